#!/usr/bin/env python3
"""Writes config.json fixtures for the four MoE families, and what transformers makes of them.

For each case a config class from transformers is instantiated with non-default values and
serialised. "params" cases are what save_pretrained writes (`rope_parameters`, and only the
values that differ from the class defaults, so the parser's defaults are checked too); "legacy"
cases are every field, rewritten into the layout published checkpoints use (`rope_theta` + `rope_scaling`
with a "type" key, `num_experts` for Qwen3-MoE, `torch_dtype`). Each written file is then loaded
back with transformers and a tiny model is built from it, and the values the *modeling* code
resolves (head_dim, which layers are sparse, biases, router renormalisation, RoPE type, theta and
factor) go to expected.json. tests/io/model_config_test.cpp holds parse_model_config to them.

Usage: python3 tools/dump_reference_configs.py [--out tests/fixtures/configs]
"""
import argparse
import json
import os

import torch
import transformers
from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers import MixtralForCausalLM, OlmoeForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=80, num_attention_heads=4,
             max_position_embeddings=8192, rms_norm_eps=1e-5)

CASES = [
    # name, config class, model class, layout, kwargs
    ("qwen3_moe_legacy_yarn", Qwen3MoeConfig, Qwen3MoeForCausalLM, "legacy",
     dict(SMALL, num_hidden_layers=5, num_key_value_heads=2, head_dim=32, moe_intermediate_size=24,
          num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=True,
          rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0,
                               original_max_position_embeddings=2048),
          eos_token_id=[5, 7], bos_token_id=3, dtype="bfloat16")),
    ("qwen3_moe_params_dense_layers", Qwen3MoeConfig, Qwen3MoeForCausalLM, "params",
     dict(SMALL, num_hidden_layers=6, num_key_value_heads=1, moe_intermediate_size=24,
          num_experts=4, num_experts_per_tok=3, decoder_sparse_step=2, mlp_only_layers=[3],
          attention_bias=True, use_sliding_window=True, sliding_window=512,
          rope_parameters=dict(rope_type="default", rope_theta=500000.0), eos_token_id=9)),
    ("mixtral_legacy_linear", MixtralConfig, MixtralForCausalLM, "legacy",
     dict(SMALL, num_hidden_layers=3, num_key_value_heads=2, num_local_experts=5,
          num_experts_per_tok=2, sliding_window=None,
          rope_parameters=dict(rope_type="linear", rope_theta=2000000.0, factor=2.0),
          dtype="float16")),
    ("mixtral_params_dynamic", MixtralConfig, MixtralForCausalLM, "params",
     dict(SMALL, num_hidden_layers=2, num_key_value_heads=4, head_dim=8, num_local_experts=3,
          num_experts_per_tok=1, sliding_window=256, tie_word_embeddings=True,
          rope_parameters=dict(rope_type="dynamic", rope_theta=1000000.0, factor=3.0))),
    ("olmoe_legacy_default", OlmoeConfig, OlmoeForCausalLM, "legacy",
     dict(SMALL, num_hidden_layers=2, num_experts=8, num_experts_per_tok=4, clip_qkv=8.0,
          norm_topk_prob=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    ("olmoe_params_llama3", OlmoeConfig, OlmoeForCausalLM, "params",
     dict(SMALL, num_hidden_layers=3, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
          norm_topk_prob=True, attention_bias=True,
          rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                               low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=1024))),
    ("qwen2_moe_legacy_dynamic", Qwen2MoeConfig, Qwen2MoeForCausalLM, "legacy",
     dict(SMALL, num_hidden_layers=4, num_key_value_heads=4, moe_intermediate_size=16,
          shared_expert_intermediate_size=40, num_experts=6, num_experts_per_tok=2,
          mlp_only_layers=[0], rope_parameters=dict(rope_type="dynamic", rope_theta=1000000.0,
                                                    factor=2.0),
          eos_token_id=[11, 12], dtype="bfloat16")),
    ("qwen2_moe_params_yarn", Qwen2MoeConfig, Qwen2MoeForCausalLM, "params",
     dict(SMALL, num_hidden_layers=6, num_key_value_heads=2, moe_intermediate_size=16,
          shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=4,
          decoder_sparse_step=3, qkv_bias=False, norm_topk_prob=True,
          rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=2.0,
                               original_max_position_embeddings=4096, beta_fast=16.0,
                               beta_slow=2.0, attention_factor=1.25))),
]


def to_legacy(d):
    """Rewrites transformers 5's layout into the one published checkpoints use."""
    d = dict(d)
    params = dict(d.pop("rope_parameters") or {})
    d["rope_theta"] = params.pop("rope_theta")
    rope_type = params.pop("rope_type", "default")
    params.pop("type", None)
    d["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **params}
    if d.get("model_type") == "qwen3_moe" and "num_local_experts" in d:
        d["num_experts"] = d.pop("num_local_experts")
    if "dtype" in d:
        d["torch_dtype"] = d.pop("dtype")
    return d


def resolved(config_class, model_class, path):
    """What transformers' modeling code makes of the config file at `path`."""
    config = config_class.from_json_file(path)
    torch.manual_seed(0)
    model = model_class(config).eval()
    layers = model.model.layers
    attn = layers[0].self_attn
    sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in layers]
    dense = [layer.mlp for layer, s in zip(layers, sparse) if not s]
    moe = next(layer.mlp for layer, s in zip(layers, sparse) if s)
    router = moe.gate
    family = config.model_type
    rope = config.rope_parameters
    rotary = model.model.rotary_emb
    norm_topk = getattr(router, "norm_topk_prob", None)
    if family == "mixtral":
        norm_topk = True  # MixtralTopKRouter.forward always divides by the top-k sum
    sliding = getattr(config, "sliding_window", None)
    if family == "qwen2_moe":
        sliding = None if not config.use_sliding_window else config.sliding_window
    eos = config.eos_token_id
    shared = getattr(moe, "shared_expert", None)
    return {
        "model_type": family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_hidden_layers,
        "num_heads": config.num_attention_heads,
        "num_kv_heads": config.num_key_value_heads,
        "head_dim": attn.head_dim,
        "intermediate_size": dense[0].down_proj.in_features if dense else config.intermediate_size,
        "moe_intermediate_size": moe.experts.down_proj.shape[-1],
        "num_experts": moe.experts.down_proj.shape[0],
        "num_experts_per_tok": router.top_k,
        "shared_expert_intermediate_size": shared.down_proj.in_features if shared is not None else 0,
        "norm_topk_prob": bool(norm_topk),
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": model.lm_head.weight is model.model.embed_tokens.weight,
        "attention_bias": attn.q_proj.bias is not None,
        "attention_out_bias": attn.o_proj.bias is not None,
        "qk_norm_per_head": hasattr(attn, "q_norm") and attn.q_norm.weight.shape[0] == attn.head_dim,
        "qk_norm_full": hasattr(attn, "q_norm") and attn.q_norm.weight.shape[0] == config.hidden_size
        and attn.head_dim != config.hidden_size,
        "clip_qkv": getattr(config, "clip_qkv", None),
        "sliding_window": sliding,
        "layer_is_moe": sparse,
        "rope_type": rotary.rope_type,
        "rope_theta": rope["rope_theta"],
        "rope_factor": rope.get("factor", 1.0) if rotary.rope_type != "default" else 1.0,
        "rope_original_max_position_embeddings": rope.get("original_max_position_embeddings", 0),
        "rope_attention_scaling": rotary.attention_scaling,
        "rope_beta_fast": rope.get("beta_fast"),
        "rope_beta_slow": rope.get("beta_slow"),
        "rope_low_freq_factor": rope.get("low_freq_factor"),
        "rope_high_freq_factor": rope.get("high_freq_factor"),
        "bos_token_id": config.bos_token_id,
        "eos_token_ids": eos if isinstance(eos, list) else ([] if eos is None else [eos]),
        "dtype": str(config.dtype).removeprefix("torch.") if config.dtype is not None else "",
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--out", default=os.path.join(here, "..", "tests", "fixtures", "configs"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    expected = {"transformers_version": transformers.__version__, "configs": {}}
    for name, config_class, model_class, layout, kwargs in CASES:
        config = config_class(**kwargs)
        if layout == "legacy":
            data = to_legacy(config.to_dict())
        else:  # exactly what save_pretrained writes: only the values that differ from defaults
            data = json.loads(config.to_json_string(use_diff=True))
        path = os.path.join(args.out, name + ".json")
        with open(path, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
        expected["configs"][name + ".json"] = resolved(config_class, model_class, path)
        print("wrote", path)
    with open(os.path.join(args.out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=2, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
