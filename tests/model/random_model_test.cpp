// The random configurations the GPU sweep draws (tests/support/random_model.h) are models the
// engine accepts, and on each of them the CPU decoder, the sweep's oracle, gives every sequence
// of the scripted batched steps (prefill, chunked in a mixed step, batched decode over a shared
// pool) the logits that the same tokens get when the sequence runs alone, token by token, over
// its own cache: batching, chunking and paging change where rows live, never the numbers. The
// batched steps replay the routing of the runs alone: bf16 products round differently at other
// row counts, which may tip a near-tie between experts (DeepSeek-V3's sigmoid router at routed
// scaling 16 amplifies the flip to 0.7 of the logits) and would test the router's ties, not the
// numbers of batching.
#include "../support/random_model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <random>
#include <tuple>

#include "../support/compare.h"
#include "../support/random_schedule.h"
#include "model/decoder.h"

namespace moeinfer {
namespace {

using moeinfer::testing::max_rel_diff;

constexpr int kConfigsPerFamily = 4;

TEST(RandomModels, CpuBatchedStepsMatchEachSequenceAlone) {
  const char* replay = std::getenv("MOE_TEST_SEED");  // the base seed of a failed run
  const uint64_t base = replay ? std::strtoull(replay, nullptr, 10) : std::random_device{}();
  for (int i = 0; i < kConfigsPerFamily * 6; ++i) {
    const ModelFamily family = testing::kAllFamilies[i % 6];
    const uint64_t seed = base + static_cast<uint64_t>(i);
    SCOPED_TRACE(std::string(family_name(family)) + " seed " + std::to_string(seed) +
                 " (MOE_TEST_SEED=" + std::to_string(base) + " replays the run)");
    const testing::RandomModel m = testing::make_random_model(family, seed);
    SCOPED_TRACE(m.config_json);
    const ModelConfig& c = m.config;
    const int64_t V = c.vocab_size;
    Decoder decoder(c, m.weights);
    const testing::Schedule s = testing::make_schedule(V, seed, /*block_size=*/8);
    const int64_t key_width = c.mla ? c.mla->cache_width() : c.kv_dim();
    const int64_t value_width = c.mla ? 0 : c.kv_dim();
    KvBlockPool pool(c.num_layers, key_width, value_width, s.block_size, s.num_blocks);

    // Each sequence alone: one token per step, logits at every position, and its experts.
    const int64_t K = c.num_experts_per_tok;
    std::map<std::tuple<int, int64_t, int64_t>, std::vector<int32_t>> chosen;  // (q, pos, layer)
    std::vector<std::vector<float>> alone(3);
    for (int q = 0; q < 3; ++q) {
      KvCache cache = decoder.make_cache(s.max_len);
      std::vector<float> row(V);
      int64_t position = 0;
      decoder.set_routing_observer([&](int64_t layer, const moe::Routing& routing) {
        chosen[{q, position, layer}].assign(routing.topk_ids.begin(), routing.topk_ids.end());
      });
      for (int32_t token : s.tokens[q]) {
        decoder.forward(std::span<const int32_t>(&token, 1), cache, row, false);
        alone[q].insert(alone[q].end(), row.begin(), row.end());
        ++position;
      }
    }
    decoder.set_routing_observer({});
    const testing::ScheduledStep* current = nullptr;
    decoder.set_routing_override([&](int64_t layer, const float* logits,
                                     const moe::RouterOptions& options, moe::Routing& routing) {
      int64_t t = 0;
      for (size_t b = 0; b < current->batch.sequences.size(); ++b) {
        const SequenceBatch& sb = current->batch.sequences[b];
        for (size_t i = 0; i < sb.tokens.size(); ++i, ++t) {
          const std::vector<int32_t>& ids =
              chosen.at({current->sequence[b], sb.position + static_cast<int64_t>(i), layer});
          std::copy(ids.begin(), ids.end(), routing.topk_ids.begin() + t * K);
        }
      }
      moe::route_weights(logits, options, &routing);
    });
    // bf16 matrix products may take another kernel (and round activations) at other row counts.
    const double bound = c.dtype == "float32" ? 1e-4 : 3e-2;
    std::vector<float> logits;
    for (const testing::ScheduledStep& step : s.steps) {
      current = &step;
      logits.assign(testing::schedule_logit_rows(step.batch) * V, NAN);
      decoder.forward(step.batch, pool, logits);
      int64_t row = 0;
      for (size_t b = 0; b < step.batch.sequences.size(); ++b) {
        const SequenceBatch& sb = step.batch.sequences[b];
        const int q = step.sequence[b];
        const int64_t n = static_cast<int64_t>(sb.tokens.size());
        const int64_t first = step.batch.all_positions ? 0 : n - 1;
        for (int64_t t = first; t < n; ++t, ++row) {
          const int64_t position = sb.position + t;
          EXPECT_LE(
              max_rel_diff({&logits[row * V], size_t(V)}, {&alone[q][position * V], size_t(V)}),
              bound)
              << testing::route_name(step.route) << " sequence " << q << " position " << position;
        }
      }
    }
  }
}

}  // namespace
}  // namespace moeinfer
