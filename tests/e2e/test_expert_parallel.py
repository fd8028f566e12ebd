#!/usr/bin/env python3
"""End-to-end: expert parallelism on CPU ranks (--ep N under mpirun, issue 15, item 6).

Every rank runs the same sequence (attention data-parallel) while the routed experts are
sharded over the ranks, so each MoE layer's rows cross between ranks both ways:

  logits_match        `mpirun -np N moeinfer logits --ep N` (N = 2, 3) writes the logits of one
                      process within float rounding (relative 1e-5 of the largest logit) for every
                      fixture model.
  generate_same_text  `moeinfer generate --ep N` on the demo model prints the greedy text of one
                      process, once (rank 0 prints).
  bad_flags           --ep 2 outside mpirun names the launch command; --ep with --expert-budget
                      is refused by name.

Prints one line per check and a last line "N passed, M failed"; exits non-zero on any failure.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np

import e2e_util
from e2e_util import run_checks

IDS = "1,5,9,2,7,3,8,4,6,10,11,12"
PROMPT = "The capital of France is"


def mpi_env() -> dict:
    env = dict(os.environ)
    # CI runs as root; two ranks share its two cores.
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_rmaps_base_oversubscribe": "1", "MOE_NUM_THREADS": "1"})
    return env


def run(cmd: list[str], ok: bool = True, mpi: bool = False) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env=mpi_env() if mpi else None)
    if ok:
        assert r.returncode == 0, f"{cmd}: exit {r.returncode}: {r.stderr[-2000:]}"
    return r


def mpirun(n: int, args: list[str], ok: bool = True) -> subprocess.CompletedProcess:
    launcher = shutil.which("mpirun")
    assert launcher, "mpirun not found (scripts/install-deps.sh installs openmpi-bin)"
    return run([launcher, "-np", str(n), *args], ok=ok, mpi=True)


def check_logits_match(ctx: dict) -> None:
    m = ctx["moeinfer"]
    models = sorted(p for p in (pathlib.Path(ctx["fixtures"]) / "models").iterdir() if p.is_dir())
    assert models, "no fixture models"
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            one = pathlib.Path(tmp) / f"{model.name}_1.npy"
            run([m, "logits", "--model", str(model), "--ids", IDS, "--out", str(one)],
                mpi=True)
            want = np.load(one)
            for n in (2, 3):
                out = pathlib.Path(tmp) / f"{model.name}_{n}.npy"
                mpirun(n, [m, "logits", "--model", str(model), "--ids", IDS, "--out", str(out),
                           "--ep", str(n)])
                got = np.load(out)
                assert got.shape == want.shape, (model.name, n, got.shape, want.shape)
                err = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
                assert err <= 1e-5, f"{model.name} --ep {n}: relative error {err:.2e} > 1e-5"


def check_generate_same_text(ctx: dict) -> None:
    m = ctx["moeinfer"]
    base = ["generate", "--prompt", PROMPT, "--max-tokens", "16", "--temperature", "0",
            "--ignore-eos"]
    want = run([m, *base], mpi=True).stdout
    assert want.strip(), "one process printed nothing"
    for n in (2, 3):
        got = mpirun(n, [m, *base, "--ep", str(n)]).stdout
        assert got == want, f"--ep {n}: {got!r} differs from one process's {want!r}"


def check_bad_flags(ctx: dict) -> None:
    m = ctx["moeinfer"]
    base = ["generate", "--prompt", "x", "--max-tokens", "1"]
    r = run([m, *base, "--ep", "2"], ok=False, mpi=True)
    assert r.returncode != 0 and "mpirun -np 2" in r.stderr, r.stderr
    r = mpirun(2, [m, *base, "--ep", "2", "--expert-budget", "25%"], ok=False)
    assert r.returncode != 0 and "--expert-budget" in r.stderr, r.stderr


def main() -> int:
    args = e2e_util.parse_args()
    ctx = {"moeinfer": args.moeinfer, "fixtures": args.fixtures}
    checks = [check_logits_match, check_generate_same_text, check_bad_flags]
    return e2e_util.summary(*run_checks(e2e_util.selected(checks, args.only),
                                        lambda check: check(ctx)))


if __name__ == "__main__":
    sys.exit(main())
