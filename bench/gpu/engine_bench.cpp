// engine_gpu_bench: the CUDA engine (engine/cuda) on one GPU with random weights of a real shape (Kimi-Linear-48B,
// or a few K3 layers). GPU machine only; bench/gpu/engine.sh runs it.
//
// Measures: decode step time and tokens/s per batch size and context, prefill tokens/s and the TTFT of a long prompt,
// and the memory plan (state slots, cache pages, requests that fit).
// Limit, from ceilings measured in the same run (device copy bandwidth: bytes read+written / s of a 2 GiB
// device-to-device copy; cuBLAS bf16 GEMM peak):
//   decode: the bytes one step must read (and write) at least, over the copy bandwidth: every non-expert weight
//     (embedding rows aside), the routed experts the batch touches (expected distinct experts under uniform routing,
//     E·(1-(1-k/E)^B) per MoE layer — the random router is near uniform), every KDA state and conv tail read and
//     written, every MLA cache row read once.
//   prefill: FLOPs of the minimal computation (2 per weight per token for the active weights; MLA attention in the
//     naive form, causal: 2·(qk_nope+qk_rope + v) per head per (query, key) pair; KDA chunked form
//     6·d² + 3·C·d + C² per head per token, C = 64) over the GEMM peak.
// Peer: none run beside it; the KDA kernels' peer (fla) is in kda_gpu_bench.
//
//   engine_gpu_bench --config CONFIG.json [--layers N | --kinds kda,mla,...] [--first-dense K] --label NAME
//                    --commit C --date D [--machine M] [--command TEXT]
//                    [--batches 1,8,32,128,256] [--contexts 4096,32768] [--prompts 4096,32768,131072]
//                    [--memory-fraction 0.92] [--max-prefill-seconds 90] [--prefill-chunk 8192]
//                    [--profiler-step] [--trace-step]
//
// Output: JSON lines in the bench/results format on stdout; progress on stderr. Each record's command is --command,
// or else this process's command line.
// Prefill: the median of 5 timed prefills (3 above 32k tokens), each of a new request, after one warm-up prefill of
// up to two passes in the first case (lazy module loads and first-call set-up stay out of the timing).
// Contexts are set up with CudaBackend::assume_context (zero states and rows: the same work as real ones).
// Decode runs twice per case on the same backend: ",graph" (CUDA graphs on; shapes that are not graph-eligible run
// eagerly and say so on stderr and in graph_replayed_steps) and ",eager". The per-phase GPU profile of one eager
// decode step (B=1 and B=256 at context 4096) and of one eager 32k prefill goes to stderr.
// --profiler-step: one more graph-mode decode step per case between cudaProfilerStart and cudaProfilerStop, so that
// `ncu --profile-from-start off` sees exactly the kernels of one step.
// --trace-step: the kernel timeline of one more graph-mode decode step per case (CUPTI activity records: every
// kernel's start and end as the GPU ran it, programmatic overlaps included, and what each adds to the step) on stderr,
// and per kernel name as decode_step_trace records (summed_adds: the adds sum to the span; summed_duration).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <cublas_v2.h>
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include "bench/gpu/kernel_trace.hpp"
#include "engine/cuda/cuda_backend.hpp"
#include "engine/model.hpp"
#include "engine/model_config.hpp"
#include "engine/model_weights.hpp"

namespace {

using namespace deltaserve;  // NOLINT(google-build-using-namespace)
using Clock = std::chrono::steady_clock;

struct Args {
  std::string config_path, label = "model", commit = "unknown", date = "unknown", machine = "nvidia-h200";
  std::string command;  // the records' command: --command, else this process's command line
  std::optional<int64_t> layers, first_dense;
  std::vector<engine::LayerKind> kinds;  // --kinds kda,mla,...: these layers instead of the config's
  std::vector<int64_t> batches = {1, 8, 32, 128, 256}, contexts = {4096, 32768}, prompts = {4096, 32768, 131072};
  double memory_fraction = 0.92, max_prefill_seconds = 90;
  int64_t prefill_chunk = 8192;  // the backend's max_batch_tokens: rows of one prefill pass
  bool ceilings = true;
  bool profiler_step = false;  // one graph-mode decode step per case inside cudaProfilerStart/Stop
  bool trace_step = false;     // the kernel timeline of one graph-mode decode step per case (stderr)
};

std::vector<int64_t> parse_list(const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(std::stoll(item));
  }
  return out;
}

[[noreturn]] void die(const std::string& message) {
  std::fprintf(stderr, "engine_gpu_bench: %s\n", message.c_str());
  std::exit(1);
}

void check(const Status& status, const std::string& what) {
  if (!status.is_ok()) die(what + ": " + status.to_string());
}

void check_cuda(cudaError_t error, const std::string& what) {
  if (error != cudaSuccess) die(what + ": " + cudaGetErrorString(error));
}

// ---- output --------------------------------------------------------------------------------------------------
const Args* g_args = nullptr;

std::string number(double v) {
  if (!std::isfinite(v)) return "null";
  char text[64];
  std::snprintf(text, sizeof text, "%.6g", v);
  return text;
}

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

void emit(const std::string& bench, const std::string& case_name, const std::string& metric, double value,
          const std::string& unit, double limit = NAN, double ratio = NAN) {
  std::printf(
      "{\"bench\": %s, \"case\": %s, \"metric\": %s, \"value\": %s, \"unit\": %s, \"limit\": %s, "
      "\"ratio_to_limit\": %s, \"peer\": null, \"peer_value\": null, \"ratio_to_peer\": null, \"machine\": %s, "
      "\"commit\": %s, \"date\": %s, \"command\": %s}\n",
      quoted(bench).c_str(), quoted(case_name).c_str(), quoted(metric).c_str(), number(value).c_str(),
      quoted(unit).c_str(), number(limit).c_str(), number(ratio).c_str(), quoted(g_args->machine).c_str(),
      quoted(g_args->commit).c_str(), quoted(g_args->date).c_str(), quoted(g_args->command).c_str());
  std::fflush(stdout);
}

// ---- ceilings ------------------------------------------------------------------------------------------------
// The fastest of 10 runs of `work` on the default stream, in ms (CUDA events).
template <class Work>
float best_of_10_ms(Work&& work) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  float best = 1e30f;
  for (int i = 0; i < 10; ++i) {
    cudaEventRecord(start);
    work();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    best = std::min(best, ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best;
}

double measure_copy_bandwidth() {  // bytes read + written per second
  const size_t bytes = size_t{2} << 30;
  void *a = nullptr, *b = nullptr;
  check_cuda(cudaMalloc(&a, bytes), "cudaMalloc");
  check_cuda(cudaMalloc(&b, bytes), "cudaMalloc");
  check_cuda(cudaMemset(a, 1, bytes), "cudaMemset");
  const float best = best_of_10_ms([&] { cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice); });
  cudaFree(a);
  cudaFree(b);
  return 2.0 * static_cast<double>(bytes) / (best * 1e-3);
}

double measure_gemm_peak() {  // FLOP/s of a bf16 8192^3 GEMM with fp32 accumulation
  const int n = 8192;
  void *a = nullptr, *b = nullptr, *c = nullptr;
  const size_t elems = static_cast<size_t>(n) * n;
  check_cuda(cudaMalloc(&a, elems * 2), "cudaMalloc");
  check_cuda(cudaMalloc(&b, elems * 2), "cudaMalloc");
  check_cuda(cudaMalloc(&c, elems * 2), "cudaMalloc");
  cudaMemset(a, 0x3c, elems * 2);  // small finite bf16 values
  cudaMemset(b, 0x3c, elems * 2);
  cublasHandle_t handle;
  cublasCreate(&handle);
  const float alpha = 1, beta = 0;
  const float best = best_of_10_ms([&] {
    cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n, &beta, c,
                 CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  });
  cublasDestroy(handle);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return 2.0 * n * static_cast<double>(n) * n / (best * 1e-3);
}

// ---- model arithmetic ----------------------------------------------------------------------------------------
struct ModelBytes {
  double non_expert = 0;     // bytes of every weight outside the routed experts, embedding table excluded
  double per_expert = 0;     // bytes of one routed expert (gate, up, down)
  double embedding_row = 0;  // bytes of one embedding row
  double active_params = 0;  // weights one token multiplies (non-expert + top_k experts), embedding excluded
  int64_t moe_layers = 0;
};

ModelBytes model_bytes(const engine::ModelConfig& c) {
  ModelBytes m;
  double expert_params_total = 0;
  for (const engine::TensorSpec& t : engine::expected_tensors(c)) {
    double n = 1;
    for (int64_t d : t.shape) n *= static_cast<double>(d);
    const bool vector_like =
        t.shape.size() == 1 || t.name.find("conv1d") != std::string::npos || t.name.find("A_log") != std::string::npos;
    const bool router = t.name.ends_with("gate.weight") && t.name.find("block_sparse_moe") != std::string::npos;
    const double bytes = n * (vector_like || router ? 4.0 : 2.0);
    if (t.name.find(".experts.") != std::string::npos) {
      expert_params_total += n;
      continue;
    }
    if (t.name.find("embed_tokens") != std::string::npos) {
      m.embedding_row = 2.0 * static_cast<double>(c.hidden_size);
      continue;
    }
    m.non_expert += bytes;
    m.active_params += n;
  }
  for (int64_t l = 0; l < c.num_layers; ++l) m.moe_layers += c.is_moe_layer(l) ? 1 : 0;
  if (m.moe_layers > 0) {
    m.per_expert = 2.0 * expert_params_total / (static_cast<double>(m.moe_layers) * c.moe.num_experts);
    m.active_params += expert_params_total / static_cast<double>(c.moe.num_experts) * c.moe.num_experts_per_token;
  }
  return m;
}

double kda_state_bytes(const engine::ModelConfig& c) {  // one request, every KDA layer: S + conv tails
  const double h = c.kda.num_heads, d = c.kda.head_dim;
  return static_cast<double>(c.num_layers_of(engine::LayerKind::kKda)) *
         (h * d * d + 3 * h * d * (c.kda.conv_kernel_size - 1)) * 4.0;
}

double mla_bytes_per_token(const engine::ModelConfig& c) {
  return static_cast<double>(c.num_layers_of(engine::LayerKind::kMla)) * c.mla.cache_width() * 2.0;
}

double decode_limit_bytes(const engine::ModelConfig& c, const ModelBytes& m, int64_t batch, int64_t context) {
  const double e = static_cast<double>(c.moe.num_experts), k = static_cast<double>(c.moe.num_experts_per_token);
  const double distinct = m.moe_layers > 0 ? e * (1.0 - std::pow(1.0 - k / e, static_cast<double>(batch))) : 0;
  return m.non_expert + static_cast<double>(m.moe_layers) * distinct * m.per_expert +
         static_cast<double>(batch) * (m.embedding_row + 2.0 * kda_state_bytes(c) + context * mla_bytes_per_token(c));
}

// Minimal FLOPs of prefilling `tokens` tokens from an empty context.
double prefill_flops(const engine::ModelConfig& c, const ModelBytes& m, int64_t tokens) {
  const double t = static_cast<double>(tokens);
  double flops = 2.0 * m.active_params * t;
  const double mla_pair = 2.0 * c.mla.num_heads * (c.mla.qk_head_dim() + c.mla.v_head_dim);
  flops += static_cast<double>(c.num_layers_of(engine::LayerKind::kMla)) * mla_pair * t * (t + 1) / 2;
  const double d = c.kda.head_dim, chunk = 64;
  flops += static_cast<double>(c.num_layers_of(engine::LayerKind::kKda)) * c.kda.num_heads * t *
           (6 * d * d + 3 * chunk * d + chunk * chunk);
  return flops;
}

// ---- runs ----------------------------------------------------------------------------------------------------
double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

struct Bench {
  const Args& args;
  engine::ModelConfig config;
  std::shared_ptr<engine::Backend> backend;
  engine::cuda::CudaBackend* cuda = nullptr;
  std::unique_ptr<engine::Model> model;
  ModelBytes bytes;
  double copy_bw = 0, gemm_peak = 0;

  void decode(int64_t batch, int64_t context) {
    const std::string name = args.label + ",B=" + std::to_string(batch) + ",ctx=" + std::to_string(context);
    std::vector<engine::RequestState> states;
    states.reserve(static_cast<size_t>(batch));
    for (int64_t i = 0; i < batch; ++i) {
      states.push_back(model->new_state());
      const Status assumed = cuda->assume_context(states.back(), context);
      if (!assumed.is_ok()) {
        std::fprintf(stderr, "%s: does not fit (%lld requests of this context fit): %s\n", name.c_str(),
                     static_cast<long long>(i), assumed.to_string().c_str());
        emit("engine_decode", name, "fits", 0, "bool");
        emit("engine_decode", name, "requests_that_fit_now", static_cast<double>(i), "requests");
        return;
      }
    }
    std::vector<int32_t> tokens(static_cast<size_t>(batch));
    for (int64_t i = 0; i < batch; ++i) tokens[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919) % 150000);
    std::vector<engine::SequenceInput> inputs;
    for (int64_t i = 0; i < batch; ++i) {
      inputs.push_back({&states[static_cast<size_t>(i)], {&tokens[static_cast<size_t>(i)], 1}, false});
    }
    auto step = [&] { check(cuda->forward_on_device(inputs), name + " decode step"); };
    const double limit_s = decode_limit_bytes(config, bytes, batch, context) / copy_bw;
    // The same states advance through both modes (the context grows by ~50 tokens: negligible).
    for (const bool graphs : {true, false}) {
      cuda->set_cuda_graphs(graphs);
      const std::string mode = name + (graphs ? ",graph" : ",eager");
      // Graphs: the first step of a shape runs eagerly, the second captures; timing starts after the third.
      for (int i = 0; i < 3; ++i) step();
      check(cuda->synchronize(), "synchronize");
      const int64_t replays_before = cuda->graph_stats().replays;
      const int steps = batch >= 128 ? 10 : 20;
      const auto start = Clock::now();
      for (int i = 0; i < steps; ++i) step();
      check(cuda->synchronize(), "synchronize");
      const double seconds = seconds_since(start) / steps;
      const int64_t replayed = cuda->graph_stats().replays - replays_before;
      std::fprintf(stderr, "%s: %.3f ms per step (limit %.3f ms)%s\n", mode.c_str(), seconds * 1e3, limit_s * 1e3,
                   graphs && replayed < steps ? " [not graph-eligible: ran eagerly]" : "");
      emit("engine_decode", mode, "step_time", seconds * 1e3, "ms", limit_s * 1e3, limit_s / seconds);
      emit("engine_decode", mode, "tokens_per_s", static_cast<double>(batch) / seconds, "tokens/s");
      if (graphs)
        emit("engine_decode", mode, "graph_replayed_steps", static_cast<double>(replayed) / steps, "fraction");
    }
    if (g_args->profiler_step) {
      cuda->set_cuda_graphs(true);
      check_cuda(cudaProfilerStart(), "cudaProfilerStart");
      step();
      check(cuda->synchronize(), "synchronize");
      check_cuda(cudaProfilerStop(), "cudaProfilerStop");
    }
    if (g_args->trace_step) {
      // The graph is captured again with the tracer on (a tracer enabled after a graph's capture may not see its
      // kernels): the capture (with its first replay) and one more replay, then the traced replay.
      cuda->set_cuda_graphs(true);
      check(cuda->synchronize(), "synchronize");
      const std::string started = bench::kernel_trace_start();
      if (!started.empty()) {
        std::fprintf(stderr, "%s: no kernel trace: %s\n", name.c_str(), started.c_str());
      } else {
        cuda->clear_cuda_graphs();
        const int64_t replays_before = cuda->graph_stats().replays;
        for (int i = 0; i < 2; ++i) step();
        check(cuda->synchronize(), "synchronize");
        (void)bench::kernel_trace_stop();  // the capture's replay and the one after it
        const std::string restarted = bench::kernel_trace_start();
        step();
        check(cuda->synchronize(), "synchronize");
        const std::vector<bench::KernelRecord> kernels = bench::kernel_trace_stop();
        const bool replayed = cuda->graph_stats().replays > replays_before;
        std::fprintf(stderr, "kernel timeline of one %s decode step, %s%s:\n%s",
                     replayed ? "graph-replayed" : "eager (no replay)", name.c_str(),
                     restarted.empty() ? "" : (" (restart: " + restarted + ")").c_str(),
                     bench::kernel_timeline_report(kernels).c_str());
        // The same per kernel name as records: what each adds to the step (the adds sum to the span) and its time.
        const bench::KernelTimelineSummary summary = bench::summarize_kernel_timeline(kernels);
        const std::string traced = name + (replayed ? ",graph" : ",eager");
        emit("decode_step_trace", traced + ",whole step (" + std::to_string(summary.kernels) + " kernels)", "span",
             summary.span_us, "us");
        for (const bench::KernelGroup& g : summary.groups) {
          const std::string kernel_case = traced + "," + g.name + " x" + std::to_string(g.count);
          emit("decode_step_trace", kernel_case, "summed_adds", g.adds_us, "us");
          emit("decode_step_trace", kernel_case, "summed_duration", g.duration_us, "us");
        }
      }
    }
    // Per-phase GPU time of one eager step (stderr) at B=1 and B=256, context 4096.
    if (context == 4096 && (batch == 1 || batch == 256)) {
      cuda->enable_profile(true);
      cuda->reset_profile();
      step();
      check(cuda->synchronize(), "synchronize");
      std::fprintf(stderr, "profile of one eager decode step, %s:\n%s", name.c_str(), cuda->profile_table().c_str());
      cuda->enable_profile(false);
      cuda->reset_profile();
    }
    cuda->set_cuda_graphs(true);
  }

  bool prefill_warmed = false;

  // Runs the first `tokens` of `prompt` into `state` in passes of `chunk` tokens and waits for the GPU.
  void prefill_passes(engine::RequestState& state, const std::vector<int32_t>& prompt, int64_t tokens, int64_t chunk,
                      const std::string& what) {
    for (int64_t begin = 0; begin < tokens; begin += chunk) {
      const int64_t n = std::min(chunk, tokens - begin);
      engine::SequenceInput input{
          &state, std::span<const int32_t>(prompt).subspan(static_cast<size_t>(begin), static_cast<size_t>(n)), false};
      check(cuda->forward_on_device({&input, 1}), what);
    }
    check(cuda->synchronize(), "synchronize");
  }

  // Prefills `tokens` tokens in chunks of the backend's max batch (after one warm-up prefill of up to two chunks in
  // the first call), several times; returns the median seconds (or nullopt when skipped).
  std::optional<double> prefill(int64_t tokens, int64_t chunk, std::optional<double> projected) {
    const std::string name = args.label + ",T=" + std::to_string(tokens) + ",chunk=" + std::to_string(chunk);
    if (projected && *projected > args.max_prefill_seconds) {
      std::fprintf(stderr, "%s: skipped, projected %.1f s\n", name.c_str(), *projected);
      emit("engine_prefill", name, "skipped_projected_seconds", *projected, "s");
      return std::nullopt;
    }
    std::vector<int32_t> prompt(static_cast<size_t>(tokens));
    for (int64_t i = 0; i < tokens; ++i) prompt[static_cast<size_t>(i)] = static_cast<int32_t>((i * 104729) % 160000);
    if (!prefill_warmed) {  // a server is warm: lazy module loads and first-call set-up stay out of the timing
      engine::RequestState warm = model->new_state();
      prefill_passes(warm, prompt, std::min(tokens, 2 * chunk), chunk, name + " warm-up prefill chunk");
      prefill_warmed = true;
    }
    // Medians of several timed prefills (5 up to 32k tokens, 3 above), each of a new request.
    const int runs = tokens <= 32768 ? 5 : 3;
    std::vector<double> prefill_s, ttft_s;
    engine::RequestState state;
    for (int run = 0; run < runs; ++run) {
      state = model->new_state();  // gives the previous run's slot and pages back
      const auto start = Clock::now();
      prefill_passes(state, prompt, tokens, chunk, name + " prefill chunk");
      prefill_s.push_back(seconds_since(start));
      // TTFT adds the first decode step of this request (the cluster's N-1 prefill + 1 decode).
      const int32_t next = 42;
      engine::SequenceInput first{&state, {&next, 1}, false};
      const auto decode_start = Clock::now();
      check(cuda->forward_on_device({&first, 1}), name + " first decode step");
      check(cuda->synchronize(), "synchronize");
      ttft_s.push_back(prefill_s.back() + seconds_since(decode_start));
    }
    std::sort(prefill_s.begin(), prefill_s.end());
    std::sort(ttft_s.begin(), ttft_s.end());
    const double seconds = prefill_s[prefill_s.size() / 2], ttft = ttft_s[ttft_s.size() / 2];
    const double flops = prefill_flops(config, bytes, tokens);
    const double limit_s = flops / gemm_peak;
    std::fprintf(stderr, "%s: %.3f s (median of %d, %.3f-%.3f), %.0f tokens/s (FLOP limit %.3f s), TTFT %.3f s\n",
                 name.c_str(), seconds, runs, prefill_s.front(), prefill_s.back(),
                 static_cast<double>(tokens) / seconds, limit_s, ttft);
    emit("engine_prefill", name, "tokens_per_s", static_cast<double>(tokens) / seconds, "tokens/s",
         static_cast<double>(tokens) / limit_s, limit_s / seconds);
    emit("engine_prefill", name, "achieved_flops", flops / seconds / 1e12, "TFLOP/s", gemm_peak / 1e12,
         flops / seconds / gemm_peak);
    emit("engine_prefill", name, "ttft", ttft, "s", limit_s, limit_s / ttft);
    if (tokens == 32768) {         // per-phase GPU time of one (separate) eager prefill of 32k, to stderr
      state = model->new_state();  // gives the timed request's slot and pages back
      cuda->enable_profile(true);
      cuda->reset_profile();
      prefill_passes(state, prompt, tokens, chunk, name + " profiled prefill chunk");
      std::fprintf(stderr, "profile of one eager prefill, %s:\n%s", name.c_str(), cuda->profile_table().c_str());
      cuda->enable_profile(false);
      cuda->reset_profile();
    }
    return seconds;
  }
};

}  // namespace

int main(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) die("missing value for " + flag);
      return argv[++i];
    };
    if (flag == "--config")
      args.config_path = value();
    else if (flag == "--label")
      args.label = value();
    else if (flag == "--commit")
      args.commit = value();
    else if (flag == "--date")
      args.date = value();
    else if (flag == "--machine")
      args.machine = value();
    else if (flag == "--command")
      args.command = value();
    else if (flag == "--layers")
      args.layers = std::stoll(value());
    else if (flag == "--first-dense")
      args.first_dense = std::stoll(value());
    else if (flag == "--kinds") {
      std::stringstream in(value());
      std::string kind;
      while (std::getline(in, kind, ',')) {
        if (kind != "kda" && kind != "mla") die("--kinds: '" + kind + "' is not kda or mla");
        args.kinds.push_back(kind == "kda" ? engine::LayerKind::kKda : engine::LayerKind::kMla);
      }
    } else if (flag == "--batches")
      args.batches = parse_list(value());
    else if (flag == "--contexts")
      args.contexts = parse_list(value());
    else if (flag == "--prompts")
      args.prompts = parse_list(value());
    else if (flag == "--memory-fraction")
      args.memory_fraction = std::stod(value());
    else if (flag == "--max-prefill-seconds")
      args.max_prefill_seconds = std::stod(value());
    else if (flag == "--prefill-chunk")
      args.prefill_chunk = std::stoll(value());
    else if (flag == "--no-ceilings")
      args.ceilings = false;
    else if (flag == "--profiler-step")
      args.profiler_step = true;
    else if (flag == "--trace-step")
      args.trace_step = true;
    else
      die("unknown flag " + flag);
  }
  if (args.config_path.empty()) die("--config is required");
  if (args.command.empty()) {  // the command line as run: the program's file name, then every argument
    const std::string program = argv[0];
    args.command = program.substr(program.find_last_of('/') + 1);
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      const bool plain = !arg.empty() && arg.find_first_of(" '\"$") == std::string::npos;
      args.command += " " + (plain ? arg : "'" + arg + "'");
    }
  }
  g_args = &args;

  Bench bench{args};
  auto config = engine::load_model_config(args.config_path);
  check(config.status(), "config " + args.config_path);
  bench.config = *config;
  if (args.layers) {  // the first N layers of the model (kinds as in the config)
    bench.config.num_layers = *args.layers;
    bench.config.layer_kinds.resize(static_cast<size_t>(*args.layers));
  }
  if (!args.kinds.empty()) {
    bench.config.num_layers = static_cast<int64_t>(args.kinds.size());
    bench.config.layer_kinds = args.kinds;
  }
  if (args.first_dense) bench.config.moe.first_k_dense_replace = *args.first_dense;
  bench.bytes = model_bytes(bench.config);

  bench.copy_bw = measure_copy_bandwidth();
  bench.gemm_peak = measure_gemm_peak();
  std::fprintf(stderr, "copy %.3f TB/s, bf16 GEMM %.1f TFLOP/s\n", bench.copy_bw / 1e12, bench.gemm_peak / 1e12);
  if (args.ceilings) {
    emit("gpu_copy_ceiling", "device-to-device copy 2 GiB, bytes read+written", "bandwidth", bench.copy_bw / 1e12,
         "TB/s");
    emit("gpu_gemm_ceiling", "cuBLAS bf16 GEMM 8192^3, fp32 accumulate", "throughput", bench.gemm_peak / 1e12,
         "TFLOP/s");
  }

  engine::cuda::CudaBackendOptions options;
  options.memory_fraction = args.memory_fraction;
  options.max_batch_tokens = args.prefill_chunk;
  options.max_requests = 512;
  const auto load_start = Clock::now();
  auto backend = engine::cuda::make_cuda_backend_random(bench.config, 1, options);
  check(backend.status(), "random weights on the device");
  check_cuda(cudaDeviceSynchronize(), "init");
  const double load_s = seconds_since(load_start);
  bench.backend = *backend;
  bench.cuda = dynamic_cast<engine::cuda::CudaBackend*>(bench.backend.get());
  bench.model = std::make_unique<engine::Model>(bench.config, bench.backend);
  const engine::BackendCapacity cap = bench.backend->capacity();
  std::fprintf(stderr,
               "%s: %.1f GB weights (random, %.1f s), %lld slots of %.1f MB, %lld pages of %lld tokens, %.2f GB free\n",
               args.label.c_str(), cap.weight_bytes / 1e9, load_s, static_cast<long long>(cap.state_slots),
               cap.state_slot_bytes / 1e6, static_cast<long long>(cap.cache_pages),
               static_cast<long long>(cap.page_tokens), cap.free_bytes_after / 1e9);
  // The plan depends on the scratch of one pass (max_batch_tokens rows), so its case names the pass size.
  const std::string plan_case = args.label + ",max_batch_tokens=" + std::to_string(args.prefill_chunk);
  emit("engine_memory", args.label, "weight_bytes", static_cast<double>(cap.weight_bytes) / 1e9, "GB");
  emit("engine_memory", plan_case, "state_slots", static_cast<double>(cap.state_slots), "slots");
  emit("engine_memory", plan_case, "cache_pages", static_cast<double>(cap.cache_pages), "pages");
  emit("engine_memory", plan_case + ",32k-token requests", "requests_that_fit",
       static_cast<double>(cap.requests_that_fit(32768)), "requests");

  for (int64_t context : args.contexts) {
    for (int64_t batch : args.batches) bench.decode(batch, context);
  }
  std::optional<double> last_seconds;
  int64_t last_tokens = 0;
  for (int64_t tokens : args.prompts) {
    std::optional<double> projected;
    if (last_seconds) {  // attention grows with the square of the length: a pessimistic projection
      const double r = static_cast<double>(tokens) / static_cast<double>(last_tokens);
      projected = *last_seconds * r * r;
    }
    auto seconds = bench.prefill(tokens, options.max_batch_tokens, projected);
    if (seconds) {
      last_seconds = seconds;
      last_tokens = tokens;
    }
  }
  return 0;
}
