#include "model/family.h"

#include "core/error.h"

namespace moeinfer {

DecoderWeights bind_weights(const ModelConfig& config, WeightSource& src) {
  switch (config.family) {
    case ModelFamily::kQwen3Moe: return bind_qwen3_moe(config, src);
    case ModelFamily::kMixtral: return bind_mixtral(config, src);
    case ModelFamily::kOlmoe: return bind_olmoe(config, src);
    case ModelFamily::kQwen2Moe: return bind_qwen2_moe(config, src);
    case ModelFamily::kDeepseekV2:
    case ModelFamily::kDeepseekV3: return bind_deepseek(config, src);
    case ModelFamily::kKimiK2: return bind_kimi_k2(config, src);
    case ModelFamily::kGlm4Moe: return bind_glm4_moe(config, src);
    case ModelFamily::kErnie45Moe: return bind_ernie4_5_moe(config, src);
    case ModelFamily::kQwen3Next:
      return bind_qwen3_next(config, src);
    case ModelFamily::kQwen35Moe:
      return bind_qwen3_5_moe(config, src);
    case ModelFamily::kGptOss:
      return bind_gpt_oss(config, src);
    case ModelFamily::kLlama4:
      return bind_llama4(config, src);
  }
  MOE_FAIL("no weight binding for model_type '", config.model_type, "'");
}

moe::RouterOptions router_options(const ModelConfig& config) {
  moe::RouterOptions options{
      .num_experts = config.num_experts,
      .top_k = config.num_experts_per_tok,
      .score = config.router_topk_softmax ? moe::ScoreFunction::kTopkSoftmax
               : config.sigmoid_scores    ? moe::ScoreFunction::kSigmoid
                                          : moe::ScoreFunction::kSoftmax,
      .renormalize = config.norm_topk_prob,
      .routed_scaling_factor = static_cast<float>(config.routed_scaling_factor)};
  if (config.topk_method != TopkMethod::kGreedy) {
    options.group_score = config.topk_method == TopkMethod::kNoauxTc ? moe::GroupScore::kTop2Sum
                                                                     : moe::GroupScore::kMax;
    options.num_groups = config.num_groups;
    options.topk_groups = config.topk_groups;
  }
  return options;
}

moe::ExpertActivation expert_activation(const ModelConfig& config) {
  if (!config.clamped_swiglu) return {};
  return {.kind = moe::ActivationKind::kClampedSwiglu,
          .alpha = static_cast<float>(config.clamped_swiglu->alpha),
          .limit = static_cast<float>(config.clamped_swiglu->limit)};
}

namespace binding {

AttentionWeights attention(const ModelConfig& config, WeightSource& src,
                           const std::string& layer_prefix) {
  const std::string p = layer_prefix + "self_attn.";
  const int64_t H = config.hidden_size;
  AttentionWeights w;
  const int64_t q_rows = config.attention_output_gate ? 2 * config.q_dim() : config.q_dim();
  w.q_proj = src.matrix(p + "q_proj.weight", {q_rows, H});
  w.k_proj = src.matrix(p + "k_proj.weight", {config.kv_dim(), H});
  w.v_proj = src.matrix(p + "v_proj.weight", {config.kv_dim(), H});
  w.o_proj = src.matrix(p + "o_proj.weight", {H, config.q_dim()});
  if (config.attention_bias) {
    w.q_bias = src.tensor(p + "q_proj.bias", {config.q_dim()});
    w.k_bias = src.tensor(p + "k_proj.bias", {config.kv_dim()});
    w.v_bias = src.tensor(p + "v_proj.bias", {config.kv_dim()});
  }
  if (config.attention_out_bias) w.o_bias = src.tensor(p + "o_proj.bias", {H});
  if (config.qk_norm_per_head) {
    w.q_norm = src.tensor(p + "q_norm.weight", {config.head_dim});
    w.k_norm = src.tensor(p + "k_norm.weight", {config.head_dim});
  } else if (config.qk_norm_full) {
    w.q_norm = src.tensor(p + "q_norm.weight", {config.q_dim()});
    w.k_norm = src.tensor(p + "k_norm.weight", {config.kv_dim()});
  }
  return w;
}

MlpWeights mlp(WeightSource& src, const std::string& prefix, int64_t hidden_size,
               int64_t width) {
  return MlpWeights{.gate_proj = src.matrix(prefix + "gate_proj.weight", {width, hidden_size}),
                    .up_proj = src.matrix(prefix + "up_proj.weight", {width, hidden_size}),
                    .down_proj = src.matrix(prefix + "down_proj.weight", {hidden_size, width})};
}

namespace {

// Rows [first, first + count) of a 2-D view, as a view.
TensorView row_range(const TensorView& matrix, int64_t first, int64_t count) {
  return TensorView{.dtype = matrix.dtype, .shape = {count, matrix.shape[1]},
                    .data = matrix.row(first)};
}

}  // namespace

moe::RoutedExperts routed_experts(const ModelConfig& config, WeightSource& src,
                                  const std::string& prefix, const std::string& router_name,
                                  const ExpertNames& names) {
  const int64_t E = config.num_experts;
  const int64_t H = config.hidden_size;
  const int64_t I = config.moe_intermediate_size;
  moe::RoutedExperts routed;
  routed.router = src.tensor(prefix + router_name, {E, H});
  routed.experts.resize(E);
  const std::string stacked_gate_up = prefix + "experts.gate_up_proj";
  if (src.has(stacked_gate_up)) {
    const TensorView gate_up = src.tensor(stacked_gate_up, {E, 2 * I, H});
    const TensorView down = src.tensor(prefix + "experts.down_proj", {E, H, I});
    for (int64_t e = 0; e < E; ++e) {
      const TensorView both = gate_up.slice0(e);
      routed.experts[e] = {.gate = row_range(both, 0, I), .up = row_range(both, I, I),
                           .down = down.slice0(e)};
    }
    return routed;
  }
  for (int64_t e = 0; e < E; ++e) {
    const std::string p = prefix + "experts." + std::to_string(e) + ".";
    routed.experts[e] = {.gate = src.matrix(p + names.gate, {I, H}),
                         .up = src.matrix(p + names.up, {I, H}),
                         .down = src.matrix(p + names.down, {H, I})};
  }
  return routed;
}

DecoderWeights skeleton(const ModelConfig& config, WeightSource& src, const std::string& prefix,
                        const std::string& model) {
  const int64_t H = config.hidden_size;
  const int64_t V = config.vocab_size;
  DecoderWeights w;
  w.embed_tokens = src.tensor(prefix + model + "embed_tokens.weight", {V, H});
  w.final_norm = src.tensor(prefix + model + "norm.weight", {H});
  w.lm_head =
      config.tie_word_embeddings ? w.embed_tokens : src.matrix(prefix + "lm_head.weight", {V, H});
  w.layers.resize(config.num_layers);
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const std::string p = prefix + model + "layers." + std::to_string(l) + ".";
    w.layers[l].input_norm = src.tensor(p + "input_layernorm.weight", {H});
    w.layers[l].post_attention_norm = src.tensor(p + "post_attention_layernorm.weight", {H});
    if (!config.mla && !config.is_linear_layer(l))
      w.layers[l].attention = attention(config, src, p);
    w.layers[l].is_moe = config.layer_is_moe[l];
  }
  return w;
}

}  // namespace binding
}  // namespace moeinfer
