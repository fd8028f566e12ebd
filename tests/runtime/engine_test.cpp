// The engine on the demo model: batching, chunking, paging, preemption and the prefix cache change
// where and when tokens are computed, never which tokens greedy decoding picks.
#include "runtime/engine.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "../support/engine_runs.h"
#include "core/error.h"
#include "io/model_config.h"

namespace moeinfer {
namespace {

// Greedy runs that computed the same tokens in different batches agree token for token, except
// where the two most likely tokens are tied to rounding: the CPU kernels sum in a different
// order at different row counts. So: equal, or parted at a near-tie in the reference run.
void expect_same_up_to_ties(const testing::SequenceRun& got, const testing::SequenceRun& want,
                            const std::string& what) {
  ASSERT_EQ(got.tokens.size(), want.tokens.size()) << what;
  for (size_t i = 0; i < want.tokens.size(); ++i) {
    if (got.tokens[i] == want.tokens[i]) continue;
    ASSERT_EQ(want.logprobs.size(), want.tokens.size()) << what;
    const auto& top = want.logprobs[i].top;
    ASSERT_GE(top.size(), 2u);
    EXPECT_LT(top[0].second - top[1].second, 1e-2f)
        << what << ": greedy parted at token " << i << " without a near-tie";
    return;
  }
  EXPECT_EQ(got.text, want.text) << what;
}

class EngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tokenizer_ =
        std::make_unique<Tokenizer>(Tokenizer::from_file(testing::kDemoModel / "tokenizer.json"));
  }
  std::unique_ptr<Engine> make(EngineConfig config) {
    return std::make_unique<Engine>(
        Model::load(testing::kDemoModel, LoadOptions{.prefault = false}),
        Tokenizer::from_file(testing::kDemoModel / "tokenizer.json"), config);
  }
  std::vector<int32_t> encode(const std::string& text) { return tokenizer_->encode(text, true); }
  static GenerationParams greedy(int64_t max_tokens) {
    return {.max_tokens = max_tokens, .ignore_eos = true, .logprobs = 2};
  }
  const std::vector<std::string> prompts_ = {
      "The meaning of life is", "Q: What is a computer?\nA:", "Once upon a time there was",
      "A fortune cookie says:", "Never trust"};
  static std::unique_ptr<Tokenizer> tokenizer_;
};
std::unique_ptr<Tokenizer> EngineTest::tokenizer_;

TEST_F(EngineTest, BatchedGreedyEqualsOneAtATime) {
  std::vector<testing::SequenceRun> alone;
  {
    auto engine = make({});
    for (const auto& p : prompts_) {
      engine->add_request(encode(p), greedy(24));
      alone.push_back(testing::run_requests(*engine).begin()->second);
    }
  }
  // All at once, with a small token budget so prompts are prefilled in chunks beside decodes.
  auto engine = make({.max_num_batched_tokens = 7});
  std::vector<RequestId> ids;
  for (const auto& p : prompts_) ids.push_back(engine->add_request(encode(p), greedy(24)));
  auto batched = testing::run_requests(*engine);
  for (size_t i = 0; i < ids.size(); ++i) {
    expect_same_up_to_ties(batched[ids[i]], alone[i], prompts_[i]);
    EXPECT_EQ(batched[ids[i]].finish, FinishReason::kLength);
    EXPECT_EQ(batched[ids[i]].tokens.size(), 24u);
  }
  EXPECT_EQ(engine->stats().kv.num_used, 0);
}

TEST_F(EngineTest, PreemptionUnderATinyPoolGivesTheSameText) {
  auto reference = make({});
  std::vector<testing::SequenceRun> alone;
  for (const auto& p : prompts_) {
    reference->add_request(encode(p), greedy(40));
    alone.push_back(testing::run_requests(*reference).begin()->second);
  }
  // Blocks of 4 tokens, 14 blocks: about one and a half requests fit at a time.
  auto engine = make({.block_size = 4, .num_kv_blocks = 14});
  std::vector<RequestId> ids;
  for (const auto& p : prompts_) ids.push_back(engine->add_request(encode(p), greedy(40)));
  auto batched = testing::run_requests(*engine);
  EXPECT_GT(engine->stats().num_preemptions, 0);
  for (size_t i = 0; i < ids.size(); ++i) {
    expect_same_up_to_ties(batched[ids[i]], alone[i], prompts_[i]);
  }
  EXPECT_EQ(engine->stats().kv.num_used, 0);
}

TEST_F(EngineTest, RepeatedSystemPromptHitsThePrefixCache) {
  auto engine = make({.block_size = 4});
  const std::string system = "You are a helpful assistant who answers with fortune cookies. ";
  engine->add_request(encode(system + "Hello"), greedy(4));
  testing::run_requests(*engine);
  const int64_t hits_before = engine->stats().kv.prefix_hits;
  const RequestId id = engine->add_request(encode(system + "Goodbye"), greedy(4));
  int64_t cached = 0;
  while (engine->has_unfinished()) {
    for (const RequestOutput& out : engine->step()) {
      if (out.id == id) cached = out.num_cached_tokens;
    }
  }
  EXPECT_GE(cached, 8);
  EXPECT_EQ(engine->stats().kv.prefix_hits - hits_before, cached);
  EXPECT_EQ(engine->stats().kv.num_used, 0);
}

TEST_F(EngineTest, AbortFreesEveryBlock) {
  auto engine = make({});
  const RequestId a = engine->add_request(encode(prompts_[0]), greedy(100));
  const RequestId b = engine->add_request(encode(prompts_[1]), greedy(100));
  engine->step();
  engine->step();
  EXPECT_GT(engine->stats().kv.num_used, 0);
  engine->abort_request(a);
  engine->abort_request(b);
  engine->abort_request(12345);  // unknown: ignored
  const auto outputs = engine->step();
  ASSERT_EQ(outputs.size(), 2u);
  for (const auto& out : outputs) EXPECT_EQ(out.finish, FinishReason::kAbort);
  EXPECT_FALSE(engine->has_unfinished());
  EXPECT_EQ(engine->stats().kv.num_used, 0);
  EXPECT_EQ(engine->stats().num_running, 0);
}

TEST_F(EngineTest, SameSeedSameText) {
  auto engine = make({});
  GenerationParams params{.sampling = {.temperature = 1.0f, .top_p = 0.9f, .seed = 1234},
                          .has_seed = true,
                          .max_tokens = 30,
                          .ignore_eos = true};
  const RequestId a = engine->add_request(encode(prompts_[2]), params);
  const RequestId b = engine->add_request(encode(prompts_[2]), params);
  params.sampling.seed = 99;
  const RequestId c = engine->add_request(encode(prompts_[2]), params);
  auto done = testing::run_requests(*engine);
  EXPECT_EQ(done[a].tokens, done[b].tokens);
  EXPECT_NE(done[a].tokens, done[c].tokens);
}

TEST_F(EngineTest, StopStringEndsTheTextBeforeIt) {
  auto engine = make({});
  const RequestId free_run = engine->add_request(encode(prompts_[3]), greedy(40));
  const std::string full = testing::run_requests(*engine)[free_run].text;
  ASSERT_GE(full.size(), 6u);
  // Stop at a piece from the middle of the greedy text.
  const std::string stop = full.substr(full.size() / 2, 3);
  GenerationParams params = greedy(40);
  params.stop = {stop};
  const RequestId id = engine->add_request(encode(prompts_[3]), params);
  const testing::SequenceRun f = testing::run_requests(*engine)[id];
  EXPECT_EQ(f.finish, FinishReason::kStop);
  EXPECT_EQ(f.text, full.substr(0, full.find(stop)));
}

TEST_F(EngineTest, StopTokenIdEndsGeneration) {
  auto engine = make({});
  const RequestId free_run = engine->add_request(encode(prompts_[4]), greedy(10));
  const auto tokens = testing::run_requests(*engine)[free_run].tokens;
  GenerationParams params = greedy(10);
  params.stop_token_ids = {tokens[3]};
  const RequestId id = engine->add_request(encode(prompts_[4]), params);
  const testing::SequenceRun f = testing::run_requests(*engine)[id];
  EXPECT_EQ(f.finish, FinishReason::kStop);
  const auto first = std::find(tokens.begin(), tokens.end(), tokens[3]) - tokens.begin();
  EXPECT_EQ(f.tokens.size(), static_cast<size_t>(first + 1));
}

TEST_F(EngineTest, LogprobsComeWithEveryToken) {
  auto engine = make({});
  GenerationParams params = greedy(5);
  params.logprobs = 3;
  const RequestId id = engine->add_request(encode(prompts_[0]), params);
  int count = 0;
  while (engine->has_unfinished()) {
    for (const RequestOutput& out : engine->step()) {
      ASSERT_EQ(out.id, id);
      ASSERT_EQ(out.logprobs.size(), out.token_ids.size());
      for (const auto& lp : out.logprobs) {
        ++count;
        ASSERT_EQ(lp.top.size(), 3u);
        EXPECT_EQ(lp.top[0].first, lp.token);  // greedy picks the most likely token
        EXPECT_LE(lp.logprob, 0.0f);
        EXPECT_GE(lp.top[0].second, lp.top[1].second);
      }
    }
  }
  EXPECT_EQ(count, 5);
}

TEST_F(EngineTest, RejectsRequestsThatCannotRun) {
  auto engine = make({});
  EXPECT_THROW(engine->add_request({}, greedy(4)), Error);
  EXPECT_THROW(engine->add_request(std::vector<int32_t>(engine->max_model_len(), 1), greedy(4)),
               Error);
  EXPECT_THROW(engine->add_request({1, 2}, greedy(0)), Error);
  EXPECT_THROW(engine->add_request({1, 1 << 30}, greedy(4)), Error);
  GenerationParams bad = greedy(4);
  bad.sampling.top_p = 0.0f;
  EXPECT_THROW(engine->add_request({1, 2}, bad), Error);
  EXPECT_FALSE(engine->has_unfinished());
}

TEST_F(EngineTest, AContextLongerThanTheModelsIsRefusedNotClamped) {
  const int64_t native = load_model_config(testing::kDemoModel).max_position_embeddings;
  EXPECT_EQ(make({.max_model_len = native})->max_model_len(), native);
  EXPECT_EQ(make({.max_model_len = native / 2})->max_model_len(), native / 2);
  try {
    make({.max_model_len = native + 1});
    ADD_FAILURE() << "a context of " << native + 1 << " was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--max-model-len " + std::to_string(native + 1) +
                                         " exceeds the model's context of " +
                                         std::to_string(native)),
              std::string::npos)
        << e.what();
  }
}

TEST_F(EngineTest, StageProfileCountsEveryExpertRow) {
  auto engine = make({.max_num_batched_tokens = 5, .profile_stages = true});
  for (const auto& p : prompts_) engine->add_request(encode(p), greedy(6));
  testing::run_requests(*engine);
  const EngineStats stats = engine->stats();
  const ModelConfig& config = engine->model_config();
  ASSERT_EQ(stats.num_layers, config.num_layers);
  ASSERT_EQ(stats.num_experts, config.num_experts);
  int64_t rows = 0;
  for (int64_t r : stats.expert_rows) rows += r;
  // Every token computed went through every (MoE) layer and picked K experts there.
  EXPECT_EQ(rows, stats.computed_tokens * config.num_layers * config.num_experts_per_tok);
  ASSERT_EQ(stats.stage_seconds.size(), static_cast<size_t>(profile::kNumStages));
  EXPECT_GT(stats.stage_seconds[static_cast<int>(profile::Stage::kExperts)], 0.0);
  EXPECT_GT(stats.stage_seconds[static_cast<int>(profile::Stage::kAttention)], 0.0);
  // Off by default: nothing is counted.
  EXPECT_TRUE(make({})->stats().expert_rows.empty());
}

// Sampled stage timing (one step in 3): rows are still counted on every step, the timed steps
// are one in three, every step is sorted into prompt or decode steps, and the estimates scale
// each kind's timed steps to all of its steps; timing every step makes them exact.
TEST_F(EngineTest, SampledStageTimingEstimatesPerKindOfStep) {
  auto engine = make({.max_num_batched_tokens = 5, .profile_stages = true, .profile_time_every = 3});
  for (const auto& p : prompts_) engine->add_request(encode(p), greedy(6));
  testing::run_requests(*engine);
  const EngineStats stats = engine->stats();
  const ModelConfig& config = engine->model_config();
  int64_t rows = 0;
  for (int64_t r : stats.expert_rows) rows += r;
  EXPECT_EQ(rows, stats.computed_tokens * config.num_layers * config.num_experts_per_tok);
  EXPECT_EQ(stats.timed_steps, (stats.num_steps + 2) / 3);
  const auto& prompt = stats.stage_samples[EngineStats::kPromptStep];
  const auto& decode = stats.stage_samples[EngineStats::kDecodeStep];
  EXPECT_EQ(prompt.steps + decode.steps, stats.num_steps);
  EXPECT_EQ(prompt.timed_steps + decode.timed_steps, stats.timed_steps);
  EXPECT_GT(prompt.steps, 0);
  EXPECT_GT(decode.steps, 0);
  const std::vector<double> estimated = stats.estimated_stage_seconds();
  const int experts = static_cast<int>(profile::Stage::kExperts);
  double want = 0.0;
  for (const auto* s : {&prompt, &decode}) {
    if (s->timed_steps > 0) {
      want += static_cast<double>(s->steps) / s->timed_steps * s->timed_stage_seconds[experts];
    }
  }
  EXPECT_NEAR(estimated[experts], want, 1e-12);
  EXPECT_GE(estimated[experts], stats.stage_seconds[experts]);

  auto every = make({.max_num_batched_tokens = 5, .profile_stages = true});
  for (const auto& p : prompts_) every->add_request(encode(p), greedy(6));
  testing::run_requests(*every);
  const EngineStats all = every->stats();
  EXPECT_EQ(all.timed_steps, all.num_steps);
  const std::vector<double> exact = all.estimated_stage_seconds();
  for (int stage = 0; stage < profile::kNumStages; ++stage) {
    EXPECT_NEAR(exact[stage], all.stage_seconds[stage], 1e-12) << stage;
  }
}

TEST_F(EngineTest, ContextEndFinishesWithLength) {
  auto engine = make({});
  const int64_t n = engine->max_model_len() - 3;
  const RequestId id = engine->add_request(std::vector<int32_t>(n, 42), greedy(100));
  const testing::SequenceRun f = testing::run_requests(*engine)[id];
  EXPECT_EQ(f.finish, FinishReason::kLength);
  EXPECT_EQ(f.tokens.size(), 3u);
  EXPECT_EQ(engine->stats().kv.num_used, 0);
}

}  // namespace
}  // namespace moeinfer
