// --deterministic on the CPU (cpu::set_batch_invariant): the decoder gives a token bit-identical
// logits whatever else its step carries. Each random configuration (tests/support/
// random_model.h: every family, float32 and bf16) runs the scripted batched steps (prefill,
// chunked prefill in a mixed step, batched decode over a shared pool) and every logits row must
// equal, bit for bit, the row the same token gets when its sequence runs alone, one token per
// step. Without the mode the two differ by float rounding (another GEMM path at another row
// count), which the last check shows the test would see.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "../support/random_model.h"
#include "../support/random_schedule.h"
#include "backend/cpu/gemm.h"
#include "model/decoder.h"

namespace moeinfer {
namespace {

// Sets the mode for one scope; the rest of the binary runs with the default.
class BatchInvariantScope {
 public:
  explicit BatchInvariantScope(bool on) : before_(cpu::batch_invariant()) {
    cpu::set_batch_invariant(on);
  }
  ~BatchInvariantScope() { cpu::set_batch_invariant(before_); }

 private:
  bool before_;
};

// Rows of the scripted steps that differ in any bit from the same token run alone.
int64_t rows_differing_from_alone(const testing::RandomModel& m, uint64_t seed) {
  const ModelConfig& c = m.config;
  const int64_t V = c.vocab_size;
  Decoder decoder(c, m.weights);
  const testing::Schedule s = testing::make_schedule(V, seed, /*block_size=*/8);
  std::vector<std::vector<float>> alone(3);
  for (int q = 0; q < 3; ++q) {
    KvCache cache = decoder.make_cache(s.max_len);
    std::vector<float> row(V);
    for (int32_t token : s.tokens[q]) {
      decoder.forward(std::span<const int32_t>(&token, 1), cache, row, false);
      alone[q].insert(alone[q].end(), row.begin(), row.end());
    }
  }
  const int64_t key_width = c.mla ? c.mla->cache_width() : c.kv_dim();
  KvBlockPool pool(c.num_layers, key_width, c.mla ? 0 : c.kv_dim(), s.block_size, s.num_blocks);
  int64_t differing = 0;
  std::vector<float> logits;
  for (const testing::ScheduledStep& step : s.steps) {
    logits.assign(testing::schedule_logit_rows(step.batch) * V, NAN);
    decoder.forward(step.batch, pool, logits);
    testing::for_each_logit_row(step, [&](int64_t row, int sequence, int64_t position) {
      const float* want = &alone[sequence][position * V];
      differing += std::memcmp(&logits[row * V], want, V * sizeof(float)) != 0;
    });
  }
  return differing;
}

TEST(BatchInvariance, EveryRowEqualsItsTokenRunAlone) {
  const uint64_t base = std::random_device{}();
  BatchInvariantScope on(true);
  for (int i = 0; i < 12; ++i) {
    const ModelFamily family = testing::kAllFamilies[i % 6];
    const uint64_t seed = base + static_cast<uint64_t>(i);
    const testing::RandomModel m = testing::make_random_model(family, seed);
    SCOPED_TRACE(std::string(family_name(family)) + " seed " + std::to_string(seed) + "\n" +
                 m.config_json);
    EXPECT_EQ(rows_differing_from_alone(m, seed), 0);
  }
}

// The same check without the mode finds rows that differ: the test can see a batch dependence.
TEST(BatchInvariance, WithoutTheModeBatchedRowsDiffer) {
  const uint64_t base = std::random_device{}();
  BatchInvariantScope off(false);
  int64_t differing = 0;
  for (int i = 0; i < 6 && differing == 0; ++i) {
    const testing::RandomModel m = testing::make_random_model(testing::kAllFamilies[i], base + i);
    differing += rows_differing_from_alone(m, base + i);
  }
  EXPECT_GT(differing, 0);
}

}  // namespace
}  // namespace moeinfer
