// Test-only: a scripted InferenceService for the HTTP tests (chunks from worker threads, as the real
// cluster delivers them), with switches for rejection, hanging until cancel, and late failure.
#pragma once

#include <condition_variable>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "router/inference_service.hpp"
#include "tokenizer/tiktoken_tokenizer.hpp"

namespace deltaserve::router::testing {

struct ScriptStep {
  std::string text;
  std::optional<std::string> finish;
};

class FakeService final : public InferenceService {
 public:
  enum class Mode {
    kScript,     // emit `script` (one chunk per step) from a worker thread
    kReject,     // fail at once with kResourceExhausted (inside submit)
    kHang,       // emit the first script step, then wait for cancel (→ "abort") or release() (→ the rest)
    kFailLater,  // emit the first step, then fail with kUnavailable
  };

  explicit FakeService(const tokenizer::Tokenizer& tok) : tok_(tok) {}
  ~FakeService() override {
    release();
    for (std::thread& t : workers_) t.join();
  }

  void submit(GenerationRequest request, std::shared_ptr<GenerationSink> sink) override {
    std::lock_guard lock(mutex_);
    submitted_.push_back(request);
    if (mode_ == Mode::kReject) {
      GenerationChunk chunk;
      chunk.request_id = request.request_id;
      chunk.error = Status(StatusCode::kResourceExhausted, "queue full");
      sink->on_chunk(std::move(chunk));
      return;
    }
    workers_.emplace_back([this, request, sink, mode = mode_, script = script_] { run(request, sink, mode, script); });
  }

  void cancel(const std::string& request_id) override {
    std::lock_guard lock(mutex_);
    cancelled_.insert(request_id);
    cv_.notify_all();
  }

  ServiceStatus status() const override {
    std::lock_guard lock(mutex_);
    return {ready_, ready_ ? "" : "no decode worker", 0, 0};
  }

  void set_mode(Mode mode) {
    std::lock_guard lock(mutex_);
    mode_ = mode;
  }
  void set_script(std::vector<ScriptStep> script) {
    std::lock_guard lock(mutex_);
    script_ = std::move(script);
  }
  void set_ready(bool ready) {
    std::lock_guard lock(mutex_);
    ready_ = ready;
  }
  void release() {
    std::lock_guard lock(mutex_);
    released_ = true;
    cv_.notify_all();
  }
  std::vector<GenerationRequest> submitted() const {
    std::lock_guard lock(mutex_);
    return submitted_;
  }
  bool wait_cancelled(const std::string& id, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    return cv_.wait_for(lock, timeout, [&] { return cancelled_.count(id) > 0; });
  }
  bool was_cancelled(const std::string& id) const {
    std::lock_guard lock(mutex_);
    return cancelled_.count(id) > 0;
  }

 private:
  GenerationChunk make_chunk(const GenerationRequest& request, const ScriptStep& step, int64_t& produced) {
    GenerationChunk chunk;
    chunk.request_id = request.request_id;
    chunk.text = step.text;
    chunk.tokens = tok_.encode(step.text, tokenizer::SpecialTokens::kNone);
    produced += static_cast<int64_t>(chunk.tokens.size());
    if (request.logprobs) {
      for (const int32_t token : chunk.tokens) {
        TokenLogprobs entry{token, -0.5f, {}};
        for (int32_t k = 0; k < request.sampling.top_logprobs; ++k) entry.top.push_back({token + k, -0.5f - k});
        chunk.logprobs.push_back(std::move(entry));
      }
    }
    chunk.finish_reason = step.finish;
    if (chunk.finish_reason) {
      chunk.prompt_tokens = static_cast<int64_t>(request.prompt.size());
      chunk.completion_tokens = produced;
      chunk.cached_tokens = 3;
    }
    return chunk;
  }

  void run(GenerationRequest request, std::shared_ptr<GenerationSink> sink, Mode mode, std::vector<ScriptStep> script) {
    int64_t produced = 0;
    for (size_t i = 0; i < script.size(); ++i) {
      if (i == 1 && mode == Mode::kFailLater) {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return released_; });
        lock.unlock();
        GenerationChunk chunk;
        chunk.request_id = request.request_id;
        chunk.error = Status(StatusCode::kUnavailable, "decode worker lost");
        sink->on_chunk(std::move(chunk));
        return;
      }
      if (i == 1 && mode == Mode::kHang) {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return released_ || cancelled_.count(request.request_id) > 0; });
        if (cancelled_.count(request.request_id) > 0) {
          lock.unlock();
          GenerationChunk chunk;
          chunk.request_id = request.request_id;
          chunk.finish_reason = "abort";
          sink->on_chunk(std::move(chunk));
          return;
        }
      }
      sink->on_chunk(make_chunk(request, script[i], produced));
    }
  }

  const tokenizer::Tokenizer& tok_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  Mode mode_ = Mode::kScript;
  std::vector<ScriptStep> script_ = {{"Hel", {}}, {"lo wor", {}}, {"ld", "stop"}};
  bool ready_ = true;
  bool released_ = false;
  std::vector<GenerationRequest> submitted_;
  std::set<std::string> cancelled_;
  std::vector<std::thread> workers_;
};

}  // namespace deltaserve::router::testing
