// config.json of GLM-4.5, ERNIE 4.5 MoE and Kimi K2 as their Hugging Face checkpoints publish
// them (the values below are the published files' own), what the engine makes of them, and the
// fields it refuses by name rather than run differently from transformers.
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "io/model_config.h"
#include "model/layer_plan.h"

namespace moeinfer {
namespace {

using nlohmann::json;

// zai-org/GLM-4.5-Air config.json.
json glm45_air() {
  return json::parse(R"({
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "partial_rotary_factor": 0.5,
    "initializer_range": 0.02, "intermediate_size": 10944, "max_position_embeddings": 131072,
    "model_type": "glm4_moe", "moe_intermediate_size": 1408, "norm_topk_prob": true,
    "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 128,
    "n_shared_experts": 1, "routed_scaling_factor": 1.0, "num_experts_per_tok": 8,
    "first_k_dense_replace": 1, "num_hidden_layers": 46, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 1000000,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0", "use_cache": true, "use_qk_norm": false,
    "vocab_size": 151552})");
}

// baidu/ERNIE-4.5-21B-A3B-PT config.json (the fields transformers reads, and some it ignores).
json ernie45_21b() {
  return json::parse(R"({
    "architectures": ["Ernie4_5_MoeForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 12288,
    "max_position_embeddings": 131072, "model_type": "ernie4_5_moe", "num_attention_heads": 20,
    "num_key_value_heads": 4, "num_hidden_layers": 28, "pad_token_id": 0, "rms_norm_eps": 1e-05,
    "use_cache": false, "vocab_size": 103424, "rope_theta": 500000, "use_bias": false,
    "tie_word_embeddings": true, "torch_dtype": "bfloat16", "moe_num_experts": 64,
    "moe_num_shared_experts": 2, "moe_layer_start_index": 1, "moe_intermediate_size": 1536,
    "moe_capacity": [64, 64, 64], "moe_gate": "topk", "moe_k": 6, "moe_layer_interval": 1,
    "moe_use_aux_free": true, "num_nextn_predict_layers": 1, "multi_token_pred_lambda": 0.3})");
}

// moonshotai/Kimi-K2-Instruct config.json.
json kimi_k2() {
  return json::parse(R"({
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false,
    "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 163584, "eos_token_id": 163585, "ep_size": 1,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 131072, "model_type": "kimi_k2", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 384, "n_shared_experts": 1,
    "norm_topk_prob": true, "num_attention_heads": 64, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 64, "num_nextn_predict_layers": 0,
    "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid",
    "seq_aux": true, "tie_word_embeddings": false, "topk_group": 1, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "transformers_version": "4.48.3", "use_cache": true,
    "v_head_dim": 128, "vocab_size": 163840})");
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

TEST(NewFamilyConfig, Glm45AirAsPublished) {
  const ModelConfig c = parse(glm45_air());
  EXPECT_EQ(c.family, ModelFamily::kGlm4Moe);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.q_dim(), 96 * 128);  // past hidden_size
  EXPECT_EQ(c.rotary_dim(), 64);   // partial_rotary_factor 0.5
  EXPECT_TRUE(c.attention_bias);
  EXPECT_FALSE(c.attention_out_bias);
  EXPECT_FALSE(c.qk_norm_per_head);
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 1408);
  EXPECT_EQ(c.shared_expert_intermediate_size, 1408);
  EXPECT_FALSE(c.shared_expert_gated);
  EXPECT_EQ(c.topk_method, TopkMethod::kNoauxTc);
  EXPECT_TRUE(c.sigmoid_scores);
  EXPECT_TRUE(c.router_selection_bias);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.num_groups, 1);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);
  EXPECT_EQ(c.layer_is_moe.size(), 46u);
  EXPECT_FALSE(c.layer_is_moe[0]);
  EXPECT_TRUE(c.layer_is_moe[1]);
  EXPECT_TRUE(c.layer_is_moe[45]);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{151329, 151336, 151338}));
  const auto plans = plan_layers(c);
  EXPECT_EQ(plans[0].rope, RopePairing::kHalves);
  EXPECT_EQ(plans[0].qk_norm, QkNormKind::kNone);
  EXPECT_EQ(plans[1].shared_expert, SharedExpertKind::kUngated);
}

TEST(NewFamilyConfig, Glm45FullAndTransformersLayout) {
  // GLM-4.5 (355B): q/k norm, three dense layers, 160 experts, scaling 2.5.
  json j = glm45_air();
  j["use_qk_norm"] = true;
  j["first_k_dense_replace"] = 3;
  j["n_routed_experts"] = 160;
  j["routed_scaling_factor"] = 2.5;
  j["num_hidden_layers"] = 92;
  ModelConfig c = parse(j);
  EXPECT_TRUE(c.qk_norm_per_head);
  EXPECT_EQ(plan_layers(c)[0].qk_norm, QkNormKind::kPerHead);
  EXPECT_EQ(std::count(c.layer_is_moe.begin(), c.layer_is_moe.end(), false), 3);
  // transformers 5 writes the factor inside rope_parameters; absent anywhere it is 0.5.
  json params = glm45_air();
  params.erase("partial_rotary_factor");
  params.erase("rope_theta");
  params.erase("rope_scaling");
  params["rope_parameters"] = {
      {"rope_type", "default"}, {"rope_theta", 1e6}, {"partial_rotary_factor", 0.25}};
  EXPECT_EQ(parse(params).rotary_dim(), 32);
  params["rope_parameters"].erase("partial_rotary_factor");
  EXPECT_EQ(parse(params).rotary_dim(), 64);
  // The dict's value wins over the top level's.
  params["rope_parameters"]["partial_rotary_factor"] = 1.0;
  params["partial_rotary_factor"] = 0.5;
  EXPECT_EQ(parse(params).rotary_dim(), 128);
  // An alias of n_routed_experts must agree with it.
  j = glm45_air();
  j["num_local_experts"] = 64;
  EXPECT_NE(error_of(j).find("field 'num_local_experts'"), std::string::npos) << error_of(j);
}

TEST(NewFamilyConfig, Ernie45AsPublished) {
  const ModelConfig c = parse(ernie45_21b());
  EXPECT_EQ(c.family, ModelFamily::kErnie45Moe);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.rotary_dim(), 128);
  EXPECT_TRUE(c.rope_interleaved);
  EXPECT_DOUBLE_EQ(c.rope.theta, 500000.0);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.num_experts, 64);
  EXPECT_EQ(c.num_experts_per_tok, 6);
  EXPECT_EQ(c.shared_expert_intermediate_size, 2 * 1536);
  EXPECT_FALSE(c.sigmoid_scores);
  EXPECT_EQ(c.topk_method, TopkMethod::kGreedy);
  EXPECT_TRUE(c.router_selection_bias);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 1.0);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_FALSE(c.layer_is_moe[0]);
  EXPECT_TRUE(c.layer_is_moe[1]);
  EXPECT_TRUE(c.layer_is_moe[27]);  // moe_layer_end_index -1: the last layer
  EXPECT_EQ(plan_layers(c)[0].rope, RopePairing::kInterleaved);
  // Defaults when transformers omits them: tied embeddings, theta 500000, 64 experts top-6.
  const ModelConfig d = parse({{"model_type", "ernie4_5_moe"}, {"num_hidden_layers", 2}});
  EXPECT_TRUE(d.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(d.rope.theta, 500000.0);
  EXPECT_EQ(d.num_experts, 64);
  EXPECT_EQ(d.num_experts_per_tok, 6);
}

TEST(NewFamilyConfig, ErnieLayerRule) {
  json j = ernie45_21b();
  j["num_hidden_layers"] = 8;
  j["moe_layer_interval"] = 2;
  j["moe_layer_start_index"] = 2;
  j["moe_layer_end_index"] = 5;
  // (l + 1) % 2 == 0 and 2 <= l <= 5: layers 3 and 5.
  EXPECT_EQ(parse(j).layer_is_moe,
            (std::vector<bool>{false, false, false, true, false, true, false, false}));
  j["moe_layer_interval"] = 0;
  EXPECT_NE(error_of(j).find("field 'moe_layer_interval'"), std::string::npos) << error_of(j);
}

TEST(NewFamilyConfig, ErnieRefusesWhatItWouldRunDifferently) {
  json j = ernie45_21b();
  j["use_bias"] = true;
  EXPECT_NE(error_of(j).find("field 'use_bias'"), std::string::npos) << error_of(j);
  j = ernie45_21b();
  j["moe_norm_min"] = 1e-3;
  EXPECT_NE(error_of(j).find("field 'moe_norm_min'"), std::string::npos) << error_of(j);
  j = ernie45_21b();
  j["num_experts"] = 32;  // transformers' alias of moe_num_experts
  EXPECT_NE(error_of(j).find("field 'num_experts'"), std::string::npos) << error_of(j);
  j = ernie45_21b();
  j["moe_num_experts"] = {64, 64};  // the vision-language layout: not this model_type's
  EXPECT_NE(error_of(j).find("field 'moe_num_experts'"), std::string::npos) << error_of(j);
  j = ernie45_21b();
  j["partial_rotary_factor"] = 0.5;  // ERNIE's modeling code rotates whole heads
  EXPECT_NE(error_of(j).find("field 'partial_rotary_factor'"), std::string::npos) << error_of(j);
  j = ernie45_21b();
  j["rope_scaling"] = {{"rope_type", "longrope"}, {"factor", 2.0}};
  EXPECT_NE(error_of(j).find("field 'rope_scaling.rope_type'"), std::string::npos) << error_of(j);
}

TEST(NewFamilyConfig, KimiK2AsPublished) {
  const ModelConfig c = parse(kimi_k2());
  EXPECT_EQ(c.family, ModelFamily::kKimiK2);
  EXPECT_EQ(c.model_type, "kimi_k2");
  ASSERT_TRUE(c.mla.has_value());
  EXPECT_EQ(c.mla->kv_lora_rank, 512);
  EXPECT_EQ(c.mla->q_lora_rank, 1536);
  EXPECT_TRUE(c.mla->rope_interleave);
  EXPECT_EQ(c.rotary_dim(), 64);
  EXPECT_EQ(c.num_experts, 384);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.num_groups, 1);
  EXPECT_EQ(c.topk_groups, 1);
  EXPECT_EQ(c.topk_method, TopkMethod::kNoauxTc);
  EXPECT_TRUE(c.router_selection_bias);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.827);
  EXPECT_EQ(c.shared_expert_intermediate_size, 2048);
  EXPECT_FALSE(c.layer_is_moe[0]);
  EXPECT_TRUE(c.layer_is_moe[1]);
  EXPECT_EQ(c.rope.type, "yarn");
  EXPECT_DOUBLE_EQ(c.rope.factor, 32.0);
  EXPECT_DOUBLE_EQ(c.rope.beta_fast, 1.0);
  EXPECT_DOUBLE_EQ(c.rope.beta_slow, 1.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 4096);
  ASSERT_TRUE(c.fp8.has_value());
  EXPECT_EQ(c.fp8->block_rows, 128);
  EXPECT_EQ(plan_layers(c)[0].attention, AttentionKind::kMla);
  EXPECT_EQ(plan_layers(c)[0].rope, RopePairing::kInterleaved);
}

TEST(NewFamilyConfig, KimiK2RefusesAnotherRouter) {
  json j = kimi_k2();
  j["topk_method"] = "greedy";
  EXPECT_NE(error_of(j).find("field 'topk_method'"), std::string::npos) << error_of(j);
  EXPECT_NE(error_of(j).find("kimi_k2 routing is noaux_tc"), std::string::npos) << error_of(j);
  j = kimi_k2();
  j["scoring_func"] = "softmax";
  EXPECT_NE(error_of(j).find("field 'scoring_func'"), std::string::npos) << error_of(j);
  j = kimi_k2();
  j["moe_layer_freq"] = 2;
  EXPECT_NE(error_of(j).find("field 'moe_layer_freq'"), std::string::npos) << error_of(j);
}

TEST(NewFamilyConfig, PartialRotaryElsewhereIsRefusedByName) {
  json qwen = {{"model_type", "qwen3_moe"}, {"partial_rotary_factor", 0.5}};
  EXPECT_NE(error_of(qwen).find("field 'partial_rotary_factor'"), std::string::npos)
      << error_of(qwen);
  // GLM: a factor that leaves an odd number of rotary dims.
  json glm = glm45_air();
  glm["head_dim"] = 10;
  EXPECT_NE(error_of(glm).find("field 'partial_rotary_factor'"), std::string::npos)
      << error_of(glm);
  glm = glm45_air();
  glm["partial_rotary_factor"] = 1.5;
  EXPECT_NE(error_of(glm).find("must be in (0, 1]"), std::string::npos) << error_of(glm);
}

}  // namespace
}  // namespace moeinfer
