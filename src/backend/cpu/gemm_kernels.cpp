// Portable element conversions, CPU feature detection and the run-time choice between the
// portable and the AVX-512 versions (gemm_avx512.cpp).
#include "backend/cpu/gemm_kernels.h"

namespace moeinfer::cpu::gemm_detail {

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MOE_GEMM_X86 1
#endif

bool cpu_has_avx512() {
#if defined(MOE_GEMM_X86)
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return has;
#else
  return false;
#endif
}

bool cpu_has_avx512_bf16() {
#if defined(MOE_GEMM_X86)
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

void round_to_bf16(const float* src, uint16_t* dst, int64_t n) {
#if defined(MOE_GEMM_X86)
  if (cpu_has_avx512_bf16()) return round_to_bf16_avx512(src, dst, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

void round_to_f16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}

void widen_to_f32(DType dtype, const void* src, float* dst, int64_t n) {
#if defined(MOE_GEMM_X86)
  if (cpu_has_avx512()) {
    if (dtype == DType::kBF16) return widen_bf16_avx512(static_cast<const uint16_t*>(src), dst, n);
    if (dtype == DType::kF16) return widen_f16_avx512(static_cast<const uint16_t*>(src), dst, n);
  }
#endif
  convert_to_f32(dtype, src, dst, static_cast<size_t>(n));
}

}  // namespace moeinfer::cpu::gemm_detail
