"""GPTQ and AWQ 4-bit checkpoints for the parity fixtures (used by make_fixtures.py).

transformers loads these formats only through GPU packages, so the fixtures are made the other
way round: a saved checkpoint's linears are quantised here with round-to-nearest 4-bit groups
and written in the layouts the tools publish, and the reference runs transformers on a copy
whose weights are those tensors dequantised again by unpack_linear() below, from the packed
words as written. The engine's C++ reader shares no code with this file.

GPTQ (AutoGPTQ, GPTQModel, optimum), per linear of N outputs and K inputs in G groups:
  qweight int32 [K / 8, N]   input 8i + j of output n in bits 4j..4j+3 of word [i, n]
  qzeros  int32 [G, N / 8]   output 8i + j of group g in bits 4j..4j+3 of word [g, i]
  scales  fp16  [G, N]
  g_idx   int32 [K]          each input's group: k // group_size, or with desc_act the group of
                             the input's place in the activation order
  checkpoint_format "gptq" stores each zero point minus one, "gptq_v2" stores it as it is.
AWQ (AutoAWQ, version gemm):
  qweight int32 [K, N / 8]   packed along the outputs: nibble i of word [k, c] holds output
                             8c + AWQ_ORDER[i]
  qzeros  int32 [G, N / 8]   the same packing
  scales  fp16  [G, N]
Both dequantise to w[n, k] = (q - zero) * scale of input k's group.
"""
import json
import os
import re

import numpy as np
import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]

# The decoder layers' linears that the tools quantise: attention (GQA and MLA), routed experts,
# shared experts and dense MLPs. Routers (mlp.gate), the shared expert's gate, embeddings and the
# LM head stay as saved.
QUANTISED = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj"
    r"|kv_a_proj_with_mqa|kv_b_proj)|mlp\.(experts\.\d+\.|shared_experts?\.)?"
    r"(gate_proj|up_proj|down_proj))\.weight$")


def pack_nibbles(codes, order=range(8)):
    """codes [..., 8m] in 0..15 -> int32 [..., m]: nibble i of each word holds code order[i]."""
    c = codes.astype(np.uint32).reshape(*codes.shape[:-1], -1, 8)
    words = np.zeros(c.shape[:-1], dtype=np.uint32)
    for nibble, source in enumerate(order):
        words |= c[..., source] << np.uint32(4 * nibble)
    return words.view(np.int32)


def unpack_nibbles(words, order=range(8)):
    """The inverse of pack_nibbles: int32 [..., m] -> codes [..., 8m]."""
    w = words.view(np.uint32)
    codes = np.zeros((*w.shape, 8), dtype=np.int64)
    for nibble, source in enumerate(order):
        codes[..., source] = (w >> np.uint32(4 * nibble)) & 0xF
    return codes.reshape(*w.shape[:-1], -1)


def group_index(K, group_size, act_order, rng):
    """g_idx [K]: plain groups of consecutive inputs, or GPTQ's act-order groups (the inputs
    taken in a shuffled order, each run of group_size of that order one group)."""
    if not act_order:
        return np.arange(K) // group_size
    perm = rng.permutation(K)
    g_idx = np.empty(K, dtype=np.int64)
    g_idx[perm] = np.arange(K) // group_size
    return g_idx


def quantise(w, g_idx, G, sym):
    """Round-to-nearest 4-bit codes of w [N, K] by groups. Returns codes [N, K], zero points and
    fp16 scales, both [G, N]; the codes are computed with the fp16 scales."""
    N, K = w.shape
    scales = np.zeros((G, N), dtype=np.float16)
    zeros = np.zeros((G, N), dtype=np.int64)
    codes = np.zeros((N, K), dtype=np.int64)
    for g in range(G):
        cols = np.nonzero(g_idx == g)[0]
        block = w[:, cols]
        lo = np.minimum(block.min(axis=1), 0.0)
        hi = np.maximum(block.max(axis=1), 0.0)
        if sym:  # GPTQ's symmetric grid: zero point 8, range +-max|w|
            amax = np.maximum(-lo, hi)
            scale = (2 * amax / 15).astype(np.float16)
            scale[scale == 0] = 1
            zero = np.full(N, 8)
        else:
            scale = ((hi - lo) / 15).astype(np.float16)
            scale[scale == 0] = 1
            zero = np.clip(np.round(-lo / scale.astype(np.float32)), 0, 15).astype(np.int64)
        s32 = scale.astype(np.float32)[:, None]
        codes[:, cols] = np.clip(np.round(block / s32) + zero[:, None], 0, 15)
        scales[g], zeros[g] = scale, zero
    return codes, zeros, scales


def pack_linear(w, fmt, rng):
    """The stored tensors of one linear w [N, K] (numpy float32) in fmt's layout."""
    N, K = w.shape
    group_size = K if fmt["group_size"] == -1 else fmt["group_size"]
    assert K % group_size == 0 and N % 8 == 0 and K % 8 == 0, (N, K, group_size)
    G = K // group_size
    gptq = fmt["method"] == "gptq"
    g_idx = group_index(K, group_size, gptq and fmt["desc_act"], rng)
    codes, zeros, scales = quantise(w, g_idx, G, fmt["sym"])
    out = {"scales": scales}
    if gptq:
        stored_zeros = (zeros - 1) & 0xF if fmt["checkpoint_format"] == "gptq" else zeros
        out["qweight"] = pack_nibbles(codes.T.reshape(K // 8, 8, N).transpose(0, 2, 1)).reshape(
            K // 8, N)
        out["qzeros"] = pack_nibbles(stored_zeros)
        out["g_idx"] = g_idx.astype(np.int32)
    else:
        out["qweight"] = pack_nibbles(codes.T, AWQ_ORDER)
        out["qzeros"] = pack_nibbles(zeros, AWQ_ORDER)
    return out


def unpack_linear(t, fmt):
    """w [N, K] float32 from the stored tensors t, read as the tools' dequantisers read them."""
    gptq = fmt["method"] == "gptq"
    scales = t["scales"].astype(np.float32)
    G, N = scales.shape
    if gptq:
        # [K / 8, N] words -> codes [K, N]: unpack each word's eight inputs, then interleave.
        per_word = unpack_nibbles(t["qweight"].T.copy())  # [N, K]
        codes = per_word.T
        zeros = unpack_nibbles(t["qzeros"])
        if fmt["checkpoint_format"] == "gptq":
            zeros = zeros + 1
        K = codes.shape[0]
        g_idx = t["g_idx"].astype(np.int64) if "g_idx" in t else np.arange(K) // (K // G)
    else:
        codes = unpack_nibbles(t["qweight"], AWQ_ORDER)  # [K, N]
        zeros = unpack_nibbles(t["qzeros"], AWQ_ORDER)
        K = codes.shape[0]
        g_idx = np.arange(K) // (K // G)
    w = (codes - zeros[g_idx]).astype(np.float32) * scales[g_idx]  # [K, N]
    return w.T.copy()


def quantization_config(fmt):
    if fmt["method"] == "gptq":
        return dict(quant_method="gptq", bits=4, group_size=fmt["group_size"],
                    desc_act=fmt["desc_act"], sym=fmt["sym"], damp_percent=0.01,
                    true_sequential=True, static_groups=False,
                    checkpoint_format=fmt["checkpoint_format"], pack_dtype="int32",
                    meta=dict(quantizer=["moeinfer tools/int4_checkpoint.py (round to nearest)"]))
    return dict(quant_method="awq", bits=4, group_size=fmt["group_size"], zero_point=True,
                version="gemm", modules_to_not_convert=fmt.get("modules_to_not_convert"))


def quantise_checkpoint(out_dir, reference_dir, fmt, seed):
    """Rewrites out_dir's model.safetensors with fmt's packed linears and its config.json with the
    published quantization_config, and writes to reference_dir the same checkpoint with each
    packed linear dequantised again (float32, no quantization_config) for transformers."""
    from safetensors.torch import load_file, save_file
    rng = np.random.default_rng(seed)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    packed, dequantised = {}, {}
    for name, w in tensors.items():
        if not QUANTISED.search(name):
            packed[name] = dequantised[name] = w
            continue
        module = name[:-len(".weight")]
        w32 = w.float().numpy()
        stored = pack_linear(w32, fmt, rng)
        back = unpack_linear(stored, fmt)
        # Round to nearest: within half a step (plus the clamp at the ends) of the original.
        step = np.abs(stored["scales"].astype(np.float32)).max()
        assert np.abs(back - w32).max() <= step, (name, np.abs(back - w32).max(), step)
        for part, value in stored.items():
            packed[f"{module}.{part}"] = torch.from_numpy(np.ascontiguousarray(value))
        dequantised[name] = torch.from_numpy(back)
    save_file(packed, path, metadata={"format": "pt"})
    os.makedirs(reference_dir, exist_ok=True)
    save_file(dequantised, os.path.join(reference_dir, "model.safetensors"),
              metadata={"format": "pt"})
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path) as f:
        cfg = json.load(f)
    with open(os.path.join(reference_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    cfg["quantization_config"] = quantization_config(fmt)
    with open(config_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
