// GPT-OSS's published chat template (the harmony format: system and developer messages, analysis
// and final channels, tool calls to functions.*, builtin browser and python tools) rendered by the
// engine against transformers' apply_chat_template on the same conversations
// (tools/make_published_template_fixtures.py). The template prints today's date; the references
// were made with the clock pinned, so the engine's date is put in that place before comparing.
#include <gtest/gtest.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "core/error.h"
#include "io/chat_template.h"

namespace moeinfer {
namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

const fs::path kPublished = fs::path(MOE_FIXTURES_DIR) / "templates" / "published";
constexpr std::string_view kPinnedDate = "Current date: 2025-08-05\n";

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << "cannot open " << path;
  std::ostringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

// The engine's output with its "Current date: YYYY-MM-DD" line set to the pinned date.
std::string with_pinned_date(std::string text) {
  const size_t at = text.find("Current date: ");
  if (at == std::string::npos || at + kPinnedDate.size() > text.size()) return text;
  const std::string date = text.substr(at + 14, 10);
  const bool shaped = date.size() == 10 && date[4] == '-' && date[7] == '-' &&
                      std::isdigit(static_cast<unsigned char>(date[0])) &&
                      std::isdigit(static_cast<unsigned char>(date[9]));
  if (!shaped || text[at + 24] != '\n') return text;
  return text.replace(at, kPinnedDate.size(), kPinnedDate);
}

TEST(GptOssChatTemplate, RendersAsTransformersDoes) {
  const std::string source = read_text(kPublished / "gpt_oss.jinja");
  ASSERT_EQ(source.size(), 16738u);  // the published file, byte for byte
  const ChatTemplate tmpl = ChatTemplate::parse(source);
  const ordered_json cases = ordered_json::parse(read_text(kPublished / "gpt_oss.cases.json"));
  ASSERT_GE(cases.size(), 8u);
  int rendered = 0, refused = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const ordered_json& c = cases[i];
    SCOPED_TRACE("case " + std::to_string(i) + ": " + c["messages"].dump().substr(0, 120));
    const ChatTemplateExtras extras{.tools = c["tools"], .variables = c["kwargs"]};
    if (c.contains("error")) {
      try {
        apply_chat_template(tmpl, c["messages"], c["add_generation_prompt"].get<bool>(),
                            ChatConfig{}, extras);
        ADD_FAILURE() << "transformers raised, the engine rendered";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(c["error"].get<std::string>()), std::string::npos)
            << e.what();
      }
      ++refused;
      continue;
    }
    const std::string ours = apply_chat_template(
        tmpl, c["messages"], c["add_generation_prompt"].get<bool>(), ChatConfig{}, extras);
    EXPECT_EQ(with_pinned_date(ours), c["output"].get<std::string>());
    ++rendered;
  }
  EXPECT_GE(rendered, 7);
  EXPECT_GE(refused, 1);
}

}  // namespace
}  // namespace moeinfer
