// Writes a small but real-format Kimi tokenizer (tiktoken.model + tokenizer_config.json) for the
// project's built-in tiny models, so the whole load → encode → serve path runs without a download.
//
// Vocabulary: ranks 0..255 are the single bytes 0x00..0xFF in byte order; ranks 256.. are BPE merges
// learned by a deterministic trainer over an embedded multilingual text (English prose, code, Russian,
// Chinese), pre-split with the Kimi pattern, until `num_base_tokens` ranks exist. Specials occupy
// num_base_tokens + [0, 256) with the Kimi layout below (bos "[BOS]", eos "<|im_end|>", pad "[PAD]").
// Same arguments → byte-identical files. `seed` weights the training paragraphs, so different seeds
// give different (equally valid) merges.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.hpp"

namespace deltaserve::tokenizer {

// Offsets of the named specials from the first special id, as in the Kimi K2 / Kimi Linear
// tokenizer_config.json (first special 163584): [BOS] 163584, [EOS] 163585, <|im_end|> 163586,
// <|im_user|> 163587, <|im_assistant|> 163588, <|start_header_id|> 163590, <|end_header_id|> 163591,
// [EOT] 163593, <|im_system|> 163594, tool-call markers 163595..163599, <|im_middle|> 163601,
// [UNK] 163838, [PAD] 163839. Unlisted offsets are <|reserved_token_{id}|>.
struct SpecialTokenSlot {
  int32_t offset;
  std::string_view text;
};
inline constexpr std::array<SpecialTokenSlot, 17> kKimiSpecialTokenLayout = {{
    {0, "[BOS]"},
    {1, "[EOS]"},
    {2, "<|im_end|>"},
    {3, "<|im_user|>"},
    {4, "<|im_assistant|>"},
    {6, "<|start_header_id|>"},
    {7, "<|end_header_id|>"},
    {9, "[EOT]"},
    {10, "<|im_system|>"},
    {11, "<|tool_calls_section_begin|>"},
    {12, "<|tool_calls_section_end|>"},
    {13, "<|tool_call_begin|>"},
    {14, "<|tool_call_argument_begin|>"},
    {15, "<|tool_call_end|>"},
    {17, "<|im_middle|>"},
    {254, "[UNK]"},
    {255, "[PAD]"},
}};

// The embedded training text (a few KB, UTF-8, paragraphs separated by blank lines).
std::string_view tiny_training_text();

// The ranked token bytes the writer would produce (index == rank). InvalidArgument when
// num_base_tokens < 256 or exceeds what the training text can yield (its distinct merges run out).
Result<std::vector<std::string>> train_tiny_bpe(int32_t num_base_tokens, uint64_t seed);

// Creates `dir` if needed and writes dir/tiktoken.model and dir/tokenizer_config.json (each written to
// a temporary file and renamed into place). IoError naming the path on filesystem failures.
Status write_tiny_tokenizer(const std::filesystem::path& dir, int32_t num_base_tokens, uint64_t seed);

}  // namespace deltaserve::tokenizer
