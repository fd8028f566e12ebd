// OLMoE: q/k RMSNorm over the whole projection (not per head), optional clip_qkv, 64 experts
// top-8 in the published model, every layer sparse.
#include "model/family.h"

namespace moeinfer {

DecoderWeights bind_olmoe(const ModelConfig& config, WeightSource& src) {
  DecoderWeights w = binding::skeleton(config, src);
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".mlp.";
    w.layers[l].moe.routed = binding::routed_experts(
        config, src, p, "gate.weight", {"gate_proj.weight", "up_proj.weight", "down_proj.weight"});
  }
  return w;
}

}  // namespace moeinfer
