#!/usr/bin/env python3
"""End-to-end: the server's MoE stage histograms on /metrics and its live page /dashboard.

Starts `moeinfer serve --model REPO/models/demo --port 0` (REPO is FIXTURES/../..; the bound port
is read from its log line), sends 6 completions (3 one after another, 3 at once) so there are
figures, waits until the server is idle, and checks:

  metrics_histograms  /metrics has the moeinfer:stage_step_seconds histogram, a series per stage
                      (label stage="..."): buckets cumulative with increasing bounds, +Inf equal
                      to _count; attention, route, experts, lm_head and sample observed in every
                      engine step (count = engine_steps_total), no stage in more; each stage's
                      _sum equals its stage_seconds_total counter; the earlier counters remain
  data_json           GET /dashboard/data: the figures /metrics has (one source of truth): the
                      same request, token, KV and step counts, stage totals and per-step counts,
                      latency counts and sums; rows per layer and expert [L][E] each layer adding
                      up to computed tokens x top_k, max/mean per layer; shares add up to 1; the
                      KV history's last point is now and an earlier one saw blocks in use
  page_self_contained GET /dashboard: HTML with a Content-Security-Policy that allows nothing but
                      inline code and this server; no external script, stylesheet, image or
                      frame, no URL of another host; an <svg> for each of the four panels, empty
                      until the script draws (the page itself holds no figures)
  page_renders        headless Chromium with --virtual-time-budget (so the script polls /dashboard/
                      data and draws) and --dump-dom: the page polled more than once without an
                      error; #dash-stages has a g.stage-bar with a visible rect.bar per stage
                      that ran (and a mix bar segment each); #dash-heatmap one rect.cell per
                      (layer, expert), L x E, all sized, coloured by load; #dash-kv the gauge
                      (track and used rects) and its "used / total blocks" text, and the
                      kv_used, running and waiting polylines with two points at least;
                      #dash-latency a g.lat-row for TTFT, TPOT, ITL and E2E whose request count
                      matches the JSON, each with its p50 dot; eight cards
  screenshot          Chromium's screenshot of /dashboard is a PNG of the window's size that is
                      not blank
  auth                a second server with --api-key and --no-stage-metrics: /dashboard/data and
                      /metrics answer 401 without the key or with a wrong one and 200 with it;
                      /dashboard itself (static) loads without it; in Chromium the page without
                      a key shows its key form (state "auth"), with /dashboard#key=KEY it draws,
                      the stage panel saying stage metrics are off

Chromium is a required test dependency (Debian's `chromium`, installed by
scripts/install-deps.sh): without it the page checks FAIL, they do not skip.

Prints one line per check and a last line "N passed, M failed"; exits non-zero on any failure.
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import re
import shutil
import sys
import tempfile
import urllib.error
import urllib.request
from html.parser import HTMLParser

import e2e_util
from e2e_util import ServerProcess, chromium, parse_metrics, png_info, wait_for

WINDOW = (1400, 1900)
KEY = "dash-secret-3141"
PANELS = ("dash-stages", "dash-heatmap", "dash-kv", "dash-latency")
ALWAYS_RUN = ("attention", "route", "experts", "lm_head", "sample")  # every step, every model
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "Mixture of experts",
           "Hello, my name is", "The quick brown fox"]


def http(base: str, method: str, path: str, body: dict | None = None,
         headers: dict | None = None) -> tuple[int, dict, str]:
    data = json.dumps(body).encode() if body is not None else None
    hdrs = {"Content-Type": "application/json"} if body is not None else {}
    hdrs.update(headers or {})
    req = urllib.request.Request(base + path, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=120) as res:
            return res.status, dict(res.headers), res.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def get_json(base: str, path: str, headers: dict | None = None) -> dict:
    status, _, text = http(base, "GET", path, headers=headers)
    assert status == 200, f"GET {path} answered {status}: {text[:300]}"
    return json.loads(text)


def get_metrics(base: str, headers: dict | None = None) -> tuple[str, dict[str, float]]:
    status, _, text = http(base, "GET", "/metrics", headers=headers)
    assert status == 200, f"/metrics answered {status}"
    return text, parse_metrics(text)


def close(a: float, b: float, rel: float = 1e-6) -> bool:
    return abs(a - b) <= rel * max(1.0, abs(a), abs(b))


# ---------------------------------------------------------------------------------------------
# Chromium and the dumped DOM


VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
        "track", "wbr"}


class Node:
    def __init__(self, tag: str, attrs: dict, parent: "Node | None"):
        self.tag, self.attrs, self.parent = tag, attrs, parent
        self.children: list[Node] = []
        self.text = ""

    def classes(self) -> set[str]:
        return set((self.attrs.get("class") or "").split())

    def walk(self):
        for c in self.children:
            yield c
            yield from c.walk()

    def find(self, tag: str | None = None, cls: str | None = None, **attrs) -> list["Node"]:
        out = []
        for n in self.walk():
            if tag and n.tag != tag:
                continue
            if cls and cls not in n.classes():
                continue
            if any(n.attrs.get(k.replace("_", "-")) != v for k, v in attrs.items()):
                continue
            out.append(n)
        return out

    def by_id(self, id_: str) -> "Node | None":
        found = [n for n in self.walk() if n.attrs.get("id") == id_]
        return found[0] if found else None

    def all_text(self) -> str:
        return self.text + "".join(c.all_text() for c in self.children)


class Tree(HTMLParser):
    """The DOM as Chromium serialised it, as a tree (SVG elements come with end tags)."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.root = Node("#root", {}, None)
        self.current = self.root
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        node = Node(tag, dict(attrs), self.current)
        self.current.children.append(node)
        if tag not in VOID:
            self.current = node

    def handle_startendtag(self, tag, attrs):
        self.current.children.append(Node(tag, dict(attrs), self.current))

    def handle_endtag(self, tag):
        n = self.current
        while n is not self.root and n.tag != tag:
            n = n.parent
        if n is not self.root:
            self.current = n.parent

    def handle_data(self, data):
        self.current.text += data


def number(node: Node, attr: str) -> float:
    return float(node.attrs.get(attr, "nan"))


def render_dom(url: str, work: pathlib.Path, budget_ms: int = 6000) -> Node:
    dom = chromium([f"--virtual-time-budget={budget_ms}", "--dump-dom", url], WINDOW,
                   work / "chromium-profile").stdout
    assert "<body" in dom, f"no DOM came back: {dom[:300]}"
    return Tree(dom).root


# ---------------------------------------------------------------------------------------------
# Checks


def check_metrics_histograms(ctx: dict) -> None:
    text, m = get_metrics(ctx["base"])
    name = "moeinfer:stage_step_seconds"
    assert f"# TYPE {name} histogram" in text, "no stage_step_seconds histogram on /metrics"
    steps = m["moeinfer:engine_steps_total"]
    assert steps > 0, "no engine steps"
    stages = re.findall(rf'^{name}_count{{stage="(\w+)"}}', text, re.M)
    assert len(stages) == 12 and len(set(stages)) == 12, f"stages {stages}"
    for stage in stages:
        bounds, counts = [], []
        for le, value in re.findall(rf'^{name}_bucket{{stage="{stage}",le="([^"]+)"}} (\S+)$',
                                    text, re.M):
            bounds.append(float("inf") if le == "+Inf" else float(le))
            counts.append(float(value))
        assert len(bounds) >= 10 and bounds[-1] == float("inf"), f"{stage}: buckets {bounds}"
        assert all(a < b for a, b in zip(bounds, bounds[1:])), f"{stage}: bounds not increasing"
        assert all(a <= b for a, b in zip(counts, counts[1:])), f"{stage}: not cumulative"
        count = m[f'{name}_count{{stage="{stage}"}}']
        assert counts[-1] == count, f"{stage}: +Inf {counts[-1]} != count {count}"
        assert count <= steps, f"{stage}: observed in {count} of {steps} steps"
        if stage in ALWAYS_RUN:
            assert count == steps, f"{stage}: observed in {count} of {steps} steps"
        total = m[f'moeinfer:stage_seconds_total{{stage="{stage}"}}']
        hist_sum = m[f'{name}_sum{{stage="{stage}"}}']
        assert close(hist_sum, total), f"{stage}: histogram sum {hist_sum} != counter {total}"
    for kept in ("moeinfer:expert_rows_total", "moeinfer:expert_load_max_over_mean",
                 "moeinfer:time_to_first_token_seconds_count", "moeinfer:kv_cache_total_blocks"):
        assert any(k.startswith(kept) for k in m), f"{kept} is gone"
    experts = 'stage="experts"'
    print(f"  {steps:.0f} steps; experts observed in {m[f'{name}_count{{{experts}}}']:.0f}, "
          f"{m[f'{name}_sum{{{experts}}}']:.4f} s in all")


def check_data_json(ctx: dict) -> None:
    d = get_json(ctx["base"], "/dashboard/data")
    _, m = get_metrics(ctx["base"])
    for key in ("model", "time", "uptime_s", "requests", "tokens", "engine", "kv", "stage_metrics",
                "stages", "experts", "latency"):
        assert key in d, f"/dashboard/data has no {key}"
    assert d["model"] == "demo", d["model"]
    r = d["requests"]
    assert r["running"] == m["moeinfer:num_requests_running"] == 0
    assert r["waiting"] == m["moeinfer:num_requests_waiting"] == 0
    assert r["finished_total"] == len(PROMPTS), f"{r['finished_total']} finished"
    for reason, n in r["finished"].items():
        assert n == m[f'moeinfer:request_success_total{{finished_reason="{reason}"}}'], reason
    t = d["tokens"]
    assert t["prompt"] == m["moeinfer:prompt_tokens_total"]
    assert t["generation"] == m["moeinfer:generation_tokens_total"]
    assert t["computed"] == m["moeinfer:computed_tokens_total"]
    assert d["engine"]["steps"] == m["moeinfer:engine_steps_total"]
    kv = d["kv"]
    assert kv["total"] == m["moeinfer:kv_cache_total_blocks"] > 0
    assert kv["used"] == m["moeinfer:kv_cache_used_blocks"] == 0
    assert kv["cached"] == m["moeinfer:kv_cache_cached_blocks"]
    assert kv["prefix_queries"] == m["moeinfer:prefix_cache_queries_total"]
    history = kv["history"]
    assert len(history) >= 2, f"KV history of {len(history)} points"
    assert all(a["t"] <= b["t"] for a, b in zip(history, history[1:])), "history out of order"
    assert abs(history[-1]["t"] - d["uptime_s"]) < 1e-6, "the last history point is not now"
    assert max(p["kv_used"] for p in history) >= 1, "the history never saw a block in use"
    assert max(p["running"] for p in history) >= 1, "the history never saw a running request"

    assert d["stage_metrics"] is True
    stages = {s["stage"]: s for s in d["stages"]}
    assert len(stages) == 12, sorted(stages)
    for name, s in stages.items():
        assert close(s["seconds_total"], m[f'moeinfer:stage_seconds_total{{stage="{name}"}}'])
        assert s["steps"] == m[f'moeinfer:stage_step_seconds_count{{stage="{name}"}}'], name
        assert close(s["step_sum_s"], m[f'moeinfer:stage_step_seconds_sum{{stage="{name}"}}'])
        if s["steps"]:
            assert 0 < s["step_p50_s"] <= s["step_p90_s"], s
    assert abs(sum(s["share"] for s in stages.values()) - 1.0) < 1e-9

    ex = d["experts"]
    L, E, K = ctx["num_layers"], ctx["num_experts"], ctx["top_k"]
    assert (ex["num_layers"], ex["num_experts"]) == (L, E), ex
    assert len(ex["rows"]) == L and all(len(row) == E for row in ex["rows"])
    for layer, row in enumerate(ex["rows"]):
        assert sum(row) == t["computed"] * K, (
            f"layer {layer}: {sum(row)} rows != {t['computed']} tokens x {K}")
        for e, v in enumerate(row):
            assert v == m[f'moeinfer:expert_rows_total{{layer="{layer}",expert="{e}"}}']
        assert close(ex["max_over_mean"][layer], max(row) * E / sum(row))
        assert close(ex["max_over_mean"][layer],
                     m[f'moeinfer:expert_load_max_over_mean{{layer="{layer}"}}'])

    names = {"ttft": "time_to_first_token_seconds", "tpot": "time_per_output_token_seconds",
             "itl": "inter_token_latency_seconds", "e2e": "e2e_request_latency_seconds"}
    for key, metric in names.items():
        lat = d["latency"][key]
        assert lat["count"] == m[f"moeinfer:{metric}_count"], key
        assert close(lat["sum_s"], m[f"moeinfer:{metric}_sum"]), key
        assert lat["window"] == min(lat["count"], 1000), key
        assert 0 < lat["p50_s"] <= lat["p90_s"] <= lat["p99_s"] <= lat["max_s"], (key, lat)
    assert d["latency"]["e2e"]["count"] == len(PROMPTS)
    print(f"  {L} layers x {E} experts, top-{K}; {t['computed']} tokens computed in "
          f"{d['engine']['steps']} steps; {len(history)} KV history points")


def check_page_self_contained(ctx: dict) -> None:
    status, headers, html = http(ctx["base"], "GET", "/dashboard")
    assert status == 200, f"/dashboard answered {status}"
    headers = {k.lower(): v for k, v in headers.items()}
    assert headers.get("content-type", "").startswith("text/html"), headers.get("content-type")
    csp = headers.get("content-security-policy", "")
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp, f"CSP: {csp!r}"
    root = Tree(html).root
    for node in root.walk():
        assert node.tag not in ("link", "img", "iframe", "object", "embed"), f"<{node.tag}>"
        if node.tag == "script":
            assert "src" not in node.attrs, "a script is fetched"
        for key in ("src", "href", "xlink:href", "action"):
            value = node.attrs.get(key) or ""
            assert not re.match(r"^(https?:)?//", value), f"<{node.tag} {key}={value}> fetches"
    assert not re.search(r"url\(\s*['\"]?(https?:)?//", html), "CSS fetches a URL"
    assert "@import" not in html
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", html), "an external URL"
    for panel in PANELS:
        svg = root.by_id(panel)
        assert svg is not None and svg.tag == "svg", f"no <svg id={panel}>"
        assert not svg.children, f"{panel} holds figures before the script ran"
    assert len(root.find("script")) == 1


def check_page_renders(ctx: dict) -> None:
    d = get_json(ctx["base"], "/dashboard/data")
    root = render_dom(ctx["base"] + "/dashboard", ctx["work"])
    body = root.find("body")[0]
    assert body.attrs.get("data-state") == "ok", (
        f"page state {body.attrs.get('data-state')}: {root.by_id('status').all_text()}")
    updates = int(body.attrs.get("data-updates", "0"))
    assert updates >= 2, f"the page drew {updates} times (its polls did not run)"

    stages = root.by_id("dash-stages")
    ran = [s["stage"] for s in d["stages"] if s["seconds_total"] > 0]
    bars = stages.find("g", "stage-bar")
    assert [b.attrs["data-stage"] for b in bars] == ran, (
        f"stage bars {[b.attrs['data-stage'] for b in bars]} for stages that ran {ran}")
    for name in ALWAYS_RUN:
        assert name in ran, f"no {name} bar"
    for b in bars:
        rect = b.find("rect", "bar")
        assert len(rect) == 1 and number(rect[0], "width") > 0, f"{b.attrs['data-stage']}: no bar"
        assert rect[0].attrs.get("fill", "").startswith("#")
    segs = stages.find("g", "stage-stack")[0].find("rect", "seg")
    assert len(segs) == len(ran), f"{len(segs)} mix segments"
    assert [s.attrs.get("fill") for s in segs] == [
        b.find("rect", "bar")[0].attrs.get("fill") for b in bars], "mix and bars differ in colour"

    heat = root.by_id("dash-heatmap")
    cells = heat.find("rect", "cell")
    L, E = ctx["num_layers"], ctx["num_experts"]
    assert len(cells) == L * E, f"{len(cells)} heat-map cells for {L} x {E}"
    assert all(number(c, "width") > 0 and number(c, "height") > 0 for c in cells)
    assert len(heat.find("g", "heat-row")) == L
    fills = {c.attrs.get("fill") for c in cells}
    assert len(fills) >= 4, f"heat map in {len(fills)} colours"
    busiest = max(range(L * E), key=lambda i: d["experts"]["rows"][i // E][i % E])
    assert f"{d['experts']['rows'][busiest // E][busiest % E]} rows" in cells[busiest].all_text()

    kv = root.by_id("dash-kv")
    track, used = kv.find("rect", "kv-track"), kv.find("rect", "kv-used")
    assert len(track) == 1 and len(used) == 1, "no KV gauge"
    assert number(track[0], "width") > 0 and number(used[0], "width") >= 0
    total = d["kv"]["total"]
    assert f"/ {total} blocks" in kv.all_text(), f"no 'used / {total} blocks' text"
    lines = {p.attrs.get("data-series"): p for p in kv.find("polyline", "series")}
    assert set(lines) == {"kv_used", "running", "waiting"}, sorted(lines)
    for key, line in lines.items():
        points = line.attrs.get("points", "").split()
        assert len(points) >= 2, f"{key}: {len(points)} points"

    lat = root.by_id("dash-latency")
    rows = {g.attrs["data-metric"]: g for g in lat.find("g", "lat-row")}
    assert list(rows) == ["ttft", "tpot", "itl", "e2e"], list(rows)
    for key, g in rows.items():
        assert int(g.attrs["data-count"]) == d["latency"][key]["count"] > 0, key
        assert len(g.find("circle", "lat-p50")) == 1, f"{key}: no p50 dot"
        assert "p99" in g.all_text(), f"{key}: no percentile text"

    cards = root.by_id("cards").find("div", "card")
    assert len(cards) == 8, f"{len(cards)} cards"
    print(f"  {updates} updates; {len(bars)} stage bars, {len(cells)} cells, "
          f"{len(lines)} KV/request series, {len(rows)} latency rows")


def check_screenshot(ctx: dict) -> None:
    png = ctx["work"] / "dashboard.png"
    chromium(["--virtual-time-budget=4000", f"--screenshot={png}", ctx["base"] + "/dashboard"],
             WINDOW, ctx["work"] / "chromium-profile")
    assert png.is_file(), "no screenshot written"
    width, height, distinct = png_info(png)
    assert (width, height) == WINDOW, f"screenshot {width}x{height}"
    assert png.stat().st_size > 20000, f"screenshot of {png.stat().st_size} bytes"
    assert distinct > 32, f"screenshot looks blank ({distinct} distinct byte values)"
    print(f"  screenshot {width}x{height}, {png.stat().st_size} bytes")


def check_auth(ctx: dict) -> None:
    server = ServerProcess(ctx["moeinfer"], ["--model", str(ctx["demo"]), "--api-key", KEY,
                                             "--no-stage-metrics"])
    try:
        base = server.base
        good = {"Authorization": f"Bearer {KEY}"}
        for path in ("/dashboard/data", "/metrics"):
            assert http(base, "GET", path)[0] == 401, f"{path} without a key"
            assert http(base, "GET", path, headers={"Authorization": "Bearer nope"})[0] == 401
            assert http(base, "GET", path, headers=good)[0] == 200, f"{path} with the key"
        status, _, html = http(base, "GET", "/dashboard")
        assert status == 200 and "dash-heatmap" in html, f"/dashboard without a key: {status}"
        status, _, _ = http(base, "POST", "/v1/completions",
                            {"model": "demo", "prompt": "Hello", "max_tokens": 4}, headers=good)
        assert status == 200, f"completion with the key: {status}"
        wait_for(lambda: get_json(base, "/dashboard/data", good)["requests"]["finished_total"] == 1,
                 "the completion to be counted")
        assert "stage_step_seconds" not in http(base, "GET", "/metrics", headers=good)[2]

        root = render_dom(base + "/dashboard", ctx["work"], budget_ms=3000)
        body = root.find("body")[0]
        assert body.attrs.get("data-state") == "auth", f"state {body.attrs.get('data-state')}"
        assert "hidden" not in root.by_id("auth").attrs, "no key form"
        assert not root.by_id("dash-heatmap").children, "drew without the key"

        root = render_dom(base + f"/dashboard#key={KEY}", ctx["work"], budget_ms=3000)
        body = root.find("body")[0]
        assert body.attrs.get("data-state") == "ok", f"state {body.attrs.get('data-state')}"
        assert int(body.attrs.get("data-updates", "0")) >= 1
        assert "stage metrics are off" in root.by_id("dash-stages").all_text()
        assert not root.by_id("dash-stages").find("g", "stage-bar")
        assert len(root.by_id("dash-latency").find("g", "lat-row")) == 4
        assert len(root.by_id("dash-kv").find("rect", "kv-used")) == 1
    finally:
        server.stop()


CHECKS = [("metrics_histograms", check_metrics_histograms), ("data_json", check_data_json),
          ("page_self_contained", check_page_self_contained),
          ("page_renders", check_page_renders), ("screenshot", check_screenshot),
          ("auth", check_auth)]


def send_completions(base: str) -> None:
    def one(prompt: str) -> None:
        status, _, text = http(base, "POST", "/v1/completions",
                               {"model": "demo", "prompt": prompt, "max_tokens": 12,
                                "temperature": 0})
        assert status == 200, f"completion answered {status}: {text[:300]}"

    for prompt in PROMPTS[:3]:
        one(prompt)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(one, PROMPTS[3:]))

    def settled() -> bool:
        d = get_json(base, "/dashboard/data")
        r = d["requests"]
        return r["finished_total"] == len(PROMPTS) and r["running"] == 0 and r["waiting"] == 0

    wait_for(settled, "the server to count every request and go idle")


def main() -> int:
    args = e2e_util.parse_args(
        __doc__.split("\n")[0],
        lambda p: p.add_argument("--keep", help="copy the screenshot here for a look"))
    demo = e2e_util.demo_model(args.fixtures)
    config = json.loads((demo / "config.json").read_text())
    checks = e2e_util.selected(CHECKS, args.only)
    with tempfile.TemporaryDirectory(prefix="moeinfer-dashboard-") as tmp:
        ctx = {"moeinfer": args.moeinfer, "demo": demo, "work": pathlib.Path(tmp),
               "num_layers": config["num_hidden_layers"],
               "num_experts": config["num_local_experts"],
               "top_k": config["num_experts_per_tok"]}

        def run(server: ServerProcess, check) -> None:
            if "base" not in ctx:  # the set-up, once: when it fails, every check fails
                ctx["base"] = server.base
                try:
                    send_completions(server.base)
                except Exception as e:  # noqa: BLE001 - reported by each check
                    ctx["setup"] = f"{type(e).__name__}: {e}"
            if "setup" in ctx:
                raise AssertionError(f"the set-up failed: {ctx['setup']}")
            check(ctx)

        passed, failed = e2e_util.serve_and_run(args.moeinfer, ["--model", str(demo)], checks,
                                                run)
        if args.keep and (ctx["work"] / "dashboard.png").is_file():
            shutil.copy(ctx["work"] / "dashboard.png", args.keep)
    return e2e_util.summary(passed, failed)

if __name__ == "__main__":
    sys.exit(main())
