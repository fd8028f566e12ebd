// Expert load of a text: how a model's routers spread the text's tokens over the experts, layer
// by layer, beside a random router of the same shape. `moeinfer expert-load` prints it; the
// Python API's moeinfer.expert_load() returns it.
//
// The ids are cut into chunks of at most chunk_tokens (0: the model's context length), each
// prefilled from an empty KV cache, and a routing observer counts every (token, expert)
// assignment per MoE layer. The random router draws K distinct experts uniformly for each of
// the same T tokens in every layer; `draws` seeded draws are averaged. Load figures are ratios
// to the mean load T*K/E: max/mean (the hottest expert), min/mean (the coldest) and cv (standard
// deviation over mean). A balanced router gives max/mean near 1.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <span>
#include <vector>

#include "model/decoder.h"

namespace moeinfer {

struct ExpertLoadOptions {
  int64_t draws = 20;        // random-router draws averaged per layer
  uint64_t seed = 0;         // the random router's seed
  int64_t chunk_tokens = 0;  // tokens per forward pass; 0: the model's context length
};

// Load statistics of one layer's counts [E].
struct LoadStats {
  double max_over_mean = 0.0;
  double min_over_mean = 0.0;
  double cv = 0.0;
};

// Mean, standard deviation and largest value of a sample (the random router's draws).
struct SampleSummary {
  double mean = 0.0, sd = 0.0, max = 0.0;
};

struct ExpertLoadLayer {
  int64_t layer = 0;            // index among all layers
  std::vector<int64_t> counts;  // [E] assignments per expert
  LoadStats model;
  SampleSummary random_max, random_min, random_cv;
};

struct ExpertLoadReport {
  int64_t num_tokens = 0;  // T
  int64_t num_chunks = 0;
  int64_t chunk_tokens = 0;
  int64_t num_experts = 0;  // E
  int64_t top_k = 0;        // K
  ExpertLoadOptions options;
  std::vector<ExpertLoadLayer> layers;     // the MoE layers, in order
  double mean_max_over_mean = 0.0;         // the model's, over the layers
  double random_mean_max_over_mean = 0.0;  // the random router's
};

LoadStats load_stats(std::span<const int64_t> counts);

// Runs `ids` through the decoder (its routing observer is taken for the call and cleared after).
// Throws for a model without MoE layers, no ids, ids outside the vocabulary or bad options.
ExpertLoadReport measure_expert_load(Decoder& decoder, std::span<const int32_t> ids,
                                     const ExpertLoadOptions& options);

// `moeinfer expert-load --json`'s fields (the caller adds model and text_file).
nlohmann::ordered_json expert_load_json(const ExpertLoadReport& report);

}  // namespace moeinfer
