// mla_prefill's naive form on the Hopper wgmma flash kernel (prefill_wgmma.cu) against the CPU reference
// (cpu::mla_attention_naive on the same bf16 values), ctest label gpu. Tolerance per output element (outputs are
// O(0.1..1)): |gpu - cpu| <= 2e-2 + 1e-2 |cpu| (the tensor-core bound of mla_attention_check.hpp: K, V and P rounded
// to bf16, fp32 accumulation). Where the Hopper kernel declines (head dims other than 128 / 64 / 128, a q_stride that
// breaks 16-byte rows) the launcher runs the mma.sync kernel, held to the same bound. Every page slot and table entry
// not read, the q row padding, the output past the end and, before every run, the whole naive workspace (so the rows
// past a block's last row, which TMA must zero-fill instead of reading) are NaN-poisoned.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/mla.hpp"
#include "kernels/cuda/mla/detail/prefill_wgmma.hpp"
#include "kernels/cuda/mla/mla.hpp"
#include "kernels/cuda/tests/gpu_test_graph.hpp"
#include "kernels/cuda/tests/kda_test_util.hpp"
#include "kernels/cuda/tests/mla_test_util.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

using Dims = MlaShape;
constexpr Dims kKimi{32, 512, 128, 64, 128};
constexpr Dims kTinyDims{2, 32, 16, 8, 16};  // outside the Hopper kernel: the mma.sync kernel runs

struct Case {
  std::vector<int> q_lens, contexts;
  int block_rows = 0;  // > 0: a workspace for blocks of this many rows (contexts in several blocks); 0: one block
  int page_size = 64;
  int q_stride_pad = 8;  // elements of NaN after each token's q row (not a multiple of 8: the Hopper kernel declines)
  bool capture = false;  // also capture the call in a CUDA graph and replay it (bitwise equal)
};

std::string describe(const Dims& d, const Case& c) {
  std::ostringstream os;
  os << "H=" << d.heads << " kv_lora=" << d.kv_lora << " nope=" << d.nope << " rope=" << d.rope << " v=" << d.v_head
     << " block_rows=" << c.block_rows << " page_size=" << c.page_size << " q_stride_pad=" << c.q_stride_pad
     << " (q_len, context):";
  for (size_t n = 0; n < c.q_lens.size(); ++n) os << " (" << c.q_lens[n] << ", " << c.contexts[n] << ")";
  return os.str();
}

// |actual - expected| <= atol + rtol |expected| element-wise; logs the first failures and the max error with its
// (token, head, column) and the failures per 64-column half of the head (the Hopper kernel computes the halves from
// separate shared-memory boxes of V); returns the number outside.
size_t compare(const std::string& name, const std::vector<float>& actual, const std::vector<float>& expected, size_t n,
               int heads, int v_head, double atol, double rtol) {
  size_t failures_high_half = 0;
  auto where = [&](size_t i) {
    std::ostringstream os;
    os << "token " << i / (static_cast<size_t>(heads) * v_head) << " head " << i / v_head % heads << " col "
       << i % v_head;
    return os.str();
  };
  const auto [max_err, max_at, failures] =
      scan_errors(actual, expected, n, atol, rtol, [&](size_t i, double err, size_t earlier) {
        if (earlier < 5) {
          ADD_FAILURE() << name << ": " << where(i) << ": expected " << expected[i] << " got " << actual[i]
                        << " (abs err " << err << ")";
        }
        if (i % v_head >= 64) ++failures_high_half;
      });
  if (n > 0) {
    std::printf(
        "  [%s] max abs err %.3g at %s (expected %.6g got %.6g); relative L2 %.3g; %zu of %zu outside (columns "
        "0..63: %zu, 64..: %zu)\n",
        name.c_str(), max_err, where(max_at).c_str(), expected[max_at], actual[max_at],
        relative_error(actual.data(), expected.data(), n), failures, n, failures - failures_high_half,
        failures_high_half);
  }
  return failures;
}

size_t bitwise_differences(const std::vector<float>& a, const std::vector<float>& b, size_t n) {
  size_t differing = 0;
  for (size_t i = 0; i < n; ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0 && a[i] != b[i]) ++differing;  // +0 vs -0 counts as equal
  }
  return differing;
}

void run_case(const Dims& dims, const Case& c, uint32_t seed) {
  SCOPED_TRACE(describe(dims, c));
  std::mt19937 rng(seed);
  const int H = dims.heads, kv = dims.kv_lora, nope = dims.nope, rope = dims.rope, v_head = dims.v_head;
  const int width = kv + rope, q_width = nope + rope, ps = c.page_size;
  const int N = static_cast<int>(c.q_lens.size());
  const int64_t row_stride = width + 8;
  const int num_layers = 2, layer = 1;

  std::vector<int32_t> cu_q(N + 1, 0);
  int total_pages = 3;  // spare pages stay NaN
  int longest = 1;
  for (int n = 0; n < N; ++n) {
    ASSERT_LE(c.q_lens[n], c.contexts[n]);
    cu_q[n + 1] = cu_q[n] + c.q_lens[n];
    total_pages += (c.contexts[n] + ps - 1) / ps;
    longest = std::max(longest, c.contexts[n]);
  }
  const int64_t T = cu_q[N];
  const int max_pages = (longest + ps - 1) / ps + 1;

  // Pages in shuffled order; table entries past a sequence's pages hold garbage ids (never read).
  const PagedMlaCache cache =
      paged_mla_cache(rng, c.contexts, width, row_stride, num_layers, layer, ps, total_pages, max_pages, 5);
  const int64_t q_stride = static_cast<int64_t>(H) * q_width + c.q_stride_pad;
  const std::vector<float> q = rounded_normal(rng, static_cast<size_t>(T) * H * q_width, 0.0f, 1.0f);
  const std::vector<__nv_bfloat16> q_host = padded_q(q, T, H * q_width, q_stride);
  const std::vector<float> kv_b = rounded_normal(rng, static_cast<size_t>(H) * (nope + v_head) * kv, 0.0f,
                                                 1.0f / std::sqrt(static_cast<float>(kv)));
  const float scale = 1.0f / std::sqrt(static_cast<float>(q_width));
  const cpu::MlaDims cpu_dims{H, kv, nope, rope, v_head, scale};
  const std::vector<float> expected = mla_reference(cpu_dims, q, cu_q, c.q_lens, c.contexts, cache.caches, width, kv_b);

  const size_t out_size = expected.size(), out_pad = 64;
  DeviceBuffer<__nv_bfloat16> pool_d(cache.pool.size()), q_d(q_host.size()), kv_b_d(kv_b.size());
  DeviceBuffer<int32_t> cu_q_d(N + 1), ctx_d(std::max(N, 1)), table_d(std::max<size_t>(cache.table.size(), 1));
  DeviceBuffer<float> out_d(out_size + out_pad);
  pool_d.upload(cache.pool);
  q_d.upload(q_host);
  kv_b_d.upload(to_bf16(kv_b));
  cu_q_d.upload(cu_q);
  std::vector<int32_t> contexts(c.contexts.begin(), c.contexts.end());
  contexts.push_back(0);  // keeps data() valid for N = 0
  ctx_d.upload(std::vector<int32_t>(contexts.begin(), contexts.begin() + std::max(N, 1)));
  table_d.upload(cache.table);
  const int rows = c.block_rows > 0 ? c.block_rows : longest;
  const size_t ws_bytes = mla_prefill_workspace_bytes(H, kv, nope, rope, v_head, T, rows);
  DeviceBuffer<char> ws_d(ws_bytes);
  ASSERT_NE(ws_d.get(), nullptr);
  CublasHandle cublas;
  ASSERT_EQ(cublasCreate(&cublas.handle), CUBLAS_STATUS_SUCCESS);

  const MlaSeqTables seqs{N, T, cu_q_d.get(), ctx_d.get(), table_d.get(), max_pages, longest};
  MlaAttentionParams p = mla_params(dims, MlaPagePool{pool_d.get(), total_pages, num_layers, ps, row_stride, width},
                                    layer, seqs, q_d.get(), q_stride, kv_b_d.get(), out_d.get(), ws_d.get(), ws_bytes);
  p.prefill_form = MlaPrefillForm::kNaive;
  p.host_cu_q = cu_q.data();
  p.host_context_lens = contexts.data();
  p.cublas = cublas.handle;

  const bool wgmma_covers = detail::mla_wgmma_prefill_supported(nope, rope, v_head, q_d.get(), q_stride);
  if (wgmma_covers) {
    ASSERT_TRUE(detail::mla_wgmma_prefill_ready()) << "the Hopper kernel covers these dims but cannot run here";
  }
  auto run = [&](cudaStream_t stream, std::vector<float>* out) {
    DS_CUDA_OK(cudaMemset(ws_d.get(), 0xff, ws_bytes));  // bf16 and fp32 NaN everywhere
    out_d.upload(std::vector<float>(out_size + out_pad, NAN));
    const Status status = mla_prefill(p, stream);
    ASSERT_TRUE(status.is_ok()) << status.to_string();
    DS_CUDA_OK(cudaStreamSynchronize(stream));
    DS_CUDA_OK(cudaGetLastError());
    *out = out_d.download();
    for (size_t i = out_size; i < out_size + out_pad; ++i) {
      ASSERT_TRUE(std::isnan((*out)[i])) << "output padding written at " << i - out_size << " past the end";
    }
  };
  std::vector<float> direct;
  run(nullptr, &direct);
  if (::testing::Test::HasFatalFailure()) return;
  const std::string name = wgmma_covers ? "naive (wgmma) vs cpu" : "naive (mma.sync) vs cpu";
  EXPECT_EQ(compare(name, direct, expected, out_size, H, v_head, 2e-2, 1e-2), 0u);

  if (c.capture && T > 0) {
    // The call captured in a CUDA graph (relaxed mode, as the engine captures) and replayed twice: the tensor maps
    // travel in the launch parameters, so the replays match the direct call bitwise.
    SCOPED_TRACE("captured in a CUDA graph");
    cudaStream_t stream = nullptr;
    DS_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::vector<float> warm;
    run(stream, &warm);  // cuBLAS settles its workspace for this stream outside the capture
    DS_CUDA_OK(cudaMemset(ws_d.get(), 0xff, ws_bytes));
    out_d.upload(std::vector<float>(out_size + out_pad, NAN));
    ASSERT_NO_FATAL_FAILURE(
        replay_captured(stream, cudaStreamCaptureModeRelaxed, 2, [&](cudaStream_t s) { return mla_prefill(p, s); }));
    const std::vector<float> replayed = out_d.download();
    cudaStreamDestroy(stream);
    EXPECT_EQ(bitwise_differences(replayed, direct, out_size), 0u) << "graph replay differs from the direct call";
    EXPECT_EQ(bitwise_differences(warm, direct, out_size), 0u) << "two direct calls differ";
  }
}

// The query counts around the 64-row warpgroup and the 128-query tile, each sequence's whole context in its chunk.
TEST(MlaPrefillWgmmaGpu, QueryTileEdgesWithoutHistory) {
  run_case(kKimi, Case{{1, 63, 64, 65, 127, 128, 129, 700}, {1, 63, 64, 65, 127, 128, 129, 700}}, 1);
}

// The same chunks over cached prefixes: on and off the 128-key tile (the causal diagonal then cuts a key tile at
// every offset), one prefix of a single row, one far longer than the chunk.
TEST(MlaPrefillWgmmaGpu, QueryTileEdgesOverHistory) {
  run_case(kKimi,
           Case{{1, 63, 64, 65, 127, 128, 129, 700},
                {2, 63 + 37, 64 + 128, 65 + 64, 127 + 1, 128 + 300, 129 + 129, 700 + 1337}},
           2);
}

// Contexts in several workspace blocks (64 .. 320 rows; blocks of 64 / 192 / 320 rows end inside a 128-key tile):
// the softmax state is carried through `out` and the (max, sum) array, and query tiles that precede a whole block
// pass through it unchanged. Page size 16 on one of them.
TEST(MlaPrefillWgmmaGpu, ContextInSeveralWorkspaceBlocks) {
  for (int rows : {64, 128, 192, 320}) {
    Case c{{129, 300, 1, 0, 700}, {129 + 65, 300 + 333, 1000, 17, 700 + 77}};
    c.block_rows = rows;
    run_case(kKimi, c, 10 + rows);
  }
  Case pages16{{257}, {257 + 1500}};
  pages16.block_rows = 512;
  pages16.page_size = 16;
  run_case(kKimi, pages16, 11);
}

// Head counts 1 and 4 (grids of a few CTAs, the head index wrapping inside the tile-major grid) and the K3 head
// count (96), with a graph capture of the call.
TEST(MlaPrefillWgmmaGpu, HeadCounts) {
  Dims one = kKimi, four = kKimi, k3 = kKimi;
  one.heads = 1;
  four.heads = 4;
  k3.heads = 96;
  run_case(one, Case{{65, 700}, {65, 900}}, 20);
  Case captured{{129, 33}, {129 + 200, 400}};
  captured.capture = true;
  run_case(four, captured, 21);
  run_case(k3, Case{{250}, {250 + 130}}, 22);
}

// Inputs the Hopper kernel does not cover run the mma.sync kernel: the tiny head dims, and Kimi dims with a q row
// stride that is not a multiple of 8 elements (rows not 16-byte aligned).
TEST(MlaPrefillWgmmaGpu, DeclinedInputsRunMmaSync) {
  run_case(kTinyDims, Case{{1, 65, 129, 300}, {1, 65 + 64, 129 + 7, 300 + 500}}, 30);
  Case odd_stride{{130, 64}, {130 + 90, 64}};
  odd_stride.q_stride_pad = 4;
  run_case(kKimi, odd_stride, 31);
}

// Kimi dims, one sequence, 8192 queries at the end of contexts of 8192 / 16384 / 32768 rows (one workspace block):
// mla_prefill's naive form timed over back-to-back calls (cudaEvents), with the FLOP count of mla_prefill_test.cpp's
// timing line (2 H (nope + rope + v) per visible pair + the decompression GEMM). Also the decompression GEMM alone
// (same cuBLAS call and shape), so "attention ≈ call − GEMM" estimates the flash kernel alone (the gather, ~40 MB at
// 32k, is left in). Only finite outputs are asserted here (mla_prefill_test.cpp's long-chunk case compares this shape
// with the absorbed form), never speed.
TEST(MlaPrefillWgmmaGpu, Timing) {
  const Dims d = kKimi;
  const int H = d.heads, kv = d.kv_lora, nope = d.nope, rope = d.rope, v_head = d.v_head;
  const int width = kv + rope, q_width = nope + rope, ps = 64;
  const int64_t T = 8192;
  constexpr double kPeakFlops = 873e12;
  constexpr int kCalls = 5;
  ASSERT_TRUE(detail::mla_wgmma_prefill_ready()) << "the Hopper kernel cannot run on this device";
  CublasHandle handle;
  ASSERT_EQ(cublasCreate(&handle.handle), CUBLAS_STATUS_SUCCESS);
  cublasHandle_t cublas = handle.handle;
  cudaEvent_t start = nullptr, stop = nullptr;
  DS_CUDA_OK(cudaEventCreate(&start));
  DS_CUDA_OK(cudaEventCreate(&stop));

  for (const int64_t context : {int64_t{8192}, int64_t{16384}, int64_t{32768}}) {
    const MlaLongChunk chunk(d, T, context, ps, 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(context));
    if (::testing::Test::HasFatalFailure()) return;
    const size_t out_size = static_cast<size_t>(T) * H * v_head;
    DeviceBuffer<float> out_d(out_size);
    const size_t ws_bytes = mla_prefill_workspace_bytes(H, kv, nope, rope, v_head, T, static_cast<int>(context));
    DeviceBuffer<char> ws_d(ws_bytes);
    ASSERT_NE(ws_d.get(), nullptr) << "workspace of " << ws_bytes << " bytes";

    MlaAttentionParams p = chunk.params(d, ws_d.get(), ws_bytes);
    p.prefill_form = MlaPrefillForm::kNaive;
    p.host_cu_q = chunk.cu_q.data();
    p.host_context_lens = chunk.contexts.data();
    p.cublas = cublas;

    const double pairs = static_cast<double>(T) * (context - T) + static_cast<double>(T) * (T + 1) / 2;
    const double attention_flops = pairs * 2.0 * H * (q_width + v_head);
    const double gemm_flops = 2.0 * context * kv * H * (nope + v_head);
    const double naive_flops = attention_flops + gemm_flops;

    // The decompression GEMM alone: kvᵀ [H (nope + v), context] = kv_bᵀ rowsᵀ, as prefill.cu calls it (the
    // pool, one layer, stands in for the gathered rows).
    float gemm_ms = 0.0f;
    {
      const int kv_cols = H * (nope + v_head);
      DeviceBuffer<__nv_bfloat16> decompressed(static_cast<size_t>(context) * kv_cols);
      ASSERT_NE(decompressed.get(), nullptr);
      ASSERT_EQ(cublasSetStream(cublas, nullptr), CUBLAS_STATUS_SUCCESS);
      const float one = 1.0f, zero = 0.0f;
      auto gemm = [&] {
        return cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, kv_cols, static_cast<int>(context), kv, &one,
                            chunk.kv_b_d.get(), CUDA_R_16BF, kv, chunk.pool_d.get(), CUDA_R_16BF, width, &zero,
                            decompressed.get(), CUDA_R_16BF, kv_cols, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      };
      ASSERT_EQ(gemm(), CUBLAS_STATUS_SUCCESS);
      DS_CUDA_OK(cudaEventRecord(start, nullptr));
      for (int i = 0; i < kCalls; ++i) ASSERT_EQ(gemm(), CUBLAS_STATUS_SUCCESS);
      DS_CUDA_OK(cudaEventRecord(stop, nullptr));
      DS_CUDA_OK(cudaEventSynchronize(stop));
      DS_CUDA_OK(cudaEventElapsedTime(&gemm_ms, start, stop));
      gemm_ms /= kCalls;
    }

    p.out = out_d.get();
    const Status status = mla_prefill(p, nullptr);  // warm-up
    ASSERT_TRUE(status.is_ok()) << status.to_string();
    float ms = 0.0f;
    ASSERT_NO_FATAL_FAILURE(time_eager_calls(
        nullptr, kCalls, [&](cudaStream_t s) { return mla_prefill(p, s); }, &ms));
    ms /= kCalls;
    const double call_rate = naive_flops / (ms * 1e-3);
    const double attention_ms = ms - gemm_ms;
    const double attention_rate = attention_flops / (attention_ms * 1e-3);
    std::printf(
        "  [naive] T=%lld context=%lld: %.3f ms per call (%d calls), %.1f TFLOP/s at the naive form's count (%.3g "
        "FLOPs) = %.3f of 873; attention alone ~ %.3f ms (call - GEMM %.3f ms): %.1f TFLOP/s = %.3f of 873\n",
        static_cast<long long>(T), static_cast<long long>(context), ms, kCalls, call_rate / 1e12, naive_flops,
        call_rate / kPeakFlops, attention_ms, gemm_ms, attention_rate / 1e12, attention_rate / kPeakFlops);
    const std::vector<float> out = out_d.download();
    size_t non_finite = 0;
    for (float x : out) non_finite += std::isfinite(x) ? 0 : 1;
    EXPECT_EQ(non_finite, 0u) << "non-finite outputs at context " << context;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
