// Test-only helpers shared by the router tests: the project's tiny tokenizer, written once per process.
#pragma once

#include <cstdlib>
#include <filesystem>

#include <unistd.h>

#include "tokenizer/tiktoken_tokenizer.hpp"
#include "tokenizer/tokenizer_writer.hpp"

namespace deltaserve::router::testing {

inline const tokenizer::Tokenizer& tiny_tokenizer() {
  static const tokenizer::Tokenizer* const instance = [] {
    const auto dir = std::filesystem::temp_directory_path() / ("ds_router_tok_" + std::to_string(::getpid()));
    if (!tokenizer::write_tiny_tokenizer(dir, 1024, 7).is_ok()) std::abort();
    auto loaded = tokenizer::Tokenizer::load(dir);
    if (!loaded.is_ok()) std::abort();
    std::filesystem::remove_all(dir);
    return new tokenizer::Tokenizer(std::move(loaded).value());
  }();
  return *instance;
}

}  // namespace deltaserve::router::testing
