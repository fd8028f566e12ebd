// config.json of Llama 4 as its checkpoints publish it (Llama4ForConditionalGeneration: the
// text model in text_config beside a vision_config) and in the text-only layout
// (Llama4ForCausalLM, model_type llama4_text); what the engine makes of them, layer by layer;
// and the fields it refuses by name rather than run differently from transformers.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "io/model_config.h"
#include "model/layer_plan.h"

namespace moeinfer {
namespace {

using nlohmann::json;

// meta-llama/Llama-4-Scout-17B-16E-Instruct config.json (the vision_config shortened to the
// fields that say what it is: the engine does not read it).
json scout() {
  return json::parse(R"({
    "architectures": ["Llama4ForConditionalGeneration"], "boi_token_index": 200080,
    "eoi_token_index": 200081, "image_token_index": 200092, "model_type": "llama4",
    "text_config": {
      "_attn_implementation_autoset": true, "attention_bias": false,
      "attention_chunk_size": 8192, "attention_dropout": 0.0, "attn_scale": 0.1,
      "attn_temperature_tuning": 4, "bos_token_id": 200000,
      "eos_token_id": [200001, 200007, 200008], "floor_scale": 8192,
      "for_llm_compressor": false, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
      "initializer_range": 0.02, "interleave_moe_layer_step": 1, "intermediate_size": 8192,
      "intermediate_size_mlp": 16384, "max_position_embeddings": 10485760,
      "model_type": "llama4_text", "no_rope_layers": [], "num_attention_heads": 40,
      "num_experts_per_tok": 1, "num_hidden_layers": 48, "num_key_value_heads": 8,
      "num_local_experts": 16, "output_router_logits": false, "pad_token_id": 200018,
      "rms_norm_eps": 1e-05,
      "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"},
      "rope_theta": 500000.0, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
      "torch_dtype": "bfloat16", "use_cache": true, "use_qk_norm": true, "vocab_size": 202048},
    "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 1408,
                      "num_hidden_layers": 34, "vision_output_dim": 4096}})");
}

// meta-llama/Llama-4-Maverick-17B-128E-Instruct's text_config (as TensorRT-LLM's tests quote
// it): 128 experts on every other layer, no q/k norm, no RoPE scaling.
json maverick() {
  json j = scout();
  j["text_config"] = json::parse(R"({
    "attention_bias": false, "attention_chunk_size": 8192, "attention_dropout": 0.0,
    "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008],
    "for_llm_compressor": false, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
    "initializer_range": 0.02, "interleave_moe_layer_step": 2, "intermediate_size": 8192,
    "intermediate_size_mlp": 16384, "max_position_embeddings": 1048576,
    "model_type": "llama4_text", "num_attention_heads": 40, "num_experts_per_tok": 1,
    "num_hidden_layers": 48, "num_key_value_heads": 8, "num_local_experts": 128,
    "output_router_logits": false, "pad_token_id": 200018, "rms_norm_eps": 1e-05,
    "rope_scaling": null, "rope_theta": 500000.0, "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0, "torch_dtype": "bfloat16", "use_cache": true,
    "use_qk_norm": false, "vocab_size": 202048})");
  return j;
}

// A text-only Scout fine-tune (Llama4ForCausalLM) as a user published it: the same fields at the
// top level, with moe_layers and no_rope_layers written out.
json scout_text_only() {
  json j = scout()["text_config"];
  j["architectures"] = {"Llama4ForCausalLM"};
  j["cache_implementation"] = "hybrid";
  j["max_position_embeddings"] = 262144;
  j["moe_layers"] = json::array();
  for (int l = 0; l < 48; ++l) j["moe_layers"].push_back(l);
  j["no_rope_layers"] = json::array();
  for (int l = 0; l < 48; ++l) j["no_rope_layers"].push_back((l + 1) % 4 != 0 ? 1 : 0);
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

void expect_refused(const json& j, const std::string& field) {
  const std::string error = error_of(j);
  EXPECT_NE(error.find("field '" + field + "'"), std::string::npos)
      << "expected a refusal naming " << field << ", got: " << error;
}

TEST(Llama4Config, ScoutAsPublished) {
  const ModelConfig c = parse(scout());
  EXPECT_EQ(c.family, ModelFamily::kLlama4);
  EXPECT_EQ(c.model_type, "llama4");
  EXPECT_TRUE(c.has_vision_tower);
  EXPECT_EQ(c.vocab_size, 202048);
  EXPECT_EQ(c.hidden_size, 5120);
  EXPECT_EQ(c.num_layers, 48);
  EXPECT_EQ(c.num_heads, 40);
  EXPECT_EQ(c.num_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.num_experts, 16);
  EXPECT_EQ(c.num_experts_per_tok, 1);
  EXPECT_EQ(c.moe_intermediate_size, 8192);  // intermediate_size: the experts
  EXPECT_EQ(c.intermediate_size, 16384);     // intermediate_size_mlp: dense layers
  EXPECT_EQ(c.shared_expert_intermediate_size, 8192);
  EXPECT_FALSE(c.shared_expert_gated);
  EXPECT_TRUE(c.sigmoid_scores);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_FALSE(c.router_selection_bias);
  EXPECT_TRUE(c.routing_weight_on_input);
  EXPECT_TRUE(c.rope_interleaved);
  EXPECT_TRUE(c.qk_norm_after_rope);
  EXPECT_FALSE(c.qk_norm_per_head);
  EXPECT_EQ(c.rope.type, "llama3");
  EXPECT_DOUBLE_EQ(c.rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(c.rope.factor, 16.0);
  EXPECT_DOUBLE_EQ(c.rope.low_freq_factor, 1.0);  // equal factors: no smoothed band
  EXPECT_DOUBLE_EQ(c.rope.high_freq_factor, 1.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 8192);
  EXPECT_EQ(c.max_position_embeddings, 10485760);
  ASSERT_TRUE(c.attention_temperature.has_value());  // attn_temperature_tuning: 4
  EXPECT_EQ(c.attention_temperature->floor_scale, 8192);
  EXPECT_DOUBLE_EQ(c.attention_temperature->attn_scale, 0.1);
  EXPECT_EQ(c.attention_chunk_size, 8192);
  EXPECT_EQ(c.bos_token_id, 200000);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{200001, 200007, 200008}));
  for (int64_t l = 0; l < 48; ++l) {
    const bool nope = (l + 1) % 4 == 0;  // no_rope_layers [] -> every 4th layer
    EXPECT_EQ(c.uses_rope(l), !nope) << l;
    EXPECT_EQ(c.is_chunked(l), !nope) << l;
    EXPECT_TRUE(c.layer_is_moe[l]) << l;
  }

  const auto plans = plan_layers(c);
  EXPECT_EQ(plans[0].position, PositionEncoding::kRope);
  EXPECT_EQ(plans[0].rope, RopePairing::kInterleaved);
  EXPECT_EQ(plans[0].span, AttentionSpan::kChunked);
  EXPECT_EQ(plans[0].qk_norm, QkNormKind::kAfterRopeWeightless);
  EXPECT_EQ(plans[0].query_scale, QueryScale::kNone);
  EXPECT_EQ(plans[0].feed_forward, FeedForwardKind::kMoe);
  EXPECT_EQ(plans[0].shared_expert, SharedExpertKind::kUngated);
  EXPECT_EQ(plans[3].position, PositionEncoding::kNone);
  EXPECT_EQ(plans[3].span, AttentionSpan::kCausal);
  EXPECT_EQ(plans[3].qk_norm, QkNormKind::kNone);  // q/k norm on RoPE layers only
  EXPECT_EQ(plans[3].query_scale, QueryScale::kTemperature);
}

TEST(Llama4Config, MaverickInterleavesDenseAndRoutedLayers) {
  const ModelConfig c = parse(maverick());
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_FALSE(c.qk_norm_after_rope);
  EXPECT_EQ(c.rope.type, "default");
  for (int64_t l = 0; l < 48; ++l) EXPECT_EQ(c.layer_is_moe[l], l % 2 == 1) << l;
  // attn_temperature_tuning, floor_scale and attn_scale absent: transformers' defaults.
  ASSERT_TRUE(c.attention_temperature.has_value());
  EXPECT_EQ(c.attention_temperature->floor_scale, 8192);
  const auto plans = plan_layers(c);
  EXPECT_EQ(plans[0].feed_forward, FeedForwardKind::kDenseMlp);
  EXPECT_EQ(plans[0].shared_expert, SharedExpertKind::kNone);
  EXPECT_EQ(plans[0].qk_norm, QkNormKind::kNone);
  EXPECT_EQ(plans[1].feed_forward, FeedForwardKind::kMoe);
}

TEST(Llama4Config, TextOnlyLayoutReadsTheSameModel) {
  const ModelConfig nested = parse(scout());
  const ModelConfig flat = parse(scout_text_only());
  EXPECT_EQ(flat.family, ModelFamily::kLlama4);
  EXPECT_EQ(flat.model_type, "llama4_text");
  EXPECT_FALSE(flat.has_vision_tower);
  EXPECT_EQ(flat.layer_is_moe, nested.layer_is_moe);
  EXPECT_EQ(flat.layer_uses_rope, nested.layer_uses_rope);
  EXPECT_EQ(flat.layer_is_chunked, nested.layer_is_chunked);
  EXPECT_EQ(flat.head_dim, nested.head_dim);
  EXPECT_EQ(flat.max_position_embeddings, 262144);
}

TEST(Llama4Config, LayerTypesAndChunkSizeAsWritten) {
  json j = scout_text_only();
  j["num_hidden_layers"] = 4;
  j["no_rope_layers"] = {1, 0, 1, 1, 1};  // longer than the layers: the rest is unread
  j["layer_types"] = {"full_attention", "chunked_attention", "chunked_attention", "full_attention"};
  j["moe_layers"] = {1, 3, 47};  // 47: no such layer, as in the reference
  ModelConfig c = parse(j);
  EXPECT_EQ(c.layer_uses_rope, (std::vector<bool>{true, false, true, true}));
  EXPECT_EQ(c.layer_is_chunked, (std::vector<bool>{false, true, true, false}));
  EXPECT_EQ(c.layer_is_moe, (std::vector<bool>{false, true, false, true}));

  j.erase("layer_types");
  j["attention_chunk_size"] = nullptr;  // no chunks: every layer global
  c = parse(j);
  EXPECT_EQ(c.attention_chunk_size, 0);
  EXPECT_EQ(c.layer_is_chunked, (std::vector<bool>(4, false)));

  j["head_dim"] = nullptr;  // explicit null: hidden_size / heads (absent: 128)
  EXPECT_EQ(parse(j).head_dim, 5120 / 40);
  j.erase("head_dim");
  EXPECT_EQ(parse(j).head_dim, 128);

  j["attn_temperature_tuning"] = false;
  EXPECT_FALSE(parse(j).attention_temperature.has_value());
  j["attn_temperature_tuning"] = 0;
  EXPECT_FALSE(parse(j).attention_temperature.has_value());
}

TEST(Llama4Config, RefusesWhatItWouldRunDifferently) {
  json j = scout();
  j["text_config"]["model_type"] = "llama";
  expect_refused(j, "text_config.model_type");
  j = scout();
  j["text_config"] = "llama4_text";
  expect_refused(j, "text_config");
  j = scout();
  j["text_config"]["no_rope_layers"] = {1, 2, 1};
  expect_refused(j, "text_config.no_rope_layers");
  j = scout();
  j["text_config"]["no_rope_layers"] = {1, 1, 1, 0};  // 4 entries for 48 layers
  expect_refused(j, "text_config.no_rope_layers");
  j = scout();
  j["text_config"]["no_rope_layer_interval"] = 0;
  expect_refused(j, "text_config.no_rope_layer_interval");
  j = scout();
  j["text_config"]["layer_types"] = json::array();
  for (int l = 0; l < 48; ++l) j["text_config"]["layer_types"].push_back("sliding_attention");
  expect_refused(j, "text_config.layer_types");
  j = scout();
  j["text_config"]["layer_types"] = {"chunked_attention"};
  expect_refused(j, "text_config.layer_types");
  j = scout();
  j["text_config"]["attention_chunk_size"] = nullptr;
  j["text_config"]["layer_types"] = json::array();
  for (int l = 0; l < 48; ++l) j["text_config"]["layer_types"].push_back("chunked_attention");
  expect_refused(j, "text_config.attention_chunk_size");
  j = scout();
  j["text_config"]["attention_chunk_size"] = 0;
  expect_refused(j, "text_config.attention_chunk_size");
  j = scout();
  j["text_config"]["rope_scaling"]["rope_type"] = "longrope";
  expect_refused(j, "text_config.rope_scaling.rope_type");
  j = scout();
  j["text_config"]["hidden_act"] = "gelu";
  expect_refused(j, "text_config.hidden_act");
  j = scout();
  j["text_config"]["moe_layers"] = {-1};
  expect_refused(j, "text_config.moe_layers");
  j = scout();
  j["text_config"]["interleave_moe_layer_step"] = 0;
  expect_refused(j, "text_config.interleave_moe_layer_step");
  j = scout();
  j["text_config"]["floor_scale"] = 0;
  expect_refused(j, "text_config.floor_scale");
  j = scout();
  j["text_config"]["attn_temperature_tuning"] = "yes";
  expect_refused(j, "text_config.attn_temperature_tuning");
  j = scout();
  j["tie_word_embeddings"] = true;  // the text model's own says false
  expect_refused(j, "tie_word_embeddings");
  j = scout();
  j["quantization_config"] = {{"quant_method", "compressed-tensors"}};  // the FP8 re-uploads
  expect_refused(j, "quantization_config.quant_method");
  j = scout();
  j["text_config"]["num_local_experts"] = 0;
  expect_refused(j, "text_config.num_local_experts");
}

}  // namespace
}  // namespace moeinfer
