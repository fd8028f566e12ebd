#include "server/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>

#include "offload/cache_summary.h"
#include "profile/profiler.h"

namespace moeinfer::server {
namespace {

// The expert cache's counts (EngineStats::expert_cache) summed over layers, named by
// offload::kCacheCounterNames, in offload::CacheCounter order.
using offload::kCacheCounterNames;
constexpr const char* kCacheCounterHelp[offload::kNumCacheCounters] = {
    "Expert-cache demands found resident.",
    "Expert-cache demands copied into a slot (host to device) before their layer ran.",
    "Expert-cache demands with no evictable slot, read from host memory where they live.",
    "Experts a prefetch (predicted from the previous layer) copied into a slot.",
    "Demands that found an expert a prefetch had brought and no demand had used yet.",
    "Expert-cache demands computed on the host where the expert lives (--cold-experts).",
    "Rows the experts computed on the host ran.",
    "Prefetched experts evicted before any demand used them."};

offload::CacheSummary cache_totals(const EngineStats& stats) {
  return offload::summarize_cache(stats.expert_cache, stats.expert_cache_bytes,
                                  stats.expert_cache_stall_seconds);
}


std::string number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

void line(std::string& out, const std::string& name, const std::string& labels, double value) {
  out += name;
  if (!labels.empty()) out += "{" + labels + "}";
  out += " " + number(value) + "\n";
}

void header(std::string& out, const std::string& name, const char* type, const std::string& help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

const std::vector<double> kLatencyBounds = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06,
                                            0.08,  0.1,    0.25,  0.5,  0.75, 1.0,  2.5,
                                            5.0,   7.5,    10.0,  20.0, 40.0, 80.0};
const std::vector<double> kE2eBounds = {0.01, 0.025, 0.05, 0.1,  0.25, 0.5,  1.0,   2.5,
                                        5.0,  10.0,  15.0, 20.0, 30.0, 60.0, 120.0, 300.0};
// One stage of one engine step: from a microsecond (plan, schedule at batch 1) to seconds (the
// experts of a long prefill).
const std::vector<double> kStageBounds = {1e-6,   2.5e-6, 5e-6, 1e-5,   2.5e-5, 5e-5, 1e-4,
                                          2.5e-4, 5e-4,   1e-3, 2.5e-3, 5e-3,   0.01, 0.025,
                                          0.05,   0.1,    0.25, 0.5,    1.0,    2.5,  5.0};

// vLLM's buckets (vllm/v1/metrics/loggers.py), so that its dashboards' quantiles read the same.
const std::vector<double> kVllmTtftBounds = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,
                                             0.25,  0.5,   0.75, 1.0,  2.5,  5.0,  7.5,  10.0,
                                             20.0,  40.0,  80.0, 160.0, 640.0, 2560.0};
const std::vector<double> kVllmTpotBounds = {0.01, 0.025, 0.05, 0.075, 0.1,  0.15, 0.2,
                                             0.3,  0.4,   0.5,  0.75,  1.0,  2.5,  5.0,
                                             7.5,  10.0,  20.0, 40.0,  80.0};
const std::vector<double> kVllmRequestBounds = {0.3,  0.5,  0.8,  1.0,   1.5,   2.0,   2.5,
                                                5.0,  10.0, 15.0, 20.0,  30.0,  40.0,  50.0,
                                                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
const std::vector<double> kVllmIterationBounds = {1,    8,    16,   32,   64,    128,  256,
                                                  512,  1024, 2048, 4096, 8192, 16384};
const std::vector<double> kVllmParamsNBounds = {1, 2, 5, 10, 20};

// 1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's build_1_2_5_buckets).
std::vector<double> one_two_five(int64_t max_value) {
  std::vector<double> bounds;
  for (int64_t scale = 1;; scale *= 10) {
    for (int64_t m : {1, 2, 5}) {
      if (m * scale > max_value) return bounds;
      bounds.push_back(static_cast<double>(m * scale));
    }
  }
}

// A Prometheus label value: backslash, double quote and newline escaped.
std::string label_value(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

std::string stage_label(int stage) {
  return std::string(profile::stage_name(static_cast<profile::Stage>(stage)));
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += value;
  ++count_;
}

void Histogram::render(const std::string& name, const std::string& help, std::string& out) const {
  header(out, name, "histogram", help);
  render_series(name, "", out);
}

void Histogram::render_series(const std::string& name, const std::string& labels,
                              std::string& out) const {
  const std::string prefix = labels.empty() ? "" : labels + ",";
  int64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    line(out, name + "_bucket", prefix + "le=\"" + number(bounds_[i]) + "\"", cumulative);
  }
  line(out, name + "_bucket", prefix + "le=\"+Inf\"", count_);
  line(out, name + "_sum", labels, sum_);
  line(out, name + "_count", labels, count_);
}

double Histogram::quantile(double q) const {
  if (count_ == 0) return 0.0;
  const double rank = q * static_cast<double>(count_);
  int64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    if (cumulative + counts_[i] >= rank && counts_[i] > 0) {
      const double lower = i == 0 ? 0.0 : bounds_[i - 1];
      const double within = (rank - static_cast<double>(cumulative)) / counts_[i];
      return lower + (bounds_[i] - lower) * std::clamp(within, 0.0, 1.0);
    }
    cumulative += counts_[i];
  }
  return bounds_.empty() ? 0.0 : bounds_.back();
}

void Metrics::Window::add(double v) {
  if (values.size() < kLatencyWindow) {
    values.push_back(v);
  } else {
    values[next] = v;
    next = (next + 1) % kLatencyWindow;
  }
}

Metrics::Metrics(const MetricsOptions& options)
    : ttft_(kLatencyBounds),
      tpot_(kLatencyBounds),
      itl_(kLatencyBounds),
      e2e_(kE2eBounds),
      queue_(kE2eBounds),
      request_tpot_(kLatencyBounds),
      vllm_{.ttft = Histogram(kVllmTtftBounds),
            .tpot = Histogram(kVllmTpotBounds),
            .request_tpot = Histogram(kVllmTpotBounds),
            .e2e = Histogram(kVllmRequestBounds),
            .queue = Histogram(kVllmRequestBounds),
            .inference = Histogram(kVllmRequestBounds),
            .prefill = Histogram(kVllmRequestBounds),
            .decode = Histogram(kVllmRequestBounds),
            .prompt_tokens = Histogram(one_two_five(options.max_model_len)),
            .generation_tokens = Histogram(one_two_five(options.max_model_len)),
            .iteration_tokens = Histogram(kVllmIterationBounds),
            .params_n = Histogram(kVllmParamsNBounds),
            .params_max_tokens = Histogram(one_two_five(options.max_model_len))},
      stage_step_(profile::kNumStages, Histogram(kStageBounds)) {}

void Metrics::set_engine_stats(const EngineStats& stats) {
  std::lock_guard lock(mutex_);
  // The server sets the stats after each step, so a new count of timed steps means one new
  // timed step, whose stage times the histograms take (stages that did not run in it are left
  // out).
  if (stats.timed_steps != stats_.timed_steps &&
      stats.last_step_stage_seconds.size() == static_cast<size_t>(profile::kNumStages)) {
    for (int stage = 0; stage < profile::kNumStages; ++stage) {
      const double s = stats.last_step_stage_seconds[stage];
      if (s > 0.0) stage_step_[stage].observe(s);
    }
  }
  // Tokens run by each new step (vLLM's iteration_tokens_total).
  if (stats.num_steps > stats_.num_steps) {
    vllm_.iteration_tokens.observe(static_cast<double>(stats.computed_tokens - stats_.computed_tokens));
  }
  stats_ = stats;
  // History: one sample per kHistoryPeriod holding the peaks within it, so a burst shorter
  // than the period still shows.
  const double t = std::chrono::duration<double>(Clock::now() - start_).count();
  if (history_.empty() || t - history_.back().t >= kHistoryPeriod) {
    history_.push_back({t, stats.kv.num_used, stats.num_running, stats.num_waiting});
    if (history_.size() > kHistoryLength) history_.pop_front();
  } else {
    Sample& s = history_.back();
    s.kv_used = std::max(s.kv_used, stats.kv.num_used);
    s.running = std::max(s.running, stats.num_running);
    s.waiting = std::max(s.waiting, stats.num_waiting);
  }
}
void Metrics::observe_ttft(double s) {
  std::lock_guard lock(mutex_);
  ttft_.observe(s);
  ttft_window_.add(s);
  vllm_.ttft.observe(s);
}
void Metrics::observe_token_interval(double s) {
  std::lock_guard lock(mutex_);
  tpot_.observe(s);
  tpot_window_.add(s);
  itl_.observe(s);
  itl_window_.add(s);
  vllm_.tpot.observe(s);
}
void Metrics::observe_finished(const FinishedRequest& r) {
  std::lock_guard lock(mutex_);
  ++finished_[r.finish_reason];
  e2e_.observe(r.e2e_seconds);
  e2e_window_.add(r.e2e_seconds);
  queue_.observe(r.queue_seconds);
  vllm_.e2e.observe(r.e2e_seconds);
  vllm_.queue.observe(r.queue_seconds);
  vllm_.inference.observe(r.inference_seconds);
  vllm_.prefill.observe(r.prefill_seconds);
  vllm_.decode.observe(r.decode_seconds);
  vllm_.prompt_tokens.observe(static_cast<double>(r.num_prompt_tokens));
  vllm_.generation_tokens.observe(static_cast<double>(r.num_generation_tokens));
  vllm_.params_n.observe(static_cast<double>(r.num_sequences));
  vllm_.params_max_tokens.observe(static_cast<double>(r.max_tokens));
  if (r.has_first_token && r.max_sequence_tokens > 1) {
    const double mean = r.decode_seconds / static_cast<double>(r.max_sequence_tokens - 1);
    request_tpot_.observe(mean);
    vllm_.request_tpot.observe(mean);
  }
}
void Metrics::count_rejected(int status) {
  std::lock_guard lock(mutex_);
  ++rejected_[status];
}
void Metrics::count_slow_client(const std::string& reason) {
  std::lock_guard lock(mutex_);
  ++slow_clients_[reason];
}

EngineSnapshot Metrics::snapshot() const {
  std::lock_guard lock(mutex_);
  return {.uptime_seconds = std::chrono::duration<double>(Clock::now() - start_).count(),
          .prompt_tokens = stats_.prompt_tokens,
          .generation_tokens = stats_.generation_tokens,
          .num_running = stats_.num_running,
          .num_waiting = stats_.num_waiting,
          .kv_usage = stats_.kv.num_blocks
                          ? static_cast<double>(stats_.kv.num_used) / stats_.kv.num_blocks
                          : 0.0,
          .prefix_queries = stats_.kv.prefix_queries,
          .prefix_hits = stats_.kv.prefix_hits};
}

void Metrics::set_rank_figures(std::vector<RankFigures> ranks) {
  std::lock_guard lock(mutex_);
  ranks_ = std::move(ranks);
}

std::string Metrics::render(const std::string& model_name) const {
  std::lock_guard lock(mutex_);
  std::string out;
  const std::string p = "moeinfer:";
  const auto gauge = [&](const std::string& name, const std::string& help, double v) {
    header(out, p + name, "gauge", help);
    line(out, p + name, "", v);
  };
  const auto counter = [&](const std::string& name, const std::string& help, double v) {
    header(out, p + name, "counter", help);
    line(out, p + name, "", v);
  };
  out += "# moeinfer serving metrics, model " + model_name + "\n";
  gauge("num_requests_running", "Requests in the running batch.", stats_.num_running);
  gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats_.num_waiting);
  gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (0 to 1).",
        stats_.kv.num_blocks ? double(stats_.kv.num_used) / stats_.kv.num_blocks : 0.0);
  gauge("kv_cache_used_blocks", "KV-cache blocks held by requests.", stats_.kv.num_used);
  gauge("kv_cache_total_blocks", "KV-cache blocks in the pool.", stats_.kv.num_blocks);
  gauge("kv_cache_cached_blocks", "Free KV-cache blocks still holding a reusable prefix.",
        stats_.kv.num_cached);
  if (!ranks_.empty()) {
    // Expert parallelism: each rank runs its own requests (the figures above are their sums).
    const auto per_rank = [&](const std::string& name, const char* type, const std::string& help,
                              int64_t RankFigures::*field) {
      header(out, p + name, type, help);
      for (size_t r = 0; r < ranks_.size(); ++r) {
        line(out, p + name, "rank=\"" + std::to_string(r) + "\"",
             static_cast<double>(ranks_[r].*field));
      }
    };
    per_rank("rank_num_requests_running", "gauge", "Sequences in each rank's running batch.",
             &RankFigures::num_running);
    per_rank("rank_num_requests_waiting", "gauge", "Sequences waiting on each rank.",
             &RankFigures::num_waiting);
    per_rank("rank_requests_assigned_total", "counter", "Requests sent to each rank.",
             &RankFigures::num_assigned);
    per_rank("rank_kv_cache_used_blocks", "gauge", "KV-cache blocks held on each rank.",
             &RankFigures::kv_used);
    per_rank("rank_network_bytes_total", "counter",
             "Bytes each rank's MoE layers sent to other ranks (dispatched rows with their "
             "counts, combined outputs), as encoded on the wire (--dispatch-dtype).",
             &RankFigures::network_bytes);
  }
  counter("prompt_tokens_total", "Prompt tokens of admitted requests.", stats_.prompt_tokens);
  counter("generation_tokens_total", "Tokens generated.", stats_.generation_tokens);
  counter("computed_tokens_total", "Tokens run through the model (prefill, recompute, decode).",
          stats_.computed_tokens);
  counter("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
          stats_.kv.prefix_queries);
  counter("prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
          stats_.kv.prefix_hits);
  counter("num_preemptions_total", "Requests preempted (recomputed later) for lack of blocks.",
          stats_.num_preemptions);
  counter("engine_steps_total", "Engine steps run.", stats_.num_steps);
  counter("engine_schedule_seconds_total", "Time spent in the scheduler.", stats_.schedule_seconds);
  counter("engine_forward_seconds_total", "Time spent in the model's forward pass.",
          stats_.forward_seconds);
  counter("engine_sample_seconds_total", "Time spent sampling and detokenising.",
          stats_.sample_seconds);
  header(out, p + "request_success_total", "counter", "Finished requests by finish reason.");
  for (const char* reason : {"stop", "length", "abort"}) {
    const auto it = finished_.find(reason);
    line(out, p + "request_success_total", std::string("finished_reason=\"") + reason + "\"",
         it == finished_.end() ? 0 : it->second);
  }
  header(out, p + "request_rejected_total", "counter", "Requests refused, by HTTP status.");
  for (const auto& [status, count] : rejected_) {
    line(out, p + "request_rejected_total", "status=\"" + std::to_string(status) + "\"", count);
  }
  header(out, p + "slow_clients_total", "counter",
         "Connections closed for a slow client: header_rate, body_rate (sent under "
         "--min-request-rate), send_timeout (took no answer bytes for --send-timeout).");
  for (const char* reason : {"header_rate", "body_rate", "send_timeout"}) {
    const auto it = slow_clients_.find(reason);
    line(out, p + "slow_clients_total", std::string("reason=\"") + reason + "\"",
         it == slow_clients_.end() ? 0 : it->second);
  }
  if (!stats_.stage_seconds.empty()) {
    header(out, p + "stage_seconds_total", "counter",
           "Time per MoE-path stage, summed over layers and the timed steps (the stage "
           "profiler; every step on the CPU, one in --time-every on the GPU).");
    for (int stage = 0; stage < profile::kNumStages; ++stage) {
      line(out, p + "stage_seconds_total",
           "stage=\"" + std::string(profile::stage_name(static_cast<profile::Stage>(stage))) + "\"",
           stats_.stage_seconds[stage]);
    }
    const std::string name = p + "stage_step_seconds";
    header(out, name, "histogram",
           "Time of each MoE-path stage in one engine step, summed over layers; timed steps in "
           "which the stage ran.");
    for (int stage = 0; stage < profile::kNumStages; ++stage) {
      stage_step_[stage].render_series(name, "stage=\"" + stage_label(stage) + "\"", out);
    }
  }
  if (stats_.expert_offload()) {
    const offload::CacheSummary totals = cache_totals(stats_);
    for (int k = 0; k < offload::kNumCacheCounters; ++k) {
      counter(std::string("expert_cache_") + kCacheCounterNames[k] + "_total", kCacheCounterHelp[k],
              static_cast<double>(totals.counts[k]));
    }
    counter("expert_cache_host_to_device_bytes_total",
            "Expert bytes that crossed host to device: every copy into a slot and every read of "
            "an unplaced expert.",
            static_cast<double>(totals.host_to_device_bytes));
    counter("expert_cache_stall_seconds_total",
            "Time compute waited for the expert cache's demand copies.", totals.stall_seconds);
    gauge("expert_cache_prefetch_accuracy",
          "Share of resolved prefetches that a demand used: prefetch_used / (prefetch_used + "
          "prefetch_wasted).",
          totals.prefetch_accuracy());
    header(out, p + "expert_cache_layer_events_total", "counter",
           "The expert cache's counts per layer (event: hits, misses, unplaced, prefetched, "
           "prefetch_used, cpu_experts, cpu_rows, prefetch_wasted).");
    for (int64_t l = 0; l < stats_.num_layers; ++l) {
      for (int k = 0; k < offload::kNumCacheCounters; ++k) {
        line(out, p + "expert_cache_layer_events_total",
             "layer=\"" + std::to_string(l) + "\",event=\"" + kCacheCounterNames[k] + "\"",
             static_cast<double>(stats_.expert_cache[l * offload::kNumCacheCounters + k]));
      }
    }
  }
  if (stats_.num_experts > 0 && !stats_.expert_rows.empty()) {
    const int64_t E = stats_.num_experts;
    header(out, p + "expert_rows_total", "counter",
           "Token rows routed to each expert of each layer.");
    for (int64_t l = 0; l < stats_.num_layers; ++l) {
      for (int64_t e = 0; e < E; ++e) {
        line(out, p + "expert_rows_total",
             "layer=\"" + std::to_string(l) + "\",expert=\"" + std::to_string(e) + "\"",
             static_cast<double>(stats_.expert_rows[l * E + e]));
      }
    }
    header(out, p + "expert_load_max_over_mean", "gauge",
           "Per layer: the busiest expert's rows over the mean (1 = balanced).");
    for (int64_t l = 0; l < stats_.num_layers; ++l) {
      int64_t total = 0, most = 0;
      for (int64_t e = 0; e < E; ++e) {
        total += stats_.expert_rows[l * E + e];
        most = std::max(most, stats_.expert_rows[l * E + e]);
      }
      line(out, p + "expert_load_max_over_mean", "layer=\"" + std::to_string(l) + "\"",
           total > 0 ? static_cast<double>(most) * E / total : 0.0);
    }
  }
  ttft_.render(p + "time_to_first_token_seconds", "Time to first token.", out);
  tpot_.render(p + "time_per_output_token_seconds",
               "Time per output token after the first: one sample per token.", out);
  itl_.render(p + "inter_token_latency_seconds", "Time between consecutive output tokens.", out);
  request_tpot_.render(p + "request_time_per_output_token_seconds",
                       "Per request: the mean time per output token after the first.", out);
  e2e_.render(p + "e2e_request_latency_seconds", "End-to-end request latency.", out);
  queue_.render(p + "request_queue_time_seconds",
                "Time a request waited before it was first scheduled.", out);
  render_vllm(model_name, out);
  return out;
}

// vLLM's names and labels for what has a vLLM counterpart, and vLLM's request histograms.
void Metrics::render_vllm(const std::string& model_name, std::string& out) const {
  const std::string labels = "model_name=\"" + label_value(model_name) + "\",engine=\"0\"";
  const auto sample = [&](const std::string& name, const char* type, const std::string& help,
                          double v) {
    header(out, "vllm:" + name, type, help);
    line(out, "vllm:" + name, labels, v);
  };
  const auto histogram = [&](const std::string& name, const std::string& help,
                             const Histogram& h) {
    header(out, "vllm:" + name, "histogram", help);
    h.render_series("vllm:" + name, labels, out);
  };
  const double kv_usage =
      stats_.kv.num_blocks ? static_cast<double>(stats_.kv.num_used) / stats_.kv.num_blocks : 0.0;
  sample("num_requests_running", "gauge", "Requests in the running batch.",
         stats_.num_running);
  sample("num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
         stats_.num_waiting);
  sample("kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks held by requests (0 to 1).", kv_usage);
  sample("gpu_cache_usage_perc", "gauge",
         "kv_cache_usage_perc under vLLM's older name.",
         kv_usage);
  sample("prefix_cache_queries_total", "counter",
         "Prompt tokens looked up in the prefix cache.", stats_.kv.prefix_queries);
  sample("prefix_cache_hits_total", "counter",
         "Prompt tokens found in the prefix cache.", stats_.kv.prefix_hits);
  sample("num_preemptions_total", "counter", "Requests preempted (recomputed later) for lack of blocks.",
         stats_.num_preemptions);
  sample("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
         stats_.prompt_tokens);
  sample("generation_tokens_total", "counter", "Tokens generated.",
         stats_.generation_tokens);
  header(out, "vllm:request_success_total", "counter", "Finished requests by finish reason.");
  for (const char* reason : {"stop", "length", "abort"}) {
    const auto it = finished_.find(reason);
    line(out, "vllm:request_success_total",
         labels + ",finished_reason=\"" + reason + "\"", it == finished_.end() ? 0 : it->second);
  }
  histogram("time_to_first_token_seconds", "Time to first token.",
            vllm_.ttft);
  histogram("time_per_output_token_seconds",
            "Time per output token after the first: one sample per token.", vllm_.tpot);
  histogram("inter_token_latency_seconds", "Time between consecutive output tokens.",
            vllm_.tpot);
  histogram("request_time_per_output_token_seconds",
            "Per request: the mean time per output token after the first.", vllm_.request_tpot);
  histogram("e2e_request_latency_seconds", "End-to-end request latency.",
            vllm_.e2e);
  histogram("request_queue_time_seconds", "Time a request waited before it was first scheduled.",
            vllm_.queue);
  histogram("request_inference_time_seconds",
            "Time from first scheduled to finished.", vllm_.inference);
  histogram("request_prefill_time_seconds",
            "Time from first scheduled to the first token.", vllm_.prefill);
  histogram("request_decode_time_seconds", "Time from the first token to the last.",
            vllm_.decode);
  histogram("request_prompt_tokens", "Prompt tokens per finished request.", vllm_.prompt_tokens);
  histogram("request_generation_tokens", "Generated tokens per finished request.",
            vllm_.generation_tokens);
  histogram("iteration_tokens_total", "Tokens run through the model per engine step.",
            vllm_.iteration_tokens);
  histogram("request_params_n", "The n of finished requests.", vllm_.params_n);
  histogram("request_params_max_tokens", "The max_tokens of finished requests.",
            vllm_.params_max_tokens);
}

nlohmann::json Metrics::dashboard(const std::string& model_name) const {
  using json = nlohmann::json;
  std::lock_guard lock(mutex_);
  const double now = std::chrono::duration<double>(Clock::now() - start_).count();
  json d;
  d["model"] = model_name;
  d["time"] = static_cast<int64_t>(std::time(nullptr));
  d["uptime_s"] = now;

  json finished = json::object();
  int64_t num_finished = 0;
  for (const char* reason : {"stop", "length", "abort"}) {
    const auto it = finished_.find(reason);
    finished[reason] = it == finished_.end() ? 0 : it->second;
    num_finished += finished[reason].get<int64_t>();
  }
  json rejected = json::object();
  for (const auto& [status, count] : rejected_) rejected[std::to_string(status)] = count;
  d["requests"] = {{"running", stats_.num_running},
                   {"waiting", stats_.num_waiting},
                   {"finished", finished},
                   {"finished_total", num_finished},
                   {"rejected", rejected}};
  json ranks = json::array();
  for (const RankFigures& r : ranks_) {
    ranks.push_back({{"running", r.num_running},
                     {"waiting", r.num_waiting},
                     {"assigned", r.num_assigned},
                     {"kv_used", r.kv_used},
                     {"kv_blocks", r.kv_blocks},
                     {"network_bytes", r.network_bytes}});
  }
  d["ranks"] = ranks;  // empty in one process
  d["tokens"] = {{"prompt", stats_.prompt_tokens},
                 {"generation", stats_.generation_tokens},
                 {"computed", stats_.computed_tokens}};
  d["engine"] = {{"steps", stats_.num_steps},
                 {"preemptions", stats_.num_preemptions},
                 {"schedule_s", stats_.schedule_seconds},
                 {"forward_s", stats_.forward_seconds},
                 {"sample_s", stats_.sample_seconds}};

  // KV: now, and the samples taken after steps (t in seconds since start; the last point is
  // now, so an idle server's line runs on to the present).
  json history = json::array();
  for (const Sample& s : history_) {
    history.push_back(
        {{"t", s.t}, {"kv_used", s.kv_used}, {"running", s.running}, {"waiting", s.waiting}});
  }
  history.push_back({{"t", now},
                     {"kv_used", stats_.kv.num_used},
                     {"running", stats_.num_running},
                     {"waiting", stats_.num_waiting}});
  d["kv"] = {
      {"used", stats_.kv.num_used},
      {"total", stats_.kv.num_blocks},
      {"cached", stats_.kv.num_cached},
      {"usage",
       stats_.kv.num_blocks ? double(stats_.kv.num_used) / double(stats_.kv.num_blocks) : 0.0},
      {"prefix_queries", stats_.kv.prefix_queries},
      {"prefix_hits", stats_.kv.prefix_hits},
      {"history", history}};

  // Stages: totals (stage_seconds_total) and per-step statistics (stage_step_seconds).
  json stages = json::array();
  const bool profiled = stats_.stage_seconds.size() == static_cast<size_t>(profile::kNumStages);
  if (profiled) {
    double total = 0.0;
    for (double s : stats_.stage_seconds) total += s;
    for (int stage = 0; stage < profile::kNumStages; ++stage) {
      const Histogram& h = stage_step_[stage];
      const double seconds = stats_.stage_seconds[stage];
      stages.push_back(
          {{"stage", stage_label(stage)},
           {"layer_stage", profile::is_layer_stage(static_cast<profile::Stage>(stage))},
           {"seconds_total", seconds},
           {"share", total > 0.0 ? seconds / total : 0.0},
           {"steps", h.count()},
           {"step_sum_s", h.sum()},
           {"step_mean_s", h.count() ? h.sum() / h.count() : 0.0},
           {"step_p50_s", h.quantile(0.5)},
           {"step_p90_s", h.quantile(0.9)}});
    }
  }
  d["stage_metrics"] = profiled;
  d["stages"] = stages;

  // Experts: rows per layer and expert, and each layer's busiest expert over the mean.
  json experts = nullptr;
  const int64_t L = stats_.num_layers, E = stats_.num_experts;
  if (E > 0 && stats_.expert_rows.size() == static_cast<size_t>(L * E)) {
    json rows = json::array(), imbalance = json::array();
    for (int64_t l = 0; l < L; ++l) {
      json row = json::array();
      int64_t total = 0, most = 0;
      for (int64_t e = 0; e < E; ++e) {
        const int64_t v = stats_.expert_rows[l * E + e];
        row.push_back(v);
        total += v;
        most = std::max(most, v);
      }
      rows.push_back(std::move(row));
      imbalance.push_back(total > 0 ? static_cast<double>(most) * E / total : 0.0);
    }
    experts = {{"num_layers", L}, {"num_experts", E}, {"rows", rows}, {"max_over_mean", imbalance}};
  }
  d["experts"] = experts;

  // The expert cache under offloading: totals and per layer; null without a budget.
  json cache = nullptr;
  if (stats_.expert_offload()) {
    const offload::CacheSummary totals = cache_totals(stats_);
    json layers = json::array();
    for (int64_t l = 0; l < stats_.num_layers; ++l) {
      json layer = {{"layer", l}};
      for (int k = 0; k < offload::kNumCacheCounters; ++k) {
        layer[kCacheCounterNames[k]] = stats_.expert_cache[l * offload::kNumCacheCounters + k];
      }
      layer["host_to_device_bytes"] = stats_.expert_cache_bytes[l];
      layer["stall_seconds"] = stats_.expert_cache_stall_seconds[l];
      layers.push_back(std::move(layer));
    }
    cache = json::object();
    for (int k = 0; k < offload::kNumCacheCounters; ++k) {
      cache[kCacheCounterNames[k]] = totals.counts[k];
    }
    cache["hit_rate"] = totals.hit_rate();
    cache["prefetch_accuracy"] = totals.prefetch_accuracy();
    cache["host_to_device_bytes"] = totals.host_to_device_bytes;
    cache["stall_seconds"] = totals.stall_seconds;
    cache["layers"] = std::move(layers);
  }
  d["expert_cache"] = cache;

  // Latencies: count and sum as the histograms hold them; percentiles of the latest window.
  const auto latency = [](const Histogram& h, const Window& w) {
    std::vector<double> v = w.values;
    std::sort(v.begin(), v.end());
    const auto pct = [&](double q) {
      if (v.empty()) return 0.0;
      const size_t i = static_cast<size_t>(std::ceil(q * static_cast<double>(v.size()))) - 1;
      return v[std::min(i, v.size() - 1)];
    };
    return json{{"count", h.count()},
                {"sum_s", h.sum()},
                {"mean_s", h.count() ? h.sum() / h.count() : 0.0},
                {"window", v.size()},
                {"p50_s", pct(0.5)},
                {"p90_s", pct(0.9)},
                {"p99_s", pct(0.99)},
                {"max_s", v.empty() ? 0.0 : v.back()}};
  };
  d["latency"] = {{"ttft", latency(ttft_, ttft_window_)},
                  {"tpot", latency(tpot_, tpot_window_)},
                  {"itl", latency(itl_, itl_window_)},
                  {"e2e", latency(e2e_, e2e_window_)}};
  return d;
}

}  // namespace moeinfer::server
