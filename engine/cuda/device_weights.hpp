// The model's weights in device memory. Projections bf16, row-major [out, in] as in the checkpoint; norms, conv
// taps, gate parameters, the router and AttnRes vectors fp32. Some tensors are packed at load so one GEMM serves
// several projections of the same input:
//   KDA  qkv      [3·C, hidden]      = q_proj ; k_proj ; v_proj
//   KDA  fg_a     [2·r or r, hidden] = f_a_proj ; g_a_proj (g_a only with the low-rank output gate)
//   MLA  qa_kva   [q_lora + width, hidden] = q_a_proj ; kv_a_proj_with_mqa   (q_lora set; else kv_a alone)
//   FFN  gate_up  [2·I, width]       = gate (w1) ; up (w3)      (dense FFN, shared experts, every routed expert)
// Routed experts are contiguous: gate_up [E, 2I, width], down [E, width, I] (kernels/cuda/moe/moe.hpp layout).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/status.hpp"
#include "engine/checkpoint/safetensors.hpp"
#include "engine/cuda/cuda_util.hpp"
#include "engine/model_config.hpp"
#include "engine/model_weights.hpp"

namespace deltaserve::engine::cuda {

using bf16 = __nv_bfloat16;

struct DeviceFfn {
  bf16* gate_up = nullptr;  // [2I, width]
  bf16* down = nullptr;     // [width, I]
  int64_t width = 0, intermediate = 0;
};

struct DeviceKda {
  bf16* qkv = nullptr;                                            // [3C, hidden]
  float *q_conv = nullptr, *k_conv = nullptr, *v_conv = nullptr;  // [C, K]
  float* a_log = nullptr;                                         // [H]
  float* dt_bias = nullptr;                                       // [C]
  bf16* fg_a = nullptr;                                           // [r (+ r), hidden]
  bf16* f_b = nullptr;                                            // [C, r]
  bf16* g_b = nullptr;                                            // [C, r] (low-rank output gate)
  bf16* g_proj = nullptr;                                         // [C, hidden] (full-rank output gate)
  bf16* b_proj = nullptr;                                         // [H, hidden]
  float* o_norm = nullptr;                                        // [d]
  bf16* o_proj = nullptr;                                         // [hidden, C]
};

struct DeviceMla {
  bf16* q_proj = nullptr;      // [H·qk, hidden] (no q_lora)
  bf16* qa_kva = nullptr;      // [q_lora + width, hidden] or [width, hidden]
  float* q_a_norm = nullptr;   // [q_lora]
  bf16* q_b = nullptr;         // [H·qk, q_lora]
  float* kv_a_norm = nullptr;  // [kv_lora]
  bf16* kv_b = nullptr;        // [H·(nope + v), kv_lora]
  bf16* g_proj = nullptr;      // [H·v, hidden] (output gate)
  bf16* o_proj = nullptr;      // [hidden, H·v]
};

struct DeviceMoe {
  float* router = nullptr;           // [E, hidden] fp32
  float* correction_bias = nullptr;  // [E] fp32
  bf16* experts_gate_up = nullptr;   // [E, 2I, width]
  bf16* experts_down = nullptr;      // [E, width, I]
  int64_t width = 0, intermediate = 0;
  DeviceFfn shared;              // gate_up null when there is no shared expert
  bf16* latent_down = nullptr;   // [latent, hidden]
  float* latent_norm = nullptr;  // [latent]
  bf16* latent_up = nullptr;     // [hidden, latent]
};

struct DeviceAttnRes {
  float* norm = nullptr;  // [hidden]
  float* proj = nullptr;  // [hidden]
};

struct DeviceLayer {
  LayerKind kind = LayerKind::kKda;
  int64_t slot = 0;  // ordinal among layers of its kind (RequestState::kda / ::mla index, MLA pool layer)
  float* input_norm = nullptr;
  float* post_attention_norm = nullptr;
  DeviceKda kda;
  DeviceMla mla;
  bool is_moe = false;
  DeviceFfn dense;
  DeviceMoe moe;
  DeviceAttnRes attention_res, mlp_res;
};

struct DeviceWeights {
  bf16* embed_tokens = nullptr;  // [vocab, hidden]
  float* final_norm = nullptr;   // [hidden]
  bf16* lm_head = nullptr;       // [vocab, hidden] (== embed_tokens when tied)
  DeviceAttnRes output_res;
  std::vector<DeviceLayer> layers;
  int64_t bytes = 0;  // device bytes of all weights
  std::vector<DeviceMemory> memory;
};

// Where the values of each checkpoint tensor come from.
struct WeightSource {
  const ModelWeights* host = nullptr;              // host fp32 tensors (the CPU loader's output), or
  const Checkpoint* checkpoint = nullptr;          // streamed tensor by tensor, or
  std::optional<uint64_t> random_seed;             // initialised on the device
  std::function<void(int64_t, int64_t)> progress;  // (bytes done, bytes total) of device weight bytes
};

// Allocates and fills every weight of `config`. Errors name the tensor.
Result<std::unique_ptr<DeviceWeights>> load_device_weights(const ModelConfig& config, const WeightSource& source,
                                                           cudaStream_t stream);

// Device bytes load_device_weights will allocate for `config` (before alignment padding).
int64_t device_weight_bytes(const ModelConfig& config);

}  // namespace deltaserve::engine::cuda
