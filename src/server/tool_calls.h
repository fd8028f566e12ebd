// Tool calls in chat completions, as vLLM's OpenAI server does them: the `tools` a request
// offers, its `tool_choice`, and the calls a model writes into its output parsed back out, one
// parser per format (named as vLLM's --tool-call-parser names them):
//
//   hermes       Qwen3-MoE, Qwen2-MoE     <tool_call>{"name": ..., "arguments": {...}}</tool_call>
//   mistral      Mixtral                  [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
//   deepseek_v3  DeepSeek-V2 / V3 / R1    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function
//                                         <｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>
//                                         ...<｜tool▁calls▁end｜>
//
// OLMoE's template has no tool-call format, so it has no parser unless the server is told one.
//
// Rules, the same for every format (docs/serving.md, "Tools"):
// - no start marker in the output: no tool call, the whole output is the content;
// - otherwise every call must parse (its JSON valid, a string name): then the calls, in order,
//   and the content is the text before the first marker (null when empty); text after the first
//   marker that is not a call is dropped, as vLLM drops it;
// - one call that does not parse (malformed JSON, no name, a call cut off by max_tokens): no tool
//   call at all, the whole output is the content.
// Streamed (ToolCallStream), content before the first marker is sent as it comes, holding back
// only what could still be the start of a marker; each call is sent in one piece (id, type,
// name and the whole arguments) once it is complete, so no markup ever reaches delta.content.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/json_schema_grammar.h"

namespace moeinfer::server {

enum class ToolCallFormat { kNone, kHermes, kMistral, kDeepSeekV3 };

// vLLM's --tool-call-parser names: "hermes", "mistral", "deepseek_v3" (also "deepseekv3", its
// older spelling); "none" is kNone. nullopt for any other name.
std::optional<ToolCallFormat> tool_call_format_from_name(std::string_view name);
const char* tool_call_format_name(ToolCallFormat format);  // "none" for kNone
// "hermes, mistral, deepseek_v3", for messages and --help.
std::string tool_call_format_names();
// The format a family's chat template writes calls in (config.json's model_type): hermes for
// qwen3_moe and qwen2_moe, mistral for mixtral, deepseek_v3 for deepseek_v2 and deepseek_v3,
// none for olmoe and anything else.
ToolCallFormat default_tool_call_format(std::string_view model_type);
// Whether the format's markers are special tokens that decoding must keep (vLLM turns
// skip_special_tokens off for the mistral parser; DeepSeek's tool tokens are added tokens too).
bool tool_call_format_needs_special_tokens(ToolCallFormat format);

struct ToolCall {
  std::string id;  // chatcmpl-tool-<32 hex>; mistral: 9 letters and digits
  std::string name;
  std::string arguments;  // JSON text
  bool operator==(const ToolCall&) const = default;
};

// Tool call ids as vLLM makes them: "chatcmpl-tool-" and 32 random hex digits, or for mistral
// 9 random letters and digits (Mistral's templates refuse other ids).
class ToolCallIds {
 public:
  ToolCallIds();                        // seeded from std::random_device
  explicit ToolCallIds(uint64_t seed);  // for tests
  std::string next(ToolCallFormat format);

 private:
  std::mt19937_64 rng_;
};

struct ParsedToolCalls {
  std::optional<std::string> content;  // null: nothing is left besides the calls
  std::vector<ToolCall> calls;         // empty: no tool call (content is the whole output)
};

// A whole output (non-streamed responses). kNone returns the output as content.
ParsedToolCalls parse_tool_calls(ToolCallFormat format, std::string_view output, ToolCallIds& ids);

// The streamed form of parse_tool_calls: feed the output's text as it comes. Whatever the split,
// the content and calls that come out are those one push of the whole output gives, and they
// equal parse_tool_calls' unless a call that does not parse follows calls already sent (those
// stand; the rest of the output then comes as content).
class ToolCallStream {
 public:
  ToolCallStream(ToolCallFormat format, ToolCallIds* ids);

  struct Delta {
    std::string content;          // for delta.content ("" for none)
    std::vector<ToolCall> calls;  // complete calls, numbered on from first_index
    int64_t first_index = 0;
    bool empty() const { return content.empty() && calls.empty(); }
  };
  Delta push(std::string_view text);
  // The output has ended: a last call without its closing marker is parsed now; text held back
  // is released.
  Delta finish();
  int64_t num_calls() const { return num_calls_; }  // calls sent so far

 private:
  enum class State { kText, kTools, kPlain };
  Delta step(bool at_end);

  ToolCallFormat format_;
  ToolCallIds* ids_;
  State state_ = State::kText;
  std::string pending_;  // kText: not yet sent (a possible marker prefix); kTools: the tool part
  size_t consumed_ = 0;  // kTools: bytes of pending_ already turned into calls
  int64_t num_calls_ = 0;
};

// The tool_choice of a request.
struct ToolChoice {
  enum class Mode { kNone, kAuto, kRequired, kNamed };
  Mode mode = Mode::kNone;
  std::string name;  // kNamed: the function
};

// vLLM's tools as its request model dumps them for the chat template: each
// {"type": "function", "function": {"name", "description", "parameters", ...}}, description and
// parameters null where not given, other fields kept after them. Throws ApiError (400, naming
// tools[i]...) on a malformed tool.
nlohmann::ordered_json normalize_tools(const nlohmann::ordered_json& tools);
// "none", "auto", "required" or {"type": "function", "function": {"name": ...}}; given tools
// (normalize_tools' output, possibly null). Throws ApiError (400, param tool_choice).
ToolChoice parse_tool_choice(const nlohmann::ordered_json& value,
                             const nlohmann::ordered_json& tools);

// tool_choice "required" or a named function: the output is forced by constrained decoding,
// as vLLM forces it with guided decoding, instead of being parsed for a format's markers.
inline bool tool_choice_is_forced(const ToolChoice& choice) {
  return choice.mode == ToolChoice::Mode::kRequired || choice.mode == ToolChoice::Mode::kNamed;
}
// The JSON schema the forced output must follow: a named function's `parameters` (the output is
// its arguments), or for "required" an array of at least one
// {"name": one of the tools, "parameters": that tool's parameters} (vLLM's schema).
nlohmann::ordered_json tool_choice_json_schema(const ToolChoice& choice,
                                               const nlohmann::ordered_json& tools);
// That schema compiled for the sampler (null unless forced). Throws ApiError (400, param
// tool_choice) when a tool's parameters use what the grammar cannot follow; the message names
// the keyword and its place.
std::shared_ptr<const JsonGrammar> tool_choice_grammar(const ToolChoice& choice,
                                                       const nlohmann::ordered_json& tools);
// The calls a constrained output stands for: for a named function one call with the output as
// its arguments; for "required" one per array element. Empty when the output does not parse
// (cut off by max_tokens).
std::vector<ToolCall> tool_calls_from_forced_output(const ToolChoice& choice,
                                                    std::string_view output, ToolCallIds& ids);

// A call as OpenAI's message.tool_calls[i] has it: {id, type: "function", function: {name,
// arguments}}; with an index for a stream delta's tool_calls[i].
nlohmann::json tool_call_json(const ToolCall& call);
nlohmann::json tool_call_delta_json(const ToolCall& call, int64_t index);

}  // namespace moeinfer::server
