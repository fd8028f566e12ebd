// Launcher of the Hopper grouped GEMM (grouped_gemm_wgmma_kernel.cuh). Built for sm_90a only
// (wgmma and setmaxnreg exist nowhere else; src/CMakeLists.txt compiles this file alone with
// that target): builds the two TMA tensor maps on the host, picks the weight-tile width from N
// and sizes a persistent grid of one CTA per SM. Six instantiations: BNW 256, 128 and 64 weight
// rows, plain and gated.
#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_info.h"
#include "backend/cuda/grouped_gemm.h"
#include "backend/cuda/grouped_gemm_wgmma.h"
#include "backend/cuda/grouped_gemm_wgmma_kernel.cuh"
#include "backend/cuda/sm90/tensor_map.h"

namespace moeinfer::cuda {

namespace {

static_assert(wgmma::kBK == wgmma::kBoxInner, "a k-tile is one TMA box wide");

template <class Cfg>
void launch(const GroupedGemmParams& p, cudaStream_t stream) {
  static const bool attribute_set = [] {
    CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_wgmma_kernel<Cfg>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
    return true;
  }();
  (void)attribute_set;
  const int64_t nw = Cfg::kGated ? 2 * p.n : p.n;
  wgmma::Params kp;
  kp.rows_map = wgmma::tensor_map(p.rows, p.k, p.num_rows, wgmma::kBM, "rows");
  kp.weights_map = wgmma::tensor_map(p.weights, p.k, p.num_experts * nw, Cfg::kHalfRows, "weights");
  kp.expert_offsets = p.expert_offsets;
  kp.out = p.out;
  kp.bias = p.bias;
  kp.num_experts = static_cast<int32_t>(p.num_experts);
  kp.n = static_cast<int32_t>(p.n);
  kp.nw = static_cast<int32_t>(nw);
  kp.k = static_cast<int32_t>(p.k);
  kp.num_n_tiles = static_cast<int32_t>(p.n / Cfg::BN);
  kp.epilogue = p.epilogue;
  kp.swiglu_alpha = p.swiglu_alpha;
  kp.swiglu_limit = p.swiglu_limit;
  // Worst-case tiles (every touched expert's last row tile nearly empty), capped at one CTA
  // per SM: the CTAs walk the device's tile list.
  const int64_t touched = std::min(p.num_experts, p.num_rows);
  const int64_t slots = (p.num_rows + touched * (wgmma::kBM - 1)) / wgmma::kBM;
  const int64_t grid =
      std::max<int64_t>(1, std::min<int64_t>(slots * kp.num_n_tiles, current_multiprocessor_count()));
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(grid));
  config.blockDim = dim3(wgmma::kThreads);
  config.dynamicSmemBytes = Cfg::kSmemBytes;
  config.stream = stream;
  config.attrs = p.overlap_previous ? &attribute : nullptr;
  config.numAttrs = p.overlap_previous ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&config, grouped_gemm_wgmma_kernel<Cfg>, kp));
}

template <bool G>
void dispatch(const GroupedGemmParams& p, cudaStream_t stream) {
  // The widest weight tile whose output columns divide N (see the kernel file's header).
  if (p.n % wgmma::Config<256, G>::BN == 0) return launch<wgmma::Config<256, G>>(p, stream);
  if (p.n % wgmma::Config<128, G>::BN == 0) return launch<wgmma::Config<128, G>>(p, stream);
  return launch<wgmma::Config<64, G>>(p, stream);
}

}  // namespace

void grouped_gemm_wgmma(const GroupedGemmParams& p, cudaStream_t stream) {
  if (p.epilogue == GemmEpilogue::kNone) {
    dispatch<false>(p, stream);
  } else {
    dispatch<true>(p, stream);
  }
}

}  // namespace moeinfer::cuda
