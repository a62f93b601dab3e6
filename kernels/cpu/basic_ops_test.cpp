#include "kernels/cpu/basic_ops.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/cpu/thread_pool.hpp"

namespace deltaserve::kernels::cpu {
namespace {

// Uniform floats in [low, high) from a fixed-seed generator (24 random bits, platform independent).
std::vector<float> random_floats(std::mt19937& generator, size_t n, float low, float high) {
  std::vector<float> values(n);
  for (float& value : values) value = low + (high - low) * static_cast<float>(generator() >> 8) * 0x1p-24f;
  return values;
}

double reference_sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

TEST(BasicOpsTest, RmsNormMatchesReference) {
  std::mt19937 generator(1);
  for (int64_t dim : {1, 7, 64, 130}) {
    const int64_t rows = 5;
    const std::vector<float> x = random_floats(generator, static_cast<size_t>(rows * dim), -3.0f, 3.0f);
    const std::vector<float> weight = random_floats(generator, static_cast<size_t>(dim), 0.5f, 1.5f);
    for (const float* weight_or_null : {weight.data(), static_cast<const float*>(nullptr)}) {
      std::vector<float> y(x.size());
      rms_norm(x.data(), weight_or_null, y.data(), rows, dim, 1e-5f);
      for (int64_t r = 0; r < rows; ++r) {
        double mean_square = 0.0;
        for (int64_t d = 0; d < dim; ++d) mean_square += double{x[r * dim + d]} * x[r * dim + d];
        mean_square /= static_cast<double>(dim);
        for (int64_t d = 0; d < dim; ++d) {
          const double expected =
              x[r * dim + d] / std::sqrt(mean_square + 1e-5) * (weight_or_null != nullptr ? weight_or_null[d] : 1.0);
          EXPECT_NEAR(y[r * dim + d], expected, 1e-5 * (1.0 + std::fabs(expected)));
        }
      }
    }
  }
}

TEST(BasicOpsTest, RmsNormInPlaceEqualsOutOfPlace) {
  std::mt19937 generator(2);
  const int64_t rows = 9;
  const int64_t dim = 48;
  std::vector<float> x = random_floats(generator, static_cast<size_t>(rows * dim), -2.0f, 2.0f);
  const std::vector<float> weight = random_floats(generator, static_cast<size_t>(dim), -1.0f, 1.0f);
  std::vector<float> out_of_place(x.size());
  rms_norm(x.data(), weight.data(), out_of_place.data(), rows, dim, 1e-6f);
  rms_norm(x.data(), weight.data(), x.data(), rows, dim, 1e-6f);
  EXPECT_EQ(x, out_of_place);
}

// Naive fp64 matmul: y[r, o] = sum_c x[r, c] * weight[o, c].
std::vector<double> reference_linear(const std::vector<float>& x, const std::vector<float>& weight, int64_t rows,
                                     int64_t in, int64_t out) {
  std::vector<double> y(static_cast<size_t>(rows * out), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t c = 0; c < in; ++c) y[r * out + o] += double{x[r * in + c]} * weight[o * in + c];
    }
  }
  return y;
}

TEST(BasicOpsTest, LinearMatchesNaiveMatmul) {
  std::mt19937 generator(3);
  // Row counts on both sides of the row/output split, tails in every tiled dimension.
  struct Shape {
    int64_t rows, in, out;
  };
  for (int threads : {1, 3}) {
    set_num_threads(threads);
    for (const Shape shape : {Shape{1, 1, 1}, Shape{1, 7, 5}, Shape{3, 33, 9}, Shape{4, 64, 16}, Shape{5, 100, 70},
                              Shape{31, 17, 130}, Shape{37, 129, 13}, Shape{70, 64, 33}}) {
      const auto [rows, in, out] = shape;
      const std::vector<float> x = random_floats(generator, static_cast<size_t>(rows * in), -1.0f, 1.0f);
      const std::vector<float> weight = random_floats(generator, static_cast<size_t>(out * in), -1.0f, 1.0f);
      const std::vector<double> expected = reference_linear(x, weight, rows, in, out);
      const std::vector<float> initial = random_floats(generator, static_cast<size_t>(rows * out), -1.0f, 1.0f);
      for (bool accumulate : {false, true}) {
        std::vector<float> y = initial;
        linear(x.data(), weight.data(), y.data(), rows, in, out, accumulate);
        // Error bound of an fp32 sum of `in` products of magnitude <= 1.
        const double tolerance = 1e-6 * static_cast<double>(in) + 1e-6;
        for (size_t i = 0; i < y.size(); ++i) {
          const double want = expected[i] + (accumulate ? initial[i] : 0.0f);
          ASSERT_NEAR(y[i], want, tolerance) << rows << "x" << in << "x" << out << " accumulate " << accumulate;
        }
      }
    }
  }
  set_num_threads(0);
}

TEST(BasicOpsTest, LinearIgnoresEmptyShapes) {
  std::vector<float> y(4, 7.0f);
  const float x = 1.0f;
  linear(&x, &x, y.data(), 0, 1, 4);
  EXPECT_EQ(y, std::vector<float>(4, 7.0f));
  // in == 0: an empty sum.
  linear(&x, &x, y.data(), 1, 0, 4);
  EXPECT_EQ(y, std::vector<float>(4, 0.0f));
}

TEST(BasicOpsTest, DotMatchesReference) {
  std::mt19937 generator(4);
  for (int64_t n : {0, 1, 7, 8, 9, 100}) {
    const std::vector<float> a = random_floats(generator, static_cast<size_t>(n), -1.0f, 1.0f);
    const std::vector<float> b = random_floats(generator, static_cast<size_t>(n), -1.0f, 1.0f);
    double expected = 0.0;
    for (int64_t i = 0; i < n; ++i) expected += double{a[i]} * b[i];
    EXPECT_NEAR(dot(a.data(), b.data(), n), expected, 1e-6 * static_cast<double>(n + 1));
  }
}

TEST(BasicOpsTest, ScalarActivationsAreStableAtExtremes) {
  for (float x : {-1000.0f, -100.0f, -30.0f, -1.0f, 0.0f, 1.0f, 30.0f, 100.0f, 1000.0f}) {
    EXPECT_TRUE(std::isfinite(sigmoid(x)));
    EXPECT_TRUE(std::isfinite(softplus(x)));
    EXPECT_TRUE(std::isfinite(silu(x)));
    EXPECT_NEAR(sigmoid(x), reference_sigmoid(x), 1e-7);
    EXPECT_GE(softplus(x), 0.0f);
    EXPECT_NEAR(softplus(x), std::max<double>(x, 0.0) + std::log1p(std::exp(-std::fabs(double{x}))),
                1e-6 * (1.0 + std::fabs(x)));
    EXPECT_NEAR(silu(x), x * reference_sigmoid(x), 1e-6 * (1.0 + std::fabs(x)));
  }
  EXPECT_EQ(sigmoid(-1000.0f), 0.0f);
  EXPECT_EQ(sigmoid(1000.0f), 1.0f);
  EXPECT_EQ(softplus(1000.0f), 1000.0f);
  EXPECT_GT(softplus(-50.0f), 0.0f);  // e^-50 ≈ 1.9e-22, representable
  EXPECT_NEAR(softplus(-50.0f), std::exp(-50.0), 1e-28);
}

TEST(BasicOpsTest, ElementwiseOpsMatchFormulas) {
  std::mt19937 generator(5);
  // Larger than one parallel range so that several threads take part.
  const size_t n = 100'003;
  const std::vector<float> gate = random_floats(generator, n, -40.0f, 40.0f);
  const std::vector<float> up = random_floats(generator, n, -60.0f, 60.0f);

  std::vector<float> silu_values = gate;
  silu_inplace(silu_values.data(), static_cast<int64_t>(n));
  std::vector<float> sigmoid_values = gate;
  sigmoid_inplace(sigmoid_values.data(), static_cast<int64_t>(n));
  std::vector<float> swiglu_values(n);
  swiglu(gate.data(), up.data(), swiglu_values.data(), static_cast<int64_t>(n));
  std::vector<float> situ_values(n);
  const double beta = 4.0;
  const double beta_linear = 25.0;
  situ_glu(gate.data(), up.data(), situ_values.data(), static_cast<int64_t>(n), 4.0f, 25.0f);

  for (size_t i = 0; i < n; ++i) {
    const double g = gate[i];
    const double u = up[i];
    const double expected_silu = g * reference_sigmoid(g);
    ASSERT_NEAR(silu_values[i], expected_silu, 2e-6 * (1.0 + std::fabs(expected_silu)));
    ASSERT_NEAR(sigmoid_values[i], reference_sigmoid(g), 2e-7);
    ASSERT_NEAR(swiglu_values[i], expected_silu * u, 2e-6 * (1.0 + std::fabs(expected_silu * u)));
    const double expected_situ =
        beta * std::tanh(g / beta) * reference_sigmoid(g) * beta_linear * std::tanh(u / beta_linear);
    ASSERT_NEAR(situ_values[i], expected_situ, 2e-6 * (1.0 + std::fabs(expected_situ)));
  }
}

}  // namespace
}  // namespace deltaserve::kernels::cpu
