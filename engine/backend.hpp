// The seam between the model's math and the hardware that runs it. A Model either runs on the CPU
// (its own fp32 code, kernels/cpu) or hands every validated forward pass to a Backend (the CUDA backend
// in engine/cuda). A backend that keeps a request's caches in device memory attaches a DeviceResidency
// to the request's RequestState; the state's host containers are then a copy that is brought up to date
// on demand (RequestState::sync_host) — for a handoff, a prefix-cache checkpoint or a test.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/status.hpp"
#include "engine/sampler.hpp"

namespace deltaserve::engine {

class RequestState;
struct SequenceInput;
struct ForwardOptions;

// A request's caches in a backend's device memory (KDA state slot, MLA pages). Owned by the RequestState;
// destroying it gives the device memory back to the backend (which must outlive it: implementations hold
// a shared reference to their pools).
class DeviceResidency {
 public:
  virtual ~DeviceResidency() = default;
  // Copies the device contents (KDA conv tails and recurrent states, MLA rows of num_tokens() tokens) into
  // `state`'s host containers, which have the model's shapes. Synchronous.
  [[nodiscard]] virtual Status download(RequestState& state) const = 0;
  // Copies at least these parts: the KDA states and tails (when `kda`), and the MLA rows of tokens
  // [mla_begin, mla_end) into rows that already exist in the host containers or are appended (rows before
  // mla_begin are kept as they are). The default copies everything. Synchronous.
  [[nodiscard]] virtual Status download_part(RequestState& state, bool kda, int64_t mla_begin, int64_t mla_end) const {
    (void)kda, (void)mla_begin, (void)mla_end;
    return download(state);
  }
};

// A contiguous range of device memory.
struct DeviceSpan {
  std::byte* data = nullptr;
  int64_t bytes = 0;
};

// A request's caches in a backend's device memory, as a handoff moves them, stored as the kernels use them (no
// conversion): each KDA layer's recurrent state and (with a short conv) its conv tails, and the MLA pages holding
// the request's tokens in token order (each page holds every MLA layer's rows of page_tokens tokens; the last one
// may be partly used). Two backends of the same model and page size lay these out the same way, so copying every
// span into the other's spans of a state reserved for as many tokens moves the request exactly.
struct DeviceStateSpans {
  std::vector<DeviceSpan> kda_states;  // [KDA layer]
  std::vector<DeviceSpan> kda_tails;   // [KDA layer]; empty when the model has no short conv
  std::vector<DeviceSpan> mla_pages;   // [page], covering tokens [0, num_tokens)
  int64_t page_tokens = 0;
  int64_t bytes() const {
    int64_t n = 0;
    for (const auto* spans : {&kda_states, &kda_tails, &mla_pages}) {
      for (const DeviceSpan& s : *spans) n += s.bytes;
    }
    return n;
  }
};

// What a backend holds and how many requests fit; reported at start-up and on /metrics.
struct BackendCapacity {
  std::string device;                 // "cpu", "cuda:0 (NVIDIA H200)"
  int64_t weight_bytes = 0;           // weights resident on the device
  int64_t state_slots = 0;            // requests whose KDA states fit at once (0 = limited by host memory only)
  int64_t state_slot_bytes = 0;       // bytes of one slot (every KDA layer's recurrent state + conv tails)
  int64_t cache_pages = 0;            // MLA pages in the pool
  int64_t page_tokens = 0;            // tokens per page
  int64_t cache_bytes_per_token = 0;  // MLA bytes of one token, all MLA layers
  int64_t free_bytes_after = 0;       // device memory left after weights, slots, pages and scratch
  // Concurrent requests of `tokens` tokens that fit (slots and pages both).
  int64_t requests_that_fit(int64_t tokens) const;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual BackendCapacity capacity() const = 0;

  // The forward pass of Model::forward, called after Model validated the batch (token ids, context limit,
  // state shapes). Same contract: logits[i] for sequence i, each state advanced by its tokens on success.
  // On an error (e.g. kResourceExhausted when no state slot or page is free) no state has advanced.
  // Thread-safe (calls are serialised by the backend).
  [[nodiscard]] virtual Status forward(std::span<SequenceInput> batch, std::vector<std::vector<float>>& logits,
                                       const ForwardOptions& options) = 0;

  // The pass of Model::forward_sample, called after Model validated the batch and the rows (one row per sequence,
  // no all_logits): out[i] is rows[i] sampled from the logits of sequence i's last token, as SamplingRule chooses.
  // The default runs forward() and samples the logits on the host with SamplingRule (engine/sampler.hpp); a
  // device backend overrides it to sample where the logits are and bring back only the sampled tokens. Same error
  // contract as forward().
  [[nodiscard]] virtual Status forward_sample(std::span<SequenceInput> batch, std::span<const SampleRequest> rows,
                                              std::vector<SampledToken>& out, const ForwardOptions& options);

  // ---- handoff from and into device memory (kUnimplemented on backends without one) ----
  // The spans of `state`'s caches, which live on this backend, once every pass that wrote them has finished (waits
  // for the device). Valid until the next pass on `state` or its release. kFailedPrecondition for a state that is
  // not resident here.
  [[nodiscard]] virtual Result<DeviceStateSpans> device_state_spans(const RequestState& state);
  // Gives a fresh `state` (no tokens, no residency) a slot and the pages of `tokens` tokens and advances it by
  // `tokens`; the contents are undefined until written through device_state_spans (the receiving side of a
  // handoff, which must not run a pass on it before then). kResourceExhausted when they are not free; nothing is
  // taken then.
  [[nodiscard]] virtual Status reserve_device_state(RequestState& state, int64_t tokens);
  // The device allocations every DeviceStateSpans of this backend lies in (a transport registers them once).
  virtual std::vector<DeviceSpan> device_memory_regions() const { return {}; }
  // Equal for two backends exactly when their DeviceStateSpans of equal token counts line up span for span (same
  // sizes, same meaning); "" without device state.
  virtual std::string device_state_layout() const { return ""; }
};

// forward_sample's row checks, shared by Model and the backends: one row per sequence, no all_logits, each row's
// params and draw valid (validate_request). InvalidArgument naming the sequence otherwise.
[[nodiscard]] Status check_sample_rows(std::span<const SequenceInput> batch, std::span<const SampleRequest> rows);

}  // namespace deltaserve::engine
