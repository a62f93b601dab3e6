#include "actors/prefill_worker.hpp"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iostream>

#include "engine/state_codec.hpp"

namespace deltaserve::actors {
namespace {

using Clock = std::chrono::steady_clock;

struct Job {
  PrefillJob job;
  engine::RequestState state;
  int64_t position = 0;  // prompt tokens consumed so far; the job is done at N−1
};

struct PrefillState {
  std::shared_ptr<const engine::Model> model;
  registry_actor registry;
  PrefillWorkerConfig config;
  std::shared_ptr<Transport> transport;
  std::deque<Job> jobs;  // FIFO; front is being prefilled
  bool work_pending = false;
  bool draining = false;
  uint64_t next_handoff_id = 1;
  WorkerStats stats;
  WorkerLoad last_reported{-1, -1, -1, -1};
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
  self->send(s.registry, heartbeat_atom::value, s.config.name, load);
}

void schedule_work(PrefillPointer self) {
  if (self->state.work_pending || self->state.jobs.empty()) return;
  self->state.work_pending = true;
  self->send(self, work_atom::value);
}

void fail_front(PrefillPointer self, Status status) {
  auto& s = self->state;
  Job& job = s.jobs.front();
  self->send(caf::actor_cast<sink_actor>(job.job.sink), chunk_atom::value,
             error_chunk(job.job.request.request_id, std::move(status)));
  s.jobs.pop_front();
}

// Encodes the front job's state and hands it to its decode worker.
void hand_off(PrefillPointer self) {
  auto& s = self->state;
  Job& job = s.jobs.front();
  const auto start = Clock::now();
  const std::vector<std::byte> encoded = engine::encode_state(s.model->config(), job.state);
  std::vector<uint8_t> bytes(encoded.size());
  if (!encoded.empty()) std::memcpy(bytes.data(), encoded.data(), encoded.size());
  const int64_t num_bytes = static_cast<int64_t>(bytes.size());
  HandoffEnvelope envelope;
  envelope.handoff_id = s.next_handoff_id++;
  envelope.next_token = job.job.request.prompt.back();
  envelope.sink = job.job.sink;
  const std::string id = job.job.request.request_id;
  envelope.request = std::move(job.job.request);
  Status sent = s.transport->send_state(job.job.decode_worker, std::move(envelope), std::move(bytes));
  const int64_t micros = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start).count();
  if (!sent.is_ok()) {
    self->send(caf::actor_cast<sink_actor>(job.job.sink), chunk_atom::value,
               error_chunk(id, sent.with_context("handoff")));
    s.jobs.pop_front();
    return;
  }
  ++s.stats.handoffs;
  s.stats.handoff_bytes += num_bytes;
  s.stats.handoff_us += micros;
  if (debug_enabled()) {
    std::cerr << "debug: " << s.config.name << " handoff " << id << " " << num_bytes << " bytes in " << micros
              << " us\n";
  }
  if (job.job.router) {
    self->send(caf::actor_cast<router_actor>(job.job.router), prefilled_atom::value, id, num_bytes, micros);
  }
  s.jobs.pop_front();
}

prefill_actor::behavior_type prefill_impl(PrefillPointer self, std::shared_ptr<const engine::Model> model,
                                          registry_actor registry, PrefillWorkerConfig config,
                                          std::shared_ptr<Transport> transport) {
  auto& s = self->state;
  s.model = std::move(model);
  s.registry = std::move(registry);
  s.config = std::move(config);
  s.transport = transport ? std::move(transport) : make_caf_transport();
  if (s.config.chunk_tokens <= 0) s.config.chunk_tokens = 512;
  if (s.registry && s.config.heartbeat_interval.count() > 0) {
    self->delayed_send(self, s.config.heartbeat_interval, tick_atom::value);
  }
  return {
      [self](prefill_atom, PrefillJob& job) {
        auto& s = self->state;
        if (job.request.prompt.empty()) {
          self->send(caf::actor_cast<sink_actor>(job.sink), chunk_atom::value,
                     error_chunk(job.request.request_id, invalid_argument("empty prompt")));
          return;
        }
        s.jobs.push_back(Job{std::move(job), s.model->new_state(), 0});
        schedule_work(self);
        report_load(self, false);
      },
      [self](work_atom) {
        auto& s = self->state;
        s.work_pending = false;
        if (s.jobs.empty()) return;
        Job& job = s.jobs.front();
        const auto& prompt = job.job.request.prompt;
        const int64_t target = static_cast<int64_t>(prompt.size()) - 1;  // N−1: the decode worker feeds the last
        if (job.position < target) {
          const int64_t n = std::min(s.config.chunk_tokens, target - job.position);
          std::vector<std::vector<float>> logits;
          engine::SequenceInput input{
              &job.state,
              std::span<const int32_t>(prompt).subspan(static_cast<size_t>(job.position), static_cast<size_t>(n)),
              false};
          Status status = s.model->forward({&input, 1}, logits);
          ++s.stats.steps;
          if (!status.is_ok()) {
            fail_front(self, status.with_context("prefill"));
          } else {
            job.position += n;
          }
        }
        if (!s.jobs.empty() && s.jobs.front().position >= target) hand_off(self);
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
          self->send(caf::actor_cast<sink_actor>(it->job.sink), chunk_atom::value, std::move(chunk));
          s.jobs.erase(it);
          report_load(self, false);
          return;
        }
      },
      [self](drain_atom) {
        auto& s = self->state;
        if (s.registry && !s.draining) self->send(s.registry, leave_atom::value, s.config.name);
        s.draining = true;
      },
      [self](stats_atom) -> WorkerStats {
        WorkerStats out = self->state.stats;
        out.queued = static_cast<int64_t>(self->state.jobs.size());
        out.active = self->state.jobs.empty() ? 0 : 1;
        return out;
      },
      [self](tick_atom) {
        auto& s = self->state;
        if (s.draining) return;
        report_load(self, true);
        self->delayed_send(self, s.config.heartbeat_interval, tick_atom::value);
      },
  };
}

}  // namespace

prefill_actor spawn_prefill_worker(caf::actor_system& system, std::shared_ptr<const engine::Model> model,
                                   registry_actor registry, PrefillWorkerConfig config,
                                   std::shared_ptr<Transport> transport) {
  return system.spawn(prefill_impl, std::move(model), std::move(registry), std::move(config), std::move(transport));
}

}  // namespace deltaserve::actors
