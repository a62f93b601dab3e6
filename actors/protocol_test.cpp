// Message-by-message tests of the actor protocols on CAF 0.17's deterministic test coordinator
// (no threads: the test decides which actor runs next).
#define CAF_SUITE actors_protocol
#define FAIL(msg) CAF_FAIL(msg)  // dsl.hpp uses the short name
#include <memory>
#include <vector>

#include <caf/binary_deserializer.hpp>
#include <caf/binary_serializer.hpp>
#include <caf/test/dsl.hpp>
#include <caf/test/unit_test_impl.hpp>

#include "actors/cluster_service_impl.hpp"
#include "actors/decode_worker.hpp"
#include "actors/prefill_worker.hpp"
#include "actors/registry_actor.hpp"
#include "actors/router_actor.hpp"
#include "actors/test_model.hpp"
#include "engine/state_codec.hpp"
#include "kvstore/index/prefix_index.hpp"

using namespace deltaserve;
using namespace deltaserve::actors;

namespace {

using Chunks = std::vector<router::GenerationChunk>;

// A sink that records every chunk into a vector the test owns (and keeps running after a final chunk,
// so the tests can prove nothing follows it).
caf::behavior recording_sink(caf::event_based_actor*, std::shared_ptr<Chunks> out) {
  return {[out](chunk_atom, int64_t, router::GenerationChunk& chunk) { out->push_back(std::move(chunk)); },
          [](attempt_atom, int64_t, int64_t) {}};
}

// What a client receives through the real per-request sink actor (spawn_stream_sink).
class ClientStream final : public router::GenerationSink {
 public:
  explicit ClientStream(std::shared_ptr<Chunks> out) : out_(std::move(out)) {}
  void on_chunk(router::GenerationChunk chunk) override { out_->push_back(std::move(chunk)); }

 private:
  std::shared_ptr<Chunks> out_;
};

// Stands in for a prefill worker: records the jobs it gets.
caf::behavior fake_prefill(caf::event_based_actor*, std::shared_ptr<std::vector<PrefillJob>> jobs,
                           std::shared_ptr<std::vector<std::string>> cancels) {
  return {[jobs](prefill_atom, PrefillJob& job) { jobs->push_back(std::move(job)); },
          [cancels](cancel_atom, std::string& id) { cancels->push_back(std::move(id)); }};
}

// The unused argument avoids CAF 0.17's no-argument spawn path (UB on a null shared_ptr<tuple<>>).
caf::behavior idle_worker(caf::event_based_actor*, int /*unused*/) {
  return {[](cancel_atom, std::string&) {}};
}

// Records registry notifications.
struct SubscriberLog {
  std::vector<std::vector<WorkerInfo>> lists;
  std::vector<std::string> lost;
};
caf::behavior recording_subscriber(caf::event_based_actor*, std::shared_ptr<SubscriberLog> log) {
  return {[log](workers_atom, std::vector<WorkerInfo>& list) { log->lists.push_back(std::move(list)); },
          [log](lost_atom, std::string& name) { log->lost.push_back(std::move(name)); }};
}

// A handoff as a prefill worker would build it: prompt[0, N−1) prefilled, prompt[N−1] to feed.
Handoff make_handoff(const engine::Model& model, const router::GenerationRequest& request, caf::actor sink) {
  engine::RequestState state = model.new_state();
  if (request.prompt.size() > 1) {
    auto r = model.prefill(state, std::span<const int32_t>(request.prompt).first(request.prompt.size() - 1), 4);
    CAF_REQUIRE(r.is_ok());
  }
  const std::vector<std::byte> bytes = engine::encode_state(model.config(), state);
  Handoff h;
  h.envelope.handoff_id = 1;
  h.envelope.request = request;
  h.envelope.next_token = request.prompt.back();
  h.envelope.sink = std::move(sink);
  h.state.resize(bytes.size());
  std::memcpy(h.state.data(), bytes.data(), bytes.size());
  return h;
}

// The CAF transport with faults: the first `corrupt` handoffs get one flipped payload byte.
class FaultyTransport final : public Transport {
 public:
  explicit FaultyTransport(int corrupt) : corrupt_(corrupt) {}
  Status send_state(const caf::actor& decode_worker, HandoffEnvelope envelope, std::vector<uint8_t> state) override {
    if (corrupt_ > 0 && !state.empty()) {
      --corrupt_;
      state[state.size() / 2] ^= 0x5a;
    }
    return inner_->send_state(decode_worker, std::move(envelope), std::move(state));
  }

 private:
  int corrupt_;
  std::shared_ptr<Transport> inner_ = make_caf_transport();
};

// A prefix index in memory that answers every lookup with `matches` and records the hashes it was asked.
class FakeIndex final : public kvstore::PrefixIndex {
 public:
  std::vector<kvstore::WorkerPrefixMatch> matches;
  mutable std::vector<std::vector<kvstore::BlockHash>> lookups;

  Status apply(const kvstore::CacheEventBatch&) override { return Status::ok(); }
  Result<std::vector<kvstore::WorkerPrefixMatch>> lookup(std::span<const kvstore::BlockHash> hashes,
                                                         std::string_view) const override {
    lookups.emplace_back(hashes.begin(), hashes.end());
    return matches;
  }
  Status drop_worker(std::string_view) override { return Status::ok(); }
  Result<int64_t> reconcile(std::span<const std::pair<std::string, uint64_t>>) override { return int64_t{0}; }
  Result<std::vector<std::pair<std::string, uint64_t>>> workers() const override {
    return std::vector<std::pair<std::string, uint64_t>>{};
  }
  kvstore::PrefixIndexStats stats() const override { return {}; }
};

std::vector<int32_t> streamed_tokens(const Chunks& chunks) {
  std::vector<int32_t> tokens;
  for (const auto& c : chunks) tokens.insert(tokens.end(), c.tokens.begin(), c.tokens.end());
  return tokens;
}

// The fixture's run() fires every pending timer at once, also a queue deadline (RouterConfig::queue_timeout)
// of a request that waits only for the test's next step: tests that do not test the deadline turn it off.
RouterConfig no_queue_deadline(RouterConfig config = {}) {
  config.queue_timeout = std::chrono::milliseconds(0);
  return config;
}

// One message per scheduling of an actor, so a self-sent step does not run the whole generation at once.
struct OneMessageConfig : caf::actor_system_config {
  OneMessageConfig() { set("scheduler.max-throughput", size_t{1}); }
};

struct fixture : test_coordinator_fixture<OneMessageConfig> {
  std::vector<caf::actor> to_kill;

  template <class Handle>
  void kill_at_end(const Handle& h) {
    to_kill.push_back(caf::actor_cast<caf::actor>(h));
  }

  ~fixture() override {
    for (auto& a : to_kill) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    run();
  }
};

}  // namespace

CAF_TEST_FIXTURE_SCOPE(actors_protocol_tests, fixture)

CAF_TEST(router_admission_queue_bound) {
  auto gauges = std::make_shared<RouterGauges>();
  auto router = spawn_router(sys, no_queue_deadline(RouterConfig{1}), registry_actor{}, gauges);
  kill_at_end(router);
  std::vector<std::shared_ptr<Chunks>> sinks_out;
  std::vector<caf::actor> sinks;
  for (int i = 0; i < 5; ++i) {
    sinks_out.push_back(std::make_shared<Chunks>());
    sinks.push_back(sys.spawn(recording_sink, sinks_out.back()));
    kill_at_end(sinks.back());
  }
  // No workers yet: r0 waits (queue 1/1), r1 is over the bound and fails at once.
  self->send(router, submit_atom::value, testing::greedy_request("r0", {1, 2, 3}, 4), sinks[0]);
  self->send(router, submit_atom::value, testing::greedy_request("r1", {1, 2, 3}, 4), sinks[1]);
  run();
  CAF_CHECK(sinks_out[0]->empty());
  CAF_REQUIRE_EQUAL(sinks_out[1]->size(), 1u);
  CAF_CHECK(sinks_out[1]->at(0).error.code() == StatusCode::kResourceExhausted);
  CAF_CHECK_EQUAL(gauges->waiting.load(), 1);

  // A prefill worker and a decode worker with one slot join: r0 is dispatched with that decode worker.
  auto jobs = std::make_shared<std::vector<PrefillJob>>();
  auto cancels = std::make_shared<std::vector<std::string>>();
  auto prefill = sys.spawn(fake_prefill, jobs, cancels);
  auto decode = sys.spawn(idle_worker, 0);
  kill_at_end(prefill);
  kill_at_end(decode);
  std::vector<WorkerInfo> workers{{"decode-0", kDecodeRole, decode, 1, {}},
                                  {"prefill-0", kPrefillRole, prefill, 4, {}}};
  self->send(router, workers_atom::value, workers);
  run();
  CAF_REQUIRE_EQUAL(jobs->size(), 1u);
  CAF_CHECK_EQUAL(jobs->at(0).request.request_id, "r0");
  CAF_CHECK(jobs->at(0).decode_worker == decode);
  CAF_CHECK_EQUAL(gauges->waiting.load(), 0);
  CAF_CHECK_EQUAL(gauges->running.load(), 1);

  // The only slot is taken: r2 waits, r3 is rejected; cancelling r2 aborts it from the queue.
  self->send(router, submit_atom::value, testing::greedy_request("r2", {5}, 4), sinks[2]);
  self->send(router, submit_atom::value, testing::greedy_request("r3", {5}, 4), sinks[3]);
  run();
  CAF_CHECK(sinks_out[2]->empty());
  CAF_REQUIRE_EQUAL(sinks_out[3]->size(), 1u);
  CAF_CHECK(sinks_out[3]->at(0).error.code() == StatusCode::kResourceExhausted);
  self->send(router, cancel_atom::value, std::string("r2"));
  run();
  CAF_REQUIRE_EQUAL(sinks_out[2]->size(), 1u);
  CAF_CHECK_EQUAL(sinks_out[2]->at(0).finish_reason.value_or(""), "abort");

  // Cancelling a dispatched request goes to its workers.
  self->send(router, cancel_atom::value, std::string("r0"));
  run();
  CAF_REQUIRE_EQUAL(cancels->size(), 1u);
  CAF_CHECK_EQUAL(cancels->at(0), "r0");

  // r0's sink finishing frees the decode slot: r4 is dispatched.
  caf::anon_send_exit(sinks[0], caf::exit_reason::kill);  // the sink goes down (as after its final chunk)
  self->send(router, submit_atom::value, testing::greedy_request("r4", {6, 7}, 4), sinks[4]);
  run();
  CAF_REQUIRE_EQUAL(jobs->size(), 2u);
  CAF_CHECK_EQUAL(jobs->at(1).request.request_id, "r4");
  auto stats = request<RouterStats>(router, stats_atom::value);
  CAF_CHECK_EQUAL(stats.rejected, 2);
  CAF_CHECK_EQUAL(stats.running, 1);
}

// A request that waits in the queue longer than queue_timeout ends with kUnavailable (HTTP 503); one
// dispatched before its deadline is not touched by it. Virtual time, messages only (sched.run), as run()
// would fire every timer at once.
CAF_TEST(router_queue_timeout_fails_requests_that_waited_too_long) {
  auto gauges = std::make_shared<RouterGauges>();
  RouterConfig config;
  config.queue_timeout = std::chrono::milliseconds(1000);
  auto router = spawn_router(sys, config, registry_actor{}, gauges);
  kill_at_end(router);
  std::vector<std::shared_ptr<Chunks>> out;
  std::vector<caf::actor> sinks;
  for (int i = 0; i < 2; ++i) {
    out.push_back(std::make_shared<Chunks>());
    sinks.push_back(sys.spawn(recording_sink, out.back()));
    kill_at_end(sinks.back());
  }
  self->send(router, submit_atom::value, testing::greedy_request("r0", {1, 2, 3}, 4), sinks[0]);
  sched.run();
  sched.advance_time(std::chrono::milliseconds(600));
  sched.run();
  self->send(router, submit_atom::value, testing::greedy_request("r1", {4, 5}, 4), sinks[1]);
  sched.run();
  sched.advance_time(std::chrono::milliseconds(399));  // r0 has waited 999 ms
  sched.run();
  CAF_CHECK(out[0]->empty());
  CAF_CHECK_EQUAL(gauges->waiting.load(), 2);
  sched.advance_time(std::chrono::milliseconds(1));  // 1000 ms
  sched.run();
  CAF_REQUIRE_EQUAL(out[0]->size(), 1u);
  CAF_CHECK(out[0]->at(0).error.code() == StatusCode::kUnavailable);
  CAF_CHECK_EQUAL(out[0]->at(0).prompt_tokens, 3);
  CAF_CHECK(out[1]->empty());
  CAF_CHECK_EQUAL(gauges->waiting.load(), 1);

  // Workers join: r1 is dispatched before its deadline, which then passes without effect.
  auto jobs = std::make_shared<std::vector<PrefillJob>>();
  auto cancels = std::make_shared<std::vector<std::string>>();
  auto prefill = sys.spawn(fake_prefill, jobs, cancels);
  auto decode = sys.spawn(idle_worker, 0);
  kill_at_end(prefill);
  kill_at_end(decode);
  self->send(
      router, workers_atom::value,
      std::vector<WorkerInfo>{{"decode-0", kDecodeRole, decode, 1, {}}, {"prefill-0", kPrefillRole, prefill, 4, {}}});
  sched.run();
  CAF_REQUIRE_EQUAL(jobs->size(), 1u);
  CAF_CHECK_EQUAL(jobs->at(0).request.request_id, "r1");
  sched.advance_time(std::chrono::milliseconds(5000));
  sched.run();
  CAF_CHECK(out[1]->empty());
  auto stats = request<RouterStats>(router, stats_atom::value);
  CAF_CHECK_EQUAL(stats.failed, 1);
  CAF_CHECK_EQUAL(stats.running, 1);
}

// The waiting queue dispatches by priority class, then arrival: with one decode slot and a full queue, the
// high-priority request that came last runs first, then normal, then the low ones in their order.
CAF_TEST(router_dispatches_higher_priority_first) {
  RouterConfig config = no_queue_deadline();
  config.max_queue = 4;
  auto router = spawn_router(sys, config, registry_actor{}, nullptr);
  kill_at_end(router);
  const std::vector<std::pair<std::string, router::Priority>> arrivals = {{"low-0", router::Priority::kLow},
                                                                          {"normal-0", router::Priority::kNormal},
                                                                          {"low-1", router::Priority::kLow},
                                                                          {"high-0", router::Priority::kHigh}};
  std::vector<caf::actor> sinks;
  for (const auto& [id, priority] : arrivals) {
    sinks.push_back(sys.spawn(recording_sink, std::make_shared<Chunks>()));
    kill_at_end(sinks.back());
    router::GenerationRequest r = testing::greedy_request(id, {1, 2}, 4);
    r.priority = priority;
    self->send(router, submit_atom::value, std::move(r), sinks.back());
  }
  run();
  auto jobs = std::make_shared<std::vector<PrefillJob>>();
  auto cancels = std::make_shared<std::vector<std::string>>();
  auto prefill = sys.spawn(fake_prefill, jobs, cancels);
  auto decode = sys.spawn(idle_worker, 0);
  kill_at_end(prefill);
  kill_at_end(decode);
  self->send(
      router, workers_atom::value,
      std::vector<WorkerInfo>{{"decode-0", kDecodeRole, decode, 1, {}}, {"prefill-0", kPrefillRole, prefill, 4, {}}});
  run();
  const std::vector<std::string> expected = {"high-0", "normal-0", "low-0", "low-1"};
  for (size_t i = 0; i < expected.size(); ++i) {
    CAF_REQUIRE_EQUAL(jobs->size(), i + 1);
    CAF_CHECK_EQUAL(jobs->back().request.request_id, expected[i]);
    size_t at = 0;
    while (arrivals[at].first != expected[i]) ++at;
    CAF_CHECK(jobs->back().request.priority == arrivals[at].second);  // the class travels with the job
    caf::anon_send_exit(sinks[at], caf::exit_reason::kill);           // frees the only decode slot
    run();
  }
}

// The router hashes a prompt once, for its index lookup, and the hashes travel in the prefill job (rooted in the
// request's namespace and the prefill workers' model id, under the router's key and block size); a router
// without an index sends none. The placement follows the index's live-epoch match.
CAF_TEST(router_sends_its_prompt_hashes_with_the_job) {
  kvstore::SipKey key{};
  key[0] = 7;
  auto index = std::make_shared<FakeIndex>();
  index->matches = {{"prefill-b", 3, 2, 2}, {"prefill-a", 1, 2, 2}};  // prefill-a's entry is of an older epoch
  RouterConfig config;
  config.index = index;
  config.hash_key = key;
  config.block_tokens = 4;
  auto router = spawn_router(sys, no_queue_deadline(config), registry_actor{}, nullptr);
  auto plain = spawn_router(sys, no_queue_deadline(), registry_actor{}, nullptr);
  auto jobs = std::make_shared<std::vector<PrefillJob>>();
  auto cancels = std::make_shared<std::vector<std::string>>();
  auto prefill_a = sys.spawn(fake_prefill, jobs, cancels);
  auto prefill_b = sys.spawn(fake_prefill, jobs, cancels);
  auto decode = sys.spawn(idle_worker, 0);
  auto out = std::make_shared<Chunks>();
  auto sink = sys.spawn(recording_sink, out);
  auto sink_plain = sys.spawn(recording_sink, out);
  for (const caf::actor& a : {caf::actor_cast<caf::actor>(router), caf::actor_cast<caf::actor>(plain), prefill_a,
                              prefill_b, decode, sink, sink_plain}) {
    kill_at_end(a);
  }
  const std::vector<WorkerInfo> workers{{"decode-0", kDecodeRole, decode, 4, {}, 0, ""},
                                        {"prefill-a", kPrefillRole, prefill_a, 4, {}, 2, "model-x"},
                                        {"prefill-b", kPrefillRole, prefill_b, 4, {}, 3, "model-x"}};
  self->send(router, workers_atom::value, workers);
  self->send(plain, workers_atom::value, workers);
  auto req = testing::greedy_request("r", {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, 4);  // prompt[0, 9): 2 full blocks
  req.tenant = "acme";
  self->send(router, submit_atom::value, req, sink);
  run();
  CAF_REQUIRE_EQUAL(jobs->size(), 1u);
  const kvstore::BlockHasher hasher(key, 4);
  const kvstore::BlockHash root = hasher.root("acme", "model-x");
  const auto expected = hasher.hash_prompt(root, std::span<const int32_t>(req.prompt).first(8));
  CAF_REQUIRE_EQUAL(expected.size(), 2u);
  CAF_CHECK(jobs->at(0).prompt_hashes.root == root);
  CAF_CHECK(jobs->at(0).prompt_hashes.blocks == expected);
  CAF_REQUIRE_EQUAL(index->lookups.size(), 1u);
  CAF_CHECK(index->lookups[0] == expected);
  const auto stats = request<RouterStats>(router, stats_atom::value);
  CAF_CHECK_EQUAL(stats.routed_to_hit, 1);  // prefill-b: its 2 blocks (8 tokens) are cached
  CAF_CHECK_EQUAL(stats.expected_cached_tokens, 8);

  req.request_id = "r-plain";
  self->send(plain, submit_atom::value, req, sink_plain);
  run();
  CAF_REQUIRE_EQUAL(jobs->size(), 2u);
  CAF_CHECK(jobs->at(1).prompt_hashes.blocks.empty());
}

// PrefillJob's prompt hashes (and a CacheEvent's hash, which travels the same way) survive CAF serialization.
CAF_TEST(prompt_hashes_travel_on_the_wire) {
  kvstore::PromptHashes hashes;
  for (uint8_t i = 0; i < 16; ++i) hashes.root.bytes[i] = static_cast<uint8_t>(i * 17 + 1);
  for (uint8_t b = 0; b < 3; ++b) {
    kvstore::BlockHash h;
    for (uint8_t i = 0; i < 16; ++i) h.bytes[i] = static_cast<uint8_t>(255 - i - 40 * b);
    hashes.blocks.push_back(h);
  }
  PrefillJob job;
  job.request = testing::greedy_request("w", {1, 2, 3}, 2);
  job.request.priority = router::Priority::kHigh;
  job.attempt = 2;
  job.prompt_hashes = hashes;
  kvstore::CacheEvent event;
  event.hash = hashes.blocks[1];
  event.block_index = 2;
  std::vector<char> buffer;
  caf::binary_serializer sink(sys, buffer);
  CAF_REQUIRE(!sink(job, event));
  PrefillJob loaded;
  kvstore::CacheEvent loaded_event;
  caf::binary_deserializer source(sys, buffer);
  CAF_REQUIRE(!source(loaded, loaded_event));
  CAF_CHECK(loaded.prompt_hashes.root == hashes.root);
  CAF_CHECK(loaded.prompt_hashes.blocks == hashes.blocks);
  CAF_CHECK_EQUAL(loaded.attempt, 2);
  CAF_CHECK_EQUAL(loaded.request.request_id, "w");
  CAF_CHECK(loaded.request.priority == router::Priority::kHigh);
  CAF_CHECK(loaded_event.hash == hashes.blocks[1]);
  CAF_CHECK_EQUAL(loaded_event.block_index, 2);
}

CAF_TEST(registry_join_leave_down) {
  auto registry = spawn_registry(sys);
  kill_at_end(registry);
  auto log = std::make_shared<SubscriberLog>();
  auto subscriber = sys.spawn(recording_subscriber, log);
  kill_at_end(subscriber);
  self->send(registry, subscribe_atom::value, subscriber);
  run();
  CAF_REQUIRE_EQUAL(log->lists.size(), 1u);
  CAF_CHECK(log->lists.back().empty());

  auto w1 = sys.spawn(idle_worker, 0);
  auto w2 = sys.spawn(idle_worker, 0);
  kill_at_end(w1);
  CAF_CHECK_EQUAL(request<uint64_t>(registry, join_atom::value, WorkerInfo{"w2", kDecodeRole, w2, 8, {}}), 1u);
  CAF_CHECK_EQUAL(request<uint64_t>(registry, join_atom::value, WorkerInfo{"w1", kPrefillRole, w1, 4, {}}), 2u);
  auto list = request<std::vector<WorkerInfo>>(registry, list_atom::value);
  CAF_REQUIRE_EQUAL(list.size(), 2u);
  CAF_CHECK_EQUAL(list[0].name, "w1");  // sorted by name
  CAF_CHECK_EQUAL(list[1].name, "w2");

  WorkerLoad load;
  load.free_slots = 3;
  self->send(registry, heartbeat_atom::value, std::string("w2"), load);
  run();
  CAF_CHECK_EQUAL(log->lists.back().at(1).load.free_slots, 3);

  self->send(registry, leave_atom::value, std::string("w1"));
  run();
  CAF_CHECK_EQUAL(log->lists.back().size(), 1u);
  CAF_CHECK(log->lost.empty());  // leaving is not losing

  // w2 dies without leaving: removed, and subscribers learn it was lost.
  caf::anon_send_exit(w2, caf::exit_reason::kill);
  run();
  CAF_REQUIRE_EQUAL(log->lost.size(), 1u);
  CAF_CHECK_EQUAL(log->lost[0], "w2");
  CAF_CHECK(request<std::vector<WorkerInfo>>(registry, list_atom::value).empty());
}

CAF_TEST(registry_expires_workers_that_stop_reporting) {
  // A worker that vanished without its connection being reported: no down message, no leave; only
  // its heartbeats stop. Virtual time: the test clock moves only when told to, and only messages are
  // run here (sched.run), since the fixture's run() would keep firing the registry's periodic tick.
  auto registry = spawn_registry(sys, std::chrono::milliseconds(1000));
  kill_at_end(registry);
  auto log = std::make_shared<SubscriberLog>();
  auto subscriber = sys.spawn(recording_subscriber, log);
  kill_at_end(subscriber);
  self->send(registry, subscribe_atom::value, subscriber);
  sched.run();
  auto w = sys.spawn(idle_worker, 0);
  kill_at_end(w);
  self->send(registry, join_atom::value, WorkerInfo{"w", kDecodeRole, w, 8, {}});
  sched.run();
  CAF_REQUIRE_EQUAL(log->lists.back().size(), 1u);

  sched.advance_time(std::chrono::milliseconds(600));
  sched.run();
  self->send(registry, heartbeat_atom::value, std::string("w"), WorkerLoad{});
  sched.run();
  sched.advance_time(std::chrono::milliseconds(600));  // 1200 ms after joining, 600 after the heartbeat
  sched.run();
  CAF_CHECK(log->lost.empty());
  CAF_CHECK_EQUAL(log->lists.back().size(), 1u);

  sched.advance_time(std::chrono::milliseconds(1200));  // 1800 ms without a report
  sched.run();
  CAF_REQUIRE_EQUAL(log->lost.size(), 1u);
  CAF_CHECK_EQUAL(log->lost[0], "w");
  CAF_CHECK(log->lists.back().empty());

  // It was only stalled: its next heartbeat registers it again (same handle); a name that never joined
  // stays unknown.
  self->send(registry, heartbeat_atom::value, std::string("w"), WorkerLoad{3, 2, 0, 1});
  self->send(registry, heartbeat_atom::value, std::string("stranger"), WorkerLoad{});
  sched.run();
  CAF_REQUIRE_EQUAL(log->lists.back().size(), 1u);
  CAF_CHECK_EQUAL(log->lists.back()[0].name, "w");
  CAF_CHECK(log->lists.back()[0].handle == w);
  CAF_CHECK_EQUAL(log->lists.back()[0].load.queue_length, 3);
  CAF_CHECK_EQUAL(log->lost.size(), 1u);
}

CAF_TEST(decode_step_loop_join_and_cancel_between_steps) {
  std::string error;
  const auto& tiny = testing::tiny_model(&error);
  CAF_REQUIRE(tiny.model != nullptr);
  DecodeWorkerConfig config{"decode-0", 4, std::chrono::milliseconds(0), /*self_step=*/false};
  auto decode = spawn_decode_worker(sys, tiny.model, tiny.tokenizer, registry_actor{}, config);
  kill_at_end(decode);
  auto out_a = std::make_shared<Chunks>(), out_b = std::make_shared<Chunks>();
  auto sink_a = sys.spawn(recording_sink, out_a), sink_b = sys.spawn(recording_sink, out_b);
  kill_at_end(sink_a);
  kill_at_end(sink_b);
  const auto req_a = testing::greedy_request("a", {11, 12, 13, 14, 15}, 50);
  const auto req_b = testing::greedy_request("b", {21, 22, 23}, 6);

  // Steps run only when the test sends step(), so the order of events is exact.
  auto step = [&] {
    self->send(decode, step_atom::value);
    run();
  };
  // A joins and decodes two steps alone.
  self->send(decode, handoff_atom::value, make_handoff(*tiny.model, req_a, sink_a));
  run();
  step();
  step();
  CAF_CHECK_EQUAL(out_a->size(), 2u);
  // B joins between steps; both advance together.
  self->send(decode, handoff_atom::value, make_handoff(*tiny.model, req_b, sink_b));
  run();
  step();
  step();
  CAF_CHECK_EQUAL(out_a->size(), 4u);
  CAF_CHECK_EQUAL(out_b->size(), 2u);
  CAF_CHECK(!out_a->back().is_final());
  // A is cancelled between steps: one "abort" chunk, then nothing more for A; B runs to max_tokens.
  self->send(decode, cancel_atom::value, std::string("a"));
  run();
  CAF_REQUIRE_EQUAL(out_a->size(), 5u);
  CAF_CHECK_EQUAL(out_a->back().finish_reason.value_or(""), "abort");
  CAF_CHECK(out_a->back().tokens.empty());
  for (int i = 0; i < 10; ++i) step();  // more steps than B needs: extra steps are no-ops
  CAF_CHECK_EQUAL(out_a->size(), 5u);
  CAF_REQUIRE_EQUAL(out_b->size(), 6u);
  CAF_CHECK_EQUAL(out_b->back().finish_reason.value_or(""), "length");
  CAF_CHECK_EQUAL(out_b->back().completion_tokens, 6);
  CAF_CHECK_EQUAL(out_b->back().prompt_tokens, 3);
  std::vector<int32_t> tokens_b;
  for (const auto& c : *out_b) tokens_b.insert(tokens_b.end(), c.tokens.begin(), c.tokens.end());
  CAF_CHECK(tokens_b == testing::reference_greedy(*tiny.model, req_b.prompt, 6, 4));
  auto stats = request<WorkerStats>(decode, stats_atom::value);
  CAF_CHECK_EQUAL(stats.active, 0);
  CAF_CHECK_EQUAL(stats.free_slots, 4);
  CAF_CHECK_EQUAL(stats.handoffs, 2);
}

CAF_TEST(corrupted_handoff_is_rejected) {
  std::string error;
  const auto& tiny = testing::tiny_model(&error);
  CAF_REQUIRE(tiny.model != nullptr);
  auto decode = spawn_decode_worker(sys, tiny.model, tiny.tokenizer, registry_actor{},
                                    DecodeWorkerConfig{"decode-0", 2, std::chrono::milliseconds(0)});
  kill_at_end(decode);
  auto out = std::make_shared<Chunks>();
  auto sink = sys.spawn(recording_sink, out);
  kill_at_end(sink);
  Handoff h = make_handoff(*tiny.model, testing::greedy_request("c", {3, 4, 5, 6}, 4), sink);
  h.state[h.state.size() / 2] ^= 0x5a;  // one flipped byte in the payload
  self->send(decode, handoff_atom::value, h);
  Handoff truncated = make_handoff(*tiny.model, testing::greedy_request("d", {3, 4, 5, 6}, 4), sink);
  truncated.state.resize(truncated.state.size() / 3);
  self->send(decode, handoff_atom::value, truncated);
  run();
  CAF_REQUIRE_EQUAL(out->size(), 2u);
  CAF_CHECK(out->at(0).error.code() == StatusCode::kDataLoss);
  CAF_CHECK(out->at(1).error.code() == StatusCode::kDataLoss);
  auto stats = request<WorkerStats>(decode, stats_atom::value);
  CAF_CHECK_EQUAL(stats.rejected, 2);
  CAF_CHECK_EQUAL(stats.steps, 0);
  CAF_CHECK_EQUAL(stats.free_slots, 2);
}

CAF_TEST(prefill_chunks_then_hands_off) {
  std::string error;
  const auto& tiny = testing::tiny_model(&error);
  CAF_REQUIRE(tiny.model != nullptr);
  auto decode = spawn_decode_worker(sys, tiny.model, tiny.tokenizer, registry_actor{},
                                    DecodeWorkerConfig{"decode-0", 2, std::chrono::milliseconds(0)});
  auto prefill = spawn_prefill_worker(sys, tiny.model, registry_actor{},
                                      PrefillWorkerConfig{"prefill-0", 3, std::chrono::milliseconds(0)});
  kill_at_end(decode);
  kill_at_end(prefill);
  auto out = std::make_shared<Chunks>(), out_one = std::make_shared<Chunks>();
  auto sink = sys.spawn(recording_sink, out), sink_one = sys.spawn(recording_sink, out_one);
  kill_at_end(sink);
  kill_at_end(sink_one);
  const auto req = testing::greedy_request("p", {2, 3, 4, 5, 6, 7, 8, 9}, 5);  // 7 prefill tokens = 3 chunks of <= 3
  self->send(prefill, prefill_atom::value, PrefillJob{req, caf::actor_cast<caf::actor>(decode), sink, caf::actor{}});
  const auto one = testing::greedy_request("one", {42}, 3);  // 1-token prompt: empty prefill, fresh state
  self->send(prefill, prefill_atom::value,
             PrefillJob{one, caf::actor_cast<caf::actor>(decode), sink_one, caf::actor{}});
  run();
  auto stats = request<WorkerStats>(prefill, stats_atom::value);
  CAF_CHECK_EQUAL(stats.steps, 3);
  CAF_CHECK_EQUAL(stats.handoffs, 2);
  CAF_CHECK(stats.handoff_bytes > 0);
  std::vector<int32_t> tokens;
  for (const auto& c : *out) tokens.insert(tokens.end(), c.tokens.begin(), c.tokens.end());
  CAF_CHECK(tokens == testing::reference_greedy(*tiny.model, req.prompt, 5, 3));
  std::vector<int32_t> tokens_one;
  for (const auto& c : *out_one) tokens_one.insert(tokens_one.end(), c.tokens.begin(), c.tokens.end());
  CAF_CHECK(tokens_one == testing::reference_greedy(*tiny.model, one.prompt, 3, 3));
}

// A handoff that does not check out at the decode worker is prefilled again; the stream is the same as
// if nothing had happened. When every attempt fails, the client gets one clean error and nothing decoded.
CAF_TEST(corrupt_handoffs_are_prefilled_again_then_given_up) {
  std::string error;
  const auto& tiny = testing::tiny_model(&error);
  CAF_REQUIRE(tiny.model != nullptr);
  for (int corrupt : {2, 5}) {
    auto router = spawn_router(sys, no_queue_deadline(), registry_actor{}, nullptr);
    auto decode = spawn_decode_worker(sys, tiny.model, tiny.tokenizer, registry_actor{},
                                      DecodeWorkerConfig{"decode-0", 2, std::chrono::milliseconds(0)});
    auto prefill = spawn_prefill_worker(sys, tiny.model, registry_actor{},
                                        PrefillWorkerConfig{"prefill-0", 4, std::chrono::milliseconds(0)},
                                        std::make_shared<FaultyTransport>(corrupt));
    auto out = std::make_shared<Chunks>();
    auto sink = sys.spawn(recording_sink, out);
    for (const caf::actor& a : {caf::actor_cast<caf::actor>(router), caf::actor_cast<caf::actor>(decode),
                                caf::actor_cast<caf::actor>(prefill), sink}) {
      kill_at_end(a);
    }
    self->send(router, workers_atom::value,
               std::vector<WorkerInfo>{{"decode-0", kDecodeRole, caf::actor_cast<caf::actor>(decode), 2, {}},
                                       {"prefill-0", kPrefillRole, caf::actor_cast<caf::actor>(prefill), 4, {}}});
    const auto req = testing::greedy_request("r", {5, 6, 7, 8, 9, 10, 11}, 5);
    self->send(router, submit_atom::value, req, sink);
    run();
    const auto router_stats = request<RouterStats>(router, stats_atom::value);
    const auto decode_stats = request<WorkerStats>(decode, stats_atom::value);
    if (corrupt < 3) {  // max_attempts = 3
      CAF_CHECK_EQUAL(router_stats.retried, corrupt);
      CAF_CHECK_EQUAL(decode_stats.rejected, corrupt);
      CAF_REQUIRE(!out->empty());
      CAF_CHECK(out->back().error.is_ok());
      CAF_CHECK(streamed_tokens(*out) == testing::reference_greedy(*tiny.model, req.prompt, 5, 4));
    } else {
      CAF_CHECK_EQUAL(router_stats.retried, 2);
      CAF_CHECK_EQUAL(router_stats.failed, 1);
      CAF_CHECK_EQUAL(decode_stats.rejected, 3);
      CAF_CHECK_EQUAL(decode_stats.steps, 0);
      CAF_REQUIRE_EQUAL(out->size(), 1u);
      CAF_CHECK(out->at(0).error.code() == StatusCode::kDataLoss);
      CAF_CHECK(out->at(0).error.message().find("gave up after 3 attempts") != std::string::npos);
      CAF_CHECK(out->at(0).error.message().find("decode-0") == std::string::npos);  // no worker name for clients
    }
  }
}

// A prefill worker lost before its handoff: the request is prefilled again on another worker, and the
// decode worker is told to drop a stale handoff of the first attempt.
CAF_TEST(request_on_a_lost_prefill_worker_is_prefilled_again) {
  std::string error;
  const auto& tiny = testing::tiny_model(&error);
  CAF_REQUIRE(tiny.model != nullptr);
  auto router = spawn_router(sys, no_queue_deadline(), registry_actor{}, nullptr);
  auto decode = spawn_decode_worker(sys, tiny.model, tiny.tokenizer, registry_actor{},
                                    DecodeWorkerConfig{"decode-0", 2, std::chrono::milliseconds(0)});
  auto jobs = std::make_shared<std::vector<PrefillJob>>();
  auto cancels = std::make_shared<std::vector<std::string>>();
  auto silent = sys.spawn(fake_prefill, jobs, cancels);  // takes the job and never hands off
  auto prefill = spawn_prefill_worker(sys, tiny.model, registry_actor{},
                                      PrefillWorkerConfig{"prefill-b", 4, std::chrono::milliseconds(0)});
  auto out = std::make_shared<Chunks>();
  auto sink = sys.spawn(recording_sink, out);
  for (const caf::actor& a : {caf::actor_cast<caf::actor>(router), caf::actor_cast<caf::actor>(decode), silent,
                              caf::actor_cast<caf::actor>(prefill), sink}) {
    kill_at_end(a);
  }
  self->send(router, workers_atom::value,
             std::vector<WorkerInfo>{{"decode-0", kDecodeRole, caf::actor_cast<caf::actor>(decode), 2, {}},
                                     {"prefill-a", kPrefillRole, silent, 4, {}},
                                     {"prefill-b", kPrefillRole, caf::actor_cast<caf::actor>(prefill), 4, {}}});
  const auto req = testing::greedy_request("r", {9, 8, 7, 6, 5}, 4);
  self->send(router, submit_atom::value, req, sink);
  run();
  CAF_REQUIRE_EQUAL(jobs->size(), 1u);  // placed on prefill-a (ties break by name)
  CAF_CHECK(out->empty());
  // A stale handoff of attempt 1 (as if prefill-a had sent it just before dying) must not be decoded.
  auto stale = make_handoff(*tiny.model, req, sink);
  stale.envelope.attempt = 1;
  self->send(router, lost_atom::value, std::string("prefill-a"));
  run();
  self->send(decode, handoff_atom::value, stale);
  run();
  const auto router_stats = request<RouterStats>(router, stats_atom::value);
  CAF_CHECK_EQUAL(router_stats.retried, 1);
  CAF_CHECK_EQUAL(router_stats.failed, 0);
  CAF_REQUIRE(!out->empty());
  CAF_CHECK(out->back().error.is_ok());
  CAF_CHECK(streamed_tokens(*out) == testing::reference_greedy(*tiny.model, req.prompt, 4, 4));
  CAF_CHECK_EQUAL(request<WorkerStats>(decode, stats_atom::value).handoffs, 1);
}

// Prefilled but never admitted: prefill-a reports the handoff as left (a UCX sender does so before its reserve
// reaches the decode worker) and dies before the decode worker heard of the request. Nobody else can fail it, so
// the lost prefill worker's request must be prefilled again (issue 33's chaos test found it stuck forever); a stale
// handoff of attempt 1 arriving late is not decoded.
CAF_TEST(request_in_transfer_when_its_prefill_worker_is_lost_is_prefilled_again) {
  std::string error;
  const auto& tiny = testing::tiny_model(&error);
  CAF_REQUIRE(tiny.model != nullptr);
  auto router = spawn_router(sys, no_queue_deadline(), registry_actor{}, nullptr);
  auto decode = spawn_decode_worker(sys, tiny.model, tiny.tokenizer, registry_actor{},
                                    DecodeWorkerConfig{"decode-0", 2, std::chrono::milliseconds(0)});
  auto jobs = std::make_shared<std::vector<PrefillJob>>();
  auto cancels = std::make_shared<std::vector<std::string>>();
  auto silent = sys.spawn(fake_prefill, jobs, cancels);  // takes the job; the test reports it prefilled
  auto prefill = spawn_prefill_worker(sys, tiny.model, registry_actor{},
                                      PrefillWorkerConfig{"prefill-b", 4, std::chrono::milliseconds(0)});
  auto out = std::make_shared<Chunks>();
  auto sink = sys.spawn(recording_sink, out);
  for (const caf::actor& a : {caf::actor_cast<caf::actor>(router), caf::actor_cast<caf::actor>(decode), silent,
                              caf::actor_cast<caf::actor>(prefill), sink}) {
    kill_at_end(a);
  }
  self->send(router, workers_atom::value,
             std::vector<WorkerInfo>{{"decode-0", kDecodeRole, caf::actor_cast<caf::actor>(decode), 2, {}},
                                     {"prefill-a", kPrefillRole, silent, 4, {}},
                                     {"prefill-b", kPrefillRole, caf::actor_cast<caf::actor>(prefill), 4, {}}});
  const auto req = testing::greedy_request("r", {9, 8, 7, 6, 5}, 4);
  self->send(router, submit_atom::value, req, sink);
  run();
  CAF_REQUIRE_EQUAL(jobs->size(), 1u);  // placed on prefill-a (ties break by name)
  self->send(router, prefilled_atom::value, std::string("r"), int64_t{1}, int64_t{0}, int64_t{0});
  run();
  CAF_CHECK(out->empty());
  self->send(router, lost_atom::value, std::string("prefill-a"));
  run();
  auto stale = make_handoff(*tiny.model, req, sink);
  stale.envelope.attempt = 1;
  self->send(decode, handoff_atom::value, stale);
  run();
  const auto router_stats = request<RouterStats>(router, stats_atom::value);
  CAF_CHECK_EQUAL(router_stats.retried, 1);
  CAF_CHECK_EQUAL(router_stats.failed, 0);
  CAF_REQUIRE(!out->empty());
  CAF_CHECK(out->back().error.is_ok());
  CAF_CHECK(streamed_tokens(*out) == testing::reference_greedy(*tiny.model, req.prompt, 4, 4));
  CAF_CHECK_EQUAL(request<WorkerStats>(decode, stats_atom::value).handoffs, 1);
}

// The retry race: the router declares decode-0 lost while decode-0 streams the request (a stalled process).
// decode-0 reads the router's drop when it comes back and frees the request without a chunk; once it reports
// again, the router's second attempt, resumed after the two tokens the client has, reaches it. The client gets
// exactly the reference stream: no error, no token twice or lost.
CAF_TEST(decode_worker_lost_while_streaming_then_the_resumed_retry_reaches_it) {
  std::string error;
  const auto& tiny = testing::tiny_model(&error);
  CAF_REQUIRE(tiny.model != nullptr);
  auto router = spawn_router(sys, no_queue_deadline(), registry_actor{}, nullptr);
  DecodeWorkerConfig config{"decode-0", 4, std::chrono::milliseconds(0), /*self_step=*/false};
  auto decode = spawn_decode_worker(sys, tiny.model, tiny.tokenizer, registry_actor{}, config);
  auto jobs = std::make_shared<std::vector<PrefillJob>>();
  auto cancels = std::make_shared<std::vector<std::string>>();
  auto silent = sys.spawn(fake_prefill, jobs, cancels);  // attempt 1's prefill: the test hands off for it
  auto prefill = spawn_prefill_worker(sys, tiny.model, registry_actor{},
                                      PrefillWorkerConfig{"prefill-b", 4, std::chrono::milliseconds(0)});
  auto out = std::make_shared<Chunks>();
  auto sink = spawn_stream_sink(sys, std::make_shared<ClientStream>(out), "r", router);
  for (const caf::actor& a : {caf::actor_cast<caf::actor>(router), caf::actor_cast<caf::actor>(decode), silent,
                              caf::actor_cast<caf::actor>(prefill), caf::actor_cast<caf::actor>(sink)}) {
    kill_at_end(a);
  }
  auto step = [&] {
    self->send(decode, step_atom::value);
    run();
  };
  const caf::actor decode_handle = caf::actor_cast<caf::actor>(decode);
  self->send(router, workers_atom::value,
             std::vector<WorkerInfo>{{"decode-0", kDecodeRole, decode_handle, 4, {}},
                                     {"prefill-a", kPrefillRole, silent, 4, {}}});
  const auto req = testing::greedy_request("r", {9, 8, 7, 6, 5}, 6);
  self->send(router, submit_atom::value, req, caf::actor_cast<caf::actor>(sink));
  run();
  CAF_REQUIRE_EQUAL(jobs->size(), 1u);
  CAF_REQUIRE_EQUAL(jobs->at(0).attempt, 1);
  CAF_CHECK(jobs->at(0).generated.empty());

  auto handoff = make_handoff(*tiny.model, req, caf::actor_cast<caf::actor>(sink));
  handoff.envelope.attempt = 1;
  handoff.envelope.router = caf::actor_cast<caf::actor>(router);
  self->send(decode, handoff_atom::value, handoff);
  run();
  step();
  step();
  CAF_REQUIRE_EQUAL(out->size(), 2u);  // the client has two tokens of attempt 1

  // decode-0 stalls; the router declares it lost and has no decode worker left: the request waits.
  self->send(router, lost_atom::value, std::string("decode-0"));
  run();
  const auto dropped = request<WorkerStats>(decode, stats_atom::value);
  CAF_CHECK_EQUAL(dropped.stale_dropped, 1);  // it read the router's drop: attempt 1 is gone, its slot free
  CAF_CHECK_EQUAL(dropped.active, 0);
  CAF_CHECK_EQUAL(dropped.free_slots, 4);
  step();
  CAF_CHECK_EQUAL(out->size(), 2u);  // nothing reached the client: the drop sends no chunk

  // decode-0 reports again (registered anew) and prefill-b is there: attempt 2 resumes after the two tokens.
  self->send(router, workers_atom::value,
             std::vector<WorkerInfo>{{"decode-0", kDecodeRole, decode_handle, 4, {}},
                                     {"prefill-b", kPrefillRole, caf::actor_cast<caf::actor>(prefill), 4, {}}});
  run();
  const auto resumed = request<WorkerStats>(decode, stats_atom::value);
  CAF_CHECK_EQUAL(resumed.handoffs, 2);
  CAF_CHECK_EQUAL(resumed.active, 1);
  for (int i = 0; i < 10; ++i) step();
  CAF_REQUIRE(!out->empty());
  for (const auto& chunk : *out) CAF_CHECK(chunk.error.is_ok());
  CAF_CHECK_EQUAL(out->size(), 6u);
  CAF_CHECK_EQUAL(out->back().finish_reason.value_or(""), "length");
  CAF_CHECK_EQUAL(out->back().completion_tokens, 6);
  CAF_CHECK_EQUAL(out->back().prompt_tokens, 5);
  CAF_CHECK(streamed_tokens(*out) == testing::reference_greedy(*tiny.model, req.prompt, 6, 4));
  const auto router_stats = request<RouterStats>(router, stats_atom::value);
  CAF_CHECK_EQUAL(router_stats.retried, 1);
  CAF_CHECK_EQUAL(router_stats.resumed, 1);
  CAF_CHECK_EQUAL(router_stats.resumed_tokens, 2);
  CAF_CHECK_EQUAL(router_stats.failed, 0);
  CAF_CHECK_EQUAL(request<WorkerStats>(decode, stats_atom::value).active, 0);
}

// ---- Resume after a lost decode worker: the faults are injected at a chosen chunk of the stream ----

namespace {

constexpr int64_t kResumeBlock = 16;  // prefix-cache block: small, so a short prompt has cached blocks

// What one client stream adds up to.
struct StreamSummary {
  std::vector<int32_t> tokens;
  std::string text;
  std::vector<router::TokenLogprobs> logprobs;
  int64_t errors = 0;
  router::GenerationChunk last;
};

StreamSummary summarize(const Chunks& chunks) {
  StreamSummary out;
  for (const auto& c : chunks) {
    out.tokens.insert(out.tokens.end(), c.tokens.begin(), c.tokens.end());
    out.text += c.text;
    out.logprobs.insert(out.logprobs.end(), c.logprobs.begin(), c.logprobs.end());
    if (!c.error.is_ok()) ++out.errors;
  }
  if (!chunks.empty()) out.last = chunks.back();
  return out;
}

// The client saw exactly the uninterrupted stream: every token, its text, logprobs (bit for bit), usage.
void check_same_stream(const StreamSummary& got, const StreamSummary& want) {
  CAF_CHECK_EQUAL(got.errors, 0);
  CAF_CHECK(got.tokens == want.tokens);
  CAF_CHECK_EQUAL(got.text, want.text);
  CAF_REQUIRE_EQUAL(got.logprobs.size(), want.logprobs.size());
  for (size_t i = 0; i < got.logprobs.size(); ++i) {
    CAF_CHECK_EQUAL(got.logprobs[i].token, want.logprobs[i].token);
    CAF_CHECK_EQUAL(got.logprobs[i].logprob, want.logprobs[i].logprob);
    CAF_REQUIRE_EQUAL(got.logprobs[i].top.size(), want.logprobs[i].top.size());
    for (size_t j = 0; j < got.logprobs[i].top.size(); ++j) {
      CAF_CHECK_EQUAL(got.logprobs[i].top[j].token, want.logprobs[i].top[j].token);
      CAF_CHECK_EQUAL(got.logprobs[i].top[j].logprob, want.logprobs[i].top[j].logprob);
    }
  }
  CAF_CHECK(got.last.finish_reason == want.last.finish_reason);
  CAF_CHECK_EQUAL(got.last.prompt_tokens, want.last.prompt_tokens);
  CAF_CHECK_EQUAL(got.last.completion_tokens, want.last.completion_tokens);
}

router::GenerationRequest resume_request(const std::string& id, bool sampled) {
  auto r = testing::greedy_request(id, {}, 12);
  for (int32_t i = 0; i < 40; ++i) r.prompt.push_back(3 + (i * 37) % 200);  // 2 full blocks of prompt[0, N−1)
  r.logprobs = true;
  r.sampling.top_logprobs = 2;
  if (sampled) {
    r.sampling.temperature = 0.9f;
    r.sampling.top_p = 0.95f;
    r.sampling.seed = 2024;
  }
  return r;
}

// How decode-a stops serving the request after its k-th chunk.
enum class DecodeFault {
  kKilled,   // the process is gone
  kStalled,  // declared lost while it still runs: one more step of it is under way, then it reads the drop
};

// A router, one prefill worker with a prefix cache (16-token blocks) and two decode workers that step only when
// the test says (decode-a gets the first attempt: ties break by name).
struct ResumeCluster {
  router_actor router;
  prefill_actor prefill;
  decode_actor decode_a, decode_b;
};

}  // namespace

CAF_TEST(resume_on_another_decode_worker_greedy_and_seeded) {
  std::string error;
  const auto& tiny = testing::tiny_model(&error);
  CAF_REQUIRE(tiny.model != nullptr);
  auto make_cluster = [&] {
    ResumeCluster c;
    c.router = spawn_router(sys, no_queue_deadline(), registry_actor{}, nullptr);
    PrefillWorkerConfig prefill{"prefill-0", 8, std::chrono::milliseconds(0)};
    prefill.prefix_cache.enabled = true;
    prefill.prefix_cache.cache.block_tokens = kResumeBlock;
    prefill.prefix_cache.cache.pages.page_tokens = 1024;
    prefill.prefix_cache.cache.pages.num_pages = 4;
    prefill.prefix_cache.model_id = "tiny";
    prefill.prefix_cache.epoch = 1;
    c.prefill = spawn_prefill_worker(sys, tiny.model, registry_actor{}, prefill);
    c.decode_a = spawn_decode_worker(sys, tiny.model, tiny.tokenizer, registry_actor{},
                                     DecodeWorkerConfig{"decode-a", 4, std::chrono::milliseconds(0), false});
    c.decode_b = spawn_decode_worker(sys, tiny.model, tiny.tokenizer, registry_actor{},
                                     DecodeWorkerConfig{"decode-b", 4, std::chrono::milliseconds(0), false});
    for (const caf::actor& a : {caf::actor_cast<caf::actor>(c.router), caf::actor_cast<caf::actor>(c.prefill),
                                caf::actor_cast<caf::actor>(c.decode_a), caf::actor_cast<caf::actor>(c.decode_b)}) {
      kill_at_end(a);
    }
    self->send(c.router, workers_atom::value,
               std::vector<WorkerInfo>{{"decode-a", kDecodeRole, caf::actor_cast<caf::actor>(c.decode_a), 4, {}},
                                       {"decode-b", kDecodeRole, caf::actor_cast<caf::actor>(c.decode_b), 4, {}},
                                       {"prefill-0", kPrefillRole, caf::actor_cast<caf::actor>(c.prefill), 2, {}}});
    run();
    return c;
  };
  // Submits `request` and steps both decode workers until the stream ends; after `k` chunks reached the client
  // (k < 0: never), decode-a meets `fault`.
  auto stream = [&](ResumeCluster& c, const router::GenerationRequest& request, int64_t k, DecodeFault fault) {
    auto out = std::make_shared<Chunks>();
    auto sink = spawn_stream_sink(sys, std::make_shared<ClientStream>(out), request.request_id, c.router);
    kill_at_end(sink);
    self->send(c.router, submit_atom::value, request, caf::actor_cast<caf::actor>(sink));
    run();
    bool faulted = false;
    for (int i = 0; i < 100 && (out->empty() || !out->back().is_final()); ++i) {
      if (!faulted && k >= 0 && static_cast<int64_t>(out->size()) == k) {
        faulted = true;
        if (fault == DecodeFault::kKilled) {
          caf::anon_send_exit(c.decode_a, caf::exit_reason::kill);
        } else {
          self->send(c.decode_a, step_atom::value);  // enqueued before the router's drop
        }
        self->send(c.router, lost_atom::value, std::string("decode-a"));
        run();
        continue;
      }
      if (!faulted) self->send(c.decode_a, step_atom::value);
      self->send(c.decode_b, step_atom::value);
      run();
    }
    CAF_CHECK(k < 0 || faulted);
    return out;
  };

  for (const bool sampled : {false, true}) {
    CAF_MESSAGE((sampled ? "seeded sampling" : "greedy"));
    // The uninterrupted stream, on a cluster of its own (its prefix cache stays cold).
    ResumeCluster clean = make_cluster();
    const auto want = summarize(*stream(clean, resume_request("clean", sampled), -1, DecodeFault::kKilled));
    CAF_REQUIRE_EQUAL(want.tokens.size(), 12u);
    CAF_CHECK_EQUAL(want.errors, 0);
    if (!sampled)
      CAF_CHECK(want.tokens == testing::reference_greedy(*tiny.model, resume_request("", false).prompt, 12, 8));
    CAF_CHECK_EQUAL(request<WorkerStats>(clean.decode_b, stats_atom::value).handoffs, 0);  // all on decode-a

    // decode-a dies after 5 chunks: the rest comes from decode-b, resumed from the prompt and those 5 tokens.
    ResumeCluster c = make_cluster();
    const auto prefilled_before = request<WorkerStats>(c.prefill, stats_atom::value);
    const auto got = summarize(*stream(c, resume_request("r", sampled), 5, DecodeFault::kKilled));
    check_same_stream(got, want);
    const auto router_stats = request<RouterStats>(c.router, stats_atom::value);
    CAF_CHECK_EQUAL(router_stats.retried, 1);
    CAF_CHECK_EQUAL(router_stats.resumed, 1);
    CAF_CHECK_EQUAL(router_stats.resumed_tokens, 5);
    CAF_CHECK_EQUAL(router_stats.failed, 0);
    CAF_CHECK_EQUAL(router_stats.running, 0);
    const auto b = request<WorkerStats>(c.decode_b, stats_atom::value);
    CAF_CHECK_EQUAL(b.handoffs, 1);
    CAF_CHECK_EQUAL(b.steps, 12 - 5);  // it generated only what the client did not have
    CAF_CHECK_EQUAL(b.active, 0);
    CAF_CHECK_EQUAL(b.free_slots, 4);
    // The resumed prefill (prompt + 5 tokens, 44 to compute) found the prompt's two blocks in the prefix cache,
    // put there by attempt 1's prefill (which found nothing).
    const auto p = request<WorkerStats>(c.prefill, stats_atom::value);
    CAF_CHECK_EQUAL(prefilled_before.cached_tokens, 0);
    CAF_CHECK_EQUAL(p.handoffs, 2);
    CAF_CHECK_EQUAL(p.prompt_tokens, 40 + 45);
    CAF_CHECK_EQUAL(p.cached_tokens, 2 * kResumeBlock);
    CAF_CHECK_EQUAL(got.last.cached_tokens, 2 * kResumeBlock);  // the prompt tokens the last prefill reused
    CAF_CHECK_EQUAL(p.slots_free, p.slots_total);
  }
}

// A decode worker declared lost while it still runs (a stall): it sends one more chunk after the router moved
// the request, then reads the router's drop and frees the request without a chunk. The client's stream is the
// uninterrupted one (the resumed attempt replays the chunk it overlaps, checked and held back), and the stalled
// worker ends with nothing held: no slot, no waiting handoff, no request.
CAF_TEST(stalled_decode_worker_that_comes_back_drops_its_moved_request) {
  std::string error;
  const auto& tiny = testing::tiny_model(&error);
  CAF_REQUIRE(tiny.model != nullptr);
  for (const bool sampled : {false, true}) {
    CAF_MESSAGE((sampled ? "seeded sampling" : "greedy"));
    Chunks want, got;
    WorkerStats stalled;
    RouterStats router_stats;
    for (const bool fault : {false, true}) {
      auto router = spawn_router(sys, no_queue_deadline(), registry_actor{}, nullptr);
      auto prefill = spawn_prefill_worker(sys, tiny.model, registry_actor{},
                                          PrefillWorkerConfig{"prefill-0", 8, std::chrono::milliseconds(0)});
      auto decode_a = spawn_decode_worker(sys, tiny.model, tiny.tokenizer, registry_actor{},
                                          DecodeWorkerConfig{"decode-a", 4, std::chrono::milliseconds(0), false});
      auto decode_b = spawn_decode_worker(sys, tiny.model, tiny.tokenizer, registry_actor{},
                                          DecodeWorkerConfig{"decode-b", 4, std::chrono::milliseconds(0), false});
      auto out = std::make_shared<Chunks>();
      auto sink = spawn_stream_sink(sys, std::make_shared<ClientStream>(out), "r", router);
      for (const caf::actor& a : {caf::actor_cast<caf::actor>(router), caf::actor_cast<caf::actor>(prefill),
                                  caf::actor_cast<caf::actor>(decode_a), caf::actor_cast<caf::actor>(decode_b),
                                  caf::actor_cast<caf::actor>(sink)}) {
        kill_at_end(a);
      }
      self->send(router, workers_atom::value,
                 std::vector<WorkerInfo>{{"decode-a", kDecodeRole, caf::actor_cast<caf::actor>(decode_a), 4, {}},
                                         {"decode-b", kDecodeRole, caf::actor_cast<caf::actor>(decode_b), 4, {}},
                                         {"prefill-0", kPrefillRole, caf::actor_cast<caf::actor>(prefill), 2, {}}});
      self->send(router, submit_atom::value, resume_request("r", sampled), caf::actor_cast<caf::actor>(sink));
      run();
      auto step_a = [&] {
        self->send(decode_a, step_atom::value);
        run();
      };
      for (int i = 0; i < 4; ++i) step_a();
      CAF_REQUIRE_EQUAL(out->size(), 4u);
      if (fault) {
        // The router declares decode-a lost while its next step is under way: the router resumes after the 4
        // tokens it has heard of; decode-a still delivers a 5th, then reads the drop.
        self->send(decode_a, step_atom::value);
        self->send(router, lost_atom::value, std::string("decode-a"));
        run();
        CAF_CHECK_EQUAL(out->size(), 5u);
        for (int i = 0; i < 3; ++i) step_a();  // decode-a is back: nothing of the request is left there
        stalled = request<WorkerStats>(decode_a, stats_atom::value);
        CAF_CHECK_EQUAL(out->size(), 5u);
      }
      for (int i = 0; i < 30 && !out->back().is_final(); ++i) {
        self->send(fault ? caf::actor_cast<caf::actor>(decode_b) : caf::actor_cast<caf::actor>(decode_a),
                   step_atom::value);
        run();
      }
      CAF_REQUIRE(out->back().is_final());
      (fault ? got : want) = *out;
      if (fault) {
        router_stats = request<RouterStats>(router, stats_atom::value);
        const auto b = request<WorkerStats>(decode_b, stats_atom::value);
        CAF_CHECK_EQUAL(b.steps, 12 - 4);  // resumed after the 4 tokens the router knew of; the 5th is replayed
        CAF_CHECK_EQUAL(b.active + b.queued, 0);
        CAF_CHECK_EQUAL(b.free_slots, 4);
        const auto p = request<WorkerStats>(prefill, stats_atom::value);
        CAF_CHECK_EQUAL(p.slots_free, p.slots_total);
        CAF_CHECK_EQUAL(p.active + p.queued, 0);
      }
    }
    check_same_stream(summarize(got), summarize(want));
    CAF_CHECK_EQUAL(stalled.stale_dropped, 1);
    CAF_CHECK_EQUAL(stalled.active, 0);
    CAF_CHECK_EQUAL(stalled.queued, 0);
    CAF_CHECK_EQUAL(stalled.free_slots, 4);
    CAF_CHECK_EQUAL(router_stats.resumed, 1);
    CAF_CHECK_EQUAL(router_stats.resumed_tokens, 4);
    CAF_CHECK_EQUAL(router_stats.running, 0);
    CAF_CHECK_EQUAL(router_stats.failed, 0);
  }
}

CAF_TEST_FIXTURE_SCOPE_END()
