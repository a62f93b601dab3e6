#include "kernels/cpu/kda.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/basic_ops.hpp"
#include "kernels/cpu/thread_pool.hpp"

namespace deltaserve::kernels::cpu {
namespace {

// Tokens per parallel range of the token-local ops.
constexpr int64_t kTokenGrain = 16;
// Sub-tile of kda_chunked inside which pairwise decays are taken as exp(gc_t - gc_i) per pair; across
// sub-tiles they are split at the sub-tile start into two factors that are both <= 1 (never overflow).
constexpr int64_t kSubTile = 16;

// out[j] += scale * in[j], j < n. A plain loop GCC vectorises.
inline void axpy(float scale, const float* in, float* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] += scale * in[j];
}

// One head's view of KdaInputs: token t's vector starts at base + t * stride.
struct HeadView {
  const KdaInputs& in;
  int64_t head;
  const float* q(int64_t t) const { return in.q + (t * in.num_heads + head) * in.d_k; }
  const float* k(int64_t t) const { return in.k + (t * in.num_heads + head) * in.d_k; }
  const float* g(int64_t t) const { return in.g + (t * in.num_heads + head) * in.d_k; }
  const float* v(int64_t t) const { return in.v + (t * in.num_heads + head) * in.d_v; }
  float beta(int64_t t) const { return in.beta[t * in.num_heads + head]; }
};

// Scratch of one head's chunk loop, sized for chunk_size tokens.
struct ChunkScratch {
  ChunkScratch(int64_t chunk_size, int64_t d_k, int64_t d_v)
      : cumulative_g(static_cast<size_t>(chunk_size * d_k)),
        pair_decay(static_cast<size_t>(d_k)),
        decayed_k(static_cast<size_t>(chunk_size * d_k)),
        decayed_q(static_cast<size_t>(chunk_size * d_k)),
        inverse_decayed_k(static_cast<size_t>(chunk_size * d_k)),
        kk(static_cast<size_t>(chunk_size * chunk_size)),
        qk(static_cast<size_t>(chunk_size * chunk_size)),
        w(static_cast<size_t>(chunk_size * d_k)),
        u(static_cast<size_t>(chunk_size * d_v)) {}

  std::vector<float> cumulative_g;       // [C, d_k] gc_t = sum_{s <= t} g_s inside the chunk (<= 0)
  std::vector<float> pair_decay;         // [d_k]
  std::vector<float> decayed_k;          // [C, d_k] k_t ⊙ exp(gc_t - r_t), r_t = gc at t's sub-tile start
  std::vector<float> decayed_q;          // [C, d_k] q_t ⊙ exp(gc_t - r_t)
  std::vector<float> inverse_decayed_k;  // [C, d_k] k_i ⊙ exp(r_a - gc_i) for the current sub-tile a
  std::vector<float> kk;                 // [C, C] strictly lower: beta_t (k_t ⊙ exp(gc_t - gc_i)) · k_i
  std::vector<float> qk;                 // [C, C] lower incl. diagonal: (q_t ⊙ exp(gc_t - gc_i)) · k_i
  std::vector<float> w;                  // [C, d_k] (I + kk)^-1 diag(beta) (K ⊙ exp(gc))
  std::vector<float> u;                  // [C, d_v] (I + kk)^-1 diag(beta) V, then v_new = u - w S
};

// One chunk of n tokens starting at token `first` for one head; state [d_k, d_v] in/out; o rows written.
//
// With gc the inclusive cumulative log-decay inside the chunk and S0 the state at the chunk start,
// the recurrence unrolls to
//   u_t + sum_{i<t} kk[t,i] u_i = beta_t (v_t - S0^T (k_t ⊙ exp(gc_t)))      (the "v_new" rows)
//   o_t = S0^T (q_t ⊙ exp(gc_t)) + sum_{i<=t} qk[t,i] u_i
//   S_end = Diag(exp(gc_last)) S0 + sum_i (k_i ⊙ exp(gc_last - gc_i)) u_i^T
// The unit lower-triangular system (I + kk) is solved by forward substitution once for the two right-hand
// sides diag(beta) V and diag(beta) (K ⊙ exp(gc)) (the UT transform), giving u and w; v_new = u - w S0.
void kda_chunk(const HeadView& head, int64_t first, int64_t n, ChunkScratch& scratch, float* state, float* o) {
  const int64_t d_k = head.in.d_k;
  const int64_t d_v = head.in.d_v;
  float* gc = scratch.cumulative_g.data();
  float* kk = scratch.kk.data();
  float* qk = scratch.qk.data();
  float* w = scratch.w.data();
  float* u = scratch.u.data();
  // Row strides of the [C, C] matrices: n (the chunk's own size) keeps the used part contiguous.
  const int64_t stride = n;

  for (int64_t t = 0; t < n; ++t) {
    const float* g = head.g(first + t);
    float* gc_row = gc + t * d_k;
    const float* gc_previous = t > 0 ? gc + (t - 1) * d_k : nullptr;
    for (int64_t c = 0; c < d_k; ++c) gc_row[c] = (gc_previous != nullptr ? gc_previous[c] : 0.0f) + g[c];
  }
  // Reference log-decay r at the start of token t's sub-tile: gc just before it (0 for the first sub-tile).
  auto reference = [&](int64_t t, int64_t c) {
    const int64_t sub_tile_start = t / kSubTile * kSubTile;
    return sub_tile_start == 0 ? 0.0f : gc[(sub_tile_start - 1) * d_k + c];
  };
  for (int64_t t = 0; t < n; ++t) {
    const float* q = head.q(first + t);
    const float* k = head.k(first + t);
    for (int64_t c = 0; c < d_k; ++c) {
      const float decay = std::exp(gc[t * d_k + c] - reference(t, c));  // in (0, 1]
      scratch.decayed_q[t * d_k + c] = q[c] * decay;
      scratch.decayed_k[t * d_k + c] = k[c] * decay;
    }
  }

  // kk and qk, one sub-tile of rows at a time.
  for (int64_t tile_start = 0; tile_start < n; tile_start += kSubTile) {
    const int64_t tile_end = std::min(n, tile_start + kSubTile);
    // Columns before the sub-tile: exp(gc_t - gc_i) = exp(gc_t - r) · exp(r - gc_i), both factors <= 1.
    for (int64_t i = 0; i < tile_start; ++i) {
      const float* k = head.k(first + i);
      for (int64_t c = 0; c < d_k; ++c) {
        scratch.inverse_decayed_k[i * d_k + c] = k[c] * std::exp(reference(tile_start, c) - gc[i * d_k + c]);
      }
    }
    for (int64_t t = tile_start; t < tile_end; ++t) {
      const float beta = head.beta(first + t);
      for (int64_t i = 0; i < tile_start; ++i) {
        const float* inverse_k = scratch.inverse_decayed_k.data() + i * d_k;
        kk[t * stride + i] = beta * dot(scratch.decayed_k.data() + t * d_k, inverse_k, d_k);
        qk[t * stride + i] = dot(scratch.decayed_q.data() + t * d_k, inverse_k, d_k);
      }
      // Columns inside the sub-tile: the pairwise decay directly (exact for any g).
      const float* q = head.q(first + t);
      const float* k_t = head.k(first + t);
      for (int64_t i = tile_start; i <= t; ++i) {
        const float* k_i = head.k(first + i);
        float* pair_decay = scratch.pair_decay.data();
        for (int64_t c = 0; c < d_k; ++c) pair_decay[c] = std::exp(gc[t * d_k + c] - gc[i * d_k + c]) * k_i[c];
        qk[t * stride + i] = dot(q, pair_decay, d_k);
        kk[t * stride + i] = i < t ? beta * dot(k_t, pair_decay, d_k) : 0.0f;
      }
    }
  }

  // Forward substitution: rows of w and u, each minus the kk-weighted earlier rows.
  for (int64_t t = 0; t < n; ++t) {
    const float beta = head.beta(first + t);
    const float* k = head.k(first + t);
    const float* v = head.v(first + t);
    float* w_row = w + t * d_k;
    float* u_row = u + t * d_v;
    for (int64_t c = 0; c < d_k; ++c) w_row[c] = beta * k[c] * std::exp(gc[t * d_k + c]);
    for (int64_t j = 0; j < d_v; ++j) u_row[j] = beta * v[j];
    for (int64_t i = 0; i < t; ++i) {
      const float coefficient = kk[t * stride + i];
      axpy(-coefficient, w + i * d_k, w_row, d_k);
      axpy(-coefficient, u + i * d_v, u_row, d_v);
    }
  }

  // v_new = u - w S0 (overwrites u), and the inter-chunk part of o: (q ⊙ exp(gc)) S0.
  for (int64_t t = 0; t < n; ++t) {
    const float* q = head.q(first + t);
    float* u_row = u + t * d_v;
    float* o_row = o + ((first + t) * head.in.num_heads + head.head) * d_v;
    std::fill(o_row, o_row + d_v, 0.0f);
    for (int64_t c = 0; c < d_k; ++c) {
      const float* state_row = state + c * d_v;
      axpy(-w[t * d_k + c], state_row, u_row, d_v);
      axpy(q[c] * std::exp(gc[t * d_k + c]), state_row, o_row, d_v);
    }
  }
  // Intra-chunk part of o.
  for (int64_t t = 0; t < n; ++t) {
    float* o_row = o + ((first + t) * head.in.num_heads + head.head) * d_v;
    for (int64_t i = 0; i <= t; ++i) axpy(qk[t * stride + i], u + i * d_v, o_row, d_v);
  }
  // State: decay by the whole chunk, then add the chunk's keys decayed to its end.
  const float* gc_last = gc + (n - 1) * d_k;
  for (int64_t c = 0; c < d_k; ++c) {
    float* state_row = state + c * d_v;
    const float decay = std::exp(gc_last[c]);
    for (int64_t j = 0; j < d_v; ++j) state_row[j] *= decay;
    for (int64_t i = 0; i < n; ++i) {
      const float coefficient = head.k(first + i)[c] * std::exp(gc_last[c] - gc[i * d_k + c]);
      axpy(coefficient, u + i * d_v, state_row, d_v);
    }
  }
}

}  // namespace

void short_conv_silu(const float* x, const float* weight, float* tail, float* y, int64_t T, int64_t C, int K) {
  const int64_t tail_length = K - 1;
  // x_ext[s, c] for s in [0, tail_length + T): the tail, then x.
  auto extended = [&](int64_t s, int64_t c) {
    return s < tail_length ? tail[c * tail_length + s] : x[(s - tail_length) * C + c];
  };
  parallel_for(0, T, kTokenGrain, [&](int64_t token_begin, int64_t token_end) {
    for (int64_t t = token_begin; t < token_end; ++t) {
      for (int64_t c = 0; c < C; ++c) {
        float sum = 0.0f;
        for (int64_t j = 0; j < K; ++j) sum += weight[c * K + j] * extended(t + j, c);
        y[t * C + c] = silu(sum);
      }
    }
  });
  // New tail[j] = x_ext[T + j]; ascending j only reads entries not yet overwritten (T + j > j).
  if (T == 0) return;
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t j = 0; j < tail_length; ++j) tail[c * tail_length + j] = extended(T + j, c);
  }
}

void l2_normalize_heads(float* x, int64_t T, int64_t H, int64_t D, float eps, float scale) {
  parallel_for(0, T * H, kTokenGrain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      float* values = x + row * D;
      double sum_squares = 0.0;
      for (int64_t d = 0; d < D; ++d) sum_squares += static_cast<double>(values[d]) * values[d];
      const float factor = static_cast<float>(scale / std::sqrt(sum_squares + eps));
      for (int64_t d = 0; d < D; ++d) values[d] *= factor;
    }
  });
}

void kda_gate(const float* raw, const float* a_log, const float* dt_bias, float* g, int64_t T, int64_t H, int64_t D,
              std::optional<float> lower_bound) {
  parallel_for(0, T * H, kTokenGrain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t head = row % H;
      const float a = std::exp(a_log[head]);
      const float* bias = dt_bias + head * D;
      for (int64_t d = 0; d < D; ++d) {
        const float pre_activation = raw[row * D + d] + bias[d];
        g[row * D + d] =
            lower_bound.has_value() ? *lower_bound * sigmoid(a * pre_activation) : -a * softplus(pre_activation);
      }
    }
  });
}

void kda_recurrent(const KdaInputs& in, float* state, float* o) {
  const int64_t d_k = in.d_k;
  const int64_t d_v = in.d_v;
  parallel_for(0, in.num_heads, 1, [&](int64_t head_begin, int64_t head_end) {
    std::vector<float> u(static_cast<size_t>(d_v));
    for (int64_t h = head_begin; h < head_end; ++h) {
      const HeadView head{in, h};
      float* head_state = state + h * d_k * d_v;
      for (int64_t t = 0; t < in.num_tokens; ++t) {
        const float* q = head.q(t);
        const float* k = head.k(t);
        const float* g = head.g(t);
        const float* v = head.v(t);
        // S = Diag(exp(g)) S, and S^T k of the decayed state.
        std::fill(u.begin(), u.end(), 0.0f);
        for (int64_t c = 0; c < d_k; ++c) {
          float* row = head_state + c * d_v;
          const float decay = std::exp(g[c]);
          for (int64_t j = 0; j < d_v; ++j) row[j] *= decay;
          axpy(k[c], row, u.data(), d_v);
        }
        // u = beta (v - S^T k); S += k u^T; o = S^T q.
        const float beta = head.beta(t);
        for (int64_t j = 0; j < d_v; ++j) u[j] = beta * (v[j] - u[j]);
        float* o_row = o + (t * in.num_heads + h) * d_v;
        std::fill(o_row, o_row + d_v, 0.0f);
        for (int64_t c = 0; c < d_k; ++c) {
          float* row = head_state + c * d_v;
          axpy(k[c], u.data(), row, d_v);
          axpy(q[c], row, o_row, d_v);
        }
      }
    }
  });
}

void kda_chunked(const KdaInputs& in, float* state, float* o, int64_t chunk_size) {
  chunk_size = std::max<int64_t>(chunk_size, 1);
  parallel_for(0, in.num_heads, 1, [&](int64_t head_begin, int64_t head_end) {
    ChunkScratch scratch(chunk_size, in.d_k, in.d_v);
    for (int64_t h = head_begin; h < head_end; ++h) {
      const HeadView head{in, h};
      float* head_state = state + h * in.d_k * in.d_v;
      for (int64_t first = 0; first < in.num_tokens; first += chunk_size) {
        kda_chunk(head, first, std::min(chunk_size, in.num_tokens - first), scratch, head_state, o);
      }
    }
  });
}

void kda_gated_output_norm(const float* o, const float* gate, const float* norm_weight, float* out, int64_t T,
                           int64_t H, int64_t D, float eps) {
  parallel_for(0, T * H, kTokenGrain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* values = o + row * D;
      double sum_squares = 0.0;
      for (int64_t d = 0; d < D; ++d) sum_squares += static_cast<double>(values[d]) * values[d];
      const float inverse_rms =
          static_cast<float>(1.0 / std::sqrt(sum_squares / static_cast<double>(std::max<int64_t>(D, 1)) + eps));
      for (int64_t d = 0; d < D; ++d) {
        out[row * D + d] = values[d] * inverse_rms * norm_weight[d] * sigmoid(gate[row * D + d]);
      }
    }
  });
}

}  // namespace deltaserve::kernels::cpu
