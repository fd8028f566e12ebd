// The tensors of a decoder-only MoE transformer, bound by name from a checkpoint. Each family
// file (model/<family>.cpp) fills this from its own name table; the forward pass in
// model/decoder.cpp only ever sees these views.
#pragma once

#include <vector>

#include "core/tensor.h"
#include "moe/moe_layer.h"

namespace moeinfer {

struct AttentionWeights {
  TensorView q_proj, k_proj, v_proj, o_proj;  // [Nq*D, H], [Nkv*D, H], [Nkv*D, H], [H, Nq*D]
  TensorView q_bias, k_bias, v_bias, o_bias;  // optional
  TensorView q_norm, k_norm;                  // optional: [D] per head, or [Nq*D] / [Nkv*D]
};

struct MlpWeights {
  TensorView gate_proj, up_proj, down_proj;  // [I, H], [I, H], [H, I]
};

struct MoeWeights {
  moe::RoutedExperts routed;
  MlpWeights shared_expert;                   // optional
  TensorView shared_expert_gate;              // optional: [1, H], sigmoid gate
};

struct LayerWeights {
  TensorView input_norm;           // [H]
  TensorView post_attention_norm;  // [H]
  AttentionWeights attention;
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
