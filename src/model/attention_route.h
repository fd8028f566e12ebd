// Which attention kernel a GPU step runs (model/cuda/gpu_decoder.cpp enqueues it), decided in
// one place from the step's shape and the model's facts, so that the choice can be tested on
// machines without a GPU. The routes:
//   decode         every sequence brings one token (and no step wants every position's
//                  logits): paged decode attention, one query row per sequence; graph-captured
//   prefill        every sequence starts at position 0: flash causal attention over the new
//                  tokens alone (the cache is written for later steps)
//   paged prefill  anything else (a prompt chunk after a cached prefix, a mixed step): flash
//                  attention of each sequence's new tokens over its paged keys, on tensor cores
//   per-query      what the paged prefill kernel does not cover: each new token is its own row
//                  through the paged decode kernel
// Header-only and CUDA-free.
#pragma once

#include <cstdint>

namespace moeinfer {

enum class AttentionRoute { kDecode, kPrefill, kPagedPrefill, kPerQuery };

struct AttentionStepShape {
  bool one_token_each = false;       // every sequence brings one token, logits of last rows only
  bool all_from_position_0 = false;  // every sequence starts at position 0 (no cached prefix)
};

struct AttentionModelFacts {
  bool mla = false;             // MLA layers (their own kernels: decode, or per-query)
  bool deterministic = false;   // GpuOptions::deterministic
  int64_t padded_head_dim = 0;  // the head dim the kernels see
  int64_t gqa_group = 1;        // query heads per KV head
};

// The largest GQA group the paged prefill kernel packs into its 64 rows
// (backend/cuda/attention.h's kPagedPrefillMaxGroup; gpu_decoder.cpp checks they agree).
inline constexpr int64_t kPagedPrefillMaxGqaGroup = 64;

// Whether prompts may run on the flash kernels (the prefill one and the paged one). Not under
// MLA (its attention is over the latent, mla_attention.h), not under --deterministic (the flash
// kernels reduce a query's keys in a different order than a decode row does, so a token's
// logits would depend on how its prompt was cut into steps), and only for the head dims the
// flash kernels are compiled for (64 and 128; wider heads take the decode kernels).
inline bool flash_prefill_kernels_apply(const AttentionModelFacts& model) {
  return !model.mla && !model.deterministic &&
         (model.padded_head_dim == 64 || model.padded_head_dim == 128);
}

inline AttentionRoute choose_attention_route(const AttentionStepShape& step,
                                             const AttentionModelFacts& model) {
  if (step.one_token_each) return AttentionRoute::kDecode;
  if (!flash_prefill_kernels_apply(model)) return AttentionRoute::kPerQuery;
  if (step.all_from_position_0) return AttentionRoute::kPrefill;
  // No model has a group past 64 today; the per-query route would still be right for one.
  return model.gqa_group <= kPagedPrefillMaxGqaGroup ? AttentionRoute::kPagedPrefill
                                                     : AttentionRoute::kPerQuery;
}

// Steps per route since a decoder was made (GpuDecoder::attention_route_counts), for tests and
// benchmarks that must know which kernel ran.
struct AttentionRouteCounts {
  int64_t decode = 0;
  int64_t prefill = 0;
  int64_t paged_prefill = 0;
  int64_t per_query = 0;
};

}  // namespace moeinfer
