// `moeinfer bench-serve --url URL [--concurrency N] [--num-prompts M] [--input-len I]
// [--output-len O] [--request-rate R] [--json FILE]`: a load generator for any OpenAI-compatible
// server, measured the way vLLM's benchmark_serving reports: request and token throughput, and
// TTFT, TPOT, inter-token latency and end-to-end latency at mean / p50 / p90 / p95 / p99.
// Prompts are random token ids (so no prefix is shared) sent to /v1/completions with
// ignore_eos, streamed, with usage; arrivals are Poisson at --request-rate (all at once when
// infinite), at most --concurrency in flight.
#if MOE_HAVE_HTTPLIB
#include <httplib.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "cli/path_arg.h"
#include "core/error.h"

namespace moeinfer::cli {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

struct BenchServeArgs {
  std::string url = "http://127.0.0.1:8000";
  std::string model;
  std::string api_key;
  int64_t concurrency = 64;
  int64_t num_prompts = 200;
  int64_t input_len = 128;
  int64_t output_len = 128;
  double request_rate = std::numeric_limits<double>::infinity();
  int64_t token_range = 1000;  // prompt ids drawn from [1, token_range)
  uint64_t seed = 0;
  std::string json_file;
};

#if MOE_HAVE_HTTPLIB
struct RequestResult {
  bool ok = false;
  std::string error;
  int64_t prompt_tokens = 0;
  int64_t output_tokens = 0;
  double ttft = 0.0;     // seconds
  double latency = 0.0;  // seconds
  std::vector<double> itl;
};

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  // Linear interpolation between closest ranks, as numpy.percentile does.
  const double rank = p / 100.0 * (v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (rank - lo);
}

double mean(const std::vector<double>& v) {
  double s = 0.0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / v.size();
}

httplib::Headers auth_headers(const BenchServeArgs& args) {
  httplib::Headers h;
  if (!args.api_key.empty()) h.emplace("Authorization", "Bearer " + args.api_key);
  return h;
}

std::string served_model(httplib::Client& client, const BenchServeArgs& args) {
  auto res = client.Get("/v1/models", auth_headers(args));
  MOE_CHECK(res, "cannot reach ", args.url, ": ", httplib::to_string(res.error()));
  MOE_CHECK(res->status == 200, "GET /v1/models answered ", res->status, ": ", res->body);
  const json body = json::parse(res->body);
  MOE_CHECK(body.contains("data") && !body["data"].empty(), "the server lists no models");
  return body["data"][0]["id"].get<std::string>();
}

RequestResult run_one(httplib::Client& client, const BenchServeArgs& args, const std::string& model,
                      const std::vector<int32_t>& prompt) {
  RequestResult result;
  const json body = {{"model", model},
                     {"prompt", prompt},
                     {"max_tokens", args.output_len},
                     {"temperature", 0.0},
                     {"ignore_eos", true},
                     {"stream", true},
                     {"stream_options", {{"include_usage", true}}}};
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.headers = auth_headers(args);
  req.headers.emplace("Content-Type", "application/json");
  req.body = body.dump();
  std::string buffer;
  bool done = false;
  const auto start = Clock::now();
  auto last = start;
  bool first = true;
  const auto on_event = [&](const std::string& data) {
    if (data == "[DONE]") {
      done = true;
      return;
    }
    const json event = json::parse(data, nullptr, /*allow_exceptions=*/false);
    if (event.is_discarded()) return;
    if (event.contains("error")) {
      result.error = event["error"].value("message", "error event");
      return;
    }
    if (event.contains("usage") && event["usage"].is_object()) {
      result.prompt_tokens = event["usage"].value("prompt_tokens", 0);
      result.output_tokens = event["usage"].value("completion_tokens", 0);
    }
    if (event.contains("choices") && !event["choices"].empty() &&
        !event["choices"][0].value("text", "").empty()) {
      const auto now = Clock::now();
      if (first) {
        result.ttft = seconds(now - start);
        first = false;
      } else {
        result.itl.push_back(seconds(now - last));
      }
      last = now;
    }
  };
  req.content_receiver = [&](const char* data, size_t size, uint64_t, uint64_t) {
    buffer.append(data, size);
    for (size_t end; (end = buffer.find("\n\n")) != std::string::npos;) {
      const std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      if (event.rfind("data: ", 0) == 0) on_event(event.substr(6));
    }
    return true;
  };
  httplib::Response res;
  httplib::Error error = httplib::Error::Success;
  const bool sent = client.send(req, res, error);
  result.latency = seconds(Clock::now() - start);
  if (!sent) {
    result.error = httplib::to_string(error);
  } else if (res.status != 200) {
    result.error = "HTTP " + std::to_string(res.status) + " " + buffer + res.body;
  } else if (!done && result.error.empty()) {
    result.error = "the stream ended without [DONE]";
  }
  result.ok = result.error.empty() && !first;
  if (result.ok && result.output_tokens == 0) result.output_tokens = 1 + result.itl.size();
  return result;
}

// The engine's own time counters from /metrics (seconds in the scheduler, the forward pass and
// sampling), or nothing when the server does not publish them.
struct EngineTimes {
  double schedule = 0.0, forward = 0.0, sample = 0.0;
  bool found = false;
};

EngineTimes scrape_engine_times(httplib::Client& client, const BenchServeArgs& args) {
  httplib::Headers headers;
  if (!args.api_key.empty()) headers.emplace("Authorization", "Bearer " + args.api_key);
  EngineTimes times;
  const auto res = client.Get("/metrics", headers);
  if (!res || res->status != 200) return times;
  std::istringstream lines(res->body);
  for (std::string line; std::getline(lines, line);) {
    const auto read = [&](const char* name, double* value) {
      if (line.rfind(name, 0) == 0 && line.size() > std::strlen(name) &&
          line[std::strlen(name)] == ' ') {
        *value = std::strtod(line.c_str() + std::strlen(name) + 1, nullptr);
        times.found = true;
      }
    };
    read("moeinfer:engine_schedule_seconds_total", &times.schedule);
    read("moeinfer:engine_forward_seconds_total", &times.forward);
    read("moeinfer:engine_sample_seconds_total", &times.sample);
  }
  return times;
}

void run_bench_serve(const BenchServeArgs& args) {
  MOE_CHECK(args.concurrency >= 1, "--concurrency must be >= 1");
  MOE_CHECK(args.num_prompts >= 1, "--num-prompts must be >= 1");
  MOE_CHECK(args.input_len >= 1 && args.output_len >= 1,
            "--input-len and --output-len must be >= 1");
  MOE_CHECK(args.request_rate > 0.0, "--request-rate must be > 0");
  MOE_CHECK(args.token_range >= 2, "--token-range must be >= 2");
  httplib::Client probe(args.url);
  probe.set_read_timeout(std::chrono::seconds(30));
  const std::string model = args.model.empty() ? served_model(probe, args) : args.model;

  std::mt19937_64 rng(args.seed);
  std::uniform_int_distribution<int32_t> token(1, static_cast<int32_t>(args.token_range - 1));
  std::vector<std::vector<int32_t>> prompts(args.num_prompts);
  for (auto& p : prompts) {
    p.resize(args.input_len);
    for (auto& id : p) id = token(rng);
  }
  // Arrival offsets: Poisson process at the request rate, or everything at once.
  std::vector<double> arrival(args.num_prompts, 0.0);
  if (std::isfinite(args.request_rate)) {
    std::exponential_distribution<double> gap(args.request_rate);
    double t = 0.0;
    for (auto& a : arrival) {
      a = t;
      t += gap(rng);
    }
  }

  std::printf(
      "bench-serve: %lld requests to %s (model %s), concurrency %lld, input %lld, output %lld, "
      "rate %s\n",
      static_cast<long long>(args.num_prompts), args.url.c_str(), model.c_str(),
      static_cast<long long>(args.concurrency), static_cast<long long>(args.input_len),
      static_cast<long long>(args.output_len),
      std::isfinite(args.request_rate) ? std::to_string(args.request_rate).c_str() : "inf");
  std::vector<RequestResult> results(args.num_prompts);
  std::atomic<int64_t> next{0};
  const EngineTimes engine_before = scrape_engine_times(probe, args);
  const auto start = Clock::now();
  std::vector<std::thread> workers;
  for (int64_t w = 0; w < std::min(args.concurrency, args.num_prompts); ++w) {
    workers.emplace_back([&] {
      httplib::Client client(args.url);
      client.set_read_timeout(std::chrono::seconds(600));
      client.set_keep_alive(true);
      for (int64_t i; (i = next.fetch_add(1)) < args.num_prompts;) {
        std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                                  std::chrono::duration<double>(arrival[i])));
        results[i] = run_one(client, args, model, prompts[i]);
      }
    });
  }
  for (auto& w : workers) w.join();
  const double duration = seconds(Clock::now() - start);
  const EngineTimes engine_after = scrape_engine_times(probe, args);

  int64_t completed = 0, input_tokens = 0, output_tokens = 0;
  std::vector<double> ttft, tpot, itl, e2el;
  std::string first_error;
  for (const RequestResult& r : results) {
    if (!r.ok) {
      if (first_error.empty()) first_error = r.error;
      continue;
    }
    ++completed;
    input_tokens += r.prompt_tokens > 0 ? r.prompt_tokens : args.input_len;
    output_tokens += r.output_tokens;
    ttft.push_back(r.ttft * 1e3);
    e2el.push_back(r.latency * 1e3);
    if (r.output_tokens > 1) tpot.push_back((r.latency - r.ttft) * 1e3 / (r.output_tokens - 1));
    for (double x : r.itl) itl.push_back(x * 1e3);
  }
  const int64_t failed = args.num_prompts - completed;
  json report = {
      {"duration", duration},
      {"completed", completed},
      {"failed", failed},
      {"num_prompts", args.num_prompts},
      {"concurrency", args.concurrency},
      {"request_rate", std::isfinite(args.request_rate) ? json(args.request_rate) : json("inf")},
      {"input_len", args.input_len},
      {"output_len", args.output_len},
      {"total_input_tokens", input_tokens},
      {"total_output_tokens", output_tokens},
      {"request_throughput", completed / duration},
      {"output_throughput", output_tokens / duration},
      {"total_token_throughput", (input_tokens + output_tokens) / duration}};
  std::printf("%-34s %12lld\n", "Successful requests:", static_cast<long long>(completed));
  std::printf("%-34s %12lld\n", "Failed requests:", static_cast<long long>(failed));
  std::printf("%-34s %12.2f\n", "Benchmark duration (s):", duration);
  std::printf("%-34s %12lld\n", "Total input tokens:", static_cast<long long>(input_tokens));
  std::printf("%-34s %12lld\n", "Total generated tokens:", static_cast<long long>(output_tokens));
  std::printf("%-34s %12.2f\n", "Request throughput (req/s):", completed / duration);
  std::printf("%-34s %12.2f\n", "Output token throughput (tok/s):", output_tokens / duration);
  std::printf("%-34s %12.2f\n",
              "Total token throughput (tok/s):", (input_tokens + output_tokens) / duration);
  // Labels as vLLM's benchmark_serving prints them ("Median TTFT (ms):"), keys as its JSON.
  const auto section = [&](const std::string& key, const std::string& label, const char* title,
                           const std::vector<double>& v) {
    std::printf("---------------%s---------------\n", title);
    std::printf("%-34s %12.2f\n", ("Mean " + label + " (ms):").c_str(), mean(v));
    report["mean_" + key + "_ms"] = mean(v);
    for (int p : {50, 90, 95, 99}) {
      const double value = percentile(v, p);
      const std::string prefix = p == 50 ? "Median " : "P" + std::to_string(p) + " ";
      std::printf("%-34s %12.2f\n", (prefix + label + " (ms):").c_str(), value);
      report[(p == 50 ? std::string("median") : "p" + std::to_string(p)) + "_" + key + "_ms"] =
          value;
    }
  };
  if (engine_before.found && engine_after.found) {
    // The server's own split of its step time over the run: how much the scheduler costs.
    const double schedule = engine_after.schedule - engine_before.schedule;
    const double step = schedule + (engine_after.forward - engine_before.forward) +
                        (engine_after.sample - engine_before.sample);
    const double share = step > 0 ? schedule / step : 0.0;
    std::printf("%-34s %12.4f\n", "Server scheduler share of step:", share);
    report["server_schedule_seconds"] = schedule;
    report["server_step_seconds"] = step;
    report["server_schedule_share"] = share;
  }
  section("ttft", "TTFT", "Time to First Token", ttft);
  section("tpot", "TPOT", "Time per Output Token (excl. 1st token)", tpot);
  section("itl", "ITL", "Inter-token Latency", itl);
  section("e2el", "E2EL", "End-to-end Latency", e2el);
  if (!first_error.empty()) std::printf("first error: %s\n", first_error.c_str());
  if (!args.json_file.empty()) {
    std::ofstream out(args.json_file);
    MOE_CHECK(out.good(), "cannot write ", args.json_file);
    out << report.dump(2) << "\n";
  }
  MOE_CHECK(failed == 0, failed, " of ", args.num_prompts, " requests failed");
}

#else
void run_bench_serve(const BenchServeArgs&) {
  MOE_FAIL(
      "this moeinfer was built without cpp-httplib; install libcpp-httplib-dev "
      "(scripts/install-deps.sh) and rebuild");
}
#endif

}  // namespace

void add_bench_serve_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench-serve",
                                 "Load-test an OpenAI-compatible server (vLLM-style report)");
  auto args = std::make_shared<BenchServeArgs>();
  cmd->add_option("--url", args->url, "Server base URL")->capture_default_str();
  cmd->add_option("--model", args->model, "Model id (default: the server's first model)");
  cmd->add_option("--api-key", args->api_key, "Bearer token");
  cmd->add_option("--concurrency", args->concurrency, "Requests in flight at most")
      ->capture_default_str();
  cmd->add_option("--num-prompts", args->num_prompts, "Requests to send")->capture_default_str();
  cmd->add_option("--input-len", args->input_len, "Prompt tokens per request")
      ->capture_default_str();
  cmd->add_option("--output-len", args->output_len, "Tokens generated per request")
      ->capture_default_str();
  cmd->add_option("--request-rate", args->request_rate,
                  "Poisson arrival rate, requests/s (default inf)");
  cmd->add_option("--token-range", args->token_range, "Prompt token ids are drawn from [1, N)")
      ->capture_default_str();
  cmd->add_option("--seed", args->seed, "Random seed for prompts and arrivals")
      ->capture_default_str();
  cmd->add_option("--json", args->json_file, "Write the results as JSON to FILE")
      ->check(writable_file());
  cmd->callback([args] { run_bench_serve(*args); });
}

}  // namespace moeinfer::cli
