// Facts about the current CUDA device that launchers choose kernels by.
#pragma once

namespace moeinfer::cuda {

// The current device's compute capability as major * 10 + minor (90 for H100 and H200).
int current_compute_capability();

}  // namespace moeinfer::cuda
