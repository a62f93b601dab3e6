#include "engine/prefix_state.hpp"

#include <array>
#include <cstring>
#include <string>

#include "engine/state_codec.hpp"

namespace deltaserve::engine {
namespace {

constexpr std::array<char, 4> kMagic = {'D', 'S', 'K', 'C'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 4 + 4 + 8 + 8 + 8 + 8;
constexpr size_t kChecksumBytes = 8;

// 64-bit multiply-xor over 8-byte words (a tail is zero-padded), then a final avalanche. Not
// cryptographic: it catches truncation and flipped bits, at memory speed.
uint64_t checksum(std::span<const std::byte> bytes) {
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;
  uint64_t h = 0x243F6A8885A308D3ull ^ bytes.size();
  size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, bytes.data() + i, 8);
    h = (h ^ w) * kMul;
    h ^= h >> 29;
  }
  if (i < bytes.size()) {
    uint64_t w = 0;
    std::memcpy(&w, bytes.data() + i, bytes.size() - i);
    h = (h ^ w) * kMul;
  }
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDull;
  h ^= h >> 33;
  return h;
}

size_t kda_payload_bytes(const RequestState& state) {
  return static_cast<size_t>(state.kda_state_bytes());
}

template <class T>
void put(std::vector<std::byte>& out, size_t& at, T value) {
  std::memcpy(out.data() + at, &value, sizeof(T));
  at += sizeof(T);
}

template <class T>
T get(std::span<const std::byte> in, size_t at) {
  T value;
  std::memcpy(&value, in.data() + at, sizeof(T));
  return value;
}

void put_floats(std::vector<std::byte>& out, size_t& at, const std::vector<float>& values) {
  std::memcpy(out.data() + at, values.data(), values.size() * sizeof(float));
  at += values.size() * sizeof(float);
}

void get_floats(std::span<const std::byte> in, size_t& at, std::vector<float>& values) {
  std::memcpy(values.data(), in.data() + at, values.size() * sizeof(float));
  at += values.size() * sizeof(float);
}

Status data_loss(const std::string& what) {
  return Status(StatusCode::kDataLoss, "KDA checkpoint: " + what);
}

}  // namespace

int64_t mla_page_row_values(const ModelConfig& config) {
  return config.num_layers_of(LayerKind::kMla) * config.mla.cache_width();
}

std::vector<std::byte> encode_kda_checkpoint(const ModelConfig& config, const RequestState& state) {
  state.expect_host_kda_current("encode_kda_checkpoint");
  const size_t payload = kda_payload_bytes(state);
  const size_t total = kHeaderBytes + payload + kChecksumBytes;
  std::vector<std::byte> out(total);
  size_t at = 0;
  std::memcpy(out.data(), kMagic.data(), kMagic.size());
  at += kMagic.size();
  put<uint32_t>(out, at, kVersion);
  put<uint64_t>(out, at, total);
  put<uint64_t>(out, at, state_fingerprint(config));
  put<int64_t>(out, at, state.num_tokens());
  put<uint64_t>(out, at, payload);
  for (const KdaLayerState& layer : state.kda) {
    put_floats(out, at, layer.conv_q);
    put_floats(out, at, layer.conv_k);
    put_floats(out, at, layer.conv_v);
    put_floats(out, at, layer.recurrent);
  }
  put<uint64_t>(out, at, checksum({out.data(), at}));
  return out;
}

Result<int64_t> restore_kda_checkpoint(const ModelConfig& config, std::span<const std::byte> bytes,
                                       RequestState& state) {
  if (bytes.size() < kHeaderBytes + kChecksumBytes) return data_loss("truncated header");
  if (std::memcmp(bytes.data(), kMagic.data(), kMagic.size()) != 0) return data_loss("bad magic");
  if (const auto version = get<uint32_t>(bytes, 4); version != kVersion) {
    return data_loss("unsupported version " + std::to_string(version));
  }
  if (get<uint64_t>(bytes, 8) != bytes.size()) {
    return data_loss("size " + std::to_string(bytes.size()) + " bytes, header says " +
                     std::to_string(get<uint64_t>(bytes, 8)));
  }
  const size_t body = bytes.size() - kChecksumBytes;
  if (checksum(bytes.first(body)) != get<uint64_t>(bytes, body)) return data_loss("checksum mismatch");
  if (get<uint64_t>(bytes, 16) != state_fingerprint(config)) return data_loss("made for another model");
  const auto position = get<int64_t>(bytes, 24);
  const auto payload = get<uint64_t>(bytes, 32);
  if (payload != kda_payload_bytes(state) || kHeaderBytes + payload + kChecksumBytes != bytes.size()) {
    return data_loss("payload of " + std::to_string(payload) + " bytes; this model's KDA state has " +
                     std::to_string(kda_payload_bytes(state)));
  }
  if (position < 0) return data_loss("negative position");
  DS_RETURN_IF_ERROR(state.sync_host());  // the MLA part stays; the host copy becomes the only one
  state.drop_device();
  size_t at = kHeaderBytes;
  for (KdaLayerState& layer : state.kda) {
    get_floats(bytes, at, layer.conv_q);
    get_floats(bytes, at, layer.conv_k);
    get_floats(bytes, at, layer.conv_v);
    get_floats(bytes, at, layer.recurrent);
  }
  return position;
}

std::vector<float> gather_mla_page_rows(const ModelConfig& config, const RequestState& state, int64_t first,
                                        int64_t count) {
  state.expect_host_mla_rows(first + count, "gather_mla_page_rows");
  const int64_t width = config.mla.cache_width(), row = mla_page_row_values(config);
  std::vector<float> rows(static_cast<size_t>(count * row));
  for (size_t l = 0; l < state.mla.size(); ++l) {
    const float* src = state.mla[l].rows();
    for (int64_t t = 0; t < count; ++t) {
      std::memcpy(&rows[static_cast<size_t>(t * row + static_cast<int64_t>(l) * width)], src + (first + t) * width,
                  sizeof(float) * static_cast<size_t>(width));
    }
  }
  return rows;
}

Status resume_from_prefix(const ModelConfig& config, std::span<const std::byte> checkpoint,
                          const kvstore::PageTable& pages, const kvstore::PagePool& pool, int64_t tokens,
                          RequestState& state) {
  state.reset();
  const int64_t width = config.mla.cache_width(), row = mla_page_row_values(config);
  if (pages.num_tokens() < tokens) {
    return invalid_argument("prefix resume: " + std::to_string(tokens) + " tokens wanted, the pages hold " +
                            std::to_string(pages.num_tokens()));
  }
  if (!state.mla.empty() && pool.config().row_values != row) {
    return invalid_argument("prefix resume: page rows of " + std::to_string(pool.config().row_values) +
                            " values, the model needs " + std::to_string(row));
  }
  auto position = restore_kda_checkpoint(config, checkpoint, state);
  if (!position.is_ok()) {
    state.reset();
    return position.status();
  }
  if (*position != tokens) {
    state.reset();
    return data_loss("taken at position " + std::to_string(*position) + ", expected " + std::to_string(tokens));
  }
  for (size_t l = 0; l < state.mla.size(); ++l) {
    std::vector<float>& dst = state.mla[l].mutable_data();
    dst.resize(static_cast<size_t>(tokens * width));
    for (int64_t t = 0; t < tokens; ++t) {
      const auto src = pages.row(pool, t);
      std::memcpy(&dst[static_cast<size_t>(t * width)], src.data() + static_cast<int64_t>(l) * width,
                  sizeof(float) * static_cast<size_t>(width));
    }
  }
  state.advance(tokens);
  return Status::ok();
}

}  // namespace deltaserve::engine
