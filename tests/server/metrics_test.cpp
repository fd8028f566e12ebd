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
  for (double s : {0.01, 0.02, 0.03, 0.04}) {
    m.observe_finished({.finish_reason = "stop", .e2e_seconds = s});
  }
  m.observe_ttft(0.005);
  const auto v = parse(m.render("demo"));
  const nlohmann::json d = m.dashboard("demo");
  EXPECT_EQ(d["model"], "demo");
  EXPECT_EQ(d["kv"]["used"].get<int64_t>(), v.at("moeinfer:kv_cache_used_blocks"));
  EXPECT_EQ(d["kv"]["total"].get<int64_t>(), v.at("moeinfer:kv_cache_total_blocks"));
  EXPECT_EQ(d["requests"]["finished_total"].get<int64_t>(), 4);
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

// Every `# TYPE vllm:...` family of the text, by name.
std::map<std::string, std::string> vllm_types(const std::string& text) {
  std::map<std::string, std::string> types;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("# TYPE vllm:", 0) != 0) continue;
    const size_t space = line.rfind(' ');
    types[line.substr(7, space - 7)] = line.substr(space + 1);
  }
  return types;
}

TEST(Metrics, VllmNamesMirrorOursWithTheModelNameLabel) {
  Metrics m;
  EngineStats s = profiled(1, 0.002);
  s.num_running = 2;
  s.num_waiting = 5;
  s.prompt_tokens = 40;
  s.generation_tokens = 9;
  s.kv.prefix_queries = 40;
  s.kv.prefix_hits = 16;
  s.num_preemptions = 1;
  m.set_engine_stats(s);
  m.observe_finished({.finish_reason = "length", .e2e_seconds = 0.5});
  const std::string text = m.render("org/model");
  const auto v = parse(text);
  const std::string l = "{model_name=\"org/model\",engine=\"0\"}";
  for (const auto& [vllm, ours] : std::map<std::string, std::string>{
           {"num_requests_running", "num_requests_running"},
           {"num_requests_waiting", "num_requests_waiting"},
           {"kv_cache_usage_perc", "kv_cache_usage_perc"},
           {"gpu_cache_usage_perc", "kv_cache_usage_perc"},
           {"prompt_tokens_total", "prompt_tokens_total"},
           {"generation_tokens_total", "generation_tokens_total"},
           {"prefix_cache_queries_total", "prefix_cache_queries_total"},
           {"prefix_cache_hits_total", "prefix_cache_hits_total"},
           {"num_preemptions_total", "num_preemptions_total"},
           {"e2e_request_latency_seconds_count", "e2e_request_latency_seconds_count"}}) {
    ASSERT_TRUE(v.count("vllm:" + vllm + l)) << vllm;
    EXPECT_EQ(v.at("vllm:" + vllm + l), v.at("moeinfer:" + ours)) << vllm;
  }
  EXPECT_EQ(v.at("vllm:request_success_total{model_name=\"org/model\",engine=\"0\","
                 "finished_reason=\"length\"}"),
            1);
  const auto types = vllm_types(text);
  EXPECT_EQ(types.at("vllm:num_requests_running"), "gauge");
  EXPECT_EQ(types.at("vllm:prompt_tokens_total"), "counter");
  for (const char* h : {"time_to_first_token_seconds", "time_per_output_token_seconds",
                        "inter_token_latency_seconds", "request_time_per_output_token_seconds",
                        "e2e_request_latency_seconds", "request_queue_time_seconds",
                        "request_inference_time_seconds", "request_prefill_time_seconds",
                        "request_decode_time_seconds", "request_prompt_tokens",
                        "request_generation_tokens", "iteration_tokens_total",
                        "request_params_n", "request_params_max_tokens"}) {
    EXPECT_EQ(types.at(std::string("vllm:") + h), "histogram") << h;
  }
  // Every vllm: sample carries the labels.
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("vllm:", 0) == 0) {
      EXPECT_NE(line.find("model_name=\"org/model\""), std::string::npos) << line;
    }
  }
  // vLLM's TTFT buckets, not ours.
  EXPECT_TRUE(v.count("vllm:time_to_first_token_seconds_bucket{model_name=\"org/model\","
                      "engine=\"0\",le=\"2560\"}"));
}

TEST(Metrics, ModelNameLabelIsEscaped) {
  Metrics m;
  const std::string text = m.render("a\"b\\c");
  EXPECT_NE(text.find("vllm:num_requests_running{model_name=\"a\\\"b\\\\c\",engine=\"0\"} 0"),
            std::string::npos);
}

TEST(Metrics, TimePerOutputTokenIsOneSamplePerTokenInterval) {
  Metrics m;
  // A request of 4 tokens: 3 intervals; one of 1 token: none.
  for (double s : {0.001, 0.002, 0.003}) m.observe_token_interval(s);
  m.observe_finished({.finish_reason = "length",
                      .num_generation_tokens = 4,
                      .max_sequence_tokens = 4,
                      .has_first_token = true,
                      .decode_seconds = 0.006});
  m.observe_finished({.finish_reason = "length",
                      .num_generation_tokens = 1,
                      .max_sequence_tokens = 1,
                      .has_first_token = true});
  const auto v = parse(m.render("demo"));
  const std::string l = "{model_name=\"demo\",engine=\"0\"}";
  EXPECT_EQ(v.at("moeinfer:time_per_output_token_seconds_count"), 3);
  EXPECT_EQ(v.at("moeinfer:inter_token_latency_seconds_count"), 3);
  EXPECT_NEAR(v.at("moeinfer:time_per_output_token_seconds_sum"), 0.006, 1e-12);
  EXPECT_EQ(v.at("vllm:time_per_output_token_seconds_count" + l), 3);
  EXPECT_EQ(v.at("vllm:inter_token_latency_seconds_count" + l), 3);
  // The per-request mean: one sample, for the request with more than one token.
  EXPECT_EQ(v.at("moeinfer:request_time_per_output_token_seconds_count"), 1);
  EXPECT_NEAR(v.at("vllm:request_time_per_output_token_seconds_sum" + l), 0.002, 1e-12);
}

TEST(Metrics, RequestHistogramsTakeEachFinishedRequest) {
  Metrics m(MetricsOptions{.max_model_len = 100});
  m.observe_finished({.finish_reason = "stop",
                      .num_prompt_tokens = 7,
                      .num_generation_tokens = 30,
                      .max_sequence_tokens = 15,
                      .max_tokens = 16,
                      .num_sequences = 2,
                      .has_first_token = true,
                      .queue_seconds = 0.25,
                      .prefill_seconds = 0.5,
                      .decode_seconds = 1.0,
                      .inference_seconds = 1.5,
                      .e2e_seconds = 1.75});
  const std::string text = m.render("demo");
  const auto v = parse(text);
  const std::string l = "model_name=\"demo\",engine=\"0\"";
  EXPECT_EQ(v.at("vllm:request_queue_time_seconds_sum{" + l + "}"), 0.25);
  EXPECT_EQ(v.at("moeinfer:request_queue_time_seconds_sum"), 0.25);
  EXPECT_EQ(v.at("vllm:request_prefill_time_seconds_sum{" + l + "}"), 0.5);
  EXPECT_EQ(v.at("vllm:request_decode_time_seconds_sum{" + l + "}"), 1.0);
  EXPECT_EQ(v.at("vllm:request_inference_time_seconds_sum{" + l + "}"), 1.5);
  EXPECT_EQ(v.at("vllm:e2e_request_latency_seconds_sum{" + l + "}"), 1.75);
  EXPECT_EQ(v.at("vllm:request_prompt_tokens_sum{" + l + "}"), 7);
  EXPECT_EQ(v.at("vllm:request_generation_tokens_sum{" + l + "}"), 30);
  EXPECT_EQ(v.at("vllm:request_params_n_sum{" + l + "}"), 2);
  EXPECT_EQ(v.at("vllm:request_params_max_tokens_sum{" + l + "}"), 16);
  // Token counts: vLLM's 1-2-5 buckets up to max_model_len.
  EXPECT_EQ(v.at("vllm:request_prompt_tokens_bucket{" + l + ",le=\"5\"}"), 0);
  EXPECT_EQ(v.at("vllm:request_prompt_tokens_bucket{" + l + ",le=\"10\"}"), 1);
  EXPECT_TRUE(v.count("vllm:request_prompt_tokens_bucket{" + l + ",le=\"100\"}"));
  EXPECT_FALSE(v.count("vllm:request_prompt_tokens_bucket{" + l + ",le=\"200\"}"));
}

TEST(Metrics, IterationTokensAreTheTokensOfEachNewStep) {
  Metrics m;
  EngineStats s;
  s.num_steps = 1;
  s.computed_tokens = 20;  // a prefill
  m.set_engine_stats(s);
  m.set_engine_stats(s);  // no new step: nothing observed
  s.num_steps = 2;
  s.computed_tokens = 22;  // two decodes
  m.set_engine_stats(s);
  const auto v = parse(m.render("demo"));
  const std::string l = "model_name=\"demo\",engine=\"0\"";
  EXPECT_EQ(v.at("vllm:iteration_tokens_total_count{" + l + "}"), 2);
  EXPECT_EQ(v.at("vllm:iteration_tokens_total_sum{" + l + "}"), 22);
  EXPECT_EQ(v.at("vllm:iteration_tokens_total_bucket{" + l + ",le=\"1\"}"), 0);
  EXPECT_EQ(v.at("vllm:iteration_tokens_total_bucket{" + l + ",le=\"8\"}"), 1);
}

// The expert cache's counters (EngineStats::expert_cache, under --expert-budget) as Prometheus
// counters in total and per layer, and the same figures in the dashboard's data.
TEST(Metrics, ExpertCacheCountersInMetricsAndDashboard) {
  Metrics m;
  EngineStats s;
  s.num_layers = 2;
  s.num_experts = 4;
  m.set_engine_stats(s);
  EXPECT_EQ(m.render("demo").find("expert_cache"), std::string::npos);  // no budget, no series
  EXPECT_TRUE(m.dashboard("demo")["expert_cache"].is_null());
  // Layer 0: 3 hits, 1 miss, 1 unplaced, 2 prefetched, 1 used, 1 evicted unused; layer 1:
  // 1 hit, 2 misses, 1 expert of 3 rows on the CPU.
  s.expert_cache = {3, 1, 1, 2, 1, 0, 0, 1, 1, 2, 0, 0, 0, 1, 3, 0};
  s.expert_cache_bytes = {400, 200};
  s.expert_cache_stall_seconds = {0.25, 0.5};
  m.set_engine_stats(s);
  const auto v = parse(m.render("demo"));
  EXPECT_EQ(v.at("moeinfer:expert_cache_hits_total"), 4);
  EXPECT_EQ(v.at("moeinfer:expert_cache_misses_total"), 3);
  EXPECT_EQ(v.at("moeinfer:expert_cache_unplaced_total"), 1);
  EXPECT_EQ(v.at("moeinfer:expert_cache_prefetched_total"), 2);
  EXPECT_EQ(v.at("moeinfer:expert_cache_prefetch_used_total"), 1);
  EXPECT_EQ(v.at("moeinfer:expert_cache_host_to_device_bytes_total"), 600);
  EXPECT_DOUBLE_EQ(v.at("moeinfer:expert_cache_stall_seconds_total"), 0.75);
  EXPECT_DOUBLE_EQ(v.at("moeinfer:expert_cache_prefetch_accuracy"), 0.5);
  EXPECT_EQ(v.at("moeinfer:expert_cache_layer_events_total{layer=\"1\",event=\"misses\"}"), 2);
  const nlohmann::json d = m.dashboard("demo")["expert_cache"];
  EXPECT_EQ(d["hits"].get<int64_t>(), v.at("moeinfer:expert_cache_hits_total"));
  EXPECT_EQ(d["host_to_device_bytes"].get<int64_t>(), 600);
  EXPECT_EQ(v.at("moeinfer:expert_cache_cpu_experts_total"), 1);
  EXPECT_EQ(v.at("moeinfer:expert_cache_cpu_rows_total"), 3);
  EXPECT_DOUBLE_EQ(d["hit_rate"].get<double>(), 4.0 / 9.0);
  ASSERT_EQ(d["layers"].size(), 2u);
  EXPECT_EQ(d["layers"][0]["unplaced"].get<int64_t>(), 1);
  EXPECT_DOUBLE_EQ(d["layers"][1]["stall_seconds"].get<double>(), 0.5);
}

}  // namespace
}  // namespace moeinfer::server
