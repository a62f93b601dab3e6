// The `deltaserve` binary run as a user runs it: a real process, flags, exit codes, stdout/stderr.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include "engine/model.hpp"
#include "tokenizer/chat_template.hpp"
#include "tokenizer/tiktoken_tokenizer.hpp"

namespace {

namespace fs = std::filesystem;

struct RunResult {
  int exit_code = -1;
  std::string out, err;
};

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("ds_cli_test_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Runs the binary with `args` (shell-quoted by the caller), DELTASERVE_HOME in the test's temp dir.
  RunResult run(const std::string& args) {
    const fs::path out = dir_ / "stdout", err = dir_ / "stderr";
    const std::string command = "DELTASERVE_HOME='" + (dir_ / "home").string() + "' DELTASERVE_THREADS=2 '" +
                                DELTASERVE_BINARY + "' " + args + " >'" + out.string() + "' 2>'" + err.string() + "'";
    const int status = std::system(command.c_str());
    RunResult r;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::stringstream o, e;
    o << std::ifstream(out).rdbuf();
    e << std::ifstream(err).rdbuf();
    r.out = o.str();
    r.err = e.str();
    return r;
  }

  fs::path dir_;
};

const std::string kConfigs = std::string(DELTASERVE_SOURCE_DIR) + "/tests/data/configs/";

TEST_F(CliTest, InspectKimiLinearConfigReportsStateAndCacheSizes) {
  RunResult r = run("inspect-model '" + kConfigs + "kimi-linear-48b-a3b.config.json'");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("40 MiB"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("8,064 B/token"), std::string::npos) << r.out;
}

TEST_F(CliTest, InspectK3ConfigReportsStateAndCacheSizes) {
  RunResult r = run("inspect-model '" + kConfigs + "kimi-k3-shape.config.json'");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("414 MiB"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("27,648 B/token"), std::string::npos) << r.out;
}

TEST_F(CliTest, InspectMissingFileFailsWithItsName) {
  RunResult r = run("inspect-model '" + (dir_ / "nope.json").string() + "'");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("nope.json"), std::string::npos) << r.err;
}

// make-model → generate --logprobs: the CLI's greedy tokens equal an in-process greedy decode of the
// same checkpoint, and each reported logprob equals the log-softmax computed here.
TEST_F(CliTest, GenerateGreedyMatchesInProcessEngine) {
  const fs::path model_dir = dir_ / "k3";
  RunResult made =
      run("make-model --preset tiny-k3 --dtype fp8 --shard-bytes 100000 --seed 3 --out '" + model_dir.string() + "'");
  ASSERT_EQ(made.exit_code, 0) << made.err;
  ASSERT_TRUE(fs::exists(model_dir / "model.safetensors.index.json"));
  ASSERT_TRUE(fs::exists(model_dir / "tiktoken.model"));

  RunResult r = run("generate --model '" + model_dir.string() +
                    "' --chat --prompt 'Hello there' --max-tokens 6 --ignore-eos --logprobs 3");
  ASSERT_EQ(r.exit_code, 0) << r.err;

  auto model = deltaserve::engine::Model::load(model_dir);
  ASSERT_TRUE(model.is_ok()) << model.status().to_string();
  auto tok = deltaserve::tokenizer::Tokenizer::load(model_dir);
  ASSERT_TRUE(tok.is_ok());
  const deltaserve::tokenizer::ChatMessage message{"user", "Hello there", std::nullopt};
  auto text = deltaserve::tokenizer::apply_chat_template({&message, 1}, true);
  ASSERT_TRUE(text.is_ok());
  const auto prompt = tok->encode(*text, deltaserve::tokenizer::SpecialTokens::kAll);
  auto state = (*model)->new_state();
  auto logits = (*model)->prefill(state, prompt);
  ASSERT_TRUE(logits.is_ok());
  std::vector<float> current = *logits;

  std::istringstream lines(r.out);
  std::string line;
  int count = 0;
  while (std::getline(lines, line)) {
    const auto entry = nlohmann::json::parse(line);
    const int32_t expected = static_cast<int32_t>(std::max_element(current.begin(), current.end()) - current.begin());
    double max = *std::max_element(current.begin(), current.end()), sum = 0;
    for (float v : current) sum += std::exp(static_cast<double>(v) - max);
    const double logprob = static_cast<double>(current[static_cast<size_t>(expected)]) - max - std::log(sum);
    EXPECT_EQ(entry.at("index").get<int>(), count);
    EXPECT_EQ(entry.at("token_id").get<int32_t>(), expected) << "token " << count;
    EXPECT_NEAR(entry.at("logprob").get<double>(), logprob, 1e-4);
    ASSERT_EQ(entry.at("top_logprobs").size(), 3u);
    EXPECT_EQ(entry.at("top_logprobs")[0].at("logprob").get<double>(), entry.at("logprob").get<double>());
    ++count;
    std::vector<std::vector<float>> next;
    deltaserve::engine::SequenceInput input{&state, {&expected, 1}, false};
    ASSERT_TRUE((*model)->forward({&input, 1}, next).is_ok());
    current = next[0];
  }
  EXPECT_EQ(count, 6);
}

TEST_F(CliTest, GenerateUsesBuiltinModelAndIsDeterministic) {
  RunResult a = run("generate --prompt 'The quick brown fox' --max-tokens 12 --temperature 0.8 --seed 5 --ignore-eos");
  ASSERT_EQ(a.exit_code, 0) << a.err;
  EXPECT_TRUE(fs::exists(dir_ / "home" / "models"));
  RunResult b = run("generate --prompt 'The quick brown fox' --max-tokens 12 --temperature 0.8 --seed 5 --ignore-eos");
  ASSERT_EQ(b.exit_code, 0) << b.err;
  EXPECT_EQ(a.out, b.out);
  EXPECT_NE(a.err.find("generated 12 tokens"), std::string::npos) << a.err;
}

TEST_F(CliTest, GenerateRejectsBadFlagsAndBadModels) {
  RunResult r = run("generate --prompt x --temperature 9");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("temperature"), std::string::npos) << r.err;

  fs::create_directories(dir_ / "broken");
  std::ofstream(dir_ / "broken" / "config.json") << "{not json";
  r = run("generate --model '" + (dir_ / "broken").string() + "' --prompt x");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("config.json"), std::string::npos) << r.err;
}

TEST_F(CliTest, TokenizeMatchesTheLibraryAndRoundTrips) {
  const std::string text = "Hello, мир! 你好 <|im_end|>";
  RunResult plain = run("tokenize '" + text + "'");
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  RunResult specials = run("tokenize --specials '" + text + "'");
  ASSERT_EQ(specials.exit_code, 0) << specials.err;
  auto dir = deltaserve::tokenizer::Tokenizer::load(dir_ / "home" / "models" / "tiny-linear-v1");
  ASSERT_TRUE(dir.is_ok()) << dir.status().to_string();
  const auto ids = nlohmann::json::parse(plain.out).get<std::vector<int32_t>>();
  EXPECT_EQ(ids, dir->encode(text, deltaserve::tokenizer::SpecialTokens::kNone));
  EXPECT_EQ(dir->decode(ids), text);
  const auto special_ids = nlohmann::json::parse(specials.out).get<std::vector<int32_t>>();
  EXPECT_EQ(special_ids.back(), *dir->special_token_id("<|im_end|>"));
  EXPECT_LT(special_ids.size(), ids.size());
}

}  // namespace
