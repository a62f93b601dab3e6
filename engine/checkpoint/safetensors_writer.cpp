// SafetensorsWriter: fp32 -> stored dtype (incl. fp8 block quantisation) and deterministic files.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

#include "common/json.hpp"
#include "engine/checkpoint/safetensors.hpp"

namespace deltaserve::engine {

namespace {

constexpr const char* kIndexFileName = "model.safetensors.index.json";
constexpr const char* kSingleFileName = "model.safetensors";

// Number of elements of `shape`; an error for negative dimensions or a count past 2^62.
Result<size_t> element_count(const std::string& name, const std::vector<int64_t>& shape) {
  uint64_t count = 1;
  for (int64_t dim : shape) {
    if (dim < 0) return invalid_argument("tensor '" + name + "': negative dimension " + std::to_string(dim));
    if (__builtin_mul_overflow(count, static_cast<uint64_t>(dim), &count) || count > (uint64_t{1} << 62)) {
      return invalid_argument("tensor '" + name + "': shape too large");
    }
  }
  return static_cast<size_t>(count);
}

template <class T>
std::vector<std::byte> encode(std::span<const float> values, T (*convert)(float)) {
  std::vector<std::byte> bytes(values.size() * sizeof(T));
  for (size_t i = 0; i < values.size(); ++i) {
    const T code = convert(values[i]);
    std::memcpy(bytes.data() + i * sizeof(T), &code, sizeof(T));
  }
  return bytes;
}

std::string shard_file_name(size_t index, size_t count) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return buffer;
}

// Writes `contents` pieces to `path` through `path`.tmp + rename, so a reader never sees half a file.
Status write_file(const std::filesystem::path& path, std::span<const std::span<const std::byte>> contents) {
  const std::filesystem::path temporary = path.string() + ".tmp";
  std::FILE* file = std::fopen(temporary.c_str(), "wb");
  if (file == nullptr) return io_error(temporary.string() + ": cannot create: " + std::strerror(errno));
  bool ok = true;
  for (std::span<const std::byte> piece : contents) {
    if (!piece.empty() && std::fwrite(piece.data(), 1, piece.size(), file) != piece.size()) ok = false;
  }
  if (std::fclose(file) != 0) ok = false;
  if (!ok) {
    std::remove(temporary.c_str());
    return io_error(temporary.string() + ": write failed: " + std::strerror(errno));
  }
  std::error_code error;
  std::filesystem::rename(temporary, path, error);
  if (error) return io_error(path.string() + ": rename failed: " + error.message());
  return Status::ok();
}

std::span<const std::byte> as_bytes(const std::string& text) {
  return std::as_bytes(std::span(text));
}

// One safetensors file holding `entries` in the given (name) order. `Entry` is
// SafetensorsWriter::Entry (deduced, as it is private): name, dtype, shape, bytes.
template <class Entry>
Status write_shard(const std::filesystem::path& path, const std::vector<const Entry*>& entries) {
  json::Value header = json::Value::object();
  json::Value metadata = json::Value::object();
  metadata["format"] = "pt";
  header.as_object().emplace_back("__metadata__", std::move(metadata));
  uint64_t offset = 0;
  for (const Entry* entry_pointer : entries) {
    const Entry& entry = *entry_pointer;
    json::Value info = json::Value::object();
    info["dtype"] = dtype_name(entry.dtype);
    json::Value shape = json::Value::array();
    for (int64_t dim : entry.shape) shape.push_back(dim);
    info["shape"] = std::move(shape);
    json::Value offsets = json::Value::array();
    offsets.push_back(offset);
    offset += entry.bytes.size();
    offsets.push_back(offset);
    info["data_offsets"] = std::move(offsets);
    // Names are unique (they come from a map), so append without operator[]'s linear lookup.
    header.as_object().emplace_back(entry.name, std::move(info));
  }
  std::string header_text = header.dump();
  header_text.append((8 - header_text.size() % 8) % 8, ' ');  // as the reference implementation pads
  std::string length(8, '\0');
  for (int i = 0; i < 8; ++i) length[i] = static_cast<char>((header_text.size() >> (8 * i)) & 0xFF);

  std::vector<std::span<const std::byte>> pieces = {as_bytes(length), as_bytes(header_text)};
  for (const Entry* entry : entries) pieces.push_back(entry->bytes);
  return write_file(path, pieces);
}

}  // namespace

Status SafetensorsWriter::add(const std::string& name, std::vector<int64_t> shape, std::span<const float> values,
                              DType dtype) {
  DS_ASSIGN_OR_RETURN(const size_t count, element_count(name, shape));
  if (values.size() != count) {
    return invalid_argument("tensor '" + name + "': " + std::to_string(values.size()) + " values for " +
                            std::to_string(count) + " elements");
  }
  switch (dtype) {
    case DType::kF32: {
      std::vector<std::byte> bytes(values.size() * sizeof(float));
      if (!values.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
      return add_raw(name, dtype, std::move(shape), std::move(bytes));
    }
    case DType::kBF16:
      return add_raw(name, dtype, std::move(shape), encode<uint16_t>(values, &float_to_bf16));
    case DType::kF16:
      return add_raw(name, dtype, std::move(shape), encode<uint16_t>(values, &float_to_f16));
    case DType::kF8E4M3:
      break;
    default:
      return invalid_argument("tensor '" + name + "': add() stores F32, BF16, F16 or F8_E4M3, not " +
                              dtype_name(dtype) + " (use add_raw)");
  }

  // F8_E4M3 with 128×128 block scales.
  if (shape.size() != 2) return invalid_argument("tensor '" + name + "': F8_E4M3 needs a 2-D tensor");
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return invalid_argument("tensor '" + name + "': cannot quantise non-finite value at element " +
                              std::to_string(i) + " to F8_E4M3");
    }
  }
  const std::string scale_name = fp8_scale_name(name);
  if (entries_.contains(scale_name)) return invalid_argument("tensor '" + scale_name + "' added twice");
  const int64_t rows = shape[0];
  const int64_t cols = shape[1];
  const int64_t scale_rows = (rows + kFp8BlockSize - 1) / kFp8BlockSize;
  const int64_t scale_cols = (cols + kFp8BlockSize - 1) / kFp8BlockSize;
  std::vector<float> scales(static_cast<size_t>(scale_rows * scale_cols));
  std::vector<std::byte> codes(values.size());
  for (int64_t block_row = 0; block_row < scale_rows; ++block_row) {
    for (int64_t block_col = 0; block_col < scale_cols; ++block_col) {
      const int64_t row_end = std::min(rows, (block_row + 1) * kFp8BlockSize);
      const int64_t col_end = std::min(cols, (block_col + 1) * kFp8BlockSize);
      float max_abs = 0.0f;
      for (int64_t i = block_row * kFp8BlockSize; i < row_end; ++i) {
        for (int64_t j = block_col * kFp8BlockSize; j < col_end; ++j)
          max_abs = std::max(max_abs, std::fabs(values[i * cols + j]));
      }
      // An all-zero block gets 1; a block of tiny values keeps a normal scale so w / scale stays finite.
      const float scale = max_abs == 0.0f ? 1.0f : std::max(max_abs / kF8E4M3Max, std::numeric_limits<float>::min());
      scales[block_row * scale_cols + block_col] = scale;
      for (int64_t i = block_row * kFp8BlockSize; i < row_end; ++i) {
        for (int64_t j = block_col * kFp8BlockSize; j < col_end; ++j) {
          codes[i * cols + j] = static_cast<std::byte>(float_to_f8e4m3(values[i * cols + j] / scale));
        }
      }
    }
  }
  DS_RETURN_IF_ERROR(add_raw(name, DType::kF8E4M3, std::move(shape), std::move(codes)));
  std::vector<std::byte> scale_bytes(scales.size() * sizeof(float));
  std::memcpy(scale_bytes.data(), scales.data(), scale_bytes.size());
  return add_raw(scale_name, DType::kF32, {scale_rows, scale_cols}, std::move(scale_bytes));
}

Status SafetensorsWriter::add_raw(const std::string& name, DType dtype, std::vector<int64_t> shape,
                                  std::vector<std::byte> bytes) {
  if (name.empty() || name == "__metadata__") return invalid_argument("invalid tensor name '" + name + "'");
  if (entries_.contains(name)) return invalid_argument("tensor '" + name + "' added twice");
  DS_ASSIGN_OR_RETURN(const size_t count, element_count(name, shape));
  if (bytes.size() != count * dtype_size(dtype)) {
    return invalid_argument("tensor '" + name + "': " + std::to_string(bytes.size()) + " bytes for " +
                            std::to_string(count) + " elements of " + dtype_name(dtype));
  }
  entries_.emplace(name, Entry{name, dtype, std::move(shape), std::move(bytes)});
  return Status::ok();
}

Status SafetensorsWriter::write(const std::filesystem::path& directory, uint64_t max_shard_bytes) const {
  namespace fs = std::filesystem;
  std::error_code error;
  fs::create_directories(directory, error);
  if (error) return io_error(directory.string() + ": cannot create directory: " + error.message());

  // Greedy split in name order: a new shard starts when the next tensor would pass the limit.
  std::vector<std::vector<const Entry*>> shards(1);
  uint64_t shard_bytes = 0;
  uint64_t total_bytes = 0;
  for (const auto& [name, entry] : entries_) {
    if (max_shard_bytes > 0 && !shards.back().empty() && shard_bytes + entry.bytes.size() > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(&entry);
    shard_bytes += entry.bytes.size();
    total_bytes += entry.bytes.size();
  }

  if (max_shard_bytes == 0) {
    fs::remove(directory / kIndexFileName, error);
    return write_shard(directory / kSingleFileName, shards.front());
  }
  fs::remove(directory / kSingleFileName, error);
  json::Value weight_map = json::Value::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string file_name = shard_file_name(i, shards.size());
    DS_RETURN_IF_ERROR(write_shard(directory / file_name, shards[i]));
    for (const Entry* entry : shards[i]) weight_map.as_object().emplace_back(entry->name, file_name);
  }
  json::Value index = json::Value::object();
  index["metadata"]["total_size"] = total_bytes;
  index["weight_map"] = std::move(weight_map);
  const std::string index_text = index.dump(2) + "\n";
  const std::span<const std::byte> pieces[] = {as_bytes(index_text)};
  return write_file(directory / kIndexFileName, pieces);
}

}  // namespace deltaserve::engine
