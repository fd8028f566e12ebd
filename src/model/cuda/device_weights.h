// The model's weights in device memory, in the layouts the CUDA kernels want, and how they get
// there: one allocation for all of them, each matrix a bf16 block filled either from the
// checkpoint (converted row by row into pinned staging buffers and copied while the next chunk
// converts) or with random values on the device (synthetic models).
//
// Layout changes made at upload, each so that one kernel call covers what the checkpoint splits:
//   qkv        [(Nq + 2 Nkv) * Dp, Hp]  q, k and v projections stacked; heads padded to Dp
//   o_proj     [Hp, Nq * Dp]            zero columns for the padding
//   gate_up    [E, 2 Ip, Hp]            each expert's gate rows then up rows, padded to Ip
//   down       [E, Hp, Ip]
//   mlp / shared gate_up [2 I, Hp]      dense MLPs stacked the same way (no width padding: cuBLAS)
// Hp: the hidden size rounded up to a multiple of 64 (the grouped GEMM's reduction tile); every
// matrix that reads the hidden state has zero columns past H, every one that writes it zero rows,
// and the norm weights are zero there, so the padded columns of the residual stream stay zero
// and the norms divide by H. Dp: the head dim rounded up to what the attention kernels compile
// (64, 128, 256); Ip: the expert width rounded up to a multiple of 64 (the grouped GEMM's tile).
// Padded rows and columns are zero, so they add nothing to any product.
// Zero-centred norm weights (the config's norm_weight_offset, Qwen3-Next) are uploaded as 1 + w,
// so the kernels see ordinary weights; the padding stays zero. 1 + w takes two bf16 terms
// (norm_terms), as a float32 checkpoint's norms do: rounded to one, every weight of every norm
// moves by up to 2^-9 of itself.
//
// Quantised routed experts (fp8, int4, MXFP4 checkpoints and --weights fp8|int4): each expert's
// gate_up and down are slabs of codes and scales in the layout of backend/cuda/expert_quant.h,
// the same rows and columns as above (gate rows at 0, up rows at Ip, padding rows with zero
// codes and zero scales), taken from the codes the loader kept (model/quantized_matrix.h), or
// for a synthetic model under --weights fp8|int4 random codes drawn on the device.
//
// Two weight terms (weight_terms = 2, a float32 or float16 checkpoint unless rounded on request):
// bf16 keeps 8 significant bits, so each such weight w is held as hi = bf16(w) followed by
// lo = bf16(w - hi), which together carry 16 (every float16 value exactly, a float32 one to
// about 2^-17 of its size), and every product adds both terms' partial products in float32.
// Each matrix above is then [2, rows, cols]: its hi matrix followed by its lo matrix of the same
// shape (an expert stack [E, 2, ...]: each expert's hi then lo, so an expert stays one slab).
// Norm weights have their two terms the same way ([2, width]); biases stay one bf16 term (the
// attention sinks, the router bias and the expert biases are float32).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <vector>

#include "backend/cuda/expert_quant.h"
#include "io/model_config.h"
#include "model/cuda/device_memory.h"
#include "model/weight_quant.h"
#include "model/weights.h"

namespace moeinfer {
struct RoutingSkew;  // model/gpu_decoder.h
}  // namespace moeinfer

namespace moeinfer::gpu {

using bf16 = __nv_bfloat16;

struct DeviceLayer {
  const bf16* input_norm = nullptr;  // [Hp]
  const bf16* post_norm = nullptr;   // [Hp]
  // Standard attention. With the output gate (Qwen3-Next's gated attention, the config's
  // attention_output_gate) qkv has Nq more heads after v: each query head's gate,
  // [(2 Nq + 2 Nkv) Dp, Hp].
  const bf16* qkv = nullptr;       // [(Nq + 2 Nkv) Dp, Hp]
  const bf16* qkv_bias = nullptr;  // [(Nq + 2 Nkv) Dp] or null
  const bf16* q_norm = nullptr;    // [D] per head, or [Nq Dp] over the whole projection
  const bf16* k_norm = nullptr;
  const bf16* o_proj = nullptr;  // [Hp, Nq Dp]
  const bf16* o_bias = nullptr;  // [Hp] or null
  const float* sinks = nullptr;  // [Nq] attention sinks (GPT-OSS), float32, or null
  // Gated DeltaNet (linear-attention layers), C = 2 Nk Dk + Nv Dv channels of [q | k | v]:
  const bf16* lin_in = nullptr;     // [C + Nv Dv + 2 Nv, Hp]: q|k|v, z, b, a rows (de-interleaved
                                    // from Qwen3-Next's per-key-head packing at upload)
  const float* lin_conv = nullptr;  // [C, taps] the depthwise conv, float32
  const float* lin_a_log = nullptr;    // [Nv] A_log, float32
  const float* lin_dt_bias = nullptr;  // [Nv] float32
  const float* lin_norm = nullptr;     // [Dv] the gated norm's weight (not zero-centred), float32
  const bf16* lin_out = nullptr;       // [Hp, Nv Dv]
  // MLA.
  const bf16* q_proj = nullptr;     // [Nh qk, Hp] without a query bottleneck
  const bf16* q_a = nullptr;        // [q_lora, Hp]
  const bf16* q_a_norm = nullptr;   // [q_lora]
  const bf16* q_b = nullptr;        // [Nh qk, q_lora]
  const bf16* kv_a = nullptr;       // [L + R, Hp]
  const bf16* kv_a_norm = nullptr;  // [L]
  const bf16* kv_b = nullptr;       // [Nh (nope + v), L]
  const bf16* mla_o = nullptr;      // [Hp, Nh v]
  // Feed-forward.
  bool is_moe = false;
  const bf16* mlp_gate_up = nullptr;  // dense layer [2 I, Hp]
  const bf16* mlp_down = nullptr;     // [Hp, I]
  int64_t mlp_width = 0;
  const bf16* router = nullptr;          // [E, Hp]
  const float* selection_bias = nullptr;  // [E] chooses experts, not weights (DeepSeek-V3)
  const float* logit_bias = nullptr;      // [E] added to the logits (synthetic routing skew)
  const float* router_bias = nullptr;     // [E] the checkpoint's router bias (GPT-OSS), or null
  // Synthetic `--routing-skew uniform|zipf:A`: the router's logits are replaced by noise of this
  // seed (cuda::RouterParams::noise_seed), keyed per token and step (the decoder's route keys);
  // with zipf, Gumbel noise plus logit_bias.
  bool router_noise = false;
  uint64_t router_noise_seed = 0;
  // [E, 2 Ip, Hp] and [E, Hp, Ip]: in device memory, or with offloaded experts in the mapped
  // pinned host memory of DeviceWeights::expert_home (the experts' home, which the expert
  // cache copies from). With quantised experts (DeviceWeights::expert_quant) E slabs of codes
  // and scales each (backend/cuda/expert_quant.h), of a [2 Ip, Hp] and an [Hp, Ip] matrix.
  const bf16* experts_gate_up = nullptr;
  const bf16* experts_down = nullptr;
  // GPT-OSS's expert biases, float32 in device memory (offloaded experts too, which the cache
  // refuses for now): [E, 2 Ip] gate bias at [0, I), up bias at [Ip, Ip + I), zeros between,
  // as the gate_up rows; [E, Hp]. Null without them.
  const float* experts_gate_up_bias = nullptr;
  const float* experts_down_bias = nullptr;
  const bf16* shared_gate_up = nullptr;   // [2 Is, Hp] or null
  const bf16* shared_down = nullptr;      // [Hp, Is]
  int64_t shared_width = 0;
  const bf16* shared_gate = nullptr;  // [1, Hp] sigmoid gate of the shared expert, or null
  // shared_gate_up / shared_down are quantised slabs (DeviceWeights::dense_quant), which the
  // small-batch MoE kernel does not read (it reads bf16 shared experts).
  bool shared_quantized = false;
};

// A dense Linear held as one quantised slab (backend/cuda/expert_quant.h's layout) instead of a
// bf16 matrix: its DeviceLayer pointer (qkv, o_proj, ...) points at the slab, and
// CudaDecoder::linear() finds it here by that pointer.
struct DenseQuantMatrix {
  const void* data = nullptr;                           // the slab
  cuda::ExpertQuant format = cuda::ExpertQuant::kNone;  // kFp8 or kInt4
  int64_t group = 0;
  int64_t rows = 0, cols = 0;  // [N, K], the bf16 matrix's shape (padding included)
  cuda::QuantMatrixLayout layout;
};

// MLA's latent (kv_lora_rank L) and rope key (qk_rope_head_dim R) padded to the 16-byte vectors
// of the attention kernel and the cache writes: a cache row is [latent, zeros to Lp, rope key,
// zeros to Lp + Rp]. The padding is zero in kv_a_proj's rows, kv_a_norm and kv_b_proj's
// columns, so the padded dims add nothing to any score or output.
struct MlaPaddedDims {
  int64_t latent = 0;  // Lp
  int64_t rope = 0;    // Rp
  int64_t cache_width() const { return latent + rope; }
};

struct DeviceWeights {
  const bf16* embed = nullptr;       // [V, Hp]
  const bf16* final_norm = nullptr;  // [Hp]
  const bf16* lm_head = nullptr;     // [V, Hp]; the embedding when tied
  std::vector<DeviceLayer> layers;
  int64_t padded_hidden_size = 0;   // Hp
  int64_t padded_head_dim = 0;      // Dp
  int64_t padded_expert_width = 0;  // Ip
  MlaPaddedDims mla;                // MLA models only
  int64_t weight_terms = 1;         // 1, or 2: every bf16 matrix and norm is [hi; lo] (above)
  // 1, or 2: every norm weight is [hi; lo]. 2 with two weight terms, and for zero-centred norms
  // (1 + w of a bf16 w is not a bf16 value: one term would round every norm weight).
  int64_t norm_terms = 1;
  // How the routed experts are held: kNone, bf16 in weight_terms terms; else the checkpoint's
  // (or --weights') codes and scales, one term, dequantised in the expert GEMM. Quantised when
  // every routed expert matrix has its codes (DecoderWeights::quantized) in one format and
  // group, and the experts are resident (an offloaded expert cache holds bf16 slots).
  cuda::ExpertQuant expert_quant = cuda::ExpertQuant::kNone;
  int64_t expert_quant_group = 0;
  int64_t expert_bytes = 0;         // one routed expert's gate_up and down on the device
  // The experts have codes the device does not hold (the expert cache's slots are bf16): their
  // format, for the load summary; null otherwise.
  const char* expert_codes_unused = nullptr;
  // Dense Linears held as quantised slabs (attention, MLA but kv_b, Gated DeltaNet, dense and
  // shared MLPs; not embeddings, LM head, routers or gates): every one whose pieces have codes
  // the device reads, from a block-scaled fp8, GPTQ or AWQ checkpoint or --weights-scope linear,
  // or random codes of a synthetic model under --weights-scope linear. Empty otherwise.
  std::vector<DenseQuantMatrix> dense_quant;
  int64_t dense_quant_max_elems = 0;  // the largest one's N * K (the decoder's bf16 scratch)
  int64_t dense_quant_bytes = 0;      // all their slabs (in `bytes`)
  int64_t bytes = 0;                // device bytes of all weights
  double upload_seconds = 0.0;
  DeviceArray<char> allocation;  // every matrix above lives in it, but offloaded experts
  // Offloaded experts (offload_experts at build): every routed expert's weights, in the device
  // layout, in pinned host memory that kernels can read (filled in place from the checkpoint, or
  // with the synthetic values, so no second full copy is made).
  bool experts_offloaded = false;
  int64_t expert_home_bytes = 0;
  PinnedArray<char> expert_home;
};

// Hp, Dp and Ip for a config (and the checks that the kernels can run it).
int64_t padded_hidden_size(const ModelConfig& config);
int64_t padded_head_dim(const ModelConfig& config);
int64_t padded_expert_width(const ModelConfig& config);
MlaPaddedDims padded_mla_dims(const ModelConfig& config);  // zeros without MLA

// The codes `--weights fp8|int4` give the routed experts on the device, as the loader produces
// them (model/weight_quant.h): fp8 with a scale per 128 inputs of a row (the 128 x 128 block's,
// repeated on its rows), int4 with a scale and zero point per 128 inputs; kNone otherwise.
struct ExpertCodes {
  cuda::ExpertQuant format = cuda::ExpertQuant::kNone;
  int64_t group = 0;
};
ExpertCodes expert_codes_for(WeightFormat format);

// Device bytes upload_weights / synthetic_weights will allocate with every expert resident, the
// matrices in weight_terms terms; under --weights fp8|int4 the routed experts as those codes
// (what synthetic_weights holds, and upload_weights for a bf16 checkpoint under the flag).
// Under --weights-scope linear the dense Linears as those codes too (synthetic_weights').
int64_t device_weight_bytes(const ModelConfig& config, int64_t weight_terms = 1,
                            WeightFormat expert_weights = WeightFormat::kCheckpoint,
                            WeightScope scope = WeightScope::kExperts);

// round_to_bf16: every weight in one bf16 term, whatever the checkpoint's dtype (--dtype
// bfloat16); otherwise a float32 or float16 checkpoint gets two terms.
DeviceWeights upload_weights(const ModelConfig& config, const DecoderWeights& weights,
                             bool show_progress, bool offload_experts = false,
                             bool round_to_bf16 = false);
// Random weights (uniform, scaled by 1/sqrt(fan-in)); norms 1. Either skew sets each MoE layer's
// router_noise, with a seed mixed from `seed` and the layer index; a Zipf one also gives it a
// logit bias over a random ranking of its experts. The values do not depend on
// offload_experts.
// expert_weights fp8 or int4: every routed expert's gate_up and down are quantised slabs
// (expert_codes_for) of random codes and scales drawn on the device (cuda::quant_random_fill),
// whose values lie in the same [-1/sqrt(fan-in), 1/sqrt(fan-in)] as the bf16 ones; every other
// matrix is the bf16 one of the same seed. Refused with offload_experts (the expert cache holds
// bf16 experts: check_synthetic_weight_format); kCheckpoint and kBf16 give bf16 experts.
// scope linear (with expert_weights fp8 or int4): every dense Linear that upload_weights would
// hold quantised under --weights-scope linear (DeviceWeights::dense_quant) is one slab of random
// codes the same way, scale 1/sqrt(K).
DeviceWeights synthetic_weights(const ModelConfig& config, uint64_t seed,
                                const RoutingSkew& routing, bool offload_experts = false,
                                WeightFormat expert_weights = WeightFormat::kCheckpoint,
                                WeightScope scope = WeightScope::kExperts);

}  // namespace moeinfer::gpu
