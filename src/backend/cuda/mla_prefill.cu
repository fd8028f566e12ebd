// Launcher of MLA prefill attention (mla_prefill_kernel.cuh): argument checks naming the bad
// value, the head tiling and work list shared with the decoder, and the launch over bf16 or
// fp8 rows.
#include <algorithm>
#include <cmath>

#include "backend/cuda/attention.h"  // plan_paged_prefill_tiles: the same work list
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch_checks.h"
#include "backend/cuda/mla_attention.h"
#include "backend/cuda/mla_prefill_kernel.cuh"

namespace moeinfer::cuda {

namespace {

static_assert(kMlaPrefillTileRows == kPagedPrefillTileRows,
              "plan_mla_prefill_tiles reuses the paged prefill plan over 64-row tiles");
static_assert(kMlaPrefillMaxLatentDim <= kMlaMaxLatentDim &&
                  kMlaPrefillMaxCacheWidth <= kMlaMaxCacheWidth,
              "the prefill kernel's rows are rows the register-resident decode kernel takes");
static_assert(mla::prefill_smem_bytes(static_cast<int>(kMlaPrefillMaxCacheWidth)) <= 227 * 1024,
              "the widest row's shared memory exceeds an H100 / H200 block's");

bool prefill_kv_fp8(const MlaPrefillParams& p) {
  return p.latent_codes || p.rope_codes || p.latent_scales || p.rope_scales;
}

void check_prefill_rows(const MlaPrefillParams& p) {
  if (prefill_kv_fp8(p)) {
    MOE_CHECK(!p.cache, "cache (bf16 rows) and latent_codes / rope_codes (fp8 rows) are exclusive");
    detail::check_pointer(p.latent_codes, "latent_codes");
    detail::check_pointer(p.rope_codes, "rope_codes");
    detail::check_pointer(p.latent_scales, "latent_scales");
    detail::check_pointer(p.rope_scales, "rope_scales");
    // Rows of L and R codes (multiples of 8) are read 8 codes at a time.
    MOE_CHECK(reinterpret_cast<uintptr_t>(p.latent_codes) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(p.rope_codes) % 8 == 0,
              "latent_codes / rope_codes are not 8-byte aligned");
    MOE_CHECK(reinterpret_cast<uintptr_t>(p.latent_scales) % 4 == 0 &&
                  reinterpret_cast<uintptr_t>(p.rope_scales) % 4 == 0,
              "latent_scales / rope_scales are not float-aligned");
  } else {
    detail::check_pointer(p.cache, "cache");
    detail::check_aligned16(p.cache, "cache");
  }
}

void check_mla_prefill(const MlaPrefillParams& p) {
  MOE_CHECK(mla_prefill_supports(p.latent_dim, p.rope_dim), "latent_dim = ", p.latent_dim,
            ", rope_dim = ", p.rope_dim,
            " must be positive multiples of 8 with latent_dim <= ", kMlaPrefillMaxLatentDim,
            " and latent_dim + rope_dim <= ", kMlaPrefillMaxCacheWidth,
            " (wider rows take mla_decode_attention a query at a time)");
  MOE_CHECK(p.num_heads >= 1 && p.num_heads <= 65535, "num_heads = ", p.num_heads,
            " must be in [1, 65535]");
  detail::check_int32_range(p.num_tokens, "num_tokens");
  MOE_CHECK(p.num_seqs >= 0 && p.num_seqs <= p.num_tokens, "num_seqs = ", p.num_seqs,
            " must be in [0, num_tokens = ", p.num_tokens, "] (every sequence brings a token)");
  // Every tile holds at least one query (of its own sequence).
  MOE_CHECK(p.num_tiles >= 0 && p.num_tiles <= p.num_tokens, "num_tiles = ", p.num_tiles,
            " must be in [0, num_tokens = ", p.num_tokens, "]");
  MOE_CHECK(p.num_tokens == 0 || p.num_tiles >= 1, "num_tiles = ", p.num_tiles,
            " must be at least 1 for ", p.num_tokens, " tokens");
  MOE_CHECK(p.block_size >= 1, "block_size = ", p.block_size, " must be at least 1");
  MOE_CHECK(p.num_blocks >= 1, "num_blocks = ", p.num_blocks, " must be at least 1");
  MOE_CHECK(p.max_blocks_per_seq >= 0, "max_blocks_per_seq = ", p.max_blocks_per_seq,
            " must not be negative");
  MOE_CHECK(p.max_seq_len >= 0 && p.max_seq_len <= p.max_blocks_per_seq * p.block_size,
            "max_seq_len = ", p.max_seq_len,
            " does not fit max_blocks_per_seq = ", p.max_blocks_per_seq, " blocks of ",
            p.block_size);
  detail::check_int32_range(p.max_seq_len, "max_seq_len");
  detail::check_int32_range(p.num_blocks * p.block_size, "num_blocks * block_size");
  detail::check_int32_range(p.num_tokens * p.num_heads, "num_tokens * num_heads");
  MOE_CHECK(p.scale > 0.0f && std::isfinite(p.scale), "scale = ", p.scale,
            " must be positive and finite");
}

}  // namespace

bool mla_prefill_supports(int64_t latent_dim, int64_t rope_dim) {
  return latent_dim > 0 && latent_dim % 8 == 0 && rope_dim > 0 && rope_dim % 8 == 0 &&
         latent_dim <= kMlaPrefillMaxLatentDim && latent_dim + rope_dim <= kMlaPrefillMaxCacheWidth;
}

MlaPrefillTiling mla_prefill_tiling(int64_t num_heads) {
  MOE_CHECK(num_heads >= 1, "num_heads = ", num_heads, " must be at least 1");
  const int64_t head_tiles = (num_heads + kMlaPrefillTileRows - 1) / kMlaPrefillTileRows;
  const int64_t heads_per_tile = (num_heads + head_tiles - 1) / head_tiles;
  return MlaPrefillTiling{.heads_per_tile = heads_per_tile,
                          .head_tiles = head_tiles,
                          .queries_per_tile = kMlaPrefillTileRows / heads_per_tile};
}

int64_t plan_mla_prefill_tiles(const int32_t* cu_seqlens, int64_t num_seqs, int64_t num_heads,
                               int32_t* tile_starts) {
  // A tile of Gt heads is a GQA group of Gt in the paged kernel's plan: 64 / Gt queries.
  return plan_paged_prefill_tiles(cu_seqlens, num_seqs,
                                  mla_prefill_tiling(num_heads).heads_per_tile, tile_starts);
}

void mla_prefill_attention(const MlaPrefillParams& p, cudaStream_t stream) {
  NvtxRange range("mla_prefill_attention");
  check_mla_prefill(p);
  if (p.num_tokens == 0 || p.num_seqs == 0) return;
  detail::check_pointer(p.q, "q");
  detail::check_aligned16(p.q, "q");
  check_prefill_rows(p);
  detail::check_pointer(p.cu_seqlens, "cu_seqlens");
  detail::check_pointer(p.seq_lens, "seq_lens");
  detail::check_pointer(p.tile_starts, "tile_starts");
  detail::check_pointer(p.block_tables, "block_tables");
  detail::check_pointer(p.out, "out");
  detail::check_aligned16(p.out, "out");

  static const bool attributes_set = [] {
    for (auto kernel : {mla_prefill_kernel<false>, mla_prefill_kernel<true>}) {
      CUDA_CHECK(cudaFuncSetAttribute(
          kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
          mla::prefill_smem_bytes(static_cast<int>(kMlaPrefillMaxCacheWidth))));
    }
    return true;
  }();
  (void)attributes_set;
  const MlaPrefillTiling tiling = mla_prefill_tiling(p.num_heads);
  const int width = static_cast<int>(p.latent_dim + p.rope_dim);
  const dim3 grid(static_cast<unsigned>(p.num_tiles), static_cast<unsigned>(tiling.head_tiles));
  auto kernel = prefill_kv_fp8(p) ? mla_prefill_kernel<true> : mla_prefill_kernel<false>;
  kernel<<<grid, mla::kPrefillThreads, mla::prefill_smem_bytes(width), stream>>>(
      p, static_cast<int>(tiling.heads_per_tile));
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moeinfer::cuda
