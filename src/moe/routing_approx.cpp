#include "moe/routing_approx.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "backend/routing_rules.h"
#include "core/error.h"

namespace moeinfer::moe {

bool RoutingApproximation::enabled() const { return drops() || router_temperature != 1.0; }

std::vector<std::string> RoutingApproximation::flags() const {
  std::vector<std::string> on;
  if (active_experts != 0) on.push_back("--active-experts");
  if (drop_below != 0.0) on.push_back("--drop-below");
  if (expert_capacity != 0.0) on.push_back("--expert-capacity");
  if (router_temperature != 1.0) on.push_back("--router-temperature");
  return on;
}

void validate(const RoutingApproximation& a, const RouterOptions& router) {
  MOE_CHECK(a.active_experts >= 0, "--active-experts ", a.active_experts, " must be at least 1");
  MOE_CHECK(a.active_experts <= router.top_k, "--active-experts ", a.active_experts,
            " exceeds the model's ", router.top_k,
            " experts per token (num_experts_per_tok): it can only keep fewer");
  MOE_CHECK(a.drop_below >= 0.0 && a.drop_below < 1.0, "--drop-below ", a.drop_below,
            " must be in [0, 1): a share of the token's routed weight");
  MOE_CHECK(a.expert_capacity == 0.0 || a.expert_capacity >= 1.0, "--expert-capacity ",
            a.expert_capacity,
            " must be at least 1 (a multiple of the mean rows per expert; below 1 the experts "
            "could not hold every row even when the load is perfectly even)");
  MOE_CHECK(std::isfinite(a.expert_capacity), "--expert-capacity must be a finite number");
  MOE_CHECK(a.router_temperature > 0.0 && std::isfinite(a.router_temperature),
            "--router-temperature ", a.router_temperature, " must be a number above 0");
}

void check_routing_device(const RoutingApproximation& approx, bool cuda) {
  if (!cuda || approx.expert_capacity == 0.0) return;
  MOE_FAIL("--expert-capacity is not implemented on the CUDA backend yet (it counts every "
           "expert's rows across the step's tokens in token order): run it with --device cpu");
}

void apply_temperature(const RoutingApproximation& approx, float* logits, int64_t n) {
  if (approx.router_temperature == 1.0) return;
  const float inverse = static_cast<float>(1.0 / approx.router_temperature);
  for (int64_t i = 0; i < n; ++i) logits[i] *= inverse;
}

namespace {

// One token's assignments under the shared rules (backend/routing_rules.h).
routing_rules::Token token_of(Routing* routing, int64_t t) {
  const int64_t K = routing->top_k;
  return {.ids = routing->topk_ids.data() + t * K,
          .weights = routing->topk_weights.data() + t * K,
          .k = K,
          .dropped = kNoExpert};
}

// score(to) / score(from) for two logits of one token: route() weighs every expert of a token
// as its score times one factor (the renormalisation, the scaling factor), so this ratio turns
// an expert's weight into the weight the router gives another. Softmax and GPT-OSS's softmax
// over the top-k logits share the exponential; sigmoid does not.
float score_ratio(ScoreFunction score, float to, float from) {
  switch (score) {
    case ScoreFunction::kSoftmax:
    case ScoreFunction::kTopkSoftmax:
      return std::exp(to - from);
    case ScoreFunction::kSigmoid:
      return (1.0f + std::exp(-from)) / (1.0f + std::exp(-to));
  }
  return 1.0f;
}

void limit_capacity(const float* logits, const RouterOptions& router, const RoutingApproximation& a,
                    Routing* routing) {
  const int64_t T = routing->num_tokens, K = routing->top_k, E = router.num_experts;
  int64_t live = 0;
  for (int32_t e : routing->topk_ids) live += e != kNoExpert;
  // ceil(F * M / E); the small slack keeps an exact product (1.25 * 8) from rounding up.
  const double mean = static_cast<double>(live) / static_cast<double>(E);
  const int64_t capacity =
      std::max<int64_t>(1, static_cast<int64_t>(std::ceil(a.expert_capacity * mean - 1e-9)));
  std::vector<int32_t> preference;
  if (a.overflow == CapacityOverflow::kReroute) expert_preference(logits, T, router, &preference);
  std::vector<int64_t> rows(E, 0);
  for (int64_t t = 0; t < T; ++t) {
    const routing_rules::Token token = token_of(routing, t);
    int32_t* ids = token.ids;
    float* weights = token.weights;
    const float before = token.live_sum();
    bool dropped = false;
    for (int64_t k = 0; k < K; ++k) {
      if (ids[k] == kNoExpert) continue;
      if (rows[ids[k]] < capacity) {
        ++rows[ids[k]];
        continue;
      }
      int32_t moved_to = kNoExpert;
      if (a.overflow == CapacityOverflow::kReroute) {
        const int32_t* order = preference.data() + t * E;
        for (int64_t i = 0; i < E && order[i] != kNoExpert; ++i) {
          const int32_t e = order[i];
          if (rows[e] < capacity && std::find(ids, ids + K, e) == ids + K) {
            moved_to = e;
            break;
          }
        }
      }
      if (moved_to != kNoExpert) {
        const float* row = logits + t * E;
        weights[k] *= score_ratio(router.score, row[moved_to], row[ids[k]]);
        ids[k] = moved_to;
        ++rows[moved_to];
      } else {
        token.drop(k);
        dropped = true;
      }
    }
    if (dropped) token.rescale(before);
  }
}

}  // namespace

void approximate_routing(const float* logits, const RouterOptions& router,
                         const RoutingApproximation& approx, Routing* routing) {
  if (!approx.drops()) return;  // the default: nothing per layer on the decode path
  const int64_t T = routing->num_tokens, K = routing->top_k;
  MOE_CHECK(static_cast<int64_t>(routing->topk_ids.size()) == T * K &&
                routing->topk_weights.size() == routing->topk_ids.size(),
            "routing of ", T, " tokens x ", K, " holds ", routing->topk_ids.size(), " ids and ",
            routing->topk_weights.size(), " weights");
  const bool fewer = approx.active_experts != 0 && approx.active_experts < K;
  if (fewer || approx.drop_below > 0.0) {
    std::vector<int64_t> slots(static_cast<size_t>(K));
    for (int64_t t = 0; t < T; ++t) {
      const routing_rules::Token token = token_of(routing, t);
      if (fewer) {
        token.keep_largest(approx.active_experts, approx.renorm == KeptRenorm::kKept,
                           slots.data());
      }
      if (approx.drop_below > 0.0) {
        token.drop_small(static_cast<float>(approx.drop_below), slots.data());
      }
    }
  }
  if (approx.expert_capacity > 0.0) limit_capacity(logits, router, approx, routing);
}

}  // namespace moeinfer::moe
