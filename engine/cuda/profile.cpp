#include "engine/cuda/profile.hpp"

#include <cstdio>

#include "engine/cuda/cuda_util.hpp"

namespace deltaserve::engine::cuda {

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::kTableUpload:
      return "table upload";
    case Phase::kEmbedding:
      return "embedding";
    case Phase::kNorms:
      return "norms + AttnRes";
    case Phase::kKdaProjections:
      return "KDA projections";
    case Phase::kKdaConv:
      return "KDA conv (prep)";
    case Phase::kKdaRecurrence:
      return "KDA recurrence";
    case Phase::kKdaOutput:
      return "KDA output";
    case Phase::kMlaProjections:
      return "MLA projections";
    case Phase::kMlaAttention:
      return "MLA attention";
    case Phase::kMlaOutput:
      return "MLA output";
    case Phase::kMoeRouter:
      return "MoE router";
    case Phase::kMoePlan:
      return "MoE plan";
    case Phase::kMoeExpertFfn:
      return "MoE expert FFN";
    case Phase::kMoeCombine:
      return "MoE combine";
    case Phase::kSharedExperts:
      return "shared experts";
    case Phase::kDenseFfn:
      return "dense FFN";
    case Phase::kLmHead:
      return "LM head";
    case Phase::kSampling:
      return "sampling";
    case Phase::kDecodeGraph:
      return "decode graph (whole step)";
    case Phase::kCount:
      break;
  }
  return "?";
}

Profiler::~Profiler() {
  for (cudaEvent_t event : events_) (void)cudaEventDestroy(event);
}

void Profiler::record(int phase, cudaStream_t stream) {
  if (failed_) return;
  if (used_ == events_.size()) {
    cudaEvent_t event = nullptr;
    if (cudaEventCreate(&event) != cudaSuccess) {
      (void)cudaGetLastError();
      failed_ = true;
      return;
    }
    events_.push_back(event);
    phases_.push_back(-1);
  }
  if (cudaEventRecord(events_[used_], stream) != cudaSuccess) {
    (void)cudaGetLastError();
    failed_ = true;
    return;
  }
  phases_[used_] = phase;
  ++used_;
}

Status Profiler::collect() {
  const size_t used = used_;
  const bool failed = failed_;
  used_ = 0;
  failed_ = false;
  if (!enabled_ || used == 0 || failed) return Status::ok();
  DS_CUDA_RETURN(cudaEventSynchronize(events_[used - 1]));
  for (size_t i = 0; i + 1 < used; ++i) {
    if (phases_[i] < 0) continue;
    float ms = 0.0f;
    DS_CUDA_RETURN(cudaEventElapsedTime(&ms, events_[i], events_[i + 1]));
    totals_[static_cast<size_t>(phases_[i])] += ms;
    ++counts_[static_cast<size_t>(phases_[i])];
  }
  return Status::ok();
}

std::vector<PhaseTime> Profiler::totals() const {
  std::vector<PhaseTime> out;
  for (size_t i = 0; i < totals_.size(); ++i) {
    if (counts_[i] == 0) continue;
    out.push_back({phase_name(static_cast<Phase>(i)), totals_[i], counts_[i]});
  }
  return out;
}

std::string Profiler::table() const {
  const std::vector<PhaseTime> rows = totals();
  if (rows.empty()) return {};
  double sum = 0.0;
  for (const PhaseTime& row : rows) sum += row.ms;
  std::string text = "phase                        ms        share  intervals\n";
  char line[160];
  for (const PhaseTime& row : rows) {
    std::snprintf(line, sizeof(line), "%-26s %10.3f  %6.1f%%  %9lld\n", row.phase.c_str(), row.ms,
                  sum > 0 ? 100.0 * row.ms / sum : 0.0, static_cast<long long>(row.intervals));
    text += line;
  }
  std::snprintf(line, sizeof(line), "%-26s %10.3f\n", "total (timed)", sum);
  text += line;
  return text;
}

}  // namespace deltaserve::engine::cuda
