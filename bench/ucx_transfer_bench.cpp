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
//                           [--cases name,...] [--presum] [--put | --message] [--memory host|cuda]
//   --memory cuda: both sides' regions are GPU memory (cudaMalloc, register_device_region; pieces checksummed
//             with kSum64 on the GPU); needs a UCX that registers CUDA memory (libucx-cu13) and a build with
//             CUDA. The peer is `ucx_perftest -t ucp_put_bw -m cuda,cuda` on the same UCX_TLS
//             (bench/gpu/handoff.sh runs both). Also measured then: the GPU checksum's throughput and the
//             device-to-device copy bandwidth of the same GPU.
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
#if DS_BENCH_CUDA
#include <cuda_runtime_api.h>

#include "kvstore/transfer/cuda/cuda_device_memory.hpp"
#endif

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
  // Back-to-back pieces of one size: the transfer engine's streaming bandwidth, the figure that
  // `ucx_perftest -t ucp_put_bw -s SIZE` gives for raw puts.
  for (auto [mib, count] : {std::pair{4ull, 32u}, {16ull, 16u}, {64ull, 8u}}) {
    Case c{"pieces_" + std::to_string(mib) + "m_x" + std::to_string(count), {}};
    for (uint32_t p = 0; p < count; ++p) c.pieces.push_back({mib << 20, 1});
    cases.push_back(c);
  }
  return cases;
}

struct Options {
  EngineConfig engine;
  int iters = 7;
  int warmup = 2;
  std::vector<std::string> only;
  bool presum = false;
  bool cuda = false;  // --memory cuda
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

// A region of either memory kind; GPU memory is cudaMalloc'ed and registered with register_device_region.
struct Buffer {
  RegionId region = 0;
  std::byte* data = nullptr;
  uint64_t bytes = 0;
  bool cuda = false;
};

Buffer allocate(TransferEngine& e, uint64_t bytes, bool cuda) {
  Buffer b{0, nullptr, bytes, cuda};
#if DS_BENCH_CUDA
  if (cuda) {
    if (cudaMalloc(reinterpret_cast<void**>(&b.data), bytes) != cudaSuccess) die("cudaMalloc");
    auto region = e.register_device_region(b.data, bytes);
    if (!region.is_ok()) die(region.status().to_string());
    b.region = *region;
    return b;
  }
#endif
  if (cuda) die("--memory cuda: this build has no CUDA");
  b.region = e.allocate_region(bytes).value();
  b.data = e.region_data(b.region).data();
  return b;
}

void release(TransferEngine& e, Buffer& b) {
  (void)e.release_region(b.region);
#if DS_BENCH_CUDA
  if (b.cuda) cudaFree(b.data);
#endif
  b = {};
}

void fill(const Buffer& b, std::span<const std::byte> host) {
#if DS_BENCH_CUDA
  if (b.cuda) {
    if (cudaMemcpy(b.data, host.data(), host.size(), cudaMemcpyHostToDevice) != cudaSuccess) die("cudaMemcpy");
    return;
  }
#endif
  std::memcpy(b.data, host.data(), host.size());
}

// With --memory cuda, each process makes its own CUDA context after the fork.
void attach_device(Options& o) {
#if DS_BENCH_CUDA
  if (o.cuda) {
    auto memory = kvstore::transfer::cuda::CudaDeviceMemory::create();
    if (!memory.is_ok()) die(memory.status().to_string());
    o.engine.device = *memory;
  }
#else
  (void)o;
#endif
}

// Child: receives. Commands on stdin: "expect <case index>" -> prints "descriptor <hex>", waits,
// prints "result <CODE>"; "quit".
int receiver_main(Options o, const std::vector<Case>& cases, FILE* in, FILE* out) {
  attach_device(o);
  auto engine = TransferEngine::create(o.engine);
  if (!engine.is_ok()) die(engine.status().to_string());
  auto& e = **engine;
  Buffer buffer;
  RegionId region = 0;
  int region_case = -1;
  for (;;) {
    const std::string line = read_line(in);
    if (line.empty() || line == "quit") return 0;
    const int c = std::stoi(line.substr(7));
    if (c != region_case) {
      if (region_case >= 0) release(e, buffer);
      buffer = allocate(e, cases[c].bytes(), o.cuda);
      region = buffer.region;
      fill(buffer, std::vector<std::byte>(cases[c].bytes()));  // fault the pages in once
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
    const EngineStats before = e.stats();
    const Status s = e.wait(expected->id);
    const EngineStats after = e.stats();
    // "OK <pieces verified> <their verify microseconds>": where the receiver's time went (EngineStats).
    std::fprintf(out, "result %s %llu %llu\n", s.is_ok() ? "OK" : s.to_string().c_str(),
                 static_cast<unsigned long long>(after.pieces_verified - before.pieces_verified),
                 static_cast<unsigned long long>(after.piece_verify_us - before.piece_verify_us));
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

// The GPU checksum against the GPU's own copy bandwidth (the limit it runs against: a checksum reads each
// byte once, a device-to-device copy reads and writes it).
void measure_gpu_checksum(const std::shared_ptr<DeviceMemory>& device) {
#if DS_BENCH_CUDA
  const uint64_t bytes = 256ull << 20;
  std::byte *a = nullptr, *b = nullptr;
  if (cudaMalloc(reinterpret_cast<void**>(&a), bytes) != cudaSuccess ||
      cudaMalloc(reinterpret_cast<void**>(&b), bytes) != cudaSuccess) {
    die("cudaMalloc");
  }
  cudaMemset(a, 1, bytes);
  std::vector<double> sum_s, copy_s;
  const std::span<const std::byte> span(a, bytes);
  for (int i = 0; i < 9; ++i) {
    auto t0 = Clock::now();
    auto ticket = device->begin_checksum(std::span(&span, 1));
    if (!ticket.is_ok()) die(ticket.status().to_string());
    std::optional<Result<uint64_t>> value;
    while (!(value = device->poll_checksum(*ticket))) {
    }
    auto t1 = Clock::now();
    if (cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice) != cudaSuccess) die("cudaMemcpy");
    cudaDeviceSynchronize();
    auto t2 = Clock::now();
    if (i >= 2) {
      sum_s.push_back(std::chrono::duration<double>(t1 - t0).count());
      copy_s.push_back(std::chrono::duration<double>(t2 - t1).count());
    }
  }
  std::sort(sum_s.begin(), sum_s.end());
  std::sort(copy_s.begin(), copy_s.end());
  // Copy bandwidth counts bytes read + written (the memory traffic), checksum bytes read.
  std::printf(
      "{\"kind\": \"checksum_gpu\", \"bytes\": %llu, \"checksum_gbps\": %.1f, \"d2d_copy_traffic_gbps\": %.1f}\n",
      static_cast<unsigned long long>(bytes), gbps(bytes, sum_s[sum_s.size() / 2]),
      gbps(2 * bytes, copy_s[copy_s.size() / 2]));
  std::fflush(stdout);
  cudaFree(a);
  cudaFree(b);
#else
  (void)device;
#endif
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
    } else if (a == "--memory") {
      const std::string m = next();
      if (m != "host" && m != "cuda") die("--memory: host or cuda");
      o.cuda = m == "cuda";
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

  attach_device(o);
  if (o.cuda) measure_gpu_checksum(o.engine.device);
  auto engine = TransferEngine::create(o.engine);
  if (!engine.is_ok()) die(engine.status().to_string());
  auto& e = **engine;
  for (size_t c = 0; c < cases.size(); ++c) {
    const Case& k = cases[c];
    Buffer source = allocate(e, k.bytes(), o.cuda);
    std::vector<std::byte> payload(k.bytes());
    fill_payload(payload, 3, 0);
    fill(source, payload);
    std::vector<uint64_t> presums;
    if (o.presum) {  // the kind the receiver asks for: kSum64 for GPU memory
      uint64_t offset = 0;
      for (auto [bytes, segments] : k.pieces) {
        const auto piece = std::span<const std::byte>(payload).subspan(offset, bytes);
        presums.push_back(o.cuda ? sum64(piece) : checksum64(piece));
        offset += bytes;
      }
    }
    std::vector<double> seconds;
    uint64_t verified = 0, verify_us = 0;
    const EngineStats sender_before = e.stats();
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
        std::array<std::span<const std::byte>, 1> src{std::span<const std::byte>(source.data + offset, bytes)};
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
      unsigned long long pieces = 0, micros = 0;
      if (std::sscanf(result.c_str(), "result OK %llu %llu", &pieces, &micros) != 2) die("receiver: " + result);
      verified += pieces;
      verify_us += micros;
      if (it >= o.warmup) seconds.push_back(std::chrono::duration<double>(t1 - t0).count());
    }
    std::sort(seconds.begin(), seconds.end());
    const double median = seconds[seconds.size() / 2];
    // Mean microseconds per piece, warm-up included: puts posted -> flushed, flushed -> GPU checksum known (sender),
    // notice -> verified (receiver).
    const EngineStats sender_after = e.stats();
    const double flushed =
        static_cast<double>(std::max<uint64_t>(1, sender_after.pieces_flushed - sender_before.pieces_flushed));
    const double flush_us = static_cast<double>(sender_after.piece_flush_us - sender_before.piece_flush_us) / flushed;
    const double wait_us =
        static_cast<double>(sender_after.piece_checksum_wait_us - sender_before.piece_checksum_wait_us) / flushed;
    const double verify_mean = static_cast<double>(verify_us) / static_cast<double>(std::max<uint64_t>(1, verified));
    uint64_t segments = 0;
    for (auto [bytes, s] : k.pieces) segments += s;
    std::printf(
        "{\"kind\": \"transfer\", \"case\": \"%s\", \"bytes\": %llu, \"pieces\": %zu, \"segments\": %llu, "
        "\"median_s\": %.6f, \"min_s\": %.6f, \"max_s\": %.6f, \"gbps\": %.3f, \"iters\": %zu, \"memory\": \"%s\", "
        "\"piece_flush_us\": %.1f, "
        "\"piece_checksum_wait_us\": %.1f, \"piece_verify_us\": %.1f}\n",
        k.name.c_str(), static_cast<unsigned long long>(k.bytes()), k.pieces.size(),
        static_cast<unsigned long long>(segments), median, seconds.front(), seconds.back(), gbps(k.bytes(), median),
        seconds.size(), o.cuda ? "cuda" : "host", flush_us, wait_us, verify_mean);
    std::fflush(stdout);
    release(e, source);
  }
  std::fprintf(to, "quit\n");
  std::fflush(to);
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
