// The expert-FFN layer case of the GPU MoE tests (moe_ffn_decode_test.cpp, moe_ffn_grouped_test.cpp): router →
// plan → gather on the GPU (the router checked against cpu::moe_route), then each expert-FFN entry point + combine,
// against the CPU (cpu::linear + cpu::swiglu / cpu::situ_glu on bf16-representable weights and inputs, the
// activation rounded to bf16 as the GPU stores it, the weighted sum over j = 0..k-1) on every ref_token_stride-th
// token and against the cuBLAS reference FFN (moe_test_util.hpp) on all tokens.
// Tolerances: relative L2 <= 2e-3 and max |a - b| <= 2e-2 · rms(ref) — fp32 accumulation in another order than the
// CPU, and an occasional one-ulp bf16 flip of an activation (2^-8 relative) near a rounding tie. Entry points that
// run the same kernels (moe_expert_ffn_decode above 4 rows per expert and moe_expert_ffn_grouped; the grouped path
// and its mma.sync kernels up to kMoeWgmmaMinRowsPerExpert rows per expert) must agree bitwise.
// y_sorted and activated rows past R are NaN-poisoned and must stay NaN.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <cublas_v2.h>

#include "kernels/cpu/basic_ops.hpp"
#include "kernels/cpu/moe.hpp"
#include "kernels/cuda/moe/detail/wgmma.hpp"
#include "kernels/cuda/moe/moe.hpp"
#include "kernels/cuda/tests/kda_test_util.hpp"
#include "kernels/cuda/tests/moe_test_util.hpp"

namespace deltaserve::kernels::cuda::test {

struct LayerCase {
  int E = 8, k = 2;
  int64_t width = 32, inter = 16, T = 4;
  GluKind glu = GluKind::kSwiGlu;
  bool concentrate = false;  // bias pushes every token to experts 0 and 1 (many rows per expert, empty experts)
  bool hot_expert = false;   // bias pushes every token to expert 0 (it gets T of the T * k rows: half at k = 2)
  bool graph = false;        // also replay the chain as a CUDA graph and require identical results
  bool time_paths = false;   // print event timings of the grouped, mma.sync and cuBLAS reference paths (no assertion)
  int64_t ref_token_stride = 1;  // CPU reference on every n-th token only (big cases)
  uint32_t seed = 1;
};

// CPU reference of the routed experts for the tokens t % stride == 0: out[t, :] = Σ_j w[t, j] · expert(x_t).
inline std::vector<float> reference_layer(const LayerCase& c, const std::vector<float>& x,
                                          const std::vector<__nv_bfloat16>& gate_up,
                                          const std::vector<__nv_bfloat16>& down, const std::vector<int32_t>& ids,
                                          const std::vector<float>& w) {
  const int64_t W = c.width, I = c.inter, k = c.k;
  std::vector<std::vector<int64_t>> assigned(c.E);  // assignments a = t * k + j per expert
  for (int64_t t = 0; t < c.T; t += c.ref_token_stride) {
    for (int64_t j = 0; j < k; ++j) assigned[ids[t * k + j]].push_back(t * k + j);
  }
  std::vector<float> y(c.T * k * W, 0.0f);  // per assignment
  std::vector<float> gu_f, down_f, xs, h, act, ye;
  for (int e = 0; e < c.E; ++e) {
    const auto& list = assigned[e];
    if (list.empty()) continue;
    const int64_t n = static_cast<int64_t>(list.size());
    gu_f.assign(2 * I * W, 0.0f);
    down_f.assign(W * I, 0.0f);
    for (int64_t i = 0; i < 2 * I * W; ++i) gu_f[i] = __bfloat162float(gate_up[e * 2 * I * W + i]);
    for (int64_t i = 0; i < W * I; ++i) down_f[i] = __bfloat162float(down[e * W * I + i]);
    xs.resize(n * W);
    for (int64_t r = 0; r < n; ++r) std::copy_n(&x[(list[r] / k) * W], W, &xs[r * W]);
    h.resize(n * 2 * I);
    cpu::linear(xs.data(), gu_f.data(), h.data(), n, W, 2 * I);
    act.resize(n * I);
    std::vector<float> gate(I), up(I);
    for (int64_t r = 0; r < n; ++r) {
      std::copy_n(&h[r * 2 * I], I, gate.data());
      std::copy_n(&h[r * 2 * I + I], I, up.data());
      if (c.glu == GluKind::kSitu) {
        cpu::situ_glu(gate.data(), up.data(), &act[r * I], I, 4.0f, 25.0f);
      } else {
        cpu::swiglu(gate.data(), up.data(), &act[r * I], I);
      }
    }
    for (float& v : act) v = bf16_round(v);
    ye.resize(n * W);
    cpu::linear(act.data(), down_f.data(), ye.data(), n, I, W);
    for (int64_t r = 0; r < n; ++r) std::copy_n(&ye[r * W], W, &y[list[r] * W]);
  }
  std::vector<float> out(c.T * W, 0.0f);
  for (int64_t t = 0; t < c.T; t += c.ref_token_stride) {
    for (int64_t d = 0; d < W; ++d) {
      float sum = 0.0f;
      for (int64_t j = 0; j < k; ++j) sum += w[t * k + j] * y[(t * k + j) * W + d];
      out[t * W + d] = sum;
    }
  }
  return out;
}

struct LayerDevice {
  int64_t T, W, I, R;
  int E, k;
  DeviceBuffer<float> logits, bias;
  DeviceBuffer<int32_t> ids;
  DeviceBuffer<float> weights;
  PlanBuffers plan;
  DeviceBuffer<__nv_bfloat16> x, x_sorted, activated, gate_up, down;
  DeviceBuffer<float> y_sorted, out;
  static constexpr int kPadRows = 2;
  LayerDevice(const LayerCase& c)
      : T(c.T),
        W(c.width),
        I(c.inter),
        R(c.T * c.k),
        E(c.E),
        k(c.k),
        logits(c.T * c.E + 1),
        bias(c.E),
        ids(R + 1),
        weights(R + 1),
        plan(c.T, c.k, c.E, 0),
        x(c.T * c.width + 8),
        x_sorted((R + kPadRows) * W),
        activated((R + kPadRows) * I),
        gate_up(static_cast<size_t>(c.E) * 2 * I * W),
        down(static_cast<size_t>(c.E) * W * I),
        y_sorted((R + kPadRows) * W),
        out(c.T * (W + 4) + 1) {}

  MoeFfnParams ffn(const LayerCase& c) const {
    MoeFfnParams p;
    p.weights = {gate_up.get(), down.get(), E, W, I};
    p.glu = c.glu;
    p.rows = R;
    p.x_sorted = x_sorted.get();
    p.expert_offsets = plan.plan.expert_offsets;
    p.activated = activated.get();
    p.y_sorted = y_sorted.get();
    return p;
  }

  void poison() {
    activated.upload(std::vector<__nv_bfloat16>((R + kPadRows) * I, bf16_nan()));
    y_sorted.upload(std::vector<float>((R + kPadRows) * W, kNaN));
    out.upload(std::vector<float>(T * (W + 4) + 1, kNaN));
  }

  // Router → plan → gather (the FFN path is run separately).
  Status front(cudaStream_t stream) {
    MoeRoutingConfig config;
    config.num_experts = E;
    config.top_k = k;
    config.routed_scaling_factor = 2.5f;
    Status s = moe_route(config, logits.get(), bias.get(), T, ids.get(), weights.get(), stream);
    if (!s) return s;
    s = moe_plan(ids.get(), T, k, E, plan.plan, plan.workspace.get(), plan.workspace_bytes, stream);
    if (!s) return s;
    return moe_gather_rows(x.get(), W, plan.plan, T, k, W, x_sorted.get(), stream);
  }
  Status combine(cudaStream_t stream) {
    return moe_combine(y_sorted.get(), plan.plan, weights.get(), T, k, W, false, out.get(), W + 4, stream);
  }
};

// Downloads out [T, W] (stride W + 4), checks the stride gaps stayed NaN, and the written rows of the scratch.
inline std::vector<float> download_out(LayerDevice& d, const std::string& what) {
  const std::vector<float> raw = d.out.download();
  std::vector<float> out(d.T * d.W);
  for (int64_t t = 0; t < d.T; ++t) {
    for (int64_t c = 0; c < d.W + 4; ++c) {
      const float v = raw[t * (d.W + 4) + c];
      if (c < d.W) {
        out[t * d.W + c] = v;
      } else {
        EXPECT_TRUE(std::isnan(v)) << what << ": combine wrote the stride gap at token " << t << " col " << c;
      }
    }
  }
  const std::vector<float> y = d.y_sorted.download();
  for (int64_t i = 0; i < d.R * d.W; ++i) {
    if (std::isnan(y[i])) {
      ADD_FAILURE() << what << ": y_sorted row " << i / d.W << " col " << i % d.W << " not written (NaN)";
      break;
    }
  }
  for (int64_t i = d.R * d.W; i < (d.R + LayerDevice::kPadRows) * d.W; ++i) {
    if (!std::isnan(y[i])) {
      ADD_FAILURE() << what << ": y_sorted written past row R at " << i;
      break;
    }
  }
  const std::vector<__nv_bfloat16> act = d.activated.download();
  for (int64_t i = d.R * d.I; i < (d.R + LayerDevice::kPadRows) * d.I; ++i) {
    if (!std::isnan(__bfloat162float(act[i]))) {
      ADD_FAILURE() << what << ": activated written past row R at " << i;
      break;
    }
  }
  return out;
}

// Expects `out` bitwise equal to `want` (same kernels, same sums).
inline void expect_bitwise(const std::vector<float>& out, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(out.size(), want.size()) << what;
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], want[i]) << what << ": differs at " << i;
}

inline void run_layer_case(const LayerCase& c) {
  SCOPED_TRACE("layer E=" + std::to_string(c.E) + " k=" + std::to_string(c.k) + " W=" + std::to_string(c.width) +
               " I=" + std::to_string(c.inter) + " T=" + std::to_string(c.T) +
               (c.glu == GluKind::kSitu ? " situ" : " swiglu") + (c.concentrate ? " concentrated" : "") +
               (c.hot_expert ? " hot-expert" : ""));
  std::mt19937 rng(c.seed);
  const int64_t W = c.width, I = c.inter, T = c.T, R = T * c.k;
  std::vector<float> x = normal_vector(rng, T * W);
  for (float& v : x) v = bf16_round(v);
  const std::vector<float> logits = normal_vector(rng, T * c.E, 0.0f, 2.0f);
  std::vector<float> bias = normal_vector(rng, c.E, 0.0f, 0.05f);
  if (c.concentrate) {
    bias.assign(c.E, 0.0f);
    bias[0] = bias[1] = 10.0f;  // s + bias of experts 0, 1 beats any other s in [0, 1]
  }
  if (c.hot_expert) {
    bias.assign(c.E, 0.0f);
    bias[0] = 10.0f;  // every token picks expert 0 first
  }
  const ExpertWeightsHost& weights_host = expert_weights_host(c.E, W, I);
  const std::vector<__nv_bfloat16>& gate_up = weights_host.gate_up;
  const std::vector<__nv_bfloat16>& down = weights_host.down;

  LayerDevice d(c);
  d.logits.upload(logits);
  d.bias.upload(bias);
  d.x.upload(to_bf16(x));
  d.gate_up.upload(gate_up);
  d.down.upload(down);
  d.x_sorted.upload(std::vector<__nv_bfloat16>((R + LayerDevice::kPadRows) * W, bf16_nan()));

  // Router on the GPU must match the CPU routing exactly (the reference uses the CPU's).
  Status status = d.front(0);
  ASSERT_TRUE(status) << status.to_string();
  DS_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<int32_t> ids = d.ids.download();
  const std::vector<float> w = d.weights.download();
  {
    const cpu::MoeRouting routing{c.E, c.k, 1, 1, true, 2.5f};
    std::vector<int32_t> ref_ids(c.k);
    std::vector<float> ref_w(c.k);
    for (int64_t t = 0; t < T; ++t) {
      cpu::moe_route(routing, &logits[t * c.E], bias.data(), ref_ids.data(), ref_w.data());
      for (int j = 0; j < c.k; ++j) {
        ASSERT_EQ(ids[t * c.k + j], ref_ids[j]) << "router token " << t << " choice " << j;
        ASSERT_TRUE(same_float(w[t * c.k + j], ref_w[j], 1e-6f))
            << "router weight token " << t << " choice " << j << ": " << w[t * c.k + j] << " vs " << ref_w[j];
      }
    }
  }
  const std::vector<int32_t> offsets = d.plan.offsets.download();
  const std::vector<float> ref = reference_layer(c, x, gate_up, down, ids, w);
  // Only the reference tokens count.
  auto select = [&](const std::vector<float>& all) {
    std::vector<float> picked;
    for (int64_t t = 0; t < T; t += c.ref_token_stride) picked.insert(picked.end(), &all[t * W], &all[t * W] + W);
    return picked;
  };
  const std::vector<float> ref_sel = select(ref);
  int empty = 0, most = 0;
  for (int e = 0; e < c.E; ++e) {
    empty += offsets[e + 1] == offsets[e] ? 1 : 0;
    most = std::max(most, offsets[e + 1] - offsets[e]);
  }
  std::printf("[ moe layer ] E=%d k=%d W=%lld I=%lld T=%lld: %d empty experts, at most %d rows per expert\n", c.E, c.k,
              static_cast<long long>(W), static_cast<long long>(I), static_cast<long long>(T), empty, most);

  // The cuBLAS reference first, against the CPU.
  cublasHandle_t handle = nullptr;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  cudaStream_t stream = nullptr;
  DS_CUDA_OK(cudaStreamCreate(&stream));
  d.poison();
  status = cublas_reference_ffn(d.ffn(c), offsets, handle, stream);
  ASSERT_TRUE(status) << status.to_string();
  ASSERT_TRUE(d.combine(stream));
  DS_CUDA_OK(cudaStreamSynchronize(stream));
  const std::vector<float> reference_out = download_out(d, "cuBLAS reference");
  expect_close(select(reference_out).data(), ref_sel.data(), ref_sel.size(), W, 2e-3, 2e-2, "cuBLAS reference vs CPU");

  // Runs one expert-FFN entry point on the plan, then the combine; checks it against the CPU and the reference.
  auto run_path = [&](const std::string& name, const std::function<Status(cudaStream_t)>& ffn,
                      std::vector<float>* out) {
    d.poison();
    const Status s = ffn(stream);
    ASSERT_TRUE(s) << name << ": " << s.to_string();
    ASSERT_TRUE(d.combine(stream));
    DS_CUDA_OK(cudaStreamSynchronize(stream));
    *out = download_out(d, name);
    expect_close(select(*out).data(), ref_sel.data(), ref_sel.size(), W, 2e-3, 2e-2, name + " vs CPU");
    expect_close(out->data(), reference_out.data(), out->size(), W, 2e-3, 2e-2, name + " vs cuBLAS reference");
  };
  const MoeFfnParams p = d.ffn(c);
  const bool decode_is_grouped = R > kMoeDecodeGemvRowsPerExpert * c.E;
  const bool grouped_is_mma_sync = R <= kMoeWgmmaMinRowsPerExpert * c.E;
  const std::string grouped_name = grouped_is_mma_sync ? "moe_expert_ffn_grouped (mma.sync, row tile " +
                                                             std::to_string(moe_grouped_row_tile(R, c.E)) + ")"
                                                       : "moe_expert_ffn_grouped (wgmma)";
  // The engine's entry point: the bandwidth kernels up to 4 rows per expert, the grouped path beyond.
  std::vector<float> decode_out, grouped_out, mma_out;
  ASSERT_NO_FATAL_FAILURE(run_path(
      decode_is_grouped ? "moe_expert_ffn_decode (grouped)" : "moe_expert_ffn_decode (bandwidth kernels)",
      [&](cudaStream_t s) { return moe_expert_ffn_decode(p, s); }, &decode_out));
  ASSERT_NO_FATAL_FAILURE(run_path(
      grouped_name, [&](cudaStream_t s) { return moe_expert_ffn_grouped(p, s); }, &grouped_out));
  // The mma.sync kernels at the automatic row tile: what runs wherever the wgmma kernels decline.
  const std::string mma_name = "mma.sync kernels (row tile " + std::to_string(moe_grouped_row_tile(R, c.E)) + ")";
  ASSERT_NO_FATAL_FAILURE(run_path(
      mma_name, [&](cudaStream_t s) { return detail::moe_expert_ffn_grouped_mma_sync(p, s); }, &mma_out));
  if (decode_is_grouped) expect_bitwise(decode_out, grouped_out, "moe_expert_ffn_decode vs moe_expert_ffn_grouped");
  if (grouped_is_mma_sync) expect_bitwise(grouped_out, mma_out, grouped_name + " vs " + mma_name);

  if (c.time_paths) {
    // Event timings, informational: the two FFN GEMMs of one layer (expert FLOPs 6 * R * W * I).
    cudaEvent_t start = nullptr, stop = nullptr;
    DS_CUDA_OK(cudaEventCreate(&start));
    DS_CUDA_OK(cudaEventCreate(&stop));
    const double flops = 6.0 * static_cast<double>(R) * static_cast<double>(W) * static_cast<double>(I);
    const char* names[] = {"moe_expert_ffn_grouped", "mma.sync kernels", "cuBLAS per expert + ops glu"};
    for (const int variant : {0, 1, 2}) {
      constexpr int kReps = 5;
      auto run_once = [&] {
        if (variant == 0) return moe_expert_ffn_grouped(p, stream);
        if (variant == 1) return detail::moe_expert_ffn_grouped_mma_sync(p, stream);
        return cublas_reference_ffn(p, offsets, handle, stream);
      };
      EXPECT_TRUE(run_once());  // warm-up
      DS_CUDA_OK(cudaEventRecord(start, stream));
      for (int i = 0; i < kReps; ++i) EXPECT_TRUE(run_once());
      DS_CUDA_OK(cudaEventRecord(stop, stream));
      DS_CUDA_OK(cudaEventSynchronize(stop));
      float ms = 0.0f;
      DS_CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
      ms /= kReps;
      std::printf("[ moe timing ] %s R=%lld W=%lld I=%lld: %.3f ms, %.1f TFLOP/s\n", names[variant],
                  static_cast<long long>(R), static_cast<long long>(W), static_cast<long long>(I), ms,
                  flops / (ms * 1e-3) / 1e12);
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  cublasDestroy(handle);
  DS_CUDA_OK(cudaStreamDestroy(stream));

  if (c.graph) {
    // The whole chain (router, plan, gather, FFN, combine), captured and replayed: no host sync or allocation
    // inside, identical results. Once with moe_expert_ffn_decode, once with the mma.sync kernels (at a 128-row
    // tile their launch sets the opt-in shared-memory attribute during the capture).
    for (const int variant : {0, 1}) {
      auto run_ffn = [&](cudaStream_t s) {
        return variant == 0 ? moe_expert_ffn_decode(p, s) : detail::moe_expert_ffn_grouped_mma_sync(p, s);
      };
      d.poison();
      ASSERT_TRUE(run_ffn(0));
      ASSERT_TRUE(d.combine(0));
      DS_CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> eager = download_out(d, "eager before graph");
      d.poison();
      cudaStream_t capture_stream = nullptr;
      DS_CUDA_OK(cudaStreamCreate(&capture_stream));
      cudaGraph_t graph = nullptr;
      DS_CUDA_OK(cudaStreamBeginCapture(capture_stream, cudaStreamCaptureModeThreadLocal));
      Status s1 = d.front(capture_stream);
      Status s2 = s1 ? run_ffn(capture_stream) : s1;
      Status s3 = s2 ? d.combine(capture_stream) : s2;
      DS_CUDA_OK(cudaStreamEndCapture(capture_stream, &graph));
      ASSERT_TRUE(s3) << "graph variant " << variant << ": " << s3.to_string();
      cudaGraphExec_t exec = nullptr;
      DS_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
      DS_CUDA_OK(cudaGraphLaunch(exec, capture_stream));
      DS_CUDA_OK(cudaStreamSynchronize(capture_stream));
      const std::vector<float> graph_out = download_out(d, "graph");
      expect_bitwise(graph_out, eager, "graph replay (variant " + std::to_string(variant) + ")");
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      DS_CUDA_OK(cudaStreamDestroy(capture_stream));
    }
  }
}

}  // namespace deltaserve::kernels::cuda::test
