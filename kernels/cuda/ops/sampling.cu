// GPU sampling, the same choice as engine::Sampler (engine/sampler.cpp) given the same uniform draw:
//   1. prep (one block per row): NaN -> -inf, +inf -> FLT_MAX (all -inf: every value 0), the argmax (ties to the
//      lowest id) and log Σ exp(v - max) in fp64; writes each row's cleaned values and ids for the sort;
//   2. cub::DeviceSegmentedRadixSort, descending by value per row (stable, so ties keep ascending ids: the
//      CPU's (value desc, id asc) order);
//   3. choose (one block per row): logprob, top_logprobs (each row's own count) from the sorted prefix; greedy
//      rows take the argmax; other rows take weights exp((v - max) / T) in fp64 and invert the CDF at the draw:
//      in index order when neither top-k nor top-p filters (as the CPU does), else over the top-k prefix of the
//      sorted order cut to the nucleus (the fewest best tokens with mass >= top_p · top-k mass).
// The sums are block reductions (not the CPU's sequential order), so a draw within ~1e-15 of a CDF boundary may
// pick a neighbour; nothing else differs. One known difference: with top_p < 1 and more than 64 candidates the
// CPU inverts its CDF over the nucleus in its quickselect's partition order, here in sorted order.
// Cost: rows that filter or report top_logprobs are sorted whole (a segmented radix sort, one block per row;
// the other rows get empty segments); the workspace holds 16 bytes per logit.
#include <cfloat>
#include <string>

#include <cub/cub.cuh>

#include "kernels/cuda/ops/sampling.hpp"

namespace deltaserve::kernels::cuda {
namespace {

constexpr int kThreads = 512;
constexpr size_t kAlign = 256;

struct RowStats {
  double log_sum;   // log Σ exp(v - max); a logprob is (v - max) - log_sum (max first: FLT_MAX + log 2 == FLT_MAX)
  float max_value;  // 0 when every logit is masked
  int32_t argmax;
  int32_t all_masked;  // every logit NaN or -inf: all values count as 0 (uniform)
};

size_t align_up(size_t x) {
  return (x + kAlign - 1) / kAlign * kAlign;
}

// The workspace carve-up; `base` may be null to size it.
struct Layout {
  int32_t* begins = nullptr;  // [rows] segment of row r in the sort: [begins[r], ends[r])
  int32_t* ends = nullptr;    // [rows] (empty when the row needs no sorted order)
  RowStats* stats = nullptr;  // [rows]
  float* keys_a = nullptr;    // [rows * vocab]: the sort's double buffers (cleaned values, then ids)
  float* keys_b = nullptr;
  int32_t* ids_a = nullptr;
  int32_t* ids_b = nullptr;
  void* sort_temp = nullptr;
  size_t sort_temp_bytes = 0;
  size_t total = 0;
};

Layout make_layout(void* base, int rows, int64_t vocab) {
  Layout l;
  const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(vocab);
  size_t offset = 0;
  auto take = [&](size_t bytes) {
    char* p = base == nullptr ? nullptr : static_cast<char*>(base) + offset;
    offset += align_up(bytes);
    return p;
  };
  l.begins = reinterpret_cast<int32_t*>(take(static_cast<size_t>(rows) * sizeof(int32_t)));
  l.ends = reinterpret_cast<int32_t*>(take(static_cast<size_t>(rows) * sizeof(int32_t)));
  l.stats = reinterpret_cast<RowStats*>(take(static_cast<size_t>(rows) * sizeof(RowStats)));
  l.keys_a = reinterpret_cast<float*>(take(n * sizeof(float)));
  l.keys_b = reinterpret_cast<float*>(take(n * sizeof(float)));
  l.ids_a = reinterpret_cast<int32_t*>(take(n * sizeof(int32_t)));
  l.ids_b = reinterpret_cast<int32_t*>(take(n * sizeof(int32_t)));
  // The double-buffer form needs no vocab-sized scratch of its own (the result lands in either buffer).
  size_t temp_bytes = 0;
  cub::DoubleBuffer<float> keys(l.keys_a, l.keys_b);
  cub::DoubleBuffer<int32_t> ids(l.ids_a, l.ids_b);
  cub::DeviceSegmentedRadixSort::SortPairsDescending(nullptr, temp_bytes, keys, ids, static_cast<int>(n), rows,
                                                     static_cast<const int32_t*>(nullptr),
                                                     static_cast<const int32_t*>(nullptr));
  l.sort_temp_bytes = temp_bytes;
  l.sort_temp = take(temp_bytes);
  l.total = offset;
  return l;
}

__device__ __forceinline__ float clean_logit(float v) {
  if (isnan(v)) return -INFINITY;
  if (v == INFINITY) return FLT_MAX;
  return v;
}

struct ArgMax {
  float value;
  int32_t id;
};

struct ArgMaxOp {
  __device__ __forceinline__ ArgMax operator()(const ArgMax& a, const ArgMax& b) const {
    if (a.value != b.value) return a.value > b.value ? a : b;
    return a.id < b.id ? a : b;
  }
};

// Alternatives reported by row r (its own count when the caller gives one, clamped to the row stride).
__device__ __forceinline__ int row_top_logprobs(const int32_t* row_counts, int top_logprobs, int r) {
  return row_counts != nullptr ? min(max(row_counts[r], 0), top_logprobs) : top_logprobs;
}

// One block per SM is enough to fill it (512 threads); without the hint ptxas capped prep at 40 registers and spilled.
__global__ void __launch_bounds__(kThreads, 1) prep_kernel(SampleParams p, Layout l) {
  using Reduce = cub::BlockReduce<ArgMax, kThreads>;
  using ReduceDouble = cub::BlockReduce<double, kThreads>;
  __shared__ union {
    typename Reduce::TempStorage argmax;
    typename ReduceDouble::TempStorage sum;
  } temp;
  __shared__ ArgMax best_shared;
  const int r = blockIdx.x;
  const int64_t vocab = p.vocab;
  const float* row = p.logits + r * vocab;
  // Only rows that filter (top-k / top-p while sampling) or report top_logprobs read the sorted order.
  const int32_t top_k_raw = p.top_k[r];
  const int64_t top_k = top_k_raw > 0 && top_k_raw < vocab ? top_k_raw : vocab;
  const bool sampled = p.temperature[r] > 0.0f && top_k > 1;
  const bool needs_sort =
      row_top_logprobs(p.row_top_logprobs, p.top_logprobs, r) > 0 || (sampled && (top_k < vocab || p.top_p[r] < 1.0f));
  if (threadIdx.x == 0) {
    l.begins[r] = static_cast<int32_t>(r * vocab);
    l.ends[r] = static_cast<int32_t>(r * vocab + (needs_sort ? vocab : 0));
  }
  ArgMax best{-INFINITY, 0x7fffffff};
  for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
    const float v = clean_logit(row[i]);
    if (v > best.value || (v == best.value && i < best.id)) best = {v, static_cast<int32_t>(i)};
  }
  best = Reduce(temp.argmax).Reduce(best, ArgMaxOp());
  if (threadIdx.x == 0) best_shared = best;
  __syncthreads();
  best = best_shared;
  const bool all_masked = best.value == -INFINITY;
  const float max_value = all_masked ? 0.0f : best.value;
  double sum = 0.0;
  float* keys = l.keys_a + r * vocab;
  int32_t* ids = l.ids_a + r * vocab;
  for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
    float v = all_masked ? 0.0f : clean_logit(row[i]);
    if (v == 0.0f) v = 0.0f;  // -0 sorts like +0 (the CPU compares values with ==)
    if (needs_sort) {
      keys[i] = v;
      ids[i] = static_cast<int32_t>(i);
    }
    sum += exp(static_cast<double>(v) - max_value);
  }
  sum = ReduceDouble(temp.sum).Sum(sum);
  if (threadIdx.x == 0) {
    l.stats[r] = RowStats{log(sum), max_value, all_masked ? 0 : best.id, all_masked ? 1 : 0};
  }
}

// First i in [0, count) whose inclusive prefix sum of weight(i) is > threshold (strict) or >= threshold, or -1.
template <class WeightFn>
__device__ int64_t first_crossing(int64_t count, WeightFn weight, double threshold, bool strict) {
  using Scan = cub::BlockScan<double, kThreads>;
  __shared__ typename Scan::TempStorage scan_temp;
  __shared__ unsigned long long found;
  __syncthreads();  // every thread has read `found` of a previous call
  if (threadIdx.x == 0) found = ~0ull;
  double carry = 0.0;
  for (int64_t begin = 0; begin < count; begin += kThreads) {
    const int64_t i = begin + threadIdx.x;
    const double w = i < count ? weight(i) : 0.0;
    double cumulative, chunk_total;
    __syncthreads();  // scan_temp reuse; `found` initialised
    Scan(scan_temp).InclusiveSum(w, cumulative, chunk_total);
    cumulative += carry;
    const bool hit = i < count && (strict ? cumulative > threshold : cumulative >= threshold);
    if (hit) atomicMin(&found, static_cast<unsigned long long>(i));
    __syncthreads();
    if (found != ~0ull) return static_cast<int64_t>(found);
    carry += chunk_total;
  }
  return -1;
}

template <class WeightFn>
__device__ double block_sum(int64_t count, WeightFn weight) {
  using Reduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename Reduce::TempStorage reduce_temp;
  __shared__ double result;
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kThreads) sum += weight(i);
  __syncthreads();
  sum = Reduce(reduce_temp).Sum(sum);
  if (threadIdx.x == 0) result = sum;
  __syncthreads();
  return result;
}

// sorted_keys / sorted_ids_all: the sort's output buffers (which of the two is known on the host after the sort).
__global__ void __launch_bounds__(kThreads)
    choose_kernel(SampleParams p, const RowStats* __restrict__ all_stats, const float* __restrict__ sorted_keys,
                  const int32_t* __restrict__ sorted_ids_all) {
  const int r = blockIdx.x;
  const int64_t vocab = p.vocab;
  const RowStats stats = all_stats[r];
  const float* logits = p.logits + r * vocab;  // raw, index order (the sort may have overwritten keys_a)
  const bool all_masked = stats.all_masked != 0;
  auto value = [&](int64_t i) { return all_masked ? 0.0f : clean_logit(logits[i]); };
  const float* sorted_values = sorted_keys + r * vocab;
  const int32_t* sorted_ids = sorted_ids_all + r * vocab;

  // top_logprobs: the sorted prefix (entries past the vocabulary or the row's own count: id -1, -inf; a row without
  // alternatives may not have been sorted).
  for (int i = threadIdx.x; i < p.top_logprobs; i += kThreads) {
    const int row_top = row_top_logprobs(p.row_top_logprobs, p.top_logprobs, r);
    const bool valid = i < vocab && i < row_top;
    if (p.top_ids != nullptr) p.top_ids[r * p.top_logprobs + i] = valid ? sorted_ids[i] : -1;
    if (p.top_values != nullptr) {
      p.top_values[r * p.top_logprobs + i] =
          valid ? static_cast<float>((static_cast<double>(sorted_values[i]) - stats.max_value) - stats.log_sum)
                : -INFINITY;
    }
  }

  int32_t token = stats.argmax;
  const float temperature = p.temperature[r];
  const int32_t top_k_raw = p.top_k[r];
  const int64_t top_k = top_k_raw > 0 && top_k_raw < vocab ? top_k_raw : vocab;
  if (temperature > 0.0f && top_k > 1) {
    const double inverse_temperature = 1.0 / static_cast<double>(temperature);
    const double max_value = stats.max_value;
    const float top_p = p.top_p[r];
    const double u = p.uniform[r];
    if (top_k < vocab || top_p < 1.0f) {
      auto sorted_weight = [&](int64_t i) {
        return exp((static_cast<double>(sorted_values[i]) - max_value) * inverse_temperature);
      };
      const double top_k_mass = block_sum(top_k, sorted_weight);
      int64_t kept = top_k;
      double kept_mass = top_k_mass;
      if (top_p < 1.0f) {
        const int64_t last = first_crossing(top_k, sorted_weight, top_k_mass * static_cast<double>(top_p), false);
        if (last >= 0 && last + 1 < top_k) {
          kept = last + 1;
          kept_mass = block_sum(kept, sorted_weight);
        }
      }
      auto positive_weight = [&](int64_t i) { return sorted_weight(i); };
      const int64_t chosen = first_crossing(kept, positive_weight, u * kept_mass, true);
      if (chosen >= 0) token = sorted_ids[chosen];
    } else {
      auto weight = [&](int64_t i) { return exp((static_cast<double>(value(i)) - max_value) * inverse_temperature); };
      const double total = block_sum(vocab, weight);
      const int64_t chosen = first_crossing(vocab, weight, u * total, true);
      if (chosen >= 0) token = static_cast<int32_t>(chosen);
    }
  }
  if (threadIdx.x == 0) {
    p.tokens[r] = token;
    p.logprobs[r] = static_cast<float>((static_cast<double>(value(token)) - stats.max_value) - stats.log_sum);
  }
}

}  // namespace

size_t sample_workspace_bytes(int rows, int64_t vocab) {
  if (rows <= 0 || vocab <= 0 || static_cast<int64_t>(rows) * vocab > 0x7fffffff) return 0;
  return make_layout(nullptr, rows, vocab).total;
}

Status sample(const SampleParams& p, cudaStream_t stream) {
  const std::string prefix = "sample: ";
  if (p.rows < 0) return invalid_argument(prefix + "rows must be >= 0, got " + std::to_string(p.rows));
  if (p.vocab < 1) return invalid_argument(prefix + "vocab must be >= 1, got " + std::to_string(p.vocab));
  if (static_cast<int64_t>(p.rows) * p.vocab > 0x7fffffff) return invalid_argument(prefix + "rows * vocab > 2^31 - 1");
  if (p.top_logprobs < 0 || p.top_logprobs > kMaxSampleTopLogprobs) {
    return invalid_argument(prefix + "top_logprobs must be in [0, 20], got " + std::to_string(p.top_logprobs));
  }
  if (p.rows == 0) return Status::ok();
  if (p.logits == nullptr || p.temperature == nullptr || p.top_p == nullptr || p.top_k == nullptr ||
      p.uniform == nullptr) {
    return invalid_argument(prefix + "logits, temperature, top_p, top_k and uniform must be non-null");
  }
  if (p.tokens == nullptr || p.logprobs == nullptr) return invalid_argument(prefix + "tokens or logprobs is null");
  const size_t needed = sample_workspace_bytes(p.rows, p.vocab);
  if (p.workspace == nullptr || p.workspace_bytes < needed) {
    return invalid_argument(prefix + "workspace of " + std::to_string(p.workspace_bytes) + " bytes, needs " +
                            std::to_string(needed));
  }
  if (reinterpret_cast<uintptr_t>(p.workspace) % kAlign != 0) {
    return invalid_argument(prefix + "workspace must be 256-byte aligned");
  }
  const Layout l = make_layout(p.workspace, p.rows, p.vocab);
  prep_kernel<<<p.rows, kThreads, 0, stream>>>(p, l);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return internal_error(prefix + "prep launch: " + cudaGetErrorName(error));
  size_t temp_bytes = l.sort_temp_bytes;
  cub::DoubleBuffer<float> keys(l.keys_a, l.keys_b);
  cub::DoubleBuffer<int32_t> ids(l.ids_a, l.ids_b);
  error = cub::DeviceSegmentedRadixSort::SortPairsDescending(
      l.sort_temp, temp_bytes, keys, ids, static_cast<int>(p.rows * p.vocab), p.rows,
      static_cast<const int32_t*>(l.begins), static_cast<const int32_t*>(l.ends), 0, 32, stream);
  if (error != cudaSuccess) return internal_error(prefix + "segmented sort: " + cudaGetErrorName(error));
  choose_kernel<<<p.rows, kThreads, 0, stream>>>(p, l.stats, keys.Current(), ids.Current());
  error = cudaGetLastError();
  if (error != cudaSuccess) return internal_error(prefix + "choose launch: " + cudaGetErrorName(error));
  return Status::ok();
}

}  // namespace deltaserve::kernels::cuda
