// UCX implementation of TransferEngine, part 1: lifetime, regions, endpoints, requests, the rkey
// cache, progress, deadlines and bookkeeping. The protocol of each side is in ucx_transfers.cpp.
#include "kvstore/transfer/ucx_engine.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

namespace deltaserve::kvstore::transfer {
namespace ucx_impl {

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
    for (const DeviceCheck& check : device_checks_) config_.device->cancel_checksum(check.ticket);
    device_checks_.clear();
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

Result<RegionId> UcxEngine::map_region(void* address, uint64_t bytes, bool device) {
  if (bytes == 0) return invalid_argument("region of 0 bytes");
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = address;
  params.length = bytes;
  if (device) {
    params.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    params.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
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
  region.device = device;
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
  return map_region(nullptr, bytes, false);
}

Result<RegionId> UcxEngine::register_region(void* address, uint64_t bytes) {
  if (address == nullptr) return invalid_argument("register_region: null address");
  std::lock_guard lock(mu_);
  if (config_.device && config_.device->is_device(address)) {
    return invalid_argument("register_region: GPU memory (use register_device_region)");
  }
  return map_region(address, bytes, false);
}

Result<RegionId> UcxEngine::register_device_region(void* address, uint64_t bytes) {
  if (address == nullptr) return invalid_argument("register_device_region: null address");
  if (!config_.device) return failed_precondition("register_device_region: the engine has no EngineConfig::device");
  if (!memory_info_.cuda) {
    return failed_precondition(
        "register_device_region: this UCX build cannot register CUDA memory (ucp_context_query lists no CUDA "
        "memory type; Debian's UCX has none): run with a CUDA-enabled UCX such as PyPI's libucx-cu13, whose "
        "libraries go first on LD_LIBRARY_PATH");
  }
  if (!config_.device->is_device(address)) return invalid_argument("register_device_region: not GPU memory");
  std::lock_guard lock(mu_);
  return map_region(address, bytes, true);
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
      flushed_piece(*t, op->seq, op->bytes,
                    op->checksum_on_device ? std::nullopt : std::optional<uint64_t>(op->checksum));
      return;
  }
}

void UcxEngine::send_message(const std::shared_ptr<Peer>& peer, const Message& message) {
  send_encoded(peer, encode_message(message));
}

// Eager only: a rendezvous active message would move its bytes with (emulated) RMA, see PieceCarrier.
void UcxEngine::send_encoded(const std::shared_ptr<Peer>& peer, std::vector<std::byte> encoded) {
  if (!peer || peer->ep == nullptr || !peer->failure.is_ok()) return;
  auto* op = new_op(this, OpKind::kMessage);
  op->peer = peer.get();
  op->buffer = std::move(encoded);
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
        send_encoded(t.peer, std::move(it->message));
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
          if (t.piece_done[i]) continue;
          if (shown++ > 0) missing += ',';
          missing += std::to_string(i);
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
    if (t.finalized || !t.decided || t.in_flight > 0 || t.checks_in_flight > 0) {
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
  events += poll_device_checks();
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
  s.pieces_flushed = pieces_flushed_;
  s.piece_flush_us = piece_flush_us_;
  s.piece_checksum_wait_us = piece_checksum_wait_us_;
  s.pieces_verified = pieces_verified_;
  s.piece_verify_us = piece_verify_us_;
  return s;
}

}  // namespace ucx_impl

EngineConfig::PieceCarrier carrier_for_transports(std::string_view tls) {
  if (tls.empty()) return EngineConfig::PieceCarrier::kMessage;
  size_t start = 0;
  while (start <= tls.size()) {
    const size_t end = std::min(tls.find(',', start), tls.size());
    const std::string_view name = tls.substr(start, end - start);
    if (name.starts_with('^') || name == "all" || name == "tcp" || name == "ud" || name.starts_with("ud_")) {
      return EngineConfig::PieceCarrier::kMessage;
    }
    start = end + 1;
  }
  return EngineConfig::PieceCarrier::kPut;
}

Result<std::unique_ptr<TransferEngine>> TransferEngine::create(const EngineConfig& config) {
  auto engine = std::make_unique<ucx_impl::UcxEngine>(config);
  DS_RETURN_IF_ERROR_CTX(engine->init(), "transfer engine");
  return std::unique_ptr<TransferEngine>(std::move(engine));
}

}  // namespace deltaserve::kvstore::transfer
