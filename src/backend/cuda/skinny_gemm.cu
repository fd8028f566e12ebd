// Launchers of the skinny GEMM (skinny_gemm_kernel.cuh), bf16 and quantised, and of the
// quantised matrix's dequantisation: each checks sizes, strides and pointers, and launches one
// kernel instantiated for the row count (1 to 8) and the weight terms or format, as a
// programmatic dependent of the kernel before it.
#include <algorithm>
#include <cstdint>
#include <limits>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_info.h"
#include "backend/cuda/launch_checks.h"
#include "backend/cuda/programmatic_launch.h"
#include "backend/cuda/skinny_gemm.h"
#include "backend/cuda/skinny_gemm_kernel.cuh"

namespace moeinfer::cuda {

namespace {

// launch.operator()<M>() for M = m, the row count (1 to kSkinnyGemmMaxRows): one kernel
// instantiation per row count.
template <typename Launch>
void with_rows(int64_t m, Launch&& launch) {
  switch (m) {
    case 1:
      return launch.template operator()<1>();
    case 2:
      return launch.template operator()<2>();
    case 3:
      return launch.template operator()<3>();
    case 4:
      return launch.template operator()<4>();
    case 5:
      return launch.template operator()<5>();
    case 6:
      return launch.template operator()<6>();
    case 7:
      return launch.template operator()<7>();
    default:
      return launch.template operator()<8>();
  }
}

// launch.operator()<C>() for C, the output columns a warp owns over n columns (both kernels):
// two halve the blocks, which pays only while every SM keeps two (an O projection of 2048
// columns would otherwise leave each SM one block, 8 warps, to stream from).
template <typename Launch>
void with_columns(int64_t n, Launch&& launch) {
  const int64_t wide_blocks = (n + kSkinnyWarps * 2 - 1) / (kSkinnyWarps * 2);
  if (wide_blocks >= 2 * int64_t{current_multiprocessor_count()}) {
    launch.template operator()<2>();
  } else {
    launch.template operator()<1>();
  }
}

bool is_aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

// Whether [a, a + bytes) and [b, b + bytes) share a byte (null overlaps nothing).
bool overlaps(const void* a, const void* b, int64_t bytes) {
  if (a == nullptr || b == nullptr) return false;
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x < y + static_cast<uintptr_t>(bytes) && y < x + static_cast<uintptr_t>(bytes);
}

// The reason the folded norm of an m x k product cannot run, or null.
const char* normed_input_unsupported(const RmsNormParams& n, const void* x, int64_t m, int64_t k) {
  if (x != nullptr) return "x given with the folded norm (it forms x)";
  if (n.num_rows != m || n.hidden_size != k) return "norm.num_rows, norm.hidden_size not m, k";
  if (m * k * 2 > kSkinnyNormedInputBytes) return "m * k bf16 rows over the folded norm's 46 KiB";
  if (k > kRmsNormMaxHidden) return "k over the folded norm's kRmsNormMaxHidden";
  if (n.mean_width < 0 || n.mean_width > k) return "norm.mean_width outside [0, k]";
  if (!(n.eps >= 0.0f)) return "norm.eps negative";
  if (n.residual == nullptr && n.x == nullptr) return "norm.residual and norm.x both null";
  for (const void* pointer :
       {static_cast<const void*>(n.residual), static_cast<const void*>(n.x),
        static_cast<const void*>(n.x_bias), static_cast<const void*>(n.weight_lo),
        static_cast<const void*>(n.residual_out), static_cast<const void*>(n.out)}) {
    if (!is_aligned16(pointer)) return "a norm pointer not 16-byte aligned";
  }
  if (!is_aligned16(n.weight)) return "norm.weight not 16-byte aligned";
  const int64_t row_bytes = m * k * static_cast<int64_t>(sizeof(float));
  if (overlaps(n.residual_out, n.residual, row_bytes) || overlaps(n.residual_out, n.x, row_bytes)) {
    return "norm.residual_out overlaps norm.residual or norm.x (the blocks read them all)";
  }
  return nullptr;
}

// The reason these parameters cannot run, or null.
const char* unsupported(const SkinnyGemmParams& p) {
  if (p.m < 1 || p.m > kSkinnyGemmMaxRows) return "m outside [1, 8]";
  if (p.n < 1) return "n < 1";
  if (p.k < 8 || p.k % 8 != 0) return "k not a positive multiple of 8";
  const int64_t ldx = p.ldx > 0 ? p.ldx : p.k;
  if (ldx < p.k || ldx % 8 != 0) return "ldx not a multiple of 8 at least k";
  const int64_t ldy = p.ldy > 0 ? p.ldy : p.n;
  if (ldy < p.n) return "ldy < n";
  if (p.n * p.k >= std::numeric_limits<int32_t>::max()) return "n * k of 2^31 or more";
  if (p.norm.weight != nullptr) {
    if (const char* reason = normed_input_unsupported(p.norm, p.x, p.m, p.k)) return reason;
  } else if (p.x == nullptr || !is_aligned16(p.x)) {
    return "x null or not 16-byte aligned";
  }
  if (p.w == nullptr || !is_aligned16(p.w)) return "w null or not 16-byte aligned";
  if (!is_aligned16(p.w_lo)) return "w_lo not 16-byte aligned";
  if (p.y == nullptr) return "y null";
  return nullptr;
}

// The dynamic shared memory of a launch: the folded norm's rows.
template <typename Params>
size_t normed_rows_bytes(const Params& p) {
  return p.norm.weight != nullptr ? static_cast<size_t>(p.m * p.k * 2) : 0;
}

template <int M, int C>
void launch_columns(const SkinnyGemmParams& p, cudaStream_t stream) {
  const int64_t columns_per_block = kSkinnyWarps * C;
  const dim3 grid(static_cast<unsigned>((p.n + columns_per_block - 1) / columns_per_block));
  const size_t shared = normed_rows_bytes(p);
  auto launch = [&]<bool TwoTerms>() {
    if (shared > 0) {
      launch_after_previous(skinny_gemm_kernel<M, TwoTerms, C, true>, grid, kSkinnyThreads, shared,
                            stream, p);
    } else {
      launch_after_previous(skinny_gemm_kernel<M, TwoTerms, C, false>, grid, kSkinnyThreads, 0,
                            stream, p);
    }
  };
  if (p.w_lo != nullptr) {
    launch.template operator()<true>();
  } else {
    launch.template operator()<false>();
  }
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool skinny_gemm_supports(const SkinnyGemmParams& params) { return unsupported(params) == nullptr; }

void skinny_gemm(const SkinnyGemmParams& params, cudaStream_t stream) {
  const char* reason = unsupported(params);
  MOE_CHECK(reason == nullptr, "skinny_gemm: ", reason, " (m ", params.m, ", n ", params.n, ", k ",
            params.k, ", ldx ", params.ldx, ", ldy ", params.ldy, ")");
  SkinnyGemmParams p = params;
  if (p.ldx == 0) p.ldx = p.k;
  if (p.ldy == 0) p.ldy = p.n;
  p.prefetch_row_bytes = weight_prefetch_bytes();
  with_rows(p.m,
            [&]<int M>() { with_columns(p.n, [&]<int C>() { launch_columns<M, C>(p, stream); }); });
}

namespace {

const char* quant_unsupported(const QuantSkinnyGemmParams& p) {
  if (p.m < 1 || p.m > kSkinnyGemmMaxRows) return "m outside [1, 8]";
  if (p.n < 1) return "n < 1";
  if (p.format != ExpertQuant::kFp8 && p.format != ExpertQuant::kInt4) {
    return "format not fp8 or int4";
  }
  if (p.group < 8 || p.group % 8 != 0) return "group not a positive multiple of 8";
  if (p.format == ExpertQuant::kFp8 && (p.k < 16 || p.k % 16 != 0)) {
    return "k not a positive multiple of 16 (fp8)";
  }
  if (p.format == ExpertQuant::kInt4 && (p.k < 32 || p.k % 32 != 0)) {
    return "k not a positive multiple of 32 (int4)";
  }
  const int64_t ldx = p.ldx > 0 ? p.ldx : p.k;
  if (ldx < p.k || ldx % 8 != 0) return "ldx not a multiple of 8 at least k";
  const int64_t ldy = p.ldy > 0 ? p.ldy : p.n;
  if (ldy < p.n) return "ldy < n";
  if (p.n * p.k >= std::numeric_limits<int32_t>::max()) return "n * k of 2^31 or more";
  if (p.norm.weight != nullptr) {
    if (const char* reason = normed_input_unsupported(p.norm, p.x, p.m, p.k)) return reason;
  } else if (p.x == nullptr || !is_aligned16(p.x)) {
    return "x null or not 16-byte aligned";
  }
  if (p.w == nullptr || !is_aligned16(p.w)) return "w null or not 16-byte aligned";
  if (p.y == nullptr) return "y null";
  return nullptr;
}

template <int M, int C>
void quant_launch_columns(const QuantSkinnyGemmParams& p, cudaStream_t stream) {
  const int64_t columns_per_block = kSkinnyWarps * C;
  const dim3 grid(static_cast<unsigned>((p.n + columns_per_block - 1) / columns_per_block));
  const size_t shared = normed_rows_bytes(p);
  auto launch = [&]<ExpertQuant Q>() {
    if (shared > 0) {
      launch_after_previous(quant_skinny_gemm_kernel<M, Q, C, true>, grid, kSkinnyThreads, shared,
                            stream, p);
    } else {
      launch_after_previous(quant_skinny_gemm_kernel<M, Q, C, false>, grid, kSkinnyThreads, 0,
                            stream, p);
    }
  };
  if (p.format == ExpertQuant::kFp8) {
    launch.template operator()<ExpertQuant::kFp8>();
  } else {
    launch.template operator()<ExpertQuant::kInt4>();
  }
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool quant_skinny_gemm_supports(const QuantSkinnyGemmParams& params) {
  return quant_unsupported(params) == nullptr;
}

void quant_skinny_gemm(const QuantSkinnyGemmParams& params, cudaStream_t stream) {
  const char* reason = quant_unsupported(params);
  MOE_CHECK(reason == nullptr, "quant_skinny_gemm: ", reason, " (",
            expert_quant_name(params.format), ", group ", params.group, ", m ", params.m, ", n ",
            params.n, ", k ", params.k, ", ldx ", params.ldx, ", ldy ", params.ldy, ")");
  QuantSkinnyGemmParams p = params;
  if (p.ldx == 0) p.ldx = p.k;
  if (p.ldy == 0) p.ldy = p.n;
  p.prefetch_row_bytes = weight_prefetch_bytes();
  with_rows(p.m, [&]<int M>() {
    with_columns(p.n, [&]<int C>() { quant_launch_columns<M, C>(p, stream); });
  });
}

void dequantize_matrix(const DequantizeMatrixParams& p, cudaStream_t stream) {
  MOE_CHECK(p.format == ExpertQuant::kFp8 || p.format == ExpertQuant::kInt4,
            "dequantize_matrix: format ", expert_quant_name(p.format), " is not fp8 or int4");
  MOE_CHECK(p.group >= 8 && p.group % 8 == 0, "dequantize_matrix: group ", p.group,
            " is not a positive multiple of 8");
  MOE_CHECK(p.n >= 1 && p.k >= 8 && p.k % 8 == 0 && p.k < (int64_t{1} << 31),
            "dequantize_matrix: n ", p.n, ", k ", p.k,
            " (k must be a positive multiple of 8 below 2^31)");
  MOE_CHECK(p.n * p.k < (int64_t{1} << 40), "dequantize_matrix: n * k = ", p.n * p.k,
            " is 2^40 or more");
  MOE_CHECK(p.w != nullptr && p.out != nullptr && reinterpret_cast<uintptr_t>(p.w) % 16 == 0 &&
                reinterpret_cast<uintptr_t>(p.out) % 16 == 0,
            "dequantize_matrix: w or out null or not 16-byte aligned");
  // A block per row at a time, a thread per 8 values of it (a projection's row of 1024 to 8192
  // values is 128 to 1024 chunks).
  constexpr int kThreads = 256;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(p.n, int64_t{1} << 16)));
  if (p.format == ExpertQuant::kFp8) {
    launch_after_previous(dequantize_matrix_kernel<ExpertQuant::kFp8>, grid, kThreads, 0, stream,
                          p);
  } else {
    launch_after_previous(dequantize_matrix_kernel<ExpertQuant::kInt4>, grid, kThreads, 0, stream,
                          p);
  }
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moeinfer::cuda
