// The GPU decoder's choice of attention route (model/attention_route.h), on the host: chunked
// prefill after a cached prefix and mixed steps take the paged flash kernel wherever the flash
// kernels apply, and keep the per-query route under MLA, --deterministic and head dims the
// flash kernels are not compiled for. The GPU side (tests/cuda/cuda_paged_prefill_test.cpp)
// checks through GpuDecoder::attention_route_counts that a decoder takes these routes.
#include "model/attention_route.h"

#include <gtest/gtest.h>

namespace moeinfer {
namespace {

constexpr AttentionStepShape kDecodeStep{.one_token_each = true, .all_from_position_0 = false};
constexpr AttentionStepShape kFreshPrompts{.one_token_each = false, .all_from_position_0 = true};
constexpr AttentionStepShape kChunkAfterPrefix{.one_token_each = false,
                                               .all_from_position_0 = false};

TEST(AttentionRoute, ChunkAfterACachedPrefixTakesThePagedFlashKernel) {
  for (int64_t head_dim : {64, 128}) {
    const AttentionModelFacts model{.padded_head_dim = head_dim};
    EXPECT_EQ(choose_attention_route(kChunkAfterPrefix, model), AttentionRoute::kPagedPrefill);
    EXPECT_EQ(choose_attention_route(kFreshPrompts, model), AttentionRoute::kPrefill);
    EXPECT_EQ(choose_attention_route(kDecodeStep, model), AttentionRoute::kDecode);
  }
}

TEST(AttentionRoute, WhatTheFlashKernelsDoNotCoverKeepsThePerQueryRoute) {
  const AttentionModelFacts mla{.mla = true, .padded_head_dim = 64};
  const AttentionModelFacts deterministic{.deterministic = true, .padded_head_dim = 128};
  const AttentionModelFacts wide{.padded_head_dim = 256};
  for (const AttentionModelFacts& model : {mla, deterministic, wide}) {
    EXPECT_FALSE(flash_prefill_kernels_apply(model));
    EXPECT_EQ(choose_attention_route(kChunkAfterPrefix, model), AttentionRoute::kPerQuery);
    EXPECT_EQ(choose_attention_route(kFreshPrompts, model), AttentionRoute::kPerQuery);
    EXPECT_EQ(choose_attention_route(kDecodeStep, model), AttentionRoute::kDecode);
  }
}

TEST(AttentionRoute, GqaGroupsPastTheKernelsRowsKeepThePerQueryRoute) {
  const AttentionModelFacts packed{.padded_head_dim = 128, .gqa_group = kPagedPrefillMaxGqaGroup};
  const AttentionModelFacts wider{.padded_head_dim = 128,
                                  .gqa_group = kPagedPrefillMaxGqaGroup + 1};
  EXPECT_EQ(choose_attention_route(kChunkAfterPrefix, packed), AttentionRoute::kPagedPrefill);
  EXPECT_EQ(choose_attention_route(kChunkAfterPrefix, wider), AttentionRoute::kPerQuery);
  EXPECT_EQ(choose_attention_route(kFreshPrompts, wider), AttentionRoute::kPrefill);
}

}  // namespace
}  // namespace moeinfer
