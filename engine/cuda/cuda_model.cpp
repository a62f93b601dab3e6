// The forward pass of CudaBackend, layer by layer in the order of the CPU reference (engine/model.cpp).
#include "engine/cuda/cuda_model.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <string>

#include "kernels/cuda/kda.hpp"
#include "kernels/cuda/kda_generic.hpp"
#include "kernels/cuda/mla.hpp"
#include "kernels/cuda/moe.hpp"
#include "kernels/cuda/ops.hpp"

namespace deltaserve::engine::cuda {

namespace kc = kernels::cuda;

namespace {

constexpr float kL2NormEps = 1e-6f;  // as engine/model.cpp

kc::GluKind glu_kind(const ModelConfig& config) {
  return config.hidden_act == Activation::kSitu ? kc::GluKind::kSitu : kc::GluKind::kSwiGlu;
}

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
    moe.add(static_cast<int64_t>(kc::moe_ffn_prefill_workspace_bytes(R * k, I)));
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

CudaResidency* ours(const RequestState& state, const DevicePools* pools) {
  const auto* residency = dynamic_cast<const CudaResidency*>(state.residency());
  if (residency == nullptr || residency->pools() != pools) return nullptr;
  // The residency is owned (non-const) by the state; RequestState only hands out a const view.
  return const_cast<CudaResidency*>(residency);
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

Status CudaBackend::Impl::build_tables(std::span<SequenceInput> batch, PassTables& t) {
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
  if (host_tables.size() > table_memory.bytes()) {
    DS_CUDA_RETURN(cudaStreamSynchronize(stream()));
    DS_RETURN_IF_ERROR(table_memory.allocate(align_up(host_tables.size() * 2), "per-pass tables"));
  }
  // Pageable source: the copy is staged before the call returns, so host_tables may be reused after it.
  DS_CUDA_RETURN(
      cudaMemcpyAsync(table_memory.data(), host_tables.data(), host_tables.size(), cudaMemcpyHostToDevice, stream()));
  const char* base = table_memory.as<char>();
  t.d_tokens = reinterpret_cast<const int32_t*>(base + o_tokens);
  t.d_slots = reinterpret_cast<const int32_t*>(base + o_slots);
  t.d_cu = reinterpret_cast<const int32_t*>(base + o_cu);
  t.d_context_lens = reinterpret_cast<const int32_t*>(base + o_context);
  t.d_block_tables = reinterpret_cast<const int32_t*>(base + o_blocks);
  t.d_logit_rows = reinterpret_cast<const int32_t*>(base + o_logits);
  t.d_slot_mapping = reinterpret_cast<const int64_t*>(base + o_mapping);
  return Status::ok();
}

// ---- KDA ----------------------------------------------------------------------------------------------------

Status CudaBackend::Impl::run_kda_prefill_128(const DeviceLayer& layer, const PassTables& t, const __nv_bfloat16* q,
                                              const __nv_bfloat16* k, const __nv_bfloat16* v, const float* gate_raw,
                                              const float* beta, float* beta_group, __nv_bfloat16* o) {
  const DeviceKda& w = layer.kda;
  const int64_t H = shape.heads, d = shape.head_dim, C = H * d;
  const int64_t state_bytes = shape.state_floats() * 4;
  float* pool = pools->state_pool(layer.slot);
  const int64_t N = t.num_seqs;
  for (int64_t n = 0; n < N;) {
    // A group of consecutive sequences whose prefill workspace fits (halved until it does).
    int64_t m = std::min(N, n + kKdaPrefillGroup);
    std::vector<int32_t> cu;
    size_t workspace = 0;
    while (true) {
      cu.assign(1, 0);
      for (int64_t i = n; i < m; ++i) cu.push_back(t.cu[static_cast<size_t>(i + 1)] - t.cu[static_cast<size_t>(n)]);
      workspace = kc::kda_prefill_workspace_bytes(cu, static_cast<int>(H));
      if (workspace <= kda_workspace.bytes() || m == n + 1) break;
      m = n + (m - n) / 2;
    }
    if (workspace > kda_workspace.bytes()) {
      return internal_error("KDA prefill workspace of " + std::to_string(workspace) + " bytes exceeds the planned " +
                            std::to_string(kda_workspace.bytes()));
    }
    const int64_t row0 = t.cu[static_cast<size_t>(n)];
    float* states = nullptr;
    if (m == n + 1) {
      states = pool + t.slots[static_cast<size_t>(n)] * shape.state_floats();  // in place in the pool
    } else {
      states = kda_dense_states.as<float>();
      DS_RETURN_IF_ERROR(kc::gather_slots(pool, state_bytes, t.d_slots + n, m - n, states, stream()));
    }
    kc::KdaPrefillParams p;
    p.num_heads = static_cast<int>(H);
    p.head_dim = static_cast<int>(d);
    p.cu_seqlens = cu;
    p.q = q + row0 * C;
    p.k = k + row0 * C;
    p.v = v + row0 * C;
    p.g = gate_raw + row0 * C;
    // The kernel wants 16-byte aligned inputs: a group starting at an odd row has its beta rows copied.
    p.beta = beta + row0 * H;
    if ((row0 * H) % 4 != 0) {
      const int64_t group_rows = t.cu[static_cast<size_t>(m)] - row0;
      DS_CUDA_RETURN(cudaMemcpyAsync(beta_group, beta + row0 * H, static_cast<size_t>(group_rows * H) * sizeof(float),
                                     cudaMemcpyDeviceToDevice, stream()));
      p.beta = beta_group;
    }
    p.q_scale = 1.0f / std::sqrt(static_cast<float>(d));
    p.gate_raw = true;
    p.a_log = w.a_log;
    p.dt_bias = w.dt_bias;
    p.lower_bound = config.kda.gate_lower_bound;
    p.initial_state = states;
    p.final_state = states;
    p.o = o + row0 * C;
    p.workspace = kda_workspace.data();
    p.workspace_bytes = kda_workspace.bytes();
    DS_RETURN_IF_ERROR_CTX(kc::kda_chunk_prefill(p, stream()), "kda_chunk_prefill");
    if (m != n + 1) DS_RETURN_IF_ERROR(kc::scatter_slots(states, state_bytes, t.d_slots + n, m - n, pool, stream()));
    n = m;
  }
  return Status::ok();
}

Status CudaBackend::Impl::run_kda(const DeviceLayer& layer, const PassTables& t) {
  const DeviceKda& w = layer.kda;
  const int64_t T = t.rows, hidden = config.hidden_size;
  const int64_t H = shape.heads, d = shape.head_dim, C = H * d, r = d;
  const bool low_rank_gate = !config.kda.full_rank_output_gate;
  const int64_t low_width = low_rank_gate ? 2 * r : r;
  const float eps = config.rms_norm_eps;
  const __nv_bfloat16* x = normed;
  arena.reset();
  auto* out = arena.take<__nv_bfloat16>(T * C);  // gated, normalised output: the input of o_proj
  auto* low = arena.take<__nv_bfloat16>(T * low_width);
  DS_RETURN_IF_ERROR(arena_check("KDA"));
  DS_RETURN_IF_ERROR(gemm.run(x, hidden, w.fg_a, T, hidden, low_width, low, low_width));

  if (d == kc::kKdaHeadDim && t.pure_decode) {
    // Fused decode: conv, L2, gate, beta, recurrence and the gated norm in one kernel over the slot pool.
    auto* q = arena.take<__nv_bfloat16>(T * C);
    auto* k = arena.take<__nv_bfloat16>(T * C);
    auto* v = arena.take<__nv_bfloat16>(T * C);
    auto* gate_raw = arena.take<__nv_bfloat16>(T * C);
    auto* out_gate = arena.take<__nv_bfloat16>(T * C);
    auto* beta_raw = arena.take<__nv_bfloat16>(T * H);
    DS_RETURN_IF_ERROR(arena_check("KDA decode"));
    DS_RETURN_IF_ERROR(gemm.run(x, hidden, w.qkv, T, hidden, C, q, C));
    DS_RETURN_IF_ERROR(gemm.run(x, hidden, w.qkv + C * hidden, T, hidden, C, k, C));
    DS_RETURN_IF_ERROR(gemm.run(x, hidden, w.qkv + 2 * C * hidden, T, hidden, C, v, C));
    DS_RETURN_IF_ERROR(gemm.run(low, low_width, w.f_b, T, r, C, gate_raw, C));
    if (low_rank_gate) {
      DS_RETURN_IF_ERROR(gemm.run(low + r, low_width, w.g_b, T, r, C, out_gate, C));
    } else {
      DS_RETURN_IF_ERROR(gemm.run(x, hidden, w.g_proj, T, hidden, C, out_gate, C));
    }
    DS_RETURN_IF_ERROR(gemm.run(x, hidden, w.b_proj, T, hidden, H, beta_raw, H));
    kc::KdaDecodeParams p;
    p.batch = static_cast<int>(T);
    p.num_heads = static_cast<int>(H);
    p.head_dim = static_cast<int>(d);
    p.conv_kernel = static_cast<int>(shape.conv_kernel);
    p.num_slots = static_cast<int>(pools->num_slots());
    p.slots = t.d_slots;  // one row per sequence
    p.q_in = q;
    p.k_in = k;
    p.v_in = v;
    p.gate_raw = gate_raw;
    p.beta_raw = beta_raw;
    p.out_gate = out_gate;
    p.q_conv_weight = w.q_conv;
    p.k_conv_weight = w.k_conv;
    p.v_conv_weight = w.v_conv;
    p.a_log = w.a_log;
    p.dt_bias = w.dt_bias;
    p.lower_bound = config.kda.gate_lower_bound;
    p.o_norm_weight = w.o_norm;
    p.rms_eps = eps;
    p.conv_state = pools->conv_pool(layer.slot);
    p.state = pools->state_pool(layer.slot);
    p.out = out;
    DS_RETURN_IF_ERROR_CTX(kc::kda_decode_step(p, stream()), "kda_decode_step");
  } else {
    auto* qkv = arena.take<__nv_bfloat16>(T * 3 * C);
    auto* gate_raw = arena.take<float>(T * C);
    auto* out_gate = arena.take<float>(T * C);
    auto* beta = arena.take<float>(T * H);
    DS_RETURN_IF_ERROR(arena_check("KDA projections"));
    DS_RETURN_IF_ERROR(gemm.run(x, hidden, w.qkv, T, hidden, 3 * C, qkv, 3 * C));
    DS_RETURN_IF_ERROR(gemm.run(low, low_width, w.f_b, T, r, C, gate_raw, C));
    if (low_rank_gate) {
      DS_RETURN_IF_ERROR(gemm.run(low + r, low_width, w.g_b, T, r, C, out_gate, C));
    } else {
      DS_RETURN_IF_ERROR(gemm.run(x, hidden, w.g_proj, T, hidden, C, out_gate, C));
    }
    DS_RETURN_IF_ERROR(gemm.run(x, hidden, w.b_proj, T, hidden, H, beta, H));
    DS_RETURN_IF_ERROR(kc::sigmoid_inplace(beta, T * H, stream()));

    kc::KdaPrepParams prep;
    prep.num_seqs = static_cast<int>(t.num_seqs);
    prep.num_tokens = T;
    prep.cu_seqlens = t.d_cu;
    prep.slots = t.d_slots;
    prep.num_heads = static_cast<int>(H);
    prep.head_dim = static_cast<int>(d);
    prep.conv_kernel = static_cast<int>(shape.conv_kernel);
    prep.q_in = qkv;
    prep.k_in = qkv + C;
    prep.v_in = qkv + 2 * C;
    prep.in_stride = 3 * C;
    prep.q_conv_weight = w.q_conv;
    prep.k_conv_weight = w.k_conv;
    prep.v_conv_weight = w.v_conv;
    prep.conv_state = pools->conv_pool(layer.slot);
    prep.num_slots = static_cast<int>(pools->num_slots());
    prep.l2_eps = kL2NormEps;

    if (d == kc::kKdaHeadDim) {
      auto* q = arena.take<__nv_bfloat16>(T * C);
      auto* k = arena.take<__nv_bfloat16>(T * C);
      auto* v = arena.take<__nv_bfloat16>(T * C);
      auto* o = arena.take<__nv_bfloat16>(T * C);
      auto* beta_group = arena.take<float>(T * H);
      DS_RETURN_IF_ERROR(arena_check("KDA prefill"));
      prep.q_scale = 1.0f;  // the prefill kernel applies d^-0.5
      prep.q = q;
      prep.k = k;
      prep.v = v;
      DS_RETURN_IF_ERROR_CTX(kc::kda_prep(prep, stream()), "kda_prep");
      DS_RETURN_IF_ERROR(run_kda_prefill_128(layer, t, q, k, v, gate_raw, beta, beta_group, o));
      DS_RETURN_IF_ERROR(kc::kda_gated_output_norm(o, out_gate, C, w.o_norm, T, static_cast<int>(H),
                                                   static_cast<int>(d), eps, out, stream()));
    } else {
      auto* q = arena.take<float>(T * C);
      auto* k = arena.take<float>(T * C);
      auto* v = arena.take<float>(T * C);
      auto* g = arena.take<float>(T * C);
      auto* o = arena.take<float>(T * C);
      DS_RETURN_IF_ERROR(arena_check("KDA generic"));
      prep.q_scale = 1.0f / std::sqrt(static_cast<float>(d));
      DS_RETURN_IF_ERROR_CTX(kc::kda_prep_f32(prep, kc::KdaPrepF32Outputs{q, k, v}, stream()), "kda_prep_f32");
      DS_RETURN_IF_ERROR(kc::kda_gate(gate_raw, C, w.a_log, w.dt_bias, T, static_cast<int>(H), static_cast<int>(d),
                                      config.kda.gate_lower_bound, g, stream()));
      kc::KdaRecurrentParams p;
      p.num_seqs = static_cast<int>(t.num_seqs);
      p.num_tokens = T;
      p.cu_seqlens = t.d_cu;
      p.slots = t.d_slots;
      p.num_heads = static_cast<int>(H);
      p.head_dim = static_cast<int>(d);
      p.q = q;
      p.k = k;
      p.v = v;
      p.g = g;
      p.beta = beta;
      p.state = pools->state_pool(layer.slot);
      p.num_slots = static_cast<int>(pools->num_slots());
      p.o = o;
      DS_RETURN_IF_ERROR_CTX(kc::kda_recurrent_varlen(p, stream()), "kda_recurrent_varlen");
      DS_RETURN_IF_ERROR(kc::kda_gated_output_norm(o, out_gate, C, w.o_norm, T, static_cast<int>(H),
                                                   static_cast<int>(d), eps, out, stream()));
    }
  }
  return gemm.run(out, C, w.o_proj, T, C, hidden, residual, hidden, /*accumulate=*/true);
}

// ---- MLA ----------------------------------------------------------------------------------------------------

Status CudaBackend::Impl::run_mla(const DeviceLayer& layer, const PassTables& t) {
  const DeviceMla& w = layer.mla;
  const MlaConfig& m = config.mla;
  const int64_t T = t.rows, hidden = config.hidden_size, H = m.num_heads;
  const int64_t qk = m.qk_head_dim(), width = m.cache_width(), q_lora = m.q_lora_rank.value_or(0);
  const int64_t v_width = H * m.v_head_dim, projected = q_lora + width;
  const float eps = config.rms_norm_eps;
  const __nv_bfloat16* x = normed;
  arena.reset();
  auto* q = arena.take<__nv_bfloat16>(T * H * qk);
  auto* qa_kv = arena.take<float>(T * projected);  // [T, q_lora ‖ latent ‖ k_rot]
  auto* attention = arena.take<float>(T * v_width);
  auto* gated = arena.take<__nv_bfloat16>(T * v_width);
  DS_RETURN_IF_ERROR(arena_check("MLA"));
  DS_RETURN_IF_ERROR(gemm.run(x, hidden, w.qa_kva, T, hidden, projected, qa_kv, projected));
  if (m.q_lora_rank) {
    auto* q_low = arena.take<__nv_bfloat16>(T * q_lora);
    DS_RETURN_IF_ERROR(arena_check("MLA q_lora"));
    DS_RETURN_IF_ERROR(kc::rms_norm(qa_kv, projected, w.q_a_norm, T, q_lora, eps, q_low, q_lora, stream()));
    DS_RETURN_IF_ERROR(gemm.run(q_low, q_lora, w.q_b, T, q_lora, H * qk, q, H * qk));
  } else {
    DS_RETURN_IF_ERROR(gemm.run(x, hidden, w.q_proj, T, hidden, H * qk, q, H * qk));
  }

  // New cache rows [kv_a_layernorm(latent) ‖ k_rot] into the sequences' pages.
  kc::MlaWriteParams write;
  write.pool = pools->page_pool();
  write.layer = static_cast<int>(layer.slot);
  write.num_tokens = T;
  write.kv = qa_kv + q_lora;
  write.kv_stride = projected;
  write.norm_weight = w.kv_a_norm;
  write.eps = eps;
  write.kv_lora_rank = static_cast<int>(m.kv_lora_rank);
  write.qk_rope = static_cast<int>(m.qk_rope_head_dim);
  write.slot_mapping = t.d_slot_mapping;
  DS_RETURN_IF_ERROR_CTX(kc::mla_write_rows(write, stream()), "mla_write_rows");

  kc::MlaAttentionParams a;
  a.num_heads = static_cast<int>(H);
  a.kv_lora_rank = static_cast<int>(m.kv_lora_rank);
  a.qk_nope = static_cast<int>(m.qk_nope_head_dim);
  a.qk_rope = static_cast<int>(m.qk_rope_head_dim);
  a.v_head = static_cast<int>(m.v_head_dim);
  a.softmax_scale = m.softmax_scale();
  a.pool = pools->page_pool();
  a.layer = static_cast<int>(layer.slot);
  a.num_seqs = static_cast<int>(t.num_seqs);
  a.num_tokens = T;
  a.cu_q = t.d_cu;
  a.context_lens = t.d_context_lens;
  a.block_tables = t.d_block_tables;
  a.max_pages_per_seq = t.max_pages;
  a.max_context = t.max_context;
  a.q = q;
  a.q_stride = H * qk;
  a.kv_b = w.kv_b;
  a.out = attention;
  DS_RETURN_IF_ERROR(ensure_mla_workspace(
      kc::mla_attention_workspace_bytes(a.num_heads, a.kv_lora_rank, a.qk_rope, T, t.max_context)));
  a.workspace = mla_workspace.data();
  a.workspace_bytes = mla_workspace.bytes();
  if (t.pure_decode) {
    DS_RETURN_IF_ERROR_CTX(kc::mla_decode(a, stream()), "mla_decode");
  } else {
    DS_RETURN_IF_ERROR_CTX(kc::mla_prefill(a, stream()), "mla_prefill");
  }

  if (m.use_output_gate) {
    auto* gate = arena.take<float>(T * v_width);
    DS_RETURN_IF_ERROR(arena_check("MLA gate"));
    DS_RETURN_IF_ERROR(gemm.run(x, hidden, w.g_proj, T, hidden, v_width, gate, v_width));
    DS_RETURN_IF_ERROR(kc::sigmoid_gate(attention, gate, T * v_width, gated, stream()));
  } else {
    DS_RETURN_IF_ERROR(kc::to_bf16(attention, T * v_width, gated, stream()));
  }
  return gemm.run(gated, v_width, w.o_proj, T, v_width, hidden, residual, hidden, /*accumulate=*/true);
}

// ---- FFN ----------------------------------------------------------------------------------------------------

// residual += down(glu(gate_up(x))). Takes its temporaries from the arena without resetting it.
Status CudaBackend::Impl::run_dense_ffn(const DeviceFfn& ffn, const __nv_bfloat16* x, int64_t x_stride, int64_t rows) {
  const int64_t I = ffn.intermediate, width = ffn.width;
  auto* gate_up = arena.take<float>(rows * 2 * I);
  auto* activated = arena.take<__nv_bfloat16>(rows * I);
  DS_RETURN_IF_ERROR(arena_check("FFN"));
  DS_RETURN_IF_ERROR(gemm.run(x, x_stride, ffn.gate_up, rows, width, 2 * I, gate_up, 2 * I));
  DS_RETURN_IF_ERROR(
      kc::glu(gate_up, rows, I, glu_kind(config), config.situ_beta, config.situ_linear_beta, activated, stream()));
  return gemm.run(activated, I, ffn.down, rows, I, width, residual, config.hidden_size, /*accumulate=*/true);
}

Status CudaBackend::Impl::run_moe(const DeviceMoe& moe, int64_t T) {
  const MoeConfig& mc = config.moe;
  const int64_t hidden = config.hidden_size, E = mc.num_experts, k = mc.num_experts_per_token;
  const int64_t width = moe.width, I = moe.intermediate, R = T * k;
  const bool latent = mc.routed_expert_hidden_size.has_value();

  // Router: fp32 input, fp32 weights, fp32 GEMM.
  auto* router_logits = arena.take<float>(T * E);
  auto* expert_ids = arena.take<int32_t>(R);
  auto* expert_weights = arena.take<float>(R);
  kc::MoePlan plan;
  plan.expert_offsets = arena.take<int32_t>(E + 1);
  plan.sorted_assignments = arena.take<int32_t>(R);
  plan.assignment_pos = arena.take<int32_t>(R);
  const size_t plan_bytes = kc::moe_plan_workspace_bytes(T, static_cast<int>(k), static_cast<int>(E));
  auto* plan_workspace = arena.take<char>(static_cast<int64_t>(plan_bytes));
  DS_RETURN_IF_ERROR(arena_check("MoE router"));
  DS_RETURN_IF_ERROR(gemm.run_f32(normed_f32, hidden, moe.router, T, hidden, E, router_logits, E));
  kc::MoeRoutingConfig routing;
  routing.num_experts = static_cast<int>(E);
  routing.top_k = static_cast<int>(k);
  routing.num_groups = static_cast<int>(mc.num_expert_groups);
  routing.top_k_groups = static_cast<int>(mc.top_k_groups);
  routing.renormalize = mc.renormalize;
  routing.routed_scaling_factor = mc.routed_scaling_factor;
  DS_RETURN_IF_ERROR_CTX(
      kc::moe_route(routing, router_logits, moe.correction_bias, T, expert_ids, expert_weights, stream()), "moe_route");
  DS_RETURN_IF_ERROR_CTX(
      kc::moe_plan(expert_ids, T, static_cast<int>(k), static_cast<int>(E), plan, plan_workspace, plan_bytes, stream()),
      "moe_plan");

  // Expert inputs: x, or the latent down-projection of x (LatentMoE).
  const __nv_bfloat16* expert_in = normed;
  int64_t expert_in_stride = hidden;
  if (latent) {
    auto* latent_x = arena.take<__nv_bfloat16>(T * width);
    DS_RETURN_IF_ERROR(arena_check("MoE latent"));
    DS_RETURN_IF_ERROR(gemm.run(normed, hidden, moe.latent_down, T, hidden, width, latent_x, width));
    expert_in = latent_x;
    expert_in_stride = width;
  }
  auto* x_sorted = arena.take<__nv_bfloat16>(R * width);
  auto* activated = arena.take<__nv_bfloat16>(R * I);
  auto* y_sorted = arena.take<float>(R * width);
  DS_RETURN_IF_ERROR(arena_check("MoE experts"));
  DS_RETURN_IF_ERROR_CTX(
      kc::moe_gather_rows(expert_in, expert_in_stride, plan, T, static_cast<int>(k), width, x_sorted, stream()),
      "moe_gather_rows");
  kc::MoeFfnParams f;
  f.weights.gate_up = moe.experts_gate_up;
  f.weights.down = moe.experts_down;
  f.weights.num_experts = static_cast<int>(E);
  f.weights.width = width;
  f.weights.intermediate = I;
  f.glu = glu_kind(config);
  f.situ_beta = config.situ_beta;
  f.situ_linear_beta = config.situ_linear_beta;
  f.rows = R;
  f.x_sorted = x_sorted;
  f.expert_offsets = plan.expert_offsets;
  f.activated = activated;
  f.y_sorted = y_sorted;
  if (R <= kMoeDecodeRowsPerExpert * E) {
    DS_RETURN_IF_ERROR_CTX(kc::moe_expert_ffn_decode(f, stream()), "moe_expert_ffn_decode");
  } else {
    const size_t ffn_bytes = kc::moe_ffn_prefill_workspace_bytes(R, I);
    f.workspace = arena.take<char>(static_cast<int64_t>(ffn_bytes));
    f.workspace_bytes = ffn_bytes;
    DS_RETURN_IF_ERROR(arena_check("MoE prefill workspace"));
    std::vector<int32_t> offsets(static_cast<size_t>(E + 1));
    DS_CUDA_RETURN(cudaMemcpyAsync(offsets.data(), plan.expert_offsets, offsets.size() * sizeof(int32_t),
                                   cudaMemcpyDeviceToHost, stream()));
    DS_CUDA_RETURN(cudaStreamSynchronize(stream()));
    DS_RETURN_IF_ERROR_CTX(kc::moe_expert_ffn_prefill(f, offsets, gemm.handle(), stream()), "moe_expert_ffn_prefill");
  }

  if (latent) {
    auto* routed = arena.take<float>(T * width);
    auto* routed_bf16 = arena.take<__nv_bfloat16>(T * width);
    DS_RETURN_IF_ERROR(arena_check("MoE latent up"));
    DS_RETURN_IF_ERROR(
        kc::moe_combine(y_sorted, plan, expert_weights, T, static_cast<int>(k), width, false, routed, width, stream()));
    if (mc.latent_moe_use_norm) {
      DS_RETURN_IF_ERROR(
          kc::rms_norm(routed, width, moe.latent_norm, T, width, config.rms_norm_eps, routed_bf16, width, stream()));
    } else {
      DS_RETURN_IF_ERROR(kc::to_bf16(routed, T * width, routed_bf16, stream()));
    }
    DS_RETURN_IF_ERROR(gemm.run(routed_bf16, width, moe.latent_up, T, width, hidden, residual, hidden, true));
  } else {
    DS_RETURN_IF_ERROR(kc::moe_combine(y_sorted, plan, expert_weights, T, static_cast<int>(k), width,
                                       /*accumulate=*/true, residual, hidden, stream()));
  }
  if (moe.shared.gate_up != nullptr) DS_RETURN_IF_ERROR(run_dense_ffn(moe.shared, normed, hidden, T));
  return Status::ok();
}

// ---- the pass -----------------------------------------------------------------------------------------------

Status CudaBackend::Impl::forward_layers(const PassTables& t, const float** final_hidden) {
  const int64_t T = t.rows, hidden = config.hidden_size;
  const float eps = config.rms_norm_eps;
  DS_RETURN_IF_ERROR(
      kc::embedding_gather(weights->embed_tokens, config.vocab_size, hidden, t.d_tokens, T, residual, stream()));

  // attention(l, x): residual += attention(input_norm(x)); ffn(l, x): residual += ffn(post_attention_norm(x)).
  auto attention = [&](const DeviceLayer& layer, const float* x) -> Status {
    DS_RETURN_IF_ERROR(kc::rms_norm(x, hidden, layer.input_norm, T, hidden, eps, normed, hidden, stream()));
    return layer.kind == LayerKind::kKda ? run_kda(layer, t) : run_mla(layer, t);
  };
  auto ffn = [&](const DeviceLayer& layer, const float* x) -> Status {
    DS_RETURN_IF_ERROR(kc::rms_norm(x, hidden, layer.post_attention_norm, T, hidden, eps, normed, hidden, stream()));
    arena.reset();
    if (!layer.is_moe) return run_dense_ffn(layer.dense, normed, hidden, T);
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

Status CudaBackend::Impl::lm_head(const float* final_hidden, const PassTables& t, std::span<SequenceInput> batch,
                                  std::vector<std::vector<float>>* out) {
  const int64_t hidden = config.hidden_size, vocab = config.vocab_size;
  const auto W = static_cast<int64_t>(t.logit_rows.size());
  std::vector<int64_t> filled;
  if (out != nullptr) {
    out->assign(batch.size(), {});
    filled.assign(batch.size(), 0);
    for (size_t s = 0; s < batch.size(); ++s) {
      const int64_t rows = batch[s].all_logits ? static_cast<int64_t>(batch[s].tokens.size()) : 1;
      (*out)[s].resize(static_cast<size_t>(rows * vocab));
    }
  }
  for (int64_t begin = 0; begin < W; begin += logit_chunk) {
    const int64_t n = std::min(logit_chunk, W - begin);
    DS_RETURN_IF_ERROR(kc::gather_slots(final_hidden, hidden * 4, t.d_logit_rows + begin, n, head_rows, stream()));
    DS_RETURN_IF_ERROR(kc::rms_norm(head_rows, hidden, weights->final_norm, n, hidden, config.rms_norm_eps, head_normed,
                                    hidden, stream()));
    DS_RETURN_IF_ERROR(gemm.run(head_normed, hidden, weights->lm_head, n, hidden, vocab, logits, vocab));
    if (out == nullptr) continue;
    // Rows of one sequence are consecutive: copy each run in one piece.
    for (int64_t i = 0; i < n;) {
      const int32_t s = t.logit_seq[static_cast<size_t>(begin + i)];
      int64_t j = i;
      while (j < n && t.logit_seq[static_cast<size_t>(begin + j)] == s) ++j;
      std::vector<float>& dst = (*out)[static_cast<size_t>(s)];
      int64_t& at = filled[static_cast<size_t>(s)];
      DS_CUDA_RETURN(cudaMemcpyAsync(dst.data() + at * vocab, logits + i * vocab,
                                     static_cast<size_t>((j - i) * vocab) * sizeof(float), cudaMemcpyDeviceToHost,
                                     stream()));
      at += j - i;
      i = j;
    }
    DS_CUDA_RETURN(cudaStreamSynchronize(stream()));  // before the next piece overwrites `logits`
  }
  return Status::ok();
}

Status CudaBackend::Impl::run(std::span<SequenceInput> batch, std::vector<std::vector<float>>* out) {
  DS_RETURN_IF_ERROR(validate(batch));
  // A state resident on another backend: bring its host copy up to date and let it go (it is uploaded here).
  for (SequenceInput& in : batch) {
    if (in.state->residency() != nullptr && ours(*in.state, pools.get()) == nullptr) {
      DS_RETURN_IF_ERROR(in.state->sync_host());
      in.state->drop_device();
    }
  }
  std::lock_guard<std::recursive_mutex> lock(pools->mutex());
  DS_CUDA_RETURN(cudaSetDevice(pools->device()));
  DS_RETURN_IF_ERROR(claim_residencies(batch));
  PassTables tables;
  DS_RETURN_IF_ERROR(build_tables(batch, tables));
  const float* final_hidden = nullptr;
  const Status status = forward_layers(tables, &final_hidden);
  // Restore the AttnRes buffer rotation whatever happened (forward_layers moved `residual`).
  if (config.attn_res_block_size) {
    residual = spare_blocks.front();
  }
  DS_RETURN_IF_ERROR(status);
  DS_RETURN_IF_ERROR(lm_head(final_hidden, tables, batch, out));
  DS_CUDA_RETURN(cudaGetLastError());
  for (SequenceInput& in : batch) {
    in.state->set_host_stale(true);
    in.state->advance(static_cast<int64_t>(in.tokens.size()));
  }
  return Status::ok();
}

}  // namespace deltaserve::engine::cuda
