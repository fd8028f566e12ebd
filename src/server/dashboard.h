// GET /dashboard: the server's live page. One self-contained HTML document (inline CSS and
// script, charts drawn as SVG in the browser, nothing fetched from elsewhere) that polls
// GET /dashboard/data (Metrics::dashboard(), the state /metrics renders) every second and redraws
// four panels. Each panel is an <svg> with an id the end-to-end test (tests/e2e/test_dashboard.py)
// looks for:
//   #dash-stages   time share per MoE-path stage: one <g class="stage-bar"> per stage that ran,
//                  its <rect class="bar"> as long as the share, and a stacked mix bar on top
//   #dash-heatmap  rows routed per layer and expert: one <rect class="cell"> per (layer, expert),
//                  and each layer's busiest expert over the mean
//   #dash-kv       KV blocks used of the pool (<rect class="kv-used"> in <rect class="kv-track">)
//                  and used blocks, running and waiting requests over the last minutes
//                  (<polyline class="series" data-series=...>)
//   #dash-latency  TTFT, TPOT, inter-token and end-to-end latency: one <g class="lat-row"> each
//                  with p50 / p90 / p99 of the latest requests on a log axis
// The page holds no figures itself. With --api-key it sends the key found in its URL fragment
// (/dashboard#key=KEY), or typed into the form it shows after a 401, as a bearer token.
#pragma once

#include <string>

namespace moeinfer::server {

// The page (built once; the same bytes every call).
const std::string& dashboard_page();

}  // namespace moeinfer::server
