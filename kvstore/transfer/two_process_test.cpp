// Two processes on loopback: this test process is one side, the transfer_peer helper (posix_spawn'ed
// before this side initialises UCX) the other. Realistic payloads arrive byte-equal; each fault, a
// sender killed with SIGKILL mid-transfer and a hung receiver end in a clean error within the deadline,
// with nothing bad delivered and every resource released.
#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvstore/transfer/payload.hpp"
#include "kvstore/transfer/transfer_engine.hpp"

extern char** environ;

namespace deltaserve::kvstore::transfer {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kSeed = 77;

// A child process with pipes to its stdin and stdout; killed (SIGKILL) and reaped on destruction.
class Child {
 public:
  explicit Child(std::vector<std::string> args) {
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) return;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in[0], 0);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&actions);
    close(in[0]);
    close(out[1]);
    stdin_ = in[1];
    stdout_ = out[0];
  }
  ~Child() {
    kill_now();
    if (stdin_ >= 0) close(stdin_);
    if (stdout_ >= 0) close(stdout_);
  }
  bool started() const { return pid_ > 0; }

  void write_line(const std::string& line) {
    std::string l = line + "\n";
    size_t done = 0;
    while (done < l.size()) {
      const ssize_t n = ::write(stdin_, l.data() + done, l.size() - done);
      if (n <= 0) return;
      done += static_cast<size_t>(n);
    }
  }

  // The next line of the child's stdout, or "" after `timeout` or at EOF.
  std::string read_line(std::chrono::milliseconds timeout) {
    const auto until = Clock::now() + timeout;
    for (;;) {
      if (auto nl = buffer_.find('\n'); nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
      if (left <= 0) return "";
      pollfd p{stdout_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left)) <= 0) continue;
      char chunk[65536];
      const ssize_t n = ::read(stdout_, chunk, sizeof chunk);
      if (n <= 0) return "";
      buffer_.append(chunk, static_cast<size_t>(n));
    }
  }

  void kill_now() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  // Exit code once the child exits within `timeout`, else -1.
  int wait_exit(std::chrono::milliseconds timeout) {
    const auto until = Clock::now() + timeout;
    while (pid_ > 0 && Clock::now() < until) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(1ms);
    }
    return -1;
  }

 private:
  pid_t pid_ = -1;
  int stdin_ = -1;
  int stdout_ = -1;
  std::string buffer_;
};

struct Transport {
  const char* name;
  std::string tls;
  std::string net_devices;
  bool detect_peer_failure;
};

const Transport kShm{"shm", "posix,self", "", false};
const Transport kTcp{"tcp", "tcp,self", "lo", true};

EngineConfig engine_config(const Transport& t) {
  EngineConfig c;
  c.tls = t.tls;
  c.net_devices = t.net_devices;
  c.detect_peer_failure = t.detect_peer_failure;
  c.carrier = carrier_for_transports(t.tls);  // as the cluster chooses it (the peer tool does the same)
  c.finish_grace = 100ms;
  return c;
}

std::vector<std::string> peer_args(const std::string& mode, const Transport& t, std::vector<std::string> extra) {
  std::vector<std::string> args{DS_TRANSFER_PEER_PATH, mode, "--tls", t.tls, "--seed", std::to_string(kSeed)};
  if (!t.net_devices.empty()) args.insert(args.end(), {"--net-devices", t.net_devices});
  if (t.detect_peer_failure) args.push_back("--detect-peer-failure");
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// Receiving side in this process: one region, piece p = pieces[p] bytes at consecutive offsets, each
// piece split over `pages` equal segments placed in reverse page order (a scattered page table).
struct Receiver {
  std::unique_ptr<TransferEngine> engine;
  RegionId region = 0;
  ExpectedTransfer expected;
  std::vector<std::vector<LocalSegment>> layout;
  uint64_t total = 0;

  Receiver(const Transport& t, const std::vector<uint64_t>& pieces, uint32_t pages,
           std::chrono::milliseconds deadline) {
    auto e = TransferEngine::create(engine_config(t));
    EXPECT_TRUE(e.is_ok()) << e.status().to_string();
    if (!e.is_ok()) return;
    engine = std::move(e).value();
    for (uint64_t b : pieces) total += b;
    region = engine->allocate_region(total).value();
    std::memset(engine->region_data(region).data(), 0, total);
    uint64_t offset = 0;
    for (uint64_t bytes : pieces) {
      std::vector<LocalSegment> segments;
      const uint64_t page = bytes / pages;
      for (uint32_t k = pages; k-- > 0;) {
        const uint64_t start = k * page, end = k + 1 == pages ? bytes : start + page;
        segments.push_back({region, offset + start, end - start});
      }
      layout.push_back(std::move(segments));
      offset += bytes;
    }
    expected = engine->expect({layout, deadline, {}}).value();
  }

  // The sender fills wire byte i with payload_byte(kSeed, i); wire order = pieces, then segments.
  bool payload_delivered() {
    auto data = engine->region_data(region);
    uint64_t wire = 0;
    for (const auto& piece : layout) {
      for (const LocalSegment& s : piece) {
        if (!payload_matches(data.subspan(s.offset, s.bytes), kSeed, wire)) return false;
        wire += s.bytes;
      }
    }
    return true;
  }

  // Progresses until the transfer finishes (or `limit`); optional hook runs each round.
  Status wait(std::chrono::milliseconds limit, const std::function<void()>& each_round = {}) {
    const auto until = Clock::now() + limit;
    while (Clock::now() < until) {
      engine->progress();
      if (auto s = engine->try_take(expected.id)) return *s;
      if (each_round) each_round();
    }
    return Status(StatusCode::kInternal, "test: receiver did not finish in time");
  }

  void expect_released() {
    const EngineStats s = engine->stats();
    EXPECT_EQ(s.region_uses, 0);
    EXPECT_EQ(s.requests_in_flight, 0);
    EXPECT_EQ(s.rkey_uses, 0);
    EXPECT_EQ(s.transfers, 0);
    EXPECT_EQ(s.transfers_pending, 0);
  }
};

// Kimi-Linear-48B shapes: KDA state 20 layers × 2 MiB (one piece per layer), MLA pages of 4096 tokens
// 7 layers × 4096 × 1152 B (one piece per layer, 2 page groups of 2048 tokens each).
std::vector<uint64_t> kimi_48b_pieces(uint64_t mla_tokens) {
  std::vector<uint64_t> pieces(20, 2ull << 20);
  for (int l = 0; l < 7; ++l) pieces.push_back(mla_tokens * 1152);
  return pieces;
}

class TwoProcessTransfer : public ::testing::TestWithParam<Transport> {};

TEST_P(TwoProcessTransfer, RealisticPayloadArrivesByteEqual) {
  const Transport& t = GetParam();
  // shm: full 48B state + 4k tokens of MLA (73 MiB); tcp: the state only (40 MiB), tcp puts are slower.
  const auto pieces = t.detect_peer_failure ? std::vector<uint64_t>(20, 2ull << 20) : kimi_48b_pieces(4096);
  Child child(peer_args("send", t, {}));
  ASSERT_TRUE(child.started());
  Receiver rx(t, pieces, 2, 20s);
  ASSERT_TRUE(rx.engine);
  child.write_line("descriptor " + to_hex(rx.expected.descriptor));
  const auto start = Clock::now();
  const Status s = rx.wait(25s);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_TRUE(rx.payload_delivered());
  EXPECT_EQ(child.read_line(5s), "result OK ");
  EXPECT_EQ(child.wait_exit(5s), 0);
  std::printf("%s: %.1f MiB in %.3f s (incl. sender start-up and payload generation)\n", t.name, rx.total / 1048576.0,
              seconds);
  rx.expect_released();
}

// Each injected fault ends in a clean error on the receiving side within the deadline, and the
// payload is never reported delivered.
struct FaultCase {
  const char* faults;
  StatusCode receiver_code;
  const char* message_part;
};

TEST_P(TwoProcessTransfer, InjectedFaultsFailCleanlyWithinTheDeadline) {
  const Transport& t = GetParam();
  const auto deadline = 1500ms;
  for (const FaultCase& f : {FaultCase{"send.drop_piece:3", StatusCode::kDataLoss, "never arrived"},
                             FaultCase{"send.corrupt_byte:5", StatusCode::kDataLoss, "checksum mismatch"},
                             FaultCase{"send.delay_piece:2:60000", StatusCode::kDeadlineExceeded, "deadline"}}) {
    SCOPED_TRACE(f.faults);
    Child child(peer_args("send", t, {"--faults", f.faults}));
    ASSERT_TRUE(child.started());
    Receiver rx(t, std::vector<uint64_t>(8, 1 << 20), 4, deadline);
    ASSERT_TRUE(rx.engine);
    const auto start = Clock::now();
    child.write_line("descriptor " + to_hex(rx.expected.descriptor));
    const Status s = rx.wait(deadline + 2s);
    EXPECT_LE(Clock::now() - start, deadline + 1000ms);
    EXPECT_EQ(s.code(), f.receiver_code) << s.to_string();
    EXPECT_NE(s.message().find(f.message_part), std::string::npos) << s.to_string();
    rx.expect_released();
    // The sender learns the receiver's verdict (or its own deadline) and exits non-zero.
    EXPECT_TRUE(child.read_line(deadline + 2s).starts_with("result "));
    EXPECT_EQ(child.wait_exit(2s), 1);
  }
}

TEST_P(TwoProcessTransfer, SenderKilledMidTransferFailsCleanly) {
  const Transport& t = GetParam();
  const auto deadline = 2000ms;
  Child child(peer_args("send", t, {"--stall-after", "3"}));
  ASSERT_TRUE(child.started());
  Receiver rx(t, std::vector<uint64_t>(8, 1 << 20), 2, deadline);
  ASSERT_TRUE(rx.engine);
  const auto start = Clock::now();
  child.write_line("descriptor " + to_hex(rx.expected.descriptor));
  // Once this side verified the three pieces the sender sent before stalling, SIGKILL the sender.
  Clock::time_point killed{};
  const Status s = rx.wait(deadline + 2s, [&] {
    if (killed == Clock::time_point{} && rx.engine->pieces_verified(rx.expected.id).value_or(0) >= 3) {
      child.kill_now();
      killed = Clock::now();
    }
  });
  ASSERT_NE(killed, Clock::time_point{}) << s.to_string();
  EXPECT_LE(Clock::now() - start, deadline + 1000ms);
  if (t.detect_peer_failure) {
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.to_string();  // noticed at once, not at the deadline
    EXPECT_LT(Clock::now() - killed, 1000ms);
  } else {
    EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.to_string();  // shm: no peer failure detection
  }
  rx.expect_released();
  std::printf("%s: sender killed after 3/8 pieces -> %s\n", t.name, s.to_string().c_str());
}

// The sender dies while it streams (pieces in flight, none held back): the receiving process carries on and
// fails only the transfer. Over tcp this is what PieceCarrier::kMessage is for: with emulated puts, UCX aborts
// the receiver when it acknowledges a put whose sender is gone. Several rounds, each killing at a different
// point of the stream.
TEST_P(TwoProcessTransfer, SenderKilledWhileStreamingLeavesTheReceiverRunning) {
  const Transport& t = GetParam();
  const auto deadline = 2000ms;
  for (uint32_t kill_after : {1u, 4u, 16u, 40u}) {
    SCOPED_TRACE("killed after " + std::to_string(kill_after) + " verified pieces");
    Child child(peer_args("send", t, {}));
    ASSERT_TRUE(child.started());
    Receiver rx(t, std::vector<uint64_t>(64, 1 << 20), 2, deadline);
    ASSERT_TRUE(rx.engine);
    child.write_line("descriptor " + to_hex(rx.expected.descriptor));
    bool killed = false;
    const Status s = rx.wait(deadline + 2s, [&] {
      if (!killed && rx.engine->pieces_verified(rx.expected.id).value_or(0) >= kill_after) {
        child.kill_now();
        killed = true;
      }
    });
    if (!killed) {  // the stream outran the check: every piece arrived
      std::printf("%s: every piece arrived before the kill\n", t.name);
      EXPECT_TRUE(s.is_ok()) << s.to_string();
      child.kill_now();
      continue;
    }
    // Either the sender's death was noticed or, when its last pieces were already out, the transfer completed.
    std::printf("%s: sender killed after %u verified pieces -> %s\n", t.name, kill_after, s.to_string().c_str());
    if (s.is_ok()) {
      EXPECT_TRUE(rx.payload_delivered());
    } else {
      EXPECT_EQ(s.code(), t.detect_peer_failure ? StatusCode::kUnavailable : StatusCode::kDeadlineExceeded)
          << s.to_string();
    }
    rx.expect_released();
  }
}

TEST_P(TwoProcessTransfer, HungReceiverFailsTheSenderWithinTheDeadline) {
  const Transport& t = GetParam();
  const uint32_t deadline_ms = 1000;
  Child child(peer_args(
      "recv", t, {std::to_string(8 << 20), "4", "--stall-after", "0", "--deadline-ms", std::to_string(deadline_ms)}));
  ASSERT_TRUE(child.started());
  const std::string line = child.read_line(5s);
  ASSERT_TRUE(line.starts_with("descriptor ")) << line;
  auto descriptor = from_hex(line.substr(11)).value();
  auto engine = TransferEngine::create(engine_config(t)).value();
  const RegionId source = engine->allocate_region(8 << 20).value();
  fill_payload(engine->region_data(source), kSeed, 0);
  const auto start = Clock::now();
  const TransferId id = engine->start_send(descriptor).value();
  for (uint32_t p = 0; p < 4; ++p) {
    std::array<std::span<const std::byte>, 1> src{engine->region_data(source).subspan(p * (2 << 20), 2 << 20)};
    ASSERT_TRUE(engine->send_piece(id, p, src).is_ok());
  }
  ASSERT_TRUE(engine->finish_send(id).is_ok());
  const Status s = engine->wait(id);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.to_string();
  EXPECT_LE(Clock::now() - start, std::chrono::milliseconds(deadline_ms) + 1000ms);
  const EngineStats stats = engine->stats();
  EXPECT_EQ(stats.requests_in_flight, 0);
  EXPECT_EQ(stats.rkey_uses, 0);
  EXPECT_EQ(stats.transfers, 0);
  // The receiver never answered, so its endpoint was closed and its rkeys destroyed.
  EXPECT_EQ(stats.endpoints, 0);
  EXPECT_EQ(stats.rkeys, 0);
  child.kill_now();
  EXPECT_TRUE(engine->release_region(source).is_ok());
}

INSTANTIATE_TEST_SUITE_P(Loopback, TwoProcessTransfer, ::testing::Values(kShm, kTcp),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace deltaserve::kvstore::transfer
