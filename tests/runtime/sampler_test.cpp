#include <gtest/gtest.h>

#include <map>
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
