// GPU MoE (router, plan, gather, decode/prefill expert FFNs, combine) vs the CPU references, ctest label gpu.
// Oracles: cpu::moe_route for the router, a counting sort for the plan, and for the whole layer the engine's chain
// (cpu::linear + cpu::swiglu / cpu::situ_glu on bf16-representable weights and inputs, the activation rounded to
// bf16 as the GPU stores it, the weighted sum over j = 0..k-1).
// Tolerances:
//   router: expert ids exact; weights within 2 ulp-ish (|a - b| <= 1e-6 · max(1, |b|)): same fp32 operations;
//   plan, gather: exact;   combine: |a - b| <= 1e-5 · (1 + |b|) (fmaf chain, same order as the host);
//   expert FFN / whole layer: relative L2 <= 2e-3 and max |a - b| <= 2e-2 · rms(ref) — fp32 accumulation in another
//   order than the CPU, and an occasional one-ulp bf16 flip of an activation (2^-8 relative) near a rounding tie;
//   decode vs prefill path: the same bounds.
// Every output buffer is NaN/sentinel-poisoned beyond what the launcher may write and checked afterwards.
#include "kernels/cpu/moe.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include <cublas_v2.h>

#include "kernels/cpu/basic_ops.hpp"
#include "kernels/cuda/tests/kda_test_util.hpp"
#include "kernels/cuda/moe/moe.hpp"
#include "kernels/cuda/tests/moe_test_util.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

// ---- router -------------------------------------------------------------------------------------------------

struct RouteCase {
  int E = 8, k = 2, groups = 1, top_k_groups = 1;
  bool bias = true, renormalize = true;
  float scale = 1.0f;
  int T = 64;
  uint32_t seed = 1;
};

// Random logits plus rows with ties (equal logits, duplicated values), NaN and +-inf logits, and a row all NaN.
std::vector<float> router_logits(const RouteCase& c, std::mt19937& rng) {
  std::vector<float> logits = normal_vector(rng, static_cast<size_t>(c.T) * c.E, 0.0f, 2.0f);
  std::uniform_int_distribution<int> pick(0, c.E - 1);
  for (int t = 0; t < c.T; ++t) {
    float* row = &logits[static_cast<size_t>(t) * c.E];
    switch (t % 8) {
      case 1:  // all equal: ties everywhere
        std::fill(row, row + c.E, 0.25f);
        break;
      case 2:  // a few distinct values, many duplicates
        for (int e = 0; e < c.E; ++e) row[e] = static_cast<float>((e * 7 + t) % 3) - 1.0f;
        break;
      case 3:  // NaN in some places
        for (int i = 0; i < std::max(1, c.E / 4); ++i) row[pick(rng)] = kNaN;
        break;
      case 4:  // infinities
        row[pick(rng)] = INFINITY;
        row[pick(rng)] = -INFINITY;
        row[pick(rng)] = INFINITY;
        break;
      case 5:
        if (t % 16 == 5) std::fill(row, row + c.E, kNaN);  // every score NaN
        break;
      default:
        break;
    }
  }
  return logits;
}

void run_route_case(const RouteCase& c) {
  SCOPED_TRACE("E=" + std::to_string(c.E) + " k=" + std::to_string(c.k) + " groups=" + std::to_string(c.groups) + "/" +
               std::to_string(c.top_k_groups) + " bias=" + std::to_string(c.bias) +
               " renorm=" + std::to_string(c.renormalize) + " T=" + std::to_string(c.T));
  std::mt19937 rng(c.seed);
  const std::vector<float> logits = router_logits(c, rng);
  std::vector<float> bias;
  if (c.bias) {
    bias = normal_vector(rng, c.E, 0.0f, 0.05f);
    // Duplicate bias values so (s + bias) ties occur on the equal-logit rows.
    for (int e = 0; e < c.E; e += 3) bias[e] = 0.01f;
  }
  const int64_t T = c.T, k = c.k, pad = 7;
  DeviceBuffer<float> logits_d(logits.size() + 1), bias_d(std::max<size_t>(1, bias.size()));
  DeviceBuffer<int32_t> ids_d(T * k + pad);
  DeviceBuffer<float> w_d(T * k + pad);
  logits_d.upload(logits);
  if (c.bias) bias_d.upload(bias);
  ids_d.upload(std::vector<int32_t>(T * k + pad, kSentinel));
  w_d.upload(std::vector<float>(T * k + pad, kNaN));
  MoeRoutingConfig config;
  config.num_experts = c.E;
  config.top_k = c.k;
  config.num_groups = c.groups;
  config.top_k_groups = c.top_k_groups;
  config.renormalize = c.renormalize;
  config.routed_scaling_factor = c.scale;
  Status status = moe_route(config, logits_d.get(), c.bias ? bias_d.get() : nullptr, T, ids_d.get(), w_d.get(), 0);
  ASSERT_TRUE(status) << status.to_string();
  DS_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<int32_t> ids = ids_d.download();
  const std::vector<float> w = w_d.download();

  const cpu::MoeRouting routing{c.E, c.k, c.groups, c.top_k_groups, c.renormalize, c.scale};
  std::vector<int32_t> ref_ids(k);
  std::vector<float> ref_w(k);
  int failures = 0;
  for (int64_t t = 0; t < T && failures < 5; ++t) {
    cpu::moe_route(routing, &logits[t * c.E], c.bias ? bias.data() : nullptr, ref_ids.data(), ref_w.data());
    for (int64_t j = 0; j < k; ++j) {
      const int32_t got = ids[t * k + j];
      const float got_w = w[t * k + j];
      if (got != ref_ids[j] || !same_float(got_w, ref_w[j], 1e-6f)) {
        ++failures;
        std::string row;
        for (int64_t i = 0; i < k; ++i) {
          row += " (" + std::to_string(ids[t * k + i]) + " vs " + std::to_string(ref_ids[i]) + ", " +
                 std::to_string(w[t * k + i]) + " vs " + std::to_string(ref_w[i]) + ")";
        }
        const int32_t e = ref_ids[j];
        char detail[256];
        std::snprintf(detail, sizeof(detail), " | expected expert %d logit %.9g bias %.9g; got expert %d logit %.9g", e,
                      logits[t * c.E + e], c.bias ? bias[e] : 0.0f, got,
                      got >= 0 && got < c.E ? logits[t * c.E + got] : kNaN);
        ADD_FAILURE() << "token " << t << " choice " << j << ": gpu vs cpu (id, weight):" << row << detail;
        break;
      }
    }
  }
  for (int64_t i = T * k; i < T * k + pad; ++i) {
    EXPECT_EQ(ids[i], kSentinel) << "ids written past T*k at " << i;
    EXPECT_TRUE(std::isnan(w[i])) << "weights written past T*k at " << i;
  }
}

TEST(MoeRoute, MatchesCpuTiny) {
  run_route_case({.E = 8, .k = 2, .T = 64, .seed = 1});
  run_route_case({.E = 8, .k = 3, .bias = false, .T = 64, .seed = 2});
  run_route_case({.E = 8, .k = 8, .T = 16, .seed = 3});
  run_route_case({.E = 1, .k = 1, .T = 9, .seed = 4});
  run_route_case({.E = 33, .k = 5, .renormalize = false, .scale = 2.5f, .T = 40, .seed = 5});
}

TEST(MoeRoute, MatchesCpuLarge) {
  run_route_case({.E = 256, .k = 8, .scale = 2.446f, .T = 512, .seed = 11});
  run_route_case({.E = 256, .k = 8, .bias = false, .T = 256, .seed = 12});
  run_route_case({.E = 896, .k = 16, .T = 256, .seed = 13});
  run_route_case({.E = 1024, .k = 32, .T = 128, .seed = 14});
  run_route_case({.E = 300, .k = 7, .T = 100, .seed = 15});
}

TEST(MoeRoute, MatchesCpuGrouped) {
  run_route_case({.E = 256, .k = 8, .groups = 8, .top_k_groups = 4, .T = 256, .seed = 21});
  run_route_case({.E = 64, .k = 6, .groups = 8, .top_k_groups = 3, .bias = false, .T = 128, .seed = 22});
  run_route_case({.E = 16, .k = 4, .groups = 16, .top_k_groups = 4, .T = 64, .seed = 23});  // groups of one
  run_route_case({.E = 1024, .k = 32, .groups = 32, .top_k_groups = 8, .T = 64, .seed = 24});
  run_route_case({.E = 8, .k = 4, .groups = 2, .top_k_groups = 2, .renormalize = false, .T = 32, .seed = 25});
}

TEST(MoeRoute, RejectsBadConfig) {
  float* f = reinterpret_cast<float*>(256);
  int32_t* ids = reinterpret_cast<int32_t*>(256);
  auto route = [&](int E, int k, int G, int KG, int64_t T) {
    MoeRoutingConfig config;
    config.num_experts = E;
    config.top_k = k;
    config.num_groups = G;
    config.top_k_groups = KG;
    return moe_route(config, f, nullptr, T, ids, f, 0);
  };
  EXPECT_EQ(route(0, 1, 1, 1, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(route(1025, 1, 1, 1, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(route(8, 0, 1, 1, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(route(64, 33, 1, 1, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(route(8, 9, 1, 1, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(route(8, 2, 3, 1, 1).code(), StatusCode::kInvalidArgument);  // groups do not divide E
  EXPECT_EQ(route(8, 2, 2, 3, 1).code(), StatusCode::kInvalidArgument);  // top_k_groups > groups
  EXPECT_EQ(route(8, 5, 4, 2, 1).code(), StatusCode::kInvalidArgument);  // k > kept experts (2 groups of 2)
  EXPECT_EQ(route(8, 2, 1, 1, -1).code(), StatusCode::kInvalidArgument);
  MoeRoutingConfig config;
  config.num_experts = 8;
  config.top_k = 2;
  EXPECT_EQ(moe_route(config, nullptr, nullptr, 1, ids, f, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(moe_route(config, nullptr, nullptr, 0, nullptr, nullptr, 0));  // T == 0: nothing to do
  config.routed_scaling_factor = kNaN;
  EXPECT_EQ(moe_route(config, f, nullptr, 1, ids, f, 0).code(), StatusCode::kInvalidArgument);
}

// ---- plan, gather, combine ----------------------------------------------------------------------------------

// Checks the plan of `ids` against a host counting sort; ids outside [0, E) are left out of every expert.
void check_plan(const std::vector<int32_t>& ids, int64_t T, int k, int E, PlanBuffers& b, int pad) {
  const int64_t n = T * k;
  const std::vector<int32_t> offsets = b.offsets.download(), sorted = b.sorted.download(), pos = b.pos.download();
  std::vector<int32_t> ref_offsets(E + 1, 0);
  for (int64_t a = 0; a < n; ++a) {
    if (ids[a] >= 0 && ids[a] < E) ++ref_offsets[ids[a] + 1];
  }
  for (int e = 0; e < E; ++e) ref_offsets[e + 1] += ref_offsets[e];
  for (int e = 0; e <= E; ++e) {
    ASSERT_EQ(offsets[e], ref_offsets[e]) << "expert_offsets[" << e << "]";
  }
  // Stable order: valid assignments by (expert, a), then the out-of-range ones by a.
  std::vector<int32_t> ref_sorted(n);
  std::iota(ref_sorted.begin(), ref_sorted.end(), 0);
  auto key = [&](int32_t a) { return (ids[a] >= 0 && ids[a] < E) ? ids[a] : E; };
  std::stable_sort(ref_sorted.begin(), ref_sorted.end(), [&](int32_t a, int32_t c) { return key(a) < key(c); });
  for (int64_t p = 0; p < n; ++p) {
    ASSERT_EQ(sorted[p], ref_sorted[p]) << "sorted_assignments[" << p << "] (expert " << key(ref_sorted[p]) << ")";
  }
  std::vector<int32_t> ref_pos(n, -1);
  for (int64_t p = 0; p < n; ++p) {
    if (key(ref_sorted[p]) < E) ref_pos[ref_sorted[p]] = static_cast<int32_t>(p);
  }
  for (int64_t a = 0; a < n; ++a) {
    ASSERT_EQ(pos[a], ref_pos[a]) << "assignment_pos[" << a << "] (expert id " << ids[a] << ")";
  }
  for (int i = 0; i < pad; ++i) {
    EXPECT_EQ(offsets[E + 1 + i], kSentinel) << "expert_offsets written past E";
    EXPECT_EQ(sorted[n + i], kSentinel) << "sorted_assignments written past T*k";
    EXPECT_EQ(pos[n + i], kSentinel) << "assignment_pos written past T*k";
  }
}

void run_plan_case(int64_t T, int k, int E, bool skewed, bool invalid_ids, uint32_t seed) {
  SCOPED_TRACE("plan T=" + std::to_string(T) + " k=" + std::to_string(k) + " E=" + std::to_string(E) +
               (skewed ? " skewed" : "") + (invalid_ids ? " invalid-ids" : ""));
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> expert(0, E - 1);
  const int64_t n = T * k;
  std::vector<int32_t> ids(std::max<int64_t>(n, 1));
  for (int64_t t = 0; t < T; ++t) {
    for (int j = 0; j < k; ++j) {
      int32_t e = expert(rng);
      if (skewed && j == 0) e = 0;  // expert 0 gets a row of every token: spans many tiles
      if (skewed && j == 1 && E > 1) e = E - 1;
      ids[t * k + j] = e;
    }
  }
  if (invalid_ids && n >= 3) {
    ids[0] = -1;
    ids[n / 2] = E;
    ids[n - 1] = 1 << 30;
  }
  const int pad = 5;
  PlanBuffers b(T, k, E, pad);
  DeviceBuffer<int32_t> ids_d(ids.size());
  ids_d.upload(ids);
  b.offsets.upload(std::vector<int32_t>(E + 1 + pad, kSentinel));
  b.sorted.upload(std::vector<int32_t>(n + pad, kSentinel));
  b.pos.upload(std::vector<int32_t>(n + pad, kSentinel));
  Status status = moe_plan(ids_d.get(), T, k, E, b.plan, b.workspace.get(), b.workspace_bytes, 0);
  ASSERT_TRUE(status) << status.to_string();
  DS_CUDA_OK(cudaDeviceSynchronize());
  check_plan(ids, T, k, E, b, pad);
}

TEST(MoePlan, Invariants) {
  run_plan_case(0, 8, 256, false, false, 1);
  run_plan_case(1, 2, 8, false, false, 2);
  run_plan_case(5, 3, 8, false, false, 3);
  run_plan_case(1, 8, 256, false, false, 4);
  run_plan_case(300, 8, 256, false, false, 5);   // 10 tiles
  run_plan_case(300, 8, 256, true, false, 6);    // one expert across every tile
  run_plan_case(1000, 16, 896, true, false, 7);  // 63 tiles, 897 buckets
  run_plan_case(257, 3, 2000, false, false, 8);  // E > 1024: chunked scan
  run_plan_case(64, 4, 8, false, true, 9);       // out-of-range ids
  run_plan_case(4096, 8, 256, false, false, 10);
}

TEST(MoePlan, RejectsBadInputs) {
  PlanBuffers b(4, 2, 8, 0);
  const int32_t* ids = reinterpret_cast<const int32_t*>(256);
  EXPECT_EQ(moe_plan(ids, -1, 2, 8, b.plan, b.workspace.get(), b.workspace_bytes, 0).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(moe_plan(ids, 4, 0, 8, b.plan, b.workspace.get(), b.workspace_bytes, 0).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(moe_plan(ids, 4, 2, 0, b.plan, b.workspace.get(), b.workspace_bytes, 0).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(moe_plan(ids, 4, 2, 8, b.plan, b.workspace.get(), b.workspace_bytes - 1, 0).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(moe_plan(ids, 4, 2, 8, b.plan, nullptr, b.workspace_bytes, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(moe_plan(ids, 4, 2, 8, b.plan, b.workspace.get() + 4, b.workspace_bytes, 0).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(moe_plan(nullptr, 4, 2, 8, b.plan, b.workspace.get(), b.workspace_bytes, 0).code(),
            StatusCode::kInvalidArgument);
  MoePlan bad = b.plan;
  bad.assignment_pos = nullptr;
  EXPECT_EQ(moe_plan(ids, 4, 2, 8, bad, b.workspace.get(), b.workspace_bytes, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(moe_plan(ids, int64_t{1} << 30, 4, 8, b.plan, b.workspace.get(), b.workspace_bytes, 0).code(),
            StatusCode::kInvalidArgument);
  EXPECT_GT(moe_plan_workspace_bytes(0, 8, 256), 0u);
}

void run_gather_combine_case(int64_t T, int k, int E, int64_t width, int64_t stride_pad, bool accumulate,
                             uint32_t seed) {
  SCOPED_TRACE("gather/combine T=" + std::to_string(T) + " k=" + std::to_string(k) + " width=" + std::to_string(width) +
               " stride pad=" + std::to_string(stride_pad) + (accumulate ? " accumulate" : ""));
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> expert(0, E - 1);
  const int64_t n = T * k, stride = width + stride_pad;
  // Distinct experts per token (like the router).
  std::vector<int32_t> ids(n);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> all(E);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    for (int j = 0; j < k; ++j) ids[t * k + j] = all[j];
  }
  PlanBuffers b(T, k, E, 0);
  DeviceBuffer<int32_t> ids_d(std::max<int64_t>(n, 1));
  if (n > 0) ids_d.upload(ids);
  ASSERT_TRUE(moe_plan(ids_d.get(), T, k, E, b.plan, b.workspace.get(), b.workspace_bytes, 0));
  const std::vector<float> x = normal_vector(rng, T * stride);
  DeviceBuffer<__nv_bfloat16> x_d(std::max<int64_t>(T * stride, 1)), g_d(n * width + 8);
  if (T > 0) x_d.upload(to_bf16(x));
  g_d.upload(std::vector<__nv_bfloat16>(n * width + 8, bf16_nan()));
  Status status = moe_gather_rows(x_d.get(), stride, b.plan, T, k, width, g_d.get(), 0);
  ASSERT_TRUE(status) << status.to_string();

  const std::vector<float> y = normal_vector(rng, n * width);
  const std::vector<float> w = normal_vector(rng, n, 0.3f, 0.2f);
  std::vector<float> out(T * stride + 3, kNaN);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < width; ++c) out[t * stride + c] = accumulate ? 0.5f * static_cast<float>(c % 7) : kNaN;
  }
  DeviceBuffer<float> y_d(std::max<int64_t>(n * width, 1)), w_d(std::max<int64_t>(n, 1)), out_d(out.size());
  if (n > 0) {
    y_d.upload(y);
    w_d.upload(w);
  }
  out_d.upload(out);
  status = moe_combine(y_d.get(), b.plan, w_d.get(), T, k, width, accumulate, out_d.get(), stride, 0);
  ASSERT_TRUE(status) << status.to_string();
  DS_CUDA_OK(cudaDeviceSynchronize());
  if (n == 0) {  // nothing may be written
    for (float v : out_d.download()) EXPECT_TRUE(std::isnan(v)) << "combine wrote with T == 0";
    return;
  }

  const std::vector<int32_t> sorted = b.sorted.download(), pos = b.pos.download();
  const std::vector<__nv_bfloat16> g = g_d.download();
  for (int64_t p = 0; p < n; ++p) {
    const int64_t t = sorted[p] / k;
    for (int64_t c = 0; c < width; ++c) {
      const float expected = bf16_round(x[t * stride + c]), got = __bfloat162float(g[p * width + c]);
      ASSERT_EQ(got, expected) << "gather row " << p << " (token " << t << ") col " << c;
    }
  }
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(std::isnan(__bfloat162float(g[n * width + i]))) << "gather wrote past end";

  const std::vector<float> got = out_d.download();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < stride; ++c) {
      const float actual = got[t * stride + c];
      if (c >= width) {
        ASSERT_TRUE(std::isnan(actual)) << "combine wrote the stride gap at token " << t << " col " << c;
        continue;
      }
      float sum = 0.0f;
      for (int j = 0; j < k; ++j) sum = std::fma(w[t * k + j], y[pos[t * k + j] * width + c], sum);
      const float expected = accumulate ? out[t * stride + c] + sum : sum;
      ASSERT_LE(std::fabs(actual - expected), 1e-5f * (1.0f + std::fabs(expected)))
          << "combine token " << t << " col " << c << ": expected " << expected << " actual " << actual;
    }
  }
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(std::isnan(got[T * stride + i])) << "combine wrote past the end";
}

TEST(MoeGatherCombine, MatchesHost) {
  run_gather_combine_case(1, 2, 8, 32, 0, false, 1);
  run_gather_combine_case(7, 3, 8, 64, 8, true, 2);
  run_gather_combine_case(5, 2, 8, 37, 3, false, 3);  // odd width: scalar paths
  run_gather_combine_case(5, 2, 8, 37, 3, true, 4);
  run_gather_combine_case(64, 8, 256, 2304, 16, false, 5);
  run_gather_combine_case(0, 8, 256, 2304, 0, false, 6);
}

TEST(MoeGatherCombine, RejectsBadInputs) {
  MoePlan plan;
  plan.expert_offsets = plan.sorted_assignments = plan.assignment_pos = reinterpret_cast<int32_t*>(256);
  auto* x = reinterpret_cast<__nv_bfloat16*>(256);
  auto* f = reinterpret_cast<float*>(256);
  EXPECT_EQ(moe_gather_rows(x, 31, plan, 2, 2, 32, x, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(moe_gather_rows(nullptr, 32, plan, 2, 2, 32, x, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(moe_gather_rows(x, 32, plan, 2, 0, 32, x, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(moe_combine(f, plan, f, 2, 2, 32, false, f, 31, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(moe_combine(f, plan, nullptr, 2, 2, 32, false, f, 32, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(moe_combine(f, plan, f, -1, 2, 32, false, f, 32, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(moe_combine(nullptr, plan, nullptr, 0, 2, 32, false, nullptr, 32, 0));
}

// ---- the whole layer ----------------------------------------------------------------------------------------

enum class Path { kDecode, kPrefill, kBoth };

struct LayerCase {
  int E = 8, k = 2;
  int64_t width = 32, inter = 16, T = 4;
  GluKind glu = GluKind::kSwiGlu;
  Path path = Path::kBoth;
  bool concentrate = false;  // bias pushes every token to experts 0 and 1 (many rows per expert, empty experts)
  bool hot_expert = false;   // bias pushes every token to expert 0 (it gets T of the T * k rows: half at k = 2)
  bool graph = false;        // also replay the decode chain as a CUDA graph and require identical results
  // Grouped tensor-core path (moe_expert_ffn_grouped): row tiles to run explicitly (0 = automatic; 128 runs with
  // both column tiles, 128 and 256); each is checked against the CPU reference and against the reference path
  // (cuBLAS if it ran, else the GEMV decode kernels).
  std::vector<int> grouped_tiles = {0, 32, 64, 128};
  bool time_paths = false;       // print event timings of the grouped and the cuBLAS reference path (no assertion)
  int64_t ref_token_stride = 1;  // CPU reference on every n-th token only (big cases)
  uint32_t seed = 1;
};

// CPU reference of the routed experts for the tokens t % stride == 0: out[t, :] = Σ_j w[t, j] · expert(x_t).
std::vector<float> reference_layer(const LayerCase& c, const std::vector<float>& x,
                                   const std::vector<__nv_bfloat16>& gate_up, const std::vector<__nv_bfloat16>& down,
                                   const std::vector<int32_t>& ids, const std::vector<float>& w) {
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
  DeviceBuffer<float> y_sorted, out, workspace;
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
        out(c.T * (W + 4) + 1),
        workspace(moe_ffn_prefill_workspace_bytes(R, I) / sizeof(float) + 4) {}

  MoeFfnParams ffn(const LayerCase& c) const {
    MoeFfnParams p;
    p.weights = {gate_up.get(), down.get(), E, W, I};
    p.glu = c.glu;
    p.rows = R;
    p.x_sorted = x_sorted.get();
    p.expert_offsets = plan.plan.expert_offsets;
    p.activated = activated.get();
    p.y_sorted = y_sorted.get();
    p.workspace = workspace.get();
    p.workspace_bytes = workspace.size() * sizeof(float);
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
std::vector<float> download_out(LayerDevice& d, const std::string& what) {
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

void run_layer_case(const LayerCase& c) {
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

  // Reference paths first: the GEMV decode kernels and the per-expert cuBLAS loop (use_reference_path).
  std::vector<float> decode_out, prefill_out;
  if (c.path != Path::kPrefill) {
    d.poison();
    MoeFfnParams p = d.ffn(c);
    p.use_reference_path = true;
    status = moe_expert_ffn_decode(p, 0);
    ASSERT_TRUE(status) << status.to_string();
    ASSERT_TRUE(d.combine(0));
    DS_CUDA_OK(cudaDeviceSynchronize());
    decode_out = download_out(d, "decode (GEMV)");
    expect_close(select(decode_out).data(), ref_sel.data(), ref_sel.size(), W, 2e-3, 2e-2, "decode GEMV path vs CPU");
  }
  cublasHandle_t handle = nullptr;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  cudaStream_t stream = nullptr;
  DS_CUDA_OK(cudaStreamCreate(&stream));
  if (c.path != Path::kDecode) {
    d.poison();
    MoeFfnParams p = d.ffn(c);
    p.use_reference_path = true;
    status = moe_expert_ffn_prefill(p, offsets, handle, stream);
    EXPECT_TRUE(status) << status.to_string();
    EXPECT_TRUE(d.combine(stream));
    DS_CUDA_OK(cudaStreamSynchronize(stream));
    prefill_out = download_out(d, "prefill (cuBLAS)");
    expect_close(select(prefill_out).data(), ref_sel.data(), ref_sel.size(), W, 2e-3, 2e-2,
                 "prefill cuBLAS path vs CPU");
  }
  if (!decode_out.empty() && !prefill_out.empty()) {
    expect_close(decode_out.data(), prefill_out.data(), decode_out.size(), W, 2e-3, 2e-2,
                 "decode GEMV vs prefill cuBLAS path");
  }
  const std::vector<float>& reference_out = !prefill_out.empty() ? prefill_out : decode_out;
  const char* reference_name = !prefill_out.empty() ? "cuBLAS reference path" : "GEMV reference path";

  // The grouped path at each requested row tile, then through the default entry points (which dispatch to it).
  std::vector<float> grouped_auto_out;
  auto check_new_path = [&](const std::string& name, const std::vector<float>& out) {
    expect_close(select(out).data(), ref_sel.data(), ref_sel.size(), W, 2e-3, 2e-2, name + " vs CPU");
    if (!reference_out.empty()) {
      expect_close(out.data(), reference_out.data(), out.size(), W, 2e-3, 2e-2,
                   name + " vs " + std::string(reference_name));
    }
  };
  struct GroupedTile {
    int row_tile, col_tile, k_tile;
  };
  std::vector<GroupedTile> tiles;
  for (const int tile : c.grouped_tiles) {
    if (tile == 128) {
      // Both k tiles at both column tiles: k_tile 32 is the previous kernel (fallback), 64 the automatic one.
      for (const int col_tile : {128, 256}) {
        for (const int k_tile : {32, 64}) tiles.push_back({128, col_tile, k_tile});
      }
    } else {
      tiles.push_back({tile, 0, 0});
    }
  }
  for (const auto& [tile, col_tile, k_tile] : tiles) {
    const std::string name = "grouped path (row_tile " + std::to_string(tile) + ", col_tile " +
                             std::to_string(col_tile) + ", k_tile " + std::to_string(k_tile) + ", auto row tile " +
                             std::to_string(moe_grouped_row_tile(R, c.E)) + ", auto k tile " +
                             std::to_string(moe_grouped_auto_k_tile()) + ")";
    SCOPED_TRACE(name);
    d.poison();
    MoeFfnParams p = d.ffn(c);
    p.row_tile = tile;
    p.col_tile = col_tile;
    p.k_tile = k_tile;
    p.full_row_tiles = k_tile == 32;  // 128-row tiles at k_tile 32: exactly the previous kernel
    status = moe_expert_ffn_grouped(p, stream);
    ASSERT_TRUE(status) << status.to_string();
    EXPECT_TRUE(d.combine(stream));
    DS_CUDA_OK(cudaStreamSynchronize(stream));
    const std::vector<float> out = download_out(d, name);
    check_new_path(name, out);
    if (tile == 0) grouped_auto_out = out;
  }
  if (!c.grouped_tiles.empty()) {
    // moe_expert_ffn_prefill's default is the grouped path (automatic tile): bitwise the same as calling it.
    d.poison();
    status = moe_expert_ffn_prefill(d.ffn(c), offsets, handle, stream);
    EXPECT_TRUE(status) << status.to_string();
    EXPECT_TRUE(d.combine(stream));
    DS_CUDA_OK(cudaStreamSynchronize(stream));
    const std::vector<float> out = download_out(d, "prefill default");
    check_new_path("prefill default (grouped)", out);
    if (!grouped_auto_out.empty()) {
      for (size_t i = 0; i < out.size(); ++i) {
        ASSERT_EQ(out[i], grouped_auto_out[i]) << "prefill default differs from moe_expert_ffn_grouped at " << i;
      }
    }
    // moe_expert_ffn_decode's default: GEMV kernels up to 4 rows per expert, the grouped path beyond.
    d.poison();
    status = moe_expert_ffn_decode(d.ffn(c), stream);
    EXPECT_TRUE(status) << status.to_string();
    EXPECT_TRUE(d.combine(stream));
    DS_CUDA_OK(cudaStreamSynchronize(stream));
    const std::vector<float> out2 = download_out(d, "decode default");
    check_new_path(R > kMoeDecodeGemvRowsPerExpert * c.E ? "decode default (grouped)" : "decode default (GEMV)", out2);
  }
  if (c.path != Path::kDecode) {
    // The cuBLAS grouped path (DELTASERVE_MOE_PREFILL=cublas-grouped): with the caller's host offsets, handle and
    // fp32 workspace, then as the selector calls it (offsets copied from the device, cached handle, gate/up product
    // in the y_sorted buffer). Compared with the CPU and with the current default (grouped kernel or reference).
    // If cuBLAS only takes bf16 C for gate/up, the product is rounded to bf16 before the glu: looser bounds
    // (2^-9 relative per gate/up value on top of the activation's rounding).
    const std::vector<float>& current = !grouped_auto_out.empty() ? grouped_auto_out : reference_out;
    const std::string current_name = !grouped_auto_out.empty() ? "grouped kernel (auto tile)" : reference_name;
    for (const int variant : {0, 1}) {
      d.poison();
      MoeFfnParams p = d.ffn(c);
      if (variant == 1) {
        p.workspace = nullptr;
        p.workspace_bytes = 0;
      }
      status = variant == 0 ? moe_expert_ffn_cublas_grouped(p, offsets.data(), handle, stream)
                            : moe_expert_ffn_cublas_grouped(p, nullptr, nullptr, stream);
      const std::string name = std::string("cuBLAS grouped path (") +
                               (variant == 0 ? "host offsets, fp32 workspace" : "device offsets, no workspace") + "; " +
                               moe_cublas_grouped_mode() + ")";
      SCOPED_TRACE(name);
      if (variant == 1 && status.code() == StatusCode::kInvalidArgument && c.inter > c.width) {
        continue;  // no room for the gate/up product without a workspace: declined (the kernels run instead)
      }
      ASSERT_TRUE(status) << name << ": " << status.to_string();
      EXPECT_TRUE(d.combine(stream));
      DS_CUDA_OK(cudaStreamSynchronize(stream));
      const std::vector<float> out = download_out(d, name);
      const bool bf16_h = std::string(moe_cublas_grouped_mode()).find("gate_up C bf16") != std::string::npos;
      const double l2 = bf16_h ? 5e-3 : 2e-3, mx = bf16_h ? 4e-2 : 2e-2;
      expect_close(select(out).data(), ref_sel.data(), ref_sel.size(), W, l2, mx, name + " vs CPU");
      if (!current.empty()) {
        expect_close(out.data(), current.data(), out.size(), W, l2, mx, name + " vs " + current_name);
      }
    }
  }
  if (c.time_paths) {
    // Event timings, informational: the two FFN GEMMs of one layer (expert FLOPs 6 * R * W * I).
    cudaEvent_t start = nullptr, stop = nullptr;
    DS_CUDA_OK(cudaEventCreate(&start));
    DS_CUDA_OK(cudaEventCreate(&stop));
    const double flops = 6.0 * static_cast<double>(R) * static_cast<double>(W) * static_cast<double>(I);
    // Variants: grouped automatic, grouped 128 x 128, cuBLAS reference, grouped 128 x 256 with k_tile 32 and full
    // row tiles (the previous automatic prefill kernel), grouped 128 x 256 with k_tile 64 (skipping empty m16 tiles).
    const char* names[] = {"grouped (auto tile)", "grouped 128x128",
                           "cuBLAS per-expert",   "grouped 128x256 k32 full tiles (previous)",
                           "grouped 128x256 k64", "cuBLAS grouped"};
    for (const int variant : {0, 1, 2, 3, 4, 5}) {
      const bool reference = variant == 2;
      MoeFfnParams p = d.ffn(c);
      p.use_reference_path = reference;
      if (variant == 1) {
        p.row_tile = 128;
        p.col_tile = 128;
      }
      if (variant >= 3) {
        p.row_tile = 128;
        p.col_tile = 256;
        p.k_tile = variant == 3 ? 32 : 64;
        p.full_row_tiles = variant == 3;
      }
      constexpr int kReps = 5;
      // Variant 5: one cublasGemmGroupedBatchedEx per GEMM (host offsets given, as moe_expert_ffn_prefill has them;
      // includes the pointer staging and its copy).
      auto run_once = [&] {
        return variant == 5 ? moe_expert_ffn_cublas_grouped(p, offsets.data(), handle, stream)
                            : moe_expert_ffn_prefill(p, offsets, handle, stream);
      };
      EXPECT_TRUE(run_once());  // warm-up
      DS_CUDA_OK(cudaEventRecord(start, stream));
      for (int i = 0; i < kReps; ++i) EXPECT_TRUE(run_once());
      DS_CUDA_OK(cudaEventRecord(stop, stream));
      DS_CUDA_OK(cudaEventSynchronize(stop));
      float ms = 0.0f;
      DS_CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
      ms /= kReps;
      std::printf("[ moe timing ] %s%s%s%s R=%lld W=%lld I=%lld: %.3f ms, %.1f TFLOP/s\n", names[variant],
                  variant == 5 ? " (" : "", variant == 5 ? moe_cublas_grouped_mode() : "", variant == 5 ? ")" : "",
                  static_cast<long long>(R), static_cast<long long>(W), static_cast<long long>(I), ms,
                  flops / (ms * 1e-3) / 1e12);
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  cublasDestroy(handle);
  DS_CUDA_OK(cudaStreamDestroy(stream));

  if (c.graph) {
    // The decode chain, captured and replayed: no host sync or allocation inside, identical results. Once with
    // moe_expert_ffn_decode's default (GEMV or grouped, by rows per expert), once with the grouped path at a
    // 128-row tile (its launch sets the opt-in shared-memory attribute during the capture).
    for (const int variant : {0, 1}) {
      MoeFfnParams p = d.ffn(c);
      if (variant == 1) p.row_tile = 128;
      auto run_ffn = [&](cudaStream_t s) {
        return variant == 0 ? moe_expert_ffn_decode(p, s) : moe_expert_ffn_grouped(p, s);
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
      for (size_t i = 0; i < graph_out.size(); ++i) {
        ASSERT_EQ(graph_out[i], eager[i]) << "graph replay (variant " << variant << ") differs at " << i;
      }
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      DS_CUDA_OK(cudaStreamDestroy(capture_stream));
    }
  }
}

TEST(MoeLayer, TinySwiGlu) {
  run_layer_case({.E = 8, .k = 2, .width = 32, .inter = 16, .T = 1, .graph = true, .seed = 1});
  run_layer_case({.E = 8, .k = 2, .width = 32, .inter = 16, .T = 5, .seed = 2});
  run_layer_case({.E = 8, .k = 3, .width = 64, .inter = 32, .T = 13, .graph = true, .seed = 3});
  run_layer_case({.E = 8, .k = 3, .width = 64, .inter = 24, .T = 64, .seed = 4});  // I not a multiple of 16
}

TEST(MoeLayer, TinySitu) {
  run_layer_case({.E = 8, .k = 2, .width = 32, .inter = 16, .T = 3, .glu = GluKind::kSitu, .seed = 5});
  run_layer_case({.E = 8, .k = 3, .width = 64, .inter = 32, .T = 40, .glu = GluKind::kSitu, .seed = 6});
}

TEST(MoeLayer, EmptyExpertsAndManyRowsPerExpert) {
  // Every token picks experts 0 and 1: 6 empty experts, T rows each for 0 and 1 (decode row tiles of 4 loop).
  run_layer_case({.E = 8, .k = 2, .width = 32, .inter = 16, .T = 1, .concentrate = true, .seed = 7});
  run_layer_case({.E = 8, .k = 2, .width = 64, .inter = 32, .T = 23, .concentrate = true, .graph = true, .seed = 8});
  run_layer_case({.E = 8, .k = 3, .width = 64, .inter = 32, .T = 50, .concentrate = true, .seed = 9});
}

TEST(MoeLayer, Kimi48BDecode) {
  for (int64_t T : {1, 8, 64}) {
    run_layer_case({.E = 256,
                    .k = 8,
                    .width = 2304,
                    .inter = 1024,
                    .T = T,
                    .path = Path::kBoth,
                    .graph = T == 8,
                    .seed = static_cast<uint32_t>(100 + T)});
  }
}

TEST(MoeLayer, Kimi48BPrefill) {
  // CPU reference on every 8th token (64 of 512); decode and prefill paths compared on all tokens.
  run_layer_case({.E = 256,
                  .k = 8,
                  .width = 2304,
                  .inter = 1024,
                  .T = 512,
                  .path = Path::kBoth,
                  .ref_token_stride = 8,
                  .seed = 200});
}

TEST(MoeLayer, K3ShapeDecode) {
  // K3 expert shapes (latent width 3584, I = 3072) with fewer experts to keep the weights small; k = 16 of 32.
  run_layer_case({.E = 32, .k = 16, .width = 3584, .inter = 3072, .T = 2, .path = Path::kBoth, .seed = 300});
}

// ---- grouped tensor-core path (moe_expert_ffn_grouped) at served shapes -------------------------------------------
// run_layer_case checks each grouped row tile against the CPU reference (every ref_token_stride-th token) and against
// the reference path on all tokens, then the default entry points (prefill: grouped; decode: grouped above 4 rows
// per expert).

TEST(MoeGrouped, Kimi48BPrefillChunks) {
  // 8192-token chunks are the engine's prefill unit: E = 256, k = 8 gives R = 65536 rows, ~256 per expert.
  for (int64_t T : {64, 512, 2048, 8192}) {
    run_layer_case({.E = 256,
                    .k = 8,
                    .width = 2304,
                    .inter = 1024,
                    .T = T,
                    .path = Path::kPrefill,
                    .grouped_tiles = T >= 2048 ? std::vector<int>{0, 64, 128} : std::vector<int>{0, 32, 64, 128},
                    .time_paths = T >= 2048,
                    .ref_token_stride = std::max<int64_t>(1, T / 64),
                    .seed = static_cast<uint32_t>(400 + T)});
  }
}

TEST(MoeGrouped, Kimi48BMidSizeDecode) {
  // Decode batches B = 128 (4 rows per expert: GEMV by default) and B = 256 (8: grouped by default, captured).
  for (int64_t T : {128, 256}) {
    run_layer_case({.E = 256,
                    .k = 8,
                    .width = 2304,
                    .inter = 1024,
                    .T = T,
                    .path = Path::kBoth,
                    .graph = T == 256,
                    .ref_token_stride = T / 32,
                    .seed = static_cast<uint32_t>(450 + T)});
  }
}

TEST(MoeGrouped, UnbalancedRouting) {
  // Expert 0 takes every token: half of all rows at k = 2 (2048 of 4096), 1/8 at k = 8; many experts empty.
  run_layer_case({.E = 8, .k = 2, .width = 64, .inter = 32, .T = 37, .hot_expert = true, .graph = true, .seed = 10});
  run_layer_case({.E = 256,
                  .k = 2,
                  .width = 2304,
                  .inter = 1024,
                  .T = 2048,
                  .path = Path::kPrefill,
                  .hot_expert = true,
                  .ref_token_stride = 32,
                  .seed = 500});
  run_layer_case({.E = 256,
                  .k = 8,
                  .width = 2304,
                  .inter = 1024,
                  .T = 512,
                  .path = Path::kBoth,
                  .hot_expert = true,
                  .ref_token_stride = 8,
                  .seed = 501});
}

TEST(MoeGrouped, K3Shapes) {
  // K3 expert shapes (latent width 3584, I = 3072) with E = 64 (k = 8) to keep the weights at ~4 GB.
  for (int64_t T : {2, 64, 512}) {
    run_layer_case({.E = 64,
                    .k = 8,
                    .width = 3584,
                    .inter = 3072,
                    .T = T,
                    .path = T <= 64 ? Path::kBoth : Path::kPrefill,
                    .graph = T == 64,
                    .ref_token_stride = std::max<int64_t>(1, T / 32),
                    .seed = static_cast<uint32_t>(600 + T)});
  }
}

TEST(MoeGrouped, RejectsBadInputs) {
  MoeFfnParams p;
  auto* bf = reinterpret_cast<__nv_bfloat16*>(256);
  p.weights = {bf, bf, 8, 64, 32};
  p.rows = 4;
  p.x_sorted = bf;
  p.expert_offsets = reinterpret_cast<const int32_t*>(256);
  p.activated = bf;
  p.y_sorted = reinterpret_cast<float*>(256);
  MoeFfnParams q = p;
  q.weights.width = 60;
  EXPECT_EQ(moe_expert_ffn_grouped(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.weights.intermediate = 4;
  EXPECT_EQ(moe_expert_ffn_grouped(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.weights.num_experts = 0;
  EXPECT_EQ(moe_expert_ffn_grouped(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.weights.num_experts = kMoeMaxExperts + 1;
  EXPECT_EQ(moe_expert_ffn_grouped(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.row_tile = 48;
  EXPECT_EQ(moe_expert_ffn_grouped(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.x_sorted = bf + 4;  // 8-byte aligned only
  EXPECT_EQ(moe_expert_ffn_grouped(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.y_sorted = reinterpret_cast<float*>(260);  // 4-byte aligned only
  EXPECT_EQ(moe_expert_ffn_grouped(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.expert_offsets = nullptr;
  EXPECT_EQ(moe_expert_ffn_grouped(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.glu = GluKind::kSitu;
  q.situ_linear_beta = -1.0f;
  EXPECT_EQ(moe_expert_ffn_grouped(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.rows = int64_t{70000} * 128;  // ceil(R / 128) + E row tiles > 65535
  q.row_tile = 128;
  EXPECT_EQ(moe_expert_ffn_grouped(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.col_tile = 64;
  EXPECT_EQ(moe_expert_ffn_grouped(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.row_tile = 64;
  q.col_tile = 256;  // 256-column tiles only with 128-row tiles
  EXPECT_EQ(moe_expert_ffn_grouped(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.k_tile = 48;
  EXPECT_EQ(moe_expert_ffn_grouped(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.row_tile = 64;
  q.k_tile = 64;  // 64-wide k stages only with 128-row tiles
  EXPECT_EQ(moe_expert_ffn_grouped(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.rows = 0;
  q.x_sorted = nullptr;
  EXPECT_TRUE(moe_expert_ffn_grouped(q, 0));
  const int auto_k = moe_grouped_auto_k_tile();
  EXPECT_TRUE(auto_k == 32 || auto_k == kMoeGroupedWideKTile) << auto_k;
  // Automatic row tile by mean rows per expert.
  EXPECT_EQ(moe_grouped_row_tile(256 * 16, 256), 32);
  EXPECT_EQ(moe_grouped_row_tile(256 * 16 + 1, 256), 64);
  EXPECT_EQ(moe_grouped_row_tile(256 * 64, 256), 64);
  EXPECT_EQ(moe_grouped_row_tile(256 * 64 + 1, 256), 128);
}

TEST(MoeCublasGrouped, RejectsBadInputs) {
  // Declines (kInvalidArgument, nothing launched) so the selector falls back to the grouped kernels.
  MoeFfnParams p;
  auto* bf = reinterpret_cast<__nv_bfloat16*>(256);
  p.weights = {bf, bf, 8, 64, 32};
  p.rows = 4;
  p.x_sorted = bf;
  p.expert_offsets = reinterpret_cast<const int32_t*>(256);
  p.activated = bf;
  p.y_sorted = reinterpret_cast<float*>(256);
  MoeFfnParams q = p;
  q.weights.num_experts = 0;
  EXPECT_EQ(moe_expert_ffn_cublas_grouped(q, nullptr, nullptr, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.weights.num_experts = kMoeMaxExperts + 1;
  EXPECT_EQ(moe_expert_ffn_cublas_grouped(q, nullptr, nullptr, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.weights.width = 60;
  EXPECT_EQ(moe_expert_ffn_cublas_grouped(q, nullptr, nullptr, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.x_sorted = bf + 4;  // 8-byte aligned only
  EXPECT_EQ(moe_expert_ffn_cublas_grouped(q, nullptr, nullptr, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.y_sorted = reinterpret_cast<float*>(264);  // 8-byte aligned only
  EXPECT_EQ(moe_expert_ffn_cublas_grouped(q, nullptr, nullptr, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.expert_offsets = nullptr;
  EXPECT_EQ(moe_expert_ffn_cublas_grouped(q, nullptr, nullptr, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.weights.intermediate = 128;  // I > width and no workspace: no room for the gate/up product
  EXPECT_EQ(moe_expert_ffn_cublas_grouped(q, nullptr, nullptr, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.glu = GluKind::kSitu;
  q.situ_beta = 0.0f;
  EXPECT_EQ(moe_expert_ffn_cublas_grouped(q, nullptr, nullptr, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.rows = 0;
  q.x_sorted = nullptr;
  EXPECT_TRUE(moe_expert_ffn_cublas_grouped(q, nullptr, nullptr, 0));
  // Bad host offsets (read on the host, before anything is launched).
  std::vector<int32_t> offsets = {0, 1, 2, 3, 4, 4, 4, 4, 4};
  offsets[0] = 1;
  EXPECT_EQ(moe_expert_ffn_cublas_grouped(p, offsets.data(), nullptr, 0).code(), StatusCode::kInvalidArgument);
  offsets = {0, 2, 1, 3, 4, 4, 4, 4, 4};
  EXPECT_EQ(moe_expert_ffn_cublas_grouped(p, offsets.data(), nullptr, 0).code(), StatusCode::kInvalidArgument);
  offsets = {0, 1, 2, 3, 4, 4, 4, 4, 5};  // offsets[E] > rows
  EXPECT_EQ(moe_expert_ffn_cublas_grouped(p, offsets.data(), nullptr, 0).code(), StatusCode::kInvalidArgument);
  offsets.assign(9, 0);  // no rows used: nothing to do
  EXPECT_TRUE(moe_expert_ffn_cublas_grouped(p, offsets.data(), nullptr, 0));
  // Selector: off unless DELTASERVE_MOE_PREFILL=cublas-grouped.
  const char* env = std::getenv("DELTASERVE_MOE_PREFILL");
  EXPECT_EQ(moe_prefill_cublas_grouped_selected(), env != nullptr && std::string(env) == "cublas-grouped");
}

TEST(MoeFfn, RejectsBadInputs) {
  MoeFfnParams p;
  auto* bf = reinterpret_cast<__nv_bfloat16*>(256);
  p.weights = {bf, bf, 8, 64, 32};
  p.rows = 4;
  p.x_sorted = bf;
  p.expert_offsets = reinterpret_cast<const int32_t*>(256);
  p.activated = bf;
  p.y_sorted = reinterpret_cast<float*>(256);
  p.workspace = reinterpret_cast<void*>(256);
  p.workspace_bytes = moe_ffn_prefill_workspace_bytes(4, 32);
  const std::vector<int32_t> offsets = {0, 1, 1, 2, 2, 3, 3, 4, 4};
  cublasHandle_t fake_handle = reinterpret_cast<cublasHandle_t>(256);
  // Decode.
  MoeFfnParams q = p;
  q.weights.width = 60;
  EXPECT_EQ(moe_expert_ffn_decode(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.weights.intermediate = 0;
  EXPECT_EQ(moe_expert_ffn_decode(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.weights.num_experts = 0;
  EXPECT_EQ(moe_expert_ffn_decode(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.x_sorted = bf + 1;  // not 16-byte aligned
  EXPECT_EQ(moe_expert_ffn_decode(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.y_sorted = nullptr;
  EXPECT_EQ(moe_expert_ffn_decode(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.glu = GluKind::kSitu;
  q.situ_beta = 0.0f;
  EXPECT_EQ(moe_expert_ffn_decode(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.rows = 0;
  q.x_sorted = nullptr;
  EXPECT_TRUE(moe_expert_ffn_decode(q, 0));
  // Prefill (all rejected before cuBLAS is touched, so a fake handle is fine).
  EXPECT_EQ(moe_expert_ffn_prefill(p, {0, 1, 2}, fake_handle, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(moe_expert_ffn_prefill(p, {1, 1, 1, 2, 2, 3, 3, 4, 4}, fake_handle, 0).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(moe_expert_ffn_prefill(p, {0, 2, 1, 2, 2, 3, 3, 4, 4}, fake_handle, 0).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(moe_expert_ffn_prefill(p, {0, 1, 1, 2, 2, 3, 3, 4, 5}, fake_handle, 0).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(moe_expert_ffn_prefill(p, offsets, nullptr, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.workspace_bytes -= 4;
  EXPECT_EQ(moe_expert_ffn_prefill(q, offsets, fake_handle, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.activated = nullptr;
  EXPECT_EQ(moe_expert_ffn_prefill(q, offsets, fake_handle, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(moe_expert_ffn_prefill(p, std::vector<int32_t>(9, 0), fake_handle, 0));  // no rows: nothing to do
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
