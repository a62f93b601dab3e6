// The UCX handoff path (issue 5): the envelope travels over CAF, the encoded state over UCX
// (kvstore/transfer/transfer_engine.hpp), receiver-driven:
//
//   prefill worker                         decode worker (same or another process)
//   send_state() spawns a sender actor ──▶ reserve(ReserveRequest{id, attempt, bytes, router, sink})
//                                          allocate a region of `bytes`, expect() pieces of ≤ piece_bytes
//                                          under the deadline  ──▶ ReserveReply{transfer id, descriptor}
//   start_send(descriptor), send_piece() for each piece, finish_send()   (one-sided puts + checksummed notices)
//   handoff_ucx(envelope, transfer id) ──▶ the envelope waits for the transfer's on_done, or the other way round
//                                          OK + envelope: decode_state() straight from the region, then admit as
//                                          with the CAF path; the region is released at once.
//                                          Failure (deadline, DataLoss, peer gone, aborted, envelope missing):
//                                          nothing is decoded; failed_atom(id, attempt, code, msg) to the router,
//                                          which prefills the request again (or the sink gets the error).
// The sender reports a failure itself (failed_atom) only when no transfer started: the reserve request failed
// or timed out, or start_send refused the descriptor. Once bytes may move, the receiver alone decides, so a
// request is never both admitted and prefilled again.
//
// Memory: a receive region is allocated per transfer (ucp_mem_map ALLOCATE) and released when the state was
// decoded. After a failure the region is kept for `deadline + reserve_timeout` more (a slow sender may still
// put into it until its own deadline passes; transfer_engine.hpp "Caveat"), then released. The sender keeps the
// encoded bytes alive until its side of the transfer finished (the engine's on_done drops the last reference).
//
// Not done: layer-by-layer overlap with compute. The CPU engine encodes the whole state after the last
// prefill chunk, so pieces are cut from the finished encoding; the engine API (send_piece per piece, as soon
// as its bytes are final) already allows the overlap once the engine produces layers incrementally.
//
// Threading: the engine runs its own progress thread; its on_done callbacks only post CAF messages through
// UcxLink::deliver, which drops them once the Node is shutting down.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "actors/transport.hpp"
#include "common/status.hpp"
#include "engine/backend.hpp"
#include "kvstore/transfer/transfer_engine.hpp"

namespace deltaserve::actors {

struct UcxLinkConfig {
  std::string tls = "tcp,self";                // UCX_TLS syntax (stack.md: tcp,self on loopback; posix,self same host)
  std::string net_devices;                     // UCX_NET_DEVICES; "" = UCX default (all); loopback tests: "lo"
  std::chrono::milliseconds deadline{10'000};  // per transfer, armed at reserve (receiver) / start (sender)
  std::chrono::milliseconds reserve_timeout{5'000};  // sender: wait this long for the receiver's descriptor
  uint64_t piece_bytes = 4ull << 20;                 // the encoded state is cut into pieces of at most this
  std::string faults;  // kvstore/transfer/fault_injection.hpp spec; only the test library accepts one
  // GPU workers: the engine's access to GPU memory (kvstore/transfer/cuda); null on the CPU.
  std::shared_ptr<kvstore::transfer::DeviceMemory> device;
};

// Checks the settings (names the offending field).
Status validate(const UcxLinkConfig& config);

// One process's UCX engine (shared by its prefill and decode workers) and the gate through which the
// engine's callbacks reach actors.
class UcxLink {
 public:
  static Result<std::shared_ptr<UcxLink>> create(const UcxLinkConfig& config);
  ~UcxLink();

  kvstore::transfer::TransferEngine& engine() { return *engine_; }
  const UcxLinkConfig& config() const { return config_; }

  // ---- handoffs in device memory ----
  // Registers `backend`'s device memory (engine::Backend::device_memory_regions) with the engine, once per
  // process, so that states move from GPU memory to GPU memory (device_handoff()). kFailedPrecondition, with the
  // reason, when the link has no DeviceMemory or the UCX build cannot register CUDA memory: the workers then hand
  // states off through host memory.
  Status register_device_memory(engine::Backend& backend);
  bool device_handoff() const { return !device_regions_.empty(); }
  // The spans' layout (sizes and order; engine::DeviceStateSpans): two workers move device state only when theirs
  // are equal, otherwise through host memory.
  const std::string& device_layout() const { return device_layout_; }
  // The registered region and offset of a span of registered device memory; kNotFound for others.
  Result<kvstore::transfer::LocalSegment> device_segment(const engine::DeviceSpan& span) const;

  // Runs `post` (which sends a CAF message) unless close() was called; callable from any thread.
  void deliver(const std::function<void()>& post);
  // Called before the actor system goes away: later callbacks message nobody.
  void close();

 private:
  UcxLink(UcxLinkConfig config, std::unique_ptr<kvstore::transfer::TransferEngine> engine);
  UcxLinkConfig config_;
  struct DeviceRegion {
    const std::byte* base = nullptr;
    int64_t bytes = 0;
    kvstore::transfer::RegionId region = 0;
  };
  std::vector<DeviceRegion> device_regions_;
  std::string device_layout_;
  std::mutex mutex_;
  bool closed_ = false;
  std::unique_ptr<kvstore::transfer::TransferEngine> engine_;
};

// The prefill side: each send_state spawns a short-lived sender actor (in the decode worker handle's actor
// system) that reserves, sends and hands the envelope over.
std::shared_ptr<Transport> make_ucx_transport(std::shared_ptr<UcxLink> link);

}  // namespace deltaserve::actors
