#include "engine/model.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "engine/checkpoint/safetensors.hpp"
#include "kernels/cpu/attn_res.hpp"
#include "kernels/cpu/basic_ops.hpp"
#include "kernels/cpu/kda.hpp"
#include "kernels/cpu/mla.hpp"
#include "kernels/cpu/moe.hpp"
#include "kernels/cpu/thread_pool.hpp"

namespace deltaserve::engine {

namespace cpu = kernels::cpu;

namespace {

constexpr float kL2NormEps = 1e-6f;

void add_inplace(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

}  // namespace

// Row ranges of the sequences inside the flattened [rows, hidden] batch.
struct Model::Batch {
  std::span<SequenceInput> sequences;
  std::vector<int64_t> row_begin;  // [num_sequences + 1]
  int64_t rows() const { return row_begin.back(); }
};

Model::Model(ModelConfig config, ModelWeights weights) : config_(std::move(config)), weights_(std::move(weights)) {
  int64_t kda = 0, mla = 0;
  for (LayerKind kind : config_.layer_kinds) layer_slot_.push_back(kind == LayerKind::kKda ? kda++ : mla++);
}

Model::Model(ModelConfig config, std::shared_ptr<Backend> backend) : Model(std::move(config), ModelWeights{}) {
  backend_ = std::move(backend);
}

Result<std::unique_ptr<Model>> Model::load(const std::filesystem::path& directory) {
  DS_ASSIGN_OR_RETURN(ModelConfig config, load_model_config(directory));
  DS_ASSIGN_OR_RETURN_CTX(std::unique_ptr<Checkpoint> checkpoint, Checkpoint::open(directory),
                          "checkpoint " + directory.string());
  DS_ASSIGN_OR_RETURN_CTX(ModelWeights weights, load_model_weights(*checkpoint, config),
                          "checkpoint " + directory.string());
  return std::make_unique<Model>(std::move(config), std::move(weights));
}

void Model::run_dense_ffn(const FfnWeights& ffn, const float* x, float* out, int64_t rows) const {
  std::vector<float> gate(static_cast<size_t>(rows * ffn.intermediate));
  std::vector<float> up(gate.size());
  cpu::linear(x, ffn.gate.data(), gate.data(), rows, ffn.width, ffn.intermediate);
  cpu::linear(x, ffn.up.data(), up.data(), rows, ffn.width, ffn.intermediate);
  const auto n = static_cast<int64_t>(gate.size());
  if (config_.hidden_act == Activation::kSitu) {
    cpu::situ_glu(gate.data(), up.data(), gate.data(), n, config_.situ_beta, config_.situ_linear_beta);
  } else {
    cpu::swiglu(gate.data(), up.data(), gate.data(), n);
  }
  cpu::linear(gate.data(), ffn.down.data(), out, rows, ffn.intermediate, ffn.width);
}

void Model::run_moe(const MoeWeights& moe, const float* x, float* out, int64_t rows) const {
  const MoeConfig& mc = config_.moe;
  const int64_t hidden = config_.hidden_size;
  const int64_t experts = mc.num_experts, top_k = mc.num_experts_per_token;

  // Router on the full-width x, fp32.
  std::vector<float> router_logits(static_cast<size_t>(rows * experts));
  cpu::linear(x, moe.router.data(), router_logits.data(), rows, hidden, experts);
  std::vector<int32_t> chosen(static_cast<size_t>(rows * top_k));
  std::vector<float> chosen_weight(chosen.size());
  const cpu::MoeRouting routing{experts,         top_k,          mc.num_expert_groups,
                                mc.top_k_groups, mc.renormalize, mc.routed_scaling_factor};
  for (int64_t r = 0; r < rows; ++r) {
    cpu::moe_route(routing, &router_logits[static_cast<size_t>(r * experts)], moe.correction_bias.data(),
                   &chosen[static_cast<size_t>(r * top_k)], &chosen_weight[static_cast<size_t>(r * top_k)]);
  }

  // LatentMoE: experts work on h = down(x) in the narrower latent space.
  const bool latent = mc.routed_expert_hidden_size.has_value();
  const int64_t width = mc.routed_expert_hidden_size.value_or(hidden);
  std::vector<float> latent_x;
  const float* expert_input = x;
  if (latent) {
    latent_x.resize(static_cast<size_t>(rows * width));
    cpu::linear(x, moe.latent_down.data(), latent_x.data(), rows, hidden, width);
    expert_input = latent_x.data();
  }

  // Group rows by expert; each expert runs once over its rows (gather → FFN → weighted scatter-add).
  std::vector<std::vector<std::pair<int64_t, float>>> assigned(static_cast<size_t>(experts));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < top_k; ++k) {
      const auto i = static_cast<size_t>(r * top_k + k);
      assigned[static_cast<size_t>(chosen[i])].emplace_back(r, chosen_weight[i]);
    }
  }
  std::vector<float> routed(static_cast<size_t>(rows * width), 0.0f);
  std::vector<float> gathered, expert_out;
  for (int64_t e = 0; e < experts; ++e) {
    const auto& list = assigned[static_cast<size_t>(e)];
    if (list.empty()) continue;
    const auto n = static_cast<int64_t>(list.size());
    gathered.resize(static_cast<size_t>(n * width));
    expert_out.resize(gathered.size());
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(&gathered[static_cast<size_t>(i * width)], expert_input + list[static_cast<size_t>(i)].first * width,
                  sizeof(float) * static_cast<size_t>(width));
    }
    run_dense_ffn(moe.experts[static_cast<size_t>(e)], gathered.data(), expert_out.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const auto [row, weight] = list[static_cast<size_t>(i)];
      float* dst = &routed[static_cast<size_t>(row * width)];
      const float* src = &expert_out[static_cast<size_t>(i * width)];
      for (int64_t d = 0; d < width; ++d) dst[d] += weight * src[d];
    }
  }

  if (latent) {
    if (mc.latent_moe_use_norm) {
      cpu::rms_norm(routed.data(), moe.latent_norm.data(), routed.data(), rows, width, config_.rms_norm_eps);
    }
    cpu::linear(routed.data(), moe.latent_up.data(), out, rows, width, hidden);
  } else {
    std::copy(routed.begin(), routed.end(), out);
  }

  if (mc.num_shared_experts > 0) {
    std::vector<float> shared(static_cast<size_t>(rows * hidden));
    run_dense_ffn(moe.shared, x, shared.data(), rows);
    add_inplace(out, shared.data(), rows * hidden);
  }
}

void Model::run_ffn(const LayerWeights& layer, const float* x, float* out, int64_t rows) const {
  if (layer.is_moe) {
    run_moe(layer.moe, x, out, rows);
  } else {
    run_dense_ffn(layer.dense, x, out, rows);
  }
}

void Model::run_kda(const LayerWeights& layer, int64_t slot, const float* x, float* out, Batch& batch,
                    const ForwardOptions& options) const {
  const KdaWeights& w = layer.kda;
  const int64_t rows = batch.rows(), hidden = config_.hidden_size;
  const int64_t heads = config_.kda.num_heads, d = config_.kda.head_dim, channels = heads * d;
  const int64_t kernel = config_.kda.conv_kernel_size, rank = d;
  const auto size = static_cast<size_t>(rows * channels);

  std::vector<float> q_in(size), k_in(size), v_in(size);
  cpu::linear(x, w.q_proj.data(), q_in.data(), rows, hidden, channels);
  cpu::linear(x, w.k_proj.data(), k_in.data(), rows, hidden, channels);
  cpu::linear(x, w.v_proj.data(), v_in.data(), rows, hidden, channels);

  // Decay gate (low rank) and beta, over all rows.
  std::vector<float> low(static_cast<size_t>(rows * rank)), gate_raw(size), g(size);
  cpu::linear(x, w.f_a.data(), low.data(), rows, hidden, rank);
  cpu::linear(low.data(), w.f_b.data(), gate_raw.data(), rows, rank, channels);
  cpu::kda_gate(gate_raw.data(), w.a_log.data(), w.dt_bias.data(), g.data(), rows, heads, d,
                config_.kda.gate_lower_bound);
  std::vector<float> beta(static_cast<size_t>(rows * heads));
  cpu::linear(x, w.b_proj.data(), beta.data(), rows, hidden, heads);
  cpu::sigmoid_inplace(beta.data(), rows * heads);

  // Output gate.
  std::vector<float> out_gate(size);
  if (config_.kda.full_rank_output_gate) {
    cpu::linear(x, w.g_proj.data(), out_gate.data(), rows, hidden, channels);
  } else {
    cpu::linear(x, w.g_a.data(), low.data(), rows, hidden, rank);
    cpu::linear(low.data(), w.g_b.data(), out_gate.data(), rows, rank, channels);
  }

  // Per sequence: short conv with the request's tails, then the recurrence with its state.
  std::vector<float> q(size), k(size), v(size), o(size);
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    KdaLayerState& state = batch.sequences[s].state->kda[static_cast<size_t>(slot)];
    const int64_t begin = batch.row_begin[s], tokens = batch.row_begin[s + 1] - begin;
    const auto offset = static_cast<size_t>(begin * channels);
    cpu::short_conv_silu(&q_in[offset], w.q_conv.data(), state.conv_q.data(), &q[offset], tokens, channels, kernel);
    cpu::short_conv_silu(&k_in[offset], w.k_conv.data(), state.conv_k.data(), &k[offset], tokens, channels, kernel);
    cpu::short_conv_silu(&v_in[offset], w.v_conv.data(), state.conv_v.data(), &v[offset], tokens, channels, kernel);
    cpu::l2_normalize_heads(&q[offset], tokens, heads, d, kL2NormEps, 1.0f / std::sqrt(static_cast<float>(d)));
    cpu::l2_normalize_heads(&k[offset], tokens, heads, d, kL2NormEps, 1.0f);
    const cpu::KdaInputs inputs{
        &q[offset], &k[offset], &v[offset], &g[offset], &beta[static_cast<size_t>(begin * heads)], tokens, heads, d, d};
    if (tokens == 1) {
      cpu::kda_recurrent(inputs, state.recurrent.data(), &o[offset]);
    } else {
      cpu::kda_chunked(inputs, state.recurrent.data(), &o[offset], options.kda_chunk_size);
    }
  }

  cpu::kda_gated_output_norm(o.data(), out_gate.data(), w.o_norm.data(), o.data(), rows, heads, d,
                             config_.rms_norm_eps);
  cpu::linear(o.data(), w.o_proj.data(), out, rows, channels, hidden);
}

void Model::run_mla(const LayerWeights& layer, int64_t slot, const float* x, float* out, Batch& batch) const {
  const MlaWeights& w = layer.mla;
  const MlaConfig& m = config_.mla;
  const int64_t rows = batch.rows(), hidden = config_.hidden_size, heads = m.num_heads;
  const int64_t q_width = heads * m.qk_head_dim(), width = m.cache_width(), v_width = heads * m.v_head_dim;

  std::vector<float> q(static_cast<size_t>(rows * q_width));
  if (m.q_lora_rank) {
    const int64_t rank = *m.q_lora_rank;
    std::vector<float> low(static_cast<size_t>(rows * rank));
    cpu::linear(x, w.q_a_proj.data(), low.data(), rows, hidden, rank);
    cpu::rms_norm(low.data(), w.q_a_norm.data(), low.data(), rows, rank, config_.rms_norm_eps);
    cpu::linear(low.data(), w.q_b_proj.data(), q.data(), rows, rank, q_width);
  } else {
    cpu::linear(x, w.q_proj.data(), q.data(), rows, hidden, q_width);
  }

  // New cache rows: [kv_a_layernorm(latent) ‖ k_rot]; NoPE: k_rot is stored as projected, never rotated.
  std::vector<float> kv(static_cast<size_t>(rows * width));
  cpu::linear(x, w.kv_a_proj.data(), kv.data(), rows, hidden, width);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = &kv[static_cast<size_t>(r * width)];
    cpu::rms_norm(row, w.kv_a_norm.data(), row, 1, m.kv_lora_rank, config_.rms_norm_eps);
  }

  const cpu::MlaDims dims{heads,        m.kv_lora_rank,   m.qk_nope_head_dim, m.qk_rope_head_dim,
                          m.v_head_dim, m.softmax_scale()};
  std::vector<float> attention(static_cast<size_t>(rows * v_width));
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    MlaLayerCache& cache = batch.sequences[s].state->mla[static_cast<size_t>(slot)];
    const int64_t begin = batch.row_begin[s], tokens = batch.row_begin[s + 1] - begin;
    const int64_t first_position = cache.num_tokens();
    cache.append({&kv[static_cast<size_t>(begin * width)], static_cast<size_t>(tokens * width)});
    const float* query = &q[static_cast<size_t>(begin * q_width)];
    float* result = &attention[static_cast<size_t>(begin * v_width)];
    if (tokens == 1) {
      cpu::mla_attention_absorbed(dims, query, tokens, first_position, cache.rows(), width, cache.num_tokens(),
                                  w.kv_b_proj.data(), result);
    } else {
      cpu::mla_attention_naive(dims, query, tokens, first_position, cache.rows(), width, cache.num_tokens(),
                               w.kv_b_proj.data(), result);
    }
  }

  if (m.use_output_gate) {
    std::vector<float> gate(attention.size());
    cpu::linear(x, w.g_proj.data(), gate.data(), rows, hidden, v_width);
    cpu::sigmoid_inplace(gate.data(), static_cast<int64_t>(gate.size()));
    for (size_t i = 0; i < gate.size(); ++i) attention[i] *= gate[i];
  }
  cpu::linear(attention.data(), w.o_proj.data(), out, rows, v_width, hidden);
}

Status Model::check_batch(std::span<SequenceInput> sequences) const {
  for (size_t s = 0; s < sequences.size(); ++s) {
    const SequenceInput& in = sequences[s];
    const std::string where = "sequence " + std::to_string(s);
    if (in.state == nullptr) return invalid_argument(where + ": no request state");
    if (in.tokens.empty()) return invalid_argument(where + ": no tokens");
    if (in.state->kda.size() != static_cast<size_t>(config_.num_layers_of(LayerKind::kKda)) ||
        in.state->mla.size() != static_cast<size_t>(config_.num_layers_of(LayerKind::kMla))) {
      return invalid_argument(where + ": request state was made for another model");
    }
    for (size_t t = 0; t < in.tokens.size(); ++t) {
      if (in.tokens[t] < 0 || in.tokens[t] >= config_.vocab_size) {
        return invalid_argument(where + ": token id " + std::to_string(in.tokens[t]) + " at index " +
                                std::to_string(t) + " is outside the vocabulary [0, " +
                                std::to_string(config_.vocab_size) + ")");
      }
    }
    const int64_t length = in.state->num_tokens() + static_cast<int64_t>(in.tokens.size());
    if (config_.max_position_embeddings > 0 && length > config_.max_position_embeddings) {
      return out_of_range(where + ": " + std::to_string(length) + " tokens exceed the context limit of " +
                          std::to_string(config_.max_position_embeddings));
    }
  }
  return Status::ok();
}

Status Model::forward_sample(std::span<SequenceInput> sequences, std::span<const SampleRequest> rows,
                             std::vector<SampledToken>& out, const ForwardOptions& options) const {
  DS_RETURN_IF_ERROR(check_sample_rows(sequences, rows));
  if (backend_) {
    DS_RETURN_IF_ERROR(check_batch(sequences));
    return backend_->forward_sample(sequences, rows, out, options);
  }
  std::vector<std::vector<float>> logits;
  DS_RETURN_IF_ERROR(forward(sequences, logits, options));
  sample_rows(logits, rows, out);
  return Status::ok();
}

Status Model::forward(std::span<SequenceInput> sequences, std::vector<std::vector<float>>& logits,
                      const ForwardOptions& options) const {
  DS_RETURN_IF_ERROR(check_batch(sequences));
  Batch batch{sequences, {0}};
  for (const SequenceInput& in : sequences) {
    batch.row_begin.push_back(batch.row_begin.back() + static_cast<int64_t>(in.tokens.size()));
  }
  if (backend_) return backend_->forward(sequences, logits, options);
  // The CPU computes on the host copy: bring a device-resident state home first (its device copy is dropped).
  for (const SequenceInput& in : sequences) {
    if (in.state->residency() == nullptr) continue;
    DS_RETURN_IF_ERROR(in.state->sync_host());
    in.state->drop_device();
  }
  const int64_t rows = batch.rows(), hidden = config_.hidden_size;
  const auto size = static_cast<size_t>(rows * hidden);

  // Embeddings.
  std::vector<float> residual(size);
  for (size_t s = 0; s < sequences.size(); ++s) {
    for (size_t t = 0; t < sequences[s].tokens.size(); ++t) {
      const int64_t row = batch.row_begin[s] + static_cast<int64_t>(t);
      std::memcpy(&residual[static_cast<size_t>(row * hidden)],
                  &weights_.embed_tokens[static_cast<size_t>(sequences[s].tokens[t] * hidden)],
                  sizeof(float) * static_cast<size_t>(hidden));
    }
  }

  const float eps = config_.rms_norm_eps;
  std::vector<float> normed(size), branch(size);
  auto attention = [&](int64_t l, const float* input) {
    const LayerWeights& layer = weights_.layers[static_cast<size_t>(l)];
    cpu::rms_norm(input, layer.input_norm.data(), normed.data(), rows, hidden, eps);
    if (layer.kind == LayerKind::kKda) {
      run_kda(layer, layer_slot(l), normed.data(), branch.data(), batch, options);
    } else {
      run_mla(layer, layer_slot(l), normed.data(), branch.data(), batch);
    }
  };
  auto ffn = [&](int64_t l, const float* input) {
    const LayerWeights& layer = weights_.layers[static_cast<size_t>(l)];
    cpu::rms_norm(input, layer.post_attention_norm.data(), normed.data(), rows, hidden, eps);
    run_ffn(layer, normed.data(), branch.data(), rows);
  };

  std::vector<float> final_hidden(size);
  if (!config_.attn_res_block_size) {
    // Standard pre-norm residual stream.
    for (int64_t l = 0; l < config_.num_layers; ++l) {
      attention(l, residual.data());
      add_inplace(residual.data(), branch.data(), rows * hidden);
      ffn(l, residual.data());
      add_inplace(residual.data(), branch.data(), rows * hidden);
    }
    final_hidden = std::move(residual);
  } else {
    // Block Attention Residuals (model.md §2): `residual` is the running prefix of the current block.
    const int64_t block_size = *config_.attn_res_block_size;
    std::vector<std::vector<float>> blocks;
    std::vector<float> mixed(size);
    auto mix = [&](const AttnResWeights& w, float* result) {
      std::vector<const float*> sources;
      for (const auto& block : blocks) sources.push_back(block.data());
      sources.push_back(residual.data());
      cpu::attn_res_mix(sources.data(), static_cast<int64_t>(sources.size()), w.norm.data(), w.proj.data(), result,
                        rows, hidden, eps);
    };
    for (int64_t l = 0; l < config_.num_layers; ++l) {
      const LayerWeights& layer = weights_.layers[static_cast<size_t>(l)];
      if (blocks.empty()) {
        mixed = residual;
      } else {
        mix(layer.attention_res, mixed.data());
      }
      if (l % block_size == 0) {
        blocks.push_back(residual);
        std::fill(residual.begin(), residual.end(), 0.0f);
      }
      attention(l, mixed.data());
      add_inplace(residual.data(), branch.data(), rows * hidden);
      mix(layer.mlp_res, mixed.data());
      ffn(l, mixed.data());
      add_inplace(residual.data(), branch.data(), rows * hidden);
    }
    mix(weights_.output_res, final_hidden.data());
  }

  // LM head on the rows whose logits are wanted.
  logits.assign(sequences.size(), {});
  const int64_t vocab = config_.vocab_size;
  for (size_t s = 0; s < sequences.size(); ++s) {
    const int64_t end = batch.row_begin[s + 1];
    const int64_t first = sequences[s].all_logits ? batch.row_begin[s] : end - 1;
    const int64_t n = end - first;
    std::vector<float> normed_rows(static_cast<size_t>(n * hidden));
    cpu::rms_norm(&final_hidden[static_cast<size_t>(first * hidden)], weights_.final_norm.data(), normed_rows.data(), n,
                  hidden, eps);
    logits[s].resize(static_cast<size_t>(n * vocab));
    cpu::linear(normed_rows.data(), weights_.lm_head.data(), logits[s].data(), n, hidden, vocab);
    sequences[s].state->advance(static_cast<int64_t>(sequences[s].tokens.size()));
  }
  return Status::ok();
}

Result<std::vector<float>> Model::prefill(RequestState& state, std::span<const int32_t> tokens,
                                          int64_t chunk_tokens) const {
  if (tokens.empty()) return invalid_argument("prefill: no tokens");
  if (chunk_tokens <= 0) return invalid_argument("prefill: chunk_tokens must be positive");
  std::vector<std::vector<float>> logits;
  for (size_t begin = 0; begin < tokens.size(); begin += static_cast<size_t>(chunk_tokens)) {
    const size_t n = std::min(tokens.size() - begin, static_cast<size_t>(chunk_tokens));
    SequenceInput input{&state, tokens.subspan(begin, n), false};
    DS_RETURN_IF_ERROR(forward({&input, 1}, logits));
  }
  return std::move(logits[0]);
}

}  // namespace deltaserve::engine
