#include "kvstore/cache/prefill_plan.hpp"

#include <algorithm>
#include <cassert>

namespace deltaserve::kvstore {

PrefillPlan::PrefillPlan(int64_t prompt_tokens, int64_t chunk_tokens, int64_t block_tokens)
    : prompt_tokens_(prompt_tokens), chunk_tokens_(chunk_tokens), block_tokens_(block_tokens) {
  assert(prompt_tokens_ >= 1 && chunk_tokens_ >= 1 && block_tokens_ >= 0);
}

int64_t PrefillPlan::chunk_end(int64_t position) const {
  int64_t end = std::min(position + chunk_tokens_, target());
  if (block_tokens_ > 0 && end / block_tokens_ > position / block_tokens_ && end % block_tokens_ != 0) {
    end = end / block_tokens_ * block_tokens_;
  }
  return end;
}

int64_t PrefillPlan::boundary_at(int64_t position) const {
  if (block_tokens_ <= 0 || position % block_tokens_ != 0) return 0;
  return position / block_tokens_;
}

}  // namespace deltaserve::kvstore
