// Serving over the ranks of a job (built into test_mpi_communicator, run under mpirun -np 2 and
// 3): rank 0 drives EngineRanks over every rank's engine, the others follow_rank_zero. The
// engines are batch-invariant (--deterministic), so each request's greedy text is the one a
// single engine gives, whichever rank ran it and whatever shared its steps.
#include "runtime/engine_ranks.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "../../support/engine_runs.h"
#include "model/model.h"
#include "parallel/communicator.h"

namespace moeinfer {
namespace {

std::unique_ptr<Engine> demo_engine(parallel::Communicator* ep) {
  auto model = Model::load(testing::kDemoModel, LoadOptions{.prefault = false});
  model->decoder().set_expert_parallel(ep);
  return std::make_unique<Engine>(std::move(model),
                                  Tokenizer::from_file(testing::kDemoModel / "tokenizer.json"),
                                  EngineConfig{.deterministic = true});
}

GenerationParams greedy(int64_t max_tokens, int64_t n = 1) {
  return {.max_tokens = max_tokens, .ignore_eos = true, .num_sequences = n};
}

const std::vector<std::vector<int32_t>> kPrompts = {
    {1, 5, 9, 2}, {7, 3, 8}, {4, 6, 10, 11, 12}, {13}, {2, 2, 2, 2, 2, 2}};

// Ends the followers' loops however the test on rank 0 ends.
struct StopRanks {
  EngineRanks& ranks;
  ~StopRanks() { ranks.stop(); }
};

TEST(EngineRanksTest, RequestsSpreadOverRanksAndTheirOutputsComeHome) {
  parallel::Communicator& world = parallel::world();
  std::map<std::pair<size_t, int64_t>, std::string> want;  // (prompt, sequence) -> text
  if (world.rank() == 0) {
    auto alone = demo_engine(nullptr);
    std::map<RequestId, size_t> prompt_of;
    for (size_t p = 0; p < kPrompts.size(); ++p) {
      prompt_of[alone->add_request(kPrompts[p], greedy(8, p == 0 ? 2 : 1))] = p;
    }
    for (const auto& [key, run] : testing::run_sequences(*alone)) {
      want[{prompt_of.at(key.first), key.second}] = run.text;
    }
  }
  auto engine = demo_engine(&world);
  if (world.rank() != 0) {
    follow_rank_zero(*engine, world);
    return;
  }
  EngineRanks ranks(*engine, &world);
  StopRanks stop{ranks};
  std::map<RequestId, size_t> prompt_of;
  for (size_t p = 0; p < kPrompts.size(); ++p) {
    prompt_of[ranks.add_request(kPrompts[p], greedy(8, p == 0 ? 2 : 1))] = p;
  }
  const RequestId long_one = ranks.add_request({3, 1, 4, 1, 5}, greedy(400));
  std::map<std::pair<RequestId, int64_t>, testing::SequenceRun> got;
  for (int step = 0; ranks.has_unfinished(); ++step) {
    if (step == 5) ranks.abort_request(long_one);
    for (const RequestOutput& out : ranks.step())
      testing::add_output(got[{out.id, out.index}], out);
  }
  EXPECT_TRUE(ranks.take_refused().empty());
  for (const auto& [key, run] : got) {
    if (key.first == long_one) {
      EXPECT_EQ(run.finish, FinishReason::kAbort);
      EXPECT_LT(run.tokens.size(), 400u);
      continue;
    }
    const size_t p = prompt_of.at(key.first);
    EXPECT_EQ(run.text, want.at({p, key.second})) << "prompt " << p << " sequence " << key.second;
    EXPECT_EQ(run.tokens.size(), 8u);
    EXPECT_EQ(run.finish, FinishReason::kLength);
  }
  std::map<RequestId, int> lasts;  // each request ends once, on one of its sequences
  for (const auto& [key, run] : got) lasts[key.first] += run.num_last;
  for (const auto& [id, count] : lasts) EXPECT_EQ(count, 1) << "request " << id;
  EXPECT_EQ(got.size(), kPrompts.size() + 2);  // prompt 0 has two sequences, plus the long one
  // The least-loaded choice gave every rank some of the requests.
  for (int r = 0; r < world.size(); ++r) {
    EXPECT_GT(ranks.ranks()[r].num_assigned, 0) << "rank " << r;
    EXPECT_EQ(ranks.ranks()[r].load.num_requests(), 0) << "rank " << r;
  }
  const EngineStats stats = ranks.stats();
  EXPECT_EQ(stats.num_running + stats.num_waiting, 0);
  EXPECT_GE(stats.generation_tokens, static_cast<int64_t>(8 * (kPrompts.size() + 1)));
}

}  // namespace
}  // namespace moeinfer
