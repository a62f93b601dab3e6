// GPU MoE router, plan, gather and combine (kernels/cuda/moe/moe.hpp) vs the CPU references, ctest label gpu.
// Oracles: cpu::moe_route for the router, a counting sort for the plan, a host gather and weighted sum.
// Tolerances:
//   router: expert ids exact; weights within 2 ulp-ish (|a - b| <= 1e-6 · max(1, |b|)): same fp32 operations;
//   plan, gather: exact;   combine: |a - b| <= 1e-5 · (1 + |b|) (fmaf chain, same order as the host).
// Every output buffer is NaN/sentinel-poisoned beyond what the launcher may write and checked afterwards.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/moe.hpp"
#include "kernels/cuda/moe/moe.hpp"
#include "kernels/cuda/tests/kda_test_util.hpp"
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

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
