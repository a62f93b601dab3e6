#include "kernels/cpu/basic_ops.hpp"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/thread_pool.hpp"

namespace deltaserve::kernels::cpu {
namespace {

// Independent partial sums per dot product: a fixed-width lane array lets GCC vectorise the
// reduction without -ffast-math (no reassociation is needed).
constexpr int64_t kLanes = 8;
// Register tile of linear: kTileRows rows of x times kTileOutputs rows of W.
constexpr int64_t kTileRows = 4;
constexpr int64_t kTileOutputs = 4;
// Bytes of W one output block keeps hot in cache while every row tile of a range streams over it.
constexpr int64_t kWeightBlockBytes = 256 * 1024;
// Below this many rows, linear splits output features across threads; above, rows.
constexpr int64_t kRowParallelMinRows = 32;
// Elementwise ops: items per parallel range.
constexpr int64_t kElementwiseGrain = 1 << 15;

// y[r, o] (+)= dot(x[r, :], weight[o, :]) for r in [0, kRows), o in [0, kOutputs).
template <int64_t kRows, int64_t kOutputs>
void linear_tile(const float* x, const float* weight, float* y, int64_t in, int64_t out, bool accumulate) {
  float acc[kRows][kOutputs][kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= in; c += kLanes) {
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t o = 0; o < kOutputs; ++o) {
        for (int64_t l = 0; l < kLanes; ++l) acc[r][o][l] += x[r * in + c + l] * weight[o * in + c + l];
      }
    }
  }
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t o = 0; o < kOutputs; ++o) {
      float sum = 0.0f;
      for (int64_t l = 0; l < kLanes; ++l) sum += acc[r][o][l];
      for (int64_t tail = c; tail < in; ++tail) sum += x[r * in + tail] * weight[o * in + tail];
      float& target = y[r * out + o];
      target = accumulate ? target + sum : sum;
    }
  }
}

// Rows [row_begin, row_end) × outputs [out_begin, out_end) of linear.
void linear_block(const float* x, const float* weight, float* y, int64_t row_begin, int64_t row_end, int64_t out_begin,
                  int64_t out_end, int64_t in, int64_t out, bool accumulate) {
  const int64_t bytes_per_output = std::max<int64_t>(in, 1) * static_cast<int64_t>(sizeof(float));
  const int64_t out_block =
      std::max<int64_t>(kTileOutputs, kWeightBlockBytes / bytes_per_output / kTileOutputs * kTileOutputs);
  for (int64_t block_begin = out_begin; block_begin < out_end; block_begin += out_block) {
    const int64_t block_end = std::min(out_end, block_begin + out_block);
    for (int64_t r = row_begin; r < row_end;) {
      const bool full_rows = r + kTileRows <= row_end;
      const int64_t tile_rows = full_rows ? kTileRows : 1;
      for (int64_t o = block_begin; o < block_end;) {
        const float* x_tile = x + r * in;
        const float* w_tile = weight + o * in;
        float* y_tile = y + r * out + o;
        const bool full_outputs = o + kTileOutputs <= block_end;
        if (full_rows && full_outputs) {
          linear_tile<kTileRows, kTileOutputs>(x_tile, w_tile, y_tile, in, out, accumulate);
        } else if (full_rows) {
          linear_tile<kTileRows, 1>(x_tile, w_tile, y_tile, in, out, accumulate);
        } else if (full_outputs) {
          linear_tile<1, kTileOutputs>(x_tile, w_tile, y_tile, in, out, accumulate);
        } else {
          linear_tile<1, 1>(x_tile, w_tile, y_tile, in, out, accumulate);
        }
        o += full_outputs ? kTileOutputs : 1;
      }
      r += tile_rows;
    }
  }
}

// Calls fn(i) for i in [0, n) in parallel ranges.
template <typename Fn>
void parallel_elementwise(int64_t n, const Fn& fn) {
  parallel_for(0, n, kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) fn(i);
  });
}

}  // namespace

float sigmoid(float x) {
  if (x >= 0.0f) return 1.0f / (1.0f + std::exp(-x));
  const float e = std::exp(x);
  return e / (1.0f + e);
}

float softplus(float x) {
  return std::max(x, 0.0f) + std::log1p(std::exp(-std::fabs(x)));
}

float silu(float x) {
  return x * sigmoid(x);
}

float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  }
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += acc[l];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void rms_norm(const float* x, const float* weight, float* y, int64_t rows, int64_t dim, float eps) {
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(dim, 1));
  parallel_for(0, rows, grain, [&](int64_t row_begin, int64_t row_end) {
    for (int64_t r = row_begin; r < row_end; ++r) {
      const float* x_row = x + r * dim;
      float* y_row = y + r * dim;
      double sum_squares = 0.0;
      for (int64_t d = 0; d < dim; ++d) sum_squares += static_cast<double>(x_row[d]) * x_row[d];
      const float inverse_rms =
          static_cast<float>(1.0 / std::sqrt(sum_squares / static_cast<double>(std::max<int64_t>(dim, 1)) + eps));
      for (int64_t d = 0; d < dim; ++d) {
        y_row[d] = x_row[d] * inverse_rms * (weight != nullptr ? weight[d] : 1.0f);
      }
    }
  });
}

void linear(const float* x, const float* weight, float* y, int64_t rows, int64_t in, int64_t out, bool accumulate) {
  if (rows <= 0 || out <= 0) return;
  if (rows >= kRowParallelMinRows) {
    // Each range keeps whole row tiles; W is streamed once per range, one cache-sized block at a time.
    parallel_for(0, (rows + kTileRows - 1) / kTileRows, 2, [&](int64_t tile_begin, int64_t tile_end) {
      linear_block(x, weight, y, tile_begin * kTileRows, std::min(rows, tile_end * kTileRows), 0, out, in, out,
                   accumulate);
    });
  } else {
    // Few rows (decode): split output features; each range reads its slice of W once.
    parallel_for(0, (out + kTileOutputs - 1) / kTileOutputs, 16, [&](int64_t tile_begin, int64_t tile_end) {
      linear_block(x, weight, y, 0, rows, tile_begin * kTileOutputs, std::min(out, tile_end * kTileOutputs), in, out,
                   accumulate);
    });
  }
}

void silu_inplace(float* x, int64_t n) {
  parallel_elementwise(n, [&](int64_t i) { x[i] = silu(x[i]); });
}

void sigmoid_inplace(float* x, int64_t n) {
  parallel_elementwise(n, [&](int64_t i) { x[i] = sigmoid(x[i]); });
}

void swiglu(const float* gate, const float* up, float* out, int64_t n) {
  parallel_elementwise(n, [&](int64_t i) { out[i] = silu(gate[i]) * up[i]; });
}

void situ_glu(const float* gate, const float* up, float* out, int64_t n, float beta, float beta_linear) {
  parallel_elementwise(n, [&](int64_t i) {
    const float g = gate[i];
    const float activated_gate = beta * std::tanh(g / beta) * sigmoid(g);
    const float bounded_up = beta_linear * std::tanh(up[i] / beta_linear);
    out[i] = activated_gate * bounded_up;
  });
}

}  // namespace deltaserve::kernels::cpu
