#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
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

// Token ids by (logit descending, id ascending): the order the nucleus is defined over.
std::vector<int32_t> sorted_ids(const std::vector<float>& logits) {
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  return order;
}

// The top-p nucleus at temperature 1 computed over the full sort: in_nucleus[id].
std::vector<bool> full_sort_nucleus(const std::vector<float>& logits, double top_p) {
  const std::vector<int32_t> order = sorted_ids(logits);
  double total = 0.0;
  for (float l : logits) total += std::exp(l - logits[order[0]]);
  std::vector<bool> in_nucleus(logits.size(), false);
  double cumulative = 0.0;
  for (int32_t id : order) {
    in_nucleus[id] = true;
    cumulative += std::exp(logits[id] - logits[order[0]]) / total;
    if (cumulative >= top_p) break;
  }
  return in_nucleus;
}

// Without top_k the sampler sorts only a growing prefix of a large vocabulary; the tokens it can
// return must be exactly the nucleus (top-p) and the min-p set computed over every token.
TEST(Sampler, LargeVocabularyNucleusAndMinPMatchTheFullSort) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(20000);
  for (float& l : logits) l = normal(rng);
  const std::vector<int32_t> order = sorted_ids(logits);
  const std::vector<bool> nucleus = full_sort_nucleus(logits, 0.5);
  Sampler top_p({.temperature = 1.0f, .top_p = 0.5f, .seed = 3});
  for (int i = 0; i < 300; ++i) EXPECT_TRUE(nucleus[top_p.sample(logits)]);
  // min_p = 0.2: tokens within ln(5) of the best logit.
  Sampler min_p({.temperature = 1.0f, .min_p = 0.2f, .seed = 4});
  for (int i = 0; i < 300; ++i) {
    EXPECT_GE(logits[min_p.sample(logits)], logits[order[0]] - std::log(5.0f) - 1e-5f);
  }
}

// Ties at the edge of the nucleus go to the lower ids, as in a sort by (logit, id): four equal
// tokens and top_p 0.5 keep ids 0 and 1, each drawn about half the time.
TEST(Sampler, NucleusTiesGoToTheLowerIds) {
  const std::vector<float> logits = {1.0f, 1.0f, 1.0f, 1.0f};
  Sampler sampler({.temperature = 1.0f, .top_p = 0.5f, .seed = 11});
  std::map<int32_t, int> drawn;
  for (int i = 0; i < 4000; ++i) ++drawn[sampler.sample(logits)];
  ASSERT_EQ(drawn.size(), 2u);
  EXPECT_NEAR(drawn[0], 2000, 200);
  EXPECT_NEAR(drawn[1], 2000, 200);
}

// The draw follows the renormalised probabilities of the kept set: min_p 0.1 then top_p 0.8
// over a vocabulary with a tie at the nucleus edge; 40000 draws within 4 standard deviations of
// each expected count, and nothing outside the set.
TEST(Sampler, DrawsFollowTheKeptProbabilities) {
  const std::vector<float> logits = {0.0f, 2.0f, -3.0f, 1.0f, 1.0f, -0.5f, 2.0f, -4.0f};
  const SamplingParams params{.temperature = 0.9f, .top_p = 0.8f, .min_p = 0.1f, .seed = 5};
  // Expected set by the definition: sort by (logit desc, id), min-p, then the top-p prefix.
  const std::vector<int32_t> order = sorted_ids(logits);
  std::vector<double> weight;
  for (int32_t id : order) weight.push_back(std::exp((logits[id] - logits[order[0]]) / 0.9));
  size_t cut = 0;
  double mass = 0.0;
  while (cut < order.size() && weight[cut] >= 0.1) mass += weight[cut++];
  double cumulative = 0.0;
  size_t nucleus = 0;
  while (nucleus < cut) {
    cumulative += weight[nucleus++] / mass;
    if (cumulative >= 0.8) break;
  }
  double kept = 0.0;
  for (size_t i = 0; i < nucleus; ++i) kept += weight[i];
  ASSERT_LT(nucleus, order.size());  // the case cuts something

  Sampler sampler(params);
  constexpr int kDraws = 40000;
  std::map<int32_t, int> drawn;
  for (int i = 0; i < kDraws; ++i) ++drawn[sampler.sample(logits)];
  for (size_t i = 0; i < order.size(); ++i) {
    const double p = i < nucleus ? weight[i] / kept : 0.0;
    const double expected = p * kDraws, sd = std::sqrt(kDraws * p * (1 - p));
    EXPECT_NEAR(drawn[order[i]], expected, 4 * sd + 1e-9) << "token " << order[i];
  }
}

// A flat distribution over a large vocabulary (the nucleus holds most of it): the sampled
// tokens are the nucleus of the full sort.
TEST(Sampler, FlatLargeVocabularyNucleus) {
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> near_flat(0.0f, 0.05f);
  std::vector<float> logits(50000);
  for (float& l : logits) l = near_flat(rng);
  logits[123] = logits[456];  // a tie somewhere
  const std::vector<bool> in_nucleus = full_sort_nucleus(logits, 0.95);
  Sampler sampler({.temperature = 1.0f, .top_p = 0.95f, .seed = 8});
  for (int i = 0; i < 2000; ++i) EXPECT_TRUE(in_nucleus[sampler.sample(logits)]);
}

}  // namespace
}  // namespace moeinfer
