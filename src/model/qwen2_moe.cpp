// Qwen2-MoE: q/k/v biases, and a shared expert beside the routed ones whose output is scaled by
// its own sigmoid gate before it joins the weighted sum.
#include "model/family.h"

namespace moeinfer {

DecoderWeights bind_qwen2_moe(const ModelConfig& config, WeightSource& src) {
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
    if (config.shared_expert_intermediate_size > 0 && config.shared_expert_gated) {
      layer.moe.shared_expert = binding::mlp(src, p + "shared_expert.", config.hidden_size,
                                             config.shared_expert_intermediate_size);
      layer.moe.shared_expert_gate =
          src.matrix(p + "shared_expert_gate.weight", {1, config.hidden_size});
    }
  }
  return w;
}

}  // namespace moeinfer
