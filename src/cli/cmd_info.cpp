// `moeinfer info --model DIR [--json]`: total, active-per-token and resident sizes by part.
#include <cstdio>
#include <string>

#include "cli/commands.h"
#include "cli/model_arg.h"
#include "model/family.h"
#include "model/model_facts.h"

namespace moeinfer::cli {
namespace {

std::string human(double value, const char* unit) {
  const char* prefixes[] = {"", "K", "M", "G", "T"};
  int i = 0;
  while (value >= 1000.0 && i < 4) {
    value /= 1000.0;
    ++i;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f %s%s", value, prefixes[i], unit);
  return buf;
}

void print_table(const ModelConfig& config, const ModelFacts& f) {
  std::printf("model_type %s: %lld layers, %lld experts, top-%lld, hidden %lld, vocab %lld\n",
              config.model_type.c_str(), static_cast<long long>(config.num_layers),
              static_cast<long long>(config.num_experts),
              static_cast<long long>(config.num_experts_per_tok),
              static_cast<long long>(config.hidden_size),
              static_cast<long long>(config.vocab_size));
  std::printf("%-16s %16s %16s %16s\n", "part", "params total", "params active", "resident");
  const struct {
    const char* name;
    int64_t PartCounts::*field;
  } rows[] = {{"attention", &PartCounts::attention},
              {"routed experts", &PartCounts::routed_experts},
              {"shared experts", &PartCounts::shared_experts},
              {"embeddings", &PartCounts::embeddings},
              {"other", &PartCounts::other}};
  for (const auto& row : rows) {
    std::printf("%-16s %16s %16s %16s\n", row.name, human(f.total_params.*row.field, "").c_str(),
                human(f.active_params.*row.field, "").c_str(),
                human(f.resident_bytes.*row.field, "B").c_str());
  }
  std::printf("%-16s %16s %16s %16s\n", "total", human(f.total_params.total(), "").c_str(),
              human(f.active_params.total(), "").c_str(),
              human(f.resident_bytes.total(), "B").c_str());
  std::printf("KV cache per token: %s (float32), %s (bf16)\n",
              human(f.kv_bytes_per_token_f32, "B").c_str(),
              human(f.kv_bytes_per_token_bf16, "B").c_str());
}

}  // namespace

void add_info_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "Parameters (total, active per token) and resident bytes");
  auto model = std::make_shared<std::string>();
  auto as_json = std::make_shared<bool>(false);
  add_model_option(cmd, model.get());
  cmd->add_flag("--json", *as_json, "Print JSON");
  cmd->callback([=] {
    const auto dir = resolve_model_dir(*model);
    const ModelConfig config = load_model_config(dir / "config.json");
    const WeightStore store = WeightStore::open(dir);
    WeightSource source(store, config);
    const DecoderWeights weights = bind_weights(config, source);
    const ModelFacts facts =
        model_facts(config, weights, static_cast<int64_t>(store.total_bytes()));
    if (*as_json) {
      std::printf("%s\n", facts_to_json(config, facts).dump(2).c_str());
    } else {
      print_table(config, facts);
    }
  });
}

}  // namespace moeinfer::cli
