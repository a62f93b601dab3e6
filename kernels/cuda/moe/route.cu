// Fused MoE router (contract in moe.hpp): one warp per token, the selection in detail/route.cuh (shared with the
// small-batch decode layer). The warps of a CTA each hold their token's scores in their own slice of shared memory.
#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/cuda/common/launch_status.hpp"
#include "kernels/cuda/moe/detail/route.cuh"
#include "kernels/cuda/moe/moe.hpp"

namespace deltaserve::kernels::cuda {
namespace {

namespace rd = moe_route_device;

constexpr int kMaxWarps = 8;
constexpr size_t kMaxSharedBytes = 48 * 1024;  // the default limit: no opt-in attribute call

struct RouteArgs {
  rd::RouteConfig config;
  const float* logits;
  const float* bias;
  int64_t T;
  int32_t* expert_ids;
  float* weights;
};

__global__ void __launch_bounds__(kMaxWarps * 32) moe_route_kernel(RouteArgs p) {
  extern __shared__ float route_scratch[];  // [warps, route_scratch_floats(E, G)]
  const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * warps + warp;
  if (t >= p.T) return;  // whole warps: there is no block-wide barrier below
  const int E = p.config.num_experts, k = p.config.top_k;
  float* scratch = route_scratch + warp * rd::route_scratch_floats(E, p.config.num_groups);
  rd::route_token(p.config, p.logits + t * E, p.bias, scratch, p.expert_ids + t * k, p.weights + t * k);
}

}  // namespace

Status moe_routing_check(const MoeRoutingConfig& config, const char* who) {
  const int E = config.num_experts, k = config.top_k, G = config.num_groups, KG = config.top_k_groups;
  const std::string name(who);
  if (E < 1 || E > kMoeMaxExperts) {
    return invalid_argument(name + ": num_experts " + std::to_string(E) + " not in [1, 1024]");
  }
  if (k < 1 || k > kMoeMaxTopK || k > E) {
    return invalid_argument(name + ": top_k " + std::to_string(k) + " not in [1, min(32, num_experts)]");
  }
  if (G < 1 || E % G != 0) {
    return invalid_argument(name + ": num_groups " + std::to_string(G) + " must be >= 1 and divide num_experts");
  }
  if (KG < 1 || KG > G) return invalid_argument(name + ": top_k_groups must be in [1, num_groups]");
  if (G > 1 && k > KG * (E / G)) return invalid_argument(name + ": top_k exceeds the experts of the kept groups");
  if (!std::isfinite(config.routed_scaling_factor)) {
    return invalid_argument(name + ": routed_scaling_factor must be finite");
  }
  return Status::ok();
}

Status moe_route(const MoeRoutingConfig& config, const float* logits, const float* correction_bias, int64_t T,
                 int32_t* expert_ids, float* weights, cudaStream_t stream) {
  Status status = moe_routing_check(config, "moe_route");
  if (!status) return status;
  const int E = config.num_experts, k = config.top_k, G = config.num_groups, KG = config.top_k_groups;
  if (T < 0 || T > 0x7fffffff) return invalid_argument("moe_route: T out of range");
  if (T == 0) return Status::ok();
  if (logits == nullptr || expert_ids == nullptr || weights == nullptr) {
    return invalid_argument("moe_route: logits, expert_ids and weights must be non-null");
  }
  RouteArgs args{
      {E, k, G, KG, config.renormalize, config.routed_scaling_factor}, logits, correction_bias, T, expert_ids, weights};
  // Up to 8 warps (tokens) per CTA, fewer when their score slices would pass the default shared-memory limit
  // (at most 8 KiB a warp: 1024 experts in groups of one).
  const size_t warp_bytes = static_cast<size_t>(rd::route_scratch_floats(E, G)) * sizeof(float);
  int warps = static_cast<int>(std::min<size_t>(kMaxWarps, kMaxSharedBytes / warp_bytes));
  if (T < warps) warps = static_cast<int>(T);
  const int64_t blocks = (T + warps - 1) / warps;
  moe_route_kernel<<<static_cast<unsigned>(blocks), warps * 32, warps * warp_bytes, stream>>>(args);
  return launch_status("moe_route");
}

}  // namespace deltaserve::kernels::cuda
