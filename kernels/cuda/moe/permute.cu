// Token permutation of the MoE layer (contract in moe.hpp): the plan (a stable counting sort of the T * k
// assignments by expert), the gather of the rows in sorted order and the weighted combine back to token order.
//
// Plan, three launches over tiles of 256 assignments (plus a memset):
//   1. per-tile histograms tile_counts[tile][E + 1] (bucket E holds out-of-range ids);
//   2. one CTA turns them into per-tile bases (exclusive scan over tiles, per expert) and the expert offsets
//      (exclusive scan over experts);
//   3. per tile, an assignment's position = offsets[e] + tile base[e] + (earlier assignments of e in its tile).
// The order inside an expert is therefore the assignment order (stable). Workspace: tiles * (E + 1) int32.
#include <string>

#include "kernels/cuda/moe/moe.hpp"

namespace deltaserve::kernels::cuda {
namespace {

constexpr int kPlanTile = 256;  // assignments per tile (= threads of the histogram and scatter CTAs)
constexpr int kScanThreads = 1024;

int64_t plan_tiles(int64_t assignments) {
  return (assignments + kPlanTile - 1) / kPlanTile;
}

__device__ __forceinline__ int bucket_of(int32_t id, int E) {
  return (id >= 0 && id < E) ? id : E;
}

__global__ void __launch_bounds__(kPlanTile) plan_histogram_kernel(const int32_t* ids, int n, int E, int* tile_counts) {
  const int a = blockIdx.x * kPlanTile + threadIdx.x;
  if (a < n) atomicAdd(&tile_counts[static_cast<int64_t>(blockIdx.x) * (E + 1) + bucket_of(ids[a], E)], 1);
}

__global__ void __launch_bounds__(kScanThreads)
    plan_scan_kernel(int* tile_counts, int tiles, int E, int32_t* expert_offsets, int* bucket_start) {
  __shared__ int scan_s[kScanThreads];
  __shared__ int carry_s;
  const int tid = threadIdx.x, buckets = E + 1;
  if (tid == 0) carry_s = 0;
  // Chunks of kScanThreads buckets: per bucket a sequential scan over the tiles (coalesced across threads), then
  // a Hillis-Steele exclusive scan of the bucket totals across the chunk.
  for (int base = 0; base < buckets; base += kScanThreads) {
    const int b = base + tid;
    int total = 0;
    if (b < buckets) {
      for (int tile = 0; tile < tiles; ++tile) {
        int* cell = &tile_counts[static_cast<int64_t>(tile) * buckets + b];
        const int c = *cell;
        *cell = total;
        total += c;
      }
    }
    scan_s[tid] = total;
    __syncthreads();
    for (int offset = 1; offset < kScanThreads; offset <<= 1) {
      const int v = tid >= offset ? scan_s[tid - offset] : 0;
      __syncthreads();
      scan_s[tid] += v;
      __syncthreads();
    }
    const int start = carry_s + scan_s[tid] - total;  // exclusive
    if (b < buckets) {
      bucket_start[b] = start;
      if (b < E) expert_offsets[b] = start;
      if (b == E) expert_offsets[E] = start;  // valid assignments end where the out-of-range bucket starts
    }
    __syncthreads();
    if (tid == kScanThreads - 1) carry_s = start + total;
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kPlanTile)
    plan_scatter_kernel(const int32_t* ids, int n, int E, const int* tile_bases, const int* bucket_start,
                        int32_t* sorted_assignments, int32_t* assignment_pos) {
  __shared__ int bucket_s[kPlanTile];
  const int tid = threadIdx.x, a = blockIdx.x * kPlanTile + tid;
  const int b = a < n ? bucket_of(ids[a], E) : -1;
  bucket_s[tid] = b;
  __syncthreads();
  if (a >= n) return;
  int rank = 0;
  for (int i = 0; i < tid; ++i) rank += bucket_s[i] == b ? 1 : 0;
  const int pos = bucket_start[b] + tile_bases[static_cast<int64_t>(blockIdx.x) * (E + 1) + b] + rank;
  sorted_assignments[pos] = a;
  assignment_pos[a] = b < E ? pos : -1;
}

__global__ void gather_rows_kernel(const __nv_bfloat16* x, int64_t x_stride, const int32_t* sorted, int n, int k,
                                   int64_t width, bool vectorised, __nv_bfloat16* out) {
  for (int64_t p = blockIdx.x; p < n; p += gridDim.x) {
    const int64_t t = sorted[p] / k;
    const __nv_bfloat16* src = x + t * x_stride;
    __nv_bfloat16* dst = out + p * width;
    if (vectorised) {
      const int64_t chunks = width / 8;
      for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
        reinterpret_cast<uint4*>(dst)[c] = __ldg(reinterpret_cast<const uint4*>(src) + c);
      }
    } else {
      for (int64_t c = threadIdx.x; c < width; c += blockDim.x) dst[c] = src[c];
    }
  }
}

__global__ void combine_kernel(const float* y_sorted, const int32_t* assignment_pos, const float* weights, int64_t T,
                               int k, int64_t width, bool accumulate, bool vectorised, float* out, int64_t out_stride) {
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    float* dst = out + t * out_stride;
    const int32_t* pos = assignment_pos + t * k;
    const float* w = weights + t * k;
    if (vectorised) {
      for (int64_t c = threadIdx.x; c < width / 4; c += blockDim.x) {
        float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int j = 0; j < k; ++j) {
          const int32_t p = pos[j];
          if (p < 0) continue;
          const float wj = w[j];
          const float4 y = reinterpret_cast<const float4*>(y_sorted + static_cast<int64_t>(p) * width)[c];
          sum.x = fmaf(wj, y.x, sum.x);
          sum.y = fmaf(wj, y.y, sum.y);
          sum.z = fmaf(wj, y.z, sum.z);
          sum.w = fmaf(wj, y.w, sum.w);
        }
        float4* o = reinterpret_cast<float4*>(dst) + c;
        if (accumulate) {
          const float4 prev = *o;
          sum.x += prev.x;
          sum.y += prev.y;
          sum.z += prev.z;
          sum.w += prev.w;
        }
        *o = sum;
      }
    } else {
      for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
        float sum = 0.0f;
        for (int j = 0; j < k; ++j) {
          const int32_t p = pos[j];
          if (p >= 0) sum = fmaf(w[j], y_sorted[static_cast<int64_t>(p) * width + c], sum);
        }
        dst[c] = accumulate ? dst[c] + sum : sum;
      }
    }
  }
}

Status launch_status(const char* what) {
  const cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) return Status::ok();
  return internal_error(std::string(what) + ": launch: " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) +
                        ")");
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

constexpr unsigned kMaxGrid = 1u << 20;  // grid-stride beyond this

}  // namespace

size_t moe_plan_workspace_bytes(int64_t T, int top_k, int num_experts) {
  if (T < 0 || top_k < 1 || num_experts < 1) return 0;
  const int64_t tiles = plan_tiles(T * top_k);
  // tile bases [tiles, E + 1] and the bucket starts [E + 1], each rounded up to 16 bytes.
  const auto round16 = [](int64_t bytes) { return (bytes + 15) / 16 * 16; };
  return static_cast<size_t>(round16(tiles * (num_experts + 1) * 4) + round16((num_experts + 1) * 4));
}

Status moe_plan(const int32_t* expert_ids, int64_t T, int top_k, int num_experts, const MoePlan& plan, void* workspace,
                size_t workspace_bytes, cudaStream_t stream) {
  if (T < 0 || top_k < 1 || num_experts < 1) {
    return invalid_argument("moe_plan: need T >= 0, top_k >= 1, num_experts >= 1");
  }
  if (T * top_k > 0x7fffffff || num_experts >= 0x7fffffff) {
    return invalid_argument("moe_plan: T * top_k must be < 2^31");
  }
  if (plan.expert_offsets == nullptr) return invalid_argument("moe_plan: plan.expert_offsets must be non-null");
  const int n = static_cast<int>(T * top_k);
  if (n > 0 && (expert_ids == nullptr || plan.sorted_assignments == nullptr || plan.assignment_pos == nullptr)) {
    return invalid_argument("moe_plan: expert_ids, sorted_assignments and assignment_pos must be non-null");
  }
  const size_t needed = moe_plan_workspace_bytes(T, top_k, num_experts);
  if (workspace == nullptr || workspace_bytes < needed || !aligned16(workspace)) {
    return invalid_argument("moe_plan: workspace must be 16-byte aligned with >= " + std::to_string(needed) +
                            " bytes (got " + std::to_string(workspace_bytes) + ")");
  }
  const int tiles = static_cast<int>(plan_tiles(n));
  const int buckets = num_experts + 1;
  int* tile_counts = static_cast<int*>(workspace);
  int* bucket_start = tile_counts + (static_cast<int64_t>(tiles) * buckets + 3) / 4 * 4;
  if (tiles > 0) {
    const cudaError_t error =
        cudaMemsetAsync(tile_counts, 0, static_cast<size_t>(tiles) * buckets * sizeof(int), stream);
    if (error != cudaSuccess) {
      return internal_error(std::string("moe_plan: memset: ") + cudaGetErrorString(error));
    }
    plan_histogram_kernel<<<tiles, kPlanTile, 0, stream>>>(expert_ids, n, num_experts, tile_counts);
    Status status = launch_status("moe_plan histogram");
    if (!status) return status;
  }
  plan_scan_kernel<<<1, kScanThreads, 0, stream>>>(tile_counts, tiles, num_experts, plan.expert_offsets, bucket_start);
  Status status = launch_status("moe_plan scan");
  if (!status) return status;
  if (tiles > 0) {
    plan_scatter_kernel<<<tiles, kPlanTile, 0, stream>>>(expert_ids, n, num_experts, tile_counts, bucket_start,
                                                         plan.sorted_assignments, plan.assignment_pos);
    status = launch_status("moe_plan scatter");
  }
  return status;
}

Status moe_gather_rows(const __nv_bfloat16* x, int64_t x_stride, const MoePlan& plan, int64_t T, int top_k,
                       int64_t width, __nv_bfloat16* out, cudaStream_t stream) {
  if (T < 0 || top_k < 1 || width < 0) return invalid_argument("moe_gather_rows: need T >= 0, top_k >= 1, width >= 0");
  if (T * top_k > 0x7fffffff) return invalid_argument("moe_gather_rows: T * top_k must be < 2^31");
  if (x_stride < width) return invalid_argument("moe_gather_rows: x_stride must be >= width");
  const int n = static_cast<int>(T * top_k);
  if (n == 0 || width == 0) return Status::ok();
  if (x == nullptr || out == nullptr || plan.sorted_assignments == nullptr) {
    return invalid_argument("moe_gather_rows: x, out and plan.sorted_assignments must be non-null");
  }
  const bool vectorised = width % 8 == 0 && x_stride % 8 == 0 && aligned16(x) && aligned16(out);
  const unsigned grid = static_cast<unsigned>(n < static_cast<int>(kMaxGrid) ? n : kMaxGrid);
  gather_rows_kernel<<<grid, 128, 0, stream>>>(x, x_stride, plan.sorted_assignments, n, top_k, width, vectorised, out);
  return launch_status("moe_gather_rows");
}

Status moe_combine(const float* y_sorted, const MoePlan& plan, const float* weights, int64_t T, int top_k,
                   int64_t width, bool accumulate, float* out, int64_t out_stride, cudaStream_t stream) {
  if (T < 0 || top_k < 1 || width < 0) return invalid_argument("moe_combine: need T >= 0, top_k >= 1, width >= 0");
  if (T * top_k > 0x7fffffff) return invalid_argument("moe_combine: T * top_k must be < 2^31");
  if (out_stride < width) return invalid_argument("moe_combine: out_stride must be >= width");
  if (T == 0 || width == 0) return Status::ok();
  if (y_sorted == nullptr || weights == nullptr || out == nullptr || plan.assignment_pos == nullptr) {
    return invalid_argument("moe_combine: y_sorted, weights, out and plan.assignment_pos must be non-null");
  }
  const bool vectorised = width % 4 == 0 && out_stride % 4 == 0 && aligned16(y_sorted) && aligned16(out);
  const unsigned grid = static_cast<unsigned>(T < static_cast<int64_t>(kMaxGrid) ? T : kMaxGrid);
  const int threads = width >= 1024 ? 256 : 128;
  combine_kernel<<<grid, threads, 0, stream>>>(y_sorted, plan.assignment_pos, weights, T, top_k, width, accumulate,
                                               vectorised, out, out_stride);
  return launch_status("moe_combine");
}

}  // namespace deltaserve::kernels::cuda
