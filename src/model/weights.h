// The tensors of a decoder-only MoE transformer, bound by name from a checkpoint. Each family
// file (model/<family>.cpp) fills this from its own name table; the forward pass in
// model/decoder.cpp only ever sees these views.
#pragma once

#include <vector>

#include "core/tensor.h"
#include "moe/stages.h"

namespace moeinfer {

class QuantizedMatrices;  // model/quantized_matrix.h

struct AttentionWeights {
  // q_proj is [2*Nq*D, H] with an output gate (Qwen3-Next): per head, D query rows then D gate
  // rows.
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

// Gated DeltaNet (Qwen3-Next's linear attention) in either published packing. Qwen3-Next:
// in_proj_qkvz holds, for each key head g in turn, [q_g (Dk) | k_g (Dk) | v of its r = Nv/Nk
// value heads (r*Dv) | z of those heads (r*Dv)]; in_proj_ba, for each key head, [b of its r value
// heads | a of them]. Qwen3.5: in_proj_qkv is [q | k | v] as the conv reads it, and z, b and a
// have projections of their own.
struct LinearAttentionWeights {
  TensorView in_proj_qkvz;  // [2*Nk*Dk + 2*Nv*Dv, H] (Qwen3-Next)
  TensorView in_proj_ba;    // [2*Nv, H] (Qwen3-Next)
  TensorView in_proj_qkv;   // [2*Nk*Dk + Nv*Dv, H] (Qwen3.5)
  TensorView in_proj_z;     // [Nv*Dv, H] (Qwen3.5)
  TensorView in_proj_b;     // [Nv, H] (Qwen3.5)
  TensorView in_proj_a;     // [Nv, H] (Qwen3.5)
  TensorView conv1d;        // [Nk*Dk*2 + Nv*Dv, 1, conv_kernel] depthwise taps over [q | k | v]
  TensorView dt_bias;       // [Nv]
  TensorView a_log;         // [Nv] log of the decay rate A
  TensorView norm;          // [Dv] gated RMSNorm weight (not zero-centred)
  TensorView out_proj;      // [H, Nv*Dv]
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
  LinearAttentionWeights linear_attention;  // Qwen3-Next's linear layers
  bool is_moe = false;
  MlpWeights mlp;  // dense layers
  MoeWeights moe;  // sparse layers
};

struct DecoderWeights {
  TensorView embed_tokens;  // [V, H]
  TensorView final_norm;    // [H]
  TensorView lm_head;       // [V, H]; the embedding when tied
  std::vector<LayerWeights> layers;
  // The codes and scales behind quantised views (model/quantized_matrix.h), owned by the
  // WeightSource that outlives these views; null where nothing recorded them. The GPU upload
  // holds a routed expert's codes instead of its bf16 values when every expert has a record.
  const QuantizedMatrices* quantized = nullptr;
};

}  // namespace moeinfer
