// Constrained decoding through the engine on the demo model: every request with a JSON grammar
// ends either complete ("stop", the text parses and has the schema's shape) or cut by
// max_tokens ("length", a prefix the grammar still takes); n sequences each follow it; the
// logprobs stay the raw model's.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../support/engine_runs.h"
#include "runtime/engine.h"

namespace moeinfer {
namespace {

using json = nlohmann::json;

class EngineJsonTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    engine_ = std::make_unique<Engine>(
        Model::load(testing::kDemoModel, LoadOptions{.prefault = false}),
        Tokenizer::from_file(testing::kDemoModel / "tokenizer.json"), EngineConfig{});
  }
  static void TearDownTestSuite() { engine_.reset(); }
  static std::vector<int32_t> prompt() {
    return engine_->tokenizer().encode("Q: Describe a fortune cookie as JSON.\nA:", true);
  }
  static std::unique_ptr<Engine> engine_;
};
std::unique_ptr<Engine> EngineJsonTest::engine_;

TEST_F(EngineJsonTest, OutputsFollowTheGrammar) {
  const json schema = json::parse(R"({"type": "object", "properties": {
      "text": {"type": "string", "maxLength": 12},
      "stars": {"type": "integer", "minimum": 1, "maximum": 5},
      "tags": {"type": "array", "items": {"enum": ["luck", "love"]}, "maxItems": 2}},
      "required": ["text", "stars", "tags"], "additionalProperties": false})");
  const auto grammars = {JsonGrammar::any_object(), JsonGrammar::from_schema(schema)};
  int stopped = 0;
  for (const auto& grammar : grammars) {
    std::vector<RequestId> ids;
    for (uint64_t seed = 0; seed < 6; ++seed) {
      GenerationParams p{.sampling = {.temperature = seed == 0 ? 0.0f : 1.0f, .seed = seed},
                         .has_seed = true,
                         .max_tokens = 160,
                         .num_sequences = seed == 5 ? 3 : 1,
                         .grammar = grammar};
      ids.push_back(engine_->add_request(prompt(), p));
    }
    for (const auto& [key, s] : testing::run_sequences(*engine_)) {
      ASSERT_TRUE(s.finish == FinishReason::kStop || s.finish == FinishReason::kLength);
      JsonMatcher m(grammar);
      ASSERT_TRUE(m.advance(s.text)) << s.text;
      if (s.finish == FinishReason::kLength) {
        EXPECT_EQ(s.tokens.size(), 160u) << s.text;
        continue;
      }
      ++stopped;
      EXPECT_TRUE(m.can_finish()) << s.text;
      json v;
      ASSERT_NO_THROW(v = json::parse(s.text)) << s.text;
      ASSERT_TRUE(v.is_object()) << s.text;
      if (grammar != *grammars.begin()) {
        EXPECT_EQ(v.size(), 3u) << s.text;
        EXPECT_LE(v["stars"].get<int>(), 5) << s.text;
        EXPECT_LE(v["tags"].size(), 2u) << s.text;
      }
    }
  }
  EXPECT_GE(stopped, 8);
  EXPECT_EQ(engine_->stats().kv.num_used, 0);
}

TEST_F(EngineJsonTest, MaxTokensCutsTheValue) {
  GenerationParams p{.max_tokens = 3, .grammar = JsonGrammar::any_object()};
  engine_->add_request(prompt(), p);
  const auto done = testing::run_sequences(*engine_);
  ASSERT_EQ(done.size(), 1u);
  const testing::SequenceRun& s = done.begin()->second;
  EXPECT_EQ(s.finish, FinishReason::kLength);
  EXPECT_EQ(s.tokens.size(), 3u);
  EXPECT_FALSE(json::accept(s.text)) << s.text;
}

}  // namespace
}  // namespace moeinfer
