// RequestState's device residency bookkeeping, with a fake device that records what it was asked to copy.
#include "engine/request_state.hpp"

#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "engine/make_model.hpp"

namespace deltaserve::engine {
namespace {

struct Call {
  bool full = false, kda = false;
  int64_t mla_begin = 0, mla_end = 0;
};

// A "device" whose contents are: KDA values 7, MLA row t filled with t + 1.
class FakeResidency final : public DeviceResidency {
 public:
  explicit FakeResidency(std::vector<Call>* calls) : calls_(calls) {}
  Status download(RequestState& state) const override {
    calls_->push_back({true, true, 0, state.num_tokens()});
    write_kda(state);
    write_rows(state, 0, state.num_tokens());
    return Status::ok();
  }
  Status download_part(RequestState& state, bool kda, int64_t begin, int64_t end) const override {
    calls_->push_back({false, kda, begin, end});
    if (kda) write_kda(state);
    write_rows(state, begin, end);
    return Status::ok();
  }

 private:
  static void write_kda(RequestState& state) {
    for (auto& layer : state.kda) std::fill(layer.recurrent.begin(), layer.recurrent.end(), 7.0f);
  }
  static void write_rows(RequestState& state, int64_t begin, int64_t end) {
    for (auto& cache : state.mla) {
      auto& rows = cache.mutable_data();
      if (static_cast<int64_t>(rows.size()) < end * cache.width())
        rows.resize(static_cast<size_t>(end * cache.width()));
      for (int64_t t = begin; t < end; ++t) {
        std::fill_n(rows.begin() + t * cache.width(), cache.width(), static_cast<float>(t + 1));
      }
    }
  }
  std::vector<Call>* calls_;
};

RequestState device_state(std::vector<Call>* calls, int64_t tokens) {
  auto config = preset_config("tiny-linear");
  EXPECT_TRUE(config.is_ok());
  RequestState state(*config);
  state.attach_residency(std::make_unique<FakeResidency>(calls));
  state.set_host_stale(false);  // uploaded: the host holds everything (nothing yet)
  state.advance(tokens);        // a device pass of `tokens` tokens
  state.set_host_stale(true);
  return state;
}

TEST(RequestStateResidency, PartialSyncsCopyOnlyWhatIsMissing) {
  std::vector<Call> calls;
  RequestState state = device_state(&calls, 10);
  EXPECT_TRUE(state.host_stale());
  ASSERT_TRUE(state.sync_host_part(false, 4).is_ok());  // rows of tokens 0..3, no KDA
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_FALSE(calls[0].full);
  EXPECT_FALSE(calls[0].kda);
  EXPECT_EQ(calls[0].mla_begin, 0);
  EXPECT_EQ(calls[0].mla_end, 4);
  ASSERT_TRUE(state.sync_host_part(false, 4).is_ok());  // already there: no copy
  EXPECT_EQ(calls.size(), 1u);
  ASSERT_TRUE(state.sync_host_part(true, 25).is_ok());  // clamped to 10 tokens; KDA too
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_TRUE(calls[1].kda);
  EXPECT_EQ(calls[1].mla_begin, 4);
  EXPECT_EQ(calls[1].mla_end, 10);
  EXPECT_FALSE(state.host_stale());
  ASSERT_TRUE(state.sync_host().is_ok());  // nothing left to copy
  EXPECT_EQ(calls.size(), 2u);
  EXPECT_EQ(state.mla[0].data()[9 * state.mla[0].width()], 10.0f);
  EXPECT_EQ(state.kda[0].recurrent[0], 7.0f);

  // Another device pass of 3 tokens: KDA stale again, rows 0..9 still good, 10..12 missing.
  state.advance(3);
  state.set_host_stale(true);
  ASSERT_TRUE(state.sync_host_part(false, 13).is_ok());
  EXPECT_EQ(calls.back().mla_begin, 10);
  EXPECT_EQ(calls.back().mla_end, 13);
  EXPECT_TRUE(state.host_stale());  // the KDA part is still the device's
  ASSERT_TRUE(state.sync_host().is_ok());
  EXPECT_TRUE(calls.back().full);
  EXPECT_FALSE(state.host_stale());
}

TEST(RequestStateResidency, CopiesCarryTheContentsNotTheResidency) {
  std::vector<Call> calls;
  const RequestState state = device_state(&calls, 5);
  RequestState copy = state;  // syncs the source first
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_TRUE(calls[0].full);
  EXPECT_EQ(copy.residency(), nullptr);
  EXPECT_FALSE(copy.host_stale());
  EXPECT_EQ(copy.num_tokens(), 5);
  EXPECT_EQ(copy.mla[1].data()[4 * copy.mla[1].width()], 5.0f);
  EXPECT_TRUE(copy.same_contents(state));
}

TEST(RequestStateResidencyDeathTest, ReadingStalePartsStopsTheProcess) {
  std::vector<Call> calls;
  RequestState state = device_state(&calls, 6);
  ASSERT_TRUE(state.sync_host_part(false, 6).is_ok());
  state.expect_host_mla_rows(6, "test reader");  // rows are there
  EXPECT_DEATH(state.expect_host_kda_current("test reader"), "test reader read the KDA states");
  EXPECT_DEATH(state.expect_host_current("test reader"), "test reader read the caches");
  state.drop_device();  // the host copy is now the only one
  state.expect_host_current("test reader");
  state.expect_host_kda_current("test reader");
}

}  // namespace
}  // namespace deltaserve::engine
