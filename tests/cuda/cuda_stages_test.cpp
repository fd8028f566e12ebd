// The CUDA MoE-stage kernels (backend/cuda/moe_stages.h) against the CPU reference stages in
// moe/stages.h: fresh random inputs every run (the seed is printed on failure; MOE_TEST_SEED
// replays one), every output poisoned with 0xFF bytes first (NaN for float and bf16, -1 for
// int32) so an unwritten element fails, awkward sizes (T in 1, 19, 99, 989, 4096; E in 8, 60,
// 128, 256; K in 1, 2, 8), router ties, and empty experts. Past the kernels' fast paths: the
// plan at E from kPlanMaxSharedExperts (the shared-memory plan's largest) to a million (its
// histograms in the workspace, fewer blocks past the workspace cap), permute and unpermute at K
// in 33, 64, 100, and the four stages chained at E = 9000, K = 40 (the block router included).
//
// Tolerances:
// - ids and plans (counts, offsets, src_row, inverse) and permuted rows: exact.
// - router weights (float32): 1e-5 relative, the CONVENTIONS.md contract for float32.
// - bf16 outputs: within half a bf16 unit of the float reference (2^-8 relative, the rounding
//   itself) plus 1e-5 of the output's natural scale (the sum of the magnitudes of its terms),
//   which covers float32 accumulation in another order; far inside the 1e-2 bf16 contract, so
//   one wrong term cannot hide in it.
//
// How this binary behaves without a GPU (CI has the CUDA toolkit but no device):
// tests/CMakeLists.txt links every area's tests with gtest_main and discovers them at build
// time by running the binary with --gtest_list_tests. The host-side tests (the launchers'
// argument checks, which refuse before any CUDA call) are ordinary TESTs and always run. The
// kernel tests are registered at static-initialisation time through testing::RegisterTest,
// and only when cudaGetDeviceCount() reports a device: on a machine without one they do not
// exist (not skipped, not disabled), the binary prints one line to stderr saying so, and ctest
// stays green with the host-side tests. On the GPU machine the build's own discovery sees the
// device and registers every kernel test, so ctest runs them there (scripts/gpu-check.sh).
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/moe_stages.h"
#include "core/dtype.h"
#include "core/error.h"
#include "moe/stages.h"

namespace moeinfer::cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// Host-side checks: always registered, need no device.

template <typename Fn>
void expect_error_naming(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected moeinfer::Error mentioning '" << needle << "'";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(needle), std::string::npos)
        << "message '" << error.what() << "' does not name '" << needle << "'";
  }
}

TEST(CudaLauncherChecks, RouterRefusesBadSizes) {
  float logits = 0.0f;
  int32_t ids = 0;
  float weights = 0.0f;
  RouterParams p{.logits = &logits,
                 .topk_ids = &ids,
                 .topk_weights = &weights,
                 .num_tokens = 1,
                 .num_experts = kMaxExperts + 1,
                 .top_k = 8};
  expect_error_naming([&] { fused_router(p, nullptr); },
                      "num_experts = " + std::to_string(kMaxExperts + 1));
  p.num_experts = 64;
  p.top_k = 65;
  expect_error_naming([&] { fused_router(p, nullptr); }, "top_k = 65");
  p.num_experts = 4;
  p.top_k = 8;
  expect_error_naming([&] { fused_router(p, nullptr); }, "top_k = 8");
  p.top_k = 2;
  p.logits = nullptr;
  expect_error_naming([&] { fused_router(p, nullptr); }, "logits is null");
  // No tokens: nothing to do, and no pointer is looked at.
  fused_router(RouterParams{.num_tokens = 0, .num_experts = 8, .top_k = 2}, nullptr);
}

TEST(CudaLauncherChecks, PlanRefusesBadSizes) {
  int32_t dummy[4] = {};
  PlanParams p{.topk_ids = dummy,
               .expert_counts = dummy,
               .expert_offsets = dummy,
               .src_row = dummy,
               .inverse = dummy,
               .num_assignments = 4,
               .num_experts = 0};
  expect_error_naming([&] { moe_plan(p, nullptr); }, "num_experts = 0");
  p.num_experts = kMaxExperts + 1;
  expect_error_naming([&] { moe_plan(p, nullptr); },
                      "num_experts = " + std::to_string(kMaxExperts + 1));
  // Past the shared-memory plan every size needs the workspace: one row of E per block.
  p.num_experts = kPlanMaxSharedExperts + 1;
  EXPECT_EQ(plan_workspace_size(4, p.num_experts), p.num_experts);
  EXPECT_EQ(plan_workspace_size(0, p.num_experts), p.num_experts);
  EXPECT_EQ(plan_workspace_size(4, kPlanMaxSharedExperts), 0);
  expect_error_naming([&] { moe_plan(p, nullptr); }, "workspace is null");
  p.num_experts = 8;
  p.num_assignments = -1;
  expect_error_naming([&] { moe_plan(p, nullptr); }, "num_assignments = -1");
  p.num_assignments = 4;
  p.inverse = nullptr;
  expect_error_naming([&] { moe_plan(p, nullptr); }, "inverse is null");
  // Past the single-block size the plan needs its workspace.
  p.inverse = dummy;
  p.num_assignments = kPlanSingleBlockMax + 1;
  EXPECT_GT(plan_workspace_size(p.num_assignments, p.num_experts), 0);
  EXPECT_EQ(plan_workspace_size(kPlanSingleBlockMax, p.num_experts), 0);
  expect_error_naming([&] { moe_plan(p, nullptr); }, "workspace is null");
}

// The decoder sizes the plan's workspace once, for its largest step: the size must never shrink
// as the count grows (the block counts themselves do not grow monotonically: 150000
// assignments take 127 blocks, 131072 take 128). Shared-memory and large-E plans, the latter
// below and at its workspace cap.
TEST(CudaLauncherChecks, PlanWorkspaceServesEverySmallerStep) {
  for (const int64_t E : {int64_t{8}, int64_t{256}, kPlanMaxSharedExperts,
                          kPlanMaxSharedExperts + 1, int64_t{70000}, int64_t{1000000}}) {
    int64_t previous = 0;
    for (int64_t n = 0; n <= 400000; ++n) {
      const int64_t size = plan_workspace_size(n, E);
      ASSERT_GE(size, previous) << "E = " << E << ", " << n << " assignments";
      previous = size;
    }
    EXPECT_GT(previous, 0) << "E = " << E;
  }
  // At least one row per block the plan runs: 128 blocks at 131072 (chunks of 1024).
  EXPECT_GE(plan_workspace_size(150000, 8), 128 * 8);
}

TEST(CudaLauncherChecks, RowKernelsRefuseBadShapes) {
  alignas(16) uint16_t rows[64] = {};
  int32_t index[8] = {};
  float weights[8] = {};
  const bf16* in = reinterpret_cast<const bf16*>(rows);
  bf16* out = reinterpret_cast<bf16*>(rows);
  PermuteParams permute_params{
      .hidden = in, .inverse = index, .rows = out, .num_tokens = 2, .top_k = 2, .hidden_size = 12};
  expect_error_naming([&] { permute(permute_params, nullptr); }, "hidden_size = 12");
  permute_params.hidden_size = 8;
  permute_params.rows = reinterpret_cast<bf16*>(rows + 1);
  expect_error_naming([&] { permute(permute_params, nullptr); }, "rows (");
  alignas(16) float wide[64] = {};
  UnpermuteParams unpermute_params{.expert_out = in,
                                   .topk_weights = weights,
                                   .inverse = index,
                                   .out = wide,
                                   .num_tokens = 1,
                                   .top_k = 0,
                                   .hidden_size = 8};
  expect_error_naming([&] { unpermute(unpermute_params, nullptr); }, "top_k = 0");
  unpermute_params.top_k = 2;
  unpermute_params.inverse = nullptr;
  expect_error_naming([&] { unpermute(unpermute_params, nullptr); }, "inverse is null");
  RmsNormParams norm_params{
      .x = wide, .weight = in, .out = out, .num_rows = 1, .hidden_size = 44};
  expect_error_naming([&] { fused_add_rms_norm(norm_params, nullptr); }, "hidden_size = 44");
  norm_params.hidden_size = 8;
  norm_params.residual = wide + 1;
  expect_error_naming([&] { fused_add_rms_norm(norm_params, nullptr); }, "residual (");
  norm_params.x = nullptr;
  norm_params.residual = nullptr;
  expect_error_naming([&] { fused_add_rms_norm(norm_params, nullptr); }, "both null");
}

// ---------------------------------------------------------------------------------------------
// Kernel tests: registered only when a device is present (see the file comment).

using testing_util::DeviceBuffer;
using testing_util::fresh_seed;
using testing_util::random_bf16;
using testing_util::expect_within;
using testing_util::synchronize;
using testing_util::to_float;

// Exact comparison of integer arrays, reporting the first mismatches.
void expect_equal_ints(const std::vector<int32_t>& got, const std::vector<int32_t>& want,
                       const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int reported = 0;
  size_t mismatches = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      ++mismatches;
      if (reported++ < 5)
        ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", want " << want[i];
    }
  }
  EXPECT_EQ(mismatches, 0u) << what;
}

// bf16 results against a float reference: |got - want| <= 2^-8 |want| + 1e-5 scale[i].
void expect_bf16_close(const std::vector<uint16_t>& got, const std::vector<float>& want,
                       const std::vector<float>& scale, const char* what) {
  expect_within(
      to_float(got), want,
      [&](size_t i) { return std::ldexp(std::fabs(want[i]), -8) + 1e-5f * scale[i] + 1e-30f; },
      what);
}

// float32 outputs summed in float32 in the reference's order: within a few ulps of the sum of
// magnitudes (fmaf against a separate multiply and add).
void expect_float_close(const std::vector<float>& got, const std::vector<float>& want,
                        const std::vector<float>& scale, const char* what) {
  expect_within(got, want, [&](size_t i) { return 1e-6f * scale[i] + 1e-30f; }, what);
}

// Router logits on a grid of 1/64 in [-4, 4]: exact ties are common (E = 256 draws from 513
// values), and unequal logits are far enough apart that the CPU's and the GPU's expf cannot
// order their scores differently.
std::vector<float> grid_logits(int64_t n, std::mt19937& rng) {
  std::uniform_int_distribution<int> dist(-256, 256);
  std::vector<float> out(n);
  for (auto& v : out) v = static_cast<float>(dist(rng)) / 64.0f;
  return out;
}

struct RouterCase {
  moe::ScoreFunction score;
  bool renormalize;
  float scaling;
};

void check_router(const std::vector<float>& logits, int64_t T, int64_t E, int64_t K,
                  const RouterCase& c) {
  SCOPED_TRACE(::testing::Message()
               << "T=" << T << " E=" << E << " K=" << K << " "
               << (c.score == moe::ScoreFunction::kSoftmax ? "softmax" : "sigmoid")
               << " renormalize=" << c.renormalize << " scaling=" << c.scaling);
  moe::Routing want;
  moe::route(logits.data(), T,
             moe::RouterOptions{.num_experts = E,
                                .top_k = K,
                                .score = c.score,
                                .renormalize = c.renormalize,
                                .routed_scaling_factor = c.scaling},
             &want);

  DeviceBuffer<float> d_logits(logits);
  DeviceBuffer<int32_t> d_ids(T * K);
  DeviceBuffer<float> d_weights(T * K);
  d_ids.poison();
  d_weights.poison();
  fused_router(
      RouterParams{.logits = d_logits.get(),
                   .topk_ids = d_ids.get(),
                   .topk_weights = d_weights.get(),
                   .num_tokens = T,
                   .num_experts = E,
                   .top_k = K,
                   .score = c.score == moe::ScoreFunction::kSoftmax ? RouterScore::kSoftmax
                                                                    : RouterScore::kSigmoid,
                   .renormalize = c.renormalize,
                   .routed_scaling_factor = c.scaling},
      nullptr);
  synchronize();
  expect_equal_ints(d_ids.download(), want.topk_ids, "topk_ids");
  const std::vector<float> weights = d_weights.download();
  size_t mismatches = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const float w = want.topk_weights[i];
    if (!(std::fabs(weights[i] - w) <= 1e-5f * std::fabs(w) + 1e-30f)) {
      if (mismatches++ < 5)
        ADD_FAILURE() << "topk_weights[" << i << "] = " << weights[i] << ", want " << w;
    }
  }
  EXPECT_EQ(mismatches, 0u) << "topk_weights";
}

const int64_t kTokenCounts[] = {1, 19, 99, 989, 4096};
const int64_t kExpertCounts[] = {8, 60, 128, 256};
const int64_t kTopKs[] = {1, 2, 8};

void router_random(int64_t T) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(T));
  const RouterCase cases[] = {{moe::ScoreFunction::kSoftmax, true, 1.0f},
                              {moe::ScoreFunction::kSoftmax, false, 1.0f},
                              {moe::ScoreFunction::kSigmoid, true, 2.5f}};
  for (int64_t E : kExpertCounts)
    for (int64_t K : kTopKs)
      for (const RouterCase& c : cases) check_router(grid_logits(T * E, rng), T, E, K, c);
}

// Ties on purpose: every logit equal (picks 0..K-1), a block of equal maxima, and softmax
// scores that underflow to exactly 0 (one logit 200 above the rest: the other K-1 picks are
// the lowest ids among the zeros), at the largest supported K as well.
void router_ties() {
  std::mt19937 rng(fresh_seed());
  for (int64_t E : kExpertCounts) {
    for (int64_t K : {int64_t{1}, int64_t{2}, int64_t{8}, std::min<int64_t>(16, E)}) {
      const int64_t T = 7;
      std::vector<float> logits(T * E, 0.5f);  // token 0: all equal
      for (int64_t e = 0; e < E; ++e) {
        logits[1 * E + e] = (e % 5 == 3) ? 2.0f : -1.0f;  // token 1: equal maxima at 3, 8, ...
        logits[2 * E + e] = 0.0f;                         // token 2: underflow ties
        logits[3 * E + e] = e >= E - 2 ? 3.0f : 0.0f;     // token 3: equal maxima at the top ids
        logits[4 * E + e] = static_cast<float>(E - e) / 64.0f;  // strictly decreasing
        logits[5 * E + e] = static_cast<float>(e / 3) / 64.0f;  // triples of equal values
      }
      logits[2 * E + (E - 1)] = 200.0f;
      const std::vector<float> tail = grid_logits(E, rng);
      std::copy(tail.begin(), tail.end(), logits.begin() + 6 * E);
      for (const RouterCase& c : {RouterCase{moe::ScoreFunction::kSoftmax, true, 1.0f},
                                  RouterCase{moe::ScoreFunction::kSoftmax, false, 1.0f},
                                  RouterCase{moe::ScoreFunction::kSigmoid, false, 16.0f}})
        check_router(logits, T, E, K, c);
    }
  }
}

// Expert ids for the plan: uniform, skewed towards a few experts (many empty), all on one
// expert, and only even experts. Each token's K ids are distinct when K <= E allows.
std::vector<int32_t> random_ids(int64_t T, int64_t E, int64_t K, int pattern, std::mt19937& rng) {
  std::vector<int32_t> ids(T * K);
  std::vector<int32_t> pool(E);
  std::iota(pool.begin(), pool.end(), 0);
  std::geometric_distribution<int32_t> skewed(0.3);
  for (int64_t t = 0; t < T; ++t) {
    switch (pattern) {
      case 0:  // K distinct: the first K steps of a Fisher-Yates shuffle (E may be a million)
        for (int64_t k = 0; k < K; ++k) {
          std::swap(pool[k], pool[k + static_cast<int64_t>(rng() % (E - k))]);
          ids[t * K + k] = pool[k];
        }
        break;
      case 1:
        for (int64_t k = 0; k < K; ++k) ids[t * K + k] = std::min<int32_t>(skewed(rng), E - 1);
        break;
      case 2:
        for (int64_t k = 0; k < K; ++k) ids[t * K + k] = static_cast<int32_t>(E / 2);
        break;
      default:
        for (int64_t k = 0; k < K; ++k)
          ids[t * K + k] = 2 * static_cast<int32_t>(rng() % ((E + 1) / 2));
        break;
    }
  }
  return ids;
}

moe::Routing routing_of(const std::vector<int32_t>& ids, int64_t T, int64_t K) {
  moe::Routing routing;
  routing.num_tokens = T;
  routing.top_k = K;
  routing.topk_ids = ids;
  routing.topk_weights.assign(ids.size(), 0.0f);
  return routing;
}

struct DevicePlan {
  DeviceBuffer<int32_t> counts, offsets, src_row, inverse, workspace;
  int64_t num_assignments, num_experts;
  DevicePlan(int64_t N, int64_t E)
      : counts(E),
        offsets(E + 1),
        src_row(N),
        inverse(N),
        workspace(plan_workspace_size(N, E)),
        num_assignments(N),
        num_experts(E) {}
  void poison() {
    counts.poison();
    offsets.poison();
    src_row.poison();
    inverse.poison();
    workspace.poison();
  }
  PlanParams params(const int32_t* ids) const {
    return PlanParams{.topk_ids = ids,
                      .expert_counts = counts.get(),
                      .expert_offsets = offsets.get(),
                      .src_row = src_row.get(),
                      .inverse = inverse.get(),
                      .workspace = workspace.get(),
                      .num_assignments = num_assignments,
                      .num_experts = num_experts};
  }
};

void check_plan(const std::vector<int32_t>& ids, int64_t T, int64_t E, int64_t K) {
  const int64_t N = T * K;
  moe::DispatchPlan want;
  moe::plan(routing_of(ids, T, K), E, &want);
  DeviceBuffer<int32_t> d_ids(ids);
  DevicePlan plan(N, E);
  plan.poison();
  moe_plan(plan.params(d_ids.get()), nullptr);
  synchronize();
  expect_equal_ints(plan.counts.download(), want.expert_counts, "expert_counts");
  expect_equal_ints(plan.offsets.download(), want.expert_offsets, "expert_offsets");
  expect_equal_ints(plan.src_row.download(), want.src_row, "src_row");
  expect_equal_ints(plan.inverse.download(), want.inverse, "inverse");
}

void plan_random(int64_t T) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(T * 7919));
  for (int64_t E : kExpertCounts)
    for (int64_t K : kTopKs)
      for (int pattern = 0; pattern < 4; ++pattern) {
        SCOPED_TRACE(::testing::Message()
                     << "T=" << T << " E=" << E << " K=" << K << " pattern=" << pattern);
        check_plan(random_ids(T, E, K, pattern, rng), T, E, K);
      }
  // Many experts: fewer warps so the per-warp histograms fit in shared memory.
  for (int64_t E : {int64_t{1}, int64_t{1000}, int64_t{5000}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << T << " E=" << E << " K=2");
    check_plan(random_ids(T, E, std::min<int64_t>(2, E), 0, rng), T, E, std::min<int64_t>(2, E));
  }
}

// Past the shared-memory plan: its largest E (one warp's histogram), one more, a few thousand
// more, many more experts than assignments (most of them empty), and at T = 4096 a million,
// where the workspace cap leaves 16 blocks of 16384 assignments.
void plan_large(int64_t T) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(T * 6151));
  std::vector<int64_t> expert_counts = {kPlanMaxSharedExperts, kPlanMaxSharedExperts + 1, 9000,
                                        70000};
  if (T == 4096) expert_counts.push_back(1000000);
  for (int64_t E : expert_counts)
    for (int64_t K : {int64_t{1}, int64_t{8}, int64_t{64}})
      for (int pattern = 0; pattern < 4; ++pattern) {
        if (E == 1000000 && pattern > 1) continue;  // the one-expert patterns add nothing there
        SCOPED_TRACE(::testing::Message()
                     << "T=" << T << " E=" << E << " K=" << K << " pattern=" << pattern);
        check_plan(random_ids(T, E, K, pattern, rng), T, E, K);
      }
}

// Hidden sizes per token count: realistic ones everywhere, tiny and odd multiples of 8 where
// the host reference stays cheap.
std::vector<int64_t> hidden_sizes_for(int64_t T) {
  if (T <= 99) return {8, 136, 2048, 7168};
  if (T <= 989) return {136, 2048};
  return {1024};
}

void permute_case(int64_t T, int64_t H, int64_t K, int64_t E, std::mt19937& rng) {
  SCOPED_TRACE(::testing::Message() << "T=" << T << " H=" << H << " K=" << K);
  const std::vector<int32_t> ids = random_ids(T, E, K, 1, rng);
  const moe::Routing routing = routing_of(ids, T, K);
  moe::DispatchPlan plan;
  moe::plan(routing, E, &plan);
  const std::vector<uint16_t> hidden = random_bf16(T * H, rng);
  std::vector<float> want(T * K * H);
  moe::dispatch(to_float(hidden).data(), H, routing, plan, want.data());

  DeviceBuffer<uint16_t> d_hidden(hidden);
  DeviceBuffer<int32_t> d_inverse(plan.inverse);
  DeviceBuffer<uint16_t> d_rows(T * K * H);
  d_rows.poison();
  permute(PermuteParams{.hidden = d_hidden.as_bf16(),
                        .inverse = d_inverse.get(),
                        .rows = d_rows.as_bf16(),
                        .num_tokens = T,
                        .top_k = K,
                        .hidden_size = H},
          nullptr);
  synchronize();
  const std::vector<float> got = to_float(d_rows.download());
  size_t mismatches = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    // A copy: bit-exact, and NaN (an unwritten poisoned element) never compares equal.
    if (!(got[i] == want[i]) && mismatches++ < 5)
      ADD_FAILURE() << "rows[" << i << "] = " << got[i] << ", want " << want[i];
  }
  EXPECT_EQ(mismatches, 0u);
}

void permute_random(int64_t T) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(T * 104729));
  for (int64_t H : hidden_sizes_for(T))
    for (int64_t K : kTopKs) permute_case(T, H, K, 60, rng);
}

// More picks than the one-warp router gives (K > 32), over E = 128.
void permute_many_picks(int64_t T) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(T * 7727));
  for (int64_t H : hidden_sizes_for(T))
    for (int64_t K : {int64_t{33}, int64_t{64}, int64_t{100}}) permute_case(T, H, K, 128, rng);
}

// variant cycles through the optional inputs: none, shared, residual, both.
void unpermute_case(int64_t T, int64_t H, int64_t K, int variant, std::mt19937& rng) {
  std::uniform_real_distribution<float> weight_dist(-1.0f, 1.0f);
  const bool with_shared = (variant & 1) != 0;
  const bool with_residual = (variant & 2) != 0;
  const int64_t E = 128;
  SCOPED_TRACE(::testing::Message() << "T=" << T << " H=" << H << " K=" << K
                                    << " shared=" << with_shared << " residual=" << with_residual);
  moe::Routing routing = routing_of(random_ids(T, E, K, 0, rng), T, K);
  for (auto& w : routing.topk_weights) w = weight_dist(rng);
  // Every seventh assignment weighs 0, as the padding rows of a graph bucket do: its row
  // must not be read, so on the device it holds NaN (the reference sees the clean row).
  for (size_t i = 3; i < routing.topk_weights.size(); i += 7) routing.topk_weights[i] = 0.0f;
  moe::DispatchPlan plan;
  moe::plan(routing, E, &plan);
  const std::vector<uint16_t> expert_out = random_bf16(T * K * H, rng);
  std::vector<uint16_t> expert_out_on_device = expert_out;
  for (size_t i = 3; i < routing.topk_weights.size(); i += 7) {
    std::fill_n(expert_out_on_device.begin() + plan.inverse[i] * H, H, uint16_t{0xFFFF});
  }
  const std::vector<uint16_t> shared =
      with_shared ? random_bf16(T * H, rng, 0.5f) : std::vector<uint16_t>{};
  const std::vector<float> residual =
      with_residual ? to_float(random_bf16(T * H, rng, 2.0f)) : std::vector<float>{};

  const std::vector<float> expert_out_f = to_float(expert_out);
  const std::vector<float> shared_f = to_float(shared);
  std::vector<float> want(T * H);
  moe::unpermute(expert_out_f.data(), H, routing, plan, with_shared ? shared_f.data() : nullptr,
                 want.data());
  std::vector<float> scale(T * H, 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float s = with_shared ? std::fabs(shared_f[t * H + h]) : 0.0f;
      for (int64_t k = 0; k < K; ++k)
        s += std::fabs(routing.topk_weights[t * K + k] *
                       expert_out_f[plan.inverse[t * K + k] * H + h]);
      if (with_residual) {
        const float r = residual[t * H + h];
        want[t * H + h] += r;
        s += std::fabs(r);
      }
      scale[t * H + h] = s;
    }

  DeviceBuffer<uint16_t> d_expert_out(expert_out_on_device);
  DeviceBuffer<float> d_weights(routing.topk_weights);
  DeviceBuffer<int32_t> d_inverse(plan.inverse);
  DeviceBuffer<uint16_t> d_shared(shared);
  DeviceBuffer<float> d_residual(residual);
  DeviceBuffer<float> d_out(T * H);
  d_out.poison();
  unpermute(UnpermuteParams{.expert_out = d_expert_out.as_bf16(),
                            .topk_weights = d_weights.get(),
                            .inverse = d_inverse.get(),
                            .shared = with_shared ? d_shared.as_bf16() : nullptr,
                            .residual = with_residual ? d_residual.get() : nullptr,
                            .out = d_out.get(),
                            .num_tokens = T,
                            .top_k = K,
                            .hidden_size = H},
            nullptr);
  synchronize();
  expect_float_close(d_out.download(), want, scale, "out");
}

void unpermute_random(int64_t T) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(T * 15485863));
  int variant = 0;
  for (int64_t H : hidden_sizes_for(T))
    for (int64_t K : kTopKs) unpermute_case(T, H, K, variant++, rng);
}

// More picks than the one-warp router gives (K > 32, up to 100 of E = 128).
void unpermute_many_picks(int64_t T) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(T * 2654435761u));
  int variant = 0;
  for (int64_t H : hidden_sizes_for(T))
    for (int64_t K : {int64_t{33}, int64_t{64}, int64_t{100}})
      unpermute_case(T, H, K, variant++, rng);
}

// Which optional inputs of the fused norm a case gives.
struct NormInputs {
  bool x = true, residual = true, residual_out = true, bias = false;
  bool weight_lo = false;  // a second weight term of its own random values (added to weight)
};

// float64 reference of the fused norm, from the float32 sum the kernel forms in the same order
// (x, then the residual, then the bias), which residual_out must hold exactly.
void rms_norm_case(int64_t T, int64_t H, NormInputs in, std::mt19937& rng) {
  SCOPED_TRACE(::testing::Message() << "T=" << T << " H=" << H << " x=" << in.x << " residual="
                                    << in.residual << " residual_out=" << in.residual_out
                                    << " bias=" << in.bias << " weight_lo=" << in.weight_lo);
  const float eps = 1e-6f;
  std::normal_distribution<float> normal(0.0f, 3.0f);
  auto random_floats = [&](bool given, int64_t n) {
    std::vector<float> v(given ? n : 0);
    for (float& f : v) f = normal(rng);
    return v;
  };
  const std::vector<float> x = random_floats(in.x, T * H);
  const std::vector<float> residual = random_floats(in.residual, T * H);
  const std::vector<uint16_t> bias = in.bias ? random_bf16(H, rng, 0.5f) : std::vector<uint16_t>{};
  const std::vector<uint16_t> weight = random_bf16(H, rng, 1.0f);
  const std::vector<uint16_t> weight_lo =
      in.weight_lo ? random_bf16(H, rng, 1.0f) : std::vector<uint16_t>{};
  auto weight_at = [&](int64_t h) {
    return static_cast<double>(bf16_to_f32(weight[h])) +
           (in.weight_lo ? static_cast<double>(bf16_to_f32(weight_lo[h])) : 0.0);
  };
  std::vector<float> want_sum(T * H), want(T * H), scale(T * H);
  for (int64_t t = 0; t < T; ++t) {
    double sum_sq = 0.0;
    for (int64_t h = 0; h < H; ++h) {
      float s = in.x ? x[t * H + h] : 0.0f;
      if (in.residual) s += residual[t * H + h];
      if (in.bias) s += bf16_to_f32(bias[h]);
      want_sum[t * H + h] = s;
      sum_sq += static_cast<double>(s) * s;
    }
    const double inv_rms = 1.0 / std::sqrt(sum_sq / static_cast<double>(H) + eps);
    for (int64_t h = 0; h < H; ++h) {
      const double v = weight_at(h) * want_sum[t * H + h] * inv_rms;
      want[t * H + h] = static_cast<float>(v);
      scale[t * H + h] = static_cast<float>(std::fabs(v));
    }
  }
  DeviceBuffer<float> d_x(x), d_residual(residual), d_residual_out(T * H);
  DeviceBuffer<uint16_t> d_bias(bias), d_weight(weight), d_weight_lo(weight_lo), d_out(T * H);
  d_out.poison();
  d_residual_out.poison();
  fused_add_rms_norm(RmsNormParams{.x = in.x ? d_x.get() : nullptr,
                                   .x_bias = in.bias ? d_bias.as_bf16() : nullptr,
                                   .residual = in.residual ? d_residual.get() : nullptr,
                                   .residual_out = in.residual_out ? d_residual_out.get() : nullptr,
                                   .weight = d_weight.as_bf16(),
                                   .weight_lo = in.weight_lo ? d_weight_lo.as_bf16() : nullptr,
                                   .out = d_out.as_bf16(),
                                   .num_rows = T,
                                   .hidden_size = H,
                                   .eps = eps},
                     nullptr);
  synchronize();
  expect_bf16_close(d_out.download(), want, scale, "out");
  if (in.residual_out) {
    const std::vector<float> got_sum = d_residual_out.download();
    size_t mismatches = 0;
    for (size_t i = 0; i < got_sum.size(); ++i)
      if (got_sum[i] != want_sum[i] && mismatches++ < 5)
        ADD_FAILURE() << "residual_out[" << i << "] = " << got_sum[i] << ", want " << want_sum[i];
    EXPECT_EQ(mismatches, 0u) << "residual_out";
  }
}

void rms_norm_random(int64_t T) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(T * 32452843));
  const std::vector<int64_t> sizes =
      T <= 99 ? std::vector<int64_t>{8, 136, 2048, 7168, 8200, 16384, 32768, 32776, 40000, 65536}
              : std::vector<int64_t>{136, 2048, 4096};
  // Cycle through the decoder's uses and the corners: an attention output with its bias joining
  // the stream, a block output without residual_out (the final norm), the first layer's norm of
  // the embedded stream alone, a block output alone.
  // Each with and without a second weight term (a float32 checkpoint's norm as hi + lo).
  const NormInputs variants[] = {
      {.bias = true},
      {.residual_out = false, .weight_lo = true},
      {.x = false, .residual_out = false},
      {.residual = false, .weight_lo = true},
      {.bias = true, .weight_lo = true},
      {.residual_out = false},
      {.x = false, .residual_out = false, .weight_lo = true},
      {.residual = false},
  };
  int variant = 0;
  for (int64_t H : sizes) rms_norm_case(T, H, variants[variant++ % 8], rng);
}

// In-place use, as the decoder calls it: residual_out == residual (at H past the register
// kernel's rows too, where the second pass reads the sum back from residual_out).
void rms_norm_in_place(int64_t H) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(H));
  const int64_t T = 19;
  const std::vector<float> x = to_float(random_bf16(T * H, rng, 3.0f));
  const std::vector<float> residual = to_float(random_bf16(T * H, rng, 3.0f));
  const std::vector<uint16_t> weight = random_bf16(H, rng, 1.0f);
  DeviceBuffer<float> d_x(x), d_residual(residual), d_sum(T * H);
  DeviceBuffer<uint16_t> d_weight(weight), d_out(T * H), d_out_in_place(T * H);
  fused_add_rms_norm(RmsNormParams{.x = d_x.get(),
                                   .residual = d_residual.get(),
                                   .residual_out = d_sum.get(),
                                   .weight = d_weight.as_bf16(),
                                   .out = d_out.as_bf16(),
                                   .num_rows = T,
                                   .hidden_size = H},
                     nullptr);
  fused_add_rms_norm(RmsNormParams{.x = d_x.get(),
                                   .residual = d_residual.get(),
                                   .residual_out = d_residual.get(),
                                   .weight = d_weight.as_bf16(),
                                   .out = d_out_in_place.as_bf16(),
                                   .num_rows = T,
                                   .hidden_size = H},
                     nullptr);
  synchronize();
  EXPECT_EQ(d_out.download(), d_out_in_place.download());
  EXPECT_EQ(d_residual.download(), d_sum.download());
}

// The four GPU stages chained (route -> plan -> permute -> unpermute with the expert as the
// identity) against the CPU stages chained: ids and plan exact, output within bf16 bounds.
// in_graph: the chain is captured into a CUDA graph in global capture mode, which fails on any
// call that would synchronise with the host, then replayed: the stages need no host round trip.
void pipeline_case(int64_t T, bool in_graph, int64_t E, int64_t K, int64_t H, std::mt19937& rng) {
  SCOPED_TRACE(::testing::Message() << "T=" << T << " E=" << E << " K=" << K);
  const std::vector<float> logits = grid_logits(T * E, rng);
  const std::vector<uint16_t> hidden = random_bf16(T * H, rng);
  moe::Routing routing;
  moe::route(logits.data(), T,
             moe::RouterOptions{.num_experts = E, .top_k = K, .renormalize = true}, &routing);
  moe::DispatchPlan plan;
  moe::plan(routing, E, &plan);
  const std::vector<float> hidden_f = to_float(hidden);
  std::vector<float> rows(T * K * H), want(T * H);
  moe::dispatch(hidden_f.data(), H, routing, plan, rows.data());
  moe::unpermute(rows.data(), H, routing, plan, nullptr, want.data());
  std::vector<float> scale(T * H);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) scale[t * H + h] = std::fabs(hidden_f[t * H + h]);

  DeviceBuffer<float> d_logits(logits);
  DeviceBuffer<uint16_t> d_hidden(hidden);
  DeviceBuffer<int32_t> d_ids(T * K);
  DeviceBuffer<float> d_weights(T * K);
  DevicePlan d_plan(T * K, E);
  DeviceBuffer<uint16_t> d_rows(T * K * H);
  DeviceBuffer<float> d_out(T * H);
  d_ids.poison();
  d_weights.poison();
  d_plan.poison();
  d_rows.poison();
  d_out.poison();
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  if (in_graph) CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  fused_router(RouterParams{.logits = d_logits.get(),
                            .topk_ids = d_ids.get(),
                            .topk_weights = d_weights.get(),
                            .num_tokens = T,
                            .num_experts = E,
                            .top_k = K,
                            .renormalize = true},
               stream);
  moe_plan(d_plan.params(d_ids.get()), stream);
  permute(PermuteParams{.hidden = d_hidden.as_bf16(),
                        .inverse = d_plan.inverse.get(),
                        .rows = d_rows.as_bf16(),
                        .num_tokens = T,
                        .top_k = K,
                        .hidden_size = H},
          stream);
  unpermute(UnpermuteParams{.expert_out = d_rows.as_bf16(),
                            .topk_weights = d_weights.get(),
                            .inverse = d_plan.inverse.get(),
                            .out = d_out.get(),
                            .num_tokens = T,
                            .top_k = K,
                            .hidden_size = H},
            stream);
  if (in_graph) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  CUDA_CHECK(cudaStreamDestroy(stream));
  expect_equal_ints(d_ids.download(), routing.topk_ids, "topk_ids");
  expect_equal_ints(d_plan.counts.download(), plan.expert_counts, "expert_counts");
  expect_equal_ints(d_plan.offsets.download(), plan.expert_offsets, "expert_offsets");
  expect_equal_ints(d_plan.src_row.download(), plan.src_row, "src_row");
  expect_equal_ints(d_plan.inverse.download(), plan.inverse, "inverse");
  // The GPU router's weights differ from the CPU's by their own rounding (expf and the
  // renormalising division, a few ulps each) and K of them are summed in float32, so the bound
  // grows with K: (K + 8) ulps of the scale, at least expect_float_close's 1e-6.
  const float ulps = std::max(1e-6f, static_cast<float>(K + 8) * 0x1p-24f);
  expect_within(d_out.download(), want, [&](size_t i) { return ulps * scale[i] + 1e-30f; },
                "out");
}

void pipeline(int64_t T, bool in_graph) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(T * 49979687));
  for (int64_t E : {int64_t{60}, int64_t{128}, int64_t{256}})
    pipeline_case(T, in_graph, E, 8, 2048, rng);
}

// Past every fast path at once: the block router (E > 1024, K > 32), the plan's histograms in
// the workspace (E > kPlanMaxSharedExperts), permute and unpermute at K = 40.
void pipeline_large(int64_t T, bool in_graph) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(T * 1299709));
  pipeline_case(T, in_graph, 9000, 40, 256, rng);
}

void register_kernel_test(const char* suite, const std::string& name, std::function<void()> body) {
  testing_util::register_kernel_test(suite, name, std::move(body), __FILE__, __LINE__);
}

// Runs before gtest_main's main(): registers the kernel tests when, and only when, a CUDA
// device is visible to this process.
[[maybe_unused]] const bool kKernelTestsRegistered = [] {
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::fprintf(stderr,
                 "test_cuda: no CUDA device (%s); the CUDA kernel tests are not registered, "
                 "only the host-side launcher checks run here (scripts/gpu-check.sh runs the "
                 "kernel tests on a GPU machine)\n",
                 status != cudaSuccess ? cudaGetErrorString(status) : "0 devices");
    cudaGetLastError();  // clear the error so that no later call reports it
    return false;
  }
  for (int64_t T : kTokenCounts) {
    const std::string suffix = "T" + std::to_string(T);
    register_kernel_test("CudaRouter", "RandomLogits_" + suffix, [T] { router_random(T); });
    register_kernel_test("CudaPlan", "RandomAssignments_" + suffix, [T] { plan_random(T); });
    register_kernel_test("CudaPermute", "MatchesDispatch_" + suffix, [T] { permute_random(T); });
    register_kernel_test("CudaUnpermute", "MatchesReference_" + suffix,
                         [T] { unpermute_random(T); });
    register_kernel_test("CudaRmsNorm", "MatchesFloat64_" + suffix, [T] { rms_norm_random(T); });
    register_kernel_test("CudaPlan", "LargeExperts_" + suffix, [T] { plan_large(T); });
    if (T <= 989) {
      register_kernel_test("CudaPermute", "ManyPicks_" + suffix, [T] { permute_many_picks(T); });
      register_kernel_test("CudaUnpermute", "ManyPicks_" + suffix,
                           [T] { unpermute_many_picks(T); });
    }
  }
  register_kernel_test("CudaPlan", "LargeExperts_T0", [] { plan_large(0); });
  register_kernel_test("CudaRouter", "TiesGoToLowerId", [] { router_ties(); });
  register_kernel_test("CudaRmsNorm", "InPlaceMatchesOutOfPlace", [] { rms_norm_in_place(2048); });
  register_kernel_test("CudaRmsNorm", "InPlaceMatchesOutOfPlaceLongRows",
                       [] { rms_norm_in_place(40000); });
  for (int64_t T : {int64_t{19}, int64_t{989}}) {
    register_kernel_test("CudaPipeline", "RouteToUnpermute_T" + std::to_string(T),
                         [T] { pipeline(T, false); });
    register_kernel_test("CudaPipeline", "CapturedInGraph_T" + std::to_string(T),
                         [T] { pipeline(T, true); });
    register_kernel_test("CudaPipeline", "E9000_K40_RouteToUnpermute_T" + std::to_string(T),
                         [T] { pipeline_large(T, false); });
  }
  register_kernel_test("CudaPipeline", "E9000_K40_CapturedInGraph_T19",
                       [] { pipeline_large(19, true); });
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
