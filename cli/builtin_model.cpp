#include <cstdlib>
#include <system_error>

#include <unistd.h>

#include "cli/commands.hpp"
#include "engine/make_model.hpp"
#include "tokenizer/tokenizer_writer.hpp"

namespace deltaserve::cli {
namespace {

// Bump when the presets or the generator change, so old caches are not reused.
constexpr const char* kBuiltinVersion = "v1";
constexpr uint64_t kBuiltinSeed = 20261130;

std::filesystem::path cache_root() {
  if (const char* home = std::getenv("DELTASERVE_HOME"); home && *home) return home;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) return std::filesystem::path(xdg) / "deltaserve";
  if (const char* home = std::getenv("HOME"); home && *home) {
    return std::filesystem::path(home) / ".cache" / "deltaserve";
  }
  return std::filesystem::temp_directory_path() / "deltaserve";
}

}  // namespace

Result<std::filesystem::path> builtin_model_dir(const std::string& preset) {
  const std::filesystem::path dir = cache_root() / "models" / (preset + "-" + kBuiltinVersion);
  if (std::filesystem::exists(dir / "config.json")) return dir;

  DS_ASSIGN_OR_RETURN(engine::ModelConfig config, engine::preset_config(preset));
  std::error_code ec;
  std::filesystem::create_directories(dir.parent_path(), ec);
  if (ec) return io_error("cannot create " + dir.parent_path().string() + ": " + ec.message());
  const std::filesystem::path staging =
      dir.parent_path() / (dir.filename().string() + ".tmp-" + std::to_string(::getpid()));
  std::filesystem::remove_all(staging, ec);
  DS_RETURN_IF_ERROR_CTX(tokenizer::write_tiny_tokenizer(staging, engine::kTinyVocabBase, kBuiltinSeed),
                         "built-in model tokenizer");
  engine::MakeModelOptions options;
  options.seed = kBuiltinSeed;
  DS_RETURN_IF_ERROR_CTX(engine::write_random_model(config, staging, options), "built-in model " + preset);
  std::filesystem::rename(staging, dir, ec);
  if (ec) {
    // Another process won the race: its copy is identical (deterministic), use it.
    std::filesystem::remove_all(staging, ec);
    if (!std::filesystem::exists(dir / "config.json"))
      return io_error("cannot install built-in model at " + dir.string());
  }
  return dir;
}

Result<std::filesystem::path> resolve_model_dir(const std::optional<std::string>& model) {
  if (model && !model->empty()) return std::filesystem::path(*model);
  return builtin_model_dir();
}

}  // namespace deltaserve::cli
