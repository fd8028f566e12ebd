// Launcher of MLA decode attention: argument checks, the split plan, the split kernel and, when
// the plan has several splits, the combine kernel. The split kernel is mla_decode_kernel
// (mla_attention_kernel.cuh: L and R runtime values inside compile-time register maxima, which
// DeepSeek's 512 + 64 fits) up to kMlaMaxLatentDim / kMlaMaxCacheWidth, and past them
// mla_decode_wide_kernel (mla_attention_wide_kernel.cuh: rows streamed in panels, the output in
// slices of 512 dims), which takes any width; both share the plan, workspace and combine kernel.
// Each is instantiated twice: over bf16 rows, and over fp8 rows (kFp8, --kv-dtype fp8) that it
// decodes while loading a tile.
#include <algorithm>
#include <cmath>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch_checks.h"
#include "backend/cuda/mla_attention.h"
#include "backend/cuda/mla_attention_kernel.cuh"
#include "backend/cuda/mla_attention_wide_kernel.cuh"
#include "backend/cuda/programmatic_launch.h"

namespace moeinfer::cuda {

namespace {

// Two blocks of the split kernel fit an SM: enough blocks for two per SM of an H200 (132).
// The plan never has more splits than this, which the combine kernel relies on.
constexpr int64_t kMlaTargetBlocks = 264;
static_assert(kMlaTargetBlocks <= mla::kMaxSplits);
// Combine blocks resident at once on an H200: 132 SMs x 8 blocks of 256 threads.
constexpr int64_t kCombineTargetBlocks = 1056;
// Keys per split come in multiples of two tiles: a split's fixed cost (Q, the workspace row of
// 16 heads x (L + 2) floats) stays below its share of cache bytes.
constexpr int64_t kMlaChunkQuantum = 64;

int64_t head_tiles(const MlaDecodeParams& p) {
  return (std::max<int64_t>(p.num_heads, 0) + mla::kHeads - 1) / mla::kHeads;
}

void check_mla(const MlaDecodeParams& p) {
  MOE_CHECK(p.num_seqs >= 0 && p.num_seqs <= 65535, "num_seqs = ", p.num_seqs,
            " must be in [0, 65535]");
  MOE_CHECK(p.num_heads >= 1 && p.num_heads <= 65535, "num_heads = ", p.num_heads,
            " must be in [1, 65535]");
  MOE_CHECK(p.latent_dim > 0 && p.latent_dim % 8 == 0, "latent_dim = ", p.latent_dim,
            " must be a positive multiple of 8");
  MOE_CHECK(p.rope_dim > 0 && p.rope_dim % 8 == 0, "rope_dim = ", p.rope_dim,
            " must be a positive multiple of 8");
  // The kernels hold L, W and offsets within a row in ints (a row of 2^30 values would take
  // 2 GiB of cache per token and layer).
  MOE_CHECK(p.latent_dim + p.rope_dim <= kMlaMaxRowWidth,
            "latent_dim + rope_dim = ", p.latent_dim + p.rope_dim, " exceeds ", kMlaMaxRowWidth);
  MOE_CHECK(p.block_size >= 1, "block_size = ", p.block_size, " must be at least 1");
  MOE_CHECK(p.num_blocks >= 1, "num_blocks = ", p.num_blocks, " must be at least 1");
  detail::check_int32_range(p.num_blocks, "num_blocks");
  MOE_CHECK(p.max_blocks_per_seq >= 0, "max_blocks_per_seq = ", p.max_blocks_per_seq,
            " must not be negative");
  MOE_CHECK(p.max_seq_len >= 0 && p.max_seq_len <= p.max_blocks_per_seq * p.block_size,
            "max_seq_len = ", p.max_seq_len,
            " does not fit max_blocks_per_seq = ", p.max_blocks_per_seq, " blocks of ",
            p.block_size);
  // Key positions and split bounds (start + chunk <= 2 * max_seq_len + 64) are ints.
  MOE_CHECK(p.max_seq_len <= (int64_t{1} << 30), "max_seq_len = ", p.max_seq_len, " exceeds 2^30");
  MOE_CHECK(p.scale > 0.0f && std::isfinite(p.scale), "scale = ", p.scale,
            " must be positive and finite");
  MOE_CHECK(p.fixed_chunk >= 0 && p.fixed_chunk % kMlaChunkQuantum == 0 &&
                p.fixed_chunk <= (int64_t{1} << 30),
            "fixed_chunk = ", p.fixed_chunk, " must be 0 or a positive multiple of ",
            kMlaChunkQuantum, " up to 2^30");
}

// Whether the launch reads fp8 rows (any of the four fp8 pointers set; the checks then want all).
bool mla_kv_fp8(const MlaDecodeParams& p) {
  return p.latent_codes || p.rope_codes || p.latent_scales || p.rope_scales;
}

void check_aligned8(const void* pointer, const char* name) {
  MOE_CHECK(reinterpret_cast<uintptr_t>(pointer) % 8 == 0, name, " (", pointer,
            ") is not 8-byte aligned (fp8 rows are read 8 codes at a time)");
}

void check_rows(const MlaDecodeParams& p) {
  if (mla_kv_fp8(p)) {
    MOE_CHECK(!p.cache, "cache (bf16 rows) and latent_codes / rope_codes (fp8 rows) are exclusive");
    detail::check_pointer(p.latent_codes, "latent_codes");
    detail::check_pointer(p.rope_codes, "rope_codes");
    detail::check_pointer(p.latent_scales, "latent_scales");
    detail::check_pointer(p.rope_scales, "rope_scales");
    check_aligned8(p.latent_codes, "latent_codes");
    check_aligned8(p.rope_codes, "rope_codes");
    MOE_CHECK(reinterpret_cast<uintptr_t>(p.latent_scales) % 4 == 0 &&
                  reinterpret_cast<uintptr_t>(p.rope_scales) % 4 == 0,
              "latent_scales / rope_scales are not float-aligned");
  } else {
    detail::check_pointer(p.cache, "cache");
    detail::check_aligned16(p.cache, "cache");
  }
}

}  // namespace

bool mla_decode_is_wide(const MlaDecodeParams& p) {
  return p.latent_dim > kMlaMaxLatentDim || p.latent_dim + p.rope_dim > kMlaMaxCacheWidth;
}

MlaDecodeSplit mla_decode_split(const MlaDecodeParams& p) {
  if (p.fixed_chunk > 0) {
    const int64_t len = std::max<int64_t>(1, p.max_seq_len);
    return MlaDecodeSplit{
        .chunk = p.fixed_chunk,
        .num_splits = std::max<int64_t>(2, (len + p.fixed_chunk - 1) / p.fixed_chunk)};
  }
  const int64_t units = std::max<int64_t>(1, std::max<int64_t>(p.num_seqs, 0) * head_tiles(p));
  const int64_t want_splits = std::max<int64_t>(1, (kMlaTargetBlocks + units - 1) / units);
  const int64_t len = std::max<int64_t>(1, p.max_seq_len);
  int64_t chunk = (len + want_splits - 1) / want_splits;
  chunk = std::max<int64_t>(kMlaChunkQuantum,
                            (chunk + kMlaChunkQuantum - 1) / kMlaChunkQuantum * kMlaChunkQuantum);
  return MlaDecodeSplit{.chunk = chunk, .num_splits = (len + chunk - 1) / chunk};
}

int64_t mla_decode_workspace_size(const MlaDecodeParams& p) {
  const MlaDecodeSplit split = mla_decode_split(p);
  if (split.num_splits <= 1) return 0;
  return p.num_seqs * p.num_heads * split.num_splits * (p.latent_dim + 2);
}

int64_t mla_decode_workspace_bound(const MlaDecodeParams& p) {
  // Fixed chunks: num_seqs * max(2, ceil(keys / chunk)) rows grows with both.
  if (p.fixed_chunk > 0) return mla_decode_workspace_size(p);
  // Otherwise b sequences split into at most want(b) pieces (the chunk is at least
  // len / want(b)) and at most ceil(len / 64) (the chunk is at least 64): b times the smaller
  // of the two bounds every launch of b sequences, at any length up to max_seq_len.
  const int64_t by_keys =
      (std::max<int64_t>(1, p.max_seq_len) + kMlaChunkQuantum - 1) / kMlaChunkQuantum;
  int64_t rows = 0;  // sequences x splits
  for (int64_t b = 1; b <= p.num_seqs; ++b) {
    MlaDecodeParams launch = p;
    launch.num_seqs = b;
    const int64_t units = std::max<int64_t>(1, b * head_tiles(launch));
    const int64_t want = std::max<int64_t>(1, (kMlaTargetBlocks + units - 1) / units);
    const int64_t splits = std::min(want, by_keys);
    if (splits > 1) rows = std::max(rows, b * splits);
  }
  return rows * p.num_heads * (p.latent_dim + 2);
}

void mla_decode_attention(const MlaDecodeParams& p, cudaStream_t stream) {
  NvtxRange range("mla_decode_attention");
  check_mla(p);
  if (p.num_seqs == 0) return;
  detail::check_pointer(p.q, "q");
  check_rows(p);
  detail::check_pointer(p.block_tables, "block_tables");
  detail::check_pointer(p.seq_lens, "seq_lens");
  detail::check_pointer(p.out, "out");
  detail::check_aligned16(p.q, "q");
  detail::check_aligned16(p.out, "out");
  const MlaDecodeSplit split = mla_decode_split(p);
  // chunk <= max_seq_len rounded up to 64 and splits <= 264 both fit an int.
  MOE_CHECK(split.num_splits <= mla::kMaxSplits, "max_seq_len = ", p.max_seq_len, " needs ",
            split.num_splits, " splits");
  if (split.num_splits > 1) {
    detail::check_pointer(p.workspace, "workspace");
    detail::check_aligned16(p.workspace, "workspace");
  }

  // Both kernels' shared memory past the default 48 KB, once, before any launch of either
  // (so also before a CUDA graph captures one).
  static const bool attributes_set = [] {
    for (auto kernel : {mla_decode_kernel<false>, mla_decode_kernel<true>}) {
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      mla::smem_bytes(mla::kMaxWidth)));
    }
    for (auto kernel : {mla_decode_wide_kernel<false>, mla_decode_wide_kernel<true>}) {
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      mla::kWideSmemBytes));
    }
    return true;
  }();
  (void)attributes_set;
  const bool fp8 = mla_kv_fp8(p);
  if (mla_decode_is_wide(p)) {
    const int64_t slices = mla::wide_slices(static_cast<int>(p.latent_dim));
    const dim3 grid(static_cast<unsigned>(split.num_splits * slices),
                    static_cast<unsigned>(head_tiles(p)), static_cast<unsigned>(p.num_seqs));
    auto kernel = fp8 ? mla_decode_wide_kernel<true> : mla_decode_wide_kernel<false>;
    launch_after_previous(kernel, grid, mla::kThreads, mla::kWideSmemBytes, stream, p,
                          static_cast<int>(split.chunk), static_cast<int>(split.num_splits));
  } else {
    const int width = static_cast<int>(p.latent_dim + p.rope_dim);
    const dim3 grid(static_cast<unsigned>(split.num_splits), static_cast<unsigned>(head_tiles(p)),
                    static_cast<unsigned>(p.num_seqs));
    auto kernel = fp8 ? mla_decode_kernel<true> : mla_decode_kernel<false>;
    launch_after_previous(kernel, grid, mla::kThreads, mla::smem_bytes(width), stream, p,
                          static_cast<int>(split.chunk), static_cast<int>(split.num_splits));
  }
  MOE_CUDA_CHECK_LAUNCH();
  if (split.num_splits > 1) {
    // Slices of 64 latent dims per combine block: all of them for many (row, head) pairs, so a
    // block's fixed cost (the weights) is paid once; spread over blocks for few pairs.
    const int64_t slices = (p.latent_dim + 2 * mla::kCombinePairs - 1) / (2 * mla::kCombinePairs);
    const int64_t pairs = p.num_seqs * p.num_heads;
    const int64_t dim_blocks =
        std::clamp<int64_t>((kCombineTargetBlocks + pairs - 1) / pairs, 1, slices);
    const dim3 combine_grid(static_cast<unsigned>(dim_blocks), static_cast<unsigned>(p.num_heads),
                            static_cast<unsigned>(p.num_seqs));
    launch_after_previous(mla_decode_combine_kernel, combine_grid, mla::kCombineThreads, 0, stream,
                          p, static_cast<int>(split.chunk), static_cast<int>(split.num_splits));
    MOE_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace moeinfer::cuda
