// Qwen3-Next and Qwen3.5-MoE's text model. Layers alternate between Gated DeltaNet linear
// attention ("linear_attn.*": the in-projections, the depthwise conv1d, dt_bias, A_log, the gated
// norm and out_proj) and gated full attention ("self_attn.*", q_proj twice as wide for the output
// gate, per-head q/k norms); the MLP side is Qwen2-MoE's (routed experts, a shared expert with
// its own sigmoid gate, dense layers by mlp_only_layers). The two differ in names only:
//   Qwen3-Next   "model.", in_proj_qkvz / in_proj_ba packed per key head
//   Qwen3.5-MoE  "model.language_model." (a vision-language checkpoint: the vision tower
//                "model.visual.*" is not read), in_proj_qkv / in_proj_z / in_proj_b / in_proj_a
// The multi-token-prediction head both publish (mtp.*) is not read, and the load says so.
#include <cstdio>

#include "model/family.h"

namespace moeinfer {
namespace {

enum class Packing { kPerKeyHead, kSplit };

LinearAttentionWeights linear_attention(const ModelConfig& config, WeightSource& src,
                                        const std::string& layer_prefix, Packing packing) {
  const LinearAttentionConfig& lin = *config.linear_attention;
  const std::string p = layer_prefix + "linear_attn.";
  const int64_t H = config.hidden_size;
  const int64_t Nv = lin.num_value_heads;
  LinearAttentionWeights w{
      .conv1d = src.tensor(p + "conv1d.weight", {lin.conv_dim(), 1, lin.conv_kernel}),
      .dt_bias = src.tensor(p + "dt_bias", {Nv}),
      .a_log = src.tensor(p + "A_log", {Nv}),
      .norm = src.tensor(p + "norm.weight", {lin.value_head_dim}),
      .out_proj = src.matrix(p + "out_proj.weight", {H, lin.value_dim()})};
  switch (packing) {
    case Packing::kPerKeyHead:
      w.in_proj_qkvz =
          src.matrix(p + "in_proj_qkvz.weight", {2 * lin.key_dim() + 2 * lin.value_dim(), H});
      w.in_proj_ba = src.matrix(p + "in_proj_ba.weight", {2 * Nv, H});
      break;
    case Packing::kSplit:
      w.in_proj_qkv = src.matrix(p + "in_proj_qkv.weight", {lin.conv_dim(), H});
      w.in_proj_z = src.matrix(p + "in_proj_z.weight", {lin.value_dim(), H});
      w.in_proj_b = src.matrix(p + "in_proj_b.weight", {Nv, H});
      w.in_proj_a = src.matrix(p + "in_proj_a.weight", {Nv, H});
      break;
  }
  return w;
}

DecoderWeights bind(const ModelConfig& config, WeightSource& src, const std::string& model_prefix,
                    Packing packing) {
  DecoderWeights w = binding::skeleton(config, src, "", model_prefix);
  if (const int64_t mtp = src.count_with_prefix("mtp."); mtp > 0) {
    std::fprintf(stderr,
                 "moeinfer: %s: the multi-token-prediction head (%lld mtp.* tensors) is not "
                 "loaded; it is not part of the forward pass\n",
                 config.model_type.c_str(), static_cast<long long>(mtp));
  }
  if (const int64_t visual = src.count_with_prefix("model.visual."); visual > 0) {
    std::fprintf(stderr,
                 "moeinfer: %s: the vision tower (%lld model.visual.* tensors) is not loaded; "
                 "the engine runs the text model\n",
                 config.model_type.c_str(), static_cast<long long>(visual));
  }
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const std::string layer = model_prefix + "layers." + std::to_string(l) + ".";
    const std::string p = layer + "mlp.";
    LayerWeights& lw = w.layers[l];
    if (config.is_linear_layer(l)) {
      lw.linear_attention = linear_attention(config, src, layer, packing);
    }
    if (!lw.is_moe) {
      lw.mlp = binding::mlp(src, p, config.hidden_size, config.intermediate_size);
      continue;
    }
    lw.moe.routed = binding::routed_experts(
        config, src, p, "gate.weight", {"gate_proj.weight", "up_proj.weight", "down_proj.weight"});
    lw.moe.shared_expert = binding::mlp(src, p + "shared_expert.", config.hidden_size,
                                        config.shared_expert_intermediate_size);
    lw.moe.shared_expert_gate =
        src.matrix(p + "shared_expert_gate.weight", {1, config.hidden_size});
  }
  return w;
}

}  // namespace

DecoderWeights bind_qwen3_next(const ModelConfig& config, WeightSource& src) {
  return bind(config, src, "model.", Packing::kPerKeyHead);
}

DecoderWeights bind_qwen3_5_moe(const ModelConfig& config, WeightSource& src) {
  return bind(config, src, "model.language_model.", Packing::kSplit);
}

}  // namespace moeinfer
