#include "engine/model_inspect.hpp"

#include <cmath>
#include <cstdio>
#include <sstream>

namespace deltaserve::engine {
namespace {

constexpr int64_t kTokens128k = int64_t{128} << 10;
constexpr int64_t kTokens1M = int64_t{1} << 20;

// Up to three significant digits, trailing zeros dropped: 40, 414, 2.81, 7.88, 1008.
std::string three_digits(double value) {
  char buf[32];
  const int decimals = value >= 100.0 ? 0 : value >= 10.0 ? 1 : 2;
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, value);
  std::string s(buf);
  if (s.find('.') != std::string::npos) {
    while (s.back() == '0') s.pop_back();
    if (s.back() == '.') s.pop_back();
  }
  return s;
}

std::string exact_bytes(int64_t bytes) {
  return with_thousands(bytes) + " B (" + human_bytes(bytes) + ")";
}

int64_t kda_layer_parameters(const ModelConfig& c) {
  const KdaConfig& k = c.kda;
  const int64_t hidden = c.hidden_size, h = k.num_heads, d = k.head_dim, hd = h * d;
  const int64_t rank = k.gate_low_rank > 0 ? k.gate_low_rank : d;
  int64_t n = 3 * hd * hidden;                                             // q_proj, k_proj, v_proj
  n += 3 * hd * k.conv_kernel_size;                                        // q_conv1d, k_conv1d, v_conv1d [H·d, 1, K]
  n += h;                                                                  // A_log [1, 1, H, 1]
  n += hd;                                                                 // dt_bias
  n += rank * hidden + hd * rank;                                          // f_a_proj, f_b_proj
  n += h * hidden;                                                         // b_proj
  n += k.full_rank_output_gate ? hd * hidden : rank * hidden + hd * rank;  // g_proj | g_a_proj, g_b_proj
  n += d;                                                                  // o_norm
  n += hidden * hd;                                                        // o_proj
  return n;
}

int64_t mla_layer_parameters(const ModelConfig& c) {
  const MlaConfig& m = c.mla;
  const int64_t hidden = c.hidden_size, h = m.num_heads;
  int64_t n = 0;
  if (m.q_lora_rank) {
    n += *m.q_lora_rank * hidden + *m.q_lora_rank + h * m.qk_head_dim() * *m.q_lora_rank;  // q_a, q_a_norm, q_b
  } else {
    n += h * m.qk_head_dim() * hidden;  // q_proj
  }
  n += m.cache_width() * hidden;                                  // kv_a_proj_with_mqa
  n += m.kv_lora_rank;                                            // kv_a_layernorm
  n += h * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank;  // kv_b_proj
  if (m.use_output_gate) n += h * m.v_head_dim * hidden;          // g_proj
  n += hidden * h * m.v_head_dim;                                 // o_proj
  return n;
}

}  // namespace

std::string with_thousands(int64_t value) {
  std::string digits = std::to_string(value < 0 ? -value : value);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return value < 0 ? "-" + out : out;
}

std::string human_bytes(int64_t bytes) {
  constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 5) {
    value /= 1024.0;
    ++unit;
  }
  return three_digits(value) + " " + kUnits[unit];
}

std::string human_count(int64_t count) {
  constexpr const char* kUnits[] = {"", " K", " M", " B", " T"};
  double value = static_cast<double>(count);
  int unit = 0;
  while (value >= 1000.0 && unit < 4) {
    value /= 1000.0;
    ++unit;
  }
  return three_digits(value) + kUnits[unit];
}

ParameterCounts count_parameters(const ModelConfig& c) {
  ParameterCounts p;
  const int64_t hidden = c.hidden_size;
  const MoeConfig& moe = c.moe;
  const int64_t expert_width = moe.routed_expert_hidden_size.value_or(hidden);
  const int64_t expert_parameters = 3 * expert_width * moe.moe_intermediate_size;  // w1, w3 [I, W]; w2 [W, I]
  int64_t routed_active = 0;

  p.embedding = c.vocab_size * hidden;
  p.lm_head = c.tie_word_embeddings ? 0 : c.vocab_size * hidden;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const bool kda =
        l < static_cast<int64_t>(c.layer_kinds.size()) && c.layer_kinds[static_cast<size_t>(l)] == LayerKind::kKda;
    if (kda) {
      p.kda += kda_layer_parameters(c);
    } else {
      p.mla += mla_layer_parameters(c);
    }
    p.norms_and_attn_res += 2 * hidden;  // input_layernorm, post_attention_layernorm
    if (c.attn_res_block_size) p.norms_and_attn_res += 2 * (hidden + hidden);  // {self_attention,mlp}_res_{norm,proj}
    if (c.is_moe_layer(l)) {
      p.router += moe.num_experts * hidden + moe.num_experts;
      p.routed_experts += moe.num_experts * expert_parameters;
      routed_active += moe.num_experts_per_token * expert_parameters;
      p.shared_experts += 3 * hidden * moe.num_shared_experts * moe.moe_intermediate_size;
      if (moe.routed_expert_hidden_size) {
        p.latent_projections += 2 * expert_width * hidden + (moe.latent_moe_use_norm ? expert_width : 0);
      }
    } else {
      p.dense_ffn += 3 * hidden * c.intermediate_size;
    }
  }
  p.norms_and_attn_res += hidden;                                 // model.norm
  if (c.attn_res_block_size) p.norms_and_attn_res += 2 * hidden;  // output_attn_res_{norm,proj}

  p.total = p.embedding + p.lm_head + p.kda + p.mla + p.dense_ffn + p.routed_experts + p.shared_experts + p.router +
            p.latent_projections + p.norms_and_attn_res;
  p.active_per_token = p.total - p.embedding - p.routed_experts + routed_active;
  return p;
}

std::string describe_model(const ModelConfig& c) {
  std::ostringstream out;
  const ParameterCounts p = count_parameters(c);
  const int64_t kda_layers = c.num_layers_of(LayerKind::kKda), mla_layers = c.num_layers_of(LayerKind::kMla);

  out << (c.nested_text_config ? "Kimi K3 family" : "Kimi Linear family") << " (model_type " << c.model_type
      << (c.nested_text_config ? ", nested text_config" : "") << ", "
      << (c.architecture.empty() ? "no architecture" : c.architecture) << ")\n";

  out << "layers        " << c.num_layers << ": " << kda_layers << " KDA + " << mla_layers << " MLA\n";
  std::string kinds, ffn, mla_at;
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const bool mla =
        l < static_cast<int64_t>(c.layer_kinds.size()) && c.layer_kinds[static_cast<size_t>(l)] == LayerKind::kMla;
    kinds.push_back(mla ? 'M' : 'K');
    const bool moe = c.is_moe_layer(l);
    moe_layers += moe ? 1 : 0;
    ffn.push_back(moe ? 'E' : 'D');
    if (mla) mla_at += (mla_at.empty() ? "" : ", ") + std::to_string(l + 1);
  }
  out << "  attention   " << kinds << "  (K = KDA, M = MLA, layer 0 first)\n";
  out << "  MLA at      " << (mla_at.empty() ? "none" : mla_at) << " (1-based, as full_attn_layers)\n";
  out << "  FFN         " << ffn << "  (D = dense, E = MoE)\n";

  out << "dims          hidden " << c.hidden_size << ", vocab " << with_thousands(c.vocab_size) << ", context "
      << with_thousands(c.max_position_embeddings) << " tokens, rms_norm_eps " << c.rms_norm_eps << ", "
      << (c.tie_word_embeddings ? "tied" : "untied") << " embeddings\n";
  out << "KDA           " << c.kda.num_heads << " heads x " << c.kda.head_dim << ", conv kernel "
      << c.kda.conv_kernel_size << ", decay gate ";
  if (c.kda.gate_lower_bound) {
    out << "lower-bounded (lb " << *c.kda.gate_lower_bound << ")";
  } else {
    out << "softplus";
  }
  out << ", output gate "
      << (c.kda.full_rank_output_gate ? "full-rank g_proj"
                                      : "low-rank g_a/g_b (rank " + std::to_string(c.kda.gate_low_rank) + ")")
      << "\n";
  out << "MLA           " << c.mla.num_heads << " heads, "
      << (c.mla.q_lora_rank ? "q LoRA rank " + std::to_string(*c.mla.q_lora_rank) : std::string("plain q_proj"))
      << ", kv_lora " << c.mla.kv_lora_rank << ", qk " << c.mla.qk_nope_head_dim << " nope + " << c.mla.qk_rope_head_dim
      << " rope (NoPE: never rotated), v " << c.mla.v_head_dim << ", output gate "
      << (c.mla.use_output_gate ? "yes" : "no") << ", softmax scale " << c.mla.qk_head_dim() << "^-0.5\n";
  out << "FFN           " << (c.hidden_act == Activation::kSitu ? "SiTU-GLU" : "SwiGLU");
  if (c.hidden_act == Activation::kSitu)
    out << " (beta " << c.situ_beta << ", linear beta " << c.situ_linear_beta << ")";
  out << ", dense intermediate " << c.intermediate_size << " on " << (c.num_layers - moe_layers) << " layer(s)\n";
  if (c.moe.num_experts > 0) {
    out << "MoE           " << moe_layers << " layers: " << c.moe.num_experts << " experts, top-"
        << c.moe.num_experts_per_token << ", " << c.moe.num_shared_experts << " shared, intermediate "
        << c.moe.moe_intermediate_size << ", sigmoid router" << (c.moe.renormalize ? " renormalized" : "") << " x "
        << c.moe.routed_scaling_factor << ", groups " << c.moe.top_k_groups << "/" << c.moe.num_expert_groups << "\n";
    if (c.moe.routed_expert_hidden_size) {
      out << "  LatentMoE   routed width " << *c.moe.routed_expert_hidden_size << ", latent norm "
          << (c.moe.latent_moe_use_norm ? "yes" : "no") << "\n";
    }
  } else {
    out << "MoE           none (every FFN dense)\n";
  }
  if (c.attn_res_block_size) {
    const int64_t blocks = (c.num_layers + *c.attn_res_block_size - 1) / *c.attn_res_block_size;
    out << "AttnRes       block size " << *c.attn_res_block_size << " (output mixes " << blocks
        << " blocks + the prefix)\n";
  } else {
    out << "AttnRes       none\n";
  }

  auto line = [&](const char* name, int64_t n) {
    out << "  " << name << human_count(n) << " (" << with_thousands(n) << ")\n";
  };
  out << "parameters    " << human_count(p.total) << " total (" << with_thousands(p.total) << ")\n";
  line("embedding          ", p.embedding);
  line("lm_head            ", p.lm_head);
  line("KDA                ", p.kda);
  line("MLA                ", p.mla);
  line("dense FFN          ", p.dense_ffn);
  line("routed experts     ", p.routed_experts);
  line("shared experts     ", p.shared_experts);
  line("router             ", p.router);
  if (p.latent_projections > 0) line("latent projections ", p.latent_projections);
  line("norms + AttnRes    ", p.norms_and_attn_res);
  out << "active/token  " << human_count(p.active_per_token) << " (" << with_thousands(p.active_per_token)
      << "; embedding excluded)\n";

  out << "serving footprint\n";
  out << "  KDA state   " << exact_bytes(c.kda_state_bytes_per_request()) << " per request (fp32 S, " << kda_layers
      << " x " << c.kda.num_heads << " x " << c.kda.head_dim << " x " << c.kda.head_dim << " x 4 B)\n";
  out << "  conv tails  " << exact_bytes(c.kda_conv_state_bytes_per_request()) << " per request (fp32, " << kda_layers
      << " x 3 x " << c.kda.num_heads * c.kda.head_dim << " x " << (c.kda.conv_kernel_size - 1) << " x 4 B)\n";
  const int64_t per_token = c.mla_cache_bytes_per_token();
  out << "  MLA cache   " << with_thousands(per_token) << " B/token (bf16, " << mla_layers << " x "
      << c.mla.cache_width() << " x 2 B)\n";
  out << "    at 128k tokens  " << exact_bytes(per_token * kTokens128k) << "\n";
  out << "    at 1M tokens    " << exact_bytes(per_token * kTokens1M) << "\n";
  return out.str();
}

}  // namespace deltaserve::engine
