#include "engine/backend.hpp"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/model.hpp"

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

Status check_sample_rows(std::span<const SequenceInput> batch, std::span<const SampleRequest> rows) {
  if (rows.size() != batch.size()) {
    return invalid_argument("forward_sample: " + std::to_string(rows.size()) + " sampling rows for " +
                            std::to_string(batch.size()) + " sequences");
  }
  for (size_t s = 0; s < batch.size(); ++s) {
    const std::string where = "sequence " + std::to_string(s);
    if (batch[s].all_logits) {
      return invalid_argument(where + ": forward_sample samples the last token only; all_logits must be false");
    }
    DS_RETURN_IF_ERROR_CTX(validate_request(rows[s]), where);
  }
  return Status::ok();
}

Status Backend::forward_sample(std::span<SequenceInput> batch, std::span<const SampleRequest> rows,
                               std::vector<SampledToken>& out, const ForwardOptions& options) {
  std::vector<std::vector<float>> logits;
  DS_RETURN_IF_ERROR(forward(batch, logits, options));
  sample_rows(logits, rows, out);
  return Status::ok();
}

Result<DeviceStateSpans> Backend::device_state_spans(const RequestState&) {
  return Status(StatusCode::kUnimplemented, name() + " keeps no request state in device memory");
}

Status Backend::reserve_device_state(RequestState&, int64_t) {
  return Status(StatusCode::kUnimplemented, name() + " keeps no request state in device memory");
}

}  // namespace deltaserve::engine
