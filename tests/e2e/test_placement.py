#!/usr/bin/env python3
"""End-to-end: `moeinfer placement` plans an expert placement from a routing trace (issue 15,
item 5), and the engine runs it.

  plan_from_trace     a trace of the demo model from `generate --trace-routing`, then
                      `moeinfer placement --ranks 2 --slots +2 --output FILE --json`: every expert
                      placed, no rank over its slots, the planned busiest rank no worse than
                      contiguous ranges, the file's "predicted" field the figures printed; the
                      table and --simulate print.
  logits_with_plan    `mpirun -np 2 moeinfer logits --ep 2 --placement FILE` writes one process's
                      logits within 1e-5 relative.
  bad_inputs          each bad input exits 2 naming the problem.

Prints one line per check and a last line "N passed, M failed"; exits non-zero on any failure.
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile

import numpy as np

import e2e_util
from e2e_util import mpirun, run_checks
from e2e_util import run_command as run

IDS = "1,5,9,2,7,3,8,4,6,10,11,12"
PROMPT = "The capital of France is"




def max_relative_error(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def check_plan_from_trace(ctx: dict) -> None:
    m, tmp = ctx["moeinfer"], ctx["tmp"]
    trace = tmp / "demo.trace"
    run([m, "generate", "--prompt", PROMPT, "--max-tokens", "24", "--temperature", "0",
         "--ignore-eos", "--trace-routing", str(trace)], mpi=True)
    out = tmp / "plan.json"
    r = run([m, "placement", "--trace", str(trace), "--ranks", "2", "--slots", "+2",
             "--hidden-size", "256", "--output", str(out), "--json"])
    printed = json.loads(r.stdout)
    experts = printed["num_experts"]
    plan = json.loads(out.read_text())
    assert plan["format"] == "moeinfer-placement" and plan["num_ranks"] == 2, plan
    assert plan["predicted"] == printed["predicted"], "the file's figures differ from --json's"
    slots = experts // 2 + 2
    for entry in plan["layers"]:
        ranks = entry["ranks"]
        assert sorted(set().union(*map(set, ranks))) == list(range(experts)), entry
        for table in ranks:
            assert len(table) <= slots and len(set(table)) == len(table), entry
    predicted = printed["predicted"]
    planned, contiguous = predicted["planned"], predicted["contiguous"]
    assert planned["max_rows"] <= contiguous["max_rows"] + 1e-9, predicted
    assert planned["intra_node_bytes"] > 0 and planned["inter_node_bytes"] == 0, planned
    for layer in predicted["layers"]:
        assert layer["planned"]["max_rows"] <= layer["contiguous"]["max_rows"] + 1e-9, layer
    table = run([m, "placement", "--trace", str(trace), "--ranks", "4", "--slots", "+1",
                 "--topology", "nodes:2", "--simulate", "2,4,8,32"]).stdout
    assert "total" in table and "simulated rank counts" in table, table
    assert "    32 " in table, table  # more ranks than experts: replicas only, no baseline
    ctx["plan"] = out


def check_logits_with_plan(ctx: dict) -> None:
    m, tmp = ctx["moeinfer"], ctx["tmp"]
    assert "plan" in ctx, "plan_from_trace did not write a plan"
    one = tmp / "one.npy"
    run([m, "logits", "--ids", IDS, "--out", str(one)], mpi=True)
    two = tmp / "two.npy"
    mpirun(2, [m, "logits", "--ids", IDS, "--out", str(two), "--ep", "2",
               "--placement", str(ctx["plan"])])
    err = max_relative_error(np.load(two), np.load(one))
    assert err <= 1e-5, f"--ep 2 --placement {ctx['plan'].read_text()}: relative error {err:.2e}"


def check_bad_inputs(ctx: dict) -> None:
    m, tmp = ctx["moeinfer"], ctx["tmp"]
    trace = tmp / "demo.trace"
    assert trace.exists(), "plan_from_trace did not write a trace"
    garbage = tmp / "garbage.trace"
    garbage.write_bytes(b"not a trace at all")
    truncated = tmp / "truncated.trace"
    truncated.write_bytes(trace.read_bytes()[:30])
    topology = tmp / "topology.json"
    topology.write_text(json.dumps({"node_of_rank": [0, 0, 1]}))
    good = ["--trace", str(trace), "--ranks", "2", "--slots", "8"]
    cases = [
        (["--ranks", "2", "--slots", "8"], "--trace FILE is required"),
        (["--trace", str(tmp / "missing.trace"), "--ranks", "2", "--slots", "8"], "no such file"),
        (["--trace", str(garbage), "--ranks", "2", "--slots", "8"], "not a moeinfer routing trace"),
        (["--trace", str(truncated), "--ranks", "2", "--slots", "8"], "truncated at byte"),
        (["--trace", str(trace), "--slots", "8"], "--ranks N is required"),
        (["--trace", str(trace), "--ranks", "0", "--slots", "8"], "rank counts are 1 to 256"),
        (["--trace", str(trace), "--ranks", "257", "--slots", "8"], "rank counts are 1 to 256"),
        (["--trace", str(trace), "--ranks", "two", "--slots", "8"], "--ranks takes an integer"),
        (["--trace", str(trace), "--ranks", "2"], "--slots is required"),
        (["--trace", str(trace), "--ranks", "2", "--slots", "7"], "fewer than the 16 experts"),
        (["--trace", str(trace), "--ranks", "2", "--slots", "+x"], "--slots takes an integer"),
        ([*good, "--topology", "nodes:3"], "2 ranks do not split into 3 equal nodes"),
        ([*good, "--topology", "nodes:"], "--topology nodes:K takes an integer"),
        ([*good, "--topology", str(tmp / "nowhere.json")], "neither nodes:K nor a readable file"),
        ([*good, "--topology", str(topology)], "has 3 entries; the plan is for 2 ranks"),
        ([*good, "--hidden-size", "0"], "--hidden-size 0 must be >= 1"),
        ([*good, "--simulate", "2,x"], "--simulate takes an integer"),
        ([*good, "--simulate", "1"], "--simulate 1: --slots 8 x 1 ranks"),
        ([*good, "--bogus"], "unknown argument \"--bogus\""),
    ]
    for argv, message in cases:
        r = run([m, "placement", *argv], ok=False)
        assert r.returncode == 2 and message in r.stderr, (argv, r.returncode, r.stderr[-800:])


def main() -> int:
    args = e2e_util.parse_args()
    checks = [check_plan_from_trace, check_logits_with_plan, check_bad_inputs]
    with tempfile.TemporaryDirectory() as tmp:
        ctx = {"moeinfer": args.moeinfer, "fixtures": args.fixtures, "tmp": pathlib.Path(tmp)}
        return e2e_util.summary(*run_checks(e2e_util.selected(checks, args.only),
                                            lambda check: check(ctx)))


if __name__ == "__main__":
    sys.exit(main())
