// Kernels of the small-batch MoE layer (small_batch_moe.h says what they compute and why).
//
// Kernel 1, route_plan: warp w of the grid dots router row w (row E: the shared expert's gate)
// with the T normed rows. The block that arrives last at the ticket routes the T tokens (a warp
// per token, router_kernel.cuh's functions reading the logits through L2), then plans in one
// block: the experts' row counts (padding tokens count at expert E, as moe_plan's), a slot per
// used expert (their order is the order the threads found them in, which only changes where a
// row is stored, never a value), the rows of each slot (token, pick, weight), the shared slot
// with every real token, and the work queue of kernel 2. It zeroes kernel 2's counters and the
// output rows of padding tokens.
//
// Kernel 2, experts: a persistent grid of 8-warp blocks; thread 0 claims work items in queue
// order with one atomic each, issued one item ahead so its latency hides behind the current
// item. Items are [0, gu_items): (slot, 8 columns of the expert's width), a column per warp;
// then (slot, 32 output columns), 4 per warp. Both kinds stream their weight rows 1024
// elements (4 vectors per lane) at a time and take the slot's rows 8 at a time against them,
// so an expert's weights are read from HBM once whatever its row count (T <= 64 rows per slot).
// Quantised routed experts (small_batch_moe.h): the same items, but a lane's weights are
// kSmallMoeQuantVecsPerLane 16-byte vectors of codes per row (16 inputs each for fp8, 32 for
// int4 and MXFP4), each with the scale of its first input's group, loaded together before any
// product; each 8 inputs are then dequantised to bf16 once (expert_dequant.cuh) and taken against
// the pass's rows. A chunk that starts a new group within a vector (groups smaller than a vector)
// reads its own scale then. The shared expert's slot reads bf16 as before.
// Deadlock freedom: a down item waits only for gate/up items, which precede every down item in
// the queue, and a block claims items in increasing order, so every item a down item waits for
// is held by a block that is running an earlier item or is itself running.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/expert_dequant.cuh"
#include "backend/cuda/expert_quant.h"
#include "backend/cuda/router_kernel.cuh"
#include "backend/cuda/small_batch_moe.h"

namespace moeinfer::cuda {

inline constexpr int kSmallMoeWarps = 8;
inline constexpr int kSmallMoeThreads = kSmallMoeWarps * device::kWarpSize;
inline constexpr int kSmallMoeGateUpColumns = kSmallMoeWarps;  // a gate/up item: one per warp
inline constexpr int kSmallMoeDownColumns = 32;                // a down item: 4 per warp
inline constexpr int kSmallMoeDownPerWarp = kSmallMoeDownColumns / kSmallMoeWarps;
inline constexpr int kSmallMoeRowsPerPass = 8;  // rows taken against the weights in registers
inline constexpr int kSmallMoeVecsPerLane = 4;  // a segment: 32 lanes x 4 vectors x 8 elements
inline constexpr int kSmallMoeSegment = device::kWarpSize * kSmallMoeVecsPerLane * 8;
// Quantised: 16-byte code vectors per lane and weight row, loaded before the products: 64
// bytes per lane in flight either way (gate/up: 2 rows x 2, down: 4 rows x 1), which keeps a
// down item's codes and scales in registers (with 2 the int4 kernel spilled).
template <int kWeightRows>
inline constexpr int kSmallMoeQuantVecsPerLane = kWeightRows <= 2 ? 2 : 1;

// Inputs of one 16-byte vector of codes: 16 e4m3 codes, or 32 four-bit codes.
template <ExpertQuant Q>
inline constexpr int kSmallMoeQuantInputsPerVec = Q == ExpertQuant::kFp8 ? 16 : 32;

// Indices of the int32 counters at the start of the workspace.
enum SmallMoeCounter : int {
  kTicket,       // blocks of route_plan that have finished their logits
  kQueue,        // the next work item of the experts kernel
  kRoutedSlots,  // slots of routed experts; the shared slot, if any, follows them
  kSlots,        // all slots
  kGateUpItems,  // items [0, gate_up) are gate/up, [gate_up, all) down
  kAllItems,
  kNumCounters = 8,  // 32 bytes
};

// The workspace carved for T tokens (small_batch_moe.cu, carve_small_moe).
struct SmallMoeWorkspace {
  int32_t* counters = nullptr;        // [kNumCounters]
  int32_t* slot_expert = nullptr;     // [S] expert id; E: the shared slot
  int32_t* slot_row_begin = nullptr;  // [S]
  int32_t* slot_rows = nullptr;       // [S]
  int32_t* gate_up_done = nullptr;    // [S] gate/up items finished
  int32_t* row_token = nullptr;       // [R]
  int32_t* row_pick = nullptr;        // [R] k, or K for the shared expert
  float* row_weight = nullptr;        // [R]
  int32_t* arrivals = nullptr;        // [T, Hp / 32] expert outputs written per column tile
  float* gate_logits = nullptr;       // [T] shared expert gate
  float* act = nullptr;               // [R, act_stride] SiLU(gate) * up, float32
  float* contrib = nullptr;           // [T, K + 1, Hp] weighted expert outputs; K: shared
};

struct SmallMoeKernelParams {
  SmallMoeParams p;
  SmallMoeWorkspace ws;
  int num_tokens = 0;    // T
  int num_experts = 0;   // E
  int top_k = 0;         // K
  int hidden = 0;        // Hp
  int width = 0;         // Ip
  int shared_width = 0;  // Is, 0 without a shared expert
  int act_stride = 0;    // max(Ip, Is)
  int column_tiles = 0;  // Hp / 32
  int router_rows = 0;   // E, + 1 with a shared gate
  // Quantised routed experts: the slab layouts of an expert's gate_up [2 Ip, Hp] and down
  // [Hp, Ip] (their `bytes` the stride between experts), and the inputs per scale.
  QuantMatrixLayout gate_up_layout;
  QuantMatrixLayout down_layout;
  int quant_group = 0;
};

namespace small_moe {

__device__ __forceinline__ float dot8(const uint4& w, const float (&x)[8]) {
  float a[8];
  device::bf16x8_to_float(w, a);
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s = fmaf(a[i], x[i], s);
  return s;
}

__device__ __forceinline__ int valid_tokens(const SmallMoeKernelParams& k) {
  const int32_t* n = k.p.route.num_valid_tokens;
  if (n == nullptr) return k.num_tokens;
  return min(max(__ldg(n), 0), k.num_tokens);
}

// logits[t, row] = router[row] . hidden[t] for the real tokens (row E: the shared gate).
__device__ inline void router_logits(const SmallMoeKernelParams& k, int row, int lane,
                                     int num_valid) {
  const bool gate = row == k.num_experts;
  const uint4* w = reinterpret_cast<const uint4*>(
      gate ? k.p.shared_gate : k.p.router + static_cast<int64_t>(row) * k.hidden);
  const int vecs = k.hidden / 8;
  for (int t = 0; t < num_valid; ++t) {
    const uint4* x =
        reinterpret_cast<const uint4*>(k.p.hidden + static_cast<int64_t>(t) * k.hidden);
    float partial = 0.0f;
    for (int v = lane; v < vecs; v += device::kWarpSize)
      partial += device::bf16x8_dot(__ldg(w + v), __ldg(x + v));
    const float logit = device::warp_sum(partial);
    if (lane == 0) {
      if (gate) {
        k.ws.gate_logits[t] = logit;
      } else {
        const_cast<float*>(k.p.route.logits)[static_cast<int64_t>(t) * k.num_experts + row] = logit;
      }
    }
  }
}

// The plan of the routed picks and the shared expert (see the file comment), by one block.
__device__ inline void plan(const SmallMoeKernelParams& k, int num_valid) {
  const int E = k.num_experts, K = k.top_k, T = k.num_tokens;
  const int assignments = T * K;
  const bool shared = k.shared_width > 0 && num_valid > 0;
  __shared__ int32_t count[kRouterWarpMaxExperts + 1];  // rows per expert, then a row cursor
  __shared__ int32_t slot_of[kRouterWarpMaxExperts];
  __shared__ int32_t slot_begin[kSmallMoeMaxRows + 1];
  __shared__ int32_t routed_slots, rows_placed;
  const int tid = threadIdx.x;
  for (int e = tid; e <= E; e += blockDim.x) count[e] = 0;
  if (tid == 0) routed_slots = rows_placed = 0;
  __syncthreads();
  for (int a = tid; a < assignments; a += blockDim.x) atomicAdd(&count[k.p.route.topk_ids[a]], 1);
  __syncthreads();
  if (k.p.expert_counts != nullptr) {
    for (int e = tid; e <= E; e += blockDim.x) k.p.expert_counts[e] = count[e];
  }
  for (int e = tid; e < E; e += blockDim.x) {
    const int rows = count[e];
    if (rows == 0) continue;
    const int s = atomicAdd(&routed_slots, 1);
    const int begin = atomicAdd(&rows_placed, rows);
    slot_of[e] = s;
    slot_begin[s] = begin;
    k.ws.slot_expert[s] = e;
    k.ws.slot_row_begin[s] = begin;
    k.ws.slot_rows[s] = rows;
    count[e] = 0;  // from here: the expert's row cursor
  }
  __syncthreads();
  const int num_routed = routed_slots;
  const int shared_begin = rows_placed;
  for (int a = tid; a < assignments; a += blockDim.x) {
    const int e = k.p.route.topk_ids[a];
    if (e >= E) continue;  // a padding token's null expert
    const int r = slot_begin[slot_of[e]] + atomicAdd(&count[e], 1);
    k.ws.row_token[r] = a / K;
    k.ws.row_pick[r] = a % K;
    k.ws.row_weight[r] = k.p.route.topk_weights[a];
  }
  if (shared) {
    for (int t = tid; t < num_valid; t += blockDim.x) {
      const int r = shared_begin + t;
      k.ws.row_token[r] = t;
      k.ws.row_pick[r] = K;
      k.ws.row_weight[r] =
          k.p.shared_gate != nullptr ? 1.0f / (1.0f + expf(-__ldcg(k.ws.gate_logits + t))) : 1.0f;
    }
  }
  const int slots = num_routed + (shared ? 1 : 0);
  if (tid == 0) {
    if (shared) {
      k.ws.slot_expert[num_routed] = E;
      k.ws.slot_row_begin[num_routed] = shared_begin;
      k.ws.slot_rows[num_routed] = num_valid;
    }
    const int gate_up_items = num_routed * (k.width / kSmallMoeGateUpColumns) +
                              (shared ? k.shared_width / kSmallMoeGateUpColumns : 0);
    k.ws.counters[kQueue] = 0;
    k.ws.counters[kRoutedSlots] = num_routed;
    k.ws.counters[kSlots] = slots;
    k.ws.counters[kGateUpItems] = gate_up_items;
    k.ws.counters[kAllItems] = gate_up_items + slots * k.column_tiles;
  }
  for (int s = tid; s < slots; s += blockDim.x) k.ws.gate_up_done[s] = 0;
  for (int i = tid; i < T * k.column_tiles; i += blockDim.x) k.ws.arrivals[i] = 0;
  // Padding tokens get no expert output: their rows of the block output are zero.
  const int pad_vecs = (T - num_valid) * k.hidden / 4;
  float4* pad = reinterpret_cast<float4*>(k.p.out + static_cast<int64_t>(num_valid) * k.hidden);
  for (int i = tid; i < pad_vecs; i += blockDim.x) pad[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// Streams `rows_per_warp` weight rows of length n (row stride `stride`, bf16) against the
// inputs of up to kSmallMoeRowsPerPass rows and returns, in lane 0's acc, the dot products:
// acc[r][j] = W[j] . x_r. Input rows are bf16 (load_input reads vector v of row r as 8 floats).
template <int kWeightRows, typename LoadInput>
__device__ __forceinline__ void stream_rows(const bf16* const (&w)[kWeightRows], int n, int rows,
                                            int lane, LoadInput load_input,
                                            float (&acc)[kSmallMoeRowsPerPass][kWeightRows]) {
#pragma unroll
  for (int r = 0; r < kSmallMoeRowsPerPass; ++r) {
#pragma unroll
    for (int j = 0; j < kWeightRows; ++j) acc[r][j] = 0.0f;
  }
  const int vecs = n / 8;
  for (int base = 0; base < vecs; base += kSmallMoeSegment / 8) {
    uint4 wv[kWeightRows][kSmallMoeVecsPerLane];
#pragma unroll
    for (int j = 0; j < kWeightRows; ++j) {
#pragma unroll
      for (int i = 0; i < kSmallMoeVecsPerLane; ++i) {
        const int v = base + i * device::kWarpSize + lane;
        wv[j][i] =
            v < vecs ? __ldg(reinterpret_cast<const uint4*>(w[j]) + v) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int r = 0; r < kSmallMoeRowsPerPass; ++r) {
      if (r >= rows) break;
#pragma unroll
      for (int i = 0; i < kSmallMoeVecsPerLane; ++i) {
        const int v = base + i * device::kWarpSize + lane;
        if (v >= vecs) break;
        float x[8];
        load_input(r, v, x);
#pragma unroll
        for (int j = 0; j < kWeightRows; ++j) acc[r][j] += dot8(wv[j][i], x);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kSmallMoeRowsPerPass; ++r) {
    if (r >= rows) break;
#pragma unroll
    for (int j = 0; j < kWeightRows; ++j) acc[r][j] = device::warp_sum(acc[r][j]);
  }
}

using expert_dequant::QuantChunk;

// The scales (and int4 zero points) of one expert's quantised slab (expert_quant.h).
struct QuantScales {
  const uint8_t* scales;  // float32, or E8M0 bytes for MXFP4
  const uint8_t* zeros;   // int4: float32
};

// One weight row of the slab: its codes and the index of its first group. Kept this small
// because a down item holds four of them beside its codes.
struct QuantRow {
  const uint8_t* codes;
  int first_group;
};

__device__ __forceinline__ QuantScales quant_scales(const uint8_t* slab,
                                                    const QuantMatrixLayout& layout) {
  return {slab + layout.scale_offset, slab + layout.zero_offset};
}

__device__ __forceinline__ QuantRow quant_row(const uint8_t* slab, const QuantMatrixLayout& layout,
                                              int row) {
  return {slab + static_cast<int64_t>(row) * layout.row_code_bytes,
          row * static_cast<int>(layout.groups_per_row)};
}

// Group g of row w: its scale (and zero point, or MXFP4 exponent in codes.y) into c, where
// expert_dequant::fetch_quant_chunk puts them.
template <ExpertQuant Q>
__device__ __forceinline__ void load_group(const QuantScales& slab, const QuantRow& w, int g,
                                           QuantChunk& c) {
  const int index = w.first_group + g;
  if constexpr (Q == ExpertQuant::kMxfp4) {
    c.codes.y = __ldg(slab.scales + index);
  } else {
    c.scale = __ldg(reinterpret_cast<const float*>(slab.scales) + index);
    if constexpr (Q == ExpertQuant::kInt4) {
      c.zero = __ldg(reinterpret_cast<const float*>(slab.zeros) + index);
    }
  }
}

// The codes of chunk `chunk` (inputs 8 chunk .. 8 chunk + 7) of a 16-byte vector into c, as
// fetch_quant_chunk loads them: fp8 8 bytes, int4 and MXFP4 4 bytes (input 2j in the low nibble
// of byte j). chunk is a constant after unrolling, so the vector stays in registers.
template <ExpertQuant Q>
__device__ __forceinline__ void set_chunk_codes(const uint4& v, int chunk, QuantChunk& c) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
  if constexpr (Q == ExpertQuant::kFp8) {
    c.codes.x = words[2 * chunk];
    c.codes.y = words[2 * chunk + 1];
  } else {
    c.codes.x = words[chunk];
  }
}

// stream_rows over quantised weight rows of n inputs (n a multiple of a vector's inputs):
// acc[r][j] = W[j] . x_r in lane 0, each weight the bf16 value of dequantize_chunk.
template <ExpertQuant Q, int kWeightRows, typename LoadInput>
__device__ __forceinline__ void stream_quant_rows(const QuantScales& slab,
                                                  const QuantRow (&w)[kWeightRows], int n,
                                                  int group, int rows, int lane,
                                                  LoadInput load_input,
                                                  float (&acc)[kSmallMoeRowsPerPass][kWeightRows]) {
  constexpr int kInputs = kSmallMoeQuantInputsPerVec<Q>;
  constexpr int kChunks = kInputs / 8;
  constexpr int kVecs = kSmallMoeQuantVecsPerLane<kWeightRows>;
#pragma unroll
  for (int r = 0; r < kSmallMoeRowsPerPass; ++r) {
#pragma unroll
    for (int j = 0; j < kWeightRows; ++j) acc[r][j] = 0.0f;
  }
  const int vecs = n / kInputs;
  // Every vector within one group (a group a multiple of its inputs: --weights' 128, MXFP4's
  // 32): the scale loaded with the codes serves all its chunks.
  const bool one_group = group % kInputs == 0;
  for (int base = 0; base < vecs; base += device::kWarpSize * kVecs) {
    uint4 codes[kWeightRows][kVecs];
    QuantChunk head[kWeightRows][kVecs];  // the scale of each vector's first input
#pragma unroll
    for (int j = 0; j < kWeightRows; ++j) {
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        const int v = base + i * device::kWarpSize + lane;
        head[j][i] = QuantChunk{};
        codes[j][i] = make_uint4(0, 0, 0, 0);
        if (v < vecs) {
          codes[j][i] = __ldg(reinterpret_cast<const uint4*>(w[j].codes) + v);
          load_group<Q>(slab, w[j], v * kInputs / group, head[j][i]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int v = base + i * device::kWarpSize + lane;
      if (v >= vecs) break;
      QuantChunk current[kWeightRows];
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int k = v * kInputs + c * 8;
        uint4 values[kWeightRows];
#pragma unroll
        for (int j = 0; j < kWeightRows; ++j) {
          if (c == 0) {
            current[j] = head[j][i];
          } else if (!one_group && k % group == 0) {
            load_group<Q>(slab, w[j], k / group, current[j]);
          }
          set_chunk_codes<Q>(codes[j][i], c, current[j]);
          values[j] = expert_dequant::dequantize_chunk<Q>(current[j]);
        }
#pragma unroll
        for (int r = 0; r < kSmallMoeRowsPerPass; ++r) {
          if (r >= rows) break;
          float x[8];
          load_input(r, k / 8, x);
#pragma unroll
          for (int j = 0; j < kWeightRows; ++j) acc[r][j] += dot8(values[j], x);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kSmallMoeRowsPerPass; ++r) {
    if (r >= rows) break;
#pragma unroll
    for (int j = 0; j < kWeightRows; ++j) acc[r][j] = device::warp_sum(acc[r][j]);
  }
}

struct SlotRows {
  int expert;  // E: the shared expert
  int begin;
  int rows;
};

__device__ inline SlotRows load_slot(const SmallMoeKernelParams& k, int slot) {
  return {__ldcg(k.ws.slot_expert + slot), __ldcg(k.ws.slot_row_begin + slot),
          __ldcg(k.ws.slot_rows + slot)};
}

// act[row, c] = SiLU(gate_c . x) * (up_c . x) for the slot's rows, c = the warp's column.
template <ExpertQuant Q>
__device__ inline void gate_up_item(const SmallMoeKernelParams& k, int item, int num_routed,
                                    int32_t (&tokens)[kSmallMoeMaxTokens]) {
  const int lane = threadIdx.x % device::kWarpSize, warp = threadIdx.x / device::kWarpSize;
  const int routed_items = num_routed * (k.width / kSmallMoeGateUpColumns);
  int slot, column, width;
  if (item < routed_items) {
    slot = item / (k.width / kSmallMoeGateUpColumns);
    column = (item % (k.width / kSmallMoeGateUpColumns)) * kSmallMoeGateUpColumns + warp;
    width = k.width;
  } else {
    slot = num_routed;
    column = (item - routed_items) * kSmallMoeGateUpColumns + warp;
    width = k.shared_width;
  }
  const SlotRows s = load_slot(k, slot);
  const bool routed = s.expert < k.num_experts;
  // bf16 (the shared expert, or every expert without quantisation): rows of the [2 width, Hp]
  // matrix; quantised: rows of the expert's slab.
  const bf16* gate_up = routed ? k.p.gate_up + static_cast<int64_t>(s.expert) * 2 * width * k.hidden
                               : k.p.shared_gate_up;
  const bf16* const w[2] = {gate_up + static_cast<int64_t>(column) * k.hidden,
                            gate_up + static_cast<int64_t>(width + column) * k.hidden};
  QuantScales q_scales = {};
  QuantRow qw[2] = {};
  if constexpr (Q != ExpertQuant::kNone) {
    if (routed) {
      const uint8_t* slab = reinterpret_cast<const uint8_t*>(k.p.gate_up) +
                            static_cast<int64_t>(s.expert) * k.gate_up_layout.bytes;
      q_scales = quant_scales(slab, k.gate_up_layout);
      qw[0] = quant_row(slab, k.gate_up_layout, column);
      qw[1] = quant_row(slab, k.gate_up_layout, width + column);
    }
  }
  for (int r = threadIdx.x; r < s.rows; r += blockDim.x)
    tokens[r] = __ldcg(k.ws.row_token + s.begin + r);
  __syncthreads();
  for (int first = 0; first < s.rows; first += kSmallMoeRowsPerPass) {
    const int rows = min(kSmallMoeRowsPerPass, s.rows - first);
    float acc[kSmallMoeRowsPerPass][2];
    const auto load_hidden = [&](int r, int v, float(&x)[8]) {
      const uint4* row = reinterpret_cast<const uint4*>(
          k.p.hidden + static_cast<int64_t>(tokens[first + r]) * k.hidden);
      device::bf16x8_to_float(__ldg(row + v), x);
    };
    if constexpr (Q != ExpertQuant::kNone) {
      if (routed) {
        stream_quant_rows<Q, 2>(q_scales, qw, k.hidden, k.quant_group, rows, lane, load_hidden,
                                acc);
      } else {
        stream_rows<2>(w, k.hidden, rows, lane, load_hidden, acc);
      }
    } else {
      stream_rows<2>(w, k.hidden, rows, lane, load_hidden, acc);
    }
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kSmallMoeRowsPerPass; ++r) {
        if (r >= rows) break;
        const float g = acc[r][0], u = acc[r][1];
        k.ws.act[static_cast<int64_t>(s.begin + first + r) * k.act_stride + column] =
            g / (1.0f + expf(-g)) * u;
      }
    }
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(k.ws.gate_up_done + slot, 1);
}

// contrib[t, pick, c] = weight * (down_c . act_row) for the slot's rows and the item's 32
// columns; the arrival that completes a token's column tile writes the tile's sum to out.
template <ExpertQuant Q>
__device__ inline void down_item(const SmallMoeKernelParams& k, int item, int num_routed,
                                 int32_t (&tokens)[kSmallMoeMaxTokens],
                                 int32_t (&picks)[kSmallMoeMaxTokens],
                                 float (&weights)[kSmallMoeMaxTokens],
                                 int32_t (&complete)[kSmallMoeMaxTokens], int& num_complete) {
  const int lane = threadIdx.x % device::kWarpSize, warp = threadIdx.x / device::kWarpSize;
  const int slot = item / k.column_tiles, tile = item % k.column_tiles;
  const SlotRows s = load_slot(k, slot);
  const bool shared = s.expert == k.num_experts;
  const int width = shared ? k.shared_width : k.width;
  const bf16* down =
      shared ? k.p.shared_down : k.p.down + static_cast<int64_t>(s.expert) * k.hidden * width;
  const int first_column = tile * kSmallMoeDownColumns + warp * kSmallMoeDownPerWarp;
  bf16 const* w[kSmallMoeDownPerWarp];
#pragma unroll
  for (int j = 0; j < kSmallMoeDownPerWarp; ++j) {
    w[j] = down + static_cast<int64_t>(first_column + j) * width;
  }
  QuantScales q_scales = {};
  QuantRow qw[kSmallMoeDownPerWarp] = {};
  if constexpr (Q != ExpertQuant::kNone) {
    if (!shared) {
      const uint8_t* slab = reinterpret_cast<const uint8_t*>(k.p.down) +
                            static_cast<int64_t>(s.expert) * k.down_layout.bytes;
      q_scales = quant_scales(slab, k.down_layout);
#pragma unroll
      for (int j = 0; j < kSmallMoeDownPerWarp; ++j) {
        qw[j] = quant_row(slab, k.down_layout, first_column + j);
      }
    }
  }
  for (int r = threadIdx.x; r < s.rows; r += blockDim.x) {
    tokens[r] = __ldcg(k.ws.row_token + s.begin + r);
    picks[r] = __ldcg(k.ws.row_pick + s.begin + r);
    weights[r] = __ldcg(k.ws.row_weight + s.begin + r);
  }
  if (threadIdx.x == 0) {
    num_complete = 0;
    const int needed = width / kSmallMoeGateUpColumns;
    while (atomicAdd(k.ws.gate_up_done + slot, 0) < needed) __nanosleep(64);
    __threadfence();
  }
  __syncthreads();
  const int stride = k.top_k + 1;
  for (int first = 0; first < s.rows; first += kSmallMoeRowsPerPass) {
    const int rows = min(kSmallMoeRowsPerPass, s.rows - first);
    float acc[kSmallMoeRowsPerPass][kSmallMoeDownPerWarp];
    const auto load_act = [&](int r, int v, float(&x)[8]) {
      const float* row = k.ws.act + static_cast<int64_t>(s.begin + first + r) * k.act_stride;
      const float4* p = reinterpret_cast<const float4*>(row) + 2 * v;
      const float4 a = __ldcg(p), b = __ldcg(p + 1);
      x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
      x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
    };
    if constexpr (Q != ExpertQuant::kNone) {
      if (!shared) {
        stream_quant_rows<Q, kSmallMoeDownPerWarp>(q_scales, qw, width, k.quant_group, rows, lane,
                                                   load_act, acc);
      } else {
        stream_rows<kSmallMoeDownPerWarp>(w, width, rows, lane, load_act, acc);
      }
    } else {
      stream_rows<kSmallMoeDownPerWarp>(w, width, rows, lane, load_act, acc);
    }
    if (lane < kSmallMoeDownPerWarp) {
#pragma unroll
      for (int r = 0; r < kSmallMoeRowsPerPass; ++r) {
        if (r >= rows) break;
        float y = acc[r][0];
#pragma unroll
        for (int j = 1; j < kSmallMoeDownPerWarp; ++j) y = lane == j ? acc[r][j] : y;
        const int64_t at =
            (static_cast<int64_t>(tokens[first + r]) * stride + picks[first + r]) * k.hidden;
        k.ws.contrib[at + first_column + lane] = weights[first + r] * y;
      }
    }
  }
  __threadfence();
  __syncthreads();
  const int expected = k.top_k + (k.shared_width > 0 ? 1 : 0);
  for (int r = threadIdx.x; r < s.rows; r += blockDim.x) {
    const int t = tokens[r];
    if (atomicAdd(k.ws.arrivals + t * k.column_tiles + tile, 1) == expected - 1) {
      complete[atomicAdd(&num_complete, 1)] = t;
    }
  }
  __syncthreads();
  if (num_complete == 0) return;
  __threadfence();
  const int column = tile * kSmallMoeDownColumns + lane;
  for (int i = warp; i < num_complete; i += kSmallMoeWarps) {
    const int64_t base = static_cast<int64_t>(complete[i]) * stride * k.hidden + column;
    // shared + pick 0 + ... + pick K-1, unpermute's order.
    float sum = k.shared_width > 0 ? __ldcg(k.ws.contrib + base + k.top_k * k.hidden) : 0.0f;
    for (int pick = 0; pick < k.top_k; ++pick) sum += __ldcg(k.ws.contrib + base + pick * k.hidden);
    k.p.out[static_cast<int64_t>(complete[i]) * k.hidden + column] = sum;
  }
}

}  // namespace small_moe

template <int kPerLane, bool kGeneral>
__global__ void __launch_bounds__(kSmallMoeThreads)
    small_moe_route_plan_kernel(const __grid_constant__ SmallMoeKernelParams k) {
  extern __shared__ __align__(16) unsigned char route_scratch[];  // kGeneral: a warp's scratch
  __shared__ bool last_block;
  const int lane = threadIdx.x % device::kWarpSize, warp = threadIdx.x / device::kWarpSize;
  const int num_valid = small_moe::valid_tokens(k);
  const int row = blockIdx.x * kSmallMoeWarps + warp;
  if (row < k.router_rows) small_moe::router_logits(k, row, lane, num_valid);

  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last_block = atomicAdd(k.ws.counters + kTicket, 1) == static_cast<int>(gridDim.x) - 1;
  }
  __syncthreads();
  if (!last_block) return;
  __threadfence();

  for (int t = warp; t < k.num_tokens; t += kSmallMoeWarps) {
    if constexpr (kGeneral) {
      auto* scratch = reinterpret_cast<RouterWarpScratch<kPerLane>*>(route_scratch);
      route_token_general<kPerLane, true>(k.p.route, t, lane, scratch[warp]);
    } else {
      route_token_plain<kPerLane, true>(k.p.route, t, lane);
    }
  }
  __syncthreads();
  small_moe::plan(k, num_valid);
  if (threadIdx.x == 0) k.ws.counters[kTicket] = 0;
}

template <ExpertQuant Q>
__global__ void __launch_bounds__(kSmallMoeThreads, 2)
    small_moe_experts_kernel(const __grid_constant__ SmallMoeKernelParams k) {
  __shared__ int32_t tokens[kSmallMoeMaxTokens], picks[kSmallMoeMaxTokens];
  __shared__ float weights[kSmallMoeMaxTokens];
  __shared__ int32_t complete[kSmallMoeMaxTokens];
  __shared__ int num_complete;
  __shared__ int current;
  const int num_routed = k.ws.counters[kRoutedSlots];
  const int gate_up_items = k.ws.counters[kGateUpItems];
  const int all_items = k.ws.counters[kAllItems];
  int next = 0;
  if (threadIdx.x == 0) current = atomicAdd(k.ws.counters + kQueue, 1);
  __syncthreads();
  for (;;) {
    const int item = current;
    if (item >= all_items) return;
    // One item ahead: the atomic's round trip overlaps this item.
    if (threadIdx.x == 0) next = atomicAdd(k.ws.counters + kQueue, 1);
    if (item < gate_up_items) {
      small_moe::gate_up_item<Q>(k, item, num_routed, tokens);
    } else {
      small_moe::down_item<Q>(k, item - gate_up_items, num_routed, tokens, picks, weights, complete,
                              num_complete);
    }
    __syncthreads();
    if (threadIdx.x == 0) current = next;
    __syncthreads();
  }
}

}  // namespace moeinfer::cuda
