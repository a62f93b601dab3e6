#include <ostream>

#include "cli/commands.hpp"
#include "engine/model_config.hpp"
#include "engine/model_inspect.hpp"

namespace deltaserve::cli {

int run_inspect_model(const std::string& path, std::ostream& out, std::ostream& err) {
  auto config = engine::load_model_config(path);
  if (!config.is_ok()) {
    err << "error: " << config.status().message() << "\n";
    return 1;
  }
  out << engine::describe_model(*config);
  return 0;
}

}  // namespace deltaserve::cli
