// Internals of CudaBackend: the device weights, pools and scratch of one model on one GPU, and the forward pass
// (cuda_model.cpp: the layers; cuda_backend.cpp: construction and the memory plan).
#pragma once

#include <compare>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/status.hpp"
#include "engine/backend.hpp"
#include "engine/cuda/cuda_backend.hpp"
#include "engine/cuda/cuda_util.hpp"
#include "engine/cuda/device_state.hpp"
#include "engine/cuda/device_weights.hpp"
#include "engine/cuda/gemm.hpp"
#include "engine/cuda/profile.hpp"
#include "engine/model.hpp"
#include "kernels/cuda/moe/moe.hpp"

namespace deltaserve::engine::cuda {

// Sequences per kda_chunk_prefill call when their states are gathered from the slot pool into a dense buffer.
inline constexpr int64_t kKdaPrefillGroup = 32;

// Per-pass tables, host side and their device copies (one upload per pass).
struct PassTables {
  int64_t rows = 0;  // T
  int64_t num_seqs = 0;
  bool pure_decode = false;           // every sequence has one token
  std::vector<int32_t> cu;            // [N + 1] token offsets
  std::vector<int32_t> slots;         // [N] KDA slot of each sequence
  std::vector<int32_t> context_lens;  // [N] tokens after this pass
  int max_context = 0;
  int max_pages = 0;                // block-table row length
  std::vector<int32_t> logit_rows;  // [W] rows whose logits are wanted
  std::vector<int32_t> logit_seq;   // [W] sequence of each
  int sample_top_logprobs = 0;      // sampled passes: the most alternatives a row reports (the results' row stride)
  // Device copies.
  const int32_t* d_tokens = nullptr;
  const int32_t* d_slots = nullptr;
  const int32_t* d_cu = nullptr;
  const int32_t* d_context_lens = nullptr;
  const int32_t* d_block_tables = nullptr;
  const int32_t* d_logit_rows = nullptr;
  const int64_t* d_slot_mapping = nullptr;
  // Sampled passes (forward_sample), [N] each: the rows' parameters, appended to the tables (one upload).
  const float* d_temperature = nullptr;
  const float* d_top_p = nullptr;
  const int32_t* d_top_k = nullptr;
  const int32_t* d_top_logprobs = nullptr;  // 0 for rows that want no logprobs
  const double* d_draw = nullptr;
};

// A sampled pass (CudaBackend::forward_sample): rows[i] is sampled from sequence i's last logits on the device;
// only the results come back, into *out.
struct PassSampling {
  std::span<const SampleRequest> rows;
  std::vector<SampledToken>* out = nullptr;
};

// Page-locked host memory (cudaMallocHost), freed on destruction.
class PinnedMemory {
 public:
  PinnedMemory() = default;
  ~PinnedMemory() { reset(); }
  PinnedMemory(const PinnedMemory&) = delete;
  PinnedMemory& operator=(const PinnedMemory&) = delete;
  [[nodiscard]] Status allocate(size_t bytes, const std::string& what);
  void reset();
  char* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  char* data_ = nullptr;
  size_t bytes_ = 0;
};

// A pure-decode pass captured as a CUDA graph is keyed by its exact batch size and the host bound of its
// contexts (the MLA split grid and block-table row length are baked into the graph; the kernels read the real
// lengths on the device). See cuda_graph.cpp for the policy.
struct DecodeGraphKey {
  int64_t batch = 0;
  int context_bound = 0;  // >= every context of the pass (a power of two, capped at the model limit); 0 without MLA
  int pages_bound = 1;    // block-table row length: ceil(context_bound / page_tokens)
  auto operator<=>(const DecodeGraphKey&) const = default;
};

struct DecodeGraphs {
  struct Entry {
    cudaGraphExec_t exec = nullptr;
    uint64_t last_use = 0;
  };
  std::map<DecodeGraphKey, Entry> graphs;
  std::set<DecodeGraphKey> seen;    // keys run eagerly once (the warm-up before a capture)
  std::set<DecodeGraphKey> failed;  // capture failed: these keys stay eager
  uint64_t clock = 0;
  int64_t captures = 0, replays = 0;
  DeviceMemory tables;           // fixed per-pass tables the graphs read (reallocation drops every graph)
  PinnedMemory staging;          // host side of `tables`
  cudaEvent_t staged = nullptr;  // the last upload from `staging` (reused only after it completed)
  void clear();                  // destroys every graph (keeps tables and counters)
  ~DecodeGraphs();
};

struct CudaBackend::Impl {
  ModelConfig config;
  CudaBackendOptions options;
  std::string device_name;
  StateShape shape;
  std::shared_ptr<DevicePools> pools;
  std::unique_ptr<DeviceWeights> weights;
  Gemm gemm;
  BackendCapacity capacity;

  // Scratch (sized for max_rows tokens).
  int64_t max_rows = 0;
  DeviceMemory stream_memory;        // residual (+ AttnRes blocks and the mix output), normed rows
  float* residual = nullptr;         // [R, hidden] fp32: the residual stream (AttnRes: the running block prefix)
  std::vector<float*> spare_blocks;  // AttnRes: buffers for sealed blocks (ceil(L / B) + 1)
  float* mixed = nullptr;            // [R, hidden] fp32: AttnRes mix output
  float* normed_f32 = nullptr;       // [R, hidden] fp32: normed input of the router
  __nv_bfloat16* normed = nullptr;   // [R, hidden] bf16: normed input of every projection
  DeviceMemory arena_memory;         // also the sampling workspace: sampling runs after the layers, when it is idle
  ScratchArena arena;                // per-layer temporaries
  DeviceMemory kda_workspace;        // kda_chunk_prefill workspace
  DeviceMemory kda_dense_states;     // [kKdaPrefillGroup, H, d, d] fp32 (head size 128 only)
  DeviceMemory mla_workspace;        // MLA attention workspace (grown on demand)
  int64_t logit_chunk = 0;           // LM-head rows per piece
  DeviceMemory head_memory;          // gathered final rows (fp32 + bf16) and logits [logit_chunk, vocab]
  float* head_rows = nullptr;
  __nv_bfloat16* head_normed = nullptr;
  float* logits = nullptr;
  int64_t sample_launch_rows = 0;  // rows per sampling launch (the arena holds that launch's workspace)
  DeviceMemory sample_memory;      // sampled results of a pass: tokens, logprobs, top ids, top values (max_rows rows)
  PinnedMemory sample_host;        // their host copy
  DeviceMemory table_memory;       // per-pass tables (grown on demand)
  std::vector<char> host_tables;
  DecodeGraphs decode_graphs;
  // Grid counter of kernels::cuda::moe_small_batch_route: allocated and zeroed at the first small-batch MoE layer,
  // left 0 by every launch.
  DeviceMemory moe_small_batch_counter;
  Profiler profiler;

  // The pass: resolve residencies (taking slots and pages), upload tables, run, copy logits (when `out`) or sample
  // (when `sampling`; then `out` is null), advance.
  [[nodiscard]] Status run(std::span<SequenceInput> batch, std::vector<std::vector<float>>* out,
                           const PassSampling* sampling = nullptr);

 private:
  [[nodiscard]] Status validate(std::span<SequenceInput> batch) const;
  [[nodiscard]] Status claim_residencies(std::span<SequenceInput> batch);
  // graph == nullptr: tables into table_memory (eager). Otherwise into the fixed graph tables with graph's layout.
  // With `sampling`, the rows' sampling parameters follow the tables (after everything a graph reads).
  [[nodiscard]] Status build_tables(std::span<SequenceInput> batch, PassTables& tables,
                                    const DecodeGraphKey* graph = nullptr, const PassSampling* sampling = nullptr);
  [[nodiscard]] Status forward_layers(const PassTables& tables, const float** final_hidden);
  [[nodiscard]] Status lm_head(const float* final_hidden, const PassTables& tables, std::span<SequenceInput> batch,
                               std::vector<std::vector<float>>* out, const PassSampling* sampling);
  // LM head pieces: logits of logit rows [begin, begin + n) into `logits`; their copy into `out`.
  [[nodiscard]] Status lm_head_piece(const float* final_hidden, const PassTables& tables, int64_t begin, int64_t n);
  void size_logits(std::span<SequenceInput> batch, std::vector<std::vector<float>>& out) const;
  [[nodiscard]] Status copy_logits(const PassTables& tables, int64_t begin, int64_t n,
                                   std::vector<std::vector<float>>& out, std::vector<int64_t>& filled);
  // Sampling (cuda_sample.cpp): the rows of logit rows [begin, begin + n), whose logits are in `logits`, into
  // sample_memory (asynchronous); then the results of the whole pass to the host (synchronises).
  [[nodiscard]] Status sample_piece(const PassTables& tables, int64_t begin, int64_t n);
  [[nodiscard]] Status fetch_samples(const PassTables& tables, const PassSampling& sampling);
  // CUDA graphs (cuda_graph.cpp): the key of a batch that may replay a graph (nullopt: eager), and the pass by
  // replay. *ran false: nothing was computed (the key's eager warm-up pass, or a capture that failed); run eagerly.
  std::optional<DecodeGraphKey> decode_graph_key(std::span<SequenceInput> batch) const;
  // The MLA context bound of a pure-decode pass whose longest context is `longest` (a power of two >= 512, capped at
  // the model limit; nullopt past the limit). Graphs are keyed by it and eager decode passes use it too: the MLA
  // decode split grid follows the bound, so a step computes the same whether it replays a graph or runs eagerly.
  std::optional<int64_t> decode_context_bound(int64_t longest) const;
  [[nodiscard]] Status run_decode_graph(std::span<SequenceInput> batch, const DecodeGraphKey& key,
                                        std::vector<std::vector<float>>* out, const PassSampling* sampling, bool* ran);
  [[nodiscard]] Status capture_decode_graph(const PassTables& tables, cudaGraphExec_t* exec);
  // The attention layers read `normed`, or with `unnormed` (decode batches of the skinny path) the fp32 layer input
  // whose input_norm their projections apply themselves (Gemm::run_shared_input on GemmNormInput).
  [[nodiscard]] Status run_kda(const DeviceLayer& layer, const PassTables& tables, const float* unnormed);
  [[nodiscard]] Status run_kda_prefill_128(const DeviceLayer& layer, const PassTables& tables, const __nv_bfloat16* q,
                                           const __nv_bfloat16* k, const __nv_bfloat16* v, const float* gate_raw,
                                           const float* beta, float* beta_group, __nv_bfloat16* o);
  [[nodiscard]] Status run_mla(const DeviceLayer& layer, const PassTables& tables, const float* unnormed);
  // `normed` / `normed_f32` hold the layer's normalised input, or (unnormed set) the caller left the norm with
  // norm_weight to it: fused into the small-batch launches when they take it, rms_norm_dual first otherwise.
  [[nodiscard]] Status run_moe(const DeviceMoe& moe, int64_t rows, const float* unnormed = nullptr,
                               const float* norm_weight = nullptr);
  [[nodiscard]] Status run_dense_ffn(const DeviceFfn& ffn, const __nv_bfloat16* x, int64_t x_stride, int64_t rows);
  [[nodiscard]] Status run_dense_ffn(const DeviceFfn& ffn, const GemmNormInput& x, int64_t rows);
  [[nodiscard]] Status run_dense_ffn(const DeviceFfn& ffn, int64_t rows,
                                     const std::function<Status(float*)>& gate_up_projection);
  [[nodiscard]] Status ensure_mla_workspace(size_t bytes);
  [[nodiscard]] Status arena_check(const char* where) const;
  cudaStream_t stream() const { return pools->stream(); }
};

// Bytes of the per-layer arena for `rows` tokens (the largest layer's temporaries).
size_t arena_bytes(const ModelConfig& config, int64_t rows);

}  // namespace deltaserve::engine::cuda
