// Facts about the current CUDA device that launchers choose kernels and grid sizes by, each asked
// of the driver once per device (a mutex, not the driver, on every later call).
#pragma once

namespace moeinfer::cuda {

// The current device's compute capability as major * 10 + minor (90 for H100 and H200).
int current_compute_capability();

// The current device's streaming multiprocessors.
int current_multiprocessor_count();

}  // namespace moeinfer::cuda
