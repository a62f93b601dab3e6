// GPU fused decode step vs the CPU chain the engine runs per token (short_conv_silu, l2_normalize_heads,
// kda_gate, sigmoid, kda_recurrent, kda_gated_output_norm), ctest label gpu. Inputs are bf16-representable.
// Tolerances: the state is fp32 on both sides (relative L2 <= 1e-5); the conv tails are bf16 on the device and hold
// bf16 inputs, so they match exactly (<= 1e-6); the bf16 output <= 1e-2. Slots not in the batch must stay
// bit-identical; skipped rows (slot < 0) output zeros (the output starts as NaN). Cases with several layers launch
// them back to back per step (each its own state, tails and output), which is where early state loads may overlap.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include "kernels/cuda/kda/kda.hpp"
#include "kernels/cuda/tests/gpu_test_graph.hpp"
#include "kernels/cuda/tests/kda_decode_test_util.hpp"
#include "kernels/cuda/tests/kda_test_util.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

constexpr int kD = 128;

struct DecodeCase {
  int heads = 4;
  int conv_kernel = 4;
  int num_slots = 10;
  std::vector<int32_t> slots = {3, 7, -1, 0, 9, 5};
  std::optional<float> lower_bound = -5.0f;
  int steps = 1;
  bool graph = false;
  uint32_t seed = 1;
  int layers = 1;                  // launched in order each step, each with its own state, tails and output
  bool early_state_loads = false;  // valid with layers >= 2: the kernel before a layer's is another layer's
  // 1 = the gate logits from gate_low and f_b inside the kernel, 2 = the output gate's from g_b too.
  int fused_gates = 0;
};

void run_decode_case(const DecodeCase& c) {
  std::mt19937 rng(c.seed);
  const int H = c.heads, K = c.conv_kernel, B = static_cast<int>(c.slots.size());
  const int64_t C = static_cast<int64_t>(H) * kD;
  const size_t state_size = static_cast<size_t>(H) * kD * kD, tail_size = static_cast<size_t>(3 * C * (K - 1));
  KdaDecodeInputs in(rng, B, H);
  const KdaDecodeWeights w(rng, H, K);
  const int L = c.layers;
  // Tails are bf16 on the device (exact for the bf16 projection inputs they hold): start from bf16 values.
  std::vector<float> conv_state =
      to_float(to_bf16(normal_vector(rng, L * c.num_slots * tail_size)), L * c.num_slots * tail_size);
  std::vector<float> state = normal_vector(rng, L * c.num_slots * state_size, 0.0f, 0.05f);
  const size_t layer_tails = c.num_slots * tail_size, layer_states = c.num_slots * state_size;
  const float eps = 1e-5f;

  // Fused gates: gate_low [B, 2 kD + 8] and f_b, g_b [C, kD] drawn from {-2, ..., 2} / 4, so that every product and
  // every partial sum is exact in fp32 (multiples of 1/16 below 2^20) and, checked here, every logit is a bf16
  // value: the kernel's fp32 dot products, whatever their order, round to exactly the logits that the CPU reference
  // reads as gate_raw (and out_gate).
  const int64_t low_stride = 2 * kD + 8;
  DeviceBuffer<__nv_bfloat16> low_d(c.fused_gates ? B * low_stride : 0), f_b_d(c.fused_gates ? C * kD : 0),
      g_b_d(c.fused_gates ? C * kD : 0);
  if (c.fused_gates) {
    std::uniform_int_distribution<int> step(-2, 2);
    auto draw = [&](size_t n) {
      std::vector<float> x(n);
      for (float& value : x) value = 0.25f * static_cast<float>(step(rng));
      return x;
    };
    const std::vector<float> low = draw(B * low_stride), f_b = draw(C * kD), g_b = draw(C * kD);
    for (int b = 0; b < B; ++b) {
      for (int64_t channel = 0; channel < C; ++channel) {
        float gate = 0.0f, out_gate = 0.0f;
        for (int j = 0; j < kD; ++j) {
          gate += f_b[channel * kD + j] * low[b * low_stride + j];
          out_gate += g_b[channel * kD + j] * low[b * low_stride + kD + j];
        }
        ASSERT_EQ(bf16_round(gate), gate) << "row " << b << " channel " << channel;
        in.gate_raw[b * C + channel] = gate;
        if (c.fused_gates == 2) {
          ASSERT_EQ(bf16_round(out_gate), out_gate) << "row " << b << " channel " << channel;
          in.out_gate[b * C + channel] = out_gate;
        }
      }
    }
    low_d.upload(to_bf16(low));
    f_b_d.upload(to_bf16(f_b));
    g_b_d.upload(to_bf16(g_b));
  }

  // Device.
  DeviceBuffer<__nv_bfloat16> out_d(L * B * C);
  out_d.upload(std::vector<__nv_bfloat16>(L * B * C, bf16_nan()));
  DeviceBuffer<__nv_bfloat16> conv_d(conv_state.size());
  DeviceBuffer<float> state_d(state.size());
  DeviceBuffer<int32_t> slots_d(B);
  conv_d.upload(to_bf16(conv_state));
  state_d.upload(state);
  slots_d.upload(c.slots);

  std::vector<KdaDecodeParams> params(L);
  for (int l = 0; l < L; ++l) {
    KdaDecodeParams& p = params[l];
    p = kda_decode_params(B, H, K, c.num_slots, slots_d.get(), in, w, c.lower_bound, eps);
    p.conv_state = conv_d.get() + l * layer_tails;
    p.state = state_d.get() + l * layer_states;
    p.out = out_d.get() + static_cast<size_t>(l) * B * C;
    p.early_state_loads = c.early_state_loads;
    if (c.fused_gates) {
      p.gate_raw = nullptr;  // not read
      p.gate_low = low_d.get();
      p.gate_low_stride = low_stride;
      p.f_b = f_b_d.get();
      if (c.fused_gates == 2) {
        p.g_b = g_b_d.get();
        p.out_gate = nullptr;  // not read
      }
    }
  }
  auto launch_step = [&](cudaStream_t stream) {
    for (const KdaDecodeParams& p : params) {
      const Status status = kda_decode_step(p, stream);
      if (!status.is_ok()) return status;
    }
    return Status::ok();
  };

  cudaStream_t stream;
  DS_CUDA_OK(cudaStreamCreate(&stream));
  if (c.graph) {
    ASSERT_NO_FATAL_FAILURE(replay_captured(stream, cudaStreamCaptureModeGlobal, c.steps, launch_step));
  } else {
    for (int step = 0; step < c.steps; ++step) {
      const Status status = launch_step(stream);
      ASSERT_TRUE(status.is_ok()) << status.to_string();
    }
    DS_CUDA_OK(cudaStreamSynchronize(stream));
  }
  DS_CUDA_OK(cudaStreamDestroy(stream));

  // CPU reference: the same inputs `steps` times, every layer.
  std::vector<float> out_ref(L * B * C, 0.0f);
  std::vector<float> conv_ref(conv_state), state_ref(state);
  for (int step = 0; step < c.steps; ++step) {
    for (int l = 0; l < L; ++l) {
      for (int b = 0; b < B; ++b) {
        const int slot = c.slots[b];
        if (slot < 0) continue;
        cpu_decode_token(in, w, b, H, K, c.lower_bound, eps, conv_ref.data() + l * layer_tails + slot * tail_size,
                         state_ref.data() + l * layer_states + slot * state_size, &out_ref[(l * B + b) * C]);
      }
    }
  }

  const std::vector<float> out = to_float(out_d.download(), L * B * C);
  const std::vector<float> state_got = state_d.download(), conv_got = to_float(conv_d.download(), conv_state.size());
  const double out_error = relative_error(out.data(), out_ref.data(), out.size());
  const double state_error = relative_error(state_got.data(), state_ref.data(), state_got.size());
  const double conv_error = relative_error(conv_got.data(), conv_ref.data(), conv_got.size());
  std::printf(
      "[ kda decode ] B=%d H=%d K=%d layers=%d steps=%d graph=%d early=%d lb=%d fused_gates=%d: out %.2e, state "
      "%.2e, conv tails %.2e\n",
      B, H, K, L, c.steps, c.graph ? 1 : 0, c.early_state_loads ? 1 : 0, c.lower_bound ? 1 : 0, c.fused_gates,
      out_error, state_error, conv_error);
  if (state_error > 1e-5 || out_error > 1e-2 || conv_error > 1e-6) {
    // First wrong (layer, slot, head, key row, value column), tail and output element, to tell a misplaced item
    // from bad math.
    for (size_t i = 0; i < state_got.size(); ++i) {
      const float want = state_ref[i], got = state_got[i];
      if (!(std::abs(got - want) <= 1e-4f * (1.0f + std::abs(want)))) {
        const size_t per_head = static_cast<size_t>(kD) * kD, j = i % layer_states;
        ADD_FAILURE() << "first state mismatch at layer " << i / layer_states << " slot " << j / state_size << " head "
                      << (j % state_size) / per_head << " key row " << (j % per_head) / kD << " column " << j % kD
                      << ": got " << got << ", want " << want;
        break;
      }
    }
    for (size_t i = 0; i < conv_got.size(); ++i) {
      if (!(std::abs(conv_got[i] - conv_ref[i]) <= 1e-5f * (1.0f + std::abs(conv_ref[i])))) {
        const size_t j = i % layer_tails, per_slot = tail_size, per_which = per_slot / 3;
        ADD_FAILURE() << "first conv tail mismatch at layer " << i / layer_tails << " slot " << j / per_slot
                      << " which " << (j % per_slot) / per_which << " channel "
                      << (j % per_which) / static_cast<size_t>(K - 1) << ": got " << conv_got[i] << ", want "
                      << conv_ref[i];
        break;
      }
    }
    for (size_t i = 0; i < out.size(); ++i) {
      if (!(std::abs(out[i] - out_ref[i]) <= 2e-2f * (1.0f + std::abs(out_ref[i])))) {
        ADD_FAILURE() << "first output mismatch at layer " << i / (B * C) << " row " << (i / C) % B << " head "
                      << (i % C) / kD << " column " << i % kD << ": got " << out[i] << ", want " << out_ref[i];
        break;
      }
    }
  }
  EXPECT_LE(out_error, 1e-2);
  EXPECT_LE(state_error, 1e-5);
  EXPECT_LE(conv_error, 1e-6);
  // Untouched slots bit-identical (state and tails); skipped rows zero.
  for (int l = 0; l < L; ++l) {
    for (int slot = 0; slot < c.num_slots; ++slot) {
      if (std::find(c.slots.begin(), c.slots.end(), slot) != c.slots.end()) continue;
      const size_t state_at = l * layer_states + slot * state_size, tail_at = l * layer_tails + slot * tail_size;
      EXPECT_EQ(0, std::memcmp(state_got.data() + state_at, state.data() + state_at, state_size * sizeof(float)))
          << "layer " << l << " slot " << slot << " state changed";
      EXPECT_EQ(0, std::memcmp(conv_got.data() + tail_at, conv_state.data() + tail_at, tail_size * sizeof(float)))
          << "layer " << l << " slot " << slot << " conv tails changed";
    }
    for (int b = 0; b < B; ++b) {
      if (c.slots[b] >= 0) continue;
      for (int64_t i = 0; i < C; ++i) {
        ASSERT_EQ(out[(l * B + b) * C + i], 0.0f) << "layer " << l << " skipped row " << b;
      }
    }
  }
}

TEST(KdaDecodeGpu, BoundedGateSlotPool) {
  run_decode_case({.seed = 1});
}

TEST(KdaDecodeGpu, SoftplusGate) {
  run_decode_case({.lower_bound = std::nullopt, .seed = 2});
}

TEST(KdaDecodeGpu, ThirtyTwoHeadsShortKernels) {
  for (int kernel : {1, 2, 4}) {
    SCOPED_TRACE("conv kernel " + std::to_string(kernel));
    run_decode_case({.heads = 32, .conv_kernel = kernel, .num_slots = 5, .slots = {4, 1}, .seed = 3});
  }
}

TEST(KdaDecodeGpu, ThreeStepsEager) {
  run_decode_case({.steps = 3, .seed = 4});
}

TEST(KdaDecodeGpu, ThreeStepsCudaGraph) {
  run_decode_case({.steps = 3, .graph = true, .seed = 5});
}

TEST(KdaDecodeGpu, LargeBatchGraph) {
  std::vector<int32_t> slots;
  for (int b = 0; b < 70; ++b) slots.push_back(b % 7 == 3 ? -1 : (b * 37) % 97);
  run_decode_case({.heads = 8, .num_slots = 97, .slots = slots, .steps = 2, .graph = true, .seed = 6});
}

// 32 heads x 44 rows with skipped rows between valid ones, two steps eager and three as a graph.
TEST(KdaDecodeGpu, ManyItemsPerCtaEagerAndGraph) {
  std::vector<int32_t> slots;
  for (int b = 0; b < 44; ++b) slots.push_back(b % 5 == 2 ? -1 : (b * 13) % 53);
  run_decode_case({.heads = 32, .num_slots = 53, .slots = slots, .steps = 2, .seed = 7});
  run_decode_case({.heads = 32, .num_slots = 53, .slots = slots, .steps = 3, .graph = true, .seed = 8});
}

// All rows skipped except the last.
TEST(KdaDecodeGpu, MostlySkippedRows) {
  std::vector<int32_t> slots(30, -1);
  slots.back() = 2;
  run_decode_case({.heads = 32, .num_slots = 3, .slots = slots, .seed = 9});
}

// Three layers per step, so each kernel's predecessor on the stream is another layer's decode step: with early
// state loads the step issues its state loads before that kernel has finished (programmatic dependent
// launch). Odd batch with skipped rows; eager and as a graph; short conv and softplus gate too.
TEST(KdaDecodeGpu, EarlyStateLoadsLayersEagerAndGraph) {
  std::vector<int32_t> slots;
  for (int b = 0; b < 37; ++b) slots.push_back(b % 6 == 1 ? -1 : (b * 11) % 41);
  const DecodeCase base{.heads = 32, .num_slots = 41, .slots = slots, .steps = 3, .layers = 3};
  DecodeCase c = base;
  c.early_state_loads = true;
  c.seed = 10;
  run_decode_case(c);
  c.graph = true;
  c.seed = 11;
  run_decode_case(c);
  c.conv_kernel = 2;
  c.lower_bound = std::nullopt;
  c.seed = 12;
  run_decode_case(c);
  // The same layers without early loads: every kernel waits for its predecessor before it reads anything.
  c = base;
  c.graph = true;
  c.seed = 13;
  run_decode_case(c);
}

// Five eager steps of one layer: each kernel's predecessor on the stream writes the same state (no early loads),
// so the step, launched as a programmatic dependent, must wait for it before it loads anything.
TEST(KdaDecodeGpu, SameStateBackToBackEager) {
  run_decode_case({.heads = 32, .num_slots = 9, .slots = {8, 0, 5, -1, 2}, .steps = 5, .seed = 14});
}

// The gate (and output-gate) logits from the low-rank up-projections inside the step: one layer eager with skipped
// rows, the softplus gate, and three layers with early state loads as a graph (the engine's setting at small batches).
TEST(KdaDecodeGpu, FusedLowRankGates) {
  for (const int fused : {1, 2}) {
    SCOPED_TRACE("fused_gates " + std::to_string(fused));
    run_decode_case({.seed = 31, .fused_gates = fused});
    run_decode_case({.heads = 32,
                     .num_slots = 6,
                     .slots = {5, 0, -1, 3},
                     .lower_bound = std::nullopt,
                     .steps = 2,
                     .seed = 32,
                     .fused_gates = fused});
    run_decode_case({.heads = 32,
                     .num_slots = 4,
                     .slots = {2},
                     .steps = 3,
                     .graph = true,
                     .seed = 33,
                     .layers = 3,
                     .early_state_loads = true,
                     .fused_gates = fused});
  }
}

TEST(KdaDecodeGpu, FusedLowRankGatesValidation) {
  std::mt19937 rng(34);
  const KdaDecodeInputs in(rng, 1, 1);
  const KdaDecodeWeights w(rng, 1, 4);
  DeviceBuffer<int32_t> slots_d(1);
  DeviceBuffer<__nv_bfloat16> low_d(2 * kD), weights_d(2 * kD * kD), out_d(kD), conv_d(3 * kD * 3);
  DeviceBuffer<float> state_d(kD * kD);
  KdaDecodeParams p = kda_decode_params(1, 1, 4, 1, slots_d.get(), in, w, -5.0f, 1e-5f);
  p.conv_state = conv_d.get();
  p.state = state_d.get();
  p.out = out_d.get();
  p.gate_low = low_d.get();
  p.gate_low_stride = 2 * kD;
  p.f_b = weights_d.get();
  p.g_b = weights_d.get() + kD * kD;
  p.gate_low_stride = kD;  // g_b needs the second half
  EXPECT_EQ(kda_decode_step(p, nullptr).code(), StatusCode::kInvalidArgument);
  p.gate_low_stride = 2 * kD + 4;  // not a multiple of 8
  EXPECT_EQ(kda_decode_step(p, nullptr).code(), StatusCode::kInvalidArgument);
  p.gate_low_stride = 2 * kD;
  p.f_b = nullptr;
  EXPECT_EQ(kda_decode_step(p, nullptr).code(), StatusCode::kInvalidArgument);
  p.gate_low = nullptr;  // f_b / g_b without gate_low
  p.f_b = weights_d.get();
  EXPECT_EQ(kda_decode_step(p, nullptr).code(), StatusCode::kInvalidArgument);
}

TEST(KdaDecodeGpu, ValidationRejectsBadInputs) {
  KdaDecodeParams p;
  p.batch = 1;
  p.num_heads = 1;
  p.num_slots = 1;
  EXPECT_EQ(kda_decode_step(p, nullptr).code(), StatusCode::kInvalidArgument);  // null pointers
  p.head_dim = 64;
  EXPECT_EQ(kda_decode_step(p, nullptr).code(), StatusCode::kUnimplemented);
  p.head_dim = 128;
  p.conv_kernel = 5;
  EXPECT_EQ(kda_decode_step(p, nullptr).code(), StatusCode::kUnimplemented);
  p.conv_kernel = 4;
  p.num_slots = 0;
  EXPECT_EQ(kda_decode_step(p, nullptr).code(), StatusCode::kInvalidArgument);
  p.num_slots = 1;
  p.lower_bound = 1.0f;
  EXPECT_EQ(kda_decode_step(p, nullptr).code(), StatusCode::kInvalidArgument);
  p.batch = 0;
  p.lower_bound.reset();
  EXPECT_TRUE(kda_decode_step(p, nullptr).is_ok());  // nothing to do
}

// Per-layer time of the step without and with early state loads at H = 32, K = 4, B in {1, 8, 64, 256}: 8-layer
// graphs (each layer its own state and tails, as in a model), mean over 20 replays after 3 warm-up replays. One
// line per (B, early) with the bytes it moves as a ratio to 4.26 TB/s (state bytes alone, and all bytes) and the
// time without early loads in the same run. Asserts correctness only: after the same 23 steps from the same start,
// the states (first slots of layer 0) and last-layer outputs with early loads match those without.
TEST(KdaDecodeGpu, EarlyStateLoadsTiming) {
  constexpr int H = 32, K = 4, kLayers = 8, kWarmup = 3, kReplays = 20;
  constexpr double kCopyBytesPerSecond = 4.26e12;
  constexpr int64_t C = int64_t{H} * kD;
  const size_t slot_state = static_cast<size_t>(H) * kD * kD, slot_tails = static_cast<size_t>(3 * C * (K - 1));
  std::mt19937 rng(21);
  const KdaDecodeWeights w(rng, H, K);
  // One slot's state and tails, copied into every (layer, slot) before each kernel runs.
  DeviceBuffer<float> state_pattern(slot_state);
  DeviceBuffer<__nv_bfloat16> tails_pattern(slot_tails);
  state_pattern.upload(normal_vector(rng, slot_state, 0.0f, 0.05f));
  tails_pattern.upload(to_bf16(normal_vector(rng, slot_tails)));
  cudaStream_t stream;
  DS_CUDA_OK(cudaStreamCreate(&stream));

  for (const int B : {1, 8, 64, 256}) {
    const KdaDecodeInputs in(rng, B, H, 1.0f);
    std::vector<int32_t> slots(B);
    for (int b = 0; b < B; ++b) slots[b] = b;
    DeviceBuffer<int32_t> slots_d(B);
    slots_d.upload(slots);
    DeviceBuffer<float> state_d(kLayers * B * slot_state);
    DeviceBuffer<__nv_bfloat16> conv_d(kLayers * B * slot_tails);
    DeviceBuffer<__nv_bfloat16> out_d(kLayers * B * C);
    ASSERT_NE(state_d.get(), nullptr) << "B=" << B << ": state allocation failed";
    std::vector<KdaDecodeParams> params(kLayers);
    for (int l = 0; l < kLayers; ++l) {
      KdaDecodeParams& p = params[l];
      p = kda_decode_params(B, H, K, B, slots_d.get(), in, w, -5.0f, 1e-5f);
      p.conv_state = conv_d.get() + static_cast<size_t>(l) * B * slot_tails;
      p.state = state_d.get() + static_cast<size_t>(l) * B * slot_state;
      p.out = out_d.get() + static_cast<size_t>(l) * B * C;
    }
    const double state_bytes = 2.0 * B * H * kD * kD * 4;
    const double all_bytes = state_bytes + 2.0 * B * 3 * C * (K - 1) * 2 + B * (5.0 * C + H) * 2 + B * C * 2.0;
    const int compared_slots = std::min(B, 8);
    std::vector<float> plain_state, plain_out;
    double plain_us = 0.0;
    for (const bool early : {false, true}) {
      SCOPED_TRACE(std::string("B=") + std::to_string(B) + (early ? " early" : ""));
      for (int i = 0; i < kLayers * B; ++i) {
        DS_CUDA_OK(cudaMemcpyAsync(state_d.get() + i * slot_state, state_pattern.get(), slot_state * sizeof(float),
                                   cudaMemcpyDeviceToDevice, stream));
        DS_CUDA_OK(cudaMemcpyAsync(conv_d.get() + i * slot_tails, tails_pattern.get(),
                                   slot_tails * sizeof(__nv_bfloat16), cudaMemcpyDeviceToDevice, stream));
      }
      DS_CUDA_OK(cudaMemsetAsync(out_d.get(), 0xff, out_d.size() * sizeof(__nv_bfloat16), stream));  // NaN
      for (KdaDecodeParams& p : params) p.early_state_loads = early;
      const auto step = [&](cudaStream_t s) {
        Status status = Status::ok();
        for (const KdaDecodeParams& p : params) {
          if (status.is_ok()) status = kda_decode_step(p, s);
        }
        return status;
      };
      double ms = 0.0;
      ASSERT_NO_FATAL_FAILURE(time_graph_replays(stream, cudaStreamCaptureModeGlobal, kWarmup, kReplays, step, &ms));
      const double us = 1e3 * ms / kLayers;
      std::vector<float> state(compared_slots * slot_state);
      DS_CUDA_OK(cudaMemcpy(state.data(), state_d.get(), state.size() * sizeof(float), cudaMemcpyDeviceToHost));
      std::vector<__nv_bfloat16> out_raw(static_cast<size_t>(B) * C);
      DS_CUDA_OK(cudaMemcpy(out_raw.data(), params.back().out, out_raw.size() * sizeof(__nv_bfloat16),
                            cudaMemcpyDeviceToHost));
      const std::vector<float> out = to_float(out_raw, out_raw.size());
      if (!early) {
        plain_us = us;
        plain_state = state;
        plain_out = out;
        for (const float value : out) ASSERT_TRUE(std::isfinite(value)) << "output not finite";
      } else {
        EXPECT_LE(relative_error(state.data(), plain_state.data(), state.size()), 1e-4);
        EXPECT_LE(relative_error(out.data(), plain_out.data(), out.size()), 1e-2);
      }
      std::printf(
          "[ kda decode timing ] H=%d B=%d early=%d: %.2f us per layer (%d-layer graph, mean of %d); state "
          "%.1f MB -> %.3f of 4.26 TB/s, all %.1f MB -> %.3f; without early loads %.2f us in this run (%.2fx)\n",
          H, B, early ? 1 : 0, us, kLayers, kReplays, state_bytes / 1e6,
          state_bytes / (us * 1e-6) / kCopyBytesPerSecond, all_bytes / 1e6,
          all_bytes / (us * 1e-6) / kCopyBytesPerSecond, plain_us, plain_us / us);
      std::fflush(stdout);
    }
  }
  DS_CUDA_OK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
