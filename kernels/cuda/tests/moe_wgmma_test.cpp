// moe_expert_ffn_wgmma (Hopper TMA + wgmma expert FFN) vs the mma.sync kernels of moe_expert_ffn_grouped (themselves
// tested against the CPU in moe_ffn_*_test.cpp) and vs a direct host reference, ctest label gpu.
// Host reference, on chosen rows (each expert's first and last row, the rows around the 64- and 128-row tile edges,
// every n-th row): gate and up in double from the same bf16 inputs, rounded to fp32, the glu of kernels/cpu
// (cpu::swiglu / cpu::situ_glu), rounded to bf16 like the GPU; y in double from the GPU's own `activated` row, so
// each GEMM is checked on its own.
// Tolerances (bf16 inputs, fp32 accumulation in another order than the host):
//   activated vs host:     max |a - b| <= 1e-2 · max |ref| (a one-ulp bf16 flip at a rounding tie is 2^-8 of the
//                          value), relative L2 <= 2e-3;
//   y vs host:             max |a - b| <= 2e-3 · max |ref|, relative L2 <= 1e-3 (fp32 sums of up to 2304 products);
//   wgmma vs grouped:      activated and y, max |a - b| <= 1e-2 · max |grouped|, relative L2 <= 2e-3 (y inherits
//                          the grouped kernel's own bf16 flips of `activated`).
// Poison: x_sorted rows past offsets[E] are NaN (the kernel reads them inside a row tile, never stores them);
// activated and y_sorted start as all-ones bytes (NaN), rows < offsets[E] must come back finite and rows past
// offsets[E] bit-identical to the poison.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/cpu/basic_ops.hpp"
#include "kernels/cuda/moe/detail/wgmma.hpp"
#include "kernels/cuda/moe/moe.hpp"
#include "kernels/cuda/tests/gpu_test_graph.hpp"
#include "kernels/cuda/tests/kda_test_util.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

// Deterministic uniform bf16 fill in (-scale, scale) (xorshift64*: fast enough for the 3.6 GB of Kimi-48B weights).
void fill_uniform(__nv_bfloat16* out, size_t n, uint64_t seed, float scale) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    const uint64_t r = s * 0x2545F4914F6CDD1Dull;
    const float u = static_cast<float>(r >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    out[i] = __float2bfloat16((2.0f * u - 1.0f) * scale);
  }
}

// Expert weights of one shape on host and device; the last shape is kept so the E = 256 cases share them.
struct ExpertWeights {
  int E = 0;
  int64_t W = 0, I = 0;
  std::vector<__nv_bfloat16> gate_up, down;  // [E, 2I, W], [E, W, I]
  DeviceBuffer<__nv_bfloat16> d_gate_up, d_down;

  ExpertWeights(int experts, int64_t width, int64_t inter)
      : E(experts),
        W(width),
        I(inter),
        gate_up(static_cast<size_t>(E) * 2 * I * W),
        down(static_cast<size_t>(E) * W * I),
        d_gate_up(gate_up.size()),
        d_down(down.size()) {
    const auto seed = static_cast<uint64_t>(E * 131 + W * 7 + I);
    // Scales that keep gate/up and y near unit size, so the glu's curved part is exercised.
    fill_uniform(gate_up.data(), gate_up.size(), seed, std::sqrt(3.0f / static_cast<float>(W)) * 2.0f);
    fill_uniform(down.data(), down.size(), seed + 1, std::sqrt(3.0f / static_cast<float>(I)));
    d_gate_up.upload(gate_up);
    d_down.upload(down);
  }
};

const ExpertWeights& expert_weights(int E, int64_t W, int64_t I) {
  static std::unique_ptr<ExpertWeights> cache;
  if (!cache || cache->E != E || cache->W != W || cache->I != I) {
    cache.reset();  // free the previous device copy first
    cache = std::make_unique<ExpertWeights>(E, W, I);
  }
  return *cache;
}

std::vector<int32_t> prefix_offsets(const std::vector<int>& counts) {
  std::vector<int32_t> offsets(counts.size() + 1, 0);
  for (size_t e = 0; e < counts.size(); ++e) offsets[e + 1] = offsets[e] + counts[e];
  return offsets;
}

// x_sorted [rows, W]: random rows below `used`, NaN rows past it.
std::vector<__nv_bfloat16> make_x(int64_t rows, int64_t used, int64_t W, uint64_t seed) {
  std::vector<__nv_bfloat16> x(static_cast<size_t>(rows * W));
  fill_uniform(x.data(), static_cast<size_t>(used * W), seed, 1.5f);
  std::fill(x.begin() + used * W, x.end(), bf16_nan());
  return x;
}

// Device inputs and outputs of one FFN call: rows = offsets[E] + pad, x rows past offsets[E] NaN.
struct FfnBuffers {
  std::vector<int32_t> offsets;
  int64_t used = 0, rows = 0;
  std::vector<__nv_bfloat16> x;
  DeviceBuffer<__nv_bfloat16> d_x;
  DeviceBuffer<int32_t> d_offsets;
  DeviceBuffer<__nv_bfloat16> activated;
  DeviceBuffer<float> y;

  FfnBuffers(const std::vector<int>& counts, int64_t W, int64_t I, int64_t pad, uint64_t seed)
      : offsets(prefix_offsets(counts)),
        used(offsets.back()),
        rows(used + pad),
        x(make_x(rows, used, W, seed)),
        d_x(x.size()),
        d_offsets(offsets.size()),
        activated(static_cast<size_t>(rows * I)),
        y(static_cast<size_t>(rows * W)) {
    d_x.upload(x);
    d_offsets.upload(offsets);
  }
  void poison() const {
    ASSERT_EQ(cudaMemset(activated.get(), 0xff, activated.size() * sizeof(__nv_bfloat16)), cudaSuccess);
    ASSERT_EQ(cudaMemset(y.get(), 0xff, y.size() * sizeof(float)), cudaSuccess);
  }
  MoeFfnParams params(const ExpertWeights& w, GluKind glu) const {
    MoeFfnParams p;
    p.weights = {w.d_gate_up.get(), w.d_down.get(), w.E, w.W, w.I};
    p.glu = glu;
    p.rows = rows;
    p.x_sorted = d_x.get();
    p.expert_offsets = d_offsets.get();
    p.activated = activated.get();
    p.y_sorted = y.get();
    return p;
  }
};

struct Outputs {
  std::vector<float> activated, y;  // activated widened to fp32
  std::vector<uint16_t> activated_bits;
  std::vector<uint32_t> y_bits;
};

Outputs download(const FfnBuffers& b) {
  Outputs out;
  const std::vector<__nv_bfloat16> act = b.activated.download();
  out.activated = to_float(act, act.size());
  out.activated_bits.resize(act.size());
  std::memcpy(out.activated_bits.data(), act.data(), act.size() * sizeof(uint16_t));
  out.y = b.y.download();
  out.y_bits.resize(out.y.size());
  std::memcpy(out.y_bits.data(), out.y.data(), out.y.size() * sizeof(float));
  return out;
}

// Rows < used finite; rows >= used still hold the all-ones poison.
void expect_written_exactly(const Outputs& out, int64_t used, int64_t W, int64_t I, const std::string& what) {
  int64_t not_finite = 0, overwritten = 0, first_bad = -1;
  for (size_t i = 0; i < out.activated.size(); ++i) {
    const bool inside = static_cast<int64_t>(i) < used * I;
    if (inside ? !std::isfinite(out.activated[i]) : out.activated_bits[i] != 0xffffu) {
      (inside ? not_finite : overwritten)++;
      if (first_bad < 0) first_bad = static_cast<int64_t>(i / I);
    }
  }
  EXPECT_EQ(not_finite + overwritten, 0) << what << " activated: " << not_finite << " non-finite rows < offsets[E], "
                                         << overwritten << " overwritten past it (first at row " << first_bad << ")";
  not_finite = overwritten = 0;
  first_bad = -1;
  for (size_t i = 0; i < out.y.size(); ++i) {
    const bool inside = static_cast<int64_t>(i) < used * W;
    if (inside ? !std::isfinite(out.y[i]) : out.y_bits[i] != 0xffffffffu) {
      (inside ? not_finite : overwritten)++;
      if (first_bad < 0) first_bad = static_cast<int64_t>(i / W);
    }
  }
  EXPECT_EQ(not_finite + overwritten, 0) << what << " y_sorted: " << not_finite << " non-finite values, " << overwritten
                                         << " overwritten past offsets[E] (first at row " << first_bad << ")";
}

// Running comparison of actual vs reference values.
struct Compare {
  double diff2 = 0.0, ref2 = 0.0, max_abs = 0.0, max_ref = 0.0;
  int64_t worst = -1;
  float worst_actual = 0.0f, worst_expected = 0.0f;
  void add(float actual, float expected, int64_t index) {
    const double d = static_cast<double>(actual) - expected;
    diff2 += d * d;
    ref2 += static_cast<double>(expected) * expected;
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(expected)));
    if (!(std::fabs(d) <= max_abs)) {  // also catches NaN
      max_abs = std::isnan(d) ? INFINITY : std::fabs(d);
      worst = index;
      worst_actual = actual;
      worst_expected = expected;
    }
  }
  void expect(double max_rel_tol, double l2_tol, int64_t width, const std::string& what) const {
    const double rel_l2 = ref2 > 0.0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
    char detail[256];
    std::snprintf(detail, sizeof(detail),
                  "max_abs=%.3e (max|ref|=%.3e) rel_l2=%.3e; worst at row %lld col %lld: expected %.8g actual %.8g",
                  max_abs, max_ref, rel_l2, static_cast<long long>(worst / width),
                  static_cast<long long>(worst % width), worst_expected, worst_actual);
    EXPECT_LE(max_abs, max_rel_tol * max_ref) << what << ": " << detail;
    EXPECT_LE(rel_l2, l2_tol) << what << ": " << detail;
  }
};

void compare_outputs(const Outputs& actual, const Outputs& expected, int64_t used, int64_t W, int64_t I,
                     const std::string& what) {
  Compare act, y;
  for (int64_t i = 0; i < used * I; ++i) act.add(actual.activated[i], expected.activated[i], i);
  for (int64_t i = 0; i < used * W; ++i) y.add(actual.y[i], expected.y[i], i);
  act.expect(1e-2, 2e-3, I, what + " activated");
  y.expect(1e-2, 2e-3, W, what + " y_sorted");
}

// Rows that the host reference checks, in every expert_stride-th expert: the first and last, both sides of the 64-
// and 128-row edges, and every stride-th.
std::vector<int64_t> reference_rows(const std::vector<int32_t>& offsets, int stride, int expert_stride) {
  std::vector<int64_t> rows;
  for (size_t e = 0; e + 1 < offsets.size(); e += expert_stride) {
    const int64_t begin = offsets[e], n = offsets[e + 1] - begin;
    std::set<int64_t> pick;
    for (int64_t r : {0, 1, 62, 63, 64, 65, 126, 127, 128, 129, 191, 192, 255, 256}) {
      if (r < n) pick.insert(r);
    }
    if (n > 0) pick.insert(n - 1);
    for (int64_t r = 0; r < n; r += stride) pick.insert(r);
    for (int64_t r : pick) rows.push_back(begin + r);
  }
  return rows;
}

int expert_of(const std::vector<int32_t>& offsets, int64_t row) {
  return static_cast<int>(std::upper_bound(offsets.begin(), offsets.end(), static_cast<int32_t>(row)) -
                          offsets.begin()) -
         1;
}

void check_against_host(const ExpertWeights& w, const FfnBuffers& b, const Outputs& out, GluKind glu, int stride,
                        int expert_stride, const std::string& what) {
  const int64_t W = w.W, I = w.I;
  Compare act, y;
  std::vector<float> gate(I), up(I), glu_out(I);
  for (const int64_t r : reference_rows(b.offsets, stride, expert_stride)) {
    const int e = expert_of(b.offsets, r);
    const __nv_bfloat16* x = b.x.data() + r * W;
    const __nv_bfloat16* gu = w.gate_up.data() + static_cast<int64_t>(e) * 2 * I * W;
    for (int64_t j = 0; j < 2 * I; ++j) {
      double sum = 0.0;
      const __nv_bfloat16* wr = gu + j * W;
      for (int64_t k = 0; k < W; ++k) sum += static_cast<double>(__bfloat162float(x[k])) * __bfloat162float(wr[k]);
      (j < I ? gate[j] : up[j - I]) = static_cast<float>(sum);
    }
    if (glu == GluKind::kSitu) {
      cpu::situ_glu(gate.data(), up.data(), glu_out.data(), I, 4.0f, 25.0f);
    } else {
      cpu::swiglu(gate.data(), up.data(), glu_out.data(), I);
    }
    for (int64_t j = 0; j < I; ++j) act.add(out.activated[r * I + j], bf16_round(glu_out[j]), r * I + j);
    const __nv_bfloat16* dn = w.down.data() + static_cast<int64_t>(e) * W * I;
    const float* a = out.activated.data() + r * I;  // the GPU's own activation: checks the down GEMM alone
    for (int64_t n = 0; n < W; ++n) {
      double sum = 0.0;
      const __nv_bfloat16* wr = dn + n * I;
      for (int64_t j = 0; j < I; ++j) sum += static_cast<double>(a[j]) * __bfloat162float(wr[j]);
      y.add(out.y[r * W + n], static_cast<float>(sum), r * W + n);
    }
  }
  act.expect(1e-2, 2e-3, I, what + " activated vs host");
  y.expect(2e-3, 1e-3, W, what + " y_sorted vs host");
}

struct WgmmaCase {
  int E = 1;
  int64_t W = 256, I = 256;
  std::vector<int> counts;  // rows per expert, cycled over the E experts
  GluKind glu = GluKind::kSwiGlu;
  int64_t pad = 0;            // NaN rows of x_sorted past offsets[E] (included in params.rows)
  int ref_stride = 1;         // host reference on every n-th row of an expert (plus its edge rows)
  int ref_expert_stride = 1;  // ... of every n-th expert
  bool graph = false;         // also capture the call in a CUDA graph and require bit-identical replays
  uint32_t seed = 1;
};

void run_case(const WgmmaCase& c) {
  std::vector<int> counts(c.E);
  for (int e = 0; e < c.E; ++e) counts[e] = c.counts[e % c.counts.size()];
  const std::string name = "E=" + std::to_string(c.E) + " W=" + std::to_string(c.W) + " I=" + std::to_string(c.I) +
                           (c.glu == GluKind::kSitu ? " situ" : " swiglu") + " pad=" + std::to_string(c.pad);
  SCOPED_TRACE(name);
  const ExpertWeights& w = expert_weights(c.E, c.W, c.I);
  FfnBuffers wg(counts, c.W, c.I, c.pad, c.seed);
  FfnBuffers grouped(counts, c.W, c.I, c.pad, c.seed);
  std::printf("[ moe wgmma ] %s: R=%lld rows (%lld routed)\n", name.c_str(), static_cast<long long>(wg.rows),
              static_cast<long long>(wg.used));
  wg.poison();
  grouped.poison();
  const Status s_wg = moe_expert_ffn_wgmma(wg.params(w, c.glu), 0);
  ASSERT_TRUE(s_wg) << s_wg.to_string();
  // The mma.sync kernels themselves (moe_expert_ffn_grouped would hand prefill-sized batches to the wgmma path under
  // test).
  const Status s_grouped = detail::moe_expert_ffn_grouped_mma_sync(grouped.params(w, c.glu), 0);
  ASSERT_TRUE(s_grouped) << s_grouped.to_string();
  DS_CUDA_OK(cudaDeviceSynchronize());
  const Outputs out = download(wg);
  const Outputs ref = download(grouped);
  expect_written_exactly(out, wg.used, c.W, c.I, "wgmma");
  compare_outputs(out, ref, wg.used, c.W, c.I, "wgmma vs grouped");
  check_against_host(w, wg, out, c.glu, c.ref_stride, c.ref_expert_stride, "wgmma");

  if (c.graph) {
    cudaStream_t stream = nullptr;
    DS_CUDA_OK(cudaStreamCreate(&stream));
    cudaGraphExec_t exec = nullptr;
    const MoeFfnParams params = wg.params(w, c.glu);
    ASSERT_NO_FATAL_FAILURE(capture_graph(
        stream, cudaStreamCaptureModeThreadLocal, [&](cudaStream_t s) { return moe_expert_ffn_wgmma(params, s); },
        &exec));
    for (int replay = 0; replay < 2; ++replay) {
      wg.poison();
      DS_CUDA_OK(cudaGraphLaunch(exec, stream));
      DS_CUDA_OK(cudaStreamSynchronize(stream));
      const Outputs again = download(wg);
      EXPECT_EQ(again.activated_bits, out.activated_bits) << "graph replay " << replay << ": activated differs";
      EXPECT_EQ(again.y_bits, out.y_bits) << "graph replay " << replay << ": y_sorted differs";
    }
    cudaGraphExecDestroy(exec);
    DS_CUDA_OK(cudaStreamDestroy(stream));
  }
}

// The row counts of the brief's edge cases: empty, single rows, both sides of the 64-row (one consumer
// warpgroup) and 128-row (one tile) edges, and a long expert.
const std::vector<int> kEdgeCounts = {0, 1, 63, 64, 65, 127, 128, 129, 1000, 2, 200, 0, 255, 256, 257, 31};

TEST(MoeWgmmaGpu, SingleExpert) {
  run_case({.E = 1, .W = 256, .I = 256, .counts = {1000}, .pad = 37, .seed = 1});
  // R == offsets[E] (no padding): the last tile's A rows past R come from TMA zero fill.
  run_case({.E = 1, .W = 2304, .I = 1024, .counts = {129}, .glu = GluKind::kSitu, .seed = 2});
}

TEST(MoeWgmmaGpu, FewExperts) {
  run_case({.E = 4, .W = 256, .I = 1024, .counts = {0, 65, 1, 128}, .glu = GluKind::kSitu, .pad = 5, .seed = 3});
  run_case({.E = 4, .W = 2304, .I = 256, .counts = {64, 0, 127, 1000}, .pad = 130, .ref_stride = 7, .seed = 4});
}

TEST(MoeWgmmaGpu, EdgeRowCounts) {
  run_case({.E = 16, .W = 2304, .I = 256, .counts = kEdgeCounts, .pad = 3, .ref_stride = 16, .seed = 5});
  run_case({.E = 16,
            .W = 256,
            .I = 1024,
            .counts = kEdgeCounts,
            .glu = GluKind::kSitu,
            .pad = 64,
            .ref_stride = 8,
            .graph = true,
            .seed = 6});
}

TEST(MoeWgmmaGpu, OddShapes) {
  // width and intermediate multiples of 8 but not of the 64-wide k tile or the 128 / 256 column tiles: the k tail
  // is zero-filled by TMA, the column tail computed and not stored (gate boxes reach into the up rows, up boxes
  // into the next expert's rows or past the tensor).
  run_case({.E = 4, .W = 328, .I = 200, .counts = {70, 0, 129, 3}, .pad = 9, .seed = 7});
  run_case({.E = 4, .W = 328, .I = 200, .counts = {70, 0, 129, 3}, .glu = GluKind::kSitu, .pad = 9, .seed = 8});
  run_case({.E = 3, .W = 72, .I = 8, .counts = {1, 190, 64}, .pad = 2, .graph = true, .seed = 9});
}

TEST(MoeWgmmaGpu, ManyExperts) {
  // E = 1024 (the limit): the schedule scan takes 3 experts per thread.
  run_case({.E = 1024, .W = 64, .I = 64, .counts = {0, 3, 1, 70, 0, 0, 129, 2}, .pad = 1, .ref_stride = 4, .seed = 10});
}

TEST(MoeWgmmaGpu, Kimi48BShapes) {
  // E = 256, W = 2304, I = 1024 with the edge counts spread over the experts (~170 rows per expert).
  for (const GluKind glu : {GluKind::kSwiGlu, GluKind::kSitu}) {
    run_case({.E = 256,
              .W = 2304,
              .I = 1024,
              .counts = kEdgeCounts,
              .glu = glu,
              .pad = 11,
              .ref_stride = 97,
              .ref_expert_stride = 5,  // coprime to the 16 edge counts: every count is checked
              .graph = glu == GluKind::kSwiGlu,
              .seed = glu == GluKind::kSitu ? 12u : 11u});
  }
}

TEST(MoeWgmmaGpu, RejectsBadInputs) {
  auto* bf = reinterpret_cast<__nv_bfloat16*>(256);
  MoeFfnParams good;
  good.weights = {bf, bf, 8, 64, 64};
  good.rows = 4;
  good.x_sorted = bf;
  good.expert_offsets = reinterpret_cast<const int32_t*>(256);
  good.activated = bf;
  good.y_sorted = reinterpret_cast<float*>(256);
  auto expect_invalid = [&](MoeFfnParams p, const char* what) {
    const Status s = moe_expert_ffn_wgmma(p, 0);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << what << ": " << s.to_string();
  };
  MoeFfnParams p = good;
  p.weights.num_experts = 0;
  expect_invalid(p, "no experts");
  p = good;
  p.weights.num_experts = kMoeMaxExperts + 1;
  expect_invalid(p, "too many experts");
  p = good;
  p.weights.width = 60;
  expect_invalid(p, "width not a multiple of 8");
  p = good;
  p.weights.intermediate = 12;
  expect_invalid(p, "intermediate not a multiple of 8");
  p = good;
  p.weights.num_experts = 1024;
  p.weights.intermediate = int64_t{1} << 20;
  expect_invalid(p, "E * 2I past 2^31");
  p = good;
  p.rows = -1;
  expect_invalid(p, "negative rows");
  p = good;
  p.glu = GluKind::kSitu;
  p.situ_beta = 0.0f;
  expect_invalid(p, "SiTU beta");
  p = good;
  p.activated = nullptr;
  expect_invalid(p, "null activated");
  p = good;
  p.x_sorted = reinterpret_cast<const __nv_bfloat16*>(264);
  expect_invalid(p, "x_sorted 8-byte aligned");
  p = good;
  p.y_sorted = reinterpret_cast<float*>(260);
  expect_invalid(p, "y_sorted 4-byte aligned");
  // R == 0 launches nothing and needs no buffers.
  p = {};
  p.weights = {nullptr, nullptr, 8, 64, 64};
  EXPECT_TRUE(moe_expert_ffn_wgmma(p, 0));
  DS_CUDA_OK(cudaGetLastError());
}

// Kimi-Linear-48B prefill chunks (E = 256, k = 8, W = 2304, I = 1024) under uniform random routing: the wgmma
// kernels and the mma.sync kernels, each captured once in a CUDA graph and replayed kReps times. Prints per stage the
// time, TFLOP/s and its ratio to 873 (the H200's cuBLAS bf16 peak), and the bytes the stage must move
// (weights once, x or activated once, outputs once) as a ratio to 4.26 TB/s. Asserts only correctness.
TEST(MoeWgmmaGpu, Timing) {
  constexpr int E = 256, kTopK = 8, kReps = 20;
  constexpr int64_t W = 2304, I = 1024;
  const ExpertWeights& w = expert_weights(E, W, I);
  for (const int64_t tokens : {8192, 32768}) {
    const int64_t R = tokens * kTopK;
    std::mt19937 rng(static_cast<uint32_t>(tokens));
    std::vector<int> counts(E, 0), experts(E);
    std::iota(experts.begin(), experts.end(), 0);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int j = 0; j < kTopK; ++j) {  // k distinct experts: partial Fisher-Yates
        std::uniform_int_distribution<int> pick(j, E - 1);
        std::swap(experts[j], experts[pick(rng)]);
        ++counts[experts[j]];
      }
    }
    FfnBuffers wg(counts, W, I, 0, 77);
    FfnBuffers grouped(counts, W, I, 0, 77);
    ASSERT_EQ(wg.rows, R);
    cudaStream_t stream = nullptr;
    DS_CUDA_OK(cudaStreamCreate(&stream));
    const double gate_up_flops = 2.0 * R * W * 2 * I, down_flops = 2.0 * R * I * W;
    const double weight_bytes = 2.0 * E * 3 * I * W;
    const double gate_up_bytes = 2.0 * E * 2 * I * W + 2.0 * R * W + 2.0 * R * I;
    const double down_bytes = 2.0 * E * I * W + 2.0 * R * I + 4.0 * R * W;
    // variant 0..2: wgmma both / gate_up / down; 3: the mma.sync kernels, both (their automatic prefill tiles).
    const char* names[] = {"wgmma gate_up+down", "wgmma gate_up", "wgmma down", "grouped gate_up+down"};
    double ms_of[4] = {};
    for (int variant = 0; variant < 4; ++variant) {
      const FfnBuffers& b = variant == 3 ? grouped : wg;
      const MoeFfnParams p = b.params(w, GluKind::kSwiGlu);
      auto run = [&](cudaStream_t s) {
        switch (variant) {
          case 0:
            return moe_expert_ffn_wgmma(p, s);
          case 1:
            return moe_expert_ffn_wgmma(p, s, MoeWgmmaStage::kGateUp);
          case 2:
            return moe_expert_ffn_wgmma(p, s, MoeWgmmaStage::kDown);
          default:  // the mma.sync kernels (without the hand-off to the wgmma kernels)
            return detail::moe_expert_ffn_grouped_mma_sync(p, s);
        }
      };
      if (variant == 0 || variant == 3) b.poison();
      if (variant == 2) {
        ASSERT_TRUE(moe_expert_ffn_wgmma(p, stream));  // activated must be valid
      }
      SCOPED_TRACE(names[variant]);
      ASSERT_NO_FATAL_FAILURE(
          time_graph_replays(stream, cudaStreamCaptureModeThreadLocal, 1, kReps, run, &ms_of[variant]));
      const double flops = variant == 1 ? gate_up_flops : variant == 2 ? down_flops : gate_up_flops + down_flops;
      const double bytes = variant == 1 ? gate_up_bytes : variant == 2 ? down_bytes : gate_up_bytes + down_bytes;
      const double seconds = ms_of[variant] * 1e-3;
      std::printf(
          "[ moe wgmma timing ] R=%lld (T=%lld, rows/expert %d..%d) %-22s %8.3f ms %6.1f TFLOP/s (%.3f of 873) "
          "%6.3f GB (%.3f of 4.26 TB/s)\n",
          static_cast<long long>(R), static_cast<long long>(tokens), *std::min_element(counts.begin(), counts.end()),
          *std::max_element(counts.begin(), counts.end()), names[variant], ms_of[variant], flops / seconds / 1e12,
          flops / seconds / 873e12, bytes / 1e9, bytes / seconds / 4.26e12);
    }
    std::printf("[ moe wgmma timing ] R=%lld: wgmma %.3f ms vs grouped %.3f ms (%.2fx); weights %.2f GB\n",
                static_cast<long long>(R), ms_of[0], ms_of[3], ms_of[3] / ms_of[0], weight_bytes / 1e9);
    DS_CUDA_OK(cudaDeviceSynchronize());
    // The last runs left complete outputs in both buffers: the timing runs must also be right.
    const Outputs out = download(wg);
    const Outputs ref = download(grouped);
    expect_written_exactly(out, wg.used, W, I, "timing wgmma");
    compare_outputs(out, ref, wg.used, W, I, "timing wgmma vs grouped");
    DS_CUDA_OK(cudaStreamDestroy(stream));
  }
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
