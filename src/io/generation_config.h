// generation_config.json -> the sampling defaults a checkpoint ships with. The server applies
// them to every request that leaves the field out, as vLLM's `--generation-config auto` (its
// default) does: temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as a
// cap on max_tokens. As transformers' GenerationConfig.to_diff_dict(), which vLLM reads, a value
// equal to transformers' own default (temperature 1, top_p 1, top_k 50, repetition_penalty 1)
// is no default at all: top_k 50 in the file leaves requests without a top-k cut.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

namespace moeinfer {

struct GenerationDefaults {
  std::optional<float> temperature;
  std::optional<float> top_p;
  std::optional<int64_t> top_k;
  std::optional<float> min_p;
  std::optional<float> repetition_penalty;
  std::optional<int64_t> max_tokens;  // max_new_tokens

  bool empty() const {
    return !temperature && !top_p && !top_k && !min_p && !repetition_penalty && !max_tokens;
  }
  // "temperature=0.6 top_p=0.95 ..." for the server's start-up line; "none" when empty.
  std::string describe() const;

  // Parses the text of a generation_config.json; `source` names it in errors. Throws
  // moeinfer::Error naming the field for a value of the wrong type or out of range.
  static GenerationDefaults parse(const std::string& text, const std::string& source);
  // dir/generation_config.json, or no defaults when the folder has none.
  static GenerationDefaults load(const std::filesystem::path& dir);
};

}  // namespace moeinfer
