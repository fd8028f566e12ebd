#include "model/cuda/cached_experts.h"

#include <algorithm>
#include <cstring>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"

namespace moeinfer::gpu {
namespace {

// Blocks of the copy kernel. A demand copy has the GPU to itself (the experts wait for it); a
// prefetch shares it with the layer it overlaps, and a few blocks keep PCIe busy.
constexpr int kDemandCopyBlocksPerSm = 2;
constexpr int kPrefetchCopyBlocks = 16;

size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Hands out 256-byte aligned pieces of one allocation; a null base only sizes.
class Pieces {
 public:
  explicit Pieces(char* base) : base_(base) {}
  template <typename T>
  T* take(int64_t count) {
    T* out = base_ ? reinterpret_cast<T*>(base_ + used_) : nullptr;
    used_ += align256(static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(T));
    return out;
  }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

template <typename T>
void upload(T* dst, const std::vector<T>& src) {
  CUDA_CHECK(cudaMemcpy(dst, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice));
}

template <typename T>
std::vector<T> download(const T* src, int64_t count) {
  std::vector<T> out(static_cast<size_t>(count));
  CUDA_CHECK(cudaMemcpy(out.data(), src, out.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

}  // namespace

CachedExperts::CachedExperts(const ModelConfig& config, const DeviceWeights& weights,
                             const offload::OffloadOptions& options, int64_t max_assignments,
                             std::span<const int32_t> ranking)
    : num_layers_(config.num_layers), num_experts_(config.num_experts), policy_(options.policy) {
  MOE_CHECK(weights.experts_offloaded, "the expert cache needs offloaded expert weights");
  MOE_CHECK(num_experts_ <= offload::cuda::kAdmitMaxExperts, "num_experts ", num_experts_,
            ": the expert cache's admission kernel takes up to ",
            offload::cuda::kAdmitMaxExperts);
  const int64_t Hp = weights.padded_hidden_size, Ip = weights.padded_expert_width;
  gate_up_elems_ = 2 * Ip * Hp;
  down_elems_ = Hp * Ip;
  expert_bytes_ = (gate_up_elems_ + down_elems_) * static_cast<int64_t>(sizeof(bf16));
  int64_t moe_layers = 0;
  for (const DeviceLayer& d : weights.layers) moe_layers += d.is_moe ? 1 : 0;
  num_slots_ = options.num_slots(expert_bytes_, moe_layers * num_experts_);
  const int64_t LE = num_layers_ * num_experts_, S = num_slots_, E = num_experts_;

  auto carve = [&](Pieces& p) {
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
  };
  Pieces sizing(nullptr);
  carve(sizing);
  device_bytes_ = static_cast<int64_t>(sizing.used());
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  MOE_CHECK(static_cast<size_t>(device_bytes_) < free_bytes, "the expert cache of ", S,
            " slots needs ", device_bytes_ >> 20, " MiB of device memory, ", free_bytes >> 20,
            " MiB are free (lower --expert-budget)");
  memory_ = device_array<char>(static_cast<size_t>(device_bytes_));
  Pieces assign(memory_.get());
  carve(assign);
  tables_.num_slots = S;
  tables_.policy = policy_;
  tables_.hot = hot_;

  // Homes as device addresses of the mapped pinned memory.
  char* home_device = nullptr;
  const cudaError_t mapped = cudaHostGetDevicePointer(reinterpret_cast<void**>(&home_device),
                                                      weights.expert_home.get(), 0);
  MOE_CHECK(mapped == cudaSuccess, "the offloaded experts' home (",
            static_cast<const void*>(weights.expert_home.get()), ", ",
            weights.expert_home_bytes, " bytes) is not mapped for the device: ",
            cudaGetErrorString(mapped));
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
    for (int64_t e = 0; e < E; ++e) {
      gu_table[l * E + e] = home_gu[l] + e * gate_up_elems_;
      dn_table[l * E + e] = home_dn[l] + e * down_elems_;
    }
  }
  upload(home_gate_up_, home_gu);
  upload(home_down_, home_dn);
  upload(gate_up_table_, gu_table);
  upload(down_table_, dn_table);
  upload(tables_.slot_of, std::vector<int32_t>(static_cast<size_t>(LE), -1));
  upload(tables_.owner, std::vector<int32_t>(static_cast<size_t>(S), -1));
  upload(tables_.last_use, std::vector<int64_t>(static_cast<size_t>(S), 0));
  upload(tables_.uses, std::vector<int64_t>(static_cast<size_t>(LE), 0));
  upload(tables_.prefetched, std::vector<uint8_t>(static_cast<size_t>(S), 0));
  upload(hot_, std::vector<uint8_t>(static_cast<size_t>(LE), 0));
  upload(clock_, std::vector<int64_t>(offload::cuda::kClockWords, 0));
  upload(counters_, std::vector<int64_t>(static_cast<size_t>(num_layers_ *
                                                             offload::kNumCacheCounters), 0));

  for (int32_t g : ranking) {
    MOE_CHECK(g >= 0 && g < LE && weights.layers[g / E].is_moe, "expert ", g,
              " of the ranking is not a routed expert of this model");
  }
  if (policy_ == offload::CachePolicy::kStatic) {
    // The slots beyond the hot set stream the other experts: a layer's misses and a prefetch.
    const int64_t reserve = std::min(S, 2 * std::min(E, max_assignments));
    const int64_t hot = std::min<int64_t>(static_cast<int64_t>(ranking.size()), S - reserve);
    warm(ranking.first(static_cast<size_t>(hot)), /*hot=*/true);
    // The streaming slots start with the next experts of the ranking.
    warm(ranking.subspan(static_cast<size_t>(hot)), /*hot=*/false);
  } else {
    warm(ranking, /*hot=*/false);
  }

  cudaDeviceProp prop{};
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  demand_blocks_ = kDemandCopyBlocksPerSm * prop.multiProcessorCount;
  prefetch_blocks_ = kPrefetchCopyBlocks;
  cudaStream_t copy_stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream, cudaStreamNonBlocking));
  copy_stream_.reset(copy_stream);
  CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&prefetch_done_, cudaEventDisableTiming));
  host_counters_ = pinned_array<int64_t>(static_cast<size_t>(num_layers_ *
                                                             offload::kNumCacheCounters));
  std::memset(host_counters_.get(), 0,
              static_cast<size_t>(num_layers_ * offload::kNumCacheCounters) * sizeof(int64_t));
}

CachedExperts::~CachedExperts() {
  if (fork_) cudaEventDestroy(fork_);
  if (prefetch_done_) cudaEventDestroy(prefetch_done_);
}

// The free slots take the experts of the ranking in order (those not resident yet) before any
// traffic, the top of the ranking the most recently used: every warm stamp is below the clock,
// which starts past them.
void CachedExperts::warm(std::span<const int32_t> ranking, bool hot) {
  const int64_t LE = num_layers_ * num_experts_;
  std::vector<int32_t> slot_of = download(tables_.slot_of, LE);
  std::vector<int32_t> owner = download(tables_.owner, num_slots_);
  std::vector<int64_t> last_use = download(tables_.last_use, num_slots_);
  std::vector<uint8_t> hot_set = download(hot_, LE);
  std::vector<bf16*> gu_table = download(gate_up_table_, LE);
  std::vector<bf16*> dn_table = download(down_table_, LE);
  std::vector<int64_t> clock = download(clock_, offload::cuda::kClockWords);
  // Stamps count down from the clock's top: the first expert of this ranking is the newest.
  const int64_t top = clock[0] + static_cast<int64_t>(ranking.size());
  int32_t slot = 0;
  int64_t rank = 0;
  for (const int32_t g : ranking) {
    ++rank;
    if (slot_of[g] >= 0) continue;  // listed twice
    while (slot < num_slots_ && owner[slot] >= 0) ++slot;
    if (slot == num_slots_) break;
    slot_of[g] = slot;
    owner[slot] = g;
    last_use[slot] = top - rank + 1;
    if (hot) hot_set[g] = 1;
    bf16* gate_up = slots_ + slot * (gate_up_elems_ + down_elems_);
    const int64_t l = g / num_experts_, e = g % num_experts_;
    CUDA_CHECK(cudaMemcpy(gate_up, host_home_gate_up_[l] + e * gate_up_elems_,
                          static_cast<size_t>(gate_up_elems_) * sizeof(bf16),
                          cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(gate_up + gate_up_elems_, host_home_down_[l] + e * down_elems_,
                          static_cast<size_t>(down_elems_) * sizeof(bf16),
                          cudaMemcpyHostToDevice));
    gu_table[g] = gate_up;
    dn_table[g] = gate_up + gate_up_elems_;
  }
  upload(tables_.slot_of, slot_of);
  upload(tables_.owner, owner);
  upload(tables_.last_use, last_use);
  upload(hot_, hot_set);
  upload(gate_up_table_, gu_table);
  upload(down_table_, dn_table);
  upload(clock_, std::vector<int64_t>{top, top});
}

offload::cuda::AdmitParams CachedExperts::admit_params(int64_t layer, const int32_t* ids,
                                                       int64_t n, bool prefetch) const {
  return {.tables = tables_,
          .layout = {.gate_up_table = gate_up_table_,
                     .down_table = down_table_,
                     .home_gate_up = home_gate_up_,
                     .home_down = home_down_,
                     .slots = slots_,
                     .gate_up_elems = gate_up_elems_,
                     .down_elems = down_elems_,
                     .num_experts = num_experts_},
          .clock = clock_,
          .counters = counters_,
          .topk_ids = ids,
          .num_assignments = n,
          .layer = layer,
          .prefetch = prefetch,
          .copies = prefetch ? prefetch_copies_ : demand_copies_};
}

void CachedExperts::join(cudaStream_t stream) {
  if (!prefetch_pending_) return;
  CUDA_CHECK(cudaStreamWaitEvent(stream, prefetch_done_, 0));
  prefetch_pending_ = false;
}

void CachedExperts::admit(int64_t layer, const int32_t* topk_ids, int64_t num_assignments,
                          cudaStream_t stream) {
  join(stream);
  const offload::cuda::AdmitParams p = admit_params(layer, topk_ids, num_assignments, false);
  offload::cuda::admit_experts(p, stream);
  offload::cuda::copy_experts({.layout = p.layout, .copies = p.copies, .max_copies = num_experts_,
                               .num_blocks = demand_blocks_},
                              stream);
}

void CachedExperts::prefetch(int64_t layer, const int32_t* topk_ids, int64_t num_assignments,
                             cudaStream_t stream) {
  join(stream);
  cudaStream_t copy = copy_stream_.get();
  CUDA_CHECK(cudaEventRecord(fork_, stream));
  CUDA_CHECK(cudaStreamWaitEvent(copy, fork_, 0));
  const offload::cuda::AdmitParams p = admit_params(layer, topk_ids, num_assignments, true);
  offload::cuda::admit_experts(p, copy);
  offload::cuda::copy_experts({.layout = p.layout, .copies = p.copies, .max_copies = num_experts_,
                               .num_blocks = prefetch_blocks_},
                              copy);
  CUDA_CHECK(cudaEventRecord(prefetch_done_, copy));
  prefetch_pending_ = true;
}

void CachedExperts::enqueue_counter_readback(cudaStream_t stream) {
  CUDA_CHECK(cudaMemcpyAsync(host_counters_.get(), counters_,
                             static_cast<size_t>(num_layers_ * offload::kNumCacheCounters) *
                                 sizeof(int64_t),
                             cudaMemcpyDeviceToHost, stream));
}

CachedExperts::Snapshot CachedExperts::snapshot() const {
  CUDA_CHECK(cudaDeviceSynchronize());
  const int64_t LE = num_layers_ * num_experts_;
  return {.slot_of = download(tables_.slot_of, LE),
          .owner = download(tables_.owner, num_slots_),
          .last_use = download(tables_.last_use, num_slots_),
          .uses = download(tables_.uses, LE),
          .prefetched = download(tables_.prefetched, num_slots_),
          .counters = download(counters_, num_layers_ * offload::kNumCacheCounters)};
}

}  // namespace moeinfer::gpu
