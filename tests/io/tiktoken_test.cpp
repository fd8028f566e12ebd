// The tiktoken-style tokenizer (Kimi K2) against the `tiktoken` package: the fixture
// fixtures/tokenizers/kimi_tiktoken was made by tools/make_tokenizer_fixtures.py, which stored the
// ids tiktoken gives (with Kimi's split pattern and special tokens, as its TikTokenTokenizer
// encodes) and the decoded text. Also: the special-token layout, the lookup API, the stream
// decoder, the pattern rewrite for PCRE2, and the refusals (bad rank files, an unknown tokenizer
// class) with messages that name the problem. Random strings against tiktoken itself:
// tests/e2e/test_tiktoken_diff.py.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/tokenizer.h"
#include "io/tokenizer_internal.h"
#include "io/unicode.h"
#include "../support/temp_path.h"

namespace moeinfer {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const fs::path kKimi = fs::path(MOE_FIXTURES_DIR) / "tokenizers" / "kimi_tiktoken";

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

std::string printable(const std::string& s) { return json(s).dump(); }

// A scratch folder with the fixture's files, some of them replaced.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& name)
      : path_(moeinfer::testing::unique_temp_path("moeinfer_tiktoken_" + name)) {
    fs::remove_all(path_);
    fs::create_directories(path_);
    for (const char* file : {"tiktoken.model", "tokenizer_config.json"})
      fs::copy_file(kKimi / file, path_ / file);
  }
  ~ScratchDir() { fs::remove_all(path_); }
  void write(const std::string& file, const std::string& text) const {
    std::ofstream(path_ / file, std::ios::binary | std::ios::trunc) << text;
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::string load_error(const fs::path& dir) {
  try {
    Tokenizer::from_dir(dir);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Tiktoken, EncodeAndDecodeMatchTiktoken) {
  const Tokenizer tok = Tokenizer::from_dir(kKimi);
  const json meta = read_json(kKimi / "cases.json");
  EXPECT_EQ(tok.vocab_size(), meta["vocab_size"].get<int64_t>());
  ASSERT_GE(meta["cases"].size(), 30u);
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

TEST(Tiktoken, SpecialTokensFollowTheRanks) {
  const Tokenizer tok = Tokenizer::from_dir(kKimi);
  const json meta = read_json(kKimi / "cases.json");
  const json config = read_json(kKimi / "tokenizer_config.json");
  const auto num_base = meta["num_base"].get<int32_t>();
  for (const auto& [key, entry] : config["added_tokens_decoder"].items()) {
    const int32_t id = std::stoi(key);
    const std::string content = entry["content"].get<std::string>();
    EXPECT_EQ(tok.token_to_id(content), id) << content;
    EXPECT_EQ(tok.id_to_token(id), content);
    EXPECT_TRUE(tok.is_special(id)) << content;
    const int32_t one[] = {id};
    EXPECT_EQ(tok.decode(one), content);
    EXPECT_EQ(tok.decode(one, /*skip_special_tokens=*/true), "");
  }
  // Ids without a name are <|reserved_token_<id>|>: encoded as one id, and kept by
  // skip_special_tokens (transformers' class knows only the named ones as special).
  const int32_t reserved = num_base + 100;
  const std::string name = "<|reserved_token_" + std::to_string(reserved) + "|>";
  EXPECT_EQ(tok.id_to_token(reserved), name);
  EXPECT_EQ(tok.encode("a" + name + "b").at(1), reserved);
  EXPECT_FALSE(tok.is_special(reserved));
  const int32_t one[] = {reserved};
  EXPECT_EQ(tok.decode(one, /*skip_special_tokens=*/true), name);
  EXPECT_EQ(tok.vocab_size(), num_base + 256);
  EXPECT_THROW(tok.id_to_token(num_base + 256), Error);
}

TEST(Tiktoken, LookupUsesByteLevelStrings) {
  const Tokenizer tok = Tokenizer::from_dir(kKimi);
  const std::string ranks = read_text(kKimi / "tiktoken.model");
  // Every rank's bytes, shown in the GPT-2 byte alphabet, maps back to its rank.
  const auto& chars = unicode::byte_to_chars();
  std::istringstream lines(ranks);
  std::string b64;
  int32_t rank = 0;
  int64_t checked = 0;
  while (lines >> b64 >> rank) {
    const std::string token = tok.id_to_token(rank);
    EXPECT_EQ(tok.token_to_id(token), rank) << b64;
    ++checked;
  }
  EXPECT_EQ(checked, read_json(kKimi / "cases.json")["num_base"].get<int64_t>());
  EXPECT_EQ(tok.id_to_token(*tok.token_to_id(chars[' '])), chars[' ']);
}

TEST(Tiktoken, StreamDecoderEqualsDecode) {
  const Tokenizer tok = Tokenizer::from_dir(kKimi);
  const json meta = read_json(kKimi / "cases.json");
  for (const json& c : meta["cases"]) {
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    for (const bool skip : {true, false}) {
      StreamDecoder stream(tok, skip);
      std::string streamed;
      for (const int32_t id : ids) streamed += stream.push(id);
      streamed += stream.flush();
      EXPECT_EQ(streamed, tok.decode(ids, skip)) << printable(c["text"].get<std::string>());
    }
  }
}

TEST(Tiktoken, RewritesClassIntersectionsForPcre2) {
  EXPECT_EQ(tok::rewrite_class_intersections(R"([\p{Lu}\p{M}&&[^\p{Han}]]+x)"),
            R"((?:(?=[^\p{Han}])[\p{Lu}\p{M}])+x)");
  EXPECT_EQ(tok::rewrite_class_intersections(R"([a-z&&[^aeiou]&&[^x]])"),
            R"((?:(?=[^aeiou])(?=[^x])[a-z]))");
  // No intersection: unchanged, escaped brackets included.
  EXPECT_EQ(tok::rewrite_class_intersections(R"([^\r\n\p{L}]?\[&&\]|[\]&])"),
            R"([^\r\n\p{L}]?\[&&\]|[\]&])");
  EXPECT_THROW(tok::rewrite_class_intersections("[abc"), Error);
  EXPECT_THROW(tok::rewrite_class_intersections("[^a&&b]"), Error);
}

TEST(Tiktoken, MergesLowestRankFirstLeftmostOnTies) {
  // Bytes are ranks 0..255 in byte order; then "ab" (256), "bc" (257), "abc" (258), "cd" (259).
  std::string file;
  auto b64 = [](std::string_view bytes) {
    static const char* kAlphabet =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    for (size_t i = 0; i < bytes.size(); i += 3) {
      uint32_t n = static_cast<uint8_t>(bytes[i]) << 16;
      if (i + 1 < bytes.size()) n |= static_cast<uint8_t>(bytes[i + 1]) << 8;
      if (i + 2 < bytes.size()) n |= static_cast<uint8_t>(bytes[i + 2]);
      out += kAlphabet[(n >> 18) & 63];
      out += kAlphabet[(n >> 12) & 63];
      out += i + 1 < bytes.size() ? kAlphabet[(n >> 6) & 63] : '=';
      out += i + 2 < bytes.size() ? kAlphabet[n & 63] : '=';
    }
    return out;
  };
  for (int b = 0; b < 256; ++b)
    file += b64(std::string(1, static_cast<char>(b))) + " " + std::to_string(b) + "\n";
  int rank = 256;
  for (const char* t : {"ab", "bc", "abc", "cd"})
    file += b64(t) + " " + std::to_string(rank++) + "\n";
  const tok::TiktokenModel model(file, "<test>");
  auto ids = [&](std::string_view word) {
    std::vector<int32_t> out;
    model.tokenize(word, out);
    return out;
  };
  EXPECT_EQ(ids("abc"), (std::vector<int32_t>{258}));        // a whole token
  EXPECT_EQ(ids("abcd"), (std::vector<int32_t>{258, 'd'}));  // ab, then abc; cd never forms
  EXPECT_EQ(ids("bcd"), (std::vector<int32_t>{257, 'd'}));   // bc (257) before cd (259)
  EXPECT_EQ(ids("ababab"), (std::vector<int32_t>{256, 256, 256}));
  EXPECT_EQ(ids("xbcab"), (std::vector<int32_t>{'x', 257, 256}));
  EXPECT_EQ(model.id_to_token(258) != nullptr, true);
  EXPECT_EQ(*model.id_to_token(258), "abc");
  EXPECT_EQ(model.id_to_token(260), nullptr);
}

TEST(Tiktoken, RefusesBadRankFiles) {
  const std::string ranks = read_text(kKimi / "tiktoken.model");
  {
    ScratchDir dir("dup");
    dir.write("tiktoken.model", ranks + "YWJj 3\n");  // "abc" given rank 3, which "$" holds
    EXPECT_NE(load_error(dir.path()).find("rank"), std::string::npos) << load_error(dir.path());
  }
  {
    ScratchDir dir("base64");
    dir.write("tiktoken.model", "!!!! 0\n" + ranks);
    EXPECT_NE(load_error(dir.path()).find("not valid base64"), std::string::npos)
        << load_error(dir.path());
  }
  {
    ScratchDir dir("nobyte");
    // Drop rank 0's line ("IQ==" is "!"): ranks no longer start at 0 and a byte is missing.
    dir.write("tiktoken.model", ranks.substr(ranks.find('\n') + 1));
    EXPECT_NE(load_error(dir.path()).find("missing rank 0"), std::string::npos)
        << load_error(dir.path());
  }
  {
    ScratchDir dir("norank");
    dir.write("tiktoken.model", "IQ==\n");
    EXPECT_NE(load_error(dir.path()).find("expected '<base64 token> <rank>'"), std::string::npos)
        << load_error(dir.path());
  }
}

TEST(Tiktoken, RefusesAnotherTokenizerClass) {
  json config = read_json(kKimi / "tokenizer_config.json");
  {
    ScratchDir dir("class");
    json c = config;
    c["tokenizer_class"] = "LlamaTokenizer";
    dir.write("tokenizer_config.json", c.dump());
    const std::string error = load_error(dir.path());
    EXPECT_NE(error.find("field 'tokenizer_class'"), std::string::npos) << error;
  }
  {
    ScratchDir dir("automap");
    json c = config;
    c["auto_map"]["AutoTokenizer"] = {"tokenization_other.TikTokenTokenizer", nullptr};
    dir.write("tokenizer_config.json", c.dump());
    const std::string error = load_error(dir.path());
    EXPECT_NE(error.find("field 'auto_map.AutoTokenizer'"), std::string::npos) << error;
    EXPECT_NE(error.find("tokenization_other"), std::string::npos) << error;
  }
  {
    ScratchDir dir("specialid");
    json c = config;
    c["added_tokens_decoder"]["5"] = {{"content", "<x>"}, {"special", true}};
    dir.write("tokenizer_config.json", c.dump());
    const std::string error = load_error(dir.path());
    EXPECT_NE(error.find("id '5' is not one of the special ids"), std::string::npos) << error;
  }
  {
    ScratchDir dir("none");
    fs::remove(dir.path() / "tiktoken.model");
    const std::string error = load_error(dir.path());
    EXPECT_NE(error.find("neither tokenizer.json nor tiktoken.model"), std::string::npos) << error;
  }
}

}  // namespace
}  // namespace moeinfer
