// Internal to kvstore/transfer: the UCX implementation of TransferEngine, shared by ucx_engine.cpp
// (lifetime, regions, endpoints, requests, progress) and ucx_transfers.cpp (the receiver's and the
// sender's protocol). Design notes: docs/transfer.md. Not part of the library's interface.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ucp/api/ucp.h>

#include "kvstore/transfer/fault_injection.hpp"
#include "kvstore/transfer/transfer_engine.hpp"
#include "kvstore/transfer/wire.hpp"

namespace deltaserve::kvstore::transfer::ucx_impl {

using Clock = std::chrono::steady_clock;

constexpr unsigned kAmId = 0x5D5;                          // every control message travels on this active-message id
constexpr auto kSendDrainGrace = std::chrono::seconds(1);  // see Transfer::drain_deadline
constexpr auto kShutdownWait = std::chrono::seconds(2);
constexpr size_t kRkeyCacheEntries = 256;  // unpacked rkeys kept (LRU among unused ones)

inline Status ucx_status(StatusCode code, const std::string& what, ucs_status_t status) {
  return Status(code, what + ": " + ucs_status_string(status));
}

inline StatusCode code_from_wire(uint32_t code) {
  if (code == 0 || code > static_cast<uint32_t>(StatusCode::kCancelled)) return StatusCode::kUnavailable;
  return static_cast<StatusCode>(code);
}

inline std::string blob_text(const std::vector<std::byte>& blob) {
  return std::string(reinterpret_cast<const char*>(blob.data()), blob.size());
}

inline std::vector<std::byte> text_blob(const std::string& text) {
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
  std::vector<std::byte> buffer;    // kMessage payload; kPut fault byte
  bool checksum_on_device = false;  // kFlush: the piece's checksum comes from a DeviceCheck (Transfer::send_checks)
  bool counted = false;             // counted in the in-flight figures (UCX returned a request)
  Peer* peer = nullptr;             // the endpoint it was issued on (compared, never dereferenced)
  std::shared_ptr<Peer> target;     // kClose: the peer being closed
  bool orphaned = false;            // its endpoint was closed without completing it (see close_endpoint)
  void* request = nullptr;          // the UCX request while counted
  bool request_released = false;    // ucp_request_free already called (engine shutdown)
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
  std::vector<std::byte> message;  // encoded
};

// A kSum64 checksum running on the GPU (DeviceMemory::begin_checksum), polled by progress().
struct DeviceCheck {
  DeviceMemory::Ticket ticket = 0;
  TransferId transfer = 0;
  uint32_t seq = 0;
  Role role = Role::kReceive;  // receive: verify against `expected`; send: the notice's checksum
  uint64_t bytes = 0;
  uint64_t expected = 0;
};

// Send side: a piece whose notice waits for its flush and its GPU checksum, whichever completes last.
struct PendingNotice {
  bool flushed = false;
  Clock::time_point flushed_at;
  std::optional<uint64_t> checksum;
  uint64_t bytes = 0;
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
  int64_t checks_in_flight = 0;  // DeviceChecks not yet polled to completion (they read this transfer's memory)
  ChecksumKind checksum = ChecksumKind::kStripe64;
  DoneCallback on_done;
  std::shared_ptr<Peer> peer;  // receive: the sender (known after kBegin/kFinish); send: the receiver
  uint32_t num_pieces = 0;
  std::vector<uint8_t> piece_done;               // receive: verified; send: passed to send_piece
  std::vector<uint8_t> piece_checking;           // receive: its checksum runs on the GPU
  std::vector<Clock::time_point> piece_started;  // receive: notice handled; send: puts posted (EngineStats timings)
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
  std::map<uint32_t, PendingNotice> pending_notices;
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
  bool device = false;  // GPU memory (register_device_region)
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
  Result<RegionId> register_device_region(void* address, uint64_t bytes) override;
  std::span<std::byte> region_data(RegionId region) override;
  Result<std::vector<std::byte>> packed_rkey(RegionId region) const override;
  Status release_region(RegionId region) override;
  Result<ExpectedTransfer> expect(ReceiveSpec spec) override;
  std::optional<uint32_t> pieces_verified(TransferId id) const override;
  Result<TransferId> start_send(std::span<const std::byte> descriptor, DoneCallback on_done) override;
  Status send_piece(TransferId id, uint32_t seq, std::span<const std::span<const std::byte>> sources,
                    std::optional<uint64_t> checksum) override;
  Status finish_send(TransferId id) override;
  std::optional<ChecksumKind> checksum_kind(TransferId id) const override;
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
  Result<RegionId> map_region(void* address, uint64_t bytes, bool device);
  bool on_device(std::span<const std::span<const std::byte>> sources) const;
  Result<uint64_t> host_checksum(ChecksumKind kind, std::span<const std::span<const std::byte>> sources);
  Status begin_device_check(Transfer& t, uint32_t seq, Role role, std::span<const std::span<const std::byte>> spans,
                            uint64_t bytes, uint64_t expected);
  int poll_device_checks();
  void complete_verification(Transfer& t, uint32_t seq, uint64_t bytes, uint64_t received, uint64_t expected);
  void flushed_piece(Transfer& t, uint32_t seq, uint64_t bytes, std::optional<uint64_t> checksum);
  Result<std::shared_ptr<Peer>> connect(const std::string& address);
  void close_endpoint(Peer& peer, bool force);
  void orphan_requests_of(const Peer* peer);
  bool has_outstanding(const Peer& peer) const;
  void issue_queued_pieces();
  bool issue_piece_direct(Transfer& t, uint32_t seq, std::span<const std::span<const std::byte>> sources,
                          std::optional<uint64_t> checksum);
  void issue_piece_message(Transfer& t, uint32_t seq, std::span<const std::span<const std::byte>> sources,
                           std::optional<uint64_t> checksum);
  void issue_piece(Transfer& t, uint32_t seq, std::span<const std::span<const std::byte>> sources,
                   std::optional<uint64_t> checksum);
  Result<ucp_rkey_h> acquire_rkey(Peer& peer, const RkeyKey& key);
  void release_rkey(const RkeyKey& key);
  void purge_rkeys_of(const Peer& peer);
  void submit(ucs_status_ptr_t request, Op* op);
  void send_message(const std::shared_ptr<Peer>& peer, const Message& message);
  void send_encoded(const std::shared_ptr<Peer>& peer, std::vector<std::byte> encoded);
  Message message_for(const Transfer& t, MessageKind kind) const;
  ucp_mem_h memh_containing(const std::byte* p, uint64_t bytes) const;
  const Fault* fault(FaultPoint point, uint32_t seq) const;

  int progress_locked();
  void handle_message(const Message& m);
  void handle_failed_peers();
  void fail_peer(const std::shared_ptr<Peer>& peer, Status reason);
  void emit_notice(Transfer& t, uint32_t seq, uint64_t bytes, uint64_t checksum);
  void emit_encoded_notice(Transfer& t, uint32_t seq, std::vector<std::byte> encoded);
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
  std::vector<DeviceCheck> device_checks_;
  uint64_t pieces_flushed_ = 0, piece_flush_us_ = 0, piece_checksum_wait_us_ = 0;
  uint64_t pieces_verified_ = 0, piece_verify_us_ = 0;
  uint64_t requests_orphaned_ = 0;
};

inline Op* new_op(UcxEngine* engine, OpKind kind, TransferId transfer = 0, uint32_t seq = 0) {
  auto* op = new Op;
  op->engine = engine;
  op->kind = kind;
  op->transfer = transfer;
  op->seq = seq;
  return op;
}

// UCX callbacks (ucx_engine.cpp).
void on_request_done(void* request, ucs_status_t status, void* user_data);
ucs_status_t on_am(void* arg, const void* header, size_t header_length, void* data, size_t length,
                   const ucp_am_recv_param_t* param);
void on_endpoint_error(void* arg, ucp_ep_h ep, ucs_status_t status);

}  // namespace deltaserve::kvstore::transfer::ucx_impl
