// The OpenAI-compatible HTTP server. One engine thread runs Engine::step() for as long as there
// is work; HTTP threads (cpp-httplib's pool) parse and check requests, tokenize, and hand each
// request to the engine thread through an inbox, then wait on the request's own channel for its
// outputs (streamed as server-sent events, or gathered into one response). Nothing but the
// engine thread touches the engine.
//
// Limits: at most max_num_seqs + max_queue requests are in flight; more get 429. A client that
// goes away mid-stream cancels its request, which frees its KV blocks at the next step.
// Shutdown (SIGTERM): new requests get 503, requests in flight finish (or end with a 503 error
// after the grace period), then the listener closes and run() returns. How connections are read
// (deadlines, body limits, pipelining) is http_connection.h's.
//
// Under expert parallelism (--ep N) this is rank 0: the engine thread drives every rank's engine
// through runtime/engine_ranks.h (each request runs on one rank, each step is a round of all of
// them) and the other ranks run follow_rank_zero(); everything above is unchanged.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "io/chat_template.h"
#include "parallel/communicator.h"
#include "runtime/engine.h"
#include "runtime/engine_ranks.h"
#include "server/metrics.h"
#include "server/openai_api.h"
#include "server/serving_log.h"

namespace httplib {
struct Request;
struct Response;
class ContentReader;
}  // namespace httplib

namespace moeinfer::server {

class HttpServer;  // http_connection.h

struct ServerConfig {
  std::string host = "127.0.0.1";
  int port = 8000;         // 0: any free port (see Server::port())
  std::string api_key;     // empty: no authentication
  std::string model_name;  // the id clients use in "model"
  // --tool-call-parser: a format of server/tool_calls.h by vLLM's name ("none" included); empty:
  // the model family's (default_tool_call_format).
  std::string tool_call_parser;
  int64_t max_queue = 256;       // requests waiting beyond the running batch
  int64_t num_http_threads = 0;  // 0: enough for every request in flight plus a few
  double shutdown_grace_seconds = 30.0;
  int64_t default_max_tokens = 16;  // completions without max_tokens (OpenAI's default)
  // Slow senders: the request line and headers must arrive within header_timeout of their first
  // byte, the body within body_timeout of the headers' end (per request, not per recv()).
  double header_timeout_seconds = 10.0;
  double body_timeout_seconds = 60.0;
  // ... and after a grace period at min_request_rate bytes a second on average (0: no minimum).
  double min_request_rate = 500.0;
  double min_request_rate_grace_seconds = 5.0;
  // Slow readers: what is written must be taken by the client within this (0: no bound).
  double send_timeout_seconds = 30.0;
  // Host header names (port ignored) the server answers; empty: any. Others get 421.
  std::vector<std::string> allowed_hosts;
  bool log_requests = true;            // one access-log line per request (serving_log.h)
  double log_interval_seconds = 10.0;  // the periodic engine line; 0: none
};

struct Channel;

class Server {
 public:
  // expert_parallel: the job whose rank 0 this is (each rank's engine expert-parallel over it),
  // or null for one process.
  Server(std::unique_ptr<Engine> engine, ChatConfig chat, const ServerConfig& config,
         parallel::Communicator* expert_parallel = nullptr);
  ~Server();

  // Binds host:port; returns the bound port. Throws moeinfer::Error when the port is taken.
  int bind();
  // Serves until shutdown() completes; returns after the engine thread has stopped.
  void run();
  // Thread-safe, returns at once: refuse new requests, let the ones in flight finish (abort them
  // after the grace period), then stop the listener.
  void shutdown();

 private:
  void install_routes();
  // A POST route whose handler gets the body, read by http_connection.h's read_body (bounded
  // while it is read, chunked or not); a body that cannot be read is answered here.
  using BodyHandler = std::function<void(const std::string& body, httplib::Response& res)>;
  void post(const std::string& pattern, BodyHandler handler);
  // False after answering a body that could not be read (too large, too slow, malformed).
  bool read_request_body(const httplib::Request& req, httplib::Response& res,
                         const httplib::ContentReader& reader, std::string* body);
  // The error object for the HTTP layer's own refusals (cpp-httplib's, or the connection's
  // deadlines and limits), counted as rejected.
  void answer_http_error(const httplib::Request& req, httplib::Response& res);
  // 401 / 421 before routing; true when the request was answered.
  bool refuse_before_routing(const httplib::Request& req, httplib::Response& res);
  void handle_completion(const std::string& body, Endpoint endpoint, httplib::Response& res);
  // The prompt's token ids, with the chat template applied for chat; throws ApiError.
  // How a request's prompt becomes token ids: completions prompts get the tokenizer's special
  // tokens, chat messages the template's generation prompt (vLLM's /tokenize can turn either
  // off).
  struct PromptOptions {
    bool add_special_tokens = true;
    bool add_generation_prompt = true;
  };
  std::vector<int32_t> prompt_ids(const ApiRequest& request, GenerationParams& params,
                                  const PromptOptions& options);
  // 400 when a prompt's text is longer than max-model-len tokens could be, before it is
  // tokenised (a 16 MiB prompt would otherwise be tokenised in full only to be refused).
  void check_prompt_bytes(size_t bytes, Endpoint endpoint) const;
  // 404 unless `model` is empty or the served model's name.
  void check_model(const std::string& model) const;
  // Runs `handler`, answering an ApiError it throws as an OpenAI error object (and counting it).
  void answer(httplib::Response& res, const std::function<void()>& handler);
  std::shared_ptr<Channel> submit(std::vector<int32_t> prompt, const GenerationParams& params);
  // The client of `channel`'s request left: the engine thread aborts it at its next turn.
  void cancel(Channel& channel);
  void engine_loop();
  void shutdown_loop();
  // The engines' figures to the metrics (per rank under expert parallelism).
  void publish_engine_stats();
  // Requests in flight at most: the running batches of every rank plus the queue.
  int64_t max_in_flight() const;

  std::unique_ptr<Engine> engine_;
  EngineRanks ranks_;  // every rank's engine (only engine_ in one process); engine thread only
  ChatConfig chat_;
  std::unique_ptr<ChatTemplate> template_;
  std::mutex template_mutex_;
  ServerConfig config_;
  std::unique_ptr<HttpServer> http_;
  Metrics metrics_;
  AccessLog access_log_;
  int64_t created_ = 0;
  int64_t max_prompt_bytes_ = 0;  // see check_prompt_bytes

  // Inbox: requests for the engine thread.
  struct Pending {
    std::vector<int32_t> prompt;
    GenerationParams params;
    std::shared_ptr<Channel> channel;
  };
  std::mutex inbox_mutex_;
  std::condition_variable inbox_cv_;
  std::deque<Pending> inbox_;
  bool stop_engine_ = false;
  std::atomic<bool> abort_all_{false};
  std::atomic<bool> cancel_pending_{false};  // some channel asked to cancel

  std::atomic<int64_t> in_flight_{0};
  std::atomic<bool> draining_{false};
  std::atomic<uint64_t> next_response_id_{1};
  ToolCallFormat tool_format_ = ToolCallFormat::kNone;  // what chat outputs are parsed for
  std::thread engine_thread_;
  std::thread shutdown_thread_;
  std::mutex shutdown_mutex_;
  std::condition_variable shutdown_cv_;
  bool shutdown_requested_ = false;
};

}  // namespace moeinfer::server
