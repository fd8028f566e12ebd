// Builds without CUDA: the GPU decoder is not there, and asking for it says so.
#include "model/gpu_decoder.h"

#include "core/error.h"

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
