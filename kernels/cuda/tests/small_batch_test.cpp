// Skinny GEMM (kernels/cuda/gemm/small_batch.hpp) vs the CPU reference cpu::linear on bf16-rounded inputs, ctest label
// gpu. Tolerance per element: |err| <= 1e-5 * sum_k |x_k w_k| + 1e-6 (both sides sum in fp32 in different orders;
// an indexing bug misses by O(sum)); bf16 outputs additionally get one bf16 ulp (2^-8 |ref|) for the final rounding.
// Outputs carry NaN-poisoned padding (y_stride tails and the rows past `rows`) that must stay NaN; strided x rows
// carry NaN past `in` that must never be read. Every case runs the kernel skinny_gemm_kernel_for picks for its rows.
// SkinnyGemmV2.* (1-2 rows, the kernels with the extra fields): split-K, per-output x offsets and output types
// against the same reference; the fused input norm bitwise against rms_norm + the GEMM; programmatic dependent launch
// in a captured graph against the eager run.
// SkinnyGemm.Bandwidth48B and SkinnyGemmGpu.Timing (graph replays) print the achieved weight bandwidth at the
// Kimi-Linear-48B decode shapes; they assert nothing about speed.
#include "kernels/cuda/gemm/small_batch.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/basic_ops.hpp"
#include "kernels/cuda/ops/ops.hpp"
#include "kernels/cuda/tests/gpu_test_graph.hpp"
#include "kernels/cuda/tests/ops_test_util.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

struct Case {
  int64_t rows = 1;
  int64_t in = 256;
  std::vector<int64_t> outs{64};  // n of each output
  int64_t x_stride_pad = 0;       // x_stride = in + pad (odd pads exercise the unaligned x copy)
  int64_t y_stride_pad = 3;
  bool y_bf16 = false;
  bool accumulate = false;
  bool fp32 = false;  // fp32 x and weights (the router form) instead of bf16
  uint32_t seed = 1;
  // 1-2 rows only: per-output x column offsets and bf16 outputs (empty: 0 and y_bf16 for every output).
  std::vector<int64_t> x_offsets;
  std::vector<bool> out_bf16;
};

std::string describe(const Case& c) {
  std::ostringstream s;
  s << "rows " << c.rows << " in " << c.in << " outs [";
  for (int64_t n : c.outs) s << n << " ";
  s << "] x_stride_pad " << c.x_stride_pad << " y_stride_pad " << c.y_stride_pad << " bf16 " << c.y_bf16
    << " accumulate " << c.accumulate << " fp32 " << c.fp32 << " x_offsets [";
  for (int64_t offset : c.x_offsets) s << offset << " ";
  s << "] out_bf16 [";
  for (bool bf16 : c.out_bf16) s << bf16 << " ";
  s << "]";
  return s.str();
}

// Compares one output [rows, n] (stride y_stride, kSkinnyGemmMaxRows rows allocated) with the reference; names the
// worst element. Rows >= `rows` and columns >= n must still be NaN.
::testing::AssertionResult check_output(const std::vector<float>& actual, const std::vector<float>& expected,
                                        const std::vector<double>& bound, int64_t rows, int64_t n, int64_t y_stride,
                                        const std::string& what) {
  int64_t bad = 0, worst_row = -1, worst_col = -1;
  double worst_excess = -1.0;
  for (int64_t m = 0; m < kSkinnyGemmMaxRows; ++m) {
    for (int64_t c = 0; c < y_stride; ++c) {
      const float a = actual[m * y_stride + c];
      if (m >= rows || c >= n) {
        if (!std::isnan(a)) {
          return ::testing::AssertionFailure()
                 << what << ": padding at row " << m << " col " << c << " overwritten with " << a;
        }
        continue;
      }
      const double e = expected[m * n + c];
      const double excess = std::isfinite(a) ? std::fabs(a - e) - bound[m * n + c] : INFINITY;
      if (excess > 0.0) {
        ++bad;
        if (excess > worst_excess) worst_excess = excess, worst_row = m, worst_col = c;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << rows * n << " elements out of bound; worst"
                                       << " at row " << worst_row << " col " << worst_col << ": expected "
                                       << expected[worst_row * n + worst_col] << ", actual "
                                       << actual[worst_row * y_stride + worst_col] << ", bound "
                                       << bound[worst_row * n + worst_col];
}

const char* kernel_name(SkinnyGemmKernel kernel) {
  switch (kernel) {
    case SkinnyGemmKernel::kV1:
      return "v1";
    case SkinnyGemmKernel::kV2R1:
      return "v2-r1";
    default:
      return "v2";
  }
}

int64_t offset_of(const Case& c, size_t o) {
  return c.x_offsets.empty() ? 0 : c.x_offsets[o];
}
bool bf16_of(const Case& c, size_t o) {
  return c.out_bf16.empty() ? c.y_bf16 : static_cast<bool>(c.out_bf16[o]);
}

void run_case(const Case& c) {
  SCOPED_TRACE(describe(c) + " kernel " + kernel_name(skinny_gemm_kernel_for(c.rows, c.in)));
  std::mt19937 rng(c.seed);
  int64_t x_cols = c.in;  // columns of x the outputs read
  for (size_t o = 0; o < c.outs.size(); ++o) x_cols = std::max(x_cols, offset_of(c, o) + c.in);
  const int64_t x_stride = x_cols + c.x_stride_pad;
  std::vector<float> x = normal_vector(rng, c.rows * x_cols);
  if (!c.fp32) {
    for (float& v : x) v = bf16_round(v);
  }
  std::vector<float> x_strided(std::max<int64_t>(c.rows, 1) * x_stride, NAN);
  for (int64_t m = 0; m < c.rows; ++m) std::copy_n(x.begin() + m * x_cols, x_cols, x_strided.begin() + m * x_stride);

  // All weights in one buffer, each matrix starting at a multiple of `in` elements (16-byte aligned).
  int64_t total_n = 0;
  for (int64_t n : c.outs) total_n += n;
  std::vector<float> w = normal_vector(rng, std::max<int64_t>(total_n, 1) * c.in, 0.0f, 0.05f);
  if (!c.fp32) {
    for (float& v : w) v = bf16_round(v);
  }

  DeviceBuffer<__nv_bfloat16> x_d(c.fp32 ? 0 : x_strided.size()), w_d(c.fp32 ? 0 : w.size());
  DeviceBuffer<float> x32_d(c.fp32 ? x_strided.size() : 0), w32_d(c.fp32 ? w.size() : 0);
  if (c.fp32) {
    x32_d.upload(x_strided);
    w32_d.upload(w);
  } else {
    x_d.upload(to_bf16(x_strided));
    w_d.upload(to_bf16(w));
  }
  // Weight o starts at element offset * in of the buffer.
  auto weight_at = [&](int64_t offset) -> const void* {
    return c.fp32 ? static_cast<const void*>(w32_d.get() + offset * c.in)
                  : static_cast<const void*>(w_d.get() + offset * c.in);
  };
  SkinnyGemmParams p;
  p.input = c.fp32 ? SkinnyGemmInput::kFp32 : SkinnyGemmInput::kBf16;
  p.x = c.fp32 ? static_cast<const void*>(x32_d.get()) : static_cast<const void*>(x_d.get());
  p.x_stride = x_stride;
  p.rows = c.rows;
  p.in = c.in;
  p.y_bf16 = c.y_bf16 && c.out_bf16.empty();
  p.accumulate = c.accumulate;
  p.num_outputs = static_cast<int>(c.outs.size());

  std::vector<DeviceBuffer<float>> y32;
  std::vector<DeviceBuffer<__nv_bfloat16>> y16;
  std::vector<std::vector<float>> y_initial;  // the accumulate base (rows < `rows`), NaN padding
  int64_t w_offset = 0;
  for (size_t o = 0; o < c.outs.size(); ++o) {
    const int64_t n = c.outs[o], y_stride = n + c.y_stride_pad;
    std::vector<float> initial(kSkinnyGemmMaxRows * y_stride, NAN);
    for (int64_t m = 0; m < c.rows; ++m) {
      for (int64_t col = 0; col < n; ++col) initial[m * y_stride + col] = c.accumulate ? 0.5f * (m - col % 7) : NAN;
    }
    y_initial.push_back(initial);
    // Every output gets both buffers (one unused) so that y16[o] / y32[o] index by output.
    y16.emplace_back(initial.size());
    y32.emplace_back(initial.size());
    if (bf16_of(c, o)) {
      y16.back().upload(to_bf16(initial));
      p.outputs[o] = {weight_at(w_offset), n, y16.back().get(), y_stride};
    } else {
      y32.back().upload(initial);
      p.outputs[o] = {weight_at(w_offset), n, y32.back().get(), y_stride};
    }
    p.outputs[o].y_bf16 = !c.out_bf16.empty() && c.out_bf16[o];
    p.outputs[o].x_offset = offset_of(c, o);
    w_offset += n;
  }
  ASSERT_TRUE(skinny_gemm_supported(p));
  Stream stream;
  const Status status = skinny_gemm(p, stream.get());
  ASSERT_TRUE(status.is_ok()) << status.to_string();
  stream.sync();

  w_offset = 0;
  for (size_t o = 0; o < c.outs.size(); ++o) {
    const int64_t n = c.outs[o], y_stride = n + c.y_stride_pad;
    const bool bf16 = bf16_of(c, o);
    std::vector<float> x_o(c.rows * c.in);  // the columns output o reads
    for (int64_t m = 0; m < c.rows; ++m)
      std::copy_n(x.begin() + m * x_cols + offset_of(c, o), c.in, x_o.begin() + m * c.in);
    std::vector<float> expected(c.rows * n);
    if (c.rows > 0 && n > 0) cpu::linear(x_o.data(), w.data() + w_offset * c.in, expected.data(), c.rows, c.in, n);
    std::vector<double> bound(c.rows * n);
    for (int64_t m = 0; m < c.rows; ++m) {
      for (int64_t col = 0; col < n; ++col) {
        double sum_abs = 0.0;
        for (int64_t k = 0; k < c.in; ++k) sum_abs += std::fabs(x_o[m * c.in + k] * w[(w_offset + col) * c.in + k]);
        float& e = expected[m * n + col];
        if (c.accumulate) e += y_initial[o][m * y_stride + col];
        bound[m * n + col] = 1e-5 * sum_abs + 1e-6;
        if (bf16) {
          // Both sides round once to bf16; sums that differ within the fp32 bound can straddle a rounding midpoint
          // and round one ulp apart (2^-7 relative at most).
          e = bf16_round(e);
          bound[m * n + col] += std::ldexp(std::fabs(e), -7);
        }
      }
    }
    const std::vector<float> actual =
        bf16 ? to_float(y16[o].download(), kSkinnyGemmMaxRows * y_stride) : y32[o].download();
    EXPECT_TRUE(check_output(actual, expected, bound, c.rows, n, y_stride, "output " + std::to_string(o)));
    w_offset += n;
  }
}

TEST(SkinnyGemm, SingleOutputEveryRowCount) {
  for (int64_t rows = 1; rows <= kSkinnyGemmMaxRows; ++rows) {
    Case c;
    c.rows = rows;
    c.in = 2304;
    c.outs = {333};  // not a multiple of the rows a warp takes
    c.seed = static_cast<uint32_t>(rows);
    run_case(c);
  }
}

TEST(SkinnyGemm, ShortAndRaggedK) {
  for (int64_t in : {8, 128, 264, 1000, 1024, 4096}) {
    for (int64_t rows : {1, 3, 16}) {
      Case c;
      c.rows = rows;
      c.in = in;
      c.outs = {97};
      c.seed = static_cast<uint32_t>(in + rows);
      run_case(c);
    }
  }
}

TEST(SkinnyGemm, StridedAndUnalignedActivations) {
  for (int64_t pad : {8, 3, 1}) {
    for (int64_t rows : {1, 5, 16}) {
      Case c;
      c.rows = rows;
      c.in = 512;
      c.outs = {130};
      c.x_stride_pad = pad;
      c.seed = static_cast<uint32_t>(pad * 100 + rows);
      run_case(c);
    }
  }
}

TEST(SkinnyGemm, AccumulateIntoResidual) {
  for (int64_t rows : {1, 2, 7, 16}) {
    Case c;
    c.rows = rows;
    c.in = 1024;
    c.outs = {2304 / 4 + 1};
    c.accumulate = true;
    c.seed = static_cast<uint32_t>(50 + rows);
    run_case(c);
  }
}

TEST(SkinnyGemm, Bf16Output) {
  for (int64_t rows : {1, 4, 9, 16}) {
    Case c;
    c.rows = rows;
    c.in = 2304;
    c.outs = {259};
    c.y_bf16 = true;
    c.seed = static_cast<uint32_t>(70 + rows);
    run_case(c);
  }
}

// The MoE router form: fp32 x and weights [E, hidden], fp32 logits; ragged K (in % 4 == 0 only).
TEST(SkinnyGemm, Fp32Router) {
  for (int64_t rows : {1, 2, 6, 16}) {
    for (int64_t in : {2304, 132}) {
      Case c;
      c.rows = rows;
      c.in = in;
      c.outs = {256};
      c.fp32 = true;
      c.x_stride_pad = rows % 2 == 0 ? 4 : 1;
      c.seed = static_cast<uint32_t>(300 + rows + in);
      run_case(c);
    }
  }
}

// The KDA decode projection set (fg_a, q, k, v, b_proj, g_proj at reduced width) plus an empty output.
TEST(SkinnyGemm, MultiOutputSharedInput) {
  for (int64_t rows : {1, 4, 16}) {
    for (bool bf16 : {true, false}) {
      Case c;
      c.rows = rows;
      c.in = 2304;
      c.outs = {256, 512, 512, 0, 512, 32};
      c.y_bf16 = bf16;
      c.seed = static_cast<uint32_t>(90 + rows);
      run_case(c);
    }
  }
}

TEST(SkinnyGemm, ZeroRowsLaunchesNothing) {
  Case c;
  c.rows = 0;
  c.in = 64;
  c.outs = {8};
  run_case(c);
}

TEST(SkinnyGemm, UnsupportedShapesAreRefused) {
  DeviceBuffer<__nv_bfloat16> w(64 * 64 + 8), x(16 * 64);
  DeviceBuffer<float> y(17 * 64);
  SkinnyGemmParams p;
  p.x = x.get();
  p.x_stride = 64;
  p.rows = 4;
  p.in = 64;
  p.num_outputs = 1;
  p.outputs[0] = {w.get(), 64, y.get(), 64};
  EXPECT_TRUE(skinny_gemm_supported(p));
  SkinnyGemmParams bad = p;
  bad.rows = kSkinnyGemmMaxRows + 1;
  EXPECT_FALSE(skinny_gemm_supported(bad)) << "rows past the limit";
  bad = p;
  bad.in = 60;
  bad.x_stride = 60;
  EXPECT_FALSE(skinny_gemm_supported(bad)) << "in % 8 != 0";
  bad = p;
  bad.outputs[0].weight = w.get() + 1;
  EXPECT_FALSE(skinny_gemm_supported(bad)) << "unaligned weight";
  bad = p;
  bad.y_bf16 = true;
  bad.accumulate = true;
  EXPECT_FALSE(skinny_gemm_supported(bad)) << "bf16 accumulate";
  bad = p;
  bad.in = 8192;
  bad.x_stride = 8192;
  bad.rows = 16;
  EXPECT_FALSE(skinny_gemm_supported(bad)) << "activations past the shared-memory limit";
  bad = p;
  bad.input = SkinnyGemmInput::kFp32;
  bad.accumulate = true;
  EXPECT_FALSE(skinny_gemm_supported(bad)) << "fp32 accumulate";
  bad = p;
  bad.num_outputs = 0;
  EXPECT_FALSE(skinny_gemm_supported(bad)) << "no outputs";
  bad = p;
  bad.in = 60;
  const Status status = skinny_gemm(bad, nullptr);
  EXPECT_FALSE(status.is_ok());
  EXPECT_NE(status.to_string().find("in % 8"), std::string::npos) << status.to_string();

  // The 1-2-row fields.
  p.rows = 2;
  EXPECT_TRUE(skinny_gemm_supported(p));
  bad = p;
  bad.norm_x = true;
  EXPECT_TRUE(skinny_gemm_supported(bad)) << "fused norm, 2 rows";
  bad.rows = 3;
  EXPECT_FALSE(skinny_gemm_supported(bad)) << "fused norm at 3 rows";
  bad = p;
  bad.norm_x = true;
  bad.outputs[0].x_offset = 8;
  bad.x_stride = 72;
  EXPECT_FALSE(skinny_gemm_supported(bad)) << "fused norm with an x offset";
  bad = p;
  bad.outputs[0].x_offset = 4;
  bad.x_stride = 72;
  EXPECT_FALSE(skinny_gemm_supported(bad)) << "x offset not a multiple of 8";
  bad.outputs[0].x_offset = 8;
  EXPECT_TRUE(skinny_gemm_supported(bad)) << "x offset 8, x_stride 72";
  bad.x_stride = 70;
  EXPECT_FALSE(skinny_gemm_supported(bad)) << "x_stride < x_offset + in";
  bad.x_stride = 72;
  bad.rows = 3;
  EXPECT_FALSE(skinny_gemm_supported(bad)) << "x offset at 3 rows";
  bad = p;
  bad.outputs[0].y_bf16 = true;
  bad.accumulate = true;
  EXPECT_FALSE(skinny_gemm_supported(bad)) << "per-output bf16 with accumulate";
  bad.accumulate = false;
  EXPECT_TRUE(skinny_gemm_supported(bad)) << "per-output bf16";
  bad.rows = 3;
  EXPECT_FALSE(skinny_gemm_supported(bad)) << "per-output bf16 at 3 rows";
}

// ---- the 1-2-row kernels ----------------------------------------------------------------------------------------

// Few row groups for the resident warps, so choose_split splits k over a team of warps (in 4096 at 1 row: 4 chunks
// a row), plain and accumulating, against the CPU reference (the fp32 bound of run_case); 3 and 16 rows for the
// kernel without split-K at the same shapes.
TEST(SkinnyGemmV2, SplitK) {
  for (int64_t rows : {1, 2, 3, 16}) {
    for (bool accumulate : {false, true}) {
      for (int64_t in : {2304, 4096}) {
        Case c;
        c.rows = rows;
        c.in = in;
        c.outs = {2304 / 4 + 1, 7};
        c.accumulate = accumulate;
        c.seed = static_cast<uint32_t>(1000 + in / 256 + rows * 2 + accumulate);
        run_case(c);
      }
    }
  }
}

// KDA's f_b and g_b form: two outputs reading the two halves of one x row; also offsets in any order.
TEST(SkinnyGemmV2, PerOutputOffsets) {
  for (int64_t rows : {1, 2}) {
    Case c;
    c.rows = rows;
    c.in = 128;
    c.outs = {512, 512};
    c.x_offsets = {0, 128};
    c.y_bf16 = true;
    c.seed = static_cast<uint32_t>(1200 + rows);
    run_case(c);
    c.outs = {97, 0, 130};
    c.x_offsets = {64, 8, 0};
    c.x_stride_pad = 3;  // unaligned rows: the scalar copy of x
    c.y_bf16 = false;
    run_case(c);
  }
}

// MLA's kv_a (fp32) and q_proj (bf16) and a gate (fp32) in one launch.
TEST(SkinnyGemmV2, PerOutputTypes) {
  for (int64_t rows : {1, 2}) {
    Case c;
    c.rows = rows;
    c.in = 2304;
    c.outs = {576 / 4, 6144 / 8, 257};
    c.out_bf16 = {false, true, false};
    c.seed = static_cast<uint32_t>(1300 + rows);
    run_case(c);
  }
}

// The fused norm against rms_norm (ops.hpp, bf16 out) followed by the same GEMM (at these widths one k chunk a row:
// no split-K either way, so the same sums): bitwise equal outputs, for rows 1..2, ragged `in`, with and without a
// norm weight, fp32 / bf16 / accumulating outputs. x rows past `rows` and the x_stride tails are NaN (never read);
// output padding must stay NaN.
TEST(SkinnyGemmV2, FusedNormBitwise) {
  const float eps = 1e-6f;
  for (int64_t in : {2304, 1000, 8}) {
    for (int64_t rows = 1; rows <= 2; ++rows) {
      for (bool accumulate : {false, true}) {
        for (bool with_weight : {true, false}) {
          SCOPED_TRACE("in " + std::to_string(in) + " rows " + std::to_string(rows) + " accumulate " +
                       std::to_string(accumulate) + " weight " + std::to_string(with_weight) + " kernel " +
                       kernel_name(skinny_gemm_kernel_for(rows, in)));
          std::mt19937 rng(static_cast<uint32_t>(in * 31 + rows * 7 + with_weight * 3 + accumulate));
          const int64_t x_stride = in + 3, n32 = 97, n16 = 130, y32_stride = n32 + 2, y16_stride = n16 + 1;
          const std::vector<float> values = normal_vector(rng, rows * in, 0.3f, 2.0f);
          std::vector<float> x(kSkinnyGemmMaxRows * x_stride, NAN);
          for (int64_t m = 0; m < rows; ++m) std::copy_n(values.begin() + m * in, in, x.begin() + m * x_stride);
          const std::vector<float> norm_weight = normal_vector(rng, in, 1.0f, 0.2f);
          const std::vector<float> w = normal_vector(rng, (n32 + n16) * in, 0.0f, 0.05f);
          std::vector<float> y32_initial(kSkinnyGemmMaxRows * y32_stride, NAN);
          for (int64_t m = 0; m < rows; ++m) {
            for (int64_t col = 0; col < n32; ++col) y32_initial[m * y32_stride + col] = 0.25f * (m - col % 5);
          }
          DeviceBuffer<float> x_d(x.size()), norm_d(in), y32_d(y32_initial.size()), y32_ref_d(y32_initial.size());
          DeviceBuffer<__nv_bfloat16> w_d(w.size()), normed_d(rows * in), y16_d(kSkinnyGemmMaxRows * y16_stride),
              y16_ref_d(kSkinnyGemmMaxRows * y16_stride);
          x_d.upload(x);
          norm_d.upload(norm_weight);
          w_d.upload(to_bf16(w));
          for (const DeviceBuffer<float>* y : {&y32_d, &y32_ref_d}) y->upload(y32_initial);
          const std::vector<__nv_bfloat16> y16_initial(kSkinnyGemmMaxRows * y16_stride, bf16_nan());
          for (const DeviceBuffer<__nv_bfloat16>* y : {&y16_d, &y16_ref_d}) y->upload(y16_initial);

          // Accumulating GEMMs take fp32 outputs only: the bf16 output is dropped then.
          SkinnyGemmParams p;
          p.rows = rows;
          p.in = in;
          p.accumulate = accumulate;
          p.num_outputs = accumulate ? 1 : 2;
          p.outputs[0] = {w_d.get(), n32, y32_d.get(), y32_stride};
          p.outputs[1] = {w_d.get() + n32 * in, n16, y16_d.get(), y16_stride};
          p.outputs[1].y_bf16 = true;
          SkinnyGemmParams fused = p;
          fused.x = x_d.get();
          fused.x_stride = x_stride;
          fused.norm_x = true;
          fused.norm_weight = with_weight ? norm_d.get() : nullptr;
          fused.norm_eps = eps;
          SkinnyGemmParams reference = p;
          reference.x = normed_d.get();
          reference.x_stride = in;
          reference.outputs[0].y = y32_ref_d.get();
          reference.outputs[1].y = y16_ref_d.get();
          ASSERT_TRUE(skinny_gemm_supported(fused));
          ASSERT_TRUE(skinny_gemm_supported(reference));
          Stream stream;
          Status status = skinny_gemm(fused, stream.get());
          ASSERT_TRUE(status.is_ok()) << status.to_string();
          status =
              cuda::rms_norm(x_d.get(), x_stride, fused.norm_weight, rows, in, eps, normed_d.get(), in, stream.get());
          ASSERT_TRUE(status.is_ok()) << status.to_string();
          status = skinny_gemm(reference, stream.get());
          ASSERT_TRUE(status.is_ok()) << status.to_string();
          stream.sync();
          const std::vector<float> y32 = y32_d.download(), y32_ref = y32_ref_d.download();
          const std::vector<__nv_bfloat16> y16 = y16_d.download(), y16_ref = y16_ref_d.download();
          for (int64_t m = 0; m < kSkinnyGemmMaxRows; ++m) {
            for (int64_t col = 0; col < y32_stride; ++col) {
              const float a = y32[m * y32_stride + col], e = y32_ref[m * y32_stride + col];
              if (m >= rows || col >= n32) {
                ASSERT_TRUE(std::isnan(a)) << "fp32 padding row " << m << " col " << col;
              } else {
                ASSERT_EQ(std::memcmp(&a, &e, 4), 0) << "fp32 row " << m << " col " << col << ": " << a << " vs " << e;
              }
            }
            for (int64_t col = 0; col < y16_stride; ++col) {
              const float a = __bfloat162float(y16[m * y16_stride + col]);
              const float e = __bfloat162float(y16_ref[m * y16_stride + col]);
              if (m >= rows || col >= n16 || accumulate) {
                ASSERT_TRUE(std::isnan(a)) << "bf16 padding row " << m << " col " << col;
              } else {
                ASSERT_EQ(std::memcmp(&a, &e, 4), 0) << "bf16 row " << m << " col " << col << ": " << a << " vs " << e;
              }
            }
          }
        }
      }
    }
  }
}

// Programmatic dependent launch inside a captured graph: a chain in which each launch reads what the launch
// just before it wrote (x of a fused-norm projection written by an accumulating GEMM, a bf16 x written by
// rms_norm, the residual accumulated into while the next launch reads it) gives bitwise the eager results, twice
// in a row (the second pass reads the first one's residual).
TEST(SkinnyGemmV2, PdlGraphMatchesEager) {
  constexpr int64_t kHidden = 2304, kQ = 512, kKv = 64, kOut = 333;
  for (int64_t rows : {1, 2}) {
    SCOPED_TRACE("rows " + std::to_string(rows));
    std::mt19937 rng(static_cast<uint32_t>(77 + rows));
    const std::vector<float> residual0 = normal_vector(rng, rows * kHidden);
    const std::vector<float> norm_weight = normal_vector(rng, kHidden, 1.0f, 0.2f);
    const std::vector<float> w = normal_vector(rng, (kQ + kKv) * kHidden + kHidden * kQ + kOut * kHidden, 0.0f, 0.05f);
    DeviceBuffer<float> residual(rows * kHidden), norm(kHidden), kv(rows * kKv), y(rows * kOut);
    DeviceBuffer<__nv_bfloat16> weights(w.size()), q(rows * kQ), normed(rows * kHidden);
    norm.upload(norm_weight);
    weights.upload(to_bf16(w));
    const __nv_bfloat16* w_qkv = weights.get();
    const __nv_bfloat16* w_o = w_qkv + (kQ + kKv) * kHidden;
    const __nv_bfloat16* w_y = w_o + kHidden * kQ;

    auto chain = [&](cudaStream_t stream) -> Status {
      for (int pass = 0; pass < 2; ++pass) {
        SkinnyGemmParams a;  // q (bf16) and kv (fp32) of the normalised residual
        a.x = residual.get();
        a.x_stride = kHidden;
        a.rows = rows;
        a.in = kHidden;
        a.norm_x = true;
        a.norm_weight = norm.get();
        a.norm_eps = 1e-5f;
        a.num_outputs = 2;
        a.outputs[0] = {w_qkv, kQ, q.get(), kQ};
        a.outputs[0].y_bf16 = true;
        a.outputs[1] = {w_qkv + kQ * kHidden, kKv, kv.get(), kKv};
        DS_RETURN_IF_ERROR(skinny_gemm(a, stream));
        SkinnyGemmParams b;  // residual += q · W_o^T (split-K as chosen)
        b.x = q.get();
        b.x_stride = kQ;
        b.rows = rows;
        b.in = kQ;
        b.accumulate = true;
        b.num_outputs = 1;
        b.outputs[0] = {w_o, kHidden, residual.get(), kHidden};
        DS_RETURN_IF_ERROR(skinny_gemm(b, stream));
        DS_RETURN_IF_ERROR(
            cuda::rms_norm(residual.get(), kHidden, norm.get(), rows, kHidden, 1e-5f, normed.get(), kHidden, stream));
        SkinnyGemmParams c;  // y = normed · W_y^T, then residual += ... of the fused norm of the new residual
        c.x = normed.get();
        c.x_stride = kHidden;
        c.rows = rows;
        c.in = kHidden;
        c.num_outputs = 1;
        c.outputs[0] = {w_y, kOut, y.get(), kOut};
        DS_RETURN_IF_ERROR(skinny_gemm(c, stream));
      }
      return Status::ok();
    };
    Stream stream;
    residual.upload(residual0);
    Status status = chain(stream.get());
    ASSERT_TRUE(status.is_ok()) << status.to_string();
    stream.sync();
    const std::vector<float> eager_residual = residual.download(), eager_kv = kv.download(), eager_y = y.download();
    const std::vector<__nv_bfloat16> eager_q = q.download();

    residual.upload(residual0);
    ASSERT_NO_FATAL_FAILURE(replay_captured(stream.get(), cudaStreamCaptureModeGlobal, 1, chain));
    const std::vector<float> graph_residual = residual.download(), graph_kv = kv.download(), graph_y = y.download();
    const std::vector<__nv_bfloat16> graph_q = q.download();
    EXPECT_EQ(std::memcmp(eager_residual.data(), graph_residual.data(), eager_residual.size() * 4), 0);
    EXPECT_EQ(std::memcmp(eager_kv.data(), graph_kv.data(), eager_kv.size() * 4), 0);
    EXPECT_EQ(std::memcmp(eager_y.data(), graph_y.data(), eager_y.size() * 4), 0);
    EXPECT_EQ(std::memcmp(eager_q.data(), graph_q.data(), eager_q.size() * 2), 0);
    for (float v : graph_y) ASSERT_TRUE(std::isfinite(v));
  }
}

// rms_norm_dual vs cpu::rms_norm (fp32 within 1e-6 + 1e-5 |ref|; bf16 within one ulp of the rounded reference)
// and vs rms_norm (ops.hpp), which it is expected to match bitwise (held to 1e-6 relative); poisoned padding.
TEST(RmsNormDual, MatchesCpuAndSingleNorm) {
  for (int64_t rows : {1, 3, 16, 40}) {
    for (int64_t dim : {2304, 100}) {
      for (bool with_weight : {true, false}) {
        SCOPED_TRACE("rows " + std::to_string(rows) + " dim " + std::to_string(dim) + " weight " +
                     std::to_string(with_weight));
        std::mt19937 rng(static_cast<uint32_t>(rows * 7 + dim));
        const int64_t x_stride = dim + 3, y16_stride = dim + 5, y32_stride = dim + 2;
        const std::vector<float> x_packed = normal_vector(rng, rows * dim, 0.3f, 2.0f);
        const std::vector<float> weight = normal_vector(rng, dim, 1.0f, 0.2f);
        std::vector<float> x_strided(rows * x_stride, NAN);
        for (int64_t r = 0; r < rows; ++r)
          std::copy_n(x_packed.begin() + r * dim, dim, x_strided.begin() + r * x_stride);
        std::vector<float> ref(rows * dim);
        cpu::rms_norm(x_packed.data(), with_weight ? weight.data() : nullptr, ref.data(), rows, dim, 1e-5f);

        DeviceBuffer<float> x_d(x_strided.size()), w_d(dim), y32_d(rows * y32_stride), single32_d(rows * dim);
        DeviceBuffer<__nv_bfloat16> y16_d(rows * y16_stride);
        x_d.upload(x_strided);
        w_d.upload(weight);
        y32_d.upload(std::vector<float>(rows * y32_stride, NAN));
        y16_d.upload(std::vector<__nv_bfloat16>(rows * y16_stride, bf16_nan()));
        Stream stream;
        const float* w = with_weight ? w_d.get() : nullptr;
        Status status = rms_norm_dual(x_d.get(), x_stride, w, rows, dim, 1e-5f, y16_d.get(), y16_stride, y32_d.get(),
                                      y32_stride, stream.get());
        ASSERT_TRUE(status.is_ok()) << status.to_string();
        status = cuda::rms_norm(x_d.get(), x_stride, w, rows, dim, 1e-5f, single32_d.get(), dim, stream.get());
        ASSERT_TRUE(status.is_ok()) << status.to_string();
        stream.sync();
        const std::vector<float> y32 = y32_d.download(), single = single32_d.download();
        const std::vector<float> y16 = to_float(y16_d.download(), rows * y16_stride);
        std::vector<float> y32_packed(rows * dim), y16_packed(rows * dim), ref16(rows * dim);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < y32_stride; ++c) {
            if (c < dim) {
              y32_packed[r * dim + c] = y32[r * y32_stride + c];
            } else {
              ASSERT_TRUE(std::isnan(y32[r * y32_stride + c])) << "fp32 padding row " << r << " col " << c;
            }
          }
          for (int64_t c = 0; c < y16_stride; ++c) {
            if (c < dim) {
              y16_packed[r * dim + c] = y16[r * y16_stride + c];
              ref16[r * dim + c] = bf16_round(ref[r * dim + c]);
            } else {
              ASSERT_TRUE(std::isnan(y16[r * y16_stride + c])) << "bf16 padding row " << r << " col " << c;
            }
          }
        }
        EXPECT_TRUE(all_close(y32_packed, ref, 1e-6, 1e-5, "fp32 vs cpu::rms_norm"));
        EXPECT_TRUE(all_close(y16_packed, ref16, 1e-6, 8e-3, "bf16 vs rounded cpu::rms_norm"));
        EXPECT_TRUE(all_close(y32_packed, single, 0.0, 1e-6, "fp32 vs cuda::rms_norm"));
      }
    }
  }
  EXPECT_FALSE(rms_norm_dual(nullptr, 4, nullptr, 1, 8, 1e-5f, nullptr, 8, nullptr, 8, nullptr).is_ok());
  EXPECT_TRUE(rms_norm_dual(nullptr, 8, nullptr, 0, 8, 1e-5f, nullptr, 8, nullptr, 8, nullptr).is_ok());
}

// Achieved weight bandwidth at the 48B decode shapes (weights rotated through copies larger than L2 so every
// launch reads HBM). Prints GB/s and the fraction of the 4.24 TB/s copy ceiling; the goal is >= 80% for N*K >= 4M.
TEST(SkinnyGemm, Bandwidth48B) {
  struct Shape {
    const char* name;
    std::vector<int64_t> outs;
    int64_t in;
    bool bf16;
    bool accumulate;
  };
  const Shape shapes[] = {
      {"kda qkv+fg_a+b_proj (fused)", {256, 4096, 4096, 4096, 32}, 2304, true, false},
      {"kda qkv [12288x2304]", {12288}, 2304, true, false},
      {"kda o_proj [2304x4096] +=", {2304}, 4096, false, true},
      {"shared gate_up [2048x2304]", {2048}, 2304, true, false},
      {"shared down [2304x1024] +=", {2304}, 1024, false, true},
      {"lm head [163840x2304]", {163840}, 2304, false, false},
  };
  constexpr double kCeilingBytesPerS = 4.24e12;
  Stream stream;
  for (const Shape& shape : shapes) {
    int64_t total_n = 0, max_n = 0;
    for (int64_t n : shape.outs) total_n += n, max_n = std::max(max_n, n);
    const size_t weight_bytes = static_cast<size_t>(total_n * shape.in) * 2;
    const int copies = static_cast<int>(std::max<size_t>(1, (size_t{256} << 20) / weight_bytes + 1));
    DeviceBuffer<__nv_bfloat16> w(static_cast<size_t>(copies) * total_n * shape.in);
    DeviceBuffer<__nv_bfloat16> x(kSkinnyGemmMaxRows * shape.in);
    DeviceBuffer<float> y(kSkinnyGemmMaxRows * total_n);
    ASSERT_NE(w.get(), nullptr);
    ASSERT_EQ(cudaMemset(w.get(), 0, w.size() * 2), cudaSuccess);
    ASSERT_EQ(cudaMemset(x.get(), 0, x.size() * 2), cudaSuccess);
    ASSERT_EQ(cudaMemset(y.get(), 0, y.size() * 4), cudaSuccess);
    for (int64_t rows : {1, 4, 16}) {
      std::vector<SkinnyGemmParams> params(copies);
      for (int copy = 0; copy < copies; ++copy) {
        SkinnyGemmParams& p = params[copy];
        p.x = x.get();
        p.x_stride = shape.in;
        p.rows = rows;
        p.in = shape.in;
        p.y_bf16 = shape.bf16;
        p.accumulate = shape.accumulate;
        int64_t offset = 0;
        for (int64_t n : shape.outs) {
          p.outputs[p.num_outputs++] = {w.get() + (copy * total_n + offset) * shape.in, n, y.get() + offset, total_n};
          offset += n;
        }
      }
      for (int i = 0; i < 3; ++i) ASSERT_TRUE(skinny_gemm(params[i % copies], stream.get()).is_ok());
      cudaEvent_t start, stop;
      cudaEventCreate(&start);
      cudaEventCreate(&stop);
      const int iterations = std::max(20, 2 * copies);
      cudaEventRecord(start, stream.get());
      for (int i = 0; i < iterations; ++i) (void)skinny_gemm(params[i % copies], stream.get());
      cudaEventRecord(stop, stream.get());
      stream.sync();
      float ms = 0.0f;
      cudaEventElapsedTime(&ms, start, stop);
      cudaEventDestroy(start);
      cudaEventDestroy(stop);
      const double seconds = ms * 1e-3 / iterations;
      const double bytes_per_s = weight_bytes / seconds;
      std::printf("skinny_gemm %-30s rows %2lld: %8.2f us  %7.1f GB/s  %5.1f%% of copy ceiling\n", shape.name,
                  static_cast<long long>(rows), seconds * 1e6, bytes_per_s * 1e-9,
                  100.0 * bytes_per_s / kCeilingBytesPerS);
    }
  }
}

// The engine's decode shapes at rows 1 and 4: one "pass" is what the engine enqueues for the shape (at 4 rows
// rms_norm first where 1-2 rows fuse the input norm, and one launch per output where 1-2 rows mix output types or
// read column offsets), timed as CUDA-graph replays of kLaunches passes in a row over enough weight copies that no
// pass finds its weights in L2 (> 60 MB between two reads of a copy). Prints us per pass and the fraction of the 4.26
// TB/s copy rate its weight bytes make; asserts only that the launches succeed.
TEST(SkinnyGemmGpu, Timing) {
  struct Shape {
    const char* name;
    std::vector<int64_t> outs;
    std::vector<bool> bf16;          // per output
    std::vector<int64_t> x_offsets;  // per output; empty: 0
    int64_t in;
    bool accumulate;
    bool norm;  // the input norm of fp32 rows (1-2 rows: fused; more: rms_norm, then the GEMM)
  };
  const std::vector<int64_t> kda = {256, 4096, 4096, 4096, 32};
  const std::vector<bool> kda_bf16(5, true);
  const Shape shapes[] = {
      {"kda fused projection", kda, kda_bf16, {}, 2304, false, false},
      {"kda fused projection + input norm", kda, kda_bf16, {}, 2304, false, true},
      {"o_proj 2304x4096 +=", {2304}, {false}, {}, 4096, true, false},
      {"mla kv_a 576 + q_proj 6144", {576, 6144}, {false, true}, {}, 2304, false, false},
      {"mla kv_a + q_proj + input norm", {576, 6144}, {false, true}, {}, 2304, false, true},
      {"kda f_b + g_b (128 -> 4096 x 2)", {4096, 4096}, {true, true}, {0, 128}, 128, false, false},
      {"lm head 163840x2304", {163840}, {false}, {}, 2304, false, false},
  };
  constexpr double kCopyBytesPerS = 4.26e12;
  constexpr int kLaunches = 20;
  constexpr size_t kL2Flush = size_t{60} << 20;
  Stream stream;
  for (const Shape& shape : shapes) {
    int64_t total_n = 0, x_cols = shape.in;
    for (size_t o = 0; o < shape.outs.size(); ++o) {
      total_n += shape.outs[o];
      if (!shape.x_offsets.empty()) x_cols = std::max(x_cols, shape.x_offsets[o] + shape.in);
    }
    const size_t weight_bytes = static_cast<size_t>(total_n * shape.in) * 2;
    const int copies =
        weight_bytes >= kL2Flush ? 1 : std::min<int>(kLaunches, static_cast<int>(kL2Flush / weight_bytes) + 2);
    DeviceBuffer<__nv_bfloat16> w(static_cast<size_t>(copies) * total_n * shape.in), x16(4 * x_cols), y16(4 * total_n);
    DeviceBuffer<float> x32(4 * shape.in), norm(shape.in), y32(4 * total_n);
    ASSERT_NE(w.get(), nullptr);
    ASSERT_EQ(cudaMemset(w.get(), 0, w.size() * 2), cudaSuccess);
    ASSERT_EQ(cudaMemset(x16.get(), 0, x16.size() * 2), cudaSuccess);
    ASSERT_EQ(cudaMemset(x32.get(), 0, x32.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMemset(norm.get(), 0, norm.size() * 4), cudaSuccess);
    for (int64_t rows : {1, 4}) {
      const SkinnyGemmKernel kernel = skinny_gemm_kernel_for(rows, shape.in);
      const bool v1 = kernel == SkinnyGemmKernel::kV1;
      // Output o of weight copy `copy`; y columns [offset, offset + n) of a [rows, total_n] buffer.
      auto output = [&](int copy, size_t o, int64_t row_offset) {
        SkinnyGemmOutput out{w.get() + (copy * total_n + row_offset) * shape.in, shape.outs[o], nullptr, total_n};
        out.y = shape.bf16[o] ? static_cast<void*>(y16.get() + row_offset) : static_cast<void*>(y32.get() + row_offset);
        out.x_offset = shape.x_offsets.empty() ? 0 : shape.x_offsets[o];
        return out;
      };
      SkinnyGemmParams base;
      base.x = x16.get();
      base.x_stride = x_cols;
      base.rows = rows;
      base.in = shape.in;
      base.accumulate = shape.accumulate;
      auto pass = [&](cudaStream_t s, int copy) -> Status {
        const bool uniform =
            std::all_of(shape.bf16.begin(), shape.bf16.end(), [&](bool b) { return b == shape.bf16[0]; });
        if (v1 && shape.norm) {
          DS_RETURN_IF_ERROR(
              cuda::rms_norm(x32.get(), shape.in, norm.get(), rows, shape.in, 1e-5f, x16.get(), x_cols, s));
        }
        if (v1 && (!uniform || !shape.x_offsets.empty())) {
          int64_t row_offset = 0;
          for (size_t o = 0; o < shape.outs.size(); ++o) {
            SkinnyGemmParams p = base;
            p.y_bf16 = shape.bf16[o];
            p.num_outputs = 1;
            p.outputs[0] = output(copy, o, row_offset);
            p.x = x16.get() + p.outputs[0].x_offset;
            p.outputs[0].x_offset = 0;
            DS_RETURN_IF_ERROR(skinny_gemm(p, s));
            row_offset += shape.outs[o];
          }
          return Status::ok();
        }
        SkinnyGemmParams p = base;
        if (!v1 && shape.norm) {
          p.x = x32.get();
          p.x_stride = shape.in;
          p.norm_x = true;
          p.norm_weight = norm.get();
          p.norm_eps = 1e-5f;
        }
        p.y_bf16 = uniform && shape.bf16[0];
        int64_t row_offset = 0;
        for (size_t o = 0; o < shape.outs.size(); ++o) {
          p.outputs[p.num_outputs] = output(copy, o, row_offset);
          p.outputs[p.num_outputs++].y_bf16 = !uniform && shape.bf16[o];
          row_offset += shape.outs[o];
        }
        return skinny_gemm(p, s);
      };
      auto passes = [&](cudaStream_t s) -> Status {
        for (int i = 0; i < kLaunches; ++i) DS_RETURN_IF_ERROR(pass(s, i % copies));
        return Status::ok();
      };
      double ms = 0.0;
      ASSERT_NO_FATAL_FAILURE(time_graph_replays(stream.get(), cudaStreamCaptureModeGlobal, 2, 10, passes, &ms));
      const double seconds = ms * 1e-3 / kLaunches;
      std::printf("SkinnyGemmGpu.Timing %-36s rows %lld %-8s: %8.2f us  %5.1f%% of 4.26 TB/s\n", shape.name,
                  static_cast<long long>(rows), kernel_name(kernel), seconds * 1e6,
                  100.0 * static_cast<double>(weight_bytes) / seconds / kCopyBytesPerS);
    }
  }
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
