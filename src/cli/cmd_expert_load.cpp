// `moeinfer expert-load --model DIR --text-file FILE [--json] [--draws N] [--seed S]`: how a
// model's routers spread a text's tokens over the experts, layer by layer, beside a random
// router of the same shape (runtime/expert_load.h measures; this prints).
//
// The text is encoded as `generate` encodes a prompt (special tokens included).
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/model_arg.h"
#include "core/error.h"
#include "io/tokenizer.h"
#include "model/model.h"
#include "runtime/expert_load.h"

namespace moeinfer::cli {
namespace {

struct ExpertLoadArgs {
  std::string model;
  std::string text_file;
  bool json = false;
  ExpertLoadOptions options;
};

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in.good(), "cannot open --text-file ", path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

void run_expert_load(const ExpertLoadArgs& args) {
  const std::filesystem::path dir = resolve_model_dir(args.model);
  auto model = Model::load(dir, LoadOptions{});
  const Tokenizer tokenizer = Tokenizer::from_dir(dir);
  const std::vector<int32_t> ids =
      tokenizer.encode(read_text(args.text_file), /*add_special_tokens=*/true);
  MOE_CHECK(!ids.empty(), args.text_file, " encodes to no tokens");
  const ExpertLoadReport report = measure_expert_load(model->decoder(), ids, args.options);

  if (args.json) {
    nlohmann::ordered_json out;
    out["model"] = dir.string();
    out["text_file"] = args.text_file;
    out.update(expert_load_json(report));
    std::printf("%s\n", out.dump(2).c_str());
    return;
  }

  const int64_t T = report.num_tokens, K = report.top_k, E = report.num_experts;
  std::printf("expert load of %s on %s\n", dir.filename().string().c_str(), args.text_file.c_str());
  std::printf(
      "%lld tokens in %lld chunk(s) of <= %lld; top-%lld of %lld experts; mean load "
      "%.1f assignments per expert per layer; random router: %lld seeded draws\n\n",
      static_cast<long long>(T), static_cast<long long>(report.num_chunks),
      static_cast<long long>(report.chunk_tokens), static_cast<long long>(K),
      static_cast<long long>(E), static_cast<double>(T * K) / E,
      static_cast<long long>(args.options.draws));
  std::printf("%5s  %8s %8s %6s | %17s %8s %6s | %7s\n", "layer", "max/mean", "min/mean", "cv",
              "random max/mean", "min/mean", "cv", "ratio");
  for (const ExpertLoadLayer& r : report.layers) {
    std::printf("%5lld  %8.2f %8.2f %6.2f | %9.2f +- %4.2f %8.2f %6.2f | %6.2fx\n",
                static_cast<long long>(r.layer), r.model.max_over_mean, r.model.min_over_mean,
                r.model.cv, r.random_max.mean, r.random_max.sd, r.random_min.mean, r.random_cv.mean,
                r.model.max_over_mean / r.random_max.mean);
  }
  std::printf("%5s  %8.2f %8s %6s | %9.2f %6s %8s %6s | %6.2fx\n", "mean",
              report.mean_max_over_mean, "", "", report.random_mean_max_over_mean, "", "", "",
              report.mean_max_over_mean / report.random_mean_max_over_mean);
  std::printf("\nassignments per expert (layer: expert 0 .. %lld)\n",
              static_cast<long long>(E - 1));
  for (const ExpertLoadLayer& r : report.layers) {
    std::printf("%5lld:", static_cast<long long>(r.layer));
    for (int64_t c : r.counts) std::printf(" %lld", static_cast<long long>(c));
    std::printf("\n");
  }
}

}  // namespace

void add_expert_load_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "expert-load", "Per-layer expert load of a text, beside a random router of the same shape");
  auto args = std::make_shared<ExpertLoadArgs>();
  add_model_option(cmd, &args->model);
  cmd->add_option("--text-file", args->text_file, "Text to run through the model")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_flag("--json", args->json, "Print JSON instead of a table");
  cmd->add_option("--draws", args->options.draws, "Random-router draws to average")->capture_default_str();
  cmd->add_option("--seed", args->options.seed, "Random-router seed")->capture_default_str();
  cmd->add_option("--chunk-tokens", args->options.chunk_tokens,
                  "Tokens per forward pass (0 = the model's context length)")
      ->capture_default_str();
  cmd->callback([args] { run_expert_load(*args); });
}

}  // namespace moeinfer::cli
