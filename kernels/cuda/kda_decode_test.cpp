// GPU fused decode step vs the CPU chain the engine runs per token (short_conv_silu, l2_normalize_heads,
// kda_gate, sigmoid, kda_recurrent, kda_gated_output_norm), ctest label gpu. Inputs are bf16-representable.
// Tolerances: state and conv tails are fp32 on both sides (relative L2 <= 1e-5); the bf16 output <= 1e-2.
// Slots not in the batch must stay bit-identical; skipped rows (slot < 0) output zeros.
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include "kernels/cpu/basic_ops.hpp"
#include "kernels/cpu/kda.hpp"
#include "kernels/cuda/kda.hpp"
#include "kernels/cuda/kda_test_util.hpp"

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
};

void run_decode_case(const DecodeCase& c) {
  std::mt19937 rng(c.seed);
  const int H = c.heads, K = c.conv_kernel, B = static_cast<int>(c.slots.size());
  const int64_t C = static_cast<int64_t>(H) * kD;
  const size_t state_size = static_cast<size_t>(H) * kD * kD, tail_size = static_cast<size_t>(3 * C * (K - 1));
  auto rounded = [&](size_t n, float stddev) {
    std::vector<float> x = normal_vector(rng, n, 0.0f, stddev);
    for (float& value : x) value = bf16_round(value);
    return x;
  };
  std::vector<float> q_in = rounded(B * C, 1.0f), k_in = rounded(B * C, 1.0f), v_in = rounded(B * C, 1.0f);
  std::vector<float> gate_raw = rounded(B * C, 2.0f), beta_raw = rounded(B * H, 1.0f);
  std::vector<float> out_gate = rounded(B * C, 1.0f);
  std::vector<float> q_w = normal_vector(rng, C * K, 0.0f, 0.5f), k_w = normal_vector(rng, C * K, 0.0f, 0.5f);
  std::vector<float> v_w = normal_vector(rng, C * K, 0.0f, 0.5f);
  std::vector<float> a_log = normal_vector(rng, H, 0.0f, 0.5f), dt_bias = normal_vector(rng, C, 0.0f, 0.5f);
  std::vector<float> norm_w = normal_vector(rng, kD, 1.0f, 0.1f);
  std::vector<float> conv_state = normal_vector(rng, c.num_slots * tail_size);
  std::vector<float> state = normal_vector(rng, c.num_slots * state_size, 0.0f, 0.05f);
  const float eps = 1e-5f;

  // Device.
  DeviceBuffer<__nv_bfloat16> q_d(B * C), k_d(B * C), v_d(B * C), gate_d(B * C), beta_d(B * H), og_d(B * C);
  DeviceBuffer<__nv_bfloat16> out_d(B * C);
  q_d.upload(to_bf16(q_in));
  k_d.upload(to_bf16(k_in));
  v_d.upload(to_bf16(v_in));
  gate_d.upload(to_bf16(gate_raw));
  beta_d.upload(to_bf16(beta_raw));
  og_d.upload(to_bf16(out_gate));
  out_d.upload(std::vector<__nv_bfloat16>(B * C, bf16_nan()));
  DeviceBuffer<float> qw_d(C * K), kw_d(C * K), vw_d(C * K), a_d(H), dt_d(C), nw_d(kD);
  DeviceBuffer<float> conv_d(conv_state.size()), state_d(state.size());
  DeviceBuffer<int32_t> slots_d(B);
  qw_d.upload(q_w);
  kw_d.upload(k_w);
  vw_d.upload(v_w);
  a_d.upload(a_log);
  dt_d.upload(dt_bias);
  nw_d.upload(norm_w);
  conv_d.upload(conv_state);
  state_d.upload(state);
  slots_d.upload(c.slots);

  KdaDecodeParams p;
  p.batch = B;
  p.num_heads = H;
  p.conv_kernel = K;
  p.num_slots = c.num_slots;
  p.slots = slots_d.get();
  p.q_in = q_d.get();
  p.k_in = k_d.get();
  p.v_in = v_d.get();
  p.gate_raw = gate_d.get();
  p.beta_raw = beta_d.get();
  p.out_gate = og_d.get();
  p.q_conv_weight = qw_d.get();
  p.k_conv_weight = kw_d.get();
  p.v_conv_weight = vw_d.get();
  p.a_log = a_d.get();
  p.dt_bias = dt_d.get();
  p.lower_bound = c.lower_bound;
  p.o_norm_weight = nw_d.get();
  p.rms_eps = eps;
  p.conv_state = conv_d.get();
  p.state = state_d.get();
  p.out = out_d.get();

  cudaStream_t stream;
  DS_CUDA_OK(cudaStreamCreate(&stream));
  if (c.graph) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    DS_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    const Status status = kda_decode_step(p, stream);
    DS_CUDA_OK(cudaStreamEndCapture(stream, &graph));
    ASSERT_TRUE(status.is_ok()) << status.to_string();
    DS_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int step = 0; step < c.steps; ++step) DS_CUDA_OK(cudaGraphLaunch(exec, stream));
    DS_CUDA_OK(cudaStreamSynchronize(stream));
    DS_CUDA_OK(cudaGraphExecDestroy(exec));
    DS_CUDA_OK(cudaGraphDestroy(graph));
  } else {
    for (int step = 0; step < c.steps; ++step) {
      const Status status = kda_decode_step(p, stream);
      ASSERT_TRUE(status.is_ok()) << status.to_string();
    }
    DS_CUDA_OK(cudaStreamSynchronize(stream));
  }
  DS_CUDA_OK(cudaStreamDestroy(stream));

  // CPU reference: the same inputs `steps` times.
  std::vector<float> out_ref(B * C, 0.0f);
  std::vector<float> conv_ref(conv_state), state_ref(state);
  for (int step = 0; step < c.steps; ++step) {
    for (int b = 0; b < B; ++b) {
      const int slot = c.slots[b];
      if (slot < 0) continue;
      std::vector<float> q(C), k(C), v(C), g(C), o(C);
      float* tails = conv_ref.data() + slot * tail_size;
      cpu::short_conv_silu(&q_in[b * C], q_w.data(), tails, q.data(), 1, C, K);
      cpu::short_conv_silu(&k_in[b * C], k_w.data(), tails + C * (K - 1), k.data(), 1, C, K);
      cpu::short_conv_silu(&v_in[b * C], v_w.data(), tails + 2 * C * (K - 1), v.data(), 1, C, K);
      cpu::l2_normalize_heads(q.data(), 1, H, kD, 1e-6f, 1.0f / std::sqrt(static_cast<float>(kD)));
      cpu::l2_normalize_heads(k.data(), 1, H, kD, 1e-6f, 1.0f);
      cpu::kda_gate(&gate_raw[b * C], a_log.data(), dt_bias.data(), g.data(), 1, H, kD, c.lower_bound);
      std::vector<float> beta(&beta_raw[b * H], &beta_raw[b * H] + H);
      cpu::sigmoid_inplace(beta.data(), H);
      const cpu::KdaInputs inputs{q.data(), k.data(), v.data(), g.data(), beta.data(), 1, H, kD, kD};
      cpu::kda_recurrent(inputs, state_ref.data() + slot * state_size, o.data());
      cpu::kda_gated_output_norm(o.data(), &out_gate[b * C], norm_w.data(), &out_ref[b * C], 1, H, kD, eps);
    }
  }

  const std::vector<float> out = to_float(out_d.download(), B * C);
  const std::vector<float> state_got = state_d.download(), conv_got = conv_d.download();
  const double out_error = relative_error(out.data(), out_ref.data(), out.size());
  const double state_error = relative_error(state_got.data(), state_ref.data(), state_got.size());
  const double conv_error = relative_error(conv_got.data(), conv_ref.data(), conv_got.size());
  std::printf("[ kda decode ] B=%d H=%d K=%d steps=%d graph=%d lb=%d: out %.2e, state %.2e, conv tails %.2e\n", B, H, K,
              c.steps, c.graph ? 1 : 0, c.lower_bound ? 1 : 0, out_error, state_error, conv_error);
  if (state_error > 1e-5 || out_error > 1e-2) {
    // First wrong (slot, head, key row, value column) and output element, to tell a misplaced item from bad math.
    for (size_t i = 0; i < state_got.size(); ++i) {
      const float want = state_ref[i], got = state_got[i];
      if (std::abs(got - want) > 1e-4f * (1.0f + std::abs(want))) {
        const size_t per_head = static_cast<size_t>(kD) * kD;
        ADD_FAILURE() << "first state mismatch at slot " << i / state_size << " head " << (i % state_size) / per_head
                      << " key row " << (i % per_head) / kD << " column " << i % kD << ": got " << got << ", want "
                      << want;
        break;
      }
    }
    for (size_t i = 0; i < out.size(); ++i) {
      if (std::abs(out[i] - out_ref[i]) > 2e-2f * (1.0f + std::abs(out_ref[i]))) {
        ADD_FAILURE() << "first output mismatch at row " << i / C << " head " << (i % C) / kD << " column " << i % kD
                      << ": got " << out[i] << ", want " << out_ref[i];
        break;
      }
    }
  }
  EXPECT_LE(out_error, 1e-2);
  EXPECT_LE(state_error, 1e-5);
  EXPECT_LE(conv_error, 1e-6);
  // Untouched slots bit-identical; skipped rows zero.
  for (int slot = 0; slot < c.num_slots; ++slot) {
    if (std::find(c.slots.begin(), c.slots.end(), slot) != c.slots.end()) continue;
    EXPECT_EQ(0, std::memcmp(state_got.data() + slot * state_size, state.data() + slot * state_size,
                             state_size * sizeof(float)))
        << "slot " << slot << " changed";
  }
  for (int b = 0; b < B; ++b) {
    if (c.slots[b] >= 0) continue;
    for (int64_t i = 0; i < C; ++i) ASSERT_EQ(out[b * C + i], 0.0f) << "skipped row " << b;
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

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
