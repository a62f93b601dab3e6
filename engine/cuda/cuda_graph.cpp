// CUDA graphs for pure-decode passes (CudaBackendOptions::cuda_graphs).
//
// Policy:
//  - Eligible: every sequence brings one token and the pass's logit rows fit one LM-head piece (batch <=
//    logit_chunk). Everything else is eager. No layer of a pass syncs with the host, which a capture would not allow.
//  - Key: the EXACT batch size, not a padded bucket. Dummy rows would be skipped by the KDA decode kernel (slot
//    -1) and the MLA row writes (slot -1), but the MoE router would still send each one to top_k experts whose
//    weights the decode kernel then reads: at small batches (where graphs matter most, being launch-bound) a
//    batch of 3 padded to 4 would read up to top_k more experts per MoE layer. Exact sizes cost one capture per
//    distinct batch size (host time only); the cache keeps the 128 most recently used graphs.
//  - MLA: the split grid and the block-table row length are host values baked into a graph. The key carries a
//    context bound: the smallest power of two >= the pass's longest context (at least 512, where the split count
//    is 1 anyway; at most the model limit the workspace was planned for); a longer context makes a new key. The
//    kernels divide the REAL context of each sequence over the splits (per_split = visible / splits on the
//    device), so a larger bound only adds splits (at most twice as many, capped at 64 and by the occupancy
//    target): each CTA walks fewer rows, the extra CTAs and the wider log-sum-exp combine are small, and the
//    critical path does not grow. Block-table rows are padded with -1 (never dereferenced).
//    Numerics: where the bound changes the split count (contexts above 512) the bf16-rounded softmax weights are
//    partitioned differently from the eager pass, so graph and eager logits differ by rounding there; at or below
//    512 they run the same kernels on the same inputs.
//  - Tables: written into a fixed device buffer (one cudaMemcpyAsync from pinned staging) that every graph reads;
//    growing it (a larger batch or bound than any before) drops every graph. A sampled pass (forward_sample) appends
//    the rows' sampling parameters after what the graph reads and samples after the replay, outside the graph.
//  - The first pass of a key runs eagerly (module loading, kernel attributes, cuBLAS heuristics happen outside a
//    capture); the second captures, instantiates and replays. A capture that fails (a kernel that is not
//    capturable) leaves that key eager for good and says so once on stderr; nothing ran during the capture, so the
//    pass is then computed eagerly with the same state.
#include <algorithm>
#include <bit>
#include <cstdio>
#include <string>

#include "engine/cuda/cuda_model.hpp"
#include "kernels/cuda/mla/mla.hpp"

namespace deltaserve::engine::cuda {

namespace {

constexpr size_t kMaxDecodeGraphs = 128;
constexpr int kMinContextBound = 512;  // fewer graphs for short contexts (the split grid follows the bound)

}  // namespace

Status PinnedMemory::allocate(size_t bytes, const std::string& what) {
  reset();
  if (bytes == 0) return Status::ok();
  void* data = nullptr;
  const cudaError_t error = cudaMallocHost(&data, bytes);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    return Status(StatusCode::kResourceExhausted, "cannot allocate " + std::to_string(bytes) +
                                                      " bytes of pinned host memory for " + what + ": " +
                                                      cudaGetErrorString(error));
  }
  data_ = static_cast<char*>(data);
  bytes_ = bytes;
  return Status::ok();
}

void PinnedMemory::reset() {
  if (data_ != nullptr) (void)cudaFreeHost(data_);
  data_ = nullptr;
  bytes_ = 0;
}

void DecodeGraphs::clear() {
  for (auto& [key, entry] : graphs) {
    if (entry.exec != nullptr) (void)cudaGraphExecDestroy(entry.exec);
  }
  graphs.clear();
}

DecodeGraphs::~DecodeGraphs() {
  clear();
  if (staged != nullptr) (void)cudaEventDestroy(staged);
}

std::optional<DecodeGraphKey> CudaBackend::Impl::decode_graph_key(std::span<SequenceInput> batch) const {
  if (!options.cuda_graphs) return std::nullopt;
  const auto B = static_cast<int64_t>(batch.size());
  if (B < 1 || B > max_rows || B > logit_chunk) return std::nullopt;
  int64_t longest = 0;
  for (const SequenceInput& in : batch) {
    if (in.tokens.size() != 1) return std::nullopt;
    longest = std::max(longest, in.state->num_tokens() + 1);
  }
  DecodeGraphKey key;
  key.batch = B;
  if (shape.mla_layers > 0) {
    const std::optional<int64_t> context_bound = decode_context_bound(longest);
    if (!context_bound) return std::nullopt;
    const int64_t bound = *context_bound;
    key.context_bound = static_cast<int>(bound);
    key.pages_bound = static_cast<int>((bound + pools->page_tokens() - 1) / pools->page_tokens());
    // A residency may hold more pages than its context needs (pages claimed by a pass that then failed): such a
    // batch does not fit the key's block-table rows and runs eagerly.
    for (const SequenceInput& in : batch) {
      const auto* residency = dynamic_cast<const CudaResidency*>(in.state->residency());
      if (residency == nullptr || static_cast<int64_t>(residency->pages().size()) > key.pages_bound) {
        return std::nullopt;
      }
    }
  }
  return key;
}

std::optional<int64_t> CudaBackend::Impl::decode_context_bound(int64_t longest) const {
  // The limit the MLA workspace was planned for (allocate_scratch).
  const int64_t limit = std::min<int64_t>(
      config.max_position_embeddings > 0 ? config.max_position_embeddings : int64_t{1} << 20, int64_t{1} << 30);
  if (longest > limit) return std::nullopt;
  return std::min<int64_t>(std::bit_ceil(static_cast<uint64_t>(std::max<int64_t>(longest, kMinContextBound))), limit);
}

Status CudaBackend::Impl::capture_decode_graph(const PassTables& t, cudaGraphExec_t* exec) {
  *exec = nullptr;
  DS_CUDA_RETURN(cudaStreamBeginCapture(stream(), cudaStreamCaptureModeRelaxed));
  profiler.pause(true);
  const float* final_hidden = nullptr;
  Status status = forward_layers(t, &final_hidden);
  if (config.attn_res_block_size) residual = spare_blocks.front();
  if (status.is_ok()) status = lm_head_piece(final_hidden, t, 0, static_cast<int64_t>(t.logit_rows.size()));
  profiler.pause(false);
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream(), &graph);
  if (status.is_ok()) status = cuda_status(ended, "cudaStreamEndCapture", __FILE__, __LINE__);
  if (status.is_ok()) {
    status = cuda_status(cudaGraphInstantiate(exec, graph, 0), "cudaGraphInstantiate", __FILE__, __LINE__);
  }
  if (graph != nullptr) (void)cudaGraphDestroy(graph);
  if (!status.is_ok()) {
    if (*exec != nullptr) (void)cudaGraphExecDestroy(*exec);
    *exec = nullptr;
    (void)cudaGetLastError();  // capture errors are not sticky
  }
  return status;
}

Status CudaBackend::Impl::run_decode_graph(std::span<SequenceInput> batch, const DecodeGraphKey& key,
                                           std::vector<std::vector<float>>* out, const PassSampling* sampling,
                                           bool* ran) {
  *ran = false;
  DecodeGraphs& g = decode_graphs;
  if (!g.graphs.contains(key)) {
    if (g.failed.contains(key)) return Status::ok();
    if (g.seen.size() > 4096) g.seen.clear();
    if (g.seen.insert(key).second) return Status::ok();  // first sight: the eager warm-up
  }
  PassTables t;
  DS_RETURN_IF_ERROR(build_tables(batch, t, &key, sampling));  // may drop every graph (the fixed buffer grew)
  auto it = g.graphs.find(key);
  if (it == g.graphs.end()) {
    if (shape.mla_layers > 0) {
      const MlaConfig& m = config.mla;
      DS_RETURN_IF_ERROR(ensure_mla_workspace(
          kernels::cuda::mla_attention_workspace_bytes(static_cast<int>(m.num_heads), static_cast<int>(m.kv_lora_rank),
                                                       static_cast<int>(m.qk_rope_head_dim), t.rows, t.max_context)));
    }
    cudaGraphExec_t exec = nullptr;
    const Status captured = capture_decode_graph(t, &exec);
    if (!captured.is_ok()) {
      g.failed.insert(key);
      std::fprintf(stderr,
                   "deltaserve CUDA backend: decode graph capture (batch %lld, context bound %d) failed, that shape "
                   "runs eagerly: %s\n",
                   static_cast<long long>(key.batch), key.context_bound, captured.to_string().c_str());
      return Status::ok();
    }
    if (g.graphs.size() >= kMaxDecodeGraphs) {
      auto oldest = std::min_element(g.graphs.begin(), g.graphs.end(), [](const auto& a, const auto& b) {
        return a.second.last_use < b.second.last_use;
      });
      (void)cudaGraphExecDestroy(oldest->second.exec);
      g.graphs.erase(oldest);
    }
    it = g.graphs.emplace(key, DecodeGraphs::Entry{exec, 0}).first;
    ++g.captures;
  }
  it->second.last_use = ++g.clock;
  profiler.mark(Phase::kDecodeGraph, stream());
  DS_CUDA_RETURN(cudaGraphLaunch(it->second.exec, stream()));
  profiler.idle(stream());
  ++g.replays;
  *ran = true;
  if (out != nullptr) {
    size_logits(batch, *out);
    std::vector<int64_t> filled(batch.size(), 0);
    DS_RETURN_IF_ERROR(copy_logits(t, 0, static_cast<int64_t>(t.logit_rows.size()), *out, filled));
  }
  if (sampling != nullptr) {
    // After the replay, outside the graph: the sampling parameters change every step and the results are read on
    // the host anyway.
    DS_RETURN_IF_ERROR(sample_piece(t, 0, static_cast<int64_t>(t.logit_rows.size())));
    DS_RETURN_IF_ERROR(fetch_samples(t, *sampling));
    profiler.idle(stream());
  }
  return Status::ok();
}

}  // namespace deltaserve::engine::cuda
