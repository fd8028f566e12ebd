// The profile report: one JSON document built from a Profiler's step records (the single source
// of truth), and two renderings of it, a text table and a self-contained HTML page with SVG
// charts. `moeinfer profile` writes all three; docs/profiling.md describes every field.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "profile/profiler.h"
#include "profile/routing_trace.h"

namespace moeinfer::profile {

// What was run, as the report states it.
struct RunInfo {
  std::string model;       // folder name
  std::string model_type;  // config.json model_type
  int64_t batch = 0;       // B sequences
  int64_t input_len = 0;   // I prompt tokens per sequence (one prefill step)
  int64_t output_len = 0;  // O decode steps
  uint64_t seed = 0;
  std::string token_source;  // "random" or the text file's name
  int64_t num_threads = 0;
  int64_t top_k = 0;               // K
  int64_t hidden_size = 0;         // H
  std::vector<bool> layer_is_moe;  // [L]
  int64_t prefill_steps = 1;       // the first steps are prefill, the rest decode
};

// The profiler's cost, measured by running the same workload with it off and on.
struct OverheadInfo {
  int64_t repeats = 0;           // off/on pairs, interleaved
  double off_ms = 0.0;           // best wall time of the workload with the profiler off
  double on_ms = 0.0;            // ... and on
  double measured = 0.0;         // on / off - 1
  double off_cpu_ms = 0.0;       // best CPU time of the driving thread, profiler off
  double on_cpu_ms = 0.0;        // ... and on
  double measured_cpu = 0.0;     // on_cpu / off_cpu - 1
  int64_t paired_steps = 0;      // decode steps per side in the paired step A/B
  int64_t paired_block = 1;      // ... run in blocks of this many (the profiler's time_every)
  double step_off_us = 0.0;      // median over blocks of the mean decode step, profiler off
  double step_on_us = 0.0;       // ... on, alternating with the off blocks
  double measured_step = 0.0;    // step_on / step_off - 1
  double scope_on_ns = 0.0;      // cost of one scope (two clock reads and an add) when on
  double scope_off_ns = 0.0;     // ... when off (a thread-local load and a branch)
  double scopes_per_step = 0.0;  // scopes the workload opened per step
  double estimated = 0.0;        // scopes_per_step * scope_on_ns / mean step time
};

// Builds the report document. `routing` holds the routing-trace summary of the same run (one
// entry per layer, see summarize_routing_trace), or is empty.
nlohmann::ordered_json build_report(const RunInfo& run, const Profiler& profiler,
                                    std::span<const LayerSummary> routing,
                                    const OverheadInfo& overhead);

// report.txt: per-stage totals, means and shares; per-layer stage times; expert load.
std::string render_text_report(const nlohmann::ordered_json& report);

// report.html: one page, inline CSS and SVG, no script and nothing fetched. Charts (each an
// <svg> with an id the end-to-end test looks for):
//   #chart-stage-layers  stage time per layer, stacked bars (one <g class="layer-bar"> a layer)
//   #chart-load-heatmap  layer x expert load (one <rect class="cell"> per MoE layer and expert)
//   #chart-imbalance     max/mean expert load over steps (<polyline class="series">, a point
//                        per step)
//   #chart-expert-cache  under offloading: each MoE layer's demands by where they were served
//                        (one <g class="cache-bar"> a layer), beside the cache's totals and
//                        per-layer table
std::string render_html_report(const nlohmann::ordered_json& report);

// The report page's look, shared with the server's live dashboard (server/dashboard.cpp) so the
// two pages read alike: a colour per stage name ("other" included), the heat map's sequential
// ramp (t in [0, 1], near-white to deep blue-violet) and the stylesheet.
const char* chart_stage_colour(const std::string& stage);
std::string chart_load_ramp(double t);
const char* chart_css();

}  // namespace moeinfer::profile
