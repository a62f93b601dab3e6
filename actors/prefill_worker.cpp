#include "actors/prefill_worker.hpp"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iostream>
#include <optional>
#include <set>

#include <caf/io/all.hpp>

#include "actors/heartbeat.hpp"
#include "engine/prefix_state.hpp"
#include "engine/state_codec.hpp"
#include "kvstore/cache/prefill_plan.hpp"
#include "kvstore/cache/slot_pool.hpp"

namespace deltaserve::actors {
namespace {

using Clock = std::chrono::steady_clock;

struct Job {
  PrefillJob job;
  bool started = false;
  std::optional<kvstore::SlotId> slot;       // the request state, from the fixed pool, while the job runs
  int64_t position = 0;                      // prompt tokens consumed so far; the job is done at plan.target() = N−1
  std::optional<kvstore::PrefillPlan> plan;  // where chunks end and which boundaries they reach; set at the start
  // Prefix cache (when enabled):
  bool caching = false;                    // rows go into `pages`; boundaries are registered at the end
  std::vector<kvstore::BlockHash> hashes;  // of the full blocks of prompt[0, N−1)
  kvstore::PageTable pages;                // this request's MLA rows (shared prefix + its own)
  int64_t cached_tokens = 0;               // prompt tokens restored from the cache
  // A resumed job (PrefillJob::generated, k tokens): after prompt[0, N−1), the k decode passes it replays, one
  // token each, over prompt[N−1] and generated[0, k−1). Done at k.
  int64_t replayed = 0;
};

int64_t replay_count(const Job& job) {
  return static_cast<int64_t>(job.job.generated.size());
}

struct PrefillState {
  std::shared_ptr<const engine::Model> model;
  registry_actor registry;
  PrefillWorkerConfig config;
  std::shared_ptr<Transport> transport;
  std::unique_ptr<kvstore::SlotPool<engine::RequestState>> slots;
  std::unique_ptr<kvstore::PrefixCache> cache;  // null: no prefix cache
  std::unique_ptr<kvstore::BlockHasher> hasher;
  std::deque<Job> jobs;  // FIFO; front is being prefilled
  bool work_pending = false;
  bool draining = false;
  std::unique_ptr<LoadReporter> reporter;  // with a registry and a heartbeat interval (heartbeat.hpp)
  uint64_t next_handoff_id = 1;
  WorkerStats stats;
  WorkerLoad last_reported{-1, -1, -1, -1};

  ~PrefillState() {
    for (Job& job : jobs) {
      if (cache) job.pages.release(cache->pool());
    }
  }
};

using PrefillPointer = prefill_actor::stateful_pointer<PrefillState>;

bool debug_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("DELTASERVE_LOG");
    return v && std::string(v) == "debug";
  }();
  return enabled;
}

WorkerLoad current_load(const PrefillState& s) {
  WorkerLoad load;
  load.queue_length = static_cast<int64_t>(s.jobs.size());
  load.active = s.jobs.empty() ? 0 : 1;
  return load;
}

void report_load(PrefillPointer self, bool force) {
  auto& s = self->state;
  if (!s.registry || s.draining) return;
  const WorkerLoad load = current_load(s);
  if (!force && load.queue_length == s.last_reported.queue_length && load.active == s.last_reported.active) return;
  s.last_reported = load;
  if (s.reporter) {  // one sender for every report keeps them in order
    s.reporter->set(load);
  } else {
    self->send(s.registry, heartbeat_atom::value, s.config.name, load);
  }
}

void schedule_work(PrefillPointer self) {
  if (self->state.work_pending || self->state.jobs.empty()) return;
  self->state.work_pending = true;
  self->send(self, work_atom::value);
}

// Sends what changed in the prefix cache to the registry, which forwards it to the routers' index.
void publish_cache_events(PrefillPointer self) {
  auto& s = self->state;
  if (!s.cache) return;
  kvstore::CacheEventBatch batch{s.config.name, s.config.prefix_cache.epoch, s.cache->take_events()};
  if (batch.events.empty() || !s.registry) return;
  self->send(s.registry, cache_atom::value, std::move(batch));
}

// States move from GPU memory to GPU memory (Transport::send_device_state) rather than through the host encoding.
bool device_handoff(const PrefillState& s) {
  return s.transport && s.model->backend() != nullptr && s.transport->moves_device_state();
}

// Gives back everything a job holds (its pages and its state slot).
void release_job(PrefillState& s, Job& job) {
  if (s.cache) job.pages.release(s.cache->pool());
  if (job.slot) {
    s.slots->release(*job.slot);
    job.slot.reset();
  }
}

void fail_front(PrefillPointer self, Status status) {
  auto& s = self->state;
  Job& job = s.jobs.front();
  self->send(caf::actor_cast<sink_actor>(job.job.sink), chunk_atom::value, job.job.attempt,
             error_chunk(job.job.request.request_id, std::move(status)));
  release_job(s, job);
  s.jobs.pop_front();
}

// Takes a state slot and, with a prefix cache, restores the deepest usable cached prefix.
Status start_job(PrefillPointer self, Job& job) {
  auto& s = self->state;
  job.slot = s.slots->acquire();
  if (!job.slot) return Status(StatusCode::kResourceExhausted, "no free request state slot");
  engine::RequestState& state = s.slots->at(*job.slot);
  state.reset();
  job.started = true;
  const auto& prompt = job.job.request.prompt;
  job.plan.emplace(static_cast<int64_t>(prompt.size()), s.config.chunk_tokens, s.cache ? s.cache->block_tokens() : 0);
  if (!s.cache) return Status::ok();

  // The router's hashes when they are this worker's chain (PrefillJob::prompt_hashes), else hashed here.
  const kvstore::BlockHash root =
      s.hasher->root(job.job.request.prefix_cache_namespace(), s.config.prefix_cache.model_id);
  job.hashes =
      s.hasher->hash_prompt(root, std::span<const int32_t>(prompt).first(static_cast<size_t>(job.plan->target())),
                            std::move(job.job.prompt_hashes));
  job.caching = true;
  kvstore::PrefixCache::Hit hit = s.cache->lookup(job.hashes, job.plan->full_blocks());
  if (hit.blocks == 0) return Status::ok();
  const int64_t tokens = hit.blocks * s.cache->block_tokens();
  Status resumed =
      engine::resume_from_prefix(s.model->config(), *hit.checkpoint, hit.pages, s.cache->pool(), tokens, state);
  if (!resumed.is_ok()) {  // never a wrong hit: compute everything
    std::cerr << "warning: " << s.config.name << ": prefix cache entry unusable, recomputing: " << resumed.to_string()
              << "\n";
    hit.pages.release(s.cache->pool());
    state.reset();
    return Status::ok();
  }
  job.pages = std::move(hit.pages);
  job.position = tokens;
  job.cached_tokens = tokens;
  if (debug_enabled()) {
    std::cerr << "debug: " << s.config.name << " prefix hit " << job.job.request.request_id << " " << tokens
              << " tokens\n";
  }
  return Status::ok();
}

// Runs the next chunk of the front job; with a cache, keeps its rows and takes checkpoints at boundaries.
Status prefill_chunk(PrefillPointer self, Job& job) {
  auto& s = self->state;
  engine::RequestState& state = s.slots->at(*job.slot);
  const auto& prompt = job.job.request.prompt;
  const kvstore::PrefillPlan& plan = *job.plan;
  const int64_t end = plan.chunk_end(job.position);  // with a cache, on the boundary a crossing chunk reaches
  const int64_t n = end - job.position;
  std::vector<std::vector<float>> logits;
  engine::SequenceInput input{
      &state, std::span<const int32_t>(prompt).subspan(static_cast<size_t>(job.position), static_cast<size_t>(n)),
      false};
  DS_RETURN_IF_ERROR(s.model->forward({&input, 1}, logits));
  ++s.stats.steps;
  const int64_t first = job.position;
  job.position = end;
  // A device backend keeps the caches on the GPU: the handoff encoding reads the whole host copy; the prefix cache
  // only this chunk's MLA rows, and the KDA part at block boundaries (where a checkpoint may be taken).
  const int64_t boundary = plan.boundary_at(job.position);  // k >= 1: the chunk ended after block k
  if (job.position >= plan.target() && !device_handoff(s)) {
    DS_RETURN_IF_ERROR(state.sync_host());
  } else if (job.caching) {
    DS_RETURN_IF_ERROR(state.sync_host_part(boundary > 0, job.position));
  }
  if (!job.caching) return Status::ok();

  const engine::ModelConfig& config = s.model->config();
  Status kept = s.cache->append(job.pages, engine::gather_mla_page_rows(config, state, first, n));
  if (!kept.is_ok()) {  // running requests hold every page: serve this one without caching it
    job.caching = false;
    job.pages.release(s.cache->pool());
    return Status::ok();
  }
  if (boundary > 0) {
    const kvstore::BlockHash& hash = job.hashes[static_cast<size_t>(boundary - 1)];
    if (s.cache->should_checkpoint(boundary, plan.full_blocks(), hash)) {
      Status put = s.cache->put_checkpoint(hash, engine::encode_kda_checkpoint(config, state));
      if (!put.is_ok() && debug_enabled()) std::cerr << "debug: checkpoint not kept: " << put.to_string() << "\n";
    }
  }
  return Status::ok();
}

// A resumed job, after prompt[0, N−1): the passes the lost decode worker ran, one token per pass, over prompt[N−1]
// and the delivered tokens but the last, at most chunk_tokens of them per call. Not a chunked prefill: that would
// give the same state only up to the last bits (and so, rarely, another sampled token); these passes give the state
// the decode worker held, bit for bit where the kernels are batch-invariant (engine/decode_batcher.hpp).
Status replay_chunk(PrefillPointer self, Job& job) {
  auto& s = self->state;
  engine::RequestState& state = s.slots->at(*job.slot);
  const std::vector<int32_t>& generated = job.job.generated;
  const int64_t end = std::min(replay_count(job), job.replayed + s.config.chunk_tokens);
  std::vector<std::vector<float>> logits;
  for (; job.replayed < end; ++job.replayed) {
    const int32_t token =
        job.replayed == 0 ? job.job.request.prompt.back() : generated[static_cast<size_t>(job.replayed - 1)];
    engine::SequenceInput input{&state, {&token, 1}, false};
    DS_RETURN_IF_ERROR(s.model->forward({&input, 1}, logits));
  }
  ++s.stats.steps;
  if (job.replayed >= replay_count(job) && !device_handoff(s)) DS_RETURN_IF_ERROR(state.sync_host());
  return Status::ok();
}

// Encodes the front job's state and hands it to its decode worker.
void hand_off(PrefillPointer self) {
  auto& s = self->state;
  Job& job = s.jobs.front();
  const auto start = Clock::now();
  const auto& prompt = job.job.request.prompt;
  // Device path: the state leaves its slot as it is (the slot gets a fresh state) and moves in GPU memory; the
  // transport holds it, with its device slot and pages, until its side of the transfer ended.
  std::shared_ptr<engine::RequestState> device_state;
  std::vector<uint8_t> bytes;
  if (device_handoff(s)) {
    device_state = std::make_shared<engine::RequestState>(std::move(s.slots->at(*job.slot)));
    s.slots->at(*job.slot) = s.model->new_state();
  } else {
    const std::vector<std::byte> encoded = engine::encode_state(s.model->config(), s.slots->at(*job.slot));
    bytes.resize(encoded.size());
    if (!encoded.empty()) std::memcpy(bytes.data(), encoded.data(), encoded.size());
  }
  if (job.caching) s.cache->insert(job.hashes, job.pages, job.job.request.prefix_cache_namespace());
  s.stats.prompt_tokens += static_cast<int64_t>(prompt.size()) + replay_count(job);
  s.stats.cached_tokens += job.cached_tokens;
  int64_t num_bytes = static_cast<int64_t>(bytes.size());
  if (device_state) {  // as stored on the device (waits for its last pass, as the transfer would)
    auto spans = s.model->backend()->device_state_spans(*device_state);
    num_bytes = spans.is_ok() ? spans->bytes() : 0;
  }
  HandoffEnvelope envelope;
  envelope.handoff_id = s.next_handoff_id++;
  envelope.next_token = job.job.generated.empty() ? prompt.back() : job.job.generated.back();
  envelope.sink = job.job.sink;
  envelope.router = job.job.router;
  envelope.attempt = job.job.attempt;
  const int64_t attempt = job.job.attempt;
  envelope.cached_tokens = job.cached_tokens;
  envelope.generated = std::move(job.job.generated);
  const std::string id = job.job.request.request_id;
  const caf::actor sink = job.job.sink, router = job.job.router, decode_worker = job.job.decode_worker;
  const std::string decode_host = job.job.decode_host;
  const uint16_t decode_port = job.job.decode_port;
  envelope.request = std::move(job.job.request);
  release_job(s, job);
  s.jobs.pop_front();
  publish_cache_events(self);
  // What is handed over, shared by the continuation below (the state may be large): the envelope and either the
  // encoded bytes or the state in device memory.
  struct Payload {
    HandoffEnvelope envelope;
    std::vector<uint8_t> bytes;
    std::shared_ptr<engine::RequestState> device_state;
  };
  auto payload = std::make_shared<Payload>(Payload{std::move(envelope), std::move(bytes), std::move(device_state)});
  auto deliver = [self, payload, id, attempt, sink, router, num_bytes, start](const caf::actor& target) {
    auto& s = self->state;
    Status sent = payload->device_state
                      ? s.transport->send_device_state(target, std::move(payload->envelope),
                                                       std::move(payload->device_state), s.model)
                      : s.transport->send_state(target, std::move(payload->envelope), std::move(payload->bytes));
    const int64_t micros = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start).count();
    if (!sent.is_ok()) {
      self->send(caf::actor_cast<sink_actor>(sink), chunk_atom::value, attempt,
                 error_chunk(id, sent.with_context("handoff")));
      return;
    }
    ++s.stats.handoffs;
    s.stats.handoff_bytes += num_bytes;
    s.stats.handoff_us += micros;
    if (debug_enabled()) {
      std::cerr << "debug: " << s.config.name << " handoff " << id << " " << num_bytes << " bytes in " << micros
                << " us\n";
    }
    if (router) {
      self->send(caf::actor_cast<router_actor>(router), prefilled_atom::value, id, attempt, num_bytes, micros);
    }
  };
  if (decode_port == 0 || !s.config.peers || !decode_worker) {
    deliver(decode_worker);
    return;
  }
  // A decode worker of another node: over a direct connection to it (actors/decode_peers.hpp), never through a
  // router. The router prefills the request again when that connection cannot be made.
  const std::string where = decode_host + ":" + std::to_string(decode_port);
  auto fail = [self, id, attempt, sink, router, where](const Status& why) {
    const Status status(StatusCode::kUnavailable,
                        "handoff: no connection to the decode worker at " + where + ": " + why.message());
    if (router) {
      self->send(caf::actor_cast<router_actor>(router), failed_atom::value, id, attempt,
                 static_cast<int32_t>(status.code()), status.message());
    } else {
      self->send(caf::actor_cast<sink_actor>(sink), chunk_atom::value, attempt, error_chunk(id, status));
    }
  };
  auto endpoint = s.config.peers->caf_endpoint(decode_host, decode_port);
  if (!endpoint.is_ok()) {
    fail(endpoint.status());
    return;
  }
  auto peers = s.config.peers;
  self->request(self->system().middleman().actor_handle(), s.config.peer_connect_timeout, caf::connect_atom::value,
                endpoint->first, endpoint->second)
      .then(
          [deliver, fail, decode_worker](const caf::node_id&, const caf::strong_actor_ptr& published,
                                         const std::set<std::string>&) {
            // The address may have been taken over by another decode worker (a restarted one): not the one the
            // router chose, whose state and slot are gone with its process.
            if (!published || published->node() != decode_worker.node() || published->id() != decode_worker.id()) {
              fail(Status(StatusCode::kUnavailable, "another decode worker listens there now"));
              return;
            }
            deliver(caf::actor_cast<caf::actor>(published));
          },
          [self, fail, peers, decode_host, decode_port](const caf::error& error) {
            std::string why = self->system().render(error);
            if (std::string tunnel = peers->transport_error(decode_host, decode_port); !tunnel.empty()) {
              why += " (" + tunnel + ")";
            }
            fail(Status(StatusCode::kUnavailable, why));
          });
}

WorkerStats current_stats(const PrefillState& s) {
  WorkerStats out = s.stats;
  out.queued = static_cast<int64_t>(s.jobs.size());
  out.active = s.jobs.empty() ? 0 : 1;
  out.slots_total = s.slots->size();
  out.slots_free = s.slots->free_slots();
  if (s.cache) {
    const kvstore::PrefixCacheStats c = s.cache->stats();
    out.pages_total = c.pages_total;
    out.pages_free = c.pages_free;
    out.cache_entries = c.entries;
    out.checkpoints = c.checkpoints;
    out.checkpoint_bytes = c.checkpoint_bytes;
    out.cache_evictions = c.entry_evictions + c.checkpoint_evictions;
  }
  return out;
}

}  // namespace

Status validate(const PrefillWorkerConfig& config, const engine::ModelConfig& model) {
  if (config.chunk_tokens <= 0) return invalid_argument("prefill_chunk: must be positive");
  if (config.state_slots <= 0) return invalid_argument("state_slots: must be positive");
  if (!config.prefix_cache.enabled) return Status::ok();
  kvstore::PrefixCacheConfig cache = config.prefix_cache.cache;
  cache.pages.row_values = engine::mla_page_row_values(model);
  if (cache.pages.row_values == 0) return invalid_argument("prefix cache: the model has no MLA layers");
  return kvstore::validate(cache).with_context("prefix cache");
}

namespace {

prefill_actor::behavior_type prefill_impl(PrefillPointer self, std::shared_ptr<const engine::Model> model,
                                          registry_actor registry, PrefillWorkerConfig config,
                                          std::shared_ptr<Transport> transport) {
  auto& s = self->state;
  s.model = std::move(model);
  s.registry = std::move(registry);
  s.config = std::move(config);
  s.transport = transport ? std::move(transport) : make_caf_transport();
  if (s.config.chunk_tokens <= 0) s.config.chunk_tokens = 512;
  if (s.config.state_slots <= 0) s.config.state_slots = 1;
  s.slots = std::make_unique<kvstore::SlotPool<engine::RequestState>>(
      std::vector<engine::RequestState>(static_cast<size_t>(s.config.state_slots), s.model->new_state()));
  if (s.config.prefix_cache.enabled) {
    Status valid = validate(s.config, s.model->config());
    if (valid.is_ok()) {
      kvstore::PrefixCacheConfig cache = s.config.prefix_cache.cache;
      cache.pages.row_values = engine::mla_page_row_values(s.model->config());
      s.cache = std::make_unique<kvstore::PrefixCache>(cache);
      s.hasher = std::make_unique<kvstore::BlockHasher>(s.config.prefix_cache.hash_key, cache.block_tokens);
    } else {  // Node validates first; a direct spawn with bad settings runs without a cache
      std::cerr << "warning: " << s.config.name << ": prefix cache off: " << valid.to_string() << "\n";
    }
  }
  if (s.registry && s.config.heartbeat_interval.count() > 0) {
    s.reporter = std::make_unique<LoadReporter>(self->system(), s.registry, s.config.name, s.config.heartbeat_interval,
                                                current_load(s));
  }
  return {
      [self](prefill_atom, PrefillJob& job) {
        auto& s = self->state;
        if (job.request.prompt.empty()) {
          self->send(caf::actor_cast<sink_actor>(job.sink), chunk_atom::value, job.attempt,
                     error_chunk(job.request.request_id, invalid_argument("empty prompt")));
          return;
        }
        Job queued;
        queued.job = std::move(job);
        s.jobs.push_back(std::move(queued));
        schedule_work(self);
        report_load(self, false);
      },
      [self](work_atom) {
        auto& s = self->state;
        s.work_pending = false;
        if (s.jobs.empty()) return;
        Job& job = s.jobs.front();
        if (!job.started) {
          if (Status started = start_job(self, job); !started.is_ok()) {
            fail_front(self, started.with_context("prefill"));
            schedule_work(self);
            report_load(self, false);
            return;
          }
        }
        const int64_t target = job.plan->target();  // N−1
        if (job.position < target || job.replayed < replay_count(job)) {
          Status status = job.position < target ? prefill_chunk(self, job) : replay_chunk(self, job);
          if (!status.is_ok()) fail_front(self, status.with_context("prefill"));
        }
        if (!s.jobs.empty() && s.jobs.front().started && s.jobs.front().position >= target &&
            s.jobs.front().replayed >= replay_count(s.jobs.front())) {
          hand_off(self);
        }
        publish_cache_events(self);
        schedule_work(self);
        report_load(self, false);
      },
      [self](cancel_atom, const std::string& id) {
        auto& s = self->state;
        for (auto it = s.jobs.begin(); it != s.jobs.end(); ++it) {
          if (it->job.request.request_id != id) continue;
          router::GenerationChunk chunk;
          chunk.request_id = id;
          chunk.finish_reason = "abort";
          chunk.prompt_tokens = static_cast<int64_t>(it->job.request.prompt.size());
          self->send(caf::actor_cast<sink_actor>(it->job.sink), chunk_atom::value, it->job.attempt, std::move(chunk));
          release_job(s, *it);
          s.jobs.erase(it);
          report_load(self, false);
          return;
        }
      },
      [self](drain_atom) {
        auto& s = self->state;
        if (s.reporter) s.reporter->set_draining();
        if (s.registry && !s.draining) self->send(s.registry, leave_atom::value, s.config.name);
        s.draining = true;
      },
      [self](stats_atom) -> WorkerStats { return current_stats(self->state); },
  };
}

}  // namespace

prefill_actor spawn_prefill_worker(caf::actor_system& system, std::shared_ptr<const engine::Model> model,
                                   registry_actor registry, PrefillWorkerConfig config,
                                   std::shared_ptr<Transport> transport) {
  return system.spawn(prefill_impl, std::move(model), std::move(registry), std::move(config), std::move(transport));
}

}  // namespace deltaserve::actors
