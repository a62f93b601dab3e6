// GPU sampling (kernels/cuda/ops/sampling.hpp) vs engine::Sampler (the CPU reference) driven with the same uniform
// draw, ctest label gpu. Here rather than beside the kernel because its reference lives in engine/.
// Checked: greedy = argmax with ties to the lowest id; NaN = -inf, +inf = FLT_MAX, all-masked rows uniform;
// logprobs vs a float64 log-softmax (|err| <= 2e-6 + 1e-6 |ref|); top_logprobs ids exactly, values as logprobs;
// non-greedy choices equal the CPU sampler's on distinct logits (where the CPU inverts its CDF over a sorted
// order: no top-p, or top-p with top-k <= 64); with top-p over more candidates the token lies in the nucleus;
// rows with their own top_logprobs counts.
#include "kernels/cuda/ops/sampling.hpp"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "engine/sampler.hpp"
#include "kernels/cuda/tests/ops_test_util.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

constexpr double kLogprobAtol = 2e-6, kLogprobRtol = 1e-6;

struct RowParams {
  float temperature = 0.0f;
  float top_p = 1.0f;
  int32_t top_k = 0;
  uint64_t seed = 0;
};

struct GpuResult {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<int32_t> top_ids;
  std::vector<float> top_values;
};

// The draw engine::Sampler uses on its first call.
double first_draw(uint64_t seed) {
  engine::Xoshiro256StarStar rng(seed);
  return rng.next_unit();
}

// row_top_logprobs: each row's own count (SampleParams::row_top_logprobs), or empty for top_logprobs everywhere.
GpuResult run_gpu(const std::vector<float>& logits, int64_t vocab, const std::vector<RowParams>& rows, int top_logprobs,
                  bool graph = false, const std::vector<int32_t>& row_top_logprobs = {}) {
  const int n = static_cast<int>(rows.size());
  std::vector<float> temperature(n), top_p(n);
  std::vector<int32_t> top_k(n);
  std::vector<double> uniform(n);
  for (int r = 0; r < n; ++r) {
    temperature[r] = rows[r].temperature;
    top_p[r] = rows[r].top_p;
    top_k[r] = rows[r].top_k;
    uniform[r] = first_draw(rows[r].seed);
  }
  DeviceBuffer<float> logits_d(logits.size()), temperature_d(n), top_p_d(n), logprobs_d(n);
  DeviceBuffer<float> top_values_d(std::max(n * top_logprobs, 1));
  DeviceBuffer<int32_t> top_k_d(n), tokens_d(n), top_ids_d(std::max(n * top_logprobs, 1));
  DeviceBuffer<double> uniform_d(n);
  DeviceBuffer<int32_t> row_top_d(std::max<size_t>(row_top_logprobs.size(), 1));
  if (!row_top_logprobs.empty()) row_top_d.upload(row_top_logprobs);
  const size_t workspace_bytes = sample_workspace_bytes(n, vocab);
  DeviceBuffer<char> workspace_d(workspace_bytes);
  logits_d.upload(logits);
  temperature_d.upload(temperature);
  top_p_d.upload(top_p);
  top_k_d.upload(top_k);
  uniform_d.upload(uniform);
  tokens_d.upload(std::vector<int32_t>(n, -7));
  logprobs_d.upload(nan_vector(n));
  top_ids_d.upload(std::vector<int32_t>(static_cast<size_t>(std::max(n * top_logprobs, 1)), -7));
  SampleParams p;
  p.rows = n;
  p.vocab = vocab;
  p.logits = logits_d.get();
  p.temperature = temperature_d.get();
  p.top_p = top_p_d.get();
  p.top_k = top_k_d.get();
  p.uniform = uniform_d.get();
  p.top_logprobs = top_logprobs;
  p.row_top_logprobs = row_top_logprobs.empty() ? nullptr : row_top_d.get();
  p.tokens = tokens_d.get();
  p.logprobs = logprobs_d.get();
  p.top_ids = top_logprobs > 0 ? top_ids_d.get() : nullptr;
  p.top_values = top_logprobs > 0 ? top_values_d.get() : nullptr;
  p.workspace = workspace_d.get();
  p.workspace_bytes = workspace_bytes;
  Stream stream;
  GpuResult result;
  if (graph) {
    cudaGraph_t captured;
    cudaGraphExec_t exec;
    EXPECT_EQ(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal), cudaSuccess);
    const Status status = sample(p, stream.get());
    EXPECT_EQ(cudaStreamEndCapture(stream.get(), &captured), cudaSuccess);
    EXPECT_TRUE(status.is_ok()) << status.to_string();
    EXPECT_EQ(cudaGraphInstantiate(&exec, captured, 0), cudaSuccess);
    for (int replay = 0; replay < 2; ++replay) EXPECT_EQ(cudaGraphLaunch(exec, stream.get()), cudaSuccess);
    stream.sync();
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(captured);
  } else {
    const Status status = sample(p, stream.get());
    EXPECT_TRUE(status.is_ok()) << status.to_string();
    stream.sync();
  }
  result.tokens = tokens_d.download();
  result.logprobs = logprobs_d.download();
  if (top_logprobs > 0) {
    result.top_ids = top_ids_d.download();
    result.top_values = top_values_d.download();
  }
  return result;
}

engine::SampledToken run_cpu(const float* logits, int64_t vocab, const RowParams& row, int top_logprobs) {
  engine::SamplingParams params;
  params.temperature = row.temperature;
  params.top_p = row.top_p;
  params.top_k = row.top_k;
  params.seed = row.seed;
  params.top_logprobs = top_logprobs;
  engine::Sampler sampler(params);
  return sampler.sample(std::span<const float>(logits, static_cast<size_t>(vocab)));
}

// Log-softmax in float64 under the sampler's NaN / inf rules.
std::vector<double> log_softmax(const float* logits, int64_t vocab) {
  std::vector<double> values(vocab);
  double max_value = -INFINITY;
  for (int64_t i = 0; i < vocab; ++i) {
    double v = logits[i];
    if (std::isnan(v)) v = -INFINITY;
    if (v == INFINITY) v = FLT_MAX;
    values[i] = v;
    max_value = std::max(max_value, v);
  }
  if (max_value == -INFINITY) {
    std::fill(values.begin(), values.end(), 0.0);
    max_value = 0.0;
  }
  double sum = 0.0;
  for (double v : values) sum += std::exp(v - max_value);
  for (double& v : values) v = v - max_value - std::log(sum);
  return values;
}

bool close(double actual, double expected) {
  if (std::isinf(expected)) return actual == expected;
  return std::fabs(actual - expected) <= kLogprobAtol + kLogprobRtol * std::fabs(expected);
}

std::string describe(const RowParams& row) {
  return "T=" + std::to_string(row.temperature) + " top_p=" + std::to_string(row.top_p) +
         " top_k=" + std::to_string(row.top_k) + " seed=" + std::to_string(row.seed) +
         " draw=" + std::to_string(first_draw(row.seed));
}

// Compares every row with the CPU sampler: token (when `exact_token`), logprob vs float64, top_logprobs.
void compare_rows(const std::vector<float>& logits, int64_t vocab, const std::vector<RowParams>& rows, int top_logprobs,
                  const GpuResult& got, bool exact_token = true, const std::vector<int32_t>& row_top_logprobs = {}) {
  for (size_t r = 0; r < rows.size(); ++r) {
    SCOPED_TRACE("row " + std::to_string(r) + " " + describe(rows[r]));
    const float* row_logits = logits.data() + r * vocab;
    const int row_top = row_top_logprobs.empty() ? top_logprobs : row_top_logprobs[r];
    const engine::SampledToken cpu = run_cpu(row_logits, vocab, rows[r], row_top);
    const std::vector<double> reference = log_softmax(row_logits, vocab);
    const int32_t token = got.tokens[r];
    ASSERT_TRUE(token >= 0 && token < vocab) << "token " << token << " out of range";
    if (exact_token) {
      EXPECT_EQ(token, cpu.token) << "GPU token differs from engine::Sampler";
    }
    EXPECT_TRUE(close(got.logprobs[r], reference[token]))
        << "logprob of token " << token << ": GPU " << got.logprobs[r] << ", float64 " << reference[token];
    EXPECT_TRUE(close(got.logprobs[r], cpu.logprob) || token != cpu.token)
        << "logprob: GPU " << got.logprobs[r] << ", CPU " << cpu.logprob;
    const int num_top = static_cast<int>(std::min<int64_t>(row_top, vocab));
    ASSERT_EQ(cpu.top.size(), static_cast<size_t>(num_top));
    for (int i = 0; i < num_top; ++i) {
      const int32_t id = got.top_ids[r * top_logprobs + i];
      const float value = got.top_values[r * top_logprobs + i];
      EXPECT_EQ(id, cpu.top[i].token) << "top_logprobs entry " << i;
      EXPECT_TRUE(close(value, cpu.top[i].logprob))
          << "top_logprobs entry " << i << ": GPU " << value << ", CPU " << cpu.top[i].logprob;
    }
    for (int i = num_top; i < top_logprobs; ++i) {
      EXPECT_EQ(got.top_ids[r * top_logprobs + i], -1) << "top_logprobs entry " << i << " past the vocabulary or row";
      EXPECT_EQ(got.top_values[r * top_logprobs + i], -INFINITY) << "top_logprobs entry " << i;
    }
  }
}

// Distinct logits 0.01 apart, shuffled, spanning [-span/2, span/2).
std::vector<float> distinct_logits(std::mt19937& rng, int64_t vocab, float span) {
  std::vector<float> row(vocab);
  for (int64_t i = 0; i < vocab; ++i) row[i] = span * (static_cast<float>(i) / static_cast<float>(vocab) - 0.5f);
  std::shuffle(row.begin(), row.end(), rng);
  return row;
}

TEST(SamplingGpu, GreedyTiesAndNanInfRules) {
  const int64_t vocab = 37;
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  std::mt19937 rng(1);
  std::vector<std::vector<float>> cases;
  std::vector<float> ties = normal_vector(rng, vocab);
  ties[5] = ties[20] = ties[33] = 9.0f;  // argmax tie: 5
  cases.push_back(ties);
  std::vector<float> infs = normal_vector(rng, vocab);
  infs[0] = nan, infs[3] = inf, infs[9] = inf, infs[4] = -inf;  // +inf = FLT_MAX: tie 3 / 9 -> 3
  cases.push_back(infs);
  cases.push_back(std::vector<float>(vocab, nan));  // all masked: uniform, greedy 0
  std::vector<float> masked(vocab, -inf);
  masked[7] = nan;
  cases.push_back(masked);
  std::vector<float> single(vocab, -inf);
  single[30] = -3.0f;  // the only finite value: logprob 0
  cases.push_back(single);
  std::vector<float> negative_zero(vocab, -1.0f);
  negative_zero[11] = -0.0f, negative_zero[4] = 0.0f;  // -0 == +0: tie -> 4
  cases.push_back(negative_zero);

  // Each case greedy, sampled without filters, with top-k 3 and with top-k 3 + top-p 0.5.
  std::vector<float> logits;
  std::vector<RowParams> rows;
  uint64_t seed = 10;
  for (const auto& c : cases) {
    for (const RowParams& row : {RowParams{0.0f, 1.0f, 0, 0}, RowParams{1.0f, 1.0f, 0, 0}, RowParams{0.8f, 1.0f, 3, 0},
                                 RowParams{1.2f, 0.5f, 3, 0}}) {
      logits.insert(logits.end(), c.begin(), c.end());
      rows.push_back(row);
      rows.back().seed = seed++;
    }
  }
  const GpuResult got = run_gpu(logits, vocab, rows, 6);
  compare_rows(logits, vocab, rows, 6, got);
  EXPECT_EQ(got.tokens[0], 5);
  EXPECT_EQ(got.tokens[4], 3);
  EXPECT_EQ(got.tokens[8], 0);
  EXPECT_EQ(got.tokens[12], 0);
  EXPECT_EQ(got.tokens[16], 30);
  EXPECT_EQ(got.tokens[20], 4);
  EXPECT_NEAR(got.logprobs[8], -std::log(static_cast<double>(vocab)), 1e-6);
  EXPECT_NEAR(got.logprobs[16], 0.0, 1e-7);
}

TEST(SamplingGpu, LogprobsMatchFloat64AndCpuSampler) {
  const int64_t vocab = 1000;
  std::mt19937 rng(2);
  std::vector<float> logits;
  std::vector<RowParams> rows;
  const float temperatures[] = {0.0f, 0.3f, 0.7f, 1.0f, 1.5f, 2.0f};
  const int32_t top_ks[] = {0, 1, 5, 50, 64, 2000, 1000};
  const float top_ps[] = {1.0f, 0.95f, 0.5f, 0.1f};
  for (int r = 0; r < 96; ++r) {
    const std::vector<float> row = distinct_logits(rng, vocab, 12.0f);
    logits.insert(logits.end(), row.begin(), row.end());
    RowParams params{temperatures[r % 6], top_ps[(r / 6) % 4], top_ks[(r / 3) % 7], static_cast<uint64_t>(1000 + r)};
    // The CPU inverts its CDF over a sorted nucleus only when at most 64 candidates remain (see the file comment).
    if (params.top_p < 1.0f && (params.top_k == 0 || params.top_k > 64)) params.top_k = 64;
    rows.push_back(params);
  }
  const GpuResult got = run_gpu(logits, vocab, rows, 7);
  compare_rows(logits, vocab, rows, 7, got);
}

TEST(SamplingGpu, TopPOverManyCandidatesStaysInNucleus) {
  const int64_t vocab = 5000;
  std::mt19937 rng(3);
  std::vector<float> logits;
  std::vector<RowParams> rows;
  for (int r = 0; r < 16; ++r) {
    const std::vector<float> row = distinct_logits(rng, vocab, 6.0f);
    logits.insert(logits.end(), row.begin(), row.end());
    rows.push_back({1.0f, r % 2 == 0 ? 0.9f : 0.5f, r % 4 == 1 ? 2000 : 0, static_cast<uint64_t>(77 + r)});
  }
  const GpuResult got = run_gpu(logits, vocab, rows, 0);
  int same_as_cpu = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    SCOPED_TRACE("row " + std::to_string(r) + " " + describe(rows[r]));
    const float* row_logits = logits.data() + r * vocab;
    // The nucleus in float64: sorted by value desc, fewest with mass >= top_p of the top-k mass.
    std::vector<int32_t> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return row_logits[a] > row_logits[b]; });
    const int64_t k = rows[r].top_k > 0 ? std::min<int64_t>(rows[r].top_k, vocab) : vocab;
    const double max_value = row_logits[order[0]];
    double mass = 0.0;
    for (int64_t i = 0; i < k; ++i) mass += std::exp(row_logits[order[i]] - max_value);
    double cumulative = 0.0;
    int64_t nucleus = k;
    for (int64_t i = 0; i < k; ++i) {
      cumulative += std::exp(row_logits[order[i]] - max_value);
      if (cumulative >= mass * rows[r].top_p) {
        nucleus = i + 1;
        break;
      }
    }
    const auto rank = std::find(order.begin(), order.end(), got.tokens[r]) - order.begin();
    EXPECT_LT(rank, nucleus) << "token " << got.tokens[r] << " outside the nucleus of " << nucleus;
    same_as_cpu += run_cpu(row_logits, vocab, rows[r], 0).token == got.tokens[r];
  }
  std::printf(
      "[ sampling ] top-p over many candidates: %d of %zu rows pick the CPU's token (the CPU walks its\n"
      "             nucleus in quickselect order, the GPU in sorted order)\n",
      same_as_cpu, rows.size());
}

TEST(SamplingGpu, RealVocabularyManyRows) {
  const int64_t vocab = 163840;
  const int num_rows = 256;
  std::mt19937 rng(4);
  std::vector<float> logits = normal_vector(rng, static_cast<size_t>(num_rows) * vocab, 0.0f, 2.5f);
  std::vector<RowParams> rows;
  const RowParams kinds[] = {{0.0f, 1.0f, 0, 0},    {1.0f, 1.0f, 0, 0},  {0.8f, 1.0f, 40, 0}, {1.0f, 0.8f, 20, 0},
                             {0.7f, 1.0f, 1000, 0}, {0.6f, 0.9f, 64, 0}, {1.3f, 1.0f, 1, 0}};
  for (int r = 0; r < num_rows; ++r) {
    rows.push_back(kinds[r % 7]);
    rows.back().seed = 5000 + r;
  }
  const GpuResult got = run_gpu(logits, vocab, rows, 20);
  compare_rows(logits, vocab, rows, 20, got);
}

TEST(SamplingGpu, MixedRowsWithoutTopLogprobs) {
  // Rows that need no sorted order (greedy, unfiltered sampling) get empty sort segments next to rows that do.
  const int64_t vocab = 2000;
  std::mt19937 rng(6);
  std::vector<float> logits;
  std::vector<RowParams> rows;
  const RowParams kinds[] = {{0.0f, 1.0f, 0, 0},  {1.0f, 1.0f, 0, 0}, {0.9f, 1.0f, 10, 0},
                             {1.1f, 0.7f, 48, 0}, {0.5f, 1.0f, 1, 0}, {1.0f, 1.0f, 5000, 0}};
  for (int r = 0; r < 24; ++r) {
    const std::vector<float> row = distinct_logits(rng, vocab, 9.0f);
    logits.insert(logits.end(), row.begin(), row.end());
    rows.push_back(kinds[r % 6]);
    rows.back().seed = 300 + r;
  }
  const GpuResult got = run_gpu(logits, vocab, rows, 0);
  compare_rows(logits, vocab, rows, 0, got);
}

// Rows with their own top_logprobs counts (row_top_logprobs) in one launch: 0 (greedy or unfiltered rows are then
// not sorted at all), fewer than the stride, the stride; next to filtering rows. Choices and alternatives as the CPU
// sampler's with that row's count; the entries past a row's count are -1 / -inf.
TEST(SamplingGpu, PerRowTopLogprobs) {
  const int64_t vocab = 4000;
  const int stride = 8;
  std::mt19937 rng(7);
  std::vector<float> logits;
  std::vector<RowParams> rows;
  std::vector<int32_t> counts;
  const RowParams kinds[] = {
      {0.0f, 1.0f, 0, 0}, {1.0f, 1.0f, 0, 0}, {0.9f, 1.0f, 30, 0}, {1.1f, 0.8f, 64, 0}, {0.7f, 1.0f, 1, 0}};
  const int32_t row_counts[] = {0, 3, 8, 0, 1, 8, 0};
  for (int r = 0; r < 35; ++r) {
    const std::vector<float> row = distinct_logits(rng, vocab, 11.0f);
    logits.insert(logits.end(), row.begin(), row.end());
    rows.push_back(kinds[r % 5]);
    rows.back().seed = 600 + r;
    counts.push_back(row_counts[r % 7]);
  }
  for (bool graph : {false, true}) {
    SCOPED_TRACE(graph ? "graph" : "eager");
    const GpuResult got = run_gpu(logits, vocab, rows, stride, graph, counts);
    compare_rows(logits, vocab, rows, stride, got, true, counts);
  }
  // A small vocabulary: a row's count past it still ends at the vocabulary.
  const std::vector<float> small = {0.5f, 2.0f, -1.0f, 1.0f, 1.0f, 1.0f};
  const std::vector<RowParams> small_rows = {{0.0f, 1.0f, 0, 1}, {1.0f, 1.0f, 0, 2}};
  const std::vector<int32_t> small_counts = {5, 2};
  compare_rows(small, 3, small_rows, 5, run_gpu(small, 3, small_rows, 5, false, small_counts), true, small_counts);
}

TEST(SamplingGpu, GraphCaptureReplays) {
  const int64_t vocab = 3000;
  std::mt19937 rng(5);
  std::vector<float> logits;
  std::vector<RowParams> rows;
  for (int r = 0; r < 8; ++r) {
    const std::vector<float> row = distinct_logits(rng, vocab, 10.0f);
    logits.insert(logits.end(), row.begin(), row.end());
    rows.push_back({r % 2 == 0 ? 0.0f : 0.9f, 1.0f, r % 3 == 0 ? 0 : 32, static_cast<uint64_t>(900 + r)});
  }
  const GpuResult got = run_gpu(logits, vocab, rows, 3, /*graph=*/true);
  compare_rows(logits, vocab, rows, 3, got);
}

TEST(SamplingGpu, VocabSmallerThanTopLogprobs) {
  const int64_t vocab = 3;
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 1.0f, 1.0f, 1.0f};
  const std::vector<RowParams> rows = {{0.0f, 1.0f, 0, 1}, {1.0f, 1.0f, 0, 2}};
  const GpuResult got = run_gpu(logits, vocab, rows, 5);
  compare_rows(logits, vocab, rows, 5, got);
}

TEST(SamplingGpu, RejectsBadArguments) {
  auto invalid = [](const Status& s) { return s.code() == StatusCode::kInvalidArgument; };
  EXPECT_EQ(sample_workspace_bytes(0, 100), 0u);
  EXPECT_GT(sample_workspace_bytes(4, 163840), 4u * 163840u * 16u);
  alignas(256) static char fake_storage[512];
  SampleParams good;
  good.rows = 2;
  good.vocab = 10;
  good.logits = reinterpret_cast<const float*>(fake_storage);
  good.temperature = good.top_p = good.logits;
  good.top_k = reinterpret_cast<const int32_t*>(fake_storage);
  good.uniform = reinterpret_cast<const double*>(fake_storage);
  good.tokens = reinterpret_cast<int32_t*>(fake_storage);
  good.logprobs = reinterpret_cast<float*>(fake_storage);
  good.workspace = fake_storage;
  good.workspace_bytes = sample_workspace_bytes(2, 10);
  auto with = [&](auto edit) {
    SampleParams p = good;
    edit(p);
    return p;
  };
  EXPECT_TRUE(invalid(sample(with([](SampleParams& p) { p.rows = -1; }), nullptr)));
  EXPECT_TRUE(invalid(sample(with([](SampleParams& p) { p.vocab = 0; }), nullptr)));
  EXPECT_TRUE(invalid(sample(with([](SampleParams& p) { p.top_logprobs = 21; }), nullptr)));
  EXPECT_TRUE(invalid(sample(with([](SampleParams& p) { p.workspace_bytes -= 1; }), nullptr)));
  EXPECT_TRUE(invalid(sample(with([](SampleParams& p) { p.workspace = fake_storage + 16; }), nullptr)));
  EXPECT_TRUE(invalid(sample(with([](SampleParams& p) { p.logits = nullptr; }), nullptr)));
  EXPECT_TRUE(invalid(sample(with([](SampleParams& p) { p.uniform = nullptr; }), nullptr)));
  EXPECT_TRUE(invalid(sample(with([](SampleParams& p) { p.tokens = nullptr; }), nullptr)));
  EXPECT_TRUE(invalid(sample(with([](SampleParams& p) { p.vocab = int64_t{1} << 31; }), nullptr)));
  EXPECT_TRUE(sample(with([](SampleParams& p) { p.rows = 0; }), nullptr).is_ok());
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
