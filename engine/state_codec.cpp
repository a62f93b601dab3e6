#include "engine/state_codec.hpp"

#include <bit>
#include <cstring>
#include <string>

namespace deltaserve::engine {
namespace {

static_assert(std::endian::native == std::endian::little,
              "state_codec copies integers and floats as they are in memory: a big-endian host needs byte swaps");

constexpr char kMagic[4] = {'D', 'S', 'R', 'S'};
constexpr size_t kFixedHeaderBytes = 56;  // up to and including the recurrent bytes field
constexpr size_t kChecksumBytes = 8;
constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ULL;
constexpr uint64_t kFnvPrime = 0x100000001b3ULL;

uint64_t fnv1a(std::span<const std::byte> bytes, uint64_t hash = kFnvOffset) {
  for (std::byte b : bytes) hash = (hash ^ static_cast<uint64_t>(b)) * kFnvPrime;
  return hash;
}

class Writer {
 public:
  explicit Writer(size_t capacity) { out_.reserve(capacity); }
  template <class T>
  void put(T value) {
    append(&value, sizeof(T));
  }
  void put_floats(const std::vector<float>& values) { append(values.data(), values.size() * sizeof(float)); }
  void put_floats(std::span<const float> values) { append(values.data(), values.size() * sizeof(float)); }
  std::vector<std::byte>& bytes() { return out_; }

 private:
  void append(const void* data, size_t size) {
    const auto* p = static_cast<const std::byte*>(data);
    out_.insert(out_.end(), p, p + size);
  }
  std::vector<std::byte> out_;
};

// Reads at offsets the caller has checked against the buffer size.
template <class T>
T load(std::span<const std::byte> bytes, size_t offset) {
  T value;
  std::memcpy(&value, bytes.data() + offset, sizeof(T));
  return value;
}

void load_floats(std::span<const std::byte> bytes, size_t& offset, std::vector<float>& out) {
  if (out.empty()) return;  // data() may be null: memcpy must not see it
  std::memcpy(out.data(), bytes.data() + offset, out.size() * sizeof(float));
  offset += out.size() * sizeof(float);
}

std::string hex(uint64_t value) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s = "0x";
  for (int shift = 60; shift >= 0; shift -= 4) s += kDigits[(value >> shift) & 0xf];
  return s;
}

struct Shapes {
  uint64_t kda_layers, mla_layers;
  uint64_t conv_bytes, recurrent_bytes;  // per KDA layer: each conv tail, S
  uint64_t mla_row_bytes;                // per token per MLA layer
};

Shapes shapes_of(const ModelConfig& config) {
  const RequestState fresh(config);
  Shapes s{};
  s.kda_layers = fresh.kda.size();
  s.mla_layers = fresh.mla.size();
  if (!fresh.kda.empty()) {
    s.conv_bytes = fresh.kda[0].conv_q.size() * sizeof(float);
    s.recurrent_bytes = fresh.kda[0].recurrent.size() * sizeof(float);
  }
  s.mla_row_bytes = static_cast<uint64_t>(config.mla.cache_width()) * sizeof(float);
  return s;
}

}  // namespace

uint64_t state_fingerprint(const ModelConfig& config) {
  uint64_t hash = fnv1a(std::as_bytes(std::span<const char>("deltaserve.request_state", 24)));
  auto mix = [&hash](int64_t value) {
    const auto v = static_cast<uint64_t>(value);
    hash = fnv1a(std::as_bytes(std::span<const uint64_t>(&v, 1)), hash);
  };
  mix(config.num_layers);
  for (LayerKind kind : config.layer_kinds) mix(kind == LayerKind::kKda ? 1 : 2);
  mix(config.hidden_size);
  mix(config.vocab_size);
  mix(config.intermediate_size);
  mix(config.tie_word_embeddings);
  mix(config.kda.num_heads);
  mix(config.kda.head_dim);
  mix(config.kda.conv_kernel_size);
  mix(config.kda.gate_lower_bound.has_value());
  mix(config.kda.full_rank_output_gate);
  mix(config.kda.gate_low_rank);
  mix(config.mla.num_heads);
  mix(config.mla.q_lora_rank.value_or(-1));
  mix(config.mla.kv_lora_rank);
  mix(config.mla.qk_nope_head_dim);
  mix(config.mla.qk_rope_head_dim);
  mix(config.mla.v_head_dim);
  mix(config.mla.use_nope);
  mix(config.mla.use_output_gate);
  mix(config.moe.num_experts);
  mix(config.moe.num_experts_per_token);
  mix(config.moe.num_shared_experts);
  mix(config.moe.moe_intermediate_size);
  mix(config.moe.first_k_dense_replace);
  mix(config.moe.layer_freq);
  mix(config.moe.renormalize);
  mix(config.moe.num_expert_groups);
  mix(config.moe.top_k_groups);
  mix(config.moe.routed_expert_hidden_size.value_or(-1));
  mix(config.moe.latent_moe_use_norm);
  mix(config.hidden_act == Activation::kSilu ? 1 : 2);
  mix(config.attn_res_block_size.value_or(-1));
  return hash;
}

std::vector<std::byte> encode_state(const ModelConfig& config, const RequestState& state) {
  state.expect_host_current("encode_state");
  uint64_t payload = 0;
  for (const KdaLayerState& layer : state.kda) {
    payload +=
        (layer.conv_q.size() + layer.conv_k.size() + layer.conv_v.size() + layer.recurrent.size()) * sizeof(float);
  }
  for (const MlaLayerCache& layer : state.mla) payload += layer.data().size() * sizeof(float);
  const uint64_t total = kFixedHeaderBytes + 8 * state.mla.size() + payload + kChecksumBytes;

  Writer w(total);
  for (char c : kMagic) w.put(c);
  w.put<uint32_t>(kStateCodecVersion);
  w.put<uint64_t>(total);
  w.put<uint64_t>(state_fingerprint(config));
  w.put<int64_t>(state.num_tokens());
  w.put<uint32_t>(static_cast<uint32_t>(state.kda.size()));
  w.put<uint32_t>(static_cast<uint32_t>(state.mla.size()));
  w.put<uint64_t>(state.kda.empty() ? 0 : state.kda[0].conv_q.size() * sizeof(float));
  w.put<uint64_t>(state.kda.empty() ? 0 : state.kda[0].recurrent.size() * sizeof(float));
  for (const MlaLayerCache& layer : state.mla) w.put<uint64_t>(layer.data().size() * sizeof(float));
  for (const KdaLayerState& layer : state.kda) {
    w.put_floats(layer.conv_q);
    w.put_floats(layer.conv_k);
    w.put_floats(layer.conv_v);
    w.put_floats(layer.recurrent);
  }
  for (const MlaLayerCache& layer : state.mla) w.put_floats(layer.data());
  w.put<uint64_t>(fnv1a(w.bytes()));
  return std::move(w.bytes());
}

Result<RequestState> decode_state(const ModelConfig& config, std::span<const std::byte> bytes) {
  const size_t size = bytes.size();
  // Framing: magic, version and total size, so that the checksum can be located.
  if (size < 16) return data_loss("request state truncated: " + std::to_string(size) + " bytes, no header");
  if (std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return data_loss("request state has a bad magic (not \"DSRS\")");
  }
  const auto version = load<uint32_t>(bytes, 4);
  if (version != kStateCodecVersion) {
    return data_loss("request state has unsupported version " + std::to_string(version) + " (expected " +
                     std::to_string(kStateCodecVersion) + ")");
  }
  const auto total = load<uint64_t>(bytes, 8);
  if (size < total) {
    return data_loss("request state truncated: " + std::to_string(size) + " of " + std::to_string(total) + " bytes");
  }
  if (size > total) {
    return data_loss("request state has " + std::to_string(size - total) + " trailing bytes after its " +
                     std::to_string(total) + " bytes");
  }
  if (total < kFixedHeaderBytes + kChecksumBytes) {
    return data_loss("request state total size " + std::to_string(total) + " is smaller than its header");
  }
  const size_t body = size - kChecksumBytes;
  const auto stored_checksum = load<uint64_t>(bytes, body);
  const uint64_t checksum = fnv1a(bytes.first(body));
  if (checksum != stored_checksum) {
    return data_loss("request state checksum mismatch: stored " + hex(stored_checksum) + ", computed " + hex(checksum));
  }

  // Identity and shapes against this model.
  const auto fingerprint = load<uint64_t>(bytes, 16);
  if (fingerprint != state_fingerprint(config)) {
    return data_loss("request state belongs to another model: fingerprint " + hex(fingerprint) + ", this model's " +
                     hex(state_fingerprint(config)));
  }
  const Shapes expected = shapes_of(config);
  const auto num_tokens = load<int64_t>(bytes, 24);
  const auto kda_layers = load<uint32_t>(bytes, 32);
  const auto mla_layers = load<uint32_t>(bytes, 36);
  if (kda_layers != expected.kda_layers) {
    return data_loss("request state has " + std::to_string(kda_layers) + " KDA layers, the model " +
                     std::to_string(expected.kda_layers));
  }
  if (mla_layers != expected.mla_layers) {
    return data_loss("request state has " + std::to_string(mla_layers) + " MLA layers, the model " +
                     std::to_string(expected.mla_layers));
  }
  const size_t header = kFixedHeaderBytes + 8 * static_cast<size_t>(mla_layers);
  if (header > body) return data_loss("request state header runs past its end");
  const auto conv_bytes = load<uint64_t>(bytes, 40);
  const auto recurrent_bytes = load<uint64_t>(bytes, 48);
  if (kda_layers > 0 && conv_bytes != expected.conv_bytes) {
    return data_loss("request state KDA conv tail section size " + std::to_string(conv_bytes) + " bytes, the model " +
                     std::to_string(expected.conv_bytes));
  }
  if (kda_layers > 0 && recurrent_bytes != expected.recurrent_bytes) {
    return data_loss("request state KDA recurrent section size " + std::to_string(recurrent_bytes) +
                     " bytes, the model " + std::to_string(expected.recurrent_bytes));
  }
  // Every bound below is checked against `size`, so no product overflows and no allocation exceeds it.
  if (num_tokens < 0 || (expected.mla_row_bytes > 0 && mla_layers > 0 &&
                         static_cast<uint64_t>(num_tokens) > size / expected.mla_row_bytes)) {
    return data_loss("request state has an impossible token count " + std::to_string(num_tokens));
  }
  uint64_t sections = static_cast<uint64_t>(kda_layers) * (3 * expected.conv_bytes + expected.recurrent_bytes);
  for (uint32_t i = 0; i < mla_layers; ++i) {
    const auto layer_bytes = load<uint64_t>(bytes, kFixedHeaderBytes + 8 * static_cast<size_t>(i));
    const uint64_t want = static_cast<uint64_t>(num_tokens) * expected.mla_row_bytes;
    if (layer_bytes != want) {
      return data_loss("request state MLA layer " + std::to_string(i) + " section size " + std::to_string(layer_bytes) +
                       " bytes, " + std::to_string(num_tokens) + " tokens need " + std::to_string(want));
    }
    sections += want;
  }
  if (header + sections != body) {
    return data_loss("request state section sizes add up to " + std::to_string(header + sections) +
                     " bytes, the buffer holds " + std::to_string(body) + " before its checksum");
  }

  RequestState state(config);
  size_t offset = header;
  for (KdaLayerState& layer : state.kda) {
    load_floats(bytes, offset, layer.conv_q);
    load_floats(bytes, offset, layer.conv_k);
    load_floats(bytes, offset, layer.conv_v);
    load_floats(bytes, offset, layer.recurrent);
  }
  for (MlaLayerCache& layer : state.mla) {
    std::vector<float>& rows = layer.mutable_data();
    rows.resize(static_cast<size_t>(num_tokens) * static_cast<size_t>(config.mla.cache_width()));
    load_floats(bytes, offset, rows);
  }
  state.advance(num_tokens);
  return state;
}

}  // namespace deltaserve::engine
