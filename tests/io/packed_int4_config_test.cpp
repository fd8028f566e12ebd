// quantization_config for GPTQ and AWQ as their tools write it: the fields that change how the
// codes read (bits, group_size, the GPTQ layout's zero points, desc_act) and every variant whose
// tensors would read differently, refused by name.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/model_config.h"

namespace moeinfer {
namespace {

using json = nlohmann::json;

json with_quantization(json quantization, std::string model_type = "qwen3_moe") {
  return {{"model_type", std::move(model_type)},
          {"vocab_size", 1000},
          {"hidden_size", 64},
          {"intermediate_size", 96},
          {"moe_intermediate_size", 32},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"num_experts", 4},
          {"num_experts_per_tok", 2},
          {"quantization_config", std::move(quantization)}};
}

ModelConfig parse(const json& j) { return parse_model_config(j.dump(), "config.json"); }

std::string error_of(const json& j) {
  try {
    parse(j);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// As AutoGPTQ and optimum write it (Qwen's published GPTQ-Int4 checkpoints look like this).
json gptq() {
  return {{"quant_method", "gptq"},
          {"bits", 4},
          {"group_size", 128},
          {"desc_act", false},
          {"sym", true},
          {"damp_percent", 0.01},
          {"true_sequential", true},
          {"checkpoint_format", "gptq"}};
}

// As AutoAWQ writes it.
json awq() {
  return {{"quant_method", "awq"}, {"bits", 4},         {"group_size", 128},
          {"zero_point", true},    {"version", "gemm"}, {"modules_to_not_convert", nullptr}};
}

json patched(json base, const json& patch) {
  base.merge_patch(patch);
  return base;
}

TEST(PackedInt4Config, ReadsGptq) {
  const ModelConfig c = parse(with_quantization(gptq()));
  ASSERT_TRUE(c.packed_int4.has_value());
  EXPECT_EQ(c.packed_int4->packing, Int4Packing::kGptq);
  EXPECT_EQ(c.packed_int4->group_size, 128);
  EXPECT_TRUE(c.packed_int4->zero_minus_one);
  EXPECT_FALSE(c.packed_int4->desc_act);
  EXPECT_FALSE(c.fp8.has_value());

  json q = gptq();
  q["checkpoint_format"] = "gptq_v2";
  q["group_size"] = -1;
  q["desc_act"] = true;
  q["sym"] = false;
  const ModelConfig v2 = parse(with_quantization(q));
  EXPECT_FALSE(v2.packed_int4->zero_minus_one);
  EXPECT_EQ(v2.packed_int4->group_size, 0);  // one group over all inputs
  EXPECT_TRUE(v2.packed_int4->desc_act);
  EXPECT_FALSE(v2.packed_int4->sym);

  q = gptq();
  q.erase("checkpoint_format");  // older AutoGPTQ: the first format
  EXPECT_TRUE(parse(with_quantization(q)).packed_int4->zero_minus_one);
  q["format"] = "gptq_v2";  // GPTQModel's name for the field
  EXPECT_FALSE(parse(with_quantization(q)).packed_int4->zero_minus_one);
}

TEST(PackedInt4Config, ReadsAwq) {
  for (const char* version : {"gemm", "GEMM"}) {
    json q = awq();
    q["version"] = version;
    q["modules_to_not_convert"] = {"shared_expert_gate"};
    const ModelConfig c = parse(with_quantization(q, "qwen2_moe"));
    ASSERT_TRUE(c.packed_int4.has_value()) << version;
    EXPECT_EQ(c.packed_int4->packing, Int4Packing::kAwq);
    EXPECT_EQ(c.packed_int4->group_size, 128);
    EXPECT_FALSE(c.packed_int4->zero_minus_one);
  }
}

TEST(PackedInt4Config, RefusesWhatWouldReadDifferentlyByName) {
  const struct {
    json quantization;
    const char* field;
    const char* says;
  } cases[] = {
      {patched(gptq(), {{"bits", 8}}), "quantization_config.bits", "found 8"},
      {patched(gptq(), {{"bits", 3}}), "quantization_config.bits", "4-bit gptq"},
      {patched(awq(), {{"bits", 8}}), "quantization_config.bits", "4-bit awq"},
      {patched(gptq(), {{"group_size", 0}}), "quantization_config.group_size", "0"},
      {patched(gptq(), {{"group_size", -2}}), "quantization_config.group_size", "-2"},
      {patched(gptq(), {{"checkpoint_format", "marlin"}}), "quantization_config.checkpoint_format",
       "'marlin'"},
      {patched(gptq(), {{"format", "gptq_v2"}}), "quantization_config.format",
       "checkpoint_format is 'gptq'"},
      {patched(gptq(), {{"pack_dtype", "int16"}}), "quantization_config.pack_dtype", "int16"},
      {patched(gptq(), {{"dynamic", {{"-:.*experts.*", json::object()}}}}),
       "quantization_config.dynamic", "per-module"},
      {patched(awq(), {{"version", "gemv"}}), "quantization_config.version", "'gemv'"},
      {patched(awq(), {{"version", "exllama"}}), "quantization_config.version", "'exllama'"},
      {patched(awq(), {{"version", "marlin"}}), "quantization_config.version", "'marlin'"},
      {patched(awq(), {{"backend", "llm-awq"}}), "quantization_config.backend", "'llm-awq'"},
      {patched(awq(), {{"zero_point", false}}), "quantization_config.zero_point", "zero points"},
      {patched(awq(), {{"modules_to_not_convert", "gate"}}),
       "quantization_config.modules_to_not_convert", "list"},
  };
  for (const auto& c : cases) {
    const std::string error = error_of(with_quantization(c.quantization));
    EXPECT_NE(error.find(std::string("field '") + c.field + "'"), std::string::npos)
        << c.quantization.dump() << ": " << error;
    EXPECT_NE(error.find(c.says), std::string::npos) << c.quantization.dump() << ": " << error;
  }
}

TEST(PackedInt4Config, FusedExpertFamiliesRefuseByName) {
  json llama4 = with_quantization(gptq(), "llama4_text");
  std::string error = error_of(llama4);
  EXPECT_NE(error.find("quantization_config.quant_method"), std::string::npos) << error;
  EXPECT_NE(error.find("gptq checkpoints of llama4_text"), std::string::npos) << error;

  const json gpt_oss = {{"model_type", "gpt_oss"}, {"quantization_config", awq()}};
  error = error_of(gpt_oss);
  EXPECT_NE(error.find("quantization_config.quant_method"), std::string::npos) << error;
  EXPECT_NE(error.find("'awq'"), std::string::npos) << error;
  EXPECT_NE(error.find("fused"), std::string::npos) << error;
}

}  // namespace
}  // namespace moeinfer
