// Routing approximations (issue 17): ways of computing less than the model's router asks for,
// each off by default, applied inside the MoE block's route stage so that every device and
// strategy downstream (plan, dispatch, the experts, combine) sees only the changed routing.
//
// In the order the route stage applies them:
//   router_temperature  logits / T before the score function (softmax, sigmoid, GPT-OSS's
//                       softmax over the top-k logits). T > 1 flattens, T < 1 sharpens; with a
//                       sigmoid router and a selection bias the choice itself may change.
//   active_experts K'   of the K chosen, keep the K' of largest routing weight (ties: earlier in
//                       route()'s choice order). kFull keeps their weights as the full top-K
//                       gave them (their sum falls below the K's); kKept scales them to the sum
//                       the K had: 1 (times routed_scaling_factor) where the family renormalises
//                       (Qwen3 with norm_topk_prob, Mixtral, DeepSeek-V3, GPT-OSS), the K's own
//                       sum where it does not (OLMoE, Qwen2-MoE, DeepSeek-V2), so that kKept is
//                       "renormalise among the kept" and kFull "normalised against the full
//                       top-K" of the published comparison in either kind of family.
//   drop_below W        an assignment whose share of its token's routed weight (w / sum of the
//                       token's weights: the weight itself where weights sum to 1) is under W
//                       is dropped; the token's largest weight (ties: earlier in choice order)
//                       is always kept; the kept are scaled back to the token's sum before.
//   expert_capacity F   at most C = ceil(F * M / E) rows per expert in one forward, M the step's
//                       assignments still routed (T * K with nothing else on). Assignments are
//                       admitted in token order, then each token's choice order; one that finds
//                       its expert full is dropped (kDrop: the token's remaining weights scaled
//                       back to its sum before, a token left with none gets no routed output,
//                       only its shared experts) or (kReroute) moved to the first expert of the
//                       token's route() preference with room that it does not already use,
//                       weighted as the router weighs that expert beside the token's others
//                       (its score times the token's factor: renormalisation and scaling as
//                       route() applied them; the weights are not renormalised again), and
//                       dropped as under kDrop when none has room. What
//                       is admitted depends on the other tokens of the same forward: the result
//                       depends on the batch, by design of a capacity.
//
// Llama 4 (top-1, sigmoid of the chosen logit, the weight applied to the expert's input): K'
// and drop_below cannot drop its one expert; a capacity can, leaving the token its shared
// expert; a rerouted token's input is scaled by sigmoid(new logit).
//
// Dropped assignments keep their slot as moe::kNoExpert with weight 0: Routing keeps its [T, K]
// shape and plan gives them no row, so the experts compute only what is kept.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moe/stages.h"

namespace moeinfer::moe {

enum class KeptRenorm { kKept, kFull };
enum class CapacityOverflow { kDrop, kReroute };

struct RoutingApproximation {
  int64_t active_experts = 0;  // K' in [1, K]; 0: every one of the K
  KeptRenorm renorm = KeptRenorm::kKept;
  double drop_below = 0.0;       // W in [0, 1); 0: off
  double expert_capacity = 0.0;  // F >= 1; 0: off
  CapacityOverflow overflow = CapacityOverflow::kDrop;
  double router_temperature = 1.0;  // T > 0; 1: off

  bool enabled() const;
  bool operator==(const RoutingApproximation&) const = default;
  // Whether assignments may be dropped (all but the temperature), so that a token may have
  // fewer than K experts.
  bool drops() const { return active_experts != 0 || drop_below != 0.0 || expert_capacity != 0.0; }
  // The command-line flags of the approximations that are on (--active-experts, ...).
  std::vector<std::string> flags() const;
};

// Checks the values on their own and against the router (K' <= K); throws moeinfer::Error
// naming the command-line flag.
void validate(const RoutingApproximation& approx, const RouterOptions& router);

// Refuses the approximations a device does not run yet (the GPU's route stage has the
// temperature, --active-experts and --drop-below, not --expert-capacity): an error naming the
// flag, never a silent run without it.
void check_routing_device(const RoutingApproximation& approx, bool cuda);

// logits [n] /= router_temperature (nothing when it is 1).
void apply_temperature(const RoutingApproximation& approx, float* logits, int64_t n);

// Applies active_experts, drop_below and expert_capacity to route()'s output for `logits`
// [T, E] (already divided by the temperature) under `router`.
void approximate_routing(const float* logits, const RouterOptions& router,
                         const RoutingApproximation& approx, Routing* routing);

}  // namespace moeinfer::moe
