// Qwen3-Next and Qwen3.5-MoE on the GPU held to the CPU decoder (which matches transformers on
// these fixtures, tests/model/) beyond the reference's single sequence:
//   scheduled   tests/support/random_schedule.h's steps on both decoders (gpu_cpu_compare.h):
//               two prompts prefilled together, a third in two chunks the second of which shares
//               a mixed step with the others' next tokens, batched decode of three and then two
//               sequences in graph buckets with padding; every sequence in its own state slot
//   reused slot a decode-graph step in which a new one-token sequence takes over the state slot
//               a finished sequence left full: the kernels must start it from zeros, inside the
//               graph replay, as the CPU's reset does
//   engine      the cuda engine with --deterministic (batch-invariant kernels): five greedy
//               requests batched with chunked prefill, more requests than state slots, and
//               preemption by recompute each give exactly the tokens every request gives alone,
//               so the scheduler's slots reach the device state and a recompute restarts it
// Bounds: relative logit error <= 2e-2 on every route (the parity test's), no routing mismatch;
// the engine's tokens equal.
// Registered only where a CUDA device is visible.
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "../support/engine_runs.h"
#include "../support/model_fixtures.h"
#include "cuda_test_util.h"
#include "gpu_cpu_compare.h"
#include "model/model.h"

namespace moeinfer {
namespace {

constexpr double kMaxRelError = 2e-2;
const char* const kFixtures[] = {"qwen3_next_f32", "qwen3_next_bf16", "qwen3_5_moe_f32",
                                 "qwen3_5_moe_bf16"};

void scheduled_steps_match_cpu() {
  for (const char* name : kFixtures) {
    SCOPED_TRACE(name);
    auto model = Model::load(testing_support::kModelFixtures / name, LoadOptions{.prefault = false});
    ASSERT_TRUE(model->config().linear_attention.has_value());
    const testing::ConfigResult r = testing::compare_gpu_with_cpu(
        model->config(), model->decoder().weights(), cuda::testing_util::fresh_seed(), false);
    std::printf("%-18s rel error prefill %.3e chunked %.3e decode %.3e, top-1 %lld/%lld\n", name,
                r.routes[0].rel(), r.routes[1].rel(), r.routes[2].rel(),
                static_cast<long long>(r.same_top1), static_cast<long long>(r.positions));
    EXPECT_GT(r.positions, 0);
    EXPECT_LE(r.worst(), kMaxRelError)
        << "rel error prefill " << r.routes[0].rel() << " chunked " << r.routes[1].rel()
        << " decode " << r.routes[2].rel();
    EXPECT_EQ(r.routing_mismatches, 0) << r.first_mismatch;
  }
}

std::vector<int32_t> iota_blocks(int32_t first, int32_t count) {
  std::vector<int32_t> out(static_cast<size_t>(count));
  std::iota(out.begin(), out.end(), first);
  return out;
}

double rel_error(const std::vector<float>& ours, const std::vector<float>& ref) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(ours[i])) return INFINITY;
    diff += std::pow(double{ours[i]} - ref[i], 2);
    norm += std::pow(double{ref[i]}, 2);
  }
  return std::sqrt(diff / norm);
}

void reused_slot_starts_from_zeros() {
  for (const char* name : {"qwen3_next_bf16", "qwen3_5_moe_bf16"}) {
    SCOPED_TRACE(name);
    auto model = Model::load(testing_support::kModelFixtures / name, LoadOptions{.prefault = false});
    const ModelConfig& c = model->config();
    const int64_t V = c.vocab_size, block_size = 16, blocks_per_seq = 2;
    auto gpu = GpuDecoder::create(c, model->decoder().weights(),
                                  GpuOptions{.max_batch_tokens = 64, .max_num_seqs = 4,
                                             .max_model_len = 32, .num_kv_blocks = 8,
                                             .quiet = true});
    ASSERT_EQ(gpu->num_state_slots(), 4);
    Decoder cpu(c, model->decoder().weights());
    KvBlockPool pool = cpu.make_pool(block_size, 8, 4);
    // Two sequences decode token by token from position 0 (graph steps of two rows), sequence A
    // in slot 2 and B in slot 0; after five steps A finishes and a new sequence C, one token,
    // takes slot 2 at position 0 beside B's sixth token.
    const std::vector<int32_t> a_tokens{5, 17, 301, 44, 9}, b_tokens{7, 8, 9, 10, 11, 12, 13};
    const std::vector<int32_t> c_tokens{123};
    const auto table_a = iota_blocks(0, blocks_per_seq), table_b = iota_blocks(2, blocks_per_seq),
               table_c = iota_blocks(4, blocks_per_seq);
    std::vector<float> ours(2 * V), ref(2 * V);
    double worst = 0.0;
    for (int64_t t = 0; t <= 5; ++t) {
      ForwardBatch batch;
      if (t < 5) {
        batch.sequences.push_back({.tokens = std::span<const int32_t>(a_tokens).subspan(t, 1),
                                   .position = t, .block_table = table_a, .state_slot = 2});
      } else {
        batch.sequences.push_back({.tokens = c_tokens, .position = 0, .block_table = table_c,
                                   .state_slot = 2});
      }
      batch.sequences.push_back({.tokens = std::span<const int32_t>(b_tokens).subspan(t, 1),
                                 .position = t, .block_table = table_b, .state_slot = 0});
      std::fill(ours.begin(), ours.end(), NAN);
      gpu->forward(batch, ours);
      cpu.forward(batch, pool, ref);
      const double e = rel_error(ours, ref);
      worst = std::max(worst, e);
      EXPECT_LE(e, kMaxRelError) << "step " << t << (t == 5 ? " (slot 2 reused)" : "");
    }
    std::printf("%-18s reused slot: worst rel error %.3e\n", name, worst);
  }
}

std::unique_ptr<Engine> cuda_engine(const std::filesystem::path& dir, EngineConfig config) {
  config.device = "cuda";
  config.max_model_len = 64;
  config.gpu_memory_fraction = 0.5;
  config.deterministic = true;
  return Engine::load(dir, config);
}

void engine_runs_each_request_as_alone() {
  for (const char* name : {"qwen3_next_bf16", "qwen3_5_moe_f32"}) {
    SCOPED_TRACE(name);
    const auto dir = testing_support::kModelFixtures / name;
    const std::vector<std::vector<int32_t>> prompts = {
        {5, 17, 301, 44, 9, 120, 7, 66, 210}, {3, 77, 12}, {400, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13},
        {250, 251, 9, 9, 9, 9}, {31, 41, 59, 26, 53, 58, 97, 93, 23, 84, 62}};
    const GenerationParams greedy{.max_tokens = 20, .ignore_eos = true};
    std::vector<std::vector<int32_t>> alone;
    {
      auto engine = cuda_engine(dir, {.max_num_seqs = 1, .block_size = 8, .num_kv_blocks = 16});
      for (const auto& p : prompts) {
        engine->add_request(p, greedy);
        alone.push_back(testing::run_requests(*engine).begin()->second.tokens);
        ASSERT_EQ(alone.back().size(), 20u);
      }
    }
    struct Case {
      const char* what;
      EngineConfig config;
      bool preempts;
    };
    const Case cases[] = {
        {"batched, chunks of 5 tokens",
         {.max_num_seqs = 4, .max_num_batched_tokens = 5, .block_size = 8, .num_kv_blocks = 32},
         false},
        {"2 state slots for 5 requests", {.max_num_seqs = 2, .block_size = 8, .num_kv_blocks = 32},
         false},
        // 8 blocks of 8 tokens: one and a half requests' worth.
        {"preemption by recompute", {.max_num_seqs = 4, .block_size = 8, .num_kv_blocks = 8},
         true},
    };
    for (const Case& c : cases) {
      SCOPED_TRACE(c.what);
      auto engine = cuda_engine(dir, c.config);
      std::vector<RequestId> ids;
      for (const auto& p : prompts) ids.push_back(engine->add_request(p, greedy));
      auto runs = testing::run_requests(*engine);
      for (size_t i = 0; i < ids.size(); ++i) {
        EXPECT_EQ(runs[ids[i]].tokens, alone[i]) << "request " << i;
      }
      if (c.preempts) EXPECT_GT(engine->stats().num_preemptions, 0);
      EXPECT_EQ(engine->stats().num_running, 0);
    }
  }
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda::testing_util::cuda_device_present("Qwen3-Next decoder")) return false;
  cuda::testing_util::register_kernel_test("CudaQwen3Next", "ScheduledStepsMatchTheCpu",
                                           scheduled_steps_match_cpu, __FILE__, __LINE__);
  cuda::testing_util::register_kernel_test("CudaQwen3Next", "ReusedSlotStartsFromZerosInAGraph",
                                           reused_slot_starts_from_zeros, __FILE__, __LINE__);
  cuda::testing_util::register_kernel_test("CudaQwen3Next", "EngineRunsEachRequestAsAlone",
                                           engine_runs_each_request_as_alone, __FILE__,
                                           __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer

#endif  // MOE_HAVE_CUDA
