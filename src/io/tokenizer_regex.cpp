// Regex matching and splitting for the tokenizer.
//
// `tokenizers` compiles its patterns with Oniguruma (Ruby syntax, UTF-8, Unicode 16 data). We use
// PCRE2 10.42 in UTF + UCP mode (Unicode 14 data), which agrees on case-insensitive groups and
// lookarounds but differs on a few escapes: in Oniguruma \s is exactly White_Space (PCRE2 adds
// U+180E), \w is Alphabetic | Mark | Nd | Pc (PCRE2: letters, numbers and '_'), \h is a hex
// digit (PCRE2: horizontal space), and \uHHHH is a code point. `translate_pattern` rewrites
// those escapes into explicit classes, and widens \p{<general category>} and \d with the code
// points assigned after Unicode 14 (unicode::newer_assignments), so both engines see the same
// sets. Ruby's ^ and $ are line anchors, hence MULTILINE.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cctype>
#include <iterator>

#include "core/error.h"
#include "io/tokenizer_internal.h"
#include "io/unicode.h"

namespace moeinfer::tok {

namespace {

constexpr std::string_view kSpaceSet =
    "\\x{9}-\\x{D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}"
    "\\x{205F}\\x{3000}";
constexpr std::string_view kHexSet = "0-9a-fA-F";

const std::string& word_set() {
  // Oniguruma's word set: Alphabetic, marks, decimal digits, connector punctuation, and the
  // Latin-1 superscripts and fractions.
  static const std::string set =
      "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{B2}\\x{B3}\\x{B9}\\x{BC}-\\x{BE}" +
      unicode::newer_class_items({"L", "M", "Nd", "Nl", "Pc"});
  return set;
}

const std::string& digit_set() {
  static const std::string set = "\\p{Nd}" + unicode::newer_class_items({"Nd"});
  return set;
}

bool is_category_name(std::string_view name) {
  static constexpr std::string_view kNames[] = {
      "L",  "Lu", "Ll", "Lt", "Lm", "Lo", "M",  "Mn", "Mc", "Me", "N", "Nd",
      "Nl", "No", "P",  "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "S", "Sm",
      "Sc", "Sk", "So", "Z",  "Zs", "Zl", "Zp", "Cc", "Cf", "Co"};
  return std::find(std::begin(kNames), std::end(kNames), name) != std::end(kNames);
}

// \p{X} / \P{X} for a general category X, with the code points assigned after PCRE2's Unicode
// version added. Returns false (and writes nothing) when the escape is something else.
bool translate_property(std::string_view p, size_t* i, bool in_class, std::string& out) {
  const char kind = p[*i + 1];  // 'p' or 'P'
  size_t j = *i + 2;
  std::string_view name;
  if (j < p.size() && p[j] == '{') {
    const size_t close = p.find('}', j);
    if (close == std::string_view::npos) return false;
    name = p.substr(j + 1, close - j - 1);
    j = close + 1;
  } else if (j < p.size()) {
    name = p.substr(j, 1);
    j += 1;
  }
  bool negated = kind == 'P';
  if (name.starts_with('^')) {
    negated = !negated;
    name.remove_prefix(1);
  }
  if (!is_category_name(name)) return false;
  const std::string extra = unicode::newer_class_items({name});
  if (extra.empty() || (negated && in_class)) return false;
  const std::string base = "\\p{" + std::string(name) + "}";
  if (in_class) {
    out += base + extra;
  } else {
    out += (negated ? "[^" : "[") + base + extra + "]";
  }
  *i = j;
  return true;
}

std::string translate_pattern(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 16);
  bool in_class = false;
  for (size_t i = 0; i < p.size();) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char d = p[i + 1];
      if (d == 'Q') {  // literal run up to \E
        const size_t end = p.find("\\E", i + 2);
        const size_t stop = end == std::string_view::npos ? p.size() : end + 2;
        out.append(p.substr(i, stop - i));
        i = stop;
        continue;
      }
      if ((d == 'p' || d == 'P') && translate_property(p, &i, in_class, out)) continue;
      if (d == 'u' && i + 6 <= p.size() &&
          std::all_of(p.begin() + i + 2, p.begin() + i + 6,
                      [](char h) { return std::isxdigit(static_cast<unsigned char>(h)); })) {
        out += "\\x{";
        out.append(p.substr(i + 2, 4));
        out += '}';
        i += 6;
        continue;
      }
      const std::string& word = word_set();
      const std::string& digit = digit_set();
      std::string_view set;
      bool negated = false;
      switch (d) {
        case 's':
          set = kSpaceSet;
          break;
        case 'S':
          set = kSpaceSet;
          negated = true;
          break;
        case 'w':
          set = word;
          break;
        case 'W':
          set = word;
          negated = true;
          break;
        case 'd':
          set = digit;
          break;
        case 'D':
          set = digit;
          negated = true;
          break;
        case 'h':
          set = kHexSet;
          break;
        case 'H':
          set = kHexSet;
          negated = true;
          break;
        default:
          break;
      }
      if (set.empty() || (negated && in_class)) {
        // Other escapes mean the same in both engines; a negated set inside a class has no
        // PCRE2 spelling, so it keeps PCRE2's meaning there.
        out.append(p.substr(i, 2));
      } else if (in_class) {
        out.append(set);
      } else {
        out += negated ? "[^" : "[";
        out.append(set);
        out += ']';
      }
      i += 2;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      ++i;
      if (i < p.size() && p[i] == '^') out += p[i++];
      if (i < p.size() && p[i] == ']') out += p[i++];  // a leading ']' is a literal
      continue;
    }
    if (in_class && c == '[' && i + 1 < p.size() && p[i + 1] == ':') {  // [:alpha:]
      const size_t end = p.find(":]", i + 2);
      const size_t stop = end == std::string_view::npos ? i + 1 : end + 2;
      out.append(p.substr(i, stop - i));
      i = stop;
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out += c;
    ++i;
  }
  return out;
}

}  // namespace

Regex::Regex(std::string_view pattern, bool oniguruma_syntax) {
  const std::string translated =
      oniguruma_syntax ? translate_pattern(pattern) : std::string(pattern);
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                    PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &error_code, &error_offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    MOE_FAIL("cannot compile regex '", pattern, "': ", reinterpret_cast<const char*>(message),
             " at offset ", error_offset);
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if JIT is off
  code_ = code;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

namespace {

// Runs one match from `start`; returns false when there is none.
bool match_at(const pcre2_code* code, std::string_view text, size_t start, pcre2_match_data* md,
              size_t* s, size_t* e) {
  int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), start,
                       PCRE2_NO_UTF_CHECK, md, nullptr);
  if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
    rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), start,
                     PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, nullptr);
  }
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(rc, message, sizeof(message));
    MOE_FAIL("regex match failed: ", reinterpret_cast<const char*>(message));
  }
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(md);
  *s = ovector[0];
  *e = ovector[1];
  return true;
}

struct MatchData {
  explicit MatchData(const pcre2_code* code)
      : md(pcre2_match_data_create_from_pattern(code, nullptr)) {
    MOE_CHECK(md != nullptr, "out of memory for regex match data");
  }
  ~MatchData() { pcre2_match_data_free(md); }
  pcre2_match_data* md;
};

}  // namespace

void Regex::find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const {
  const auto* code = static_cast<const pcre2_code*>(code_);
  MatchData data(code);
  size_t pos = 0;
  bool have_last = false;
  size_t last_end = 0;
  while (pos <= text.size()) {
    size_t s = 0, e = 0;
    if (!match_at(code, text, pos, data.md, &s, &e)) break;
    if (s == e && have_last && last_end == e) {
      // An empty match where the previous one ended: step over one character and retry.
      pos += pos < text.size() ? unicode::utf8_length(static_cast<unsigned char>(text[pos])) : 1;
      continue;
    }
    pos = e;
    last_end = e;
    have_last = true;
    out.emplace_back(s, e);
  }
}

bool Regex::search(std::string_view text) const {
  const auto* code = static_cast<const pcre2_code*>(code_);
  MatchData data(code);
  size_t s = 0, e = 0;
  return match_at(code, text, 0, data.md, &s, &e);
}

std::string Regex::escape(std::string_view literal) {
  std::string out;
  for (const char c : literal) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7F) {
      static const char kHex[] = "0123456789ABCDEF";
      out += "\\x{";
      out += kHex[u >> 4];
      out += kHex[u & 15];
      out += '}';
    } else if (u < 0x80 && !std::isalnum(u) && c != ' ') {
      out += '\\';
      out += c;
    } else {
      out += c;
    }
  }
  return out;
}

std::vector<Span> regex_spans(const Regex& regex, std::string_view text) {
  std::vector<Span> spans;
  if (text.empty()) {
    spans.push_back({0, 0, false});
    return spans;
  }
  std::vector<std::pair<size_t, size_t>> matches;
  regex.find_all(text, matches);
  size_t prev = 0;
  for (const auto& [s, e] : matches) {
    if (prev != s) spans.push_back({prev, s, false});
    spans.push_back({s, e, true});
    prev = e;
  }
  if (prev != text.size()) spans.push_back({prev, text.size(), false});
  return spans;
}

std::vector<Span> char_spans(std::string_view text, const std::function<bool(char32_t)>& pred) {
  std::vector<Span> spans;
  if (text.empty()) {
    spans.push_back({0, 0, false});
    return spans;
  }
  size_t last = 0;
  for (size_t pos = 0; pos < text.size();) {
    const size_t start = pos;
    const char32_t cp = unicode::next_code_point(text, pos);
    if (pred(cp)) {
      if (last < start) spans.push_back({last, start, false});
      spans.push_back({start, pos, true});
      last = pos;
    }
  }
  if (last < text.size()) spans.push_back({last, text.size(), false});
  return spans;
}

std::vector<std::pair<size_t, size_t>> apply_behavior(std::vector<Span> spans,
                                                      SplitBehavior behavior) {
  std::vector<std::pair<size_t, size_t>> keep;
  keep.reserve(spans.size());
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const Span& s : spans) keep.emplace_back(s.start, s.end);
      break;
    case SplitBehavior::kRemoved:
      for (const Span& s : spans) {
        if (!s.is_match) keep.emplace_back(s.start, s.end);
      }
      break;
    case SplitBehavior::kContiguous: {
      bool previous = false;
      for (const Span& s : spans) {
        if (s.is_match == previous && !keep.empty()) {
          keep.back().second = s.end;
        } else {
          keep.emplace_back(s.start, s.end);
        }
        previous = s.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithPrevious: {
      bool previous = false;
      for (const Span& s : spans) {
        if (s.is_match && !previous && !keep.empty()) {
          keep.back().second = s.end;
        } else {
          keep.emplace_back(s.start, s.end);
        }
        previous = s.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool previous = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->is_match && !previous && !keep.empty()) {
          keep.back().first = it->start;
        } else {
          keep.emplace_back(it->start, it->end);
        }
        previous = it->is_match;
      }
      std::reverse(keep.begin(), keep.end());
      break;
    }
  }
  return keep;
}

SplitBehavior parse_behavior(const Json& j) {
  const std::string name = j.get<std::string>();
  if (name == "Removed" || name == "removed") return SplitBehavior::kRemoved;
  if (name == "Isolated" || name == "isolated") return SplitBehavior::kIsolated;
  if (name == "MergedWithPrevious" || name == "merged_with_previous") {
    return SplitBehavior::kMergedWithPrevious;
  }
  if (name == "MergedWithNext" || name == "merged_with_next") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous" || name == "contiguous") return SplitBehavior::kContiguous;
  MOE_FAIL("unknown split behavior '", name, "'");
}

void split_pieces(Pieces& pieces, const std::function<void(const Piece&, Pieces&)>& fn) {
  Pieces result;
  result.reserve(pieces.size());
  Pieces scratch;
  for (Piece& piece : pieces) {
    if (piece.id >= 0) {
      result.push_back(std::move(piece));
      continue;
    }
    scratch.clear();
    fn(piece, scratch);
    for (Piece& sub : scratch) {
      if (!sub.text.empty()) result.push_back(std::move(sub));
    }
  }
  pieces = std::move(result);
}

void emit_ranges(const Piece& piece, const std::vector<std::pair<size_t, size_t>>& ranges,
                 Pieces& out) {
  for (const auto& [s, e] : ranges) {
    out.push_back(Piece{
        .text = piece.text.substr(s, e - s), .id = -1, .at_origin = piece.at_origin && s == 0});
  }
}

}  // namespace moeinfer::tok
