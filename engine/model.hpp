// The hybrid model's forward pass on the CPU (fp32 math), over a batch of sequences of any lengths:
// a prefill chunk of one request and single decode tokens of others go through one call. Dense work
// (projections, FFN, MoE, LM head) runs over all rows of the batch at once; sequence mixing (short
// conv, KDA recurrence, MLA attention) runs per sequence against that sequence's RequestState.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.hpp"
#include "engine/backend.hpp"
#include "engine/model_config.hpp"
#include "engine/model_weights.hpp"
#include "engine/request_state.hpp"

namespace deltaserve::engine {

struct SequenceInput {
  RequestState* state = nullptr;    // advanced by tokens.size() on success
  std::span<const int32_t> tokens;  // new tokens, in order; at least one
  bool all_logits = false;          // logits for every new token, not only the last
};

struct ForwardOptions {
  int64_t kda_chunk_size = 64;  // chunk of the WY/UT prefill form; decode (1 token) uses the recurrence
};

class Model {
 public:
  // A model computed on the CPU from host weights.
  Model(ModelConfig config, ModelWeights weights);
  // A model whose forward passes run on `backend`, which holds the weights (none are kept on the host).
  Model(ModelConfig config, std::shared_ptr<Backend> backend);

  // Reads config.json and the safetensors checkpoint in `directory`. Errors name the file and field/tensor.
  static Result<std::unique_ptr<Model>> load(const std::filesystem::path& directory);

  const ModelConfig& config() const { return config_; }
  // The device backend, or nullptr for the CPU.
  Backend* backend() const { return backend_.get(); }
  std::string device_name() const { return backend_ ? backend_->name() : "cpu"; }
  RequestState new_state() const { return RequestState(config_); }

  // Runs one step for every sequence of the batch. On success logits[i] holds, for sequence i,
  // [vocab] (last token) or [T_i, vocab] (all_logits). Checks token ids and the context limit
  // first; on an error no state has been modified.
  Status forward(std::span<SequenceInput> batch, std::vector<std::vector<float>>& logits,
                 const ForwardOptions& options = {}) const;

  // A forward pass that samples: out[i] is rows[i] sampled from the logits of sequence i's last token (one row
  // per sequence; all_logits must be false), as SamplingRule::apply (engine/sampler.hpp) chooses it. On the CPU
  // that is forward() plus the rule on the host; a device backend samples where the logits are and returns only
  // the tokens (and the logprobs asked for): see Backend::forward_sample. Checks the rows (params, draws) and then
  // the batch as forward() does; on an error no state has been modified.
  Status forward_sample(std::span<SequenceInput> batch, std::span<const SampleRequest> rows,
                        std::vector<SampledToken>& out, const ForwardOptions& options = {}) const;

  // Convenience: prefill `tokens` into `state` in pieces of at most `chunk_tokens`, returning the
  // logits of the last token.
  Result<std::vector<float>> prefill(RequestState& state, std::span<const int32_t> tokens,
                                     int64_t chunk_tokens = 512) const;

  // Ordinal of `layer` among the layers of its kind: its index into RequestState::kda or ::mla.
  int64_t layer_slot(int64_t layer) const { return layer_slot_[static_cast<size_t>(layer)]; }

 private:
  struct Batch;
  // forward()'s checks: states, token ids, the context limit.
  Status check_batch(std::span<SequenceInput> batch) const;
  void run_kda(const LayerWeights& layer, int64_t slot, const float* x, float* out, Batch& batch,
               const ForwardOptions& options) const;
  void run_mla(const LayerWeights& layer, int64_t slot, const float* x, float* out, Batch& batch) const;
  void run_ffn(const LayerWeights& layer, const float* x, float* out, int64_t rows) const;
  void run_moe(const MoeWeights& moe, const float* x, float* out, int64_t rows) const;
  void run_dense_ffn(const FfnWeights& ffn, const float* x, float* out, int64_t rows) const;

  ModelConfig config_;
  ModelWeights weights_;
  std::shared_ptr<Backend> backend_;
  std::vector<int64_t> layer_slot_;
};

}  // namespace deltaserve::engine
