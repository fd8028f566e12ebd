// `moeinfer plan`'s numbers against what the CPU engine really allocates (issue 4, item 4):
//   weights    the plan's resident bytes by part (bf16) against the tensors the engine binds
//              from the demo checkpoint (bf16 as stored), part by part and in total
//   KV/token   the plan's bytes per token at --kv-dtype f32 (the CPU pool stores float32 rows)
//              against an Engine's pool: its kv_cache_mb over the tokens it holds; MLA (the
//              deepseek_v3 fixture) caches the latent row only
//   tokens     the plan's "tokens of KV that fit" against the Engine's num_kv_blocks x block_size
//              for the same memory (see kv_tokens_like_the_engine for what is compared)
// All within 5%. The GPU side (device weights, bf16 pool, gpu_memory_fraction) is
// tests/cuda/cuda_capacity_plan_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>

#include "capacity_plan_checks.h"
#include "model/capacity_plan.h"
#include "model/model.h"
#include "model/model_facts.h"
#include "runtime/engine.h"

namespace moeinfer {
namespace {

const std::filesystem::path kFixtures = MOE_FIXTURES_DIR;
const std::filesystem::path kDemo = kFixtures / ".." / ".." / "models" / "demo";
constexpr int64_t kKvCacheMb = 64;

using testing_util::expect_within;
using testing_util::kGiB;
using testing_util::rel_diff;

TEST(CapacityPlanAlloc, DemoWeightBytesByPartMatchTheBoundTensors) {
  auto model = Model::load(kDemo, LoadOptions{.prefault = false});
  const ModelConfig& config = model->config();
  const int64_t mapped = static_cast<int64_t>(model->store().total_bytes());
  // The tensors the decoder bound, in their stored dtype (bf16 for the demo), by part.
  const ModelFacts facts = model_facts(config, model->decoder().weights(), mapped);
  const CapacityPlan plan = plan_capacity(config, PlanOptions{.kv_dtype = KvDType::kF32});
  const PartCounts& p = plan.weight_bytes;
  const PartCounts& r = facts.resident_bytes;
  expect_within(p.attention, r.attention, "attention");
  expect_within(p.routed_experts, r.routed_experts, "routed experts");
  expect_within(p.embeddings, r.embeddings, "embeddings");
  expect_within(p.other, r.other, "other");
  EXPECT_EQ(p.shared_experts, r.shared_experts);  // none in the demo
  expect_within(p.total(), r.total(), "bound total");
  expect_within(p.total(), mapped, "mapped checkpoint tensors");
  std::printf("demo weights: plan %lld B, bound %lld B (%+.4f%%), checkpoint tensors %lld B\n",
              static_cast<long long>(p.total()), static_cast<long long>(r.total()),
              100 * rel_diff(p.total(), r.total()), static_cast<long long>(mapped));
}

// The CPU engine has no device budget: its pool is kv_cache_mb of float32 rows, rounded down to
// whole blocks (runtime/engine.cpp, pool_blocks). The planner's "tokens that fit" is
// (gpu_mem x memory_fraction - workspace - weights) / KV bytes per token. To compare like with
// like the plan gets a "GPU" of exactly the weights the engine holds plus its KV budget, no
// fraction and no workspace, so what remains is the planner's own weight estimate subtracted and
// the rest divided by its bytes per token; the engine's answer is the blocks it built.
struct KvComparison {
  int64_t plan_bytes_per_token = 0;
  double engine_bytes_per_token = 0.0;  // kv_cache_mb over the tokens the pool holds
  int64_t plan_tokens = 0;
  int64_t engine_tokens = 0;
};

KvComparison kv_tokens_like_the_engine(const std::filesystem::path& dir,
                                       int64_t engine_weight_bytes_or_0) {
  auto engine =
      Engine::load(dir, EngineConfig{.kv_cache_mb = kKvCacheMb}, LoadOptions{.prefault = false});
  const ModelConfig& config = engine->model_config();
  const int64_t kv_bytes = kKvCacheMb << 20;
  KvComparison c;
  c.engine_tokens = engine->num_kv_blocks() * engine->config().block_size;
  c.engine_bytes_per_token = static_cast<double>(kv_bytes) / static_cast<double>(c.engine_tokens);

  const CapacityPlan sizing = plan_capacity(config, PlanOptions{.kv_dtype = KvDType::kF32});
  const int64_t weights =
      engine_weight_bytes_or_0 > 0 ? engine_weight_bytes_or_0 : sizing.weight_bytes.total();
  const CapacityPlan plan = plan_capacity(
      config, PlanOptions{.num_gpus = 1,
                          .gpu_mem_gib = static_cast<double>(weights + kv_bytes) / kGiB,
                          .kv_dtype = KvDType::kF32,
                          .memory_fraction = 1.0,
                          .workspace_gib = 0.0});
  EXPECT_EQ(plan.layout, Layout::kSingleGpu) << dir;
  c.plan_bytes_per_token = plan.kv_bytes_per_token;
  c.plan_tokens = plan.kv_tokens_fit;
  return c;
}

void check_kv(const std::string& name, const KvComparison& c) {
  expect_within(c.plan_bytes_per_token, c.engine_bytes_per_token, name + " KV bytes per token");
  expect_within(c.plan_tokens, c.engine_tokens, name + " tokens of KV that fit");
  std::printf(
      "%s KV (f32): plan %lld B/token, engine %.1f B/token (%+.3f%%); tokens in %lld "
      "MiB: plan %lld, engine %lld (%+.3f%%)\n",
      name.c_str(), static_cast<long long>(c.plan_bytes_per_token), c.engine_bytes_per_token,
      100 * rel_diff(c.plan_bytes_per_token, c.engine_bytes_per_token),
      static_cast<long long>(kKvCacheMb), static_cast<long long>(c.plan_tokens),
      static_cast<long long>(c.engine_tokens), 100 * rel_diff(c.plan_tokens, c.engine_tokens));
}

TEST(CapacityPlanAlloc, DemoKvBytesAndTokensMatchTheEnginePool) {
  // The weights the engine maps are the checkpoint's bf16 tensors, the same dtype as the plan.
  const int64_t mapped = static_cast<int64_t>(WeightStore::open(kDemo).total_bytes());
  check_kv("demo", kv_tokens_like_the_engine(kDemo, mapped));
}

TEST(CapacityPlanAlloc, MlaKvBytesAndTokensMatchTheEnginePool) {
  // The deepseek_v3 fixture is stored in float32, which the planner has no weight dtype for, so
  // its "GPU" is the plan's own bf16 weights + the KV budget: this compares the MLA-aware bytes
  // per token (one latent row of kv_lora_rank + rope dims per layer, no values) and the
  // division, not the weight estimate (the demo test does that).
  const auto dir = kFixtures / "models" / "deepseek_v3_f32";
  const ModelConfig config = load_model_config(dir / "config.json");
  ASSERT_TRUE(config.mla.has_value());
  const KvComparison c = kv_tokens_like_the_engine(dir, 0);
  EXPECT_EQ(c.plan_bytes_per_token, config.num_layers * config.mla->cache_width() * 4);
  check_kv("deepseek_v3_f32 (MLA)", c);
}

}  // namespace
}  // namespace moeinfer
