// Normalisers, pre-tokenisers, decoders and post-processors of a tokenizer.json, each written
// to give what the `tokenizers` component of the same name gives (offsets are not tracked: the
// engine only needs ids and text).
#include <algorithm>
#include <type_traits>

#include "core/error.h"
#include "io/tokenizer_internal.h"
#include "io/unicode.h"

namespace moeinfer::tok {

namespace {

std::string type_of(const Json& j, const char* what) {
  MOE_CHECK(j.is_object(), what, " is not a JSON object");
  auto it = j.find("type");
  MOE_CHECK(it != j.end() && it->is_string(), what, " has no \"type\"");
  return it->get<std::string>();
}

// A string or boolean field, or `fallback` when absent (a value of another JSON type throws);
// numbers go through count_or, which checks their kind and range before converting.
template <typename T>
T value_or(const Json& j, const char* key, T fallback) {
  static_assert(std::is_same_v<T, bool> || !std::is_arithmetic_v<T>, "numeric fields: count_or");
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  return it->get<T>();
}

// A non-negative whole-number field, or `fallback` when absent. Anything else (a float, whose
// conversion could overflow, a negative number, a string) is refused by name.
size_t count_or(const Json& j, const char* key, size_t fallback, const char* what) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  MOE_CHECK(it->is_number_unsigned(), what, " \"", key, "\" must be a non-negative integer, got ",
            it->dump());
  return it->get<size_t>();
}

const Json& required(const Json& j, const char* key, const std::string& what) {
  auto it = j.find(key);
  MOE_CHECK(it != j.end() && !it->is_null(), what, " has no \"", key, "\"");
  return *it;
}

char32_t single_char(const Json& j, const std::string& what) {
  const std::string s = j.get<std::string>();
  size_t pos = 0;
  MOE_CHECK(!s.empty() && unicode::is_valid_utf8(s), what, " must be one character");
  const char32_t cp = unicode::next_code_point(s, pos);
  MOE_CHECK(pos == s.size(), what, " must be one character, got '", s, "'");
  return cp;
}

// {"String": "..."} or {"Regex": "..."}, compiled either way.
std::unique_ptr<Regex> parse_pattern(const Json& j, const std::string& what) {
  MOE_CHECK(j.is_object(), what, " pattern must be {\"String\": ...} or {\"Regex\": ...}");
  if (auto it = j.find("String"); it != j.end()) {
    return std::make_unique<Regex>(Regex::escape(it->get<std::string>()));
  }
  if (auto it = j.find("Regex"); it != j.end()) {
    return std::make_unique<Regex>(it->get<std::string>());
  }
  MOE_FAIL(what, " pattern must be {\"String\": ...} or {\"Regex\": ...}");
}

std::string replace_matches(const Regex& regex, const std::string& text,
                            const std::string& content) {
  std::string out;
  out.reserve(text.size());
  for (const Span& span : regex_spans(regex, text)) {
    if (span.is_match) {
      out += content;
    } else {
      out.append(text, span.start, span.end - span.start);
    }
  }
  return out;
}

template <typename Pred>
std::string filter_chars(std::string_view text, Pred keep) {
  std::string out;
  out.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    const size_t start = pos;
    const char32_t cp = unicode::next_code_point(text, pos);
    if (keep(cp)) out.append(text.substr(start, pos - start));
  }
  return out;
}

std::string to_byte_level(std::string_view text) {
  const auto& table = unicode::byte_to_chars();
  std::string out;
  out.reserve(text.size() * 2);
  for (const char c : text) out += table[static_cast<unsigned char>(c)];
  return out;
}

// ---------------------------------------------------------------------------------------------
// Normalisers

class UnicodeNormalizer final : public Normalizer {
 public:
  explicit UnicodeNormalizer(unicode::NormalForm form) : form_(form) {}
  void normalize(std::string& text) const override { text = unicode::normalize(text, form_); }

 private:
  unicode::NormalForm form_;
};

class LowercaseNormalizer final : public Normalizer {
 public:
  void normalize(std::string& text) const override { text = unicode::to_lower(text); }
};

class PrependNormalizer final : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prefix) : prefix_(std::move(prefix)) {}
  void normalize(std::string& text) const override {
    if (!text.empty()) text.insert(0, prefix_);
  }

 private:
  std::string prefix_;
};

class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(std::unique_ptr<Regex> regex, std::string content)
      : regex_(std::move(regex)), content_(std::move(content)) {}
  void normalize(std::string& text) const override {
    text = replace_matches(*regex_, text, content_);
  }

 private:
  std::unique_ptr<Regex> regex_;
  std::string content_;
};

class StripNormalizer final : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  void normalize(std::string& text) const override {
    size_t begin = 0;
    if (left_) {
      while (begin < text.size()) {
        size_t pos = begin;
        if (!unicode::is_whitespace(unicode::next_code_point(text, pos))) break;
        begin = pos;
      }
    }
    size_t end = text.size();
    if (right_) {
      while (end > begin) {
        size_t start = end - 1;
        while (start > begin && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
        size_t pos = start;
        if (!unicode::is_whitespace(unicode::next_code_point(text, pos))) break;
        end = start;
      }
    }
    text = text.substr(begin, end - begin);
  }

 private:
  bool left_, right_;
};

class StripAccentsNormalizer final : public Normalizer {
 public:
  void normalize(std::string& text) const override {
    text = filter_chars(text, [](char32_t cp) { return !unicode::is_stripped_accent(cp); });
  }
};

class NmtNormalizer final : public Normalizer {
 public:
  void normalize(std::string& text) const override {
    std::string out;
    out.reserve(text.size());
    for (size_t pos = 0; pos < text.size();) {
      const size_t start = pos;
      const char32_t cp = unicode::next_code_point(text, pos);
      if ((cp >= 0x1 && cp <= 0x8) || cp == 0xB || (cp >= 0xE && cp <= 0x1F) || cp == 0x7F ||
          cp == 0x8F || cp == 0x9F) {
        continue;
      }
      const bool to_space = cp == 0x9 || cp == 0xA || cp == 0xC || cp == 0xD || cp == 0x1680 ||
                            (cp >= 0x200B && cp <= 0x200F) || cp == 0x2028 || cp == 0x2029 ||
                            cp == 0x2581 || cp == 0xFEFF || cp == 0xFFFD;
      if (to_space) {
        out += ' ';
      } else {
        out.append(text, start, pos - start);
      }
    }
    text = std::move(out);
  }
};

class ByteLevelNormalizer final : public Normalizer {
 public:
  void normalize(std::string& text) const override { text = to_byte_level(text); }
};

class SequenceNormalizer final : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> steps)
      : steps_(std::move(steps)) {}
  void normalize(std::string& text) const override {
    for (const auto& step : steps_) step->normalize(text);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

// ---------------------------------------------------------------------------------------------
// Pre-tokenisers

// The GPT-2 split used by ByteLevel when use_regex is set.
constexpr std::string_view kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, bool use_regex)
      : add_prefix_space_(add_prefix_space), use_regex_(use_regex) {
    if (use_regex_) regex_ = std::make_unique<Regex>(kGpt2Pattern);
  }
  void pre_tokenize(Pieces& pieces) const override {
    split_pieces(pieces, [this](const Piece& piece, Pieces& out) {
      Piece p = piece;
      if (add_prefix_space_ && p.text.front() != ' ') p.text.insert(0, " ");
      if (use_regex_) {
        emit_ranges(p, apply_behavior(regex_spans(*regex_, p.text), SplitBehavior::kIsolated), out);
      } else {
        out.push_back(std::move(p));
      }
    });
    for (Piece& p : pieces) {
      if (p.id < 0) p.text = to_byte_level(p.text);
    }
  }

 private:
  bool add_prefix_space_;
  bool use_regex_;
  std::unique_ptr<Regex> regex_;
};

class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(std::unique_ptr<Regex> regex, SplitBehavior behavior, bool invert)
      : regex_(std::move(regex)), behavior_(behavior), invert_(invert) {}
  void pre_tokenize(Pieces& pieces) const override {
    split_pieces(pieces, [this](const Piece& piece, Pieces& out) {
      std::vector<Span> spans = regex_spans(*regex_, piece.text);
      if (invert_) {
        for (Span& s : spans) s.is_match = !s.is_match;
      }
      emit_ranges(piece, apply_behavior(std::move(spans), behavior_), out);
    });
  }

 private:
  std::unique_ptr<Regex> regex_;
  SplitBehavior behavior_;
  bool invert_;
};

// Splits on characters chosen by a predicate.
class CharSplitPreTokenizer final : public PreTokenizer {
 public:
  CharSplitPreTokenizer(std::function<bool(char32_t)> pred, SplitBehavior behavior)
      : pred_(std::move(pred)), behavior_(behavior) {}
  void pre_tokenize(Pieces& pieces) const override {
    split_pieces(pieces, [this](const Piece& piece, Pieces& out) {
      emit_ranges(piece, apply_behavior(char_spans(piece.text, pred_), behavior_), out);
    });
  }

 private:
  std::function<bool(char32_t)> pred_;
  SplitBehavior behavior_;
};

enum class PrependScheme { kFirst, kNever, kAlways };

PrependScheme parse_prepend_scheme(const Json& j) {
  PrependScheme scheme = PrependScheme::kAlways;
  if (auto it = j.find("prepend_scheme"); it != j.end() && !it->is_null()) {
    const std::string name = it->get<std::string>();
    if (name == "first") {
      scheme = PrependScheme::kFirst;
    } else if (name == "never") {
      scheme = PrependScheme::kNever;
    } else if (name == "always") {
      scheme = PrependScheme::kAlways;
    } else {
      MOE_FAIL("Metaspace prepend_scheme '", name, "' is not one of first, never, always");
    }
  }
  if (auto it = j.find("add_prefix_space"); it != j.end() && it->is_boolean() && !it->get<bool>()) {
    MOE_CHECK(scheme == PrependScheme::kNever || !j.contains("prepend_scheme"),
              "Metaspace add_prefix_space=false does not match prepend_scheme");
    scheme = PrependScheme::kNever;
  }
  return scheme;
}

class MetaspacePreTokenizer final : public PreTokenizer {
 public:
  MetaspacePreTokenizer(char32_t replacement, PrependScheme scheme, bool split)
      : replacement_(replacement),
        replacement_str_(unicode::to_utf8(replacement)),
        scheme_(scheme),
        split_(split) {}
  void pre_tokenize(Pieces& pieces) const override {
    split_pieces(pieces, [this](const Piece& piece, Pieces& out) {
      Piece p = piece;
      std::string replaced;
      replaced.reserve(p.text.size() + 8);
      for (const char c : p.text) {
        if (c == ' ') {
          replaced += replacement_str_;
        } else {
          replaced += c;
        }
      }
      p.text = std::move(replaced);
      const bool starts_with_replacement = p.text.starts_with(replacement_str_);
      if (!starts_with_replacement && (scheme_ == PrependScheme::kAlways ||
                                       (scheme_ == PrependScheme::kFirst && p.at_origin))) {
        p.text.insert(0, replacement_str_);
      }
      if (split_) {
        const char32_t r = replacement_;
        emit_ranges(p,
                    apply_behavior(char_spans(p.text, [r](char32_t c) { return c == r; }),
                                   SplitBehavior::kMergedWithNext),
                    out);
      } else {
        out.push_back(std::move(p));
      }
    });
  }

 private:
  char32_t replacement_;
  std::string replacement_str_;
  PrependScheme scheme_;
  bool split_;
};

class SequencePreTokenizer final : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> steps)
      : steps_(std::move(steps)) {}
  void pre_tokenize(Pieces& pieces) const override {
    for (const auto& step : steps_) step->pre_tokenize(pieces);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

// `Whitespace`: runs of word characters and runs of other non-space characters (Rust regex
// `\w+|[^\w\s]+`, where \w is Alphabetic | Mark | Nd | Pc | Join_Control).
constexpr std::string_view kRustWordSet = "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}";

std::unique_ptr<PreTokenizer> make_whitespace_pre_tokenizer() {
  const std::string word =
      std::string(kRustWordSet) + unicode::newer_class_items({"L", "M", "Nd", "Nl", "Pc"});
  const std::string pattern = "[" + word + "]+|[^" + word +
                              "\\x{9}-\\x{D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}"
                              "\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}]+";
  return std::make_unique<SplitPreTokenizer>(std::make_unique<Regex>(pattern, false),
                                             SplitBehavior::kRemoved, /*invert=*/true);
}

bool is_bert_punctuation(char32_t cp) {
  const bool ascii_punct = (cp >= 0x21 && cp <= 0x2F) || (cp >= 0x3A && cp <= 0x40) ||
                           (cp >= 0x5B && cp <= 0x60) || (cp >= 0x7B && cp <= 0x7E);
  return ascii_punct || unicode::is_split_punctuation(cp);
}

// ---------------------------------------------------------------------------------------------
// Decoders

class ByteLevelDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    decode_chain_bytes(tokens);
    tokens[0] = unicode::from_bytes_lossy(tokens[0]);
  }
  void decode_chain_bytes(std::vector<std::string>& tokens) const override {
    std::string bytes;
    for (const std::string& token : tokens) {
      const size_t mark = bytes.size();
      bool mapped = true;
      for (size_t pos = 0; pos < token.size();) {
        const int b = unicode::byte_of_char(unicode::next_code_point(token, pos));
        if (b < 0) {
          mapped = false;
          break;
        }
        bytes.push_back(static_cast<char>(b));
      }
      if (!mapped) {  // a token outside the byte alphabet passes through as its own bytes
        bytes.resize(mark);
        bytes += token;
      }
    }
    tokens.assign(1, std::move(bytes));
  }
};

class MetaspaceDecoder final : public Decoder {
 public:
  MetaspaceDecoder(char32_t replacement, PrependScheme scheme)
      : replacement_(replacement), scheme_(scheme) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      const std::string& token = tokens[i];
      std::string out;
      out.reserve(token.size());
      for (size_t pos = 0; pos < token.size();) {
        const size_t start = pos;
        const char32_t cp = unicode::next_code_point(token, pos);
        if (cp == replacement_) {
          if (!(i == 0 && scheme_ != PrependScheme::kNever)) out += ' ';
        } else {
          out.append(token, start, pos - start);
        }
      }
      tokens[i] = std::move(out);
    }
  }

 private:
  char32_t replacement_;
  PrependScheme scheme_;
};

class ReplaceDecoder final : public Decoder {
 public:
  ReplaceDecoder(std::unique_ptr<Regex> regex, std::string content)
      : regex_(std::move(regex)), content_(std::move(content)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::string& token : tokens) token = replace_matches(*regex_, token, content_);
  }

 private:
  std::unique_ptr<Regex> regex_;
  std::string content_;
};

class ByteFallbackDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override { run(tokens, true); }
  void decode_chain_bytes(std::vector<std::string>& tokens) const override {
    run(tokens, false);
  }

 private:
  static void run(std::vector<std::string>& tokens, bool repair) {
    std::vector<std::string> out;
    out.reserve(tokens.size());
    std::string pending;
    auto flush = [&] {
      if (pending.empty()) return;
      if (!repair || unicode::is_valid_utf8(pending)) {
        out.push_back(pending);
      } else {
        for (size_t i = 0; i < pending.size(); ++i) out.emplace_back("\xEF\xBF\xBD");
      }
      pending.clear();
    };
    for (std::string& token : tokens) {
      if (auto byte = parse_byte_token(token)) {
        pending.push_back(static_cast<char>(*byte));
      } else {
        flush();
        out.push_back(std::move(token));
      }
    }
    flush();
    tokens = std::move(out);
  }

  // "<0xNN>" -> NN, parsed as Rust's u8::from_str_radix(.., 16) would parse the two characters.
  static std::optional<int> parse_byte_token(const std::string& t) {
    if (t.size() != 6 || !t.starts_with("<0x") || t.back() != '>') return std::nullopt;
    auto hex = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    if (t[3] == '+') {
      const int lo = hex(t[4]);
      return lo < 0 ? std::nullopt : std::optional<int>(lo);
    }
    const int hi = hex(t[3]), lo = hex(t[4]);
    if (hi < 0 || lo < 0) return std::nullopt;
    return hi * 16 + lo;
  }
};

class FuseDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string joined;
    for (const std::string& t : tokens) joined += t;
    tokens.assign(1, std::move(joined));
  }
};

class StripDecoder final : public Decoder {
 public:
  StripDecoder(char32_t content, size_t start, size_t stop)
      : content_(content), start_(start), stop_(stop) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::string& token : tokens) {
      std::vector<std::pair<size_t, char32_t>> chars;  // (byte offset, code point)
      for (size_t pos = 0; pos < token.size();) {
        const size_t at = pos;
        chars.emplace_back(at, unicode::next_code_point(token, pos));
      }
      size_t start_cut = 0;
      for (size_t i = 0; i < std::min(start_, chars.size()); ++i) {
        if (chars[i].second != content_) break;
        start_cut = i + 1;
      }
      size_t stop_cut = chars.size();
      for (size_t i = 0; i < std::min(stop_, chars.size()); ++i) {
        const size_t index = chars.size() - i - 1;
        if (chars[index].second != content_) break;
        stop_cut = index;
      }
      if (stop_cut < start_cut) stop_cut = start_cut;
      const size_t begin = start_cut < chars.size() ? chars[start_cut].first : token.size();
      const size_t end = stop_cut < chars.size() ? chars[stop_cut].first : token.size();
      token = token.substr(begin, end - begin);
    }
  }

 private:
  char32_t content_;
  size_t start_, stop_;
};

class BpeDecoder final : public Decoder {
 public:
  explicit BpeDecoder(std::string suffix) : suffix_(std::move(suffix)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    if (suffix_.empty()) return;
    for (size_t i = 0; i < tokens.size(); ++i) {
      const std::string replacement = i + 1 == tokens.size() ? "" : " ";
      std::string out;
      const std::string& t = tokens[i];
      for (size_t pos = 0;;) {
        const size_t hit = t.find(suffix_, pos);
        if (hit == std::string::npos) {
          out.append(t, pos);
          break;
        }
        out.append(t, pos, hit - pos);
        out += replacement;
        pos = hit + suffix_.size();
      }
      tokens[i] = std::move(out);
    }
  }

 private:
  std::string suffix_;
};

class SequenceDecoder final : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> steps)
      : steps_(std::move(steps)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (const auto& step : steps_) step->decode_chain(tokens);
  }
  void decode_chain_bytes(std::vector<std::string>& tokens) const override {
    for (const auto& step : steps_) step->decode_chain_bytes(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> steps_;
};

// ---------------------------------------------------------------------------------------------
// Post-processors

// Wraps the sequence in special tokens when asked to: `before` + ids + `after`.
class WrapProcessor final : public PostProcessor {
 public:
  WrapProcessor(std::vector<int32_t> before, std::vector<int32_t> after)
      : before_(std::move(before)), after_(std::move(after)) {}
  void process(std::vector<int32_t>& ids, bool add_special_tokens) const override {
    if (!add_special_tokens) return;
    ids.insert(ids.begin(), before_.begin(), before_.end());
    ids.insert(ids.end(), after_.begin(), after_.end());
  }

 private:
  std::vector<int32_t> before_, after_;
};

class NoopProcessor final : public PostProcessor {
 public:
  void process(std::vector<int32_t>&, bool) const override {}
};

class SequenceProcessor final : public PostProcessor {
 public:
  explicit SequenceProcessor(std::vector<std::unique_ptr<PostProcessor>> steps)
      : steps_(std::move(steps)) {}
  void process(std::vector<int32_t>& ids, bool add_special_tokens) const override {
    for (const auto& step : steps_) step->process(ids, add_special_tokens);
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> steps_;
};

// TemplateProcessing's single-sequence template: the special tokens before and after $A.
std::unique_ptr<PostProcessor> parse_template(const Json& j) {
  const Json& single = required(j, "single", "TemplateProcessing");
  std::unordered_map<std::string, std::vector<int32_t>> special_ids;
  if (auto it = j.find("special_tokens"); it != j.end() && it->is_object()) {
    for (const auto& [name, entry] : it->items()) {
      const Json& ids = required(entry, "ids", "TemplateProcessing special token '" + name + "'");
      MOE_CHECK(ids.is_array(), "TemplateProcessing special token '", name, "' ids must be a list");
      for (const Json& id : ids) {
        MOE_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 &&
                      id.get<int64_t>() <= INT32_MAX,
                  "TemplateProcessing special token '", name, "' has an id that is not a token id");
        special_ids[name].push_back(static_cast<int32_t>(id.get<int64_t>()));
      }
    }
  }
  // The template is a list of pieces ({"Sequence": {...}} / {"SpecialToken": {...}}), a list of
  // strings ("$A", "[CLS]:0"), or one string with the strings separated by spaces.
  std::vector<std::pair<bool, std::string>> pieces;  // (is_sequence, special token name or A/B)
  auto add_string_piece = [&](const std::string& s) {
    if (s.starts_with("$")) {
      std::string rest =
          s.substr(1, s.find(':') == std::string::npos ? std::string::npos : s.find(':') - 1);
      pieces.emplace_back(true, rest == "B" ? "B" : "A");
    } else {
      pieces.emplace_back(false, s.substr(0, s.find(':')));
    }
  };
  if (single.is_string()) {
    const std::string s = single.get<std::string>();
    for (size_t pos = 0; pos < s.size();) {
      const size_t space = s.find(' ', pos);
      const size_t end = space == std::string::npos ? s.size() : space;
      if (end > pos) add_string_piece(s.substr(pos, end - pos));
      pos = end + 1;
    }
  } else {
    MOE_CHECK(single.is_array(), "TemplateProcessing \"single\" must be a list or a string");
    for (const Json& piece : single) {
      if (piece.is_string()) {
        add_string_piece(piece.get<std::string>());
      } else if (piece.contains("Sequence")) {
        pieces.emplace_back(true, value_or<std::string>(piece["Sequence"], "id", "A"));
      } else if (piece.contains("SpecialToken")) {
        pieces.emplace_back(
            false,
            required(piece["SpecialToken"], "id", "TemplateProcessing piece").get<std::string>());
      } else {
        MOE_FAIL("TemplateProcessing piece ", piece.dump(), " is not understood");
      }
    }
  }
  std::vector<int32_t> before, after;
  int num_sequences = 0;
  for (const auto& [is_sequence, name] : pieces) {
    if (is_sequence) {
      MOE_CHECK(name == "A", "TemplateProcessing single template uses sequence $", name);
      ++num_sequences;
      continue;
    }
    auto it = special_ids.find(name);
    MOE_CHECK(it != special_ids.end(), "TemplateProcessing special token '", name,
              "' is missing from special_tokens");
    auto& target = num_sequences == 0 ? before : after;
    target.insert(target.end(), it->second.begin(), it->second.end());
  }
  MOE_CHECK(num_sequences == 1, "TemplateProcessing single template must use $A exactly once");
  return std::make_unique<WrapProcessor>(std::move(before), std::move(after));
}

int32_t token_pair_id(const Json& j, const std::string& what) {
  MOE_CHECK(j.is_array() && j.size() == 2, what, " must be [token, id]");
  MOE_CHECK(j[1].is_number_integer() && j[1].get<int64_t>() >= 0 &&
                j[1].get<int64_t>() <= INT32_MAX,
            what, ": the id must be a non-negative integer");
  return static_cast<int32_t>(j[1].get<int64_t>());
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Parsers

std::unique_ptr<Normalizer> parse_normalizer(const Json& j) {
  if (j.is_null()) return nullptr;
  const std::string type = type_of(j, "normalizer");
  if (type == "NFC") return std::make_unique<UnicodeNormalizer>(unicode::NormalForm::kNFC);
  if (type == "NFD") return std::make_unique<UnicodeNormalizer>(unicode::NormalForm::kNFD);
  if (type == "NFKC") return std::make_unique<UnicodeNormalizer>(unicode::NormalForm::kNFKC);
  if (type == "NFKD") return std::make_unique<UnicodeNormalizer>(unicode::NormalForm::kNFKD);
  if (type == "Lowercase") return std::make_unique<LowercaseNormalizer>();
  if (type == "StripAccents") return std::make_unique<StripAccentsNormalizer>();
  if (type == "Nmt") return std::make_unique<NmtNormalizer>();
  if (type == "ByteLevel") return std::make_unique<ByteLevelNormalizer>();
  if (type == "Prepend") {
    return std::make_unique<PrependNormalizer>(
        required(j, "prepend", "Prepend normalizer").get<std::string>());
  }
  if (type == "Replace") {
    return std::make_unique<ReplaceNormalizer>(
        parse_pattern(required(j, "pattern", "Replace normalizer"), "Replace normalizer"),
        required(j, "content", "Replace normalizer").get<std::string>());
  }
  if (type == "Strip") {
    return std::make_unique<StripNormalizer>(value_or(j, "strip_left", true),
                                             value_or(j, "strip_right", true));
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Normalizer>> steps;
    for (const Json& step : required(j, "normalizers", "Sequence normalizer")) {
      if (auto n = parse_normalizer(step)) steps.push_back(std::move(n));
    }
    return std::make_unique<SequenceNormalizer>(std::move(steps));
  }
  MOE_FAIL("normalizer type '", type, "' is not supported");
}

std::unique_ptr<PreTokenizer> parse_pre_tokenizer(const Json& j) {
  if (j.is_null()) return nullptr;
  const std::string type = type_of(j, "pre_tokenizer");
  if (type == "ByteLevel") {
    return std::make_unique<ByteLevelPreTokenizer>(value_or(j, "add_prefix_space", true),
                                                   value_or(j, "use_regex", true));
  }
  if (type == "Split") {
    return std::make_unique<SplitPreTokenizer>(
        parse_pattern(required(j, "pattern", "Split pre_tokenizer"), "Split pre_tokenizer"),
        parse_behavior(required(j, "behavior", "Split pre_tokenizer")),
        value_or(j, "invert", false));
  }
  if (type == "Metaspace") {
    return std::make_unique<MetaspacePreTokenizer>(
        single_char(required(j, "replacement", "Metaspace"), "Metaspace replacement"),
        parse_prepend_scheme(j), value_or(j, "split", true));
  }
  if (type == "Digits") {
    return std::make_unique<CharSplitPreTokenizer>(
        unicode::is_numeric, value_or(j, "individual_digits", false) ? SplitBehavior::kIsolated
                                                                     : SplitBehavior::kContiguous);
  }
  if (type == "Punctuation") {
    auto behavior = SplitBehavior::kIsolated;
    if (auto it = j.find("behavior"); it != j.end() && !it->is_null()) {
      behavior = parse_behavior(*it);
    }
    return std::make_unique<CharSplitPreTokenizer>(is_bert_punctuation, behavior);
  }
  if (type == "WhitespaceSplit") {
    return std::make_unique<CharSplitPreTokenizer>(unicode::is_whitespace, SplitBehavior::kRemoved);
  }
  if (type == "Whitespace") return make_whitespace_pre_tokenizer();
  if (type == "CharDelimiterSplit") {
    const char32_t delimiter =
        single_char(required(j, "delimiter", "CharDelimiterSplit"), "CharDelimiterSplit delimiter");
    return std::make_unique<CharSplitPreTokenizer>(
        [delimiter](char32_t c) { return c == delimiter; }, SplitBehavior::kRemoved);
  }
  if (type == "BertPreTokenizer") {
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    steps.push_back(
        std::make_unique<CharSplitPreTokenizer>(unicode::is_whitespace, SplitBehavior::kRemoved));
    steps.push_back(
        std::make_unique<CharSplitPreTokenizer>(is_bert_punctuation, SplitBehavior::kIsolated));
    return std::make_unique<SequencePreTokenizer>(std::move(steps));
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    for (const Json& step : required(j, "pretokenizers", "Sequence pre_tokenizer")) {
      if (auto p = parse_pre_tokenizer(step)) steps.push_back(std::move(p));
    }
    return std::make_unique<SequencePreTokenizer>(std::move(steps));
  }
  MOE_FAIL("pre_tokenizer type '", type, "' is not supported");
}

std::unique_ptr<Decoder> parse_decoder(const Json& j) {
  if (j.is_null()) return nullptr;
  const std::string type = type_of(j, "decoder");
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "Metaspace") {
    return std::make_unique<MetaspaceDecoder>(
        single_char(required(j, "replacement", "Metaspace decoder"), "Metaspace replacement"),
        parse_prepend_scheme(j));
  }
  if (type == "Replace") {
    return std::make_unique<ReplaceDecoder>(
        parse_pattern(required(j, "pattern", "Replace decoder"), "Replace decoder"),
        required(j, "content", "Replace decoder").get<std::string>());
  }
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Strip") {
    return std::make_unique<StripDecoder>(
        single_char(required(j, "content", "Strip decoder"), "Strip decoder content"),
        count_or(j, "start", 0, "Strip decoder"), count_or(j, "stop", 0, "Strip decoder"));
  }
  if (type == "BPEDecoder") {
    return std::make_unique<BpeDecoder>(value_or<std::string>(j, "suffix", "</w>"));
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Decoder>> steps;
    for (const Json& step : required(j, "decoders", "Sequence decoder")) {
      if (auto d = parse_decoder(step)) steps.push_back(std::move(d));
    }
    return std::make_unique<SequenceDecoder>(std::move(steps));
  }
  MOE_FAIL("decoder type '", type, "' is not supported");
}

std::unique_ptr<PostProcessor> parse_post_processor(const Json& j) {
  if (j.is_null()) return nullptr;
  const std::string type = type_of(j, "post_processor");
  if (type == "TemplateProcessing") return parse_template(j);
  if (type == "ByteLevel") return std::make_unique<NoopProcessor>();
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    const int32_t cls = token_pair_id(required(j, "cls", type), type + " cls");
    const int32_t sep = token_pair_id(required(j, "sep", type), type + " sep");
    return std::make_unique<WrapProcessor>(std::vector<int32_t>{cls}, std::vector<int32_t>{sep});
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PostProcessor>> steps;
    for (const Json& step : required(j, "processors", "Sequence post_processor")) {
      if (auto p = parse_post_processor(step)) steps.push_back(std::move(p));
    }
    return std::make_unique<SequenceProcessor>(std::move(steps));
  }
  MOE_FAIL("post_processor type '", type, "' is not supported");
}

}  // namespace moeinfer::tok
