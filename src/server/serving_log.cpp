#include "server/serving_log.h"

#if MOE_HAVE_HTTPLIB  // AccessLog reads cpp-httplib's request and response
#include <httplib.h>
#endif

#include <cstdio>

namespace moeinfer::server {
namespace {

std::string count_text(int64_t v) { return v < 0 ? "-" : std::to_string(v); }

std::string seconds_text(double s) {
  if (s < 0.0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.4fs", s);
  return buf;
}

std::string or_dash(const std::string& s) { return s.empty() ? "-" : s; }

void write_line(const std::string& line) {
  // One write per line, so that lines from several threads do not interleave.
  std::fprintf(stderr, "%s\n", line.c_str());
}

}  // namespace

std::string access_log_line(const AccessEntry& e) {
  const std::string request = e.method.empty() ? "-" : e.method + " " + e.path;
  return "moeinfer serve: access " + or_dash(e.id) + " " + or_dash(e.client) + " \"" + request +
         "\" " + std::to_string(e.status) + " prompt_tokens=" + count_text(e.prompt_tokens) +
         " output_tokens=" + count_text(e.output_tokens) +
         " cached_tokens=" + count_text(e.cached_tokens) +
         " queue=" + seconds_text(e.queue_seconds) + " ttft=" + seconds_text(e.ttft_seconds) +
         " latency=" + seconds_text(e.latency_seconds) + " finish=" + or_dash(e.finish);
}

void AccessLog::begin() {
  if (!enabled_) return;
  std::lock_guard lock(mutex_);
  pending_[std::this_thread::get_id()] = Pending{.start = Clock::now()};
}

void AccessLog::describe(std::function<void(AccessEntry&)> fill) {
  if (!enabled_) return;
  std::lock_guard lock(mutex_);
  pending_[std::this_thread::get_id()].fill = std::move(fill);
}

void AccessLog::end(const httplib::Request& req, const httplib::Response& res) {
#if MOE_HAVE_HTTPLIB
  if (!enabled_) return;
  Pending pending;
  {
    std::lock_guard lock(mutex_);
    const auto it = pending_.find(std::this_thread::get_id());
    if (it != pending_.end()) {
      pending = std::move(it->second);
      pending_.erase(it);
    }
  }
  // Probes and scrapes that succeed would drown the rest (a dashboard polls every second).
  const bool monitoring =
      req.path == "/health" || req.path == "/metrics" || req.path == "/dashboard/data";
  if (monitoring && res.status < 300) return;
  AccessEntry entry{.client = req.remote_addr + ":" + std::to_string(req.remote_port),
                    .method = req.method,
                    .path = req.path,
                    .status = res.status};
  if (pending.start != Clock::time_point()) {
    entry.latency_seconds = std::chrono::duration<double>(Clock::now() - pending.start).count();
  }
  if (pending.fill) pending.fill(entry);
  write_line(access_log_line(entry));
#else
  (void)req;
  (void)res;
#endif
}

void AccessLog::refused(int status) {
  if (!enabled_) return;
  write_line(access_log_line(AccessEntry{.status = status}));
}

std::string engine_log_line(const EngineSnapshot& now, const EngineSnapshot& last) {
  const double dt = now.uptime_seconds - last.uptime_seconds;
  const auto rate = [dt](int64_t tokens) { return dt > 0.0 ? tokens / dt : 0.0; };
  const int64_t queries = now.prefix_queries - last.prefix_queries;
  const double hit_rate =
      queries > 0 ? static_cast<double>(now.prefix_hits - last.prefix_hits) / queries : 0.0;
  char buf[320];
  std::snprintf(buf, sizeof(buf),
                "moeinfer serve: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: "
                "%.1f tokens/s, Running: %lld reqs, Waiting: %lld reqs, KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%",
                rate(now.prompt_tokens - last.prompt_tokens),
                rate(now.generation_tokens - last.generation_tokens),
                static_cast<long long>(now.num_running), static_cast<long long>(now.num_waiting),
                100.0 * now.kv_usage, 100.0 * hit_rate);
  return buf;
}

bool engine_log_due(const EngineSnapshot& now, const EngineSnapshot& last,
                    bool last_had_throughput) {
  const bool throughput =
      now.prompt_tokens != last.prompt_tokens || now.generation_tokens != last.generation_tokens;
  return throughput || last_had_throughput || now.num_running > 0 || now.num_waiting > 0;
}

EngineLogger::EngineLogger(const Metrics& metrics, double interval_seconds) : metrics_(metrics) {
  if (interval_seconds > 0.0) thread_ = std::thread([this, interval_seconds] { loop(interval_seconds); });
}

EngineLogger::~EngineLogger() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void EngineLogger::loop(double interval_seconds) {
  const auto interval = std::chrono::duration<double>(interval_seconds);
  EngineSnapshot last = metrics_.snapshot();
  bool last_had_throughput = false;
  std::unique_lock lock(mutex_);
  while (!cv_.wait_for(lock, interval, [this] { return stop_; })) {
    const EngineSnapshot now = metrics_.snapshot();
    if (engine_log_due(now, last, last_had_throughput)) {
      write_line(engine_log_line(now, last));
      last_had_throughput = now.prompt_tokens != last.prompt_tokens ||
                            now.generation_tokens != last.generation_tokens;
    }
    last = now;
  }
}

}  // namespace moeinfer::server
