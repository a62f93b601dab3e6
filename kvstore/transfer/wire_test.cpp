#include "kvstore/transfer/wire.hpp"

#include <algorithm>
#include <array>
#include <random>

#include <gtest/gtest.h>

#include "kvstore/transfer/checksum.hpp"
#include "kvstore/transfer/fault_injection.hpp"

namespace deltaserve::kvstore::transfer {
namespace {

Descriptor sample() {
  Descriptor d;
  d.transfer_id = 42;
  d.token = 0x1234567890ABCDEFull;
  d.deadline_ms = 5000;
  d.receiver_address = {std::byte{1}, std::byte{2}, std::byte{3}};
  d.regions.push_back({0x7f0000000000ull, 1 << 20, {std::byte{9}, std::byte{8}}});
  d.regions.push_back({0x7f1000000000ull, 4096, {std::byte{7}}});
  d.pieces = {{{0, 0, 4096}, {1, 0, 4096}}, {{0, 8192, (1 << 20) - 8192}}};
  return d;
}

TEST(TransferWire, DescriptorRoundTrip) {
  const Descriptor d = sample();
  auto decoded = decode_descriptor(encode_descriptor(d));
  ASSERT_TRUE(decoded.is_ok()) << decoded.status().to_string();
  EXPECT_EQ(*decoded, d);
  EXPECT_EQ(piece_bytes(d.pieces[0]), 8192u);
}

TEST(TransferWire, DescriptorCarriesTheChecksumKind) {
  Descriptor d = sample();
  d.checksum = ChecksumKind::kSum64;
  auto bytes = encode_descriptor(d);
  auto decoded = decode_descriptor(bytes);
  ASSERT_TRUE(decoded.is_ok()) << decoded.status().to_string();
  EXPECT_EQ(decoded->checksum, ChecksumKind::kSum64);
  bytes[6] = std::byte{2};  // the u16 after magic and version: no such kind
  decoded = decode_descriptor(bytes);
  ASSERT_FALSE(decoded.is_ok());
  EXPECT_NE(decoded.status().message().find("checksum kind"), std::string::npos);
}

TEST(TransferWire, DescriptorRejectsSegmentsOutsideRegions) {
  for (Segment bad :
       {Segment{2, 0, 1}, Segment{1, 0, 4097}, Segment{1, 4096, 1}, Segment{0, 0, 0}, Segment{0, ~0ull, 2}}) {
    Descriptor d = sample();
    d.pieces[1].push_back(bad);
    auto decoded = decode_descriptor(encode_descriptor(d));
    ASSERT_FALSE(decoded.is_ok());
    EXPECT_EQ(decoded.status().code(), StatusCode::kInvalidArgument);
  }
}

TEST(TransferWire, EveryTruncationAndTrailingByteIsRejected) {
  const auto bytes = encode_descriptor(sample());
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_FALSE(decode_descriptor(std::span(bytes).subspan(0, n)).is_ok()) << n;
  }
  auto longer = bytes;
  longer.push_back(std::byte{0});
  auto r = decode_descriptor(longer);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("trailing"), std::string::npos);
}

TEST(TransferWire, RandomMutationsNeverCrash) {
  const auto bytes = encode_descriptor(sample());
  std::mt19937_64 rng(7);
  for (int i = 0; i < 20000; ++i) {
    auto mutated = bytes;
    for (int k = 0; k < 3; ++k) mutated[rng() % mutated.size()] = static_cast<std::byte>(rng());
    auto r = decode_descriptor(mutated);
    if (r.is_ok()) {  // whatever decodes must satisfy the invariants
      for (const auto& piece : r->pieces) {
        for (const Segment& s : piece) {
          ASSERT_LT(s.region, r->regions.size());
          ASSERT_LE(s.offset + s.bytes, r->regions[s.region].bytes);
        }
      }
    }
    (void)decode_message(std::span(mutated).subspan(0, std::min<size_t>(mutated.size(), 50)));
  }
}

TEST(TransferWire, MessageRoundTripAndRejects) {
  Message m{MessageKind::kPiece, 3, 99, 7, 4096, 0xFEEDull, {std::byte{5}}, {}};
  auto bytes = encode_message(m);
  auto decoded = decode_message(bytes);
  ASSERT_TRUE(decoded.is_ok());
  EXPECT_EQ(decoded->kind, MessageKind::kPiece);
  EXPECT_EQ(decoded->seq, 7u);
  EXPECT_EQ(decoded->checksum, 0xFEEDull);
  EXPECT_EQ(decoded->blob, m.blob);
  bytes[4] = std::byte{9};  // unknown kind
  EXPECT_FALSE(decode_message(bytes).is_ok());
  EXPECT_FALSE(decode_message({}).is_ok());
}

TEST(TransferWire, PieceDataCarriesItsBytesAndChecksum) {
  std::vector<std::byte> a(100), b(37);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<std::byte>(i * 7);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::byte>(255 - i);
  std::vector<std::byte> whole(a);
  whole.insert(whole.end(), b.begin(), b.end());
  Message header{MessageKind::kPiece, 3, 99, 7, whole.size(), 0, {}, {}};
  const std::array<std::span<const std::byte>, 2> sources{a, b};
  auto bytes = encode_piece_data(header, sources, std::nullopt);
  auto decoded = decode_message(bytes);
  ASSERT_TRUE(decoded.is_ok()) << decoded.status().to_string();
  EXPECT_EQ(decoded->kind, MessageKind::kPieceData);
  EXPECT_EQ(decoded->seq, 7u);
  EXPECT_EQ(decoded->bytes, whole.size());
  EXPECT_EQ(decoded->checksum, checksum64(whole));
  EXPECT_TRUE(std::equal(decoded->payload.begin(), decoded->payload.end(), whole.begin(), whole.end()));
  // A given checksum is carried as is.
  EXPECT_EQ(decode_message(encode_piece_data(header, sources, 0x1234ull))->checksum, 0x1234ull);
  // A payload shorter or longer than announced is rejected, naming it.
  auto short_bytes = bytes;
  short_bytes.pop_back();
  auto rejected = decode_message(short_bytes);
  ASSERT_FALSE(rejected.is_ok());
  EXPECT_NE(rejected.status().message().find("piece data of 136 bytes, announced 137"), std::string::npos)
      << rejected.status().to_string();
  auto long_bytes = bytes;
  long_bytes.push_back(std::byte{0});
  EXPECT_FALSE(decode_message(long_bytes).is_ok());
  // Other kinds still refuse trailing bytes.
  auto control = encode_message(Message{MessageKind::kPiece, 3, 99, 7, 5, 0, {}, {}});
  control.push_back(std::byte{1});
  EXPECT_FALSE(decode_message(control).is_ok());
}

TEST(TransferFaults, ParsesNamedPoints) {
  auto faults = parse_faults("send.drop_piece:3,send.delay_piece:1:500,send.corrupt_byte:0,send.kill_endpoint:2");
  ASSERT_TRUE(faults.is_ok()) << faults.status().to_string();
  ASSERT_EQ(faults->size(), 4u);
  EXPECT_EQ((*faults)[1].point, FaultPoint::kDelayPiece);
  EXPECT_EQ((*faults)[1].delay_ms, 500u);
  for (const char* bad :
       {"send.nope:1", "send.drop_piece", "send.drop_piece:x", "send.delay_piece:1", "send.drop_piece:1:5"}) {
    EXPECT_FALSE(parse_faults(bad).is_ok()) << bad;
  }
}

}  // namespace
}  // namespace deltaserve::kvstore::transfer
