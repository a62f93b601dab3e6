// The model's weights in memory, fp32, row-major, shapes as in the checkpoint (model.md).
// Loaded from a Checkpoint by load_model_weights; every tensor's shape is checked against the config
// and every tensor in the checkpoint must be used (except the skipped vision tower).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.hpp"
#include "engine/checkpoint/safetensors.hpp"
#include "engine/model_config.hpp"

namespace deltaserve::engine {

using Tensor = std::vector<float>;  // fp32, row-major; the shape is implied by the config

struct KdaWeights {
  Tensor q_proj, k_proj, v_proj;  // [H·d, hidden]
  Tensor q_conv, k_conv, v_conv;  // [H·d, K]   (checkpoint [H·d, 1, K])
  Tensor a_log;                   // [H]        (checkpoint [1, 1, H, 1] or [H])
  Tensor dt_bias;                 // [H·d]
  Tensor f_a, f_b;                // [r, hidden], [H·d, r]    decay gate, low rank
  Tensor b_proj;                  // [H, hidden]              beta
  Tensor g_a, g_b;                // [r, hidden], [H·d, r]    output gate, low rank (Kimi Linear)
  Tensor g_proj;                  // [H·d, hidden]            output gate, full rank (K3)
  Tensor o_norm;                  // [d]
  Tensor o_proj;                  // [hidden, H·d]
};

struct MlaWeights {
  Tensor q_proj;                        // [H·(nope+rope), hidden] when q_lora_rank is null
  Tensor q_a_proj, q_a_norm, q_b_proj;  // [q_lora, hidden], [q_lora], [H·(nope+rope), q_lora]
  Tensor kv_a_proj;                     // [kv_lora + rope, hidden]
  Tensor kv_a_norm;                     // [kv_lora]
  Tensor kv_b_proj;                     // [H·(nope + v), kv_lora]: per head W_UK rows then W_UV rows
  Tensor g_proj;                        // [H·v, hidden] when mla_use_output_gate
  Tensor o_proj;                        // [hidden, H·v]
};

struct FfnWeights {
  Tensor gate, up;  // [intermediate, width]
  Tensor down;      // [width, intermediate]
  int64_t width = 0;
  int64_t intermediate = 0;
};

struct MoeWeights {
  Tensor router;                    // [E, hidden], fp32 logits
  Tensor correction_bias;           // [E] (zeros when the checkpoint has none)
  std::vector<FfnWeights> experts;  // E experts at width = hidden, or the latent width for LatentMoE
  FfnWeights shared;                // num_shared · moe_intermediate wide, on the full hidden x; empty when none
  Tensor latent_down;               // [latent, hidden]   routed_expert_down_proj (LatentMoE)
  Tensor latent_norm;               // [latent]           routed_expert_norm (when latent_moe_use_norm)
  Tensor latent_up;                 // [hidden, latent]   routed_expert_up_proj
};

struct AttnResWeights {
  Tensor norm;  // [hidden]
  Tensor proj;  // [hidden]  (checkpoint [1, hidden])
};

struct LayerWeights {
  LayerKind kind = LayerKind::kKda;
  Tensor input_norm, post_attention_norm;  // [hidden]
  KdaWeights kda;
  MlaWeights mla;
  bool is_moe = false;
  FfnWeights dense;                       // when !is_moe
  MoeWeights moe;                         // when is_moe
  AttnResWeights attention_res, mlp_res;  // when attn_res_block_size is set
};

struct ModelWeights {
  Tensor embed_tokens;  // [vocab, hidden]
  Tensor final_norm;    // [hidden]
  Tensor lm_head;       // [vocab, hidden] (a copy of embed_tokens when tied)
  AttnResWeights output_res;
  std::vector<LayerWeights> layers;
};

// Reads every tensor the config calls for, checks its shape, dequantises to fp32, and fails on
// tensors the config does not explain (vision tower tensors of K3 checkpoints are skipped).
// Error messages name the tensor (and file, through the Checkpoint).
Result<ModelWeights> load_model_weights(const Checkpoint& checkpoint, const ModelConfig& config);

// Every tensor name and shape a checkpoint of `config` holds (the loader's expectations; make-model
// writes exactly these). Order: embeddings, layers in order, final norm, lm_head. The low-rank KDA
// gates (f_a/f_b, g_a/g_b) have rank head_dim, as in Kimi Linear.
struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  bool is_norm = false;  // RMSNorm weight: make-model initialises it near 1
};
std::vector<TensorSpec> expected_tensors(const ModelConfig& config);

}  // namespace deltaserve::engine
