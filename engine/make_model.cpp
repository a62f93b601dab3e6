#include "engine/make_model.hpp"

#include <cmath>
#include <fstream>
#include <system_error>

#include "engine/model_weights.hpp"
#include "engine/sampler.hpp"

namespace deltaserve::engine {
namespace {

// A seeded, platform-independent generator (std distributions are implementation-defined).
class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed) {}
  uint64_t next() { return splitmix64_next(state_); }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double normal() {                                                           // Box–Muller
    const double u1 = 1.0 - uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
  }

 private:
  uint64_t state_;
};

uint64_t name_seed(uint64_t seed, const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull ^ seed;  // FNV-1a over the name, keyed by the seed
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

std::vector<float> init_tensor(const TensorSpec& spec, uint64_t seed) {
  int64_t count = 1;
  for (int64_t s : spec.shape) count *= s;
  std::vector<float> values(static_cast<size_t>(count));
  Random random(name_seed(seed, spec.name));
  const std::string& n = spec.name;
  if (spec.is_norm) {
    for (float& v : values) v = static_cast<float>(1.0 + 0.1 * random.normal());
  } else if (n.ends_with("A_log")) {
    for (float& v : values) v = static_cast<float>(std::log(1.0 + 15.0 * random.uniform()));  // decay rate 1..16
  } else if (n.ends_with("dt_bias")) {
    for (float& v : values) v = static_cast<float>(-2.0 + 1.0 * random.normal());
  } else if (n.ends_with("e_score_correction_bias")) {
    for (float& v : values) v = static_cast<float>(0.1 * random.normal());
  } else if (n.ends_with("conv1d.weight")) {
    for (float& v : values) v = static_cast<float>(0.5 * random.normal());
  } else if (n.find("embed_tokens") != std::string::npos) {
    for (float& v : values) v = static_cast<float>(random.normal());
  } else {
    // Projections [out, in]: scaled so activations stay O(1) through the stack.
    const double fan_in = spec.shape.empty() ? 1.0 : static_cast<double>(spec.shape.back());
    const double scale = 1.0 / std::sqrt(fan_in);
    for (float& v : values) v = static_cast<float>(scale * random.normal());
  }
  return values;
}

// fp8 checkpoints quantise the 2-D projection weights only (as public fp8 releases do); embeddings,
// router, norms and small vectors stay bf16.
DType storage_dtype(const TensorSpec& spec, DType requested) {
  if (requested != DType::kF8E4M3) return requested;
  const bool projection = spec.shape.size() == 2 && spec.name.ends_with("proj.weight") && !spec.is_norm;
  const bool expert = spec.name.find(".experts.") != std::string::npos;
  return (projection || expert) && spec.shape[0] > 1 ? DType::kF8E4M3 : DType::kBF16;
}

ModelConfig common_tiny(int64_t vocab_base) {
  ModelConfig c;
  c.model_type = "kimi_linear";
  c.architecture = "KimiLinearForCausalLM";
  c.hidden_size = 64;
  c.vocab_size = vocab_base + 256;
  c.intermediate_size = 128;
  c.rms_norm_eps = 1e-5f;
  c.max_position_embeddings = 65536;
  c.kda.num_heads = 2;
  c.kda.head_dim = 32;
  c.kda.conv_kernel_size = 4;
  c.kda.gate_low_rank = 32;
  c.mla.num_heads = 2;
  c.mla.kv_lora_rank = 32;
  c.mla.qk_nope_head_dim = 16;
  c.mla.qk_rope_head_dim = 8;
  c.mla.v_head_dim = 16;
  c.mla.use_nope = true;
  c.moe.num_experts = 8;
  c.moe.moe_intermediate_size = 32;
  c.moe.first_k_dense_replace = 1;
  c.moe.layer_freq = 1;
  c.moe.routed_scaling_factor = 2.446f;
  c.moe.renormalize = true;
  c.bos_token_id = static_cast<int32_t>(vocab_base);
  c.eos_token_id = static_cast<int32_t>(vocab_base + 2);  // <|im_end|>
  c.pad_token_id = static_cast<int32_t>(vocab_base + 255);
  return c;
}

}  // namespace

std::vector<std::string> preset_names() {
  return {"tiny-linear", "tiny-k3"};
}

Result<ModelConfig> preset_config(std::string_view name, int64_t vocab_base) {
  ModelConfig c = common_tiny(vocab_base);
  if (name == "tiny-linear") {
    // KDA at 1,2,3,5 and MLA at 4,6 (1-based), like Kimi Linear's 3:1 pattern ending in MLA.
    c.num_layers = 6;
    c.layer_kinds = {LayerKind::kKda, LayerKind::kKda, LayerKind::kKda,
                     LayerKind::kMla, LayerKind::kKda, LayerKind::kMla};
    c.moe.num_experts_per_token = 2;
    c.moe.num_shared_experts = 1;
    return c;
  }
  if (name == "tiny-k3") {
    // MLA at 4, 8 and the last layer (9), KDA elsewhere, as K3's [4, 8, ..., 92, 93].
    c.nested_text_config = true;
    c.num_layers = 9;
    c.layer_kinds.assign(9, LayerKind::kKda);
    c.layer_kinds[3] = c.layer_kinds[7] = c.layer_kinds[8] = LayerKind::kMla;
    c.kda.gate_lower_bound = -5.0f;
    c.kda.full_rank_output_gate = true;
    c.mla.q_lora_rank = 32;
    c.mla.use_output_gate = true;
    c.moe.num_experts = 8;
    c.moe.num_experts_per_token = 3;
    c.moe.num_shared_experts = 2;
    c.moe.moe_intermediate_size = 16;
    c.moe.routed_expert_hidden_size = 32;
    c.moe.latent_moe_use_norm = true;
    c.hidden_act = Activation::kSitu;
    c.situ_beta = 4.0f;
    c.situ_linear_beta = 25.0f;
    c.attn_res_block_size = 3;
    return c;
  }
  return invalid_argument("unknown preset '" + std::string(name) + "' (known: tiny-linear, tiny-k3)");
}

Status write_random_model(const ModelConfig& config, const std::filesystem::path& directory,
                          const MakeModelOptions& options) {
  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  if (ec) return io_error("cannot create " + directory.string() + ": " + ec.message());

  SafetensorsWriter writer;
  for (const TensorSpec& spec : expected_tensors(config)) {
    const std::vector<float> values = init_tensor(spec, options.seed);
    DS_RETURN_IF_ERROR(writer.add(spec.name, spec.shape, values, storage_dtype(spec, options.dtype)));
  }
  DS_RETURN_IF_ERROR(writer.write(directory, options.max_shard_bytes));

  const std::filesystem::path config_path = directory / "config.json";
  std::ofstream out(config_path, std::ios::binary | std::ios::trunc);
  out << model_config_to_json(config).dump(2) << "\n";
  out.close();
  if (!out) return io_error("cannot write " + config_path.string());
  return Status::ok();
}

}  // namespace deltaserve::engine
