#include "engine/model_weights.hpp"

#include <functional>
#include <string>

namespace deltaserve::engine {
namespace {

// Calls bind(name, shape, destination, is_norm) for every tensor of the model in checkpoint order.
// One enumeration serves the loader (destination receives the data) and make-model (names + shapes).
using BindFn = std::function<void(const std::string&, std::vector<int64_t>, Tensor*, bool)>;

void bind_ffn(const std::string& prefix, const std::string& gate, const std::string& up, const std::string& down,
              int64_t width, int64_t intermediate, FfnWeights& ffn, const BindFn& bind) {
  ffn.width = width;
  ffn.intermediate = intermediate;
  bind(prefix + gate, {intermediate, width}, &ffn.gate, false);
  bind(prefix + up, {intermediate, width}, &ffn.up, false);
  bind(prefix + down, {width, intermediate}, &ffn.down, false);
}

void bind_kda(const ModelConfig& c, const std::string& p, KdaWeights& w, const BindFn& bind) {
  const int64_t h = c.kda.num_heads, d = c.kda.head_dim, hd = h * d, k = c.kda.conv_kernel_size;
  const int64_t hidden = c.hidden_size, rank = d;
  bind(p + "q_proj.weight", {hd, hidden}, &w.q_proj, false);
  bind(p + "k_proj.weight", {hd, hidden}, &w.k_proj, false);
  bind(p + "v_proj.weight", {hd, hidden}, &w.v_proj, false);
  bind(p + "q_conv1d.weight", {hd, 1, k}, &w.q_conv, false);
  bind(p + "k_conv1d.weight", {hd, 1, k}, &w.k_conv, false);
  bind(p + "v_conv1d.weight", {hd, 1, k}, &w.v_conv, false);
  bind(p + "A_log", {1, 1, h, 1}, &w.a_log, false);
  bind(p + "dt_bias", {hd}, &w.dt_bias, false);
  bind(p + "f_a_proj.weight", {rank, hidden}, &w.f_a, false);
  bind(p + "f_b_proj.weight", {hd, rank}, &w.f_b, false);
  bind(p + "b_proj.weight", {h, hidden}, &w.b_proj, false);
  if (c.kda.full_rank_output_gate) {
    bind(p + "g_proj.weight", {hd, hidden}, &w.g_proj, false);
  } else {
    bind(p + "g_a_proj.weight", {rank, hidden}, &w.g_a, false);
    bind(p + "g_b_proj.weight", {hd, rank}, &w.g_b, false);
  }
  bind(p + "o_norm.weight", {d}, &w.o_norm, true);
  bind(p + "o_proj.weight", {hidden, hd}, &w.o_proj, false);
}

void bind_mla(const ModelConfig& c, const std::string& p, MlaWeights& w, const BindFn& bind) {
  const MlaConfig& m = c.mla;
  const int64_t h = m.num_heads, hidden = c.hidden_size;
  if (m.q_lora_rank) {
    bind(p + "q_a_proj.weight", {*m.q_lora_rank, hidden}, &w.q_a_proj, false);
    bind(p + "q_a_layernorm.weight", {*m.q_lora_rank}, &w.q_a_norm, true);
    bind(p + "q_b_proj.weight", {h * m.qk_head_dim(), *m.q_lora_rank}, &w.q_b_proj, false);
  } else {
    bind(p + "q_proj.weight", {h * m.qk_head_dim(), hidden}, &w.q_proj, false);
  }
  bind(p + "kv_a_proj_with_mqa.weight", {m.cache_width(), hidden}, &w.kv_a_proj, false);
  bind(p + "kv_a_layernorm.weight", {m.kv_lora_rank}, &w.kv_a_norm, true);
  bind(p + "kv_b_proj.weight", {h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank}, &w.kv_b_proj, false);
  if (m.use_output_gate) bind(p + "g_proj.weight", {h * m.v_head_dim, hidden}, &w.g_proj, false);
  bind(p + "o_proj.weight", {hidden, h * m.v_head_dim}, &w.o_proj, false);
}

void bind_moe(const ModelConfig& c, const std::string& p, MoeWeights& w, const BindFn& bind) {
  const MoeConfig& m = c.moe;
  const int64_t hidden = c.hidden_size;
  bind(p + "gate.weight", {m.num_experts, hidden}, &w.router, false);
  bind(p + "gate.e_score_correction_bias", {m.num_experts}, &w.correction_bias, false);
  const int64_t width = m.routed_expert_hidden_size.value_or(hidden);
  if (m.routed_expert_hidden_size) {
    bind(p + "routed_expert_down_proj.weight", {width, hidden}, &w.latent_down, false);
    if (m.latent_moe_use_norm) bind(p + "routed_expert_norm.weight", {width}, &w.latent_norm, true);
    bind(p + "routed_expert_up_proj.weight", {hidden, width}, &w.latent_up, false);
  }
  w.experts.resize(static_cast<size_t>(m.num_experts));
  for (int64_t e = 0; e < m.num_experts; ++e) {
    bind_ffn(p + "experts." + std::to_string(e) + ".", "w1.weight", "w3.weight", "w2.weight", width,
             m.moe_intermediate_size, w.experts[static_cast<size_t>(e)], bind);
  }
  if (m.num_shared_experts > 0) {
    bind_ffn(p + "shared_experts.", "gate_proj.weight", "up_proj.weight", "down_proj.weight", hidden,
             m.num_shared_experts * m.moe_intermediate_size, w.shared, bind);
  }
}

void bind_attn_res(const std::string& p, const std::string& name, int64_t hidden, AttnResWeights& w,
                   const BindFn& bind) {
  bind(p + name + "_norm.weight", {hidden}, &w.norm, true);
  bind(p + name + "_proj.weight", {1, hidden}, &w.proj, false);
}

void bind_model(const ModelConfig& c, ModelWeights& w, const BindFn& bind) {
  const std::string prefix = c.tensor_prefix();
  const int64_t hidden = c.hidden_size;
  bind(prefix + "embed_tokens.weight", {c.vocab_size, hidden}, &w.embed_tokens, false);
  w.layers.resize(static_cast<size_t>(c.num_layers));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    LayerWeights& layer = w.layers[static_cast<size_t>(l)];
    const std::string p = prefix + "layers." + std::to_string(l) + ".";
    layer.kind = c.layer_kinds[static_cast<size_t>(l)];
    layer.is_moe = c.is_moe_layer(l);
    bind(p + "input_layernorm.weight", {hidden}, &layer.input_norm, true);
    if (layer.kind == LayerKind::kKda) {
      bind_kda(c, p + "self_attn.", layer.kda, bind);
    } else {
      bind_mla(c, p + "self_attn.", layer.mla, bind);
    }
    bind(p + "post_attention_layernorm.weight", {hidden}, &layer.post_attention_norm, true);
    if (layer.is_moe) {
      bind_moe(c, p + "block_sparse_moe.", layer.moe, bind);
    } else {
      bind_ffn(p + "mlp.", "gate_proj.weight", "up_proj.weight", "down_proj.weight", hidden, c.intermediate_size,
               layer.dense, bind);
    }
    if (c.attn_res_block_size) {
      bind_attn_res(p, "self_attention_res", hidden, layer.attention_res, bind);
      bind_attn_res(p, "mlp_res", hidden, layer.mlp_res, bind);
    }
  }
  bind(prefix + "norm.weight", {hidden}, &w.final_norm, true);
  if (c.attn_res_block_size) bind_attn_res(prefix, "output_attn_res", hidden, w.output_res, bind);
  if (!c.tie_word_embeddings) bind(c.lm_head_name(), {c.vocab_size, hidden}, &w.lm_head, false);
}

int64_t product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

}  // namespace

std::vector<TensorSpec> expected_tensors(const ModelConfig& config) {
  std::vector<TensorSpec> specs;
  ModelWeights scratch;
  bind_model(config, scratch, [&](const std::string& name, std::vector<int64_t> shape, Tensor*, bool is_norm) {
    specs.push_back({name, std::move(shape), is_norm});
  });
  return specs;
}

Result<ModelWeights> load_model_weights(const Checkpoint& checkpoint, const ModelConfig& config) {
  ModelWeights weights;
  Status status;
  bind_model(config, weights,
             [&](const std::string& name, std::vector<int64_t> shape, Tensor* destination, bool /*is_norm*/) {
               if (!status.is_ok()) return;
               const TensorView* view = checkpoint.find(name);
               if (view == nullptr) {
                 // MXFP4-packed experts (K3) ship `weight_packed` + `weight_scale` instead of `weight`.
                 const std::string stem = name.substr(0, name.size() - std::string("weight").size());
                 if (name.ends_with(".weight") && checkpoint.find(stem + "weight_packed") != nullptr) {
                   status = unimplemented("tensor '" + stem +
                                          "weight_packed': MXFP4-packed weights are not supported yet; "
                                          "convert the checkpoint to bf16 or fp8 block-quantised weights");
                   return;
                 }
                 // Variants of the same data: A_log may be [H]; the bias may be absent (zeros).
                 if (name.ends_with("e_score_correction_bias")) {
                   destination->assign(static_cast<size_t>(product(shape)), 0.0f);
                   return;
                 }
               }
               if (view != nullptr && name.ends_with("A_log") && view->shape.size() == 1) {
                 shape = {shape[2]};
               }
               auto data = checkpoint.read_f32(name, shape);
               if (!data.is_ok()) {
                 status = data.status();
                 return;
               }
               *destination = std::move(data).value();
             });
  DS_RETURN_IF_ERROR(status);
  if (config.tie_word_embeddings) weights.lm_head = weights.embed_tokens;

  // Vision tower / projector tensors of multimodal (K3) checkpoints are not used for text serving,
  // and neither are multi-token-prediction layers.
  const std::vector<std::string> ignored = {"vision_tower.", "multi_modal_projector.", "mm_projector.",
                                            "language_model.model.mtp", "model.mtp"};
  std::vector<std::string> unused = checkpoint.unused_tensors(ignored);
  if (!unused.empty()) {
    std::string list;
    for (size_t i = 0; i < unused.size() && i < 5; ++i) list += (i ? ", '" : "'") + unused[i] + "'";
    if (unused.size() > 5) list += ", ... (" + std::to_string(unused.size()) + " in all)";
    return invalid_argument("checkpoint holds tensors the config does not describe (wrong expert or layer count?): " +
                            list);
  }
  return weights;
}

}  // namespace deltaserve::engine
