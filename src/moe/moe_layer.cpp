#include "moe/moe_layer.h"

#include "backend/cpu/gemm.h"
#include "core/error.h"
#include "profile/profiler.h"

namespace moeinfer::moe {

void moe_layer_forward(const float* hidden, int64_t num_tokens, const RoutedExperts& weights,
                       const MoeLayerOptions& options, const float* shared, float* out,
                       MoeWorkspace* ws, const RouteAdjust& adjust) {
  const int64_t E = options.router.num_experts;
  const int64_t K = options.router.top_k;
  const int64_t H = options.hidden_size;
  MOE_CHECK(static_cast<int64_t>(weights.experts.size()) == E, "MoE layer has ",
            weights.experts.size(), " experts, options say ", E);
  ws->logits.resize(num_tokens * E);
  ws->rows.resize(num_tokens * K * H);
  ws->expert_out.resize(num_tokens * K * H);

  {
    MOE_PROFILE_SCOPE(profile::Stage::kRoute);
    cpu::linear(hidden, num_tokens, weights.router, nullptr, ws->logits.data());
    route(ws->logits.data(), num_tokens, options.router, &ws->routing);
    if (adjust) adjust(ws->logits.data(), options.router, ws->routing);
  }
  {
    MOE_PROFILE_SCOPE(profile::Stage::kPlan);
    plan(ws->routing, E, &ws->plan);
  }
  {
    MOE_PROFILE_SCOPE(profile::Stage::kDispatch);
    dispatch(hidden, H, ws->routing, ws->plan, ws->rows.data());
  }
  {
    MOE_PROFILE_SCOPE(profile::Stage::kExperts);
    run_experts(ws->rows.data(), H, options.expert_width, ws->plan, weights.experts,
                ws->expert_out.data());
  }
  const float* combined = nullptr;
  {
    MOE_PROFILE_SCOPE(profile::Stage::kCombine);
    combined = combine(ws->expert_out.data());
  }
  MOE_PROFILE_SCOPE(profile::Stage::kUnpermute);
  unpermute(combined, H, ws->routing, ws->plan, shared, out);
}

}  // namespace moeinfer::moe
