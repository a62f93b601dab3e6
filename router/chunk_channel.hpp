// The hand-off of one HTTP request's chunks from service threads (GenerationSink calls) to the
// connection that serves it. No Asio here: the owner supplies the wake callback that schedules itself.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>

#include "router/inference_service.hpp"

namespace deltaserve::router {

// Chunks of one HTTP request's choices, from service threads to the connection's strand.
class ChunkChannel {
 public:
  using Item = std::pair<int, GenerationChunk>;  // (choice index, chunk)

  // `wake` is called (under the channel's lock, so it must not block) when the queue becomes non-empty.
  explicit ChunkChannel(std::function<void()> wake) : wake_(std::move(wake)) {}

  void push(int index, GenerationChunk chunk) {
    std::lock_guard lock(mutex_);
    if (closed_) return;
    queue_.emplace_back(index, std::move(chunk));
    if (!wake_pending_ && wake_) {
      wake_pending_ = true;
      wake_();
    }
  }

  std::deque<Item> drain() {
    std::lock_guard lock(mutex_);
    wake_pending_ = false;
    return std::exchange(queue_, {});
  }

  // Later pushes are dropped; the wake callback (which keeps the connection alive) is released.
  void close() {
    std::lock_guard lock(mutex_);
    closed_ = true;
    wake_ = nullptr;
    queue_.clear();
  }

 private:
  std::mutex mutex_;
  std::deque<Item> queue_;
  bool wake_pending_ = false;
  bool closed_ = false;
  std::function<void()> wake_;
};

class ChannelSink final : public GenerationSink {
 public:
  ChannelSink(std::shared_ptr<ChunkChannel> channel, int index) : channel_(std::move(channel)), index_(index) {}
  void on_chunk(GenerationChunk chunk) override { channel_->push(index_, std::move(chunk)); }

 private:
  std::shared_ptr<ChunkChannel> channel_;
  int index_;
};

}  // namespace deltaserve::router
