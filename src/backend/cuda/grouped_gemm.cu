// Launcher of the grouped expert GEMM (grouped_gemm_kernel.cuh): checks shapes and alignment,
// picks the tile from host-known sizes, sizes the grid for the worst case and launches once.
// The instantiations are the eight used: four tiles, each plain and with SiLU(gate)*up fused;
// and for quantised weights (fp8, int4, MXFP4) the 16- and 64-row tiles of each, twelve more;
// and fp8 x fp8 on the 16-, 64- and 128-row tiles, six more; and the skinny kernel
// (grouped_skinny_kernel.cuh) for each weight format, plain and gated, eight more. Also the
// activation quantiser that feeds fp8 x fp8, and the predicate that picks it.
#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_info.h"
#include "backend/cuda/fp8_rows_kernel.cuh"
#include "backend/cuda/grouped_gemm.h"
#include "backend/cuda/grouped_gemm_kernel.cuh"
#include "backend/cuda/grouped_gemm_wgmma.h"
#include "backend/cuda/grouped_skinny_kernel.cuh"
#include "backend/cuda/launch_checks.h"
#include "backend/cuda/moe_stages.h"
#include "backend/cuda/programmatic_launch.h"

namespace moeinfer::cuda {

namespace {

// 16 rows x 32 columns, 4 warps side by side: decode, where blocks must be many and narrow.
// Six stages: the tile is small (10 KB a stage with gate/up) and a memory-bound block needs
// bytes in flight, but more stages cost resident blocks: eight measured 8-25% slower than six
// at T = 8 and 64 (bench/RESULTS.md, 2026-11-30), where each block's start-up (the offsets
// scan) is hidden only by other resident blocks.
template <bool G>
using Rows16 = gemm::TileConfig<16, 32, 1, 4, 6, G>;
// 64 x 64, 2 x 2 warps.
template <bool G>
using Rows64 = gemm::TileConfig<64, 64, 2, 2, 4, G>;
// 128 x 128 (64 output columns, 128 weight rows with gate/up), 2 x 4 warps, 3 stages.
template <bool G>
using Rows128 = gemm::TileConfig<128, G ? 64 : 128, 2, 4, 3, G>;
// 128 x 256 (128 output columns with gate/up), 2 x 4 warps of 64 x 64, 3 stages of 48 KB.
template <bool G>
using Rows128Wide = gemm::TileConfig<128, G ? 128 : 256, 2, 4, 3, G>;

// Whether kAuto takes kSkinny (outside batch_invariant): at most one row per expert on average,
// and few rows in all. Measured on an H200
// (bench/RESULTS.md, 2026-12-06, Qwen3-30B-A3B's experts, bench_cuda_moe_layer --tile), the
// skinny kernel beat the 16-row tile at 8 and 16 rows with bf16 weights (T = 1, 2 with top-8)
// and up to 64 with fp8 and int4, whose tile dequantises through shared memory; past that the
// tile's deep cp.async pipeline wins.
bool skinny_rows(int64_t num_rows, int64_t num_experts, ExpertQuant quant) {
  const int64_t most = quant == ExpertQuant::kNone ? 16 : 64;
  return num_rows <= num_experts && num_rows <= most;
}

// Enqueues one grouped-GEMM kernel on `stream`: a programmatic dependent of the kernel before it
// where p.overlap_previous asks (its start-up overlaps that kernel's tail), else a plain launch.
void enqueue(void (*kernel)(GroupedGemmParams), dim3 grid, int threads, int shared_bytes,
             const GroupedGemmParams& p, cudaStream_t stream) {
  if (!p.overlap_previous) {
    kernel<<<grid, threads, shared_bytes, stream>>>(p);
    MOE_CUDA_CHECK_LAUNCH();
    return;
  }
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
}

template <class Cfg, ExpertQuant Q = ExpertQuant::kNone, bool Fp8Mma = false>
void launch(const GroupedGemmParams& p, cudaStream_t stream) {
  MOE_CHECK(p.n % Cfg::BN == 0, "n = ", p.n, " must be a multiple of ", Cfg::BN, " for the ",
            Cfg::BM, "-row tile");
  constexpr int kSmemBytes = Fp8Mma ? Cfg::kFp8SmemBytes : Cfg::kSmemBytes;
  static const bool attribute_set = [] {
    CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_kernel<Cfg, Q, Fp8Mma>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    return true;
  }();
  (void)attribute_set;
  const int64_t touched = std::min(p.num_experts, p.num_rows);
  const int64_t slots = (p.num_rows + touched * (Cfg::BM - 1)) / Cfg::BM;
  // gridDim.y and gridDim.z take 65535 each; slots < 2^31 (num_rows is int32) need z <= 32769.
  const int64_t slots_z = (slots + 65534) / 65535;
  const int64_t slots_y = (slots + slots_z - 1) / slots_z;
  const dim3 grid(static_cast<unsigned>(p.n / Cfg::BN), static_cast<unsigned>(slots_y),
                  static_cast<unsigned>(slots_z));
  enqueue(grouped_gemm_kernel<Cfg, Q, Fp8Mma>, grid, Cfg::kThreads, kSmemBytes, p, stream);
}

template <bool G, ExpertQuant Q>
void launch_skinny(const GroupedGemmParams& params, cudaStream_t stream) {
  GroupedGemmParams p = params;
  p.prefetch_row_bytes = weight_prefetch_bytes();
  const dim3 grid(static_cast<unsigned>(p.n / kGroupedSkinnyColumnsPerBlock),
                  static_cast<unsigned>(p.num_rows));
  if (p.one_row_per_expert) {
    enqueue(grouped_skinny_kernel<G, Q, 1>, grid, kGroupedSkinnyThreads, 0, p, stream);
  } else {
    enqueue(grouped_skinny_kernel<G, Q, kGroupedSkinnyRows>, grid, kGroupedSkinnyThreads, 0, p,
            stream);
  }
}

template <bool G>
void dispatch_skinny(const GroupedGemmParams& p, cudaStream_t stream) {
  switch (p.quant) {
    case ExpertQuant::kNone:
      return launch_skinny<G, ExpertQuant::kNone>(p, stream);
    case ExpertQuant::kFp8:
      return launch_skinny<G, ExpertQuant::kFp8>(p, stream);
    case ExpertQuant::kInt4:
      return launch_skinny<G, ExpertQuant::kInt4>(p, stream);
    case ExpertQuant::kMxfp4:
      return launch_skinny<G, ExpertQuant::kMxfp4>(p, stream);
  }
  MOE_CHECK(false, "quant ", static_cast<int>(p.quant), " is not a weight format");
}

template <bool G>
void dispatch_tile(GemmTile tile, const GroupedGemmParams& p, cudaStream_t stream) {
  switch (tile) {
    case GemmTile::kRows16:
      return launch<Rows16<G>>(p, stream);
    case GemmTile::kRows64:
      return launch<Rows64<G>>(p, stream);
    case GemmTile::kRows128:
      return launch<Rows128<G>>(p, stream);
    case GemmTile::kRows128Wide:
      return launch<Rows128Wide<G>>(p, stream);
    case GemmTile::kAuto:
    case GemmTile::kHopperWgmma:  // launched by grouped_gemm itself
    case GemmTile::kSkinny:
      break;
  }
  MOE_CHECK(false, "unresolved tile ", static_cast<int>(tile));
}

// Quantised weights: the 16-row tile for decode, the 64-row one for everything larger (the
// register-staged weight tile of the 128-row tiles would cost 8 chunks a thread more; prefill
// with quantised experts is not tuned yet).
template <bool G, ExpertQuant Q>
void dispatch_quant_tile(GemmTile tile, const GroupedGemmParams& p, cudaStream_t stream) {
  if (tile == GemmTile::kRows16) return launch<Rows16<G>, Q>(p, stream);
  return launch<Rows64<G>, Q>(p, stream);
}

template <bool G>
void dispatch_quant(GemmTile tile, const GroupedGemmParams& p, cudaStream_t stream) {
  switch (p.quant) {
    case ExpertQuant::kFp8:
      return dispatch_quant_tile<G, ExpertQuant::kFp8>(tile, p, stream);
    case ExpertQuant::kInt4:
      return dispatch_quant_tile<G, ExpertQuant::kInt4>(tile, p, stream);
    case ExpertQuant::kMxfp4:
      return dispatch_quant_tile<G, ExpertQuant::kMxfp4>(tile, p, stream);
    case ExpertQuant::kNone:
      break;
  }
  MOE_CHECK(false, "quant ", static_cast<int>(p.quant), " is not a quantised format");
}

// fp8 x fp8: the 16-row tile where asked for, else the 64-row one, and the 128 x 128 tile for
// both larger tiles (the 128 x 256 tile's 64 x 64 warp tiles would need a second set of 128
// float32 partial sums a thread: past the register file).
template <bool G>
void dispatch_fp8_mma_tile(GemmTile tile, const GroupedGemmParams& p, cudaStream_t stream) {
  switch (tile) {
    case GemmTile::kRows16:
      return launch<Rows16<G>, ExpertQuant::kFp8, true>(p, stream);
    case GemmTile::kRows64:
      return launch<Rows64<G>, ExpertQuant::kFp8, true>(p, stream);
    case GemmTile::kRows128:
    case GemmTile::kRows128Wide:
      return launch<Rows128<G>, ExpertQuant::kFp8, true>(p, stream);
    case GemmTile::kAuto:
    case GemmTile::kHopperWgmma:  // refused by grouped_gemm first
    case GemmTile::kSkinny:
      break;
  }
  MOE_CHECK(false, "unresolved tile ", static_cast<int>(tile));
}

// Whether fp8 x fp8 runs on the current device: compute capability 8.9 (Ada) or later has the
// e4m3 mma, and this build's code for it must come from an architecture that has it too (a
// build for CUDA architectures below 89 compiles the kernel to a trap, mma_fp8); the code the
// runtime loads is the same for every device of one compute capability.
bool device_has_fp8_mma() {
  const int capability = current_compute_capability();
  if (capability < 89) return false;
  static std::mutex mutex;
  static std::map<int, bool> built_for;
  const std::lock_guard lock(mutex);
  if (const auto it = built_for.find(capability); it != built_for.end()) return it->second;
  cudaFuncAttributes attributes{};
  CUDA_CHECK(cudaFuncGetAttributes(
      &attributes, grouped_gemm_kernel<Rows64<false>, ExpertQuant::kFp8, true>));
  return built_for[capability] = attributes.ptxVersion >= 89;
}

// fp8 x fp8's requirements, each refused by name.
void check_fp8_mma(const GroupedGemmParams& p) {
  MOE_CHECK(p.quant == ExpertQuant::kFp8, "act_codes (fp8 x fp8) needs fp8 weights, not ",
            expert_quant_name(p.quant));
  MOE_CHECK(p.quant_group % kFp8ActBlock == 0, "fp8 x fp8 needs weight scale groups of a multiple "
            "of ", kFp8ActBlock, " inputs, not quant_group = ", p.quant_group);
  MOE_CHECK(p.act_scales != nullptr, "act_codes is given but act_scales is null");
  detail::check_aligned16(p.act_codes, "act_codes");
  MOE_CHECK(device_has_fp8_mma(), "fp8 x fp8 needs a GPU of compute capability 8.9 or later "
            "(Ada, Hopper) and a build for such an architecture (CMAKE_CUDA_ARCHITECTURES 89 or "
            "90); run this one with the weight-only path (act_codes null)");
}

// The quantised layout's requirements (expert_quant.h), each refused by name.
void check_quant(const GroupedGemmParams& p) {
  if (p.quant == ExpertQuant::kNone) return;
  MOE_CHECK(p.quant == ExpertQuant::kFp8 || p.quant == ExpertQuant::kInt4 ||
                p.quant == ExpertQuant::kMxfp4,
            "quant ", static_cast<int>(p.quant), " is not kNone, kFp8, kInt4 or kMxfp4");
  MOE_CHECK(p.weight_terms == 1, "quantised weights take one term, not weight_terms = ",
            p.weight_terms);
  if (p.quant == ExpertQuant::kMxfp4) {
    MOE_CHECK(p.quant_group == 32, "MXFP4 scales 32 inputs each, not quant_group = ",
              p.quant_group);
  } else {
    MOE_CHECK(p.quant_group > 0 && p.quant_group % 8 == 0, "quant_group = ", p.quant_group,
              " must be a positive multiple of 8 (one scale per 16-byte chunk)");
  }
  if (p.weights) {
    MOE_CHECK(reinterpret_cast<uintptr_t>(p.weights) % 256 == 0,
              "quantised weights must be 256-byte aligned");
  }
}

#if defined(MOE_HAVE_WGMMA) && MOE_HAVE_WGMMA
// Whether the current device is compute capability 9.0 exactly (H100, H200): the sm_90a code
// of the Hopper kernel runs there and nowhere else.
bool device_is_sm90() { return current_compute_capability() == 90; }
#endif

// Mean rows per expert above which kAuto takes the Hopper kernel: the 128-row tiles' region.
constexpr int64_t kWgmmaMinMeanRows = 160;
// The Hopper kernel keeps the offsets and their prefix sums in shared memory.
constexpr int64_t kWgmmaMaxExperts = 1024;

}  // namespace

const char* grouped_gemm_wgmma_unsupported(const GroupedGemmParams& p) {
  if (p.act_codes != nullptr) return "fp8 x fp8 (act_codes)";
  if (p.quant != ExpertQuant::kNone) return "quantised weights";
  if (p.weights == nullptr || p.expert_weights != nullptr) {
    return "an expert_weights table (TMA reads one [E, Nw, Kd] weights tensor)";
  }
  if (p.weight_terms != 1) return "two weight terms";
  if (p.src_row != nullptr) return "a src_row gather (a gathered A tile is not a TMA box)";
  if (p.num_experts > kWgmmaMaxExperts) return "more than 1024 experts";
  const bool gated = p.epilogue != GemmEpilogue::kNone;
  if (p.n % (gated ? 32 : 64) != 0) {
    return gated ? "n not a multiple of 32 (gated)" : "n not a multiple of 64";
  }
  // TMA coordinates are int32: the weight rows of all experts, [E * Nw].
  if (p.num_experts * (gated ? 2 : 1) * p.n > int64_t{2147483647}) {
    return "E * Nw of 2^31 or more weight rows";
  }
  return nullptr;
}

bool grouped_gemm_wgmma_available() {
#if defined(MOE_HAVE_WGMMA) && MOE_HAVE_WGMMA
  return device_is_sm90();
#else
  return false;
#endif
}

bool grouped_gemm_wgmma_supported(const GroupedGemmParams& p) {
  return grouped_gemm_wgmma_unsupported(p) == nullptr && grouped_gemm_wgmma_available();
}

GemmTile grouped_gemm_tile(const GroupedGemmParams& p) {
  if (p.tile != GemmTile::kAuto) return p.tile;
  if (!p.batch_invariant && p.act_codes == nullptr &&
      skinny_rows(p.num_rows, p.num_experts, p.quant)) {
    return GemmTile::kSkinny;
  }
  const int64_t touched = std::max<int64_t>(1, std::min(p.num_experts, p.num_rows));
  if (!p.batch_invariant && p.num_rows / touched > kWgmmaMinMeanRows &&
      grouped_gemm_wgmma_supported(p)) {
    return GemmTile::kHopperWgmma;
  }
  // The mma.sync tiles see a gated epilogue as kSiluMul (the same weight rows per column).
  return grouped_gemm_auto_tile(
      p.num_rows, p.num_experts, p.n,
      p.epilogue != GemmEpilogue::kNone ? GemmEpilogue::kSiluMul : GemmEpilogue::kNone);
}

// Measured on an H200 (bench/RESULTS.md, 2026-11-30, Qwen3-30B-A3B experts): the 16-row tile
// wins at 1 to 8 mean rows per expert (T = 1 to 64 with top-8 of 128), the 64-row tile at 16
// (T = 256), the 128 x 256 tile at 256 (T = 4096, 8% ahead of 128 x 128).
GemmTile grouped_gemm_auto_tile(int64_t num_rows, int64_t num_experts, int64_t n,
                                GemmEpilogue epilogue) {
  const int64_t touched = std::max<int64_t>(1, std::min(num_experts, num_rows));
  const int64_t mean_rows = num_rows / touched;
  if (mean_rows <= 8 || n % 64 != 0) return GemmTile::kRows16;
  if (mean_rows <= 160 || n % 128 != 0) return GemmTile::kRows64;
  const int64_t wide_n = epilogue == GemmEpilogue::kSiluMul ? 128 : 256;
  return n % wide_n == 0 ? GemmTile::kRows128Wide : GemmTile::kRows128;
}

void grouped_gemm(const GroupedGemmParams& p, cudaStream_t stream) {
  NvtxRange range("experts");
  MOE_CHECK(p.num_experts >= 1 && p.num_experts <= kMaxExperts, "num_experts = ", p.num_experts,
            " must be in [1, ", kMaxExperts, "]");
  detail::check_int32_range(p.num_rows, "num_rows");
  MOE_CHECK(p.k > 0 && p.k % gemm::kBK == 0, "k = ", p.k, " must be a positive multiple of ",
            gemm::kBK);
  MOE_CHECK(p.n > 0 && p.n % 32 == 0, "n = ", p.n, " must be a positive multiple of 32");
  MOE_CHECK(p.epilogue == GemmEpilogue::kNone || p.epilogue == GemmEpilogue::kSiluMul ||
                p.epilogue == GemmEpilogue::kClampedSwiglu,
            "epilogue ", static_cast<int>(p.epilogue), " is not kNone, kSiluMul or kClampedSwiglu");
  const bool gated = p.epilogue != GemmEpilogue::kNone;
  MOE_CHECK(p.weight_terms == 1 || p.weight_terms == 2, "weight_terms = ", p.weight_terms,
            " must be 1 or 2");
  const int64_t weight_rows = gated ? 2 * p.n : p.n;
  detail::check_int32_range(p.num_rows * std::max(p.k, p.n), "num_rows * max(k, n)");
  detail::check_int32_range(p.weight_terms * weight_rows * p.k, "weight rows * k of one expert");
  if (p.num_rows == 0) return;
  const bool fp8_mma = p.act_codes != nullptr;
  if (!fp8_mma) detail::check_pointer(p.rows, "rows");
  MOE_CHECK((p.weights != nullptr) != (p.expert_weights != nullptr),
            "give exactly one of weights and expert_weights");
  detail::check_pointer(p.expert_offsets, "expert_offsets");
  detail::check_pointer(p.out, "out");
  if (!fp8_mma) detail::check_aligned16(p.rows, "rows");
  if (p.weights) detail::check_aligned16(p.weights, "weights");
  detail::check_aligned16(p.out, "out");
  if (p.src_row) {
    MOE_CHECK(p.top_k >= 1 && p.num_rows % p.top_k == 0, "top_k = ", p.top_k,
              " must be positive and divide num_rows = ", p.num_rows, " when gathering");
  }
  if (p.epilogue == GemmEpilogue::kClampedSwiglu) {
    MOE_CHECK(p.swiglu_limit > 0.0f && std::isfinite(p.swiglu_alpha), "swiglu_limit = ",
              p.swiglu_limit, " must be positive and swiglu_alpha = ", p.swiglu_alpha, " finite");
  }
  const GemmTile tile = grouped_gemm_tile(p);
  if (tile == GemmTile::kHopperWgmma) {
    const char* unsupported = grouped_gemm_wgmma_unsupported(p);
    MOE_CHECK(unsupported == nullptr, "tile kHopperWgmma does not support ",
              unsupported == nullptr ? "" : unsupported, " (n = ", p.n, ", num_experts = ",
              p.num_experts, "); use kAuto, which takes an mma.sync tile there");
    MOE_CHECK(grouped_gemm_wgmma_available(),
              "tile kHopperWgmma needs a GPU of compute capability 9.0 (H100, H200) and a build "
              "for CUDA architecture 90 (CMAKE_CUDA_ARCHITECTURES including 90); use kAuto");
#if defined(MOE_HAVE_WGMMA) && MOE_HAVE_WGMMA
    grouped_gemm_wgmma(p, stream);
#endif
    return;
  }
  check_quant(p);
  if (tile == GemmTile::kSkinny) {
    MOE_CHECK(!fp8_mma, "tile kSkinny does not take fp8 x fp8 (act_codes); use kAuto");
    MOE_CHECK(p.num_rows <= 65535,
              "tile kSkinny takes at most 65535 rows, not num_rows = ", p.num_rows, "; use kAuto");
    if (gated) {
      dispatch_skinny<true>(p, stream);
    } else {
      dispatch_skinny<false>(p, stream);
    }
    return;
  }
  if (fp8_mma) {
    check_fp8_mma(p);
    if (gated) {
      dispatch_fp8_mma_tile<true>(tile, p, stream);
    } else {
      dispatch_fp8_mma_tile<false>(tile, p, stream);
    }
    return;
  }
  if (p.quant != ExpertQuant::kNone) {
    if (gated) {
      dispatch_quant<true>(tile, p, stream);
    } else {
      dispatch_quant<false>(tile, p, stream);
    }
    return;
  }
  if (gated) {
    dispatch_tile<true>(tile, p, stream);
  } else {
    dispatch_tile<false>(tile, p, stream);
  }
}

void quantize_rows_fp8(const Fp8RowsParams& p, cudaStream_t stream) {
  NvtxRange range("experts");
  MOE_CHECK(p.k > 0 && p.k % gemm::kBK == 0, "k = ", p.k, " must be a positive multiple of ",
            gemm::kBK);
  detail::check_int32_range(p.num_rows * p.k, "num_rows * k");
  if (p.num_rows == 0) return;
  detail::check_pointer(p.rows, "rows");
  detail::check_pointer(p.codes, "codes");
  detail::check_pointer(p.scales, "scales");
  const int64_t blocks_per_row = (p.k + kFp8ActBlock - 1) / kFp8ActBlock;
  constexpr int64_t kWarps = kFp8RowsThreads / 32;
  const int64_t grid = (p.num_rows * blocks_per_row + kWarps - 1) / kWarps;
  quantize_rows_fp8_kernel<<<static_cast<unsigned>(grid), kFp8RowsThreads, 0, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH();
}

bool fp8_tensor_cores_supported(ExpertQuant quant, int64_t quant_group) {
  return quant == ExpertQuant::kFp8 && quant_group > 0 && quant_group % kFp8ActBlock == 0 &&
         device_has_fp8_mma();
}

bool fp8_tensor_core_experts(ExpertQuant quant, int64_t quant_group, int64_t num_rows,
                             int64_t num_experts) {
  const int64_t touched = std::max<int64_t>(1, std::min(num_experts, num_rows));
  return num_rows / touched >= kFp8MmaMinMeanRows &&
         fp8_tensor_cores_supported(quant, quant_group);
}

void moe_experts(const MoeExpertsParams& p, cudaStream_t stream) {
  NvtxRange range("experts");
  MOE_CHECK(p.gate_up_epilogue == GemmEpilogue::kSiluMul ||
                p.gate_up_epilogue == GemmEpilogue::kClampedSwiglu,
            "gate_up_epilogue ", static_cast<int>(p.gate_up_epilogue),
            " is not kSiluMul or kClampedSwiglu");
  const bool fp8_mma =
      p.fp8_codes != nullptr && p.fp8_scales != nullptr && p.gate_up != nullptr &&
      fp8_tensor_core_experts(p.quant, p.quant_group, p.num_rows, p.num_experts);
  if (fp8_mma) {
    // The gate/up operand: the token rows themselves when gathering ([T, H], T = M / K: each
    // token quantised once, not K times), else the M expert-ordered rows.
    const int64_t operand_rows = p.src_row != nullptr ? p.num_rows / p.top_k : p.num_rows;
    quantize_rows_fp8({.rows = p.rows, .codes = p.fp8_codes, .scales = p.fp8_scales,
                       .num_rows = operand_rows, .k = p.hidden_size},
                      stream);
  }
  // The rows of one token (gathered: M = T * K rows, K distinct experts): one row an expert.
  const bool one_token = p.one_row_blocks && p.src_row != nullptr && p.num_rows <= p.top_k;
  GroupedGemmParams gate_up{.rows = p.rows,
                            .weights = p.gate_up,
                            .expert_weights = p.gate_up_table,
                            .expert_offsets = p.expert_offsets,
                            .out = p.activation,
                            .num_rows = p.num_rows,
                            .num_experts = p.num_experts,
                            .n = p.expert_width,
                            .k = p.hidden_size,
                            .weight_terms = p.weight_terms,
                            .quant = p.quant,
                            .quant_group = p.quant_group,
                            .epilogue = p.gate_up_epilogue,
                            .bias = p.gate_up_bias,
                            .swiglu_alpha = p.swiglu_alpha,
                            .swiglu_limit = p.swiglu_limit,
                            .tile = p.tile,
                            .src_row = p.src_row,
                            .top_k = p.top_k,
                            .act_codes = fp8_mma ? p.fp8_codes : nullptr,
                            .act_scales = fp8_mma ? p.fp8_scales : nullptr,
                            .overlap_previous = fp8_mma,
                            .batch_invariant = p.batch_invariant,
                            .one_row_per_expert = one_token};
  if (p.src_row != nullptr && !fp8_mma) {
    // The Hopper kernel loads whole row tiles (TMA), so it cannot gather: where it would be the
    // choice for the rows in expert order, write them out first, into `out` (the down
    // projection's [M, H] output, free until then). The gather moves M*H bf16 once; the
    // gate/up product it enables is the larger share of the experts' FLOPs.
    GroupedGemmParams gathered = gate_up;
    gathered.rows = p.out;
    gathered.src_row = nullptr;
    gathered.top_k = 1;
    if (grouped_gemm_tile(gathered) == GemmTile::kHopperWgmma) {
      gather_rows({.hidden = p.rows, .src_row = p.src_row, .rows = p.out,
                   .num_rows = p.num_rows, .top_k = p.top_k, .hidden_size = p.hidden_size},
                  stream);
      gate_up = gathered;
    }
  }
  grouped_gemm(gate_up, stream);
  if (fp8_mma) {
    // The down projection's operand: the activation rows the plan holds (expert_offsets[E] of
    // them; the rest are a bucket's padding, never written). The gate/up product has finished
    // reading the codes this overwrites: this launch is not a programmatic dependent.
    quantize_rows_fp8({.rows = p.activation, .codes = p.fp8_codes, .scales = p.fp8_scales,
                       .num_rows = p.num_rows, .k = p.expert_width,
                       .num_valid_rows = p.expert_offsets + p.num_experts},
                      stream);
  }
  grouped_gemm(GroupedGemmParams{.rows = p.activation,
                                 .weights = p.down,
                                 .expert_weights = p.down_table,
                                 .expert_offsets = p.expert_offsets,
                                 .out = p.out,
                                 .num_rows = p.num_rows,
                                 .num_experts = p.num_experts,
                                 .n = p.hidden_size,
                                 .k = p.expert_width,
                                 .weight_terms = p.weight_terms,
                                 .quant = p.quant,
                                 .quant_group = p.quant_group,
                                 .epilogue = GemmEpilogue::kNone,
                                 .bias = p.down_bias,
                                 .tile = p.tile,
                                 .act_codes = fp8_mma ? p.fp8_codes : nullptr,
                                 .act_scales = fp8_mma ? p.fp8_scales : nullptr,
                                 .overlap_previous = true,
                                 .batch_invariant = p.batch_invariant,
                                 .one_row_per_expert = one_token},
               stream);
}

}  // namespace moeinfer::cuda
