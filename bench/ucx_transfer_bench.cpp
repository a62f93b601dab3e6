// Transfer-layer bandwidth and latency on one host: this process sends, a forked child (forked
// before either side initialises UCX) receives, as a prefill and a decode worker would. Payloads have
// the model's shapes: KDA states (one piece per KDA layer) and MLA pages (one piece per MLA layer,
// scattered over 2048-token page groups). One figure per case = the median over --iters timed runs of
// start_send -> every piece put and announced -> the receiver verified every checksum -> its OK came
// back (so the latency includes one control round trip). Also measured in the same run: checksum64
// and memcpy throughput on one core, to show whether checksumming limits bandwidth.
//
// Output: one JSON object per line on stdout (bench/ucx_transfer.sh turns them into results lines).
// Usage: ucx_transfer_bench [--tls posix,self] [--net-devices lo] [--iters 7] [--warmup 2]
//                           [--cases name,...] [--presum] [--put | --message]
//   --presum: the sender passes checksums computed once up front (a producer that checksums a layer
//             when it writes it, or immutable prefix-cache pages), instead of checksumming per send.
//   --put:     EngineConfig::direct_copy = false (always ucp_put_nbx + flush, also over shared memory).
//   --message: direct_copy = false, carrier = kMessage (every piece's bytes inside its notice).
//   Neither:   direct copy where the region is mapped, else carrier_for_transports(--tls).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "engine/make_model.hpp"
#include "kvstore/transfer/checksum.hpp"
#include "kvstore/transfer/payload.hpp"
#include "kvstore/transfer/transfer_engine.hpp"
#include "kvstore/transfer/wire.hpp"

using namespace deltaserve;
using namespace deltaserve::kvstore::transfer;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint64_t kMlaBytesPerTokenPerLayer = 576 * 2;  // Kimi-Linear-48B: (512 latent + 64 k_rot) bf16
constexpr int kMlaLayers48b = 7;                         // 7 × 1152 = 8064 B/token
constexpr uint64_t kPageTokens = 2048;

struct Case {
  std::string name;
  std::vector<std::pair<uint64_t, uint32_t>> pieces;  // bytes, segments (page groups) per piece
  uint64_t bytes() const {
    uint64_t b = 0;
    for (auto [n, s] : pieces) b += n;
    return b;
  }
};

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  // Tiny model: the state the CPU cluster hands off (recurrent S + conv tails per KDA layer).
  auto tiny = engine::preset_config("tiny-linear").value();
  const int64_t kda_layers = tiny.num_layers_of(engine::LayerKind::kKda);
  const uint64_t tiny_layer =
      static_cast<uint64_t>(tiny.kda_state_bytes_per_request() + tiny.kda_conv_state_bytes_per_request()) /
      static_cast<uint64_t>(kda_layers);
  Case t{"kda_state_tiny_linear", {}};
  for (int64_t l = 0; l < kda_layers; ++l) t.pieces.push_back({tiny_layer, 1});
  cases.push_back(t);
  Case k{"kda_state_48b", {}};
  for (int l = 0; l < 20; ++l) k.pieces.push_back({32ull * 128 * 128 * 4, 1});  // 2 MiB per KDA layer
  cases.push_back(k);
  for (uint64_t tokens : {4096ull, 32768ull, 131072ull}) {
    Case m{"mla_pages_48b_" + std::to_string(tokens / 1024) + "k", {}};
    for (int l = 0; l < kMlaLayers48b; ++l) {
      m.pieces.push_back({tokens * kMlaBytesPerTokenPerLayer, static_cast<uint32_t>(tokens / kPageTokens)});
    }
    cases.push_back(m);
  }
  return cases;
}

struct Options {
  EngineConfig engine;
  int iters = 7;
  int warmup = 2;
  std::vector<std::string> only;
  bool presum = false;
};

void die(const std::string& what) {
  std::fprintf(stderr, "ucx_transfer_bench: %s\n", what.c_str());
  std::exit(1);
}

std::string read_line(FILE* in) {
  std::string line;
  int c;
  while ((c = std::fgetc(in)) != EOF && c != '\n') line.push_back(static_cast<char>(c));
  return line;
}

// Child: receives. Commands on stdin: "expect <case index>" -> prints "descriptor <hex>", waits,
// prints "result <CODE>"; "quit".
int receiver_main(const Options& o, const std::vector<Case>& cases, FILE* in, FILE* out) {
  auto engine = TransferEngine::create(o.engine);
  if (!engine.is_ok()) die(engine.status().to_string());
  auto& e = **engine;
  RegionId region = 0;
  int region_case = -1;
  for (;;) {
    const std::string line = read_line(in);
    if (line.empty() || line == "quit") return 0;
    const int c = std::stoi(line.substr(7));
    if (c != region_case) {
      if (region_case >= 0) (void)e.release_region(region);
      region = e.allocate_region(cases[c].bytes()).value();
      std::memset(e.region_data(region).data(), 0, cases[c].bytes());  // fault the pages in once
      region_case = c;
    }
    ReceiveSpec spec;
    spec.deadline = std::chrono::seconds(60);
    uint64_t offset = 0;
    for (auto [bytes, segments] : cases[c].pieces) {
      std::vector<LocalSegment> piece;
      const uint64_t page = bytes / segments;
      for (uint32_t s = segments; s-- > 0;) {  // page groups in reverse order: a scattered page table
        piece.push_back({region, offset + s * page, s + 1 == segments ? bytes - s * page : page});
      }
      spec.pieces.push_back(std::move(piece));
      offset += bytes;
    }
    auto expected = e.expect(std::move(spec));
    if (!expected.is_ok()) die(expected.status().to_string());
    std::fprintf(out, "descriptor %s\n", to_hex(expected->descriptor).c_str());
    std::fflush(out);
    const Status s = e.wait(expected->id);
    std::fprintf(out, "result %s\n", s.is_ok() ? "OK" : s.to_string().c_str());
    std::fflush(out);
  }
}

double gbps(uint64_t bytes, double seconds) {
  return static_cast<double>(bytes) / seconds / 1e9;
}

void measure_checksum() {
  std::vector<std::byte> a(64 << 20), b(64 << 20);
  fill_payload(a, 1, 0);
  std::memset(b.data(), 0, b.size());
  std::vector<double> sum_s, copy_s;
  uint64_t sink = 0;
  for (int i = 0; i < 7; ++i) {
    auto t0 = Clock::now();
    sink ^= checksum64(a);
    auto t1 = Clock::now();
    std::memcpy(b.data(), a.data(), a.size());
    auto t2 = Clock::now();
    sum_s.push_back(std::chrono::duration<double>(t1 - t0).count());
    copy_s.push_back(std::chrono::duration<double>(t2 - t1).count());
  }
  std::sort(sum_s.begin(), sum_s.end());
  std::sort(copy_s.begin(), copy_s.end());
  std::printf(
      "{\"kind\": \"checksum\", \"bytes\": %zu, \"checksum_gbps\": %.3f, \"memcpy_gbps\": %.3f, \"sink\": %llu}\n",
      a.size(), gbps(a.size(), sum_s[3]), gbps(a.size(), copy_s[3]), static_cast<unsigned long long>(sink & 1));
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  std::optional<EngineConfig::PieceCarrier> carrier;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) die("missing value for " + a);
      return argv[++i];
    };
    if (a == "--tls")
      o.engine.tls = next();
    else if (a == "--net-devices")
      o.engine.net_devices = next();
    else if (a == "--iters")
      o.iters = std::stoi(next());
    else if (a == "--warmup")
      o.warmup = std::stoi(next());
    else if (a == "--presum")
      o.presum = true;
    else if (a == "--put") {
      o.engine.direct_copy = false;
      carrier = EngineConfig::PieceCarrier::kPut;
    } else if (a == "--message") {
      o.engine.direct_copy = false;
      carrier = EngineConfig::PieceCarrier::kMessage;
    } else if (a == "--cases") {
      std::string list = next();
      for (size_t p = 0; p <= list.size();) {
        const size_t comma = std::min(list.find(',', p), list.size());
        o.only.push_back(list.substr(p, comma - p));
        p = comma + 1;
      }
    } else
      die("unknown argument " + a);
  }
  o.engine.carrier = carrier.value_or(carrier_for_transports(o.engine.tls));
  std::vector<Case> cases;
  for (const Case& c : all_cases()) {
    if (o.only.empty() || std::find(o.only.begin(), o.only.end(), c.name) != o.only.end()) cases.push_back(c);
  }
  measure_checksum();

  // Fork before UCX is initialised on either side.
  std::fflush(stdout);
  int to_child[2], from_child[2];
  if (pipe(to_child) != 0 || pipe(from_child) != 0) die("pipe");
  const pid_t pid = fork();
  if (pid < 0) die("fork");
  if (pid == 0) {
    close(to_child[1]);
    close(from_child[0]);
    std::exit(receiver_main(o, cases, fdopen(to_child[0], "r"), fdopen(from_child[1], "w")));
  }
  close(to_child[0]);
  close(from_child[1]);
  FILE* to = fdopen(to_child[1], "w");
  FILE* from = fdopen(from_child[0], "r");

  auto engine = TransferEngine::create(o.engine);
  if (!engine.is_ok()) die(engine.status().to_string());
  auto& e = **engine;
  for (size_t c = 0; c < cases.size(); ++c) {
    const Case& k = cases[c];
    const RegionId source = e.allocate_region(k.bytes()).value();
    fill_payload(e.region_data(source), 3, 0);
    std::vector<uint64_t> presums;
    if (o.presum) {
      uint64_t offset = 0;
      for (auto [bytes, segments] : k.pieces) {
        presums.push_back(checksum64(e.region_data(source).subspan(offset, bytes)));
        offset += bytes;
      }
    }
    std::vector<double> seconds;
    for (int it = 0; it < o.warmup + o.iters; ++it) {
      std::fprintf(to, "expect %zu\n", c);
      std::fflush(to);
      const std::string line = read_line(from);
      if (!line.starts_with("descriptor ")) die("receiver: " + line);
      const auto descriptor = from_hex(line.substr(11)).value();
      const auto t0 = Clock::now();
      const TransferId id = e.start_send(descriptor).value();
      uint64_t offset = 0;
      for (uint32_t p = 0; p < k.pieces.size(); ++p) {
        const uint64_t bytes = k.pieces[p].first;
        std::array<std::span<const std::byte>, 1> src{e.region_data(source).subspan(offset, bytes)};
        offset += bytes;
        const Status s = o.presum ? e.send_piece(id, p, src, presums[p]) : e.send_piece(id, p, src);
        if (!s.is_ok()) die(s.to_string());
        e.progress();
      }
      if (Status s = e.finish_send(id); !s.is_ok()) die(s.to_string());
      const Status s = e.wait(id);
      const auto t1 = Clock::now();
      if (!s.is_ok()) die("send: " + s.to_string());
      const std::string result = read_line(from);
      if (result != "result OK") die("receiver: " + result);
      if (it >= o.warmup) seconds.push_back(std::chrono::duration<double>(t1 - t0).count());
    }
    std::sort(seconds.begin(), seconds.end());
    const double median = seconds[seconds.size() / 2];
    uint64_t segments = 0;
    for (auto [bytes, s] : k.pieces) segments += s;
    std::printf(
        "{\"kind\": \"transfer\", \"case\": \"%s\", \"bytes\": %llu, \"pieces\": %zu, \"segments\": %llu, "
        "\"median_s\": %.6f, \"min_s\": %.6f, \"max_s\": %.6f, \"gbps\": %.3f, \"iters\": %zu}\n",
        k.name.c_str(), static_cast<unsigned long long>(k.bytes()), k.pieces.size(),
        static_cast<unsigned long long>(segments), median, seconds.front(), seconds.back(), gbps(k.bytes(), median),
        seconds.size());
    std::fflush(stdout);
    (void)e.release_region(source);
  }
  std::fprintf(to, "quit\n");
  std::fflush(to);
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
