// The CUDA backend of the engine: the whole hybrid model (KDA, MLA, MoE, dense FFN, AttnRes, LM head) on one
// NVIDIA GPU (sm_90a) behind engine::Backend, with request state resident on the device (engine/cuda/
// device_state.hpp). Numerics: residual stream fp32; GEMM inputs bf16 (weights bf16 on the device, activations
// rounded once), fp32 accumulation; router logits fp32 (fp32 weights and GEMM); norms, softmax, gates fp32; KDA
// states fp32; MLA cache rows bf16; logits fp32.
//
// Memory plan (at construction; nothing is printed): budget = min(free, memory_fraction × total) of the device.
// Weights (exact size from expected_tensors) and the scratch for max_batch_tokens rows (residual stream, AttnRes
// blocks, per-layer arena, KDA prefill and MLA attention workspaces, LM-head pieces) come first; of the rest, state
// slots take at most half (and at most max_requests) unless state_slots / cache_pages fix either count, and MLA
// pages take what remains. capacity() reports the result.
//
// Paths: KDA head size 128 runs kda_decode_step for pure-decode batches and kda_prep + kda_chunk_prefill (states
// gathered from the slot pool in groups, or used in place for one sequence) + kda_gated_output_norm otherwise;
// other head sizes run kda_prep_f32 + kda_gate + kda_recurrent_varlen. MLA uses mla_decode for pure-decode batches
// and mla_prefill otherwise. MoE layers of up to 4 tokens (no LatentMoE, shapes permitting) run the small-batch MoE
// layer (moe_small_batch_*); other batches run moe_expert_ffn_decode (the bandwidth kernel while tokens × top_k <= 4 ×
// experts, the grouped tensor-core GEMM beyond), without a host sync. Projections: engine/cuda/gemm.hpp.
//
// CUDA graphs (options.cuda_graphs, set_cuda_graphs): a pure-decode pass (one token per sequence) of a batch
// size seen before is replayed from a graph captured for (exact batch size, power-of-two context bound); the
// per-pass tables go to fixed device buffers first. Batches whose logits need more than one LM-head piece run
// eagerly, as does every other pass (policy: cuda_graph.cpp).
//
// Sampling (forward_sample, Model::forward_sample, used by the decode batcher): the pass keeps the logits on the
// device and kernels::cuda::sample picks every row's token there (one launch per LM-head piece, after the graph
// replay for graph passes), from per-row temperature / top-p / top-k / draw / top_logprobs arrays uploaded with the
// pass's tables; only the tokens, their logprobs and the alternatives asked for come back (8 + 8 x top_logprobs
// bytes per row instead of 4 x vocab). Choices are SamplingRule's (engine/sampler.hpp) up to the kernel's one
// documented difference (kernels/cuda/ops/sampling.hpp: top_p < 1 over more than 64 top-k candidates). The workspace
// shares the layer arena.
//
// Profiling (options.profile, enable_profile): times the phases of eager passes with cudaEvents (profile.hpp; a
// replayed graph counts as one phase) and prints the table to stderr when the backend is destroyed. Off: no events.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/status.hpp"
#include "engine/backend.hpp"
#include "engine/checkpoint/safetensors.hpp"
#include "engine/model.hpp"
#include "engine/model_config.hpp"
#include "engine/model_weights.hpp"

namespace deltaserve::engine::cuda {

struct CudaBackendOptions {
  int device = 0;
  double memory_fraction = 0.90;    // of the device's memory, for weights + state slots + pages + scratch
  int64_t max_batch_tokens = 8192;  // rows of one forward pass (prefill chunk + decode tokens): sizes the scratch
  int64_t max_requests = 1024;      // upper bound of state slots
  int page_tokens = 64;             // MLA page size (tokens): a multiple of 16 up to 256
  int64_t state_slots = 0;          // 0 = from the memory plan (min(max_requests, what fits))
  int64_t cache_pages = 0;          // 0 = from the memory plan (the rest of the budget)
  bool cuda_graphs = true;          // replay pure-decode passes from CUDA graphs (false: every pass eager)
  bool profile = false;             // per-phase GPU time of eager passes from the first pass (see the top)
};

class CudaBackend final : public Backend {
 public:
  struct Impl;
  explicit CudaBackend(std::unique_ptr<Impl> impl);
  ~CudaBackend() override;

  std::string name() const override;
  BackendCapacity capacity() const override;
  // Model::forward's pass (the caller validated the batch). On kResourceExhausted (no free slot or page) no state
  // was touched; the message says what ran out.
  [[nodiscard]] Status forward(std::span<SequenceInput> batch, std::vector<std::vector<float>>& logits,
                               const ForwardOptions& options) override;
  // Model::forward_sample's pass, sampled on the device (see the top); the same error contract as forward.
  [[nodiscard]] Status forward_sample(std::span<SequenceInput> batch, std::span<const SampleRequest> rows,
                                      std::vector<SampledToken>& out, const ForwardOptions& options) override;

  // For benchmarks: the same pass, but the logits stay on the device (device_logits(): the last LM-head piece of
  // up to logit_chunk_rows() rows, fp32 [rows, vocab]; after forward_sample, the last piece it sampled from).
  // Validates the batch itself. Asynchronous: the pass may still run on the device when this returns; synchronize()
  // waits for it.
  [[nodiscard]] Status forward_on_device(std::span<SequenceInput> batch, const ForwardOptions& options = {});
  [[nodiscard]] Status synchronize();
  const float* device_logits() const;
  int64_t logit_chunk_rows() const;

  // For benchmarks of long contexts: gives a fresh `state` (no tokens, no residency) a state slot and the MLA pages of
  // `tokens` tokens, zero-filled, and advances it by `tokens` as if they had been computed (zero KDA states, zero MLA
  // rows: the decode work per step is that of a real context of this length; the values are not a real prompt's).
  // kResourceExhausted when the slot or pages are not free; nothing is taken then.
  [[nodiscard]] Status assume_context(RequestState& state, int64_t tokens);

  // Handoffs in device memory (Backend): the spans of a resident state and fresh states reserved to receive one.
  [[nodiscard]] Result<DeviceStateSpans> device_state_spans(const RequestState& state) override;
  [[nodiscard]] Status reserve_device_state(RequestState& state, int64_t tokens) override;
  std::vector<DeviceSpan> device_memory_regions() const override;
  std::string device_state_layout() const override;

  // CUDA graphs on or off from the next pass on (graphs already captured are kept).
  void set_cuda_graphs(bool on);
  // Destroys every captured decode graph (after the stream's work is done): the next graph-eligible passes capture
  // again (benchmarks that must see a capture, e.g. a tracer enabled after the first one).
  void clear_cuda_graphs();
  bool cuda_graphs() const;
  struct GraphStats {
    int64_t cached = 0;    // instantiated graphs held now
    int64_t captures = 0;  // graphs captured so far
    int64_t replays = 0;   // passes run by a graph replay
    int64_t failed = 0;    // keys whose capture failed (they run eagerly)
  };
  GraphStats graph_stats() const;

  // The per-phase GPU time of eager passes (options.profile, or enable_profile(true) from the next pass on):
  // totals since the last reset, in milliseconds; profile_table() as text (empty when nothing was timed).
  void enable_profile(bool on);
  std::vector<std::pair<std::string, double>> profile() const;
  std::string profile_table() const;
  void reset_profile();

  // Pool occupancy (tests, metrics).
  int64_t free_state_slots() const;
  int64_t free_cache_pages() const;

 private:
  std::unique_ptr<Impl> impl_;
};

// Weights from host fp32 tensors (the CPU loader's output; converted to bf16 on upload, small vectors kept fp32).
Result<std::shared_ptr<Backend>> make_cuda_backend(const ModelConfig& config, const ModelWeights& weights,
                                                   const CudaBackendOptions& options);
// Weights streamed tensor by tensor from a checkpoint (never the whole model in host fp32), with a progress callback
// (device bytes done, bytes total).
Result<std::shared_ptr<Backend>> make_cuda_backend(const ModelConfig& config, const Checkpoint& checkpoint,
                                                   const CudaBackendOptions& options,
                                                   std::function<void(int64_t, int64_t)> progress = {});
// Random weights initialised on the device (same distributions as engine/make_model: projections scaled
// 1/sqrt(fan_in), norms near 1), deterministic in `seed`.
Result<std::shared_ptr<Backend>> make_cuda_backend_random(const ModelConfig& config, uint64_t seed,
                                                          const CudaBackendOptions& options);

}  // namespace deltaserve::engine::cuda
