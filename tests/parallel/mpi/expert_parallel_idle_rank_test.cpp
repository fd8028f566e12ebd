// A rank with nothing to run still steps under expert parallelism (built into
// test_mpi_communicator, run under mpirun -np 2 and 3): the last rank runs empty batches through
// the decoder, zero rows in every layer, while the others run a sequence each; their logits are
// one process's within float rounding, so the idle rank's experts served their rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <vector>

#include "../../support/compare.h"
#include "model/model.h"
#include "parallel/communicator.h"

namespace moeinfer {
namespace {

using moeinfer::testing::max_rel_diff;

const std::filesystem::path kModels = std::filesystem::path(MOE_FIXTURES_DIR) / "models";

class IdleRankTest : public ::testing::TestWithParam<std::string> {};

TEST_P(IdleRankTest, EmptyBatchesJoinEveryMoeLayer) {
  parallel::Communicator& world = parallel::world();
  const int me = world.rank();
  const bool idle = me == world.size() - 1;
  auto model = Model::load(kModels / GetParam(), LoadOptions{.prefault = false});
  Decoder& decoder = model->decoder();
  const int64_t V = decoder.config().vocab_size;
  // Each working rank its own prompt (ids 1 + rank ...), then two decode tokens.
  std::vector<int32_t> prompt;
  for (int32_t i = 0; i < 5 + me; ++i) prompt.push_back(static_cast<int32_t>((1 + me + 3 * i) % V));
  const std::vector<int32_t> decode = {static_cast<int32_t>(2 % V), static_cast<int32_t>(7 % V)};

  std::vector<float> want;  // one process: every expert here
  if (!idle) {
    KvCache cache = decoder.make_cache(32);
    std::vector<float> logits(V);
    decoder.forward(prompt, cache, logits, false);
    want = logits;
    for (int32_t t : decode) {
      const int32_t token[1] = {t};
      decoder.forward(token, cache, logits, false);
      want.insert(want.end(), logits.begin(), logits.end());
    }
  }

  decoder.set_expert_parallel(&world);
  std::vector<float> got;
  KvCache cache = decoder.make_cache(32);
  for (size_t step = 0; step <= decode.size(); ++step) {
    if (idle) {
      decoder.forward(ForwardBatch{}, cache.pool(), {});
      continue;
    }
    std::vector<float> logits(V);
    if (step == 0) {
      decoder.forward(prompt, cache, logits, false);
    } else {
      const int32_t token[1] = {decode[step - 1]};
      decoder.forward(token, cache, logits, false);
    }
    got.insert(got.end(), logits.begin(), logits.end());
  }
  decoder.set_expert_parallel(nullptr);
  if (!idle) EXPECT_LE(max_rel_diff(got, want), 1e-5) << "rank " << me;
}

TEST(IdleRankTest, EmptyBatchRefusedWithoutExpertParallelism) {
  auto model = Model::load(kModels / "qwen3_moe_f32", LoadOptions{.prefault = false});
  KvCache cache = model->decoder().make_cache(8);
  EXPECT_THROW(model->decoder().forward(ForwardBatch{}, cache.pool(), {}), Error);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, IdleRankTest,
                         ::testing::Values("qwen3_moe_f32", "deepseek_v3_f32", "qwen2_moe_f32"));

}  // namespace
}  // namespace moeinfer
