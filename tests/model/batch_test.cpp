// A batched step over several sequences with scattered, shared-pool blocks gives each sequence
// the logits it gets alone: batching and paging change where rows live, never the numbers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <random>

#include "../support/compare.h"
#include "model/model.h"

namespace moeinfer {
namespace {

using moeinfer::testing::max_rel_diff;

const std::filesystem::path kModels = std::filesystem::path(MOE_FIXTURES_DIR) / "models";

class BatchTest : public ::testing::TestWithParam<std::string> {};

TEST_P(BatchTest, BatchedPagedStepsMatchSingleSequences) {
  auto model = Model::load(kModels / GetParam(), LoadOptions{.prefault = false});
  Decoder& decoder = model->decoder();
  const ModelConfig& config = decoder.config();
  const int64_t V = config.vocab_size;
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(V - 1));

  // Three sequences of different prompt lengths, then two decode steps each.
  const std::vector<int64_t> prompt_lengths = {5, 1, 13};
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t n : prompt_lengths) {
    std::vector<int32_t> p(n);
    for (auto& id : p) id = token(rng);
    prompts.push_back(p);
  }
  const int decode_steps = 2;
  std::vector<std::vector<int32_t>> next(prompts.size());
  for (auto& n : next) n = {token(rng), token(rng)};

  // Reference: each sequence alone.
  std::vector<std::vector<float>> alone(prompts.size());  // logits of every step, concatenated
  for (size_t s = 0; s < prompts.size(); ++s) {
    KvCache cache = decoder.make_cache(32);
    std::vector<float> logits(V);
    decoder.forward(prompts[s], cache, logits, false);
    alone[s] = logits;
    for (int step = 0; step < decode_steps; ++step) {
      const int32_t t[1] = {next[s][step]};
      decoder.forward(t, cache, logits, false);
      alone[s].insert(alone[s].end(), logits.begin(), logits.end());
    }
  }

  // Batched: one pool, blocks of 4 handed out in a shuffled order.
  // Models with linear-attention layers also get a recurrent state slot per sequence (in
  // reverse order, so slots and batch positions differ).
  const int64_t block_size = 4;
  KvBlockPool pool = decoder.make_pool(block_size, 24, static_cast<int64_t>(prompts.size()));
  const auto state_slot = [&](size_t s) {
    return config.linear_attention ? static_cast<int32_t>(prompts.size() - 1 - s) : -1;
  };
  std::vector<int32_t> free_blocks(24);
  std::iota(free_blocks.begin(), free_blocks.end(), 0);
  std::shuffle(free_blocks.begin(), free_blocks.end(), rng);
  std::vector<std::vector<int32_t>> tables(prompts.size());
  for (size_t s = 0; s < prompts.size(); ++s) {
    for (int64_t b = 0; b < (prompt_lengths[s] + decode_steps + block_size - 1) / block_size; ++b) {
      tables[s].push_back(free_blocks.back());
      free_blocks.pop_back();
    }
  }
  std::vector<std::vector<float>> batched(prompts.size());
  ForwardBatch prefill;
  for (size_t s = 0; s < prompts.size(); ++s) {
    prefill.sequences.push_back({.tokens = prompts[s],
                                 .position = 0,
                                 .block_table = tables[s],
                                 .state_slot = state_slot(s)});
  }
  std::vector<float> logits(prompts.size() * V, NAN);
  decoder.forward(prefill, pool, logits);
  for (size_t s = 0; s < prompts.size(); ++s) {
    batched[s].assign(logits.begin() + s * V, logits.begin() + (s + 1) * V);
  }
  for (int step = 0; step < decode_steps; ++step) {
    ForwardBatch decode;
    for (size_t s = 0; s < prompts.size(); ++s) {
      decode.sequences.push_back({.tokens = std::span<const int32_t>(&next[s][step], 1),
                                  .position = prompt_lengths[s] + step,
                                  .block_table = tables[s],
                                  .state_slot = state_slot(s)});
    }
    std::fill(logits.begin(), logits.end(), NAN);
    decoder.forward(decode, pool, logits);
    for (size_t s = 0; s < prompts.size(); ++s) {
      batched[s].insert(batched[s].end(), logits.begin() + s * V, logits.begin() + (s + 1) * V);
    }
  }
  // bf16 matrix products may pick a different kernel for another row count.
  const double bound = config.dtype == "float32" ? 1e-5 : 2e-2;
  for (size_t s = 0; s < prompts.size(); ++s) {
    EXPECT_LE(max_rel_diff(batched[s], alone[s]), bound) << GetParam() << " sequence " << s;
  }
}

TEST(BatchTest, RejectsBlockTablesThatDoNotCoverTheTokens) {
  auto model = Model::load(kModels / "qwen3_moe_f32", LoadOptions{.prefault = false});
  Decoder& decoder = model->decoder();
  const ModelConfig& c = decoder.config();
  KvBlockPool pool(c.num_layers, c.kv_dim(), c.kv_dim(), 4, 2);
  const std::vector<int32_t> tokens(9, 1);
  const std::vector<int32_t> table = {0, 1};
  ForwardBatch batch{.sequences = {{.tokens = tokens, .position = 0, .block_table = table}}};
  std::vector<float> logits(c.vocab_size);
  EXPECT_THROW(decoder.forward(batch, pool, logits), Error);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, BatchTest,
                         ::testing::Values("qwen3_moe_f32", "mixtral_bf16", "olmoe_f32",
                                           "qwen2_moe_f32", "deepseek_v2_lite_f32",
                                           "deepseek_v3_f32", "glm4_moe_f32", "glm4_moe_air_bf16",
                                           "ernie4_5_moe_f32", "ernie4_5_moe_i2_bf16",
                                           "kimi_k2_f32", "llama4_text_f32", "llama4_vision_bf16",
                                           "qwen3_next_f32", "qwen3_next_bf16", "qwen3_5_moe_f32",
                                           "qwen3_5_moe_bf16"),
                         [](const auto& info) { return info.param; });

// GPT-OSS: sliding layers beside full ones (windows of 3 and 4 tokens over blocks of 4),
// attention sinks, MXFP4 experts.
INSTANTIATE_TEST_SUITE_P(GptOss, BatchTest,
                         ::testing::Values("gpt_oss_f32", "gpt_oss_d24_bf16", "gpt_oss_mxfp4"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace moeinfer
