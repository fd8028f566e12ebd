// Regular expressions as JSON Schema's `pattern` means them (ECMA-262 syntax, no flags, matched
// anywhere in the string unless anchored), compiled to a deterministic automaton over Unicode
// code points, for constrained decoding (runtime/json_schema_grammar.h).
//
// Parse -> Thompson NFA over sets of code-point ranges -> subset construction -> states that
// cannot reach an accepting state removed. So every transition the automaton has keeps the
// string completable: a matcher that follows it never walks into a dead end.
//
// Taken: literals, escapes (\t \n \v \f \r \0 \cX \xHH \uHHHH, escaped punctuation), classes
// [...] and [^...] with ranges, \d \D \w \W \s \S (ASCII digits and word characters, ECMA-262's
// white space), `.` (anything but a line terminator), groups (...), (?:...), (?<name>...),
// alternation, quantifiers ? * + {n} {n,} {n,m} (lazy forms too: for matching they mean the
// same), and the anchors ^ and $ at the start and the end of the pattern or of one of its
// top-level alternatives. Refused, with an Error naming the construct: backreferences,
// lookahead and lookbehind, word boundaries \b \B, Unicode property escapes \p \P, anchors
// elsewhere, automata of more than kMaxStates states, and patterns that take more than kMaxWork
// steps to compile.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace moeinfer {

class CodePointDfa {
 public:
  static constexpr int32_t kMaxStates = 4096;
  static constexpr uint32_t kMaxCodePoint = 0x10FFFF;

  struct Edge {
    uint32_t lo = 0, hi = 0;  // code points [lo, hi], surrogates never included
    int32_t to = 0;
  };

  // Compiling visits NFA states; more than this (about 0.4 s) is refused.
  static constexpr int64_t kMaxWork = 10'000'000;

  // Throws moeinfer::Error naming what it cannot take, or when the pattern matches no string.
  // `budget`: NFA state visits left for a whole schema's patterns, taken from as it compiles.
  static CodePointDfa from_pattern(std::string_view pattern, int64_t* budget = nullptr);
  // Strings both take; throws when there are none.
  static CodePointDfa intersect(const CodePointDfa& a, const CodePointDfa& b);

  int32_t num_states() const { return static_cast<int32_t>(accepting_.size()); }
  int32_t start() const { return 0; }
  bool accepting(int32_t state) const { return accepting_[state] != 0; }
  // The state after `cp`, -1 when the string cannot go on that way.
  int32_t next(int32_t state, uint32_t cp) const;
  // The edges of `state`, sorted by code point and disjoint.
  const Edge* edges_begin(int32_t state) const { return edges_.data() + edge_begin_[state]; }
  const Edge* edges_end(int32_t state) const { return edges_.data() + edge_begin_[state + 1]; }
  // Whether `text` (UTF-8) matches as a whole; for tests.
  bool matches(std::string_view text) const;

 private:
  // Keeps the states reachable from the start that can reach an accepting state, start first.
  static CodePointDfa trimmed(std::vector<std::vector<Edge>> edges, std::vector<uint8_t> accepting,
                              int32_t start);

  std::vector<uint32_t> edge_begin_;  // [states + 1]
  std::vector<Edge> edges_;
  std::vector<uint8_t> accepting_;  // [states]
};

}  // namespace moeinfer
