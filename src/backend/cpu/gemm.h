// Matrix products of float32 activations with checkpoint weights in their stored dtype.
// Weights are never copied to float32 as a whole: bf16 and f16 stay as they are in the map.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace moeinfer::cpu {

// y[T, N] = x[T, K] . W[N, K]^T (+ bias[N] when bias is not null).
// W: a 2-D checkpoint tensor in F32, BF16 or F16. x and y are row-major float32 and must not
// overlap. BF16 weights: the activations may be rounded to bf16 before the multiply (products
// are accumulated in float32), as a tensor-core kernel does. Safe to call from several threads
// at once. Paths, threading and measured speed: gemm.cpp and bench/RESULTS.md.
void linear(const float* x, int64_t num_rows, const TensorView& weight, const float* bias,
            float* y);

}  // namespace moeinfer::cpu
