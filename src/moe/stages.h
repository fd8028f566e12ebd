// The six stages of an MoE layer (route, plan, dispatch, experts, combine, unpermute) as CPU
// reference implementations with typed hand-offs. Each stage is one function; under expert
// parallelism or offloading a stage is swapped without touching the others.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/tensor.h"

namespace moeinfer::moe {

enum class ScoreFunction {
  kSoftmax,
  kSigmoid,
  // GPT-OSS: the K experts of the highest logits, weighted by a softmax over those K logits
  // (renormalisation changes nothing: the weights already sum to 1).
  kTopkSoftmax,
};

// Group-limited routing (DeepSeek): experts are split into num_groups equal groups, each group
// gets a score, only the best topk_groups groups stay eligible.
enum class GroupScore {
  kNone,     // no grouping
  kMax,      // DeepSeek-V2 group_limited_greedy: the group's best expert score
  kTop2Sum,  // DeepSeek-V3 noaux_tc: the sum of the group's two best (bias-corrected) scores
};

struct RouterOptions {
  int64_t num_experts = 0;  // E
  int64_t top_k = 0;        // K
  ScoreFunction score = ScoreFunction::kSoftmax;
  bool renormalize = false;          // divide the K weights by their sum
  float routed_scaling_factor = 1.0f;
  GroupScore group_score = GroupScore::kNone;
  int64_t num_groups = 1;
  int64_t topk_groups = 1;
  // [E] score-correction bias (DeepSeek-V3 e_score_correction_bias), or null. It is added to
  // the scores used to choose experts and groups; the weights come from the unbiased scores.
  const float* selection_bias = nullptr;
};

// Checks the options' invariants (top_k <= E, groups divide E, enough experts in the kept
// groups); throws moeinfer::Error naming the bad value.
void validate(const RouterOptions& options);

// Where a token's routing weights apply.
enum class WeightPlacement {
  kOutput,  // out[t] = sum_k w[t, k] * expert_k(x[t])
  kInput,   // out[t] = sum_k expert_k(w[t, k] * x[t]) (Llama 4)
};

// An assignment a routing approximation dropped (moe/routing_approx.h): its slot in topk_ids
// holds this id and a weight of 0; plan gives it no row, so no expert computes it.
inline constexpr int32_t kNoExpert = -1;

struct Routing {
  int64_t num_tokens = 0;  // T
  int64_t top_k = 0;       // K
  std::vector<int32_t> topk_ids;     // [T, K] expert ids, best first (kNoExpert: dropped)
  std::vector<float> topk_weights;   // [T, K]
};

struct DispatchPlan {
  std::vector<int32_t> expert_counts;   // [E] assignments per expert
  std::vector<int32_t> expert_offsets;  // [E + 1] start of each expert's rows in sorted order
  std::vector<int32_t> src_row;         // [M] assignment (t*K + k) held at each sorted row
  std::vector<int32_t> inverse;         // [T*K] sorted row of assignment t*K + k, or -1 (dropped)
};

// The weights of one expert: act(x . gate^T + gate_bias, x . up^T + up_bias), then . down^T +
// down_bias, act as ExpertActivation says.
struct ExpertWeights {
  TensorView gate;  // [I, H]
  TensorView up;    // [I, H]
  TensorView down;  // [H, I]
  // Optional float32 biases (GPT-OSS): [I], [I], [H]; empty views where the model has none.
  TensorView gate_bias, up_bias, down_bias;
};

// How an expert joins its gate and up projections.
enum class ActivationKind {
  kSiluGlu,        // SiLU(gate) * up
  kClampedSwiglu,  // GPT-OSS: g = min(gate, limit), u = clamp(up, -limit, limit),
                   // (u + 1) * g * sigmoid(alpha * g)
};
struct ExpertActivation {
  ActivationKind kind = ActivationKind::kSiluGlu;
  float alpha = 1.702f;  // kClampedSwiglu
  float limit = 7.0f;    // kClampedSwiglu
};

// Bytes of one expert's three matrices as stored (the unit of the expert cache's budget and of
// the profiler's bytes of expert weights read). The biases, a few KB where a model has them, are
// left out: the cache's slots hold the matrices and the biases stay where they are.
inline int64_t expert_nbytes(const ExpertWeights& e) {
  return static_cast<int64_t>(e.gate.nbytes() + e.up.nbytes() + e.down.nbytes());
}

// One layer's routed experts as the checkpoint holds them.
struct RoutedExperts {
  TensorView router;                   // [E, H]
  std::vector<ExpertWeights> experts;  // [E]
};

// route: router logits [T, E] -> top-k experts and weights. Ties go to the lower expert id.
void route(const float* logits, int64_t num_tokens, const RouterOptions& options, Routing* out);

// The weights route() gives the experts already in routing->topk_ids (chosen elsewhere: another
// device's router replayed on this one), from the same logits [T, E] and options.
void route_weights(const float* logits, const RouterOptions& options, Routing* routing);

// Every token's eligible experts in route()'s order of choice (selection bias and groups
// applied, ties to the lower id): order [T, E], best first, the experts of groups route() would
// not consider at the end as kNoExpert. What a rerouted assignment picks from.
void expert_preference(const float* logits, int64_t num_tokens, const RouterOptions& options,
                       std::vector<int32_t>* order);

// plan: counting sort of the T*K assignments by expert id (stable in assignment order); dropped
// assignments (kNoExpert) get no row, so M = T*K less the dropped.
void plan(const Routing& routing, int64_t num_experts, DispatchPlan* out);

// dispatch: hidden [T, H] -> expert-ordered rows [T*K, H]; with WeightPlacement::kInput each row
// is its token's hidden state times the assignment's weight.
void dispatch(const float* hidden, int64_t hidden_size, const Routing& routing,
              const DispatchPlan& plan, float* rows,
              WeightPlacement placement = WeightPlacement::kOutput);

// experts: expert-ordered rows [M, H] -> expert outputs [M, H], one grouped pass; expert e
// (experts[e]) owns rows [expert_offsets[e], expert_offsets[e + 1]), M = expert_offsets.back().
void run_experts(const float* rows, int64_t hidden_size, int64_t expert_width,
                 std::span<const int32_t> expert_offsets, std::span<const ExpertWeights> experts,
                 float* out, const ExpertActivation& activation = {});

// combine: brings expert outputs back to their source (TokenDispatcher::combine, moe_block.h);
// on one device the outputs already sit in this process in plan order and unpermute follows.

// unpermute: out[t] = sum_k weight[t,k] * expert_out[inverse[t*K+k]] (+ shared[t]), over the
// assignments that have a row; with
// WeightPlacement::kInput the weights were applied by dispatch and the outputs sum unweighted.
void unpermute(const float* expert_out, int64_t hidden_size, const Routing& routing,
               const DispatchPlan& plan, const float* shared, float* out,
               WeightPlacement placement = WeightPlacement::kOutput);

}  // namespace moeinfer::moe
