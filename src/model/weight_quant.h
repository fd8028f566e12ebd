// Weight-only quantisation of the routed experts at load (`--weights fp8|int4`), as the numerics
// of the format on the CPU: each routed expert's gate, up and down matrix is quantised and
// dequantised once, and the values are held in the experts' compute dtype (bf16 for a bf16
// checkpoint, float32 otherwise). The products are then those of the quantised model. The codes
// and scales are kept too (model/quantized_matrix.h): the GPU holds those, not the values, and
// dequantises them in its expert GEMM.
// With --weights-scope linear (WeightScope::kLinear) every other Linear weight of every layer is
// quantised the same way (quantize_linear_weights): attention's q/k/v/o, MLA's projections,
// Gated DeltaNet's in/out projections, shared experts and dense MLPs. Embeddings, the LM head,
// norms, the MoE router and small gates (Qwen2-MoE's shared_expert_gate) keep the checkpoint's
// weights, as vLLM's --quantization fp8 and llama.cpp's quantisers leave them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"

namespace moeinfer {

struct DecoderWeights;
struct ModelConfig;
class WeightSource;

// What the routed experts run as. kCheckpoint: as the checkpoint's weights load (block-scaled
// fp8, MXFP4, GPTQ and AWQ checkpoints are dequantised to bf16 at load, as always).
enum class WeightFormat : uint8_t {
  kCheckpoint,
  kBf16,  // each routed expert weight rounded to bf16 (a no-op on bf16 and quantised checkpoints)
  kFp8,   // e4m3 with one float32 scale per 128 x 128 block (DeepSeek-V3's weight_scale_inv)
  kInt4,  // 4-bit codes with a scale and a zero point per group of 128 inputs of a row (GPTQ/AWQ)
};

inline constexpr int64_t kFp8BlockSize = 128;   // rows and columns of a block
inline constexpr int64_t kInt4GroupSize = 128;  // consecutive inputs of one output row

// Which Linear weights --weights quantises (--weights-scope).
enum class WeightScope : uint8_t {
  kExperts,  // the routed experts only (the default)
  kLinear,   // the routed experts and every dense Linear but embeddings, LM head and routers
};

// "experts", "linear".
std::string_view weight_scope_name(WeightScope scope);
// The inverse; "" is kExperts. Throws naming --weights-scope on anything else.
WeightScope parse_weight_scope(std::string_view text);
// Refuses --weights-scope linear without --weights fp8|int4, naming both flags.
void check_weight_scope(WeightFormat format, WeightScope scope);

// "bf16", "fp8", "int4"; "" for kCheckpoint.
std::string_view weight_format_name(WeightFormat format);
// The inverse for "bf16" / "bfloat16", "fp8", "int4"; "" is kCheckpoint. Throws on anything else.
WeightFormat parse_weight_format(std::string_view text);

// Refuses --weights bf16 on the GPU (that is --dtype bfloat16 there), and fp8 / int4 on a
// checkpoint whose experts are already quantised (block-scaled fp8, MXFP4, GPTQ, AWQ), naming the
// flag and the checkpoint's format.
void check_weight_format(WeightFormat format, const ModelConfig& config, bool cuda);
// A synthetic model (`name`, drawn on the GPU) takes --weights fp8 / int4 as random codes of that
// format for its routed experts (gpu::synthetic_weights), whatever the published checkpoint's
// own format. Refuses --weights bf16 as check_weight_format does on cuda, and fp8 / int4 with
// offloaded experts (--expert-budget): the expert cache holds bf16 experts, and a synthetic
// model has no bf16 values behind its codes (a checkpoint's experts would fall back to bf16 there).
void check_synthetic_weight_format(WeightFormat format, std::string_view name,
                                   bool offload_experts);

// Replaces each routed expert's gate, up and down view of every MoE layer by its quantised
// values in buffers owned by `source`, and records each one's codes and scales there
// (WeightSource::quantized, for the GPU). Nothing changes under kCheckpoint.
void quantize_routed_experts(WeightFormat format, DecoderWeights& weights, WeightSource& source);

// --weights-scope linear: the same for every dense Linear weight of every layer (attention's
// q/k/v/o, MLA's q/q_a/q_b/kv_a/kv_b/o, Gated DeltaNet's in/out projections, shared experts' and
// dense MLPs' gate/up/down), each one a matrix of its own (fp8 blocks and int4 groups start at
// its row 0 and column 0). Not the embeddings, the LM head, norms, the router, the shared
// expert's sigmoid gate, biases or the depthwise conv. A matrix whose K (columns) is not a
// multiple of 8 keeps the checkpoint's weights (the device reads codes 8 at a time). fp8 and int4
// only (check_weight_scope); a view met twice (one tensor bound twice) is quantised once.
// Returns how many matrices it quantised.
int64_t quantize_linear_weights(WeightFormat format, DecoderWeights& weights, WeightSource& source);
// The views quantize_linear_weights quantises in `weights` (non-empty, 2-D, K a multiple of 8),
// in layer order: what the tests hold it to.
std::vector<TensorView*> dense_linear_views(DecoderWeights& weights);

// w [R, C] -> out [R, C]: per block_rows x block_cols block (partial at the edges) scale =
// amax / 448 (1 for an all-zero block), out = e4m3(w / scale) * scale with e4m3 rounding to
// nearest even and saturating. scales [ceil(R / block_rows), ceil(C / block_cols)], when not
// null, receives each block's scale (what a checkpoint stores as weight_scale_inv), codes [R, C]
// each value's e4m3 byte. out may alias w.
void fake_quantize_fp8_blocks(const float* w, int64_t num_rows, int64_t num_cols,
                              int64_t block_rows, int64_t block_cols, float* out,
                              float* scales = nullptr, uint8_t* codes = nullptr);

// w [R, C] -> out [R, C]: per group of group_size consecutive values of a row (the last group of
// a row may be shorter), lo = min(min, 0), hi = max(max, 0), scale = (hi - lo) / 15, zero =
// round(-lo / scale) in [0, 15], q = clamp(round(w / scale) + zero, 0, 15), out = (q - zero) *
// scale; rounding to nearest even. A constant group c gets scale |c| (1 for 0) and codes that
// give c back exactly. scales and zeros [R, ceil(C / group_size)], when not null, receive each
// group's scale and zero point, codes [R, C] each value's q. out may alias w.
void fake_quantize_int4_groups(const float* w, int64_t num_rows, int64_t num_cols,
                               int64_t group_size, float* out, float* scales = nullptr,
                               int32_t* zeros = nullptr, uint8_t* codes = nullptr);

}  // namespace moeinfer
