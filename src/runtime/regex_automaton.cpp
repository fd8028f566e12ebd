#include "runtime/regex_automaton.h"

#include <algorithm>
#include <deque>
#include <map>
#include <string>
#include <utility>

#include "core/error.h"

namespace moeinfer {
namespace {

// A set of code points as sorted, disjoint, non-adjacent ranges [first, second].
using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;

constexpr uint32_t kSurrogateLo = 0xD800, kSurrogateHi = 0xDFFF;
// Repetition counts above this are refused: {n,m} copies its operand.
constexpr int kMaxRepeat = 1000;
constexpr size_t kMaxNfaStates = 200'000;
// Groups nest at most this deep (the parser and the NFA builder recurse through them).
constexpr int kMaxGroupDepth = 64;

Ranges normalized(Ranges r) {
  std::sort(r.begin(), r.end());
  Ranges out;
  for (const auto& [lo, hi] : r) {
    if (!out.empty() && lo <= out.back().second + 1) {
      out.back().second = std::max(out.back().second, hi);
    } else {
      out.emplace_back(lo, hi);
    }
  }
  // Strings never hold surrogates (the JSON lexer refuses them): drop them here.
  Ranges cut;
  for (const auto& [lo, hi] : out) {
    if (hi < kSurrogateLo || lo > kSurrogateHi) {
      cut.emplace_back(lo, hi);
      continue;
    }
    if (lo < kSurrogateLo) cut.emplace_back(lo, kSurrogateLo - 1);
    if (hi > kSurrogateHi) cut.emplace_back(kSurrogateHi + 1, hi);
  }
  return cut;
}

Ranges complement(const Ranges& r) {
  Ranges out;
  uint32_t next = 0;
  for (const auto& [lo, hi] : r) {
    if (lo > next) out.emplace_back(next, lo - 1);
    next = hi + 1;
  }
  if (next <= CodePointDfa::kMaxCodePoint) out.emplace_back(next, CodePointDfa::kMaxCodePoint);
  return normalized(out);
}

Ranges united(Ranges a, const Ranges& b) {
  a.insert(a.end(), b.begin(), b.end());
  return normalized(std::move(a));
}

Ranges digit_class() { return {{'0', '9'}}; }
Ranges word_class() { return normalized({{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}}); }
// ECMA-262 WhiteSpace and LineTerminator.
Ranges space_class() {
  return normalized({{'\t', '\r'},
                     {' ', ' '},
                     {0xA0, 0xA0},
                     {0x1680, 0x1680},
                     {0x2000, 0x200A},
                     {0x2028, 0x2029},
                     {0x202F, 0x202F},
                     {0x205F, 0x205F},
                     {0x3000, 0x3000},
                     {0xFEFF, 0xFEFF}});
}
Ranges dot_class() {
  return complement(normalized({{'\n', '\n'}, {'\r', '\r'}, {0x2028, 0x2029}}));
}
Ranges all_class() { return normalized({{0, CodePointDfa::kMaxCodePoint}}); }

// The pattern's code points (it is a JSON string, so valid UTF-8).
std::vector<uint32_t> decode_utf8(std::string_view text, const char* what) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < text.size();) {
    const auto b = static_cast<uint8_t>(text[i]);
    int n = 0;
    uint32_t cp = 0;
    if (b < 0x80) {
      cp = b;
    } else if ((b & 0xE0) == 0xC0) {
      n = 1;
      cp = b & 0x1F;
    } else if ((b & 0xF0) == 0xE0) {
      n = 2;
      cp = b & 0x0F;
    } else if ((b & 0xF8) == 0xF0) {
      n = 3;
      cp = b & 0x07;
    } else {
      MOE_FAIL(what, " is not valid UTF-8");
    }
    MOE_CHECK(i + n < text.size() || n == 0, what, " is not valid UTF-8");
    for (int k = 1; k <= n; ++k) {
      const auto c = static_cast<uint8_t>(text[i + k]);
      MOE_CHECK((c & 0xC0) == 0x80, what, " is not valid UTF-8");
      cp = cp << 6 | (c & 0x3F);
    }
    out.push_back(cp);
    i += n + 1;
  }
  return out;
}

// The syntax tree.
struct Ast {
  enum class Kind { kClass, kConcat, kAlt, kRepeat } kind = Kind::kConcat;
  Ranges ranges = {};              // kClass
  std::vector<int32_t> kids = {};  // kConcat, kAlt; kRepeat: one
  int min = 0, max = 0;            // kRepeat; max -1: unbounded
};

class Parser {
 public:
  explicit Parser(std::string_view pattern)
      : p_(decode_utf8(pattern, "the pattern")), text_(pattern) {}

  // The whole pattern as JSON Schema matches it: anywhere in the string, unless anchored.
  int32_t parse() {
    std::vector<int32_t> alternatives;
    while (true) {
      bool anchored_start = false, anchored_end = false;
      if (peek('^')) {
        ++i_;
        anchored_start = true;
      }
      const int32_t body = sequence(/*depth=*/0, &anchored_end);
      std::vector<int32_t> parts;
      if (!anchored_start) parts.push_back(anything());
      parts.push_back(body);
      if (!anchored_end) parts.push_back(anything());
      alternatives.push_back(add({.kind = Ast::Kind::kConcat, .kids = parts}));
      if (i_ == p_.size()) break;
      MOE_CHECK(p_[i_] == '|', "the pattern has an unmatched ')' at ", where());
      ++i_;
    }
    return alternatives.size() == 1 ? alternatives[0]
                                    : add({.kind = Ast::Kind::kAlt, .kids = alternatives});
  }

  std::vector<Ast> nodes;

 private:
  int32_t add(Ast a) {
    nodes.push_back(std::move(a));
    return static_cast<int32_t>(nodes.size()) - 1;
  }
  int32_t klass(Ranges r) { return add({.kind = Ast::Kind::kClass, .ranges = std::move(r)}); }
  int32_t anything() {
    return add({.kind = Ast::Kind::kRepeat, .kids = {klass(all_class())}, .min = 0, .max = -1});
  }

  bool peek(uint32_t c, size_t ahead = 0) const {
    return i_ + ahead < p_.size() && p_[i_ + ahead] == c;
  }
  std::string where() const { return "code point " + std::to_string(i_) + " of '" + text_ + "'"; }

  // Alternatives up to ')' (depth > 0) or the end.
  int32_t alternation(int depth) {
    std::vector<int32_t> alternatives = {sequence(depth, nullptr)};
    while (peek('|')) {
      ++i_;
      alternatives.push_back(sequence(depth, nullptr));
    }
    return alternatives.size() == 1 ? alternatives[0]
                                    : add({.kind = Ast::Kind::kAlt, .kids = alternatives});
  }

  // Atoms and their quantifiers up to '|', ')' or the end. At depth 0 a '$' may end it.
  int32_t sequence(int depth, bool* anchored_end) {
    std::vector<int32_t> parts;
    while (i_ < p_.size() && p_[i_] != '|' && p_[i_] != ')') {
      const uint32_t c = p_[i_];
      if (c == '$') {
        const bool last = i_ + 1 == p_.size() || p_[i_ + 1] == '|';
        MOE_CHECK(depth == 0 && last && anchored_end != nullptr,
                  "the anchor '$' is supported only at the end of the pattern or of a top-level "
                  "alternative (",
                  where(), ")");
        *anchored_end = true;
        ++i_;
        break;
      }
      MOE_CHECK(c != '^',
                "the anchor '^' is supported only at the start of the pattern or of a "
                "top-level alternative (",
                where(), ")");
      int32_t atom_node = atom(depth);
      atom_node = quantified(atom_node);
      parts.push_back(atom_node);
    }
    MOE_CHECK(depth > 0 || i_ == p_.size() || p_[i_] != ')', "the pattern has an unmatched ')' at ",
              where());
    return parts.size() == 1 ? parts[0] : add({.kind = Ast::Kind::kConcat, .kids = parts});
  }

  // {n}, {n,}, {n,m} at i_: true and the counts when it is one (ECMA-262 takes a '{' that is
  // not a quantifier as a literal).
  bool braces(size_t at, int* lo, int* hi, size_t* end) const {
    size_t k = at + 1;
    const auto number = [&](int* v) {
      const size_t begin = k;
      int64_t x = 0;
      while (k < p_.size() && p_[k] >= '0' && p_[k] <= '9') {
        x = std::min<int64_t>(x * 10 + (p_[k] - '0'), int64_t{1} << 40);
        ++k;
      }
      *v = static_cast<int>(std::min<int64_t>(x, 1 << 30));
      return k > begin;
    };
    if (at >= p_.size() || p_[at] != '{' || !number(lo)) return false;
    *hi = *lo;
    if (k < p_.size() && p_[k] == ',') {
      ++k;
      if (!number(hi)) *hi = -1;
    }
    if (k >= p_.size() || p_[k] != '}') return false;
    *end = k + 1;
    return true;
  }

  int32_t quantified(int32_t operand) {
    int lo = 0, hi = 0;
    size_t end = 0;
    if (peek('*')) {
      lo = 0, hi = -1, end = i_ + 1;
    } else if (peek('+')) {
      lo = 1, hi = -1, end = i_ + 1;
    } else if (peek('?')) {
      lo = 0, hi = 1, end = i_ + 1;
    } else if (!braces(i_, &lo, &hi, &end)) {
      return operand;
    }
    MOE_CHECK(hi < 0 || lo <= hi, "the quantifier at ", where(), " has its counts out of order");
    MOE_CHECK(lo <= kMaxRepeat && hi <= kMaxRepeat, "the quantifier at ", where(),
              " repeats more than ", kMaxRepeat, " times");
    i_ = end;
    if (peek('?')) ++i_;  // lazy: the same strings match
    int a = 0, b = 0;
    size_t e = 0;
    MOE_CHECK(!(peek('*') || peek('+') || peek('?') || braces(i_, &a, &b, &e)),
              "the pattern repeats a quantifier at ", where(), " (nothing to repeat)");
    return add({.kind = Ast::Kind::kRepeat, .kids = {operand}, .min = lo, .max = hi});
  }

  int32_t atom(int depth) {
    const uint32_t c = p_[i_];
    switch (c) {
      case '(': {
        MOE_CHECK(depth < kMaxGroupDepth, "the pattern nests groups more than ", kMaxGroupDepth,
                  " deep (", where(), ")");
        ++i_;
        if (peek('?')) {
          if (peek(':', 1)) {
            i_ += 2;
          } else if (peek('=', 1) || peek('!', 1)) {
            MOE_FAIL("lookahead ('(?=' / '(?!') is not supported in a pattern (", where(), ")");
          } else if (peek('<', 1) && (peek('=', 2) || peek('!', 2))) {
            MOE_FAIL("lookbehind ('(?<=' / '(?<!') is not supported in a pattern (", where(), ")");
          } else if (peek('<', 1)) {  // a named group: the name does not change what matches
            i_ += 2;
            while (i_ < p_.size() && p_[i_] != '>') ++i_;
            MOE_CHECK(i_ < p_.size(), "the group name at ", where(), " has no '>'");
            ++i_;
          } else {
            MOE_FAIL("the group '(?", i_ + 1 < p_.size() ? std::string(1, char(p_[i_ + 1])) : "",
                     "' is not supported in a pattern (", where(), ")");
          }
        }
        const int32_t inner = alternation(depth + 1);
        MOE_CHECK(peek(')'), "the pattern has an unclosed '(' (", where(), ")");
        ++i_;
        return inner;
      }
      case '[':
        return klass(character_class());
      case '.':
        ++i_;
        return klass(dot_class());
      case '\\':
        return klass(escape(/*in_class=*/false));
      case '*':
      case '+':
      case '?':
        MOE_FAIL("the pattern has a quantifier with nothing to repeat at ", where());
      case '{': {
        int a = 0, b = 0;
        size_t e = 0;
        MOE_CHECK(!braces(i_, &a, &b, &e),
                  "the pattern has a quantifier with nothing to repeat at ", where());
        ++i_;
        return klass({{c, c}});
      }
      default:
        ++i_;
        return klass(normalized({{c, c}}));
    }
  }

  uint32_t hex(int digits) {
    uint32_t v = 0;
    for (int k = 0; k < digits; ++k, ++i_) {
      MOE_CHECK(i_ < p_.size(), "the escape at ", where(), " is cut short");
      const uint32_t d = p_[i_];
      int x = -1;
      if (d >= '0' && d <= '9') x = static_cast<int>(d - '0');
      if (d >= 'a' && d <= 'f') x = static_cast<int>(d - 'a' + 10);
      if (d >= 'A' && d <= 'F') x = static_cast<int>(d - 'A' + 10);
      MOE_CHECK(x >= 0, "the escape at ", where(), " wants hex digits");
      v = v * 16 + static_cast<uint32_t>(x);
    }
    return v;
  }

  // At a backslash; the code points it stands for.
  Ranges escape(bool in_class) {
    ++i_;
    MOE_CHECK(i_ < p_.size(), "the pattern ends in a lone backslash");
    const uint32_t c = p_[i_++];
    const auto one = [](uint32_t v) { return normalized({{v, v}}); };
    switch (c) {
      case 'd':
        return digit_class();
      case 'D':
        return complement(digit_class());
      case 'w':
        return word_class();
      case 'W':
        return complement(word_class());
      case 's':
        return space_class();
      case 'S':
        return complement(space_class());
      case 't':
        return one('\t');
      case 'n':
        return one('\n');
      case 'v':
        return one('\v');
      case 'f':
        return one('\f');
      case 'r':
        return one('\r');
      case 'b':
        MOE_CHECK(in_class, "the word boundary '\\b' is not supported in a pattern");
        return one('\b');
      case 'B':
        MOE_FAIL("the word boundary '\\B' is not supported in a pattern");
      case 'p':
      case 'P':
        MOE_FAIL("Unicode property escapes ('\\", char(c),
                 "{...}') are not supported in a pattern");
      case 'k':
        MOE_FAIL("backreferences ('\\k<name>') are not supported in a pattern");
      case '0':
        MOE_CHECK(!(i_ < p_.size() && p_[i_] >= '0' && p_[i_] <= '9'),
                  "octal escapes are not supported in a pattern (", where(), ")");
        return one(0);
      case 'c': {
        MOE_CHECK(i_ < p_.size() &&
                      ((p_[i_] >= 'a' && p_[i_] <= 'z') || (p_[i_] >= 'A' && p_[i_] <= 'Z')),
                  "the control escape '\\c' wants a letter (", where(), ")");
        return one(p_[i_++] % 32);
      }
      case 'x':
        return one(hex(2));
      case 'u': {
        MOE_CHECK(!peek('{'), "the escape '\\u{...}' needs the u flag, which a pattern has not");
        const uint32_t v = hex(4);
        if (v >= 0xD800 && v <= 0xDBFF && peek('\\') && peek('u', 1)) {
          i_ += 2;
          const uint32_t low = hex(4);
          MOE_CHECK(low >= 0xDC00 && low <= 0xDFFF, "the escape '\\u", std::to_string(v),
                    "' is half a surrogate pair");
          return one(0x10000 + ((v - 0xD800) << 10) + (low - 0xDC00));
        }
        MOE_CHECK(v < kSurrogateLo || v > kSurrogateHi,
                  "a lone surrogate escape is not supported in a pattern (", where(), ")");
        return one(v);
      }
      default:
        break;
    }
    MOE_CHECK(!(c >= '1' && c <= '9'), "backreferences ('\\", char(c),
              "') are not supported in a pattern");
    const bool alnum = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
    MOE_CHECK(!alnum, "the escape '\\", char(c), "' is not supported in a pattern");
    return one(c);  // an escaped punctuation mark stands for itself
  }

  Ranges character_class() {
    ++i_;  // '['
    bool negated = false;
    if (peek('^')) {
      negated = true;
      ++i_;
    }
    Ranges set;
    while (true) {
      MOE_CHECK(i_ < p_.size(), "the pattern has an unclosed '[' (", where(), ")");
      if (peek(']')) {
        ++i_;
        break;
      }
      const bool escaped = peek('\\');
      Ranges first = escaped ? escape(/*in_class=*/true) : Ranges{{p_[i_], p_[i_]}};
      if (!escaped) ++i_;
      if (peek('-') && i_ + 1 < p_.size() && p_[i_ + 1] != ']') {
        ++i_;
        const bool escaped_hi = peek('\\');
        Ranges second = escaped_hi ? escape(true) : Ranges{{p_[i_], p_[i_]}};
        if (!escaped_hi) ++i_;
        MOE_CHECK(first.size() == 1 && second.size() == 1 && first[0].first == first[0].second &&
                      second[0].first == second[0].second,
                  "a class range at ", where(), " must run between two characters");
        MOE_CHECK(first[0].first <= second[0].first, "the class range at ", where(),
                  " is out of order");
        set.emplace_back(first[0].first, second[0].first);
        continue;
      }
      set.insert(set.end(), first.begin(), first.end());
    }
    set = normalized(std::move(set));
    return negated ? complement(set) : set;
  }

  std::vector<uint32_t> p_;
  std::string text_;
  size_t i_ = 0;
};

// Thompson NFA: each state has epsilon moves and at most one move over a set of code points.
struct Nfa {
  struct State {
    std::vector<int32_t> eps;
    int32_t ranges = -1;  // index into sets; -1: none
    int32_t to = -1;
  };
  std::vector<State> states;
  std::vector<Ranges> sets;
  std::vector<uint32_t> seen;  // closure(): the generation that last visited each state
  uint32_t generation = 0;
  int64_t work = 0;  // states visited by closure() so far

  int32_t add() {
    MOE_CHECK(states.size() < kMaxNfaStates,
              "the pattern is too large (its repetitions expand past ", kMaxNfaStates, " states)");
    states.emplace_back();
    return static_cast<int32_t>(states.size()) - 1;
  }

  // The fragment for node `n`: (entry, exit).
  std::pair<int32_t, int32_t> build(const std::vector<Ast>& ast, int32_t n) {
    const Ast& a = ast[n];
    switch (a.kind) {
      case Ast::Kind::kClass: {
        const int32_t s = add(), e = add();
        sets.push_back(a.ranges);
        states[s].ranges = static_cast<int32_t>(sets.size()) - 1;
        states[s].to = e;
        return {s, e};
      }
      case Ast::Kind::kConcat: {
        const int32_t s = add();
        int32_t at = s;
        for (const int32_t kid : a.kids) {
          const auto [ks, ke] = build(ast, kid);
          states[at].eps.push_back(ks);
          at = ke;
        }
        return {s, at};
      }
      case Ast::Kind::kAlt: {
        const int32_t s = add(), e = add();
        for (const int32_t kid : a.kids) {
          const auto [ks, ke] = build(ast, kid);
          states[s].eps.push_back(ks);
          states[ke].eps.push_back(e);
        }
        return {s, e};
      }
      case Ast::Kind::kRepeat: {
        const int32_t s = add();
        int32_t at = s;
        for (int k = 0; k < a.min; ++k) {
          const auto [ks, ke] = build(ast, a.kids[0]);
          states[at].eps.push_back(ks);
          at = ke;
        }
        const int32_t e = add();
        if (a.max < 0) {
          const auto [ks, ke] = build(ast, a.kids[0]);
          states[at].eps.push_back(ks);
          states[at].eps.push_back(e);
          states[ke].eps.push_back(ks);
          states[ke].eps.push_back(e);
          return {s, e};
        }
        states[at].eps.push_back(e);
        for (int k = a.min; k < a.max; ++k) {
          const auto [ks, ke] = build(ast, a.kids[0]);
          states[at].eps.push_back(ks);
          states[ke].eps.push_back(e);
          at = ke;
        }
        return {s, e};
      }
    }
    return {-1, -1};
  }

  // The states reachable through epsilon moves, those that matter: with a move, or `final`.
  std::vector<int32_t> closure(std::vector<int32_t> seeds, int32_t final_state) {
    if (seen.size() < states.size()) seen.resize(states.size(), 0);
    ++generation;
    std::vector<int32_t> out;
    while (!seeds.empty()) {
      const int32_t s = seeds.back();
      seeds.pop_back();
      if (seen[s] == generation) continue;
      seen[s] = generation;
      ++work;
      if (states[s].ranges >= 0 || s == final_state) out.push_back(s);
      for (const int32_t t : states[s].eps) seeds.push_back(t);
    }
    std::sort(out.begin(), out.end());
    return out;
  }
};

std::string too_many_states() {
  return "the pattern's automaton has more than " + std::to_string(CodePointDfa::kMaxStates) +
         " states; simplify it";
}

}  // namespace

CodePointDfa CodePointDfa::trimmed(std::vector<std::vector<Edge>> edges,
                                   std::vector<uint8_t> accepting, int32_t start) {
  const auto n = static_cast<int32_t>(accepting.size());
  // Live: can reach an accepting state.
  std::vector<std::vector<int32_t>> from(n);
  for (int32_t s = 0; s < n; ++s) {
    for (const Edge& e : edges[s]) from[e.to].push_back(s);
  }
  std::vector<uint8_t> live(n, 0);
  std::vector<int32_t> todo;
  for (int32_t s = 0; s < n; ++s) {
    if (accepting[s]) {
      live[s] = 1;
      todo.push_back(s);
    }
  }
  while (!todo.empty()) {
    const int32_t s = todo.back();
    todo.pop_back();
    for (const int32_t p : from[s]) {
      if (!live[p]) {
        live[p] = 1;
        todo.push_back(p);
      }
    }
  }
  MOE_CHECK(live[start], "the pattern matches no string");
  std::vector<int32_t> id(n, -1);
  std::vector<int32_t> order = {start};
  id[start] = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    for (const Edge& e : edges[order[k]]) {
      if (live[e.to] && id[e.to] < 0) {
        id[e.to] = static_cast<int32_t>(order.size());
        order.push_back(e.to);
      }
    }
  }
  CodePointDfa dfa;
  dfa.edge_begin_.push_back(0);
  for (const int32_t s : order) {
    for (const Edge& e : edges[s]) {
      if (!live[e.to]) continue;
      Edge kept{.lo = e.lo, .hi = e.hi, .to = id[e.to]};
      if (dfa.edges_.size() > dfa.edge_begin_.back() && dfa.edges_.back().to == kept.to &&
          dfa.edges_.back().hi + 1 == kept.lo) {
        dfa.edges_.back().hi = kept.hi;  // adjacent, same target: one edge
      } else {
        dfa.edges_.push_back(kept);
      }
    }
    dfa.edge_begin_.push_back(static_cast<uint32_t>(dfa.edges_.size()));
    dfa.accepting_.push_back(accepting[s]);
  }
  return dfa;
}

CodePointDfa CodePointDfa::from_pattern(std::string_view pattern, int64_t* budget) {
  Parser parser(pattern);
  const int32_t root = parser.parse();
  Nfa nfa;
  const auto [entry, final_state] = nfa.build(parser.nodes, root);
  const int64_t limit = budget ? std::min(kMaxWork, *budget) : kMaxWork;
  const auto check_work = [&] {
    MOE_CHECK(nfa.work <= limit, "the pattern takes more than ", limit, " steps to compile",
              budget && *budget < kMaxWork ? " (with the schema's others)" : "", "; simplify it");
  };

  std::map<std::vector<int32_t>, int32_t> ids;
  std::vector<std::vector<int32_t>> sets;
  std::vector<std::vector<Edge>> edges;
  std::vector<uint8_t> accepting;
  const auto intern = [&](std::vector<int32_t> set) {
    const auto [it, fresh] = ids.emplace(set, static_cast<int32_t>(sets.size()));
    if (fresh) {
      MOE_CHECK(sets.size() < static_cast<size_t>(kMaxStates), too_many_states());
      accepting.push_back(std::binary_search(set.begin(), set.end(), final_state));
      sets.push_back(std::move(set));
      edges.emplace_back();
    }
    return it->second;
  };
  intern(nfa.closure({entry}, final_state));
  for (size_t d = 0; d < sets.size(); ++d) {
    // Cut the code points at every range boundary of the members' moves; each piece moves the
    // whole set to one set.
    std::vector<uint32_t> cuts;
    for (const int32_t s : sets[d]) {
      if (nfa.states[s].ranges < 0) continue;
      for (const auto& [lo, hi] : nfa.sets[nfa.states[s].ranges]) {
        cuts.push_back(lo);
        cuts.push_back(hi + 1);
      }
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    std::vector<Edge> out;
    for (size_t k = 0; k + 1 < cuts.size(); ++k) {
      const uint32_t lo = cuts[k], hi = cuts[k + 1] - 1;
      std::vector<int32_t> targets;
      for (const int32_t s : sets[d]) {
        if (nfa.states[s].ranges < 0) continue;
        const Ranges& r = nfa.sets[nfa.states[s].ranges];
        const auto it = std::upper_bound(r.begin(), r.end(), std::make_pair(lo, UINT32_MAX));
        if (it != r.begin() && std::prev(it)->second >= lo) targets.push_back(nfa.states[s].to);
      }
      if (targets.empty()) continue;
      const int32_t to = intern(nfa.closure(std::move(targets), final_state));
      check_work();
      if (!out.empty() && out.back().to == to && out.back().hi + 1 == lo) {
        out.back().hi = hi;
      } else {
        out.push_back({.lo = lo, .hi = hi, .to = to});
      }
    }
    edges[d] = std::move(out);
  }
  if (budget) *budget -= nfa.work;
  return trimmed(std::move(edges), std::move(accepting), 0);
}

CodePointDfa CodePointDfa::intersect(const CodePointDfa& a, const CodePointDfa& b) {
  std::map<std::pair<int32_t, int32_t>, int32_t> ids;
  std::vector<std::pair<int32_t, int32_t>> pairs;
  std::vector<std::vector<Edge>> edges;
  std::vector<uint8_t> accepting;
  const auto intern = [&](int32_t x, int32_t y) {
    const auto [it, fresh] = ids.emplace(std::make_pair(x, y), static_cast<int32_t>(pairs.size()));
    if (fresh) {
      MOE_CHECK(pairs.size() < static_cast<size_t>(kMaxStates), too_many_states());
      pairs.emplace_back(x, y);
      accepting.push_back(a.accepting(x) && b.accepting(y));
      edges.emplace_back();
    }
    return it->second;
  };
  intern(a.start(), b.start());
  for (size_t d = 0; d < pairs.size(); ++d) {
    const auto [x, y] = pairs[d];
    std::vector<Edge> out;
    const Edge* p = a.edges_begin(x);
    const Edge* q = b.edges_begin(y);
    while (p != a.edges_end(x) && q != b.edges_end(y)) {
      const uint32_t lo = std::max(p->lo, q->lo), hi = std::min(p->hi, q->hi);
      if (lo <= hi) out.push_back({.lo = lo, .hi = hi, .to = intern(p->to, q->to)});
      if (p->hi < q->hi) {
        ++p;
      } else {
        ++q;
      }
    }
    edges[d] = std::move(out);
  }
  return trimmed(std::move(edges), std::move(accepting), 0);
}

int32_t CodePointDfa::next(int32_t state, uint32_t cp) const {
  const Edge* begin = edges_begin(state);
  const Edge* end = edges_end(state);
  const Edge* it =
      std::upper_bound(begin, end, cp, [](uint32_t v, const Edge& e) { return v < e.lo; });
  if (it == begin) return -1;
  --it;
  return cp <= it->hi ? it->to : -1;
}

bool CodePointDfa::matches(std::string_view text) const {
  int32_t state = start();
  for (const uint32_t cp : decode_utf8(text, "the text")) {
    state = next(state, cp);
    if (state < 0) return false;
  }
  return accepting(state);
}

}  // namespace moeinfer
