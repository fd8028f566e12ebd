// DeepSeek-V2 / V2-Lite / V3: Multi-head Latent Attention (with or without a query bottleneck),
// shared experts beside the routed ones (ungated), dense first layers, group-limited routing,
// and for V3 a score-correction bias that steers selection only. fp8 block-scaled matrices are
// dequantised by the WeightSource.
#include "model/family.h"

namespace moeinfer {
namespace {

MlaWeights bind_mla(const ModelConfig& config, WeightSource& src, const std::string& layer_prefix) {
  const MlaConfig& m = *config.mla;
  const std::string p = layer_prefix + "self_attn.";
  const int64_t H = config.hidden_size;
  const int64_t Nh = config.num_heads;
  MlaWeights w;
  if (m.q_lora_rank > 0) {
    w.q_a_proj = src.matrix(p + "q_a_proj.weight", {m.q_lora_rank, H});
    w.q_a_norm = src.tensor(p + "q_a_layernorm.weight", {m.q_lora_rank});
    w.q_b_proj = src.matrix(p + "q_b_proj.weight", {Nh * m.qk_head_dim(), m.q_lora_rank});
  } else {
    w.q_proj = src.matrix(p + "q_proj.weight", {Nh * m.qk_head_dim(), H});
  }
  w.kv_a_proj = src.matrix(p + "kv_a_proj_with_mqa.weight", {m.cache_width(), H});
  w.kv_a_norm = src.tensor(p + "kv_a_layernorm.weight", {m.kv_lora_rank});
  w.kv_b_proj =
      src.matrix(p + "kv_b_proj.weight", {Nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank});
  w.o_proj = src.matrix(p + "o_proj.weight", {H, Nh * m.v_head_dim});
  return w;
}

}  // namespace

DecoderWeights bind_deepseek(const ModelConfig& config, WeightSource& src) {
  DecoderWeights w = binding::skeleton(config, src);
  const bool v3 = config.family == ModelFamily::kDeepseekV3;
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const std::string layer = "model.layers." + std::to_string(l) + ".";
    const std::string p = layer + "mlp.";
    LayerWeights& lw = w.layers[l];
    lw.mla = bind_mla(config, src, layer);
    if (!lw.is_moe) {
      lw.mlp = binding::mlp(src, p, config.hidden_size, config.intermediate_size);
      continue;
    }
    lw.moe.routed = binding::routed_experts(
        config, src, p, "gate.weight", {"gate_proj.weight", "up_proj.weight", "down_proj.weight"});
    if (config.shared_expert_intermediate_size > 0) {
      lw.moe.shared_expert = binding::mlp(src, p + "shared_experts.", config.hidden_size,
                                          config.shared_expert_intermediate_size);
    }
    if (v3) lw.moe.selection_bias = src.tensor(p + "gate.e_score_correction_bias", {config.num_experts});
  }
  return w;
}

}  // namespace moeinfer
