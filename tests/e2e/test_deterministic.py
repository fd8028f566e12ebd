#!/usr/bin/env python3
"""End-to-end: `moeinfer serve --deterministic` keeps a seeded request's text whatever else runs.

Two servers on the demo model, both with --deterministic: one with room for every request, one
whose KV cache is too small for its batch (25 blocks of 16 tokens: --kv-cache-mb 2 of float32
rows on the CPU, 1 of bf16 rows on the GPU) and whose steps take at most 24 tokens (prompts
chunked), so that requests are preempted and recomputed as prefills. The same eight concurrent
seeded requests (temperature 1, 100 tokens, logprobs; half of them with top-p 0.9) must give the
same tokens with bit-identical logprobs on both, and each the same as when it is sent alone;
the small server must have preempted. The check runs with --device cpu, and again with
--device cuda where the build has CUDA and a device is visible (`moeinfer info --device cuda`
succeeds); without one the cuda check says so and passes as skipped.

Prints one line per check and a last line "N passed, M failed"; exits non-zero on any failure.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import urllib.request

import e2e_util
from e2e_util import ServerProcess, parse_metrics, run_checks, wait_for

PROMPTS = [f"Fortune number {i} says that" for i in range(8)]


def sample(client, prompt: str, seed: int):
    top_p = 0.9 if seed % 2 else 1.0
    r = client.completions.create(model="demo", prompt=prompt, max_tokens=100, temperature=1.0,
                                  top_p=top_p, seed=seed, logprobs=1,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 100, r.usage
    lp = r.choices[0].logprobs
    return lp.tokens, lp.token_logprobs


def concurrent_samples(client) -> list:
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        return list(pool.map(lambda i: sample(client, PROMPTS[i], 100 + i), range(len(PROMPTS))))


def metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        return parse_metrics(r.read().decode())


def seeded_text_survives_batching_and_preemption(moeinfer: str, device: str) -> None:
    big = ServerProcess(moeinfer, ["--deterministic", "--device", device])
    try:
        alone = [sample(big.client(), p, 100 + i) for i, p in enumerate(PROMPTS)]
        together = concurrent_samples(big.client())
    finally:
        assert big.stop() == 0
    # 25 blocks of 16 tokens either way: float32 rows on the CPU, bf16 rows on the GPU.
    kv_mb = "2" if device == "cpu" else "1"
    small = ServerProcess(moeinfer, ["--deterministic", "--device", device, "--kv-cache-mb", kv_mb,
                                     "--max-num-seqs", "16", "--max-num-batched-tokens", "24"])
    try:
        assert "25 KV blocks" in "".join(small.log), "".join(small.log)
        preempted = concurrent_samples(small.client())
        wait_for(lambda: metrics(small.base)["moeinfer:num_requests_running"] == 0, "the small server idle")
        assert metrics(small.base)["moeinfer:num_preemptions_total"] > 0, "nothing was preempted"
    finally:
        assert small.stop() == 0
    for i, (a, b, c) in enumerate(zip(alone, together, preempted)):
        assert a == b, f"{device}, prompt {i}: batched run differs from the request alone"
        assert a == c, f"{device}, prompt {i}: preempted run differs from the request alone"


def cuda_available(moeinfer: str) -> bool:
    r = subprocess.run([moeinfer, "info", "--device", "cuda"], capture_output=True, text=True,
                       timeout=300)
    return r.returncode == 0


def check_seeded_text_survives_batching_and_preemption(ctx: dict) -> None:
    seeded_text_survives_batching_and_preemption(ctx["moeinfer"], "cpu")


def check_seeded_text_survives_batching_and_preemption_on_cuda(ctx: dict) -> None:
    if not cuda_available(ctx["moeinfer"]):
        print("SKIP seeded_text_survives_batching_and_preemption_on_cuda: no CUDA device "
              "(or a build without CUDA)", flush=True)
        return
    seeded_text_survives_batching_and_preemption(ctx["moeinfer"], "cuda")


def main() -> int:
    args = e2e_util.parse_args()
    ctx = {"moeinfer": args.moeinfer}
    checks = [check_seeded_text_survives_batching_and_preemption,
              check_seeded_text_survives_batching_and_preemption_on_cuda]
    return e2e_util.summary(*run_checks(e2e_util.selected(checks, args.only),
                                        lambda check: check(ctx)))


if __name__ == "__main__":
    sys.exit(main())
