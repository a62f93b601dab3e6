#include "engine/cuda/device_weights.hpp"

#include <algorithm>
#include <cmath>
#include <utility>

#include "engine/cuda/device_init.hpp"
#include "kernels/cuda/ops/ops.hpp"

namespace deltaserve::engine::cuda {
namespace {

namespace kc = kernels::cuda;

// One checkpoint tensor and where it goes on the device.
struct Placement {
  std::string name;
  std::vector<int64_t> shape;
  bool is_norm = false;
  void* dst = nullptr;  // device destination (nullptr while only measuring)
  bool as_bf16 = false;
  const Tensor* host = nullptr;  // the host fp32 tensor when the source is a ModelWeights
};

int64_t product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// Walks the model's tensors (the names and shapes of engine/model_weights.cpp), allocating the device buffers
// (or only counting their bytes) and recording one Placement per checkpoint tensor.
class Walker {
 public:
  Walker(const ModelConfig& config, const ModelWeights* host, DeviceWeights* weights)
      : c_(config), host_(host), w_(weights) {}

  Status run() {
    const std::string prefix = c_.tensor_prefix();
    const int64_t hidden = c_.hidden_size;
    DeviceWeights& w = *w_;
    w.embed_tokens = alloc<bf16>(c_.vocab_size * hidden, "embed_tokens");
    place(prefix + "embed_tokens.weight", {c_.vocab_size, hidden}, false, w.embed_tokens,
          host_ ? &host_->embed_tokens : nullptr);
    w.layers.resize(static_cast<size_t>(c_.num_layers));
    int64_t kda_slot = 0, mla_slot = 0;
    for (int64_t l = 0; l < c_.num_layers; ++l) {
      DeviceLayer& layer = w.layers[static_cast<size_t>(l)];
      const LayerWeights* hl = host_ ? &host_->layers.at(static_cast<size_t>(l)) : nullptr;
      const std::string p = prefix + "layers." + std::to_string(l) + ".";
      layer.kind = c_.layer_kinds[static_cast<size_t>(l)];
      layer.slot = layer.kind == LayerKind::kKda ? kda_slot++ : mla_slot++;
      layer.is_moe = c_.is_moe_layer(l);
      layer.input_norm = vec(p + "input_layernorm.weight", {hidden}, true, hl ? &hl->input_norm : nullptr);
      if (layer.kind == LayerKind::kKda) {
        kda(p + "self_attn.", layer.kda, hl ? &hl->kda : nullptr);
      } else {
        mla(p + "self_attn.", layer.mla, hl ? &hl->mla : nullptr);
      }
      layer.post_attention_norm =
          vec(p + "post_attention_layernorm.weight", {hidden}, true, hl ? &hl->post_attention_norm : nullptr);
      if (layer.is_moe) {
        moe(p + "block_sparse_moe.", layer.moe, hl ? &hl->moe : nullptr);
      } else {
        ffn(p + "mlp.", "gate_proj.weight", "up_proj.weight", "down_proj.weight", hidden, c_.intermediate_size,
            layer.dense, hl ? &hl->dense : nullptr);
      }
      if (c_.attn_res_block_size) {
        attn_res(p, "self_attention_res", layer.attention_res, hl ? &hl->attention_res : nullptr);
        attn_res(p, "mlp_res", layer.mlp_res, hl ? &hl->mlp_res : nullptr);
      }
    }
    w.final_norm = vec(prefix + "norm.weight", {hidden}, true, host_ ? &host_->final_norm : nullptr);
    if (c_.attn_res_block_size) attn_res(prefix, "output_attn_res", w.output_res, host_ ? &host_->output_res : nullptr);
    if (c_.tie_word_embeddings) {
      w.lm_head = w.embed_tokens;
    } else {
      w.lm_head = alloc<bf16>(c_.vocab_size * hidden, "lm_head");
      place(c_.lm_head_name(), {c_.vocab_size, hidden}, false, w.lm_head, host_ ? &host_->lm_head : nullptr);
    }
    w.bytes = bytes_;
    return status_;
  }

  std::vector<Placement>& placements() { return placements_; }
  int64_t bytes() const { return bytes_; }
  void set_measure_only() { measure_only_ = true; }

 private:
  template <class T>
  T* alloc(int64_t count, const std::string& what) {
    const auto bytes = static_cast<size_t>(count) * sizeof(T);
    bytes_ += static_cast<int64_t>(bytes);
    if (measure_only_ || !status_.is_ok() || count == 0) return nullptr;
    DeviceMemory memory;
    status_ = memory.allocate(bytes, "weight " + what);
    if (!status_.is_ok()) return nullptr;
    T* data = memory.as<T>();
    w_->memory.push_back(std::move(memory));
    return data;
  }
  void place(std::string name, std::vector<int64_t> shape, bool is_norm, void* dst, const Tensor* host,
             bool as_bf16 = true) {
    placements_.push_back({std::move(name), std::move(shape), is_norm, dst, as_bf16, host});
  }
  // An fp32 vector/small tensor of its own.
  float* vec(const std::string& name, std::vector<int64_t> shape, bool is_norm, const Tensor* host) {
    float* data = alloc<float>(product(shape), name);
    place(name, std::move(shape), is_norm, data, host, false);
    return data;
  }
  template <class T>
  static T* offset(T* base, int64_t elements) {
    return base == nullptr ? nullptr : base + elements;
  }

  void kda(const std::string& p, DeviceKda& w, const KdaWeights* h) {
    const int64_t heads = c_.kda.num_heads, d = c_.kda.head_dim, hd = heads * d, k = c_.kda.conv_kernel_size;
    const int64_t hidden = c_.hidden_size, rank = d;
    w.qkv = alloc<bf16>(3 * hd * hidden, p + "qkv");
    place(p + "q_proj.weight", {hd, hidden}, false, w.qkv, h ? &h->q_proj : nullptr);
    place(p + "k_proj.weight", {hd, hidden}, false, offset(w.qkv, hd * hidden), h ? &h->k_proj : nullptr);
    place(p + "v_proj.weight", {hd, hidden}, false, offset(w.qkv, 2 * hd * hidden), h ? &h->v_proj : nullptr);
    w.q_conv = vec(p + "q_conv1d.weight", {hd, 1, k}, false, h ? &h->q_conv : nullptr);
    w.k_conv = vec(p + "k_conv1d.weight", {hd, 1, k}, false, h ? &h->k_conv : nullptr);
    w.v_conv = vec(p + "v_conv1d.weight", {hd, 1, k}, false, h ? &h->v_conv : nullptr);
    w.a_log = vec(p + "A_log", {1, 1, heads, 1}, false, h ? &h->a_log : nullptr);
    w.dt_bias = vec(p + "dt_bias", {hd}, false, h ? &h->dt_bias : nullptr);
    const bool low_rank_gate = !c_.kda.full_rank_output_gate;
    w.fg_a = alloc<bf16>((low_rank_gate ? 2 : 1) * rank * hidden, p + "f_a/g_a");
    place(p + "f_a_proj.weight", {rank, hidden}, false, w.fg_a, h ? &h->f_a : nullptr);
    w.f_b = alloc<bf16>(hd * rank, p + "f_b_proj");
    place(p + "f_b_proj.weight", {hd, rank}, false, w.f_b, h ? &h->f_b : nullptr);
    w.b_proj = alloc<bf16>(heads * hidden, p + "b_proj");
    place(p + "b_proj.weight", {heads, hidden}, false, w.b_proj, h ? &h->b_proj : nullptr);
    if (low_rank_gate) {
      place(p + "g_a_proj.weight", {rank, hidden}, false, offset(w.fg_a, rank * hidden), h ? &h->g_a : nullptr);
      w.g_b = alloc<bf16>(hd * rank, p + "g_b_proj");
      place(p + "g_b_proj.weight", {hd, rank}, false, w.g_b, h ? &h->g_b : nullptr);
    } else {
      w.g_proj = alloc<bf16>(hd * hidden, p + "g_proj");
      place(p + "g_proj.weight", {hd, hidden}, false, w.g_proj, h ? &h->g_proj : nullptr);
    }
    w.o_norm = vec(p + "o_norm.weight", {d}, true, h ? &h->o_norm : nullptr);
    w.o_proj = alloc<bf16>(hidden * hd, p + "o_proj");
    place(p + "o_proj.weight", {hidden, hd}, false, w.o_proj, h ? &h->o_proj : nullptr);
  }

  void mla(const std::string& p, DeviceMla& w, const MlaWeights* h) {
    const MlaConfig& m = c_.mla;
    const int64_t heads = m.num_heads, hidden = c_.hidden_size, width = m.cache_width();
    const int64_t q_lora = m.q_lora_rank.value_or(0);
    w.qa_kva = alloc<bf16>((q_lora + width) * hidden, p + "q_a/kv_a");
    if (m.q_lora_rank) {
      place(p + "q_a_proj.weight", {q_lora, hidden}, false, w.qa_kva, h ? &h->q_a_proj : nullptr);
      w.q_a_norm = vec(p + "q_a_layernorm.weight", {q_lora}, true, h ? &h->q_a_norm : nullptr);
      w.q_b = alloc<bf16>(heads * m.qk_head_dim() * q_lora, p + "q_b_proj");
      place(p + "q_b_proj.weight", {heads * m.qk_head_dim(), q_lora}, false, w.q_b, h ? &h->q_b_proj : nullptr);
    } else {
      w.q_proj = alloc<bf16>(heads * m.qk_head_dim() * hidden, p + "q_proj");
      place(p + "q_proj.weight", {heads * m.qk_head_dim(), hidden}, false, w.q_proj, h ? &h->q_proj : nullptr);
    }
    place(p + "kv_a_proj_with_mqa.weight", {width, hidden}, false, offset(w.qa_kva, q_lora * hidden),
          h ? &h->kv_a_proj : nullptr);
    w.kv_a_norm = vec(p + "kv_a_layernorm.weight", {m.kv_lora_rank}, true, h ? &h->kv_a_norm : nullptr);
    const int64_t kv_b_rows = heads * (m.qk_nope_head_dim + m.v_head_dim);
    w.kv_b = alloc<bf16>(kv_b_rows * m.kv_lora_rank, p + "kv_b_proj");
    place(p + "kv_b_proj.weight", {kv_b_rows, m.kv_lora_rank}, false, w.kv_b, h ? &h->kv_b_proj : nullptr);
    if (m.use_output_gate) {
      w.g_proj = alloc<bf16>(heads * m.v_head_dim * hidden, p + "g_proj");
      place(p + "g_proj.weight", {heads * m.v_head_dim, hidden}, false, w.g_proj, h ? &h->g_proj : nullptr);
    }
    w.o_proj = alloc<bf16>(hidden * heads * m.v_head_dim, p + "o_proj");
    place(p + "o_proj.weight", {hidden, heads * m.v_head_dim}, false, w.o_proj, h ? &h->o_proj : nullptr);
  }

  void ffn(const std::string& p, const std::string& gate, const std::string& up, const std::string& down, int64_t width,
           int64_t intermediate, DeviceFfn& w, const FfnWeights* h) {
    w.width = width;
    w.intermediate = intermediate;
    w.gate_up = alloc<bf16>(2 * intermediate * width, p + "gate_up");
    w.down = alloc<bf16>(width * intermediate, p + down);
    place(p + gate, {intermediate, width}, false, w.gate_up, h ? &h->gate : nullptr);
    place(p + up, {intermediate, width}, false, offset(w.gate_up, intermediate * width), h ? &h->up : nullptr);
    place(p + down, {width, intermediate}, false, w.down, h ? &h->down : nullptr);
  }

  void moe(const std::string& p, DeviceMoe& w, const MoeWeights* h) {
    const MoeConfig& m = c_.moe;
    const int64_t hidden = c_.hidden_size, experts = m.num_experts, inter = m.moe_intermediate_size;
    const int64_t width = m.routed_expert_hidden_size.value_or(hidden);
    w.width = width;
    w.intermediate = inter;
    w.router = vec(p + "gate.weight", {experts, hidden}, false, h ? &h->router : nullptr);
    w.correction_bias = vec(p + "gate.e_score_correction_bias", {experts}, false, h ? &h->correction_bias : nullptr);
    if (m.routed_expert_hidden_size) {
      w.latent_down = alloc<bf16>(width * hidden, p + "routed_expert_down_proj");
      place(p + "routed_expert_down_proj.weight", {width, hidden}, false, w.latent_down, h ? &h->latent_down : nullptr);
      if (m.latent_moe_use_norm) {
        w.latent_norm = vec(p + "routed_expert_norm.weight", {width}, true, h ? &h->latent_norm : nullptr);
      }
      w.latent_up = alloc<bf16>(hidden * width, p + "routed_expert_up_proj");
      place(p + "routed_expert_up_proj.weight", {hidden, width}, false, w.latent_up, h ? &h->latent_up : nullptr);
    }
    w.experts_gate_up = alloc<bf16>(experts * 2 * inter * width, p + "experts gate/up");
    w.experts_down = alloc<bf16>(experts * width * inter, p + "experts down");
    for (int64_t e = 0; e < experts; ++e) {
      const std::string q = p + "experts." + std::to_string(e) + ".";
      const FfnWeights* he = h ? &h->experts.at(static_cast<size_t>(e)) : nullptr;
      bf16* gate_up = offset(w.experts_gate_up, e * 2 * inter * width);
      place(q + "w1.weight", {inter, width}, false, gate_up, he ? &he->gate : nullptr);
      place(q + "w3.weight", {inter, width}, false, offset(gate_up, inter * width), he ? &he->up : nullptr);
      place(q + "w2.weight", {width, inter}, false, offset(w.experts_down, e * width * inter),
            he ? &he->down : nullptr);
    }
    if (m.num_shared_experts > 0) {
      ffn(p + "shared_experts.", "gate_proj.weight", "up_proj.weight", "down_proj.weight", hidden,
          m.num_shared_experts * inter, w.shared, h ? &h->shared : nullptr);
    }
  }

  void attn_res(const std::string& p, const std::string& name, DeviceAttnRes& w, const AttnResWeights* h) {
    const int64_t hidden = c_.hidden_size;
    w.norm = vec(p + name + "_norm.weight", {hidden}, true, h ? &h->norm : nullptr);
    w.proj = vec(p + name + "_proj.weight", {1, hidden}, false, h ? &h->proj : nullptr);
  }

  const ModelConfig& c_;
  const ModelWeights* host_;
  DeviceWeights* w_;
  bool measure_only_ = false;
  Status status_;
  int64_t bytes_ = 0;
  std::vector<Placement> placements_;
};

uint64_t name_seed(uint64_t seed, const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull ^ seed;  // FNV-1a over the name, keyed by the seed (as make-model)
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// Copies fp32 host values to the device, converting to bf16 through a device staging buffer in pieces.
class Uploader {
 public:
  explicit Uploader(cudaStream_t stream) : stream_(stream) {}
  Status upload(const float* host, int64_t n, void* dst, bool as_bf16) {
    if (n == 0) return Status::ok();
    if (!as_bf16) {
      DS_CUDA_RETURN(
          cudaMemcpyAsync(dst, host, static_cast<size_t>(n) * sizeof(float), cudaMemcpyHostToDevice, stream_));
      return Status::ok();
    }
    if (staging_.data() == nullptr) DS_RETURN_IF_ERROR(staging_.allocate(kStagingFloats * sizeof(float), "staging"));
    for (int64_t begin = 0; begin < n; begin += kStagingFloats) {
      const int64_t count = std::min(kStagingFloats, n - begin);
      // The staging buffer is reused: the previous conversion must have read it (same stream: ordered).
      DS_CUDA_RETURN(cudaMemcpyAsync(staging_.data(), host + begin, static_cast<size_t>(count) * sizeof(float),
                                     cudaMemcpyHostToDevice, stream_));
      DS_RETURN_IF_ERROR(kc::to_bf16(staging_.as<float>(), count, static_cast<bf16*>(dst) + begin, stream_));
    }
    return Status::ok();
  }

 private:
  static constexpr int64_t kStagingFloats = int64_t{16} << 20;  // 64 MiB
  cudaStream_t stream_;
  DeviceMemory staging_;
};

Status fill_random(const Placement& p, uint64_t seed, cudaStream_t stream) {
  const int64_t n = product(p.shape);
  const uint64_t s = name_seed(seed, p.name);
  const std::string& name = p.name;
  auto normal = [&](float mean, float stddev) {
    return random_fill(p.dst, p.as_bf16, n, s, RandomLaw::kNormal, mean, stddev, stream);
  };
  if (p.is_norm) return normal(1.0f, 0.1f);
  if (name.ends_with("A_log")) return random_fill(p.dst, p.as_bf16, n, s, RandomLaw::kLog1p15Uniform, 0, 0, stream);
  if (name.ends_with("dt_bias")) return normal(-2.0f, 1.0f);
  if (name.ends_with("e_score_correction_bias")) return normal(0.0f, 0.1f);
  if (name.ends_with("conv1d.weight")) return normal(0.0f, 0.5f);
  if (name.find("embed_tokens") != std::string::npos) return normal(0.0f, 1.0f);
  const double fan_in = p.shape.empty() ? 1.0 : static_cast<double>(p.shape.back());
  return normal(0.0f, static_cast<float>(1.0 / std::sqrt(fan_in)));
}

Status fill_from_checkpoint(const Placement& p, const Checkpoint& checkpoint, Uploader& uploader, cudaStream_t stream) {
  const std::string& name = p.name;
  std::vector<int64_t> shape = p.shape;
  const TensorView* view = checkpoint.find(name);
  if (view == nullptr) {
    const std::string stem = name.substr(0, name.size() - std::string("weight").size());
    if (name.ends_with(".weight") && checkpoint.find(stem + "weight_packed") != nullptr) {
      return unimplemented("tensor '" + stem +
                           "weight_packed': MXFP4-packed weights are not supported yet; convert the checkpoint to "
                           "bf16 or fp8 block-quantised weights");
    }
    if (name.ends_with("e_score_correction_bias")) {  // absent: zeros (as the CPU loader)
      DS_CUDA_RETURN(cudaMemsetAsync(p.dst, 0, static_cast<size_t>(product(shape)) * sizeof(float), stream));
      return Status::ok();
    }
  }
  if (view != nullptr && name.ends_with("A_log") && view->shape.size() == 1) shape = {shape[2]};
  DS_ASSIGN_OR_RETURN(std::vector<float> values, checkpoint.read_f32(name, shape));
  DS_RETURN_IF_ERROR(uploader.upload(values.data(), static_cast<int64_t>(values.size()), p.dst, p.as_bf16));
  // The host copy is freed on return: pageable cudaMemcpyAsync has staged it already.
  return Status::ok();
}

// The walker's tensors must be exactly those the CPU loader expects (same names and shapes).
Status check_against_expected(const ModelConfig& config, const std::vector<Placement>& placements) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> mine, expected;
  for (const Placement& p : placements) mine.emplace_back(p.name, p.shape);
  for (const TensorSpec& spec : expected_tensors(config)) expected.emplace_back(spec.name, spec.shape);
  std::sort(mine.begin(), mine.end());
  std::sort(expected.begin(), expected.end());
  if (mine == expected) return Status::ok();
  for (size_t i = 0; i < std::max(mine.size(), expected.size()); ++i) {
    const std::string a = i < mine.size() ? mine[i].first : "(none)";
    const std::string b = i < expected.size() ? expected[i].first : "(none)";
    if (i >= mine.size() || i >= expected.size() || mine[i] != expected[i]) {
      return internal_error("CUDA weight layout disagrees with expected_tensors(): '" + a + "' vs '" + b + "'");
    }
  }
  return internal_error("CUDA weight layout disagrees with expected_tensors()");
}

}  // namespace

int64_t device_weight_bytes(const ModelConfig& config) {
  DeviceWeights scratch;
  Walker walker(config, nullptr, &scratch);
  walker.set_measure_only();
  (void)walker.run();
  return walker.bytes();
}

Result<std::unique_ptr<DeviceWeights>> load_device_weights(const ModelConfig& config, const WeightSource& source,
                                                           cudaStream_t stream) {
  const int sources = (source.host ? 1 : 0) + (source.checkpoint ? 1 : 0) + (source.random_seed ? 1 : 0);
  if (sources != 1) return internal_error("load_device_weights: exactly one weight source expected");
  if (source.host && source.host->layers.size() != static_cast<size_t>(config.num_layers)) {
    return invalid_argument("host weights have " + std::to_string(source.host->layers.size()) + " layers, the config " +
                            std::to_string(config.num_layers));
  }
  auto weights = std::make_unique<DeviceWeights>();
  Walker walker(config, source.host, weights.get());
  DS_RETURN_IF_ERROR(walker.run());
  DS_RETURN_IF_ERROR(check_against_expected(config, walker.placements()));

  Uploader uploader(stream);
  const int64_t total = walker.bytes();
  int64_t done = 0;
  for (const Placement& p : walker.placements()) {
    const int64_t n = product(p.shape);
    if (source.host) {
      if (p.host == nullptr || static_cast<int64_t>(p.host->size()) != n) {
        return invalid_argument("host tensor '" + p.name + "' has " + std::to_string(p.host ? p.host->size() : 0) +
                                " values, expected " + std::to_string(n));
      }
      DS_RETURN_IF_ERROR_CTX(uploader.upload(p.host->data(), n, p.dst, p.as_bf16), "tensor '" + p.name + "'");
    } else if (source.checkpoint) {
      DS_RETURN_IF_ERROR(fill_from_checkpoint(p, *source.checkpoint, uploader, stream));
    } else {
      DS_RETURN_IF_ERROR_CTX(fill_random(p, *source.random_seed, stream), "tensor '" + p.name + "'");
    }
    done += n * (p.as_bf16 ? 2 : 4);
    if (source.progress) source.progress(done, total);
  }
  if (source.checkpoint) {
    const std::vector<std::string> ignored = {"vision_tower.", "multi_modal_projector.", "mm_projector.",
                                              "language_model.model.mtp", "model.mtp"};
    const std::vector<std::string> unused = source.checkpoint->unused_tensors(ignored);
    if (!unused.empty()) {
      return invalid_argument("checkpoint holds tensors the config does not describe, e.g. '" + unused[0] + "' (" +
                              std::to_string(unused.size()) + " in all)");
    }
  }
  DS_CUDA_RETURN(cudaStreamSynchronize(stream));
  return weights;
}

}  // namespace deltaserve::engine::cuda
