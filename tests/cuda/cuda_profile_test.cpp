// The stage profiler on the GPU decoder: with a profiler installed, a decode step (graph path,
// captured with its events) and a prefill step (eager) report a positive time for every stage of
// every layer, the plan's rows per expert (T * K per MoE layer), and the bytes moved on the device
// and between host and device; the logits are the same as without the profiler. With sampled
// timing (time_every 3) only every third step carries stage times, every step its rows and
// bytes; a timed forward_sample times the sampling kernel; the padding rows of a graph bucket
// count for no expert; the routing observer reports every MoE layer's choices.
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <numeric>
#include <vector>

#include "cuda_test_util.h"
#include "kv/kv_cache.h"
#include "model/gpu_decoder.h"
#include "model/model.h"
#include "profile/profiler.h"

namespace moeinfer {
namespace {

using profile::Stage;

// The Qwen2-MoE fixture (shared experts with a sigmoid gate beside the routed ones).
std::unique_ptr<Model> load_fixture() {
  const auto dir = std::filesystem::path(MOE_FIXTURES_DIR) / "models" / "qwen2_moe_f32";
  return Model::load(dir, LoadOptions{.prefault = false});
}

// A GPU decoder over it: 4 sequences, 64 tokens, 8 KV blocks. Route and plan as two stages
// at every step (the fused route-and-plan kernel of small steps is timed as route alone).
std::unique_ptr<GpuDecoder> small_decoder(Model& model) {
  return GpuDecoder::create(model.config(), model.decoder().weights(),
                            GpuOptions{.max_batch_tokens = 64,
                                       .max_num_seqs = 4,
                                       .max_model_len = 64,
                                       .num_kv_blocks = 8,
                                       .quiet = true,
                                       .fused_route_tokens = 0});
}

void profiled_steps_report_every_stage() {
  auto model = load_fixture();
  const ModelConfig& c = model->config();
  auto gpu = small_decoder(*model);
  const std::vector<int32_t> prompt = {3, 14, 15, 92, 65, 35, 89, 79};
  const std::vector<int32_t> table = {0, 1, 2, 3};
  const int64_t V = c.vocab_size, L = c.num_layers, E = c.num_experts, K = c.num_experts_per_tok;

  auto run = [&](profile::Profiler* profiler, int64_t length, std::vector<float>& logits) {
    profile::ActiveProfiler on(profiler);
    if (profiler) profiler->begin_step(length);
    const std::span<const int32_t> tokens(prompt.data(), static_cast<size_t>(length));
    gpu->forward({.sequences = {{.tokens = length == 1 ? tokens.subspan(0, 1) : tokens,
                                 .position = 0, .block_table = table}}},
                 logits);
    if (profiler) profiler->end_step();
  };
  profile::Profiler profiler({.num_layers = L, .num_experts = E});
  // Decode steps: the first of a graph bucket (eager), its first replay (the graph's own events,
  // or, where the device cannot time events a graph recorded, no stage times for that one step
  // and eager profiled steps after it), a later one; then a prefill.
  const std::vector<int64_t> lengths = {1, 1, 1, static_cast<int64_t>(prompt.size())};
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int64_t length = lengths[i];
    std::vector<float> plain(V), profiled(V);
    run(nullptr, length, plain);
    run(&profiler, length, profiled);
    EXPECT_EQ(plain, profiled) << "the profiler changed the logits at length " << length;
    const profile::StepRecord& r = profiler.steps().back();
    const bool timed = i != 1 || r.ns(0, Stage::kAttention) > 0;
    if (!timed) std::printf("CudaProfile: graph-recorded events are not timed here\n");
    for (int64_t l = 0; l < L && timed; ++l) {
      EXPECT_GT(r.ns(l, Stage::kAttention), 0) << "layer " << l;
      if (!c.layer_is_moe[l]) {
        EXPECT_GT(r.ns(l, Stage::kDenseMlp), 0) << "layer " << l;
        continue;
      }
      for (Stage s : {Stage::kRoute, Stage::kPlan, Stage::kExperts, Stage::kSharedExperts,
                      Stage::kUnpermute}) {
        EXPECT_GT(r.ns(l, s), 0) << "layer " << l << " stage " << profile::stage_name(s);
      }
    }
    if (timed) EXPECT_GT(r.ns(L, Stage::kLmHead), 0);
    for (int64_t l = 0; l < L; ++l) {
      if (!c.layer_is_moe[l]) continue;
      const int64_t rows = std::accumulate(r.expert_rows.begin() + l * E,
                                           r.expert_rows.begin() + (l + 1) * E, int64_t{0});
      EXPECT_EQ(rows, length * K) << "layer " << l;
    }
    EXPECT_GT(r.link_bytes[static_cast<int>(profile::Link::kOnDevice)], 0);
    EXPECT_GE(r.link_bytes[static_cast<int>(profile::Link::kHostDevice)], V * 4);
  }
}

void sampled_timing_counts_every_step() {
  auto model = load_fixture();
  const ModelConfig& c = model->config();
  auto gpu = small_decoder(*model);
  const std::vector<int32_t> token = {92};
  const std::vector<int32_t> table = {0};
  const int64_t V = c.vocab_size, L = c.num_layers, E = c.num_experts, K = c.num_experts_per_tok;
  const ForwardBatch batch{.sequences = {{.tokens = token, .position = 0, .block_table = table}}};
  std::vector<float> plain(V);
  gpu->forward(batch, plain);

  profile::Profiler profiler({.num_layers = L, .num_experts = E, .time_every = 3});
  profile::ActiveProfiler on(&profiler);
  for (int step = 0; step < 7; ++step) {
    std::vector<float> logits(V);
    profiler.begin_step(1);
    gpu->forward(batch, logits);
    profiler.end_step();
    EXPECT_EQ(logits, plain) << "step " << step;
    const profile::StepRecord& r = profiler.steps().back();
    EXPECT_EQ(r.timed, step % 3 == 0) << "step " << step;
    const int64_t staged = std::accumulate(r.stage_ns.begin(), r.stage_ns.end(), int64_t{0});
    if (r.timed) {
      EXPECT_GT(r.ns(L, Stage::kLmHead), 0) << "step " << step;
      for (int64_t l = 0; l < L; ++l) EXPECT_GT(r.ns(l, Stage::kAttention), 0) << "layer " << l;
    } else {
      EXPECT_EQ(staged, 0) << "step " << step << " was not to be timed";
    }
    for (int64_t l = 0; l < L; ++l) {
      if (!c.layer_is_moe[l]) continue;
      const int64_t rows = std::accumulate(r.expert_rows.begin() + l * E,
                                           r.expert_rows.begin() + (l + 1) * E, int64_t{0});
      EXPECT_EQ(rows, K) << "step " << step << " layer " << l;
    }
    EXPECT_GE(r.link_bytes[static_cast<int>(profile::Link::kHostDevice)], V * 4);
  }

  // Sampling on the device: a timed step times the sampling kernel too (step level).
  profile::Profiler every({.num_layers = L, .num_experts = E});
  profile::ActiveProfiler sampling(&every);
  const GpuSamplingRow row{.temperature = 0.7f, .top_k = 20, .top_p = 0.9f, .seed = 3};
  int32_t sampled = -1;
  every.begin_step(1);
  gpu->forward_sample(batch, std::span<const GpuSamplingRow>(&row, 1),
                      std::span<int32_t>(&sampled, 1));
  every.end_step();
  EXPECT_GE(sampled, 0);
  EXPECT_LT(sampled, V);
  EXPECT_GT(every.steps().back().ns(L, Stage::kSample), 0);
  EXPECT_GT(every.steps().back().ns(L, Stage::kLmHead), 0);
}

// Three sequences decode in a graph bucket of four rows: the padding row routes to no expert, so
// each MoE layer counts 3 * K rows, on the eager first step and on the graph's replay.
void padded_bucket_counts_real_rows_only() {
  auto model = load_fixture();
  const ModelConfig& c = model->config();
  auto gpu = small_decoder(*model);
  const std::vector<int32_t> a = {5}, b = {17}, d = {230};
  const std::vector<int32_t> ta = {0}, tb = {1}, td = {2};
  const ForwardBatch batch{.sequences = {{.tokens = a, .position = 0, .block_table = ta},
                                         {.tokens = b, .position = 0, .block_table = tb},
                                         {.tokens = d, .position = 0, .block_table = td}}};
  const int64_t V = c.vocab_size, L = c.num_layers, E = c.num_experts, K = c.num_experts_per_tok;
  profile::Profiler profiler({.num_layers = L, .num_experts = E});
  profile::ActiveProfiler on(&profiler);
  for (int step = 0; step < 2; ++step) {
    std::vector<float> logits(3 * V);
    profiler.begin_step(3);
    gpu->forward(batch, logits);
    profiler.end_step();
    const profile::StepRecord& r = profiler.steps().back();
    for (int64_t l = 0; l < L; ++l) {
      if (!c.layer_is_moe[l]) continue;
      const int64_t rows = std::accumulate(r.expert_rows.begin() + l * E,
                                           r.expert_rows.begin() + (l + 1) * E, int64_t{0});
      EXPECT_EQ(rows, 3 * K) << "step " << step << " layer " << l;
    }
    const std::vector<int32_t> counts = gpu->expert_counts();
    for (int64_t l = 0; l < L; ++l) {
      if (!c.layer_is_moe[l]) continue;
      EXPECT_EQ(std::accumulate(counts.begin() + l * E, counts.begin() + (l + 1) * E, int64_t{0}),
                3 * K)
          << "expert_counts(), step " << step << " layer " << l;
    }
  }
}

// The routing observer on the GPU: a prefill and a padded decode bucket report every MoE
// layer's routing of the real tokens only; each layer's ids add up to the plan's counts, the
// weights are finite and positive, the logits are those of a run without the observer, and the
// prefill's choices agree with the CPU decoder's (bf16 may flip near-ties, so 90% of them).
void routing_observer_reports_every_layer() {
  auto model = load_fixture();
  const ModelConfig& c = model->config();
  const int64_t V = c.vocab_size, L = c.num_layers, E = c.num_experts, K = c.num_experts_per_tok;
  const std::vector<int32_t> prompt = {3, 14, 15, 92, 65, 35, 89, 79};
  const std::vector<int32_t> t0 = {0}, t1 = {1}, t2 = {2};
  const ForwardBatch prefill{.sequences = {{.tokens = prompt, .position = 0, .block_table = t0}}};
  const std::vector<int32_t> a = {5}, b = {17}, d = {230};
  const ForwardBatch decode{.sequences = {{.tokens = a, .position = 0, .block_table = t1},
                                          {.tokens = b, .position = 0, .block_table = t2},
                                          {.tokens = d, .position = 8, .block_table = t0}}};
  auto plain = small_decoder(*model), traced = small_decoder(*model);
  std::vector<std::vector<int32_t>> ids(L);
  std::vector<int64_t> tokens(L, -1);
  traced->set_routing_observer([&](int64_t layer, const moe::Routing& routing) {
    tokens[layer] = routing.num_tokens;
    ids[layer] = routing.topk_ids;
    EXPECT_EQ(routing.top_k, K);
    for (float w : routing.topk_weights) EXPECT_TRUE(std::isfinite(w) && w > 0.0f) << w;
  });

  std::vector<int32_t> cpu_ids;  // the CPU decoder's prefill choices, layer by layer
  model->decoder().set_routing_observer([&](int64_t, const moe::Routing& routing) {
    cpu_ids.insert(cpu_ids.end(), routing.topk_ids.begin(), routing.topk_ids.end());
  });
  KvCache cache = model->decoder().make_cache(64);
  std::vector<float> cpu_logits(V);
  model->decoder().forward(prompt, cache, cpu_logits, /*all_positions=*/false);
  model->decoder().set_routing_observer(nullptr);

  int64_t agree = 0, total = 0;
  size_t cpu_at = 0;
  for (const ForwardBatch* batch : {&prefill, &decode, &decode}) {
    const int64_t n = batch == &prefill ? static_cast<int64_t>(prompt.size()) : 3;
    std::vector<float> want(batch == &prefill ? V : 3 * V), got(want.size());
    plain->forward(*batch, want);
    std::fill(tokens.begin(), tokens.end(), -1);
    traced->forward(*batch, got);
    EXPECT_EQ(got, want) << "the routing observer changed the logits";
    const std::vector<int32_t> counts = traced->expert_counts();
    for (int64_t l = 0; l < L; ++l) {
      if (!c.layer_is_moe[l]) {
        EXPECT_EQ(tokens[l], -1) << "dense layer " << l << " reported";
        continue;
      }
      ASSERT_EQ(tokens[l], n) << "layer " << l;
      ASSERT_EQ(static_cast<int64_t>(ids[l].size()), n * K);
      std::vector<int32_t> histogram(E, 0);
      for (int32_t e : ids[l]) {
        ASSERT_TRUE(e >= 0 && e < E) << e;
        ++histogram[e];
      }
      EXPECT_TRUE(std::equal(histogram.begin(), histogram.end(), counts.begin() + l * E))
          << "layer " << l;
      if (batch != &prefill) continue;
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t k = 0; k < K; ++k, ++total) {
          const auto cpu_row = cpu_ids.begin() + cpu_at + t * K;
          agree += std::count(cpu_row, cpu_row + K, ids[l][t * K + k]) > 0;
        }
      }
      cpu_at += n * K;
    }
  }
  EXPECT_GE(static_cast<double>(agree), 0.9 * static_cast<double>(total))
      << agree << " of " << total << " choices agree with the CPU decoder";
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda::testing_util::cuda_device_present("profile")) return false;
  cuda::testing_util::register_kernel_test("CudaProfile", "ProfiledStepsReportEveryStage",
                                           profiled_steps_report_every_stage, __FILE__, __LINE__);
  cuda::testing_util::register_kernel_test("CudaProfile", "SampledTimingCountsEveryStep",
                                           sampled_timing_counts_every_step, __FILE__, __LINE__);
  cuda::testing_util::register_kernel_test("CudaProfile", "RoutingObserverReportsEveryLayer",
                                           routing_observer_reports_every_layer, __FILE__,
                                           __LINE__);
  cuda::testing_util::register_kernel_test("CudaProfile", "PaddedBucketCountsRealRowsOnly",
                                           padded_bucket_counts_real_rows_only, __FILE__,
                                           __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer

#endif  // MOE_HAVE_CUDA
