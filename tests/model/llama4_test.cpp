// Llama 4 beyond the parity fixtures: the stacked [in, out] experts bound as the products' [out,
// in] views, the MoE block's weights-on-the-input option against its definition, the parameter
// and KV counts of the fixtures and of synthetic:llama4-scout, and what `plan` says of it.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "model/capacity_plan.h"
#include "model/family.h"
#include "model/model.h"
#include "model/model_facts.h"
#include "model/synthetic.h"
#include "moe/moe_block.h"

namespace moeinfer {
namespace {

const std::filesystem::path kModels = std::filesystem::path(MOE_FIXTURES_DIR) / "models";

float element(const TensorView& view, int64_t index) {
  float value = 0.0f;
  convert_to_f32(view.dtype, static_cast<const char*>(view.data) + index * dtype_size(view.dtype),
                 &value, 1);
  return value;
}

TEST(Llama4, StackedExpertsAreBoundTransposedWithGateFirst) {
  for (const char* fixture : {"llama4_text_f32", "llama4_vision_bf16"}) {
    const auto dir = kModels / fixture;
    const ModelConfig config = load_model_config(dir / "config.json");
    const WeightStore store = WeightStore::open(dir);
    WeightSource source(store, config);
    const DecoderWeights w = bind_weights(config, source);
    const std::string prefix = config.has_vision_tower ? "language_model." : "";
    const int64_t E = config.num_experts, H = config.hidden_size, I = config.moe_intermediate_size;
    int checked_layers = 0;
    for (int64_t l = 0; l < config.num_layers; ++l) {
      if (!w.layers[l].is_moe) continue;
      const std::string p = prefix + "model.layers." + std::to_string(l) + ".feed_forward.";
      const TensorView gate_up = store.require(p + "experts.gate_up_proj", {E, H, 2 * I});
      const TensorView down = store.require(p + "experts.down_proj", {E, I, H});
      for (int64_t e = 0; e < E; ++e) {
        const moe::ExpertWeights& x = w.layers[l].moe.routed.experts[e];
        ASSERT_EQ(x.gate.shape, (Shape{I, H}));
        ASSERT_EQ(x.up.shape, (Shape{I, H}));
        ASSERT_EQ(x.down.shape, (Shape{H, I}));
        for (int64_t i = 0; i < I; ++i) {
          for (int64_t h = 0; h < H; ++h) {
            const int64_t stored = (e * H + h) * 2 * I + i;  // gate_up[e, h, i]
            ASSERT_EQ(element(x.gate, i * H + h), element(gate_up, stored)) << fixture;
            ASSERT_EQ(element(x.up, i * H + h), element(gate_up, stored + I)) << fixture;
            ASSERT_EQ(element(x.down, h * I + i), element(down, (e * I + i) * H + h)) << fixture;
          }
        }
      }
      ++checked_layers;
    }
    EXPECT_GE(checked_layers, 1) << fixture;
    // Only the routed experts are copied; every other tensor stays a view of the map.
    const size_t element_bytes = dtype_size(w.embed_tokens.dtype);
    EXPECT_EQ(source.transposed_bytes(),
              static_cast<size_t>(checked_layers * E * 3 * I * H) * element_bytes)
        << fixture;
  }
}

// out[t] = sum_k expert_k(w[t, k] * x[t]): the block's kInput option against the experts stage
// run on rows scaled by hand; kOutput on the same routing differs (the experts are not linear).
TEST(Llama4, MoeBlockAppliesRoutingWeightsToTheExpertInput) {
  const int64_t T = 7, H = 24, I = 10, E = 5, K = 2;
  std::mt19937 rng(20261205);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  auto random = [&](int64_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = normal(rng);
    return v;
  };
  const std::vector<float> router = random(E * H), hidden = random(T * H);
  std::vector<std::vector<float>> gates, ups, downs;
  moe::RoutedExperts weights{
      .router = {.dtype = DType::kF32, .shape = {E, H}, .data = router.data()}};
  for (int64_t e = 0; e < E; ++e) {
    gates.push_back(random(I * H));
    ups.push_back(random(I * H));
    downs.push_back(random(H * I));
    weights.experts.push_back(
        {.gate = {.dtype = DType::kF32, .shape = {I, H}, .data = gates[e].data()},
         .up = {.dtype = DType::kF32, .shape = {I, H}, .data = ups[e].data()},
         .down = {.dtype = DType::kF32, .shape = {H, I}, .data = downs[e].data()}});
  }
  const moe::RouterOptions router_options{
      .num_experts = E, .top_k = K, .score = moe::ScoreFunction::kSigmoid};
  auto run = [&](moe::WeightPlacement placement, moe::Routing* routing) {
    moe::MoeBlock block = moe::single_layer_block(
        {.router = router_options, .hidden_size = H, .expert_width = I, .weights = placement},
        weights);
    std::vector<float> out(T * H, NAN);
    block.forward(0, hidden.data(), T, weights.router, nullptr, nullptr, out.data());
    *routing = block.routing();
    return out;
  };
  moe::Routing routing;
  const std::vector<float> on_input = run(moe::WeightPlacement::kInput, &routing);

  // By hand: each (token, pick) row scaled by its weight, through its expert alone, summed.
  std::vector<float> expected(T * H, 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = routing.topk_ids[t * K + k];
      const float w = routing.topk_weights[t * K + k];
      EXPECT_NEAR(w, 1.0f / (1.0f + std::exp(-[&] {
                               float logit = 0.0f;
                               for (int64_t h = 0; h < H; ++h)
                                 logit += router[e * H + h] * hidden[t * H + h];
                               return logit;
                             }())),
                  1e-5f);
      std::vector<float> row(H), out(H);
      for (int64_t h = 0; h < H; ++h) row[h] = hidden[t * H + h] * w;
      const std::vector<int32_t> offsets = {0, 1};
      moe::run_experts(row.data(), H, I, offsets,
                       std::span<const moe::ExpertWeights>(&weights.experts[e], 1), out.data());
      for (int64_t h = 0; h < H; ++h) expected[t * H + h] += out[h];
    }
  }
  double max_diff = 0.0, max_ref = 0.0;
  for (int64_t i = 0; i < T * H; ++i) {
    max_diff = std::max(max_diff, std::fabs(double{on_input[i]} - expected[i]));
    max_ref = std::max(max_ref, std::fabs(double{expected[i]}));
  }
  EXPECT_LE(max_diff, 1e-5 * max_ref);

  moe::Routing same_routing;
  const std::vector<float> on_output = run(moe::WeightPlacement::kOutput, &same_routing);
  EXPECT_EQ(same_routing.topk_ids, routing.topk_ids);
  double apart = 0.0;
  for (int64_t i = 0; i < T * H; ++i)
    apart = std::max(apart, std::fabs(double{on_output[i]} - on_input[i]));
  EXPECT_GT(apart, 1e-3 * max_ref);
}

// A sigmoid router without a bias chooses by the logits: past a logit of about 17 every float
// sigmoid is 1, yet the larger logit must win, as in the reference's top-k of the logits.
TEST(Llama4, SigmoidRouterChoosesByLogitsPastSaturation) {
  const float logits[3] = {18.0f, 25.0f, -1.0f};
  moe::Routing routing;
  moe::route(logits, 1, {.num_experts = 3, .top_k = 1, .score = moe::ScoreFunction::kSigmoid},
             &routing);
  EXPECT_EQ(routing.topk_ids[0], 1);
  EXPECT_FLOAT_EQ(routing.topk_weights[0], 1.0f);
}

TEST(Llama4, FixturesCountAndAllocateAsPlanned) {
  for (const char* fixture : {"llama4_text_f32", "llama4_vision_bf16"}) {
    auto model = Model::load(kModels / fixture, LoadOptions{.prefault = false});
    const ModelConfig& config = model->config();
    const int64_t mapped = static_cast<int64_t>(model->store().total_bytes());
    // Throws unless the bound tensors hold exactly the config's parameter count.
    const ModelFacts facts = model_facts(config, model->decoder().weights(), mapped);
    const CapacityPlan plan = plan_capacity(config, PlanOptions{.kv_dtype = KvDType::kF32});
    const KvCache cache = model->decoder().make_cache(8);
    EXPECT_EQ(static_cast<size_t>(plan.kv_bytes_per_token), cache.bytes_per_token()) << fixture;
    EXPECT_EQ(plan.kv_bytes_per_token, config.num_layers * 2 * config.kv_dim() * 4) << fixture;
    const int64_t element_bytes = config.dtype == "float32" ? 4 : 2;
    EXPECT_EQ(facts.resident_bytes.total(), facts.total_params.total() * element_bytes);
    EXPECT_EQ(plan.weight_bytes.total(), facts.total_params.total() * 2) << fixture;  // bf16
    if (config.has_vision_tower) {
      EXPECT_GT(mapped, facts.resident_bytes.total()) << "the vision tower is not bound";
    } else {
      EXPECT_EQ(mapped, facts.resident_bytes.total());
    }
  }
}

TEST(Llama4, ScoutCountsExactly) {
  const ModelConfig scout = synthetic_model_config("llama4-scout");
  const int64_t H = 5120, V = 202048, L = 48, E = 16, I = 8192;
  const int64_t attention = H * 40 * 128 * 2 + H * 8 * 128 * 2;  // q, o; k, v
  const PartCounts total = count_params(scout, false);
  EXPECT_EQ(total.embeddings, 2 * V * H);
  EXPECT_EQ(total.attention, L * attention);
  EXPECT_EQ(total.routed_experts, L * E * 3 * H * I);
  EXPECT_EQ(total.shared_experts, L * 3 * H * I);
  EXPECT_EQ(total.other, H + L * (2 * H + E * H));  // norms, routers
  EXPECT_EQ(total.total(), 107'769'861'120);        // "109B" with the unread vision tower
  const PartCounts active = count_params(scout, true);
  EXPECT_EQ(active.routed_experts, L * 3 * H * I);  // top-1
  EXPECT_NEAR(active.total() / 1e9, 17.2, 0.05);    // "17B active"

  const CapacityPlan plan =
      plan_capacity(scout, PlanOptions{.num_gpus = 1, .gpu_mem_gib = 141, .max_seq_len = 8192});
  EXPECT_EQ(plan.kv_bytes_per_token, L * 2 * 8 * 128 * 2);  // bf16 keys and values
  EXPECT_EQ(plan.weight_bytes.total(), total.total() * 2);
  ASSERT_FALSE(plan.arithmetic.empty());
  // Past one 141 GiB GPU it needs an expert budget, which the GPU does not take for Llama 4.
  EXPECT_NE(plan.arithmetic[0].find("note: llama4: --expert-budget on cuda"), std::string::npos)
      << plan.arithmetic[0];
  EXPECT_EQ(plan.run_flags, "--device cpu");
  EXPECT_EQ(synthetic_model_config("llama4-scout", 4).num_layers, 4);  // --layers cuts text_config
}

}  // namespace
}  // namespace moeinfer
