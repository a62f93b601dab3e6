// Sampled passes of CudaBackend (forward_sample): every row's token is picked on the device from the logits the LM
// head left there (kernels::cuda::sample), and only the results travel: at batch 256 with Kimi's vocabulary
// (163840) that is 2 KB (+ 160 bytes per row with 20 alternatives) instead of 168 MB of fp32 logits.
#include <algorithm>

#include "engine/cuda/cuda_model.hpp"
#include "kernels/cuda/ops/sampling.hpp"

namespace deltaserve::engine::cuda {

namespace kc = kernels::cuda;

namespace {

// The results of a pass of `rows` sequences with `top` alternatives per row, packed from the start of `base` (all
// 4-byte values): tokens [rows], logprobs [rows], top ids [rows, top], top values [rows, top]. Packed so that one
// copy brings them back.
struct SampleResults {
  int32_t* tokens;
  float* logprobs;
  int32_t* top_ids;
  float* top_values;
  size_t bytes;
};

SampleResults sample_results(void* base, int64_t rows, int top) {
  auto* tokens = static_cast<int32_t*>(base);
  auto* logprobs = reinterpret_cast<float*>(tokens + rows);
  auto* top_ids = reinterpret_cast<int32_t*>(logprobs + rows);
  auto* top_values = reinterpret_cast<float*>(top_ids + rows * top);
  return {tokens, logprobs, top_ids, top_values, static_cast<size_t>(rows) * (8 + 8 * static_cast<size_t>(top))};
}

}  // namespace

Status CudaBackend::Impl::sample_piece(const PassTables& t, int64_t begin, int64_t n) {
  // With all_logits off (forward_sample checks it) logit row i is sequence i's last token.
  if (static_cast<int64_t>(t.logit_rows.size()) != t.num_seqs) {
    return internal_error("sample_piece: a sampled pass needs one logit row per sequence");
  }
  if (t.num_seqs * (8 + 8 * int64_t{t.sample_top_logprobs}) > static_cast<int64_t>(sample_memory.bytes())) {
    return internal_error("sample_piece: more sequences than the sampled-results buffer holds");
  }
  profiler.mark(Phase::kSampling, stream());
  const int64_t vocab = config.vocab_size;
  const int top = t.sample_top_logprobs;
  const SampleResults results = sample_results(sample_memory.data(), t.num_seqs, top);
  for (int64_t at = 0; at < n; at += sample_launch_rows) {
    const int64_t rows = std::min(sample_launch_rows, n - at), row = begin + at;
    kc::SampleParams p;
    p.rows = static_cast<int>(rows);
    p.vocab = vocab;
    p.logits = logits + at * vocab;
    p.temperature = t.d_temperature + row;
    p.top_p = t.d_top_p + row;
    p.top_k = t.d_top_k + row;
    p.uniform = t.d_draw + row;
    p.top_logprobs = top;
    p.row_top_logprobs = t.d_top_logprobs + row;
    p.tokens = results.tokens + row;
    p.logprobs = results.logprobs + row;
    p.top_ids = top > 0 ? results.top_ids + row * top : nullptr;
    p.top_values = top > 0 ? results.top_values + row * top : nullptr;
    p.workspace = arena_memory.data();  // idle after the layers (see allocate_scratch)
    p.workspace_bytes = arena_memory.bytes();
    DS_RETURN_IF_ERROR(kc::sample(p, stream()));
  }
  return Status::ok();
}

Status CudaBackend::Impl::fetch_samples(const PassTables& t, const PassSampling& sampling) {
  const int top = t.sample_top_logprobs;
  const SampleResults device = sample_results(sample_memory.data(), t.num_seqs, top);
  DS_CUDA_RETURN(
      cudaMemcpyAsync(sample_host.data(), sample_memory.data(), device.bytes, cudaMemcpyDeviceToHost, stream()));
  DS_CUDA_RETURN(cudaStreamSynchronize(stream()));
  const SampleResults host = sample_results(sample_host.data(), t.num_seqs, top);
  std::vector<SampledToken>& out = *sampling.out;
  out.clear();
  out.reserve(static_cast<size_t>(t.num_seqs));
  for (int64_t i = 0; i < t.num_seqs; ++i) {
    const SampleRequest& row = sampling.rows[static_cast<size_t>(i)];
    SampledToken sampled{host.tokens[i], 0.0f, {}};
    if (row.logprobs) {
      sampled.logprob = host.logprobs[i];
      // As SamplingRule: min(top_logprobs, vocab) alternatives (the kernel marks the ones past the vocabulary -1).
      const int64_t count = std::min<int64_t>(row.params.top_logprobs, config.vocab_size);
      sampled.top.reserve(static_cast<size_t>(count));
      for (int64_t j = 0; j < count; ++j) {
        sampled.top.push_back({host.top_ids[i * top + j], host.top_values[i * top + j]});
      }
    }
    out.push_back(std::move(sampled));
  }
  return Status::ok();
}

}  // namespace deltaserve::engine::cuda
