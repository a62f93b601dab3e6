#include "engine/open_model.hpp"

#include <cstdio>
#include <memory>
#include <ostream>

#include "engine/checkpoint/safetensors.hpp"
#include "engine/model_config.hpp"

#ifdef DELTASERVE_WITH_CUDA_BACKEND
#include "engine/cuda/cuda_backend.hpp"
#endif

namespace deltaserve::engine {

Result<int> parse_device(const std::string& device) {
  if (device == "cpu") return -1;
  if (device == "cuda") return 0;
  const std::string index = device.starts_with("cuda:") ? device.substr(5) : std::string();
  if (!index.empty() && index.size() <= 3 && index.find_first_not_of("0123456789") == std::string::npos) {
    return std::stoi(index);
  }
  return invalid_argument("device: '" + device + "' is not cpu, cuda or cuda:N");
}

bool cuda_backend_built() {
#ifdef DELTASERVE_WITH_CUDA_BACKEND
  return true;
#else
  return false;
#endif
}

Result<std::unique_ptr<Model>> open_model(const std::filesystem::path& directory, const DeviceOptions& options,
                                          const std::function<void(int64_t, int64_t)>& progress) {
  DS_ASSIGN_OR_RETURN(const int device, parse_device(options.device));
  if (device < 0) {
    if (options.random_weights) return invalid_argument("random_weights: needs a GPU device (--device cuda)");
    if (!options.cuda_graphs) return invalid_argument("cuda_graphs: false needs a GPU device (--device cuda)");
    if (options.cuda_profile) return invalid_argument("cuda_profile: needs a GPU device (--device cuda)");
    return Model::load(directory);
  }
  if (!(options.gpu_memory_fraction > 0.0 && options.gpu_memory_fraction <= 1.0)) {
    return invalid_argument("gpu_memory_fraction: must be in (0, 1]");
  }
  if (options.gpu_max_batch_tokens <= 0) return invalid_argument("gpu_max_batch_tokens: must be positive");
  if (options.gpu_max_requests <= 0) return invalid_argument("gpu_max_requests: must be positive");
#ifdef DELTASERVE_WITH_CUDA_BACKEND
  DS_ASSIGN_OR_RETURN(ModelConfig config, load_model_config(directory));
  cuda::CudaBackendOptions backend_options;
  backend_options.device = device;
  backend_options.memory_fraction = options.gpu_memory_fraction;
  backend_options.max_batch_tokens = options.gpu_max_batch_tokens;
  backend_options.max_requests = options.gpu_max_requests;
  backend_options.cuda_graphs = options.cuda_graphs;
  backend_options.profile = options.cuda_profile;
  std::shared_ptr<Backend> backend;
  if (options.random_weights) {
    DS_ASSIGN_OR_RETURN_CTX(backend, cuda::make_cuda_backend_random(config, options.random_seed, backend_options),
                            options.device + ": random weights");
  } else {
    DS_ASSIGN_OR_RETURN_CTX(std::unique_ptr<Checkpoint> checkpoint, Checkpoint::open(directory),
                            "checkpoint " + directory.string());
    DS_ASSIGN_OR_RETURN_CTX(backend, cuda::make_cuda_backend(config, *checkpoint, backend_options, progress),
                            "checkpoint " + directory.string() + " on " + options.device);
  }
  return std::make_unique<Model>(std::move(config), std::move(backend));
#else
  (void)progress;
  return unimplemented("device: '" + options.device +
                       "' needs the CUDA backend, and this build has none (built "
                       "without nvcc)");
#endif
}

std::function<void(int64_t, int64_t)> progress_printer(std::ostream& out, std::string label) {
  auto next_tenth = std::make_shared<int64_t>(1);
  return [&out, label = std::move(label), next_tenth](int64_t done, int64_t total) {
    if (total <= 0) return;
    const int64_t tenth = done * 10 / total;
    if (tenth < *next_tenth && done < total) return;
    *next_tenth = tenth + 1;
    char line[160];
    std::snprintf(line, sizeof line, "%s: %3lld%% (%.1f of %.1f GB)\n", label.c_str(),
                  static_cast<long long>(done * 100 / total), static_cast<double>(done) / 1e9,
                  static_cast<double>(total) / 1e9);
    out << line << std::flush;
  };
}

}  // namespace deltaserve::engine
