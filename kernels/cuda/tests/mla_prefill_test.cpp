// GPU mla_prefill (prefill chunks over cached history, mixed batches; the absorbed form, the naive form and kAuto's
// choice) vs the CPU references, ctest label gpu. Each case runs check_attention (mla_attention_check.hpp:
// tolerances, modes, poisoning); the last one times both forms on a long chunk.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "kernels/cuda/mla/mla.hpp"
#include "kernels/cuda/tests/mla_attention_check.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

TEST(MlaPrefill, TinyChunksOverHistory) {
  for (int history : {0, 5, 64, 300}) {
    Batch batch;
    for (int q_len : {1, 17, 64, 200}) {
      batch.q_lens.push_back(q_len);
      batch.contexts.push_back(history + q_len);
    }
    check_attention(kTiny, batch, 20 + history);
  }
}

TEST(MlaPrefill, Kimi48BChunksOverHistory) {
  check_attention(kKimi48B, Batch{{1, 17, 64, 200}, {1, 17, 64, 200}}, 30);
  check_attention(kKimi48B, Batch{{17, 200}, {22, 500}}, 31);
  check_attention(kKimi48B, Batch{{1, 64}, {65, 128}}, 32);
}

TEST(MlaPrefill, MixedBatchWithZeroLengthSequence) {
  check_attention(kTiny, Batch{{3, 0, 1, 50, 0}, {10, 7, 1, 50, 0}}, 40);
  check_attention(kKimi48B, Batch{{3, 0, 1, 50}, {10, 7, 1000, 50}}, 41);
  check_attention(kOdd, Batch{{5, 0, 33}, {5, 3, 100}, 16}, 42);
}

TEST(MlaPrefill, SplitsOnFewTokensWithLongHistory) {
  // Few query tokens over a long history: more than one split per token.
  const Batch batch{{2, 3}, {3000, 4500}};
  ASSERT_GT(mla_num_splits(5, 4500), 1);
  check_attention(kKimi48B, batch, 50);
  check_attention(kTiny, Batch{{4}, {9}, 64, 50000}, 51);
}

TEST(MlaPrefill, ReadsRowsWrittenByWriteRows) {
  Batch batch{{7, 21, 1}, {40, 21, 17}, 16};
  batch.write_kernel = true;
  check_attention(kTiny, batch, 61);
  check_attention(kKimi48B, batch, 62);
}

TEST(MlaPrefill, NoTokensIsANoOp) {
  check_attention(kTiny, Batch{{0, 0}, {0, 12}}, 60);
}

// Chunks of 1, 17, 64, 200 and 1000 query tokens over a history, one sequence each in one batch (every form).
Batch chunks_over_history(int history) {
  Batch batch;
  for (int q_len : {1, 17, 64, 200, 1000}) {
    batch.q_lens.push_back(q_len);
    batch.contexts.push_back(history + q_len);
  }
  return batch;
}

TEST(MlaPrefillNaive, Kimi48BChunksOverShortHistories) {
  for (int history : {0, 5, 64, 300}) check_attention(kKimi48B, chunks_over_history(history), 80 + history);
}

TEST(MlaPrefillNaive, Kimi48BChunksOverHistory4097) {
  check_attention(kKimi48B, chunks_over_history(4097), 85);
}

TEST(MlaPrefillNaive, TinyAndOddDims) {
  for (int history : {0, 5, 64, 300}) check_attention(kTiny, chunks_over_history(history), 90 + history);
  check_attention(kOdd, Batch{{40, 0, 100}, {40, 3, 700}, 16}, 95);
  check_attention(kK3, Batch{{70, 33}, {70, 400}}, 96);
}

TEST(MlaPrefillNaive, ContextInSeveralKeyBlocks) {
  // Workspace for blocks of 64 / 128 / 192 rows: the softmax state is carried across blocks, and query tiles whose
  // positions precede a block pass through it unchanged.
  for (int rows : {64, 128, 192}) {
    Batch batch{{200, 1, 64, 0, 37}, {300, 129, 1000, 50, 37}};
    batch.naive_block_rows = rows;
    check_attention(kKimi48B, batch, 100 + rows);
    check_attention(kTiny, batch, 101 + rows);
  }
  Batch pages16{{300}, {4097}, 16};
  pages16.naive_block_rows = 1024;
  check_attention(kKimi48B, pages16, 104);
}

// The flash kernels' edges (the Hopper one at Kimi / K3 dims, the mma.sync one at the tiny dims): chunks around the
// 128-query tile (127, 128, 129, 255, 257: idle warps in a partial last tile), histories off and on the key tiles
// (the causal diagonal where warps skip key tiles past their rows), several key blocks (tiles whose warps are all
// idle in a block), and a sequence whose history starts mid-tile.
TEST(MlaPrefillNaive, QueryTileEdges) {
  check_attention(kKimi48B, Batch{{127, 128, 129, 255, 257}, {127, 191, 129 + 64, 255 + 1, 257 + 700}}, 120);
  for (int rows : {64, 192}) {
    Batch batch{{129, 300, 16}, {129 + 65, 300 + 333, 1000}};
    batch.naive_block_rows = rows;
    check_attention(kKimi48B, batch, 121 + rows);
    check_attention(kTiny, batch, 122 + rows);
  }
  check_attention(kK3, Batch{{250}, {250 + 130}}, 123);
}

TEST(MlaPrefillNaive, MixedBatchesAndZeroLengthSequences) {
  check_attention(kKimi48B, Batch{{0, 40, 0, 1, 300}, {0, 40, 9, 600, 2000}, 256}, 110);
  check_attention(kTiny, Batch{{0, 0, 65, 0}, {0, 5, 65, 64}}, 111);
  // Every sequence with enough query tokens: kAuto's estimate favours the naive form.
  check_attention(kKimi48B, Batch{{32, 100}, {32, 4000}}, 112);
}

// An 8192-token chunk over 24576 rows of history (a 32k prompt's last chunk) at Kimi-48B dims: the naive form
// against the absorbed tensor-core form (no CPU reference at this size; both round to bf16, so the tolerance is
// the tensor-core one on each side: |naive - absorbed| <= 4e-2 + 2e-2 |absorbed|), and the time of each form
// (printed with its FLOP rate; naive FLOPs = 2 H (nope + rope + v) per visible pair + the decompression GEMM).
TEST(MlaPrefillNaive, Kimi48BLongChunkMatchesAbsorbedAndTimes) {
  const MlaShape shape = kKimi48B;
  const int H = shape.heads, kv = shape.kv_lora, nope = shape.nope, rope = shape.rope, v_head = shape.v_head;
  const int q_width = nope + rope, ps = 64;
  const int64_t T = 8192, context = 32768;
  // Cheap deterministic values in [-1.7, 1.7) (variance about 1), bf16.
  const MlaLongChunk chunk(shape, T, context, ps, 0x9e3779b97f4a7c15ull);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  DeviceBuffer<float> out_absorbed(static_cast<size_t>(T) * H * v_head), out_naive(static_cast<size_t>(T) * H * v_head);
  const size_t ws_bytes =
      std::max(mla_attention_workspace_bytes(H, kv, rope, T, static_cast<int>(context)),
               mla_prefill_workspace_bytes(H, kv, nope, rope, v_head, T, static_cast<int>(context)));
  DeviceBuffer<char> ws_d(ws_bytes);
  ASSERT_NE(ws_d.get(), nullptr) << "workspace of " << ws_bytes << " bytes";
  CublasHandle cublas;
  ASSERT_EQ(cublasCreate(&cublas.handle), CUBLAS_STATUS_SUCCESS);

  MlaAttentionParams p = chunk.params(shape, ws_d.get(), ws_bytes);
  p.host_cu_q = chunk.cu_q.data();
  p.host_context_lens = chunk.contexts.data();
  p.cublas = cublas.handle;

  const double pairs = static_cast<double>(T) * (context - T) + static_cast<double>(T) * (T + 1) / 2;
  const double naive_flops = pairs * 2.0 * H * (q_width + v_head) + 2.0 * context * kv * H * (nope + v_head);
  for (const bool naive : {false, true}) {
    p.prefill_form = naive ? MlaPrefillForm::kNaive : MlaPrefillForm::kAbsorbed;
    p.out = naive ? out_naive.get() : out_absorbed.get();
    float best_ms = INFINITY;
    for (int rep = 0; rep < 3; ++rep) {
      float ms = 0.0f;
      ASSERT_NO_FATAL_FAILURE(time_eager_calls(
          nullptr, 1, [&](cudaStream_t s) { return mla_prefill(p, s); }, &ms));
      best_ms = std::min(best_ms, ms);
    }
    std::printf("  [%s] T=%lld context=%lld: %.3f ms, %.1f TFLOP/s at the naive form's FLOP count (%.3g FLOPs)\n",
                naive ? "naive" : "absorbed", static_cast<long long>(T), static_cast<long long>(context), best_ms,
                naive_flops / (best_ms * 1e-3) / 1e12, naive_flops);
  }
  const std::vector<float> a = out_absorbed.download(), b = out_naive.download();
  const auto [max_err, max_at, failures] =
      scan_errors(b, a, a.size(), 4e-2, 2e-2, [&](size_t i, double, size_t earlier) {
        if (earlier < 5) {
          const size_t t = i / (static_cast<size_t>(H) * v_head);
          ADD_FAILURE() << "token " << t << " (position " << context - T + static_cast<int64_t>(t) << ") head "
                        << i / v_head % H << " col " << i % v_head << ": absorbed " << a[i] << " naive " << b[i];
        }
      });
  std::printf("  naive vs absorbed: max abs err %.3g at %zu (%.6g vs %.6g), relative L2 %.3g\n", max_err, max_at,
              b[max_at], a[max_at], relative_error(b.data(), a.data(), a.size()));
  EXPECT_EQ(failures, 0u);
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
