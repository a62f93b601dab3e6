// KDA chunked prefill for sm_90a (contract in kda.hpp): validation, workspace sizing, the chunk and sequence tables,
// the choice of state pass, and the launches. Two kernels:
//   1. the prep (chunk_prefill_prep.cu), one CTA per (chunk of 64 tokens, head), fully parallel: each chunk's WY/UT
//      factors into the workspace (layout in detail/chunk_prefill.cuh);
//   2. a state pass (chunk_prefill_state.cu), sequential over each sequence's chunks: per value slice, per head, or
//      per head overlapped with the prep (KdaPrefillParams::state_pass).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "kernels/cuda/kda/detail/chunk_prefill.cuh"
#include "kernels/cuda/kda/kda.hpp"

namespace deltaserve::kernels::cuda {
namespace {

using namespace kda_prefill;  // NOLINT(google-build-using-namespace)

bool aligned16(const void* pointer) {
  return (reinterpret_cast<uintptr_t>(pointer) & 15u) == 0;
}

Status check_device_pointer(const void* pointer, const char* name, bool required) {
  if (pointer == nullptr) {
    if (required) return invalid_argument(std::string(name) + " is null");
    return Status::ok();
  }
  if (!aligned16(pointer)) return invalid_argument(std::string(name) + " is not 16-byte aligned");
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, pointer) != cudaSuccess) {
    (void)cudaGetLastError();
    return invalid_argument(std::string(name) + " is not a CUDA pointer");
  }
  if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged) {
    return invalid_argument(std::string(name) + " is not device memory");
  }
  return Status::ok();
}

Status check_cu_seqlens(const std::vector<int32_t>& cu) {
  if (cu.size() < 2) return invalid_argument("cu_seqlens needs N + 1 >= 2 entries");
  if (cu[0] != 0) return invalid_argument("cu_seqlens[0] must be 0");
  for (size_t i = 1; i < cu.size(); ++i) {
    if (cu[i] < cu[i - 1]) {
      return invalid_argument("cu_seqlens must be non-decreasing (entry " + std::to_string(i) + ")");
    }
  }
  return Status::ok();
}

int64_t chunk_count(const std::vector<int32_t>& cu) {
  int64_t chunks = 0;
  for (size_t i = 1; i < cu.size(); ++i) chunks += (cu[i] - cu[i - 1] + kC - 1) / kC;
  return chunks;
}

// Whether the overlapped pass can run: its state CTAs spin on the prep's flags, so every one of them must be resident
// beside the prep: at most half the SMs (one CTA an SM), the rest for the prep; and the prep's grid is 1-D.
bool overlapped_pass_fits(int num_heads, int64_t sequences, int64_t items, int sms) {
  return static_cast<int64_t>(num_heads) * sequences * 2 <= sms && items <= 0x7fffffff;
}

// kAuto's choice, made here only: the overlapped pass wherever it fits (few (head, sequence) chains: the chain is
// the critical path, and the prep runs beside it); else a CTA per head when the 2 H CTAs of a sequence of the pass
// per slice would not all be resident at once (one wave instead of two), else a CTA per value slice.
KdaStatePass auto_state_pass(int num_heads, int64_t sequences, int64_t items, int sms) {
  if (overlapped_pass_fits(num_heads, sequences, items, sms)) return KdaStatePass::kPerHeadOverlapped;
  return 2 * num_heads > sms ? KdaStatePass::kPerHead : KdaStatePass::kPerSlice;
}

// The state pass for `requested` (KdaPrefillParams::state_pass): the overlapped pass falls back to kAuto's choice
// where it does not fit.
KdaStatePass choose_state_pass(KdaStatePass requested, int num_heads, int64_t sequences, int64_t items) {
  if (requested == KdaStatePass::kPerSlice || requested == KdaStatePass::kPerHead) return requested;
  int device = 0, sms = 0;  // of the current device: a process may drive GPUs of different kinds
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return KdaStatePass::kPerSlice;
  }
  if (requested == KdaStatePass::kPerHeadOverlapped && overlapped_pass_fits(num_heads, sequences, items, sms)) {
    return requested;
  }
  return auto_state_pass(num_heads, sequences, items, sms);
}

size_t align256(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

Status cuda_status(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return Status::ok();
  return internal_error(std::string(what) + ": " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) + ")");
}

}  // namespace

size_t kda_prefill_workspace_bytes(const std::vector<int32_t>& cu_seqlens, int num_heads) {
  if (!check_cu_seqlens(cu_seqlens).is_ok() || num_heads <= 0) return 0;
  const int64_t chunks = chunk_count(cu_seqlens);
  const size_t sequences = cu_seqlens.size() - 1;
  const size_t items = static_cast<size_t>(chunks) * static_cast<size_t>(num_heads);
  return align256(static_cast<size_t>(chunks) * sizeof(ChunkEntry)) + align256(sequences * sizeof(SequenceEntry)) +
         items * kChunkBytes +
         align256((items + 1 + sequences * static_cast<size_t>(num_heads)) * sizeof(unsigned int));  // flags
}

int64_t kda_prefill_checkpoint_count(const std::vector<int32_t>& cu_seqlens, int checkpoint_interval) {
  if (checkpoint_interval <= 0 || !check_cu_seqlens(cu_seqlens).is_ok()) return 0;
  int64_t count = 0;
  for (size_t i = 1; i < cu_seqlens.size(); ++i) count += (cu_seqlens[i] - cu_seqlens[i - 1]) / checkpoint_interval;
  return count;
}

Status kda_chunk_prefill(const KdaPrefillParams& p, cudaStream_t stream) {
  if (p.num_heads <= 0) return invalid_argument("kda_chunk_prefill: num_heads must be >= 1");
  if (p.head_dim != kD)
    return unimplemented("kda_chunk_prefill: head_dim must be 128, got " + std::to_string(p.head_dim));
  DS_RETURN_IF_ERROR_CTX(check_cu_seqlens(p.cu_seqlens), "kda_chunk_prefill");
  const int64_t total_tokens = p.cu_seqlens.back();
  const int64_t sequences = static_cast<int64_t>(p.cu_seqlens.size()) - 1;
  if (sequences > 65535) return out_of_range("kda_chunk_prefill: at most 65535 sequences per call");
  if (!(std::isfinite(p.q_scale) && p.q_scale > 0.0f))
    return invalid_argument("kda_chunk_prefill: q_scale must be > 0");
  const bool tokens = total_tokens > 0;
  DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.q, "q", tokens), "kda_chunk_prefill");
  DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.k, "k", tokens), "kda_chunk_prefill");
  DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.v, "v", tokens), "kda_chunk_prefill");
  DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.g, "g", tokens), "kda_chunk_prefill");
  DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.beta, "beta", tokens), "kda_chunk_prefill");
  DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.o, "o", tokens), "kda_chunk_prefill");
  DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.initial_state, "initial_state", false), "kda_chunk_prefill");
  DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.final_state, "final_state", false), "kda_chunk_prefill");
  if (p.gate_raw) {
    DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.a_log, "a_log", true), "kda_chunk_prefill: gate_raw");
    DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.dt_bias, "dt_bias", true), "kda_chunk_prefill: gate_raw");
    if (p.lower_bound && !(std::isfinite(*p.lower_bound) && *p.lower_bound < 0.0f)) {
      return invalid_argument("kda_chunk_prefill: lower_bound must be finite and < 0");
    }
  } else if (p.lower_bound) {
    return invalid_argument("kda_chunk_prefill: lower_bound applies to the fused (raw) gate only");
  }
  if (p.overlap_wait_us < 0) {
    return invalid_argument("kda_chunk_prefill: overlap_wait_us must be >= 0, got " +
                            std::to_string(p.overlap_wait_us));
  }
  if (p.checkpoint_interval < 0 || p.checkpoint_interval % kC != 0) {
    return invalid_argument("kda_chunk_prefill: checkpoint_interval must be 0 or a positive multiple of 64, got " +
                            std::to_string(p.checkpoint_interval));
  }
  const int64_t checkpoints = kda_prefill_checkpoint_count(p.cu_seqlens, p.checkpoint_interval);
  DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.checkpoint_states, "checkpoint_states", checkpoints > 0),
                         "kda_chunk_prefill");
  const size_t needed = kda_prefill_workspace_bytes(p.cu_seqlens, p.num_heads);
  DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.workspace, "workspace", true), "kda_chunk_prefill");
  if (p.workspace_bytes < needed) {
    return invalid_argument("kda_chunk_prefill: workspace has " + std::to_string(p.workspace_bytes) + " bytes, needs " +
                            std::to_string(needed));
  }
  const int64_t chunks = chunk_count(p.cu_seqlens);
  if (chunks > 0x7fffffff / 2) return out_of_range("kda_chunk_prefill: too many chunks");
  if (!tokens && p.final_state == nullptr) return Status::ok();

  // Tables.
  std::vector<ChunkEntry> chunk_table;
  chunk_table.reserve(static_cast<size_t>(chunks));
  std::vector<SequenceEntry> sequence_table(static_cast<size_t>(sequences));
  int32_t checkpoint_first = 0;
  for (int64_t s = 0; s < sequences; ++s) {
    const int32_t begin = p.cu_seqlens[s], length = p.cu_seqlens[s + 1] - begin;
    SequenceEntry& entry = sequence_table[static_cast<size_t>(s)];
    entry = {};
    entry.first_chunk = static_cast<int32_t>(chunk_table.size());
    entry.num_chunks = (length + kC - 1) / kC;
    entry.token_begin = begin;
    entry.length = length;
    entry.checkpoint_first = checkpoint_first;
    if (p.checkpoint_interval > 0) checkpoint_first += length / p.checkpoint_interval;
    for (int32_t first = 0; first < length; first += kC) {
      chunk_table.push_back({begin + first, std::min(kC, length - first), static_cast<int32_t>(s), 0});
    }
  }
  auto* base = static_cast<uint8_t*>(p.workspace);
  auto* chunk_device = reinterpret_cast<ChunkEntry*>(base);
  auto* sequence_device = reinterpret_cast<SequenceEntry*>(base + align256(chunk_table.size() * sizeof(ChunkEntry)));
  uint8_t* data = reinterpret_cast<uint8_t*>(sequence_device) + align256(sequence_table.size() * sizeof(SequenceEntry));
  if (!chunk_table.empty()) {
    DS_RETURN_IF_ERROR(
        cuda_status(cudaMemcpyAsync(chunk_device, chunk_table.data(), chunk_table.size() * sizeof(ChunkEntry),
                                    cudaMemcpyHostToDevice, stream),
                    "kda_chunk_prefill: chunk table copy"));
  }
  DS_RETURN_IF_ERROR(
      cuda_status(cudaMemcpyAsync(sequence_device, sequence_table.data(), sequence_table.size() * sizeof(SequenceEntry),
                                  cudaMemcpyHostToDevice, stream),
                  "kda_chunk_prefill: sequence table copy"));

  const size_t items = static_cast<size_t>(chunks) * static_cast<size_t>(p.num_heads);
  const KdaStatePass pass = choose_state_pass(p.state_pass, p.num_heads, sequences, static_cast<int64_t>(items));
  // The overlapped pass's flags [items], done counter, fallback markers [sequences * H].
  auto* flags = reinterpret_cast<unsigned int*>(data + items * kChunkBytes);
  const size_t flag_words = items + 1 + static_cast<size_t>(sequences) * static_cast<size_t>(p.num_heads);
  StateArgs state{p.num_heads,
                  sequence_device,
                  data,
                  p.initial_state,
                  p.final_state,
                  p.checkpoint_interval,
                  p.checkpoint_states,
                  p.o,
                  nullptr,
                  nullptr,
                  0,
                  0};
  PrepArgs prep{p.q,
                p.k,
                p.v,
                p.g,
                p.beta,
                p.q_scale,
                !p.gate_raw ? kGatePrecomputed : (p.lower_bound ? kGateBounded : kGateSoftplus),
                p.a_log,
                p.dt_bias,
                p.lower_bound.value_or(0.0f),
                p.num_heads,
                chunk_device,
                data,
                nullptr,
                nullptr,
                0};
  if (pass == KdaStatePass::kPerHeadOverlapped && chunks > 0) {
    // State pass first (its CTAs let the prep start at once), then the prep as its programmatic dependent.
    DS_RETURN_IF_ERROR(
        cuda_status(cudaMemsetAsync(flags, 0, flag_words * sizeof(unsigned int), stream), "kda_chunk_prefill: flags"));
    state.flags = flags;
    state.fallback = flags + items + 1;
    state.wait_ns = static_cast<unsigned long long>(p.overlap_wait_us) * 1000ull;
    DS_RETURN_IF_ERROR(
        cuda_status(launch_chunk_state_per_head(state, sequences, stream), "kda_chunk_prefill: state launch"));
    prep.flags = flags;
    prep.done = flags + items;
    prep.total_items = static_cast<unsigned int>(items);
    DS_RETURN_IF_ERROR(cuda_status(launch_chunk_prep(prep, chunks, stream), "kda_chunk_prefill: prep launch"));
    // After the prep: the (head, sequence) CTAs that gave up waiting, if any (the others return at once).
    state.rerun = 1;
    return cuda_status(launch_chunk_state_per_head(state, sequences, stream), "kda_chunk_prefill: state rerun launch");
  }
  if (chunks > 0) {
    DS_RETURN_IF_ERROR(cuda_status(launch_chunk_prep(prep, chunks, stream), "kda_chunk_prefill: prep launch"));
  }
  const cudaError_t launched = pass != KdaStatePass::kPerSlice ? launch_chunk_state_per_head(state, sequences, stream)
                                                               : launch_chunk_state_per_slice(state, sequences, stream);
  return cuda_status(launched, "kda_chunk_prefill: state launch");
}

}  // namespace deltaserve::kernels::cuda
