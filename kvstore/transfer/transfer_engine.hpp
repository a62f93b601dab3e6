// UCX transport of MLA pages and KDA states between workers (issue 5): one UCP context + worker per
// process, registered memory regions, and transfers made of pieces that each side tracks under a
// deadline. Depends on UCX and std only; the header does not include UCX.
//
// A transfer, receiver-driven placement, sender-driven data movement:
//   receiver  expect(spec)            -> {id, descriptor bytes}   (spec: where each piece lands)
//             ... descriptor travels to the sender inside an actor message ...
//   sender    start_send(descriptor)  -> id; kBegin, and the receiver answers kAccept
//             send_piece(id, seq, src) for each piece as soon as its bytes are final (e.g. per layer);
//                                        queued until kAccept, then written straight into the
//                                        receiver's region (over shared memory a CPU copy fused with
//                                        the checksum; otherwise one-sided puts + an endpoint flush,
//                                        then a kPiece notice (seq, bytes, checksum64); or, with
//                                        PieceCarrier::kMessage, inside the notice itself)
//             finish_send(id)          -> a kFinish notice after the last piece's notice
//   both      wait(id) / try_take(id) / on_done callback -> the final Status
// The receiver verifies each piece's checksum over the bytes in its own memory when the notice arrives,
// and reports OK only when every piece arrived and checked out, then sends the result back to the
// sender. The sender's OK therefore means "the receiver holds verified bytes".
//
// Failures (each side, independently, never later than its deadline):
//   kDeadlineExceeded  the deadline (armed at expect()/start_send(), duration from the descriptor) passed
//   kDataLoss          a checksum mismatch, a piece announced with the wrong size, or pieces missing after
//                      kFinish (waits EngineConfig::finish_grace for stragglers)
//   kUnavailable       the peer's endpoint failed (peer death: needs detect_peer_failure), a put or
//                      flush failed, or the other side aborted
//   kCancelled         abort() by the user, or the engine was destroyed
// A failed receive hands nothing to the user: the destination bytes are undefined. Caveat: a sender
// that is alive but slow may still write into those bytes until it sees the kResult failure or its own
// deadline passes (its puts are then cancelled); return such pages to a pool only after the sender's
// deadline has passed or its endpoint is known dead.
//
// Resources: a transfer holds a use of every region it names (release_region() refuses while used),
// its in-flight UCX requests and its uses of unpacked rkeys (cached per peer); all are released when the
// transfer finishes (status decided and no request in flight), which stats() counts and the tests
// assert. A peer that fails, or still has requests pending at a transfer's deadline, has its endpoint
// force-closed and its cached rkeys destroyed.
//
// Threading: every public method locks one mutex, so any thread may call them. Progress is explicit:
// progress() (or wait(), which calls it) drives UCX and checks deadlines; alternatively
// EngineConfig::progress_thread runs progress() on a library thread. on_done callbacks run inside
// progress(), with the engine's lock held: they may call back into the engine but must not block.
//
// GPU memory: with EngineConfig::device set and a UCX build that registers CUDA memory (memory_info().cuda;
// PyPI's libucx-cu13 does, Debian's UCX 1.13 does not), register_device_region() registers GPU memory: a
// receiver's pieces land there (cuda_ipc on one host, GPUDirect RDMA where the fabric has it) and a sender
// puts from there. Pieces with a GPU destination are checksummed with ChecksumKind::kSum64 on the GPU on
// both sides, while UCX keeps moving other pieces. See docs/transfer.md.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.hpp"
#include "kvstore/transfer/checksum.hpp"
#include "kvstore/transfer/device_memory.hpp"

namespace deltaserve::kvstore::transfer {

struct EngineConfig {
  // UCX transports (UCX_TLS syntax) for this engine's context; "" keeps UCX's default, which the
  // environment's UCX_TLS overrides. Same host: "posix,self"; across nodes: "tcp,self" or "rc,sm,self".
  std::string tls;
  std::string net_devices;  // UCX_NET_DEVICES; "" = UCX default (all). Loopback tests: "lo".
  // UCP_ERR_HANDLING_MODE_PEER on every endpoint: a dead peer fails its transfers with kUnavailable
  // at once instead of at the deadline. Needs a network transport (tcp, rc, ud); UCX 1.13 then refuses
  // shared-memory transports, so "posix,self" + true fails to connect.
  bool detect_peer_failure = false;
  // When the receiver's region is mapped into this process (shared-memory transports), copy each piece
  // with the CPU and checksum it in the same pass instead of posting puts (ucx_transfer_bench shows
  // the difference; docs/transfer.md). false = always ucp_put_nbx.
  bool direct_copy = true;
  // How a piece's bytes travel when they are not copied directly (above):
  //   kPut      one-sided puts into the receiver's region, an endpoint flush, then the kPiece notice. For
  //             transports with native RMA (rc, dc, shared memory, cuda_ipc).
  //   kMessage  inside the notice (one eager active message per piece, kPieceData); the receiver copies them
  //             into place and checksums them in the same pass.
  // Over tcp and ud UCX emulates puts with active messages, and the receiver acknowledges each one; when the
  // sender died between its put and that acknowledgement, UCX aborts the receiving process (ucs_fatal in
  // ucp_request_try_send; UCX 1.13 and current UCX alike). kMessage asks nothing back, so there a sender's
  // death costs the receiver only the transfer: use it unless the transport has native RMA.
  enum class PieceCarrier { kPut, kMessage };
  PieceCarrier carrier = PieceCarrier::kPut;
  std::chrono::milliseconds finish_grace{200};  // receiver: wait for late notices after kFinish
  bool progress_thread = false;                 // run progress() on a library thread
  std::string faults;  // fault_injection.hpp spec; rejected unless built with DELTASERVE_TRANSFER_FAULTS
  // GPU memory access (device_memory.hpp); null: host memory only, register_device_region refuses.
  std::shared_ptr<DeviceMemory> device;
};

// The carrier for a UCX_TLS list: kMessage when some peer may be reached over a transport without native RMA
// (the list names tcp, ud or ud_*, is "all", an exclusion "^...", or "" = UCX's choice), else kPut
// ("rc,sm,self", "posix,self", "cuda_ipc,rc,self").
EngineConfig::PieceCarrier carrier_for_transports(std::string_view tls);

// What the UCX build can register and move (ucp_context_query memory types).
struct MemoryInfo {
  uint64_t memory_type_mask = 0;  // bit i = ucs_memory_type_t i
  bool host = false;
  bool cuda = false;  // device memory (needs UCX --with-cuda)
  bool cuda_managed = false;
  std::string transports;  // the UCX_TLS in effect ("" = UCX default)
};

struct EngineStats {
  int64_t regions = 0;             // registered regions
  int64_t region_uses = 0;         // sum of transfers' uses of regions
  int64_t requests_in_flight = 0;  // UCX requests not yet completed (puts, flushes, messages, closes)
  int64_t rkeys = 0;               // unpacked remote keys (cached per peer and packed rkey, LRU-bounded)
  int64_t rkey_uses = 0;           // transfers' uses of them
  int64_t endpoints = 0;           // open endpoints
  int64_t transfers = 0;           // transfers not yet taken by the user (pending or finished)
  int64_t transfers_pending = 0;   // transfers whose status is not decided
  uint64_t bytes_sent = 0;         // piece bytes put (sender)
  uint64_t bytes_received = 0;     // piece bytes verified (receiver)
  uint64_t pieces_rejected = 0;    // checksum or size mismatches
  uint64_t messages_ignored = 0;   // malformed, stale or foreign control messages
  uint64_t requests_orphaned = 0;  // requests dropped with a force-closed endpoint (never completed by UCX)
  // Where pieces spend their time (sums over pieces, microseconds; divide by the pieces to get a mean):
  uint64_t pieces_flushed = 0;          // sender: pieces whose puts were flushed
  uint64_t piece_flush_us = 0;          // sender: puts posted -> their flush completed
  uint64_t piece_checksum_wait_us = 0;  // sender: flush completed -> the GPU checksum was known (0 on the host)
  uint64_t pieces_verified = 0;         // receiver: pieces verified (or rejected) after their notice
  uint64_t piece_verify_us = 0;         // receiver: notice handled -> checksum compared (GPU: launch, run, poll)
};

using RegionId = uint32_t;
using TransferId = uint64_t;  // local to one engine; the receiver's id also names the transfer on the wire

struct LocalSegment {
  RegionId region = 0;
  uint64_t offset = 0;  // bytes from the region's start
  uint64_t bytes = 0;
};

using DoneCallback = std::function<void(TransferId, const Status&)>;

struct ReceiveSpec {
  // pieces[i] = where piece i (sequence number i) lands, in order; each piece at least one byte.
  std::vector<std::vector<LocalSegment>> pieces;
  std::chrono::milliseconds deadline{10'000};
  DoneCallback on_done;  // optional; when set, the transfer is forgotten after the call (no try_take)
};

struct ExpectedTransfer {
  TransferId id = 0;
  std::vector<std::byte> descriptor;  // wire.hpp format; give it to the sender
};

class TransferEngine {
 public:
  static Result<std::unique_ptr<TransferEngine>> create(const EngineConfig& config);
  virtual ~TransferEngine() = default;

  // This worker's UCX address; a peer connects with it (it is also inside every descriptor).
  virtual std::vector<std::byte> worker_address() const = 0;
  virtual MemoryInfo memory_info() const = 0;

  // Regions. allocate_region lets UCX allocate (ucp_mem_map ALLOCATE): required for one-sided puts
  // over shared memory (posix/sysv), where the peer maps the region. register_region registers
  // caller memory (host only; it must outlive the region), which tcp, rc and cma can write into.
  virtual Result<RegionId> allocate_region(uint64_t bytes) = 0;
  virtual Result<RegionId> register_region(void* address, uint64_t bytes) = 0;
  // Registers GPU memory (UCS_MEMORY_TYPE_CUDA). kFailedPrecondition without EngineConfig::device or when the
  // UCX build cannot register CUDA memory (memory_info().cuda false); kInvalidArgument for host memory.
  // region_data() of such a region is a device pointer. A receive spec's piece lies wholly in GPU memory or
  // wholly in host memory; in GPU memory every segment but the piece's last holds a multiple of 8 bytes and
  // starts 8-byte aligned (the kSum64 word rule, device_memory.hpp).
  virtual Result<RegionId> register_device_region(void* address, uint64_t bytes) = 0;
  virtual std::span<std::byte> region_data(RegionId region) = 0;  // empty for an unknown id
  virtual Result<std::vector<std::byte>> packed_rkey(RegionId region) const = 0;
  virtual Status release_region(RegionId region) = 0;  // kFailedPrecondition while a transfer uses it

  // Receiver side.
  virtual Result<ExpectedTransfer> expect(ReceiveSpec spec) = 0;
  // Pieces verified so far (progress reporting, tests); nullopt for an unknown id.
  virtual std::optional<uint32_t> pieces_verified(TransferId id) const = 0;

  // Sender side. The descriptor is untrusted input (validated). Source bytes passed to send_piece must
  // stay valid and unchanged until the transfer finishes (wait/try_take/on_done).
  // on_done as in ReceiveSpec.
  virtual Result<TransferId> start_send(std::span<const std::byte> descriptor, DoneCallback on_done = {}) = 0;
  // `sources` (gathered in order) must hold exactly the piece's bytes, all in host memory or all in GPU memory
  // (then under the kSum64 word rule above). `checksum`: the checksum of those bytes, of the kind the
  // descriptor names (checksum_kind()), when the producer already has it (computed as it wrote the layer, or cached
  // with immutable prefix-cache pages), which saves the sender a pass over the bytes; the receiver verifies either way,
  // so a wrong value fails the transfer with kDataLoss. Returns the transfer's failure if it has already failed, so a
  // producer can stop early.
  virtual Status send_piece(TransferId id, uint32_t seq, std::span<const std::span<const std::byte>> sources,
                            std::optional<uint64_t> checksum = std::nullopt) = 0;
  virtual Status finish_send(TransferId id) = 0;  // after every piece was passed to send_piece
  // The checksum kind of a send transfer's pieces (chosen by the receiver); nullopt for an unknown id.
  virtual std::optional<ChecksumKind> checksum_kind(TransferId id) const = 0;

  // Either side: fail the transfer now with `reason` (kCancelled if OK), telling the peer.
  virtual void abort(TransferId id, Status reason) = 0;

  // Drives UCX, handles control messages, checks deadlines. Returns the number of events handled.
  virtual int progress() = 0;
  // The final status once the transfer has finished, which also forgets it; nullopt while running.
  virtual std::optional<Status> try_take(TransferId id) = 0;
  // progress() until the transfer finishes, then try_take. Bounded by the transfer's deadline (plus
  // the time to cancel in-flight requests); kNotFound for an unknown id.
  virtual Status wait(TransferId id) = 0;

  virtual EngineStats stats() const = 0;
};

}  // namespace deltaserve::kvstore::transfer
