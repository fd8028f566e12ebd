// The GPU decoder's choice of attention route (model/attention_route.h), on the host: chunked
// prefill after a cached prefix and mixed steps take the paged flash kernel wherever the flash
// kernels apply, and keep the per-query route under --deterministic and head dims the flash
// kernels are not compiled for; MLA models take the MLA prefill kernel for every non-decode step
// up to its widest row, else the per-query route. The GPU side
// (tests/cuda/cuda_paged_prefill_test.cpp) checks through GpuDecoder::attention_route_counts that a
// decoder takes these routes.
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
  const AttentionModelFacts mla_too_wide{
      .mla = true, .padded_head_dim = 64, .mla_latent_dim = 1024, .mla_rope_dim = 64};
  const AttentionModelFacts deterministic{.deterministic = true, .padded_head_dim = 128};
  const AttentionModelFacts wide{.padded_head_dim = 256};
  for (const AttentionModelFacts& model : {mla_too_wide, deterministic, wide}) {
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

constexpr AttentionModelFacts kDeepSeekV3Mla{
    .mla = true, .mla_latent_dim = 512, .mla_rope_dim = 64};

TEST(AttentionRoute, MlaPromptsTakeTheMlaPrefillKernelFreshOrAfterAPrefix) {
  // DeepSeek-V3 / Kimi K2 (512 + 64), and the fixtures' padded 32 + 8 and 40 + 16.
  const AttentionModelFacts fixture{.mla = true, .mla_latent_dim = 32, .mla_rope_dim = 8};
  const AttentionModelFacts odd_fixture{.mla = true, .mla_latent_dim = 40, .mla_rope_dim = 16};
  for (const AttentionModelFacts& model : {kDeepSeekV3Mla, fixture, odd_fixture}) {
    EXPECT_TRUE(mla_prefill_kernel_applies(model));
    EXPECT_FALSE(flash_prefill_kernels_apply(model));
    EXPECT_EQ(choose_attention_route(kChunkAfterPrefix, model), AttentionRoute::kMlaPrefill);
    EXPECT_EQ(choose_attention_route(kFreshPrompts, model), AttentionRoute::kMlaPrefill);
    EXPECT_EQ(choose_attention_route(kDecodeStep, model), AttentionRoute::kDecode);
  }
}

TEST(AttentionRoute, MlaRowsPastThePrefillKernelsAndDeterministicKeepThePerQueryRoute) {
  AttentionModelFacts deterministic = kDeepSeekV3Mla;
  deterministic.deterministic = true;
  AttentionModelFacts wide_latent = kDeepSeekV3Mla;  // the streaming decode kernel's ground
  wide_latent.mla_latent_dim = kMlaPrefillMaxLatent + 8;
  wide_latent.mla_rope_dim = 8;
  AttentionModelFacts wide_row = kDeepSeekV3Mla;  // a latent that fits, a rope key that does not
  wide_row.mla_latent_dim = 256;
  wide_row.mla_rope_dim = kMlaPrefillMaxRow - 256 + 8;
  AttentionModelFacts unpadded = kDeepSeekV3Mla;  // not a multiple of 8: never from the decoder
  unpadded.mla_latent_dim = 36;
  AttentionModelFacts unknown = kDeepSeekV3Mla;  // facts without the dims
  unknown.mla_latent_dim = 0;
  unknown.mla_rope_dim = 0;
  for (const AttentionModelFacts& model :
       {deterministic, wide_latent, wide_row, unpadded, unknown}) {
    EXPECT_FALSE(mla_prefill_kernel_applies(model));
    EXPECT_EQ(choose_attention_route(kChunkAfterPrefix, model), AttentionRoute::kPerQuery);
    EXPECT_EQ(choose_attention_route(kFreshPrompts, model), AttentionRoute::kPerQuery);
    EXPECT_EQ(choose_attention_route(kDecodeStep, model), AttentionRoute::kDecode);
  }
  // The widest row it takes: 512 + 64, and 256 + 320.
  AttentionModelFacts widest = kDeepSeekV3Mla;
  widest.mla_latent_dim = 256;
  widest.mla_rope_dim = kMlaPrefillMaxRow - 256;
  EXPECT_TRUE(mla_prefill_kernel_applies(widest));
}

}  // namespace
}  // namespace moeinfer
