#include "router/openai_request.hpp"

#include <limits>

#include <nlohmann/json.hpp>

#include "router/prompt_encoding.hpp"
#include "tokenizer/utf8.hpp"

namespace deltaserve::router {
namespace {

using nlohmann::json;

const char* type_name(const json& value) {
  switch (value.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return "an integer";
    case json::value_t::number_float:
      return "a decimal";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    default:
      return "an unsupported value";
  }
}

ApiError type_error(const std::string& param, const char* expected, const json& got) {
  return ApiError::invalid(
      param, "Invalid type for '" + param + "': expected " + expected + ", but got " + type_name(got) + " instead.",
      "invalid_type");
}

ApiError range_error(const std::string& param, const std::string& what) {
  return ApiError::invalid(param, "Invalid value for '" + param + "': " + what, "invalid_value");
}

// The field's value, or nullptr when absent or null (null = the default, as OpenAI treats it).
const json* field(const json& object, const char* name) {
  const auto it = object.find(name);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<ApiError> read_bool(const json& object, const char* name, bool& out) {
  const json* value = field(object, name);
  if (value == nullptr) return std::nullopt;
  if (!value->is_boolean()) return type_error(name, "a boolean", *value);
  out = value->get<bool>();
  return std::nullopt;
}

std::optional<ApiError> read_number(const json& object, const char* name, double& out, bool& present) {
  present = false;
  const json* value = field(object, name);
  if (value == nullptr) return std::nullopt;
  if (!value->is_number()) return type_error(name, "a number", *value);
  out = value->get<double>();
  present = true;
  return std::nullopt;
}

// An integer in [min, max]; decimals and out-of-range integers are rejected.
std::optional<ApiError> read_integer(const json& object, const char* name, int64_t min, int64_t max,
                                     std::optional<int64_t>& out) {
  const json* value = field(object, name);
  if (value == nullptr) return std::nullopt;
  if (!value->is_number_integer()) return type_error(name, "an integer", *value);
  if (value->is_number_unsigned() && value->get<uint64_t>() > static_cast<uint64_t>(max)) {
    return range_error(name, "must be at most " + std::to_string(max) + ".");
  }
  const int64_t v = value->get<int64_t>();
  if (v < min) return range_error(name, "must be at least " + std::to_string(min) + ".");
  if (v > max) return range_error(name, "must be at most " + std::to_string(max) + ".");
  out = v;
  return std::nullopt;
}

std::optional<ApiError> parse_messages(const json& body, OpenAiRequest& out) {
  const auto it = body.find("messages");
  if (it == body.end()) return ApiError::invalid("messages", "Missing required parameter: 'messages'.");
  if (!it->is_array()) return type_error("messages", "an array", *it);
  if (it->empty()) return range_error("messages", "must contain at least one message.");
  for (size_t i = 0; i < it->size(); ++i) {
    const json& message = (*it)[i];
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!message.is_object()) return type_error(at, "an object", message);
    tokenizer::ChatMessage parsed;
    const auto role = message.find("role");
    if (role == message.end()) return ApiError::invalid(at + ".role", "Missing required parameter: '" + at + ".role'.");
    if (!role->is_string()) return type_error(at + ".role", "a string", *role);
    parsed.role = role->get<std::string>();
    if (parsed.role != "system" && parsed.role != "user" && parsed.role != "assistant" && parsed.role != "tool") {
      return range_error(at + ".role", "must be one of 'system', 'user', 'assistant', 'tool'.");
    }
    const auto content = message.find("content");
    if (content == message.end() || content->is_null()) {
      if (parsed.role != "assistant") {
        return ApiError::invalid(at + ".content", "Missing required parameter: '" + at + ".content'.");
      }
    } else if (content->is_string()) {
      parsed.content = content->get<std::string>();
    } else if (content->is_array()) {
      for (size_t j = 0; j < content->size(); ++j) {
        const json& part = (*content)[j];
        const std::string part_at = at + ".content[" + std::to_string(j) + "]";
        if (!part.is_object()) return type_error(part_at, "an object", part);
        const auto type = part.find("type");
        if (type == part.end() || !type->is_string()) {
          return ApiError::invalid(part_at + ".type", "Missing required parameter: '" + part_at + ".type'.");
        }
        if (type->get_ref<const std::string&>() != "text") {
          return range_error(part_at + ".type", "only 'text' content parts are supported.");
        }
        const auto text = part.find("text");
        if (text == part.end() || !text->is_string()) {
          return type_error(part_at + ".text", "a string", text == part.end() ? json() : *text);
        }
        parsed.content += text->get_ref<const std::string&>();
      }
    } else {
      return type_error(at + ".content", "a string or an array of content parts", *content);
    }
    const auto name = message.find("name");
    if (name != message.end() && !name->is_null()) {
      if (!name->is_string()) return type_error(at + ".name", "a string", *name);
      parsed.name = name->get<std::string>();
    }
    out.messages.push_back(std::move(parsed));
  }
  return std::nullopt;
}

std::optional<ApiError> parse_token_list(const json& list, const std::string& param, std::vector<int32_t>& out) {
  if (list.empty()) return range_error(param, "the prompt must not be empty.");
  out.reserve(list.size());
  for (const json& id : list) {
    if (!id.is_number_integer()) return type_error(param, "a list of token ids (integers)", id);
    if (id.is_number_unsigned() ? id.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())
                                : (id.get<int64_t>() < 0 || id.get<int64_t>() > std::numeric_limits<int32_t>::max())) {
      return range_error(param, "token id " + id.dump() + " is out of range.");
    }
    out.push_back(static_cast<int32_t>(id.get<int64_t>()));
  }
  return std::nullopt;
}

std::optional<ApiError> parse_prompt(const json& body, OpenAiRequest& out) {
  const auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) return ApiError::invalid("prompt", "Missing required parameter: 'prompt'.");
  if (it->is_string()) {
    out.prompt_text = it->get<std::string>();
    return std::nullopt;
  }
  if (!it->is_array()) return type_error("prompt", "a string, a list of strings or a list of token ids", *it);
  if (it->empty()) return range_error("prompt", "the prompt must not be empty.");
  const json& first = it->front();
  if (first.is_string() || first.is_array()) {
    if (it->size() != 1)
      return range_error("prompt", "only one prompt per request is supported; send one request each.");
    if (first.is_string()) {
      out.prompt_text = first.get<std::string>();
      return std::nullopt;
    }
    std::vector<int32_t> ids;
    if (auto error = parse_token_list(first, "prompt", ids)) return error;
    out.prompt_tokens = std::move(ids);
    return std::nullopt;
  }
  std::vector<int32_t> ids;
  if (auto error = parse_token_list(*it, "prompt", ids)) return error;
  out.prompt_tokens = std::move(ids);
  return std::nullopt;
}

std::optional<ApiError> parse_stop(const json& body, OpenAiRequest& out) {
  const json* stop = field(body, "stop");
  if (stop == nullptr) return std::nullopt;
  if (stop->is_string()) {
    out.stop.push_back(stop->get<std::string>());
    return std::nullopt;
  }
  if (!stop->is_array()) return type_error("stop", "a string or a list of strings", *stop);
  if (stop->size() > static_cast<size_t>(kMaxStopStrings)) {
    return range_error("stop", "at most " + std::to_string(kMaxStopStrings) + " stop sequences are allowed.");
  }
  for (const json& s : *stop) {
    if (!s.is_string()) return type_error("stop", "a string or a list of strings", s);
    out.stop.push_back(s.get<std::string>());
  }
  return std::nullopt;
}

std::optional<ApiError> parse_body(Endpoint endpoint, const json& body, OpenAiRequest& out) {
  const bool chat = endpoint == Endpoint::kChatCompletions;
  out = OpenAiRequest();
  out.endpoint = endpoint;

  const auto model = body.find("model");
  if (model == body.end() || model->is_null())
    return ApiError::invalid("model", "Missing required parameter: 'model'.");
  if (!model->is_string()) return type_error("model", "a string", *model);
  out.model = model->get<std::string>();

  if (chat) {
    if (auto error = parse_messages(body, out)) return error;
  } else {
    if (auto error = parse_prompt(body, out)) return error;
  }

  std::optional<int64_t> integer;
  if (auto error = read_integer(body, "n", 1, kMaxChoices, integer)) return error;
  if (integer) out.n = static_cast<int>(*integer);
  if (auto error = read_bool(body, "stream", out.stream)) return error;
  if (const json* options = field(body, "stream_options")) {
    if (!options->is_object()) return type_error("stream_options", "an object", *options);
    if (const json* usage = field(*options, "include_usage")) {
      if (!usage->is_boolean()) return type_error("stream_options.include_usage", "a boolean", *usage);
      out.include_usage = usage->get<bool>();
    }
  }
  if (auto error = parse_stop(body, out)) return error;

  constexpr int64_t kMaxInt = std::numeric_limits<int64_t>::max();
  integer.reset();
  if (auto error = read_integer(body, "max_tokens", 1, kMaxInt, integer)) return error;
  out.max_tokens = integer;
  if (chat) {
    integer.reset();
    if (auto error = read_integer(body, "max_completion_tokens", 1, kMaxInt, integer)) return error;
    if (integer) out.max_tokens = integer;
  }

  double number = 0;
  bool present = false;
  if (auto error = read_number(body, "temperature", number, present)) return error;
  if (present) {
    if (!(number >= 0.0 && number <= 2.0)) return range_error("temperature", "must be between 0 and 2.");
    out.temperature = static_cast<float>(number);
  }
  if (auto error = read_number(body, "top_p", number, present)) return error;
  if (present) {
    if (!(number > 0.0 && number <= 1.0)) return range_error("top_p", "must be greater than 0 and at most 1.");
    out.top_p = static_cast<float>(number);
  }
  integer.reset();
  if (auto error = read_integer(body, "top_k", -1, std::numeric_limits<int32_t>::max(), integer)) return error;
  if (integer) out.top_k = *integer < 0 ? 0 : static_cast<int32_t>(*integer);
  integer.reset();
  if (const json* seed = field(body, "seed")) {
    if (!seed->is_number_integer()) return type_error("seed", "an integer", *seed);
    out.seed = seed->is_number_unsigned() ? seed->get<uint64_t>() : static_cast<uint64_t>(seed->get<int64_t>());
  }

  for (const char* penalty : {"presence_penalty", "frequency_penalty"}) {
    if (auto error = read_number(body, penalty, number, present)) return error;
    if (present && number != 0.0) {
      return range_error(penalty, "only 0 is supported (penalties are not implemented).");
    }
  }

  if (chat) {
    if (auto error = read_bool(body, "logprobs", out.logprobs)) return error;
    integer.reset();
    if (auto error = read_integer(body, "top_logprobs", 0, kMaxChatTopLogprobs, integer)) return error;
    if (integer) {
      if (!out.logprobs && *integer > 0) {
        return ApiError::invalid("top_logprobs", "'top_logprobs' requires 'logprobs' to be true.", "invalid_value");
      }
      out.top_logprobs = static_cast<int32_t>(*integer);
    }
  } else {
    integer.reset();
    if (auto error = read_integer(body, "logprobs", 0, kMaxCompletionLogprobs, integer)) return error;
    if (integer) {
      out.logprobs = true;
      out.top_logprobs = static_cast<int32_t>(*integer);
    }
    bool echo = false;
    if (auto error = read_bool(body, "echo", echo)) return error;
    if (echo) return range_error("echo", "echo is not supported.");
    if (const json* suffix = field(body, "suffix")) {
      if (!suffix->is_string()) return type_error("suffix", "a string", *suffix);
      if (!suffix->get_ref<const std::string&>().empty()) return range_error("suffix", "suffix is not supported.");
    }
    integer.reset();
    if (auto error = read_integer(body, "best_of", 1, kMaxChoices, integer)) return error;
    if (integer && *integer != out.n && *integer != 1) {
      return range_error("best_of", "best_of other than 1 or n is not supported.");
    }
  }
  if (const json* bias = field(body, "logit_bias")) {
    if (!bias->is_object()) return type_error("logit_bias", "an object", *bias);
    if (!bias->empty()) return range_error("logit_bias", "logit_bias is not supported.");
  }
  if (const json* user = field(body, "user")) {
    if (!user->is_string()) return type_error("user", "a string", *user);
    out.user = user->get<std::string>();
  }
  if (auto error = read_bool(body, "ignore_eos", out.ignore_eos)) return error;
  return std::nullopt;
}

}  // namespace

std::optional<ApiError> parse_openai_request(Endpoint endpoint, std::string_view body, OpenAiRequest& out) {
  if (!tokenizer::is_valid_utf8(body)) {
    return ApiError::invalid("", "The request body is not valid UTF-8.", "invalid_utf8");
  }
  const json doc = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    return ApiError::invalid("",
                             "We could not parse the JSON body of your request. (HINT: This likely means you aren't "
                             "using your HTTP library correctly. The OpenAI API expects a JSON payload.)",
                             "invalid_json");
  }
  if (!doc.is_object()) return ApiError::invalid("", "The request body must be a JSON object.", "invalid_json");
  return parse_body(endpoint, doc, out);
}

std::optional<ApiError> plan_generation(const OpenAiRequest& request, const tokenizer::Tokenizer& tokenizer,
                                        const PlanOptions& options, GenerationPlan& out) {
  const bool chat = request.endpoint == Endpoint::kChatCompletions;
  const std::string prompt_param = chat ? "messages" : "prompt";
  out = GenerationPlan();
  if (chat) {
    auto ids = encode_chat_prompt(tokenizer, request.messages, /*add_generation_prompt=*/true);
    if (!ids.is_ok()) return ApiError::from_status(ids.status(), prompt_param);
    out.prompt = std::move(ids).value();
  } else if (request.prompt_tokens) {
    const Status checked = check_token_ids(tokenizer, *request.prompt_tokens);
    if (!checked.is_ok()) return ApiError::invalid(prompt_param, checked.message(), "invalid_value");
    out.prompt = *request.prompt_tokens;
  } else {
    out.prompt = encode_completion_prompt(tokenizer, request.prompt_text.value_or(""));
  }
  if (out.prompt.empty()) return ApiError::invalid(prompt_param, "The prompt must not be empty.", "invalid_value");

  const auto prompt_tokens = static_cast<int64_t>(out.prompt.size());
  const int64_t room = options.context_length - prompt_tokens;
  const int64_t max_tokens = request.max_tokens.value_or(chat ? room : kDefaultCompletionMaxTokens);
  if (max_tokens < 1 || room < max_tokens) {
    // Unsigned: max_tokens may be as large as INT64_MAX, and the sum of two int64 >= 0 fits in uint64.
    const uint64_t completion = static_cast<uint64_t>(std::max<int64_t>(max_tokens, 1));
    return ApiError::invalid(prompt_param,
                             "This model's maximum context length is " + std::to_string(options.context_length) +
                                 " tokens. However, you requested " +
                                 std::to_string(static_cast<uint64_t>(prompt_tokens) + completion) + " tokens (" +
                                 std::to_string(prompt_tokens) + " in the " + prompt_param + ", " +
                                 std::to_string(completion) + " for the completion). Please reduce the length of the " +
                                 prompt_param + " or completion.",
                             "context_length_exceeded");
  }
  out.max_tokens = max_tokens;

  const uint64_t base_seed = request.seed.value_or(options.random_seed);
  for (int index = 0; index < request.n; ++index) {
    GenerationRequest choice;
    choice.request_id = options.response_id + "-" + std::to_string(index);
    choice.tenant = options.tenant;
    choice.cache_namespace = options.cache_namespace.empty() ? options.tenant : options.cache_namespace;
    choice.prompt = out.prompt;
    choice.sampling.temperature = request.temperature;
    choice.sampling.top_p = request.top_p;
    choice.sampling.top_k = request.top_k;
    choice.sampling.seed = base_seed + static_cast<uint64_t>(index);
    choice.sampling.top_logprobs = request.logprobs ? request.top_logprobs : 0;
    choice.logprobs = request.logprobs;
    choice.max_tokens = max_tokens;
    choice.stop = request.stop;
    choice.ignore_eos = request.ignore_eos;
    choice.stop_token_ids = options.stop_token_ids;
    choice.arrival_ns = options.arrival_ns;
    out.choices.push_back(std::move(choice));
  }
  return std::nullopt;
}

}  // namespace deltaserve::router
