// UCX implementation of TransferEngine. Design notes (why puts, why a flush before each notice, how
// deadlines cancel requests) are in docs/transfer.md.
#include "kvstore/transfer/transfer_engine.hpp"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include <ucp/api/ucp.h>

#include "kvstore/transfer/checksum.hpp"
#include "kvstore/transfer/fault_injection.hpp"
#include "kvstore/transfer/wire.hpp"

namespace deltaserve::kvstore::transfer {
namespace {

using Clock = std::chrono::steady_clock;

constexpr unsigned kAmId = 0x5D5;                          // every control message travels on this active-message id
constexpr auto kSendDrainGrace = std::chrono::seconds(1);  // see Transfer::drain_deadline
constexpr auto kShutdownWait = std::chrono::seconds(2);
constexpr size_t kRkeyCacheEntries = 256;  // unpacked rkeys kept (LRU among unused ones)

Status ucx_status(StatusCode code, const std::string& what, ucs_status_t status) {
  return Status(code, what + ": " + ucs_status_string(status));
}

StatusCode code_from_wire(uint32_t code) {
  if (code == 0 || code > static_cast<uint32_t>(StatusCode::kCancelled)) return StatusCode::kUnavailable;
  return static_cast<StatusCode>(code);
}

std::string blob_text(const std::vector<std::byte>& blob) {
  return std::string(reinterpret_cast<const char*>(blob.data()), blob.size());
}

std::vector<std::byte> text_blob(const std::string& text) {
  const auto* p = reinterpret_cast<const std::byte*>(text.data());
  return std::vector<std::byte>(p, p + std::min<size_t>(text.size(), 1024));
}

class UcxEngine;

// One endpoint to one remote worker, shared by every transfer with that worker.
struct Peer : std::enable_shared_from_this<Peer> {
  UcxEngine* engine = nullptr;
  uint64_t serial = 0;  // unique per engine, never reused (keys the rkey cache)
  std::string address;
  ucp_ep_h ep = nullptr;
  Status failure;  // set by the error handler (or a local decision); the endpoint is then closed
  bool failure_handled = false;
};

enum class Role { kReceive, kSend };
enum class OpKind { kPut, kFlush, kMessage, kClose };

// The user_data of one UCX request.
struct Op {
  UcxEngine* engine = nullptr;
  OpKind kind = OpKind::kPut;
  TransferId transfer = 0;  // 0: the engine's own (control messages, closes)
  uint32_t seq = 0;         // kFlush: the piece whose puts it completes
  uint64_t bytes = 0;
  uint64_t checksum = 0;
  std::vector<std::byte> buffer;  // kMessage payload; kPut fault byte
  bool counted = false;           // counted in the in-flight figures (UCX returned a request)
  Peer* peer = nullptr;           // the endpoint it was issued on (compared, never dereferenced)
  std::shared_ptr<Peer> target;   // kClose: the peer being closed
  bool orphaned = false;          // its endpoint was closed without completing it (see close_endpoint)
  void* request = nullptr;        // the UCX request while counted
  bool request_released = false;  // ucp_request_free already called (engine shutdown)
};

// An unpacked remote key, shared by the transfers to one peer that name the same packed rkey (a decode
// worker's page pool stays registered, so its rkey repeats). Unpacking over shared memory maps the
// peer's segment, and first touches of a fresh mapping page-fault: caching keeps one mapping warm.
struct CachedRkey {
  ucp_rkey_h rkey = nullptr;
  int64_t uses = 0;        // transfers holding it
  bool stale = false;      // its peer failed: destroyed at the last release
  uint64_t last_used = 0;  // LRU among unused entries
};
using RkeyKey = std::pair<uint64_t, std::string>;  // peer serial, packed rkey

struct QueuedPiece {
  uint32_t seq = 0;
  std::vector<std::span<const std::byte>> sources;
  std::optional<uint64_t> checksum;
};

struct DelayedNotice {
  Clock::time_point due;
  Message message;
};

struct Transfer {
  TransferId id = 0;
  Role role = Role::kReceive;
  uint64_t token = 0;
  uint32_t deadline_ms = 0;
  Clock::time_point deadline;
  bool decided = false;
  Status status;
  bool finalized = false;
  int64_t in_flight = 0;
  DoneCallback on_done;
  std::shared_ptr<Peer> peer;  // receive: the sender (known after kBegin/kFinish); send: the receiver
  uint32_t num_pieces = 0;
  std::vector<uint8_t> piece_done;  // receive: verified; send: passed to send_piece
  uint32_t pieces_done = 0;

  // Receive side.
  std::vector<std::vector<LocalSegment>> local_pieces;
  std::vector<RegionId> regions_used;  // distinct; each holds one use
  bool finish_seen = false;
  Clock::time_point grace_end;

  // Send side.
  TransferId remote_id = 0;
  std::vector<std::vector<Segment>> remote_pieces;
  std::vector<uint64_t> remote_bases;
  std::vector<ucp_rkey_h> rkeys;   // [region]
  std::vector<RkeyKey> rkey_keys;  // cache entries this transfer holds a use of
  uint32_t notices_sent = 0;       // includes pieces dropped by fault injection
  bool finish_requested = false;
  bool finish_sent = false;
  Clock::time_point drain_deadline;  // decided with requests in flight: force-close the endpoint then
  std::vector<DelayedNotice> delayed;
  std::vector<QueuedPiece> queued;  // passed to send_piece before kAccept
  // The receiver answered kBegin. Puts are posted only after: UCX 1.13 keeps RMA requests posted
  // before the endpoint's wire-up reply in a pending queue that a force close neither cancels nor
  // drops (it replays them later), so a put posted to a peer that never answers could read user memory
  // and use a destroyed rkey after its transfer failed. The receiver answers wire-up before it handles
  // kBegin, and both answers reach this worker in order, so after kAccept the endpoint is wired up and
  // puts over shared memory complete locally. Until then send_piece queues.
  bool accepted = false;
};

struct Region {
  ucp_mem_h memh = nullptr;
  std::byte* base = nullptr;
  uint64_t bytes = 0;
  int64_t uses = 0;
  std::vector<std::byte> rkey;
};

class UcxEngine final : public TransferEngine {
 public:
  explicit UcxEngine(EngineConfig config) : config_(std::move(config)) {}
  ~UcxEngine() override;

  Status init();

  std::vector<std::byte> worker_address() const override { return address_; }
  MemoryInfo memory_info() const override { return memory_info_; }
  Result<RegionId> allocate_region(uint64_t bytes) override;
  Result<RegionId> register_region(void* address, uint64_t bytes) override;
  std::span<std::byte> region_data(RegionId region) override;
  Result<std::vector<std::byte>> packed_rkey(RegionId region) const override;
  Status release_region(RegionId region) override;
  Result<ExpectedTransfer> expect(ReceiveSpec spec) override;
  std::optional<uint32_t> pieces_verified(TransferId id) const override;
  Result<TransferId> start_send(std::span<const std::byte> descriptor, DoneCallback on_done) override;
  Status send_piece(TransferId id, uint32_t seq, std::span<const std::span<const std::byte>> sources,
                    std::optional<uint64_t> checksum) override;
  Status finish_send(TransferId id) override;
  void abort(TransferId id, Status reason) override;
  int progress() override;
  std::optional<Status> try_take(TransferId id) override;
  Status wait(TransferId id) override;
  EngineStats stats() const override;

  // UCX callbacks (trampolines below); run inside ucp_worker_progress, under mu_.
  void complete_op(Op* op, ucs_status_t status);
  void on_message(const void* data, size_t length);
  void on_peer_error() { peers_failed_ = true; }  // the failure itself is recorded in the Peer

 private:
  Result<RegionId> map_region(void* address, uint64_t bytes);
  Result<std::shared_ptr<Peer>> connect(const std::string& address);
  void close_endpoint(Peer& peer, bool force);
  void orphan_requests_of(const Peer* peer);
  bool has_outstanding(const Peer& peer) const;
  void issue_queued_pieces();
  bool issue_piece_direct(Transfer& t, uint32_t seq, std::span<const std::span<const std::byte>> sources,
                          std::optional<uint64_t> checksum);
  void issue_piece(Transfer& t, uint32_t seq, std::span<const std::span<const std::byte>> sources,
                   std::optional<uint64_t> checksum);
  Result<ucp_rkey_h> acquire_rkey(Peer& peer, const RkeyKey& key);
  void release_rkey(const RkeyKey& key);
  void purge_rkeys_of(const Peer& peer);
  void submit(ucs_status_ptr_t request, Op* op);
  void send_message(const std::shared_ptr<Peer>& peer, const Message& message);
  Message message_for(const Transfer& t, MessageKind kind) const;
  ucp_mem_h memh_containing(const std::byte* p, uint64_t bytes) const;
  const Fault* fault(FaultPoint point, uint32_t seq) const;

  int progress_locked();
  void handle_message(const Message& m);
  void handle_failed_peers();
  void fail_peer(const std::shared_ptr<Peer>& peer, Status reason);
  void emit_notice(Transfer& t, uint32_t seq, uint64_t bytes, uint64_t checksum);
  void maybe_send_finish(Transfer& t);
  void verify_piece(Transfer& t, const Message& m);
  void decide(Transfer& t, Status status, bool notify_peer);
  void check_timers();
  int finalize_finished();
  void finalize(Transfer& t);
  Transfer* find(TransferId id);
  const Transfer* find(TransferId id) const;

  EngineConfig config_;
  std::vector<Fault> faults_;
  mutable std::recursive_mutex mu_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::vector<std::byte> address_;
  MemoryInfo memory_info_;
  std::map<RegionId, Region> regions_;
  RegionId next_region_ = 1;
  std::map<std::string, std::shared_ptr<Peer>> peers_;
  std::map<TransferId, Transfer> transfers_;
  std::unordered_map<uint64_t, TransferId> send_by_token_;
  TransferId next_transfer_ = 1;
  std::mt19937_64 token_rng_;
  std::vector<std::vector<std::byte>> inbox_;  // control messages received, handled after the progress call
  bool peers_failed_ = false;
  bool pieces_queued_ = false;
  bool shutting_down_ = false;
  int64_t requests_in_flight_ = 0;
  std::map<RkeyKey, CachedRkey> rkey_cache_;
  uint64_t rkey_clock_ = 0;
  uint64_t next_peer_serial_ = 1;
  int64_t endpoints_ = 0;
  uint64_t bytes_sent_ = 0;
  uint64_t bytes_received_ = 0;
  uint64_t pieces_rejected_ = 0;
  uint64_t messages_ignored_ = 0;
  std::atomic<bool> stop_{false};
  std::thread progress_thread_;
  std::unordered_set<Op*> outstanding_;  // ops whose UCX request has not completed (orphans included)
  uint64_t requests_orphaned_ = 0;
};

Op* new_op(UcxEngine* engine, OpKind kind, TransferId transfer = 0, uint32_t seq = 0) {
  auto* op = new Op;
  op->engine = engine;
  op->kind = kind;
  op->transfer = transfer;
  op->seq = seq;
  return op;
}

void on_request_done(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<Op*>(user_data);
  const bool released = op->request_released;
  op->engine->complete_op(op, status);  // deletes op
  if (!released) ucp_request_free(request);
}

ucs_status_t on_am(void* arg, const void* /*header*/, size_t /*header_length*/, void* data, size_t length,
                   const ucp_am_recv_param_t* param) {
  auto* engine = static_cast<UcxEngine*>(arg);
  // Control messages are small and sent eagerly; a rendezvous one is not ours (dropped by returning OK).
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    engine->on_message(nullptr, 0);
    return UCS_OK;
  }
  engine->on_message(data, length);
  return UCS_OK;
}

void on_endpoint_error(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* peer = static_cast<Peer*>(arg);
  if (peer->failure.is_ok()) peer->failure = ucx_status(StatusCode::kUnavailable, "peer endpoint failed", status);
  peer->engine->on_peer_error();  // handled in progress(), outside UCX's callback
}

// ---- lifetime --------------------------------------------------------------------------------------

Status UcxEngine::init() {
  DS_ASSIGN_OR_RETURN(faults_, parse_faults(config_.faults));
  token_rng_.seed(std::random_device{}() ^ static_cast<uint64_t>(Clock::now().time_since_epoch().count()));

  ucp_config_t* ucp_config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &ucp_config);
  if (s != UCS_OK) return ucx_status(StatusCode::kUnavailable, "ucp_config_read", s);
  if (!config_.tls.empty() && (s = ucp_config_modify(ucp_config, "TLS", config_.tls.c_str())) != UCS_OK) {
    ucp_config_release(ucp_config);
    return ucx_status(StatusCode::kInvalidArgument, "UCX TLS '" + config_.tls + "'", s);
  }
  if (!config_.net_devices.empty() &&
      (s = ucp_config_modify(ucp_config, "NET_DEVICES", config_.net_devices.c_str())) != UCS_OK) {
    ucp_config_release(ucp_config);
    return ucx_status(StatusCode::kInvalidArgument, "UCX NET_DEVICES '" + config_.net_devices + "'", s);
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM;
  s = ucp_init(&params, ucp_config, &context_);
  ucp_config_release(ucp_config);
  if (s != UCS_OK) return ucx_status(StatusCode::kUnavailable, "ucp_init", s);

  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(context_, &attr) == UCS_OK) {
    memory_info_.memory_type_mask = attr.memory_types;
    memory_info_.host = attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_HOST);
    memory_info_.cuda = attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA);
    memory_info_.cuda_managed = attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA_MANAGED);
  }
  memory_info_.transports = config_.tls;

  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // every call is under mu_
  if ((s = ucp_worker_create(context_, &worker_params, &worker_)) != UCS_OK) {
    return ucx_status(StatusCode::kUnavailable, "ucp_worker_create", s);
  }
  ucp_address_t* address = nullptr;
  size_t address_length = 0;
  if ((s = ucp_worker_get_address(worker_, &address, &address_length)) != UCS_OK) {
    return ucx_status(StatusCode::kUnavailable, "ucp_worker_get_address", s);
  }
  const auto* a = reinterpret_cast<const std::byte*>(address);
  address_.assign(a, a + address_length);
  ucp_worker_release_address(worker_, address);

  ucp_am_handler_param_t handler{};
  handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                       UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  handler.id = kAmId;
  handler.flags = UCP_AM_FLAG_WHOLE_MSG;
  handler.cb = on_am;
  handler.arg = this;
  if ((s = ucp_worker_set_am_recv_handler(worker_, &handler)) != UCS_OK) {
    return ucx_status(StatusCode::kUnavailable, "ucp_worker_set_am_recv_handler", s);
  }
  if (config_.progress_thread) {
    progress_thread_ = std::thread([this] {
      while (!stop_.load(std::memory_order_relaxed)) {
        if (progress() == 0) std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    });
  }
  return Status::ok();
}

UcxEngine::~UcxEngine() {
  stop_ = true;
  if (progress_thread_.joinable()) progress_thread_.join();
  std::lock_guard lock(mu_);
  if (worker_ != nullptr) {
    for (auto& [id, t] : transfers_) {
      t.on_done = nullptr;  // the owner of the callbacks may be gone already
      if (!t.decided) decide(t, Status(StatusCode::kCancelled, "transfer engine shut down"), true);
      if (t.role == Role::kSend && t.in_flight > 0) t.drain_deadline = Clock::now();
    }
    // Let aborts, results and cancellations go out, then close every endpoint.
    const auto until = Clock::now() + kShutdownWait;
    while (Clock::now() < until && requests_in_flight_ > 0) progress_locked();
    for (auto& [address, peer] : peers_) close_endpoint(*peer, config_.detect_peer_failure);
    while (Clock::now() < until && requests_in_flight_ > 0) progress_locked();
    for (auto& [id, t] : transfers_) {
      t.rkeys.clear();
    }
    for (auto& [key, cached] : rkey_cache_) ucp_rkey_destroy(cached.rkey);
    rkey_cache_.clear();
    for (auto& [id, region] : regions_) ucp_mem_unmap(context_, region.memh);
    // Requests still outstanding (a peer that never answered): hand them back to UCX, which must hold
    // no unreleased request at ucp_worker_destroy; callbacks that still come only free their Op.
    shutting_down_ = true;
    for (Op* op : outstanding_) {
      op->request_released = true;
      ucp_request_free(op->request);
    }
    ucp_worker_destroy(worker_);
    for (Op* op : outstanding_) delete op;
  }
  if (context_ != nullptr) ucp_cleanup(context_);
}

// ---- regions ---------------------------------------------------------------------------------------

Result<RegionId> UcxEngine::map_region(void* address, uint64_t bytes) {
  if (bytes == 0) return invalid_argument("region of 0 bytes");
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = address;
  params.length = bytes;
  if (address == nullptr) {
    params.field_mask |= UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    params.flags = UCP_MEM_MAP_ALLOCATE;
  }
  Region region;
  ucs_status_t s = ucp_mem_map(context_, &params, &region.memh);
  if (s != UCS_OK) {
    return ucx_status(StatusCode::kResourceExhausted, "ucp_mem_map of " + std::to_string(bytes) + " bytes", s);
  }
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  if ((s = ucp_mem_query(region.memh, &attr)) != UCS_OK) {
    ucp_mem_unmap(context_, region.memh);
    return ucx_status(StatusCode::kInternal, "ucp_mem_query", s);
  }
  region.base = static_cast<std::byte*>(attr.address);
  region.bytes = bytes;
  void* rkey = nullptr;
  size_t rkey_size = 0;
  if ((s = ucp_rkey_pack(context_, region.memh, &rkey, &rkey_size)) != UCS_OK) {
    ucp_mem_unmap(context_, region.memh);
    return ucx_status(StatusCode::kInternal, "ucp_rkey_pack", s);
  }
  const auto* r = static_cast<const std::byte*>(rkey);
  region.rkey.assign(r, r + rkey_size);
  ucp_rkey_buffer_release(rkey);
  const RegionId id = next_region_++;
  regions_.emplace(id, std::move(region));
  return id;
}

Result<RegionId> UcxEngine::allocate_region(uint64_t bytes) {
  std::lock_guard lock(mu_);
  return map_region(nullptr, bytes);
}

Result<RegionId> UcxEngine::register_region(void* address, uint64_t bytes) {
  if (address == nullptr) return invalid_argument("register_region: null address");
  std::lock_guard lock(mu_);
  return map_region(address, bytes);
}

std::span<std::byte> UcxEngine::region_data(RegionId region) {
  std::lock_guard lock(mu_);
  auto it = regions_.find(region);
  if (it == regions_.end()) return {};
  return {it->second.base, it->second.bytes};
}

Result<std::vector<std::byte>> UcxEngine::packed_rkey(RegionId region) const {
  std::lock_guard lock(mu_);
  auto it = regions_.find(region);
  if (it == regions_.end()) return not_found("region " + std::to_string(region));
  return it->second.rkey;
}

Status UcxEngine::release_region(RegionId region) {
  std::lock_guard lock(mu_);
  auto it = regions_.find(region);
  if (it == regions_.end()) return not_found("region " + std::to_string(region));
  if (it->second.uses > 0) {
    return failed_precondition("region " + std::to_string(region) + " is used by " + std::to_string(it->second.uses) +
                               " transfer(s)");
  }
  ucp_mem_unmap(context_, it->second.memh);
  regions_.erase(it);
  return Status::ok();
}

ucp_mem_h UcxEngine::memh_containing(const std::byte* p, uint64_t bytes) const {
  for (const auto& [id, region] : regions_) {
    if (p >= region.base && bytes <= region.bytes && p - region.base <= static_cast<ptrdiff_t>(region.bytes - bytes)) {
      return region.memh;
    }
  }
  return nullptr;
}

// ---- endpoints and requests ------------------------------------------------------------------------

Result<std::shared_ptr<Peer>> UcxEngine::connect(const std::string& address) {
  handle_failed_peers();  // a failed peer leaves the map only after its transfers were failed
  auto it = peers_.find(address);
  if (it != peers_.end() && it->second->failure.is_ok()) return it->second;
  auto peer = std::make_shared<Peer>();
  peer->engine = this;
  peer->serial = next_peer_serial_++;
  peer->address = address;
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.address = reinterpret_cast<const ucp_address_t*>(address.data());
  params.err_mode = config_.detect_peer_failure ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  if (config_.detect_peer_failure) {
    params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.err_handler.cb = on_endpoint_error;
    params.err_handler.arg = peer.get();
  }
  const ucs_status_t s = ucp_ep_create(worker_, &params, &peer->ep);
  if (s != UCS_OK) return ucx_status(StatusCode::kUnavailable, "ucp_ep_create", s);
  ++endpoints_;
  peers_[address] = peer;
  return peer;
}

void UcxEngine::close_endpoint(Peer& peer, bool force) {
  if (peer.ep == nullptr) return;
  auto* op = new_op(this, OpKind::kClose);
  op->target = peer.shared_from_this();
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = on_request_done;
  param.user_data = op;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucp_ep_h ep = peer.ep;
  peer.ep = nullptr;
  submit(ucp_ep_close_nbx(ep, &param), op);
}

void UcxEngine::submit(ucs_status_ptr_t request, Op* op) {
  if (request == nullptr) return complete_op(op, UCS_OK);
  if (UCS_PTR_IS_ERR(request)) return complete_op(op, UCS_PTR_STATUS(request));
  op->counted = true;
  op->request = request;
  outstanding_.insert(op);
  ++requests_in_flight_;
  if (Transfer* t = find(op->transfer)) ++t->in_flight;
}

Result<ucp_rkey_h> UcxEngine::acquire_rkey(Peer& peer, const RkeyKey& key) {
  auto it = rkey_cache_.find(key);
  if (it == rkey_cache_.end()) {
    ucp_rkey_h rkey = nullptr;
    const ucs_status_t s = ucp_ep_rkey_unpack(peer.ep, key.second.data(), &rkey);
    if (s != UCS_OK) return ucx_status(StatusCode::kInvalidArgument, "ucp_ep_rkey_unpack", s);
    it = rkey_cache_.emplace(key, CachedRkey{.rkey = rkey}).first;
    if (rkey_cache_.size() > kRkeyCacheEntries) {  // evict the least recently used unused entry
      auto victim = rkey_cache_.end();
      for (auto c = rkey_cache_.begin(); c != rkey_cache_.end(); ++c) {
        if (c->second.uses == 0 && c != it &&
            (victim == rkey_cache_.end() || c->second.last_used < victim->second.last_used)) {
          victim = c;
        }
      }
      if (victim != rkey_cache_.end()) {
        ucp_rkey_destroy(victim->second.rkey);
        rkey_cache_.erase(victim);
      }
    }
  }
  ++it->second.uses;
  it->second.last_used = ++rkey_clock_;
  return it->second.rkey;
}

void UcxEngine::release_rkey(const RkeyKey& key) {
  auto it = rkey_cache_.find(key);
  if (it == rkey_cache_.end()) return;
  if (--it->second.uses == 0 && it->second.stale) {
    ucp_rkey_destroy(it->second.rkey);
    rkey_cache_.erase(it);
  }
}

void UcxEngine::purge_rkeys_of(const Peer& peer) {
  for (auto it = rkey_cache_.lower_bound({peer.serial, std::string()});
       it != rkey_cache_.end() && it->first.first == peer.serial;) {
    if (it->second.uses == 0) {
      ucp_rkey_destroy(it->second.rkey);
      it = rkey_cache_.erase(it);
    } else {
      it->second.stale = true;
      ++it;
    }
  }
}

// UCX 1.13 does not complete requests that were still waiting for the endpoint's wire-up (peer never
// answered) when the endpoint is force-closed. Control requests (messages, flushes) reference only
// memory this engine owns: stop counting them so their transfers finish, and keep their Op until UCX
// calls back or the worker is destroyed. Puts are not orphaned (and are posted only after wire-up).
bool UcxEngine::has_outstanding(const Peer& peer) const {
  for (const Op* op : outstanding_) {
    if (op->peer == &peer && !op->orphaned) return true;
  }
  return false;
}

void UcxEngine::orphan_requests_of(const Peer* peer) {
  for (Op* op : outstanding_) {
    // Puts are never orphaned: they may still read user memory (and use an rkey) when replayed.
    if (op->peer != peer || op->orphaned || op->kind == OpKind::kPut) continue;
    op->orphaned = true;
    --requests_in_flight_;
    if (Transfer* t = find(op->transfer)) --t->in_flight;
    ++requests_orphaned_;
  }
}

void UcxEngine::complete_op(Op* op, ucs_status_t status) {
  std::unique_ptr<Op> owned(op);
  if (shutting_down_) {
    outstanding_.erase(op);
    return;
  }
  Transfer* t = find(op->transfer);
  if (op->counted) outstanding_.erase(op);
  if (op->orphaned) return;  // already uncounted when its endpoint was closed
  if (op->counted) {
    --requests_in_flight_;
    if (t != nullptr) --t->in_flight;
  }
  switch (op->kind) {
    case OpKind::kClose:
      --endpoints_;
      orphan_requests_of(op->target.get());
      return;
    case OpKind::kMessage:
      return;  // a lost control message shows up as the peer's deadline
    case OpKind::kPut:
      if (status != UCS_OK && t != nullptr && !t->decided) {
        decide(*t, ucx_status(StatusCode::kUnavailable, "put of piece " + std::to_string(op->seq), status), true);
      }
      return;
    case OpKind::kFlush:
      if (t == nullptr || t->decided) return;
      if (status != UCS_OK) {
        decide(*t, ucx_status(StatusCode::kUnavailable, "flush of piece " + std::to_string(op->seq), status), true);
        return;
      }
      emit_notice(*t, op->seq, op->bytes, op->checksum);
      return;
  }
}

void UcxEngine::send_message(const std::shared_ptr<Peer>& peer, const Message& message) {
  if (!peer || peer->ep == nullptr || !peer->failure.is_ok()) return;
  auto* op = new_op(this, OpKind::kMessage);
  op->peer = peer.get();
  op->buffer = encode_message(message);
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = on_request_done;
  param.user_data = op;
  param.flags = UCP_AM_SEND_FLAG_EAGER;
  submit(ucp_am_send_nbx(peer->ep, kAmId, nullptr, 0, op->buffer.data(), op->buffer.size(), &param), op);
}

Message UcxEngine::message_for(const Transfer& t, MessageKind kind) const {
  Message m;
  m.kind = kind;
  m.transfer_id = t.role == Role::kSend ? t.remote_id : t.id;
  m.token = t.token;
  return m;
}

void UcxEngine::on_message(const void* data, size_t length) {
  if (data == nullptr) {
    ++messages_ignored_;
    return;
  }
  const auto* p = static_cast<const std::byte*>(data);
  inbox_.emplace_back(p, p + length);
}

const Fault* UcxEngine::fault(FaultPoint point, uint32_t seq) const {
  if constexpr (!kFaultInjectionCompiled) return nullptr;
  for (const Fault& f : faults_) {
    if (f.point == point && f.piece == seq) return &f;
  }
  return nullptr;
}

Transfer* UcxEngine::find(TransferId id) {
  auto it = transfers_.find(id);
  return it == transfers_.end() ? nullptr : &it->second;
}

const Transfer* UcxEngine::find(TransferId id) const {
  auto it = transfers_.find(id);
  return it == transfers_.end() ? nullptr : &it->second;
}

// ---- receiver --------------------------------------------------------------------------------------

Result<ExpectedTransfer> UcxEngine::expect(ReceiveSpec spec) {
  std::lock_guard lock(mu_);
  if (spec.pieces.empty() || spec.pieces.size() > kMaxPieces) {
    return invalid_argument("expect: piece count " + std::to_string(spec.pieces.size()));
  }
  if (spec.deadline.count() <= 0 || spec.deadline.count() > UINT32_MAX) {
    return invalid_argument("expect: deadline must be in (0, 2^32) ms");
  }
  Descriptor d;
  std::map<RegionId, uint32_t> region_index;
  Transfer t;
  for (size_t p = 0; p < spec.pieces.size(); ++p) {
    if (spec.pieces[p].empty()) return invalid_argument("expect: piece " + std::to_string(p) + " has no segments");
    std::vector<Segment> remote;
    for (const LocalSegment& s : spec.pieces[p]) {
      auto it = regions_.find(s.region);
      if (it == regions_.end())
        return not_found("expect: piece " + std::to_string(p) + ": region " + std::to_string(s.region));
      if (s.bytes == 0 || s.offset > it->second.bytes || s.bytes > it->second.bytes - s.offset) {
        return invalid_argument("expect: piece " + std::to_string(p) + ": segment outside region " +
                                std::to_string(s.region));
      }
      auto [index, added] = region_index.emplace(s.region, static_cast<uint32_t>(d.regions.size()));
      if (added) {
        d.regions.push_back({reinterpret_cast<uint64_t>(it->second.base), it->second.bytes, it->second.rkey});
        t.regions_used.push_back(s.region);
      }
      remote.push_back({index->second, s.offset, s.bytes});
    }
    d.pieces.push_back(std::move(remote));
  }
  t.id = next_transfer_++;
  t.role = Role::kReceive;
  t.token = token_rng_();
  t.deadline_ms = static_cast<uint32_t>(spec.deadline.count());
  t.deadline = Clock::now() + spec.deadline;
  t.on_done = std::move(spec.on_done);
  t.num_pieces = static_cast<uint32_t>(spec.pieces.size());
  t.piece_done.assign(t.num_pieces, 0);
  t.local_pieces = std::move(spec.pieces);
  for (RegionId r : t.regions_used) ++regions_[r].uses;
  d.transfer_id = t.id;
  d.token = t.token;
  d.deadline_ms = t.deadline_ms;
  d.receiver_address = address_;
  ExpectedTransfer out{t.id, encode_descriptor(d)};
  transfers_.emplace(t.id, std::move(t));
  return out;
}

std::optional<uint32_t> UcxEngine::pieces_verified(TransferId id) const {
  std::lock_guard lock(mu_);
  const Transfer* t = find(id);
  if (t == nullptr) return std::nullopt;
  return t->pieces_done;
}

void UcxEngine::verify_piece(Transfer& t, const Message& m) {
  const std::string piece = "piece " + std::to_string(m.seq);
  if (m.seq >= t.num_pieces)
    return decide(t, data_loss(piece + " out of range (" + std::to_string(t.num_pieces) + " pieces)"), true);
  uint64_t expected_bytes = 0;
  for (const LocalSegment& s : t.local_pieces[m.seq]) expected_bytes += s.bytes;
  if (m.bytes != expected_bytes) {
    ++pieces_rejected_;
    return decide(t,
                  data_loss(piece + ": announced " + std::to_string(m.bytes) + " bytes, expected " +
                            std::to_string(expected_bytes)),
                  true);
  }
  if (t.piece_done[m.seq]) {
    ++messages_ignored_;  // duplicate notice
    return;
  }
  Checksum64 checksum;
  for (const LocalSegment& s : t.local_pieces[m.seq]) {
    checksum.update({regions_[s.region].base + s.offset, s.bytes});
  }
  const uint64_t received = checksum.finish();
  if (received != m.checksum) {
    ++pieces_rejected_;
    char text[96];
    std::snprintf(text, sizeof text, ": checksum mismatch (sent %016llx, received %016llx)",
                  static_cast<unsigned long long>(m.checksum), static_cast<unsigned long long>(received));
    return decide(t, data_loss(piece + text), true);
  }
  t.piece_done[m.seq] = 1;
  ++t.pieces_done;
  bytes_received_ += m.bytes;
  if (t.finish_seen && t.pieces_done == t.num_pieces) decide(t, Status::ok(), true);
}

void UcxEngine::handle_message(const Message& m) {
  if (m.kind == MessageKind::kAccept) {
    auto it = send_by_token_.find(m.token);
    Transfer* t = it == send_by_token_.end() ? nullptr : find(it->second);
    if (t == nullptr || t->remote_id != m.transfer_id || t->decided || t->accepted) {
      ++messages_ignored_;
      return;
    }
    t->accepted = true;
    pieces_queued_ = true;
    return;
  }
  if (m.kind == MessageKind::kResult) {
    auto it = send_by_token_.find(m.token);
    Transfer* t = it == send_by_token_.end() ? nullptr : find(it->second);
    if (t == nullptr || t->remote_id != m.transfer_id || t->decided) {
      ++messages_ignored_;
      return;
    }
    if (m.seq == 0) {
      decide(*t, Status::ok(), false);
    } else {
      decide(*t, Status(code_from_wire(m.seq), "receiver: " + blob_text(m.blob)), false);
    }
    return;
  }
  Transfer* t = find(m.transfer_id);
  if (t == nullptr || t->role != Role::kReceive || t->token != m.token || t->decided) {
    ++messages_ignored_;
    return;
  }
  if ((m.kind == MessageKind::kBegin || m.kind == MessageKind::kFinish) && !t->peer && !m.blob.empty()) {
    auto peer = connect(blob_text(m.blob));
    if (peer.is_ok()) t->peer = std::move(peer).value();
  }
  switch (m.kind) {
    case MessageKind::kBegin:
      send_message(t->peer, message_for(*t, MessageKind::kAccept));
      return;
    case MessageKind::kPiece:
      return verify_piece(*t, m);
    case MessageKind::kFinish:
      if (m.seq != t->num_pieces) {
        return decide(*t,
                      data_loss("sender finished after " + std::to_string(m.seq) + " pieces, expected " +
                                std::to_string(t->num_pieces)),
                      true);
      }
      if (t->pieces_done == t->num_pieces) return decide(*t, Status::ok(), true);
      t->finish_seen = true;
      t->grace_end = std::min(t->deadline, Clock::now() + config_.finish_grace);
      return;
    case MessageKind::kAbort:
      return decide(*t, Status(code_from_wire(m.seq), "sender aborted: " + blob_text(m.blob)), false);
    case MessageKind::kResult:
    case MessageKind::kAccept:
      return;
  }
}

// ---- sender ----------------------------------------------------------------------------------------

Result<TransferId> UcxEngine::start_send(std::span<const std::byte> bytes, DoneCallback on_done) {
  DS_ASSIGN_OR_RETURN(Descriptor d, decode_descriptor(bytes));
  std::lock_guard lock(mu_);
  if (send_by_token_.contains(d.token)) return failed_precondition("start_send: transfer already started");
  DS_ASSIGN_OR_RETURN_CTX(std::shared_ptr<Peer> peer, connect(blob_text(d.receiver_address)), "start_send");
  Transfer t;
  for (size_t i = 0; i < d.regions.size(); ++i) {
    RkeyKey key{peer->serial, blob_text(d.regions[i].rkey)};
    auto cached = acquire_rkey(*peer, key);
    if (!cached.is_ok()) {
      for (const RkeyKey& k : t.rkey_keys) release_rkey(k);
      return cached.status().with_context("start_send: rkey of region " + std::to_string(i));
    }
    t.rkeys.push_back(*cached);
    t.rkey_keys.push_back(std::move(key));
    t.remote_bases.push_back(d.regions[i].base);
  }
  t.id = next_transfer_++;
  t.role = Role::kSend;
  t.token = d.token;
  t.remote_id = d.transfer_id;
  t.deadline_ms = d.deadline_ms;
  t.deadline = Clock::now() + std::chrono::milliseconds(d.deadline_ms);
  t.on_done = std::move(on_done);
  t.peer = peer;
  t.num_pieces = static_cast<uint32_t>(d.pieces.size());
  t.piece_done.assign(t.num_pieces, 0);
  t.remote_pieces = std::move(d.pieces);
  const TransferId id = t.id;
  send_by_token_[t.token] = id;
  Message begin = message_for(t, MessageKind::kBegin);
  begin.blob = address_;
  transfers_.emplace(id, std::move(t));
  send_message(peer, begin);
  return id;
}

Status UcxEngine::send_piece(TransferId id, uint32_t seq, std::span<const std::span<const std::byte>> sources,
                             std::optional<uint64_t> checksum) {
  std::lock_guard lock(mu_);
  Transfer* t = find(id);
  if (t == nullptr || t->role != Role::kSend) return not_found("send_piece: no send transfer " + std::to_string(id));
  if (t->decided) return t->status.is_ok() ? failed_precondition("send_piece: transfer already complete") : t->status;
  const std::string piece = "send_piece " + std::to_string(seq);
  if (seq >= t->num_pieces)
    return invalid_argument(piece + ": out of range (" + std::to_string(t->num_pieces) + " pieces)");
  if (t->piece_done[seq]) return failed_precondition(piece + ": already sent");
  const uint64_t bytes = piece_bytes(t->remote_pieces[seq]);
  uint64_t source_bytes = 0;
  for (const auto& s : sources) source_bytes += s.size();
  if (source_bytes != bytes) {
    return invalid_argument(piece + ": sources hold " + std::to_string(source_bytes) + " bytes, the piece " +
                            std::to_string(bytes));
  }
  t->piece_done[seq] = 1;
  ++t->pieces_done;
  if (fault(FaultPoint::kKillEndpoint, seq) != nullptr) {
    fail_peer(t->peer, Status(StatusCode::kUnavailable, "fault send.kill_endpoint at piece " + std::to_string(seq)));
    return t->status;
  }
  if (fault(FaultPoint::kDropPiece, seq) != nullptr) {
    ++t->notices_sent;  // the notice is "sent" and lost
    maybe_send_finish(*t);
    return Status::ok();
  }
  if (!t->accepted) {  // puts wait for the receiver's kAccept: see Transfer::accepted
    t->queued.push_back({seq, {sources.begin(), sources.end()}, checksum});
    return Status::ok();
  }
  issue_piece(*t, seq, sources, checksum);
  return t->decided && !t->status.is_ok() ? t->status : Status::ok();
}

void UcxEngine::issue_queued_pieces() {
  for (auto& [id, t] : transfers_) {
    if (t.queued.empty() || t.decided || !t.accepted) continue;
    std::vector<QueuedPiece> queued;
    queued.swap(t.queued);
    for (const QueuedPiece& q : queued) {
      if (t.decided) break;
      issue_piece(t, q.seq, q.sources, q.checksum);
    }
  }
}

// Shared-memory fast path: when every destination segment is mapped into this process
// (ucp_rkey_ptr succeeds: posix/sysv/xpmem), copy with the CPU and checksum in the same pass instead
// of posting puts and reading the bytes a second time. The bytes are in place when the copy returns;
// the release fence orders them before the notice. Returns false (nothing done) otherwise.
bool UcxEngine::issue_piece_direct(Transfer& t, uint32_t seq, std::span<const std::span<const std::byte>> sources,
                                   std::optional<uint64_t> checksum) {
  const auto& segments = t.remote_pieces[seq];
  std::vector<std::byte*> destinations;
  destinations.reserve(segments.size());
  for (const Segment& segment : segments) {
    void* local = nullptr;
    if (ucp_rkey_ptr(t.rkeys[segment.region], t.remote_bases[segment.region] + segment.offset, &local) != UCS_OK) {
      return false;
    }
    destinations.push_back(static_cast<std::byte*>(local));
  }
  Checksum64 sum;
  size_t si = 0;
  uint64_t source_offset = 0;
  for (size_t k = 0; k < segments.size(); ++k) {
    std::byte* destination = destinations[k];
    uint64_t left = segments[k].bytes;
    while (left > 0) {
      while (sources[si].size() == source_offset) {
        ++si;
        source_offset = 0;
      }
      const uint64_t run = std::min<uint64_t>(left, sources[si].size() - source_offset);
      const auto source = sources[si].subspan(source_offset, run);
      if (checksum) {
        std::memcpy(destination, source.data(), run);
      } else {
        sum.copy_and_update(destination, source);
      }
      source_offset += run;
      destination += run;
      left -= run;
    }
  }
  if (fault(FaultPoint::kCorruptByte, seq) != nullptr) {
    std::byte* byte = destinations.front() + segments.front().bytes / 2;
    *byte = ~*byte;
  }
  std::atomic_thread_fence(std::memory_order_release);
  const uint64_t bytes = piece_bytes(segments);
  bytes_sent_ += bytes;
  emit_notice(t, seq, bytes, checksum ? *checksum : sum.finish());
  return true;
}

void UcxEngine::issue_piece(Transfer& transfer, uint32_t seq, std::span<const std::span<const std::byte>> sources,
                            std::optional<uint64_t> checksum) {
  Transfer* t = &transfer;
  const TransferId id = t->id;
  const uint64_t bytes = piece_bytes(t->remote_pieces[seq]);
  const std::shared_ptr<Peer> peer = t->peer;
  if (config_.direct_copy && issue_piece_direct(*t, seq, sources, checksum)) return;
  auto put = [&](const std::byte* source, uint64_t length, uint64_t remote, ucp_rkey_h rkey, Op* op) {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = on_request_done;
    param.user_data = op;
    if (ucp_mem_h memh = memh_containing(source, length)) {
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      param.memh = memh;
    }
    op->peer = peer.get();
    submit(ucp_put_nbx(peer->ep, source, length, remote, rkey, &param), op);
  };
  // Walk the destination segments and the sources together; one put per overlapping run.
  size_t si = 0;
  uint64_t source_offset = 0;
  for (const Segment& segment : t->remote_pieces[seq]) {
    uint64_t remote = t->remote_bases[segment.region] + segment.offset;
    uint64_t left = segment.bytes;
    while (left > 0) {
      while (sources[si].size() == source_offset) {
        ++si;
        source_offset = 0;
      }
      const uint64_t run = std::min<uint64_t>(left, sources[si].size() - source_offset);
      put(sources[si].data() + source_offset, run, remote, t->rkeys[segment.region],
          new_op(this, OpKind::kPut, id, seq));
      if (t->decided) return;  // an immediate put failure
      source_offset += run;
      remote += run;
      left -= run;
    }
  }
  if (!checksum) {
    Checksum64 sum;
    for (const auto& s : sources) sum.update(s);
    checksum = sum.finish();
  }
  bytes_sent_ += bytes;
  if (fault(FaultPoint::kCorruptByte, seq) != nullptr) {
    // Overwrite one byte in the middle of the first segment with its complement, after the real puts.
    const Segment& first = t->remote_pieces[seq].front();
    const uint64_t at = first.bytes / 2;
    uint64_t skip = at;
    std::byte original{};
    for (const auto& s : sources) {
      if (skip < s.size()) {
        original = s[skip];
        break;
      }
      skip -= s.size();
    }
    auto* op = new_op(this, OpKind::kPut, id, seq);
    op->buffer = {~original};
    ucp_worker_fence(worker_);
    put(op->buffer.data(), 1, t->remote_bases[first.region] + first.offset + at, t->rkeys[first.region], op);
  }
  auto* flush = new_op(this, OpKind::kFlush, id, seq);
  flush->bytes = bytes;
  flush->checksum = *checksum;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = on_request_done;
  param.user_data = flush;
  flush->peer = peer.get();
  submit(ucp_ep_flush_nbx(peer->ep, &param), flush);
}

void UcxEngine::emit_notice(Transfer& t, uint32_t seq, uint64_t bytes, uint64_t checksum) {
  Message m = message_for(t, MessageKind::kPiece);
  m.seq = seq;
  m.bytes = bytes;
  m.checksum = checksum;
  if (const Fault* f = fault(FaultPoint::kDelayPiece, seq)) {
    t.delayed.push_back({Clock::now() + std::chrono::milliseconds(f->delay_ms), std::move(m)});
    return;
  }
  send_message(t.peer, m);
  ++t.notices_sent;
  maybe_send_finish(t);
}

void UcxEngine::maybe_send_finish(Transfer& t) {
  if (t.decided || !t.finish_requested || t.finish_sent || t.notices_sent < t.num_pieces) return;
  Message m = message_for(t, MessageKind::kFinish);
  m.seq = t.num_pieces;
  m.blob = address_;
  send_message(t.peer, m);
  t.finish_sent = true;
}

Status UcxEngine::finish_send(TransferId id) {
  std::lock_guard lock(mu_);
  Transfer* t = find(id);
  if (t == nullptr || t->role != Role::kSend) return not_found("finish_send: no send transfer " + std::to_string(id));
  if (t->decided) return t->status.is_ok() ? failed_precondition("finish_send: transfer already complete") : t->status;
  if (t->pieces_done != t->num_pieces) {
    return failed_precondition("finish_send: " + std::to_string(t->pieces_done) + " of " +
                               std::to_string(t->num_pieces) + " pieces sent");
  }
  t->finish_requested = true;
  maybe_send_finish(*t);
  return Status::ok();
}

// ---- both sides ------------------------------------------------------------------------------------

void UcxEngine::decide(Transfer& t, Status status, bool notify_peer) {
  if (t.decided) return;
  t.decided = true;
  t.status = std::move(status);
  if (t.role == Role::kReceive) {
    if (t.peer) {
      Message m = message_for(t, MessageKind::kResult);
      m.seq = static_cast<uint32_t>(t.status.code());
      m.blob = text_blob(t.status.message());
      send_message(t.peer, m);
    }
    return;
  }
  if (!t.status.is_ok() && notify_peer) {
    Message m = message_for(t, MessageKind::kAbort);
    m.seq = static_cast<uint32_t>(t.status.code());
    m.blob = text_blob(t.status.message());
    send_message(t.peer, m);
  }
  t.delayed.clear();
  t.queued.clear();
  t.drain_deadline = Clock::now() + kSendDrainGrace;
}

void UcxEngine::abort(TransferId id, Status reason) {
  std::lock_guard lock(mu_);
  Transfer* t = find(id);
  if (t == nullptr || t->decided) return;
  if (reason.is_ok()) reason = Status(StatusCode::kCancelled, "aborted");
  decide(*t, std::move(reason), true);
  t->drain_deadline = Clock::now();
}

void UcxEngine::fail_peer(const std::shared_ptr<Peer>& peer, Status reason) {
  if (!peer) return;
  if (peer->failure.is_ok()) peer->failure = std::move(reason);
  peers_failed_ = true;
  handle_failed_peers();
}

void UcxEngine::handle_failed_peers() {
  if (!peers_failed_) return;
  peers_failed_ = false;
  std::vector<std::shared_ptr<Peer>> failed;
  for (auto it = peers_.begin(); it != peers_.end();) {
    if (!it->second->failure.is_ok() && !it->second->failure_handled) {
      failed.push_back(it->second);
      it = peers_.erase(it);
    } else {
      ++it;
    }
  }
  for (const auto& peer : failed) {
    peer->failure_handled = true;
    for (auto& [id, t] : transfers_) {
      if (t.peer == peer && !t.decided) decide(t, peer->failure, false);
    }
    purge_rkeys_of(*peer);
    // Force: outstanding requests on it complete now with UCS_ERR_CANCELED, so transfers can finish.
    close_endpoint(*peer, true);
  }
}

void UcxEngine::check_timers() {
  const auto now = Clock::now();
  std::vector<std::shared_ptr<Peer>> to_fail;
  for (auto& [id, t] : transfers_) {
    if (!t.decided) {
      for (auto it = t.delayed.begin(); it != t.delayed.end();) {
        if (it->due > now) {
          ++it;
          continue;
        }
        send_message(t.peer, it->message);
        ++t.notices_sent;
        it = t.delayed.erase(it);
      }
      maybe_send_finish(t);
      if (now >= t.deadline) {
        const std::string what = t.role == Role::kReceive ? " pieces verified" : " pieces sent";
        decide(t,
               Status(StatusCode::kDeadlineExceeded,
                      "transfer " + std::to_string(t.role == Role::kSend ? t.remote_id : t.id) + ": deadline of " +
                          std::to_string(t.deadline_ms) + " ms passed with " + std::to_string(t.pieces_done) + "/" +
                          std::to_string(t.num_pieces) + what),
               true);
        t.drain_deadline = now;
        // Requests still waiting on this peer at the deadline (it never completed wire-up, or stopped
        // draining): treat it as unresponsive and close its endpoint, which releases them.
        if (t.peer && t.peer->failure.is_ok() && has_outstanding(*t.peer)) to_fail.push_back(t.peer);
      } else if (t.finish_seen && now >= t.grace_end) {
        std::string missing;
        for (uint32_t i = 0, shown = 0; i < t.num_pieces && shown < 8; ++i) {
          if (!t.piece_done[i]) missing += (shown++ ? "," : "") + std::to_string(i);
        }
        decide(t, data_loss("sender finished but piece(s) " + missing + " never arrived"), true);
      }
    }
    if (t.decided && t.role == Role::kSend && t.in_flight > 0 && now >= t.drain_deadline && t.peer &&
        t.peer->failure.is_ok()) {
      to_fail.push_back(t.peer);
    }
  }
  for (const auto& peer : to_fail) {
    fail_peer(peer, Status(StatusCode::kUnavailable,
                           "peer unresponsive: endpoint closed to release requests of a failed transfer"));
  }
}

void UcxEngine::finalize(Transfer& t) {
  t.finalized = true;
  for (const RkeyKey& key : t.rkey_keys) release_rkey(key);
  t.rkey_keys.clear();
  t.rkeys.clear();
  for (RegionId r : t.regions_used) --regions_[r].uses;
  t.regions_used.clear();
  t.peer.reset();
  if (t.role == Role::kSend) send_by_token_.erase(t.token);
}

int UcxEngine::finalize_finished() {
  std::vector<std::pair<TransferId, DoneCallback>> callbacks;
  std::vector<std::pair<TransferId, Status>> statuses;
  for (auto it = transfers_.begin(); it != transfers_.end();) {
    Transfer& t = it->second;
    if (t.finalized || !t.decided || t.in_flight > 0) {
      ++it;
      continue;
    }
    finalize(t);
    if (t.on_done) {
      callbacks.emplace_back(t.id, std::move(t.on_done));
      statuses.emplace_back(t.id, t.status);
      it = transfers_.erase(it);
    } else {
      ++it;
    }
  }
  for (size_t i = 0; i < callbacks.size(); ++i) callbacks[i].second(callbacks[i].first, statuses[i].second);
  return static_cast<int>(callbacks.size());
}

int UcxEngine::progress_locked() {
  int events = 0;
  for (int i = 0; i < 64; ++i) {
    const unsigned n = ucp_worker_progress(worker_);
    events += static_cast<int>(n);
    if (n == 0) break;
  }
  handle_failed_peers();
  if (pieces_queued_) {
    pieces_queued_ = false;
    issue_queued_pieces();
  }
  while (!inbox_.empty()) {
    std::vector<std::vector<std::byte>> batch;
    batch.swap(inbox_);
    for (const auto& bytes : batch) {
      auto m = decode_message(bytes);
      if (!m.is_ok()) {
        ++messages_ignored_;
        continue;
      }
      handle_message(*m);
      ++events;
    }
  }
  if (pieces_queued_) {
    pieces_queued_ = false;
    issue_queued_pieces();
  }
  check_timers();
  handle_failed_peers();
  events += finalize_finished();
  return events;
}

int UcxEngine::progress() {
  std::lock_guard lock(mu_);
  return progress_locked();
}

std::optional<Status> UcxEngine::try_take(TransferId id) {
  std::lock_guard lock(mu_);
  auto it = transfers_.find(id);
  if (it == transfers_.end()) return not_found("transfer " + std::to_string(id));
  if (!it->second.finalized) return std::nullopt;
  Status status = std::move(it->second.status);
  transfers_.erase(it);
  return status;
}

Status UcxEngine::wait(TransferId id) {
  for (;;) {
    {
      std::lock_guard lock(mu_);
      if (!config_.progress_thread) progress_locked();
      if (auto status = try_take(id)) return *status;
    }
    if (config_.progress_thread) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    } else {
      std::this_thread::yield();  // two busy-polling processes may share a core
    }
  }
}

EngineStats UcxEngine::stats() const {
  std::lock_guard lock(mu_);
  EngineStats s;
  s.regions = static_cast<int64_t>(regions_.size());
  for (const auto& [id, region] : regions_) s.region_uses += region.uses;
  s.requests_in_flight = requests_in_flight_;
  s.rkeys = static_cast<int64_t>(rkey_cache_.size());
  for (const auto& [key, cached] : rkey_cache_) s.rkey_uses += cached.uses;
  s.endpoints = endpoints_;
  s.transfers = static_cast<int64_t>(transfers_.size());
  for (const auto& [id, t] : transfers_) s.transfers_pending += t.decided ? 0 : 1;
  s.bytes_sent = bytes_sent_;
  s.bytes_received = bytes_received_;
  s.pieces_rejected = pieces_rejected_;
  s.messages_ignored = messages_ignored_;
  s.requests_orphaned = requests_orphaned_;
  return s;
}

}  // namespace

Result<std::unique_ptr<TransferEngine>> TransferEngine::create(const EngineConfig& config) {
  auto engine = std::make_unique<UcxEngine>(config);
  DS_RETURN_IF_ERROR_CTX(engine->init(), "transfer engine");
  return std::unique_ptr<TransferEngine>(std::move(engine));
}

}  // namespace deltaserve::kvstore::transfer
