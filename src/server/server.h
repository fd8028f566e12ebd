// The OpenAI-compatible HTTP server. One engine thread runs Engine::step() for as long as there
// is work; HTTP threads (cpp-httplib's pool) parse and check requests, tokenize, and hand each
// request to the engine thread through an inbox, then wait on the request's own channel for its
// outputs (streamed as server-sent events, or gathered into one response). Nothing but the
// engine thread touches the engine.
//
// Limits: at most max_num_seqs + max_queue requests are in flight; more get 429. A client that
// goes away mid-stream cancels its request, which frees its KV blocks at the next step.
// Shutdown (SIGTERM): new requests get 503, requests in flight finish (or are aborted after the
// grace period), then the listener closes and run() returns.
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
#include "runtime/engine.h"
#include "server/metrics.h"
#include "server/openai_api.h"

namespace httplib {
class Server;
struct Response;
}  // namespace httplib

namespace moeinfer::server {

struct ServerConfig {
  std::string host = "127.0.0.1";
  int port = 8000;               // 0: any free port (see Server::port())
  std::string api_key;           // empty: no authentication
  std::string model_name;        // the id clients use in "model"
  int64_t max_queue = 256;       // requests waiting beyond the running batch
  int64_t num_http_threads = 0;  // 0: enough for every request in flight plus a few
  double shutdown_grace_seconds = 30.0;
  int64_t default_max_tokens = 16;  // completions without max_tokens (OpenAI's default)
};

struct Channel;

class Server {
 public:
  Server(std::unique_ptr<Engine> engine, ChatConfig chat, const ServerConfig& config);
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
  // 404 unless `model` is empty or the served model's name.
  void check_model(const std::string& model) const;
  // Runs `handler`, answering an ApiError it throws as an OpenAI error object (and counting it).
  void answer(httplib::Response& res, const std::function<void()>& handler);
  std::shared_ptr<Channel> submit(std::vector<int32_t> prompt, const GenerationParams& params);
  void engine_loop();
  void shutdown_loop();

  std::unique_ptr<Engine> engine_;
  ChatConfig chat_;
  std::unique_ptr<ChatTemplate> template_;
  std::mutex template_mutex_;
  ServerConfig config_;
  std::unique_ptr<httplib::Server> http_;
  Metrics metrics_;
  int64_t created_ = 0;

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
  std::thread engine_thread_;
  std::thread shutdown_thread_;
  std::mutex shutdown_mutex_;
  std::condition_variable shutdown_cv_;
  bool shutdown_requested_ = false;
};

}  // namespace moeinfer::server
