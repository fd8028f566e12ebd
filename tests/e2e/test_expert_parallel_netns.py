#!/usr/bin/env python3
"""End-to-end: expert parallelism over MPI between two "hosts" (issue 15, item 6).

The two hosts are two network namespaces on this machine joined by a veth pair on a private /30.
`mpirun` starts in namespace A with `-H <A>:1,<B>:1 -np 2`; Open MPI's rsh launcher is pointed
at a script written here that runs the daemon's command inside the namespace owning the address
it is given (`ip netns exec NS sh -c ...`, what ssh would do on a real second host), so no ssh is
needed. mpirun recognises A's address as its own host and starts that rank itself; only B's
daemon goes through the script (every run checks that it did). Open MPI is held to the veth
addresses: point-to-point over `pml ob1` (the btl list binds only there; Debian's build also has
UCX) with `btl self,tcp` (no shared memory, which would cross namespaces through /dev/shm) and
both TCP transports (btl and the daemons' oob) limited to the /30. A rank in the other
namespace is then reachable over the veth pair only.

  logits_match        `moeinfer logits --ep 2` across the namespaces writes one process's logits
                      (relative 1e-5 of the largest logit) for a fixture of each family with
                      shared experts (qwen2_moe_f32, deepseek_v3_f32).
  generate_same_text  `moeinfer generate --ep 2` on the built-in model prints one process's
                      greedy text, once.
  rows_cross_link     the veth's byte counters grow by at least the rows the run must move: the
                      built-in model's logits of T tokens with rank 0 holding expert 0 only and
                      rank 1 every other expert. A token's K experts are distinct, so at least
                      K - 1 of them live on rank 1, wherever rank 0 runs: per MoE layer rank 0
                      sends >= T * (K - 1) rows of H float32 to rank 1 and receives as many
                      outputs back. A's veth must carry at least that both ways (tx and rx), with
                      Open MPI's start-up and TCP/IP headers on top; the logits stay one
                      process's.

Where the namespaces cannot be made (not root, no CAP_NET_ADMIN, no `ip`, a chroot without
them) every check prints a SKIP line with the reason and the script exits 0. Whatever it makes
is removed at the end, also on failure or SIGTERM.

Prints one line per check and a last line "N passed, M failed"; exits non-zero on any failure.
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile

import numpy as np

import e2e_util
from e2e_util import run_checks

IDS = "1,5,9,2,7,3,8,4,6,10,11,12"
PROMPT = "The capital of France is"
FIXTURES = ("qwen2_moe_f32", "deepseek_v3_f32")
# The namespaces have no other interfaces or routes, so a fixed subnet cannot clash with the
# machine's own networks or with a second run of this test (its pair lives in its own namespaces).
SUBNET = "10.213.7.0/30"
ADDRESS_A, ADDRESS_B = "10.213.7.1", "10.213.7.2"
COMMAND_TIMEOUT = 120


def run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs cmd in its own process group; on a timeout or SIGTERM the whole group is killed
    (mpirun, its ranks and the launcher of the other namespace's daemon) before going on."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=COMMAND_TIMEOUT)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def must(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    r = run(cmd, env)
    assert r.returncode == 0, f"{shlex.join(cmd)}: exit {r.returncode}: {r.stderr[-2000:]}"
    return r


class NamespacePair:
    """Two network namespaces joined by a veth pair, A and B, named after this process. setup()
    raises Unavailable naming the step this machine refuses; teardown() removes what exists."""

    class Unavailable(Exception):
        pass

    def __init__(self, ip: str):
        self.ip = ip
        pid = os.getpid()
        self.ns_a, self.ns_b = f"moeinfer-ep-a-{pid}", f"moeinfer-ep-b-{pid}"
        self.if_a, self.if_b = f"moeA{pid}", f"moeB{pid}"  # at most 15 characters

    def setup(self) -> None:
        steps = [
            ["netns", "add", self.ns_a],
            ["netns", "add", self.ns_b],
            ["link", "add", self.if_a, "type", "veth", "peer", "name", self.if_b],
            ["link", "set", self.if_a, "netns", self.ns_a],
            ["link", "set", self.if_b, "netns", self.ns_b],
            ["-n", self.ns_a, "addr", "add", f"{ADDRESS_A}/30", "dev", self.if_a],
            ["-n", self.ns_b, "addr", "add", f"{ADDRESS_B}/30", "dev", self.if_b],
            ["-n", self.ns_a, "link", "set", "lo", "up"],
            ["-n", self.ns_b, "link", "set", "lo", "up"],
            ["-n", self.ns_a, "link", "set", self.if_a, "up"],
            ["-n", self.ns_b, "link", "set", self.if_b, "up"],
        ]
        for step in steps:
            self._step(step)
        self.counters()  # `ip netns exec` (it mounts the namespace's own /sys) works too

    def _step(self, args: list[str]) -> str:
        r = run([self.ip, *args])
        if r.returncode != 0:
            raise NamespacePair.Unavailable(
                f"`ip {shlex.join(args)}` failed ({r.stderr.strip() or f'exit {r.returncode}'})")
        return r.stdout

    def exec_in(self, ns: str, cmd: list[str]) -> list[str]:
        return [self.ip, "netns", "exec", ns, *cmd]

    def counters(self) -> dict[str, int]:
        """A's veth: bytes sent (tx) and received (rx) so far."""
        stats = f"/sys/class/net/{self.if_a}/statistics"
        r = run(self.exec_in(self.ns_a, ["cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes"]))
        if r.returncode != 0:
            raise NamespacePair.Unavailable(f"reading {stats} in {self.ns_a} failed "
                                            f"({r.stderr.strip()})")
        tx, rx = (int(v) for v in r.stdout.split())
        return {"tx": tx, "rx": rx}

    def teardown(self) -> list[str]:
        """Deletes both namespaces (their veth ends go with them) and the veth if it never left
        this namespace; the names still present afterwards."""
        for ns in (self.ns_a, self.ns_b):
            run([self.ip, "netns", "delete", ns])
        run([self.ip, "link", "delete", self.if_a])  # only there if setup stopped half-way
        left = run([self.ip, "netns", "list"]).stdout.split()
        links = run([self.ip, "-o", "link", "show"]).stdout
        return [n for n in (self.ns_a, self.ns_b) if n in left] + \
               [i for i in (self.if_a, self.if_b) if f" {i}@" in links or f" {i}:" in links]


class TwoHostMpi:
    """mpirun from namespace A over both namespaces, through a launcher script in `tmp`."""

    def __init__(self, pair: NamespacePair, tmp: pathlib.Path):
        self.pair = pair
        self.mpirun = shutil.which("mpirun")
        assert self.mpirun, "mpirun not found (scripts/install-deps.sh installs openmpi-bin)"
        # Open MPI calls it as `AGENT HOST COMMAND...`, the command's words to be joined and run
        # by a shell on HOST, as ssh does. It notes each host it is asked for.
        self.agent = tmp / "netns-agent.sh"
        self.agent_log = tmp / "netns-agent.log"
        self.agent.write_text(
            "#!/bin/sh\n"
            "host=$1\nshift\n"
            f'echo "$host" >> {shlex.quote(str(self.agent_log))}\n'
            "case $host in\n"
            f"  {ADDRESS_A}) ns={shlex.quote(pair.ns_a)} ;;\n"
            f"  {ADDRESS_B}) ns={shlex.quote(pair.ns_b)} ;;\n"
            '  *) echo "netns-agent: no namespace holds host $host" >&2; exit 1 ;;\n'
            "esac\n"
            f'exec {shlex.quote(pair.ip)} netns exec "$ns" sh -c "$*"\n')
        self.agent.chmod(0o755)

    def env(self) -> dict:
        env = dict(os.environ)
        env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                    "MOE_NUM_THREADS": "1",
                    "OMPI_MCA_orte_tmpdir_base": e2e_util.private_mpi_session_base()})
        return env

    def run(self, args: list[str]) -> tuple[subprocess.CompletedProcess, dict[str, int]]:
        """Two ranks, one per namespace: the result and how many bytes A's veth sent and
        received meanwhile."""
        cmd = [self.mpirun, "-np", "2", "-H", f"{ADDRESS_A}:1,{ADDRESS_B}:1",
               "--mca", "plm_rsh_agent", str(self.agent),
               "--mca", "pml", "ob1", "--mca", "btl", "self,tcp",
               "--mca", "btl_tcp_if_include", SUBNET, "--mca", "oob_tcp_if_include", SUBNET,
               # A real second host would not inherit mpirun's environment; say what it needs.
               "-x", "MOE_NUM_THREADS", *args]
        self.agent_log.write_text("")
        before = self.pair.counters()
        r = must(self.pair.exec_in(self.pair.ns_a, cmd), env=self.env())
        after = self.pair.counters()
        hosts = self.agent_log.read_text().split()
        assert ADDRESS_B in hosts, f"mpirun did not start B's daemon through {self.agent}: {hosts}"
        return r, {k: after[k] - before[k] for k in before}


def one_process(args: list[str]) -> subprocess.CompletedProcess:
    return must(args, env={**os.environ, "MOE_NUM_THREADS": "1"})


def max_relative_error(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def check_logits_match(ctx: dict) -> None:
    m, mpi, tmp = ctx["moeinfer"], ctx["mpi"], ctx["tmp"]
    for name in FIXTURES:
        model = ctx["fixtures"] / "models" / name
        assert model.is_dir(), f"fixture {model} is missing"
        one, two = tmp / f"{name}_1.npy", tmp / f"{name}_2.npy"
        one_process([m, "logits", "--model", str(model), "--ids", IDS, "--out", str(one)])
        _, moved = mpi.run([m, "logits", "--model", str(model), "--ids", IDS, "--out", str(two),
                            "--ep", "2"])
        err = max_relative_error(np.load(two), np.load(one))
        print(f"  {name}: relative error {err:.2e}; A's veth sent {moved['tx']} B, received "
              f"{moved['rx']} B", flush=True)
        assert err <= 1e-5, f"{name} --ep 2 across namespaces: relative error {err:.2e} > 1e-5"


def check_generate_same_text(ctx: dict) -> None:
    m = ctx["moeinfer"]
    base = [m, "generate", "--prompt", PROMPT, "--max-tokens", "16", "--temperature", "0",
            "--ignore-eos"]
    want = one_process(base).stdout
    assert want.strip(), "one process printed nothing"
    got, _ = ctx["mpi"].run([*base, "--ep", "2"])
    assert got.stdout == want, f"--ep 2 across namespaces: {got.stdout!r} differs from {want!r}"


def check_rows_cross_link(ctx: dict) -> None:
    m, tmp = ctx["moeinfer"], ctx["tmp"]
    info = json.loads(one_process([m, "info", "--json"]).stdout)
    experts, k, hidden = info["experts"], info["experts_per_token"], info["hidden_size"]
    assert k >= 2, f"the built-in model routes {k} expert per token; the bound needs K >= 2"
    placement = tmp / "lopsided.json"
    placement.write_text(json.dumps({"format": "moeinfer-placement", "version": 1,
                                     "num_experts": experts, "num_ranks": 2,
                                     "ranks": [[0], list(range(1, experts))]}))
    ids = ",".join(str(1 + (7 * i) % 1000) for i in range(48))  # T = 48
    tokens = len(ids.split(","))
    one, two = tmp / "lopsided_1.npy", tmp / "lopsided_2.npy"
    one_process([m, "logits", "--ids", ids, "--out", str(one)])
    _, moved = ctx["mpi"].run([m, "logits", "--ids", ids, "--out", str(two), "--ep", "2",
                               "--placement", str(placement)])
    bound = info["moe_layers"] * tokens * (k - 1) * hidden * 4  # float32 rows, each way
    print(f"  T={tokens} K={k} H={hidden} MoE layers={info['moe_layers']}: rows each way >= "
          f"{bound} B; A's veth sent {moved['tx']} B, received {moved['rx']} B", flush=True)
    assert moved["tx"] >= bound and moved["rx"] >= bound, \
        f"A's veth moved {moved} bytes, fewer than the {bound} B of rows each way"
    err = max_relative_error(np.load(two), np.load(one))
    assert err <= 1e-5, f"lopsided placement across namespaces: relative error {err:.2e} > 1e-5"


def main() -> int:
    args = e2e_util.parse_args()
    checks = e2e_util.selected([check_logits_match, check_generate_same_text,
                                check_rows_cross_link], args.only)
    ip = shutil.which("ip")
    if ip is None:
        e2e_util.skip_checks(checks, "`ip` not found on PATH (Debian's iproute2; "
                                     "scripts/install-deps.sh installs it)")
        return e2e_util.summary(0, 0)
    # ctest ends a test past its timeout with SIGTERM: tear down then too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated by SIGTERM"))
    pair = NamespacePair(ip)
    passed = failed = 0
    try:
        pair.setup()
        with tempfile.TemporaryDirectory() as tmp:
            tmp = pathlib.Path(tmp)
            ctx = {"moeinfer": str(pathlib.Path(args.moeinfer).resolve()),
                   "fixtures": pathlib.Path(args.fixtures).resolve(), "tmp": tmp,
                   "mpi": TwoHostMpi(pair, tmp)}
            passed, failed = run_checks(checks, lambda check: check(ctx))
    except NamespacePair.Unavailable as e:
        e2e_util.skip_checks(checks, f"cannot make two network namespaces here: {e}")
    finally:
        left = pair.teardown()
    if left:
        print(f"FAIL teardown: still present: {', '.join(left)}", flush=True)
        failed += 1
    return e2e_util.summary(passed, failed)

if __name__ == "__main__":
    sys.exit(main())
