// The GPU's expert cache (--expert-budget): every routed expert lives in pinned host memory
// (DeviceWeights::expert_home), S device slots hold what the budget allows, and the experts stage
// reads each expert through a device slot table that points at its slot or, for an expert
// without one, at its home. Admissions and copies are kernels (offload/cuda/expert_cache.h)
// that decide from the routing in device memory, so a decode step stays one CUDA graph whose
// replays admit and copy whatever that step's routing needs.
//
// Per MoE layer l the decoder calls, in stream order:
//   join(stream)               the prefetch for l (issued at l - 1) has finished its copies
//                              (before anything rewrites what it reads; admit and prefetch
//                              refuse to run while one is pending)
//   admit(l, ids, rows, ...)   demand: the layer's missing experts get slots, copied now; under
//                              --cold-experts cpu|auto the misses the cost model sends to the
//                              host are computed there instead, by the host worker, from the
//                              rows the admission staged in pinned memory
//   prefetch(l + 1, ids', ...) the next layer's predicted experts, admitted and copied on a
//                              copy stream while layer l computes
// and the experts stage then reads gate_up_table(l) / down_table(l), skipping the host's experts
// (null entries), and merge_host_rows(l, ...) puts the host's results among its outputs.
//
// The host's compute is a worker thread of this object (under --cold-experts cpu|auto), which
// the GPU signals through mapped memory (offload/cuda/expert_cache.h's header has the protocol):
// the demand admission kernel publishes (layer, sequence) when it sent misses to the host, the
// worker runs moe::run_experts over the experts' weights where they live, beside the GPU's copies
// and grouped GEMM of the same layer, and publishes done = sequence; merge_host_rows's wait
// kernel waits on the device for it, and its two kernels return at once for a layer with
// nothing on the host. No stream, event or host node joins the host, so such a layer costs two
// empty kernels, and the sequence numbers advance on the device, so a decode graph replays as
// captured.
// The destructor synchronises the device (no merge left waiting) before it stops the worker.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <span>
#include <thread>
#include <vector>

#include "io/model_config.h"
#include "model/cuda/device_memory.h"
#include "model/cuda/device_weights.h"
#include "moe/stages.h"
#include "offload/cuda/expert_cache.h"
#include "offload/offload_options.h"

namespace moeinfer::gpu {

class CachedExperts {
 public:
  // weights: built with offload_experts. options.hot_set_file, when given, is a routing trace
  // whose ranking warms the slots before traffic (and, for the static policy, names the hot
  // set). max_assignments_per_layer: T*K of a decode step, which sizes the static policy's
  // streaming slots (offload::static_reserve_slots, the CPU's rule); max_step_tokens: the most
  // rows one step carries (the host staging's size).
  CachedExperts(const ModelConfig& config, const DeviceWeights& weights,
                const offload::OffloadOptions& options, int64_t max_assignments_per_layer,
                int64_t max_step_tokens);
  ~CachedExperts();
  CachedExperts(const CachedExperts&) = delete;
  CachedExperts& operator=(const CachedExperts&) = delete;

  int64_t num_slots() const { return num_slots_; }
  int64_t slot_bytes() const { return expert_bytes_; }
  int64_t device_bytes() const { return device_bytes_; }

  void join(cudaStream_t stream);
  // rows: the layer's input [num_rows, Hp] on the device (what a host-computed expert reads).
  void admit(int64_t layer, const int32_t* topk_ids, int64_t num_assignments, const bf16* rows,
             int64_t num_rows, cudaStream_t stream);
  void prefetch(int64_t layer, const int32_t* topk_ids, int64_t num_assignments,
                cudaStream_t stream);
  // After the experts stage of the layer admit() last ran: kernels that wait on the device for
  // the host's compute (returning at once when the layer sent nothing to the host) and write
  // its results into expert_out's rows (inverse: the plan's). No-op under kGpu.
  void merge_host_rows(int64_t layer, const int32_t* topk_ids, const int32_t* inverse,
                       bf16* expert_out, int64_t num_assignments, cudaStream_t stream);
  // Whether prefetches copy anything (not under kCpu, where no miss is copied).
  bool prefetches() const {
    return prefetch_ != offload::PrefetchMode::kOff && cold_.mode != offload::ColdExperts::kCpu;
  }
  // The cost model kAuto decides with (measured at construction), or the mode alone.
  const offload::ColdCost& cold_cost() const { return cold_; }

  const bf16* const* gate_up_table(int64_t layer) const {
    return gate_up_table_ + layer * num_experts_;
  }
  const bf16* const* down_table(int64_t layer) const { return down_table_ + layer * num_experts_; }

  // The counters ([L, kNumCacheCounters], cumulative) copied to pinned memory on `stream`, and
  // read after the stream has passed that point.
  void enqueue_counter_readback(cudaStream_t stream);
  std::span<const int64_t> counters() const {
    return {host_counters_.get(), static_cast<size_t>(num_layers_ * offload::kNumCacheCounters)};
  }

 private:
  offload::cuda::AdmitParams admit_params(int64_t layer, const int32_t* ids, int64_t n,
                                          bool prefetch) const;
  // The expert's weights where the host reads them: its bf16 home, or with two weight terms
  // their float32 sum widened into *wide (which the view points into).
  moe::ExpertWeights host_view(int64_t layer, int64_t expert, std::vector<float>* wide) const;
  void measure_cold_cost(std::span<const int32_t> slot_owners);  // [S] after the warm-up
  // The worker's loop: waits for each request, computes it, publishes done; returns once
  // stop_worker_ is set and no request is left.
  void serve_host_requests();
  void compute_on_host(int64_t layer);  // on the worker; reports its errors, never throws

  int64_t num_layers_ = 0, num_experts_ = 0, num_slots_ = 0, expert_bytes_ = 0;
  int64_t device_bytes_ = 0;
  offload::CachePolicy policy_ = offload::CachePolicy::kLfu;
  offload::PrefetchMode prefetch_ = offload::PrefetchMode::kAuto;  // --expert-prefetch
  int demand_blocks_ = 0, prefetch_blocks_ = 0;
  DeviceArray<char> memory_;  // slots, tables, clock, counters, copy lists
  bf16* slots_ = nullptr;
  bf16** gate_up_table_ = nullptr;
  bf16** down_table_ = nullptr;
  bf16** home_gate_up_ = nullptr;
  bf16** home_down_ = nullptr;
  offload::CacheTables tables_;  // device pointers
  uint8_t* hot_ = nullptr;
  int64_t* clock_ = nullptr;
  int64_t* counters_ = nullptr;
  offload::cuda::CopyList demand_copies_, prefetch_copies_;
  int32_t* demand_lists_ = nullptr;  // [admit_lists_size(E)] or null
  int32_t* prefetch_lists_ = nullptr;
  std::vector<bf16*> host_home_gate_up_, host_home_down_;  // [L]
  int64_t gate_up_elems_ = 0, down_elems_ = 0;  // an expert's slab of each, all its terms
  int64_t weight_terms_ = 1;
  PinnedArray<int64_t> host_counters_;
  StreamHandle copy_stream_;
  cudaEvent_t fork_ = nullptr, prefetch_done_ = nullptr;
  bool prefetch_pending_ = false;

  // Cold experts on the host.
  offload::ColdCost cold_;
  int64_t top_k_ = 0, hidden_elems_ = 0, expert_width_ = 0;  // K, Hp, Ip
  PinnedArray<char> staging_memory_;  // mapped
  offload::cuda::HostStaging staging_;  // its sequence words in memory_
  bool host_pending_ = false;  // admit() ran and merge_host_rows() not yet (call order only)
  // The worker's buffers, reused.
  std::vector<int32_t> host_assignments_, host_offsets_;
  std::vector<float> host_rows_, host_out_;
  std::vector<moe::ExpertWeights> host_views_;
  std::vector<std::vector<float>> host_wide_;  // two weight terms: widened experts, per view
  // The host worker: started at the end of the constructor (nothing throws after it, so no
  // joinable thread is ever destroyed), stopped and joined in the destructor.
  int device_ = 0;  // the worker's GPU: the destructor synchronises it
  std::atomic<bool> stop_worker_{false};
  std::thread host_worker_;
};

}  // namespace moeinfer::gpu
