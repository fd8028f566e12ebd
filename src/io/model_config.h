// ModelConfig: the validated, immutable hyper-parameters of a checkpoint, read once from
// config.json. Both RoPE layouts are accepted: `rope_theta` + `rope_scaling` (published
// checkpoints) and `rope_parameters` (newer transformers).
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moeinfer {

enum class ModelFamily {
  kQwen3Moe,
  kMixtral,
  kOlmoe,
  kQwen2Moe,
  kDeepseekV2,
  kDeepseekV3,
  kKimiK2,      // DeepSeek-V3's architecture and tensor names under model_type kimi_k2
  kGlm4Moe,     // GLM-4.5 / 4.5-Air
  kErnie45Moe,  // ERNIE 4.5 MoE (text)
  kQwen3Next,   // Qwen3-Next: Gated DeltaNet layers beside gated full attention
  kQwen35Moe,   // Qwen3.5-MoE's text model (text_config): Qwen3-Next's arithmetic, other names
  kLlama4,      // Llama 4 text: llama4 (text_config nested beside a vision_config) or llama4_text
  kGptOss,      // GPT-OSS: attention sinks, alternating sliding windows, MXFP4 experts
};

std::string_view family_name(ModelFamily family);

struct RopeConfig {
  // "default", "linear", "dynamic", "yarn", "llama3"
  std::string type = "default";
  double theta = 10000.0;
  double factor = 1.0;
  // yarn / llama3 / dynamic: the context length the model was trained at.
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;  // yarn
  double beta_slow = 1.0;   // yarn
  std::optional<double> attention_factor;  // yarn: overrides the default mscale
  double mscale = 0.0;           // yarn (DeepSeek style), 0 = unset
  double mscale_all_dim = 0.0;   // yarn (DeepSeek style), 0 = unset
  bool truncate = true;          // yarn
  double low_freq_factor = 1.0;   // llama3
  double high_freq_factor = 4.0;  // llama3
  // The share of each head's dims that rotate (GLM-4.5: 0.5, the first half); 1 elsewhere.
  double partial_rotary_factor = 1.0;
};

// Multi-head Latent Attention (DeepSeek): queries optionally through a low-rank bottleneck,
// keys and values from one compressed latent per token plus a shared RoPE key.
struct MlaConfig {
  int64_t q_lora_rank = 0;        // 0: q_proj straight from the hidden state
  int64_t kv_lora_rank = 0;       // latent width cached per token
  int64_t qk_nope_head_dim = 0;   // per-head query/key dims without position
  int64_t qk_rope_head_dim = 0;   // per-head rotary dims (the key part is shared by all heads)
  int64_t v_head_dim = 0;
  bool rope_interleave = true;    // rotate pairs (2i, 2i+1) rather than (i, i + D/2)
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t cache_width() const { return kv_lora_rank + qk_rope_head_dim; }
};

// Gated DeltaNet linear attention (Qwen3-Next's linear_attention layers): q and k of
// num_key_heads heads, v of num_value_heads heads (each key head serves num_value_heads /
// num_key_heads consecutive value heads), a causal depthwise conv of conv_kernel taps over
// [q | k | v], and per value head a recurrent state [key_head_dim, value_head_dim].
struct LinearAttentionConfig {
  int64_t num_key_heads = 0;    // Nk
  int64_t num_value_heads = 0;  // Nv
  int64_t key_head_dim = 0;     // Dk
  int64_t value_head_dim = 0;   // Dv
  int64_t conv_kernel = 0;
  int64_t key_dim() const { return num_key_heads * key_head_dim; }
  int64_t value_dim() const { return num_value_heads * value_head_dim; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }  // channels of [q | k | v]
  // Per sequence and layer: the last conv_kernel - 1 inputs of every channel, and the state.
  int64_t conv_state_values() const { return conv_dim() * (conv_kernel - 1); }
  int64_t recurrent_state_values() const { return num_value_heads * key_head_dim * value_head_dim; }
};

// How the router picks experts beyond plain softmax top-k.
enum class TopkMethod {
  kGreedy,              // softmax (or sigmoid) top-k
  kGroupLimitedGreedy,  // DeepSeek-V2: keep the topk_group groups with the best expert score
  kNoauxTc,             // DeepSeek-V3: sigmoid + e_score_correction_bias, groups by top-2 sum
};

// Block-scaled fp8 weights (DeepSeek-V3's published format): float8_e4m3fn matrices, each with a
// float32 `<name>_scale_inv` of one scale per block_rows x block_cols block.
struct Fp8Quantization {
  int64_t block_rows = 128;
  int64_t block_cols = 128;
};

// GPTQ (AutoGPTQ, GPTQModel, optimum) and AWQ (AutoAWQ's gemm layout) 4-bit weights. A quantised
// linear is stored as `<module>.qweight` (eight 4-bit codes an int32), `.qzeros` (one zero point
// per group and output, packed along the outputs) and `.scales` (float16 [groups, outputs]);
// GPTQ may add `.g_idx` (int32 [inputs], each input's group). w = (q - zero) * scale. Which
// linears are quantised the loader reads from the tensors a module has (`.qweight` or
// `.weight`), so modules_to_not_convert needs no interpretation beyond its type.
enum class Int4Packing {
  kGptq,  // qweight [K / 8, N]: codes along the inputs, input 8i + j in nibble j
  kAwq,   // qweight [K, N / 8]: codes along the outputs in AWQ's order (below)
};

// quant_method as config.json names it: "gptq" or "awq".
inline std::string_view quant_method_name(Int4Packing packing) {
  return packing == Int4Packing::kAwq ? "awq" : "gptq";
}

struct PackedInt4Quantization {
  Int4Packing packing = Int4Packing::kGptq;
  int64_t group_size = 128;  // inputs sharing a scale and zero point; 0: all of a row's inputs
  // GPTQ's first checkpoint format ("gptq", AutoGPTQ's) stores each zero point minus one;
  // GPTQModel's "gptq_v2" and AWQ store it as it is.
  bool zero_minus_one = false;
  bool desc_act = false;  // GPTQ act-order: the groups come from g_idx, which must be stored
  bool sym = true;        // as written; the zero points are stored either way
};

// The experts' activation of GPT-OSS: gate clamped above at `limit`, up clamped to
// [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate).
struct ClampedSwiglu {
  double alpha = 1.702;
  double limit = 7.0;
};

// Llama 4's query temperature on NoPE layers (attn_temperature_tuning): the query at position p
// is multiplied by 1 + attn_scale * log1p(floor((p + 1) / floor_scale)).
struct AttentionTemperature {
  int64_t floor_scale = 8192;
  double attn_scale = 0.1;
};

struct ModelConfig {
  ModelFamily family = ModelFamily::kQwen3Moe;
  std::string model_type;       // as written in config.json
  std::string source;           // path of config.json, for error messages

  int64_t vocab_size = 0;       // V
  int64_t hidden_size = 0;      // H
  int64_t num_layers = 0;
  int64_t num_heads = 0;        // Nq
  int64_t num_kv_heads = 0;     // Nkv
  int64_t head_dim = 0;         // D
  int64_t intermediate_size = 0;      // width of dense MLP layers
  int64_t moe_intermediate_size = 0;  // I, width of one routed expert
  int64_t num_experts = 0;            // E
  int64_t num_experts_per_tok = 0;    // K
  int64_t shared_expert_intermediate_size = 0;  // qwen2_moe; 0 = no shared expert
  bool norm_topk_prob = false;   // renormalise the K routing weights to sum to 1
  double rms_norm_eps = 1e-6;
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;   // bias on q/k/v projections
  bool attention_out_bias = false;  // bias on o_proj
  bool qk_norm_per_head = false;    // qwen3_moe: RMSNorm over D of each head
  bool qk_norm_full = false;        // olmoe: RMSNorm over the whole q / k projection
  std::optional<double> clip_qkv;   // olmoe
  std::optional<int64_t> sliding_window;  // tokens; absent = full attention
  std::vector<bool> layer_is_moe;   // [num_layers]: routed experts (true) or dense MLP
  RopeConfig rope;
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;
  std::string dtype;  // "float32", "bfloat16", ... as declared; informational

  // DeepSeek family.
  std::optional<MlaConfig> mla;           // set for deepseek_v2 / deepseek_v3
  TopkMethod topk_method = TopkMethod::kGreedy;
  bool sigmoid_scores = false;            // router scores: sigmoid instead of softmax
  int64_t num_groups = 1;                 // n_group
  int64_t topk_groups = 1;                // topk_group
  double routed_scaling_factor = 1.0;
  bool shared_expert_gated = false;       // qwen2_moe: sigmoid gate on the shared expert
  // The router adds a per-expert bias [E] (e_score_correction_bias) to the scores it chooses
  // experts (and groups) by; the weights stay the unbiased scores. DeepSeek-V3 and Kimi K2,
  // GLM-4.5 (sigmoid scores) and ERNIE 4.5 (softmax scores).
  bool router_selection_bias = false;
  // GQA families: RoPE rotates adjacent pairs (2i, 2i + 1) instead of (i, i + rotary_dim/2)
  // (ERNIE 4.5). MLA has its own flag (MlaConfig::rope_interleave).
  bool rope_interleaved = false;
  std::optional<Fp8Quantization> fp8;     // quantization_config with quant_method fp8
  std::optional<PackedInt4Quantization> packed_int4;  // quant_method gptq or awq

  // Qwen3-Next.
  std::optional<LinearAttentionConfig> linear_attention;  // set when some layer is linear
  std::vector<bool> layer_is_linear;  // [num_layers] Gated DeltaNet (true) or full attention
  // q_proj gives each head's query and then a gate of the same width; the attention output is
  // scaled by sigmoid(gate) before o_proj.
  bool attention_output_gate = false;
  // Zero-centred RMSNorm weights: y = normed(x) * (1 + w) for the layer norms, the final norm
  // and the q/k norms (not the linear layers' gated norm).
  bool norm_weight_offset = false;
  // GPT-OSS.
  // [num_layers] from layer_types: the layers that attend over sliding_window keys. Empty: every
  // layer does when sliding_window is set (Mixtral, Qwen3-MoE).
  std::vector<bool> layer_sliding;
  bool attention_sinks = false;  // a learned logit per query head joins each softmax's denominator
  bool router_bias = false;      // the router's logits get a per-expert bias
  bool router_topk_softmax = false;  // top-k of the logits, then softmax over those k
  bool expert_bias = false;          // biases on each expert's gate/up and down projections
  std::optional<ClampedSwiglu> clamped_swiglu;  // nullopt: the experts apply SiLU(gate) * up
  // quantization_config with quant_method mxfp4: the routed experts may be stored as
  // <name>_blocks / <name>_scales (32 e2m1 values sharing one power-of-two scale).
  bool mxfp4 = false;

  // The sliding window of layer `layer` in tokens (each query sees itself and the window - 1
  // keys before it), or 0 for full attention.
  int64_t window_of(int64_t layer) const {
    if (!sliding_window) return 0;
    if (layer_sliding.empty()) return *sliding_window;
    return layer_sliding[static_cast<size_t>(layer)] ? *sliding_window : 0;
  }

  // Llama 4. Per layer: whether RoPE applies (no_rope_layers; a NoPE layer encodes no position)
  // and whether attention is chunked (layer_types: a query sees only the keys of its own
  // attention_chunk_size block of positions). Empty vectors: RoPE everywhere, nothing chunked.
  std::vector<bool> layer_uses_rope;   // [num_layers]
  std::vector<bool> layer_is_chunked;  // [num_layers]
  int64_t attention_chunk_size = 0;    // tokens; 0 when no layer is chunked
  // use_qk_norm: a weightless RMSNorm over each q and k head after RoPE, on RoPE layers only.
  bool qk_norm_after_rope = false;
  std::optional<AttentionTemperature> attention_temperature;  // NoPE layers only
  // The router's weight multiplies the token's hidden state before the expert, and the experts'
  // outputs are summed unweighted (Llama 4), instead of weighting each expert's output.
  bool routing_weight_on_input = false;
  bool has_vision_tower = false;  // config.json has a vision_config; its weights are not read

  int64_t q_dim() const { return num_heads * head_dim; }
  // The leading dims of each head that RoPE rotates: MLA's rope key, else head_dim scaled by
  // partial_rotary_factor (truncated, as transformers' int(head_dim * factor)).
  int64_t rotary_dim() const {
    if (mla) return mla->qk_rope_head_dim;
    return static_cast<int64_t>(static_cast<double>(head_dim) * rope.partial_rotary_factor);
  }
  int64_t kv_dim() const { return num_kv_heads * head_dim; }
  bool is_linear_layer(int64_t layer) const {
    return !layer_is_linear.empty() && layer_is_linear[static_cast<size_t>(layer)];
  }
  // Layers that keep keys and values in the paged cache (all but the linear ones).
  int64_t num_kv_layers() const {
    int64_t n = 0;
    for (int64_t l = 0; l < num_layers; ++l) n += !is_linear_layer(l);
    return n;
  }
  int64_t num_linear_layers() const { return num_layers - num_kv_layers(); }
  bool uses_rope(int64_t layer) const {
    return layer_uses_rope.empty() || layer_uses_rope[static_cast<size_t>(layer)];
  }
  bool is_chunked(int64_t layer) const {
    return !layer_is_chunked.empty() && layer_is_chunked[static_cast<size_t>(layer)];
  }
};

// Parses and validates config.json text; `source` names the file in error messages. A
// qwen3_5_moe config (a vision-language checkpoint) is read through its text_config.
ModelConfig parse_model_config(std::string_view json_text, const std::string& source);
// Reads <dir>/config.json (or the file itself when given a file).
ModelConfig load_model_config(const std::filesystem::path& path);

}  // namespace moeinfer
