// The layers of CudaBackend's forward pass: KDA (fused decode, chunked prefill for head size 128, the generic
// recurrence otherwise), MLA, MoE and the dense FFN. Each reads the normed input rows (bf16, fp32 for the router)
// and adds its output to the residual stream (the o_proj / down / combine GEMMs accumulate in place). At decode
// batches of the skinny path the attention layers get the un-normalised fp32 rows instead and their projections
// apply the input norm in the same launch (Gemm::fuses_input_norm).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "engine/cuda/cuda_model.hpp"
#include "kernels/cuda/gemm/small_batch.hpp"
#include "kernels/cuda/kda/kda.hpp"
#include "kernels/cuda/kda/kda_generic.hpp"
#include "kernels/cuda/mla/mla.hpp"
#include "kernels/cuda/moe/moe.hpp"
#include "kernels/cuda/ops/ops.hpp"

namespace deltaserve::engine::cuda {

namespace kc = kernels::cuda;

namespace {

constexpr float kL2NormEps = 1e-6f;  // as engine/model.cpp

kc::GluKind glu_kind(const ModelConfig& config) {
  return config.hidden_act == Activation::kSitu ? kc::GluKind::kSitu : kc::GluKind::kSwiGlu;
}

}  // namespace

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

Status CudaBackend::Impl::run_kda(const DeviceLayer& layer, const PassTables& t, const float* unnormed) {
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
  const bool fused_decode = d == kc::kKdaHeadDim && t.pure_decode;
  if (unnormed != nullptr && !fused_decode) {  // the unfused projections read `normed`
    profiler.mark(Phase::kNorms, stream());
    DS_RETURN_IF_ERROR(kc::rms_norm(unnormed, hidden, layer.input_norm, T, hidden, eps, normed, hidden, stream()));
    unnormed = nullptr;
  }
  profiler.mark(Phase::kKdaProjections, stream());
  if (!fused_decode) DS_RETURN_IF_ERROR(gemm.run(x, hidden, w.fg_a, T, hidden, low_width, low, low_width));

  if (fused_decode) {
    // Fused decode: conv, L2, gate, beta, recurrence and the gated norm in one kernel over the slot pool.
    auto* q = arena.take<__nv_bfloat16>(T * C);
    auto* k = arena.take<__nv_bfloat16>(T * C);
    auto* v = arena.take<__nv_bfloat16>(T * C);
    auto* gate_raw = arena.take<__nv_bfloat16>(T * C);
    auto* out_gate = arena.take<__nv_bfloat16>(T * C);
    auto* beta_raw = arena.take<__nv_bfloat16>(T * H);
    DS_RETURN_IF_ERROR(arena_check("KDA decode"));
    // Every projection of x in one launch for small batches (the skinny GEMM; one cuBLAS call each otherwise), on
    // the input norm of `unnormed` when the caller left it to them.
    const GemmTarget fg_a{w.fg_a, low_width, low, low_width};
    const GemmTarget q_target{w.qkv, C, q, C}, k_target{w.qkv + C * hidden, C, k, C};
    const GemmTarget v_target{w.qkv + 2 * C * hidden, C, v, C}, b_target{w.b_proj, H, beta_raw, H};
    auto project = [&](std::initializer_list<GemmTarget> targets) -> Status {
      if (unnormed == nullptr) return gemm.run_shared_input(x, hidden, T, hidden, targets);
      return gemm.run_shared_input(GemmNormInput{unnormed, hidden, layer.input_norm, eps, normed}, T, hidden, targets);
    };
    const GemmTarget f_b{w.f_b, C, gate_raw, C};
    // Small batches: the decode step computes the gate logits from `low` itself (kc::kKdaFusedGateMaxRows).
    const bool fused_gates = T <= kc::kKdaFusedGateMaxRows;
    if (low_rank_gate) {
      DS_RETURN_IF_ERROR(project({fg_a, q_target, k_target, v_target, b_target}));
      // f_b and g_b on the two halves of `low` in one launch (g_b first where they run one by one).
      if (!fused_gates) {
        DS_RETURN_IF_ERROR(gemm.run_shared_input(low, low_width, T, r, {GemmTarget{w.g_b, C, out_gate, C, r}, f_b}));
      }
    } else {
      const GemmTarget g_target{w.g_proj, C, out_gate, C};
      DS_RETURN_IF_ERROR(project({fg_a, q_target, k_target, v_target, b_target, g_target}));
      if (!fused_gates) DS_RETURN_IF_ERROR(gemm.run_shared_input(low, low_width, T, r, {f_b}));
    }
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
    if (fused_gates) {
      p.gate_raw = nullptr;
      p.gate_low = low;
      p.gate_low_stride = low_width;
      p.f_b = w.f_b;
      if (low_rank_gate) {
        p.g_b = w.g_b;
        p.out_gate = nullptr;
      }
    }
    // Valid here: the kernel enqueued just before is the f_b (+ g_b) GEMM above, or with fused gates the
    // projections (they write gate_raw / out_gate, or low, q, k, v and beta; with programmatic dependent launch they
    // let this kernel start only after their own wait, when everything before them is complete), the slot table was
    // uploaded at the start of the pass and this layer's state last written by its previous step.
    // Issuing the state loads before the wait is faster at every batch size.
    p.early_state_loads = true;
    profiler.mark(Phase::kKdaRecurrence, stream());
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
      profiler.mark(Phase::kKdaConv, stream());
      DS_RETURN_IF_ERROR_CTX(kc::kda_prep(prep, stream()), "kda_prep");
      profiler.mark(Phase::kKdaRecurrence, stream());
      DS_RETURN_IF_ERROR(run_kda_prefill_128(layer, t, q, k, v, gate_raw, beta, beta_group, o));
      profiler.mark(Phase::kKdaOutput, stream());
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
      profiler.mark(Phase::kKdaConv, stream());
      DS_RETURN_IF_ERROR_CTX(kc::kda_prep_f32(prep, kc::KdaPrepF32Outputs{q, k, v}, stream()), "kda_prep_f32");
      profiler.mark(Phase::kKdaRecurrence, stream());
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
      profiler.mark(Phase::kKdaOutput, stream());
      DS_RETURN_IF_ERROR(kc::kda_gated_output_norm(o, out_gate, C, w.o_norm, T, static_cast<int>(H),
                                                   static_cast<int>(d), eps, out, stream()));
    }
  }
  profiler.mark(Phase::kKdaOutput, stream());
  return gemm.run(out, C, w.o_proj, T, C, hidden, residual, hidden, /*accumulate=*/true);
}

// ---- MLA ----------------------------------------------------------------------------------------------------

Status CudaBackend::Impl::run_mla(const DeviceLayer& layer, const PassTables& t, const float* unnormed) {
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
  profiler.mark(Phase::kMlaProjections, stream());
  float* gate = nullptr;  // the output gate's pre-activation, projected with the others when they are fused
  if (unnormed != nullptr) {
    // Every projection of x (kv_a fp32, q_proj bf16 without q_lora, the gate fp32) in one launch on the input norm
    // of `unnormed`.
    if (m.use_output_gate) {
      gate = arena.take<float>(T * v_width);
      DS_RETURN_IF_ERROR(arena_check("MLA gate"));
    }
    const GemmNormInput input{unnormed, hidden, layer.input_norm, eps, normed};
    const GemmTarget kv_a{w.qa_kva, projected, qa_kv, projected};
    if (m.q_lora_rank) {
      DS_RETURN_IF_ERROR(gate != nullptr ? gemm.run_shared_input(input, T, hidden,
                                                                 {kv_a, GemmTarget{w.g_proj, v_width, gate, v_width}})
                                         : gemm.run_shared_input(input, T, hidden, {kv_a}));
    } else {
      const GemmTarget q_target{w.q_proj, H * qk, q, H * qk};
      DS_RETURN_IF_ERROR(
          gate != nullptr
              ? gemm.run_shared_input(input, T, hidden, {kv_a, q_target, GemmTarget{w.g_proj, v_width, gate, v_width}})
              : gemm.run_shared_input(input, T, hidden, {kv_a, q_target}));
    }
  } else {
    DS_RETURN_IF_ERROR(gemm.run(x, hidden, w.qa_kva, T, hidden, projected, qa_kv, projected));
  }
  if (m.q_lora_rank) {
    auto* q_low = arena.take<__nv_bfloat16>(T * q_lora);
    DS_RETURN_IF_ERROR(arena_check("MLA q_lora"));
    DS_RETURN_IF_ERROR(kc::rms_norm(qa_kv, projected, w.q_a_norm, T, q_lora, eps, q_low, q_lora, stream()));
    DS_RETURN_IF_ERROR(gemm.run(q_low, q_lora, w.q_b, T, q_lora, H * qk, q, H * qk));
  } else if (unnormed == nullptr) {
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
  profiler.mark(Phase::kMlaAttention, stream());
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
  // Decode without an output gate: the attention writes the bf16 input of o_proj itself (no conversion launch).
  const bool bf16_out = t.pure_decode && !m.use_output_gate;
  if (bf16_out) {
    a.out = nullptr;
    a.out_bf16 = gated;
  }
  DS_RETURN_IF_ERROR(ensure_mla_workspace(
      kc::mla_attention_workspace_bytes(a.num_heads, a.kv_lora_rank, a.qk_rope, T, t.max_context)));
  a.workspace = mla_workspace.data();
  a.workspace_bytes = mla_workspace.bytes();
  if (t.pure_decode) {
    DS_RETURN_IF_ERROR_CTX(kc::mla_decode(a, stream()), "mla_decode");
  } else {
    // The host copies of the query offsets and context lengths let mla_prefill choose the naive (decompressed,
    // tensor-core flash attention) form for long chunks; it then uses the backend's cuBLAS handle on our stream.
    a.host_cu_q = t.cu.data();
    a.host_context_lens = t.context_lens.data();
    a.cublas = gemm.handle();
    DS_RETURN_IF_ERROR_CTX(kc::mla_prefill(a, stream()), "mla_prefill");
  }

  profiler.mark(Phase::kMlaOutput, stream());
  if (m.use_output_gate) {
    if (gate == nullptr) {
      gate = arena.take<float>(T * v_width);
      DS_RETURN_IF_ERROR(arena_check("MLA gate"));
      DS_RETURN_IF_ERROR(gemm.run(x, hidden, w.g_proj, T, hidden, v_width, gate, v_width));
    }
    DS_RETURN_IF_ERROR(kc::sigmoid_gate(attention, gate, T * v_width, gated, stream()));
  } else if (!bf16_out) {
    DS_RETURN_IF_ERROR(kc::to_bf16(attention, T * v_width, gated, stream()));
  }
  return gemm.run(gated, v_width, w.o_proj, T, v_width, hidden, residual, hidden, /*accumulate=*/true);
}

// ---- FFN ----------------------------------------------------------------------------------------------------

// residual += down(glu(gate_up(x))). Takes its temporaries from the arena without resetting it.
Status CudaBackend::Impl::run_dense_ffn(const DeviceFfn& ffn, const __nv_bfloat16* x, int64_t x_stride, int64_t rows) {
  return run_dense_ffn(ffn, rows, [&](float* gate_up) {
    return gemm.run(x, x_stride, ffn.gate_up, rows, ffn.width, 2 * ffn.intermediate, gate_up, 2 * ffn.intermediate);
  });
}

// The same on the RMSNorm of fp32 rows, which the gate/up projection applies itself where it can.
Status CudaBackend::Impl::run_dense_ffn(const DeviceFfn& ffn, const GemmNormInput& x, int64_t rows) {
  return run_dense_ffn(ffn, rows, [&](float* gate_up) {
    const int64_t out = 2 * ffn.intermediate;
    return gemm.run_shared_input(x, rows, ffn.width, {GemmTarget(ffn.gate_up, out, gate_up, out)});
  });
}

Status CudaBackend::Impl::run_dense_ffn(const DeviceFfn& ffn, int64_t rows,
                                        const std::function<Status(float*)>& gate_up_projection) {
  const int64_t I = ffn.intermediate, width = ffn.width;
  auto* gate_up = arena.take<float>(rows * 2 * I);
  auto* activated = arena.take<__nv_bfloat16>(rows * I);
  DS_RETURN_IF_ERROR(arena_check("FFN"));
  DS_RETURN_IF_ERROR(gate_up_projection(gate_up));
  DS_RETURN_IF_ERROR(
      kc::glu(gate_up, rows, I, glu_kind(config), config.situ_beta, config.situ_linear_beta, activated, stream()));
  return gemm.run(activated, I, ffn.down, rows, I, width, residual, config.hidden_size, /*accumulate=*/true);
}

Status CudaBackend::Impl::run_moe(const DeviceMoe& moe, int64_t T, const float* unnormed, const float* norm_weight) {
  const MoeConfig& mc = config.moe;
  // The input norm the caller left to this layer: rms_norm_dual, unless the small-batch launches fuse it below.
  auto norm_input = [&]() -> Status {
    if (unnormed == nullptr) return Status::ok();
    DS_RETURN_IF_ERROR(kc::rms_norm_dual(unnormed, config.hidden_size, norm_weight, T, config.hidden_size,
                                         config.rms_norm_eps, normed, config.hidden_size, normed_f32,
                                         config.hidden_size, stream()));
    unnormed = nullptr;
    return Status::ok();
  };
  const int64_t hidden = config.hidden_size, E = mc.num_experts, k = mc.num_experts_per_token;
  const int64_t width = moe.width, I = moe.intermediate, R = T * k;
  const bool latent = mc.routed_expert_hidden_size.has_value();
  const int64_t shared_I = moe.shared.gate_up != nullptr ? moe.shared.intermediate : 0;

  // Decode batches (<= kSmallBatchMoeTokens tokens, no LatentMoE): the whole layer in three launches
  // (kernels/cuda/moe/moe.hpp, moe_small_batch_*). The kernels take up to 16 tokens; the layer alone beats the chain
  // below up to 8 tokens, but at 8 the engine's whole decode step is slower through it, so it stops at 4. Its
  // temporaries are fewer than the chain's (no x_sorted / y_sorted), so whatever the arena was planned for fits;
  // checked anyway, since the router's partial sums grow with E.
  constexpr int64_t kSmallBatchMoeTokens = 4;
  if (!latent && width == hidden && T <= kSmallBatchMoeTokens &&
      kc::moe_small_batch_fits(T, static_cast<int>(k), static_cast<int>(E), hidden, I, shared_I)) {
    const size_t workspace_bytes =
        kc::moe_small_batch_workspace_bytes(T, static_cast<int>(k), static_cast<int>(E), hidden);
    size_t small_bytes = 0, chain_bytes = 0;
    for (const int64_t bytes : {T * E * 4, R * 4, R * 4, (E + 1) * 4, R * 4, R * 4, R * I * 2, T * shared_I * 2,
                                static_cast<int64_t>(workspace_bytes)}) {
      small_bytes += align_up(static_cast<size_t>(bytes));
    }
    for (const int64_t bytes :
         {T * E * 4, R * 4, R * 4, (E + 1) * 4, R * 4, R * 4,
          static_cast<int64_t>(kc::moe_plan_workspace_bytes(T, static_cast<int>(k), static_cast<int>(E))),
          R * width * 2, R * I * 2, R * width * 4, T * 2 * shared_I * 4, T * shared_I * 2}) {
      chain_bytes += align_up(static_cast<size_t>(bytes));
    }
    // The launch's grid counter must be zero before its first use: allocated and cleared once, outside a capture
    // (the first pass of each decode batch size runs eagerly before its graph is captured).
    if (moe_small_batch_counter.data() == nullptr) {
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      DS_CUDA_RETURN(cudaStreamIsCapturing(stream(), &capture));
      if (capture == cudaStreamCaptureStatusNone &&
          moe_small_batch_counter.allocate(sizeof(unsigned int), "MoE small-batch grid counter").is_ok()) {
        DS_CUDA_RETURN(cudaMemsetAsync(moe_small_batch_counter.data(), 0, sizeof(unsigned int), stream()));
      }
    }
    if (small_bytes <= chain_bytes && moe_small_batch_counter.data() != nullptr) {
      kc::MoeSmallBatchParams p;
      p.routing.num_experts = static_cast<int>(E);
      p.routing.top_k = static_cast<int>(k);
      p.routing.num_groups = static_cast<int>(mc.num_expert_groups);
      p.routing.top_k_groups = static_cast<int>(mc.top_k_groups);
      p.routing.renormalize = mc.renormalize;
      p.routing.routed_scaling_factor = mc.routed_scaling_factor;
      p.tokens = T;
      p.hidden = hidden;
      p.x_f32 = normed_f32;
      p.x_f32_stride = hidden;
      p.router = moe.router;
      p.correction_bias = moe.correction_bias;
      p.x = normed;
      p.x_stride = hidden;
      p.experts.gate_up = moe.experts_gate_up;
      p.experts.down = moe.experts_down;
      p.experts.num_experts = static_cast<int>(E);
      p.experts.width = width;
      p.experts.intermediate = I;
      p.shared_gate_up = moe.shared.gate_up;
      p.shared_down = moe.shared.down;
      p.shared_intermediate = shared_I;
      p.glu = glu_kind(config);
      p.situ_beta = config.situ_beta;
      p.situ_linear_beta = config.situ_linear_beta;
      p.logits = arena.take<float>(T * E);
      p.expert_ids = arena.take<int32_t>(R);
      p.weights = arena.take<float>(R);
      p.plan.expert_offsets = arena.take<int32_t>(E + 1);
      p.plan.sorted_assignments = arena.take<int32_t>(R);
      p.plan.assignment_pos = arena.take<int32_t>(R);
      p.activated = arena.take<__nv_bfloat16>(R * I);
      p.shared_activated = arena.take<__nv_bfloat16>(T * shared_I);
      p.workspace = arena.take<char>(static_cast<int64_t>(workspace_bytes));
      p.workspace_bytes = workspace_bytes;
      p.residual = residual;
      p.residual_stride = hidden;
      p.counter = static_cast<unsigned int*>(moe_small_batch_counter.data());
      if (unnormed != nullptr) {
        // The fused norm reads the residual stream itself (launch 3 adds to it only after launches 1 and 2 are
        // done).
        p.x_f32 = unnormed;
        p.x = nullptr;
        p.norm_weight = norm_weight;
        p.norm_eps = config.rms_norm_eps;
      }
      DS_RETURN_IF_ERROR(arena_check("MoE small batch"));
      profiler.mark(Phase::kMoeRouter, stream());
      DS_RETURN_IF_ERROR_CTX(kc::moe_small_batch_route(p, stream()), "moe_small_batch_route");
      profiler.mark(Phase::kMoeExpertFfn, stream());
      DS_RETURN_IF_ERROR_CTX(kc::moe_small_batch_experts(p, stream()), "moe_small_batch_experts");
      return Status::ok();
    }
  }

  DS_RETURN_IF_ERROR(norm_input());
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
  profiler.mark(Phase::kMoeRouter, stream());
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
  profiler.mark(Phase::kMoePlan, stream());
  DS_RETURN_IF_ERROR_CTX(
      kc::moe_plan(expert_ids, T, static_cast<int>(k), static_cast<int>(E), plan, plan_workspace, plan_bytes, stream()),
      "moe_plan");

  // Expert inputs: x, or the latent down-projection of x (LatentMoE).
  profiler.mark(Phase::kMoeExpertFfn, stream());
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
  DS_RETURN_IF_ERROR_CTX(kc::moe_expert_ffn_decode(f, stream()), "moe_expert_ffn_decode");

  profiler.mark(Phase::kMoeCombine, stream());
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
  if (moe.shared.gate_up != nullptr) {
    profiler.mark(Phase::kSharedExperts, stream());
    DS_RETURN_IF_ERROR(run_dense_ffn(moe.shared, normed, hidden, T));
  }
  return Status::ok();
}

}  // namespace deltaserve::engine::cuda
