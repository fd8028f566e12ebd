// Launchers of paged decode attention and causal prefill attention (attention_kernel.cuh and
// the tensor-core kernels beside it): argument checks, the split plan for decode,
// instantiations for the head dims in use.
//
// Decode runs on tensor cores by default. The tensor-core kernel covers every shape
// check_decode accepts at D 64, 128 and 256 (any G, 16 heads per block, padded to 16 mma
// rows), so there is no shape to fall back on the CUDA-core kernel for; its one extra need, q
// 16-byte aligned, is refused with a message rather than taken silently down the slower path.
// Head dims above 256 (multiples of 64) take the wide kernel (attention_decode_wide_kernel.cuh)
// whatever tensor_cores says: it is the only one there.
//
// Prefill on tensor cores takes the Hopper wgmma kernel (sm90/attention_prefill_wgmma.cu) on
// compute capability 9.0 when the build has it and prefill_attention_wgmma_unsupported() finds
// nothing (no window, no chunk, no sinks); the mma.sync kernel everywhere else.
#include <algorithm>

#include "backend/cuda/attention.h"
#include "backend/cuda/attention_decode_mma_kernel.cuh"
#include "backend/cuda/attention_decode_wide_kernel.cuh"
#include "backend/cuda/attention_kernel.cuh"
#include "backend/cuda/attention_paged_prefill_mma_kernel.cuh"
#include "backend/cuda/attention_prefill_mma_kernel.cuh"
#include "backend/cuda/attention_prefill_wgmma.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_info.h"
#include "backend/cuda/launch_checks.h"
#include "backend/cuda/programmatic_launch.h"

namespace moeinfer::cuda {

namespace {

// Enough blocks to cover every SM twice at batch 1 with a handful of KV heads.
constexpr int64_t kDecodeTargetBlocks = 264;
constexpr int64_t kDecodeMaxChunk = 512;

bool wide_head_dim(const PagedDecodeParams& p) { return p.head_dim > 256; }

// A launch's first visible key: a sliding window W or Llama 4's attention chunk C, not both.
void check_first_key_rule(int64_t sliding_window, int64_t attention_chunk) {
  MOE_CHECK(sliding_window >= 0, "sliding_window = ", sliding_window,
            " must be 0 (none) or positive");
  MOE_CHECK(attention_chunk >= 0, "attention_chunk = ", attention_chunk,
            " must be 0 (none) or positive");
  MOE_CHECK(attention_chunk == 0 || sliding_window == 0, "attention_chunk = ", attention_chunk,
            " and sliding_window = ", sliding_window,
            " are exclusive (one first-key rule per launch)");
  detail::check_int32_range(attention_chunk, "attention_chunk");
}

// Whether the launch reads fp8 rows (any of the four fp8 pointers set; the checks then want all).
bool decode_kv_fp8(const PagedDecodeParams& p) {
  return p.k_codes || p.v_codes || p.k_scales || p.v_scales;
}

void check_decode(const PagedDecodeParams& p) {
  detail::check_int32_range(p.num_seqs, "num_seqs");
  MOE_CHECK(decode_head_dim_supported(p.head_dim), "head_dim = ", p.head_dim,
            " must be 64, 128, 256 or a multiple of ", kAttentionWideHeadDimStep,
            " above 256 (pad the heads with zeros)");
  detail::check_int32_range(p.head_dim, "head_dim");
  MOE_CHECK(
      p.num_kv_heads >= 1 && p.num_q_heads >= p.num_kv_heads && p.num_q_heads % p.num_kv_heads == 0,
      "num_q_heads = ", p.num_q_heads,
      " must be a positive multiple of num_kv_heads = ", p.num_kv_heads);
  MOE_CHECK(p.block_size >= 1, "block_size = ", p.block_size, " must be at least 1");
  MOE_CHECK(p.num_blocks >= 1, "num_blocks = ", p.num_blocks, " must be at least 1");
  MOE_CHECK(p.max_seq_len >= 0 && p.max_seq_len <= p.max_blocks_per_seq * p.block_size,
            "max_seq_len = ", p.max_seq_len,
            " does not fit max_blocks_per_seq = ", p.max_blocks_per_seq, " blocks of ",
            p.block_size);
  detail::check_int32_range(p.max_seq_len, "max_seq_len");
  detail::check_int32_range(p.num_blocks * p.block_size, "num_blocks * block_size");
  MOE_CHECK(p.scale > 0.0f, "scale = ", p.scale, " must be positive");
  check_first_key_rule(p.sliding_window, p.attention_chunk);
  MOE_CHECK(p.fixed_chunk >= 0 && p.fixed_chunk % 32 == 0, "fixed_chunk = ", p.fixed_chunk,
            " must be 0 or a positive multiple of 32");
  MOE_CHECK(p.fixed_chunk == 0 || p.tensor_cores || wide_head_dim(p),
            "fixed_chunk = ", p.fixed_chunk,
            " needs the tensor-core kernel (the CUDA-core one holds at most ", kDecodeMaxChunk,
            " scores of a split)");
  detail::check_int32_range(p.fixed_chunk, "fixed_chunk");
  if (wide_head_dim(p)) {
    const int64_t blocks_y =
        p.num_kv_heads * attn::decode_head_tiles(p) * attn::decode_dim_tiles(p.head_dim);
    MOE_CHECK(blocks_y <= 65535, "num_kv_heads = ", p.num_kv_heads, " at head_dim = ", p.head_dim,
              " needs ", blocks_y, " blocks per split and sequence, past the grid's y limit 65535");
  }
}

template <int D, bool kFp8>
void launch_decode_mma(const PagedDecodeParams& p, const DecodeSplit& split, cudaStream_t stream) {
  constexpr int smem = attn::decode_mma_smem_bytes<D>();
  static const bool attribute_set = [] {
    CUDA_CHECK(cudaFuncSetAttribute(paged_decode_mma_kernel<D, kFp8>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)attribute_set;
  const dim3 grid(static_cast<unsigned>(split.num_splits),
                  static_cast<unsigned>(p.num_kv_heads * attn::decode_head_tiles(p)),
                  static_cast<unsigned>(p.num_seqs));
  launch_after_previous(paged_decode_mma_kernel<D, kFp8>, grid, attn::kDecodeMmaThreads, smem,
                        stream, p, static_cast<int>(split.chunk),
                        static_cast<int>(split.num_splits));
  MOE_CUDA_CHECK_LAUNCH();
}

template <int D, bool kFp8>
void launch_decode_simt(const PagedDecodeParams& p, const DecodeSplit& split, cudaStream_t stream) {
  const int group = static_cast<int>(std::min(p.num_q_heads / p.num_kv_heads, kAttentionMaxGroup));
  const int smem = attn::decode_smem_bytes<D>(group, static_cast<int>(split.chunk));
  static const bool attribute_set = [] {
    CUDA_CHECK(cudaFuncSetAttribute(paged_decode_kernel<D, kFp8>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    attn::decode_smem_bytes<D>(static_cast<int>(kAttentionMaxGroup),
                                                               static_cast<int>(kDecodeMaxChunk))));
    return true;
  }();
  (void)attribute_set;
  const dim3 grid(static_cast<unsigned>(split.num_splits),
                  static_cast<unsigned>(p.num_kv_heads * attn::decode_head_tiles(p)),
                  static_cast<unsigned>(p.num_seqs));
  launch_after_previous(paged_decode_kernel<D, kFp8>, grid, attn::kDecodeThreads, smem, stream, p,
                        static_cast<int>(split.chunk), static_cast<int>(split.num_splits));
  MOE_CUDA_CHECK_LAUNCH();
}

template <int D>
void launch_decode(const PagedDecodeParams& p, const DecodeSplit& split, cudaStream_t stream) {
  const bool fp8 = p.k_codes != nullptr;
  if (p.tensor_cores) {
    fp8 ? launch_decode_mma<D, true>(p, split, stream)
        : launch_decode_mma<D, false>(p, split, stream);
  } else {
    fp8 ? launch_decode_simt<D, true>(p, split, stream)
        : launch_decode_simt<D, false>(p, split, stream);
  }
  // The tensor-core kernel merges its splits itself where it has tickets.
  if (split.num_splits > 1 && !(p.tensor_cores && p.split_tickets != nullptr)) {
    launch_after_previous(
        paged_decode_combine_kernel<D>,
        dim3(static_cast<unsigned>(p.num_q_heads), static_cast<unsigned>(p.num_seqs)), D, 0, stream,
        p, static_cast<int>(split.chunk), static_cast<int>(split.num_splits));
    MOE_CUDA_CHECK_LAUNCH();
  }
}

void launch_decode_wide(const PagedDecodeParams& p, const DecodeSplit& split, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(split.num_splits),
                  static_cast<unsigned>(p.num_kv_heads * attn::decode_head_tiles(p) *
                                        attn::decode_dim_tiles(p.head_dim)),
                  static_cast<unsigned>(p.num_seqs));
  launch_after_previous(paged_decode_wide_kernel, grid, attn::kWideThreads, 0, stream, p,
                        static_cast<int>(split.chunk), static_cast<int>(split.num_splits));
  MOE_CUDA_CHECK_LAUNCH();
  if (split.num_splits > 1) {
    launch_after_previous(
        paged_decode_wide_combine_kernel,
        dim3(static_cast<unsigned>(p.num_q_heads), static_cast<unsigned>(p.num_seqs)),
        attn::kWideCombineThreads, 0, stream, p, static_cast<int>(split.chunk),
        static_cast<int>(split.num_splits));
    MOE_CUDA_CHECK_LAUNCH();
  }
}

template <int D>
void launch_prefill(const PrefillParams& p, cudaStream_t stream) {
  if (p.tensor_cores) {
    constexpr int smem = attn::prefill_mma_smem_bytes<D>();
    static const bool attribute_set = [] {
      CUDA_CHECK(cudaFuncSetAttribute(prefill_attention_mma_kernel<D>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      return true;
    }();
    (void)attribute_set;
    const dim3 grid(static_cast<unsigned>((p.max_seq_len + attn::kMmaQ - 1) / attn::kMmaQ),
                    static_cast<unsigned>(p.num_q_heads), static_cast<unsigned>(p.num_seqs));
    prefill_attention_mma_kernel<D><<<grid, attn::kMmaThreads, smem, stream>>>(p);
    MOE_CUDA_CHECK_LAUNCH();
    return;
  }
  constexpr int smem = attn::prefill_smem_bytes<D>();
  static const bool attribute_set = [] {
    CUDA_CHECK(cudaFuncSetAttribute(prefill_attention_kernel<D>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)attribute_set;
  const dim3 grid(
      static_cast<unsigned>((p.max_seq_len + attn::kPrefillTile - 1) / attn::kPrefillTile),
      static_cast<unsigned>(p.num_q_heads), static_cast<unsigned>(p.num_seqs));
  prefill_attention_kernel<D><<<grid, attn::kPrefillThreads, smem, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH();
}

template <int D, bool kFp8>
void launch_paged_prefill(const PagedPrefillParams& p, cudaStream_t stream) {
  constexpr int smem = attn::prefill_mma_smem_bytes<D>();
  static const bool attribute_set = [] {
    CUDA_CHECK(cudaFuncSetAttribute(paged_prefill_attention_mma_kernel<D, kFp8>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)attribute_set;
  const dim3 grid(static_cast<unsigned>(p.num_tiles), static_cast<unsigned>(p.num_kv_heads));
  paged_prefill_attention_mma_kernel<D, kFp8><<<grid, attn::kMmaThreads, smem, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH();
}

void check_paged_prefill(const PagedPrefillParams& p) {
  detail::check_int32_range(p.num_tokens, "num_tokens");
  MOE_CHECK(p.head_dim == 64 || p.head_dim == 128, "head_dim = ", p.head_dim,
            " must be 64 or 128 (wider heads take paged_decode_attention a query at a time)");
  MOE_CHECK(
      p.num_kv_heads >= 1 && p.num_q_heads >= p.num_kv_heads && p.num_q_heads % p.num_kv_heads == 0,
      "num_q_heads = ", p.num_q_heads,
      " must be a positive multiple of num_kv_heads = ", p.num_kv_heads);
  MOE_CHECK(p.num_q_heads <= kPagedPrefillMaxGroup * p.num_kv_heads,
            "num_q_heads = ", p.num_q_heads, " over num_kv_heads = ", p.num_kv_heads,
            " is a GQA group past ", kPagedPrefillMaxGroup, " (the rows of one tile)");
  MOE_CHECK(p.num_kv_heads <= 65535, "num_kv_heads = ", p.num_kv_heads, " must be at most 65535");
  MOE_CHECK(p.num_seqs >= 0 && p.num_seqs <= 65535, "num_seqs = ", p.num_seqs,
            " must be in [0, 65535]");
  MOE_CHECK(p.num_seqs <= p.num_tokens, "num_seqs = ", p.num_seqs,
            " exceeds num_tokens = ", p.num_tokens, " (every sequence brings a token)");
  // Every tile holds at least one query (of its own sequence).
  MOE_CHECK(p.num_tiles >= 0 && p.num_tiles <= p.num_tokens, "num_tiles = ", p.num_tiles,
            " must be in [0, num_tokens = ", p.num_tokens, "]");
  MOE_CHECK(p.num_tokens == 0 || p.num_tiles >= 1, "num_tiles = ", p.num_tiles,
            " must be at least 1 for ", p.num_tokens, " tokens");
  MOE_CHECK(p.block_size >= 1, "block_size = ", p.block_size, " must be at least 1");
  MOE_CHECK(p.num_blocks >= 1, "num_blocks = ", p.num_blocks, " must be at least 1");
  MOE_CHECK(p.max_seq_len >= 0 && p.max_seq_len <= p.max_blocks_per_seq * p.block_size,
            "max_seq_len = ", p.max_seq_len, " does not fit max_blocks_per_seq = ",
            p.max_blocks_per_seq, " blocks of ", p.block_size);
  detail::check_int32_range(p.max_seq_len, "max_seq_len");
  detail::check_int32_range(p.num_blocks * p.block_size, "num_blocks * block_size");
  detail::check_int32_range(p.num_tokens * p.num_q_heads * p.head_dim,
                            "num_tokens * num_q_heads * head_dim");
  MOE_CHECK(p.scale > 0.0f, "scale = ", p.scale, " must be positive");
  check_first_key_rule(p.sliding_window, p.attention_chunk);
}

// The split plan's pieces (paged_decode_split and paged_decode_workspace_bound).
// Splits wanted to fill the GPU: about kDecodeTargetBlocks blocks over the blocks of one split
// (the wide kernel also has one per 512 output dims).
int64_t want_splits(const PagedDecodeParams& p) {
  const int64_t dim_tiles = wide_head_dim(p) ? attn::decode_dim_tiles(p.head_dim) : 1;
  const int64_t units =
      std::max<int64_t>(1, p.num_seqs * p.num_kv_heads * attn::decode_head_tiles(p) * dim_tiles);
  return std::max<int64_t>(1, (kDecodeTargetBlocks + units - 1) / units);
}

// Keys one query sees at most: W under a sliding window, C under chunked attention (position p
// sees p - floor(p / C) * C + 1 <= C keys), else every cached key.
int64_t visible_keys(const PagedDecodeParams& p) {
  const int64_t span = p.attention_chunk > 0 ? p.attention_chunk : p.sliding_window;
  return span > 0 ? std::min(p.max_seq_len, span) : p.max_seq_len;
}

// Keys one sequence's query sees at most (at least 1): its splits start at the window's (the
// chunk's) first key.
int64_t planned_keys(const PagedDecodeParams& p) {
  return std::max<int64_t>(1, visible_keys(p));
}

bool streams_any_chunk(const PagedDecodeParams& p) { return p.tensor_cores || wide_head_dim(p); }

}  // namespace

DecodeSplit paged_decode_split(const PagedDecodeParams& p) {
  if (p.fixed_chunk > 0) {
    // Planned over the bound for the grid; each sequence uses the splits its own keys need.
    const int64_t keys = visible_keys(p);
    return DecodeSplit{
        .chunk = p.fixed_chunk,
        .num_splits = std::max<int64_t>(2, (keys + p.fixed_chunk - 1) / p.fixed_chunk)};
  }
  const int64_t want = want_splits(p);
  const int64_t len = planned_keys(p);
  int64_t chunk = (len + want - 1) / want;
  // The tensor-core and the wide kernels stream any chunk through their tile loops, so they
  // split only to fill the GPU: at most want splits, and a workspace that does not grow with
  // the context. The CUDA-core kernel keeps a chunk's scores in shared memory, which caps the
  // chunk.
  chunk = std::clamp<int64_t>((chunk + 31) / 32 * 32, 32,
                              streams_any_chunk(p) ? std::max<int64_t>(32, len) : kDecodeMaxChunk);
  return DecodeSplit{.chunk = chunk, .num_splits = (len + chunk - 1) / chunk};
}

int64_t paged_decode_workspace_size(const PagedDecodeParams& p) {
  const DecodeSplit split = paged_decode_split(p);
  if (split.num_splits <= 1) return 0;
  return p.num_seqs * p.num_q_heads * split.num_splits * (p.head_dim + 2);
}

int64_t paged_decode_workspace_bound(const PagedDecodeParams& p) {
  // Fixed chunks: num_seqs * max(2, ceil(keys / chunk)) rows grows with both.
  if (p.fixed_chunk > 0) return paged_decode_workspace_size(p);
  // Otherwise a launch of b <= num_seqs sequences over at most `keys` keys has chunks of at
  // least 32 keys and at least keys / want_splits(b) (so at most want_splits(b) splits), except
  // where the CUDA-core kernel's 512-key cap binds (then ceil(keys / 512) splits). Both bounds
  // grow with the keys, so the largest b * splits over every b bounds every launch.
  const int64_t keys = planned_keys(p);
  const int64_t by_keys = (keys + 31) / 32;
  const int64_t by_cap = (keys + kDecodeMaxChunk - 1) / kDecodeMaxChunk;
  int64_t rows = 0;  // sequences x splits
  for (int64_t b = 1; b <= p.num_seqs; ++b) {
    PagedDecodeParams launch = p;
    launch.num_seqs = b;
    int64_t splits = want_splits(launch);
    if (!streams_any_chunk(p)) splits = std::max(splits, by_cap);
    splits = std::min(splits, by_keys);
    if (splits > 1) rows = std::max(rows, b * splits);
  }
  return rows * p.num_q_heads * (p.head_dim + 2);
}

void paged_decode_attention(const PagedDecodeParams& p, cudaStream_t stream) {
  NvtxRange range("attention_decode");
  check_decode(p);
  if (p.num_seqs == 0) return;
  detail::check_pointer(p.q, "q");
  if (decode_kv_fp8(p)) {
    MOE_CHECK(!p.k_cache && !p.v_cache,
              "k_cache / v_cache (bf16 rows) and k_codes / v_codes (fp8 rows) are exclusive");
    MOE_CHECK(!wide_head_dim(p), "head_dim = ", p.head_dim,
              ": fp8 KV rows are read by the decode kernels of head dims 64, 128 and 256 only");
    detail::check_pointer(p.k_codes, "k_codes");
    detail::check_pointer(p.v_codes, "v_codes");
    detail::check_pointer(p.k_scales, "k_scales");
    detail::check_pointer(p.v_scales, "v_scales");
    detail::check_aligned16(p.k_codes, "k_codes");
    detail::check_aligned16(p.v_codes, "v_codes");
  } else {
    detail::check_pointer(p.k_cache, "k_cache");
    detail::check_pointer(p.v_cache, "v_cache");
    detail::check_aligned16(p.k_cache, "k_cache");
    detail::check_aligned16(p.v_cache, "v_cache");
  }
  detail::check_pointer(p.block_tables, "block_tables");
  detail::check_pointer(p.seq_lens, "seq_lens");
  detail::check_pointer(p.out, "out");
  MOE_CHECK(!p.tensor_cores || wide_head_dim(p) || reinterpret_cast<uintptr_t>(p.q) % 16 == 0,
            "q (", static_cast<const void*>(p.q),
            ") is not 16-byte aligned, which the tensor-core decode kernel needs (tensor_cores "
            "= false takes any alignment)");
  const DecodeSplit split = paged_decode_split(p);
  MOE_CHECK(split.num_splits <= 65535, "max_seq_len = ", p.max_seq_len, " needs ", split.num_splits,
            " splits");
  if (split.num_splits > 1) detail::check_pointer(p.workspace, "workspace");
  switch (p.head_dim) {
    case 64:
      return launch_decode<64>(p, split, stream);
    case 128:
      return launch_decode<128>(p, split, stream);
    case 256:
      return launch_decode<256>(p, split, stream);
    default:
      return launch_decode_wide(p, split, stream);
  }
}

void prefill_attention(const PrefillParams& p, cudaStream_t stream) {
  NvtxRange range("attention_prefill");
  detail::check_int32_range(p.num_tokens, "num_tokens");
  MOE_CHECK(p.head_dim == 64 || p.head_dim == 128, "head_dim = ", p.head_dim, " must be 64 or 128");
  MOE_CHECK(
      p.num_kv_heads >= 1 && p.num_q_heads >= p.num_kv_heads && p.num_q_heads % p.num_kv_heads == 0,
      "num_q_heads = ", p.num_q_heads,
      " must be a positive multiple of num_kv_heads = ", p.num_kv_heads);
  MOE_CHECK(p.num_seqs >= 1 && p.num_seqs <= 65535, "num_seqs = ", p.num_seqs,
            " must be in [1, 65535]");
  MOE_CHECK(p.max_seq_len >= 1 && p.max_seq_len <= p.num_tokens, "max_seq_len = ", p.max_seq_len,
            " must be in [1, num_tokens = ", p.num_tokens, "]");
  detail::check_int32_range(p.num_tokens * p.num_q_heads * p.head_dim,
                            "num_tokens * num_q_heads * head_dim");
  MOE_CHECK(p.scale > 0.0f, "scale = ", p.scale, " must be positive");
  check_first_key_rule(p.sliding_window, p.attention_chunk);
  if (p.num_tokens == 0) return;
  detail::check_pointer(p.q, "q");
  detail::check_pointer(p.k, "k");
  detail::check_pointer(p.v, "v");
  detail::check_pointer(p.cu_seqlens, "cu_seqlens");
  detail::check_pointer(p.out, "out");
  if (p.tensor_cores) {
    detail::check_aligned16(p.q, "q");
    detail::check_aligned16(p.k, "k");
    detail::check_aligned16(p.v, "v");
    detail::check_aligned16(p.out, "out");
  }
  if (p.tensor_cores && p.hopper && prefill_attention_wgmma_unsupported(p) == nullptr &&
      prefill_attention_hopper_available()) {
#if defined(MOE_HAVE_WGMMA) && MOE_HAVE_WGMMA
    prefill_attention_wgmma(p, stream);
#endif
    return;
  }
  if (p.head_dim == 64) {
    launch_prefill<64>(p, stream);
  } else {
    launch_prefill<128>(p, stream);
  }
}

const char* prefill_attention_wgmma_unsupported(const PrefillParams& p) {
  if (p.sliding_window > 0) return "a sliding window";
  if (p.attention_chunk > 0) return "an attention chunk";
  if (p.sinks != nullptr) return "attention sinks";
  // Query tiles of 128 are the grid's y (at most 65535).
  if (p.max_seq_len > int64_t{65535} * 128) return "max_seq_len past 65535 tiles of 128";
  return nullptr;
}

bool prefill_attention_hopper_available() {
#if defined(MOE_HAVE_WGMMA) && MOE_HAVE_WGMMA
  return current_compute_capability() == 90;
#else
  return false;
#endif
}

int64_t plan_paged_prefill_tiles(const int32_t* cu_seqlens, int64_t num_seqs, int64_t group,
                                 int32_t* tile_starts) {
  MOE_CHECK(group >= 1 && group <= kPagedPrefillMaxGroup, "GQA group ", group,
            " must be in [1, ", kPagedPrefillMaxGroup, "]");
  const int64_t tile_queries = paged_prefill_queries_per_tile(group);
  int64_t total = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    tile_starts[b] = static_cast<int32_t>(total);
    const int64_t n = cu_seqlens[b + 1] - cu_seqlens[b];
    MOE_CHECK(n >= 0, "cu_seqlens decreases at sequence ", b);
    total += (n + tile_queries - 1) / tile_queries;
  }
  tile_starts[num_seqs] = static_cast<int32_t>(total);
  return total;
}

void paged_prefill_attention(const PagedPrefillParams& p, cudaStream_t stream) {
  NvtxRange range("attention_paged_prefill");
  check_paged_prefill(p);
  if (p.num_tokens == 0 || p.num_seqs == 0) return;
  detail::check_pointer(p.q, "q");
  detail::check_aligned16(p.q, "q");
  const bool fp8 = p.k_codes || p.v_codes || p.k_scales || p.v_scales;
  if (fp8) {
    MOE_CHECK(!p.k_cache && !p.v_cache,
              "k_cache / v_cache (bf16 rows) and k_codes / v_codes (fp8 rows) are exclusive");
    detail::check_pointer(p.k_codes, "k_codes");
    detail::check_pointer(p.v_codes, "v_codes");
    detail::check_pointer(p.k_scales, "k_scales");
    detail::check_pointer(p.v_scales, "v_scales");
    // 8-byte loads of codes: each row of D codes starts at a multiple of D (64 or 128) bytes.
    detail::check_aligned16(p.k_codes, "k_codes");
    detail::check_aligned16(p.v_codes, "v_codes");
  } else {
    detail::check_pointer(p.k_cache, "k_cache");
    detail::check_pointer(p.v_cache, "v_cache");
    detail::check_aligned16(p.k_cache, "k_cache");
    detail::check_aligned16(p.v_cache, "v_cache");
  }
  detail::check_pointer(p.cu_seqlens, "cu_seqlens");
  detail::check_pointer(p.seq_lens, "seq_lens");
  detail::check_pointer(p.tile_starts, "tile_starts");
  detail::check_pointer(p.block_tables, "block_tables");
  detail::check_pointer(p.out, "out");
  detail::check_aligned16(p.out, "out");
  if (p.head_dim == 64) {
    fp8 ? launch_paged_prefill<64, true>(p, stream) : launch_paged_prefill<64, false>(p, stream);
  } else {
    fp8 ? launch_paged_prefill<128, true>(p, stream) : launch_paged_prefill<128, false>(p, stream);
  }
}

}  // namespace moeinfer::cuda
