// Host interface of token sampling on the GPU: greedy argmax and temperature / top-k / top-p
// sampling from a seeded Philox generator, one block per row of logits.
//
// Per-row parameters live in device memory so that one captured graph serves every mix of
// requests in a batch:
//   logits       [B, V] float32
//   temperature  [B]    float32; <= 0 means greedy for that row
//   top_k        [B]    int32;   <= 0 or >= V means no top-k cut
//   top_p        [B]    float32; >= 1 (or <= 0) means no top-p cut
//   seeds        [B]    uint64 per-request seed
//   steps        [B]    uint64 per-request counter (tokens sampled so far), the Philox
//                       subsequence, so a request's draws do not depend on its batch mates
//   tokens       [B]    int32 output
//
// Semantics (as Hugging Face applies its warpers): scale by 1/temperature, keep the k largest
// (all logits equal to the k-th largest are kept too), then keep the smallest set of the
// largest probabilities whose mass reaches top_p of what is left (ties at the boundary kept),
// then draw from the kept tokens' renormalised probabilities with one uniform draw walked over
// the kept tokens in vocabulary order. Greedy ties go to the lower token id.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace moeinfer::cuda {

struct SamplingParams {
  const float* logits = nullptr;       // [B, V]
  const float* temperature = nullptr;  // [B] or null: greedy for every row
  const int32_t* top_k = nullptr;      // [B] or null: no top-k
  const float* top_p = nullptr;        // [B] or null: no top-p
  const uint64_t* seeds = nullptr;     // [B], needed unless temperature is null
  const uint64_t* steps = nullptr;     // [B], needed unless temperature is null
  int32_t* tokens = nullptr;           // [B]
  int64_t num_rows = 0;                // B
  int64_t vocab_size = 0;              // V
};

void sample_tokens(const SamplingParams& params, cudaStream_t stream);

}  // namespace moeinfer::cuda
