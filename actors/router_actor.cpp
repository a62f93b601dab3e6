#include "actors/router_actor.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <unordered_map>
#include <vector>

#include "actors/decode_protocol.hpp"
#include "actors/prefill_protocol.hpp"

namespace deltaserve::actors {
namespace {

// kTransfer: prefilled, the state is on its way to the decode worker; kDecode: the decode worker admitted
// it (tokens may have been streamed from then on).
enum class Stage { kWaiting, kPrefill, kTransfer, kDecode };

struct Entry {
  router::GenerationRequest request;  // prompt kept until a decode worker admitted the state
  caf::actor sink;
  Stage stage = Stage::kWaiting;
  int64_t attempt = 0;  // dispatches so far
  std::string prefill_worker, decode_worker;
  int64_t prefill_tokens = 0;  // prompt tokens the prefill worker is expected to compute (load accounting)
  uint64_t queued = 0;         // times it entered the queue: a queue deadline of an earlier stay is stale
  // What the client has (the sink's delivered() reports, in stream order): one entry per worker chunk forwarded,
  // each one token. A retry resumes after them (PrefillJob::generated); bounded by max_tokens.
  std::vector<int32_t> delivered;
  int64_t delivered_chunks = 0;
};

struct RouterState {
  RouterConfig config;
  std::shared_ptr<RouterGauges> gauges;
  std::map<std::string, WorkerInfo> prefill_workers, decode_workers;  // by name: ties break by name
  std::map<std::string, int64_t> prefill_outstanding;                 // jobs this router sent and not yet prefilled
  std::map<std::string, int64_t> prefill_tokens;                      // their expected prompt tokens to compute
  std::unique_ptr<kvstore::BlockHasher> hasher;                       // only with an index: hashes prompts like workers
  std::set<std::pair<std::string, uint64_t>> cache_workers;           // (name, epoch) the index was reconciled to
  std::map<std::string, int64_t> decode_assigned;                     // requests this router placed and not finished
  std::unordered_map<std::string, Entry> requests;
  std::map<caf::actor_addr, std::string> by_sink;
  std::deque<std::string> queue;  // waiting request ids: higher priority first, FIFO within a priority (enqueue)
  RouterStats totals;
};

using RouterPointer = router_actor::stateful_pointer<RouterState>;

void update_gauges(RouterState& s) {
  const int64_t waiting = static_cast<int64_t>(s.queue.size());
  s.totals.waiting = waiting;
  s.totals.running = static_cast<int64_t>(s.requests.size()) - waiting;
  s.totals.prefill_workers = static_cast<int64_t>(s.prefill_workers.size());
  s.totals.decode_workers = static_cast<int64_t>(s.decode_workers.size());
  if (!s.gauges) return;
  s.gauges->waiting = s.totals.waiting;
  s.gauges->running = s.totals.running;
  s.gauges->prefill_workers = s.totals.prefill_workers;
  s.gauges->decode_workers = s.totals.decode_workers;
}

void send_final(RouterPointer self, const caf::actor& sink, router::GenerationChunk chunk) {
  self->send(caf::actor_cast<sink_actor>(sink), chunk_atom::value, kRouterChunk, std::move(chunk));
}

bool debug_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("DELTASERVE_LOG");
    return v && std::string(v) == "debug";
  }();
  return enabled;
}

// The prefill placement of one dispatch, and what travels with the job.
struct PrefillPick {
  const WorkerInfo* worker = nullptr;
  router::PrefillChoice choice;  // why (router/placement.hpp); its names view prefill_workers' keys
  bool looked_up = false;        // the index was asked
  kvstore::PromptHashes hashes;  // the prompt's usable block hashes when the index was asked (see PrefillJob)
};

// Hashes the prompt and asks the index when the policy wants it, then applies router/placement.hpp.
PrefillPick pick_prefill(RouterState& s, const router::GenerationRequest& r) {
  PrefillPick pick;
  const router::PlacementOptions options{s.config.policy, s.config.block_tokens};
  const auto prompt = static_cast<int64_t>(r.prompt.size());
  const int64_t lookup_blocks = router::index_lookup_blocks(options, prompt);
  std::vector<kvstore::WorkerPrefixMatch> found;
  if (s.config.index && lookup_blocks > 0 && !s.prefill_workers.empty()) {
    const std::string& ns = r.prefix_cache_namespace();
    const std::string& model_id = s.prefill_workers.begin()->second.model_id;
    pick.hashes.root = s.hasher->root(ns, model_id);
    pick.hashes.blocks = s.hasher->hash_prompt(
        pick.hashes.root,
        std::span<const int32_t>(r.prompt).first(static_cast<size_t>(lookup_blocks * s.config.block_tokens)));
    auto matches = s.config.index->lookup(pick.hashes.blocks, ns);
    pick.looked_up = true;
    if (matches.is_ok()) {
      found = std::move(*matches);
    } else {
      ++s.totals.index_errors;
    }
  }
  std::vector<router::IndexMatch> matches;
  matches.reserve(found.size());
  for (const kvstore::WorkerPrefixMatch& m : found) matches.push_back({m.worker, m.worker_epoch, m.checkpoint_blocks});
  std::vector<router::PrefillCandidate> candidates;
  std::vector<const WorkerInfo*> infos;
  candidates.reserve(s.prefill_workers.size());
  infos.reserve(s.prefill_workers.size());
  for (const auto& [name, info] : s.prefill_workers) {
    candidates.push_back(
        {name, info.cache_epoch, s.prefill_tokens[name], s.prefill_outstanding[name], info.load.queue_length});
    infos.push_back(&info);
  }
  pick.choice = router::choose_prefill(options, prompt, candidates, matches);
  if (pick.choice.worker) pick.worker = infos[*pick.choice.worker];
  return pick;
}

// Decode placement (router/placement.hpp); null when every decode worker is full.
const WorkerInfo* pick_decode(RouterState& s) {
  std::vector<router::DecodeCandidate> candidates;
  std::vector<const WorkerInfo*> infos;
  candidates.reserve(s.decode_workers.size());
  infos.reserve(s.decode_workers.size());
  for (const auto& [name, info] : s.decode_workers) {
    candidates.push_back({name, info.capacity, s.decode_assigned[name]});
    infos.push_back(&info);
  }
  const std::optional<size_t> chosen = router::choose_decode(candidates);
  return chosen ? infos[*chosen] : nullptr;
}

bool try_dispatch_one(RouterPointer self, Entry& entry) {
  auto& s = self->state;
  if (s.prefill_workers.empty()) return false;
  const WorkerInfo* decode = pick_decode(s);
  if (!decode) return false;
  PrefillPick pick = pick_prefill(s, entry.request);
  const WorkerInfo* prefill = pick.worker;
  const int64_t hit_tokens = pick.choice.hit_tokens;
  entry.stage = Stage::kPrefill;
  entry.prefill_worker = prefill->name;
  entry.decode_worker = decode->name;
  const auto resumed_tokens = static_cast<int64_t>(entry.delivered.size());
  entry.prefill_tokens =
      std::max<int64_t>(static_cast<int64_t>(entry.request.prompt.size()) + resumed_tokens - 1 - hit_tokens, 0);
  ++s.prefill_outstanding[prefill->name];
  s.prefill_tokens[prefill->name] += entry.prefill_tokens;
  ++s.decode_assigned[decode->name];
  if (hit_tokens > 0) {
    ++s.totals.routed_to_hit;
    s.totals.expected_cached_tokens += hit_tokens;
  }
  if (s.config.observer) {
    const router::GenerationRequest& r = entry.request;
    if (entry.attempt == 0 && r.arrival_ns > 0) {  // the first dispatch (retries are not queue time)
      const int64_t now =
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
              .count();
      s.config.observer->queue_time(static_cast<double>(std::max<int64_t>(now - r.arrival_ns, 0)) * 1e-9);
    }
    if (pick.looked_up) {
      s.config.observer->prefix_lookup(r.prefix_cache_namespace(), static_cast<int64_t>(r.prompt.size()), hit_tokens);
    }
  }
  if (debug_enabled()) {
    std::cerr << "debug: route " << entry.request.request_id << ": " << pick.choice.describe() << "\n";
  }
  ++entry.attempt;
  // An earlier attempt may still be alive (a stalled worker): the sink lets only one attempt through. This one
  // resumes after what the client has (as far as the router heard; the sink checks any overlap).
  if (entry.attempt > 1) {
    self->send(caf::actor_cast<sink_actor>(entry.sink), attempt_atom::value, entry.attempt, entry.delivered_chunks);
  }
  if (resumed_tokens > 0) {
    ++s.totals.resumed;
    s.totals.resumed_tokens += resumed_tokens;
  }
  PrefillJob job{entry.request, decode->handle, entry.sink, caf::actor_cast<caf::actor>(self), entry.attempt};
  job.prompt_hashes = std::move(pick.hashes);
  job.generated = entry.delivered;
  job.decode_host = decode->peer_host;
  job.decode_port = decode->peer_port;
  self->send(caf::actor_cast<prefill_actor>(prefill->handle), prefill_atom::value, std::move(job));
  return true;
}

// Puts a waiting request in the queue and arms its queue deadline. The queue is ordered by priority class
// (GenerationRequest::priority, from the tenant's limits), highest first, and by arrival within a class:
// a new request goes behind every request of its class or a higher one. A retry (`again`: it was
// dispatched and its attempt failed) goes to the front of its class instead, as it was admitted before
// anything still waiting there. Only waiting requests are ordered; nothing dispatched is preempted.
void enqueue(RouterPointer self, Entry& entry, bool again) {
  auto& s = self->state;
  const router::Priority priority = entry.request.priority;
  auto ahead = [&](const std::string& id) {  // does `id` stay ahead of the request being placed?
    auto it = s.requests.find(id);
    if (it == s.requests.end()) return true;  // a stale id: dispatch_waiting drops it
    return again ? it->second.request.priority > priority : it->second.request.priority >= priority;
  };
  auto at = s.queue.begin();
  if (again) {
    at = std::find_if_not(s.queue.begin(), s.queue.end(), ahead);
  } else {  // usually the back: scan from there
    auto from_back = std::find_if(s.queue.rbegin(), s.queue.rend(), ahead);
    at = from_back.base();
  }
  s.queue.insert(at, entry.request.request_id);
  ++entry.queued;
  if (s.config.queue_timeout.count() > 0) {
    self->delayed_send(self, s.config.queue_timeout, queue_timeout_atom::value, entry.request.request_id, entry.queued);
  }
}

void dispatch_waiting(RouterPointer self) {
  auto& s = self->state;
  while (!s.queue.empty()) {
    auto it = s.requests.find(s.queue.front());
    if (it == s.requests.end()) {
      s.queue.pop_front();
      continue;
    }
    if (!try_dispatch_one(self, it->second)) break;
    s.queue.pop_front();
  }
  update_gauges(s);
}

// Forgets a request (finished, failed or its sink gone) and releases its worker reservations.
void release(RouterState& s, const std::string& id) {
  auto it = s.requests.find(id);
  if (it == s.requests.end()) return;
  Entry& e = it->second;
  if (e.stage == Stage::kPrefill && s.prefill_outstanding[e.prefill_worker] > 0) {
    --s.prefill_outstanding[e.prefill_worker];
    s.prefill_tokens[e.prefill_worker] = std::max<int64_t>(s.prefill_tokens[e.prefill_worker] - e.prefill_tokens, 0);
  }
  if (e.stage != Stage::kWaiting && s.decode_assigned[e.decode_worker] > 0) --s.decode_assigned[e.decode_worker];
  if (e.stage == Stage::kWaiting) std::erase(s.queue, id);
  s.by_sink.erase(e.sink.address());
  s.requests.erase(it);
}

// Gives a dispatched, not yet admitted request back to the front of the queue (its worker reservations
// released) for another prefill; after max_attempts the sink gets `why`.
void retry(RouterPointer self, const std::string& id, const Status& why) {
  auto& s = self->state;
  auto it = s.requests.find(id);
  if (it == s.requests.end()) return;
  Entry& e = it->second;
  if (e.attempt >= s.config.max_attempts) {
    ++s.totals.failed;
    std::cerr << "warning: router: request " << id << " failed after " << e.attempt << " attempts: " << why.to_string()
              << "\n";
    // The client gets the kind of failure, not `why`'s text: that names workers, hosts and pids.
    send_final(self, e.sink,
               error_chunk(id, Status(why.code(), "gave up after " + std::to_string(e.attempt) + " attempts (" +
                                                      status_code_name(why.code()) + ")")));
    return;  // the sink quits after its final chunk; its down message releases the entry
  }
  ++s.totals.retried;
  // Retries are the visible symptom of lost handoffs and dying workers; the reason is what an operator needs.
  std::cerr << "warning: router: request " << id << " attempt " << e.attempt << " on " << e.prefill_worker << " -> "
            << e.decode_worker << " failed, prefilling again: " << why.to_string() << "\n";
  if (e.stage == Stage::kPrefill && s.prefill_outstanding[e.prefill_worker] > 0) {
    --s.prefill_outstanding[e.prefill_worker];
    s.prefill_tokens[e.prefill_worker] = std::max<int64_t>(s.prefill_tokens[e.prefill_worker] - e.prefill_tokens, 0);
  }
  if (s.decode_assigned[e.decode_worker] > 0) --s.decode_assigned[e.decode_worker];
  e.stage = Stage::kWaiting;
  e.prefill_worker.clear();
  e.decode_worker.clear();
  enqueue(self, e, /*again=*/true);
}

void cancel_on_workers(RouterPointer self, const Entry& e) {
  const std::string& id = e.request.request_id;
  if (auto p = self->state.prefill_workers.find(e.prefill_worker); p != self->state.prefill_workers.end()) {
    self->send(caf::actor_cast<prefill_actor>(p->second.handle), cancel_atom::value, id);
  }
  if (auto d = self->state.decode_workers.find(e.decode_worker); d != self->state.decode_workers.end()) {
    self->send(caf::actor_cast<decode_actor>(d->second.handle), cancel_atom::value, id);
  }
}

// Keeps the index to the live prefill workers' caches: entries of workers that are gone, or of an earlier
// incarnation of a worker (its cache started empty again), are dropped. Runs when that set changes (and
// so once after a restart, when the registry's first worker list arrives).
void reconcile_index(RouterPointer self) {
  auto& s = self->state;
  if (!s.config.index) return;
  std::set<std::pair<std::string, uint64_t>> live;
  for (const auto& [name, info] : s.prefill_workers) {
    if (info.cache_epoch != 0) live.emplace(name, info.cache_epoch);
  }
  if (live == s.cache_workers) return;
  const std::vector<std::pair<std::string, uint64_t>> pairs(live.begin(), live.end());
  auto dropped = s.config.index->reconcile(pairs);
  if (!dropped.is_ok()) {
    ++s.totals.index_errors;
    std::cerr << "warning: prefix index reconcile: " << dropped.status().to_string() << "\n";
    return;
  }
  s.cache_workers = std::move(live);
  if (debug_enabled()) std::cerr << "debug: prefix index reconciled, " << *dropped << " entries dropped\n";
}

router_actor::behavior_type router_impl(RouterPointer self, RouterConfig config, registry_actor registry,
                                        std::shared_ptr<RouterGauges> gauges) {
  self->state.config = config;
  if (config.index) self->state.hasher = std::make_unique<kvstore::BlockHasher>(config.hash_key, config.block_tokens);
  self->state.gauges = std::move(gauges);
  if (registry) {
    self->send(registry, subscribe_atom::value, caf::actor_cast<caf::actor>(self));
  }
  // Sinks: the request is over for whoever submitted it.
  self->set_down_handler([self](const caf::down_msg& down) {
    auto& s = self->state;
    auto it = s.by_sink.find(down.source);
    if (it == s.by_sink.end()) return;
    const std::string id = it->second;
    auto entry = s.requests.find(id);
    // A sink quits after its final chunk; if it died early, the workers still hold the request.
    if (entry != s.requests.end() && entry->second.stage != Stage::kWaiting &&
        down.reason != caf::exit_reason::normal) {
      cancel_on_workers(self, entry->second);
    }
    release(s, id);
    dispatch_waiting(self);
  });
  return {
      [self](submit_atom, router::GenerationRequest& request, caf::actor& sink) {
        auto& s = self->state;
        if (!sink) return;
        const std::string id = request.request_id;
        if (s.requests.count(id) != 0) {
          send_final(self, sink, error_chunk(id, invalid_argument("duplicate request id " + id)));
          return;
        }
        const bool can_run_now = s.queue.empty() && !s.prefill_workers.empty() && pick_decode(s);
        if (!can_run_now && static_cast<int64_t>(s.queue.size()) >= s.config.max_queue) {
          ++s.totals.rejected;
          send_final(self, sink,
                     error_chunk(id, Status(StatusCode::kResourceExhausted,
                                            "server overloaded: " + std::to_string(s.queue.size()) +
                                                " requests waiting (max_queue)")));
          return;
        }
        ++s.totals.admitted;
        self->monitor(sink);
        s.by_sink[sink.address()] = id;
        Entry& entry = s.requests[id];
        entry.request = std::move(request);
        entry.sink = std::move(sink);
        enqueue(self, entry, /*again=*/false);
        dispatch_waiting(self);
      },
      [self](cancel_atom, const std::string& id) {
        auto& s = self->state;
        auto it = s.requests.find(id);
        if (it == s.requests.end()) return;
        if (it->second.stage == Stage::kWaiting) {
          router::GenerationChunk chunk;
          chunk.request_id = id;
          chunk.finish_reason = "abort";
          chunk.prompt_tokens = static_cast<int64_t>(it->second.request.prompt.size());
          send_final(self, it->second.sink, std::move(chunk));
          release(s, id);
          update_gauges(s);
          return;
        }
        cancel_on_workers(self, it->second);  // the worker holding it sends "abort"; the sink's exit releases it
      },
      [self](prefilled_atom, const std::string& id, int64_t attempt, int64_t bytes, int64_t micros) {
        auto& s = self->state;
        if (s.config.observer) s.config.observer->handoff(bytes, static_cast<double>(micros) * 1e-6, true);
        auto it = s.requests.find(id);
        if (it == s.requests.end() || it->second.stage != Stage::kPrefill || it->second.attempt != attempt) return;
        const std::string& worker = it->second.prefill_worker;
        if (s.prefill_outstanding[worker] > 0) --s.prefill_outstanding[worker];
        s.prefill_tokens[worker] = std::max<int64_t>(s.prefill_tokens[worker] - it->second.prefill_tokens, 0);
        it->second.stage = Stage::kTransfer;
        dispatch_waiting(self);
      },
      [self](admitted_atom, const std::string& id, int64_t attempt) {
        auto& s = self->state;
        auto it = s.requests.find(id);
        if (it == s.requests.end() || it->second.attempt != attempt || it->second.stage == Stage::kWaiting) return;
        Entry& e = it->second;
        if (e.stage == Stage::kPrefill && s.prefill_outstanding[e.prefill_worker] > 0) {  // admitted overtook prefilled
          --s.prefill_outstanding[e.prefill_worker];
          s.prefill_tokens[e.prefill_worker] =
              std::max<int64_t>(s.prefill_tokens[e.prefill_worker] - e.prefill_tokens, 0);
        }
        e.stage = Stage::kDecode;  // the prompt stays: a lost decode worker means another attempt
        dispatch_waiting(self);
      },
      [self](failed_atom, const std::string& id, int64_t attempt, int32_t code, const std::string& message) {
        auto& s = self->state;
        auto it = s.requests.find(id);
        if (it == s.requests.end() || it->second.attempt != attempt) return;
        if (it->second.stage != Stage::kPrefill && it->second.stage != Stage::kTransfer) return;
        const auto status_code = code >= 0 && code <= static_cast<int32_t>(StatusCode::kCancelled)
                                     ? static_cast<StatusCode>(code)
                                     : StatusCode::kInternal;
        if (s.config.observer) s.config.observer->handoff(0, 0.0, false);
        retry(self, id, Status(status_code, message));
        dispatch_waiting(self);
      },
      [self](delivered_atom, const std::string& id, const std::vector<int32_t>& tokens) {
        auto it = self->state.requests.find(id);
        if (it == self->state.requests.end()) return;
        Entry& e = it->second;
        // Bounded: the request's own stream has at most max_tokens tokens (one per chunk).
        if (static_cast<int64_t>(e.delivered.size() + tokens.size()) > e.request.max_tokens) return;
        e.delivered.insert(e.delivered.end(), tokens.begin(), tokens.end());
        ++e.delivered_chunks;
      },
      [self](workers_atom, const std::vector<WorkerInfo>& workers) {
        auto& s = self->state;
        s.prefill_workers.clear();
        s.decode_workers.clear();
        int64_t slots_total = 0, slots_free = 0, worker_requests = 0;
        for (const WorkerInfo& w : workers) {
          if (!w.handle) continue;
          if (w.role == kPrefillRole) s.prefill_workers[w.name] = w;
          if (w.role == kDecodeRole) {
            s.decode_workers[w.name] = w;
            slots_total += w.capacity;
            slots_free += w.load.free_slots;
          }
          worker_requests += w.load.active + w.load.queue_length;
        }
        if (s.config.observer) {
          std::vector<RouterWorkerLoad> views;
          for (const WorkerInfo& w : workers) {
            views.push_back({w.name, w.role, w.load.active + w.load.queue_length, w.load.free_slots});
          }
          s.config.observer->workers(views);
        }
        reconcile_index(self);
        if (s.gauges) {
          s.gauges->decode_slots_total = slots_total;
          s.gauges->decode_slots_free = slots_free;
          s.gauges->worker_requests = worker_requests;
        }
        dispatch_waiting(self);
      },
      [self](lost_atom, const std::string& name) {
        auto& s = self->state;
        // "Lost" may be a stall, not a death. A request it held that no chunk has shown admitted is prefilled
        // again; if the old attempt still streams, the sink's gate lets only one of the two through.
        const bool lost_decode = s.decode_workers.count(name) != 0;
        caf::actor lost_handle;  // a decode worker that only stalled reads the drops below when it comes back
        if (lost_decode) lost_handle = s.decode_workers[name].handle;
        s.prefill_workers.erase(name);
        s.decode_workers.erase(name);
        std::vector<std::string> again;
        for (auto& [id, e] : s.requests) {
          // Prefilled but not yet admitted (kTransfer) counts as on the prefill worker: the handoff may not have
          // left it (a UCX sender reports `prefilled` before its reserve reaches the decode worker, which then
          // never hears of the request), and nobody else would ever fail it.
          const bool on_prefill =
              (e.stage == Stage::kPrefill || e.stage == Stage::kTransfer) && e.prefill_worker == name;
          const bool on_decode = e.stage != Stage::kWaiting && e.decode_worker == name;
          if (!on_prefill && !on_decode) continue;
          if (on_prefill) {  // it may have handed off just before: that decode worker drops the stale handoff
            if (auto d = s.decode_workers.find(e.decode_worker); d != s.decode_workers.end()) {
              self->send(caf::actor_cast<decode_actor>(d->second.handle), drop_atom::value, id, e.attempt);
            }
          }
          if (on_decode && lost_handle) {  // frees its slot there if the worker comes back; no chunk
            self->send(caf::actor_cast<decode_actor>(lost_handle), drop_atom::value, id, e.attempt);
          }
          again.push_back(id);  // also when streaming: the new attempt resumes after what the client has
        }
        const std::string role = lost_decode ? "decode" : "prefill";
        for (const std::string& id : again) {
          // The client may see this reason (after max_attempts): the worker's name would tell it internal hosts.
          retry(self, id, Status(StatusCode::kUnavailable, "a " + role + " worker was lost"));
        }
        s.prefill_outstanding.erase(name);
        s.prefill_tokens.erase(name);
        s.decode_assigned.erase(name);
        reconcile_index(self);
        dispatch_waiting(self);
      },
      [self](cache_atom, const kvstore::CacheEventBatch& batch) {
        auto& s = self->state;
        if (!s.config.index) return;
        auto w = s.prefill_workers.find(batch.worker);
        if (w == s.prefill_workers.end() || w->second.cache_epoch != batch.worker_epoch) return;  // not live
        const auto start = std::chrono::steady_clock::now();
        if (Status applied = s.config.index->apply(batch); applied.is_ok()) {
          s.totals.index_events += static_cast<int64_t>(batch.events.size());
          if (s.config.observer) {
            s.config.observer->index_write(
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
          }
        } else {
          ++s.totals.index_errors;
          std::cerr << "warning: prefix index: " << applied.to_string() << "\n";
        }
      },
      [self](queue_timeout_atom, const std::string& id, uint64_t queued) {
        auto& s = self->state;
        auto it = s.requests.find(id);
        if (it == s.requests.end() || it->second.stage != Stage::kWaiting || it->second.queued != queued) return;
        ++s.totals.failed;
        router::GenerationChunk chunk =
            error_chunk(id, Status(StatusCode::kUnavailable, "no worker was free for " +
                                                                 std::to_string(s.config.queue_timeout.count()) +
                                                                 " ms (the router's queue timeout); retry later"));
        chunk.prompt_tokens = static_cast<int64_t>(it->second.request.prompt.size());
        send_final(self, it->second.sink, std::move(chunk));
        release(s, id);
        update_gauges(s);
      },
      [self](stats_atom) -> RouterStats {
        update_gauges(self->state);
        if (self->state.config.index) {
          const kvstore::PrefixIndexStats index = self->state.config.index->stats();
          self->state.totals.index_entries = index.entries;
          self->state.totals.index_bytes = index.sst_file_bytes;
        }
        return self->state.totals;
      },
  };
}

}  // namespace

router_actor spawn_router(caf::actor_system& system, RouterConfig config, registry_actor registry,
                          std::shared_ptr<RouterGauges> gauges) {
  return system.spawn(router_impl, config, std::move(registry), std::move(gauges));
}

}  // namespace deltaserve::actors
