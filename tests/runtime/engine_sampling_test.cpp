// The engine's side of OpenAI's n / best_of, prompt logprobs (echo) and logit_bias, on the demo
// model: a request of n sequences gives what n single requests give, its later sequences take
// the prompt's blocks from the prefix cache, an abort frees everything, and prompt logprobs
// equal the log-softmax of the model's own logits for the prompt.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "../support/engine_runs.h"
#include "core/error.h"
#include "runtime/engine.h"

namespace moeinfer {
namespace {

class EngineSamplingTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tokenizer_ =
        std::make_unique<Tokenizer>(Tokenizer::from_file(testing::kDemoModel / "tokenizer.json"));
  }
  std::unique_ptr<Engine> make(EngineConfig config = {}) {
    return std::make_unique<Engine>(
        Model::load(testing::kDemoModel, LoadOptions{.prefault = false}),
        Tokenizer::from_file(testing::kDemoModel / "tokenizer.json"), config);
  }
  static std::vector<int32_t> encode(const std::string& text) {
    return tokenizer_->encode(text, true);
  }
  static std::unique_ptr<Tokenizer> tokenizer_;
};
std::unique_ptr<Tokenizer> EngineSamplingTest::tokenizer_;

const char* const kPrompt =
    "Q: What is the difference between a fortune cookie and a computer?\nA:";

TEST_F(EngineSamplingTest, NSequencesEqualSingleRequestsWithSeedPlusIndex) {
  auto engine = make({.block_size = 4});
  std::vector<testing::SequenceRun> alone;
  for (uint64_t i = 0; i < 3; ++i) {
    engine->add_request(encode(kPrompt), testing::seeded_sampling(20, 42 + i));
    alone.push_back(testing::run_sequences(*engine).begin()->second);
  }
  auto fresh = make({.block_size = 4});
  GenerationParams params = testing::seeded_sampling(20, 42);
  params.num_sequences = 3;
  const RequestId id = fresh->add_request(encode(kPrompt), params);
  const auto done = testing::run_sequences(*fresh);
  ASSERT_EQ(done.size(), 3u);
  int num_last = 0;
  for (int64_t i = 0; i < 3; ++i) {
    const testing::SequenceRun& s = done.at({id, i});
    EXPECT_EQ(s.tokens, alone[i].tokens) << "sequence " << i;
    EXPECT_EQ(s.text, alone[i].text) << "sequence " << i;
    EXPECT_EQ(s.finish, FinishReason::kLength);
    num_last += s.num_last;
  }
  EXPECT_EQ(num_last, 1) << "one output closes the request";
  EXPECT_NE(done.at({id, 0}).tokens, done.at({id, 1}).tokens) << "the seeds differ";
  // Sequences 1 and 2 started after sequence 0's prefill and took its full blocks.
  const int64_t prompt_len = static_cast<int64_t>(encode(kPrompt).size());
  EXPECT_GE(fresh->stats().kv.prefix_hits, 2 * ((prompt_len - 1) / 4 * 4));
  EXPECT_EQ(fresh->stats().kv.num_used, 0);
  EXPECT_FALSE(fresh->has_unfinished());
}

TEST_F(EngineSamplingTest, AbortEndsEverySequenceAndFreesTheBlocks) {
  auto engine = make({.block_size = 4});
  GenerationParams params = testing::seeded_sampling(200, 1);
  params.num_sequences = 4;
  const RequestId id = engine->add_request(encode(kPrompt), params);
  // Run until at least two sequences are decoding, then abort.
  for (int i = 0; i < 3; ++i) engine->step();
  EXPECT_GT(engine->stats().kv.num_used, 0);
  engine->abort_request(id);
  const std::vector<RequestOutput> outputs = engine->step();
  ASSERT_EQ(outputs.size(), 4u);
  int num_last = 0;
  for (const RequestOutput& out : outputs) {
    EXPECT_EQ(out.id, id);
    EXPECT_EQ(out.finish, FinishReason::kAbort);
    num_last += out.last ? 1 : 0;
  }
  EXPECT_EQ(num_last, 1);
  EXPECT_TRUE(outputs.back().last);
  EXPECT_FALSE(engine->has_unfinished());
  EXPECT_EQ(engine->stats().kv.num_used, 0);
  EXPECT_EQ(engine->stats().num_running + engine->stats().num_waiting, 0);
}

TEST_F(EngineSamplingTest, AbortBeforeTheSiblingsStarted) {
  auto engine = make({.block_size = 4});
  GenerationParams params = testing::seeded_sampling(8, 1);
  params.num_sequences = 3;
  const RequestId id = engine->add_request(encode(kPrompt), params);
  engine->abort_request(id);
  const std::vector<RequestOutput> outputs = engine->step();
  EXPECT_EQ(outputs.size(), 3u);
  EXPECT_FALSE(engine->has_unfinished());
  EXPECT_EQ(engine->stats().kv.num_used, 0);
}

TEST_F(EngineSamplingTest, CumulativeLogprobIsTheSumOfTheTokensLogprobs) {
  auto engine = make();
  GenerationParams params = testing::seeded_sampling(12, 5);
  params.logprobs = 0;
  const RequestId id = engine->add_request(encode(kPrompt), params);
  double sum = 0.0, reported = 0.0;
  while (engine->has_unfinished()) {
    for (const RequestOutput& out : engine->step()) {
      if (out.id != id) continue;
      for (const TokenLogprob& lp : out.logprobs) sum += lp.logprob;
      reported = out.cumulative_logprob;
    }
  }
  EXPECT_NEAR(reported, sum, 1e-4);
  EXPECT_LT(reported, 0.0);
}

// The reference: one forward pass over the prompt with every position's logits, as
// `moeinfer logits` computes them.
std::vector<float> prompt_logits(const std::vector<int32_t>& ids, int64_t vocab) {
  auto model = Model::load(testing::kDemoModel, LoadOptions{.prefault = false});
  KvCache cache = model->decoder().make_cache(static_cast<int64_t>(ids.size()));
  std::vector<float> logits(ids.size() * static_cast<size_t>(vocab));
  model->decoder().forward(ids, cache, logits, /*all_positions=*/true);
  return logits;
}

double log_softmax_at(std::span<const float> row, int32_t token) {
  const float max = *std::max_element(row.begin(), row.end());
  double total = 0.0;
  for (float l : row) total += std::exp(static_cast<double>(l) - max);
  return row[token] - max - std::log(total);
}

TEST_F(EngineSamplingTest, PromptLogprobsEqualTheModelsLogits) {
  const std::vector<int32_t> ids = encode(kPrompt);
  const int64_t V = make()->model_config().vocab_size;
  const std::vector<float> reference = prompt_logits(ids, V);
  // Chunked prefill (5 tokens a step) beside another request, with the prompt's blocks already
  // in the prefix cache: the scored request must still run every position.
  auto engine = make({.max_num_batched_tokens = 5, .block_size = 4});
  engine->add_request(ids, testing::seeded_sampling(2, 1));
  testing::run_sequences(*engine);
  engine->add_request(encode("Never trust a fortune cookie"), testing::seeded_sampling(6, 2));
  GenerationParams params = testing::seeded_sampling(0, 3);
  params.prompt_logprobs = 2;
  const RequestId id = engine->add_request(ids, params);
  const auto done = testing::run_sequences(*engine);
  const testing::SequenceRun& s = done.at({id, 0});
  EXPECT_TRUE(s.tokens.empty()) << "max_tokens 0 generates nothing";
  EXPECT_EQ(s.finish, FinishReason::kLength);
  ASSERT_EQ(s.prompt_logprobs.size(), ids.size() - 1);
  for (size_t j = 0; j + 1 < ids.size(); ++j) {
    const TokenLogprob& lp = s.prompt_logprobs[j];
    const std::span<const float> row(reference.data() + j * V, V);
    EXPECT_EQ(lp.token, ids[j + 1]);
    EXPECT_NEAR(lp.logprob, log_softmax_at(row, ids[j + 1]), 2e-3) << "position " << j + 1;
    ASSERT_EQ(lp.top.size(), 2u);
    EXPECT_GE(lp.top[0].second, lp.top[1].second);
    EXPECT_GE(lp.top[0].second, lp.logprob - 1e-6f);
  }
  EXPECT_EQ(engine->stats().kv.num_used, 0);
}

TEST_F(EngineSamplingTest, PromptLogprobsSurvivePreemption) {
  const std::vector<int32_t> ids = encode(kPrompt);
  auto reference_engine = make();
  GenerationParams params = testing::seeded_sampling(30, 3);
  params.prompt_logprobs = 0;
  const RequestId ref = reference_engine->add_request(ids, params);
  const auto want = testing::run_sequences(*reference_engine).at({ref, 0});
  // A pool too small for three such requests: some are preempted and recomputed.
  auto engine = make({.max_num_batched_tokens = 6, .block_size = 4, .num_kv_blocks = 16});
  std::vector<RequestId> id_list;
  for (int i = 0; i < 3; ++i) id_list.push_back(engine->add_request(ids, params));
  const auto done = testing::run_sequences(*engine);
  EXPECT_GT(engine->stats().num_preemptions, 0);
  for (RequestId id : id_list) {
    const testing::SequenceRun& s = done.at({id, 0});
    ASSERT_EQ(s.prompt_logprobs.size(), want.prompt_logprobs.size());
    for (size_t j = 0; j < s.prompt_logprobs.size(); ++j) {
      EXPECT_EQ(s.prompt_logprobs[j].token, want.prompt_logprobs[j].token);
      EXPECT_NEAR(s.prompt_logprobs[j].logprob, want.prompt_logprobs[j].logprob, 2e-3);
    }
  }
  EXPECT_EQ(engine->stats().kv.num_used, 0);
}

TEST_F(EngineSamplingTest, LogitBiasBansAndForcesTokens) {
  auto engine = make();
  const std::vector<int32_t> ids = encode(kPrompt);
  GenerationParams greedy{.max_tokens = 6, .ignore_eos = true};
  const RequestId plain = engine->add_request(ids, greedy);
  const auto first = testing::run_sequences(*engine).at({plain, 0});
  ASSERT_EQ(first.tokens.size(), 6u);
  // Banning the greedy first token changes the first token.
  GenerationParams banned = greedy;
  banned.sampling.logit_bias = {{first.tokens[0], -100.0f}};
  const RequestId b = engine->add_request(ids, banned);
  const auto got = testing::run_sequences(*engine).at({b, 0});
  EXPECT_NE(got.tokens[0], first.tokens[0]);
  for (int32_t t : got.tokens) EXPECT_NE(t, first.tokens[0]);
  // +100 on one token makes every token that token, sampled at temperature 1 too.
  GenerationParams forced = testing::seeded_sampling(6, 9);
  forced.sampling.logit_bias = {{1234, 100.0f}};
  const RequestId f = engine->add_request(ids, forced);
  EXPECT_EQ(testing::run_sequences(*engine).at({f, 0}).tokens, std::vector<int32_t>(6, 1234));
  // Ids outside the vocabulary are refused when the request is added.
  GenerationParams bad = greedy;
  bad.sampling.logit_bias = {{static_cast<int32_t>(engine->model_config().vocab_size), 1.0f}};
  EXPECT_THROW(engine->add_request(ids, bad), Error);
}

TEST_F(EngineSamplingTest, RefusesBadSequenceCounts) {
  auto engine = make();
  GenerationParams params = testing::seeded_sampling(4, 1);
  params.num_sequences = 0;
  EXPECT_THROW(engine->add_request(encode(kPrompt), params), Error);
  params.num_sequences = kMaxSequencesPerRequest + 1;
  EXPECT_THROW(engine->add_request(encode(kPrompt), params), Error);
  EXPECT_FALSE(engine->has_unfinished());
}

}  // namespace
}  // namespace moeinfer
