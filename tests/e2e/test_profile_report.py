#!/usr/bin/env python3
"""End-to-end: `moeinfer profile` on the demo model writes a consistent report, and its HTML page
renders in headless Chromium with the three charts in place.

Runs `moeinfer profile --model REPO/models/demo --batch 3 --input-len 19 --output-len 7
--repeats 1 --out TMP` (REPO is FIXTURES/../..) and checks:

  files_written        report.txt, report.json and report.html exist and are not empty
  json_consistent      one step per forward pass (1 prefill + O decode), each with the right
                       token count; every step's wall time and its attention, route, experts,
                       lm_head, sample and schedule times are positive and the stages never add
                       up to more than the wall time; in every MoE layer each step's rows per
                       expert add up to tokens x top_k and the per-layer load to all tokens x
                       top_k; imbalance = max/mean of those rows; bytes read = distinct experts x
                       expert bytes; shares add up to 1
  text_table           report.txt has a row per stage that ran and a row per layer
  html_self_contained  report.html has no script and loads nothing from the network
  html_renders         Chromium (`--dump-dom` after load) on a copy of the page with a probe
                       script appended: the three SVG charts are laid out with a non-zero size
                       inside the window, #chart-stage-layers has one g.layer-bar per layer,
                       #chart-load-heatmap one rect.cell per (MoE layer, expert), and each
                       polyline of #chart-imbalance has one point per step (as the browser
                       parsed the points attribute); every chart has a title, axis labels and a
                       legend
  screenshot           Chromium's screenshot of report.html is a PNG of the window's size that
                       is not blank

Chromium is a required test dependency (Debian's `chromium`, installed by
scripts/install-deps.sh): without it the test FAILS, it does not skip.

Prints one line per check and a last line "N passed, M failed"; exits non-zero on any failure.
"""

from __future__ import annotations

import html as html_lib
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser

import e2e_util
from e2e_util import chromium, png_info

BATCH, INPUT_LEN, OUTPUT_LEN = 3, 19, 7
WINDOW = (1400, 2800)

# Appended to a copy of report.html: measures what the browser laid out and writes it as JSON
# into <pre id="probe">, which --dump-dom then prints.
PROBE = """
<pre id="probe"></pre>
<script>
(function () {
  const out = {charts: {}, window_width: window.innerWidth};
  for (const id of ["chart-stage-layers", "chart-load-heatmap", "chart-imbalance"]) {
    const svg = document.getElementById(id);
    if (!svg) continue;
    const box = svg.getBoundingClientRect();
    const sized = (sel) => Array.from(svg.querySelectorAll(sel)).filter((e) => {
      const b = e.getBBox(); return b.width > 0 || b.height > 0; }).length;
    out.charts[id] = {
      width: box.width, height: box.height, left: box.left, right: box.right,
      title: (svg.querySelector(":scope > title") || {}).textContent || "",
      layer_bars: svg.querySelectorAll("g.layer-bar").length,
      sized_segments: sized("g.layer-bar rect.seg"),
      cells: svg.querySelectorAll("rect.cell").length,
      sized_cells: sized("rect.cell"),
      polylines: Array.from(svg.querySelectorAll("polyline.series")).map(
          (p) => ({series: p.dataset.series, points: p.points.numberOfItems})),
      legend_items: svg.querySelectorAll(".legend-item").length,
      axis_titles: Array.from(svg.querySelectorAll(".axis-title")).map((t) => t.textContent),
    };
  }
  document.getElementById("probe").textContent = JSON.stringify(out);
})();
</script>
"""


def check_files(out: pathlib.Path) -> None:
    for name in ("report.txt", "report.json", "report.html"):
        path = out / name
        assert path.is_file(), f"{name} missing"
        assert path.stat().st_size > 200, f"{name} holds only {path.stat().st_size} bytes"


def check_json(report: dict) -> None:
    run, summary, steps = report["run"], report["summary"], report["steps"]
    L, E, K = run["num_layers"], run["num_experts"], run["top_k"]
    moe = run["moe_layers"]
    stages = [s["name"] for s in report["stages"]]
    assert (run["batch"], run["input_len"], run["output_len"]) == (BATCH, INPUT_LEN, OUTPUT_LEN)
    assert len(steps) == 1 + OUTPUT_LEN == summary["steps"], f"{len(steps)} steps"
    # On the CPU every step times its stages unless --time-every says otherwise.
    assert summary["timed_steps"] == summary["steps"] and all(s["timed"] for s in steps)
    assert len(moe) == L and any(moe), f"moe_layers {moe}"
    total_tokens = 0
    for s in steps:
        expect = BATCH * INPUT_LEN if s["step"] == 0 else BATCH
        assert s["phase"] == ("prefill" if s["step"] == 0 else "decode"), s["phase"]
        assert s["tokens"] == expect, f"step {s['step']}: {s['tokens']} tokens, expected {expect}"
        total_tokens += s["tokens"]
        assert s["wall_us"] > 0, f"step {s['step']}: wall {s['wall_us']}"
        for name in ("attention", "route", "experts", "lm_head", "sample", "schedule"):
            assert s["stage_us"][name] > 0, f"step {s['step']}: {name} took {s['stage_us'][name]}"
        assert sum(s["stage_us"].values()) <= s["wall_us"] * 1.0001, f"step {s['step']}"
        assert len(s["layer_stage_us"]) == L + 1
        assert all(len(row) == len(stages) for row in s["layer_stage_us"])
        for name in stages:  # the per-stage sums are the per-layer rows added up
            col = stages.index(name)
            added = sum(row[col] for row in s["layer_stage_us"])
            assert abs(added - s["stage_us"][name]) <= 1e-6 * max(1.0, added), name
        distinct = 0
        for layer in range(L):
            rows = s["expert_rows"][layer]
            assert len(rows) == E
            if not moe[layer]:
                assert sum(rows) == 0 and s["imbalance"][layer] is None
                continue
            assert sum(rows) == s["tokens"] * K, (
                f"step {s['step']} layer {layer}: {sum(rows)} rows != {s['tokens']} x {K}")
            mean = s["tokens"] * K / E
            assert abs(s["imbalance"][layer] - max(rows) / mean) < 1e-9
            assert s["imbalance"][layer] >= 1.0
            distinct += sum(1 for r in rows if r > 0) * run["expert_bytes"][layer]
        assert s["expert_bytes_read"] == distinct, f"step {s['step']}: bytes read"
        values = [x for x in s["imbalance"] if x is not None]
        assert abs(s["imbalance_max"] - max(values)) < 1e-12
        assert abs(s["imbalance_mean"] - sum(values) / len(values)) < 1e-9
    assert total_tokens == BATCH * (INPUT_LEN + OUTPUT_LEN)
    for layer in report["layers"]:
        if not layer["moe"]:
            continue
        assert len(layer["load"]) == E
        assert sum(layer["load"]) == total_tokens * K, (
            f"layer {layer['layer']}: load {sum(layer['load'])} != {total_tokens} x {K}")
        assert layer["max_over_mean"] >= 1.0
        assert layer["stage_ms"]["attention"] > 0 and layer["stage_ms"]["experts"] > 0
    shares = sum(t["share"] for t in report["totals"])
    assert abs(shares - 1.0) < 1e-6, f"shares add up to {shares}"
    for t in report["totals"]:
        if t["stage"] != "other":
            assert t["total_ms"] >= 0, t
    overhead = report["overhead"]
    assert overhead["repeats"] == 1 and overhead["off_ms"] > 0 and overhead["on_ms"] > 0
    assert overhead["scope_on_ns"] > 0 and overhead["scopes_per_step"] > 0
    print(f"  {len(steps)} steps, {L} layers x {E} experts, top-{K}; decode step "
          f"{summary['decode_step_mean_ms']:.3f} ms; profiler overhead measured "
          f"{100 * overhead['measured']:+.2f}% (1 pair, noisy), estimated "
          f"{100 * overhead['estimated']:.3f}%")


def check_text(text: str, report: dict) -> None:
    for t in report["totals"]:
        if t["total_ms"] > 0:
            assert re.search(rf"^{t['stage']}\s+\d", text, re.M), f"no row for {t['stage']}"
    for layer in range(report["run"]["num_layers"]):
        assert re.search(rf"^\s+{layer}\s+\d+\.\d+", text, re.M), f"no row for layer {layer}"


class Elements(HTMLParser):
    """Collects tags with their attributes, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    handle_startendtag = handle_starttag


def check_self_contained(html: str) -> None:
    parser = Elements()
    parser.feed(html)
    tags = {tag for tag, _ in parser.tags}
    assert "script" not in tags, "report.html has a script"
    assert "link" not in tags and "img" not in tags and "iframe" not in tags, tags
    for tag, attrs in parser.tags:
        for key in ("src", "href", "xlink:href"):
            value = attrs.get(key) or ""
            assert not re.match(r"^(https?:)?//", value), f"<{tag} {key}={value}> fetches"
    assert not re.search(r"url\(\s*['\"]?(https?:)?//", html), "CSS fetches a URL"
    assert "@import" not in html
    svgs = [attrs.get("id") for tag, attrs in parser.tags if tag == "svg"]
    for chart in ("chart-stage-layers", "chart-load-heatmap", "chart-imbalance"):
        assert chart in svgs, f"no <svg id={chart}> in report.html"


def check_render(html_path: pathlib.Path, report: dict, work: pathlib.Path) -> None:
    probe_page = work / "probe.html"
    html = html_path.read_text(encoding="utf-8")
    assert "</body>" in html
    probe_page.write_text(html.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    dom = chromium(["--dump-dom", probe_page.as_uri()], WINDOW).stdout
    match = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert match and match.group(1).strip(), "the probe wrote nothing: page did not load/run"
    probe = json.loads(html_lib.unescape(match.group(1)))
    charts = probe["charts"]
    run = report["run"]
    L, E = run["num_layers"], run["num_experts"]
    num_moe = sum(1 for m in run["moe_layers"] if m)
    num_steps = len(report["steps"])
    for chart in ("chart-stage-layers", "chart-load-heatmap", "chart-imbalance"):
        assert chart in charts, f"{chart} not in the rendered DOM"
        c = charts[chart]
        assert c["width"] > 300 and c["height"] > 100, f"{chart} laid out at {c['width']}x{c['height']}"
        assert c["left"] >= 0 and c["right"] <= probe["window_width"] + 1, f"{chart} overflows: {c}"
        assert c["title"].strip(), f"{chart} has no title"
    bars = charts["chart-stage-layers"]
    assert bars["layer_bars"] == L, f"{bars['layer_bars']} layer bars for {L} layers"
    assert bars["sized_segments"] >= L, f"only {bars['sized_segments']} visible bar segments"
    assert bars["legend_items"] >= 2 and len(bars["axis_titles"]) == 2, bars
    heat = charts["chart-load-heatmap"]
    assert heat["cells"] == num_moe * E, f"{heat['cells']} cells for {num_moe} x {E}"
    assert heat["sized_cells"] == heat["cells"], "heat-map cells without a size"
    assert len(heat["axis_titles"]) == 2, heat
    line = charts["chart-imbalance"]
    assert len(line["polylines"]) >= 1, "no imbalance polyline"
    for p in line["polylines"]:
        assert p["points"] == num_steps, f"{p['series']}: {p['points']} points for {num_steps} steps"
    assert line["legend_items"] == len(line["polylines"]), line
    assert len(line["axis_titles"]) == 2, line
    print(f"  rendered: {bars['layer_bars']} layer bars, {heat['cells']} heat-map cells, "
          f"{len(line['polylines'])} polylines x {num_steps} points")


def check_screenshot(html_path: pathlib.Path, work: pathlib.Path) -> None:
    png = work / "report.png"
    chromium([f"--screenshot={png}", html_path.as_uri()], WINDOW)
    assert png.is_file(), "no screenshot written"
    width, height, distinct = png_info(png)
    assert (width, height) == WINDOW, f"screenshot {width}x{height}"
    assert distinct > 32, f"screenshot looks blank ({distinct} distinct byte values)"
    print(f"  screenshot {width}x{height}, {png.stat().st_size} bytes")


def main() -> int:
    args = e2e_util.parse_args(
        __doc__.split("\n")[0],
        lambda p: p.add_argument("--keep", help="copy the report folder here for a look"))
    demo = e2e_util.demo_model(args.fixtures)
    with tempfile.TemporaryDirectory(prefix="moeinfer-profile-") as tmp:
        work = pathlib.Path(tmp)
        out = work / "report"
        report: dict = {}
        checks = e2e_util.selected([
            ("files_written", lambda: check_files(out)),
            ("json_consistent", lambda: check_json(report)),
            ("text_table", lambda: check_text((out / "report.txt").read_text(), report)),
            ("html_self_contained",
             lambda: check_self_contained((out / "report.html").read_text(encoding="utf-8"))),
            ("html_renders", lambda: check_render(out / "report.html", report, work)),
            ("screenshot", lambda: check_screenshot(out / "report.html", work)),
        ], args.only)
        try:
            proc = subprocess.run(
                [args.moeinfer, "profile", "--model", str(demo), "--batch", str(BATCH),
                 "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--repeats", "1",
                 "--seed", "5", "--out", str(out)], capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                raise AssertionError(f"moeinfer profile exited {proc.returncode}: {proc.stderr}")
            report.update(json.loads((out / "report.json").read_text()))
        except Exception as error:  # noqa: BLE001 - every check fails with it
            print(f"FAIL run: {error}")
            return e2e_util.summary(0, 1 + e2e_util.skip_checks(checks, "no report"))
        passed, failed = e2e_util.run_checks(checks)
        if args.keep and out.is_dir():
            shutil.copytree(out, args.keep, dirs_exist_ok=True)
            if (work / "report.png").is_file():
                shutil.copy(work / "report.png", args.keep)
    return e2e_util.summary(passed, failed)

if __name__ == "__main__":
    sys.exit(main())
