// Routing traces round-trip through the file, summarise to hand-checked numbers, reject
// truncated or foreign files, and record every MoE layer of every step of a real model.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "model/model.h"
#include "profile/routing_trace.h"
#include "../support/temp_path.h"

namespace moeinfer {
namespace {

std::filesystem::path temp_file(const std::string& name) {
  return moeinfer::testing::unique_temp_path(name + ".trace");
}

moe::Routing routing(int64_t tokens, std::vector<int32_t> ids, std::vector<float> weights) {
  return moe::Routing{.num_tokens = tokens, .top_k = 2, .topk_ids = std::move(ids),
                      .topk_weights = std::move(weights)};
}

TEST(RoutingTrace, RoundTripAndSummary) {
  const auto path = temp_file("roundtrip");
  {
    RoutingTraceWriter writer(path, /*num_layers=*/2, /*num_experts=*/4, /*top_k=*/2);
    // Step 0: layer 1, two tokens: {0,1} and {0,2}.
    writer.record(1, routing(2, {0, 1, 0, 2}, {0.75f, 0.25f, 0.5f, 0.5f}));
    writer.next_step();
    // Step 1: layer 1, one token {0,1}. Step 3 (after an empty step 2): {3,0}.
    writer.record(1, routing(1, {0, 1}, {0.5f, 0.5f}));
    writer.next_step();
    writer.next_step();
    writer.record(1, routing(1, {3, 0}, {0.6f, 0.4f}));
    EXPECT_EQ(writer.records(), 3);
  }
  const RoutingTrace trace = read_routing_trace(path);
  ASSERT_EQ(trace.records.size(), 3u);
  EXPECT_EQ(trace.records[2].step, 3u);
  EXPECT_EQ(trace.records[0].weights[0], 0.75f);  // bf16 holds these exactly
  const auto layers = summarize_routing_trace(trace, 2);
  const LayerSummary& s = layers[1];
  EXPECT_EQ(s.tokens, 4);
  EXPECT_EQ(s.load, (std::vector<int64_t>{4, 2, 1, 1}));
  EXPECT_DOUBLE_EQ(s.max_over_mean, 4.0 / 2.0);
  EXPECT_EQ(s.unused_experts, 0);
  ASSERT_EQ(s.top_pairs.size(), 2u);
  EXPECT_EQ(s.top_pairs[0], std::make_tuple(0, 1, int64_t{2}));
  // Expert 0: steps 0, 1, 3 -> distances 1 and 2; expert 1: steps 0, 1 -> 1.
  EXPECT_EQ(s.reuse_samples, 3);
  EXPECT_EQ(s.reuse_within_1_step, 2);
  EXPECT_NEAR(s.mean_reuse_distance, 4.0 / 3.0, 1e-12);
  EXPECT_EQ(layers[0].tokens, 0);
  std::filesystem::remove(path);
}

TEST(RoutingTrace, RejectsTruncatedAndForeignFiles) {
  const auto path = temp_file("truncated");
  {
    RoutingTraceWriter writer(path, 1, 4, 2);
    writer.record(0, routing(2, {0, 1, 2, 3}, {0.5f, 0.5f, 0.5f, 0.5f}));
  }
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 3);
  EXPECT_THROW(read_routing_trace(path), Error);
  std::ofstream(path, std::ios::binary) << "not a trace at all";
  EXPECT_THROW(read_routing_trace(path), Error);
  std::filesystem::remove(path);
}

TEST(RoutingTrace, RecordsEveryMoeLayerOfEveryStep) {
  const auto dir = std::filesystem::path(MOE_FIXTURES_DIR) / "models" / "qwen3_moe_f32";
  auto model = Model::load(dir, LoadOptions{.prefault = false});
  Decoder& decoder = model->decoder();
  const ModelConfig& c = decoder.config();
  const auto path = temp_file("model");
  int64_t moe_layers = 0;
  for (bool is_moe : c.layer_is_moe) moe_layers += is_moe;
  {
    RoutingTraceWriter writer(path, c.num_layers, c.num_experts, c.num_experts_per_tok);
    decoder.set_routing_observer(
        [&](int64_t layer, const moe::Routing& r) { writer.record(layer, r); });
    KvCache cache = decoder.make_cache(16);
    std::vector<float> logits(c.vocab_size);
    const std::vector<int32_t> prompt = {5, 6, 7, 8};
    decoder.forward(prompt, cache, logits, false);
    writer.next_step();
    for (int32_t t : {9, 10}) {
      const int32_t token[1] = {t};
      decoder.forward(token, cache, logits, false);
      writer.next_step();
    }
    decoder.set_routing_observer({});
  }
  const RoutingTrace trace = read_routing_trace(path);
  EXPECT_EQ(static_cast<int64_t>(trace.records.size()), 3 * moe_layers);
  EXPECT_EQ(trace.records.front().num_tokens, 4u);
  EXPECT_EQ(trace.records.back().num_tokens, 1u);
  EXPECT_EQ(trace.records.back().step, 2u);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace moeinfer
