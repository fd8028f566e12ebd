// Server metrics: the per-step stage histograms fed from EngineStats, the labelled histogram
// text, the histogram quantile estimate, and the dashboard JSON agreeing with /metrics.
#include "server/metrics.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <sstream>
#include <string>

#include "profile/profiler.h"

namespace moeinfer::server {
namespace {

// name{labels} -> value, from the Prometheus text.
std::map<std::string, double> parse(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    out[line.substr(0, space)] = std::stod(line.substr(space + 1));
  }
  return out;
}

int stage(profile::Stage s) { return static_cast<int>(s); }

// Stats of an engine with profiling on after `steps` steps, the latest taking `last` seconds in
// attention and 0.5 ms in the experts (route did not run).
// `steps` engine steps, of which `timed` timed their stages (all of them unless given).
EngineStats profiled(int64_t steps, double last, int64_t timed = -1) {
  EngineStats s;
  s.num_steps = steps;
  s.timed_steps = timed < 0 ? steps : timed;
  s.num_layers = 2;
  s.num_experts = 3;
  s.stage_seconds.assign(profile::kNumStages, 0.0);
  s.last_step_stage_seconds.assign(profile::kNumStages, 0.0);
  s.last_step_stage_seconds[stage(profile::Stage::kAttention)] = last;
  s.last_step_stage_seconds[stage(profile::Stage::kExperts)] = 0.0005;
  s.expert_rows = {4, 0, 2, 1, 1, 4};  // [L, E]
  s.kv.num_blocks = 10;
  s.kv.num_used = 3;
  return s;
}

TEST(Histogram, LabelledSeriesAreCumulativeWithTheLabelFirst) {
  Histogram h({0.1, 1.0});
  h.observe(0.05);
  h.observe(0.5);
  h.observe(7.0);
  std::string out;
  h.render_series("m", "stage=\"route\"", out);
  EXPECT_EQ(out,
            "m_bucket{stage=\"route\",le=\"0.1\"} 1\n"
            "m_bucket{stage=\"route\",le=\"1\"} 2\n"
            "m_bucket{stage=\"route\",le=\"+Inf\"} 3\n"
            "m_sum{stage=\"route\"} 7.55\n"
            "m_count{stage=\"route\"} 3\n");
}

TEST(Histogram, QuantileInterpolatesWithinTheBucket) {
  Histogram h({1.0, 2.0, 4.0});
  EXPECT_EQ(h.quantile(0.5), 0.0);             // empty
  for (int i = 0; i < 4; ++i) h.observe(1.5);  // all in (1, 2]
  EXPECT_DOUBLE_EQ(h.quantile(0.5), 1.5);
  EXPECT_DOUBLE_EQ(h.quantile(1.0), 2.0);
  h.observe(100.0);  // +Inf bucket: the largest finite bound
  EXPECT_DOUBLE_EQ(h.quantile(0.99), 4.0);
}

TEST(Metrics, ObservesEachNewStepOnceAndOnlyStagesThatRan) {
  Metrics m;
  m.set_engine_stats(profiled(1, 0.002));
  m.set_engine_stats(profiled(1, 0.002));  // the same step again (an idle loop): not observed
  m.set_engine_stats(profiled(2, 0.004));
  const auto v = parse(m.render("demo"));
  const std::string a = "moeinfer:stage_step_seconds_count{stage=\"attention\"}";
  EXPECT_EQ(v.at(a), 2);
  EXPECT_NEAR(v.at("moeinfer:stage_step_seconds_sum{stage=\"attention\"}"), 0.006, 1e-12);
  EXPECT_EQ(v.at("moeinfer:stage_step_seconds_count{stage=\"experts\"}"), 2);
  EXPECT_EQ(v.at("moeinfer:stage_step_seconds_count{stage=\"route\"}"), 0);
  EXPECT_EQ(v.at("moeinfer:stage_step_seconds_bucket{stage=\"attention\",le=\"0.0025\"}"), 1);
  EXPECT_EQ(v.at("moeinfer:stage_step_seconds_bucket{stage=\"attention\",le=\"+Inf\"}"), 2);
  // A step whose stages were not timed (sampled timing) adds nothing to the histograms.
  m.set_engine_stats(profiled(3, 0.004, /*timed=*/2));
  EXPECT_EQ(parse(m.render("demo")).at(a), 2);
  // The counters stay.
  EXPECT_TRUE(v.count("moeinfer:stage_seconds_total{stage=\"attention\"}"));
  EXPECT_TRUE(v.count("moeinfer:expert_rows_total{layer=\"1\",expert=\"2\"}"));
}

TEST(Metrics, WithoutStageProfilingThereIsNoStageHistogram) {
  Metrics m;
  EngineStats s;
  s.num_steps = 3;
  m.set_engine_stats(s);
  EXPECT_EQ(m.render("demo").find("stage_step_seconds"), std::string::npos);
  const nlohmann::json d = m.dashboard("demo");
  EXPECT_FALSE(d["stage_metrics"].get<bool>());
  EXPECT_TRUE(d["stages"].empty());
  EXPECT_TRUE(d["experts"].is_null());
}

TEST(Metrics, DashboardCarriesTheFiguresOfMetrics) {
  Metrics m;
  m.set_engine_stats(profiled(1, 0.002));
  for (double s : {0.01, 0.02, 0.03, 0.04}) m.observe_e2e(s);
  m.observe_ttft(0.005);
  m.count_finished("stop");
  const auto v = parse(m.render("demo"));
  const nlohmann::json d = m.dashboard("demo");
  EXPECT_EQ(d["model"], "demo");
  EXPECT_EQ(d["kv"]["used"].get<int64_t>(), v.at("moeinfer:kv_cache_used_blocks"));
  EXPECT_EQ(d["kv"]["total"].get<int64_t>(), v.at("moeinfer:kv_cache_total_blocks"));
  EXPECT_EQ(d["requests"]["finished_total"].get<int64_t>(), 1);
  ASSERT_EQ(d["stages"].size(), static_cast<size_t>(profile::kNumStages));
  for (const auto& s : d["stages"]) {
    const std::string label = "{stage=\"" + s["stage"].get<std::string>() + "\"}";
    EXPECT_EQ(s["steps"].get<double>(), v.at("moeinfer:stage_step_seconds_count" + label));
    EXPECT_EQ(s["seconds_total"].get<double>(), v.at("moeinfer:stage_seconds_total" + label));
  }
  const nlohmann::json& e2e = d["latency"]["e2e"];
  EXPECT_EQ(e2e["count"].get<double>(), v.at("moeinfer:e2e_request_latency_seconds_count"));
  EXPECT_DOUBLE_EQ(e2e["p50_s"].get<double>(), 0.02);  // nearest rank over the window
  EXPECT_DOUBLE_EQ(e2e["p99_s"].get<double>(), 0.04);
  EXPECT_NEAR(e2e["mean_s"].get<double>(), 0.025, 1e-12);
  const nlohmann::json& ex = d["experts"];
  ASSERT_EQ(ex["rows"].size(), 2u);
  EXPECT_EQ(ex["rows"][1][2].get<int64_t>(), 4);
  EXPECT_DOUBLE_EQ(ex["max_over_mean"][0].get<double>(), 2.0);  // 4 of 6 rows over 3 experts
  EXPECT_DOUBLE_EQ(ex["max_over_mean"][0].get<double>(),
                   v.at("moeinfer:expert_load_max_over_mean{layer=\"0\"}"));
  // History: the sample after the step, then now.
  const nlohmann::json& h = d["kv"]["history"];
  ASSERT_EQ(h.size(), 2u);
  EXPECT_EQ(h[0]["kv_used"].get<int64_t>(), 3);
  EXPECT_LE(h[0]["t"].get<double>(), h[1]["t"].get<double>());
}

TEST(Metrics, HistoryKeepsThePeakOfEachPeriod) {
  Metrics m;
  EngineStats s = profiled(1, 0.001);
  m.set_engine_stats(s);  // first sample: 3 used
  s.num_steps = 2;
  s.kv.num_used = 7;
  m.set_engine_stats(s);  // within the same period: the peak is kept
  s.num_steps = 3;
  s.kv.num_used = 0;
  m.set_engine_stats(s);
  // However the three calls fall into periods, the 7 is kept and the last point (now) is 0.
  const nlohmann::json h = m.dashboard("demo")["kv"]["history"];
  ASSERT_GE(h.size(), 2u);
  int64_t peak = 0;
  for (const auto& p : h) peak = std::max(peak, p["kv_used"].get<int64_t>());
  EXPECT_EQ(peak, 7);
  EXPECT_EQ(h.back()["kv_used"].get<int64_t>(), 0);
}

}  // namespace
}  // namespace moeinfer::server
