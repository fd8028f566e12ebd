// Matrix products of float32 activations with checkpoint weights in their stored dtype.
// Weights are never copied to float32 as a whole: bf16 and f16 stay as they are in the map.
#pragma once

#include <cstdint>
#include <span>

#include "core/tensor.h"

namespace moeinfer::cpu {

// y[T, N] = x[T, K] . W[N, K]^T (+ bias[N] when bias is not null).
// W: a 2-D checkpoint tensor in F32, BF16 or F16. x and y are row-major float32 and must not
// overlap. BF16 weights: the activations may be rounded to bf16 before the multiply (products
// are accumulated in float32), as a tensor-core kernel does. Safe to call from several threads
// at once. Paths, threading and measured speed: gemm.cpp and bench/RESULTS.md.
void linear(const float* x, int64_t num_rows, const TensorView& weight, const float* bias,
            float* y);

// One product of a group: y[T, N] = x[T, K] . W[N, K]^T (+ bias[N]).
struct LinearProblem {
  const float* x = nullptr;     // [T, K]
  int64_t num_rows = 0;         // T; zero rows are allowed and cost nothing
  TensorView weight;            // [N, K], F32 / BF16 / F16
  const float* bias = nullptr;  // [N] or null
  float* y = nullptr;           // [T, N]
};

// Runs every product of the group in one parallel region: the workers take (product, slice of
// N) items from a shared counter, so many small products (the selected experts of an MoE layer)
// keep every core streaming, with no barrier after each product. Each result is what linear()
// gives for that product. Products must not write to each other's y or read another's y as x.
void linear_grouped(std::span<const LinearProblem> problems);

// A float32 weight kept as two bf16 terms (hi, and lo = the rest: the GPU's weight_terms = 2):
// out[i] = float(hi[i]) + float(lo[i]) for i in [0, n), spread over the GEMM workers in chunks
// (the values the serial sum gives, bit for bit). Safe from any thread, like linear(): a call
// that finds the workers busy runs on its own thread.
void widen_bf16_terms(const uint16_t* hi, const uint16_t* lo, int64_t n, float* out);

// Batch-invariant products (`--deterministic`): every product takes the per-row GEMV path,
// whatever its row count (AVX-512 for bf16/f16 where the CPU has it, the portable one
// otherwise, float32 included), so a row's result never depends on which other rows share the
// call: a token's logits are the same alone, batched, chunked or recomputed after preemption.
// Slower for many rows (the weights are read once per 4 rows instead of once per call).
// Process-wide, set once before the first product.
void set_batch_invariant(bool on);
bool batch_invariant();

}  // namespace moeinfer::cpu
