// GPU small-batch MoE layer (moe_small_batch_route / moe_small_batch_experts, moe.hpp) vs the separate GPU launches
// it replaces and a CPU reference of the whole layer, ctest label gpu (launch 1 alone: moe_small_batch_route_test.cpp).
// Oracles and tolerances: what the layer adds to the residual vs the separate launches on the same logits
// (moe_route, moe_plan, moe_gather_rows, moe_expert_ffn_decode, moe_combine; the shared expert as a one-expert pass
// of the same kernels) and vs a CPU reference (float sums of bf16 weights and inputs, the activation rounded to bf16
// as the GPU stores it): relative L2 <= 2e-3 and max |a - b| <= 2e-2 · rms(ref), the bounds of the expert-FFN tests
// (fp32 sums in other orders, an occasional one-ulp bf16 flip of an activation near a rounding tie); eager vs eager
// and graph replay vs eager: bitwise (deterministic: no atomics in any sum).
// Outputs are NaN/sentinel-poisoned past what the launchers may write and checked afterwards; the grid counter must
// be back at 0 after every launch.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/basic_ops.hpp"
#include "kernels/cuda/gemm/small_batch.hpp"
#include "kernels/cuda/moe/moe.hpp"
#include "kernels/cuda/ops/ops.hpp"
#include "kernels/cuda/tests/gpu_test_graph.hpp"
#include "kernels/cuda/tests/kda_test_util.hpp"
#include "kernels/cuda/tests/moe_small_batch_test_util.hpp"
#include "kernels/cuda/tests/moe_test_util.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

void run_shared_activation_case(const SmallCase& c) {
  SCOPED_TRACE("shared activations " + describe_case(c));
  const HostLayer h = make_host(c);
  DeviceLayer d(c, h);
  d.poison(h);
  // Written by launch 2 (moe_small_batch_experts).
  ASSERT_TRUE(moe_small_batch_route(d.p, 0));
  ASSERT_TRUE(moe_small_batch_experts(d.p, 0));
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
  // token tiles.
  run_shared_activation_case({.E = 8, .k = 2, .hidden = 2304, .inter = 16, .shared_inter = 1024, .T = 5, .seed = 51});
  run_shared_activation_case({.E = 8, .k = 2, .hidden = 2304, .inter = 16, .shared_inter = 1024, .T = 11, .seed = 52});
}

// ---- the whole layer -------------------------------------------------------------------------------------------

void run_layer_case(const SmallCase& c) {
  SCOPED_TRACE("layer " + describe_case(c));
  const HostLayer h = make_host(c);
  DeviceLayer d(c, h);
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

  // The separate launches on the same logits, and the CPU.
  ChainBuffers b(c);
  d.reset_residual(h);
  const Status status = run_chain(c, d, b, d.logits.get(), 0);
  ASSERT_TRUE(status) << status.to_string();
  DS_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> chain = residual_delta(d.residual, h, c, "separate launches");
  const std::vector<int32_t> chain_ids = b.ids.download();
  ASSERT_EQ(chain_ids, std::vector<int32_t>(ids.begin(), ids.begin() + R)) << "moe_route picked other experts";
  expect_close(delta.data(), chain.data(), delta.size(), c.hidden, 2e-3, 2e-2,
               "small-batch layer vs separate launches");
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

TEST(MoeSmallBatch, SharedMemoryLimit) {
  // 17 staged x rows of hidden 8192 do not fit the gate/up launch's shared memory: not the small-batch path's shapes
  // (the engine runs the separate launches then), and the launchers refuse them before launching anything.
  EXPECT_FALSE(moe_small_batch_fits(16, 2, 8, 8192, 64, 64));
  EXPECT_TRUE(moe_small_batch_fits(16, 2, 8, 2304, 64, 64));
  const SmallCase c{.E = 8, .k = 2, .hidden = 8192, .inter = 64, .shared_inter = 64, .T = 16, .seed = 101};
  const HostLayer h = make_host(c);
  DeviceLayer d(c, h);
  EXPECT_EQ(moe_small_batch_route(d.p, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(moe_small_batch_experts(d.p, 0).code(), StatusCode::kInvalidArgument);
  d.expect_counter_zero("refused launch");
}

// Several layers back to back on one stream as the engine runs them: each one's inputs x (bf16) and x_f32 are
// rms_norm_dual of the residual the layer before just wrote, then the layer adds into that residual; the same
// buffers for every layer. Captured in one graph, the layer's launches start while the kernel before them drains (and
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
  for (const int64_t T : {1, 4}) {
    run_layer_chain_case({.E = 256,
                          .k = 8,
                          .hidden = 2304,
                          .inter = 1024,
                          .shared_inter = 1024,
                          .T = T,
                          .seed = static_cast<uint32_t>(110 + T)});
  }
}

// The input norm fused into the layer's launches (MoeSmallBatchParams::norm_weight) against the engine's unfused order:
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
  EXPECT_EQ(moe_small_batch_experts(d.p, 0).code(), StatusCode::kInvalidArgument);
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
  p.activated = reinterpret_cast<__nv_bfloat16*>(reinterpret_cast<uintptr_t>(p.activated) + 2);
  expect_invalid(p, "misaligned activated");
  p = d.p;
  p.tokens = 0;
  p.x = nullptr;
  EXPECT_TRUE(moe_small_batch_layer(p, 0)) << "T == 0 launches nothing";
  EXPECT_FALSE(moe_small_batch_fits(16, 17, 256, 2304, 1024, 1024));  // 272 assignments
  EXPECT_TRUE(moe_small_batch_fits(16, 16, 896, 3584, 3072, 0));
}

// ---- timing: the layer vs the separate launches, graph-replayed ------------------------------------------------

TEST(MoeDecodeLayerGpu, Timing) {
  constexpr int kReplays = 200;
  constexpr double kCopyBandwidth = 4.26e12;  // bytes/s, the H200's copy rate
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

    // The separate launches as the engine runs them above the layer's token limit: skinny fp32 router GEMM, route,
    // plan, gather, GEMV experts, combine, then the shared expert as skinny gate/up (fp32), glu, skinny down
    // accumulating into the residual.
    auto run_separate = [&](cudaStream_t stream) -> Status {
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

    // Correctness once, eagerly: the layer vs the separate launches (same experts unless the two routers' fp32 logits
    // split a near tie differently, which the ids check reports).
    d.poison(h);
    ASSERT_TRUE(moe_small_batch_layer(d.p, 0));
    DS_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> fresh = residual_delta(d.residual, h, c, "small-batch layer");
    const std::vector<int32_t> new_ids = d.ids.download();
    const std::vector<int32_t> offsets = d.offsets.download();
    int active = 0;
    for (int e = 0; e < c.E; ++e) active += offsets[e + 1] > offsets[e] ? 1 : 0;
    d.reset_residual(h);
    const Status status = run_separate(0);
    ASSERT_TRUE(status) << status.to_string();
    DS_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> separate = residual_delta(d.residual, h, c, "separate launches");
    ASSERT_EQ(std::vector<int32_t>(new_ids.begin(), new_ids.begin() + T * c.k), b.ids.download());
    expect_close(fresh.data(), separate.data(), fresh.size(), W, 2e-3, 2e-2, "layer vs separate launches");

    // Graph replays. 0: the layer as the engine runs it, 1: the separate launches, 2: launch 1 alone (router, route,
    // plan).
    cudaStream_t stream = nullptr;
    DS_CUDA_OK(cudaStreamCreate(&stream));
    double us[3] = {0.0, 0.0, 0.0};
    for (const int variant : {0, 1, 2}) {
      double ms = 0.0;
      ASSERT_NO_FATAL_FAILURE(time_graph_replays(
          stream, cudaStreamCaptureModeThreadLocal, 10, kReplays,
          [&](cudaStream_t s) {
            if (variant == 1) return run_separate(s);
            if (variant == 2) return moe_small_batch_route(d.p, s);
            return moe_small_batch_layer(d.p, s);
          },
          &ms));
      us[variant] = 1e3 * ms;
    }
    d.expect_counter_zero("timing replays");
    const double expert_bytes = 3.0 * W * c.inter * 2.0;
    const double bytes = active * expert_bytes + 3.0 * W * Is * 2.0 + static_cast<double>(c.E) * W * 4.0;
    const double floor_us = 1e6 * bytes / kCopyBandwidth;
    std::printf(
        "[ moe decode layer ] T=%2lld: layer %7.1f us (launch 1 alone %5.1f), separate launches %7.1f us (%.2fx); "
        "%3d experts + shared + router = %6.1f MB -> %6.1f us at 4.26 TB/s: layer at %.2f, separate at %.2f of it\n",
        static_cast<long long>(T), us[0], us[2], us[1], us[1] / us[0], active, bytes / 1e6, floor_us, floor_us / us[0],
        floor_us / us[1]);
    DS_CUDA_OK(cudaStreamDestroy(stream));
  }
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
