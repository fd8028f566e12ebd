// Expert parallelism's pieces that need no second rank: a dispatcher
// over a one-rank job, which must give the local dispatcher's result bit for bit (the same rows
// reach the same experts in the same order). Several ranks: tests/parallel (under mpirun) and
// tests/e2e/test_expert_parallel.py.
#include "moe/expert_parallel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"

namespace moeinfer::moe {
namespace {

TEST(ExpertParallelDispatcher, OneRankGivesTheLocalResultBitForBit) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal(0.0f, 0.5f);
  const int64_t H = 16, I = 8, E = 6, K = 2, T = 9;
  std::vector<std::vector<float>> storage;
  storage.reserve(1 + 3 * E);
  auto view = [&](int64_t rows, int64_t cols) {
    storage.emplace_back(rows * cols);
    for (float& v : storage.back()) v = normal(rng);
    return TensorView{.dtype = DType::kF32, .shape = {rows, cols}, .data = storage.back().data()};
  };
  RoutedExperts weights;
  weights.router = view(E, H);
  for (int64_t e = 0; e < E; ++e) {
    weights.experts.push_back({.gate = view(I, H), .up = view(I, H), .down = view(H, I)});
  }
  std::vector<float> hidden(T * H), shared(T * H);
  for (float& v : hidden) v = normal(rng);
  for (float& v : shared) v = normal(rng);
  // Both places of the routing weights: on the outputs, and on the rows sent (Llama 4).
  for (const WeightPlacement placement : {WeightPlacement::kOutput, WeightPlacement::kInput}) {
    const MoeBlockOptions options{.router = {.num_experts = E, .top_k = K, .renormalize = true},
                                  .hidden_size = H,
                                  .expert_width = I,
                                  .weights = placement};
    MoeBlock local = single_layer_block(options, weights);
    std::vector<float> want(T * H);
    local.forward(0, hidden.data(), T, weights.router, nullptr, shared.data(), want.data());

    parallel::SelfCommunicator self;
    MoeBlock ep(
        options,
        std::make_unique<ExpertParallelDispatcher>(self, parallel::ExpertPlacement(E, 1), H),
        std::make_unique<ResidentExperts>(
            std::vector<std::span<const ExpertWeights>>{weights.experts}, H, I));
    std::vector<float> got(T * H);
    ep.forward(0, hidden.data(), T, weights.router, nullptr, shared.data(), got.data());
    EXPECT_EQ(got, want);
    // A step without tokens still passes through (every rank enters every layer).
    std::vector<float> none;
    ep.forward(0, hidden.data(), 0, weights.router, nullptr, nullptr, none.data());
  }
}

// --dispatch-dtype bf16 and fp8 over a one-rank job: the experts see the rows after a round
// trip through the encoding, so the block's output differs from the local one by the encoding's
// error carried through one expert (relative to the output's largest value: bf16 <= 1e-2, fp8
// <= 1e-1, each several times what the codecs' bounds give here); f32 is exact (above).
TEST(ExpertParallelDispatcher, EncodedRowsStayWithinTheirDtypesTolerance) {
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  const int64_t H = 19, I = 8, E = 5, K = 2, T = 11;
  std::vector<std::vector<float>> storage;
  storage.reserve(1 + 3 * E);
  auto view = [&](int64_t rows, int64_t cols) {
    storage.emplace_back(rows * cols);
    for (float& v : storage.back()) v = normal(rng);
    return TensorView{.dtype = DType::kF32, .shape = {rows, cols}, .data = storage.back().data()};
  };
  RoutedExperts weights;
  weights.router = view(E, H);
  for (int64_t e = 0; e < E; ++e) {
    weights.experts.push_back({.gate = view(I, H), .up = view(I, H), .down = view(H, I)});
  }
  std::vector<float> hidden(T * H);
  for (float& v : hidden) v = normal(rng);
  for (const WeightPlacement placement : {WeightPlacement::kOutput, WeightPlacement::kInput}) {
    const MoeBlockOptions options{.router = {.num_experts = E, .top_k = K, .renormalize = true},
                                  .hidden_size = H,
                                  .expert_width = I,
                                  .weights = placement};
    MoeBlock local = single_layer_block(options, weights);
    std::vector<float> want(T * H);
    local.forward(0, hidden.data(), T, weights.router, nullptr, nullptr, want.data());
    float largest = 0.0f;
    for (const float v : want) largest = std::max(largest, std::fabs(v));
    for (const auto [wire, tolerance] :
         {std::pair{DispatchDtype::kBF16, 1e-2f}, std::pair{DispatchDtype::kFp8, 1e-1f}}) {
      parallel::SelfCommunicator self;
      MoeBlock ep(options,
                  std::make_unique<ExpertParallelDispatcher>(self, parallel::ExpertPlacement(E, 1),
                                                             H, wire),
                  std::make_unique<ResidentExperts>(
                      std::vector<std::span<const ExpertWeights>>{weights.experts}, H, I));
      std::vector<float> got(T * H, std::numeric_limits<float>::quiet_NaN());
      ep.forward(0, hidden.data(), T, weights.router, nullptr, nullptr, got.data());
      float worst = 0.0f;
      for (int64_t i = 0; i < T * H; ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
      EXPECT_LE(worst, tolerance * largest)
          << dispatch_dtype_name(wire) << (placement == WeightPlacement::kInput ? " input" : "");
      EXPECT_GT(worst, 0.0f) << dispatch_dtype_name(wire) << ": the rows were not encoded";
    }
  }
}

TEST(ExpertParallelDispatcher, RefusesAPlacementOfAnotherJobSize) {
  parallel::SelfCommunicator self;
  EXPECT_THROW(ExpertParallelDispatcher(self, parallel::ExpertPlacement(4, 2), 8), Error);
}

}  // namespace
}  // namespace moeinfer::moe
