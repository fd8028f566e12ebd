// The fused route-and-plan kernel (backend/cuda/route_plan.h) against the stage kernels it
// replaces. Its logits are held to float64 dot products of the same bf16 rows (1e-5 of the sum of
// the terms' magnitudes: float32 sums of up to 7168 terms in another order); its picks, weights
// and plan must then equal, bit for bit, what fused_router and moe_plan make of those very logits
// (the same per-token routing functions and the same sort run inside it). Outputs are poisoned
// first (NaN logits and weights, -1 ids and rows) so that an unwritten element fails.
//
// Cases: Qwen3-30B-A3B's router at T = 1, 4, 16 and 64; OLMoE, Mixtral and DeepSeek-V2-Lite
// shapes; DeepSeek-V3's grouped sigmoid routing with a selection bias (the general router and its
// shared-memory scratch); GPT-OSS's logit bias with the top-k softmax; an E that leaves idle warps
// (60); the largest sizes it takes (E = 1024, K = 32, T*K = 1024); padding tokens past
// num_valid_tokens (the null expert, no logits); the synthetic models' Zipf noise router, which
// does not read the logits. One case replays a captured graph with new inputs, which also checks
// that each launch leaves its ticket at zero for the next.
//
// Host-side checks (the launcher refusing sizes it does not take, naming them) need no device and
// always run; the kernel tests are registered only when a device is present (cuda_test_util.h).
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/moe_stages.h"
#include "backend/cuda/route_plan.h"
#include "cuda_test_util.h"

namespace moeinfer::cuda {
namespace {

using namespace testing_util;

// ---------------------------------------------------------------------------------------------
// Host-side checks: always registered, need no device.

RoutePlanParams host_params(int64_t T, int64_t E, int64_t K, int64_t H) {
  static float logits = 0.0f, weights = 0.0f;
  static int32_t ids = 0, counts = 0, offsets = 0, src = 0, inverse = 0, ticket = 0;
  alignas(16) static uint16_t rows[8] = {};
  return {.hidden = reinterpret_cast<const bf16*>(rows),
          .router = reinterpret_cast<const bf16*>(rows),
          .hidden_size = H,
          .route = {.logits = &logits,
                    .topk_ids = &ids,
                    .topk_weights = &weights,
                    .num_tokens = T,
                    .num_experts = E,
                    .top_k = K},
          .plan = {.expert_counts = &counts,
                   .expert_offsets = &offsets,
                   .src_row = &src,
                   .inverse = &inverse},
          .ticket = &ticket};
}

TEST(CudaRoutePlanChecks, RefusesSizesItDoesNotTake) {
  EXPECT_TRUE(route_plan_supports(64, 128, 8, 2048));
  EXPECT_TRUE(route_plan_supports(32, 1024, 32, 8));
  EXPECT_FALSE(route_plan_supports(65, 128, 8, 2048));  // T
  EXPECT_FALSE(route_plan_supports(33, 1024, 32, 64));  // T*K
  EXPECT_FALSE(route_plan_supports(1, 1025, 8, 2048));  // E past the one-warp router
  EXPECT_FALSE(route_plan_supports(1, 128, 33, 2048));  // K
  EXPECT_FALSE(route_plan_supports(1, 128, 8, 2044));   // H not a multiple of 8
  EXPECT_FALSE(route_plan_supports(1, 4, 8, 2048));     // K > E
  expect_error_naming([] { moe_route_plan(host_params(65, 128, 8, 2048), nullptr); }, "T = 65");
  expect_error_naming([] { moe_route_plan(host_params(1, 128, 8, 2044), nullptr); },
                      "hidden_size = 2044");
  expect_error_naming([] { moe_route_plan(host_params(1, 128, 0, 2048), nullptr); }, "top_k");
  RoutePlanParams no_ticket = host_params(1, 128, 8, 2048);
  no_ticket.ticket = nullptr;
  expect_error_naming([&] { moe_route_plan(no_ticket, nullptr); }, "ticket");
}

// ---------------------------------------------------------------------------------------------
// Kernel tests: registered only when a device is present.

struct Case {
  const char* name;
  int64_t tokens, experts, top_k, hidden;
  RouterScore score = RouterScore::kSoftmax;
  bool renormalize = true;
  float scaling = 1.0f;
  RouterGroupScore group_score = RouterGroupScore::kNone;
  int64_t num_groups = 1, topk_groups = 1;
  bool selection_bias = false;
  bool logit_bias = false;
  bool noise = false;      // the synthetic router's keys (with logit_bias: Zipf-like Gumbel noise)
  int64_t num_valid = -1;  // < tokens: the rest pad a graph bucket
};

// The device buffers of one case, its random inputs uploaded.
struct Buffers {
  Buffers(const Case& c, std::mt19937& rng)
      : T(c.tokens),
        E(c.experts),
        K(c.top_k),
        H(c.hidden),
        hidden(random_bf16(static_cast<size_t>(T * H), rng)),
        router(random_bf16(static_cast<size_t>(E * H), rng, 0.03f)),
        d_hidden(hidden),
        d_router(router),
        logits(T * E),
        ids(T * K),
        weights(T * K),
        counts(E + 1),
        offsets(E + 2),
        src_row(T * K),
        inverse(T * K),
        ticket(std::vector<int32_t>{0}),
        num_valid(std::vector<int32_t>{static_cast<int32_t>(c.num_valid < 0 ? T : c.num_valid)}) {
    std::normal_distribution<float> bias(0.0f, 0.5f);
    std::vector<float> values(static_cast<size_t>(E));
    for (float& v : values) v = bias(rng);
    selection_bias.emplace(values);
    for (float& v : values) v = bias(rng);
    logit_bias.emplace(values);
    std::vector<int32_t> keys(static_cast<size_t>(T));
    for (int32_t& k : keys) k = static_cast<int32_t>(rng() & 0x7fffffff);
    noise_keys.emplace(keys);
  }

  RoutePlanParams params(const Case& c) {
    RouterParams route{.logits = logits.get(),
                       .topk_ids = ids.get(),
                       .topk_weights = weights.get(),
                       .num_tokens = T,
                       .num_experts = E,
                       .top_k = K,
                       .score = c.score,
                       .renormalize = c.renormalize,
                       .routed_scaling_factor = c.scaling};
    route.group_score = c.group_score;
    route.num_groups = c.num_groups;
    route.topk_groups = c.topk_groups;
    if (c.selection_bias) route.selection_bias = selection_bias->get();
    if (c.logit_bias) route.logit_bias = logit_bias->get();
    if (c.noise) {
      route.noise_keys = noise_keys->get();
      route.noise_seed = 0x5eed;
    }
    if (c.num_valid >= 0) route.num_valid_tokens = num_valid.get();
    return {.hidden = d_hidden.as_bf16(),
            .router = d_router.as_bf16(),
            .hidden_size = H,
            .route = route,
            .plan = {.expert_counts = counts.get(),
                     .expert_offsets = offsets.get(),
                     .src_row = src_row.get(),
                     .inverse = inverse.get()},
            .ticket = ticket.get()};
  }

  void poison() {
    logits.poison();
    ids.poison();
    weights.poison();
    counts.poison();
    offsets.poison();
    src_row.poison();
    inverse.poison();
  }

  int64_t T, E, K, H;
  std::vector<uint16_t> hidden, router;
  DeviceBuffer<uint16_t> d_hidden, d_router;
  DeviceBuffer<float> logits;
  DeviceBuffer<int32_t> ids;
  DeviceBuffer<float> weights;
  DeviceBuffer<int32_t> counts, offsets, src_row, inverse, ticket, num_valid;
  std::optional<DeviceBuffer<float>> selection_bias, logit_bias;
  std::optional<DeviceBuffer<int32_t>> noise_keys;
};

// The fused kernel's outputs against float64 logits and against fused_router + moe_plan run over
// its own logits.
void expect_stage_results(const Case& c, Buffers& b) {
  const int64_t T = b.T, E = b.E, K = b.K, H = b.H;
  const int64_t valid = c.num_valid < 0 ? T : c.num_valid;
  const std::vector<float> logits = b.logits.download();
  const std::vector<float> hidden = to_float(b.hidden), router = to_float(b.router);
  size_t mismatches = 0;
  for (int64_t t = 0; t < valid; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      double dot = 0.0, magnitude = 0.0;
      for (int64_t h = 0; h < H; ++h) {
        const double term = double{hidden[t * H + h]} * router[e * H + h];
        dot += term;
        magnitude += std::fabs(term);
      }
      const float got = logits[t * E + e];
      if (!(std::fabs(got - dot) <= 1e-5 * magnitude + 1e-30) && mismatches++ < 5) {
        ADD_FAILURE() << c.name << ": logit (" << t << ", " << e << ") = " << got << ", want "
                      << dot;
      }
    }
  }
  EXPECT_EQ(mismatches, 0u) << c.name << ": logits off";

  // The stage kernels over the same logits (padding rows stay poisoned: never read).
  DeviceBuffer<float> stage_logits(logits);
  DeviceBuffer<int32_t> ids(T * K), counts(E + 1), offsets(E + 2), src_row(T * K), inverse(T * K);
  DeviceBuffer<float> weights(T * K);
  RoutePlanParams p = b.params(c);
  RouterParams route = p.route;
  route.logits = stage_logits.get();
  route.topk_ids = ids.get();
  route.topk_weights = weights.get();
  fused_router(route, nullptr);
  moe_plan({.topk_ids = ids.get(),
            .expert_counts = counts.get(),
            .expert_offsets = offsets.get(),
            .src_row = src_row.get(),
            .inverse = inverse.get(),
            .num_assignments = T * K,
            .num_experts = E + 1},
           nullptr);
  synchronize();
  EXPECT_EQ(b.ids.download(), ids.download()) << c.name << ": topk_ids";
  const std::vector<float> got_w = b.weights.download(), want_w = weights.download();
  EXPECT_EQ(0, std::memcmp(got_w.data(), want_w.data(), got_w.size() * sizeof(float)))
      << c.name << ": topk_weights differ from fused_router's";
  EXPECT_EQ(b.counts.download(), counts.download()) << c.name << ": expert_counts";
  const std::vector<int32_t> got_offsets = b.offsets.download(), want = offsets.download();
  EXPECT_TRUE(std::equal(want.begin(), want.begin() + E + 2, got_offsets.begin()))
      << c.name << ": expert_offsets";
  EXPECT_EQ(b.src_row.download(), src_row.download()) << c.name << ": src_row";
  EXPECT_EQ(b.inverse.download(), inverse.download()) << c.name << ": inverse";
  if (valid < T) {  // padding tokens: the null expert E at weight 0
    const std::vector<int32_t> got_ids = b.ids.download();
    for (int64_t i = valid * K; i < T * K; ++i) EXPECT_EQ(got_ids[i], E) << c.name << " pick " << i;
    EXPECT_EQ(got_offsets[E + 1] - got_offsets[E], (T - valid) * K) << c.name;
  }
}

void route_plan_matches_the_stages(const Case& c) {
  std::mt19937 rng(fresh_seed());
  Buffers b(c, rng);
  b.poison();
  moe_route_plan(b.params(c), nullptr);
  synchronize();
  EXPECT_EQ(b.ticket.download()[0], 0) << c.name << ": the ticket is left for the next launch";
  expect_stage_results(c, b);
}

// Captured once, replayed over new inputs: each replay's outputs are those of the stage kernels.
void route_plan_replays_in_a_graph(const Case& c) {
  std::mt19937 rng(fresh_seed());
  Buffers b(c, rng);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  moe_route_plan(b.params(c), stream);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    b.hidden = random_bf16(b.hidden.size(), rng);
    CUDA_CHECK(cudaMemcpy(b.d_hidden.get(), b.hidden.data(), b.hidden.size() * sizeof(uint16_t),
                          cudaMemcpyHostToDevice));
    b.poison();
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    SCOPED_TRACE(::testing::Message() << "replay " << replay);
    expect_stage_results(c, b);
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

const Case kCases[] = {
    {.name = "Qwen3_T1", .tokens = 1, .experts = 128, .top_k = 8, .hidden = 2048},
    {.name = "Qwen3_T4", .tokens = 4, .experts = 128, .top_k = 8, .hidden = 2048},
    {.name = "Qwen3_T16", .tokens = 16, .experts = 128, .top_k = 8, .hidden = 2048},
    {.name = "Qwen3_T64", .tokens = 64, .experts = 128, .top_k = 8, .hidden = 2048},
    {.name = "OLMoE_T3",
     .tokens = 3,
     .experts = 64,
     .top_k = 8,
     .hidden = 2048,
     .renormalize = false},
    {.name = "Mixtral_T5", .tokens = 5, .experts = 8, .top_k = 2, .hidden = 4096},
    {.name = "DeepSeekV2Lite_T7",
     .tokens = 7,
     .experts = 64,
     .top_k = 6,
     .hidden = 2048,
     .renormalize = false},
    {.name = "DeepSeekV3_Grouped_T2",
     .tokens = 2,
     .experts = 256,
     .top_k = 8,
     .hidden = 7168,
     .score = RouterScore::kSigmoid,
     .scaling = 2.5f,
     .group_score = RouterGroupScore::kTop2Sum,
     .num_groups = 8,
     .topk_groups = 4,
     .selection_bias = true},
    {.name = "GptOss_LogitBias_T8",
     .tokens = 8,
     .experts = 32,
     .top_k = 4,
     .hidden = 2880,
     .score = RouterScore::kTopkSoftmax,
     .renormalize = false,
     .logit_bias = true},
    {.name = "E60_IdleWarps_T9", .tokens = 9, .experts = 60, .top_k = 4, .hidden = 1024},
    {.name = "Largest_E1024_K32_T32", .tokens = 32, .experts = 1024, .top_k = 32, .hidden = 256},
    {.name = "Padding_T16_Valid5",
     .tokens = 16,
     .experts = 128,
     .top_k = 8,
     .hidden = 2048,
     .num_valid = 5},
    {.name = "Padding_General_T8_Valid0",
     .tokens = 8,
     .experts = 256,
     .top_k = 8,
     .hidden = 512,
     .score = RouterScore::kSigmoid,
     .group_score = RouterGroupScore::kMax,
     .num_groups = 8,
     .topk_groups = 3,
     .selection_bias = true,
     .num_valid = 0},
    {.name = "ZipfNoise_T16",
     .tokens = 16,
     .experts = 128,
     .top_k = 8,
     .hidden = 2048,
     .logit_bias = true,
     .noise = true},
};

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda_device_present("route-and-plan")) return false;
  for (const Case& c : kCases) {
    register_kernel_test(
        "CudaRoutePlan", std::string("MatchesTheStages_") + c.name,
        [&c] { route_plan_matches_the_stages(c); }, __FILE__, __LINE__);
  }
  register_kernel_test(
      "CudaRoutePlan", "ReplaysInAGraph_Qwen3_T4", [] { route_plan_replays_in_a_graph(kCases[1]); },
      __FILE__, __LINE__);
  register_kernel_test(
      "CudaRoutePlan", "ReplaysInAGraph_DeepSeekV3_Grouped_T2",
      [] { route_plan_replays_in_a_graph(kCases[7]); }, __FILE__, __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
