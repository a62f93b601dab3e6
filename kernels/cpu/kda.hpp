// Kimi Delta Attention, CPU reference (fp32). Layouts are token-major: [T, H, D] means
// element (t, h, d) at ((t * H) + h) * D + d. Per-head state S is [H, d_k, d_v] fp32.
// Math: shared/spec/model.md §3 (docs/model-math.md once written).
#pragma once

#include <cstdint>
#include <optional>

namespace deltaserve::kernels::cpu {

// Short causal depthwise convolution followed by SiLU.
//   x:      [T, C] inputs (projections W x)
//   weight: [C, K] (the checkpoint's [C, 1, K]); output channel c at token t is
//           sum_{j=0}^{K-1} weight[c, j] * x_ext[t + j, c], where x_ext = tail ‖ x (causal, last tap = current token)
//   tail:   [C, K-1] in/out, the previous K-1 inputs per channel, oldest first (zeros for a new request);
//           on return it holds the last K-1 inputs of tail ‖ x.
//   y:      [T, C] = SiLU(conv). y may not alias x. K >= 1; T = 0 leaves tail unchanged.
// Splitting a sequence over several calls (tail carried) gives bit-identical y to one call.
void short_conv_silu(const float* x, const float* weight, float* tail, float* y, int64_t T, int64_t C, int K);

// Per-head L2 normalisation in place: x[t,h,:] *= scale * rsqrt(sum(x[t,h,:]^2) + eps). x: [T, H, D].
void l2_normalize_heads(float* x, int64_t T, int64_t H, int64_t D, float eps, float scale);

// KDA log-decay gate. raw: [T, H, D] = f_b(f_a(x)); a_log: [H]; dt_bias: [H * D]; g: [T, H, D] out.
//   no bound:   g = -exp(a_log[h]) * softplus(raw + dt_bias)
//   bound lb:   g = lb * sigmoid(exp(a_log[h]) * (raw + dt_bias))        (lb < 0, e.g. -5)
void kda_gate(const float* raw, const float* a_log, const float* dt_bias, float* g, int64_t T, int64_t H, int64_t D,
              std::optional<float> lower_bound);

// Inputs of one KDA layer for T tokens of one request (all fp32, token-major):
struct KdaInputs {
  const float* q;     // [T, H, d_k], already L2-normalised and scaled by d_k^-0.5
  const float* k;     // [T, H, d_k], L2-normalised
  const float* v;     // [T, H, d_v]
  const float* g;     // [T, H, d_k], log-decay per key channel, <= 0
  const float* beta;  // [T, H], in (0, 1)
  int64_t num_tokens;
  int64_t num_heads;
  int64_t d_k;
  int64_t d_v;
};

// Token-by-token recurrence (the definition):
//   S = Diag(exp(g_t)) S;  u = beta_t (v_t - S^T k_t);  S += k_t u^T;  o_t = S^T q_t
// state: [H, d_k, d_v] in/out (row = key channel). o: [T, H, d_v] out, must not alias the inputs.
// T = 0 leaves state unchanged. Calls on consecutive pieces with state carried equal one call, bit for bit.
void kda_recurrent(const KdaInputs& in, float* state, float* o);

// Chunked prefill in the WY/UT form (chunk of `chunk_size` tokens, >= 1; last chunk may be partial).
// Same contract and result as kda_recurrent up to fp32 rounding (tests: <= 1e-5 relative). Every exponent
// it evaluates is <= 0 (pair decays are split at 16-token sub-tile starts, never as exp(gc)·exp(-gc)), so
// any g <= 0 is safe, with or without a lower bound. Parallel over heads; per head and chunk of C tokens
// O(C·d_k·(d_k + d_v) + C²·(d_k + d_v)) work plus about 9·C·d_k exponentials.
void kda_chunked(const KdaInputs& in, float* state, float* o, int64_t chunk_size = 64);

// Gated output norm per head: out[t,h,:] = rms_norm(o[t,h,:]) * norm_weight ⊙ sigmoid(gate[t,h,:]).
// o, gate, out: [T, H, D]; norm_weight: [D]. out may alias o.
void kda_gated_output_norm(const float* o, const float* gate, const float* norm_weight, float* out, int64_t T,
                           int64_t H, int64_t D, float eps);

}  // namespace deltaserve::kernels::cpu
