// router::InferenceService on top of the router actor. Free of CAF types (the CLI and the HTTP layer
// include it); the Node builds it.
//
// submit() spawns a per-request sink actor that calls GenerationSink::on_chunk from the actor's thread,
// in order, until the final chunk; if the router goes down or the actor system shuts down first, the sink
// delivers a final kUnavailable chunk, so every submitted request gets exactly one final chunk.
#pragma once

#include <memory>
#include <string>

#include "router/inference_service.hpp"

namespace deltaserve::actors {

class ClusterService final : public router::InferenceService {
 public:
  struct Impl;
  explicit ClusterService(std::unique_ptr<Impl> impl);
  ~ClusterService() override;

  void submit(router::GenerationRequest request, std::shared_ptr<router::GenerationSink> sink) override;
  void cancel(const std::string& request_id) override;
  router::ServiceStatus status() const override;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace deltaserve::actors
