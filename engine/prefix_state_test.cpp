// Resuming from a prefix-cache hit against the cold run: a state rebuilt from a KDA checkpoint and MLA
// page rows must continue exactly (bitwise) like the state that computed the prefix itself.
#include "engine/prefix_state.hpp"

#include <gtest/gtest.h>

#include "engine/model.hpp"
#include "engine/test_models.hpp"

namespace deltaserve::engine {
namespace {

std::unique_ptr<Model> tiny_model(const std::string& preset) {
  return testing::make_model(preset);
}
using testing::random_tokens;

class PrefixResume : public ::testing::TestWithParam<std::string> {};

TEST_P(PrefixResume, ResumedStateContinuesBitwiseLikeTheColdRun) {
  const auto model = tiny_model(GetParam());
  ASSERT_NE(model, nullptr);
  const ModelConfig& config = model->config();
  const auto prompt = random_tokens(3 * 512 + 37, config.vocab_size, 11);

  // Cold: the whole prompt in 512-token chunks.
  RequestState cold = model->new_state();
  auto cold_logits = model->prefill(cold, prompt, 512);
  ASSERT_TRUE(cold_logits.is_ok());

  for (int64_t boundary : {512, 1024}) {
    // What the cache would hold after another request computed the prefix: a checkpoint and page rows.
    RequestState donor = model->new_state();
    ASSERT_TRUE(model->prefill(donor, std::span(prompt).first(static_cast<size_t>(boundary)), 512).is_ok());
    const auto checkpoint = encode_kda_checkpoint(config, donor);
    kvstore::PagePool pool({1024, 4, mla_page_row_values(config)});
    kvstore::PageTable pages;
    ASSERT_TRUE(pages.append(pool, gather_mla_page_rows(config, donor, 0, boundary)).is_ok());

    RequestState resumed = model->new_state();
    ASSERT_TRUE(model->prefill(resumed, std::span(prompt).first(100), 512).is_ok());  // dirty slot: reset by resume
    Status status = resume_from_prefix(config, checkpoint, pages, pool, boundary, resumed);
    ASSERT_TRUE(status.is_ok()) << status.to_string();
    EXPECT_TRUE(resumed.same_contents(donor));
    auto logits = model->prefill(resumed, std::span(prompt).subspan(static_cast<size_t>(boundary)), 512);
    ASSERT_TRUE(logits.is_ok());
    EXPECT_EQ(*logits, *cold_logits) << "boundary " << boundary;
    EXPECT_TRUE(resumed.same_contents(cold)) << "boundary " << boundary;
    pages.release(pool);
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, PrefixResume, ::testing::Values("tiny-linear", "tiny-k3"));

TEST(PrefixResume, DamagedOrForeignCheckpointsAreRejected) {
  const auto model = tiny_model("tiny-linear");
  ASSERT_NE(model, nullptr);
  const ModelConfig& config = model->config();
  RequestState donor = model->new_state();
  const auto prompt = random_tokens(512, config.vocab_size, 5);
  ASSERT_TRUE(model->prefill(donor, prompt, 512).is_ok());
  const auto good = encode_kda_checkpoint(config, donor);
  kvstore::PagePool pool({1024, 2, mla_page_row_values(config)});
  kvstore::PageTable pages;
  ASSERT_TRUE(pages.append(pool, gather_mla_page_rows(config, donor, 0, 512)).is_ok());

  auto expect_rejected = [&](std::vector<std::byte> bytes, int64_t tokens, const std::string& what) {
    RequestState state = model->new_state();
    Status status = resume_from_prefix(config, bytes, pages, pool, tokens, state);
    EXPECT_FALSE(status.is_ok()) << what;
    EXPECT_NE(status.message().find(what), std::string::npos) << status.to_string();
    EXPECT_TRUE(state.same_contents(model->new_state())) << "state must be reset after " << what;
  };
  for (size_t at : {size_t{0}, size_t{40}, good.size() / 2, good.size() - 1}) {
    auto flipped = good;
    flipped[at] ^= std::byte{0x10};
    expect_rejected(flipped, 512, at == 0 ? "bad magic" : "checksum mismatch");
  }
  expect_rejected(std::vector<std::byte>(good.begin(), good.end() - 9), 512, "size");
  expect_rejected(good, 256, "position 512");

  const auto other = tiny_model("tiny-k3");
  ASSERT_NE(other, nullptr);
  RequestState foreign = other->new_state();
  ASSERT_TRUE(other->prefill(foreign, random_tokens(512, other->config().vocab_size, 5), 512).is_ok());
  expect_rejected(encode_kda_checkpoint(other->config(), foreign), 512, "another model");
  pages.release(pool);
}

}  // namespace
}  // namespace deltaserve::engine
