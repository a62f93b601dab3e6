#include "engine/model_config.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <span>
#include <sstream>
#include <system_error>

namespace deltaserve::engine {
namespace {

constexpr std::string_view kTextModelType = "kimi_linear";  // the text config of both families
constexpr std::string_view kNestedModelType = "kimi_k3";    // K3's outer (multimodal) config
constexpr double kMinGateLowerBound = -5.0;  // 16 tokens × |lb| ≤ 80 keeps the chunk kernel's exp() in range

// Upper bounds that keep every byte count below in int64 and every token id in int32.
constexpr int64_t kMaxDim = int64_t{1} << 24;
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxExperts = int64_t{1} << 16;
constexpr int64_t kMaxTokenId = std::numeric_limits<int32_t>::max();

// ---- the keys of each object: read, or known to be irrelevant for serving ----------------------------------

// The text config: the whole document for Kimi Linear, `text_config` for K3.
constexpr std::string_view kTextKeys[] = {
    "model_type", "architectures", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size",
    "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "model_max_length", "hidden_act",
    "activation_situ_beta", "activation_situ_linear_beta",
    // MLA
    "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "mla_use_nope", "mla_use_output_gate",
    // KDA + layer kinds
    "linear_attn_config",
    // MoE
    "num_experts", "num_experts_per_token", "num_shared_experts", "moe_intermediate_size", "first_k_dense_replace",
    "moe_layer_freq", "routed_scaling_factor", "moe_renormalize", "moe_router_activation_func", "use_grouped_topk",
    "num_expert_group", "topk_group", "topk_method", "routed_expert_hidden_size", "latent_moe_use_norm",
    // Block Attention Residuals, special tokens
    "attn_res_block_size", "bos_token_id", "eos_token_id", "pad_token_id"};

constexpr std::string_view kIgnoredTextKeys[] = {
    // Loader / packaging metadata.
    "auto_map", "dtype", "torch_dtype", "transformers_version", "_name_or_path", "_commit_hash", "use_cache",
    // Training only.
    "initializer_range", "attention_dropout", "router_aux_loss_coef", "aux_loss_alpha", "output_router_logits",
    // MLA runs NoPE (mla_use_nope must be true), so the RoPE settings change nothing.
    "rope_theta", "rope_scaling", "rope_parameters",
    // HF's generic per-head size (hidden / heads); MLA and KDA carry their own head dims.
    "head_dim",
    // Multi-token-prediction layers are not served; their tensors are skipped by the loader.
    "num_nextn_predict_layers",
    // Quantisation is read from the checkpoint's tensors (packed MXFP4 experts are rejected there).
    "quantization_config", "quantization",
    // sglang's KDA-state dtype knob; deltaserve keeps S in fp32.
    "mamba_ssm_dtype"};

constexpr std::string_view kLinearAttnKeys[] = {"kda_layers",        "full_attn_layers",       "num_heads",
                                                "head_dim",          "short_conv_kernel_size", "gate_lower_bound",
                                                "use_full_rank_gate"};
constexpr std::string_view kIgnoredLinearAttnKeys[] = {"dtype"};

// K3's outer config; its text lives in `text_config`, the vision tower is not served.
constexpr std::string_view kNestedTopKeys[] = {"model_type",   "architectures", "text_config",        "bos_token_id",
                                               "eos_token_id", "pad_token_id",  "tie_word_embeddings"};
constexpr std::string_view kIgnoredNestedTopKeys[] = {"vision_config",
                                                      "media_placeholder_token_id",
                                                      "auto_map",
                                                      "dtype",
                                                      "torch_dtype",
                                                      "transformers_version",
                                                      "use_cache",
                                                      "initializer_range",
                                                      "quantization_config",
                                                      "_name_or_path",
                                                      "_commit_hash",
                                                      "ignore_index"};

const char* kind_name(const json::Value& v) {
  switch (v.kind()) {
    case json::Value::Kind::kNull:
      return "null";
    case json::Value::Kind::kBool:
      return "a boolean";
    case json::Value::Kind::kInt:
      return "an integer";
    case json::Value::Kind::kDouble:
      return "a number with a fraction or exponent";
    case json::Value::Kind::kString:
      return "a string";
    case json::Value::Kind::kArray:
      return "an array";
    case json::Value::Kind::kObject:
      return "an object";
  }
  return "?";
}

bool contains(std::span<const std::string_view> list, std::string_view key) {
  return std::find(list.begin(), list.end(), key) != list.end();
}

// Typed, path-aware access to one JSON object of config.json. Every error names the full field path.
// A JSON null reads as "absent" (HF semantics: None = use the default), except where a getter says otherwise.
class ObjectReader {
 public:
  ObjectReader(const json::Value& object, std::string path, std::span<const std::string_view> known,
               std::span<const std::string_view> ignored)
      : object_(object), path_(std::move(path)), known_(known), ignored_(ignored) {}

  std::string path(std::string_view key) const {
    return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
  }
  Status fail(std::string_view key, const std::string& what) const { return invalid_argument(path(key) + ": " + what); }

  // Every key must be read or known to be irrelevant; checked first, so a misspelt key is reported as such
  // rather than as the required field it was meant to be.
  Status check_keys() const {
    if (!object_.is_object()) {
      return invalid_argument((path_.empty() ? std::string("config.json") : path_) + ": expected an object, got " +
                              kind_name(object_));
    }
    for (const auto& [key, value] : object_.as_object()) {
      if (!contains(known_, key) && !contains(ignored_, key)) {
        return fail(key, "unknown key (neither read by deltaserve nor on its list of keys known to be irrelevant)");
      }
    }
    return Status::ok();
  }

  // nullptr when absent or null. `key` must be on the known list (a programming error otherwise).
  const json::Value* find(std::string_view key) const {
    const json::Value* v = object_.find(key);
    return v == nullptr || v->is_null() ? nullptr : v;
  }
  const json::Value* find_raw(std::string_view key) const { return object_.find(key); }

  Status int_in(std::string_view key, const json::Value& v, int64_t min, int64_t max, int64_t& out) const {
    if (!v.is_int()) return fail(key, std::string("expected an integer, got ") + kind_name(v));
    const int64_t x = v.as_int();
    if (x < min || x > max) {
      return fail(key,
                  std::to_string(x) + " is out of range [" + std::to_string(min) + ", " + std::to_string(max) + "]");
    }
    out = x;
    return Status::ok();
  }
  Status required_int(std::string_view key, int64_t min, int64_t max, int64_t& out) const {
    const json::Value* v = find(key);
    if (v == nullptr) return fail(key, "missing required field");
    return int_in(key, *v, min, max, out);
  }
  Result<std::optional<int64_t>> optional_int(std::string_view key, int64_t min, int64_t max) const {
    const json::Value* v = find(key);
    if (v == nullptr) return std::optional<int64_t>();
    int64_t x = 0;
    DS_RETURN_IF_ERROR(int_in(key, *v, min, max, x));
    return std::optional<int64_t>(x);
  }

  Status number_in(std::string_view key, const json::Value& v, double min, double max, double& out) const {
    if (!v.is_number()) return fail(key, std::string("expected a number, got ") + kind_name(v));
    const double x = v.as_double();
    if (!(x >= min && x <= max)) {
      std::ostringstream s;
      s << x << " is out of range [" << min << ", " << max << "]";
      return fail(key, s.str());
    }
    out = x;
    return Status::ok();
  }
  Result<std::optional<double>> optional_number(std::string_view key, double min, double max) const {
    const json::Value* v = find(key);
    if (v == nullptr) return std::optional<double>();
    double x = 0.0;
    DS_RETURN_IF_ERROR(number_in(key, *v, min, max, x));
    return std::optional<double>(x);
  }

  Result<std::optional<bool>> optional_bool(std::string_view key) const {
    const json::Value* v = find(key);
    if (v == nullptr) return std::optional<bool>();
    if (!v->is_bool()) return fail(key, std::string("expected true or false, got ") + kind_name(*v));
    return std::optional<bool>(v->as_bool());
  }

  Result<std::optional<std::string>> optional_string(std::string_view key) const {
    const json::Value* v = find(key);
    if (v == nullptr) return std::optional<std::string>();
    if (!v->is_string()) return fail(key, std::string("expected a string, got ") + kind_name(*v));
    return std::optional<std::string>(v->as_string());
  }
  Result<std::string> required_string(std::string_view key) const {
    DS_ASSIGN_OR_RETURN(std::optional<std::string> s, optional_string(key));
    if (!s) return fail(key, "missing required field");
    return *s;
  }

  // A token id: an integer, or (eos in some configs) a non-empty array of integers whose first is taken.
  Result<std::optional<int64_t>> optional_token_id(std::string_view key) const {
    const json::Value* v = find(key);
    if (v == nullptr) return std::optional<int64_t>();
    const json::Value* id = v;
    std::string where(key);
    if (v->is_array()) {
      if (v->as_array().empty()) return fail(key, "expected a token id or a non-empty array of token ids");
      id = &v->as_array()[0];
      where += "[0]";
    }
    int64_t x = 0;
    DS_RETURN_IF_ERROR(int_in(where, *id, 0, kMaxTokenId, x));
    return std::optional<int64_t>(x);
  }

 private:
  const json::Value& object_;
  std::string path_;
  std::span<const std::string_view> known_;
  std::span<const std::string_view> ignored_;
};

// Reads `kda_layers` and `full_attn_layers` (1-based) into c.layer_kinds (0-based).
Status parse_layer_lists(const ObjectReader& r, ModelConfig& c) {
  std::vector<int> owner(static_cast<size_t>(c.num_layers), -1);  // -1, or the list (0 KDA, 1 MLA) naming it
  constexpr std::string_view kLists[] = {"kda_layers", "full_attn_layers"};
  for (int list = 0; list < 2; ++list) {
    const std::string_view key = kLists[list];
    const json::Value* v = r.find_raw(key);
    if (v == nullptr) return r.fail(key, "missing required field");
    if (!v->is_array())
      return r.fail(key, std::string("expected an array of 1-based layer indices, got ") + kind_name(*v));
    const json::Array& items = v->as_array();
    for (size_t i = 0; i < items.size(); ++i) {
      const std::string item = std::string(key) + "[" + std::to_string(i) + "]";
      int64_t layer = 0;
      DS_RETURN_IF_ERROR(r.int_in(item, items[i], 1, c.num_layers, layer));
      int& slot = owner[static_cast<size_t>(layer - 1)];
      if (slot == list) return r.fail(item, "duplicate layer " + std::to_string(layer));
      if (slot >= 0) {
        return r.fail(item, "layer " + std::to_string(layer) + " is also listed in " + std::string(kLists[slot]));
      }
      slot = list;
    }
  }
  c.layer_kinds.resize(static_cast<size_t>(c.num_layers));
  for (size_t l = 0; l < owner.size(); ++l) {
    if (owner[l] < 0) {
      return r.fail("kda_layers",
                    "layer " + std::to_string(l + 1) + " (1-based) is in neither kda_layers nor full_attn_layers");
    }
    c.layer_kinds[l] = owner[l] == 0 ? LayerKind::kKda : LayerKind::kMla;
  }
  return Status::ok();
}

Status parse_linear_attn_config(const ObjectReader& text, ModelConfig& c) {
  const json::Value* v = text.find_raw("linear_attn_config");
  if (v == nullptr) return text.fail("linear_attn_config", "missing required field");
  ObjectReader r(*v, text.path("linear_attn_config"), kLinearAttnKeys, kIgnoredLinearAttnKeys);
  DS_RETURN_IF_ERROR(r.check_keys());
  DS_RETURN_IF_ERROR(r.required_int("num_heads", 1, kMaxDim, c.kda.num_heads));
  DS_RETURN_IF_ERROR(r.required_int("head_dim", 1, 1024, c.kda.head_dim));
  DS_RETURN_IF_ERROR(r.required_int("short_conv_kernel_size", 1, 64, c.kda.conv_kernel_size));
  c.kda.gate_low_rank = c.kda.head_dim;  // HF: f_a_proj / g_a_proj map hidden → head_dim
  DS_ASSIGN_OR_RETURN(
      std::optional<double> lower_bound,
      r.optional_number("gate_lower_bound", -std::numeric_limits<double>::max(), std::numeric_limits<double>::max()));
  if (lower_bound) {
    if (*lower_bound >= 0.0) {
      return r.fail("gate_lower_bound", "must be negative (the log-decay lb·sigmoid(·) must be ≤ 0)");
    }
    if (*lower_bound < kMinGateLowerBound) {
      return unimplemented(r.path("gate_lower_bound") + ": values below -5 are not supported (the chunked KDA " +
                           "kernel needs 16·|lb| ≤ 80 to keep exp(cumulative decay) in fp32 range)");
    }
    c.kda.gate_lower_bound = static_cast<float>(*lower_bound);
  }
  DS_ASSIGN_OR_RETURN(std::optional<bool> full_rank, r.optional_bool("use_full_rank_gate"));
  c.kda.full_rank_output_gate = full_rank.value_or(false);
  return parse_layer_lists(r, c);
}

Status parse_mla(const ObjectReader& r, ModelConfig& c) {
  MlaConfig& m = c.mla;
  DS_RETURN_IF_ERROR(r.required_int("num_attention_heads", 1, kMaxDim, m.num_heads));
  DS_ASSIGN_OR_RETURN(std::optional<int64_t> kv_heads, r.optional_int("num_key_value_heads", 1, kMaxDim));
  if (kv_heads && *kv_heads != m.num_heads) {
    return r.fail("num_key_value_heads", std::to_string(*kv_heads) + " differs from num_attention_heads " +
                                             std::to_string(m.num_heads) + " (MLA has no grouped KV heads)");
  }
  if (const json::Value* q = r.find("q_lora_rank")) {  // null or absent: plain q_proj
    int64_t rank = 0;
    if (q->is_int() && q->as_int() == 0) {
      return r.fail("q_lora_rank", "0 is not a rank: use null for a plain q_proj");
    }
    DS_RETURN_IF_ERROR(r.int_in("q_lora_rank", *q, 1, kMaxDim, rank));
    m.q_lora_rank = rank;
  }
  DS_RETURN_IF_ERROR(r.required_int("kv_lora_rank", 1, kMaxDim, m.kv_lora_rank));
  DS_RETURN_IF_ERROR(r.required_int("qk_nope_head_dim", 1, 4096, m.qk_nope_head_dim));
  DS_RETURN_IF_ERROR(r.required_int("qk_rope_head_dim", 0, 4096, m.qk_rope_head_dim));
  DS_RETURN_IF_ERROR(r.required_int("v_head_dim", 1, 4096, m.v_head_dim));
  DS_ASSIGN_OR_RETURN(std::optional<bool> use_nope, r.optional_bool("mla_use_nope"));
  if (!use_nope) return r.fail("mla_use_nope", "missing required field (only NoPE MLA, true, is supported)");
  if (!*use_nope) {
    return unimplemented(r.path("mla_use_nope") +
                         ": false (RoPE on the MLA layers) is not supported; only NoPE MLA is implemented");
  }
  m.use_nope = true;
  DS_ASSIGN_OR_RETURN(std::optional<bool> gate, r.optional_bool("mla_use_output_gate"));
  m.use_output_gate = gate.value_or(false);
  return Status::ok();
}

Status parse_moe(const ObjectReader& r, ModelConfig& c) {
  MoeConfig& m = c.moe;
  DS_ASSIGN_OR_RETURN(std::optional<int64_t> experts, r.optional_int("num_experts", 0, kMaxExperts));
  m.num_experts = experts.value_or(0);
  if (m.num_experts == 0) return Status::ok();  // every FFN dense; the other MoE keys are not used

  DS_RETURN_IF_ERROR(r.required_int("num_experts_per_token", 1, kMaxExperts, m.num_experts_per_token));
  if (m.num_experts_per_token > m.num_experts) {
    return r.fail("num_experts_per_token",
                  std::to_string(m.num_experts_per_token) + " exceeds num_experts " + std::to_string(m.num_experts));
  }
  DS_RETURN_IF_ERROR(r.required_int("moe_intermediate_size", 1, kMaxDim, m.moe_intermediate_size));
  DS_ASSIGN_OR_RETURN(std::optional<int64_t> shared, r.optional_int("num_shared_experts", 0, 64));
  m.num_shared_experts = shared.value_or(0);
  DS_ASSIGN_OR_RETURN(std::optional<int64_t> first_dense, r.optional_int("first_k_dense_replace", 0, c.num_layers));
  m.first_k_dense_replace = first_dense.value_or(0);
  DS_ASSIGN_OR_RETURN(std::optional<int64_t> freq, r.optional_int("moe_layer_freq", 1, kMaxLayers));
  m.layer_freq = freq.value_or(1);
  DS_ASSIGN_OR_RETURN(std::optional<double> scale, r.optional_number("routed_scaling_factor", 1e-6, 1e6));
  m.routed_scaling_factor = static_cast<float>(scale.value_or(1.0));
  DS_ASSIGN_OR_RETURN(std::optional<bool> renormalize, r.optional_bool("moe_renormalize"));
  m.renormalize = renormalize.value_or(true);

  DS_ASSIGN_OR_RETURN(std::optional<std::string> activation, r.optional_string("moe_router_activation_func"));
  if (activation && *activation != "sigmoid") {
    if (*activation == "softmax") {
      return unimplemented(r.path("moe_router_activation_func") + ": softmax routing is not supported (sigmoid only)");
    }
    return r.fail("moe_router_activation_func", "unknown router activation '" + *activation + "' (expected sigmoid)");
  }
  DS_ASSIGN_OR_RETURN(std::optional<std::string> method, r.optional_string("topk_method"));
  if (method && *method != "noaux_tc") {
    return unimplemented(r.path("topk_method") + ": '" + *method +
                         "' is not supported (noaux_tc: top-k of sigmoid + e_score_correction_bias)");
  }

  DS_ASSIGN_OR_RETURN(std::optional<bool> grouped, r.optional_bool("use_grouped_topk"));
  DS_ASSIGN_OR_RETURN(std::optional<int64_t> groups, r.optional_int("num_expert_group", 1, kMaxExperts));
  DS_ASSIGN_OR_RETURN(std::optional<int64_t> top_groups, r.optional_int("topk_group", 1, kMaxExperts));
  m.num_expert_groups = groups.value_or(1);
  m.top_k_groups = top_groups.value_or(1);
  if (m.num_experts % m.num_expert_groups != 0) {
    return r.fail("num_expert_group", std::to_string(m.num_expert_groups) + " does not divide num_experts " +
                                          std::to_string(m.num_experts));
  }
  if (m.top_k_groups > m.num_expert_groups) {
    return r.fail("topk_group",
                  std::to_string(m.top_k_groups) + " exceeds num_expert_group " + std::to_string(m.num_expert_groups));
  }
  if (!grouped.value_or(true)) m.num_expert_groups = m.top_k_groups = 1;
  if (m.num_experts_per_token > m.top_k_groups * (m.num_experts / m.num_expert_groups)) {
    return r.fail("num_experts_per_token",
                  std::to_string(m.num_experts_per_token) + " exceeds the experts in topk_group groups (" +
                      std::to_string(m.top_k_groups * (m.num_experts / m.num_expert_groups)) + ")");
  }

  DS_ASSIGN_OR_RETURN(m.routed_expert_hidden_size, r.optional_int("routed_expert_hidden_size", 1, kMaxDim));
  DS_ASSIGN_OR_RETURN(std::optional<bool> latent_norm, r.optional_bool("latent_moe_use_norm"));
  m.latent_moe_use_norm = latent_norm.value_or(false);
  if (m.latent_moe_use_norm && !m.routed_expert_hidden_size) {
    return r.fail("latent_moe_use_norm", "true requires routed_expert_hidden_size (the latent it normalises)");
  }
  return Status::ok();
}

Status parse_text_config(const ObjectReader& r, ModelConfig& c) {
  DS_RETURN_IF_ERROR(r.check_keys());
  DS_ASSIGN_OR_RETURN(c.model_type, r.required_string("model_type"));
  if (c.model_type != kTextModelType) {
    return r.fail("model_type",
                  "unsupported model type '" + c.model_type + "' (expected '" + std::string(kTextModelType) + "')");
  }
  if (const json::Value* archs = r.find("architectures")) {
    if (!archs->is_array() || archs->as_array().empty() || !archs->as_array()[0].is_string()) {
      return r.fail("architectures", "expected a non-empty array of strings");
    }
    c.architecture = archs->as_array()[0].as_string();
  }
  DS_RETURN_IF_ERROR(r.required_int("hidden_size", 1, kMaxDim, c.hidden_size));
  DS_RETURN_IF_ERROR(r.required_int("num_hidden_layers", 1, kMaxLayers, c.num_layers));
  DS_RETURN_IF_ERROR(r.required_int("vocab_size", 1, kMaxTokenId, c.vocab_size));
  DS_RETURN_IF_ERROR(r.required_int("intermediate_size", 1, kMaxDim, c.intermediate_size));
  double eps = 0.0;
  if (r.find("rms_norm_eps") == nullptr) return r.fail("rms_norm_eps", "missing required field");
  DS_RETURN_IF_ERROR(r.number_in("rms_norm_eps", *r.find("rms_norm_eps"), 1e-12, 1.0, eps));
  c.rms_norm_eps = static_cast<float>(eps);
  DS_ASSIGN_OR_RETURN(std::optional<bool> tie, r.optional_bool("tie_word_embeddings"));
  c.tie_word_embeddings = tie.value_or(false);

  // Context limit: K3 says max_position_embeddings, Kimi Linear model_max_length; both must agree.
  DS_ASSIGN_OR_RETURN(std::optional<int64_t> max_positions,
                      r.optional_int("max_position_embeddings", 1, int64_t{1} << 40));
  DS_ASSIGN_OR_RETURN(std::optional<int64_t> max_length, r.optional_int("model_max_length", 1, int64_t{1} << 40));
  if (!max_positions && !max_length) {
    return r.fail("max_position_embeddings", "missing required field (or model_max_length)");
  }
  if (max_positions && max_length && *max_positions != *max_length) {
    return r.fail("model_max_length", std::to_string(*max_length) + " differs from max_position_embeddings " +
                                          std::to_string(*max_positions));
  }
  c.max_position_embeddings = max_positions ? *max_positions : *max_length;

  DS_ASSIGN_OR_RETURN(std::string act, r.required_string("hidden_act"));
  if (act == "silu") {
    c.hidden_act = Activation::kSilu;
  } else if (act == "situ") {
    c.hidden_act = Activation::kSitu;
  } else {
    return r.fail("hidden_act", "unsupported activation '" + act + "' (expected silu or situ)");
  }
  DS_ASSIGN_OR_RETURN(std::optional<double> beta, r.optional_number("activation_situ_beta", 1e-6, 1e6));
  DS_ASSIGN_OR_RETURN(std::optional<double> linear_beta, r.optional_number("activation_situ_linear_beta", 1e-6, 1e6));
  if (c.hidden_act == Activation::kSitu) {  // (3P) values: read, never assumed
    if (!beta) return r.fail("activation_situ_beta", "missing required field (hidden_act is situ)");
    if (!linear_beta) return r.fail("activation_situ_linear_beta", "missing required field (hidden_act is situ)");
    c.situ_beta = static_cast<float>(*beta);
    c.situ_linear_beta = static_cast<float>(*linear_beta);
  }

  DS_RETURN_IF_ERROR(parse_mla(r, c));
  DS_RETURN_IF_ERROR(parse_linear_attn_config(r, c));
  DS_RETURN_IF_ERROR(parse_moe(r, c));
  DS_ASSIGN_OR_RETURN(c.attn_res_block_size, r.optional_int("attn_res_block_size", 1, kMaxLayers));
  return Status::ok();
}

// Special tokens: from the text config, overridden by K3's outer config (they must agree where both say).
Status parse_token_ids(const ObjectReader& text, const ObjectReader* top, ModelConfig& c) {
  constexpr std::string_view kKeys[] = {"bos_token_id", "eos_token_id", "pad_token_id"};
  int32_t* slots[] = {&c.bos_token_id, &c.eos_token_id, &c.pad_token_id};
  for (int i = 0; i < 3; ++i) {
    DS_ASSIGN_OR_RETURN(std::optional<int64_t> id, text.optional_token_id(kKeys[i]));
    const ObjectReader* where = &text;
    if (top != nullptr) {
      DS_ASSIGN_OR_RETURN(std::optional<int64_t> outer, top->optional_token_id(kKeys[i]));
      if (outer && id && *outer != *id) {
        return top->fail(kKeys[i],
                         std::to_string(*outer) + " differs from " + text.path(kKeys[i]) + " " + std::to_string(*id));
      }
      if (outer) {
        id = outer;
        where = top;
      }
    }
    if (!id) continue;
    if (*id >= c.vocab_size) {
      return where->fail(kKeys[i], std::to_string(*id) + " is not below vocab_size " + std::to_string(c.vocab_size));
    }
    *slots[i] = static_cast<int32_t>(*id);
  }
  return Status::ok();
}

// A float as JSON: its shortest decimal form (2.446f → 2.446, not 2.4460000991821289).
json::Value float_value(float f) {
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), f);
  double d = static_cast<double>(f);
  if (ec == std::errc()) std::from_chars(buf, end, d);
  return json::Value(d);
}

json::Value layer_list(const ModelConfig& c, LayerKind kind) {
  json::Value list = json::Value::array();
  for (size_t l = 0; l < c.layer_kinds.size(); ++l)
    if (c.layer_kinds[l] == kind) list.push_back(static_cast<int64_t>(l + 1));
  return list;
}

}  // namespace

float MlaConfig::softmax_scale() const {
  return 1.0f / std::sqrt(static_cast<float>(qk_head_dim()));
}

bool ModelConfig::is_moe_layer(int64_t layer) const {
  return moe.num_experts > 0 && layer >= moe.first_k_dense_replace && moe.layer_freq > 0 && layer % moe.layer_freq == 0;
}

int64_t ModelConfig::num_layers_of(LayerKind kind) const {
  return static_cast<int64_t>(std::count(layer_kinds.begin(), layer_kinds.end(), kind));
}

int64_t ModelConfig::kda_state_bytes_per_request() const {
  return num_layers_of(LayerKind::kKda) * kda.num_heads * kda.head_dim * kda.head_dim * 4;
}

int64_t ModelConfig::kda_conv_state_bytes_per_request() const {
  return num_layers_of(LayerKind::kKda) * 3 * kda.num_heads * kda.head_dim * (kda.conv_kernel_size - 1) * 4;
}

int64_t ModelConfig::mla_cache_bytes_per_token() const {
  return num_layers_of(LayerKind::kMla) * mla.cache_width() * 2;
}

Result<ModelConfig> parse_model_config(const json::Value& document) {
  if (!document.is_object()) return invalid_argument("config.json: expected a JSON object at the top level");
  ModelConfig c;
  const json::Value* text_config = document.find("text_config");
  if (text_config == nullptr) {
    ObjectReader text(document, "", kTextKeys, kIgnoredTextKeys);
    DS_RETURN_IF_ERROR(parse_text_config(text, c));
    DS_RETURN_IF_ERROR(parse_token_ids(text, nullptr, c));
    return c;
  }

  ObjectReader top(document, "", kNestedTopKeys, kIgnoredNestedTopKeys);
  DS_RETURN_IF_ERROR(top.check_keys());
  DS_ASSIGN_OR_RETURN(std::string outer_type, top.required_string("model_type"));
  if (outer_type != kNestedModelType) {
    return top.fail("model_type", "unsupported model type '" + outer_type + "' for a config with text_config " +
                                      "(expected '" + std::string(kNestedModelType) + "')");
  }
  if (!text_config->is_object()) {
    return top.fail("text_config", std::string("expected an object, got ") + kind_name(*text_config));
  }
  ObjectReader text(*text_config, "text_config", kTextKeys, kIgnoredTextKeys);
  DS_RETURN_IF_ERROR(parse_text_config(text, c));
  c.nested_text_config = true;
  if (const json::Value* archs = top.find("architectures")) {  // the outer architecture names the checkpoint
    if (!archs->is_array() || archs->as_array().empty() || !archs->as_array()[0].is_string()) {
      return top.fail("architectures", "expected a non-empty array of strings");
    }
    c.architecture = archs->as_array()[0].as_string();
  }
  DS_ASSIGN_OR_RETURN(std::optional<bool> tie, top.optional_bool("tie_word_embeddings"));
  if (tie && text.find("tie_word_embeddings") != nullptr && *tie != c.tie_word_embeddings) {
    return top.fail("tie_word_embeddings", "differs from text_config.tie_word_embeddings");
  }
  if (tie) c.tie_word_embeddings = *tie;
  DS_RETURN_IF_ERROR(parse_token_ids(text, &top, c));
  return c;
}

Result<ModelConfig> parse_model_config_text(std::string_view text) {
  DS_ASSIGN_OR_RETURN(json::Value document, json::parse(text));
  return parse_model_config(document);
}

Result<ModelConfig> load_model_config(const std::filesystem::path& path) {
  std::error_code ec;
  const std::filesystem::path file = std::filesystem::is_directory(path, ec) ? path / "config.json" : path;
  std::ifstream in(file, std::ios::binary);
  if (!in) return not_found(file.string() + ": cannot open");
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) return io_error(file.string() + ": read failed");
  auto config = parse_model_config_text(contents.str());
  if (!config.is_ok()) return config.status().with_context(file.string());
  return config;
}

json::Value model_config_to_json(const ModelConfig& c) {
  // Keys in the order HF writes them (sorted), so a written file diffs cleanly against a published one.
  json::Value t = json::Value::object();
  if (!c.nested_text_config && !c.architecture.empty()) {
    json::Value archs = json::Value::array();
    archs.push_back(c.architecture);
    t["architectures"] = std::move(archs);
  }
  if (c.hidden_act == Activation::kSitu) {
    t["activation_situ_beta"] = float_value(c.situ_beta);
    t["activation_situ_linear_beta"] = float_value(c.situ_linear_beta);
  }
  if (c.attn_res_block_size) t["attn_res_block_size"] = *c.attn_res_block_size;
  if (c.bos_token_id >= 0) t["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_id >= 0) t["eos_token_id"] = c.eos_token_id;
  t["first_k_dense_replace"] = c.moe.first_k_dense_replace;
  t["hidden_act"] = c.hidden_act == Activation::kSitu ? "situ" : "silu";
  t["hidden_size"] = c.hidden_size;
  t["intermediate_size"] = c.intermediate_size;
  t["kv_lora_rank"] = c.mla.kv_lora_rank;
  if (c.moe.routed_expert_hidden_size) t["latent_moe_use_norm"] = c.moe.latent_moe_use_norm;

  json::Value linear = json::Value::object();
  linear["full_attn_layers"] = layer_list(c, LayerKind::kMla);
  if (c.kda.gate_lower_bound) linear["gate_lower_bound"] = float_value(*c.kda.gate_lower_bound);
  linear["head_dim"] = c.kda.head_dim;
  linear["kda_layers"] = layer_list(c, LayerKind::kKda);
  linear["num_heads"] = c.kda.num_heads;
  linear["short_conv_kernel_size"] = c.kda.conv_kernel_size;
  if (c.kda.full_rank_output_gate) linear["use_full_rank_gate"] = true;
  t["linear_attn_config"] = std::move(linear);

  if (c.nested_text_config) {
    t["max_position_embeddings"] = c.max_position_embeddings;
  }
  t["mla_use_nope"] = c.mla.use_nope;
  if (c.mla.use_output_gate) t["mla_use_output_gate"] = true;
  if (!c.nested_text_config) t["model_max_length"] = c.max_position_embeddings;
  t["model_type"] = c.model_type.empty() ? std::string(kTextModelType) : c.model_type;
  t["moe_intermediate_size"] = c.moe.moe_intermediate_size;
  t["moe_layer_freq"] = c.moe.layer_freq;
  t["moe_renormalize"] = c.moe.renormalize;
  t["moe_router_activation_func"] = "sigmoid";
  t["num_attention_heads"] = c.mla.num_heads;
  t["num_expert_group"] = c.moe.num_expert_groups;
  t["num_experts"] = c.moe.num_experts > 0 ? json::Value(c.moe.num_experts) : json::Value(nullptr);
  t["num_experts_per_token"] = c.moe.num_experts_per_token;
  t["num_hidden_layers"] = c.num_layers;
  t["num_key_value_heads"] = c.mla.num_heads;
  t["num_nextn_predict_layers"] = 0;
  t["num_shared_experts"] = c.moe.num_shared_experts;
  if (c.pad_token_id >= 0) t["pad_token_id"] = c.pad_token_id;
  t["q_lora_rank"] = c.mla.q_lora_rank ? json::Value(*c.mla.q_lora_rank) : json::Value(nullptr);
  t["qk_nope_head_dim"] = c.mla.qk_nope_head_dim;
  t["qk_rope_head_dim"] = c.mla.qk_rope_head_dim;
  t["rms_norm_eps"] = float_value(c.rms_norm_eps);
  if (c.moe.routed_expert_hidden_size) t["routed_expert_hidden_size"] = *c.moe.routed_expert_hidden_size;
  t["routed_scaling_factor"] = float_value(c.moe.routed_scaling_factor);
  t["tie_word_embeddings"] = c.tie_word_embeddings;
  t["topk_group"] = c.moe.top_k_groups;
  t["use_grouped_topk"] = true;
  t["v_head_dim"] = c.mla.v_head_dim;
  t["vocab_size"] = c.vocab_size;
  if (!c.nested_text_config) return t;

  json::Value top = json::Value::object();
  json::Value archs = json::Value::array();
  archs.push_back(c.architecture.empty() ? std::string("KimiK3ForConditionalGeneration") : c.architecture);
  top["architectures"] = std::move(archs);
  if (c.bos_token_id >= 0) top["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_id >= 0) top["eos_token_id"] = c.eos_token_id;
  top["model_type"] = kNestedModelType;
  if (c.pad_token_id >= 0) top["pad_token_id"] = c.pad_token_id;
  top["text_config"] = std::move(t);
  top["tie_word_embeddings"] = c.tie_word_embeddings;
  return top;
}

}  // namespace deltaserve::engine
