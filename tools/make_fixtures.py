#!/usr/bin/env python3
"""Builds the tiny parity fixtures under tests/fixtures/models/ with Hugging Face transformers.

Each fixture is a random model of one family saved as transformers saves it (config.json,
model.safetensors), a tokenizer trained by tools/make_tokenizer_fixtures.py, and the
reference outputs of the checkpoint as stored: it is reloaded from disk before the reference
runs, so what the engine reads is exactly what produced the numbers.

  reference.json  prompt ids, the greedy continuation (16 tokens, KV cache on), tolerances
  logits.npy      float32 logits [n_ids, vocab] of one forward pass over the prompt

Checkpoints saved in bfloat16 are evaluated in float32 on their bf16 weights (upcast); the
engine does the same arithmetic in float32 with bf16 weights, apart from rounding the
activations to bf16 inside the bf16 matrix products.

Some fixtures rewrite config.json in the older layout (rope_theta + rope_scaling at top
level, num_experts instead of num_local_experts) as published checkpoints have it; the
reference is computed after that rewrite, so both layouts are held to transformers.

Run where torch and transformers are installed:  python3 tools/make_fixtures.py
"""
import argparse
import json
import os
import re
import shutil
import sys
import tempfile

import numpy as np
import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

VOCAB = 512
NUM_PROMPT = 12
NUM_GREEDY = 16

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.08,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)

FIXTURES = [
    dict(name="qwen3_moe_f32", cls="Qwen3Moe", dtype="float32", tokenizer="qwen", legacy_rope=False,
         config=dict(COMMON, head_dim=16, num_hidden_layers=3, intermediate_size=64,
                     moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                     norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
                     tie_word_embeddings=False, rope_theta=10000.0)),
    dict(name="qwen3_moe_bf16", cls="Qwen3Moe", dtype="bfloat16", tokenizer="qwen", legacy_rope=True,
         config=dict(COMMON, head_dim=32, num_hidden_layers=4, intermediate_size=96,
                     moe_intermediate_size=32, num_experts=10, num_experts_per_tok=3,
                     norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=2,
                     tie_word_embeddings=True, rope_theta=1000000.0,
                     rope_scaling=dict(rope_type="yarn", factor=4.0,
                                       original_max_position_embeddings=64))),
    dict(name="mixtral_f32", cls="Mixtral", dtype="float32", tokenizer="mixtral", legacy_rope=True,
         config=dict(COMMON, num_hidden_layers=3, intermediate_size=32, num_local_experts=8,
                     num_experts_per_tok=2, rope_theta=1000000.0, sliding_window=None)),
    dict(name="mixtral_bf16", cls="Mixtral", dtype="bfloat16", tokenizer="mixtral", legacy_rope=False,
         config=dict(COMMON, num_hidden_layers=3, intermediate_size=48, num_local_experts=8,
                     num_experts_per_tok=2, rope_theta=10000.0, sliding_window=8)),
    dict(name="olmoe_f32", cls="Olmoe", dtype="float32", tokenizer="qwen", legacy_rope=False,
         config=dict(COMMON, num_hidden_layers=3, intermediate_size=24, num_experts=12,
                     num_experts_per_tok=3, norm_topk_prob=False, clip_qkv=0.6,
                     rope_theta=10000.0)),
    dict(name="qwen2_moe_f32", cls="Qwen2Moe", dtype="float32", tokenizer="qwen", legacy_rope=True,
         max_shard_size="300KB",
         config=dict(COMMON, num_hidden_layers=3, intermediate_size=64, moe_intermediate_size=24,
                     shared_expert_intermediate_size=40, num_experts=8, num_experts_per_tok=2,
                     norm_topk_prob=False, mlp_only_layers=[2], decoder_sparse_step=1,
                     rope_theta=10000.0, rope_scaling=dict(rope_type="linear", factor=2.0))),
]


DEEPSEEK_MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)

FIXTURES += [
    # V2-Lite layout: no query bottleneck, greedy softmax routing, one dense first layer.
    dict(name="deepseek_v2_lite_f32", cls="DeepseekV2", dtype="float32", tokenizer="qwen",
         legacy_rope=True,
         config=dict(COMMON, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
                     intermediate_size=64, moe_intermediate_size=24, n_routed_experts=8,
                     num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
                     q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0,
                     rope_theta=10000.0, **DEEPSEEK_MLA)),
    # V2 layout: query bottleneck, group-limited routing, YaRN with its attention-scale fix.
    dict(name="deepseek_v2_f32", cls="DeepseekV2", dtype="float32", tokenizer="qwen",
         legacy_rope=True,
         config=dict(COMMON, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
                     intermediate_size=64, moe_intermediate_size=24, n_routed_experts=12,
                     num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1,
                     q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                     routed_scaling_factor=2.0, rope_theta=10000.0,
                     rope_scaling=dict(rope_type="yarn", factor=8.0,
                                       original_max_position_embeddings=32, beta_fast=32,
                                       beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
                     **DEEPSEEK_MLA)),
    # V3 layout: sigmoid + correction bias (non-zero), top-2-sum groups, YaRN, dense first layer.
    dict(name="deepseek_v3_f32", cls="DeepseekV3", dtype="float32", tokenizer="qwen",
         legacy_rope=False, correction_bias=0.15,
         config=dict(COMMON, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
                     intermediate_size=64, moe_intermediate_size=24, n_routed_experts=16,
                     num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1,
                     q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                     routed_scaling_factor=2.5, rope_theta=10000.0,
                     rope_scaling=dict(rope_type="yarn", factor=4.0,
                                       original_max_position_embeddings=64, beta_fast=32,
                                       beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
                     **DEEPSEEK_MLA)),
    # V3's published fp8 format: e4m3 weights with per-block float32 scale_inv.
    dict(name="deepseek_v3_fp8", cls="DeepseekV3", dtype="bfloat16", tokenizer="qwen",
         legacy_rope=True, correction_bias=0.15, fp8_block=[8, 8],
         config=dict(COMMON, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
                     intermediate_size=64, moe_intermediate_size=24, n_routed_experts=8,
                     num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                     q_lora_rank=24, n_group=2, topk_group=1, norm_topk_prob=True,
                     routed_scaling_factor=2.5, rope_theta=10000.0, **DEEPSEEK_MLA)),
]

# Shapes the first fixtures never covered (issue 12): widths off the GPU's 64-multiples, odd
# vocabularies, expert counts that are not a power of two, head dims of 20, 24 and 80, top-8
# routing. Two layers in bfloat16 keep each near 400 KB (the Mixtral one, whose six 112-wide
# experts alone take 258 KB a layer, near 750 KB). Appended after the others: a fixture's seed is
# its index in FIXTURES, so inserting above would regenerate the existing fixtures differently.
FIXTURES += [
    # Shared expert of width 96 beside routed experts of width 40; 6 experts; tied embeddings.
    dict(name="qwen2_moe_shared96_bf16", cls="Qwen2Moe", dtype="bfloat16", tokenizer="qwen",
         legacy_rope=False,
         config=dict(COMMON, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=40,
                     shared_expert_intermediate_size=96, num_experts=6, num_experts_per_tok=2,
                     norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=1,
                     tie_word_embeddings=True, rope_theta=10000.0)),
    # 6 experts of width 112, vocabulary 500 (a Mixtral-style tokenizer of 500 entries).
    dict(name="mixtral_e6_i112_v500_bf16", cls="Mixtral", dtype="bfloat16", tokenizer="mixtral",
         legacy_rope=True,
         config=dict(COMMON, vocab_size=500, num_hidden_layers=2, intermediate_size=112,
                     num_local_experts=6, num_experts_per_tok=2, rope_theta=1000000.0,
                     sliding_window=None)),
    # q_lora_rank 48, 12 experts in 4 groups, noaux_tc with a non-zero correction bias, YaRN
    # (factor 4, mscale 1.0), routed_scaling_factor 2.5, vocabulary 560.
    dict(name="deepseek_v3_q48_v560_bf16", cls="DeepseekV3", dtype="bfloat16", tokenizer="qwen",
         legacy_rope=True, correction_bias=0.15,
         config=dict(COMMON, vocab_size=560, num_attention_heads=4, num_key_value_heads=4,
                     num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=24,
                     n_routed_experts=12, num_experts_per_tok=3, n_shared_experts=1,
                     first_k_dense_replace=1, q_lora_rank=48, n_group=4, topk_group=2,
                     norm_topk_prob=True, routed_scaling_factor=2.5, rope_theta=10000.0,
                     rope_scaling=dict(rope_type="yarn", factor=4.0,
                                       original_max_position_embeddings=64, beta_fast=32,
                                       beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
                     **DEEPSEEK_MLA)),
    # Hidden size 80 (head_dim 20), 10 experts.
    dict(name="olmoe_h80_bf16", cls="Olmoe", dtype="bfloat16", tokenizer="qwen", legacy_rope=True,
         config=dict(COMMON, hidden_size=80, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=2, intermediate_size=16, num_experts=10,
                     num_experts_per_tok=3, norm_topk_prob=False, clip_qkv=None,
                     rope_theta=10000.0)),
    # Hidden size 96, head_dim 24, 6 experts.
    dict(name="qwen3_moe_h96_bf16", cls="Qwen3Moe", dtype="bfloat16", tokenizer="qwen",
         legacy_rope=False,
         config=dict(COMMON, hidden_size=96, head_dim=24, num_hidden_layers=2,
                     intermediate_size=64, moe_intermediate_size=24, num_experts=6,
                     num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[],
                     decoder_sparse_step=1, tie_word_embeddings=True, rope_theta=10000.0)),
    # head_dim 80 (q_dim 160 > hidden 64), top-8 of 12 experts.
    dict(name="qwen3_moe_d80_k8_bf16", cls="Qwen3Moe", dtype="bfloat16", tokenizer="qwen",
         legacy_rope=True,
         config=dict(COMMON, num_attention_heads=2, num_key_value_heads=1, head_dim=80,
                     num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=16,
                     num_experts=12, num_experts_per_tok=8, norm_topk_prob=True,
                     mlp_only_layers=[], decoder_sparse_step=1, tie_word_embeddings=True,
                     rope_theta=1000000.0)),
    # MLA ranks off the kernels' 8-multiples (the GPU pads them): kv_lora_rank 36, rope key 12,
    # nope 20, v 12; q_lora_rank 40; group-limited routing, routed scaling 16 as V2 ships.
    dict(name="deepseek_v2_l36_r12_bf16", cls="DeepseekV2", dtype="bfloat16", tokenizer="qwen",
         legacy_rope=True,
         config=dict(COMMON, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2,
                     intermediate_size=64, moe_intermediate_size=24, n_routed_experts=6,
                     num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                     q_lora_rank=40, topk_method="group_limited_greedy", n_group=3,
                     topk_group=2, routed_scaling_factor=16.0, rope_theta=10000.0,
                     kv_lora_rank=36, qk_nope_head_dim=20, qk_rope_head_dim=12, v_head_dim=12)),
]

# GLM-4.5, ERNIE 4.5 MoE and Kimi K2 (issue 18), appended so that the fixtures above keep their
# seeds. Two layers or three, small widths: each stays under 400 KB.
FIXTURES += [
    # GLM-4.5 as transformers 5 writes it (rope_parameters): per-head q/k norm, q/k/v biases, RoPE
    # over the first half of each head (the default partial_rotary_factor, inside the dict) under
    # YaRN, 8 experts in 2 groups with a non-zero correction bias, routed_scaling_factor 2.5, one
    # dense first layer, one shared expert.
    dict(name="glm4_moe_f32", cls="Glm4Moe", dtype="float32", tokenizer="qwen", legacy_rope=False,
         correction_bias=0.15, min_distinct=4, min_margin=2e-2,
         config=dict(COMMON, head_dim=16, num_hidden_layers=2, intermediate_size=64,
                     moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2,
                     n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                     norm_topk_prob=True, routed_scaling_factor=2.5, use_qk_norm=True,
                     attention_bias=True, rope_theta=10000.0,
                     rope_scaling=dict(rope_type="yarn", factor=4.0,
                                       original_max_position_embeddings=64))),
    # GLM-4.5-Air as published: rope_theta and partial_rotary_factor 0.5 at the top level, no q/k
    # norm, head_dim 32 (q_dim 128 past hidden 64), one group, 10 experts top-3, two shared
    # experts' width, and an MTP layer's tensors after the last layer (num_nextn_predict_layers 1)
    # that the forward pass does not read.
    dict(name="glm4_moe_air_bf16", cls="Glm4Moe", dtype="bfloat16", tokenizer="qwen",
         legacy_rope=True, correction_bias=0.15, mtp_tensors=True, min_distinct=4,
         config=dict(COMMON, head_dim=32, num_hidden_layers=2, intermediate_size=96,
                     moe_intermediate_size=32, n_routed_experts=10, num_experts_per_tok=3,
                     n_shared_experts=2, first_k_dense_replace=1, n_group=1, topk_group=1,
                     norm_topk_prob=True, routed_scaling_factor=1.0, use_qk_norm=False,
                     attention_bias=True, partial_rotary_factor=0.5, rope_theta=1000000.0)),
    # ERNIE 4.5 as transformers writes it (moe_num_experts, moe_k): 8 experts top-2 chosen with a
    # non-zero correction bias, two shared experts, RoPE on adjacent pairs, tied embeddings, only
    # layer 1 routed (moe_layer_start_index 1, moe_layer_end_index 1).
    dict(name="ernie4_5_moe_f32", cls="Ernie4_5_Moe", dtype="float32", tokenizer="qwen",
         legacy_rope=False, correction_bias=0.05, min_distinct=4,
         config=dict(COMMON, head_dim=16, num_hidden_layers=3, intermediate_size=64,
                     moe_intermediate_size=24, moe_num_experts=8, moe_k=2,
                     moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_end_index=1,
                     tie_word_embeddings=True, rope_theta=500000.0)),
    # rope_theta at the top level as published, moe_layer_interval 2 over 4 layers (dense, routed,
    # dense, routed), 6 experts top-3, one shared expert, untied embeddings, head_dim 24.
    dict(name="ernie4_5_moe_i2_bf16", cls="Ernie4_5_Moe", dtype="bfloat16", tokenizer="qwen",
         legacy_rope=True, correction_bias=0.05, min_distinct=4,
         config=dict(COMMON, head_dim=24, num_hidden_layers=4, intermediate_size=48,
                     moe_intermediate_size=32, moe_num_experts=6, moe_k=3,
                     moe_num_shared_experts=1, moe_layer_start_index=0, moe_layer_interval=2,
                     tie_word_embeddings=False, rope_theta=500000.0)),
    # Kimi K2. transformers has no kimi_k2 model type: the Hub checkpoint ships the remote
    # DeepseekV3 code (auto_map), and transformers' own kimi_k25 maps a kimi_k2 text_config onto
    # deepseek_v3. So the model is transformers' DeepseekV3 with K2's choices (one group, 12
    # experts top-4, one shared, one dense first layer, routed_scaling_factor 2.827, rope_theta
    # 50000, YaRN factor 32 with beta_fast = beta_slow = 1 and mscale 1 / 1), saved with
    # config.json rewritten as moonshotai/Kimi-K2-Instruct publishes it (model_type kimi_k2,
    # DeepseekV3ForCausalLM, auto_map, the remote config's routing fields); the reference reloads
    # that file with model_type deepseek_v3, as kimi_k25 does.
    dict(name="kimi_k2_f32", cls="DeepseekV3", dtype="float32", tokenizer="qwen",
         legacy_rope=True, correction_bias=0.15, kimi_k2=True, min_distinct=4, min_margin=2e-2,
         config=dict(COMMON, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                     intermediate_size=64, moe_intermediate_size=24, n_routed_experts=12,
                     num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1,
                     q_lora_rank=24, n_group=1, topk_group=1, norm_topk_prob=True,
                     routed_scaling_factor=2.827, rope_theta=50000.0,
                     rope_scaling=dict(rope_type="yarn", factor=32.0,
                                       original_max_position_embeddings=8, beta_fast=1.0,
                                       beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                     **DEEPSEEK_MLA)),
    # K2's published fp8 weights (e4m3, block-scaled; 8x8 blocks here for the small shapes).
    dict(name="kimi_k2_fp8", cls="DeepseekV3", dtype="bfloat16", tokenizer="qwen",
         legacy_rope=True, correction_bias=0.15, kimi_k2=True, fp8_block=[8, 8], min_distinct=4,
         min_route_margin=1e-2,
         config=dict(COMMON, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2,
                     intermediate_size=64, moe_intermediate_size=24, n_routed_experts=8,
                     num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                     q_lora_rank=24, n_group=1, topk_group=1, norm_topk_prob=True,
                     routed_scaling_factor=2.827, rope_theta=50000.0,
                     rope_scaling=dict(rope_type="yarn", factor=32.0,
                                       original_max_position_embeddings=8, beta_fast=1.0,
                                       beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                     **DEEPSEEK_MLA)),
]

# Llama 4 (issue 18), appended for the same reason. Chunks of 4 and 8 tokens, so that the 12-token
# prompt and the 16 greedy tokens cross several chunk boundaries, a NoPE layer (with the query
# temperature's floor_scale small enough to change the scale within 28 tokens) and a dense layer
# in each.
FIXTURES += [
    # Llama4ForCausalLM (model_type llama4_text) with rope_theta + rope_scaling (llama3) at the top
    # level as published: layers 0-2 RoPE with chunks of 4, layer 3 NoPE (no_rope_layer_interval
    # 4) and global; dense layers 0 and 2 of intermediate_size_mlp 32, routed layers 1 and 3
    # (interleave_moe_layer_step 2) with 4 experts of width 16, top-1, and the shared expert;
    # one key/value head; q/k norm after RoPE.
    dict(name="llama4_text_f32", cls="Llama4Text", model_cls="Llama4ForCausalLM",
         dtype="float32", tokenizer="qwen", legacy_rope=True, min_distinct=4,
         config=dict(COMMON, head_dim=16, num_key_value_heads=1, num_hidden_layers=4,
                     intermediate_size=16, intermediate_size_mlp=32, num_local_experts=4,
                     num_experts_per_tok=1,
                     interleave_moe_layer_step=2, no_rope_layer_interval=4,
                     attention_chunk_size=4, use_qk_norm=True, attn_temperature_tuning=True,
                     floor_scale=4, attn_scale=0.5, rope_theta=500000.0,
                     rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0,
                                       original_max_position_embeddings=16))),
    # Llama4ForConditionalGeneration as published (model_type llama4, the text model in
    # text_config, weights under language_model.*) with a one-layer vision tower of width 16
    # whose weights the engine leaves unread; rope_parameters as transformers 5 writes them;
    # head_dim 32 over 4 query heads and one key/value head; explicit moe_layers [0, 2] (layer 1
    # dense) and no_rope_layers [1, 0, 1] (layer 1 NoPE); 6 experts top-2 (the sigmoid of each
    # chosen logit scales the token's input to that expert); chunks of 8; no q/k norm.
    dict(name="llama4_vision_bf16", cls="Llama4Text", model_cls="Llama4ForConditionalGeneration",
         dtype="bfloat16", tokenizer="qwen", legacy_rope=False, min_distinct=4,
         vision=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, vision_output_dim=32, image_size=28, patch_size=14,
                     projector_input_dim=32, projector_output_dim=32),
         config=dict(COMMON, head_dim=32, num_key_value_heads=1, num_hidden_layers=3,
                     intermediate_size=24, intermediate_size_mlp=64, num_local_experts=6,
                     num_experts_per_tok=2, moe_layers=[0, 2], no_rope_layers=[1, 0, 1],
                     attention_chunk_size=8, use_qk_norm=False, attn_temperature_tuning=True,
                     floor_scale=8, attn_scale=0.3, rope_theta=500000.0)),
]

# GPT-OSS (issue 18), appended after Llama 4 so that the fixtures above keep their seeds. Attention
# sinks, q/k/v/o biases, sliding-window layers alternating with full ones (a window of 3 or 4 tokens, so
# that the 12-token prompt and its continuation slide past it), YaRN with truncate false as
# published, a router bias, expert biases and a swiglu_limit low enough that the clamps bind on
# the small random activations. transformers initialises sinks and biases to zero or near it, so
# make_fixture draws them again (gpt_oss=True).
GPT_OSS_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                    beta_fast=32.0, beta_slow=1.0, truncate=False)
FIXTURES += [
    # As transformers 5 writes it (rope_parameters), float32, three layers (sliding, full,
    # sliding), 6 experts top-2.
    dict(name="gpt_oss_f32", cls="GptOss", dtype="float32", tokenizer="qwen", legacy_rope=False,
         gpt_oss=True, min_distinct=4,
         config=dict(COMMON, head_dim=16, num_hidden_layers=3, intermediate_size=16,
                     num_local_experts=6, num_experts_per_tok=2, sliding_window=4,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                     swiglu_limit=1.0, attention_bias=True, rope_theta=150000.0,
                     rope_scaling=GPT_OSS_YARN)),
    # As openai/gpt-oss-* publish it (rope_theta and rope_scaling at the top level), bfloat16,
    # head_dim 24 (q_dim 96 past hidden 64), one key/value head, 6 experts top-3, window 3.
    dict(name="gpt_oss_d24_bf16", cls="GptOss", dtype="bfloat16", tokenizer="qwen",
         legacy_rope=True, gpt_oss=True, min_distinct=4,
         config=dict(COMMON, head_dim=24, num_key_value_heads=1, num_hidden_layers=2,
                     intermediate_size=48, num_local_experts=6, num_experts_per_tok=3,
                     sliding_window=3, layer_types=["sliding_attention", "full_attention"],
                     swiglu_limit=0.8, attention_bias=True, rope_theta=150000.0,
                     rope_scaling=GPT_OSS_YARN)),
    # The published MXFP4 experts: gate_up_proj and down_proj stored as *_blocks / *_scales
    # (quantize_mxfp4_checkpoint), the rest in bfloat16, quantization_config as published. The
    # reference is transformers loading that checkpoint with Mxfp4Config(dequantize=True).
    dict(name="gpt_oss_mxfp4", cls="GptOss", dtype="bfloat16", tokenizer="qwen",
         legacy_rope=True, gpt_oss=True, mxfp4=True, min_distinct=4,
         config=dict(COMMON, head_dim=16, num_hidden_layers=2, intermediate_size=64,
                     num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                     layer_types=["sliding_attention", "full_attention"], swiglu_limit=7.0,
                     attention_bias=True, rope_theta=150000.0, rope_scaling=GPT_OSS_YARN)),
]

# Qwen3-Next (issue 18), appended after GPT-OSS so that the fixtures above keep their seeds. Layers
# mix Gated DeltaNet (linear_attention) and gated full attention; the prompt (12 tokens) is longer
# than the conv kernel, so the conv window and the recurrent state carry across the prompt and into
# every cached decode step. The zero-centred norms, the gated norm, dt_bias and A_log get random
# values (perturb_qwen3_next) so that none of them sits at an identity.
FIXTURES += [
    # transformers 5's layout (rope_parameters, layer_types written out): linear, full, linear;
    # 2 key heads serving 4 value heads (Dk 16, Dv 8), conv kernel 4, RoPE over a quarter of each
    # head (the default partial_rotary_factor), 6 experts top-2 renormalised beside a gated shared
    # expert, layer 1 dense (mlp_only_layers), tied embeddings.
    dict(name="qwen3_next_f32", cls="Qwen3Next", dtype="float32", tokenizer="qwen",
         legacy_rope=False, qwen3_next=True, min_distinct=4, min_margin=2e-2,
         router_scale=4.0, min_route_logit_margin=4e-2,
         config=dict(COMMON, head_dim=16, num_hidden_layers=3, intermediate_size=48,
                     moe_intermediate_size=16, shared_expert_intermediate_size=24,
                     num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
                     mlp_only_layers=[1], decoder_sparse_step=1, tie_word_embeddings=True,
                     layer_types=["linear_attention", "full_attention", "linear_attention"],
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                     linear_value_head_dim=8, linear_conv_kernel_dim=4,
                     rope_theta=10000.0)),
    # The published layout: rope_theta and partial_rotary_factor (0.5) at the top level,
    # full_attention_interval 3 instead of layer_types (linear, linear, full), one value head per
    # key head (Dk 24, Dv 16), conv kernel 3, head_dim 32 with one KV head, 6 experts top-3 not
    # renormalised, untied embeddings, and mtp.* tensors that the forward pass leaves unread.
    dict(name="qwen3_next_bf16", cls="Qwen3Next", dtype="bfloat16", tokenizer="qwen",
         legacy_rope=True, qwen3_next=True, qwen3_next_interval=3, min_distinct=4,
         router_scale=4.0, min_route_logit_margin=4e-2,
         config=dict(COMMON, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                     num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=32,
                     shared_expert_intermediate_size=40, num_experts=6, num_experts_per_tok=3,
                     norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=1,
                     tie_word_embeddings=False,
                     layer_types=["linear_attention", "linear_attention", "full_attention"],
                     linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=24,
                     linear_value_head_dim=16, linear_conv_kernel_dim=3,
                     partial_rotary_factor=0.5, rope_theta=1000000.0)),
    # Qwen3.5-MoE as transformers writes the vision-language checkpoint it publishes
    # (Qwen3_5MoeForConditionalGeneration: text_config, model.language_model.*, a vision tower
    # model.visual.* of one tiny block that the engine does not read): the split in_proj_qkv /
    # in_proj_z / in_proj_b / in_proj_a, M-RoPE sections over the quarter of each head that rotates
    # (text positions: the 1-D RoPE), every layer routed with renormalised top-2 of 6 experts,
    # the LM head tied by the wrapper's tie_word_embeddings.
    dict(name="qwen3_5_moe_f32", cls="Qwen3_5Moe", model_cls="Qwen3_5MoeForConditionalGeneration",
         dtype="float32", tokenizer="qwen",
         legacy_rope=False, qwen3_next=True, qwen3_5_moe=True, min_distinct=4,
         tie_word_embeddings=True,
         vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                            out_hidden_size=64, num_position_embeddings=16, patch_size=4,
                            temporal_patch_size=2, spatial_merge_size=2),
         config=dict(COMMON, head_dim=16, num_hidden_layers=3, moe_intermediate_size=16,
                     shared_expert_intermediate_size=24, num_experts=6, num_experts_per_tok=2,
                     layer_types=["linear_attention", "full_attention", "linear_attention"],
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                     linear_value_head_dim=8, linear_conv_kernel_dim=4, rope_theta=10000.0,
                     rope_scaling=dict(partial_rotary_factor=0.25, mrope_section=[1, 1, 0],
                                       mrope_interleaved=True))),
    # The same in bfloat16 with other shapes: four layers (linear, full, linear, full), one value
    # head per key head (Dk 24, Dv 16), conv kernel 3, head_dim 32 over 2 query heads and one
    # key/value head, M-RoPE sections (2, 1, 1) over its 8 rotary dims, 4 experts top-2, an
    # untied LM head.
    dict(name="qwen3_5_moe_bf16", cls="Qwen3_5Moe", model_cls="Qwen3_5MoeForConditionalGeneration",
         dtype="bfloat16", tokenizer="qwen", legacy_rope=False, qwen3_next=True, qwen3_5_moe=True,
         min_distinct=4, tie_word_embeddings=False, min_route_margin=3e-3,
         vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                            out_hidden_size=64, num_position_embeddings=16, patch_size=4,
                            temporal_patch_size=2, spatial_merge_size=2),
         config=dict(COMMON, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                     num_hidden_layers=4, moe_intermediate_size=24,
                     shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                     layer_types=["linear_attention", "full_attention", "linear_attention",
                                  "full_attention"],
                     linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=24,
                     linear_value_head_dim=16, linear_conv_kernel_dim=3, rope_theta=1000000.0,
                     rope_scaling=dict(partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
                                       mrope_interleaved=True))),
]


def perturb_qwen3_next(model):
    """Random values where Qwen3-Next initialises to an identity: the zero-centred RMSNorm
    weights (1 + w), the gated norm (ones), dt_bias (ones); A_log within log(0.05..1) so that the
    recurrent state decays slowly enough to matter over the prompt."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.2)
            elif name.endswith("dt_bias"):
                param.normal_(0.0, 0.5)
            elif name.endswith("A_log"):
                param.copy_(torch.empty_like(param).uniform_(0.05, 1.0).log())


def rewrite_qwen3_next_interval(config_path, interval):
    """full_attention_interval instead of the written-out layer_types, as Qwen/Qwen3-Next-80B-A3B
    publishes it (transformers derives the same list from it)."""
    with open(config_path) as f:
        cfg = json.load(f)
    expected = ["linear_attention" if (i + 1) % interval else "full_attention"
                for i in range(cfg["num_hidden_layers"])]
    assert cfg.pop("layer_types") == expected
    cfg["full_attention_interval"] = interval
    with open(config_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def add_qwen3_next_mtp_tensors(out_dir, hidden, dtype):
    """A few tensors of the MTP head Qwen3-Next's checkpoints carry (mtp.*), which the
    reference's forward pass (and the engine) leaves unread."""
    from safetensors.torch import load_file, save_file
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden).to(dtype)
    tensors["mtp.norm.weight"] = torch.zeros(hidden, dtype=dtype)
    tensors["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(hidden, dtype=dtype)
    save_file(tensors, path, metadata={"format": "pt"})


# Fields of moonshotai/Kimi-K2-Instruct's config.json that transformers' DeepseekV3Config does not
# write (the remote configuration_deepseek.py reads them), with the published values.
KIMI_K2_HUB_FIELDS = dict(
    model_type="kimi_k2",
    architectures=["DeepseekV3ForCausalLM"],
    auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
              "AutoModel": "modeling_deepseek.DeepseekV3Model",
              "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    aux_loss_alpha=0.001, ep_size=1, moe_layer_freq=1, num_nextn_predict_layers=0,
    pretraining_tp=1, scoring_func="sigmoid", seq_aux=True, topk_method="noaux_tc",
    use_cache=True)


def rewrite_kimi_k2_config(config_path):
    """config.json as the Kimi K2 Hub checkpoint has it (see KIMI_K2_HUB_FIELDS); rope_interleave
    is left out, as there (the remote code always interleaves, DeepseekV3Config's default)."""
    with open(config_path) as f:
        cfg = json.load(f)
    cfg.pop("rope_interleave", None)
    cfg.update(KIMI_K2_HUB_FIELDS)
    with open(config_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def add_mtp_tensors(out_dir, num_layers, hidden, dtype):
    """GLM-4.5 stores its MTP module as one more layer after the last (model.layers.<L>.*:
    eh_proj, enorm, hnorm, shared_head.norm, ...); a few of its tensors, which the forward pass
    of transformers (and the engine) leaves unread."""
    from safetensors.torch import load_file, save_file
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    p = f"model.layers.{num_layers}."
    tensors[p + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden).to(dtype)
    tensors[p + "enorm.weight"] = torch.ones(hidden, dtype=dtype)
    tensors[p + "hnorm.weight"] = torch.ones(hidden, dtype=dtype)
    tensors[p + "shared_head.norm.weight"] = torch.ones(hidden, dtype=dtype)
    save_file(tensors, path, metadata={"format": "pt"})


# Linear weights that DeepSeek-V3's published checkpoint stores in fp8; the router, norms,
# embeddings and LM head stay in higher precision.
FP8_PATTERN = re.compile(r"\.(self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
                         r"|mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj))"
                         r"\.weight$")


def quantize_fp8_checkpoint(out_dir, block):
    """Rewrites model.safetensors with block-scaled e4m3 weights (the DeepSeek-V3 recipe: one
    scale per block, amax / 448, stored as weight_scale_inv) and adds quantization_config."""
    from safetensors.torch import load_file, save_file
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    out = {}
    for name, w in tensors.items():
        if not FP8_PATTERN.search(name):
            out[name] = w
            continue
        rows, cols = w.shape
        br, bc = block
        nr, nc = -(-rows // br), -(-cols // bc)
        w32 = w.float()
        scale = torch.empty(nr, nc)
        q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        for i in range(nr):
            for j in range(nc):
                tile = w32[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
                s_ = tile.abs().max().clamp(min=1e-12) / 448.0
                scale[i, j] = s_
                q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (tile / s_).to(torch.float8_e4m3fn)
        out[name] = q
        out[name + "_scale_inv"] = scale
    save_file(out, path, metadata={"format": "pt"})
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                      weight_block_size=list(block))
    with open(config_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


# MXFP4 as gpt-oss publishes it: 32 values of a row share one power-of-two scale (E8M0 byte,
# exponent + 127), each value is an e2m1 code (the 16 values below), two codes a byte, the
# earlier value in the low nibble. The blocks of an [E, in, out] parameter are stored per output
# row: <name>_blocks [E, out, in / 32, 16] and <name>_scales [E, out, in / 32].
FP4_CODES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                          -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def quantize_mxfp4(w):
    """w [E, in, out] -> (blocks uint8 [E, out, in/32, 16], scales uint8 [E, out, in/32])."""
    rows = w.float().transpose(1, 2).contiguous()  # [E, out, in]
    E, out, inner = rows.shape
    assert inner % 32 == 0, f"MXFP4 needs the input width to be a multiple of 32, found {inner}"
    groups = rows.reshape(E, out, inner // 32, 32)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0 ** -126)
    exponent = torch.ceil(torch.log2(amax / 6.0))  # largest code 6 * 2^exponent covers amax
    scaled = groups / torch.pow(2.0, exponent)[..., None]
    codes = (scaled[..., None] - FP4_CODES).abs().argmin(dim=-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponent + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def quantize_mxfp4_checkpoint(out_dir):
    """Rewrites the experts' gate_up_proj and down_proj as MXFP4 blocks and scales (their biases
    and every other tensor stay as saved) and adds the published quantization_config."""
    from safetensors.torch import load_file, save_file
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    out = {}
    for name, w in tensors.items():
        if not re.search(r"\.mlp\.experts\.(gate_up_proj|down_proj)$", name):
            out[name] = w
            continue
        out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(w)
    save_file(out, path, metadata={"format": "pt"})
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = dict(
        quant_method="mxfp4",
        modules_to_not_convert=["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                "model.embed_tokens", "lm_head"])
    with open(config_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def randomize_gpt_oss(model):
    """Sinks, attention biases, router and expert biases drawn again: transformers starts them at
    zero (or near it), which would leave their arithmetic untested."""
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.sinks.normal_(0.0, 1.0)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                proj.bias.normal_(0.0, 0.1)
            layer.mlp.router.bias.normal_(0.0, 0.5)
            layer.mlp.experts.gate_up_proj_bias.normal_(0.0, 0.3)
            layer.mlp.experts.down_proj_bias.normal_(0.0, 0.1)


def published_gpt_oss_rope(config_path):
    """rope_scaling as openai/gpt-oss-* publish it: rope_type only (no legacy `type` twin)."""
    with open(config_path) as f:
        cfg = json.load(f)
    if cfg.get("rope_scaling"):
        cfg["rope_scaling"].pop("type", None)
    with open(config_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def build_config(spec):
    cfg_cls = getattr(transformers, spec["cls"] + "Config")
    kwargs = dict(spec["config"])
    if spec.get("qwen3_5_moe"):
        # The text model's fields live in text_config; the wrapper ties (or not) the LM head.
        text = {k: v for k, v in kwargs.items()
                if k not in ("rope_theta", "rope_scaling", "bos_token_id", "eos_token_id",
                             "pad_token_id")}
        text["rope_parameters"] = dict(rope_type="default", rope_theta=kwargs["rope_theta"],
                                       **kwargs["rope_scaling"])
        return cfg_cls(text_config=text, vision_config=spec["vision_config"],
                       tie_word_embeddings=spec.get("tie_word_embeddings", False))
    rope_scaling = kwargs.pop("rope_scaling", None)
    theta = kwargs.pop("rope_theta")
    rope = dict(rope_type="default", rope_theta=theta)
    if rope_scaling:
        rope.update(rope_scaling)
    config = cfg_cls(rope_parameters=rope, **kwargs)
    if spec.get("vision"):  # Llama 4's multimodal layout: the text config nested
        config = transformers.Llama4Config(
            text_config=config, vision_config=transformers.Llama4VisionConfig(**spec["vision"]))
    return config


def rewrite_legacy_rope(config_path):
    """Rewrites rope_parameters into rope_theta + rope_scaling, as published configs have it."""
    with open(config_path) as f:
        root = json.load(f)
    cfg = root.get("text_config", root)  # Llama 4's multimodal layout nests the text model
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:  # GLM-4.5 publishes it at the top level
        cfg["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = dict(rope, type=rope["rope_type"])
    else:
        cfg["rope_scaling"] = None
    if "num_local_experts" in cfg and cfg["model_type"] in ("qwen3_moe", "qwen2_moe", "olmoe"):
        cfg["num_experts"] = cfg.pop("num_local_experts")
    if "num_local_experts" in cfg and cfg["model_type"].startswith("deepseek"):
        cfg["n_routed_experts"] = cfg.pop("num_local_experts")
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    with open(config_path, "w") as f:
        json.dump(root, f, indent=2, sort_keys=True)


def make_tokenizer(kind, out_dir, vocab_size):
    """A tokenizer of at most vocab_size entries (the fixture's vocabulary)."""
    import make_tokenizer_fixtures as tok
    if kind == "qwen":
        tokenizer = tok.build_qwen_style(vocab_size)
    else:
        tokenizer = tok.build_mixtral_style(vocab_size)
    assert tokenizer.get_vocab_size(with_added_tokens=True) <= vocab_size
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))


def top2_margin(logits):
    top = torch.topk(logits.float(), 2, dim=-1).values
    return (top[..., 0] - top[..., 1]).min().item()


def route_margin(model, ids, in_logits=False):
    """The smallest gap, over MoE layers and positions, between the k-th and (k+1)-th expert's
    selection score: sigmoid + correction bias for a DeepSeek-V3-style router, the softmax
    probability for a softmax router (Qwen). A near-tie there lets bf16 rounding pick another
    expert, which changes that position's logits far more than rounding does: the GPU's parity
    bound assumes the reference's routing is clear. in_logits: a softmax router's gap in its
    logits instead (rounding moves logits by a relative amount, so a decided router whose k-th
    probability is small still makes a clear choice there)."""
    scores = []

    def catch(module, inputs, _):
        x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
        logits = x @ module.weight.float().t()
        if hasattr(module, "e_score_correction_bias"):
            scores.append(torch.sigmoid(logits) + module.e_score_correction_bias.float())
        else:
            scores.append(logits if in_logits else torch.softmax(logits, dim=-1))

    gates = [m for name, m in model.named_modules()
             if name.endswith("mlp.gate") and getattr(m, "weight", None) is not None]
    hooks = [g.register_forward_hook(catch) for g in gates]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    config = getattr(model.config, "text_config", model.config)
    k = config.num_experts_per_tok
    return min((top[:, k - 1] - top[:, k]).min().item()
               for top in (s.topk(k + 1, dim=-1).values for s in scores))


def make_fixture(spec, root, seed, with_tokenizer):
    out_dir = os.path.join(root, spec["name"])
    vocab = spec["config"]["vocab_size"]
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    torch.manual_seed(seed)
    config = build_config(spec)
    model_cls = getattr(transformers, spec.get("model_cls", spec["cls"] + "ForCausalLM"))
    model = model_cls(config).eval()
    if spec.get("correction_bias"):
        # DeepSeek-V3 and GLM keep it on the router (mlp.gate), ERNIE in mlp.gate.moe_statics.
        with torch.no_grad():
            for layer in model.model.layers:
                for module in layer.mlp.modules():
                    bias = getattr(module, "e_score_correction_bias", None)
                    if isinstance(bias, torch.Tensor):
                        bias.normal_(0.0, spec["correction_bias"])
    if spec.get("router_scale"):
        # Random routers at the initializer's scale score 6 experts nearly alike, so the reference's
        # own top-k is a near-tie that bf16 rounding flips; a trained router is far more decided.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    param.mul_(spec["router_scale"])
    if spec.get("qwen3_next"):
        perturb_qwen3_next(model)
    if spec.get("gpt_oss"):
        randomize_gpt_oss(model)
    if spec["dtype"] == "bfloat16":
        model = model.to(torch.bfloat16)
    if spec["dtype"] == "float16":
        model = model.to(torch.float16)
    model.save_pretrained(out_dir, max_shard_size=spec.get("max_shard_size", "50GB"))
    gen_cfg = os.path.join(out_dir, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)
    if spec["legacy_rope"]:
        rewrite_legacy_rope(os.path.join(out_dir, "config.json"))
    if spec.get("fp8_block"):
        quantize_fp8_checkpoint(out_dir, spec["fp8_block"])
    if spec.get("gpt_oss") and spec["legacy_rope"]:
        published_gpt_oss_rope(os.path.join(out_dir, "config.json"))
    if spec.get("mxfp4"):
        quantize_mxfp4_checkpoint(out_dir)
    dequantised_dir = None
    if spec.get("int4"):
        import int4_checkpoint
        dequantised_dir = tempfile.mkdtemp(prefix=spec["name"] + "_dequantised_")
        int4_checkpoint.quantise_checkpoint(out_dir, dequantised_dir, spec["int4"], seed)
    if spec.get("kimi_k2"):
        rewrite_kimi_k2_config(os.path.join(out_dir, "config.json"))
    if spec.get("qwen3_next_interval"):
        rewrite_qwen3_next_interval(os.path.join(out_dir, "config.json"),
                                    spec["qwen3_next_interval"])
        add_qwen3_next_mtp_tensors(out_dir, config.hidden_size,
                                   torch.bfloat16 if spec["dtype"] == "bfloat16" else torch.float32)
    if spec.get("mtp_tensors"):
        add_mtp_tensors(out_dir, config.num_hidden_layers, config.hidden_size,
                        torch.bfloat16 if spec["dtype"] == "bfloat16" else torch.float32)
    if with_tokenizer:
        make_tokenizer(spec["tokenizer"], out_dir, vocab)

    if spec.get("kimi_k2"):
        # The file says kimi_k2, which transformers does not know; read it as deepseek_v3.
        with open(os.path.join(out_dir, "config.json")) as f:
            as_v3 = dict(json.load(f), model_type="deepseek_v3")
        reference = model_cls.from_pretrained(
            out_dir, config=transformers.DeepseekV3Config.from_dict(as_v3),
            dtype=torch.float32).eval()
    elif spec.get("mxfp4"):
        # transformers' own MXFP4 dequantiser (integrations/mxfp4.py) reads the blocks.
        reference = model_cls.from_pretrained(
            out_dir, dtype=torch.float32,
            quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    elif dequantised_dir:
        # transformers reads GPTQ and AWQ only through GPU packages: the reference runs on the
        # packed tensors as the script dequantised them.
        reference = model_cls.from_pretrained(dequantised_dir, dtype=torch.float32).eval()
        shutil.rmtree(dequantised_dir)
    else:
        reference = model_cls.from_pretrained(out_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    # Choose a prompt whose greedy path has a clear winner at every step, so that a correct
    # engine cannot flip a token on rounding alone, and (where the spec asks) at least
    # min_distinct different tokens, so that the cached decode steps are not one repeated token.
    # min_margin: a float32 fixture may ask for the bf16 margin, so that the GPU (which runs it in
    # bf16) keeps the greedy path too. min_route_margin: every MoE layer's routing of the prompt
    # and continuation must be clear by that much too (route_margin).
    needed = spec.get("min_margin", 1e-3 if spec["dtype"] == "float32" else 2e-2)
    min_distinct = spec.get("min_distinct", 1)
    for attempt in range(50):
        prompt = torch.randint(0, vocab, (1, NUM_PROMPT), generator=generator)
        with torch.no_grad():
            logits = reference(prompt).logits[0]
            out = reference.generate(prompt, attention_mask=torch.ones_like(prompt),
                                     max_new_tokens=NUM_GREEDY, do_sample=False,
                                     eos_token_id=None, pad_token_id=0, use_cache=True)
            full = reference(out).logits[0, NUM_PROMPT - 1:-1]
        margin = top2_margin(full)
        if spec["cls"] == "Llama4Text":
            # The greedy tokens come from generate's cache (chunked layers keep a window of it),
            # the margin from one uncached pass: both must pick the same tokens.
            assert full.argmax(-1).tolist() == out[0, NUM_PROMPT:].tolist(), spec["name"]
        route_ok = ("min_route_margin" not in spec or
                    route_margin(reference, out) >= spec["min_route_margin"])
        route_ok = route_ok and ("min_route_logit_margin" not in spec or
                                 route_margin(reference, out, in_logits=True) >=
                                 spec["min_route_logit_margin"])
        if (margin >= needed and route_ok and
                len(set(out[0, NUM_PROMPT:].tolist())) >= min_distinct):
            break
    else:
        raise SystemExit(f"{spec['name']}: no prompt with a top-2 margin of {needed}, "
                         f"{min_distinct} distinct greedy tokens and clear routing")
    greedy = out[0, NUM_PROMPT:].tolist()
    np.save(os.path.join(out_dir, "logits.npy"), logits.float().numpy())
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(dict(family="kimi_k2" if spec.get("kimi_k2") else config.model_type, checkpoint_dtype=spec["dtype"],
                       prompt_ids=prompt[0].tolist(), greedy_ids=greedy,
                       greedy_min_top2_margin=margin,
                       max_rel_error=1e-4 if spec["dtype"] == "float32" else 2e-2,
                       transformers_version=transformers.__version__,
                       torch_version=torch.__version__), f, indent=2)
    size = sum(os.path.getsize(os.path.join(out_dir, n)) for n in os.listdir(out_dir))
    print(f"{spec['name']:16s} {size / 1e6:6.2f} MB  margin {margin:.4f}  greedy {greedy}")


# GPTQ and AWQ 4-bit checkpoints (issue 17), appended so that the fixtures above keep their
# seeds. Saved in float16 as the tools publish them; the packed linears are made by
# tools/int4_checkpoint.py and the reference runs on their values dequantised again from the
# packed words. Two layers, four experts, groups of 32 inputs: each under 300 KB.
FIXTURES += [
    # GPTQ as AutoGPTQ writes it (checkpoint_format gptq: zero points stored minus one),
    # symmetric, act-order (desc_act) groups from a shuffled g_idx; tied embeddings.
    dict(name="qwen3_moe_gptq", cls="Qwen3Moe", dtype="float16", tokenizer="qwen",
         legacy_rope=True, min_distinct=3,
         int4=dict(method="gptq", group_size=32, desc_act=True, sym=True,
                   checkpoint_format="gptq"),
         config=dict(COMMON, head_dim=16, num_hidden_layers=2, intermediate_size=64,
                     moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                     norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1,
                     tie_word_embeddings=True, rope_theta=1000000.0)),
    # GPTQModel's gptq_v2 (zero points as they are), asymmetric, plain groups; DeepSeek-V2-Lite's
    # MLA projections, a dense first layer and shared experts quantised too.
    dict(name="deepseek_v2_lite_gptq_v2", cls="DeepseekV2", dtype="float16", tokenizer="qwen",
         legacy_rope=True, min_distinct=3,
         int4=dict(method="gptq", group_size=32, desc_act=False, sym=False,
                   checkpoint_format="gptq_v2"),
         config=dict(COMMON, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                     intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
                     num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                     q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0,
                     tie_word_embeddings=True, rope_theta=10000.0, **DEEPSEEK_MLA)),
    # AutoAWQ's gemm layout (outputs packed in AWQ's order, zero points as they are); Qwen2-MoE's
    # attention biases and its shared expert (whose sigmoid gate stays in float16).
    dict(name="qwen2_moe_awq", cls="Qwen2Moe", dtype="float16", tokenizer="qwen",
         legacy_rope=True, min_distinct=2,
         int4=dict(method="awq", group_size=32, sym=False,
                   modules_to_not_convert=["shared_expert_gate"]),
         config=dict(COMMON, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=32,
                     shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                     norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=1,
                     tie_word_embeddings=True, rope_theta=10000.0)),
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(HERE, "..", "tests", "fixtures", "models"))
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--no-tokenizer", action="store_true", help="skip the tokenizers")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    for i, spec in enumerate(FIXTURES):
        if args.only and spec["name"] not in args.only:
            continue
        make_fixture(spec, args.out, args.seed + 100 * i, not args.no_tokenizer)


if __name__ == "__main__":
    main()
