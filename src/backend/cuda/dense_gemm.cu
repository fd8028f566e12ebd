// Launcher of the fixed-order dense GEMM (dense_gemm_kernel.cuh): checks sizes, strides and
// pointers, picks the tile by M (which changes no bit of the result) and launches once. Two
// instantiations: the 16-row decode tile and the 64 x 128 prefill tile.
#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/dense_gemm.h"
#include "backend/cuda/dense_gemm_kernel.cuh"
#include "backend/cuda/launch_checks.h"

namespace moeinfer::cuda {

namespace {

// 16 x 32, four warps of 8 columns, k-tiles of 64 in 4 stages: at one row a block streams 32
// weight rows, so a 2048-wide projection has N / 32 blocks to spread over the SMs.
using Rows16 = dense::TileConfig<16, 32, 1, 4, 64, 4>;
// 64 x 128, 2 x 2 warps of 32 x 64, k-tiles of 32 in 3 stages (45 KB).
using Rows64 = dense::TileConfig<64, 128, 2, 2, 32, 3>;

template <class Cfg>
void launch(const DenseGemmParams& p, cudaStream_t stream) {
  static const bool attribute_set = [] {
    CUDA_CHECK(cudaFuncSetAttribute(dense_gemm_kernel<Cfg>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
    return true;
  }();
  (void)attribute_set;
  const int64_t row_tiles = (p.m + Cfg::BM - 1) / Cfg::BM;
  MOE_CHECK(row_tiles <= 65535, "m = ", p.m, " needs ", row_tiles, " row tiles of ", Cfg::BM,
            ", over the grid's 65535");
  const dim3 grid(static_cast<unsigned>((p.n + Cfg::BN - 1) / Cfg::BN),
                  static_cast<unsigned>(row_tiles), static_cast<unsigned>(p.batch));
  dense_gemm_kernel<Cfg><<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

DenseTile dense_gemm_auto_tile(int64_t m) {
  return m <= 16 ? DenseTile::kRows16 : DenseTile::kRows64;
}

void dense_gemm(const DenseGemmParams& args, cudaStream_t stream) {
  NvtxRange range("dense_gemm");
  DenseGemmParams p = args;
  const bool kn = p.b_layout == DenseLayout::kKN;
  MOE_CHECK(p.b_layout == DenseLayout::kNK || kn, "b_layout ", static_cast<int>(p.b_layout),
            " is not kNK or kKN");
  MOE_CHECK(p.m >= 0, "m = ", p.m, " must not be negative");
  MOE_CHECK(p.n >= 1 && p.k >= 1, "n = ", p.n, " and k = ", p.k, " must be positive");
  detail::check_int32_range(p.m, "m");
  detail::check_int32_range(p.n, "n");
  detail::check_int32_range(p.k, "k");
  MOE_CHECK(p.batch >= 1 && p.batch <= 65535, "batch = ", p.batch, " must be in [1, 65535]");
  if (p.lda == 0) p.lda = p.k;
  if (p.ldb == 0) p.ldb = kn ? p.n : p.k;
  if (p.ldc == 0) p.ldc = p.n;
  MOE_CHECK(p.lda >= p.k, "lda = ", p.lda, " is below k = ", p.k);
  MOE_CHECK(p.ldb >= (kn ? p.n : p.k), "ldb = ", p.ldb, " is below ",
            kn ? "n = " : "k = ", kn ? p.n : p.k);
  MOE_CHECK(p.ldc >= p.n, "ldc = ", p.ldc, " is below n = ", p.n);
  MOE_CHECK(p.batch_stride_a >= 0 && p.batch_stride_b >= 0 && p.batch_stride_c >= 0,
            "batch strides must not be negative");
  MOE_CHECK(
      p.tile == DenseTile::kAuto || p.tile == DenseTile::kRows16 || p.tile == DenseTile::kRows64,
      "tile ", static_cast<int>(p.tile), " is not kAuto, kRows16 or kRows64");
  if (p.m == 0) return;
  detail::check_pointer(p.a, "a");
  detail::check_pointer(p.b, "b");
  MOE_CHECK(reinterpret_cast<uintptr_t>(p.b_lo) % 2 == 0, "b_lo must be 2-byte aligned (bf16)");
  detail::check_pointer(p.c, "c");
  MOE_CHECK(reinterpret_cast<uintptr_t>(p.a) % 2 == 0 && reinterpret_cast<uintptr_t>(p.b) % 2 == 0,
            "a and b must be 2-byte aligned (bf16)");
  MOE_CHECK(reinterpret_cast<uintptr_t>(p.c) % (p.c_f32 ? 4 : 2) == 0, "c (",
            static_cast<const void*>(p.c), ") is not aligned to its element");
  const DenseTile tile = p.tile == DenseTile::kAuto ? dense_gemm_auto_tile(p.m) : p.tile;
  if (tile == DenseTile::kRows16) {
    launch<Rows16>(p, stream);
  } else {
    launch<Rows64>(p, stream);
  }
}

}  // namespace moeinfer::cuda
