// GPT-OSS: Llama-style attention with q/k/v/o biases and a learned sink logit per head
// (self_attn.sinks), every layer routed through mlp.router (weight and bias) to experts stored
// stacked per layer, with biases, as the published checkpoints hold them:
//   mlp.experts.gate_up_proj       [E, H, 2I]  gate and up interleaved along the last dim
//   mlp.experts.gate_up_proj_bias  [E, 2I]     interleaved the same way
//   mlp.experts.down_proj          [E, I, H]
//   mlp.experts.down_proj_bias     [E, H]
// i.e. [in, out] per expert, the transpose of the [out, in] the products take. The MXFP4 release
// stores gate_up_proj and down_proj as <name>_blocks / <name>_scales per output row instead
// ([E, 2I, H / 32, 16] and [E, H, I / 32, 16]), already [out, in]. Either way the binder lays
// each layer's experts out once at load as [E, 2I, H] with the I gate rows first and the I up
// rows after them, and [E, H, I]: the views of moe::ExpertWeights. The biases become float32.
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "model/family.h"

namespace moeinfer {
namespace {

// Where row (or column) c of the interleaved gate/up dimension goes: gate c / 2 to row c / 2,
// up c / 2 to row I + c / 2.
std::vector<int64_t> gate_up_rows(int64_t I) {
  std::vector<int64_t> rows(static_cast<size_t>(2 * I));
  for (int64_t c = 0; c < 2 * I; ++c) rows[c] = (c % 2) * I + c / 2;
  return rows;
}

// [E, A, B] -> a new [E, B, A] of the same dtype, row b of each expert written at
// destination_row[b] (empty: b).
TensorView transposed_experts(const TensorView& in, std::span<const int64_t> destination_row,
                              WeightSource& src) {
  const int64_t E = in.shape[0], A = in.shape[1], B = in.shape[2];
  const size_t elem = dtype_size(in.dtype);
  auto* out = static_cast<std::byte*>(src.allocate(static_cast<size_t>(E * A * B) * elem));
  const auto* from = static_cast<const std::byte*>(in.data);
  parallel_for(E * B, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t e = task / B, b = task % B;
      const int64_t row = destination_row.empty() ? b : destination_row[b];
      std::byte* dst = out + static_cast<size_t>((e * B + row) * A) * elem;
      const std::byte* col = from + static_cast<size_t>(e * A * B + b) * elem;
      for (int64_t a = 0; a < A; ++a) {
        std::memcpy(dst + a * elem, col + static_cast<size_t>(a * B) * elem, elem);
      }
    }
  });
  return TensorView{.dtype = in.dtype, .shape = {E, B, A}, .data = out};
}

// [E, N] biases as float32, entry n of each expert written at destination[n] (empty: n).
TensorView float_biases(const TensorView& in, std::span<const int64_t> destination,
                        WeightSource& src) {
  const int64_t E = in.shape[0], N = in.shape[1];
  auto* out = static_cast<float*>(src.allocate(static_cast<size_t>(E * N) * sizeof(float)));
  std::vector<float> row(static_cast<size_t>(N));
  for (int64_t e = 0; e < E; ++e) {
    convert_to_f32(in.dtype, in.row(e), row.data(), N);
    for (int64_t n = 0; n < N; ++n)
      out[e * N + (destination.empty() ? n : destination[n])] = row[n];
  }
  return TensorView{.dtype = DType::kF32, .shape = {E, N}, .data = out};
}

// A [count] slice of row `row` of a 2-D float32 view.
TensorView bias_slice(const TensorView& biases, int64_t row, int64_t first, int64_t count) {
  return TensorView{.dtype = DType::kF32,
                    .shape = {count},
                    .data = static_cast<const float*>(biases.data) + row * biases.shape[1] + first};
}

moe::RoutedExperts bind_experts(const ModelConfig& config, WeightSource& src,
                                const std::string& p) {
  const int64_t E = config.num_experts, H = config.hidden_size, I = config.moe_intermediate_size;
  const std::vector<int64_t> rows = gate_up_rows(I);
  const std::string gate_up_name = p + "experts.gate_up_proj";
  const std::string down_name = p + "experts.down_proj";
  TensorView gate_up, down;  // [E, 2I, H] gate rows then up rows; [E, H, I]
  if (src.has(gate_up_name + "_blocks")) {
    MOE_CHECK(config.mxfp4, config.source, ": tensor '", gate_up_name,
              "_blocks' is MXFP4 but config.json has no quantization_config with quant_method "
              "mxfp4");
    gate_up = src.mxfp4_experts(gate_up_name, {E, 2 * I, H}, rows);
    down = src.mxfp4_experts(down_name, {E, H, I});
  } else {
    gate_up = transposed_experts(src.tensor(gate_up_name, {E, H, 2 * I}), rows, src);
    down = transposed_experts(src.tensor(down_name, {E, I, H}), {}, src);
  }
  const TensorView gate_up_bias =
      float_biases(src.tensor(gate_up_name + "_bias", {E, 2 * I}), rows, src);
  const TensorView down_bias = float_biases(src.tensor(down_name + "_bias", {E, H}), {}, src);

  moe::RoutedExperts routed;
  routed.router = src.tensor(p + "router.weight", {E, H});
  routed.experts.resize(E);
  for (int64_t e = 0; e < E; ++e) {
    const TensorView both = gate_up.slice0(e);  // [2I, H]
    routed.experts[e] = {.gate = {.dtype = both.dtype, .shape = {I, H}, .data = both.row(0)},
                         .up = {.dtype = both.dtype, .shape = {I, H}, .data = both.row(I)},
                         .down = down.slice0(e),
                         .gate_bias = bias_slice(gate_up_bias, e, 0, I),
                         .up_bias = bias_slice(gate_up_bias, e, I, I),
                         .down_bias = bias_slice(down_bias, e, 0, H)};
  }
  return routed;
}

}  // namespace

DecoderWeights bind_gpt_oss(const ModelConfig& config, WeightSource& src) {
  DecoderWeights w = binding::skeleton(config, src);
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const std::string layer = "model.layers." + std::to_string(l) + ".";
    LayerWeights& lw = w.layers[l];
    lw.attention.sinks = src.tensor(layer + "self_attn.sinks", {config.num_heads});
    const std::string p = layer + "mlp.";
    lw.moe.routed = bind_experts(config, src, p);
    lw.moe.router_bias = src.tensor(p + "router.bias", {config.num_experts});
  }
  return w;
}

}  // namespace moeinfer
