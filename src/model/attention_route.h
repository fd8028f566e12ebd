// Which attention kernel a GPU step runs (model/cuda/gpu_decoder.cpp enqueues it), decided in
// one place from the step's shape and the model's facts, so that the choice can be tested on
// machines without a GPU. The routes:
//   decode         every sequence brings one token (and no step wants every position's
//                  logits): paged decode attention, one query row per sequence; graph-captured
//   prefill        every sequence starts at position 0: flash causal attention over the new
//                  tokens alone (the cache is written for later steps)
//   paged prefill  anything else (a prompt chunk after a cached prefix, a mixed step): flash
//                  attention of each sequence's new tokens over its paged keys, on tensor cores
//   MLA prefill    every non-decode step of an MLA model (fresh prompts, chunks after a cached
//                  prefix, mixed steps): flash attention of each sequence's absorbed queries
//                  over its paged latent rows, all heads sharing each key tile (MQA), on tensor
//                  cores (backend/cuda/mla_prefill_kernel.cuh)
//   per-query      what the flash kernels do not cover: each new token is its own row
//                  through the paged decode kernel (the GQA or the MLA one)
// Header-only and CUDA-free.
#pragma once

#include <cstdint>

namespace moeinfer {

enum class AttentionRoute { kDecode, kPrefill, kPagedPrefill, kMlaPrefill, kPerQuery };

struct AttentionStepShape {
  bool one_token_each = false;       // every sequence brings one token, logits of last rows only
  bool all_from_position_0 = false;  // every sequence starts at position 0 (no cached prefix)
};

struct AttentionModelFacts {
  bool mla = false;             // MLA layers (their own kernels: decode, MLA prefill, per-query)
  bool deterministic = false;   // GpuOptions::deterministic
  int64_t padded_head_dim = 0;  // the head dim the kernels see (not MLA)
  int64_t gqa_group = 1;        // query heads per KV head (not MLA)
  // MLA: the cache row's latent and rope key widths as the kernels see them (padded to
  // multiples of 8, device_weights.h's MlaPaddedDims).
  int64_t mla_latent_dim = 0;
  int64_t mla_rope_dim = 0;
};

// The largest GQA group the paged prefill kernel packs into its 64 rows
// (backend/cuda/attention.h's kPagedPrefillMaxGroup; gpu_decoder.cpp checks they agree).
inline constexpr int64_t kPagedPrefillMaxGqaGroup = 64;

// The widest latent and cache row (latent + rope key) the MLA prefill kernel holds (its output
// accumulators in registers, a key tile and the queries in shared memory): DeepSeek-V3's and
// Kimi K2's 512 + 64. backend/cuda/mla_attention.h's kMlaPrefillMaxLatentDim and
// kMlaPrefillMaxCacheWidth; gpu_decoder.cpp checks they agree.
inline constexpr int64_t kMlaPrefillMaxLatent = 512;
inline constexpr int64_t kMlaPrefillMaxRow = 576;

// Whether prompts may run on the GQA flash kernels (the prefill one and the paged one). Not
// under MLA (its attention is over the latent: mla_prefill_kernel_applies), not under
// --deterministic (the flash kernels reduce a query's keys in a different order than a decode row
// does, so a token's logits would depend on how its prompt was cut into steps), and only for the
// head dims the flash kernels are compiled for (64 and 128; wider heads take the decode kernels).
inline bool flash_prefill_kernels_apply(const AttentionModelFacts& model) {
  return !model.mla && !model.deterministic &&
         (model.padded_head_dim == 64 || model.padded_head_dim == 128);
}

// Whether an MLA model's prompts may run on the MLA prefill kernel: not under --deterministic
// (as above: a token's reduction order must not depend on how its prompt was cut), and only for
// latents and rows it holds (wider ones take the streaming decode kernel a query at a time).
inline bool mla_prefill_kernel_applies(const AttentionModelFacts& model) {
  return model.mla && !model.deterministic && model.mla_latent_dim > 0 &&
         model.mla_latent_dim % 8 == 0 && model.mla_rope_dim > 0 && model.mla_rope_dim % 8 == 0 &&
         model.mla_latent_dim <= kMlaPrefillMaxLatent &&
         model.mla_latent_dim + model.mla_rope_dim <= kMlaPrefillMaxRow;
}

inline AttentionRoute choose_attention_route(const AttentionStepShape& step,
                                             const AttentionModelFacts& model) {
  if (step.one_token_each) return AttentionRoute::kDecode;
  // One kernel for fresh prompts and chunks alike: MLA has no separate K and V to attend over
  // before they reach the cache, and the paged kernel starting at position 0 costs nothing more.
  if (model.mla) {
    return mla_prefill_kernel_applies(model) ? AttentionRoute::kMlaPrefill
                                             : AttentionRoute::kPerQuery;
  }
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
  int64_t mla_prefill = 0;
  int64_t per_query = 0;
};

}  // namespace moeinfer
