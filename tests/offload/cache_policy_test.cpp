// The expert cache's shared decision code (offload/cache_policy.h) through the host tables:
// eviction order of each policy, protection, unplaced demands, counters and tie rules.
#include "offload/cache_policy.h"

#include <gtest/gtest.h>

#include <vector>

#include "offload/cache_summary.h"
#include "offload/host_cache.h"
#include "offload/hot_set.h"

namespace moeinfer::offload {
namespace {

constexpr int64_t kLayers = 2;
constexpr int64_t kExperts = 8;

// One admission of `experts` (layer-local ids) of `layer`: a demand protecting itself, or a
// prefetch protecting from `protect_from`. Returns the (global expert, slot) copies.
std::vector<SlotCopy> admit(HostCacheTables& cache, int64_t layer, std::vector<int> experts,
                            bool prefetch = false, int64_t protect_from = -1) {
  std::vector<int32_t> rows(kExperts, 0);
  for (int e : experts) rows[e] = 1;
  const int64_t tick = cache.next_tick();
  std::vector<SlotCopy> copies(kExperts);
  const int64_t n = cache
                        .admit({.layer = layer,
                                .num_experts = kExperts,
                                .tick = tick,
                                .protect_from = protect_from >= 0 ? protect_from : tick,
                                .prefetch = prefetch},
                               rows.data(), {}, copies)
                        .num_copies;
  copies.resize(n);
  return copies;
}

int64_t count(const HostCacheTables& cache, int64_t layer, CacheCounter c) {
  return cache.counters(layer)[c];
}

TEST(CachePolicy, LruEvictsTheLeastRecentlyUsed) {
  HostCacheTables cache(kLayers, kExperts, 3, CachePolicy::kLru);
  admit(cache, 0, {0});
  admit(cache, 0, {1});
  admit(cache, 0, {2});
  admit(cache, 0, {0});  // 0 is now the most recent; 1 the least
  const std::vector<SlotCopy> copies = admit(cache, 0, {3});
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].expert, 3);
  EXPECT_EQ(copies[0].slot, 1);  // expert 1's slot
  EXPECT_EQ(cache.slot_of(1), -1);
  EXPECT_EQ(cache.slot_of(3), 1);
  EXPECT_EQ(cache.owner(1), 3);
  admit(cache, 0, {4});  // next: expert 2
  EXPECT_EQ(cache.slot_of(2), -1);
  EXPECT_EQ(cache.slot_of(4), 2);
}

TEST(CachePolicy, FreeSlotsFirstLowestSlotFirst) {
  HostCacheTables cache(kLayers, kExperts, 4, CachePolicy::kLru);
  const std::vector<SlotCopy> copies = admit(cache, 1, {5, 2, 7});
  ASSERT_EQ(copies.size(), 3u);
  // Misses are placed in expert order, each in the lowest free slot.
  EXPECT_EQ(copies[0].expert, 1 * kExperts + 2);
  EXPECT_EQ(copies[0].slot, 0);
  EXPECT_EQ(copies[1].expert, 1 * kExperts + 5);
  EXPECT_EQ(copies[1].slot, 1);
  EXPECT_EQ(copies[2].expert, 1 * kExperts + 7);
  EXPECT_EQ(copies[2].slot, 2);
}

TEST(CachePolicy, EqualKeysGoToTheLowerSlot) {
  // Two slots stamped by the same admission have equal LRU keys.
  HostCacheTables cache(kLayers, kExperts, 2, CachePolicy::kLru);
  admit(cache, 0, {0, 1});  // slots 0 and 1 share a tick
  const std::vector<SlotCopy> copies = admit(cache, 0, {2});
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].slot, 0);
}

TEST(CachePolicy, LfuEvictsTheLeastOftenUsedTiesByRecency) {
  HostCacheTables cache(kLayers, kExperts, 3, CachePolicy::kLfu);
  admit(cache, 0, {0});
  admit(cache, 0, {0});
  admit(cache, 0, {0});  // expert 0: 3 uses
  admit(cache, 0, {1});
  admit(cache, 0, {1});  // expert 1: 2 uses
  admit(cache, 0, {2});  // expert 2: 1 use, the most recent
  admit(cache, 0, {3});  // evicts 2 (fewest uses) although it is the most recent
  EXPECT_EQ(cache.slot_of(2), -1);
  EXPECT_EQ(cache.slot_of(3), 2);
  EXPECT_EQ(cache.uses(2), 1);  // uses are kept across evictions
  // 3 (1 use) and a returning 2 (2 uses): 3 goes.
  admit(cache, 0, {2});
  EXPECT_EQ(cache.slot_of(3), -1);
  EXPECT_EQ(cache.slot_of(2), 2);
  // A tie in uses goes to the least recently used: experts 4 and 5 once each, 4 first.
  HostCacheTables tie(kLayers, kExperts, 2, CachePolicy::kLfu);
  admit(tie, 0, {4});
  admit(tie, 0, {5});
  admit(tie, 0, {6});
  EXPECT_EQ(tie.slot_of(4), -1);
  EXPECT_EQ(tie.slot_of(5), 1);
  EXPECT_EQ(tie.slot_of(6), 0);
}

TEST(CachePolicy, StaticNeverEvictsTheHotSet) {
  HostCacheTables cache(kLayers, kExperts, 3, CachePolicy::kStatic);
  const std::vector<int32_t> ranking = {3, 10, 1};
  cache.set_hot_set(ranking, 2);  // 3 and 10 are hot
  EXPECT_EQ(cache.num_hot(), 2);
  const std::vector<SlotCopy> warm = cache.warm(ranking);
  ASSERT_EQ(warm.size(), 3u);
  for (int round = 0; round < 4; ++round) {
    admit(cache, 0, {static_cast<int>(4 + round)});  // streams through the one cold slot
    EXPECT_EQ(cache.slot_of(3), 0);
    EXPECT_EQ(cache.slot_of(10), 1);
    EXPECT_EQ(cache.owner(2), 4 + round);
  }
  // A demand larger than the cold slots leaves the rest unplaced, never evicting a hot one.
  admit(cache, 0, {0, 1, 2});
  EXPECT_EQ(count(cache, 0, kCacheUnplaced), 2);
  EXPECT_EQ(cache.slot_of(3), 0);
  EXPECT_EQ(cache.slot_of(10), 1);
}

TEST(CachePolicy, PrefetchNeverEvictsProtectedSlots) {
  HostCacheTables cache(kLayers, kExperts, 3, CachePolicy::kLru);
  admit(cache, 0, {0});  // tick 1
  const int64_t layer_tick = cache.tick() + 1;
  admit(cache, 0, {1, 2});  // tick 2: layer 0 computing
  // The prefetch of layer 1 protects from layer 0's tick: slots 1 and 2 stay, slot 0 (tick 1)
  // may go.
  const std::vector<SlotCopy> copies = admit(cache, 1, {4, 5}, /*prefetch=*/true, layer_tick);
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].expert, kExperts + 4);
  EXPECT_EQ(copies[0].slot, 0);
  EXPECT_EQ(cache.slot_of(1), 1);
  EXPECT_EQ(cache.slot_of(2), 2);
  EXPECT_EQ(cache.slot_of(kExperts + 5), -1);
  // A prefetch that finds nothing evictable counts nothing as unplaced (it is not a demand).
  EXPECT_EQ(count(cache, 1, kCachePrefetched), 1);
  EXPECT_EQ(count(cache, 1, kCacheUnplaced), 0);
  EXPECT_TRUE(cache.prefetched(0));
}

TEST(CachePolicy, UnplacedWhenEverySlotIsProtected) {
  HostCacheTables cache(kLayers, kExperts, 2, CachePolicy::kLru);
  const std::vector<SlotCopy> copies = admit(cache, 0, {1, 3, 5, 6});
  ASSERT_EQ(copies.size(), 2u);  // 1 and 3 placed, 5 and 6 find every slot in use
  EXPECT_EQ(count(cache, 0, kCacheMisses), 2);
  EXPECT_EQ(count(cache, 0, kCacheUnplaced), 2);
  EXPECT_EQ(cache.slot_of(5), -1);
  EXPECT_EQ(cache.slot_of(6), -1);
  // No slots at all: every demand is unplaced.
  HostCacheTables none(kLayers, kExperts, 0, CachePolicy::kLru);
  EXPECT_TRUE(admit(none, 1, {0, 7}).empty());
  EXPECT_EQ(count(none, 1, kCacheUnplaced), 2);
}

TEST(CachePolicy, AdmissionTouchesHitsBeforePlacingMisses) {
  // Slots hold 0 (older) and 1; the admission needs 0 and 2. Expert 0 must be stamped before
  // the miss looks for a slot, so 2 takes 1's slot; placed first, it would evict 0.
  HostCacheTables cache(kLayers, kExperts, 2, CachePolicy::kLru);
  admit(cache, 0, {0});
  admit(cache, 0, {1});
  const std::vector<SlotCopy> copies = admit(cache, 0, {0, 2});
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].slot, 1);
  EXPECT_EQ(cache.slot_of(0), 0);
  EXPECT_EQ(count(cache, 0, kCacheHits), 1);
  EXPECT_EQ(count(cache, 0, kCacheUnplaced), 0);
}

TEST(CachePolicy, CountersOfDemandsAndPrefetches) {
  HostCacheTables cache(kLayers, kExperts, 4, CachePolicy::kLru);
  const int64_t t = cache.tick() + 1;
  admit(cache, 0, {0, 1});                        // 2 misses
  admit(cache, 1, {2, 3}, /*prefetch=*/true, t);  // 2 prefetched
  admit(cache, 1, {2, 4});                        // hit (prefetch used), miss
  admit(cache, 1, {2});                           // hit, not a second prefetch use
  EXPECT_EQ(count(cache, 0, kCacheMisses), 2);
  EXPECT_EQ(count(cache, 1, kCachePrefetched), 2);
  EXPECT_EQ(count(cache, 1, kCacheHits), 2);
  EXPECT_EQ(count(cache, 1, kCachePrefetchUsed), 1);
  EXPECT_EQ(count(cache, 1, kCacheMisses), 1);
  EXPECT_EQ(cache.uses(kExperts + 2), 2);  // prefetches are not demands
  EXPECT_EQ(cache.uses(kExperts + 3), 0);
  const std::vector<int64_t> total = cache.total_counters();
  EXPECT_EQ(total[kCacheMisses], 3);
  EXPECT_EQ(total[kCacheHits], 2);
}

// A prefetch resolves once: used by a demand, or evicted unused (wasted, in its own layer's row,
// whichever layer evicts it). Over any window, used + wasted counts only resolutions in it.
TEST(CachePolicy, EvictedUnusedPrefetchCountsAsWastedInItsLayer) {
  HostCacheTables cache(kLayers, kExperts, 2, CachePolicy::kLru);
  admit(cache, 1, {2, 3}, /*prefetch=*/true, cache.tick() + 1);  // both slots prefetched
  admit(cache, 1, {2});                                           // 2 used
  const std::vector<int64_t> before = cache.total_counters();
  admit(cache, 0, {0, 1});  // evicts 3 (never used, wasted in layer 1) and 2 (used: not wasted)
  EXPECT_EQ(count(cache, 1, kCachePrefetchWasted), 1);
  EXPECT_EQ(count(cache, 0, kCachePrefetchWasted), 0);
  EXPECT_EQ(count(cache, 1, kCachePrefetchUsed), 1);
  // A window that starts after the prefetches: no new prefetch, yet one resolution in it.
  const std::vector<int64_t> after = cache.total_counters();
  std::vector<int64_t> window(after.size());
  for (size_t k = 0; k < after.size(); ++k) window[k] = after[k] - before[k];
  CacheSummary summary;
  std::copy(window.begin(), window.end(), summary.counts);
  EXPECT_EQ(summary.counts[kCachePrefetched], 0);
  EXPECT_DOUBLE_EQ(summary.prefetch_accuracy(), 0.0);  // 0 used of 1 resolved
  std::copy(after.begin(), after.end(), summary.counts);
  EXPECT_DOUBLE_EQ(summary.prefetch_accuracy(), 0.5);
}

TEST(CachePolicy, PrefetchPaysWhileHalfOfTheResolvedAreUsed) {
  int64_t c[kNumCacheCounters] = {};
  const int64_t tick = kPrefetchProbeTicks + 1;  // not a probe
  c[kCachePrefetchWasted] = kPrefetchTrial - 1;  // still learning, however bad
  EXPECT_TRUE(prefetch_pays(c, tick));
  c[kCachePrefetchWasted] = kPrefetchTrial;
  EXPECT_FALSE(prefetch_pays(c, tick));
  EXPECT_TRUE(prefetch_pays(c, 2 * kPrefetchProbeTicks));  // the probe still prefetches
  c[kCachePrefetchUsed] = kPrefetchTrial - 1;  // 31 of 63: under half
  EXPECT_FALSE(prefetch_pays(c, tick));
  c[kCachePrefetchUsed] = kPrefetchTrial;  // half
  EXPECT_TRUE(prefetch_pays(c, tick));
  c[kCachePrefetched] = 1000;  // prefetches still waiting for a demand do not count
  EXPECT_TRUE(prefetch_pays(c, tick));
}

TEST(CachePolicy, WarmFillsFreeSlotsTopOfRankingMostRecent) {
  HostCacheTables cache(kLayers, kExperts, 3, CachePolicy::kLru);
  const std::vector<int32_t> ranking = {9, 2, 12, 5};
  const std::vector<SlotCopy> copies = cache.warm(ranking);
  ASSERT_EQ(copies.size(), 3u);  // 5 finds no free slot
  EXPECT_EQ(cache.slot_of(9), 0);
  EXPECT_EQ(cache.slot_of(2), 1);
  EXPECT_EQ(cache.slot_of(12), 2);
  EXPECT_EQ(cache.slot_of(5), -1);
  EXPECT_GT(cache.last_use(0), cache.last_use(1));
  EXPECT_GT(cache.last_use(1), cache.last_use(2));
  for (int64_t c : cache.total_counters()) EXPECT_EQ(c, 0);  // a warm-up is not traffic
  // An LRU eviction takes the bottom of the ranking first.
  admit(cache, 0, {7});
  EXPECT_EQ(cache.slot_of(12), -1);
  EXPECT_EQ(cache.slot_of(7), 2);
}

TEST(HotSet, RankingByLoadTiesToTheLowerId) {
  RoutingTrace trace{.num_layers = 2, .num_experts = 4, .top_k = 2};
  trace.records.push_back({.step = 0, .layer = 0, .num_tokens = 2, .expert_ids = {1, 3, 3, 1}});
  trace.records.push_back({.step = 0, .layer = 1, .num_tokens = 1, .expert_ids = {0, 2}});
  trace.records.push_back({.step = 1, .layer = 0, .num_tokens = 1, .expert_ids = {3, 0}});
  // Loads: g1 = 2, g3 = 3, g0 = 1, g4 = 1, g6 = 1.
  EXPECT_EQ(rank_experts_by_load(trace), (std::vector<int32_t>{3, 1, 0, 4, 6}));
}

TEST(HotSet, StaticReserveSlots) {
  EXPECT_EQ(static_reserve_slots(128, 8, 1000), 16);  // two layers of top-8
  EXPECT_EQ(static_reserve_slots(8, 64, 1000), 16);   // at most E per layer
  EXPECT_EQ(static_reserve_slots(128, 8, 10), 10);    // never more than the cache
  EXPECT_EQ(static_reserve_slots(128, 8, 0), 0);
}

// One demand of `rows` (rows per layer-local expert) under a cold mode.
struct ColdAdmission {
  std::vector<SlotCopy> copies;
  std::vector<int32_t> on_cpu;
};
ColdAdmission admit_cold(HostCacheTables& cache, int64_t layer, std::vector<int32_t> rows,
                         const ColdCost& cold) {
  rows.resize(kExperts, 0);
  const int64_t tick = cache.next_tick();
  ColdAdmission out{.copies = std::vector<SlotCopy>(kExperts),
                    .on_cpu = std::vector<int32_t>(kExperts)};
  const HostCacheTables::Admitted n =
      cache.admit({.layer = layer, .num_experts = kExperts, .tick = tick, .protect_from = tick},
                  rows.data(), cold, out.copies, out.on_cpu);
  out.copies.resize(n.num_copies);
  out.on_cpu.resize(n.num_on_cpu);
  return out;
}

TEST(ColdExperts, CpuModeFillsFreeSlotsAndEvictsNothing) {
  HostCacheTables cache(kLayers, kExperts, 2, CachePolicy::kLru);
  admit(cache, 0, {1});  // expert 1 resident, one slot free
  const ColdAdmission a = admit_cold(cache, 0, {2, 1, 0, 3}, {.mode = ColdExperts::kCpu});
  ASSERT_EQ(a.copies.size(), 1u);  // expert 0 takes the free slot
  EXPECT_EQ(a.copies[0].expert, 0);
  EXPECT_EQ(a.on_cpu, (std::vector<int32_t>{3}));  // no free slot left: the host
  EXPECT_EQ(count(cache, 0, kCacheHits), 1);
  EXPECT_EQ(count(cache, 0, kCacheMisses), 2);  // expert 1's first admission, then expert 0
  EXPECT_EQ(count(cache, 0, kCacheOnCpu), 1);
  EXPECT_EQ(count(cache, 0, kCacheRowsOnCpu), 3);
  // Later misses evict nothing, even of experts not used for a long time.
  const ColdAdmission b = admit_cold(cache, 0, {0, 0, 4, 1}, {.mode = ColdExperts::kCpu});
  EXPECT_TRUE(b.copies.empty());
  EXPECT_EQ(b.on_cpu, (std::vector<int32_t>{2, 3}));
  EXPECT_GE(cache.slot_of(0), 0);
  EXPECT_GE(cache.slot_of(1), 0);
}

TEST(ColdExperts, AutoBalancesTheCopyAndHostQueues) {
  HostCacheTables cache(kLayers, kExperts, 8, CachePolicy::kLru);
  // A copy takes 100; the host 60 + 20 per row. In expert order: 0 to the host (80 <= 100),
  // 1 copied (160 > 100), 2 to the host (160 <= 200), 3 copied (240 > 200).
  const ColdCost cold{.mode = ColdExperts::kAuto, .copy_ns = 100, .host_ns = 60, .host_row_ns = 20};
  const ColdAdmission a = admit_cold(cache, 1, {1, 1, 1, 1}, cold);
  EXPECT_EQ(a.on_cpu, (std::vector<int32_t>{kExperts + 0, kExperts + 2}));
  ASSERT_EQ(a.copies.size(), 2u);
  EXPECT_EQ(a.copies[0].expert, kExperts + 1);
  EXPECT_EQ(a.copies[1].expert, kExperts + 3);
  EXPECT_EQ(count(cache, 1, kCacheMisses), 2);
  EXPECT_EQ(count(cache, 1, kCacheOnCpu), 2);
  // Many rows make the host's arithmetic dear: every miss is copied.
  const ColdAdmission b = admit_cold(cache, 0, {50, 50}, cold);
  EXPECT_TRUE(b.on_cpu.empty());
  EXPECT_EQ(b.copies.size(), 2u);
}

TEST(ColdExperts, AMissWithoutASlotGoesToTheHostUnlessGpu) {
  HostCacheTables none(kLayers, kExperts, 0, CachePolicy::kLru);
  const ColdCost cold{.mode = ColdExperts::kAuto, .copy_ns = 1, .host_ns = 1000};
  const ColdAdmission a = admit_cold(none, 0, {1, 2}, cold);
  EXPECT_EQ(a.on_cpu, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(count(none, 0, kCacheUnplaced), 0);
  EXPECT_EQ(count(none, 0, kCacheRowsOnCpu), 3);
  HostCacheTables gpu(kLayers, kExperts, 0, CachePolicy::kLru);
  const ColdAdmission b = admit_cold(gpu, 0, {1, 2}, {.mode = ColdExperts::kGpu});
  EXPECT_TRUE(b.on_cpu.empty());
  EXPECT_EQ(count(gpu, 0, kCacheUnplaced), 2);
}

TEST(ColdExperts, APrefetchOnlyCopies) {
  HostCacheTables cache(kLayers, kExperts, 4, CachePolicy::kLru);
  const std::vector<SlotCopy> copies = admit(cache, 1, {0, 1}, /*prefetch=*/true, 0);
  EXPECT_EQ(copies.size(), 2u);  // admit() passes ColdCost{}: kGpu; under any mode alike
  std::vector<int32_t> rows(kExperts, 0);
  rows[2] = 1;
  const int64_t tick = cache.next_tick();
  std::vector<SlotCopy> out(kExperts);
  std::vector<int32_t> on_cpu(kExperts);
  const HostCacheTables::Admitted n = cache.admit(
      {.layer = 1, .num_experts = kExperts, .tick = tick, .protect_from = tick, .prefetch = true},
      rows.data(), {.mode = ColdExperts::kCpu}, out, on_cpu);
  EXPECT_EQ(n.num_copies, 1);
  EXPECT_EQ(n.num_on_cpu, 0);
}

}  // namespace
}  // namespace moeinfer::offload
