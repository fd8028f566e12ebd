#!/usr/bin/env python3
"""End-to-end: what `moeinfer serve` reports about itself: vLLM's metric names and labels on
/metrics, the per-token TPOT histogram, the access log and the periodic engine line on stderr.

Starts the demo model as `--served-model-name obs-demo --log-interval 0.25` and checks:

  vllm_names       every vllm: name a vLLM Grafana board reads is on /metrics with vLLM's type
                   and the labels model_name="obs-demo" (the served name) and engine="0", and
                   agrees with its moeinfer: twin
  tpot_per_token   sequential requests of known lengths (ignore_eos) add, to the TPOT and ITL
                   histograms (moeinfer: and vllm:), one sample per output token after the
                   first (the sum over requests of output tokens minus one); TTFT, end-to-end,
                   queue time and the per-request histograms one sample per request, and
                   vllm:request_generation_tokens the tokens themselves
  access_log       one stderr line per request: its id, endpoint, status, prompt and output
                   tokens as `usage` gave them, queue time, TTFT and latency; a refused request
                   a 400 line; a stream its own line
  engine_line      a line "Avg prompt throughput: X tokens/s, Avg generation throughput: Y
                   tokens/s, Running: N reqs, Waiting: M reqs, KV cache usage: P%" with Y > 0
                   after work
  quiet            a second server with --disable-log-requests --log-interval 0 writes neither
                   (its whole stderr read after it stopped)

Prints one line per check and a last line "N passed, M failed"; exits non-zero on any failure.
"""

from __future__ import annotations

import http.client
import json
import re
import sys

import e2e_util
from e2e_util import parse_metrics, wait_for

NAME = "obs-demo"
LABELS = f'model_name="{NAME}",engine="0"'
ENGINE_LINE = re.compile(
    r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
    r"Running: (\d+) reqs, Waiting: (\d+) reqs, KV cache usage: ([\d.]+)%")
ACCESS_LINE = re.compile(
    r'access (\S+) (\S+) "(\S+) (\S+)" (\d{3}) prompt_tokens=(\S+) output_tokens=(\S+) '
    r"cached_tokens=(\S+) queue=(\S+) ttft=(\S+) latency=(\S+) finish=(\S+)")


def request(port: int, method: str, path: str, body: dict | bytes | None = None
            ) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, data, {"Content-Type": "application/json"} if data else {})
        res = conn.getresponse()
        return res.status, res.read()
    finally:
        conn.close()


def metrics_text(port: int) -> str:
    status, text = request(port, "GET", "/metrics")
    assert status == 200, status
    return text.decode()


def complete(port: int, prompt: str, max_tokens: int, stream: bool = False) -> dict:
    status, body = request(port, "POST", "/v1/completions", {
        "model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {})})
    assert status == 200, (status, body[:300])
    if not stream:
        return json.loads(body)
    events = [json.loads(line[6:]) for line in body.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return {"id": events[0]["id"], "usage": events[-1]["usage"]}


# (vllm: name, Prometheus type, moeinfer: twin or None)
VLLM_METRICS = [
    ("num_requests_running", "gauge", "num_requests_running"),
    ("num_requests_waiting", "gauge", "num_requests_waiting"),
    ("kv_cache_usage_perc", "gauge", "kv_cache_usage_perc"),
    ("gpu_cache_usage_perc", "gauge", "kv_cache_usage_perc"),
    ("prompt_tokens_total", "counter", "prompt_tokens_total"),
    ("generation_tokens_total", "counter", "generation_tokens_total"),
    ("prefix_cache_queries_total", "counter", "prefix_cache_queries_total"),
    ("prefix_cache_hits_total", "counter", "prefix_cache_hits_total"),
    ("num_preemptions_total", "counter", "num_preemptions_total"),
    ("time_to_first_token_seconds", "histogram", "time_to_first_token_seconds"),
    ("time_per_output_token_seconds", "histogram", "time_per_output_token_seconds"),
    ("inter_token_latency_seconds", "histogram", "inter_token_latency_seconds"),
    ("request_time_per_output_token_seconds", "histogram",
     "request_time_per_output_token_seconds"),
    ("e2e_request_latency_seconds", "histogram", "e2e_request_latency_seconds"),
    ("request_queue_time_seconds", "histogram", "request_queue_time_seconds"),
    ("request_inference_time_seconds", "histogram", None),
    ("request_prefill_time_seconds", "histogram", None),
    ("request_decode_time_seconds", "histogram", None),
    ("request_prompt_tokens", "histogram", None),
    ("request_generation_tokens", "histogram", None),
    ("iteration_tokens_total", "histogram", None),
    ("request_params_n", "histogram", None),
    ("request_params_max_tokens", "histogram", None),
]


def check_vllm_names(ctx: dict) -> None:
    port = ctx["server"].port
    complete(port, "Once upon a time", 8)
    text = metrics_text(port)
    types = dict(re.findall(r"^# TYPE (vllm:\S+) (\S+)$", text, re.M))
    m = parse_metrics(text)
    for name, kind, ours in VLLM_METRICS:
        assert types.get(f"vllm:{name}") == kind, (name, types.get(f"vllm:{name}"))
        key = f"vllm:{name}{{{LABELS}}}" if kind != "histogram" else \
            f"vllm:{name}_count{{{LABELS}}}"
        assert key in m, f"{key} missing"
        if ours:
            twin = f"moeinfer:{ours}" + ("_count" if kind == "histogram" else "")
            assert m[key] == m[twin], (key, m[key], twin, m[twin])
    for reason in ("stop", "length", "abort"):
        key = f'vllm:request_success_total{{{LABELS},finished_reason="{reason}"}}'
        assert m[key] == m[f'moeinfer:request_success_total{{finished_reason="{reason}"}}'], key
    assert m[f'vllm:request_success_total{{{LABELS},finished_reason="length"}}'] >= 1
    # Every vllm: sample carries both labels.
    for line in text.splitlines():
        if line.startswith("vllm:"):
            assert f'model_name="{NAME}"' in line and 'engine="0"' in line, line


def check_tpot_per_token(ctx: dict) -> None:
    port = ctx["server"].port
    wait_for(lambda: parse_metrics(metrics_text(port))["moeinfer:num_requests_running"] == 0,
             "no request running")
    before = parse_metrics(metrics_text(port))
    lengths = [1, 2, 5, 9, 17]
    for i, n in enumerate(lengths):
        r = complete(port, f"Fortune number {i}", n, stream=i % 2 == 1)
        assert r["usage"]["completion_tokens"] == n, r["usage"]
    after = parse_metrics(metrics_text(port))

    def delta(key: str) -> float:
        return after[key] - before[key]

    intervals = sum(n - 1 for n in lengths)
    for key in ("moeinfer:time_per_output_token_seconds_count",
                "moeinfer:inter_token_latency_seconds_count",
                f"vllm:time_per_output_token_seconds_count{{{LABELS}}}",
                f"vllm:inter_token_latency_seconds_count{{{LABELS}}}"):
        assert delta(key) == intervals, (key, delta(key), intervals)
    for key in ("moeinfer:time_to_first_token_seconds_count",
                "moeinfer:e2e_request_latency_seconds_count",
                "moeinfer:request_queue_time_seconds_count",
                f"vllm:time_to_first_token_seconds_count{{{LABELS}}}",
                f"vllm:e2e_request_latency_seconds_count{{{LABELS}}}",
                f"vllm:request_queue_time_seconds_count{{{LABELS}}}",
                f"vllm:request_prompt_tokens_count{{{LABELS}}}"):
        assert delta(key) == len(lengths), (key, delta(key))
    # The per-request mean: only requests of more than one token have one.
    assert delta(f"vllm:request_time_per_output_token_seconds_count{{{LABELS}}}") == \
        sum(1 for n in lengths if n > 1)
    assert delta(f"vllm:request_generation_tokens_sum{{{LABELS}}}") == sum(lengths)
    assert delta(f"vllm:generation_tokens_total{{{LABELS}}}") == sum(lengths)
    assert delta(f"vllm:request_params_max_tokens_sum{{{LABELS}}}") == sum(lengths)
    assert delta(f"vllm:iteration_tokens_total_count{{{LABELS}}}") >= max(lengths)


def access_lines(server: e2e_util.ServerProcess) -> list[re.Match]:
    return [m for m in map(ACCESS_LINE.search, list(server.log)) if m]


def check_access_log(ctx: dict) -> None:
    server = ctx["server"]
    port = server.port
    plain = complete(port, "Tomorrow brings", 6)
    streamed = complete(port, "A wise man once said", 4, stream=True)
    status, _ = request(port, "POST", "/v1/completions", b'{"prompt": ')
    assert status == 400
    status, _ = request(port, "GET", "/v1/models")
    assert status == 200

    def line_of(rid: str) -> re.Match | None:
        return next((m for m in access_lines(server) if m.group(1) == rid), None)

    for r in (plain, streamed):
        wait_for(lambda: line_of(r["id"]) is not None, f"the access line of {r['id']}")
        m = line_of(r["id"])
        assert m.group(3, 4, 5) == ("POST", "/v1/completions", "200"), m.group(0)
        assert int(m.group(6)) == r["usage"]["prompt_tokens"], (m.group(0), r["usage"])
        assert int(m.group(7)) == r["usage"]["completion_tokens"], (m.group(0), r["usage"])
        assert m.group(12) == "length", m.group(0)
        queue, ttft, latency = (float(m.group(i).rstrip("s")) for i in (9, 10, 11))
        assert 0 <= queue <= ttft <= latency, m.group(0)
        assert m.group(2).startswith("127.0.0.1:"), m.group(0)
    wait_for(lambda: any(m.group(5) == "400" and m.group(4) == "/v1/completions"
                         for m in access_lines(server)), "the access line of the 400")
    wait_for(lambda: any(m.group(3, 4, 5) == ("GET", "/v1/models", "200")
                         for m in access_lines(server)), "the access line of GET /v1/models")
    # Successful scrapes are not logged (a dashboard polls every second).
    assert not any(m.group(4) == "/metrics" for m in access_lines(server))


def check_engine_line(ctx: dict) -> None:
    server = ctx["server"]
    complete(server.port, "You will soon", 24)

    def busy_line() -> bool:
        return any((m := ENGINE_LINE.search(line)) and float(m.group(2)) > 0
                   for line in list(server.log))

    wait_for(busy_line, "an engine line with generation throughput")
    m = next(m for m in map(ENGINE_LINE.search, list(server.log)) if m)
    assert 0 <= float(m.group(5)) <= 100, m.group(0)


def check_quiet(ctx: dict) -> None:
    quiet = e2e_util.ServerProcess(ctx["moeinfer"], ["--served-model-name", NAME,
                                                     "--disable-log-requests",
                                                     "--log-interval", "0"])
    try:
        for i in range(3):
            complete(quiet.port, f"Quiet {i}", 8, stream=i == 1)
        assert request(quiet.port, "POST", "/v1/completions", b"{")[0] == 400
    finally:
        code = quiet.stop()
    assert code == 0, code
    log = "".join(quiet.log)
    assert " access " not in log, log
    assert "Avg prompt throughput" not in log, log


CHECKS = [check_vllm_names, check_tpot_per_token, check_access_log, check_engine_line,
          check_quiet]


def main() -> int:
    args = e2e_util.parse_args()
    ctx: dict = {"moeinfer": args.moeinfer}

    def run(server: e2e_util.ServerProcess, check) -> None:
        ctx["server"] = server
        check(ctx)

    return e2e_util.summary(*e2e_util.serve_and_run(
        args.moeinfer, ["--served-model-name", NAME, "--log-interval", "0.25"],
        e2e_util.selected(CHECKS, args.only), run, clean_exit=True))

if __name__ == "__main__":
    sys.exit(main())
