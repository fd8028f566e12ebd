#include "server/openai_api.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <set>
#include <string>

#include "io/unicode.h"
#include "server/response_format.h"

namespace moeinfer::server {
namespace {

using json = nlohmann::json;

[[noreturn]] void bad(const std::string& param, const std::string& message) {
  throw ApiError(400, message, "invalid_request_error", param);
}

// Optional field readers: absent or null leaves `out` alone; a wrong type is a 400 naming it.
bool read_bool(const json& body, const char* key, bool& out) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return false;
  if (!it->is_boolean()) bad(key, std::string("'") + key + "' must be a boolean");
  out = it->get<bool>();
  return true;
}

bool read_int(const json& body, const char* key, int64_t& out) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return false;
  if (it->is_number_integer() || it->is_number_unsigned()) {
    if (it->is_number_unsigned() && it->get<uint64_t>() > uint64_t{INT64_MAX}) {
      bad(key, std::string("'") + key + "' is out of range");
    }
    out = it->get<int64_t>();
    return true;
  }
  if (it->is_number_float()) {
    const double v = it->get<double>();
    if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 9e15) {
      out = static_cast<int64_t>(v);
      return true;
    }
  }
  bad(key, std::string("'") + key + "' must be an integer");
}

bool read_float(const json& body, const char* key, float& out, double lo, double hi) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return false;
  if (!it->is_number()) bad(key, std::string("'") + key + "' must be a number");
  const double v = it->get<double>();
  if (!(v >= lo && v <= hi)) {
    bad(key, std::string("'") + key + "' must be in [" + std::to_string(lo) + ", " +
                 std::to_string(hi) + "], got " + it->dump());
  }
  out = static_cast<float>(v);
  return true;
}

std::string message_text(const json& content, size_t index) {
  const std::string param = "messages[" + std::to_string(index) + "].content";
  if (content.is_string()) return content.get<std::string>();
  if (content.is_null()) return "";
  if (!content.is_array()) bad(param, "'content' must be a string or an array of text parts");
  if (content.empty()) bad(param, "'" + param + "' must not be an empty array");
  std::string text;
  for (size_t j = 0; j < content.size(); ++j) {
    const json& part = content[j];
    const bool text_part = part.is_object() && part.contains("type") && part["type"].is_string() &&
                           part["type"].get<std::string>() == "text" && part.contains("text") &&
                           part["text"].is_string();
    if (!text_part) {
      bad(param, "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported");
    }
    for (const auto& [key, value] : part.items()) {  // e.g. cache_control: would be ignored
      if (key != "type" && key != "text") {
        const std::string at = param + "[" + std::to_string(j) + "]." + key;
        bad(at, "'" + at + "' is not supported by this server");
      }
    }
    text += part["text"].get<std::string>();
  }
  return text;
}

// logit_bias: {"token id": bias}; biases are clamped to [-100, 100] as vLLM does, token ids
// checked against the vocabulary by the engine.
void parse_logit_bias(const json& body, SamplingParams& s) {
  const auto it = body.find("logit_bias");
  if (it == body.end() || it->is_null()) return;
  if (!it->is_object()) bad("logit_bias", "'logit_bias' must be an object of token id -> bias");
  if (it->size() > 1024) bad("logit_bias", "'logit_bias' takes at most 1024 tokens");
  for (const auto& [key, value] : it->items()) {
    int64_t id = -1;
    const bool digits = !key.empty() && key.size() <= 10 &&
                        key.find_first_not_of("0123456789") == std::string::npos;
    if (digits) id = std::stoll(key);
    if (!digits || id > INT32_MAX)
      bad("logit_bias", "'logit_bias' keys must be token ids, got '" + key + "'");
    if (!value.is_number() || !std::isfinite(value.get<double>()))
      bad("logit_bias", "'logit_bias' values must be numbers, got " + value.dump());
    const double bias = std::clamp(value.get<double>(), -100.0, 100.0);
    s.logit_bias.emplace_back(static_cast<int32_t>(id), static_cast<float>(bias));
  }
}

void parse_sampling(const json& body, ApiRequest& r, const GenerationDefaults& defaults) {
  GenerationParams& g = r.params;
  SamplingParams& s = g.sampling;
  // What the request leaves out: the checkpoint's generation_config.json, else OpenAI's.
  s.temperature = defaults.temperature.value_or(1.0f);
  s.top_p = defaults.top_p.value_or(1.0f);
  s.top_k = defaults.top_k.value_or(0);
  s.min_p = defaults.min_p.value_or(0.0f);
  s.repetition_penalty = defaults.repetition_penalty.value_or(1.0f);
  r.max_tokens_cap = defaults.max_tokens;
  read_float(body, "temperature", s.temperature, 0.0, 2.0);
  read_float(body, "top_p", s.top_p, 0.0, 1.0);
  if (s.top_p <= 0.0f) bad("top_p", "'top_p' must be in (0, 1]");
  int64_t top_k = 0;
  if (read_int(body, "top_k", top_k)) {
    if (top_k < -1) bad("top_k", "'top_k' must be -1 (no limit) or >= 0");
    s.top_k = top_k < 0 ? 0 : top_k;
  }
  read_float(body, "min_p", s.min_p, 0.0, 1.0);
  read_float(body, "repetition_penalty", s.repetition_penalty, 1e-6, 100.0);
  read_float(body, "presence_penalty", s.presence_penalty, -2.0, 2.0);
  read_float(body, "frequency_penalty", s.frequency_penalty, -2.0, 2.0);
  parse_logit_bias(body, s);
  int64_t seed = 0;
  if (read_int(body, "seed", seed)) {
    s.seed = static_cast<uint64_t>(seed);
    g.has_seed = true;
  }
  if (read_int(body, "n", r.n) && (r.n < 1 || r.n > kMaxSequencesPerRequest))
    bad("n", "'n' must be in [1, " + std::to_string(kMaxSequencesPerRequest) + "]");
  r.best_of = r.n;
  if (read_int(body, "best_of", r.best_of) &&
      (r.best_of < r.n || r.best_of > kMaxSequencesPerRequest)) {
    bad("best_of", "'best_of' must be in [n, " + std::to_string(kMaxSequencesPerRequest) +
                       "], got " + std::to_string(r.best_of) + " with n = " + std::to_string(r.n));
  }
  if (r.stream && r.best_of > r.n) bad("best_of", "'best_of' > 'n' cannot be streamed");
  g.num_sequences = r.best_of;
  g.score_sequences = r.best_of > r.n;

  // max_tokens (chat also takes max_completion_tokens); range against the context is checked
  // once the prompt length is known (resolve_max_tokens). 0 is for scoring a prompt: echo.
  // Both given (chat): max_completion_tokens, OpenAI's replacement for the deprecated
  // max_tokens, as vLLM takes it.
  int64_t max_tokens = 0, max_completion_tokens = 0;
  const bool plain = read_int(body, "max_tokens", max_tokens);
  const bool completion = r.endpoint == Endpoint::kChat &&
                          read_int(body, "max_completion_tokens", max_completion_tokens);
  if (completion) max_tokens = max_completion_tokens;
  if (plain || completion) {
    const std::string field = completion ? "max_completion_tokens" : "max_tokens";
    const int64_t least = r.echo ? 0 : 1;
    if (max_tokens < least) {
      bad(field, "'" + field + "' must be >= " + std::to_string(least) +
                     (r.echo ? "" : " (0 only with echo)") + ", got " + std::to_string(max_tokens));
    }
    g.max_tokens = max_tokens;
    r.max_tokens_given = true;
    r.max_tokens_field = field;
  }

  if (const auto it = body.find("stop"); it != body.end() && !it->is_null()) {
    if (it->is_string()) {
      g.stop.push_back(it->get<std::string>());
    } else if (it->is_array()) {
      for (const json& s : *it) {
        if (!s.is_string()) bad("stop", "'stop' must be a string or an array of strings");
        g.stop.push_back(s.get<std::string>());
      }
    } else {
      bad("stop", "'stop' must be a string or an array of strings");
    }
    if (g.stop.size() > 16) bad("stop", "at most 16 stop strings");
    for (const std::string& s : g.stop) {
      if (s.empty()) bad("stop", "stop strings must not be empty");
    }
  }
  if (const auto it = body.find("stop_token_ids"); it != body.end() && !it->is_null()) {
    if (!it->is_array()) bad("stop_token_ids", "'stop_token_ids' must be an array of integers");
    for (const json& id : *it) {
      if (!id.is_number_integer())
        bad("stop_token_ids", "'stop_token_ids' must be an array of integers");
      // Range-checked before narrowing: 2^40 must not become some other token's id.
      if (id.is_number_unsigned() ? id.get<uint64_t>() > uint64_t{INT32_MAX}
                                  : id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
        bad("stop_token_ids", "stop token id " + id.dump() + " is out of range");
      g.stop_token_ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
    }
  }
  read_bool(body, "ignore_eos", g.ignore_eos);
  read_bool(body, "include_stop_str_in_output", g.include_stop_str_in_output);
  read_bool(body, "skip_special_tokens", g.skip_special_tokens);

  // Log probabilities: completions take an integer, chat a boolean plus top_logprobs.
  if (r.endpoint == Endpoint::kCompletions) {
    int64_t lp = -1;
    if (read_int(body, "logprobs", lp)) {
      if (lp < 0 || lp > 20) bad("logprobs", "'logprobs' must be in [0, 20]");
      g.logprobs = lp;
    }
  } else {
    read_bool(body, "logprobs", r.chat_logprobs);
    int64_t top = 0;
    if (read_int(body, "top_logprobs", top)) {
      if (top < 0 || top > 20) bad("top_logprobs", "'top_logprobs' must be in [0, 20]");
      if (!r.chat_logprobs) bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    }
    if (r.chat_logprobs) g.logprobs = top;
  }
  // vLLM's prompt_logprobs; echo with logprobs scores the prompt at the same depth.
  if (read_int(body, "prompt_logprobs", r.prompt_logprobs)) {
    if (r.prompt_logprobs < 0 || r.prompt_logprobs > 20)
      bad("prompt_logprobs", "'prompt_logprobs' must be in [0, 20]");
    if (r.stream && r.prompt_logprobs > 0)
      bad("prompt_logprobs", "'prompt_logprobs' are not available when 'stream' is true");
  }
  g.prompt_logprobs = r.prompt_logprobs;
  if (r.echo && g.logprobs >= 0) g.prompt_logprobs = std::max(g.prompt_logprobs, g.logprobs);
  // echo with max_tokens 0 asks for the prompt only: the engine runs it as a scored prompt.
  if (r.echo && r.max_tokens_given && g.max_tokens == 0) {
    g.prompt_logprobs = std::max<int64_t>(g.prompt_logprobs, 0);
  }
}

// The request fields this server honours, per endpoint; anything else a client sends is refused
// with a 400 naming it rather than ignored. `user` (an end-user id for the caller's own abuse
// monitoring) is accepted and has no effect here.
using FieldSet = std::set<std::string, std::less<>>;

const FieldSet kCommonFields = {
    "model", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "n",
    "best_of", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output",
    "skip_special_tokens", "logprobs", "prompt_logprobs", "user", "response_format",
    "guided_json"};
const FieldSet kCompletionFields = {"prompt", "echo", "suffix"};
const FieldSet kChatFields = {"messages",    "max_completion_tokens", "top_logprobs",
                              "tools",       "tool_choice",           "parallel_tool_calls",
                              "chat_template_kwargs"};
const FieldSet kMessageFields = {"role", "content", "name", "tool_calls", "tool_call_id"};
const FieldSet kMessageRoles = {"system", "developer", "user", "assistant", "tool"};
const FieldSet kPromptField = {"prompt"};
const FieldSet kChatTokenizeFields = {"messages", "tools", "chat_template_kwargs"};

// A 400 for the first key of `object` in neither set; `where` prefixes the param it names.
void refuse_unknown_fields(const json& object, const FieldSet& fields, const FieldSet& more_fields,
                           const std::string& where) {
  for (const auto& [key, value] : object.items()) {
    if (fields.count(key) || more_fields.count(key)) continue;
    const std::string param = where.empty() ? key : where + "." + key;
    bad(param, "'" + param + "' is not supported by this server (the fields it honours are " +
                   "listed in docs/serving.md)");
  }
}

using ordered_json = nlohmann::ordered_json;

// An assistant message's tool_calls as the chat template wants them (vLLM's
// _postprocess_messages): {id, type, function: {name, arguments}} with the arguments a JSON value,
// parsed from the string the API carries ("" or absent: {}). An empty list is dropped.
ordered_json message_tool_calls(const ordered_json& calls, const std::string& where) {
  if (!calls.is_array()) bad(where, "'" + where + "' must be an array of tool calls");
  ordered_json out = ordered_json::array();
  for (size_t j = 0; j < calls.size(); ++j) {
    const std::string at = where + "[" + std::to_string(j) + "]";
    const ordered_json& call = calls[j];
    if (!call.is_object() || !call.contains("function") || !call["function"].is_object())
      bad(at, "'" + at + "' must be {\"id\", \"type\": \"function\", \"function\": {...}}");
    const ordered_json& fn = call["function"];
    if (!fn.contains("name") || !fn["name"].is_string())
      bad(at + ".function.name", "'" + at + ".function.name' must be a string");
    // Fields the template is not given are refused rather than dropped, except a streamed
    // call's index (clients paste the deltas they joined back), which the list order carries:
    // it must then be that order.
    for (const auto& [key, value] : call.items()) {
      if (key == "index") {
        if (!value.is_number_integer() || value.get<int64_t>() != static_cast<int64_t>(j))
          bad(at + ".index",
              "'" + at + ".index' must be the call's position, " + std::to_string(j));
      } else if (key != "id" && key != "type" && key != "function") {
        bad(at + "." + key, "'" + at + "." + key + "' is not a field of a tool call");
      }
    }
    for (const auto& [key, value] : fn.items()) {
      if (key != "name" && key != "arguments") {
        bad(at + ".function." + key,
            "'" + at + ".function." + key + "' is not a field of a tool call's function");
      }
    }
    ordered_json arguments = ordered_json::object();
    if (const auto a = fn.find("arguments"); a != fn.end() && !a->is_null()) {
      if (a->is_string()) {
        if (!a->get<std::string>().empty()) {
          arguments = ordered_json::parse(a->get<std::string>(), nullptr, false);
          if (arguments.is_discarded())
            bad(at + ".function.arguments",
                "'" + at + ".function.arguments' must be a JSON text (the call's arguments)");
        }
      } else if (a->is_object()) {
        arguments = *a;
      } else {
        bad(at + ".function.arguments", "'" + at + ".function.arguments' must be a string");
      }
    }
    ordered_json entry = ordered_json::object();
    if (const auto id = call.find("id"); id != call.end() && !id->is_null()) {
      if (!id->is_string()) bad(at + ".id", "'" + at + ".id' must be a string");
      entry["id"] = *id;
    }
    if (const auto type = call.find("type"); type != call.end() && !type->is_null() &&
                                             *type != "function") {
      bad(at + ".type", "'" + at + ".type' must be \"function\"");
    }
    entry["type"] = "function";
    entry["function"] = {{"name", fn["name"]}, {"arguments", std::move(arguments)}};
    out.push_back(std::move(entry));
  }
  return out;
}

// chat_template_kwargs: an object of extra template variables; `messages` and `tools` are the
// request's own fields and cannot be replaced through it.
ordered_json template_kwargs(const ordered_json& value) {
  if (value.is_null()) return ordered_json::object();
  if (!value.is_object())
    bad("chat_template_kwargs",
        "'chat_template_kwargs' must be an object of template variables, got " +
            std::string(value.type_name()));
  for (const char* reserved : {"messages", "tools"}) {
    if (value.contains(reserved)) {
      bad(std::string("chat_template_kwargs.") + reserved,
          std::string("'chat_template_kwargs' cannot set '") + reserved +
              "'; use the request's own field");
    }
  }
  return value;
}

}  // namespace

json error_body(const std::string& message, const std::string& type, const std::string& param,
                const std::string& code) {
  return {{"error",
           {{"message", message},
            {"type", type},
            {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code.empty() ? json(nullptr) : json(code)}}}};
}

namespace {

json parse_object(const std::string& text) {
  json body;
  try {
    body = json::parse(text);
  } catch (const json::exception& e) {  // syntax errors and numbers out of range (1e400)
    throw ApiError(400, std::string("the request body is not valid JSON: ") + e.what());
  }
  if (!body.is_object()) bad("", "the request body must be a JSON object");
  return body;
}

std::string read_model(const json& body) {
  const auto it = body.find("model");
  if (it == body.end() || it->is_null()) return "";
  if (!it->is_string()) bad("model", "'model' must be a string");
  return it->get<std::string>();
}

}  // namespace

TokenizeRequest parse_tokenize_request(const std::string& text) {
  const json body = parse_object(text);
  const bool chat = body.contains("messages");
  refuse_unknown_fields(body, {"model", "add_special_tokens", "add_generation_prompt"},
                        chat ? kChatTokenizeFields : kPromptField, "");
  TokenizeRequest t;
  const bool special_given = read_bool(body, "add_special_tokens", t.add_special_tokens);
  const bool generation_given = read_bool(body, "add_generation_prompt", t.add_generation_prompt);
  // Each option applies to one form; given to the other it would be ignored. A chat's text is
  // tokenized as a chat request's is, without special tokens added (the template writes them).
  if (!chat && generation_given)
    bad("add_generation_prompt", "'add_generation_prompt' applies to 'messages', not 'prompt'");
  if (chat && special_given && t.add_special_tokens) {
    bad("add_special_tokens",
        "'add_special_tokens' must be false with 'messages': the chat template writes the "
        "special tokens");
  }
  // Key order kept: the tools' schemas reach the template as the client wrote them.
  const ordered_json ordered = ordered_json::parse(text);
  ordered_json inner = ordered_json::object();
  for (const char* key : {"model", "prompt", "messages", "tools", "chat_template_kwargs"}) {
    if (ordered.contains(key)) inner[key] = ordered[key];
  }
  if (!chat && !inner.contains("prompt")) bad("prompt", "'prompt' or 'messages' is required");
  t.request = parse_request(inner.dump(), chat ? Endpoint::kChat : Endpoint::kCompletions);
  return t;
}

std::vector<int32_t> parse_detokenize_request(const std::string& text, std::string* model) {
  const json body = parse_object(text);
  refuse_unknown_fields(body, {"model", "tokens"}, {}, "");
  *model = read_model(body);
  const auto it = body.find("tokens");
  if (it == body.end() || !it->is_array()) bad("tokens", "'tokens' must be an array of token ids");
  std::vector<int32_t> ids;
  for (const json& id : *it) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
      bad("tokens", "'tokens' must be an array of token ids");
    ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
  }
  return ids;
}

ApiRequest parse_request(const std::string& text, Endpoint endpoint,
                         const GenerationDefaults& defaults) {
  const json body = parse_object(text);
  refuse_unknown_fields(body, kCommonFields,
                        endpoint == Endpoint::kCompletions ? kCompletionFields : kChatFields, "");
  ApiRequest r;
  r.endpoint = endpoint;
  r.model = read_model(body);
  // Accepted without effect, but held to its type as OpenAI holds it.
  if (const auto it = body.find("user"); it != body.end() && !it->is_null() && !it->is_string())
    bad("user", "'user' must be a string");
  read_bool(body, "stream", r.stream);
  if (const auto it = body.find("stream_options"); it != body.end() && !it->is_null()) {
    if (!it->is_object()) bad("stream_options", "'stream_options' must be an object");
    // Its options shape the stream's chunks: without a stream they would be ignored.
    if (!r.stream) bad("stream_options", "'stream_options' is only allowed when 'stream' is true");
    for (const auto& [key, value] : it->items()) {
      if (key != "include_usage") {
        bad("stream_options", "'stream_options." + key + "' is not supported by this server");
      }
    }
    read_bool(*it, "include_usage", r.include_usage);
  }

  if (endpoint == Endpoint::kCompletions) {
    const auto it = body.find("prompt");
    if (it == body.end() || it->is_null()) bad("prompt", "'prompt' is required");
    const json* prompt = &*it;
    // A list holding one prompt is taken as that prompt.
    if (prompt->is_array() && prompt->size() == 1 &&
        ((*prompt)[0].is_string() || (*prompt)[0].is_array())) {
      prompt = &(*prompt)[0];
    }
    if (prompt->is_string()) {
      r.prompt_text = prompt->get<std::string>();
      if (r.prompt_text.empty()) bad("prompt", "'prompt' must not be empty");
    } else if (prompt->is_array() && !prompt->empty()) {
      for (const json& id : *prompt) {
        if (!id.is_number_integer()) {
          bad("prompt",
              "'prompt' must be a string, a list of token ids, or a list of one of those "
              "(several prompts per request are not supported)");
        }
        const int64_t v = id.get<int64_t>();
        if (v < 0 || v > INT32_MAX)
          bad("prompt", "token id " + std::to_string(v) + " is out of range");
        r.prompt_ids.push_back(static_cast<int32_t>(v));
      }
      r.prompt_is_ids = true;
    } else {
      bad("prompt", "'prompt' must be a non-empty string or list of token ids");
    }
    if (const auto s = body.find("suffix"); s != body.end() && !s->is_null()) {
      bad("suffix", "'suffix' is not supported");
    }
  } else {
    const auto it = body.find("messages");
    if (it == body.end() || !it->is_array() || it->empty()) {
      bad("messages", "'messages' must be a non-empty array");
    }
    // Tools, template variables and the arguments of earlier tool calls keep the client's key
    // order (a tool's schema reaches the model as written): they come from an order-keeping
    // parse of the body, made only when the request has any of them.
    bool ordered_needed = body.contains("tools") || body.contains("chat_template_kwargs");
    for (const json& m : *it) ordered_needed |= m.is_object() && m.contains("tool_calls");
    const ordered_json ordered = ordered_needed ? ordered_json::parse(text) : ordered_json();
    r.messages = nlohmann::ordered_json::array();
    for (size_t i = 0; i < it->size(); ++i) {
      const json& m = (*it)[i];
      const std::string where = "messages[" + std::to_string(i) + "]";
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
        bad(where, "each message needs a string 'role'");
      }
      refuse_unknown_fields(m, kMessageFields, {}, where);
      const std::string role = m["role"].get<std::string>();
      // OpenAI's roles: another would reach the template as it is, a message the model was
      // never trained on, where OpenAI answers 400.
      if (!kMessageRoles.count(role)) {
        bad(where + ".role", "'" + where + ".role' must be one of system, developer, user, " +
                                 "assistant, tool; got '" + role + "'");
      }
      // Only an assistant message may leave its content out (a turn of tool calls).
      if (role != "assistant" && (!m.contains("content") || m["content"].is_null())) {
        bad(where + ".content", "'" + where + ".content' is required for a " + role + " message");
      }
      ordered_json message = {{"role", role},
                              {"content", message_text(m.value("content", json(nullptr)), i)}};
      if (const auto name = m.find("name"); name != m.end() && !name->is_null()) {
        if (!name->is_string()) bad(where + ".name", "'" + where + ".name' must be a string");
        message["name"] = name->get<std::string>();
      }
      if (const auto calls = m.find("tool_calls"); calls != m.end() && !calls->is_null()) {
        if (role != "assistant")
          bad(where + ".tool_calls", "only assistant messages carry 'tool_calls'");
        ordered_json list = message_tool_calls(ordered["messages"][i]["tool_calls"],
                                               where + ".tool_calls");
        if (!list.empty()) message["tool_calls"] = std::move(list);
      }
      if (const auto id = m.find("tool_call_id"); id != m.end() && !id->is_null()) {
        if (role != "tool") bad(where + ".tool_call_id", "only tool messages carry 'tool_call_id'");
        if (!id->is_string())
          bad(where + ".tool_call_id", "'" + where + ".tool_call_id' must be a string");
        message["tool_call_id"] = id->get<std::string>();
      }
      r.messages.push_back(std::move(message));
    }
    if (ordered_needed) {
      r.tools = normalize_tools(ordered.value("tools", ordered_json()));
      r.chat_template_kwargs =
          template_kwargs(ordered.value("chat_template_kwargs", ordered_json()));
    }
    r.tool_choice = parse_tool_choice(
        body.contains("tool_choice") ? ordered_json::parse(body["tool_choice"].dump())
                                     : ordered_json(),
        r.tools);
    read_bool(body, "parallel_tool_calls", r.parallel_tool_calls);
  }
  if (endpoint == Endpoint::kCompletions) read_bool(body, "echo", r.echo);
  parse_sampling(body, r, defaults);
  r.params.grammar = parse_response_format(body);
  if (endpoint == Endpoint::kChat && tool_choice_is_forced(r.tool_choice)) {
    // One grammar per sequence: a forced tool call and a JSON response_format cannot both hold.
    if (r.params.grammar) {
      bad("tool_choice",
          "'tool_choice' \"required\" or a named function cannot be combined with a JSON "
          "'response_format' or 'guided_json'");
    }
    r.params.grammar = tool_choice_grammar(r.tool_choice, r.tools);
  }
  return r;
}

void resolve_tool_parser(ApiRequest& request, ToolCallFormat server_format) {
  request.tool_parser = ToolCallFormat::kNone;
  if (request.endpoint != Endpoint::kChat) return;
  switch (request.tool_choice.mode) {
    case ToolChoice::Mode::kNone:
      return;  // tools (if any) are still shown to the template, the output is never parsed
    case ToolChoice::Mode::kRequired:
    case ToolChoice::Mode::kNamed:
      // The output is forced JSON (parse_request set the grammar), read by
      // tool_calls_from_forced_output, not by a format's parser: any family will do.
      return;
    case ToolChoice::Mode::kAuto:
      break;
  }
  if (server_format == ToolCallFormat::kNone) {
    throw ApiError(400,
                   "tool_choice \"auto\" needs a tool-call parser, and this model's family has "
                   "none: start the server with --tool-call-parser NAME (" +
                       tool_call_format_names() + "), or send tool_choice \"none\"",
                   "invalid_request_error", "tool_choice");
  }
  request.tool_parser = server_format;
  if (tool_call_format_needs_special_tokens(server_format)) {
    request.params.skip_special_tokens = false;  // the markers must survive decoding
  }
}

void check_token_ids(const GenerationParams& params, int64_t vocab_size) {
  const auto check = [&](int32_t id, const char* field) {
    if (id < 0 || id >= vocab_size) {
      bad(field, std::string("'") + field + "' has token id " + std::to_string(id) +
                     ", outside the vocabulary of " + std::to_string(vocab_size));
    }
  };
  for (const auto& [id, bias] : params.sampling.logit_bias) check(id, "logit_bias");
  for (int32_t id : params.stop_token_ids) check(id, "stop_token_ids");
}

void resolve_max_tokens(ApiRequest& request, int64_t n, int64_t context,
                        int64_t default_completion_tokens) {
  GenerationParams& params = request.params;
  if (n >= context) {
    throw ApiError(413,
                   "this model's maximum context length is " + std::to_string(context) +
                       " tokens, but the prompt has " + std::to_string(n) + " tokens",
                   "invalid_request_error",
                   request.endpoint == Endpoint::kChat ? "messages" : "prompt",
                   "context_length_exceeded");
  }
  if (request.max_tokens_given) {
    if (params.max_tokens > context - n) {  // not n + max_tokens: max_tokens may be 2^63 - 1
      throw ApiError(400,
                     request.max_tokens_field + " is " + std::to_string(params.max_tokens) +
                         " but the prompt has " + std::to_string(n) +
                         " tokens and the context holds " + std::to_string(context),
                     "invalid_request_error", request.max_tokens_field, "context_length_exceeded");
    }
  } else {
    params.max_tokens = request.endpoint == Endpoint::kChat
                            ? context - n
                            : std::min(default_completion_tokens, context - n);
  }
  if (request.max_tokens_cap) {
    params.max_tokens = std::min(params.max_tokens, *request.max_tokens_cap);
  }
}

json logprobs_json(Endpoint endpoint, const Tokenizer& tokenizer,
                   const std::vector<TokenLogprob>& logprobs, int64_t text_offset,
                   bool skip_special_tokens) {
  const auto piece = [&](int32_t id) {
    const int32_t ids[1] = {id};
    return tokenizer.decode(ids, /*skip_special_tokens=*/false);
  };
  // Chat's `bytes` are the token's own, so that the pieces of a character split over tokens
  // add up to it (its `token` text cannot: it is JSON, and holds U+FFFD for them).
  const auto raw_bytes = [&](int32_t id) {
    const int32_t ids[1] = {id};
    json b = json::array();
    for (unsigned char c : tokenizer.decode_bytes(ids, /*skip_special_tokens=*/false))
      b.push_back(c);
    return b;
  };
  // Token text may be a partial UTF-8 sequence; JSON needs valid text, so replace those bytes.
  const auto safe = [](const std::string& s) {
    return json(s).dump(-1, ' ', false, json::error_handler_t::replace);
  };
  if (endpoint == Endpoint::kChat) {
    json content = json::array();
    for (const TokenLogprob& lp : logprobs) {
      const std::string text = piece(lp.token);
      json top = json::array();
      for (const auto& [id, value] : lp.top) {
        const std::string t = piece(id);
        top.push_back(
            {{"token", json::parse(safe(t))}, {"logprob", value}, {"bytes", raw_bytes(id)}});
      }
      content.push_back({{"token", json::parse(safe(text))},
                         {"logprob", lp.logprob},
                         {"bytes", raw_bytes(lp.token)},
                         {"top_logprobs", top}});
    }
    return {{"content", content}};
  }
  json tokens = json::array(), token_logprobs = json::array(), top_logprobs = json::array(),
       offsets = json::array();
  int64_t offset = text_offset;
  // The text the tokens add, as the returned text has it: a token holding part of a character
  // adds it only once the character is complete.
  StreamDecoder text_so_far(tokenizer, skip_special_tokens);
  for (const TokenLogprob& lp : logprobs) {
    const std::string text = json::parse(safe(piece(lp.token))).get<std::string>();
    tokens.push_back(text);
    token_logprobs.push_back(lp.logprob);
    // Keyed by text: of two tokens with one text the more likely (listed first) stays. The
    // sampled (or prompt) token is always there, as OpenAI and vLLM give it: up to N + 1 entries.
    json top = json::object();
    for (const auto& [id, value] : lp.top) {
      const std::string key = json::parse(safe(piece(id))).get<std::string>();
      if (!top.contains(key)) top[key] = value;
    }
    if (!top.contains(text)) top[text] = lp.logprob;
    top_logprobs.push_back(top);
    offsets.push_back(offset);
    offset += unicode::count_code_points(text_so_far.push(lp.token));
  }
  return {{"tokens", tokens},
          {"token_logprobs", token_logprobs},
          {"top_logprobs", top_logprobs},
          {"text_offset", offsets}};
}

json usage_json(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", cached_tokens}}}};
}

namespace {
json finish_json(const char* reason) { return reason ? json(reason) : json(nullptr); }
json header_json(const ResponseInfo& info, const char* object) {
  return {{"id", info.id}, {"object", object}, {"created", info.created}, {"model", info.model}};
}
}  // namespace

json response_json(const ResponseInfo& info, const std::string& text, const json& logprobs,
                   const char* finish_reason, const json& usage) {
  json out;
  if (info.endpoint == Endpoint::kChat) {
    out = header_json(info, "chat.completion");
    out["choices"] = json::array({{{"index", 0},
                                   {"message", {{"role", "assistant"}, {"content", text}}},
                                   {"logprobs", logprobs},
                                   {"finish_reason", finish_json(finish_reason)}}});
  } else {
    out = header_json(info, "text_completion");
    out["choices"] = json::array({{{"index", 0},
                                   {"text", text},
                                   {"logprobs", logprobs},
                                   {"finish_reason", finish_json(finish_reason)}}});
  }
  out["usage"] = usage;
  return out;
}

namespace {

// `tool_calls`: null, or the delta's tool_calls list (chat).
json chunk_at(const ResponseInfo& info, int64_t index, const std::string& text,
              const json& logprobs, const char* finish_reason, bool first, bool include_usage,
              const json& tool_calls = nullptr) {
  json out;
  if (info.endpoint == Endpoint::kChat) {
    out = header_json(info, "chat.completion.chunk");
    json delta = json::object();
    if (first) delta["role"] = "assistant";
    if (!text.empty() || first) delta["content"] = text;
    if (!tool_calls.is_null()) delta["tool_calls"] = tool_calls;
    out["choices"] = json::array({{{"index", index},
                                   {"delta", delta},
                                   {"logprobs", logprobs},
                                   {"finish_reason", finish_json(finish_reason)}}});
  } else {
    out = header_json(info, "text_completion");
    out["choices"] = json::array({{{"index", index},
                                   {"text", text},
                                   {"logprobs", logprobs},
                                   {"finish_reason", finish_json(finish_reason)}}});
  }
  if (include_usage) out["usage"] = nullptr;
  return out;
}

}  // namespace

std::string token_text(const Tokenizer& tokenizer, int32_t id) {
  const int32_t ids[1] = {id};
  const std::string raw = tokenizer.decode(ids, /*skip_special_tokens=*/false);
  return json::parse(json(raw).dump(-1, ' ', false, json::error_handler_t::replace))
      .get<std::string>();
}

json chunk_json(const ResponseInfo& info, const std::string& text, const json& logprobs,
                const char* finish_reason, bool first, bool include_usage) {
  return chunk_at(info, 0, text, logprobs, finish_reason, first, include_usage);
}

json usage_chunk_json(const ResponseInfo& info, const json& usage) {
  json out = header_json(
      info, info.endpoint == Endpoint::kChat ? "chat.completion.chunk" : "text_completion");
  out["choices"] = json::array();
  out["usage"] = usage;
  return out;
}

ChoiceSet::ChoiceSet(const ApiRequest& request, ResponseInfo info, const Tokenizer& tokenizer,
                     std::vector<int32_t> prompt)
    : endpoint_(request.endpoint),
      info_(std::move(info)),
      tokenizer_(tokenizer),
      prompt_(std::move(prompt)),
      n_(request.n),
      want_logprobs_(request.params.logprobs >= 0),
      prompt_logprobs_(request.prompt_logprobs),
      include_usage_(request.include_usage),
      choices_(static_cast<size_t>(std::max(request.best_of, request.n))),
      num_prompt_tokens_(static_cast<int64_t>(prompt_.size())),
      tool_parser_(request.endpoint == Endpoint::kChat ? request.tool_parser
                                                       : ToolCallFormat::kNone),
      max_tool_calls_(request.parallel_tool_calls ? INT64_MAX : 1),
      forced_tool_choice_(request.endpoint == Endpoint::kChat &&
                                  tool_choice_is_forced(request.tool_choice)
                              ? request.tool_choice
                              : ToolChoice{}),
      tool_call_ids_(std::make_unique<ToolCallIds>()) {
  if (tool_parser_ != ToolCallFormat::kNone) {
    for (Choice& c : choices_) c.tool_stream.emplace(tool_parser_, tool_call_ids_.get());
  }
  skip_special_tokens_ = request.params.skip_special_tokens;
  if (request.echo) {
    echo_ = request.prompt_is_ids ? tokenizer.decode(prompt_, request.params.skip_special_tokens)
                                  : request.prompt_text;
    echo_logprobs_ = want_logprobs_;
  }
}

void ChoiceSet::add(const RequestOutput& out) {
  if (out.index < 0 || out.index >= static_cast<int64_t>(choices_.size())) return;
  Choice& c = choices_[out.index];
  c.text += out.text;
  c.logprobs.insert(c.logprobs.end(), out.logprobs.begin(), out.logprobs.end());
  if (!out.prompt_logprobs.empty()) prompt_entries_ = out.prompt_logprobs;
  c.cumulative_logprob = out.cumulative_logprob;
  if (out.finish != FinishReason::kNone) c.finish = out.finish;
  c.num_output_tokens = std::max(c.num_output_tokens, out.num_output_tokens);
  num_prompt_tokens_ = out.num_prompt_tokens > 0 ? out.num_prompt_tokens : num_prompt_tokens_;
  if (out.index == 0) num_cached_tokens_ = std::max(num_cached_tokens_, out.num_cached_tokens);
}

json ChoiceSet::prompt_logprobs_json() const {
  json list = json::array({nullptr});  // the first token has nothing before it
  for (const TokenLogprob& lp : prompt_entries_) {
    json entry = json::object();
    entry[std::to_string(lp.token)] = {{"logprob", lp.logprob},
                                       {"rank", lp.rank},
                                       {"decoded_token", token_text(tokenizer_, lp.token)}};
    for (size_t i = 0; i < lp.top.size(); ++i) {
      const auto& [id, value] = lp.top[i];
      entry[std::to_string(id)] = {{"logprob", value},
                                   {"rank", static_cast<int64_t>(i) + 1},
                                   {"decoded_token", token_text(tokenizer_, id)}};
    }
    list.push_back(entry);
  }
  return list;
}

json ChoiceSet::echo_logprobs_json() const {
  // The prompt's tokens: the first with a null logprob, then what the engine scored; the first
  // goes through the same text offsets as the rest.
  if (prompt_.empty()) return logprobs_json(Endpoint::kCompletions, tokenizer_, {}, 0, true);
  std::vector<TokenLogprob> entries = {{.token = prompt_[0]}};
  entries.insert(entries.end(), prompt_entries_.begin(), prompt_entries_.end());
  json prompt = logprobs_json(Endpoint::kCompletions, tokenizer_, entries, 0, skip_special_tokens_);
  prompt["token_logprobs"][0] = nullptr;
  prompt["top_logprobs"][0] = nullptr;
  return prompt;
}

json ChoiceSet::choice_logprobs(const Choice& c, bool with_echo, int64_t text_offset) const {
  if (!want_logprobs_) return nullptr;
  json generated =
      logprobs_json(endpoint_, tokenizer_, c.logprobs, text_offset, skip_special_tokens_);
  if (!with_echo || !echo_logprobs_) return generated;
  json all = echo_logprobs_json();
  for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"}) {
    for (json& v : generated[key]) all[key].push_back(std::move(v));
  }
  return all;
}

std::vector<int64_t> ChoiceSet::returned() const {
  std::vector<int64_t> order(choices_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  if (static_cast<int64_t>(order.size()) > n_) {
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return choices_[a].cumulative_logprob > choices_[b].cumulative_logprob;
    });
    order.resize(static_cast<size_t>(n_));
  }
  return order;
}

json ChoiceSet::usage() const {
  int64_t completion = 0;
  for (int64_t i : returned()) completion += choices_[i].num_output_tokens;
  return usage_json(num_prompt_tokens_, completion, num_cached_tokens_);
}

json ChoiceSet::forced_message_json(const std::string& text, bool* called) const {
  std::vector<ToolCall> calls =
      tool_calls_from_forced_output(forced_tool_choice_, text, *tool_call_ids_);
  if (calls.empty()) return {{"role", "assistant"}, {"content", text}};  // cut off: the text
  if (static_cast<int64_t>(calls.size()) > max_tool_calls_) calls.resize(1);
  json list = json::array();
  for (const ToolCall& call : calls) list.push_back(tool_call_json(call));
  *called = true;
  return {{"role", "assistant"}, {"content", nullptr}, {"tool_calls", std::move(list)}};
}

const char* ChoiceSet::tool_finish_reason(FinishReason finish, bool called) const {
  if (finish == FinishReason::kNone) return nullptr;
  if (!called) return finish_reason_name(finish);
  // vLLM's (and OpenAI's) rule: "tool_calls" for auto, and for "required" when the output
  // ended by itself; a named function keeps the reason its output ended with.
  switch (forced_tool_choice_.mode) {
    case ToolChoice::Mode::kRequired:
      return finish == FinishReason::kStop ? "tool_calls" : finish_reason_name(finish);
    case ToolChoice::Mode::kNamed:
      return finish_reason_name(finish);
    default:
      return "tool_calls";
  }
}

json ChoiceSet::message_json(const Choice& c, bool* called) const {
  *called = false;
  if (forced_tool_choice_.mode != ToolChoice::Mode::kNone)
    return forced_message_json(c.text, called);
  if (tool_parser_ == ToolCallFormat::kNone) return {{"role", "assistant"}, {"content", c.text}};
  ParsedToolCalls parsed = parse_tool_calls(tool_parser_, c.text, *tool_call_ids_);
  if (static_cast<int64_t>(parsed.calls.size()) > max_tool_calls_) parsed.calls.resize(1);
  json message = {{"role", "assistant"},
                  {"content", parsed.content ? json(*parsed.content) : json(nullptr)}};
  if (!parsed.calls.empty()) {
    json calls = json::array();
    for (const ToolCall& call : parsed.calls) calls.push_back(tool_call_json(call));
    message["tool_calls"] = std::move(calls);
    *called = true;
  }
  return message;
}

json ChoiceSet::response() const {
  const bool chat = endpoint_ == Endpoint::kChat;
  json out = header_json(info_, chat ? "chat.completion" : "text_completion");
  json choices = json::array();
  int64_t index = 0;
  for (int64_t i : returned()) {
    const Choice& c = choices_[i];
    json choice = {{"index", index++}};
    bool called = false;
    if (chat) {
      choice["message"] = message_json(c, &called);
    } else {
      choice["text"] = echo_ + c.text;
    }
    choice["logprobs"] = choice_logprobs(c, true, unicode::count_code_points(echo_));
    choice["finish_reason"] = finish_json(tool_finish_reason(c.finish, called));
    if (!chat && prompt_logprobs_ >= 0) choice["prompt_logprobs"] = prompt_logprobs_json();
    choices.push_back(std::move(choice));
  }
  out["choices"] = std::move(choices);
  if (chat && prompt_logprobs_ >= 0) out["prompt_logprobs"] = prompt_logprobs_json();
  out["usage"] = usage();
  return out;
}

std::vector<json> ChoiceSet::stream(const RequestOutput& out) {
  std::vector<json> chunks;
  if (out.index < 0 || out.index >= static_cast<int64_t>(choices_.size())) return chunks;
  if (!out.prompt_logprobs.empty()) prompt_entries_ = out.prompt_logprobs;
  Choice& c = choices_[out.index];
  const bool first = !c.started;
  c.started = true;
  if (first && !echo_.empty()) {
    const json lp = echo_logprobs_ ? echo_logprobs_json() : json(nullptr);
    chunks.push_back(chunk_at(info_, out.index, echo_, lp, nullptr, false, include_usage_));
    c.stream_offset = unicode::count_code_points(echo_);
  }
  const bool finish = out.finish != FinishReason::kNone;
  // With a tool parser the text goes through the choice's stream: content as it comes, held
  // back where it could be the start of a call, and each call in one piece once complete.
  std::string text = out.text;
  json tool_calls = nullptr;
  const char* finish_reason = finish ? finish_reason_name(out.finish) : nullptr;
  if (c.tool_stream) {
    ToolCallStream::Delta delta = c.tool_stream->push(out.text);
    if (finish) {
      ToolCallStream::Delta last = c.tool_stream->finish();
      delta.content += last.content;
      if (delta.calls.empty()) delta.first_index = last.first_index;
      for (ToolCall& call : last.calls) delta.calls.push_back(std::move(call));
    }
    text = std::move(delta.content);
    for (size_t i = 0; i < delta.calls.size(); ++i) {
      const int64_t at = delta.first_index + static_cast<int64_t>(i);
      if (at >= max_tool_calls_) break;
      if (tool_calls.is_null()) tool_calls = json::array();
      tool_calls.push_back(tool_call_delta_json(delta.calls[i], at));
    }
    if (finish && c.tool_stream->num_calls() > 0) finish_reason = "tool_calls";
  } else if (forced_tool_choice_.mode != ToolChoice::Mode::kNone) {
    // Forced JSON: nothing until the output is complete, then its calls in one piece (or, cut
    // off before it parses, the whole text as content), as the parsed formats send each call.
    text.clear();
    if (finish) {
      const std::string whole = c.text + out.text;
      bool called = false;
      const json message = forced_message_json(whole, &called);
      if (called) {
        tool_calls = json::array();
        for (size_t i = 0; i < message["tool_calls"].size(); ++i) {
          json call = message["tool_calls"][i];
          call["index"] = static_cast<int64_t>(i);
          tool_calls.push_back(std::move(call));
        }
      } else {
        text = whole;
      }
      finish_reason = tool_finish_reason(out.finish, called);
    }
  }
  if ((first && echo_.empty()) || !text.empty() || !tool_calls.is_null() || finish ||
      !out.logprobs.empty()) {
    const json lp = want_logprobs_ && !out.logprobs.empty()
                        ? logprobs_json(endpoint_, tokenizer_, out.logprobs, c.stream_offset,
                                        skip_special_tokens_)
                        : json(nullptr);
    chunks.push_back(chunk_at(info_, out.index, text, lp, finish_reason, first, include_usage_,
                              tool_calls));
    c.stream_offset += unicode::count_code_points(out.text);
  }
  if (first && prompt_logprobs_ >= 0 && !chunks.empty()) {
    if (endpoint_ == Endpoint::kChat) {
      chunks.front()["prompt_logprobs"] = prompt_logprobs_json();
    } else {
      chunks.front()["choices"][0]["prompt_logprobs"] = prompt_logprobs_json();
    }
  }
  add(out);
  return chunks;
}

json ChoiceSet::usage_chunk() const { return usage_chunk_json(info_, usage()); }

}  // namespace moeinfer::server
