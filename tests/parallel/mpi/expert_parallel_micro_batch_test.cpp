// Two micro-batches per step under expert parallelism (--micro-batches 2, built into
// test_mpi_communicator, run under mpirun -np 2 and 3): each rank runs a batch of its own
// sequences (3, 1 or none, so that micro-batch B is empty on some ranks and a whole rank on
// others) through a prefill and two decode steps; the logits are those of the same batch in one
// process within float rounding, with the shared experts overlapping the rows or not, on fixtures
// with shared experts, MLA, linear attention and Llama 4's weights on the expert inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "../../support/compare.h"
#include "model/model.h"
#include "parallel/communicator.h"

namespace moeinfer {
namespace {

using moeinfer::testing::max_rel_diff;

const std::filesystem::path kModels = std::filesystem::path(MOE_FIXTURES_DIR) / "models";

// Each rank's sequences: rank r runs counts[r] of them.
struct RankSequences {
  std::vector<int> counts;  // [3], the first `ranks` used
  std::string name;
};

void PrintTo(const RankSequences& ranks, std::ostream* os) { *os << ranks.name; }

using Param = std::tuple<std::string, bool, RankSequences>;

class MicroBatchTest : public ::testing::TestWithParam<Param> {};

// The logits of prefill + two decode steps of `prompts` as one batch over a fresh pool:
// [steps, sequences, V].
std::vector<float> run_batch(Decoder& decoder, const std::vector<std::vector<int32_t>>& prompts) {
  const ModelConfig& config = decoder.config();
  const int64_t V = config.vocab_size, block_size = 4, num_blocks = 32, decode_steps = 2;
  const size_t n = prompts.size();
  KvBlockPool pool = decoder.make_pool(block_size, num_blocks, std::max<int64_t>(1, n));
  std::vector<std::vector<int32_t>> tables(n);
  int32_t next_block = 0;
  for (size_t s = 0; s < n; ++s) {
    const int64_t length = static_cast<int64_t>(prompts[s].size()) + decode_steps;
    for (int64_t b = 0; b < (length + block_size - 1) / block_size; ++b) {
      tables[s].push_back(next_block++);
    }
  }
  const auto state_slot = [&](size_t s) {
    return config.linear_attention ? static_cast<int32_t>(s) : -1;
  };
  std::vector<float> all;
  std::vector<float> logits(n * V);
  ForwardBatch prefill;
  for (size_t s = 0; s < n; ++s) {
    prefill.sequences.push_back({.tokens = prompts[s],
                                 .position = 0,
                                 .block_table = tables[s],
                                 .state_slot = state_slot(s)});
  }
  decoder.forward(prefill, pool, logits);
  all.insert(all.end(), logits.begin(), logits.end());
  std::vector<int32_t> tokens(n);
  for (int64_t step = 0; step < decode_steps; ++step) {
    ForwardBatch decode;
    for (size_t s = 0; s < n; ++s) {
      tokens[s] = static_cast<int32_t>((3 + 5 * s + 7 * step) % V);
      decode.sequences.push_back({.tokens = std::span<const int32_t>(&tokens[s], 1),
                                  .position = static_cast<int64_t>(prompts[s].size()) + step,
                                  .block_table = tables[s],
                                  .state_slot = state_slot(s)});
    }
    std::fill(logits.begin(), logits.end(), NAN);
    decoder.forward(decode, pool, logits);
    all.insert(all.end(), logits.begin(), logits.end());
  }
  return all;
}

TEST_P(MicroBatchTest, LogitsOfOneProcess) {
  const auto& [fixture, overlap, ranks] = GetParam();
  parallel::Communicator& world = parallel::world();
  const int me = world.rank();
  ASSERT_LE(world.size(), static_cast<int>(ranks.counts.size()));
  auto model = Model::load(kModels / fixture, LoadOptions{.prefault = false});
  Decoder& decoder = model->decoder();
  const int64_t V = decoder.config().vocab_size;
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(ranks.counts[me]));
  for (size_t s = 0; s < prompts.size(); ++s) {  // 3 to 6 tokens, different on every rank
    for (size_t i = 0; i < 3 + (s + me) % 4; ++i) {
      prompts[s].push_back(static_cast<int32_t>((1 + me + 2 * s + 3 * i) % V));
    }
  }
  // Every expert here (a rank without sequences has nothing to compare).
  const std::vector<float> want =
      prompts.empty() ? std::vector<float>{} : run_batch(decoder, prompts);

  decoder.set_expert_parallel(&world, std::nullopt, overlap, moe::DispatchDtype::kF32,
                              /*micro_batches=*/2);
  const std::vector<float> got = run_batch(decoder, prompts);
  decoder.set_expert_parallel(nullptr);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_LE(max_rel_diff(got, want), 1e-5)
      << fixture << " rank " << me << " with " << prompts.size() << " sequences";
}

TEST(MicroBatchTest, TwoNeedExpertParallelism) {
  auto model = Model::load(kModels / "qwen3_moe_f32", LoadOptions{.prefault = false});
  EXPECT_THROW(model->decoder().set_expert_parallel(nullptr, std::nullopt, true,
                                                    moe::DispatchDtype::kF32, 2),
               Error);
  EXPECT_THROW(model->decoder().set_expert_parallel(&parallel::world(), std::nullopt, true,
                                                    moe::DispatchDtype::kF32, 3),
               Error);
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, MicroBatchTest,
    ::testing::Combine(::testing::Values("qwen2_moe_f32", "deepseek_v3_f32", "llama4_text_f32",
                                         "qwen3_next_f32"),
                       ::testing::Bool(),
                       ::testing::Values(RankSequences{{3, 1, 0}, "three_one_none"},
                                         RankSequences{{2, 0, 3}, "two_none_three"})),
    [](const ::testing::TestParamInfo<Param>& info) {
      return std::get<0>(info.param) + (std::get<1>(info.param) ? "_overlap_" : "_no_overlap_") +
             std::get<2>(info.param).name;
    });

}  // namespace
}  // namespace moeinfer
