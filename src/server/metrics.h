// Server metrics in the Prometheus text exposition format: gauges set from the engine's state,
// counters, and latency histograms (TTFT, time per output token, end-to-end). Thread-safe: the
// engine thread records, HTTP threads render.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/engine.h"

namespace moeinfer::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);  // upper bounds, increasing; +Inf is implied
  void observe(double value);
  // Appends `name_bucket{le=..}`, `name_sum` and `name_count` lines.
  void render(const std::string& name, const std::string& help, std::string& out) const;

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

 private:
  mutable std::mutex mutex_;
  EngineStats stats_;
  Histogram ttft_, tpot_, itl_, e2e_;
  std::map<std::string, int64_t> finished_;  // by finish reason
  std::map<int, int64_t> rejected_;          // by HTTP status
};

}  // namespace moeinfer::server
