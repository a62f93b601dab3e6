// open_model's device parsing and checks (no GPU needed: the GPU paths are covered by engine/cuda's GPU tests),
// the progress printer, and BackendCapacity's arithmetic.
#include "engine/open_model.hpp"

#include <sstream>

#include <gtest/gtest.h>

#include "common/temp_dir.hpp"
#include "engine/make_model.hpp"

namespace deltaserve::engine {
namespace {

TEST(OpenModel, ParsesDevices) {
  EXPECT_EQ(*parse_device("cpu"), -1);
  EXPECT_EQ(*parse_device("cuda"), 0);
  EXPECT_EQ(*parse_device("cuda:0"), 0);
  EXPECT_EQ(*parse_device("cuda:7"), 7);
  EXPECT_EQ(*parse_device("cuda:123"), 123);
  for (const char* bad : {"", "gpu", "CUDA", "cuda:", "cuda:x", "cuda:1x", "cuda:-1", "cuda:1234", "cpu:0"}) {
    auto parsed = parse_device(bad);
    EXPECT_FALSE(parsed.is_ok()) << bad;
    if (!parsed.is_ok()) EXPECT_NE(parsed.status().message().find("device"), std::string::npos) << bad;
  }
}

TEST(OpenModel, CpuLoadsTheCheckpointAndRejectsGpuOnlyOptions) {
  TempDir dir;
  auto config = preset_config("tiny-linear");
  ASSERT_TRUE(config.is_ok());
  ASSERT_TRUE(write_random_model(*config, dir.path(), {}).is_ok());
  auto model = open_model(dir.path(), DeviceOptions{});
  ASSERT_TRUE(model.is_ok()) << model.status().to_string();
  EXPECT_EQ((*model)->device_name(), "cpu");
  EXPECT_EQ((*model)->backend(), nullptr);
  EXPECT_EQ((*model)->config().num_layers, config->num_layers);

  DeviceOptions random;
  random.random_weights = true;
  auto rejected = open_model(dir.path(), random);
  ASSERT_FALSE(rejected.is_ok());
  EXPECT_NE(rejected.status().message().find("random_weights"), std::string::npos);

  // The GPU-pass switches would be ignored on the CPU: refused, naming the option.
  DeviceOptions no_graphs;
  no_graphs.cuda_graphs = false;
  auto graphs_rejected = open_model(dir.path(), no_graphs);
  ASSERT_FALSE(graphs_rejected.is_ok());
  EXPECT_NE(graphs_rejected.status().message().find("cuda_graphs"), std::string::npos);
  DeviceOptions profile;
  profile.cuda_profile = true;
  auto profile_rejected = open_model(dir.path(), profile);
  ASSERT_FALSE(profile_rejected.is_ok());
  EXPECT_NE(profile_rejected.status().message().find("cuda_profile"), std::string::npos);

  DeviceOptions bad_device;
  bad_device.device = "tpu";
  EXPECT_EQ(open_model(dir.path(), bad_device).status().code(), StatusCode::kInvalidArgument);
}

TEST(OpenModel, GpuSettingsAreCheckedBeforeAnyDeviceIsTouched) {
  TempDir dir;  // nothing in it: the checks come first
  DeviceOptions options;
  options.device = "cuda";
  options.gpu_memory_fraction = 0.0;
  auto fraction = open_model(dir.path(), options);
  ASSERT_FALSE(fraction.is_ok());
  EXPECT_NE(fraction.status().message().find("gpu_memory_fraction"), std::string::npos);
  options.gpu_memory_fraction = 0.5;
  options.gpu_max_batch_tokens = 0;
  EXPECT_NE(open_model(dir.path(), options).status().message().find("gpu_max_batch_tokens"), std::string::npos);
  options.gpu_max_batch_tokens = 64;
  options.gpu_max_requests = -1;
  EXPECT_NE(open_model(dir.path(), options).status().message().find("gpu_max_requests"), std::string::npos);
}

TEST(OpenModel, ProgressPrinterWritesEachTenthOnce) {
  std::ostringstream out;
  auto progress = progress_printer(out, "loading");
  for (int64_t done = 0; done <= 1000; done += 50) progress(done, 1000);
  const std::string text = out.str();
  EXPECT_NE(text.find("loading:  10% (0.0 of 0.0 GB)"), std::string::npos) << text;
  EXPECT_NE(text.find("loading: 100%"), std::string::npos) << text;
  size_t lines = 0;
  for (char c : text) lines += c == '\n';
  EXPECT_EQ(lines, 10u) << text;  // 10%, 20%, ..., 100%: no repeats, nothing for 0%
  progress(5, 0);                 // an empty total prints nothing
  EXPECT_EQ(out.str(), text);
}

TEST(BackendCapacity, RequestsThatFitTakeTheScarcerOfSlotsAndPages) {
  BackendCapacity c;
  c.state_slots = 100;
  c.cache_pages = 1000;
  c.page_tokens = 64;
  EXPECT_EQ(c.requests_that_fit(32768), 1);  // 512 pages each
  EXPECT_EQ(c.requests_that_fit(640), 100);  // 10 pages each: slots are scarcer
  EXPECT_EQ(c.requests_that_fit(0), 100);    // every request takes at least one page
  EXPECT_EQ(c.requests_that_fit(65), 100);   // 2 pages each: 500 by pages
  EXPECT_EQ(c.requests_that_fit(-1), 0);
  c.cache_pages = 0;  // no MLA pages (a model without MLA): slots decide
  EXPECT_EQ(c.requests_that_fit(1 << 20), 100);
  c.state_slots = 0;  // the CPU: no fixed pools
  EXPECT_EQ(c.requests_that_fit(100), 0);
}

}  // namespace
}  // namespace deltaserve::engine
