// The CPU reference stages on hand-checkable inputs, and the whole MoE layer against a direct
// per-token loop over each token's experts.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/cpu/gemm.h"
#include "moe/moe_block.h"
#include "moe/stages.h"

namespace moeinfer::moe {
namespace {

TEST(Route, SoftmaxTopKPicksHighestAndRenormalises) {
  // One token, 4 experts: logits ln(1), ln(2), ln(3), ln(4) -> probabilities 0.1 .. 0.4.
  const float logits[4] = {0.0f, std::log(2.0f), std::log(3.0f), std::log(4.0f)};
  Routing r;
  route(logits, 1, {.num_experts = 4, .top_k = 2}, &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{3, 2}));
  EXPECT_NEAR(r.topk_weights[0], 0.4f, 1e-6);
  EXPECT_NEAR(r.topk_weights[1], 0.3f, 1e-6);
  route(logits, 1, {.num_experts = 4, .top_k = 2, .renormalize = true}, &r);
  EXPECT_NEAR(r.topk_weights[0], 0.4f / 0.7f, 1e-6);
  EXPECT_NEAR(r.topk_weights[1], 0.3f / 0.7f, 1e-6);
}

TEST(Route, TiesGoToTheLowerExpertId) {
  const float logits[6] = {1.0f, 5.0f, 5.0f, 0.0f, 5.0f, 2.0f};
  Routing r;
  route(logits, 1, {.num_experts = 6, .top_k = 2}, &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{1, 2}));
  route(logits, 1, {.num_experts = 6, .top_k = 3}, &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{1, 2, 4}));
}

TEST(Route, SigmoidScoresAndScalingFactor) {
  const float logits[3] = {0.0f, 2.0f, -1.0f};
  Routing r;
  route(logits, 1,
        {.num_experts = 3, .top_k = 1, .score = ScoreFunction::kSigmoid,
         .routed_scaling_factor = 2.5f},
        &r);
  EXPECT_EQ(r.topk_ids[0], 1);
  EXPECT_NEAR(r.topk_weights[0], 2.5f / (1.0f + std::exp(-2.0f)), 1e-6);
}

TEST(Route, WeightsOfExpertsChosenElsewhereAreRoutesOwn) {
  // Experts 0 and 2 (not route's choice, 3 and 2): their sigmoid scores, renormalised, scaled.
  const float logits[4] = {0.5f, -1.0f, 1.0f, 2.0f};
  const RouterOptions options{.num_experts = 4, .top_k = 2, .score = ScoreFunction::kSigmoid,
                              .renormalize = true, .routed_scaling_factor = 2.5f};
  Routing r;
  route(logits, 1, options, &r);
  const std::vector<float> chosen_by_route = r.topk_weights;
  route_weights(logits, options, &r);
  EXPECT_EQ(r.topk_weights, chosen_by_route);
  r.topk_ids = {0, 2};
  route_weights(logits, options, &r);
  const float s0 = 1.0f / (1.0f + std::exp(-0.5f)), s2 = 1.0f / (1.0f + std::exp(-1.0f));
  EXPECT_NEAR(r.topk_weights[0], 2.5f * s0 / (s0 + s2), 1e-6);
  EXPECT_NEAR(r.topk_weights[1], 2.5f * s2 / (s0 + s2), 1e-6);
  r.topk_ids = {0, 4};
  EXPECT_THROW(route_weights(logits, options, &r), Error);
}

TEST(Route, RejectsTopKLargerThanExperts) {
  const float logits[2] = {0.0f, 1.0f};
  Routing r;
  EXPECT_THROW(route(logits, 1, {.num_experts = 2, .top_k = 3}, &r), Error);
}

TEST(Route, GroupLimitedGreedyKeepsBestGroupsByMaxScore) {
  // DeepSeek-V2 group_limited_greedy: 8 experts in 4 groups of 2, keep 2 groups, top-2.
  // Without groups the top-3 would be experts 7, 0, 5. Group maxima: g0 = 3 (e0), g1 = 2 (e2),
  // g2 = 2.5 (e5), g3 = 4 (e7); groups 3 and 0 are kept, so expert 5 is excluded and expert 1
  // takes its place.
  const float logits[8] = {3.0f, 2.0f, 2.0f, 0.0f, 1.0f, 2.5f, 0.0f, 4.0f};
  Routing r;
  const RouterOptions options{.num_experts = 8, .top_k = 3, .group_score = GroupScore::kMax,
                              .num_groups = 4, .topk_groups = 2};
  route(logits, 1, options, &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{7, 0, 1}));
  // Weights are the softmax over all 8 experts, not renormalised.
  float denom = 0.0f;
  for (float l : logits) denom += std::exp(l);
  EXPECT_NEAR(r.topk_weights[0], std::exp(4.0f) / denom, 1e-6);
  EXPECT_NEAR(r.topk_weights[2], std::exp(2.0f) / denom, 1e-6);
}

TEST(Route, NoauxTcGroupWinsOnBiasAloneButWeightsIgnoreBias) {
  // DeepSeek-V3 noaux_tc: sigmoid scores, bias added for choosing only. 4 experts in 2 groups.
  // Without bias group 0 (experts 0, 1) wins; a bias of +1 on experts 2 and 3 flips the choice
  // to group 1, and the weights are still their unbiased sigmoid scores.
  const float logits[4] = {1.0f, 0.5f, 0.0f, -0.5f};
  const float bias[4] = {0.0f, 0.0f, 1.0f, 1.0f};
  const auto sigmoid = [](float x) { return 1.0f / (1.0f + std::exp(-x)); };
  RouterOptions options{.num_experts = 4, .top_k = 2, .score = ScoreFunction::kSigmoid,
                        .group_score = GroupScore::kTop2Sum, .num_groups = 2, .topk_groups = 1};
  Routing r;
  route(logits, 1, options, &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{0, 1}));
  options.selection_bias = bias;
  options.renormalize = true;
  options.routed_scaling_factor = 2.5f;
  route(logits, 1, options, &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{2, 3}));
  const float s2 = sigmoid(0.0f), s3 = sigmoid(-0.5f);
  EXPECT_NEAR(r.topk_weights[0], 2.5f * s2 / (s2 + s3), 1e-6);
  EXPECT_NEAR(r.topk_weights[1], 2.5f * s3 / (s2 + s3), 1e-6);
}

TEST(Route, GroupTiesGoToTheLowerGroup) {
  // Two groups with equal top-2 sums: the lower group is kept.
  const float logits[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  Routing r;
  route(logits, 1,
        {.num_experts = 4, .top_k = 2, .score = ScoreFunction::kSigmoid,
         .group_score = GroupScore::kTop2Sum, .num_groups = 2, .topk_groups = 1},
        &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{0, 1}));
}

TEST(Route, RejectsGroupsThatCannotSupplyTopK) {
  const float logits[8] = {};
  Routing r;
  EXPECT_THROW(route(logits, 1,
                     {.num_experts = 8, .top_k = 4, .group_score = GroupScore::kMax,
                      .num_groups = 4, .topk_groups = 1},
                     &r),
               Error);
  EXPECT_THROW(route(logits, 1,
                     {.num_experts = 8, .top_k = 2, .group_score = GroupScore::kMax,
                      .num_groups = 3, .topk_groups = 1},
                     &r),
               Error);
}

TEST(Plan, CountingSortIsStableAndInverts) {
  // 3 tokens, top-2, 4 experts; expert 2 gets nothing.
  Routing r{.num_tokens = 3, .top_k = 2, .topk_ids = {3, 0, 0, 1, 3, 0}, .topk_weights = {}};
  DispatchPlan p;
  plan(r, 4, &p);
  EXPECT_EQ(p.expert_counts, (std::vector<int32_t>{3, 1, 0, 2}));
  EXPECT_EQ(p.expert_offsets, (std::vector<int32_t>{0, 3, 4, 4, 6}));
  // Expert 0 holds assignments 1, 2, 5 in that order; expert 1 holds 3; expert 3 holds 0, 4.
  EXPECT_EQ(p.src_row, (std::vector<int32_t>{1, 2, 5, 3, 0, 4}));
  for (int a = 0; a < 6; ++a) EXPECT_EQ(p.src_row[p.inverse[a]], a);
}

TEST(Plan, RejectsOutOfRangeExpert) {
  Routing r{.num_tokens = 1, .top_k = 1, .topk_ids = {7}, .topk_weights = {1.0f}};
  DispatchPlan p;
  EXPECT_THROW(plan(r, 4, &p), Error);
}

// The whole layer against a direct loop: for each token, for each of its experts, run the
// expert on that token alone and add weight * output.
TEST(MoeLayer, MatchesPerTokenLoopAtAwkwardSizes) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal(0.0f, 0.5f);
  const int64_t H = 24, I = 10, E = 7, K = 3;
  std::vector<std::vector<float>> storage;
  const auto random_view = [&](int64_t rows, int64_t cols) {
    storage.emplace_back(rows * cols);
    for (float& v : storage.back()) v = normal(rng);
    return TensorView{.dtype = DType::kF32, .shape = {rows, cols}, .data = storage.back().data()};
  };
  RoutedExperts weights;
  weights.router = random_view(E, H);
  for (int64_t e = 0; e < E; ++e) {
    weights.experts.push_back({.gate = random_view(I, H), .up = random_view(I, H),
                               .down = random_view(H, I)});
  }
  const MoeBlockOptions options{.router = {.num_experts = E, .top_k = K, .renormalize = true},
                                .hidden_size = H, .expert_width = I};
  for (int64_t T : {1, 2, 19}) {
    std::vector<float> hidden(T * H);
    for (float& v : hidden) v = normal(rng);
    std::vector<float> out(T * H, NAN);
    MoeBlock block = single_layer_block(options, weights);
    block.forward(0, hidden.data(), T, weights.router, nullptr, nullptr, out.data());

    std::vector<float> logits(T * E);
    cpu::linear(hidden.data(), T, weights.router, nullptr, logits.data());
    Routing routing;
    route(logits.data(), T, options.router, &routing);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> expected(H, 0.0);
      for (int64_t k = 0; k < K; ++k) {
        const ExpertWeights& ex = weights.experts[routing.topk_ids[t * K + k]];
        std::vector<float> g(I), u(I), d(H);
        cpu::linear(hidden.data() + t * H, 1, ex.gate, nullptr, g.data());
        cpu::linear(hidden.data() + t * H, 1, ex.up, nullptr, u.data());
        for (int64_t i = 0; i < I; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
        cpu::linear(g.data(), 1, ex.down, nullptr, d.data());
        for (int64_t h = 0; h < H; ++h) expected[h] += routing.topk_weights[t * K + k] * d[h];
      }
      for (int64_t h = 0; h < H; ++h) {
        ASSERT_NEAR(out[t * H + h], expected[h], 1e-4 * (1.0 + std::fabs(expected[h])))
            << "T=" << T << " t=" << t << " h=" << h;
      }
    }
  }
}

}  // namespace
}  // namespace moeinfer::moe
