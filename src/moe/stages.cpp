#include "moe/stages.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "backend/cpu/gemm.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace moeinfer::moe {

void validate(const RouterOptions& o) {
  MOE_CHECK(o.num_experts >= 1, "router needs at least one expert, got ", o.num_experts);
  MOE_CHECK(o.top_k >= 1 && o.top_k <= o.num_experts, "top_k ", o.top_k,
            " must be in [1, num_experts=", o.num_experts, "]");
  if (o.group_score == GroupScore::kNone) return;
  MOE_CHECK(o.num_groups >= 1 && o.num_experts % o.num_groups == 0, "n_group ", o.num_groups,
            " must divide the ", o.num_experts, " experts");
  MOE_CHECK(o.topk_groups >= 1 && o.topk_groups <= o.num_groups, "topk_group ", o.topk_groups,
            " must be in [1, n_group=", o.num_groups, "]");
  MOE_CHECK(o.topk_groups * (o.num_experts / o.num_groups) >= o.top_k, "topk_group ",
            o.topk_groups, " groups of ", o.num_experts / o.num_groups,
            " experts cannot supply top_k=", o.top_k, " experts");
  MOE_CHECK(o.group_score != GroupScore::kTop2Sum || o.num_experts / o.num_groups >= 2,
            "top-2 group scores need at least 2 experts per group");
}

namespace {

// Higher score first; equal scores keep the lower index first.
struct ByScoreDesc {
  const float* scores;
  bool operator()(int32_t a, int32_t b) const {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  }
};

// Marks experts outside the best topk_groups groups as ineligible (-inf in `choice`).
void mask_groups(const RouterOptions& o, float* choice, std::vector<float>& group_scores,
                 std::vector<int32_t>& group_order) {
  const int64_t per_group = o.num_experts / o.num_groups;
  group_scores.resize(o.num_groups);
  for (int64_t g = 0; g < o.num_groups; ++g) {
    const float* s = choice + g * per_group;
    if (o.group_score == GroupScore::kMax) {
      group_scores[g] = *std::max_element(s, s + per_group);
    } else {
      float best = -INFINITY, second = -INFINITY;
      for (int64_t i = 0; i < per_group; ++i) {
        if (s[i] > best) {
          second = best;
          best = s[i];
        } else if (s[i] > second) {
          second = s[i];
        }
      }
      group_scores[g] = best + second;
    }
  }
  group_order.resize(o.num_groups);
  std::iota(group_order.begin(), group_order.end(), 0);
  std::partial_sort(group_order.begin(), group_order.begin() + o.topk_groups, group_order.end(),
                    ByScoreDesc{group_scores.data()});
  std::vector<bool> kept(o.num_groups, false);
  for (int64_t i = 0; i < o.topk_groups; ++i) kept[group_order[i]] = true;
  for (int64_t e = 0; e < o.num_experts; ++e) {
    if (!kept[e / per_group]) choice[e] = -INFINITY;
  }
}

// scores[E] of one token's logits: softmax, sigmoid, or (kTopkSoftmax) the logits themselves,
// which pick_weights softmaxes over the picks.
void expert_scores(const float* row, int64_t E, ScoreFunction score, float* scores) {
  switch (score) {
    case ScoreFunction::kSoftmax: {
      const float max_logit = *std::max_element(row, row + E);
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) sum += scores[e] = std::exp(row[e] - max_logit);
      for (int64_t e = 0; e < E; ++e) scores[e] /= sum;
      return;
    }
    case ScoreFunction::kSigmoid:
      for (int64_t e = 0; e < E; ++e) scores[e] = 1.0f / (1.0f + std::exp(-row[e]));
      return;
    case ScoreFunction::kTopkSoftmax:
      std::copy_n(row, E, scores);
      return;
  }
}

// The K weights of the picked experts: their scores, renormalised (summed in pick order) and
// scaled as the options say; under kTopkSoftmax the softmax of their logits, scaled.
void pick_weights(const float* scores, const int32_t* ids, int64_t K, const RouterOptions& options,
                  float* weights) {
  if (options.score == ScoreFunction::kTopkSoftmax) {
    float max_logit = -INFINITY;
    for (int64_t k = 0; k < K; ++k) max_logit = std::max(max_logit, scores[ids[k]]);
    float sum = 0.0f;
    for (int64_t k = 0; k < K; ++k) sum += weights[k] = std::exp(scores[ids[k]] - max_logit);
    for (int64_t k = 0; k < K; ++k) weights[k] = weights[k] / sum * options.routed_scaling_factor;
    return;
  }
  float picked_sum = 0.0f;
  for (int64_t k = 0; k < K; ++k) picked_sum += scores[ids[k]];
  const float scale =
      (options.renormalize ? 1.0f / (picked_sum + 1e-20f) : 1.0f) * options.routed_scaling_factor;
  for (int64_t k = 0; k < K; ++k) weights[k] = scores[ids[k]] * scale;
}

}  // namespace

void route(const float* logits, int64_t num_tokens, const RouterOptions& options, Routing* out) {
  validate(options);
  const int64_t E = options.num_experts;
  const int64_t K = options.top_k;
  out->num_tokens = num_tokens;
  out->top_k = K;
  out->topk_ids.resize(num_tokens * K);
  out->topk_weights.resize(num_tokens * K);
  const bool by_logits = options.score == ScoreFunction::kSigmoid &&
                         options.selection_bias == nullptr &&
                         options.group_score == GroupScore::kNone;
  parallel_for(num_tokens, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(E), choice(E), group_scores;
    std::vector<int32_t> order(E), group_order;
    for (int64_t t = begin; t < end; ++t) {
      expert_scores(logits + t * E, E, options.score, scores.data());
      // A plain sigmoid router chooses by the logits (the same order), because float sigmoid
      // saturates at 1 past a logit of about 17, where the logits still tell experts apart.
      const float* basis = by_logits ? logits + t * E : scores.data();
      for (int64_t e = 0; e < E; ++e) {
        choice[e] = basis[e] + (options.selection_bias ? options.selection_bias[e] : 0.0f);
      }
      if (options.group_score != GroupScore::kNone) {
        mask_groups(options, choice.data(), group_scores, group_order);
      }
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + K, order.end(), ByScoreDesc{choice.data()});
      for (int64_t k = 0; k < K; ++k) out->topk_ids[t * K + k] = order[k];
      pick_weights(scores.data(), &out->topk_ids[t * K], K, options, &out->topk_weights[t * K]);
    }
  }, 16);
}

void expert_preference(const float* logits, int64_t num_tokens, const RouterOptions& options,
                       std::vector<int32_t>* order) {
  validate(options);
  const int64_t E = options.num_experts;
  order->resize(num_tokens * E);
  const bool by_logits = options.score == ScoreFunction::kSigmoid &&
                         options.selection_bias == nullptr &&
                         options.group_score == GroupScore::kNone;
  std::vector<float> scores(E), choice(E), group_scores;
  std::vector<int32_t> group_order;
  for (int64_t t = 0; t < num_tokens; ++t) {
    // The same choice basis as route(), so that its top-K are this order's first K.
    expert_scores(logits + t * E, E, options.score, scores.data());
    const float* basis = by_logits ? logits + t * E : scores.data();
    for (int64_t e = 0; e < E; ++e) {
      choice[e] = basis[e] + (options.selection_bias ? options.selection_bias[e] : 0.0f);
    }
    if (options.group_score != GroupScore::kNone) {
      mask_groups(options, choice.data(), group_scores, group_order);
    }
    int32_t* row = order->data() + t * E;
    std::iota(row, row + E, 0);
    std::stable_sort(row, row + E, ByScoreDesc{choice.data()});
    if (options.group_score == GroupScore::kNone) continue;
    for (int64_t i = 0; i < E; ++i) {
      if (choice[row[i]] == -INFINITY) row[i] = kNoExpert;  // outside the kept groups
    }
  }
}

void route_weights(const float* logits, const RouterOptions& options, Routing* routing) {
  validate(options);
  const int64_t E = options.num_experts, K = options.top_k;
  MOE_CHECK(routing->top_k == K && static_cast<int64_t>(routing->topk_ids.size()) ==
                                       routing->num_tokens * K,
            "routing of ", routing->num_tokens, " tokens x ", routing->top_k,
            " does not match top_k = ", K);
  routing->topk_weights.resize(routing->topk_ids.size());
  std::vector<float> scores(E);
  for (int64_t t = 0; t < routing->num_tokens; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = routing->topk_ids[t * K + k];
      MOE_CHECK(e >= 0 && e < E, "expert id ", e, " out of range [0, ", E, ")");
    }
    expert_scores(logits + t * E, E, options.score, scores.data());
    pick_weights(scores.data(), &routing->topk_ids[t * K], K, options,
                 &routing->topk_weights[t * K]);
  }
}

void plan(const Routing& routing, int64_t num_experts, DispatchPlan* out) {
  const int64_t num_assignments = routing.num_tokens * routing.top_k;
  out->expert_counts.assign(num_experts, 0);
  out->expert_offsets.assign(num_experts + 1, 0);
  out->inverse.resize(num_assignments);
  int64_t num_rows = 0;
  for (int64_t a = 0; a < num_assignments; ++a) {
    const int32_t expert = routing.topk_ids[a];
    if (expert == kNoExpert) continue;
    MOE_CHECK(expert >= 0 && expert < num_experts, "expert id ", expert, " out of range [0, ",
              num_experts, ")");
    ++out->expert_counts[expert];
    ++num_rows;
  }
  out->src_row.resize(num_rows);
  for (int64_t e = 0; e < num_experts; ++e) {
    out->expert_offsets[e + 1] = out->expert_offsets[e] + out->expert_counts[e];
  }
  std::vector<int32_t> cursor(out->expert_offsets.begin(), out->expert_offsets.end() - 1);
  for (int64_t a = 0; a < num_assignments; ++a) {
    if (routing.topk_ids[a] == kNoExpert) {
      out->inverse[a] = -1;
      continue;
    }
    const int32_t row = cursor[routing.topk_ids[a]]++;
    out->src_row[row] = static_cast<int32_t>(a);
    out->inverse[a] = row;
  }
}

void dispatch(const float* hidden, int64_t hidden_size, const Routing& routing,
              const DispatchPlan& plan, float* rows, WeightPlacement placement) {
  const int64_t num_rows = static_cast<int64_t>(plan.src_row.size());
  parallel_for(num_rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t token = plan.src_row[r] / routing.top_k;
      const float* src = hidden + token * hidden_size;
      float* dst = rows + r * hidden_size;
      switch (placement) {
        case WeightPlacement::kOutput:
          std::copy_n(src, hidden_size, dst);
          break;
        case WeightPlacement::kInput: {
          const float weight = routing.topk_weights[plan.src_row[r]];
          for (int64_t h = 0; h < hidden_size; ++h) dst[h] = src[h] * weight;
          break;
        }
      }
    }
  }, 64);
}

namespace {

// A bias view as the products take it: float32 [n], or null when the expert has none.
const float* bias_data(const TensorView& bias, int64_t n) {
  if (bias.empty()) return nullptr;
  MOE_CHECK(bias.dtype == DType::kF32 && bias.numel() == n, "an expert bias must be float32 [", n,
            "], found ", dtype_name(bias.dtype), " of ", bias.numel(), " values");
  return static_cast<const float*>(bias.data);
}

}  // namespace

void run_experts(const float* rows, int64_t hidden_size, int64_t expert_width,
                 std::span<const int32_t> expert_offsets, std::span<const ExpertWeights> experts,
                 float* out, const ExpertActivation& activation) {
  const int64_t num_experts = static_cast<int64_t>(experts.size());
  MOE_CHECK(static_cast<int64_t>(expert_offsets.size()) == num_experts + 1, "the rows hold ",
            static_cast<int64_t>(expert_offsets.size()) - 1, " experts but ", num_experts,
            " weight sets were given");
  const int64_t num_rows = expert_offsets[num_experts];
  std::vector<float> gate(num_rows * expert_width);  // [T*K, I] in plan order
  std::vector<float> up(num_rows * expert_width);    // [T*K, I]
  // Every expert's products run in one grouped call: the workers stream all selected experts'
  // weights with no barrier between experts, and empty experts cost nothing.
  std::vector<cpu::LinearProblem> problems;
  problems.reserve(2 * num_experts);
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t first = expert_offsets[e];
    const int64_t n = expert_offsets[e + 1] - first;
    if (n == 0) continue;
    const float* x = rows + first * hidden_size;
    problems.push_back({.x = x,
                        .num_rows = n,
                        .weight = experts[e].gate,
                        .bias = bias_data(experts[e].gate_bias, expert_width),
                        .y = gate.data() + first * expert_width});
    problems.push_back({.x = x,
                        .num_rows = n,
                        .weight = experts[e].up,
                        .bias = bias_data(experts[e].up_bias, expert_width),
                        .y = up.data() + first * expert_width});
  }
  cpu::linear_grouped(problems);
  switch (activation.kind) {
    case ActivationKind::kSiluGlu:
      parallel_for(
          num_rows * expert_width,
          [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) {
              const float g = gate[i];
              gate[i] = g / (1.0f + std::exp(-g)) * up[i];
            }
          },
          4096);
      break;
    case ActivationKind::kClampedSwiglu: {
      const float alpha = activation.alpha, limit = activation.limit;
      parallel_for(
          num_rows * expert_width,
          [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) {
              const float g = std::min(gate[i], limit);
              const float u = std::clamp(up[i], -limit, limit);
              gate[i] = (u + 1.0f) * (g / (1.0f + std::exp(-alpha * g)));
            }
          },
          4096);
      break;
    }
  }
  problems.clear();
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t first = expert_offsets[e];
    const int64_t n = expert_offsets[e + 1] - first;
    if (n == 0) continue;
    problems.push_back({.x = gate.data() + first * expert_width,
                        .num_rows = n,
                        .weight = experts[e].down,
                        .bias = bias_data(experts[e].down_bias, hidden_size),
                        .y = out + first * hidden_size});
  }
  cpu::linear_grouped(problems);
}

void unpermute(const float* expert_out, int64_t hidden_size, const Routing& routing,
               const DispatchPlan& plan, const float* shared, float* out,
               WeightPlacement placement) {
  const int64_t K = routing.top_k;
  const bool weighted = placement == WeightPlacement::kOutput;
  parallel_for(routing.num_tokens, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* dst = out + t * hidden_size;
      if (shared) {
        std::copy_n(shared + t * hidden_size, hidden_size, dst);
      } else {
        std::fill_n(dst, hidden_size, 0.0f);
      }
      for (int64_t k = 0; k < K; ++k) {
        const int32_t row = plan.inverse[t * K + k];
        if (row < 0) continue;  // dropped by a routing approximation
        const float weight = weighted ? routing.topk_weights[t * K + k] : 1.0f;
        const float* src = expert_out + static_cast<int64_t>(row) * hidden_size;
        for (int64_t h = 0; h < hidden_size; ++h) dst[h] += weight * src[h];
      }
    }
  }, 4);
}

}  // namespace moeinfer::moe
