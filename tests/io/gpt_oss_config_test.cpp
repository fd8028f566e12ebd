// config.json of GPT-OSS as openai/gpt-oss-120b and gpt-oss-20b publish it (the values below are
// the published files' own), the defaults transformers' GptOssConfig fills in, and the fields the
// engine refuses by name rather than run differently from transformers.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "io/model_config.h"
#include "model/layer_plan.h"

namespace moeinfer {
namespace {

using nlohmann::json;

// openai/gpt-oss-120b config.json.
json gpt_oss_120b() {
  json j = json::parse(R"({
    "architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "max_position_embeddings": 131072, "model_type": "gpt_oss",
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "num_local_experts": 128, "output_router_logits": false,
    "pad_token_id": 199999,
    "quantization_config": {
      "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                 "model.embed_tokens", "lm_head"],
      "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": false},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": false, "transformers_version": "4.55.0.dev0",
    "use_cache": true, "vocab_size": 201088})");
  json types = json::array();
  for (int i = 0; i < 18; ++i) {
    types.push_back("sliding_attention");
    types.push_back("full_attention");
  }
  j["layer_types"] = types;
  return j;
}

// openai/gpt-oss-20b differs in depth and expert count.
json gpt_oss_20b() {
  json j = gpt_oss_120b();
  j["num_hidden_layers"] = 24;
  j["num_local_experts"] = 32;
  j["layer_types"].erase(j["layer_types"].begin() + 24, j["layer_types"].end());
  return j;
}

ModelConfig parse(const json& j) { return parse_model_config(j.dump(), "model/config.json"); }

std::string error_of(const json& j) {
  try {
    parse(j);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_published_rope(const RopeConfig& rope) {
  EXPECT_EQ(rope.type, "yarn");
  EXPECT_DOUBLE_EQ(rope.theta, 150000.0);
  EXPECT_DOUBLE_EQ(rope.factor, 32.0);
  EXPECT_DOUBLE_EQ(rope.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(rope.beta_slow, 1.0);
  EXPECT_EQ(rope.original_max_position_embeddings, 4096);
  EXPECT_FALSE(rope.truncate);
}

TEST(GptOssConfig, GptOss120bAsPublished) {
  const ModelConfig c = parse(gpt_oss_120b());
  EXPECT_EQ(c.family, ModelFamily::kGptOss);
  EXPECT_EQ(c.vocab_size, 201088);
  EXPECT_EQ(c.hidden_size, 2880);
  EXPECT_EQ(c.num_layers, 36);
  EXPECT_EQ(c.num_heads, 64);
  EXPECT_EQ(c.num_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.q_dim(), 4096);  // past hidden_size
  EXPECT_EQ(c.rotary_dim(), 64);
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.moe_intermediate_size, 2880);
  EXPECT_EQ(c.shared_expert_intermediate_size, 0);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_TRUE(c.attention_out_bias);
  EXPECT_TRUE(c.attention_sinks);
  EXPECT_TRUE(c.router_bias);
  EXPECT_TRUE(c.router_topk_softmax);
  EXPECT_FALSE(c.router_selection_bias);
  EXPECT_TRUE(c.expert_bias);
  ASSERT_TRUE(c.clamped_swiglu.has_value());
  EXPECT_DOUBLE_EQ(c.clamped_swiglu->alpha, 1.702);
  EXPECT_DOUBLE_EQ(c.clamped_swiglu->limit, 7.0);
  EXPECT_TRUE(c.mxfp4);
  EXPECT_FALSE(c.fp8.has_value());
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{200002}));
  expect_published_rope(c.rope);
  ASSERT_EQ(c.sliding_window, 128);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    EXPECT_EQ(c.window_of(l), l % 2 == 0 ? 128 : 0) << "layer " << l;
    EXPECT_TRUE(c.layer_is_moe[l]);
  }
  const auto plans = plan_layers(c);
  EXPECT_EQ(plans[0].sliding_window, 128);
  EXPECT_EQ(plans[1].sliding_window, 0);
  EXPECT_EQ(plans[35].sliding_window, 0);
  EXPECT_TRUE(plans[0].attention_sinks);
  EXPECT_EQ(plans[0].attention, AttentionKind::kGqa);
  EXPECT_EQ(plans[0].rope, RopePairing::kHalves);
  EXPECT_EQ(plans[0].feed_forward, FeedForwardKind::kMoe);
  EXPECT_EQ(plans[0].shared_expert, SharedExpertKind::kNone);
}

TEST(GptOssConfig, GptOss20bAsPublished) {
  const ModelConfig c = parse(gpt_oss_20b());
  EXPECT_EQ(c.num_layers, 24);
  EXPECT_EQ(c.num_experts, 32);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.window_of(22), 128);
  EXPECT_EQ(c.window_of(23), 0);
}

TEST(GptOssConfig, TransformersDefaultsFillWhatIsAbsent) {
  // save_pretrained leaves out what equals GptOssConfig's defaults.
  const ModelConfig c = parse(json{{"model_type", "gpt_oss"}});
  EXPECT_EQ(c.num_layers, 36);
  EXPECT_EQ(c.head_dim, 64);  // the class default, not hidden_size / heads (45)
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.moe_intermediate_size, 2880);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_FALSE(c.mxfp4);
  expect_published_rope(c.rope);   // yarn when neither rope_scaling nor rope_parameters is given
  EXPECT_EQ(c.window_of(0), 128);  // layers alternate from a sliding first one
  EXPECT_EQ(c.window_of(1), 0);
  EXPECT_DOUBLE_EQ(c.clamped_swiglu->alpha, 1.702);

  // transformers 5 writes rope_parameters, swiglu_alpha, and may leave attention biases off.
  json j = gpt_oss_120b();
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j["rope_parameters"] = {{"rope_type", "yarn"},
                          {"rope_theta", 150000.0},
                          {"factor", 32.0},
                          {"beta_fast", 32.0},
                          {"beta_slow", 1.0},
                          {"truncate", false},
                          {"original_max_position_embeddings", 4096}};
  j["swiglu_alpha"] = 1.5;
  j["attention_bias"] = false;
  j["num_experts"] = 128;  // transformers' alias of num_local_experts
  const ModelConfig t = parse(j);
  expect_published_rope(t.rope);
  EXPECT_DOUBLE_EQ(t.clamped_swiglu->alpha, 1.5);
  EXPECT_FALSE(t.attention_bias);
  EXPECT_FALSE(t.attention_out_bias);
  EXPECT_TRUE(t.attention_sinks);

  // The experts' activation is fixed: transformers never reads hidden_act for gpt_oss.
  j["hidden_act"] = "gelu";
  EXPECT_TRUE(parse(j).clamped_swiglu.has_value());

  // An explicit rope type other than yarn is taken as given.
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}};
  EXPECT_EQ(parse(j).rope.type, "default");
  EXPECT_DOUBLE_EQ(parse(j).rope.theta, 10000.0);
}

TEST(GptOssConfig, RefusesWhatItWouldRunDifferently) {
  json j = gpt_oss_120b();
  j["layer_types"][3] = "chunked_attention";
  EXPECT_NE(error_of(j).find("field 'layer_types': entry 3 is 'chunked_attention'"),
            std::string::npos)
      << error_of(j);
  j = gpt_oss_120b();
  j["layer_types"].erase(j["layer_types"].begin());
  EXPECT_NE(error_of(j).find("field 'layer_types': has 35 entries for 36 layers"),
            std::string::npos)
      << error_of(j);
  j = gpt_oss_120b();
  j["sliding_window"] = nullptr;
  EXPECT_NE(error_of(j).find("field 'sliding_window'"), std::string::npos) << error_of(j);
  j = gpt_oss_120b();
  j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}};
  EXPECT_NE(error_of(j).find("field 'quantization_config.quant_method'"), std::string::npos)
      << error_of(j);
  j = gpt_oss_120b();
  j["rope_scaling"]["rope_type"] = "longrope";
  EXPECT_NE(error_of(j).find("field 'rope_scaling.rope_type'"), std::string::npos) << error_of(j);
  j = gpt_oss_120b();
  j["swiglu_limit"] = 0.0;
  EXPECT_NE(error_of(j).find("field 'swiglu_limit'"), std::string::npos) << error_of(j);
  j = gpt_oss_120b();
  j["swiglu_alpha"] = -1.0;
  EXPECT_NE(error_of(j).find("field 'swiglu_alpha'"), std::string::npos) << error_of(j);
  j = gpt_oss_120b();
  j["num_experts"] = 64;  // disagrees with num_local_experts
  EXPECT_NE(error_of(j).find("field 'num_experts'"), std::string::npos) << error_of(j);
  j = gpt_oss_120b();
  j["partial_rotary_factor"] = 0.5;  // GPT-OSS rotates whole heads
  EXPECT_NE(error_of(j).find("field 'partial_rotary_factor'"), std::string::npos) << error_of(j);
}

TEST(GptOssConfig, Mxfp4IsGptOssOnly) {
  const json qwen = {{"model_type", "qwen3_moe"},
                     {"quantization_config", {{"quant_method", "mxfp4"}}}};
  const std::string error = error_of(qwen);
  EXPECT_NE(error.find("field 'quantization_config.quant_method'"), std::string::npos) << error;
  EXPECT_NE(error.find("gpt_oss"), std::string::npos) << error;
}

}  // namespace
}  // namespace moeinfer
