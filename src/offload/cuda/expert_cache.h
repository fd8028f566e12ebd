// The GPU expert cache's two kernels: admission (which of a layer's experts are resident, which
// slot each missing one takes: offload/cache_policy.h, the same code the host runs) and the copy
// of the admitted experts from pinned host memory into their slots.
//
// Everything an admission reads and writes lives in device memory (the tables, the tick clock,
// the slot table the grouped GEMM reads, the copy list), so neither kernel synchronises with the
// host and both sit in a CUDA graph: a decode graph replays admissions and copies whose outcome
// changes from step to step, and the experts stage reads each expert through the slot table.
//
// Layouts (glossary letters: T tokens, K experts per token, E experts, L layers, S slots; an
// expert's weights are gate_up [2 Ip, Hp] then down [Hp, Ip], bf16):
//   topk_ids         [T*K]      the layer's (or a prediction's) routing; ids outside [0, E)
//                               are padding and want no expert
//   gate_up_table    [L*E]      device pointer of each expert's gate_up: its slot's, or its home
//   down_table       [L*E]      the same for down
//   home_gate_up     [L]        the layer's [E, 2 Ip, Hp] in pinned, mapped host memory
//   home_down        [L]        the layer's [E, Hp, Ip]
//   slots            [S, 3 Ip Hp]  bf16 device memory, slot s = gate_up then down
//   copy list        [E] experts, [E] slots, [1] count: written by the admission, read by the copy
//   host staging     pinned, mapped host memory the admission writes for the host's compute of
//                    the misses it sends there (--cold-experts cpu|auto): [E] experts, [2]
//                    counts, the layer's [T*K] ids and [T, Hp] rows; the host writes [T*K, Hp]
//                    results back, which merge_host_rows puts in the experts' output
//
// The hand-off with the host (HostStaging's sequence, request and done). Every demand admission
// numbers itself (sequence[0] += 1, in device memory) and records how many misses it sent to
// the host (sequence[1]). When that is not 0, after a system-scope fence of everything it
// staged, it publishes request = (layer, sequence) in mapped memory, the sequence written last
// behind a second fence. A host thread (model/cuda/cached_experts.cpp) polls request[1], computes,
// writes its results, then stores done = sequence with release order. merge_host_rows launches
// a one-thread wait kernel, then the merge, both of which return at once when sequence[1] is 0
// (no host read at all); otherwise the wait kernel spins on done == sequence[0] (volatile loads
// with __nanosleep backoff, then a system fence as acquire) and the merge, after it in stream
// order, reads the results. The state advances on the device, so a CUDA graph of these kernels
// replays correctly, and a layer with nothing on the host never waits on it.
// The next demand rewrites the staging only after the merge of the last one (stream order),
// which waited for the host to finish reading it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "offload/cache_policy.h"

namespace moeinfer::offload::cuda {

using bf16 = __nv_bfloat16;

// The clock: [0] the last tick handed out, [1] the tick of the last demand (the layer that may
// be computing while a prefetch runs).
inline constexpr int64_t kClockWords = 2;

// The admission kernel keeps two int32 lists of E (the misses, the rows per expert) in shared
// memory up to this many experts; past it they live in AdmitParams::lists, device memory.
inline constexpr int64_t kAdmitMaxSharedExperts = 8192;

// int32 elements of AdmitParams::lists for E experts: 0 when shared memory holds them.
inline int64_t admit_lists_size(int64_t num_experts) {
  return num_experts > kAdmitMaxSharedExperts ? 2 * num_experts : 0;
}

struct ExpertSlotsLayout {
  bf16** gate_up_table = nullptr;         // [L*E]
  bf16** down_table = nullptr;            // [L*E]
  bf16* const* home_gate_up = nullptr;    // [L] (null for a dense layer)
  bf16* const* home_down = nullptr;       // [L]
  bf16* slots = nullptr;                  // [S, slot_elems]
  int64_t gate_up_elems = 0;              // 2 Ip Hp
  int64_t down_elems = 0;                 // Hp Ip
  int64_t num_experts = 0;                // E
  // Cold experts compute on the host: a table entry is null while its expert has no slot (an
  // eviction writes null instead of the home), and the grouped GEMM skips null experts.
  bool null_without_slot = false;
};

struct CopyList {
  int32_t* experts = nullptr;  // [E] global expert ids
  int32_t* slots = nullptr;    // [E]
  int32_t* count = nullptr;    // [1]
};

// Device addresses of pinned, mapped host memory (but `sequence`, device memory), shared by the
// admission (which writes all but `out` and `done`), the host's worker (the GPU cache's
// compute_on_host) and merge_host_rows. The hand-off protocol: the file's header.
struct HostStaging {
  int32_t* experts = nullptr;    // [E] global ids of the misses computed on the host
  int32_t* count = nullptr;      // [2] their number, and the assignments staged (T*K)
  int32_t* topk_ids = nullptr;   // [max T*K] the layer's routing
  bf16* rows = nullptr;          // [max T, Hp] the layer's input rows
  bf16* out = nullptr;           // [max T*K, Hp] each host assignment's result
  int64_t row_elems = 0;         // Hp
  // [2] device memory, zero at start: [0] the demands admitted so far, [1] the last one's
  // number of misses on the host (0: its merge waits for nothing).
  int64_t* sequence = nullptr;
  // [2] mapped, zero at start: [0] the layer, [1] the sequence of the last demand that sent
  // misses to the host. Written by the admission only, [1] last.
  int64_t* request = nullptr;
  // [1] mapped, zero at start: the sequence of the last request the host finished. Written by
  // the host only.
  int64_t* done = nullptr;
};

struct AdmitParams {
  CacheTables tables;          // device arrays; num_slots and policy by value
  ExpertSlotsLayout layout;
  int64_t* clock = nullptr;    // [kClockWords]
  int64_t* counters = nullptr; // [L, kNumCacheCounters]
  const int32_t* topk_ids = nullptr;  // [num_assignments]
  int64_t num_assignments = 0;        // T*K
  int64_t layer = 0;
  bool prefetch = false;
  // A prefetch under --expert-prefetch auto: admits nothing (no copy, no touch, no tick) when
  // the layer's counters say its prefetches do not pay (cache_policy.h's prefetch_pays, with
  // the last demand's tick), as the host decides.
  bool prefetch_while_it_pays = false;
  CopyList copies;
  // A demand under --cold-experts cpu|auto: misses the cost model sends to the host (and those
  // without an evictable slot) are listed in `host`, with the ids and `rows` staged there.
  ColdCost cold;
  HostStaging host;
  const bf16* rows = nullptr;  // [T, Hp] device, the layer's input
  int64_t num_rows = 0;        // T
  // [admit_lists_size(E)] device scratch past kAdmitMaxSharedExperts (unused below it).
  // Admissions that may run at once (a demand and a prefetch on two streams) need one each.
  int32_t* lists = nullptr;
};

// One block: marks the experts the ids want, then admit()s them exactly as the host function
// does (the victims found by a block-wide reduction over the slots, same keys, same ties), and
// points the slot table at every placed expert's slot and every evicted expert's home.
void admit_experts(const AdmitParams& params, cudaStream_t stream);

struct CopyParams {
  ExpertSlotsLayout layout;
  CopyList copies;          // what admit_experts listed
  int64_t max_copies = 0;   // the list's capacity (E)
  int num_blocks = 0;       // of the copy grid: fewer leaves SMs to the compute it overlaps
};

// After the host's compute of the staged misses: expert_out[inverse[a]] = host.out[a] for every
// assignment a whose expert the host computed. Two kernels on `stream`: a one-thread wait for
// the host's done (the header), then the merge; both return at once when the last demand sent
// nothing to the host.
struct MergeHostParams {
  HostStaging host;
  const int32_t* topk_ids = nullptr;  // [T*K] device, the layer's
  const int32_t* inverse = nullptr;   // [T*K] the plan's
  bf16* expert_out = nullptr;         // [T*K, Hp]
  int64_t num_assignments = 0;        // T*K
  int64_t layer = 0;
  int64_t num_experts = 0;            // E
};
void merge_host_rows(const MergeHostParams& params, cudaStream_t stream);

// The most experts merge_host_rows takes on this device: it keeps a bit per expert in shared
// memory (1.8 million on an H100).
int64_t merge_host_rows_max_experts();

// Copies every listed expert's weights from its home in host memory into its slot, read over
// PCIe by the SMs in 16-byte vectors (a copy engine would need the list on the host).
void copy_experts(const CopyParams& params, cudaStream_t stream);

}  // namespace moeinfer::offload::cuda
