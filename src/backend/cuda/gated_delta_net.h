// Host interface of the Gated DeltaNet kernels (Qwen3-Next's and Qwen3.5-MoE's linear-attention
// layers): the causal depthwise conv over the q/k/v channels, the gated delta rule recurrence,
// and the gated RMSNorm of its output; and the sigmoid output gate of the same models' gated
// full-attention layers. The CPU twin is Decoder::linear_attention
// (model/decoder.cpp); these follow its order of operations.
//
// A step carries S sequences, each a run of consecutive token rows (cu_seqlens), and each owns
// a slot of the layer's recurrent state (state_slots, the host's StateSlots numbers): the conv's
// last `taps - 1` inputs per channel and the delta rule's [Nv, Dk, Dv] state, float32. A
// sequence whose first row is at position 0 starts from zeros (the slot's old contents are not
// read), so a fresh request or a recompute after preemption needs no separate reset, and decode
// graphs replay it as it is. A slot < 0 marks a padding sequence of a graph bucket: nothing is
// read or written but its rows of the recurrence's output, which are zeroed.
//
// Same contract as moe_stages.h: params structs of raw device pointers, host-side checks that
// name the offending value, no host synchronisation (graph-capturable).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moeinfer::cuda {

// The conv's widest kernel (Qwen3-Next uses 4): its window lives in registers.
inline constexpr int64_t kDeltaNetMaxConvTaps = 8;
// The widest key head: the recurrence keeps a [Dk, 32] tile of the state in a block's registers,
// 32 rows a warp.
inline constexpr int64_t kDeltaNetMaxKeyDim = 256;

// Sequences of a step, shared by the three launchers.
struct DeltaNetSequences {
  const int32_t* cu_seqlens = nullptr;   // [S + 1] first row of each sequence, then T
  const int32_t* state_slots = nullptr;  // [S] the sequence's state slot; < 0: padding
  const int32_t* positions = nullptr;    // [T] each row's position (0 at a sequence's start)
  int64_t num_seqs = 0;                  // S
  int64_t num_slots = 0;                 // slots of the state buffers (device range check)
};

struct DeltaNetConvParams {
  DeltaNetSequences seqs;
  const float* x = nullptr;   // [T, x_stride]: channels [0, C) are the [q | k | v] projections
  int64_t x_stride = 0;       // >= C
  const float* weight = nullptr;  // [C, taps] depthwise taps, the last one on the newest input
  float* conv_state = nullptr;    // [num_slots, C, taps - 1], read then rewritten per sequence
  float* out = nullptr;           // [T, C] SiLU(conv)
  int64_t num_channels = 0;       // C
  int64_t taps = 0;               // in [2, kDeltaNetMaxConvTaps]
};

// out[t, c] = silu(sum_j weight[c, j] * window_t[j]) over the window of the sequence's last
// `taps` inputs of channel c (the state's, then the step's), and the window's tail back into the
// state. One thread per (sequence, channel), over the sequence's rows in order.
void delta_net_conv(const DeltaNetConvParams& params, cudaStream_t stream);

struct DeltaNetRecurrenceParams {
  DeltaNetSequences seqs;
  const float* qkv = nullptr;  // [T, qkv_stride]: q heads [0, Nk Dk), k heads, v heads (after conv)
  int64_t qkv_stride = 0;
  const float* b = nullptr;    // [T, ba_stride]: beta's logits, one per value head
  const float* a = nullptr;    // [T, ba_stride]: the decay's input, one per value head
  int64_t ba_stride = 0;
  const float* a_log = nullptr;    // [Nv] A_log
  const float* dt_bias = nullptr;  // [Nv]
  float* state = nullptr;          // [num_slots, Nv, Dk, Dv]
  float* out = nullptr;            // [T, Nv Dv]
  int64_t num_key_heads = 0;       // Nk; value head h reads key head h / (Nv / Nk)
  int64_t num_value_heads = 0;     // Nv, a multiple of Nk
  int64_t key_dim = 0;             // Dk in [1, kDeltaNetMaxKeyDim]
  int64_t value_dim = 0;           // Dv
  float l2_eps = 1e-6f;            // inside the square root of the q and k L2 norms
};

// The gated delta rule per (sequence, value head), token by token, on the state S [Dk, Dv]:
//   q, k L2-normalised (q also by 1/sqrt(Dk)); beta = sigmoid(b);
//   decay = exp(-exp(A_log) softplus(a + dt_bias));
//   S *= decay; S += k (beta (v - S^T k))^T; out = S^T q.
// One block per (sequence, value head, 32 value columns): 32 lanes a column each, one warp per
// 32 rows of Dk, the tile of S in registers for the whole sequence.
void delta_net_recurrence(const DeltaNetRecurrenceParams& params, cudaStream_t stream);

struct GatedRmsNormParams {
  const float* x = nullptr;       // [rows, width] (rows = T * Nv heads of width Dv), contiguous
  const float* z = nullptr;       // the gate: row r at z + (r / heads) * z_stride + (r % heads) * width
  int64_t z_stride = 0;           // from one token's gates to the next
  int64_t heads = 0;              // rows per token
  const float* weight = nullptr;  // [width], float32
  __nv_bfloat16* out = nullptr;   // [rows, width]
  int64_t rows = 0;
  int64_t width = 0;              // in [1, 1024]
  float eps = 1e-6f;
};

// out = rms_norm(x) * weight * silu(z) per row, in float32, one bf16 rounding. A warp per row.
void gated_rms_norm(const GatedRmsNormParams& params, cudaStream_t stream);

struct OutputGateParams {
  __nv_bfloat16* x = nullptr;           // [rows, width] in place (the attention's output)
  const __nv_bfloat16* gate = nullptr;  // row r at gate + r * gate_stride, `width` logits
  int64_t gate_stride = 0;              // >= width
  int64_t rows = 0;
  int64_t width = 0;
};

// x *= sigmoid(gate), element by element, in float32 with one bf16 rounding: the output gate of
// Qwen3-Next's gated full attention (the gate logits are q_proj's second half of each head).
void attention_output_gate(const OutputGateParams& params, cudaStream_t stream);

}  // namespace moeinfer::cuda
