// GPU paged MLA (mla_write_rows, mla_decode, mla_prefill) vs the CPU references, ctest label gpu.
// Inputs given to the CPU are the bf16 values the GPU reads (q, cache rows and kv_b rounded to bf16), so only the
// GPU's own roundings and the accumulation order differ. Tolerances per output element (outputs are O(0.1..1)),
// against cpu::mla_attention_naive:
//   tensor-core attention (default; q̃ and P rounded to bf16): |gpu - cpu| <= 2e-2 + 1e-2 |cpu|
//   fp32_attention (CUDA-core fp32 kernel):                    |gpu - cpu| <= 5e-3 + 5e-3 |cpu|
// (a host emulation of the bf16 roundings at Kimi-48B dims gave max abs errors of 2e-3 at context 65 and 3e-4 at
// 4097, so the tensor-core bound has a wide margin). Each case runs mla_decode (decode-shaped batches) and
// mla_prefill, each in both absorbed kernels, then mla_prefill in the naive form (forced: decompressed K/V rounded
// to bf16 as well, the tensor-core tolerance) and in the automatic choice, against one CPU reference.
// Every failure log prints the max error, its index (sequence, token, head, column) and expected vs actual.
// Cache writes: within one bf16 rounding step of cpu::rms_norm (the fp32 value may round the other way), the k_rot
// part exact. Every page slot, page table entry and output padding that must not be read or written is
// NaN-poisoned (or holds a garbage page id).
#include "kernels/cuda/mla/mla.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/basic_ops.hpp"
#include "kernels/cpu/mla.hpp"
#include "kernels/cuda/tests/gpu_test_graph.hpp"
#include "kernels/cuda/tests/kda_test_util.hpp"
#include "kernels/cuda/tests/mla_test_util.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

constexpr MlaShape kTiny{2, 32, 16, 8, 16};
constexpr MlaShape kKimi48B{32, 512, 128, 64, 128};
constexpr MlaShape kK3{96, 512, 128, 64, 128};  // 3 head groups of 32
constexpr MlaShape kOdd{40, 96, 24, 0, 40};     // head groups 32 + 8, no rope part

std::string shape_name(const MlaShape& s) {
  std::ostringstream os;
  os << "H=" << s.heads << " kv_lora=" << s.kv_lora << " nope=" << s.nope << " rope=" << s.rope << " v=" << s.v_head;
  return os.str();
}

bool is_poison(__nv_bfloat16 x) {
  return __nv_bfloat16_raw(x).x == __nv_bfloat16_raw(bf16_nan()).x;
}

// Element-wise |actual - expected| <= atol + rtol |expected| (see the file comment); logs the first failures and
// the max error with its index (`where` names it).
template <class Where>
void compare_outputs(const std::string& name, const std::vector<float>& actual, const std::vector<float>& expected,
                     size_t n, bool fp32, Where where) {
  const float atol = fp32 ? 5e-3f : 2e-2f, rtol = fp32 ? 5e-3f : 1e-2f;
  const auto [max_err, max_at, failures] =
      scan_errors(actual, expected, n, atol, rtol, [&](size_t i, double err, size_t earlier) {
        if (earlier < 5) {
          ADD_FAILURE() << name << ": mismatch at " << where(i) << ": expected " << expected[i] << " got " << actual[i]
                        << " (abs err " << err << ")";
        }
      });
  if (n > 0) {
    const double rel = relative_error(actual.data(), expected.data(), n);
    std::printf(
        "  [%s] max abs err %.3g at %s (expected %.6g got %.6g); relative L2 %.3g; %zu of %zu outside "
        "tolerance\n",
        name.c_str(), max_err, where(max_at).c_str(), expected[max_at], actual[max_at], rel, failures, n);
  }
  EXPECT_EQ(failures, 0u) << name << ": max abs err " << max_err;
}

struct Batch {
  std::vector<int> q_lens;
  std::vector<int> contexts;
  int page_size = 64;
  int max_context = 0;              // 0: the largest context (at least 1)
  bool write_kernel = false;        // rows produced by mla_write_rows from fp32 kv (read back for the CPU side)
  int naive_block_rows = 0;         // > 0: the naive form's workspace holds blocks of this many rows (several blocks)
  bool decode_only = false;         // mla_decode modes only (no mla_prefill)
  bool absorbed_reference = false;  // cpu::mla_attention_absorbed (about 100x fewer FLOPs at Kimi dims) as reference
};

std::string batch_name(const Batch& b) {
  std::ostringstream os;
  os << "page_size=" << b.page_size << " max_context=" << b.max_context << " naive_block_rows=" << b.naive_block_rows
     << " (q_len, context):";
  for (size_t n = 0; n < b.q_lens.size(); ++n) os << " (" << b.q_lens[n] << ", " << b.contexts[n] << ")";
  return os.str();
}

// Builds a shuffled, poisoned page pool holding each sequence's rows, runs the GPU launchers (mla_decode when every
// q_len <= 1, and mla_prefill; each on tensor cores and in fp32; mla_prefill in the naive form and in kAuto) and
// compares every output against cpu::mla_attention_naive on the same bf16 values.
// The naive form's two flash kernels run the same per-row operations in the same order: outputs bitwise equal
// (a zero's sign aside: a row wholly masked in a key tile that only one kernel runs adds P·V products of 0).
// Reports the first few differing elements (token, head, col, both values) and the count.
void expect_bitwise_equal_v1_v2(const std::vector<float>& v1, const std::vector<float>& v2, size_t out_size, int H,
                                int v_head, const std::vector<int32_t>& cu_q) {
  ASSERT_GE(v1.size(), out_size);
  ASSERT_GE(v2.size(), out_size) << "no v2 output recorded";
  size_t differing = 0;
  for (size_t i = 0; i < out_size; ++i) {
    uint32_t a = 0, b = 0;
    std::memcpy(&a, &v1[i], sizeof(a));
    std::memcpy(&b, &v2[i], sizeof(b));
    if (a == b || v1[i] == v2[i]) continue;  // bit-identical, or +0 vs -0
    if (differing++ < 5) {
      const int64_t t = static_cast<int64_t>(i / (static_cast<size_t>(H) * v_head));
      size_t n = 0;
      while (n + 1 < cu_q.size() && cu_q[n + 1] <= t) ++n;
      ADD_FAILURE() << "naive v1 vs v2 flash kernel differ at token " << t << " (seq " << n << ", query " << t - cu_q[n]
                    << ") head " << i / v_head % H << " col " << i % v_head << ": v1 " << v1[i] << " v2 " << v2[i];
    }
  }
  EXPECT_EQ(differing, 0u) << "elements where the v1 and v2 naive flash kernels differ (of " << out_size << ")";
}

void check_attention(const MlaShape& shape, const Batch& batch, uint32_t seed) {
  SCOPED_TRACE(shape_name(shape) + " " + batch_name(batch));
  std::mt19937 rng(seed);
  const int H = shape.heads, kv = shape.kv_lora, nope = shape.nope, rope = shape.rope, v_head = shape.v_head;
  const int width = kv + rope, q_width = nope + rope, ps = batch.page_size;
  const int N = static_cast<int>(batch.q_lens.size());
  const int64_t row_stride = (width + 7) / 8 * 8 + 8;
  const int num_layers = 2, layer = 1;
  int max_context = batch.max_context;
  int total_pages = 5;  // spare pages stay NaN
  std::vector<int32_t> cu_q(N + 1, 0);
  for (int n = 0; n < N; ++n) {
    ASSERT_LE(batch.q_lens[n], batch.contexts[n]);
    cu_q[n + 1] = cu_q[n] + batch.q_lens[n];
    total_pages += (batch.contexts[n] + ps - 1) / ps;
    if (batch.max_context == 0) max_context = std::max(max_context, batch.contexts[n]);
  }
  max_context = std::max(max_context, 1);
  const int64_t T = cu_q[N];
  int max_pages = (max_context + ps - 1) / ps + 1;
  for (int n = 0; n < N; ++n) max_pages = std::max(max_pages, (batch.contexts[n] + ps - 1) / ps + 1);

  // Pages: shuffled ids; table entries past a sequence's pages hold garbage ids (never read).
  PagedMlaCache cache =
      paged_mla_cache(rng, batch.contexts, width, row_stride, num_layers, layer, ps, total_pages, max_pages, 7);
  std::vector<int32_t>& table = cache.table;
  std::vector<__nv_bfloat16>& pool = cache.pool;
  std::vector<std::vector<float>>& caches = cache.caches;  // contiguous [context, width] per sequence (CPU side)
  const size_t pool_size = pool.size();
  if (batch.write_kernel) {
    // The same positions written by mla_write_rows from fp32 kv rows (latent RMS-normed), in one call for all
    // sequences; the CPU reference then reads the rows back from the pool.
    std::vector<float> kv_rows;
    std::vector<int64_t> slots;
    for (int n = 0; n < N; ++n) {
      for (int j = 0; j < batch.contexts[n]; ++j) {
        const int64_t page = table[static_cast<size_t>(n) * max_pages + j / ps];
        slots.push_back(page * ps + j % ps);
        for (int c = 0; c < width + 3; ++c) kv_rows.push_back(c < width ? 3.0f * caches[n][j * width + c] : NAN);
      }
    }
    const std::vector<float> weight = normal_vector(rng, kv, 1.0f, 0.2f);
    std::vector<__nv_bfloat16> poisoned(pool_size, bf16_nan());
    DeviceBuffer<__nv_bfloat16> pool_w(pool_size);
    DeviceBuffer<float> kv_w(std::max<size_t>(kv_rows.size(), 1)), weight_w(weight.size());
    DeviceBuffer<int64_t> slots_w(std::max<size_t>(slots.size(), 1));
    pool_w.upload(poisoned);
    kv_w.upload(kv_rows);
    weight_w.upload(weight);
    slots_w.upload(slots);
    MlaWriteParams w;
    w.pool = MlaPagePool{pool_w.get(), total_pages, num_layers, ps, row_stride, width};
    w.layer = layer;
    w.num_tokens = static_cast<int64_t>(slots.size());
    w.kv = kv_w.get();
    w.kv_stride = width + 3;
    w.norm_weight = weight_w.get();
    w.kv_lora_rank = kv;
    w.qk_rope = rope;
    w.slot_mapping = slots_w.get();
    const Status written = mla_write_rows(w, nullptr);
    ASSERT_TRUE(written.is_ok()) << written.to_string();
    DS_CUDA_OK(cudaDeviceSynchronize());
    pool = pool_w.download();
    for (int n = 0; n < N; ++n) {
      for (int j = 0; j < batch.contexts[n]; ++j) {
        const size_t base = cache.row(n, j);
        for (int c = 0; c < width; ++c) {
          caches[n][static_cast<size_t>(j) * width + c] = __bfloat162float(pool[base + c]);
          ASSERT_TRUE(std::isfinite(caches[n][static_cast<size_t>(j) * width + c])) << "row not written";
        }
      }
    }
  }
  // q with a NaN-padded row stride; kv_b.
  const int64_t q_stride = static_cast<int64_t>(H) * q_width + 8;
  const std::vector<float> q = rounded_normal(rng, static_cast<size_t>(T) * H * q_width, 0.0f, 1.0f);
  const std::vector<__nv_bfloat16> q_host = padded_q(q, T, H * q_width, q_stride);
  const std::vector<float> kv_b =
      rounded_normal(rng, static_cast<size_t>(H) * (nope + v_head) * kv, 0.0f, 1.0f / std::sqrt(float(kv)));
  const float scale = 1.0f / std::sqrt(static_cast<float>(q_width));

  // CPU reference.
  const cpu::MlaDims dims{H, kv, nope, rope, v_head, scale};
  const std::vector<float> expected =
      mla_reference(dims, q, cu_q, batch.q_lens, batch.contexts, caches, width, kv_b, batch.absorbed_reference);

  // GPU.
  const size_t out_size = static_cast<size_t>(T) * H * v_head, out_pad = 64;
  DeviceBuffer<__nv_bfloat16> pool_d(pool_size), q_d(q_host.size()), kv_b_d(kv_b.size());
  DeviceBuffer<int32_t> cu_q_d(N + 1), ctx_d(std::max(N, 1)), table_d(table.size());
  DeviceBuffer<float> out_d(out_size + out_pad);
  DeviceBuffer<__nv_bfloat16> out_bf16_d(out_size + out_pad);
  pool_d.upload(pool);
  q_d.upload(q_host);
  kv_b_d.upload(to_bf16(kv_b));
  cu_q_d.upload(cu_q);
  ctx_d.upload(std::vector<int32_t>(batch.contexts.begin(), batch.contexts.end()));
  table_d.upload(table);
  const size_t ws_bytes = mla_attention_workspace_bytes(H, kv, rope, T, max_context);
  DeviceBuffer<char> ws_d(ws_bytes);
  if (T > 0) {
    ASSERT_NE(ws_d.get(), nullptr) << "workspace of " << ws_bytes << " bytes";
  }

  const MlaSeqTables seqs{N, T, cu_q_d.get(), ctx_d.get(), table_d.get(), max_pages, max_context};
  MlaAttentionParams p = mla_params(shape, MlaPagePool{pool_d.get(), total_pages, num_layers, ps, row_stride, width},
                                    layer, seqs, q_d.get(), q_stride, kv_b_d.get(), out_d.get(), ws_d.get(), ws_bytes);
  // The naive form's inputs: host copies of the tables, a cuBLAS handle, its own workspace (one block covering
  // the longest context, or blocks of batch.naive_block_rows rows).
  std::vector<int32_t> contexts_host(batch.contexts.begin(), batch.contexts.end());
  contexts_host.push_back(0);  // keeps data() valid for N = 0
  const int longest = std::max(1, *std::max_element(contexts_host.begin(), contexts_host.end()));
  const int naive_rows = batch.naive_block_rows > 0 ? batch.naive_block_rows : longest;
  const size_t naive_ws_bytes = mla_prefill_workspace_bytes(H, kv, nope, rope, v_head, T, naive_rows);
  DeviceBuffer<char> naive_ws_d(naive_ws_bytes);
  CublasHandle cublas;
  ASSERT_EQ(cublasCreate(&cublas.handle), CUBLAS_STATUS_SUCCESS);
  const bool decode_shaped = std::all_of(batch.q_lens.begin(), batch.q_lens.end(), [](int l) { return l <= 1; });
  std::vector<float> decode_out;     // mla_decode v1 on tensor cores, launched directly (mode 0)
  std::vector<float> decode_v2_out;  // the same on the v2 kernels (mode 9): the graph replay must match it bitwise
  std::vector<float> legacy_out;     // mode 6
  std::vector<float> decode_v3_out;  // mode 13: mla_decode on the v3 attention (warpgroup MMA where it applies)
  std::vector<float> naive_v2_out;   // mode 4's output: mode 8 (the v1 flash kernel) must match it bitwise
  for (int mode = 0; mode < 15; ++mode) {
    // 0, 1: mla_decode tensor-core (v1 kernels) / fp32; 2, 3: mla_prefill absorbed tensor-core / fp32; 4:
    // mla_prefill naive (forced, own workspace); 5: mla_prefill kAuto with the host tables and the absorbed-sized
    // workspace; 6, 7: mla_decode / mla_prefill absorbed on the legacy tensor-core kernel (legacy_tc_attention, the
    // bypass of the default one); 8: mla_prefill naive forced on the v1 flash kernel (mode 4 runs v2 explicitly);
    // 9: mla_decode on the v2 kernels (within 2e-4 + 1e-3 |v1| of mode 0: only the W_UV product's summation order
    // differs); 10, 11, 12: mla_decode v2 / v1 / legacy with the bf16 output (out null), bitwise the bf16 rounding
    // of modes 9 / 0 / 6; 13, 14: mla_decode v3 (the split attention on warpgroup MMA at Kimi dims, v2's elsewhere)
    // with the fp32 and the bf16 output (14 bitwise the rounding of 13).
    const bool bf16_out = (mode >= 10 && mode <= 12) || mode == 14;
    const bool decode = mode < 2 || mode == 6 || mode >= 9, fp32 = mode < 4 && (mode % 2) == 1;
    const bool host_tables = mode == 4 || mode == 5 || mode == 8;
    const bool naive_forced = mode == 4 || mode == 8;
    if (decode && !decode_shaped) continue;
    if (!decode && batch.decode_only) continue;
    const char* names[] = {"mla_decode tensor-core v1",
                           "mla_decode fp32",
                           "mla_prefill tensor-core",
                           "mla_prefill fp32",
                           "mla_prefill naive",
                           "mla_prefill auto",
                           "mla_decode tensor-core legacy",
                           "mla_prefill tensor-core legacy",
                           "mla_prefill naive v1",
                           "mla_decode tensor-core v2",
                           "mla_decode tensor-core v2 bf16 out",
                           "mla_decode tensor-core v1 bf16 out",
                           "mla_decode tensor-core legacy bf16 out",
                           "mla_decode tensor-core v3",
                           "mla_decode tensor-core v3 bf16 out"};
    const std::string name = names[mode];
    SCOPED_TRACE(name);
    out_d.upload(std::vector<float>(out_size + out_pad, NAN));
    out_bf16_d.upload(std::vector<__nv_bfloat16>(out_size + out_pad, bf16_nan()));
    p.out = bf16_out ? nullptr : out_d.get();
    p.out_bf16 = bf16_out ? out_bf16_d.get() : nullptr;
    p.decode_kernel = mode == 0 || mode == 11   ? MlaDecodeKernel::kV1
                      : mode == 9 || mode == 10 ? MlaDecodeKernel::kV2
                      : mode >= 13              ? MlaDecodeKernel::kV3
                                                : MlaDecodeKernel::kDefault;
    p.fp32_attention = fp32;
    p.legacy_tc_attention = mode == 6 || mode == 7 || mode == 12;
    p.prefill_form =
        !host_tables ? MlaPrefillForm::kAbsorbed : (naive_forced ? MlaPrefillForm::kNaive : MlaPrefillForm::kAuto);
    p.naive_kernel = mode == 4 ? MlaNaiveKernel::kV2 : mode == 8 ? MlaNaiveKernel::kV1 : MlaNaiveKernel::kDefault;
    p.host_cu_q = host_tables ? cu_q.data() : nullptr;
    p.host_context_lens = host_tables ? contexts_host.data() : nullptr;
    p.cublas = host_tables ? cublas.handle : nullptr;
    p.workspace = naive_forced ? static_cast<void*>(naive_ws_d.get()) : static_cast<void*>(ws_d.get());
    p.workspace_bytes = naive_forced ? naive_ws_bytes : ws_bytes;
    const Status status = decode ? mla_decode(p, nullptr) : mla_prefill(p, nullptr);
    ASSERT_TRUE(status.is_ok()) << status.to_string();
    DS_CUDA_OK(cudaDeviceSynchronize());
    DS_CUDA_OK(cudaGetLastError());
    std::vector<float> out = out_d.download();
    if (bf16_out) {
      for (size_t i = 0; i < out.size(); ++i) {
        ASSERT_TRUE(std::isnan(out[i])) << "fp32 out written at " << i << " while out_bf16 is set";
      }
      const std::vector<__nv_bfloat16> out_bf16 = out_bf16_d.download();
      const std::vector<float>& fp32_run = mode == 10   ? decode_v2_out
                                           : mode == 11 ? decode_out
                                           : mode == 14 ? decode_v3_out
                                                        : legacy_out;
      ASSERT_GE(fp32_run.size(), out_size);
      size_t differing = 0;
      for (size_t i = 0; i < out.size(); ++i) {
        out[i] = __bfloat162float(out_bf16[i]);
        if (i >= out_size) continue;
        const uint16_t want = __nv_bfloat16_raw(__float2bfloat16(fp32_run[i])).x,
                       got = __nv_bfloat16_raw(out_bf16[i]).x;
        if (want != got && differing++ < 5) {
          ADD_FAILURE() << "bf16 output " << i << ": " << got << " != bf16 of the fp32 run's " << fp32_run[i];
        }
      }
      EXPECT_EQ(differing, 0u) << "bf16 outputs that are not the rounding of the fp32 run's";
    }
    if (mode == 0) decode_out = out;
    if (mode == 4) naive_v2_out = out;
    if (mode == 6) legacy_out = out;
    if (mode == 13) {
      decode_v3_out = out;
      double max_diff = 0.0;
      for (size_t i = 0; i < out_size; ++i) {
        const double diff = std::fabs(static_cast<double>(out[i]) - decode_v2_out[i]);
        max_diff = std::isfinite(diff) ? std::max(max_diff, diff) : INFINITY;
      }
      std::printf("  [v3 vs v2] max abs diff %.3g\n", max_diff);  // the CPU reference below is the check
    }
    if (mode == 8) expect_bitwise_equal_v1_v2(out, naive_v2_out, out_size, H, v_head, cu_q);
    if (mode == 9) {
      decode_v2_out = out;
      size_t far = 0;
      double max_diff = 0.0;
      for (size_t i = 0; i < out_size; ++i) {
        const double diff = std::fabs(static_cast<double>(out[i]) - decode_out[i]);
        max_diff = std::isfinite(diff) ? std::max(max_diff, diff) : INFINITY;
        if (!(diff <= 2e-4 + 1e-3 * std::fabs(decode_out[i])) && far++ < 5) {
          ADD_FAILURE() << "v2 vs v1 at " << i << ": " << out[i] << " vs " << decode_out[i];
        }
      }
      std::printf("  [v2 vs v1] max abs diff %.3g\n", max_diff);
      EXPECT_EQ(far, 0u) << "v2 outputs farther than 2e-4 + 1e-3 |v1| from v1's";
    }
    compare_outputs(name, out, expected, out_size, fp32, [&](size_t i) {
      const int64_t t = static_cast<int64_t>(i / (static_cast<size_t>(H) * v_head));
      const int h = static_cast<int>(i / v_head % H), c = static_cast<int>(i % v_head);
      int n = 0;
      while (cu_q[n + 1] <= t) ++n;
      std::ostringstream os;
      os << "token " << t << " (seq " << n << ", query " << t - cu_q[n] << " at position "
         << batch.contexts[n] - batch.q_lens[n] + (t - cu_q[n]) << ") head " << h << " col " << c;
      return os.str();
    });
    std::printf("  [%s] T=%lld splits=%d heads per CTA=%d workspace=%zu bytes\n", name.c_str(),
                static_cast<long long>(T), mla_num_splits(T, max_context), mla_decode_head_group(T, H, max_context),
                static_cast<size_t>(p.workspace_bytes));
    for (size_t i = out_size; i < out_size + out_pad; ++i) {
      ASSERT_TRUE(std::isnan(out[i])) << "output padding written at " << i - out_size << " past the end";
    }
  }
  // mla_decode (v2 kernels) captured in a CUDA graph (global capture mode) and replayed: bit-identical to the direct
  // launch.
  if (decode_shaped && T > 0) {
    SCOPED_TRACE("mla_decode captured in a CUDA graph");
    cudaStream_t stream = nullptr;
    DS_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    out_d.upload(std::vector<float>(out_size + out_pad, NAN));
    p.out = out_d.get();
    p.out_bf16 = nullptr;
    p.decode_kernel = MlaDecodeKernel::kV2;
    p.fp32_attention = false;
    p.legacy_tc_attention = false;
    p.workspace = ws_d.get();
    p.workspace_bytes = ws_bytes;
    for (MlaDecodeKernel kernel : {MlaDecodeKernel::kV2, MlaDecodeKernel::kV3}) {
      const bool v3 = kernel == MlaDecodeKernel::kV3;
      SCOPED_TRACE(v3 ? "v3" : "v2");
      out_d.upload(std::vector<float>(out_size + out_pad, NAN));
      p.decode_kernel = kernel;
      ASSERT_NO_FATAL_FAILURE(
          replay_captured(stream, cudaStreamCaptureModeGlobal, 2, [&](cudaStream_t s) { return mla_decode(p, s); }));
      const std::vector<float> out = out_d.download();
      const std::vector<float>& direct = v3 ? decode_v3_out : decode_v2_out;
      for (size_t i = 0; i < out_size; ++i) {
        ASSERT_EQ(std::memcmp(&out[i], &direct[i], sizeof(float)), 0)
            << "graph replay differs at " << i << ": " << out[i] << " vs " << direct[i];
      }
    }
    cudaStreamDestroy(stream);
  }
}

std::vector<int> ones(size_t n) {
  return std::vector<int>(n, 1);
}

// ---- decode ----------------------------------------------------------------------------------------------------
TEST(MlaDecode, TinyContexts) {
  const Batch batch{ones(6), {1, 63, 64, 65, 1000, 4097}};
  check_attention(kTiny, batch, 1);
}

TEST(MlaDecode, Kimi48BContexts) {
  const Batch batch{ones(6), {1, 63, 64, 65, 1000, 4097}};
  check_attention(kKimi48B, batch, 2);
}

TEST(MlaDecode, PageSizes16And256) {
  for (int page_size : {16, 256}) {
    const Batch batch{ones(5), {1, 15, 17, 257, 700}, page_size};
    check_attention(kTiny, batch, 3);
    check_attention(kKimi48B, batch, 4);
  }
}

TEST(MlaDecode, K3AndOddHeadGroups) {
  check_attention(kK3, Batch{ones(3), {1, 64, 333}}, 5);
  check_attention(kOdd, Batch{ones(4), {2, 64, 129, 1500}}, 6);
}

TEST(MlaDecode, ForcedSplitsOnShortContexts) {
  // max_context far above the real lengths: many splits, most of them empty on the device.
  const Batch batch{ones(3), {1, 5, 70}, 64, 100000};
  ASSERT_GT(mla_num_splits(3, 100000), 1);
  check_attention(kTiny, batch, 7);
  check_attention(kKimi48B, batch, 8);
}

TEST(MlaDecode, ZeroLengthSequencesInBatch) {
  // q_len 0 with context 0 and with a context; one query token per other sequence.
  check_attention(kTiny, Batch{{1, 0, 1, 0, 1}, {10, 0, 33, 20, 1}}, 9);
  check_attention(kKimi48B, Batch{{0, 1, 0}, {0, 600, 5}}, 10);
}

TEST(MlaDecode, LargeBatchOneSplit) {
  std::vector<int> contexts(300);
  for (size_t n = 0; n < contexts.size(); ++n) contexts[n] = 1 + static_cast<int>(n * 7 % 200);
  check_attention(kTiny, Batch{ones(contexts.size()), contexts}, 11);
}

TEST(MlaDecode, Kimi48BBatchOf37SeveralSplitsPartialCombineBlock) {
  // 37 tokens: several splits whose slices start off page boundaries, and a last combine CTA of 5 tokens (the
  // default combine takes 32 tokens per CTA); page size 16 so a 32-row tile spans two pages (three off alignment).
  std::vector<int> contexts(37);
  for (size_t n = 0; n < contexts.size(); ++n) contexts[n] = 1 + static_cast<int>(n * 131 % 1500);
  ASSERT_GT(mla_num_splits(37, 1500), 1);
  check_attention(kKimi48B, Batch{ones(contexts.size()), contexts, 16}, 13);
}

// One or two query tokens: the default kernel's small head groups (8 heads per CTA at one token, 16 at two) and
// the combine's split-parallel merge; contexts around the 32-row tile and 64-row page edges and past several
// splits.
TEST(MlaDecode, Kimi48BSingleTokenEightHeadGroups) {
  for (int context : {1, 31, 32, 33, 63, 64, 65, 2049}) {
    ASSERT_EQ(mla_decode_head_group(1, kKimi48B.heads, context), 8);
    check_attention(kKimi48B, Batch{{1}, {context}}, 20 + context);
  }
}

TEST(MlaDecode, Kimi48BTwoTokensSixteenHeadGroups) {
  ASSERT_EQ(mla_decode_head_group(2, kKimi48B.heads, 4097), 16);
  ASSERT_EQ(mla_num_splits(2, 4097), 33);
  check_attention(kKimi48B, Batch{{1, 1}, {4097, 65}}, 21);
  // Page size 16 (every tile spans two pages) and one zero-length sequence beside the two tokens.
  check_attention(kKimi48B, Batch{{1, 0, 1}, {700, 9, 1}, 16}, 22);
}

TEST(MlaDecode, SingleTokenUnderLargeContextBound) {
  // A graph captured for contexts up to 32768 running a 65-row and a 1-row context: 64 splits, nearly all empty
  // (check_attention captures and replays every decode case).
  ASSERT_EQ(mla_num_splits(1, 32768), 64);
  ASSERT_EQ(mla_decode_head_group(1, kKimi48B.heads, 32768), 16);
  check_attention(kKimi48B, Batch{{1}, {65}, 64, 32768}, 23);
  check_attention(kKimi48B, Batch{{1}, {1}, 64, 4096}, 24);
}

TEST(MlaDecode, SmallHeadGroupsOfK3AndOddShapes) {
  // K3 (96 heads): 6 groups of 16 at one token; 40 heads with 96-wide latent, no rope: groups 8 x 5; tiny: 2 heads.
  ASSERT_EQ(mla_decode_head_group(1, kK3.heads, 4096), 16);
  check_attention(kK3, Batch{{1}, {333}, 64, 4096}, 25);
  ASSERT_EQ(mla_decode_head_group(1, kOdd.heads, 1500), 8);
  check_attention(kOdd, Batch{{1}, {1500}}, 26);
  check_attention(kTiny, Batch{{1}, {4097}}, 27);
  check_attention(kTiny, Batch{{1, 1, 1}, {65, 1, 640}, 16}, 28);
}

// The v2 kernels next to v1, the bf16 output and the CPU reference at the batches they target: 1, 3, 8 and 16 (the
// split-K cluster combine, up to kMlaSplitKCombineMaxTokens), 17 and 64 (the 32-token combine), contexts 1, 17,
// 512 and 4096 (check_attention runs every decode mode: v1, v2, bf16 outputs, legacy, graph replay). Decode modes
// only, against cpu::mla_attention_absorbed: the naive reference would spend minutes at these sizes.
Batch decode_batch(std::vector<int> contexts, int page_size = 64) {
  Batch b{ones(contexts.size()), std::move(contexts), page_size};
  b.decode_only = true;
  b.absorbed_reference = true;
  return b;
}

TEST(MlaDecode, Kimi48BV2BatchesAndContexts) {
  ASSERT_EQ(kMlaSplitKCombineMaxTokens, 16);
  for (int batch : {1, 3, 8}) {
    for (int context : {1, 17, 512, 4096}) {
      check_attention(kKimi48B, decode_batch(std::vector<int>(batch, context)), 200 + 7 * batch + context % 13);
    }
  }
  // 16 and 17 tokens (the last split-K batch and the first past it), 64 tokens; the four contexts in turn (bound
  // 4096), page size 16 for one of them (tiles over two pages).
  for (int batch : {16, 17, 64}) {
    std::vector<int> contexts(batch);
    for (int n = 0; n < batch; ++n) contexts[n] = std::vector<int>{1, 17, 512, 4096}[n % 4];
    check_attention(kKimi48B, decode_batch(contexts, batch == 17 ? 16 : 64), 300 + batch);
  }
  check_attention(kKimi48B, decode_batch(std::vector<int>(64, 512)), 364);
}

TEST(MlaDecode, LongContextsOverManySplits) {
  // Every split in use: one token over 20000 rows (64 splits of 320 rows, the last one empty), two tokens over 20000
  // and 9000 (64 splits each).
  ASSERT_EQ(mla_num_splits(1, 20000), 64);
  ASSERT_EQ(mla_num_splits(2, 20000), 64);
  check_attention(kKimi48B, decode_batch({20000}), 29);
  check_attention(kKimi48B, decode_batch({20000, 9000}), 30);
}

TEST(MlaDecode, V2SplitKOddShapes) {
  // Slices of the split-K combine: kv_lora 96 -> 2 CTAs a cluster (the second one half empty), v_head 40 -> 3 W_UV
  // blocks; kv_lora 32 -> clusters of 1; K3's 96 heads; 8 tokens over several splits each.
  check_attention(kOdd, decode_batch({1, 17, 512, 4096, 3, 700, 64, 65}), 400);
  check_attention(kTiny, decode_batch({1, 17, 512, 4096, 3}), 401);
  check_attention(kK3, decode_batch({4096, 17, 1}), 402);
}

// ---- prefill ---------------------------------------------------------------------------------------------------
TEST(MlaPrefill, TinyChunksOverHistory) {
  for (int history : {0, 5, 64, 300}) {
    Batch batch;
    for (int q_len : {1, 17, 64, 200}) {
      batch.q_lens.push_back(q_len);
      batch.contexts.push_back(history + q_len);
    }
    check_attention(kTiny, batch, 20 + history);
  }
}

TEST(MlaPrefill, Kimi48BChunksOverHistory) {
  check_attention(kKimi48B, Batch{{1, 17, 64, 200}, {1, 17, 64, 200}}, 30);
  check_attention(kKimi48B, Batch{{17, 200}, {22, 500}}, 31);
  check_attention(kKimi48B, Batch{{1, 64}, {65, 128}}, 32);
}

TEST(MlaPrefill, MixedBatchWithZeroLengthSequence) {
  check_attention(kTiny, Batch{{3, 0, 1, 50, 0}, {10, 7, 1, 50, 0}}, 40);
  check_attention(kKimi48B, Batch{{3, 0, 1, 50}, {10, 7, 1000, 50}}, 41);
  check_attention(kOdd, Batch{{5, 0, 33}, {5, 3, 100}, 16}, 42);
}

TEST(MlaPrefill, SplitsOnFewTokensWithLongHistory) {
  // Few query tokens over a long history: more than one split per token.
  const Batch batch{{2, 3}, {3000, 4500}};
  ASSERT_GT(mla_num_splits(5, 4500), 1);
  check_attention(kKimi48B, batch, 50);
  check_attention(kTiny, Batch{{4}, {9}, 64, 50000}, 51);
}

TEST(MlaPrefill, ReadsRowsWrittenByWriteRows) {
  Batch batch{{7, 21, 1}, {40, 21, 17}, 16};
  batch.write_kernel = true;
  check_attention(kTiny, batch, 61);
  check_attention(kKimi48B, batch, 62);
}

TEST(MlaPrefill, NoTokensIsANoOp) {
  check_attention(kTiny, Batch{{0, 0}, {0, 12}}, 60);
}

// Chunks of 1, 17, 64, 200 and 1000 query tokens over a history, one sequence each in one batch (every form).
Batch chunks_over_history(int history) {
  Batch batch;
  for (int q_len : {1, 17, 64, 200, 1000}) {
    batch.q_lens.push_back(q_len);
    batch.contexts.push_back(history + q_len);
  }
  return batch;
}

TEST(MlaPrefillNaive, Kimi48BChunksOverShortHistories) {
  for (int history : {0, 5, 64, 300}) check_attention(kKimi48B, chunks_over_history(history), 80 + history);
}

TEST(MlaPrefillNaive, Kimi48BChunksOverHistory4097) {
  check_attention(kKimi48B, chunks_over_history(4097), 85);
}

TEST(MlaPrefillNaive, TinyAndOddDims) {
  for (int history : {0, 5, 64, 300}) check_attention(kTiny, chunks_over_history(history), 90 + history);
  check_attention(kOdd, Batch{{40, 0, 100}, {40, 3, 700}, 16}, 95);
  check_attention(kK3, Batch{{70, 33}, {70, 400}}, 96);
}

TEST(MlaPrefillNaive, ContextInSeveralKeyBlocks) {
  // Workspace for blocks of 64 / 128 / 192 rows: the softmax state is carried across blocks, and query tiles whose
  // positions precede a block pass through it unchanged.
  for (int rows : {64, 128, 192}) {
    Batch batch{{200, 1, 64, 0, 37}, {300, 129, 1000, 50, 37}};
    batch.naive_block_rows = rows;
    check_attention(kKimi48B, batch, 100 + rows);
    check_attention(kTiny, batch, 101 + rows);
  }
  Batch pages16{{300}, {4097}, 16};
  pages16.naive_block_rows = 1024;
  check_attention(kKimi48B, pages16, 104);
}

// The v2 flash kernel's edges (every check_attention call runs v1 and v2 forced and requires them bitwise equal):
// chunks around its 128-query tile (127, 128, 129, 255, 257: idle warps in a partial last tile), histories off and
// on the 64-key tile (the causal diagonal where warps skip key tiles past their rows), several key blocks (tiles
// whose warps are all idle in a block), and a sequence whose history starts mid-tile.
TEST(MlaPrefillNaive, V2QueryTileEdges) {
  check_attention(kKimi48B, Batch{{127, 128, 129, 255, 257}, {127, 191, 129 + 64, 255 + 1, 257 + 700}}, 120);
  for (int rows : {64, 192}) {
    Batch batch{{129, 300, 16}, {129 + 65, 300 + 333, 1000}};
    batch.naive_block_rows = rows;
    check_attention(kKimi48B, batch, 121 + rows);
    check_attention(kTiny, batch, 122 + rows);
  }
  check_attention(kK3, Batch{{250}, {250 + 130}}, 123);
}

TEST(MlaPrefillNaive, MixedBatchesAndZeroLengthSequences) {
  check_attention(kKimi48B, Batch{{0, 40, 0, 1, 300}, {0, 40, 9, 600, 2000}, 256}, 110);
  check_attention(kTiny, Batch{{0, 0, 65, 0}, {0, 5, 65, 64}}, 111);
  // Every sequence with enough query tokens: kAuto's estimate favours the naive form.
  check_attention(kKimi48B, Batch{{32, 100}, {32, 4000}}, 112);
}

// An 8192-token chunk over 24576 rows of history (a 32k prompt's last chunk) at Kimi-48B dims: the naive form
// (timed on both flash kernels, v1 and v2, which must agree bitwise; v2 compared with absorbed) against the
// absorbed tensor-core form (no CPU reference at this size; both round to bf16, so the tolerance is
// the tensor-core one on each side: |naive - absorbed| <= 4e-2 + 2e-2 |absorbed|), and the time of each form
// (printed with its FLOP rate; naive FLOPs = 2 H (nope + rope + v) per visible pair + the decompression GEMM).
TEST(MlaPrefillNaive, Kimi48BLongChunkMatchesAbsorbedAndTimes) {
  const MlaShape shape = kKimi48B;
  const int H = shape.heads, kv = shape.kv_lora, nope = shape.nope, rope = shape.rope, v_head = shape.v_head;
  const int q_width = nope + rope, ps = 64;
  const int64_t T = 8192, context = 32768;
  // Cheap deterministic values in [-1.7, 1.7) (variance about 1), bf16.
  const MlaLongChunk chunk(shape, T, context, ps, 0x9e3779b97f4a7c15ull);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  const std::vector<int32_t>& cu_q = chunk.cu_q;
  DeviceBuffer<float> out_absorbed(static_cast<size_t>(T) * H * v_head), out_naive(static_cast<size_t>(T) * H * v_head),
      out_naive_v1(static_cast<size_t>(T) * H * v_head);
  const size_t ws_bytes =
      std::max(mla_attention_workspace_bytes(H, kv, rope, T, static_cast<int>(context)),
               mla_prefill_workspace_bytes(H, kv, nope, rope, v_head, T, static_cast<int>(context)));
  DeviceBuffer<char> ws_d(ws_bytes);
  ASSERT_NE(ws_d.get(), nullptr) << "workspace of " << ws_bytes << " bytes";
  CublasHandle cublas;
  ASSERT_EQ(cublasCreate(&cublas.handle), CUBLAS_STATUS_SUCCESS);

  MlaAttentionParams p = chunk.params(shape, ws_d.get(), ws_bytes);
  p.host_cu_q = chunk.cu_q.data();
  p.host_context_lens = chunk.contexts.data();
  p.cublas = cublas.handle;

  const double pairs = static_cast<double>(T) * (context - T) + static_cast<double>(T) * (T + 1) / 2;
  const double naive_flops = pairs * 2.0 * H * (q_width + v_head) + 2.0 * context * kv * H * (nope + v_head);
  // 0: absorbed; 1: naive on the v1 flash kernel; 2: naive on the v2 flash kernel.
  for (int run = 0; run < 3; ++run) {
    const bool naive = run > 0;
    p.prefill_form = naive ? MlaPrefillForm::kNaive : MlaPrefillForm::kAbsorbed;
    p.naive_kernel = run == 1 ? MlaNaiveKernel::kV1 : MlaNaiveKernel::kV2;
    p.out = run == 0 ? out_absorbed.get() : run == 1 ? out_naive_v1.get() : out_naive.get();
    float best_ms = INFINITY;
    for (int rep = 0; rep < 3; ++rep) {
      float ms = 0.0f;
      ASSERT_NO_FATAL_FAILURE(time_eager_calls(
          nullptr, 1, [&](cudaStream_t s) { return mla_prefill(p, s); }, &ms));
      best_ms = std::min(best_ms, ms);
    }
    std::printf("  [%s] T=%lld context=%lld: %.3f ms, %.1f TFLOP/s at the naive form's FLOP count (%.3g FLOPs)\n",
                run == 0   ? "absorbed"
                : run == 1 ? "naive v1"
                           : "naive v2",
                static_cast<long long>(T), static_cast<long long>(context), best_ms,
                naive_flops / (best_ms * 1e-3) / 1e12, naive_flops);
  }
  const std::vector<float> a = out_absorbed.download(), b = out_naive.download();
  const auto [max_err, max_at, failures] =
      scan_errors(b, a, a.size(), 4e-2, 2e-2, [&](size_t i, double, size_t earlier) {
        if (earlier < 5) {
          const size_t t = i / (static_cast<size_t>(H) * v_head);
          ADD_FAILURE() << "token " << t << " (position " << context - T + static_cast<int64_t>(t) << ") head "
                        << i / v_head % H << " col " << i % v_head << ": absorbed " << a[i] << " naive " << b[i];
        }
      });
  std::printf("  naive vs absorbed: max abs err %.3g at %zu (%.6g vs %.6g), relative L2 %.3g\n", max_err, max_at,
              b[max_at], a[max_at], relative_error(b.data(), a.data(), a.size()));
  EXPECT_EQ(failures, 0u);
  expect_bitwise_equal_v1_v2(out_naive_v1.download(), b, b.size(), H, v_head, cu_q);
}

// ---- page writes -----------------------------------------------------------------------------------------------
void check_write_rows(const MlaShape& shape, uint32_t seed) {
  SCOPED_TRACE("mla_write_rows " + shape_name(shape));
  std::mt19937 rng(seed);
  const int kv = shape.kv_lora, rope = shape.rope, width = kv + rope;
  const int num_pages = 4, num_layers = 3, layer = 1, ps = 16;
  const int64_t row_stride = (width + 7) / 8 * 8 + 8;
  const int64_t T = 37, kv_stride = width + 5, capacity = static_cast<int64_t>(num_pages) * ps;
  std::vector<float> kv_in = normal_vector(rng, static_cast<size_t>(T * kv_stride), 0.0f, 2.0f);
  std::vector<float> weight = normal_vector(rng, kv, 1.0f, 0.2f);
  std::vector<int64_t> all_slots(capacity);
  std::iota(all_slots.begin(), all_slots.end(), 0);
  std::shuffle(all_slots.begin(), all_slots.end(), rng);
  std::vector<int64_t> slots(T);
  for (int64_t t = 0; t < T; ++t) slots[t] = (t % 5 == 2) ? -1 : (t % 11 == 7 ? capacity + 3 : all_slots[t]);
  const float eps = 1e-5f;
  const size_t pool_size = static_cast<size_t>(num_pages) * num_layers * ps * row_stride;
  DeviceBuffer<__nv_bfloat16> pool_d(pool_size);
  DeviceBuffer<float> kv_d(kv_in.size()), w_d(weight.size());
  DeviceBuffer<int64_t> slots_d(slots.size());
  pool_d.upload(std::vector<__nv_bfloat16>(pool_size, bf16_nan()));
  kv_d.upload(kv_in);
  w_d.upload(weight);
  slots_d.upload(slots);
  MlaWriteParams p;
  p.pool = MlaPagePool{pool_d.get(), num_pages, num_layers, ps, row_stride, width};
  p.layer = layer;
  p.num_tokens = T;
  p.kv = kv_d.get();
  p.kv_stride = kv_stride;
  p.norm_weight = w_d.get();
  p.eps = eps;
  p.kv_lora_rank = kv;
  p.qk_rope = rope;
  p.slot_mapping = slots_d.get();
  // v1 (plain launch) and v2 (PDL, weights before the wait): the same arithmetic, so bitwise equal pools.
  std::vector<__nv_bfloat16> pool;
  for (MlaDecodeKernel kernel : {MlaDecodeKernel::kV1, MlaDecodeKernel::kV2}) {
    SCOPED_TRACE(kernel == MlaDecodeKernel::kV1 ? "v1" : "v2");
    pool_d.upload(std::vector<__nv_bfloat16>(pool_size, bf16_nan()));
    p.decode_kernel = kernel;
    const Status status = mla_write_rows(p, nullptr);
    ASSERT_TRUE(status.is_ok()) << status.to_string();
    DS_CUDA_OK(cudaDeviceSynchronize());
    if (kernel == MlaDecodeKernel::kV1) {
      pool = pool_d.download();
      continue;
    }
    const std::vector<__nv_bfloat16> pool_v2 = pool_d.download();
    size_t differing = 0;
    for (size_t i = 0; i < pool_size; ++i) {
      const uint16_t a = __nv_bfloat16_raw(pool[i]).x, b = __nv_bfloat16_raw(pool_v2[i]).x;
      if (a != b && differing++ < 5) ADD_FAILURE() << "pool element " << i << ": v1 " << a << " v2 " << b;
    }
    EXPECT_EQ(differing, 0u) << "pool elements where the v1 and v2 write kernels differ";
  }

  std::vector<bool> written(pool_size, false);
  int mismatches = 0;
  double max_err = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= capacity) continue;
    std::vector<float> normed(kv);
    cpu::rms_norm(&kv_in[t * kv_stride], weight.data(), normed.data(), 1, kv, eps);
    const size_t base = static_cast<size_t>((((slot / ps) * num_layers + layer) * ps + slot % ps) * row_stride);
    for (int c = 0; c < width; ++c) {
      written[base + c] = true;
      const float got = __bfloat162float(pool[base + c]);
      const float want = c < kv ? normed[c] : kv_in[t * kv_stride + c];
      // One bf16 step (8 mantissa bits) for the normed part; the k_rot part is a plain rounding.
      const float tol = c < kv ? std::fabs(want) * (1.0f / 128.0f) + 1e-6f : 0.0f;
      const float err = std::isfinite(got) ? std::fabs(got - (c < kv ? want : bf16_round(want))) : INFINITY;
      max_err = std::max<double>(max_err, err);
      if (err > tol && mismatches++ < 5) {
        ADD_FAILURE() << "token " << t << " slot " << slot << " col " << c << ": expected " << want << " got " << got;
      }
    }
  }
  std::printf("  mla_write_rows max abs err %.3g\n", max_err);
  EXPECT_EQ(mismatches, 0);
  size_t stray = 0;
  for (size_t i = 0; i < pool_size; ++i) {
    if (!written[i] && !is_poison(pool[i]) && stray++ < 5) ADD_FAILURE() << "pool element " << i << " overwritten";
  }
  EXPECT_EQ(stray, 0u);
}

TEST(MlaWriteRows, MatchesRmsNormAndLayout) {
  check_write_rows(kTiny, 70);
  check_write_rows(kKimi48B, 71);
  check_write_rows(MlaShape{2, 1024, 16, 64, 16}, 72);  // kv_lora past v2's 512 register-held columns
}

// ---- validation (no GPU work: every call below must be rejected before launching) ------------------------------
template <class T>
T* fake_device(uintptr_t address = 4096) {
  return reinterpret_cast<T*>(address);
}

MlaAttentionParams valid_attention_params() {
  MlaAttentionParams p;
  p.num_heads = 32;
  p.kv_lora_rank = 512;
  p.qk_nope = 128;
  p.qk_rope = 64;
  p.v_head = 128;
  p.softmax_scale = 0.07f;
  p.pool = MlaPagePool{fake_device<__nv_bfloat16>(), 10, 2, 64, 576, 576};
  p.layer = 1;
  p.num_seqs = 2;
  p.num_tokens = 2;
  p.cu_q = fake_device<int32_t>();
  p.context_lens = fake_device<int32_t>();
  p.block_tables = fake_device<int32_t>();
  p.max_pages_per_seq = 4;
  p.max_context = 256;
  p.q = fake_device<__nv_bfloat16>();
  p.q_stride = 32 * 192;
  p.kv_b = fake_device<__nv_bfloat16>();
  p.out = fake_device<float>();
  p.workspace = fake_device<void>();
  p.workspace_bytes = mla_attention_workspace_bytes(32, 512, 64, 2, 256);
  return p;
}

TEST(MlaAttentionValidation, RejectsBadHostInputs) {
  struct Bad {
    const char* what;
    void (*edit)(MlaAttentionParams&);
  };
  const Bad cases[] = {
      {"num_heads 0", [](MlaAttentionParams& p) { p.num_heads = 0; }},
      {"num_heads 129", [](MlaAttentionParams& p) { p.num_heads = 129; }},
      {"kv_lora 20", [](MlaAttentionParams& p) { p.kv_lora_rank = 20; }},
      {"kv_lora 520", [](MlaAttentionParams& p) { p.kv_lora_rank = 520; }},
      {"rope 12", [](MlaAttentionParams& p) { p.qk_rope = 12; }},
      {"rope 72", [](MlaAttentionParams& p) { p.qk_rope = 72; }},
      {"nope 0", [](MlaAttentionParams& p) { p.qk_nope = 0; }},
      {"nope 193", [](MlaAttentionParams& p) { p.qk_nope = 193; }},
      {"v_head 257", [](MlaAttentionParams& p) { p.v_head = 257; }},
      {"scale nan", [](MlaAttentionParams& p) { p.softmax_scale = NAN; }},
      {"pages null", [](MlaAttentionParams& p) { p.pool.pages = nullptr; }},
      {"pages misaligned", [](MlaAttentionParams& p) { p.pool.pages = fake_device<__nv_bfloat16>(4098); }},
      {"num_pages 0", [](MlaAttentionParams& p) { p.pool.num_pages = 0; }},
      {"layer out of range", [](MlaAttentionParams& p) { p.layer = 2; }},
      {"page_size 24", [](MlaAttentionParams& p) { p.pool.page_size = 24; }},
      {"page_size 272", [](MlaAttentionParams& p) { p.pool.page_size = 272; }},
      {"row_stride < width", [](MlaAttentionParams& p) { p.pool.row_stride = 568; }},
      {"row_stride not multiple of 8", [](MlaAttentionParams& p) { p.pool.row_stride = 580; }},
      {"width mismatch", [](MlaAttentionParams& p) { p.pool.width = 512; }},
      {"num_tokens negative", [](MlaAttentionParams& p) { p.num_tokens = -1; }},
      {"tokens without sequences", [](MlaAttentionParams& p) { p.num_seqs = 0; }},
      {"max_pages 0", [](MlaAttentionParams& p) { p.max_pages_per_seq = 0; }},
      {"max_context above table", [](MlaAttentionParams& p) { p.max_context = 257; }},
      {"max_context 0 with tokens", [](MlaAttentionParams& p) { p.max_context = 0; }},
      {"q_stride small", [](MlaAttentionParams& p) { p.q_stride = 32 * 192 - 1; }},
      {"cu_q null", [](MlaAttentionParams& p) { p.cu_q = nullptr; }},
      {"q null", [](MlaAttentionParams& p) { p.q = nullptr; }},
      {"out null", [](MlaAttentionParams& p) { p.out = nullptr; }},
      {"workspace small", [](MlaAttentionParams& p) { p.workspace_bytes -= 1; }},
      {"workspace misaligned", [](MlaAttentionParams& p) { p.workspace = fake_device<void>(4100); }},
      {"kv_b misaligned", [](MlaAttentionParams& p) { p.kv_b = fake_device<__nv_bfloat16>(4104); }},
      {"decode_kernel 4", [](MlaAttentionParams& p) { p.decode_kernel = static_cast<MlaDecodeKernel>(4); }},
  };
  for (const Bad& bad : cases) {
    MlaAttentionParams p = valid_attention_params();
    bad.edit(p);
    const Status decode = mla_decode(p, nullptr);
    const Status prefill = mla_prefill(p, nullptr);
    EXPECT_EQ(decode.code(), StatusCode::kInvalidArgument) << bad.what << ": " << decode.to_string();
    EXPECT_EQ(prefill.code(), StatusCode::kInvalidArgument) << bad.what << ": " << prefill.to_string();
  }
  // out_bf16: enough for mla_decode (out may then be null; checked up to the workspace size here), rejected by
  // mla_prefill in every form.
  {
    MlaAttentionParams p = valid_attention_params();
    p.out_bf16 = fake_device<__nv_bfloat16>(8192);
    p.out = nullptr;
    p.workspace_bytes -= 1;  // stops mla_decode's validation before any launch
    const Status decode = mla_decode(p, nullptr);
    EXPECT_EQ(decode.code(), StatusCode::kInvalidArgument) << decode.to_string();
    EXPECT_NE(decode.to_string().find("workspace_bytes"), std::string::npos) << decode.to_string();
    for (MlaPrefillForm form : {MlaPrefillForm::kAuto, MlaPrefillForm::kAbsorbed, MlaPrefillForm::kNaive}) {
      p.prefill_form = form;
      const Status prefill = mla_prefill(p, nullptr);
      EXPECT_EQ(prefill.code(), StatusCode::kInvalidArgument) << prefill.to_string();
      EXPECT_NE(prefill.to_string().find("out_bf16"), std::string::npos) << prefill.to_string();
    }
  }
  // The naive form, forced: rejected (no launch) without its host tables or cuBLAS handle, with host tables that
  // do not match num_tokens or the block table, with head dims it does not support, or a workspace below one block.
  {
    static const int32_t cu[3] = {0, 1, 2}, contexts[2] = {100, 256};
    static const int32_t bad_cu[3] = {0, 1, 3}, bad_contexts[2] = {100, 257};
    const Bad naive_cases[] = {
        {"naive without host tables",
         [](MlaAttentionParams& p) {
           p.host_cu_q = nullptr;
           p.host_context_lens = nullptr;
         }},
        {"naive without cuBLAS", [](MlaAttentionParams& p) { p.cublas = nullptr; }},
        {"naive host cu_q[N] != num_tokens", [](MlaAttentionParams& p) { p.host_cu_q = bad_cu; }},
        {"naive context past the table", [](MlaAttentionParams& p) { p.host_context_lens = bad_contexts; }},
        {"naive nope 12",
         [](MlaAttentionParams& p) {
           p.qk_nope = 12;
           p.q_stride = 32 * 76;
         }},
        {"naive v_head 136", [](MlaAttentionParams& p) { p.v_head = 136; }},
        {"naive workspace small",
         [](MlaAttentionParams& p) {
           p.workspace_bytes = mla_prefill_workspace_bytes(32, 512, 128, 64, 128, 2, 64) - 1024;
         }},
    };
    for (const Bad& bad : naive_cases) {
      MlaAttentionParams p = valid_attention_params();
      p.prefill_form = MlaPrefillForm::kNaive;
      p.host_cu_q = cu;
      p.host_context_lens = contexts;
      p.cublas = reinterpret_cast<cublasHandle_t>(uintptr_t{4096});  // never used: rejected before any launch
      p.workspace_bytes = mla_prefill_workspace_bytes(32, 512, 128, 64, 128, 2, 256);
      bad.edit(p);
      const Status prefill = mla_prefill(p, nullptr);
      EXPECT_EQ(prefill.code(), StatusCode::kInvalidArgument) << bad.what << ": " << prefill.to_string();
    }
    EXPECT_TRUE(mla_prefill_naive_supported(128, 64, 128));
    EXPECT_TRUE(mla_prefill_naive_supported(16, 8, 16));
    EXPECT_FALSE(mla_prefill_naive_supported(128, 72, 128));
    EXPECT_FALSE(mla_prefill_naive_supported(128, 64, 256));
    EXPECT_FALSE(mla_prefill_naive_supported(20, 8, 16));
    // Block sizes: one 64-row granule minimum; Kimi-48B costs 17,536 bytes per row plus 8 bytes per (token, head).
    const size_t b64 = mla_prefill_workspace_bytes(32, 512, 128, 64, 128, 8192, 64);
    const size_t b4096 = mla_prefill_workspace_bytes(32, 512, 128, 64, 128, 8192, 4096);
    EXPECT_EQ(b4096 - b64, size_t{4032} * 17536);
    EXPECT_EQ(mla_prefill_workspace_bytes(32, 512, 128, 64, 128, 8192, 1), b64);
    EXPECT_GE(b64, size_t{8192} * 32 * 8 + 64 * 17536);
  }
  // Decode takes at most one query token per sequence; prefill takes any.
  MlaAttentionParams p = valid_attention_params();
  p.num_seqs = 1;
  EXPECT_EQ(mla_decode(p, nullptr).code(), StatusCode::kInvalidArgument);
  // No query tokens: nothing to launch, device pointers may be null.
  p = valid_attention_params();
  p.num_tokens = 0;
  p.q = nullptr;
  p.out = nullptr;
  p.workspace = nullptr;
  p.workspace_bytes = 0;
  EXPECT_TRUE(mla_decode(p, nullptr).is_ok());
  EXPECT_TRUE(mla_prefill(p, nullptr).is_ok());
}

TEST(MlaAttentionValidation, WorkspaceCoversEverySmallerBatch) {
  for (int max_context : {1, 512, 513, 4097, 131072}) {
    const size_t bytes = mla_attention_workspace_bytes(32, 512, 64, 300, max_context);
    for (int64_t t = 1; t <= 300; ++t) {
      const int splits = mla_num_splits(t, max_context);
      ASSERT_GE(splits, 1);
      ASSERT_LE(splits, kMlaMaxSplits);
      const size_t need = static_cast<size_t>(t) * 32 * (576 * 4 + static_cast<size_t>(splits) * (512 * 4 + 8));
      ASSERT_GE(bytes, need) << "t=" << t << " max_context=" << max_context;
    }
  }
  EXPECT_EQ(mla_num_splits(1, 100), 1);
  EXPECT_GT(mla_num_splits(1, 100000), 1);
  if (std::getenv("DELTASERVE_MLA_TC") == nullptr) {  // the default heuristic: >= 128 rows per split, ~132 CTAs
    EXPECT_EQ(mla_num_splits(1, 4096), 32);
    EXPECT_EQ(mla_num_splits(8, 4096), 16);
    EXPECT_EQ(mla_num_splits(32, 4096), 4);
    EXPECT_EQ(mla_num_splits(64, 4096), 2);
    EXPECT_EQ(mla_num_splits(256, 4096), 1);
    EXPECT_EQ(mla_num_splits(1, 512), 4);
    EXPECT_EQ(mla_num_splits(1, 32768), 64);
    EXPECT_EQ(mla_num_splits(8, 32768), 16);
    // Heads per CTA of the default attention kernel: smaller groups only where the CTAs would not fill the SMs.
    EXPECT_EQ(mla_decode_head_group(1, 32, 4096), 8);
    EXPECT_EQ(mla_decode_head_group(2, 32, 4096), 16);
    EXPECT_EQ(mla_decode_head_group(4, 32, 4096), 32);
    EXPECT_EQ(mla_decode_head_group(256, 32, 4096), 32);
    EXPECT_EQ(mla_decode_head_group(1, 32, 32768), 16);
    EXPECT_EQ(mla_decode_head_group(1, 2, 4096), 2);
    EXPECT_EQ(mla_decode_head_group(1, 96, 4096), 16);
  }
}

TEST(MlaWriteRowsValidation, RejectsBadHostInputs) {
  auto valid = [] {
    MlaWriteParams p;
    p.pool = MlaPagePool{fake_device<__nv_bfloat16>(), 10, 2, 64, 40, 40};
    p.layer = 0;
    p.num_tokens = 3;
    p.kv = fake_device<float>();
    p.kv_stride = 40;
    p.norm_weight = fake_device<float>();
    p.kv_lora_rank = 32;
    p.qk_rope = 8;
    p.slot_mapping = fake_device<int64_t>();
    return p;
  };
  struct Bad {
    const char* what;
    void (*edit)(MlaWriteParams&);
  };
  const Bad cases[] = {
      {"pages null", [](MlaWriteParams& p) { p.pool.pages = nullptr; }},
      {"layer out of range", [](MlaWriteParams& p) { p.layer = 2; }},
      {"page_size 8", [](MlaWriteParams& p) { p.pool.page_size = 8; }},
      {"width mismatch", [](MlaWriteParams& p) { p.qk_rope = 16; }},
      {"kv_stride small", [](MlaWriteParams& p) { p.kv_stride = 39; }},
      {"eps negative", [](MlaWriteParams& p) { p.eps = -1.0f; }},
      {"num_tokens negative", [](MlaWriteParams& p) { p.num_tokens = -2; }},
      {"kv null", [](MlaWriteParams& p) { p.kv = nullptr; }},
      {"slot_mapping null", [](MlaWriteParams& p) { p.slot_mapping = nullptr; }},
      {"norm_weight null", [](MlaWriteParams& p) { p.norm_weight = nullptr; }},
  };
  for (const Bad& bad : cases) {
    MlaWriteParams p = valid();
    bad.edit(p);
    const Status s = mla_write_rows(p, nullptr);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad.what << ": " << s.to_string();
  }
  MlaWriteParams p = valid();
  p.num_tokens = 0;
  p.kv = nullptr;
  EXPECT_TRUE(mla_write_rows(p, nullptr).is_ok());
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
