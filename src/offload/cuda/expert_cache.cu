// Admission is sequential by nature (each miss's victim depends on the previous placements), and
// a layer has few misses, so one block runs it: thread 0 walks the decisions of admit() in its
// order, and the whole block finds each victim, a min-reduction of eviction_key over the S slots
// (tens of thousands for a large budget) with ties to the lower slot, as choose_slot() does.
//
// The copy reads host memory through the SMs: four 16-byte loads in flight per thread before
// their stores, a grid-stride over (expert, vector) pairs of the whole list, so that a few blocks
// keep PCIe busy while the rest of the GPU computes the layer beside it.
#include <algorithm>
#include <climits>
#include <cstdio>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "offload/cuda/expert_cache.h"

namespace moeinfer::offload::cuda {
namespace {

constexpr int kAdmitThreads = 1024;
constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 4;

__device__ bf16* home_gate_up(const ExpertSlotsLayout& l, int32_t g) {
  return l.home_gate_up[g / l.num_experts] + (g % l.num_experts) * l.gate_up_elems;
}
__device__ bf16* home_down(const ExpertSlotsLayout& l, int32_t g) {
  return l.home_down[g / l.num_experts] + (g % l.num_experts) * l.down_elems;
}
__device__ bf16* slot_gate_up(const ExpertSlotsLayout& l, int32_t slot) {
  return l.slots + static_cast<int64_t>(slot) * (l.gate_up_elems + l.down_elems);
}

// The block's lowest (key, slot) among evictable slots, or slot -1.
__device__ int32_t block_choose_slot(const CacheTables& t, int64_t protect_from) {
  __shared__ int64_t s_key[kAdmitThreads / 32];
  __shared__ int32_t s_slot[kAdmitThreads / 32];
  int64_t best_key = kNotEvictable;
  int32_t best = -1;
  for (int64_t s = threadIdx.x; s < t.num_slots; s += blockDim.x) {
    const int64_t key = eviction_key(t, s, protect_from);
    if (key < best_key) {  // s ascends within a thread: the first of equal keys stays
      best_key = key;
      best = static_cast<int32_t>(s);
    }
  }
  auto better = [](int64_t ka, int32_t sa, int64_t kb, int32_t sb) {
    if (sb < 0) return true;
    if (sa < 0) return false;
    return ka < kb || (ka == kb && sa < sb);
  };
  for (int offset = 16; offset > 0; offset >>= 1) {
    const int64_t k = __shfl_down_sync(0xffffffffu, best_key, offset);
    const int32_t s = __shfl_down_sync(0xffffffffu, best, offset);
    if (!better(best_key, best, k, s)) {
      best_key = k;
      best = s;
    }
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    s_key[warp] = best_key;
    s_slot[warp] = best;
  }
  __syncthreads();
  __shared__ int32_t s_best;
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) {
      if (!better(best_key, best, s_key[w], s_slot[w])) {
        best_key = s_key[w];
        best = s_slot[w];
      }
    }
    s_best = best;
  }
  __syncthreads();
  const int32_t result = s_best;
  __syncthreads();  // s_key / s_slot / s_best are reused by the next call
  return result;
}

__device__ void point_at_home(const ExpertSlotsLayout& l, int32_t g) {
  l.gate_up_table[g] = l.null_without_slot ? nullptr : home_gate_up(l, g);
  l.down_table[g] = l.null_without_slot ? nullptr : home_down(l, g);
}

// The ids and input rows of a layer whose misses the host computes, into host memory; then the
// demand's sequence number, and the request to the host's worker when it has work (the
// protocol: expert_cache.h's header).
__device__ void stage_for_host(const AdmitParams& p, int32_t num_host) {
  const HostStaging& h = p.host;
  if (num_host > 0) {
    for (int64_t a = threadIdx.x; a < p.num_assignments; a += blockDim.x) {
      h.topk_ids[a] = p.topk_ids[a];
    }
    const int64_t vecs = p.num_rows * h.row_elems / 8;
    const uint4* src = reinterpret_cast<const uint4*>(p.rows);
    uint4* dst = reinterpret_cast<uint4*>(h.rows);
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) dst[v] = src[v];
  }
  if (threadIdx.x == 0) {
    h.count[0] = num_host;
    h.count[1] = static_cast<int32_t>(p.num_assignments);
  }
  // Each thread's staging reaches host memory before the barrier, and so before the request.
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x != 0) return;
  const int64_t sequence = h.sequence[0] + 1;
  h.sequence[0] = sequence;
  h.sequence[1] = num_host;
  if (num_host == 0) return;  // nothing for the host: its worker is not told, the merge skips
  volatile int64_t* request = h.request;
  request[0] = p.layer;
  __threadfence_system();  // the layer (and, cumulatively, the staging) before the sequence
  request[1] = sequence;
}

// kListsInDevice: the misses and rows per expert live in p.lists (past kAdmitMaxSharedExperts);
// the block's __syncthreads order those accesses as they order shared ones. A template
// parameter, so the shared instantiation keeps shared-memory loads, stores and atomics.
template <bool kListsInDevice>
__global__ void __launch_bounds__(kAdmitThreads)
    admit_experts_kernel(const __grid_constant__ AdmitParams p) {
  extern __shared__ int32_t s_lists[];  // [2E] unless kListsInDevice
  const int64_t E = p.layout.num_experts;
  // Every thread reads the same words (written by earlier kernels), so all return or none.
  if (p.prefetch_while_it_pays &&
      !prefetch_pays(p.counters + p.layer * kNumCacheCounters, p.clock[1])) {
    if (threadIdx.x == 0) *p.copies.count = 0;
    return;
  }
  int32_t* const s_misses = kListsInDevice ? p.lists : s_lists;  // [E] the misses in order
  int32_t* const rows_of = s_misses + E;                         // [E] rows using each expert
  __shared__ int32_t s_num_misses, s_to_host, s_num_host;
  __shared__ int64_t s_tick, s_protect;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) rows_of[e] = 0;
  __syncthreads();
  for (int64_t a = threadIdx.x; a < p.num_assignments; a += blockDim.x) {
    const int32_t id = p.topk_ids[a];
    if (id >= 0 && id < E) atomicAdd(&rows_of[id], 1);
  }
  const CacheTables& t = p.tables;
  int64_t* counters = p.counters + p.layer * kNumCacheCounters;
  const int32_t base = static_cast<int32_t>(p.layer * E);
  __shared__ unsigned long long s_counters[kNumCacheCounters];
  __shared__ int32_t s_warp_misses[kAdmitThreads / 32];
  if (threadIdx.x == 0) {
    const int64_t tick = ++p.clock[0];
    s_tick = tick;
    s_protect = p.prefetch ? p.clock[1] : tick;
    if (!p.prefetch) p.clock[1] = tick;
    s_num_misses = 0;
  }
  if (threadIdx.x < kNumCacheCounters) s_counters[threadIdx.x] = 0;
  __syncthreads();
  const Admission a{.layer = p.layer, .num_experts = E, .tick = s_tick,
                    .protect_from = s_protect, .prefetch = p.prefetch};
  // The touches of resident experts are independent (distinct experts, distinct slots), so each
  // thread takes its own; the misses are listed in expert order, as admit() walks them, by a
  // block-wide prefix count of each round of blockDim.x experts.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int num_warps = static_cast<int>(blockDim.x >> 5);
  for (int64_t round = 0; round < E; round += blockDim.x) {
    const int64_t e = round + threadIdx.x;
    bool miss = false;
    int32_t g = -1;
    if (e < E && rows_of[e] > 0) {
      g = base + static_cast<int32_t>(e);
      if (!a.prefetch) t.uses[g] += 1;
      const int32_t slot = t.slot_of[g];
      if (slot >= 0) {
        int64_t mine[kNumCacheCounters] = {};
        touch_resident(t, a, slot, mine);
        for (int c = 0; c < kNumCacheCounters; ++c) {
          if (mine[c] != 0) atomicAdd(&s_counters[c], static_cast<unsigned long long>(mine[c]));
        }
      } else {
        miss = true;
      }
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, miss);
    if (lane == 0) s_warp_misses[warp] = __popc(ballot);
    __syncthreads();
    int32_t before = s_num_misses, total = 0;
    for (int w = 0; w < num_warps; ++w) {
      if (w < warp) before += s_warp_misses[w];
      total += s_warp_misses[w];
    }
    if (miss) s_misses[before + __popc(ballot & ((1u << lane) - 1u))] = g;
    __syncthreads();  // every thread has read s_num_misses and s_warp_misses
    if (threadIdx.x == 0) s_num_misses += total;
    __syncthreads();
  }
  if (threadIdx.x < kNumCacheCounters && s_counters[threadIdx.x] != 0) {
    counters[threadIdx.x] += static_cast<int64_t>(s_counters[threadIdx.x]);
  }
  __syncthreads();
  // The misses in order, as admit() places them: thread 0 decides, the block finds victims.
  const bool host_allowed = !a.prefetch && p.cold.mode != ColdExperts::kGpu;
  const bool cpu_only = host_allowed && p.cold.mode == ColdExperts::kCpu;
  ColdQueues queues;       // thread 0's
  int32_t num_copies = 0;  // thread 0's
  int32_t num_host = 0;    // thread 0's
  for (int32_t m = 0; m < s_num_misses; ++m) {
    const int32_t g = s_misses[m];
    if (threadIdx.x == 0) {
      s_to_host = host_allowed && !cpu_only && miss_on_host(p.cold, rows_of[g - base], queues)
                      ? 1
                      : 0;
    }
    __syncthreads();
    int32_t slot = s_to_host ? -1 : block_choose_slot(t, a.protect_from);
    if (threadIdx.x == 0) {
      if (cpu_only) slot = free_slot_or_none(t, slot);
      if (slot < 0) {
        if (host_allowed) {
          count_on_host(rows_of[g - base], counters);
          p.host.experts[num_host++] = g;
        } else if (!a.prefetch) {
          counters[kCacheUnplaced] += 1;
        }
      } else {
        const int32_t old = t.owner[slot];
        if (old >= 0) point_at_home(p.layout, old);
        place(t, a, g, slot, p.counters);
        bf16* gate_up = slot_gate_up(p.layout, slot);
        p.layout.gate_up_table[g] = gate_up;
        p.layout.down_table[g] = gate_up + p.layout.gate_up_elems;
        p.copies.experts[num_copies] = g;
        p.copies.slots[num_copies] = slot;
        ++num_copies;
      }
    }
    __syncthreads();  // the next reduction sees this placement
  }
  if (threadIdx.x == 0) {
    *p.copies.count = num_copies;
    s_num_host = num_host;
  }
  __syncthreads();
  if (host_allowed) stage_for_host(p, s_num_host);
}

// Until the host's worker has published done == sequence. No time limit: the worker publishes
// every request it takes, a failed compute included, and lives as long as the cache; a limit
// would turn a slow host into wrong outputs.
__device__ void wait_for_host(const int64_t* done, int64_t sequence) {
  const volatile int64_t* flag = done;
  unsigned sleep_ns = 32;
  while (*flag != sequence) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700
    __nanosleep(sleep_ns);
#endif
    sleep_ns = min(sleep_ns * 2, 1024u);
  }
  __threadfence_system();  // with the volatile load, an acquire: the results are read after it
}

// One thread, before the merge on its stream: the only poller of `done`, so that the merge's
// blocks (up to 256) do not each send reads over PCIe while the host computes and a prefetch
// copies beside it. The merge starts after this kernel ends (stream order), so it reads the
// results after the acquire.
__global__ void wait_for_host_kernel(const __grid_constant__ HostStaging h) {
  // Device memory, written by this stream's admission: a layer with nothing on the host reads
  // no host memory and waits for nothing.
  if (h.sequence[1] == 0) return;
  wait_for_host(h.done, h.sequence[0]);
}

__global__ void merge_host_rows_kernel(const __grid_constant__ MergeHostParams p) {
  extern __shared__ uint32_t s_on_host[];  // [ceil(E / 32)] a bit per expert
  if (p.host.sequence[1] == 0) return;     // nothing went to the host (wait_for_host_kernel)
  const int32_t num_host = __ldcv(p.host.count);
  const int64_t words = (p.num_experts + 31) / 32;
  for (int64_t w = threadIdx.x; w < words; w += blockDim.x) s_on_host[w] = 0;
  __syncthreads();
  for (int32_t i = threadIdx.x; i < num_host; i += blockDim.x) {
    const int64_t e = __ldcv(p.host.experts + i) - p.layer * p.num_experts;
    atomicOr(&s_on_host[e / 32], 1u << (e % 32));
  }
  __syncthreads();
  const int64_t vecs = p.host.row_elems / 8;
  for (int64_t a = blockIdx.x; a < p.num_assignments; a += gridDim.x) {
    const int32_t id = p.topk_ids[a];
    if (id < 0 || id >= p.num_experts || ((s_on_host[id / 32] >> (id % 32)) & 1u) == 0) continue;
    const uint4* src = reinterpret_cast<const uint4*>(p.host.out + a * p.host.row_elems);
    uint4* dst = reinterpret_cast<uint4*>(p.expert_out + p.inverse[a] * p.host.row_elems);
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) dst[v] = __ldcv(src + v);
  }
}

__global__ void __launch_bounds__(kCopyThreads)
    copy_experts_kernel(const __grid_constant__ CopyParams p) {
  const int64_t count = *p.copies.count;
  const int64_t gate_up_vecs = p.layout.gate_up_elems / 8;
  const int64_t expert_vecs = gate_up_vecs + p.layout.down_elems / 8;
  const int64_t total = count * expert_vecs;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kCopyThreads * kCopyUnroll;
  for (int64_t first = (static_cast<int64_t>(blockIdx.x) * kCopyThreads * kCopyUnroll) +
                       threadIdx.x;
       first < total; first += stride) {
    uint4 values[kCopyUnroll];
    uint4* dst[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t item = first + u * kCopyThreads;
      dst[u] = nullptr;
      if (item >= total) continue;
      const int64_t c = item / expert_vecs, v = item % expert_vecs;
      const int32_t g = p.copies.experts[c], slot = p.copies.slots[c];
      const uint4* src =
          v < gate_up_vecs
              ? reinterpret_cast<const uint4*>(home_gate_up(p.layout, g)) + v
              : reinterpret_cast<const uint4*>(home_down(p.layout, g)) + (v - gate_up_vecs);
      values[u] = *src;
      dst[u] = reinterpret_cast<uint4*>(slot_gate_up(p.layout, slot)) + v;
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (dst[u] != nullptr) *dst[u] = values[u];
    }
  }
}

// The most dynamic shared memory a block of this device can opt into.
size_t max_shared_per_block() {
  static const size_t bytes = [] {
    int device = 0, value = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    return static_cast<size_t>(value);
  }();
  return bytes;
}

void check_layout(const ExpertSlotsLayout& l) {
  MOE_CHECK(l.num_experts >= 1 && l.num_experts <= INT32_MAX, "num_experts = ", l.num_experts,
            " must be in [1, 2^31) (int32 expert ids)");
  MOE_CHECK(l.gate_up_elems > 0 && l.gate_up_elems % 8 == 0 && l.down_elems > 0 &&
                l.down_elems % 8 == 0,
            "expert matrices of ", l.gate_up_elems, " and ", l.down_elems,
            " elements: each must be a positive multiple of 8 (16-byte vectors)");
  MOE_CHECK(l.gate_up_table && l.down_table && l.home_gate_up && l.home_down,
            "the slot tables and the homes must be given");
}

}  // namespace

void admit_experts(const AdmitParams& p, cudaStream_t stream) {
  check_layout(p.layout);
  MOE_CHECK(p.tables.num_slots == 0 || p.layout.slots != nullptr, "slots must be given");
  MOE_CHECK(p.tables.slot_of && p.tables.uses &&
                (p.tables.num_slots == 0 ||
                 (p.tables.owner && p.tables.last_use && p.tables.prefetched)),
            "the cache tables must be given");
  MOE_CHECK(p.tables.policy != CachePolicy::kStatic || p.tables.hot != nullptr,
            "the static policy needs its hot set");
  MOE_CHECK(p.clock && p.counters && p.copies.experts && p.copies.slots && p.copies.count,
            "the clock, counters and copy list must be given");
  MOE_CHECK(p.num_assignments >= 0 && (p.num_assignments == 0 || p.topk_ids != nullptr),
            "num_assignments = ", p.num_assignments, " without ids");
  if (!p.prefetch && p.cold.mode != ColdExperts::kGpu) {
    MOE_CHECK(p.host.experts && p.host.count && p.host.topk_ids && p.host.rows && p.host.sequence &&
                  p.host.request && p.rows && p.host.row_elems > 0 && p.host.row_elems % 8 == 0 &&
                  p.num_rows >= 0,
              "a demand with cold experts on the host needs the host staging (with its sequence "
              "and request words) and the rows");
  }
  // Global ids g = layer * E + e are int32.
  MOE_CHECK(p.layer >= 0 && (p.layer + 1) * p.layout.num_experts <= INT32_MAX, "layer ", p.layer,
            " of ", p.layout.num_experts, " experts: the global expert ids pass 2^31");
  const int64_t E = p.layout.num_experts;
  MOE_CHECK(admit_lists_size(E) == 0 || p.lists != nullptr, "lists is null but ", E,
            " experts (past ", kAdmitMaxSharedExperts,
            " in shared memory) need admit_lists_size() = ", admit_lists_size(E), " ints");
  if (admit_lists_size(E) > 0) {
    admit_experts_kernel<true><<<1, kAdmitThreads, 0, stream>>>(p);
    MOE_CUDA_CHECK_LAUNCH();
    return;
  }
  const size_t smem = static_cast<size_t>(E) * 2 * sizeof(int32_t);
  static const bool sized = [] {
    CUDA_CHECK(cudaFuncSetAttribute(
        admit_experts_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
        static_cast<int>(kAdmitMaxSharedExperts * 2 * sizeof(int32_t))));
    return true;
  }();
  (void)sized;
  admit_experts_kernel<false><<<1, kAdmitThreads, smem, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH();
}

void merge_host_rows(const MergeHostParams& p, cudaStream_t stream) {
  MOE_CHECK(p.host.experts && p.host.count && p.host.out && p.host.sequence && p.host.done &&
                p.topk_ids && p.inverse && p.expert_out && p.host.row_elems > 0 &&
                p.host.row_elems % 8 == 0,
            "merge_host_rows: the staging (with its sequence and done words), ids, inverse and "
            "output must be given");
  MOE_CHECK(p.num_experts >= 1 && p.num_experts <= INT32_MAX, "num_experts = ", p.num_experts,
            " must be in [1, 2^31)");
  if (p.num_assignments == 0) return;
  // A bit per expert: 48 KB (the default) holds 393216 experts; more needs an opt-in, up to
  // what the device has.
  const size_t smem = static_cast<size_t>((p.num_experts + 31) / 32) * sizeof(uint32_t);
  if (smem > 48 * 1024) {
    MOE_CHECK(p.num_experts <= merge_host_rows_max_experts(),
              "merge_host_rows keeps a bit per expert in shared memory: ", p.num_experts,
              " experts need ", smem, " bytes, over the ", max_shared_per_block(),
              " a block of this device can have");
    CUDA_CHECK(cudaFuncSetAttribute(merge_host_rows_kernel,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
  }
  wait_for_host_kernel<<<1, 1, 0, stream>>>(p.host);
  MOE_CUDA_CHECK_LAUNCH();
  const int blocks = static_cast<int>(std::min<int64_t>(p.num_assignments, 256));
  merge_host_rows_kernel<<<blocks, 256, smem, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH();
}

int64_t merge_host_rows_max_experts() { return static_cast<int64_t>(max_shared_per_block()) * 8; }

void copy_experts(const CopyParams& p, cudaStream_t stream) {
  check_layout(p.layout);
  MOE_CHECK(p.num_blocks >= 1, "num_blocks = ", p.num_blocks, " must be positive");
  MOE_CHECK(p.copies.experts && p.copies.slots && p.copies.count, "the copy list must be given");
  if (p.max_copies == 0) return;
  copy_experts_kernel<<<p.num_blocks, kCopyThreads, 0, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moeinfer::offload::cuda
