// Which dispatch attempt of a request writes to its client stream. The router dispatches a request again
// (attempt n+1) when it loses sight of a worker, which may only have stalled: two attempts can then send
// chunks to the request's sink. A new attempt resumes the request after the chunks the router knew the client
// had when it dispatched it (its `start`: the sink reports every chunk it forwards to the router, which records
// them; router_protocol.hpp): it is prefilled with the prompt plus those tokens and its first chunk is chunk
// `start` of the stream. Every attempt computes the same stream from there (greedy, or sampled with a seed, the
// sampler positioned at the resume point: engine/sampler.hpp; on batch-invariant kernels), one chunk per
// generated token, so the gate forwards chunk i exactly once and checks every later copy of it against what
// the client got.
//
// Rules (attempts count from 1; attempt 0 marks the router's own chunks, which always pass):
//   - the router announces attempt n and its start (announce(n, start)) before any chunk of it can reach the
//     sink; start <= the chunks forwarded so far (the router learns of them from this sink);
//   - the owner is the attempt whose chunks the client is getting. With no owner, the first chunk of an
//     attempt at or above the latest announcement makes it the owner if the attempt starts where the client is;
//   - an announced attempt newer than the owner first replays the chunks the client got after its start (the
//     router's record lagged, or the old attempt kept going: a stalled worker): each is compared with what was
//     forwarded and dropped. Once it has replayed them all it becomes the owner (the older attempt is then
//     stale). A replayed chunk that differs, or a final chunk where the client's stream went on, ends the stream
//     (kDiverged): the client never sees a token rewritten. (A replayed "abort" passes: the client asked.);
//   - chunks of attempts below the latest announcement that do not own the stream are dropped;
//   - the owner's final error chunk while a newer attempt is announced is not the end of the stream: the
//     owner gave the request up, the newer attempt carries on from where the client is.
// A worker that dies is the router's to notice (registry `lost`): it dispatches a new attempt, or ends the
// stream itself.
// The router's announcement is enqueued at the sink before it sends the attempt's job, and every chunk of
// that attempt is caused by that job, so no chunk of attempt n reaches the sink before announce(n).
#pragma once

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <map>
#include <vector>

#include "router/inference_service.hpp"

namespace deltaserve::actors {

class StreamGate {
 public:
  enum class Verdict { kForward, kDrop, kDiverged };

  // The router dispatched `attempt`, which resumes the stream at chunk `start` (0: from the beginning).
  void announce(int64_t attempt, size_t start) {
    assert(start <= forwarded_.size());  // the router knows only of chunks this gate forwarded
    if (attempt > owner_ && attempt >= floor_) replay_[attempt] = std::min(start, forwarded_.size());
    floor_ = std::max(floor_, attempt);
  }

  Verdict admit(int64_t attempt, const router::GenerationChunk& chunk) {
    if (attempt == 0) return Verdict::kForward;
    if (owner_ == 0 && attempt >= floor_ && replayed(attempt) == forwarded_.size()) return take(attempt, chunk);
    if (attempt == owner_) {
      if (!chunk.error.is_ok() && floor_ > owner_) {  // gave the request up to a newer attempt
        abandon();
        return Verdict::kDrop;
      }
      return take(attempt, chunk);
    }
    if (attempt < floor_ || attempt < owner_) return drop();
    // A newer announced attempt replaying what the client has.
    size_t& index = replay_[attempt];
    if (!chunk.error.is_ok()) {  // it failed while replaying: the end of the stream unless the owner goes on
      return owner_ == 0 ? take(attempt, chunk) : drop();
    }
    if (index < forwarded_.size()) {
      if (chunk.finish_reason == "abort") return take(attempt, chunk);  // cancelled while replaying
      if (chunk.tokens != forwarded_[index] || chunk.is_final()) return Verdict::kDiverged;
      ++index;
      return drop();
    }
    return take(attempt, chunk);  // caught up: from here on the client gets this attempt
  }

  int64_t owner() const { return owner_; }                // 0: no attempt owns the stream
  size_t forwarded() const { return forwarded_.size(); }  // worker chunks the client got
  int64_t dropped() const { return dropped_; }

 private:
  void abandon() { owner_ = 0; }
  size_t replayed(int64_t attempt) const {
    auto it = replay_.find(attempt);
    return it == replay_.end() ? 0 : it->second;
  }
  Verdict take(int64_t attempt, const router::GenerationChunk& chunk) {
    owner_ = attempt;
    replay_.erase(attempt);
    forwarded_.push_back(chunk.tokens);
    return Verdict::kForward;
  }
  Verdict drop() {
    ++dropped_;
    return Verdict::kDrop;
  }

  int64_t floor_ = 0;
  int64_t owner_ = 0;
  std::vector<std::vector<int32_t>> forwarded_;  // tokens of each worker chunk forwarded, in order
  std::map<int64_t, size_t> replay_;             // newer attempt -> stream index of its next chunk (start + replayed)
  int64_t dropped_ = 0;
};

}  // namespace deltaserve::actors
