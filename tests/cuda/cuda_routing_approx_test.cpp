// The GPU's routing approximations (backend/cuda/routing_approx.cu) against the CPU's
// (moe/routing_approx.cpp, which the quality measurements of bench/RESULTS.md ran):
//   - approximate_routing on random routings (ties among the weights included): the same
//     assignments dropped (the GPU's null expert E where the CPU has kNoExpert) and the kept
//     weights within 1e-6 relative (the same float32 operations in the same order; the bound
//     only allows for a compiler's contraction of a multiply and add); tokens past the valid
//     count (graph padding) untouched;
//   - scale_logits against moe::apply_temperature, bit for bit.
// Host-side checks (the launcher's refusals, naming the field) need no device and always run.
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/moe_stages.h"
#include "cuda_test_util.h"
#include "moe/routing_approx.h"
#include "moe/stages.h"

namespace moeinfer::cuda {
namespace {

using namespace testing_util;

TEST(CudaRoutingApproxChecks, RefusesBadArgumentsByName) {
  int32_t ids = 0;
  float weights = 0.0f;
  const RoutingApproxParams ok{.topk_ids = &ids,
                               .topk_weights = &weights,
                               .num_tokens = 1,
                               .top_k = 1,
                               .num_experts = 4,
                               .active_experts = 1};
  RoutingApproxParams p = ok;
  p.top_k = kRoutingApproxMaxTopK + 1;
  expect_error_naming([&] { approximate_routing(p, nullptr); }, "experts per token");
  p = ok;
  p.active_experts = 2;
  expect_error_naming([&] { approximate_routing(p, nullptr); }, "active_experts");
  p = ok;
  p.drop_below = 1.0f;
  expect_error_naming([&] { approximate_routing(p, nullptr); }, "drop_below");
}

struct ApproxCase {
  const char* name;
  int64_t E, K, T;
  moe::RoutingApproximation approx;
};

// A random routing of T tokens: K distinct ids per token, positive weights of which about one
// in four repeats the token's previous one (ties), summing to about 1.
moe::Routing random_routing(const ApproxCase& c, std::mt19937& rng) {
  moe::Routing r{.num_tokens = c.T, .top_k = c.K};
  std::uniform_real_distribution<float> weight(0.01f, 1.0f);
  for (int64_t t = 0; t < c.T; ++t) {
    std::vector<int32_t> experts(static_cast<size_t>(c.E));
    for (int64_t e = 0; e < c.E; ++e) experts[e] = static_cast<int32_t>(e);
    std::shuffle(experts.begin(), experts.end(), rng);
    float sum = 0.0f;
    std::vector<float> w(static_cast<size_t>(c.K));
    for (int64_t k = 0; k < c.K; ++k) {
      w[k] = k > 0 && rng() % 4 == 0 ? w[k - 1] : weight(rng);
      sum += w[k];
    }
    for (int64_t k = 0; k < c.K; ++k) {
      r.topk_ids.push_back(experts[k]);
      r.topk_weights.push_back(w[k] / sum);
    }
  }
  return r;
}

void approx_case(const ApproxCase& c) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(c.E * 7 + c.K));
  SCOPED_TRACE(c.name);
  const moe::Routing routing = random_routing(c, rng);
  moe::Routing want = routing;
  const std::vector<float> unused_logits(static_cast<size_t>(c.T * c.E), 0.0f);
  moe::approximate_routing(unused_logits.data(),
                           moe::RouterOptions{.num_experts = c.E, .top_k = c.K}, c.approx, &want);

  // The last few tokens are graph padding: the kernel must leave them as they are.
  const int64_t valid = c.T > 4 ? c.T - 3 : c.T;
  DeviceBuffer<int32_t> d_ids(routing.topk_ids);
  DeviceBuffer<float> d_weights(routing.topk_weights);
  DeviceBuffer<int32_t> d_valid(std::vector<int32_t>{static_cast<int32_t>(valid)});
  approximate_routing({.topk_ids = d_ids.get(),
                       .topk_weights = d_weights.get(),
                       .num_tokens = c.T,
                       .top_k = c.K,
                       .num_experts = c.E,
                       .num_valid_tokens = d_valid.get(),
                       .active_experts = c.approx.active_experts,
                       .renorm_kept = c.approx.renorm == moe::KeptRenorm::kKept,
                       .drop_below = static_cast<float>(c.approx.drop_below)},
                      nullptr);
  synchronize();
  const std::vector<int32_t> ids = d_ids.download();
  const std::vector<float> weights = d_weights.download();
  int64_t bad = 0;
  for (int64_t i = 0; i < c.T * c.K; ++i) {
    const bool padding = i / c.K >= valid;
    const int32_t want_id =
        padding
            ? routing.topk_ids[i]
            : (want.topk_ids[i] == moe::kNoExpert ? static_cast<int32_t>(c.E) : want.topk_ids[i]);
    const float want_w = padding ? routing.topk_weights[i] : want.topk_weights[i];
    const bool same =
        ids[i] == want_id && std::fabs(weights[i] - want_w) <= 1e-6f * std::fabs(want_w);
    if (!same && bad++ < 5) {
      ADD_FAILURE() << "token " << i / c.K << " pick " << i % c.K << ": (" << ids[i] << ", "
                    << weights[i] << "), want (" << want_id << ", " << want_w << ")"
                    << (padding ? " (padding, untouched)" : "");
    }
  }
  EXPECT_EQ(bad, 0);
}

void temperature_case(int64_t n, double temperature) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(n));
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(static_cast<size_t>(n));
  for (float& x : logits) x = normal(rng);
  std::vector<float> want = logits;
  const moe::RoutingApproximation approx{.router_temperature = temperature};
  moe::apply_temperature(approx, want.data(), n);
  DeviceBuffer<float> d_logits(logits);
  scale_logits(d_logits.get(), n, static_cast<float>(1.0 / temperature), nullptr);
  synchronize();
  EXPECT_EQ(d_logits.download(), want);
}

const ApproxCase kCases[] = {
    {"Active4of8_Kept_E128_T989", 128, 8, 989, {.active_experts = 4}},
    {"Active4of8_Full_E128_T989",
     128,
     8,
     989,
     {.active_experts = 4, .renorm = moe::KeptRenorm::kFull}},
    {"Active1of2_Kept_E8_T64", 8, 2, 64, {.active_experts = 1}},
    {"DropBelow0p1_E64_K6_T333", 64, 6, 333, {.drop_below = 0.1}},
    {"Active6Full_DropBelow0p05_E256_K8_T4096",
     256,
     8,
     4096,
     {.active_experts = 6, .renorm = moe::KeptRenorm::kFull, .drop_below = 0.05}},
    {"Active20of40Kept_DropBelow0p02_E9000_K40_T19",
     9000,
     40,
     19,
     {.active_experts = 20, .drop_below = 0.02}},
    {"DropBelow0p3_E160_K64_T7", 160, 64, 7, {.drop_below = 0.3}},
};

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda_device_present("routing approximation")) return false;
  for (const ApproxCase& c : kCases) {
    register_kernel_test(
        "CudaRoutingApprox", c.name, [&c] { approx_case(c); }, __FILE__, __LINE__);
  }
  register_kernel_test(
      "CudaRoutingApprox", "Temperature0p7_N100000", [] { temperature_case(100000, 0.7); },
      __FILE__, __LINE__);
  register_kernel_test(
      "CudaRoutingApprox", "Temperature3_N4099", [] { temperature_case(4099, 3.0); }, __FILE__,
      __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
