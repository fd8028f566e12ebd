"""The reports from Python equal the commands' (they run the same library functions): the
capacity plan, expert load, routing traces and the profiler."""

import json

import numpy as np
import pytest

import moeinfer

from conftest import DEMO, REPO, run_module

TEXT = (DEMO / "heldout.txt").read_text()[:1500]


def test_plan_equals_the_command():
    for model in ("synthetic:qwen3-30b-a3b", "synthetic:deepseek-v3", str(DEMO)):
        ours = moeinfer.plan(model, gpus=2, gpu_mem=80, kv_dtype="fp8")
        theirs = json.loads(run_module("plan", "--model", model, "--gpus", "2", "--gpu-mem",
                                       "80", "--kv-dtype", "fp8", "--json").stdout)
        assert ours == theirs
    plan = moeinfer.plan("synthetic:qwen3-30b-a3b", gpu_mem=16)
    assert plan["layout"] and plan["weight_bytes"]["total"] > 16 * 2**30
    assert plan["expert_budget"]  # does not fit: the budget to pass


def test_plan_errors():
    import pytest
    with pytest.raises(moeinfer.EngineError, match="kv dtype"):
        moeinfer.plan("synthetic:qwen3-30b-a3b", kv_dtype="int3")


def test_expert_load_equals_the_command(tmp_path):
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT)
    ours = moeinfer.expert_load(DEMO, TEXT, draws=5, seed=3)
    theirs = json.loads(run_module("expert-load", "--model", str(DEMO), "--text-file",
                                   str(text_file), "--draws", "5", "--seed", "3",
                                   "--json").stdout)
    counts = ours.pop("counts")
    assert counts.dtype == np.int64 and counts.shape == (len(theirs["layers"]), 16)
    for row, layer in zip(counts, theirs["layers"]):
        assert row.tolist() == layer.pop("counts")
        assert row.sum() == ours["num_tokens"] * ours["top_k"]
    theirs.pop("model")
    theirs.pop("text_file")
    assert ours == theirs


def test_expert_load_per_rank(tmp_path):
    report = moeinfer.expert_load(DEMO, TEXT, draws=2, ranks=4)
    counts, rows = report["counts"], report["rank_rows"]
    assert rows.dtype == np.float64 and rows.shape == (counts.shape[0], 4)
    # Contiguous ranges: rank r holds experts 4r..4r+3 of the demo model's 16.
    np.testing.assert_array_equal(rows, counts.reshape(-1, 4, 4).sum(axis=2))
    np.testing.assert_allclose(report["rank_max_over_mean"], rows.max(axis=1) / rows.mean(axis=1))
    # Every expert on both ranks: each replica takes half of its expert's rows.
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps({"format": "moeinfer-placement", "version": 1,
                                     "num_experts": 16, "num_ranks": 2,
                                     "ranks": [list(range(16)), list(range(16))]}))
    layers = [layer["layer"] for layer in report["layers"]]
    halves = moeinfer.rank_rows(counts, layers, 2, placement)
    np.testing.assert_allclose(halves, np.repeat(counts.sum(axis=1, keepdims=True) / 2, 2, axis=1))
    with pytest.raises(moeinfer.EngineError, match="cannot cover 32 ranks"):
        moeinfer.rank_rows(counts, layers, 32)
    with pytest.raises(moeinfer.EngineError, match="layer ids"):
        moeinfer.rank_rows(counts, layers[:1], 2)
    with pytest.raises(ValueError, match="2-D"):
        moeinfer.rank_rows(counts[0], layers, 2)


def test_routing_trace(tmp_path):
    trace = tmp_path / "routing.trace"
    run_module("generate", "--model", str(DEMO), "--prompt", "The meaning of life is",
               "--max-tokens", "12", "--ignore-eos", "--trace-routing", str(trace))
    t = moeinfer.read_routing_trace(trace)
    assert (t["num_experts"], t["top_k"]) == (16, 2)
    records = len(t["step"])
    assert t["layer"].shape == (records,) and t["token_offsets"].shape == (records + 1,)
    rows = t["token_offsets"][-1]
    assert t["expert_ids"].shape == (rows, 2) and t["weights"].shape == (rows, 2)
    assert t["expert_ids"].dtype == np.int32 and t["weights"].dtype == np.float32
    assert ((t["expert_ids"] >= 0) & (t["expert_ids"] < 16)).all()
    assert (t["expert_ids"][:, 0] != t["expert_ids"][:, 1]).all()
    # One prefill step then one step per generated token but the last, every MoE layer each.
    assert t["step"].max() == 11
    summary = moeinfer.summarize_routing_trace(trace, pairs=2)
    command = json.loads(run_module("trace", "summarize", str(trace), "--pairs", "2",
                                    "--json").stdout)
    for ours, theirs in zip(summary["layers"], command["layers"]):
        assert ours.pop("load").tolist() == theirs.pop("load")
    assert summary == command
    # The summary's load is the trace's assignments per expert.
    first = summary["layers"][0]["layer"]
    mask = np.repeat(t["layer"] == first, np.diff(t["token_offsets"]))
    load = np.bincount(t["expert_ids"][mask].ravel(), minlength=16)
    assert load.tolist() == moeinfer.summarize_routing_trace(trace)["layers"][0]["load"].tolist()


def test_profile_report(tmp_path):
    report = moeinfer.profile(DEMO, tmp_path / "profile", batch=2, input_len=16, output_len=4,
                              repeats=0)
    assert (tmp_path / "profile" / "report.html").is_file()
    on_disk = json.loads((tmp_path / "profile" / "report.json").read_text())
    assert report == on_disk
    assert isinstance(report, dict) and report
    # Without a folder: a temporary one, removed after.
    assert moeinfer.profile(DEMO, batch=1, input_len=8, output_len=2, repeats=0).keys() == \
        report.keys()


def test_llm_records_a_routing_trace(tmp_path):
    trace = tmp_path / "llm.trace"
    llm = moeinfer.LLM(DEMO, trace_routing=trace, profile=True)
    prompts = ["The meaning of life is", "Never"]
    llm.generate(prompts, moeinfer.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    llm.trace_routing(None)
    t = moeinfer.read_routing_trace(trace)
    # Every token the engine computed went through every MoE layer once, top-2 each: the trace
    # holds what the profiler counted, expert by expert.
    rows = llm.stats()["expert_rows"]
    for layer in np.unique(t["layer"]):
        mask = np.repeat(t["layer"] == layer, np.diff(t["token_offsets"]))
        assert mask.sum() == llm.stats()["computed_tokens"]
        load = np.bincount(t["expert_ids"][mask].ravel(), minlength=16)
        assert load.tolist() == rows[layer].tolist()
    # Steps: one per engine step (a prefill of both prompts, then 5 decode steps).
    assert t["step"].max() == 5
    llm.logits([1, 2, 3])  # no trace open: nothing more is written
    assert moeinfer.read_routing_trace(trace)["step"].max() == 5
