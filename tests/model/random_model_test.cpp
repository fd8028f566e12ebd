// The random configurations the GPU sweep draws (tests/support/random_model.h) are models the
// engine accepts, and on each of them the CPU decoder, the sweep's oracle, gives every sequence
// of the scripted batched steps (prefill, chunked in a mixed step, batched decode over a shared
// pool) the logits that the same tokens get when the sequence runs alone, token by token, over
// its own cache: batching, chunking and paging change where rows live, never the numbers.
#include "../support/random_model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "../support/random_schedule.h"
#include "model/decoder.h"

namespace moeinfer {
namespace {

constexpr int kConfigsPerFamily = 4;

double max_rel_diff(const float* a, const float* b, int64_t n) {
  double diff = 0.0, norm = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    diff = std::max(diff, std::fabs(double{a[i]} - b[i]));
    norm = std::max(norm, std::fabs(double{b[i]}));
  }
  return norm > 0 ? diff / norm : diff;
}

TEST(RandomModels, CpuBatchedStepsMatchEachSequenceAlone) {
  const uint64_t base = std::random_device{}();
  for (int i = 0; i < kConfigsPerFamily * 6; ++i) {
    const ModelFamily family = testing::kAllFamilies[i % 6];
    const uint64_t seed = base + static_cast<uint64_t>(i);
    SCOPED_TRACE(std::string(family_name(family)) + " seed " + std::to_string(seed));
    const testing::RandomModel m = testing::make_random_model(family, seed);
    SCOPED_TRACE(m.config_json);
    const ModelConfig& c = m.config;
    const int64_t V = c.vocab_size;
    Decoder decoder(c, m.weights);
    const testing::Schedule s = testing::make_schedule(V, seed, /*block_size=*/8);
    const int64_t key_width = c.mla ? c.mla->cache_width() : c.kv_dim();
    const int64_t value_width = c.mla ? 0 : c.kv_dim();
    KvBlockPool pool(c.num_layers, key_width, value_width, s.block_size, s.num_blocks);

    // Each sequence alone: one token per step, logits at every position.
    std::vector<std::vector<float>> alone(3);
    for (int q = 0; q < 3; ++q) {
      KvCache cache = decoder.make_cache(s.max_len);
      std::vector<float> row(V);
      for (int32_t token : s.tokens[q]) {
        decoder.forward(std::span<const int32_t>(&token, 1), cache, row, false);
        alone[q].insert(alone[q].end(), row.begin(), row.end());
      }
    }
    // bf16 matrix products may take another kernel (and round activations) at other row counts.
    const double bound = c.dtype == "float32" ? 1e-4 : 3e-2;
    std::vector<float> logits;
    for (const testing::ScheduledStep& step : s.steps) {
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
          EXPECT_LE(max_rel_diff(&logits[row * V], &alone[q][position * V], V), bound)
              << testing::route_name(step.route) << " sequence " << q << " position " << position;
        }
      }
    }
  }
}

}  // namespace
}  // namespace moeinfer
