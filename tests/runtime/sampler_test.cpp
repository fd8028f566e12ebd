#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "core/error.h"
#include "runtime/sampler.h"

namespace moeinfer {
namespace {

TEST(Sampler, GreedyTakesFirstMaximum) {
  Sampler sampler({});
  const std::vector<float> logits = {0.5f, 3.0f, -1.0f, 3.0f};
  EXPECT_EQ(sampler.sample(logits), 1);
}

TEST(Sampler, SameSeedSameTokens) {
  const std::vector<float> logits = {1.0f, 1.2f, 0.8f, 1.1f, 0.9f};
  Sampler a({.temperature = 1.0f, .seed = 42});
  Sampler b({.temperature = 1.0f, .seed = 42});
  for (int i = 0; i < 50; ++i) EXPECT_EQ(a.sample(logits), b.sample(logits));
}

TEST(Sampler, TopKOneIsGreedy) {
  const std::vector<float> logits = {1.0f, 1.2f, 0.8f, 1.19f};
  Sampler sampler({.temperature = 5.0f, .top_k = 1, .seed = 7});
  for (int i = 0; i < 20; ++i) EXPECT_EQ(sampler.sample(logits), 1);
}

TEST(Sampler, TopPKeepsOnlyTheNucleus) {
  // Probabilities at T=1: about 0.665, 0.245, 0.090. top_p = 0.6 keeps the first alone;
  // top_p = 0.9 keeps the first two.
  const std::vector<float> logits = {2.0f, 1.0f, 0.0f};
  Sampler narrow({.temperature = 1.0f, .top_p = 0.6f, .seed = 1});
  for (int i = 0; i < 50; ++i) EXPECT_EQ(narrow.sample(logits), 0);
  Sampler wide({.temperature = 1.0f, .top_p = 0.9f, .seed = 1});
  std::map<int32_t, int> seen;
  for (int i = 0; i < 400; ++i) ++seen[wide.sample(logits)];
  EXPECT_EQ(seen.count(2), 0u);
  EXPECT_GT(seen[1], 0);
}

TEST(Sampler, RejectsBadParameters) {
  EXPECT_THROW(Sampler::validate({.temperature = -1.0f}), Error);
  EXPECT_THROW(Sampler::validate({.top_p = 0.0f}), Error);
  EXPECT_THROW(Sampler::validate({.top_p = 1.5f}), Error);
  EXPECT_THROW(Sampler::validate({.top_k = -2}), Error);
}

}  // namespace
}  // namespace moeinfer

namespace moeinfer {
namespace {

// Without top_k the sampler sorts only a growing prefix of a large vocabulary; the tokens it can
// return must be exactly the nucleus (top-p) and the min-p set computed over every token.
TEST(Sampler, LargeVocabularyNucleusAndMinPMatchTheFullSort) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(20000);
  for (float& l : logits) l = normal(rng);
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  double total = 0.0;
  for (float l : logits) total += std::exp(l - logits[order[0]]);
  // The nucleus of top_p = 0.5, computed over the full sort.
  std::set<int32_t> nucleus;
  double cumulative = 0.0;
  for (int32_t id : order) {
    nucleus.insert(id);
    cumulative += std::exp(logits[id] - logits[order[0]]) / total;
    if (cumulative >= 0.5) break;
  }
  Sampler top_p({.temperature = 1.0f, .top_p = 0.5f, .seed = 3});
  for (int i = 0; i < 300; ++i) EXPECT_EQ(nucleus.count(top_p.sample(logits)), 1u);
  // min_p = 0.2: tokens within ln(5) of the best logit.
  Sampler min_p({.temperature = 1.0f, .min_p = 0.2f, .seed = 4});
  for (int i = 0; i < 300; ++i) {
    EXPECT_GE(logits[min_p.sample(logits)], logits[order[0]] - std::log(5.0f) - 1e-5f);
  }
}

}  // namespace
}  // namespace moeinfer
