// CudaBackend construction: device and weights, the memory plan (scratch, state slots, MLA pages) and the thin
// Backend methods; the pass itself is in cuda_model.cpp.
#include "engine/cuda/cuda_backend.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "engine/cuda/cuda_model.hpp"
#include "engine/device_memory_plan.hpp"
#include "kernels/cuda/kda/kda.hpp"
#include "kernels/cuda/mla/mla.hpp"
#include "kernels/cuda/moe/moe.hpp"
#include "kernels/cuda/ops/sampling.hpp"

namespace deltaserve::engine::cuda {

namespace kc = kernels::cuda;

namespace {

// Shapes the kernels cannot take, reported before anything is allocated.
Status check_supported(const ModelConfig& c, const CudaBackendOptions& o) {
  auto unsupported = [](const std::string& what) { return unimplemented("CUDA backend: " + what); };
  if (c.hidden_size % 8 != 0) return unsupported("hidden_size must be a multiple of 8");
  if (c.num_layers_of(LayerKind::kKda) > 0) {
    if (c.kda.head_dim > 128) return unsupported("KDA head_dim above 128");
    if (c.kda.conv_kernel_size < 1 || c.kda.conv_kernel_size > 4) return unsupported("KDA conv kernel outside [1, 4]");
  }
  if (c.num_layers_of(LayerKind::kMla) > 0) {
    const MlaConfig& m = c.mla;
    if (m.kv_lora_rank % 8 != 0 || m.qk_rope_head_dim % 8 != 0) {
      return unsupported("MLA kv_lora_rank and qk_rope_head_dim must be multiples of 8");
    }
    if (m.kv_lora_rank > kc::kMlaMaxKvLora || m.qk_rope_head_dim > kc::kMlaMaxRope ||
        m.qk_nope_head_dim > kc::kMlaMaxNope || m.v_head_dim > kc::kMlaMaxVHead || m.num_heads > kc::kMlaMaxHeads) {
      return unsupported("MLA dimensions beyond the kernels' limits (kernels/cuda/mla/mla.hpp)");
    }
  }
  if (c.moe.num_experts > 0) {
    const MoeConfig& m = c.moe;
    if (m.num_experts > kc::kMoeMaxExperts || m.num_experts_per_token > kc::kMoeMaxTopK) {
      return unsupported("MoE beyond the router's limits (1024 experts, top-32)");
    }
    if (m.routed_expert_hidden_size.value_or(c.hidden_size) % 8 != 0 || m.moe_intermediate_size % 8 != 0) {
      return unsupported("MoE expert widths must be multiples of 8");
    }
  }
  if (o.page_tokens < 16 || o.page_tokens > kc::kMlaMaxPageSize || o.page_tokens % 16 != 0) {
    return invalid_argument("page_tokens must be a multiple of 16 in [16, 256]");
  }
  if (o.max_batch_tokens < 1) return invalid_argument("max_batch_tokens must be positive");
  if (o.max_requests < 1) return invalid_argument("max_requests must be positive");
  if (!(o.memory_fraction > 0.0 && o.memory_fraction <= 1.0)) return invalid_argument("memory_fraction in (0, 1]");
  return Status::ok();
}

// Allocates the fixed scratch of `impl` for max_rows tokens.
Status allocate_scratch(CudaBackend::Impl& impl) {
  const ModelConfig& c = impl.config;
  const int64_t R = impl.max_rows, hidden = c.hidden_size;
  const size_t row_f32 = align_up(static_cast<size_t>(R * hidden) * 4);
  const size_t row_bf16 = align_up(static_cast<size_t>(R * hidden) * 2);
  const int64_t rotating =
      c.attn_res_block_size ? (c.num_layers + *c.attn_res_block_size - 1) / *c.attn_res_block_size + 1 : 1;
  const int64_t f32_buffers = rotating + (c.attn_res_block_size ? 1 : 0) + 1;  // + mixed + normed_f32
  DS_RETURN_IF_ERROR(
      impl.stream_memory.allocate(row_f32 * static_cast<size_t>(f32_buffers) + row_bf16, "residual stream"));
  char* base = impl.stream_memory.as<char>();
  impl.spare_blocks.clear();
  for (int64_t i = 0; i < rotating; ++i) impl.spare_blocks.push_back(reinterpret_cast<float*>(base + i * row_f32));
  impl.residual = impl.spare_blocks.front();
  size_t at = static_cast<size_t>(rotating) * row_f32;
  if (c.attn_res_block_size) {
    impl.mixed = reinterpret_cast<float*>(base + at);
    at += row_f32;
  }
  impl.normed_f32 = reinterpret_cast<float*>(base + at);
  at += row_f32;
  impl.normed = reinterpret_cast<__nv_bfloat16*>(base + at);

  // LM head in pieces of at most ~256 MiB of logits.
  const int64_t vocab = c.vocab_size;
  impl.logit_chunk = std::clamp<int64_t>((int64_t{256} << 20) / (vocab * 4), 1, std::min<int64_t>(R, 1024));

  // The layer arena doubles as the sampling workspace (sampling runs after the layers): one launch samples a whole
  // LM-head piece, of no more sequences than there can be state slots. Kimi's arena at 8192 rows (~1.3 GB) already
  // holds the 16 bytes per logit of a 409-row piece of 163840 logits (~1.1 GB); small configurations grow it.
  impl.sample_launch_rows = std::min(impl.logit_chunk, impl.options.max_requests);
  const size_t arena = std::max(arena_bytes(c, R),
                                align_up(kc::sample_workspace_bytes(static_cast<int>(impl.sample_launch_rows), vocab)));
  DS_RETURN_IF_ERROR(impl.arena_memory.allocate(arena, "layer scratch and sampling workspace"));
  impl.arena.assign(impl.arena_memory.data(), arena);
  // Sampled results of up to R sequences: token, logprob and up to 20 (id, logprob) alternatives each.
  const size_t sample_bytes = static_cast<size_t>(R) * (8 + 8 * kc::kMaxSampleTopLogprobs);
  DS_RETURN_IF_ERROR(impl.sample_memory.allocate(sample_bytes, "sampled tokens"));
  DS_RETURN_IF_ERROR(impl.sample_host.allocate(sample_bytes, "sampled tokens (host)"));

  const StateShape& s = impl.shape;
  if (s.kda_layers > 0 && s.head_dim == kc::kKdaHeadDim) {
    const int H = static_cast<int>(s.heads);
    size_t workspace = kc::kda_prefill_workspace_bytes({0, static_cast<int32_t>(R)}, H);
    if (R > kKdaPrefillGroup) {  // a group of single tokens and one long sequence: the most chunks per group
      std::vector<int32_t> cu;
      for (int32_t i = 0; i < kKdaPrefillGroup; ++i) cu.push_back(i);
      cu.push_back(static_cast<int32_t>(R));
      workspace = std::max(workspace, kc::kda_prefill_workspace_bytes(cu, H));
    }
    DS_RETURN_IF_ERROR(impl.kda_workspace.allocate(align_up(workspace), "KDA prefill workspace"));
    DS_RETURN_IF_ERROR(impl.kda_dense_states.allocate(static_cast<size_t>(kKdaPrefillGroup * s.state_floats()) * 4,
                                                      "KDA gathered states"));
  }
  if (s.mla_layers > 0) {
    const MlaConfig& m = c.mla;
    const int context = static_cast<int>(std::min<int64_t>(
        c.max_position_embeddings > 0 ? c.max_position_embeddings : int64_t{1} << 20, int64_t{1} << 30));
    // Sized for up to R query tokens with contexts up to the model's limit (the kernels' maximum over both).
    const size_t workspace =
        kc::mla_attention_workspace_bytes(static_cast<int>(m.num_heads), static_cast<int>(m.kv_lora_rank),
                                          static_cast<int>(m.qk_rope_head_dim), R, context);
    DS_RETURN_IF_ERROR(impl.mla_workspace.allocate(align_up(workspace), "MLA attention workspace"));
  }

  const size_t head_f32 = align_up(static_cast<size_t>(impl.logit_chunk * hidden) * 4);
  const size_t head_bf16 = align_up(static_cast<size_t>(impl.logit_chunk * hidden) * 2);
  DS_RETURN_IF_ERROR(impl.head_memory.allocate(
      head_f32 + head_bf16 + align_up(static_cast<size_t>(impl.logit_chunk * vocab) * 4), "LM head"));
  impl.head_rows = impl.head_memory.as<float>();
  impl.head_normed = reinterpret_cast<__nv_bfloat16*>(impl.head_memory.as<char>() + head_f32);
  impl.logits = reinterpret_cast<float*>(impl.head_memory.as<char>() + head_f32 + head_bf16);
  // Tables of a pass of R tokens in R sequences with short contexts; grown on demand.
  DS_RETURN_IF_ERROR(impl.table_memory.allocate(align_up(static_cast<size_t>(R) * 64 + 4096), "per-pass tables"));
  return Status::ok();
}

Result<std::shared_ptr<Backend>> make_backend(const ModelConfig& config, const WeightSource& source,
                                              const CudaBackendOptions& options) {
  DS_RETURN_IF_ERROR(check_supported(config, options));
  auto impl = std::make_unique<CudaBackend::Impl>();
  impl->config = config;
  impl->options = options;
  impl->shape = StateShape::of(config);
  impl->max_rows = options.max_batch_tokens;
  impl->profiler.enable(options.profile);

  DS_CUDA_RETURN(cudaSetDevice(options.device));
  DS_CUDA_RETURN(cudaFree(nullptr));  // creates the context, so cudaMemGetInfo sees its cost
  cudaDeviceProp props{};
  DS_CUDA_RETURN(cudaGetDeviceProperties(&props, options.device));
  impl->device_name = "cuda:" + std::to_string(options.device) + " (" + props.name + ")";
  impl->pools = std::make_shared<DevicePools>(options.device, impl->shape);
  DS_RETURN_IF_ERROR(impl->pools->create_stream());
  DS_RETURN_IF_ERROR(impl->gemm.init(impl->pools->stream()));

  size_t free_bytes = 0, total_bytes = 0;
  DS_CUDA_RETURN(cudaMemGetInfo(&free_bytes, &total_bytes));
  const auto budget = static_cast<int64_t>(
      std::min<double>(static_cast<double>(free_bytes), options.memory_fraction * static_cast<double>(total_bytes)));
  const int64_t weight_bytes = device_weight_bytes(config);
  if (weight_bytes > budget) {
    return Status(StatusCode::kResourceExhausted,
                  "CUDA backend: the weights need " + std::to_string(weight_bytes) + " bytes, the budget is " +
                      std::to_string(budget) + " (memory_fraction " + std::to_string(options.memory_fraction) + " of " +
                      std::to_string(total_bytes) + ", " + std::to_string(free_bytes) + " free)");
  }
  const int64_t own_before = DeviceMemory::live_bytes();
  DS_ASSIGN_OR_RETURN(impl->weights, load_device_weights(config, source, impl->pools->stream()));

  DS_RETURN_IF_ERROR(allocate_scratch(*impl));
  size_t free_after_scratch = 0;
  DS_CUDA_RETURN(cudaMemGetInfo(&free_after_scratch, &total_bytes));
  // Slots and pages from what is left (engine/device_memory_plan.hpp). The backend's own allocations bound what the
  // drop in free memory may count as its own: another worker on the same device may allocate its pools meanwhile.
  const StateShape& s = impl->shape;
  DeviceMemoryPlanInput plan_input;
  plan_input.budget = budget;
  plan_input.device_drop = static_cast<int64_t>(free_bytes) - static_cast<int64_t>(free_after_scratch);
  plan_input.own_allocated = DeviceMemory::live_bytes() - own_before;
  plan_input.slot_bytes = std::max<int64_t>(s.slot_bytes(), 1);
  plan_input.page_bytes = s.mla_layers > 0 ? s.page_bytes(options.page_tokens) : 0;
  plan_input.state_slots = options.state_slots;
  plan_input.cache_pages = options.cache_pages;
  plan_input.max_requests = options.max_requests;
  const DeviceMemoryPlan plan = plan_device_memory(plan_input);
  const int64_t slots = plan.slots, pages = plan.pages;
  if (!plan.fits()) {
    return Status(StatusCode::kResourceExhausted,
                  "CUDA backend: no room for request state after weights (" + std::to_string(weight_bytes) +
                      " bytes) and scratch: " + std::to_string(plan.remaining) + " bytes left of the budget " +
                      std::to_string(budget) + " for slots of " + std::to_string(plan_input.slot_bytes) +
                      " bytes and pages of " + std::to_string(plan_input.page_bytes) + " bytes");
  }
  DS_RETURN_IF_ERROR(impl->pools->allocate(slots, pages, options.page_tokens));

  BackendCapacity& cap = impl->capacity;
  cap.device = impl->device_name;
  cap.weight_bytes = impl->weights->bytes;
  cap.state_slots = slots;
  cap.state_slot_bytes = s.slot_bytes();
  cap.cache_pages = s.mla_layers > 0 ? pages : 0;
  cap.page_tokens = options.page_tokens;
  cap.cache_bytes_per_token = s.mla_layers * s.mla_row_stride * 2;
  size_t free_now = 0;
  DS_CUDA_RETURN(cudaMemGetInfo(&free_now, &total_bytes));
  cap.free_bytes_after = static_cast<int64_t>(free_now);
  return std::shared_ptr<Backend>(std::make_shared<CudaBackend>(std::move(impl)));
}

}  // namespace

CudaBackend::CudaBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CudaBackend::~CudaBackend() {
  if (impl_ && impl_->pools) {
    (void)cudaSetDevice(impl_->pools->device());
    (void)cudaStreamSynchronize(impl_->pools->stream());
    const std::string table = impl_->profiler.table();
    if (!table.empty())
      std::fprintf(stderr, "CUDA backend profile (%s):\n%s", impl_->device_name.c_str(), table.c_str());
  }
}

void CudaBackend::set_cuda_graphs(bool on) {
  std::lock_guard<std::recursive_mutex> lock(impl_->pools->mutex());
  impl_->options.cuda_graphs = on;
}

void CudaBackend::clear_cuda_graphs() {
  std::lock_guard<std::recursive_mutex> lock(impl_->pools->mutex());
  (void)cudaStreamSynchronize(impl_->pools->stream());
  impl_->decode_graphs.clear();
}

bool CudaBackend::cuda_graphs() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->pools->mutex());
  return impl_->options.cuda_graphs;
}

CudaBackend::GraphStats CudaBackend::graph_stats() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->pools->mutex());
  const DecodeGraphs& g = impl_->decode_graphs;
  return {static_cast<int64_t>(g.graphs.size()), g.captures, g.replays, static_cast<int64_t>(g.failed.size())};
}

void CudaBackend::enable_profile(bool on) {
  std::lock_guard<std::recursive_mutex> lock(impl_->pools->mutex());
  impl_->profiler.enable(on);
}

std::vector<std::pair<std::string, double>> CudaBackend::profile() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->pools->mutex());
  std::vector<std::pair<std::string, double>> out;
  for (const PhaseTime& row : impl_->profiler.totals()) out.emplace_back(row.phase, row.ms);
  return out;
}

std::string CudaBackend::profile_table() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->pools->mutex());
  return impl_->profiler.table();
}

void CudaBackend::reset_profile() {
  std::lock_guard<std::recursive_mutex> lock(impl_->pools->mutex());
  impl_->profiler.reset();
}

std::string CudaBackend::name() const {
  return impl_->device_name;
}

BackendCapacity CudaBackend::capacity() const {
  return impl_->capacity;
}

Status CudaBackend::forward(std::span<SequenceInput> batch, std::vector<std::vector<float>>& logits,
                            const ForwardOptions& /*options: the GPU prefill's chunk is fixed at 64*/) {
  return impl_->run(batch, &logits);
}

Status CudaBackend::forward_sample(std::span<SequenceInput> batch, std::span<const SampleRequest> rows,
                                   std::vector<SampledToken>& out, const ForwardOptions& /*options*/) {
  const PassSampling sampling{rows, &out};
  return impl_->run(batch, nullptr, &sampling);
}

Status CudaBackend::forward_on_device(std::span<SequenceInput> batch, const ForwardOptions& /*options*/) {
  return impl_->run(batch, nullptr);
}

Status CudaBackend::synchronize() {
  std::lock_guard<std::recursive_mutex> lock(impl_->pools->mutex());
  DS_CUDA_RETURN(cudaSetDevice(impl_->pools->device()));
  DS_CUDA_RETURN(cudaStreamSynchronize(impl_->pools->stream()));
  return Status::ok();
}

const float* CudaBackend::device_logits() const {
  return impl_->logits;
}
int64_t CudaBackend::logit_chunk_rows() const {
  return impl_->logit_chunk;
}

Status CudaBackend::assume_context(RequestState& state, int64_t tokens) {
  if (tokens < 0) return invalid_argument("assume_context: negative token count");
  if (state.num_tokens() != 0 || state.residency() != nullptr) {
    return invalid_argument("assume_context: the state must be fresh (no tokens, not on a device)");
  }
  DevicePools& pools = *impl_->pools;
  std::lock_guard<std::recursive_mutex> lock(pools.mutex());
  DS_CUDA_RETURN(cudaSetDevice(pools.device()));
  const int64_t page_tokens = pools.page_tokens();
  const int64_t pages = impl_->shape.mla_layers > 0 ? (tokens + page_tokens - 1) / page_tokens : 0;
  if (pools.free_slots() < 1 || pools.free_pages() < pages) {
    return Status(StatusCode::kResourceExhausted, "assume_context: " + std::to_string(tokens) +
                                                      " tokens need a slot and " + std::to_string(pages) + " pages; " +
                                                      std::to_string(pools.free_slots()) + " slots and " +
                                                      std::to_string(pools.free_pages()) + " pages are free");
  }
  auto residency = std::make_unique<CudaResidency>(impl_->pools, pools.take_slot());
  DS_RETURN_IF_ERROR(pools.upload(state, residency->slot(), residency->pages()));  // zero KDA state and tails
  const kernels::cuda::MlaPagePool& pool = pools.page_pool();
  const int64_t page_elements = static_cast<int64_t>(pool.num_layers) * pool.page_size * pool.row_stride;
  for (int64_t i = 0; i < pages; ++i) {
    const int32_t page = pools.take_page();
    residency->pages().push_back(page);
    DS_CUDA_RETURN(
        cudaMemsetAsync(pool.pages + page * page_elements, 0, sizeof(__nv_bfloat16) * page_elements, pools.stream()));
  }
  state.attach_residency(std::move(residency));
  state.advance(tokens);
  state.set_host_stale(true);
  return Status::ok();
}

Result<DeviceStateSpans> CudaBackend::device_state_spans(const RequestState& state) {
  DevicePools& pools = *impl_->pools;
  std::lock_guard<std::recursive_mutex> lock(pools.mutex());
  const auto* residency = dynamic_cast<const CudaResidency*>(state.residency());
  if (residency == nullptr || residency->pools() != &pools) {
    return failed_precondition("device_state_spans: the state is not resident on this backend");
  }
  DS_CUDA_RETURN(cudaSetDevice(pools.device()));
  DS_CUDA_RETURN(cudaStreamSynchronize(pools.stream()));  // every pass that wrote it has finished
  return pools.spans(residency->slot(), residency->pages());
}

Status CudaBackend::reserve_device_state(RequestState& state, int64_t tokens) {
  if (tokens < 0) return invalid_argument("reserve_device_state: negative token count");
  if (state.num_tokens() != 0 || state.residency() != nullptr) {
    return invalid_argument("reserve_device_state: the state must be fresh (no tokens, not on a device)");
  }
  DevicePools& pools = *impl_->pools;
  std::lock_guard<std::recursive_mutex> lock(pools.mutex());
  const int64_t page_tokens = pools.page_tokens();
  const int64_t pages = impl_->shape.mla_layers > 0 ? (tokens + page_tokens - 1) / page_tokens : 0;
  if (pools.free_slots() < 1 || pools.free_pages() < pages) {
    return Status(StatusCode::kResourceExhausted, "reserve_device_state: " + std::to_string(tokens) +
                                                      " tokens need a slot and " + std::to_string(pages) + " pages; " +
                                                      std::to_string(pools.free_slots()) + " slots and " +
                                                      std::to_string(pools.free_pages()) + " pages are free");
  }
  auto residency = std::make_unique<CudaResidency>(impl_->pools, pools.take_slot());
  for (int64_t i = 0; i < pages; ++i) residency->pages().push_back(pools.take_page());
  state.attach_residency(std::move(residency));
  state.advance(tokens);
  state.set_host_stale(true);  // the device copy is the one that counts (written by the handoff)
  return Status::ok();
}

std::string CudaBackend::device_state_layout() const {
  const StateShape& shape = impl_->shape;
  // The spans' sizes follow from these; the dtypes (fp32 states, bf16 tails and rows) are the engine's.
  return "cuda kda " + std::to_string(shape.kda_layers) + "x" + std::to_string(shape.state_floats()) + "f32+" +
         std::to_string(shape.conv_kernel > 1 ? shape.tail_floats() : 0) + "bf16 mla " +
         std::to_string(shape.mla_layers) + "x" + std::to_string(impl_->pools->page_tokens()) + "x" +
         std::to_string(shape.mla_row_stride) + "bf16";
}

std::vector<DeviceSpan> CudaBackend::device_memory_regions() const {
  return impl_->pools->memory_regions();
}

int64_t CudaBackend::free_state_slots() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->pools->mutex());
  return impl_->pools->free_slots();
}

int64_t CudaBackend::free_cache_pages() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->pools->mutex());
  return impl_->pools->free_pages();
}

Result<std::shared_ptr<Backend>> make_cuda_backend(const ModelConfig& config, const ModelWeights& weights,
                                                   const CudaBackendOptions& options) {
  WeightSource source;
  source.host = &weights;
  return make_backend(config, source, options);
}

Result<std::shared_ptr<Backend>> make_cuda_backend(const ModelConfig& config, const Checkpoint& checkpoint,
                                                   const CudaBackendOptions& options,
                                                   std::function<void(int64_t, int64_t)> progress) {
  WeightSource source;
  source.checkpoint = &checkpoint;
  source.progress = std::move(progress);
  return make_backend(config, source, options);
}

Result<std::shared_ptr<Backend>> make_cuda_backend_random(const ModelConfig& config, uint64_t seed,
                                                          const CudaBackendOptions& options) {
  WeightSource source;
  source.random_seed = seed;
  return make_backend(config, source, options);
}

}  // namespace deltaserve::engine::cuda
