#include "kv/block_manager.h"

#include <gtest/gtest.h>

#include <numeric>
#include <set>
#include <vector>

namespace moeinfer {
namespace {

std::vector<int32_t> iota_tokens(int64_t n, int32_t start = 0) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), start);
  return t;
}

TEST(BlockManager, AllocatesAllOrNothingAndFreesEverything) {
  BlockManager manager(5, 4);
  SequenceBlocks a, b;
  ASSERT_TRUE(manager.allocate(a, 9));  // 3 blocks
  EXPECT_EQ(a.table.size(), 3u);
  EXPECT_EQ(manager.num_free_blocks(), 2);
  EXPECT_FALSE(manager.allocate(b, 13));  // 4 blocks: refused, nothing taken
  EXPECT_TRUE(b.table.empty());
  EXPECT_EQ(manager.num_free_blocks(), 2);
  ASSERT_TRUE(manager.allocate(b, 1));
  ASSERT_TRUE(manager.allocate(a, 12));  // still 3 blocks
  EXPECT_EQ(a.table.size(), 3u);
  std::set<int32_t> distinct(a.table.begin(), a.table.end());
  distinct.insert(b.table.begin(), b.table.end());
  EXPECT_EQ(distinct.size(), 4u);
  manager.free(a);
  manager.free(b);
  EXPECT_EQ(manager.num_used_blocks(), 0);
  EXPECT_EQ(manager.num_free_blocks(), 5);
}

TEST(BlockManager, RepeatedPrefixIsSharedByReference) {
  BlockManager manager(8, 4);
  const std::vector<int32_t> prompt = iota_tokens(11);  // two full blocks and 3 tokens
  SequenceBlocks first;
  EXPECT_EQ(manager.match_prefix(prompt, first), 0);
  ASSERT_TRUE(manager.allocate(first, 11));
  manager.register_full_blocks(first, prompt, 11);
  EXPECT_EQ(first.num_registered, 2);

  // Same prompt while the first still runs: both full blocks are shared.
  SequenceBlocks second;
  EXPECT_EQ(manager.match_prefix(prompt, second), 8);
  ASSERT_EQ(second.table.size(), 2u);
  EXPECT_EQ(second.table[0], first.table[0]);
  EXPECT_EQ(second.table[1], first.table[1]);
  ASSERT_TRUE(manager.allocate(second, 11));
  EXPECT_NE(second.table[2], first.table[2]);
  EXPECT_EQ(manager.num_used_blocks(), 4);

  // After both finish the prefix stays cached and a third request finds it.
  manager.free(first);
  manager.free(second);
  EXPECT_EQ(manager.num_used_blocks(), 0);
  EXPECT_EQ(manager.stats().num_cached, 2);
  SequenceBlocks third;
  EXPECT_EQ(manager.match_prefix(prompt, third), 8);
  manager.free(third);
  const BlockManagerStats stats = manager.stats();
  EXPECT_EQ(stats.prefix_queries, 24);
  EXPECT_EQ(stats.prefix_hits, 16);
}

TEST(BlockManager, LastTokenIsNeverTakenFromTheCache) {
  BlockManager manager(4, 4);
  const std::vector<int32_t> prompt = iota_tokens(8);  // exactly two blocks
  SequenceBlocks a;
  ASSERT_TRUE(manager.allocate(a, 8));
  manager.register_full_blocks(a, prompt, 8);
  SequenceBlocks b;
  EXPECT_EQ(manager.match_prefix(prompt, b), 4);  // one block: the last token must run
  manager.free(a);
  manager.free(b);
  EXPECT_EQ(manager.num_used_blocks(), 0);
}

TEST(BlockManager, DifferentPrefixDoesNotMatchLaterBlocks) {
  BlockManager manager(8, 4);
  std::vector<int32_t> p1 = iota_tokens(9);
  std::vector<int32_t> p2 = p1;
  p2[0] = 100;  // same second block, different first block: chained hashes differ
  SequenceBlocks a, b;
  ASSERT_TRUE(manager.allocate(a, 9));
  manager.register_full_blocks(a, p1, 9);
  EXPECT_EQ(manager.match_prefix(p2, b), 0);
  manager.free(a);
  manager.free(b);
}

TEST(BlockManager, CachedBlocksAreEvictedWhenSpaceIsNeeded) {
  BlockManager manager(3, 2);
  const std::vector<int32_t> prompt = iota_tokens(5);
  SequenceBlocks a;
  ASSERT_TRUE(manager.allocate(a, 5));
  manager.register_full_blocks(a, prompt, 5);
  manager.free(a);
  EXPECT_EQ(manager.stats().num_cached, 2);
  // A new sequence needing every block evicts the cached ones.
  SequenceBlocks b;
  ASSERT_TRUE(manager.allocate(b, 6));
  EXPECT_EQ(manager.stats().num_cached, 0);
  manager.free(b);
  SequenceBlocks c;
  EXPECT_EQ(manager.match_prefix(prompt, c), 0);
  manager.free(c);
  EXPECT_EQ(manager.num_used_blocks(), 0);
}

TEST(BlockManager, DisabledPrefixCachingNeverMatches) {
  BlockManager manager(4, 2, /*enable_prefix_caching=*/false);
  const std::vector<int32_t> prompt = iota_tokens(5);
  SequenceBlocks a, b;
  ASSERT_TRUE(manager.allocate(a, 5));
  manager.register_full_blocks(a, prompt, 5);
  EXPECT_EQ(manager.match_prefix(prompt, b), 0);
  manager.free(a);
  manager.free(b);
}

TEST(BlockManager, ChainHashDependsOnParentAndTokens) {
  const std::vector<int32_t> t = {1, 2, 3};
  const std::vector<int32_t> u = {1, 2, 4};
  EXPECT_NE(BlockManager::chain_hash(0, t), BlockManager::chain_hash(1, t));
  EXPECT_NE(BlockManager::chain_hash(0, t), BlockManager::chain_hash(0, u));
  EXPECT_EQ(BlockManager::chain_hash(7, t), BlockManager::chain_hash(7, t));
}

}  // namespace
}  // namespace moeinfer
