// How one prompt's prefill is cut into chunks around a worker's prefix cache (prefix_cache.hpp). The prefill
// computes prompt[0, N−1) (the decode worker feeds the last token), starting at the deepest usable cached
// boundary (a multiple of block_tokens), in chunks of at most chunk_tokens. With a cache, a chunk that crosses a
// block boundary and would end inside a block ends on the last boundary it reaches instead, so the KDA state
// there exists and can be checkpointed (with chunk_tokens <= block_tokens, every boundary is one). Which boundaries
// get a checkpoint is the cache's CheckpointPolicy (PrefixCache::should_checkpoint: every interval_blocks-th
// boundary and the last full block, optionally only on a second sighting); at the end the prompt's full blocks
// are registered (PrefixCache::insert).
//
// Pure arithmetic on sizes: the prefill worker runs the model, asks this where chunks end and which boundary it
// stands on.
#pragma once

#include <cstdint>

namespace deltaserve::kvstore {

// Full blocks of prompt[0, N−1): the deepest prefix a prefill can serve from a cache, in blocks (the decode worker
// feeds the last prompt token). 0 for an empty prompt or block_tokens <= 0 (no cache). The router's placement and
// the prefill worker both count usable blocks with this.
constexpr int64_t usable_prompt_blocks(int64_t prompt_tokens, int64_t block_tokens) {
  return prompt_tokens > 0 && block_tokens > 0 ? (prompt_tokens - 1) / block_tokens : 0;
}

class PrefillPlan {
 public:
  // prompt_tokens >= 1, chunk_tokens >= 1; block_tokens >= 1 with a prefix cache, 0 without (chunks then
  // ignore block boundaries and there are none).
  PrefillPlan(int64_t prompt_tokens, int64_t chunk_tokens, int64_t block_tokens);

  // N−1: the prompt tokens the prefill computes (or restores); the job is done at this position.
  int64_t target() const { return prompt_tokens_ - 1; }

  // Full blocks of prompt[0, N−1): the deepest hit a lookup may use, the boundaries that may get a checkpoint
  // (1..full_blocks) and those registered at the end. 0 without a cache.
  int64_t full_blocks() const { return usable_prompt_blocks(prompt_tokens_, block_tokens_); }

  // The end of the chunk that starts at `position` (< target()): e = min(position + chunk_tokens, target()),
  // or the last block boundary in (position, e) when there is one and e is not a boundary itself.
  int64_t chunk_end(int64_t position) const;

  // k >= 1 when `position` is the boundary after block k (position == k × block_tokens), else 0.
  int64_t boundary_at(int64_t position) const;

 private:
  int64_t prompt_tokens_;
  int64_t chunk_tokens_;
  int64_t block_tokens_;
};

}  // namespace deltaserve::kvstore
