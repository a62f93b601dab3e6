// Opening a model on the device it will run on: the one place that knows which backends this build has.
// Callers (CLI, actors) pass the user's device flags and get a Model whose forward passes run there.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <iosfwd>
#include <memory>
#include <string>

#include "common/status.hpp"
#include "engine/model.hpp"

namespace deltaserve::engine {

struct DeviceOptions {
  std::string device = "cpu";           // "cpu" | "cuda" | "cuda:N"
  double gpu_memory_fraction = 0.90;    // of the GPU's memory for weights, request states, MLA pages and scratch
  int64_t gpu_max_batch_tokens = 8192;  // rows of one GPU forward pass (prefill chunk + decode tokens)
  int64_t gpu_max_requests = 1024;      // GPU request-state slots at most
  bool cuda_graphs = true;      // replay pure-decode GPU passes from CUDA graphs (false: every pass eager, to debug)
  bool cuda_profile = false;    // time the phases of eager GPU passes; the table goes to stderr when the model closes
  bool random_weights = false;  // weights drawn on the device from config.json alone (benchmarks of shapes whose
                                // checkpoints are not here); the checkpoint files are not read
  uint64_t random_seed = 0;
};

// Parses `device`: "cpu" → -1, "cuda" → 0, "cuda:N" → N. The message names the flag.
Result<int> parse_device(const std::string& device);

// Whether this build has the CUDA backend (built with nvcc; a GPU is only needed at run time).
bool cuda_backend_built();

// Loads config.json (+ the checkpoint unless random_weights) from `directory` for `options.device`.
// `progress(bytes_done, bytes_total)` is called while weights are uploaded to a GPU.
Result<std::unique_ptr<Model>> open_model(const std::filesystem::path& directory, const DeviceOptions& options,
                                          const std::function<void(int64_t, int64_t)>& progress = {});

// A progress callback for open_model that writes "<label>: 40% (38.4 of 96.0 GB)" lines to `out` at every tenth of
// the total and at the end. `out` must outlive the returned callback.
std::function<void(int64_t, int64_t)> progress_printer(std::ostream& out, std::string label);

}  // namespace deltaserve::engine
