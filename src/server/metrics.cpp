#include "server/metrics.h"

#include <algorithm>
#include <cstdio>

#include "profile/profiler.h"

namespace moeinfer::server {
namespace {

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
  int64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    line(out, name + "_bucket", "le=\"" + number(bounds_[i]) + "\"", cumulative);
  }
  line(out, name + "_bucket", "le=\"+Inf\"", count_);
  line(out, name + "_sum", "", sum_);
  line(out, name + "_count", "", count_);
}

Metrics::Metrics()
    : ttft_(kLatencyBounds), tpot_(kLatencyBounds), itl_(kLatencyBounds), e2e_(kE2eBounds) {}

void Metrics::set_engine_stats(const EngineStats& stats) {
  std::lock_guard lock(mutex_);
  stats_ = stats;
}
void Metrics::observe_ttft(double s) {
  std::lock_guard lock(mutex_);
  ttft_.observe(s);
}
void Metrics::observe_tpot(double s) {
  std::lock_guard lock(mutex_);
  tpot_.observe(s);
}
void Metrics::observe_itl(double s) {
  std::lock_guard lock(mutex_);
  itl_.observe(s);
}
void Metrics::observe_e2e(double s) {
  std::lock_guard lock(mutex_);
  e2e_.observe(s);
}
void Metrics::count_finished(const std::string& reason) {
  std::lock_guard lock(mutex_);
  ++finished_[reason];
}
void Metrics::count_rejected(int status) {
  std::lock_guard lock(mutex_);
  ++rejected_[status];
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
  if (!stats_.stage_seconds.empty()) {
    header(out, p + "stage_seconds_total", "counter",
           "Time per MoE-path stage, summed over layers and steps (the stage profiler).");
    for (int stage = 0; stage < profile::kNumStages; ++stage) {
      line(out, p + "stage_seconds_total",
           "stage=\"" + std::string(profile::stage_name(static_cast<profile::Stage>(stage))) + "\"",
           stats_.stage_seconds[stage]);
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
  tpot_.render(p + "time_per_output_token_seconds", "Mean time per output token after the first.",
               out);
  itl_.render(p + "inter_token_latency_seconds", "Time between consecutive output tokens.", out);
  e2e_.render(p + "e2e_request_latency_seconds", "End-to-end request latency.", out);
  return out;
}

}  // namespace moeinfer::server
