#include "server/server.h"

#if MOE_HAVE_HTTPLIB  // without cpp-httplib the server is left out (see src/CMakeLists.txt)

#include <httplib.h>
#include <strings.h>
#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <optional>
#include <set>
#include <string_view>
#include <unordered_map>

#include "core/error.h"
#include "core/version.h"
#include "runtime/chat_prompt.h"
#include "server/dashboard.h"
#include "server/http_connection.h"

namespace moeinfer::server {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// One request's mailbox between the engine thread (writer) and its HTTP thread (reader).
struct Channel {
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<RequestOutput> outputs;  // guarded by mutex
  bool finished = false;              // guarded by mutex
  std::optional<ApiError> error;      // guarded by mutex: the engine refused or failed it
  std::atomic<bool> cancel{false};    // set by the HTTP side when the client went away
  // Guarded by mutex, for the access log: the figures known so far.
  int64_t num_prompt_tokens = -1, num_cached_tokens = -1, num_output_tokens = 0;
  double queue_seconds = -1.0, ttft_seconds = -1.0;
  std::optional<FinishedRequest> summary;  // set before the last output or the error

  // Set by submit() before the engine thread sees it.
  int64_t max_tokens = 0;
  int64_t num_sequences = 1;
  // Engine thread only.
  Clock::time_point arrival = Clock::now();
  Clock::time_point scheduled, first_token, last_token;
  std::vector<Clock::time_point> last_token_of;  // [num_sequences] each sequence's latest
  std::vector<int64_t> tokens_of;                // [num_sequences] tokens so far
  bool started = false;                          // scheduled at least once
  bool has_first = false;
  bool abort_sent = false;
  bool shutdown_abort = false;  // aborted because the grace period ended

  void push(RequestOutput out) {
    {
      std::lock_guard lock(mutex);
      if (out.finished()) finished = true;
      outputs.push_back(std::move(out));
    }
    cv.notify_all();
  }
  void fail(ApiError e) {
    {
      std::lock_guard lock(mutex);
      error = std::move(e);
      finished = true;
    }
    cv.notify_all();
  }
};

namespace {

constexpr size_t kMaxBodyBytes = size_t{16} << 20;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The engine step that first scheduled the request began at `at`.
void note_started(Channel& ch, Clock::time_point at) {
  ch.started = true;
  ch.scheduled = at;
  std::lock_guard lock(ch.mutex);
  ch.queue_seconds = seconds(at - ch.arrival);
}

// A token of sequence out.index: the request's first gives TTFT, every later token of a
// sequence one token interval (so a sequence of N tokens gives N - 1 of them).
void note_token(Metrics& metrics, Channel& ch, const RequestOutput& out, Clock::time_point now) {
  const size_t seq = static_cast<size_t>(out.index);
  if (ch.tokens_of.size() <= seq) {
    ch.tokens_of.resize(seq + 1, 0);
    ch.last_token_of.resize(seq + 1);
  }
  if (!ch.has_first) {
    metrics.observe_ttft(seconds(now - ch.arrival));
    ch.first_token = now;
    ch.has_first = true;
  }
  if (ch.tokens_of[seq] > 0) metrics.observe_token_interval(seconds(now - ch.last_token_of[seq]));
  const auto num_tokens = static_cast<int64_t>(out.token_ids.size());
  ch.tokens_of[seq] += num_tokens;
  ch.last_token_of[seq] = now;
  ch.last_token = now;
  std::lock_guard lock(ch.mutex);
  ch.num_prompt_tokens = out.num_prompt_tokens;
  ch.num_cached_tokens = out.num_cached_tokens;
  ch.num_output_tokens += num_tokens;
  ch.ttft_seconds = seconds(ch.first_token - ch.arrival);
}

FinishedRequest finished_request(const Channel& ch, const RequestOutput& out,
                                 Clock::time_point now) {
  FinishedRequest r{.finish_reason = finish_reason_name(out.finish),
                    .num_prompt_tokens = out.num_prompt_tokens,
                    .max_tokens = ch.max_tokens,
                    .num_sequences = ch.num_sequences,
                    .has_first_token = ch.has_first,
                    .queue_seconds = seconds(ch.scheduled - ch.arrival),
                    .inference_seconds = seconds(now - ch.scheduled),
                    .e2e_seconds = seconds(now - ch.arrival)};
  for (int64_t tokens : ch.tokens_of) {
    r.num_generation_tokens += tokens;
    r.max_sequence_tokens = std::max(r.max_sequence_tokens, tokens);
  }
  if (ch.has_first) {
    r.prefill_seconds = seconds(ch.first_token - ch.scheduled);
    r.decode_seconds = seconds(ch.last_token - ch.first_token);
  }
  return r;
}

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) {
  send_json(res, e.status, error_body(e.what(), e.type, e.param, e.code));
}

bool same_secret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

std::string sse(const json& body) {
  return "data: " + body.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
}

std::chrono::milliseconds milliseconds_of(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

std::string seconds_text(std::chrono::milliseconds ms) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g s", static_cast<double>(ms.count()) / 1000.0);
  return text;
}

// The name of a Host header value or an --allowed-hosts entry: no port, no IPv6 brackets, lower
// case (RFC 9110 4.2.3). An entry may give an IPv6 address without brackets.
std::string host_name(const std::string& host) {
  std::string name;
  if (!host.empty() && host[0] == '[') {
    name = host.substr(1, host.find(']') - 1);
  } else if (std::count(host.begin(), host.end(), ':') > 1) {
    name = host;
  } else {
    name = host.substr(0, host.find(':'));
  }
  std::transform(name.begin(), name.end(), name.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return name;
}

// The most bytes of text one token stands for: its longest decoded token. A token covers at
// most that many bytes of normalised text, and normalisation (NFC, NFKC) shrinks text at most
// threefold, so four times that per token bounds a prompt that fits the context.
int64_t prompt_bytes_per_token(const Tokenizer& tokenizer) {
  size_t longest = 1;
  for (int64_t id = 0; id < tokenizer.vocab_size(); ++id) {
    const int32_t ids[] = {static_cast<int32_t>(id)};
    try {
      longest = std::max(longest, tokenizer.decode(ids).size());
    } catch (const Error&) {  // a hole in the id range
    }
  }
  return 4 * static_cast<int64_t>(longest);
}

// The methods the route at `path` answers (the Allow header of a 405), "" for a path without a
// route. Kept beside install_routes, which registers the same paths.
std::string allowed_methods(const std::string& path) {
  static const std::set<std::string, std::less<>> kGet = {
      "/health", "/metrics", "/dashboard", "/dashboard/data", "/v1/models", "/version"};
  static const std::set<std::string, std::less<>> kPost = {
      "/tokenize", "/detokenize", "/v1/completions", "/v1/chat/completions"};
  const std::string_view models = "/v1/models/";
  if (kGet.count(path) || (path.size() > models.size() && path.starts_with(models)))
    return "GET, HEAD";
  if (kPost.count(path)) return "POST";
  return "";
}

// A request whose body may still be unread on the connection when it is answered.
bool has_body(const httplib::Request& req) {
  return req.has_header("Content-Length") || req.has_header("Transfer-Encoding");
}

// Decrements the in-flight count once, however the request ends.
struct InFlight {
  explicit InFlight(std::atomic<int64_t>& count) : count_(&count) {}
  InFlight(const InFlight&) = delete;
  ~InFlight() { count_->fetch_sub(1); }
  std::atomic<int64_t>* count_;
};

}  // namespace

Server::Server(std::unique_ptr<Engine> engine, ChatConfig chat, const ServerConfig& config,
               parallel::Communicator* expert_parallel)
    : engine_(std::move(engine)),
      ranks_(*engine_, expert_parallel),
      chat_(std::move(chat)),
      config_(config),
      metrics_(MetricsOptions{.max_model_len = engine_->max_model_len()}),
      access_log_(config.log_requests),
      created_(static_cast<int64_t>(std::time(nullptr))) {
  MOE_CHECK(config.max_queue >= 0, "--max-queue must be >= 0, got ", config.max_queue);
  MOE_CHECK(!config.model_name.empty(), "the served model needs a name");
  MOE_CHECK(config.header_timeout_seconds > 0 && config.body_timeout_seconds > 0,
            "--header-timeout and --body-timeout must be > 0, got ", config.header_timeout_seconds,
            " and ", config.body_timeout_seconds);
  MOE_CHECK(config.min_request_rate >= 0 && config.min_request_rate_grace_seconds >= 0,
            "--min-request-rate and --min-request-rate-grace must be >= 0, got ",
            config.min_request_rate, " and ", config.min_request_rate_grace_seconds);
  MOE_CHECK(config.send_timeout_seconds >= 0, "--send-timeout must be >= 0, got ",
            config.send_timeout_seconds);
  for (std::string& host : config_.allowed_hosts) {
    host = host_name(host);
    MOE_CHECK(!host.empty(), "--allowed-hosts has an empty name");
  }
  http_ = std::make_unique<HttpServer>(
      HttpLimits{.header_timeout = milliseconds_of(config.header_timeout_seconds),
                 .body_timeout = milliseconds_of(config.body_timeout_seconds),
                 .max_body_bytes = kMaxBodyBytes,
                 .min_rate = config.min_request_rate,
                 .rate_grace = milliseconds_of(config.min_request_rate_grace_seconds),
                 .send_timeout = milliseconds_of(config.send_timeout_seconds)});
  max_prompt_bytes_ = engine_->max_model_len() * prompt_bytes_per_token(engine_->tokenizer());
  if (chat_.chat_template)
    template_ = std::make_unique<ChatTemplate>(ChatTemplate::parse(*chat_.chat_template));
  // The tool-call format: --tool-call-parser, else the one the model family's template writes.
  if (config.tool_call_parser.empty()) {
    tool_format_ = default_tool_call_format(engine_->model_config().model_type);
  } else {
    const auto format = tool_call_format_from_name(config.tool_call_parser);
    MOE_CHECK(format.has_value(), "--tool-call-parser '", config.tool_call_parser,
              "' is not one of none, ", tool_call_format_names());
    tool_format_ = *format;
  }
  const int64_t threads =
      config.num_http_threads > 0 ? config.num_http_threads : max_in_flight() + 16;
  http_->new_task_queue = [threads] {
    return new httplib::ThreadPool(static_cast<size_t>(threads));
  };
  // Exclusive bind: cpp-httplib's default sets SO_REUSEPORT too, with which a second server on
  // the same port starts without error and the kernel splits connections between the two.
  // SO_REUSEADDR alone lets a restart bind over connections in TIME_WAIT.
  http_->set_socket_options([](socket_t sock) {
    const int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  http_->set_keep_alive_max_count(1000);
  // read_body bounds the bodies of our routes; this bounds cpp-httplib's own reads of the others.
  http_->set_payload_max_length(kMaxBodyBytes);
  http_->set_slow_client([this](const char* reason, const std::string& client) {
    metrics_.count_slow_client(reason);
    if (std::string(reason) == "send_timeout") {
      std::fprintf(stderr,
                   "moeinfer serve: %s took none of the answer's latest bytes for %s "
                   "(--send-timeout): connection closed, its request aborted\n",
                   client.c_str(), seconds_text(http_->limits().send_timeout).c_str());
    }
  });
  http_->set_error_body([this](int status, const std::string& message) {
    metrics_.count_rejected(status);
    access_log_.refused(status);
    return error_body(message, "invalid_request_error", "", "").dump();
  });
  install_routes();
}

Server::~Server() {
  shutdown();
  if (shutdown_thread_.joinable()) shutdown_thread_.join();
  if (engine_thread_.joinable()) {
    {
      std::lock_guard lock(inbox_mutex_);
      stop_engine_ = true;
    }
    inbox_cv_.notify_all();
    engine_thread_.join();
  }
}

int64_t Server::max_in_flight() const {
  return engine_->config().max_num_seqs * ranks_.num_ranks() + config_.max_queue;
}

int Server::bind() {
  int port = config_.port;
  if (port == 0) {
    port = http_->bind_to_any_port(config_.host);
    MOE_CHECK(port > 0, "cannot bind to ", config_.host, " (any port)");
  } else {
    MOE_CHECK(http_->bind_to_port(config_.host, port), "cannot bind to ", config_.host, ":", port,
              ": address in use, or not an address of this host");
  }
  MOE_CHECK(http_->widen_backlog(1024), "listen() on ", config_.host, ":", port, " failed");
  config_.port = port;
  return port;
}

bool Server::refuse_before_routing(const httplib::Request& req, httplib::Response& res) {
  // cpp-httplib reads the body of POST, PUT, PATCH and DELETE requests only: a body sent with
  // another method (a GET with a Content-Length) would be taken for the next request on the
  // connection, one smuggled past whatever forwarded it as a body. Answer, then close instead.
  const bool body_read = req.method == "POST" || req.method == "PUT" || req.method == "PATCH" ||
                         req.method == "DELETE";
  const std::string length = req.get_header_value("Content-Length");
  if (ConnectionState* connection = ConnectionState::current();
      connection && !body_read &&
      (req.has_header("Transfer-Encoding") || (!length.empty() && length != "0"))) {
    connection->close_after(res);
  }
  std::optional<ApiError> error;
  // /health (probes use the address as the host) and the dashboard's page (static, no figures:
  // its data needs the key) are open.
  const bool open = req.path == "/health" || req.path == "/dashboard";
  // RFC 9112, 3.2: an HTTP/1.1 request carries one Host, and an http URI's host is not empty
  // (a Host line with no value is not kept as a header, so it counts as none).
  if (req.get_header_value_count("Host") > 1) {
    error = ApiError(400, "a request must carry one Host header, not several",
                     "invalid_request_error", "", "missing_host");
  } else if (req.version == "HTTP/1.1" && req.get_header_value("Host").empty()) {
    error = ApiError(400, "an HTTP/1.1 request must carry a Host header naming the host",
                     "invalid_request_error", "", "missing_host");
  }
  if (!error && !config_.allowed_hosts.empty() && req.path != "/health") {
    const std::string host = host_name(req.get_header_value("Host"));
    if (std::find(config_.allowed_hosts.begin(), config_.allowed_hosts.end(), host) ==
        config_.allowed_hosts.end()) {
      error = ApiError(421, "this server does not answer for the host '" + host + "'",
                       "invalid_request_error", "", "host_not_allowed");
    }
  }
  if (!error && !config_.api_key.empty() && !open) {
    // The scheme is case-insensitive (RFC 9110), the key is not.
    const std::string auth = req.get_header_value("Authorization");
    const bool bearer = auth.size() > 7 && strncasecmp(auth.c_str(), "Bearer ", 7) == 0;
    if (!bearer || !same_secret(auth.substr(7), config_.api_key)) {
      error = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                       "invalid_request_error", "", "invalid_api_key");
    }
  }
  if (!error) return false;
  metrics_.count_rejected(error->status);
  send_error(res, *error);
  // Answered before the body was read: what follows on the connection is that body.
  ConnectionState* connection = ConnectionState::current();
  if (connection && has_body(req)) connection->close_after(res);
  return true;
}

void Server::answer_http_error(const httplib::Request& req, httplib::Response& res) {
  if (!res.body.empty()) return;  // one of ours: an error object already, and counted
  ConnectionState* connection = ConnectionState::current();
  const auto& limits = http_->limits();
  const bool in_headers = connection && connection->phase() == ReadPhase::kHeaders;
  const ReadFailure failure = connection ? connection->read_failure() : ReadFailure::kNone;
  std::string message = "a malformed HTTP request";
  std::string code;
  if (in_headers && (failure == ReadFailure::kTimeout || failure == ReadFailure::kTooSlow)) {
    res.status = 408;
    message = read_timeout_message(*connection, limits);
    if (failure == ReadFailure::kTooSlow) metrics_.count_slow_client("header_rate");
  } else if (in_headers && failure == ReadFailure::kTooLarge) {
    res.status = 431;
    message = "the request headers are larger than " +
              std::to_string(limits.max_header_bytes >> 10) + " KiB";
  } else if (res.status == 404) {
    // A route of another method is there: 405 with the methods it takes, as FastAPI (vLLM)
    // answers a GET of a POST route.
    if (const std::string allow = allowed_methods(req.path); !allow.empty()) {
      res.status = 405;
      res.set_header("Allow", allow);
      message = req.method + " is not allowed on " + req.path + "; use " + allow;
      code = "method_not_allowed";
    } else {
      message = "no route for " + req.method + " " + req.path;
      code = "not_found";
    }
  } else if (res.status == 413) {
    message = "the request body is larger than " + std::to_string(kMaxBodyBytes >> 20) + " MiB";
    code = "payload_too_large";
  } else if (res.status == 414) {
    message = "the request target is too long";
  }
  // cpp-httplib refused it before or while framing it: the rest of the request may still be on
  // the connection, unread. Only a 404 or 405 for a request without a body leaves it clean.
  const bool routed = res.status == 404 || res.status == 405;
  if (connection && (!routed || has_body(req))) connection->close_after(res);
  metrics_.count_rejected(res.status);
  send_json(res, res.status, error_body(message, "invalid_request_error", "", code));
}

bool Server::read_request_body(const httplib::Request& req, httplib::Response& res,
                               const httplib::ContentReader& reader, std::string* body) {
  const BodyRead read = read_body(req, res, reader, http_->limits(), body);
  if (read.ok) return true;
  metrics_.count_rejected(read.status);
  if (read.too_slow) metrics_.count_slow_client("body_rate");
  send_json(res, read.status,
            error_body(read.message, "invalid_request_error", "",
                       read.status == 413 ? "payload_too_large" : ""));
  return false;
}

void Server::post(const std::string& pattern, BodyHandler handler) {
  http_->Post(pattern, [this, handler = std::move(handler)](const httplib::Request& req,
                                                            httplib::Response& res,
                                                            const httplib::ContentReader& reader) {
    std::string body;
    if (read_request_body(req, res, reader, &body)) handler(body, res);
  });
}

void Server::install_routes() {
  http_->set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    access_log_.end(req, res);
  });
  http_->set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    access_log_.begin();
    return refuse_before_routing(req, res) ? httplib::Server::HandlerResponse::Handled
                                           : httplib::Server::HandlerResponse::Unhandled;
  });
  http_->set_error_handler(
      [this](const httplib::Request& req, httplib::Response& res) { answer_http_error(req, res); });
  // A client that waits for 100 Continue before sending a body over the limit gets its 413
  // instead (cpp-httplib would say 100 and then refuse the body).
  http_->set_expect_100_continue_handler([](const httplib::Request& req, httplib::Response& res) {
    const std::string length = req.get_header_value("Content-Length");
    if (std::strtoull(length.c_str(), nullptr, 10) <= kMaxBodyBytes) return 100;
    res.status = 413;  // what cpp-httplib answers; the return value only picks the branch
    return 413;
  });
  http_->set_post_routing_handler([](const httplib::Request& req, httplib::Response& res) {
    // HTTP/1.0 has no chunked transfer coding (RFC 9112 6.1): a stream to an HTTP/1.0 client
    // (curl -0, proxies that speak 1.0 upstream) goes out as its bare body, ended by closing the
    // connection, instead of chunk sizes inside its events.
    if (req.version == "HTTP/1.0" && res.is_chunked_content_provider_) {
      res.is_chunked_content_provider_ = false;
      res.headers.erase("Transfer-Encoding");
      if (ConnectionState* connection = ConnectionState::current()) connection->close_after(res);
    }
    // One Connection header: cpp-httplib adds its own "close" beside one close_after set.
    if (res.get_header_value_count("Connection") > 1) {
      const std::string value = res.get_header_value("Connection");
      res.headers.erase("Connection");
      res.set_header("Connection", value);
    }
    // cpp-httplib adds Keep-Alive to every answer but the last of a connection; not to one that
    // closes it.
    if (res.get_header_value("Connection") == "close") res.headers.erase("Keep-Alive");
  });
  http_->set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string message = "internal error";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          message = e.what();
        } catch (...) {
        }
        send_json(res, 500, error_body(message, "internal_error", "", ""));
      });

  http_->Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (draining_) {
      send_json(res, 503, error_body("shutting down", "unavailable", "", "shutting_down"));
    } else {
      res.status = 200;
      res.set_content("", "text/plain");
    }
  });
  http_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_.render(config_.model_name), "text/plain; version=0.0.4");
  });
  http_->Get("/dashboard", [](const httplib::Request&, httplib::Response& res) {
    // The page may run its own inline script and talk to this server, nothing else.
    res.set_header("Content-Security-Policy",
                   "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                   "connect-src 'self'; img-src data:; form-action 'none'; base-uri 'none'");
    res.set_header("Cache-Control", "no-cache");
    res.set_content(dashboard_page(), "text/html; charset=utf-8");
  });
  http_->Get("/dashboard/data", [this](const httplib::Request&, httplib::Response& res) {
    res.set_header("Cache-Control", "no-store");
    send_json(res, 200, metrics_.dashboard(config_.model_name));
  });
  const auto model_card = [this] {
    return json{{"id", config_.model_name},
                {"object", "model"},
                {"created", created_},
                {"owned_by", "moeinfer"},
                {"root", config_.model_name},  // not the checkpoint's path on this host
                {"max_model_len", engine_->max_model_len()}};
  };
  http_->Get("/v1/models", [model_card](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200, {{"object", "list"}, {"data", json::array({model_card()})}});
  });
  http_->Get(
      "/v1/models/(.+)", [this, model_card](const httplib::Request& req, httplib::Response& res) {
        if (req.matches[1] != config_.model_name) {
          send_error(res,
                     ApiError(404, "the model '" + std::string(req.matches[1]) + "' does not exist",
                              "invalid_request_error", "model", "model_not_found"));
          return;
        }
        send_json(res, 200, model_card());
      });
  http_->Get("/version", [](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200, {{"version", kVersion}});
  });
  // vLLM's tokenizer endpoints.
  post("/tokenize", [this](const std::string& body, httplib::Response& res) {
    answer(res, [&] {
      TokenizeRequest t = parse_tokenize_request(body);
      check_model(t.request.model);
      const std::vector<int32_t> ids =
          prompt_ids(t.request, t.request.params,
                     {.add_special_tokens = t.add_special_tokens,
                      .add_generation_prompt = t.add_generation_prompt});
      send_json(res, 200,
                {{"count", ids.size()},
                 {"max_model_len", engine_->max_model_len()},
                 {"tokens", ids},
                 {"token_strs", nullptr}});
    });
  });
  post("/detokenize", [this](const std::string& body, httplib::Response& res) {
    answer(res, [&] {
      std::string model;
      const std::vector<int32_t> ids = parse_detokenize_request(body, &model);
      check_model(model);
      const int64_t vocab = engine_->model_config().vocab_size;
      for (int32_t id : ids) {
        if (id >= vocab) {
          throw ApiError(400,
                         "token id " + std::to_string(id) + " is outside the vocabulary of " +
                             std::to_string(vocab),
                         "invalid_request_error", "tokens");
        }
      }
      send_json(res, 200, {{"prompt", engine_->tokenizer().decode(ids)}});
    });
  });
  post("/v1/completions", [this](const std::string& body, httplib::Response& res) {
    handle_completion(body, Endpoint::kCompletions, res);
  });
  post("/v1/chat/completions", [this](const std::string& body, httplib::Response& res) {
    handle_completion(body, Endpoint::kChat, res);
  });
  // Every other request with a body is read through read_body too (cpp-httplib's own reading
  // bounds no chunked body), then answered 404 by the error handler.
  const auto no_route = [this](const httplib::Request& req, httplib::Response& res,
                               const httplib::ContentReader& reader) {
    std::string body;
    if (read_request_body(req, res, reader, &body)) res.status = 404;
  };
  http_->Post(".*", no_route);
  http_->Put(".*", no_route);
  http_->Patch(".*", no_route);
  http_->Delete(".*", no_route);
}

void Server::check_prompt_bytes(size_t bytes, Endpoint endpoint) const {
  if (static_cast<int64_t>(bytes) <= max_prompt_bytes_) return;
  throw ApiError(400,
                 "the prompt is " + std::to_string(bytes) + " bytes, more than this model's " +
                     "maximum context length of " + std::to_string(engine_->max_model_len()) +
                     " tokens could hold (at most " + std::to_string(max_prompt_bytes_) +
                     " bytes); it was not tokenized",
                 "invalid_request_error", endpoint == Endpoint::kChat ? "messages" : "prompt",
                 "context_length_exceeded");
}

void Server::check_model(const std::string& model) const {
  if (!model.empty() && model != config_.model_name) {
    throw ApiError(404,
                   "the model '" + model + "' does not exist (this server has '" +
                       config_.model_name + "')",
                   "invalid_request_error", "model", "model_not_found");
  }
}

void Server::answer(httplib::Response& res, const std::function<void()>& handler) {
  try {
    handler();
  } catch (const ApiError& e) {
    metrics_.count_rejected(e.status);
    send_error(res, e);
  }
}

std::vector<int32_t> Server::prompt_ids(const ApiRequest& request, GenerationParams& params,
                                        const PromptOptions& options) {
  const Tokenizer& tokenizer = engine_->tokenizer();
  std::vector<int32_t> ids;
  if (request.endpoint == Endpoint::kChat) {
    if (!template_) throw ApiError(400, "the model has no chat template; use /v1/completions");
    std::string text;
    try {
      std::lock_guard lock(template_mutex_);
      text = apply_chat_template(*template_, request.messages, options.add_generation_prompt,
                                 chat_,
                                 {.tools = request.tools, .variables = request.chat_template_kwargs});
    } catch (const Error& e) {
      throw ApiError(400, std::string("the chat template failed: ") + e.what(),
                     "invalid_request_error", "messages");
    }
    check_prompt_bytes(text.size(), request.endpoint);
    ChatPrompt chat = chat_prompt(tokenizer, chat_, text);
    ids = std::move(chat.ids);
    // The template's end-of-sequence token ends a chat as EOS does, so ignore_eos ignores it
    // too (as vLLM, where it is the tokenizer's eos_token).
    if (!params.ignore_eos) {
      params.stop_token_ids.insert(params.stop_token_ids.end(), chat.stop_token_ids.begin(),
                                   chat.stop_token_ids.end());
    }
  } else if (request.prompt_is_ids) {
    ids = request.prompt_ids;
  } else {
    check_prompt_bytes(request.prompt_text.size(), request.endpoint);
    try {
      ids = tokenizer.encode(request.prompt_text, options.add_special_tokens);
    } catch (const Error& e) {
      throw ApiError(400, std::string("the prompt cannot be tokenized: ") + e.what(),
                     "invalid_request_error", "prompt");
    }
  }
  if (ids.empty()) throw ApiError(400, "the prompt is empty", "invalid_request_error", "prompt");
  const int64_t vocab = engine_->model_config().vocab_size;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab) {
      throw ApiError(400,
                     "token id " + std::to_string(id) + " is outside the vocabulary of " +
                         std::to_string(vocab),
                     "invalid_request_error", "prompt");
    }
  }
  return ids;
}

std::shared_ptr<Channel> Server::submit(std::vector<int32_t> prompt,
                                        const GenerationParams& params) {
  if (draining_)
    throw ApiError(503, "the server is shutting down", "unavailable", "", "shutting_down");
  const int64_t limit = max_in_flight();
  int64_t current = in_flight_.load();
  do {
    if (current >= limit) {
      throw ApiError(429,
                     "too many requests in flight (" + std::to_string(limit) + "); retry later",
                     "rate_limit_error", "", "queue_full");
    }
  } while (!in_flight_.compare_exchange_weak(current, current + 1));
  auto channel = std::make_shared<Channel>();
  channel->max_tokens = params.max_tokens;
  channel->num_sequences = params.num_sequences;
  {
    std::lock_guard lock(inbox_mutex_);
    inbox_.push_back({std::move(prompt), params, channel});
  }
  inbox_cv_.notify_one();
  return channel;
}

void Server::handle_completion(const std::string& body, Endpoint endpoint, httplib::Response& res) {
  ApiRequest request;
  std::vector<int32_t> prompt;
  std::shared_ptr<Channel> channel;
  try {
    request = parse_request(body, endpoint, engine_->generation_defaults());
    resolve_tool_parser(request, tool_format_);
    check_model(request.model);
    GenerationParams& params = request.params;
    check_token_ids(params, engine_->model_config().vocab_size);
    prompt = prompt_ids(request, params, {});
    const int64_t n = static_cast<int64_t>(prompt.size());
    resolve_max_tokens(request, n, engine_->max_model_len(), config_.default_max_tokens);
    const int64_t block = engine_->config().block_size;
    if (params.max_tokens > engine_->num_kv_blocks() * block - n) {
      throw ApiError(413, "the request needs more KV cache than the server has (--kv-cache-mb)",
                     "invalid_request_error", request.max_tokens_field, "context_length_exceeded");
    }
    try {
      Sampler::validate(params.sampling);
    } catch (const Error& e) {
      throw ApiError(400, e.what());
    }
    channel = submit(prompt, params);
  } catch (const ApiError& e) {
    metrics_.count_rejected(e.status);
    send_error(res, e);
    return;
  }

  ResponseInfo info{.endpoint = endpoint,
                    .id = std::string(endpoint == Endpoint::kChat ? "chatcmpl-" : "cmpl-") +
                          std::to_string(created_) + "-" + std::to_string(next_response_id_++),
                    .created = static_cast<int64_t>(std::time(nullptr)),
                    .model = config_.model_name};
  auto choices = std::make_shared<ChoiceSet>(request, info, engine_->tokenizer(), std::move(prompt));
  access_log_.describe([channel, id = info.id](AccessEntry& e) {
    std::lock_guard lock(channel->mutex);
    e.id = id;
    e.prompt_tokens = channel->num_prompt_tokens;
    e.cached_tokens = channel->num_cached_tokens;
    e.output_tokens = channel->num_output_tokens;
    e.queue_seconds = channel->queue_seconds;
    e.ttft_seconds = channel->ttft_seconds;
    const ConnectionState* connection = ConnectionState::current();
    if (connection && connection->write_failure() == WriteFailure::kSendTimeout) {
      e.finish = "send_timeout";  // the client took its answer too slowly: cut, and aborted
    } else if (channel->summary) {
      e.finish = channel->summary->finish_reason;
    } else if (channel->error) {
      e.finish = "error";
    } else if (!channel->finished) {
      e.finish = "disconnected";  // a stream whose client left before its end
    }
  });

  if (!request.stream) {
    InFlight guard(in_flight_);
    // A client that left is looked for every second, as a stream's next write finds it: its
    // request is cancelled rather than run to max_tokens for nobody.
    const ConnectionState* connection = ConnectionState::current();
    auto next_look = Clock::now() + std::chrono::seconds(1);
    for (bool finished = false; !finished;) {
      if (Clock::now() >= next_look) {
        next_look = Clock::now() + std::chrono::seconds(1);
        if (!channel->cancel && connection && connection->client_left()) cancel(*channel);
      }
      std::deque<RequestOutput> outputs;
      {
        std::unique_lock lock(channel->mutex);
        channel->cv.wait_until(lock, next_look,
                               [&] { return !channel->outputs.empty() || channel->finished; });
        if (channel->error) {
          send_error(res, *channel->error);
          return;
        }
        outputs.swap(channel->outputs);
        finished = channel->finished && channel->outputs.empty();
      }
      for (const RequestOutput& out : outputs) choices->add(out);
    }
    send_json(res, 200, choices->response());
    return;
  }

  struct StreamState {
    std::shared_ptr<Channel> channel;
    std::shared_ptr<ChoiceSet> choices;
    bool include_usage = false;
    bool done = false;
  };
  auto state = std::make_shared<StreamState>();
  state->channel = channel;
  state->choices = choices;
  state->include_usage = request.include_usage;
  auto guard = std::make_shared<InFlight>(in_flight_);
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [state](size_t, httplib::DataSink& sink) {
        Channel& ch = *state->channel;
        std::deque<RequestOutput> outputs;
        std::optional<ApiError> error;
        bool finished = false;
        {
          std::unique_lock lock(ch.mutex);
          ch.cv.wait_for(lock, std::chrono::seconds(1),
                         [&] { return !ch.outputs.empty() || ch.finished; });
          outputs.swap(ch.outputs);
          finished = ch.finished;
          error = ch.error;
        }
        std::string data;
        for (const RequestOutput& out : outputs) {
          for (const json& chunk : state->choices->stream(out)) data += sse(chunk);
        }
        if (error) {
          data += sse(error_body(error->what(), error->type, error->param, error->code));
        }
        if (finished) {
          if (state->include_usage && !error) data += sse(state->choices->usage_chunk());
          data += "data: [DONE]\n\n";
        }
        // A comment line keeps idle streams probing the connection, so a client that left is
        // noticed even while its request waits in the queue.
        if (data.empty()) data = ": waiting\n\n";
        if (!sink.write(data.data(), data.size())) return false;
        if (finished) {
          state->done = true;
          sink.done();
        }
        return true;
      },
      [this, state, guard](bool) {
        if (!state->done) cancel(*state->channel);
      });
}

void Server::cancel(Channel& channel) {
  channel.cancel = true;
  {
    std::lock_guard lock(inbox_mutex_);  // no lost wake-up between test and wait
    cancel_pending_ = true;
  }
  inbox_cv_.notify_one();
}

void Server::engine_loop() {
  std::unordered_map<RequestId, std::shared_ptr<Channel>> live;
  while (true) {
    std::deque<Pending> incoming;
    bool stopping = false;
    {
      std::unique_lock lock(inbox_mutex_);
      const auto ready = [&] {
        return stop_engine_ || !inbox_.empty() || ranks_.has_unfinished() || cancel_pending_ ||
               abort_all_;
      };
      // Idle under expert parallelism: the other ranks join a round every kIdleRoundPeriod.
      if (ranks_.distributed()) {
        inbox_cv_.wait_for(lock, kIdleRoundPeriod, ready);
      } else {
        inbox_cv_.wait(lock, ready);
      }
      stopping = stop_engine_;
      if (stopping && inbox_.empty() && !ranks_.has_unfinished()) break;
      incoming.swap(inbox_);
    }
    for (Pending& p : incoming) {
      if (p.channel->cancel || stopping) {
        p.channel->fail(ApiError(503, "cancelled before it started", "unavailable"));
        continue;
      }
      try {
        const RequestId id = ranks_.add_request(std::move(p.prompt), p.params);
        live.emplace(id, p.channel);
      } catch (const std::exception& e) {
        p.channel->fail(ApiError(400, e.what()));
      }
    }
    const bool abort_all = abort_all_ || stopping;
    if (cancel_pending_.exchange(false) || abort_all) {
      for (auto& [id, ch] : live) {
        if ((ch->cancel || abort_all) && !ch->abort_sent) {
          ranks_.abort_request(id);
          ch->abort_sent = true;
          ch->shutdown_abort = !ch->cancel;
        }
      }
    }
    if (ranks_.has_unfinished() || ranks_.distributed()) {
      std::vector<RequestOutput> outputs;
      const auto step_start = Clock::now();
      try {
        outputs = ranks_.step();
      } catch (const std::exception& e) {
        if (ranks_.distributed()) {
          // The other ranks wait inside this step's collectives: only ending the job frees them
          // (mpirun ends every rank when one exits without finalising MPI).
          std::fprintf(stderr, "moeinfer serve: engine step failed on rank 0: %s\n", e.what());
          std::_Exit(1);
        }
        // A failed step must not take the server down: end every live request and free its
        // blocks, then carry on with the next requests.
        std::fprintf(stderr, "moeinfer serve: engine step failed: %s\n", e.what());
        for (auto& [id, ch] : live) engine_->abort_request(id);
        outputs = engine_->step();  // only the aborts: nothing is left to schedule
        for (auto& [id, ch] : live)
          ch->fail(ApiError(500, std::string("engine failure: ") + e.what(), "internal_error"));
        live.clear();
      }
      // A rank's engine refused a request that rank 0's engine accepted.
      for (RankRefusal& refusal : ranks_.take_refused()) {
        if (const auto it = live.find(refusal.id); it != live.end()) {
          it->second->fail(ApiError(400, refusal.message));
          live.erase(it);
        }
      }
      // Before any output reaches its client: a client that has its response sees the
      // counters of the step that made it.
      publish_engine_stats();
      const auto now = Clock::now();
      // Queue time ends with the step that first scheduled a request (vLLM's WAITING phase).
      for (auto& [id, ch] : live) {
        if (!ch->started && ranks_.has_started(id)) note_started(*ch, step_start);
      }
      for (RequestOutput& out : outputs) {
        const auto it = live.find(out.id);
        if (it == live.end()) continue;
        Channel& ch = *it->second;
        const bool finished = out.finished();
        if (!out.token_ids.empty()) {
          // Finished in the step that first scheduled it: has_started no longer knows it.
          if (!ch.started) note_started(ch, step_start);
          note_token(metrics_, ch, out, now);
        }
        if (finished) {
          if (!ch.started) note_started(ch, now);  // aborted while it waited
          FinishedRequest summary = finished_request(ch, out, now);
          metrics_.observe_finished(summary);
          std::lock_guard lock(ch.mutex);
          if (ch.num_prompt_tokens < 0) ch.num_prompt_tokens = out.num_prompt_tokens;
          ch.summary = std::move(summary);
        }
        if (finished && ch.shutdown_abort && out.finish == FinishReason::kAbort) {
          // Cut short by the server, not finished: an error, not finish_reason "abort".
          ch.fail(ApiError(503,
                           "the server shut down before the request finished (--shutdown-grace " +
                               seconds_text(milliseconds_of(config_.shutdown_grace_seconds)) +
                               ")",
                           "unavailable", "", "shutting_down"));
          live.erase(it);
          continue;
        }
        ch.push(std::move(out));
        if (finished) live.erase(it);
      }
    } else {
      publish_engine_stats();
    }
  }
  ranks_.stop();  // the other ranks leave follow_rank_zero() and exit
}

void Server::publish_engine_stats() {
  metrics_.set_engine_stats(ranks_.stats());
  if (!ranks_.distributed()) return;
  std::vector<RankFigures> figures;
  for (const RankStatus& status : ranks_.ranks()) {
    figures.push_back({.num_running = status.load.num_running,
                       .num_waiting = status.load.num_waiting,
                       .num_assigned = status.num_assigned,
                       .kv_used = status.load.kv_used,
                       .kv_blocks = status.load.kv_blocks,
                       .network_bytes = status.load.network_bytes});
  }
  metrics_.set_rank_figures(std::move(figures));
}

void Server::shutdown() {
  {
    std::lock_guard lock(shutdown_mutex_);
    shutdown_requested_ = true;
  }
  shutdown_cv_.notify_all();
}

void Server::shutdown_loop() {
  {
    std::unique_lock lock(shutdown_mutex_);
    shutdown_cv_.wait(lock, [&] { return shutdown_requested_; });
  }
  draining_ = true;
  const auto wait_idle = [this](double limit_seconds) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(limit_seconds);
    while (in_flight_ > 0 && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return in_flight_ == 0;
  };
  if (!wait_idle(config_.shutdown_grace_seconds)) {
    std::fprintf(stderr, "moeinfer serve: aborting %lld requests still in flight\n",
                 static_cast<long long>(in_flight_.load()));
    {
      std::lock_guard lock(inbox_mutex_);
      abort_all_ = true;
    }
    inbox_cv_.notify_all();
    wait_idle(10.0);
  }
  http_->stop();
}

void Server::run() {
  engine_thread_ = std::thread([this] { engine_loop(); });
  shutdown_thread_ = std::thread([this] { shutdown_loop(); });
  std::fprintf(
      stderr,
      "moeinfer serve: model %s on http://%s:%d (max context %lld, %lld KV blocks of %lld)\n",
      config_.model_name.c_str(), config_.host.c_str(), config_.port,
      static_cast<long long>(engine_->max_model_len()),
      static_cast<long long>(engine_->num_kv_blocks()),
      static_cast<long long>(engine_->config().block_size));
  std::fprintf(stderr, "moeinfer serve: request defaults from generation_config: %s\n",
               engine_->generation_defaults().describe().c_str());
  const bool loopback = config_.host == "localhost" || config_.host == "::1" ||
                        config_.host.rfind("127.", 0) == 0;
  if (!loopback && config_.api_key.empty()) {
    std::fprintf(stderr,
                 "moeinfer serve: warning: listening on %s beyond loopback without --api-key: "
                 "anyone who reaches this host can use the model\n",
                 config_.host.c_str());
  }
  std::optional<EngineLogger> engine_logger;
  engine_logger.emplace(metrics_, config_.log_interval_seconds);
  const bool ok = http_->listen_after_bind();
  engine_logger.reset();
  shutdown();  // when listen ended on its own, let the shutdown thread finish too
  if (shutdown_thread_.joinable()) shutdown_thread_.join();
  {
    std::lock_guard lock(inbox_mutex_);
    stop_engine_ = true;
  }
  inbox_cv_.notify_all();
  engine_thread_.join();
  MOE_CHECK(ok || draining_, "the HTTP listener stopped unexpectedly");
}

}  // namespace moeinfer::server

#endif  // MOE_HAVE_HTTPLIB
