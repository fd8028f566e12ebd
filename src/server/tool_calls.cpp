// Tool-call parsers (one scanner per format), the streaming state machine over them, and the
// request side of tools: their normal form, tool_choice, and the constrained-decoding hook.
#include "server/tool_calls.h"

#include <algorithm>

#include "core/error.h"
#include "io/jinja_value.h"
#include "server/openai_api.h"

namespace moeinfer::server {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

[[noreturn]] void bad(const std::string& param, const std::string& message) {
  throw ApiError(400, message, "invalid_request_error", param);
}

// The markers of each format. `start` opens the tool part of an output: the content is what
// comes before it.
constexpr std::string_view kHermesOpen = "<tool_call>";
constexpr std::string_view kHermesClose = "</tool_call>";
constexpr std::string_view kMistralStart = "[TOOL_CALLS]";
constexpr std::string_view kMistralArgs = "[ARGS]";  // tokenizer v11+
constexpr std::string_view kMistralCallId = "[CALL_ID]";
constexpr std::string_view kDeepSeekStart = "<｜tool▁calls▁begin｜>";
constexpr std::string_view kDeepSeekEnd = "<｜tool▁calls▁end｜>";
constexpr std::string_view kDeepSeekOpen = "<｜tool▁call▁begin｜>";
constexpr std::string_view kDeepSeekClose = "<｜tool▁call▁end｜>";
constexpr std::string_view kDeepSeekSep = "<｜tool▁sep｜>";

std::string_view start_marker(ToolCallFormat format) {
  switch (format) {
    case ToolCallFormat::kHermes:
      return kHermesOpen;
    case ToolCallFormat::kMistral:
      return kMistralStart;
    case ToolCallFormat::kDeepSeekV3:
      return kDeepSeekStart;
    case ToolCallFormat::kNone:
      break;
  }
  return {};
}

bool is_json_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

size_t skip_space(std::string_view s, size_t pos) {
  while (pos < s.size() && is_json_space(s[pos])) ++pos;
  return pos;
}

// json.dumps(value, ensure_ascii=False), as vLLM writes a call's arguments: Python's separators
// (", " and ": "), key order kept, floats as Python prints them.
std::string python_json(const ordered_json& value) {
  return jinja::to_json(jinja::Value::from_json(value), jinja::JsonOptions{});
}

std::optional<ordered_json> parse_json(std::string_view text) {
  ordered_json value = ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) return std::nullopt;
  return value;
}

// One call as written, before it has an id.
struct RawCall {
  std::string name, arguments;
  size_t end = 0;  // where it ends in the tool part
};

// {"name": "...", "arguments": ...}: the name must be a string and the arguments present (any
// JSON, written back as json.dumps writes it), as vLLM's hermes and mistral parsers want.
std::optional<RawCall> call_from_object(const ordered_json& object, size_t end) {
  if (!object.is_object()) return std::nullopt;
  const auto name = object.find("name");
  const auto arguments = object.find("arguments");
  if (name == object.end() || !name->is_string() || arguments == object.end()) return std::nullopt;
  return RawCall{name->get<std::string>(), python_json(*arguments), end};
}

// What a scanner found in the tool part (which starts with the format's start marker), from
// `from` on: the calls complete so far, or that one of them cannot be a call.
struct Scan {
  std::vector<RawCall> calls;
  bool malformed = false;
};

// <tool_call>{json}</tool_call> ..., text between calls dropped; at the end a call without its
// closing tag is parsed from what there is (vLLM's `<tool_call>(.*)` alternative).
Scan scan_hermes(std::string_view part, size_t from, bool at_end) {
  Scan scan;
  size_t pos = from;
  while (true) {
    const size_t open = part.find(kHermesOpen, pos);
    if (open == std::string_view::npos) break;
    const size_t body = open + kHermesOpen.size();
    const size_t close = part.find(kHermesClose, body);
    if (close == std::string_view::npos && !at_end) break;  // the call is still coming
    const size_t body_end = close == std::string_view::npos ? part.size() : close;
    const size_t end = close == std::string_view::npos ? part.size() : close + kHermesClose.size();
    const auto value = parse_json(part.substr(body, body_end - body));
    std::optional<RawCall> call = value ? call_from_object(*value, end) : std::nullopt;
    if (!call) {
      scan.malformed = true;
      break;
    }
    scan.calls.push_back(std::move(*call));
    pos = end;
  }
  return scan;
}

// Where the JSON value at `pos` ends: npos while it may still be coming, `error` set when its
// brackets cannot match. Strings and nesting are followed; the value's own validity is
// nlohmann's to judge afterwards.
size_t json_value_end(std::string_view s, size_t pos, bool at_end, bool* error) {
  *error = false;
  if (pos >= s.size()) return std::string_view::npos;
  const char first = s[pos];
  if (first != '{' && first != '[' && first != '"') {  // a number, true, false, null
    size_t end = pos;
    while (end < s.size() && !is_json_space(s[end]) && s[end] != ',' && s[end] != ']' &&
           s[end] != '}') {
      ++end;
    }
    return end == s.size() && !at_end ? std::string_view::npos : end;
  }
  std::string stack;
  bool in_string = false, escaped = false;
  for (size_t i = pos; i < s.size(); ++i) {
    const char c = s[i];
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
        if (stack.empty()) return i + 1;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      stack.push_back(c == '{' ? '}' : ']');
    } else if (c == '}' || c == ']') {
      if (stack.empty() || stack.back() != c) {
        *error = true;
        return std::string_view::npos;
      }
      stack.pop_back();
      if (stack.empty()) return i + 1;
    }
  }
  return std::string_view::npos;
}

// The JSON object that must start at `at`, with where it ends; nullopt, and scan.malformed set
// (for one still coming, only at the end of the output), when there is none.
std::optional<std::pair<ordered_json, size_t>> object_at(std::string_view part, size_t at,
                                                         bool at_end, Scan& scan) {
  if (at == part.size()) {
    scan.malformed = at_end;
    return std::nullopt;
  }
  bool error = false;
  const size_t end = part[at] == '{' ? json_value_end(part, at, at_end, &error) : at;
  if (part[at] != '{' || end == std::string_view::npos) {
    scan.malformed = part[at] != '{' || error || at_end;
    return std::nullopt;
  }
  auto value = parse_json(part.substr(at, end - at));
  if (!value) {
    scan.malformed = true;
    return std::nullopt;
  }
  return std::make_pair(std::move(*value), end);
}

bool is_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '-';
}

// `marker` at pos: 1 when it is there, 0 while what there is could still become it (not at the
// end), -1 when it is not.
int marker_at(std::string_view part, size_t pos, std::string_view marker, bool at_end) {
  const std::string_view rest = part.substr(pos);
  if (rest.starts_with(marker)) return 1;
  return !at_end && marker.starts_with(rest) ? 0 : -1;
}

// Tokenizer v11 and later (Mistral-Small-3.2, Magistral, Devstral):
// [TOOL_CALLS]NAME[ARGS]{...}[TOOL_CALLS]NAME[ARGS]{...}, one marker per call, the name as
// vLLM's parser takes it ([A-Za-z0-9_-]+), an optional [CALL_ID]ID between the name and [ARGS],
// and [ARGS] itself optional (mistral-common's decoding drops it: NAME{...}, which vLLM parses).
// The arguments must be a JSON object; text after the last call is dropped.
Scan scan_mistral_named(std::string_view part, size_t from, bool at_end) {
  Scan scan;
  size_t pos = from;
  while (true) {
    pos = skip_space(part, pos);
    if (pos == part.size()) {
      scan.malformed = at_end && from == 0 && scan.calls.empty();
      return scan;
    }
    const int start = marker_at(part, pos, kMistralStart, at_end);
    if (start == 0) return scan;  // maybe the next marker
    if (start < 0) {
      scan.malformed = from == 0 && scan.calls.empty();  // text after the calls is dropped
      return scan;
    }
    size_t at = skip_space(part, pos + kMistralStart.size());
    const size_t name_at = at;
    while (at < part.size() && is_name_char(part[at])) ++at;
    if (at == part.size()) {
      scan.malformed = at_end;  // the name is still coming, or cut off
      return scan;
    }
    if (at == name_at) {
      scan.malformed = true;
      return scan;
    }
    const std::string name(part.substr(name_at, at - name_at));
    for (const std::string_view optional : {kMistralCallId, kMistralArgs}) {
      const int found = marker_at(part, at, optional, at_end);
      if (found == 0) {
        scan.malformed = at_end;
        return scan;
      }
      if (found < 0) continue;
      at += optional.size();
      if (optional == kMistralCallId) {
        while (at < part.size() && is_name_char(part[at])) ++at;
      }
    }
    const auto arguments = object_at(part, skip_space(part, at), at_end, scan);
    if (!arguments) return scan;
    scan.calls.push_back(RawCall{name, python_json(arguments->first), arguments->second});
    pos = arguments->second;
  }
}

// [TOOL_CALLS] [{"name": ..., "arguments": ...}, ...]: the array may follow the marker directly
// or, as vLLM's fallback regex finds it, start at the first "[{" after it; text after the array
// is dropped. Each element is a call as soon as it is complete. A name right after the marker is
// the newer format (scan_mistral_named).
Scan scan_mistral(std::string_view part, size_t from, bool at_end) {
  // The newer format when a name right after the marker runs into [ARGS], [CALL_ID] or the
  // arguments' '{'; anything else after a name is text before an array (vLLM's fallback).
  size_t name_end = skip_space(part, kMistralStart.size());
  const size_t name_at = name_end;
  while (name_end < part.size() && is_name_char(part[name_end])) ++name_end;
  if (name_end > name_at) {
    if (name_end == part.size() && !at_end) return {};  // not decided yet
    const int args = marker_at(part, name_end, kMistralArgs, at_end);
    const int call_id = marker_at(part, name_end, kMistralCallId, at_end);
    if (args == 0 || call_id == 0) return {};
    if (args > 0 || call_id > 0 || name_end == part.size() || part[name_end] == '{') {
      return scan_mistral_named(part, from, at_end);
    }
  }
  Scan scan;
  size_t pos = from;
  if (from == 0) {
    pos = skip_space(part, kMistralStart.size());
    if (pos == part.size()) {
      scan.malformed = at_end;
      return scan;
    }
    if (part[pos] != '[') {
      pos = part.find("[{", pos);
      if (pos == std::string_view::npos) {
        scan.malformed = at_end;
        return scan;
      }
    }
  } else {
    // After a call: a comma and the next element, or the end of the array.
    pos = skip_space(part, from);
    if (pos == part.size()) return scan;  // at the end: the array's ']' is all that is missing
    if (part[pos] == ']') return scan;
    if (part[pos] != ',') {
      scan.malformed = true;
      return scan;
    }
  }
  ++pos;  // past '[' or ','
  while (true) {
    // An element: a {"name", "arguments"} object (not an empty array, not cut off).
    const auto value = object_at(part, skip_space(part, pos), at_end, scan);
    if (!value) return scan;
    const size_t end = value->second;
    std::optional<RawCall> call = call_from_object(value->first, end);
    if (!call) {
      scan.malformed = true;
      return scan;
    }
    scan.calls.push_back(std::move(*call));
    pos = skip_space(part, end);
    if (pos == part.size() || part[pos] == ']') return scan;
    if (part[pos] != ',') {
      scan.malformed = true;
      return scan;
    }
    ++pos;
  }
}

// <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜> ...
// until <｜tool▁calls▁end｜>; ARGS must be valid JSON and is kept as written (vLLM keeps it).
Scan scan_deepseek(std::string_view part, size_t from, bool at_end) {
  Scan scan;
  size_t pos = from;
  while (true) {
    const size_t open = part.find(kDeepSeekOpen, pos);
    const size_t done = part.find(kDeepSeekEnd, pos);
    if (open == std::string_view::npos || (done != std::string_view::npos && done < open)) break;
    const size_t body = open + kDeepSeekOpen.size();
    const size_t close = part.find(kDeepSeekClose, body);
    if (close == std::string_view::npos) {
      scan.malformed = at_end;  // cut off
      break;
    }
    const std::string_view text = part.substr(body, close - body);
    const size_t sep = text.find(kDeepSeekSep);
    const size_t name_at = sep == std::string_view::npos ? sep : sep + kDeepSeekSep.size();
    const size_t newline = sep == std::string_view::npos ? sep : text.find('\n', name_at);
    constexpr std::string_view kFence = "\n```json\n", kFenceEnd = "\n```";
    const bool shaped = newline != std::string_view::npos && text.substr(0, sep) == "function" &&
                        text.substr(newline, kFence.size()) == kFence &&
                        text.size() >= newline + kFence.size() + kFenceEnd.size() &&
                        text.ends_with(kFenceEnd) && newline > name_at;
    if (!shaped) {
      scan.malformed = true;
      break;
    }
    const size_t args_at = newline + kFence.size();
    const std::string_view args = text.substr(args_at, text.size() - kFenceEnd.size() - args_at);
    if (!parse_json(args)) {
      scan.malformed = true;
      break;
    }
    const size_t end = close + kDeepSeekClose.size();
    scan.calls.push_back(
        RawCall{std::string(text.substr(name_at, newline - name_at)), std::string(args), end});
    pos = end;
  }
  return scan;
}

Scan scan_calls(ToolCallFormat format, std::string_view part, size_t from, bool at_end) {
  switch (format) {
    case ToolCallFormat::kHermes:
      return scan_hermes(part, from, at_end);
    case ToolCallFormat::kMistral:
      return scan_mistral(part, from, at_end);
    case ToolCallFormat::kDeepSeekV3:
      return scan_deepseek(part, from, at_end);
    case ToolCallFormat::kNone:
      break;
  }
  return {};
}

// The longest end of `text` that is a proper beginning of `marker`: what must be held back.
size_t partial_marker_suffix(std::string_view text, std::string_view marker) {
  for (size_t n = std::min(text.size(), marker.size() - 1); n > 0; --n) {
    if (text.substr(text.size() - n) == marker.substr(0, n)) return n;
  }
  return 0;
}

}  // namespace

std::optional<ToolCallFormat> tool_call_format_from_name(std::string_view name) {
  if (name == "none") return ToolCallFormat::kNone;
  if (name == "hermes") return ToolCallFormat::kHermes;
  if (name == "mistral") return ToolCallFormat::kMistral;
  if (name == "deepseek_v3" || name == "deepseekv3") return ToolCallFormat::kDeepSeekV3;
  return std::nullopt;
}

const char* tool_call_format_name(ToolCallFormat format) {
  switch (format) {
    case ToolCallFormat::kHermes:
      return "hermes";
    case ToolCallFormat::kMistral:
      return "mistral";
    case ToolCallFormat::kDeepSeekV3:
      return "deepseek_v3";
    case ToolCallFormat::kNone:
      break;
  }
  return "none";
}

std::string tool_call_format_names() { return "hermes, mistral, deepseek_v3"; }

ToolCallFormat default_tool_call_format(std::string_view model_type) {
  if (model_type == "qwen3_moe" || model_type == "qwen2_moe") return ToolCallFormat::kHermes;
  if (model_type == "mixtral") return ToolCallFormat::kMistral;
  if (model_type == "deepseek_v2" || model_type == "deepseek_v3")
    return ToolCallFormat::kDeepSeekV3;
  return ToolCallFormat::kNone;
}

bool tool_call_format_needs_special_tokens(ToolCallFormat format) {
  return format == ToolCallFormat::kMistral || format == ToolCallFormat::kDeepSeekV3;
}

ToolCallIds::ToolCallIds() : rng_(std::random_device{}()) {}
ToolCallIds::ToolCallIds(uint64_t seed) : rng_(seed) {}

std::string ToolCallIds::next(ToolCallFormat format) {
  if (format == ToolCallFormat::kMistral) {
    static constexpr std::string_view kAlphanumeric =
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    std::string id(9, ' ');
    for (char& c : id) c = kAlphanumeric[rng_() % kAlphanumeric.size()];
    return id;
  }
  static constexpr std::string_view kHex = "0123456789abcdef";
  std::string id = "chatcmpl-tool-";
  for (int i = 0; i < 32; ++i) id += kHex[rng_() % 16];
  return id;
}

ParsedToolCalls parse_tool_calls(ToolCallFormat format, std::string_view output, ToolCallIds& ids) {
  ParsedToolCalls parsed;
  const std::string_view marker = start_marker(format);
  const size_t at = marker.empty() ? std::string_view::npos : output.find(marker);
  if (at == std::string_view::npos) {
    parsed.content = std::string(output);
    return parsed;
  }
  const Scan scan = scan_calls(format, output.substr(at), 0, /*at_end=*/true);
  if (scan.malformed || scan.calls.empty()) {
    parsed.content = std::string(output);
    return parsed;
  }
  if (at > 0) parsed.content = std::string(output.substr(0, at));
  for (const RawCall& raw : scan.calls) {
    parsed.calls.push_back(ToolCall{ids.next(format), raw.name, raw.arguments});
  }
  return parsed;
}

ToolCallStream::ToolCallStream(ToolCallFormat format, ToolCallIds* ids)
    : format_(format), ids_(ids) {
  if (format_ == ToolCallFormat::kNone) state_ = State::kPlain;
}

ToolCallStream::Delta ToolCallStream::push(std::string_view text) {
  pending_ += text;
  return step(/*at_end=*/false);
}

ToolCallStream::Delta ToolCallStream::finish() { return step(/*at_end=*/true); }

ToolCallStream::Delta ToolCallStream::step(bool at_end) {
  Delta delta;
  delta.first_index = num_calls_;
  if (state_ == State::kPlain) {
    delta.content = std::move(pending_);
    pending_.clear();
    return delta;
  }
  if (state_ == State::kText) {
    const std::string_view marker = start_marker(format_);
    const size_t at = pending_.find(marker);
    if (at == std::string::npos) {
      const size_t keep = at_end ? 0 : partial_marker_suffix(pending_, marker);
      delta.content = pending_.substr(0, pending_.size() - keep);
      pending_.erase(0, pending_.size() - keep);
      return delta;
    }
    delta.content = pending_.substr(0, at);
    pending_.erase(0, at);
    state_ = State::kTools;
    consumed_ = 0;
  }
  // kTools: pending_ is the tool part, calls up to consumed_ already sent.
  const Scan scan = scan_calls(format_, pending_, consumed_, at_end);
  for (const RawCall& raw : scan.calls) {
    delta.calls.push_back(ToolCall{ids_->next(format_), raw.name, raw.arguments});
    consumed_ = raw.end;
  }
  num_calls_ += static_cast<int64_t>(delta.calls.size());
  if (scan.malformed || (at_end && num_calls_ == 0)) {
    // Not calls after all: the output is text from here on. With no call sent the whole tool
    // part becomes content (as parse_tool_calls makes the whole output the content); after
    // calls already sent, what follows the last of them.
    state_ = State::kPlain;
    delta.content += pending_.substr(num_calls_ == 0 ? 0 : consumed_);
    pending_.clear();
  } else if (at_end) {
    pending_.clear();  // text after the calls is dropped, as in parse_tool_calls
  }
  return delta;
}

ordered_json normalize_tools(const ordered_json& tools) {
  if (tools.is_null()) return nullptr;
  if (!tools.is_array()) bad("tools", "'tools' must be an array of {\"type\": \"function\", ...}");
  ordered_json out = ordered_json::array();
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string where = "tools[" + std::to_string(i) + "]";
    const ordered_json& tool = tools[i];
    if (!tool.is_object()) bad(where, "'" + where + "' must be an object");
    const auto type = tool.find("type");
    if (type != tool.end() && !(type->is_string() && type->get<std::string>() == "function")) {
      bad(where + ".type", "'" + where + ".type' must be \"function\" (the only tool type)");
    }
    for (const auto& [key, value] : tool.items()) {
      if (key != "type" && key != "function")
        bad(where + "." + key, "'" + where + "." + key + "' is not a field of a function tool");
    }
    const auto fn = tool.find("function");
    if (fn == tool.end() || !fn->is_object())
      bad(where + ".function", "'" + where + ".function' must be an object");
    const auto name = fn->find("name");
    if (name == fn->end() || !name->is_string() || name->get<std::string>().empty())
      bad(where + ".function.name", "'" + where + ".function.name' must be a non-empty string");
    const auto description = fn->find("description");
    if (description != fn->end() && !description->is_null() && !description->is_string())
      bad(where + ".function.description", "'" + where + ".function.description' must be a string");
    const auto parameters = fn->find("parameters");
    if (parameters != fn->end() && !parameters->is_null() && !parameters->is_object())
      bad(where + ".function.parameters",
          "'" + where + ".function.parameters' must be a JSON schema object");
    // The declared fields first, then the others in the client's order (vLLM's model_dump).
    ordered_json function = ordered_json::object();
    function["name"] = *name;
    function["description"] = description != fn->end() ? *description : ordered_json(nullptr);
    function["parameters"] = parameters != fn->end() ? *parameters : ordered_json(nullptr);
    for (const auto& [key, value] : fn->items()) {
      if (key != "name" && key != "description" && key != "parameters") function[key] = value;
    }
    out.push_back({{"type", "function"}, {"function", std::move(function)}});
  }
  return out;
}

ToolChoice parse_tool_choice(const ordered_json& value, const ordered_json& tools) {
  const bool have_tools = tools.is_array() && !tools.empty();
  ToolChoice choice;
  if (value.is_null()) {
    choice.mode = have_tools ? ToolChoice::Mode::kAuto : ToolChoice::Mode::kNone;  // vLLM's default
    return choice;
  }
  const std::string accepted =
      "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
      "\"function\": {\"name\": ...}}";
  if (value.is_string()) {
    const std::string mode = value.get<std::string>();
    if (mode == "none") return choice;
    if (mode == "auto") {
      choice.mode = ToolChoice::Mode::kAuto;
    } else if (mode == "required") {
      choice.mode = ToolChoice::Mode::kRequired;
    } else {
      bad("tool_choice", accepted + ", got \"" + mode + "\"");
    }
  } else if (value.is_object()) {
    const auto type = value.find("type");
    const auto fn = value.find("function");
    if (type == value.end() || !type->is_string() || type->get<std::string>() != "function" ||
        fn == value.end() || !fn->is_object() || !fn->contains("name") ||
        !(*fn)["name"].is_string()) {
      bad("tool_choice", accepted);
    }
    // Anything more would be ignored: refused by name.
    for (const auto& [key, v] : value.items()) {
      if (key != "type" && key != "function")
        bad("tool_choice." + key, "'tool_choice." + key + "' is not supported; " + accepted);
    }
    for (const auto& [key, v] : fn->items()) {
      if (key != "name") {
        bad("tool_choice.function." + key,
            "'tool_choice.function." + key + "' is not supported; " + accepted);
      }
    }
    choice.mode = ToolChoice::Mode::kNamed;
    choice.name = (*fn)["name"].get<std::string>();
  } else {
    bad("tool_choice", accepted);
  }
  if (!have_tools) bad("tool_choice", "'tool_choice' other than \"none\" needs 'tools'");
  if (choice.mode == ToolChoice::Mode::kNamed) {
    const bool found = std::any_of(tools.begin(), tools.end(), [&](const ordered_json& t) {
      return t["function"]["name"] == choice.name;
    });
    if (!found)
      bad("tool_choice", "'tool_choice' names '" + choice.name + "', which is not in 'tools'");
  }
  return choice;
}

ordered_json tool_choice_json_schema(const ToolChoice& choice, const ordered_json& tools) {
  const auto parameters = [](const ordered_json& tool) {
    const ordered_json& p = tool["function"]["parameters"];
    return p.is_object() && !p.empty()
               ? p
               : ordered_json{{"type", "object"}, {"properties", ordered_json::object()}};
  };
  if (choice.mode == ToolChoice::Mode::kNamed) {
    for (const ordered_json& tool : tools) {
      if (tool["function"]["name"] == choice.name) return parameters(tool);
    }
    return nullptr;
  }
  if (choice.mode != ToolChoice::Mode::kRequired) return nullptr;
  ordered_json any_of = ordered_json::array();
  ordered_json defs = ordered_json::object();
  for (const ordered_json& tool : tools) {
    ordered_json p = parameters(tool);
    if (p.contains("$defs") && p["$defs"].is_object()) {
      for (const auto& [k, v] : p["$defs"].items()) defs[k] = v;
      p.erase("$defs");
    }
    any_of.push_back(
        {{"properties",
          {{"name",
            {{"type", "string"}, {"enum", ordered_json::array({tool["function"]["name"]})}}},
           {"parameters", std::move(p)}}},
         {"required", ordered_json::array({"name", "parameters"})}});
  }
  ordered_json schema = {{"type", "array"},
                         {"minItems", 1},
                         {"items", {{"type", "object"}, {"anyOf", std::move(any_of)}}}};
  if (!defs.empty()) schema["$defs"] = std::move(defs);
  return schema;
}

std::shared_ptr<const JsonGrammar> tool_choice_grammar(const ToolChoice& choice,
                                                       const ordered_json& tools) {
  if (!tool_choice_is_forced(choice)) return nullptr;
  ordered_json schema = tool_choice_json_schema(choice, tools);
  if (choice.mode == ToolChoice::Mode::kRequired) {
    // The grammar takes no 'type' beside 'anyOf'; the same items with the type moved into each
    // alternative accept the same values.
    ordered_json& items = schema["items"];
    for (ordered_json& alternative : items["anyOf"]) alternative["type"] = "object";
    items.erase("type");
  }
  const std::string what = choice.mode == ToolChoice::Mode::kRequired
                               ? std::string("tool_choice \"required\"")
                               : "tool_choice function '" + choice.name + "'";
  try {
    return JsonGrammar::from_schema(json::parse(schema.dump()));
  } catch (const Error& e) {
    // The schema is the tools' parameters (or vLLM's array around them): name the request field
    // that asked for the constraint, and the grammar's keyword and place.
    bad("tool_choice",
        "'tool_choice': the parameters of the tools cannot be followed by "
        "constrained decoding for " +
            what + ": " + e.what());
  }
}

std::vector<ToolCall> tool_calls_from_forced_output(const ToolChoice& choice,
                                                    std::string_view output, ToolCallIds& ids) {
  std::vector<ToolCall> calls;
  if (choice.mode == ToolChoice::Mode::kNamed) {
    if (parse_json(output))
      calls.push_back(ToolCall{ids.next(ToolCallFormat::kNone), choice.name, std::string(output)});
    return calls;
  }
  if (choice.mode != ToolChoice::Mode::kRequired) return calls;
  const auto value = parse_json(output);
  if (!value || !value->is_array()) return calls;
  for (const ordered_json& item : *value) {
    if (!item.is_object() || !item.contains("name") || !item["name"].is_string() ||
        !item.contains("parameters")) {
      return {};
    }
    calls.push_back(ToolCall{ids.next(ToolCallFormat::kNone), item["name"].get<std::string>(),
                             python_json(item["parameters"])});
  }
  return calls;
}

json tool_call_json(const ToolCall& call) {
  return {{"id", call.id},
          {"type", "function"},
          {"function", {{"name", call.name}, {"arguments", call.arguments}}}};
}

json tool_call_delta_json(const ToolCall& call, int64_t index) {
  json out = tool_call_json(call);
  out["index"] = index;
  return out;
}

}  // namespace moeinfer::server
