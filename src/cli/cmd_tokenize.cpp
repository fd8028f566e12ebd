// `moeinfer tokenize`: prints the ids of a text, comma-separated, exactly as
// `tokenizers.Tokenizer.from_file(DIR/tokenizer.json).encode(TEXT).ids` gives them (or, for a
// folder with Kimi's tiktoken.model, what its TikTokenTokenizer.encode(TEXT) gives).
// With --input-jsonl every line of the file is a JSON string and one line of ids is printed per
// input (the differential test against `tokenizers` drives this mode). --decode turns a
// comma-separated id list back into text.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/ids_arg.h"
#include "cli/model_arg.h"
#include "core/error.h"
#include "io/tokenizer.h"

namespace moeinfer::cli {

namespace {

struct TokenizeOptions {
  std::string model;
  std::string text;
  std::string input_jsonl;
  std::string decode_ids;
  bool no_special = false;
  bool skip_special = false;
};

// A model folder's tokenizer (tokenizer.json, or Kimi's tiktoken.model with
// tokenizer_config.json), or a tokenizer.json given as a file.
Tokenizer load_tokenizer(const std::string& model) {
  const std::filesystem::path path(model);
  if (std::filesystem::is_directory(path)) return Tokenizer::from_dir(path);
  return Tokenizer::from_file(path);
}

void append_ids(std::string& out, const std::vector<int32_t>& ids) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i > 0) out += ',';
    out += std::to_string(ids[i]);
  }
  out += '\n';
}

void run_tokenize(const TokenizeOptions& opts) {
  const Tokenizer tokenizer = load_tokenizer(resolve_model_dir(opts.model).string());
  const bool add_special = !opts.no_special;
  std::string out;
  if (!opts.decode_ids.empty()) {
    const std::vector<int32_t> ids = parse_token_ids(opts.decode_ids, "--decode");
    for (int32_t id : ids) {  // decode() skips an unknown id, as the tokenizers library does
      MOE_CHECK(id < tokenizer.vocab_size(), "--decode: token id ", id,
                " is outside the vocabulary of ", tokenizer.vocab_size());
    }
    out = tokenizer.decode(ids, opts.skip_special);
    out += '\n';
  } else if (!opts.input_jsonl.empty()) {
    std::ifstream in(opts.input_jsonl, std::ios::binary);
    MOE_CHECK(in.good(), "cannot open --input-jsonl file ", opts.input_jsonl);
    std::string line;
    size_t line_number = 0;
    while (std::getline(in, line)) {
      ++line_number;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      nlohmann::json value;
      try {
        value = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        MOE_FAIL(opts.input_jsonl, ":", line_number, ": not JSON: ", e.what());
      }
      MOE_CHECK(value.is_string(), opts.input_jsonl, ":", line_number, ": expected a JSON string");
      append_ids(out, tokenizer.encode(value.get<std::string>(), add_special));
    }
  } else {
    append_ids(out, tokenizer.encode(opts.text, add_special));
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::fflush(stdout);
}

}  // namespace

void add_tokenize_command(CLI::App& app) {
  auto opts = std::make_shared<TokenizeOptions>();
  CLI::App* cmd = app.add_subcommand("tokenize", "Print the token ids of a text");
  cmd->add_option("model,--model", opts->model,
                  "Model directory holding tokenizer.json, or the file; default: the built-in "
                  "model, or $MOEINFER_MODEL");
  auto* text = cmd->add_option("--text", opts->text, "Text to encode");
  auto* jsonl = cmd->add_option("--input-jsonl", opts->input_jsonl,
                                "File with one JSON string per line; prints one line per input");
  auto* decode =
      cmd->add_option("--decode", opts->decode_ids, "Comma-separated ids to decode back into text");
  text->excludes(jsonl)->excludes(decode);
  jsonl->excludes(decode);
  cmd->add_flag("--no-special", opts->no_special, "Do not add BOS/EOS (add_special_tokens=False)");
  cmd->add_flag("--skip-special", opts->skip_special, "With --decode: drop special tokens");
  cmd->callback([opts] { run_tokenize(*opts); });
}

}  // namespace moeinfer::cli
