// Mixtral: softmax top-2 renormalised, GQA, experts named w1 (gate), w3 (up), w2 (down) under
// block_sparse_moe.
#include "model/family.h"

namespace moeinfer {

DecoderWeights bind_mixtral(const ModelConfig& config, WeightSource& src) {
  DecoderWeights w = binding::skeleton(config, src);
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".block_sparse_moe.";
    w.layers[l].moe.routed = binding::routed_experts(config, src, p, "gate.weight",
                                                     {"w1.weight", "w3.weight", "w2.weight"});
  }
  return w;
}

}  // namespace moeinfer
