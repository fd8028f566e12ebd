// The GPU decoder held to the CPU decoder (which matches transformers on every fixture) on one
// model: the same scripted steps (tests/support/random_schedule.h: prefill, chunked prefill in a
// mixed step, batched decode over the paged cache with CUDA-graph replay) on both, every logits
// row compared. Used by the random-configuration sweep and by the tests of shapes at and past
// the kernels' fast paths.
//
// Routing is held apart from the numbers: where the two routers differ only by a near-tie the
// CPU replays the GPU's experts (replay_gpu_routing), any other difference is counted as a
// routing mismatch.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../support/random_model.h"
#include "../support/random_schedule.h"
#include "model/decoder.h"
#include "model/gpu_decoder.h"
#include "moe/stages.h"

namespace moeinfer::testing {

struct RouteError {
  double diff = 0.0, norm = 0.0;
  double rel() const { return norm > 0 ? std::sqrt(diff / norm) : 0.0; }
};

struct ConfigResult {
  RouteError routes[3];  // by ScheduleRoute
  // With fp8 KV rows only: the GPU against a CPU run over float32 rows (its own routing), and
  // that CPU run against the CPU's fp8 one: how far fp8 rounding alone moves the logits.
  RouteError unrounded[3], cpu_rounding[3];
  int64_t gpu_kv_bytes_per_token = 0;  // the GPU pool's (GpuMemoryReport::kv_bytes_per_token)
  // GpuMemoryReport::persistent_layers and persistent_refusal of the GPU decoder.
  int64_t persistent_layers = 0;
  std::string persistent_refusal;
  int64_t positions = 0, same_top1 = 0;
  int64_t routed = 0, near_ties = 0, routing_mismatches = 0;  // token-layer routings
  std::string first_mismatch;
  double worst() const { return std::max({routes[0].rel(), routes[1].rel(), routes[2].rel()}); }
};

// How far the CPU's router may be from choosing what the GPU chose, for the two to count as a
// near-tie: softmax routers by this much in each differing expert's logit (bf16 rounding
// upstream moves router logits by about 1e-2 here), sigmoid routers by this much in its score,
// whose sums rank DeepSeek-V3's groups (a logit nudge moves a saturated score too little: a
// group tie of 0.0037 between two groups of summed scores near 1.3 was missed so).
constexpr float kRoutingTieLogits = 0.05f;
constexpr float kRoutingTieScore = 0.01f;
constexpr float kRoutingMaxNudgeLogits = 4.0f;
// With fp8 KV rows on both devices the two round some keys and values to neighbouring e4m3 codes
// (a step of 6 to 12% of the value where bf16's is 0.4%), which moves the hidden states, and so
// the router logits, by several times what bf16 rounding does: ties are this many times wider.
constexpr float kFp8RoutingTieScale = 4.0f;

// The logit change that moves expert e's choice by the tie tolerance (times `scale`).
inline float tie_nudge(float logit, const moe::RouterOptions& options, float scale) {
  if (options.score != moe::ScoreFunction::kSigmoid) return scale * kRoutingTieLogits;
  const float s = 1.0f / (1.0f + std::exp(-logit));
  return std::min(scale * kRoutingTieScore / std::max(s * (1.0f - s), 1e-6f),
                  scale * kRoutingMaxNudgeLogits);
}

inline std::vector<int32_t> sorted_ids(const int32_t* ids, int64_t K) {
  std::vector<int32_t> out(ids, ids + K);
  std::sort(out.begin(), out.end());
  return out;
}

// A routing decision is discrete: a near-tie between two experts (or groups) can go either way
// on two devices, and the token's output then differs by a whole expert. So the CPU replays the
// GPU's choice of experts (with its own weights, moe::route_weights) wherever the two differ
// only by a near-tie: the CPU's own router, with the experts only the GPU picked raised by the
// tie tolerance (tie_nudge) and those only it picked lowered as much, picks what the GPU picked.
// Any other difference is a routing mismatch and fails the configuration.
// tie_scale widens the tolerance (fp8 KV rows move the router's inputs by more than bf16 does).
inline void replay_gpu_routing(const moe::Routing& gpu, const float* logits,
                        const moe::RouterOptions& options, moe::Routing& cpu, ConfigResult& result,
                        int64_t layer, float tie_scale = 1.0f) {
  const int64_t T = cpu.num_tokens, K = cpu.top_k, E = options.num_experts;
  ASSERT_EQ(gpu.num_tokens, T) << "layer " << layer;
  std::vector<float> row(E);
  moe::Routing nudged;
  for (int64_t t = 0; t < T; ++t) {
    ++result.routed;
    const auto ours = sorted_ids(&gpu.topk_ids[t * K], K);
    const auto theirs = sorted_ids(&cpu.topk_ids[t * K], K);
    if (ours == theirs) continue;
    // Whether the CPU picks the GPU's experts once the differing ones are nudged by `scale`
    // tie tolerances: the GPU-only experts raised and the CPU-only ones lowered, or either
    // alone (under group-limited routing, lowering a CPU-only expert can drop its whole group
    // and so hide a tie that raising the GPU-only one alone resolves).
    auto nudged_agrees = [&](float scale, bool raise, bool lower) {
      const float* own = logits + t * E;
      std::copy_n(own, E, row.begin());
      if (raise) {
        for (int32_t e : ours)
          if (!std::binary_search(theirs.begin(), theirs.end(), e))
            row[e] += tie_nudge(own[e], options, scale);
      }
      if (lower) {
        for (int32_t e : theirs)
          if (!std::binary_search(ours.begin(), ours.end(), e))
            row[e] -= tie_nudge(own[e], options, scale);
      }
      moe::route(row.data(), 1, options, &nudged);
      return sorted_ids(nudged.topk_ids.data(), K) == ours;
    };
    auto agrees_when_nudged = [&](float scale) {
      return nudged_agrees(scale, true, true) || nudged_agrees(scale, true, false) ||
             nudged_agrees(scale, false, true);
    };
    if (agrees_when_nudged(tie_scale)) {
      ++result.near_ties;
      std::copy_n(&gpu.topk_ids[t * K], K, &cpu.topk_ids[t * K]);
    } else if (result.routing_mismatches++ == 0) {
      std::ostringstream what;
      what << "layer " << layer << " token " << t << ": GPU experts";
      for (int32_t e : ours) what << " " << e;
      what << ", CPU experts";
      for (int32_t e : theirs) what << " " << e;
      what << "; the CPU agrees at";
      const float larger[] = {2.0f * tie_scale, 4.0f * tie_scale, 10.0f * tie_scale, 100.0f};
      const float* at = std::find_if(std::begin(larger), std::end(larger), agrees_when_nudged);
      if (at == std::end(larger)) {
        what << " no nudge up to 100 tie tolerances";
      } else {
        what << " " << *at << " tie tolerances";
      }
      result.first_mismatch = what.str();
    }
  }
  moe::route_weights(logits, options, &cpu);
}

// Runs `schedule` on both decoders (the GPU's with `options`, whose block size and pool must fit
// the schedule) and compares every logits row. options.kv_dtype kFP8 gives both decoders fp8 KV
// rows (the CPU pool's kv_format encoder is the GPU's oracle); kBF16 the GPU's bf16 rows against
// the CPU's float32 ones.
inline ConfigResult compare_on_schedule(const ModelConfig& c, const DecoderWeights& weights,
                                        const testing::Schedule& schedule,
                                        const GpuOptions& options) {
  const int64_t V = c.vocab_size;
  const int64_t block_size = schedule.block_size;
  const bool fp8 = options.kv_dtype == KvDType::kFP8;
  Decoder cpu(c, weights);
  const int64_t key_width = c.mla ? c.mla->cache_width() : c.kv_dim();
  const int64_t value_width = c.mla ? 0 : c.kv_dim();
  // Models with linear-attention layers: the schedule's three sequences hold state slots 0..2
  // (the GPU's are its max_num_seqs = 4).
  const int64_t state_slots = c.linear_attention ? 3 : 0;
  const auto layout = [&](KvDType dtype) {
    return dtype == KvDType::kFP8 || state_slots > 0 ? kv_pool_layout(c, state_slots, dtype)
                                                     : KvPoolLayout{};
  };
  KvBlockPool pool(c.num_layers, key_width, value_width, block_size, schedule.num_blocks,
                   layout(fp8 ? KvDType::kFP8 : KvDType::kF32));
  auto gpu = GpuDecoder::create(c, weights, options);
  // fp8: a second CPU decoder over float32 rows, routing by itself.
  std::optional<Decoder> cpu_f32;
  std::optional<KvBlockPool> pool_f32;
  if (fp8) {
    cpu_f32.emplace(c, weights);
    pool_f32.emplace(c.num_layers, key_width, value_width, block_size, schedule.num_blocks,
                     layout(KvDType::kF32));
  }
  ConfigResult result;
  result.gpu_kv_bytes_per_token = gpu->memory().kv_bytes_per_token;
  result.persistent_layers = gpu->memory().persistent_layers;
  result.persistent_refusal = gpu->memory().persistent_refusal;
  std::map<int64_t, moe::Routing> gpu_routing;  // this step's, by layer
  gpu->set_routing_observer(
      [&](int64_t layer, const moe::Routing& routing) { gpu_routing[layer] = routing; });
  cpu.set_routing_override([&](int64_t layer, const float* logits,
                               const moe::RouterOptions& options, moe::Routing& routing) {
    replay_gpu_routing(gpu_routing.at(layer), logits, options, routing, result, layer,
                       fp8 ? kFp8RoutingTieScale : 1.0f);
  });
  std::vector<float> ours, reference, unrounded;
  for (const testing::ScheduledStep& step : schedule.steps) {
    const int64_t rows = testing::schedule_logit_rows(step.batch);
    ours.assign(rows * V, NAN);
    reference.assign(rows * V, NAN);
    gpu_routing.clear();
    gpu->forward(step.batch, ours);
    cpu.forward(step.batch, pool, reference);
    if (fp8) {
      unrounded.assign(rows * V, NAN);
      cpu_f32->forward(step.batch, *pool_f32, unrounded);
      RouteError& gpu_e = result.unrounded[static_cast<int>(step.route)];
      RouteError& cpu_e = result.cpu_rounding[static_cast<int>(step.route)];
      for (int64_t i = 0; i < rows * V; ++i) {
        gpu_e.diff += std::pow(double{ours[i]} - unrounded[i], 2);
        gpu_e.norm += std::pow(double{unrounded[i]}, 2);
        cpu_e.diff += std::pow(double{reference[i]} - unrounded[i], 2);
        cpu_e.norm += std::pow(double{unrounded[i]}, 2);
      }
    }
    RouteError& e = result.routes[static_cast<int>(step.route)];
    for (int64_t r = 0; r < rows; ++r) {
      const float* a = &ours[r * V];
      const float* b = &reference[r * V];
      for (int64_t i = 0; i < V; ++i) {
        if (!std::isfinite(a[i])) {
          e.diff = INFINITY;
          break;
        }
        e.diff += std::pow(double{a[i]} - b[i], 2);
        e.norm += std::pow(double{b[i]}, 2);
      }
      ++result.positions;
      result.same_top1 += std::max_element(a, a + V) - a == std::max_element(b, b + V) - b;
    }
  }
  return result;
}

// The three-sequence schedule (random_schedule.h) of a random block size.
// weight_dtype: how a float32 model's weights go to the GPU (GpuOptions::weight_dtype).
// kv_dtype: as compare_on_schedule's options.kv_dtype (kFP8, or anything else for bf16).
inline ConfigResult compare_gpu_with_cpu(const ModelConfig& c, const DecoderWeights& weights,
                                         uint64_t schedule_seed, bool deterministic,
                                         GpuWeightDtype weight_dtype = GpuWeightDtype::kCheckpoint,
                                         KvDType kv_dtype = KvDType::kBF16) {
  std::mt19937_64 rng(schedule_seed);
  const int64_t block_size = std::vector<int64_t>{8, 16, 32}[rng() % 3];
  const testing::Schedule schedule =
      testing::make_schedule(c.vocab_size, schedule_seed, block_size);
  const bool fp8 = kv_dtype == KvDType::kFP8;
  return compare_on_schedule(c, weights, schedule,
                             GpuOptions{.weight_dtype = weight_dtype,
                                        .max_batch_tokens = 64,
                                        .max_num_seqs = 4,
                                        .max_model_len = 64,
                                        .block_size = block_size,
                                        .num_kv_blocks = schedule.num_blocks,
                                        .quiet = true,
                                        .kv_dtype = fp8 ? KvDType::kFP8 : KvDType::kBF16,
                                        .deterministic = deterministic});
}

inline ConfigResult compare_gpu_with_cpu(const testing::RandomModel& m, uint64_t schedule_seed,
                                         bool deterministic,
                                         GpuWeightDtype weight_dtype = GpuWeightDtype::kCheckpoint,
                                         KvDType kv_dtype = KvDType::kBF16) {
  return compare_gpu_with_cpu(m.config, m.weights, schedule_seed, deterministic, weight_dtype,
                              kv_dtype);
}

}  // namespace moeinfer::testing
