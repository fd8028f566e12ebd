// Fused router: softmax or sigmoid over a token's E logits, DeepSeek's group-limited selection
// with a selection-only score bias, top-k, renormalisation and the routed scaling factor, in one
// kernel with one warp per token.
//
// Why this shape: a token's E <= 1024 logits fit in one warp's registers (kPerLane = E/32
// rounded up to 1, 2, 4, 8, 16 or 32, a compile-time count so the array stays in registers; 16
// and 32 serve Kimi K2's 384 and Qwen3-Next's 512 experts), the softmax needs only two
// warp reductions, and top-k is K rounds of a warp arg-max over (score, id) pairs ordered by
// score descending then id ascending, a strict total order, so every lane agrees on the winner
// and ties go to the lower expert id as the CPU reference's partial_sort does. Lane k keeps the
// k-th pick, so the K outputs are written by K lanes at once. Selection is by score, not logit,
// exactly like the reference: logits far below the maximum whose softmax underflows to 0 tie,
// and go to the lower id there too. With RouterParams::noise_keys the logits are not read: each
// is replaced by a hash of (noise_seed, the token's key, expert), in router_scores, which every
// kernel that routes with these functions (small_batch_moe's included) goes through.
//
// Two kernels. The plain one (no selection bias, no groups) marks picked experts with -inf,
// which can never win again because scores are >= 0. The general one chooses by
// choice = score + selection_bias, which may be negative, and masks the experts of dropped
// groups with -inf exactly as the reference does, so it tracks the picked experts in a
// per-lane bit mask instead: every unpicked expert stays a candidate, -inf ones included, and
// the order is the reference's total order even in degenerate cases. The weight of a pick is
// its unbiased score, fetched from the lane that owns the winner with one shuffle.
//
// Group scores need a group's experts together, but lane l holds experts l, l + 32, ..., which
// for an arbitrary group size (E = 160 in 8 groups of 20) cuts groups across lanes and slots.
// So the general kernel writes the warp's E choices to shared memory, and L lanes per group
// (the largest power of two with L * num_groups <= 32; 1 past 32 groups) each scan every L-th
// expert of their group and merge with shuffles inside their L-lane segment. Max and top-2 are
// exact whatever the scan order (the top-2 multiset does not depend on it, and a + b == b + a),
// so the group scores are bit-identical to the reference's sequential scan of the same choices.
// A group is kept when fewer than topk_groups groups beat it in (score desc, id asc), the set
// the reference's partial_sort keeps; each lane ranks groups lane, lane + 32, ... against all
// of them (num_groups is 8 in the DeepSeek models: 8 comparisons).
//
// Loads: lane l reads experts l, l + 32, ... so each round of loads is one coalesced 128-byte
// segment per warp; any E works, including ones whose rows are not 16-byte aligned (E = 60).
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/moe_stages.h"

namespace moeinfer::cuda {

inline constexpr int kRouterWarpsPerBlock = 4;

// Calls launch(std::integral_constant<int, kPerLane>{}) with the smallest per-lane register array
// (1, 2, 4, ..., 32 experts a lane) that holds E <= kRouterWarpMaxExperts: the instantiation
// every one-warp routing kernel is launched with.
template <typename Launch>
void with_router_lanes(int64_t num_experts, Launch&& launch) {
  if (num_experts <= 32) {
    launch(std::integral_constant<int, 1>{});
  } else if (num_experts <= 64) {
    launch(std::integral_constant<int, 2>{});
  } else if (num_experts <= 128) {
    launch(std::integral_constant<int, 4>{});
  } else if (num_experts <= 256) {
    launch(std::integral_constant<int, 8>{});
  } else if (num_experts <= 512) {
    launch(std::integral_constant<int, 16>{});
  } else {
    launch(std::integral_constant<int, 32>{});
  }
}

namespace device {

// A token's scores: softmax or sigmoid of logits (+ logit_bias), the logits replaced by
// router_noise when p.noise_keys is set (by its Gumbel transform when there is a logit_bias). Lane
// l holds experts l, l + 32, ...; slots past E hold -inf. kLogitsWrittenHere: the logits were
// written by other blocks of the running kernel, so they are read through L2 (ld.global.cg), not
// the read-only path.
// keep_logits: stop before the sigmoid (the plain router then chooses by the logits).
template <int kPerLane, bool kLogitsWrittenHere>
__device__ __forceinline__ void router_scores(const RouterParams& p, int64_t token, int lane,
                                              float (&score)[kPerLane], bool keep_logits = false) {
  const int num_experts = static_cast<int>(p.num_experts);
  const float* row = p.logits + token * p.num_experts;  // [E]
  if (p.noise_keys != nullptr) {  // the logits replaced by the noise: not read
    const int32_t key = __ldg(p.noise_keys + token);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = j * kWarpSize + lane;
      if (e >= num_experts) {
        score[j] = -INFINITY;
        continue;
      }
      const float u = router_noise(p.noise_seed, key, e);
      score[j] = p.logit_bias != nullptr ? router_gumbel(u) : u;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = j * kWarpSize + lane;
      if (e < num_experts) {
        score[j] = kLogitsWrittenHere ? __ldcg(row + e) : __ldg(row + e);
      } else {
        score[j] = -INFINITY;
      }
    }
  }
  if (p.logit_bias != nullptr) {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = j * kWarpSize + lane;
      if (e < num_experts) score[j] += __ldg(p.logit_bias + e);
    }
  }

  if (p.score == RouterScore::kTopkSoftmax) return;  // the picks' weights are softmaxed later
  if (keep_logits) return;
  if (p.score == RouterScore::kSoftmax) {
    float local_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) local_max = fmaxf(local_max, score[j]);
    const float max_logit = warp_max(local_max);
    float local_sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = j * kWarpSize + lane;
      if (e < num_experts) {
        score[j] = expf(score[j] - max_logit);
        local_sum += score[j];
      }
    }
    const float sum = warp_sum(local_sum);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = j * kWarpSize + lane;
      if (e < num_experts) score[j] = score[j] / sum;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = j * kWarpSize + lane;
      if (e < num_experts) score[j] = 1.0f / (1.0f + expf(-score[j]));
    }
  }
}

// Warp arg-max step: keeps (other, other_id) when it comes first in (value desc, id asc).
__device__ __forceinline__ void router_argmax_merge(float& best, int32_t& best_id) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(kFullMask, best, offset);
    const int32_t other_id = __shfl_xor_sync(kFullMask, best_id, offset);
    if (other > best || (other == best && other_id < best_id)) {
      best = other;
      best_id = other_id;
    }
  }
}

// The reference's scale, same operations in the same order.
__device__ __forceinline__ float router_scale(const RouterParams& p, float picked_sum) {
  return (p.renormalize ? 1.0f / (picked_sum + 1e-20f) : 1.0f) * p.routed_scaling_factor;
}

// kTopkSoftmax: lane k's weight from the K picks' logits (lane k holds the k-th in my_logit),
// as moe::pick_weights: exp(logit - the picks' max) / (their sum in pick order), scaled. Every
// lane of the warp calls it (shuffles).
__device__ __forceinline__ float topk_softmax_weight(const RouterParams& p, float my_logit,
                                                     int lane) {
  const int top_k = static_cast<int>(p.top_k);
  const float max_logit = warp_max(lane < top_k ? my_logit : -INFINITY);
  float sum = 0.0f;
  for (int k = 0; k < top_k; ++k) sum += expf(__shfl_sync(kFullMask, my_logit, k) - max_logit);
  return expf(my_logit - max_logit) / sum * p.routed_scaling_factor;
}

// A token past *num_valid_tokens pads a graph bucket: the null expert E at weight 0 in every
// slot. Returns whether it was one (the whole warp sees the same answer).
__device__ inline bool router_padding_token(const RouterParams& p, int64_t token, int lane) {
  if (p.num_valid_tokens == nullptr || token < __ldg(p.num_valid_tokens)) return false;
  if (lane < p.top_k) {
    p.topk_ids[token * p.top_k + lane] = static_cast<int32_t>(p.num_experts);
    p.topk_weights[token * p.top_k + lane] = 0.0f;
  }
  return true;
}

}  // namespace device

// Plain routing of one token by one warp: no selection bias, no groups. kLogitsWrittenHere as
// for router_scores.
template <int kPerLane, bool kLogitsWrittenHere = false>
__device__ inline void route_token_plain(const RouterParams& p, int64_t token, int lane) {
  const int top_k = static_cast<int>(p.top_k);
  if (device::router_padding_token(p, token, lane)) return;

  // Slots past E, and experts already picked, hold -inf: never chosen since scores are >= 0
  // (kTopkSoftmax and the sigmoid router: finite logits, which -inf never beats either).
  // A plain sigmoid router chooses by the logits, as moe::route: float sigmoid saturates at 1
  // past a logit of about 17, where the logits still tell experts apart (Llama 4). The same
  // picks as by the sigmoid otherwise, and the same weights.
  const bool by_logits = p.score == RouterScore::kSigmoid;
  float score[kPerLane];
  device::router_scores<kPerLane, kLogitsWrittenHere>(p, token, lane, score, by_logits);
  auto weight_of = [&](float picked) {
    return by_logits ? 1.0f / (1.0f + expf(-picked)) : picked;
  };

  float my_score = 0.0f;  // lane k: the k-th pick
  int32_t my_id = 0;
  float picked_sum = 0.0f;  // summed in pick order, as the reference does
  for (int k = 0; k < top_k; ++k) {
    // Best of this lane: slots are in ascending id order, so '>' keeps the lower id on ties.
    float best = -INFINITY;
    int32_t best_id = INT_MAX;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if (score[j] > best) {
        best = score[j];
        best_id = j * device::kWarpSize + lane;
      }
    }
    device::router_argmax_merge(best, best_id);
    if (lane == k) {
      my_score = best;
      my_id = best_id;
    }
    picked_sum += weight_of(best);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if (j * device::kWarpSize + lane == best_id) score[j] = -INFINITY;
    }
  }

  const float weight = p.score == RouterScore::kTopkSoftmax
                           ? device::topk_softmax_weight(p, my_score, lane)
                           : weight_of(my_score) * device::router_scale(p, picked_sum);
  if (lane < top_k) {
    p.topk_ids[token * p.top_k + lane] = my_id;
    p.topk_weights[token * p.top_k + lane] = weight;
  }
}

// The shared memory one warp of the general routing needs: kPerLane * 32 >= E slots each.
template <int kPerLane>
struct RouterWarpScratch {
  static constexpr int kSlots = kPerLane * device::kWarpSize;
  float choice[kSlots];       // [E]
  float group_score[kSlots];  // [num_groups]
  bool kept[kSlots];          // [num_groups]
};

// General routing of one token by one warp: selection bias and/or group-limited selection (see
// the file comment). Only __syncwarp inside, so warps of a block may route different tokens.
template <int kPerLane, bool kLogitsWrittenHere = false>
__device__ inline void route_token_general(const RouterParams& p, int64_t token, int lane,
                                           RouterWarpScratch<kPerLane>& scratch) {
  const int num_experts = static_cast<int>(p.num_experts);
  const int top_k = static_cast<int>(p.top_k);
  if (device::router_padding_token(p, token, lane)) return;

  float score[kPerLane];  // unbiased: the weights
  device::router_scores<kPerLane, kLogitsWrittenHere>(p, token, lane, score);
  float choice[kPerLane];  // score + selection_bias: the selection
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = j * device::kWarpSize + lane;
    choice[j] = e < num_experts
                    ? score[j] + (p.selection_bias != nullptr ? __ldg(p.selection_bias + e) : 0.0f)
                    : -INFINITY;
  }

  if (p.group_score != RouterGroupScore::kNone) {
    const int num_groups = static_cast<int>(p.num_groups);
    const int group_size = num_experts / num_groups;
    float* const warp_choice = scratch.choice;
    float* const group_score = scratch.group_score;
    bool* const kept = scratch.kept;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = j * device::kWarpSize + lane;
      if (e < num_experts) warp_choice[e] = choice[j];
    }
    __syncwarp();

    // L lanes per group, groups_per_pass groups per pass; all values warp-uniform, so every
    // lane runs every shuffle below.
    int lanes_per_group = device::kWarpSize;
    while (lanes_per_group > 1 && lanes_per_group * num_groups > device::kWarpSize) {
      lanes_per_group >>= 1;
    }
    const int groups_per_pass = device::kWarpSize / lanes_per_group;
    const int sub = lane % lanes_per_group;
    const bool top2 = p.group_score == RouterGroupScore::kTop2Sum;
    for (int first_group = 0; first_group < num_groups; first_group += groups_per_pass) {
      const int g = first_group + lane / lanes_per_group;
      // This lane's two best of its share, with multiplicity (the reference's scan).
      float first = -INFINITY, second = -INFINITY;
      if (g < num_groups) {
        const float* s = warp_choice + g * group_size;
        for (int i = sub; i < group_size; i += lanes_per_group) {
          const float v = s[i];
          if (v > first) {
            second = first;
            first = v;
          } else if (v > second) {
            second = v;
          }
        }
      }
      // Merge two top-2 lists {a1 >= a2}, {b1 >= b2}: max(a1, b1), then
      // max(min(a1, b1), max(a2, b2)). Offsets below L stay inside the L-lane segment.
      for (int offset = lanes_per_group / 2; offset > 0; offset >>= 1) {
        const float other_first = __shfl_xor_sync(device::kFullMask, first, offset);
        const float other_second = __shfl_xor_sync(device::kFullMask, second, offset);
        second = fmaxf(fminf(first, other_first), fmaxf(second, other_second));
        first = fmaxf(first, other_first);
      }
      if (sub == 0 && g < num_groups) group_score[g] = top2 ? first + second : first;
    }
    __syncwarp();

    // Kept: fewer than topk_groups groups come before g in (score desc, id asc).
    const int topk_groups = static_cast<int>(p.topk_groups);
    for (int g = lane; g < num_groups; g += device::kWarpSize) {
      const float v = group_score[g];
      int rank = 0;
      for (int h = 0; h < num_groups; ++h) {
        const float w = group_score[h];
        rank += (w > v || (w == v && h < g)) ? 1 : 0;
      }
      kept[g] = rank < topk_groups;
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = j * device::kWarpSize + lane;
      if (e < num_experts && !kept[e / group_size]) choice[j] = -INFINITY;
    }
  }

  uint32_t available = 0;  // bit j: expert j * 32 + lane exists and is not picked yet
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    if (j * device::kWarpSize + lane < num_experts) available |= 1u << j;
  }
  float my_score = 0.0f;  // lane k: the unbiased score of the k-th pick
  int32_t my_id = 0;
  float picked_sum = 0.0f;  // unbiased scores summed in pick order, as the reference does
  for (int k = 0; k < top_k; ++k) {
    // Best of this lane: slots are in ascending id order, so the first available slot, then
    // '>', keeps the lower id on ties (-inf ones included).
    float best = -INFINITY;
    int32_t best_id = INT_MAX;
    float best_score = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if (((available >> j) & 1u) != 0 && (best_id == INT_MAX || choice[j] > best)) {
        best = choice[j];
        best_id = j * device::kWarpSize + lane;
        best_score = score[j];
      }
    }
    device::router_argmax_merge(best, best_id);
    // K <= E leaves a candidate in every round, so best_id is an expert, held by lane
    // best_id % 32 as that lane's own best: its best_score is the winner's score.
    const float picked = __shfl_sync(device::kFullMask, best_score, best_id % device::kWarpSize);
    if (lane == k) {
      my_score = picked;
      my_id = best_id;
    }
    picked_sum += picked;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if (j * device::kWarpSize + lane == best_id) available &= ~(1u << j);
    }
  }

  const float weight = p.score == RouterScore::kTopkSoftmax
                           ? device::topk_softmax_weight(p, my_score, lane)
                           : my_score * device::router_scale(p, picked_sum);
  if (lane < top_k) {
    p.topk_ids[token * p.top_k + lane] = my_id;
    p.topk_weights[token * p.top_k + lane] = weight;
  }
}

// One warp per token, kRouterWarpsPerBlock tokens per block.
template <int kPerLane>
__global__ void __launch_bounds__(kRouterWarpsPerBlock* device::kWarpSize)
    fused_router_kernel(const __grid_constant__ RouterParams p) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  const int lane = threadIdx.x % device::kWarpSize;
  const int64_t token =
      static_cast<int64_t>(blockIdx.x) * kRouterWarpsPerBlock + threadIdx.x / device::kWarpSize;
  if (token >= p.num_tokens) return;  // whole warps leave together
  route_token_plain<kPerLane>(p, token, lane);
}

template <int kPerLane>
__global__ void __launch_bounds__(kRouterWarpsPerBlock* device::kWarpSize)
    fused_router_general_kernel(const __grid_constant__ RouterParams p) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  __shared__ RouterWarpScratch<kPerLane> scratch[kRouterWarpsPerBlock];
  const int lane = threadIdx.x % device::kWarpSize;
  const int warp = threadIdx.x / device::kWarpSize;
  const int64_t token = static_cast<int64_t>(blockIdx.x) * kRouterWarpsPerBlock + warp;
  if (token >= p.num_tokens) return;  // whole warps leave together; only __syncwarp inside
  route_token_general<kPerLane>(p, token, lane, scratch[warp]);
}

}  // namespace moeinfer::cuda
