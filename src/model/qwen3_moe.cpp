// Qwen3-MoE: per-head q/k RMSNorm, softmax top-k with norm_topk_prob, no shared expert;
// layers listed in mlp_only_layers (or off the decoder_sparse_step grid) are dense MLPs.
#include "model/family.h"

namespace moeinfer {

DecoderWeights bind_qwen3_moe(const ModelConfig& config, WeightSource& src) {
  DecoderWeights w = binding::skeleton(config, src);
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".mlp.";
    if (w.layers[l].is_moe) {
      w.layers[l].moe.routed = binding::routed_experts(
          config, src, p, "gate.weight", {"gate_proj.weight", "up_proj.weight", "down_proj.weight"});
    } else {
      w.layers[l].mlp = binding::mlp(src, p, config.hidden_size, config.intermediate_size);
    }
  }
  return w;
}

}  // namespace moeinfer
