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

// The block in phases (--micro-batches 2): two blocks over a one-rank job, each with its own
// dispatcher, interleaved as the decoder runs them (start A, start B, experts A, experts B,
// finish A, finish B), give each micro-batch's forward() result bit for bit, at both shared
// schedules and with a micro-batch of no tokens; phases out of order are refused.
TEST(ExpertParallelDispatcher, InterleavedPhasesOfTwoBlocksGiveForwardBitForBit) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal(0.0f, 0.5f);
  const int64_t H = 16, I = 8, E = 6, K = 2;
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
  parallel::SelfCommunicator self;
  const MoeBlockOptions options{.router = {.num_experts = E, .top_k = K, .renormalize = true},
                                .hidden_size = H,
                                .expert_width = I};
  auto block = [&] {
    return MoeBlock(
        options,
        std::make_unique<ExpertParallelDispatcher>(self, parallel::ExpertPlacement(E, 1), H),
        std::make_unique<ResidentExperts>(
            std::vector<std::span<const ExpertWeights>>{weights.experts}, H, I));
  };
  const LayerRouter router{.weight = weights.router};
  for (const int64_t num_b : {int64_t{0}, int64_t{1}, int64_t{5}}) {
    const int64_t num_tokens[2] = {7, num_b};
    std::vector<float> hidden[2], shared[2];
    for (int m = 0; m < 2; ++m) {
      hidden[m].resize(num_tokens[m] * H);
      shared[m].resize(num_tokens[m] * H);
      for (float& v : hidden[m]) v = normal(rng);
      for (float& v : shared[m]) v = normal(rng);
    }
    for (const SharedSchedule schedule :
         {SharedSchedule::kBeforeDispatch, SharedSchedule::kWhileDispatching}) {
      MoeBlock whole = block();
      std::vector<float> want[2];
      for (int m = 0; m < 2; ++m) {
        want[m].assign(num_tokens[m] * H, NAN);
        whole.forward(
            0, hidden[m].data(), num_tokens[m], router, [&, m] { return shared[m].data(); },
            schedule, want[m].data());
      }
      MoeBlock blocks[2] = {block(), block()};
      std::vector<float> got[2];
      int calls[2] = {0, 0};
      for (int m = 0; m < 2; ++m) {
        got[m].assign(num_tokens[m] * H, NAN);
        blocks[m].start(
            0, hidden[m].data(), num_tokens[m], router,
            [&, m] {
              ++calls[m];
              return shared[m].data();
            },
            schedule);
      }
      for (int m = 0; m < 2; ++m) blocks[m].run_experts();
      for (int m = 0; m < 2; ++m) blocks[m].finish(got[m].data());
      for (int m = 0; m < 2; ++m) {
        EXPECT_EQ(calls[m], 1) << "micro-batch " << m;
        EXPECT_EQ(got[m], want[m]) << "micro-batch " << m << " of " << num_tokens[m] << " tokens";
      }
    }
  }
  MoeBlock b = block();
  std::vector<float> hidden(H), out(H);
  EXPECT_THROW(b.run_experts(), Error);
  EXPECT_THROW(b.finish(out.data()), Error);
  b.start(
      0, hidden.data(), 1, router, [] { return nullptr; }, SharedSchedule::kBeforeDispatch);
  EXPECT_THROW(
      b.start(
          0, hidden.data(), 1, router, [] { return nullptr; }, SharedSchedule::kBeforeDispatch),
      Error);
  b.run_experts();
  b.finish(out.data());
}

// --dispatch-dtype bf16 and fp8 over a one-rank job: the experts see the rows after a round
// trip through the encoding, so the block's output differs from the local one by the encoding's
// error carried through one expert. Measured as the error's norm relative to the output's norm
// (bf16 <= 1e-2, fp8 <= 1e-1, each several times what the codecs' relative steps, 2^-8 and 2^-4,
// give): a bound on the largest element against the largest output was missed by a random draw
// (0.39 against 0.38) where one output element is small and its error is not. f32 is exact
// (above).
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
      double error_sq = 0.0, want_sq = 0.0;
      for (int64_t i = 0; i < T * H; ++i) {
        error_sq += static_cast<double>(got[i] - want[i]) * (got[i] - want[i]);
        want_sq += static_cast<double>(want[i]) * want[i];
      }
      EXPECT_LE(std::sqrt(error_sq), tolerance * std::sqrt(want_sq))
          << dispatch_dtype_name(wire) << (placement == WeightPlacement::kInput ? " input" : "");
      EXPECT_GT(error_sq, 0.0) << dispatch_dtype_name(wire) << ": the rows were not encoded";
    }
  }
}

TEST(ExpertParallelDispatcher, RefusesAPlacementOfAnotherJobSize) {
  parallel::SelfCommunicator self;
  EXPECT_THROW(ExpertParallelDispatcher(self, parallel::ExpertPlacement(4, 2), 8), Error);
}

}  // namespace
}  // namespace moeinfer::moe
