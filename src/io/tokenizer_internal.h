// Internal pieces of the tokenizer (see tokenizer.h for the overview). Not part of the API.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "io/tokenizer.h"

namespace moeinfer::tok {

using Json = nlohmann::json;

// Hash/equality that let unordered_map<std::string, ...> be searched with a string_view.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using StringMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// A PCRE2 regex that finds matches the way the Oniguruma crate's `find_iter` does (which is what
// `tokenizers` uses): leftmost matches, and an empty match right where the previous match ended
// is skipped. The pattern is first rewritten so that \s, \S, \w, \W, \h and \H mean what they
// mean in Oniguruma's Ruby syntax.
class Regex {
 public:
  explicit Regex(std::string_view pattern, bool oniguruma_syntax = true);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends [start, end) byte ranges of the matches in `text` (valid UTF-8).
  void find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const;
  // Whether the pattern matches at `text[pos]` or later.
  bool search(std::string_view text) const;

  static std::string escape(std::string_view literal);

 private:
  void* code_ = nullptr;  // pcre2_code*
};

// One stretch of the input on its way through the pipeline.
struct Piece {
  std::string text;
  int32_t id = -1;         // an added token's id; -1 while the text still needs tokenising
  bool at_origin = false;  // starts at byte 0 of the original input
};
using Pieces = std::vector<Piece>;

// How a split treats the matched delimiters (`SplitDelimiterBehavior`).
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// A stretch of text and whether it is a delimiter match.
struct Span {
  size_t start;
  size_t end;
  bool is_match;
};

// Covers `text` with matches and gaps, like `Pattern::find_matches` for a regex.
std::vector<Span> regex_spans(const Regex& regex, std::string_view text);
// Covers `text` with one match per character satisfying `pred`, and gaps in between.
std::vector<Span> char_spans(std::string_view text, const std::function<bool(char32_t)>& pred);
// Applies the behaviour and returns the [start, end) ranges to keep (empty ones included).
std::vector<std::pair<size_t, size_t>> apply_behavior(std::vector<Span> spans,
                                                      SplitBehavior behavior);
SplitBehavior parse_behavior(const Json& j);

// Replaces every sub-piece with the result of `fn(piece, out)` and drops empty pieces. Pieces that
// are added tokens pass through untouched.
void split_pieces(Pieces& pieces, const std::function<void(const Piece&, Pieces&)>& fn);
// Splits one piece at the kept ranges.
void emit_ranges(const Piece& piece, const std::vector<std::pair<size_t, size_t>>& ranges,
                 Pieces& out);

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void normalize(std::string& text) const = 0;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual void pre_tokenize(Pieces& pieces) const = 0;
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
  // The same without repairing invalid UTF-8 (for the bytes of single tokens, which may hold
  // part of a character).
  virtual void decode_chain_bytes(std::vector<std::string>& tokens) const { decode_chain(tokens); }
};

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  virtual void process(std::vector<int32_t>& ids, bool add_special_tokens) const = 0;
};

// Each parser throws moeinfer::Error naming the component it cannot handle. A null JSON value
// gives a null pointer.
std::unique_ptr<Normalizer> parse_normalizer(const Json& j);
std::unique_ptr<PreTokenizer> parse_pre_tokenizer(const Json& j);
std::unique_ptr<Decoder> parse_decoder(const Json& j);
std::unique_ptr<PostProcessor> parse_post_processor(const Json& j);

// The model that turns one pre-tokenised word into ids: tokenizer.json's BPE, or a tiktoken
// rank file.
class Model {
 public:
  virtual ~Model() = default;
  // Appends the ids of one pre-tokenised word.
  virtual void tokenize(std::string_view word, std::vector<int32_t>& out) const = 0;
  virtual size_t num_entries() const = 0;  // what `get_vocab_size` reports
  virtual int32_t max_id() const = 0;
  virtual std::optional<int32_t> token_to_id(std::string_view token) const = 0;
  // The token's vocabulary string, or null for an id without one.
  virtual const std::string* id_to_token(int32_t id) const = 0;
};

// Byte-pair encoding model.
class BpeModel final : public Model {
 public:
  explicit BpeModel(const Json& j);

  void tokenize(std::string_view word, std::vector<int32_t>& out) const override;

  size_t num_entries() const override { return vocab_.size(); }
  int32_t max_id() const override { return static_cast<int32_t>(id_to_token_.size()) - 1; }
  std::optional<int32_t> token_to_id(std::string_view token) const override;
  const std::string* id_to_token(int32_t id) const override;

 private:
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;

  StringMap vocab_;
  std::vector<std::string> id_to_token_;
  std::vector<bool> has_id_;
  // (left id << 32 | right id) -> (rank, merged id)
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;
  std::optional<std::string> unk_token_;
  std::optional<int32_t> unk_id_;  // set when unk_token_ is in the vocabulary
  std::string continuing_subword_prefix_;
  std::string end_of_word_suffix_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::array<int32_t, 256> byte_ids_{};  // ids of <0xNN>, -1 when missing

  static constexpr size_t kCacheCapacity = 10000;
  static constexpr size_t kMaxCachedWordBytes = 256;
  mutable std::shared_mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache_;
};

// tiktoken's byte-pair encoding over a rank file (io/tokenizer_tiktoken.cpp): a word that is a
// whole token is that token; otherwise its bytes are merged pairwise, the adjacent pair whose
// concatenation has the lowest rank first (leftmost on ties), until no pair is a token. Ids are
// the ranks. Token strings (token_to_id, id_to_token) are the bytes in the GPT-2 byte-level
// alphabet, as transformers' TikTokenTokenizer shows them.
class TiktokenModel final : public Model {
 public:
  // `text`: the file's lines, "<base64 of the token's bytes> <rank>"; `source` names it in errors.
  TiktokenModel(std::string_view text, const std::string& source);

  void tokenize(std::string_view word, std::vector<int32_t>& out) const override;
  size_t num_entries() const override { return tokens_.size(); }
  int32_t max_id() const override { return static_cast<int32_t>(tokens_.size()) - 1; }
  std::optional<int32_t> token_to_id(std::string_view token) const override;
  const std::string* id_to_token(int32_t id) const override;

 private:
  int32_t rank_of(std::string_view bytes) const;  // kNoRank when not a token
  static constexpr int32_t kNoRank = std::numeric_limits<int32_t>::max();

  StringMap ranks_;                  // token bytes -> rank
  std::vector<std::string> tokens_;  // rank -> byte-level string
  StringMap by_string_;              // byte-level string -> rank
};

// Kimi K2's split pattern (tokenization_kimi.py's pat_str, in the Rust regex syntax tiktoken
// compiles), and the pattern rewritten for PCRE2: a class intersection [A&&[^B]] becomes
// (?:(?=[^B])[A]).
extern const std::string_view kKimiPattern;
std::string rewrite_class_intersections(std::string_view pattern);

// tiktoken's split: the matches of the pattern become the words; text the pattern does not match
// is dropped, as tiktoken's find_iter loop drops it.
std::unique_ptr<PreTokenizer> make_tiktoken_split(std::string_view pattern);

}  // namespace moeinfer::tok
