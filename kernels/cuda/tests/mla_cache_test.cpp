// GPU mla_write_rows (the MLA page pool writes) vs cpu::rms_norm, ctest label gpu: each written row within one bf16
// rounding step of cpu::rms_norm (the fp32 value may round the other way), the k_rot part exact; every pool element
// not written (skipped tokens, slots past the pool, other layers, padding) still holds its NaN poison. Also the
// host-side validation of its inputs.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/basic_ops.hpp"
#include "kernels/cuda/mla/mla.hpp"
#include "kernels/cuda/tests/kda_test_util.hpp"
#include "kernels/cuda/tests/mla_test_util.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

bool is_poison(__nv_bfloat16 x) {
  return __nv_bfloat16_raw(x).x == __nv_bfloat16_raw(bf16_nan()).x;
}

void check_write_rows(const MlaShape& shape, uint32_t seed) {
  SCOPED_TRACE("mla_write_rows " + shape_name(shape));
  std::mt19937 rng(seed);
  const int kv = shape.kv_lora, rope = shape.rope, width = kv + rope;
  const int num_pages = 4, num_layers = 3, layer = 1, ps = 16;
  const int64_t row_stride = (width + 7) / 8 * 8 + 8;
  const int64_t T = 37, kv_stride = width + 5, capacity = static_cast<int64_t>(num_pages) * ps;
  std::vector<float> kv_in = normal_vector(rng, static_cast<size_t>(T * kv_stride), 0.0f, 2.0f);
  std::vector<float> weight = normal_vector(rng, kv, 1.0f, 0.2f);
  std::vector<int64_t> all_slots(capacity);
  std::iota(all_slots.begin(), all_slots.end(), 0);
  std::shuffle(all_slots.begin(), all_slots.end(), rng);
  std::vector<int64_t> slots(T);
  for (int64_t t = 0; t < T; ++t) slots[t] = (t % 5 == 2) ? -1 : (t % 11 == 7 ? capacity + 3 : all_slots[t]);
  const float eps = 1e-5f;
  const size_t pool_size = static_cast<size_t>(num_pages) * num_layers * ps * row_stride;
  DeviceBuffer<__nv_bfloat16> pool_d(pool_size);
  DeviceBuffer<float> kv_d(kv_in.size()), w_d(weight.size());
  DeviceBuffer<int64_t> slots_d(slots.size());
  pool_d.upload(std::vector<__nv_bfloat16>(pool_size, bf16_nan()));
  kv_d.upload(kv_in);
  w_d.upload(weight);
  slots_d.upload(slots);
  MlaWriteParams p;
  p.pool = MlaPagePool{pool_d.get(), num_pages, num_layers, ps, row_stride, width};
  p.layer = layer;
  p.num_tokens = T;
  p.kv = kv_d.get();
  p.kv_stride = kv_stride;
  p.norm_weight = w_d.get();
  p.eps = eps;
  p.kv_lora_rank = kv;
  p.qk_rope = rope;
  p.slot_mapping = slots_d.get();
  const Status status = mla_write_rows(p, nullptr);
  ASSERT_TRUE(status.is_ok()) << status.to_string();
  DS_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<__nv_bfloat16> pool = pool_d.download();

  std::vector<bool> written(pool_size, false);
  int mismatches = 0;
  double max_err = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= capacity) continue;
    std::vector<float> normed(kv);
    cpu::rms_norm(&kv_in[t * kv_stride], weight.data(), normed.data(), 1, kv, eps);
    const size_t base = static_cast<size_t>((((slot / ps) * num_layers + layer) * ps + slot % ps) * row_stride);
    for (int c = 0; c < width; ++c) {
      written[base + c] = true;
      const float got = __bfloat162float(pool[base + c]);
      const float want = c < kv ? normed[c] : kv_in[t * kv_stride + c];
      // One bf16 step (8 mantissa bits) for the normed part; the k_rot part is a plain rounding.
      const float tol = c < kv ? std::fabs(want) * (1.0f / 128.0f) + 1e-6f : 0.0f;
      const float err = std::isfinite(got) ? std::fabs(got - (c < kv ? want : bf16_round(want))) : INFINITY;
      max_err = std::max<double>(max_err, err);
      if (err > tol && mismatches++ < 5) {
        ADD_FAILURE() << "token " << t << " slot " << slot << " col " << c << ": expected " << want << " got " << got;
      }
    }
  }
  std::printf("  mla_write_rows max abs err %.3g\n", max_err);
  EXPECT_EQ(mismatches, 0);
  size_t stray = 0;
  for (size_t i = 0; i < pool_size; ++i) {
    if (!written[i] && !is_poison(pool[i]) && stray++ < 5) ADD_FAILURE() << "pool element " << i << " overwritten";
  }
  EXPECT_EQ(stray, 0u);
}

TEST(MlaWriteRows, MatchesRmsNormAndLayout) {
  check_write_rows(kTiny, 70);
  check_write_rows(kKimi48B, 71);
  check_write_rows(MlaShape{2, 1024, 16, 64, 16}, 72);  // kv_lora past the 512 columns held in registers
}

// ---- validation (no GPU work: every call below must be rejected before launching) ------------------------------
TEST(MlaWriteRowsValidation, RejectsBadHostInputs) {
  auto valid = [] {
    MlaWriteParams p;
    p.pool = MlaPagePool{fake_device<__nv_bfloat16>(), 10, 2, 64, 40, 40};
    p.layer = 0;
    p.num_tokens = 3;
    p.kv = fake_device<float>();
    p.kv_stride = 40;
    p.norm_weight = fake_device<float>();
    p.kv_lora_rank = 32;
    p.qk_rope = 8;
    p.slot_mapping = fake_device<int64_t>();
    return p;
  };
  struct Bad {
    const char* what;
    void (*edit)(MlaWriteParams&);
  };
  const Bad cases[] = {
      {"pages null", [](MlaWriteParams& p) { p.pool.pages = nullptr; }},
      {"layer out of range", [](MlaWriteParams& p) { p.layer = 2; }},
      {"page_size 8", [](MlaWriteParams& p) { p.pool.page_size = 8; }},
      {"width mismatch", [](MlaWriteParams& p) { p.qk_rope = 16; }},
      {"kv_stride small", [](MlaWriteParams& p) { p.kv_stride = 39; }},
      {"eps negative", [](MlaWriteParams& p) { p.eps = -1.0f; }},
      {"num_tokens negative", [](MlaWriteParams& p) { p.num_tokens = -2; }},
      {"kv null", [](MlaWriteParams& p) { p.kv = nullptr; }},
      {"slot_mapping null", [](MlaWriteParams& p) { p.slot_mapping = nullptr; }},
      {"norm_weight null", [](MlaWriteParams& p) { p.norm_weight = nullptr; }},
  };
  for (const Bad& bad : cases) {
    MlaWriteParams p = valid();
    bad.edit(p);
    const Status s = mla_write_rows(p, nullptr);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad.what << ": " << s.to_string();
  }
  MlaWriteParams p = valid();
  p.num_tokens = 0;
  p.kv = nullptr;
  EXPECT_TRUE(mla_write_rows(p, nullptr).is_ok());
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
