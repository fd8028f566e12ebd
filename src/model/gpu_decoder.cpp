// What the GPU decoder computes (check_gpu_support, in every build); and without CUDA, the GPU
// decoder is not there and asking for it says so.
#include "model/gpu_decoder.h"

#include <string>

#include "core/error.h"
#include "model/model_facts.h"

namespace moeinfer {

std::optional<std::string> gpu_unsupported(const ModelConfig& config) {
  // Qwen3-Next / Qwen3.5-MoE run: Gated DeltaNet layers (backend/cuda/gated_delta_net.h) with
  // their recurrent state in device slots, the attention output gate, zero-centred norms (1 + w
  // at upload), partial RoPE.
  if (config.num_linear_layers() > 0 && config.num_kv_layers() == 0) {
    return config.model_type +
           ": every layer is linear attention; the CUDA backend needs at least one layer with a "
           "KV cache; run with --device cpu";
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
  if (config.num_linear_layers() > 0) {
    return config.model_type +
           ": --expert-budget on cuda is not supported yet for models with Gated DeltaNet "
           "layers (the expert cache has not been held to the CPU with a recurrent state); run "
           "without --expert-budget (every expert resident) or with --device cpu";
  }
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
      // MLA: the latent and the rope key, two scale groups a row (mla_attention.h).
      if (config.mla) return std::nullopt;
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
  if (config.mla) {
    // fp8: a code a value of the padded row and two float32 scales (latent, rope key).
    const int64_t row = dtype == KvDType::kFP8 ? mla_cache_width + 2 * 4 : mla_cache_width * 2;
    return config.num_kv_layers() * row;
  }
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

int cuda_device_count() { return 0; }

std::string cuda_device_uuid(int) { return {}; }

}  // namespace moeinfer
#endif
