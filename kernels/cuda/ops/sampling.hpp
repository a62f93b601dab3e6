// Token sampling on the GPU: the same choice as engine::Sampler (engine/sampler.hpp, the reference) given the
// same uniform draw per row. Greedy rows (temperature 0) take the argmax (ties to the lowest id); other rows
// take softmax(logits / temperature) restricted to top-k (by value desc, id asc), then the nucleus top-p, and
// invert the CDF at the row's draw. Logits: NaN counts as -inf, +inf as FLT_MAX.
// One known difference: with top_p < 1 over more than 64 top-k candidates, engine::Sampler walks its nucleus in
// its quickselect's partition order, this in sorted order: the same nucleus and distribution, but the same draw
// may pick another token of it. Everywhere else the choice is the CPU's (up to fp64 summation order).
// Workspace: 16 bytes per logit plus the sort's scratch; only rows that filter or report top_logprobs are sorted
// (row_top_logprobs lets a batch mix rows that report alternatives with rows that do not).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "common/status.hpp"

namespace deltaserve::kernels::cuda {

constexpr int kMaxSampleTopLogprobs = 20;

struct SampleParams {
  int rows = 0;
  int64_t vocab = 0;
  const float* logits = nullptr;       // [rows, vocab] fp32 (row stride = vocab); NaN = -inf, +inf = FLT_MAX
  const float* temperature = nullptr;  // device [rows]; 0 = greedy
  const float* top_p = nullptr;        // device [rows]; 1 = off
  const int32_t* top_k = nullptr;      // device [rows]; 0 = off
  const double* uniform = nullptr;     // device [rows]: the row's random draw in [0, 1) (the caller draws it from
                                       // the request's own RNG stream, exactly as engine::Sampler does)
  int top_logprobs = 0;                // [0, 20] alternatives per row (the row stride of top_ids / top_values)
  int32_t* tokens = nullptr;           // device [rows] out
  float* logprobs = nullptr;           // device [rows] out: log-softmax of the raw logits at the chosen token
  int32_t* top_ids = nullptr;          // device [rows, top_logprobs] out (best first, ties to lower id) or nullptr
  float* top_values = nullptr;         // device [rows, top_logprobs] out or nullptr
  void* workspace = nullptr;           // device, >= sample_workspace_bytes(rows, vocab), 256-byte aligned
  size_t workspace_bytes = 0;
  // device [rows] or nullptr (every row top_logprobs): the alternatives of each row, in [0, top_logprobs]; entries
  // past a row's count are id -1 / -inf; a row with none that does not filter is not sorted.
  const int32_t* row_top_logprobs = nullptr;
};
size_t sample_workspace_bytes(int rows, int64_t vocab);
[[nodiscard]] Status sample(const SampleParams& params, cudaStream_t stream);

}  // namespace deltaserve::kernels::cuda
