// Launcher of the skinny GEMM (skinny_gemm_kernel.cuh): checks sizes, strides and pointers,
// and launches one kernel instantiated for the row count (1 to 8) and the weight terms, as a
// programmatic dependent of the kernel before it.
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
  for (const void* pointer : {static_cast<const void*>(p.x), static_cast<const void*>(p.w)}) {
    if (pointer == nullptr) return "x or w null";
    if (reinterpret_cast<uintptr_t>(pointer) % 16 != 0) return "x or w not 16-byte aligned";
  }
  if (p.w_lo != nullptr && reinterpret_cast<uintptr_t>(p.w_lo) % 16 != 0) {
    return "w_lo not 16-byte aligned";
  }
  if (p.y == nullptr) return "y null";
  return nullptr;
}

template <int M, int C>
void launch_columns(const SkinnyGemmParams& p, cudaStream_t stream) {
  const int64_t columns_per_block = kSkinnyWarps * C;
  const dim3 grid(static_cast<unsigned>((p.n + columns_per_block - 1) / columns_per_block));
  if (p.w_lo != nullptr) {
    launch_after_previous(skinny_gemm_kernel<M, true, C>, grid, kSkinnyThreads, 0, stream, p);
  } else {
    launch_after_previous(skinny_gemm_kernel<M, false, C>, grid, kSkinnyThreads, 0, stream, p);
  }
  MOE_CUDA_CHECK_LAUNCH();
}

// Two columns a warp halve the blocks; that pays only while two blocks per SM remain (an O
// projection of 2048 columns would otherwise leave each SM one block, 8 warps, to stream from).
template <int M>
void launch(const SkinnyGemmParams& p, cudaStream_t stream) {
  const int64_t wide_blocks = (p.n + kSkinnyWarps * 2 - 1) / (kSkinnyWarps * 2);
  if (wide_blocks >= 2 * int64_t{current_multiprocessor_count()}) {
    launch_columns<M, 2>(p, stream);
  } else {
    launch_columns<M, 1>(p, stream);
  }
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
  p.prefetch_weights = weight_prefetch();
  switch (p.m) {
    case 1:
      return launch<1>(p, stream);
    case 2:
      return launch<2>(p, stream);
    case 3:
      return launch<3>(p, stream);
    case 4:
      return launch<4>(p, stream);
    case 5:
      return launch<5>(p, stream);
    case 6:
      return launch<6>(p, stream);
    case 7:
      return launch<7>(p, stream);
    default:
      return launch<8>(p, stream);
  }
}

}  // namespace moeinfer::cuda
