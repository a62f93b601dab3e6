// Safetensors checkpoints: reading (mmap, one file or shards + model.safetensors.index.json),
// validation, dequantisation to fp32, and writing (for `deltaserve make-model` and tests).
//
// File format: 8-byte little-endian header length N, N bytes of JSON header
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {...}},
// then the data section; offsets are relative to the start of the data section.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.hpp"

namespace deltaserve::engine {

enum class DType { kF32, kF16, kBF16, kF8E4M3, kU8, kI8, kI32, kI64, kF64, kBool };

const char* dtype_name(DType dtype);  // safetensors spelling: "F32", "BF16", "F8_E4M3", ...
size_t dtype_size(DType dtype);

struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::span<const std::byte> data;  // into the mmapped file; valid while the Checkpoint lives
  std::string file;                 // file name (within the checkpoint directory) holding it
  int64_t num_elements() const;
};

// A read-only, mmapped checkpoint. Validation at open time (each failure names the file, and the
// tensor where there is one): header length beyond the file or over 100 MB, header not JSON / not an
// object, unknown dtype, shape not a list of non-negative ints, offsets not [begin, end] with
// begin <= end, data beyond the file, dtype-size × elements != end - begin, overlapping tensors,
// holes in the data section; with an index: tensors listed in the index but absent from their shard,
// tensors in a shard but not in the index, shard files missing, a tensor in two shards.
class Checkpoint {
 public:
  // `path`: a directory holding model.safetensors.index.json (+ shards) or model.safetensors,
  // or a single .safetensors file.
  static Result<std::unique_ptr<Checkpoint>> open(const std::filesystem::path& path);
  ~Checkpoint();
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  const TensorView* find(const std::string& name) const;
  std::vector<std::string> names() const;  // sorted
  const std::filesystem::path& directory() const { return directory_; }

  // Reads tensor `name` as fp32, checking its shape equals `expected_shape` (error names the tensor,
  // expected and found shapes). BF16/F16/F32 convert; F8_E4M3 is dequantised with the companion
  // `<name minus .weight>.weight_scale_inv` tensor (F32/BF16, shape [ceil(rows/128), ceil(cols/128)],
  // each scale multiplies its 128×128 block). Marks the tensor (and its scale) as used.
  Result<std::vector<float>> read_f32(const std::string& name, std::span<const int64_t> expected_shape) const;
  // Like read_f32 but an absent tensor gives std::nullopt-like empty vector with ok status? No: returns
  // NotFound; callers check `find` first for optional tensors.

  // Names never passed to read_f32 (and not their scales), excluding names starting with any of
  // `ignored_prefixes` (e.g. vision tower tensors). The loader reports them as unexpected tensors.
  std::vector<std::string> unused_tensors(std::span<const std::string> ignored_prefixes) const;

 private:
  Checkpoint() = default;
  struct MappedFile;
  std::filesystem::path directory_;
  std::vector<std::unique_ptr<MappedFile>> files_;
  std::map<std::string, TensorView> tensors_;
  mutable std::map<std::string, bool> used_;
};

// bf16/fp16/fp8 conversions (round-to-nearest-even on the way down; fp8 e4m3fn saturates to ±448).
uint16_t float_to_bf16(float x);
float bf16_to_float(uint16_t x);
uint16_t float_to_f16(float x);
float f16_to_float(uint16_t x);
uint8_t float_to_f8e4m3(float x);
float f8e4m3_to_float(uint8_t x);

// Writes checkpoints in the real format: tensors are added as fp32 and stored in the chosen dtype.
class SafetensorsWriter {
 public:
  // Adds `name` with `shape` from fp32 `values` stored as `dtype` (F32, BF16, F16). For F8_E4M3, adds
  // the quantised weight plus `<prefix>.weight_scale_inv` with 128×128 block scales (2-D tensors only).
  Status add(const std::string& name, std::vector<int64_t> shape, std::span<const float> values, DType dtype);
  // Raw bytes as given (tests use it to write odd dtypes).
  Status add_raw(const std::string& name, DType dtype, std::vector<int64_t> shape, std::vector<std::byte> bytes);

  // Writes one `model.safetensors` when max_shard_bytes == 0, else shards
  // `model-0000i-of-0000n.safetensors` of at most max_shard_bytes each (a tensor is never split) plus
  // `model.safetensors.index.json` {"metadata": {"total_size": N}, "weight_map": {name: file}}.
  // Tensors are written in name order; the output is byte-for-byte deterministic.
  Status write(const std::filesystem::path& directory, uint64_t max_shard_bytes = 0) const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<std::byte> bytes;
  };
  std::map<std::string, Entry> entries_;
};

}  // namespace deltaserve::engine
