// Llama 4 (text): Llama4ForConditionalGeneration as published, its text model under
// "language_model." (model.*, lm_head) beside a vision tower (vision_model.*,
// multi_modal_projector.*) that is not read, or Llama4ForCausalLM without the prefix. Attention
// is Llama's (biases when attention_bias); the layer's feed-forward sits under "feed_forward.":
// a dense MLP of intermediate_size_mlp, or a router ("router.weight" [E, H]), the stacked
// experts and an ungated shared expert ("shared_expert."). The experts are stored [in, out]:
// gate_up_proj [E, H, 2I] with the gate in the first I columns and up in the last I, down_proj
// [E, I, H]; the products take [out, in], so each is copied transposed once at load (the CPU
// path holds the routed experts twice over while the map's pages stay cached).
#include "model/family.h"

namespace moeinfer {

DecoderWeights bind_llama4(const ModelConfig& config, WeightSource& src) {
  const std::string prefix = config.model_type == "llama4" ? "language_model." : "";
  DecoderWeights w = binding::skeleton(config, src, prefix);
  const int64_t E = config.num_experts;
  const int64_t H = config.hidden_size;
  const int64_t I = config.moe_intermediate_size;
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const std::string p = prefix + "model.layers." + std::to_string(l) + ".feed_forward.";
    LayerWeights& layer = w.layers[l];
    if (!layer.is_moe) {
      layer.mlp = binding::mlp(src, p, H, config.intermediate_size);
      continue;
    }
    moe::RoutedExperts& routed = layer.moe.routed;
    routed.router = src.tensor(p + "router.weight", {E, H});
    const TensorView gate_up = src.tensor(p + "experts.gate_up_proj", {E, H, 2 * I});
    const TensorView down = src.tensor(p + "experts.down_proj", {E, I, H});
    routed.experts.resize(E);
    for (int64_t e = 0; e < E; ++e) {
      const TensorView both = gate_up.slice0(e);  // [H, 2I]
      routed.experts[e] = {.gate = src.transposed_columns(both, 0, I),
                           .up = src.transposed_columns(both, I, I),
                           .down = src.transposed_columns(down.slice0(e), 0, H)};
    }
    layer.moe.shared_expert =
        binding::mlp(src, p + "shared_expert.", H, config.shared_expert_intermediate_size);
  }
  return w;
}

}  // namespace moeinfer
