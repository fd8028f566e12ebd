// The two floors every GPU performance figure is a ratio to, measured on the device in the same
// run: device-to-device copy bandwidth (bytes read + bytes written per second, the ceiling of a
// memory-bound step) and cuBLAS bf16 GEMM throughput at n^3 (the ceiling of a compute-bound one).
#pragma once

#include <cstdint>

namespace moeinfer::cuda {

// Bytes per second of cudaMemcpyAsync device to device over `bytes`-sized buffers (counting the
// read and the write), best of a few timed repetitions after a warm-up.
double measure_copy_bandwidth(int64_t bytes = int64_t{1} << 30);

// FLOP/s of a bf16 x bf16 -> bf16 GEMM with float32 accumulation at m = n = k = `n`, best of a
// few timed repetitions after a warm-up.
double measure_gemm_flops(int64_t n = 8192);

// Bytes per second of cudaMemcpyAsync from pinned host memory to the device over `bytes`-sized
// buffers (the PCIe ceiling of expert offloading), best of a few timed repetitions.
double measure_host_to_device_bandwidth(int64_t bytes = int64_t{256} << 20);

}  // namespace moeinfer::cuda
