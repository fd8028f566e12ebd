#include "kv/block_manager.h"

#include <algorithm>

#include "core/error.h"

namespace moeinfer {

BlockManager::BlockManager(int64_t num_blocks, int64_t block_size, bool enable_prefix_caching)
    : block_size_(block_size),
      prefix_caching_(enable_prefix_caching),
      ref_counts_(static_cast<size_t>(num_blocks), 0),
      block_hash_(static_cast<size_t>(num_blocks), 0),
      has_hash_(static_cast<size_t>(num_blocks), false),
      block_tokens_(static_cast<size_t>(num_blocks)),
      free_pos_(static_cast<size_t>(num_blocks)) {
  MOE_CHECK(num_blocks > 0 && block_size > 0, "block manager needs blocks: ", num_blocks,
            " blocks of ", block_size);
  for (int32_t b = 0; b < num_blocks; ++b) free_pos_[b] = free_list_.insert(free_list_.end(), b);
}

BlockManagerStats BlockManager::stats() const {
  int64_t cached = 0;
  for (int32_t b : free_list_) cached += has_hash_[b] ? 1 : 0;
  return {.num_blocks = num_blocks(),
          .num_used = num_used_blocks(),
          .num_cached = cached,
          .prefix_queries = prefix_queries_,
          .prefix_hits = prefix_hits_};
}

uint64_t BlockManager::chain_hash(uint64_t parent, std::span<const int32_t> block_tokens) {
  // FNV-1a over the parent hash and the token ids, then a splitmix finaliser.
  uint64_t h = 1469598103934665603ull;
  const auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(parent);
  for (int32_t t : block_tokens) mix(static_cast<uint32_t>(t));
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  h ^= h >> 31;
  return h;
}

int64_t BlockManager::match_prefix(std::span<const int32_t> tokens, SequenceBlocks& seq) {
  MOE_CHECK(seq.table.empty(), "match_prefix on a sequence that already holds blocks");
  seq.num_registered = 0;
  seq.last_hash = 0;
  if (!prefix_caching_ || tokens.empty()) return 0;
  const int64_t num_full = (static_cast<int64_t>(tokens.size()) - 1) / block_size_;
  prefix_queries_ += num_full * block_size_;
  uint64_t hash = 0;
  for (int64_t i = 0; i < num_full; ++i) {
    const auto block_tokens = tokens.subspan(i * block_size_, block_size_);
    hash = chain_hash(hash, block_tokens);
    const auto found = hash_to_block_.find(hash);
    if (found == hash_to_block_.end()) break;
    const int32_t block = found->second;
    const auto& stored = block_tokens_[block];
    if (!std::equal(stored.begin(), stored.end(), block_tokens.begin(), block_tokens.end())) break;
    if (ref_counts_[block] == 0) free_list_.erase(free_pos_[block]);
    ++ref_counts_[block];
    seq.table.push_back(block);
    seq.num_registered = i + 1;
    seq.last_hash = hash;
  }
  const int64_t hit = seq.num_registered * block_size_;
  prefix_hits_ += hit;
  return hit;
}

int32_t BlockManager::take_free_block() {
  const int32_t block = free_list_.front();
  free_list_.pop_front();
  if (has_hash_[block]) {
    // Evict the cached prefix this block held.
    const auto found = hash_to_block_.find(block_hash_[block]);
    if (found != hash_to_block_.end() && found->second == block) hash_to_block_.erase(found);
    has_hash_[block] = false;
    block_tokens_[block].clear();
  }
  ref_counts_[block] = 1;
  return block;
}

bool BlockManager::allocate(SequenceBlocks& seq, int64_t num_tokens) {
  const int64_t need = blocks_for(num_tokens) - static_cast<int64_t>(seq.table.size());
  if (need <= 0) return true;
  if (need > num_free_blocks()) return false;
  for (int64_t i = 0; i < need; ++i) seq.table.push_back(take_free_block());
  return true;
}

void BlockManager::register_full_blocks(SequenceBlocks& seq, std::span<const int32_t> tokens,
                                        int64_t num_computed) {
  if (!prefix_caching_) return;
  const int64_t num_full = std::min<int64_t>(num_computed / block_size_, seq.table.size());
  for (int64_t i = seq.num_registered; i < num_full; ++i) {
    const auto block_tokens = tokens.subspan(i * block_size_, block_size_);
    const uint64_t hash = chain_hash(seq.last_hash, block_tokens);
    const int32_t block = seq.table[i];
    // A block computed twice by sequences that ran the same prefix at once: the first one stays
    // the cached copy, the second is private to its sequence.
    if (hash_to_block_.emplace(hash, block).second) {
      block_hash_[block] = hash;
      has_hash_[block] = true;
      block_tokens_[block].assign(block_tokens.begin(), block_tokens.end());
    }
    seq.num_registered = i + 1;
    seq.last_hash = hash;
  }
}

void BlockManager::release(int32_t block) {
  MOE_CHECK(block >= 0 && block < num_blocks() && ref_counts_[block] > 0, "block ", block,
            " released but not held");
  if (--ref_counts_[block] > 0) return;
  // Cached blocks go to the back so they are evicted last; plain ones to the front.
  free_pos_[block] = has_hash_[block] ? free_list_.insert(free_list_.end(), block)
                                      : free_list_.insert(free_list_.begin(), block);
}

void BlockManager::free(SequenceBlocks& seq) {
  // Release the tail first so that a prefix's deeper blocks are evicted before its head.
  for (auto it = seq.table.rbegin(); it != seq.table.rend(); ++it) release(*it);
  seq.table.clear();
  seq.num_registered = 0;
  seq.last_hash = 0;
}

}  // namespace moeinfer
