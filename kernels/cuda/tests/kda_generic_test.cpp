// GPU generic-head-size KDA recurrence vs cpu::kda_recurrent, ctest label gpu. Varlen batches with zero-length
// sequences, a skipped sequence (slot -1) and states in non-contiguous slots of a pool.
// Tolerances: o and the states |err| <= 1e-5 + 1e-4 |ref| per element and relative L2 <= 1e-5 (the same fp32
// recurrence; the GPU fuses multiply-adds, the CPU may not). Skipped rows keep their NaN poison; slots not in
// the batch stay bit-identical; a sequence split across two calls equals one call bit for bit.
#include "kernels/cuda/kda/kda_generic.hpp"

#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/basic_ops.hpp"
#include "kernels/cpu/kda.hpp"
#include "kernels/cuda/tests/ops_test_util.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

struct GenericCase {
  int heads = 2, head_dim = 32;
  std::vector<int> lengths = {0, 1, 5, 17, 64, 0, 3, 9};
  std::vector<int32_t> slots = {4, 0, 7, -1, 2, 5, 9, 1};  // sequence 3 skipped
  int num_slots = 10;
  uint32_t seed = 1;
};

struct Inputs {
  std::vector<float> q, k, v, g, beta;  // token-major, all tokens of the batch
};

Inputs make_inputs(std::mt19937& rng, int64_t T, int H, int d) {
  Inputs in;
  const int64_t n = T * H * d;
  in.q = normal_vector(rng, n);
  in.k = normal_vector(rng, n);
  in.v = normal_vector(rng, n);
  cpu::l2_normalize_heads(in.q.data(), T, H, d, 1e-6f, 1.0f / std::sqrt(static_cast<float>(d)));
  cpu::l2_normalize_heads(in.k.data(), T, H, d, 1e-6f, 1.0f);
  in.g = normal_vector(rng, n, 0.0f, 1.0f);
  for (float& x : in.g) x = -0.3f * cpu::softplus(x);  // log-decay <= 0
  in.beta = normal_vector(rng, T * H);
  cpu::sigmoid_inplace(in.beta.data(), T * H);
  return in;
}

std::vector<int32_t> prefix_sums(const std::vector<int>& lengths) {
  std::vector<int32_t> cu = {0};
  for (int length : lengths) cu.push_back(cu.back() + length);
  return cu;
}

// Runs the GPU recurrence on `in` (rows [first_token, first_token + cu.back())) for the batch (cu, slots) on
// `state` (updated); returns o [cu.back(), H, d] (NaN-poisoned before the call).
std::vector<float> run_gpu(const Inputs& in, int64_t first_token, const std::vector<int32_t>& cu,
                           const std::vector<int32_t>& slots, int H, int d, int num_slots, std::vector<float>& state) {
  const int64_t T = cu.back(), row = static_cast<int64_t>(H) * d;
  auto upload_rows = [&](const std::vector<float>& x, int64_t width) {
    auto buffer = std::make_unique<DeviceBuffer<float>>(std::max<int64_t>(T * width, 1));
    buffer->upload(std::vector<float>(x.begin() + first_token * width, x.begin() + (first_token + T) * width));
    return buffer;
  };
  const auto q_d = upload_rows(in.q, row), k_d = upload_rows(in.k, row), v_d = upload_rows(in.v, row);
  const auto g_d = upload_rows(in.g, row), beta_d = upload_rows(in.beta, H);
  DeviceBuffer<float> state_d(state.size()), o_d(T * row + 1);
  state_d.upload(state);
  o_d.upload(nan_vector(T * row + 1));
  DeviceBuffer<int32_t> cu_d(cu.size()), slots_d(slots.size());
  cu_d.upload(cu);
  slots_d.upload(slots);
  KdaRecurrentParams p;
  p.num_seqs = static_cast<int>(slots.size());
  p.num_tokens = T;
  p.cu_seqlens = cu_d.get();
  p.slots = slots_d.get();
  p.num_heads = H;
  p.head_dim = d;
  p.q = q_d->get();
  p.k = k_d->get();
  p.v = v_d->get();
  p.g = g_d->get();
  p.beta = beta_d->get();
  p.state = state_d.get();
  p.num_slots = num_slots;
  p.o = o_d.get();
  Stream stream;
  const Status status = kda_recurrent_varlen(p, stream.get());
  EXPECT_TRUE(status.is_ok()) << status.to_string();
  stream.sync();
  state = state_d.download();
  std::vector<float> o = o_d.download();
  EXPECT_TRUE(std::isnan(o[T * row])) << "o written past T";
  o.resize(T * row);
  return o;
}

void run_case(const GenericCase& c) {
  const int H = c.heads, d = c.head_dim;
  SCOPED_TRACE("H " + std::to_string(H) + " d " + std::to_string(d));
  std::mt19937 rng(c.seed);
  const std::vector<int32_t> cu = prefix_sums(c.lengths);
  const int64_t T = cu.back(), row = static_cast<int64_t>(H) * d, state_size = row * d;
  const Inputs in = make_inputs(rng, T, H, d);
  const std::vector<float> state0 = normal_vector(rng, c.num_slots * state_size, 0.0f, 0.05f);

  // CPU reference, sequence by sequence on its slot's state.
  std::vector<float> o_ref = nan_vector(T * row), state_ref = state0;
  for (size_t n = 0; n < c.lengths.size(); ++n) {
    if (c.slots[n] < 0) continue;
    const int64_t offset = cu[n] * row;
    const cpu::KdaInputs inputs{in.q.data() + offset,
                                in.k.data() + offset,
                                in.v.data() + offset,
                                in.g.data() + offset,
                                in.beta.data() + cu[n] * H,
                                c.lengths[n],
                                H,
                                d,
                                d};
    cpu::kda_recurrent(inputs, state_ref.data() + c.slots[n] * state_size, o_ref.data() + offset);
  }

  std::vector<float> state = state0;
  const std::vector<float> o = run_gpu(in, 0, cu, c.slots, H, d, c.num_slots, state);
  // Relative L2 over the rows of processed sequences (NaN rows excluded).
  std::vector<float> o_live, o_ref_live;
  for (int64_t i = 0; i < T * row; ++i) {
    if (std::isnan(o_ref[i])) continue;
    o_live.push_back(o[i]);
    o_ref_live.push_back(o_ref[i]);
  }
  const double o_error = relative_error(o_live.data(), o_ref_live.data(), o_live.size());
  const double state_error = relative_error(state.data(), state_ref.data(), state.size());
  std::printf("[ kda generic ] H=%d d=%d T=%lld: o rel L2 %.2e, state rel L2 %.2e\n", H, d, static_cast<long long>(T),
              o_error, state_error);
  EXPECT_TRUE(all_close(o, o_ref, 1e-5, 1e-4, "o"));  // NaN rows (skipped sequence) must stay NaN
  EXPECT_TRUE(all_close(state, state_ref, 1e-5, 1e-4, "state pool"));
  EXPECT_LE(o_error, 1e-5);
  EXPECT_LE(state_error, 1e-5);
  for (int slot = 0; slot < c.num_slots; ++slot) {
    bool live = false;
    for (size_t n = 0; n < c.slots.size(); ++n) live |= c.slots[n] == slot && c.lengths[n] > 0;
    if (live) continue;
    EXPECT_TRUE(bit_equal(state.data() + slot * state_size, state0.data() + slot * state_size, state_size,
                          "untouched slot " + std::to_string(slot)));
  }

  // Two calls (every sequence split at a third, the state carried in the pool) equal one call, bit for bit.
  std::vector<int> first_lengths, second_lengths;
  for (int length : c.lengths) {
    first_lengths.push_back(length / 3);
    second_lengths.push_back(length - length / 3);
  }
  // Re-order the token rows: all first parts, then all second parts.
  Inputs split;
  std::vector<int64_t> source_row;
  for (int part = 0; part < 2; ++part) {
    for (size_t n = 0; n < c.lengths.size(); ++n) {
      const int begin = part == 0 ? 0 : first_lengths[n], end = part == 0 ? first_lengths[n] : c.lengths[n];
      for (int t = begin; t < end; ++t) source_row.push_back(cu[n] + t);
    }
  }
  auto reorder = [&](const std::vector<float>& x, int64_t width) {
    std::vector<float> out(x.size());
    for (size_t r = 0; r < source_row.size(); ++r) {
      std::copy_n(&x[source_row[r] * width], width, &out[r * width]);
    }
    return out;
  };
  split.q = reorder(in.q, row);
  split.k = reorder(in.k, row);
  split.v = reorder(in.v, row);
  split.g = reorder(in.g, row);
  split.beta = reorder(in.beta, H);
  const std::vector<int32_t> cu1 = prefix_sums(first_lengths), cu2 = prefix_sums(second_lengths);
  std::vector<float> split_state = state0;
  const std::vector<float> o1 = run_gpu(split, 0, cu1, c.slots, H, d, c.num_slots, split_state);
  const std::vector<float> o2 = run_gpu(split, cu1.back(), cu2, c.slots, H, d, c.num_slots, split_state);
  EXPECT_TRUE(bit_equal(split_state.data(), state.data(), state.size(), "split state"));
  std::vector<float> joined(T * row);
  for (size_t r = 0; r < source_row.size(); ++r) {
    const bool first = r < static_cast<size_t>(cu1.back());
    const std::vector<float>& part = first ? o1 : o2;
    const size_t local = first ? r : r - cu1.back();
    std::copy_n(&part[local * row], row, &joined[source_row[r] * row]);
  }
  EXPECT_TRUE(bit_equal(joined.data(), o.data(), joined.size(), "split o"));
}

TEST(KdaGenericGpu, MatchesCpuRecurrence) {
  uint32_t seed = 1;
  for (int d : {1, 32, 64, 100, 128}) run_case({.heads = 2, .head_dim = d, .seed = seed++});
}

TEST(KdaGenericGpu, ManyHeadsLongSequence) {
  run_case({.heads = 16, .head_dim = 32, .lengths = {300, 0, 40}, .slots = {3, 1, 0}, .num_slots = 4, .seed = 9});
}

TEST(KdaGenericGpu, ZeroTokensAndValidation) {
  auto invalid = [](const Status& s) { return s.code() == StatusCode::kInvalidArgument; };
  float* const fake = reinterpret_cast<float*>(256);
  const int32_t* const fake_ids = reinterpret_cast<const int32_t*>(256);
  KdaRecurrentParams good;
  good.num_seqs = 2;
  good.num_tokens = 4;
  good.cu_seqlens = good.slots = fake_ids;
  good.num_heads = 2;
  good.head_dim = 32;
  good.q = good.k = good.v = good.g = good.beta = fake;
  good.state = good.o = fake;
  good.num_slots = 3;
  auto with = [&](auto edit) {
    KdaRecurrentParams p = good;
    edit(p);
    return p;
  };
  EXPECT_TRUE(invalid(kda_recurrent_varlen(with([](KdaRecurrentParams& p) { p.head_dim = 0; }), nullptr)));
  EXPECT_TRUE(invalid(kda_recurrent_varlen(with([](KdaRecurrentParams& p) { p.head_dim = 129; }), nullptr)));
  EXPECT_TRUE(invalid(kda_recurrent_varlen(with([](KdaRecurrentParams& p) { p.num_heads = 0; }), nullptr)));
  EXPECT_TRUE(invalid(kda_recurrent_varlen(with([](KdaRecurrentParams& p) { p.num_seqs = -1; }), nullptr)));
  EXPECT_TRUE(invalid(kda_recurrent_varlen(with([](KdaRecurrentParams& p) { p.num_tokens = -1; }), nullptr)));
  EXPECT_TRUE(invalid(kda_recurrent_varlen(with([](KdaRecurrentParams& p) { p.beta = nullptr; }), nullptr)));
  EXPECT_TRUE(invalid(kda_recurrent_varlen(with([](KdaRecurrentParams& p) { p.state = nullptr; }), nullptr)));
  EXPECT_TRUE(invalid(kda_recurrent_varlen(with([](KdaRecurrentParams& p) { p.slots = nullptr; }), nullptr)));
  // No tokens (every sequence empty): ok, nothing launched, even with null buffers.
  KdaRecurrentParams empty;
  empty.num_seqs = 3;
  empty.num_heads = 2;
  empty.head_dim = 32;
  EXPECT_TRUE(kda_recurrent_varlen(empty, nullptr).is_ok());
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
