// The CUDA fused router's DeepSeek routing (backend/cuda/moe_stages.h: selection_bias,
// group_score, num_groups, topk_groups) against moe::route(), the CPU reference: fresh random
// logits and biases every run (the seed is printed on failure; MOE_TEST_SEED replays one),
// outputs poisoned with 0xFF bytes first (NaN weights, -1 ids) so an unwritten element fails.
//
// Cases: DeepSeek-V2-like (softmax, group max, no bias, scale 16), DeepSeek-V3-like (sigmoid,
// top-2 group sums, random bias, renormalised, scale 2.5), and shapes that stress the kernel's
// group step: groups that straddle lanes (E = 160 in 8 groups of 20), a group count that is not
// a power of two (E = 60 in 5), more than 32 groups (64 and 256), one group of all experts, kept
// groups that hold exactly K experts, and a bias without groups. Ties on purpose: all-equal
// logits, groups that are copies or permutations of each other (equal group scores go to the
// lower group), duplicated maxima (the top-2 sum counts a value twice), and a negative bias that
// makes every choice negative; and a -inf bias, where the last picks come from a dropped group
// as in the reference. One case runs captured in a CUDA graph.
//
// Tolerances: ids exact; weights 1e-5 relative (float32, CONVENTIONS.md). The GPU's expf and its
// reduction order differ from the CPU's by a few float32 units, so a token whose choice is
// decided by a margin that small could legitimately go either way. Before use, every token is
// checked in float64: each comparison route() makes (which experts count towards a group's
// score, kept against dropped groups, picked experts against each other and against the rest)
// must be between bit-identical inputs or a gap above 1e-5 relative; a token that fails is drawn
// again (a few in a hundred with random biases). The tie tests' constructed tokens are drawn the
// same way; most pass as they are.
//
// Shapes past the one-warp router (E > 1024 or K > 32: the block router, router_block_kernel.cuh)
// run the same checks at E in 1025, 1500, 4099 and 12000 to 24000 (past the shared-memory cache
// of choices and group scores), K in 1, 33, 40, 64 and K = E, plain, biased and grouped (kMax,
// kTop2Sum, groups of one and of two), softmax and sigmoid, with padding tokens, a logit bias,
// ties and a -inf bias. Their logits are drawn on a grid of 1/64 and their biases on a grid of
// 1/8: with thousands of experts and dozens of picks, continuous draws leave a near-tie in most
// tokens, while on the grids distinct inputs are far apart and equal ones tie exactly (the
// robustness check above still runs). Their weights are held to 1e-6 relative as well, against
// route()'s float32 operations with the softmax denominator summed in float64 and rounded once:
// route() adds the E terms one after another in float32, which is up to 3e-6 off at E = 4099,
// more than the kernels' own error, so only that one sum is taken exactly.
//
// The synthetic models' uniform router (RouterParams::noise_keys) runs on NaN logits, which it
// must not read, in the plain, general and block kernels: ids K distinct experts and the K
// largest noise values, weights as configured, a chi-square test of the per-expert counts, the
// experts neighbouring keys share, the same keys giving the same picks in any order, and padding
// tokens still getting the null expert.
//
// Host-side checks (the launcher refusing bad grouping arguments, naming the field) need no
// device and always run; the kernel tests are registered only when a device is present
// (cuda_test_util.h).
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iterator>
#include <numeric>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "backend/cuda/moe_stages.h"
#include "cuda_test_util.h"
#include "moe/stages.h"

namespace moeinfer::cuda {
namespace {

using namespace testing_util;

// ---------------------------------------------------------------------------------------------
// Host-side checks: always registered, need no device.

RouterParams grouped_params(int64_t E, int64_t K, RouterGroupScore group, int64_t num_groups,
                            int64_t topk_groups, int64_t T = 1) {
  static float logits = 0.0f;
  static int32_t ids = 0;
  static float weights = 0.0f;
  return RouterParams{.logits = &logits,
                      .topk_ids = &ids,
                      .topk_weights = &weights,
                      .num_tokens = T,
                      .num_experts = E,
                      .top_k = K,
                      .group_score = group,
                      .num_groups = num_groups,
                      .topk_groups = topk_groups};
}

TEST(CudaRouterChecks, RefusesBadGroups) {
  using G = RouterGroupScore;
  expect_error_naming([] { fused_router(grouped_params(64, 6, G::kMax, 7, 3), nullptr); },
                      "num_groups = 7");
  expect_error_naming([] { fused_router(grouped_params(64, 6, G::kMax, 0, 1), nullptr); },
                      "num_groups = 0");
  expect_error_naming([] { fused_router(grouped_params(64, 6, G::kTop2Sum, 128, 1), nullptr); },
                      "num_groups = 128");
  expect_error_naming([] { fused_router(grouped_params(64, 6, G::kMax, 8, 0), nullptr); },
                      "topk_groups = 0");
  expect_error_naming([] { fused_router(grouped_params(64, 6, G::kMax, 8, 9), nullptr); },
                      "topk_groups = 9");
  // One kept group of 8 experts cannot supply 9.
  expect_error_naming([] { fused_router(grouped_params(64, 9, G::kMax, 8, 1), nullptr); },
                      "top_k = 9");
  // The top-2 sum needs two experts per group; the group max does not.
  expect_error_naming([] { fused_router(grouped_params(64, 6, G::kTop2Sum, 64, 8), nullptr); },
                      "kTop2Sum");
  expect_error_naming([] { fused_router(grouped_params(64, 6, static_cast<G>(7), 8, 3), nullptr); },
                      "group_score = 7");
  // Refused before the empty-batch early return: the answer does not depend on T.
  expect_error_naming([] { fused_router(grouped_params(64, 6, G::kMax, 7, 3, 0), nullptr); },
                      "num_groups = 7");
  // Accepted without a device when there is nothing to do: exactly K experts in the kept
  // groups, one expert per group under the group max, and no grouping with unused group sizes
  // that would be invalid (as moe::validate ignores them).
  fused_router(grouped_params(64, 8, G::kMax, 8, 1, 0), nullptr);
  fused_router(grouped_params(64, 6, G::kMax, 64, 6, 0), nullptr);
  fused_router(grouped_params(64, 6, G::kNone, 7, 0, 0), nullptr);
}

TEST(CudaRouterChecks, TakesAnyExpertCountAndTopK) {
  using G = RouterGroupScore;
  // Past the one-warp router: accepted (no tokens, so nothing launches).
  fused_router(grouped_params(1025, 33, G::kNone, 1, 1, 0), nullptr);
  fused_router(grouped_params(48, 48, G::kTop2Sum, 6, 6, 0), nullptr);
  fused_router(grouped_params(4099, 64, G::kMax, 4099, 64, 0), nullptr);
  fused_router(grouped_params(kMaxExperts, 1, G::kNone, 1, 1, 0), nullptr);
  // The only bounds left: K in [1, E], E within int32 ids.
  expect_error_naming([] { fused_router(grouped_params(48, 49, G::kNone, 1, 1, 0), nullptr); },
                      "top_k = 49");
  expect_error_naming([] { fused_router(grouped_params(48, 0, G::kNone, 1, 1, 0), nullptr); },
                      "top_k = 0");
  expect_error_naming(
      [] { fused_router(grouped_params(kMaxExperts + 1, 8, G::kNone, 1, 1, 0), nullptr); },
      "num_experts = " + std::to_string(kMaxExperts + 1));
}

// ---------------------------------------------------------------------------------------------
// Kernel tests: registered only when a device is present.

struct RouterCase {
  const char* name;
  int64_t num_experts;  // E
  int64_t top_k;        // K
  moe::ScoreFunction score;
  moe::GroupScore group_score;
  int64_t num_groups;
  int64_t topk_groups;
  bool bias;  // random tests: draw a selection bias
  bool renormalize;
  float scaling;
};

using SF = moe::ScoreFunction;
using GS = moe::GroupScore;

const RouterCase kDeepSeekV2{"DeepSeekV2", 160,   6,    SF::kSoftmax, GS::kMax, 8, 3,
                             false,        false, 16.0f};
const RouterCase kDeepSeekV2Small{
    "DeepSeekV2_E64", 64, 6, SF::kSoftmax, GS::kMax, 8, 3, false, false, 1.0f};
const RouterCase kDeepSeekV3{"DeepSeekV3", 256,  8,   SF::kSigmoid, GS::kTop2Sum, 8, 4,
                             true,         true, 2.5f};
const RouterCase kShapes[] = {
    {"E60_G5_Top2Sum_Softmax", 60, 5, SF::kSoftmax, GS::kTop2Sum, 5, 2, true, true, 1.0f},
    {"E160_G8_Top2Sum_Sigmoid", 160, 6, SF::kSigmoid, GS::kTop2Sum, 8, 3, true, false, 1.0f},
    {"E256_G64_Max_K16", 256, 16, SF::kSoftmax, GS::kMax, 64, 7, true, true, 1.0f},
    {"E256_G256_Max_K16", 256, 16, SF::kSigmoid, GS::kMax, 256, 16, true, false, 3.0f},
    {"E96_G3_Top1Group", 96, 8, SF::kSoftmax, GS::kTop2Sum, 3, 1, false, false, 1.0f},
    {"E64_G8_ExactPool", 64, 8, SF::kSigmoid, GS::kMax, 8, 1, true, true, 1.0f},
    {"E32_G1", 32, 4, SF::kSigmoid, GS::kTop2Sum, 1, 1, true, true, 2.5f},
    {"E8_G4_Top2Sum", 8, 2, SF::kSigmoid, GS::kTop2Sum, 4, 2, true, true, 1.0f},
    {"E128_BiasOnly", 128, 8, SF::kSigmoid, GS::kNone, 1, 1, true, true, 2.5f},
    // Kimi K2's router (384 experts, one group, noaux_tc), Qwen3-Next's (512, top-10, plain
    // softmax) and the largest E the kernel takes, grouped.
    {"E384_G1_Top2Sum_Sigmoid", 384, 8, SF::kSigmoid, GS::kTop2Sum, 1, 1, true, true, 2.827f},
    {"E512_Softmax_K10", 512, 10, SF::kSoftmax, GS::kNone, 1, 1, false, true, 1.0f},
    {"E1024_G16_Max_K16", 1024, 16, SF::kSoftmax, GS::kMax, 16, 5, true, false, 1.0f},
    // Top-k past 16, up to a pick per lane.
    {"E64_Softmax_K32", 64, 32, SF::kSoftmax, GS::kNone, 1, 1, false, true, 1.0f},
    {"E96_G4_Top2Sum_K32", 96, 32, SF::kSigmoid, GS::kTop2Sum, 4, 2, true, true, 1.0f},
};

// Past the one-warp router. Every pair of E in {1025, 1500, 4099} and K in {1, 33, 40, 64}
// plain, with the score function and renormalisation alternating; a bias alone; grouped with
// both group scores, groups of one and of two, kept groups that hold exactly K experts, one group
// of all experts; K = E; and E past the shared-memory cache (choices alone, then group scores
// too, single experts and pairs per group). Selection biases go with sigmoid scores, as in
// DeepSeek-V3: beside softmax scores of 1e-4 a bias of 0.25 leaves most tokens with a decision
// the robustness check cannot vouch for.
const RouterCase kBlockShapes[] = {
    {"E1025_K1_Softmax", 1025, 1, SF::kSoftmax, GS::kNone, 1, 1, false, false, 1.0f},
    {"E1025_K33_Sigmoid", 1025, 33, SF::kSigmoid, GS::kNone, 1, 1, false, true, 2.5f},
    {"E1025_K40_Softmax", 1025, 40, SF::kSoftmax, GS::kNone, 1, 1, false, true, 1.0f},
    {"E1025_K64_Sigmoid", 1025, 64, SF::kSigmoid, GS::kNone, 1, 1, false, false, 16.0f},
    {"E1500_K1_Sigmoid", 1500, 1, SF::kSigmoid, GS::kNone, 1, 1, false, true, 1.0f},
    {"E1500_K33_Softmax", 1500, 33, SF::kSoftmax, GS::kNone, 1, 1, false, false, 1.0f},
    {"E1500_K40_Sigmoid", 1500, 40, SF::kSigmoid, GS::kNone, 1, 1, false, true, 2.5f},
    {"E1500_K64_Softmax", 1500, 64, SF::kSoftmax, GS::kNone, 1, 1, false, true, 1.0f},
    {"E4099_K1_Softmax", 4099, 1, SF::kSoftmax, GS::kNone, 1, 1, false, true, 1.0f},
    {"E4099_K33_Sigmoid", 4099, 33, SF::kSigmoid, GS::kNone, 1, 1, false, true, 1.0f},
    {"E4099_K40_Softmax", 4099, 40, SF::kSoftmax, GS::kNone, 1, 1, false, true, 2.5f},
    {"E4099_K64_Softmax", 4099, 64, SF::kSoftmax, GS::kNone, 1, 1, false, false, 1.0f},
    {"E1500_K40_BiasOnly_Sigmoid", 1500, 40, SF::kSigmoid, GS::kNone, 1, 1, true, true, 2.5f},
    {"E1025_G25_Max_K40", 1025, 40, SF::kSoftmax, GS::kMax, 25, 3, false, false, 16.0f},
    {"E1025_G5_Top2Sum_K64", 1025, 64, SF::kSigmoid, GS::kTop2Sum, 5, 2, true, true, 2.5f},
    {"E1500_G12_Top2Sum_K33", 1500, 33, SF::kSigmoid, GS::kTop2Sum, 12, 4, true, true, 2.5f},
    {"E1500_G1500_Max_K64", 1500, 64, SF::kSigmoid, GS::kMax, 1500, 100, true, true, 1.0f},
    {"E1500_G750_Top2Sum_K40", 1500, 40, SF::kSigmoid, GS::kTop2Sum, 750, 25, true, false, 1.0f},
    {"E4099_G1_Top2Sum_K64", 4099, 64, SF::kSigmoid, GS::kTop2Sum, 1, 1, true, true, 2.827f},
    {"E4099_G4099_Max_K33", 4099, 33, SF::kSoftmax, GS::kMax, 4099, 40, false, false, 1.0f},
    {"E64_G8_Max_K40_ExactPool", 64, 40, SF::kSigmoid, GS::kMax, 8, 5, true, true, 1.0f},
    {"E48_K48_Softmax", 48, 48, SF::kSoftmax, GS::kNone, 1, 1, false, true, 1.0f},
    {"E48_G6_Top2Sum_K48", 48, 48, SF::kSigmoid, GS::kTop2Sum, 6, 6, true, true, 2.5f},
};
const RouterCase kUncachedShapes[] = {
    {"E12000_K8_Softmax", 12000, 8, SF::kSoftmax, GS::kNone, 1, 1, false, true, 1.0f},
    {"E12000_G8_Top2Sum_K36", 12000, 36, SF::kSigmoid, GS::kTop2Sum, 8, 3, true, true, 2.5f},
    {"E12000_G12000_Max_K33", 12000, 33, SF::kSigmoid, GS::kMax, 12000, 40, true, false, 1.0f},
    {"E24000_G12000_Top2Sum_K33", 24000, 33, SF::kSigmoid, GS::kTop2Sum, 12000, 20, true, true,
     1.0f},
};

const RouterCase& block_case(std::string_view name) {
  for (const RouterCase& c : kBlockShapes)
    if (c.name == name) return c;
  for (const RouterCase& c : kUncachedShapes)
    if (c.name == name) return c;
  MOE_CHECK(false, "no block-router case ", name);
  return kBlockShapes[0];
}

// The shapes the block router takes (see the file comment for what changes with them).
bool block_shape(const RouterCase& c) {
  return c.num_experts > kRouterWarpMaxExperts || c.top_k > kRouterWarpMaxTopK;
}

RouterGroupScore to_cuda(GS group) {
  switch (group) {
    case GS::kMax:
      return RouterGroupScore::kMax;
    case GS::kTop2Sum:
      return RouterGroupScore::kTop2Sum;
    default:
      return RouterGroupScore::kNone;
  }
}

moe::RouterOptions options_of(const RouterCase& c, const float* bias) {
  return moe::RouterOptions{.num_experts = c.num_experts,
                            .top_k = c.top_k,
                            .score = c.score,
                            .renormalize = c.renormalize,
                            .routed_scaling_factor = c.scaling,
                            .group_score = c.group_score,
                            .num_groups = c.num_groups,
                            .topk_groups = c.topk_groups,
                            .selection_bias = bias};
}

// Higher value first; equal values keep the lower index first (route()'s order).
template <typename V>
std::vector<int64_t> order_desc(const std::vector<V>& values) {
  std::vector<int64_t> order(values.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return values[a] > values[b]; });
  return order;
}

// Within what float32 rounding in two implementations could flip (an exact tie included).
bool close(double a, double b) {
  return std::fabs(a - b) <= 1e-5 * (std::fabs(a) + std::fabs(b)) + 1e-6;
}

// route()'s decisions on one token, redone in float64: true when each comparison it makes is
// either far apart or between bit-identical inputs, which both implementations see as an exact
// tie. Close values from different inputs are fragile even when float64 finds them equal:
// sigmoid(1) + sigmoid(-1) and sigmoid(0.5) + sigmoid(-0.5) are both 1, but not in float32.
// An expert's input is its (logit, bias); a group score's is the multiset of its best one or
// two experts' inputs.
bool decisions_are_robust(const float* row, const float* bias, const RouterCase& c) {
  using Key = std::vector<std::pair<float, float>>;
  const int64_t E = c.num_experts;
  std::vector<double> choice(E);
  if (c.score == SF::kSoftmax) {
    const double max_logit = *std::max_element(row, row + E);
    double sum = 0.0;
    for (int64_t e = 0; e < E; ++e) sum += choice[e] = std::exp(row[e] - max_logit);
    for (int64_t e = 0; e < E; ++e) choice[e] /= sum;
  } else {
    for (int64_t e = 0; e < E; ++e) choice[e] = 1.0 / (1.0 + std::exp(-double{row[e]}));
  }
  std::vector<Key> key(E);
  for (int64_t e = 0; e < E; ++e) {
    const float b = bias != nullptr ? bias[e] : 0.0f;
    choice[e] += b;
    key[e] = {{row[e], b}};
  }
  const auto fragile = [](double a, double b, const Key& ka, const Key& kb) {
    return close(a, b) && ka != kb;
  };

  std::vector<bool> eligible(E, true);
  if (c.group_score != GS::kNone) {
    const int64_t per_group = E / c.num_groups;
    const int64_t counted = c.group_score == GS::kMax ? 1 : 2;
    std::vector<double> group_score(c.num_groups, 0.0);
    std::vector<Key> group_key(c.num_groups);
    for (int64_t g = 0; g < c.num_groups; ++g) {
      const std::vector<double> members(choice.begin() + g * per_group,
                                        choice.begin() + (g + 1) * per_group);
      const std::vector<int64_t> order = order_desc(members);
      for (int64_t i = 0; i < counted; ++i) {
        const int64_t e = g * per_group + order[i];
        group_score[g] += choice[e];
        group_key[g].push_back(key[e][0]);
      }
      std::sort(group_key[g].begin(), group_key[g].end());
      // Which experts count must not be in doubt either.
      if (per_group > counted) {
        const int64_t a = g * per_group + order[counted - 1], b = g * per_group + order[counted];
        if (fragile(choice[a], choice[b], key[a], key[b])) return false;
      }
    }
    const std::vector<int64_t> groups = order_desc(group_score);
    for (int64_t i = 0; i < c.topk_groups; ++i) {
      for (int64_t j = c.topk_groups; j < c.num_groups; ++j) {
        const int64_t a = groups[i], b = groups[j];
        if (fragile(group_score[a], group_score[b], group_key[a], group_key[b])) return false;
      }
    }
    for (int64_t j = c.topk_groups; j < c.num_groups; ++j)
      for (int64_t i = 0; i < per_group; ++i) eligible[groups[j] * per_group + i] = false;
  }
  for (int64_t e = 0; e < E; ++e)
    if (!eligible[e]) choice[e] = -INFINITY;
  const std::vector<int64_t> experts = order_desc(choice);
  for (int64_t i = 0; i < c.top_k; ++i) {
    for (int64_t j = i + 1; j < E; ++j) {
      const int64_t a = experts[i], b = experts[j];
      if (eligible[b] && fragile(choice[a], choice[b], key[a], key[b])) return false;
    }
  }
  return true;
}

// route()'s weights of the picks `ids` [T, K] with the softmax denominator summed in float64 and
// rounded to float32 once; every other operation is route()'s float32 one, in its order (see
// the file comment).
std::vector<float> exact_sum_weights(const std::vector<float>& logits, int64_t T,
                                     const RouterCase& c, const std::vector<int32_t>& ids) {
  const int64_t E = c.num_experts, K = c.top_k;
  std::vector<float> weights(T * K), score(E);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = logits.data() + t * E;
    if (c.score == SF::kSoftmax) {
      const float max_logit = *std::max_element(row, row + E);
      double sum = 0.0;
      for (int64_t e = 0; e < E; ++e) sum += score[e] = std::exp(row[e] - max_logit);
      for (int64_t e = 0; e < E; ++e) score[e] /= static_cast<float>(sum);
    } else {
      for (int64_t e = 0; e < E; ++e) score[e] = 1.0f / (1.0f + std::exp(-row[e]));
    }
    float picked_sum = 0.0f;
    for (int64_t k = 0; k < K; ++k) picked_sum += score[ids[t * K + k]];
    const float scale = (c.renormalize ? 1.0f / (picked_sum + 1e-20f) : 1.0f) * c.scaling;
    for (int64_t k = 0; k < K; ++k) weights[t * K + k] = score[ids[t * K + k]] * scale;
  }
  return weights;
}

// How expect_matches_reference runs the router beyond the case itself.
struct RunOptions {
  // Captured into a CUDA graph in global capture mode (which fails on any host
  // synchronisation) and replayed.
  bool in_graph = false;
  // [E] the synthetic models' routing skew, added to every token's logits before the score
  // function; the reference routes the biased logits. Empty: none.
  std::vector<float> logit_bias;
  // >= 0: tokens from this one on pad a graph bucket and must get the null expert E at weight 0.
  int64_t num_valid = -1;
};

// Runs the GPU router on [T, E] logits (and bias, empty for none) and holds it to route():
// ids exact, weights within 1e-5 relative; block-router shapes also to exact_sum_weights()
// within 1e-6 relative.
void expect_matches_reference(const std::vector<float>& logits, const std::vector<float>& bias,
                              int64_t T, const RouterCase& c, const RunOptions& run = {}) {
  const bool in_graph = run.in_graph;
  const std::vector<float>& logit_bias = run.logit_bias;
  const int64_t num_valid = run.num_valid;
  const int64_t K = c.top_k;
  SCOPED_TRACE(::testing::Message() << c.name << " T=" << T << " E=" << c.num_experts << " K=" << K
                                    << " bias=" << !bias.empty() << (in_graph ? " in graph" : "")
                                    << " logit_bias=" << !logit_bias.empty());
  std::vector<float> biased = logits;
  for (size_t i = 0; i < biased.size() && !logit_bias.empty(); ++i) {
    biased[i] += logit_bias[i % logit_bias.size()];
  }
  moe::Routing want;
  moe::route(biased.data(), T, options_of(c, bias.empty() ? nullptr : bias.data()), &want);

  DeviceBuffer<float> d_logits(logits);
  DeviceBuffer<float> d_bias(bias);
  DeviceBuffer<float> d_logit_bias(logit_bias);
  DeviceBuffer<int32_t> d_num_valid(std::vector<int32_t>{static_cast<int32_t>(num_valid)});
  DeviceBuffer<int32_t> d_ids(T * K);
  DeviceBuffer<float> d_weights(T * K);
  d_ids.poison();
  d_weights.poison();
  const RouterParams params{
      .logits = d_logits.get(),
      .topk_ids = d_ids.get(),
      .topk_weights = d_weights.get(),
      .num_tokens = T,
      .num_experts = c.num_experts,
      .top_k = K,
      .score = c.score == SF::kSoftmax ? RouterScore::kSoftmax : RouterScore::kSigmoid,
      .renormalize = c.renormalize,
      .routed_scaling_factor = c.scaling,
      .logit_bias = logit_bias.empty() ? nullptr : d_logit_bias.get(),
      .selection_bias = bias.empty() ? nullptr : d_bias.get(),
      .group_score = to_cuda(c.group_score),
      .num_groups = c.num_groups,
      .topk_groups = c.topk_groups,
      .num_valid_tokens = num_valid >= 0 ? d_num_valid.get() : nullptr};
  if (in_graph) {
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    fused_router(params, stream);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
    CUDA_CHECK(cudaStreamDestroy(stream));
  } else {
    fused_router(params, nullptr);
  }
  synchronize();

  const std::vector<int32_t> ids = d_ids.download();
  const std::vector<float> weights = d_weights.download();
  size_t id_mismatches = 0, weight_mismatches = 0;
  for (int64_t i = 0; i < T * K; ++i) {
    if (num_valid >= 0 && i / K >= num_valid) {  // padding
      want.topk_ids[i] = static_cast<int32_t>(c.num_experts);
      want.topk_weights[i] = 0.0f;
    }
    if (ids[i] != want.topk_ids[i] && id_mismatches++ < 5)
      ADD_FAILURE() << "token " << i / K << ": topk_ids[" << i % K << "] = " << ids[i] << ", want "
                    << want.topk_ids[i];
    const float w = want.topk_weights[i];
    if (!(std::fabs(weights[i] - w) <= 1e-5f * std::fabs(w) + 1e-30f) &&
        weight_mismatches++ < 5)  // NaN fails
      ADD_FAILURE() << "token " << i / K << ": topk_weights[" << i % K << "] = " << weights[i]
                    << ", want " << w;
  }
  EXPECT_EQ(id_mismatches, 0u) << "topk_ids";
  EXPECT_EQ(weight_mismatches, 0u) << "topk_weights";
  if (!block_shape(c)) return;
  // The picks are route()'s (checked above), so the weights of the same picks.
  const std::vector<float> exact = exact_sum_weights(biased, T, c, want.topk_ids);
  size_t exact_mismatches = 0;
  for (int64_t i = 0; i < T * K; ++i) {
    if (num_valid >= 0 && i / K >= num_valid) continue;  // padding: checked above
    const float w = exact[i];
    if (!(std::fabs(weights[i] - w) <= 1e-6f * std::fabs(w) + 1e-30f) && exact_mismatches++ < 5)
      ADD_FAILURE() << "token " << i / K << ": topk_weights[" << i % K << "] = " << weights[i]
                    << ", want " << w << " within 1e-6 (float64 softmax sum)";
  }
  EXPECT_EQ(exact_mismatches, 0u) << "topk_weights against the exactly summed reference";
}

// Uniform in [-0.25, 0.25]; block-router shapes on the grid of 1/8 in that range.
std::vector<float> random_bias(const RouterCase& c, std::mt19937& rng) {
  if (!c.bias) return {};
  std::uniform_real_distribution<float> dist(-0.25f, 0.25f);
  std::uniform_int_distribution<int> grid(-2, 2);
  std::vector<float> bias(c.num_experts);
  for (float& b : bias) b = block_shape(c) ? static_cast<float>(grid(rng)) / 8.0f : dist(rng);
  return bias;
}

// T tokens of N(0, 1.5) logits (block-router shapes: uniform on the grid of 1/64 in [-4, 4]),
// each drawn again until its decisions are robust with logit_bias [E] (empty: none) added, as
// the router sees them.
std::vector<float> random_logits(int64_t T, const RouterCase& c, const std::vector<float>& bias,
                                 std::mt19937& rng, const std::vector<float>& logit_bias = {}) {
  const int64_t E = c.num_experts;
  std::normal_distribution<float> dist(0.0f, 1.5f);
  std::uniform_int_distribution<int> grid(-256, 256);
  auto draw = [&] { return block_shape(c) ? static_cast<float>(grid(rng)) / 64.0f : dist(rng); };
  std::vector<float> logits(T * E), biased(E);
  auto robust = [&](const float* row) {
    for (int64_t e = 0; e < E; ++e)
      biased[e] = row[e] + (logit_bias.empty() ? 0.0f : logit_bias[e]);
    return decisions_are_robust(biased.data(), bias.empty() ? nullptr : bias.data(), c);
  };
  int64_t redraws = 0;
  for (int64_t t = 0; t < T; ++t) {
    float* row = logits.data() + t * E;
    do {
      for (int64_t e = 0; e < E; ++e) row[e] = draw();
    } while (!robust(row) && ++redraws < 100 + T);
  }
  EXPECT_LT(redraws, 100 + T) << c.name << ": too many tokens with fragile decisions";
  return logits;
}

void router_random(const RouterCase& c, int64_t T, bool in_graph = false) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(T * 7919 + c.num_experts * 31 + c.top_k));
  for (int round = 0; round < 2; ++round) {  // two biases per case
    const std::vector<float> bias = random_bias(c, rng);
    expect_matches_reference(random_logits(T, c, bias, rng), bias, T, c, {.in_graph = in_graph});
  }
}

// A Zipf-shaped logit bias (-A ln(rank + 1) over shuffled ranks, as synthetic models use it)
// on random logits, with and without a selection bias and groups. Block-router shapes round it
// to the logits' grid of 1/64.
void router_logit_bias(const RouterCase& c, int64_t T) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(T * 104729 + c.num_experts));
  std::vector<int64_t> rank(c.num_experts);
  std::iota(rank.begin(), rank.end(), 0);
  std::shuffle(rank.begin(), rank.end(), rng);
  std::vector<float> logit_bias(c.num_experts);
  for (int64_t e = 0; e < c.num_experts; ++e) {
    logit_bias[e] = static_cast<float>(-1.2 * std::log(static_cast<double>(rank[e] + 1)));
    if (block_shape(c)) logit_bias[e] = std::round(logit_bias[e] * 64.0f) / 64.0f;
  }
  const std::vector<float> bias = random_bias(c, rng);
  expect_matches_reference(random_logits(T, c, bias, rng, logit_bias), bias, T, c,
                           {.logit_bias = logit_bias});
}

// A graph bucket of T rows of which the first num_valid are tokens: those route as the
// reference does, the rest get the null expert at weight 0 (plain and general kernels, and
// captured in a graph).
void router_padding(const RouterCase& c, int64_t T, int64_t num_valid, bool in_graph) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(T * 613 + num_valid + c.num_experts));
  const std::vector<float> bias = random_bias(c, rng);
  expect_matches_reference(random_logits(T, c, bias, rng), bias, T, c,
                           {.in_graph = in_graph, .num_valid = num_valid});
}

// Constructed tokens full of exact ties, under three biases: zero, a bias that repeats with
// the group (bias[e] depends on e % group size only, on a grid of 1/8), and -3 everywhere (every
// choice negative; only the dropped groups' -inf is lower).
void router_ties(const RouterCase& c) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(c.num_experts * 131 + c.top_k));
  const int64_t E = c.num_experts;
  const int64_t per_group = c.group_score == GS::kNone ? E : E / c.num_groups;
  const int64_t num_groups = E / per_group;
  std::uniform_int_distribution<int> coarse(-2, 2);  // logits in {-1, -0.5, 0, 0.5, 1}
  std::uniform_int_distribution<int> bias_grid(-4, 4);
  for (int bias_kind = 0; bias_kind < 3; ++bias_kind) {
    std::vector<float> bias(E, 0.0f);
    if (bias_kind == 1) {
      std::vector<float> pattern(per_group);
      for (float& b : pattern) b = static_cast<float>(bias_grid(rng)) / 8.0f;
      for (int64_t e = 0; e < E; ++e) bias[e] = pattern[e % per_group];
    } else if (bias_kind == 2) {
      std::fill(bias.begin(), bias.end(), -3.0f);
    }
    // Each maker fills one token; random ones are drawn again until robust.
    std::vector<std::function<void(float*)>> makers;
    makers.push_back([&](float* row) { std::fill(row, row + E, 0.0f); });  // all equal
    makers.push_back([&](float* row) {  // every group a copy of group 0
      for (int64_t i = 0; i < per_group; ++i) row[i] = 0.5f * static_cast<float>(coarse(rng));
      for (int64_t e = per_group; e < E; ++e) row[e] = row[e % per_group];
    });
    if (bias_kind != 1) {
      makers.push_back([&](float* row) {  // every group a permutation of group 0
        for (int64_t i = 0; i < per_group; ++i) row[i] = 0.5f * static_cast<float>(coarse(rng));
        for (int64_t g = 1; g < num_groups; ++g) {
          std::copy(row, row + per_group, row + g * per_group);
          std::shuffle(row + g * per_group, row + (g + 1) * per_group, rng);
        }
      });
      makers.push_back([&](float* row) {  // duplicated maxima against one higher maximum
        std::fill(row, row + E, -4.0f);
        const int64_t last = num_groups - 1;
        row[last * per_group] = 2.0f;  // the highest group holds the duplicates
        if (per_group > 1) row[last * per_group + per_group - 1] = 2.0f;
        if (num_groups > 1) row[0] = 2.5f;  // group 0 the single higher one
      });
    }
    makers.push_back([&](float* row) {  // coarse logits: many exact ties everywhere
      for (int64_t e = 0; e < E; ++e) row[e] = 0.5f * static_cast<float>(coarse(rng));
    });
    const int64_t T = static_cast<int64_t>(makers.size());
    std::vector<float> logits(T * E);
    for (int64_t t = 0; t < T; ++t) {
      float* row = logits.data() + t * E;
      int tries = 0;
      do {
        makers[t](row);
      } while (!decisions_are_robust(row, bias.data(), c) && ++tries < 1000);
      ASSERT_LT(tries, 1000) << c.name << ": tie token " << t << " (bias kind " << bias_kind
                             << ") is never robust";
    }
    expect_matches_reference(logits, bias, T, c);
  }
}

// A -inf bias, which no checkpoint has: route() then orders the -inf choices of kept and dropped
// experts alike by id, and so must the kernel. One kept group of 8 (group 1, logits 3) with
// experts 10 and 12 at -inf leaves 6 finite choices for K = 8: the last two picks are experts 0
// and 1 of dropped group 0, weighted by their unbiased scores.
void router_infinite_bias() {
  const RouterCase& c = kShapes[5];  // E64_G8_ExactPool: E = 64, K = 8, 8 groups, keep 1
  ASSERT_EQ(c.num_experts, 64);
  ASSERT_EQ(c.top_k, 8);
  std::vector<float> logits(64, 0.0f), bias(64, 0.0f);
  for (int e = 8; e < 16; ++e) logits[e] = 3.0f;
  bias[10] = bias[12] = -INFINITY;
  moe::Routing want;
  moe::route(logits.data(), 1, options_of(c, bias.data()), &want);
  EXPECT_EQ(want.topk_ids, (std::vector<int32_t>{8, 9, 11, 13, 14, 15, 0, 1}));
  expect_matches_reference(logits, bias, 1, c);
}

// The same on the block router: one kept group of 41 (group 1, logits 3) of E = 1025 in 25
// groups, experts 45 and 50 at -inf, K = 41: the 39 finite picks by id, then experts 0 and 1 of
// dropped group 0.
void router_block_infinite_bias() {
  const RouterCase c{
      "E1025_G25_Max_K41_Keep1", 1025, 41, SF::kSigmoid, GS::kMax, 25, 1, true, true, 1.0f};
  ASSERT_TRUE(block_shape(c));
  std::vector<float> logits(1025, 0.0f), bias(1025, 0.0f);
  for (int e = 41; e < 82; ++e) logits[e] = 3.0f;
  bias[45] = bias[50] = -INFINITY;
  std::vector<int32_t> expected;
  for (int32_t e = 41; e < 82; ++e)
    if (e != 45 && e != 50) expected.push_back(e);
  expected.push_back(0);
  expected.push_back(1);
  moe::Routing want;
  moe::route(logits.data(), 1, options_of(c, bias.data()), &want);
  EXPECT_EQ(want.topk_ids, expected);
  expect_matches_reference(logits, bias, 1, c);
}

// ---------------------------------------------------------------------------------------------
// The synthetic models' uniform router (RouterParams::noise_keys, `--routing-skew uniform`): the
// logits are NaN here, so a kernel that read them instead of the noise would pick nothing sane.

struct NoiseCase {
  const char* name;
  int64_t num_experts;  // E
  int64_t top_k;        // K
  RouterScore score;
  bool renormalize;
  float scaling;
  bool general;  // a zero selection bias: the general kernels instead of the plain one
};

struct NoiseRouting {
  std::vector<int32_t> ids;    // [T, K]
  std::vector<float> weights;  // [T, K]
};

// Routes keys.size() tokens with noise of `seed`; num_valid >= 0 pads the tokens past it.
NoiseRouting route_with_noise(const NoiseCase& c, const std::vector<int32_t>& keys, uint64_t seed,
                              int64_t num_valid = -1) {
  const int64_t T = static_cast<int64_t>(keys.size()), E = c.num_experts, K = c.top_k;
  DeviceBuffer<float> d_logits(std::vector<float>(T * E, std::nanf("")));
  DeviceBuffer<float> d_bias(std::vector<float>(c.general ? E : 0, 0.0f));
  DeviceBuffer<int32_t> d_keys(keys);
  DeviceBuffer<int32_t> d_num_valid(std::vector<int32_t>{static_cast<int32_t>(num_valid)});
  DeviceBuffer<int32_t> d_ids(T * K);
  DeviceBuffer<float> d_weights(T * K);
  d_ids.poison();
  d_weights.poison();
  fused_router({.logits = d_logits.get(),
                .topk_ids = d_ids.get(),
                .topk_weights = d_weights.get(),
                .num_tokens = T,
                .num_experts = E,
                .top_k = K,
                .score = c.score,
                .renormalize = c.renormalize,
                .routed_scaling_factor = c.scaling,
                .selection_bias = c.general ? d_bias.get() : nullptr,
                .num_valid_tokens = num_valid >= 0 ? d_num_valid.get() : nullptr,
                .noise_keys = d_keys.get(),
                .noise_seed = seed},
               nullptr);
  synchronize();
  return {d_ids.download(), d_weights.download()};
}

// A token's scores in float64 from the same noise (host and device hash alike).
std::vector<double> noise_scores(const NoiseCase& c, uint64_t seed, int32_t key) {
  const int64_t E = c.num_experts;
  std::vector<double> x(E);
  for (int64_t e = 0; e < E; ++e) x[e] = router_noise(seed, key, e);
  if (c.score == RouterScore::kSigmoid) {
    for (double& v : x) v = 1.0 / (1.0 + std::exp(-v));
    return x;
  }
  const double max = *std::max_element(x.begin(), x.end());
  double sum = 0.0;
  for (double& v : x) sum += (v = std::exp(v - max));
  for (double& v : x) v /= sum;
  return x;
}

// `--routing-skew zipf:A`: with a logit bias the noise becomes Gumbel noise, so the top k of
// bias + Gumbel draw k experts without replacement with probabilities proportional to
// exp(bias). With bias -A ln(rank + 1) over a shuffled ranking, T tokens of distinct keys:
//  - each token's picks are K distinct experts, the K largest of bias + router_gumbel(noise) on
//    the host (1 token in 100 may differ by float32 rounding);
//  - K = 1: the per-expert counts pass a chi-square test against T (rank + 1)^-A / H within 6
//    standard deviations of its mean (the noise really is Gumbel noise).
void router_noise_zipf(int64_t E, int64_t K, double exponent, int64_t T) {
  std::mt19937_64 rng(fresh_seed() ^ static_cast<uint64_t>(E * 104729 + K));
  const uint64_t seed = rng();
  SCOPED_TRACE(::testing::Message() << "E=" << E << " K=" << K << " A=" << exponent << " T=" << T
                                    << " noise_seed=" << seed);
  std::vector<int64_t> rank(E);
  std::iota(rank.begin(), rank.end(), 0);
  std::shuffle(rank.begin(), rank.end(), rng);
  std::vector<float> bias(E);
  for (int64_t e = 0; e < E; ++e)
    bias[e] = static_cast<float>(-exponent * std::log(static_cast<double>(rank[e] + 1)));
  std::vector<int32_t> keys(4 * T);
  std::iota(keys.begin(), keys.end(), 0);
  std::shuffle(keys.begin(), keys.end(), rng);
  keys.resize(T);

  DeviceBuffer<float> d_logits(std::vector<float>(T * E, std::nanf("")));
  DeviceBuffer<float> d_bias(bias);
  DeviceBuffer<int32_t> d_keys(keys);
  DeviceBuffer<int32_t> d_ids(T * K);
  DeviceBuffer<float> d_weights(T * K);
  d_ids.poison();
  fused_router({.logits = d_logits.get(),
                .topk_ids = d_ids.get(),
                .topk_weights = d_weights.get(),
                .num_tokens = T,
                .num_experts = E,
                .top_k = K,
                .score = RouterScore::kSoftmax,
                .renormalize = true,
                .logit_bias = d_bias.get(),
                .noise_keys = d_keys.get(),
                .noise_seed = seed},
               nullptr);
  synchronize();
  const std::vector<int32_t> ids = d_ids.download();

  std::vector<int64_t> counts(E, 0);
  int64_t host_mismatches = 0, bad_tokens = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> got(ids.begin() + t * K, ids.begin() + (t + 1) * K);
    std::sort(got.begin(), got.end());
    if (got.front() < 0 || got.back() >= E ||
        std::adjacent_find(got.begin(), got.end()) != got.end()) {
      if (bad_tokens++ < 5) ADD_FAILURE() << "token " << t << ": ids not K distinct experts";
      continue;
    }
    for (int32_t id : got) ++counts[id];
    std::vector<float> logit(E);
    for (int64_t e = 0; e < E; ++e)
      logit[e] = router_gumbel(router_noise(seed, keys[t], e)) + bias[e];
    std::vector<int32_t> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return logit[a] > logit[b]; });
    std::vector<int32_t> want(order.begin(), order.begin() + K);
    std::sort(want.begin(), want.end());
    if (want != got) ++host_mismatches;
  }
  EXPECT_EQ(bad_tokens, 0);
  EXPECT_LE(host_mismatches, T / 100)
      << "tokens whose picks are not the K largest of bias + Gumbel";

  // The K = 1 counts test the noise itself; for K > 1 the picks are the host's Gumbel top-k above.
  if (K == 1) {
    double norm = 0.0;
    for (float b : bias) norm += std::exp(static_cast<double>(b));
    double chi2 = 0.0;
    for (int64_t e = 0; e < E; ++e) {
      const double expected =
          static_cast<double>(T) * std::exp(static_cast<double>(bias[e])) / norm;
      chi2 += (counts[e] - expected) * (counts[e] - expected) / expected;
    }
    const double dof = static_cast<double>(E - 1), spread = 6.0 * std::sqrt(2.0 * dof);
    EXPECT_LT(chi2, dof + spread) << "top-1 counts do not follow the Zipf law";
  }
}

// T tokens with distinct keys (a shuffled range, as KV slots are distinct within a step):
//  - each token's K ids are distinct experts in [0, E), and the set is the K largest noise
//    values (float32 rounding of the score may tie two nearly equal values: 1 token in 100 may
//    differ);
//  - the weights are the scores of the picks, renormalised and scaled as configured (1e-5);
//  - the per-expert counts pass a chi-square test with E - 1 degrees of freedom within 6
//    standard deviations of its mean, both ways (too even is as wrong as too skewed);
//  - neighbouring keys (a sequence's consecutive slots) share K^2 / E experts on average, as
//    independent uniform picks do;
//  - the same keys in another order give the same ids and weights, token by token, and another
//    seed gives other ids.
void router_noise_uniform(const NoiseCase& c, int64_t T) {
  std::mt19937_64 rng(fresh_seed() ^ static_cast<uint64_t>(c.num_experts * 7919 + c.top_k));
  const uint64_t seed = rng();
  const int64_t E = c.num_experts, K = c.top_k;
  SCOPED_TRACE(::testing::Message() << c.name << " T=" << T << " noise_seed=" << seed);
  std::vector<int32_t> range(4 * T);
  std::iota(range.begin(), range.end(), 0);
  std::shuffle(range.begin(), range.end(), rng);
  const std::vector<int32_t> keys(range.begin(), range.begin() + T);
  const NoiseRouting got = route_with_noise(c, keys, seed);

  std::vector<int64_t> counts(E, 0);
  int64_t host_mismatches = 0, bad_tokens = 0, bad_weights = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> ids(got.ids.begin() + t * K, got.ids.begin() + (t + 1) * K);
    std::vector<int32_t> sorted = ids;
    std::sort(sorted.begin(), sorted.end());
    const bool valid = sorted.front() >= 0 && sorted.back() < E &&
                       std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
    if (!valid) {
      if (bad_tokens++ < 5) ADD_FAILURE() << "token " << t << ": ids not K distinct experts";
      continue;
    }
    for (int32_t id : ids) ++counts[id];
    const std::vector<double> scores = noise_scores(c, seed, keys[t]);
    std::vector<float> noise(E);
    for (int64_t e = 0; e < E; ++e) noise[e] = router_noise(seed, keys[t], e);
    std::vector<int32_t> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return noise[a] > noise[b]; });
    std::vector<int32_t> want(order.begin(), order.begin() + K);
    std::sort(want.begin(), want.end());
    if (want != sorted) ++host_mismatches;
    double picked = 0.0;
    for (int32_t id : ids) picked += scores[id];
    const double scale = (c.renormalize ? 1.0 / picked : 1.0) * c.scaling;
    double sum = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double w = scores[ids[k]] * scale;
      const float g = got.weights[t * K + k];
      sum += g;
      if (!(std::fabs(g - w) <= 1e-5 * std::fabs(w)) && bad_weights++ < 5)
        ADD_FAILURE() << "token " << t << ": topk_weights[" << k << "] = " << g << ", want " << w;
    }
    if (c.renormalize && !(std::fabs(sum - c.scaling) <= 1e-5 * c.scaling) && bad_weights++ < 5)
      ADD_FAILURE() << "token " << t << ": the weights sum to " << sum << ", want " << c.scaling;
  }
  EXPECT_EQ(bad_tokens, 0);
  EXPECT_EQ(bad_weights, 0);
  EXPECT_LE(host_mismatches, T / 100) << "tokens whose picks are not the K largest noise values";

  const double expected = static_cast<double>(T * K) / static_cast<double>(E);
  double chi2 = 0.0;
  for (int64_t n : counts) chi2 += (n - expected) * (n - expected) / expected;
  const double dof = static_cast<double>(E - 1), spread = 6.0 * std::sqrt(2.0 * dof);
  EXPECT_LT(chi2, dof + spread) << "per-expert counts too uneven for uniform picks";
  EXPECT_GT(chi2, dof - spread) << "per-expert counts too even for random picks";

  // Neighbouring keys: key + 1 for every token.
  std::vector<int32_t> next = keys;
  for (int32_t& k : next) ++k;
  const NoiseRouting neighbour = route_with_noise(c, next, seed);
  double shared = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> a(got.ids.begin() + t * K, got.ids.begin() + (t + 1) * K);
    std::vector<int32_t> b(neighbour.ids.begin() + t * K, neighbour.ids.begin() + (t + 1) * K);
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    std::vector<int32_t> both;
    std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(both));
    shared += static_cast<double>(both.size());
  }
  const double mean_shared = shared / static_cast<double>(T);
  const double want_shared = static_cast<double>(K * K) / static_cast<double>(E);
  EXPECT_NEAR(mean_shared, want_shared, 8.0 * std::sqrt(want_shared / T) + 0.02)
      << "experts shared by neighbouring keys";

  // The same keys reversed: token t of the first run is token T - 1 - t here.
  const std::vector<int32_t> reversed(keys.rbegin(), keys.rend());
  const NoiseRouting again = route_with_noise(c, reversed, seed);
  int64_t differ = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t r = T - 1 - t;
    for (int64_t k = 0; k < K; ++k) {
      if (again.ids[r * K + k] != got.ids[t * K + k] ||
          again.weights[r * K + k] != got.weights[t * K + k]) {
        if (differ++ < 5) ADD_FAILURE() << "key " << keys[t] << " routes differently in order";
        break;
      }
    }
  }
  EXPECT_EQ(differ, 0);

  const NoiseRouting other = route_with_noise(c, keys, seed ^ 0x5DEECE66Dull);
  int64_t same = 0;
  for (int64_t t = 0; t < T; ++t) {
    same += std::equal(other.ids.begin() + t * K, other.ids.begin() + (t + 1) * K,
                       got.ids.begin() + t * K)
                ? 1
                : 0;
  }
  EXPECT_LE(same, T / 100 + 1) << "tokens that another seed routes identically";
}

// A graph bucket of T rows of which num_valid are tokens: the padding rows (key -1, as the
// decoder's padding slots) get the null expert E at weight 0; the tokens route as they do alone.
void router_noise_padding(const NoiseCase& c, int64_t T, int64_t num_valid) {
  std::mt19937_64 rng(fresh_seed() ^ static_cast<uint64_t>(T * 613 + num_valid));
  const uint64_t seed = rng();
  const int64_t K = c.top_k;
  SCOPED_TRACE(::testing::Message()
               << c.name << " T=" << T << " valid=" << num_valid << " noise_seed=" << seed);
  std::vector<int32_t> keys(T, -1);
  for (int64_t t = 0; t < num_valid; ++t) keys[t] = static_cast<int32_t>(rng() % (1u << 30));
  const NoiseRouting padded = route_with_noise(c, keys, seed, num_valid);
  const NoiseRouting alone =
      route_with_noise(c, std::vector<int32_t>(keys.begin(), keys.begin() + num_valid), seed);
  for (int64_t i = 0; i < T * K; ++i) {
    if (i / K >= num_valid) {
      EXPECT_EQ(padded.ids[i], c.num_experts) << "padding token " << i / K;
      EXPECT_EQ(padded.weights[i], 0.0f) << "padding token " << i / K;
    } else {
      EXPECT_EQ(padded.ids[i], alone.ids[i]) << "token " << i / K;
      EXPECT_EQ(padded.weights[i], alone.weights[i]) << "token " << i / K;
    }
  }
}

// One-warp plain and general kernels (Qwen3-30B-A3B's E = 128, K = 8; an odd E), and the block
// router (K > 32, E > 1024).
const NoiseCase kNoiseCases[] = {
    {"E128_K8_Softmax", 128, 8, RouterScore::kSoftmax, true, 1.0f, false},
    {"E128_K8_Sigmoid_General", 128, 8, RouterScore::kSigmoid, true, 2.5f, true},
    {"E60_K4_Softmax_NotRenormalized", 60, 4, RouterScore::kSoftmax, false, 1.0f, false},
    {"E1500_K40_Softmax_Block", 1500, 40, RouterScore::kSoftmax, true, 1.0f, false},
    {"E1025_K33_Sigmoid_Block_General", 1025, 33, RouterScore::kSigmoid, false, 2.5f, true},
};

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda_device_present("router")) return false;
  auto reg = [](const std::string& name, std::function<void()> body) {
    register_kernel_test("CudaRouterGrouped", name, std::move(body), __FILE__, __LINE__);
  };
  for (int64_t T : {int64_t{1}, int64_t{19}, int64_t{989}, int64_t{4096}}) {
    const std::string suffix = "_T" + std::to_string(T);
    reg(std::string(kDeepSeekV2.name) + suffix, [T] { router_random(kDeepSeekV2, T); });
    reg(std::string(kDeepSeekV3.name) + suffix, [T] { router_random(kDeepSeekV3, T); });
  }
  reg(std::string(kDeepSeekV2Small.name) + "_T99", [] { router_random(kDeepSeekV2Small, 99); });
  for (const RouterCase& c : kShapes)
    reg(std::string(c.name) + "_T99", [&c] { router_random(c, 99); });
  reg("DeepSeekV3_CapturedInGraph_T989", [] { router_random(kDeepSeekV3, 989, true); });
  reg("Ties_DeepSeekV2", [] { router_ties(kDeepSeekV2); });
  reg("LogitBias_Qwen3Like_T64", [] {
    router_logit_bias({"Qwen3Like", 128, 8, SF::kSoftmax, GS::kNone, 1, 1, false, true, 1.0f}, 64);
  });
  reg("LogitBias_DeepSeekV3_T33", [] { router_logit_bias(kDeepSeekV3, 33); });
  reg("Padding_Qwen3Like_T64_Valid37", [] {
    router_padding({"Qwen3Like", 128, 8, SF::kSoftmax, GS::kNone, 1, 1, false, true, 1.0f}, 64,
                   37, /*in_graph=*/true);
  });
  reg("Padding_DeepSeekV3_T8_Valid3", [] { router_padding(kDeepSeekV3, 8, 3, false); });
  reg("Padding_DeepSeekV3_T4_Valid4", [] { router_padding(kDeepSeekV3, 4, 4, false); });
  reg("Ties_DeepSeekV3", [] { router_ties(kDeepSeekV3); });
  for (const RouterCase& c : kShapes) reg(std::string("Ties_") + c.name, [&c] { router_ties(c); });
  reg("InfiniteBiasOrdersByIdLikeTheReference", [] { router_infinite_bias(); });

  // The block router (shapes past the one-warp router).
  auto block = [](const std::string& name, std::function<void()> body) {
    register_kernel_test("CudaRouterBlock", name, std::move(body), __FILE__, __LINE__);
  };
  for (const RouterCase& c : kBlockShapes)
    block(std::string(c.name) + "_T99", [&c] { router_random(c, 99); });
  for (const RouterCase& c : kUncachedShapes)
    block(std::string(c.name) + "_T19", [&c] { router_random(c, 19); });
  const RouterCase& v3_like = block_case("E1500_G12_Top2Sum_K33");
  const RouterCase& plain_k40 = block_case("E1500_K40_Sigmoid");
  const RouterCase& k_equals_e = block_case("E48_K48_Softmax");
  block("E1500_G12_Top2Sum_K33_T1", [&v3_like] { router_random(v3_like, 1); });
  block("E1500_G12_Top2Sum_K33_T989", [&v3_like] { router_random(v3_like, 989); });
  block("E1500_G12_Top2Sum_K33_CapturedInGraph_T99",
        [&v3_like] { router_random(v3_like, 99, true); });
  block("Padding_E1500_K40_T64_Valid37_InGraph",
        [&plain_k40] { router_padding(plain_k40, 64, 37, true); });
  block("Padding_E1500_G12_Top2Sum_K33_T8_Valid3",
        [&v3_like] { router_padding(v3_like, 8, 3, false); });
  block("Padding_E48_K48_T5_Valid5", [&k_equals_e] { router_padding(k_equals_e, 5, 5, false); });
  block("Padding_E12000_G8_Top2Sum_K36_T6_Valid2",
        [] { router_padding(block_case("E12000_G8_Top2Sum_K36"), 6, 2, false); });
  block("LogitBias_E4099_K64_Softmax_T33",
        [] { router_logit_bias(block_case("E4099_K64_Softmax"), 33); });
  block("LogitBias_E1500_G12_Top2Sum_K33_T33", [&v3_like] { router_logit_bias(v3_like, 33); });
  for (const char* name : {"E1025_K33_Sigmoid", "E1500_G12_Top2Sum_K33", "E1500_G750_Top2Sum_K40",
                           "E64_G8_Max_K40_ExactPool", "E48_K48_Softmax", "E48_G6_Top2Sum_K48"})
    block(std::string("Ties_") + name, [name] { router_ties(block_case(name)); });
  block("InfiniteBiasOrdersByIdLikeTheReference", [] { router_block_infinite_bias(); });

  auto noise = [](const std::string& name, std::function<void()> body) {
    register_kernel_test("CudaRouterNoise", name, std::move(body), __FILE__, __LINE__);
  };
  for (const NoiseCase& c : kNoiseCases) {
    const int64_t T = c.num_experts > kRouterWarpMaxExperts || c.top_k > kRouterWarpMaxTopK
                          ? 2048
                          : (c.num_experts == 60 ? 989 : 4096);
    noise(std::string("Uniform_") + c.name + "_T" + std::to_string(T),
          [&c, T] { router_noise_uniform(c, T); });
  }
  noise("Zipf_E128_K1_A1_T8192", [] { router_noise_zipf(128, 1, 1.0, 8192); });
  noise("Zipf_E16_K1_A2_T8192", [] { router_noise_zipf(16, 1, 2.0, 8192); });
  noise("Zipf_E128_K8_A1_T4096", [] { router_noise_zipf(128, 8, 1.0, 4096); });
  noise("Padding_E128_K8_T64_Valid37", [] { router_noise_padding(kNoiseCases[0], 64, 37); });
  noise("Padding_E128_K8_General_T8_Valid3", [] { router_noise_padding(kNoiseCases[1], 8, 3); });
  noise("Padding_E1500_K40_Block_T19_Valid5", [] { router_noise_padding(kNoiseCases[3], 19, 5); });
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
