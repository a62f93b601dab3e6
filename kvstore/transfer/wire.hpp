// Byte formats of the transfer layer: the transfer descriptor (receiver → sender, carried inside an
// actor message) and the control messages the two engines exchange as UCX active messages.
// All integers little-endian. Every decoder takes untrusted bytes: any input is safe (no crash, no read
// out of bounds, bounded allocation) and anything malformed is kInvalidArgument naming the field.
//
// Descriptor, version 2:
//   magic "DSTX" | u16 version | u16 checksum kind (ChecksumKind: 0 kStripe64, 1 kSum64) | u64 transfer_id | u64 token
//   | u32 deadline_ms | u32 address bytes, receiver worker address | u32 regions, each: u64 remote base | u64 bytes |
//   u32 rkey bytes, packed rkey | u32 pieces,  each: u32 segments, each: u32 region | u64 offset | u64 bytes
// A segment lies inside its region (offset + bytes <= region bytes); a piece holds 1..kMaxSegments
// segments and at least one byte.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/status.hpp"
#include "kvstore/transfer/checksum.hpp"

namespace deltaserve::kvstore::transfer {

inline constexpr uint16_t kDescriptorVersion = 2;
inline constexpr uint32_t kMaxPieces = 1u << 16;
inline constexpr uint32_t kMaxSegmentsPerPiece = 1u << 16;
inline constexpr uint32_t kMaxSegmentsTotal = 1u << 20;
inline constexpr uint32_t kMaxRegions = 1u << 12;
inline constexpr uint32_t kMaxBlobBytes = 1u << 16;  // a worker address or a packed rkey

// A contiguous byte range inside one of the descriptor's regions.
struct Segment {
  uint32_t region = 0;  // index into Descriptor::regions
  uint64_t offset = 0;  // bytes from the region's base
  uint64_t bytes = 0;
  bool operator==(const Segment&) const = default;
};

struct RemoteRegion {
  uint64_t base = 0;  // address in the receiver's process
  uint64_t bytes = 0;
  std::vector<std::byte> rkey;  // ucp_rkey_pack output
  bool operator==(const RemoteRegion&) const = default;
};

struct Descriptor {
  uint64_t transfer_id = 0;                         // unique per receiving engine
  uint64_t token = 0;                               // random per transfer: a stale or foreign message never matches
  uint32_t deadline_ms = 0;                         // each side arms its own deadline from its start
  ChecksumKind checksum = ChecksumKind::kStripe64;  // of every piece (the receiver's choice)
  std::vector<std::byte> receiver_address;          // ucp_worker_get_address output
  std::vector<RemoteRegion> regions;
  std::vector<std::vector<Segment>> pieces;  // [piece][segment], piece i has sequence number i
  bool operator==(const Descriptor&) const = default;
};

std::vector<std::byte> encode_descriptor(const Descriptor& descriptor);
Result<Descriptor> decode_descriptor(std::span<const std::byte> bytes);

uint64_t piece_bytes(const std::vector<Segment>& piece);

// Control messages (one UCX active message each, carried as the AM payload). Layout: magic "DSTM" | u8 kind
// | u64 transfer_id | u64 token | u32 seq | u64 bytes | u64 checksum | u32 blob bytes, blob | payload (kPieceData
// only: exactly `bytes` bytes, the rest of the message).
enum class MessageKind : uint8_t {
  kBegin = 1,      // sender → receiver: the sender's worker address follows (for replies)
  kPiece = 2,      // sender → receiver: piece `seq` was written (all its puts flushed), `checksum` of its bytes
  kFinish = 3,     // sender → receiver: all `count` pieces were announced
  kResult = 4,     // receiver → sender: final status (`code`; 0 = every piece verified); text follows
  kAbort = 5,      // sender → receiver: the sender gave up (`code`); text follows
  kAccept = 6,     // receiver → sender: kBegin seen; puts may start (the sender's endpoint is wired up)
  kPieceData = 7,  // sender → receiver: kPiece that carries the piece's bytes (EngineConfig::PieceCarrier::kMessage)
};

struct Message {
  MessageKind kind = MessageKind::kBegin;
  uint64_t transfer_id = 0;
  uint64_t token = 0;
  uint32_t seq = 0;             // kPiece: piece sequence number; kFinish: number of pieces; kResult/kAbort: StatusCode
  uint64_t bytes = 0;           // kPiece: bytes of the piece
  uint64_t checksum = 0;        // kPiece: the piece's checksum (the descriptor's kind) over its bytes in segment order
  std::vector<std::byte> blob;  // kBegin: sender address; kResult/kAbort: status message text
  // kPieceData: the piece's bytes in segment order (`bytes` of them). decode_message returns a view into its
  // input, which must outlive the Message.
  std::span<const std::byte> payload;
};

std::vector<std::byte> encode_message(const Message& message);
Result<Message> decode_message(std::span<const std::byte> bytes);

// A kPieceData message whose payload is the concatenation of `sources` (message.bytes in all, checked by the
// caller), copied in one pass. message.checksum is replaced by checksum64 of the payload, computed during the
// copy, unless `checksum` is given. Returns the encoding; its payload is the last message.bytes bytes.
std::vector<std::byte> encode_piece_data(Message message, std::span<const std::span<const std::byte>> sources,
                                         std::optional<uint64_t> checksum);

}  // namespace deltaserve::kvstore::transfer
