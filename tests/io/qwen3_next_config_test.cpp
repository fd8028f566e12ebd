// config.json of Qwen3-Next as Qwen/Qwen3-Next-80B-A3B-Instruct publishes it
// (full_attention_interval, not layer_types; rope_theta and partial_rotary_factor at the top
// level), what the engine makes of it, and the fields it refuses by name rather than run
// differently from transformers.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "io/model_config.h"
#include "model/layer_plan.h"

namespace moeinfer {
namespace {

using nlohmann::json;

// Qwen/Qwen3-Next-80B-A3B-Instruct config.json.
json qwen3_next_80b() {
  return json::parse(R"({
    "architectures": ["Qwen3NextForCausalLM"], "attention_bias": false,
    "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
    "eos_token_id": 151645, "full_attention_interval": 4, "head_dim": 256,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_next",
    "moe_intermediate_size": 512, "norm_topk_prob": true, "num_attention_heads": 16,
    "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
    "num_key_value_heads": 2, "output_router_logits": false, "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.57.0.dev0",
    "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");
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

TEST(Qwen3NextConfig, AsPublished) {
  const ModelConfig c = parse(qwen3_next_80b());
  EXPECT_EQ(c.family, ModelFamily::kQwen3Next);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.q_dim(), 16 * 256);
  EXPECT_EQ(c.rotary_dim(), 64);  // a quarter of each head
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e7);
  EXPECT_TRUE(c.qk_norm_per_head);
  EXPECT_TRUE(c.attention_output_gate);
  EXPECT_TRUE(c.norm_weight_offset);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.num_experts, 512);
  EXPECT_EQ(c.num_experts_per_tok, 10);
  EXPECT_EQ(c.moe_intermediate_size, 512);
  EXPECT_EQ(c.shared_expert_intermediate_size, 512);
  EXPECT_TRUE(c.shared_expert_gated);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{151645});
  ASSERT_TRUE(c.linear_attention);
  const LinearAttentionConfig& lin = *c.linear_attention;
  EXPECT_EQ(lin.num_key_heads, 16);
  EXPECT_EQ(lin.num_value_heads, 32);
  EXPECT_EQ(lin.key_head_dim, 128);
  EXPECT_EQ(lin.value_head_dim, 128);
  EXPECT_EQ(lin.conv_kernel, 4);
  EXPECT_EQ(lin.conv_dim(), 2 * 2048 + 4096);
  // full_attention_interval 4: layers 3, 7, ..., 47 attend over a cache, the rest are linear.
  ASSERT_EQ(c.layer_is_linear.size(), 48u);
  for (int64_t l = 0; l < 48; ++l) EXPECT_EQ(c.is_linear_layer(l), (l + 1) % 4 != 0) << l;
  EXPECT_EQ(c.num_kv_layers(), 12);
  const std::vector<LayerPlan> plans = plan_layers(c);
  EXPECT_EQ(plans[0].attention, AttentionKind::kGatedDeltaNet);
  EXPECT_EQ(plans[3].attention, AttentionKind::kGqa);
  EXPECT_TRUE(plans[3].output_gate);
  EXPECT_EQ(plans[3].qk_norm, QkNormKind::kPerHead);
  EXPECT_EQ(plans[0].feed_forward, FeedForwardKind::kMoe);
  EXPECT_EQ(plans[0].shared_expert, SharedExpertKind::kSigmoidGated);
}

TEST(Qwen3NextConfig, DefaultsAreTransformers) {
  // save_pretrained omits values equal to Qwen3NextConfig's defaults.
  const ModelConfig c = parse(json{{"model_type", "qwen3_next"}});
  EXPECT_EQ(c.num_layers, 48);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.intermediate_size, 5632);
  EXPECT_EQ(c.num_experts, 512);
  EXPECT_EQ(c.num_experts_per_tok, 10);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.rope.partial_rotary_factor, 0.25);
  EXPECT_EQ(c.num_kv_layers(), 12);  // full_attention_interval 4
  EXPECT_EQ(c.linear_attention->conv_kernel, 4);
}

TEST(Qwen3NextConfig, LayerTypesAndSparseLayers) {
  json j = qwen3_next_80b();
  j["num_hidden_layers"] = 4;
  j["layer_types"] = {"full_attention", "linear_attention", "linear_attention", "full_attention"};
  j["mlp_only_layers"] = {1};
  j["decoder_sparse_step"] = 1;
  const ModelConfig c = parse(j);
  EXPECT_EQ(c.layer_is_linear, (std::vector<bool>{false, true, true, false}));
  EXPECT_EQ(c.layer_is_moe, (std::vector<bool>{true, false, true, true}));
  // Only full attention: no linear layers, no state.
  j["layer_types"] = {"full_attention", "full_attention", "full_attention", "full_attention"};
  EXPECT_FALSE(parse(j).linear_attention);
}

TEST(Qwen3NextConfig, RefusesWhatItDoesNotRunByName) {
  const auto refused = [](const json& j, const std::string& field) {
    const std::string message = error_of(j);
    EXPECT_NE(message.find("'" + field + "'"), std::string::npos) << message;
  };
  json j = qwen3_next_80b();
  j["num_hidden_layers"] = 2;
  j["layer_types"] = {"linear_attention", "sliding_attention"};
  refused(j, "layer_types");
  j["layer_types"] = {"linear_attention"};  // one entry for two layers
  refused(j, "layer_types");

  j["layer_types"] = {"linear_attention", "linear_attention"};  // no layer with a KV cache
  refused(j, "layer_types");

  j = qwen3_next_80b();
  j["full_attention_interval"] = 0;
  refused(j, "full_attention_interval");
  j["full_attention_interval"] = 49;  // past the 48 layers: all linear
  refused(j, "full_attention_interval");
  j = qwen3_next_80b();
  j["attention_bias"] = true;
  refused(j, "attention_bias");
  j = qwen3_next_80b();
  j["use_sliding_window"] = true;
  refused(j, "use_sliding_window");
  j = qwen3_next_80b();
  j["linear_num_value_heads"] = 24;  // not a multiple of the 16 key heads
  refused(j, "linear_num_value_heads");
  j = qwen3_next_80b();
  j["linear_conv_kernel_dim"] = 0;
  refused(j, "linear_conv_kernel_dim");
  j = qwen3_next_80b();
  j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}};
  refused(j, "quantization_config");
  j = qwen3_next_80b();
  j["hidden_act"] = "gelu";
  refused(j, "hidden_act");
  j = qwen3_next_80b();
  j["rope_scaling"] = {{"rope_type", "mrope"}, {"mrope_section", {11, 11, 10}}};
  refused(j, "rope_scaling.rope_type");
}

}  // namespace
}  // namespace moeinfer

namespace moeinfer {
namespace {

// Qwen/Qwen3.5-35B-A3B's config.json is not in transformers' docs or tests; its text_config
// here takes the values of transformers' Qwen3_5MoeTextConfig, whose defaults are that
// checkpoint's (auto_docstring checkpoint="Qwen/Qwen3.5-35B-A3B"), with the M-RoPE sections of
// Qwen3-VL (11, 11, 10: the 64 rotary dims of a 256-wide head at partial_rotary_factor 0.25).
json qwen35_moe() {
  return json::parse(R"({
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
    "image_token_id": 248056, "video_token_id": 248057, "tie_word_embeddings": false,
    "text_config": {
      "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048,
      "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
      "head_dim": 256, "num_experts": 256, "num_experts_per_tok": 8,
      "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
      "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
      "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
      "max_position_embeddings": 262144, "rms_norm_eps": 1e-06, "dtype": "bfloat16",
      "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                          "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                          "mrope_interleaved": true}},
    "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 27}})");
}

TEST(Qwen35MoeConfig, TheTextConfigIsQwen3NextWithEveryLayerRouted) {
  const ModelConfig c = parse_model_config(qwen35_moe().dump(), "config.json");
  EXPECT_EQ(c.family, ModelFamily::kQwen35Moe);
  EXPECT_EQ(c.model_type, "qwen3_5_moe");
  EXPECT_EQ(c.vocab_size, 248320);
  EXPECT_EQ(c.num_layers, 40);
  EXPECT_EQ(c.rotary_dim(), 64);
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e7);
  EXPECT_TRUE(c.norm_topk_prob);  // the router always renormalises
  EXPECT_TRUE(c.attention_output_gate);
  EXPECT_TRUE(c.norm_weight_offset);
  EXPECT_EQ(c.intermediate_size, 0);
  EXPECT_EQ(c.num_kv_layers(), 10);
  EXPECT_EQ(c.dtype, "bfloat16");
  for (bool routed : c.layer_is_moe) EXPECT_TRUE(routed);
  ASSERT_TRUE(c.linear_attention);
  EXPECT_EQ(c.linear_attention->num_value_heads, 32);
}

TEST(Qwen35MoeConfig, RefusesByName) {
  const auto refused = [](const json& j, const std::string& field) {
    try {
      parse_model_config(j.dump(), "config.json");
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'" + field + "'"), std::string::npos) << e.what();
      return;
    }
    ADD_FAILURE() << field << " was not refused";
  };
  json j = qwen35_moe();
  j.erase("text_config");
  refused(j, "text_config");
  j = qwen35_moe();
  j["text_config"]["model_type"] = "qwen3_vl_moe_text";
  refused(j, "text_config.model_type");
  j = qwen35_moe();
  j["text_config"]["rope_parameters"]["mrope_section"] = {16, 16, 16};  // 96 of 64 dims
  refused(j, "text_config.rope_parameters.mrope_section");
  j = qwen35_moe();
  j["text_config"]["layer_types"] = json::array({"linear_attention"});
  refused(j, "text_config.layer_types");
}

}  // namespace
}  // namespace moeinfer
