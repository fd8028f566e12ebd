// Tools in chat completions (server/tool_calls.h): each format's parser on many outputs (several
// calls, text before them, malformed JSON kept as content, calls cut off), the streamed parser
// split at every byte boundary against the whole-output one, the request fields (tools,
// tool_choice, chat_template_kwargs, tool messages), the constrained-decoding hook, the
// templates of the supported families rendering tools, and the responses and stream chunks
// ChoiceSet builds from outputs that call tools.
#include "server/tool_calls.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "io/chat_template.h"
#include "server/openai_api.h"

namespace moeinfer::server {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

constexpr ToolCallFormat kHermes = ToolCallFormat::kHermes;
constexpr ToolCallFormat kMistral = ToolCallFormat::kMistral;
constexpr ToolCallFormat kDeepSeek = ToolCallFormat::kDeepSeekV3;

struct Call {
  std::string name, arguments;
  bool operator==(const Call&) const = default;
};
std::ostream& operator<<(std::ostream& os, const Call& c) {
  return os << c.name << "(" << c.arguments << ")";
}

std::vector<Call> calls_of(const std::vector<ToolCall>& calls) {
  std::vector<Call> out;
  for (const ToolCall& c : calls) out.push_back({c.name, c.arguments});
  return out;
}

ParsedToolCalls parse(ToolCallFormat format, std::string_view text) {
  ToolCallIds ids(7);
  return parse_tool_calls(format, text, ids);
}

// What a stream gives for `text` cut into pieces at `cuts` (increasing byte offsets).
struct Streamed {
  std::string content;
  std::vector<ToolCall> calls;
};
Streamed stream(ToolCallFormat format, std::string_view text, const std::vector<size_t>& cuts) {
  ToolCallIds ids(7);
  ToolCallStream s(format, &ids);
  Streamed out;
  const auto take = [&](ToolCallStream::Delta d) {
    EXPECT_EQ(d.first_index, static_cast<int64_t>(out.calls.size()));
    out.content += d.content;
    for (ToolCall& c : d.calls) out.calls.push_back(std::move(c));
  };
  size_t at = 0;
  for (size_t cut : cuts) {
    take(s.push(text.substr(at, cut - at)));
    at = cut;
  }
  take(s.push(text.substr(at)));
  take(s.finish());
  return out;
}

// ---------------------------------------------------------------------------------------------
// Names and families

TEST(ToolCallFormats, VllmNamesAndFamilies) {
  EXPECT_EQ(tool_call_format_from_name("hermes"), kHermes);
  EXPECT_EQ(tool_call_format_from_name("mistral"), kMistral);
  EXPECT_EQ(tool_call_format_from_name("deepseek_v3"), kDeepSeek);
  EXPECT_EQ(tool_call_format_from_name("deepseekv3"), kDeepSeek);
  EXPECT_EQ(tool_call_format_from_name("none"), ToolCallFormat::kNone);
  EXPECT_FALSE(tool_call_format_from_name("llama3_json").has_value());
  EXPECT_STREQ(tool_call_format_name(kDeepSeek), "deepseek_v3");
  EXPECT_EQ(default_tool_call_format("qwen3_moe"), kHermes);
  EXPECT_EQ(default_tool_call_format("qwen2_moe"), kHermes);
  EXPECT_EQ(default_tool_call_format("mixtral"), kMistral);
  EXPECT_EQ(default_tool_call_format("deepseek_v2"), kDeepSeek);
  EXPECT_EQ(default_tool_call_format("deepseek_v3"), kDeepSeek);
  EXPECT_EQ(default_tool_call_format("olmoe"), ToolCallFormat::kNone);
}

TEST(ToolCallFormats, IdsAreVllms) {
  ToolCallIds ids;
  const std::string id = ids.next(kHermes);
  ASSERT_EQ(id.size(), 14u + 32u);
  EXPECT_EQ(id.substr(0, 14), "chatcmpl-tool-");
  EXPECT_EQ(id.substr(14).find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_NE(ids.next(kHermes), id);
  const std::string mistral = ids.next(kMistral);
  ASSERT_EQ(mistral.size(), 9u);  // Mistral's templates refuse any other length
  for (char c : mistral) EXPECT_TRUE(std::isalnum(static_cast<unsigned char>(c))) << mistral;
}

// ---------------------------------------------------------------------------------------------
// Whole outputs, per format

TEST(HermesToolCalls, CallsContentAndArguments) {
  auto p = parse(kHermes, R"(<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2.5], "unit": "°C"}}
</tool_call>)");
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_FALSE(p.content.has_value());  // nothing besides the call: null
  EXPECT_EQ(p.calls[0].name, "get_weather");
  // json.dumps(arguments, ensure_ascii=False), as vLLM writes them.
  EXPECT_EQ(p.calls[0].arguments, R"({"city": "Paris", "days": [1, 2.5], "unit": "°C"})");
  EXPECT_EQ(p.calls[0].id.substr(0, 14), "chatcmpl-tool-");

  p = parse(kHermes,
            "Let me look.\n\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n"
            "<tool_call>\n{\"name\": \"b\", \"arguments\": {\"q\": \"x y\"}}\n</tool_call>");
  ASSERT_EQ(p.content, "Let me look.\n\n");
  EXPECT_EQ(calls_of(p.calls), (std::vector<Call>{{"a", "{}"}, {"b", R"({"q": "x y"})"}}));
  EXPECT_NE(p.calls[0].id, p.calls[1].id);

  // The last call without its closing tag (the model stopped there): parsed from what there is.
  p = parse(kHermes, "<tool_call>{\"name\": \"a\", \"arguments\": {\"k\": true}}");
  EXPECT_EQ(calls_of(p.calls), (std::vector<Call>{{"a", R"({"k": true})"}}));
  // Arguments that are not an object are written back as JSON all the same (vLLM's dumps).
  p = parse(kHermes, "<tool_call>{\"name\": \"a\", \"arguments\": \"{\\\"k\\\": 1}\"}</tool_call>");
  EXPECT_EQ(calls_of(p.calls), (std::vector<Call>{{"a", R"("{\"k\": 1}")"}}));
  // Key order is kept; text after the calls is dropped (vLLM's content is what precedes them).
  p = parse(kHermes,
            "<tool_call>{\"arguments\": {\"z\": 1, \"a\": 2}, \"name\": \"f\"}</tool_call>"
            " and then some text");
  EXPECT_EQ(calls_of(p.calls), (std::vector<Call>{{"f", R"({"z": 1, "a": 2})"}}));
  EXPECT_FALSE(p.content.has_value());
}

TEST(HermesToolCalls, MalformedIsContent) {
  for (const char* text : {
           "no call at all",
           "",
           "<tool_call>{\"name\": \"a\", \"arguments\": {\"k\": }</tool_call>",  // bad JSON
           "<tool_call>{\"name\": \"a\", \"arguments\": {\"k\": 1}",   // cut off by max_tokens
           "<tool_call>{\"arguments\": {}}</tool_call>",               // no name
           "<tool_call>{\"name\": 5, \"arguments\": {}}</tool_call>",  // name not a string
           "<tool_call>{\"name\": \"a\"}</tool_call>",                 // no arguments
           "<tool_call>[1, 2]</tool_call>",                            // not an object
           "<tool_call></tool_call>",
           "<tool_call>",
           // One bad call among good ones: no call at all, as vLLM does.
           "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{oops}"
           "</tool_call>",
           "text <tool_ca",
           "<tool_call >{\"name\": \"a\", \"arguments\": {}}</tool_call>",
       }) {
    const ParsedToolCalls p = parse(kHermes, text);
    EXPECT_TRUE(p.calls.empty()) << text;
    EXPECT_EQ(p.content, std::string(text)) << text;
  }
}

TEST(MistralToolCalls, CallsContentAndFallbacks) {
  auto p = parse(kMistral, R"([TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, )"
                           R"({"name": "neg", "arguments": {"x": -1}}])");
  EXPECT_FALSE(p.content.has_value());
  EXPECT_EQ(calls_of(p.calls),
            (std::vector<Call>{{"add", R"({"a": 3.5, "b": 4})"}, {"neg", R"({"x": -1})"}}));
  ASSERT_EQ(p.calls[0].id.size(), 9u);

  p = parse(kMistral, R"(Sure.[TOOL_CALLS][{"name":"f","arguments":{"s":"a]}b"}}])");
  EXPECT_EQ(p.content, "Sure.");
  EXPECT_EQ(calls_of(p.calls), (std::vector<Call>{{"f", R"({"s": "a]}b"})"}}));
  // vLLM's fallback: the array found after text the model put in front of it.
  p = parse(kMistral, R"([TOOL_CALLS] calling: [{"name": "f", "arguments": {}}] done)");
  EXPECT_EQ(calls_of(p.calls), (std::vector<Call>{{"f", "{}"}}));
  // Only the closing bracket missing: the complete calls stand.
  p = parse(kMistral, R"([TOOL_CALLS] [{"name": "f", "arguments": {}})");
  EXPECT_EQ(calls_of(p.calls), (std::vector<Call>{{"f", "{}"}}));

  for (const char* text : {
           "[TOOL_CALLS]",
           "[TOOL_CALLS] []",
           R"([TOOL_CALLS] {"name": "f", "arguments": {}})",  // an object, not a list
           R"([TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {)",
           R"([TOOL_CALLS] [{"name": "f"}])",
           R"([TOOL_CALLS] [{"name": "f", "arguments": {}} {"name": "g", "arguments": {}}])",
           R"([TOOL_CALLS] [{"name": "f", "arguments": {]}])",
           R"([TOOL_CALLS] [3])",
       }) {
    const ParsedToolCalls q = parse(kMistral, text);
    EXPECT_TRUE(q.calls.empty()) << text;
    EXPECT_EQ(q.content, std::string(text)) << text;
  }
}

// Tokenizer v11+ (Mistral-Small-3.2): [TOOL_CALLS]NAME[ARGS]{...} per call.
TEST(MistralToolCalls, NamedFormatOfTokenizerV11) {
  auto p = parse(kMistral, R"([TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3})");
  EXPECT_FALSE(p.content.has_value());
  EXPECT_EQ(calls_of(p.calls),
            (std::vector<Call>{{"get_weather", R"({"city": "Paris", "days": 3})"}}));
  ASSERT_EQ(p.calls[0].id.size(), 9u);

  p = parse(kMistral, R"(Let me check.[TOOL_CALLS]a[ARGS]{"x":1}[TOOL_CALLS]b_2-c[ARGS])"
                      R"({"y": [1, {"z": "}[TOOL_CALLS]"}]})");
  EXPECT_EQ(p.content, "Let me check.");
  EXPECT_EQ(calls_of(p.calls),
            (std::vector<Call>{{"a", R"({"x": 1})"},
                               {"b_2-c", R"({"y": [1, {"z": "}[TOOL_CALLS]"}]})"}}));
  // As mistral-common decodes it ([ARGS] dropped), which vLLM parses; an optional [CALL_ID];
  // whitespace between calls; text after the last call dropped.
  p = parse(kMistral, R"([TOOL_CALLS]add{"a": 3.5, "b": 4})");
  EXPECT_EQ(calls_of(p.calls), (std::vector<Call>{{"add", R"({"a": 3.5, "b": 4})"}}));
  p = parse(kMistral, R"([TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{} [TOOL_CALLS]g[ARGS]{"k": null})"
                      "\n done");
  EXPECT_EQ(calls_of(p.calls), (std::vector<Call>{{"f", "{}"}, {"g", R"({"k": null})"}}));

  for (const char* text : {
           "[TOOL_CALLS]f",
           "[TOOL_CALLS]f[ARGS]",
           R"([TOOL_CALLS]f[ARGS]{"a":)",
           "[TOOL_CALLS]f[ARGS][1]",
           "[TOOL_CALLS]f[ARGS]{x}",
           "[TOOL_CALLS]f[ARG]{}",
           "[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g[ARGS]{",  // the second call cut off
           "[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS][ARGS]{}",  // the second without a name
           "[TOOL_CALLS]f g[ARGS]{}",
       }) {
    const ParsedToolCalls q = parse(kMistral, text);
    EXPECT_TRUE(q.calls.empty()) << text;
    EXPECT_EQ(q.content, std::string(text)) << text;
  }
}

const std::string kDsCall1 =
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"location\": "
    "\"Beijing\"}\n```<｜tool▁call▁end｜>";
const std::string kDsCall2 =
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{\"q\":\"a\\n```b\",\n "
    "\"n\": 2}\n```<｜tool▁call▁end｜>";

TEST(DeepSeekToolCalls, CallsContentAndMalformed) {
  const std::string two =
      "I will check.<｜tool▁calls▁begin｜>" + kDsCall1 + "\n" + kDsCall2 + "<｜tool▁calls▁end｜>";
  auto p = parse(kDeepSeek, two);
  EXPECT_EQ(p.content, "I will check.");
  // The arguments as the model wrote them (vLLM keeps them), newlines included.
  EXPECT_EQ(calls_of(p.calls), (std::vector<Call>{{"get_weather", "{\"location\": \"Beijing\"}"},
                                                  {"search", "{\"q\":\"a\\n```b\",\n \"n\": 2}"}}));
  p = parse(kDeepSeek, "<｜tool▁calls▁begin｜>" + kDsCall1);  // no calls-end marker
  EXPECT_EQ(p.calls.size(), 1u);
  EXPECT_FALSE(p.content.has_value());

  for (const std::string& text : std::vector<std::string>{
           "<｜tool▁calls▁begin｜>",
           "<｜tool▁calls▁begin｜>" + kDsCall1.substr(0, kDsCall1.size() - 10),  // cut off
           "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>code<｜tool▁sep｜>f\n```json\n{}\n```"
           "<｜tool▁call▁end｜>",  // type other than function
           "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{x}\n```"
           "<｜tool▁call▁end｜>",  // arguments not JSON
           "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f{}"
           "<｜tool▁call▁end｜>",  // no fence
           "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>\n```json\n{}\n```"
           "<｜tool▁call▁end｜>",  // no name
       }) {
    const ParsedToolCalls q = parse(kDeepSeek, text);
    EXPECT_TRUE(q.calls.empty()) << text;
    EXPECT_EQ(q.content, text);
  }
}

TEST(ToolCalls, NoParserKeepsTheText) {
  const auto p = parse(ToolCallFormat::kNone, "<tool_call>{\"name\": \"a\", \"arguments\": {}}");
  EXPECT_TRUE(p.calls.empty());
  EXPECT_EQ(p.content, "<tool_call>{\"name\": \"a\", \"arguments\": {}}");
}

// ---------------------------------------------------------------------------------------------
// Streaming: every split gives what the whole output gives

struct StreamCase {
  ToolCallFormat format;
  std::string text;
};

std::vector<StreamCase> stream_cases() {
  const std::string h1 =
      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
      "\"Zürich\"}}\n</tool_call>";
  const std::string h2 =
      "<tool_call>\n{\"name\": \"b\", \"arguments\": {\"s\": \"</tool\"}}\n"
      "</tool_call>";
  return {
      {kHermes, h1},
      {kHermes, "Checking <the> weather < tool\n\n" + h1 + "\n" + h2 + "\n"},
      {kHermes, "<tool_call>{\"name\": \"a\", \"arguments\": {\"k\": [1, {\"x\": null}]}}"},
      {kHermes, "plain text with < and <tool and <tool_call but no call"},
      {kHermes, "<tool_call>{\"name\": \"a\", \"arguments\": {oops}}</tool_call> after"},
      {kHermes, "Text<tool_call>{\"name\": \"a\", \"arguments\": {\"k\": 1"},
      {kMistral, R"([TOOL_CALLS] [{"name": "add", "arguments": {"a": "[{]}", "b": 4}}, )"
                 R"({"name": "neg", "arguments": {"x": -1}}])"},
      {kMistral, R"(I will call [TOOL_ it.[TOOL_CALLS][{"name":"f","arguments":{}}])"},
      {kMistral, R"([TOOL_CALLS] text first [{"name": "f", "arguments": {"q": "\"]"}}] tail)"},
      {kMistral, R"([TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}} oops])"},
      {kMistral, R"(plain [TOOL text)"},
      {kMistral, R"(Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Z\u00fcrich", "n": [1, 2]})"
                 R"([TOOL_CALLS]b[ARGS]{"s": "[TOOL_CALLS]x[ARGS]{"})"},
      {kMistral, R"([TOOL_CALLS]add{"a": 3.5} [TOOL_CALLS]f[CALL_ID]abcdefghi[ARGS]{} tail)"},
      {kMistral, R"([TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{"b": )"},
      {kMistral, "[TOOL_CALLS]f[ARG]{}"},
      {kDeepSeek,
       "Sure<｜tool▁calls▁begin｜>" + kDsCall1 + "\n" + kDsCall2 + "<｜tool▁calls▁end｜>"},
      {kDeepSeek, "<｜tool▁calls▁begin｜>" + kDsCall2},
      {kDeepSeek,
       "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f{}"
       "<｜tool▁call▁end｜>"},
      {kDeepSeek, "almost <｜tool▁calls a call"},
  };
}

// The streamed result whatever the split must be the one-push result, and equal the whole-output
// parse when that found calls or nothing malformed came after a sent call.
void expect_stream_matches(const StreamCase& c, const std::vector<size_t>& cuts,
                           const Streamed& reference) {
  const Streamed s = stream(c.format, c.text, cuts);
  std::string where = "cuts:";
  for (size_t cut : cuts) where += " " + std::to_string(cut);
  ASSERT_EQ(s.content, reference.content) << c.text << "\n" << where;
  ASSERT_EQ(calls_of(s.calls), calls_of(reference.calls)) << c.text << "\n" << where;
}

TEST(ToolCallStream, EverySplitGivesTheWholeOutputsResult) {
  for (const StreamCase& c : stream_cases()) {
    const Streamed whole = stream(c.format, c.text, {});
    const ParsedToolCalls parsed = parse(c.format, c.text);
    // The one documented difference: a call that does not parse after calls already sent.
    if (!(parsed.calls.empty() && !whole.calls.empty())) {
      EXPECT_EQ(whole.content, parsed.content.value_or("")) << c.text;
      EXPECT_EQ(calls_of(whole.calls), calls_of(parsed.calls)) << c.text;
    }
    for (size_t cut = 0; cut <= c.text.size(); ++cut) {
      expect_stream_matches(c, {cut}, whole);
    }
    std::vector<size_t> every_byte;
    for (size_t i = 1; i < c.text.size(); ++i) every_byte.push_back(i);
    expect_stream_matches(c, every_byte, whole);
  }
}

TEST(ToolCallStream, EveryPairOfSplits) {
  for (const StreamCase& c : stream_cases()) {
    if (c.text.size() > 160) continue;  // quadratic: the short cases cover it
    const Streamed whole = stream(c.format, c.text, {});
    for (size_t a = 1; a < c.text.size(); ++a) {
      for (size_t b = a; b < c.text.size(); ++b) expect_stream_matches(c, {a, b}, whole);
    }
  }
}

TEST(ToolCallStream, NoMarkupReachesTheContent) {
  // Byte by byte, no delta's content ever holds part of a marker, and text before a call is
  // released as soon as it cannot be the start of one.
  const std::string text = "Hi <b> <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>";
  ToolCallIds ids(1);
  ToolCallStream s(kHermes, &ids);
  std::string content;
  std::vector<ToolCall> calls;
  for (size_t i = 0; i < text.size(); ++i) {
    ToolCallStream::Delta d = s.push(text.substr(i, 1));
    EXPECT_EQ(d.content.find("<t"), std::string::npos) << "at " << i << ": '" << d.content << "'";
    content += d.content;
    for (ToolCall& c : d.calls) calls.push_back(c);
    if (i == 3) {
      EXPECT_EQ(content, "Hi ");  // "<" held: it may open a call
    } else if (i == 4) {
      EXPECT_EQ(content, "Hi <b");  // "<b" cannot
    } else if (i == text.size() - 1) {
      EXPECT_EQ(calls.size(), 1u);  // sent once closed, not at finish
    }
  }
  EXPECT_TRUE(s.finish().empty());
  EXPECT_EQ(content, "Hi <b> ");
  EXPECT_EQ(s.num_calls(), 1);
}

TEST(ToolCallStream, CallsAlreadySentStandWhenALaterOneIsMalformed) {
  const std::string text =
      "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>\n"
      "<tool_call>{broken}</tool_call> tail";
  const Streamed s = stream(kHermes, text, {60});
  EXPECT_EQ(calls_of(s.calls), (std::vector<Call>{{"f", "{}"}}));
  EXPECT_EQ(s.content, "\n<tool_call>{broken}</tool_call> tail");
  // Whole, vLLM's rule: nothing is a call.
  EXPECT_TRUE(parse(kHermes, text).calls.empty());
}

// ---------------------------------------------------------------------------------------------
// Request fields

int status_of(const std::string& body, std::string* param = nullptr) {
  try {
    parse_request(body, Endpoint::kChat);
  } catch (const ApiError& e) {
    if (param) *param = e.param;
    return e.status;
  }
  return 200;
}

const char* kWeatherTool = R"({"type": "function", "function": {"name": "get_weather",
    "parameters": {"type": "object", "properties": {"zip": {"type": "string"},
                   "city": {"type": "string"}}, "required": ["city"]}}})";

TEST(ToolRequests, ToolsAreNormalisedWithTheirOrderKept) {
  const ApiRequest r = parse_request(std::string(R"({"messages": [{"role": "user", "content": "x"}],
                                                     "tools": [)") +
                                         kWeatherTool + R"(, {"function": {"strict": true,
                                         "name": "now", "description": "the time"}}]})",
                                     Endpoint::kChat);
  ASSERT_EQ(r.tools.size(), 2u);
  // vLLM's model_dump: type, then name, description, parameters (null when absent), then the rest.
  EXPECT_EQ(r.tools[0].dump(),
            R"({"type":"function","function":{"name":"get_weather","description":null,)"
            R"("parameters":{"type":"object","properties":{"zip":{"type":"string"},)"
            R"("city":{"type":"string"}},"required":["city"]}}})");
  EXPECT_EQ(r.tools[1].dump(),
            R"({"type":"function","function":{"name":"now","description":"the time",)"
            R"("parameters":null,"strict":true}})");
  EXPECT_EQ(r.tool_choice.mode, ToolChoice::Mode::kAuto);  // vLLM's default with tools
  EXPECT_TRUE(r.parallel_tool_calls);
  const ApiRequest none =
      parse_request(R"({"messages": [{"role": "user", "content": "x"}]})", Endpoint::kChat);
  EXPECT_EQ(none.tool_choice.mode, ToolChoice::Mode::kNone);
  EXPECT_TRUE(none.tools.is_null());
}

TEST(ToolRequests, RefusalsNameTheField) {
  const std::string user = R"("messages": [{"role": "user", "content": "x"}])";
  const std::string tools = std::string(R"("tools": [)") + kWeatherTool + "]";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{" + user + R"(, "tools": {"a": 1}})", "tools"},
      {"{" + user + R"(, "tools": [5]})", "tools[0]"},
      {"{" + user + R"(, "tools": [{"type": "code", "function": {"name": "f"}}]})",
       "tools[0].type"},
      {"{" + user + R"(, "tools": [{"type": "function"}]})", "tools[0].function"},
      {"{" + user + R"(, "tools": [{"function": {"name": ""}}]})", "tools[0].function.name"},
      {"{" + user + R"(, "tools": [{"function": {"name": "f", "parameters": []}}]})",
       "tools[0].function.parameters"},
      {"{" + user + R"(, "tools": [{"function": {"name": "f"}, "extra": 1}]})", "tools[0].extra"},
      {"{" + user + R"(, "tool_choice": "auto"})", "tool_choice"},  // no tools
      {"{" + user + ", " + tools + R"(, "tool_choice": "sometimes"})", "tool_choice"},
      {"{" + user + ", " + tools + R"(, "tool_choice": 3})", "tool_choice"},
      {"{" + user + ", " + tools +
           R"(, "tool_choice": {"type": "function", "function": {"name": "other"}}})",
       "tool_choice"},
      {"{" + user + ", " + tools + R"(, "parallel_tool_calls": "yes"})", "parallel_tool_calls"},
      {"{" + user + R"(, "chat_template_kwargs": [1]})", "chat_template_kwargs"},
      {"{" + user + R"(, "chat_template_kwargs": "enable_thinking"})", "chat_template_kwargs"},
      {"{" + user + R"(, "chat_template_kwargs": {"messages": []}})",
       "chat_template_kwargs.messages"},
      {"{" + user + R"(, "chat_template_kwargs": {"tools": []}})", "chat_template_kwargs.tools"},
      {R"({"messages": [{"role": "user", "content": "x", "tool_calls": []}]})",
       "messages[0].tool_calls"},
      {R"({"messages": [{"role": "user", "content": "x", "tool_call_id": "a"}]})",
       "messages[0].tool_call_id"},
      {R"({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]})",
       "messages[0].tool_call_id"},
      {R"({"messages": [{"role": "user", "content": "x", "name": 5}]})", "messages[0].name"},
      {R"({"messages": [{"role": "assistant", "tool_calls": [{"type": "function",
          "function": {"name": "f", "arguments": "{not json"}}]}]})",
       "messages[0].tool_calls[0].function.arguments"},
      {R"({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]})",
       "messages[0].tool_calls[0].function.name"},
      {R"({"messages": [{"role": "assistant", "tool_calls": {"a": 1}}]})",
       "messages[0].tool_calls"},
      // Keys that would be dropped on the way to the template or the grammar.
      {"{" + user + ", " + tools +
           R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"},
              "strict": true}})",
       "tool_choice.strict"},
      {"{" + user + ", " + tools +
           R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather",
              "arguments": "{}"}}})",
       "tool_choice.function.arguments"},
      {R"({"messages": [{"role": "assistant", "tool_calls": [{"type": "function",
          "function": {"name": "f", "arguments": "{}"}, "index": 1}]}]})",
       "messages[0].tool_calls[0].index"},
      {R"({"messages": [{"role": "assistant", "tool_calls": [{"type": "function",
          "function": {"name": "f", "arguments": "{}"}, "index": "0"}]}]})",
       "messages[0].tool_calls[0].index"},
      {R"({"messages": [{"role": "assistant", "tool_calls": [{"type": "function",
          "function": {"name": "f", "arguments": "{}"}, "spare": 0}]}]})",
       "messages[0].tool_calls[0].spare"},
      {R"({"messages": [{"role": "assistant", "tool_calls": [{"type": "function",
          "function": {"name": "f", "arguments": "{}", "output": "1"}}]}]})",
       "messages[0].tool_calls[0].function.output"},
      {R"({"messages": [{"role": "user", "content": []}]})", "messages[0].content"},
      {R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "x",
          "cache_control": {"type": "ephemeral"}}]}]})",
       "messages[0].content[0].cache_control"},
      {"{" + user + R"(, "functions": []})", "functions"},  // the legacy fields stay refused
  };
  for (const auto& [body, want] : cases) {
    std::string param;
    EXPECT_EQ(status_of(body, &param), 400) << body;
    EXPECT_EQ(param, want) << body;
  }
}

TEST(ToolRequests, ToolMessagesReachTheTemplateAsVllmPassesThem) {
  const ApiRequest r = parse_request(R"({"messages": [
      {"role": "user", "content": "weather?", "name": "ann"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call1", "type": "function",
       "function": {"name": "get_weather", "arguments": "{\"zip\": \"1\", \"city\": \"Bern\"}"}},
       {"type": "function", "function": {"name": "now", "arguments": ""}, "index": 1}]},
      {"role": "tool", "tool_call_id": "call1", "content": "sunny"},
      {"role": "assistant", "content": "ok", "tool_calls": []}],
      "chat_template_kwargs": {"enable_thinking": false, "custom": {"b": 1, "a": 2}}})",
                                     Endpoint::kChat);
  EXPECT_EQ(r.messages[0]["name"], "ann");
  // Arguments as a JSON value (templates write them with tojson), key order kept; "" is {}.
  // A streamed call's index, at its own position, is taken and not passed on.
  EXPECT_EQ(r.messages[1]["tool_calls"].dump(),
            R"([{"id":"call1","type":"function","function":{"name":"get_weather",)"
            R"("arguments":{"zip":"1","city":"Bern"}}},{"type":"function","function":)"
            R"({"name":"now","arguments":{}}}])");
  EXPECT_EQ(r.messages[2]["tool_call_id"], "call1");
  EXPECT_FALSE(r.messages[3].contains("tool_calls"));  // an empty list is dropped, as in vLLM
  EXPECT_EQ(r.chat_template_kwargs.dump(), R"({"enable_thinking":false,"custom":{"b":1,"a":2}})");
}

TEST(ToolRequests, ResolveToolParser) {
  const std::string base = std::string(R"({"messages": [{"role": "user", "content": "x"}],
                                           "tools": [)") +
                           kWeatherTool + "]";
  ApiRequest r = parse_request(base + "}", Endpoint::kChat);
  resolve_tool_parser(r, kHermes);
  EXPECT_EQ(r.tool_parser, kHermes);
  EXPECT_TRUE(r.params.skip_special_tokens);
  r = parse_request(base + "}", Endpoint::kChat);
  resolve_tool_parser(r, kMistral);
  EXPECT_EQ(r.tool_parser, kMistral);
  EXPECT_FALSE(r.params.skip_special_tokens);  // [TOOL_CALLS] is a special token
  // "none": the tools are still offered to the template, the output is not parsed.
  r = parse_request(base + R"(, "tool_choice": "none"})", Endpoint::kChat);
  resolve_tool_parser(r, kHermes);
  EXPECT_EQ(r.tool_parser, ToolCallFormat::kNone);
  EXPECT_EQ(r.tools.size(), 1u);
  // No tools: nothing to parse.
  r = parse_request(R"({"messages": [{"role": "user", "content": "x"}]})", Endpoint::kChat);
  resolve_tool_parser(r, kHermes);
  EXPECT_EQ(r.tool_parser, ToolCallFormat::kNone);

  const auto refusal = [](ApiRequest request, ToolCallFormat format) {
    try {
      resolve_tool_parser(request, format);
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status, 400);
      EXPECT_EQ(e.param, "tool_choice");
      return std::string(e.what());
    }
    ADD_FAILURE() << "no refusal";
    return std::string();
  };
  // "auto" on a family without a format (OLMoE) and no --tool-call-parser: vLLM's 400.
  std::string message = refusal(parse_request(base + "}", Endpoint::kChat), ToolCallFormat::kNone);
  EXPECT_NE(message.find("--tool-call-parser"), std::string::npos) << message;
  // "required" and a named function are forced JSON: no parser, on any family.
  for (const char* choice :
       {R"("required")", R"({"type": "function", "function": {"name": "get_weather"}})"}) {
    for (const ToolCallFormat format : {kHermes, kMistral, ToolCallFormat::kNone}) {
      r = parse_request(base + R"(, "tool_choice": )" + choice + "}", Endpoint::kChat);
      resolve_tool_parser(r, format);
      EXPECT_EQ(r.tool_parser, ToolCallFormat::kNone) << choice;
      EXPECT_TRUE(r.params.grammar) << choice;
    }
  }
}

// What a grammar accepts as a whole output.
bool accepts(const std::shared_ptr<const JsonGrammar>& grammar, std::string_view text) {
  JsonMatcher m(grammar);
  return m.advance(text) && m.can_finish();
}

TEST(ToolRequests, ForcedToolChoiceSetsTheGrammar) {
  const std::string base = std::string(R"({"messages": [{"role": "user", "content": "x"}],
                                           "tools": [)") +
                           kWeatherTool + R"(, {"function": {"name": "now"}}])";
  // A named function: its parameters are the output.
  ApiRequest r = parse_request(
      base + R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})",
      Endpoint::kChat);
  ASSERT_TRUE(r.params.grammar);
  EXPECT_TRUE(accepts(r.params.grammar, R"({"city": "Bern"})"));
  EXPECT_TRUE(accepts(r.params.grammar, R"({"zip": "3000", "city": "Bern"})"));
  EXPECT_FALSE(accepts(r.params.grammar, R"({"zip": "3000"})"));  // city is required
  EXPECT_FALSE(accepts(r.params.grammar, R"([{"name": "now", "parameters": {}}])"));
  // "required": vLLM's array of {name, parameters}, at least one.
  r = parse_request(base + R"(, "tool_choice": "required"})", Endpoint::kChat);
  ASSERT_TRUE(r.params.grammar);
  EXPECT_TRUE(accepts(r.params.grammar, R"([{"name": "now", "parameters": {}}])"));
  EXPECT_TRUE(accepts(r.params.grammar, R"([{"name": "get_weather", "parameters": {"city": "B"}},)"
                                        R"( {"name": "now", "parameters": {}}])"));
  EXPECT_FALSE(accepts(r.params.grammar, "[]"));
  EXPECT_FALSE(accepts(r.params.grammar, R"([{"name": "get_weather", "parameters": {}}])"));
  EXPECT_FALSE(accepts(r.params.grammar, R"([{"name": "later", "parameters": {}}])"));
  EXPECT_FALSE(accepts(r.params.grammar, R"({"city": "Bern"})"));
  // "auto" and "none" leave the output free.
  EXPECT_FALSE(parse_request(base + "}", Endpoint::kChat).params.grammar);
  EXPECT_FALSE(parse_request(base + R"(, "tool_choice": "none"})", Endpoint::kChat).params.grammar);
  // response_format text is no constraint, so it combines.
  EXPECT_TRUE(parse_request(base + R"(, "tool_choice": "required",
                                        "response_format": {"type": "text"}})",
                            Endpoint::kChat)
                  .params.grammar);
}

TEST(ToolRequests, ForcedToolChoiceRefusals) {
  const std::string user = R"({"messages": [{"role": "user", "content": "x"}], "tools": [)";
  const auto refusal = [](const std::string& body) {
    try {
      parse_request(body, Endpoint::kChat);
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status, 400) << body;
      EXPECT_EQ(e.param, "tool_choice") << body;
      return std::string(e.what());
    }
    ADD_FAILURE() << "no refusal: " << body;
    return std::string();
  };
  // One constraint per output: a JSON response_format or guided_json beside a forced call.
  for (const char* other :
       {R"("response_format": {"type": "json_object"})", R"("guided_json": {"type": "object"})"}) {
    for (const char* choice :
         {R"("required")", R"({"type": "function", "function": {"name": "get_weather"}})"}) {
      refusal(user + kWeatherTool + R"(], "tool_choice": )" + choice + ", " + other + "}");
    }
  }
  // A parameters keyword the grammar does not follow: named in the message, for either mode.
  const std::string refused_tool = R"({"type": "function", "function": {"name": "f",
      "parameters": {"type": "object", "properties": {"n": {"type": "integer",
      "multipleOf": 2}}}}})";
  for (const char* choice :
       {R"("required")", R"({"type": "function", "function": {"name": "f"}})"}) {
    const std::string message =
        refusal(user + refused_tool + R"(], "tool_choice": )" + choice + "}");
    EXPECT_NE(message.find("multipleOf"), std::string::npos) << message;
  }
  // "auto" with the same tool is not constrained, so not refused.
  EXPECT_NO_THROW(parse_request(user + refused_tool + "]}", Endpoint::kChat));
}

TEST(ToolRequests, TokenizeTakesToolsAndTemplateKwargs) {
  const TokenizeRequest t = parse_tokenize_request(
      std::string(R"({"messages": [{"role": "user", "content": "x"}], "tools": [)") + kWeatherTool +
      R"(], "chat_template_kwargs": {"enable_thinking": false}})");
  EXPECT_EQ(t.request.tools.size(), 1u);
  EXPECT_EQ(t.request.tools[0]["function"]["parameters"]["properties"].begin().key(), "zip");
  EXPECT_EQ(t.request.chat_template_kwargs["enable_thinking"], false);
}

// ---------------------------------------------------------------------------------------------
// The constrained-decoding hook

TEST(ToolChoiceSchema, NamedAndRequired) {
  const ordered_json tools = normalize_tools(
      ordered_json::parse(std::string("[") + kWeatherTool + R"(, {"function": {"name": "now"}}])"));
  const ToolChoice named{.mode = ToolChoice::Mode::kNamed, .name = "get_weather"};
  EXPECT_EQ(tool_choice_json_schema(named, tools), tools[0]["function"]["parameters"]);
  const ordered_json required =
      tool_choice_json_schema({.mode = ToolChoice::Mode::kRequired}, tools);
  EXPECT_EQ(required["type"], "array");
  EXPECT_EQ(required["minItems"], 1);
  ASSERT_EQ(required["items"]["anyOf"].size(), 2u);
  EXPECT_EQ(required["items"]["anyOf"][1]["properties"]["name"]["enum"][0], "now");
  EXPECT_EQ(required["items"]["anyOf"][1]["properties"]["parameters"]["type"], "object");

  ToolCallIds ids(3);
  auto calls = tool_calls_from_forced_output(named, R"({"city": "Oslo"})", ids);
  EXPECT_EQ(calls_of(calls), (std::vector<Call>{{"get_weather", R"({"city": "Oslo"})"}}));
  calls = tool_calls_from_forced_output(
      {.mode = ToolChoice::Mode::kRequired},
      R"([{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"city":"B"}}])",
      ids);
  EXPECT_EQ(calls_of(calls),
            (std::vector<Call>{{"now", "{}"}, {"get_weather", R"({"city": "B"})"}}));
  EXPECT_TRUE(tool_calls_from_forced_output(named, "{oops", ids).empty());
}

// ---------------------------------------------------------------------------------------------
// The families' templates render the tools (the styles of tests/fixtures/templates, which the
// template differential tests hold to jinja2)

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

std::string render_fixture(const char* name, const std::string& body) {
  const ChatTemplate tmpl =
      ChatTemplate::parse(read_text(std::filesystem::path(MOE_FIXTURES_DIR) / "templates" / name));
  const ApiRequest r = parse_request(body, Endpoint::kChat);
  return apply_chat_template(tmpl, r.messages, true, {.bos_token = "<s>", .eos_token = "</s>"},
                             {.tools = r.tools, .variables = r.chat_template_kwargs});
}

TEST(ToolTemplates, QwenStyleRendersToolsCallsResultsAndKwargs) {
  const std::string text = render_fixture(
      "chat_qwen3_style.jinja",
      std::string(R"({"messages": [{"role": "user", "content": "weather in Bern?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Bern\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], "tools": [)") +
          kWeatherTool + R"(], "chat_template_kwargs": {"enable_thinking": false}})");
  EXPECT_NE(text.find("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
                      "\"description\": null, \"parameters\": {\"type\": \"object\", "
                      "\"properties\": {\"zip\""),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                      "\"Bern\"}}\n</tool_call>"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("<tool_response>\nsunny\n</tool_response>"), std::string::npos) << text;
  EXPECT_TRUE(text.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n")) << text;
}

TEST(ToolTemplates, MistralStyleRendersToolsAndNineCharacterIds) {
  const std::string text =
      render_fixture("chat_mistral_style.jinja",
                     std::string(R"({"messages": [{"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [{"id": "abcDEF123", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Bern\"}"}}]},
        {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny"},
        {"role": "user", "content": "and tomorrow?"}], "tools": [)") +
                         kWeatherTool + "]}");
  // One entry per tool before the last user turn. The fixture builds each entry's fields with a
  // `set` inside a for loop, which jinja2 scopes to the loop, so the fields stay empty there too.
  EXPECT_NE(text.find("[AVAILABLE_TOOLS] [{\"type\": \"function\", \"function\": {}}]"
                      "[/AVAILABLE_TOOLS][INST] and tomorrow?[/INST]"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                      "\"Bern\"}, \"id\": \"abcDEF123\"}]</s>"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("[TOOL_RESULTS] {\"content\": sunny, \"call_id\": \"abcDEF123\"}"),
            std::string::npos)
      << text;
}

TEST(ToolTemplates, DeepSeekStyleRendersCallsAndOutputs) {
  const std::string text = render_fixture("chat_deepseek_style.jinja",
                                          R"({"messages": [{"role": "user", "content": "weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Bern\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]})");
  EXPECT_NE(text.find("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                      "get_weather\n```json\n{\"city\": \"Bern\"}\n```<｜tool▁call▁end｜>"
                      "<｜tool▁calls▁end｜>"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>"), std::string::npos)
      << text;
  // What the template writes for a call, the deepseek_v3 parser reads back.
  const size_t at = text.find("<｜tool▁calls▁begin｜>");
  const size_t end = text.find("<｜tool▁calls▁end｜>") + std::string("<｜tool▁calls▁end｜>").size();
  const auto p = parse(kDeepSeek, text.substr(at, end - at));
  EXPECT_EQ(calls_of(p.calls), (std::vector<Call>{{"get_weather", R"({"city": "Bern"})"}}));
}

// ---------------------------------------------------------------------------------------------
// Responses and stream chunks

class ToolChoiceSetTest : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    const auto demo = std::filesystem::path(MOE_FIXTURES_DIR) / ".." / ".." / "models" / "demo" /
                      "tokenizer.json";
    tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::from_file(demo));
  }
  static ApiRequest request(const std::string& extra, ToolCallFormat format) {
    ApiRequest r = parse_request(std::string(R"({"messages": [{"role": "user", "content": "x"}],
                                                 "tools": [)") +
                                     kWeatherTool + "]" + extra + "}",
                                 Endpoint::kChat);
    resolve_tool_parser(r, format);
    return r;
  }
  static RequestOutput output(int64_t index, const std::string& text, bool finish) {
    RequestOutput out{.id = 1, .index = index, .token_ids = {42}, .text = text};
    out.finish = finish ? FinishReason::kStop : FinishReason::kNone;
    out.last = finish;
    out.num_prompt_tokens = 3;
    out.num_output_tokens = 1;
    return out;
  }
  static ResponseInfo info() {
    return {.endpoint = Endpoint::kChat, .id = "chatcmpl-1", .created = 1, .model = "demo"};
  }
  static std::unique_ptr<Tokenizer> tokenizer_;
};
std::unique_ptr<Tokenizer> ToolChoiceSetTest::tokenizer_;

const std::string kTwoCalls =
    "On it.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Bern\"}}\n"
    "</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}"
    "\n</tool_call>";

TEST_F(ToolChoiceSetTest, ResponseCarriesToolCalls) {
  ChoiceSet set(request("", kHermes), info(), *tokenizer_, {1, 2, 3});
  set.add(output(0, kTwoCalls, true));
  const json res = set.response();
  const json& choice = res["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  EXPECT_EQ(choice["message"]["content"], "On it.");
  ASSERT_EQ(choice["message"]["tool_calls"].size(), 2u);
  const json& call = choice["message"]["tool_calls"][1];
  EXPECT_EQ(call["type"], "function");
  EXPECT_EQ(call["id"].get<std::string>().substr(0, 14), "chatcmpl-tool-");
  EXPECT_EQ(call["function"]["name"], "get_weather");
  EXPECT_EQ(call["function"]["arguments"], R"({"city": "Oslo"})");
  EXPECT_FALSE(call.contains("index"));
}

TEST_F(ToolChoiceSetTest, WithoutCallsOrWithoutParsingTheTextIsTheContent) {
  ChoiceSet plain(request("", kHermes), info(), *tokenizer_, {1});
  plain.add(output(0, "just text", true));
  json res = plain.response();
  EXPECT_EQ(res["choices"][0]["message"]["content"], "just text");
  EXPECT_FALSE(res["choices"][0]["message"].contains("tool_calls"));
  EXPECT_EQ(res["choices"][0]["finish_reason"], "stop");

  ChoiceSet none(request(R"(, "tool_choice": "none")", kHermes), info(), *tokenizer_, {1});
  none.add(output(0, kTwoCalls, true));
  res = none.response();
  EXPECT_EQ(res["choices"][0]["message"]["content"], kTwoCalls);
  EXPECT_EQ(res["choices"][0]["finish_reason"], "stop");
}

TEST_F(ToolChoiceSetTest, ParallelToolCallsFalseKeepsTheFirst) {
  ChoiceSet set(request(R"(, "parallel_tool_calls": false)", kHermes), info(), *tokenizer_, {1});
  set.add(output(0, kTwoCalls, true));
  const json res = set.response();
  ASSERT_EQ(res["choices"][0]["message"]["tool_calls"].size(), 1u);
  EXPECT_EQ(res["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
            R"({"city": "Bern"})");
}

const char* kNamedChoice =
    R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}})";
const std::string kForcedTwo = R"([{"name": "get_weather", "parameters": {"city": "Bern"}},)"
                               R"( {"name": "get_weather", "parameters": {"city":"Oslo"}}])";

TEST_F(ToolChoiceSetTest, ForcedOutputBecomesToolCalls) {
  // "required": one call per element, content null, finish_reason tool_calls (vLLM's).
  ChoiceSet required(request(R"(, "tool_choice": "required")", kHermes), info(), *tokenizer_, {1});
  required.add(output(0, kForcedTwo, true));
  json res = required.response();
  const json& choice = res["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  EXPECT_TRUE(choice["message"]["content"].is_null());
  ASSERT_EQ(choice["message"]["tool_calls"].size(), 2u);
  EXPECT_EQ(choice["message"]["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(choice["message"]["tool_calls"][1]["function"]["arguments"], R"({"city": "Oslo"})");
  EXPECT_EQ(choice["message"]["tool_calls"][1]["id"].get<std::string>().substr(0, 14),
            "chatcmpl-tool-");

  // A named function: the output is the arguments, as written; finish_reason stays "stop".
  ChoiceSet named(request(kNamedChoice, kHermes), info(), *tokenizer_, {1});
  named.add(output(0, R"({"city":"Bern"})", true));
  res = named.response();
  EXPECT_EQ(res["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(res["choices"][0]["message"]["content"].is_null());
  ASSERT_EQ(res["choices"][0]["message"]["tool_calls"].size(), 1u);
  EXPECT_EQ(res["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(res["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
            R"({"city":"Bern"})");

  // parallel_tool_calls false keeps the first.
  ChoiceSet one(request(R"(, "tool_choice": "required", "parallel_tool_calls": false)", kHermes),
                info(), *tokenizer_, {1});
  one.add(output(0, kForcedTwo, true));
  EXPECT_EQ(one.response()["choices"][0]["message"]["tool_calls"].size(), 1u);

  // Cut off by max_tokens before the JSON is complete: no call, the text, "length".
  ChoiceSet cut(request(R"(, "tool_choice": "required")", kHermes), info(), *tokenizer_, {1});
  RequestOutput partial = output(0, R"([{"name": "get_we)", true);
  partial.finish = FinishReason::kLength;
  cut.add(partial);
  res = cut.response();
  EXPECT_EQ(res["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(res["choices"][0]["message"]["content"], R"([{"name": "get_we)");
  EXPECT_FALSE(res["choices"][0]["message"].contains("tool_calls"));
}

TEST_F(ToolChoiceSetTest, ForcedOutputIsStreamedAsCallsOnceComplete) {
  for (const bool is_named : {false, true}) {
    const std::string text = is_named ? R"({"city": "Bern"})" : kForcedTwo;
    ChoiceSet set(request(std::string(is_named ? kNamedChoice : R"(, "tool_choice": "required")") +
                              R"(, "stream": true)",
                          kHermes),
                  info(), *tokenizer_, {1});
    std::vector<json> chunks;
    for (size_t i = 0; i < text.size(); i += 4) {
      for (json& c : set.stream(output(0, text.substr(i, 4), i + 4 >= text.size())))
        chunks.push_back(c);
    }
    std::string content;
    std::vector<json> calls;
    json finish;
    for (const json& chunk : chunks) {
      const json& choice = chunk["choices"][0];
      if (choice["delta"].contains("content") && choice["delta"]["content"].is_string())
        content += choice["delta"]["content"].get<std::string>();
      if (choice["delta"].contains("tool_calls")) {
        EXPECT_FALSE(choice["finish_reason"].is_null());  // sent with the last output
        for (const json& call : choice["delta"]["tool_calls"]) calls.push_back(call);
      }
      if (!choice["finish_reason"].is_null()) finish = choice["finish_reason"];
    }
    EXPECT_EQ(content, "") << is_named;  // no JSON ever reaches delta.content
    ASSERT_EQ(calls.size(), is_named ? 1u : 2u);
    for (size_t i = 0; i < calls.size(); ++i) {
      EXPECT_EQ(calls[i]["index"], static_cast<int64_t>(i));
      EXPECT_EQ(calls[i]["type"], "function");
      EXPECT_EQ(calls[i]["function"]["name"], "get_weather");
    }
    EXPECT_EQ(calls[0]["function"]["arguments"], R"({"city": "Bern"})");
    EXPECT_EQ(finish, is_named ? "stop" : "tool_calls");
  }
}

TEST_F(ToolChoiceSetTest, StreamedCallsAreDeltasWithTheirIndex) {
  ApiRequest r = request(R"(, "stream": true, "n": 2)", kHermes);
  ChoiceSet set(r, info(), *tokenizer_, {1, 2, 3});
  std::vector<json> chunks;
  // Choice 0 gets the two calls a few bytes at a time; choice 1 plain text.
  for (size_t i = 0; i < kTwoCalls.size(); i += 5) {
    const bool last = i + 5 >= kTwoCalls.size();
    for (json& c : set.stream(output(0, kTwoCalls.substr(i, 5), last))) chunks.push_back(c);
  }
  for (json& c : set.stream(output(1, "<tool", false))) chunks.push_back(c);
  for (json& c : set.stream(output(1, "s>", true))) chunks.push_back(c);

  std::string content[2];
  std::vector<json> calls;
  json finish[2];
  for (const json& chunk : chunks) {
    const json& choice = chunk["choices"][0];
    const int64_t index = choice["index"].get<int64_t>();
    const json& delta = choice["delta"];
    if (delta.contains("content")) {
      content[index] += delta["content"].get<std::string>();
      EXPECT_EQ(delta["content"].get<std::string>().find("<tool_call"), std::string::npos);
    }
    if (delta.contains("tool_calls")) {
      EXPECT_EQ(index, 0);
      for (const json& call : delta["tool_calls"]) calls.push_back(call);
    }
    if (!choice["finish_reason"].is_null()) finish[index] = choice["finish_reason"];
  }
  EXPECT_EQ(content[0], "On it.");
  EXPECT_EQ(content[1], "<tools>");
  ASSERT_EQ(calls.size(), 2u);
  for (int64_t i = 0; i < 2; ++i) {
    EXPECT_EQ(calls[i]["index"], i);
    EXPECT_EQ(calls[i]["type"], "function");
    EXPECT_EQ(calls[i]["id"].get<std::string>().substr(0, 14), "chatcmpl-tool-");
    EXPECT_EQ(calls[i]["function"]["name"], "get_weather");
  }
  EXPECT_EQ(calls[1]["function"]["arguments"], R"({"city": "Oslo"})");
  EXPECT_EQ(finish[0], "tool_calls");
  EXPECT_EQ(finish[1], "stop");
}

}  // namespace
}  // namespace moeinfer::server
