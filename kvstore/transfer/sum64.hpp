// The transfer layer's checksum for pieces in GPU memory (ChecksumKind::kSum64): a sum, modulo 2^64, of one
// independent term per 8-byte word, so any number of threads can hash any slice of a piece and add up.
//
//   words   w_i = little-endian u64 at byte 8*i of the piece's bytes in segment order; the last word is
//           zero-padded when the length is not a multiple of 8
//   term    t_i = mix(w_i XOR (i + 1) * kSum64Key)     mix: multiply by an odd constant, xor-shift,
//                                                      multiply, xor-shift (each step a bijection)
//   value   finish(sum_i t_i, n) = avalanche(sum + n * kSum64Length)
//
// Guarantee (as checksum64's): for a fixed position i, w -> t_i is a bijection, and the other terms do not
// change, so two inputs of the same length that differ inside one aligned 8-byte word always hash
// differently. A word moved to another position changes its key, so reordering is detected too; other
// differences collide with probability about 2^-64. Not cryptographic.
//
// Header-only and free of dependencies so that the CUDA kernel (kvstore/transfer/cuda/) and the CPU
// implementation (checksum.hpp, Sum64) compute the same function from one definition.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DS_SUM64_FN __host__ __device__ __forceinline__
#else
#define DS_SUM64_FN inline
#endif

namespace deltaserve::kvstore::transfer::sum64_terms {

inline constexpr uint64_t kKey = 0x9E3779B97F4A7C15ull;
inline constexpr uint64_t kMulA = 0xC2B2AE3D27D4EB4Full;
inline constexpr uint64_t kMulB = 0x165667B19E3779F9ull;
inline constexpr uint64_t kLength = 0xD6E8FEB86659FD93ull;

// Term of word `word` at word index `index` (0-based).
DS_SUM64_FN constexpr uint64_t term(uint64_t word, uint64_t index) {
  uint64_t x = word ^ ((index + 1) * kKey);
  x *= kMulA;
  x ^= x >> 32;
  x *= kMulB;
  x ^= x >> 29;
  return x;
}

// The checksum of `total_bytes` bytes whose terms add up to `sum`.
DS_SUM64_FN constexpr uint64_t finish(uint64_t sum, uint64_t total_bytes) {
  uint64_t h = sum + total_bytes * kLength;
  h ^= h >> 31;
  h *= kMulB;
  h ^= h >> 29;
  h *= kMulA;
  h ^= h >> 32;
  return h;
}

}  // namespace deltaserve::kvstore::transfer::sum64_terms
