"""The engine's reports as dicts and NumPy arrays: the capacity plan, a text's expert load,
routing traces and the stage profiler's report. Each runs the same library function as the
``moeinfer`` command that prints it (``plan``, ``expert-load``, ``trace summarize``,
``profile``)."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Dict, Optional, Sequence, Union

import numpy as np

from . import _core
from .cli import command_args

PathLike = Union[str, "os.PathLike[str]"]


def plan(model: PathLike, *, gpus: int = 1, gpu_mem: float = 80.0, dtype: Optional[str] = None,
         kv_dtype: str = "bf16", max_seq_len: int = 0,
         gpu_memory_fraction: float = 0.9) -> Dict[str, Any]:
    """``moeinfer plan --json``: weights by part, KV bytes per token, KV that fits, the layout.

    Args:
        model: checkpoint folder or "synthetic:NAME" (a published configuration).
        gpus: GPUs to plan for.
        gpu_mem: memory per GPU in GiB.
        dtype: weight dtype, "bf16" or "fp8" (None: the checkpoint's own).
        kv_dtype: KV cache dtype, "bf16", "fp8" or "f32".
        max_seq_len: longest sequence to plan for in tokens (0: the model's context).
        gpu_memory_fraction: share of each GPU the engine may use.

    Returns:
        {"weight_bytes": {part: bytes}, "kv_bytes_per_token": bytes, "kv_tokens_fit": tokens,
        "layout", "gpus_used", "expert_budget" (the --expert-budget to pass), "run_flags",
        "arithmetic": [lines], ...}.
    """
    return json.loads(_core.plan(os.fspath(model), gpus, float(gpu_mem), dtype or "", kv_dtype,
                                 max_seq_len, gpu_memory_fraction))


def expert_load(model: PathLike, text: str, *, draws: int = 20, seed: int = 0,
                chunk_tokens: int = 0, ranks: int = 1,
                placement: Optional[PathLike] = None) -> Dict[str, Any]:
    """``moeinfer expert-load --json``: how the routers spread ``text``'s tokens over the
    experts, per MoE layer, beside a random router of the same shape.

    Args:
        model: checkpoint folder.
        text: the text, encoded with the tokenizer's special tokens.
        draws: random-router draws averaged per layer.
        seed: the random router's seed.
        chunk_tokens: tokens per forward pass (0: the model's context length).
        ranks: with ranks > 1, also each rank's load under expert parallelism over that many
            ranks (see ``rank_rows``).
        placement: with ranks: a ``moeinfer placement`` file (None: contiguous ranges).

    Returns:
        The command's JSON fields, with "counts": int64 array [num_moe_layers, num_experts]
        (assignments per expert; row i is layer ``layers[i]["layer"]``) and per layer its
        max_over_mean, min_over_mean, cv (ratios to the mean load T*K/E) and the random
        router's. With ranks > 1: "rank_rows", float64 [num_moe_layers, ranks] (rows each
        rank's experts compute), and "rank_max_over_mean", float64 [num_moe_layers] (the
        busiest rank over the mean: the layer's straggler factor).
    """
    text_json, counts = _core.expert_load(os.fspath(model), text, draws, seed, chunk_tokens)
    report = json.loads(text_json)
    report["counts"] = counts
    if ranks > 1:
        layers = [layer["layer"] for layer in report["layers"]]
        rows = rank_rows(counts, layers, ranks, placement)
        report["rank_rows"] = rows
        mean = rows.mean(axis=1)
        report["rank_max_over_mean"] = np.divide(rows.max(axis=1), mean, out=np.ones_like(mean),
                                                 where=mean > 0)
    return report


def rank_rows(counts: Any, layers: Sequence[int], ranks: int,
              placement: Optional[PathLike] = None) -> Any:
    """Rows each rank's experts compute under expert parallelism over ``ranks`` ranks.

    Args:
        counts: int64 array [L, E], the assignments each expert received in L MoE layers
            (``expert_load``'s "counts", or the MoE layers' rows of
            ``LLM(profile=True).stats()["expert_rows"]``).
        layers: the model's layer index of each row of counts (a placement file's per-layer
            tables are looked up by it).
        ranks: expert-parallel ranks.
        placement: a ``moeinfer placement`` file; None: contiguous ranges (needs E >= ranks).

    Returns:
        float64 array [L, ranks]; an expert with replicas shares its rows evenly among them, as
        ``moeinfer placement`` predicts.
    """
    array = np.ascontiguousarray(counts, dtype=np.int64)
    if array.ndim != 2:
        raise ValueError(f"counts must be a 2-D array [layers, experts], got shape {array.shape}")
    return _core.rank_rows(array, [int(layer) for layer in layers], int(ranks),
                           "" if placement is None else os.fspath(placement))


def read_routing_trace(path: PathLike) -> Dict[str, Any]:
    """A routing trace (``generate --trace-routing FILE``) as arrays.

    Returns:
        {"num_layers", "num_experts", "top_k",
         "step": int64 [R] (forward pass of each record), "layer": int64 [R],
         "token_offsets": int64 [R + 1] (record r's tokens are rows
         token_offsets[r]:token_offsets[r + 1] of the next two),
         "expert_ids": int32 [N, top_k] (best first), "weights": float32 [N, top_k]}
        for R records (one per forward pass and MoE layer) and N token rows in all.
    """
    return _core.read_routing_trace(os.fspath(path))


def summarize_routing_trace(path: PathLike, *, pairs: int = 3) -> Dict[str, Any]:
    """``moeinfer trace summarize --json``: per layer with records, tokens, load (int64 array
    [num_experts]), max_over_mean, unused_experts, the ``pairs`` most co-selected expert pairs
    [[a, b, count]], mean_reuse_distance (steps) and reuse_next_step_fraction."""
    summary = json.loads(_core.summarize_routing_trace(os.fspath(path), pairs))
    for layer in summary["layers"]:
        layer["load"] = np.asarray(layer["load"], dtype=np.int64)
    return summary


def profile(model: PathLike, out: Optional[PathLike] = None, **options: Any) -> Dict[str, Any]:
    """``moeinfer profile``: runs a fixed workload with the stage profiler on and returns its
    report (report.json; docs/profiling.md), writing report.txt, report.json and report.html
    to ``out`` (a temporary folder, removed after, when None).

    The options are the command's in Python spelling: ``batch``, ``input_len``,
    ``output_len`` (tokens), ``time_every``, ``seed``, ``device``, ``expert_budget``, ...
    Times in the report are in seconds unless its keys say otherwise.
    """
    if out is None:
        with tempfile.TemporaryDirectory(prefix="moeinfer-profile-") as folder:
            return profile(model, folder, **options)
    _core.run_command(command_args("profile", model, out=os.fspath(out), **options))
    with open(os.path.join(os.fspath(out), "report.json"), encoding="utf-8") as f:
        return json.load(f)
