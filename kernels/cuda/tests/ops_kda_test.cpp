// GPU KDA layer pieces (kda_prep / kda_prep_f32, kda_gate, kda_gated_output_norm) vs the CPU chain
// (cpu::short_conv_silu + cpu::l2_normalize_heads, cpu::kda_gate, cpu::kda_gated_output_norm), ctest label gpu.
// Inputs are bf16-representable. Tolerances: fp32 outputs |err| <= 1e-5 + 1e-5 |ref|; bf16 outputs vs the
// bf16-rounded reference |err| <= 1e-6 + 8e-3 |ref|; conv tails are copies of inputs, compared bit for bit.
// Varlen batches include zero-length sequences and a skipped one (slot -1) whose NaN-poisoned output rows and
// pool tails must stay untouched; slots not in the batch stay bit-identical.
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/basic_ops.hpp"
#include "kernels/cpu/kda.hpp"
#include "kernels/cuda/ops/ops.hpp"
#include "kernels/cuda/tests/ops_test_util.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

constexpr double kF32Atol = 1e-5, kF32Rtol = 1e-5;
constexpr double kBf16Atol = 1e-6, kBf16Rtol = 8e-3;

std::vector<int32_t> prefix_sums(const std::vector<int>& lengths) {
  std::vector<int32_t> cu = {0};
  for (int length : lengths) cu.push_back(cu.back() + length);
  return cu;
}

struct PrepCase {
  int heads = 2, head_dim = 32, conv_kernel = 4;
  std::vector<int> lengths = {0, 1, 2, 3, 7, 64, 130, 5};
  std::vector<int32_t> slots = {2, 7, 0, 4, -1, 5, 1, 8};  // sequence 4 skipped
  int num_slots = 9;
  uint32_t seed = 1;
  int in_stride_pad = 8;          // in_stride = 3C + pad (an odd pad makes rows unaligned: reference kernel)
  bool reference_kernel = false;  // KdaPrepParams::reference_kernel
};

// Everything the prep reads, on the host (fp32 copies of the bf16 inputs) and on the device.
struct PrepData {
  int64_t C = 0, T = 0, in_stride = 0, tail_size = 0;
  std::vector<float> in;  // [T, in_stride]: q at column 0, k at C, v at 2C (a fused projection)
  std::vector<float> weights[3];
  std::vector<float> conv_state;  // [num_slots, 3, C, K-1], bf16 values (bf16 on the device)
  std::unique_ptr<DeviceBuffer<__nv_bfloat16>> in_d;
  std::unique_ptr<DeviceBuffer<float>> weights_d[3];
};

void upload_data(PrepData& data) {
  data.in_d = std::make_unique<DeviceBuffer<__nv_bfloat16>>(data.in.size());
  data.in_d->upload(to_bf16(data.in));
  for (int i = 0; i < 3; ++i) {
    data.weights_d[i] = std::make_unique<DeviceBuffer<float>>(std::max<size_t>(data.weights[i].size(), 1));
    data.weights_d[i]->upload(data.weights[i]);
  }
}

void make_data(const PrepCase& c, PrepData& data, std::mt19937& rng) {
  data.C = static_cast<int64_t>(c.heads) * c.head_dim;
  data.T = prefix_sums(c.lengths).back();
  data.in_stride = 3 * data.C + c.in_stride_pad;
  data.tail_size = 3 * data.C * (c.conv_kernel - 1);
  data.in = normal_vector(rng, data.T * data.in_stride);
  for (float& x : data.in) x = bf16_round(x);
  for (auto& w : data.weights) w = normal_vector(rng, data.C * c.conv_kernel, 0.0f, 0.5f);
  data.conv_state = normal_vector(rng, c.num_slots * data.tail_size);
  for (float& x : data.conv_state) x = bf16_round(x);  // the device keeps bf16 tails (exact for bf16 inputs)
  upload_data(data);
}

// CPU reference of the prep over a varlen batch: q, k, v [T, C] (rows of skipped sequences NaN) and the tails.
void reference_prep(const PrepCase& c, const PrepData& data, const std::vector<int32_t>& cu, float q_scale,
                    std::vector<float> out[3], std::vector<float>& conv_state) {
  const int64_t C = data.C;
  const int K = c.conv_kernel;
  for (int i = 0; i < 3; ++i) out[i] = nan_vector(data.T * C);
  for (size_t n = 0; n + 1 < cu.size(); ++n) {
    const int32_t slot = c.slots[n];
    const int64_t length = cu[n + 1] - cu[n];
    if (slot < 0) continue;
    for (int i = 0; i < 3; ++i) {
      std::vector<float> x(length * C), y(length * C);
      for (int64_t t = 0; t < length; ++t) {
        for (int64_t ch = 0; ch < C; ++ch) x[t * C + ch] = data.in[(cu[n] + t) * data.in_stride + i * C + ch];
      }
      float* tail = conv_state.data() + slot * data.tail_size + i * C * (K - 1);
      cpu::short_conv_silu(x.data(), data.weights[i].data(), tail, y.data(), length, C, K);
      if (i < 2) cpu::l2_normalize_heads(y.data(), length, c.heads, c.head_dim, 1e-6f, i == 0 ? q_scale : 1.0f);
      std::copy(y.begin(), y.end(), out[i].begin() + cu[n] * C);
    }
  }
}

// Runs kda_prep_f32 and kda_prep (bf16) over the batch `cu` (a sub-range of the data's tokens starting at row
// `first_token`) on the given pool state; returns the fp32 outputs, the bf16 outputs as float and the pool.
struct PrepResult {
  std::vector<float> f32[3], bf16[3], conv_state;
};

PrepResult run_prep(const PrepCase& c, const PrepData& data, const std::vector<int32_t>& cu,
                    const std::vector<int32_t>& slots, int64_t first_token, const std::vector<float>& conv_state,
                    float q_scale, bool bf16_too) {
  const int64_t C = data.C, T = cu.back();
  DeviceBuffer<int32_t> cu_d(cu.size()), slots_d(slots.size());
  cu_d.upload(cu);
  slots_d.upload(slots);
  DeviceBuffer<__nv_bfloat16> conv_d(std::max<size_t>(conv_state.size(), 1));
  conv_d.upload(to_bf16(conv_state));
  DeviceBuffer<float> out_f32[3] = {DeviceBuffer<float>(T * C + 1), DeviceBuffer<float>(T * C + 1),
                                    DeviceBuffer<float>(T * C + 1)};
  DeviceBuffer<__nv_bfloat16> out_bf16[3] = {DeviceBuffer<__nv_bfloat16>(T * C + 1),
                                             DeviceBuffer<__nv_bfloat16>(T * C + 1),
                                             DeviceBuffer<__nv_bfloat16>(T * C + 1)};
  for (int i = 0; i < 3; ++i) {
    out_f32[i].upload(nan_vector(T * C + 1));
    out_bf16[i].upload(std::vector<__nv_bfloat16>(T * C + 1, bf16_nan()));
  }
  KdaPrepParams p;
  p.num_seqs = static_cast<int>(slots.size());
  p.num_tokens = T;
  p.cu_seqlens = cu_d.get();
  p.slots = slots_d.get();
  p.num_heads = c.heads;
  p.head_dim = c.head_dim;
  p.conv_kernel = c.conv_kernel;
  const __nv_bfloat16* base = data.in_d->get() + first_token * data.in_stride;
  p.q_in = base;
  p.k_in = base + C;
  p.v_in = base + 2 * C;
  p.in_stride = data.in_stride;
  p.q_conv_weight = data.weights_d[0]->get();
  p.k_conv_weight = data.weights_d[1]->get();
  p.v_conv_weight = data.weights_d[2]->get();
  p.conv_state = c.conv_kernel > 1 ? conv_d.get() : nullptr;
  p.num_slots = c.num_slots;
  p.q_scale = q_scale;
  p.reference_kernel = c.reference_kernel;
  p.q = out_bf16[0].get();
  p.k = out_bf16[1].get();
  p.v = out_bf16[2].get();
  Stream stream;
  PrepResult result;
  // The f32 run reads the tails first; the bf16 run (when asked) repeats the step from the same tails.
  const Status status = kda_prep_f32(p, {out_f32[0].get(), out_f32[1].get(), out_f32[2].get()}, stream.get());
  EXPECT_TRUE(status.is_ok()) << status.to_string();
  stream.sync();
  result.conv_state = to_float(conv_d.download(), conv_state.size());
  if (bf16_too) {
    conv_d.upload(to_bf16(conv_state));
    const Status status16 = kda_prep(p, stream.get());
    EXPECT_TRUE(status16.is_ok()) << status16.to_string();
    stream.sync();
    const std::vector<float> again = to_float(conv_d.download(), conv_state.size());
    EXPECT_TRUE(bit_equal(again.data(), result.conv_state.data(), again.size(), "bf16 run's tails"));
  }
  for (int i = 0; i < 3; ++i) {
    result.f32[i] = out_f32[i].download();
    result.bf16[i] = to_float(out_bf16[i].download(), T * C + 1);
    EXPECT_TRUE(std::isnan(result.f32[i][T * C])) << "f32 output " << i << " written past T";
    if (bf16_too) {
      EXPECT_TRUE(std::isnan(result.bf16[i][T * C])) << "bf16 output " << i << " written past T";
    }
    result.f32[i].resize(T * C);
    result.bf16[i].resize(T * C);
  }
  return result;
}

void run_prep_case(const PrepCase& c) {
  SCOPED_TRACE("H " + std::to_string(c.heads) + " d " + std::to_string(c.head_dim) + " K " +
               std::to_string(c.conv_kernel) + " pad " + std::to_string(c.in_stride_pad) +
               (c.reference_kernel ? " reference kernel" : ""));
  std::mt19937 rng(c.seed);
  PrepData data;
  make_data(c, data, rng);
  const std::vector<int32_t> cu = prefix_sums(c.lengths);
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  std::vector<float> ref[3];
  std::vector<float> ref_state = data.conv_state;
  reference_prep(c, data, cu, q_scale, ref, ref_state);

  const PrepResult got = run_prep(c, data, cu, c.slots, 0, data.conv_state, q_scale, true);
  const char* names[3] = {"q", "k", "v"};
  for (int i = 0; i < 3; ++i) {
    // NaN rows of the reference are the skipped sequence: the poison must be left there (all_close matches NaNs).
    EXPECT_TRUE(all_close(got.f32[i], ref[i], kF32Atol, kF32Rtol, std::string(names[i]) + " fp32"));
    std::vector<float> ref16(ref[i].size());
    for (size_t j = 0; j < ref16.size(); ++j) ref16[j] = std::isnan(ref[i][j]) ? NAN : bf16_round(ref[i][j]);
    EXPECT_TRUE(all_close(got.bf16[i], ref16, kBf16Atol, kBf16Rtol, std::string(names[i]) + " bf16"));
  }
  // Tails: copies of inputs, so bit-identical; skipped and unused slots unchanged (the reference leaves them).
  EXPECT_TRUE(bit_equal(got.conv_state.data(), ref_state.data(), ref_state.size(), "conv tails"));

  // Splitting every sequence into two calls (tails carried in the pool) equals one call, bit for bit.
  std::vector<int> first_lengths, second_lengths;
  for (int length : c.lengths) {
    first_lengths.push_back(length / 3);
    second_lengths.push_back(length - length / 3);
  }
  // Both calls read token rows from one packed buffer: sequence n's first part, then its second part, so the
  // parts are gathered into a re-ordered input copy.
  PrepData split;
  split.C = data.C;
  split.T = data.T;
  split.in_stride = data.in_stride;
  split.tail_size = data.tail_size;
  for (int i = 0; i < 3; ++i) split.weights[i] = data.weights[i];
  split.in.resize(data.in.size());
  std::vector<int64_t> source_row;  // split row -> original row
  for (int part = 0; part < 2; ++part) {
    for (size_t n = 0; n < c.lengths.size(); ++n) {
      const int begin = part == 0 ? 0 : first_lengths[n], end = part == 0 ? first_lengths[n] : c.lengths[n];
      for (int t = begin; t < end; ++t) source_row.push_back(cu[n] + t);
    }
  }
  for (size_t r = 0; r < source_row.size(); ++r) {
    std::copy_n(&data.in[source_row[r] * data.in_stride], data.in_stride, &split.in[r * data.in_stride]);
  }
  upload_data(split);
  const std::vector<int32_t> cu1 = prefix_sums(first_lengths), cu2 = prefix_sums(second_lengths);
  const PrepResult one = run_prep(c, split, cu1, c.slots, 0, data.conv_state, q_scale, false);
  const PrepResult two = run_prep(c, split, cu2, c.slots, cu1.back(), one.conv_state, q_scale, false);
  EXPECT_TRUE(bit_equal(two.conv_state.data(), got.conv_state.data(), got.conv_state.size(), "split tails"));
  for (int i = 0; i < 3; ++i) {
    std::vector<float> joined(data.T * data.C);
    for (size_t r = 0; r < source_row.size(); ++r) {
      const std::vector<float>& part = r < static_cast<size_t>(cu1.back()) ? one.f32[i] : two.f32[i];
      const size_t row = r < static_cast<size_t>(cu1.back()) ? r : r - cu1.back();
      std::copy_n(&part[row * data.C], data.C, &joined[source_row[r] * data.C]);
    }
    EXPECT_TRUE(bit_equal(joined.data(), got.f32[i].data(), joined.size(), std::string(names[i]) + " split"));
  }
}

TEST(OpsKdaGpu, PrepVarlenTailsSkippedSlot) {
  run_prep_case({});
}

TEST(OpsKdaGpu, PrepHeadSizesAndKernels) {
  run_prep_case({.heads = 3, .head_dim = 100, .conv_kernel = 4, .seed = 2});
  run_prep_case({.heads = 2, .head_dim = 128, .conv_kernel = 2, .seed = 3});
  run_prep_case({.heads = 4, .head_dim = 1, .conv_kernel = 3, .seed = 4});
  run_prep_case({.heads = 2, .head_dim = 64, .conv_kernel = 1, .seed = 5});
}

// The vectorised kernel (head_dim % 4 == 0, aligned rows) walks runs of 16 tokens per warp with the conv window in
// registers: sequences that start, end and are skipped inside a run and across run boundaries, idle lanes
// (d < 128), one active lane (d = 4); every K; the same cases through the reference kernel; unaligned rows
// (in_stride % 4 != 0) fall back to the reference kernel.
const std::vector<int> kRunLengths = {0, 15, 16, 17, 1, 33, 2, 40, 0, 3, 31};
const std::vector<int32_t> kRunSlots = {3, 0, 6, -1, 9, 2, 11, 5, 1, 8, 10};

TEST(OpsKdaGpu, PrepVectorisedRuns) {
  for (int K = 1; K <= 4; ++K) {
    run_prep_case({.heads = 4,
                   .head_dim = 128,
                   .conv_kernel = K,
                   .lengths = kRunLengths,
                   .slots = kRunSlots,
                   .num_slots = 12,
                   .seed = 10u + K});
  }
  run_prep_case({.heads = 3,
                 .head_dim = 96,
                 .conv_kernel = 4,
                 .lengths = kRunLengths,
                 .slots = kRunSlots,
                 .num_slots = 12,
                 .seed = 20});
  run_prep_case({.heads = 5,
                 .head_dim = 4,
                 .conv_kernel = 3,
                 .lengths = kRunLengths,
                 .slots = kRunSlots,
                 .num_slots = 12,
                 .seed = 21});
}

TEST(OpsKdaGpu, PrepReferenceKernelForcedAndUnalignedFallback) {
  run_prep_case({.heads = 4,
                 .head_dim = 128,
                 .conv_kernel = 4,
                 .lengths = kRunLengths,
                 .slots = kRunSlots,
                 .num_slots = 12,
                 .seed = 30,
                 .reference_kernel = true});
  run_prep_case({.heads = 2, .head_dim = 32, .conv_kernel = 4, .seed = 31, .reference_kernel = true});
  run_prep_case({.heads = 4,
                 .head_dim = 128,
                 .conv_kernel = 4,
                 .lengths = kRunLengths,
                 .slots = kRunSlots,
                 .num_slots = 12,
                 .seed = 32,
                 .in_stride_pad = 9});
}

// The two kernels on the same data: tails bit-identical, outputs equal up to the L2 summation order.
TEST(OpsKdaGpu, PrepVectorisedMatchesReferenceKernel) {
  PrepCase c{.heads = 4,
             .head_dim = 128,
             .conv_kernel = 4,
             .lengths = kRunLengths,
             .slots = kRunSlots,
             .num_slots = 12,
             .seed = 40};
  std::mt19937 rng(c.seed);
  PrepData data;
  make_data(c, data, rng);
  const std::vector<int32_t> cu = prefix_sums(c.lengths);
  const float q_scale = 1.0f / std::sqrt(128.0f);
  const PrepResult fast = run_prep(c, data, cu, c.slots, 0, data.conv_state, q_scale, true);
  c.reference_kernel = true;
  const PrepResult slow = run_prep(c, data, cu, c.slots, 0, data.conv_state, q_scale, true);
  EXPECT_TRUE(bit_equal(fast.conv_state.data(), slow.conv_state.data(), slow.conv_state.size(), "tails"));
  const char* names[3] = {"q", "k", "v"};
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(all_close(fast.f32[i], slow.f32[i], 1e-6, 1e-6, std::string(names[i]) + " fp32 fast vs reference"));
    EXPECT_TRUE(all_close(fast.bf16[i], slow.bf16[i], 1e-6, 8e-3, std::string(names[i]) + " bf16 fast vs reference"));
  }
}

// ---- kda_gate ------------------------------------------------------------------------------------------------

void run_gate(std::optional<float> lower_bound, uint32_t seed) {
  SCOPED_TRACE(lower_bound ? "bounded" : "softplus");
  const int64_t T = 5;
  const int H = 3, d = 16;
  const int64_t C = H * d, stride = C + 4;
  std::mt19937 rng(seed);
  std::vector<float> raw = normal_vector(rng, T * stride, 0.0f, 3.0f);
  raw[0] = 60.0f, raw[1] = -60.0f;  // saturated
  const std::vector<float> a_log = normal_vector(rng, H, 0.0f, 0.5f), dt_bias = normal_vector(rng, C, 0.0f, 0.5f);
  std::vector<float> packed(T * C), ref(T * C);
  for (int64_t t = 0; t < T; ++t) std::copy_n(&raw[t * stride], C, &packed[t * C]);
  cpu::kda_gate(packed.data(), a_log.data(), dt_bias.data(), ref.data(), T, H, d, lower_bound);
  DeviceBuffer<float> raw_d(raw.size()), a_d(H), dt_d(C), g_d(T * C + 4);
  raw_d.upload(raw);
  a_d.upload(a_log);
  dt_d.upload(dt_bias);
  g_d.upload(nan_vector(T * C + 4));
  Stream stream;
  const Status status =
      cuda::kda_gate(raw_d.get(), stride, a_d.get(), dt_d.get(), T, H, d, lower_bound, g_d.get(), stream.get());
  ASSERT_TRUE(status.is_ok()) << status.to_string();
  stream.sync();
  const std::vector<float> g = g_d.download();
  EXPECT_TRUE(all_close(g.data(), ref.data(), T * C, 1e-6, 1e-5, "kda_gate"));
  EXPECT_TRUE(all_nan(g.data() + T * C, 4, "kda_gate past the output"));
}

TEST(OpsKdaGpu, GateBothForms) {
  run_gate(-5.0f, 6);
  run_gate(std::nullopt, 7);
}

// ---- kda_gated_output_norm -----------------------------------------------------------------------------------

void run_gated_norm(int H, int d, bool bf16_input, uint32_t seed) {
  SCOPED_TRACE("H " + std::to_string(H) + " d " + std::to_string(d) + (bf16_input ? " bf16 o" : " fp32 o"));
  const int64_t T = 6, C = static_cast<int64_t>(H) * d, gate_stride = C + 2;
  std::mt19937 rng(seed);
  std::vector<float> o = normal_vector(rng, T * C, 0.0f, 0.3f);
  if (bf16_input) {
    for (float& x : o) x = bf16_round(x);
  }
  const std::vector<float> gate = normal_vector(rng, T * gate_stride, 0.0f, 2.0f);
  const std::vector<float> norm_w = normal_vector(rng, d, 1.0f, 0.1f);
  std::vector<float> packed_gate(T * C), ref(T * C);
  for (int64_t t = 0; t < T; ++t) std::copy_n(&gate[t * gate_stride], C, &packed_gate[t * C]);
  cpu::kda_gated_output_norm(o.data(), packed_gate.data(), norm_w.data(), ref.data(), T, H, d, 1e-5f);
  for (float& x : ref) x = bf16_round(x);
  DeviceBuffer<float> o32_d(T * C), gate_d(gate.size()), w_d(d);
  DeviceBuffer<__nv_bfloat16> o16_d(T * C), out_d(T * C + 4);
  o32_d.upload(o);
  o16_d.upload(to_bf16(o));
  gate_d.upload(gate);
  w_d.upload(norm_w);
  out_d.upload(std::vector<__nv_bfloat16>(T * C + 4, bf16_nan()));
  Stream stream;
  const Status status = bf16_input ? cuda::kda_gated_output_norm(o16_d.get(), gate_d.get(), gate_stride, w_d.get(), T,
                                                                 H, d, 1e-5f, out_d.get(), stream.get())
                                   : cuda::kda_gated_output_norm(o32_d.get(), gate_d.get(), gate_stride, w_d.get(), T,
                                                                 H, d, 1e-5f, out_d.get(), stream.get());
  ASSERT_TRUE(status.is_ok()) << status.to_string();
  stream.sync();
  const std::vector<float> out = to_float(out_d.download(), T * C + 4);
  EXPECT_TRUE(all_close(out.data(), ref.data(), T * C, kBf16Atol, kBf16Rtol, "kda_gated_output_norm"));
  EXPECT_TRUE(all_nan(out.data() + T * C, 4, "kda_gated_output_norm past the output"));
}

TEST(OpsKdaGpu, GatedOutputNorm) {
  for (bool bf16_input : {true, false}) {
    run_gated_norm(3, 100, bf16_input, 8);
    run_gated_norm(4, 128, bf16_input, 9);
    run_gated_norm(2, 32, bf16_input, 10);
    run_gated_norm(1, 1, bf16_input, 11);
  }
}

// ---- validation ----------------------------------------------------------------------------------------------

TEST(OpsKdaGpu, RejectsBadArguments) {
  auto invalid = [](const Status& s) { return s.code() == StatusCode::kInvalidArgument; };
  float* const fake = reinterpret_cast<float*>(256);
  const __nv_bfloat16* const fake16 = reinterpret_cast<const __nv_bfloat16*>(256);
  const int32_t* const fake_ids = reinterpret_cast<const int32_t*>(256);
  KdaPrepParams good;
  good.num_seqs = 1;
  good.num_tokens = 4;
  good.cu_seqlens = fake_ids;
  good.slots = fake_ids;
  good.num_heads = 2;
  good.head_dim = 32;
  good.q_in = good.k_in = good.v_in = fake16;
  good.in_stride = 64;
  good.q_conv_weight = good.k_conv_weight = good.v_conv_weight = fake;
  good.conv_state = reinterpret_cast<__nv_bfloat16*>(256);
  good.num_slots = 1;
  good.q = good.k = good.v = reinterpret_cast<__nv_bfloat16*>(256);
  auto with = [&](auto edit) {
    KdaPrepParams p = good;
    edit(p);
    return p;
  };
  EXPECT_TRUE(invalid(kda_prep(with([](KdaPrepParams& p) { p.head_dim = 129; }), nullptr)));
  EXPECT_TRUE(invalid(kda_prep(with([](KdaPrepParams& p) { p.head_dim = 0; }), nullptr)));
  EXPECT_TRUE(invalid(kda_prep(with([](KdaPrepParams& p) { p.conv_kernel = 5; }), nullptr)));
  EXPECT_TRUE(invalid(kda_prep(with([](KdaPrepParams& p) { p.in_stride = 63; }), nullptr)));
  EXPECT_TRUE(invalid(kda_prep(with([](KdaPrepParams& p) { p.num_seqs = -1; }), nullptr)));
  EXPECT_TRUE(invalid(kda_prep(with([](KdaPrepParams& p) { p.num_seqs = 0; }), nullptr)));  // T > 0, no seqs
  EXPECT_TRUE(invalid(kda_prep(with([](KdaPrepParams& p) { p.conv_state = nullptr; }), nullptr)));
  EXPECT_TRUE(invalid(kda_prep(with([](KdaPrepParams& p) { p.k = nullptr; }), nullptr)));
  EXPECT_TRUE(invalid(kda_prep(with([](KdaPrepParams& p) { p.cu_seqlens = nullptr; }), nullptr)));
  EXPECT_TRUE(invalid(kda_prep_f32(good, {fake, fake, nullptr}, nullptr)));
  EXPECT_TRUE(kda_prep(with([](KdaPrepParams& p) { p.num_tokens = 0; }), nullptr).is_ok());
  EXPECT_TRUE(invalid(cuda::kda_gate(fake, 8, fake, fake, 2, 2, 8, std::nullopt, fake, nullptr)));  // stride < H*d
  EXPECT_TRUE(invalid(cuda::kda_gate(fake, 16, fake, fake, -1, 2, 8, std::nullopt, fake, nullptr)));
  EXPECT_TRUE(invalid(cuda::kda_gate(fake, 16, nullptr, fake, 2, 2, 8, -5.0f, fake, nullptr)));
  EXPECT_TRUE(invalid(cuda::kda_gated_output_norm(fake, fake, 8, fake, 2, 2, 8, 1e-5f,
                                                  reinterpret_cast<__nv_bfloat16*>(256), nullptr)));
  EXPECT_TRUE(invalid(cuda::kda_gated_output_norm(fake16, fake, 16, nullptr, 2, 2, 8, 1e-5f,
                                                  reinterpret_cast<__nv_bfloat16*>(256), nullptr)));
  EXPECT_TRUE(cuda::kda_gated_output_norm(fake16, nullptr, 16, nullptr, 0, 2, 8, 1e-5f, nullptr, nullptr).is_ok());
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
