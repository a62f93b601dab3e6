// Safetensors checkpoints: reading (mmap, one file or shards + model.safetensors.index.json),
// validation, dequantisation to fp32, and writing (for `deltaserve make-model` and tests).
//
// File format: 8-byte little-endian header length N, N bytes of JSON header
// {"__metadata__": {"k": "v", ...}, "name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...},
// then the data section; offsets are relative to the start of the data section, half-open, and the
// tensors tile the data section exactly (no overlap, no hole). Data need not be aligned.
// Index: model.safetensors.index.json = {"metadata": {...}, "weight_map": {"tensor name": "shard file"}}.
//
// FP8 weights (F8_E4M3 = OCP E4M3FN: bias 7, no infinities, NaN = 0x7F/0xFF, max ±448) come with a
// companion `<name>_scale_inv` tensor (for "x.weight": "x.weight_scale_inv") of 128×128 block scales:
// w[i][j] = fp8(q[i][j]) × scale_inv[i / 128][j / 128].
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.hpp"

namespace deltaserve::engine {

enum class DType { kF32, kF16, kBF16, kF8E4M3, kU8, kI8, kI32, kI64, kF64, kBool };

const char* dtype_name(DType dtype);                          // safetensors spelling: "F32", "BF16", "F8_E4M3", ...
size_t dtype_size(DType dtype);                               // bytes per element
std::optional<DType> dtype_from_name(std::string_view name);  // inverse of dtype_name; nullopt if unknown

inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // larger header lengths are rejected as corrupt
inline constexpr int64_t kFp8BlockSize = 128;             // fp8 scales cover 128×128 blocks
inline constexpr float kF8E4M3Max = 448.0f;               // largest finite e4m3fn magnitude

// "x.weight" -> "x.weight_scale_inv": the block-scale tensor of an F8_E4M3 weight.
std::string fp8_scale_name(std::string_view weight_name);

struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::span<const std::byte> data;  // into the mmapped file, unaligned; valid while the Checkpoint lives
  std::string file;                 // file name (within the checkpoint directory) holding it
  int64_t num_elements() const;
};

// A read-only, mmapped checkpoint. Every file is validated completely at open time; each failure is a
// kDataLoss (kNotFound for a path with no checkpoint, kIoError when the OS refuses) naming the file,
// and the tensor where there is one:
// file shorter than 8 bytes, header length beyond the file or over kMaxHeaderBytes, header not JSON /
// not an object, entry not an object, unknown dtype, shape not a list of non-negative ints, offsets not
// [begin, end] with 0 <= begin <= end, data beyond the file, dtype-size × elements != end - begin,
// overlapping tensors, holes in the data section (including before the first / after the last tensor);
// with an index: shard files missing, shard names that are not plain file names, tensors listed in the
// index but absent from their shard, tensors in a shard but not in the index, a tensor in two shards.
// Tensor values are not inspected at open; read_f32 checks what depends on them (NaN in norms).
//
// Thread safety: const methods may be called concurrently.
class Checkpoint {
 public:
  // `path`: a directory holding model.safetensors.index.json (+ shards) or model.safetensors,
  // a single .safetensors file, or an index .json file (shards beside it).
  static Result<std::unique_ptr<Checkpoint>> open(const std::filesystem::path& path);
  ~Checkpoint();
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  const TensorView* find(const std::string& name) const;  // nullptr when absent
  std::vector<std::string> names() const;                 // sorted
  const std::filesystem::path& directory() const { return directory_; }

  // Reads tensor `name` as fp32 (row-major), checking its shape equals `expected_shape` (error names
  // the tensor, expected and found shapes). F32/F64/BF16/F16 convert; F8_E4M3 (2-D only) is
  // dequantised with its fp8_scale_name tensor (F32/BF16/F16, shape [ceil(rows/128), ceil(cols/128)]).
  // Tensors whose name ends in "norm.weight" are rejected (kDataLoss) if they hold NaN or Inf.
  // An absent tensor is kNotFound: callers check `find` first for optional tensors.
  // On success marks the tensor (and its scale) as used.
  Result<std::vector<float>> read_f32(const std::string& name, std::span<const int64_t> expected_shape) const;

  // Names never passed to read_f32 (and not their scales), sorted, excluding names starting with any
  // of `ignored_prefixes` (e.g. vision tower tensors). The loader reports them as unexpected tensors.
  std::vector<std::string> unused_tensors(std::span<const std::string> ignored_prefixes) const;

 private:
  Checkpoint() = default;
  struct MappedFile;
  Status load(const std::filesystem::path& path);  // open() minus the "checkpoint <path>" context
  Status add_file(const std::string& file_name);   // maps, validates and indexes one safetensors file
  Status check_index(const std::string& index_name, const std::map<std::string, std::string>& weight_map) const;

  std::filesystem::path directory_;
  std::vector<std::unique_ptr<MappedFile>> files_;  // owns the mappings every TensorView::data points into
  std::map<std::string, TensorView> tensors_;
  mutable std::mutex used_mutex_;
  mutable std::set<std::string> used_;  // guarded by used_mutex_
};

// bf16/fp16/fp8 conversions. Down-conversions round to nearest, ties to even, with subnormals; NaN
// stays NaN (sign kept, quiet), ±Inf stays ±Inf for bf16/f16 (finite values past the largest finite
// round to Inf as IEEE does). e4m3fn has no Inf: values past ±448 and ±Inf saturate to ±448.
uint16_t float_to_bf16(float x);
float bf16_to_float(uint16_t x);
uint16_t float_to_f16(float x);
float f16_to_float(uint16_t x);
uint8_t float_to_f8e4m3(float x);
float f8e4m3_to_float(uint8_t x);

// Writes checkpoints in the real format: tensors are added as fp32 and stored in the chosen dtype.
class SafetensorsWriter {
 public:
  // Adds `name` with `shape` from fp32 `values` (row-major, product(shape) of them) stored as `dtype`
  // (F32, BF16, F16). For F8_E4M3 (2-D tensors, finite values only), adds the quantised weight plus
  // fp8_scale_name(name) as F32 128×128 block scales: scale_inv = max|w| / 448 over the block (1 for an
  // all-zero block), q = e4m3(w / scale_inv) rounded to nearest even.
  Status add(const std::string& name, std::vector<int64_t> shape, std::span<const float> values, DType dtype);
  // Raw little-endian bytes as given (tests use it to write odd dtypes); size must match dtype × shape.
  Status add_raw(const std::string& name, DType dtype, std::vector<int64_t> shape, std::vector<std::byte> bytes);

  // Writes one `model.safetensors` when max_shard_bytes == 0, else shards
  // `model-0000i-of-0000n.safetensors` of at most max_shard_bytes of data each (a tensor is never
  // split; a tensor larger than the limit gets a shard of its own) plus
  // `model.safetensors.index.json` {"metadata": {"total_size": N}, "weight_map": {name: file}}.
  // Tensors are written in name order; headers are compact JSON padded with spaces to a multiple of 8;
  // the output is byte-for-byte deterministic. Creates `directory`; each file is written to a
  // temporary name and renamed, the index last. A stale file of the other layout (model.safetensors
  // vs. the index) is removed so that Checkpoint::open sees the new one.
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
