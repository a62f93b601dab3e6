// Helpers of the GPU KDA decode tests (kda_decode_test.cpp, kda_spec_decode_test.cpp): one layer's weights and a
// batch of step inputs on host and device, the decode-step parameters over them, and the CPU chain the engine runs
// per token.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include "kernels/cpu/basic_ops.hpp"
#include "kernels/cpu/kda.hpp"
#include "kernels/cuda/kda/kda.hpp"
#include "kernels/cuda/tests/kda_test_util.hpp"

namespace deltaserve::kernels::cuda::test {

// One layer's weights, drawn in declaration order: conv weights [H*d, K], A_log [H] and dt_bias [H*d] N(0, 0.5),
// the output norm weight [d] N(1, 0.1); fp32 on host and device.
struct KdaDecodeWeights {
  KdaDecodeWeights(std::mt19937& rng, int H, int K)
      : q_w(normal_vector(rng, static_cast<size_t>(H) * kKdaHeadDim * K, 0.0f, 0.5f)),
        k_w(normal_vector(rng, q_w.size(), 0.0f, 0.5f)),
        v_w(normal_vector(rng, q_w.size(), 0.0f, 0.5f)),
        a_log(normal_vector(rng, H, 0.0f, 0.5f)),
        dt_bias(normal_vector(rng, static_cast<size_t>(H) * kKdaHeadDim, 0.0f, 0.5f)),
        norm_w(normal_vector(rng, kKdaHeadDim, 1.0f, 0.1f)),
        qw_d(q_w.size()),
        kw_d(k_w.size()),
        vw_d(v_w.size()),
        a_d(a_log.size()),
        dt_d(dt_bias.size()),
        nw_d(norm_w.size()) {
    qw_d.upload(q_w);
    kw_d.upload(k_w);
    vw_d.upload(v_w);
    a_d.upload(a_log);
    dt_d.upload(dt_bias);
    nw_d.upload(norm_w);
  }

  std::vector<float> q_w, k_w, v_w, a_log, dt_bias, norm_w;
  DeviceBuffer<float> qw_d, kw_d, vw_d, a_d, dt_d, nw_d;
};

// `rows` rows of step inputs, bf16-representable, drawn in declaration order: q, k, v [rows, H*d] N(0, 1), gate
// logits N(0, gate_stddev), beta logits [rows, H] and output-gate logits N(0, 1); fp32 on host, bf16 on device.
struct KdaDecodeInputs {
  KdaDecodeInputs(std::mt19937& rng, size_t rows, int H, float gate_stddev = 2.0f)
      : q_in(rounded(rng, rows * H * kKdaHeadDim, 1.0f)),
        k_in(rounded(rng, q_in.size(), 1.0f)),
        v_in(rounded(rng, q_in.size(), 1.0f)),
        gate_raw(rounded(rng, q_in.size(), gate_stddev)),
        beta_raw(rounded(rng, rows * H, 1.0f)),
        out_gate(rounded(rng, q_in.size(), 1.0f)),
        q_d(q_in.size()),
        k_d(k_in.size()),
        v_d(v_in.size()),
        gate_d(gate_raw.size()),
        beta_d(beta_raw.size()),
        og_d(out_gate.size()) {
    q_d.upload(to_bf16(q_in));
    k_d.upload(to_bf16(k_in));
    v_d.upload(to_bf16(v_in));
    gate_d.upload(to_bf16(gate_raw));
    beta_d.upload(to_bf16(beta_raw));
    og_d.upload(to_bf16(out_gate));
  }

  static std::vector<float> rounded(std::mt19937& rng, size_t n, float stddev) {
    std::vector<float> x = normal_vector(rng, n, 0.0f, stddev);
    for (float& value : x) value = bf16_round(value);
    return x;
  }

  std::vector<float> q_in, k_in, v_in, gate_raw, beta_raw, out_gate;
  DeviceBuffer<__nv_bfloat16> q_d, k_d, v_d, gate_d, beta_d, og_d;
};

// The step parameters over these inputs and weights (head dim 128); the caller sets conv_state, state and out.
inline KdaDecodeParams kda_decode_params(int batch, int H, int K, int num_slots, const int32_t* slots,
                                         const KdaDecodeInputs& in, const KdaDecodeWeights& w,
                                         std::optional<float> lower_bound, float rms_eps) {
  KdaDecodeParams p;
  p.batch = batch;
  p.num_heads = H;
  p.conv_kernel = K;
  p.num_slots = num_slots;
  p.slots = slots;
  p.q_in = in.q_d.get();
  p.k_in = in.k_d.get();
  p.v_in = in.v_d.get();
  p.gate_raw = in.gate_d.get();
  p.beta_raw = in.beta_d.get();
  p.out_gate = in.og_d.get();
  p.q_conv_weight = w.qw_d.get();
  p.k_conv_weight = w.kw_d.get();
  p.v_conv_weight = w.vw_d.get();
  p.a_log = w.a_d.get();
  p.dt_bias = w.dt_d.get();
  p.lower_bound = lower_bound;
  p.o_norm_weight = w.nw_d.get();
  p.rms_eps = rms_eps;
  return p;
}

// The CPU chain the engine runs for input row `row` (short_conv_silu, l2_normalize_heads, kda_gate, sigmoid,
// kda_recurrent, kda_gated_output_norm): advances `tails` [3, H*d, K-1] and `state` [H, d, d] and writes
// out [H*d].
inline void cpu_decode_token(const KdaDecodeInputs& in, const KdaDecodeWeights& w, size_t row, int H, int K,
                             std::optional<float> lower_bound, float eps, float* tails, float* state, float* out) {
  constexpr int kD = kKdaHeadDim;
  const int64_t C = static_cast<int64_t>(H) * kD;
  std::vector<float> q(C), k(C), v(C), g(C), o(C);
  cpu::short_conv_silu(&in.q_in[row * C], w.q_w.data(), tails, q.data(), 1, C, K);
  cpu::short_conv_silu(&in.k_in[row * C], w.k_w.data(), tails + C * (K - 1), k.data(), 1, C, K);
  cpu::short_conv_silu(&in.v_in[row * C], w.v_w.data(), tails + 2 * C * (K - 1), v.data(), 1, C, K);
  cpu::l2_normalize_heads(q.data(), 1, H, kD, 1e-6f, 1.0f / std::sqrt(static_cast<float>(kD)));
  cpu::l2_normalize_heads(k.data(), 1, H, kD, 1e-6f, 1.0f);
  cpu::kda_gate(&in.gate_raw[row * C], w.a_log.data(), w.dt_bias.data(), g.data(), 1, H, kD, lower_bound);
  std::vector<float> beta(&in.beta_raw[row * H], &in.beta_raw[row * H] + H);
  cpu::sigmoid_inplace(beta.data(), H);
  const cpu::KdaInputs inputs{q.data(), k.data(), v.data(), g.data(), beta.data(), 1, H, kD, kD};
  cpu::kda_recurrent(inputs, state, o.data());
  cpu::kda_gated_output_norm(o.data(), &in.out_gate[row * C], w.norm_w.data(), out, 1, H, kD, eps);
}

}  // namespace deltaserve::kernels::cuda::test
