// CAF 0.17 `inspect` overloads for the router/engine types that travel inside actor messages, and the
// registration of every wire type with an actor_system_config. Overloads live in the types' own
// namespaces so CAF finds them by ADL. Included only by actors/*.cpp and actor tests (CAF is slow to
// compile; nothing outside actors/ sees CAF).
//
// Status travels as (code, message). std::optional<std::string> travels as (has_value, value).
#pragma once

#include <cstdint>
#include <string>

#include <caf/all.hpp>

#include "common/status.hpp"
#include "engine/request_types.hpp"
#include "kvstore/cache/cache_event.hpp"
#include "router/inference_service.hpp"

namespace deltaserve::engine {

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, SamplingParams& x) {
  return f(caf::meta::type_name("SamplingParams"), x.temperature, x.top_p, x.top_k, x.seed, x.top_logprobs);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, TokenLogprob& x) {
  return f(caf::meta::type_name("TokenLogprob"), x.token, x.logprob);
}

}  // namespace deltaserve::engine

namespace deltaserve::kvstore {

// A BlockHash travels as two u64 halves: bytes [0, 8) and [8, 16), little-endian.
inline void split_block_hash(const BlockHash& hash, uint64_t& lo, uint64_t& hi) {
  lo = hi = 0;
  for (int i = 7; i >= 0; --i) {
    lo = (lo << 8) | hash.bytes[static_cast<size_t>(i)];
    hi = (hi << 8) | hash.bytes[static_cast<size_t>(i + 8)];
  }
}

inline void join_block_hash(uint64_t lo, uint64_t hi, BlockHash& hash) {
  for (size_t i = 0; i < 8; ++i) {
    hash.bytes[i] = static_cast<uint8_t>(lo >> (8 * i));
    hash.bytes[i + 8] = static_cast<uint8_t>(hi >> (8 * i));
  }
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, BlockHash& x) {
  uint64_t lo = 0, hi = 0;
  split_block_hash(x, lo, hi);
  auto rebuild = caf::meta::load_callback([&]() -> caf::error {
    join_block_hash(lo, hi, x);
    return caf::none;
  });
  return f(caf::meta::type_name("BlockHash"), lo, hi, rebuild);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, PromptHashes& x) {
  return f(caf::meta::type_name("PromptHashes"), x.root, x.blocks);
}

// The hash travels as two u64 halves (as a BlockHash), the event kind as its u8 value (checked after loading).
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, CacheEvent& x) {
  uint64_t lo = 0, hi = 0;
  split_block_hash(x.hash, lo, hi);
  auto kind = static_cast<uint8_t>(x.kind);
  auto rebuild = caf::meta::load_callback([&]() -> caf::error {
    join_block_hash(lo, hi, x.hash);
    if (kind > static_cast<uint8_t>(CacheEvent::Kind::kCheckpointEvicted)) return caf::sec::invalid_argument;
    x.kind = static_cast<CacheEvent::Kind>(kind);
    return caf::none;
  });
  return f(caf::meta::type_name("CacheEvent"), kind, lo, hi, x.block_index, x.has_checkpoint, x.cache_namespace,
           rebuild);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, CacheEventBatch& x) {
  return f(caf::meta::type_name("CacheEventBatch"), x.worker, x.worker_epoch, x.events);
}

}  // namespace deltaserve::kvstore

namespace deltaserve::router {

// For CAF's stringification inspector (serializers use the underlying integer).
inline std::string to_string(Priority priority) {
  return std::to_string(static_cast<int>(priority));
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, GenerationRequest& x) {
  return f(caf::meta::type_name("GenerationRequest"), x.request_id, x.tenant, x.cache_namespace, x.prompt, x.sampling,
           x.logprobs, x.max_tokens, x.stop, x.ignore_eos, x.arrival_ns, x.priority);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, TokenLogprobs& x) {
  return f(caf::meta::type_name("TokenLogprobs"), x.token, x.logprob, x.top);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, GenerationChunk& x) {
  // Flattened optional + Status; rebuilt after loading.
  bool has_finish = x.finish_reason.has_value();
  std::string finish = x.finish_reason.value_or(std::string());
  int32_t code = static_cast<int32_t>(x.error.code());
  std::string message = x.error.message();
  auto rebuild = caf::meta::load_callback([&]() -> caf::error {
    if (has_finish) {
      x.finish_reason = finish;
    } else {
      x.finish_reason.reset();
    }
    if (code < 0 || code > static_cast<int32_t>(StatusCode::kCancelled))
      code = static_cast<int32_t>(StatusCode::kInternal);
    x.error = Status(static_cast<StatusCode>(code), message);
    return caf::none;
  });
  return f(caf::meta::type_name("GenerationChunk"), x.request_id, x.tokens, x.text, x.logprobs, has_finish, finish,
           code, message, x.prompt_tokens, x.completion_tokens, x.cached_tokens, rebuild);
}

}  // namespace deltaserve::router

namespace deltaserve::actors {

// Adds every message type of actors/*_protocol.hpp to `config` (needed for remote messaging; harmless
// locally). Call once per actor_system_config, before the system is constructed.
void register_wire_types(caf::actor_system_config& config);

}  // namespace deltaserve::actors

namespace deltaserve::actors {

// Atoms shared by several protocols (CAF 0.17 atom_constant: at most 10 characters).
using cancel_atom = caf::atom_constant<caf::atom("cancel")>;  // abort one request by id
using stats_atom = caf::atom_constant<caf::atom("stats")>;    // ask an actor for its counters
using drain_atom = caf::atom_constant<caf::atom("drain")>;    // leave the registry, finish active work
using tick_atom = caf::atom_constant<caf::atom("tick")>;      // self-sent heartbeat timer

// Counters every worker reports (prefill fields are 0 on decode workers and vice versa).
struct WorkerStats {
  int64_t active = 0;         // decode: requests in the batcher; prefill: job being prefilled (0/1)
  int64_t queued = 0;         // decode: handoffs waiting for a slot; prefill: jobs waiting
  int64_t free_slots = 0;     // decode: batcher slots free
  int64_t steps = 0;          // decode steps run / prefill chunks run
  int64_t handoffs = 0;       // prefill: states sent; decode: states accepted
  int64_t handoff_bytes = 0;  // prefill: encoded bytes sent in total
  int64_t handoff_us = 0;     // prefill: microseconds spent encoding + sending, in total
  int64_t rejected = 0;       // decode: handoffs rejected (corrupt state, bad params)
  int64_t stale_dropped = 0;  // decode: handoffs or requests of attempts the router had moved elsewhere, dropped
  // Prefill workers with a prefix cache (0 otherwise):
  int64_t slots_total = 0, slots_free = 0;        // state slots of the fixed pool
  int64_t pages_total = 0, pages_free = 0;        // MLA page groups of the pool
  int64_t cache_entries = 0;                      // block boundaries whose pages are held
  int64_t checkpoints = 0, checkpoint_bytes = 0;  // KDA checkpoints held
  int64_t cache_evictions = 0;                    // entries + checkpoints evicted, in total
  int64_t prompt_tokens = 0;  // tokens of finished prefills, in total (a resumed request's: prompt ++ generated)
  int64_t cached_tokens = 0;  // of which served from the cache
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, WorkerStats& x) {
  return f(caf::meta::type_name("WorkerStats"), x.active, x.queued, x.free_slots, x.steps, x.handoffs, x.handoff_bytes,
           x.handoff_us, x.rejected, x.stale_dropped, x.slots_total, x.slots_free, x.pages_total, x.pages_free,
           x.cache_entries, x.checkpoints, x.checkpoint_bytes, x.cache_evictions, x.prompt_tokens, x.cached_tokens);
}

// Builds the final chunk of a request that failed outside the decode loop.
inline router::GenerationChunk error_chunk(const std::string& request_id, Status status) {
  router::GenerationChunk chunk;
  chunk.request_id = request_id;
  chunk.error = std::move(status);
  return chunk;
}

}  // namespace deltaserve::actors
