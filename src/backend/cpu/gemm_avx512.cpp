// AVX-512 GEMV kernels and conversions for 16-bit weights. Compiled with per-function target
// attributes so that the library needs no -march flag; callers check cpu_has_avx512*() first.
//
// The GEMV streams W once: a tile of NB = 4 rows of W (NB * K * 2 bytes, in L1 for K <= 2048)
// is multiplied by every block of up to MB = 4 activation rows before the next tile is read, so
// W comes from memory once whatever the row count; 16 zmm accumulators, one horizontal sum per
// output. The next tile is prefetched while this one is computed. BF16 uses vdpbf16ps on
// activations pre-rounded to bf16 (32 products per instruction); F16 widens W with vcvtph2ps and
// multiplies float32 activations with FMA.
#include "backend/cpu/gemm_kernels.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#include <immintrin.h>

#include <algorithm>
#include <cstdlib>

#define MOE_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))
#define MOE_TARGET_AVX512_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

namespace moeinfer::cpu::gemm_detail {
namespace {

constexpr int kTileN = 4;  // rows of W per tile
constexpr int kTileM = 4;  // activation rows per pass over a tile

template <int MB, int NB>
MOE_TARGET_AVX512_BF16 inline void bf16_tile(const uint16_t* xb, int64_t ldx, const uint16_t* w,
                                             int64_t ldw, int64_t k, const float* bias, float* y,
                                             int64_t ldy, const uint16_t* prefetch, int pf_phase,
                                             int pf_stride) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t kk = 0;
  int countdown = pf_phase;
  for (; kk + 32 <= k; kk += 32) {
    if (prefetch != nullptr) {
      if (countdown == 0) {
        for (int j = 0; j < kTileN; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(prefetch + j * ldw + kk), _MM_HINT_T0);
        countdown = pf_stride;
      }
      --countdown;
    }
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(w + j * ldw + kk);
    for (int m = 0; m < MB; ++m) {
      const __m512i xv = _mm512_loadu_si512(xb + m * ldx + kk);
      for (int j = 0; j < NB; ++j)
        acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)xv, (__m512bh)wv[j]);
    }
  }
  if (kk < k) {
    const __mmask32 mask = _cvtu32_mask32((1u << (k - kk)) - 1u);
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_epi16(mask, w + j * ldw + kk);
    for (int m = 0; m < MB; ++m) {
      const __m512i xv = _mm512_maskz_loadu_epi16(mask, xb + m * ldx + kk);
      for (int j = 0; j < NB; ++j)
        acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)xv, (__m512bh)wv[j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j)
      y[m * ldy + j] = _mm512_reduce_add_ps(acc[m][j]) + (bias ? bias[j] : 0.0f);
}

template <int MB, int NB>
MOE_TARGET_AVX512 inline void f16_tile(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw,
                                       int64_t k, const float* bias, float* y, int64_t ldy,
                                       const uint16_t* prefetch, int pf_phase, int pf_stride) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t kk = 0;
  int countdown = pf_phase;
  for (; kk + 16 <= k; kk += 16) {
    if (prefetch != nullptr && (kk & 31) == 0) {  // one 64-byte line per row every 32 elements
      if (countdown == 0) {
        for (int j = 0; j < kTileN; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(prefetch + j * ldw + kk), _MM_HINT_T0);
        countdown = pf_stride;
      }
      --countdown;
    }
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j)
      wv[j] =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * ldw + kk)));
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * ldx + kk);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  if (kk < k) {
    const __mmask16 mask = _cvtu32_mask16((1u << (k - kk)) - 1u);
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j)
      wv[j] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, w + j * ldw + kk));
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * ldx + kk);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j)
      y[m * ldy + j] = _mm512_reduce_add_ps(acc[m][j]) + (bias ? bias[j] : 0.0f);
}

}  // namespace

MOE_TARGET_AVX512_BF16 void gemv_bf16_avx512(const uint16_t* xb, int64_t ldx, int64_t num_rows,
                                             const uint16_t* w, int64_t ldw, int64_t k,
                                             int64_t n_begin, int64_t n_end, const float* bias,
                                             float* y, int64_t ldy) {
  auto run = [&]<int NB>(int64_t n) {
    const uint16_t* wt = w + n * ldw;
    const float* bt = bias ? bias + n : nullptr;
    for (int64_t m0 = 0; m0 < num_rows; m0 += kTileM) {
      // While working on this tile, pull the next one into L1: rows of W start new pages (a row
      // is 4 KiB at K = 2048) where the hardware prefetcher stops. With several passes over
      // the tile (more than 4 activation rows) pass p prefetches every passes-th line, so the
      // prefetches spread over the tile's compute instead of bunching in the first pass (a
      // bunch overflows the fill buffers): 1.3x at 16 rows, measured.
      const uint16_t* pf = n + 2 * kTileN <= n_end ? wt + kTileN * ldw : nullptr;
      const int pf_phase = static_cast<int>(m0 / kTileM);
      const int pf_stride = static_cast<int>((num_rows + kTileM - 1) / kTileM);
      const uint16_t* xt = xb + m0 * ldx;
      float* yt = y + m0 * ldy + n;
      switch (std::min<int64_t>(kTileM, num_rows - m0)) {
        case 1:
          bf16_tile<1, NB>(xt, ldx, wt, ldw, k, bt, yt, ldy, pf, pf_phase, pf_stride);
          break;
        case 2:
          bf16_tile<2, NB>(xt, ldx, wt, ldw, k, bt, yt, ldy, pf, pf_phase, pf_stride);
          break;
        case 3:
          bf16_tile<3, NB>(xt, ldx, wt, ldw, k, bt, yt, ldy, pf, pf_phase, pf_stride);
          break;
        default:
          bf16_tile<4, NB>(xt, ldx, wt, ldw, k, bt, yt, ldy, pf, pf_phase, pf_stride);
          break;
      }
    }
  };
  int64_t n = n_begin;
  for (; n + kTileN <= n_end; n += kTileN) run.template operator()<kTileN>(n);
  for (; n < n_end; ++n) run.template operator()<1>(n);
}

MOE_TARGET_AVX512 void gemv_f16_avx512(const float* x, int64_t ldx, int64_t num_rows,
                                       const uint16_t* w, int64_t ldw, int64_t k, int64_t n_begin,
                                       int64_t n_end, const float* bias, float* y, int64_t ldy) {
  auto run = [&]<int NB>(int64_t n) {
    const uint16_t* wt = w + n * ldw;
    const float* bt = bias ? bias + n : nullptr;
    for (int64_t m0 = 0; m0 < num_rows; m0 += kTileM) {
      // While working on this tile, pull the next one into L1: rows of W start new pages (a row
      // is 4 KiB at K = 2048) where the hardware prefetcher stops. With several passes over
      // the tile (more than 4 activation rows) pass p prefetches every passes-th line, so the
      // prefetches spread over the tile's compute instead of bunching in the first pass (a
      // bunch overflows the fill buffers): 1.3x at 16 rows, measured.
      const uint16_t* pf = n + 2 * kTileN <= n_end ? wt + kTileN * ldw : nullptr;
      const int pf_phase = static_cast<int>(m0 / kTileM);
      const int pf_stride = static_cast<int>((num_rows + kTileM - 1) / kTileM);
      const float* xt = x + m0 * ldx;
      float* yt = y + m0 * ldy + n;
      switch (std::min<int64_t>(kTileM, num_rows - m0)) {
        case 1:
          f16_tile<1, NB>(xt, ldx, wt, ldw, k, bt, yt, ldy, pf, pf_phase, pf_stride);
          break;
        case 2:
          f16_tile<2, NB>(xt, ldx, wt, ldw, k, bt, yt, ldy, pf, pf_phase, pf_stride);
          break;
        case 3:
          f16_tile<3, NB>(xt, ldx, wt, ldw, k, bt, yt, ldy, pf, pf_phase, pf_stride);
          break;
        default:
          f16_tile<4, NB>(xt, ldx, wt, ldw, k, bt, yt, ldy, pf, pf_phase, pf_stride);
          break;
      }
    }
  };
  int64_t n = n_begin;
  for (; n + kTileN <= n_end; n += kTileN) run.template operator()<kTileN>(n);
  for (; n < n_end; ++n) run.template operator()<1>(n);
}

MOE_TARGET_AVX512_BF16 void round_to_bf16_avx512(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512bh packed =
        _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
    _mm512_storeu_si512(dst + i, (__m512i)packed);
  }
  for (; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

MOE_TARGET_AVX512 void widen_bf16_avx512(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
  }
  for (; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

MOE_TARGET_AVX512 void widen_f16_avx512(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(
        dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  for (; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}

}  // namespace moeinfer::cpu::gemm_detail

#endif  // x86-64

#if !(defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)))
// Other CPUs never take these paths (cpu_has_avx512*() is false); the stubs keep the link whole.
#include "core/error.h"

namespace moeinfer::cpu::gemm_detail {
void gemv_bf16_avx512(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, int64_t,
                      int64_t, const float*, float*, int64_t) {
  MOE_FAIL("gemv_bf16_avx512 called on a CPU without AVX-512");
}
void gemv_f16_avx512(const float*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, int64_t,
                     int64_t, const float*, float*, int64_t) {
  MOE_FAIL("gemv_f16_avx512 called on a CPU without AVX-512");
}
void round_to_bf16_avx512(const float*, uint16_t*, int64_t) {
  MOE_FAIL("round_to_bf16_avx512 called on a CPU without AVX-512");
}
void widen_bf16_avx512(const uint16_t*, float*, int64_t) {
  MOE_FAIL("widen_bf16_avx512 called on a CPU without AVX-512");
}
void widen_f16_avx512(const uint16_t*, float*, int64_t) {
  MOE_FAIL("widen_f16_avx512 called on a CPU without AVX-512");
}
}  // namespace moeinfer::cpu::gemm_detail
#endif
