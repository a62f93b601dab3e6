// Two engines in one process over shared memory (posix,self): placement, verification, every fault
// point, deadlines, and that every registration use, request, rkey and transfer is released.
#include "kvstore/transfer/transfer_engine.hpp"

#include <cstring>
#include <tuple>

#include <gtest/gtest.h>

#include "kvstore/transfer/checksum.hpp"

namespace deltaserve::kvstore::transfer {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kPiece = 256 << 10;  // bytes per piece
constexpr uint32_t kPieces = 6;

std::byte pattern(uint64_t i, uint64_t seed) {
  uint64_t x = (i / 8 + 1) * 0x9E3779B97F4A7C15ull ^ seed;
  x ^= x >> 29;
  return static_cast<std::byte>(x >> (8 * (i % 8)));
}

// How the sender moves piece bytes: a CPU copy into the mapped region, puts, or inside the notice.
enum class Path { kDirect, kPut, kMessage };

std::unique_ptr<TransferEngine> make_engine(const std::string& faults = "", bool progress_thread = false,
                                            Path path = Path::kDirect) {
  EngineConfig config;
  config.direct_copy = path == Path::kDirect;
  config.carrier = path == Path::kMessage ? EngineConfig::PieceCarrier::kMessage : EngineConfig::PieceCarrier::kPut;
  config.tls = "posix,self";
  config.faults = faults;
  config.progress_thread = progress_thread;
  config.finish_grace = 100ms;
  auto engine = TransferEngine::create(config);
  EXPECT_TRUE(engine.is_ok()) << engine.status().to_string();
  return engine.is_ok() ? std::move(engine).value() : nullptr;
}

void expect_released(TransferEngine& engine, int64_t regions) {
  const EngineStats s = engine.stats();
  EXPECT_EQ(s.regions, regions);
  EXPECT_EQ(s.region_uses, 0);
  EXPECT_EQ(s.requests_in_flight, 0);
  EXPECT_EQ(s.rkey_uses, 0);
  EXPECT_EQ(s.transfers, 0);
  EXPECT_EQ(s.transfers_pending, 0);
}

// Receiver region holds kPieces pieces, each scattered over two segments in reverse order (the second
// half of a piece lands before its first half); the sender gathers each piece from two spans.
struct Pair {
  std::unique_ptr<TransferEngine> receiver;
  std::unique_ptr<TransferEngine> sender;
  RegionId destination = 0;
  RegionId source = 0;
  ExpectedTransfer expected;
  TransferId send_id = 0;

  explicit Pair(const std::string& sender_faults = "", std::chrono::milliseconds deadline = 5000ms,
                Path path = Path::kDirect) {
    receiver = make_engine();
    sender = make_engine(sender_faults, false, path);
    destination = receiver->allocate_region(kPieces * kPiece).value();
    source = sender->allocate_region(kPieces * kPiece).value();
    auto src = sender->region_data(source);
    for (uint64_t i = 0; i < src.size(); ++i) src[i] = pattern(i, 11);
    std::memset(receiver->region_data(destination).data(), 0, kPieces * kPiece);
    ReceiveSpec spec;
    spec.deadline = deadline;
    for (uint32_t p = 0; p < kPieces; ++p) {
      const uint64_t base = p * kPiece;
      spec.pieces.push_back({{destination, base + kPiece / 2, kPiece / 2}, {destination, base, kPiece / 2}});
    }
    expected = receiver->expect(std::move(spec)).value();
    send_id = sender->start_send(expected.descriptor).value();
  }

  // Source bytes of piece p in its wire order (second half of the slot first).
  std::array<std::span<const std::byte>, 2> piece_sources(uint32_t p) {
    auto src = sender->region_data(source).subspan(p * kPiece, kPiece);
    return {src.subspan(kPiece / 2), src.subspan(0, kPiece / 2)};
  }

  Status send_all(bool finish = true) {
    for (uint32_t p = kPieces; p-- > 0;) {  // out of order
      auto sources = piece_sources(p);
      Status s = sender->send_piece(send_id, p, sources);
      if (!s.is_ok()) return s;
    }
    return finish ? sender->finish_send(send_id) : Status::ok();
  }

  // Pumps both engines until both transfers finished; returns {receiver, sender} statuses.
  std::pair<Status, Status> run(std::chrono::milliseconds limit = 10s) {
    std::optional<Status> r, s;
    const auto until = Clock::now() + limit;
    while ((!r || !s) && Clock::now() < until) {
      receiver->progress();
      sender->progress();
      if (!r) r = receiver->try_take(expected.id);
      if (!s) s = sender->try_take(send_id);
    }
    return {r.value_or(Status(StatusCode::kInternal, "test timeout")),
            s.value_or(Status(StatusCode::kInternal, "test timeout"))};
  }

  bool destination_matches() {
    auto src = sender->region_data(source);
    auto dst = receiver->region_data(destination);
    return std::memcmp(src.data(), dst.data(), src.size()) == 0;
  }
};

TEST(TransferEngine, ReportsMemoryTypes) {
  auto engine = make_engine();
  const MemoryInfo info = engine->memory_info();
  EXPECT_TRUE(info.host);
  EXPECT_EQ(info.transports, "posix,self");
  std::printf("UCX memory types mask 0x%llx, cuda %d, cuda_managed %d\n",
              static_cast<unsigned long long>(info.memory_type_mask), info.cuda, info.cuda_managed);
  EXPECT_FALSE(engine->worker_address().empty());
}

TEST(TransferEngine, ScatterGatherPiecesArriveVerified) {
  Pair pair;
  ASSERT_TRUE(pair.send_all().is_ok());
  auto [r, s] = pair.run();
  EXPECT_TRUE(r.is_ok()) << r.to_string();
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_TRUE(pair.destination_matches());
  EXPECT_EQ(pair.receiver->stats().bytes_received, kPieces * kPiece);
  EXPECT_EQ(pair.sender->stats().bytes_sent, kPieces * kPiece);
  expect_released(*pair.receiver, 1);
  expect_released(*pair.sender, 1);
  EXPECT_TRUE(pair.receiver->release_region(pair.destination).is_ok());
}

// The same with ucp_put_nbx (direct_copy off): puts, an endpoint flush per piece, then the notice.
TEST(TransferEngine, PutPathPiecesArriveVerified) {
  Pair pair("", 5000ms, Path::kPut);
  ASSERT_TRUE(pair.send_all().is_ok());
  auto [r, s] = pair.run();
  EXPECT_TRUE(r.is_ok()) << r.to_string();
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_TRUE(pair.destination_matches());
  expect_released(*pair.receiver, 1);
  expect_released(*pair.sender, 1);
}

TEST(TransferEngine, PutPathCorruptedByteIsDetected) {
  Pair pair("send.corrupt_byte:0", 5000ms, Path::kPut);
  ASSERT_TRUE(pair.send_all().is_ok());
  auto [r, s] = pair.run();
  EXPECT_EQ(r.code(), StatusCode::kDataLoss) << r.to_string();
  EXPECT_NE(r.message().find("piece 0: checksum mismatch"), std::string::npos) << r.to_string();
  EXPECT_FALSE(pair.destination_matches());
  expect_released(*pair.receiver, 1);
  expect_released(*pair.sender, 1);
}

// PieceCarrier::kMessage: each piece's bytes inside its notice, placed and checksummed by the receiver.
TEST(TransferEngine, MessagePathPiecesArriveVerified) {
  Pair pair("", 5000ms, Path::kMessage);
  ASSERT_TRUE(pair.send_all().is_ok());
  auto [r, s] = pair.run();
  EXPECT_TRUE(r.is_ok()) << r.to_string();
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_TRUE(pair.destination_matches());
  EXPECT_EQ(pair.receiver->stats().bytes_received, kPieces * kPiece);
  EXPECT_EQ(pair.sender->stats().bytes_sent, kPieces * kPiece);
  expect_released(*pair.receiver, 1);
  expect_released(*pair.sender, 1);
}

TEST(TransferEngine, MessagePathFaultsEndInCleanErrors) {
  for (const auto& [faults, code, part] :
       {std::tuple{"send.corrupt_byte:2", StatusCode::kDataLoss, "piece 2: checksum mismatch"},
        std::tuple{"send.drop_piece:1", StatusCode::kDataLoss, "never arrived"},
        std::tuple{"send.delay_piece:4:60000", StatusCode::kDeadlineExceeded, "deadline"}}) {
    SCOPED_TRACE(faults);
    Pair pair(faults, 1000ms, Path::kMessage);
    ASSERT_TRUE(pair.send_all().is_ok());
    auto [r, s] = pair.run();
    EXPECT_EQ(r.code(), code) << r.to_string();
    EXPECT_NE(r.message().find(part), std::string::npos) << r.to_string();
    EXPECT_FALSE(s.is_ok());
    expect_released(*pair.receiver, 1);
    expect_released(*pair.sender, 1);
  }
}

TEST(TransferEngine, CarrierFollowsTheTransports) {
  using C = EngineConfig::PieceCarrier;
  for (const char* tls : {"tcp,self", "tcp", "ud,self", "ud_verbs,sm", "rc,tcp,self", "all", "", "^rc"}) {
    EXPECT_EQ(carrier_for_transports(tls), C::kMessage) << tls;
  }
  for (const char* tls : {"rc,sm,self", "posix,self", "rc_mlx5,dc_mlx5,self", "cuda_ipc,cuda_copy,rc,self", "sm"}) {
    EXPECT_EQ(carrier_for_transports(tls), C::kPut) << tls;
  }
}

TEST(TransferEngine, SourcesOutsideRegisteredMemoryWork) {
  Pair pair;
  std::vector<std::byte> copy(pair.sender->region_data(pair.source).begin(),
                              pair.sender->region_data(pair.source).end());
  for (uint32_t p = 0; p < kPieces; ++p) {
    std::array<std::span<const std::byte>, 1> one{std::span<const std::byte>(copy).subspan(p * kPiece, kPiece)};
    // Wire order of piece p is (second half, first half): send a rotated copy.
    std::vector<std::byte> rotated(kPiece);
    std::memcpy(rotated.data(), one[0].data() + kPiece / 2, kPiece / 2);
    std::memcpy(rotated.data() + kPiece / 2, one[0].data(), kPiece / 2);
    std::memcpy(copy.data() + p * kPiece, rotated.data(), kPiece);
    ASSERT_TRUE(pair.sender->send_piece(pair.send_id, p, one).is_ok());
  }
  ASSERT_TRUE(pair.sender->finish_send(pair.send_id).is_ok());
  auto [r, s] = pair.run();
  EXPECT_TRUE(r.is_ok()) << r.to_string();
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_TRUE(pair.destination_matches());
}

TEST(TransferEngine, RejectsBadSendCalls) {
  Pair pair;
  auto sources = pair.piece_sources(0);
  std::array<std::span<const std::byte>, 1> short_source{sources[0]};
  EXPECT_EQ(pair.sender->send_piece(pair.send_id, 0, short_source).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(pair.sender->send_piece(pair.send_id, kPieces, sources).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(pair.sender->send_piece(999, 0, sources).code(), StatusCode::kNotFound);
  ASSERT_TRUE(pair.sender->send_piece(pair.send_id, 0, sources).is_ok());
  EXPECT_EQ(pair.sender->send_piece(pair.send_id, 0, sources).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(pair.sender->finish_send(pair.send_id).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(pair.sender->start_send(pair.expected.descriptor).status().code(), StatusCode::kFailedPrecondition);
  auto garbage = pair.expected.descriptor;
  garbage.resize(garbage.size() / 2);
  EXPECT_EQ(pair.sender->start_send(garbage).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(pair.receiver->release_region(pair.destination).code(), StatusCode::kFailedPrecondition);
  pair.sender->abort(pair.send_id, Status::ok());
  auto [r, s] = pair.run();
  EXPECT_EQ(s.code(), StatusCode::kCancelled);
  EXPECT_EQ(r.code(), StatusCode::kCancelled) << r.to_string();  // the sender's abort reached the receiver
  expect_released(*pair.receiver, 1);
  expect_released(*pair.sender, 1);
}

TEST(TransferEngine, ExpectValidatesPlacement) {
  auto engine = make_engine();
  const RegionId region = engine->allocate_region(4096).value();
  EXPECT_EQ(engine->expect({{{{region, 4000, 200}}}, 1s, {}}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->expect({{{{region + 7, 0, 1}}}, 1s, {}}).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(engine->expect({{}, 1s, {}}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->expect({{{{region, 0, 1}}}, 0ms, {}}).status().code(), StatusCode::kInvalidArgument);
  expect_released(*engine, 1);
}

TEST(TransferEngine, DroppedPieceIsDataLossAndNothingIsDelivered) {
  Pair pair("send.drop_piece:2");
  ASSERT_TRUE(pair.send_all().is_ok());
  auto [r, s] = pair.run();
  EXPECT_EQ(r.code(), StatusCode::kDataLoss) << r.to_string();
  EXPECT_NE(r.message().find("piece(s) 2 never arrived"), std::string::npos) << r.to_string();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.to_string();
  expect_released(*pair.receiver, 1);
  expect_released(*pair.sender, 1);
}

TEST(TransferEngine, CorruptedByteIsDetected) {
  Pair pair("send.corrupt_byte:4");
  ASSERT_TRUE(pair.send_all().is_ok());
  auto [r, s] = pair.run();
  EXPECT_EQ(r.code(), StatusCode::kDataLoss) << r.to_string();
  EXPECT_NE(r.message().find("piece 4: checksum mismatch"), std::string::npos) << r.to_string();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_EQ(pair.receiver->stats().pieces_rejected, 1u);
  EXPECT_FALSE(pair.destination_matches());  // the fault really changed a byte
  expect_released(*pair.receiver, 1);
  expect_released(*pair.sender, 1);
}

TEST(TransferEngine, DelayPastDeadlineFailsBothSidesWithinTheDeadline) {
  const auto start = Clock::now();
  Pair pair("send.delay_piece:1:5000", 300ms);
  ASSERT_TRUE(pair.send_all().is_ok());
  auto [r, s] = pair.run();
  const auto elapsed = Clock::now() - start;
  EXPECT_EQ(r.code(), StatusCode::kDeadlineExceeded) << r.to_string();
  EXPECT_NE(s.code(), StatusCode::kOk);
  EXPECT_LT(elapsed, 300ms + 1000ms);  // slack for a loaded CI machine
  expect_released(*pair.receiver, 1);
  expect_released(*pair.sender, 1);
}

TEST(TransferEngine, ShortDelayWithinDeadlineStillCompletes) {
  Pair pair("send.delay_piece:0:50", 3000ms);
  ASSERT_TRUE(pair.send_all().is_ok());
  auto [r, s] = pair.run();
  EXPECT_TRUE(r.is_ok()) << r.to_string();
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_TRUE(pair.destination_matches());
}

TEST(TransferEngine, KilledEndpointFailsSenderAtOnceAndReceiverByItsDeadline) {
  Pair pair("send.kill_endpoint:3", 400ms);
  const Status sent = pair.send_all();
  EXPECT_EQ(sent.code(), StatusCode::kUnavailable) << sent.to_string();
  const auto start = Clock::now();
  auto [r, s] = pair.run();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_EQ(r.code(), StatusCode::kDeadlineExceeded) << r.to_string();
  EXPECT_LT(Clock::now() - start, 400ms + 1000ms);
  expect_released(*pair.receiver, 1);
  expect_released(*pair.sender, 1);
  EXPECT_EQ(pair.sender->stats().endpoints, 0);
  EXPECT_EQ(pair.sender->stats().rkeys, 0);  // the failed peer's cached rkeys are destroyed
}

TEST(TransferEngine, SenderThatNeverFinishesHitsTheDeadline) {
  Pair pair("", 200ms);
  ASSERT_TRUE(pair.send_all(/*finish=*/false).is_ok());
  auto [r, s] = pair.run();
  EXPECT_EQ(r.code(), StatusCode::kDeadlineExceeded) << r.to_string();
  // Both ends run under the descriptor's one deadline, so the receiver ends on whichever expiry it sees first: its
  // own (every piece verified, no finish) or the sender's abort (every piece sent). A stall of the test thread
  // between the two engines' progress calls decides which; both are this test's outcome.
  const bool own_expiry = r.message().find("6/6 pieces verified") != std::string::npos;
  const bool sender_expiry = r.message().find("sender aborted") != std::string::npos &&
                             r.message().find("6/6 pieces sent") != std::string::npos;
  EXPECT_TRUE(own_expiry || sender_expiry) << r.to_string();
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  expect_released(*pair.receiver, 1);
  expect_released(*pair.sender, 1);
}

TEST(TransferEngine, PrecomputedChecksumsAreVerifiedToo) {
  Pair pair;
  for (uint32_t p = 0; p < kPieces; ++p) {
    auto sources = pair.piece_sources(p);
    Checksum64 sum;
    for (auto s : sources) sum.update(s);
    const uint64_t value = p == 1 ? sum.finish() ^ 1 : sum.finish();  // piece 1 carries a wrong value
    ASSERT_TRUE(pair.sender->send_piece(pair.send_id, p, sources, value).is_ok());
  }
  ASSERT_TRUE(pair.sender->finish_send(pair.send_id).is_ok());
  auto [r, s] = pair.run();
  EXPECT_EQ(r.code(), StatusCode::kDataLoss) << r.to_string();
  EXPECT_NE(r.message().find("piece 1: checksum mismatch"), std::string::npos) << r.to_string();
  expect_released(*pair.receiver, 1);
  expect_released(*pair.sender, 1);
}

TEST(TransferEngine, ProgressThreadAndCallbacks) {
  auto receiver = make_engine("", /*progress_thread=*/true);
  auto sender = make_engine("", /*progress_thread=*/true);
  const RegionId dst = receiver->allocate_region(1 << 20).value();
  std::vector<std::byte> src(1 << 20);
  for (size_t i = 0; i < src.size(); ++i) src[i] = pattern(i, 5);
  std::atomic<int> done{0};
  std::atomic<bool> receive_ok{false};
  ReceiveSpec spec{{{{dst, 0, 1 << 19}}, {{dst, 1 << 19, 1 << 19}}}, 5000ms, [&](TransferId, const Status& s) {
                     receive_ok = s.is_ok();
                     ++done;
                   }};
  auto expected = receiver->expect(std::move(spec)).value();
  const TransferId id = sender->start_send(expected.descriptor).value();
  for (uint32_t p = 0; p < 2; ++p) {
    std::array<std::span<const std::byte>, 1> s{std::span<const std::byte>(src).subspan(p << 19, 1 << 19)};
    ASSERT_TRUE(sender->send_piece(id, p, s).is_ok());
  }
  ASSERT_TRUE(sender->finish_send(id).is_ok());
  EXPECT_TRUE(sender->wait(id).is_ok());
  const auto until = Clock::now() + 5s;
  while (done == 0 && Clock::now() < until) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE(receive_ok);
  EXPECT_EQ(std::memcmp(receiver->region_data(dst).data(), src.data(), src.size()), 0);
  expect_released(*receiver, 1);
  expect_released(*sender, 0);
}

}  // namespace
}  // namespace deltaserve::kvstore::transfer
