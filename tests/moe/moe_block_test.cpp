// The MoE block's contract with its two strategies: the runner hears of the routing before any
// row is dispatched, the rows it gets are the tokens' hidden rows in the plan's expert order,
// and a runner that serves the experts in pieces (as a cache or an expert-parallel rank does,
// through ExpertRows::first_expert) gives the resident result.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "moe/moe_block.h"

namespace moeinfer::moe {
namespace {

struct Layer {
  std::vector<std::vector<float>> storage;
  RoutedExperts weights;
};

Layer random_layer(int64_t E, int64_t H, int64_t I, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 0.5f);
  Layer layer;
  layer.storage.reserve(1 + 3 * E);
  auto view = [&](int64_t rows, int64_t cols) {
    layer.storage.emplace_back(rows * cols);
    for (float& v : layer.storage.back()) v = normal(rng);
    return TensorView{.dtype = DType::kF32, .shape = {rows, cols}, .data = layer.storage.back().data()};
  };
  layer.weights.router = view(E, H);
  for (int64_t e = 0; e < E; ++e) {
    layer.weights.experts.push_back({.gate = view(I, H), .up = view(I, H), .down = view(H, I)});
  }
  return layer;
}

// Runs each call's experts in two pieces through a resident runner, and records what it saw.
class SplittingRunner final : public ExpertRunner {
 public:
  SplittingRunner(std::span<const ExpertWeights> experts, int64_t H, int64_t I)
      : resident_({experts}, H, I), hidden_size_(H) {}

  void on_routed(int64_t layer, const RoutedTokens& tokens) override {
    events.push_back("routed " + std::to_string(layer));
    routed_offsets = tokens.plan->expert_offsets;
  }
  void run(int64_t layer, const ExpertRows& rows, float* out) override {
    events.push_back("run " + std::to_string(layer));
    seen_offsets.assign(rows.expert_offsets.begin(), rows.expert_offsets.end());
    seen_rows.assign(rows.rows, rows.rows + rows.expert_offsets.back() * hidden_size_);
    const size_t num_experts = rows.expert_offsets.size() - 1, half = num_experts / 2;
    for (const auto [first, count] : {std::pair{size_t{0}, half}, {half, num_experts - half}}) {
      // Offsets of the piece, rebased to its first row.
      const int32_t base = rows.expert_offsets[first];
      std::vector<int32_t> offsets(count + 1);
      for (size_t e = 0; e <= count; ++e) offsets[e] = rows.expert_offsets[first + e] - base;
      resident_.run(0,
                    {.rows = rows.rows + base * hidden_size_,
                     .expert_offsets = offsets,
                     .first_expert = rows.first_expert + static_cast<int64_t>(first)},
                    out + base * hidden_size_);
    }
  }

  std::vector<std::string> events;
  std::vector<int32_t> routed_offsets, seen_offsets;
  std::vector<float> seen_rows;

 private:
  ResidentExperts resident_;
  int64_t hidden_size_;
};

TEST(MoeBlock, StrategiesSeeTheRoutingFirstAndPiecesGiveTheResidentResult) {
  std::mt19937 rng(std::random_device{}());
  const int64_t H = 16, I = 8, E = 7, K = 3, T = 11;
  const Layer layer = random_layer(E, H, I, rng);
  const MoeBlockOptions options{
      .router = {.num_experts = E, .top_k = K, .renormalize = true}, .hidden_size = H,
      .expert_width = I};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> hidden(T * H), shared(T * H);
  for (float& v : hidden) v = normal(rng);
  for (float& v : shared) v = normal(rng);

  MoeBlock resident = single_layer_block(options, layer.weights);
  std::vector<float> want(T * H);
  resident.forward(0, hidden.data(), T, layer.weights.router, nullptr, shared.data(), want.data());

  auto runner = std::make_unique<SplittingRunner>(layer.weights.experts, H, I);
  SplittingRunner* seen = runner.get();
  MoeBlock split(options, std::make_unique<LocalDispatcher>(H), std::move(runner));
  std::vector<float> got(T * H);
  split.forward(0, hidden.data(), T, layer.weights.router, nullptr, shared.data(), got.data());

  EXPECT_EQ(seen->events, (std::vector<std::string>{"routed 0", "run 0"}));
  EXPECT_EQ(seen->routed_offsets, split.plan().expert_offsets);
  EXPECT_EQ(seen->seen_offsets, split.plan().expert_offsets);
  ASSERT_EQ(static_cast<int64_t>(seen->seen_rows.size()), T * K * H);
  for (int64_t r = 0; r < T * K; ++r) {
    const int64_t token = split.plan().src_row[r] / K;
    for (int64_t h = 0; h < H; ++h) {
      ASSERT_EQ(seen->seen_rows[r * H + h], hidden[token * H + h]) << "row " << r;
    }
  }
  // The same products in the same order: bit-identical.
  EXPECT_EQ(got, want);
}

TEST(MoeBlock, SharedExpertsRunOnceAtEitherScheduleWithTheSameResult) {
  std::mt19937 rng(std::random_device{}());
  const int64_t H = 16, I = 8, E = 5, K = 2, T = 9;
  const Layer layer = random_layer(E, H, I, rng);
  const MoeBlockOptions options{
      .router = {.num_experts = E, .top_k = K, .renormalize = true}, .hidden_size = H,
      .expert_width = I};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> hidden(T * H), shared(T * H);
  for (float& v : hidden) v = normal(rng);
  for (float& v : shared) v = normal(rng);
  MoeBlock block = single_layer_block(options, layer.weights);
  std::vector<float> want(T * H);
  block.forward(0, hidden.data(), T, layer.weights.router, nullptr, shared.data(), want.data());
  for (const SharedSchedule schedule :
       {SharedSchedule::kBeforeDispatch, SharedSchedule::kWhileDispatching}) {
    int calls = 0;
    std::vector<float> got(T * H);
    block.forward(
        0, hidden.data(), T, layer.weights.router, nullptr,
        [&] {
          ++calls;
          return shared.data();
        },
        schedule, got.data());
    EXPECT_EQ(calls, 1);
    EXPECT_EQ(got, want);
  }
}

TEST(MoeBlock, RefusesARouterOfTheWrongShapeByLayer) {
  std::mt19937 rng(7);
  const Layer layer = random_layer(4, 8, 8, rng);
  MoeBlock block = single_layer_block(
      {.router = {.num_experts = 4, .top_k = 2}, .hidden_size = 8, .expert_width = 8},
      layer.weights);
  std::vector<float> hidden(8), out(8);
  const TensorView wrong = layer.weights.experts[0].gate;  // [8, 8], not [4, 8]
  try {
    block.forward(0, hidden.data(), 1, wrong, nullptr, nullptr, out.data());
    ADD_FAILURE() << "accepted a [8, 8] router";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer 0's router is not [4, 8]"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace moeinfer::moe
