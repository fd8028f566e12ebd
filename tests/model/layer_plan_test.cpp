// plan_layers on the published layouts of each family: the decisions both decoders switch on.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "io/model_config.h"
#include "model/layer_plan.h"

namespace moeinfer {
namespace {

ModelConfig parse(nlohmann::json j) {
  j["vocab_size"] = 64;
  j["hidden_size"] = 32;
  j["num_attention_heads"] = 4;
  j["num_key_value_heads"] = j.value("model_type", "").starts_with("deepseek") ? 4 : 2;
  j["max_position_embeddings"] = 64;
  return parse_model_config(j.dump(), "test config");
}

TEST(LayerPlan, EachFamilysQuirksBecomeItsLayersPlans) {
  const auto qwen3 = plan_layers(parse({{"model_type", "qwen3_moe"}, {"num_hidden_layers", 3},
                                        {"num_experts", 4}, {"num_experts_per_tok", 2},
                                        {"moe_intermediate_size", 8}, {"intermediate_size", 16},
                                        {"mlp_only_layers", {1}}, {"head_dim", 8}}));
  ASSERT_EQ(qwen3.size(), 3u);
  EXPECT_EQ(qwen3[0].attention, AttentionKind::kGqa);
  EXPECT_EQ(qwen3[0].qk_norm, QkNormKind::kPerHead);
  EXPECT_EQ(qwen3[0].feed_forward, FeedForwardKind::kMoe);
  EXPECT_EQ(qwen3[1].feed_forward, FeedForwardKind::kDenseMlp);
  EXPECT_EQ(qwen3[0].shared_expert, SharedExpertKind::kNone);
  EXPECT_EQ(qwen3[0].rope, RopePairing::kHalves);

  const auto olmoe = plan_layers(parse({{"model_type", "olmoe"}, {"num_hidden_layers", 1},
                                        {"num_experts", 4}, {"num_experts_per_tok", 2},
                                        {"intermediate_size", 8}, {"clip_qkv", 2.0}}));
  EXPECT_EQ(olmoe[0].qk_norm, QkNormKind::kWholeProjection);
  EXPECT_TRUE(olmoe[0].clip_qkv);

  const auto qwen2 = plan_layers(parse(
      {{"model_type", "qwen2_moe"}, {"num_hidden_layers", 1}, {"num_experts", 4},
       {"num_experts_per_tok", 2}, {"moe_intermediate_size", 8}, {"intermediate_size", 16},
       {"shared_expert_intermediate_size", 24}}));
  EXPECT_EQ(qwen2[0].qk_norm, QkNormKind::kNone);
  EXPECT_EQ(qwen2[0].shared_expert, SharedExpertKind::kSigmoidGated);

  const auto mixtral = plan_layers(parse({{"model_type", "mixtral"}, {"num_hidden_layers", 1},
                                          {"num_local_experts", 4}, {"num_experts_per_tok", 2},
                                          {"intermediate_size", 8}}));
  EXPECT_EQ(mixtral[0].feed_forward, FeedForwardKind::kMoe);
  EXPECT_EQ(mixtral[0].shared_expert, SharedExpertKind::kNone);
  EXPECT_FALSE(mixtral[0].clip_qkv);

  nlohmann::json v3 = {{"model_type", "deepseek_v3"}, {"num_hidden_layers", 3},
                       {"n_routed_experts", 8}, {"num_experts_per_tok", 2}, {"n_group", 2},
                       {"topk_group", 1}, {"n_shared_experts", 1}, {"moe_intermediate_size", 8},
                       {"intermediate_size", 16}, {"first_k_dense_replace", 1},
                       {"q_lora_rank", nullptr}, {"kv_lora_rank", 16}, {"qk_nope_head_dim", 8},
                       {"qk_rope_head_dim", 8}, {"v_head_dim", 8}};
  const auto deepseek = plan_layers(parse(v3));
  EXPECT_EQ(deepseek[0].attention, AttentionKind::kMla);
  EXPECT_EQ(deepseek[0].feed_forward, FeedForwardKind::kDenseMlp);
  EXPECT_EQ(deepseek[0].shared_expert, SharedExpertKind::kNone);  // dense layers have none
  EXPECT_EQ(deepseek[1].feed_forward, FeedForwardKind::kMoe);
  EXPECT_EQ(deepseek[1].shared_expert, SharedExpertKind::kUngated);
  EXPECT_EQ(deepseek[1].rope, RopePairing::kInterleaved);
  v3["rope_interleave"] = false;
  EXPECT_EQ(plan_layers(parse(v3))[1].rope, RopePairing::kHalves);
}

}  // namespace
}  // namespace moeinfer
