// What differs between architecture families: tensor names and router behaviour. Each family
// has one file (model/<family>.cpp) with its name table; the forward pass is shared.
#pragma once

#include <string>

#include "io/model_config.h"
#include "model/weight_source.h"
#include "model/weights.h"
#include "moe/stages.h"

namespace moeinfer {

// Binds every tensor the config calls for, checking name, shape and dtype.
DecoderWeights bind_weights(const ModelConfig& config, WeightSource& src);
// The router's options from the config; a per-layer selection bias is set by the caller.
moe::RouterOptions router_options(const ModelConfig& config);
// How the config's experts join gate and up.
moe::ExpertActivation expert_activation(const ModelConfig& config);

// Per-family binders (model/<family>.cpp).
DecoderWeights bind_qwen3_moe(const ModelConfig& config, WeightSource& src);
DecoderWeights bind_mixtral(const ModelConfig& config, WeightSource& src);
DecoderWeights bind_olmoe(const ModelConfig& config, WeightSource& src);
DecoderWeights bind_qwen2_moe(const ModelConfig& config, WeightSource& src);
DecoderWeights bind_deepseek(const ModelConfig& config, WeightSource& src);  // V2 and V3
DecoderWeights bind_kimi_k2(const ModelConfig& config, WeightSource& src);
DecoderWeights bind_glm4_moe(const ModelConfig& config, WeightSource& src);
DecoderWeights bind_ernie4_5_moe(const ModelConfig& config, WeightSource& src);
DecoderWeights bind_qwen3_next(const ModelConfig& config, WeightSource& src);
DecoderWeights bind_qwen3_5_moe(const ModelConfig& config, WeightSource& src);
DecoderWeights bind_gpt_oss(const ModelConfig& config, WeightSource& src);
DecoderWeights bind_llama4(const ModelConfig& config, WeightSource& src);

// Building blocks shared by the binders (model/family.cpp).
namespace binding {

struct ExpertNames {
  std::string gate, up, down;  // per-expert suffixes, e.g. "gate_proj.weight"
};

// Attention of the common layout under "<prefix>self_attn.".
AttentionWeights attention(const ModelConfig& config, WeightSource& src,
                           const std::string& layer_prefix);
MlpWeights mlp(WeightSource& src, const std::string& prefix, int64_t hidden_size,
               int64_t width);
// Routed experts under "<prefix>": "<prefix>gate.weight" and "<prefix>experts.<e>.<name>", or
// the stacked layout "<prefix>experts.gate_up_proj" [E, 2I, H] / "experts.down_proj" [E, H, I].
moe::RoutedExperts routed_experts(const ModelConfig& config, WeightSource& src,
                                  const std::string& prefix, const std::string& router_name,
                                  const ExpertNames& names);
// Embedding, final norm and LM head (tied or not), each layer's two norms, and the attention of
// every layer that is neither MLA nor linear, under "<prefix><model>" and "<prefix>lm_head."
// (prefix "language_model." for Llama 4's text model nested in a multimodal checkpoint; model
// "model.language_model." for Qwen3.5's).
DecoderWeights skeleton(const ModelConfig& config, WeightSource& src,
                        const std::string& prefix = "", const std::string& model = "model.");

}  // namespace binding
}  // namespace moeinfer
