// Internal interface between attention.cu and the Hopper prefill attention kernel
// (attention_prefill_wgmma_kernel.cuh), whose launcher sm90/attention_prefill_wgmma.cu is built
// for sm_90a only, and only when CMAKE_CUDA_ARCHITECTURES includes 90 (then MOE_HAVE_WGMMA is
// defined for attention.cu). Callers go through prefill_attention() (PrefillParams::hopper).
#pragma once

#include <cuda_runtime_api.h>

#include "backend/cuda/attention.h"

namespace moeinfer::cuda {

// Why the Hopper kernel cannot run these parameters (options and shapes, not the device), or
// null when it can. Defined in attention.cu, so it exists in every build.
const char* prefill_attention_wgmma_unsupported(const PrefillParams& params);

#if defined(MOE_HAVE_WGMMA) && MOE_HAVE_WGMMA
// Enqueues the Hopper kernel; the caller has checked the parameters (prefill_attention's checks
// and prefill_attention_wgmma_unsupported) and that the device is compute capability 9.0.
void prefill_attention_wgmma(const PrefillParams& params, cudaStream_t stream);
#endif

}  // namespace moeinfer::cuda
