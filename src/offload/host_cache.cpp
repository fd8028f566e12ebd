#include "offload/host_cache.h"

#include <algorithm>

#include "core/error.h"

namespace moeinfer::offload {

HostCacheTables::HostCacheTables(int64_t num_layers, int64_t num_experts, int64_t num_slots,
                                 CachePolicy policy)
    : num_layers_(num_layers), num_experts_(num_experts), policy_(policy) {
  MOE_CHECK(num_layers >= 1 && num_experts >= 1, "expert cache: ", num_layers, " layers of ",
            num_experts, " experts (both must be >= 1)");
  MOE_CHECK(num_slots >= 0 && num_slots <= num_layers * num_experts, "expert cache: ", num_slots,
            " slots for ", num_layers * num_experts, " experts");
  MOE_CHECK(num_layers * num_experts <= INT32_MAX, "expert cache: ", num_layers * num_experts,
            " experts overflow the int32 expert ids");
  const size_t G = static_cast<size_t>(num_layers * num_experts);
  slot_of_.assign(G, -1);
  owner_.assign(static_cast<size_t>(num_slots), -1);
  last_use_.assign(static_cast<size_t>(num_slots), 0);
  uses_.assign(G, 0);
  prefetched_.assign(static_cast<size_t>(num_slots), 0);
  hot_.assign(G, 0);
  counters_.assign(static_cast<size_t>(num_layers) * kNumCacheCounters, 0);
}

CacheTables HostCacheTables::tables() {
  return {.slot_of = slot_of_.data(),
          .owner = owner_.data(),
          .last_use = last_use_.data(),
          .uses = uses_.data(),
          .prefetched = prefetched_.data(),
          .hot = hot_.data(),
          .num_slots = num_slots(),
          .policy = policy_};
}

HostCacheTables::Admitted HostCacheTables::admit(const Admission& a, const int32_t* rows,
                                                  const ColdCost& cold,
                                                  std::span<SlotCopy> copies,
                                                  std::span<int32_t> on_cpu) {
  MOE_CHECK(a.layer >= 0 && a.layer < num_layers_, "expert cache: admission of layer ", a.layer,
            " outside [0, ", num_layers_, ")");
  MOE_CHECK(a.num_experts == num_experts_, "expert cache: admission of ", a.num_experts,
            " experts per layer into a cache of ", num_experts_);
  MOE_CHECK(a.tick > 0 && a.tick <= tick_ && a.protect_from <= a.tick, "expert cache: tick ",
            a.tick, " (protect_from ", a.protect_from, ") not taken from this cache's clock at ",
            tick_);
  MOE_CHECK(static_cast<int64_t>(copies.size()) >= num_experts_, "expert cache: room for ",
            copies.size(), " copies, an admission may need ", num_experts_);
  MOE_CHECK(cold.mode == ColdExperts::kGpu || static_cast<int64_t>(on_cpu.size()) >= num_experts_,
            "expert cache: room for ", on_cpu.size(), " experts on the CPU, an admission may need ",
            num_experts_);
  std::vector<int32_t> experts(static_cast<size_t>(num_experts_));
  std::vector<int32_t> slots(static_cast<size_t>(num_experts_));
  AdmissionLists lists{.copy_experts = experts.data(), .copy_slots = slots.data(),
                       .host_experts = on_cpu.data()};
  offload::admit(tables(), a, rows, cold, lists, counters_.data());
  for (int64_t i = 0; i < lists.num_copies; ++i) {
    copies[i] = {.expert = experts[i], .slot = slots[i]};
  }
  return {.num_copies = lists.num_copies, .num_on_cpu = lists.num_host};
}

std::vector<SlotCopy> HostCacheTables::warm(std::span<const int32_t> ranking) {
  std::vector<int32_t> placed;
  int64_t next_free = 0;
  for (int32_t g : ranking) {
    MOE_CHECK(g >= 0 && g < static_cast<int64_t>(slot_of_.size()), "expert cache: warm-up expert ",
              g, " outside the ", slot_of_.size(), " experts");
    if (slot_of_[g] >= 0) continue;
    while (next_free < num_slots() && owner_[next_free] >= 0) ++next_free;
    if (next_free == num_slots()) break;
    slot_of_[g] = static_cast<int32_t>(next_free);
    owner_[next_free] = g;
    placed.push_back(g);
  }
  // The last placed is stamped first, so the top of the ranking holds the newest tick.
  std::vector<SlotCopy> copies;
  std::vector<int64_t> scratch(counters_.size(), 0);
  const CacheTables t = tables();
  for (auto it = placed.rbegin(); it != placed.rend(); ++it) {
    const int32_t slot = slot_of_[*it];
    place(t,
          Admission{.layer = *it / num_experts_,
                    .num_experts = num_experts_,
                    .tick = next_tick(),
                    .protect_from = tick_},
          *it, slot, scratch.data());
  }
  for (int32_t g : placed) copies.push_back({.expert = g, .slot = slot_of_[g]});
  return copies;
}

void HostCacheTables::set_hot_set(std::span<const int32_t> ranking, int64_t num_hot) {
  MOE_CHECK(num_hot >= 0, "expert cache: a hot set of ", num_hot, " experts");
  std::fill(hot_.begin(), hot_.end(), 0);
  const int64_t n = std::min<int64_t>(num_hot, static_cast<int64_t>(ranking.size()));
  for (int64_t i = 0; i < n; ++i) {
    MOE_CHECK(ranking[i] >= 0 && ranking[i] < static_cast<int64_t>(hot_.size()),
              "expert cache: hot expert ", ranking[i], " outside the ", hot_.size(), " experts");
    hot_[ranking[i]] = 1;
  }
}

int64_t HostCacheTables::num_hot() const { return std::count(hot_.begin(), hot_.end(), 1); }

std::span<const int64_t> HostCacheTables::counters(int64_t layer) const {
  MOE_CHECK(layer >= 0 && layer < num_layers_, "expert cache: layer ", layer, " outside [0, ",
            num_layers_, ")");
  return std::span<const int64_t>(counters_).subspan(layer * kNumCacheCounters, kNumCacheCounters);
}

std::vector<int64_t> HostCacheTables::total_counters() const {
  std::vector<int64_t> total(kNumCacheCounters, 0);
  for (size_t i = 0; i < counters_.size(); ++i) total[i % kNumCacheCounters] += counters_[i];
  return total;
}

}  // namespace moeinfer::offload
