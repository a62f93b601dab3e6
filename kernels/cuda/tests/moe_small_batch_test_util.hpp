// The small-batch MoE layer cases of the GPU tests (moe_small_batch_route_test.cpp, moe_small_batch_test.cpp): host
// inputs, the device buffers and params of one case (outputs NaN/sentinel-poisoned past what the launchers may
// write), what the layer added to the residual, a CPU reference of the layer (float sums of bf16 weights and inputs,
// the activation rounded to bf16 as the GPU stores it) and the chain of separate launches it replaces (moe_route,
// moe_plan, moe_gather_rows, moe_expert_ffn_decode, moe_combine; the shared expert as a one-expert pass of the same
// kernels).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/basic_ops.hpp"
#include "kernels/cuda/moe/moe.hpp"
#include "kernels/cuda/tests/kda_test_util.hpp"
#include "kernels/cuda/tests/moe_test_util.hpp"

namespace deltaserve::kernels::cuda::test {

inline constexpr int kPad = 3;            // poisoned elements past every 1-D output
inline constexpr int64_t kPadRows = 2;    // poisoned rows past activated / shared_activated / x_sorted
inline constexpr int64_t kStrideGap = 4;  // residual row stride = hidden + 4, the gap NaN-poisoned

struct SmallCase {
  int E = 8, k = 2, groups = 1, top_k_groups = 1;
  int64_t hidden = 64, inter = 32, shared_inter = 0;  // shared_inter 0: no shared expert
  int64_t T = 1;
  GluKind glu = GluKind::kSwiGlu;
  bool renormalize = true;
  bool special = false;  // tied router rows, a NaN and an infinite router weight, a token whose router input has a NaN
  bool graph = false;
  uint32_t seed = 1;
};

inline std::string describe_case(const SmallCase& c) {
  return "E=" + std::to_string(c.E) + " k=" + std::to_string(c.k) + " groups=" + std::to_string(c.groups) + "/" +
         std::to_string(c.top_k_groups) + " hidden=" + std::to_string(c.hidden) + " I=" + std::to_string(c.inter) +
         " I_shared=" + std::to_string(c.shared_inter) + " T=" + std::to_string(c.T) +
         (c.glu == GluKind::kSitu ? " situ" : " swiglu") + (c.special ? " special-logits" : "");
}

// Host inputs of one case.
struct HostLayer {
  std::vector<float> x_f32, router, bias, residual0;  // residual0: [T, hidden + gap], the gap NaN
  std::vector<__nv_bfloat16> x, shared_gate_up, shared_down;
};

inline HostLayer make_host(const SmallCase& c) {
  std::mt19937 rng(c.seed);
  HostLayer h;
  const int64_t W = c.hidden;
  h.x_f32 = normal_vector(rng, c.T * W);
  h.x = to_bf16(h.x_f32);
  // Router weights: logits of standard deviation ~2 (well spread sigmoids, like a trained router's).
  h.router = normal_vector(rng, static_cast<size_t>(c.E) * W, 0.0f, 2.0f / std::sqrt(static_cast<float>(W)));
  h.bias = normal_vector(rng, c.E, 0.0f, 0.05f);
  for (int e = 0; e < c.E; e += 3) h.bias[e] = 0.01f;  // duplicated bias values: ties on tied logits
  if (c.special && c.E >= 4) {
    // Experts 0/1 and 2/3 have identical router rows: bitwise-equal logits (the same sums), ties broken by id.
    std::copy_n(&h.router[0], W, &h.router[W]);
    std::copy_n(&h.router[2 * W], W, &h.router[3 * W]);
    h.bias[1] = h.bias[0];
    h.router[static_cast<size_t>(c.E / 2) * W + 1] = kNaN;  // a NaN logit for every token
    h.router[static_cast<size_t>(c.E - 1) * W] = INFINITY;  // +-inf logits (sign of x[t, 0])
    if (c.T >= 3) h.x_f32[(c.T - 1) * W + W / 2] = kNaN;    // the last token: every logit NaN
  }
  if (c.shared_inter > 0) {
    h.shared_gate_up.resize(static_cast<size_t>(2 * c.shared_inter * W));
    h.shared_down.resize(static_cast<size_t>(W * c.shared_inter));
    fill_uniform_bf16(h.shared_gate_up, c.seed * 7 + 3, std::sqrt(3.0f / static_cast<float>(W)));
    fill_uniform_bf16(h.shared_down, c.seed * 7 + 4, std::sqrt(3.0f / static_cast<float>(c.shared_inter)) * 2.0f);
  }
  h.residual0.assign(c.T * (W + kStrideGap), kNaN);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t t = 0; t < c.T; ++t) {
    for (int64_t d = 0; d < W; ++d) h.residual0[t * (W + kStrideGap) + d] = normal(rng);
  }
  return h;
}

// Device buffers and params of one case (the layer).
struct DeviceLayer {
  SmallCase c;
  const ExpertWeightsHost& experts;  // expert_weights_host of the case's shape
  int64_t R = 0;
  DeviceBuffer<float> x_f32, router, bias, logits, weights, residual;
  DeviceBuffer<__nv_bfloat16> x, gate_up, down, shared_gate_up, shared_down, x_sorted, activated, shared_activated;
  DeviceBuffer<int32_t> ids, offsets, sorted, pos;
  DeviceBuffer<unsigned char> workspace;
  DeviceBuffer<unsigned int> counter;
  MoeSmallBatchParams p;

  DeviceLayer(const SmallCase& cc, const HostLayer& h)
      : c(cc),
        experts(expert_weights_host(cc.E, cc.hidden, cc.inter)),
        R(cc.T * cc.k),
        x_f32(h.x_f32.size()),
        router(h.router.size()),
        bias(h.bias.size()),
        logits(cc.T * cc.E + kPad),
        weights(R + kPad),
        residual(h.residual0.size() + kPad),
        x(h.x.size()),
        gate_up(experts.gate_up.size()),
        down(experts.down.size()),
        shared_gate_up(std::max<size_t>(h.shared_gate_up.size(), 1)),
        shared_down(std::max<size_t>(h.shared_down.size(), 1)),
        x_sorted((R + kPadRows) * cc.hidden),
        activated((R + kPadRows) * cc.inter),
        shared_activated((cc.T + kPadRows) * std::max<int64_t>(cc.shared_inter, 1)),
        ids(R + kPad),
        offsets(cc.E + 1 + kPad),
        sorted(R + kPad),
        pos(R + kPad),
        workspace(moe_small_batch_workspace_bytes(cc.T, cc.k, cc.E, cc.hidden)),
        counter(1) {
    x_f32.upload(h.x_f32);
    router.upload(h.router);
    bias.upload(h.bias);
    x.upload(h.x);
    gate_up.upload(experts.gate_up);
    down.upload(experts.down);
    if (c.shared_inter > 0) {
      shared_gate_up.upload(h.shared_gate_up);
      shared_down.upload(h.shared_down);
    }
    counter.upload({0u});
    p.routing.num_experts = c.E;
    p.routing.top_k = c.k;
    p.routing.num_groups = c.groups;
    p.routing.top_k_groups = c.top_k_groups;
    p.routing.renormalize = c.renormalize;
    p.routing.routed_scaling_factor = 2.446f;
    p.tokens = c.T;
    p.hidden = c.hidden;
    p.x_f32 = x_f32.get();
    p.x_f32_stride = c.hidden;
    p.router = router.get();
    p.correction_bias = bias.get();
    p.x = x.get();
    p.x_stride = c.hidden;
    p.experts = {gate_up.get(), down.get(), c.E, c.hidden, c.inter};
    if (c.shared_inter > 0) {
      p.shared_gate_up = shared_gate_up.get();
      p.shared_down = shared_down.get();
      p.shared_intermediate = c.shared_inter;
    }
    p.glu = c.glu;
    p.logits = logits.get();
    p.expert_ids = ids.get();
    p.weights = weights.get();
    p.plan.expert_offsets = offsets.get();
    p.plan.sorted_assignments = sorted.get();
    p.plan.assignment_pos = pos.get();
    p.x_sorted = x_sorted.get();
    p.activated = activated.get();
    p.shared_activated = c.shared_inter > 0 ? shared_activated.get() : nullptr;
    p.residual = residual.get();
    p.residual_stride = c.hidden + kStrideGap;
    p.workspace = workspace.get();
    p.workspace_bytes = workspace.size();
    p.counter = counter.get();
  }

  void poison(const HostLayer& h) {
    logits.upload(std::vector<float>(logits.size(), kNaN));
    weights.upload(std::vector<float>(weights.size(), kNaN));
    ids.upload(std::vector<int32_t>(ids.size(), kSentinel));
    offsets.upload(std::vector<int32_t>(offsets.size(), kSentinel));
    sorted.upload(std::vector<int32_t>(sorted.size(), kSentinel));
    pos.upload(std::vector<int32_t>(pos.size(), kSentinel));
    x_sorted.upload(std::vector<__nv_bfloat16>(x_sorted.size(), bf16_nan()));
    activated.upload(std::vector<__nv_bfloat16>(activated.size(), bf16_nan()));
    shared_activated.upload(std::vector<__nv_bfloat16>(shared_activated.size(), bf16_nan()));
    // Every workspace byte 0xff: nothing may read the workspace before launch 1 writes it.
    workspace.upload(std::vector<unsigned char>(workspace.size(), 0xffu));
    reset_residual(h);
  }
  void reset_residual(const HostLayer& h) {
    std::vector<float> r = h.residual0;
    r.resize(residual.size(), kNaN);
    residual.upload(r);
  }
  void expect_counter_zero(const std::string& what) {
    EXPECT_EQ(counter.download()[0], 0u) << what << ": the grid counter was not left at 0";
  }
  // Poisons the outputs and runs `launch` (moe_small_batch_route or moe_small_batch_layer) once, eagerly; the
  // counter must be back at 0.
  void run_poisoned(const HostLayer& h, Status (*launch)(const MoeSmallBatchParams&, cudaStream_t),
                    const std::string& what) {
    poison(h);
    const Status status = launch(p, 0);
    ASSERT_TRUE(status) << status.to_string();
    DS_CUDA_OK(cudaDeviceSynchronize());
    expect_counter_zero(what);
  }
};

// What the layer added to the residual, [T, hidden]; checks the stride gaps and the end stayed NaN.
inline std::vector<float> residual_delta(const DeviceBuffer<float>& residual, const HostLayer& h, const SmallCase& c,
                                         const std::string& what) {
  const std::vector<float> got = residual.download();
  const int64_t stride = c.hidden + kStrideGap;
  std::vector<float> delta(c.T * c.hidden);
  int gap_writes = 0;
  for (int64_t t = 0; t < c.T; ++t) {
    for (int64_t d = 0; d < stride; ++d) {
      const float v = got[t * stride + d];
      if (d < c.hidden) {
        delta[t * c.hidden + d] = v - h.residual0[t * stride + d];
      } else if (!std::isnan(v)) {
        ++gap_writes;
      }
    }
  }
  for (size_t i = h.residual0.size(); i < got.size(); ++i) gap_writes += std::isnan(got[i]) ? 0 : 1;
  EXPECT_EQ(gap_writes, 0) << what << ": the residual's stride gaps or its end were written";
  return delta;
}

// CPU reference of the layer's addition for the routing in ids / w: Σ_j w_j · expert_j(x_t) + shared(x_t).
inline std::vector<float> reference_delta(const SmallCase& c, const HostLayer& h, const ExpertWeightsHost& experts,
                                          const std::vector<int32_t>& ids, const std::vector<float>& w) {
  const int64_t W = c.hidden;
  // One FFN on bf16 weights: gate_up [2 In, W], down [W, In]; the activation rounded to bf16.
  auto ffn = [&](const __nv_bfloat16* gu, const __nv_bfloat16* dn, int64_t In, const float* x, float* y) {
    std::vector<float> gate(In), up(In), act(In);
    for (int64_t j = 0; j < In; ++j) {
      float g = 0.0f, u = 0.0f;
      const __nv_bfloat16* gr = gu + j * W;
      const __nv_bfloat16* ur = gu + (In + j) * W;
      for (int64_t i = 0; i < W; ++i) {
        g += __bfloat162float(gr[i]) * x[i];
        u += __bfloat162float(ur[i]) * x[i];
      }
      gate[j] = g;
      up[j] = u;
    }
    if (c.glu == GluKind::kSitu) {
      cpu::situ_glu(gate.data(), up.data(), act.data(), In, 4.0f, 25.0f);
    } else {
      cpu::swiglu(gate.data(), up.data(), act.data(), In);
    }
    for (float& v : act) v = bf16_round(v);
    for (int64_t d = 0; d < W; ++d) {
      float s = 0.0f;
      const __nv_bfloat16* dr = dn + d * In;
      for (int64_t j = 0; j < In; ++j) s += __bfloat162float(dr[j]) * act[j];
      y[d] = s;
    }
  };
  std::vector<float> out(c.T * W, 0.0f), y(W), xt(W);
  const int64_t I = c.inter;
  for (int64_t t = 0; t < c.T; ++t) {
    for (int64_t i = 0; i < W; ++i) xt[i] = __bfloat162float(h.x[t * W + i]);
    for (int j = 0; j < c.k; ++j) {
      const int64_t e = ids[t * c.k + j];
      ffn(&experts.gate_up[e * 2 * I * W], &experts.down[e * W * I], I, xt.data(), y.data());
      for (int64_t d = 0; d < W; ++d) out[t * W + d] += w[t * c.k + j] * y[d];
    }
    if (c.shared_inter > 0) {
      ffn(h.shared_gate_up.data(), h.shared_down.data(), c.shared_inter, xt.data(), y.data());
      for (int64_t d = 0; d < W; ++d) out[t * W + d] += y[d];
    }
  }
  return out;
}

// The separate launches on the layer's logits: moe_route, moe_plan, moe_gather_rows, moe_expert_ffn_decode,
// moe_combine (accumulate into the residual), then the shared expert as a one-expert pass of the same kernels.
struct ChainBuffers {
  DeviceBuffer<int32_t> ids;
  DeviceBuffer<float> weights;
  PlanBuffers plan;
  DeviceBuffer<__nv_bfloat16> x_sorted, activated, shared_activated;
  DeviceBuffer<float> y_sorted, shared_y, ones;
  DeviceBuffer<int32_t> shared_offsets, identity;
  ChainBuffers(const SmallCase& c)
      : ids(c.T * c.k),
        weights(c.T * c.k),
        plan(c.T, c.k, c.E, 0),
        x_sorted(c.T * c.k * c.hidden),
        activated(c.T * c.k * c.inter),
        shared_activated(c.T * std::max<int64_t>(c.shared_inter, 1)),
        y_sorted(c.T * c.k * c.hidden),
        shared_y(c.T * c.hidden),
        ones(c.T),
        shared_offsets(2),
        identity(c.T) {
    ones.upload(std::vector<float>(c.T, 1.0f));
    shared_offsets.upload({0, static_cast<int32_t>(c.T)});
    std::vector<int32_t> iota(c.T);
    std::iota(iota.begin(), iota.end(), 0);
    identity.upload(iota);
  }
};

// The routed experts of the separate launches on `logits`: moe_route, moe_plan, moe_gather_rows,
// moe_expert_ffn_decode, moe_combine accumulating into the residual.
inline Status run_routed_chain(const SmallCase& c, const MoeSmallBatchParams& p, ChainBuffers& b, const float* logits,
                               cudaStream_t stream) {
  const int64_t T = c.T, W = c.hidden;
  Status s = moe_route(p.routing, logits, p.correction_bias, T, b.ids.get(), b.weights.get(), stream);
  if (s) s = moe_plan(b.ids.get(), T, c.k, c.E, b.plan.plan, b.plan.workspace.get(), b.plan.workspace_bytes, stream);
  if (s) s = moe_gather_rows(p.x, W, b.plan.plan, T, c.k, W, b.x_sorted.get(), stream);
  MoeFfnParams f;
  f.weights = p.experts;
  f.glu = c.glu;
  f.rows = T * c.k;
  f.x_sorted = b.x_sorted.get();
  f.expert_offsets = b.plan.plan.expert_offsets;
  f.activated = b.activated.get();
  f.y_sorted = b.y_sorted.get();
  if (s) s = moe_expert_ffn_decode(f, stream);
  if (s)
    s = moe_combine(b.y_sorted.get(), b.plan.plan, b.weights.get(), T, c.k, W, true, p.residual, p.residual_stride,
                    stream);
  return s;
}

inline Status run_chain(const SmallCase& c, DeviceLayer& d, ChainBuffers& b, const float* logits, cudaStream_t stream) {
  const MoeSmallBatchParams& p = d.p;
  const int64_t T = c.T, W = c.hidden;
  Status s = run_routed_chain(c, p, b, logits, stream);
  if (s && c.shared_inter > 0) {
    MoeFfnParams g;
    g.weights = {p.shared_gate_up, p.shared_down, 1, W, c.shared_inter};
    g.glu = c.glu;
    g.rows = T;
    g.x_sorted = p.x;
    g.expert_offsets = b.shared_offsets.get();
    g.activated = b.shared_activated.get();
    g.y_sorted = b.shared_y.get();
    s = moe_expert_ffn_decode(g, stream);
    MoePlan shared_plan;
    shared_plan.expert_offsets = b.shared_offsets.get();
    shared_plan.sorted_assignments = b.identity.get();
    shared_plan.assignment_pos = b.identity.get();
    if (s)
      s = moe_combine(b.shared_y.get(), shared_plan, b.ones.get(), T, 1, W, true, p.residual, p.residual_stride,
                      stream);
  }
  return s;
}

}  // namespace deltaserve::kernels::cuda::test
