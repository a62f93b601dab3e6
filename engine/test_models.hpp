// Test helpers for engine suites: a random model of a preset written in the real checkpoint format and
// loaded back, random token ids, and a backend that runs a CPU model (for the Backend defaults and failures).
#pragma once

#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/temp_dir.hpp"
#include "engine/backend.hpp"
#include "engine/make_model.hpp"
#include "engine/model.hpp"

namespace deltaserve::engine::testing {

// A tiny preset with the real models' head sizes (KDA head 128, MLA 512 latent + 64 rope), small elsewhere: what
// the GPU kernels specialise for, at a size a test runs in seconds.
inline ModelConfig real_head_sizes(ModelConfig c) {
  c.hidden_size = 256;
  c.intermediate_size = 256;
  c.kda.num_heads = 2;
  c.kda.head_dim = 128;
  c.kda.gate_low_rank = 128;
  c.mla.num_heads = 2;
  c.mla.kv_lora_rank = 512;
  c.mla.qk_rope_head_dim = 64;
  c.mla.qk_nope_head_dim = 128;
  c.mla.v_head_dim = 128;
  if (c.mla.q_lora_rank) c.mla.q_lora_rank = 64;
  c.moe.num_experts = 8;
  c.moe.moe_intermediate_size = 64;
  if (c.moe.routed_expert_hidden_size) c.moe.routed_expert_hidden_size = 128;
  return c;
}

inline std::unique_ptr<Model> make_model(const std::string& preset, DType dtype = DType::kF32, uint64_t shard_bytes = 0,
                                         uint64_t seed = 7) {
  TempDir dir;
  auto config = preset_config(preset);
  EXPECT_TRUE(config.is_ok()) << config.status().to_string();
  if (!config.is_ok()) return nullptr;
  MakeModelOptions options;
  options.seed = seed;
  options.dtype = dtype;
  options.max_shard_bytes = shard_bytes;
  Status written = write_random_model(*config, dir.path(), options);
  EXPECT_TRUE(written.is_ok()) << written.to_string();
  auto model = Model::load(dir.path());
  EXPECT_TRUE(model.is_ok()) << model.status().to_string();
  return model.is_ok() ? std::move(model).value() : nullptr;
}

inline std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  return tokens;
}

// A Backend whose forward pass is a CPU model's (so forward_sample is the base class's default: forward, then the
// rule on the host), and which fails its next `fail_passes` passes (kUnavailable) without touching any state.
class CpuModelBackend : public Backend {
 public:
  explicit CpuModelBackend(const Model& model) : model_(model) {}
  std::string name() const override { return "cpu-model-backend"; }
  BackendCapacity capacity() const override { return {}; }
  Status forward(std::span<SequenceInput> batch, std::vector<std::vector<float>>& logits,
                 const ForwardOptions& options) override {
    ++passes;
    if (fail_passes > 0) {
      --fail_passes;
      return Status(StatusCode::kUnavailable, "injected failure");
    }
    return model_.forward(batch, logits, options);
  }
  int fail_passes = 0;
  int passes = 0;

 private:
  const Model& model_;
};

}  // namespace deltaserve::engine::testing
