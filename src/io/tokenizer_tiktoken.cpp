// tiktoken-style tokenizers (Kimi K2): the rank file, the byte-pair merge, the split pattern.
//
// A rank file (`tiktoken.model`, what tiktoken's load_tiktoken_bpe reads) has one token per line:
// the token's bytes in base64, a space, its rank. Ranks are the ids and must be 0..n-1, each
// once; every single byte must be a token (the merge starts from bytes). The special tokens come
// from elsewhere (tokenizer.cpp: tokenizer_config.json and the tokenizer class's rule).
//
// The split pattern is written for Rust's regex crate, whose character classes may intersect
// (`[\p{Lo}&&[^\p{Han}]]`). PCRE2 10.42 has no such operator, so every intersection becomes a
// lookahead per extra operand followed by the first operand: one character that is in all of
// them. The rest of the syntax Kimi's pattern uses (\p{..}, \s, lookahead, (?i:..)) means the same
// in both engines; \s and the general categories are mapped by the tokenizer's regex layer
// (tokenizer_regex.cpp) onto White_Space and the newer Unicode data, as for tokenizer.json files,
// and \p{Han} becomes the Script (not Script_Extensions) with the ideographs Unicode 15 and 15.1
// added (widen_han).
#include <algorithm>
#include <array>
#include <cstdio>

#include "core/error.h"
#include "io/tokenizer_internal.h"
#include "io/unicode.h"

namespace moeinfer::tok {

namespace {

// Standard base64 (RFC 4648 with '=' padding), as Python's base64.b64decode reads the file.
bool base64_decode(std::string_view in, std::string& out) {
  static const std::array<int8_t, 256> kValue = [] {
    std::array<int8_t, 256> v{};
    v.fill(-1);
    const std::string_view alphabet =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (size_t i = 0; i < alphabet.size(); ++i) v[static_cast<uint8_t>(alphabet[i])] = int8_t(i);
    return v;
  }();
  if (in.size() % 4 != 0) return false;
  out.clear();
  for (size_t i = 0; i < in.size(); i += 4) {
    int values[4];
    int pad = 0;
    for (int j = 0; j < 4; ++j) {
      const char c = in[i + j];
      if (c == '=' && i + 4 == in.size() && j >= 2) {
        values[j] = 0;
        ++pad;
        continue;
      }
      if (pad > 0) return false;  // data after padding
      values[j] = kValue[static_cast<uint8_t>(c)];
      if (values[j] < 0) return false;
    }
    const uint32_t word = (uint32_t(values[0]) << 18) | (uint32_t(values[1]) << 12) |
                          (uint32_t(values[2]) << 6) | uint32_t(values[3]);
    out.push_back(static_cast<char>((word >> 16) & 0xFF));
    if (pad < 2) out.push_back(static_cast<char>((word >> 8) & 0xFF));
    if (pad < 1) out.push_back(static_cast<char>(word & 0xFF));
  }
  return true;
}

std::string byte_level(std::string_view bytes) {
  const auto& chars = unicode::byte_to_chars();
  std::string out;
  for (const char b : bytes) out += chars[static_cast<uint8_t>(b)];
  return out;
}

std::string widen_han(std::string_view p);

class TiktokenSplit final : public PreTokenizer {
 public:
  explicit TiktokenSplit(std::string_view pattern)
      : regex_(widen_han(rewrite_class_intersections(pattern)), /*oniguruma_syntax=*/true) {}

  void pre_tokenize(Pieces& pieces) const override {
    split_pieces(pieces, [this](const Piece& piece, Pieces& out) {
      std::vector<std::pair<size_t, size_t>> matches;
      regex_.find_all(piece.text, matches);
      emit_ranges(piece, matches, out);
    });
  }

 private:
  Regex regex_;
};

// The Han ideographs Unicode assigned after PCRE2 10.42's Unicode 14 and before the Unicode 16
// of tiktoken's regex crate: CJK Extension I (15.1) and Extension H (15.0).
constexpr std::string_view kHanAfterUnicode14 = "\\x{2EBF0}-\\x{2EE5D}\\x{31350}-\\x{323AF}";

// \p{Han} as Rust's regex crate means it, the Script property (PCRE2 10.40+ reads a bare script
// name as Script_Extensions, which adds punctuation such as U+3008 and the CJK strokes), with
// kHanAfterUnicode14 added, inside a class or as a class of its own.
std::string widen_han(std::string_view p) {
  constexpr std::string_view kHan = "\\p{Han}";
  const std::string han = "\\p{sc:Han}" + std::string(kHanAfterUnicode14);
  std::string out;
  int depth = 0;
  for (size_t i = 0; i < p.size();) {
    if (p.substr(i, kHan.size()) == kHan) {
      out += depth > 0 ? han : "[" + han + "]";
      i += kHan.size();
    } else if (p[i] == '\\') {
      out.append(p.substr(i, 2));
      i += 2;
    } else {
      if (p[i] == '[') ++depth;
      if (p[i] == ']' && depth > 0) --depth;
      out += p[i++];
    }
  }
  return out;
}

// The end of the bracket expression that opens at p[open] ('['), nested classes and escapes
// included: the index of its closing ']'.
size_t class_end(std::string_view p, size_t open) {
  size_t i = open + 1;
  if (i < p.size() && p[i] == '^') ++i;
  if (i < p.size() && p[i] == ']') ++i;  // a leading ']' is a literal
  while (i < p.size()) {
    if (p[i] == '\\') {
      i += 2;
    } else if (p[i] == '[') {
      i = class_end(p, i) + 1;
    } else if (p[i] == ']') {
      return i;
    } else {
      ++i;
    }
  }
  MOE_FAIL("unterminated character class in split pattern at offset ", open);
}

// Rewrites the class p[open..close] (brackets included) if it intersects at its top level.
std::string rewrite_class(std::string_view p, size_t open, size_t close) {
  const std::string_view body = p.substr(open + 1, close - open - 1);
  std::vector<std::string_view> operands;
  size_t start = 0;
  for (size_t i = 0; i < body.size();) {
    if (body[i] == '\\') {
      i += 2;
    } else if (body[i] == '[') {
      i = class_end(body, i) + 1;
    } else if (body.substr(i, 2) == "&&") {
      operands.push_back(body.substr(start, i - start));
      i += 2;
      start = i;
    } else {
      ++i;
    }
  }
  if (operands.empty()) return std::string(p.substr(open, close - open + 1));
  operands.push_back(body.substr(start));
  MOE_CHECK(!body.starts_with('^'),
            "a negated class intersection in the split pattern is not supported: ",
            std::string(p.substr(open, close - open + 1)));
  // An operand is a nested class ("[...]") or bare class items (wrapped in brackets).
  auto as_class = [](std::string_view operand) {
    const std::string inner = rewrite_class_intersections(operand);
    if (operand.size() >= 2 && operand.front() == '[' &&
        class_end(operand, 0) + 1 == operand.size())
      return inner;
    return "[" + inner + "]";
  };
  std::string out = "(?:";
  for (size_t k = 1; k < operands.size(); ++k) out += "(?=" + as_class(operands[k]) + ")";
  out += as_class(operands[0]) + ")";
  return out;
}

}  // namespace

// tokenization_kimi.py's TikTokenTokenizer.pat_str, the alternatives joined by '|'.
const std::string_view kKimiPattern =
    R"([\p{Han}]+|)"
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*)"
    R"([\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+)"
    R"([\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
    R"(\p{N}{1,3}|)"
    R"( ?[^\s\p{L}\p{N}]+[\r\n]*|)"
    R"(\s*[\r\n]+|)"
    R"(\s+(?!\S)|)"
    R"(\s+)";

std::string rewrite_class_intersections(std::string_view pattern) {
  std::string out;
  for (size_t i = 0; i < pattern.size();) {
    if (pattern[i] == '\\') {
      out.append(pattern.substr(i, 2));
      i += 2;
    } else if (pattern[i] == '[') {
      const size_t close = class_end(pattern, i);
      out += rewrite_class(pattern, i, close);
      i = close + 1;
    } else {
      out += pattern[i++];
    }
  }
  return out;
}

std::unique_ptr<PreTokenizer> make_tiktoken_split(std::string_view pattern) {
  return std::make_unique<TiktokenSplit>(pattern);
}

TiktokenModel::TiktokenModel(std::string_view text, const std::string& source) {
  std::vector<std::pair<int64_t, std::string>> entries;  // (rank, bytes)
  size_t line_no = 0;
  std::string bytes;
  for (size_t pos = 0; pos < text.size();) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;  // load_tiktoken_bpe skips empty lines
    const size_t space = line.find(' ');
    MOE_CHECK(space != std::string_view::npos && space > 0, source, ":", line_no,
              ": expected '<base64 token> <rank>'");
    const std::string_view rank_text = line.substr(space + 1);
    MOE_CHECK(!rank_text.empty() && rank_text.size() <= 9 &&
                  std::all_of(rank_text.begin(), rank_text.end(),
                              [](char c) { return c >= '0' && c <= '9'; }),
              source, ":", line_no, ": rank '", std::string(rank_text),
              "' is not a non-negative integer below 10^9");
    MOE_CHECK(base64_decode(line.substr(0, space), bytes), source, ":", line_no, ": token '",
              std::string(line.substr(0, space)), "' is not valid base64");
    MOE_CHECK(!bytes.empty(), source, ":", line_no, ": empty token");
    entries.emplace_back(std::stoll(std::string(rank_text)), bytes);
  }
  MOE_CHECK(!entries.empty(), source, ": no tokens");
  std::sort(entries.begin(), entries.end());
  tokens_.reserve(entries.size());
  ranks_.reserve(entries.size());
  by_string_.reserve(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& [rank, token] = entries[i];
    MOE_CHECK(rank == static_cast<int64_t>(i), source, ": ranks must be 0..", entries.size() - 1,
              " each once; ", rank == static_cast<int64_t>(i) - 1 ? "rank " : "missing rank ",
              rank == static_cast<int64_t>(i) - 1 ? std::to_string(rank) + " appears twice"
                                                  : std::to_string(i));
    MOE_CHECK(ranks_.emplace(token, static_cast<int32_t>(rank)).second, source,
              ": the bytes of rank ", rank, " appear twice");
    tokens_.push_back(byte_level(token));
    by_string_.emplace(tokens_.back(), static_cast<int32_t>(rank));
  }
  for (int b = 0; b < 256; ++b) {
    const char c = static_cast<char>(b);
    char hex[8];
    std::snprintf(hex, sizeof(hex), "0x%02X", b);
    MOE_CHECK(ranks_.contains(std::string_view(&c, 1)), source, ": byte ", hex,
              " is not a token; every byte must be one");
  }
}

int32_t TiktokenModel::rank_of(std::string_view bytes) const {
  const auto it = ranks_.find(bytes);
  return it == ranks_.end() ? kNoRank : it->second;
}

void TiktokenModel::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (const int32_t whole = rank_of(word); whole != kNoRank) {
    out.push_back(whole);
    return;
  }
  // parts[i]: where part i starts, and the rank of part i joined with part i + 1 (the bytes from
  // parts[i].start to parts[i + 2].start). The last entry marks the end.
  struct Part {
    size_t start;
    int32_t pair_rank;
  };
  std::vector<Part> parts(word.size() + 1);
  for (size_t i = 0; i <= word.size(); ++i) parts[i] = {i, kNoRank};
  auto pair_rank = [&](size_t i) {
    return i + 2 < parts.size()
               ? rank_of(word.substr(parts[i].start, parts[i + 2].start - parts[i].start))
               : kNoRank;
  };
  for (size_t i = 0; i + 1 < parts.size(); ++i) parts[i].pair_rank = pair_rank(i);
  while (parts.size() > 2) {
    size_t best = 0;
    int32_t best_rank = kNoRank;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      if (parts[i].pair_rank < best_rank) {
        best_rank = parts[i].pair_rank;
        best = i;
      }
    }
    if (best_rank == kNoRank) break;
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(best) + 1);
    parts[best].pair_rank = pair_rank(best);
    if (best > 0) parts[best - 1].pair_rank = pair_rank(best - 1);
  }
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    const int32_t rank = rank_of(word.substr(parts[i].start, parts[i + 1].start - parts[i].start));
    MOE_CHECK(rank != kNoRank, "a merged part is not a token");  // single bytes all are
    out.push_back(rank);
  }
}

std::optional<int32_t> TiktokenModel::token_to_id(std::string_view token) const {
  const auto it = by_string_.find(token);
  if (it == by_string_.end()) return std::nullopt;
  return it->second;
}

const std::string* TiktokenModel::id_to_token(int32_t id) const {
  if (id < 0 || id >= static_cast<int32_t>(tokens_.size())) return nullptr;
  return &tokens_[id];
}

}  // namespace moeinfer::tok
