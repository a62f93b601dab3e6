// State codec: bitwise round trip (including NaN payloads, -0 and denormals), generation continuing
// identically from a decoded state, and every kind of corruption rejected with DataLoss naming it.
// Field-level corruptions are "resealed" (checksum recomputed) so that the check behind the checksum
// is the one exercised, as a well-formed encoding from another model or writer would be.
#include "engine/state_codec.hpp"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <unistd.h>

#include "common/temp_dir.hpp"
#include "engine/make_model.hpp"
#include "engine/model.hpp"

namespace deltaserve::engine {
namespace {

using Bytes = std::vector<std::byte>;

const Model& tiny_model() {
  static const std::unique_ptr<Model> model = [] {
    TempDir dir;
    auto config = preset_config("tiny-linear");
    EXPECT_TRUE(config.is_ok());
    MakeModelOptions options;
    options.seed = 5;
    options.dtype = DType::kF32;
    EXPECT_TRUE(write_random_model(*config, dir.path(), options).is_ok());
    auto model = Model::load(dir.path());
    EXPECT_TRUE(model.is_ok()) << model.status().to_string();
    return std::move(model).value();
  }();
  return *model;
}

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  return tokens;
}

RequestState prefilled(const Model& model, int64_t tokens, uint32_t seed) {
  RequestState state = model.new_state();
  if (tokens > 0) {
    const auto ids = random_tokens(tokens, model.config().vocab_size, seed);
    EXPECT_TRUE(model.prefill(state, ids, 16).is_ok());
  }
  return state;
}

// Fills every value with random bit patterns, NaNs with payloads, ±0, ±inf and denormals included.
void poison(RequestState& state, uint32_t seed) {
  std::mt19937 rng(seed);
  auto fill = [&](std::vector<float>& values) {
    for (float& v : values) {
      const uint32_t bits = rng();
      std::memcpy(&v, &bits, sizeof(v));
    }
    if (values.size() >= 4) {
      values[0] = -0.0f;
      values[1] = std::numeric_limits<float>::denorm_min();
      values[2] = -std::numeric_limits<float>::infinity();
      const uint32_t nan_payload = 0x7fc12345u;
      std::memcpy(&values[3], &nan_payload, sizeof(float));
    }
  };
  for (KdaLayerState& layer : state.kda) {
    fill(layer.conv_q);
    fill(layer.conv_k);
    fill(layer.conv_v);
    fill(layer.recurrent);
  }
  for (MlaLayerCache& layer : state.mla) fill(layer.mutable_data());
}

// FNV-1a 64, written out again: the test's own idea of the checksum.
void reseal(Bytes& bytes) {
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i + 8 < bytes.size(); ++i) {
    hash = (hash ^ static_cast<uint8_t>(bytes[i])) * 0x100000001b3ULL;
  }
  std::memcpy(bytes.data() + bytes.size() - 8, &hash, 8);
}

template <class T>
void store(Bytes& bytes, size_t offset, T value) {
  std::memcpy(bytes.data() + offset, &value, sizeof(T));
}

// Decoding must fail with DataLoss whose message contains `needle`.
void expect_data_loss(const ModelConfig& config, const Bytes& bytes, const std::string& needle,
                      const std::string& what) {
  auto decoded = decode_state(config, bytes);
  ASSERT_FALSE(decoded.is_ok()) << what;
  EXPECT_EQ(decoded.status().code(), StatusCode::kDataLoss) << what << ": " << decoded.status().to_string();
  EXPECT_NE(decoded.status().message().find(needle), std::string::npos)
      << what << ": expected '" << needle << "' in " << decoded.status().to_string();
}

TEST(StateCodec, RoundTripIsBitwise) {
  const Model& model = tiny_model();
  const ModelConfig& config = model.config();
  for (const int64_t tokens : {0, 1, 37}) {
    const RequestState state = prefilled(model, tokens, static_cast<uint32_t>(tokens));
    const Bytes bytes = encode_state(config, state);
    auto decoded = decode_state(config, bytes);
    ASSERT_TRUE(decoded.is_ok()) << decoded.status().to_string();
    EXPECT_TRUE(decoded->same_contents(state)) << tokens << " tokens";
    EXPECT_EQ(decoded->num_tokens(), tokens);
    EXPECT_EQ(bytes.size(), 56 + 8 * state.mla.size() + static_cast<size_t>(state.kda_state_bytes()) +
                                static_cast<size_t>(state.mla_cache_bytes()) + 8);
  }
  // Bit patterns == cannot compare (NaN payloads, -0): the re-encoding must be byte-identical.
  RequestState odd = prefilled(model, 5, 9);
  poison(odd, 3);
  const Bytes bytes = encode_state(config, odd);
  auto decoded = decode_state(config, bytes);
  ASSERT_TRUE(decoded.is_ok()) << decoded.status().to_string();
  EXPECT_EQ(encode_state(config, *decoded), bytes);
  EXPECT_TRUE(std::signbit(decoded->kda[0].conv_q[0]));
}

TEST(StateCodec, DecodedStateContinuesGenerationIdentically) {
  const Model& model = tiny_model();
  RequestState original = prefilled(model, 23, 4);
  auto decoded = decode_state(model.config(), encode_state(model.config(), original));
  ASSERT_TRUE(decoded.is_ok()) << decoded.status().to_string();
  RequestState copy = std::move(decoded).value();
  int32_t next_a = 17, next_b = 17;
  for (int step = 0; step < 12; ++step) {
    std::vector<std::vector<float>> a, b;
    SequenceInput in_a{&original, {&next_a, 1}, false}, in_b{&copy, {&next_b, 1}, false};
    ASSERT_TRUE(model.forward({&in_a, 1}, a).is_ok());
    ASSERT_TRUE(model.forward({&in_b, 1}, b).is_ok());
    ASSERT_EQ(a[0], b[0]) << "step " << step;  // same arithmetic on the same bits
    next_a = next_b = static_cast<int32_t>(std::max_element(a[0].begin(), a[0].end()) - a[0].begin());
  }
  EXPECT_TRUE(copy.same_contents(original));
}

TEST(StateCodec, TruncationAtEveryCutIsRejected) {
  const Model& model = tiny_model();
  const Bytes bytes = encode_state(model.config(), prefilled(model, 3, 1));
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    expect_data_loss(model.config(), Bytes(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(cut)),
                     "truncated", "cut at " + std::to_string(cut));
  }
  Bytes longer = bytes;
  longer.push_back(std::byte{0});
  expect_data_loss(model.config(), longer, "trailing", "one byte appended");
}

TEST(StateCodec, FlippedByteAnywhereIsRejected) {
  const Model& model = tiny_model();
  const Bytes bytes = encode_state(model.config(), prefilled(model, 6, 2));
  std::vector<size_t> positions;
  for (size_t i = 0; i < 128; ++i) positions.push_back(i);  // the whole header
  for (size_t i = 128; i < bytes.size(); i += 61) positions.push_back(i);
  for (size_t i = bytes.size() - 8; i < bytes.size(); ++i) positions.push_back(i);  // the checksum itself
  for (size_t position : positions) {
    for (const uint8_t mask : {uint8_t{0x01}, uint8_t{0x80}, uint8_t{0xff}}) {
      Bytes corrupt = bytes;
      corrupt[position] ^= std::byte{mask};
      const std::string what = "byte " + std::to_string(position) + " ^ " + std::to_string(mask);
      if (position < 4) {
        expect_data_loss(model.config(), corrupt, "magic", what);
      } else if (position < 8) {
        expect_data_loss(model.config(), corrupt, "version", what);
      } else if (position < 16) {
        expect_data_loss(model.config(), corrupt, "bytes", what);  // truncated / trailing: the size is wrong
      } else {
        expect_data_loss(model.config(), corrupt, "checksum", what);
      }
    }
  }
}

TEST(StateCodec, BadMagicAndVersion) {
  const Model& model = tiny_model();
  const Bytes bytes = encode_state(model.config(), prefilled(model, 2, 3));
  Bytes magic = bytes;
  magic[0] = std::byte{'X'};
  expect_data_loss(model.config(), magic, "magic", "bad magic");
  Bytes version = bytes;
  store<uint32_t>(version, 4, 2);
  reseal(version);
  expect_data_loss(model.config(), version, "version 2", "version 2");
  store<uint32_t>(version, 4, 0);
  reseal(version);
  expect_data_loss(model.config(), version, "version 0", "version 0");
  expect_data_loss(model.config(), Bytes(bytes.size(), std::byte{0}), "magic", "all zero");
}

TEST(StateCodec, StateOfAnotherModelIsRejected) {
  const Model& model = tiny_model();
  auto k3 = preset_config("tiny-k3");
  ASSERT_TRUE(k3.is_ok());
  EXPECT_NE(state_fingerprint(*k3), state_fingerprint(model.config()));
  EXPECT_EQ(state_fingerprint(*preset_config("tiny-linear")), state_fingerprint(model.config()));

  // Another preset: other layer counts and shapes.
  RequestState k3_state(*k3);
  poison(k3_state, 1);
  expect_data_loss(model.config(), encode_state(*k3, k3_state), "fingerprint", "tiny-k3 state");
  expect_data_loss(*k3, encode_state(model.config(), prefilled(model, 4, 5)), "fingerprint", "tiny-linear state");

  // Same state shapes, other architecture (hidden size): only the fingerprint can tell.
  ModelConfig wider = model.config();
  wider.hidden_size *= 2;
  ASSERT_NE(state_fingerprint(wider), state_fingerprint(model.config()));
  expect_data_loss(wider, encode_state(model.config(), prefilled(model, 4, 5)), "another model", "other hidden size");
}

TEST(StateCodec, LayerCountAndSectionSizeMismatchesAreNamed) {
  const Model& model = tiny_model();
  const ModelConfig& config = model.config();
  const Bytes bytes = encode_state(config, prefilled(model, 4, 6));
  auto mutated = [&](auto&& edit) {
    Bytes copy = bytes;
    edit(copy);
    reseal(copy);
    return copy;
  };
  expect_data_loss(config, mutated([](Bytes& b) { store<uint32_t>(b, 32, 3); }), "3 KDA layers", "KDA layers");
  expect_data_loss(config, mutated([](Bytes& b) { store<uint32_t>(b, 36, 7); }), "7 MLA layers", "MLA layers");
  expect_data_loss(config, mutated([](Bytes& b) { store<uint64_t>(b, 40, 4); }), "conv tail section size",
                   "conv tail bytes");
  expect_data_loss(config, mutated([](Bytes& b) { store<uint64_t>(b, 48, 0); }), "recurrent section size",
                   "recurrent bytes");
  expect_data_loss(config, mutated([](Bytes& b) { store<uint64_t>(b, 56 + 8, 12); }), "MLA layer 1 section size",
                   "MLA layer bytes");
  expect_data_loss(config, mutated([](Bytes& b) { store<int64_t>(b, 24, 5); }), "MLA layer 0 section size",
                   "token count not matching the MLA rows");
  expect_data_loss(config, mutated([](Bytes& b) { store<int64_t>(b, 24, -1); }), "token count", "negative tokens");
  expect_data_loss(config, mutated([](Bytes& b) { store<int64_t>(b, 24, std::numeric_limits<int64_t>::max()); }),
                   "token count", "huge token count");
  // Extra payload with a consistent total size: the sections no longer add up.
  Bytes padded = bytes;
  padded.insert(padded.end() - 8, 16, std::byte{0});
  store<uint64_t>(padded, 8, padded.size());
  reseal(padded);
  expect_data_loss(config, padded, "add up to", "padded payload");
}

// Random corruption (bytes, header fields, sizes; checksum resealed or not) never crashes or reads out
// of bounds (run under ASan), and never yields anything but a state or DataLoss.
TEST(StateCodec, RandomMutationsNeverCrash) {
  const Model& model = tiny_model();
  const ModelConfig& config = model.config();
  const Bytes original = encode_state(config, prefilled(model, 3, 8));
  std::mt19937_64 rng(2024);
  int accepted = 0;
  for (int iteration = 0; iteration < 1000; ++iteration) {
    Bytes bytes = original;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits && !bytes.empty(); ++e) {
      switch (rng() % 6) {
        case 0:  // a random byte anywhere
          bytes[rng() % bytes.size()] = static_cast<std::byte>(rng());
          break;
        case 1:  // a random header field value (u64 at an 8-aligned offset, or u32)
          if (bytes.size() >= 64) {
            const size_t offset = 8 * (1 + rng() % 7);
            if (rng() % 2) {
              store<uint64_t>(bytes, offset, rng() >> (rng() % 64));
            } else {
              store<uint32_t>(bytes, offset + 4 * (rng() % 2), static_cast<uint32_t>(rng() % 16));
            }
          }
          break;
        case 2:  // truncate
          bytes.resize(rng() % bytes.size());
          break;
        case 3:  // grow
          bytes.resize(bytes.size() + rng() % 64, static_cast<std::byte>(rng()));
          break;
        case 4:  // make the size field agree with the buffer
          if (bytes.size() >= 16) store<uint64_t>(bytes, 8, bytes.size());
          break;
        default:  // drop a range from the middle
          if (bytes.size() > 2) {
            const size_t begin = rng() % bytes.size();
            const size_t end = std::min(bytes.size(), begin + 1 + rng() % 100);
            bytes.erase(bytes.begin() + static_cast<std::ptrdiff_t>(begin),
                        bytes.begin() + static_cast<std::ptrdiff_t>(end));
          }
          break;
      }
    }
    if (bytes.size() >= 8 && rng() % 2) reseal(bytes);
    auto decoded = decode_state(config, bytes);
    if (decoded.is_ok()) {
      ++accepted;
      // Only a frame that is fully consistent decodes; it re-encodes to exactly the bytes given.
      EXPECT_EQ(encode_state(config, *decoded), bytes) << "iteration " << iteration;
    } else {
      EXPECT_EQ(decoded.status().code(), StatusCode::kDataLoss) << decoded.status().to_string();
    }
  }
  std::printf("[ mutations ] 1000 mutated buffers, %d decoded (payload-only edits, resealed)\n", accepted);
}

}  // namespace
}  // namespace deltaserve::engine
