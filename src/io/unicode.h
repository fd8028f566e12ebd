// Unicode helpers for the tokenizer: UTF-8 walking, the character properties that Hugging Face
// `tokenizers` consults (Rust's `char::is_whitespace`, `char::is_numeric`, ...), normalisation
// forms through utf8proc, and the GPT-2 byte-to-character table used by byte-level BPE.
//
// Everything here works on UTF-8 `std::string`s. Functions that take text assume it is valid
// UTF-8 (the tokenizer checks its input once, at the door) unless they say otherwise.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>

namespace moeinfer::unicode {

inline constexpr char32_t kReplacementChar = 0xFFFD;

// Number of bytes of the UTF-8 sequence that starts with `lead` (1 for stray bytes).
inline size_t utf8_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead >> 5) == 0x6) return 2;
  if ((lead >> 4) == 0xE) return 3;
  if ((lead >> 3) == 0x1E) return 4;
  return 1;
}

// Code points of UTF-8 text: the bytes that start one (a stray continuation byte counts none).
inline int64_t count_code_points(std::string_view s) {
  int64_t n = 0;
  for (const unsigned char c : s) n += (c & 0xC0) != 0x80 ? 1 : 0;
  return n;
}

// Decodes the code point at `s[pos]` and advances `pos` past it. `s` must be valid UTF-8.
char32_t next_code_point(std::string_view s, size_t& pos);

void append_utf8(std::string& out, char32_t cp);
std::string to_utf8(char32_t cp);

bool is_valid_utf8(std::string_view bytes);

// Like Rust's `String::from_utf8_lossy`: each maximal invalid subsequence becomes one U+FFFD.
std::string from_bytes_lossy(std::string_view bytes);

// True when the text ends in a code point that may still be growing: an incomplete UTF-8
// sequence, or U+FFFD produced by lossy decoding of one.
bool ends_with_replacement(std::string_view text);

// Character properties, matching what Rust's `char` methods report.
bool is_whitespace(char32_t cp);   // White_Space property
bool is_numeric(char32_t cp);      // general category Nd, Nl or No
bool is_punctuation(char32_t cp);  // general category P*
bool is_mark(char32_t cp);         // general category M*
bool is_control(char32_t cp);      // general category Cc
// Several `tokenizers` components carry Unicode tables older than utf8proc's; these follow them
// (tables made by `tools/make_tokenizer_fixtures.py --print-unicode-table`, which asks
// `tokenizers` itself):
// non-ASCII punctuation that the Punctuation and BertPreTokenizer pre-tokenizers split on,
bool is_split_punctuation(char32_t cp);
// what the StripAccents normaliser removes.
bool is_stripped_accent(char32_t cp);

// Code points assigned after Unicode 14.0 (the data of PCRE2 10.42) up to the Unicode version of
// the regex engines inside `tokenizers` (16.0), with their general category. Made by
// `tools/make_tokenizer_fixtures.py --print-unicode-table`, which asks `tokenizers` itself.
struct AssignedRange {
  char32_t first;
  char32_t last;
  const char* category;  // two letters, e.g. "Lo"
};
std::span<const AssignedRange> newer_assignments();

// General category of `cp` as two letters ("Lu", "Nd", ..., "Cn" when unassigned): utf8proc's,
// completed by `newer_assignments` for code points it does not know yet.
std::string_view general_category(char32_t cp);

// PCRE2 class items ("\x{..}-\x{..}...") for the newer code points whose category starts with
// one of `prefixes` (e.g. {"L", "Nd"}); empty when there are none.
std::string newer_class_items(std::initializer_list<std::string_view> prefixes);

enum class NormalForm { kNFC, kNFD, kNFKC, kNFKD };
// utf8proc's normalisation, except that code points the `tokenizers` normalisers do not know are
// left alone and act as barriers (nothing composes or reorders across them), as there.
std::string normalize(std::string_view text, NormalForm form);

// Per-character full lowercase mapping, as Rust's `char::to_lowercase`.
std::string to_lower(std::string_view text);

// GPT-2 byte-level alphabet: every byte maps to one printable code point, stored UTF-8 encoded.
const std::array<std::string, 256>& byte_to_chars();
// Inverse of `byte_to_chars`: the byte for a code point of the alphabet, or -1.
int byte_of_char(char32_t cp);

}  // namespace moeinfer::unicode
