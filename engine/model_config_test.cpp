#include "engine/model_config.hpp"

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/json.hpp"
#include "engine/model_inspect.hpp"

namespace deltaserve::engine {
namespace {

#ifndef DELTASERVE_SOURCE_DIR
#define DELTASERVE_SOURCE_DIR "."
#endif

const std::filesystem::path kConfigDir = std::filesystem::path(DELTASERVE_SOURCE_DIR) / "tests/data/configs";
const std::filesystem::path kKimiLinearPath = kConfigDir / "kimi-linear-48b-a3b.config.json";
const std::filesystem::path kK3Path = kConfigDir / "kimi-k3-shape.config.json";

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

json::Value read_json(const std::filesystem::path& path) {
  auto v = json::parse(read_file(path));
  EXPECT_TRUE(v.is_ok()) << path << ": " << v.status().to_string();
  return v.is_ok() ? *v : json::Value();
}

ModelConfig load_or_die(const std::filesystem::path& path) {
  auto c = load_model_config(path);
  EXPECT_TRUE(c.is_ok()) << c.status().to_string();
  return c.is_ok() ? *c : ModelConfig();
}

// Field by field, so a round-trip failure names the field; then == to catch any field not listed here.
void expect_same(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.model_type, b.model_type);
  EXPECT_EQ(a.architecture, b.architecture);
  EXPECT_EQ(a.nested_text_config, b.nested_text_config);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.layer_kinds, b.layer_kinds);
  EXPECT_EQ(a.kda.num_heads, b.kda.num_heads);
  EXPECT_EQ(a.kda.head_dim, b.kda.head_dim);
  EXPECT_EQ(a.kda.conv_kernel_size, b.kda.conv_kernel_size);
  EXPECT_EQ(a.kda.gate_lower_bound, b.kda.gate_lower_bound);
  EXPECT_EQ(a.kda.full_rank_output_gate, b.kda.full_rank_output_gate);
  EXPECT_EQ(a.kda.gate_low_rank, b.kda.gate_low_rank);
  EXPECT_EQ(a.mla.num_heads, b.mla.num_heads);
  EXPECT_EQ(a.mla.q_lora_rank, b.mla.q_lora_rank);
  EXPECT_EQ(a.mla.kv_lora_rank, b.mla.kv_lora_rank);
  EXPECT_EQ(a.mla.qk_nope_head_dim, b.mla.qk_nope_head_dim);
  EXPECT_EQ(a.mla.qk_rope_head_dim, b.mla.qk_rope_head_dim);
  EXPECT_EQ(a.mla.v_head_dim, b.mla.v_head_dim);
  EXPECT_EQ(a.mla.use_nope, b.mla.use_nope);
  EXPECT_EQ(a.mla.use_output_gate, b.mla.use_output_gate);
  EXPECT_EQ(a.moe.num_experts, b.moe.num_experts);
  EXPECT_EQ(a.moe.num_experts_per_token, b.moe.num_experts_per_token);
  EXPECT_EQ(a.moe.num_shared_experts, b.moe.num_shared_experts);
  EXPECT_EQ(a.moe.moe_intermediate_size, b.moe.moe_intermediate_size);
  EXPECT_EQ(a.moe.first_k_dense_replace, b.moe.first_k_dense_replace);
  EXPECT_EQ(a.moe.layer_freq, b.moe.layer_freq);
  EXPECT_EQ(a.moe.routed_scaling_factor, b.moe.routed_scaling_factor);
  EXPECT_EQ(a.moe.renormalize, b.moe.renormalize);
  EXPECT_EQ(a.moe.num_expert_groups, b.moe.num_expert_groups);
  EXPECT_EQ(a.moe.top_k_groups, b.moe.top_k_groups);
  EXPECT_EQ(a.moe.routed_expert_hidden_size, b.moe.routed_expert_hidden_size);
  EXPECT_EQ(a.moe.latent_moe_use_norm, b.moe.latent_moe_use_norm);
  EXPECT_EQ(a.hidden_act, b.hidden_act);
  EXPECT_EQ(a.situ_beta, b.situ_beta);
  EXPECT_EQ(a.situ_linear_beta, b.situ_linear_beta);
  EXPECT_EQ(a.attn_res_block_size, b.attn_res_block_size);
  EXPECT_EQ(a.bos_token_id, b.bos_token_id);
  EXPECT_EQ(a.eos_token_id, b.eos_token_id);
  EXPECT_EQ(a.pad_token_id, b.pad_token_id);
  EXPECT_TRUE(a == b);
}

void expect_round_trip(const ModelConfig& c) {
  const std::string text = model_config_to_json(c).dump(2);
  auto again = parse_model_config_text(text);
  ASSERT_TRUE(again.is_ok()) << again.status().to_string() << "\n" << text;
  expect_same(c, *again);
}

TEST(ModelConfigTest, ParsesKimiLinear48B) {
  const ModelConfig c = load_or_die(kKimiLinearPath);
  EXPECT_EQ(c.model_type, "kimi_linear");
  EXPECT_EQ(c.architecture, "KimiLinearForCausalLM");
  EXPECT_FALSE(c.nested_text_config);
  EXPECT_EQ(c.tensor_prefix(), "model.");
  EXPECT_EQ(c.hidden_size, 2304);
  EXPECT_EQ(c.num_layers, 27);
  EXPECT_EQ(c.vocab_size, 163840);
  EXPECT_EQ(c.intermediate_size, 9216);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-5f);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.max_position_embeddings, 1048576);
  EXPECT_EQ(c.num_layers_of(LayerKind::kKda), 20);
  EXPECT_EQ(c.num_layers_of(LayerKind::kMla), 7);
  for (int64_t l : {3, 7, 11, 15, 19, 23, 26}) EXPECT_EQ(c.layer_kinds[static_cast<size_t>(l)], LayerKind::kMla) << l;
  EXPECT_EQ(c.layer_kinds[0], LayerKind::kKda);
  EXPECT_EQ(c.kda.num_heads, 32);
  EXPECT_EQ(c.kda.head_dim, 128);
  EXPECT_EQ(c.kda.conv_kernel_size, 4);
  EXPECT_FALSE(c.kda.gate_lower_bound.has_value());
  EXPECT_FALSE(c.kda.full_rank_output_gate);
  EXPECT_EQ(c.kda.gate_low_rank, 128);
  EXPECT_EQ(c.mla.num_heads, 32);
  EXPECT_FALSE(c.mla.q_lora_rank.has_value());
  EXPECT_EQ(c.mla.kv_lora_rank, 512);
  EXPECT_EQ(c.mla.qk_head_dim(), 192);
  EXPECT_EQ(c.mla.cache_width(), 576);
  EXPECT_FLOAT_EQ(c.mla.softmax_scale(), 1.0f / std::sqrt(192.0f));
  EXPECT_TRUE(c.mla.use_nope);
  EXPECT_FALSE(c.mla.use_output_gate);
  EXPECT_EQ(c.moe.num_experts, 256);
  EXPECT_EQ(c.moe.num_experts_per_token, 8);
  EXPECT_EQ(c.moe.num_shared_experts, 1);
  EXPECT_EQ(c.moe.moe_intermediate_size, 1024);
  EXPECT_FLOAT_EQ(c.moe.routed_scaling_factor, 2.446f);
  EXPECT_TRUE(c.moe.renormalize);
  EXPECT_FALSE(c.moe.routed_expert_hidden_size.has_value());
  EXPECT_EQ(c.hidden_act, Activation::kSilu);
  EXPECT_FALSE(c.attn_res_block_size.has_value());
  EXPECT_EQ(c.bos_token_id, 163584);
  EXPECT_EQ(c.eos_token_id, 163586);
  EXPECT_EQ(c.pad_token_id, 163839);
  EXPECT_FALSE(c.is_moe_layer(0));
  for (int64_t l = 1; l < 27; ++l) EXPECT_TRUE(c.is_moe_layer(l)) << l;

  EXPECT_EQ(c.kda_state_bytes_per_request(), 41'943'040);  // 40 MiB
  EXPECT_EQ(c.kda_state_bytes_per_request(), 40 << 20);
  EXPECT_EQ(c.mla_cache_bytes_per_token(), 8'064);
  EXPECT_EQ(c.kda_conv_state_bytes_per_request(), 20 * 3 * 4096 * 3 * 4);
}

TEST(ModelConfigTest, ParsesKimiK3Shape) {
  const ModelConfig c = load_or_die(kK3Path);
  EXPECT_TRUE(c.nested_text_config);
  EXPECT_EQ(c.tensor_prefix(), "language_model.model.");
  EXPECT_EQ(c.lm_head_name(), "language_model.lm_head.weight");
  EXPECT_EQ(c.architecture, "KimiK3ForConditionalGeneration");
  EXPECT_EQ(c.model_type, "kimi_linear");
  EXPECT_EQ(c.num_layers, 93);
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.num_layers_of(LayerKind::kKda), 69);
  EXPECT_EQ(c.num_layers_of(LayerKind::kMla), 24);
  EXPECT_EQ(c.layer_kinds[3], LayerKind::kMla);
  EXPECT_EQ(c.layer_kinds[91], LayerKind::kMla);
  EXPECT_EQ(c.layer_kinds[92], LayerKind::kMla);
  EXPECT_EQ(c.layer_kinds[90], LayerKind::kKda);
  EXPECT_EQ(c.kda.num_heads, 96);
  ASSERT_TRUE(c.kda.gate_lower_bound.has_value());
  EXPECT_FLOAT_EQ(*c.kda.gate_lower_bound, -5.0f);
  EXPECT_TRUE(c.kda.full_rank_output_gate);
  EXPECT_EQ(c.mla.num_heads, 96);
  EXPECT_EQ(c.mla.q_lora_rank, std::optional<int64_t>(1536));
  EXPECT_TRUE(c.mla.use_output_gate);
  EXPECT_EQ(c.moe.num_experts, 896);
  EXPECT_EQ(c.moe.num_experts_per_token, 16);
  EXPECT_EQ(c.moe.num_shared_experts, 2);
  EXPECT_EQ(c.moe.moe_intermediate_size, 3072);
  EXPECT_EQ(c.moe.routed_expert_hidden_size, std::optional<int64_t>(3584));
  EXPECT_TRUE(c.moe.latent_moe_use_norm);
  EXPECT_EQ(c.hidden_act, Activation::kSitu);
  EXPECT_FLOAT_EQ(c.situ_beta, 4.0f);
  EXPECT_FLOAT_EQ(c.situ_linear_beta, 25.0f);
  EXPECT_EQ(c.attn_res_block_size, std::optional<int64_t>(12));
  EXPECT_EQ(c.vocab_size, 163840);
  EXPECT_EQ(c.eos_token_id, 163586);
  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_TRUE(c.is_moe_layer(92));

  EXPECT_EQ(c.kda_state_bytes_per_request(), 434'110'464);  // 414 MiB
  EXPECT_EQ(c.kda_state_bytes_per_request(), int64_t{414} << 20);
  EXPECT_EQ(c.mla_cache_bytes_per_token(), 27'648);
}

TEST(ModelConfigTest, IsMoeLayerFollowsHfRule) {
  ModelConfig c = load_or_die(kKimiLinearPath);
  c.moe.first_k_dense_replace = 2;
  c.moe.layer_freq = 3;
  // HF KimiDecoderLayer: layer >= first_k_dense_replace and layer % moe_layer_freq == 0.
  std::vector<int64_t> moe;
  for (int64_t l = 0; l < c.num_layers; ++l)
    if (c.is_moe_layer(l)) moe.push_back(l);
  EXPECT_EQ(moe, (std::vector<int64_t>{3, 6, 9, 12, 15, 18, 21, 24}));
  c.moe.num_experts = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) EXPECT_FALSE(c.is_moe_layer(l));
}

TEST(ModelConfigTest, RoundTripsBothRealConfigs) {
  expect_round_trip(load_or_die(kKimiLinearPath));
  expect_round_trip(load_or_die(kK3Path));
}

TEST(ModelConfigTest, RoundTripsEditedConfigs) {
  ModelConfig c = load_or_die(kKimiLinearPath);
  c.moe.num_expert_groups = 8;
  c.moe.top_k_groups = 4;
  c.moe.first_k_dense_replace = 3;
  c.moe.layer_freq = 2;
  c.tie_word_embeddings = true;
  c.mla.q_lora_rank = 64;
  c.pad_token_id = -1;
  c.rms_norm_eps = 1e-6f;
  expect_round_trip(c);

  ModelConfig dense = load_or_die(kKimiLinearPath);
  dense.moe = MoeConfig{};
  expect_round_trip(dense);

  ModelConfig k3 = load_or_die(kK3Path);
  k3.kda.gate_lower_bound = -2.5f;
  k3.moe.latent_moe_use_norm = false;
  k3.situ_beta = 3.5f;
  expect_round_trip(k3);
}

TEST(ModelConfigTest, WritesRealFormat) {
  const json::Value written = model_config_to_json(load_or_die(kKimiLinearPath));
  const json::Value real = read_json(kKimiLinearPath);
  // Every key written is a key of the published file, with the published value.
  for (const auto& [key, value] : written.as_object()) {
    const json::Value* published = real.find(key);
    ASSERT_NE(published, nullptr) << key;
    EXPECT_EQ(value.dump(), published->dump()) << key;
  }
  const json::Value k3 = model_config_to_json(load_or_die(kK3Path));
  ASSERT_NE(k3.find("text_config"), nullptr);
  EXPECT_EQ(k3.find("model_type")->as_string(), "kimi_k3");
  EXPECT_EQ(k3.find("text_config")->find("model_type")->as_string(), "kimi_linear");
}

TEST(ModelConfigTest, LoadsDirectoryAndReportsPath) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      ("ds_model_config_test_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()));
  std::filesystem::create_directories(dir);
  {
    std::ofstream out(dir / "config.json");
    out << read_file(kKimiLinearPath);
  }
  auto c = load_model_config(dir);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->num_layers, 27);
  {
    std::ofstream out(dir / "config.json");
    out << "{\"model_type\": \"kimi_linear\",}";
  }
  auto broken = load_model_config(dir);
  ASSERT_FALSE(broken.is_ok());
  EXPECT_EQ(broken.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(broken.status().message().find((dir / "config.json").string()), std::string::npos)
      << broken.status().message();
  std::filesystem::remove_all(dir);

  auto missing = load_model_config(dir / "nope.json");
  ASSERT_FALSE(missing.is_ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
}

// ---- broken configs: one mutation each, the error names the field ---------------------------------------

enum class Base { kKimiLinear, kK3 };

struct Mutation {
  std::string name;
  Base base;
  std::vector<std::string> path;     // object keys down to the field; the last is the field itself
  std::optional<json::Value> value;  // nullopt: remove the field
  std::string expected_path;         // must appear in the message
  StatusCode expected_code = StatusCode::kInvalidArgument;
};

json::Value& descend(json::Value& root, const std::vector<std::string>& keys, size_t count) {
  json::Value* v = &root;
  for (size_t i = 0; i < count; ++i) v = &(*v)[keys[i]];
  return *v;
}

json::Value apply(json::Value document, const Mutation& m) {
  json::Value& parent = descend(document, m.path, m.path.size() - 1);
  const std::string& key = m.path.back();
  if (m.value) {
    parent[key] = *m.value;
  } else {
    auto& members = parent.as_object();
    std::erase_if(members, [&](const auto& member) { return member.first == key; });
  }
  return document;
}

json::Value ints(std::initializer_list<int64_t> values) {
  json::Value a = json::Value::array();
  for (int64_t v : values) a.push_back(v);
  return a;
}

json::Value with_appended(json::Value array, json::Value item) {
  array.push_back(std::move(item));
  return array;
}

std::vector<Mutation> broken_configs(const json::Value& kimi_linear) {
  const json::Value& kda_layers = *kimi_linear.find("linear_attn_config")->find("kda_layers");
  json::Value full_with_string = ints({8, 12, 16, 20, 24, 27});
  full_with_string.as_array().insert(full_with_string.as_array().begin(), json::Value("4"));
  using B = Base;
  const StatusCode kUnimpl = StatusCode::kUnimplemented;
  const std::vector<std::string> lac = {"linear_attn_config"};
  const std::vector<std::string> k3lac = {"text_config", "linear_attn_config"};
  auto in = [](std::vector<std::string> prefix, std::string key) {
    prefix.push_back(std::move(key));
    return prefix;
  };
  return {
      // required fields removed
      {"no_hidden_size", B::kKimiLinear, {"hidden_size"}, std::nullopt, "hidden_size"},
      {"no_num_hidden_layers", B::kKimiLinear, {"num_hidden_layers"}, std::nullopt, "num_hidden_layers"},
      {"no_vocab_size", B::kKimiLinear, {"vocab_size"}, std::nullopt, "vocab_size"},
      {"no_model_type", B::kKimiLinear, {"model_type"}, std::nullopt, "model_type"},
      {"no_kv_lora_rank", B::kKimiLinear, {"kv_lora_rank"}, std::nullopt, "kv_lora_rank"},
      {"no_mla_use_nope", B::kKimiLinear, {"mla_use_nope"}, std::nullopt, "mla_use_nope"},
      {"no_context", B::kKimiLinear, {"model_max_length"}, std::nullopt, "max_position_embeddings"},
      {"no_linear_attn_config", B::kKimiLinear, {"linear_attn_config"}, std::nullopt, "linear_attn_config"},
      {"no_kda_layers", B::kKimiLinear, in(lac, "kda_layers"), std::nullopt, "linear_attn_config.kda_layers"},
      {"no_num_heads", B::kKimiLinear, in(lac, "num_heads"), std::nullopt, "linear_attn_config.num_heads"},
      {"no_top_k", B::kKimiLinear, {"num_experts_per_token"}, std::nullopt, "num_experts_per_token"},
      {"k3_no_situ_beta",
       B::kK3,
       {"text_config", "activation_situ_beta"},
       std::nullopt,
       "text_config.activation_situ_beta"},
      {"k3_no_head_dim", B::kK3, in(k3lac, "head_dim"), std::nullopt, "text_config.linear_attn_config.head_dim"},
      // wrong types
      {"hidden_size_string", B::kKimiLinear, {"hidden_size"}, json::Value("2304"), "hidden_size"},
      {"hidden_size_float", B::kKimiLinear, {"hidden_size"}, json::Value(2304.0), "hidden_size"},
      {"eps_string", B::kKimiLinear, {"rms_norm_eps"}, json::Value("1e-5"), "rms_norm_eps"},
      {"nope_int", B::kKimiLinear, {"mla_use_nope"}, json::Value(1), "mla_use_nope"},
      {"kda_layers_object", B::kKimiLinear, in(lac, "kda_layers"), json::Value::object(),
       "linear_attn_config.kda_layers"},
      {"layer_as_string", B::kKimiLinear, in(lac, "full_attn_layers"), full_with_string,
       "linear_attn_config.full_attn_layers[0]"},
      {"linear_attn_config_array", B::kKimiLinear, {"linear_attn_config"}, json::Value::array(), "linear_attn_config"},
      {"k3_text_config_string", B::kK3, {"text_config"}, json::Value("x"), "text_config"},
      {"k3_lb_string", B::kK3, in(k3lac, "gate_lower_bound"), json::Value("-5"),
       "text_config.linear_attn_config.gate_lower_bound"},
      {"architectures_string",
       B::kKimiLinear,
       {"architectures"},
       json::Value("KimiLinearForCausalLM"),
       "architectures"},
      // unknown keys
      {"unknown_top", B::kKimiLinear, {"hiden_size"}, json::Value(2304), "hiden_size"},
      {"unknown_nested", B::kKimiLinear, in(lac, "num_kv_heads"), json::Value(4), "linear_attn_config.num_kv_heads"},
      {"k3_unknown_outer", B::kK3, {"speculative_config"}, json::Value::object(), "speculative_config"},
      {"k3_unknown_text", B::kK3, {"text_config", "attention_bias"}, json::Value(true), "text_config.attention_bias"},
      {"k3_unknown_nested", B::kK3, in(k3lac, "bogus"), json::Value(1), "text_config.linear_attn_config.bogus"},
      // layer lists
      {"layer_zero", B::kKimiLinear, in(lac, "kda_layers"), with_appended(kda_layers, json::Value(0)),
       "linear_attn_config.kda_layers[20]"},
      {"layer_past_end", B::kKimiLinear, in(lac, "full_attn_layers"), ints({4, 8, 12, 16, 20, 24, 28}),
       "linear_attn_config.full_attn_layers[6]"},
      {"layer_duplicate", B::kKimiLinear, in(lac, "kda_layers"), with_appended(kda_layers, json::Value(26)),
       "linear_attn_config.kda_layers[20]"},
      {"layer_in_both", B::kKimiLinear, in(lac, "full_attn_layers"), ints({3, 8, 12, 16, 20, 24, 27}),
       "linear_attn_config.full_attn_layers[0]"},
      {"layer_in_neither", B::kKimiLinear, in(lac, "full_attn_layers"), ints({4, 8, 12, 16, 20, 24}),
       "linear_attn_config.kda_layers"},
      {"k3_layer_in_both", B::kK3, in(k3lac, "full_attn_layers"), ints({1}),
       "text_config.linear_attn_config.full_attn_layers[0]"},
      // values out of range or inconsistent
      {"hidden_zero", B::kKimiLinear, {"hidden_size"}, json::Value(0), "hidden_size"},
      {"heads_negative", B::kKimiLinear, {"num_attention_heads"}, json::Value(-1), "num_attention_heads"},
      {"kv_heads_differ", B::kKimiLinear, {"num_key_value_heads"}, json::Value(8), "num_key_value_heads"},
      {"q_lora_rank_zero", B::kKimiLinear, {"q_lora_rank"}, json::Value(0), "q_lora_rank"},
      {"conv_kernel_zero", B::kKimiLinear, in(lac, "short_conv_kernel_size"), json::Value(0),
       "linear_attn_config.short_conv_kernel_size"},
      {"bad_activation", B::kKimiLinear, {"hidden_act"}, json::Value("gelu"), "hidden_act"},
      {"k3_bad_activation", B::kK3, {"text_config", "hidden_act"}, json::Value("swiglu"), "text_config.hidden_act"},
      {"top_k_over_experts", B::kKimiLinear, {"num_experts_per_token"}, json::Value(257), "num_experts_per_token"},
      {"k3_top_k_over_experts",
       B::kK3,
       {"text_config", "num_experts_per_token"},
       json::Value(900),
       "text_config.num_experts_per_token"},
      {"groups_not_dividing", B::kKimiLinear, {"num_expert_group"}, json::Value(3), "num_expert_group"},
      {"topk_group_over_groups", B::kKimiLinear, {"topk_group"}, json::Value(2), "topk_group"},
      {"first_dense_past_end", B::kKimiLinear, {"first_k_dense_replace"}, json::Value(28), "first_k_dense_replace"},
      {"moe_freq_zero", B::kKimiLinear, {"moe_layer_freq"}, json::Value(0), "moe_layer_freq"},
      {"scaling_negative", B::kKimiLinear, {"routed_scaling_factor"}, json::Value(-1.0), "routed_scaling_factor"},
      {"unknown_router",
       B::kKimiLinear,
       {"moe_router_activation_func"},
       json::Value("tanh"),
       "moe_router_activation_func"},
      {"vocab_below_bos", B::kKimiLinear, {"vocab_size"}, json::Value(1000), "bos_token_id"},
      {"pad_negative", B::kKimiLinear, {"pad_token_id"}, json::Value(-2), "pad_token_id"},
      {"context_mismatch", B::kKimiLinear, {"max_position_embeddings"}, json::Value(4096), "model_max_length"},
      {"bad_model_type", B::kKimiLinear, {"model_type"}, json::Value("deepseek_v3"), "model_type"},
      {"k3_bad_outer_model_type", B::kK3, {"model_type"}, json::Value("kimi_vl"), "model_type"},
      {"k3_bad_text_model_type",
       B::kK3,
       {"text_config", "model_type"},
       json::Value("kimi_k3"),
       "text_config.model_type"},
      {"k3_lb_zero", B::kK3, in(k3lac, "gate_lower_bound"), json::Value(0.0),
       "text_config.linear_attn_config.gate_lower_bound"},
      {"k3_lb_positive", B::kK3, in(k3lac, "gate_lower_bound"), json::Value(1.5),
       "text_config.linear_attn_config.gate_lower_bound"},
      {"k3_latent_norm_without_latent",
       B::kK3,
       {"text_config", "routed_expert_hidden_size"},
       std::nullopt,
       "text_config.latent_moe_use_norm"},
      {"k3_eos_disagrees", B::kK3, {"eos_token_id"}, json::Value(163585), "eos_token_id"},
      {"k3_tie_disagrees", B::kK3, {"tie_word_embeddings"}, json::Value(true), "tie_word_embeddings"},
      {"k3_attn_res_zero",
       B::kK3,
       {"text_config", "attn_res_block_size"},
       json::Value(0),
       "text_config.attn_res_block_size"},
      // recognised but unsupported
      {"rope_mla", B::kKimiLinear, {"mla_use_nope"}, json::Value(false), "mla_use_nope", kUnimpl},
      {"k3_rope_mla", B::kK3, {"text_config", "mla_use_nope"}, json::Value(false), "text_config.mla_use_nope", kUnimpl},
      {"softmax_router",
       B::kKimiLinear,
       {"moe_router_activation_func"},
       json::Value("softmax"),
       "moe_router_activation_func",
       kUnimpl},
      {"k3_lb_too_low", B::kK3, in(k3lac, "gate_lower_bound"), json::Value(-6.0),
       "text_config.linear_attn_config.gate_lower_bound", kUnimpl},
      {"topk_method", B::kKimiLinear, {"topk_method"}, json::Value("greedy"), "topk_method", kUnimpl},
  };
}

TEST(ModelConfigTest, BrokenConfigsNameTheField) {
  const json::Value kimi_linear = read_json(kKimiLinearPath);
  const json::Value k3 = read_json(kK3Path);
  ASSERT_TRUE(parse_model_config(kimi_linear).is_ok());
  ASSERT_TRUE(parse_model_config(k3).is_ok());
  const std::vector<Mutation> cases = broken_configs(kimi_linear);
  EXPECT_GE(cases.size(), 60u);
  for (const Mutation& m : cases) {
    SCOPED_TRACE(m.name);
    const json::Value mutated = apply(m.base == Base::kKimiLinear ? kimi_linear : k3, m);
    auto c = parse_model_config(mutated);
    ASSERT_FALSE(c.is_ok()) << "accepted";
    EXPECT_EQ(c.status().code(), m.expected_code) << c.status().to_string();
    const std::string& message = c.status().message();
    EXPECT_NE(message.find(m.expected_path), std::string::npos) << message;
    // A nested path is reported in full, from the document root.
    if (m.expected_path.starts_with("text_config.")) {
      EXPECT_TRUE(message.starts_with("text_config.")) << message;
    }
  }
}

TEST(ModelConfigTest, AcceptsOptionalVariants) {
  const json::Value kimi_linear = read_json(kKimiLinearPath);
  // Dense-only: num_experts null and the MoE keys unused.
  auto dense =
      parse_model_config(apply(kimi_linear, {"", Base::kKimiLinear, {"num_experts"}, json::Value(nullptr), ""}));
  ASSERT_TRUE(dense.is_ok()) << dense.status().to_string();
  EXPECT_EQ(dense->moe.num_experts, 0);
  for (int64_t l = 0; l < dense->num_layers; ++l) EXPECT_FALSE(dense->is_moe_layer(l));
  // eos as a list; both context keys present and equal; use_grouped_topk false collapses groups.
  json::Value v = apply(kimi_linear, {"", Base::kKimiLinear, {"eos_token_id"}, ints({163586, 163585}), ""});
  v = apply(v, {"", Base::kKimiLinear, {"max_position_embeddings"}, json::Value(1048576), ""});
  v = apply(v, {"", Base::kKimiLinear, {"use_grouped_topk"}, json::Value(false), ""});
  auto c = parse_model_config(v);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->eos_token_id, 163586);
  EXPECT_EQ(c->max_position_embeddings, 1048576);
  EXPECT_EQ(c->moe.num_expert_groups, 1);

  auto not_json = parse_model_config_text("{\"model_type\": ");
  ASSERT_FALSE(not_json.is_ok());
  EXPECT_EQ(not_json.status().code(), StatusCode::kInvalidArgument);
  auto not_object = parse_model_config_text("[1, 2]");
  ASSERT_FALSE(not_object.is_ok());
}

// ---- parameter counts and the architecture report ---------------------------------------------------------

// Two layers: KDA + dense FFN, then gated MLA (q LoRA) + LatentMoE; AttnRes; untied.
ModelConfig tiny_config() {
  ModelConfig c;
  c.model_type = "kimi_linear";
  c.hidden_size = 8;
  c.num_layers = 2;
  c.vocab_size = 10;
  c.intermediate_size = 7;
  c.max_position_embeddings = 64;
  c.layer_kinds = {LayerKind::kKda, LayerKind::kMla};
  c.kda = {.num_heads = 2,
           .head_dim = 4,
           .conv_kernel_size = 3,
           .gate_lower_bound = -5.0f,
           .full_rank_output_gate = false,
           .gate_low_rank = 4};
  c.mla = {.num_heads = 2,
           .q_lora_rank = 6,
           .kv_lora_rank = 4,
           .qk_nope_head_dim = 2,
           .qk_rope_head_dim = 2,
           .v_head_dim = 3,
           .use_nope = true,
           .use_output_gate = true};
  c.moe.num_experts = 4;
  c.moe.num_experts_per_token = 2;
  c.moe.num_shared_experts = 1;
  c.moe.moe_intermediate_size = 5;
  c.moe.first_k_dense_replace = 1;
  c.moe.routed_expert_hidden_size = 6;
  c.moe.latent_moe_use_norm = true;
  c.attn_res_block_size = 2;
  return c;
}

int64_t elements(std::initializer_list<std::vector<int64_t>> shapes) {
  int64_t total = 0;
  for (const auto& shape : shapes) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    total += n;
  }
  return total;
}

TEST(ModelInspectTest, TinyConfigCountsMatchHandSum) {
  const ParameterCounts p = count_parameters(tiny_config());
  // Tensor by tensor, shapes as the checkpoint stores them.
  const int64_t embedding = elements({{10, 8}});
  const int64_t lm_head = elements({{10, 8}});
  const int64_t kda = elements({{8, 8},
                                {8, 8},
                                {8, 8},  // q/k/v_proj
                                {8, 1, 3},
                                {8, 1, 3},
                                {8, 1, 3},  // q/k/v_conv1d
                                {1, 1, 2, 1},
                                {8},  // A_log, dt_bias
                                {4, 8},
                                {8, 4},
                                {2, 8},  // f_a, f_b, b_proj
                                {4, 8},
                                {8, 4},  // g_a, g_b
                                {4},
                                {8, 8}});  // o_norm, o_proj
  const int64_t dense = elements({{7, 8}, {7, 8}, {8, 7}});
  const int64_t mla = elements({{6, 8},
                                {6},
                                {2 * 4, 6},  // q_a_proj, q_a_layernorm, q_b_proj
                                {4 + 2, 8},
                                {4},               // kv_a_proj_with_mqa, kv_a_layernorm
                                {2 * (2 + 3), 4},  // kv_b_proj
                                {2 * 3, 8},
                                {8, 2 * 3}});  // g_proj, o_proj
  const int64_t router = elements({{4, 8}, {4}});
  const int64_t one_expert = elements({{5, 6}, {5, 6}, {6, 5}});
  const int64_t latent = elements({{6, 8}, {6}, {8, 6}});
  const int64_t shared = elements({{5, 8}, {5, 8}, {8, 5}});
  const int64_t norms = elements({{8},
                                  {8},
                                  {8},
                                  {8},  // input/post norms × 2 layers
                                  {8},
                                  {1, 8},
                                  {8},
                                  {1, 8},  // layer 0 AttnRes
                                  {8},
                                  {1, 8},
                                  {8},
                                  {1, 8},  // layer 1 AttnRes
                                  {8},
                                  {8},
                                  {1, 8}});  // final norm, output AttnRes
  EXPECT_EQ(p.embedding, embedding);
  EXPECT_EQ(p.lm_head, lm_head);
  EXPECT_EQ(p.kda, kda);
  EXPECT_EQ(p.dense_ffn, dense);
  EXPECT_EQ(p.mla, mla);
  EXPECT_EQ(p.router, router);
  EXPECT_EQ(p.routed_experts, 4 * one_expert);
  EXPECT_EQ(p.latent_projections, latent);
  EXPECT_EQ(p.shared_experts, shared);
  EXPECT_EQ(p.norms_and_attn_res, norms);
  const int64_t total = embedding + lm_head + kda + dense + mla + router + 4 * one_expert + latent + shared + norms;
  EXPECT_EQ(total, 1842);
  EXPECT_EQ(p.total, total);
  EXPECT_EQ(p.active_per_token, total - embedding - 4 * one_expert + 2 * one_expert);

  ModelConfig tied = tiny_config();
  tied.tie_word_embeddings = true;
  EXPECT_EQ(count_parameters(tied).lm_head, 0);
  EXPECT_EQ(count_parameters(tied).total, total - lm_head);
}

TEST(ModelInspectTest, KimiLinearTotalMatchesPublishedCheckpoint) {
  // 49,122,681,728: the sum over the published checkpoint's 20,493 tensors (bf16, 91.5 GB).
  const ParameterCounts p = count_parameters(load_or_die(kKimiLinearPath));
  EXPECT_EQ(p.total, 49'122'681'728);
  EXPECT_EQ(p.routed_experts, int64_t{26} * 256 * 3 * 1024 * 2304);
  EXPECT_GT(p.active_per_token, 2'500'000'000);  // "A3B"
  EXPECT_LT(p.active_per_token, 3'500'000'000);
}

TEST(ModelInspectTest, KimiK3ShapeCounts) {
  const ParameterCounts p = count_parameters(load_or_die(kK3Path));
  EXPECT_EQ(p.routed_experts, int64_t{92} * 896 * 3 * 3072 * 3584);
  EXPECT_GT(p.total, 2'700'000'000'000);  // ~2.8 T published
  EXPECT_LT(p.total, 2'900'000'000'000);
}

TEST(ModelInspectTest, DescribesBothFamilies) {
  const std::string linear = describe_model(load_or_die(kKimiLinearPath));
  EXPECT_NE(linear.find("41,943,040 B (40 MiB)"), std::string::npos) << linear;
  EXPECT_NE(linear.find("8,064 B/token"), std::string::npos) << linear;
  EXPECT_NE(linear.find("KKKMKKKMKKKMKKKMKKKMKKKMKKM"), std::string::npos) << linear;
  EXPECT_NE(linear.find("49.1 B"), std::string::npos) << linear;
  EXPECT_NE(linear.find("1,056,964,608 B (1008 MiB)"), std::string::npos) << linear;  // 128k tokens
  EXPECT_NE(linear.find("8,455,716,864 B (7.88 GiB)"), std::string::npos) << linear;  // 1M tokens
  const std::string k3 = describe_model(load_or_die(kK3Path));
  EXPECT_NE(k3.find("434,110,464 B (414 MiB)"), std::string::npos) << k3;
  EXPECT_NE(k3.find("27,648 B/token"), std::string::npos) << k3;
  EXPECT_NE(k3.find("LatentMoE"), std::string::npos) << k3;
  EXPECT_NE(k3.find("AttnRes       block size 12"), std::string::npos) << k3;
}

TEST(ModelInspectTest, FormatsUnits) {
  EXPECT_EQ(with_thousands(0), "0");
  EXPECT_EQ(with_thousands(999), "999");
  EXPECT_EQ(with_thousands(1000), "1,000");
  EXPECT_EQ(with_thousands(41943040), "41,943,040");
  EXPECT_EQ(with_thousands(-1234567), "-1,234,567");
  EXPECT_EQ(human_bytes(512), "512 B");
  EXPECT_EQ(human_bytes(41943040), "40 MiB");
  EXPECT_EQ(human_bytes(2949120), "2.81 MiB");
  EXPECT_EQ(human_count(49122681728), "49.1 B");
  EXPECT_EQ(human_count(12), "12");
}

}  // namespace
}  // namespace deltaserve::engine
