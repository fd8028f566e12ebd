// Token sampling on the GPU (backend/cuda/sampling.h) on fresh random logits, tokens poisoned
// first (-1): greedy equals the CPU argmax with ties to the lower id; a sampled token always
// lies in the set a float64 CPU top-k/top-p would keep; the same seeds and steps give the same
// tokens; and over many independent draws (distinct seeds) of one small distribution the
// frequencies match the renormalised kept probabilities (each within 6 standard deviations,
// kept-out tokens never drawn).
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <numeric>

#include "backend/cuda/sampling.h"
#include "cuda_test_util.h"

namespace moeinfer::cuda {
namespace {

using namespace testing_util;

TEST(CudaSamplingChecks, RefusesBadShapes) {
  float logits[4] = {};
  int32_t tokens[1] = {};
  float temperature[1] = {1.0f};
  expect_error_naming(
      [&] {
        sample_tokens(
            SamplingParams{.logits = logits, .tokens = tokens, .num_rows = 1, .vocab_size = 0},
            nullptr);
      },
      "vocab_size = 0");
  expect_error_naming(
      [&] {
        sample_tokens(SamplingParams{.logits = logits,
                                     .temperature = temperature,
                                     .tokens = tokens,
                                     .num_rows = 1,
                                     .vocab_size = 4},
                      nullptr);
      },
      "seeds is null");
}

// The set a CPU sampler keeps: k largest (ties at the k-th kept), then the smallest set of the
// largest probabilities reaching p. `slack` widens the top-p boundary by a relative margin so
// that float32 summation on the device cannot put a token just outside it.
std::vector<bool> kept_set(const std::vector<float>& logits, float temperature, int top_k,
                           float top_p, double slack) {
  const int V = static_cast<int>(logits.size());
  std::vector<double> x(V);
  for (int i = 0; i < V; ++i) x[i] = static_cast<double>(logits[i] * (1.0f / temperature));
  std::vector<int> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return x[a] > x[b]; });
  double kth = -1e300;
  if (top_k > 0 && top_k < V) kth = x[order[top_k - 1]];
  const double m = x[order[0]];
  double z = 0;
  for (int i = 0; i < V; ++i)
    if (x[i] >= kth) z += std::exp(x[i] - m);
  double threshold = kth;
  if (top_p > 0 && top_p < 1) {
    double cum = 0;
    for (int i : order) {
      if (x[i] < kth) break;
      cum += std::exp(x[i] - m);
      if (cum >= top_p * z * (1 + slack)) {
        threshold = std::max(threshold, x[i]);
        break;
      }
    }
  }
  std::vector<bool> keep(V);
  for (int i = 0; i < V; ++i) keep[i] = x[i] >= threshold;
  return keep;
}

struct Batch {
  DeviceBuffer<float> logits, temperature, top_p;
  DeviceBuffer<int32_t> top_k, tokens;
  DeviceBuffer<uint64_t> seeds, steps;
};

std::vector<int32_t> run(const std::vector<float>& logits, int64_t B, int64_t V,
                         const std::vector<float>& temperature, const std::vector<int32_t>& top_k,
                         const std::vector<float>& top_p, const std::vector<uint64_t>& seeds,
                         const std::vector<uint64_t>& steps) {
  Batch d{DeviceBuffer<float>(logits),  DeviceBuffer<float>(temperature),
          DeviceBuffer<float>(top_p),   DeviceBuffer<int32_t>(top_k),
          DeviceBuffer<int32_t>(B),     DeviceBuffer<uint64_t>(seeds),
          DeviceBuffer<uint64_t>(steps)};
  d.tokens.poison();
  sample_tokens(SamplingParams{.logits = d.logits.get(),
                               .temperature = d.temperature.get(),
                               .top_k = d.top_k.get(),
                               .top_p = d.top_p.get(),
                               .seeds = d.seeds.get(),
                               .steps = d.steps.get(),
                               .tokens = d.tokens.get(),
                               .num_rows = B,
                               .vocab_size = V},
                nullptr);
  synchronize();
  return d.tokens.download();
}

void greedy_random(int64_t B, int64_t V) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(B * 31 + V));
  std::vector<float> logits(B * V);
  // A coarse grid: ties for the maximum are common.
  std::uniform_int_distribution<int> grid(-200, 200);
  for (auto& x : logits) x = grid(rng) / 16.0f;
  DeviceBuffer<float> d_logits(logits);
  DeviceBuffer<int32_t> d_tokens(B);
  d_tokens.poison();
  sample_tokens(
      SamplingParams{
          .logits = d_logits.get(), .tokens = d_tokens.get(), .num_rows = B, .vocab_size = V},
      nullptr);
  synchronize();
  const auto got = d_tokens.download();
  for (int64_t b = 0; b < B; ++b) {
    const auto row = logits.begin() + b * V;
    const int64_t want = std::max_element(row, row + V) - row;  // first maximum
    ASSERT_EQ(got[b], want) << "row " << b;
  }
}

void sampled_in_kept_set(int64_t B, int64_t V) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(B * 7 + V));
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(B * V);
  for (auto& x : logits) x = normal(rng);
  std::vector<float> temperature(B), top_p(B);
  std::vector<int32_t> top_k(B);
  std::vector<uint64_t> seeds(B), steps(B);
  for (int64_t b = 0; b < B; ++b) {
    temperature[b] = std::uniform_real_distribution<float>(0.3f, 1.5f)(rng);
    const int mode = b % 4;  // plain, top-k, top-p, both
    top_k[b] = (mode == 1 || mode == 3) ? std::uniform_int_distribution<int>(1, 50)(rng) : 0;
    top_p[b] =
        (mode == 2 || mode == 3) ? std::uniform_real_distribution<float>(0.1f, 0.95f)(rng) : 1.0f;
    seeds[b] = rng();
    steps[b] = rng() % 1000;
  }
  const auto got = run(logits, B, V, temperature, top_k, top_p, seeds, steps);
  const auto again = run(logits, B, V, temperature, top_k, top_p, seeds, steps);
  EXPECT_EQ(got, again) << "same seeds and steps must give the same tokens";
  for (int64_t b = 0; b < B; ++b) {
    ASSERT_GE(got[b], 0) << "row " << b;
    ASSERT_LT(got[b], V) << "row " << b;
    const std::vector<float> row(logits.begin() + b * V, logits.begin() + (b + 1) * V);
    const auto keep = kept_set(row, temperature[b], top_k[b], top_p[b], 1e-4);
    EXPECT_TRUE(keep[got[b]]) << "row " << b << " drew token " << got[b] << " (T " << temperature[b]
                              << ", top_k " << top_k[b] << ", top_p " << top_p[b] << ")";
    if (top_k[b] == 1) {
      EXPECT_EQ(got[b], std::max_element(row.begin(), row.end()) - row.begin());
    }
  }
}

void distribution(float temperature, int top_k, float top_p) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(top_k * 101));
  const int64_t V = 11, B = 40000;
  std::vector<float> row(V);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& x : row) x = normal(rng);
  std::vector<float> logits;
  for (int64_t b = 0; b < B; ++b) logits.insert(logits.end(), row.begin(), row.end());
  std::vector<uint64_t> seeds(B), steps(B);
  const uint64_t base = rng();
  for (int64_t b = 0; b < B; ++b) {
    seeds[b] = base + b;
    steps[b] = b % 3;
  }
  const auto got = run(logits, B, V, std::vector<float>(B, temperature),
                       std::vector<int32_t>(B, top_k), std::vector<float>(B, top_p), seeds, steps);
  const auto keep = kept_set(row, temperature, top_k, top_p, 0.0);
  std::vector<double> prob(V, 0.0);
  double z = 0;
  const double m = *std::max_element(row.begin(), row.end()) / temperature;
  for (int i = 0; i < V; ++i)
    if (keep[i]) z += prob[i] = std::exp(row[i] / temperature - m);
  std::vector<int64_t> count(V, 0);
  for (int32_t t : got) {
    ASSERT_GE(t, 0);
    ASSERT_LT(t, V);
    ++count[t];
  }
  for (int i = 0; i < V; ++i) {
    const double p = prob[i] / z;
    const double expected = p * B;
    const double sigma = std::sqrt(B * p * (1 - p)) + 1.0;
    if (!keep[i]) {
      EXPECT_EQ(count[i], 0) << "token " << i << " is outside the kept set";
    } else {
      EXPECT_NEAR(static_cast<double>(count[i]), expected, 6 * sigma) << "token " << i;
    }
  }
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda_device_present("sampling")) return false;
  auto reg = [](const std::string& name, std::function<void()> body) {
    register_kernel_test("CudaSampling", name, std::move(body), __FILE__, __LINE__);
  };
  reg("Greedy_B1_V151936", [] { greedy_random(1, 151936); });
  reg("Greedy_B19_V1000", [] { greedy_random(19, 1000); });
  reg("Greedy_B3_V7", [] { greedy_random(3, 7); });
  reg("KeptSet_B64_V151936", [] { sampled_in_kept_set(64, 151936); });
  reg("KeptSet_B99_V1003", [] { sampled_in_kept_set(99, 1003); });
  reg("Distribution_Plain", [] { distribution(1.0f, 0, 1.0f); });
  reg("Distribution_TopK4", [] { distribution(0.7f, 4, 1.0f); });
  reg("Distribution_TopP", [] { distribution(1.3f, 0, 0.6f); });
  reg("Distribution_TopK6_TopP", [] { distribution(1.0f, 6, 0.8f); });
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
