// The recurrent state of Qwen3-Next's linear-attention layers (kv/state_pool.h): a prompt run in
// chunks continues from the state each chunk leaves (the same logits as one prefill), a slot that
// a new sequence takes is reset at position 0, linear layers hold no KV rows, and batches that
// would run without a state slot, or share one, are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <random>

#include "../support/compare.h"
#include "core/error.h"
#include "model/model.h"

namespace moeinfer {
namespace {

using moeinfer::testing::max_rel_diff;

const std::filesystem::path kModels = std::filesystem::path(MOE_FIXTURES_DIR) / "models";

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (auto& id : out) id = token(rng);
  return out;
}

class RecurrentStateTest : public ::testing::TestWithParam<std::string> {};

TEST_P(RecurrentStateTest, ChunkedPrefillContinuesTheState) {
  auto model = Model::load(kModels / GetParam(), LoadOptions{.prefault = false});
  Decoder& decoder = model->decoder();
  const int64_t V = decoder.config().vocab_size;
  std::mt19937 rng(std::random_device{}());
  const std::vector<int32_t> prompt = random_tokens(17, V, rng);

  KvCache whole = decoder.make_cache(32);
  std::vector<float> expected(V);
  decoder.forward(prompt, whole, expected, false);

  // Chunks of 5, 1, 7 and 4 tokens: shorter and longer than the conv window.
  KvCache chunked = decoder.make_cache(32);
  std::vector<float> logits(V, NAN);
  size_t start = 0;
  for (size_t n : {5, 1, 7, 4}) {
    decoder.forward(std::span<const int32_t>(prompt).subspan(start, n), chunked, logits, false);
    start += n;
  }
  ASSERT_EQ(start, prompt.size());
  const double bound = decoder.config().dtype == "float32" ? 1e-5 : 2e-2;
  EXPECT_LE(max_rel_diff(logits, expected), bound);
}

TEST_P(RecurrentStateTest, ASequenceStartingAtPositionZeroResetsItsSlot) {
  auto model = Model::load(kModels / GetParam(), LoadOptions{.prefault = false});
  Decoder& decoder = model->decoder();
  const int64_t V = decoder.config().vocab_size;
  std::mt19937 rng(std::random_device{}());
  const std::vector<int32_t> first = random_tokens(9, V, rng);
  const std::vector<int32_t> second = random_tokens(6, V, rng);

  KvCache fresh = decoder.make_cache(32);
  std::vector<float> expected(V);
  decoder.forward(second, fresh, expected, false);

  // The same cache (slot 0) after another sequence: clear() puts it back at position 0.
  KvCache reused = decoder.make_cache(32);
  std::vector<float> logits(V, NAN);
  decoder.forward(first, reused, logits, false);
  reused.clear();
  decoder.forward(second, reused, logits, false);
  EXPECT_EQ(logits, expected);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, RecurrentStateTest,
                         ::testing::Values("qwen3_next_f32", "qwen3_next_bf16", "qwen3_5_moe_f32"),
                         [](const auto& info) { return info.param; });

TEST(RecurrentState, LinearLayersHoldNoKvRows) {
  auto model = Model::load(kModels / "qwen3_next_f32", LoadOptions{.prefault = false});
  const Decoder& decoder = model->decoder();
  const ModelConfig& c = decoder.config();
  ASSERT_EQ(c.num_layers, 3);
  ASSERT_EQ(c.num_kv_layers(), 1);  // linear, full, linear
  KvBlockPool pool = decoder.make_pool(4, 8, 2);
  EXPECT_EQ(pool.num_kv_layers(), 1);
  EXPECT_FALSE(pool.has_kv(0));
  EXPECT_TRUE(pool.has_kv(1));
  EXPECT_EQ(pool.bytes_per_token(), static_cast<size_t>(2 * c.kv_dim()) * sizeof(float));
  const RecurrentStatePool& state = pool.recurrent_state();
  EXPECT_EQ(state.num_slots(), 2);
  EXPECT_TRUE(state.has_state(0));
  EXPECT_FALSE(state.has_state(1));
  const LinearAttentionConfig& lin = *c.linear_attention;
  // Per slot: the conv window [conv_dim, kernel - 1] and the state [Nv, Dk, Dv] of each layer.
  EXPECT_EQ(state.shape().bytes_per_slot(),
            static_cast<size_t>(2 * (lin.conv_dim() * (lin.conv_kernel - 1) +
                                     lin.num_value_heads * lin.key_head_dim * lin.value_head_dim)) *
                sizeof(float));
}

TEST(RecurrentState, BatchesWithoutAStateSlotOrSharingOneAreRefused) {
  auto model = Model::load(kModels / "qwen3_next_f32", LoadOptions{.prefault = false});
  Decoder& decoder = model->decoder();
  const int64_t V = decoder.config().vocab_size;
  KvBlockPool pool = decoder.make_pool(4, 8, 2);
  const std::vector<int32_t> tokens = {1, 2, 3};
  const std::vector<int32_t> table_a = {0}, table_b = {1};
  std::vector<float> logits(2 * V);
  const auto message = [&](const ForwardBatch& batch) {
    try {
      decoder.forward(
          batch, pool,
          std::span<float>(logits).first(batch.sequences.size() * static_cast<size_t>(V)));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(ForwardBatch{.sequences = {{.tokens = tokens, .block_table = table_a}}})
                .find("state slot -1"),
            std::string::npos);
  EXPECT_NE(message(ForwardBatch{
                        .sequences = {{.tokens = tokens, .block_table = table_a, .state_slot = 2}}})
                .find("recurrent state for 2 sequences"),
            std::string::npos);
  EXPECT_NE(message(ForwardBatch{
                        .sequences = {{.tokens = tokens, .block_table = table_a, .state_slot = 1},
                                      {.tokens = tokens, .block_table = table_b, .state_slot = 1}}})
                .find("share recurrent state slot 1"),
            std::string::npos);
  // A pool built for another model's layout (rows in every layer) is refused too.
  const ModelConfig& c = decoder.config();
  KvBlockPool plain(c.num_layers, c.kv_dim(), c.kv_dim(), 4, 8);
  EXPECT_THROW(
      decoder.forward(
          ForwardBatch{.sequences = {{.tokens = tokens, .block_table = table_a, .state_slot = 0}}},
          plain, std::span<float>(logits).first(V)),
      Error);
}

}  // namespace
}  // namespace moeinfer
