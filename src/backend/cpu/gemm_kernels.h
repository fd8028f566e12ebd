// Element conversions and GEMV micro-kernels shared by the GEMM paths, each with a portable
// version and an AVX-512 version chosen at run time from cpuid.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace moeinfer::cpu::gemm_detail {

// CPU features, detected once.
bool cpu_has_avx512();       // F, BW, VL (and the OS saves the zmm state)
bool cpu_has_avx512_bf16();  // the above plus AVX512_BF16 (vdpbf16ps, vcvtne2ps2bf16)

// dst[i] = src[i] rounded to bf16, round to nearest even.
void round_to_bf16(const float* src, uint16_t* dst, int64_t n);
// dst[i] = src[i] rounded to f16.
void round_to_f16(const float* src, uint16_t* dst, int64_t n);
// dst[i] = float(src[i]) for a F32, BF16 or F16 source.
void widen_to_f32(DType dtype, const void* src, float* dst, int64_t n);

// AVX-512 kernels (gemm_avx512.cpp); call only when the matching cpu_has_* is true.
// y[m, n] = sum_k x[m, k] * w[n, k] for m < num_rows, n in [n_begin, n_end), row strides
// ldx (x, elements) / ldw (w, elements) / ldy (y). bias may be null.
// BF16: xb holds x already rounded to bf16 ([num_rows, ldx]).
void gemv_bf16_avx512(const uint16_t* xb, int64_t ldx, int64_t num_rows, const uint16_t* w,
                      int64_t ldw, int64_t k, int64_t n_begin, int64_t n_end, const float* bias,
                      float* y, int64_t ldy);
// F16: x is float32.
void gemv_f16_avx512(const float* x, int64_t ldx, int64_t num_rows, const uint16_t* w, int64_t ldw,
                     int64_t k, int64_t n_begin, int64_t n_end, const float* bias, float* y,
                     int64_t ldy);
void round_to_bf16_avx512(const float* src, uint16_t* dst, int64_t n);
void widen_bf16_avx512(const uint16_t* src, float* dst, int64_t n);
void widen_f16_avx512(const uint16_t* src, float* dst, int64_t n);

}  // namespace moeinfer::cpu::gemm_detail
