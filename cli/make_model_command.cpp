#include <fstream>
#include <ostream>
#include <sstream>

#include "cli/commands.hpp"
#include "engine/make_model.hpp"
#include "tokenizer/tokenizer_writer.hpp"

namespace deltaserve::cli {
namespace {

Result<engine::ModelConfig> config_from_argument(const std::string& preset) {
  for (const std::string& name : engine::preset_names()) {
    if (preset == name) return engine::preset_config(name);
  }
  if (!preset.empty() && preset.front() == '{') return engine::parse_model_config_text(preset);
  return engine::load_model_config(preset);
}

Result<engine::DType> parse_dtype(const std::string& dtype) {
  if (dtype == "f32") return engine::DType::kF32;
  if (dtype == "bf16") return engine::DType::kBF16;
  if (dtype == "f16") return engine::DType::kF16;
  if (dtype == "fp8") return engine::DType::kF8E4M3;
  return invalid_argument("--dtype: '" + dtype + "' is not one of f32, bf16, f16, fp8");
}

}  // namespace

int run_make_model(const MakeModelCommandOptions& options, std::ostream& out, std::ostream& err) {
  auto config = config_from_argument(options.preset);
  if (!config.is_ok()) {
    err << "error: --preset " << options.preset << ": " << config.status().message() << "\n";
    return 1;
  }
  auto dtype = parse_dtype(options.dtype);
  if (!dtype.is_ok()) {
    err << "error: " << dtype.status().message() << "\n";
    return 1;
  }
  // The tokenizer's base vocabulary fills the config's vocabulary up to the 256 specials.
  const int64_t vocab_base = config->vocab_size - 256;
  if (vocab_base < 256) {
    err << "error: vocab_size " << config->vocab_size << " leaves no room for 256 byte tokens and 256 specials\n";
    return 1;
  }
  engine::MakeModelOptions make;
  make.seed = options.seed;
  make.dtype = *dtype;
  make.max_shard_bytes = options.shard_bytes;
  Status status = engine::write_random_model(*config, options.out_dir, make);
  if (status.is_ok()) {
    status = tokenizer::write_tiny_tokenizer(options.out_dir, static_cast<int32_t>(vocab_base), options.seed);
  }
  if (!status.is_ok()) {
    err << "error: " << status.message() << "\n";
    return 1;
  }
  out << "wrote " << options.out_dir << " (" << config->num_layers << " layers, hidden " << config->hidden_size
      << ", vocab " << config->vocab_size << ")\n";
  return 0;
}

}  // namespace deltaserve::cli
