// GPU mla_decode (decode-shaped batches: one query token per sequence) vs the CPU references, ctest label gpu. Each
// case runs check_attention (mla_attention_check.hpp: tolerances, modes, poisoning), which also runs mla_prefill on
// the same batch.
#include <cstddef>
#include <utility>
#include <vector>

#include "kernels/cuda/mla/mla.hpp"
#include "kernels/cuda/tests/mla_attention_check.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

std::vector<int> ones(size_t n) {
  return std::vector<int>(n, 1);
}

TEST(MlaDecode, TinyContexts) {
  const Batch batch{ones(6), {1, 63, 64, 65, 1000, 4097}};
  check_attention(kTiny, batch, 1);
}

TEST(MlaDecode, Kimi48BContexts) {
  const Batch batch{ones(6), {1, 63, 64, 65, 1000, 4097}};
  check_attention(kKimi48B, batch, 2);
}

TEST(MlaDecode, PageSizes16And256) {
  for (int page_size : {16, 256}) {
    const Batch batch{ones(5), {1, 15, 17, 257, 700}, page_size};
    check_attention(kTiny, batch, 3);
    check_attention(kKimi48B, batch, 4);
  }
}

TEST(MlaDecode, K3AndOddHeadGroups) {
  check_attention(kK3, Batch{ones(3), {1, 64, 333}}, 5);
  check_attention(kOdd, Batch{ones(4), {2, 64, 129, 1500}}, 6);
}

TEST(MlaDecode, ForcedSplitsOnShortContexts) {
  // max_context far above the real lengths: many splits, most of them empty on the device.
  const Batch batch{ones(3), {1, 5, 70}, 64, 100000};
  ASSERT_GT(mla_num_splits(3, 100000), 1);
  check_attention(kTiny, batch, 7);
  check_attention(kKimi48B, batch, 8);
}

TEST(MlaDecode, ZeroLengthSequencesInBatch) {
  // q_len 0 with context 0 and with a context; one query token per other sequence.
  check_attention(kTiny, Batch{{1, 0, 1, 0, 1}, {10, 0, 33, 20, 1}}, 9);
  check_attention(kKimi48B, Batch{{0, 1, 0}, {0, 600, 5}}, 10);
}

TEST(MlaDecode, LargeBatchOneSplit) {
  std::vector<int> contexts(300);
  for (size_t n = 0; n < contexts.size(); ++n) contexts[n] = 1 + static_cast<int>(n * 7 % 200);
  check_attention(kTiny, Batch{ones(contexts.size()), contexts}, 11);
}

TEST(MlaDecode, Kimi48BBatchOf37SeveralSplitsPartialCombineBlock) {
  // 37 tokens: several splits whose slices start off page boundaries, and a last combine CTA of 5 tokens (the
  // default combine takes 32 tokens per CTA); page size 16 so a 32-row tile spans two pages (three off alignment).
  std::vector<int> contexts(37);
  for (size_t n = 0; n < contexts.size(); ++n) contexts[n] = 1 + static_cast<int>(n * 131 % 1500);
  ASSERT_GT(mla_num_splits(37, 1500), 1);
  check_attention(kKimi48B, Batch{ones(contexts.size()), contexts, 16}, 13);
}

// One or two query tokens: the attention kernels' small head groups (8 heads per CTA at one token, 16 at two) and
// the combine's split-parallel merge; contexts around the 32-row tile and 64-row page edges and past several
// splits.
TEST(MlaDecode, Kimi48BSingleTokenEightHeadGroups) {
  for (int context : {1, 31, 32, 33, 63, 64, 65, 2049}) {
    ASSERT_EQ(mla_decode_head_group(1, kKimi48B.heads, context), 8);
    check_attention(kKimi48B, Batch{{1}, {context}}, 20 + context);
  }
}

TEST(MlaDecode, Kimi48BTwoTokensSixteenHeadGroups) {
  ASSERT_EQ(mla_decode_head_group(2, kKimi48B.heads, 4097), 16);
  ASSERT_EQ(mla_num_splits(2, 4097), 33);
  check_attention(kKimi48B, Batch{{1, 1}, {4097, 65}}, 21);
  // Page size 16 (every tile spans two pages) and one zero-length sequence beside the two tokens.
  check_attention(kKimi48B, Batch{{1, 0, 1}, {700, 9, 1}, 16}, 22);
}

TEST(MlaDecode, SingleTokenUnderLargeContextBound) {
  // A graph captured for contexts up to 32768 running a 65-row and a 1-row context: 64 splits, nearly all empty
  // (check_attention captures and replays every decode case).
  ASSERT_EQ(mla_num_splits(1, 32768), 64);
  ASSERT_EQ(mla_decode_head_group(1, kKimi48B.heads, 32768), 16);
  check_attention(kKimi48B, Batch{{1}, {65}, 64, 32768}, 23);
  check_attention(kKimi48B, Batch{{1}, {1}, 64, 4096}, 24);
}

TEST(MlaDecode, SmallHeadGroupsOfK3AndOddShapes) {
  // K3 (96 heads): 6 groups of 16 at one token; 40 heads with 96-wide latent, no rope: groups 8 x 5; tiny: 2 heads.
  ASSERT_EQ(mla_decode_head_group(1, kK3.heads, 4096), 16);
  check_attention(kK3, Batch{{1}, {333}, 64, 4096}, 25);
  ASSERT_EQ(mla_decode_head_group(1, kOdd.heads, 1500), 8);
  check_attention(kOdd, Batch{{1}, {1500}}, 26);
  check_attention(kTiny, Batch{{1}, {4097}}, 27);
  check_attention(kTiny, Batch{{1, 1, 1}, {65, 1, 640}, 16}, 28);
}

// mla_decode at the batches its two combines target: 1, 3, 8 and 16 (the split-K cluster combine, up to
// kMlaSplitKCombineMaxTokens), 17 and 64 (the 32-token combine), contexts 1, 17, 512 and 4096 (check_attention runs
// every decode mode: fp32 and bf16 outputs, fp32 attention, graph replay). Decode modes only, against
// cpu::mla_attention_absorbed: the naive reference would spend minutes at these sizes.
Batch decode_batch(std::vector<int> contexts, int page_size = 64) {
  Batch b{ones(contexts.size()), std::move(contexts), page_size};
  b.decode_only = true;
  b.absorbed_reference = true;
  return b;
}

TEST(MlaDecode, Kimi48BBatchesAndContexts) {
  ASSERT_EQ(kMlaSplitKCombineMaxTokens, 16);
  for (int batch : {1, 3, 8}) {
    for (int context : {1, 17, 512, 4096}) {
      check_attention(kKimi48B, decode_batch(std::vector<int>(batch, context)), 200 + 7 * batch + context % 13);
    }
  }
  // 16 and 17 tokens (the last split-K batch and the first past it), 64 tokens; the four contexts in turn (bound
  // 4096), page size 16 for one of them (tiles over two pages).
  for (int batch : {16, 17, 64}) {
    std::vector<int> contexts(batch);
    for (int n = 0; n < batch; ++n) contexts[n] = std::vector<int>{1, 17, 512, 4096}[n % 4];
    check_attention(kKimi48B, decode_batch(contexts, batch == 17 ? 16 : 64), 300 + batch);
  }
  check_attention(kKimi48B, decode_batch(std::vector<int>(64, 512)), 364);
}

TEST(MlaDecode, LongContextsOverManySplits) {
  // Every split in use: one token over 20000 rows (64 splits of 320 rows, the last one empty), two tokens over 20000
  // and 9000 (64 splits each).
  ASSERT_EQ(mla_num_splits(1, 20000), 64);
  ASSERT_EQ(mla_num_splits(2, 20000), 64);
  check_attention(kKimi48B, decode_batch({20000}), 29);
  check_attention(kKimi48B, decode_batch({20000, 9000}), 30);
}

TEST(MlaDecode, SplitKCombineOddShapes) {
  // Slices of the split-K combine: kv_lora 96 -> 2 CTAs a cluster (the second one half empty), v_head 40 -> 3 W_UV
  // blocks; kv_lora 32 -> clusters of 1; K3's 96 heads; 8 tokens over several splits each.
  check_attention(kOdd, decode_batch({1, 17, 512, 4096, 3, 700, 64, 65}), 400);
  check_attention(kTiny, decode_batch({1, 17, 512, 4096, 3}), 401);
  check_attention(kK3, decode_batch({4096, 17, 1}), 402);
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
