// The model architecture as read from a checkpoint's config.json (Kimi Linear, or K3 with its
// nested `text_config`). One struct serves both: fields absent from one family take the neutral
// value that makes the shared code path behave like that family.
//
// Layer indices here are 0-based; config.json's `kda_layers` / `full_attn_layers` are 1-based.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/json.hpp"
#include "common/status.hpp"

namespace deltaserve::engine {

enum class LayerKind { kKda, kMla };
enum class Activation { kSilu, kSitu };  // SwiGLU or SiTU-GLU in every FFN

struct KdaConfig {
  int64_t num_heads = 0;
  int64_t head_dim = 0;                   // d_k = d_v
  int64_t conv_kernel_size = 4;           // short causal depthwise conv
  std::optional<float> gate_lower_bound;  // K3: -5.0; absent = softplus gate
  bool full_rank_output_gate = false;     // K3 `g_proj` instead of `g_a_proj`/`g_b_proj`
  int64_t gate_low_rank = 0;              // rank of f_a/g_a; config.json does not carry it: parse sets head_dim (HF)

  bool operator==(const KdaConfig&) const = default;
};

struct MlaConfig {
  int64_t num_heads = 0;
  std::optional<int64_t> q_lora_rank;  // null: plain q_proj; set: q_a_proj → q_a_layernorm → q_b_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  bool use_nope = true;          // only NoPE is supported: rope dims exist but are never rotated
  bool use_output_gate = false;  // K3: attn_out ⊙ sigmoid(g_proj(x)) before o_proj

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  // Values per token in the latent cache: normed latent ‖ k_rot.
  int64_t cache_width() const { return kv_lora_rank + qk_rope_head_dim; }
  float softmax_scale() const;  // qk_head_dim^-0.5 (192^-0.5 for both families)

  bool operator==(const MlaConfig&) const = default;
};

struct MoeConfig {
  int64_t num_experts = 0;  // 0 = no MoE layers (every FFN dense)
  int64_t num_experts_per_token = 0;
  int64_t num_shared_experts = 0;
  int64_t moe_intermediate_size = 0;  // routed (and shared) expert intermediate width
  int64_t first_k_dense_replace = 0;  // layers [0, k) use the dense FFN
  int64_t layer_freq = 1;             // MoE on layer l iff num_experts > 0, l >= k and l % freq == 0 (HF rule)
  float routed_scaling_factor = 1.0f;
  bool renormalize = true;
  int64_t num_expert_groups = 1;  // divides num_experts; 1 when config.json says use_grouped_topk: false
  int64_t top_k_groups = 1;       // in [1, num_expert_groups]
  // Stable LatentMoE (K3): experts run in a narrower latent space.
  std::optional<int64_t> routed_expert_hidden_size;
  bool latent_moe_use_norm = false;  // routed_expert_norm (RMSNorm over the latent) before the up-projection

  bool operator==(const MoeConfig&) const = default;
};

struct ModelConfig {
  std::string model_type;           // "kimi_linear"
  std::string architecture;         // e.g. "KimiLinearForCausalLM"
  bool nested_text_config = false;  // K3 layout: fields under text_config, tensors under language_model.

  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t vocab_size = 0;
  int64_t intermediate_size = 0;  // dense FFN (layers < first_k_dense_replace)
  float rms_norm_eps = 1e-5f;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 0;  // context limit in tokens

  std::vector<LayerKind> layer_kinds;  // [num_layers], 0-based

  KdaConfig kda;
  MlaConfig mla;
  MoeConfig moe;

  Activation hidden_act = Activation::kSilu;
  float situ_beta = 4.0f;          // activation_situ_beta
  float situ_linear_beta = 25.0f;  // activation_situ_linear_beta

  std::optional<int64_t> attn_res_block_size;  // Block Attention Residuals when set

  int32_t bos_token_id = -1;  // -1: absent from config.json; otherwise in [0, vocab_size)
  int32_t eos_token_id = -1;
  int32_t pad_token_id = -1;

  bool operator==(const ModelConfig&) const = default;

  // Tensor-name prefixes: "model." / "lm_head." or "language_model.model." / "language_model.lm_head.".
  std::string tensor_prefix() const { return nested_text_config ? "language_model.model." : "model."; }
  std::string lm_head_name() const { return nested_text_config ? "language_model.lm_head.weight" : "lm_head.weight"; }

  // HF KimiDecoderLayer: num_experts > 0 && layer >= first_k_dense_replace && layer % moe_layer_freq == 0.
  bool is_moe_layer(int64_t layer) const;  // layer 0-based
  int64_t num_layers_of(LayerKind kind) const;

  // Serving footprint (bf16 cache, fp32 KDA state), used by inspect-model and the schedulers.
  int64_t kda_state_bytes_per_request() const;       // S: layers × H × d × d × 4 B
  int64_t kda_conv_state_bytes_per_request() const;  // conv tails: layers × 3 × H·d × (K-1) × 4 B (fp32, as
                                                     // RequestState keeps them; model.md's 1.4 MiB assumes bf16)
  int64_t mla_cache_bytes_per_token() const;         // MLA layers × cache_width × 2 B (bf16)
};

// Parses a config.json document. Every key is either understood, or on the list of keys known to be
// irrelevant for serving (e.g. `initializer_range`, `auto_map`); any other key — and any value of the
// wrong type, out of range, or inconsistent with another — is an InvalidArgument whose message names
// the field path, e.g. "text_config.linear_attn_config.kda_layers[3]: ...". A recognised but unsupported
// feature (mla_use_nope false, softmax router, gate_lower_bound below -5) is Unimplemented, naming the field.
// Keys read: see model_config.cpp (kTextKeys / kIgnoredTextKeys and friends).
Result<ModelConfig> parse_model_config(const json::Value& document);
Result<ModelConfig> parse_model_config_text(std::string_view text);
// Reads and parses `path` (a config.json or a directory holding one); errors are prefixed with the file path.
Result<ModelConfig> load_model_config(const std::filesystem::path& path);

// Writes the config back in the real format (nested under text_config when nested_text_config).
json::Value model_config_to_json(const ModelConfig& config);

}  // namespace deltaserve::engine
