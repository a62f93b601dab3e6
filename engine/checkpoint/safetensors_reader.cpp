// Checkpoint: mmap + validation of safetensors files and the shard index, and reads to fp32.
#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <tuple>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/json.hpp"
#include "engine/checkpoint/safetensors.hpp"

namespace deltaserve::engine {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian; reads memcpy it as is");

namespace {

constexpr const char* kIndexFileName = "model.safetensors.index.json";
constexpr const char* kSingleFileName = "model.safetensors";
constexpr size_t kMaxJsonInMessage = 120;  // longer JSON fragments are cut in error messages

std::string shape_string(std::span<const int64_t> shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

std::string json_snippet(const json::Value& value) {
  std::string text = value.dump();
  if (text.size() > kMaxJsonInMessage) text = text.substr(0, kMaxJsonInMessage) + "...";
  return text;
}

// "[begin, end)": a half-open byte range.
std::string offsets_string(uint64_t begin, uint64_t end) {
  std::string out = "[";
  out += std::to_string(begin);
  out += ", ";
  out += std::to_string(end);
  out += ")";
  return out;
}

// A plain file name: no directory part, so an index cannot point outside the checkpoint directory.
bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

}  // namespace

// One read-only private mapping of a whole file. Owned by the Checkpoint; unmapped in the destructor,
// after which every TensorView::data into it dangles. The file descriptor is closed right after mmap.
struct Checkpoint::MappedFile {
  std::string name;  // file name within the checkpoint directory
  const std::byte* base = nullptr;
  size_t size = 0;

  MappedFile() = default;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() {
    if (base != nullptr) munmap(const_cast<std::byte*>(base), size);
  }

  std::span<const std::byte> bytes() const { return {base, size}; }

  static Result<std::unique_ptr<MappedFile>> map(const std::filesystem::path& path, const std::string& name) {
    auto file = std::make_unique<MappedFile>();
    file->name = name;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return io_error(name + ": cannot open " + path.string() + ": " + std::strerror(errno));
    struct stat info {};
    if (::fstat(fd, &info) != 0) {
      const int error = errno;
      ::close(fd);
      return io_error(name + ": cannot stat: " + std::strerror(error));
    }
    if (!S_ISREG(info.st_mode)) {
      ::close(fd);
      return io_error(name + ": not a regular file");
    }
    file->size = static_cast<size_t>(info.st_size);
    if (file->size > 0) {
      void* base = ::mmap(nullptr, file->size, PROT_READ, MAP_PRIVATE, fd, 0);
      if (base == MAP_FAILED) {
        const int error = errno;
        ::close(fd);
        return io_error(name + ": mmap of " + std::to_string(file->size) + " bytes failed: " + std::strerror(error));
      }
      file->base = static_cast<const std::byte*>(base);
    }
    ::close(fd);
    return file;
  }
};

int64_t TensorView::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

// Parses and validates one safetensors file; on success `out` holds its tensors (data into `bytes`).
Status parse_safetensors(const std::string& file_name, std::span<const std::byte> bytes, std::vector<TensorView>& out) {
  auto fail = [&](const std::string& what) { return data_loss(file_name + ": " + what); };
  auto fail_tensor = [&](const std::string& tensor, const std::string& what) {
    return data_loss(file_name + ": tensor '" + tensor + "': " + what);
  };

  if (bytes.size() < 8) {
    return fail("file is " + std::to_string(bytes.size()) +
                " bytes, shorter than the 8-byte header length field (truncated?)");
  }
  uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) header_length = (header_length << 8) | static_cast<uint8_t>(bytes[i]);
  if (header_length > kMaxHeaderBytes) {
    return fail("header length " + std::to_string(header_length) + " is over the limit of " +
                std::to_string(kMaxHeaderBytes) + " bytes (corrupt length field?)");
  }
  if (header_length > bytes.size() - 8) {
    return fail("header length " + std::to_string(header_length) + " runs past the end of the file (" +
                std::to_string(bytes.size() - 8) + " bytes after the length field; truncated?)");
  }
  const std::string_view header_text(reinterpret_cast<const char*>(bytes.data() + 8), header_length);
  auto parsed = json::parse(header_text);
  if (!parsed.is_ok()) return fail("header is not valid JSON: " + parsed.status().message());
  const json::Value& header = parsed.value();
  if (!header.is_object()) return fail("header is not a JSON object (found " + json_snippet(header) + ")");

  const uint64_t data_begin = 8 + header_length;
  const uint64_t data_size = bytes.size() - data_begin;
  std::vector<TensorView> tensors;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // parallel to `tensors`: [begin, end) in the data section
  for (const auto& [name, entry] : header.as_object()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return fail("'__metadata__' is not an object");
      for (const auto& [key, value] : entry.as_object()) {
        if (!value.is_string()) return fail("'__metadata__' value for key '" + key + "' is not a string");
      }
      continue;
    }
    if (!entry.is_object()) return fail_tensor(name, "entry is not an object (found " + json_snippet(entry) + ")");

    const json::Value* dtype_value = entry.find("dtype");
    if (dtype_value == nullptr || !dtype_value->is_string()) return fail_tensor(name, "missing or non-string 'dtype'");
    const std::optional<DType> dtype = dtype_from_name(dtype_value->as_string());
    if (!dtype) return fail_tensor(name, "unknown dtype '" + dtype_value->as_string() + "'");

    const json::Value* shape_value = entry.find("shape");
    if (shape_value == nullptr) return fail_tensor(name, "missing 'shape'");
    std::vector<int64_t> shape;
    bool shape_ok = shape_value->is_array();
    if (shape_ok) {
      for (const json::Value& dim : shape_value->as_array()) {
        if (!dim.is_int() || dim.as_int() < 0) {
          shape_ok = false;
          break;
        }
        shape.push_back(dim.as_int());
      }
    }
    if (!shape_ok) {
      return fail_tensor(name, "shape must be a list of non-negative integers, found " + json_snippet(*shape_value));
    }

    const json::Value* offsets_value = entry.find("data_offsets");
    if (offsets_value == nullptr) return fail_tensor(name, "missing 'data_offsets'");
    const bool offsets_ok = offsets_value->is_array() && offsets_value->size() == 2 &&
                            offsets_value->as_array()[0].is_int() && offsets_value->as_array()[1].is_int() &&
                            offsets_value->as_array()[0].as_int() >= 0 &&
                            offsets_value->as_array()[0].as_int() <= offsets_value->as_array()[1].as_int();
    if (!offsets_ok) {
      return fail_tensor(
          name, "data_offsets must be [begin, end] with 0 <= begin <= end, found " + json_snippet(*offsets_value));
    }
    const auto begin = static_cast<uint64_t>(offsets_value->as_array()[0].as_int());
    const auto end = static_cast<uint64_t>(offsets_value->as_array()[1].as_int());
    if (end > data_size) {
      return fail_tensor(name, "data_offsets " + offsets_string(begin, end) +
                                   " run past the end of the data section (" + std::to_string(data_size) +
                                   " bytes; truncated file?)");
    }

    uint64_t expected_bytes = dtype_size(*dtype);
    for (int64_t dim : shape) {
      if (__builtin_mul_overflow(expected_bytes, static_cast<uint64_t>(dim), &expected_bytes)) {
        return fail_tensor(name, "dtype " + std::string(dtype_name(*dtype)) + " × shape " + shape_string(shape) +
                                     " overflows 64 bits");
      }
    }
    if (expected_bytes != end - begin) {
      return fail_tensor(name, "dtype " + std::string(dtype_name(*dtype)) + " × shape " + shape_string(shape) + " = " +
                                   std::to_string(expected_bytes) + " bytes but data_offsets span " +
                                   std::to_string(end - begin));
    }

    TensorView view;
    view.name = name;
    view.dtype = *dtype;
    view.shape = std::move(shape);
    view.data = bytes.subspan(data_begin + begin, end - begin);
    view.file = file_name;
    tensors.push_back(std::move(view));
    ranges.emplace_back(begin, end);
  }

  // The tensors must tile [0, data_size) exactly: sorted by offsets, each begins where the last ended.
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::tie(ranges[a], tensors[a].name) < std::tie(ranges[b], tensors[b].name);
  });
  uint64_t previous_end = 0;
  const TensorView* previous = nullptr;
  uint64_t previous_begin = 0;
  for (size_t index : order) {
    const auto [begin, end] = ranges[index];
    const TensorView& tensor = tensors[index];
    if (previous != nullptr && begin < previous_end) {
      return fail("tensors '" + previous->name + "' " + offsets_string(previous_begin, previous_end) + " and '" +
                  tensor.name + "' " + offsets_string(begin, end) + " overlap");
    }
    if (begin > previous_end) {
      if (previous == nullptr) {
        return fail("hole in the data section: bytes " + offsets_string(0, begin) + " before the first tensor '" +
                    tensor.name + "' belong to no tensor");
      }
      return fail("hole in the data section: bytes " + offsets_string(previous_end, begin) + " between tensors '" +
                  previous->name + "' and '" + tensor.name + "' belong to no tensor");
    }
    previous_begin = begin;
    previous_end = end;
    previous = &tensor;
  }
  if (previous_end != data_size) {
    return fail("hole in the data section: " + std::to_string(data_size - previous_end) +
                " trailing bytes after the last tensor" + (previous ? " '" + previous->name + "'" : std::string()) +
                " belong to no tensor");
  }
  out = std::move(tensors);
  return Status::ok();
}

// Reads the raw little-endian elements of a F32/F64/BF16/F16 tensor into fp32.
Result<std::vector<float>> decode_float_tensor(const TensorView& view) {
  const size_t count = static_cast<size_t>(view.num_elements());
  std::vector<float> out(count);
  const std::byte* data = view.data.data();
  switch (view.dtype) {
    case DType::kF32:
      if (count > 0) std::memcpy(out.data(), data, count * sizeof(float));
      break;
    case DType::kF64:
      for (size_t i = 0; i < count; ++i) {
        double value;
        std::memcpy(&value, data + i * sizeof(double), sizeof(double));
        out[i] = static_cast<float>(value);
      }
      break;
    case DType::kBF16:
    case DType::kF16: {
      const bool is_bf16 = view.dtype == DType::kBF16;
      for (size_t i = 0; i < count; ++i) {
        uint16_t code;
        std::memcpy(&code, data + i * sizeof(uint16_t), sizeof(uint16_t));
        out[i] = is_bf16 ? bf16_to_float(code) : f16_to_float(code);
      }
      break;
    }
    default:
      return invalid_argument(view.file + ": tensor '" + view.name + "': dtype " + dtype_name(view.dtype) +
                              " cannot be read as fp32");
  }
  return out;
}

const std::array<float, 256>& f8e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> values{};
    for (int code = 0; code < 256; ++code) values[code] = f8e4m3_to_float(static_cast<uint8_t>(code));
    return values;
  }();
  return table;
}

}  // namespace

Checkpoint::~Checkpoint() = default;

Status Checkpoint::add_file(const std::string& file_name) {
  DS_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> file, MappedFile::map(directory_ / file_name, file_name));
  std::vector<TensorView> views;
  DS_RETURN_IF_ERROR(parse_safetensors(file_name, file->bytes(), views));
  for (TensorView& view : views) {
    auto existing = tensors_.find(view.name);
    if (existing != tensors_.end()) {
      return data_loss("tensor '" + view.name + "' appears in two shards: '" + existing->second.file + "' and '" +
                       file_name + "'");
    }
    std::string name = view.name;
    tensors_.emplace(std::move(name), std::move(view));
  }
  files_.push_back(std::move(file));
  return Status::ok();
}

Status Checkpoint::check_index(const std::string& index_name,
                               const std::map<std::string, std::string>& weight_map) const {
  for (const auto& [name, view] : tensors_) {
    auto listed = weight_map.find(name);
    if (listed == weight_map.end()) {
      return data_loss(view.file + ": tensor '" + name + "' is in the shard but not in " + index_name);
    }
    if (listed->second != view.file) {
      return data_loss(view.file + ": tensor '" + name + "' is in this shard but " + index_name + " maps it to '" +
                       listed->second + "'");
    }
  }
  for (const auto& [name, shard] : weight_map) {
    if (!tensors_.contains(name)) {
      return data_loss(index_name + ": tensor '" + name + "' is listed in shard '" + shard + "' but absent from it");
    }
  }
  return Status::ok();
}

Result<std::unique_ptr<Checkpoint>> Checkpoint::open(const std::filesystem::path& path) {
  std::unique_ptr<Checkpoint> checkpoint(new Checkpoint());
  DS_RETURN_IF_ERROR_CTX(checkpoint->load(path), "checkpoint " + path.string());
  return checkpoint;
}

Status Checkpoint::load(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::error_code error;
  std::string index_name;
  std::string single_name;
  if (fs::is_directory(path, error)) {
    directory_ = path;
    if (fs::exists(path / kIndexFileName, error)) {
      index_name = kIndexFileName;
    } else if (fs::exists(path / kSingleFileName, error)) {
      single_name = kSingleFileName;
    } else {
      return not_found(std::string("neither ") + kIndexFileName + " nor " + kSingleFileName + " found");
    }
  } else if (fs::exists(path, error)) {
    directory_ = path.has_parent_path() ? path.parent_path() : fs::path(".");
    (path.extension() == ".json" ? index_name : single_name) = path.filename().string();
  } else {
    return not_found("no such file or directory");
  }
  if (!single_name.empty()) return add_file(single_name);

  // Sharded: the index names every tensor's shard.
  std::map<std::string, std::string> weight_map;  // tensor -> shard file
  {
    DS_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> index_file, MappedFile::map(directory_ / index_name, index_name));
    if (index_file->size > kMaxHeaderBytes) {
      return data_loss(index_name + ": over " + std::to_string(kMaxHeaderBytes) + " bytes");
    }
    const std::string_view text(reinterpret_cast<const char*>(index_file->base), index_file->size);
    auto parsed = json::parse(text);
    if (!parsed.is_ok()) return data_loss(index_name + ": not valid JSON: " + parsed.status().message());
    const json::Value* map_value = parsed->find("weight_map");
    if (map_value == nullptr || !map_value->is_object()) {
      return data_loss(index_name + ": missing 'weight_map' object");
    }
    for (const auto& [name, shard] : map_value->as_object()) {
      if (!shard.is_string() || !is_plain_file_name(shard.as_string())) {
        return data_loss(index_name + ": tensor '" + name + "': shard must be a plain file name, found " +
                         json_snippet(shard));
      }
      weight_map.emplace(name, shard.as_string());
    }
  }
  std::map<std::string, std::string> shards;  // shard file -> first tensor listed in it
  for (const auto& [name, shard] : weight_map) shards.emplace(shard, name);
  for (const auto& [shard, first_tensor] : shards) {
    if (!fs::is_regular_file(directory_ / shard, error)) {
      return data_loss(index_name + ": shard file '" + shard + "' is missing (it should hold tensor '" + first_tensor +
                       "')");
    }
    DS_RETURN_IF_ERROR(add_file(shard));
  }
  return check_index(index_name, weight_map);
}

const TensorView* Checkpoint::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, view] : tensors_) out.push_back(name);
  return out;
}

Result<std::vector<float>> Checkpoint::read_f32(const std::string& name,
                                                std::span<const int64_t> expected_shape) const {
  const TensorView* view = find(name);
  if (view == nullptr) return not_found("tensor '" + name + "' not found in checkpoint " + directory_.string());
  const std::string where = view->file + ": tensor '" + name + "'";
  if (!std::equal(view->shape.begin(), view->shape.end(), expected_shape.begin(), expected_shape.end())) {
    return invalid_argument(where + ": expected shape " + shape_string(expected_shape) + " but found " +
                            shape_string(view->shape));
  }

  std::vector<float> out;
  std::string scale_name;
  if (view->dtype == DType::kF8E4M3) {
    if (view->shape.size() != 2) {
      return invalid_argument(where + ": F8_E4M3 weights must be 2-D to dequantise, found shape " +
                              shape_string(view->shape));
    }
    scale_name = fp8_scale_name(name);
    const TensorView* scale = find(scale_name);
    if (scale == nullptr) return data_loss(where + ": F8_E4M3 weight without its scale tensor '" + scale_name + "'");
    const int64_t rows = view->shape[0];
    const int64_t cols = view->shape[1];
    const int64_t scale_rows = (rows + kFp8BlockSize - 1) / kFp8BlockSize;
    const int64_t scale_cols = (cols + kFp8BlockSize - 1) / kFp8BlockSize;
    const std::vector<int64_t> expected_scale_shape = {scale_rows, scale_cols};
    if (scale->shape != expected_scale_shape) {
      return data_loss(scale->file + ": tensor '" + scale_name + "': scale shape " + shape_string(scale->shape) +
                       " does not match weight '" + name + "' " + shape_string(view->shape) + ": expected " +
                       shape_string(expected_scale_shape) + " (one scale per 128×128 block)");
    }
    auto scales = decode_float_tensor(*scale);
    if (!scales.is_ok()) return scales.status();
    for (size_t i = 0; i < scales->size(); ++i) {
      if (!std::isfinite((*scales)[i])) {
        return data_loss(scale->file + ": tensor '" + scale_name + "': non-finite scale at block " + std::to_string(i));
      }
    }
    const std::array<float, 256>& table = f8e4m3_table();
    out.resize(static_cast<size_t>(rows * cols));
    const auto* codes = reinterpret_cast<const uint8_t*>(view->data.data());
    for (int64_t i = 0; i < rows; ++i) {
      const float* scale_row = scales->data() + (i / kFp8BlockSize) * scale_cols;
      for (int64_t j = 0; j < cols; ++j) {
        out[i * cols + j] = table[codes[i * cols + j]] * scale_row[j / kFp8BlockSize];
      }
    }
  } else {
    auto decoded = decode_float_tensor(*view);
    if (!decoded.is_ok()) return decoded.status();
    out = std::move(decoded).value();
  }

  if (name.ends_with("norm.weight")) {
    for (size_t i = 0; i < out.size(); ++i) {
      if (!std::isfinite(out[i])) {
        return data_loss(where + ": " + (std::isnan(out[i]) ? "NaN" : "Inf") + " in a norm weight (element " +
                         std::to_string(i) + ")");
      }
    }
  }

  std::lock_guard<std::mutex> lock(used_mutex_);
  used_.insert(name);
  if (!scale_name.empty()) used_.insert(scale_name);
  return out;
}

std::vector<std::string> Checkpoint::unused_tensors(std::span<const std::string> ignored_prefixes) const {
  std::lock_guard<std::mutex> lock(used_mutex_);
  std::vector<std::string> out;
  for (const auto& [name, view] : tensors_) {
    if (used_.contains(name)) continue;
    const bool ignored = std::any_of(ignored_prefixes.begin(), ignored_prefixes.end(),
                                     [&](const std::string& prefix) { return name.starts_with(prefix); });
    if (!ignored) out.push_back(name);
  }
  return out;
}

}  // namespace deltaserve::engine
