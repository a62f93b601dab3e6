// UCX implementation of TransferEngine, part 2: the protocol. Receiver: expect, piece verification,
// control messages. Sender: start, pieces (direct copy or puts + flush), notices, finish.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>

#include "kvstore/transfer/checksum.hpp"
#include "kvstore/transfer/ucx_engine.hpp"

namespace deltaserve::kvstore::transfer::ucx_impl {
namespace {

uint64_t micros_since(Clock::time_point start) {
  return static_cast<uint64_t>(
      std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start).count()));
}

}  // namespace

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
  // Pieces in GPU memory: wholly there, under the kSum64 word rule (device_memory.hpp); they make the
  // transfer's checksum kSum64, computed on the GPU.
  bool any_device = false;
  for (size_t p = 0; p < spec.pieces.size(); ++p) {
    const auto& segments = spec.pieces[p];
    const bool device = regions_[segments.front().region].device;
    any_device |= device;
    for (size_t k = 0; k < segments.size(); ++k) {
      const Region& region = regions_[segments[k].region];
      const std::string where = "expect: piece " + std::to_string(p) + ": segment " + std::to_string(k);
      if (region.device != device) return invalid_argument(where + " mixes GPU and host memory in one piece");
      if (!device) continue;
      if (reinterpret_cast<uintptr_t>(region.base + segments[k].offset) % 8 != 0) {
        return invalid_argument(where + " in GPU memory is not 8-byte aligned");
      }
      if (k + 1 < segments.size() && segments[k].bytes % 8 != 0) {
        return invalid_argument(where + " in GPU memory is not the last and not a multiple of 8 bytes");
      }
    }
  }
  t.checksum = any_device ? ChecksumKind::kSum64 : ChecksumKind::kStripe64;
  d.checksum = t.checksum;
  t.id = next_transfer_++;
  t.role = Role::kReceive;
  t.token = token_rng_();
  t.deadline_ms = static_cast<uint32_t>(spec.deadline.count());
  t.deadline = Clock::now() + spec.deadline;
  t.on_done = std::move(spec.on_done);
  t.num_pieces = static_cast<uint32_t>(spec.pieces.size());
  t.piece_done.assign(t.num_pieces, 0);
  t.piece_checking.assign(t.num_pieces, 0);
  t.piece_started.assign(t.num_pieces, Clock::time_point{});
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
  if (t.piece_done[m.seq] || t.piece_checking[m.seq]) {
    ++messages_ignored_;  // duplicate notice
    return;
  }
  t.piece_started[m.seq] = Clock::now();
  const std::vector<LocalSegment>& segments = t.local_pieces[m.seq];
  if (regions_[segments.front().region].device) {
    // Place carried bytes with a copy, then checksum what GPU memory holds, on the GPU, without blocking.
    std::vector<std::span<const std::byte>> spans;
    uint64_t at = 0;
    for (const LocalSegment& s : segments) {
      std::byte* destination = regions_[s.region].base + s.offset;
      if (m.kind == MessageKind::kPieceData) {
        if (Status c = config_.device->copy(destination, m.payload.data() + at, s.bytes); !c.is_ok()) {
          return decide(t, c.with_context(piece + ": copy into GPU memory"), true);
        }
        at += s.bytes;
      }
      spans.emplace_back(destination, s.bytes);
    }
    if (Status c = begin_device_check(t, m.seq, Role::kReceive, spans, m.bytes, m.checksum); !c.is_ok()) {
      return decide(t, c, true);
    }
    return;
  }
  uint64_t received = 0;
  if (t.checksum == ChecksumKind::kStripe64) {
    Checksum64 checksum;
    uint64_t at = 0;
    for (const LocalSegment& s : segments) {
      std::byte* destination = regions_[s.region].base + s.offset;
      if (m.kind == MessageKind::kPieceData) {  // place the carried bytes, checksumming them on the way
        checksum.copy_and_update(destination, m.payload.subspan(at, s.bytes));
        at += s.bytes;
      } else {
        checksum.update({destination, s.bytes});
      }
    }
    received = checksum.finish();
  } else {
    Sum64 checksum;
    uint64_t at = 0;
    for (const LocalSegment& s : segments) {
      std::byte* destination = regions_[s.region].base + s.offset;
      if (m.kind == MessageKind::kPieceData) {
        std::memcpy(destination, m.payload.data() + at, s.bytes);
        at += s.bytes;
      }
      checksum.update({destination, s.bytes});
    }
    received = checksum.finish();
  }
  complete_verification(t, m.seq, m.bytes, received, m.checksum);
}

void UcxEngine::complete_verification(Transfer& t, uint32_t seq, uint64_t bytes, uint64_t received, uint64_t expected) {
  ++pieces_verified_;
  piece_verify_us_ += micros_since(t.piece_started[seq]);
  if (received != expected) {
    ++pieces_rejected_;
    char text[96];
    std::snprintf(text, sizeof text, ": checksum mismatch (sent %016llx, received %016llx)",
                  static_cast<unsigned long long>(expected), static_cast<unsigned long long>(received));
    return decide(t, data_loss("piece " + std::to_string(seq) + text), true);
  }
  t.piece_done[seq] = 1;
  ++t.pieces_done;
  bytes_received_ += bytes;
  if (t.finish_seen && t.pieces_done == t.num_pieces) decide(t, Status::ok(), true);
}

// ---- checksums on the GPU ---------------------------------------------------------------------------

Status UcxEngine::begin_device_check(Transfer& t, uint32_t seq, Role role,
                                     std::span<const std::span<const std::byte>> spans, uint64_t bytes,
                                     uint64_t expected) {
  auto ticket = config_.device->begin_checksum(spans);
  if (!ticket.is_ok()) return ticket.status().with_context("checksum of piece " + std::to_string(seq));
  device_checks_.push_back({*ticket, t.id, seq, role, bytes, expected});
  ++t.checks_in_flight;
  if (role == Role::kReceive) t.piece_checking[seq] = 1;
  return Status::ok();
}

int UcxEngine::poll_device_checks() {
  int events = 0;
  for (size_t i = 0; i < device_checks_.size();) {
    const DeviceCheck check = device_checks_[i];
    std::optional<Result<uint64_t>> value = config_.device->poll_checksum(check.ticket);
    if (!value) {
      ++i;
      continue;
    }
    device_checks_.erase(device_checks_.begin() + static_cast<ptrdiff_t>(i));
    ++events;
    Transfer* t = find(check.transfer);  // still there: checks_in_flight holds back its finalization
    if (t == nullptr) continue;
    --t->checks_in_flight;
    if (check.role == Role::kReceive) t->piece_checking[check.seq] = 0;
    if (t->decided) continue;
    if (!value->is_ok()) {
      decide(*t, value->status().with_context("checksum of piece " + std::to_string(check.seq)), true);
      continue;
    }
    if (check.role == Role::kReceive) {
      complete_verification(*t, check.seq, check.bytes, **value, check.expected);
      continue;
    }
    PendingNotice& pending = t->pending_notices[check.seq];
    const uint64_t checksum = **value ^ (fault(FaultPoint::kCorruptByte, check.seq) != nullptr ? 1 : 0);
    if (pending.flushed) {
      const uint64_t bytes = pending.bytes;
      piece_checksum_wait_us_ += micros_since(pending.flushed_at);
      t->pending_notices.erase(check.seq);
      emit_notice(*t, check.seq, bytes, checksum);
    } else {
      pending.checksum = checksum;
    }
  }
  return events;
}

// The flush of a piece's puts completed: announce it once its checksum is known as well.
void UcxEngine::flushed_piece(Transfer& t, uint32_t seq, uint64_t bytes, std::optional<uint64_t> checksum) {
  ++pieces_flushed_;
  piece_flush_us_ += micros_since(t.piece_started[seq]);
  if (checksum) return emit_notice(t, seq, bytes, *checksum);
  PendingNotice& pending = t.pending_notices[seq];
  if (pending.checksum) {
    const uint64_t value = *pending.checksum;
    t.pending_notices.erase(seq);
    return emit_notice(t, seq, bytes, value);
  }
  pending.flushed = true;
  pending.flushed_at = Clock::now();
  pending.bytes = bytes;
}

bool UcxEngine::on_device(std::span<const std::span<const std::byte>> sources) const {
  return config_.device && !sources.empty() && config_.device->is_device(sources.front().data());
}

// The checksum of `sources` computed by the CPU; GPU sources are first copied to host memory (a GPU source for
// a host destination, rare: the receiver then chose kStripe64).
Result<uint64_t> UcxEngine::host_checksum(ChecksumKind kind, std::span<const std::span<const std::byte>> sources) {
  std::vector<std::byte> staged;
  auto hash = [&](auto& checksum) -> Result<uint64_t> {
    for (const auto& source : sources) {
      if (on_device(std::span(&source, 1))) {
        staged.resize(source.size());
        DS_RETURN_IF_ERROR(config_.device->copy(staged.data(), source.data(), source.size()));
        checksum.update(staged);
      } else {
        checksum.update(source);
      }
    }
    return checksum.finish();
  };
  if (kind == ChecksumKind::kStripe64) {
    Checksum64 checksum;
    return hash(checksum);
  }
  Sum64 checksum;
  return hash(checksum);
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
    case MessageKind::kPieceData:
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
  t.checksum = d.checksum;
  t.deadline_ms = d.deadline_ms;
  t.deadline = Clock::now() + std::chrono::milliseconds(d.deadline_ms);
  t.on_done = std::move(on_done);
  t.peer = peer;
  t.num_pieces = static_cast<uint32_t>(d.pieces.size());
  t.piece_done.assign(t.num_pieces, 0);
  t.piece_started.assign(t.num_pieces, Clock::time_point{});
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
  if (config_.device) {
    const bool device = on_device(sources);
    for (size_t k = 0; k < sources.size(); ++k) {
      if (k > 0 && config_.device->is_device(sources[k].data()) != device) {  // sources[0] decided `device`
        return invalid_argument(piece + ": sources mix GPU and host memory");
      }
      if (device && t->checksum == ChecksumKind::kSum64 && !checksum &&
          (reinterpret_cast<uintptr_t>(sources[k].data()) % 8 != 0 ||
           (k + 1 < sources.size() && sources[k].size() % 8 != 0))) {
        return invalid_argument(piece + ": GPU source " + std::to_string(k) + " breaks the kSum64 word rule");
      }
    }
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

// PieceCarrier::kMessage: the bytes travel inside the notice; nothing is written into the receiver's memory
// from here, so a failed or late transfer can never touch its region.
void UcxEngine::issue_piece_message(Transfer& t, uint32_t seq, std::span<const std::span<const std::byte>> sources,
                                    std::optional<uint64_t> checksum) {
  Message m = message_for(t, MessageKind::kPieceData);
  m.seq = seq;
  m.bytes = piece_bytes(t.remote_pieces[seq]);
  // GPU sources travel through host memory here: stage them first.
  std::vector<std::byte> staged;
  std::vector<std::span<const std::byte>> staged_sources;
  if (on_device(sources)) {
    staged.resize(m.bytes);
    uint64_t at = 0;
    for (const auto& source : sources) {
      if (Status c = config_.device->copy(staged.data() + at, source.data(), source.size()); !c.is_ok()) {
        return decide(t, c.with_context("piece " + std::to_string(seq) + ": copy out of GPU memory"), true);
      }
      at += source.size();
    }
    staged_sources.emplace_back(staged);
    sources = staged_sources;
  }
  if (!checksum && t.checksum == ChecksumKind::kSum64) {  // encode_piece_data computes kStripe64 only
    Sum64 sum;
    for (const auto& source : sources) sum.update(source);
    checksum = sum.finish();
  }
  std::vector<std::byte> encoded = encode_piece_data(m, sources, checksum);
  if (fault(FaultPoint::kCorruptByte, seq) != nullptr) {
    std::byte& byte = encoded[encoded.size() - m.bytes + t.remote_pieces[seq].front().bytes / 2];
    byte = ~byte;
  }
  bytes_sent_ += m.bytes;
  emit_encoded_notice(t, seq, std::move(encoded));
}

void UcxEngine::issue_piece(Transfer& transfer, uint32_t seq, std::span<const std::span<const std::byte>> sources,
                            std::optional<uint64_t> checksum) {
  Transfer* t = &transfer;
  const TransferId id = t->id;
  const uint64_t bytes = piece_bytes(t->remote_pieces[seq]);
  const std::shared_ptr<Peer> peer = t->peer;
  const bool device_sources = on_device(sources);
  // The direct copy is a CPU copy fused with the kStripe64 checksum: host bytes for a host destination only.
  if (config_.direct_copy && !device_sources && t->checksum == ChecksumKind::kStripe64 &&
      issue_piece_direct(*t, seq, sources, checksum)) {
    return;
  }
  if (config_.carrier == EngineConfig::PieceCarrier::kMessage) return issue_piece_message(*t, seq, sources, checksum);
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
  t->piece_started[seq] = Clock::now();
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
  bool checksum_on_device = false;
  if (!checksum && device_sources && t->checksum == ChecksumKind::kSum64) {
    // On the GPU, beside the puts; the notice goes out when both the flush and the checksum are done.
    if (Status c = begin_device_check(*t, seq, Role::kSend, sources, bytes, 0); !c.is_ok()) return decide(*t, c, true);
    checksum_on_device = true;
  } else if (!checksum) {
    auto c = host_checksum(t->checksum, sources);
    if (!c.is_ok()) return decide(*t, c.status().with_context("checksum of piece " + std::to_string(seq)), true);
    checksum = *c;
  }
  bytes_sent_ += bytes;
  const bool corrupt = fault(FaultPoint::kCorruptByte, seq) != nullptr;
  if (corrupt && device_sources) {
    // GPU memory: the corruption is one flipped bit of the announced checksum (a one-byte put from host memory
    // into GPU memory is no transfer the protocol makes); the receiver must reject the piece the same way.
  } else if (corrupt) {
    // Overwrite one byte in the middle of the first segment with its complement, after the real puts.
    const Segment& first = t->remote_pieces[seq].front();
    const uint64_t at = first.bytes / 2;
    uint64_t skip = at;
    std::byte original{};
    for (const auto& s : sources) {
      if (skip < s.size()) {
        if (device_sources) {
          if (Status c = config_.device->copy(&original, s.data() + skip, 1); !c.is_ok()) return decide(*t, c, true);
        } else {
          original = s[skip];
        }
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
  flush->checksum = checksum.value_or(0) ^ (corrupt && device_sources && checksum ? 1 : 0);
  flush->checksum_on_device = checksum_on_device;
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
  emit_encoded_notice(t, seq, encode_message(m));
}

void UcxEngine::emit_encoded_notice(Transfer& t, uint32_t seq, std::vector<std::byte> encoded) {
  if (const Fault* f = fault(FaultPoint::kDelayPiece, seq)) {
    t.delayed.push_back({Clock::now() + std::chrono::milliseconds(f->delay_ms), std::move(encoded)});
    return;
  }
  send_encoded(t.peer, std::move(encoded));
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

std::optional<ChecksumKind> UcxEngine::checksum_kind(TransferId id) const {
  std::lock_guard lock(mu_);
  const Transfer* t = find(id);
  if (t == nullptr) return std::nullopt;
  return t->checksum;
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

}  // namespace deltaserve::kvstore::transfer::ucx_impl
