// DType names and sizes, and the bf16 / fp16 / fp8-e4m3fn <-> fp32 conversions (bit-exact, no
// hardware intrinsics, so the CPU reference and the checkpoint writer agree on every platform).
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "engine/checkpoint/safetensors.hpp"

namespace deltaserve::engine {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kF8E4M3:
      return "F8_E4M3";
    case DType::kU8:
      return "U8";
    case DType::kI8:
      return "I8";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
    case DType::kF64:
      return "F64";
    case DType::kBool:
      return "BOOL";
  }
  return "?";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kF8E4M3:
    case DType::kU8:
    case DType::kI8:
    case DType::kBool:
      return 1;
    case DType::kI64:
    case DType::kF64:
      return 8;
  }
  return 0;
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3, DType::kU8, DType::kI8, DType::kI32,
                  DType::kI64, DType::kF64, DType::kBool}) {
    if (name == dtype_name(d)) return d;
  }
  return std::nullopt;
}

std::string fp8_scale_name(std::string_view weight_name) {
  return std::string(weight_name) + "_scale_inv";
}

namespace {

// Shifts `magnitude` right by `shift` (1..31) rounding to nearest, ties to even.
uint32_t shift_right_round_even(uint32_t magnitude, int shift) {
  const uint32_t quotient = magnitude >> shift;
  const uint32_t remainder = magnitude & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  return quotient + ((remainder > half || (remainder == half && (quotient & 1))) ? 1 : 0);
}

}  // namespace

uint16_t float_to_bf16(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // quiet NaN
  // Adding 0x7FFF (+1 when the kept lsb is odd) rounds to nearest even; a carry out of the mantissa
  // bumps the exponent, and past the largest finite it lands exactly on Inf.
  const uint32_t rounded = bits + 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

float bf16_to_float(uint16_t x) {
  return std::bit_cast<float>(static_cast<uint32_t>(x) << 16);
}

uint16_t float_to_f16(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((magnitude >> 13) & 0x3FFu));  // NaN
  if (magnitude >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 (or Inf): Inf
  const int exponent = static_cast<int>(magnitude >> 23);                      // biased by 127
  if (exponent >= 113) {  // normal in f16 (>= 2^-14): rebias 127 -> 15 and round 13 bits away
    const uint32_t rounded = magnitude + 0x0FFFu + ((magnitude >> 13) & 1u) - (112u << 23);
    return static_cast<uint16_t>(sign | (rounded >> 13));
  }
  if (exponent < 102) return sign;  // below 2^-25: rounds to (signed) zero
  // f16 subnormal: value / 2^-24 rounded; may round up to the smallest normal 0x0400.
  const uint32_t mantissa = (magnitude & 0x7FFFFFu) | 0x800000u;
  return static_cast<uint16_t>(sign | shift_right_round_even(mantissa, 126 - exponent));
}

float f16_to_float(uint16_t x) {
  const uint32_t sign = static_cast<uint32_t>(x & 0x8000u) << 16;
  const uint32_t exponent = (x >> 10) & 0x1Fu;
  const uint32_t mantissa = x & 0x3FFu;
  if (exponent == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | (mantissa << 13));  // Inf / NaN
  if (exponent != 0) return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  const float value = static_cast<float>(mantissa) * 0x1p-24f;  // subnormal or zero, exact
  return sign ? -value : value;
}

uint8_t float_to_f8e4m3(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return static_cast<uint8_t>(sign | 0x7Fu);   // NaN
  if (magnitude >= 0x43E00000u) return static_cast<uint8_t>(sign | 0x7Eu);  // >= 448 or Inf: saturate
  const int exponent = static_cast<int>(magnitude >> 23);
  if (exponent >= 121) {  // normal in e4m3 (>= 2^-6): rebias 127 -> 7 and round 20 bits away
    // Below 448 the rounding can reach at most 448 (0x7E), never the NaN code.
    const uint32_t rounded = magnitude + 0x7FFFFu + ((magnitude >> 20) & 1u) - (120u << 23);
    return static_cast<uint8_t>(sign | (rounded >> 20));
  }
  if (exponent < 117) return sign;  // below 2^-10 (half the smallest subnormal 2^-9): zero
  // Subnormal: value / 2^-9 rounded; may round up to the smallest normal 0x08.
  const uint32_t mantissa = (magnitude & 0x7FFFFFu) | 0x800000u;
  return static_cast<uint8_t>(sign | shift_right_round_even(mantissa, 141 - exponent));
}

float f8e4m3_to_float(uint8_t x) {
  const uint32_t exponent = (x >> 3) & 0xFu;
  const uint32_t mantissa = x & 0x7u;
  float value;
  if (exponent == 0xF && mantissa == 0x7) {
    value = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    value = static_cast<float>(mantissa) * 0x1p-9f;
  } else {
    value = std::bit_cast<float>(((exponent + 120u) << 23) | (mantissa << 20));
  }
  return (x & 0x80u) ? -value : value;
}

}  // namespace deltaserve::engine
