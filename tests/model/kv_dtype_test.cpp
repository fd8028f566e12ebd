// --kv-dtype on the CPU decoder: a fixture's logits over a cache of bf16 or fp8 rows stay near
// those over float32 rows (GQA: qwen3_moe; MLA: deepseek_v2_lite), the default cache is float32,
// and the bytes per token agree three ways: the pool's, the planner's (`moeinfer plan
// --kv-dtype`) and the engine's block count for a --kv-cache-mb budget.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "kv/kv_cache.h"
#include "model/capacity_plan.h"
#include "model/model.h"
#include "model/model_facts.h"
#include "moe/stages.h"
#include "runtime/engine.h"

namespace moeinfer {
namespace {

std::filesystem::path fixture(const std::string& name) {
  return std::filesystem::path(MOE_FIXTURES_DIR) / "models" / name;
}

constexpr KvDType kDtypes[] = {KvDType::kF32, KvDType::kBF16, KvDType::kFP8};

// Routing decisions of one run, in the order the MoE layers made them (step by step, layer by
// layer), so that another run can make the same ones.
using Routings = std::vector<moe::Routing>;

// Logits of every position: a prefill of all but the last four tokens, then one decode step each,
// so that later steps read rows that earlier steps wrote. With `record`, the run's routing is
// kept; with `replay`, each MoE layer takes the recorded experts and weights instead of its own.
std::vector<float> logits_with(Model& model, KvDType dtype, std::span<const int32_t> tokens,
                               Routings* record = nullptr, const Routings* replay = nullptr) {
  Decoder& decoder = model.decoder();
  size_t next = 0;
  decoder.set_routing_observer(
      record ? Decoder::RoutingObserver(
                   [record](int64_t, const moe::Routing& r) { record->push_back(r); })
             : nullptr);
  decoder.set_routing_override(
      replay ? Decoder::RoutingOverride(
                   [&](int64_t, const float*, const moe::RouterOptions&, moe::Routing& routing) {
                     ASSERT_LT(next, replay->size());
                     ASSERT_EQ(routing.num_tokens, (*replay)[next].num_tokens);
                     routing = (*replay)[next++];
                   })
             : nullptr);
  KvCache cache = decoder.make_cache(64, dtype);
  EXPECT_EQ(cache.pool().dtype(), dtype);
  const int64_t V = model.config().vocab_size;
  const size_t prefill = tokens.size() - 4;
  std::vector<float> logits(tokens.size() * V);
  decoder.forward(tokens.first(prefill), cache, std::span(logits.data(), prefill * V),
                  /*all_positions=*/true);
  for (size_t i = prefill; i < tokens.size(); ++i) {
    decoder.forward(tokens.subspan(i, 1), cache, std::span(logits.data() + i * V, V), false);
  }
  decoder.set_routing_observer(nullptr);
  decoder.set_routing_override(nullptr);
  if (replay) EXPECT_EQ(next, replay->size());
  return logits;
}

struct Error2 {
  double relative = 0.0;  // ||y - x|| / ||x|| over every logit
  double max_abs = 0.0;
};

Error2 compare(const std::vector<float>& x, const std::vector<float>& y) {
  double norm = 0.0, diff = 0.0, max_abs = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double d = double{y[i]} - x[i];
    norm += double{x[i]} * x[i];
    diff += d * d;
    max_abs = std::max(max_abs, std::fabs(d));
  }
  return {.relative = std::sqrt(diff / norm), .max_abs = max_abs};
}

// A random fixture's router sits near ties, so a rounding anywhere upstream flips some token's
// experts and that token's logits move by far more than the rounding (and every later token
// that attends to it): measured on 2026-12-05, qwen3_moe_f32 with bf16 rows is 2e-3 off at the
// first four positions, then a flip at position 4 takes it to 0.2. So the bound that tests the
// cache holds the routing fixed, replaying the f32 run's experts and weights: what is left is the
// rounding of the rows through attention and the layers after it. The free-running error is
// printed and only bounded loosely. Measured (relative L2 of all 16 positions' logits, routing
// replayed / free): qwen3_moe_f32 bf16 3.2e-3 / 7.8e-2, fp8 4.2e-2 / 8.8e-2; deepseek_v2_lite_f32
// bf16 2.5e-3 / 2.4e-3, fp8 4.1e-2 / 4.5e-2. The bounds, 1e-2 and 1e-1, leave 2.4x or more.
void expect_near_f32(const char* name, double bf16_bound, double fp8_bound) {
  SCOPED_TRACE(name);
  auto model = Model::load(fixture(name), LoadOptions{.prefault = false});
  const int32_t tokens[] = {1, 17, 42, 99, 7, 250, 3, 11, 64, 128, 5, 300, 23, 8, 77, 150};
  Routings routing;
  const std::vector<float> f32 = logits_with(*model, KvDType::kF32, tokens, &routing);
  ASSERT_FALSE(routing.empty());
  // Replaying a run's own routing changes nothing; the default cache is float32.
  EXPECT_EQ(logits_with(*model, KvDType::kF32, tokens, nullptr, &routing), f32);
  EXPECT_EQ(model->decoder().make_cache(8).pool().dtype(), KvDType::kF32);
  for (KvDType dtype : {KvDType::kBF16, KvDType::kFP8}) {
    const Error2 pinned = compare(f32, logits_with(*model, dtype, tokens, nullptr, &routing));
    const Error2 free = compare(f32, logits_with(*model, dtype, tokens));
    std::printf(
        "%s --kv-dtype %s: relative L2 error of the logits %.3e (max abs %.3e) with the f32 "
        "run's routing, %.3e (max abs %.3e) routing freely\n",
        name, std::string(kv_dtype_name(dtype)).c_str(), pinned.relative, pinned.max_abs,
        free.relative, free.max_abs);
    EXPECT_GT(pinned.relative, 0.0) << "the rounded cache changed nothing";
    EXPECT_LT(pinned.relative, dtype == KvDType::kBF16 ? bf16_bound : fp8_bound);
    EXPECT_LT(free.relative, 0.5);  // a few flipped tokens, not garbage
  }
}

TEST(KvDtype, GqaLogitsStayNearFloat32Rows) { expect_near_f32("qwen3_moe_f32", 1e-2, 1e-1); }

TEST(KvDtype, MlaLogitsStayNearFloat32Rows) { expect_near_f32("deepseek_v2_lite_f32", 1e-2, 1e-1); }

// The planner counts what the pool allocates and the engine sizes its pool by, at every dtype.
TEST(KvDtype, PlannerPoolAndEngineAgreeOnBytesPerToken) {
  constexpr int64_t kKvCacheMb = 4;
  for (const char* name : {"qwen3_moe_f32", "deepseek_v2_lite_f32", "qwen3_next_f32"}) {
    SCOPED_TRACE(name);
    auto model = Model::load(fixture(name), LoadOptions{.prefault = false});
    int64_t f32_tokens = 0;
    for (KvDType dtype : kDtypes) {
      SCOPED_TRACE(std::string(kv_dtype_name(dtype)));
      auto engine =
          Engine::load(fixture(name), EngineConfig{.kv_cache_mb = kKvCacheMb, .kv_dtype = dtype},
                       LoadOptions{.prefault = false});
      const ModelConfig& config = engine->model_config();
      const CapacityPlan plan = plan_capacity(config, PlanOptions{.kv_dtype = dtype});
      const KvCache cache = model->decoder().make_cache(8, dtype);
      const KvBlockPool pool = model->decoder().make_pool(16, 1, 1, dtype);
      EXPECT_EQ(static_cast<size_t>(plan.kv_bytes_per_token), cache.bytes_per_token());
      EXPECT_EQ(static_cast<size_t>(plan.kv_bytes_per_token), pool.bytes_per_token());
      EXPECT_EQ(plan.kv_bytes_per_token, kv_bytes_per_token(config, dtype));
      const int64_t block = engine->config().block_size;
      const int64_t tokens = engine->num_kv_blocks() * block;
      EXPECT_EQ(engine->num_kv_blocks(), (kKvCacheMb << 20) / (plan.kv_bytes_per_token * block));
      std::printf("%s --kv-dtype %s: %lld B per token, %lld tokens in %lld MiB\n", name,
                  std::string(kv_dtype_name(dtype)).c_str(),
                  static_cast<long long>(plan.kv_bytes_per_token), static_cast<long long>(tokens),
                  static_cast<long long>(kKvCacheMb));
      if (dtype == KvDType::kF32) f32_tokens = tokens;
      if (dtype == KvDType::kFP8) {
        // fp8 holds close to 4x the f32 tokens (less the scales' share, 4 B per head of D).
        EXPECT_GT(tokens, 3 * f32_tokens);
      }
    }
  }
}

}  // namespace
}  // namespace moeinfer
