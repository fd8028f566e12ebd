// The OpenAI wire format: request bodies of /v1/completions and /v1/chat/completions parsed and
// checked into typed values, and the JSON of responses, stream chunks and error objects. No HTTP
// and no engine here, so every rule about the format lives in one place.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "io/generation_config.h"
#include "io/tokenizer.h"
#include "runtime/request.h"
#include "server/tool_calls.h"

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
  GenerationParams params;          // max_tokens filled in by resolve_max_tokens
  bool max_tokens_given = false;
  // The field max_tokens came from, for the errors about it: chat's max_completion_tokens when
  // given (it wins over max_tokens), else max_tokens.
  std::string max_tokens_field = "max_tokens";
  // generation_config.json's max_new_tokens: max_tokens is at most this, given or not (vLLM).
  std::optional<int64_t> max_tokens_cap;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  // completions: the prompt (text, or the ids decoded) before the completion; with logprobs the
  // prompt tokens carry theirs (the first one's null), and max_tokens may be 0.
  bool echo = false;
  bool chat_logprobs = false;  // chat: logprobs true
  int64_t n = 1;               // choices returned
  int64_t best_of = 1;         // sequences generated, the n of highest cumulative logprob kept
  // vLLM's prompt_logprobs extra field: -1 none; else per prompt token {id: {logprob, rank,
  // decoded_token}} with this many alternatives, the first token's entry null.
  int64_t prompt_logprobs = -1;
  // chat: the tools offered (normalize_tools' form; null when none), tool_choice (vLLM's default:
  // auto with tools, none without), parallel_tool_calls (false: at most the first call is
  // returned), and chat_template_kwargs, extra variables for the chat template.
  nlohmann::ordered_json tools;
  ToolChoice tool_choice;
  bool parallel_tool_calls = true;
  nlohmann::ordered_json chat_template_kwargs = nlohmann::ordered_json::object();
  // The parser run over the output (resolve_tool_parser): kNone leaves the text as the content.
  ToolCallFormat tool_parser = ToolCallFormat::kNone;
};

// Throws ApiError (400, naming the parameter) for wrong types and values out of range. Fields
// the request leaves out take `defaults` (the checkpoint's generation_config.json) where it has
// them, else the OpenAI defaults.
ApiRequest parse_request(const std::string& body, Endpoint endpoint,
                         const GenerationDefaults& defaults = {});

// Throws ApiError (400, naming `logit_bias` or `stop_token_ids`) for a token id those fields
// give outside a vocabulary of `vocab_size` tokens: the engine would refuse a biased one without
// naming the field, and a stop id that can never be sampled would be silently ignored.
void check_token_ids(const GenerationParams& params, int64_t vocab_size);

// Sets request.params.max_tokens once the prompt's length is known: the given value, checked
// against the context, or the default (completions: min(default_completion_tokens, room),
// chat: the rest of the context), capped by max_tokens_cap. Throws ApiError: 413 for a prompt
// that fills the context, 400 for a max_tokens past it.
void resolve_max_tokens(ApiRequest& request, int64_t num_prompt_tokens, int64_t context,
                        int64_t default_completion_tokens);

// Chooses the tool-call parser of a chat request once the server's format is known (the model
// family's, or --tool-call-parser): with tools and tool_choice "auto" the output is parsed for
// calls (and special tokens are kept where the format's markers are special tokens);
// "required" and a named function need no parser (parse_request set their grammar, the
// output is forced JSON). Throws ApiError (400, param tool_choice) for "auto" when the server
// has no parser (as vLLM without --tool-call-parser).
void resolve_tool_parser(ApiRequest& request, ToolCallFormat server_format);

// vLLM's POST /tokenize: {"prompt": text, "add_special_tokens": true} or {"messages": [...],
// "add_generation_prompt": true, "tools": [...], "chat_template_kwargs": {...}}; the request
// comes back as the completions or chat ApiRequest whose prompt would be tokenized so.
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

// A token's text alone as valid UTF-8 (a token may hold part of a character: U+FFFD stands for
// the missing bytes), as logprobs' decoded_token shows it.
std::string token_text(const Tokenizer& tokenizer, int32_t id);

// Log probabilities in the endpoint's format, for the tokens of one output. Completions: token i's
// text_offset (in characters, as the OpenAI API counts it: a Python client indexes the returned
// text with it) is text_offset plus the characters the tokens before it add to the returned text
// (decoded with skip_special_tokens, as that text is: a skipped special token adds none), while
// `tokens` shows every token's own text.
nlohmann::json logprobs_json(Endpoint endpoint, const Tokenizer& tokenizer,
                             const std::vector<TokenLogprob>& logprobs, int64_t text_offset,
                             bool skip_special_tokens);

nlohmann::json usage_json(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens);

// A whole (non-streamed) response.
nlohmann::json response_json(const ResponseInfo& info, const std::string& text,
                             const nlohmann::json& logprobs, const char* finish_reason,
                             const nlohmann::json& usage);
// One streamed chunk of choice 0; `finish_reason` null until the last. For chat the first chunk
// carries the assistant role (`first`).
nlohmann::json chunk_json(const ResponseInfo& info, const std::string& text,
                          const nlohmann::json& logprobs, const char* finish_reason, bool first,
                          bool include_usage);
// The final usage-only chunk of a stream (stream_options.include_usage).
nlohmann::json usage_chunk_json(const ResponseInfo& info, const nlohmann::json& usage);

// A request's choices built from the engine's outputs for it (RequestOutput::index is the
// choice): n of them, or with best_of > n the n sequences of highest cumulative logprob,
// renumbered 0..n-1 in that order. The echoed prompt, with its logprobs, comes first in each
// choice; `prompt` is the request's token ids.
class ChoiceSet {
 public:
  ChoiceSet(const ApiRequest& request, ResponseInfo info, const Tokenizer& tokenizer,
            std::vector<int32_t> prompt);

  // Non-streamed: every output of the request, in the order the engine gave them.
  void add(const RequestOutput& out);
  // The whole response, once the output with `last` was added.
  nlohmann::json response() const;

  // Streamed (best_of = n): the chunks one output makes; a choice's first output brings the
  // assistant role (chat) or the echoed prompt (completions) first.
  std::vector<nlohmann::json> stream(const RequestOutput& out);
  // The final usage-only chunk (stream_options.include_usage).
  nlohmann::json usage_chunk() const;
  nlohmann::json usage() const;

 private:
  struct Choice {
    std::string text;
    std::optional<ToolCallStream> tool_stream;  // streamed with a tool parser
    std::vector<TokenLogprob> logprobs;
    double cumulative_logprob = 0.0;
    FinishReason finish = FinishReason::kNone;
    int64_t num_output_tokens = 0;
    bool started = false;       // streamed: its first chunk was made
    int64_t stream_offset = 0;  // streamed: text_offset of its next token
  };
  // The choices returned, by sequence: all, or the n best of best_of.
  std::vector<int64_t> returned() const;
  nlohmann::json choice_logprobs(const Choice& c, bool with_echo, int64_t text_offset) const;
  nlohmann::json echo_logprobs_json() const;    // completions logprobs of the prompt's tokens
  nlohmann::json prompt_logprobs_json() const;  // vLLM's prompt_logprobs list
  // chat: the message of a whole choice, its tool calls parsed out with a tool parser; sets
  // `called` when it has some.
  nlohmann::json message_json(const Choice& c, bool* called) const;
  // The same for a forced tool_choice: the calls its JSON stands for, content null.
  nlohmann::json forced_message_json(const std::string& text, bool* called) const;
  // A choice's finish_reason given whether it called tools (null while it runs).
  const char* tool_finish_reason(FinishReason finish, bool called) const;

  Endpoint endpoint_;
  ResponseInfo info_;
  const Tokenizer& tokenizer_;
  std::vector<int32_t> prompt_;
  std::string echo_;  // the prompt's text when echoed
  bool skip_special_tokens_ = true;  // how the returned text was decoded (its text_offsets)
  int64_t n_ = 1;
  bool want_logprobs_ = false;
  bool echo_logprobs_ = false;  // echo with logprobs: the prompt tokens' too
  int64_t prompt_logprobs_ = -1;
  bool include_usage_ = false;
  std::vector<Choice> choices_;             // [best_of]
  std::vector<TokenLogprob> prompt_entries_;  // [prompt tokens - 1] from the engine
  int64_t num_prompt_tokens_ = 0, num_cached_tokens_ = 0;
  ToolCallFormat tool_parser_ = ToolCallFormat::kNone;
  int64_t max_tool_calls_ = INT64_MAX;          // 1 without parallel_tool_calls
  ToolChoice forced_tool_choice_;               // chat, "required" or a named function; else kNone
  std::unique_ptr<ToolCallIds> tool_call_ids_;  // behind a pointer: the streams hold it
};

}  // namespace moeinfer::server
