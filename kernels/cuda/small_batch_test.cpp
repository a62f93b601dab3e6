// Skinny GEMM (kernels/cuda/small_batch.hpp) vs the CPU reference cpu::linear on bf16-rounded inputs, ctest label
// gpu. Tolerance per element: |err| <= 1e-5 * sum_k |x_k w_k| + 1e-6 (both sides sum in fp32 in different orders;
// an indexing bug misses by O(sum)); bf16 outputs additionally get one bf16 ulp (2^-8 |ref|) for the final rounding.
// Outputs carry NaN-poisoned padding (y_stride tails and the rows past `rows`) that must stay NaN; strided x rows
// carry NaN past `in` that must never be read. SkinnyGemm.Bandwidth48B prints the achieved weight bandwidth at the
// Kimi-Linear-48B decode shapes (rows 1, 4, 16) for the lead to read; it asserts nothing about speed.
#include "kernels/cuda/small_batch.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/basic_ops.hpp"
#include "kernels/cuda/ops.hpp"
#include "kernels/cuda/ops_test_util.hpp"

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
};

std::string describe(const Case& c) {
  std::ostringstream s;
  s << "rows " << c.rows << " in " << c.in << " outs [";
  for (int64_t n : c.outs) s << n << " ";
  s << "] x_stride_pad " << c.x_stride_pad << " y_stride_pad " << c.y_stride_pad << " bf16 " << c.y_bf16
    << " accumulate " << c.accumulate << " fp32 " << c.fp32;
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

void run_case(const Case& c) {
  SCOPED_TRACE(describe(c));
  std::mt19937 rng(c.seed);
  const int64_t x_stride = c.in + c.x_stride_pad;
  std::vector<float> x = normal_vector(rng, c.rows * c.in);
  if (!c.fp32) {
    for (float& v : x) v = bf16_round(v);
  }
  std::vector<float> x_strided(std::max<int64_t>(c.rows, 1) * x_stride, NAN);
  for (int64_t m = 0; m < c.rows; ++m) std::copy_n(x.begin() + m * c.in, c.in, x_strided.begin() + m * x_stride);

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
  p.y_bf16 = c.y_bf16;
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
    if (c.y_bf16) {
      y16.emplace_back(initial.size());
      y16.back().upload(to_bf16(initial));
      p.outputs[o] = {weight_at(w_offset), n, y16.back().get(), y_stride};
    } else {
      y32.emplace_back(initial.size());
      y32.back().upload(initial);
      p.outputs[o] = {weight_at(w_offset), n, y32.back().get(), y_stride};
    }
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
    std::vector<float> expected(c.rows * n);
    if (c.rows > 0 && n > 0) cpu::linear(x.data(), w.data() + w_offset * c.in, expected.data(), c.rows, c.in, n);
    std::vector<double> bound(c.rows * n);
    for (int64_t m = 0; m < c.rows; ++m) {
      for (int64_t col = 0; col < n; ++col) {
        double sum_abs = 0.0;
        for (int64_t k = 0; k < c.in; ++k) sum_abs += std::fabs(x[m * c.in + k] * w[(w_offset + col) * c.in + k]);
        float& e = expected[m * n + col];
        if (c.accumulate) e += y_initial[o][m * y_stride + col];
        bound[m * n + col] = 1e-5 * sum_abs + 1e-6;
        if (c.y_bf16) {
          e = bf16_round(e);
          bound[m * n + col] += std::ldexp(std::fabs(e), -8);
        }
      }
    }
    const std::vector<float> actual =
        c.y_bf16 ? to_float(y16[o].download(), kSkinnyGemmMaxRows * y_stride) : y32[o].download();
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

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
