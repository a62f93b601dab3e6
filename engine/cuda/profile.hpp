// Per-phase GPU time of CudaBackend's eager passes (CudaBackendOptions::profile): cudaEvents at phase boundaries on
// the backend's stream, elapsed times summed per phase after each pass. Off (the default): no events, no
// synchronisation; every call below returns at its first test.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "common/status.hpp"

namespace deltaserve::engine::cuda {

enum class Phase : int {
  kTableUpload = 0,  // residencies (slots, pages, host-state uploads) and the per-pass tables
  kEmbedding,
  kNorms,  // input / post-attention norms, AttnRes mixes
  kKdaProjections,
  kKdaConv,        // kda_prep (prefill) — decode fuses it into the recurrence
  kKdaRecurrence,  // kda_decode_step (conv + recurrence + gated norm) or the chunked / generic recurrence
  kKdaOutput,      // gated output norm (prefill) and o_proj
  kMlaProjections,
  kMlaAttention,  // cache-row writes and the attention kernel
  kMlaOutput,     // output gate and o_proj
  kMoeRouter,
  kMoePlan,
  kMoeExpertFfn,  // row gather (and the latent down-projection) and the expert FFN
  kMoeCombine,    // combine (and the latent up-projection)
  kSharedExperts,
  kDenseFfn,
  kLmHead,
  kSampling,     // forward_sample: the sampling kernels and the copy of the results (after a graph replay too)
  kDecodeGraph,  // a whole pure-decode step replayed from a CUDA graph (not split into phases)
  kCount
};
const char* phase_name(Phase phase);

struct PhaseTime {
  std::string phase;
  double ms = 0.0;
  int64_t intervals = 0;  // how many timed intervals were summed
};

class Profiler {
 public:
  Profiler() = default;
  ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  void enable(bool on) { enabled_ = on; }
  bool enabled() const { return enabled_ && !paused_; }
  // While paused (a graph capture) marks record nothing.
  void pause(bool paused) { paused_ = paused; }

  // Starts `phase` at this point of the stream (ends the phase before it).
  void mark(Phase phase, cudaStream_t stream) {
    if (enabled_ && !paused_) record(static_cast<int>(phase), stream);
  }
  // Ends the current phase (the time up to the next mark counts for nothing).
  void idle(cudaStream_t stream) {
    if (enabled_ && !paused_) record(-1, stream);
  }
  // After a pass: waits for its last event and adds the intervals to the totals. Drops the pass on a CUDA error.
  [[nodiscard]] Status collect();

  std::vector<PhaseTime> totals() const;
  void reset() {
    totals_ = {};
    counts_ = {};
  }
  // A text table (phase, ms, share, intervals); empty when nothing was recorded.
  std::string table() const;

 private:
  void record(int phase, cudaStream_t stream);
  bool enabled_ = false, paused_ = false;
  std::vector<cudaEvent_t> events_;  // pool, reused by every pass
  std::vector<int> phases_;          // phase starting at events_[i] of this pass (-1: none)
  size_t used_ = 0;
  bool failed_ = false;
  std::array<double, static_cast<size_t>(Phase::kCount)> totals_{};
  std::array<int64_t, static_cast<size_t>(Phase::kCount)> counts_{};
};

}  // namespace deltaserve::engine::cuda
