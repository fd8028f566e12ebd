// Block router: the fused router for the shapes past the one-warp router (router_kernel.cuh),
// E > kRouterWarpMaxExperts or K > kRouterWarpMaxTopK, with every option it has (softmax or
// sigmoid, logit_bias, selection_bias, kMax and kTop2Sum groups, renormalisation, the routed
// scaling factor, padding tokens). One block per token.
//
// Why this shape: no published model has more than 512 experts or top-k above 10, so these
// shapes are rare and the kernel is built to be plainly correct at any size first:
// - A token's score of expert e is a pure function of the logits: x = logit + logit_bias (the
//   logit replaced by router_noise of the token's key when noise_keys is set),
//   softmax expf(x - max) / sum (max and sum block reductions, computed once) or sigmoid
//   1 / (1 + expf(-x)), the one-warp kernels' float32 operations in the same order. Recomputed
//   from the same inputs it gives the same bits, so nothing per expert has to be stored: the
//   choices (score + selection_bias) and the group scores sit in dynamic shared memory when
//   they fit in kRouterBlockCacheBytes (any E up to ~10000 without groups) and are recomputed
//   where needed otherwise.
// - The picks are K rounds of a block-wide arg-max in the reference's strict total order
//   (choice desc, id asc). Round k's candidates are the experts after round k-1's winner in
//   that order, so no set of picked experts is kept whatever K is, -inf choices stay candidates
//   (ordered by id, as the reference's partial_sort orders them), and a thread that did not
//   hold the winner keeps its own best for the next round (it still comes first among its
//   experts after the winner): only the winner's thread scans again.
// - The kept groups are the topk_groups first groups in (group score desc, id asc), found by
//   the same rounds over the groups; a group is kept when it is the last of them or comes
//   before it. Max and top-2 of a group are exact whatever the scan order, so a group's score is
//   what the reference's sequential scan gives for the same choices.
// - Thread 0 writes each pick as it is found, its weight the recomputed unbiased score, and sums
//   them in pick order; the block then scales the K weights as the reference does.
// NaN scores (NaN logits) are never picked; a round left without a candidate (only NaN left)
// writes the null expert E at weight 0, which every later stage ignores.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/moe_stages.h"
#include "backend/cuda/router_kernel.cuh"

namespace moeinfer::cuda {

inline constexpr int kRouterBlockThreads = 256;
// Dynamic shared memory for the cached group scores [G] and choices [E]: under the 48 KB a
// block gets without opting in, with room for the static scratch.
inline constexpr int64_t kRouterBlockCacheBytes = 40 * 1024;

// Which arrays the launcher put in dynamic shared memory: group_scores [G] first, then
// choices [E]. An array not cached is recomputed where it is read.
struct RouterBlockCache {
  bool group_scores = false;
  bool choices = false;
};

namespace device {

// Whether (v, id) comes before (w, jd) in the router's order: value desc, then id asc. A strict
// total order on non-NaN values; a NaN value comes before nothing and nothing comes before it.
__device__ __forceinline__ bool router_before(float v, int id, float w, int jd) {
  return v > w || (v == w && id < jd);
}

// An item and its value in router order; id INT_MAX: none.
struct RouterRanked {
  float value;
  int id;
};

template <int kThreads>
struct RouterBlockScratch {
  static constexpr int kWarps = kThreads / kWarpSize;
  float warp_value[kWarps];
  int warp_id[kWarps];
  float value;  // the block's result, read by every thread
  int id;
};

// Block-wide reduction of v by op (max or sum), the result returned to every thread. The
// two-barrier pattern makes back-to-back calls on one scratch safe: the warp slots are read
// before the second barrier, the result before the next call's first.
template <int kThreads, typename Op>
__device__ float router_block_reduce(float v, Op op, float identity,
                                     RouterBlockScratch<kThreads>& s) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(kFullMask, v, offset));
  if (lane == 0) s.warp_value[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < s.kWarps ? s.warp_value[lane] : identity;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      w = op(w, __shfl_xor_sync(kFullMask, w, offset));
    if (lane == 0) s.value = w;
  }
  __syncthreads();
  return s.value;
}

// Block-wide arg-max: the (value, id) that comes first in router order, to every thread.
// (-inf, INT_MAX) is "no candidate" and loses to every candidate, -inf ones included.
template <int kThreads>
__device__ void router_block_best(float& value, int& id, RouterBlockScratch<kThreads>& s) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(kFullMask, value, offset);
    const int other_id = __shfl_xor_sync(kFullMask, id, offset);
    if (router_before(other, other_id, value, id)) {
      value = other;
      id = other_id;
    }
  }
  if (lane == 0) {
    s.warp_value[warp] = value;
    s.warp_id[warp] = id;
  }
  __syncthreads();
  if (warp == 0) {
    float v = lane < s.kWarps ? s.warp_value[lane] : -INFINITY;
    int i = lane < s.kWarps ? s.warp_id[lane] : INT_MAX;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other = __shfl_xor_sync(kFullMask, v, offset);
      const int other_id = __shfl_xor_sync(kFullMask, i, offset);
      if (router_before(other, other_id, v, i)) {
        v = other;
        i = other_id;
      }
    }
    if (lane == 0) {
      s.value = v;
      s.id = i;
    }
  }
  __syncthreads();
  value = s.value;
  id = s.id;
}

// `rounds` rounds of the block-wide arg-max over items [0, n) valued by value_of(i): round k's
// winner is the k-th item in router order. on_pick(k, value, id) runs on thread 0 after each
// round (id INT_MAX: no candidate was left). Returns the last winner, to every thread.
// n <= kMaxExperts: i + kThreads stays inside int.
template <int kThreads, typename ValueOf, typename OnPick>
__device__ RouterRanked router_block_rounds(int n, int rounds, ValueOf value_of, OnPick on_pick,
                                            RouterBlockScratch<kThreads>& s) {
  float prev = INFINITY;  // before every item: round 0 takes all
  int prev_id = -1;
  float best = -INFINITY;  // this thread's first item after (prev, prev_id)
  int best_id = INT_MAX;
  bool rescan = true;
  for (int k = 0; k < rounds; ++k) {
    if (rescan) {
      best = -INFINITY;
      best_id = INT_MAX;
      // Ascending ids: the first candidate, then strictly better ones.
      for (int i = threadIdx.x; i < n; i += kThreads) {
        const float v = value_of(i);
        if (router_before(prev, prev_id, v, i) &&
            (best_id == INT_MAX || router_before(v, i, best, best_id))) {
          best = v;
          best_id = i;
        }
      }
    }
    float winner = best;
    int winner_id = best_id;
    router_block_best(winner, winner_id, s);
    if (threadIdx.x == 0) on_pick(k, winner, winner_id);
    rescan = winner_id == best_id;  // this thread held the winner (or nobody had a candidate)
    prev = winner;
    prev_id = winner_id;
  }
  return {prev, prev_id};
}

// A token's scores and choices, recomputed from its logits.
struct RouterBlockToken {
  const RouterParams* p;
  const float* logits;  // [E] this token's row
  float max_logit;      // softmax: over the biased logits
  float sum;            // softmax: of expf(x - max_logit)
  int32_t noise_key;    // with p->noise_keys: this token's key

  __device__ __forceinline__ float biased_logit(int e) const {
    float x = p->noise_keys != nullptr ? router_noise(p->noise_seed, noise_key, e)
                                       : __ldg(logits + e);
    if (p->logit_bias != nullptr) x += __ldg(p->logit_bias + e);
    return x;
  }
  // The one-warp kernels' operations: expf(x - max) / sum, or 1 / (1 + expf(-x)), or x itself
  // (kTopkSoftmax, whose picks are softmaxed at the end).
  __device__ __forceinline__ float score(int e) const {
    const float x = biased_logit(e);
    if (p->score == RouterScore::kTopkSoftmax) return x;
    if (p->score == RouterScore::kSoftmax) return expf(x - max_logit) / sum;
    return 1.0f / (1.0f + expf(-x));
  }
  __device__ __forceinline__ float choice(int e) const {
    return score(e) + (p->selection_bias != nullptr ? __ldg(p->selection_bias + e) : 0.0f);
  }
};

// The two best of v1, v2, ... with multiplicity, the reference's scan.
__device__ __forceinline__ void router_top2_add(float v, float& first, float& second) {
  if (v > first) {
    second = first;
    first = v;
  } else if (v > second) {
    second = v;
  }
}

}  // namespace device

// One block per token. Dynamic shared memory: [G] group scores if cache.group_scores, then
// [E] choices if cache.choices.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    fused_router_block_kernel(const __grid_constant__ RouterParams p,
                              const __grid_constant__ RouterBlockCache cache) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  extern __shared__ float router_block_smem[];
  __shared__ device::RouterBlockScratch<kThreads> scratch;
  __shared__ float scale;
  const int64_t token = blockIdx.x;
  const int E = static_cast<int>(p.num_experts), K = static_cast<int>(p.top_k);
  int32_t* const ids = p.topk_ids + token * K;        // [K]
  float* const weights = p.topk_weights + token * K;  // [K]

  // A token past *num_valid_tokens pads a graph bucket: the null expert E at weight 0.
  if (p.num_valid_tokens != nullptr && token >= __ldg(p.num_valid_tokens)) {
    for (int k = threadIdx.x; k < K; k += kThreads) {
      ids[k] = E;
      weights[k] = 0.0f;
    }
    return;  // the whole block: num_valid_tokens is uniform
  }

  device::RouterBlockToken tok{&p, p.logits + token * E, 0.0f, 1.0f,
                               p.noise_keys != nullptr ? __ldg(p.noise_keys + token) : 0};
  if (p.score == RouterScore::kSoftmax) {
    float local_max = -INFINITY;
    for (int e = threadIdx.x; e < E; e += kThreads)
      local_max = fmaxf(local_max, tok.biased_logit(e));
    tok.max_logit = device::router_block_reduce(
        local_max, [](float a, float b) { return fmaxf(a, b); }, -INFINITY, scratch);
    float local_sum = 0.0f;
    for (int e = threadIdx.x; e < E; e += kThreads)
      local_sum += expf(tok.biased_logit(e) - tok.max_logit);
    tok.sum = device::router_block_reduce(
        local_sum, [](float a, float b) { return a + b; }, 0.0f, scratch);
  }

  const bool grouped = p.group_score != RouterGroupScore::kNone;
  const int G = grouped ? static_cast<int>(p.num_groups) : 1;
  const int group_size = E / G;
  float* const group_cache = cache.group_scores ? router_block_smem : nullptr;  // [G]
  float* const choice_cache =
      cache.choices ? router_block_smem + (cache.group_scores ? G : 0) : nullptr;  // [E]
  if (choice_cache != nullptr) {
    for (int e = threadIdx.x; e < E; e += kThreads) choice_cache[e] = tok.choice(e);
    __syncthreads();
  }
  // The unmasked choice of expert e (until the cache is masked below).
  auto choice_of = [&](int e) { return choice_cache != nullptr ? choice_cache[e] : tok.choice(e); };

  // Group g's score, scanned by one thread (group scores not cached).
  const bool top2 = p.group_score == RouterGroupScore::kTop2Sum;
  auto scan_group = [&](int g) {
    float first = -INFINITY, second = -INFINITY;
    for (int i = g * group_size; i < (g + 1) * group_size; ++i)
      device::router_top2_add(choice_of(i), first, second);
    return top2 ? first + second : first;
  };
  auto group_value = [&](int g) { return group_cache != nullptr ? group_cache[g] : scan_group(g); };

  // The last kept group in (score desc, id asc): a group is kept when it is this one or comes
  // before it.
  device::RouterRanked last_kept{-INFINITY, INT_MAX};
  if (grouped) {
    if (group_cache != nullptr) {
      // One warp per group: lane l scans members l, l + 32, ..., then the lanes merge their two
      // best ({a1 >= a2} and {b1 >= b2}: max(a1, b1), then max(min(a1, b1), max(a2, b2))).
      const int lane = threadIdx.x % device::kWarpSize, warp = threadIdx.x / device::kWarpSize;
      for (int g = warp; g < G; g += kThreads / device::kWarpSize) {  // warp-uniform
        float first = -INFINITY, second = -INFINITY;
        for (int i = lane; i < group_size; i += device::kWarpSize)
          device::router_top2_add(choice_of(g * group_size + i), first, second);
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
          const float other_first = __shfl_xor_sync(device::kFullMask, first, offset);
          const float other_second = __shfl_xor_sync(device::kFullMask, second, offset);
          second = fmaxf(fminf(first, other_first), fmaxf(second, other_second));
          first = fmaxf(first, other_first);
        }
        if (lane == 0) group_cache[g] = top2 ? first + second : first;
      }
      __syncthreads();
    }
    last_kept = device::router_block_rounds<kThreads>(
        G, static_cast<int>(p.topk_groups), group_value, [](int, float, int) {}, scratch);
  }
  auto kept = [&](int e) {
    const int g = e / group_size;
    return g == last_kept.id ||
           device::router_before(group_value(g), g, last_kept.value, last_kept.id);
  };
  // With both arrays cached the dropped groups' choices are set to -inf in place (kept() then
  // reads only the group cache); otherwise kept() is asked per read, and the choices it may
  // scan stay unmasked.
  const bool masked_in_cache = grouped && choice_cache != nullptr && group_cache != nullptr;
  if (masked_in_cache) {
    for (int e = threadIdx.x; e < E; e += kThreads)
      if (!kept(e)) choice_cache[e] = -INFINITY;
    __syncthreads();
  }
  // The choice the top-k sees: -inf outside the kept groups.
  auto masked_choice = [&](int e) {
    if (!grouped || masked_in_cache) return choice_of(e);
    return kept(e) ? choice_of(e) : -INFINITY;
  };

  float picked_sum = 0.0f;  // thread 0's: the unbiased scores in pick order
  device::router_block_rounds<kThreads>(
      E, K, masked_choice,
      [&](int k, float, int id) {
        if (id == INT_MAX) {  // only NaN scores were left
          ids[k] = E;
          weights[k] = 0.0f;
          return;
        }
        const float s = tok.score(id);
        ids[k] = id;
        weights[k] = s;
        picked_sum += s;
      },
      scratch);
  if (p.score == RouterScore::kTopkSoftmax) {
    // The softmax of the picked logits (thread 0 wrote them as the weights), as
    // moe::pick_weights: their max, then the sum in pick order; a null pick keeps weight 0.
    if (threadIdx.x == 0) {
      float max_logit = -INFINITY;
      for (int k = 0; k < K; ++k)
        if (ids[k] < E) max_logit = fmaxf(max_logit, weights[k]);
      float sum = 0.0f;
      for (int k = 0; k < K; ++k)
        if (ids[k] < E) sum += expf(weights[k] - max_logit);
      for (int k = 0; k < K; ++k) {
        weights[k] =
            ids[k] < E ? expf(weights[k] - max_logit) / sum * p.routed_scaling_factor : 0.0f;
      }
    }
    return;
  }
  if (threadIdx.x == 0) scale = device::router_scale(p, picked_sum);
  __syncthreads();  // also makes thread 0's weights visible to the block
  for (int k = threadIdx.x; k < K; k += kThreads) weights[k] *= scale;
}

}  // namespace moeinfer::cuda
