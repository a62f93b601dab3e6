// Speculative verify/commit (kernels/cuda/kda/spec_decode.cu) vs the CPU decode chain, ctest label gpu:
// verify's outputs equal k decode steps and leave state and conv tails bit-identical; commit leaves the state and
// tails equal to running only the accepted tokens (state <= 1e-5 relative, tails <= 1e-6, outputs <= 1e-2).
#include <cstdio>
#include <optional>
#include <string>

#include "kernels/cuda/kda/kda.hpp"
#include "kernels/cuda/tests/gpu_test_graph.hpp"
#include "kernels/cuda/tests/kda_decode_test_util.hpp"
#include "kernels/cuda/tests/kda_test_util.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

constexpr int kD = 128;

struct SpecCase {
  int heads = 4;
  int conv_kernel = 4;
  int num_slots = 10;
  int draft = 4;
  std::vector<int32_t> slots = {3, 7, -1, 0, 9};
  std::vector<int32_t> accepted = {4, 0, 2, 1, 3};
  bool graph = false;
  uint32_t seed = 1;
};

void run_spec_case(const SpecCase& c) {
  std::mt19937 rng(c.seed);
  const int H = c.heads, K = c.conv_kernel, B = static_cast<int>(c.slots.size()), k = c.draft;
  const int64_t C = static_cast<int64_t>(H) * kD;
  const size_t state_size = static_cast<size_t>(H) * kD * kD, tail_size = static_cast<size_t>(3 * C * (K - 1));
  const size_t tokens = static_cast<size_t>(B) * k;
  const KdaDecodeInputs in(rng, tokens, H);
  const KdaDecodeWeights w(rng, H, K);
  // bf16 values: the device keeps the tails in bf16 (exact for the bf16 inputs they hold).
  const size_t tail_values = std::max<size_t>(c.num_slots * tail_size, 1);
  std::vector<float> conv_state = to_float(to_bf16(normal_vector(rng, tail_values)), tail_values);
  std::vector<float> state = normal_vector(rng, c.num_slots * state_size, 0.0f, 0.05f);
  const float eps = 1e-5f;
  const std::optional<float> lower_bound = -5.0f;

  DeviceBuffer<__nv_bfloat16> out_d(tokens * C);
  out_d.upload(std::vector<__nv_bfloat16>(tokens * C, bf16_nan()));
  DeviceBuffer<__nv_bfloat16> conv_d(conv_state.size());
  DeviceBuffer<float> state_d(state.size());
  DeviceBuffer<float> saved_d(tokens * H * 3 * kD), saved_beta_d(tokens * H);
  DeviceBuffer<int32_t> slots_d(B), accepted_d(B);
  conv_d.upload(to_bf16(conv_state));
  state_d.upload(state);
  slots_d.upload(c.slots);
  accepted_d.upload(c.accepted);

  KdaDecodeParams p = kda_decode_params(B, H, K, c.num_slots, slots_d.get(), in, w, lower_bound, eps);
  p.conv_state = conv_d.get();
  p.state = state_d.get();
  p.out = out_d.get();
  const KdaSpecBuffers buffers{k, saved_d.get(), saved_beta_d.get()};

  // Verify, then check state and tails untouched.
  ASSERT_TRUE(kda_spec_verify(p, k, buffers, nullptr).is_ok());
  DS_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> out = to_float(out_d.download(), tokens * C);
  EXPECT_EQ(state_d.download(), state) << "verify changed the state";
  EXPECT_EQ(to_float(conv_d.download(), conv_state.size()), conv_state) << "verify changed the conv tails";

  // Commit (eager, or captured in a graph).
  cudaStream_t stream;
  DS_CUDA_OK(cudaStreamCreate(&stream));
  if (c.graph) {
    ASSERT_NO_FATAL_FAILURE(replay_captured(stream, cudaStreamCaptureModeGlobal, 1, [&](cudaStream_t s) {
      return kda_spec_commit(p, k, accepted_d.get(), buffers, s);
    }));
  } else {
    const Status status = kda_spec_commit(p, k, accepted_d.get(), buffers, stream);
    ASSERT_TRUE(status.is_ok()) << status.to_string();
    DS_CUDA_OK(cudaStreamSynchronize(stream));
  }
  DS_CUDA_OK(cudaStreamDestroy(stream));
  const std::vector<float> state_got = state_d.download(), conv_got = to_float(conv_d.download(), conv_state.size());

  // CPU: every row runs its k tokens (outputs) from a copy; the committed result runs only the accepted ones.
  std::vector<float> out_ref(tokens * C, 0.0f), state_ref(state), conv_ref(conv_state);
  for (int b = 0; b < B; ++b) {
    const int slot = c.slots[b];
    if (slot < 0) continue;
    std::vector<float> run_state(state.begin() + slot * state_size, state.begin() + (slot + 1) * state_size);
    std::vector<float> run_tails(conv_state.begin() + slot * tail_size, conv_state.begin() + (slot + 1) * tail_size);
    for (int j = 0; j < k; ++j) {
      const size_t token = static_cast<size_t>(b) * k + j;
      cpu_decode_token(in, w, token, H, K, lower_bound, eps, run_tails.data(), run_state.data(), &out_ref[token * C]);
      if (j + 1 == std::min(std::max(c.accepted[b], 0), k)) {
        std::copy(run_state.begin(), run_state.end(), state_ref.begin() + slot * state_size);
        std::copy(run_tails.begin(), run_tails.end(), conv_ref.begin() + slot * tail_size);
      }
    }
  }
  const double out_error = relative_error(out.data(), out_ref.data(), out.size());
  const double state_error = relative_error(state_got.data(), state_ref.data(), state_got.size());
  const double conv_error = relative_error(conv_got.data(), conv_ref.data(), conv_got.size());
  std::printf("[ kda spec ] B=%d H=%d K=%d draft=%d graph=%d: verify out %.2e, committed state %.2e, tails %.2e\n", B,
              H, K, k, c.graph ? 1 : 0, out_error, state_error, conv_error);
  EXPECT_LE(out_error, 1e-2);
  EXPECT_LE(state_error, 1e-5);
  EXPECT_LE(conv_error, 1e-6);
  // Rows with nothing accepted and slots outside the batch keep their state bit for bit.
  for (int slot = 0; slot < c.num_slots; ++slot) {
    bool advanced = false;
    for (int b = 0; b < B; ++b) advanced = advanced || (c.slots[b] == slot && c.accepted[b] > 0);
    if (advanced) continue;
    EXPECT_EQ(0, std::memcmp(state_got.data() + slot * state_size, state.data() + slot * state_size,
                             state_size * sizeof(float)))
        << "slot " << slot;
  }
}

TEST(KdaSpecDecodeGpu, VerifyThenCommitEqualsAcceptedTokensOnly) {
  run_spec_case({.seed = 21});
}

TEST(KdaSpecDecodeGpu, CommitInCudaGraph) {
  run_spec_case({.draft = 3, .accepted = {3, 1, 0, 2, 5}, .graph = true, .seed = 22});
}

TEST(KdaSpecDecodeGpu, ThirtyTwoHeadsEightDrafts) {
  run_spec_case({.heads = 32, .num_slots = 4, .draft = 8, .slots = {2, 0}, .accepted = {8, 5}, .seed = 23});
}

TEST(KdaSpecDecodeGpu, ValidationRejectsBadDraftCounts) {
  KdaDecodeParams p;
  p.batch = 0;
  p.num_heads = 1;
  p.num_slots = 1;
  const KdaSpecBuffers buffers{4, nullptr, nullptr};
  EXPECT_EQ(kda_spec_verify(p, 0, buffers, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(kda_spec_verify(p, 17, buffers, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(kda_spec_verify(p, 5, buffers, nullptr).code(), StatusCode::kInvalidArgument);  // > max_draft_tokens
  EXPECT_TRUE(kda_spec_verify(p, 4, buffers, nullptr).is_ok());                             // empty batch
  p.batch = 1;
  EXPECT_EQ(kda_spec_commit(p, 4, nullptr, buffers, nullptr).code(), StatusCode::kInvalidArgument);  // nulls
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
