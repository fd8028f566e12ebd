// One routed-experts block run through the six stages on the CPU:
// router GEMM -> route -> plan -> dispatch -> experts -> combine -> unpermute.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "moe/stages.h"

namespace moeinfer::moe {

struct RoutedExperts {
  TensorView router;                  // [E, H]
  std::vector<ExpertWeights> experts;  // [E]
};

struct MoeLayerOptions {
  RouterOptions router;
  int64_t hidden_size = 0;   // H
  int64_t expert_width = 0;  // I
};

// Buffers reused across calls so that a decode step allocates nothing once warm.
struct MoeWorkspace {
  std::vector<float> logits;       // [T, E]
  std::vector<float> rows;         // [T*K, H]
  std::vector<float> expert_out;   // [T*K, H]
  Routing routing;
  DispatchPlan plan;
};

// Called between route and plan with the router logits [T, E]; it may change the routing, as a
// test does that replays another device's choices (moe::route_weights gives their weights).
using RouteAdjust =
    std::function<void(const float* logits, const RouterOptions& options, Routing& routing)>;

// out[T, H] = sum over each token's K experts of weight * expert(hidden) (+ shared[T, H]).
void moe_layer_forward(const float* hidden, int64_t num_tokens, const RoutedExperts& weights,
                       const MoeLayerOptions& options, const float* shared, float* out,
                       MoeWorkspace* workspace, const RouteAdjust& adjust = {});

}  // namespace moeinfer::moe
