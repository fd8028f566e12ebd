// Built-in configurations of published MoE models, by name ("qwen3-30b-a3b", ...), so that
// planning and benchmarking at real scale need no checkpoint: `--model synthetic:NAME`.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "io/model_config.h"

namespace moeinfer {

// The names known, e.g. {"qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", ...}.
std::vector<std::string> synthetic_model_names();
// The config.json text of a published model, as its checkpoint ships it.
std::string synthetic_config_json(std::string_view name);
// Parsed and validated; `num_layers` > 0 cuts the model to its first layers.
ModelConfig synthetic_model_config(std::string_view name, int64_t num_layers = 0);
// A byte-level BPE tokenizer.json of `vocab_size` tokens for synthetic models: the 256 byte
// tokens, then "<tN>" for every other id, no merges (text encodes to bytes, every id decodes).
std::string synthetic_tokenizer_json(int64_t vocab_size);
// True for "synthetic:NAME" model arguments.
bool is_synthetic_model(std::string_view model_arg);

}  // namespace moeinfer
