// What the GPU decoder computes (check_gpu_support, in every build); and without CUDA, the GPU
// decoder is not there and asking for it says so.
#include "model/gpu_decoder.h"

#include <string>

#include "core/error.h"
#include "model/model_facts.h"

namespace moeinfer {

std::optional<std::string> gpu_unsupported(const ModelConfig& config) {
  // Qwen3-Next / Qwen3.5-MoE: Gated DeltaNet layers with a per-sequence recurrent state, the
  // attention output gate and zero-centred norms are not in the CUDA kernels.
  if (config.num_linear_layers() > 0) {
    std::string layers;
    for (int64_t l = 0; l < config.num_layers; ++l) {
      if (!config.is_linear_layer(l)) continue;
      if (layers.size() > 40) {
        layers += ", ...";
        break;
      }
      layers += (layers.empty() ? "" : ", ") + std::to_string(l);
    }
    return config.model_type + ": the Gated DeltaNet linear-attention layers (" + layers + "; " +
           std::to_string(config.num_linear_layers()) + " of " + std::to_string(config.num_layers) +
           ") and their recurrent state are not implemented on the CUDA backend; run with "
           "--device cpu";
  }
  if (config.attention_output_gate) {
    return config.model_type +
           ": the attention output gate is not implemented on the CUDA backend; run with "
           "--device cpu";
  }
  if (config.norm_weight_offset) {
    return config.model_type +
           ": zero-centred RMSNorm weights are not implemented on the CUDA backend; run with "
           "--device cpu";
  }
  // GPT-OSS (attention sinks, per-layer sliding windows, the router's bias and top-k softmax,
  // expert biases, the clamped SwiGLU) runs; its --expert-budget is refused at create
  // (check_gpu_offload in model/cuda/gpu_decoder.cpp). So does Llama 4 (chunked local attention,
  // NoPE layers and their query temperature, the q/k norm after RoPE, routing weights on the
  // experts' input), its --expert-budget refused the same way.
  return std::nullopt;
}

void check_gpu_support(const ModelConfig& config) {
  if (const std::optional<std::string> reason = gpu_unsupported(config)) MOE_FAIL(*reason);
}

std::optional<std::string> gpu_offload_unsupported(const ModelConfig& config) {
  // The cache moves the experts' matrices and computes cold ones on the host as SiLU-gated
  // experts without biases (CachedExperts::compute_on_host), on the unweighted hidden rows.
  if (config.routing_weight_on_input) {
    return config.model_type +
           ": --expert-budget on cuda does not support routing weights on the experts' input "
           "yet (the expert cache's host compute reads the unweighted rows); run without "
           "--expert-budget (every expert resident) or with --device cpu";
  }
  if (!config.expert_bias && !config.clamped_swiglu) return std::nullopt;
  return config.model_type +
         ": --expert-budget on cuda does not support experts with biases and the clamped SwiGLU "
         "yet (the expert cache's host compute lacks them); run without --expert-budget (every "
         "expert resident) or with --device cpu";
}

void check_gpu_offload(const ModelConfig& config, const offload::OffloadOptions& offload) {
  if (!offload.enabled()) return;
  if (const std::optional<std::string> reason = gpu_offload_unsupported(config)) {
    MOE_FAIL(*reason);
  }
}

std::optional<std::string> gpu_kv_unsupported(const ModelConfig& config, KvDType dtype) {
  switch (dtype) {
    case KvDType::kBF16:
      return std::nullopt;
    case KvDType::kF32:
      return std::string(
          "--kv-dtype f32 applies to --device cpu: the CUDA backend's KV cache holds bf16 or fp8 "
          "rows (use --kv-dtype bf16, fp8 or auto there, or run --device cpu)");
    case KvDType::kFP8:
      if (config.mla) {
        return config.model_type +
               ": --kv-dtype fp8 on cuda does not support MLA yet (the latent cache's kernels "
               "read bf16 rows); use --kv-dtype bf16 there, or --device cpu for fp8 rows";
      }
      if (config.head_dim > 256) {
        return config.model_type + ": --kv-dtype fp8 on cuda does not support head_dim " +
               std::to_string(config.head_dim) +
               " yet (the wide decode kernel of heads above 256 reads bf16 rows); use "
               "--kv-dtype bf16 there, or --device cpu for fp8 rows";
      }
      return std::nullopt;
  }
  return std::nullopt;  // unreachable: every enumerator returns above
}

void check_gpu_kv_dtype(const ModelConfig& config, KvDType dtype) {
  if (const std::optional<std::string> reason = gpu_kv_unsupported(config, dtype)) {
    MOE_FAIL(*reason);
  }
}

int64_t gpu_kv_bytes_per_token(const ModelConfig& config, int64_t padded_head_dim,
                               int64_t mla_cache_width, KvDType dtype) {
  check_gpu_kv_dtype(config, dtype);
  if (config.mla) return config.num_kv_layers() * mla_cache_width * 2;
  ModelConfig padded = config;
  padded.head_dim = padded_head_dim;
  return kv_bytes_per_token(padded, dtype);
}

}  // namespace moeinfer

#if !defined(MOE_HAVE_CUDA)
namespace moeinfer {

std::unique_ptr<GpuDecoder> GpuDecoder::create(const ModelConfig&, const DecoderWeights&,
                                               const GpuOptions&) {
  MOE_FAIL("--device cuda: this build of moeinfer has no CUDA support (configure with the CUDA "
           "toolkit installed, or -DMOE_ENABLE_CUDA=ON)");
}

std::unique_ptr<GpuDecoder> GpuDecoder::create_synthetic(const ModelConfig& config,
                                                         const GpuOptions& options,
                                                         const SyntheticGpuOptions&) {
  return create(config, DecoderWeights{}, options);
}

DeviceFloors measure_device_floors() {
  MOE_FAIL("this build of moeinfer has no CUDA support");
}

}  // namespace moeinfer
#endif
