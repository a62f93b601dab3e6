// Helpers of the GPU MLA tests (mla_attention_check.hpp and the mla_*_test.cpp files): head dims, bf16-rounded
// inputs, a shuffled NaN-poisoned page pool, NaN-padded q rows, the CPU reference per sequence, the launch
// parameters every case sets alike, the one-sequence long-chunk inputs of the timing cases, and fake device pointers
// for the validation cases.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <cublas_v2.h>

#include "kernels/cpu/mla.hpp"
#include "kernels/cuda/mla/mla.hpp"
#include "kernels/cuda/tests/kda_test_util.hpp"

namespace deltaserve::kernels::cuda::test {

struct MlaShape {
  int heads, kv_lora, nope, rope, v_head;
};

inline constexpr MlaShape kTiny{2, 32, 16, 8, 16};
inline constexpr MlaShape kKimi48B{32, 512, 128, 64, 128};
inline constexpr MlaShape kK3{96, 512, 128, 64, 128};  // 3 head groups of 32
inline constexpr MlaShape kOdd{40, 96, 24, 0, 40};     // head groups 32 + 8, no rope part

inline std::string shape_name(const MlaShape& s) {
  std::ostringstream os;
  os << "H=" << s.heads << " kv_lora=" << s.kv_lora << " nope=" << s.nope << " rope=" << s.rope << " v=" << s.v_head;
  return os.str();
}

// A device pointer that is never dereferenced: the validation cases' calls are all rejected before any launch.
template <class T>
T* fake_device(uintptr_t address = 4096) {
  return reinterpret_cast<T*>(address);
}

inline std::vector<float> rounded_normal(std::mt19937& rng, size_t n, float mean, float stddev) {
  std::vector<float> x = normal_vector(rng, n, mean, stddev);
  for (float& v : x) v = bf16_round(v);
  return x;
}

// Element-wise |actual - expected| <= atol + rtol |expected| over n elements, a non-finite actual counting as an
// infinite error: the largest error, its index and the count outside; on_failure(i, err, failures before this one)
// runs for each element outside.
struct ErrorScan {
  double max_err = 0.0;
  size_t max_at = 0, failures = 0;
};

template <class OnFailure>
ErrorScan scan_errors(const std::vector<float>& actual, const std::vector<float>& expected, size_t n, double atol,
                      double rtol, OnFailure on_failure) {
  ErrorScan scan;
  for (size_t i = 0; i < n; ++i) {
    const double err = std::isfinite(actual[i]) ? std::fabs(static_cast<double>(actual[i]) - expected[i]) : INFINITY;
    if (err > scan.max_err) {
      scan.max_err = err;
      scan.max_at = i;
    }
    if (err > atol + rtol * std::fabs(expected[i])) on_failure(i, err, scan.failures++);
  }
  return scan;
}

// A cuBLAS handle destroyed at scope exit (create it with cublasCreate(&h.handle)).
struct CublasHandle {
  cublasHandle_t handle = nullptr;
  CublasHandle() = default;
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  ~CublasHandle() {
    if (handle != nullptr) cublasDestroy(handle);
  }
};

// Each sequence's cache rows (bf16-rounded N(0, 1), `width` elements) in a pool of pages holding `num_layers`
// layers, written at layer `layer`; pages in shuffled order, every other slot NaN. Block-table entries past a
// sequence's pages hold garbage ids (-1, INT32_MAX, num_pages + garbage_past_pool): never read.
struct PagedMlaCache {
  int num_pages = 0, num_layers = 0, layer = 0, page_size = 0, max_pages = 0;
  int64_t row_stride = 0;
  std::vector<int32_t> table;              // [N, max_pages]
  std::vector<__nv_bfloat16> pool;         // [num_pages, num_layers, page_size, row_stride]
  std::vector<std::vector<float>> caches;  // contiguous [context, width] per sequence (the CPU side)

  // Pool index of sequence n's row j.
  size_t row(int n, int j) const {
    const int64_t page = table[static_cast<size_t>(n) * max_pages + j / page_size];
    return static_cast<size_t>(((page * num_layers + layer) * page_size + j % page_size) * row_stride);
  }
};

inline PagedMlaCache paged_mla_cache(std::mt19937& rng, const std::vector<int>& contexts, int width, int64_t row_stride,
                                     int num_layers, int layer, int page_size, int num_pages, int max_pages,
                                     int garbage_past_pool) {
  PagedMlaCache c;
  c.num_pages = num_pages;
  c.num_layers = num_layers;
  c.layer = layer;
  c.page_size = page_size;
  c.max_pages = max_pages;
  c.row_stride = row_stride;
  std::vector<int32_t> page_ids(num_pages);
  std::iota(page_ids.begin(), page_ids.end(), 0);
  std::shuffle(page_ids.begin(), page_ids.end(), rng);
  const int32_t garbage[3] = {-1, INT32_MAX, num_pages + garbage_past_pool};
  const int N = static_cast<int>(contexts.size());
  c.table.resize(static_cast<size_t>(N) * max_pages);
  for (size_t i = 0; i < c.table.size(); ++i) c.table[i] = garbage[i % 3];
  c.pool.assign(static_cast<size_t>(num_pages) * num_layers * page_size * row_stride, bf16_nan());
  c.caches.resize(N);
  int next_page = 0;
  for (int n = 0; n < N; ++n) {
    for (int p = 0; p < (contexts[n] + page_size - 1) / page_size; ++p)
      c.table[static_cast<size_t>(n) * max_pages + p] = page_ids[next_page++];
    c.caches[n] = rounded_normal(rng, static_cast<size_t>(contexts[n]) * width, 0.0f, 1.0f);
    for (int j = 0; j < contexts[n]; ++j) {
      const size_t base = c.row(n, j);
      for (int e = 0; e < width; ++e)
        c.pool[base + e] = __float2bfloat16(c.caches[n][static_cast<size_t>(j) * width + e]);
    }
  }
  return c;
}

// q [T, row] as bf16 rows of `stride` elements, NaN past each row; at least one row, so data() stays valid at T = 0.
inline std::vector<__nv_bfloat16> padded_q(const std::vector<float>& q, int64_t T, int row, int64_t stride) {
  std::vector<__nv_bfloat16> host(static_cast<size_t>(std::max<int64_t>(T, 1)) * stride, bf16_nan());
  for (int64_t t = 0; t < T; ++t) {
    for (int i = 0; i < row; ++i) host[t * stride + i] = __float2bfloat16(q[t * row + i]);
  }
  return host;
}

// cpu::mla_attention_naive (or, with `absorbed`, cpu::mla_attention_absorbed) per sequence (q_lens[n] queries at the
// end of contexts[n] rows); [T, H, v_head], zero for the rows of empty sequences.
inline std::vector<float> mla_reference(const cpu::MlaDims& dims, const std::vector<float>& q,
                                        const std::vector<int32_t>& cu_q, const std::vector<int>& q_lens,
                                        const std::vector<int>& contexts, const std::vector<std::vector<float>>& caches,
                                        int width, const std::vector<float>& kv_b, bool absorbed = false) {
  const size_t H = static_cast<size_t>(dims.num_heads), q_width = static_cast<size_t>(dims.qk_nope + dims.qk_rope);
  const size_t v_head = static_cast<size_t>(dims.v_head);
  std::vector<float> expected(static_cast<size_t>(cu_q.back()) * H * v_head, 0.0f);
  for (size_t n = 0; n < q_lens.size(); ++n) {
    if (q_lens[n] == 0) continue;
    (absorbed ? cpu::mla_attention_absorbed : cpu::mla_attention_naive)(
        dims, q.data() + static_cast<size_t>(cu_q[n]) * H * q_width, q_lens[n], contexts[n] - q_lens[n],
        caches[n].data(), width, contexts[n], kv_b.data(), expected.data() + static_cast<size_t>(cu_q[n]) * H * v_head);
  }
  return expected;
}

// The device tables of a batch: cu_q [N + 1], context_lens [N], block_tables [N, max_pages].
struct MlaSeqTables {
  int num_seqs = 0;
  int64_t num_tokens = 0;
  const int32_t *cu_q = nullptr, *context_lens = nullptr, *block_tables = nullptr;
  int max_pages = 0, max_context = 0;
};

// The launch parameters every case sets the same way (scale (nope + rope)^-0.5); the caller adds the form, kernel
// and host-table fields.
inline MlaAttentionParams mla_params(const MlaShape& s, const MlaPagePool& pool, int layer, const MlaSeqTables& seqs,
                                     const __nv_bfloat16* q, int64_t q_stride, const __nv_bfloat16* kv_b, float* out,
                                     void* workspace, size_t workspace_bytes) {
  MlaAttentionParams p;
  p.num_heads = s.heads;
  p.kv_lora_rank = s.kv_lora;
  p.qk_nope = s.nope;
  p.qk_rope = s.rope;
  p.v_head = s.v_head;
  p.softmax_scale = 1.0f / std::sqrt(static_cast<float>(s.nope + s.rope));
  p.pool = pool;
  p.layer = layer;
  p.num_seqs = seqs.num_seqs;
  p.num_tokens = seqs.num_tokens;
  p.cu_q = seqs.cu_q;
  p.context_lens = seqs.context_lens;
  p.block_tables = seqs.block_tables;
  p.max_pages_per_seq = seqs.max_pages;
  p.max_context = seqs.max_context;
  p.q = q;
  p.q_stride = q_stride;
  p.kv_b = kv_b;
  p.out = out;
  p.workspace = workspace;
  p.workspace_bytes = workspace_bytes;
  return p;
}

// One sequence of T queries at the end of `context` rows, one layer, unpadded rows and q, on the device: cheap
// deterministic values in [-1.7, 1.7) (variance about 1; a 64-bit LCG from `seed`, pool then q then kv_b / sqrt
// kv_lora), pages shuffled by std::mt19937(7). For the timing cases, where no CPU reference runs.
struct MlaLongChunk {
  MlaLongChunk(const MlaShape& s, int64_t T, int64_t context, int page_size, uint64_t seed)
      : pages(static_cast<int>(context / page_size)),
        page_size(page_size),
        cu_q{0, static_cast<int32_t>(T)},
        contexts{static_cast<int32_t>(context)},
        pool_d(static_cast<size_t>(pages) * page_size * (s.kv_lora + s.rope)),
        q_d(static_cast<size_t>(T) * s.heads * (s.nope + s.rope)),
        kv_b_d(static_cast<size_t>(s.heads) * (s.nope + s.v_head) * s.kv_lora),
        cu_d(2),
        ctx_d(1),
        table_d(pages) {
    uint64_t state = seed;
    auto next = [&state] {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      return (static_cast<float>(state >> 40) / 16777216.0f * 2.0f - 1.0f) * 1.7f;
    };
    std::vector<__nv_bfloat16> pool(pool_d.size()), q(q_d.size()), kv_b(kv_b_d.size());
    for (auto& x : pool) x = __float2bfloat16(next());
    for (auto& x : q) x = __float2bfloat16(next());
    for (auto& x : kv_b) x = __float2bfloat16(next() / std::sqrt(static_cast<float>(s.kv_lora)));
    std::vector<int32_t> table(pages);
    std::iota(table.begin(), table.end(), 0);
    std::mt19937 rng(7);
    std::shuffle(table.begin(), table.end(), rng);
    pool_d.upload(pool);
    q_d.upload(q);
    kv_b_d.upload(kv_b);
    cu_d.upload(cu_q);
    ctx_d.upload(contexts);
    table_d.upload(table);
  }

  // mla_params for this chunk (no output yet; the workspace given).
  MlaAttentionParams params(const MlaShape& s, void* workspace, size_t workspace_bytes) const {
    const int width = s.kv_lora + s.rope;
    const MlaSeqTables seqs{1, cu_q[1], cu_d.get(), ctx_d.get(), table_d.get(), pages, contexts[0]};
    return mla_params(s, MlaPagePool{pool_d.get(), pages, 1, page_size, width, width}, 0, seqs, q_d.get(),
                      static_cast<int64_t>(s.heads) * (s.nope + s.rope), kv_b_d.get(), nullptr, workspace,
                      workspace_bytes);
  }

  int pages, page_size;
  std::vector<int32_t> cu_q, contexts;
  DeviceBuffer<__nv_bfloat16> pool_d, q_d, kv_b_d;
  DeviceBuffer<int32_t> cu_d, ctx_d, table_d;
};

}  // namespace deltaserve::kernels::cuda::test
