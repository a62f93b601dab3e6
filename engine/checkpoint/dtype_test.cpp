// Bit-exact tests of the bf16 / fp16 / fp8-e4m3fn conversions against independent references.
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>

#include <gtest/gtest.h>

#include "engine/checkpoint/safetensors.hpp"

namespace deltaserve::engine {
namespace {

bool same_bits(float a, float b) {
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}

// Independent value definitions of the formats (no bit tricks shared with the implementation).
double reference_f16_value(uint32_t code) {
  const int exponent = (code >> 10) & 0x1F;
  const int mantissa = code & 0x3FF;
  const double magnitude = exponent == 0 ? std::ldexp(mantissa, -24) : std::ldexp(1024 + mantissa, exponent - 25);
  return (code & 0x8000) ? -magnitude : magnitude;
}

double reference_f8_value(uint32_t code) {
  const int exponent = (code >> 3) & 0xF;
  const int mantissa = code & 0x7;
  const double magnitude = exponent == 0 ? std::ldexp(mantissa, -9) : std::ldexp(8 + mantissa, exponent - 10);
  return (code & 0x80) ? -magnitude : magnitude;
}

// Round-to-nearest-even by search: the largest positive code whose value is <= |x|, compared with the
// next one. `beyond` is the value one step past the largest finite code (IEEE: overflow to Inf at the
// code max_finite + 1), or NaN to saturate at max_finite.
uint32_t reference_round(double x, uint32_t max_finite, const std::function<double(uint32_t)>& value, double beyond,
                         uint32_t sign_bit) {
  const double magnitude = std::fabs(x);
  uint32_t low = 0, high = max_finite;  // invariant: value(low) <= magnitude
  while (low < high) {
    const uint32_t middle = (low + high + 1) / 2;
    if (value(middle) <= magnitude)
      low = middle;
    else
      high = middle - 1;
  }
  uint32_t code = low;
  const double next = low == max_finite ? beyond : value(low + 1);
  if (!std::isnan(next)) {
    const double below = magnitude - value(low), above = next - magnitude;
    if (above < below || (above == below && (low & 1))) code = low + 1;
  }
  return std::signbit(x) ? (code | sign_bit) : code;
}

TEST(SafetensorsConversion, Bf16AllCodesRoundTrip) {
  for (uint32_t code = 0; code < 65536; ++code) {
    const float value = bf16_to_float(static_cast<uint16_t>(code));
    ASSERT_TRUE(same_bits(value, std::bit_cast<float>(code << 16))) << code;
    if (std::isnan(value)) {
      ASSERT_TRUE(std::isnan(bf16_to_float(float_to_bf16(value)))) << code;
    } else {
      ASSERT_EQ(float_to_bf16(value), code) << code;
    }
  }
}

TEST(SafetensorsConversion, F16AllCodesRoundTrip) {
  for (uint32_t code = 0; code < 65536; ++code) {
    const float value = f16_to_float(static_cast<uint16_t>(code));
    const bool is_nan = (code & 0x7C00) == 0x7C00 && (code & 0x3FF) != 0;
    const bool is_inf = (code & 0x7FFF) == 0x7C00;
    if (is_nan) {
      ASSERT_TRUE(std::isnan(value)) << code;
      ASSERT_TRUE(std::isnan(f16_to_float(float_to_f16(value)))) << code;
      continue;
    }
    if (is_inf) {
      ASSERT_TRUE(std::isinf(value) && std::signbit(value) == bool(code & 0x8000)) << code;
    } else {
      ASSERT_EQ(static_cast<double>(value), reference_f16_value(code)) << code;
      ASSERT_EQ(std::signbit(value), bool(code & 0x8000)) << code;
    }
    ASSERT_EQ(float_to_f16(value), code) << code;
  }
}

TEST(SafetensorsConversion, F8E4M3AllCodesRoundTrip) {
  for (uint32_t code = 0; code < 256; ++code) {
    const float value = f8e4m3_to_float(static_cast<uint8_t>(code));
    if ((code & 0x7F) == 0x7F) {
      ASSERT_TRUE(std::isnan(value)) << code;
      ASSERT_EQ(float_to_f8e4m3(value) & 0x7F, 0x7F) << code;
      continue;
    }
    ASSERT_EQ(static_cast<double>(value), reference_f8_value(code)) << code;
    ASSERT_EQ(std::signbit(value), bool(code & 0x80)) << code;
    ASSERT_EQ(float_to_f8e4m3(value), code) << code;
  }
  EXPECT_EQ(f8e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(f8e4m3_to_float(0x01), 0x1p-9f);
  EXPECT_EQ(f8e4m3_to_float(0x08), 0x1p-6f);
}

TEST(SafetensorsConversion, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(float_to_bf16(inf), 0x7F80);
  EXPECT_EQ(float_to_bf16(-inf), 0xFF80);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(nan))));
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::bit_cast<float>(0x7F800001u)))));  // NaN with low payload
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7F80);                       // rounds past the max
  EXPECT_EQ(float_to_f16(inf), 0x7C00);
  EXPECT_EQ(float_to_f16(-inf), 0xFC00);
  EXPECT_EQ(float_to_f16(65504.0f), 0x7BFF);
  EXPECT_EQ(float_to_f16(65519.0f), 0x7BFF);
  EXPECT_EQ(float_to_f16(65520.0f), 0x7C00);
  EXPECT_EQ(float_to_f16(0x1p-24f), 0x0001);
  EXPECT_EQ(float_to_f16(0x1p-25f), 0x0000);  // tie -> even (zero)
  EXPECT_EQ(float_to_f16(0x1.8p-24f), 0x0002);
  EXPECT_EQ(float_to_f16(-0.0f), 0x8000);
  EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(std::bit_cast<float>(0x7F800001u)))));
  EXPECT_EQ(float_to_f8e4m3(inf), 0x7E);  // e4m3fn has no Inf: saturate
  EXPECT_EQ(float_to_f8e4m3(-inf), 0xFE);
  EXPECT_EQ(float_to_f8e4m3(1e9f), 0x7E);
  EXPECT_EQ(float_to_f8e4m3(464.0f), 0x7E);
  EXPECT_EQ(float_to_f8e4m3(nan), 0x7F);
  EXPECT_EQ(float_to_f8e4m3(-nan), 0xFF);
  EXPECT_EQ(float_to_f8e4m3(0x1p-10f), 0x00);   // tie -> even (zero)
  EXPECT_EQ(float_to_f8e4m3(0x1.8p-9f), 0x02);  // tie between codes 1 and 2 -> 2
  EXPECT_EQ(float_to_f8e4m3(-0.0f), 0x80);
}

// bf16 rounding against a bit-level reference: truncate to the lower neighbour, take the next one
// up, pick the nearer by exact double arithmetic, ties to the even code.
uint16_t reference_bf16(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t lower = bits & 0x7FFF0000u;
  const uint32_t upper = lower + 0x10000u;
  const double magnitude = std::fabs(static_cast<double>(x));
  const double low_value = std::bit_cast<float>(lower);
  const double high_value = upper == 0x7F800000u ? std::ldexp(1.0, 128) : double(std::bit_cast<float>(upper));
  const double below = magnitude - low_value, above = high_value - magnitude;
  uint32_t chosen = lower;
  if (above < below || (above == below && ((lower >> 16) & 1))) chosen = upper;
  return static_cast<uint16_t>((sign | chosen) >> 16);
}

TEST(SafetensorsConversion, Bf16RoundingMatchesReference) {
  std::mt19937 generator(7);
  auto check = [](float x) {
    if (std::isnan(x) || std::isinf(x)) return;
    ASSERT_EQ(float_to_bf16(x), reference_bf16(x)) << std::hexfloat << x;
  };
  for (int i = 0; i < 1'000'000; ++i) check(std::bit_cast<float>(static_cast<uint32_t>(generator())));
  // Every midpoint between neighbouring codes (exact in fp32) and one ulp either side of it.
  for (uint32_t code = 0; code < 0x7F80; ++code) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      const uint32_t midpoint = sign | (code << 16) | 0x8000u;
      check(std::bit_cast<float>(midpoint));
      check(std::bit_cast<float>(midpoint - 1));
      check(std::bit_cast<float>(midpoint + 1));
    }
  }
}

TEST(SafetensorsConversion, F16RoundingMatchesReference) {
  auto value = [](uint32_t code) { return reference_f16_value(code); };
  auto check = [&](float x) {
    const uint32_t expected = reference_round(x, 0x7BFF, value, 65536.0, 0x8000);
    ASSERT_EQ(float_to_f16(x), expected) << std::hexfloat << x;
  };
  std::mt19937 generator(11);
  std::uniform_int_distribution<uint32_t> exponent(90, 143);  // from below the subnormals to past Inf
  for (int i = 0; i < 200'000; ++i) {
    const uint32_t bits = (generator() & 0x807FFFFFu) | (exponent(generator) << 23);
    if ((bits & 0x7FFFFFFFu) >= 0x7F800000u) continue;
    check(std::bit_cast<float>(bits));
  }
  for (uint32_t code = 0; code < 0x7BFF; ++code) {
    const float midpoint = static_cast<float>((value(code) + value(code + 1)) / 2);
    for (float x : {midpoint, std::nextafter(midpoint, 0.0f), std::nextafter(midpoint, 1e9f)}) {
      check(x);
      check(-x);
    }
  }
}

TEST(SafetensorsConversion, F8E4M3RoundingMatchesReference) {
  auto value = [](uint32_t code) { return reference_f8_value(code); };
  auto check = [&](float x) {
    const uint32_t expected = reference_round(x, 0x7E, value, std::nan(""), 0x80);  // saturating
    ASSERT_EQ(float_to_f8e4m3(x), expected) << std::hexfloat << x;
  };
  std::mt19937 generator(13);
  std::uniform_int_distribution<uint32_t> exponent(105, 140);
  for (int i = 0; i < 200'000; ++i) {
    const uint32_t bits = (generator() & 0x807FFFFFu) | (exponent(generator) << 23);
    check(std::bit_cast<float>(bits));
  }
  for (uint32_t code = 0; code < 0x7E; ++code) {
    const float midpoint = static_cast<float>((value(code) + value(code + 1)) / 2);
    for (float x : {midpoint, std::nextafter(midpoint, 0.0f), std::nextafter(midpoint, 1e9f)}) {
      check(x);
      check(-x);
    }
  }
}

}  // namespace
}  // namespace deltaserve::engine
