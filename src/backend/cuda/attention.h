// Host interface of the CUDA attention-side kernels: embedding gather, rotary position
// embeddings, decode attention over the paged KV cache and causal prefill attention.
//
// As in moe_stages.h, every launcher takes a params struct of raw device pointers and a
// stream, checks sizes, pointers and alignment on the host (naming the offending value), and
// enqueues without reading device memory back, so all of them can be captured in a graph.
//
// Glossary: T tokens, B sequences, Nq query heads, Nkv key/value heads (GQA group G = Nq/Nkv),
// D head dim, V vocabulary, H hidden.
//
// Paged KV layout (the serving layer's block manager owns the blocks; the kernels only read):
//   k_cache, v_cache  [num_blocks, block_size, Nkv, D]  bf16, or under --kv-dtype fp8
//   k_codes, v_codes  [num_blocks, block_size, Nkv, D]  e4m3, with
//   k_scales, v_scales [num_blocks, block_size, Nkv]    float32 (value = code * scale)
//   block_tables      [B, max_blocks_per_seq]           int32 block ids, position p of sequence
//                                                       b lives in block_tables[b, p / block_size]
//                                                       at slot p % block_size
//   seq_lens          [B]                                int32 cached tokens (the current one
//                                                       included), each in [0, max_seq_len]
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moeinfer::cuda {

struct EmbeddingParams {
  const int32_t* token_ids = nullptr;    // [T], each in [0, V) (a device check traps otherwise)
  const __nv_bfloat16* table = nullptr;  // [V, H]
  // [V, H] the table's second bf16 term (a float32 checkpoint held as hi + lo), or null; only
  // with out_f32, which gets table + table_lo summed in float32.
  const __nv_bfloat16* table_lo = nullptr;
  __nv_bfloat16* out = nullptr;          // [T, H], or null
  float* out_f32 = nullptr;              // [T, H] the rows widened to float32, or null
  int64_t num_tokens = 0;                // T
  int64_t vocab_size = 0;                // V
  int64_t hidden_size = 0;               // H, a multiple of 8
};

// out[t] = table[token_ids[t]] (into out or out_f32, exactly one of them).
void embedding(const EmbeddingParams& params, cudaStream_t stream);

struct RopeParams {
  __nv_bfloat16* q = nullptr;          // [T, q_stride], heads [Nq, D] at the start of each row
  __nv_bfloat16* k = nullptr;          // [T, k_stride], heads [Nkv, D]; null: rotate q only
  const int32_t* positions = nullptr;  // [T]
  const float* inv_freq = nullptr;     // [rotary_dim / 2], from the host's rope (yarn, linear,
                                       // llama3 all precomputed there)
  int64_t num_tokens = 0;              // T
  int64_t num_q_heads = 0;             // Nq
  int64_t num_kv_heads = 0;            // Nkv
  int64_t head_dim = 0;                // D (the head-to-head stride)
  int64_t rotary_dim = 0;              // leading dims of each head that rotate, even, <= D
  int64_t q_stride = 0;                // elements from one token's q row to the next
  int64_t k_stride = 0;                // same for k
  float attention_scaling = 1.0f;      // multiplies cos and sin (yarn's mscale)
  bool interleaved = false;            // pairs (2i, 2i+1) instead of (i, i + rotary_dim/2)
};

// In place: each pair turns by angle = float(position) * inv_freq[i] (float32 math, one bf16
// rounding), as moeinfer::Rope::apply does on the CPU.
void rope(const RopeParams& params, cudaStream_t stream);

// Largest GQA group one decode block packs (larger groups take several blocks per KV head).
inline constexpr int64_t kAttentionMaxGroup = 16;

// Head dims paged_decode_attention takes: 64, 128 and 256 (the tensor-core and CUDA-core
// kernels), and every multiple of 64 above 256 (attention_decode_wide_kernel.cuh, whose shared
// memory and registers do not grow with D). A model's head_dim is padded up to the next one,
// with zeros in the padded dims.
inline constexpr int64_t kAttentionWideHeadDimStep = 64;
inline bool decode_head_dim_supported(int64_t head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256 ||
         (head_dim > 256 && head_dim % kAttentionWideHeadDimStep == 0);
}
inline int64_t decode_padded_head_dim(int64_t head_dim) {
  if (head_dim <= 64) return 64;
  if (head_dim <= 128) return 128;
  if (head_dim <= 256) return 256;
  return (head_dim + kAttentionWideHeadDimStep - 1) / kAttentionWideHeadDimStep *
         kAttentionWideHeadDimStep;
}

struct PagedDecodeParams {
  const __nv_bfloat16* q = nullptr;        // [B, Nq, D]
  const __nv_bfloat16* k_cache = nullptr;  // [num_blocks, block_size, Nkv, D]
  const __nv_bfloat16* v_cache = nullptr;  // [num_blocks, block_size, Nkv, D]
  // --kv-dtype fp8 (backend/cuda/kv_fp8.cuh), instead of k_cache / v_cache (which are then
  // null): e4m3 codes in the same layout and one float32 scale per (slot, KV head); the kernels
  // decode code * scale in registers as they load. D <= 256 only (not the wide kernel).
  const uint8_t* k_codes = nullptr;        // [num_blocks, block_size, Nkv, D]
  const uint8_t* v_codes = nullptr;        // [num_blocks, block_size, Nkv, D]
  const float* k_scales = nullptr;         // [num_blocks, block_size, Nkv]
  const float* v_scales = nullptr;         // [num_blocks, block_size, Nkv]
  const int32_t* block_tables = nullptr;   // [B, max_blocks_per_seq]
  const int32_t* seq_lens = nullptr;       // [B]
  __nv_bfloat16* out = nullptr;            // [B, Nq, D]
  float* workspace = nullptr;  // [paged_decode_workspace_size(...)] floats, when splits > 1
  int64_t num_seqs = 0;        // B
  int64_t num_q_heads = 0;     // Nq
  int64_t num_kv_heads = 0;    // Nkv, divides Nq (groups past 16 take several blocks)
  int64_t head_dim = 0;        // D: 64, 128, 256 or a multiple of 64 above 256
  int64_t block_size = 0;      // tokens per KV block
  int64_t num_blocks = 0;      // blocks in the pool (for the device range check)
  int64_t max_blocks_per_seq = 0;
  int64_t max_seq_len = 0;  // host-known bound on seq_lens: sizes the split grid
  float scale = 0.0f;       // softmax scale, usually 1/sqrt(D)
  // W: the query (position seq_lens[b] - 1) sees keys [max(0, seq_lens[b] - W), seq_lens[b]),
  // as Mistral / Qwen2 sliding-window layers; 0: every cached key. Keys before the window are
  // not read, and the split plan (hence the workspace size) covers min(max_seq_len, W) keys.
  int64_t sliding_window = 0;
  // C: chunked local attention (Llama 4's chunked layers): the query at position p =
  // seq_lens[b] - 1 sees keys [floor(p / C) * C, p] only; 0: off. Exclusive with
  // sliding_window. As the window, it moves the splits' start (keys before it are not read), and
  // the split plan covers min(max_seq_len, C) keys.
  int64_t attention_chunk = 0;
  // [Nq] float32 attention sinks (GPT-OSS), or null: head h's softmax denominator takes one
  // more term exp(sinks[h] - max), a logit in the units of the scaled scores with no value row,
  // so the weights of the keys sum to less than 1. Applied once per query where its softmax is
  // finished (the single split's output, or the combine kernel's).
  const float* sinks = nullptr;
  // Tensor cores (attention_decode_mma_kernel.cuh: the G query heads as 16 mma rows, P rounded
  // to bf16 for the P.V product), needing q 16-byte aligned; it covers every D and G the
  // launcher accepts, and measured 2.4x to 9x faster than the CUDA-core kernel on an H200
  // (bench/RESULTS.md, 2026-11-30). false: the float32 CUDA-core kernel, kept as a second
  // implementation to test against. Head dims above 256 have one kernel, float32 on CUDA cores
  // with any q alignment, which runs whatever this says.
  bool tensor_cores = true;
  // > 0 (--deterministic): every sequence's keys are cut into splits of this many (a multiple
  // of 32; tensor cores or D > 256) whatever the batch, and the splits always go through the
  // workspace and the combine kernel, even a sequence that needs one: a query's reduction order
  // then depends on its own length alone (batch_invariant_chunk). 0: splits sized to fill the
  // GPU for this batch, a single split written directly.
  int64_t fixed_chunk = 0;
  // [num_seqs * num_kv_heads * head tiles] int32 tickets, zero before the first launch and left
  // zero by every launch, or null. Given, with several splits on tensor cores: each split block
  // takes a ticket after writing its partial, and the last of a (sequence, KV head, head tile) to
  // finish merges the splits itself, in the combine kernel's order (the same bits), so the
  // combine's launch is saved. Null: the combine kernel merges them.
  int32_t* split_tickets = nullptr;
};

// The keys per split of --deterministic for a context of max_seq_len: at least 256, and few
// enough splits (at most kBatchInvariantMaxSplits) that the workspace stays bounded; a multiple
// of 64, so that it serves the GQA and the MLA decode kernels alike.
inline constexpr int64_t kBatchInvariantMaxSplits = 16;
inline int64_t batch_invariant_chunk(int64_t max_seq_len) {
  const int64_t spread = (max_seq_len + kBatchInvariantMaxSplits - 1) / kBatchInvariantMaxSplits;
  const int64_t chunk = spread > 256 ? spread : 256;
  return (chunk + 63) / 64 * 64;
}

// Tokens per split the launcher will use (a multiple of 32; at most 512 on the CUDA-core kernel
// of D <= 256, which keeps a chunk's scores in shared memory) and the split count, planned over
// min(max_seq_len, sliding_window or attention_chunk) keys; each sequence's splits start at the
// first key of its window or chunk. With fixed_chunk: that chunk, and at least two splits.
struct DecodeSplit {
  int64_t chunk = 0;
  int64_t num_splits = 0;
};
DecodeSplit paged_decode_split(const PagedDecodeParams& params);
// Floats of workspace paged_decode_attention() needs (0 when one split covers the planned keys);
// it depends on sliding_window as on max_seq_len.
int64_t paged_decode_workspace_size(const PagedDecodeParams& params);
// Floats of workspace enough for every launch with num_seqs and max_seq_len at most params'
// (the rest alike), for sizing a workspace once: the split plan is not monotone in either (65
// sequences can need more than 64 and 128 do, a shorter context one more split than a longer).
int64_t paged_decode_workspace_bound(const PagedDecodeParams& params);

// out[b, h] = softmax(scale * q[b,h] . K[b, first..len)) V (the denominator also taking
// exp(sinks[h]) when sinks are given), with K/V of KV head h / G read
// through the block table, first = max(0, len - W) under a sliding window, else 0. One block per
// (sequence, KV head, split) packs the G query heads, so each K/V byte is read once; splits over
// long contexts are combined by a second kernel. A sequence of length 0 gets zeros.
void paged_decode_attention(const PagedDecodeParams& params, cudaStream_t stream);

struct PrefillParams {
  const __nv_bfloat16* q = nullptr;     // [T, Nq, D] all sequences' new tokens, concatenated
  const __nv_bfloat16* k = nullptr;     // [T, Nkv, D]
  const __nv_bfloat16* v = nullptr;     // [T, Nkv, D]
  const int32_t* cu_seqlens = nullptr;  // [B + 1] device, token offsets of the sequences
  __nv_bfloat16* out = nullptr;         // [T, Nq, D]
  int64_t num_tokens = 0;               // T
  int64_t num_seqs = 0;                 // B
  int64_t max_seq_len = 0;              // host-known bound: sizes the grid
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;  // 64 or 128
  float scale = 0.0f;
  // W: query i of a sequence (0-based within it) sees keys [max(0, i - W + 1), i]; 0: every
  // key up to i. Key tiles wholly before a query tile's window are not loaded.
  int64_t sliding_window = 0;
  // C: query i sees keys [floor(i / C) * C, i] only (Llama 4's chunked layers); 0: off.
  // Exclusive with sliding_window. Key tiles wholly before a query tile's first chunk are not
  // loaded.
  int64_t attention_chunk = 0;
  // [Nq] float32 attention sinks, or null: as PagedDecodeParams::sinks.
  const float* sinks = nullptr;
  // Tensor cores (mma.sync, 64-query x 64-key tiles); false: the float32 CUDA-core kernel
  // (32 x 32 tiles), kept as a second implementation to test against.
  bool tensor_cores = true;
  // With tensor_cores, on a GPU of compute capability 9.0 and a build for architecture 90: the
  // Hopper kernel (attention_prefill_wgmma_kernel.cuh: wgmma, TMA, 128-query x 128-key tiles)
  // wherever it applies, which is no sliding window, no attention chunk and no sinks; the
  // mma.sync kernel everywhere else. false: always the mma.sync kernel, kept to test against.
  bool hopper = true;
};

// Causal (optionally sliding-window) self-attention of each sequence's tokens among themselves
// (no cached prefix): flash-style, K/V tiles in shared memory, online softmax in float32; P is
// rounded to bf16 for the P.V product on the tensor-core paths.
void prefill_attention(const PrefillParams& params, cudaStream_t stream);

// Whether prefill_attention() can take the Hopper kernel on this device and build (compute
// capability 9.0, CMAKE_CUDA_ARCHITECTURES including 90); the parameters decide the rest.
bool prefill_attention_hopper_available();

// A step's new tokens attending over the paged cache: each sequence brings n_b >= 1 tokens
// after a cached prefix of any length (0 included), and its keys, the new tokens' among them,
// are already in the cache. Query i of sequence b sits at position seq_lens[b] - n_b + i and
// sees keys [first visible key, that position] under the same rules as PagedDecodeParams.
struct PagedPrefillParams {
  const __nv_bfloat16* q = nullptr;        // [T, Nq, D] all sequences' new tokens, concatenated
  const __nv_bfloat16* k_cache = nullptr;  // [num_blocks, block_size, Nkv, D], or null under fp8
  const __nv_bfloat16* v_cache = nullptr;  // [num_blocks, block_size, Nkv, D], or null under fp8
  const uint8_t* k_codes = nullptr;        // [num_blocks, block_size, Nkv, D] e4m3, or null
  const uint8_t* v_codes = nullptr;        // [num_blocks, block_size, Nkv, D] e4m3, or null
  const float* k_scales = nullptr;         // [num_blocks, block_size, Nkv]
  const float* v_scales = nullptr;         // [num_blocks, block_size, Nkv]
  const int32_t* cu_seqlens = nullptr;     // [B + 1] token offsets of the sequences' queries
  const int32_t* seq_lens = nullptr;       // [B] cached keys after this step (prefix + n_b)
  // [B + 1] the work list, plan_paged_prefill_tiles' output uploaded: sequence b's query tiles
  // are blocks [tile_starts[b], tile_starts[b + 1]), so no block is launched for nothing.
  const int32_t* tile_starts = nullptr;
  const int32_t* block_tables = nullptr;   // [B, max_blocks_per_seq]
  __nv_bfloat16* out = nullptr;            // [T, Nq, D]
  int64_t num_tokens = 0;                  // T
  int64_t num_seqs = 0;                    // B
  int64_t num_tiles = 0;                   // tile_starts[B]: the grid's query tiles
  int64_t max_seq_len = 0;                 // host-known bound on seq_lens
  int64_t num_q_heads = 0;                 // Nq
  int64_t num_kv_heads = 0;                // Nkv, divides Nq, G = Nq / Nkv <= 64
  int64_t head_dim = 0;                    // D: 64 or 128
  int64_t block_size = 0;                  // tokens per KV block
  int64_t num_blocks = 0;                  // blocks in the pool (for the device range check)
  int64_t max_blocks_per_seq = 0;
  float scale = 0.0f;
  int64_t sliding_window = 0;    // W, as PagedDecodeParams::sliding_window
  int64_t attention_chunk = 0;   // C, as PagedDecodeParams::attention_chunk
  const float* sinks = nullptr;  // [Nq] float32, or null: as PagedDecodeParams::sinks
};

// A paged prefill block's mma rows: (query, head) pairs of one KV head, 64 / G queries of the G
// heads; so the largest GQA group it takes is 64.
inline constexpr int64_t kPagedPrefillTileRows = 64;
inline constexpr int64_t kPagedPrefillMaxGroup = kPagedPrefillTileRows;
inline int64_t paged_prefill_queries_per_tile(int64_t group) {
  return kPagedPrefillTileRows / group;
}

// The work list of a launch, planned on the host from the sequences' query offsets
// cu_seqlens [B + 1] (host memory): tile_starts[b] = the query tiles of the sequences before b
// (ceil(n / queries per tile) each), tile_starts[B] their total, which it returns (the launch's
// num_tiles). Writes B + 1 values.
int64_t plan_paged_prefill_tiles(const int32_t* cu_seqlens, int64_t num_seqs, int64_t group,
                                 int32_t* tile_starts);

// Flash-style causal attention of the new tokens over their sequences' paged keys on tensor
// cores (attention_paged_prefill_mma_kernel.cuh): chunked prefill after a cached prefix and
// steps where sequences bring several tokens. The G heads of a KV head share a block's rows, so
// a sequence bringing one token fills G rows of a tile (all-decode steps still take
// paged_decode_attention, which also splits long contexts over blocks).
void paged_prefill_attention(const PagedPrefillParams& params, cudaStream_t stream);

}  // namespace moeinfer::cuda
