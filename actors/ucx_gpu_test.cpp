// GPU workers handing request states off in GPU memory (ctest label gpu). In one process: a router Node, a
// prefill Node and a decode Node, each worker Node with its own UCX context and its own GPU model of the same
// checkpoint (UCX_TLS sm,self,cuda_copy,cuda_ipc). Needs a UCX that registers CUDA memory (PyPI's libucx-cu13
// first on LD_LIBRARY_PATH): without one the workers fall back to host memory, which the test reports as a
// failure, not a skip.
//   - greedy output through router -> prefill -> decode equals the colocated GPU loop token for token, for Kimi
//     Linear's and K3's layouts at real head sizes (KDA head 128, MLA 512 + 64); the decode worker's engine
//     verified exactly the bytes of the device spans (not a host encoding); every transfer resource is released;
//   - a long prompt sent again hits the prefill worker's prefix cache and gives the cold output.
#include <gtest/gtest.h>

#include "actors/node.hpp"
#include "actors/test_model.hpp"
#include "actors/test_sink.hpp"
#include "common/temp_dir.hpp"
#include "engine/open_model.hpp"
#include "engine/test_models.hpp"
#include "tokenizer/tokenizer_writer.hpp"

namespace deltaserve::actors {
namespace {

using namespace std::chrono_literals;
using testing::CollectingSink;
using testing::wait_until;

struct GpuModelDir {
  TempDir dir;
  engine::ModelConfig config;
};

// A random checkpoint of `preset` at real head sizes, with the tiny tokenizer (token-id prompts only).
std::unique_ptr<GpuModelDir> write_model(const std::string& preset) {
  auto out = std::make_unique<GpuModelDir>();
  auto config = engine::preset_config(preset);
  EXPECT_TRUE(config.is_ok()) << config.status().to_string();
  if (!config.is_ok()) return nullptr;
  out->config = engine::testing::real_head_sizes(*config);
  engine::MakeModelOptions make;
  make.seed = 29;
  make.dtype = engine::DType::kBF16;
  EXPECT_TRUE(engine::write_random_model(out->config, out->dir.path(), make).is_ok());
  EXPECT_TRUE(tokenizer::write_tiny_tokenizer(out->dir.path(), engine::kTinyVocabBase, 7).is_ok());
  return out;
}

std::shared_ptr<const engine::Model> open_gpu(const GpuModelDir& dir) {
  engine::DeviceOptions device;
  device.device = "cuda:0";
  device.gpu_memory_fraction = 0.2;  // three models share the GPU
  device.gpu_max_requests = 16;
  auto model = engine::open_model(dir.dir.path(), device);
  EXPECT_TRUE(model.is_ok()) << model.status().to_string();
  return model.is_ok() ? std::shared_ptr<const engine::Model>(std::move(model).value()) : nullptr;
}

std::vector<int32_t> prompt_of(int64_t n, uint32_t seed) {
  return engine::testing::random_tokens(n, engine::kTinyVocabBase, seed);
}

class UcxGpuHandoffTest : public ::testing::TestWithParam<std::string> {};

TEST_P(UcxGpuHandoffTest, RouterPrefillDecodeInGpuMemoryEqualsColocated) {
  auto dir = write_model(GetParam());
  ASSERT_TRUE(dir);
  auto reference_model = open_gpu(*dir);
  ASSERT_TRUE(reference_model);
  auto tok = tokenizer::Tokenizer::load(dir->dir.path());
  ASSERT_TRUE(tok.is_ok());
  auto tokenizer = std::make_shared<const tokenizer::Tokenizer>(std::move(tok).value());

  auto router_node = Node::start(testing::remote_router_options());
  ASSERT_TRUE(router_node.is_ok()) << router_node.status().to_string();
  router::InferenceService& service = *(*router_node)->service();
  NodeOptions worker;
  worker.tokenizer = tokenizer;
  worker.max_batch = 4;
  worker.prefill_chunk = 256;
  worker.heartbeat_interval = 200ms;
  worker.transport = "ucx";
  worker.ucx_tls = "sm,self,cuda_copy,cuda_ipc";
  worker.join = {{"127.0.0.1", (*router_node)->cluster_port()}};
  worker.join_timeout = 30s;
  worker.cache_page_tokens = 1024;
  worker.role = NodeRole::kPrefill;
  worker.model = open_gpu(*dir);
  ASSERT_TRUE(worker.model);
  auto prefill = Node::start(worker);
  ASSERT_TRUE(prefill.is_ok()) << prefill.status().to_string();
  worker.role = NodeRole::kDecode;
  worker.model = open_gpu(*dir);
  ASSERT_TRUE(worker.model);
  auto decode = Node::start(worker);
  ASSERT_TRUE(decode.is_ok()) << decode.status().to_string();
  ASSERT_TRUE(wait_until([&] { return service.status().ready; }, 30s));

  // Short prompts, one ending inside a page, one longer than a prefill chunk; then a long prompt twice (the second
  // a prefix hit).
  const std::vector<std::vector<int32_t>> prompts{
      prompt_of(10, 1), {42}, prompt_of(300, 2), prompt_of(1100, 3), prompt_of(1100, 3)};
  constexpr int64_t kTokens = 12;
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto sink = std::make_shared<CollectingSink>();
    service.submit(testing::greedy_request("g" + std::to_string(i), prompts[i], kTokens), sink);
    ASSERT_TRUE(sink->wait_final(60s)) << "request " << i;
    const auto last = sink->last();
    ASSERT_TRUE(last.error.is_ok()) << last.error.to_string();
    EXPECT_EQ(sink->tokens(), testing::reference_greedy(*reference_model, prompts[i], kTokens, 256))
        << GetParam() << " request " << i;
  }
  const NodeWorkerStats sent = (*prefill)->worker_stats();
  const NodeWorkerStats received = (*decode)->worker_stats();
  EXPECT_EQ(sent.handoffs, static_cast<int64_t>(prompts.size()));
  EXPECT_EQ(received.handoffs, static_cast<int64_t>(prompts.size()));
  EXPECT_EQ(received.rejected, 0);
  EXPECT_GT(sent.cached_tokens, 0) << "the repeated prompt should hit the prefix cache";
  // handoff_bytes counts the device spans' bytes on the device path; the receiving engine verified exactly those.
  EXPECT_TRUE(wait_until([&] { return (*decode)->transfer_stats().transfers == 0; }, 10s));
  EXPECT_EQ((*decode)->transfer_stats().bytes_received, static_cast<uint64_t>(sent.handoff_bytes));
  EXPECT_EQ((*prefill)->transfer_stats().bytes_sent, static_cast<uint64_t>(sent.handoff_bytes));
  EXPECT_TRUE(wait_until(
      [&] {
        const NodeTransferStats d = (*decode)->transfer_stats(), p = (*prefill)->transfer_stats();
        return d.transfers_pending == 0 && d.requests_in_flight == 0 && p.transfers == 0 && p.requests_in_flight == 0;
      },
      10s));
  EXPECT_EQ((*router_node)->router_stats().retried, 0);
  (*decode)->shutdown();
  (*prefill)->shutdown();
  (*router_node)->shutdown();
}

INSTANTIATE_TEST_SUITE_P(Layouts, UcxGpuHandoffTest, ::testing::Values("tiny-linear", "tiny-k3"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param == "tiny-linear" ? std::string("KimiLinear") : std::string("K3");
                         });

}  // namespace
}  // namespace deltaserve::actors
