// What `moeinfer serve` writes to stderr while it serves, besides its start-up lines: one access
// line per HTTP request (AccessLog; off with --disable-log-requests) and, every --log-interval
// seconds while there is work, one engine line with the throughput and the batch as vLLM prints
// it (EngineLogger). Formats in docs/serving.md, "Logging".
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "server/metrics.h"

namespace httplib {
struct Request;
struct Response;
}  // namespace httplib

namespace moeinfer::server {

// One access-log line's fields; -1 (or empty) where a figure does not apply or is not known.
struct AccessEntry {
  std::string id;        // the response id (cmpl-..., chatcmpl-...) of a generation
  std::string client;    // address:port
  std::string method;    // empty: refused before its request line arrived
  std::string path;
  int status = 0;
  int64_t prompt_tokens = -1;
  int64_t output_tokens = -1;
  int64_t cached_tokens = -1;
  double queue_seconds = -1.0;
  double ttft_seconds = -1.0;
  double latency_seconds = -1.0;  // from its headers' arrival to the end of the answer
  std::string finish;             // stop, length, abort; disconnected: the client left a stream
};

// `moeinfer serve: access ID CLIENT "METHOD PATH" STATUS prompt_tokens=N ... finish=R`, every
// key present, `-` for what is unknown or does not apply.
std::string access_log_line(const AccessEntry& entry);

// The access log. cpp-httplib serves each connection, one request after another, on one pool
// thread and calls its logger on that thread after the answer is written, so what a handler
// adds about its request is kept by thread until then.
class AccessLog {
 public:
  explicit AccessLog(bool enabled) : enabled_(enabled) {}

  // Before routing: the request on this thread starts now.
  void begin();
  // From a handler: what only it knows (a generation's id, tokens and times), filled in when
  // the line is written.
  void describe(std::function<void(AccessEntry&)> fill);
  // cpp-httplib's logger: writes the line of this thread's request.
  void end(const httplib::Request& req, const httplib::Response& res);
  // An answer given before a request line arrived (408, 431): no request to name.
  void refused(int status);

 private:
  using Clock = std::chrono::steady_clock;
  struct Pending {
    Clock::time_point start;
    std::function<void(AccessEntry&)> fill;
  };
  const bool enabled_;
  std::mutex mutex_;
  std::unordered_map<std::thread::id, Pending> pending_;  // by the thread serving it
};

// `moeinfer serve: Avg prompt throughput: X tokens/s, Avg generation throughput: Y tokens/s,
// Running: N reqs, Waiting: M reqs, KV cache usage: P%, Prefix cache hit rate: H%`, the
// throughputs and the hit rate over the interval from `last` to `now`.
std::string engine_log_line(const EngineSnapshot& now, const EngineSnapshot& last);
// Whether the interval from `last` to `now` deserves a line: tokens went through, requests are
// in flight, or the previous line had throughput (one line says that it stopped).
bool engine_log_due(const EngineSnapshot& now, const EngineSnapshot& last,
                    bool last_had_throughput);

// A thread that writes engine_log_line every `interval_seconds` (none when it is 0) while
// engine_log_due says so; stops and joins on destruction.
class EngineLogger {
 public:
  EngineLogger(const Metrics& metrics, double interval_seconds);
  EngineLogger(const EngineLogger&) = delete;
  EngineLogger& operator=(const EngineLogger&) = delete;
  ~EngineLogger();

 private:
  void loop(double interval_seconds);

  const Metrics& metrics_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace moeinfer::server
