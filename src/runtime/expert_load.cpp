#include "runtime/expert_load.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "core/error.h"

namespace moeinfer {
namespace {

SampleSummary summarise(const std::vector<double>& values) {
  SampleSummary s;
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

}  // namespace

LoadStats load_stats(std::span<const int64_t> counts) {
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

ExpertLoadReport measure_expert_load(Decoder& decoder, std::span<const int32_t> ids,
                                     const ExpertLoadOptions& options) {
  MOE_CHECK(options.draws >= 1, "draws must be >= 1, got ", options.draws);
  MOE_CHECK(options.chunk_tokens >= 0, "chunk_tokens must be >= 0, got ", options.chunk_tokens);
  const ModelConfig& config = decoder.config();
  const int64_t E = config.num_experts;
  const int64_t K = config.num_experts_per_tok;
  MOE_CHECK(E > 0 && std::count(config.layer_is_moe.begin(), config.layer_is_moe.end(), true) > 0,
            "the model has no MoE layers");
  MOE_CHECK(!ids.empty(), "the text encodes to no tokens");
  for (int32_t id : ids) {
    MOE_CHECK(id >= 0 && id < config.vocab_size, "the tokenizer gave id ", id,
              " but the model's vocabulary has ", config.vocab_size, " entries");
  }
  ExpertLoadReport report{.num_tokens = static_cast<int64_t>(ids.size()),
                          .num_experts = E,
                          .top_k = K,
                          .options = options};
  int64_t chunk = options.chunk_tokens ? options.chunk_tokens : config.max_position_embeddings;
  if (chunk <= 0) chunk = 2048;  // a checkpoint that does not state its context length
  report.chunk_tokens = chunk;
  const int64_t T = report.num_tokens;

  // [layer] -> [E] assignments, for the MoE layers in order.
  std::map<int64_t, std::vector<int64_t>> counts;
  decoder.set_routing_observer([&counts, E](int64_t layer, const moe::Routing& routing) {
    auto& c = counts.try_emplace(layer, E, 0).first->second;
    for (int32_t e : routing.topk_ids) {  // [T, K]
      MOE_CHECK(e >= 0 && e < E, "router picked expert ", e, " of ", E, " in layer ", layer);
      ++c[e];
    }
  });
  struct ClearObserver {
    Decoder& decoder;
    ~ClearObserver() { decoder.set_routing_observer(nullptr); }
  } clear{decoder};
  std::vector<float> logits(config.vocab_size);
  for (int64_t start = 0; start < T; start += chunk) {
    const int64_t n = std::min(chunk, T - start);
    KvCache cache = decoder.make_cache(n);
    decoder.forward(ids.subspan(start, n), cache, logits, /*all_positions=*/false);
    ++report.num_chunks;
  }

  std::mt19937_64 rng(options.seed);
  for (auto& [layer, c] : counts) {
    std::vector<double> max_r, min_r, cv_r;
    for (int64_t d = 0; d < options.draws; ++d) {
      const std::vector<int64_t> random = random_counts(T, K, E, rng);
      const LoadStats s = load_stats(random);
      max_r.push_back(s.max_over_mean);
      min_r.push_back(s.min_over_mean);
      cv_r.push_back(s.cv);
    }
    const LoadStats model = load_stats(c);
    report.layers.push_back({.layer = layer,
                             .counts = std::move(c),
                             .model = model,
                             .random_max = summarise(max_r),
                             .random_min = summarise(min_r),
                             .random_cv = summarise(cv_r)});
  }
  for (const ExpertLoadLayer& l : report.layers) {
    report.mean_max_over_mean += l.model.max_over_mean / report.layers.size();
    report.random_mean_max_over_mean += l.random_max.mean / report.layers.size();
  }
  return report;
}

nlohmann::ordered_json expert_load_json(const ExpertLoadReport& report) {
  nlohmann::ordered_json out;
  out["num_tokens"] = report.num_tokens;
  out["num_chunks"] = report.num_chunks;
  out["chunk_tokens"] = report.chunk_tokens;
  out["num_experts"] = report.num_experts;
  out["top_k"] = report.top_k;
  out["draws"] = report.options.draws;
  out["seed"] = report.options.seed;
  nlohmann::ordered_json layers = nlohmann::ordered_json::array();
  for (const ExpertLoadLayer& l : report.layers) {
    layers.push_back({{"layer", l.layer},
                      {"counts", l.counts},
                      {"max_over_mean", l.model.max_over_mean},
                      {"min_over_mean", l.model.min_over_mean},
                      {"cv", l.model.cv},
                      {"random",
                       {{"max_over_mean", l.random_max.mean},
                        {"max_over_mean_sd", l.random_max.sd},
                        {"max_over_mean_max", l.random_max.max},
                        {"min_over_mean", l.random_min.mean},
                        {"cv", l.random_cv.mean}}}});
  }
  out["layers"] = layers;
  out["mean_max_over_mean"] = report.mean_max_over_mean;
  out["random_mean_max_over_mean"] = report.random_mean_max_over_mean;
  return out;
}

}  // namespace moeinfer
