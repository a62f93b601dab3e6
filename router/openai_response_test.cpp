#include "router/openai_response.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "router/router_test_util.hpp"

namespace deltaserve::router {
namespace {

using nlohmann::json;

ResponseContext context(Endpoint endpoint, bool logprobs = false, bool include_usage = false) {
  ResponseContext c;
  c.endpoint = endpoint;
  c.id = endpoint == Endpoint::kChatCompletions ? "chatcmpl-1" : "cmpl-1";
  c.created = 1700000000;
  c.model = "tiny";
  c.logprobs = logprobs;
  c.include_usage = include_usage;
  c.tokenizer = &testing::tiny_tokenizer();
  return c;
}

GenerationChunk chunk(std::string text, std::vector<int32_t> tokens, std::optional<std::string> finish = {}) {
  GenerationChunk c;
  c.text = std::move(text);
  c.tokens = std::move(tokens);
  c.finish_reason = std::move(finish);
  return c;
}

TEST(OpenAiResponseTest, ModelsList) {
  const auto body = json::parse(models_json({"tiny", 4096, 1700000000, "deltaserve"}));
  EXPECT_EQ(body["object"], "list");
  ASSERT_EQ(body["data"].size(), 1u);
  EXPECT_EQ(body["data"][0]["id"], "tiny");
  EXPECT_EQ(body["data"][0]["object"], "model");
  EXPECT_EQ(body["data"][0]["created"], 1700000000);
  EXPECT_EQ(body["data"][0]["owned_by"], "deltaserve");
}

TEST(OpenAiResponseTest, ChatStreamEventsExactBytes) {
  StreamFormatter formatter(context(Endpoint::kChatCompletions), 1);
  EXPECT_EQ(
      formatter.on_chunk(0, chunk("Hi", {1})),
      "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"tiny\","
      "\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"Hi\"},\"logprobs\":null,"
      "\"finish_reason\":null}]}\n\n");
  EXPECT_EQ(formatter.on_chunk(0, chunk("", {2})), "");  // nothing to say (text held back)
  EXPECT_EQ(
      formatter.on_chunk(0, chunk("", {}, "length")),
      "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"tiny\","
      "\"choices\":[{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"length\"}]}\n\n");
  EXPECT_EQ(StreamFormatter::done_event(), "data: [DONE]\n\n");
}

TEST(OpenAiResponseTest, UsageChunkAndNullUsage) {
  StreamFormatter formatter(context(Endpoint::kCompletions, false, true), 1);
  const std::string event = formatter.on_chunk(0, chunk("x", {1}));
  const auto parsed = json::parse(event.substr(6));
  EXPECT_TRUE(parsed.contains("usage"));
  EXPECT_TRUE(parsed["usage"].is_null());
  EXPECT_EQ(parsed["object"], "text_completion");
  EXPECT_EQ(parsed["choices"][0]["text"], "x");
  const auto usage = json::parse(formatter.usage_event({10, 3, 4}).substr(6));
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["total_tokens"], 13);
  EXPECT_EQ(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 4);
}

TEST(OpenAiResponseTest, LogprobShapes) {
  const auto& tok = testing::tiny_tokenizer();
  const int32_t a = tok.encode("a", tokenizer::SpecialTokens::kNone)[0];
  const int32_t b = tok.encode("b", tokenizer::SpecialTokens::kNone)[0];
  ChoiceOutput choice{"ab", {{a, -0.5f, {{a, -0.5f}, {b, -1.5f}}}, {b, -0.25f, {{b, -0.25f}, {a, -2.0f}}}}, "stop"};
  const auto chat = json::parse(completion_json(context(Endpoint::kChatCompletions, true), {&choice, 1}, {5, 2, 0}));
  const auto& content = chat["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 2u);
  EXPECT_EQ(content[0]["token"], "a");
  EXPECT_EQ(content[0]["logprob"], -0.5);
  EXPECT_EQ(content[0]["bytes"], json::array({97}));
  ASSERT_EQ(content[0]["top_logprobs"].size(), 2u);
  EXPECT_EQ(content[0]["top_logprobs"][1]["token"], "b");
  EXPECT_EQ(chat["choices"][0]["message"]["content"], "ab");
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_EQ(chat["usage"]["total_tokens"], 7);

  const auto text = json::parse(completion_json(context(Endpoint::kCompletions, true), {&choice, 1}, {5, 2, 0}));
  const auto& logprobs = text["choices"][0]["logprobs"];
  EXPECT_EQ(logprobs["tokens"], json::array({"a", "b"}));
  EXPECT_EQ(logprobs["token_logprobs"], json::array({-0.5, -0.25}));
  EXPECT_EQ(logprobs["top_logprobs"][0]["b"], -1.5);
  EXPECT_EQ(logprobs["text_offset"], json::array({0, 1}));
  EXPECT_EQ(text["choices"][0]["text"], "ab");
  EXPECT_EQ(text["object"], "text_completion");
}

}  // namespace
}  // namespace deltaserve::router
