#include "model/synthetic.h"

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moeinfer {
namespace {

struct Published {
  const char* name;
  const char* config;  // the fields of the published config.json that the engine reads
};

constexpr Published kPublished[] = {
    {"qwen3-30b-a3b", R"({"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
      "num_experts_per_tok": 8, "norm_topk_prob": true, "decoder_sparse_step": 1,
      "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
      "rope_theta": 1000000.0, "rope_scaling": null, "tie_word_embeddings": false,
      "hidden_act": "silu", "attention_bias": false, "torch_dtype": "bfloat16",
      "bos_token_id": 151643, "eos_token_id": 151645})"},
    {"qwen3-235b-a22b", R"({"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 4096,
      "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
      "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
      "num_experts_per_tok": 8, "norm_topk_prob": true, "decoder_sparse_step": 1,
      "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
      "rope_theta": 1000000.0, "rope_scaling": null, "tie_word_embeddings": false,
      "hidden_act": "silu", "attention_bias": false, "torch_dtype": "bfloat16",
      "bos_token_id": 151643, "eos_token_id": 151645})"},
    {"mixtral-8x7b", R"({"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
      "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
      "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
      "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
      "sliding_window": null, "tie_word_embeddings": false, "hidden_act": "silu",
      "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2})"},
    {"olmoe-1b-7b", R"({"model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048,
      "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16,
      "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
      "norm_topk_prob": false, "clip_qkv": null, "max_position_embeddings": 4096,
      "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "rope_scaling": null,
      "tie_word_embeddings": false, "hidden_act": "silu", "attention_bias": false,
      "torch_dtype": "bfloat16", "bos_token_id": null, "eos_token_id": 50279})"},
    {"deepseek-v2-lite", R"({"model_type": "deepseek_v2", "vocab_size": 102400,
      "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
      "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
      "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2,
      "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512,
      "q_lora_rank": null, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
      "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
      "scoring_func": "softmax", "norm_topk_prob": false, "max_position_embeddings": 163840,
      "rms_norm_eps": 1e-06, "rope_theta": 10000,
      "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                       "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                       "mscale_all_dim": 0.707},
      "tie_word_embeddings": false, "hidden_act": "silu", "torch_dtype": "bfloat16",
      "bos_token_id": 100000, "eos_token_id": 100001})"},
    {"deepseek-v3", R"({"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
      "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
      "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
      "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
      "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
      "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
      "moe_layer_freq": 1, "norm_topk_prob": true, "topk_method": "noaux_tc",
      "scoring_func": "sigmoid", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
      "rope_theta": 10000,
      "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                       "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
      "tie_word_embeddings": false, "hidden_act": "silu", "torch_dtype": "bfloat16",
      "bos_token_id": 0, "eos_token_id": 1,
      "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                              "quant_method": "fp8", "weight_block_size": [128, 128]}})"},
    {"glm-4.5-air", R"({"model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096,
      "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 46,
      "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
      "partial_rotary_factor": 0.5, "attention_bias": true, "use_qk_norm": false,
      "n_routed_experts": 128, "num_experts_per_tok": 8, "n_shared_experts": 1,
      "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": true,
      "first_k_dense_replace": 1, "num_nextn_predict_layers": 1,
      "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 1000000,
      "rope_scaling": null, "tie_word_embeddings": false, "hidden_act": "silu",
      "torch_dtype": "bfloat16", "pad_token_id": 151329,
      "eos_token_id": [151329, 151336, 151338]})"},
    {"kimi-k2", R"({"model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168,
      "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
      "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
      "n_routed_experts": 384, "routed_scaling_factor": 2.827, "kv_lora_rank": 512,
      "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
      "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
      "moe_layer_freq": 1, "norm_topk_prob": true, "topk_method": "noaux_tc",
      "scoring_func": "sigmoid", "max_position_embeddings": 131072, "rms_norm_eps": 1e-06,
      "rope_theta": 50000.0,
      "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                       "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                       "mscale_all_dim": 1.0},
      "tie_word_embeddings": false, "hidden_act": "silu", "torch_dtype": "bfloat16",
      "bos_token_id": 163584, "eos_token_id": 163585,
      "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                              "quant_method": "fp8", "weight_block_size": [128, 128]}})"},
    // openai/gpt-oss-120b and gpt-oss-20b. Their layer_types (sliding, full, sliding, ...) is
    // the alternation GptOssConfig defaults to, so it is left out here and --layers N keeps it.
    {"gpt-oss-120b", R"({"model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
      "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
      "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128,
      "num_experts_per_tok": 4, "attention_bias": true, "sliding_window": 128,
      "swiglu_limit": 7.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
      "rope_theta": 150000,
      "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                       "original_max_position_embeddings": 4096, "rope_type": "yarn",
                       "truncate": false},
      "tie_word_embeddings": false, "hidden_act": "silu", "eos_token_id": 200002,
      "pad_token_id": 199999,
      "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
                                "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
                              "quant_method": "mxfp4"}})"},
    {"gpt-oss-20b", R"({"model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
      "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
      "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
      "num_experts_per_tok": 4, "attention_bias": true, "sliding_window": 128,
      "swiglu_limit": 7.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
      "rope_theta": 150000,
      "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                       "original_max_position_embeddings": 4096, "rope_type": "yarn",
                       "truncate": false},
      "tie_word_embeddings": false, "hidden_act": "silu", "eos_token_id": 200002,
      "pad_token_id": 199999,
      "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
                                "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
                              "quant_method": "mxfp4"}})"},
    // meta-llama/Llama-4-Scout-17B-16E-Instruct: the text model's fields in text_config (the
    // vision tower's are not read), every layer routed (16 experts, top-1, one shared expert),
    // NoPE on every fourth layer, chunks of 8192 on the others.
    {"llama4-scout", R"({"model_type": "llama4",
      "architectures": ["Llama4ForConditionalGeneration"], "tie_word_embeddings": false,
      "text_config": {"model_type": "llama4_text", "vocab_size": 202048, "hidden_size": 5120,
        "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_hidden_layers": 48,
        "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
        "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
        "no_rope_layers": [], "attention_chunk_size": 8192, "use_qk_norm": true,
        "attn_temperature_tuning": 4, "floor_scale": 8192, "attn_scale": 0.1,
        "attention_bias": false, "max_position_embeddings": 10485760, "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": false, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008],
        "pad_token_id": 200018},
      "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 1408,
        "num_hidden_layers": 34, "num_attention_heads": 16, "intermediate_size": 5632,
        "image_size": 336, "patch_size": 14, "vision_output_dim": 4096}})"},
    // Qwen/Qwen3-Next-80B-A3B-Instruct: every fourth layer full attention, the rest Gated
    // DeltaNet; the engine runs it on the CPU only (the GPU decoder refuses linear attention).
    {"qwen3-next-80b-a3b", R"({"model_type": "qwen3_next", "vocab_size": 151936,
      "hidden_size": 2048, "intermediate_size": 5120, "moe_intermediate_size": 512,
      "shared_expert_intermediate_size": 512, "num_hidden_layers": 48,
      "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "num_experts": 512,
      "num_experts_per_tok": 10, "norm_topk_prob": true, "decoder_sparse_step": 1,
      "mlp_only_layers": [], "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
      "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
      "linear_value_head_dim": 128, "partial_rotary_factor": 0.25,
      "max_position_embeddings": 262144, "rms_norm_eps": 1e-06, "rope_theta": 10000000,
      "rope_scaling": null, "attention_bias": false, "use_sliding_window": false,
      "tie_word_embeddings": false, "hidden_act": "silu", "torch_dtype": "bfloat16",
      "bos_token_id": 151643, "eos_token_id": 151645})"},
};

const Published* find_published(std::string_view name) {
  for (const Published& p : kPublished) {
    if (name == p.name) return &p;
  }
  return nullptr;
}

}  // namespace

std::vector<std::string> synthetic_model_names() {
  std::vector<std::string> names;
  for (const Published& p : kPublished) names.emplace_back(p.name);
  return names;
}

std::string synthetic_config_json(std::string_view name) {
  const Published* p = find_published(name);
  if (!p) {
    std::string known;
    for (const Published& q : kPublished) known += std::string(known.empty() ? "" : ", ") + q.name;
    MOE_FAIL("unknown synthetic model '", name, "'; known: ", known);
  }
  return p->config;
}

ModelConfig synthetic_model_config(std::string_view name, int64_t num_layers) {
  nlohmann::json config = nlohmann::json::parse(synthetic_config_json(name));
  if (num_layers > 0) {
    // A multimodal config (Llama 4) holds the text model's layer count in text_config.
    nlohmann::json& text = config.contains("text_config") ? config["text_config"] : config;
    const int64_t full = text["num_hidden_layers"].get<int64_t>();
    MOE_CHECK(num_layers <= full, "--layers ", num_layers, " exceeds ", name, "'s ", full,
              " layers");
    text["num_hidden_layers"] = num_layers;
  }
  return parse_model_config(config.dump(), "synthetic:" + std::string(name));
}

std::string synthetic_tokenizer_json(int64_t vocab_size) {
  MOE_CHECK(vocab_size >= 256, "a synthetic tokenizer needs at least 256 ids, not ", vocab_size);
  // The byte-level alphabet: printable bytes stand for themselves, the rest map to U+0100 on.
  nlohmann::json vocab = nlohmann::json::object();
  int next_codepoint = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    const int cp = printable ? b : next_codepoint++;
    std::string utf8;
    if (cp < 0x80) {
      utf8 += static_cast<char>(cp);
    } else {
      utf8 += static_cast<char>(0xC0 | (cp >> 6));
      utf8 += static_cast<char>(0x80 | (cp & 0x3F));
    }
    vocab[utf8] = b;
  }
  for (int64_t id = 256; id < vocab_size; ++id) vocab["<t" + std::to_string(id) + ">"] = id;
  const nlohmann::json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false},
                                     {"trim_offsets", false}, {"use_regex", false}};
  const nlohmann::json tokenizer = {
      {"version", "1.0"},
      {"added_tokens", nlohmann::json::array()},
      {"normalizer", nullptr},
      {"pre_tokenizer", byte_level},
      {"post_processor", nullptr},
      {"decoder", byte_level},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
  return tokenizer.dump();
}

bool is_synthetic_model(std::string_view model_arg) {
  return model_arg.starts_with("synthetic:");
}

}  // namespace moeinfer
