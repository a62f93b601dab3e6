#include "engine/backend.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace deltaserve::engine {

int64_t BackendCapacity::requests_that_fit(int64_t tokens) const {
  if (tokens < 0) return 0;
  int64_t fit = state_slots > 0 ? state_slots : INT64_MAX;
  if (cache_pages > 0 && page_tokens > 0) {
    const int64_t pages_each = std::max<int64_t>(1, (tokens + page_tokens - 1) / page_tokens);
    fit = std::min(fit, cache_pages / pages_each);
  }
  return fit == INT64_MAX ? 0 : fit;
}

Status Backend::forward_sample(std::span<SequenceInput> batch, std::span<const SampleRequest> rows,
                               std::vector<SampledToken>& out, const ForwardOptions& options) {
  std::vector<std::vector<float>> logits;
  DS_RETURN_IF_ERROR(forward(batch, logits, options));
  sample_rows(logits, rows, out);
  return Status::ok();
}

}  // namespace deltaserve::engine
