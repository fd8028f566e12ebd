// logit_bias in the sampler: added to the raw logits before penalties and the draw, so -100
// bans a token and +100 forces it, greedy or not; logprobs stay those of the raw logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "core/error.h"
#include "runtime/sampler.h"

namespace moeinfer {
namespace {

std::vector<float> random_logits(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(n);
  for (float& l : logits) l = normal(rng);
  return logits;
}

int32_t argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

TEST(SamplerLogitBias, MinusHundredBansTheGreedyToken) {
  for (int64_t n : {2, 19, 99, 989}) {
    const std::vector<float> logits = random_logits(n, 7 + n);
    const int32_t best = argmax(logits);
    Sampler sampler({.temperature = 0.0f, .logit_bias = {{best, -100.0f}}});
    std::vector<float> without = logits;
    without[best] = -1e30f;
    EXPECT_EQ(sampler.sample(logits), argmax(without)) << "n = " << n;
  }
}

TEST(SamplerLogitBias, PlusHundredForcesATokenAtAnyTemperature) {
  const std::vector<float> logits = random_logits(989, 3);
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int32_t a, int32_t b) { return logits[a] < logits[b]; });
  const int32_t least = order[0];  // the least likely token
  for (float temperature : {0.0f, 0.7f, 1.0f, 2.0f}) {
    for (int64_t top_k : {0, 5}) {
      for (uint64_t seed = 0; seed < 20; ++seed) {
        Sampler sampler({.temperature = temperature,
                         .top_k = top_k,
                         .top_p = 0.9f,
                         .logit_bias = {{least, 100.0f}},
                         .seed = seed});
        EXPECT_EQ(sampler.sample(logits), least)
            << "temperature " << temperature << " top_k " << top_k << " seed " << seed;
      }
    }
  }
}

TEST(SamplerLogitBias, BannedTokenNeverDrawn) {
  // Eleven tokens of equal weight but for a ban on one: a thousand draws never give it.
  const std::vector<float> logits(11, 0.5f);
  Sampler sampler({.temperature = 1.0f, .logit_bias = {{4, -100.0f}}, .seed = 1234});
  std::vector<int> counts(11, 0);
  for (int i = 0; i < 1000; ++i) ++counts[sampler.sample(logits)];
  EXPECT_EQ(counts[4], 0);
  for (int t = 0; t < 11; ++t) {
    if (t != 4) EXPECT_GT(counts[t], 0) << "token " << t;
  }
}

TEST(SamplerLogitBias, SmallBiasShiftsTheArgmaxOnly) {
  // Two close logits: +0.3 on the runner-up makes it the greedy choice, -0.3 does not.
  const std::vector<float> logits = {0.0f, 2.0f, 1.8f, -1.0f};
  EXPECT_EQ(Sampler({.logit_bias = {{2, 0.3f}}}).sample(logits), 2);
  EXPECT_EQ(Sampler({.logit_bias = {{2, -0.3f}}}).sample(logits), 1);
  // Without a bias the same sampler picks the argmax.
  EXPECT_EQ(Sampler({}).sample(logits), 1);
}

TEST(SamplerLogitBias, AppliedBeforePenalties) {
  // Repetition penalty 2 halves a positive logit: token 1 (4.0 + 2.0 bias = 6.0, seen) becomes
  // 3.0, below token 0's 3.5. Bias after the penalty would give 4.0 instead.
  const std::vector<float> logits = {3.5f, 4.0f};
  const std::vector<int32_t> prompt = {1};
  Sampler sampler({.repetition_penalty = 2.0f, .logit_bias = {{1, 2.0f}}});
  EXPECT_EQ(sampler.sample(logits, {.prompt = prompt}), 0);
}

TEST(SamplerLogitBias, LogprobsAreOfTheRawLogits) {
  const std::vector<float> logits = random_logits(99, 11);
  const int32_t best = argmax(logits);
  const TokenLogprob lp = Sampler::logprobs(logits, best, 3);
  EXPECT_EQ(lp.rank, 1);
  EXPECT_EQ(lp.top[0].first, best);
  // Ranks count strictly more likely tokens.
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  for (int64_t r : {0, 1, 17, 98}) {
    EXPECT_EQ(Sampler::logprobs(logits, order[r], 0).rank, r + 1);
  }
}

TEST(SamplerLogitBias, ValidationNamesTheBadEntry) {
  EXPECT_THROW(Sampler({.logit_bias = {{3, 100.5f}}}), Error);
  EXPECT_THROW(Sampler({.logit_bias = {{3, -101.0f}}}), Error);
  EXPECT_THROW(Sampler({.logit_bias = {{-1, 1.0f}}}), Error);
  try {
    Sampler({.logit_bias = {{7, 250.0f}}});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("logit_bias of token 7"), std::string::npos) << e.what();
  }
  // A token past the row is refused when sampling, not written out of bounds.
  Sampler sampler({.logit_bias = {{10, 1.0f}}});
  const std::vector<float> logits(4, 0.0f);
  EXPECT_THROW(sampler.sample(logits), Error);
}

}  // namespace
}  // namespace moeinfer
