// The engine on a model with recurrent state (Qwen3-Next's linear-attention layers, the
// qwen3_next_f32 fixture): every running sequence holds a state slot of its own, so batching,
// chunked prefill, more requests than slots and preemption by recompute (which restarts the
// state from zeros) leave each greedy continuation as the sequence gives alone; the prefix cache
// is off, since a cached prefix has no saved state to resume from.
#include <gtest/gtest.h>

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "../support/engine_runs.h"
#include "runtime/engine.h"

namespace moeinfer {
namespace {

const std::filesystem::path kFixture =
    std::filesystem::path(MOE_FIXTURES_DIR) / "models" / "qwen3_next_f32";

std::unique_ptr<Engine> make_engine(EngineConfig config) {
  return std::make_unique<Engine>(Model::load(kFixture, LoadOptions{.prefault = false}),
                                  Tokenizer::from_file(kFixture / "tokenizer.json"), config);
}

GenerationParams greedy(int64_t max_tokens) {
  return {.max_tokens = max_tokens, .ignore_eos = true, .logprobs = 2};
}

// Equal token for token, or parted where the reference's two best tokens were within rounding
// (the CPU sums in another order at another row count).
void expect_same_up_to_ties(const testing::SequenceRun& got, const testing::SequenceRun& want,
                            size_t index) {
  ASSERT_EQ(got.tokens.size(), want.tokens.size()) << "request " << index;
  for (size_t i = 0; i < want.tokens.size(); ++i) {
    if (got.tokens[i] == want.tokens[i]) continue;
    const auto& top = want.logprobs[i].top;
    ASSERT_GE(top.size(), 2u);
    EXPECT_LT(top[0].second - top[1].second, 1e-3f)
        << "request " << index << ": greedy parted at token " << i << " without a near-tie";
    return;
  }
}

std::vector<std::vector<int32_t>> random_prompts(int64_t vocab) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab - 1));
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t n : {9, 3, 14, 6, 11}) {
    std::vector<int32_t> p(static_cast<size_t>(n));
    for (auto& id : p) id = token(rng);
    prompts.push_back(p);
  }
  return prompts;
}

class StatefulEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto reference = make_engine({});
    prompts_ = random_prompts(reference->model_config().vocab_size);
    for (const auto& p : prompts_) {
      reference->add_request(p, greedy(kTokens));
      alone_.push_back(testing::run_requests(*reference).begin()->second);
    }
  }
  void expect_each_as_alone(Engine& engine) {
    std::vector<RequestId> ids;
    for (const auto& p : prompts_) ids.push_back(engine.add_request(p, greedy(kTokens)));
    auto runs = testing::run_requests(engine);
    for (size_t i = 0; i < ids.size(); ++i) expect_same_up_to_ties(runs[ids[i]], alone_[i], i);
    EXPECT_EQ(engine.stats().kv.num_used, 0);
    EXPECT_EQ(engine.stats().num_running, 0);
  }
  static constexpr int64_t kTokens = 24;
  std::vector<std::vector<int32_t>> prompts_;
  std::vector<testing::SequenceRun> alone_;
};

TEST_F(StatefulEngineTest, BatchedAndChunkedGreedyEqualsOneAtATime) {
  auto engine = make_engine({.max_num_batched_tokens = 5});
  expect_each_as_alone(*engine);
}

TEST_F(StatefulEngineTest, MoreRequestsThanStateSlotsWaitForOne) {
  auto engine = make_engine({.max_num_seqs = 2});
  expect_each_as_alone(*engine);
}

TEST_F(StatefulEngineTest, PreemptionByRecomputeRestartsTheState) {
  // Blocks of 4 tokens, 12 blocks: about one and a half requests fit at a time.
  auto engine = make_engine({.block_size = 4, .num_kv_blocks = 12});
  expect_each_as_alone(*engine);
  EXPECT_GT(engine->stats().num_preemptions, 0);
}

TEST(StatefulEngine, PrefixCachingIsOffAndAPromptRunsInFull) {
  auto engine = make_engine({.block_size = 4});
  EXPECT_FALSE(engine->prefix_caching());
  const std::vector<int32_t> prompt = {5, 17, 301, 44, 9, 120, 7, 66, 210, 3};
  engine->add_request(prompt, greedy(2));
  testing::run_requests(*engine);
  const RequestId id = engine->add_request(prompt, greedy(2));
  int64_t cached = -1;
  while (engine->has_unfinished()) {
    for (const RequestOutput& out : engine->step()) {
      if (out.id == id) cached = out.num_cached_tokens;
    }
  }
  EXPECT_EQ(cached, 0);
  EXPECT_EQ(engine->stats().kv.prefix_hits, 0);
}

TEST(StatefulEngine, ScoreRunsInAStateSlotOfItsOwn) {
  auto engine = make_engine({.max_num_batched_tokens = 4});
  const std::vector<int32_t> ids = {5, 17, 301, 44, 9, 120, 7, 66, 210, 3, 77};
  const int64_t V = engine->model_config().vocab_size;
  std::vector<float> scored(ids.size() * V);
  engine->score(ids, scored);  // in chunks of 4: the state carries across them

  auto model = Model::load(kFixture, LoadOptions{.prefault = false});
  KvCache cache = model->decoder().make_cache(32);
  std::vector<float> expected(ids.size() * V);
  model->decoder().forward(ids, cache, expected, /*all_positions=*/true);
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < expected.size(); ++i) {
    diff = std::max(diff, std::fabs(double{scored[i]} - expected[i]));
    norm = std::max(norm, std::fabs(double{expected[i]}));
  }
  EXPECT_LE(diff / norm, 1e-5);
}

}  // namespace
}  // namespace moeinfer
