// Owns the KV pool's blocks: who holds which block (reference counts), which blocks are free, and
// the prefix cache. A full block is identified by a hash of its token ids chained with the hash of
// the block before it, so equal hashes mean equal prefixes up to and including that block. When a
// request's prompt starts with blocks already in the cache (a repeated system prompt), it takes
// those blocks by reference and skips their prefill. Blocks whose last holder let go stay in the
// cache, findable by hash, until a fresh allocation needs them (least recently freed first).
//
// The block manager only counts; it never touches the pool's memory.
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

namespace moeinfer {

// One sequence's blocks, kept by the sequence and changed only through the BlockManager.
struct SequenceBlocks {
  std::vector<int32_t> table;  // block ids for positions [0, table.size() * block_size)
  int64_t num_registered = 0;  // leading blocks of `table` whose hash is known (full, computed)
  uint64_t last_hash = 0;      // hash of table[num_registered - 1]
};

struct BlockManagerStats {
  int64_t num_blocks = 0;
  int64_t num_used = 0;        // held by at least one sequence
  int64_t num_cached = 0;      // free, but still holding a prefix that can be found by hash
  int64_t prefix_queries = 0;  // prompt tokens looked up in the prefix cache
  int64_t prefix_hits = 0;     // of which found
};

class BlockManager {
 public:
  BlockManager(int64_t num_blocks, int64_t block_size, bool enable_prefix_caching = true);

  int64_t block_size() const { return block_size_; }
  bool prefix_caching() const { return prefix_caching_; }
  int64_t num_blocks() const { return static_cast<int64_t>(ref_counts_.size()); }
  int64_t num_free_blocks() const { return static_cast<int64_t>(free_list_.size()); }
  int64_t num_used_blocks() const { return num_blocks() - num_free_blocks(); }
  BlockManagerStats stats() const;

  // Blocks needed to hold `num_tokens` positions.
  int64_t blocks_for(int64_t num_tokens) const {
    return (num_tokens + block_size_ - 1) / block_size_;
  }

  // For a sequence that holds no blocks yet: takes the cached blocks that match the leading full
  // blocks of `tokens`, never all of them (the last token must run to give logits). Returns the
  // number of tokens covered, i.e. whose prefill can be skipped.
  int64_t match_prefix(std::span<const int32_t> tokens, SequenceBlocks& seq);

  // Grows `seq` to cover `num_tokens` positions. All or nothing: false (and no change) when the
  // free blocks do not suffice.
  bool allocate(SequenceBlocks& seq, int64_t num_tokens);

  // After a forward pass: registers every block of `seq` that is now full and computed
  // (`num_computed` tokens of `tokens` are in the cache) in the prefix cache.
  void register_full_blocks(SequenceBlocks& seq, std::span<const int32_t> tokens,
                            int64_t num_computed);

  // Drops the sequence's hold on all its blocks (finish, abort, failure or preemption).
  void free(SequenceBlocks& seq);

  // Hash of one block's tokens chained to the previous block's hash.
  static uint64_t chain_hash(uint64_t parent, std::span<const int32_t> block_tokens);

 private:
  int32_t take_free_block();
  void release(int32_t block);

  int64_t block_size_;
  bool prefix_caching_;
  std::vector<int32_t> ref_counts_;                     // [num_blocks]
  std::vector<uint64_t> block_hash_;                    // [num_blocks], valid when has_hash_
  std::vector<bool> has_hash_;                          // [num_blocks]
  std::vector<std::vector<int32_t>> block_tokens_;      // [num_blocks] tokens of hashed blocks
  std::list<int32_t> free_list_;                        // ref 0; front is taken first
  std::vector<std::list<int32_t>::iterator> free_pos_;  // [num_blocks] position in free_list_
  std::unordered_map<uint64_t, int32_t> hash_to_block_;
  int64_t prefix_queries_ = 0;
  int64_t prefix_hits_ = 0;
};

}  // namespace moeinfer
