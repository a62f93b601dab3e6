// The body of the GPU MLA attention cases (mla_decode_test.cpp, mla_prefill_test.cpp): one batch of sequences in a
// shuffled, NaN-poisoned page pool, every launcher that applies run on it, each output compared against the CPU
// reference on the same bf16 values (q, cache rows and kv_b rounded to bf16), so only the GPU's own roundings and the
// accumulation order differ. Tolerances per output element (outputs are O(0.1..1)), against
// cpu::mla_attention_naive:
//   tensor-core attention (default; q̃ and P rounded to bf16): |gpu - cpu| <= 2e-2 + 1e-2 |cpu|
//   fp32_attention (CUDA-core fp32 kernel):                    |gpu - cpu| <= 5e-3 + 5e-3 |cpu|
// (a host emulation of the bf16 roundings at Kimi-48B dims gave max abs errors of 2e-3 at context 65 and 3e-4 at
// 4097, so the tensor-core bound has a wide margin). Each case runs mla_decode (decode-shaped batches; fp32 and bf16
// outputs, and a CUDA-graph replay) and mla_prefill in the absorbed form, each on tensor cores and in fp32, then
// mla_prefill in the naive form (forced: decompressed K/V rounded to bf16 as well, the tensor-core tolerance) and in
// the automatic choice, against one CPU reference. Every failure log prints the max error, its index (sequence,
// token, head, column) and expected vs actual. Every page slot, page table entry and output padding that must not be
// read or written is NaN-poisoned (or holds a garbage page id).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/mla.hpp"
#include "kernels/cuda/mla/mla.hpp"
#include "kernels/cuda/tests/gpu_test_graph.hpp"
#include "kernels/cuda/tests/kda_test_util.hpp"
#include "kernels/cuda/tests/mla_test_util.hpp"

namespace deltaserve::kernels::cuda::test {

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

inline std::string batch_name(const Batch& b) {
  std::ostringstream os;
  os << "page_size=" << b.page_size << " max_context=" << b.max_context << " naive_block_rows=" << b.naive_block_rows
     << " (q_len, context):";
  for (size_t n = 0; n < b.q_lens.size(); ++n) os << " (" << b.q_lens[n] << ", " << b.contexts[n] << ")";
  return os.str();
}

// Builds a shuffled, poisoned page pool holding each sequence's rows, runs the GPU launchers (mla_decode when every
// q_len <= 1, and mla_prefill; each on tensor cores and in fp32; mla_prefill in the naive form and in kAuto) and
// compares every output against cpu::mla_attention_naive (or _absorbed) on the same bf16 values.
inline void check_attention(const MlaShape& shape, const Batch& batch, uint32_t seed) {
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
  std::vector<float> decode_out;  // mode 0: the graph replay and mode 6's bf16 output must match it bitwise
  for (int mode = 0; mode < 7; ++mode) {
    // 0, 1: mla_decode tensor-core (the warpgroup-MMA attention at kv_lora 512 + rope 64 on Hopper, the mma.sync one
    // elsewhere) / fp32; 2, 3: mla_prefill absorbed tensor-core (the mma.sync attention) / fp32; 4: mla_prefill naive
    // (forced, own workspace); 5: mla_prefill kAuto with the host tables and the absorbed-sized workspace; 6:
    // mla_decode with the bf16 output (out null), bitwise the bf16 rounding of mode 0.
    const bool bf16_out = mode == 6;
    const bool decode = mode < 2 || mode == 6, fp32 = mode < 4 && (mode % 2) == 1;
    const bool host_tables = mode == 4 || mode == 5;
    const bool naive_forced = mode == 4;
    if (decode && !decode_shaped) continue;
    if (!decode && batch.decode_only) continue;
    const char* names[] = {"mla_decode tensor-core", "mla_decode fp32",  "mla_prefill tensor-core", "mla_prefill fp32",
                           "mla_prefill naive",      "mla_prefill auto", "mla_decode bf16 out"};
    const std::string name = names[mode];
    SCOPED_TRACE(name);
    out_d.upload(std::vector<float>(out_size + out_pad, NAN));
    out_bf16_d.upload(std::vector<__nv_bfloat16>(out_size + out_pad, bf16_nan()));
    p.out = bf16_out ? nullptr : out_d.get();
    p.out_bf16 = bf16_out ? out_bf16_d.get() : nullptr;
    p.fp32_attention = fp32;
    p.prefill_form =
        !host_tables ? MlaPrefillForm::kAbsorbed : (naive_forced ? MlaPrefillForm::kNaive : MlaPrefillForm::kAuto);
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
      ASSERT_GE(decode_out.size(), out_size);
      size_t differing = 0;
      for (size_t i = 0; i < out.size(); ++i) {
        out[i] = __bfloat162float(out_bf16[i]);
        if (i >= out_size) continue;
        const uint16_t want = __nv_bfloat16_raw(__float2bfloat16(decode_out[i])).x,
                       got = __nv_bfloat16_raw(out_bf16[i]).x;
        if (want != got && differing++ < 5) {
          ADD_FAILURE() << "bf16 output " << i << ": " << got << " != bf16 of the fp32 run's " << decode_out[i];
        }
      }
      EXPECT_EQ(differing, 0u) << "bf16 outputs that are not the rounding of the fp32 run's";
    }
    if (mode == 0) decode_out = out;
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
  // mla_decode captured in a CUDA graph (global capture mode) and replayed: bit-identical to the direct launch.
  if (decode_shaped && T > 0) {
    SCOPED_TRACE("mla_decode captured in a CUDA graph");
    cudaStream_t stream = nullptr;
    DS_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    out_d.upload(std::vector<float>(out_size + out_pad, NAN));
    p.out = out_d.get();
    p.out_bf16 = nullptr;
    p.fp32_attention = false;
    p.workspace = ws_d.get();
    p.workspace_bytes = ws_bytes;
    ASSERT_NO_FATAL_FAILURE(
        replay_captured(stream, cudaStreamCaptureModeGlobal, 2, [&](cudaStream_t s) { return mla_decode(p, s); }));
    const std::vector<float> out = out_d.download();
    for (size_t i = 0; i < out_size; ++i) {
      ASSERT_EQ(std::memcmp(&out[i], &decode_out[i], sizeof(float)), 0)
          << "graph replay differs at " << i << ": " << out[i] << " vs " << decode_out[i];
    }
    cudaStreamDestroy(stream);
  }
}

}  // namespace deltaserve::kernels::cuda::test
