// Server metrics in the Prometheus text exposition format: gauges set from the engine's state,
// counters, latency histograms (TTFT, time per output token, end-to-end) and per-step MoE stage
// histograms. The same state, as JSON, feeds the live dashboard (GET /dashboard/data), so the
// page and /metrics never disagree. Thread-safe: the engine thread records, HTTP threads render.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/engine.h"

namespace moeinfer::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);  // upper bounds, increasing; +Inf is implied
  void observe(double value);
  // Appends the HELP and TYPE lines, then `name_bucket{le=..}`, `name_sum` and `name_count`.
  void render(const std::string& name, const std::string& help, std::string& out) const;
  // The sample lines alone, each with `labels` (`stage="route"`) in front of `le`: one series of
  // a labelled histogram whose HELP and TYPE the caller wrote once.
  void render_series(const std::string& name, const std::string& labels, std::string& out) const;

  int64_t count() const { return count_; }
  double sum() const { return sum_; }
  // Estimated q-quantile (0 < q < 1), interpolated within the bucket that holds it as
  // Prometheus' histogram_quantile does; the largest finite bound when it falls in +Inf; 0 when
  // empty.
  double quantile(double q) const;

 private:
  std::vector<double> bounds_;
  std::vector<int64_t> counts_;  // [bounds + 1], not cumulative
  double sum_ = 0.0;
  int64_t count_ = 0;
};

class Metrics {
 public:
  Metrics();

  void set_engine_stats(const EngineStats& stats);  // after every step
  void observe_ttft(double seconds);
  void observe_tpot(double seconds);
  void observe_itl(double seconds);
  void observe_e2e(double seconds);
  void count_finished(const std::string& reason);
  void count_rejected(int status);

  std::string render(const std::string& model_name) const;
  // The dashboard's figures (docs/serving.md, "Dashboard"): requests, tokens, KV usage with its
  // recent history, stage totals and per-step statistics, rows per layer and expert, latency
  // counts and sums (the histograms') with percentiles of the latest kLatencyWindow requests.
  nlohmann::json dashboard(const std::string& model_name) const;

  static constexpr size_t kLatencyWindow = 1000;  // latencies kept for exact percentiles
  static constexpr size_t kHistoryLength = 1200;  // KV / request samples kept (5 minutes busy)
  static constexpr double kHistoryPeriod = 0.25;  // seconds a sample covers (its peaks)

 private:
  using Clock = std::chrono::steady_clock;

  // The latest kLatencyWindow observations, oldest overwritten first.
  struct Window {
    std::vector<double> values;
    size_t next = 0;
    void add(double v);
  };
  struct Sample {
    double t;  // seconds since the server started, when the sample's period began
    int64_t kv_used, running, waiting;  // peaks within the period
  };

  mutable std::mutex mutex_;
  Clock::time_point start_ = Clock::now();
  EngineStats stats_;
  Histogram ttft_, tpot_, itl_, e2e_;
  Window ttft_window_, tpot_window_, itl_window_, e2e_window_;
  // [profile::kNumStages] time per engine step of each stage, over the steps the stage ran in.
  std::vector<Histogram> stage_step_;
  std::map<std::string, int64_t> finished_;  // by finish reason
  std::map<int, int64_t> rejected_;          // by HTTP status
  std::deque<Sample> history_;               // one at most every kHistoryPeriod
};

}  // namespace moeinfer::server
