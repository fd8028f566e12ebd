// The MoE layer as one unit (../shared/DESIGN.md, "The MoE block"), on the CPU: the block owns
// route and plan and delegates the two things that vary to strategies,
//   route -> plan -> dispatcher.dispatch -> runner.run -> dispatcher.combine,
// a TokenDispatcher (where the rows go: here, on this process; the all-to-all of expert
// parallelism later) and an ExpertRunner (where the experts live: resident here; a cache over
// host memory with offloading). The stage hand-offs are the typed structs below.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "moe/routing_approx.h"
#include "moe/stages.h"

namespace moeinfer::moe {

// One layer's router as the checkpoint holds it (inputs, not options).
struct LayerRouter {
  TensorView weight;                      // [E, H]; empty for a dense layer
  const float* selection_bias = nullptr;  // [E] or null
  const float* logit_bias = nullptr;      // [E] added to the logits (GPT-OSS), or null
};

struct MoeBlockOptions {
  RouterOptions router;      // selection_bias is per layer: see MoeBlock::forward
  int64_t hidden_size = 0;   // H
  int64_t expert_width = 0;  // I
  // Where the routing weights apply: to each expert's output, or to the token before the expert
  // (Llama 4). The dispatcher scales the rows it sends; combine then sums unweighted.
  WeightPlacement weights = WeightPlacement::kOutput;
  // Routing approximations applied in the route stage (off by default; routing_approx.h).
  RoutingApproximation approx;
};

// route + plan: what the strategies read.
struct RoutedTokens {
  const float* hidden = nullptr;  // [T, H]
  int64_t num_tokens = 0;         // T
  const Routing* routing = nullptr;
  const DispatchPlan* plan = nullptr;
  WeightPlacement weights = WeightPlacement::kOutput;  // MoeBlockOptions::weights
};

// What the experts stage reads: rows in expert order, the e-th expert owning rows
// [expert_offsets[e], expert_offsets[e + 1]). The e-th expert is expert_ids[e] when expert_ids
// is given (a placement table's slots: any experts, in the rank's order), else first_expert + e.
struct ExpertRows {
  const float* rows = nullptr;  // [expert_offsets.back(), H]
  std::span<const int32_t> expert_offsets;
  int64_t first_expert = 0;
  std::span<const int32_t> expert_ids;

  int64_t num_experts() const { return static_cast<int64_t>(expert_offsets.size()) - 1; }
  int64_t expert(int64_t e) const {
    return expert_ids.empty() ? first_expert + e : expert_ids[static_cast<size_t>(e)];
  }
};

// Work the block runs while a dispatch's rows are in flight (the shared experts).
using InFlightWork = std::function<void()>;

// Where the rows go and how the outputs come back.
class TokenDispatcher {
 public:
  virtual ~TokenDispatcher() = default;
  // Moves the rows to their experts. `while_in_flight` (may be empty) runs once, while the rows
  // travel where the transport is non-blocking, else before the rows are returned.
  virtual ExpertRows dispatch(int64_t layer, const RoutedTokens& tokens,
                              const InFlightWork& while_in_flight) = 0;
  // out[T, H] = shared[t] (when given) + sum_k weight[t, k] * expert_out[row of (t, k)].
  virtual void combine(int64_t layer, const float* expert_out, const RoutedTokens& tokens,
                       const float* shared, float* out) = 0;

  // dispatch and combine in halves, for a schedule that computes something else while the bytes
  // travel (two micro-batches: MoeBlock::start, run_experts, finish). start_* returns once the
  // exchange is started, finish_* waits for it; the buffers belong to the dispatcher until then.
  // By default nothing travels: the whole stage runs in the finishing half.
  virtual void start_dispatch(int64_t /*layer*/, const RoutedTokens& /*tokens*/) {}
  virtual ExpertRows finish_dispatch(int64_t layer, const RoutedTokens& tokens) {
    return dispatch(layer, tokens, {});
  }
  virtual void start_combine(int64_t /*layer*/, const float* /*expert_out*/,
                             const RoutedTokens& /*tokens*/) {}
  virtual void finish_combine(int64_t layer, const float* expert_out, const RoutedTokens& tokens,
                              const float* shared, float* out) {
    combine(layer, expert_out, tokens, shared, out);
  }
};

// Where the experts live and how they run.
class ExpertRunner {
 public:
  virtual ~ExpertRunner() = default;
  // The layer's routing, before dispatch: where a cache starts its copies.
  virtual void on_routed(int64_t /*layer*/, const RoutedTokens& /*tokens*/) {}
  // out[r] = expert(rows[r]) for every row, in the order of `rows`.
  virtual void run(int64_t layer, const ExpertRows& rows, float* out) = 0;
};

// Every row stays in this process: dispatch copies each token's hidden row to its K expert-order
// rows, combine is the weighted sum back (unpermute).
class LocalDispatcher final : public TokenDispatcher {
 public:
  explicit LocalDispatcher(int64_t hidden_size) : hidden_size_(hidden_size) {}
  ExpertRows dispatch(int64_t layer, const RoutedTokens& tokens,
                      const InFlightWork& while_in_flight) override;
  void combine(int64_t layer, const float* expert_out, const RoutedTokens& tokens,
               const float* shared, float* out) override;

 private:
  int64_t hidden_size_;
  std::vector<float> rows_;  // [T*K, H]
};

// Every expert of every layer resident in the checkpoint's memory.
class ResidentExperts final : public ExpertRunner {
 public:
  // experts[l]: layer l's experts (empty for a dense layer); the views must outlive this.
  ResidentExperts(std::vector<std::span<const ExpertWeights>> experts, int64_t hidden_size,
                  int64_t expert_width, ExpertActivation activation = {});
  void run(int64_t layer, const ExpertRows& rows, float* out) override;

 private:
  std::vector<std::span<const ExpertWeights>> experts_;
  int64_t hidden_size_, expert_width_;
  ExpertActivation activation_;
  std::vector<ExpertWeights> views_;  // the experts of rows given by expert_ids
};

// Called between route and plan with the router logits [T, E]; it may change the routing, as a
// test does that replays another device's choices (moe::route_weights gives their weights).
using RouteAdjust =
    std::function<void(const float* logits, const RouterOptions& options, Routing& routing)>;

// The shared experts' output [T, H] for combine, computed when the block asks (null: none).
using SharedExpertsFn = std::function<const float*()>;

// When the shared experts run: before dispatch, or while the dispatch's rows are in flight
// (--overlap on: expert parallelism hides the transfer behind them).
enum class SharedSchedule { kBeforeDispatch, kWhileDispatching };

class MoeBlock {
 public:
  MoeBlock(MoeBlockOptions options, std::unique_ptr<TokenDispatcher> dispatcher,
           std::unique_ptr<ExpertRunner> runner);

  // out[T, H] = sum over each token's K experts of weight * expert(hidden) (+ shared[T, H]),
  // routed by `router` ([E, H]) with the layer's selection bias ([E] or null).
  void forward(int64_t layer, const float* hidden, int64_t num_tokens, const TensorView& router,
               const float* selection_bias, const float* shared, float* out,
               const RouteAdjust& adjust = {});
  // The same with the shared experts computed by the block, at `schedule`.
  void forward(int64_t layer, const float* hidden, int64_t num_tokens, const TensorView& router,
               const float* selection_bias, const SharedExpertsFn& shared_experts,
               SharedSchedule schedule, float* out, const RouteAdjust& adjust = {});
  // The same with the whole router (its logit bias too).
  void forward(int64_t layer, const float* hidden, int64_t num_tokens, const LayerRouter& router,
               const SharedExpertsFn& shared_experts, SharedSchedule schedule, float* out,
               const RouteAdjust& adjust = {});

  // forward in three phases, so that two micro-batches, each with a block of its own, can
  // interleave: while one's rows or outputs travel, the other computes. In order, per layer:
  //   start        route, plan and start the dispatch (the shared experts first at
  //                kBeforeDispatch);
  //   run_experts  the shared experts at kWhileDispatching, then wait for the rows, run the
  //                experts and start the combine;
  //   finish       wait for the outputs and unpermute into out[T, H].
  // `hidden` and what `shared_experts` reads must stay unchanged until finish returns. The
  // collectives are those of forward, in the same order.
  void start(int64_t layer, const float* hidden, int64_t num_tokens, const LayerRouter& router,
             const SharedExpertsFn& shared_experts, SharedSchedule schedule,
             const RouteAdjust& adjust = {});
  void run_experts();
  void finish(float* out);

  // Replaces the routing approximations from the next forward on (checked against the router).
  void set_approximation(const RoutingApproximation& approx);

  // The last forward's routing and plan.
  const Routing& routing() const { return routing_; }
  const DispatchPlan& plan() const { return plan_; }

 private:
  MoeBlockOptions options_;
  std::unique_ptr<TokenDispatcher> dispatcher_;
  std::unique_ptr<ExpertRunner> runner_;
  // Reused across calls so that a decode step allocates nothing once warm.
  std::vector<float> logits_;      // [T, E]
  std::vector<float> expert_out_;  // [T*K, H]
  Routing routing_;
  DispatchPlan plan_;

  // route + plan of forward and start (the logits stay in logits_).
  RoutedTokens route_and_plan(int64_t layer, const float* hidden, int64_t num_tokens,
                              const LayerRouter& router, const RouteAdjust& adjust);
  // Between start and finish: the layer in flight and what its later phases need.
  struct InFlightLayer {
    int64_t layer = -1;  // -1: none
    RoutedTokens tokens;
    SharedExpertsFn shared_experts;
    SharedSchedule schedule = SharedSchedule::kBeforeDispatch;
    const float* shared = nullptr;  // [T, H] once computed
  };
  InFlightLayer in_flight_;
};

// A block with the local dispatcher and resident experts over one layer's experts, at layer 0
// (tests and benchmarks of a single layer).
MoeBlock single_layer_block(const MoeBlockOptions& options, const RoutedExperts& weights);

}  // namespace moeinfer::moe
