// Host interface of the small-batch MoE layer: the whole routed (and shared) expert block of a
// decode step in two launches, for steps whose T*K rows are few (decode at small batch).
//
// Why: at batch 1 a MoE layer is memory-bound on a few experts' weights (8 of them in
// Qwen3-30B-A3B, 9.4 MB each), but the general path (router GEMM, router, plan, grouped gate/up,
// grouped down, shared MLP, unpermute) is seven or more launches of a few microseconds each, and
// the grouped GEMM's 16-row tiles keep 15 of 16 mma rows empty. Here:
//   1. route: every warp computes one router row's logits for the T tokens (the E router rows
//      spread over E/4 blocks); the block that finishes last (a ticket counter) routes the T
//      tokens with the fused router's own per-token functions (router_kernel.cuh: the same
//      picks, ties and weights), then plans: the experts used, their rows, and the shared
//      experts as one more "expert" that every real token uses at weight 1 (or the sigmoid of
//      the shared gate). It also resets the second kernel's counters.
//   2. experts: a persistent grid takes work items from a queue in order: first every
//      (expert, 8 gate/up columns) item (each warp one column: SiLU(gate) * up for the expert's
//      rows, float32), then every (expert, 32 output columns) item of the down projection, which
//      waits until its expert's gate/up items are done. Items are claimed in order by running
//      blocks, so a waiting block only waits for work a running block already holds, and the
//      queue cannot deadlock whatever the residency. Each down item writes its rows' weighted
//      outputs to a per-(token, pick) buffer and counts the arrivals of its (token, column
//      tile); the arrival that completes a tile sums shared + pick 0 + ... + pick K-1 in that
//      order, as unpermute does, into the block output.
// Work is split by (expert, column block), so one token's eight experts stream from every SM,
// and an expert no token picked costs nothing. Weights are read once per step (rows of an
// expert are taken 8 at a time from shared memory against the weights held in registers).
//
// Numerics: as the general path up to float32 summation order, but the SiLU product and the
// expert outputs stay float32 (the grouped GEMM rounds both to bf16 for its tensor cores).
//
// Quantised routed experts (quant != kNone, expert_quant.h's slabs): a lane loads 16 bytes of
// codes at a time (16 fp8 inputs, 32 int4 or MXFP4 inputs) with the scale of their group, and
// dequantises each 8 inputs with the grouped GEMM's own function (expert_dequant.cuh) just
// before the products, so every weight has the bf16 value the grouped GEMM multiplies and only
// the codes and scales cross the memory bus. The shared experts stay bf16 (never quantised).
//
// Glossary: T tokens, E experts, K picks per token, Hp padded hidden size, Ip padded expert
// width, Is shared-expert width (all of them multiples of 8).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "backend/cuda/expert_quant.h"
#include "backend/cuda/moe_stages.h"

namespace moeinfer::cuda {

// The sizes the small-batch path is built for: its router keeps a token's logits in one warp
// (E <= 1024, K <= 32, the fused router's one-warp range) and its plan runs in one block. Other
// shapes take the stage-by-stage path.
inline constexpr int64_t kSmallMoeMaxTokens = 64;
inline constexpr int64_t kSmallMoeMaxRows = 512;  // T * K

struct SmallMoeParams {
  const bf16* hidden = nullptr;  // [T, Hp] the normed hidden state
  const bf16* router = nullptr;  // [E, Hp]
  // Routing (logits is workspace, [T, E] float32; topk_ids / topk_weights [T, K] are written as
  // fused_router writes them; num_tokens, num_experts, top_k and num_valid_tokens are read from
  // here). The router noise (route.noise_keys) is honoured as fused_router honours it: the
  // routing runs router_kernel.cuh's functions, which replace the logits they read.
  RouterParams route;
  // bf16: [E, 2 Ip, Hp] gate rows then up rows per expert, and [E, Hp, Ip]. Quantised: E slabs
  // each, at a stride of quant_matrix_layout(quant, 2 Ip, Hp, group).bytes (and of
  // quant_matrix_layout(quant, Hp, Ip, group).bytes), as the grouped GEMM reads them.
  const bf16* gate_up = nullptr;
  const bf16* down = nullptr;
  ExpertQuant quant = ExpertQuant::kNone;
  int64_t quant_group = 0;               // inputs per scale (small_moe_supports_quant)
  int64_t expert_width = 0;              // Ip
  const bf16* shared_gate_up = nullptr;  // [2 Is, Hp] or null
  const bf16* shared_down = nullptr;     // [Hp, Is]
  int64_t shared_width = 0;              // Is
  const bf16* shared_gate = nullptr;     // [1, Hp] sigmoid gate of the shared expert, or null
  int32_t* expert_counts = nullptr;      // [E + 1] rows per expert (padding at E), or null
  float* out = nullptr;                  // [T, Hp] the block output, float32
  // small_moe_workspace_bytes(...) bytes, 16-byte aligned, zero-filled once before the first
  // call (the kernels leave their counters zeroed for the next one).
  void* workspace = nullptr;
  int64_t hidden_size = 0;  // Hp
  // Blocks of the experts kernel; 0: small_moe_default_blocks().
  int64_t experts_blocks = 0;
};

// Whether the small-batch path takes these sizes: T <= kSmallMoeMaxTokens, T*K <=
// kSmallMoeMaxRows, E <= kRouterWarpMaxExperts, K <= min(kRouterWarpMaxTopK, E), Hp a multiple
// of 64, Ip and Is multiples of 8 (Is 0 without a shared expert).
bool small_moe_supports(int64_t num_tokens, int64_t num_experts, int64_t top_k, int64_t hidden_size,
                        int64_t expert_width, int64_t shared_width);

// Whether the experts kernel reads routed experts of this format: kNone always; fp8 with a
// group a multiple of 8 and Hp, Ip multiples of 16 (a lane's 16 bytes of codes lie in one row);
// int4 likewise with Hp, Ip multiples of 32; MXFP4 with group 32 and Hp, Ip multiples of 32.
bool small_moe_supports_quant(ExpertQuant quant, int64_t group, int64_t hidden_size,
                              int64_t expert_width);

// Bytes of workspace for up to max_tokens tokens.
int64_t small_moe_workspace_bytes(int64_t max_tokens, int64_t num_experts, int64_t top_k,
                                  int64_t hidden_size, int64_t expert_width, int64_t shared_width);

// Blocks of the persistent experts kernel (for routed experts of format `quant`) that stay
// resident on this device.
int64_t small_moe_default_blocks(ExpertQuant quant = ExpertQuant::kNone);

// The routed and shared experts of one MoE layer: out = shared + sum_k w_k expert_k(hidden),
// with the routing of fused_router. Two launches, no host synchronisation (graph-capturable).
void small_batch_moe(const SmallMoeParams& params, cudaStream_t stream);

// The two launches of small_batch_moe, for a caller that records events between them (the
// profiler's route and experts stages): route_plan writes the logits, the routing, the counts
// and the plan; experts the block output. Called in this order with the same params.
void small_batch_moe_route_plan(const SmallMoeParams& params, cudaStream_t stream);
void small_batch_moe_experts(const SmallMoeParams& params, cudaStream_t stream);

}  // namespace moeinfer::cuda
