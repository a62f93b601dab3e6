// GPU elementwise / norm ops vs their CPU references (kernels/cpu/basic_ops.hpp, attn_res.hpp), ctest label gpu.
// Tolerances: fp32 outputs |err| <= 1e-6 + 1e-5 |ref| (the CPU reduces in fp64, the GPU in fp32; the GPU's
// exp is the fast intrinsic); bf16 outputs are compared with the bf16-rounded reference, |err| <= 1e-6 + 8e-3 |ref|
// (one bf16 ulp is 2^-8 relative: a rounding boundary between the two fp32 values can flip one ulp).
// Outputs carry NaN-poisoned padding (row strides, tails) that must stay NaN.
#include "kernels/cuda/ops/ops.hpp"

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/attn_res.hpp"
#include "kernels/cpu/basic_ops.hpp"
#include "kernels/cuda/tests/ops_test_util.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

constexpr double kF32Atol = 1e-6, kF32Rtol = 1e-5;
constexpr double kBf16Atol = 1e-6, kBf16Rtol = 8e-3;

std::vector<float> rounded_to_bf16(const std::vector<float>& x) {
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = bf16_round(x[i]);
  return out;
}

// ---- rms_norm ------------------------------------------------------------------------------------------------

void run_rms_norm(int64_t rows, int64_t dim, bool with_weight, uint32_t seed) {
  SCOPED_TRACE("rows " + std::to_string(rows) + " dim " + std::to_string(dim) + " weight " +
               std::to_string(with_weight));
  std::mt19937 rng(seed);
  const int64_t x_stride = dim + 3, y_stride = dim + 5;
  std::vector<float> x_packed = normal_vector(rng, rows * dim, 0.5f, 2.0f);
  std::vector<float> weight = normal_vector(rng, dim, 1.0f, 0.2f);
  std::vector<float> x_strided = nan_vector(rows * x_stride);  // the padding is never read
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < dim; ++c) x_strided[r * x_stride + c] = x_packed[r * dim + c];
  }
  std::vector<float> ref(rows * dim);
  cpu::rms_norm(x_packed.data(), with_weight ? weight.data() : nullptr, ref.data(), rows, dim, 1e-5f);

  DeviceBuffer<float> x_d(rows * x_stride), w_d(dim), y32_d(rows * y_stride);
  DeviceBuffer<__nv_bfloat16> y16_d(rows * y_stride);
  x_d.upload(x_strided);
  w_d.upload(weight);
  y32_d.upload(nan_vector(rows * y_stride));
  y16_d.upload(std::vector<__nv_bfloat16>(rows * y_stride, bf16_nan()));
  Stream stream;
  const float* w = with_weight ? w_d.get() : nullptr;
  Status status = cuda::rms_norm(x_d.get(), x_stride, w, rows, dim, 1e-5f, y32_d.get(), y_stride, stream.get());
  ASSERT_TRUE(status.is_ok()) << status.to_string();
  status = cuda::rms_norm(x_d.get(), x_stride, w, rows, dim, 1e-5f, y16_d.get(), y_stride, stream.get());
  ASSERT_TRUE(status.is_ok()) << status.to_string();
  stream.sync();
  const std::vector<float> y32 = y32_d.download();
  const std::vector<float> y16 = to_float(y16_d.download(), rows * y_stride);
  std::vector<float> got32(rows * dim), got16(rows * dim);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < dim; ++c) {
      got32[r * dim + c] = y32[r * y_stride + c];
      got16[r * dim + c] = y16[r * y_stride + c];
    }
    EXPECT_TRUE(all_nan(&y32[r * y_stride + dim], y_stride - dim, "fp32 padding of row " + std::to_string(r)));
    EXPECT_TRUE(all_nan(&y16[r * y_stride + dim], y_stride - dim, "bf16 padding of row " + std::to_string(r)));
  }
  EXPECT_TRUE(all_close(got32, ref, kF32Atol, kF32Rtol, "rms_norm fp32"));
  EXPECT_TRUE(all_close(got16, rounded_to_bf16(ref), kBf16Atol, kBf16Rtol, "rms_norm bf16"));

  // In place (fp32, same stride).
  status = cuda::rms_norm(x_d.get(), x_stride, w, rows, dim, 1e-5f, x_d.get(), x_stride, stream.get());
  ASSERT_TRUE(status.is_ok()) << status.to_string();
  stream.sync();
  const std::vector<float> in_place = x_d.download();
  std::vector<float> got_in_place(rows * dim);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < dim; ++c) got_in_place[r * dim + c] = in_place[r * x_stride + c];
    EXPECT_TRUE(all_nan(&in_place[r * x_stride + dim], x_stride - dim, "in-place padding"));
  }
  EXPECT_TRUE(all_close(got_in_place, ref, kF32Atol, kF32Rtol, "rms_norm in place"));
}

TEST(OpsGpu, RmsNormStridesAndOutputs) {
  run_rms_norm(5, 1000, true, 1);
  run_rms_norm(3, 7, false, 2);
  run_rms_norm(17, 2304, true, 3);
  run_rms_norm(1, 7168, false, 4);
}

// ---- elementwise ---------------------------------------------------------------------------------------------

TEST(OpsGpu, AddToBf16SigmoidAndGate) {
  const int64_t n = 100003;
  std::mt19937 rng(5);
  std::vector<float> x = normal_vector(rng, n, 0.0f, 4.0f), y = normal_vector(rng, n, 0.0f, 4.0f);
  std::vector<float> gate = normal_vector(rng, n, 0.0f, 6.0f);
  x[0] = 100.0f, x[1] = -100.0f, gate[0] = 90.0f, gate[1] = -90.0f;  // saturated sigmoids stay finite
  DeviceBuffer<float> x_d(n), y_d(n), gate_d(n), s_d(n);
  DeviceBuffer<__nv_bfloat16> b_d(n + 8), g_d(n + 8);
  x_d.upload(x);
  y_d.upload(y);
  gate_d.upload(gate);
  s_d.upload(x);
  b_d.upload(std::vector<__nv_bfloat16>(n + 8, bf16_nan()));
  g_d.upload(std::vector<__nv_bfloat16>(n + 8, bf16_nan()));
  Stream stream;
  ASSERT_TRUE(cuda::add_inplace(y_d.get(), x_d.get(), n, stream.get()).is_ok());
  ASSERT_TRUE(cuda::to_bf16(x_d.get(), n, b_d.get(), stream.get()).is_ok());
  ASSERT_TRUE(cuda::sigmoid_inplace(s_d.get(), n, stream.get()).is_ok());
  ASSERT_TRUE(cuda::sigmoid_gate(x_d.get(), gate_d.get(), n, g_d.get(), stream.get()).is_ok());
  stream.sync();

  std::vector<float> sum_ref(n), sig_ref(x), gate_ref(n);
  for (int64_t i = 0; i < n; ++i) sum_ref[i] = y[i] + x[i];
  cpu::sigmoid_inplace(sig_ref.data(), n);
  for (int64_t i = 0; i < n; ++i) gate_ref[i] = bf16_round(x[i] * cpu::sigmoid(gate[i]));
  EXPECT_TRUE(bit_equal(y_d.download().data(), sum_ref.data(), n, "add_inplace"));
  const std::vector<float> b = to_float(b_d.download(), n + 8);
  EXPECT_TRUE(bit_equal(b.data(), rounded_to_bf16(x).data(), n, "to_bf16"));
  EXPECT_TRUE(all_nan(b.data() + n, 8, "to_bf16 past n"));
  EXPECT_TRUE(all_close(s_d.download(), sig_ref, kF32Atol, kF32Rtol, "sigmoid_inplace"));
  const std::vector<float> g = to_float(g_d.download(), n + 8);
  EXPECT_TRUE(all_close(g.data(), gate_ref.data(), n, kBf16Atol, kBf16Rtol, "sigmoid_gate"));
  EXPECT_TRUE(all_nan(g.data() + n, 8, "sigmoid_gate past n"));
}

void run_glu(GluKind kind, int64_t rows, int64_t width, uint32_t seed) {
  SCOPED_TRACE(std::string(kind == GluKind::kSwiGlu ? "swiglu" : "situ") + " rows " + std::to_string(rows) + " width " +
               std::to_string(width));
  std::mt19937 rng(seed);
  const float beta = 3.0f, beta_linear = 5.0f;
  std::vector<float> gate_up = normal_vector(rng, rows * 2 * width, 0.0f, 4.0f);
  std::vector<float> gate(rows * width), up(rows * width), ref(rows * width);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < width; ++c) {
      gate[r * width + c] = gate_up[r * 2 * width + c];
      up[r * width + c] = gate_up[r * 2 * width + width + c];
    }
  }
  if (kind == GluKind::kSwiGlu) {
    cpu::swiglu(gate.data(), up.data(), ref.data(), rows * width);
  } else {
    cpu::situ_glu(gate.data(), up.data(), ref.data(), rows * width, beta, beta_linear);
  }
  DeviceBuffer<float> gu_d(gate_up.size());
  DeviceBuffer<__nv_bfloat16> out_d(rows * width + 8);
  gu_d.upload(gate_up);
  out_d.upload(std::vector<__nv_bfloat16>(rows * width + 8, bf16_nan()));
  Stream stream;
  const Status status = cuda::glu(gu_d.get(), rows, width, kind, beta, beta_linear, out_d.get(), stream.get());
  ASSERT_TRUE(status.is_ok()) << status.to_string();
  stream.sync();
  const std::vector<float> out = to_float(out_d.download(), rows * width + 8);
  EXPECT_TRUE(all_close(out.data(), rounded_to_bf16(ref).data(), rows * width, kBf16Atol, kBf16Rtol, "glu"));
  EXPECT_TRUE(all_nan(out.data() + rows * width, 8, "glu past the output"));
}

TEST(OpsGpu, GluBothKinds) {
  for (GluKind kind : {GluKind::kSwiGlu, GluKind::kSitu}) {
    run_glu(kind, 7, 300, 6);
    run_glu(kind, 1, 1, 7);
    run_glu(kind, 33, 1024, 8);
  }
}

// ---- attn_res_mix --------------------------------------------------------------------------------------------

void run_attn_res(int num_sources, int64_t T, int64_t dim, uint32_t seed) {
  SCOPED_TRACE("sources " + std::to_string(num_sources) + " T " + std::to_string(T) + " dim " + std::to_string(dim));
  std::mt19937 rng(seed);
  std::vector<std::vector<float>> sources;
  std::vector<DeviceBuffer<float>> sources_d;
  std::vector<const float*> host_pointers, device_pointers;
  for (int i = 0; i < num_sources; ++i) {
    sources.push_back(normal_vector(rng, T * dim, 0.1f * i, 1.0f + 0.5f * i));
    sources_d.emplace_back(T * dim);
    sources_d.back().upload(sources.back());
  }
  for (int i = 0; i < num_sources; ++i) {
    host_pointers.push_back(sources[i].data());
    device_pointers.push_back(sources_d[i].get());
  }
  std::vector<float> norm_w = normal_vector(rng, dim, 1.0f, 0.3f), proj_w = normal_vector(rng, dim, 0.0f, 0.2f);
  std::vector<float> ref(T * dim);
  cpu::attn_res_mix(host_pointers.data(), num_sources, norm_w.data(), proj_w.data(), ref.data(), T, dim, 1e-6f);
  DeviceBuffer<float> nw_d(dim), pw_d(dim), out_d(T * dim + 8);
  nw_d.upload(norm_w);
  pw_d.upload(proj_w);
  out_d.upload(nan_vector(T * dim + 8));
  Stream stream;
  const Status status = cuda::attn_res_mix(device_pointers.data(), num_sources, nw_d.get(), pw_d.get(), T, dim, 1e-6f,
                                           out_d.get(), stream.get());
  ASSERT_TRUE(status.is_ok()) << status.to_string();
  stream.sync();
  const std::vector<float> out = out_d.download();
  if (num_sources == 1) {
    EXPECT_TRUE(bit_equal(out.data(), ref.data(), T * dim, "attn_res_mix of one source"));
  } else {
    // The softmax weights carry the logits' fp32 rounding (|logit| ~ sqrt(dim) * 0.2): 1e-5 relative plus an
    // absolute term scaled to the sources' magnitude.
    EXPECT_TRUE(all_close(out.data(), ref.data(), T * dim, 2e-5, 2e-5, "attn_res_mix"));
  }
  EXPECT_TRUE(all_nan(out.data() + T * dim, 8, "attn_res_mix past the output"));
}

TEST(OpsGpu, AttnResMixOneTwoFiveSources) {
  run_attn_res(1, 9, 257, 9);
  run_attn_res(2, 9, 257, 10);
  run_attn_res(5, 9, 257, 11);
  run_attn_res(5, 3, 2304, 12);
}

// ---- embedding_gather ----------------------------------------------------------------------------------------

TEST(OpsGpu, EmbeddingGatherOutOfRangeIsNan) {
  const int64_t vocab = 50, hidden = 40;
  std::mt19937 rng(13);
  const std::vector<__nv_bfloat16> table = to_bf16(normal_vector(rng, vocab * hidden));
  const std::vector<int32_t> ids = {49, 0, -1, 50, 7, 7};
  const int64_t T = static_cast<int64_t>(ids.size());
  DeviceBuffer<__nv_bfloat16> table_d(vocab * hidden);
  DeviceBuffer<int32_t> ids_d(T);
  DeviceBuffer<float> out_d(T * hidden + 8);
  table_d.upload(table);
  ids_d.upload(ids);
  out_d.upload(std::vector<float>(T * hidden + 8, 12345.0f));
  Stream stream;
  ASSERT_TRUE(cuda::embedding_gather(table_d.get(), vocab, hidden, ids_d.get(), T, out_d.get(), stream.get()).is_ok());
  stream.sync();
  const std::vector<float> out = out_d.download();
  for (int64_t t = 0; t < T; ++t) {
    const int32_t id = ids[t];
    if (id < 0 || id >= vocab) {
      EXPECT_TRUE(all_nan(&out[t * hidden], hidden, "row of out-of-range id " + std::to_string(id)));
      continue;
    }
    const std::vector<float> row =
        to_float(std::vector<__nv_bfloat16>(&table[id * hidden], &table[(id + 1) * hidden]), hidden);
    EXPECT_TRUE(bit_equal(&out[t * hidden], row.data(), hidden, "row " + std::to_string(t)));
  }
  for (int i = 0; i < 8; ++i) EXPECT_EQ(out[T * hidden + i], 12345.0f) << "past the output, index " << i;
}

// ---- gather_slots / scatter_slots ----------------------------------------------------------------------------

TEST(OpsGpu, GatherScatterSlots) {
  const int num_slots = 6;
  const int64_t row_bytes = 48, row_floats = row_bytes / 4;
  const std::vector<int32_t> slots = {3, -1, 0, 5};
  const int64_t n = static_cast<int64_t>(slots.size());
  std::mt19937 rng(14);
  const std::vector<float> pool = normal_vector(rng, num_slots * row_floats);
  const std::vector<float> dense_in = normal_vector(rng, n * row_floats);
  DeviceBuffer<float> pool_d(pool.size()), dense_d(n * row_floats), scattered_d(pool.size());
  DeviceBuffer<int32_t> slots_d(n);
  pool_d.upload(pool);
  scattered_d.upload(pool);
  dense_d.upload(nan_vector(n * row_floats));
  slots_d.upload(slots);
  Stream stream;
  ASSERT_TRUE(cuda::gather_slots(pool_d.get(), row_bytes, slots_d.get(), n, dense_d.get(), stream.get()).is_ok());
  stream.sync();
  const std::vector<float> gathered = dense_d.download();
  for (int64_t i = 0; i < n; ++i) {
    std::vector<float> expected(row_floats, 0.0f);
    if (slots[i] >= 0) expected.assign(&pool[slots[i] * row_floats], &pool[(slots[i] + 1) * row_floats]);
    EXPECT_TRUE(bit_equal(&gathered[i * row_floats], expected.data(), row_floats, "gathered row " + std::to_string(i)));
  }
  dense_d.upload(dense_in);
  ASSERT_TRUE(cuda::scatter_slots(dense_d.get(), row_bytes, slots_d.get(), n, scattered_d.get(), stream.get()).is_ok());
  stream.sync();
  std::vector<float> expected = pool;
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] < 0) continue;
    for (int64_t j = 0; j < row_floats; ++j) expected[slots[i] * row_floats + j] = dense_in[i * row_floats + j];
  }
  EXPECT_TRUE(bit_equal(scattered_d.download().data(), expected.data(), expected.size(), "scattered pool"));
}

// ---- argument validation (no kernel runs) --------------------------------------------------------------------

TEST(OpsGpu, RejectsBadArguments) {
  float* const fake = reinterpret_cast<float*>(256);  // never dereferenced: each call fails validation first
  __nv_bfloat16* const fake16 = reinterpret_cast<__nv_bfloat16*>(256);
  const int32_t* const fake_ids = reinterpret_cast<const int32_t*>(256);
  auto invalid = [](const Status& s) { return s.code() == StatusCode::kInvalidArgument; };
  EXPECT_TRUE(invalid(cuda::rms_norm(fake, 8, nullptr, -1, 8, 1e-5f, fake, 8, nullptr)));
  EXPECT_TRUE(invalid(cuda::rms_norm(fake, 8, nullptr, 2, 0, 1e-5f, fake, 8, nullptr)));
  EXPECT_TRUE(invalid(cuda::rms_norm(fake, 4, nullptr, 2, 8, 1e-5f, fake, 8, nullptr)));
  EXPECT_TRUE(invalid(cuda::rms_norm(nullptr, 8, nullptr, 2, 8, 1e-5f, fake16, 8, nullptr)));
  EXPECT_TRUE(invalid(cuda::rms_norm(fake, 8, nullptr, 2, 8, 1e-5f, fake, 16, nullptr)));  // in place, other stride
  EXPECT_TRUE(cuda::rms_norm(nullptr, 8, nullptr, 0, 8, 1e-5f, static_cast<float*>(nullptr), 8, nullptr).is_ok());
  EXPECT_TRUE(invalid(cuda::add_inplace(fake, nullptr, 4, nullptr)));
  EXPECT_TRUE(invalid(cuda::add_inplace(fake, fake, -1, nullptr)));
  EXPECT_TRUE(cuda::add_inplace(nullptr, nullptr, 0, nullptr).is_ok());
  EXPECT_TRUE(invalid(cuda::to_bf16(fake, 4, nullptr, nullptr)));
  EXPECT_TRUE(invalid(cuda::sigmoid_inplace(nullptr, 4, nullptr)));
  EXPECT_TRUE(invalid(cuda::sigmoid_gate(fake, nullptr, 4, fake16, nullptr)));
  EXPECT_TRUE(invalid(cuda::glu(fake, 2, 0, GluKind::kSwiGlu, 1.0f, 1.0f, fake16, nullptr)));
  EXPECT_TRUE(invalid(cuda::glu(fake, 2, 4, GluKind::kSitu, 0.0f, 1.0f, fake16, nullptr)));
  EXPECT_TRUE(invalid(cuda::glu(nullptr, 2, 4, GluKind::kSwiGlu, 1.0f, 1.0f, fake16, nullptr)));
  const float* sources[2] = {fake, fake};
  EXPECT_TRUE(invalid(cuda::attn_res_mix(sources, 0, fake, fake, 2, 8, 1e-6f, fake + 64, nullptr)));
  EXPECT_TRUE(invalid(cuda::attn_res_mix(sources, 65, fake, fake, 2, 8, 1e-6f, fake + 64, nullptr)));
  EXPECT_TRUE(invalid(cuda::attn_res_mix(sources, 2, fake, fake, 2, 8, 1e-6f, fake, nullptr)));  // out aliases
  EXPECT_TRUE(invalid(cuda::attn_res_mix(sources, 2, nullptr, fake, 2, 8, 1e-6f, fake + 64, nullptr)));
  EXPECT_TRUE(invalid(cuda::embedding_gather(fake16, 0, 8, fake_ids, 2, fake, nullptr)));
  EXPECT_TRUE(invalid(cuda::embedding_gather(fake16, 8, 8, nullptr, 2, fake, nullptr)));
  EXPECT_TRUE(invalid(cuda::gather_slots(fake, 8, fake_ids, 2, fake + 64, nullptr)));  // row_bytes % 16
  EXPECT_TRUE(invalid(cuda::gather_slots(fake, 16, fake_ids, -1, fake + 64, nullptr)));
  EXPECT_TRUE(invalid(cuda::scatter_slots(fake, 16, nullptr, 2, fake + 64, nullptr)));
  EXPECT_TRUE(invalid(cuda::scatter_slots(fake + 1, 16, fake_ids, 2, fake + 64, nullptr)));  // misaligned
  EXPECT_TRUE(cuda::scatter_slots(nullptr, 16, nullptr, 0, nullptr, nullptr).is_ok());
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
