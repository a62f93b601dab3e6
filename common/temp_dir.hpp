// A directory under the system temp dir, unique per process and instance, removed with everything in
// it when the object goes away. For tests and tools that must leave nothing behind.
#pragma once

#include <atomic>
#include <filesystem>
#include <string>

#include <unistd.h>

namespace deltaserve {

class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "deltaserve") {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            (prefix + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace deltaserve
