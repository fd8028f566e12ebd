// Tokenizer: reads a Hugging Face `tokenizer.json` and encodes/decodes exactly as the
// `tokenizers` library does for the components published checkpoints use.
//
// Pipeline (encode): added tokens are cut out of the raw text first, the rest is normalised,
// cut again on added tokens that match their normalised form, pre-tokenised into words, each
// word is split by the BPE model, and the post-processor adds BOS/EOS. Decode maps ids to
// token strings and runs the decoder chain.
//
// Supported components:
//   model           BPE (merges as "a b" strings or [a, b] pairs, ignore_merges, byte_fallback,
//                   unk_token, fuse_unk, continuing_subword_prefix, end_of_word_suffix)
//   normalizer      NFC, NFD, NFKC, NFKD, Lowercase, Prepend, Replace, Strip, StripAccents, Nmt,
//                   ByteLevel, Sequence
//   pre_tokenizer   ByteLevel, Split, Metaspace, Digits, Punctuation, Whitespace,
//                   WhitespaceSplit, CharDelimiterSplit, BertPreTokenizer, FixedLength, Sequence
//   post_processor  TemplateProcessing, BertProcessing, RobertaProcessing, ByteLevel, Sequence
//   decoder         ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, BPEDecoder,
//                   Sequence
// Anything else (WordPiece/Unigram/WordLevel models, Precompiled normaliser, ...) is refused
// with a moeinfer::Error that names the component. A tiktoken rank file with its special tokens
// (Kimi K2, from_tiktoken) runs through the same pipeline: its specials as added tokens, its
// split pattern as the pre-tokenizer, tiktoken's byte-pair merge as the model, ByteLevel decode. Regexes run on PCRE2 (UTF + UCP) with the
// Oniguruma meaning of \s, \w and \h. The `truncation` and `padding` sections are ignored.
//
// Thread safety: a Tokenizer is immutable after loading except for an internal, locked BPE
// word cache, so `encode`/`decode` may be called from several threads at once.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace moeinfer {

class Tokenizer {
 public:
  // Errors (unreadable file, bad JSON, unsupported component) name the file.
  static Tokenizer from_file(const std::filesystem::path& tokenizer_json);
  // `source` names the text in error messages (a path, or e.g. "<inline>").
  static Tokenizer from_json(std::string_view json_text, const std::string& source);
  // A tiktoken-style tokenizer as Kimi K2 publishes it: the rank file (tiktoken.model, lines of
  // "<base64 bytes> <rank>") and tokenizer_config.json, whose tokenizer_class and auto_map must
  // name Kimi's TikTokenTokenizer (its split pattern is built in). Ids num_base .. num_base + 255
  // are special tokens, named by added_tokens_decoder or "<|reserved_token_<id>|>" (encoded as
  // one id each; only the named ones count as special for skip_special_tokens). Encodes as
  // that class's encode(text) does (tiktoken with every special token allowed, the text cut
  // where a run of spaces or non-spaces passes 25000 characters); adds no BOS.
  static Tokenizer from_tiktoken(const std::filesystem::path& rank_file,
                                 const std::filesystem::path& tokenizer_config);
  // A checkpoint folder's tokenizer: <dir>/tokenizer.json, or else <dir>/tiktoken.model with
  // <dir>/tokenizer_config.json.
  static Tokenizer from_dir(const std::filesystem::path& dir);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // `text` must be valid UTF-8. With `add_special_tokens` the post-processor adds BOS/EOS.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const;
  // Unknown ids are skipped, as `tokenizers` does.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;
  // decode() before invalid UTF-8 is replaced: a token holding part of a character gives its
  // bytes, not U+FFFD (the `bytes` of OpenAI's logprobs).
  std::string decode_bytes(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // [vocab_size()] the bytes each token adds to a text in its middle, as decode() gives them but
  // before invalid UTF-8 is replaced (a token may hold part of a character); empty for special
  // tokens and unused ids. For constrained decoding (runtime/json_schema_grammar.h).
  std::vector<std::string> token_bytes() const;

  int64_t vocab_size() const;  // highest id + 1 over model vocab and added tokens
  std::optional<int32_t> token_to_id(std::string_view token) const;
  std::string id_to_token(int32_t id) const;  // throws for an id that is not in the vocabulary
  bool is_special(int32_t id) const;          // an added token marked "special"

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Turns a growing id sequence into text pieces as they become complete UTF-8 (for streaming).
// The concatenation of every push() and the final flush() equals decode() of all ids.
// The tokenizer must outlive the decoder.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = true);
  std::string push(int32_t id);  // the new text since the last push (may be empty)
  std::string flush();           // whatever is still held back (e.g. an incomplete character)

 private:
  std::string diff(bool final);

  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  std::vector<int32_t> ids_;
  size_t prefix_offset_ = 0;  // ids_[prefix_offset_, read_offset_) were already emitted
  size_t read_offset_ = 0;
};

}  // namespace moeinfer
