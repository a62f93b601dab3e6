// Deterministic model checkpoints in the real formats (config.json + safetensors shards + index),
// for the built-in tiny models and for tests: no weights are ever downloaded.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.hpp"
#include "engine/checkpoint/safetensors.hpp"
#include "engine/model_config.hpp"

namespace deltaserve::engine {

// Presets small enough for fast tests, covering both layer kinds, both FFN kinds, both gate forms:
//   tiny-linear: Kimi Linear layout (KDA×3 + MLA, plain residuals, SwiGLU MoE, softplus gate, q_proj).
//   tiny-k3:     K3 layout (nested text_config, lower-bound gate, g_proj, q_lora, MLA output gate,
//                LatentMoE with norm, SiTU-GLU, Block AttnRes with block size 3).
// `vocab_base` is the number of BPE tokens of the tokenizer written beside it; 256 specials follow.
inline constexpr int64_t kTinyVocabBase = 1024;
std::vector<std::string> preset_names();
Result<ModelConfig> preset_config(std::string_view name, int64_t vocab_base = kTinyVocabBase);

struct MakeModelOptions {
  uint64_t seed = 0;
  DType dtype = DType::kBF16;    // storage dtype of weights; F8_E4M3 block-quantises 2-D projections
  uint64_t max_shard_bytes = 0;  // 0 = one model.safetensors; else shards + index
};

// Writes config.json and the weights for `config` into `directory` (created if needed). Weights are
// drawn from a seeded generator, scaled 1/sqrt(fan_in); norms near 1. Byte-for-byte deterministic.
Status write_random_model(const ModelConfig& config, const std::filesystem::path& directory,
                          const MakeModelOptions& options);

}  // namespace deltaserve::engine
