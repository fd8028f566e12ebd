// The tensors of a decoder-only MoE transformer, bound by name from a checkpoint. Each family
// file (model/<family>.cpp) fills this from its own name table; the forward pass in
// model/decoder.cpp only ever sees these views.
#pragma once

#include <vector>

#include "core/tensor.h"
#include "moe/stages.h"

namespace moeinfer {

struct AttentionWeights {
  TensorView q_proj, k_proj, v_proj, o_proj;  // [Nq*D, H], [Nkv*D, H], [Nkv*D, H], [H, Nq*D]
  TensorView q_bias, k_bias, v_bias, o_bias;  // optional
  TensorView q_norm, k_norm;                  // optional: [D] per head, or [Nq*D] / [Nkv*D]
  TensorView sinks;                           // optional: [Nq] GPT-OSS's sink logit per head
};

// Multi-head Latent Attention (DeepSeek).
struct MlaWeights {
  TensorView q_proj;             // [Nh*(nope+rope), H] when there is no query bottleneck
  TensorView q_a_proj;           // [q_lora, H]
  TensorView q_a_norm;           // [q_lora]
  TensorView q_b_proj;           // [Nh*(nope+rope), q_lora]
  TensorView kv_a_proj;          // [kv_lora + rope, H]: the latent and the shared RoPE key
  TensorView kv_a_norm;          // [kv_lora]
  TensorView kv_b_proj;          // [Nh*(nope+v), kv_lora]: per head, key rows then value rows
  TensorView o_proj;             // [H, Nh*v]
};

struct MlpWeights {
  TensorView gate_proj, up_proj, down_proj;  // [I, H], [I, H], [H, I]
};

struct MoeWeights {
  moe::RoutedExperts routed;
  MlpWeights shared_expert;                   // optional
  TensorView shared_expert_gate;              // optional: [1, H], sigmoid gate
  TensorView selection_bias;                  // optional: [E] e_score_correction_bias (f32)
  TensorView router_bias;                     // optional: [E] added to the router's logits
};

struct LayerWeights {
  TensorView input_norm;           // [H]
  TensorView post_attention_norm;  // [H]
  AttentionWeights attention;  // standard attention
  MlaWeights mla;              // DeepSeek attention
  bool is_moe = false;
  MlpWeights mlp;  // dense layers
  MoeWeights moe;  // sparse layers
};

struct DecoderWeights {
  TensorView embed_tokens;  // [V, H]
  TensorView final_norm;    // [H]
  TensorView lm_head;       // [V, H]; the embedding when tied
  std::vector<LayerWeights> layers;
};

}  // namespace moeinfer
