#!/usr/bin/env python3
"""End-to-end: `moeinfer eval` and the routing approximations' flags.

  perplexity_matches_logits   on the demo model (models/demo/heldout.txt, the first 300 tokens in
                              windows of 128) and on the qwen3_moe_f32 and deepseek_v3_f32
                              fixtures: eval's perplexity equals the one this script computes in
                              NumPy from `moeinfer tokenize` ids and `moeinfer logits` of each
                              window (every token of a window after its first, scored from the
                              window's tokens before it), within 1e-6 relative
  unmodified_against_itself   flags that change nothing (--router-temperature 1, --active-experts
                              K on the model's K) give KL 0, agreement 1 and equal perplexities
  renorm_full_and_kept_differ on the top-2 demo model --active-experts 1 --renorm full and kept
                              give finite perplexities and KLs that differ from each other and
                              from the unmodified run
  every_approximation_runs    --drop-below, --expert-capacity (drop and reroute) and
                              --router-temperature each change the output, finite
  offload_unchanged           an approximation gives the same figures with --expert-budget 25%
                              (the expert cache sees only the kept assignments)
  refusals                    bad values and combinations exit 2 with a message naming the flag;
                              each approximation on --device cuda is refused by name (eval,
                              logits, generate), never ignored
  weight_formats              --weights fp8 and int4 (routed experts quantised at load) on the
                              demo model and the qwen3_moe_f32 fixture: finite perplexity, KL > 0
                              and top-1 agreement in (0.5, 1]; --weights bf16 on the bf16 demo
                              model changes nothing; with an approximation, both in one run
  weight_refusals             --weights fp8 / int4 on fp8, MXFP4, GPTQ and AWQ checkpoints, and on
                              synthetic models with --expert-budget, refused naming the flag;
                              --weights bf16 on cuda (checkpoint and synthetic) refused; an
                              unknown value refused with the accepted set
  kv_dtypes                   --kv-dtype fp8 and bf16 (the CPU cache's rows rounded when written)
                              on the demo model and the qwen3_moe_f32 (GQA) and
                              deepseek_v2_lite_f32 (MLA) fixtures: finite perplexity, KL > 0 and
                              top-1 agreement in (0.5, 1] against float32 rows; --kv-dtype f32
                              and auto are the unmodified run (no comparison, same perplexity)
  kv_refusals                 --kv-dtype f32 on --device cuda (eval, logits, generate,
                              bench, serve) refused naming the flag and the GPU's bf16 cache;
                              an unknown value refused with the accepted set (fp8 on cuda is
                              kept for GQA and MLA models alike)

Prints one line per check and a last line "N passed, M failed".
"""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

import e2e_util

MAX_TOKENS = 300
WINDOW = 128


def eval_json(moeinfer: str, model: pathlib.Path, text: pathlib.Path, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "eval.json"
        e2e_util.run_command([moeinfer, "eval", "--model", str(model), "--text-file", str(text),
                              "--max-tokens", str(MAX_TOKENS), "--window", str(WINDOW),
                              "--json", str(out), *flags])
        return json.loads(out.read_text())


def reference_perplexity(moeinfer: str, model: pathlib.Path, text: pathlib.Path) -> float:
    ids_line = e2e_util.run_command([moeinfer, "tokenize", "--model", str(model),
                                     "--text", text.read_text()]).stdout.strip()
    ids = [int(x) for x in ids_line.split(",")][:MAX_TOKENS]
    nll, scored = 0.0, 0
    with tempfile.TemporaryDirectory() as tmp:
        for start in range(0, len(ids), WINDOW):
            window = ids[start:start + WINDOW]
            if len(window) < 2:
                break
            out = pathlib.Path(tmp) / f"w{start}.npy"
            e2e_util.run_command([moeinfer, "logits", "--model", str(model), "--ids",
                                  ",".join(map(str, window)), "--out", str(out)])
            logits = np.load(out).astype(np.float64)  # [n, V]
            shifted = logits - logits.max(axis=1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
            for i in range(len(window) - 1):
                nll -= log_probs[i, window[i + 1]]
                scored += 1
    return math.exp(nll / scored)


def refused(moeinfer: str, args: list[str], needle: str) -> None:
    r = subprocess.run([moeinfer, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0, f"{args}: accepted"
    assert needle in r.stderr, f"{args}: exit {r.returncode}, message lacks {needle!r}: {r.stderr}"


def main() -> int:
    args = e2e_util.parse_args(__doc__.split("\n")[0])
    demo = e2e_util.demo_model(args.fixtures)
    heldout = demo / "heldout.txt"
    models = args.fixtures / "models"
    tmp = tempfile.TemporaryDirectory()
    # A fixture family's text: any English will do for random weights; the demo's held-out text.
    fixture_text = pathlib.Path(tmp.name) / "text.txt"
    fixture_text.write_text(heldout.read_text()[:1500])
    moeinfer = args.moeinfer

    def check_perplexity_matches_logits() -> None:
        for model, text in [(demo, heldout), (models / "qwen3_moe_f32", fixture_text),
                            (models / "deepseek_v3_f32", fixture_text)]:
            report = eval_json(moeinfer, model, text, [])
            expected = reference_perplexity(moeinfer, model, text)
            assert report["tokens"] == MAX_TOKENS and report["window"] == WINDOW, report
            got = report["perplexity"]
            assert abs(got - expected) <= 1e-6 * expected, f"{model.name}: {got} != {expected}"
            assert "modified" not in report, report

    def check_unmodified_against_itself() -> None:
        for model, text, flags in [(demo, heldout, ["--router-temperature", "1"]),
                                   (demo, heldout, ["--active-experts", "2", "--renorm", "full"]),
                                   (models / "deepseek_v3_f32", fixture_text,
                                    ["--active-experts", "4"])]:
            report = eval_json(moeinfer, model, text, flags)
            m = report["modified"]
            assert m["kl_mean"] == 0.0 and m["kl_p99"] == 0.0, (flags, m)
            assert m["top1_agreement"] == 1.0, (flags, m)
            assert m["perplexity"] == report["perplexity"], (flags, report)

    def check_renorm_full_and_kept_differ() -> None:
        full = eval_json(moeinfer, demo, heldout, ["--active-experts", "1", "--renorm", "full"])
        kept = eval_json(moeinfer, demo, heldout, ["--active-experts", "1", "--renorm", "kept"])
        assert full["perplexity"] == kept["perplexity"], "the unmodified runs differ"
        f, k = full["modified"], kept["modified"]
        for m in (f, k):
            for key in ("perplexity", "kl_mean", "kl_p99", "top1_agreement"):
                assert math.isfinite(m[key]), m
            assert m["kl_mean"] > 0 and m["perplexity"] != full["perplexity"], m
        assert f["perplexity"] != k["perplexity"] and f["kl_mean"] != k["kl_mean"], (f, k)

    def check_every_approximation_runs() -> None:
        for flags in (["--drop-below", "0.3"], ["--expert-capacity", "1"],
                      ["--expert-capacity", "1", "--overflow", "reroute"],
                      ["--router-temperature", "2"]):
            m = eval_json(moeinfer, demo, heldout, flags)["modified"]
            assert math.isfinite(m["perplexity"]) and m["kl_mean"] > 0, (flags, m)
            assert 0.0 < m["top1_agreement"] < 1.0, (flags, m)

    def check_offload_unchanged() -> None:
        flags = ["--expert-capacity", "1.25", "--overflow", "reroute", "--active-experts", "1"]
        resident = eval_json(moeinfer, demo, heldout, flags)
        offloaded = eval_json(moeinfer, demo, heldout, [*flags, "--expert-budget", "25%"])
        assert resident == offloaded, (resident, offloaded)

    def check_refusals() -> None:
        base = ["eval", "--model", str(demo), "--text-file", str(heldout)]
        for flags, needle in [
                (["--active-experts", "3"], "--active-experts 3 exceeds the model's 2"),
                (["--active-experts", "0"], "--active-experts 0 must be at least 1"),
                (["--renorm", "full"], "--renorm full needs --active-experts"),
                (["--expert-capacity", "0.5"], "--expert-capacity 0.5 must be at least 1"),
                (["--overflow", "reroute"], "--overflow reroute needs --expert-capacity"),
                (["--router-temperature", "0"], "--router-temperature 0 must be"),
                (["--router-temperature", "-1"], "--router-temperature -1 must be"),
                (["--drop-below", "1"], "--drop-below 1 must be in [0, 1)"),
                (["--drop-below", "-0.5"], "--drop-below -0.5 must be in [0, 1)")]:
            refused(moeinfer, [*base, *flags], needle)
        usage = subprocess.run([moeinfer, *base, "--renorm", "full"], capture_output=True,
                               text=True, timeout=300)
        assert usage.returncode == 2, f"a usage error exits 2, not {usage.returncode}"
        # The GPU's route stage has the temperature, --active-experts and --drop-below
        # (tests/cuda/cuda_routing_approx_test.cpp); a capacity is refused before any device work.
        for flag, value in [("--expert-capacity", "2")]:
            needle = f"{flag} is not implemented on the CUDA backend yet"
            refused(moeinfer, [*base, "--device", "cuda", flag, value], needle)
            refused(moeinfer, ["logits", "--model", str(demo), "--ids", "1,2", "--out",
                               str(pathlib.Path(tmp.name) / "x.npy"), "--device", "cuda", flag,
                               value], needle)
            refused(moeinfer, ["generate", "--model", str(demo), "--prompt", "Hi",
                               "--max-tokens", "1", "--device", "cuda", flag, value], needle)
        refused(moeinfer, ["generate", "--model", str(demo), "--prompt", "Hi", "--max-tokens",
                           "1", "--trace-routing", str(pathlib.Path(tmp.name) / "t.bin"),
                           "--active-experts", "1"], "--trace-routing records all K experts")

    def check_weight_formats() -> None:
        for model, text in [(demo, heldout), (models / "qwen3_moe_f32", fixture_text)]:
            for fmt in ("fp8", "int4"):
                report = eval_json(moeinfer, model, text, ["--weights", fmt])
                m = report["modified"]
                assert m["flags"] == f"--weights {fmt}", m
                for key in ("perplexity", "kl_mean", "kl_p99", "top1_agreement"):
                    assert math.isfinite(m[key]), (model.name, fmt, m)
                assert m["kl_mean"] > 0 and m["perplexity"] != report["perplexity"], (fmt, m)
                assert 0.5 < m["top1_agreement"] <= 1.0, (model.name, fmt, m)
        m = eval_json(moeinfer, demo, heldout, ["--weights", "bf16"])["modified"]
        assert m["kl_mean"] == 0.0 and m["top1_agreement"] == 1.0, m  # already bf16
        both = eval_json(moeinfer, demo, heldout, ["--weights", "int4", "--active-experts", "1"])
        alone = eval_json(moeinfer, demo, heldout, ["--active-experts", "1"])
        assert both["modified"]["flags"] == "--active-experts 1 --renorm kept --weights int4"
        assert both["modified"]["kl_mean"] != alone["modified"]["kl_mean"], (both, alone)

    def check_weight_refusals() -> None:
        base = ["eval", "--model", str(demo), "--text-file", str(heldout)]
        npy = str(pathlib.Path(tmp.name) / "x.npy")
        # --device cuda takes --weights fp8|int4 (the GPU holds the codes): no refusal there.
        for fmt in ["fp8", "int4"]:
            for fixture, stored in [("deepseek_v3_fp8", "already block-scaled fp8"),
                                    ("gpt_oss_mxfp4", "already MXFP4"),
                                    ("qwen3_moe_gptq", "already 4-bit gptq"),
                                    ("qwen2_moe_awq", "already 4-bit awq")]:
                refused(moeinfer, ["logits", "--model", str(models / fixture), "--ids", "1,2",
                                   "--out", npy, "--weights", fmt], f"--weights {fmt}: ")
                refused(moeinfer, ["eval", "--model", str(models / fixture), "--text-file",
                                   str(fixture_text), "--weights", fmt], stored)
        refused(moeinfer, [*base, "--device", "cuda", "--weights", "bf16"], "--dtype bfloat16")
        # A synthetic model takes --weights fp8|int4 (random codes on the GPU), but not with
        # --expert-budget (the cache holds bf16 experts), and not --weights bf16 on cuda (refused
        # before any GPU is needed).
        for command in (["bench"], ["profile", "--out", str(pathlib.Path(tmp.name) / "p")]):
            synthetic = [*command, "--device", "cuda", "--model", "synthetic:olmoe-1b-7b"]
            for fmt in ["fp8", "int4"]:
                refused(moeinfer, [*synthetic, "--weights", fmt, "--expert-budget", "25%"],
                        f"--weights {fmt} with --expert-budget: the expert cache holds bf16")
            refused(moeinfer, [*synthetic, "--weights", "bf16"],
                    "--weights bf16 applies to --device cpu")
        refused(moeinfer, [*base, "--weights", "int8"], "--weights: int8 not in {bf16,fp8,int4}")

    def check_kv_dtypes() -> None:
        for model, text in [(demo, heldout), (models / "qwen3_moe_f32", fixture_text),
                            (models / "deepseek_v2_lite_f32", fixture_text)]:
            plain = eval_json(moeinfer, model, text, [])
            for dtype in ("fp8", "bf16"):
                report = eval_json(moeinfer, model, text, ["--kv-dtype", dtype])
                assert report["perplexity"] == plain["perplexity"], "the unmodified runs differ"
                m = report["modified"]
                assert m["flags"] == f"--kv-dtype {dtype}", m
                for key in ("perplexity", "kl_mean", "kl_p99", "top1_agreement"):
                    assert math.isfinite(m[key]), (model.name, dtype, m)
                assert m["kl_mean"] > 0, (model.name, dtype, m)
                assert 0.5 < m["top1_agreement"] <= 1.0, (model.name, dtype, m)
            for dtype in ("f32", "auto"):
                report = eval_json(moeinfer, model, text, ["--kv-dtype", dtype])
                assert "modified" not in report, report
                assert report["perplexity"] == plain["perplexity"], (dtype, report, plain)

    def check_kv_refusals() -> None:
        npy = str(pathlib.Path(tmp.name) / "x.npy")
        needle = "--kv-dtype f32 applies to --device cpu: the CUDA backend's KV cache"
        for command in (["eval", "--model", str(demo), "--text-file", str(heldout)],
                        ["logits", "--model", str(demo), "--ids", "1,2", "--out", npy],
                        ["generate", "--model", str(demo), "--prompt", "Hi",
                         "--max-tokens", "1"],
                        ["bench", "--model", str(demo)], ["serve", "--model", str(demo)]):
            refused(moeinfer, [*command, "--device", "cuda", "--kv-dtype", "f32"], needle)
        refused(moeinfer, ["eval", "--model", str(demo), "--text-file", str(heldout),
                           "--kv-dtype", "fp16"], "--kv-dtype: fp16 not in {auto,f32,bf16,fp8}")

    checks = e2e_util.selected(
        [check_perplexity_matches_logits, check_unmodified_against_itself,
         check_renorm_full_and_kept_differ, check_every_approximation_runs,
         check_offload_unchanged, check_refusals, check_weight_formats, check_weight_refusals,
         check_kv_dtypes, check_kv_refusals],
        args.only)
    result = e2e_util.summary(*e2e_util.run_checks(checks))
    tmp.cleanup()
    return result


if __name__ == "__main__":
    sys.exit(main())
