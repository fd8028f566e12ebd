// ERNIE 4.5 MoE (text): standard attention without biases, RoPE over adjacent pairs (in
// ModelConfig), dense layers outside [moe_layer_start_index, moe_layer_end_index] and off the
// moe_layer_interval grid, routed experts chosen by softmax scores plus a per-expert correction
// bias stored as mlp.moe_statics.e_score_correction_bias [1, E] (one row: the text experts), and
// ungated shared experts. The MTP block (mtp_*) is not read.
#include "model/family.h"

namespace moeinfer {

DecoderWeights bind_ernie4_5_moe(const ModelConfig& config, WeightSource& src) {
  DecoderWeights w = binding::skeleton(config, src);
  const int64_t E = config.num_experts;
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".mlp.";
    LayerWeights& layer = w.layers[l];
    if (!layer.is_moe) {
      layer.mlp = binding::mlp(src, p, config.hidden_size, config.intermediate_size);
      continue;
    }
    layer.moe.routed = binding::routed_experts(
        config, src, p, "gate.weight", {"gate_proj.weight", "up_proj.weight", "down_proj.weight"});
    TensorView bias = src.tensor(p + "moe_statics.e_score_correction_bias", {1, E});
    bias.shape = {E};  // [1, E] -> [E]: the one group's row
    layer.moe.selection_bias = bias;
    if (config.shared_expert_intermediate_size > 0) {
      layer.moe.shared_expert = binding::mlp(src, p + "shared_experts.", config.hidden_size,
                                             config.shared_expert_intermediate_size);
    }
  }
  return w;
}

}  // namespace moeinfer
