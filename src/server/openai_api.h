// The OpenAI wire format: request bodies of /v1/completions and /v1/chat/completions parsed and
// checked into typed values, and the JSON of responses, stream chunks and error objects. No HTTP
// and no engine here, so every rule about the format lives in one place.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "io/tokenizer.h"
#include "runtime/request.h"

namespace moeinfer::server {

// An error the client caused, with its HTTP status and the OpenAI error fields.
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string message, std::string type = "invalid_request_error",
           std::string param = "", std::string code = "")
      : std::runtime_error(std::move(message)),
        status(status),
        type(std::move(type)),
        param(std::move(param)),
        code(std::move(code)) {}
  int status;
  std::string type, param, code;
};

// {"error": {"message", "type", "param", "code"}}; empty param / code become null.
nlohmann::json error_body(const std::string& message, const std::string& type,
                          const std::string& param, const std::string& code);

enum class Endpoint { kCompletions, kChat };

struct ApiRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;                // empty when not given
  std::string prompt_text;          // completions: a text prompt
  std::vector<int32_t> prompt_ids;  // completions: a prompt given as token ids
  bool prompt_is_ids = false;
  nlohmann::ordered_json messages;  // chat: [{role, content}] with text content
  GenerationParams params;          // max_tokens filled in by the server when not given
  bool max_tokens_given = false;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool echo = false;           // completions: prompt text before the completion
  bool chat_logprobs = false;  // chat: logprobs true
};

// Throws ApiError (400, naming the parameter) for wrong types and values out of range.
ApiRequest parse_request(const std::string& body, Endpoint endpoint);

// vLLM's POST /tokenize: {"prompt": text, "add_special_tokens": true} or {"messages": [...],
// "add_generation_prompt": true}; the request comes back as the completions or chat
// ApiRequest whose prompt would be tokenized so.
struct TokenizeRequest {
  ApiRequest request;
  bool add_special_tokens = true;  // prompt: the tokenizer's BOS/EOS template
  bool add_generation_prompt = true;  // messages
};
TokenizeRequest parse_tokenize_request(const std::string& body);
// vLLM's POST /detokenize: {"tokens": [ids]}; returns the ids (range against the vocabulary is
// the caller's).
std::vector<int32_t> parse_detokenize_request(const std::string& body, std::string* model);

// Per-response identity shared by every chunk of one response.
struct ResponseInfo {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string id;  // cmpl-... / chatcmpl-...
  int64_t created = 0;
  std::string model;
};

// Log probabilities in the endpoint's format, for the tokens of one output.
nlohmann::json logprobs_json(Endpoint endpoint, const Tokenizer& tokenizer,
                             const std::vector<TokenLogprob>& logprobs, int64_t text_offset);

nlohmann::json usage_json(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens);

// A whole (non-streamed) response.
nlohmann::json response_json(const ResponseInfo& info, const std::string& text,
                             const nlohmann::json& logprobs, const char* finish_reason,
                             const nlohmann::json& usage);
// One streamed chunk; `finish_reason` null until the last. For chat the first chunk carries the
// assistant role (`first`).
nlohmann::json chunk_json(const ResponseInfo& info, const std::string& text,
                          const nlohmann::json& logprobs, const char* finish_reason, bool first,
                          bool include_usage);
// The final usage-only chunk of a stream (stream_options.include_usage).
nlohmann::json usage_chunk_json(const ResponseInfo& info, const nlohmann::json& usage);

}  // namespace moeinfer::server
