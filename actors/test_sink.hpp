// Test helpers for gtest suites that drive a ClusterService: a sink that collects a request's chunks, a
// polling wait, and the node options those suites start from.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "actors/node.hpp"
#include "actors/test_model.hpp"
#include "router/inference_service.hpp"

namespace deltaserve::actors::testing {

// Collects one request's chunks (ClusterService sink) and waits for them.
class CollectingSink : public router::GenerationSink {
 public:
  void on_chunk(router::GenerationChunk chunk) override {
    std::lock_guard lock(mutex_);
    EXPECT_FALSE(final_) << "chunk after the final chunk";
    final_ = chunk.is_final();
    chunks_.push_back(std::move(chunk));
    cv_.notify_all();
  }
  bool wait_final(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    return cv_.wait_for(lock, timeout, [&] { return final_; });
  }
  bool wait_chunks(size_t n, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    return cv_.wait_for(lock, timeout, [&] { return chunks_.size() >= n || final_; });
  }
  std::vector<int32_t> tokens() {
    std::lock_guard lock(mutex_);
    std::vector<int32_t> out;
    for (const auto& c : chunks_) out.insert(out.end(), c.tokens.begin(), c.tokens.end());
    return out;
  }
  router::GenerationChunk last() {
    std::lock_guard lock(mutex_);
    return chunks_.back();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<router::GenerationChunk> chunks_;
  bool final_ = false;
};

inline bool wait_until(const std::function<bool()>& pred, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return pred();
}

// Every role in this process with the tiny model: 4 decode slots, 4-token prefill chunks, fast heartbeats.
inline NodeOptions tiny_serve_options() {
  const auto& tiny = tiny_model();
  NodeOptions o;
  o.role = NodeRole::kServe;
  o.model = tiny.model;
  o.tokenizer = tiny.tokenizer;
  o.max_batch = 4;
  o.prefill_chunk = 4;
  o.heartbeat_interval = std::chrono::milliseconds(100);
  return o;
}

// A router (registry published on an ephemeral loopback port) that workers of other nodes join. Its registry
// expires a worker after ten of the router's heartbeat intervals: 10 s here, so a scheduling stall of a loaded
// 2-core CI machine cannot expire a live worker (at 100 ms a 1 s stall did, once: every request of a test that
// counts retries was prefilled twice). Workers leave on shutdown and go down when killed, which the tests see
// at once; expiry itself is tested on the registry (protocol_test).
inline NodeOptions remote_router_options() {
  NodeOptions o;
  o.role = NodeRole::kRouter;
  o.cluster_port = 0;
  o.heartbeat_interval = std::chrono::seconds(1);
  return o;
}

}  // namespace deltaserve::actors::testing
