// deltaserve: one binary for every role and tool. Flags are documented by `deltaserve <command> --help`.
#include <iostream>

#include <CLI/CLI.hpp>

#include "cli/commands.hpp"
#include "kernels/cpu/thread_pool.hpp"

int main(int argc, char** argv) {
  using namespace deltaserve::cli;
  CLI::App app{"deltaserve: serving for hybrid linear-attention MoE models (Kimi Linear, Kimi K3)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "deltaserve 0.1.0");
  int threads = 0;
  app.add_option("--threads", threads, "CPU threads for the CPU engine (0 = all cores)")
      ->envname("DELTASERVE_THREADS")
      ->check(CLI::NonNegativeNumber);

  GenerateOptions gen;
  auto* generate = app.add_subcommand("generate", "Generate text from a prompt, printing tokens as they come");
  generate->add_option("--model", gen.model, "Checkpoint directory (default: the built-in tiny model)")
      ->envname("DELTASERVE_MODEL");
  generate->add_option("--prompt,-p", gen.prompt, "Prompt text")->required();
  generate->add_flag("--chat", gen.chat, "Wrap the prompt as a user message in the chat format");
  generate->add_option("--max-tokens", gen.max_tokens, "Tokens to generate at most")->capture_default_str();
  generate->add_option("--temperature", gen.temperature, "0 = greedy")->capture_default_str();
  generate->add_option("--top-p", gen.top_p, "Nucleus sampling mass")->capture_default_str();
  generate->add_option("--top-k", gen.top_k, "Sample among the K best tokens (0 = off)")->capture_default_str();
  generate->add_option("--seed", gen.seed, "Sampling seed")->capture_default_str();
  generate->add_option("--logprobs", gen.logprobs,
                       "Print one JSON line per token with its logprob and the top-K alternatives (0..20)");
  generate->add_option("--prefill-chunk", gen.prefill_chunk, "Prefill chunk in tokens")->capture_default_str();
  generate->add_flag("--ignore-eos", gen.ignore_eos, "Do not stop at the end-of-sequence token");

  TokenizeOptions tok;
  auto* tokenize = app.add_subcommand("tokenize", "Print the token ids of a text as a JSON list");
  tokenize->add_option("--model", tok.model, "Checkpoint directory (default: the built-in tiny model)")
      ->envname("DELTASERVE_MODEL");
  tokenize->add_option("text", tok.text, "Text to encode")->required();
  tokenize->add_flag("--chat", tok.chat, "Wrap the text as a user message in the chat format");
  tokenize->add_flag("--specials", tok.specials, "Parse special-token text as special tokens");

  std::string inspect_path;
  auto* inspect = app.add_subcommand("inspect-model", "Print a model's architecture, parameters and cache sizes");
  inspect->add_option("path", inspect_path, "Checkpoint directory or config.json")->required();

  MakeModelCommandOptions make;
  auto* make_model = app.add_subcommand("make-model", "Write a random model checkpoint in the real formats");
  make_model->add_option("--preset", make.preset, "tiny-linear | tiny-k3 | a config.json path | inline JSON")
      ->capture_default_str();
  make_model->add_option("--out", make.out_dir, "Output directory")->required();
  make_model->add_option("--seed", make.seed, "Weight seed")->capture_default_str();
  make_model->add_option("--dtype", make.dtype, "f32 | bf16 | f16 | fp8 (128x128 block scales)")->capture_default_str();
  make_model->add_option("--shard-bytes", make.shard_bytes, "Shard size in bytes (0 = one file)")
      ->capture_default_str();

  CLI11_PARSE(app, argc, argv);
  deltaserve::kernels::cpu::set_num_threads(threads);

  if (generate->parsed()) return run_generate(gen, std::cout, std::cerr);
  if (tokenize->parsed()) return run_tokenize(tok, std::cout, std::cerr);
  if (inspect->parsed()) return run_inspect_model(inspect_path, std::cout, std::cerr);
  if (make_model->parsed()) return run_make_model(make, std::cout, std::cerr);
  return 2;
}
