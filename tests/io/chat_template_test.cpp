// Chat templates against Python jinja2: every fixture under fixtures/templates was rendered by
// jinja2 configured as transformers configures it (tools/make_template_fixtures.py); the output
// here must match byte for byte, and where jinja2 raised, ChatTemplate must throw moeinfer::Error.
#include "io/chat_template.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "../support/temp_path.h"

namespace moeinfer {
namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

const fs::path kTemplates = fs::path(MOE_FIXTURES_DIR) / "templates";

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << "cannot open " << path;
  std::ostringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

std::vector<std::string> fixture_names() {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(kTemplates)) {
    if (entry.path().extension() == ".jinja") names.push_back(entry.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string render(std::string_view source, const ordered_json& context) {
  return ChatTemplate::parse(source).render(context);
}

// Runs `fn` and returns the moeinfer::Error message it throws ("" and a failure if none).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-moeinfer exception: " << e.what();
    return e.what();
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

class JinjaParity : public ::testing::TestWithParam<std::string> {};

TEST_P(JinjaParity, MatchesPythonJinja2) {
  const std::string name = GetParam();
  const std::string source = read_text(kTemplates / (name + ".jinja"));
  const ordered_json cases = ordered_json::parse(read_text(kTemplates / (name + ".cases.json")));
  ASSERT_FALSE(cases.empty());
  for (size_t i = 0; i < cases.size(); ++i) {
    const ordered_json& c = cases[i];
    SCOPED_TRACE(name + " case " + std::to_string(i));
    if (c.contains("output")) {
      std::string got;
      try {
        got = render(source, c["context"]);
      } catch (const Error& e) {
        ADD_FAILURE() << "jinja2 rendered it but moeinfer threw: " << e.what();
        continue;
      }
      EXPECT_EQ(got, c["output"].get<std::string>());
    } else {
      std::string message = error_of([&] { render(source, c["context"]); });
      // raise_exception's message reaches the caller unchanged.
      if (c["error_type"] == "TemplateError") {
        EXPECT_NE(message.find(c["error"].get<std::string>()), std::string::npos) << message;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, JinjaParity, ::testing::ValuesIn(fixture_names()),
                         [](const auto& info) { return info.param; });

TEST(ChatTemplate, FixturesArePresent) {
  auto names = fixture_names();
  EXPECT_GE(names.size(), 30u);
  for (const char* family :
       {"chat_qwen3_style", "chat_llama3_style", "chat_mistral_style", "chat_deepseek_style"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), family), names.end()) << family;
  }
}

TEST(ChatTemplate, RaiseExceptionCarriesMessageAndLine) {
  std::string message = error_of([] {
    render("line one\n{% if true %}\n{{ raise_exception('roles must alternate') }}\n{% endif %}",
           ordered_json::object());
  });
  EXPECT_NE(message.find("roles must alternate"), std::string::npos) << message;
  EXPECT_NE(message.find("line 3"), std::string::npos) << message;
}

TEST(ChatTemplate, SyntaxErrorsNameTheLine) {
  std::string message = error_of([] { ChatTemplate::parse("ok\nok\n{{ 1 + }}\n"); });
  EXPECT_NE(message.find("line 3"), std::string::npos) << message;

  message = error_of([] { ChatTemplate::parse("{% for x in y %}\n{{ x }}\n"); });
  EXPECT_NE(message.find("endfor"), std::string::npos) << message;

  message = error_of([] { ChatTemplate::parse("\n{% frobnicate %}"); });
  EXPECT_NE(message.find("line 2"), std::string::npos) << message;
  EXPECT_NE(message.find("frobnicate"), std::string::npos) << message;

  error_of([] { ChatTemplate::parse("{{ 'unterminated }}"); });
  error_of([] { ChatTemplate::parse("{% if x %}a{% endfor %}"); });
  error_of([] { ChatTemplate::parse("{{ (1, 2 }}"); });
}

TEST(ChatTemplate, UnknownFilterFailsAtParseUnlessInsideIf) {
  std::string message = error_of([] { ChatTemplate::parse("\n\n{{ x | no_such_filter }}"); });
  EXPECT_NE(message.find("no_such_filter"), std::string::npos) << message;
  EXPECT_NE(message.find("line 3"), std::string::npos) << message;
  error_of([] { ChatTemplate::parse("{{ x is no_such_test }}"); });

  // jinja2 defers the error to run time inside `if`: the branch not taken renders fine.
  auto tmpl = ChatTemplate::parse("{% if flag %}{{ x | no_such_filter }}{% endif %}ok");
  EXPECT_EQ(tmpl.render({{"flag", false}}), "ok");
  error_of([&] { tmpl.render({{"flag", true}}); });
}

TEST(ChatTemplate, RuntimeErrorsNameTheLine) {
  std::string message = error_of([] { render("a\nb\n{{ nope.attr }}", ordered_json::object()); });
  EXPECT_NE(message.find("line 3"), std::string::npos) << message;
  EXPECT_NE(message.find("nope"), std::string::npos) << message;
  error_of([] { render("{{ 'a' + 1 }}", ordered_json::object()); });
  error_of([] { render("{{ 1 // 0 }}", ordered_json::object()); });
  error_of([] { render("{% set l = [] %}{{ l.append(1) }}", ordered_json::object()); });
  error_of([] { render("{% for x in v %}{% endfor %}", {{"v", nullptr}}); });
}

TEST(ChatTemplate, UndefinedBehavesLikeJinja2Default) {
  ordered_json ctx = {{"d", ordered_json::object()}};
  EXPECT_EQ(render("[{{ missing }}][{{ d.key }}][{{ missing | length }}][{% for x in missing %}x"
                   "{% endfor %}][{{ missing is defined }}]",
                   ctx),
            "[][][0][][False]");
  error_of([&] { render("{{ d.key.deeper }}", ctx); });
}

TEST(ChatTemplate, PythonValueFormatting) {
  ordered_json ctx = ordered_json::parse(R"({"v": [1, 2.0, "it's", null, true, {"k": [0.1]}]})");
  EXPECT_EQ(render("{{ v }}", ctx), R"([1, 2.0, "it's", None, True, {'k': [0.1]}])");
  EXPECT_EQ(render("{{ 1e16 }} {{ 1/3 }} {{ 1.5e-7 }}", ordered_json::object()),
            "1e+16 0.3333333333333333 1.5e-07");
  // transformers' tojson keeps key order and non-ASCII text.
  ctx = ordered_json::parse(R"({"v": {"b": "é", "a": 1}})");
  EXPECT_EQ(render("{{ v | tojson }}", ctx), R"({"b": "é", "a": 1})");
  EXPECT_EQ(render("{{ v | tojson(sort_keys=true, ensure_ascii=true) }}", ctx),
            R"({"a": 1, "b": "\u00e9"})");
}

TEST(ChatTemplate, TrimAndLstripBlocksAsTransformersSetsThem) {
  EXPECT_EQ(render("a\n  {% if true %}\n  b\n  {% endif %}\nc\n", ordered_json::object()),
            "a\n  b\nc");
  EXPECT_EQ(render("x  {%- if true -%}  y  {%- endif %}", ordered_json::object()), "xy");
}

TEST(ChatTemplate, TransformersGlobals) {
  // strftime_now reads the clock, so only its shape is checked here.
  EXPECT_EQ(render("{{ strftime_now('%Y-%m-%d') | length }}", ordered_json::object()), "10");
  EXPECT_EQ(render("{% set ns = namespace(n=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}"
                   "{{ dict(a=1) }}{% generation %}g{% endgeneration %}",
                   ordered_json::object()),
            "2{'a': 1}g");
  error_of([] { render("{% set ns = namespace(_hidden=1) %}", ordered_json::object()); });
}

class ChatConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = moeinfer::testing::unique_temp_path("moeinfer_chat");
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  void write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name, std::ios::binary) << text;
  }
  fs::path dir_;
};

TEST_F(ChatConfigTest, MissingFilesGiveEmptyFields) {
  ChatConfig config = load_chat_config(dir_);
  EXPECT_FALSE(config.chat_template.has_value());
  EXPECT_EQ(config.bos_token, "");
  EXPECT_EQ(config.eos_token, "");
}

TEST_F(ChatConfigTest, ReadsStringTemplateAndAddedTokens) {
  write("tokenizer_config.json", R"({
    "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
    "eos_token": "</s>",
    "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}{{ eos_token }}"
  })");
  ChatConfig config = load_chat_config(dir_);
  ASSERT_TRUE(config.chat_template.has_value());
  EXPECT_EQ(config.bos_token, "<s>");
  EXPECT_EQ(config.eos_token, "</s>");
  auto tmpl = ChatTemplate::parse(*config.chat_template);
  ordered_json messages = ordered_json::parse(R"([{"role": "user", "content": "hi"}])");
  EXPECT_EQ(apply_chat_template(tmpl, messages, true, config), "<s>[user]hi[assistant]</s>");
  EXPECT_EQ(apply_chat_template(tmpl, messages, false, config), "<s>[user]hi</s>");
}

TEST_F(ChatConfigTest, TemplateListUsesDefaultAndJinjaFileWins) {
  write("tokenizer_config.json", R"({
    "chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "default"}]
  })");
  EXPECT_EQ(load_chat_config(dir_).chat_template.value_or(""), "default");
  write("chat_template.jinja", "from file");
  EXPECT_EQ(load_chat_config(dir_).chat_template.value_or(""), "from file");
}

TEST_F(ChatConfigTest, ApplyDropsNullKeysAndAliasesReasoning) {
  ChatConfig config;
  auto tmpl = ChatTemplate::parse(
      "{% for m in messages %}{{ m | tojson }}{{ tools is none }}{{ documents is none }}"
      "{{ bos_token is defined }}\n{% endfor %}");
  ordered_json messages =
      ordered_json::parse(R"([{"role": "assistant", "content": null, "reasoning": "why"}])");
  EXPECT_EQ(
      apply_chat_template(tmpl, messages, false, config),
      R"({"thinking": "why", "role": "assistant", "reasoning": "why", "reasoning_content": "why"})"
      "TrueTrueFalse\n");
  error_of([&] { apply_chat_template(tmpl, ordered_json::array(), false, config); });
}

}  // namespace
}  // namespace moeinfer
