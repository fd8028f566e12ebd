// The per-layer decisions of a config, made once: which attention, which q/k norm, dense or MoE,
// which shared expert, which RoPE pairing, RoPE or none, causal or chunked attention, which query
// scale. Both decoders switch on these enums without a
// `default`, so a family quirk added here does not compile until every device handles it.
#pragma once

#include <cstdint>
#include <vector>

#include "io/model_config.h"

namespace moeinfer {

enum class AttentionKind {
  kGqa,            // grouped-query attention over per-head keys and values (MHA and MQA included)
  kMla,            // DeepSeek's multi-head latent attention over a [latent | rope key] cache
  kGatedDeltaNet,  // Qwen3-Next's linear attention: a per-sequence recurrent state, no KV rows
};

enum class QkNormKind {
  kNone,
  kPerHead,              // Qwen3-MoE: RMSNorm over each head's D values
  kWholeProjection,      // OLMoE: RMSNorm over the whole q and k projections
  kAfterRopeWeightless,  // Llama 4: RMSNorm without weight over each head, after RoPE
};

enum class PositionEncoding {
  kRope,
  kNone,  // Llama 4's NoPE layers: queries and keys carry no position
};

// Which cached keys a query attends to, beyond causality.
enum class AttentionSpan {
  kCausal,   // every earlier key (or the config's sliding window)
  kChunked,  // Llama 4: only keys of the query's own attention_chunk_size block of positions
};

enum class QueryScale {
  kNone,
  kTemperature,  // Llama 4's NoPE layers: 1 + attn_scale * log1p(floor((p + 1) / floor_scale))
};

enum class FeedForwardKind {
  kDenseMlp,
  kMoe,  // routed experts (with the shared expert below, if any)
};

enum class SharedExpertKind {
  kNone,
  kUngated,       // DeepSeek: added as it is
  kSigmoidGated,  // Qwen2-MoE: scaled by sigmoid(x . shared_expert_gate)
};

enum class RopePairing {
  kHalves,       // (i, i + R/2) over the R rotary dims, transformers' rotate_half
  kInterleaved,  // (2i, 2i + 1), DeepSeek's rope_interleave, ERNIE 4.5
};

struct LayerPlan {
  AttentionKind attention = AttentionKind::kGqa;
  QkNormKind qk_norm = QkNormKind::kNone;
  bool clip_qkv = false;  // OLMoE: clamp q, k and v to +-clip_qkv
  bool output_gate = false;  // Qwen3-Next: the attention output times sigmoid(q_proj's gate)
  // Keys each query sees, itself included (0: every earlier key): the config's sliding_window
  // on the layers that slide (all of them, or GPT-OSS's layer_types).
  int64_t sliding_window = 0;
  bool attention_sinks = false;  // GPT-OSS: a per-head logit joins each softmax's denominator
  RopePairing rope = RopePairing::kHalves;
  PositionEncoding position = PositionEncoding::kRope;
  AttentionSpan span = AttentionSpan::kCausal;
  QueryScale query_scale = QueryScale::kNone;
  FeedForwardKind feed_forward = FeedForwardKind::kDenseMlp;
  SharedExpertKind shared_expert = SharedExpertKind::kNone;  // kNone in dense layers
};

// One plan per layer, in layer order.
std::vector<LayerPlan> plan_layers(const ModelConfig& config);

// The indices of the layers with routed experts (config.layer_is_moe), in order: what expert
// placements and per-layer expert counters are indexed by.
std::vector<int64_t> moe_layer_indices(const ModelConfig& config);

}  // namespace moeinfer
