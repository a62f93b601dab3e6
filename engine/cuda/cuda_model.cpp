// The forward pass of CudaBackend in the order of the CPU reference (engine/model.cpp): validation, residencies
// (slots, pages, uploads), the per-pass tables, the layer loop (plain or Block AttnRes residuals) and the LM head.
// The layers themselves are in cuda_layers.cpp.
#include "engine/cuda/cuda_model.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <set>
#include <string>

#include "kernels/cuda/gemm/small_batch.hpp"
#include "kernels/cuda/kda/kda.hpp"
#include "kernels/cuda/kda/kda_generic.hpp"
#include "kernels/cuda/mla/mla.hpp"
#include "kernels/cuda/moe/moe.hpp"
#include "kernels/cuda/ops/ops.hpp"

namespace deltaserve::engine::cuda {

namespace kc = kernels::cuda;

namespace {

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Adds aligned sizes (the arena hands out 256-byte aligned pieces).
struct SizeSum {
  size_t total = 0;
  void add(int64_t bytes) { total += align_up(static_cast<size_t>(std::max<int64_t>(bytes, 0))); }
};

}  // namespace

size_t arena_bytes(const ModelConfig& c, int64_t R) {
  const int64_t hidden = c.hidden_size;
  SizeSum kda, mla, moe, dense;
  if (c.num_layers_of(LayerKind::kKda) > 0) {
    const int64_t H = c.kda.num_heads, d = c.kda.head_dim, C = H * d, r = d;
    kda.add(R * 3 * C * 2);                          // qkv
    kda.add(R * 2 * r * 2);                          // low rank (f_a ‖ g_a)
    kda.add(R * C * 4);                              // gate raw
    kda.add(R * C * 4);                              // output gate
    kda.add(R * H * 4);                              // beta
    kda.add(R * H * 4);                              // beta of a prefill group, realigned
    for (int i = 0; i < 3; ++i) kda.add(R * C * 4);  // q, k, v (fp32 on the generic path)
    kda.add(R * C * 4);                              // g (generic path)
    kda.add(R * C * 4);                              // o
    kda.add(R * C * 2);                              // gated output
  }
  if (c.num_layers_of(LayerKind::kMla) > 0) {
    const MlaConfig& m = c.mla;
    const int64_t H = m.num_heads, qr = m.q_lora_rank.value_or(0), width = m.cache_width();
    mla.add(R * H * m.qk_head_dim() * 2);
    mla.add(R * (qr + width) * 4);
    mla.add(R * qr * 2);
    mla.add(R * H * m.v_head_dim * 4);
    mla.add(R * H * m.v_head_dim * 4);
    mla.add(R * H * m.v_head_dim * 2);
  }
  dense.add(R * 2 * c.intermediate_size * 4);
  dense.add(R * c.intermediate_size * 2);
  if (c.moe.num_experts > 0) {
    const MoeConfig& m = c.moe;
    const int64_t E = m.num_experts, k = m.num_experts_per_token, I = m.moe_intermediate_size;
    const int64_t w = m.routed_expert_hidden_size.value_or(hidden), shared = m.num_shared_experts * I;
    moe.add(R * E * 4);
    moe.add(R * k * 4);
    moe.add(R * k * 4);
    moe.add((E + 1) * 4);
    moe.add(R * k * 4);
    moe.add(R * k * 4);
    moe.add(static_cast<int64_t>(kc::moe_plan_workspace_bytes(R, static_cast<int>(k), static_cast<int>(E))));
    moe.add(R * w * 2);
    moe.add(R * k * w * 2);
    moe.add(R * k * I * 2);
    moe.add(R * k * w * 4);
    moe.add(R * w * 4);
    moe.add(R * w * 2);
    moe.add(R * 2 * shared * 4);
    moe.add(R * shared * 2);
  }
  return std::max({kda.total, mla.total, moe.total, dense.total}) + 4096;
}

Status CudaBackend::Impl::arena_check(const char* where) const {
  if (arena.overflowed()) {
    return internal_error(std::string("scratch arena too small in ") + where + " (" + std::to_string(arena.capacity()) +
                          " bytes): the memory plan is wrong");
  }
  return Status::ok();
}

Status CudaBackend::Impl::ensure_mla_workspace(size_t bytes) {
  if (bytes <= mla_workspace.bytes()) return Status::ok();
  DS_CUDA_RETURN(cudaStreamSynchronize(stream()));
  decode_graphs.clear();  // they hold the old workspace's address
  return mla_workspace.allocate(align_up(bytes), "MLA attention workspace");
}

// ---- validation and residency ------------------------------------------------------------------------------

Status CudaBackend::Impl::validate(std::span<SequenceInput> batch) const {
  if (batch.empty()) return invalid_argument("empty batch");
  std::set<const RequestState*> seen;
  int64_t rows = 0;
  for (size_t s = 0; s < batch.size(); ++s) {
    const SequenceInput& in = batch[s];
    const std::string where = "sequence " + std::to_string(s);
    if (in.state == nullptr) return invalid_argument(where + ": no request state");
    if (in.tokens.empty()) return invalid_argument(where + ": no tokens");
    if (!seen.insert(in.state).second) return invalid_argument(where + ": the same request state appears twice");
    if (in.state->kda.size() != static_cast<size_t>(shape.kda_layers) ||
        in.state->mla.size() != static_cast<size_t>(shape.mla_layers)) {
      return invalid_argument(where + ": request state was made for another model");
    }
    for (int32_t token : in.tokens) {
      if (token < 0 || token >= config.vocab_size) {
        return invalid_argument(where + ": token id " + std::to_string(token) + " is outside the vocabulary");
      }
    }
    const int64_t length = in.state->num_tokens() + static_cast<int64_t>(in.tokens.size());
    if (config.max_position_embeddings > 0 && length > config.max_position_embeddings) {
      return out_of_range(where + ": " + std::to_string(length) + " tokens exceed the context limit of " +
                          std::to_string(config.max_position_embeddings));
    }
    rows += static_cast<int64_t>(in.tokens.size());
  }
  if (rows > max_rows) {
    return invalid_argument("batch of " + std::to_string(rows) +
                            " tokens exceeds the CUDA backend's max_batch_tokens " + std::to_string(max_rows) +
                            " (prefill in smaller chunks)");
  }
  return Status::ok();
}

namespace {

CudaResidency* ours(RequestState& state, const DevicePools* pools) {
  auto* residency = dynamic_cast<CudaResidency*>(state.mutable_residency());
  if (residency == nullptr || residency->pools() != pools) return nullptr;
  return residency;
}

}  // namespace

// Takes a slot for every sequence without one and the pages every sequence needs for its new tokens, uploads the
// host contents of newcomers and attaches their residencies. Checks availability first: when something is short,
// nothing is taken and no state changes.
Status CudaBackend::Impl::claim_residencies(std::span<SequenceInput> batch) {
  const int64_t page_tokens = pools->page_tokens();
  int64_t new_slots = 0, new_pages = 0;
  for (const SequenceInput& in : batch) {
    CudaResidency* residency = ours(*in.state, pools.get());
    if (residency == nullptr) ++new_slots;
    if (shape.mla_layers > 0) {
      const int64_t need = ceil_div(in.state->num_tokens() + static_cast<int64_t>(in.tokens.size()), page_tokens);
      const int64_t have = residency ? static_cast<int64_t>(residency->pages().size()) : 0;
      new_pages += std::max<int64_t>(0, need - have);
    }
  }
  if (new_slots > pools->free_slots()) {
    return Status(StatusCode::kResourceExhausted, "CUDA backend: no free KDA state slot (the batch needs " +
                                                      std::to_string(new_slots) + " new slots; " +
                                                      std::to_string(pools->free_slots()) + " of " +
                                                      std::to_string(pools->num_slots()) + " are free)");
  }
  if (new_pages > pools->free_pages()) {
    return Status(StatusCode::kResourceExhausted, "CUDA backend: MLA cache pages exhausted (the batch needs " +
                                                      std::to_string(new_pages) + " more pages of " +
                                                      std::to_string(page_tokens) + " tokens; " +
                                                      std::to_string(pools->free_pages()) + " of " +
                                                      std::to_string(pools->page_pool().num_pages) + " are free)");
  }
  for (const SequenceInput& in : batch) {
    RequestState& state = *in.state;
    CudaResidency* residency = ours(state, pools.get());
    std::unique_ptr<CudaResidency> fresh;
    if (residency == nullptr) {
      fresh = std::make_unique<CudaResidency>(pools, pools->take_slot());
      residency = fresh.get();
    }
    if (shape.mla_layers > 0) {
      const int64_t need = ceil_div(state.num_tokens() + static_cast<int64_t>(in.tokens.size()), page_tokens);
      while (static_cast<int64_t>(residency->pages().size()) < need) residency->pages().push_back(pools->take_page());
    }
    if (fresh) {
      DS_RETURN_IF_ERROR_CTX(pools->upload(state, fresh->slot(), fresh->pages()), "uploading a request state");
      state.attach_residency(std::move(fresh));
      state.set_host_stale(false);
    }
  }
  return Status::ok();
}

// ---- per-pass tables --------------------------------------------------------------------------------------

namespace {

// Appends `count` values of T to a byte buffer at a 16-byte aligned offset; returns the offset.
template <class T>
size_t append(std::vector<char>& buffer, const T* values, size_t count) {
  const size_t offset = align_up(buffer.size(), 16);
  buffer.resize(offset + count * sizeof(T));
  if (count > 0) std::memcpy(buffer.data() + offset, values, count * sizeof(T));
  return offset;
}

}  // namespace

Status CudaBackend::Impl::build_tables(std::span<SequenceInput> batch, PassTables& t, const DecodeGraphKey* graph,
                                       const PassSampling* sampling) {
  const auto N = static_cast<int64_t>(batch.size());
  const int64_t page_tokens = pools->page_tokens();
  t.num_seqs = N;
  t.cu.assign(1, 0);
  t.slots.clear();
  t.context_lens.clear();
  t.logit_rows.clear();
  t.logit_seq.clear();
  t.pure_decode = true;
  t.max_context = 0;
  t.max_pages = 1;
  std::vector<int32_t> tokens;
  std::vector<int64_t> slot_mapping;
  for (int64_t s = 0; s < N; ++s) {
    const SequenceInput& in = batch[static_cast<size_t>(s)];
    const CudaResidency* residency = ours(*in.state, pools.get());
    if (residency == nullptr) return internal_error("build_tables: a sequence has no residency");
    const auto T = static_cast<int64_t>(in.tokens.size());
    const int64_t first = in.state->num_tokens();
    const int32_t begin = t.cu.back();
    t.cu.push_back(begin + static_cast<int32_t>(T));
    t.slots.push_back(residency->slot());
    t.context_lens.push_back(static_cast<int32_t>(first + T));
    t.max_context = std::max<int>(t.max_context, static_cast<int>(first + T));
    t.max_pages = std::max<int>(t.max_pages, static_cast<int>(residency->pages().size()));
    if (T != 1) t.pure_decode = false;
    tokens.insert(tokens.end(), in.tokens.begin(), in.tokens.end());
    for (int64_t i = 0; i < T; ++i) {
      const int64_t position = first + i;
      if (shape.mla_layers > 0) {
        const int64_t page = residency->pages()[static_cast<size_t>(position / page_tokens)];
        slot_mapping.push_back(page * page_tokens + position % page_tokens);
      }
      if (in.all_logits || i == T - 1) {
        t.logit_rows.push_back(begin + static_cast<int32_t>(i));
        t.logit_seq.push_back(static_cast<int32_t>(s));
      }
    }
  }
  t.rows = t.cu.back();
  if (graph != nullptr) {
    // The graph's layout: block-table rows of its bound, its context bound for the split grid.
    const bool context_fits = shape.mla_layers == 0 || t.max_context <= graph->context_bound;
    if (t.max_pages > graph->pages_bound || !context_fits || N != graph->batch) {
      return internal_error("build_tables: the batch does not fit its decode graph key");
    }
    t.max_pages = graph->pages_bound;
    if (shape.mla_layers > 0) t.max_context = graph->context_bound;
  } else if (t.pure_decode && shape.mla_layers > 0) {
    // An eager decode pass splits the MLA context as the graph of its key would (decode_context_bound).
    if (const std::optional<int64_t> bound = decode_context_bound(t.max_context)) {
      t.max_context = static_cast<int>(*bound);
      t.max_pages = std::max<int>(t.max_pages, static_cast<int>((*bound + page_tokens - 1) / page_tokens));
    }
  }
  std::vector<int32_t> block_tables(static_cast<size_t>(N * t.max_pages), -1);
  for (int64_t s = 0; s < N; ++s) {
    const auto& pages = ours(*batch[static_cast<size_t>(s)].state, pools.get())->pages();
    std::copy(pages.begin(), pages.end(), block_tables.begin() + s * t.max_pages);
  }

  host_tables.clear();
  const size_t o_tokens = append(host_tables, tokens.data(), tokens.size());
  const size_t o_slots = append(host_tables, t.slots.data(), t.slots.size());
  const size_t o_cu = append(host_tables, t.cu.data(), t.cu.size());
  const size_t o_context = append(host_tables, t.context_lens.data(), t.context_lens.size());
  const size_t o_blocks = append(host_tables, block_tables.data(), block_tables.size());
  const size_t o_logits = append(host_tables, t.logit_rows.data(), t.logit_rows.size());
  const size_t o_mapping = append(host_tables, slot_mapping.data(), slot_mapping.size());
  // Sampling parameters last: the offsets of everything a graph reads stay those of an unsampled pass.
  std::vector<float> temperature, top_p;
  std::vector<int32_t> top_k, top_logprobs;
  std::vector<double> draws;
  t.sample_top_logprobs = 0;
  if (sampling != nullptr) {
    for (const SampleRequest& row : sampling->rows) {
      temperature.push_back(row.params.temperature);
      top_p.push_back(row.params.top_p);
      top_k.push_back(row.params.top_k);
      top_logprobs.push_back(row.logprobs ? row.params.top_logprobs : 0);
      draws.push_back(row.draw);
      t.sample_top_logprobs = std::max<int>(t.sample_top_logprobs, top_logprobs.back());
    }
  }
  const size_t o_temperature = append(host_tables, temperature.data(), temperature.size());
  const size_t o_top_p = append(host_tables, top_p.data(), top_p.size());
  const size_t o_top_k = append(host_tables, top_k.data(), top_k.size());
  const size_t o_top_logprobs = append(host_tables, top_logprobs.data(), top_logprobs.size());
  const size_t o_draws = append(host_tables, draws.data(), draws.size());
  const char* base = nullptr;
  if (graph == nullptr) {
    if (host_tables.size() > table_memory.bytes()) {
      DS_CUDA_RETURN(cudaStreamSynchronize(stream()));
      DS_RETURN_IF_ERROR(table_memory.allocate(align_up(host_tables.size() * 2), "per-pass tables"));
    }
    // Pageable source: the copy is staged before the call returns, so host_tables may be reused after it.
    DS_CUDA_RETURN(
        cudaMemcpyAsync(table_memory.data(), host_tables.data(), host_tables.size(), cudaMemcpyHostToDevice, stream()));
    base = table_memory.as<char>();
  } else {
    // Fixed device buffer (the graphs hold its address): one copy from pinned staging. Growing it moves it, so
    // every graph is dropped then (the caller captures after this call).
    DecodeGraphs& g = decode_graphs;
    if (g.staged == nullptr) DS_CUDA_RETURN(cudaEventCreateWithFlags(&g.staged, cudaEventDisableTiming));
    DS_CUDA_RETURN(cudaEventSynchronize(g.staged));  // the previous upload has left the staging buffer
    if (host_tables.size() > g.tables.bytes()) {
      DS_CUDA_RETURN(cudaStreamSynchronize(stream()));
      g.clear();
      DS_RETURN_IF_ERROR(g.tables.allocate(align_up(host_tables.size() * 2), "decode graph tables"));
    }
    if (host_tables.size() > g.staging.bytes()) {
      DS_RETURN_IF_ERROR(g.staging.allocate(align_up(host_tables.size() * 2), "decode graph table staging"));
    }
    std::memcpy(g.staging.data(), host_tables.data(), host_tables.size());
    DS_CUDA_RETURN(
        cudaMemcpyAsync(g.tables.data(), g.staging.data(), host_tables.size(), cudaMemcpyHostToDevice, stream()));
    DS_CUDA_RETURN(cudaEventRecord(g.staged, stream()));
    base = g.tables.as<char>();
  }
  t.d_tokens = reinterpret_cast<const int32_t*>(base + o_tokens);
  t.d_slots = reinterpret_cast<const int32_t*>(base + o_slots);
  t.d_cu = reinterpret_cast<const int32_t*>(base + o_cu);
  t.d_context_lens = reinterpret_cast<const int32_t*>(base + o_context);
  t.d_block_tables = reinterpret_cast<const int32_t*>(base + o_blocks);
  t.d_logit_rows = reinterpret_cast<const int32_t*>(base + o_logits);
  t.d_slot_mapping = reinterpret_cast<const int64_t*>(base + o_mapping);
  t.d_temperature = reinterpret_cast<const float*>(base + o_temperature);
  t.d_top_p = reinterpret_cast<const float*>(base + o_top_p);
  t.d_top_k = reinterpret_cast<const int32_t*>(base + o_top_k);
  t.d_top_logprobs = reinterpret_cast<const int32_t*>(base + o_top_logprobs);
  t.d_draw = reinterpret_cast<const double*>(base + o_draws);
  return Status::ok();
}

// ---- the pass -----------------------------------------------------------------------------------------------

Status CudaBackend::Impl::forward_layers(const PassTables& t, const float** final_hidden) {
  const int64_t T = t.rows, hidden = config.hidden_size;
  const float eps = config.rms_norm_eps;
  profiler.mark(Phase::kEmbedding, stream());
  DS_RETURN_IF_ERROR(
      kc::embedding_gather(weights->embed_tokens, config.vocab_size, hidden, t.d_tokens, T, residual, stream()));

  // attention(l, x): residual += attention(input_norm(x)); ffn(l, x): residual += ffn(post_attention_norm(x)).
  // Decode batches of the skinny path skip the separate input norm: the projections normalise x in their launch
  // (Gemm::fuses_input_norm: 1-2 rows).
  const bool fused_input_norm = t.pure_decode && Gemm::fuses_input_norm(T);
  auto attention = [&](const DeviceLayer& layer, const float* x) -> Status {
    if (fused_input_norm) return layer.kind == LayerKind::kKda ? run_kda(layer, t, x) : run_mla(layer, t, x);
    profiler.mark(Phase::kNorms, stream());
    DS_RETURN_IF_ERROR(kc::rms_norm(x, hidden, layer.input_norm, T, hidden, eps, normed, hidden, stream()));
    return layer.kind == LayerKind::kKda ? run_kda(layer, t, nullptr) : run_mla(layer, t, nullptr);
  };
  auto ffn = [&](const DeviceLayer& layer, const float* x) -> Status {
    profiler.mark(Phase::kNorms, stream());
    arena.reset();
    // MoE at small batches: the bf16 (experts) and fp32 (router) normalisations in one launch, or inside the
    // small-batch launches themselves (run_moe decides, and falls back to that launch).
    if (layer.is_moe && T <= kc::kSkinnyGemmMaxRows) return run_moe(layer.moe, T, x, layer.post_attention_norm);
    if (!layer.is_moe) {  // the gate/up projection normalises x in its launch where it can, else rms_norm first
      profiler.mark(Phase::kDenseFfn, stream());
      return run_dense_ffn(layer.dense, GemmNormInput{x, hidden, layer.post_attention_norm, eps, normed}, T);
    }
    DS_RETURN_IF_ERROR(kc::rms_norm(x, hidden, layer.post_attention_norm, T, hidden, eps, normed, hidden, stream()));
    DS_RETURN_IF_ERROR(
        kc::rms_norm(x, hidden, layer.post_attention_norm, T, hidden, eps, normed_f32, hidden, stream()));
    return run_moe(layer.moe, T);
  };

  if (!config.attn_res_block_size) {
    for (const DeviceLayer& layer : weights->layers) {
      DS_RETURN_IF_ERROR_CTX(attention(layer, residual), "layer " + std::to_string(&layer - weights->layers.data()));
      DS_RETURN_IF_ERROR_CTX(ffn(layer, residual), "layer " + std::to_string(&layer - weights->layers.data()));
    }
    *final_hidden = residual;
    return Status::ok();
  }

  // Block Attention Residuals (model.md §2), the CPU order: `residual` is the running prefix of the current block;
  // sealing a block hands its buffer to `blocks` and continues in a spare zeroed buffer.
  const int64_t block_size = *config.attn_res_block_size;
  std::vector<const float*> blocks;
  // spare_blocks[0] is the residual buffer the embeddings went into; the others take over as blocks are sealed.
  std::vector<float*> spares(spare_blocks.begin() + 1, spare_blocks.end());
  auto mix = [&](const DeviceAttnRes& w, float* out) -> Status {
    profiler.mark(Phase::kNorms, stream());
    std::vector<const float*> sources = blocks;
    sources.push_back(residual);
    if (static_cast<int>(sources.size()) > kc::kMaxAttnResSources) {
      return unimplemented("AttnRes with more than " + std::to_string(kc::kMaxAttnResSources) + " sources");
    }
    return kc::attn_res_mix(sources.data(), static_cast<int>(sources.size()), w.norm, w.proj, T, hidden, eps, out,
                            stream());
  };
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const DeviceLayer& layer = weights->layers[static_cast<size_t>(l)];
    const std::string where = "layer " + std::to_string(l);
    const bool had_blocks = !blocks.empty();
    if (had_blocks) DS_RETURN_IF_ERROR_CTX(mix(layer.attention_res, mixed), where);
    const float* x_in = had_blocks ? mixed : residual;
    if (l % block_size == 0) {
      if (spares.empty()) return internal_error("AttnRes: no spare block buffer");
      blocks.push_back(residual);  // sealed: x_in (when it is the prefix) keeps pointing at the same values
      residual = spares.back();
      spares.pop_back();
      DS_CUDA_RETURN(cudaMemsetAsync(residual, 0, static_cast<size_t>(T * hidden) * 4, stream()));
    }
    DS_RETURN_IF_ERROR_CTX(attention(layer, x_in), where);
    DS_RETURN_IF_ERROR_CTX(mix(layer.mlp_res, mixed), where);
    DS_RETURN_IF_ERROR_CTX(ffn(layer, mixed), where);
  }
  // The final mix goes into a free buffer (mixed is one); then the buffers go back to their places.
  DS_RETURN_IF_ERROR(mix(weights->output_res, mixed));
  *final_hidden = mixed;
  return Status::ok();
}

void CudaBackend::Impl::size_logits(std::span<SequenceInput> batch, std::vector<std::vector<float>>& out) const {
  out.assign(batch.size(), {});
  for (size_t s = 0; s < batch.size(); ++s) {
    const int64_t rows = batch[s].all_logits ? static_cast<int64_t>(batch[s].tokens.size()) : 1;
    out[s].resize(static_cast<size_t>(rows * config.vocab_size));
  }
}

Status CudaBackend::Impl::lm_head_piece(const float* final_hidden, const PassTables& t, int64_t begin, int64_t n) {
  const int64_t hidden = config.hidden_size, vocab = config.vocab_size;
  // A pure decode pass wants every row's logits, in order (build_tables: one row per sequence), so the rows are read
  // where they are; otherwise the wanted rows are gathered first.
  const float* rows = final_hidden + begin * hidden;
  if (!t.pure_decode) {
    DS_RETURN_IF_ERROR(kc::gather_slots(final_hidden, hidden * 4, t.d_logit_rows + begin, n, head_rows, stream()));
    rows = head_rows;
  }
  // The final norm inside the LM head's launch where the skinny GEMM fuses it (bitwise rms_norm's rows), else
  // rms_norm into head_normed first.
  return gemm.run_shared_input(GemmNormInput{rows, hidden, weights->final_norm, config.rms_norm_eps, head_normed}, n,
                               hidden, {GemmTarget(weights->lm_head, vocab, logits, vocab)});
}

// Rows of one sequence are consecutive: each run is copied in one piece. Synchronises (pageable destinations, and
// the next piece overwrites `logits`).
Status CudaBackend::Impl::copy_logits(const PassTables& t, int64_t begin, int64_t n,
                                      std::vector<std::vector<float>>& out, std::vector<int64_t>& filled) {
  const int64_t vocab = config.vocab_size;
  for (int64_t i = 0; i < n;) {
    const int32_t s = t.logit_seq[static_cast<size_t>(begin + i)];
    int64_t j = i;
    while (j < n && t.logit_seq[static_cast<size_t>(begin + j)] == s) ++j;
    std::vector<float>& dst = out[static_cast<size_t>(s)];
    int64_t& at = filled[static_cast<size_t>(s)];
    DS_CUDA_RETURN(cudaMemcpyAsync(dst.data() + at * vocab, logits + i * vocab,
                                   static_cast<size_t>((j - i) * vocab) * sizeof(float), cudaMemcpyDeviceToHost,
                                   stream()));
    at += j - i;
    i = j;
  }
  DS_CUDA_RETURN(cudaStreamSynchronize(stream()));
  return Status::ok();
}

Status CudaBackend::Impl::lm_head(const float* final_hidden, const PassTables& t, std::span<SequenceInput> batch,
                                  std::vector<std::vector<float>>* out, const PassSampling* sampling) {
  const auto W = static_cast<int64_t>(t.logit_rows.size());
  std::vector<int64_t> filled;
  if (out != nullptr) {
    size_logits(batch, *out);
    filled.assign(batch.size(), 0);
  }
  for (int64_t begin = 0; begin < W; begin += logit_chunk) {
    const int64_t n = std::min(logit_chunk, W - begin);
    profiler.mark(Phase::kLmHead, stream());
    DS_RETURN_IF_ERROR(lm_head_piece(final_hidden, t, begin, n));
    if (out != nullptr) DS_RETURN_IF_ERROR(copy_logits(t, begin, n, *out, filled));
    // Sampled on the stream before the next piece overwrites `logits`; no host sync between pieces.
    if (sampling != nullptr) DS_RETURN_IF_ERROR(sample_piece(t, begin, n));
  }
  if (sampling != nullptr) DS_RETURN_IF_ERROR(fetch_samples(t, *sampling));
  profiler.idle(stream());
  return Status::ok();
}

Status CudaBackend::Impl::run(std::span<SequenceInput> batch, std::vector<std::vector<float>>* out,
                              const PassSampling* sampling) {
  DS_RETURN_IF_ERROR(validate(batch));
  if (sampling != nullptr) {
    if (out != nullptr || sampling->out == nullptr) return internal_error("run: a sampled pass returns no logits");
    DS_RETURN_IF_ERROR(check_sample_rows(batch, sampling->rows));
  }
  // A state resident on another backend: bring its host copy up to date and let it go (it is uploaded here).
  for (SequenceInput& in : batch) {
    if (in.state->residency() != nullptr && ours(*in.state, pools.get()) == nullptr) {
      DS_RETURN_IF_ERROR(in.state->sync_host());
      in.state->drop_device();
    }
  }
  std::lock_guard<std::recursive_mutex> lock(pools->mutex());
  DS_CUDA_RETURN(cudaSetDevice(pools->device()));
  profiler.mark(Phase::kTableUpload, stream());
  Status status = claim_residencies(batch);
  if (!status.is_ok()) {
    (void)profiler.collect();  // closes this pass's timing (profiling only)
    return status;             // as before: kResourceExhausted took nothing
  }
  bool done = false;
  if (const std::optional<DecodeGraphKey> key = decode_graph_key(batch)) {
    status = run_decode_graph(batch, *key, out, sampling, &done);
  }
  if (status.is_ok() && !done) {
    PassTables tables;
    status = build_tables(batch, tables, nullptr, sampling);
    const float* final_hidden = nullptr;
    if (status.is_ok()) status = forward_layers(tables, &final_hidden);
    // Restore the AttnRes buffer rotation whatever happened (forward_layers moved `residual`).
    if (config.attn_res_block_size) residual = spare_blocks.front();
    if (status.is_ok()) status = lm_head(final_hidden, tables, batch, out, sampling);
  }
  if (status.is_ok()) status = cuda_status(cudaGetLastError(), "forward pass", __FILE__, __LINE__);
  const Status collected = profiler.collect();  // (no-op unless profiling)
  if (status.is_ok()) status = collected;
  if (!status.is_ok()) {
    // Layers may have updated KDA states in place before the failure. Where the host copy is current, let the
    // device copy go (the next pass uploads the host contents again); a request whose only current copy was on
    // the device cannot be restored (a failure here is a bug or a broken device).
    for (SequenceInput& in : batch) {
      if (!in.state->host_stale()) in.state->drop_device();
    }
    return status.with_context("CUDA forward pass");
  }
  for (SequenceInput& in : batch) {
    in.state->set_host_stale(true);
    in.state->advance(static_cast<int64_t>(in.tokens.size()));
  }
  return Status::ok();
}

}  // namespace deltaserve::engine::cuda
