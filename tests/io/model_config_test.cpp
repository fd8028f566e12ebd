// config.json parsing: the four families in both RoPE layouts, dense-layer patterns, defaults,
// every refused field (the error must name the file and the field), and parity with what
// transformers itself resolves for configs it wrote (tests/fixtures/configs, made by
// tools/dump_reference_configs.py).
#include "io/model_config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "core/error.h"

namespace moeinfer {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

json qwen3_moe() {
  return {{"model_type", "qwen3_moe"},
          {"vocab_size", 1000},
          {"hidden_size", 64},
          {"intermediate_size", 96},
          {"moe_intermediate_size", 32},
          {"num_hidden_layers", 4},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"head_dim", 32},
          {"num_experts", 8},
          {"num_experts_per_tok", 2},
          {"norm_topk_prob", true},
          {"max_position_embeddings", 4096},
          {"rms_norm_eps", 1e-6},
          {"rope_theta", 1000000.0},
          {"rope_scaling", nullptr},
          {"tie_word_embeddings", false},
          {"eos_token_id", 151645},
          {"torch_dtype", "bfloat16"}};
}

json mixtral() {
  return {
      {"model_type", "mixtral"},  {"vocab_size", 32000},       {"hidden_size", 128},
      {"intermediate_size", 256}, {"num_hidden_layers", 2},    {"num_attention_heads", 8},
      {"num_key_value_heads", 2}, {"num_local_experts", 8},    {"num_experts_per_tok", 2},
      {"rope_theta", 1e6},        {"sliding_window", nullptr}, {"max_position_embeddings", 32768}};
}

json olmoe() {
  return {{"model_type", "olmoe"},   {"vocab_size", 50304},      {"hidden_size", 64},
          {"intermediate_size", 32}, {"num_hidden_layers", 2},   {"num_attention_heads", 4},
          {"num_experts", 16},       {"num_experts_per_tok", 4}, {"clip_qkv", nullptr},
          {"rope_theta", 10000.0}};
}

json qwen2_moe() {
  return {{"model_type", "qwen2_moe"},   {"vocab_size", 151936},
          {"hidden_size", 64},           {"intermediate_size", 128},
          {"moe_intermediate_size", 16}, {"shared_expert_intermediate_size", 64},
          {"num_hidden_layers", 4},      {"num_attention_heads", 4},
          {"num_key_value_heads", 4},    {"num_experts", 6},
          {"num_experts_per_tok", 2},    {"use_sliding_window", false},
          {"sliding_window", 4096},      {"rope_theta", 1000000.0}};
}

// Rewrites top-level rope_theta + rope_scaling into transformers 5's rope_parameters.
json to_rope_parameters(json cfg) {
  json params = cfg.contains("rope_scaling") && cfg["rope_scaling"].is_object()
                    ? cfg["rope_scaling"]
                    : json::object();
  if (params.contains("type")) {
    params["rope_type"] = params["type"];
    params.erase("type");
  }
  if (!params.contains("rope_type")) params["rope_type"] = "default";
  if (cfg.contains("rope_theta")) params["rope_theta"] = cfg["rope_theta"];
  cfg.erase("rope_theta");
  cfg.erase("rope_scaling");
  cfg["rope_parameters"] = params;
  return cfg;
}

ModelConfig parse(const json& cfg) { return parse_model_config(cfg.dump(), "config.json"); }

class ConfigFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::random_device rd;
    dir_ = fs::temp_directory_path() /
           ("moe_config_test_" + std::to_string(::getpid()) + "_" + std::to_string(rd()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Loads `text` from <dir>/config.json; returns the error ("" when it loaded).
  std::string error_of(const std::string& text) {
    std::ofstream(dir_ / "config.json") << text;
    try {
      load_model_config(dir_);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }
  // The config must be refused with an error naming the file and `field`.
  void expect_refused(const json& cfg, const std::string& field, const std::string& also = "") {
    const std::string error = error_of(cfg.dump());
    EXPECT_NE(error.find((dir_ / "config.json").string()), std::string::npos)
        << "file not named: " << error;
    EXPECT_NE(error.find("'" + field + "'"), std::string::npos)
        << "field " << field << " not named: " << error;
    if (!also.empty()) {
      EXPECT_NE(error.find(also), std::string::npos) << error;
    }
  }

  fs::path dir_;
};

// --- the four families ---------------------------------------------------------------------------

TEST(ModelConfigTest, Qwen3MoeBothRopeLayouts) {
  for (const json& cfg : {qwen3_moe(), to_rope_parameters(qwen3_moe())}) {
    const ModelConfig c = parse(cfg);
    EXPECT_EQ(c.family, ModelFamily::kQwen3Moe);
    EXPECT_EQ(family_name(c.family), "qwen3_moe");
    EXPECT_EQ(c.source, "config.json");
    EXPECT_EQ(c.vocab_size, 1000);
    EXPECT_EQ(c.hidden_size, 64);
    EXPECT_EQ(c.num_layers, 4);
    EXPECT_EQ(c.num_heads, 4);
    EXPECT_EQ(c.num_kv_heads, 2);
    EXPECT_EQ(c.head_dim, 32);  // explicit, not hidden / heads
    EXPECT_EQ(c.q_dim(), 128);
    EXPECT_EQ(c.kv_dim(), 64);
    EXPECT_EQ(c.intermediate_size, 96);
    EXPECT_EQ(c.moe_intermediate_size, 32);
    EXPECT_EQ(c.num_experts, 8);
    EXPECT_EQ(c.num_experts_per_tok, 2);
    EXPECT_EQ(c.shared_expert_intermediate_size, 0);
    EXPECT_TRUE(c.norm_topk_prob);
    EXPECT_TRUE(c.qk_norm_per_head);
    EXPECT_FALSE(c.qk_norm_full);
    EXPECT_FALSE(c.attention_bias);
    EXPECT_FALSE(c.attention_out_bias);
    EXPECT_FALSE(c.sliding_window.has_value());
    EXPECT_EQ(c.layer_is_moe, std::vector<bool>(4, true));
    EXPECT_EQ(c.rope.type, "default");
    EXPECT_EQ(c.rope.theta, 1e6);
    EXPECT_EQ(c.rope.factor, 1.0);
    EXPECT_EQ(c.max_position_embeddings, 4096);
    EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{151645});
    EXPECT_FALSE(c.bos_token_id.has_value());
    EXPECT_EQ(c.dtype, "bfloat16");
  }
}

TEST(ModelConfigTest, Qwen3MoeNumLocalExpertsAsTransformers5WritesIt) {
  json cfg = qwen3_moe();
  cfg.erase("num_experts");
  cfg["num_local_experts"] = 16;
  EXPECT_EQ(parse(cfg).num_experts, 16);
  cfg["num_experts"] = 16;  // both, agreeing
  EXPECT_EQ(parse(cfg).num_experts, 16);
}

TEST(ModelConfigTest, Qwen3MoeDenseLayerPatterns) {
  json cfg = qwen3_moe();
  cfg["num_hidden_layers"] = 8;
  cfg["decoder_sparse_step"] = 2;
  EXPECT_EQ(parse(cfg).layer_is_moe,
            (std::vector<bool>{false, true, false, true, false, true, false, true}));
  cfg["decoder_sparse_step"] = 1;
  cfg["mlp_only_layers"] = {0, 5};
  EXPECT_EQ(parse(cfg).layer_is_moe,
            (std::vector<bool>{false, true, true, true, true, false, true, true}));
  cfg["decoder_sparse_step"] = 3;
  cfg["mlp_only_layers"] = {5};
  EXPECT_EQ(parse(cfg).layer_is_moe,
            (std::vector<bool>{false, false, true, false, false, false, false, false}));
  cfg["mlp_only_layers"] = nullptr;  // transformers: None -> []
  EXPECT_EQ(parse(cfg).layer_is_moe,
            (std::vector<bool>{false, false, true, false, false, true, false, false}));
}

TEST(ModelConfigTest, Qwen3MoeBiasHeadDimAndSlidingWindow) {
  json cfg = qwen3_moe();
  cfg.erase("head_dim");
  cfg["attention_bias"] = true;
  cfg["sliding_window"] = 1024;  // ignored while use_sliding_window is false
  ModelConfig c = parse(cfg);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_TRUE(c.attention_out_bias);  // o_proj shares attention_bias in qwen3_moe
  EXPECT_FALSE(c.sliding_window.has_value());
  cfg["use_sliding_window"] = true;
  EXPECT_EQ(parse(cfg).sliding_window, 1024);
  cfg.erase("sliding_window");
  EXPECT_EQ(parse(cfg).sliding_window, 4096);  // the class default
  cfg["sliding_window"] = nullptr;
  EXPECT_FALSE(parse(cfg).sliding_window.has_value());
}

TEST(ModelConfigTest, TiedEmbeddingsAndEosList) {
  json cfg = qwen3_moe();
  cfg["tie_word_embeddings"] = true;
  cfg["eos_token_id"] = {151645, 151643};
  cfg["bos_token_id"] = 151643;
  cfg.erase("torch_dtype");
  cfg["dtype"] = "float16";
  const ModelConfig c = parse(cfg);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{151645, 151643}));
  EXPECT_EQ(c.bos_token_id, 151643);
  EXPECT_EQ(c.dtype, "float16");
}

TEST(ModelConfigTest, MixtralBothRopeLayouts) {
  for (const json& cfg : {mixtral(), to_rope_parameters(mixtral())}) {
    const ModelConfig c = parse(cfg);
    EXPECT_EQ(c.family, ModelFamily::kMixtral);
    EXPECT_EQ(c.head_dim, 16);  // hidden / heads
    EXPECT_EQ(c.num_experts, 8);
    EXPECT_EQ(c.num_experts_per_tok, 2);
    EXPECT_EQ(c.moe_intermediate_size, 256);  // experts use intermediate_size
    EXPECT_TRUE(c.norm_topk_prob);            // the router always renormalises
    EXPECT_FALSE(c.attention_bias);
    EXPECT_FALSE(c.qk_norm_per_head);
    EXPECT_FALSE(c.qk_norm_full);
    EXPECT_FALSE(c.sliding_window.has_value());
    EXPECT_EQ(c.layer_is_moe, std::vector<bool>(2, true));
    EXPECT_EQ(c.rope.theta, 1e6);
    EXPECT_EQ(c.rms_norm_eps, 1e-5);  // the mixtral default
    EXPECT_EQ(c.bos_token_id, 1);
    EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{2});
  }
}

TEST(ModelConfigTest, MixtralDefaultsAndSlidingWindow) {
  json cfg = mixtral();
  cfg.erase("rope_theta");
  cfg["sliding_window"] = 4096;
  cfg["head_dim"] = 32;
  cfg["num_experts"] = 8;  // alias of num_local_experts
  const ModelConfig c = parse(cfg);
  EXPECT_EQ(c.rope.theta, 1e6);  // MixtralConfig.default_theta
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_EQ(c.head_dim, 32);
}

TEST(ModelConfigTest, OlmoeBothRopeLayouts) {
  for (json cfg : {olmoe(), to_rope_parameters(olmoe())}) {
    ModelConfig c = parse(cfg);
    EXPECT_EQ(c.family, ModelFamily::kOlmoe);
    EXPECT_EQ(c.num_kv_heads, 4);  // default: same as heads
    EXPECT_EQ(c.head_dim, 16);
    EXPECT_TRUE(c.qk_norm_full);
    EXPECT_FALSE(c.qk_norm_per_head);
    EXPECT_FALSE(c.clip_qkv.has_value());
    EXPECT_FALSE(c.norm_topk_prob);
    EXPECT_EQ(c.moe_intermediate_size, 32);
    EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{50279});
    EXPECT_EQ(c.max_position_embeddings, 4096);
    cfg["clip_qkv"] = 8.0;
    cfg["norm_topk_prob"] = true;
    cfg["attention_bias"] = true;
    c = parse(cfg);
    EXPECT_EQ(c.clip_qkv, 8.0);
    EXPECT_TRUE(c.norm_topk_prob);
    EXPECT_TRUE(c.attention_bias);
    EXPECT_TRUE(c.attention_out_bias);
  }
}

TEST(ModelConfigTest, Qwen2MoeBothRopeLayouts) {
  for (const json& cfg : {qwen2_moe(), to_rope_parameters(qwen2_moe())}) {
    const ModelConfig c = parse(cfg);
    EXPECT_EQ(c.family, ModelFamily::kQwen2Moe);
    EXPECT_EQ(c.shared_expert_intermediate_size, 64);
    EXPECT_EQ(c.moe_intermediate_size, 16);
    EXPECT_EQ(c.intermediate_size, 128);
    EXPECT_TRUE(c.attention_bias);  // qkv_bias defaults to true
    EXPECT_FALSE(c.attention_out_bias);
    EXPECT_FALSE(c.norm_topk_prob);
    EXPECT_FALSE(c.qk_norm_per_head);
    EXPECT_FALSE(c.sliding_window.has_value());
    EXPECT_EQ(c.layer_is_moe, std::vector<bool>(4, true));
    EXPECT_EQ(c.rope.theta, 1e6);
  }
}

TEST(ModelConfigTest, Qwen2MoeDenseLayersAndBiasFlag) {
  json cfg = qwen2_moe();
  cfg["decoder_sparse_step"] = 2;
  cfg["mlp_only_layers"] = {1};
  cfg["qkv_bias"] = false;
  cfg["layer_types"] = {"full_attention", "full_attention", "full_attention", "full_attention"};
  const ModelConfig c = parse(cfg);
  EXPECT_EQ(c.layer_is_moe, (std::vector<bool>{false, false, false, true}));
  EXPECT_FALSE(c.attention_bias);
}

TEST(ModelConfigTest, FamilyDefaultsWhenFieldsAreAbsent) {
  // save_pretrained omits values equal to the class defaults.
  const ModelConfig q3 = parse(json{{"model_type", "qwen3_moe"}});
  EXPECT_EQ(q3.vocab_size, 151936);
  EXPECT_EQ(q3.hidden_size, 2048);
  EXPECT_EQ(q3.num_layers, 24);
  EXPECT_EQ(q3.num_heads, 32);
  EXPECT_EQ(q3.num_kv_heads, 4);
  EXPECT_EQ(q3.head_dim, 64);
  EXPECT_EQ(q3.num_experts, 128);
  EXPECT_EQ(q3.num_experts_per_tok, 8);
  EXPECT_EQ(q3.moe_intermediate_size, 768);
  EXPECT_EQ(q3.intermediate_size, 6144);
  EXPECT_FALSE(q3.norm_topk_prob);
  EXPECT_EQ(q3.rope.theta, 10000.0);
  EXPECT_EQ(q3.max_position_embeddings, 32768);
  const ModelConfig mx = parse(json{{"model_type", "mixtral"}});
  EXPECT_EQ(mx.num_experts, 8);
  EXPECT_EQ(mx.num_kv_heads, 8);
  EXPECT_EQ(mx.max_position_embeddings, 131072);
  EXPECT_EQ(mx.moe_intermediate_size, 14336);
  const ModelConfig ol = parse(json{{"model_type", "olmoe"}});
  EXPECT_EQ(ol.num_experts, 64);
  EXPECT_EQ(ol.num_experts_per_tok, 8);
  EXPECT_EQ(ol.num_kv_heads, 16);
  EXPECT_EQ(ol.vocab_size, 50304);
  const ModelConfig q2 = parse(json{{"model_type", "qwen2_moe"}});
  EXPECT_EQ(q2.num_experts, 60);
  EXPECT_EQ(q2.num_experts_per_tok, 4);
  EXPECT_EQ(q2.shared_expert_intermediate_size, 5632);
  EXPECT_EQ(q2.moe_intermediate_size, 1408);
  EXPECT_EQ(q2.num_kv_heads, 16);
  EXPECT_TRUE(q2.attention_bias);
}

// --- RoPE ----------------------------------------------------------------------------------------

TEST(ModelConfigTest, RopeTypesInBothLayouts) {
  struct Case {
    json scaling;
    std::string type;
    double factor;
    int64_t original;
  };
  const Case cases[] = {
      {{{"type", "linear"}, {"factor", 2.0}}, "linear", 2.0, 0},
      {{{"rope_type", "dynamic"}, {"factor", 4.0}}, "dynamic", 4.0, 4096},
      {{{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 1024}},
       "yarn",
       4.0,
       1024},
      {{{"type", "yarn"}, {"factor", 2.0}}, "yarn", 2.0, 4096},  // defaults to max positions
      {{{"rope_type", "llama3"},
        {"factor", 8.0},
        {"low_freq_factor", 1.0},
        {"high_freq_factor", 4.0},
        {"original_max_position_embeddings", 2048}},
       "llama3",
       8.0,
       2048},
  };
  for (const Case& tc : cases) {
    json cfg = qwen3_moe();
    cfg["rope_scaling"] = tc.scaling;
    for (const json& variant : {cfg, to_rope_parameters(cfg)}) {
      SCOPED_TRACE(variant.dump());
      const ModelConfig c = parse(variant);
      EXPECT_EQ(c.rope.type, tc.type);
      EXPECT_EQ(c.rope.theta, 1e6);
      EXPECT_EQ(c.rope.factor, tc.factor);
      EXPECT_EQ(c.rope.original_max_position_embeddings, tc.original);
    }
  }
}

TEST(ModelConfigTest, YarnAndLlama3Fields) {
  json cfg = qwen3_moe();
  cfg["rope_parameters"] = {{"rope_type", "yarn"},     {"rope_theta", 5e5},
                            {"factor", 8.0},           {"original_max_position_embeddings", 512},
                            {"beta_fast", 16},         {"beta_slow", nullptr},
                            {"attention_factor", 1.5}, {"mscale", 0.707},
                            {"mscale_all_dim", 0.707}, {"truncate", false}};
  cfg.erase("rope_theta");
  cfg.erase("rope_scaling");
  ModelConfig c = parse(cfg);
  EXPECT_EQ(c.rope.theta, 5e5);
  EXPECT_EQ(c.rope.beta_fast, 16.0);
  EXPECT_EQ(c.rope.beta_slow, 1.0);  // null -> default, as transformers' `or`
  EXPECT_EQ(c.rope.attention_factor, 1.5);
  EXPECT_EQ(c.rope.mscale, 0.707);
  EXPECT_EQ(c.rope.mscale_all_dim, 0.707);
  EXPECT_FALSE(c.rope.truncate);

  cfg["rope_parameters"] = {
      {"rope_type", "yarn"}, {"factor", nullptr}, {"original_max_position_embeddings", 1024}};
  c = parse(cfg);
  EXPECT_EQ(c.rope.factor, 4.0);     // max_position_embeddings / original
  EXPECT_EQ(c.rope.theta, 10000.0);  // no rope_theta anywhere: the class default

  cfg["rope_parameters"] = {{"rope_type", "llama3"},
                            {"rope_theta", 5e5},
                            {"factor", 32.0},
                            {"low_freq_factor", 1.0},
                            {"high_freq_factor", 4.0}};
  c = parse(cfg);
  EXPECT_EQ(c.rope.low_freq_factor, 1.0);
  EXPECT_EQ(c.rope.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 4096);
}

TEST(ModelConfigTest, RopeScalingWinsOverRopeParametersAndEmptyScalingIsIgnored) {
  json cfg = qwen3_moe();
  cfg["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1234.0}};
  cfg["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  EXPECT_EQ(parse(cfg).rope.type, "linear");
  EXPECT_EQ(parse(cfg).rope.theta, 1e6);  // from the top level
  cfg["rope_scaling"] = json::object();
  EXPECT_EQ(parse(cfg).rope.type, "default");
  EXPECT_EQ(parse(cfg).rope.theta, 1234.0);  // the dict's own theta comes first
}

// --- refusals: each names the file and the field -------------------------------------------------

TEST_F(ConfigFileTest, LoadsFromFolderOrFile) {
  std::ofstream(dir_ / "config.json") << qwen3_moe().dump();
  EXPECT_EQ(load_model_config(dir_).source, (dir_ / "config.json").string());
  EXPECT_EQ(load_model_config(dir_ / "config.json").num_experts, 8);
}

TEST_F(ConfigFileTest, MissingFile) {
  try {
    load_model_config(dir_ / "nope.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nope.json"), std::string::npos) << e.what();
  }
}

TEST_F(ConfigFileTest, BadJsonAndNotAnObject) {
  std::string error = error_of("{\"model_type\": \"qwen3_moe\",");
  EXPECT_NE(error.find((dir_ / "config.json").string()), std::string::npos) << error;
  EXPECT_NE(error.find("JSON"), std::string::npos) << error;
  error = error_of("[1, 2]");
  EXPECT_NE(error.find("object"), std::string::npos) << error;
}

TEST_F(ConfigFileTest, UnknownModelTypeListsSupported) {
  json cfg = qwen3_moe();
  cfg["model_type"] = "llama";
  expect_refused(cfg, "model_type", "qwen3_moe, mixtral, olmoe, qwen2_moe");
  cfg.erase("model_type");
  expect_refused(cfg, "model_type", "missing");
}

TEST_F(ConfigFileTest, WrongTypes) {
  json cfg = qwen3_moe();
  cfg["num_attention_heads"] = "4";
  expect_refused(cfg, "num_attention_heads", "integer");
  cfg = qwen3_moe();
  cfg["norm_topk_prob"] = 1;
  expect_refused(cfg, "norm_topk_prob", "true or false");
  cfg = qwen3_moe();
  cfg["rms_norm_eps"] = "1e-6";
  expect_refused(cfg, "rms_norm_eps", "number");
  cfg = qwen3_moe();
  cfg["hidden_size"] = 64.5;
  expect_refused(cfg, "hidden_size", "integer");
  cfg = qwen3_moe();
  cfg["hidden_size"] = nullptr;
  expect_refused(cfg, "hidden_size", "null");
  cfg = qwen3_moe();
  cfg["eos_token_id"] = {1, "two"};
  expect_refused(cfg, "eos_token_id");
  cfg = qwen3_moe();
  cfg["mlp_only_layers"] = 3;
  expect_refused(cfg, "mlp_only_layers", "list");
  cfg = qwen3_moe();
  cfg["torch_dtype"] = 16;
  expect_refused(cfg, "torch_dtype", "string");
}

TEST_F(ConfigFileTest, NonPositiveAndHugeSizes) {
  for (const char* field : {"vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
                            "moe_intermediate_size", "num_experts", "num_experts_per_tok",
                            "max_position_embeddings", "head_dim", "num_key_value_heads"}) {
    json cfg = qwen3_moe();
    cfg[field] = 0;
    expect_refused(cfg, field, "positive");
    cfg[field] = -3;
    expect_refused(cfg, field, "positive");
  }
  json cfg = qwen3_moe();
  cfg["num_hidden_layers"] = 1000000000;
  expect_refused(cfg, "num_hidden_layers", "limit");
  cfg = qwen3_moe();
  cfg["vocab_size"] = 18446744073709551615ull;
  expect_refused(cfg, "vocab_size", "range");
}

// Token ids are compared as int32 with sampled tokens: a wider one wrapped onto a real token
// (4294971389 stopped generation at 4093), a negative one was kept and never matched.
TEST_F(ConfigFileTest, TokenIdsOutsideInt32Refused) {
  json cfg = qwen3_moe();
  cfg["eos_token_id"] = {2, int64_t{4294971389}};
  expect_refused(cfg, "eos_token_id", "4294971389");
  cfg["eos_token_id"] = -5;
  expect_refused(cfg, "eos_token_id", "-5");
  cfg = qwen3_moe();
  cfg["bos_token_id"] = int64_t{1} << 40;
  expect_refused(cfg, "bos_token_id", "1099511627776");
}

TEST_F(ConfigFileTest, HeadsAndExpertsMustAgree) {
  json cfg = qwen3_moe();
  cfg["num_key_value_heads"] = 3;
  expect_refused(cfg, "num_key_value_heads", "divide");
  cfg = qwen3_moe();
  cfg["num_experts_per_tok"] = 9;
  expect_refused(cfg, "num_experts_per_tok", "exceeds");
  cfg = qwen3_moe();
  cfg["num_local_experts"] = 4;  // disagrees with num_experts = 8
  expect_refused(cfg, "num_local_experts", "agree");
  cfg = qwen3_moe();
  cfg["head_dim"] = 33;
  expect_refused(cfg, "head_dim", "even");
  cfg = qwen3_moe();
  cfg.erase("head_dim");
  cfg["num_attention_heads"] = 128;
  cfg["num_key_value_heads"] = 128;
  expect_refused(cfg, "num_attention_heads", "hidden_size");
}

TEST_F(ConfigFileTest, DenseLayerFieldsChecked) {
  json cfg = qwen3_moe();
  cfg["decoder_sparse_step"] = 0;
  expect_refused(cfg, "decoder_sparse_step", "positive");
  cfg = qwen3_moe();
  cfg["mlp_only_layers"] = {1, 4};
  expect_refused(cfg, "mlp_only_layers", "layer 4");
  cfg = qwen2_moe();
  cfg["mlp_only_layers"] = {-1};
  expect_refused(cfg, "mlp_only_layers");
}

TEST_F(ConfigFileTest, UnsupportedFeatures) {
  json cfg = qwen3_moe();
  cfg["hidden_act"] = "gelu";
  expect_refused(cfg, "hidden_act", "gelu");
  cfg = qwen2_moe();
  cfg["use_sliding_window"] = true;
  expect_refused(cfg, "use_sliding_window", "not supported");
  cfg = qwen2_moe();
  cfg["layer_types"] = {"sliding_attention", "full_attention", "full_attention", "full_attention"};
  expect_refused(cfg, "layer_types", "sliding_attention");
  cfg = olmoe();
  cfg["head_dim"] = 32;
  expect_refused(cfg, "head_dim", "hidden_size");
  cfg = olmoe();
  cfg["clip_qkv"] = -1.0;
  expect_refused(cfg, "clip_qkv", "positive");
  cfg = qwen3_moe();
  cfg["partial_rotary_factor"] = 0.5;
  expect_refused(cfg, "partial_rotary_factor", "not supported");
}

TEST_F(ConfigFileTest, RopeRefusals) {
  json cfg = qwen3_moe();
  cfg["rope_scaling"] = {{"type", "longrope"}, {"factor", 2.0}};
  expect_refused(cfg, "rope_scaling.type", "longrope");
  cfg = to_rope_parameters(qwen3_moe());
  cfg["rope_parameters"]["rope_type"] = "su";
  expect_refused(cfg, "rope_parameters.rope_type", "yarn");
  cfg = qwen3_moe();
  cfg["rope_scaling"] = {{"type", "linear"}};
  expect_refused(cfg, "rope_scaling.factor", "missing");
  cfg = qwen3_moe();
  cfg["rope_scaling"] = {{"type", "yarn"}};
  expect_refused(cfg, "rope_scaling.factor", "missing");
  cfg = to_rope_parameters(qwen3_moe());
  cfg["rope_parameters"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}};
  expect_refused(cfg, "rope_parameters.high_freq_factor", "missing");
  cfg = qwen3_moe();
  cfg["rope_theta"] = -1.0;
  expect_refused(cfg, "rope_theta", "positive");
  cfg = qwen3_moe();
  cfg["rope_scaling"] = {{"type", "linear"}, {"factor", "2"}};
  expect_refused(cfg, "rope_scaling.factor", "number");
  cfg = qwen3_moe();
  cfg["rope_scaling"] = "yarn";
  expect_refused(cfg, "rope_scaling", "object");
  cfg = to_rope_parameters(qwen3_moe());
  cfg["rope_parameters"] = {{"full_attention", {{"rope_type", "default"}}}};
  expect_refused(cfg, "rope_parameters.full_attention", "per-layer");
}

// --- parity with transformers --------------------------------------------------------------------

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

TEST(ModelConfigReferenceTest, MatchesWhatTransformersResolves) {
  const fs::path dir = fs::path(MOE_FIXTURES_DIR) / "configs";
  const json expected_all = json::parse(read_text(dir / "expected.json"));
  ASSERT_GE(expected_all["configs"].size(), 8u);
  for (const auto& [file, want] : expected_all["configs"].items()) {
    SCOPED_TRACE(file);
    const ModelConfig c = load_model_config(dir / file);
    EXPECT_EQ(std::string(family_name(c.family)), want["model_type"].get<std::string>());
    EXPECT_EQ(c.vocab_size, want["vocab_size"].get<int64_t>());
    EXPECT_EQ(c.hidden_size, want["hidden_size"].get<int64_t>());
    EXPECT_EQ(c.num_layers, want["num_layers"].get<int64_t>());
    EXPECT_EQ(c.num_heads, want["num_heads"].get<int64_t>());
    EXPECT_EQ(c.num_kv_heads, want["num_kv_heads"].get<int64_t>());
    EXPECT_EQ(c.head_dim, want["head_dim"].get<int64_t>());
    EXPECT_EQ(c.intermediate_size, want["intermediate_size"].get<int64_t>());
    EXPECT_EQ(c.moe_intermediate_size, want["moe_intermediate_size"].get<int64_t>());
    EXPECT_EQ(c.num_experts, want["num_experts"].get<int64_t>());
    EXPECT_EQ(c.num_experts_per_tok, want["num_experts_per_tok"].get<int64_t>());
    EXPECT_EQ(c.shared_expert_intermediate_size,
              want["shared_expert_intermediate_size"].get<int64_t>());
    EXPECT_EQ(c.norm_topk_prob, want["norm_topk_prob"].get<bool>());
    EXPECT_DOUBLE_EQ(c.rms_norm_eps, want["rms_norm_eps"].get<double>());
    EXPECT_EQ(c.max_position_embeddings, want["max_position_embeddings"].get<int64_t>());
    EXPECT_EQ(c.tie_word_embeddings, want["tie_word_embeddings"].get<bool>());
    EXPECT_EQ(c.attention_bias, want["attention_bias"].get<bool>());
    EXPECT_EQ(c.attention_out_bias, want["attention_out_bias"].get<bool>());
    EXPECT_EQ(c.qk_norm_per_head, want["qk_norm_per_head"].get<bool>());
    EXPECT_EQ(c.qk_norm_full, want["qk_norm_full"].get<bool>());
    if (want["clip_qkv"].is_null()) {
      EXPECT_FALSE(c.clip_qkv.has_value());
    } else {
      EXPECT_EQ(c.clip_qkv, want["clip_qkv"].get<double>());
    }
    if (want["sliding_window"].is_null()) {
      EXPECT_FALSE(c.sliding_window.has_value());
    } else {
      EXPECT_EQ(c.sliding_window, want["sliding_window"].get<int64_t>());
    }
    EXPECT_EQ(c.layer_is_moe, want["layer_is_moe"].get<std::vector<bool>>());
    EXPECT_EQ(c.rope.type, want["rope_type"].get<std::string>());
    EXPECT_DOUBLE_EQ(c.rope.theta, want["rope_theta"].get<double>());
    EXPECT_DOUBLE_EQ(c.rope.factor, want["rope_factor"].get<double>());
    if (c.rope.type == "yarn" || c.rope.type == "llama3") {
      EXPECT_EQ(c.rope.original_max_position_embeddings,
                want["rope_original_max_position_embeddings"].get<int64_t>());
    }
    if (!want["rope_beta_fast"].is_null()) {
      EXPECT_DOUBLE_EQ(c.rope.beta_fast, want["rope_beta_fast"].get<double>());
    }
    if (!want["rope_beta_slow"].is_null()) {
      EXPECT_DOUBLE_EQ(c.rope.beta_slow, want["rope_beta_slow"].get<double>());
    }
    if (!want["rope_low_freq_factor"].is_null()) {
      EXPECT_DOUBLE_EQ(c.rope.low_freq_factor, want["rope_low_freq_factor"].get<double>());
    }
    if (!want["rope_high_freq_factor"].is_null()) {
      EXPECT_DOUBLE_EQ(c.rope.high_freq_factor, want["rope_high_freq_factor"].get<double>());
    }
    if (c.rope.type == "yarn" && c.rope.attention_factor) {
      EXPECT_DOUBLE_EQ(*c.rope.attention_factor, want["rope_attention_scaling"].get<double>());
    }
    if (want["bos_token_id"].is_null()) {
      EXPECT_FALSE(c.bos_token_id.has_value());
    } else {
      EXPECT_EQ(c.bos_token_id, want["bos_token_id"].get<int64_t>());
    }
    EXPECT_EQ(c.eos_token_ids, want["eos_token_ids"].get<std::vector<int64_t>>());
    EXPECT_EQ(c.dtype, want["dtype"].get<std::string>());
  }
}

}  // namespace
}  // namespace moeinfer
