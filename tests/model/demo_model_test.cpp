// Holds the shipped demo model (models/demo, trained by tools/train_demo.py) to what transformers
// computes with it (tests/fixtures/demo_reference.json, made by tools/make_demo_reference.py):
// the tokenizer's ids for the prompt, the first logits rows within the reference's relative
// bound, and the 16-token greedy continuation with the KV cache on. Also keeps the model within
// the shape and size the project promises (issue 4).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/model_config.h"
#include "io/tokenizer.h"
#include "model/model.h"

namespace moeinfer {
namespace {

const std::filesystem::path kFixtures = MOE_FIXTURES_DIR;
const std::filesystem::path kDemo = kFixtures / ".." / ".." / "models" / "demo";

nlohmann::json reference() {
  std::ifstream in(kFixtures / "demo_reference.json");
  return nlohmann::json::parse(in);
}

int32_t argmax(const float* row, int64_t n) {
  return static_cast<int32_t>(std::max_element(row, row + n) - row);
}

TEST(DemoModel, ShapeAndSizeAsPromised) {
  const ModelConfig config = load_model_config(kDemo / "config.json");
  EXPECT_EQ(config.family, ModelFamily::kQwen3Moe);
  EXPECT_GE(config.num_layers, 4);
  EXPECT_GE(config.num_experts, 16);
  EXPECT_GE(config.num_experts_per_tok, 2);
  EXPECT_TRUE(std::all_of(config.layer_is_moe.begin(), config.layer_is_moe.end(),
                          [](bool moe) { return moe; }));
  uintmax_t bytes = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kDemo)) {
    bytes += entry.file_size();
  }
  EXPECT_LE(bytes, 24u * 1000 * 1000) << "models/demo holds " << bytes << " bytes";
}

TEST(DemoModel, TokenizerMatchesReference) {
  const nlohmann::json ref = reference();
  const Tokenizer tokenizer = Tokenizer::from_file(kDemo / "tokenizer.json");
  EXPECT_EQ(tokenizer.encode(ref["prompt"].get<std::string>(), /*add_special_tokens=*/true),
            ref["prompt_ids"].get<std::vector<int32_t>>());
}

TEST(DemoModel, LogitsMatchReference) {
  const nlohmann::json ref = reference();
  const auto prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
  const auto rows = ref["logits"].get<std::vector<std::vector<float>>>();
  auto model = Model::load(kDemo, LoadOptions{.prefault = false});
  Decoder& decoder = model->decoder();
  const int64_t V = decoder.config().vocab_size;
  ASSERT_FALSE(rows.empty());
  ASSERT_LE(rows.size(), prompt.size());
  KvCache cache = decoder.make_cache(static_cast<int64_t>(prompt.size()));
  std::vector<float> logits(prompt.size() * V, NAN);
  decoder.forward(prompt, cache, logits, /*all_positions=*/true);

  const double bound = ref["max_rel_error"].get<double>();
  double diff = 0.0, norm = 0.0;
  for (size_t r = 0; r < rows.size(); ++r) {
    ASSERT_EQ(static_cast<int64_t>(rows[r].size()), V) << "row " << r;
    double row_diff = 0.0, row_norm = 0.0;
    for (int64_t v = 0; v < V; ++v) {
      const float ours = logits[r * V + v];
      ASSERT_TRUE(std::isfinite(ours)) << "logit [" << r << ", " << v << "] not finite";
      row_diff += std::pow(double{ours} - rows[r][v], 2);
      row_norm += std::pow(double{rows[r][v]}, 2);
    }
    EXPECT_LE(std::sqrt(row_diff / row_norm), bound) << "row " << r;
    diff += row_diff;
    norm += row_norm;
  }
  const double rel = std::sqrt(diff / norm);
  EXPECT_LE(rel, bound) << "||ours - ref|| / ||ref|| = " << rel;
  std::printf("demo model: relative logit error %.3g over %zu rows (bound %.0e)\n", rel,
              rows.size(), bound);
}

TEST(DemoModel, GreedyContinuationMatchesWithKvCache) {
  const nlohmann::json ref = reference();
  const auto prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
  const auto greedy = ref["greedy_ids"].get<std::vector<int32_t>>();
  auto model = Model::load(kDemo, LoadOptions{.prefault = false});
  Decoder& decoder = model->decoder();
  const int64_t V = decoder.config().vocab_size;
  KvCache cache = decoder.make_cache(static_cast<int64_t>(prompt.size() + greedy.size()));
  std::vector<float> logits(V, NAN);
  decoder.forward(prompt, cache, logits, /*all_positions=*/false);
  std::vector<int32_t> ours;
  for (size_t step = 0; step < greedy.size(); ++step) {
    const int32_t next = argmax(logits.data(), V);
    ours.push_back(next);
    const int32_t token[1] = {next};
    decoder.forward(token, cache, logits, /*all_positions=*/false);
  }
  EXPECT_EQ(ours, greedy) << "reference continuation: " << ref["greedy_text"].dump();
}

}  // namespace
}  // namespace moeinfer
