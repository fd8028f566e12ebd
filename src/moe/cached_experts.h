// The experts of every layer behind a cache of S slots: the CPU backend's simulated expert
// budget (--expert-budget on the CPU, issue 14). It drives the same decision code as the GPU's
// cache (offload/cache_policy.h: admission, eviction, protection, prefetch), and only the copies
// differ: here a slot is host memory and a "host-to-device copy" is a memcpy from the expert's
// home, the checkpoint's weights used in place.
//
// Per MoE layer l and step:
//   on_routed(l): the layer's demand (the experts some row of this step uses) is admitted with
//     a new tick that protects itself; the misses are copied home -> slot at once (the time
//     they take is the stall), the unplaced ones (no evictable slot) stay at home. Then, when
//     layer l+1 is an MoE layer, its experts are predicted from layer l's rows through layer
//     l+1's router and admitted as a prefetch (protecting layer l's slots), and copied.
//   run(l): each expert computes from its slot's copy when it has one, else from home, so a
//     wrong slot table gives wrong outputs rather than hiding behind the home weights.
// Under --cold-experts cpu|auto a demanded miss the cost model sends to the host is not copied:
// it computes from home (on this backend that is where every expert computes) and is counted
// as computed on the CPU, as the GPU's host path counts it.
// Counters per layer (cumulative here; each step's deltas to the active profiler through
// Profiler::record_expert_cache): the CacheCounter counts, bytes host to device (every copy and
// every unplaced read, one expert's bytes each) and the stall.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "moe/moe_block.h"
#include "offload/host_cache.h"

namespace moeinfer::moe {

struct CachedExpertsOptions {
  RouterOptions router;      // the layers' shared options; selection_bias comes per layer
  int64_t hidden_size = 0;   // H
  int64_t expert_width = 0;  // I
  int64_t num_slots = 0;     // S, at most the routed experts of all MoE layers
  offload::CachePolicy policy = offload::CachePolicy::kLfu;
  // Predict and prefetch layer l+1's experts at layer l (kAuto: while they pay).
  offload::PrefetchMode prefetch = offload::PrefetchMode::kAuto;
  offload::ColdCost cold;  // kGpu: every miss is copied
  ExpertActivation activation;  // how the experts join gate and up
  // Under expert parallelism: held[l][e] = 1 for the experts of MoE layer l this rank holds;
  // empty: every expert (one process). The demand of a layer is then the rows run() receives
  // from every rank, not this rank's own routing, so on_routed only predicts the next layer (its
  // held experts) and run() admits the demand, then that prediction as a prefetch.
  std::vector<std::vector<uint8_t>> held;
};

// What computing one cold expert on the host costs, measured with run_experts: the time of one
// row and of each further row (best of a few runs, each on the next of `experts`, so that with
// six or more no run reads weights an earlier one left in the caches).
struct HostExpertRate {
  int64_t first_row_ns = 0;
  int64_t row_ns = 0;
};
HostExpertRate measure_host_expert_rate(std::span<const ExpertWeights> experts, int64_t hidden_size,
                                        int64_t expert_width);
// Up to six experts to time, spread over the layers (expert 0 of the last layers first).
std::vector<ExpertWeights> experts_to_time(std::span<const std::span<const ExpertWeights>> layers);

// The cost model of this backend's simulated budget: a copy is a memcpy of the first expert's
// bytes (timed), the host work is measure_host_expert_rate's over `experts`.
offload::ColdCost simulated_cold_cost(offload::ColdExperts mode,
                                      std::span<const ExpertWeights> experts, int64_t hidden_size,
                                      int64_t expert_width);

class CachedExperts final : public ExpertRunner {
 public:
  // experts[l]: layer l's experts (empty for a dense layer), routers[l] its router; the views
  // must outlive this. Every expert must have the same shape and dtype.
  CachedExperts(std::vector<std::span<const ExpertWeights>> experts,
                std::vector<LayerRouter> routers, const CachedExpertsOptions& options);

  // Warm-up before traffic: the static policy's hot set is the first num_hot of the ranking
  // (global expert ids, most important first; ignored by LRU and LFU), then the free slots are
  // filled in ranked order (HostCacheTables::warm). Not counted as traffic.
  void warm(std::span<const int32_t> ranking, int64_t num_hot);

  void on_routed(int64_t layer, const RoutedTokens& tokens) override;
  void run(int64_t layer, const ExpertRows& rows, float* out) override;

  int64_t expert_bytes() const { return expert_bytes_; }
  const offload::HostCacheTables& cache() const { return cache_; }
  // Since construction, per layer [L]: bytes host to device, seconds spent in demand copies.
  std::span<const int64_t> host_to_device_bytes() const { return bytes_; }
  std::span<const double> stall_seconds() const { return stall_; }

 private:
  struct LayerStep {  // one layer's deltas within on_routed
    int64_t counters[offload::kNumCacheCounters] = {};
    int64_t bytes = 0;
    double stall = 0.0;
  };
  // Admits `rows_` for `layer` and makes its copies; adds to `step`.
  void admit(const offload::Admission& a, LayerStep& step);
  void copy_to_slot(const offload::SlotCopy& c);
  void predict(int64_t layer, const RoutedTokens& tokens);  // fills rows_ for `layer`
  void report(int64_t layer, const LayerStep& step);
  // Admits rows_ as `layer`'s demand (a new tick that protects itself); returns the tick.
  int64_t admit_demand(int64_t layer);
  // Whether layer `next` (after `layer`) gets a prefetch at the demand tick `tick`.
  bool prefetches(int64_t next, int64_t tick, int64_t num_tokens) const;
  // Admits rows_ as a prefetch of `next`, protecting what the demand of tick `tick` placed.
  void admit_prefetch(int64_t next, int64_t tick);

  struct SlotFree {
    void operator()(std::byte* p) const;
  };

  std::vector<int64_t> counters_before_;  // admit()'s snapshot of every layer's counters
  std::vector<std::span<const ExpertWeights>> experts_;
  std::vector<LayerRouter> routers_;
  CachedExpertsOptions options_;
  offload::HostCacheTables cache_;
  int64_t expert_bytes_ = 0;
  size_t up_offset_ = 0, down_offset_ = 0, slot_stride_ = 0;  // bytes within a slot
  std::unique_ptr<std::byte, SlotFree> slots_;                // [S, slot_stride_]
  std::vector<ExpertWeights> slot_views_;                     // [S]
  std::vector<int64_t> bytes_;                                // [L]
  std::vector<double> stall_;                                 // [L]
  // Per call, reused.
  std::vector<int32_t> rows_;              // [E] rows of this step per expert
  std::vector<offload::SlotCopy> copies_;  // [E]
  std::vector<int32_t> on_cpu_;            // [E]
  std::vector<float> logits_;              // [T, E] the predicted layer's router logits
  Routing predicted_;
  std::vector<ExpertWeights> views_;  // [E] the experts run() reads
  // Under `held`: on_routed's prediction of layer pending_next_ (-1: none), admitted by run().
  std::vector<int32_t> pending_rows_;  // [E]
  int64_t pending_next_ = -1;
};

}  // namespace moeinfer::moe
