// MLA prefill attention over a paged cache: any varlen batch (prefill chunks over cached history, mixed batches).
// Two forms (mla.hpp, MlaPrefillForm): the absorbed form runs the kernels of decode.cu with one CTA per query token;
// the naive form (this file) decompresses K/V and runs flash attention on tensor cores.
//
// Naive form, per sequence n with q_len > 0 and per block [b0, b0 + rows) of its context (rows <= the block size
// the workspace holds; one block covers the whole context when it fits):
//   1. gather:     the block's cache rows from the pages into a contiguous bf16 [rows, kv_lora + rope] buffer
//                  (page ids outside the pool give zero rows, like the absorbed kernels);
//   2. decompress: one cuBLAS GEMM, kv[r, h (nope + v) + j] = Σ_c rows[r, c] kv_b[h (nope + v) + j, c] (bf16 out,
//                  fp32 accumulate): per head K_nope (nope) then V (v_head), the layout of kv_b's rows;
//   3. attention:  one CTA per (128-query tile, head), the heaviest query tiles (last in the chunk) of every head
//                  first. K = [K_nope ‖ k_rot] and V tiles of keys; S = Q Kᵀ and O += P V on tensor cores in bf16
//                  with fp32 accumulate; online softmax in base 2, fp32, P rounded to bf16 for the P·V product.
//                  Causal: query i sits at position context - q_len + i and sees keys at positions <= it; each CTA
//                  stops at its last query's position. Between blocks the unnormalised O stays in `out` and the
//                  (max, sum) pair per (token, head) in the workspace; the last block normalises.
//                  Two kernels: at qk_nope 128, qk_rope 64, v_head 128 (Kimi Linear, K3) on Hopper, warpgroup MMA
//                  with TMA loads (prefill_wgmma.cu), about three times the mma.sync kernel's rate; the mma.sync
//                  kernel below for every other head-dim combination the naive form supports (and query layouts
//                  that break TMA's 16-byte rows).
// FLOPs: 2 H (nope + rope + v) per visible (query, key) pair plus 2 kv_lora H (nope + v) per context row per
// chunk for the GEMM (8.4 MFLOP per row at Kimi-48B dims: under 2% of the attention of an 8192-token chunk).
#include <algorithm>
#include <climits>
#include <cmath>
#include <string>

#include "kernels/cuda/common/detail/mma_sm80.cuh"
#include "kernels/cuda/mla/detail/attention.cuh"
#include "kernels/cuda/mla/detail/prefill_wgmma.hpp"
#include "kernels/cuda/mla/mla.hpp"

namespace deltaserve::kernels::cuda {
namespace {

constexpr int kDq = kMlaNaiveMaxQk;  // padded QK head dim
constexpr int kDv = kMlaNaiveMaxV;   // padded V head dim
constexpr int kKTile = 64;           // keys per tile
constexpr int kLdq = kDq + 8;        // smem row strides (elements): +16 bytes keeps ldmatrix rows on distinct banks
constexpr int kLdv = kDv + 8;
constexpr int kGatherThreads = 256;
constexpr float kLog2e = 1.4426950408889634f;
static_assert(kKTile == kMlaNaiveBlockGranule, "blocks are whole key tiles");

size_t align256(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

// Workspace sections of the naive form: (max, sum) per (token, head); gathered rows; decompressed K_nope ‖ V.
struct NaiveLayout {
  size_t ml = 0, rows = 0, kv = 0, total = 0;
  int64_t block_rows = 0;
};

NaiveLayout naive_layout(int num_heads, int kv_lora, int nope, int rope, int v_head, int64_t tokens,
                         int64_t block_rows) {
  NaiveLayout layout;
  const size_t h = static_cast<size_t>(num_heads);
  const size_t b = static_cast<size_t>(block_rows);
  layout.block_rows = block_rows;
  layout.ml = 0;
  layout.rows = align256(static_cast<size_t>(tokens) * h * sizeof(float2));
  layout.kv = layout.rows + align256(b * static_cast<size_t>(kv_lora + rope) * sizeof(__nv_bfloat16));
  layout.total = layout.kv + align256(b * h * static_cast<size_t>(nope + v_head) * sizeof(__nv_bfloat16));
  return layout;
}

// The largest block (a multiple of kKTile, at most `cap` rounded up to one) whose layout fits `bytes`; 0 if none.
int64_t naive_block_rows_for(size_t bytes, int num_heads, int kv_lora, int nope, int rope, int v_head, int64_t tokens,
                             int64_t cap) {
  const size_t fixed = naive_layout(num_heads, kv_lora, nope, rope, v_head, tokens, 0).total + 512;
  if (bytes < fixed) return 0;
  const size_t per_row =
      sizeof(__nv_bfloat16) * (static_cast<size_t>(kv_lora + rope) + static_cast<size_t>(num_heads) * (nope + v_head));
  int64_t rows = static_cast<int64_t>((bytes - fixed) / per_row) / kKTile * kKTile;
  const int64_t cap_rows = std::max<int64_t>(kKTile, (cap + kKTile - 1) / kKTile * kKTile);
  rows = std::min(rows, cap_rows);
  while (rows > 0 && naive_layout(num_heads, kv_lora, nope, rope, v_head, tokens, rows).total > bytes) rows -= kKTile;
  return rows;
}

// ---- 1. gather --------------------------------------------------------------------------------------------------
// Rows [block_begin, block_begin + rows) of one sequence (its block-table row `table`) -> dst [rows, width].
__global__ void __launch_bounds__(kGatherThreads)
    mla_naive_gather_kernel(const __nv_bfloat16* __restrict__ pages, int64_t num_pages, int num_layers, int page_size,
                            int layer, int64_t row_stride, const int32_t* __restrict__ table, int64_t block_begin,
                            int64_t rows, int width, __nv_bfloat16* __restrict__ dst) {
  const int chunks = width / 8;
  const int64_t total = rows * chunks;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = e / chunks;
    const int c = static_cast<int>(e - j * chunks);
    const int64_t position = block_begin + j;
    const int64_t page = table[position / page_size];
    uint4 value = make_uint4(0u, 0u, 0u, 0u);
    if (page >= 0 && page < num_pages) {
      const __nv_bfloat16* src =
          pages + ((page * num_layers + layer) * page_size + position % page_size) * row_stride + c * 8;
      value = *reinterpret_cast<const uint4*>(src);
    }
    *reinterpret_cast<uint4*>(dst + j * width + c * 8) = value;
  }
}

// ---- 3. flash attention -----------------------------------------------------------------------------------------
struct FlashArgs {
  const __nv_bfloat16* q;  // [T, H, nope + rope], row stride q_stride
  int64_t q_stride;
  const __nv_bfloat16* kv;    // [block rows, H (nope + v)]
  const __nv_bfloat16* rows;  // [block rows, kv_lora + rope]
  float* out;                 // [T, H, v_head]
  float2* ml;                 // [T, H]
  int num_heads, kv_lora, nope, rope, v_head;
  int64_t q_begin;      // first token of the sequence in the batch
  int64_t q_len;        // its query tokens
  int64_t context;      // its context length
  int64_t block_begin;  // first context row of this block
  int64_t block_rows;
  float scale_log2;  // softmax_scale * log2(e)
  int first, last;   // first / last block of the sequence's context
};

// The mma.sync kernel (m16n8k16 bf16, fp32 accumulate; prefill_wgmma.cu has the Hopper one): 128-query tiles with 8
// warps (16 queries each), so every K/V tile brought into shared memory serves 128 queries; the Q tile [128, 192]
// (zero-padded past nope + rope) in registers; K and V tiles of 64 keys (zero-filled past the block and past the head
// dims) in a 3-stage cp.async ring with one barrier per key tile (the refill of the ring slot read one iteration
// earlier is issued after that iteration's barrier); a warp whose 16 queries all precede a key tile (causal diagonal)
// or lie past the chunk skips that tile's math (an all-masked tile leaves the state unchanged, so this is exact); a 1-D
// grid ordered tile-major, last (heaviest) query tiles of every head first, so the light tiles fill the tail. 1 CTA (8
// warps) per SM, ~176 KB smem.
constexpr int kQTile = 128;
constexpr int kThreads = 256;
constexpr int kStages = 3;
constexpr size_t kFlashSmemBytes = sizeof(__nv_bfloat16) * (static_cast<size_t>(kQTile) * kLdq +
                                                            kStages * static_cast<size_t>(kKTile) * (kLdq + kLdv));

// grid (ceil(q_len / kQTile) * H), block kThreads, dynamic smem kFlashSmemBytes.
__global__ void __launch_bounds__(kThreads, 1) mla_naive_flash_kernel(FlashArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* s_q = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [kQTile][kLdq]
  __nv_bfloat16* s_k = s_q + kQTile * kLdq;                         // [kStages][kKTile][kLdq]
  __nv_bfloat16* s_v = s_k + kStages * kKTile * kLdq;               // [kStages][kKTile][kLdv]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;
  const int64_t tiles = (a.q_len + kQTile - 1) / kQTile;
  const int h = static_cast<int>(blockIdx.x % static_cast<unsigned>(a.num_heads));
  const int64_t tile = tiles - 1 - static_cast<int64_t>(blockIdx.x / static_cast<unsigned>(a.num_heads));
  const int64_t i0 = tile * kQTile;
  const int q_count = static_cast<int>(a.q_len - i0 < kQTile ? a.q_len - i0 : kQTile);
  if (tile < 0 || q_count <= 0) return;
  const int q_width = a.nope + a.rope;
  const int head_width = a.nope + a.v_head;
  const int64_t kv_stride = static_cast<int64_t>(a.num_heads) * head_width;
  const int64_t first_position = a.context - a.q_len + i0;
  const int64_t last_needed = first_position + q_count - 1 - a.block_begin;
  const int64_t needed = last_needed + 1 < a.block_rows ? last_needed + 1 : a.block_rows;
  const int num_tiles = needed > 0 ? static_cast<int>((needed + kKTile - 1) / kKTile) : 0;

  for (int e = tid; e < kQTile * kDq; e += kThreads) {
    const int r = e / kDq, d = e - r * kDq;
    __nv_bfloat16 x = __float2bfloat16(0.0f);
    if (r < q_count && d < q_width) {
      x = a.q[(a.q_begin + i0 + r) * a.q_stride + static_cast<int64_t>(h) * q_width + d];
    }
    s_q[r * kLdq + d] = x;
  }

  const __nv_bfloat16* kv_head = a.kv + static_cast<int64_t>(h) * head_width;
  auto load_tile = [&](int kt, int buf) {
    __nv_bfloat16* dk = s_k + buf * kKTile * kLdq;
    __nv_bfloat16* dv = s_v + buf * kKTile * kLdv;
    const int64_t j0 = static_cast<int64_t>(kt) * kKTile;
#pragma unroll
    for (int c = tid; c < kKTile * (kDq / 8); c += kThreads) {
      const int r = c / (kDq / 8), d = (c - r * (kDq / 8)) * 8;
      const int64_t j = j0 + r;
      const __nv_bfloat16* src = a.kv;
      bool valid = false;
      if (j < a.block_rows) {
        if (d < a.nope) {
          src = kv_head + j * kv_stride + d;
          valid = true;
        } else if (d < q_width) {
          src = a.rows + j * (a.kv_lora + a.rope) + a.kv_lora + (d - a.nope);
          valid = true;
        }
      }
      detail::cp_async16_zfill(dk + r * kLdq + d, src, valid);
    }
#pragma unroll
    for (int c = tid; c < kKTile * (kDv / 8); c += kThreads) {
      const int r = c / (kDv / 8), d = (c - r * (kDv / 8)) * 8;
      const int64_t j = j0 + r;
      const bool valid = j < a.block_rows && d < a.v_head;
      const __nv_bfloat16* src = valid ? kv_head + j * kv_stride + a.nope + d : a.kv;
      detail::cp_async16_zfill(dv + r * kLdv + d, src, valid);
    }
  };

  // Prologue: tiles 0 .. kStages - 2 in flight (one commit group each, empty groups past the end).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_tiles) load_tile(s, s);
    detail::cp_async_commit();
  }

  constexpr int kVTiles = kDv / 8;
  float o[kVTiles][4];
  float m_run[2], l_run[2];
  const int row0 = warp * 16 + g;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    m_run[r] = -INFINITY;
    l_run[r] = 0.0f;
    const int row = row0 + 8 * r;
    const bool valid = row < q_count;
    const int64_t t = a.q_begin + i0 + row;
    const float* src = a.out + (t * a.num_heads + h) * a.v_head;
    if (!a.first && valid) {
      const float2 ml = a.ml[t * a.num_heads + h];
      m_run[r] = ml.x;
      l_run[r] = tq == 0 ? ml.y : 0.0f;
    }
#pragma unroll
    for (int n = 0; n < kVTiles; ++n) {
      const int col = n * 8 + 2 * tq;
      const bool load = !a.first && valid && col < a.v_head;
      o[n][2 * r] = load ? src[col] : 0.0f;
      o[n][2 * r + 1] = load ? src[col + 1] : 0.0f;
    }
  }

  __syncthreads();  // s_q complete
  uint32_t qf[kDq / 16][4];
#pragma unroll
  for (int kk = 0; kk < kDq / 16; ++kk) detail::load_a(qf[kk], s_q, kLdq, warp * 16, kk * 16);

  const int64_t row_position0 = first_position + row0;
  // The warp's rows: none valid (past the chunk) -> no math; keys past its last row's position -> no math.
  const bool warp_idle = warp * 16 >= q_count;
  const int64_t warp_last_position = first_position + warp * 16 + 15;
  for (int kt = 0; kt < num_tiles; ++kt) {
    const int buf = kt % kStages;
    detail::cp_async_wait<kStages - 2>();  // tile kt landed (this thread's copies)
    __syncthreads();                       // ... everyone's; and every warp is done with tile kt - 1's slot
    if (kt + kStages - 1 < num_tiles) load_tile(kt + kStages - 1, (kt + kStages - 1) % kStages);
    detail::cp_async_commit();
    const int64_t tile_key0 = a.block_begin + static_cast<int64_t>(kt) * kKTile;
    if (warp_idle || tile_key0 > warp_last_position) continue;  // warp-uniform
    const __nv_bfloat16* k_tile = s_k + buf * kKTile * kLdq;
    const __nv_bfloat16* v_tile = s_v + buf * kKTile * kLdv;

    float s[kKTile / 8][4];
#pragma unroll
    for (int n = 0; n < kKTile / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kDq / 16; ++kk) {
#pragma unroll
      for (int n = 0; n < kKTile / 16; ++n) {
        uint32_t b[4];
        detail::load_b_nk(b, k_tile, kLdq, n * 16, kk * 16);
        detail::mma_bf16_16816(s[2 * n], qf[kk], b[0], b[1]);
        detail::mma_bf16_16816(s[2 * n + 1], qf[kk], b[2], b[3]);
      }
    }

    const bool mask =
        static_cast<int64_t>(kt + 1) * kKTile > a.block_rows || tile_key0 + kKTile - 1 > row_position0 - g;
    if (mask) {
#pragma unroll
      for (int n = 0; n < kKTile / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int local = n * 8 + 2 * tq + (e & 1);
          const int64_t key = tile_key0 + local;
          const int64_t position = row_position0 + ((e >> 1) << 3);
          if (static_cast<int64_t>(kt) * kKTile + local >= a.block_rows || key > position) s[n][e] = -INFINITY;
        }
      }
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < kKTile / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run[r], mx * a.scale_log2);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      const float correction = exp2f(m_run[r] - m_use);
      m_run[r] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < kKTile / 8; ++n) {
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          const float p = exp2f(s[n][e] * a.scale_log2 - m_use);
          s[n][e] = p;
          sum += p;
        }
      }
      l_run[r] = l_run[r] * correction + sum;
#pragma unroll
      for (int n = 0; n < kVTiles; ++n) {
        o[n][2 * r] *= correction;
        o[n][2 * r + 1] *= correction;
      }
    }

#pragma unroll
    for (int kk = 0; kk < kKTile / 16; ++kk) {
      uint32_t pa[4];
      pa[0] = detail::pack_bf16(s[2 * kk][0], s[2 * kk][1]);
      pa[1] = detail::pack_bf16(s[2 * kk][2], s[2 * kk][3]);
      pa[2] = detail::pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[3] = detail::pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int n = 0; n < kDv / 16; ++n) {
        uint32_t b[4];
        detail::load_b_kn(b, v_tile, kLdv, n * 16, kk * 16);
        detail::mma_bf16_16816(o[2 * n], pa, b[0], b[1]);
        detail::mma_bf16_16816(o[2 * n + 1], pa, b[2], b[3]);
      }
    }
  }
  detail::cp_async_wait<0>();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row = row0 + 8 * r;
    if (row >= q_count) continue;
    const int64_t t = a.q_begin + i0 + row;
    float* dst = a.out + (t * a.num_heads + h) * a.v_head;
    const float inv = a.last ? (l > 0.0f ? 1.0f / l : 0.0f) : 1.0f;
#pragma unroll
    for (int n = 0; n < kVTiles; ++n) {
      const int col = n * 8 + 2 * tq;
      if (col < a.v_head) *reinterpret_cast<float2*>(dst + col) = make_float2(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
    }
    if (!a.last && tq == 0) a.ml[t * a.num_heads + h] = make_float2(m_run[r], l);
  }
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Why the naive form cannot run this call ("" when it can); `block_rows` gets the block size it would use.
std::string naive_unavailable(const MlaAttentionParams& p, int64_t* block_rows) {
  if (p.host_cu_q == nullptr || p.host_context_lens == nullptr) return "host_cu_q / host_context_lens not given";
  if (p.cublas == nullptr) return "no cuBLAS handle";
  if ((reinterpret_cast<uintptr_t>(p.out) & 7u) != 0) return "out is not 8-byte aligned";
  if (!mla_prefill_naive_supported(p.qk_nope, p.qk_rope, p.v_head)) {
    return "head dims outside the naive kernel (qk_nope, v_head multiples of 8, qk_nope + qk_rope <= 192, "
           "v_head <= 128)";
  }
  if ((p.num_tokens + kQTile - 1) / kQTile * p.num_heads > INT32_MAX) {
    return "more query tiles x heads than a 1-D grid holds";
  }
  int64_t longest = 0;
  for (int n = 0; n < p.num_seqs; ++n) {
    if (p.host_cu_q[n + 1] > p.host_cu_q[n]) longest = std::max<int64_t>(longest, p.host_context_lens[n]);
  }
  *block_rows = naive_block_rows_for(p.workspace_bytes, p.num_heads, p.kv_lora_rank, p.qk_nope, p.qk_rope, p.v_head,
                                     p.num_tokens, longest);
  if (*block_rows < kKTile) {
    return "workspace_bytes " + std::to_string(p.workspace_bytes) + " < one block (" +
           std::to_string(mla_prefill_workspace_bytes(p.num_heads, p.kv_lora_rank, p.qk_nope, p.qk_rope, p.v_head,
                                                      p.num_tokens, kKTile)) +
           " bytes)";
  }
  return "";
}

// Host-side checks of the host copies (both forms rely on them matching the device arrays; only the naive form
// reads them).
Status validate_host_tables(const MlaAttentionParams& p) {
  const std::string w = "mla_prefill";
  if (p.host_cu_q[0] != 0) return invalid_argument(w + ": host_cu_q[0] must be 0");
  const int64_t table_rows = static_cast<int64_t>(p.max_pages_per_seq) * p.pool.page_size;
  for (int n = 0; n < p.num_seqs; ++n) {
    const int64_t q_len = static_cast<int64_t>(p.host_cu_q[n + 1]) - p.host_cu_q[n];
    const int64_t context = p.host_context_lens[n];
    if (q_len < 0) return invalid_argument(w + ": host_cu_q decreases at sequence " + std::to_string(n));
    if (context < q_len || context > table_rows) {
      return invalid_argument(w + ": sequence " + std::to_string(n) + " has context " + std::to_string(context) +
                              " outside [q_len " + std::to_string(q_len) + ", max_pages_per_seq * page_size " +
                              std::to_string(table_rows) + "]");
    }
  }
  if (p.host_cu_q[p.num_seqs] != p.num_tokens) {
    return invalid_argument(w + ": host_cu_q[N] " + std::to_string(p.host_cu_q[p.num_seqs]) + " != num_tokens " +
                            std::to_string(p.num_tokens));
  }
  return Status::ok();
}

// kAuto's cost model: estimated seconds of each form for the batch, from FLOPs at assumed fractions of the bf16
// tensor-core peak (kPeakFlops: the H200's as cuBLAS reaches it). The absorbed form's fraction is the least certain
// (a whole-model estimate); MlaPrefillNaive.Kimi48BLongChunkMatchesAbsorbedAndTimes prints both forms' rates to
// calibrate these. Per sequence with q_len queries over a context of ctx rows (pairs = visible (query, key) pairs):
//   naive    = ctx 2 kv_lora H (nope + v) / (gemm_eff peak) + pairs 2 H (nope + rope + v) / (naive_eff peak)
//              + 3 launches per block
//   absorbed = pairs 2 H (2 kv_lora + rope) / (absorbed_eff peak)
// At Kimi-48B dims the naive form wins from about 11 query tokens per sequence over any context; a decode-shaped
// sequence in a mixed batch costs the naive form a whole-context GEMM, which the sum weighs against the chunk.
constexpr double kPeakFlops = 875e12;
constexpr double kGemmEfficiency = 0.6;
constexpr double kNaiveEfficiency = 0.3;
constexpr double kAbsorbedEfficiency = 0.05;
constexpr double kLaunchSeconds = 4e-6;

bool naive_estimated_faster(const MlaAttentionParams& p, int64_t block_rows) {
  const double h = p.num_heads;
  double naive = 0.0, absorbed = 0.0;
  for (int n = 0; n < p.num_seqs; ++n) {
    const double q_len = static_cast<double>(p.host_cu_q[n + 1]) - p.host_cu_q[n];
    const double context = p.host_context_lens[n];
    if (q_len <= 0.0) continue;
    const double pairs = q_len * (context - q_len) + q_len * (q_len + 1.0) / 2.0;
    const double blocks = std::ceil(context / static_cast<double>(block_rows));
    naive += context * 2.0 * p.kv_lora_rank * h * (p.qk_nope + p.v_head) / (kGemmEfficiency * kPeakFlops) +
             pairs * 2.0 * h * (p.qk_nope + p.qk_rope + p.v_head) / (kNaiveEfficiency * kPeakFlops) +
             3.0 * blocks * kLaunchSeconds;
    absorbed += pairs * 2.0 * h * (2.0 * p.kv_lora_rank + p.qk_rope) / (kAbsorbedEfficiency * kPeakFlops);
  }
  return naive < absorbed;
}

Status run_naive(const MlaAttentionParams& p, int64_t block_rows, cudaStream_t stream) {
  const std::string w = "mla_prefill (naive)";
  const NaiveLayout layout =
      naive_layout(p.num_heads, p.kv_lora_rank, p.qk_nope, p.qk_rope, p.v_head, p.num_tokens, block_rows);
  char* base = static_cast<char*>(p.workspace);
  float2* ml = reinterpret_cast<float2*>(base + layout.ml);
  __nv_bfloat16* rows = reinterpret_cast<__nv_bfloat16*>(base + layout.rows);
  __nv_bfloat16* kv = reinterpret_cast<__nv_bfloat16*>(base + layout.kv);
  const int width = p.kv_lora_rank + p.qk_rope;
  const int kv_cols = p.num_heads * (p.qk_nope + p.v_head);

  // The Hopper kernel where it covers the head dims and the query layout on a Hopper device; the mma.sync one
  // otherwise.
  const bool wgmma = detail::mla_wgmma_prefill_supported(p.qk_nope, p.qk_rope, p.v_head, p.q, p.q_stride) &&
                     detail::mla_wgmma_prefill_ready();
  if (!wgmma) {
    if (cudaError_t e = cudaFuncSetAttribute(mla_naive_flash_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(kFlashSmemBytes));
        e != cudaSuccess) {
      return Status(StatusCode::kInternal, w + ": cudaFuncSetAttribute: " + cudaGetErrorString(e));
    }
  }
  if (cublasStatus_t s = cublasSetStream(p.cublas, stream); s != CUBLAS_STATUS_SUCCESS) {
    return Status(StatusCode::kInternal, w + ": cublasSetStream failed (" + std::to_string(static_cast<int>(s)) + ")");
  }
  if (cublasStatus_t s = cublasSetPointerMode(p.cublas, CUBLAS_POINTER_MODE_HOST); s != CUBLAS_STATUS_SUCCESS) {
    return Status(StatusCode::kInternal,
                  w + ": cublasSetPointerMode failed (" + std::to_string(static_cast<int>(s)) + ")");
  }
  const float one = 1.0f, zero = 0.0f;

  FlashArgs args{};
  args.q = p.q;
  args.q_stride = p.q_stride;
  args.kv = kv;
  args.rows = rows;
  args.out = p.out;
  args.ml = ml;
  args.num_heads = p.num_heads;
  args.kv_lora = p.kv_lora_rank;
  args.nope = p.qk_nope;
  args.rope = p.qk_rope;
  args.v_head = p.v_head;
  args.scale_log2 = p.softmax_scale * kLog2e;

  for (int n = 0; n < p.num_seqs; ++n) {
    const int64_t q_begin = p.host_cu_q[n];
    const int64_t q_len = static_cast<int64_t>(p.host_cu_q[n + 1]) - q_begin;
    const int64_t context = p.host_context_lens[n];
    if (q_len == 0) continue;
    const int32_t* table = p.block_tables + static_cast<int64_t>(n) * p.max_pages_per_seq;
    for (int64_t b0 = 0; b0 < context; b0 += block_rows) {
      const int64_t count = std::min(block_rows, context - b0);
      const int64_t chunks = count * (width / 8);
      const unsigned gather_blocks =
          static_cast<unsigned>(std::min<int64_t>((chunks + kGatherThreads - 1) / kGatherThreads, 132 * 16));
      mla_naive_gather_kernel<<<gather_blocks, kGatherThreads, 0, stream>>>(
          p.pool.pages, p.pool.num_pages, p.pool.num_layers, p.pool.page_size, p.layer, p.pool.row_stride, table, b0,
          count, width, rows);
      // Column-major view: kvᵀ [kv_cols, count] = kv_bᵀᵀ (kv_b is column-major [kv_lora, kv_cols]) x rowsᵀ
      // (column-major [width, count], first kv_lora rows used).
      if (cublasStatus_t s =
              cublasGemmEx(p.cublas, CUBLAS_OP_T, CUBLAS_OP_N, kv_cols, static_cast<int>(count), p.kv_lora_rank, &one,
                           p.kv_b, CUDA_R_16BF, p.kv_lora_rank, rows, CUDA_R_16BF, width, &zero, kv, CUDA_R_16BF,
                           kv_cols, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
          s != CUBLAS_STATUS_SUCCESS) {
        return Status(StatusCode::kInternal,
                      w + ": decompression GEMM failed (" + std::to_string(static_cast<int>(s)) + ")");
      }
      args.q_begin = q_begin;
      args.q_len = q_len;
      args.context = context;
      args.block_begin = b0;
      args.block_rows = count;
      args.first = b0 == 0 ? 1 : 0;
      args.last = b0 + count >= context ? 1 : 0;
      if (wgmma) {
        detail::MlaWgmmaBlock block;
        block.q = p.q;
        block.q_stride = p.q_stride;
        block.kv = kv;
        block.rows = rows;
        block.out = p.out;
        block.ml = ml;
        block.num_heads = p.num_heads;
        block.kv_lora = p.kv_lora_rank;
        block.nope = p.qk_nope;
        block.rope = p.qk_rope;
        block.v_head = p.v_head;
        block.q_begin = q_begin;
        block.q_len = q_len;
        block.context = context;
        block.block_begin = b0;
        block.block_rows = count;
        block.scale_log2 = args.scale_log2;
        block.first = args.first != 0;
        block.last = args.last != 0;
        if (Status s = detail::mla_wgmma_prefill_launch(block, stream); !s.is_ok()) return s;
      } else {
        // One CTA per (128-query tile, head); naive_unavailable bounds the count by INT32_MAX.
        const int64_t ctas = (q_len + kQTile - 1) / kQTile * p.num_heads;
        mla_naive_flash_kernel<<<static_cast<unsigned>(ctas), kThreads, kFlashSmemBytes, stream>>>(args);
      }
    }
  }
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return Status(StatusCode::kInternal, w + ": launch failed: " + cudaGetErrorString(e));
  }
  return Status::ok();
}

}  // namespace

bool mla_prefill_naive_supported(int qk_nope, int qk_rope, int v_head) {
  return qk_nope >= 8 && qk_nope % 8 == 0 && qk_rope >= 0 && qk_rope % 8 == 0 && qk_nope + qk_rope <= kDq &&
         v_head >= 8 && v_head % 8 == 0 && v_head <= kDv;
}

size_t mla_prefill_workspace_bytes(int num_heads, int kv_lora_rank, int qk_nope, int qk_rope, int v_head,
                                   int64_t max_tokens, int block_rows) {
  if (num_heads <= 0 || kv_lora_rank <= 0 || qk_nope <= 0 || qk_rope < 0 || v_head <= 0 || max_tokens < 0 ||
      block_rows < 0) {
    return 0;
  }
  const int64_t rows = std::max<int64_t>(kKTile, (static_cast<int64_t>(block_rows) + kKTile - 1) / kKTile * kKTile);
  return naive_layout(num_heads, kv_lora_rank, qk_nope, qk_rope, v_head, max_tokens, rows).total + 512;
}

Status mla_prefill(const MlaAttentionParams& params, cudaStream_t stream) {
  const MlaPrefillForm form = params.prefill_form;
  if (form == MlaPrefillForm::kAbsorbed || (form == MlaPrefillForm::kAuto && params.num_tokens <= 0)) {
    return detail::mla_attention_launch(params, /*decode=*/false, "mla_prefill", stream);
  }
  if (form != MlaPrefillForm::kAuto && form != MlaPrefillForm::kNaive) {
    return invalid_argument("mla_prefill: unknown prefill_form " + std::to_string(static_cast<int>(form)));
  }
  // Shape and pool checks shared with the absorbed form: its validation runs to completion and launches nothing
  // for a batch without tokens.
  {
    MlaAttentionParams shapes = params;
    shapes.num_tokens = 0;
    if (Status s = detail::mla_attention_launch(shapes, /*decode=*/false, "mla_prefill", stream); !s.is_ok()) return s;
  }
  const MlaAttentionParams& p = params;
  if (p.num_tokens < 0) return invalid_argument("mla_prefill: num_tokens is negative");
  if (p.num_tokens == 0) return Status::ok();
  if (p.num_seqs == 0) return invalid_argument("mla_prefill: num_tokens > 0 with no sequences");
  if (p.max_context < 1) return invalid_argument("mla_prefill: query tokens need max_context >= 1");
  if (p.num_tokens > INT32_MAX) return invalid_argument("mla_prefill: num_tokens exceeds int32");
  if (p.cu_q == nullptr || p.context_lens == nullptr || p.block_tables == nullptr || p.q == nullptr ||
      p.kv_b == nullptr || p.out == nullptr || p.workspace == nullptr) {
    return invalid_argument(
        "mla_prefill: a device pointer (cu_q, context_lens, block_tables, q, kv_b, out, workspace) is null");
  }
  if (!aligned16(p.workspace)) return invalid_argument("mla_prefill: workspace is not 16-byte aligned");
  if (p.host_cu_q != nullptr && p.host_context_lens != nullptr) {
    if (Status s = validate_host_tables(p); !s.is_ok()) return s;
  }
  int64_t block_rows = 0;
  const std::string why = naive_unavailable(p, &block_rows);
  bool naive = why.empty();
  if (form == MlaPrefillForm::kNaive && !naive) return invalid_argument("mla_prefill: naive form unavailable: " + why);
  if (form == MlaPrefillForm::kAuto && naive) naive = naive_estimated_faster(p, block_rows);
  if (!naive) return detail::mla_attention_launch(params, /*decode=*/false, "mla_prefill", stream);
  return run_naive(p, block_rows, stream);
}

}  // namespace deltaserve::kernels::cuda
