// Model facts from the config, checked against the fixtures' tensors and against the published
// size of Qwen3-30B-A3B (30.5B total, 3.3B active).
#include "model/model_facts.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "io/safetensors.h"
#include "model/family.h"
#include "model/synthetic.h"

namespace moeinfer {
namespace {

const std::filesystem::path kModels = std::filesystem::path(MOE_FIXTURES_DIR) / "models";

TEST(ModelFacts, EveryFixtureAddsUpToItsFiles) {
  int checked = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kModels)) {
    const ModelConfig config = load_model_config(entry.path() / "config.json");
    const WeightStore store = WeightStore::open(entry.path());
    WeightSource source(store, config);
    const ModelFacts facts = model_facts(config, bind_weights(config, source),
                                         static_cast<int64_t>(store.total_bytes()));
    // GLM-4.5 publishes its MTP module as one more layer after the last
    // (model.layers.<num_hidden_layers>.*), Qwen3-Next and Qwen3.5 as mtp.*; Llama 4 and Qwen3.5
    // a vision tower beside the text model (Llama 4: all but language_model.*; Qwen3.5:
    // model.visual.*). The text forward pass reads none of them.
    const bool qwen_next =
        config.family == ModelFamily::kQwen3Next || config.family == ModelFamily::kQwen35Moe;
    const std::string mtp_prefix =
        qwen_next ? "mtp." : "model.layers." + std::to_string(config.num_layers) + ".";
    int64_t unread = 0;
    for (const std::string& name : store.names()) {
      const bool vision = config.family == ModelFamily::kQwen35Moe
                              ? name.starts_with("model.visual.")
                              : config.has_vision_tower && !name.starts_with("language_model.");
      if (!name.starts_with(mtp_prefix) && !vision) continue;
      const TensorEntry& e = store.entry(name);
      unread += static_cast<int64_t>(e.end - e.begin);
    }
    EXPECT_TRUE(unread == 0 || config.family == ModelFamily::kGlm4Moe || qwen_next ||
                config.has_vision_tower)
        << entry.path();
    if (config.fp8 || config.packed_int4) {
      // fp8 and GPTQ/AWQ matrices are resident as their bf16 dequantisation: more than their
      // stored bytes (twice fp8's, nearly four times the packed 4-bit codes with their scales).
      EXPECT_GT(facts.resident_bytes.total(), facts.checkpoint_tensor_bytes) << entry.path();
    } else if (config.expert_bias && config.dtype != "float32") {
      // GPT-OSS's experts are laid out anew at load: MXFP4 blocks as bf16, biases as float32.
      EXPECT_GT(facts.resident_bytes.total(), facts.checkpoint_tensor_bytes) << entry.path();
    } else {
      // Tied embeddings are stored once; every stored tensor but the MTP layer's (and a vision
      // tower's) is bound.
      EXPECT_EQ(facts.resident_bytes.total(), facts.checkpoint_tensor_bytes - unread)
          << entry.path();
    }
    EXPECT_LT(facts.active_params.total(), facts.total_params.total());
    EXPECT_EQ(facts.active_params.attention, facts.total_params.attention);
    ++checked;
  }
  EXPECT_GE(checked, 4);
}

// Qwen3-Next-80B-A3B: 80B parameters in all, about 3B read per token (its model card); the KV
// cache only in the 12 full-attention layers, and a fixed recurrent state in the 36 others.
TEST(ModelFacts, Qwen3Next80BA3BShape) {
  const ModelConfig config = synthetic_model_config("qwen3-next-80b-a3b");
  EXPECT_EQ(config.num_kv_layers(), 12);
  EXPECT_EQ(config.num_linear_layers(), 36);
  const PartCounts total = count_params(config, false);
  const PartCounts active = count_params(config, true);
  EXPECT_NEAR(total.total() / 1e9, 80.0, 1.0);
  EXPECT_NEAR(active.total() / 1e9, 3.9, 0.3);  // with both embedding tables
  EXPECT_NEAR((active.total() - active.embeddings) / 1e9, 3.0, 0.3);
  // 12 layers x 2 KV heads x 256 x (key + value).
  EXPECT_EQ(kv_values_per_token(config), 12 * 2 * 2 * 256);
  // 36 layers x (conv window 8192 channels x 3 + state 32 heads x 128 x 128).
  EXPECT_EQ(state_values_per_sequence(config), 36 * (8192 * 3 + 32 * 128 * 128));
}

TEST(ModelFacts, Qwen3_30B_A3B_Shape) {
  const char* json = R"({
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "rope_scaling": null, "tie_word_embeddings": false, "hidden_act": "silu",
    "attention_bias": false, "torch_dtype": "bfloat16"})";
  const ModelConfig config = parse_model_config(json, "qwen3-30b-a3b/config.json");
  const PartCounts total = count_params(config, false);
  const PartCounts active = count_params(config, true);
  EXPECT_NEAR(total.total() / 1e9, 30.53, 0.05);
  EXPECT_NEAR(active.total() / 1e9, 3.35, 0.05);
  EXPECT_EQ(total.routed_experts, 48LL * 128 * 3 * 2048 * 768);
  EXPECT_EQ(active.routed_experts, 48LL * 8 * 3 * 2048 * 768);
  EXPECT_EQ(total.embeddings, 2LL * 151936 * 2048);
}

TEST(ModelFacts, DeepseekV3ShapeCachesTheLatentOnly) {
  // DeepSeek-V3 as published: 671B total, 37B active; KV per token is the 512 latent + 64
  // rope dims per layer, not 128 heads x (192 + 128).
  const char* json = R"({
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "norm_topk_prob": true, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]}})";
  const ModelConfig config = parse_model_config(json, "deepseek-v3/config.json");
  const PartCounts total = count_params(config, false);
  const PartCounts active = count_params(config, true);
  EXPECT_NEAR(total.total() / 1e9, 671.0, 1.0);
  EXPECT_NEAR(active.total() / 1e9, 37.5, 1.0);
  EXPECT_EQ(kv_values_per_token(config), 61LL * (512 + 64));
  EXPECT_LT(kv_values_per_token(config) * 50, 61LL * 128 * (192 + 128) * 2);
}

}  // namespace
}  // namespace moeinfer
