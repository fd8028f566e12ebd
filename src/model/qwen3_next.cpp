// Qwen3-Next: layers alternate between Gated DeltaNet linear attention ("linear_attn.*": the packed
// in_proj_qkvz / in_proj_ba, the depthwise conv1d, dt_bias, A_log, the gated norm and out_proj)
// and gated full attention ("self_attn.*", q_proj twice as wide for the output gate, per-head
// q/k norms); the MLP side is Qwen2-MoE's (routed experts, a shared expert with its own sigmoid
// gate, dense layers by mlp_only_layers). The multi-token-prediction head the published
// checkpoints carry (mtp.*) is not read.
#include <cstdio>

#include "model/family.h"

namespace moeinfer {
namespace {

LinearAttentionWeights linear_attention(const ModelConfig& config, WeightSource& src,
                                        const std::string& layer_prefix) {
  const LinearAttentionConfig& lin = *config.linear_attention;
  const std::string p = layer_prefix + "linear_attn.";
  const int64_t H = config.hidden_size;
  const int64_t Nv = lin.num_value_heads;
  return LinearAttentionWeights{
      .in_proj_qkvz =
          src.matrix(p + "in_proj_qkvz.weight", {2 * lin.key_dim() + 2 * lin.value_dim(), H}),
      .in_proj_ba = src.matrix(p + "in_proj_ba.weight", {2 * Nv, H}),
      .conv1d = src.tensor(p + "conv1d.weight", {lin.conv_dim(), 1, lin.conv_kernel}),
      .dt_bias = src.tensor(p + "dt_bias", {Nv}),
      .a_log = src.tensor(p + "A_log", {Nv}),
      .norm = src.tensor(p + "norm.weight", {lin.value_head_dim}),
      .out_proj = src.matrix(p + "out_proj.weight", {H, lin.value_dim()})};
}

}  // namespace

DecoderWeights bind_qwen3_next(const ModelConfig& config, WeightSource& src) {
  DecoderWeights w = binding::skeleton(config, src);
  if (const int64_t mtp = src.count_with_prefix("mtp."); mtp > 0) {
    std::fprintf(stderr,
                 "moeinfer: qwen3_next: the multi-token-prediction head (%lld mtp.* tensors) is "
                 "not loaded; it is not part of the forward pass\n",
                 static_cast<long long>(mtp));
  }
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const std::string layer = "model.layers." + std::to_string(l) + ".";
    const std::string p = layer + "mlp.";
    LayerWeights& lw = w.layers[l];
    if (config.is_linear_layer(l)) lw.linear_attention = linear_attention(config, src, layer);
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

}  // namespace moeinfer
