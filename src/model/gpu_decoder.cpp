// Builds without CUDA: the GPU decoder is not there, and asking for it says so.
#include "model/gpu_decoder.h"

#include <string>

#include "core/error.h"

namespace moeinfer {

void check_gpu_supports(const ModelConfig& config) {
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
    MOE_FAIL(config.model_type, ": the Gated DeltaNet linear-attention layers (", layers, "; ",
             config.num_linear_layers(), " of ", config.num_layers,
             ") and their recurrent state are not implemented on the CUDA backend; run with "
             "--device cpu");
  }
  MOE_CHECK(!config.attention_output_gate, config.model_type,
            ": the attention output gate is not implemented on the CUDA backend; run with "
            "--device cpu");
  MOE_CHECK(!config.norm_weight_offset, config.model_type,
            ": zero-centred RMSNorm weights are not implemented on the CUDA backend; run with "
            "--device cpu");
}

}  // namespace moeinfer

#if !defined(MOE_HAVE_CUDA)
namespace moeinfer {

std::unique_ptr<GpuDecoder> GpuDecoder::create(const ModelConfig& config, const DecoderWeights&,
                                               const GpuOptions&) {
  check_gpu_supports(config);
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
