// Constrained decoding for JSON output (OpenAI's response_format json_object / json_schema).
//
// A JSON schema is compiled once into a graph of nodes (JsonGrammar). A sequence's place in it is
// a byte-level pushdown matcher (JsonMatcher): a stack of frames, one per open value (root,
// object, array, string, number, literal), and for anyOf / oneOf several such stacks side by
// side, each dying on the first byte it cannot take. Every byte a frame accepts keeps its value
// completable, so the matcher never walks into a dead end and any text it accepted up to a
// complete value parses and validates against the schema.
//
// Token masks: the vocabulary's byte strings sit in a trie (TokenTrie, built once per
// tokenizer). Each step walks the trie depth-first with the matcher state, advancing one byte per
// edge and cutting a subtree at the first rejected byte, so a step costs the trie nodes the
// state can reach, not V times the token length. Inside a string the state changes over plain
// characters only by their count, so the tokens made of them are taken from a list sorted by
// length, and only the tokens that leave the plain alphabet are walked (from their first quote,
// backslash, control or partial UTF-8 byte).
//
// What the compiler takes (anything else is refused with an Error naming the keyword and where
// it is): type (one or a list), enum, const, anyOf, oneOf (alternatives must be provably
// disjoint: different types, different literals, or objects told apart by a required property),
// allOf of one schema, $ref to #, #/$defs/* or #/definitions/*, object properties / required /
// additionalProperties (absent means false, as vLLM's default xgrammar backend takes it), array
// items / minItems / maxItems, string minLength / maxLength, integer minimum / maximum /
// exclusiveMinimum / exclusiveMaximum; annotations (title, description, default, examples, ...)
// are ignored. The output's form is limited so that it cannot run on forever where the schema
// does not ask for it: whitespace runs of one space or tab, or of a newline and an indent of at
// most kMaxIndent spaces or tabs (no carriage returns), numbers of at most 19
// integer, 16 fraction and 2 exponent digits, at most 64 declared properties per object,
// nesting at most kMaxDepth values deep, and object keys outside the declared properties (where
// additionalProperties allows them) written without escapes.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace moeinfer {

class Tokenizer;

namespace json_grammar {

inline constexpr int kMaxIndent = 8;  // spaces or tabs after a newline, at most
inline constexpr int kMaxDepth = 64;
inline constexpr int kMaxThreads = 64;  // live stacks at most (anyOf alternatives)

// One open value of one stack. What the fields mean depends on the node's kind (see the .cpp).
struct Frame {
  int32_t node = 0;
  int32_t count = 0;  // string: code points; array: items; number: digits; literal/key: trie node
  int32_t aux = 0;    // string lexer: UTF-8 / \u state; object: the member value's node
  uint8_t phase = 0;
  uint8_t sub = 0;    // string lexer: body, escape, \u digits, UTF-8 continuation
  uint8_t ws = 0;     // whitespace bytes in the current run
  uint8_t flags = 0;  // number: negative; object key: escaped, off the key trie
  uint64_t used = 0;  // object: declared properties present; integer: magnitude so far
  bool operator==(const Frame&) const = default;
};

// Every live stack, one after another: stack i is frames[ends[i-1], ends[i]).
struct State {
  std::vector<Frame> frames;
  std::vector<uint32_t> ends;
  bool empty() const { return ends.empty(); }
  void clear() {
    frames.clear();
    ends.clear();
  }
};

}  // namespace json_grammar

class JsonGrammar {
 public:
  // {"type": "json_object"}: any JSON object.
  static std::shared_ptr<const JsonGrammar> any_object();
  // Throws moeinfer::Error naming the first unsupported keyword and its place ("#/properties/a").
  static std::shared_ptr<const JsonGrammar> from_schema(const nlohmann::json& schema);

  JsonGrammar();
  ~JsonGrammar();
  JsonGrammar(JsonGrammar&&) noexcept;
  JsonGrammar& operator=(JsonGrammar&&) noexcept;

  json_grammar::State initial() const;
  // out = in after byte b (empty when no stack takes it). `scratch` is working space.
  void advance(const json_grammar::State& in, uint8_t b, json_grammar::State& out,
               std::vector<json_grammar::Frame>& scratch) const;
  // The bytes so far are one complete value (more may still be possible: a number's digits).
  bool can_finish(const json_grammar::State& s) const;
  // Complete, and no byte can follow.
  bool closed(const json_grammar::State& s) const;
  // The state is one stack inside a string, between characters, where `room` more code points
  // fit (INT64_MAX without maxLength): plain characters (no quote, backslash or control byte,
  // whole UTF-8 characters) change nothing in it but the count.
  bool in_string_body(const json_grammar::State& s, int64_t& room) const;
  // Counts k more code points in that string.
  void count_chars(json_grammar::State& s, int64_t k) const;
  // The state is one stack inside a string with a pattern or format, between characters: its
  // frame, and a key for what tokens without a quote byte can follow (they cannot leave the
  // string, so the frame alone decides them). The key leaves out the count where no token of
  // up to `max_chars` code points can reach a length bound from here.
  bool in_pattern_string(const json_grammar::State& s, int64_t max_chars,
                         json_grammar::Frame* frame, uint64_t* key) const;
  // That frame after byte b; false when the string cannot take it.
  bool step_pattern_frame(json_grammar::Frame& f, uint8_t b) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The vocabulary's bytes (Tokenizer::token_bytes) in a trie, for token masks.
class TokenTrie {
 public:
  explicit TokenTrie(std::vector<std::string> token_bytes);  // [V]; empty: never allowed
  static TokenTrie from_tokenizer(const Tokenizer& tokenizer);

  int64_t vocab_size() const { return static_cast<int64_t>(bytes_.size()); }
  const std::string& bytes(int32_t token) const { return bytes_[token]; }

 private:
  friend class JsonMatcher;
  struct Trie {
    // CSR: node n's children are child_byte/child_node[child_begin[n], child_begin[n + 1]),
    // the tokens ending at it token_id[token_begin[n], token_begin[n + 1]).
    std::vector<uint32_t> child_begin, token_begin;
    std::vector<uint8_t> child_byte;
    std::vector<int32_t> child_node, token_id;
    size_t max_depth = 0;  // the longest word
    void build(const std::vector<std::pair<std::string_view, int32_t>>& words);
  };
  std::vector<std::string> bytes_;
  Trie all_;  // every token with bytes
  // For states inside a string: the tokens made only of plain characters, as (code points, id)
  // with the fewest code points first; the others in tries of what follows their plain start,
  // one trie per number of code points in that start.
  std::vector<std::pair<int64_t, int32_t>> plain_string_tokens_;
  std::vector<Trie> string_suffix_;
  // For states inside a string with a pattern: the tokens without a '"' byte (they stay inside
  // it), the others, and the most code points a token has.
  Trie quote_free_, with_quote_;
  int64_t max_token_chars_ = 0;
};

// One sequence's matcher: the grammar, where the text stands in it, and scratch for masks.
class JsonMatcher {
 public:
  explicit JsonMatcher(std::shared_ptr<const JsonGrammar> grammar);

  // Takes the bytes if the grammar accepts all of them; false (state unchanged) otherwise.
  bool advance(std::string_view bytes);
  bool can_finish() const { return grammar_->can_finish(state_); }
  bool closed() const { return grammar_->closed(state_); }
  // allowed[t] = 1 for each token whose bytes can come next, 0 for the others ([V]); the
  // end-of-sequence tokens are the caller's (allowed when can_finish()).
  void allowed_tokens(const TokenTrie& trie, std::span<uint8_t> allowed);

 private:
  void walk(const TokenTrie::Trie& trie, int32_t node, size_t depth, std::span<uint8_t> allowed);
  // The walk inside a pattern string: only its frame moves.
  void walk_frame(const TokenTrie::Trie& trie, int32_t node, const json_grammar::Frame& f,
                  std::vector<int32_t>& out);

  std::shared_ptr<const JsonGrammar> grammar_;
  json_grammar::State state_;
  std::vector<json_grammar::State> depth_states_;  // [max token length + 1] during a walk
  std::vector<json_grammar::Frame> scratch_;
  // Pattern strings: the quote-free tokens allowed from a frame, by in_pattern_string's key
  // (a string in a loop of its automaton asks for the same set step after step).
  std::unordered_map<uint64_t, std::vector<int32_t>> pattern_masks_;
};

}  // namespace moeinfer
