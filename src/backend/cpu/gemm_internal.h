// The paths behind cpu::linear(), exposed so that tests can check each one and benchmarks can
// compare them. The engine calls linear() only.
//
// Every path computes y[T, N] = x[T, K] . W[N, K]^T (+ bias[N]) with float32 accumulation.
// Paths marked "rounds x" first round the activations to the weight's 16-bit type (as a GPU
// tensor-core kernel would); the others multiply the float32 activations by the exactly
// widened weights.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace moeinfer::cpu::gemm_detail {

enum class Path {
  kSgemm,       // F32 weights: cblas_sgemm / sgemv per slice of N
  kDnnl,        // BF16 (F16) weights: oneDNN matmul, runtime row count, per slice of N; rounds x
  kGemv,        // BF16/F16 weights, few rows: hand-written AVX-512 kernel; BF16 rounds x
  kGemvScalar,  // BF16/F16 weights, few rows: portable C++ kernel
  kBlockedF32,  // BF16/F16 weights: rows of W widened to float32 in blocks, sgemm per block
};
const char* path_name(Path path);

// The path linear() takes for these arguments on this machine.
Path choose_path(DType dtype, int64_t num_rows, int64_t in_features, int64_t out_features,
                 bool has_bias);

// Largest row count that takes the GEMV path.
int64_t gemv_max_rows(DType dtype);

void linear_sgemm(const float* x, int64_t num_rows, const TensorView& weight, const float* bias,
                  float* y);
// Returns false (and writes nothing) when oneDNN is absent or has no primitive for this dtype on
// this CPU.
bool linear_dnnl(const float* x, int64_t num_rows, const TensorView& weight, const float* bias,
                 float* y);
bool dnnl_available(DType dtype);
// linear_dnnl splits N over our workers and runs oneDNN single-threaded in each; this variant
// makes one call with an OpenMP team of gemm_num_threads() instead (kept for the benchmarks).
bool linear_dnnl_openmp(const float* x, int64_t num_rows, const TensorView& weight,
                        const float* bias, float* y);
// Returns false when the CPU lacks the instructions the kernel needs for this dtype.
bool linear_gemv_avx512(const float* x, int64_t num_rows, const TensorView& weight,
                        const float* bias, float* y);
bool gemv_avx512_available(DType dtype);
void linear_gemv_scalar(const float* x, int64_t num_rows, const TensorView& weight,
                        const float* bias, float* y);
void linear_blocked_f32(const float* x, int64_t num_rows, const TensorView& weight,
                        const float* bias, float* y);

// True when MOE_GEMM_FALLBACK=1 (read once) or set_force_fallback(true): linear() then uses only
// the portable paths (sgemm, the blocked float32 fallback, the scalar GEMV).
bool force_fallback();
void set_force_fallback(bool on);  // for tests and benchmarks

}  // namespace moeinfer::cpu::gemm_detail
