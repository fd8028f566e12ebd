// GLM-4.5 / GLM-4.5-Air: standard attention with q/k/v biases (attention_bias) and optional
// per-head q/k RMSNorm (use_qk_norm), RoPE over the first half of each head (partial rotary, in
// ModelConfig), first_k_dense_replace dense layers, then routed experts behind DeepSeek-V3's
// router (sigmoid scores, e_score_correction_bias, groups) and ungated shared experts. The
// published tensor names are DeepSeek-V3's for the MLP side and Llama's for attention; the MTP
// layer stored after the last decoder layer (model.layers.<num_hidden_layers>.*) is not read.
#include "model/family.h"

namespace moeinfer {

DecoderWeights bind_glm4_moe(const ModelConfig& config, WeightSource& src) {
  DecoderWeights w = binding::skeleton(config, src);
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".mlp.";
    LayerWeights& layer = w.layers[l];
    if (!layer.is_moe) {
      layer.mlp = binding::mlp(src, p, config.hidden_size, config.intermediate_size);
      continue;
    }
    layer.moe.routed = binding::routed_experts(
        config, src, p, "gate.weight", {"gate_proj.weight", "up_proj.weight", "down_proj.weight"});
    layer.moe.selection_bias = src.tensor(p + "gate.e_score_correction_bias", {config.num_experts});
    if (config.shared_expert_intermediate_size > 0) {
      layer.moe.shared_expert = binding::mlp(src, p + "shared_experts.", config.hidden_size,
                                             config.shared_expert_intermediate_size);
    }
  }
  return w;
}

}  // namespace moeinfer
