// MOE_HOST_DEVICE: a function the CPU code and the CUDA kernels share, compiled for both where
// nvcc compiles it and as a plain inline function elsewhere, so that one rule has one copy.
#pragma once

#if defined(__CUDACC__)
#define MOE_HOST_DEVICE __host__ __device__ inline
#else
#define MOE_HOST_DEVICE inline
#endif
