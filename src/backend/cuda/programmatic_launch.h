// Programmatic dependent launch (Hopper): a kernel launched by launch_after_previous() may be
// scheduled while the kernel before it on the stream is still running, so that its launch and
// block start-up overlap that kernel's tail instead of following it. At decode, where each kernel
// runs a few microseconds, that gap is a large part of the step.
//
// The contract, for every kernel launched this way: it calls device::wait_for_previous_grid()
// (device_utils.cuh) before its first access to global memory, which returns once the previous
// kernel has finished and its writes are visible; it then calls device::allow_next_grid() so
// that the kernel after it may be scheduled early in turn. Because each kernel waits before it
// lets the next one start, at most one kernel runs ahead of its predecessor, and every access
// after the wait sees everything the stream did before. The same kernel launched normally (or on
// a GPU before Hopper) runs as before: both calls are then no-ops.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "backend/cuda/cuda_check.h"

namespace moeinfer::cuda {

// Whether launch_after_previous() asks for programmatic dependent launch: on by default where
// the device has compute capability 9.0 or newer; set_programmatic_launch(false) turns it off.
// Process-wide and read at each launch: the decoder sets it from its GpuOptions before each
// step, so two decoders of one process may differ.
void set_programmatic_launch(bool on);
bool programmatic_launch();

// How many bytes of each weight row the decode GEMV kernels (skinny_gemm.h, the grouped skinny
// experts) ask of L2 before they wait for the kernel before them: 0 (the default) none, a row's
// length or more the whole row. Whole rows measured slower at batch 1 (bench/RESULTS.md,
// 2026-12-07). Process-wide and read at each launch, as set_programmatic_launch: the decoder
// sets it before each step.
void set_weight_prefetch_bytes(int64_t bytes);
int64_t weight_prefetch_bytes();

// Whether the next launch on `stream` may be a programmatic dependent: outside a graph capture
// always (after an operation that is not a kernel the launch is a plain one); during a capture
// only when every node it will depend on is a kernel node, so that a profiled graph's event
// node or a routing capture's copy before it keeps a plain edge.
bool follows_kernels_only(cudaStream_t stream);

template <typename... KernelParams, typename... Args>
void launch_after_previous(void (*kernel)(KernelParams...), dim3 grid, dim3 block,
                           size_t shared_bytes, cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed =
      programmatic_launch() && follows_kernels_only(stream) ? 1 : 0;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace moeinfer::cuda
