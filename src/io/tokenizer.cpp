// Tokenizer: loading tokenizer.json, the added-token vocabulary, and the encode/decode pipeline.
// The components live in tokenizer_components.cpp, the BPE model in tokenizer_bpe.cpp.
#include "io/tokenizer.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <sstream>
#include <unordered_set>

#include "core/error.h"
#include "io/tokenizer_internal.h"
#include "io/unicode.h"

namespace moeinfer {

namespace {

using tok::Json;
using tok::Piece;
using tok::Pieces;

struct AddedToken {
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
  bool operator==(const AddedToken&) const = default;
};

// Byte trie over the added tokens, for leftmost-longest matching.
class Trie {
 public:
  Trie() : nodes_(1) {}
  bool empty() const { return nodes_.size() == 1; }

  void insert(std::string_view pattern, int32_t value) {
    if (pattern.empty()) return;
    int32_t node = 0;
    for (const char c : pattern) {
      const auto byte = static_cast<unsigned char>(c);
      int32_t child = find_child(node, byte);
      if (child < 0) {
        child = static_cast<int32_t>(nodes_.size());
        nodes_.emplace_back();
        auto& children = nodes_[node].children;
        children.insert(
            std::lower_bound(children.begin(), children.end(), std::make_pair(byte, int32_t{0})),
            {byte, child});
      }
      node = child;
    }
    nodes_[node].value = value;
  }

  // The longest pattern starting at text[pos]: sets *len and *value, or returns false.
  bool longest(std::string_view text, size_t pos, size_t* len, int32_t* value) const {
    int32_t node = 0;
    bool found = false;
    for (size_t i = pos; i < text.size(); ++i) {
      node = find_child(node, static_cast<unsigned char>(text[i]));
      if (node < 0) break;
      if (nodes_[node].value >= 0) {
        *len = i + 1 - pos;
        *value = nodes_[node].value;
        found = true;
      }
    }
    return found;
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> children;  // sorted by byte
    int32_t value = -1;
  };
  int32_t find_child(int32_t node, unsigned char byte) const {
    const auto& children = nodes_[node].children;
    auto it = std::lower_bound(children.begin(), children.end(), std::make_pair(byte, int32_t{0}));
    return it != children.end() && it->first == byte ? it->second : -1;
  }
  std::vector<Node> nodes_;
};

struct Match {
  int32_t id;  // -1 for plain text
  size_t start;
  size_t end;
};

// Python's str.isspace(): category Zs or bidirectional class WS, B or S.
bool python_isspace(char32_t cp) {
  return (cp >= 0x9 && cp <= 0xD) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// Kimi's TikTokenTokenizer.encode before tiktoken sees the text: chunks of `chunk_chars` code
// points, each cut again before the code point that would make a run of spaces (or of
// non-spaces) longer than `max_run` (its _split_whitespaces_or_nonwhitespaces).
std::vector<std::string_view> split_long_runs(std::string_view text, size_t chunk_chars,
                                              size_t max_run) {
  std::vector<std::string_view> out;
  size_t pos = 0;
  while (true) {
    // One chunk: [chunk_start, chunk_end).
    const size_t chunk_start = pos;
    size_t count = 0;
    size_t chunk_end = pos;
    while (chunk_end < text.size() && count < chunk_chars) {
      chunk_end += unicode::utf8_length(static_cast<unsigned char>(text[chunk_end]));
      ++count;
    }
    size_t slice_start = chunk_start;
    size_t run = 0;
    bool run_is_space = false;
    for (size_t p = chunk_start; p < chunk_end;) {
      const size_t at = p;
      const bool space = python_isspace(unicode::next_code_point(text, p));
      if (at == chunk_start) run_is_space = space;
      if (space != run_is_space) {
        run = 1;
        run_is_space = space;
      } else if (++run > max_run) {
        out.push_back(text.substr(slice_start, at - slice_start));
        slice_start = at;
        run = 1;
      }
    }
    out.push_back(text.substr(slice_start, chunk_end - slice_start));
    pos = chunk_end;
    if (pos >= text.size()) break;
  }
  return out;
}

std::string read_file(const std::filesystem::path& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in.good(), "cannot open ", what, " ", path.string());
  std::ostringstream buffer;
  buffer << in.rdbuf();
  MOE_CHECK(!in.bad(), "cannot read ", what, " ", path.string());
  return buffer.str();
}

bool json_bool(const Json& j, const char* key, bool fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  return it->get<bool>();
}

}  // namespace

struct Tokenizer::Impl {
  std::string source;
  std::unique_ptr<tok::Normalizer> normalizer;
  std::unique_ptr<tok::PreTokenizer> pre_tokenizer;
  std::unique_ptr<tok::Model> model;
  std::unique_ptr<tok::PostProcessor> post_processor;
  std::unique_ptr<tok::Decoder> decoder;

  tok::StringMap added_ids;                               // content -> id
  std::unordered_map<int32_t, AddedToken> added_tokens;   // id -> token
  std::unordered_map<int32_t, std::string> decoded_form;  // id -> normalised content, if changed
  std::unordered_set<std::string, tok::StringHash, std::equal_to<>> special_contents;
  Trie raw_trie;                          // added tokens matched before normalisation
  Trie normalized_trie;                   // added tokens matched on normalised text
  std::unique_ptr<tok::Regex> word_char;  // Rust regex \w, for single_word tokens
  int64_t vocab_size = 0;
  // tiktoken (Kimi): the text is cut into chunks of this many code points, and each where a run
  // of spaces or non-spaces exceeds max_run_chars, before encoding; 0: not cut.
  size_t chunk_chars = 0;
  size_t max_run_chars = 0;

  void load(const Json& root);
  void load_tiktoken(std::string_view ranks, const std::string& ranks_source, const Json& config,
                     const std::string& config_source);
  std::vector<int32_t> encode_part(std::string_view text) const;
  void add_tokens(const Json& list);
  std::vector<Match> find_matches(std::string_view text, const Trie& trie) const;
  bool is_word_char_at(std::string_view text, size_t pos) const;
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const;
  // repair: invalid UTF-8 becomes U+FFFD, as `tokenizers` gives it; else the bytes as they are.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens,
                     bool repair = true) const;
  const std::string* token_for_decode(int32_t id) const;
};

void Tokenizer::Impl::load(const Json& root) {
  MOE_CHECK(root.is_object(), "the top level is not a JSON object");
  const Json& model_json = root.contains("model") ? root["model"] : Json();
  MOE_CHECK(model_json.is_object(), "there is no \"model\" object");
  std::string model_type = "BPE";
  if (auto it = model_json.find("type"); it != model_json.end()) {
    model_type = it->get<std::string>();
  } else if (!model_json.contains("merges")) {
    model_type = "(untyped, without merges)";
  }
  MOE_CHECK(model_type == "BPE", "model type '", model_type,
            "' is not supported (only BPE models are)");

  auto section = [&root](const char* key) -> Json {
    auto it = root.find(key);
    return it == root.end() ? Json() : *it;
  };
  normalizer = tok::parse_normalizer(section("normalizer"));
  pre_tokenizer = tok::parse_pre_tokenizer(section("pre_tokenizer"));
  model = std::make_unique<tok::BpeModel>(model_json);
  post_processor = tok::parse_post_processor(section("post_processor"));
  decoder = tok::parse_decoder(section("decoder"));
  word_char = std::make_unique<tok::Regex>(
      "\\A[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}" +
          unicode::newer_class_items({"L", "M", "Nd", "Nl", "Pc"}) + "]",
      /*oniguruma_syntax=*/false);

  const Json added = section("added_tokens");
  if (!added.is_null()) add_tokens(added);

  vocab_size = model->max_id() + 1;
  for (const auto& [id, token] : added_tokens) vocab_size = std::max<int64_t>(vocab_size, id + 1);
}

// Kimi's TikTokenTokenizer: 256 special ids after the rank file's tokens.
constexpr int64_t kTiktokenSpecialTokens = 256;
constexpr size_t kTiktokenChunkChars = 400000;
constexpr size_t kTiktokenMaxRunChars = 25000;

void Tokenizer::Impl::load_tiktoken(std::string_view ranks, const std::string& ranks_source,
                                    const Json& config, const std::string& config_source) {
  MOE_CHECK(config.is_object(), config_source, ": the top level is not a JSON object");
  auto field_string = [&](const Json& j) {
    return j.is_string() ? j.get<std::string>() : j.dump();
  };
  const auto cls = config.find("tokenizer_class");
  MOE_CHECK(cls != config.end() && field_string(*cls) == "TikTokenTokenizer", config_source,
            ": field 'tokenizer_class': a tiktoken rank file is read for TikTokenTokenizer, found ",
            cls == config.end() ? std::string("none") : field_string(*cls));
  // The split pattern lives in the tokenizer's Python class, not in any file: the engine knows
  // Kimi's (tokenization_kimi.py) and refuses a class it cannot name.
  std::string auto_tokenizer = "none";
  if (auto map = config.find("auto_map"); map != config.end() && map->is_object()) {
    if (auto it = map->find("AutoTokenizer"); it != map->end()) {
      auto_tokenizer = it->is_array() && !it->empty() ? field_string((*it)[0]) : field_string(*it);
    }
  }
  MOE_CHECK(auto_tokenizer.starts_with("tokenization_kimi."), config_source,
            ": field 'auto_map.AutoTokenizer': the split pattern is known for Kimi's "
            "tokenization_kimi.TikTokenTokenizer only, found ",
            auto_tokenizer);

  model = std::make_unique<tok::TiktokenModel>(ranks, ranks_source);
  const int64_t num_base = static_cast<int64_t>(model->num_entries());
  std::unordered_map<int64_t, AddedToken> named;
  if (auto decoder_json = config.find("added_tokens_decoder"); decoder_json != config.end()) {
    MOE_CHECK(decoder_json->is_object(), config_source,
              ": field 'added_tokens_decoder' is not an object");
    for (const auto& [key, entry] : decoder_json->items()) {
      int64_t id = -1;
      try {
        size_t used = 0;
        id = std::stoll(key, &used);
        if (used != key.size()) id = -1;
      } catch (const std::exception&) {
        id = -1;
      }
      MOE_CHECK(id >= num_base && id < num_base + kTiktokenSpecialTokens, config_source,
                ": field 'added_tokens_decoder': id '", key, "' is not one of the special ids ",
                num_base, "..", num_base + kTiktokenSpecialTokens - 1,
                " that follow the rank file's tokens");
      MOE_CHECK(entry.is_object() && entry.contains("content") && entry["content"].is_string(),
                config_source, ": field 'added_tokens_decoder': entry ", key,
                " has no string \"content\"");
      named[id] = AddedToken{.content = entry["content"].get<std::string>(),
                             .normalized = false,
                             .special = json_bool(entry, "special", true)};
    }
  }
  for (int64_t id = num_base; id < num_base + kTiktokenSpecialTokens; ++id) {
    auto it = named.find(id);
    // A reserved id is a tiktoken special (encode matches it) but not one of the class's
    // special tokens, so skip_special_tokens keeps it, as transformers' decode does.
    AddedToken token = it != named.end()
                           ? it->second
                           : AddedToken{.content = "<|reserved_token_" + std::to_string(id) + "|>",
                                        .normalized = false,
                                        .special = false};
    MOE_CHECK(!token.content.empty() && unicode::is_valid_utf8(token.content), config_source,
              ": special token ", id, " is empty or not valid UTF-8");
    MOE_CHECK(!added_ids.contains(token.content), config_source, ": special token '", token.content,
              "' is named twice");
    added_ids[token.content] = static_cast<int32_t>(id);
    if (token.special) special_contents.insert(token.content);
    raw_trie.insert(token.content, static_cast<int32_t>(id));
    added_tokens[static_cast<int32_t>(id)] = std::move(token);
  }
  pre_tokenizer = tok::make_tiktoken_split(tok::kKimiPattern);
  decoder = tok::parse_decoder(Json{{"type", "ByteLevel"}});
  vocab_size = num_base + kTiktokenSpecialTokens;
  chunk_chars = kTiktokenChunkChars;
  max_run_chars = kTiktokenMaxRunChars;
}

// Mirrors `AddedVocabulary::add_tokens`: a token keeps the id the model gives its content, or
// gets the next free id after the model vocabulary; the "id" field of the JSON is not consulted
// (it agrees in every well-formed file).
void Tokenizer::Impl::add_tokens(const Json& list) {
  MOE_CHECK(list.is_array(), "\"added_tokens\" is not a list");
  int64_t next_id = static_cast<int64_t>(model->num_entries());
  for (const Json& entry : list) {
    MOE_CHECK(entry.is_object() && entry.contains("content"), "added token ", entry.dump(),
              " has no \"content\"");
    AddedToken token{.content = entry["content"].get<std::string>(),
                     .single_word = json_bool(entry, "single_word", false),
                     .lstrip = json_bool(entry, "lstrip", false),
                     .rstrip = json_bool(entry, "rstrip", false),
                     .normalized = json_bool(entry, "normalized", true),
                     .special = json_bool(entry, "special", false)};
    if (token.content.empty()) continue;
    MOE_CHECK(unicode::is_valid_utf8(token.content), "added token content is not valid UTF-8");
    if (auto it = added_ids.find(token.content); it != added_ids.end()) {
      if (added_tokens[it->second] == token) continue;
    }
    int32_t id;
    if (auto it = added_ids.find(token.content); it != added_ids.end()) {
      id = it->second;
    } else if (auto model_id = model->token_to_id(token.content)) {
      id = *model_id;
    } else {
      id = static_cast<int32_t>(next_id++);
    }
    if (token.normalized && normalizer) {
      std::string normalized = token.content;
      normalizer->normalize(normalized);
      if (normalized != token.content) decoded_form[id] = std::move(normalized);
    }
    added_ids[token.content] = id;
    if (token.special) special_contents.insert(token.content);
    added_tokens[id] = std::move(token);
  }
  for (const auto& [id, token] : added_tokens) {
    if (token.normalized) {
      auto it = decoded_form.find(id);
      normalized_trie.insert(it != decoded_form.end() ? it->second : token.content, id);
    } else {
      raw_trie.insert(token.content, id);
    }
  }
}

bool Tokenizer::Impl::is_word_char_at(std::string_view text, size_t pos) const {
  const size_t len = unicode::utf8_length(static_cast<unsigned char>(text[pos]));
  return word_char->search(text.substr(pos, len));
}

// Mirrors `AddedVocabulary::find_matches`: leftmost-longest matches, filtered by single_word,
// widened by lstrip/rstrip, with the text between them as plain pieces.
std::vector<Match> Tokenizer::Impl::find_matches(std::string_view text, const Trie& trie) const {
  std::vector<Match> out;
  if (text.empty()) return out;
  if (trie.empty()) {
    out.push_back({-1, 0, text.size()});
    return out;
  }
  size_t start_offset = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t len = 0;
    int32_t id = -1;
    if (!trie.longest(text, pos, &len, &id)) {
      ++pos;
      continue;
    }
    size_t start = pos;
    size_t stop = pos + len;
    pos = stop;
    const AddedToken& token = added_tokens.at(id);
    if (token.single_word) {
      bool word_before = false;
      if (start > 0) {
        size_t prev = start - 1;
        while (prev > 0 && (static_cast<unsigned char>(text[prev]) & 0xC0) == 0x80) --prev;
        word_before = is_word_char_at(text, prev);
      }
      const bool word_after = stop < text.size() && is_word_char_at(text, stop);
      if (word_before || word_after) continue;
    }
    if (token.lstrip) {
      size_t new_start = start;
      while (new_start > 0) {
        size_t prev = new_start - 1;
        while (prev > 0 && (static_cast<unsigned char>(text[prev]) & 0xC0) == 0x80) --prev;
        size_t p = prev;
        if (!unicode::is_whitespace(unicode::next_code_point(text, p))) break;
        new_start = prev;
      }
      start = std::max(new_start, start_offset);
    }
    if (token.rstrip) {
      while (stop < text.size()) {
        size_t p = stop;
        if (!unicode::is_whitespace(unicode::next_code_point(text, p))) break;
        stop = p;
      }
    }
    if (start_offset < start) out.push_back({-1, start_offset, start});
    out.push_back({id, start, stop});
    start_offset = stop;
  }
  if (start_offset != text.size()) out.push_back({-1, start_offset, text.size()});
  return out;
}

std::vector<int32_t> Tokenizer::Impl::encode(std::string_view text, bool add_special_tokens) const {
  MOE_CHECK(unicode::is_valid_utf8(text), "tokenizer input is not valid UTF-8");
  std::vector<int32_t> ids;
  if (max_run_chars > 0) {
    for (std::string_view part : split_long_runs(text, chunk_chars, max_run_chars)) {
      const std::vector<int32_t> part_ids = encode_part(part);
      ids.insert(ids.end(), part_ids.begin(), part_ids.end());
    }
  } else {
    ids = encode_part(text);
  }
  // 5. Special tokens around the sequence.
  if (post_processor) post_processor->process(ids, add_special_tokens);
  return ids;
}

// Steps 1-4 of encode: added tokens, normalisation, words, ids.
std::vector<int32_t> Tokenizer::Impl::encode_part(std::string_view text) const {
  Pieces pieces;
  // 1. Added tokens that match the raw text.
  for (const Match& m : find_matches(text, raw_trie)) {
    if (m.end == m.start) continue;
    pieces.push_back(Piece{.text = std::string(text.substr(m.start, m.end - m.start)),
                           .id = m.id,
                           .at_origin = m.start == 0});
  }
  // 2. Normalise the rest, then cut out added tokens that match the normalised text.
  tok::split_pieces(pieces, [this](const Piece& piece, Pieces& out) {
    std::string normalized = piece.text;
    if (normalizer) normalizer->normalize(normalized);
    for (const Match& m : find_matches(normalized, normalized_trie)) {
      out.push_back(Piece{.text = normalized.substr(m.start, m.end - m.start),
                          .id = m.id,
                          .at_origin = piece.at_origin && m.start == 0});
    }
  });
  // 3. Words.
  if (pre_tokenizer) pre_tokenizer->pre_tokenize(pieces);
  // 4. Ids.
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  for (const Piece& piece : pieces) {
    if (piece.id >= 0) {
      ids.push_back(piece.id);
    } else {
      model->tokenize(piece.text, ids);
    }
  }
  return ids;
}

const std::string* Tokenizer::Impl::token_for_decode(int32_t id) const {
  if (auto it = added_tokens.find(id); it != added_tokens.end()) {
    auto norm = decoded_form.find(id);
    return norm != decoded_form.end() ? &norm->second : &it->second.content;
  }
  return model->id_to_token(id);
}

std::string Tokenizer::Impl::decode(std::span<const int32_t> ids, bool skip_special_tokens,
                                    bool repair) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const int32_t id : ids) {
    const std::string* token = token_for_decode(id);
    if (token == nullptr) continue;
    if (skip_special_tokens && special_contents.contains(*token)) continue;
    tokens.push_back(*token);
  }
  std::string text;
  if (decoder) {
    if (repair) {
      decoder->decode_chain(tokens);
    } else {
      decoder->decode_chain_bytes(tokens);
    }
    for (const std::string& t : tokens) text += t;
  } else {
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i > 0) text += ' ';
      text += tokens[i];
    }
  }
  return text;
}

// ---------------------------------------------------------------------------------------------

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_file(const std::filesystem::path& tokenizer_json) {
  std::ifstream in(tokenizer_json, std::ios::binary);
  MOE_CHECK(in.good(), "cannot open tokenizer file ", tokenizer_json.string());
  std::ostringstream buffer;
  buffer << in.rdbuf();
  MOE_CHECK(!in.bad(), "cannot read tokenizer file ", tokenizer_json.string());
  return from_json(buffer.str(), tokenizer_json.string());
}

Tokenizer Tokenizer::from_tiktoken(const std::filesystem::path& rank_file,
                                   const std::filesystem::path& tokenizer_config) {
  const std::string ranks = read_file(rank_file, "tiktoken rank file");
  const std::string config_text = read_file(tokenizer_config, "tokenizer config");
  auto impl = std::make_unique<Impl>();
  impl->source = rank_file.string();
  try {
    impl->load_tiktoken(ranks, rank_file.string(), Json::parse(config_text),
                        tokenizer_config.string());
  } catch (const nlohmann::json::exception& e) {
    MOE_FAIL("tokenizer config ", tokenizer_config.string(), ": ", e.what());
  }
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_dir(const std::filesystem::path& dir) {
  if (std::filesystem::exists(dir / "tokenizer.json")) return from_file(dir / "tokenizer.json");
  if (std::filesystem::exists(dir / "tiktoken.model"))
    return from_tiktoken(dir / "tiktoken.model", dir / "tokenizer_config.json");
  MOE_FAIL("no tokenizer in ", dir.string(), ": neither tokenizer.json nor tiktoken.model");
}

Tokenizer Tokenizer::from_json(std::string_view json_text, const std::string& source) {
  auto impl = std::make_unique<Impl>();
  impl->source = source;
  try {
    const Json root = Json::parse(json_text);
    impl->load(root);
  } catch (const Error& e) {
    throw Error("tokenizer " + source + ": " + e.what(), e.where());
  } catch (const nlohmann::json::exception& e) {
    MOE_FAIL("tokenizer ", source, ": ", e.what());
  }
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  return impl_->encode(text, add_special_tokens);
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  return impl_->decode(ids, skip_special_tokens);
}

std::string Tokenizer::decode_bytes(std::span<const int32_t> ids, bool skip_special_tokens) const {
  return impl_->decode(ids, skip_special_tokens, /*repair=*/false);
}

std::vector<std::string> Tokenizer::token_bytes() const {
  const int64_t n = vocab_size();
  std::vector<std::string> out(static_cast<size_t>(n));
  // A token's bytes in the middle of a text: decoded after an anchor token (a lone ASCII
  // letter, so decoders that treat the first token apart, Metaspace's prefix space or Strip,
  // act on the anchor), less the anchor's own bytes.
  std::optional<int32_t> anchor;
  for (const char* letter : {"a", "x", "e"}) {
    if (auto id = token_to_id(letter); id && !is_special(*id)) {
      anchor = id;
      break;
    }
  }
  for (int32_t id = 0; !anchor && id < n; ++id) {
    if (impl_->token_for_decode(id) == nullptr || is_special(id)) continue;
    const int32_t one[] = {id};
    const std::string text = impl_->decode(one, true, false);
    if (text.size() == 1 && std::isalpha(static_cast<unsigned char>(text[0]))) anchor = id;
  }
  std::string prefix;
  if (anchor) {
    const int32_t one[] = {*anchor};
    prefix = impl_->decode(one, true, false);
  }
  for (int32_t id = 0; id < n; ++id) {
    if (impl_->token_for_decode(id) == nullptr || is_special(id)) continue;
    if (anchor) {
      const int32_t two[] = {*anchor, id};
      std::string text = impl_->decode(two, true, false);
      if (text.starts_with(prefix)) {
        out[id] = text.substr(prefix.size());
        continue;
      }
    }
    const int32_t one[] = {id};
    out[id] = impl_->decode(one, true, false);
  }
  return out;
}

int64_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (auto it = impl_->added_ids.find(token); it != impl_->added_ids.end()) return it->second;
  return impl_->model->token_to_id(token);
}

std::string Tokenizer::id_to_token(int32_t id) const {
  if (auto it = impl_->added_tokens.find(id); it != impl_->added_tokens.end()) {
    return it->second.content;
  }
  const std::string* token = impl_->model->id_to_token(id);
  MOE_CHECK(token != nullptr, "token id ", id, " is not in the vocabulary of tokenizer ",
            impl_->source);
  return *token;
}

bool Tokenizer::is_special(int32_t id) const {
  auto it = impl_->added_tokens.find(id);
  return it != impl_->added_tokens.end() && it->second.special;
}

// ---------------------------------------------------------------------------------------------

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(&tokenizer), skip_special_tokens_(skip_special_tokens) {}

std::string StreamDecoder::push(int32_t id) {
  ids_.push_back(id);
  return diff(/*final=*/false);
}

std::string StreamDecoder::flush() {
  std::string text = diff(/*final=*/true);
  ids_.clear();
  prefix_offset_ = read_offset_ = 0;
  return text;
}

// Decodes the window that starts at the last emitted chunk twice, with and without the new
// ids, and returns the difference once it no longer ends in an incomplete character. Decoding a
// window rather than everything keeps each push O(window) while letting decoders that look at
// the first token (Metaspace, Strip) treat both decodes alike.
std::string StreamDecoder::diff(bool final) {
  if (read_offset_ == ids_.size()) return {};
  const std::span<const int32_t> all(ids_);
  const std::string prefix = tokenizer_->decode(
      all.subspan(prefix_offset_, read_offset_ - prefix_offset_), skip_special_tokens_);
  const std::string full = tokenizer_->decode(all.subspan(prefix_offset_), skip_special_tokens_);
  if (!final && unicode::ends_with_replacement(full)) return {};
  std::string text;
  if (full.size() > prefix.size() && full.starts_with(prefix)) {
    text = full.substr(prefix.size());
  } else if (!final) {
    return {};
  } else if (full.size() > prefix.size()) {
    text = full.substr(prefix.size());
  }
  prefix_offset_ = read_offset_;
  read_offset_ = ids_.size();
  if (prefix_offset_ > 256) {  // forget ids that no later window can reach
    ids_.erase(ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(prefix_offset_));
    read_offset_ -= prefix_offset_;
    prefix_offset_ = 0;
  }
  return text;
}

}  // namespace moeinfer
