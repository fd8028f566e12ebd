#include "model/cuda/cached_experts.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <deque>

#include "backend/cpu/gemm.h"
#include "backend/cuda/cuda_check.h"
#include "core/dtype.h"
#include "core/error.h"
#include "moe/cached_experts.h"
#include "offload/host_cache.h"
#include "offload/hot_set.h"
#include "parallel/communicator.h"

namespace moeinfer::gpu {
namespace {

// Blocks of the copy kernel. A demand copy has the GPU to itself (the experts wait for it); a
// prefetch shares it with the layer it overlaps, and a few blocks keep PCIe busy.
constexpr int kDemandCopyBlocksPerSm = 2;
constexpr int kPrefetchCopyBlocks = 16;

template <typename T>
void upload(T* dst, const T* src, int64_t count) {
  CUDA_CHECK(cudaMemcpy(dst, src, static_cast<size_t>(count) * sizeof(T), cudaMemcpyHostToDevice));
}
template <typename T>
void upload(T* dst, const std::vector<T>& src) {
  upload(dst, src.data(), static_cast<int64_t>(src.size()));
}

}  // namespace

CachedExperts::CachedExperts(const ModelConfig& config, const DeviceWeights& weights,
                             const offload::OffloadOptions& options,
                             int64_t max_assignments_per_layer, int64_t max_step_tokens)
    : num_layers_(config.num_layers),
      num_experts_(config.num_experts),
      policy_(options.policy),
      prefetch_(options.prefetch),
      cold_{.mode = options.cold},
      top_k_(config.num_experts_per_tok) {
  MOE_CHECK(weights.experts_offloaded, "the expert cache needs offloaded expert weights");
  MOE_CHECK(num_layers_ * num_experts_ <= INT32_MAX, "num_hidden_layers ", num_layers_,
            " x num_experts ", num_experts_,
            ": the expert cache numbers the experts of all layers with int32 ids, up to 2^31 - 1");
  if (cold_.mode != offload::ColdExperts::kGpu) {
    const int64_t merge_max = offload::cuda::merge_host_rows_max_experts();
    MOE_CHECK(num_experts_ <= merge_max, "num_experts ", num_experts_,
              ": --cold-experts cpu|auto merges the host's rows by a bit per expert in shared "
              "memory, which holds ",
              merge_max, " on this GPU; use --cold-experts gpu");
  }
  const int64_t Hp = weights.padded_hidden_size, Ip = weights.padded_expert_width;
  hidden_elems_ = Hp;
  expert_width_ = Ip;
  weight_terms_ = weights.weight_terms;
  // An expert's slab holds its terms (hi, then lo with two) of each matrix.
  gate_up_elems_ = weight_terms_ * 2 * Ip * Hp;
  down_elems_ = weight_terms_ * Hp * Ip;
  expert_bytes_ = (gate_up_elems_ + down_elems_) * static_cast<int64_t>(sizeof(bf16));
  int64_t moe_layers = 0;
  for (const DeviceLayer& d : weights.layers) moe_layers += d.is_moe ? 1 : 0;
  num_slots_ = options.num_slots(expert_bytes_, moe_layers * num_experts_);
  const int64_t LE = num_layers_ * num_experts_, S = num_slots_, E = num_experts_;

  auto carve = [&](Carver& p) {
    slots_ = p.take<bf16>(S * (gate_up_elems_ + down_elems_));
    gate_up_table_ = p.take<bf16*>(LE);
    down_table_ = p.take<bf16*>(LE);
    home_gate_up_ = p.take<bf16*>(num_layers_);
    home_down_ = p.take<bf16*>(num_layers_);
    tables_.slot_of = p.take<int32_t>(LE);
    tables_.owner = p.take<int32_t>(S);
    tables_.last_use = p.take<int64_t>(S);
    tables_.uses = p.take<int64_t>(LE);
    tables_.prefetched = p.take<uint8_t>(S);
    hot_ = p.take<uint8_t>(LE);
    clock_ = p.take<int64_t>(offload::cuda::kClockWords);
    counters_ = p.take<int64_t>(num_layers_ * offload::kNumCacheCounters);
    for (offload::cuda::CopyList* list : {&demand_copies_, &prefetch_copies_}) {
      list->experts = p.take<int32_t>(E);
      list->slots = p.take<int32_t>(E);
      list->count = p.take<int32_t>(1);
    }
    // The admissions' lists past what shared memory holds; a demand and a prefetch may overlap.
    const int64_t lists = offload::cuda::admit_lists_size(E);
    demand_lists_ = lists > 0 ? p.take<int32_t>(lists) : nullptr;
    prefetch_lists_ = lists > 0 ? p.take<int32_t>(lists) : nullptr;
    staging_.sequence = p.take<int64_t>(2);  // the hand-off with the host worker
  };
  Carver sizing(nullptr);
  carve(sizing);
  device_bytes_ = static_cast<int64_t>(sizing.used());
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  MOE_CHECK(static_cast<size_t>(device_bytes_) < free_bytes, "the expert cache of ", S,
            " slots needs ", device_bytes_ >> 20, " MiB of device memory, ", free_bytes >> 20,
            " MiB are free (lower --expert-budget)");
  memory_ = device_array<char>(static_cast<size_t>(device_bytes_));
  Carver assign(memory_.get());
  carve(assign);
  tables_.num_slots = S;
  tables_.policy = policy_;
  tables_.hot = hot_;

  // Homes as device addresses of the mapped pinned memory.
  char* home_device = nullptr;
  const cudaError_t mapped = cudaHostGetDevicePointer(reinterpret_cast<void**>(&home_device),
                                                      weights.expert_home.get(), 0);
  MOE_CHECK(mapped == cudaSuccess, "the offloaded experts' home (",
            static_cast<const void*>(weights.expert_home.get()), ", ", weights.expert_home_bytes,
            " bytes) is not mapped for the device: ", cudaGetErrorString(mapped));
  auto to_device = [&](const bf16* host) -> bf16* {
    if (host == nullptr) return nullptr;
    const char* h = reinterpret_cast<const char*>(host);
    return reinterpret_cast<bf16*>(home_device + (h - weights.expert_home.get()));
  };
  host_home_gate_up_.assign(static_cast<size_t>(num_layers_), nullptr);
  host_home_down_.assign(static_cast<size_t>(num_layers_), nullptr);
  std::vector<bf16*> home_gu(static_cast<size_t>(num_layers_)), home_dn(home_gu.size());
  std::vector<bf16*> gu_table(static_cast<size_t>(LE), nullptr), dn_table(gu_table.size());
  for (int64_t l = 0; l < num_layers_; ++l) {
    const DeviceLayer& d = weights.layers[l];
    if (!d.is_moe) continue;
    host_home_gate_up_[l] = const_cast<bf16*>(d.experts_gate_up);
    host_home_down_[l] = const_cast<bf16*>(d.experts_down);
    home_gu[l] = to_device(d.experts_gate_up);
    home_dn[l] = to_device(d.experts_down);
    if (cold_.mode != offload::ColdExperts::kGpu) continue;  // null: computed on the host
    for (int64_t e = 0; e < E; ++e) {
      gu_table[l * E + e] = home_gu[l] + e * gate_up_elems_;
      dn_table[l * E + e] = home_dn[l] + e * down_elems_;
    }
  }
  upload(home_gate_up_, home_gu);
  upload(home_down_, home_dn);
  upload(counters_,
         std::vector<int64_t>(static_cast<size_t>(num_layers_ * offload::kNumCacheCounters), 0));
  upload(staging_.sequence, std::vector<int64_t>{0, 0});

  // The starting state is the host's (offload/host_cache.h, as the CPU's budget starts): the
  // trace's ranking warms the slots, and for the static policy its top is the hot set.
  std::vector<int32_t> ranking;
  if (!options.hot_set_file.empty()) {
    ranking = offload::load_expert_ranking(options.hot_set_file, num_layers_, E);
  }
  for (int32_t g : ranking) {
    MOE_CHECK(weights.layers[g / E].is_moe, "expert ", g, " of ", options.hot_set_file,
              " is in a dense layer of this model");
  }
  offload::HostCacheTables start(num_layers_, E, S, policy_);
  if (policy_ == offload::CachePolicy::kStatic) {
    start.set_hot_set(ranking, S - offload::static_reserve_slots(E, max_assignments_per_layer, S));
  }
  for (const offload::SlotCopy& c : start.warm(ranking)) {
    bf16* gate_up = slots_ + c.slot * (gate_up_elems_ + down_elems_);
    CUDA_CHECK(
        cudaMemcpy(gate_up, host_home_gate_up_[c.expert / E] + (c.expert % E) * gate_up_elems_,
                   static_cast<size_t>(gate_up_elems_) * sizeof(bf16), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(gate_up + gate_up_elems_,
                          host_home_down_[c.expert / E] + (c.expert % E) * down_elems_,
                          static_cast<size_t>(down_elems_) * sizeof(bf16), cudaMemcpyHostToDevice));
    gu_table[c.expert] = gate_up;
    dn_table[c.expert] = gate_up + gate_up_elems_;
  }
  upload(gate_up_table_, gu_table);
  upload(down_table_, dn_table);
  const offload::CacheTables t = start.tables();
  std::vector<int32_t> slot_owners(t.owner, t.owner + S);
  upload(tables_.slot_of, t.slot_of, LE);
  upload(tables_.uses, t.uses, LE);
  upload(hot_, t.hot, LE);
  upload(tables_.owner, t.owner, S);
  upload(tables_.last_use, t.last_use, S);
  upload(tables_.prefetched, t.prefetched, S);
  upload(clock_, std::vector<int64_t>{start.tick(), start.tick()});

  cudaDeviceProp prop{};
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  device_ = device;
  demand_blocks_ = kDemandCopyBlocksPerSm * prop.multiProcessorCount;
  prefetch_blocks_ = kPrefetchCopyBlocks;
  cudaStream_t copy_stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream, cudaStreamNonBlocking));
  copy_stream_.reset(copy_stream);
  CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&prefetch_done_, cudaEventDisableTiming));
  host_counters_ =
      pinned_array<int64_t>(static_cast<size_t>(num_layers_ * offload::kNumCacheCounters));
  std::memset(host_counters_.get(), 0,
              static_cast<size_t>(num_layers_ * offload::kNumCacheCounters) * sizeof(int64_t));

  if (cold_.mode == offload::ColdExperts::kGpu) return;
  const int64_t A = max_step_tokens * top_k_;
  Carver staging_sizes(nullptr);
  auto carve_staging = [&](Carver& p) {
    staging_.experts = p.take<int32_t>(E);
    staging_.count = p.take<int32_t>(2);
    staging_.topk_ids = p.take<int32_t>(A);
    staging_.rows = p.take<bf16>(max_step_tokens * Hp);
    staging_.out = p.take<bf16>(A * Hp);
    // 256-byte apart (Carver): the GPU's request and the host's done share no cache line.
    staging_.request = p.take<int64_t>(2);
    staging_.done = p.take<int64_t>(1);
  };
  carve_staging(staging_sizes);
  staging_memory_ = mapped_pinned_array<char>(staging_sizes.used());
  Carver staging_assign(staging_memory_.get());
  carve_staging(staging_assign);
  staging_.row_elems = Hp;
  staging_.count[0] = 0;
  staging_.count[1] = 0;
  staging_.request[0] = 0;
  staging_.request[1] = 0;  // sequence 0: no request yet (the first demand is 1)
  *staging_.done = 0;
  // kCpu decides without it, but its rate is the floor of its host work (moeinfer bench).
  measure_cold_cost(slot_owners);
  // Last: nothing below may throw with the worker running (a joinable std::thread member would
  // terminate the process).
  host_worker_ = std::thread([this] { serve_host_requests(); });
}

moe::ExpertWeights CachedExperts::host_view(int64_t layer, int64_t expert,
                                            std::vector<float>* wide) const {
  const bf16* gate_up = host_home_gate_up_[layer] + expert * gate_up_elems_;
  const bf16* down = host_home_down_[layer] + expert * down_elems_;
  const int64_t Hp = hidden_elems_, Ip = expert_width_;
  if (weight_terms_ == 1) {
    return {.gate = {.dtype = DType::kBF16, .shape = {Ip, Hp}, .data = gate_up},
            .up = {.dtype = DType::kBF16, .shape = {Ip, Hp}, .data = gate_up + Ip * Hp},
            .down = {.dtype = DType::kBF16, .shape = {Hp, Ip}, .data = down}};
  }
  // Two terms: the float32 weight hi + lo, which the host multiplies as a float32 checkpoint.
  // The whole expert is widened per call, over the GEMM workers: on one thread this pass would
  // take several times the products that follow, which stream the weights on every core.
  const int64_t gu = 2 * Ip * Hp, dn = Hp * Ip;
  wide->resize(static_cast<size_t>(gu + dn));
  auto widen = [&](const bf16* hi, int64_t n, float* out) {
    const auto* h = reinterpret_cast<const uint16_t*>(hi);
    cpu::widen_bf16_terms(h, h + n, n, out);
  };
  float* w = wide->data();
  widen(gate_up, gu, w);
  widen(down, dn, w + gu);
  return {.gate = {.dtype = DType::kF32, .shape = {Ip, Hp}, .data = w},
          .up = {.dtype = DType::kF32, .shape = {Ip, Hp}, .data = w + Ip * Hp},
          .down = {.dtype = DType::kF32, .shape = {Hp, Ip}, .data = w + gu}};
}

void CachedExperts::measure_cold_cost(std::span<const int32_t> slot_owners) {
  int64_t first_moe = 0;
  while (host_home_gate_up_[first_moe] == nullptr) ++first_moe;
  // Experts of the last MoE layers, which start-up has not touched, timed from host memory.
  std::vector<moe::ExpertWeights> cold;
  std::deque<std::vector<float>> wide;  // two terms: the widened weights the views point into
  for (int64_t e = 0; e < num_experts_ && cold.size() < 6; ++e) {
    for (int64_t l = num_layers_ - 1; l >= first_moe && cold.size() < 6; --l) {
      if (host_home_gate_up_[l] != nullptr) cold.push_back(host_view(l, e, &wide.emplace_back()));
    }
  }
  const moe::HostExpertRate host =
      moe::measure_host_expert_rate(cold, hidden_elems_, expert_width_);
  cold_.host_ns = std::max<int64_t>(0, host.first_row_ns - host.row_ns);
  cold_.host_row_ns = host.row_ns;
  // A copy: the demand copy kernel moving a few experts into the first slots, best of a few;
  // a warmed slot gets its own expert again. Without slots no miss is ever copied.
  const int64_t n = std::min<int64_t>(num_slots_, 4);
  if (n == 0) return;
  std::vector<int32_t> experts(static_cast<size_t>(n)), slots(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    experts[i] = slot_owners[i] >= 0
                     ? slot_owners[i]
                     : static_cast<int32_t>(first_moe * num_experts_ + i % num_experts_);
    slots[i] = static_cast<int32_t>(i);
  }
  upload(demand_copies_.experts, experts);
  upload(demand_copies_.slots, slots);
  upload(demand_copies_.count, std::vector<int32_t>{static_cast<int32_t>(n)});
  cudaEvent_t start = nullptr, stop = nullptr;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  const offload::cuda::AdmitParams p = admit_params(first_moe, nullptr, 0, false);
  float best_ms = 1e30f;
  for (int r = 0; r < 3; ++r) {
    CUDA_CHECK(cudaEventRecord(start, nullptr));
    offload::cuda::copy_experts({.layout = p.layout,
                                 .copies = p.copies,
                                 .max_copies = num_experts_,
                                 .num_blocks = demand_blocks_},
                                nullptr);
    CUDA_CHECK(cudaEventRecord(stop, nullptr));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    best_ms = std::min(best_ms, ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  upload(demand_copies_.count, std::vector<int32_t>{0});
  cold_.copy_ns = static_cast<int64_t>(static_cast<double>(best_ms) * 1e6 / n);
}

CachedExperts::~CachedExperts() {
  if (host_worker_.joinable()) {
    // A wait kernel still polling for the worker would never return once it stops, and the
    // callers' streams are not ours: finish everything on our device first (its errors have
    // nowhere to go from a destructor; the thread's current device is put back). Then the
    // worker serves any request left and stops.
    int current = device_;
    cudaGetDevice(&current);
    if (current != device_) cudaSetDevice(device_);
    cudaDeviceSynchronize();
    if (current != device_) cudaSetDevice(current);
    stop_worker_.store(true, std::memory_order_release);
    host_worker_.join();
  }
  if (copy_stream_) cudaStreamSynchronize(copy_stream_.get());
  if (fork_) cudaEventDestroy(fork_);
  if (prefetch_done_) cudaEventDestroy(prefetch_done_);
}

offload::cuda::AdmitParams CachedExperts::admit_params(int64_t layer, const int32_t* ids, int64_t n,
                                                       bool prefetch) const {
  return {.tables = tables_,
          .layout = {.gate_up_table = gate_up_table_,
                     .down_table = down_table_,
                     .home_gate_up = home_gate_up_,
                     .home_down = home_down_,
                     .slots = slots_,
                     .gate_up_elems = gate_up_elems_,
                     .down_elems = down_elems_,
                     .num_experts = num_experts_,
                     .null_without_slot = cold_.mode != offload::ColdExperts::kGpu},
          .clock = clock_,
          .counters = counters_,
          .topk_ids = ids,
          .num_assignments = n,
          .layer = layer,
          .prefetch = prefetch,
          .prefetch_while_it_pays = prefetch && prefetch_ == offload::PrefetchMode::kAuto,
          .copies = prefetch ? prefetch_copies_ : demand_copies_,
          .cold = cold_,
          .host = staging_,
          .lists = prefetch ? prefetch_lists_ : demand_lists_};
}

void CachedExperts::join(cudaStream_t stream) {
  if (!prefetch_pending_) return;
  CUDA_CHECK(cudaStreamWaitEvent(stream, prefetch_done_, 0));
  prefetch_pending_ = false;
}

void CachedExperts::admit(int64_t layer, const int32_t* topk_ids, int64_t num_assignments,
                          const bf16* rows, int64_t num_rows, cudaStream_t stream) {
  MOE_CHECK(!prefetch_pending_, "expert cache: admit() before join() of the pending prefetch");
  MOE_CHECK(!host_pending_, "expert cache: admit() before merge_host_rows() of the last layer");
  offload::cuda::AdmitParams p = admit_params(layer, topk_ids, num_assignments, false);
  p.rows = rows;
  p.num_rows = num_rows;
  // Under cpu|auto the admission also tells the host worker about its misses (if any), which it
  // computes beside the copies and the grouped GEMM below; merge_host_rows waits for it.
  offload::cuda::admit_experts(p, stream);
  if (cold_.mode != offload::ColdExperts::kGpu) host_pending_ = true;
  offload::cuda::copy_experts({.layout = p.layout,
                               .copies = p.copies,
                               .max_copies = num_experts_,
                               .num_blocks = demand_blocks_},
                              stream);
}

void CachedExperts::prefetch(int64_t layer, const int32_t* topk_ids, int64_t num_assignments,
                             cudaStream_t stream) {
  MOE_CHECK(!prefetch_pending_, "expert cache: prefetch() before join() of the pending one");
  cudaStream_t copy = copy_stream_.get();
  CUDA_CHECK(cudaEventRecord(fork_, stream));
  CUDA_CHECK(cudaStreamWaitEvent(copy, fork_, 0));
  const offload::cuda::AdmitParams p = admit_params(layer, topk_ids, num_assignments, true);
  offload::cuda::admit_experts(p, copy);
  offload::cuda::copy_experts({.layout = p.layout,
                               .copies = p.copies,
                               .max_copies = num_experts_,
                               .num_blocks = prefetch_blocks_},
                              copy);
  CUDA_CHECK(cudaEventRecord(prefetch_done_, copy));
  prefetch_pending_ = true;
}

void CachedExperts::merge_host_rows(int64_t layer, const int32_t* topk_ids, const int32_t* inverse,
                                    bf16* expert_out, int64_t num_assignments,
                                    cudaStream_t stream) {
  if (!host_pending_) return;
  host_pending_ = false;
  // Its kernels return at once when the demand sent nothing to the host; otherwise they wait on
  // the device for the worker's done.
  offload::cuda::merge_host_rows({.host = staging_,
                                  .topk_ids = topk_ids,
                                  .inverse = inverse,
                                  .expert_out = expert_out,
                                  .num_assignments = num_assignments,
                                  .layer = layer,
                                  .num_experts = num_experts_},
                                 stream);
}

void CachedExperts::serve_host_requests() {
  // The worker spins 500 us after each request (a decode step's next host layer usually comes
  // sooner), then sleeps a tenth of the time waited, at most 200 us: the first host layer after
  // a longer pause (between steps, an idle server) may start up to that late, and an idle
  // engine costs about 5000 wake-ups a second instead of a core.
  constexpr parallel::PollBackoff kBackoff{.spin = std::chrono::microseconds(500),
                                           .longest_sleep = std::chrono::microseconds(200)};
  // Written by the GPU (its admission kernel) over PCIe, read here; aligned int64 words.
  std::atomic_ref<int64_t> request_sequence(staging_.request[1]);
  std::atomic_ref<int64_t> request_layer(staging_.request[0]);
  std::atomic_ref<int64_t> done(*staging_.done);
  int64_t served = 0;  // the sequence of the last request served (0: none)
  while (true) {
    int64_t sequence = served;
    parallel::poll_until(
        [&] {
          // Acquire: the layer and the staging, written before the sequence behind system
          // fences, are read after it.
          sequence = request_sequence.load(std::memory_order_acquire);
          return sequence != served || stop_worker_.load(std::memory_order_acquire);
        },
        kBackoff);
    if (sequence == served) return;  // stopping, nothing asked
    compute_on_host(request_layer.load(std::memory_order_relaxed));
    // Release: the results are in host memory before the GPU can see done (it reads them after
    // its acquire). Published whatever the compute did, so that the GPU never waits for ever.
    done.store(sequence, std::memory_order_release);
    served = sequence;
  }
}

void CachedExperts::compute_on_host(int64_t layer) {
  // On the worker: a failure is reported and the rows are left as they are (what an earlier
  // layer left, or zero), which the parity tests would see; done is published all the same.
  try {
    MOE_CHECK(layer >= 0 && layer < num_layers_ && host_home_gate_up_[layer] != nullptr,
              "the host worker was asked for layer ", layer, ", not an MoE layer of ", num_layers_);
    const int32_t num_host = staging_.count[0];
    if (num_host == 0) return;
    const int64_t A = staging_.count[1], Hp = hidden_elems_, E = num_experts_;
    host_assignments_.clear();
    host_offsets_.assign(1, 0);
    host_views_.clear();
    if (host_wide_.size() < static_cast<size_t>(num_host)) host_wide_.resize(num_host);
    for (int32_t i = 0; i < num_host; ++i) {
      const int64_t e = staging_.experts[i] - layer * E;
      for (int64_t a = 0; a < A; ++a) {
        if (staging_.topk_ids[a] == e) host_assignments_.push_back(static_cast<int32_t>(a));
      }
      host_offsets_.push_back(static_cast<int32_t>(host_assignments_.size()));
      host_views_.push_back(host_view(layer, e, &host_wide_[i]));
    }
    const size_t M = host_assignments_.size();
    host_rows_.resize(M * static_cast<size_t>(Hp));
    host_out_.resize(host_rows_.size());
    const uint16_t* in = reinterpret_cast<const uint16_t*>(staging_.rows);
    for (size_t r = 0; r < M; ++r) {
      const uint16_t* src = in + (host_assignments_[r] / top_k_) * Hp;
      float* dst = host_rows_.data() + r * Hp;
      for (int64_t h = 0; h < Hp; ++h) dst[h] = bf16_to_f32(src[h]);
    }
    moe::run_experts(host_rows_.data(), Hp, expert_width_, host_offsets_, host_views_,
                     host_out_.data());
    uint16_t* out = reinterpret_cast<uint16_t*>(staging_.out);
    for (size_t r = 0; r < M; ++r) {
      const float* src = host_out_.data() + r * Hp;
      uint16_t* dst = out + static_cast<int64_t>(host_assignments_[r]) * Hp;
      for (int64_t h = 0; h < Hp; ++h) dst[h] = f32_to_bf16(src[h]);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moeinfer: the host's expert compute of layer %lld failed: %s\n",
                 static_cast<long long>(layer), e.what());
  } catch (...) {
    std::fprintf(stderr, "moeinfer: the host's expert compute of layer %lld failed\n",
                 static_cast<long long>(layer));
  }
}

void CachedExperts::enqueue_counter_readback(cudaStream_t stream) {
  CUDA_CHECK(cudaMemcpyAsync(
      host_counters_.get(), counters_,
      static_cast<size_t>(num_layers_ * offload::kNumCacheCounters) * sizeof(int64_t),
      cudaMemcpyDeviceToHost, stream));
}

}  // namespace moeinfer::gpu
