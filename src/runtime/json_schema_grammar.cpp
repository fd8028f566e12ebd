#include "runtime/json_schema_grammar.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <unordered_map>

#include "core/error.h"
#include "io/tokenizer.h"
#include "io/unicode.h"
#include "runtime/regex_automaton.h"

namespace moeinfer {
namespace json_grammar {
namespace {

using json = nlohmann::json;

enum class Kind : uint8_t {
  kRoot,
  kAny,
  kAnyOf,
  kObject,
  kArray,
  kString,
  kNumber,
  kInteger,
  kLiterals
};

// Phases of each kind's frame.
enum : uint8_t {
  kRootBefore = 0,
  kRootDone = 1,
  kArrOpen = 0,
  kArrFirst = 1,
  kArrAfterItem = 2,
  kArrBeforeItem = 3,
  kObjOpen = 0,
  kObjFirst = 1,
  kObjKey = 2,
  kObjAfterKey = 3,
  kObjBeforeValue = 4,
  kObjAfterValue = 5,
  kObjBeforeKey = 6,
  kStrOpen = 0,
  kStrBody = 1,
  kNumStart = 0,
  kNumMinus = 1,
  kNumZero = 2,
  kNumInt = 3,
  kNumFracStart = 4,
  kNumFrac = 5,
  kNumExpStart = 6,
  kNumExpSign = 7,
  kNumExp = 8,
};
// Lexer states inside a string (Frame::sub).
enum : uint8_t { kLexBody = 0, kLexEscape = 1, kLexHex0 = 2, kLexHex3 = 5, kLexUtf8 = 6 };
// Frame::flags.
enum : uint8_t { kNegative = 1, kKeyEscaped = 1, kKeyOffTrie = 2 };

constexpr int kMaxIntDigits = 19, kMaxFracDigits = 16, kMaxExpDigits = 2;
constexpr int kMaxProperties = 64;

// A byte trie; node 0 is the root. `value` >= 0 marks the end of a word (its index).
struct ByteTrie {
  struct TrieNode {
    std::vector<std::pair<uint8_t, int32_t>> next;  // sorted by byte
    int32_t value = -1;
    uint64_t subtree = 0;  // key tries: the properties at or below this node
  };
  std::vector<TrieNode> nodes{1};
  int32_t child(int32_t n, uint8_t b) const {
    const auto& next = nodes[n].next;
    const auto it = std::lower_bound(next.begin(), next.end(), std::make_pair(b, int32_t{-1}));
    return it != next.end() && it->first == b ? it->second : -1;
  }
  void insert(std::string_view word, int32_t value) {
    int32_t n = 0;
    for (const char c : word) {
      const auto b = static_cast<uint8_t>(c);
      int32_t k = child(n, b);
      if (k < 0) {
        k = static_cast<int32_t>(nodes.size());
        auto& next = nodes[n].next;
        next.insert(std::lower_bound(next.begin(), next.end(), std::make_pair(b, int32_t{-1})),
                    {b, k});
        nodes.emplace_back();
      }
      if (value < 64) nodes[n].subtree |= uint64_t{1} << value;
      n = k;
    }
    if (value < 64) nodes[n].subtree |= uint64_t{1} << value;
    nodes[n].value = value;
  }
};

struct ObjectSpec {
  std::vector<int32_t> value_node;  // [properties]
  uint64_t all = 0, required = 0;
  int32_t additional = -1;  // node of additional properties' values; -1: none allowed
  ByteTrie keys;            // the properties' names as JSON writes them between the quotes
};

struct Node {
  Kind kind = Kind::kAny;
  int32_t child = -1;  // root: the value; array: items
  int64_t min_count = 0, max_count = std::numeric_limits<int64_t>::max();  // length / items
  bool bounded = false;  // string: a length bound; integer: a value bound
  int64_t lo = std::numeric_limits<int64_t>::min(), hi = std::numeric_limits<int64_t>::max();
  int32_t object = -1;    // index in objects
  int32_t literals = -1;  // index in literal tries
  std::vector<int32_t> alternatives = {};
  std::vector<int32_t> tuple = {};  // array of a fixed length (a const): item i's node
  uint8_t types = 0;                // JSON types the node's values can have (kType*)
  int32_t pattern = -1;             // string: index in patterns (pattern, format); -1: none
  int32_t range = -1;               // number: index in number_ranges; -1: unbounded
};

// A string's pattern and format as one automaton over its code points, and for strings with a
// length bound the lengths at which each state can still end (so the count and the automaton
// never part ways). Frame::used holds the state (low 32 bits) and the code point being read
// (high 32 bits).
struct StringPattern {
  CodePointDfa dfa;
  bool counted = false;  // minLength / maxLength apply
  int64_t min_count = 0, max_count = std::numeric_limits<int64_t>::max();
  int64_t horizon = 0;         // counted: lengths 0..horizon in `ends`
  std::vector<uint64_t> ends;  // [states, words]: bit k set when k more code points can end it
  size_t words = 0;

  // The string can still end validly from `state` after `count` code points.
  bool viable(int32_t state, int64_t count) const {
    if (!counted) return true;  // every state of a trimmed automaton can reach an end
    if (count > max_count) return false;
    const int64_t a = std::max<int64_t>(0, min_count - count);
    int64_t b = max_count == std::numeric_limits<int64_t>::max() ? horizon : max_count - count;
    b = std::min({b, a + dfa.num_states() + 1, horizon});
    if (a > b) return false;
    const uint64_t* row = ends.data() + static_cast<size_t>(state) * words;
    for (int64_t w = a >> 6; w <= b >> 6; ++w) {
      uint64_t bits = row[w];
      if (w == a >> 6) bits &= ~uint64_t{0} << (a & 63);
      if (w == b >> 6 && (b & 63) != 63) bits &= (uint64_t{1} << ((b & 63) + 1)) - 1;
      if (bits != 0) return true;
    }
    return false;
  }
  // Some code point in [lo, hi] takes `state` somewhere it can still end at `count`.
  bool viable_in(int32_t state, uint32_t lo, uint32_t hi, int64_t count) const {
    for (const auto* e = dfa.edges_begin(state); e != dfa.edges_end(state); ++e) {
      if (e->hi < lo) continue;
      if (e->lo > hi) break;
      if (viable(e->to, count)) return true;
    }
    return false;
  }
};

// A bounded number's range, in units of 1e-16 (the finest fraction the grammar writes).
struct NumberRange {
  __int128 lo = 0, hi = 0;
};

enum : uint8_t {
  kTypeNull = 1,
  kTypeBool = 2,
  kTypeInt = 4,
  kTypeFrac = 8,
  kTypeString = 16,
  kTypeArray = 32,
  kTypeObject = 64
};
constexpr uint8_t kTypeAll = 127;

bool is_ws(uint8_t b) { return b == ' ' || b == '\t' || b == '\n' || b == '\r'; }

int hex_value(uint8_t b) {
  if (b >= '0' && b <= '9') return b - '0';
  if (b >= 'a' && b <= 'f') return b - 'a' + 10;
  if (b >= 'A' && b <= 'F') return b - 'A' + 10;
  return -1;
}

enum class Lex { kReject, kStart, kCont, kQuote };

// One byte of a JSON string's body: kStart when it begins a character (a plain one, an escape,
// a UTF-8 lead byte), kCont when it continues one, kQuote for the closing quote. Only valid
// UTF-8 and no \u surrogates (so every string decodes to whole code points).
Lex lex_string(Frame& f, uint8_t b) {
  switch (f.sub) {
    case kLexBody: {
      if (b == '"') return Lex::kQuote;
      if (b == '\\') {
        f.sub = kLexEscape;
        return Lex::kStart;
      }
      if (b < 0x20) return Lex::kReject;
      if (b < 0x80) return Lex::kStart;
      int n = 0;
      int lo = 0x80, hi = 0xBF;
      if (b >= 0xC2 && b <= 0xDF) {
        n = 1;
      } else if (b >= 0xE0 && b <= 0xEF) {
        n = 2;
        if (b == 0xE0) lo = 0xA0;
        if (b == 0xED) hi = 0x9F;
      } else if (b >= 0xF0 && b <= 0xF4) {
        n = 3;
        if (b == 0xF0) lo = 0x90;
        if (b == 0xF4) hi = 0x8F;
      } else {
        return Lex::kReject;
      }
      f.sub = kLexUtf8;
      f.aux = n | lo << 8 | hi << 16;
      return Lex::kStart;
    }
    case kLexEscape:
      if (b == 'u') {
        f.sub = kLexHex0;
        return Lex::kCont;
      }
      if (b == '"' || b == '\\' || b == '/' || b == 'b' || b == 'f' || b == 'n' || b == 'r' ||
          b == 't') {
        f.sub = kLexBody;
        return Lex::kCont;
      }
      return Lex::kReject;
    case kLexUtf8: {
      const int lo = (f.aux >> 8) & 0xFF, hi = (f.aux >> 16) & 0xFF;
      if (b < lo || b > hi) return Lex::kReject;
      const int left = (f.aux & 0xFF) - 1;
      f.aux = left | 0x80 << 8 | 0xBF << 16;
      if (left == 0) f.sub = kLexBody;
      return Lex::kCont;
    }
    default: {  // \u digits
      const int v = hex_value(b);
      if (v < 0) return Lex::kReject;
      if (f.sub == kLexHex0) f.aux = v == 0xD;
      if (f.sub == kLexHex0 + 1 && f.aux == 1 && v >= 8) return Lex::kReject;  // a surrogate
      f.sub = f.sub == kLexHex3 ? kLexBody : f.sub + 1;
      return Lex::kCont;
    }
  }
}

// Whether an integer that starts with `magnitude` (`digits` digits, sign `negative`) can still
// end inside [lo, hi] with at most kMaxIntDigits digits; digits == 0 is the bare minus sign.
bool integer_viable(bool negative, uint64_t magnitude, int digits, int64_t lo, int64_t hi) {
  if (digits == 0) return lo <= std::min<int64_t>(0, hi);
  if (magnitude == 0) return lo <= 0 && 0 <= hi;  // "0" and "-0" take no more digits
  __int128 scale = 1;
  for (int extra = 0; digits + extra <= kMaxIntDigits; ++extra, scale *= 10) {
    const __int128 first = static_cast<__int128>(magnitude) * scale;
    const __int128 last = first + scale - 1;
    const __int128 a = negative ? -last : first, b = negative ? -first : last;
    if (a <= hi && b >= lo) return true;
  }
  return false;
}

bool integer_in_range(const Frame& f, int64_t lo, int64_t hi) {
  const __int128 v =
      (f.flags & kNegative) ? -static_cast<__int128>(f.used) : static_cast<__int128>(f.used);
  return v >= lo && v <= hi;
}

// Bounded numbers (a `number` with minimum / maximum ...) are written without an exponent, with
// at most kMaxBoundedDigits digits in all and kMaxFracDigits after the point, so that a prefix's
// value is exact in 64 bits: Frame::used the digits so far as one integer, count the integer
// digits, aux the fraction digits.
constexpr int kMaxBoundedDigits = 19;
constexpr int kUnitDigits = kMaxFracDigits;  // NumberRange's unit: 1e-16

__int128 pow10_128(int k) {
  __int128 v = 1;
  for (int i = 0; i < k; ++i) v *= 10;
  return v;
}

// Some multiple of `step` above `a` (a itself included) lies in [a, b] and in [lo, hi].
bool grid_hit(__int128 a, __int128 b, __int128 step, __int128 lo, __int128 hi) {
  const __int128 from = std::max(a, lo), to = std::min(b, hi);
  if (from > to) return false;
  const __int128 first = a + (from - a + step - 1) / step * step;
  return first <= to;
}

bool in_int_part(uint8_t phase) {
  return phase == kNumStart || phase == kNumMinus || phase == kNumZero || phase == kNumInt;
}

// Whether the bounded number begun in `f` can still end inside `r`.
bool number_viable(const Frame& f, const NumberRange& r) {
  const bool negative = f.flags & kNegative;
  // The magnitudes that do: [mlo, mhi].
  const __int128 mlo = std::max<__int128>(0, negative ? -r.hi : r.lo);
  const __int128 mhi = negative ? -r.lo : r.hi;
  if (mlo > mhi) return false;
  const __int128 unit = pow10_128(kUnitDigits);
  const int digits = f.count, fraction = f.aux;
  const __int128 v = static_cast<__int128>(f.used);
  if (in_int_part(f.phase)) {
    // k more integer digits, then as many fraction digits as still fit (the finest grid holds
    // every coarser one).
    for (int k = 0; digits + k <= kMaxBoundedDigits; ++k) {
      if (digits == 0 && k == 0) continue;
      if (f.phase == kNumZero && k > 0) break;
      const __int128 scale = pow10_128(k);
      const __int128 first = digits == 0 && k > 1 ? scale / 10 : 0;  // no leading zeros
      const __int128 j_lo = v * scale + first, j_hi = v * scale + scale - 1;
      const int frac_max = std::min(kMaxFracDigits, kMaxBoundedDigits - digits - k);
      const __int128 step = pow10_128(kUnitDigits - frac_max);
      if (grid_hit(j_lo * unit, j_hi * unit + unit - step, step, mlo, mhi)) return true;
    }
    return false;
  }
  const int frac_max = std::min(kMaxFracDigits, kMaxBoundedDigits - digits);
  if (frac_max - fraction < (fraction == 0 ? 1 : 0)) return false;
  const __int128 place = pow10_128(kUnitDigits - fraction);
  const __int128 step = pow10_128(kUnitDigits - frac_max);
  const __int128 base = v * place;
  return grid_hit(base, base + place - step, step, mlo, mhi);
}

bool number_in_range(const Frame& f, const NumberRange& r) {
  const int fraction = in_int_part(f.phase) ? 0 : f.aux;
  const __int128 magnitude = static_cast<__int128>(f.used) * pow10_128(kUnitDigits - fraction);
  const __int128 v = (f.flags & kNegative) ? -magnitude : magnitude;
  return v >= r.lo && v <= r.hi;
}

// ceil (up) or floor of D * 1e16, exactly, where D is the shortest decimal that reads back as x
// (what the schema's author wrote, "0.1" rather than the double's 0.1000000000000000055...): a
// written number on the right side of D is on the right side of x after any correct rounding,
// since rounding is monotonic and D rounds to x. |x| < 1e19.
__int128 scaled_bound(double x, bool up) {
  char text[64];
  const auto [end, ec] = std::to_chars(text, text + sizeof(text), x, std::chars_format::scientific);
  MOE_CHECK(ec == std::errc(), "cannot write the bound ", x);
  const std::string_view t(text, static_cast<size_t>(end - text));  // -d.ddde+XX
  const bool negative = t.front() == '-';
  __int128 mantissa = 0;
  int decimals = 0;
  bool after_point = false;
  size_t i = negative ? 1 : 0;
  for (; i < t.size() && t[i] != 'e'; ++i) {
    if (t[i] == '.') {
      after_point = true;
      continue;
    }
    mantissa = mantissa * 10 + (t[i] - '0');
    decimals += after_point;
  }
  const int exponent = std::stoi(std::string(t.substr(i + 1)));
  const int shift = exponent - decimals + kUnitDigits;  // D * 1e16 = mantissa * 10^shift
  __int128 q = 0;
  bool inexact = false;
  if (shift >= 0) {
    q = mantissa * pow10_128(shift);
  } else if (-shift <= 38) {
    const __int128 div = pow10_128(-shift);
    q = mantissa / div;
    inexact = mantissa % div != 0;
  } else {
    inexact = mantissa != 0;
  }
  // Round the magnitude away from zero where that is the asked direction.
  if (inexact && up != negative) q += 1;
  return negative ? -q : q;
}

}  // namespace
}  // namespace json_grammar

using json_grammar::Frame;
using json_grammar::State;
using namespace json_grammar;  // NOLINT: the phases and kinds above

struct JsonGrammar::Impl {
  std::vector<Node> nodes;
  std::vector<ObjectSpec> objects;
  std::vector<ByteTrie> literals;
  std::vector<StringPattern> patterns;
  std::vector<NumberRange> number_ranges;
  int32_t root = 0;
  // The alternatives of a value of any type, by its first byte.
  int32_t any_object = -1, any_array = -1, any_string = -1, any_number = -1, any_literal = -1;

  int32_t add(Node n) {
    nodes.push_back(std::move(n));
    return static_cast<int32_t>(nodes.size()) - 1;
  }
  void add_any_nodes();

  enum class Step { kAccept, kClose, kEnd, kPush, kReject };
  Step step(std::vector<Frame>& t, uint8_t b) const;
  void child_done(Frame& parent) const;
  bool can_end(const Frame& f) const;
  void offer(std::vector<Frame>& t, uint8_t b, State& out) const;
  bool key_viable(const ObjectSpec& o, const Frame& f) const;
  Step step_pattern_string(Frame& f, const Node& n, uint8_t b) const;
  Step step_bounded_number(Frame& f, const Node& n, uint8_t b) const;
  bool more_keys(const ObjectSpec& o, const Frame& f) const {
    return o.additional >= 0 || (o.all & ~f.used) != 0;
  }
};

namespace {

using json = nlohmann::json;
using Impl = JsonGrammar::Impl;

uint8_t literal_type(const json& v) {
  if (v.is_null()) return kTypeNull;
  if (v.is_boolean()) return kTypeBool;
  if (v.is_number_integer() || v.is_number_unsigned()) return kTypeInt;
  if (v.is_number_float()) {
    const double d = v.get<double>();
    return d == std::floor(d) ? kTypeInt : kTypeFrac;
  }
  if (v.is_string()) return kTypeString;
  if (v.is_array()) return kTypeArray;
  return kTypeObject;
}

int32_t add_literals(Impl& g, const std::vector<json>& values) {
  ByteTrie trie;
  Node n{.kind = Kind::kLiterals};
  std::set<std::string> seen;
  for (const json& v : values) {
    const std::string text = v.dump();
    if (!seen.insert(text).second) continue;
    trie.insert(text, static_cast<int32_t>(seen.size()) - 1);
    n.types |= literal_type(v);
  }
  g.literals.push_back(std::move(trie));
  n.literals = static_cast<int32_t>(g.literals.size()) - 1;
  return g.add(std::move(n));
}

}  // namespace

void JsonGrammar::Impl::add_any_nodes() {
  // The any-object and any-array nodes refer to the any-value node, which dispatches on the
  // first byte to these.
  const int32_t any = add({.kind = Kind::kAny, .types = kTypeAll});
  ObjectSpec o;
  o.additional = any;
  objects.push_back(std::move(o));
  any_object = add({.kind = Kind::kObject,
                    .object = static_cast<int32_t>(objects.size()) - 1,
                    .types = kTypeObject});
  any_array = add({.kind = Kind::kArray, .child = any, .types = kTypeArray});
  any_string = add({.kind = Kind::kString, .types = kTypeString});
  any_number = add({.kind = Kind::kNumber, .types = kTypeInt | kTypeFrac});
  any_literal = add_literals(*this, {json(true), json(false), json(nullptr)});
}

namespace {

// The formats followed, each as a pattern of the subset runtime/regex_automaton.h takes. Each is
// the strict side of its RFC (what every validator takes), written here from the RFCs:
// - date (RFC 3339 full-date): years 0001-9999, the days each month has, 02-29 in leap years;
// - time (full-time): hh:mm:ss, a fraction of 1-9 digits, then Z or an offset; no leap second;
// - date-time: a date, T, a time (t and z lower-case too);
// - uuid (RFC 4122 text form), hex digits of either case;
// - ipv4: dotted quad without leading zeros; ipv6 (RFC 4291 text forms, '::' once, no embedded
//   IPv4 and no zone);
// - hostname (RFC 1123): labels of letters, digits and inner hyphens, 1-63 long, at most 253 in
//   all; email: a dot-atom local part (RFC 5322), '@', a host name;
// - uri: a loose form: a scheme (RFC 3986), ':', and one or more characters of RFC 3986's
//   unreserved and reserved sets (no brackets) or %HH escapes.
struct FormatSpec {
  const char* name;
  std::string regex;
  int64_t max_length = std::numeric_limits<int64_t>::max();
};

const FormatSpec* find_format(const std::string& name) {
  static const std::vector<FormatSpec> kFormats = [] {
    const std::string d31 = "(0[1-9]|[12][0-9]|3[01])", d30 = "(0[1-9]|[12][0-9]|30)",
                      d28 = "(0[1-9]|1[0-9]|2[0-8])";
    const std::string year = "([0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})";
    const std::string leap =
        "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)";
    const std::string date = "(" + year + "-((0[13578]|1[02])-" + d31 + "|(0[469]|11)-" + d30 +
                             "|02-" + d28 + ")|" + leap + "-02-29)";
    const std::string time =
        "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,9})?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5]"
        "[0-9])";
    const std::string hex = "[0-9A-Fa-f]";
    const std::string h = hex + "{1,4}";
    const std::string octet = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])";
    const std::string ipv6 = "((" + h + ":){7}" + h + "|(" + h + ":){1,7}:|(" + h + ":){1,6}:" + h +
                             "|(" + h + ":){1,5}(:" + h + "){1,2}|(" + h + ":){1,4}(:" + h +
                             "){1,3}|(" + h + ":){1,3}(:" + h + "){1,4}|(" + h + ":){1,2}(:" + h +
                             "){1,5}|" + h + ":(:" + h + "){1,6}|:((:" + h + "){1,7}|:))";
    const std::string label = "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?";
    const std::string host = label + "(\\." + label + ")*";
    const std::string atext = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]";
    return std::vector<FormatSpec>{
        {.name = "date", .regex = "^" + date + "$"},
        {.name = "time", .regex = "^" + time + "$"},
        {.name = "date-time", .regex = "^" + date + "[Tt]" + time + "$"},
        {.name = "uuid", .regex = "^" + hex + "{8}-(" + hex + "{4}-){3}" + hex + "{12}$"},
        {.name = "ipv4", .regex = "^" + octet + "(\\." + octet + "){3}$"},
        {.name = "ipv6", .regex = "^" + ipv6 + "$"},
        {.name = "hostname", .regex = "^" + host + "$", .max_length = 253},
        {.name = "email", .regex = "^" + atext + "+(\\." + atext + "+)*@" + host + "$"},
        {.name = "uri",
         .regex = "^[A-Za-z][A-Za-z0-9+.-]*:([A-Za-z0-9._~:/?#@!$&'()*+,;=-]|%" + hex + "{2})+$"},
    };
  }();
  for (const FormatSpec& f : kFormats) {
    if (name == f.name) return &f;
  }
  return nullptr;
}

// A format's automaton, compiled once for the process.
const CodePointDfa& format_automaton(const FormatSpec& format) {
  static const std::map<std::string, CodePointDfa> kAutomata = [] {
    std::map<std::string, CodePointDfa> m;
    for (const char* name :
         {"date", "time", "date-time", "uuid", "ipv4", "ipv6", "hostname", "email", "uri"}) {
      m.emplace(name, CodePointDfa::from_pattern(find_format(name)->regex));
    }
    return m;
  }();
  return kAutomata.at(format.name);
}

// The NFA state visits all of one schema's patterns may take to compile (about a second).
constexpr int64_t kSchemaPatternWork = 3 * CodePointDfa::kMaxWork;

// Schema -> nodes.
class Compiler {
 public:
  Compiler(Impl& g, const json& root) : g_(g), root_(root) {}

  int32_t compile(const json& s, const std::string& path) {
    if (s.is_boolean()) {
      MOE_CHECK(s.get<bool>(), "JSON schema ", path, ": the schema false matches nothing");
      return any_node();
    }
    MOE_CHECK(s.is_object(), "JSON schema ", path, ": a schema must be an object or a boolean");
    if (const auto ref = s.find("$ref"); ref != s.end()) {
      refuse_others(s, path, {"$ref"});
      return compile_ref(*ref, path);
    }
    if (const auto all = s.find("allOf"); all != s.end()) {
      MOE_CHECK(all->is_array() && all->size() == 1, "JSON schema ", path,
                ": allOf is supported with one schema only");
      refuse_others(s, path, {"allOf"});
      return compile((*all)[0], path + "/allOf/0");
    }
    for (const char* key : {"anyOf", "oneOf"}) {
      if (const auto alts = s.find(key); alts != s.end()) {
        refuse_others(s, path, {key});
        return compile_union(*alts, path + "/" + key, std::string(key) == "oneOf");
      }
    }
    check_keywords(s, path);
    std::vector<std::string> types;
    if (const auto t = s.find("type"); t != s.end()) {
      if (t->is_string()) {
        types.push_back(t->get<std::string>());
      } else {
        MOE_CHECK(t->is_array() && !t->empty(), "JSON schema ", path,
                  "/type: must be a type name or a non-empty list of them");
        for (const json& name : *t) {
          MOE_CHECK(name.is_string(), "JSON schema ", path, "/type: must list type names");
          types.push_back(name.get<std::string>());
        }
      }
    }
    const bool has_enum = s.contains("enum"), has_const = s.contains("const");
    if (has_enum || has_const) {
      // The values are the whole answer; other constraints beside them are not applied.
      for (const auto& [key, value] : s.items()) {
        MOE_CHECK(is_annotation(key) || key == "type" || key == "enum" || key == "const",
                  "JSON schema ", path, ": '", key, "' beside '", has_enum ? "enum" : "const",
                  "' is not supported");
      }
      MOE_CHECK(!(has_enum && has_const), "JSON schema ", path,
                ": 'enum' beside 'const' is not supported");
    }
    if (const auto c = s.find("const"); c != s.end()) {
      MOE_CHECK(types.empty() || type_allows(types, literal_type(*c)), "JSON schema ", path,
                "/const: the value does not have the schema's type");
      return values({*c});
    }
    if (const auto e = s.find("enum"); e != s.end()) {
      MOE_CHECK(e->is_array() && !e->empty(), "JSON schema ", path,
                "/enum: must be a non-empty array");
      std::vector<json> kept;
      for (const json& v : *e) {
        if (types.empty() || type_allows(types, literal_type(v))) kept.push_back(v);
      }
      MOE_CHECK(!kept.empty(), "JSON schema ", path, "/enum: no value has the schema's type");
      return values(kept);
    }
    if (types.empty()) {
      // No type: what the keywords imply, else any value.
      if (s.contains("properties") || s.contains("required") ||
          s.contains("additionalProperties")) {
        types.push_back("object");
      } else if (s.contains("items") || s.contains("minItems") || s.contains("maxItems")) {
        types.push_back("array");
      } else if (s.contains("minLength") || s.contains("maxLength") || s.contains("pattern") ||
                 s.contains("format")) {
        types.push_back("string");
      } else if (s.contains("minimum") || s.contains("maximum") || s.contains("exclusiveMinimum") ||
                 s.contains("exclusiveMaximum")) {
        types.push_back("integer");
      } else {
        return any_node();
      }
    }
    std::vector<int32_t> alternatives;
    for (const std::string& type : types) alternatives.push_back(compile_type(s, type, path));
    if (alternatives.size() == 1) return alternatives[0];
    Node n{.kind = Kind::kAnyOf, .alternatives = alternatives};
    for (int32_t a : alternatives) n.types |= g_.nodes[a].types;
    return g_.add(std::move(n));
  }

 private:
  int32_t any_node() const { return g_.objects[g_.nodes[g_.any_object].object].additional; }

  // Nodes for exactly these values: scalars in one literal trie; objects and arrays as
  // structure (so that whitespace may sit between their parts), each of their parts exact.
  int32_t values(const std::vector<json>& vs) {
    std::vector<json> scalars;
    std::vector<int32_t> alternatives;
    for (const json& v : vs) {
      if (v.is_object()) {
        ObjectSpec spec;
        int32_t index = 0;
        for (const auto& [name, sub] : v.items()) {
          MOE_CHECK(index < kMaxProperties, "JSON schema: a const or enum object of more than ",
                    kMaxProperties, " properties is not supported");
          const std::string quoted = json(name).dump();
          spec.keys.insert(std::string_view(quoted).substr(1, quoted.size() - 2), index);
          spec.all |= uint64_t{1} << index;
          spec.value_node.push_back(values({sub}));
          ++index;
        }
        spec.required = spec.all;
        g_.objects.push_back(std::move(spec));
        alternatives.push_back(g_.add({.kind = Kind::kObject,
                                       .object = static_cast<int32_t>(g_.objects.size()) - 1,
                                       .types = kTypeObject}));
      } else if (v.is_array()) {
        Node n{.kind = Kind::kArray, .types = kTypeArray};
        for (const json& item : v) n.tuple.push_back(values({item}));
        n.min_count = n.max_count = static_cast<int64_t>(v.size());
        alternatives.push_back(g_.add(std::move(n)));
      } else {
        scalars.push_back(v);
      }
    }
    if (!scalars.empty()) alternatives.push_back(add_literals(g_, scalars));
    if (alternatives.size() == 1) return alternatives[0];
    Node n{.kind = Kind::kAnyOf, .alternatives = alternatives};
    for (int32_t a : alternatives) n.types |= g_.nodes[a].types;
    return g_.add(std::move(n));
  }

  static bool type_allows(const std::vector<std::string>& types, uint8_t t) {
    for (const std::string& name : types) {
      if ((name == "null" && t == kTypeNull) || (name == "boolean" && t == kTypeBool) ||
          (name == "integer" && t == kTypeInt) ||
          (name == "number" && (t == kTypeInt || t == kTypeFrac)) ||
          (name == "string" && t == kTypeString) || (name == "array" && t == kTypeArray) ||
          (name == "object" && t == kTypeObject)) {
        return true;
      }
    }
    return false;
  }

  static bool is_annotation(const std::string& key) {
    static const std::set<std::string> kAnnotations = {
        "title",    "description", "default",  "examples",  "$schema", "$id",
        "$comment", "deprecated",  "readOnly", "writeOnly", "$defs",   "definitions"};
    return kAnnotations.count(key) > 0;
  }

  static void refuse_others(const json& s, const std::string& path,
                            std::initializer_list<const char*> keys) {
    for (const auto& [key, value] : s.items()) {
      if (is_annotation(key)) continue;
      if (std::find_if(keys.begin(), keys.end(), [&](const char* k) { return key == k; }) !=
          keys.end()) {
        continue;
      }
      MOE_FAIL("JSON schema ", path, ": '", key, "' beside '", *keys.begin(), "' is not supported");
    }
  }

  static void check_keywords(const json& s, const std::string& path) {
    static const std::set<std::string> kSupported = {"type",
                                                     "enum",
                                                     "const",
                                                     "properties",
                                                     "required",
                                                     "additionalProperties",
                                                     "items",
                                                     "minItems",
                                                     "maxItems",
                                                     "minLength",
                                                     "maxLength",
                                                     "minimum",
                                                     "maximum",
                                                     "exclusiveMinimum",
                                                     "exclusiveMaximum",
                                                     "pattern",
                                                     "format"};
    for (const auto& [key, value] : s.items()) {
      if (is_annotation(key) || kSupported.count(key)) continue;
      if (key == "uniqueItems" && value == json(false)) continue;
      MOE_FAIL("JSON schema ", path, ": the keyword '", key, "' is not supported");
    }
  }

  static int64_t read_count(const json& s, const char* key, const std::string& path,
                            int64_t fallback) {
    const auto it = s.find(key);
    if (it == s.end()) return fallback;
    MOE_CHECK(it->is_number_integer() || it->is_number_unsigned() ||
                  (it->is_number_float() && it->get<double>() == std::floor(it->get<double>())),
              "JSON schema ", path, "/", key, ": must be a non-negative integer");
    const double v = it->get<double>();
    MOE_CHECK(v >= 0 && v < 9e18, "JSON schema ", path, "/", key,
              ": must be a non-negative integer");
    return static_cast<int64_t>(v);
  }

  int32_t compile_type(const json& s, const std::string& type, const std::string& path) {
    const auto refuse_for = [&](std::initializer_list<const char*> keys) {
      for (const char* key : keys) {
        MOE_CHECK(!s.contains(key), "JSON schema ", path, ": the keyword '", key,
                  "' is not supported for type ", type);
      }
    };
    if (type == "null") return add_literals(g_, {json(nullptr)});
    if (type == "boolean") return add_literals(g_, {json(true), json(false)});
    if (type == "string") {
      Node n{.kind = Kind::kString, .types = kTypeString};
      n.min_count = read_count(s, "minLength", path, 0);
      n.max_count = read_count(s, "maxLength", path, std::numeric_limits<int64_t>::max());
      MOE_CHECK(n.min_count <= n.max_count, "JSON schema ", path, ": minLength is above maxLength");
      n.bounded = s.contains("minLength") || s.contains("maxLength");
      compile_pattern(s, path, n);
      return g_.add(std::move(n));
    }
    if (type == "integer") {
      Node n{.kind = Kind::kInteger, .types = kTypeInt};
      read_bound(s, "minimum", path, /*lower=*/true, /*exclusive=*/false, n);
      read_bound(s, "exclusiveMinimum", path, true, true, n);
      read_bound(s, "maximum", path, false, false, n);
      read_bound(s, "exclusiveMaximum", path, false, true, n);
      MOE_CHECK(n.lo <= n.hi, "JSON schema ", path, ": no integer between the bounds");
      return g_.add(std::move(n));
    }
    if (type == "number") {
      Node n{.kind = Kind::kNumber, .types = kTypeInt | kTypeFrac};
      compile_number_range(s, path, n);
      return g_.add(std::move(n));
    }
    if (type == "array") {
      Node n{.kind = Kind::kArray, .types = kTypeArray};
      n.min_count = read_count(s, "minItems", path, 0);
      n.max_count = read_count(s, "maxItems", path, std::numeric_limits<int64_t>::max());
      MOE_CHECK(n.min_count <= n.max_count, "JSON schema ", path, ": minItems is above maxItems");
      const int32_t at = g_.add(std::move(n));
      const auto items = s.find("items");
      const int32_t child = items == s.end() ? any_node() : compile(*items, path + "/items");
      g_.nodes[at].child = child;
      return at;
    }
    if (type == "object") return compile_object(s, path);
    MOE_FAIL("JSON schema ", path, "/type: unknown type '", type, "'");
  }

  // pattern and format into one automaton (format: the ones of kFormats; any other format is an
  // annotation, as JSON Schema 2020-12 and vLLM's xgrammar take it), with its length table.
  void compile_pattern(const json& s, const std::string& path, Node& n) {
    std::optional<CodePointDfa> dfa;
    if (const auto p = s.find("pattern"); p != s.end()) {
      MOE_CHECK(p->is_string(), "JSON schema ", path, "/pattern: must be a string");
      try {
        dfa = CodePointDfa::from_pattern(p->get<std::string>(), &pattern_work_);
      } catch (const Error& e) {
        MOE_FAIL("JSON schema ", path, "/pattern: ", e.what());
      }
    }
    if (const auto f = s.find("format"); f != s.end()) {
      MOE_CHECK(f->is_string(), "JSON schema ", path, "/format: must be a string");
      if (const FormatSpec* spec = find_format(f->get<std::string>())) {
        CodePointDfa format = format_automaton(*spec);
        if (dfa) {
          try {
            format = CodePointDfa::intersect(*dfa, format);
          } catch (const Error& e) {
            MOE_FAIL("JSON schema ", path, ": pattern and format together: ", e.what());
          }
        }
        dfa = std::move(format);
        if (spec->max_length < n.max_count) {
          n.max_count = spec->max_length;
          n.bounded = true;
          MOE_CHECK(n.min_count <= n.max_count, "JSON schema ", path, ": minLength is above the ",
                    spec->max_length, " code points of format '", spec->name, "'");
        }
      }
    }
    if (!dfa) return;
    StringPattern pattern{.dfa = std::move(*dfa),
                          .counted = n.bounded,
                          .min_count = n.min_count,
                          .max_count = n.max_count};
    if (pattern.counted) {
      // ends[q] bit k: k more code points can take q to an accepting state. A window of lengths
      // longer than states + 1 holds the shortest way as well as any longer one (a longer path
      // repeats a state, and the loop can go), so min + states + 2 lengths are enough.
      const int64_t states = pattern.dfa.num_states();
      pattern.horizon = std::min<int64_t>(n.max_count, n.min_count + states + 2);
      pattern.words = static_cast<size_t>(pattern.horizon / 64 + 1);
      MOE_CHECK(static_cast<double>(states) * static_cast<double>(pattern.horizon) <= 1 << 24,
                "JSON schema ", path,
                ": a pattern or format with minLength / maxLength this large "
                "is not supported (",
                states, " automaton states times ", pattern.horizon, " lengths)");
      pattern_work_ -= states * pattern.horizon;  // the table's cost, from the same budget
      MOE_CHECK(pattern_work_ >= 0, "JSON schema ", path,
                ": the schema's patterns and formats with minLength / maxLength take too many "
                "steps to compile together; simplify them");
      pattern.ends.assign(static_cast<size_t>(states) * pattern.words, 0);
      std::vector<uint8_t> now(states), next(states);
      for (int32_t q = 0; q < states; ++q) now[q] = pattern.dfa.accepting(q);
      for (int64_t k = 0; k <= pattern.horizon; ++k) {
        for (int32_t q = 0; q < states; ++q) {
          if (now[q]) pattern.ends[q * pattern.words + (k >> 6)] |= uint64_t{1} << (k & 63);
        }
        for (int32_t q = 0; q < states; ++q) {
          next[q] = 0;
          for (const auto* e = pattern.dfa.edges_begin(q); e != pattern.dfa.edges_end(q); ++e) {
            if (now[e->to]) {
              next[q] = 1;
              break;
            }
          }
        }
        std::swap(now, next);
      }
    }
    MOE_CHECK(pattern.viable(pattern.dfa.start(), 0), "JSON schema ", path,
              ": no string of the allowed length matches the pattern or format");
    g_.patterns.push_back(std::move(pattern));
    n.pattern = static_cast<int32_t>(g_.patterns.size()) - 1;
  }

  // minimum / maximum / exclusiveMinimum / exclusiveMaximum of a number, exactly: a value the
  // grammar lets through compares to the bound as written after any correct rounding to a
  // double (an exclusive bound is held from the next double beyond it).
  void compile_number_range(const json& s, const std::string& path, Node& n) {
    const __int128 limit = pow10_128(kMaxBoundedDigits + kUnitDigits);  // beyond any written
    NumberRange r{.lo = -limit, .hi = limit};
    bool bounded = false;
    for (const char* key : {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"}) {
      const auto it = s.find(key);
      if (it == s.end()) continue;
      MOE_CHECK(it->is_number(), "JSON schema ", path, "/", key, ": must be a number");
      bounded = true;
      const std::string name = key;
      const bool lower = name == "minimum" || name == "exclusiveMinimum";
      double v = it->get<double>();
      if (name.starts_with("exclusive")) {
        v = std::nextafter(v, lower ? std::numeric_limits<double>::infinity()
                                    : -std::numeric_limits<double>::infinity());
      }
      if (std::fabs(v) >= 1e19) {
        // Beyond every number of 19 digits: no bound, or nothing left.
        MOE_CHECK(lower ? v < 0 : v > 0, "JSON schema ", path, ": no number of at most ",
                  kMaxBoundedDigits, " digits is within '", key, "'");
        continue;
      }
      if (lower) {
        r.lo = std::max(r.lo, scaled_bound(v, /*up=*/true));
      } else {
        r.hi = std::min(r.hi, scaled_bound(v, /*up=*/false));
      }
    }
    if (!bounded) return;
    MOE_CHECK(r.lo <= r.hi, "JSON schema ", path, ": no number between the bounds");
    g_.number_ranges.push_back(r);
    n.range = static_cast<int32_t>(g_.number_ranges.size()) - 1;
    MOE_CHECK(number_viable(Frame{}, r) ||
                  number_viable(Frame{.phase = kNumMinus, .flags = kNegative}, r),
              "JSON schema ", path, ": no number of at most ", kMaxFracDigits,
              " fraction digits is between the bounds");
  }

  static void read_bound(const json& s, const char* key, const std::string& path, bool lower,
                         bool exclusive, Node& n) {
    const auto it = s.find(key);
    if (it == s.end()) return;
    MOE_CHECK(it->is_number(), "JSON schema ", path, "/", key, ": must be a number");
    const double v = it->get<double>();
    MOE_CHECK(std::fabs(v) < 9e18, "JSON schema ", path, "/", key, ": out of range");
    n.bounded = true;
    if (lower) {
      double b = std::ceil(v);
      if (exclusive && b == v) b += 1;
      n.lo = std::max(n.lo, static_cast<int64_t>(b));
    } else {
      double b = std::floor(v);
      if (exclusive && b == v) b -= 1;
      n.hi = std::min(n.hi, static_cast<int64_t>(b));
    }
  }

  int32_t compile_object(const json& s, const std::string& path) {
    const int32_t object = static_cast<int32_t>(g_.objects.size());
    g_.objects.emplace_back();
    const int32_t at = g_.add({.kind = Kind::kObject, .object = object, .types = kTypeObject});
    ObjectSpec spec;
    std::vector<std::string> names;
    if (const auto props = s.find("properties"); props != s.end()) {
      MOE_CHECK(props->is_object(), "JSON schema ", path, "/properties: must be an object");
      MOE_CHECK(props->size() <= kMaxProperties, "JSON schema ", path, "/properties: at most ",
                kMaxProperties, " properties per object, got ", props->size());
      for (const auto& [name, sub] : props->items()) {
        const int32_t index = static_cast<int32_t>(names.size());
        names.push_back(name);
        const std::string quoted = json(name).dump();
        spec.keys.insert(std::string_view(quoted).substr(1, quoted.size() - 2), index);
        spec.all |= uint64_t{1} << index;
        spec.value_node.push_back(compile(sub, path + "/properties/" + name));
      }
    }
    if (const auto req = s.find("required"); req != s.end()) {
      MOE_CHECK(req->is_array(), "JSON schema ", path, "/required: must be an array");
      for (const json& name : *req) {
        MOE_CHECK(name.is_string(), "JSON schema ", path, "/required: must list names");
        const auto it = std::find(names.begin(), names.end(), name.get<std::string>());
        MOE_CHECK(it != names.end(), "JSON schema ", path, "/required: '", name.get<std::string>(),
                  "' is not among the properties");
        spec.required |= uint64_t{1} << (it - names.begin());
      }
    }
    if (const auto extra = s.find("additionalProperties"); extra != s.end()) {
      if (extra->is_boolean()) {
        if (extra->get<bool>()) spec.additional = any_node();
      } else {
        spec.additional = compile(*extra, path + "/additionalProperties");
      }
    }
    g_.objects[object] = std::move(spec);
    return at;
  }

  int32_t compile_ref(const json& ref, const std::string& path) {
    MOE_CHECK(ref.is_string(), "JSON schema ", path, "/$ref: must be a string");
    const std::string target = ref.get<std::string>();
    if (const auto it = refs_.find(target); it != refs_.end()) return it->second;
    const json* s = nullptr;
    if (target == "#") {
      s = &root_;
    } else {
      for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
        if (!target.starts_with(prefix)) continue;
        const std::string section = std::string(prefix).substr(2, std::string(prefix).size() - 3);
        const std::string name = target.substr(std::string(prefix).size());
        const auto defs = root_.find(section);
        if (defs != root_.end() && defs->is_object() && defs->contains(name)) s = &(*defs)[name];
      }
    }
    MOE_CHECK(s != nullptr, "JSON schema ", path, "/$ref: '", target,
              "' is not # or a name under #/$defs or #/definitions");
    // A placeholder first, so that a schema that refers to itself finds its node: an anyOf of
    // one alternative, filled in once the target is compiled.
    const int32_t at = g_.add({.kind = Kind::kAnyOf});
    refs_[target] = at;
    const int32_t body = compile(*s, target);
    g_.nodes[at].alternatives = {body};
    g_.nodes[at].types = g_.nodes[body].types == 0 ? kTypeAll : g_.nodes[body].types;
    return at;
  }

  int32_t compile_union(const json& alts, const std::string& path, bool one_of) {
    MOE_CHECK(alts.is_array() && !alts.empty(), "JSON schema ", path,
              ": must be a non-empty array");
    Node n{.kind = Kind::kAnyOf};
    for (size_t i = 0; i < alts.size(); ++i) {
      n.alternatives.push_back(compile(alts[i], path + "/" + std::to_string(i)));
    }
    if (one_of) {
      for (size_t i = 0; i < n.alternatives.size(); ++i) {
        for (size_t j = i + 1; j < n.alternatives.size(); ++j) {
          MOE_CHECK(disjoint(n.alternatives[i], n.alternatives[j], 0), "JSON schema ", path,
                    ": alternatives ", i, " and ", j,
                    " may both match, and oneOf wants exactly one; use anyOf, or tell them "
                    "apart by type or by a required property with different values");
        }
      }
    }
    for (int32_t a : n.alternatives) n.types |= g_.nodes[a].types;
    if (n.alternatives.size() == 1) return n.alternatives[0];
    return g_.add(std::move(n));
  }

  // True when no value can match both nodes (a sufficient test, not a complete one).
  bool disjoint(int32_t a, int32_t b, int depth) const {
    if (depth > 8) return false;
    const Node& x = g_.nodes[a];
    const Node& y = g_.nodes[b];
    const uint8_t tx = x.types == 0 ? kTypeAll : x.types, ty = y.types == 0 ? kTypeAll : y.types;
    if ((tx & ty) == 0) return true;
    if (x.kind == Kind::kAnyOf || y.kind == Kind::kAnyOf) {
      const Node& u = x.kind == Kind::kAnyOf ? x : y;
      const int32_t other = x.kind == Kind::kAnyOf ? b : a;
      if (u.alternatives.empty()) return false;
      for (int32_t alt : u.alternatives) {
        if (!disjoint(alt, other, depth + 1)) return false;
      }
      return true;
    }
    if (x.kind == Kind::kLiterals && y.kind == Kind::kLiterals) {
      const ByteTrie& p = g_.literals[x.literals];
      const ByteTrie& q = g_.literals[y.literals];
      return !shares_word(p, 0, q, 0);
    }
    if (x.kind == Kind::kString && y.kind == Kind::kString && x.pattern >= 0 && y.pattern >= 0) {
      try {
        CodePointDfa::intersect(g_.patterns[x.pattern].dfa, g_.patterns[y.pattern].dfa);
      } catch (const Error&) {
        return true;  // no string matches both
      }
      return false;
    }
    if (x.kind == Kind::kObject && y.kind == Kind::kObject) {
      const ObjectSpec& p = g_.objects[x.object];
      const ObjectSpec& q = g_.objects[y.object];
      return object_excludes(p, q, depth) || object_excludes(q, p, depth);
    }
    return false;
  }

  static bool shares_word(const ByteTrie& p, int32_t m, const ByteTrie& q, int32_t n) {
    if (p.nodes[m].value >= 0 && q.nodes[n].value >= 0) return true;
    for (const auto& [byte, next] : p.nodes[m].next) {
      const int32_t other = q.child(n, byte);
      if (other >= 0 && shares_word(p, next, q, other)) return true;
    }
    return false;
  }

  // Some property p requires cannot be in q's objects, or has values q's cannot have.
  bool object_excludes(const ObjectSpec& p, const ObjectSpec& q, int depth) const {
    for (int i = 0; i < static_cast<int>(p.value_node.size()); ++i) {
      if (!(p.required >> i & 1)) continue;
      const std::string name = word_of(p.keys, i);
      const int32_t j = find_word(q.keys, name);
      if (j < 0) {
        if (q.additional < 0) return true;
        continue;
      }
      if ((q.required >> j & 1) && disjoint(p.value_node[i], q.value_node[j], depth + 1)) {
        return true;
      }
    }
    return false;
  }

  static std::string word_of(const ByteTrie& t, int32_t value) {
    std::string word;
    const auto find = [&](auto&& self, int32_t n) -> bool {
      if (t.nodes[n].value == value) return true;
      for (const auto& [byte, next] : t.nodes[n].next) {
        word.push_back(static_cast<char>(byte));
        if (self(self, next)) return true;
        word.pop_back();
      }
      return false;
    };
    find(find, 0);
    return word;
  }

  static int32_t find_word(const ByteTrie& t, const std::string& word) {
    int32_t n = 0;
    for (const char c : word) {
      n = t.child(n, static_cast<uint8_t>(c));
      if (n < 0) return -1;
    }
    return t.nodes[n].value;
  }

  Impl& g_;
  const json& root_;
  std::map<std::string, int32_t> refs_;
  int64_t pattern_work_ = kSchemaPatternWork;  // what the schema's patterns may still take
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Frame steps. Each kind's frame takes a byte and says what became of it:
//   kAccept  taken, the value goes on;
//   kClose   taken, and it closed the value (the frame is popped, its parent told);
//   kEnd     not taken, but the value is complete as it is (a number): popped, the parent told,
//            and the byte offered to the parent;
//   kPush    the frame pushed a child for a value that starts with this byte: offered to it;
//   kReject  not taken.

bool JsonGrammar::Impl::can_end(const Frame& f) const {
  const Node& n = nodes[f.node];
  switch (n.kind) {
    case Kind::kNumber:
    case Kind::kInteger:
      if (!(f.phase == kNumZero || f.phase == kNumInt || f.phase == kNumFrac ||
            f.phase == kNumExp)) {
        return false;
      }
      if (n.range >= 0) return number_in_range(f, number_ranges[n.range]);
      return n.kind != Kind::kInteger || !n.bounded || integer_in_range(f, n.lo, n.hi);
    case Kind::kLiterals:
      return literals[n.literals].nodes[f.count].value >= 0;
    default:
      return false;
  }
}

void JsonGrammar::Impl::child_done(Frame& parent) const {
  switch (nodes[parent.node].kind) {
    case Kind::kRoot:
      parent.phase = kRootDone;
      break;
    case Kind::kArray:
      ++parent.count;
      parent.phase = kArrAfterItem;
      break;
    case Kind::kObject:
      parent.phase = kObjAfterValue;
      break;
    default:
      break;
  }
  parent.ws = 0;
}

bool JsonGrammar::Impl::key_viable(const ObjectSpec& o, const Frame& f) const {
  const bool free_key = o.additional >= 0 && !(f.flags & kKeyEscaped);
  if (f.flags & kKeyOffTrie) return free_key;
  return free_key || (o.keys.nodes[f.count].subtree & ~f.used) != 0;
}

JsonGrammar::Impl::Step JsonGrammar::Impl::step(std::vector<Frame>& t, uint8_t b) const {
  Frame& f = t.back();
  const Node& n = nodes[f.node];
  // Whitespace where a container allows it. A run is one space or tab, or a newline (after at
  // most one of those) and an indent of at most kMaxIndent spaces or tabs: enough for compact
  // and pretty-printed JSON, never a loop. Frame::ws: bit 7 a newline seen, the rest the spaces
  // and tabs of the run or its indent.
  const auto whitespace = [&]() {
    constexpr uint8_t kNewline = 0x80;
    if (b == '\n') {
      if (f.ws & kNewline) return Step::kReject;
      f.ws = kNewline;
      return Step::kAccept;
    }
    if (b == '\r') return Step::kReject;
    const int spaces = f.ws & 0x7F;
    if (spaces >= ((f.ws & kNewline) ? kMaxIndent : 1)) return Step::kReject;
    ++f.ws;
    return Step::kAccept;
  };
  const auto push = [&](int32_t node) {
    if (static_cast<int>(t.size()) >= kMaxDepth) return Step::kReject;
    f.ws = 0;
    t.push_back(Frame{.node = node});
    return Step::kPush;
  };
  switch (n.kind) {
    case Kind::kRoot:
      if (f.phase == kRootDone) return Step::kReject;
      if (is_ws(b)) return whitespace();
      return push(n.child);

    case Kind::kAny:
      // Dispatch on the first byte to the node of that type; the byte goes to it.
      if (b == '{') {
        f.node = any_object;
      } else if (b == '[') {
        f.node = any_array;
      } else if (b == '"') {
        f.node = any_string;
      } else if (b == '-' || (b >= '0' && b <= '9')) {
        f.node = any_number;
      } else if (b == 't' || b == 'f' || b == 'n') {
        f.node = any_literal;
      } else {
        return Step::kReject;
      }
      return step(t, b);

    case Kind::kAnyOf:
      return Step::kReject;  // expanded by offer()

    case Kind::kLiterals: {
      const ByteTrie& trie = literals[n.literals];
      const int32_t next = trie.child(f.count, b);
      if (next < 0) return can_end(f) ? Step::kEnd : Step::kReject;
      f.count = next;
      return trie.nodes[next].value >= 0 && trie.nodes[next].next.empty() ? Step::kClose
                                                                          : Step::kAccept;
    }

    case Kind::kString: {
      if (f.phase == kStrOpen) {
        if (b != '"') return Step::kReject;
        f.phase = kStrBody;
        return Step::kAccept;
      }
      if (n.pattern >= 0) return step_pattern_string(f, n, b);
      const Lex lex = lex_string(f, b);
      if (lex == Lex::kReject) return Step::kReject;
      if (lex == Lex::kQuote) return f.count >= n.min_count ? Step::kClose : Step::kReject;
      if (lex == Lex::kStart && n.bounded) {
        if (f.count >= n.max_count) return Step::kReject;
        ++f.count;
      }
      return Step::kAccept;
    }

    case Kind::kNumber:
    case Kind::kInteger: {
      if (n.range >= 0) return step_bounded_number(f, n, b);
      const bool integer = n.kind == Kind::kInteger;
      const bool digit = b >= '0' && b <= '9';
      const auto int_digit = [&]() {
        if (f.count >= kMaxIntDigits) return Step::kReject;
        const uint64_t magnitude = f.used * 10 + (b - '0');
        if (integer && n.bounded &&
            !integer_viable(f.flags & kNegative, magnitude, f.count + 1, n.lo, n.hi)) {
          return Step::kReject;
        }
        f.used = magnitude;
        ++f.count;
        f.phase = magnitude == 0 ? kNumZero : kNumInt;
        return Step::kAccept;
      };
      const auto end_or_reject = [&]() { return can_end(f) ? Step::kEnd : Step::kReject; };
      switch (f.phase) {
        case kNumStart:
          if (b == '-') {
            if (integer && n.bounded && !integer_viable(true, 0, 0, n.lo, n.hi)) {
              return Step::kReject;
            }
            f.flags |= kNegative;
            f.phase = kNumMinus;
            return Step::kAccept;
          }
          return digit ? int_digit() : Step::kReject;
        case kNumMinus:
          return digit ? int_digit() : Step::kReject;
        case kNumZero:
        case kNumInt:
          if (digit && f.phase == kNumInt) return int_digit();
          if (!integer && b == '.') {
            f.phase = kNumFracStart;
            f.count = 0;
            return Step::kAccept;
          }
          if (!integer && (b == 'e' || b == 'E')) {
            f.phase = kNumExpStart;
            f.count = 0;
            return Step::kAccept;
          }
          return end_or_reject();
        case kNumFracStart:
        case kNumFrac:
          if (digit) {
            if (f.count >= kMaxFracDigits) return Step::kReject;
            ++f.count;
            f.phase = kNumFrac;
            return Step::kAccept;
          }
          if (f.phase == kNumFrac && (b == 'e' || b == 'E')) {
            f.phase = kNumExpStart;
            f.count = 0;
            return Step::kAccept;
          }
          return end_or_reject();
        case kNumExpStart:
          if (b == '+' || b == '-') {
            f.phase = kNumExpSign;
            return Step::kAccept;
          }
          [[fallthrough]];
        case kNumExpSign:
        case kNumExp:
          if (digit) {
            if (f.count >= kMaxExpDigits) return Step::kReject;
            ++f.count;
            f.phase = kNumExp;
            return Step::kAccept;
          }
          return end_or_reject();
        default:
          return Step::kReject;
      }
    }

    case Kind::kArray:
      switch (f.phase) {
        case kArrOpen:
          if (b != '[') return Step::kReject;
          f.phase = kArrFirst;
          return Step::kAccept;
        case kArrFirst:
          if (is_ws(b)) return whitespace();
          if (b == ']') return n.min_count == 0 ? Step::kClose : Step::kReject;
          return n.max_count > 0 ? push(n.tuple.empty() ? n.child : n.tuple[0]) : Step::kReject;
        case kArrAfterItem:
          if (is_ws(b)) return whitespace();
          if (b == ']') return f.count >= n.min_count ? Step::kClose : Step::kReject;
          if (b == ',' && f.count < n.max_count) {
            f.phase = kArrBeforeItem;
            f.ws = 0;
            return Step::kAccept;
          }
          return Step::kReject;
        default:  // kArrBeforeItem
          if (is_ws(b)) return whitespace();
          return push(n.tuple.empty() ? n.child : n.tuple[f.count]);
      }

    case Kind::kObject: {
      const ObjectSpec& o = objects[n.object];
      const auto start_key = [&]() {
        f.phase = kObjKey;
        f.count = 0;
        f.sub = kLexBody;
        f.flags = 0;
        f.ws = 0;
        return Step::kAccept;
      };
      switch (f.phase) {
        case kObjOpen:
          if (b != '{') return Step::kReject;
          f.phase = kObjFirst;
          return Step::kAccept;
        case kObjFirst:
          if (is_ws(b)) return whitespace();
          if (b == '}') return o.required == 0 ? Step::kClose : Step::kReject;
          if (b == '"' && more_keys(o, f)) return start_key();
          return Step::kReject;
        case kObjKey: {
          Frame next = f;
          const Lex lex = lex_string(next, b);
          if (lex == Lex::kReject) return Step::kReject;
          if (lex == Lex::kQuote) {
            // The key is a declared property not seen yet, or an allowed additional one.
            int32_t prop = -1;
            if (!(f.flags & kKeyOffTrie)) prop = o.keys.nodes[f.count].value;
            if (prop >= 0) {
              if (f.used >> prop & 1) return Step::kReject;
              f.used |= uint64_t{1} << prop;
              f.aux = o.value_node[prop];
            } else {
              if (o.additional < 0 || (f.flags & kKeyEscaped)) return Step::kReject;
              f.aux = o.additional;
            }
            f.phase = kObjAfterKey;
            f.ws = 0;
            return Step::kAccept;
          }
          if (b == '\\') next.flags |= kKeyEscaped;
          if (!(next.flags & kKeyOffTrie)) {
            const int32_t child = o.keys.child(next.count, b);
            if (child < 0) {
              next.flags |= kKeyOffTrie;
            } else {
              next.count = child;
            }
          }
          if (!key_viable(o, next)) return Step::kReject;
          f = next;
          return Step::kAccept;
        }
        case kObjAfterKey:
          if (is_ws(b)) return whitespace();
          if (b != ':') return Step::kReject;
          f.phase = kObjBeforeValue;
          f.ws = 0;
          return Step::kAccept;
        case kObjBeforeValue:
          if (is_ws(b)) return whitespace();
          return push(f.aux);
        case kObjAfterValue:
          if (is_ws(b)) return whitespace();
          if (b == '}') return (f.used & o.required) == o.required ? Step::kClose : Step::kReject;
          if (b == ',' && more_keys(o, f)) {
            f.phase = kObjBeforeKey;
            f.ws = 0;
            return Step::kAccept;
          }
          return Step::kReject;
        default:  // kObjBeforeKey
          if (is_ws(b)) return whitespace();
          return b == '"' ? start_key() : Step::kReject;
      }
    }
  }
  return Step::kReject;
}

// A string with a pattern or format: the JSON lexer as for any string, and each character's
// code point through the automaton. A byte is taken only when some character it can be part of
// leaves the automaton where the string can still end (at an allowed length): an escape's
// backslash stands for any code point up to U+FFFF, a UTF-8 lead byte or a partial \u escape for
// the range its completions cover.
JsonGrammar::Impl::Step JsonGrammar::Impl::step_pattern_string(Frame& f, const Node& n,
                                                               uint8_t b) const {
  const StringPattern& p = patterns[n.pattern];
  Frame next = f;
  const uint8_t sub = f.sub;
  const Lex lex = lex_string(next, b);
  if (lex == Lex::kReject) return Step::kReject;
  auto state = static_cast<int32_t>(f.used & 0xFFFFFFFF);
  auto partial = static_cast<uint32_t>(f.used >> 32);
  if (lex == Lex::kQuote) {
    return p.dfa.accepting(state) && f.count >= n.min_count ? Step::kClose : Step::kReject;
  }
  if (lex == Lex::kStart && n.bounded) {
    if (next.count >= n.max_count) return Step::kReject;
    ++next.count;
  }
  const int64_t count = next.count;
  // The code point, once it is whole; else the range of those it can still become.
  bool whole = false;
  uint32_t cp = 0, lo = 0, hi = 0xFFFF;
  if (sub == kLexBody) {
    if (b == '\\') {
      lo = 0, hi = 0xFFFF;
    } else if (b < 0x80) {
      whole = true, cp = b;
    } else {
      const int left = next.aux & 0xFF;
      const uint32_t lead = b & (left == 1 ? 0x1F : left == 2 ? 0x0F : 0x07);
      const int shift = 6 * (left - 1);
      const uint32_t c_lo = ((next.aux >> 8) & 0xFF) - 0x80,
                     c_hi = ((next.aux >> 16) & 0xFF) - 0x80;
      partial = lead;
      lo = (lead << (6 * left)) + (c_lo << shift);
      hi = (lead << (6 * left)) + (c_hi << shift) + ((1u << shift) - 1);
    }
  } else if (sub == kLexEscape) {
    if (b == 'u') {
      partial = 0, lo = 0, hi = 0xFFFF;
    } else {
      whole = true;
      switch (b) {
        case 'b':
          cp = '\b';
          break;
        case 'f':
          cp = '\f';
          break;
        case 'n':
          cp = '\n';
          break;
        case 'r':
          cp = '\r';
          break;
        case 't':
          cp = '\t';
          break;
        default:
          cp = b;  // " \\ /
      }
    }
  } else if (sub == kLexUtf8) {
    partial = partial << 6 | (b & 0x3F);
    if (next.sub == kLexBody) {
      whole = true, cp = partial;
    } else {
      const int shift = 6 * (next.aux & 0xFF);
      lo = partial << shift, hi = (partial << shift) + ((1u << shift) - 1);
    }
  } else {  // \u digits
    partial = partial * 16 + static_cast<uint32_t>(hex_value(b));
    const int done = sub - kLexHex0 + 1;
    if (done == 4) {
      whole = true, cp = partial;
    } else {
      const int shift = 4 * (4 - done);
      lo = partial << shift, hi = (partial << shift) + ((1u << shift) - 1);
    }
  }
  if (whole) {
    state = p.dfa.next(state, cp);
    if (state < 0 || !p.viable(state, count)) return Step::kReject;
    partial = 0;
  } else if (!p.viable_in(state, lo, hi, count)) {
    return Step::kReject;
  }
  next.used = static_cast<uint64_t>(partial) << 32 | static_cast<uint32_t>(state);
  f = next;
  return Step::kAccept;
}

// A number with bounds: the JSON grammar without an exponent, each digit taken only while some
// ending of the number stays inside the range (number_viable).
JsonGrammar::Impl::Step JsonGrammar::Impl::step_bounded_number(Frame& f, const Node& n,
                                                               uint8_t b) const {
  const NumberRange& r = number_ranges[n.range];
  const bool digit = b >= '0' && b <= '9';
  Frame next = f;
  switch (f.phase) {
    case kNumStart:
      if (b == '-') {
        next.flags |= kNegative;
        next.phase = kNumMinus;
        break;
      }
      [[fallthrough]];
    case kNumMinus:
    case kNumInt:
      if (!digit) {
        if (f.phase == kNumInt && b == '.') {
          next.phase = kNumFracStart;
          break;
        }
        return f.phase == kNumInt && can_end(f) ? Step::kEnd : Step::kReject;
      }
      if (f.count >= kMaxBoundedDigits) return Step::kReject;
      next.used = f.used * 10 + (b - '0');
      ++next.count;
      next.phase = next.used == 0 ? kNumZero : kNumInt;
      break;
    case kNumZero:
      if (b == '.') {
        next.phase = kNumFracStart;
        break;
      }
      return can_end(f) ? Step::kEnd : Step::kReject;
    case kNumFracStart:
    case kNumFrac:
      if (!digit) return f.phase == kNumFrac && can_end(f) ? Step::kEnd : Step::kReject;
      if (f.aux >= kMaxFracDigits || f.count + f.aux >= kMaxBoundedDigits) return Step::kReject;
      next.used = f.used * 10 + (b - '0');
      ++next.aux;
      next.phase = kNumFrac;
      break;
    default:
      return Step::kReject;
  }
  if (!number_viable(next, r)) return Step::kReject;
  f = next;
  return Step::kAccept;
}

void JsonGrammar::Impl::offer(std::vector<Frame>& t, uint8_t b, State& out) const {
  for (;;) {
    const Frame& top = t.back();
    const Node& n = nodes[top.node];
    if (n.kind == Kind::kAnyOf) {
      // One stack per alternative, each taking the byte on its own.
      for (size_t i = 0; i < n.alternatives.size(); ++i) {
        if (out.ends.size() >= static_cast<size_t>(kMaxThreads)) return;
        if (i + 1 == n.alternatives.size()) {
          t.back() = Frame{.node = n.alternatives[i]};
          offer(t, b, out);
        } else {
          std::vector<Frame> fork = t;
          fork.back() = Frame{.node = n.alternatives[i]};
          offer(fork, b, out);
        }
      }
      return;
    }
    switch (step(t, b)) {
      case Step::kAccept:
        break;
      case Step::kClose:
        t.pop_back();
        child_done(t.back());
        break;
      case Step::kEnd:
        t.pop_back();
        child_done(t.back());
        continue;
      case Step::kPush:
        continue;
      case Step::kReject:
        return;
    }
    if (out.ends.size() >= static_cast<size_t>(kMaxThreads)) return;
    out.frames.insert(out.frames.end(), t.begin(), t.end());
    out.ends.push_back(static_cast<uint32_t>(out.frames.size()));
    return;
  }
}

// ---------------------------------------------------------------------------------------------

JsonGrammar::JsonGrammar() : impl_(std::make_unique<Impl>()) {}
JsonGrammar::~JsonGrammar() = default;
JsonGrammar::JsonGrammar(JsonGrammar&&) noexcept = default;
JsonGrammar& JsonGrammar::operator=(JsonGrammar&&) noexcept = default;

std::shared_ptr<const JsonGrammar> JsonGrammar::any_object() {
  auto g = std::make_shared<JsonGrammar>();
  Impl& impl = *g->impl_;
  impl.add_any_nodes();
  impl.root = impl.add({.kind = Kind::kRoot, .child = impl.any_object});
  return g;
}

std::shared_ptr<const JsonGrammar> JsonGrammar::from_schema(const nlohmann::json& schema) {
  auto g = std::make_shared<JsonGrammar>();
  Impl& impl = *g->impl_;
  impl.add_any_nodes();
  const int32_t root = impl.add({.kind = Kind::kRoot});
  Compiler compiler(impl, schema);
  const int32_t value = compiler.compile(schema, "#");
  impl.nodes[root].child = value;
  // A $ref chain that comes back to itself before any byte is read would expand forever.
  for (size_t start = 0; start < impl.nodes.size(); ++start) {
    std::vector<int32_t> todo = {static_cast<int32_t>(start)};
    std::set<int32_t> seen;
    while (!todo.empty()) {
      const Node& n = impl.nodes[todo.back()];
      todo.pop_back();
      if (n.kind != Kind::kAnyOf) continue;
      for (const int32_t alt : n.alternatives) {
        MOE_CHECK(alt != static_cast<int32_t>(start),
                  "JSON schema: a $ref refers to itself "
                  "without a value in between (it would match nothing)");
        if (seen.insert(alt).second) todo.push_back(alt);
      }
    }
  }
  impl.root = root;
  return g;
}

State JsonGrammar::initial() const {
  State s;
  s.frames.push_back(Frame{.node = impl_->root});
  s.ends.push_back(1);
  return s;
}

void JsonGrammar::advance(const State& in, uint8_t b, State& out,
                          std::vector<Frame>& scratch) const {
  out.clear();
  uint32_t begin = 0;
  for (const uint32_t end : in.ends) {
    scratch.assign(in.frames.begin() + begin, in.frames.begin() + end);
    impl_->offer(scratch, b, out);
    begin = end;
  }
}

bool JsonGrammar::can_finish(const State& s) const {
  uint32_t begin = 0;
  for (const uint32_t end : s.ends) {
    const Frame& top = s.frames[end - 1];
    if (end - begin == 1 && top.phase == kRootDone) return true;
    if (end - begin == 2 && impl_->can_end(top)) return true;
    begin = end;
  }
  return false;
}

bool JsonGrammar::closed(const State& s) const {
  uint32_t begin = 0;
  for (const uint32_t end : s.ends) {
    if (end - begin != 1 || s.frames[begin].phase != kRootDone) return false;
    begin = end;
  }
  return !s.ends.empty();
}

bool JsonGrammar::in_string_body(const State& s, int64_t& room) const {
  if (s.ends.size() != 1) return false;
  const Frame& top = s.frames.back();
  const Node& n = impl_->nodes[top.node];
  if (n.kind != Kind::kString || top.phase != kStrBody || top.sub != kLexBody) return false;
  if (n.pattern >= 0) return false;  // every character moves its automaton
  room = n.bounded ? n.max_count - top.count : std::numeric_limits<int64_t>::max();
  return true;
}

bool JsonGrammar::in_pattern_string(const State& s, int64_t max_chars, Frame* frame,
                                    uint64_t* key) const {
  if (s.ends.size() != 1) return false;
  const Frame& top = s.frames.back();
  const Node& n = impl_->nodes[top.node];
  if (n.kind != Kind::kString || n.pattern < 0 || top.phase != kStrBody || top.sub != kLexBody)
    return false;
  const StringPattern& p = impl_->patterns[n.pattern];
  // Past minLength, and farther from maxLength than any token reaches plus what the automaton
  // needs to end (viable's window), every length a token can leave is as good as another.
  int64_t count = top.count;
  if (p.counted && count >= p.min_count &&
      (p.max_count == std::numeric_limits<int64_t>::max() ||
       p.max_count - count - max_chars > p.dfa.num_states() + 1)) {
    count = -1;
  }
  if (!p.counted) count = -1;
  const auto state = static_cast<uint32_t>(top.used & 0xFFFFFFFF);
  // node (24 bits), automaton state (12 bits: at most kMaxStates), count + 1 (28 bits).
  if (count + 1 >= (int64_t{1} << 28) || top.node >= (1 << 24)) return false;
  *frame = top;
  *key = static_cast<uint64_t>(top.node) << 40 | static_cast<uint64_t>(state) << 28 |
         static_cast<uint64_t>(count + 1);
  return true;
}

bool JsonGrammar::step_pattern_frame(Frame& f, uint8_t b) const {
  return impl_->step_pattern_string(f, impl_->nodes[f.node], b) == Impl::Step::kAccept;
}

void JsonGrammar::count_chars(State& s, int64_t k) const {
  Frame& top = s.frames.back();
  if (impl_->nodes[top.node].bounded) top.count += static_cast<int32_t>(k);
}

// ---------------------------------------------------------------------------------------------

namespace {

// The longest prefix of `bytes` made of whole UTF-8 characters that a string body takes as
// they are (no quote, backslash or control byte): its length in bytes and in code points.
std::pair<size_t, int64_t> plain_prefix(std::string_view bytes) {
  Frame f;
  size_t whole = 0;
  int64_t chars = 0, whole_chars = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    const auto b = static_cast<uint8_t>(bytes[i]);
    if (b == '"' || b == '\\') break;
    const Lex lex = lex_string(f, b);
    if (lex == Lex::kReject) break;
    chars += lex == Lex::kStart;
    if (f.sub == kLexBody) {
      whole = i + 1;
      whole_chars = chars;
    }
  }
  return {whole, whole_chars};
}

}  // namespace

void TokenTrie::Trie::build(const std::vector<std::pair<std::string_view, int32_t>>& words) {
  // Sorted words give each node's children in byte order and a node's subtree as a contiguous
  // run, so the CSR arrays fill in one pass over a stack of open nodes.
  std::vector<std::pair<std::string_view, int32_t>> sorted = words;
  std::sort(sorted.begin(), sorted.end());
  struct Open {
    std::vector<std::pair<uint8_t, int32_t>> children;
    std::vector<int32_t> tokens;
  };
  std::vector<Open> nodes(1);
  std::vector<int32_t> path = {0};  // node ids along the current word
  std::string_view previous;
  for (const auto& [word, id] : sorted) {
    size_t common = 0;
    while (common < previous.size() && common < word.size() && previous[common] == word[common])
      ++common;
    path.resize(std::min(path.size(), common + 1));
    for (size_t i = path.size() - 1; i < word.size(); ++i) {
      const auto node = static_cast<int32_t>(nodes.size());
      nodes[path.back()].children.emplace_back(static_cast<uint8_t>(word[i]), node);
      nodes.emplace_back();
      path.push_back(node);
    }
    nodes[path.back()].tokens.push_back(id);
    previous = word;
  }
  max_depth = 0;
  for (const auto& [word, id] : sorted) max_depth = std::max(max_depth, word.size());
  child_begin.assign(1, 0);
  token_begin.assign(1, 0);
  child_byte.clear();
  child_node.clear();
  token_id.clear();
  for (const Open& n : nodes) {
    for (const auto& [b, c] : n.children) {
      child_byte.push_back(b);
      child_node.push_back(c);
    }
    token_id.insert(token_id.end(), n.tokens.begin(), n.tokens.end());
    child_begin.push_back(static_cast<uint32_t>(child_byte.size()));
    token_begin.push_back(static_cast<uint32_t>(token_id.size()));
  }
}

TokenTrie::TokenTrie(std::vector<std::string> token_bytes) : bytes_(std::move(token_bytes)) {
  std::vector<std::pair<std::string_view, int32_t>> all;
  std::vector<std::vector<std::pair<std::string_view, int32_t>>> suffixes;
  for (size_t id = 0; id < bytes_.size(); ++id) {
    const std::string_view b = bytes_[id];
    if (b.empty()) continue;
    all.emplace_back(b, static_cast<int32_t>(id));
    const auto [plain, chars] = plain_prefix(b);
    if (plain == b.size()) {
      plain_string_tokens_.emplace_back(chars, static_cast<int32_t>(id));
    } else {
      if (suffixes.size() <= static_cast<size_t>(chars)) suffixes.resize(chars + 1);
      suffixes[chars].emplace_back(b.substr(plain), static_cast<int32_t>(id));
    }
  }
  std::sort(plain_string_tokens_.begin(), plain_string_tokens_.end());
  all_.build(all);
  std::vector<std::pair<std::string_view, int32_t>> quote_free, with_quote;
  for (const auto& [b, id] : all) {
    (b.find('"') == std::string_view::npos ? quote_free : with_quote).emplace_back(b, id);
    max_token_chars_ = std::max(max_token_chars_, unicode::count_code_points(b));
  }
  quote_free_.build(quote_free);
  with_quote_.build(with_quote);
  string_suffix_.resize(suffixes.size());
  for (size_t k = 0; k < suffixes.size(); ++k) string_suffix_[k].build(suffixes[k]);
}

TokenTrie TokenTrie::from_tokenizer(const Tokenizer& tokenizer) {
  return TokenTrie(tokenizer.token_bytes());
}

JsonMatcher::JsonMatcher(std::shared_ptr<const JsonGrammar> grammar)
    : grammar_(std::move(grammar)), state_(grammar_->initial()) {}

bool JsonMatcher::advance(std::string_view bytes) {
  if (depth_states_.size() < 2) depth_states_.resize(2);
  State& next = depth_states_[0];
  State& tmp = depth_states_[1];
  next = state_;
  for (const char c : bytes) {
    grammar_->advance(next, static_cast<uint8_t>(c), tmp, scratch_);
    if (tmp.empty()) return false;
    std::swap(next, tmp);
  }
  std::swap(state_, next);
  return true;
}

void JsonMatcher::walk(const TokenTrie::Trie& trie, int32_t node, size_t depth,
                       std::span<uint8_t> allowed) {
  for (uint32_t c = trie.child_begin[node]; c < trie.child_begin[node + 1]; ++c) {
    const int32_t child = trie.child_node[c];
    State& next = depth_states_[depth + 1];
    grammar_->advance(depth_states_[depth], trie.child_byte[c], next, scratch_);
    if (next.empty()) continue;
    for (uint32_t k = trie.token_begin[child]; k < trie.token_begin[child + 1]; ++k) {
      allowed[trie.token_id[k]] = 1;
    }
    if (trie.child_begin[child] != trie.child_begin[child + 1]) {
      walk(trie, child, depth + 1, allowed);
    }
  }
}

void JsonMatcher::walk_frame(const TokenTrie::Trie& trie, int32_t node, const Frame& f,
                             std::vector<int32_t>& out) {
  for (uint32_t c = trie.child_begin[node]; c < trie.child_begin[node + 1]; ++c) {
    const int32_t child = trie.child_node[c];
    Frame next = f;
    if (!grammar_->step_pattern_frame(next, trie.child_byte[c])) continue;
    for (uint32_t k = trie.token_begin[child]; k < trie.token_begin[child + 1]; ++k) {
      out.push_back(trie.token_id[k]);
    }
    if (trie.child_begin[child] != trie.child_begin[child + 1]) walk_frame(trie, child, next, out);
  }
}

void JsonMatcher::allowed_tokens(const TokenTrie& trie, std::span<uint8_t> allowed) {
  MOE_CHECK(static_cast<int64_t>(allowed.size()) >= trie.vocab_size(), "token mask of ",
            allowed.size(), " entries for a vocabulary of ", trie.vocab_size());
  std::fill(allowed.begin(), allowed.end(), uint8_t{0});
  const size_t depth = trie.all_.max_depth + 2;
  if (depth_states_.size() < depth) depth_states_.resize(depth);
  depth_states_[0] = state_;
  int64_t room = 0;
  if (grammar_->in_string_body(state_, room)) {
    // Plain characters only count here: the tokens made of them are in while they fit, and the
    // others are walked from their first other byte, in the state their plain start leaves.
    for (const auto& [chars, t] : trie.plain_string_tokens_) {
      if (chars > room) break;
      allowed[t] = 1;
    }
    for (size_t k = 0; k < trie.string_suffix_.size() && static_cast<int64_t>(k) <= room; ++k) {
      depth_states_[0] = state_;
      grammar_->count_chars(depth_states_[0], static_cast<int64_t>(k));
      walk(trie.string_suffix_[k], 0, 0, allowed);
    }
    return;
  }
  Frame frame;
  uint64_t key = 0;
  if (grammar_->in_pattern_string(state_, trie.max_token_chars_, &frame, &key)) {
    // Tokens without a quote stay in the string: the frame alone decides them, and a string
    // looping in its automaton asks the same again. The others are walked as usual.
    auto it = pattern_masks_.find(key);
    if (it == pattern_masks_.end()) {
      if (pattern_masks_.size() >= 256) pattern_masks_.clear();
      std::vector<int32_t> tokens;
      walk_frame(trie.quote_free_, 0, frame, tokens);
      it = pattern_masks_.emplace(key, std::move(tokens)).first;
    }
    for (const int32_t t : it->second) allowed[t] = 1;
    walk(trie.with_quote_, 0, 0, allowed);
    return;
  }
  walk(trie.all_, 0, 0, allowed);
}

}  // namespace moeinfer
