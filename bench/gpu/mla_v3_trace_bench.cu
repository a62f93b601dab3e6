// Where the v3 MLA decode attention spends its time at small batches: mla_decode (absorb -> v3 attention -> combine)
// at Kimi-48B dims, batch 1 and 2, contexts 4096 and 32768, with kernels/cuda/mla/decode_wgmma.cu compiled with
// -DDELTASERVE_MLA_V3_TRACE so that every attention CTA stamps %globaltimer at its events (see the .cu). Prints, per
// shape, medians over the CTAs (us from the earliest CTA start): the CTA start, the absorb wait, q̃ ready, and per
// tile the copies issued, the data in (warpgroup 0 past the full barrier), P handed over and warpgroup 1 done; then
// the per-tile durations (issue -> in, in -> P, P -> done) and the last store. Built and run by
// bench/gpu/mla_v3_trace.sh (GPU machine only).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "bench/gpu/cuda_check.hpp"
#include "kernels/cuda/mla/mla.hpp"

namespace deltaserve::kernels::cuda::detail {
std::vector<unsigned long long> mla_v3_trace_take();
std::vector<unsigned long long> mla_combine_trace_take();
}  // namespace deltaserve::kernels::cuda::detail

namespace {

using namespace deltaserve::kernels::cuda;  // NOLINT(google-build-using-namespace)

constexpr int kHeads = 32, kKvLora = 512, kNope = 128, kRope = 64, kVHead = 128, kPageSize = 64;
constexpr int kWidth = kKvLora + kRope, kQWidth = kNope + kRope;
constexpr int kTraceCtas = 1024, kTraceTiles = 16, kTraceFine = 4 + 4 * kTraceTiles;  // as in mla_decode_wgmma.cu
constexpr int kTraceEvents = kTraceFine + 3 * kTraceTiles;

template <typename T>
T* device_copy(const std::vector<T>& host) {
  T* device = nullptr;
  CHECK_CUDA(cudaMalloc(&device, host.size() * sizeof(T)));
  CHECK_CUDA(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return device;
}

double median(std::vector<double> x) {
  if (x.empty()) return NAN;
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

void run(int batch, int context) {
  const int pages_per_seq = (context + kPageSize - 1) / kPageSize;
  const int64_t num_pages = static_cast<int64_t>(batch) * pages_per_seq;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<__nv_bfloat16> pool(static_cast<size_t>(num_pages) * kPageSize * kWidth);
  for (auto& v : pool) v = __float2bfloat16(normal(rng));
  std::vector<__nv_bfloat16> q(static_cast<size_t>(batch) * kHeads * kQWidth);
  for (auto& v : q) v = __float2bfloat16(normal(rng));
  std::vector<__nv_bfloat16> kv_b(static_cast<size_t>(kHeads) * (kNope + kVHead) * kKvLora);
  for (auto& v : kv_b) v = __float2bfloat16(normal(rng) / std::sqrt(float(kKvLora)));
  std::vector<int32_t> table(static_cast<size_t>(num_pages));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  std::vector<int32_t> cu_q(batch + 1), contexts(batch, context);
  std::iota(cu_q.begin(), cu_q.end(), 0);

  MlaAttentionParams p;
  p.num_heads = kHeads;
  p.kv_lora_rank = kKvLora;
  p.qk_nope = kNope;
  p.qk_rope = kRope;
  p.v_head = kVHead;
  p.softmax_scale = 1.0f / std::sqrt(static_cast<float>(kQWidth));
  p.pool = MlaPagePool{device_copy(pool), num_pages, 1, kPageSize, kWidth, kWidth};
  p.num_seqs = batch;
  p.num_tokens = batch;
  p.cu_q = device_copy(cu_q);
  p.context_lens = device_copy(contexts);
  p.block_tables = device_copy(table);
  p.max_pages_per_seq = pages_per_seq;
  p.max_context = context;
  p.q = device_copy(q);
  p.q_stride = static_cast<int64_t>(kHeads) * kQWidth;
  p.kv_b = device_copy(kv_b);
  p.decode_kernel = MlaDecodeKernel::kV3;
  p.workspace_bytes = mla_attention_workspace_bytes(kHeads, kKvLora, kRope, batch, context);
  CHECK_CUDA(cudaMalloc(&p.workspace, p.workspace_bytes));
  CHECK_CUDA(cudaMalloc(&p.out, static_cast<size_t>(batch) * kHeads * kVHead * sizeof(float)));
  for (int i = 0; i < 5; ++i) CHECK_STATUS(mla_decode(p, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  (void)deltaserve::kernels::cuda::detail::mla_v3_trace_take();
  (void)deltaserve::kernels::cuda::detail::mla_combine_trace_take();
  CHECK_STATUS(mla_decode(p, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  const std::vector<unsigned long long> stamps = deltaserve::kernels::cuda::detail::mla_v3_trace_take();
  const std::vector<unsigned long long> combine = deltaserve::kernels::cuda::detail::mla_combine_trace_take();

  const int splits = mla_num_splits(batch, context), group = mla_decode_head_group(batch, kHeads, context);
  const int ctas = std::min(kTraceCtas, batch * splits * ((kHeads + group - 1) / group));
  unsigned long long t0 = ~0ull;
  for (int c = 0; c < ctas; ++c) {
    const unsigned long long start = stamps[static_cast<size_t>(c) * kTraceEvents];
    if (start != 0) t0 = std::min(t0, start);
  }
  auto at = [&](int c, int e) {
    const unsigned long long v = stamps[static_cast<size_t>(c) * kTraceEvents + e];
    return v == 0 ? NAN : static_cast<double>(v - t0) * 1e-3;
  };
  auto median_of = [&](int e) {
    std::vector<double> x;
    for (int c = 0; c < ctas; ++c) {
      if (std::isfinite(at(c, e))) x.push_back(at(c, e));
    }
    return median(x);
  };
  std::printf("B=%d ctx=%d: %d splits, %d heads per CTA, %d CTAs; medians over the CTAs, us from the first start\n",
              batch, context, splits, group, ctas);
  std::printf("  start %.2f, absorb wait done %.2f, q ready %.2f, last store %.2f (max %.2f)\n", median_of(0),
              median_of(1), median_of(2), median_of(3), [&] {
                double m = 0.0;
                for (int c = 0; c < ctas; ++c) m = std::isfinite(at(c, 3)) ? std::max(m, at(c, 3)) : m;
                return m;
              }());
  std::printf("  tile  issued     in      P   done | issue->in  in->P  P->done\n");
  for (int j = 0; j < kTraceTiles; ++j) {
    const int e = 4 + 4 * j;
    std::vector<double> load, score, product;
    for (int c = 0; c < ctas; ++c) {
      if (std::isfinite(at(c, e)) && std::isfinite(at(c, e + 1))) load.push_back(at(c, e + 1) - at(c, e));
      if (std::isfinite(at(c, e + 1)) && std::isfinite(at(c, e + 2))) score.push_back(at(c, e + 2) - at(c, e + 1));
      if (std::isfinite(at(c, e + 2)) && std::isfinite(at(c, e + 3))) product.push_back(at(c, e + 3) - at(c, e + 2));
    }
    if (load.empty()) break;
    std::printf("  %4d %7.2f %6.2f %6.2f %6.2f | %9.2f %6.2f %8.2f\n", j, median_of(e), median_of(e + 1),
                median_of(e + 2), median_of(e + 3), median(load), median(score), median(product));
  }
  // Finer: per tile, medians over the CTAs of the producer's refill (the stage's release by warpgroup 1 two tiles
  // back -> the producer past its wait -> the copies issued) and of warpgroup 0's steps (data in -> scores in
  // registers -> past the maxima's barrier -> P handed over).
  std::printf("  tile | release->woke woke->issued | in->scores scores->max max->P\n");
  auto median_gap = [&](int from, int to) {
    std::vector<double> x;
    for (int c = 0; c < ctas; ++c) {
      if (std::isfinite(at(c, from)) && std::isfinite(at(c, to))) x.push_back(at(c, to) - at(c, from));
    }
    return median(x);
  };
  for (int j = 0; j < kTraceTiles; ++j) {
    const int e = 4 + 4 * j, f = kTraceFine + 3 * j;
    if (!std::isfinite(median_of(e + 1))) break;
    const double release_to_woke = j >= 2 ? median_gap(4 + 4 * (j - 2) + 3, f) : NAN;
    std::printf("  %4d | %13.2f %11.2f | %10.2f %11.2f %6.2f\n", j, release_to_woke, median_gap(f, e),
                median_gap(e + 1, f + 1), median_gap(f + 1, f + 2), median_gap(f + 2, e + 2));
  }

  // The split-K combine after it (events of mla_decode.cu's timeline, same clock): CTAs that started while an
  // attention CTA still ran (the first wave) and those that started after the last attention store, separately.
  double attention_end = 0.0;
  for (int c = 0; c < ctas; ++c)
    attention_end = std::isfinite(at(c, 3)) ? std::max(attention_end, at(c, 3)) : attention_end;
  constexpr int kCombineEvents = 8;
  const int combine_ctas = static_cast<int>(combine.size()) / kCombineEvents;
  auto combine_at = [&](int c, int e) {
    const unsigned long long v = combine[static_cast<size_t>(c) * kCombineEvents + e];
    return v == 0 || v < t0 ? NAN : static_cast<double>(v - t0) * 1e-3;
  };
  std::vector<int> waves[2];
  std::vector<int> per_sm(1024, 0);
  for (int c = 0; c < combine_ctas; ++c) {
    if (!std::isfinite(combine_at(c, 0))) continue;
    waves[combine_at(c, 0) < attention_end ? 0 : 1].push_back(c);
    const unsigned long long sm = combine[static_cast<size_t>(c) * kCombineEvents + 7];
    if (sm > 0 && sm <= per_sm.size()) ++per_sm[sm - 1];
  }
  const int busiest = *std::max_element(per_sm.begin(), per_sm.end());
  const int sms_used = static_cast<int>(std::count_if(per_sm.begin(), per_sm.end(), [](int n) { return n > 0; }));
  std::printf(
      "  combine: attention's last store %.2f; %zu CTAs started before it, %zu after; %d SMs, at most %d CTAs "
      "on one\n",
      attention_end, waves[0].size(), waves[1].size(), sms_used, busiest);
  static const char* names[7] = {"start", "waited", "weights", "merged", "product", "cluster1", "end"};
  for (int w = 0; w < 2; ++w) {
    if (waves[w].empty()) continue;
    std::printf("    %s wave medians:", w == 0 ? "first" : "second");
    for (int e = 0; e < 7; ++e) {
      if (e == 2) continue;  // no longer stamped
      std::vector<double> x;
      for (int c : waves[w]) {
        if (std::isfinite(combine_at(c, e))) x.push_back(combine_at(c, e));
      }
      std::printf(" %s %.2f", names[e], median(x));
    }
    double last = 0.0;
    for (int c : waves[w]) last = std::isfinite(combine_at(c, 6)) ? std::max(last, combine_at(c, 6)) : last;
    std::printf("; last end %.2f\n", last);
  }
}

}  // namespace

int main() {
  for (int context : {4096, 32768}) {
    for (int batch : {1, 2}) run(batch, context);
  }
  return 0;
}
