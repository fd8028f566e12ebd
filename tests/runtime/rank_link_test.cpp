// What travels between rank 0 and the other ranks of an expert-parallel server: orders and
// reports survive the bytes field for field, a short or corrupted buffer is refused rather than
// read past its end, a new request goes to the least-loaded rank, and a rank's engine reports
// under rank 0's ids.
#include "runtime/rank_link.h"

#include <gtest/gtest.h>

#include <map>
#include <random>

#include "../support/engine_runs.h"
#include "core/error.h"
#include "model/model.h"
#include "runtime/engine_ranks.h"

namespace moeinfer {
namespace {

RankOrders sample_orders() {
  RankOrders orders;
  GenerationParams params;
  params.sampling = {.temperature = 0.7f,
                     .top_k = 40,
                     .top_p = 0.9f,
                     .min_p = 0.05f,
                     .repetition_penalty = 1.1f,
                     .presence_penalty = 0.5f,
                     .frequency_penalty = -0.25f,
                     .logit_bias = {{3, -100.0f}, {9, 2.5f}},
                     .seed = 0xdeadbeefcafeull};
  params.has_seed = true;
  params.max_tokens = 33;
  params.stop = {"\n\n", "END", std::string("a\0b", 3)};
  params.stop_token_ids = {2, 7};
  params.ignore_eos = true;
  params.include_stop_str_in_output = true;
  params.skip_special_tokens = false;
  params.logprobs = 5;
  params.prompt_logprobs = 1;
  params.num_sequences = 3;
  params.score_sequences = true;
  orders.requests.push_back({.id = 42, .prompt = {1, 5, 9}, .params = params});
  orders.requests.push_back({.id = 43, .prompt = {7}, .params = GenerationParams{}});
  orders.aborts = {7, 11};
  return orders;
}

RankReport sample_report() {
  RankReport report;
  report.load = {.num_running = 2,
                 .num_waiting = 5,
                 .num_queued_tokens = 77,
                 .has_unfinished = true,
                 .prompt_tokens = 100,
                 .generation_tokens = 50,
                 .num_preemptions = 1,
                 .kv_blocks = 64,
                 .kv_used = 12,
                 .kv_cached = 3,
                 .prefix_queries = 40,
                 .prefix_hits = 16};
  RequestOutput out;
  out.id = 42;
  out.index = 2;
  out.token_ids = {17};
  out.text = "h\xc3\xa9llo";
  out.logprobs = {{.token = 17, .logprob = -0.5f, .rank = 2, .top = {{4, -0.25f}, {17, -0.5f}}}};
  out.prompt_logprobs = {{.token = 5, .logprob = -3.0f}, {.token = 9, .logprob = -1.0f}};
  out.cumulative_logprob = -1.75;
  out.finish = FinishReason::kLength;
  out.last = true;
  out.num_prompt_tokens = 3;
  out.num_output_tokens = 33;
  out.num_cached_tokens = 2;
  report.outputs = {out, RequestOutput{.id = 43}};
  report.started = {43, 44};
  report.refused = {{.id = 45, .message = "the prompt has no tokens"}};
  return report;
}

void expect_same_logprobs(const std::vector<TokenLogprob> &got,
                          const std::vector<TokenLogprob> &want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].token, want[i].token);
    EXPECT_EQ(got[i].logprob, want[i].logprob);
    EXPECT_EQ(got[i].rank, want[i].rank);
    EXPECT_EQ(got[i].top, want[i].top);
  }
}

TEST(RankLinkTest, OrdersRoundTrip) {
  const RankOrders want = sample_orders();
  const RankOrders got = decode_orders(encode_orders(want));
  ASSERT_EQ(got.requests.size(), want.requests.size());
  for (size_t i = 0; i < want.requests.size(); ++i) {
    const RankRequest &g = got.requests[i], &w = want.requests[i];
    EXPECT_EQ(g.id, w.id);
    EXPECT_EQ(g.prompt, w.prompt);
    const SamplingParams &gs = g.params.sampling, &ws = w.params.sampling;
    EXPECT_EQ(gs.temperature, ws.temperature);
    EXPECT_EQ(gs.top_k, ws.top_k);
    EXPECT_EQ(gs.top_p, ws.top_p);
    EXPECT_EQ(gs.min_p, ws.min_p);
    EXPECT_EQ(gs.repetition_penalty, ws.repetition_penalty);
    EXPECT_EQ(gs.presence_penalty, ws.presence_penalty);
    EXPECT_EQ(gs.frequency_penalty, ws.frequency_penalty);
    EXPECT_EQ(gs.logit_bias, ws.logit_bias);
    EXPECT_EQ(gs.seed, ws.seed);
    EXPECT_EQ(g.params.has_seed, w.params.has_seed);
    EXPECT_EQ(g.params.max_tokens, w.params.max_tokens);
    EXPECT_EQ(g.params.stop, w.params.stop);
    EXPECT_EQ(g.params.stop_token_ids, w.params.stop_token_ids);
    EXPECT_EQ(g.params.ignore_eos, w.params.ignore_eos);
    EXPECT_EQ(g.params.include_stop_str_in_output, w.params.include_stop_str_in_output);
    EXPECT_EQ(g.params.skip_special_tokens, w.params.skip_special_tokens);
    EXPECT_EQ(g.params.logprobs, w.params.logprobs);
    EXPECT_EQ(g.params.prompt_logprobs, w.params.prompt_logprobs);
    EXPECT_EQ(g.params.num_sequences, w.params.num_sequences);
    EXPECT_EQ(g.params.score_sequences, w.params.score_sequences);
  }
  EXPECT_EQ(got.aborts, want.aborts);
  EXPECT_TRUE(decode_orders(encode_orders(RankOrders{})).empty());
}

TEST(RankLinkTest, ReportRoundTrip) {
  const RankReport want = sample_report();
  const RankReport got = decode_report(encode_report(want));
  const RankLoad &g = got.load, &w = want.load;
  EXPECT_EQ(g.num_running, w.num_running);
  EXPECT_EQ(g.num_waiting, w.num_waiting);
  EXPECT_EQ(g.num_queued_tokens, w.num_queued_tokens);
  EXPECT_EQ(g.has_unfinished, w.has_unfinished);
  EXPECT_EQ(g.prompt_tokens, w.prompt_tokens);
  EXPECT_EQ(g.generation_tokens, w.generation_tokens);
  EXPECT_EQ(g.num_preemptions, w.num_preemptions);
  EXPECT_EQ(g.kv_blocks, w.kv_blocks);
  EXPECT_EQ(g.kv_used, w.kv_used);
  EXPECT_EQ(g.kv_cached, w.kv_cached);
  EXPECT_EQ(g.prefix_queries, w.prefix_queries);
  EXPECT_EQ(g.prefix_hits, w.prefix_hits);
  ASSERT_EQ(got.outputs.size(), want.outputs.size());
  for (size_t i = 0; i < want.outputs.size(); ++i) {
    const RequestOutput &go = got.outputs[i], &wo = want.outputs[i];
    EXPECT_EQ(go.id, wo.id);
    EXPECT_EQ(go.index, wo.index);
    EXPECT_EQ(go.token_ids, wo.token_ids);
    EXPECT_EQ(go.text, wo.text);
    expect_same_logprobs(go.logprobs, wo.logprobs);
    expect_same_logprobs(go.prompt_logprobs, wo.prompt_logprobs);
    EXPECT_EQ(go.cumulative_logprob, wo.cumulative_logprob);
    EXPECT_EQ(go.finish, wo.finish);
    EXPECT_EQ(go.last, wo.last);
    EXPECT_EQ(go.num_prompt_tokens, wo.num_prompt_tokens);
    EXPECT_EQ(go.num_output_tokens, wo.num_output_tokens);
    EXPECT_EQ(go.num_cached_tokens, wo.num_cached_tokens);
  }
  EXPECT_EQ(got.started, want.started);
  ASSERT_EQ(got.refused.size(), 1u);
  EXPECT_EQ(got.refused[0].id, 45u);
  EXPECT_EQ(got.refused[0].message, want.refused[0].message);
}

TEST(RankLinkTest, ShortOrCorruptBytesAreRefused) {
  const std::vector<uint8_t> orders = encode_orders(sample_orders());
  const std::vector<uint8_t> report = encode_report(sample_report());
  // Every truncation fails cleanly (no read past the end), and so does a trailing byte.
  for (size_t n = 0; n < orders.size(); ++n) {
    EXPECT_THROW(decode_orders(std::span(orders).first(n)), Error) << n;
  }
  for (size_t n = 0; n < report.size(); ++n) {
    EXPECT_THROW(decode_report(std::span(report).first(n)), Error) << n;
  }
  std::vector<uint8_t> longer = orders;
  longer.push_back(0);
  EXPECT_THROW(decode_orders(longer), Error);
  // A huge length is refused before anything is allocated for it.
  std::vector<uint8_t> huge(8, 0xff);
  EXPECT_THROW(decode_orders(huge), Error);
  // Random bytes never crash the decoder.
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<uint8_t> bytes = report;
    bytes[rng() % bytes.size()] ^= static_cast<uint8_t>(1 + rng() % 255);
    try {
      decode_report(bytes);
    } catch (const Error &) {
    }
  }
}

TEST(RankLinkTest, ConstrainedRequestsDoNotTravel) {
  RankOrders orders;
  orders.requests.push_back({.id = 1, .prompt = {1}});
  orders.requests[0].params.grammar = JsonGrammar::any_object();
  EXPECT_THROW(encode_orders(orders), Error);
}

TEST(RankLinkTest, LeastLoadedRank) {
  const auto load = [](int64_t running, int64_t waiting, int64_t queued) {
    return RankLoad{.num_running = running, .num_waiting = waiting, .num_queued_tokens = queued};
  };
  EXPECT_EQ(least_loaded_rank(std::vector{load(0, 0, 0)}), 0);
  // Fewest running + waiting wins, whatever the split between them.
  EXPECT_EQ(least_loaded_rank(std::vector{load(3, 0, 0), load(1, 1, 900), load(0, 3, 0)}), 1);
  // Ties go to the fewest queued tokens, then to the lowest rank.
  EXPECT_EQ(least_loaded_rank(std::vector{load(1, 1, 50), load(2, 0, 10), load(0, 2, 10)}), 1);
  EXPECT_EQ(least_loaded_rank(std::vector{load(1, 0, 5), load(1, 0, 5)}), 0);
  EXPECT_THROW(least_loaded_rank(std::vector<RankLoad>{}), Error);
}

// A rank's engine under rank 0's ids: outputs come back under them, started and refused
// requests are reported, aborts find their request.
TEST(RankLinkTest, RankEngineReportsUnderRankZeroIds) {
  Engine engine(Model::load(testing::kDemoModel, LoadOptions{.prefault = false}),
                Tokenizer::from_file(testing::kDemoModel / "tokenizer.json"), EngineConfig{});
  RankEngine rank(engine);
  RankOrders orders;
  orders.requests.push_back(
      {.id = 1000, .prompt = {1, 2, 3}, .params = {.max_tokens = 3, .ignore_eos = true}});
  orders.requests.push_back(
      {.id = 2000, .prompt = {4, 5}, .params = {.max_tokens = 50, .ignore_eos = true}});
  orders.requests.push_back({.id = 3000, .prompt = {}, .params = {}});  // refused: no tokens
  rank.apply(std::move(orders));
  RankReport first = rank.step();
  ASSERT_EQ(first.refused.size(), 1u);
  EXPECT_EQ(first.refused[0].id, 3000u);
  EXPECT_NE(first.refused[0].message.find("no tokens"), std::string::npos);
  EXPECT_EQ(first.started, (std::vector<RequestId>{1000, 2000}));
  EXPECT_EQ(first.load.num_running, 2);
  std::map<RequestId, int64_t> tokens;
  std::map<RequestId, FinishReason> finish;
  for (RankReport report = std::move(first);; report = rank.step()) {
    for (const RequestOutput &out : report.outputs) {
      ASSERT_TRUE(out.id == 1000 || out.id == 2000) << out.id;
      tokens[out.id] += static_cast<int64_t>(out.token_ids.size());
      if (out.last) finish[out.id] = out.finish;
    }
    if (finish.count(1000) && !finish.count(2000)) rank.apply({.aborts = {2000, 99}});
    if (!report.load.has_unfinished) break;
  }
  EXPECT_EQ(tokens[1000], 3);
  EXPECT_EQ(finish[1000], FinishReason::kLength);
  EXPECT_EQ(finish[2000], FinishReason::kAbort);
  EXPECT_LT(tokens[2000], 50);
  EXPECT_FALSE(engine.has_unfinished());
}

}  // namespace
}  // namespace moeinfer
