// GPU chunked prefill vs the CPU recurrence (kernels/cpu/kda.hpp), on random inputs (ctest label gpu).
// Inputs are rounded to bf16 first and the CPU runs on the rounded values, so the error measured is the
// kernel's own (bf16 operands of the tensor-core products, fp32 state). Tolerances: relative L2 error of
// o, final states and checkpoints <= 2e-2 (bf16-operand products: errors of 1e-3..1e-2 expected).
#include <cstdio>
#include <optional>
#include <string>

#include "kernels/cpu/kda.hpp"
#include "kernels/cuda/kda/kda.hpp"
#include "kernels/cuda/tests/kda_test_util.hpp"
#include "kernels/cuda/tests/ops_test_util.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

constexpr int kD = 128;
constexpr double kTolerance = 2e-2;
constexpr int kPadRows = 80;  // NaN rows after the last token of every token-major input and output

enum class Gate { kBounded, kUnbounded, kRawBounded, kRawSoftplus };

struct PrefillCase {
  std::vector<int32_t> lengths;
  int heads = 2;
  Gate gate = Gate::kBounded;
  int checkpoint_interval = 0;
  bool initial_state = true;
  bool final_aliases_initial = false;
  uint32_t seed = 1;
};

void run_prefill_case(const PrefillCase& c) {
  std::mt19937 rng(c.seed);
  const int H = c.heads;
  std::vector<int32_t> cu{0};
  for (int32_t length : c.lengths) cu.push_back(cu.back() + length);
  const int64_t T = cu.back();
  const int64_t N = static_cast<int64_t>(c.lengths.size());
  const size_t row = static_cast<size_t>(H) * kD;
  const size_t state_size = static_cast<size_t>(H) * kD * kD;

  // Inputs (fp32 reference values, already bf16-representable where the GPU takes bf16).
  std::vector<float> q = normal_vector(rng, T * row), k = normal_vector(rng, T * row);
  std::vector<float> v = normal_vector(rng, T * row);
  cpu::l2_normalize_heads(q.data(), T, H, kD, 1e-6f, 1.0f);
  cpu::l2_normalize_heads(k.data(), T, H, kD, 1e-6f, 1.0f);
  for (float& x : q) x = bf16_round(x);
  for (float& x : k) x = bf16_round(x);
  for (float& x : v) x = bf16_round(x);
  std::vector<float> g_in(T * row), g(T * row);
  std::vector<float> a_log = normal_vector(rng, H, 0.0f, 0.5f), dt_bias = normal_vector(rng, row, 0.0f, 0.5f);
  std::optional<float> lower_bound;
  switch (c.gate) {
    case Gate::kBounded: {
      std::vector<float> raw = normal_vector(rng, T * row, 0.0f, 2.0f);
      for (size_t i = 0; i < raw.size(); ++i) g[i] = g_in[i] = -5.0f / (1.0f + std::exp(-raw[i]));
      break;
    }
    case Gate::kUnbounded: {  // many steps below -5: the exact diagonal path
      std::vector<float> raw = normal_vector(rng, T * row, 1.0f, 1.5f);
      for (size_t i = 0; i < raw.size(); ++i) g[i] = g_in[i] = -std::exp(raw[i]);
      break;
    }
    case Gate::kRawBounded:
    case Gate::kRawSoftplus: {
      g_in = normal_vector(rng, T * row, 0.0f, 2.0f);
      if (c.gate == Gate::kRawBounded) lower_bound = -5.0f;
      cpu::kda_gate(g_in.data(), a_log.data(), dt_bias.data(), g.data(), T, H, kD, lower_bound);
      break;
    }
  }
  std::vector<float> beta = normal_vector(rng, T * H);
  for (float& b : beta) b = 1.0f / (1.0f + std::exp(-b));
  std::vector<float> initial(N * state_size, 0.0f);
  if (c.initial_state) initial = normal_vector(rng, N * state_size, 0.0f, 0.05f);

  // CPU reference per sequence; checkpoints by running the pieces between them.
  const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
  std::vector<float> q_scaled(q);
  for (float& x : q_scaled) x *= scale;
  std::vector<float> o_ref(T * row), final_ref(initial), checkpoints_ref;
  for (int64_t s = 0; s < N; ++s) {
    float* state = final_ref.data() + s * state_size;
    const int64_t begin = cu[s], length = cu[s + 1] - cu[s];
    const int64_t piece = c.checkpoint_interval > 0 ? c.checkpoint_interval : std::max<int64_t>(length, 1);
    for (int64_t first = 0; first < length; first += piece) {
      const int64_t n = std::min(piece, length - first);
      const size_t offset = static_cast<size_t>(begin + first) * row;
      const cpu::KdaInputs inputs{&q_scaled[offset],
                                  &k[offset],
                                  &v[offset],
                                  &g[offset],
                                  &beta[static_cast<size_t>(begin + first) * H],
                                  n,
                                  H,
                                  kD,
                                  kD};
      cpu::kda_recurrent(inputs, state, &o_ref[offset]);
      if (c.checkpoint_interval > 0 && n == piece)
        checkpoints_ref.insert(checkpoints_ref.end(), state, state + state_size);
    }
  }

  // Device buffers: token-major inputs and o padded with NaN rows.
  const size_t padded = static_cast<size_t>(T + kPadRows) * row;
  auto padded_bf16 = [&](const std::vector<float>& x) {
    std::vector<__nv_bfloat16> out(padded, bf16_nan());
    for (size_t i = 0; i < x.size(); ++i) out[i] = __float2bfloat16(x[i]);
    return out;
  };
  auto padded_float = [&](const std::vector<float>& x, size_t n) {
    std::vector<float> out(n, NAN);
    std::copy(x.begin(), x.end(), out.begin());
    return out;
  };
  DeviceBuffer<__nv_bfloat16> q_d(padded), k_d(padded), v_d(padded), o_d(padded);
  DeviceBuffer<float> g_d(padded), beta_d(static_cast<size_t>(T + kPadRows) * H), a_log_d(H), dt_bias_d(row);
  q_d.upload(padded_bf16(q));
  k_d.upload(padded_bf16(k));
  v_d.upload(padded_bf16(v));
  g_d.upload(padded_float(g_in, padded));
  beta_d.upload(padded_float(beta, beta_d.size()));
  a_log_d.upload(a_log);
  dt_bias_d.upload(dt_bias);
  DeviceBuffer<float> initial_d(N * state_size), final_d(N * state_size);
  const int64_t checkpoints = kda_prefill_checkpoint_count(cu, c.checkpoint_interval);
  ASSERT_EQ(static_cast<size_t>(checkpoints) * state_size, checkpoints_ref.size());
  DeviceBuffer<float> checkpoints_d(std::max<int64_t>(checkpoints, 1) * state_size);
  const size_t workspace_bytes = kda_prefill_workspace_bytes(cu, H);
  ASSERT_GT(workspace_bytes, 0u);
  DeviceBuffer<uint8_t> workspace(workspace_bytes);

  // Every state pass (a CTA a value slice, a CTA a head, a CTA a head beside the prep) against the same reference,
  // each on fresh outputs, on a stream of its own (the overlapped pass launches the prep as a programmatic
  // dependent of the state pass; where its CTAs would not all fit beside the prep it runs the kAuto choice).
  // The overlapped pass runs twice: as it is, and with no wait for the prep's first chunk, so that a CTA whose first
  // chunk is not flagged at its first look (nearly all of them) leaves its work to the second launch after the prep
  // (the path for serialised kernels).
  const Stream stream;
  struct PassCase {
    KdaStatePass pass;
    int overlap_wait_us;
    const char* name;
  };
  const int default_wait_us = KdaPrefillParams{}.overlap_wait_us;
  for (const PassCase& pass_case : {PassCase{KdaStatePass::kPerSlice, default_wait_us, "per slice"},
                                    PassCase{KdaStatePass::kPerHead, default_wait_us, "per head"},
                                    PassCase{KdaStatePass::kPerHeadOverlapped, default_wait_us, "overlapped"},
                                    PassCase{KdaStatePass::kPerHeadOverlapped, 0, "overlapped, no wait (rerun)"}}) {
    const KdaStatePass pass = pass_case.pass;
    const char* pass_name = pass_case.name;
    SCOPED_TRACE(std::string("state pass ") + pass_name);
    o_d.upload(std::vector<__nv_bfloat16>(padded, bf16_nan()));
    initial_d.upload(initial);
    final_d.upload(std::vector<float>(N * state_size, NAN));
    checkpoints_d.upload(std::vector<float>(checkpoints_d.size(), NAN));

    KdaPrefillParams p;
    p.state_pass = pass;
    p.overlap_wait_us = pass_case.overlap_wait_us;
    p.num_heads = H;
    p.cu_seqlens = cu;
    p.q = q_d.get();
    p.k = k_d.get();
    p.v = v_d.get();
    p.g = g_d.get();
    p.beta = beta_d.get();
    p.q_scale = scale;
    p.gate_raw = c.gate == Gate::kRawBounded || c.gate == Gate::kRawSoftplus;
    if (p.gate_raw) {
      p.a_log = a_log_d.get();
      p.dt_bias = dt_bias_d.get();
      p.lower_bound = lower_bound;
    }
    p.initial_state = c.initial_state ? initial_d.get() : nullptr;
    p.final_state = c.final_aliases_initial ? initial_d.get() : final_d.get();
    p.checkpoint_interval = c.checkpoint_interval;
    p.checkpoint_states = checkpoints > 0 ? checkpoints_d.get() : nullptr;
    p.o = o_d.get();
    p.workspace = workspace.get();
    p.workspace_bytes = workspace_bytes;
    const Status status = kda_chunk_prefill(p, stream.get());
    ASSERT_TRUE(status.is_ok()) << status.to_string();
    DS_CUDA_OK(cudaDeviceSynchronize());

    const std::vector<__nv_bfloat16> o_all = o_d.download();
    const std::vector<float> o = to_float(o_all, static_cast<size_t>(T) * row);
    for (size_t i = static_cast<size_t>(T) * row; i < padded; ++i) {
      const __nv_bfloat16_raw raw(o_all[i]);
      ASSERT_EQ(raw.x, 0x7fc1) << "o written past the last token at element " << i;
    }
    const double o_error = T > 0 ? relative_error(o.data(), o_ref.data(), o.size()) : 0.0;
    const std::vector<float> final_state = c.final_aliases_initial ? initial_d.download() : final_d.download();
    const double state_error = relative_error(final_state.data(), final_ref.data(), final_state.size());
    double checkpoint_error = 0.0;
    if (checkpoints > 0) {
      const std::vector<float> got = checkpoints_d.download();
      checkpoint_error = relative_error(got.data(), checkpoints_ref.data(), checkpoints_ref.size());
    }
    std::printf(
        "[ kda prefill ] T=%lld N=%lld H=%d gate=%d ckpt=%d pass=%s: o %.2e, final state %.2e, checkpoints %.2e\n",
        static_cast<long long>(T), static_cast<long long>(N), H, static_cast<int>(c.gate), c.checkpoint_interval,
        pass_name, o_error, state_error, checkpoint_error);
    EXPECT_LE(o_error, kTolerance);
    EXPECT_LE(state_error, kTolerance);
    EXPECT_LE(checkpoint_error, kTolerance);
  }
}

TEST(KdaChunkPrefillGpu, SingleToken) {
  run_prefill_case({.lengths = {1}, .heads = 2, .seed = 11});
}

TEST(KdaChunkPrefillGpu, OddLengthsAroundTheChunk) {
  for (int32_t length : {15, 16, 17, 63, 64, 65, 127, 200, 333}) {
    SCOPED_TRACE("length " + std::to_string(length));
    run_prefill_case({.lengths = {length}, .heads = 3, .seed = static_cast<uint32_t>(length)});
  }
}

TEST(KdaChunkPrefillGpu, VarlenBatchWithZeroLengthSequences) {
  run_prefill_case({.lengths = {0, 1, 17, 64, 130, 0, 515, 1100, 0}, .heads = 3, .seed = 5});
}

TEST(KdaChunkPrefillGpu, NoInitialState) {
  run_prefill_case({.lengths = {70, 260}, .heads = 2, .initial_state = false, .seed = 6});
}

TEST(KdaChunkPrefillGpu, FinalStateAliasesInitialState) {
  run_prefill_case({.lengths = {190, 0, 77}, .heads = 2, .final_aliases_initial = true, .seed = 7});
}

TEST(KdaChunkPrefillGpu, CheckpointsEvery512Tokens) {
  run_prefill_case({.lengths = {1536, 511, 0, 1030}, .heads = 2, .checkpoint_interval = 512, .seed = 8});
}

TEST(KdaChunkPrefillGpu, CheckpointsEvery128Tokens) {
  run_prefill_case({.lengths = {300, 128, 64}, .heads = 1, .checkpoint_interval = 128, .seed = 9});
}

TEST(KdaChunkPrefillGpu, UnboundedGateTakesTheExactDiagonalPath) {
  run_prefill_case({.lengths = {333, 64, 5}, .heads = 2, .gate = Gate::kUnbounded, .seed = 10});
}

TEST(KdaChunkPrefillGpu, FusedBoundedGate) {
  run_prefill_case({.lengths = {257, 31}, .heads = 2, .gate = Gate::kRawBounded, .seed = 12});
}

TEST(KdaChunkPrefillGpu, FusedSoftplusGate) {
  run_prefill_case({.lengths = {257, 31}, .heads = 2, .gate = Gate::kRawSoftplus, .seed = 13});
}

TEST(KdaChunkPrefillGpu, LongSequenceManyHeads) {
  run_prefill_case({.lengths = {4096}, .heads = 4, .checkpoint_interval = 512, .seed = 14});
}

TEST(KdaChunkPrefillGpu, ValidationRejectsBadInputs) {
  DeviceBuffer<__nv_bfloat16> x(64 * kD);
  DeviceBuffer<float> f(64 * kD);
  DeviceBuffer<uint8_t> workspace(kda_prefill_workspace_bytes({0, 64}, 1));
  KdaPrefillParams p;
  p.num_heads = 1;
  p.cu_seqlens = {0, 64};
  p.q = p.k = p.v = x.get();
  p.o = x.get();
  p.g = p.beta = f.get();
  p.workspace = workspace.get();
  p.workspace_bytes = workspace.size();
  {
    KdaPrefillParams bad = p;
    bad.head_dim = 64;
    EXPECT_EQ(kda_chunk_prefill(bad, nullptr).code(), StatusCode::kUnimplemented);
  }
  {
    KdaPrefillParams bad = p;
    bad.cu_seqlens = {0, 64, 10};
    EXPECT_EQ(kda_chunk_prefill(bad, nullptr).code(), StatusCode::kInvalidArgument);
  }
  {
    KdaPrefillParams bad = p;
    bad.cu_seqlens = {1, 64};
    EXPECT_EQ(kda_chunk_prefill(bad, nullptr).code(), StatusCode::kInvalidArgument);
  }
  {
    KdaPrefillParams bad = p;
    bad.v = nullptr;
    const Status status = kda_chunk_prefill(bad, nullptr);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find("v is null"), std::string::npos) << status.message();
  }
  {
    KdaPrefillParams bad = p;
    bad.workspace_bytes = 100;
    EXPECT_EQ(kda_chunk_prefill(bad, nullptr).code(), StatusCode::kInvalidArgument);
  }
  {
    KdaPrefillParams bad = p;
    bad.checkpoint_interval = 100;
    EXPECT_EQ(kda_chunk_prefill(bad, nullptr).code(), StatusCode::kInvalidArgument);
  }
  {
    KdaPrefillParams bad = p;
    bad.overlap_wait_us = -1;
    const Status status = kda_chunk_prefill(bad, nullptr);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find("overlap_wait_us"), std::string::npos) << status.message();
  }
  {
    KdaPrefillParams bad = p;
    bad.checkpoint_interval = 64;  // one checkpoint owed, no buffer
    EXPECT_EQ(kda_chunk_prefill(bad, nullptr).code(), StatusCode::kInvalidArgument);
  }
  {
    KdaPrefillParams bad = p;
    std::vector<float> host(16);
    bad.g = host.data();  // host memory
    EXPECT_EQ(kda_chunk_prefill(bad, nullptr).code(), StatusCode::kInvalidArgument);
  }
  {
    KdaPrefillParams bad = p;
    bad.q = x.get() + 1;  // misaligned
    EXPECT_EQ(kda_chunk_prefill(bad, nullptr).code(), StatusCode::kInvalidArgument);
  }
  {
    KdaPrefillParams bad = p;
    bad.lower_bound = -5.0f;  // only with the fused gate
    EXPECT_EQ(kda_chunk_prefill(bad, nullptr).code(), StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE(kda_chunk_prefill(p, nullptr).is_ok());
  DS_CUDA_OK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
