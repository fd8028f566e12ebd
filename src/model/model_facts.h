// The three numbers MoE capacity planning needs (total, active per token, resident), split by
// part, computed from the config and cross-checked against the bound tensors.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>

#include "io/model_config.h"
#include "kv/kv_format.h"
#include "model/weights.h"

namespace moeinfer {

struct PartCounts {
  int64_t attention = 0;
  int64_t routed_experts = 0;
  int64_t shared_experts = 0;
  int64_t embeddings = 0;  // token embedding and LM head (once when tied)
  int64_t other = 0;       // norms, routers, dense MLP layers
  int64_t total() const {
    return attention + routed_experts + shared_experts + embeddings + other;
  }
};

struct ModelFacts {
  PartCounts total_params;     // every parameter
  PartCounts active_params;    // read for one token: K of E routed experts per MoE layer
  PartCounts resident_bytes;   // bytes of the bound tensors in their stored dtypes
  int64_t kv_bytes_per_token_f32 = 0;   // keys + values, all layers, as the CPU cache holds them
  int64_t kv_bytes_per_token_bf16 = 0;
  int64_t kv_bytes_per_token_fp8 = 0;   // --kv-dtype fp8: a byte a value and a scale per head
  // Linear-attention layers' conv window and recurrent state, float32 (both devices keep it so).
  int64_t state_bytes_per_sequence_f32 = 0;
  int64_t checkpoint_tensor_bytes = 0;  // every tensor in the files, bound or not
};

// Values the KV cache holds per token over all layers: the latent row for MLA, keys and
// values otherwise.
int64_t kv_values_per_token(const ModelConfig& config);
// The groups of one layer's KV rows that share one fp8 scale: a GQA key or value row has one per
// KV head ([Nkv] of D); MLA's one row has two, its latent and its rope key, and no value row.
struct KvRowGroups {
  std::vector<int64_t> key, value;
};
KvRowGroups kv_row_groups(const ModelConfig& config);
// Bytes of KV rows per token over the layers with a cache at `dtype`, fp8's scales included: what
// the CPU pool allocates (KvBlockPool::bytes_per_token) and what `moeinfer plan` counts.
int64_t kv_bytes_per_token(const ModelConfig& config, KvDType dtype);
// Values of recurrent state one sequence holds over all linear-attention layers (0 without them):
// its conv windows and delta-rule states, which do not grow with its length.
int64_t state_values_per_sequence(const ModelConfig& config);
// Parameter counts from the config alone.
PartCounts count_params(const ModelConfig& config, bool active_only);
// Counts from the config, bytes from the weights; throws if the bound tensors do not add up to
// the config's parameter count.
ModelFacts model_facts(const ModelConfig& config, const DecoderWeights& weights,
                       int64_t checkpoint_tensor_bytes);
nlohmann::ordered_json facts_to_json(const ModelConfig& config, const ModelFacts& facts);

}  // namespace moeinfer
