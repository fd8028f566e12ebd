// The live dashboard page (see dashboard.h). The page is static: the browser fetches the
// figures from /dashboard/data and draws them, so the HTML is built once, with the profile
// report's stylesheet, stage colours and heat-map ramp (profile/report.h) so both pages look
// alike. The drawing code mirrors report_html.cpp's charts (nice axis ticks, legends, cells with
// tooltips) in a few small script helpers.
#include "server/dashboard.h"

#include <string_view>

#include "profile/profiler.h"
#include "profile/report.h"

namespace moeinfer::server {
namespace {

// Added to the report's stylesheet.
constexpr std::string_view kDashboardCss = R"css(
header .status { font-size:13px; opacity:.9; }
body[data-state="error"] header { background:linear-gradient(120deg,#5f1e1e,#a74e4e); }
.two { display:grid; grid-template-columns:1fr 1fr; gap:16px; }
.two section { margin:0; }
.auth { background:#fff7e6; border:1px solid #f5d08a; border-radius:10px; padding:12px 16px;
        margin-bottom:16px; }
.auth input { font:inherit; padding:4px 8px; width:22em; margin:0 8px; }
.auth button { font:inherit; padding:4px 12px; }
.kv-text { font-size:13px; fill:#1f2937; font-weight:600; }
.lat-label { font-size:13px; fill:#111827; font-weight:650; }
.lat-range { stroke:#4e79a7; stroke-width:2; }
.lat-box { fill:#c6dbef; stroke:#4e79a7; stroke-width:1; }
.lat-p50 { fill:#1e3a5f; }
.lat-p99 { stroke:#e15759; stroke-width:2.5; }
.lat-mean { fill:#f28e2b; }
rect.bar:hover, rect.kv-used:hover { stroke:#111827; stroke-width:1.5; }
@media (max-width: 900px) { .two { grid-template-columns:1fr; } }
)css";

constexpr std::string_view kBody = R"page(
<header><h1>moeinfer · live</h1>
<p><span id="subtitle">connecting…</span> <span class="status" id="status"></span></p></header>
<main>
<form class="auth" id="auth" hidden>This server wants an API key:
<input id="auth-key" type="password" autocomplete="off" placeholder="key given to --api-key">
<button type="submit">Use key</button>
<span class="muted">(or open <code>/dashboard#key=KEY</code>)</span></form>
<div class="cards" id="cards"></div>
<section><h2>Stage breakdown</h2>
<p class="sub">Share of the profiled time of each MoE-path stage since the server started, and
its time per engine step over the steps it ran in: the mean, and the p90 as the
<code>stage_step_seconds</code> histogram of <code>/metrics</code> places it (interpolated within a
bucket).</p>
<svg id="dash-stages" class="chart" role="img"></svg></section>
<section><h2>Expert load</h2>
<p class="sub">Token rows routed to each expert of each layer since the server started (darker:
more rows); right, each layer's busiest expert over the mean (1 = balanced).</p>
<svg id="dash-heatmap" class="chart" role="img"></svg></section>
<div class="two">
<section><h2>KV cache and requests</h2>
<p class="sub">Blocks held by requests now; below, over the last minutes, the peak of each
quarter second of the blocks used and the running and waiting requests.</p>
<svg id="dash-kv" class="chart" role="img"></svg></section>
<section><h2>Request latency</h2>
<p class="sub">p50 to p99 of the latest requests (box p50–p90, red tick p99, orange mean over
all), log scale.</p>
<svg id="dash-latency" class="chart" role="img"></svg></section>
</div>
<footer>Polls <code>/dashboard/data</code> every second; the same figures as
<code>/metrics</code>.</footer>
</main>
)page";

constexpr std::string_view kScript = R"js(
"use strict";
const SVGNS = "http://www.w3.org/2000/svg";
const POLL_MS = 1000;
const state = {key: "", updates: 0, prev: null, rate: null};

function readKey() {
  return new URLSearchParams(location.hash.replace(/^#/, "")).get("key") || "";
}
state.key = readKey();
window.addEventListener("hashchange", () => { state.key = readKey(); });
document.getElementById("auth").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = document.getElementById("auth-key").value;
  location.hash = "key=" + encodeURIComponent(key);
  state.key = key;
});

function svgEl(parent, name, attrs, text) {
  const e = document.createElementNS(SVGNS, name);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function tip(e, text) { svgEl(e, "title", {}, text); return e; }
function reset(svg, w, h, title) {
  svg.replaceChildren();
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.setAttribute("width", w);
  svg.setAttribute("height", h);
  svgEl(svg, "title", {}, title);
}
function note(svg, w, title, text) {
  reset(svg, w, 60, title);
  svgEl(svg, "text", {class: "note", x: w / 2, y: 34, "text-anchor": "middle"}, text);
}
function fmtS(s) {
  if (!(s > 0)) return "–";
  if (s >= 1) return s.toFixed(2) + " s";
  if (s >= 1e-3) return (s * 1e3).toFixed(s >= 0.1 ? 0 : 2) + " ms";
  return (s * 1e6).toFixed(1) + " µs";
}
function pct(x) { return (100 * x).toFixed(x < 0.1 ? 2 : 1) + "%"; }
function duration(s) {
  if (s < 120) return s.toFixed(0) + " s";
  if (s < 7200) return (s / 60).toFixed(0) + " min";
  return (s / 3600).toFixed(1) + " h";
}
// A "nice" axis: ticks at 1, 2, 2.5 or 5 times a power of ten, covering [0, max].
function niceAxis(max, ticks = 5) {
  if (!(max > 0)) return {top: 1, step: 1};
  const raw = max / ticks, power = Math.pow(10, Math.floor(Math.log10(raw)));
  let step = power;
  for (const m of [1, 2, 2.5, 5, 10]) { step = m * power; if (step >= raw) break; }
  return {top: Math.ceil(max / step - 1e-9) * step, step};
}
// The same for counts: whole-number ticks.
function countAxis(max) {
  const axis = niceAxis(Math.max(max, 1) * 1.1);
  return axis.step >= 1 ? axis : {top: Math.ceil(axis.top), step: 1};
}
// Seconds between time ticks: about four over the span.
function timeStep(span) {
  for (const s of [1, 2, 5, 10, 15, 30, 60, 120]) if (s * 4 >= span) return s;
  return 300;
}
function tickLabel(v, step) { return step >= 1 ? v.toFixed(0) : step >= 0.1 ? v.toFixed(1) : v.toFixed(2); }
function stageColour(name) { return STAGE_COLOURS[name] || "#999999"; }
function rampColour(t) {
  t = Math.min(Math.max(t, 0), 1) * (RAMP.length - 1);
  const i = Math.min(Math.floor(t), RAMP.length - 2), f = t - i;
  const a = RAMP[i], b = RAMP[i + 1];
  let out = "#";
  for (let c = 1; c < 7; c += 2) {
    const x = parseInt(a.slice(c, c + 2), 16), y = parseInt(b.slice(c, c + 2), 16);
    out += Math.round(x + f * (y - x)).toString(16).padStart(2, "0");
  }
  return out;
}
function legend(parent, items, x, y) {
  const g = svgEl(parent, "g", {class: "legend", transform: `translate(${x},${y})`});
  let cx = 0;
  for (const [label, colour] of items) {
    const item = svgEl(g, "g", {class: "legend-item"});
    svgEl(item, "rect", {x: cx, y: 0, width: 14, height: 14, rx: 3, fill: colour});
    svgEl(item, "text", {class: "legend-text", x: cx + 20, y: 11.5}, label);
    cx += 40 + 7.2 * label.length;
  }
}

function drawCards(d) {
  const box = document.getElementById("cards");
  const r = d.requests, kv = d.kv, t = d.tokens;
  const rejected = Object.values(r.rejected).reduce((a, b) => a + b, 0);
  const hits = kv.prefix_queries ? kv.prefix_hits / kv.prefix_queries : 0;
  const cards = [
    ["running", r.running, `${r.waiting} waiting`],
    ["waiting", r.waiting, "in the queue"],
    ["KV cache", pct(kv.usage), `${kv.used} / ${kv.total} blocks`],
    ["finished", r.finished_total,
     `${r.finished.stop} stop · ${r.finished.length} length · ${r.finished.abort} abort`],
    ["generated", t.generation,
     state.rate === null ? "tokens" : `${state.rate.toFixed(1)} tokens/s now`],
    ["engine steps", d.engine.steps, `${d.engine.preemptions} preemptions`],
    ["prefix cache", pct(hits), `${kv.prefix_hits} / ${kv.prefix_queries} prompt tokens`],
    ["rejected", rejected,
     Object.entries(r.rejected).map(([s, n]) => `${n}× ${s}`).join(" · ") || "none"],
  ];
  const xc = d.expert_cache;  // null without --expert-budget
  if (xc) {
    cards.push(["expert cache", pct(xc.hit_rate),
                `${xc.hits} hits · ${xc.misses} misses · ${xc.unplaced} from host · ` +
                `${xc.cpu_experts} on the CPU (${xc.cpu_rows} rows)`]);
    cards.push(["expert prefetch", pct(xc.prefetch_accuracy),
                `${xc.prefetch_used} used · ${xc.prefetch_wasted} evicted unused · ` +
                `${(xc.host_to_device_bytes / 1048576).toFixed(1)} MiB to device · ` +
                `${(xc.stall_seconds * 1e3).toFixed(1)} ms stalled`]);
  }
  // serve --ep N: a card per rank, each running its own requests.
  (d.ranks || []).forEach((rank, i) => {
    cards.push([`rank ${i}`, rank.running,
                `running · ${rank.waiting} waiting · ${rank.assigned} assigned · ` +
                `${rank.kv_used} / ${rank.kv_blocks} KV blocks · ` +
                `${(rank.network_bytes / 1048576).toFixed(1)} MiB sent`]);
  });
  box.replaceChildren();
  for (const [k, v, s] of cards) {
    const card = document.createElement("div");
    card.className = "card";
    for (const [cls, text] of [["k", k], ["v", v], ["s", s]]) {
      const e = document.createElement("div");
      e.className = cls;
      e.textContent = String(text);
      card.appendChild(e);
    }
    box.appendChild(card);
  }
}

function drawStages(d) {
  const svg = document.getElementById("dash-stages"), W = 1040, title = "Stage breakdown";
  const rows = d.stages.filter((s) => s.seconds_total > 0);
  if (!d.stage_metrics) return note(svg, W, title, "stage metrics are off (--no-stage-metrics)");
  if (rows.length === 0) return note(svg, W, title, "no engine steps yet");
  const left = 130, barW = 500, top = 70, rowH = 26, stackW = W - left - 20;
  reset(svg, W, top + rows.length * rowH + 10, title);
  svgEl(svg, "text", {class: "tick", x: left - 10, y: 30, "text-anchor": "end"}, "mix");
  const stack = svgEl(svg, "g", {class: "stage-stack"});
  let x = left;
  for (const s of rows) {
    const w = s.share * stackW;
    tip(svgEl(stack, "rect", {class: "seg", x: x.toFixed(1), y: 14, width: w.toFixed(2),
                              height: 22, fill: stageColour(s.stage)}),
        `${s.stage}: ${pct(s.share)} of the profiled time`);
    x += w;
  }
  const cols = [[left + barW + 100, "share"], [left + barW + 210, "mean / step"],
                [left + barW + 320, "p90 / step"], [W - 10, "steps"]];
  for (const [cx, label] of cols) {
    svgEl(svg, "text", {class: "axis-title", x: cx, y: top - 10, "text-anchor": "end"}, label);
  }
  const maxShare = Math.max(...rows.map((s) => s.share));
  rows.forEach((s, i) => {
    const y = top + i * rowH;
    const g = svgEl(svg, "g", {class: "stage-bar", "data-stage": s.stage});
    svgEl(g, "text", {class: "tick", x: left - 10, y: y + rowH / 2 + 4, "text-anchor": "end"},
          s.stage);
    svgEl(g, "rect", {class: "track", x: left, y: y + 4, width: barW, height: rowH - 8, rx: 3,
                      fill: "#f1f5f9"});
    tip(svgEl(g, "rect", {class: "bar", x: left, y: y + 4, rx: 3, height: rowH - 8,
                          width: Math.max(1, s.share / maxShare * barW).toFixed(1),
                          fill: stageColour(s.stage)}),
        `${s.stage}: ${s.seconds_total.toFixed(3)} s in all, ${s.steps} steps`);
    const values = [pct(s.share), fmtS(s.step_mean_s), fmtS(s.step_p90_s), String(s.steps)];
    cols.forEach(([cx], j) => {
      svgEl(g, "text", {class: "tick", x: cx, y: y + rowH / 2 + 4, "text-anchor": "end"},
            values[j]);
    });
  });
}

function drawHeatmap(d) {
  const svg = document.getElementById("dash-heatmap"), W = 1040, title = "Expert load";
  const ex = d.experts;
  if (!ex) return note(svg, W, title, "no expert counts (a dense model, or --no-stage-metrics)");
  const L = ex.num_layers, E = ex.num_experts;
  const left = 64, right = 170, top = 26, bottom = 44;
  const cellW = Math.min(56, (W - left - right) / E);
  const cellH = Math.max(6, Math.min(30, cellW * 0.7));
  const plotW = cellW * E, plotH = cellH * L, H = top + plotH + bottom;
  reset(svg, W, Math.max(H, top + 120 + bottom), title);
  let max = 0;
  for (const row of ex.rows) for (const v of row) max = Math.max(max, v);
  const numbers = cellW >= 30 && cellH >= 16;
  const labelEvery = cellH >= 12 ? 1 : cellH >= 6 ? 5 : 10;
  svgEl(svg, "text", {class: "axis-title", x: left + plotW + 58, y: top - 10,
                      "text-anchor": "end"}, "max/mean");
  for (let l = 0; l < L; ++l) {
    const y = top + cellH * l, row = ex.rows[l];
    const total = row.reduce((a, b) => a + b, 0), mean = total / E;
    const g = svgEl(svg, "g", {class: "heat-row", "data-layer": l});
    if (l % labelEvery === 0) {
      svgEl(g, "text", {class: "tick", x: left - 8, y: y + cellH / 2 + 4, "text-anchor": "end"},
            String(l));
    }
    for (let e = 0; e < E; ++e) {
      const v = row[e], t = max > 0 ? v / max : 0, x = left + cellW * e;
      tip(svgEl(g, "rect", {class: "cell", x: (x + 0.5).toFixed(1), y: (y + 0.5).toFixed(1),
                            width: Math.max(cellW - 1, 0.5).toFixed(1),
                            height: Math.max(cellH - 1, 0.5).toFixed(1),
                            fill: total > 0 ? rampColour(t) : "#f3f4f6"}),
          `layer ${l} · expert ${e}: ${v} rows` +
          (total > 0 ? ` (${(v / mean).toFixed(2)}× mean, ${(100 * v / total).toFixed(1)}% of the layer)` : ""));
      if (numbers) {
        svgEl(g, "text", {class: "cell-text", x: x + cellW / 2, y: y + cellH / 2 + 4,
                          "text-anchor": "middle", fill: t > 0.45 ? "#ffffff" : "#1f2937"},
              String(v));
      }
    }
    if (l % labelEvery === 0 || cellH >= 12) {
      svgEl(g, "text", {class: "tick", x: left + plotW + 58, y: y + cellH / 2 + 4,
                        "text-anchor": "end"},
            total > 0 ? ex.max_over_mean[l].toFixed(2) + "×" : "–");
    }
  }
  const every = cellW >= 18 ? 1 : cellW >= 6 ? 4 : 8;
  for (let e = 0; e < E; e += every) {
    svgEl(svg, "text", {class: "tick", x: left + cellW * e + cellW / 2, y: top + plotH + 16,
                        "text-anchor": "middle"}, String(e));
  }
  svgEl(svg, "text", {class: "axis-title", x: left + plotW / 2, y: top + plotH + 38,
                      "text-anchor": "middle"}, "expert");
  svgEl(svg, "text", {class: "axis-title", transform: `translate(22,${top + plotH / 2}) rotate(-90)`,
                      "text-anchor": "middle"}, "layer");
  const defs = svgEl(svg, "defs");
  const grad = svgEl(defs, "linearGradient", {id: "dash-heat-ramp", x1: 0, y1: 1, x2: 0, y2: 0});
  for (let i = 0; i <= 10; ++i) {
    svgEl(grad, "stop", {offset: `${i * 10}%`, "stop-color": rampColour(i / 10)});
  }
  const lx = left + plotW + 90, lh = Math.max(plotH, 80);
  const scale = svgEl(svg, "g", {class: "color-scale"});
  svgEl(scale, "rect", {x: lx, y: top, width: 14, height: lh, fill: "url(#dash-heat-ramp)",
                        stroke: "#cbd5e1"});
  svgEl(scale, "text", {class: "tick", x: lx + 20, y: top + 10}, String(max));
  svgEl(scale, "text", {class: "tick", x: lx + 20, y: top + lh}, "0");
  svgEl(scale, "text", {class: "tick", x: lx - 2, y: top + lh + 16}, "rows");
}

function drawKv(d) {
  const svg = document.getElementById("dash-kv"), W = 520, H = 320;
  const kv = d.kv;
  reset(svg, W, H, "KV cache and requests");
  const gx = 20, gw = W - 40, gy = 28;
  svgEl(svg, "text", {class: "kv-text", x: gx, y: 18},
        `KV cache: ${kv.used} / ${kv.total} blocks used (${pct(kv.usage)})`);
  const gauge = svgEl(svg, "g", {class: "kv-gauge"});
  svgEl(gauge, "rect", {class: "kv-track", x: gx, y: gy, width: gw, height: 22, rx: 4,
                        fill: "#eef2f7", stroke: "#cbd5e1"});
  const usedW = kv.total ? kv.used / kv.total * gw : 0;
  const cachedW = kv.total ? kv.cached / kv.total * gw : 0;
  tip(svgEl(gauge, "rect", {class: "kv-cached", x: (gx + usedW).toFixed(1), y: gy,
                            width: cachedW.toFixed(1), height: 22, fill: "#c6dbef"}),
      `${kv.cached} free blocks still hold a reusable prefix`);
  tip(svgEl(gauge, "rect", {class: "kv-used", x: gx, y: gy, width: Math.max(usedW, 0).toFixed(1),
                            height: 22, rx: 4, fill: "#4e79a7"}),
      `${kv.used} blocks held by requests`);
  svgEl(svg, "text", {class: "tick", x: gx, y: gy + 40},
        `${kv.cached} free blocks hold a reusable prefix · prefix-cache hits ` +
        `${kv.prefix_hits} / ${kv.prefix_queries} prompt tokens`);

  const hist = kv.history;
  const now = hist[hist.length - 1].t;
  const span = Math.min(Math.max(now - hist[0].t, 10), 300), x0 = now - span;
  const pts = hist.filter((p) => p.t >= x0);
  const left = 50, right = 44, top = 96, plotH = 160, plotW = W - left - right;
  const blocks = countAxis(Math.max(...pts.map((p) => p.kv_used)));
  const reqs = countAxis(Math.max(...pts.map((p) => Math.max(p.running, p.waiting))));
  const px = (t) => left + (t - x0) / span * plotW;
  const py = (v, axis) => top + plotH - v / axis.top * plotH;
  for (let v = 0; v <= blocks.top + 1e-9; v += blocks.step) {
    const y = py(v, blocks);
    svgEl(svg, "line", {class: "grid", x1: left, x2: left + plotW, y1: y, y2: y});
    svgEl(svg, "text", {class: "tick", x: left - 6, y: y + 4, "text-anchor": "end"},
          tickLabel(v, blocks.step));
  }
  for (let v = 0; v <= reqs.top + 1e-9; v += reqs.step) {
    svgEl(svg, "text", {class: "tick", x: left + plotW + 6, y: py(v, reqs) + 4},
          tickLabel(v, reqs.step));
  }
  const tickStep = timeStep(span);
  for (let a = 0; a <= span + 1e-9; a += tickStep) {
    svgEl(svg, "text", {class: "tick", x: px(now - a), y: top + plotH + 16,
                        "text-anchor": "middle"}, a === 0 ? "now" : `-${a.toFixed(0)} s`);
  }
  svgEl(svg, "line", {class: "axis", x1: left, x2: left + plotW, y1: top + plotH,
                      y2: top + plotH});
  svgEl(svg, "text", {class: "axis-title", transform: `translate(14,${top + plotH / 2}) rotate(-90)`,
                      "text-anchor": "middle"}, "blocks");
  svgEl(svg, "text", {class: "axis-title",
                      transform: `translate(${W - 6},${top + plotH / 2}) rotate(90)`,
                      "text-anchor": "middle"}, "requests");
  const series = [["kv_used", "KV blocks used", "#4e79a7", blocks, ""],
                  ["running", "running", "#59a14f", reqs, ""],
                  ["waiting", "waiting", "#e15759", reqs, "5 4"]];
  if (pts.length) {  // the used blocks as a light area too, under lines that may overlap it
    const area = pts.map((p) => `${px(p.t).toFixed(1)},${py(p.kv_used, blocks).toFixed(1)}`);
    area.push(`${px(pts[pts.length - 1].t).toFixed(1)},${top + plotH}`,
              `${px(pts[0].t).toFixed(1)},${top + plotH}`);
    svgEl(svg, "polygon", {class: "area", points: area.join(" "), fill: "#4e79a7",
                           "fill-opacity": 0.15, stroke: "none"});
  }
  for (const [key, label, colour, axis, dash] of series) {
    const points = pts.map((p) => `${px(p.t).toFixed(1)},${py(p[key], axis).toFixed(1)}`);
    tip(svgEl(svg, "polyline", {class: "series", "data-series": key, points: points.join(" "),
                                fill: "none", stroke: colour, "stroke-width": 2,
                                "stroke-dasharray": dash || "none"}), label);
  }
  legend(svg, series.map(([, label, colour]) => [label, colour]), left, H - 22);
}

function drawLatency(d) {
  const svg = document.getElementById("dash-latency"), W = 520;
  const rows = [["ttft", "TTFT"], ["tpot", "TPOT"], ["itl", "ITL"], ["e2e", "E2E"]];
  const left = 70, right = 36, top = 40, rowH = 66, plotW = W - left - right;
  const H = top + rows.length * rowH + 6;
  reset(svg, W, H, "Request latency");
  const values = [];
  for (const [key] of rows) {
    const m = d.latency[key];
    for (const v of [m.p50_s, m.p90_s, m.p99_s, m.max_s, m.mean_s]) if (v > 0) values.push(v);
  }
  let lo = values.length ? Math.pow(10, Math.floor(Math.log10(Math.min(...values)))) : 1e-3;
  const hi = values.length ? Math.pow(10, Math.ceil(Math.log10(Math.max(...values)) + 1e-9)) : 1;
  while (hi / lo < 100) lo /= 10;
  const px = (v) => left + (Math.log10(Math.max(v, lo)) - Math.log10(lo)) /
                    (Math.log10(hi) - Math.log10(lo)) * plotW;
  for (let v = lo; v <= hi * 1.0001; v *= 10) {
    svgEl(svg, "line", {class: "grid", x1: px(v), x2: px(v), y1: top - 8, y2: H - 6});
    svgEl(svg, "text", {class: "tick", x: px(v), y: top - 14, "text-anchor": "middle"}, fmtS(v));
  }
  rows.forEach(([key, label], i) => {
    const m = d.latency[key], y = top + i * rowH;
    const g = svgEl(svg, "g", {class: "lat-row", "data-metric": key, "data-count": m.count});
    svgEl(g, "text", {class: "lat-label", x: left - 10, y: y + 20, "text-anchor": "end"}, label);
    svgEl(g, "text", {class: "tick", x: left - 10, y: y + 36, "text-anchor": "end"},
          `n=${m.count}`);
    if (m.count === 0) {
      svgEl(g, "text", {class: "note", x: left + 6, y: y + 20}, "no requests yet");
      return;
    }
    const cy = y + 16;
    svgEl(g, "line", {class: "lat-range", x1: px(m.p50_s), x2: px(m.p99_s), y1: cy, y2: cy});
    tip(svgEl(g, "rect", {class: "lat-box", x: px(m.p50_s), y: cy - 8,
                          width: Math.max(px(m.p90_s) - px(m.p50_s), 1), height: 16}),
        `${label} p50 ${fmtS(m.p50_s)} to p90 ${fmtS(m.p90_s)}`);
    tip(svgEl(g, "line", {class: "lat-p99", x1: px(m.p99_s), x2: px(m.p99_s), y1: cy - 10,
                          y2: cy + 10}), `${label} p99 ${fmtS(m.p99_s)}`);
    tip(svgEl(g, "circle", {class: "lat-p50", cx: px(m.p50_s), cy, r: 5}),
        `${label} p50 ${fmtS(m.p50_s)}`);
    tip(svgEl(g, "circle", {class: "lat-mean", cx: px(m.mean_s), cy, r: 3.5}),
        `${label} mean ${fmtS(m.mean_s)} over ${m.count}`);
    svgEl(g, "text", {class: "tick", x: left, y: y + 44},
          `p50 ${fmtS(m.p50_s)} · p90 ${fmtS(m.p90_s)} · p99 ${fmtS(m.p99_s)} · ` +
          `mean ${fmtS(m.mean_s)} (latest ${m.window})`);
  });
}

function setState(name, text) {
  document.body.dataset.state = name;
  document.getElementById("status").textContent = text;
  document.getElementById("auth").hidden = name !== "auth";
}

function draw(d) {
  if (state.prev && d.uptime_s > state.prev.uptime_s) {
    state.rate = (d.tokens.generation - state.prev.tokens.generation) /
                 (d.uptime_s - state.prev.uptime_s);
  }
  state.prev = d;
  state.updates += 1;
  document.body.dataset.updates = state.updates;
  document.getElementById("subtitle").textContent =
      `model ${d.model} · up ${duration(d.uptime_s)} · updated ` +
      `${new Date(d.time * 1000).toLocaleTimeString()}`;
  for (const fn of [drawCards, drawStages, drawHeatmap, drawKv, drawLatency]) {
    try { fn(d); } catch (e) { console.error(fn.name, e); setState("error", `${fn.name}: ${e}`); return; }
  }
  setState("ok", "");
}

async function poll() {
  try {
    const headers = state.key ? {Authorization: "Bearer " + state.key} : {};
    const res = await fetch("/dashboard/data", {headers, cache: "no-store"});
    if (res.status === 401) {
      setState("auth", "· needs the API key");
    } else if (!res.ok) {
      setState("error", `· /dashboard/data answered ${res.status}`);
    } else {
      draw(await res.json());
    }
  } catch (e) {
    setState("error", `· server unreachable (${e.message})`);
  }
  setTimeout(poll, POLL_MS);
}
poll();
)js";

std::string build_page() {
  std::string colours = "{";
  for (int s = 0; s < profile::kNumStages; ++s) {
    const std::string name(profile::stage_name(static_cast<profile::Stage>(s)));
    colours += "\"" + name + "\":\"" + profile::chart_stage_colour(name) + "\",";
  }
  colours += "\"other\":\"" + std::string(profile::chart_stage_colour("other")) + "\"}";
  std::string ramp = "[";
  for (int i = 0; i <= 10; ++i) {
    ramp += (i ? ",\"" : "\"") + profile::chart_load_ramp(i / 10.0) + "\"";
  }
  ramp += "]";
  std::string page =
      "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
      "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
      "<title>moeinfer · live</title><style>";
  page += profile::chart_css();
  page += kDashboardCss;
  page += "</style></head><body data-state=\"loading\" data-updates=\"0\">";
  page += kBody;
  page += "<script>\nconst STAGE_COLOURS = " + colours + ";\nconst RAMP = " + ramp + ";\n";
  page += kScript;
  page += "</script></body></html>\n";
  return page;
}

}  // namespace

const std::string& dashboard_page() {
  static const std::string page = build_page();
  return page;
}

}  // namespace moeinfer::server
