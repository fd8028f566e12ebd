#include "moe/moe_block.h"

#include "backend/cpu/gemm.h"
#include "core/error.h"
#include "profile/profiler.h"

namespace moeinfer::moe {

ExpertRows LocalDispatcher::dispatch(int64_t /*layer*/, const RoutedTokens& tokens,
                                     const InFlightWork& while_in_flight) {
  const DispatchPlan& plan = *tokens.plan;
  rows_.resize(plan.src_row.size() * static_cast<size_t>(hidden_size_));
  moe::dispatch(tokens.hidden, hidden_size_, *tokens.routing, plan, rows_.data(), tokens.weights);
  if (while_in_flight) while_in_flight();  // nothing travels: it runs after the copy
  return {.rows = rows_.data(), .expert_offsets = plan.expert_offsets, .first_expert = 0};
}

void LocalDispatcher::combine(int64_t /*layer*/, const float* expert_out,
                              const RoutedTokens& tokens, const float* shared, float* out) {
  {
    // Nothing crosses a wire: the outputs are already in this process, in plan order.
    MOE_PROFILE_SCOPE(profile::Stage::kCombine);
  }
  MOE_PROFILE_SCOPE(profile::Stage::kUnpermute);
  unpermute(expert_out, hidden_size_, *tokens.routing, *tokens.plan, shared, out, tokens.weights);
}

ResidentExperts::ResidentExperts(std::vector<std::span<const ExpertWeights>> experts,
                                 int64_t hidden_size, int64_t expert_width,
                                 ExpertActivation activation)
    : experts_(std::move(experts)),
      hidden_size_(hidden_size),
      expert_width_(expert_width),
      activation_(activation) {}

void ResidentExperts::run(int64_t layer, const ExpertRows& rows, float* out) {
  MOE_CHECK(layer >= 0 && layer < static_cast<int64_t>(experts_.size()), "layer ", layer,
            " outside the ", experts_.size(), " layers of resident experts");
  const std::span<const ExpertWeights> all = experts_[layer];
  const int64_t count = rows.num_experts();
  const int64_t num_experts = static_cast<int64_t>(all.size());
  MOE_CHECK(count >= 0, "expert rows without offsets");
  if (rows.expert_ids.empty()) {
    MOE_CHECK(rows.first_expert >= 0 && rows.first_expert + count <= num_experts, "experts [",
              rows.first_expert, ", ", rows.first_expert + count, ") outside layer ", layer,
              "'s ", num_experts);
    run_experts(rows.rows, hidden_size_, expert_width_, rows.expert_offsets,
                all.subspan(static_cast<size_t>(rows.first_expert), static_cast<size_t>(count)),
                out, activation_);
    return;
  }
  MOE_CHECK(static_cast<int64_t>(rows.expert_ids.size()) == count, rows.expert_ids.size(),
            " expert ids for ", count, " experts' rows");
  views_.resize(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const int64_t e = rows.expert(i);
    MOE_CHECK(e >= 0 && e < num_experts, "expert ", e, " outside layer ", layer, "'s ",
              num_experts);
    views_[i] = all[static_cast<size_t>(e)];
  }
  run_experts(rows.rows, hidden_size_, expert_width_, rows.expert_offsets, views_, out,
              activation_);
}

MoeBlock::MoeBlock(MoeBlockOptions options, std::unique_ptr<TokenDispatcher> dispatcher,
                   std::unique_ptr<ExpertRunner> runner)
    : options_(options), dispatcher_(std::move(dispatcher)), runner_(std::move(runner)) {
  MOE_CHECK(dispatcher_ && runner_, "an MoE block needs a dispatcher and an expert runner");
  validate(options_.router);
  validate(options_.approx, options_.router);
}

void MoeBlock::set_approximation(const RoutingApproximation& approx) {
  validate(approx, options_.router);
  options_.approx = approx;
}

void MoeBlock::forward(int64_t layer, const float* hidden, int64_t num_tokens,
                       const TensorView& router, const float* selection_bias,
                       const float* shared, float* out, const RouteAdjust& adjust) {
  forward(layer, hidden, num_tokens, router, selection_bias, [shared] { return shared; },
          SharedSchedule::kBeforeDispatch, out, adjust);
}

void MoeBlock::forward(int64_t layer, const float* hidden, int64_t num_tokens,
                       const TensorView& router, const float* selection_bias,
                       const SharedExpertsFn& shared_experts, SharedSchedule schedule, float* out,
                       const RouteAdjust& adjust) {
  forward(layer, hidden, num_tokens,
          LayerRouter{.weight = router, .selection_bias = selection_bias}, shared_experts, schedule,
          out, adjust);
}

void MoeBlock::forward(int64_t layer, const float* hidden, int64_t num_tokens,
                       const LayerRouter& router, const SharedExpertsFn& shared_experts,
                       SharedSchedule schedule, float* out, const RouteAdjust& adjust) {
  const int64_t H = options_.hidden_size;
  const RoutedTokens tokens = route_and_plan(layer, hidden, num_tokens, router, adjust);
  runner_->on_routed(layer, tokens);
  const float* shared = nullptr;
  if (schedule == SharedSchedule::kBeforeDispatch) shared = shared_experts();
  // The dispatch stage's time leaves out the shared experts it waits beside (timed as theirs).
  int64_t in_flight_ns = 0;
  InFlightWork while_in_flight;
  if (schedule == SharedSchedule::kWhileDispatching) {
    while_in_flight = [&] {
      const int64_t start = profile::Profiler::now_ns();
      shared = shared_experts();
      in_flight_ns = profile::Profiler::now_ns() - start;
    };
  }
  profile::Profiler* profiler = profile::active();
  const bool timed = profiler != nullptr && profiler->timing();
  const int64_t dispatch_start = timed ? profile::Profiler::now_ns() : 0;
  const ExpertRows rows = dispatcher_->dispatch(layer, tokens, while_in_flight);
  if (timed) {
    profiler->add_time(profile::Stage::kDispatch,
                       profile::Profiler::now_ns() - dispatch_start - in_flight_ns);
  }
  const int64_t M = rows.expert_offsets.empty() ? 0 : rows.expert_offsets.back();
  expert_out_.resize(M * H);
  {
    MOE_PROFILE_SCOPE(profile::Stage::kExperts);
    runner_->run(layer, rows, expert_out_.data());
  }
  dispatcher_->combine(layer, expert_out_.data(), tokens, shared, out);
}

RoutedTokens MoeBlock::route_and_plan(int64_t layer, const float* hidden, int64_t num_tokens,
                                      const LayerRouter& router, const RouteAdjust& adjust) {
  const int64_t E = options_.router.num_experts;
  const int64_t H = options_.hidden_size;
  MOE_CHECK(
      router.weight.shape.rank() == 2 && router.weight.shape[0] == E && router.weight.shape[1] == H,
      "layer ", layer, "'s router is not [", E, ", ", H, "]");
  RouterOptions router_options = options_.router;
  router_options.selection_bias = router.selection_bias;
  {
    MOE_PROFILE_SCOPE(profile::Stage::kRoute);
    logits_.resize(num_tokens * E);
    cpu::linear(hidden, num_tokens, router.weight, router.logit_bias, logits_.data());
    apply_temperature(options_.approx, logits_.data(), num_tokens * E);
    route(logits_.data(), num_tokens, router_options, &routing_);
    approximate_routing(logits_.data(), router_options, options_.approx, &routing_);
    if (adjust) adjust(logits_.data(), router_options, routing_);
  }
  {
    MOE_PROFILE_SCOPE(profile::Stage::kPlan);
    moe::plan(routing_, E, &plan_);
  }
  return {.hidden = hidden,
          .num_tokens = num_tokens,
          .routing = &routing_,
          .plan = &plan_,
          .weights = options_.weights};
}

void MoeBlock::start(int64_t layer, const float* hidden, int64_t num_tokens,
                     const LayerRouter& router, const SharedExpertsFn& shared_experts,
                     SharedSchedule schedule, const RouteAdjust& adjust) {
  MOE_CHECK(in_flight_.layer < 0, "layer ", layer, " started while layer ", in_flight_.layer,
            " is in flight in the same MoE block");
  const RoutedTokens tokens = route_and_plan(layer, hidden, num_tokens, router, adjust);
  runner_->on_routed(layer, tokens);
  in_flight_ = InFlightLayer{
      .layer = layer, .tokens = tokens, .shared_experts = shared_experts, .schedule = schedule};
  if (schedule == SharedSchedule::kBeforeDispatch) in_flight_.shared = shared_experts();
  MOE_PROFILE_SCOPE(profile::Stage::kDispatch);
  dispatcher_->start_dispatch(layer, tokens);
}

void MoeBlock::run_experts() {
  InFlightLayer& f = in_flight_;
  MOE_CHECK(f.layer >= 0, "run_experts without a started layer");
  // The shared experts run while the rows travel (timed as theirs, not as the dispatch's).
  if (f.schedule == SharedSchedule::kWhileDispatching) f.shared = f.shared_experts();
  ExpertRows rows;
  {
    MOE_PROFILE_SCOPE(profile::Stage::kDispatch);
    rows = dispatcher_->finish_dispatch(f.layer, f.tokens);
  }
  const int64_t M = rows.expert_offsets.empty() ? 0 : rows.expert_offsets.back();
  expert_out_.resize(M * options_.hidden_size);
  {
    MOE_PROFILE_SCOPE(profile::Stage::kExperts);
    runner_->run(f.layer, rows, expert_out_.data());
  }
  dispatcher_->start_combine(f.layer, expert_out_.data(), f.tokens);
}

void MoeBlock::finish(float* out) {
  InFlightLayer& f = in_flight_;
  MOE_CHECK(f.layer >= 0, "finish without a started layer");
  dispatcher_->finish_combine(f.layer, expert_out_.data(), f.tokens, f.shared, out);
  f = InFlightLayer{};
}

MoeBlock single_layer_block(const MoeBlockOptions& options, const RoutedExperts& weights) {
  return MoeBlock(options, std::make_unique<LocalDispatcher>(options.hidden_size),
                  std::make_unique<ResidentExperts>(
                      std::vector<std::span<const ExpertWeights>>{weights.experts},
                      options.hidden_size, options.expert_width));
}

}  // namespace moeinfer::moe
