// The routing approximations (moe/routing_approx.h) on hand-built routings: exact ids and
// weights for each rule, capacity with drop and reroute (ties, a full expert, a token left with
// nothing), plan and unpermute over dropped assignments, and the refusals naming their flags.
#include "moe/routing_approx.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>

#include "core/error.h"
#include "moe/moe_block.h"

namespace moeinfer::moe {
namespace {

constexpr int32_t kX = kNoExpert;

Routing hand_routing(int64_t T, int64_t K, std::vector<int32_t> ids, std::vector<float> weights) {
  return Routing{.num_tokens = T, .top_k = K, .topk_ids = ids, .topk_weights = weights};
}

void expect_weights(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-6f) << "slot " << i;
}

const RouterOptions kTop3of5{.num_experts = 5, .top_k = 3, .renormalize = true};

TEST(ActiveExperts, FullKeepsTheTopKWeights) {
  Routing r = hand_routing(1, 3, {4, 1, 2}, {0.5f, 0.3f, 0.2f});
  approximate_routing(nullptr, kTop3of5, {.active_experts = 2, .renorm = KeptRenorm::kFull}, &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{4, 1, kX}));
  expect_weights(r.topk_weights, {0.5f, 0.3f, 0.0f});
}

TEST(ActiveExperts, KeptScalesToWhatTheKSummedTo) {
  Routing r = hand_routing(1, 3, {4, 1, 2}, {0.5f, 0.3f, 0.2f});
  approximate_routing(nullptr, kTop3of5, {.active_experts = 2, .renorm = KeptRenorm::kKept}, &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{4, 1, kX}));
  expect_weights(r.topk_weights, {0.625f, 0.375f, 0.0f});
  // DeepSeek-V3: the K sum to routed_scaling_factor (2.5), and so do the kept.
  r = hand_routing(1, 3, {4, 1, 2}, {1.25f, 0.75f, 0.5f});
  approximate_routing(nullptr, kTop3of5, {.active_experts = 2}, &r);
  expect_weights(r.topk_weights, {1.5625f, 0.9375f, 0.0f});
  // A family that does not renormalise (OLMoE): the kept take the K's sum, 0.6.
  r = hand_routing(1, 3, {0, 3, 1}, {0.3f, 0.2f, 0.1f});
  approximate_routing(nullptr, kTop3of5, {.active_experts = 1}, &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{0, kX, kX}));
  expect_weights(r.topk_weights, {0.6f, 0.0f, 0.0f});
}

TEST(ActiveExperts, KeepsByWeightNotByChoiceOrderAndTiesKeepChoiceOrder) {
  // With a selection bias the choice order differs from the weights' (DeepSeek-V3).
  Routing r = hand_routing(1, 3, {4, 1, 2}, {0.2f, 0.5f, 0.3f});
  approximate_routing(nullptr, kTop3of5, {.active_experts = 1, .renorm = KeptRenorm::kFull}, &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{kX, 1, kX}));
  expect_weights(r.topk_weights, {0.0f, 0.5f, 0.0f});
  r = hand_routing(1, 3, {3, 0, 2}, {0.4f, 0.4f, 0.2f});
  approximate_routing(nullptr, kTop3of5, {.active_experts = 1, .renorm = KeptRenorm::kFull}, &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{3, kX, kX}));
}

TEST(ActiveExperts, KEqualToTheModelsKChangesNothing) {
  Routing r = hand_routing(2, 3, {4, 1, 2, 0, 3, 1}, {0.5f, 0.3f, 0.2f, 0.6f, 0.3f, 0.1f});
  const Routing before = r;
  approximate_routing(nullptr, kTop3of5, {.active_experts = 3}, &r);
  EXPECT_EQ(r.topk_ids, before.topk_ids);
  EXPECT_EQ(r.topk_weights, before.topk_weights);
}

TEST(DropBelow, DropsSmallSharesAndRescales) {
  Routing r = hand_routing(1, 3, {4, 1, 2}, {0.5f, 0.3f, 0.2f});
  approximate_routing(nullptr, kTop3of5, {.drop_below = 0.25}, &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{4, 1, kX}));
  expect_weights(r.topk_weights, {0.625f, 0.375f, 0.0f});
  // Shares, not raw weights: scaled by 2.5 the same token drops the same expert.
  r = hand_routing(1, 3, {4, 1, 2}, {1.25f, 0.75f, 0.5f});
  approximate_routing(nullptr, kTop3of5, {.drop_below = 0.25}, &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{4, 1, kX}));
  expect_weights(r.topk_weights, {1.5625f, 0.9375f, 0.0f});
  // A share equal to W stays (strictly under is dropped).
  r = hand_routing(1, 3, {4, 1, 2}, {0.5f, 0.25f, 0.25f});
  approximate_routing(nullptr, kTop3of5, {.drop_below = 0.25}, &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{4, 1, 2}));
}

TEST(DropBelow, AlwaysKeepsTheLargestWeightFirstInChoiceOrderOnTies) {
  const RouterOptions top4{.num_experts = 8, .top_k = 4, .renormalize = true};
  Routing r = hand_routing(1, 4, {5, 2, 7, 0}, {0.25f, 0.25f, 0.25f, 0.25f});
  approximate_routing(nullptr, top4, {.drop_below = 0.5}, &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{5, kX, kX, kX}));
  expect_weights(r.topk_weights, {1.0f, 0.0f, 0.0f, 0.0f});
}

TEST(ExpertCapacity, DropsOverflowInTokenOrderAndRescales) {
  // T=3, K=2, E=3: mean 6/3 = 2 rows per expert, F=1: capacity 2. Expert 0 is full after
  // tokens 0 and 1, so token 2 loses it and keeps expert 1 at its whole weight.
  const RouterOptions top2of3{.num_experts = 3, .top_k = 2, .renormalize = true};
  Routing r = hand_routing(3, 2, {0, 1, 0, 2, 0, 1}, {0.6f, 0.4f, 0.6f, 0.4f, 0.6f, 0.4f});
  approximate_routing(nullptr, top2of3, {.expert_capacity = 1.0}, &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{0, 1, 0, 2, kX, 1}));
  expect_weights(r.topk_weights, {0.6f, 0.4f, 0.6f, 0.4f, 0.0f, 1.0f});

  DispatchPlan plan;
  moe::plan(r, 3, &plan);
  EXPECT_EQ(plan.expert_counts, (std::vector<int32_t>{2, 2, 1}));
  EXPECT_EQ(plan.src_row.size(), 5u);
  EXPECT_EQ(plan.inverse[4], -1);
}

TEST(ExpertCapacity, ATokenWithEveryExpertFullGetsNoRoutedOutput) {
  // T=2, K=2, E=4: mean 1, capacity 1; token 1 wants the experts token 0 filled.
  const RouterOptions top2of4{.num_experts = 4, .top_k = 2, .renormalize = true};
  Routing r = hand_routing(2, 2, {0, 1, 0, 1}, {0.7f, 0.3f, 0.7f, 0.3f});
  approximate_routing(nullptr, top2of4, {.expert_capacity = 1.0}, &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{0, 1, kX, kX}));
  expect_weights(r.topk_weights, {0.7f, 0.3f, 0.0f, 0.0f});

  // unpermute then gives token 1 only its shared output.
  DispatchPlan plan;
  moe::plan(r, 4, &plan);
  const std::vector<float> expert_out = {1.0f, 2.0f};  // [2 rows, H=1]: experts 0 and 1
  const std::vector<float> shared = {10.0f, 20.0f};
  std::vector<float> out(2, -1.0f);
  unpermute(expert_out.data(), 1, r, plan, shared.data(), out.data());
  EXPECT_FLOAT_EQ(out[0], 10.0f + 0.7f * 1.0f + 0.3f * 2.0f);
  EXPECT_FLOAT_EQ(out[1], 20.0f);
}

TEST(ExpertCapacity, CapacityIsTheCeilingOfFTimesTheMean) {
  // T=4, K=1, E=4: mean 1, F=1.5: capacity ceil(1.5) = 2; three tokens want expert 3.
  const RouterOptions top1of4{.num_experts = 4, .top_k = 1};
  Routing r = hand_routing(4, 1, {3, 3, 3, 1}, {1.0f, 1.0f, 1.0f, 1.0f});
  approximate_routing(nullptr, top1of4, {.expert_capacity = 1.5}, &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{3, 3, kX, 1}));
}

TEST(ExpertCapacity, RerouteGoesToTheNextBestExpertWithRoomTiesToTheLowerId) {
  // T=3, K=2, E=4: mean 1.5, capacity 2. Each token's logits [3, 2, 1, 1] pick {0, 1}; token 2
  // finds 0 full (tokens 0, 1) and goes to 2 (tied with 3, lower id), then finds 1 full and
  // goes to 3 (2 is its own now). Weights: the router's for the new expert beside the others,
  // w * exp(new logit - old logit).
  const RouterOptions top2of4{.num_experts = 4, .top_k = 2, .renormalize = true};
  const std::vector<float> logits = {3, 2, 1, 1, 3, 2, 1, 1, 3, 2, 1, 1};
  Routing r;
  route(logits.data(), 3, top2of4, &r);
  ASSERT_EQ(r.topk_ids, (std::vector<int32_t>{0, 1, 0, 1, 0, 1}));
  approximate_routing(logits.data(), top2of4,
                      {.expert_capacity = 1.0, .overflow = CapacityOverflow::kReroute}, &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{0, 1, 0, 1, 2, 3}));
  const float z = std::exp(3.0f) + std::exp(2.0f);
  expect_weights(r.topk_weights, {std::exp(3.0f) / z, std::exp(2.0f) / z, std::exp(3.0f) / z,
                                  std::exp(2.0f) / z, std::exp(1.0f) / z, std::exp(1.0f) / z});
}

TEST(ExpertCapacity, RerouteStaysInTheKeptGroupsAndDropsWhenNoneHasRoom) {
  // Two groups of two experts, one kept (DeepSeek-V2 group_limited_greedy). Both tokens keep
  // group 0 = {0, 1}; capacity 1 leaves token 1 nothing inside it, and experts 2 and 3 (empty,
  // but in the other group) are not candidates.
  const RouterOptions grouped{.num_experts = 4,
                              .top_k = 2,
                              .renormalize = true,
                              .group_score = GroupScore::kMax,
                              .num_groups = 2,
                              .topk_groups = 1};
  const std::vector<float> logits = {3, 2, 1, 0, 3, 2, 1, 0};
  Routing r;
  route(logits.data(), 2, grouped, &r);
  ASSERT_EQ(r.topk_ids, (std::vector<int32_t>{0, 1, 0, 1}));
  approximate_routing(logits.data(), grouped,
                      {.expert_capacity = 1.0, .overflow = CapacityOverflow::kReroute}, &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{0, 1, kX, kX}));
  expect_weights({r.topk_weights[2], r.topk_weights[3]}, {0.0f, 0.0f});
}

TEST(ExpertPreference, MatchesRouteAndMasksGroups) {
  const RouterOptions grouped{.num_experts = 4,
                              .top_k = 2,
                              .group_score = GroupScore::kMax,
                              .num_groups = 2,
                              .topk_groups = 1};
  const std::vector<float> logits = {0, 1, 5, 5};
  std::vector<int32_t> order;
  expert_preference(logits.data(), 1, grouped, &order);
  EXPECT_EQ(order, (std::vector<int32_t>{2, 3, kX, kX}));
  expert_preference(logits.data(), 1, {.num_experts = 4, .top_k = 2}, &order);
  EXPECT_EQ(order, (std::vector<int32_t>{2, 3, 1, 0}));
}

TEST(RouterTemperature, DividesTheLogitsBeforeTheScore) {
  // ln 1, ln 4 at T = 2 become ln 1, ln 2: softmax 1/3, 2/3.
  std::vector<float> logits = {0.0f, std::log(4.0f)};
  apply_temperature({.router_temperature = 2.0}, logits.data(), 2);
  Routing r;
  route(logits.data(), 1, {.num_experts = 2, .top_k = 2}, &r);
  EXPECT_EQ(r.topk_ids, (std::vector<int32_t>{1, 0}));
  expect_weights(r.topk_weights, {2.0f / 3.0f, 1.0f / 3.0f});
}

void expect_refused(const RoutingApproximation& approx, const std::string& flag) {
  try {
    validate(approx, kTop3of5);
    FAIL() << "accepted " << flag;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(flag), std::string::npos) << e.what();
  }
}

TEST(RoutingApproximation, RefusesBadValuesNamingTheFlag) {
  expect_refused({.active_experts = 4}, "--active-experts 4");
  expect_refused({.active_experts = -1}, "--active-experts");
  expect_refused({.drop_below = 1.0}, "--drop-below");
  expect_refused({.drop_below = -0.1}, "--drop-below");
  expect_refused({.expert_capacity = 0.5}, "--expert-capacity");
  expect_refused({.router_temperature = 0.0}, "--router-temperature");
  expect_refused({.router_temperature = -2.0}, "--router-temperature");
  EXPECT_NO_THROW(
      validate({.active_experts = 3, .drop_below = 0.0, .expert_capacity = 1.0}, kTop3of5));
}

TEST(RoutingApproximation, RefusedOnCudaNamingTheFlag) {
  EXPECT_NO_THROW(check_routing_device({}, /*cuda=*/true));
  EXPECT_NO_THROW(check_routing_device({.active_experts = 1}, /*cuda=*/false));
  try {
    check_routing_device({.expert_capacity = 2.0}, /*cuda=*/true);
    FAIL() << "accepted on cuda";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--expert-capacity is not implemented on the CUDA"),
              std::string::npos)
        << e.what();
  }
}

// The block with K' = 1 kept on a renormalising top-2 router computes what a top-1 renormalised
// router computes (weight 1 on the best expert), from half the rows.
TEST(MoeBlockApproximation, OneKeptExpertOfTwoIsTheTop1Router) {
  const int64_t T = 19, H = 16, I = 8, E = 6;
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  std::vector<std::vector<float>> storage;
  const auto random_view = [&](int64_t rows, int64_t cols) {
    storage.emplace_back(rows * cols);
    for (float& v : storage.back()) v = normal(rng);
    return TensorView{.dtype = DType::kF32, .shape = {rows, cols}, .data = storage.back().data()};
  };
  RoutedExperts weights;
  weights.router = random_view(E, H);
  for (int64_t e = 0; e < E; ++e) {
    weights.experts.push_back(
        {.gate = random_view(I, H), .up = random_view(I, H), .down = random_view(H, I)});
  }
  std::vector<float> hidden(T * H);
  for (float& v : hidden) v = normal(rng);
  MoeBlock top2 = single_layer_block({.router = {.num_experts = E, .top_k = 2, .renormalize = true},
                                      .hidden_size = H,
                                      .expert_width = I,
                                      .approx = {.active_experts = 1, .renorm = KeptRenorm::kKept}},
                                     weights);
  MoeBlock top1 = single_layer_block({.router = {.num_experts = E, .top_k = 1, .renormalize = true},
                                      .hidden_size = H,
                                      .expert_width = I},
                                     weights);
  std::vector<float> out2(T * H, NAN), out1(T * H, NAN);
  top2.forward(0, hidden.data(), T, weights.router, nullptr, nullptr, out2.data());
  top1.forward(0, hidden.data(), T, weights.router, nullptr, nullptr, out1.data());
  EXPECT_EQ(top2.plan().src_row.size(), static_cast<size_t>(T));
  for (int64_t i = 0; i < T * H; ++i) EXPECT_NEAR(out2[i], out1[i], 1e-5f) << i;
}

}  // namespace
}  // namespace moeinfer::moe
