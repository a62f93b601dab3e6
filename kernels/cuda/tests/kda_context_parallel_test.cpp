// Context-parallel prefill (kda.hpp "context parallel"), ctest label gpu: a sequence split into three segments,
// each reduced to (M, S0) by two prefills, composed with kda_compose_segment, then rerun with its incoming state,
// gives the unsplit result: o and final state vs the CPU recurrence over the whole sequence (relative <= 2e-2).
#include <cstdio>
#include <string>

#include "kernels/cpu/kda.hpp"
#include "kernels/cuda/kda/kda.hpp"
#include "kernels/cuda/tests/kda_test_util.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

constexpr int kD = 128;

struct Device {
  DeviceBuffer<__nv_bfloat16> q, k, v, zeros, o;
  DeviceBuffer<float> g, beta;
};

// Prefill of tokens [begin, end) of the single sequence; returns after the stream is synchronised.
void prefill_segment(const Device& d, int H, int begin, int end, const __nv_bfloat16* v, const float* initial,
                     float* final_state, __nv_bfloat16* o) {
  const size_t row = static_cast<size_t>(H) * kD;
  KdaPrefillParams p;
  p.num_heads = H;
  p.cu_seqlens = {0, end - begin};
  p.q = d.q.get() + begin * row;
  p.k = d.k.get() + begin * row;
  p.v = v + begin * row;
  p.g = d.g.get() + begin * row;
  p.beta = d.beta.get() + static_cast<size_t>(begin) * H;
  p.q_scale = 1.0f / std::sqrt(static_cast<float>(kD));
  p.initial_state = initial;
  p.final_state = final_state;
  p.o = o + begin * row;
  DeviceBuffer<uint8_t> workspace(kda_prefill_workspace_bytes(p.cu_seqlens, H));
  p.workspace = workspace.get();
  p.workspace_bytes = workspace.size();
  const Status status = kda_chunk_prefill(p, nullptr);
  ASSERT_TRUE(status.is_ok()) << status.to_string();
  DS_CUDA_OK(cudaDeviceSynchronize());
}

TEST(KdaContextParallelGpu, ThreeSegmentsComposeToTheUnsplitRun) {
  std::mt19937 rng(31);
  const int H = 2, T = 700;
  const std::vector<int> bounds = {0, 200, 456, 700};
  const size_t row = static_cast<size_t>(H) * kD, state_size = static_cast<size_t>(H) * kD * kD;
  std::vector<float> q = normal_vector(rng, T * row), k = normal_vector(rng, T * row), v = normal_vector(rng, T * row);
  cpu::l2_normalize_heads(q.data(), T, H, kD, 1e-6f, 1.0f);
  cpu::l2_normalize_heads(k.data(), T, H, kD, 1e-6f, 1.0f);
  for (auto* x : {&q, &k, &v}) {
    for (float& value : *x) value = bf16_round(value);
  }
  std::vector<float> g = normal_vector(rng, T * row, 0.0f, 2.0f), beta = normal_vector(rng, T * H);
  for (float& x : g) x = -5.0f / (1.0f + std::exp(-x));
  for (float& x : beta) x = 1.0f / (1.0f + std::exp(-x));
  const std::vector<float> initial = normal_vector(rng, state_size, 0.0f, 0.05f);

  // CPU reference over the whole sequence.
  std::vector<float> q_scaled(q);
  for (float& x : q_scaled) x /= std::sqrt(static_cast<float>(kD));
  std::vector<float> o_ref(T * row), final_ref(initial);
  const cpu::KdaInputs inputs{q_scaled.data(), k.data(), v.data(), g.data(), beta.data(), T, H, kD, kD};
  cpu::kda_recurrent(inputs, final_ref.data(), o_ref.data());

  Device d{DeviceBuffer<__nv_bfloat16>(T * row),
           DeviceBuffer<__nv_bfloat16>(T * row),
           DeviceBuffer<__nv_bfloat16>(T * row),
           DeviceBuffer<__nv_bfloat16>(T * row),
           DeviceBuffer<__nv_bfloat16>(T * row),
           DeviceBuffer<float>(T * row),
           DeviceBuffer<float>(T * H)};
  d.q.upload(to_bf16(q));
  d.k.upload(to_bf16(k));
  d.v.upload(to_bf16(v));
  d.zeros.upload(std::vector<__nv_bfloat16>(T * row, __float2bfloat16(0.0f)));
  d.o.upload(std::vector<__nv_bfloat16>(T * row, bf16_nan()));
  d.g.upload(g);
  d.beta.upload(beta);
  DeviceBuffer<__nv_bfloat16> scratch_o(T * row);

  // Per segment: S0 (zero start) and M (v = 0, identity start); the identity per head.
  std::vector<float> identity(state_size, 0.0f);
  for (int h = 0; h < H; ++h) {
    for (int i = 0; i < kD; ++i) identity[(static_cast<size_t>(h) * kD + i) * kD + i] = 1.0f;
  }
  DeviceBuffer<float> identity_d(state_size);
  identity_d.upload(identity);
  const int segments = static_cast<int>(bounds.size()) - 1;
  std::vector<DeviceBuffer<float>> m, s0, s_in;
  for (int s = 0; s < segments; ++s) {
    m.emplace_back(state_size);
    s0.emplace_back(state_size);
    prefill_segment(d, H, bounds[s], bounds[s + 1], d.v.get(), nullptr, s0.back().get(), scratch_o.get());
    prefill_segment(d, H, bounds[s], bounds[s + 1], d.zeros.get(), identity_d.get(), m.back().get(), scratch_o.get());
  }
  // Compose left to right: s_in[0] = initial, s_in[s + 1] = M_s s_in[s] + S0_s.
  s_in.emplace_back(state_size);
  s_in[0].upload(initial);
  for (int s = 0; s < segments; ++s) {
    s_in.emplace_back(state_size);
    ASSERT_TRUE(kda_compose_segment(m[s].get(), s_in[s].get(), s0[s].get(), s_in[s + 1].get(), H, nullptr).is_ok());
  }
  DS_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> composed_final = s_in[segments].download();
  // Second pass: each segment with its incoming state.
  DeviceBuffer<float> final_d(state_size);
  for (int s = 0; s < segments; ++s) {
    // Intermediate segments' final states are not needed (m[s] is reused as their sink).
    prefill_segment(d, H, bounds[s], bounds[s + 1], d.v.get(), s_in[s].get(),
                    s + 1 == segments ? final_d.get() : m[s].get(), d.o.get());
  }
  const std::vector<float> o = to_float(d.o.download(), T * row), final_state = final_d.download();
  const double o_error = relative_error(o.data(), o_ref.data(), o.size());
  const double composed_error = relative_error(composed_final.data(), final_ref.data(), state_size);
  const double final_error = relative_error(final_state.data(), final_ref.data(), state_size);
  std::printf("[ kda context parallel ] T=%d in 3 segments, H=%d: o %.2e, composed final %.2e, final %.2e\n", T, H,
              o_error, composed_error, final_error);
  EXPECT_LE(o_error, 2e-2);
  EXPECT_LE(composed_error, 2e-2);
  EXPECT_LE(final_error, 2e-2);
}

TEST(KdaContextParallelGpu, ComposeValidatesArguments) {
  DeviceBuffer<float> a(kD * kD), b(kD * kD);
  EXPECT_EQ(kda_compose_segment(a.get(), b.get(), a.get(), nullptr, 1, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(kda_compose_segment(a.get(), b.get(), a.get(), b.get(), 1, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(kda_compose_segment(a.get(), b.get(), a.get(), a.get(), 0, nullptr).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
