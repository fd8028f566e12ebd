// Builds without CUDA: the GPU decoder is not there, and asking for it says so.
#include "model/gpu_decoder.h"

#include "core/error.h"

namespace moeinfer {

std::string gpu_missing_features(const ModelConfig& config) {
  std::string missing;
  const auto lacks = [&](bool needed, const char* what) {
    if (needed) missing += std::string(missing.empty() ? "" : ", ") + what;
  };
  lacks(config.attention_sinks, "attention sinks");
  lacks(!config.layer_sliding.empty(), "per-layer sliding windows (layer_types)");
  lacks(config.router_bias, "a router logit bias");
  lacks(config.router_topk_softmax, "softmax over the top-k router logits");
  lacks(config.expert_bias, "expert biases");
  lacks(config.clamped_swiglu.has_value(), "the clamped SwiGLU");
  return missing;
}

void check_gpu_supports(const ModelConfig& config) {
  const std::string missing = gpu_missing_features(config);
  MOE_CHECK(missing.empty(), config.model_type, ": ", missing,
            missing.find(',') == std::string::npos ? " is" : " are",
            " not implemented on the CUDA backend; run with --device cpu");
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
