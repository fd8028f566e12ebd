// Host interface of the persistent decode-layers kernel: a run of consecutive transformer layers
// of a one-token decode step (GQA attention over the paged KV cache, then a routed MoE block) in
// one launch, instead of about a dozen launches a layer.
//
// Why: at batch 1 a layer reads about 117 MB of weights (Qwen3-30B-A3B), 39 us at HBM speed, yet
// a step of separate kernels took about 90 us a layer, because each kernel in the chain pays a
// fixed few microseconds (start-up, the first bytes' latency, the tail) whatever its bytes
// (bench/RESULTS.md, 2026-12-07). Here one grid of one block per SM stays resident for the
// whole run and walks the layer's stages, separated by grid-wide barriers:
//   1. every block forms the input RMSNorm of the residual stream in shared memory; the QKV
//      GEMV, its output rows spread over every warp of the grid;
//   2. attention, split over (KV head, run of cached positions): each block normalises and
//      rotates its queries (and the new key, whose value and key the last split writes to the
//      cache), streams its keys and values, and leaves a partial softmax; the last block of a
//      head to finish (a ticket) merges the head's splits;
//   3. the O GEMV, whose warp of each output column also adds it into the residual stream;
//   4. every block forms the post-attention RMSNorm; the router GEMV;
//   5. every block routes (router_kernel.cuh's one-warp top-k, in shared memory); the experts'
//      gate/up GEMV with SiLU, (expert, column) rows spread over the grid;
//   6. the down GEMV: the warp of an output column takes it through each of the token's experts
//      and sums the weighted outputs in pick order (no unpermute).
// Each GEMV warp issues its first weight loads before the barrier that releases its inputs, so
// the weight stream does not drain between stages. Weight loads go through the non-coherent path
// (the weights are never written while the kernel runs); everything the blocks write for each
// other is read through L2 (ld.global.cg), since a block's L1 may hold a line from the previous
// layer of the same buffer.
//
// The rounding points are the stage path's: qkv, the normed and rotated heads, the attention
// output, the gated activation and each expert's output are bf16; the residual stream, the O
// output, the router logits and the MoE sum are float32.
//
// What it covers (decode_layers_supported says which layers): bf16 weights in one term; GQA with
// head dim up to 256, per-head q/k norms in one term or none, RoPE (interleaved or not, partial
// rotary dims, attention scaling) or none, full or sliding-window attention, a bf16 KV cache;
// MoE layers with SiLU-gated experts without biases, softmax / sigmoid / top-k-softmax routers
// without selection bias or groups (the synthetic routing noise included), no shared experts,
// weights on the experts' outputs. The decoder runs every other layer on the stage path.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "backend/cuda/moe_stages.h"
#include "core/host_device.h"

namespace moeinfer::cuda {

// One layer's weights and cache, as the decoder holds them (model/cuda/device_weights.h).
struct DecodeLayerWeights {
  const __nv_bfloat16* input_norm = nullptr;  // [Hp]
  const __nv_bfloat16* post_norm = nullptr;   // [Hp]
  const __nv_bfloat16* qkv = nullptr;         // [(Nq + 2 Nkv) Dp, Hp]
  const __nv_bfloat16* q_norm = nullptr;      // [D] per head, or null (no q/k norm)
  const __nv_bfloat16* k_norm = nullptr;      // [D], null exactly when q_norm is
  const __nv_bfloat16* o_proj = nullptr;      // [Hp, Nq Dp]
  const __nv_bfloat16* router = nullptr;      // [E, Hp]
  const float* logit_bias = nullptr;          // [E] or null (RouterParams::logit_bias)
  const __nv_bfloat16* gate_up = nullptr;     // [E, 2 Ip, Hp]
  const __nv_bfloat16* down = nullptr;        // [E, Hp, Ip]
  __nv_bfloat16* k_cache = nullptr;           // [num_blocks, block_size, Nkv, Dp]
  __nv_bfloat16* v_cache = nullptr;
  int64_t sliding_window = 0;     // PagedDecodeParams::sliding_window; 0: every cached key
  bool rope = true;               // rotate queries and keys (rotary_dim of DecodeLayersParams)
  bool interleaved_rope = false;  // pairs (2i, 2i + 1) instead of (i, i + rotary_dim / 2)
  bool router_noise = false;      // RouterParams::noise_keys taken from the step
  uint64_t noise_seed = 0;
  int32_t* expert_counts = nullptr;  // [E + 1] the plan's counts of this step, or null
};

struct DecodeLayersParams {
  const DecodeLayerWeights* layers = nullptr;  // [num_layers] in device memory
  int64_t num_layers = 0;
  // The residual stream on entry, hidden + block_out (block_out null: hidden alone); on return
  // hidden holds the residual after the last layer's attention and block_out that layer's MoE
  // output, as the stage path leaves them.
  float* hidden = nullptr;     // [Hp]
  float* block_out = nullptr;  // [Hp]
  bool block_out_valid = false;
  // The step's one token (device memory).
  const int32_t* position = nullptr;     // [1]
  const int32_t* slot = nullptr;         // [1] its cache slot
  const int32_t* block_table = nullptr;  // [max_blocks_per_seq]
  const int32_t* seq_len = nullptr;      // [1] cached tokens, the new one included
  const int32_t* route_key = nullptr;    // [1] RouterParams::noise_keys, or null
  const float* inv_freq = nullptr;       // [rotary_dim / 2]
  // Where each layer's picks are kept for the host (the routing capture), or null: layer l's K
  // ids and weights at routing_ids + l * routing_stride (and the same in routing_weights).
  int32_t* routing_ids = nullptr;
  float* routing_weights = nullptr;
  int64_t routing_stride = 0;
  // Shapes.
  int64_t hidden_size = 0;      // Hp, a multiple of 8
  int64_t norm_width = 0;       // H, the norms' mean width
  int64_t num_q_heads = 0;      // Nq
  int64_t num_kv_heads = 0;     // Nkv, divides Nq
  int64_t head_dim = 0;         // D
  int64_t padded_head_dim = 0;  // Dp, a multiple of 8, <= kDecodeLayersMaxHeadDim
  int64_t rotary_dim = 0;       // even, <= D
  float rope_scaling = 1.0f;    // cos and sin factor (yarn's mscale)
  float eps = 0.0f;
  float attention_scale = 0.0f;
  int64_t block_size = 0;        // tokens per KV block
  int64_t num_cache_blocks = 0;  // blocks in the pool
  int64_t max_blocks_per_seq = 0;
  int64_t num_experts = 0;   // E
  int64_t top_k = 0;         // K
  int64_t expert_width = 0;  // Ip, a multiple of 8
  RouterScore router_score = RouterScore::kSoftmax;
  bool renormalize = false;
  float routed_scaling_factor = 1.0f;
  // [kDecodeLayersStageClocks] zeros, or null: block 0 sums each stage's nanoseconds there, from
  // the barrier before it to the barrier after it (1 norm + QKV, 2 attention, 3 O, 4 norm +
  // router, 5 top-k + gate/up, 6 down; the last layer's down is not counted). For measurements.
  unsigned long long* stage_clock = nullptr;
  // Scratch (device memory, decode_layers_scratch_bytes), zero-filled once before first use:
  // the grid barrier and the attention tickets live in it and return to zero after each launch.
  void* scratch = nullptr;
};

inline constexpr int64_t kDecodeLayersMaxHeadDim = 256;
// DecodeLayersParams::stage_clock's slots: the six stages, the last barrier's time, the layers run.
inline constexpr int kDecodeLayersStages = 6;
inline constexpr int kDecodeLayersClockLast = kDecodeLayersStages;
inline constexpr int kDecodeLayersClockLayers = kDecodeLayersStages + 1;
// Every block's attention items: their count, then the nanoseconds from the queries' barrier to
// each of an item's phases, summed: its queries formed, its first key tile in shared memory, its
// key tiles done, its partial result published (the ticket taken), its end (the merge included).
inline constexpr int kDecodeLayersClockItemCount = kDecodeLayersStages + 2;
inline constexpr int kDecodeLayersClockItemPhases = kDecodeLayersStages + 3;
inline constexpr int kDecodeLayersItemPhases = 5;
inline constexpr int kDecodeLayersStageClocks =
    kDecodeLayersClockItemPhases + kDecodeLayersItemPhases;
inline constexpr int64_t kDecodeLayersMaxGroup = 16;  // query heads per KV head
inline constexpr int64_t kDecodeLayersMaxHidden = 8192;  // Hp

// The grid barrier's word (the kernel's grid_arrive): block 0 adds 2^31 - (blocks - 1) and every
// other block adds 1, so the top bit flips exactly when the last block arrives and the low bits
// come back to zero, with no reset between barriers or launches.
inline constexpr uint32_t kDecodeLayersBarrierFlip = 0x80000000u;
MOE_HOST_DEVICE constexpr uint32_t decode_layers_barrier_add(uint32_t block, uint32_t blocks) {
  return block == 0 ? kDecodeLayersBarrierFlip - (blocks - 1) : 1u;
}

// Bytes of scratch one run needs for these shapes on this device.
int64_t decode_layers_scratch_bytes(const DecodeLayersParams& shapes);

// Empty when the kernel takes these shapes (and this device: a cooperative launch of one block
// per SM), else what it does not take.
std::string decode_layers_unsupported(const DecodeLayersParams& shapes);

// Runs layers [0, num_layers) of params.layers on `stream` (one cooperative launch). Refuses
// shapes the kernel does not take, naming the value, before it touches the device.
void decode_layers(const DecodeLayersParams& params, cudaStream_t stream);

}  // namespace moeinfer::cuda
