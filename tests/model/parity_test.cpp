// Holds every model fixture to the reference made by transformers (tools/make_fixtures.py):
// relative logit error within the fixture's bound, and the same 16-token greedy continuation
// with the KV cache on (prefill once, then one token per step).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "../support/model_fixtures.h"
#include "io/npy.h"
#include "model/model.h"

namespace moeinfer {
namespace {

const std::filesystem::path& kModels = testing_support::kModelFixtures;
using testing_support::model_fixture_names;

nlohmann::json read_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

int32_t argmax(const float* row, int64_t n) {
  return static_cast<int32_t>(std::max_element(row, row + n) - row);
}

class ParityTest : public testing::TestWithParam<std::string> {};

TEST_P(ParityTest, LogitsMatchReference) {
  const auto dir = kModels / GetParam();
  const nlohmann::json ref = read_json(dir / "reference.json");
  const auto prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
  const NpyArray expected = read_npy_f32(dir / "logits.npy");

  auto model = Model::load(dir, LoadOptions{.prefault = false});
  Decoder& decoder = model->decoder();
  const int64_t V = decoder.config().vocab_size;
  ASSERT_EQ(expected.shape, (std::vector<int64_t>{static_cast<int64_t>(prompt.size()), V}));
  KvCache cache = decoder.make_cache(64);
  std::vector<float> logits(prompt.size() * V, NAN);
  decoder.forward(prompt, cache, logits, /*all_positions=*/true);

  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    ASSERT_TRUE(std::isfinite(logits[i])) << "logit " << i << " not written or not finite";
    diff += std::pow(double{logits[i]} - expected.data[i], 2);
    norm += std::pow(double{expected.data[i]}, 2);
  }
  const double rel = std::sqrt(diff / norm);
  const double bound = ref["max_rel_error"].get<double>();
  EXPECT_LE(rel, bound) << GetParam() << ": ||ours - ref|| / ||ref|| = " << rel;
  std::printf("%s: relative logit error %.3g (bound %.0e)\n", GetParam().c_str(), rel, bound);
}

TEST_P(ParityTest, GreedyContinuationMatchesWithKvCache) {
  const auto dir = kModels / GetParam();
  const nlohmann::json ref = read_json(dir / "reference.json");
  const auto prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
  const auto greedy = ref["greedy_ids"].get<std::vector<int32_t>>();

  auto model = Model::load(dir, LoadOptions{.prefault = false});
  Decoder& decoder = model->decoder();
  const int64_t V = decoder.config().vocab_size;
  KvCache cache = decoder.make_cache(64);
  std::vector<float> logits(V, NAN);
  decoder.forward(prompt, cache, logits, /*all_positions=*/false);
  std::vector<int32_t> ours;
  for (size_t step = 0; step < greedy.size(); ++step) {
    const int32_t next = argmax(logits.data(), V);
    ours.push_back(next);
    const int32_t token[1] = {next};
    decoder.forward(token, cache, logits, /*all_positions=*/false);
  }
  EXPECT_EQ(ours, greedy) << GetParam();
  EXPECT_EQ(cache.length(), static_cast<int64_t>(prompt.size() + greedy.size()));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ParityTest, testing::ValuesIn(model_fixture_names()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace moeinfer
