#!/usr/bin/env python3
"""End-to-end: `moeinfer serve --deterministic` keeps a seeded request's text whatever else runs.

Two servers on the demo model, both with --deterministic: one with room for every request, one
whose KV cache is too small for its batch (--kv-cache-mb 2: 25 blocks of 16 tokens), so that
requests are preempted and recomputed as prefills. The same eight concurrent seeded requests
(temperature 1, 100 tokens, logprobs) must give the same tokens with bit-identical logprobs on
both, and each the same as when it is sent alone; the small server must have preempted. Also:
--deterministic with --device cuda is refused at start with a message naming the flag.

Prints one line per check and a last line "N passed, M failed"; exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import subprocess
import sys
import urllib.request

import e2e_util
from e2e_util import parse_metrics, run_checks, wait_for
from openai import OpenAI

class ServerProcess(e2e_util.ServerProcess):
    def client(self) -> OpenAI:
        return OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0, timeout=300)


PROMPTS = [f"Fortune number {i} says that" for i in range(8)]


def sample(client, prompt: str, seed: int):
    r = client.completions.create(model="demo", prompt=prompt, max_tokens=100, temperature=1.0,
                                  seed=seed, logprobs=1, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 100, r.usage
    lp = r.choices[0].logprobs
    return lp.tokens, lp.token_logprobs


def concurrent_samples(client) -> list:
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        return list(pool.map(lambda i: sample(client, PROMPTS[i], 100 + i), range(len(PROMPTS))))


def metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        return parse_metrics(r.read().decode())


def check_seeded_text_survives_batching_and_preemption(ctx: dict) -> None:
    big = ServerProcess(ctx["moeinfer"], ["--deterministic"])
    try:
        alone = [sample(big.client(), p, 100 + i) for i, p in enumerate(PROMPTS)]
        together = concurrent_samples(big.client())
    finally:
        assert big.stop() == 0
    small = ServerProcess(ctx["moeinfer"],
                          ["--deterministic", "--kv-cache-mb", "2", "--max-num-seqs", "16"])
    try:
        assert "25 KV blocks" in "".join(small.log), "".join(small.log)
        preempted = concurrent_samples(small.client())
        wait_for(lambda: metrics(small.base)["moeinfer:num_requests_running"] == 0, "the small server idle")
        assert metrics(small.base)["moeinfer:num_preemptions_total"] > 0, "nothing was preempted"
    finally:
        assert small.stop() == 0
    for i, (a, b, c) in enumerate(zip(alone, together, preempted)):
        assert a == b, f"prompt {i}: batched run differs from the request alone"
        assert a == c, f"prompt {i}: preempted run differs from the request alone"


def check_refused_on_cuda(ctx: dict) -> None:
    r = subprocess.run([ctx["moeinfer"], "serve", "--port", "0", "--deterministic", "--device",
                        "cuda"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, r
    assert "--deterministic" in r.stderr and "cpu" in r.stderr, r.stderr


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--moeinfer", required=True)
    parser.add_argument("--fixtures", required=True)
    args = parser.parse_args()
    ctx = {"moeinfer": args.moeinfer}
    passed, failed = run_checks(
        [check_seeded_text_survives_batching_and_preemption, check_refused_on_cuda],
        lambda check: check(ctx))
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
