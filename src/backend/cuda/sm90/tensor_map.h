// Host side of the TMA loads of the Hopper kernels (sm90/*.cu): a 2-D bf16 tensor map whose
// boxes are 64 elements (128 bytes) wide and land in shared memory with the 128-byte swizzle
// that wgmma's descriptors (wgmma_primitives.cuh) read. cuTensorMapEncodeTiled is reached
// through the runtime's driver entry point, so nothing links libcuda directly.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime_api.h>

#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"

namespace moeinfer::cuda::wgmma {

// Elements of a box's inner dimension: 128 bytes of bf16, the span of the 128-byte swizzle.
inline constexpr int kBoxInner = 64;

// cuTensorMapEncodeTiled, looked up once.
inline PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* pointer = nullptr;
    cudaDriverEntryPointQueryResult status{};
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &pointer, 12000,
                                                cudaEnableDefault, &status));
    MOE_CHECK(status == cudaDriverEntryPointSuccess && pointer != nullptr,
              "the CUDA driver has no cuTensorMapEncodeTiled (status ", static_cast<int>(status),
              "); the Hopper kernels need a driver of CUDA 12.0 or later");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(pointer);
  }();
  return fn;
}

// A [outer, inner] row-major bf16 matrix read in boxes of 64 (inner, 128 bytes) x box_rows,
// written to shared memory with the 128-byte swizzle. Boxes reaching past the matrix read
// zeros.
inline CUtensorMap tensor_map(const void* base, int64_t inner, int64_t outer, int box_rows,
                              const char* what) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(inner) * 2};  // bytes, of dim 1
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kBoxInner), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result = encode_tiled()(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MOE_CHECK(result == CUDA_SUCCESS, "cuTensorMapEncodeTiled refused the ", what, " map (error ",
            static_cast<int>(result), ", [", outer, ", ", inner, "] bf16 at ", base, ", box ",
            box_rows, " rows)");
  return map;
}

}  // namespace moeinfer::cuda::wgmma
