// Server metrics in the Prometheus text exposition format: gauges set from the engine's state,
// counters, latency histograms (TTFT, time per output token, end-to-end) and per-step MoE stage
// histograms. The same state, as JSON, feeds the live dashboard (GET /dashboard/data), so the
// page and /metrics never disagree. Thread-safe: the engine thread records, HTTP threads render.
//
// /metrics has two families: `moeinfer:` (our names, no labels) and `vllm:` (vLLM's names,
// types, buckets and `model_name` / `engine` labels, so that dashboards written for vLLM work),
// both rendered from the same observations (docs/serving.md, "Metrics").
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

// One finished request, as vLLM's request-level histograms take it. Times in seconds; a
// request that never produced a token has no prefill, decode or per-token figures.
struct FinishedRequest {
  std::string finish_reason;  // stop, length, abort
  int64_t num_prompt_tokens = 0;
  int64_t num_generation_tokens = 0;  // over all of its sequences
  int64_t max_sequence_tokens = 0;    // the longest sequence's tokens
  int64_t max_tokens = 0;             // the request's max_tokens
  int64_t num_sequences = 1;          // n
  bool has_first_token = false;
  double queue_seconds = 0.0;      // handed to the engine until first scheduled
  double prefill_seconds = 0.0;    // first scheduled until the first token
  double decode_seconds = 0.0;     // first token until the last
  double inference_seconds = 0.0;  // first scheduled until finished
  double e2e_seconds = 0.0;        // handed to the engine until finished
};

struct MetricsOptions {
  int64_t max_model_len = 4096;  // the last bucket of the token-count histograms (vLLM's)
};

// What the periodic engine log line reports (serving_log.h), read in one lock.
struct EngineSnapshot {
  double uptime_seconds = 0.0;
  int64_t prompt_tokens = 0, generation_tokens = 0;
  int64_t num_running = 0, num_waiting = 0;
  double kv_usage = 0.0;  // 0 to 1
  int64_t prefix_queries = 0, prefix_hits = 0;
};

// One rank's engine under expert parallelism (serve --ep N), as rank 0 last heard of it.
struct RankFigures {
  int64_t num_running = 0, num_waiting = 0;  // sequences
  int64_t num_assigned = 0;                  // requests sent to the rank since the start
  int64_t kv_used = 0, kv_blocks = 0;
  int64_t network_bytes = 0;  // sent by its MoE layers to other ranks, as encoded on the wire
};

class Metrics {
 public:
  explicit Metrics(const MetricsOptions& options = {});

  void set_engine_stats(const EngineStats& stats);  // after every step
  // Under expert parallelism, after every step: [N] by rank (none: one process, no series).
  void set_rank_figures(std::vector<RankFigures> ranks);
  void observe_ttft(double seconds);
  // One interval between two consecutive tokens of a sequence: one sample per output token
  // after the first (time_per_output_token_seconds and inter_token_latency_seconds).
  void observe_token_interval(double seconds);
  // End-to-end latency, finish reason and vLLM's request-level histograms.
  void observe_finished(const FinishedRequest& request);
  void count_rejected(int status);
  // A connection closed for a slow client (header_rate, body_rate, send_timeout).
  void count_slow_client(const std::string& reason);
  EngineSnapshot snapshot() const;

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

  void render_vllm(const std::string& model_name, std::string& out) const;

  mutable std::mutex mutex_;
  Clock::time_point start_ = Clock::now();
  EngineStats stats_;
  std::vector<RankFigures> ranks_;
  // tpot_ and itl_ take the same per-token samples: vLLM has both names for them.
  Histogram ttft_, tpot_, itl_, e2e_, queue_, request_tpot_;
  Window ttft_window_, tpot_window_, itl_window_, e2e_window_;
  // The vllm: family's own histograms: vLLM's buckets for the observations above, and the
  // request-level figures only vLLM's names have.
  struct VllmHistograms {
    Histogram ttft, tpot, request_tpot, e2e, queue, inference, prefill, decode;
    Histogram prompt_tokens, generation_tokens, iteration_tokens, params_n, params_max_tokens;
  };
  VllmHistograms vllm_;
  // [profile::kNumStages] time per engine step of each stage, over the steps the stage ran in.
  std::vector<Histogram> stage_step_;
  std::map<std::string, int64_t> finished_;      // by finish reason
  std::map<int, int64_t> rejected_;              // by HTTP status
  std::map<std::string, int64_t> slow_clients_;  // by reason
  std::deque<Sample> history_;                   // one at most every kHistoryPeriod
};

}  // namespace moeinfer::server
