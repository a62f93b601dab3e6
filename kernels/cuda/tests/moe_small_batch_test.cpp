// GPU small-batch MoE layer (moe_small_batch_route / moe_small_batch_experts, moe.hpp) vs the CPU router, the
// previous GPU chain and a CPU reference of the whole layer, ctest label gpu.
// Oracles and tolerances:
//   logits: a double host GEMM, |a - b| <= 1e-5 · Σ_h |x_h · w_h| (fp32 sums in another order);
//   ids, weights: cpu::moe_route on the GPU's own logits: ids exact, weights within 1e-6 relative (same fp32 ops);
//   plan, x_sorted: moe_plan and moe_gather_rows on the same ids: identical, as the contract says;
//   layer (what it adds to the residual): vs the previous chain on the same logits (moe_route, moe_plan,
//   moe_gather_rows, moe_expert_ffn_decode, moe_combine; the shared expert as a one-expert pass of the same kernels)
//   and vs a CPU reference (float sums of bf16 weights and inputs, the activation rounded to bf16 as the GPU stores
//   it): relative L2 <= 2e-3 and max |a - b| <= 2e-2 · rms(ref), the bounds of moe_test.cpp (fp32 sums in other
//   orders, an occasional one-ulp bf16 flip of an activation near a rounding tie); eager vs eager and graph replay
//   vs eager: bitwise (deterministic: no atomics in any sum).
// Outputs are NaN/sentinel-poisoned past what the launchers may write and checked afterwards; the grid counter must
// be back at 0 after every launch.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/basic_ops.hpp"
#include "kernels/cpu/moe.hpp"
#include "kernels/cuda/tests/gpu_test_graph.hpp"
#include "kernels/cuda/tests/kda_test_util.hpp"
#include "kernels/cuda/moe/moe.hpp"
#include "kernels/cuda/tests/moe_test_util.hpp"
#include "kernels/cuda/ops/ops.hpp"
#include "kernels/cuda/gemm/small_batch.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

constexpr int kPad = 3;            // poisoned elements past every 1-D output
constexpr int64_t kPadRows = 2;    // poisoned rows past activated / shared_activated / x_sorted
constexpr int64_t kStrideGap = 4;  // residual row stride = hidden + 4, the gap NaN-poisoned

struct SmallCase {
  int E = 8, k = 2, groups = 1, top_k_groups = 1;
  int64_t hidden = 64, inter = 32, shared_inter = 0;  // shared_inter 0: no shared expert
  int64_t T = 1;
  GluKind glu = GluKind::kSwiGlu;
  bool renormalize = true;
  bool special = false;  // tied router rows, a NaN and an infinite router weight, a token whose router input has a NaN
  bool graph = false;
  uint32_t seed = 1;
  MoeSmallBatchKernel kernel = MoeSmallBatchKernel::kV2;
};

constexpr MoeSmallBatchKernel kBothKernels[] = {MoeSmallBatchKernel::kV1, MoeSmallBatchKernel::kV2};

SmallCase with_kernel(SmallCase c, MoeSmallBatchKernel kernel) {
  c.kernel = kernel;
  return c;
}

std::string describe_case(const SmallCase& c) {
  return "E=" + std::to_string(c.E) + " k=" + std::to_string(c.k) + " groups=" + std::to_string(c.groups) + "/" +
         std::to_string(c.top_k_groups) + " hidden=" + std::to_string(c.hidden) + " I=" + std::to_string(c.inter) +
         " I_shared=" + std::to_string(c.shared_inter) + " T=" + std::to_string(c.T) +
         (c.glu == GluKind::kSitu ? " situ" : " swiglu") + (c.special ? " special-logits" : "") + " kernel " +
         moe_small_batch_kernel_name(c.kernel);
}

// Host inputs of one case.
struct HostLayer {
  std::vector<float> x_f32, router, bias, residual0;  // residual0: [T, hidden + gap], the gap NaN
  std::vector<__nv_bfloat16> x, shared_gate_up, shared_down;
};

HostLayer make_host(const SmallCase& c) {
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

// Device buffers and params of one case (the new path).
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
    p.kernel = c.kernel;
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
    // Every workspace byte 0xff: what launch 1 must initialise (the split down launch's arrival counts) it does.
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
std::vector<float> residual_delta(const DeviceBuffer<float>& residual, const HostLayer& h, const SmallCase& c,
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
std::vector<float> reference_delta(const SmallCase& c, const HostLayer& h, const ExpertWeightsHost& experts,
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

// The previous chain on the new path's logits: moe_route, moe_plan, moe_gather_rows, moe_expert_ffn_decode,
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

// The routed experts of the previous chain on `logits`: moe_route, moe_plan, moe_gather_rows,
// moe_expert_ffn_decode, moe_combine accumulating into the residual.
Status run_routed_chain(const SmallCase& c, const MoeSmallBatchParams& p, ChainBuffers& b, const float* logits,
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

Status run_chain(const SmallCase& c, DeviceLayer& d, ChainBuffers& b, const float* logits, cudaStream_t stream) {
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
    g.use_reference_path = true;  // the GEMV kernels at any row count
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

// ---- launch 1: logits, routing, plan, gather ------------------------------------------------------------------

void run_route_case_with(const SmallCase& c) {
  SCOPED_TRACE("route " + describe_case(c));
  const HostLayer h = make_host(c);
  DeviceLayer d(c, h);
  ASSERT_NO_FATAL_FAILURE(d.run_poisoned(h, moe_small_batch_route, "route"));
  const int64_t T = c.T, E = c.E, k = c.k, R = T * k, W = c.hidden;

  // Logits against a double GEMM.
  const std::vector<float> logits = d.logits.download();
  int logit_failures = 0;
  for (int64_t t = 0; t < T && logit_failures < 5; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      double sum = 0.0, magnitude = 0.0;
      for (int64_t i = 0; i < W; ++i) {
        const double term = static_cast<double>(h.x_f32[t * W + i]) * h.router[e * W + i];
        sum += term;
        magnitude += std::fabs(term);
      }
      const float got = logits[t * E + e];
      const bool ok = std::isnan(sum)   ? std::isnan(got)
                      : std::isinf(sum) ? got == static_cast<float>(sum)
                                        : std::fabs(got - sum) <= 1e-5 * magnitude + 1e-30;
      if (!ok && ++logit_failures <= 5) {
        ADD_FAILURE() << "logit token " << t << " expert " << e << ": " << got << " vs " << sum;
      }
    }
  }
  for (int i = 0; i < kPad; ++i) EXPECT_TRUE(std::isnan(logits[T * E + i])) << "logits written past T * E";

  // Routing: cpu::moe_route on the GPU's logits.
  const std::vector<int32_t> ids = d.ids.download();
  const std::vector<float> w = d.weights.download();
  const cpu::MoeRouting routing{c.E, c.k, c.groups, c.top_k_groups, c.renormalize, 2.446f};
  std::vector<int32_t> ref_ids(k);
  std::vector<float> ref_w(k);
  for (int64_t t = 0; t < T; ++t) {
    cpu::moe_route(routing, &logits[t * E], h.bias.data(), ref_ids.data(), ref_w.data());
    for (int64_t j = 0; j < k; ++j) {
      ASSERT_EQ(ids[t * k + j], ref_ids[j]) << "token " << t << " choice " << j;
      ASSERT_TRUE(same_float(w[t * k + j], ref_w[j], 1e-6f))
          << "token " << t << " choice " << j << ": weight " << w[t * k + j] << " vs " << ref_w[j];
    }
  }
  for (int i = 0; i < kPad; ++i) {
    EXPECT_EQ(ids[R + i], kSentinel) << "expert_ids written past T * k";
    EXPECT_TRUE(std::isnan(w[R + i])) << "weights written past T * k";
  }

  // Plan and gather: identical to moe_plan and moe_gather_rows on the same ids.
  PlanBuffers ref(T, c.k, c.E, 0);
  ASSERT_TRUE(moe_plan(d.ids.get(), T, c.k, c.E, ref.plan, ref.workspace.get(), ref.workspace_bytes, 0));
  DeviceBuffer<__nv_bfloat16> ref_rows(R * W);
  ASSERT_TRUE(moe_gather_rows(d.x.get(), W, ref.plan, T, c.k, W, ref_rows.get(), 0));
  DS_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<int32_t> offsets = d.offsets.download(), sorted = d.sorted.download(), pos = d.pos.download();
  const std::vector<int32_t> ref_offsets = ref.offsets.download(), ref_sorted = ref.sorted.download(),
                             ref_pos = ref.pos.download();
  for (int64_t e = 0; e <= E; ++e) ASSERT_EQ(offsets[e], ref_offsets[e]) << "expert_offsets[" << e << "]";
  for (int64_t a = 0; a < R; ++a) {
    ASSERT_EQ(sorted[a], ref_sorted[a]) << "sorted_assignments[" << a << "]";
    ASSERT_EQ(pos[a], ref_pos[a]) << "assignment_pos[" << a << "]";
  }
  for (int i = 0; i < kPad; ++i) {
    EXPECT_EQ(offsets[E + 1 + i], kSentinel) << "expert_offsets written past E";
    EXPECT_EQ(sorted[R + i], kSentinel) << "sorted_assignments written past T * k";
    EXPECT_EQ(pos[R + i], kSentinel) << "assignment_pos written past T * k";
  }
  const std::vector<__nv_bfloat16> rows = d.x_sorted.download(), ref_rows_h = ref_rows.download();
  for (int64_t i = 0; i < R * W; ++i) {
    ASSERT_EQ(__bfloat16_as_ushort(rows[i]), __bfloat16_as_ushort(ref_rows_h[i])) << "x_sorted element " << i;
  }
  for (int64_t i = R * W; i < (R + kPadRows) * W; ++i) {
    ASSERT_TRUE(std::isnan(__bfloat162float(rows[i]))) << "x_sorted written past row T * k";
  }

  // Without the gather (as the engine runs v2), small plans take another path (build_plan_warp up to 32
  // assignments): the same ids, offsets and positions.
  d.p.x_sorted = nullptr;
  ASSERT_NO_FATAL_FAILURE(d.run_poisoned(h, moe_small_batch_route, "route without gather"));
  ASSERT_EQ(d.ids.download(), ids) << "expert_ids without the gather";
  ASSERT_EQ(d.offsets.download(), offsets) << "expert_offsets without the gather";
  ASSERT_EQ(d.sorted.download(), sorted) << "sorted_assignments without the gather";
  ASSERT_EQ(d.pos.download(), pos) << "assignment_pos without the gather";
}

// Launch 1 of both kernel generations (v1's front kernel, v2's router kernel: the same logits, routing and plan).
void run_route_case(const SmallCase& c) {
  for (const MoeSmallBatchKernel kernel : kBothKernels) run_route_case_with(with_kernel(c, kernel));
}

TEST(MoeSmallBatch, RouteAndPlanMatchCpu) {
  uint32_t seed = 1;
  for (const int64_t T : {1, 2, 3, 8, 16}) {
    for (const int E : {8, 64, 256, 896}) {
      for (const int k : {1, 2, 8, 16}) {
        if (k > E) continue;
        // Kimi-48B's router width at 256 experts; a narrow one (one slice) elsewhere to keep the case count cheap.
        const int64_t hidden = E == 256 ? 2304 : 96;
        run_route_case({.E = E, .k = k, .hidden = hidden, .inter = 16, .T = T, .special = true, .seed = seed++});
      }
    }
  }
}

TEST(MoeSmallBatch, RouteAndPlanMatchCpuGrouped) {
  run_route_case({.E = 256, .k = 8, .groups = 8, .top_k_groups = 4, .hidden = 2304, .T = 16, .seed = 41});
  run_route_case({.E = 64, .k = 6, .groups = 8, .top_k_groups = 3, .hidden = 96, .T = 3, .special = true, .seed = 42});
  run_route_case({.E = 16, .k = 4, .groups = 16, .top_k_groups = 4, .hidden = 64, .T = 8, .seed = 43});  // groups of 1
  run_route_case({.E = 896, .k = 16, .groups = 8, .top_k_groups = 4, .hidden = 256, .T = 16, .seed = 44});
  run_route_case({.E = 1024, .k = 16, .groups = 1024, .top_k_groups = 32, .hidden = 64, .T = 16, .seed = 45});
  run_route_case({.E = 8, .k = 4, .groups = 2, .top_k_groups = 2, .T = 2, .renormalize = false, .seed = 46});
}

void run_shared_activation_case(const SmallCase& c) {
  SCOPED_TRACE("shared activations " + describe_case(c));
  const HostLayer h = make_host(c);
  DeviceLayer d(c, h);
  d.poison(h);
  ASSERT_EQ(moe_small_batch_kernel_for(d.p), c.kernel);
  // v1 writes them in launch 1 (moe_small_batch_route), v2 in launch 2 (moe_small_batch_experts).
  ASSERT_TRUE(moe_small_batch_route(d.p, 0));
  if (c.kernel == MoeSmallBatchKernel::kV2) {
    ASSERT_TRUE(moe_small_batch_experts(d.p, 0));
  }
  DS_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<__nv_bfloat16> act = d.shared_activated.download();
  std::vector<float> got, expected;
  for (int64_t t = 0; t < c.T; ++t) {
    for (int64_t j = 0; j < c.shared_inter; ++j) {
      float g = 0.0f, u = 0.0f;
      for (int64_t i = 0; i < c.hidden; ++i) {
        const float x = __bfloat162float(h.x[t * c.hidden + i]);
        g += __bfloat162float(h.shared_gate_up[j * c.hidden + i]) * x;
        u += __bfloat162float(h.shared_gate_up[(c.shared_inter + j) * c.hidden + i]) * x;
      }
      float a = 0.0f;
      cpu::swiglu(&g, &u, &a, 1);
      expected.push_back(a);
      got.push_back(__bfloat162float(act[t * c.shared_inter + j]));
    }
  }
  // bf16 storage: up to half an ulp (2^-8 relative) of each value on top of the sum-order differences, so the
  // elementwise bound scales with the value (a mean-square bound failed on one large activation, -4.547 -> -4.5625).
  expect_close(got.data(), expected.data(), got.size(), c.shared_inter, 5e-3, 1e30, "shared activations vs CPU");
  double sum_sq = 0.0;
  for (float e : expected) sum_sq += static_cast<double>(e) * e;
  const double rms = std::sqrt(sum_sq / static_cast<double>(std::max<size_t>(expected.size(), 1)));
  int bad = 0;
  for (size_t i = 0; i < got.size() && bad < 5; ++i) {
    const double bound = std::ldexp(std::fabs(expected[i]), -8) + 2e-3 * rms;
    if (!(std::fabs(got[i] - expected[i]) <= bound)) {
      ++bad;
      ADD_FAILURE() << "shared activation " << i << ": " << got[i] << " vs CPU " << expected[i] << " (bound " << bound
                    << ")";
    }
  }
  for (int64_t i = c.T * c.shared_inter; i < (c.T + kPadRows) * c.shared_inter; ++i) {
    ASSERT_TRUE(std::isnan(__bfloat162float(act[i]))) << "shared_activated written past row T";
  }
}

TEST(MoeSmallBatch, SharedExpertActivations) {
  // The shared expert's activations alone; the rest of the layer is covered below. T = 5 and 11: one and two mma
  // token tiles in v2.
  for (const MoeSmallBatchKernel kernel : kBothKernels) {
    run_shared_activation_case(
        {.E = 8, .k = 2, .hidden = 2304, .inter = 16, .shared_inter = 1024, .T = 5, .seed = 51, .kernel = kernel});
    run_shared_activation_case(
        {.E = 8, .k = 2, .hidden = 2304, .inter = 16, .shared_inter = 1024, .T = 11, .seed = 52, .kernel = kernel});
  }
}

// ---- the whole layer -------------------------------------------------------------------------------------------

void run_layer_case_with(const SmallCase& c) {
  SCOPED_TRACE("layer " + describe_case(c));
  const HostLayer h = make_host(c);
  DeviceLayer d(c, h);
  ASSERT_EQ(moe_small_batch_kernel_for(d.p), c.kernel) << "the shapes should run the kernel asked for";
  ASSERT_NO_FATAL_FAILURE(d.run_poisoned(h, moe_small_batch_layer, "layer"));
  const std::vector<float> delta = residual_delta(d.residual, h, c, "small-batch layer");
  const std::vector<int32_t> ids = d.ids.download();
  const std::vector<float> w = d.weights.download();
  const int64_t R = c.T * c.k;
  {
    const std::vector<__nv_bfloat16> act = d.activated.download();
    for (int64_t i = 0; i < R * c.inter; ++i) {
      ASSERT_FALSE(std::isnan(__bfloat162float(act[i]))) << "activated row " << i / c.inter << " not written";
    }
    for (int64_t i = R * c.inter; i < (R + kPadRows) * c.inter; ++i) {
      ASSERT_TRUE(std::isnan(__bfloat162float(act[i]))) << "activated written past row T * k";
    }
  }

  // Deterministic: a second eager run adds exactly the same.
  d.reset_residual(h);
  ASSERT_TRUE(moe_small_batch_layer(d.p, 0));
  DS_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> again = residual_delta(d.residual, h, c, "second run");
  for (size_t i = 0; i < delta.size(); ++i) ASSERT_EQ(again[i], delta[i]) << "second eager run differs at " << i;

  // v2's down launch split over two CTAs a tile (the default up to kMoeSmallBatchSplitTokens) and unsplit: the
  // same sums in the same order, so bitwise the same.
  if (c.kernel == MoeSmallBatchKernel::kV2) {
    for (const int split : {1, 2}) {
      SCOPED_TRACE("down_split " + std::to_string(split));
      d.p.down_split = split;
      ASSERT_NO_FATAL_FAILURE(d.run_poisoned(h, moe_small_batch_layer, "layer, down_split"));
      const std::vector<float> other = residual_delta(d.residual, h, c, "down_split");
      for (size_t i = 0; i < delta.size(); ++i) ASSERT_EQ(other[i], delta[i]) << "down_split run differs at " << i;
    }
    d.p.down_split = 0;
  }

  // The previous chain on the same logits, and the CPU.
  ChainBuffers b(c);
  d.reset_residual(h);
  const Status status = run_chain(c, d, b, d.logits.get(), 0);
  ASSERT_TRUE(status) << status.to_string();
  DS_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> chain = residual_delta(d.residual, h, c, "previous chain");
  const std::vector<int32_t> chain_ids = b.ids.download();
  ASSERT_EQ(chain_ids, std::vector<int32_t>(ids.begin(), ids.begin() + R)) << "moe_route picked other experts";
  expect_close(delta.data(), chain.data(), delta.size(), c.hidden, 2e-3, 2e-2, "small-batch layer vs previous chain");
  const std::vector<float> ref = reference_delta(c, h, d.experts, ids, w);
  expect_close(delta.data(), ref.data(), delta.size(), c.hidden, 2e-3, 2e-2, "small-batch layer vs CPU");

  if (c.graph) {
    // Captured once, replayed three times (the counter must be back at 0 between replays): bitwise the eager result.
    cudaStream_t stream = nullptr;
    DS_CUDA_OK(cudaStreamCreate(&stream));
    cudaGraphExec_t exec = nullptr;
    ASSERT_NO_FATAL_FAILURE(capture_graph(
        stream, cudaStreamCaptureModeThreadLocal, [&](cudaStream_t s) { return moe_small_batch_layer(d.p, s); },
        &exec));
    for (int replay = 0; replay < 3; ++replay) {
      d.poison(h);
      DS_CUDA_OK(cudaGraphLaunch(exec, stream));
      DS_CUDA_OK(cudaStreamSynchronize(stream));
      d.expect_counter_zero("graph replay");
      const std::vector<float> replayed = residual_delta(d.residual, h, c, "graph replay");
      for (size_t i = 0; i < delta.size(); ++i) {
        ASSERT_EQ(replayed[i], delta[i]) << "graph replay " << replay << " differs at " << i;
      }
    }
    cudaGraphExecDestroy(exec);
    DS_CUDA_OK(cudaStreamDestroy(stream));
  }
}

// The layer with both kernel generations.
void run_layer_case(const SmallCase& c) {
  for (const MoeSmallBatchKernel kernel : kBothKernels) run_layer_case_with(with_kernel(c, kernel));
}

TEST(MoeSmallBatch, LayerTiny) {
  run_layer_case({.E = 8, .k = 2, .hidden = 32, .inter = 16, .T = 1, .graph = true, .seed = 61});
  run_layer_case({.E = 8, .k = 2, .hidden = 32, .inter = 16, .shared_inter = 32, .T = 5, .seed = 62});
  run_layer_case({.E = 8, .k = 3, .hidden = 72, .inter = 24, .shared_inter = 40, .T = 16, .graph = true, .seed = 63});
  run_layer_case({.E = 8, .k = 8, .hidden = 64, .inter = 32, .shared_inter = 16, .T = 3, .seed = 64});  // all experts
  run_layer_case({.E = 64,
                  .k = 6,
                  .groups = 8,
                  .top_k_groups = 3,
                  .hidden = 128,
                  .inter = 64,
                  .shared_inter = 64,
                  .T = 7,
                  .seed = 65});
}

TEST(MoeSmallBatch, LayerTinySitu) {
  run_layer_case(
      {.E = 8, .k = 2, .hidden = 32, .inter = 16, .shared_inter = 16, .T = 2, .glu = GluKind::kSitu, .seed = 71});
  run_layer_case({.E = 16,
                  .k = 4,
                  .hidden = 64,
                  .inter = 48,
                  .shared_inter = 96,
                  .T = 11,
                  .glu = GluKind::kSitu,
                  .graph = true,
                  .seed = 72});
}

TEST(MoeSmallBatch, LayerRowsInSegments) {
  // Weight rows longer than 32 x 9 chunks a lane: several segments whose partial sums are added in order
  // (hidden 2560 for gate/up; I 2560 and a shared I of 3072 for down), plus every chunk-per-lane variant.
  run_layer_case({.E = 8, .k = 2, .hidden = 2560, .inter = 2560, .shared_inter = 3072, .T = 3, .seed = 81});
  run_layer_case({.E = 8, .k = 2, .hidden = 512, .inter = 512, .T = 4, .seed = 82});    // 2 chunks a lane
  run_layer_case({.E = 8, .k = 2, .hidden = 1024, .inter = 1024, .T = 2, .seed = 83});  // 4 chunks a lane
}

TEST(MoeSmallBatch, LayerKimi48B) {
  for (const int64_t T : {1, 2, 3, 8, 16}) {
    run_layer_case({.E = 256,
                    .k = 8,
                    .hidden = 2304,
                    .inter = 1024,
                    .shared_inter = 1024,
                    .T = T,
                    .graph = T == 1 || T == 8,
                    .seed = static_cast<uint32_t>(90 + T)});
  }
  // Without a shared expert, SiTU-GLU.
  run_layer_case({.E = 256, .k = 8, .hidden = 2304, .inter = 1024, .T = 4, .glu = GluKind::kSitu, .seed = 99});
}

TEST(MoeSmallBatch, V2FallsBackToV1) {
  // 17 staged x rows of hidden 8192 do not fit v2's gate/up shared memory: both launches run v1 (launch 1 differs
  // between the two, so route and experts must agree), and the layer is still right.
  const SmallCase c{.E = 8, .k = 2, .hidden = 8192, .inter = 64, .shared_inter = 64, .T = 16, .seed = 101};
  const HostLayer h = make_host(c);
  DeviceLayer d(c, h);
  ASSERT_EQ(moe_small_batch_kernel_for(d.p), MoeSmallBatchKernel::kV1);
  ASSERT_NO_FATAL_FAILURE(d.run_poisoned(h, moe_small_batch_layer, "layer"));
  const std::vector<float> delta = residual_delta(d.residual, h, c, "small-batch layer");
  const std::vector<float> ref = reference_delta(c, h, d.experts, d.ids.download(), d.weights.download());
  expect_close(delta.data(), ref.data(), delta.size(), c.hidden, 2e-3, 2e-2, "fallback layer vs CPU");
}

// Several layers back to back on one stream as the engine runs them: each one's inputs x (bf16) and x_f32 are
// rms_norm_dual of the residual the layer before just wrote, then the layer adds into that residual; the same
// buffers for every layer. Captured in one graph, v2's launches start while the kernel before them drains (and
// launch 1 of a layer may start while launch 3 of the layer before runs, in the engine with a plain norm between).
// Bitwise the layers run one kernel at a time with a device synchronisation after each.
// Captures `layers` layers of d's params back to back in one graph on `stream`, each after norm(stream) when norm is
// set (the engine's order).
void capture_layer_chain(cudaStream_t stream, DeviceLayer& d, int layers,
                         const std::function<Status(cudaStream_t)>& norm, cudaGraphExec_t* exec) {
  ASSERT_NO_FATAL_FAILURE(capture_graph(
      stream, cudaStreamCaptureModeThreadLocal,
      [&](cudaStream_t st) {
        Status status = Status::ok();
        for (int layer = 0; layer < layers && status; ++layer) {
          if (norm) status = norm(st);
          if (status) status = moe_small_batch_layer(d.p, st);
        }
        return status;
      },
      exec));
}

void run_layer_chain_case(const SmallCase& c) {
  SCOPED_TRACE("layer chain " + describe_case(c));
  constexpr int kLayers = 3;
  const HostLayer h = make_host(c);
  DeviceLayer d(c, h);
  const int64_t residual_stride = c.hidden + kStrideGap;
  auto norm = [&](cudaStream_t stream) {
    return rms_norm_dual(d.residual.get(), residual_stride, nullptr, c.T, c.hidden, 1e-5f, d.x.get(), c.hidden,
                         d.x_f32.get(), c.hidden, stream);
  };
  d.poison(h);
  for (int layer = 0; layer < kLayers; ++layer) {
    ASSERT_TRUE(norm(0));
    DS_CUDA_OK(cudaDeviceSynchronize());
    ASSERT_TRUE(moe_small_batch_route(d.p, 0));
    DS_CUDA_OK(cudaDeviceSynchronize());
    ASSERT_TRUE(moe_small_batch_experts(d.p, 0));
    DS_CUDA_OK(cudaDeviceSynchronize());
  }
  const std::vector<float> one_at_a_time = residual_delta(d.residual, h, c, "layers one kernel at a time");
  cudaStream_t stream = nullptr;
  DS_CUDA_OK(cudaStreamCreate(&stream));
  cudaGraphExec_t exec = nullptr;
  ASSERT_NO_FATAL_FAILURE(capture_layer_chain(stream, d, kLayers, norm, &exec));
  for (int replay = 0; replay < 3; ++replay) {
    d.poison(h);
    DS_CUDA_OK(cudaGraphLaunch(exec, stream));
    DS_CUDA_OK(cudaStreamSynchronize(stream));
    d.expect_counter_zero("layer chain replay");
    const std::vector<float> chained = residual_delta(d.residual, h, c, "layer chain replay");
    for (size_t i = 0; i < chained.size(); ++i) {
      ASSERT_EQ(chained[i], one_at_a_time[i]) << "replay " << replay << " differs at " << i;
    }
  }
  cudaGraphExecDestroy(exec);
  DS_CUDA_OK(cudaStreamDestroy(stream));
}

TEST(MoeSmallBatch, LayerChainInOneGraph) {
  for (const MoeSmallBatchKernel kernel : kBothKernels) {
    for (const int64_t T : {1, 4}) {
      run_layer_chain_case({.E = 256,
                            .k = 8,
                            .hidden = 2304,
                            .inter = 1024,
                            .shared_inter = 1024,
                            .T = T,
                            .seed = static_cast<uint32_t>(110 + T),
                            .kernel = kernel});
    }
  }
}

// The input norm fused into v2's launches (MoeSmallBatchParams::norm_weight) against the engine's unfused order:
// rms_norm_dual of the residual into x and x_f32, then the layer. Three layers back to back on one residual, each
// way captured in one graph as the engine runs them; the fused launches normalise in rms_norm_dual's reduction
// order, so the residual and the last layer's logits must be bitwise the same.
void run_fused_norm_case(const SmallCase& c) {
  SCOPED_TRACE("fused norm " + describe_case(c));
  constexpr int kLayers = 3;
  constexpr float kEps = 1e-5f;
  const HostLayer h = make_host(c);
  const int64_t residual_stride = c.hidden + kStrideGap;
  std::mt19937 rng(c.seed + 1000);
  DeviceBuffer<float> norm_weight(c.hidden);
  norm_weight.upload(normal_vector(rng, c.hidden, 1.0f, 0.1f));
  DeviceLayer plain(c, h), fused(c, h);
  plain.p.x_sorted = nullptr;
  fused.p.x_sorted = nullptr;
  fused.p.x_f32 = fused.residual.get();
  fused.p.x_f32_stride = residual_stride;
  fused.p.x = nullptr;
  fused.p.norm_weight = norm_weight.get();
  fused.p.norm_eps = kEps;
  ASSERT_EQ(moe_small_batch_kernel_for(fused.p), MoeSmallBatchKernel::kV2);
  auto run = [&](DeviceLayer& d, bool fuse) {
    cudaStream_t stream = nullptr;
    DS_CUDA_OK(cudaStreamCreate(&stream));
    cudaGraphExec_t exec = nullptr;
    std::function<Status(cudaStream_t)> norm;
    if (!fuse) {
      norm = [&](cudaStream_t st) {
        return rms_norm_dual(d.residual.get(), residual_stride, norm_weight.get(), c.T, c.hidden, kEps, d.x.get(),
                             c.hidden, d.x_f32.get(), c.hidden, st);
      };
    }
    ASSERT_NO_FATAL_FAILURE(capture_layer_chain(stream, d, kLayers, norm, &exec));
    d.poison(h);
    DS_CUDA_OK(cudaGraphLaunch(exec, stream));
    DS_CUDA_OK(cudaStreamSynchronize(stream));
    d.expect_counter_zero(fuse ? "fused" : "unfused");
    cudaGraphExecDestroy(exec);
    DS_CUDA_OK(cudaStreamDestroy(stream));
  };
  ASSERT_NO_FATAL_FAILURE(run(plain, false));
  ASSERT_NO_FATAL_FAILURE(run(fused, true));
  const std::vector<float> want = residual_delta(plain.residual, h, c, "unfused");
  const std::vector<float> got = residual_delta(fused.residual, h, c, "fused");
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_FALSE(std::isnan(want[i])) << "unfused residual not written at " << i;
    ASSERT_EQ(got[i], want[i]) << "fused norm: residual differs at row " << i / c.hidden << " column " << i % c.hidden;
  }
  const std::vector<float> want_logits = plain.logits.download(), got_logits = fused.logits.download();
  for (int64_t i = 0; i < c.T * c.E; ++i) ASSERT_EQ(got_logits[i], want_logits[i]) << "logit " << i;
  EXPECT_EQ(fused.ids.download(), plain.ids.download());
}

TEST(MoeSmallBatch, FusedInputNormBitwise) {
  run_fused_norm_case({.E = 8, .k = 2, .hidden = 64, .inter = 32, .shared_inter = 16, .T = 3, .seed = 121});
  for (const int64_t T : {1, 4}) {
    run_fused_norm_case({.E = 256,
                         .k = 8,
                         .hidden = 2304,
                         .inter = 1024,
                         .shared_inter = 1024,
                         .T = T,
                         .seed = static_cast<uint32_t>(122 + T)});
  }
}

TEST(MoeSmallBatch, FusedInputNormRejects) {
  const SmallCase c{.E = 8, .k = 2, .hidden = 32, .inter = 16, .shared_inter = 16, .T = 2, .seed = 4};
  const HostLayer h = make_host(c);
  DeviceLayer d(c, h);
  DeviceBuffer<float> norm_weight(c.hidden);
  d.p.norm_weight = norm_weight.get();
  d.p.norm_eps = 1e-5f;
  // x_sorted is a gather of the normalised rows, which the fused launches do not write.
  EXPECT_EQ(moe_small_batch_route(d.p, 0).code(), StatusCode::kInvalidArgument);
  d.p.x_sorted = nullptr;
  d.p.norm_eps = -1.0f;
  EXPECT_EQ(moe_small_batch_route(d.p, 0).code(), StatusCode::kInvalidArgument);
  d.p.norm_eps = 1e-5f;
  d.p.kernel = MoeSmallBatchKernel::kV1;  // v2 only
  EXPECT_EQ(moe_small_batch_route(d.p, 0).code(), StatusCode::kUnimplemented);
  EXPECT_EQ(moe_small_batch_experts(d.p, 0).code(), StatusCode::kUnimplemented);
  EXPECT_EQ(moe_small_batch_kernel_for(d.p), MoeSmallBatchKernel::kDefault);
}

TEST(MoeSmallBatch, RejectsBadInputs) {
  const SmallCase c{.E = 8, .k = 2, .hidden = 32, .inter = 16, .shared_inter = 16, .T = 2, .seed = 3};
  const HostLayer h = make_host(c);
  DeviceLayer d(c, h);
  auto expect_invalid = [&](MoeSmallBatchParams p, const char* what) {
    EXPECT_EQ(moe_small_batch_route(p, 0).code(), StatusCode::kInvalidArgument) << what;
    EXPECT_EQ(moe_small_batch_experts(p, 0).code(), StatusCode::kInvalidArgument) << what;
  };
  MoeSmallBatchParams p = d.p;
  p.tokens = 17;
  expect_invalid(p, "17 tokens");
  p = d.p;
  p.routing.top_k = 0;
  expect_invalid(p, "top_k 0");
  p = d.p;
  p.hidden = 36;
  p.experts.width = 36;
  expect_invalid(p, "hidden not a multiple of 8");
  p = d.p;
  p.experts.width = 64;
  expect_invalid(p, "expert width != hidden (LatentMoE)");
  p = d.p;
  p.experts.intermediate = 12;
  expect_invalid(p, "intermediate not a multiple of 8");
  p = d.p;
  p.x_stride = 33;
  expect_invalid(p, "x stride");
  p = d.p;
  p.residual_stride = 16;
  expect_invalid(p, "residual stride");
  p = d.p;
  p.counter = nullptr;
  expect_invalid(p, "no counter");
  p = d.p;
  p.down_split = 3;
  expect_invalid(p, "down_split 3");
  p = d.p;
  p.workspace_bytes -= 1;
  expect_invalid(p, "small workspace");
  p = d.p;
  p.x = reinterpret_cast<const __nv_bfloat16*>(reinterpret_cast<uintptr_t>(p.x) + 2);
  expect_invalid(p, "misaligned x");
  p = d.p;
  p.shared_down = nullptr;
  expect_invalid(p, "shared expert without down");
  p = d.p;
  p.glu = GluKind::kSitu;
  p.situ_beta = 0.0f;
  expect_invalid(p, "SiTU beta 0");
  p = d.p;
  p.routing.num_groups = 3;
  expect_invalid(p, "groups do not divide E");
  p = d.p;
  p.kernel = static_cast<MoeSmallBatchKernel>(7);
  expect_invalid(p, "unknown kernel");
  p = d.p;
  p.tokens = 0;
  p.x = nullptr;
  EXPECT_TRUE(moe_small_batch_layer(p, 0)) << "T == 0 launches nothing";
  EXPECT_FALSE(moe_small_batch_fits(16, 17, 256, 2304, 1024, 1024));  // 272 assignments
  EXPECT_TRUE(moe_small_batch_fits(16, 16, 896, 3584, 3072, 0));
}

// ---- timing: v2 and v1 vs the previous chain, graph-replayed ---------------------------------------------------

TEST(MoeDecodeLayerGpu, Timing) {
  constexpr int kReplays = 200;
  constexpr double kCopyBandwidth = 4.26e12;  // bytes/s, the H200's measured copy rate
  for (const int64_t T : {1, 2, 4, 8, 16}) {
    const SmallCase c{.E = 256,
                      .k = 8,
                      .hidden = 2304,
                      .inter = 1024,
                      .shared_inter = 1024,
                      .T = T,
                      .seed = static_cast<uint32_t>(500 + T)};
    SCOPED_TRACE("timing " + describe_case(c));
    const HostLayer h = make_host(c);
    DeviceLayer d(c, h);
    d.p.x_sorted = nullptr;  // as the engine runs it
    ChainBuffers b(c);
    const int64_t W = c.hidden, Is = c.shared_inter;
    DeviceBuffer<float> chain_logits(T * c.E), shared_gate_up_out(T * 2 * Is);
    DeviceBuffer<__nv_bfloat16> shared_act(T * Is);

    // The previous chain as the engine ran it: skinny fp32 router GEMM, route, plan, gather, GEMV experts, combine,
    // then the shared expert as skinny gate/up (fp32), glu, skinny down accumulating into the residual.
    auto run_previous = [&](cudaStream_t stream) -> Status {
      SkinnyGemmParams router;
      router.input = SkinnyGemmInput::kFp32;
      router.x = d.p.x_f32;
      router.x_stride = W;
      router.rows = T;
      router.in = W;
      router.outputs[0] = {d.p.router, c.E, chain_logits.get(), c.E};
      router.num_outputs = 1;
      Status s = skinny_gemm(router, stream);
      if (s) s = run_routed_chain(c, d.p, b, chain_logits.get(), stream);
      SkinnyGemmParams gate_up;
      gate_up.x = d.p.x;
      gate_up.x_stride = W;
      gate_up.rows = T;
      gate_up.in = W;
      gate_up.outputs[0] = {d.p.shared_gate_up, 2 * Is, shared_gate_up_out.get(), 2 * Is};
      gate_up.num_outputs = 1;
      if (s) s = skinny_gemm(gate_up, stream);
      if (s) s = glu(shared_gate_up_out.get(), T, Is, GluKind::kSwiGlu, 4.0f, 25.0f, shared_act.get(), stream);
      SkinnyGemmParams down;
      down.x = shared_act.get();
      down.x_stride = Is;
      down.rows = T;
      down.in = Is;
      down.outputs[0] = {d.p.shared_down, W, d.p.residual, d.p.residual_stride};
      down.num_outputs = 1;
      down.accumulate = true;
      if (s) s = skinny_gemm(down, stream);
      return s;
    };

    // Correctness once per kernel generation, eagerly: the layer vs the previous chain (same experts unless the two
    // routers' fp32 logits split a near tie differently, which the ids check reports).
    int active = 0;
    for (const MoeSmallBatchKernel kernel : kBothKernels) {
      d.p.kernel = kernel;
      ASSERT_EQ(moe_small_batch_kernel_for(d.p), kernel);
      d.poison(h);
      ASSERT_TRUE(moe_small_batch_layer(d.p, 0));
      DS_CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> fresh = residual_delta(d.residual, h, c, "small-batch layer");
      const std::vector<int32_t> new_ids = d.ids.download();
      const std::vector<int32_t> offsets = d.offsets.download();
      active = 0;
      for (int e = 0; e < c.E; ++e) active += offsets[e + 1] > offsets[e] ? 1 : 0;
      d.reset_residual(h);
      const Status status = run_previous(0);
      ASSERT_TRUE(status) << status.to_string();
      DS_CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> previous = residual_delta(d.residual, h, c, "previous chain");
      ASSERT_EQ(std::vector<int32_t>(new_ids.begin(), new_ids.begin() + T * c.k), b.ids.download());
      expect_close(fresh.data(), previous.data(), fresh.size(), W, 2e-3, 2e-2,
                   std::string("layer ") + moe_small_batch_kernel_name(kernel) + " vs previous chain");
    }

    // Graph replays of v2, v1 and the previous chain.
    cudaStream_t stream = nullptr;
    DS_CUDA_OK(cudaStreamCreate(&stream));
    // 0: v2 as the engine runs it (down_split 0), 1: v1, 2: the previous chain, 3: v2 with the down launch split
    // (T <= kMoeSmallBatchSplitTokens; unsplit above), 4: v2's launch 1 alone (router, route, plan).
    double us[5] = {0.0, 0.0, 0.0, 0.0, 0.0};
    for (const int variant : {0, 1, 2, 3, 4}) {
      d.p.kernel = variant == 1 ? MoeSmallBatchKernel::kV1 : MoeSmallBatchKernel::kV2;
      d.p.down_split = variant == 3 ? 2 : 0;
      double ms = 0.0;
      ASSERT_NO_FATAL_FAILURE(time_graph_replays(
          stream, cudaStreamCaptureModeThreadLocal, 10, kReplays,
          [&](cudaStream_t s) {
            if (variant == 2) return run_previous(s);
            if (variant == 4) return moe_small_batch_route(d.p, s);
            return moe_small_batch_layer(d.p, s);
          },
          &ms));
      us[variant] = 1e3 * ms;
    }
    d.p.down_split = 0;
    d.expect_counter_zero("timing replays");
    const double expert_bytes = 3.0 * W * c.inter * 2.0;
    const double bytes = active * expert_bytes + 3.0 * W * Is * 2.0 + static_cast<double>(c.E) * W * 4.0;
    const double floor_us = 1e6 * bytes / kCopyBandwidth;
    std::printf(
        "[ moe decode layer ] T=%2lld: v2 %7.1f us (down split %7.1f, launch 1 alone %5.1f), v1 %7.1f us (%.2fx), "
        "previous chain %7.1f us "
        "(%.2fx); %3d experts + shared + router = %6.1f MB -> %6.1f us at 4.26 TB/s: v2 at %.2f (split %.2f), v1 at "
        "%.2f, previous at %.2f of it\n",
        static_cast<long long>(T), us[0], us[3], us[4], us[1], us[1] / us[0], us[2], us[2] / us[0], active, bytes / 1e6,
        floor_us, floor_us / us[0], floor_us / us[3], floor_us / us[1], floor_us / us[2]);
    DS_CUDA_OK(cudaStreamDestroy(stream));
  }
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
