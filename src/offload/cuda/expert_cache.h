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

// The admission kernel keeps a byte per expert of the layer in shared memory.
inline constexpr int64_t kAdmitMaxExperts = 8192;

struct ExpertSlotsLayout {
  bf16** gate_up_table = nullptr;         // [L*E]
  bf16** down_table = nullptr;            // [L*E]
  bf16* const* home_gate_up = nullptr;    // [L] (null for a dense layer)
  bf16* const* home_down = nullptr;       // [L]
  bf16* slots = nullptr;                  // [S, slot_elems]
  int64_t gate_up_elems = 0;              // 2 Ip Hp
  int64_t down_elems = 0;                 // Hp Ip
  int64_t num_experts = 0;                // E
};

struct CopyList {
  int32_t* experts = nullptr;  // [E] global expert ids
  int32_t* slots = nullptr;    // [E]
  int32_t* count = nullptr;    // [1]
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
  CopyList copies;
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

// Copies every listed expert's weights from its home in host memory into its slot, read over
// PCIe by the SMs in 16-byte vectors (a copy engine would need the list on the host).
void copy_experts(const CopyParams& params, cudaStream_t stream);

}  // namespace moeinfer::offload::cuda
