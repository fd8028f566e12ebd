// Tokenizer against the `tokenizers` library: every fixture under fixtures/tokenizers was made by
// tools/make_tokenizer_fixtures.py, which stored the ids and decoded text `tokenizers` gives for
// each input. Also: StreamDecoder output equals decode(), byte-level round trips, the lookup API,
// and bad tokenizer.json files give moeinfer::Error naming the problem.
#include "io/tokenizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/unicode.h"

namespace moeinfer {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const fs::path kTokenizers = fs::path(MOE_FIXTURES_DIR) / "tokenizers";

json read_json(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << "cannot open " << path;
  return json::parse(in);
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

std::vector<std::string> fixture_names() {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(kTokenizers)) {
    if (fs::exists(entry.path() / "tokenizer.json")) names.push_back(entry.path().filename());
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string printable(const std::string& s) { return json(s).dump(); }

class TokenizerFixture : public ::testing::TestWithParam<std::string> {
 protected:
  fs::path dir() const { return kTokenizers / GetParam(); }
};

TEST_P(TokenizerFixture, EncodeAndDecodeMatchTokenizers) {
  const Tokenizer tok = Tokenizer::from_file(dir() / "tokenizer.json");
  const json meta = read_json(dir() / "cases.json");
  EXPECT_EQ(tok.vocab_size(), meta["vocab_size"].get<int64_t>());
  ASSERT_FALSE(meta["cases"].empty());
  for (const json& c : meta["cases"]) {
    const std::string text = c["text"].get<std::string>();
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(tok.encode(text), ids) << "input " << printable(text);
    EXPECT_EQ(tok.encode(text, /*add_special_tokens=*/false),
              c["ids_no_special"].get<std::vector<int32_t>>())
        << "input " << printable(text);
    EXPECT_EQ(tok.decode(ids), c["decoded"].get<std::string>()) << "input " << printable(text);
    EXPECT_EQ(tok.decode(ids, /*skip_special_tokens=*/true),
              c["decoded_skip_special"].get<std::string>())
        << "input " << printable(text);
  }
}

TEST_P(TokenizerFixture, StreamDecoderEqualsDecode) {
  const Tokenizer tok = Tokenizer::from_file(dir() / "tokenizer.json");
  const json meta = read_json(dir() / "cases.json");
  for (const json& c : meta["cases"]) {
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    for (const bool skip : {true, false}) {
      StreamDecoder stream(tok, skip);
      std::string streamed;
      for (const int32_t id : ids) {
        const std::string piece = stream.push(id);
        EXPECT_TRUE(unicode::is_valid_utf8(piece));
        streamed += piece;
      }
      streamed += stream.flush();
      EXPECT_EQ(streamed, tok.decode(ids, skip))
          << "input " << printable(c["text"].get<std::string>()) << " skip " << skip;
    }
  }
}

TEST_P(TokenizerFixture, LookupApiIsConsistent) {
  const Tokenizer tok = Tokenizer::from_file(dir() / "tokenizer.json");
  const json file = read_json(dir() / "tokenizer.json");
  for (const json& added : file["added_tokens"]) {
    const auto id = added["id"].get<int32_t>();
    const auto content = added["content"].get<std::string>();
    EXPECT_EQ(tok.token_to_id(content), id) << content;
    EXPECT_EQ(tok.id_to_token(id), content);
    EXPECT_EQ(tok.is_special(id), added["special"].get<bool>()) << content;
  }
  int64_t max_id = -1;
  for (const auto& [token, id] : file["model"]["vocab"].items()) {
    max_id = std::max<int64_t>(max_id, id.get<int64_t>());
    EXPECT_EQ(tok.token_to_id(token), id.get<int32_t>()) << token;
  }
  EXPECT_GE(tok.vocab_size(), max_id + 1);
  EXPECT_FALSE(tok.token_to_id("no such token \x01").has_value());
  EXPECT_THROW(tok.id_to_token(static_cast<int32_t>(tok.vocab_size()) + 5), Error);
  EXPECT_THROW(tok.id_to_token(-1), Error);
  // Ids outside the vocabulary are skipped by decode, as `tokenizers` does.
  const std::vector<int32_t> with_unknown = {static_cast<int32_t>(tok.vocab_size()) + 100};
  EXPECT_EQ(tok.decode(with_unknown), "");
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TokenizerFixture, ::testing::ValuesIn(fixture_names()),
                         [](const auto& info) { return info.param; });

TEST(Tokenizer, ByteLevelRoundTripsAnyText) {
  const Tokenizer tok = Tokenizer::from_file(kTokenizers / "qwen2_bytelevel" / "tokenizer.json");
  const std::vector<std::string> texts = {"",
                                          "plain",
                                          "  two\n\nlines\t\ttabs  ",
                                          "混合 text 😀👨‍👩‍👧",
                                          "\x01\x02\x7f",
                                          "<|im_start|>user\nhi<|im_end|>",
                                          std::string(2000, 'x') + " end"};
  for (const std::string& text : texts) {
    EXPECT_EQ(tok.decode(tok.encode(text)), text) << printable(text);
  }
}

TEST(Tokenizer, StreamDecoderHoldsBackIncompleteCharacters) {
  const Tokenizer tok = Tokenizer::from_file(kTokenizers / "mixtral_legacy" / "tokenizer.json");
  // A character outside the trained alphabet is spelled as <0xNN> byte tokens.
  const std::vector<int32_t> ids = tok.encode("ok 🦎", /*add_special_tokens=*/false);
  StreamDecoder stream(tok);
  std::string streamed;
  for (const int32_t id : ids) {
    const std::string piece = stream.push(id);
    EXPECT_TRUE(unicode::is_valid_utf8(piece)) << printable(piece);
    EXPECT_EQ(piece.find("\xEF\xBF\xBD"), std::string::npos) << "emitted a half character";
    streamed += piece;
  }
  streamed += stream.flush();
  EXPECT_EQ(streamed, "ok 🦎");
}

TEST(Tokenizer, IsMovable) {
  Tokenizer a = Tokenizer::from_file(kTokenizers / "gpt2_bytelevel" / "tokenizer.json");
  const auto ids = a.encode("moved");
  Tokenizer b = std::move(a);
  EXPECT_EQ(b.encode("moved"), ids);
}

TEST(Tokenizer, RejectsInvalidUtf8Input) {
  const Tokenizer tok = Tokenizer::from_file(kTokenizers / "qwen2_bytelevel" / "tokenizer.json");
  EXPECT_THROW(tok.encode("bad \xC3\x28 byte"), Error);
}

// Loads a fixture's tokenizer.json, lets `edit` break it, and returns the error message.
template <typename Edit>
std::string load_error(Edit edit) {
  json j = read_json(kTokenizers / "mixtral_legacy" / "tokenizer.json");
  edit(j);
  try {
    Tokenizer::from_json(j.dump(), "broken.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

TEST(Tokenizer, BadFilesGiveErrorsNamingTheProblem) {
  auto expect_error = [](const std::string& message, const std::string& needle) {
    EXPECT_NE(message.find("broken.json"), std::string::npos) << message;
    EXPECT_NE(message.find(needle), std::string::npos) << message;
  };
  expect_error(load_error([](json& j) { j["model"]["type"] = "WordPiece"; }), "WordPiece");
  expect_error(load_error([](json& j) { j["model"]["type"] = "Unigram"; }), "Unigram");
  expect_error(load_error([](json& j) { j.erase("model"); }), "model");
  expect_error(load_error([](json& j) {
                 j["normalizer"] = {{"type", "Precompiled"}};
               }),
               "Precompiled");
  expect_error(load_error([](json& j) {
                 j["pre_tokenizer"] = {{"type", "UnicodeScripts"}};
               }),
               "UnicodeScripts");
  expect_error(load_error([](json& j) { j["decoder"] = {{"type", "CTC"}}; }), "CTC");
  expect_error(load_error([](json& j) { j["post_processor"] = {{"type", "Weird"}}; }), "Weird");
  expect_error(load_error([](json& j) { j["model"]["merges"].push_back("zzz qqq"); }), "zzz");
  expect_error(load_error([](json& j) { j["model"]["merges"].push_back("a b c"); }), "a b c");
  expect_error(load_error([](json& j) { j["model"]["dropout"] = 0.1; }), "dropout");
  expect_error(load_error([](json& j) { j["model"]["vocab"]["x"] = "not a number"; }), "");
  expect_error(load_error([](json& j) {
                 j["pre_tokenizer"] = {{"type", "Split"},
                                       {"pattern", {{"Regex", "(unclosed"}}},
                                       {"behavior", "Isolated"},
                                       {"invert", false}};
               }),
               "(unclosed");
  expect_error(load_error([](json& j) {
                 j["pre_tokenizer"] = {{"type", "Split"},
                                       {"pattern", {{"String", " "}}},
                                       {"behavior", "Sideways"},
                                       {"invert", false}};
               }),
               "Sideways");
  expect_error(load_error([](json& j) { j["post_processor"]["special_tokens"] = json::object(); }),
               "<s>");
  // A Strip decoder's counts must be whole non-negative numbers: a float past size_t's range
  // (a fuzzer's find) or a negative one is refused by name, not converted.
  for (const json& start : {json(7.7e69), json(-1), json(1.5), json("2")}) {
    expect_error(load_error([&](json& j) {
                   j["decoder"] = {{"type", "Strip"}, {"content", " "}, {"start", start}};
                 }),
                 "\"start\" must be a non-negative integer");
  }

  EXPECT_THROW(Tokenizer::from_json("{not json", "broken.json"), Error);
  EXPECT_THROW(Tokenizer::from_json("[]", "broken.json"), Error);
  try {
    Tokenizer::from_file("/nonexistent/dir/tokenizer.json");
    FAIL() << "no error for a missing file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir/tokenizer.json"), std::string::npos);
  }
}

TEST(Tokenizer, LongTextUsesTheWordCache) {
  const Tokenizer tok = Tokenizer::from_file(kTokenizers / "qwen2_bytelevel" / "tokenizer.json");
  const std::vector<std::string> words = {"the",  "experts", "routing", "中文", "😀", "1234",
                                          "\n\n", "  ",      "Größe",   "it's", ",", "token"};
  std::string text;
  for (size_t i = 0; text.size() < (1u << 20); ++i) {
    text += words[(i * 7 + i / 13) % words.size()];
    text += ' ';
  }
  const auto ids = tok.encode(text, false);
  EXPECT_GT(ids.size(), text.size() / 8);
  EXPECT_TRUE(tok.decode(ids) == text);  // not EXPECT_EQ: a 1 MB diff would be useless
}

}  // namespace
}  // namespace moeinfer
