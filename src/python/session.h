// What the Python module's LLM runs on: one Engine over a checkpoint, the checkpoint's chat
// template and tool-call format, and the loop that takes a batch of requests through
// Engine::step() (the continuous batching the server uses) to their ends. Plain C++, no Python
// types: module.cpp converts, this decides.
#pragma once

#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "io/chat_template.h"
#include "profile/routing_trace.h"
#include "runtime/chat_prompt.h"
#include "runtime/engine.h"
#include "server/tool_calls.h"

namespace moeinfer::python {

// One sequence of a request, gathered over the steps that produced it.
struct SequenceResult {
  int64_t index = 0;
  std::string text;
  std::vector<int32_t> token_ids;      // [num_output_tokens]
  std::vector<TokenLogprob> logprobs;  // [num_output_tokens] when asked for, else empty
  double cumulative_logprob = 0.0;     // sum of the sampled tokens' logprobs (when kept)
  FinishReason finish = FinishReason::kNone;
};

struct RequestResult {
  std::vector<int32_t> prompt_token_ids;      // [T]
  std::vector<TokenLogprob> prompt_logprobs;  // [T - 1] with prompt_logprobs, else empty
  std::vector<SequenceResult> sequences;      // [num_sequences], by index
  int64_t num_cached_tokens = 0;              // prompt tokens found in the prefix cache
};

// Thrown by Session::run when `should_stop` said so, after every request was aborted.
class Stopped : public std::exception {
 public:
  const char* what() const noexcept override { return "generation stopped"; }
};

class Session {
 public:
  // tool_call_parser: a format of server/tool_calls.h by vLLM's name, "none", or empty for the
  // model family's (default_tool_call_format); anything else throws.
  Session(std::unique_ptr<Engine> engine, ChatConfig chat, const std::string& tool_call_parser);

  // Loads the checkpoint folder onto config.device (Engine::load) with its chat config.
  static std::unique_ptr<Session> load(const std::filesystem::path& dir, const EngineConfig& config,
                                       const std::string& tool_call_parser);

  Engine& engine() { return *engine_; }
  const Engine& engine() const { return *engine_; }
  server::ToolCallFormat tool_format() const { return tool_format_; }
  bool has_chat_template() const { return template_ != nullptr; }

  // A conversation as the engine runs it: `messages` (a JSON array of {role, content, ...})
  // rendered by the checkpoint's chat template with `tools` (OpenAI's tools array, or null) and
  // `template_kwargs` (more template variables, an object), tokenised as the server does it;
  // `params` gain the template's end-of-turn stop token, with tools the grammar that forces a
  // "required" or named tool_choice (null: OpenAI's default, auto with tools), and with the
  // format's markers being special tokens, skip_special_tokens off so that they can be read
  // back. Throws moeinfer::Error without a template or when the template fails,
  // server::ApiError for malformed tools or tool_choice.
  struct ChatRequest {
    std::vector<int32_t> prompt;  // [T]
    GenerationParams params;
    server::ToolChoice tool_choice;
    bool read_tool_calls = false;  // whether outputs are read for tool calls
  };
  ChatRequest prepare_chat(const nlohmann::ordered_json& messages,
                           const nlohmann::ordered_json& tools,
                           const nlohmann::ordered_json& tool_choice, bool add_generation_prompt,
                           const nlohmann::ordered_json& template_kwargs,
                           GenerationParams params) const;

  // Every prompt as one request of the engine, all queued before the first step so that they
  // share steps; runs Engine::step() until each has finished. should_stop is asked after every
  // step: when it says true, every request is aborted (their KV blocks freed) and Stopped is
  // thrown. An error of the engine aborts the requests too and reaches the caller. All requests
  // are checked before any is queued, so a bad one leaves the engine untouched.
  // Records every MoE layer's routing of every later forward pass (generate, chat, score) to
  // the routing-trace file `path` (profile/routing_trace.h; one step per engine step);
  // an empty path stops and closes the file. A trace already open is closed first.
  void trace_routing(const std::string& path);

  // Engine::score, recorded by trace_routing as one step per chunk.
  void score(std::span<const int32_t> ids, std::span<float> logits);

  std::vector<RequestResult> run(const std::vector<std::vector<int32_t>>& prompts,
                                 const std::vector<GenerationParams>& params,
                                 const std::function<bool()>& should_stop);

 private:
  // Aborts `ids` and steps until the engine has nothing left (their final outputs dropped).
  void abort_all(const std::vector<RequestId>& ids);
  // One engine step; with a trace, the records it made close one trace step.
  std::vector<RequestOutput> step();

  std::unique_ptr<Engine> engine_;
  ChatConfig chat_;
  std::unique_ptr<ChatTemplate> template_;
  server::ToolCallFormat tool_format_ = server::ToolCallFormat::kNone;
  std::unique_ptr<RoutingTraceWriter> trace_;
};

// Tool calls of one chat output, as the server reads them: with tool_choice "required" or a
// named function the forced JSON, else the format's markers (kNone: none). Returns
// {"content": text or null, "tool_calls": [OpenAI tool_call objects]}; tool_calls is empty
// when the output holds none (content is then the whole output).
nlohmann::ordered_json read_tool_calls(server::ToolCallFormat format,
                                       const server::ToolChoice& choice, const std::string& output,
                                       server::ToolCallIds& ids);

}  // namespace moeinfer::python
