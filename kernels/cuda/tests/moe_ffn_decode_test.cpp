// GPU MoE expert FFN at decode-sized batches (moe_expert_ffn_decode: the bandwidth kernels up to 4 rows per
// expert, the grouped mma.sync kernels beyond) in the layer case of moe_ffn_test_util.hpp (router → plan → gather →
// FFN → combine against the CPU and the cuBLAS reference), ctest label gpu. The grouped path and its mma.sync kernels
// run on every case too; the input checks of moe_expert_ffn_decode at the end.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cuda/moe/detail/wgmma.hpp"
#include "kernels/cuda/moe/moe.hpp"
#include "kernels/cuda/tests/moe_ffn_test_util.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

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
  // 75 rows per expert on average: the wgmma kernels, and the mma.sync kernels' 128-row tile (whose launch sets the
  // opt-in shared-memory attribute) inside a captured graph.
  run_layer_case({.E = 8, .k = 2, .width = 64, .inter = 32, .T = 300, .concentrate = true, .graph = true, .seed = 11});
}

TEST(MoeLayer, Kimi48BDecode) {
  for (int64_t T : {1, 8, 64}) {
    run_layer_case({.E = 256,
                    .k = 8,
                    .width = 2304,
                    .inter = 1024,
                    .T = T,
                    .graph = T == 8,
                    .seed = static_cast<uint32_t>(100 + T)});
  }
}

TEST(MoeLayer, K3ShapeDecode) {
  // K3 expert shapes (latent width 3584, I = 3072) with fewer experts to keep the weights small; k = 16 of 32.
  run_layer_case({.E = 32, .k = 16, .width = 3584, .inter = 3072, .T = 2, .seed = 300});
}

TEST(MoeGrouped, Kimi48BMidSizeDecode) {
  // Decode batches B = 128 (4 rows per expert: the bandwidth kernels) and B = 256 (8: grouped, captured).
  for (int64_t T : {128, 256}) {
    run_layer_case({.E = 256,
                    .k = 8,
                    .width = 2304,
                    .inter = 1024,
                    .T = T,
                    .graph = T == 256,
                    .ref_token_stride = T / 32,
                    .seed = static_cast<uint32_t>(450 + T)});
  }
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
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
