// kda_gpu_bench: deltaserve's CUDA KDA kernels (kernels/cuda/kda/kda.hpp) alone, on the shapes of bench/gpu/kda.sh.
//
// Measures: the chunked prefill (H = 32 and 96; T = 4k, 16k, 64k and a varlen batch; log-decays in (-5, 0), plus one
// case in (-20, 0) that takes the exact diagonal path) and the decode step per layer (H = 32, B = 1 to 256, 20 layers
// replayed as one CUDA graph). Medians of timed runs after warm-up, CUDA events.
// Limit (kda_report.py, with the ceilings kda_fla_peer.py measures in the same run): prefill max(fewest bytes / device
// copy bandwidth, FLOPs / bf16 GEMM rate); decode fewest bytes / copy bandwidth.
// Peer: fla-core's chunk_kda (prefill) and fused_recurrent_kda (decode), kda_fla_peer.py, same shapes and run.
//
//   kda_gpu_bench [all | prefill | decode | prefill16k | decode64 | h=H[,t=T]]
// (h=H: one prefill at H heads, T = 16384 unless given.) Prints one JSON object per case; kda_report.py joins them
// with the peer and the ceilings into bench/results records.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "bench/gpu/cuda_check.hpp"
#include "kernels/cuda/kda/kda.hpp"

using deltaserve::Status;
using namespace deltaserve::kernels::cuda;  // NOLINT(google-build-using-namespace)

namespace {

__device__ float hash_uniform(uint64_t i, uint64_t seed) {  // in (0, 1)
  uint64_t z = i * 0x9E3779B97F4A7C15ull + seed;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (static_cast<float>(z >> 40) + 0.5f) / 16777216.0f;
}

// Rows of 128: random, L2-normalised when `normalise`.
__global__ void fill_rows(__nv_bfloat16* x, int64_t rows, uint64_t seed, bool normalise) {
  const int64_t row = blockIdx.x * 4 + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  float v[4], sum = 0.0f;
  for (int j = 0; j < 4; ++j) {
    v[j] = 2.0f * hash_uniform(row * 128 + lane * 4 + j, seed) - 1.0f;
    sum += v[j] * v[j];
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float f = normalise ? rsqrtf(sum + 1e-6f) : 1.0f;
  for (int j = 0; j < 4; ++j) x[row * 128 + lane * 4 + j] = __float2bfloat16(v[j] * f);
}

__global__ void fill_floats(float* x, int64_t n, uint64_t seed, float scale, float offset, int mode) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float u = hash_uniform(i, seed);
    // mode 0: -scale * sigmoid(4u - 2) (log-decay in (-scale, 0)); 1: sigmoid(4u - 2) (beta);
    // 2: scale * (2u - 1) + offset
    const float s = 1.0f / (1.0f + __expf(-(4.0f * u - 2.0f)));
    x[i] = mode == 0 ? -scale * s : (mode == 1 ? s : scale * (2.0f * u - 1.0f) + offset);
  }
}

__global__ void fill_bf16(__nv_bfloat16* x, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    x[i] = __float2bfloat16(scale * (2.0f * hash_uniform(i, seed) - 1.0f));
  }
}

template <class F>
double median_ms(F&& run, int warmup, int iterations) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < warmup; ++i) run();
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<double> times;
  for (int i = 0; i < iterations; ++i) {
    CHECK_CUDA(cudaEventRecord(start));
    run();
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// gate_floor: the per-step log-decay is drawn from (-gate_floor, 0); 5 is the K3 lower bound (dense diagonal tiles),
// 20 puts almost every 16-token tile past the dense span (the exact diagonal path, as an unbounded gate can).
void bench_prefill(const std::string& name, int H, const std::vector<int32_t>& lengths, float gate_floor = 5.0f) {
  std::vector<int32_t> cu{0};
  for (int32_t l : lengths) cu.push_back(cu.back() + l);
  const int64_t T = cu.back(), N = static_cast<int64_t>(lengths.size());
  const size_t elements = static_cast<size_t>(T) * H * 128;
  __nv_bfloat16 *q, *k, *v, *o;
  float *g, *beta, *state;
  void* workspace;
  const size_t workspace_bytes = kda_prefill_workspace_bytes(cu, H);
  CHECK_CUDA(cudaMalloc(&q, elements * 2));
  CHECK_CUDA(cudaMalloc(&k, elements * 2));
  CHECK_CUDA(cudaMalloc(&v, elements * 2));
  CHECK_CUDA(cudaMalloc(&o, elements * 2));
  CHECK_CUDA(cudaMalloc(&g, elements * 4));
  CHECK_CUDA(cudaMalloc(&beta, static_cast<size_t>(T) * H * 4));
  CHECK_CUDA(cudaMalloc(&state, static_cast<size_t>(N) * H * 128 * 128 * 4));
  CHECK_CUDA(cudaMalloc(&workspace, workspace_bytes));
  const int64_t rows = T * H;
  fill_rows<<<static_cast<unsigned>((rows + 3) / 4), 128>>>(q, rows, 1, true);
  fill_rows<<<static_cast<unsigned>((rows + 3) / 4), 128>>>(k, rows, 2, true);
  fill_rows<<<static_cast<unsigned>((rows + 3) / 4), 128>>>(v, rows, 3, false);
  fill_floats<<<1024, 256>>>(g, static_cast<int64_t>(elements), 4, gate_floor, 0, 0);
  fill_floats<<<1024, 256>>>(beta, rows, 5, 0, 0, 1);
  fill_floats<<<1024, 256>>>(state, N * H * 128 * 128, 6, 0.05f, 0.0f, 2);
  CHECK_CUDA(cudaGetLastError());
  KdaPrefillParams p;
  p.num_heads = H;
  p.cu_seqlens = cu;
  p.q = q;
  p.k = k;
  p.v = v;
  p.g = g;
  p.beta = beta;
  p.q_scale = 1.0f / std::sqrt(128.0f);
  p.initial_state = state;
  p.final_state = state;
  p.o = o;
  p.workspace = workspace;
  p.workspace_bytes = workspace_bytes;
  // A stream of its own (blocking: the events on the legacy stream still bracket it), where the overlapped state
  // pass's programmatic dependent launch applies.
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  const double ms = median_ms([&] { CHECK_STATUS(kda_chunk_prefill(p, stream)); }, 3, 15);
  CHECK_CUDA(cudaStreamDestroy(stream));
  // Fewest bytes: q, k, v, o bf16; g fp32; beta fp32; initial + final state fp32.
  const double bytes = static_cast<double>(elements) * (2 + 2 + 2 + 2 + 4) + rows * 4.0 + 2.0 * N * H * 128 * 128 * 4;
  const double flops = static_cast<double>(T) * H * (6.0 * 128 * 128 + 3.0 * 64 * 128 + 64.0 * 64);
  std::printf(
      "{\"kind\": \"prefill\", \"case\": \"%s\", \"H\": %d, \"T\": %lld, \"N\": %lld, \"ms\": %.5f, \"bytes\": %.6e, "
      "\"flops\": %.6e}\n",
      name.c_str(), H, static_cast<long long>(T), static_cast<long long>(N), ms, bytes, flops);
  std::fflush(stdout);
  for (void* pointer : {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v), static_cast<void*>(o),
                        static_cast<void*>(g), static_cast<void*>(beta), static_cast<void*>(state), workspace}) {
    CHECK_CUDA(cudaFree(pointer));
  }
}

// early: KdaDecodeParams::early_state_loads (valid here: each layer's predecessor in the graph is another layer's
// step). Without it the case keeps the plain name that kda_report.py pairs with fla; with it the name gets ",early=1".
void bench_decode(int H, int B, int layers, bool early = false) {
  const std::string name = "H=" + std::to_string(H) + ",d=128,B=" + std::to_string(B) + (early ? ",early=1" : "");
  const int64_t C = int64_t{H} * 128;
  const int K = 4;
  std::vector<void*> owned;
  auto alloc = [&](size_t bytes) {
    void* pointer;
    CHECK_CUDA(cudaMalloc(&pointer, bytes));
    owned.push_back(pointer);
    return pointer;
  };
  auto* inputs = static_cast<__nv_bfloat16*>(alloc(static_cast<size_t>(B) * C * 2 * 5 + B * H * 2));
  fill_bf16<<<1024, 256>>>(inputs, B * C * 5 + B * H, 7, 1.0f);
  auto* weights = static_cast<float*>(alloc(static_cast<size_t>(C) * K * 3 * 4 + H * 4 + C * 4 + 128 * 4));
  fill_floats<<<1024, 256>>>(weights, C * K * 3 + H + C + 128, 8, 0.5f, 0.0f, 2);
  auto* out = static_cast<__nv_bfloat16*>(alloc(static_cast<size_t>(B) * C * 2));
  std::vector<int32_t> slots(B);
  for (int b = 0; b < B; ++b) slots[b] = b;
  auto* slots_d = static_cast<int32_t*>(alloc(B * 4));
  CHECK_CUDA(cudaMemcpy(slots_d, slots.data(), B * 4, cudaMemcpyHostToDevice));
  std::vector<KdaDecodeParams> params(layers);
  for (int l = 0; l < layers; ++l) {
    auto* state = static_cast<float*>(alloc(static_cast<size_t>(B) * H * 128 * 128 * 4));
    auto* conv = static_cast<__nv_bfloat16*>(alloc(static_cast<size_t>(B) * 3 * C * (K - 1) * 2));
    fill_floats<<<1024, 256>>>(state, int64_t{B} * H * 128 * 128, 9 + l, 0.05f, 0.0f, 2);
    fill_bf16<<<1024, 256>>>(conv, int64_t{B} * 3 * C * (K - 1), 99 + l, 1.0f);
    KdaDecodeParams& p = params[l];
    p.batch = B;
    p.num_heads = H;
    p.conv_kernel = K;
    p.num_slots = B;
    p.slots = slots_d;
    p.q_in = inputs;
    p.k_in = inputs + B * C;
    p.v_in = inputs + 2 * B * C;
    p.gate_raw = inputs + 3 * B * C;
    p.out_gate = inputs + 4 * B * C;
    p.beta_raw = inputs + 5 * B * C;
    p.q_conv_weight = weights;
    p.k_conv_weight = weights + C * K;
    p.v_conv_weight = weights + 2 * C * K;
    p.a_log = weights + 3 * C * K;
    p.dt_bias = weights + 3 * C * K + H;
    p.o_norm_weight = weights + 3 * C * K + H + C;
    p.lower_bound = -5.0f;
    p.conv_state = conv;
    p.state = state;
    p.out = out;
    p.early_state_loads = early;
  }
  CHECK_CUDA(cudaGetLastError());
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int l = 0; l < layers; ++l) CHECK_STATUS(kda_decode_step(params[l], stream));
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) CHECK_CUDA(cudaGraphLaunch(exec, stream));
  std::vector<double> times;
  for (int i = 0; i < 20; ++i) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms / layers);
  }
  std::sort(times.begin(), times.end());
  const double us = times[times.size() / 2] * 1000.0;
  // Fewest bytes per layer: state (fp32) and conv tails (bf16) read + written, activations in, output out.
  const double bytes =
      2.0 * B * H * 128 * 128 * 4 + 2.0 * B * 3 * C * (K - 1) * 2 + B * (5.0 * C + H) * 2 + B * C * 2.0;
  // Ratios to a nominal 4.26 TB/s copy (kda_report.py redoes them with the copy bandwidth measured in the run).
  const double state_bytes = 2.0 * B * H * 128 * 128 * 4;
  std::printf(
      "{\"kind\": \"decode\", \"case\": \"%s\", \"early\": %d, \"H\": %d, \"B\": %d, "
      "\"us\": %.3f, \"bytes\": %.6e, \"ratio_4.26\": %.4f, \"state_ratio_4.26\": %.4f}\n",
      name.c_str(), early ? 1 : 0, H, B, us, bytes, bytes / (us * 1e-6) / 4.26e12, state_bytes / (us * 1e-6) / 4.26e12);
  std::fflush(stdout);
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaStreamDestroy(stream));
  for (void* pointer : owned) CHECK_CUDA(cudaFree(pointer));
}

}  // namespace

int main(int argc, char** argv) {
  const std::string what = argc > 1 ? argv[1] : "all";
  const std::vector<int32_t> varlen = {300, 1000, 2500, 4096, 8192, 16000};
  if (what == "all" || what == "prefill") {
    for (int H : {32, 96}) {
      for (int32_t T : {4096, 16384, 65536}) {
        bench_prefill("H=" + std::to_string(H) + ",d=128,T=" + std::to_string(T) + ",B=1,lb=-5", H, {T});
      }
      bench_prefill("H=" + std::to_string(H) + ",d=128,varlen=300+1000+2500+4096+8192+16000,lb=-5", H, varlen);
    }
    bench_prefill("H=32,d=128,T=16384,B=1,log-decay in (-20,0): exact diagonal tiles", 32, {16384}, 20.0f);
  }
  if (what == "prefill16k") bench_prefill("H=32,d=128,T=16384,B=1,lb=-5", 32, {16384});
  if (what.rfind("h=", 0) == 0) {  // one head count (T=16k unless ",t=T"): how the passes scale (h=4, h=8,t=4096)
    const int H = std::stoi(what.substr(2));
    const size_t t_at = what.find(",t=");
    const int32_t T = t_at == std::string::npos ? 16384 : std::stoi(what.substr(t_at + 3));
    bench_prefill("H=" + std::to_string(H) + ",d=128,T=" + std::to_string(T) + ",B=1,lb=-5", H, {T});
  }
  if (what == "decode64") bench_decode(32, 64, 20);
  if (what == "all" || what == "decode") {
    // Without and with early state loads.
    for (int B : {1, 8, 64, 256}) {
      for (const bool early : {false, true}) bench_decode(32, B, 20, early);
    }
  }
  return 0;
}
