#include "engine/checkpoint/safetensors.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <unistd.h>

#include "common/json.hpp"
#include "common/temp_dir.hpp"

namespace deltaserve::engine {
namespace {

namespace fs = std::filesystem;

// ---- helpers -------------------------------------------------------------------------------------

std::vector<char> read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string read_text(const fs::path& path) {
  std::vector<char> bytes = read_bytes(path);
  return {bytes.begin(), bytes.end()};
}

void write_text(const fs::path& path, const std::string& text) {
  write_bytes(path, {text.begin(), text.end()});
}

uint64_t header_length_of(const std::vector<char>& file) {
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | static_cast<uint8_t>(file[i]);
  return length;
}

void set_header_length(std::vector<char>& file, uint64_t length) {
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((length >> (8 * i)) & 0xFF);
}

// 8-byte length + `header` (unpadded) + `data`.
std::vector<char> assemble(const std::string& header, std::span<const char> data) {
  std::vector<char> file(8);
  set_header_length(file, header.size());
  file.insert(file.end(), header.begin(), header.end());
  file.insert(file.end(), data.begin(), data.end());
  return file;
}

// Rewrites the header of the safetensors file at `path` through `edit`; the data section is kept.
void edit_header(const fs::path& path, const std::function<void(json::Value&)>& edit) {
  std::vector<char> file = read_bytes(path);
  const uint64_t length = header_length_of(file);
  auto header = json::parse(std::string_view(file.data() + 8, length));
  ASSERT_TRUE(header.is_ok()) << header.status().to_string();
  edit(header.value());
  write_bytes(path, assemble(header->dump(), std::span(file).subspan(8 + length)));
}

// Replaces the text of the header, keeping the data section.
void replace_header(const fs::path& path, const std::string& header) {
  std::vector<char> file = read_bytes(path);
  write_bytes(path, assemble(header, std::span(file).subspan(8 + header_length_of(file))));
}

// Overwrites bytes of `tensor`'s data at byte `offset` within it.
void patch_tensor(const fs::path& path, const std::string& tensor, size_t offset, std::span<const char> bytes) {
  std::vector<char> file = read_bytes(path);
  const uint64_t length = header_length_of(file);
  auto header = json::parse(std::string_view(file.data() + 8, length));
  ASSERT_TRUE(header.is_ok());
  const json::Value* entry = header->find(tensor);
  ASSERT_NE(entry, nullptr) << tensor;
  const size_t begin = 8 + length + static_cast<size_t>(entry->find("data_offsets")->as_array()[0].as_int()) + offset;
  std::copy(bytes.begin(), bytes.end(), file.begin() + static_cast<std::ptrdiff_t>(begin));
  write_bytes(path, file);
}

void erase_key(json::Value& object, const std::string& key) {
  auto& members = object.as_object();
  members.erase(std::remove_if(members.begin(), members.end(), [&](const auto& member) { return member.first == key; }),
                members.end());
}

std::vector<float> random_values(size_t count, uint32_t seed, float magnitude = 2.0f) {
  std::mt19937 generator(seed);
  std::uniform_real_distribution<float> distribution(-magnitude, magnitude);
  std::vector<float> values(count);
  for (float& value : values) value = distribution(generator);
  return values;
}

std::vector<std::byte> to_bytes(const std::vector<uint8_t>& values) {
  std::vector<std::byte> bytes(values.size());
  std::memcpy(bytes.data(), values.data(), values.size());
  return bytes;
}

template <class T>
std::vector<std::byte> to_bytes(const std::vector<T>& values) {
  std::vector<std::byte> bytes(values.size() * sizeof(T));
  if (!bytes.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

bool same_bits(float a, float b) {
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}

// The e4m3 quantisation bound of one element: half a step at its magnitude (relative 2^-4 for
// normals, absolute 2^-10 × scale in the subnormal range), plus float rounding slack.
float fp8_error_bound(float value, float scale) {
  return std::max(std::fabs(value) * 0x1p-4f, scale * 0x1p-10f) * (1.0f + 1e-5f) + 1e-30f;
}

// ---- write -> read -------------------------------------------------------------------------------

// Every dtype, incl. empty and scalar tensors; returns what add() was given, by name.
struct Sample {
  std::vector<int64_t> shape;
  std::vector<float> values;
  DType dtype;
};

std::map<std::string, Sample> add_float_samples(SafetensorsWriter& writer) {
  std::map<std::string, Sample> samples = {
      {"a.f32", {{3, 5}, random_values(15, 1), DType::kF32}},
      {"b.bf16", {{7, 3}, random_values(21, 2), DType::kBF16}},
      {"c.f16", {{2, 2, 5}, random_values(20, 3), DType::kF16}},
      {"d.fp8.weight", {{130, 5}, random_values(650, 4), DType::kF8E4M3}},
      {"e.empty", {{0, 4}, {}, DType::kBF16}},
      {"f.scalar", {{}, {3.25f}, DType::kF32}},
  };
  samples["a.f32"].values[0] = std::numeric_limits<float>::denorm_min();
  samples["a.f32"].values[1] = -0.0f;
  for (auto& [name, sample] : samples) {
    EXPECT_TRUE(writer.add(name, sample.shape, sample.values, sample.dtype).is_ok()) << name;
  }
  return samples;
}

void expect_samples(const Checkpoint& checkpoint, const std::map<std::string, Sample>& samples) {
  for (const auto& [name, sample] : samples) {
    SCOPED_TRACE(name);
    const TensorView* view = checkpoint.find(name);
    ASSERT_NE(view, nullptr);
    EXPECT_EQ(view->dtype, sample.dtype);
    EXPECT_EQ(view->shape, sample.shape);
    auto read = checkpoint.read_f32(name, sample.shape);
    ASSERT_TRUE(read.is_ok()) << read.status().to_string();
    ASSERT_EQ(read->size(), sample.values.size());
    for (size_t i = 0; i < sample.values.size(); ++i) {
      const float written = sample.values[i];
      const float got = (*read)[i];
      switch (sample.dtype) {
        case DType::kF32:
          ASSERT_TRUE(same_bits(got, written)) << i;
          break;
        case DType::kBF16:
          ASSERT_TRUE(same_bits(got, bf16_to_float(float_to_bf16(written)))) << i;
          break;
        case DType::kF16:
          ASSERT_TRUE(same_bits(got, f16_to_float(float_to_f16(written)))) << i;
          break;
        default: {
          const float scale =
              checkpoint.read_f32(fp8_scale_name(name), std::vector<int64_t>{2, 1}).value()[i / sample.shape[1] / 128];
          ASSERT_LE(std::fabs(got - written), fp8_error_bound(written, scale)) << i;
        }
      }
    }
  }
}

TEST(SafetensorsRoundTrip, SingleFileEveryDtype) {
  TempDir dir;
  SafetensorsWriter writer;
  const auto samples = add_float_samples(writer);
  const std::vector<uint8_t> u8 = {0, 1, 255, 7};
  const std::vector<int8_t> i8 = {-128, 0, 127};
  const std::vector<int32_t> i32 = {-5, 1 << 30, 0};
  const std::vector<int64_t> i64 = {int64_t{1} << 40, -1};
  const std::vector<double> f64 = {1.0 / 3.0, -2.5, 1e300};
  const std::vector<uint8_t> booleans = {1, 0, 1};
  ASSERT_TRUE(writer.add_raw("raw.u8", DType::kU8, {2, 2}, to_bytes(u8)).is_ok());
  ASSERT_TRUE(writer.add_raw("raw.i8", DType::kI8, {3}, to_bytes(i8)).is_ok());
  ASSERT_TRUE(writer.add_raw("raw.i32", DType::kI32, {3}, to_bytes(i32)).is_ok());
  ASSERT_TRUE(writer.add_raw("raw.i64", DType::kI64, {2}, to_bytes(i64)).is_ok());
  ASSERT_TRUE(writer.add_raw("raw.f64", DType::kF64, {3}, to_bytes(f64)).is_ok());
  ASSERT_TRUE(writer.add_raw("raw.bool", DType::kBool, {3}, to_bytes(booleans)).is_ok());
  ASSERT_TRUE(writer.write(dir.path()).is_ok());
  ASSERT_TRUE(fs::exists(dir.path() / "model.safetensors"));
  ASSERT_FALSE(fs::exists(dir.path() / "model.safetensors.index.json"));

  // Through the directory and through the file itself.
  for (const fs::path& path : {dir.path(), dir.path() / "model.safetensors"}) {
    auto checkpoint = Checkpoint::open(path);
    ASSERT_TRUE(checkpoint.is_ok()) << checkpoint.status().to_string();
    expect_samples(**checkpoint, samples);
    const std::vector<std::string> names = (*checkpoint)->names();
    EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
    EXPECT_EQ(names.size(), samples.size() + 1 /* fp8 scale */ + 6 /* raw */);

    auto expect_raw = [&](const std::string& name, DType dtype, const std::vector<std::byte>& bytes) {
      const TensorView* view = (*checkpoint)->find(name);
      ASSERT_NE(view, nullptr) << name;
      EXPECT_EQ(view->dtype, dtype) << name;
      EXPECT_EQ(view->file, "model.safetensors");
      ASSERT_EQ(view->data.size(), bytes.size()) << name;
      EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), view->data.begin())) << name;
    };
    expect_raw("raw.u8", DType::kU8, to_bytes(u8));
    expect_raw("raw.i8", DType::kI8, to_bytes(i8));
    expect_raw("raw.i32", DType::kI32, to_bytes(i32));
    expect_raw("raw.i64", DType::kI64, to_bytes(i64));
    expect_raw("raw.f64", DType::kF64, to_bytes(f64));
    expect_raw("raw.bool", DType::kBool, to_bytes(booleans));
    auto f64_read = (*checkpoint)->read_f32("raw.f64", std::vector<int64_t>{3});
    ASSERT_TRUE(f64_read.is_ok());
    EXPECT_EQ((*f64_read)[0], static_cast<float>(f64[0]));
    EXPECT_TRUE(std::isinf((*f64_read)[2]));
    auto i32_read = (*checkpoint)->read_f32("raw.i32", std::vector<int64_t>{3});
    ASSERT_FALSE(i32_read.is_ok());
    EXPECT_NE(i32_read.status().message().find("dtype I32 cannot be read as fp32"), std::string::npos);
  }
}

TEST(SafetensorsRoundTrip, ShardedSeveralShardSizes) {
  SafetensorsWriter writer;
  const auto samples = add_float_samples(writer);
  // Data bytes in name order: a 60, b 42, c 40, d 650, d scale 8, e 0, f 4 = 804 in all.
  for (const auto& [max_shard_bytes, expected_shards] :
       std::vector<std::pair<uint64_t, int>>{{1, 7}, {64, 5}, {100, 4}, {700, 2}, {1000, 1}, {uint64_t{1} << 40, 1}}) {
    SCOPED_TRACE("max_shard_bytes " + std::to_string(max_shard_bytes));
    TempDir dir;
    ASSERT_TRUE(writer.write(dir.path(), max_shard_bytes).is_ok());
    ASSERT_FALSE(fs::exists(dir.path() / "model.safetensors"));
    int shard_files = 0;
    for (const auto& entry : fs::directory_iterator(dir.path())) {
      if (entry.path().extension() == ".safetensors") {
        ++shard_files;
        const std::string suffix = "-of-" + std::string(5 - std::to_string(expected_shards).size(), '0') +
                                   std::to_string(expected_shards) + ".safetensors";
        EXPECT_TRUE(entry.path().filename().string().ends_with(suffix)) << entry.path();
        if (max_shard_bytes > 1) {
          const uint64_t data_bytes = fs::file_size(entry.path()) - 8 - header_length_of(read_bytes(entry.path()));
          EXPECT_TRUE(data_bytes <= max_shard_bytes || data_bytes == 650) << entry.path();
        }
      }
    }
    EXPECT_EQ(shard_files, expected_shards);
    auto index = json::parse(read_text(dir.path() / "model.safetensors.index.json"));
    ASSERT_TRUE(index.is_ok());
    EXPECT_EQ(index->find("metadata")->find("total_size")->as_int(), 804);
    EXPECT_EQ(index->find("weight_map")->size(), samples.size() + 1);

    auto checkpoint = Checkpoint::open(dir.path());
    ASSERT_TRUE(checkpoint.is_ok()) << checkpoint.status().to_string();
    expect_samples(**checkpoint, samples);
    auto via_index = Checkpoint::open(dir.path() / "model.safetensors.index.json");
    ASSERT_TRUE(via_index.is_ok()) << via_index.status().to_string();
    EXPECT_EQ((*via_index)->names(), (*checkpoint)->names());
  }
}

TEST(SafetensorsRoundTrip, OutputIsDeterministicAndPadded) {
  SafetensorsWriter writer;
  (void)add_float_samples(writer);
  TempDir first, second;
  ASSERT_TRUE(writer.write(first.path()).is_ok());
  ASSERT_TRUE(writer.write(second.path()).is_ok());
  const std::vector<char> bytes = read_bytes(first.path() / "model.safetensors");
  EXPECT_EQ(bytes, read_bytes(second.path() / "model.safetensors"));
  const uint64_t length = header_length_of(bytes);
  EXPECT_EQ(length % 8, 0u);
  const std::string header(bytes.data() + 8, length);
  EXPECT_TRUE(header.starts_with(R"({"__metadata__":{"format":"pt"},"a.f32":{"dtype":"F32","shape":[3,5],)"
                                 R"("data_offsets":[0,60]},"b.bf16":)"))
      << header;
  const std::string trimmed = header.substr(0, header.find_last_not_of(' ') + 1);
  EXPECT_EQ(trimmed.back(), '}');
  EXPECT_LT(header.size() - trimmed.size(), 8u);

  ASSERT_TRUE(writer.write(first.path(), 100).is_ok());  // switching layout drops the single file
  ASSERT_TRUE(writer.write(second.path(), 100).is_ok());
  EXPECT_FALSE(fs::exists(first.path() / "model.safetensors"));
  for (const char* name : {"model.safetensors.index.json", "model-00001-of-00004.safetensors"}) {
    EXPECT_EQ(read_bytes(first.path() / name), read_bytes(second.path() / name)) << name;
  }
}

TEST(SafetensorsRoundTrip, Fp8DequantPartialBlocks) {
  constexpr int64_t kRows = 300, kCols = 260;  // 3 × 3 blocks, the last row/column of blocks partial
  std::vector<float> values = random_values(kRows * kCols, 21);
  // A different magnitude per block (incl. tiny values in the subnormal range of the scaled codes),
  // and one all-zero block.
  for (int64_t i = 0; i < kRows; ++i) {
    for (int64_t j = 0; j < kCols; ++j) {
      const int64_t block = (i / 128) * 3 + j / 128;
      values[i * kCols + j] *= std::ldexp(1.0f, static_cast<int>(block) * 3 - 12);
      if (block == 4) values[i * kCols + j] = 0.0f;
    }
  }
  values[5] = 0x1p-26f;  // far below the block's max: lands on e4m3 subnormals
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.add("w.weight", {kRows, kCols}, values, DType::kF8E4M3).is_ok());
  TempDir dir;
  ASSERT_TRUE(writer.write(dir.path()).is_ok());
  auto checkpoint = Checkpoint::open(dir.path());
  ASSERT_TRUE(checkpoint.is_ok()) << checkpoint.status().to_string();
  const TensorView* scale_view = (*checkpoint)->find("w.weight_scale_inv");
  ASSERT_NE(scale_view, nullptr);
  EXPECT_EQ(scale_view->dtype, DType::kF32);
  EXPECT_EQ(scale_view->shape, (std::vector<int64_t>{3, 3}));
  auto scales = (*checkpoint)->read_f32("w.weight_scale_inv", std::vector<int64_t>{3, 3});
  ASSERT_TRUE(scales.is_ok());
  for (int64_t block = 0; block < 9; ++block) {
    float max_abs = 0.0f;
    for (int64_t i = (block / 3) * 128; i < std::min(kRows, (block / 3 + 1) * 128); ++i) {
      for (int64_t j = (block % 3) * 128; j < std::min(kCols, (block % 3 + 1) * 128); ++j) {
        max_abs = std::max(max_abs, std::fabs(values[i * kCols + j]));
      }
    }
    EXPECT_EQ((*scales)[block], block == 4 ? 1.0f : max_abs / 448.0f) << block;
  }
  auto read = (*checkpoint)->read_f32("w.weight", std::vector<int64_t>{kRows, kCols});
  ASSERT_TRUE(read.is_ok()) << read.status().to_string();
  for (int64_t i = 0; i < kRows; ++i) {
    for (int64_t j = 0; j < kCols; ++j) {
      const float scale = (*scales)[(i / 128) * 3 + j / 128];
      const float expected = values[i * kCols + j];
      ASSERT_LE(std::fabs((*read)[i * kCols + j] - expected), fp8_error_bound(expected, scale)) << i << "," << j;
    }
  }
  // The block maximum maps to code ±448 and back to exactly 448 × scale.
  int64_t max_index = 0;
  for (int64_t i = 0; i < 128; ++i) {
    for (int64_t j = 0; j < 128; ++j) {
      if (std::fabs(values[i * kCols + j]) > std::fabs(values[max_index])) max_index = i * kCols + j;
    }
  }
  EXPECT_EQ(std::fabs((*read)[max_index]), 448.0f * (*scales)[0]);
}

TEST(SafetensorsRoundTrip, UnusedTensorsExcludeReadScalesAndIgnoredPrefixes) {
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.add("model.a.weight", {2, 2}, random_values(4, 1), DType::kF8E4M3).is_ok());
  ASSERT_TRUE(writer.add("model.b.weight", {2}, random_values(2, 2), DType::kBF16).is_ok());
  ASSERT_TRUE(writer.add("vision_tower.x", {2}, random_values(2, 3), DType::kBF16).is_ok());
  TempDir dir;
  ASSERT_TRUE(writer.write(dir.path()).is_ok());
  auto checkpoint = Checkpoint::open(dir.path());
  ASSERT_TRUE(checkpoint.is_ok());
  const std::vector<std::string> ignored = {"vision_tower."};
  EXPECT_EQ((*checkpoint)->unused_tensors(ignored),
            (std::vector<std::string>{"model.a.weight", "model.a.weight_scale_inv", "model.b.weight"}));
  ASSERT_TRUE((*checkpoint)->read_f32("model.a.weight", std::vector<int64_t>{2, 2}).is_ok());
  EXPECT_EQ((*checkpoint)->unused_tensors(ignored), (std::vector<std::string>{"model.b.weight"}));
  EXPECT_EQ((*checkpoint)->unused_tensors({}), (std::vector<std::string>{"model.b.weight", "vision_tower.x"}));
}

TEST(SafetensorsWriter, RejectsBadInput) {
  SafetensorsWriter writer;
  const std::vector<float> four(4, 1.0f);
  EXPECT_EQ(writer.add("x", {2, 3}, four, DType::kF32).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(writer.add("x", {-2, -2}, four, DType::kF32).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(writer.add("x", {4}, four, DType::kI32).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(writer.add("x", {4}, four, DType::kF8E4M3).code(), StatusCode::kInvalidArgument);  // 1-D fp8
  EXPECT_EQ(writer.add("__metadata__", {4}, four, DType::kF32).code(), StatusCode::kInvalidArgument);
  const std::vector<float> with_nan = {1.0f, std::nanf(""), 0.0f, 2.0f};
  EXPECT_EQ(writer.add("x", {2, 2}, with_nan, DType::kF8E4M3).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(writer.add_raw("x", DType::kI32, {2}, std::vector<std::byte>(7)).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(writer.add("x", {4}, four, DType::kF32).is_ok());
  EXPECT_EQ(writer.add("x", {4}, four, DType::kF32).code(), StatusCode::kInvalidArgument);
}

// ---- malformed checkpoints -----------------------------------------------------------------------

constexpr const char* kEmbed = "model.embed_tokens.weight";                         // BF16 [4, 8]: data [0, 64)
constexpr const char* kInputNorm = "model.layers.0.input_layernorm.weight";         // F32 [8]: [64, 96)
constexpr const char* kOutProj = "model.layers.0.self_attn.o_proj.weight";          // BF16 [8, 8]: [96, 224)
constexpr const char* kFp8 = "model.layers.1.mlp.down_proj.weight";                 // F8_E4M3 [200, 130]: [224, 26224)
constexpr const char* kFp8Scale = "model.layers.1.mlp.down_proj.weight_scale_inv";  // F32 [2, 2]: [26224, 26240)
constexpr const char* kNorm = "model.norm.weight";                                  // F32 [8]: [26240, 26272)
constexpr const char* kSingle = "model.safetensors";
constexpr const char* kIndex = "model.safetensors.index.json";
constexpr const char* kShard1 = "model-00001-of-00004.safetensors";  // embed, input norm
constexpr const char* kShard2 = "model-00002-of-00004.safetensors";  // o_proj
constexpr const char* kShard3 = "model-00003-of-00004.safetensors";  // fp8 weight
constexpr const char* kShard4 = "model-00004-of-00004.safetensors";  // fp8 scale, norm

SafetensorsWriter valid_writer() {
  SafetensorsWriter writer;
  EXPECT_TRUE(writer.add(kEmbed, {4, 8}, random_values(32, 31), DType::kBF16).is_ok());
  EXPECT_TRUE(writer.add(kInputNorm, {8}, random_values(8, 32), DType::kF32).is_ok());
  EXPECT_TRUE(writer.add(kOutProj, {8, 8}, random_values(64, 33), DType::kBF16).is_ok());
  EXPECT_TRUE(writer.add(kFp8, {200, 130}, random_values(200 * 130, 34), DType::kF8E4M3).is_ok());
  EXPECT_TRUE(writer.add(kNorm, {8}, random_values(8, 35), DType::kF32).is_ok());
  return writer;
}

void write_valid_single(const fs::path& dir) {
  ASSERT_TRUE(valid_writer().write(dir).is_ok());
}
void write_valid_sharded(const fs::path& dir) {
  ASSERT_TRUE(valid_writer().write(dir, 200).is_ok());
}

void truncate_file(const fs::path& path, size_t size) {
  std::vector<char> bytes = read_bytes(path);
  bytes.resize(std::min(size, bytes.size()));
  write_bytes(path, bytes);
}

void edit_index(const fs::path& dir, const std::function<void(json::Value& weight_map)>& edit) {
  auto index = json::parse(read_text(dir / kIndex));
  ASSERT_TRUE(index.is_ok());
  edit((*index)["weight_map"]);
  write_text(dir / kIndex, index->dump(2));
}

using ReadCall = std::function<Status(const Checkpoint&)>;

Status read_status(const Checkpoint& checkpoint, const std::string& name, std::vector<int64_t> shape) {
  auto result = checkpoint.read_f32(name, shape);
  return result.is_ok() ? Status::ok() : result.status();
}

// One malformed checkpoint: `make` writes it into an empty directory; with `read` unset, opening it
// must fail, else it opens and `read` must fail. Each fragment must appear in the message.
struct MalformedCase {
  std::string kind;
  std::function<void(const fs::path& dir)> make;
  ReadCall read;
  StatusCode code;
  std::vector<std::string> fragments;
};

std::vector<MalformedCase> malformed_cases() {
  std::vector<MalformedCase> cases;
  auto single = [](std::function<void(const fs::path& file)> mutate) {
    return [mutate](const fs::path& dir) {
      write_valid_single(dir);
      mutate(dir / kSingle);
    };
  };
  auto sharded = [](std::function<void(const fs::path& dir)> mutate) {
    return [mutate](const fs::path& dir) {
      write_valid_sharded(dir);
      mutate(dir);
    };
  };
  auto header_edit = [&](std::function<void(json::Value&)> edit) {
    return single([edit](const fs::path& file) { edit_header(file, edit); });
  };
  const StatusCode kLoss = StatusCode::kDataLoss;

  // Truncations: inside the length field, inside the header, inside the data (several points).
  for (size_t cut : {0, 5, 7}) {
    cases.push_back({"TruncatedInLengthField" + std::to_string(cut),
                     single([cut](const fs::path& file) { truncate_file(file, cut); }),
                     nullptr,
                     kLoss,
                     {kSingle, "shorter than the 8-byte header length field"}});
  }
  for (size_t cut : {8, 100}) {
    cases.push_back({"TruncatedInHeader" + std::to_string(cut),
                     single([cut](const fs::path& file) { truncate_file(file, cut); }),
                     nullptr,
                     kLoss,
                     {kSingle, "runs past the end of the file"}});
  }
  // Cut after data byte 100: o_proj [96, 224) is the first tensor (in header order) past the end.
  cases.push_back(
      {"TruncatedInData",
       single([](const fs::path& file) { truncate_file(file, 8 + header_length_of(read_bytes(file)) + 100); }),
       nullptr,
       kLoss,
       {kSingle, std::string("tensor '") + kOutProj + "'", "run past the end of the data section"}});
  cases.push_back({"TruncatedLastByte",
                   single([](const fs::path& file) { truncate_file(file, fs::file_size(file) - 1); }),
                   nullptr,
                   kLoss,
                   {kSingle, std::string("tensor '") + kNorm + "'", "[26240, 26272)", "run past the end"}});
  cases.push_back({"HeaderLengthPastFile",
                   single([](const fs::path& file) {
                     std::vector<char> bytes = read_bytes(file);
                     set_header_length(bytes, bytes.size() - 7);
                     write_bytes(file, bytes);
                   }),
                   nullptr,
                   kLoss,
                   {kSingle, "header length", "runs past the end of the file"}});
  cases.push_back({"HeaderLengthAbsurd",
                   single([](const fs::path& file) {
                     std::vector<char> bytes = read_bytes(file);
                     set_header_length(bytes, uint64_t{1} << 50);
                     write_bytes(file, bytes);
                   }),
                   nullptr,
                   kLoss,
                   {kSingle, "header length 1125899906842624 is over the limit"}});
  cases.push_back({"HeaderNotJson",
                   single([](const fs::path& file) { replace_header(file, "{\"a\": [1, 2"); }),
                   nullptr,
                   kLoss,
                   {kSingle, "header is not valid JSON"}});
  cases.push_back({"HeaderNotObject",
                   single([](const fs::path& file) { replace_header(file, "[1, 2, 3]"); }),
                   nullptr,
                   kLoss,
                   {kSingle, "header is not a JSON object"}});
  cases.push_back({"EntryNotObject",
                   header_edit([](json::Value& header) { header[kEmbed] = 5; }),
                   nullptr,
                   kLoss,
                   {kSingle, kEmbed, "entry is not an object"}});
  cases.push_back({"MetadataNotStrings",
                   header_edit([](json::Value& header) { header["__metadata__"]["n"] = 1; }),
                   nullptr,
                   kLoss,
                   {kSingle, "'__metadata__' value for key 'n' is not a string"}});
  cases.push_back({"UnknownDtype",
                   header_edit([](json::Value& header) { header[kEmbed]["dtype"] = "F9"; }),
                   nullptr,
                   kLoss,
                   {kSingle, kEmbed, "unknown dtype 'F9'"}});
  for (const auto& [kind, shape] : std::vector<std::pair<std::string, std::string>>{
           {"NegativeShape", "[-4, 8]"}, {"NonIntegerShape", "[4.5, 8]"}, {"ShapeNotList", "\"4x8\""}}) {
    cases.push_back(
        {kind,
         header_edit([shape](json::Value& header) { header[kOutProj]["shape"] = json::parse(shape).value(); }),
         nullptr,
         kLoss,
         {kSingle, kOutProj, "shape must be a list of non-negative integers, found " + shape.substr(0, 2)}});
  }
  cases.push_back(
      {"OffsetsReversed",
       header_edit([](json::Value& header) { header[kEmbed]["data_offsets"] = json::parse("[64, 0]").value(); }),
       nullptr,
       kLoss,
       {kSingle, kEmbed, "data_offsets must be [begin, end] with 0 <= begin <= end, found [64,0]"}});
  cases.push_back(
      {"OffsetsNegative",
       header_edit([](json::Value& header) { header[kEmbed]["data_offsets"] = json::parse("[-8, 56]").value(); }),
       nullptr,
       kLoss,
       {kSingle, kEmbed, "data_offsets must be [begin, end]"}});
  cases.push_back(
      {"OffsetsPastEnd",
       header_edit([](json::Value& header) { header[kNorm]["data_offsets"] = json::parse("[26240, 90000]").value(); }),
       nullptr,
       kLoss,
       {kSingle, kNorm, "data_offsets [26240, 90000) run past the end of the data section (26272 bytes"}});
  cases.push_back({"DtypeTimesShapeNotBytes",
                   header_edit([](json::Value& header) { header[kOutProj]["shape"] = json::parse("[8, 7]").value(); }),
                   nullptr,
                   kLoss,
                   {kSingle, std::string("tensor '") + kOutProj + "'",
                    "dtype BF16 × shape [8, 7] = 112 bytes but data_offsets span 128"}});
  cases.push_back({"ShapeOverflows",
                   header_edit([](json::Value& header) {
                     header[kOutProj]["shape"] = json::parse("[4611686018427387904, 8]").value();
                   }),
                   nullptr,
                   kLoss,
                   {kSingle, kOutProj, "overflows 64 bits"}});
  cases.push_back(
      {"OverlappingTensors",
       header_edit([](json::Value& header) { header[kInputNorm]["data_offsets"] = json::parse("[32, 64]").value(); }),
       nullptr,
       kLoss,
       {kSingle, std::string("tensors '") + kEmbed + "' [0, 64) and '" + kInputNorm + "' [32, 64) overlap"}});
  cases.push_back({"HoleBetweenTensors",
                   header_edit([](json::Value& header) {
                     header[kEmbed]["shape"] = json::parse("[4, 6]").value();
                     header[kEmbed]["data_offsets"] = json::parse("[0, 48]").value();
                   }),
                   nullptr,
                   kLoss,
                   {kSingle, "hole in the data section: bytes [48, 64) between tensors", kEmbed, kInputNorm}});
  cases.push_back({"HoleBeforeFirstTensor",
                   header_edit([](json::Value& header) {
                     header[kEmbed]["shape"] = json::parse("[4, 6]").value();
                     header[kEmbed]["data_offsets"] = json::parse("[16, 64]").value();
                   }),
                   nullptr,
                   kLoss,
                   {kSingle, "hole in the data section: bytes [0, 16) before the first tensor", kEmbed}});
  cases.push_back({"TrailingBytes",
                   single([](const fs::path& file) {
                     std::vector<char> bytes = read_bytes(file);
                     bytes.resize(bytes.size() + 8, 'x');
                     write_bytes(file, bytes);
                   }),
                   nullptr,
                   kLoss,
                   {kSingle, "8 trailing bytes after the last tensor", kNorm}});
  cases.push_back({"DuplicateTensorInHeader",
                   single([](const fs::path& file) {
                     std::vector<char> bytes = read_bytes(file);
                     std::string header(bytes.data() + 8, header_length_of(bytes));
                     const size_t at = header.find(std::string("\"") + kInputNorm + "\"");
                     header.replace(at, std::strlen(kInputNorm) + 2, std::string("\"") + kEmbed + "\"");
                     replace_header(file, header);
                   }),
                   nullptr,
                   kLoss,
                   {kSingle, "header is not valid JSON", "duplicate key"}});

  // Sharded checkpoints.
  cases.push_back({"MissingShard",
                   sharded([](const fs::path& dir) { fs::remove(dir / kShard2); }),
                   nullptr,
                   kLoss,
                   {kIndex, std::string("shard file '") + kShard2 + "' is missing", kOutProj}});
  cases.push_back({"TensorInIndexNotInShard",
                   sharded([](const fs::path& dir) {
                     edit_index(dir, [](json::Value& map) { map["model.layers.0.extra.weight"] = kShard1; });
                   }),
                   nullptr,
                   kLoss,
                   {kIndex, "tensor 'model.layers.0.extra.weight' is listed in shard '" + std::string(kShard1) +
                                "' but absent from it"}});
  cases.push_back(
      {"TensorInShardNotInIndex",
       sharded([](const fs::path& dir) { edit_index(dir, [](json::Value& map) { erase_key(map, kNorm); }); }),
       nullptr,
       kLoss,
       {std::string(kShard4) + ": tensor '" + kNorm + "' is in the shard but not in " + kIndex}});
  cases.push_back(
      {"IndexNamesWrongShard",
       sharded([](const fs::path& dir) { edit_index(dir, [](json::Value& map) { map[kNorm] = kShard1; }); }),
       nullptr,
       kLoss,
       {kShard4, kNorm, std::string("maps it to '") + kShard1 + "'"}});
  cases.push_back(
      {"SameTensorInTwoShards",
       sharded([](const fs::path& dir) {
         // Shard 4 rewritten to hold o_proj (also in shard 2) beside its own tensors.
         SafetensorsWriter writer;
         ASSERT_TRUE(writer.add(kOutProj, {8, 8}, random_values(64, 40), DType::kBF16).is_ok());
         ASSERT_TRUE(writer.add(kNorm, {8}, random_values(8, 41), DType::kF32).is_ok());
         ASSERT_TRUE(writer.add_raw(kFp8Scale, DType::kF32, {2, 2}, std::vector<std::byte>(16)).is_ok());
         ASSERT_TRUE(writer.write(dir / "other").is_ok());
         fs::copy_file(dir / "other" / kSingle, dir / kShard4, fs::copy_options::overwrite_existing);
       }),
       nullptr,
       kLoss,
       {std::string("tensor '") + kOutProj + "' appears in two shards: '" + kShard2 + "' and '" + kShard4 + "'"}});
  cases.push_back({"ShardNameNotPlain",
                   sharded([](const fs::path& dir) {
                     edit_index(dir, [](json::Value& map) { map[kNorm] = "../model-00004-of-00004.safetensors"; });
                   }),
                   nullptr,
                   kLoss,
                   {kIndex, kNorm, "shard must be a plain file name"}});
  cases.push_back({"IndexNotJson",
                   sharded([](const fs::path& dir) { write_text(dir / kIndex, "{\"weight_map\": "); }),
                   nullptr,
                   kLoss,
                   {kIndex, "not valid JSON"}});
  cases.push_back({"ShardCorrupt",
                   sharded([](const fs::path& dir) { truncate_file(dir / kShard3, 20); }),
                   nullptr,
                   kLoss,
                   {kShard3, "runs past the end of the file"}});

  // Failures at read time.
  cases.push_back({"NanInNormWeight",
                   single([](const fs::path& file) {
                     const float nan = std::numeric_limits<float>::quiet_NaN();
                     patch_tensor(file, kNorm, 12, std::span(reinterpret_cast<const char*>(&nan), 4));
                   }),
                   [](const Checkpoint& checkpoint) { return read_status(checkpoint, kNorm, {8}); },
                   kLoss,
                   {kSingle, std::string("tensor '") + kNorm + "'", "NaN in a norm weight (element 3)"}});
  cases.push_back({"InfInLayernormWeight",
                   single([](const fs::path& file) {
                     const float inf = -std::numeric_limits<float>::infinity();
                     patch_tensor(file, kInputNorm, 0, std::span(reinterpret_cast<const char*>(&inf), 4));
                   }),
                   [](const Checkpoint& checkpoint) { return read_status(checkpoint, kInputNorm, {8}); },
                   kLoss,
                   {kSingle, kInputNorm, "Inf in a norm weight (element 0)"}});
  cases.push_back(
      {"NanInBf16NormWeight",
       [](const fs::path& dir) {
         SafetensorsWriter writer;
         std::vector<float> values = random_values(8, 42);
         values[6] = std::nanf("");
         ASSERT_TRUE(writer.add("model.layers.2.self_attn.kv_a_layernorm.weight", {8}, values, DType::kBF16).is_ok());
         ASSERT_TRUE(writer.write(dir).is_ok());
       },
       [](const Checkpoint& checkpoint) {
         return read_status(checkpoint, "model.layers.2.self_attn.kv_a_layernorm.weight", {8});
       },
       kLoss,
       {kSingle, "kv_a_layernorm.weight", "NaN in a norm weight (element 6)"}});
  cases.push_back({"Fp8WithoutScale",
                   header_edit([](json::Value& header) {
                     for (auto& [key, value] : header.as_object()) {
                       if (key == kFp8Scale) key = "model.layers.1.mlp.down_proj.weight_scale";
                     }
                   }),
                   [](const Checkpoint& checkpoint) {
                     return read_status(checkpoint, kFp8, {200, 130});
                   },
                   kLoss,
                   {kSingle, kFp8, std::string("F8_E4M3 weight without its scale tensor '") + kFp8Scale + "'"}});
  cases.push_back({"Fp8ScaleWrongShape",
                   header_edit([](json::Value& header) { header[kFp8Scale]["shape"] = json::parse("[4, 1]").value(); }),
                   [](const Checkpoint& checkpoint) {
                     return read_status(checkpoint, kFp8, {200, 130});
                   },
                   kLoss,
                   {kSingle, kFp8Scale, "scale shape [4, 1] does not match weight", "expected [2, 2]"}});
  cases.push_back({"ShapeMismatchOnRead",
                   single([](const fs::path&) {}),
                   [](const Checkpoint& checkpoint) {
                     return read_status(checkpoint, kOutProj, {8, 4});
                   },
                   StatusCode::kInvalidArgument,
                   {kSingle, kOutProj, "expected shape [8, 4] but found [8, 8]"}});
  cases.push_back(
      {"AbsentTensorOnRead",
       single([](const fs::path&) {}),
       [](const Checkpoint& checkpoint) { return read_status(checkpoint, "model.layers.9.mlp.gate.weight", {4}); },
       StatusCode::kNotFound,
       {"tensor 'model.layers.9.mlp.gate.weight' not found in checkpoint"}});
  return cases;
}

void PrintTo(const MalformedCase& test_case, std::ostream* out) {
  *out << test_case.kind;
}

class MalformedCheckpoint : public ::testing::TestWithParam<MalformedCase> {};

TEST_P(MalformedCheckpoint, FailsWithSpecificMessage) {
  const MalformedCase& test_case = GetParam();
  TempDir dir;
  test_case.make(dir.path());
  if (HasFatalFailure()) return;
  auto checkpoint = Checkpoint::open(dir.path());
  Status status;
  if (test_case.read) {
    ASSERT_TRUE(checkpoint.is_ok()) << checkpoint.status().to_string();
    status = test_case.read(**checkpoint);
  } else {
    ASSERT_FALSE(checkpoint.is_ok());
    status = checkpoint.status();
  }
  ASSERT_FALSE(status.is_ok());
  RecordProperty("message", status.to_string());
  EXPECT_EQ(status.code(), test_case.code) << status.to_string();
  for (const std::string& fragment : test_case.fragments) {
    EXPECT_NE(status.message().find(fragment), std::string::npos)
        << "missing '" << fragment << "' in: " << status.to_string();
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, MalformedCheckpoint, ::testing::ValuesIn(malformed_cases()),
                         [](const ::testing::TestParamInfo<MalformedCase>& info) { return info.param.kind; });

TEST(SafetensorsOpen, MissingPaths) {
  TempDir dir;
  auto empty_dir = Checkpoint::open(dir.path());
  ASSERT_FALSE(empty_dir.is_ok());
  EXPECT_EQ(empty_dir.status().code(), StatusCode::kNotFound);
  EXPECT_NE(empty_dir.status().message().find("neither model.safetensors.index.json nor model.safetensors"),
            std::string::npos);
  auto absent = Checkpoint::open(dir.path() / "nope.safetensors");
  ASSERT_FALSE(absent.is_ok());
  EXPECT_NE(absent.status().message().find("no such file"), std::string::npos);
}

// Random byte flips and truncations of a valid file (fixed seed): open either fails with a Status or
// succeeds with every tensor's bytes inside the file, and every read stays in bounds.
TEST(SafetensorsFuzz, RandomCorruptionsNeverCrash) {
  TempDir dir;
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.add(kEmbed, {4, 8}, random_values(32, 51), DType::kBF16).is_ok());
  ASSERT_TRUE(writer.add(kNorm, {8}, random_values(8, 52), DType::kF32).is_ok());
  ASSERT_TRUE(writer.add(kFp8, {130, 20}, random_values(130 * 20, 53), DType::kF8E4M3).is_ok());
  ASSERT_TRUE(writer.add("x.f16", {3}, random_values(3, 54), DType::kF16).is_ok());
  ASSERT_TRUE(writer.write(dir.path() / "valid").is_ok());
  const std::vector<char> valid = read_bytes(dir.path() / "valid" / kSingle);
  const size_t header_end = 8 + header_length_of(valid);
  const std::string interesting = "[]{}\",:-0123456789 eE.";

  std::mt19937 generator(20240601);
  int opened = 0;
  for (int iteration = 0; iteration < 2000; ++iteration) {
    std::vector<char> bytes = valid;
    const uint32_t kind = generator() % 100;
    if (kind < 15) {
      bytes.resize(generator() % bytes.size());
    } else {
      const int flips = 1 + static_cast<int>(generator() % 4);
      for (int f = 0; f < flips; ++f) {
        // Mostly inside the length field and header, where the structure lives.
        const size_t at = kind < 80 ? generator() % header_end : generator() % bytes.size();
        if (kind < 50) {
          bytes[at] = interesting[generator() % interesting.size()];
        } else {
          bytes[at] = static_cast<char>(bytes[at] ^ (1 << (generator() % 8)));
        }
      }
    }
    write_bytes(dir.path() / kSingle, bytes);
    auto checkpoint = Checkpoint::open(dir.path());
    if (!checkpoint.is_ok()) {
      ASSERT_FALSE(checkpoint.status().message().empty());
      continue;
    }
    ++opened;
    for (const std::string& name : (*checkpoint)->names()) {
      const TensorView* view = (*checkpoint)->find(name);
      ASSERT_NE(view, nullptr);
      ASSERT_EQ(view->data.size(), static_cast<size_t>(view->num_elements()) * dtype_size(view->dtype)) << name;
      unsigned checksum = 0;
      for (std::byte b : view->data) checksum += static_cast<unsigned>(b);
      (void)checksum;
      auto read = (*checkpoint)->read_f32(name, view->shape);
      if (read.is_ok()) {
        ASSERT_EQ(read->size(), static_cast<size_t>(view->num_elements())) << name;
      }
    }
  }
  RecordProperty("opened", opened);
  EXPECT_GT(opened, 0);  // some corruptions (data bytes, digits) leave a valid file
}

}  // namespace
}  // namespace deltaserve::engine
