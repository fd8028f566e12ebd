// DeepSeek-V2 / V3 config.json: MLA sizes, routing method, dense first layers, fp8, and the
// combinations the reference would run differently, which must be refused by field name.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "io/model_config.h"

namespace moeinfer {
namespace {

nlohmann::json v3_config() {
  return {{"model_type", "deepseek_v3"}, {"vocab_size", 1000}, {"hidden_size", 64},
          {"intermediate_size", 96}, {"moe_intermediate_size", 32}, {"num_hidden_layers", 4},
          {"num_attention_heads", 4}, {"num_key_value_heads", 4}, {"n_routed_experts", 16},
          {"num_experts_per_tok", 4}, {"n_shared_experts", 1}, {"first_k_dense_replace", 2},
          {"kv_lora_rank", 32}, {"q_lora_rank", 24}, {"qk_nope_head_dim", 16},
          {"qk_rope_head_dim", 8}, {"v_head_dim", 16}, {"n_group", 4}, {"topk_group", 2},
          {"routed_scaling_factor", 2.5}, {"norm_topk_prob", true}, {"rope_theta", 10000}};
}

std::string error_of(const nlohmann::json& config) {
  try {
    parse_model_config(config.dump(), "model/config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(DeepseekConfig, V3Fields) {
  const ModelConfig c = parse_model_config(v3_config().dump(), "config.json");
  EXPECT_EQ(c.family, ModelFamily::kDeepseekV3);
  ASSERT_TRUE(c.mla.has_value());
  EXPECT_EQ(c.mla->q_lora_rank, 24);
  EXPECT_EQ(c.mla->cache_width(), 40);
  EXPECT_EQ(c.head_dim, 8);  // transformers: head_dim = qk_rope_head_dim
  EXPECT_EQ(c.topk_method, TopkMethod::kNoauxTc);
  EXPECT_TRUE(c.sigmoid_scores);
  EXPECT_EQ(c.num_groups, 4);
  EXPECT_EQ(c.topk_groups, 2);
  EXPECT_EQ(c.shared_expert_intermediate_size, 32);
  EXPECT_EQ(c.layer_is_moe, (std::vector<bool>{false, false, true, true}));
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_FALSE(c.fp8.has_value());
}

TEST(DeepseekConfig, V2LiteHasNoQueryBottleneck) {
  nlohmann::json j = v3_config();
  j["model_type"] = "deepseek_v2";
  j["q_lora_rank"] = nullptr;
  j["topk_method"] = "greedy";
  j["norm_topk_prob"] = false;
  j["n_shared_experts"] = 2;
  const ModelConfig c = parse_model_config(j.dump(), "config.json");
  EXPECT_EQ(c.mla->q_lora_rank, 0);
  EXPECT_EQ(c.topk_method, TopkMethod::kGreedy);
  EXPECT_FALSE(c.sigmoid_scores);
  EXPECT_EQ(c.shared_expert_intermediate_size, 64);
}

TEST(DeepseekConfig, Fp8QuantizationConfig) {
  nlohmann::json j = v3_config();
  j["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"},
                              {"activation_scheme", "dynamic"}, {"weight_block_size", {128, 128}}};
  const ModelConfig c = parse_model_config(j.dump(), "config.json");
  ASSERT_TRUE(c.fp8.has_value());
  EXPECT_EQ(c.fp8->block_rows, 128);
  j["quantization_config"]["quant_method"] = "bitsandbytes";
  EXPECT_NE(error_of(j).find("quantization_config.quant_method"), std::string::npos);
}

TEST(DeepseekConfig, RefusesWhatTheReferenceWouldRunDifferently) {
  const struct {
    const char* field;
    nlohmann::json value;
  } cases[] = {{"topk_method", "group_limited_greedy"},
               {"scoring_func", "softmax"},
               {"num_key_value_heads", 2},
               {"topk_group", 1},  // with top-5: one group of 4 experts cannot supply 5
               {"n_group", 3},
               {"first_k_dense_replace", 9},
               {"moe_layer_freq", 2},
               {"mlp_bias", true}};
  for (const auto& c : cases) {
    nlohmann::json j = v3_config();
    j[c.field] = c.value;
    if (std::string(c.field) == "topk_group") j["num_experts_per_tok"] = 5;
    const std::string error = error_of(j);
    EXPECT_NE(error.find("model/config.json"), std::string::npos) << c.field << ": " << error;
    EXPECT_NE(error.find(c.field), std::string::npos) << c.field << ": " << error;
  }
}

}  // namespace
}  // namespace moeinfer
