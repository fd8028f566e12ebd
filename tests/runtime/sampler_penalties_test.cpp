// The sampler's filters and penalties beyond temperature, top-k and top-p.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

#include "core/error.h"
#include "runtime/sampler.h"

namespace moeinfer {
namespace {

TEST(SamplerPenalties, MinPDropsUnlikelyTokens) {
  // Probabilities at T=1 relative to the best: 1, e^-1 = 0.37, e^-3 = 0.05.
  const std::vector<float> logits = {3.0f, 2.0f, 0.0f};
  Sampler sampler({.temperature = 1.0f, .min_p = 0.2f, .seed = 3});
  std::map<int32_t, int> seen;
  for (int i = 0; i < 500; ++i) ++seen[sampler.sample(logits)];
  EXPECT_EQ(seen.count(2), 0u);
  EXPECT_GT(seen[1], 0);
}

TEST(SamplerPenalties, RepetitionPenaltyTurnsGreedyAway) {
  const std::vector<float> logits = {2.0f, 1.5f, -1.0f};
  const std::vector<int32_t> prompt = {0};
  Sampler plain({});
  EXPECT_EQ(plain.sample(logits, {.prompt = prompt}), 0);
  Sampler penalised({.repetition_penalty = 2.0f});  // 2.0 / 2 = 1.0 < 1.5
  EXPECT_EQ(penalised.sample(logits, {.prompt = prompt}), 1);
}

TEST(SamplerPenalties, PresenceAndFrequencyCountOnlyTheOutput) {
  const std::vector<float> logits = {2.0f, 1.5f};
  const std::vector<int32_t> prompt = {0, 0, 0};
  const std::vector<int32_t> once = {0};
  const std::vector<int32_t> thrice = {0, 0, 0};
  Sampler presence({.presence_penalty = 1.0f});
  EXPECT_EQ(presence.sample(logits, {.prompt = prompt}), 0);  // the prompt does not count
  EXPECT_EQ(presence.sample(logits, {.output = once}), 1);
  Sampler frequency({.frequency_penalty = 0.2f});
  EXPECT_EQ(frequency.sample(logits, {.output = once}), 0);    // 2.0 - 0.2 > 1.5
  EXPECT_EQ(frequency.sample(logits, {.output = thrice}), 1);  // 2.0 - 0.6 < 1.5
}

TEST(SamplerPenalties, LogprobsAreTheRawLogSoftmax) {
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 0.5f};
  double total = 0.0;
  for (float l : logits) total += std::exp(double{l});
  const TokenLogprob lp = Sampler::logprobs(logits, 2, 2);
  EXPECT_NEAR(lp.logprob, 2.0 - std::log(total), 1e-5);
  ASSERT_EQ(lp.top.size(), 2u);
  EXPECT_EQ(lp.top[0].first, 1);
  EXPECT_EQ(lp.top[1].first, 2);
  EXPECT_NEAR(lp.top[0].second, 3.0 - std::log(total), 1e-5);
}

TEST(SamplerPenalties, RejectsBadParameters) {
  EXPECT_THROW(Sampler::validate({.min_p = 1.5f}), Error);
  EXPECT_THROW(Sampler::validate({.repetition_penalty = 0.0f}), Error);
  EXPECT_THROW(Sampler::validate({.presence_penalty = 3.0f}), Error);
  EXPECT_THROW(Sampler::validate({.frequency_penalty = -2.5f}), Error);
}

}  // namespace
}  // namespace moeinfer
