// Internal interface between grouped_gemm.cu and the Hopper grouped GEMM
// (grouped_gemm_wgmma_kernel.cuh), whose launcher sm90/grouped_gemm_wgmma.cu is built for sm_90a
// only, and only when CMAKE_CUDA_ARCHITECTURES includes 90 (then MOE_HAVE_WGMMA is defined for
// grouped_gemm.cu). Callers go through grouped_gemm() with GemmTile::kHopperWgmma or kAuto.
#pragma once

#include <cuda_runtime_api.h>

#include "backend/cuda/grouped_gemm.h"

namespace moeinfer::cuda {

// Why the Hopper kernel cannot run these parameters (shapes and options, not the device), or
// null when it can. Defined in grouped_gemm.cu, so it exists in every build.
const char* grouped_gemm_wgmma_unsupported(const GroupedGemmParams& params);

#if defined(MOE_HAVE_WGMMA) && MOE_HAVE_WGMMA
// Enqueues the Hopper kernel; the caller has checked the parameters (grouped_gemm's checks and
// grouped_gemm_wgmma_unsupported) and that the device is compute capability 9.0.
void grouped_gemm_wgmma(const GroupedGemmParams& params, cudaStream_t stream);
#endif

}  // namespace moeinfer::cuda
