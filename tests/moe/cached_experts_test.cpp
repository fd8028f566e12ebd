// The CPU's simulated expert budget (moe/cached_experts.h) behind the decoder: at every budget
// (100%, 50%, 25%, 10% and 0, where every demand is read from home) and with every policy, the
// logits of a prefill, a chunked prefill and decode steps are bit for bit those of the resident
// run, and the counters add up: each step's distinct (layer, expert) demands are hits, misses or
// unplaced, and the bytes host to device are one expert's bytes per copy and per unplaced read.
#include "moe/cached_experts.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "../support/model_fixtures.h"
#include "core/error.h"
#include "model/model.h"
#include "offload/parse_options.h"
#include "parallel/communicator.h"
#include "profile/profiler.h"
#include "profile/routing_trace.h"

namespace moeinfer {
namespace {

const std::filesystem::path& kModels = testing_support::kModelFixtures;
using testing_support::model_fixture_names;

// What one run of the workload saw.
struct WorkloadRun {
  std::vector<float> logits;     // every forward's logits, concatenated
  int64_t distinct_demands = 0;  // sum over (forward, MoE layer) of distinct experts routed
};

// A prefill of 6 tokens, a second chunk of 5, then 4 decode steps, on a fresh cache; with a
// profiler installed (so that the counters reach it too) and a routing observer counting each
// step's distinct experts per layer. `trace`, when given, records the routing.
WorkloadRun run_workload(Decoder& decoder, const std::vector<int32_t>& tokens,
                         profile::Profiler* profiler, RoutingTraceWriter* trace = nullptr) {
  const int64_t V = decoder.config().vocab_size;
  WorkloadRun run;
  decoder.set_routing_observer([&](int64_t layer, const moe::Routing& routing) {
    run.distinct_demands += static_cast<int64_t>(
        std::set<int32_t>(routing.topk_ids.begin(), routing.topk_ids.end()).size());
    if (trace) trace->record(layer, routing);
  });
  profile::ActiveProfiler on(profiler);
  KvCache cache = decoder.make_cache(32);
  auto forward = [&](std::span<const int32_t> chunk, bool all_positions) {
    const size_t rows = all_positions ? chunk.size() : 1;
    std::vector<float> logits(rows * V, NAN);
    if (profiler) profiler->begin_step(static_cast<int64_t>(chunk.size()));
    decoder.forward(chunk, cache, logits, all_positions);
    if (profiler) profiler->end_step();
    if (trace) trace->next_step();
    run.logits.insert(run.logits.end(), logits.begin(), logits.end());
  };
  const std::span<const int32_t> all(tokens);
  forward(all.subspan(0, 6), /*all_positions=*/true);
  forward(all.subspan(6, 5), /*all_positions=*/true);
  for (size_t t = 11; t < tokens.size(); ++t) forward(all.subspan(t, 1), /*all_positions=*/false);
  decoder.set_routing_observer(nullptr);
  return run;
}

class CachedExpertsTest : public testing::TestWithParam<std::string> {};

TEST_P(CachedExpertsTest, EveryBudgetAndPolicyMatchesResidentBitForBit) {
  auto model = Model::load(kModels / GetParam(), LoadOptions{.prefault = false});
  Decoder& decoder = model->decoder();
  const ModelConfig& config = decoder.config();
  const int64_t L = config.num_layers, E = config.num_experts;
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(config.vocab_size - 1));
  std::vector<int32_t> tokens(15);
  for (int32_t& t : tokens) t = token(rng);

  const std::filesystem::path trace_path =
      std::filesystem::path(testing::TempDir()) / (GetParam() + "_hot_set.trace");
  WorkloadRun resident;
  {
    RoutingTraceWriter trace(trace_path, L, E, config.num_experts_per_tok);
    resident = run_workload(decoder, tokens, nullptr, &trace);
  }
  ASSERT_GT(resident.distinct_demands, 0);

  const std::vector<std::string> budgets = {"100%", "50%", "25%", "10%", "0"};
  const std::vector<std::string> caches = {"lru", "lfu", "static:" + trace_path.string(),
                                           "lru:" + trace_path.string()};
  for (const std::string& budget : budgets) {
    for (const std::string& cache : caches) {
      // --cold-experts and --expert-prefetch; prefetch on and off with the first policy only.
      const std::vector<std::pair<std::string, std::string>> modes = {
          {"gpu", "auto"}, {"cpu", "auto"}, {"auto", "auto"}, {"gpu", "on"},
          {"gpu", "off"},  {"auto", "on"},  {"auto", "off"}};
      for (const auto& [cold, prefetch] : modes) {
        if (prefetch != "auto" && cache != caches.front()) continue;
        SCOPED_TRACE(GetParam() + " --expert-budget " + budget + " --expert-cache " + cache +
                     " --cold-experts " + cold + " --expert-prefetch " + prefetch);
        decoder.set_offload(offload::parse_offload_flags(budget, cache, cold, prefetch));
        const moe::CachedExperts* cached = decoder.cached_experts();
        ASSERT_NE(cached, nullptr);
        profile::Profiler profiler({.num_layers = L, .num_experts = E});
        const WorkloadRun run = run_workload(decoder, tokens, &profiler);
        ASSERT_EQ(run.logits.size(), resident.logits.size());
        EXPECT_EQ(std::memcmp(run.logits.data(), resident.logits.data(),
                              run.logits.size() * sizeof(float)),
                  0)
            << "logits differ from the resident run";

        const std::vector<int64_t> total = cached->cache().total_counters();
        EXPECT_EQ(total[offload::kCacheHits] + total[offload::kCacheMisses] +
                      total[offload::kCacheUnplaced] + total[offload::kCacheOnCpu],
                  run.distinct_demands);
        EXPECT_GE(total[offload::kCacheRowsOnCpu], total[offload::kCacheOnCpu]);
        if (cold == "gpu") EXPECT_EQ(total[offload::kCacheOnCpu], 0);
        if (cold != "gpu") EXPECT_EQ(total[offload::kCacheUnplaced], 0);
        if (prefetch == "off") EXPECT_EQ(total[offload::kCachePrefetched], 0);
        if (cold == "cpu") {  // nothing evicted on demand: copies only fill free slots
          EXPECT_EQ(total[offload::kCachePrefetched], 0);
          EXPECT_LE(total[offload::kCacheMisses], cached->cache().num_slots());
        }
        EXPECT_LE(total[offload::kCachePrefetchUsed] + total[offload::kCachePrefetchWasted],
                  total[offload::kCachePrefetched]);
        int64_t bytes = 0;
        for (int64_t b : cached->host_to_device_bytes()) bytes += b;
        EXPECT_EQ(bytes, (total[offload::kCacheMisses] + total[offload::kCacheUnplaced] +
                          total[offload::kCachePrefetched]) *
                             cached->expert_bytes());
        const int64_t S = cached->cache().num_slots();
        if (budget == "0") {
          EXPECT_EQ(S, 0);
          EXPECT_EQ(total[cold == "gpu" ? offload::kCacheUnplaced : offload::kCacheOnCpu],
                    run.distinct_demands);
        }
        if (budget == "100%") EXPECT_EQ(total[offload::kCacheUnplaced], 0);

        // The profiler saw the same counts, step by step, and the bytes on the host-device link.
        std::vector<int64_t> seen(offload::kNumCacheCounters, 0);
        int64_t seen_bytes = 0, link_bytes = 0, hits = 0, misses = 0;
        for (const profile::StepRecord& r : profiler.steps()) {
          for (int64_t l = 0; l < L; ++l) {
            for (int k = 0; k < offload::kNumCacheCounters; ++k) {
              seen[k] += r.expert_cache_count(l, static_cast<offload::CacheCounter>(k));
            }
            seen_bytes += r.expert_cache_bytes[l];
          }
          link_bytes += r.link_bytes[static_cast<int>(profile::Link::kHostDevice)];
          hits += r.cache_hits;
          misses += r.cache_misses;
        }
        EXPECT_EQ(seen, total);
        EXPECT_EQ(seen_bytes, bytes);
        EXPECT_EQ(link_bytes, bytes);
        EXPECT_EQ(hits, total[offload::kCacheHits]);
        EXPECT_EQ(misses, total[offload::kCacheMisses] + total[offload::kCacheUnplaced] +
                              total[offload::kCacheOnCpu]);
      }
    }
  }
  decoder.set_offload({});
  EXPECT_EQ(decoder.cached_experts(), nullptr);
  const WorkloadRun back = run_workload(decoder, tokens, nullptr);
  EXPECT_EQ(
      std::memcmp(back.logits.data(), resident.logits.data(), back.logits.size() * sizeof(float)),
      0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CachedExpertsTest, testing::ValuesIn(model_fixture_names()),
                         [](const auto& info) { return info.param; });

// A warm-up fills the cache before traffic: a static cache warmed from the trace of the same
// workload starts with the busiest experts resident and finds hits on its first step.
TEST(CachedExperts, StaticHotSetIsResidentBeforeTraffic) {
  auto model = Model::load(kModels / "qwen3_moe_f32", LoadOptions{.prefault = false});
  Decoder& decoder = model->decoder();
  const ModelConfig& config = decoder.config();
  const std::filesystem::path trace_path =
      std::filesystem::path(testing::TempDir()) / "static_warm.trace";
  std::vector<int32_t> tokens(15);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(7 * i + 3);
  {
    RoutingTraceWriter trace(trace_path, config.num_layers, config.num_experts,
                             config.num_experts_per_tok);
    run_workload(decoder, tokens, nullptr, &trace);
  }
  decoder.set_offload(offload::parse_offload_flags("50%", "static:" + trace_path.string()));
  const offload::HostCacheTables& cache = decoder.cached_experts()->cache();
  EXPECT_GT(cache.num_hot(), 0);
  int64_t resident = 0;
  for (int64_t s = 0; s < cache.num_slots(); ++s) resident += cache.owner(s) >= 0;
  EXPECT_EQ(resident, cache.num_slots());  // the trace names more experts than half the slots
  for (int64_t g = 0; g < config.num_layers * config.num_experts; ++g) {
    if (cache.hot(static_cast<int32_t>(g))) EXPECT_GE(cache.slot_of(static_cast<int32_t>(g)), 0);
  }
  run_workload(decoder, tokens, nullptr);
  EXPECT_GT(cache.total_counters()[offload::kCacheHits], 0);
  for (int64_t g = 0; g < config.num_layers * config.num_experts; ++g) {
    if (cache.hot(static_cast<int32_t>(g))) EXPECT_GE(cache.slot_of(static_cast<int32_t>(g)), 0);
  }
}

// Under expert parallelism (here a job of one rank, so that every expert is this rank's) the
// cache takes its demand from the rows run() receives and admits on_routed's prediction after
// it: the same admissions in the same order as one process, so the logits stay those of the
// resident run and every counter equals the one-process cache's, in either order of set_offload
// and set_expert_parallel. Two micro-batches with a budget are refused by name.
TEST(CachedExperts, ExpertParallelRankCachesTheRowsItReceives) {
  auto model = Model::load(kModels / "qwen3_moe_f32", LoadOptions{.prefault = false});
  Decoder& decoder = model->decoder();
  std::vector<int32_t> tokens(15);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(11 * i + 5);
  const WorkloadRun resident = run_workload(decoder, tokens, nullptr);
  parallel::SelfCommunicator self;
  for (const std::string budget : {"25%", "50%"}) {
    for (const std::string prefetch : {"on", "off"}) {
      const offload::OffloadOptions options =
          offload::parse_offload_flags(budget, "lfu", "gpu", prefetch);
      decoder.set_offload(options);
      run_workload(decoder, tokens, nullptr);
      const std::vector<int64_t> one_process = decoder.cached_experts()->cache().total_counters();
      for (const bool offload_first : {true, false}) {
        SCOPED_TRACE("--expert-budget " + budget + " --expert-prefetch " + prefetch + ", " +
                     (offload_first ? "set_offload first" : "set_expert_parallel first"));
        decoder.set_expert_parallel(nullptr);
        decoder.set_offload({});
        if (offload_first) decoder.set_offload(options);
        decoder.set_expert_parallel(&self);
        if (!offload_first) decoder.set_offload(options);
        ASSERT_NE(decoder.cached_experts(), nullptr);
        const WorkloadRun run = run_workload(decoder, tokens, nullptr);
        ASSERT_EQ(run.logits.size(), resident.logits.size());
        EXPECT_EQ(std::memcmp(run.logits.data(), resident.logits.data(),
                              run.logits.size() * sizeof(float)),
                  0);
        EXPECT_EQ(decoder.cached_experts()->cache().total_counters(), one_process);
      }
      decoder.set_expert_parallel(nullptr);
      EXPECT_GT(one_process[offload::kCacheMisses], 0);
      if (prefetch == "off") EXPECT_EQ(one_process[offload::kCachePrefetched], 0);
    }
  }
  decoder.set_offload(offload::parse_offload_flags("25%", "lfu", "gpu", "auto"));
  try {
    decoder.set_expert_parallel(&self, std::nullopt, true, moe::DispatchDtype::kF32, 2);
    ADD_FAILURE() << "two micro-batches with an expert budget were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--micro-batches 2 with --expert-budget"),
              std::string::npos)
        << e.what();
  }
}

TEST(CachedExperts, TraceOfAnotherModelIsRefusedNamingTheFile) {
  auto model = Model::load(kModels / "qwen3_moe_f32", LoadOptions{.prefault = false});
  Decoder& decoder = model->decoder();
  const ModelConfig& config = decoder.config();
  const std::filesystem::path path = std::filesystem::path(testing::TempDir()) / "other.trace";
  { RoutingTraceWriter trace(path, config.num_layers + 1, config.num_experts, 1); }
  try {
    decoder.set_offload(offload::parse_offload_flags("50%", "static:" + path.string()));
    ADD_FAILURE() << "a trace of another model was accepted";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(path.string()), std::string::npos) << what;
    EXPECT_NE(what.find("layers"), std::string::npos) << what;
  }
  EXPECT_EQ(decoder.cached_experts(), nullptr);  // left as it was
  { RoutingTraceWriter trace(path, config.num_layers, config.num_experts * 2, 1); }
  EXPECT_THROW(decoder.set_offload(offload::parse_offload_flags("50%", "static:" + path.string())),
               Error);
}

}  // namespace
}  // namespace moeinfer
