#!/usr/bin/env python3
"""End-to-end: `serve` and `bench` under expert parallelism (issue 15, item 3).

`mpirun -np 2 moeinfer serve --ep 2` on the demo model: each rank has its own engine (attention
data-parallel) over experts sharded between the two, rank 0 takes HTTP and hands each request to
the least-loaded rank. Both servers run --deterministic (batch-invariant kernels), so a greedy
text does not depend on what else shares its step and must equal the one-process server's.

  same_text       eight concurrent greedy completions, four prompts streamed and not, each with
                  the one-process server's text, usage and finish reason (and logprobs for one)
  both_ranks      /metrics counts requests sent to rank 0 and to rank 1 and the bytes each sent
                  over the network, and /dashboard/data
                  has a card per rank
  disconnect      a client that leaves mid-stream has its request aborted on whichever rank
                  ran it, and every rank goes idle
  sigterm_rank0   SIGTERM to rank 0 while a stream is in flight: the stream finishes, new
                  requests are refused, every rank stops and mpirun exits 0
  sigterm_mpirun  SIGTERM to mpirun: every rank logs its clean stop before mpirun's SIGKILL and
                  the job ends (Open MPI 4.1's mpirun then reports 1, as after any SIGTERM it
                  forwards)
  rank_dies       a rank killed with SIGKILL makes the whole job fail, not hang
  bench           `mpirun -np 2 moeinfer bench --ep 2` splits the batch over the ranks, prints
                  the job's throughput and writes it as JSON
  offloaded       `serve --ep 2 --expert-budget 50%`: eight concurrent completions get the
                  one-process, all-resident server's texts; /metrics counts the caches' demands
  bad_flags       serve --ep 2 outside mpirun names the launch command, on either device (GPU
                  ranks serve too: test_expert_parallel.py's cuda_ep_serve); --expert-budget with
                  --micro-batches 2 is refused by name; rank 0 failing alone (its port taken)
                  ends the job instead of leaving rank 1 waiting

Prints one line per check and a last line "N passed, M failed"; exits non-zero on any failure.
"""

from __future__ import annotations

import json
import os
import pathlib
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import e2e_util
from e2e_util import ServerProcess, mpi_env, mpirun_path, parse_metrics, run_checks, wait_for

PROMPTS = ["The capital of France is", "Once upon a time", "A fortune cookie says:",
           "Q: What is a computer?\nA:"]
SERVE_FLAGS = ["--deterministic", "--disable-log-requests", "--log-interval", "0"]
START_TIMEOUT = 120.0




class MpiServer:
    """`mpirun -np 2 moeinfer serve --ep 2 --port 0`; the port and each rank's pid come from the
    log."""

    def __init__(self, moeinfer: str, extra: list[str], env: dict | None = None):
        self.proc = subprocess.Popen(
            [mpirun_path(), "-np", "2", moeinfer, "serve", "--ep", "2", "--port", "0", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**mpi_env(), **(env or {})})
        self.log: list[str] = []
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()
        self.port = None
        self.pids: dict[int, int] = {}
        deadline = time.monotonic() + START_TIMEOUT
        while self.port is None or len(self.pids) < 2:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.kill()
                raise AssertionError(f"the job did not start: {''.join(self.log)[-3000:]}")
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if m := re.search(r"on http://127\.0\.0\.1:(\d+)", line):
                self.port = int(m.group(1))
            if m := re.search(r"rank (\d+) of 2 \(pid (\d+)\)", line):
                self.pids[int(m.group(1))] = int(m.group(2))
        self.base = f"http://127.0.0.1:{self.port}"

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            self.lines.put(line)

    def client(self):
        from openai import OpenAI
        return OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0, timeout=120)

    def saw(self, text: str) -> bool:
        return any(text in line for line in self.log)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the job did not end: {''.join(self.log)[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        return parse_metrics(r.read().decode())


def assigned(base: str) -> list[float]:
    m = metrics(base)
    return [m.get(f'moeinfer:rank_requests_assigned_total{{rank="{r}"}}', 0.0) for r in (0, 1)]


def idle(base: str) -> bool:
    m = metrics(base)
    return all(m.get(f'moeinfer:rank_num_requests_{kind}{{rank="{r}"}}', 1.0) == 0
               for r in (0, 1) for kind in ("running", "waiting"))


def complete(c, prompt: str, stream: bool, logprobs: int | None = None) -> dict:
    """One greedy completion: its text, finish reason, usage and chosen tokens."""
    args = dict(model="demo", prompt=prompt, max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True}, logprobs=logprobs)
    if not stream:
        r = c.completions.create(**args)
        return {"text": r.choices[0].text, "finish": r.choices[0].finish_reason,
                "usage": (r.usage.prompt_tokens, r.usage.completion_tokens),
                "tokens": r.choices[0].logprobs.tokens if logprobs else None}
    text, finish, usage, tokens = "", None, None, []
    for chunk in c.completions.create(**args, stream=True,
                                      stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
            if logprobs and choice.logprobs:
                tokens += choice.logprobs.tokens
    return {"text": text, "finish": finish, "usage": usage,
            "tokens": tokens if logprobs else None}


def run_concurrently(fn, keys: list) -> dict:
    """fn(key) for every key, each on its own thread at once; the results by key. Raises with
    every failure's key when any call failed."""
    results: dict = {}
    errors: list[str] = []

    def one(key):
        try:
            results[key] = fn(key)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{key}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(key,)) for key in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def reference(moeinfer: str) -> dict[str, dict]:
    """The one-process server's answers, one request at a time."""
    server = ServerProcess(moeinfer, SERVE_FLAGS)
    try:
        c = server.client()
        want = {p: complete(c, p, stream=False) for p in PROMPTS}
        want["logprobs"] = complete(c, PROMPTS[0], stream=False, logprobs=2)
    finally:
        code = server.stop()
    assert code == 0, f"the one-process server exited {code}"
    return want


def check_same_text(s: MpiServer, ctx: dict) -> None:
    c = s.client()
    want = ctx["want"]
    jobs = [(p, stream) for p in PROMPTS for stream in (False, True)]
    results = run_concurrently(lambda job: complete(c, job[0], stream=job[1]), jobs)
    for (prompt, stream), got in results.items():
        w = want[prompt]
        assert got["text"] == w["text"], (prompt, stream, got["text"], w["text"])
        assert got["finish"] == w["finish"] == "length", (prompt, stream, got["finish"])
        assert got["usage"] == w["usage"], (prompt, stream, got["usage"], w["usage"])
    got = complete(c, PROMPTS[0], stream=True, logprobs=2)
    assert got["tokens"] == want["logprobs"]["tokens"], (got["tokens"], want["logprobs"]["tokens"])


def check_both_ranks(s: MpiServer, ctx: dict) -> None:
    counts = assigned(s.base)
    assert counts[0] > 0 and counts[1] > 0, f"requests per rank {counts}"
    with urllib.request.urlopen(s.base + "/dashboard/data", timeout=30) as r:
        data = json.loads(r.read())
    assert len(data["ranks"]) == 2, data["ranks"]
    assert [r["assigned"] for r in data["ranks"]] == counts, (data["ranks"], counts)
    # Every step's MoE layers are collective: both ranks sent rows and outputs over the network.
    sent = [metrics(s.base).get(f'moeinfer:rank_network_bytes_total{{rank="{r}"}}', 0.0)
            for r in (0, 1)]
    assert sent[0] > 0 and sent[1] > 0, f"network bytes per rank {sent}"
    assert all(r["network_bytes"] > 0 for r in data["ranks"]), data["ranks"]


def check_disconnect(s: MpiServer, ctx: dict) -> None:
    c = s.client()
    key = 'moeinfer:request_success_total{finished_reason="abort"}'
    aborted = metrics(s.base).get(key, 0.0)
    # Two streams, so that whichever rank is least loaded, both ranks hold one.
    streams = [c.completions.create(model="demo", prompt=p, max_tokens=400, temperature=0,
                                    stream=True, extra_body={"ignore_eos": True})
               for p in PROMPTS[:2]]
    for stream in streams:
        it = iter(stream)
        for _ in range(3):
            next(it)
    for stream in streams:
        stream.close()  # hang up mid-stream
    wait_for(lambda: metrics(s.base).get(key, 0.0) >= aborted + 2,
             "both abandoned requests to be aborted")
    wait_for(lambda: idle(s.base), "every rank to go idle")
    # The server still serves.
    assert complete(c, PROMPTS[1], stream=False)["text"] == ctx["want"][PROMPTS[1]]["text"]


def check_sigterm_rank0(s: MpiServer, ctx: dict) -> None:
    import openai
    c = s.client()
    stream = c.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=150,
                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    os.kill(s.pids[0], signal.SIGTERM)
    wait_for(lambda: s.saw("SIGTERM, finishing requests in flight"), "rank 0 to see SIGTERM")
    try:
        c.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=4)
        raise AssertionError("a request after SIGTERM was served")
    except (openai.APIStatusError, openai.APIConnectionError) as e:
        if isinstance(e, openai.APIStatusError):
            assert e.status_code == 503, e.status_code
    finish = None
    for chunk in it:
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "length", f"the in-flight stream ended with {finish}"
    code = s.wait()
    assert code == 0, f"mpirun exited {code}: {''.join(s.log)[-2000:]}"
    assert s.saw("moeinfer serve: stopped") and s.saw("rank 1 stopped"), "".join(s.log)[-2000:]


def check_sigterm_mpirun(moeinfer: str) -> None:
    s = MpiServer(moeinfer, SERVE_FLAGS)
    try:
        assert complete(s.client(), PROMPTS[2], stream=False)["finish"] == "length"
        # Open MPI 4.1's mpirun answers SIGTERM with SIGCONT to every rank, SIGTERM
        # odls_base_sigkill_timeout (1 s) later, then SIGKILL as long again after that.
        s.proc.send_signal(signal.SIGTERM)
        code = s.wait()
    finally:
        s.kill()
    assert s.saw("moeinfer serve: stopped") and s.saw("rank 1 stopped"), "".join(s.log)[-2000:]
    # mpirun itself exits 1 after forwarding a SIGTERM, whatever its ranks do.
    print(f"  (mpirun exited {code}; every rank stopped cleanly)", flush=True)


def check_rank_dies(moeinfer: str) -> None:
    s = MpiServer(moeinfer, SERVE_FLAGS)
    try:
        os.kill(s.pids[1], signal.SIGKILL)
        code = s.wait()
    finally:
        s.kill()
    assert code != 0, "the job exited 0 after a rank was killed"


def check_bench(moeinfer: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "bench.json"
        r = subprocess.run([mpirun_path(), "-np", "2", moeinfer, "bench", "--ep", "2", "--batch",
                            "3", "--input-len", "8", "--output-len", "8", "--json", str(out)],
                           capture_output=True, text=True, timeout=120, env=mpi_env())
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.count("bench: demo on cpu, batch 3") == 1, r.stdout  # rank 0 prints
        assert "requests per rank 2 / 1" in r.stdout, r.stdout
        assert "Output token throughput" in r.stdout, r.stdout
        result = json.loads(out.read_text())
        assert result["ep"] == 2 and result["requests_per_rank"] == [2, 1], result
        assert result["output_throughput"] > 0, result


def check_offloaded(moeinfer: str) -> None:
    """Offloading with expert parallelism and continuous batching in one job: eight concurrent
    completions against `serve --ep 2 --expert-budget 50%` (each rank's cache over the experts
    it holds) get the one-process, all-resident server's texts, and /metrics counts the caches'
    demands."""
    want = reference(moeinfer)
    server = MpiServer(moeinfer, [*SERVE_FLAGS, "--expert-budget", "50%"])
    try:
        c = server.client()
        jobs = [(p, stream) for p in PROMPTS for stream in (False, True)]
        results = run_concurrently(lambda job: complete(c, job[0], stream=job[1]), jobs)
        for (prompt, stream), got in results.items():
            assert got["text"] == want[prompt]["text"], (prompt, stream, got["text"],
                                                         want[prompt]["text"])
        m = metrics(server.base)
        demands = sum(m.get(f"moeinfer:expert_cache_{n}_total", 0.0)
                      for n in ("hits", "misses", "unplaced"))
        assert demands > 0, "no expert demand counted under --expert-budget"
    finally:
        server.kill()


def check_bad_flags(moeinfer: str) -> None:
    def run(cmd, mpi: bool):
        full = [mpirun_path(), "-np", "2", *cmd] if mpi else cmd
        return subprocess.run(full, capture_output=True, text=True, timeout=120, env=mpi_env())

    for sub in ("serve", "bench"):
        r = run([moeinfer, sub, "--ep", "2"], mpi=False)
        assert r.returncode != 0 and "mpirun -np 2" in r.stderr, (sub, r.stderr[-1000:])
        r = run([moeinfer, sub, "--ep", "2", "--device", "cuda"], mpi=False)
        assert r.returncode != 0 and "mpirun -np 2" in r.stderr, (sub, r.stderr[-1000:])
    r = run([moeinfer, "serve", "--ep", "2", "--port", "0", "--expert-budget", "25%",
             "--micro-batches", "2"], mpi=True)
    assert r.returncode != 0 and "--micro-batches 2 with --expert-budget" in r.stderr, \
        r.stderr[-1500:]
    # Rank 0 failing alone (its port is taken) ends the job while rank 1 waits for it.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = run([moeinfer, "serve", "--ep", "2", "--port", str(taken.getsockname()[1])], mpi=True)
    assert r.returncode != 0 and "address in use" in r.stderr, r.stderr[-1500:]


def main() -> int:
    args = e2e_util.parse_args()
    moeinfer = args.moeinfer
    os.environ["MOE_NUM_THREADS"] = "1"  # the one-process reference too: two cores, shared
    ctx: dict = {}
    served = [check_same_text, check_both_ranks, check_disconnect, check_sigterm_rank0]
    alone = [("sigterm_mpirun", lambda: check_sigterm_mpirun(moeinfer)),
             ("rank_dies", lambda: check_rank_dies(moeinfer)),
             ("bench", lambda: check_bench(moeinfer)),
             ("offloaded", lambda: check_offloaded(moeinfer)),
             ("bad_flags", lambda: check_bad_flags(moeinfer))]
    passed = failed = 0
    chosen = e2e_util.selected(served, args.only)
    if chosen:
        try:
            ctx["want"] = reference(moeinfer)
            server = MpiServer(moeinfer, SERVE_FLAGS)
        except Exception as e:  # noqa: BLE001 - reported as a failure
            print(f"FAIL start: {type(e).__name__}: {e}", flush=True)
            return e2e_util.summary(0, 1)
        try:
            passed, failed = run_checks(chosen, lambda check: check(server, ctx))
        finally:
            server.kill()
    p, f = run_checks(e2e_util.selected(alone, args.only))
    return e2e_util.summary(passed + p, failed + f)


if __name__ == "__main__":
    sys.exit(main())
