// `moeinfer expert-load --model DIR --text-file FILE [--json] [--draws N] [--seed S]`: how a
// model's routers spread a text's tokens over the experts, layer by layer, beside a random
// router of the same shape.
//
// The text is encoded as `generate` encodes a prompt (special tokens included), cut into chunks
// of at most the model's context length (max_position_embeddings), and each chunk is prefilled
// from an empty KV cache. A routing observer counts every (token, expert) assignment per MoE
// layer. The random router draws K distinct experts uniformly for each of the same T tokens in
// every layer; several seeded draws are averaged. Load figures are ratios to the mean load
// T*K/E: max/mean (the hottest expert), min/mean (the coldest) and cv (standard deviation over
// mean). A balanced router gives max/mean near 1; learned routing on a narrow text is skewed.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/model_arg.h"
#include "core/error.h"
#include "io/tokenizer.h"
#include "model/model.h"

namespace moeinfer::cli {
namespace {

struct ExpertLoadArgs {
  std::string model;
  std::string text_file;
  bool json = false;
  int64_t draws = 20;
  uint64_t seed = 0;
  int64_t chunk_tokens = 0;  // 0: the model's context length
};

// Load statistics of one layer's counts [E].
struct LoadStats {
  double max_over_mean = 0.0;
  double min_over_mean = 0.0;
  double cv = 0.0;
};

LoadStats load_stats(const std::vector<int64_t>& counts) {
  const double n = static_cast<double>(counts.size());
  const double total = std::accumulate(counts.begin(), counts.end(), 0.0);
  const double mean = total / n;
  if (mean <= 0.0) return {};
  double var = 0.0;
  for (int64_t c : counts) var += (c - mean) * (c - mean);
  const auto [lo, hi] = std::minmax_element(counts.begin(), counts.end());
  return {
      .max_over_mean = *hi / mean, .min_over_mean = *lo / mean, .cv = std::sqrt(var / n) / mean};
}

// Mean, standard deviation and largest value of a sample.
struct Summary {
  double mean = 0.0, sd = 0.0, max = 0.0;
};

Summary summarise(const std::vector<double>& values) {
  Summary s;
  if (values.empty()) return s;
  s.mean = std::accumulate(values.begin(), values.end(), 0.0) / values.size();
  s.max = *std::max_element(values.begin(), values.end());
  double var = 0.0;
  for (double v : values) var += (v - s.mean) * (v - s.mean);
  s.sd = values.size() > 1 ? std::sqrt(var / (values.size() - 1)) : 0.0;
  return s;
}

// One random-router layer: each of num_tokens tokens picks top_k distinct experts uniformly.
std::vector<int64_t> random_counts(int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                   std::mt19937_64& rng) {
  std::vector<int64_t> counts(num_experts, 0);
  std::vector<int32_t> experts(num_experts);
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::iota(experts.begin(), experts.end(), 0);
    for (int64_t k = 0; k < top_k; ++k) {  // partial Fisher-Yates
      std::uniform_int_distribution<int64_t> pick(k, num_experts - 1);
      std::swap(experts[k], experts[pick(rng)]);
      ++counts[experts[k]];
    }
  }
  return counts;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in.good(), "cannot open --text-file ", path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

void run_expert_load(const ExpertLoadArgs& args) {
  MOE_CHECK(args.draws >= 1, "--draws must be >= 1, got ", args.draws);
  MOE_CHECK(args.chunk_tokens >= 0, "--chunk-tokens must be >= 0, got ", args.chunk_tokens);
  const std::filesystem::path dir = resolve_model_dir(args.model);
  auto model = Model::load(dir, LoadOptions{});
  const Tokenizer tokenizer = Tokenizer::from_dir(dir);
  Decoder& decoder = model->decoder();
  const ModelConfig& config = decoder.config();
  const int64_t E = config.num_experts;
  const int64_t K = config.num_experts_per_tok;
  MOE_CHECK(E > 0 && std::count(config.layer_is_moe.begin(), config.layer_is_moe.end(), true) > 0,
            dir.string(), " has no MoE layers");

  const std::vector<int32_t> ids =
      tokenizer.encode(read_text(args.text_file), /*add_special_tokens=*/true);
  MOE_CHECK(!ids.empty(), args.text_file, " encodes to no tokens");
  for (int32_t id : ids) {
    MOE_CHECK(id >= 0 && id < config.vocab_size, "the tokenizer gave id ", id,
              " but the model's vocabulary has ", config.vocab_size, " entries");
  }
  int64_t chunk = args.chunk_tokens ? args.chunk_tokens : config.max_position_embeddings;
  if (chunk <= 0) chunk = 2048;  // a checkpoint that does not state its context length
  const int64_t T = static_cast<int64_t>(ids.size());

  // [layer] -> [E] assignments, for the MoE layers in order.
  std::map<int64_t, std::vector<int64_t>> counts;
  decoder.set_routing_observer([&counts, E](int64_t layer, const moe::Routing& routing) {
    auto& c = counts.try_emplace(layer, E, 0).first->second;
    for (int32_t e : routing.topk_ids) {  // [T, K]
      MOE_CHECK(e >= 0 && e < E, "router picked expert ", e, " of ", E, " in layer ", layer);
      ++c[e];
    }
  });
  std::vector<float> logits(config.vocab_size);
  int64_t num_chunks = 0;
  for (int64_t start = 0; start < T; start += chunk) {
    const int64_t n = std::min(chunk, T - start);
    KvCache cache = decoder.make_cache(n);
    decoder.forward(std::span<const int32_t>(ids.data() + start, n), cache, logits,
                    /*all_positions=*/false);
    ++num_chunks;
  }
  decoder.set_routing_observer(nullptr);

  // The random router: per layer, `draws` seeded draws over the same T tokens.
  std::mt19937_64 rng(args.seed);
  struct Row {
    int64_t layer;
    LoadStats model;
    Summary random_max, random_min, random_cv;
  };
  std::vector<Row> rows;
  for (const auto& [layer, c] : counts) {
    std::vector<double> max_r, min_r, cv_r;
    for (int64_t d = 0; d < args.draws; ++d) {
      const LoadStats s = load_stats(random_counts(T, K, E, rng));
      max_r.push_back(s.max_over_mean);
      min_r.push_back(s.min_over_mean);
      cv_r.push_back(s.cv);
    }
    rows.push_back({layer, load_stats(c), summarise(max_r), summarise(min_r), summarise(cv_r)});
  }
  double model_mean = 0.0, random_mean = 0.0;
  for (const Row& r : rows) {
    model_mean += r.model.max_over_mean / rows.size();
    random_mean += r.random_max.mean / rows.size();
  }

  if (args.json) {
    nlohmann::ordered_json out;
    out["model"] = dir.string();
    out["text_file"] = args.text_file;
    out["num_tokens"] = T;
    out["num_chunks"] = num_chunks;
    out["chunk_tokens"] = chunk;
    out["num_experts"] = E;
    out["top_k"] = K;
    out["draws"] = args.draws;
    out["seed"] = args.seed;
    nlohmann::ordered_json layers = nlohmann::ordered_json::array();
    for (const Row& r : rows) {
      layers.push_back({{"layer", r.layer},
                        {"counts", counts.at(r.layer)},
                        {"max_over_mean", r.model.max_over_mean},
                        {"min_over_mean", r.model.min_over_mean},
                        {"cv", r.model.cv},
                        {"random",
                         {{"max_over_mean", r.random_max.mean},
                          {"max_over_mean_sd", r.random_max.sd},
                          {"max_over_mean_max", r.random_max.max},
                          {"min_over_mean", r.random_min.mean},
                          {"cv", r.random_cv.mean}}}});
    }
    out["layers"] = layers;
    out["mean_max_over_mean"] = model_mean;
    out["random_mean_max_over_mean"] = random_mean;
    std::printf("%s\n", out.dump(2).c_str());
    return;
  }

  std::printf("expert load of %s on %s\n", dir.filename().string().c_str(), args.text_file.c_str());
  std::printf(
      "%lld tokens in %lld chunk(s) of <= %lld; top-%lld of %lld experts; mean load "
      "%.1f assignments per expert per layer; random router: %lld seeded draws\n\n",
      static_cast<long long>(T), static_cast<long long>(num_chunks), static_cast<long long>(chunk),
      static_cast<long long>(K), static_cast<long long>(E), static_cast<double>(T * K) / E,
      static_cast<long long>(args.draws));
  std::printf("%5s  %8s %8s %6s | %17s %8s %6s | %7s\n", "layer", "max/mean", "min/mean", "cv",
              "random max/mean", "min/mean", "cv", "ratio");
  for (const Row& r : rows) {
    std::printf("%5lld  %8.2f %8.2f %6.2f | %9.2f +- %4.2f %8.2f %6.2f | %6.2fx\n",
                static_cast<long long>(r.layer), r.model.max_over_mean, r.model.min_over_mean,
                r.model.cv, r.random_max.mean, r.random_max.sd, r.random_min.mean, r.random_cv.mean,
                r.model.max_over_mean / r.random_max.mean);
  }
  std::printf("%5s  %8.2f %8s %6s | %9.2f %6s %8s %6s | %6.2fx\n", "mean", model_mean, "", "",
              random_mean, "", "", "", model_mean / random_mean);
  std::printf("\nassignments per expert (layer: expert 0 .. %lld)\n",
              static_cast<long long>(E - 1));
  for (const Row& r : rows) {
    std::printf("%5lld:", static_cast<long long>(r.layer));
    for (int64_t c : counts.at(r.layer)) std::printf(" %lld", static_cast<long long>(c));
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
  cmd->add_option("--draws", args->draws, "Random-router draws to average")->capture_default_str();
  cmd->add_option("--seed", args->seed, "Random-router seed")->capture_default_str();
  cmd->add_option("--chunk-tokens", args->chunk_tokens,
                  "Tokens per forward pass (0 = the model's context length)")
      ->capture_default_str();
  cmd->callback([args] { run_expert_load(*args); });
}

}  // namespace moeinfer::cli
