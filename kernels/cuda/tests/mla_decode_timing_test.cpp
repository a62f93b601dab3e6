// Time of one MLA decode layer's cache write and attention (mla_write_rows then mla_decode) at Kimi-Linear-48B dims
// (32 heads, kv_lora 512, rope 64, nope 128, v 128, 64-token pages), ctest label gpu. For batch B in {1, 2, 8, 64,
// 256} and context in {4096, 32768} (every request its own, shuffled pages of one random page pool; the written row
// is each request's last position, rewritten with the same values on every replay), the two calls are captured in
// one CUDA graph and replayed 200 times between two events, with the fp32 output and with the bf16 output
// (out_bf16, as the engine runs decode without an output gate: it saves a to_bf16 launch, which the fp32 variant does
// not count). One line per shape gives the times, the bytes a layer must move (cache rows read + W_UK + W_UV + q +
// out + the new rows) and their ratio to 4.26 TB/s.
// Correctness only: each output is compared once with the fp32 CUDA-core reference path (fp32_attention) with the
// tensor-core tolerance of mla_test.cpp, |x - ref| <= 2e-2 + 1e-2 |ref|. No speed is asserted.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cuda/mla/mla.hpp"
#include "kernels/cuda/tests/gpu_test_graph.hpp"
#include "kernels/cuda/tests/kda_test_util.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

constexpr int kHeads = 32, kKvLora = 512, kNope = 128, kRope = 64, kVHead = 128, kPageSize = 64;
constexpr int kWidth = kKvLora + kRope, kQWidth = kNope + kRope;
constexpr int kReplays = 200;
constexpr double kCopyBandwidth = 4.26e12;  // bytes/s, H200

// Deterministic values in [-1.7, 1.7) (variance about 1), rounded to bf16.
class Values {
 public:
  explicit Values(uint64_t seed) : state_(seed) {}
  float next() {
    state_ = state_ * 6364136223846793005ull + 1442695040888963407ull;
    return (static_cast<float>(state_ >> 40) / 16777216.0f * 2.0f - 1.0f) * 1.7f;
  }
  std::vector<__nv_bfloat16> bf16(size_t n, float scale) {
    std::vector<__nv_bfloat16> x(n);
    for (auto& v : x) v = __float2bfloat16(next() * scale);
    return x;
  }

 private:
  uint64_t state_;
};

TEST(MlaDecodeGpu, Timing) {
  const int max_batch = 256, max_context = 32768;
  const int pages_per_seq = max_context / kPageSize;
  const int64_t num_pages = static_cast<int64_t>(max_batch) * pages_per_seq;
  // The pool (9.7 GB at the largest shape) is filled by repeating one random 64 MB block.
  DeviceBuffer<__nv_bfloat16> pool_d(static_cast<size_t>(num_pages) * kPageSize * kWidth);
  ASSERT_NE(pool_d.get(), nullptr) << "page pool of " << num_pages << " pages";
  Values values(0x9e3779b97f4a7c15ull);
  {
    const std::vector<__nv_bfloat16> block = values.bf16(size_t{1} << 25, 1.0f);
    for (size_t at = 0; at < pool_d.size(); at += block.size()) {
      const size_t n = std::min(block.size(), pool_d.size() - at);
      DS_CUDA_OK(cudaMemcpy(pool_d.get() + at, block.data(), n * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
    }
  }
  const std::vector<__nv_bfloat16> q = values.bf16(static_cast<size_t>(max_batch) * kHeads * kQWidth, 1.0f);
  const std::vector<__nv_bfloat16> kv_b =
      values.bf16(static_cast<size_t>(kHeads) * (kNope + kVHead) * kKvLora, 1.0f / std::sqrt(float(kKvLora)));
  std::vector<int32_t> table(static_cast<size_t>(num_pages));
  std::iota(table.begin(), table.end(), 0);
  std::mt19937 rng(5);
  std::shuffle(table.begin(), table.end(), rng);
  std::vector<int32_t> cu_q(max_batch + 1);
  std::iota(cu_q.begin(), cu_q.end(), 0);
  DeviceBuffer<__nv_bfloat16> q_d(q.size()), kv_b_d(kv_b.size());
  DeviceBuffer<int32_t> table_d(table.size()), cu_q_d(cu_q.size()), contexts_d(max_batch);
  DeviceBuffer<float> out_d(static_cast<size_t>(max_batch) * kHeads * kVHead),
      ref_d(static_cast<size_t>(max_batch) * kHeads * kVHead);
  q_d.upload(q);
  kv_b_d.upload(kv_b);
  table_d.upload(table);
  cu_q_d.upload(cu_q);
  const size_t ws_bytes = mla_attention_workspace_bytes(kHeads, kKvLora, kRope, max_batch, max_context);
  DeviceBuffer<char> ws_d(ws_bytes);
  ASSERT_NE(ws_d.get(), nullptr) << "workspace of " << ws_bytes << " bytes";
  cudaStream_t stream = nullptr;
  DS_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // The new rows: fp32 kv_a outputs and the latent norm weight.
  DeviceBuffer<float> kv_rows_d(static_cast<size_t>(max_batch) * kWidth), norm_d(kKvLora);
  {
    std::vector<float> kv_rows(kv_rows_d.size()), norm(kKvLora);
    for (float& x : kv_rows) x = values.next();
    for (float& x : norm) x = 1.0f + 0.1f * values.next();
    kv_rows_d.upload(kv_rows);
    norm_d.upload(norm);
  }
  DeviceBuffer<int64_t> slots_d(max_batch);
  DeviceBuffer<__nv_bfloat16> out_bf16_d(out_d.size());

  for (int context : {4096, 32768}) {
    for (int batch : {1, 2, 8, 64, 256}) {
      SCOPED_TRACE("B=" + std::to_string(batch) + " context=" + std::to_string(context));
      contexts_d.upload(std::vector<int32_t>(batch, context));
      std::vector<int64_t> slots(batch);
      for (int n = 0; n < batch; ++n) {  // position context - 1 of sequence n
        const int64_t position = context - 1;
        const int64_t page = table[static_cast<size_t>(n) * pages_per_seq + position / kPageSize];
        slots[n] = page * kPageSize + position % kPageSize;
      }
      slots_d.upload(slots);
      MlaWriteParams w;
      w.pool = MlaPagePool{pool_d.get(), num_pages, 1, kPageSize, kWidth, kWidth};
      w.layer = 0;
      w.num_tokens = batch;
      w.kv = kv_rows_d.get();
      w.kv_stride = kWidth;
      w.norm_weight = norm_d.get();
      w.kv_lora_rank = kKvLora;
      w.qk_rope = kRope;
      w.slot_mapping = slots_d.get();
      MlaAttentionParams p;
      p.num_heads = kHeads;
      p.kv_lora_rank = kKvLora;
      p.qk_nope = kNope;
      p.qk_rope = kRope;
      p.v_head = kVHead;
      p.softmax_scale = 1.0f / std::sqrt(static_cast<float>(kQWidth));
      p.pool = w.pool;
      p.num_seqs = batch;
      p.num_tokens = batch;
      p.cu_q = cu_q_d.get();
      p.context_lens = contexts_d.get();
      p.block_tables = table_d.get();  // sequence n: table row n, pages_per_seq distinct pages
      p.max_pages_per_seq = pages_per_seq;
      p.max_context = context;
      p.q = q_d.get();
      p.q_stride = static_cast<int64_t>(kHeads) * kQWidth;
      p.kv_b = kv_b_d.get();
      p.workspace = ws_d.get();
      p.workspace_bytes = ws_bytes;

      // Reference: the rows written once, then the fp32 CUDA-core attention path.
      Status status = mla_write_rows(w, stream);
      ASSERT_TRUE(status.is_ok()) << status.to_string();
      p.out = ref_d.get();
      p.fp32_attention = true;
      status = mla_decode(p, stream);
      ASSERT_TRUE(status.is_ok()) << status.to_string();
      p.fp32_attention = false;
      const char* names[2] = {"fp32 out", "bf16 out"};
      double us[2] = {};
      for (int variant = 0; variant < 2; ++variant) {
        const bool bf16_out = variant == 1;
        p.out = bf16_out ? nullptr : out_d.get();
        p.out_bf16 = bf16_out ? out_bf16_d.get() : nullptr;
        DS_CUDA_OK(cudaMemsetAsync(out_d.get(), 0xff, out_d.size() * sizeof(float), stream));  // NaN
        DS_CUDA_OK(cudaMemsetAsync(out_bf16_d.get(), 0xff, out_bf16_d.size() * sizeof(__nv_bfloat16), stream));
        double ms = 0.0;
        ASSERT_NO_FATAL_FAILURE(time_graph_replays(
            stream, cudaStreamCaptureModeGlobal, 1, kReplays,
            [&](cudaStream_t s) {
              if (Status written = mla_write_rows(w, s); !written.is_ok()) return written;
              return mla_decode(p, s);
            },
            &ms));
        us[variant] = 1e3 * ms;
        DS_CUDA_OK(cudaStreamSynchronize(stream));
        DS_CUDA_OK(cudaGetLastError());
        std::vector<float> out = out_d.download();
        if (bf16_out) {
          const std::vector<__nv_bfloat16> out_bf16 = out_bf16_d.download();
          for (size_t i = 0; i < out.size(); ++i) out[i] = __bfloat162float(out_bf16[i]);
        }
        const std::vector<float> ref = ref_d.download();
        const size_t n = static_cast<size_t>(batch) * kHeads * kVHead;
        size_t failures = 0;
        double max_err = 0.0;
        for (size_t i = 0; i < n; ++i) {
          const double err = std::isfinite(out[i]) ? std::fabs(static_cast<double>(out[i]) - ref[i]) : INFINITY;
          max_err = std::max(max_err, err);
          if (err > 2e-2 + 1e-2 * std::fabs(ref[i]) && failures++ < 3) {
            ADD_FAILURE() << names[variant] << " at token " << i / (kHeads * kVHead) << " head " << i / kVHead % kHeads
                          << " col " << i % kVHead << ": " << out[i] << " vs fp32 " << ref[i];
          }
        }
        EXPECT_EQ(failures, 0u) << names[variant] << " max abs err " << max_err;
      }
      const double bytes = static_cast<double>(batch) * context * kWidth * 2 +
                           2.0 * kHeads * kNope * kKvLora * 2 +  // W_UK and W_UV (nope == v_head)
                           static_cast<double>(batch) * kHeads * (kQWidth * 2 + kVHead * 4) +
                           static_cast<double>(batch) * kWidth * (4 + 2);  // kv rows read, new cache rows written
      const double limit_us = bytes / kCopyBandwidth * 1e6;
      std::printf(
          "  [MlaDecodeGpu.Timing] B=%d ctx=%d (splits %d, heads per CTA %d): write_rows + mla_decode %.2f us, "
          "bf16 out %.2f us; %.2f MB -> %.2f us at 4.26 TB/s: %.2f, bf16 out %.2f of it\n",
          batch, context, mla_num_splits(batch, context), mla_decode_head_group(batch, kHeads, context), us[0], us[1],
          bytes / 1e6, limit_us, limit_us / us[0], limit_us / us[1]);
    }
  }
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
