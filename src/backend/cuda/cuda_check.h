// Error macros of the CUDA backend, one per layer that can fail, as the rest of the engine does
// it: each throws moeinfer::Error carrying the caller's file and line and the library's own
// error name and string, so a failure reads "cudaErrorInvalidValue: invalid argument (in
// cudaMemcpyAsync(...))" rather than a bare number.
//
// - CUDA_CHECK(expr): expr returns cudaError_t (runtime API calls, cudaGetLastError()).
// - CUBLAS_CHECK(expr): expr returns cublasStatus_t.
// - MOE_CUDA_CHECK_LAUNCH(): after a kernel launch, reports a bad configuration at once.
// - MOE_DEVICE_CHECK(cond): in device code, for contract violations the host cannot see (an
//   expert id out of range inside a kernel): prints the condition and location, then traps,
//   which makes the next host call on the stream fail with cudaErrorLaunchFailure.
// - NvtxRange: an NVTX range for the duration of a scope, opened by every launcher.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <nvtx3/nvToolsExt.h>

#include <source_location>

#include "core/error.h"

namespace moeinfer::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t status, const char* expr,
                                          std::source_location where) {
  ::moeinfer::detail::throw_error(where, cudaGetErrorName(status), ": ", cudaGetErrorString(status),
                                  " (in ", expr, ")");
}

[[noreturn]] inline void throw_cublas_error(cublasStatus_t status, const char* expr,
                                            std::source_location where) {
  ::moeinfer::detail::throw_error(where, cublasGetStatusName(status), ": ",
                                  cublasGetStatusString(status), " (in ", expr, ")");
}

class NvtxRange {
 public:
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace moeinfer::cuda

#define CUDA_CHECK(expr)                                                   \
  do {                                                                     \
    const cudaError_t moe_cuda_status_ = (expr);                           \
    if (moe_cuda_status_ != cudaSuccess) [[unlikely]]                      \
      ::moeinfer::cuda::throw_cuda_error(moe_cuda_status_, #expr,          \
                                         std::source_location::current()); \
  } while (0)

#define CUBLAS_CHECK(expr)                                                   \
  do {                                                                       \
    const cublasStatus_t moe_cublas_status_ = (expr);                        \
    if (moe_cublas_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]            \
      ::moeinfer::cuda::throw_cublas_error(moe_cublas_status_, #expr,        \
                                           std::source_location::current()); \
  } while (0)

#define MOE_CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

#if defined(__CUDACC__)
#define MOE_DEVICE_CHECK(cond)                                                                    \
  do {                                                                                            \
    if (!(cond)) {                                                                                \
      printf("%s:%d: device check failed: %s (block %d, thread %d)\n", __FILE__, __LINE__, #cond, \
             static_cast<int>(blockIdx.x), static_cast<int>(threadIdx.x));                        \
      __trap();                                                                                   \
    }                                                                                             \
  } while (0)
#endif
