// What a config.json describes, computed from the config alone (no checkpoint): parameter counts by
// component, and a human-readable architecture report (`deltaserve inspect-model`).
#pragma once

#include <cstdint>
#include <string>

#include "engine/model_config.hpp"

namespace deltaserve::engine {

// Parameter counts (elements, not bytes) of the tensors model.md lists for this config. The parts sum to
// `total`; `active_per_token` is what one token's forward pass multiplies by.
struct ParameterCounts {
  int64_t total = 0;
  int64_t embedding = 0;           // embed_tokens [vocab, hidden]
  int64_t lm_head = 0;             // [vocab, hidden]; 0 when tied to the embedding
  int64_t kda = 0;                 // every KDA layer's self_attn.* (projections, convs, A_log, dt_bias, gates, o_norm)
  int64_t mla = 0;                 // every MLA layer's self_attn.* (incl. q_a_layernorm, kv_a_layernorm, g_proj)
  int64_t dense_ffn = 0;           // mlp.{gate,up,down}_proj of the dense layers
  int64_t routed_experts = 0;      // experts.E.{w1,w2,w3} of every MoE layer
  int64_t shared_experts = 0;      // shared_experts.{gate,up,down}_proj
  int64_t router = 0;              // gate.weight + gate.e_score_correction_bias
  int64_t latent_projections = 0;  // LatentMoE: routed_expert_{down_proj,norm,up_proj} (0 without LatentMoE)
  int64_t norms_and_attn_res = 0;  // input/post-attention norms, final norm, AttnRes norm/proj tensors
  // total − embedding (a lookup reads one row) − the routed experts a token does not visit
  // (each MoE layer runs num_experts_per_token of num_experts).
  int64_t active_per_token = 0;
};

ParameterCounts count_parameters(const ModelConfig& config);

// A multi-line report: family, layer kinds, dims, MoE, parameter counts (human units and exact), active
// parameters per token, per-request KDA state and conv-tail bytes, per-token MLA cache bytes, and the MLA
// cache at 128k and 1M tokens. Byte counts read "41,943,040 B (40 MiB)".
std::string describe_model(const ModelConfig& config);

// "41,943,040": decimal digits grouped by thousands.
std::string with_thousands(int64_t value);
// "40 MiB", "2.81 MiB", "7.88 GiB": binary units, three significant digits at most.
std::string human_bytes(int64_t bytes);
// "49.1 B", "2.81 T", "371 M": decimal units (K, M, B, T), three significant digits at most.
std::string human_count(int64_t count);

}  // namespace deltaserve::engine
