// GPU MoE expert FFN at prefill-sized batches (moe_expert_ffn_grouped: the wgmma kernels above 64 rows per expert,
// the mma.sync kernels below and wherever the wgmma kernels decline) in the layer case of moe_ffn_test_util.hpp
// (router → plan → gather → FFN → combine against the CPU on every ref_token_stride-th token and the cuBLAS reference
// on all tokens), ctest label gpu; the input checks of moe_expert_ffn_grouped at the end.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cuda/moe/detail/wgmma.hpp"
#include "kernels/cuda/moe/moe.hpp"
#include "kernels/cuda/tests/moe_ffn_test_util.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

TEST(MoeLayer, Kimi48BPrefill) {
  // CPU reference on every 8th token (64 of 512); the cuBLAS reference on all tokens.
  run_layer_case({.E = 256, .k = 8, .width = 2304, .inter = 1024, .T = 512, .ref_token_stride = 8, .seed = 200});
}

TEST(MoeGrouped, Kimi48BPrefillChunks) {
  // 8192-token chunks are the engine's prefill unit: E = 256, k = 8 gives R = 65536 rows, ~256 per expert.
  for (int64_t T : {64, 512, 2048, 8192}) {
    run_layer_case({.E = 256,
                    .k = 8,
                    .width = 2304,
                    .inter = 1024,
                    .T = T,
                    .time_paths = T >= 2048,
                    .ref_token_stride = std::max<int64_t>(1, T / 64),
                    .seed = static_cast<uint32_t>(400 + T)});
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
                  .hot_expert = true,
                  .ref_token_stride = 32,
                  .seed = 500});
  run_layer_case({.E = 256,
                  .k = 8,
                  .width = 2304,
                  .inter = 1024,
                  .T = 512,
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
  q.rows = int64_t{70000} * 128;  // ceil(R / 128) + E row tiles > 65535 (the mma.sync kernels' grid)
  EXPECT_EQ(detail::moe_expert_ffn_grouped_mma_sync(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.x_sorted = bf + 4;  // the mma.sync entry checks as moe_expert_ffn_grouped does
  EXPECT_EQ(detail::moe_expert_ffn_grouped_mma_sync(q, 0).code(), StatusCode::kInvalidArgument);
  q = p;
  q.rows = 0;
  q.x_sorted = nullptr;
  EXPECT_TRUE(moe_expert_ffn_grouped(q, 0));
  EXPECT_TRUE(detail::moe_expert_ffn_grouped_mma_sync(q, 0));
  // Automatic row tile by mean rows per expert.
  EXPECT_EQ(moe_grouped_row_tile(256 * 16, 256), 32);
  EXPECT_EQ(moe_grouped_row_tile(256 * 16 + 1, 256), 64);
  EXPECT_EQ(moe_grouped_row_tile(256 * 64, 256), 64);
  EXPECT_EQ(moe_grouped_row_tile(256 * 64 + 1, 256), 128);
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
