#include "kvstore/transfer/wire.hpp"

#include <cstring>

#include "kvstore/transfer/checksum.hpp"

namespace deltaserve::kvstore::transfer {
namespace {

constexpr uint32_t kDescriptorMagic = 0x58545344;  // "DSTX" little-endian
constexpr uint32_t kMessageMagic = 0x4D545344;     // "DSTM"

class Writer {
 public:
  void u8(uint8_t v) { put(&v, 1); }
  void u16(uint16_t v) { le(v); }
  void u32(uint32_t v) { le(v); }
  void u64(uint64_t v) { le(v); }
  void blob(std::span<const std::byte> b) {
    u32(static_cast<uint32_t>(b.size()));
    put(b.data(), b.size());
  }
  void bytes(std::span<const std::byte> b) { put(b.data(), b.size()); }
  std::vector<std::byte> take() { return std::move(out_); }

 private:
  template <class T>
  void le(T v) {
    std::byte b[sizeof(T)];
    for (size_t i = 0; i < sizeof(T); ++i) b[i] = static_cast<std::byte>((v >> (8 * i)) & 0xFF);
    put(b, sizeof(T));
  }
  void put(const void* p, size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    out_.insert(out_.end(), b, b + n);
  }
  std::vector<std::byte> out_;
};

// Reads little-endian fields; the first short read latches an error naming the field.
class Reader {
 public:
  explicit Reader(std::span<const std::byte> in) : in_(in) {}
  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }
  size_t remaining() const { return in_.size() - pos_; }

  uint8_t u8(const char* field) { return le<uint8_t>(field); }
  uint16_t u16(const char* field) { return le<uint16_t>(field); }
  uint32_t u32(const char* field) { return le<uint32_t>(field); }
  uint64_t u64(const char* field) { return le<uint64_t>(field); }
  std::vector<std::byte> blob(const char* field, uint32_t max_bytes) {
    const uint32_t n = u32(field);
    if (!ok()) return {};
    if (n > max_bytes) {
      fail(field, "length " + std::to_string(n) + " over limit");
      return {};
    }
    if (n > remaining()) {
      fail(field, "truncated");
      return {};
    }
    std::vector<std::byte> out(in_.begin() + static_cast<std::ptrdiff_t>(pos_),
                               in_.begin() + static_cast<std::ptrdiff_t>(pos_ + n));
    pos_ += n;
    return out;
  }
  void fail(const char* field, const std::string& what) {
    if (error_.empty()) error_ = std::string(field) + ": " + what;
  }

 private:
  template <class T>
  T le(const char* field) {
    if (!ok()) return 0;
    if (remaining() < sizeof(T)) {
      fail(field, "truncated");
      return 0;
    }
    T v = 0;
    for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(static_cast<T>(in_[pos_ + i]) << (8 * i));
    pos_ += sizeof(T);
    return v;
  }
  std::span<const std::byte> in_;
  size_t pos_ = 0;
  std::string error_;
};

}  // namespace

uint64_t piece_bytes(const std::vector<Segment>& piece) {
  uint64_t total = 0;
  for (const Segment& s : piece) total += s.bytes;
  return total;
}

std::vector<std::byte> encode_descriptor(const Descriptor& d) {
  Writer w;
  w.u32(kDescriptorMagic);
  w.u16(kDescriptorVersion);
  w.u16(static_cast<uint16_t>(d.checksum));
  w.u64(d.transfer_id);
  w.u64(d.token);
  w.u32(d.deadline_ms);
  w.blob(d.receiver_address);
  w.u32(static_cast<uint32_t>(d.regions.size()));
  for (const RemoteRegion& r : d.regions) {
    w.u64(r.base);
    w.u64(r.bytes);
    w.blob(r.rkey);
  }
  w.u32(static_cast<uint32_t>(d.pieces.size()));
  for (const auto& piece : d.pieces) {
    w.u32(static_cast<uint32_t>(piece.size()));
    for (const Segment& s : piece) {
      w.u32(s.region);
      w.u64(s.offset);
      w.u64(s.bytes);
    }
  }
  return w.take();
}

Result<Descriptor> decode_descriptor(std::span<const std::byte> bytes) {
  auto bad = [](const std::string& what) {
    return Status(StatusCode::kInvalidArgument, "transfer descriptor: " + what);
  };
  Reader r(bytes);
  if (r.u32("magic") != kDescriptorMagic || !r.ok()) return bad(r.ok() ? "bad magic" : r.error());
  const uint16_t version = r.u16("version");
  if (r.ok() && version != kDescriptorVersion) return bad("unsupported version " + std::to_string(version));
  const uint16_t checksum = r.u16("checksum kind");
  if (r.ok() && checksum > static_cast<uint16_t>(ChecksumKind::kSum64)) {
    return bad("unknown checksum kind " + std::to_string(checksum));
  }
  Descriptor d;
  d.checksum = static_cast<ChecksumKind>(checksum);
  d.transfer_id = r.u64("transfer_id");
  d.token = r.u64("token");
  d.deadline_ms = r.u32("deadline_ms");
  d.receiver_address = r.blob("receiver address", kMaxBlobBytes);
  const uint32_t num_regions = r.u32("regions");
  if (!r.ok()) return bad(r.error());
  if (num_regions == 0 || num_regions > kMaxRegions) return bad("region count " + std::to_string(num_regions));
  for (uint32_t i = 0; i < num_regions && r.ok(); ++i) {
    RemoteRegion region;
    region.base = r.u64("region base");
    region.bytes = r.u64("region bytes");
    region.rkey = r.blob("region rkey", kMaxBlobBytes);
    if (r.ok() && region.base + region.bytes < region.base) return bad("region " + std::to_string(i) + " wraps");
    d.regions.push_back(std::move(region));
  }
  const uint32_t num_pieces = r.u32("pieces");
  if (!r.ok()) return bad(r.error());
  if (num_pieces == 0 || num_pieces > kMaxPieces) return bad("piece count " + std::to_string(num_pieces));
  uint64_t total_segments = 0;
  for (uint32_t p = 0; p < num_pieces && r.ok(); ++p) {
    const uint32_t num_segments = r.u32("segments");
    if (!r.ok()) break;
    total_segments += num_segments;
    if (num_segments == 0 || num_segments > kMaxSegmentsPerPiece || total_segments > kMaxSegmentsTotal) {
      return bad("piece " + std::to_string(p) + ": segment count " + std::to_string(num_segments));
    }
    // Each segment takes 20 bytes on the wire: reject a count the input cannot hold before allocating.
    if (static_cast<uint64_t>(num_segments) * 20 > r.remaining()) return bad("segments: truncated");
    std::vector<Segment> piece(num_segments);
    uint64_t total = 0;
    for (Segment& s : piece) {
      s.region = r.u32("segment region");
      s.offset = r.u64("segment offset");
      s.bytes = r.u64("segment bytes");
      if (!r.ok()) break;
      const std::string where = "piece " + std::to_string(p) + ": segment";
      if (s.region >= num_regions) return bad(where + " names region " + std::to_string(s.region));
      const uint64_t region_bytes = d.regions[s.region].bytes;
      if (s.bytes == 0 || s.offset > region_bytes || s.bytes > region_bytes - s.offset) {
        return bad(where + " [" + std::to_string(s.offset) + ", +" + std::to_string(s.bytes) + ") outside region");
      }
      if (total + s.bytes < total) return bad(where + " sizes overflow");
      total += s.bytes;
    }
    d.pieces.push_back(std::move(piece));
  }
  if (!r.ok()) return bad(r.error());
  if (r.remaining() != 0) return bad("trailing bytes");
  return d;
}

std::vector<std::byte> encode_message(const Message& m) {
  Writer w;
  w.u32(kMessageMagic);
  w.u8(static_cast<uint8_t>(m.kind));
  w.u64(m.transfer_id);
  w.u64(m.token);
  w.u32(m.seq);
  w.u64(m.bytes);
  w.u64(m.checksum);
  w.blob(m.blob);
  if (m.kind == MessageKind::kPieceData) w.bytes(m.payload);
  return w.take();
}

std::vector<std::byte> encode_piece_data(Message m, std::span<const std::span<const std::byte>> sources,
                                         std::optional<uint64_t> checksum) {
  m.kind = MessageKind::kPieceData;
  m.checksum = 0;
  m.payload = {};
  std::vector<std::byte> out = encode_message(m);
  const size_t header = out.size();
  constexpr size_t kChecksumOffset = 4 + 1 + 8 + 8 + 4 + 8;  // magic, kind, transfer_id, token, seq, bytes
  out.resize(header + m.bytes);
  std::byte* destination = out.data() + header;
  Checksum64 sum;
  for (const auto& source : sources) {
    if (checksum) {
      std::memcpy(destination, source.data(), source.size());
    } else {
      sum.copy_and_update(destination, source);
    }
    destination += source.size();
  }
  const uint64_t value = checksum ? *checksum : sum.finish();
  for (size_t i = 0; i < 8; ++i) out[kChecksumOffset + i] = static_cast<std::byte>((value >> (8 * i)) & 0xFF);
  return out;
}

Result<Message> decode_message(std::span<const std::byte> bytes) {
  auto bad = [](const std::string& what) { return Status(StatusCode::kInvalidArgument, "transfer message: " + what); };
  Reader r(bytes);
  if (r.u32("magic") != kMessageMagic || !r.ok()) return bad(r.ok() ? "bad magic" : r.error());
  Message m;
  const uint8_t kind = r.u8("kind");
  if (r.ok() && (kind < 1 || kind > 7)) return bad("unknown kind " + std::to_string(kind));
  m.kind = static_cast<MessageKind>(kind);
  m.transfer_id = r.u64("transfer_id");
  m.token = r.u64("token");
  m.seq = r.u32("seq");
  m.bytes = r.u64("bytes");
  m.checksum = r.u64("checksum");
  m.blob = r.blob("blob", kMaxBlobBytes);
  if (!r.ok()) return bad(r.error());
  if (m.kind == MessageKind::kPieceData) {
    if (r.remaining() != m.bytes) {
      return bad("piece data of " + std::to_string(r.remaining()) + " bytes, announced " + std::to_string(m.bytes));
    }
    m.payload = bytes.subspan(bytes.size() - r.remaining());
    return m;
  }
  if (r.remaining() != 0) return bad("trailing bytes");
  return m;
}

}  // namespace deltaserve::kvstore::transfer
