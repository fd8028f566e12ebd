#include "io/unicode.h"

#include <utf8proc.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <memory>

#include "core/error.h"

namespace moeinfer::unicode {

char32_t next_code_point(std::string_view s, size_t& pos) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + pos;
  const unsigned char lead = p[0];
  if (lead < 0x80) {
    pos += 1;
    return lead;
  }
  if ((lead >> 5) == 0x6 && pos + 1 < s.size()) {
    pos += 2;
    return (char32_t(lead & 0x1F) << 6) | (p[1] & 0x3F);
  }
  if ((lead >> 4) == 0xE && pos + 2 < s.size()) {
    pos += 3;
    return (char32_t(lead & 0x0F) << 12) | (char32_t(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
  }
  if ((lead >> 3) == 0x1E && pos + 3 < s.size()) {
    pos += 4;
    return (char32_t(lead & 0x07) << 18) | (char32_t(p[1] & 0x3F) << 12) |
           (char32_t(p[2] & 0x3F) << 6) | (p[3] & 0x3F);
  }
  pos += 1;  // not reached for valid UTF-8
  return kReplacementChar;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string to_utf8(char32_t cp) {
  std::string out;
  append_utf8(out, cp);
  return out;
}

namespace {

// Length of the valid UTF-8 sequence at `b[i]`, or 0 when it is invalid; in that case `*bad`
// receives how many bytes form the maximal invalid prefix (what one U+FFFD replaces).
size_t valid_sequence_length(const unsigned char* b, size_t n, size_t i, size_t* bad) {
  auto at = [&](size_t k) -> unsigned { return k < n ? b[k] : 0u; };
  auto is_cont = [](unsigned c) { return (c & 0xC0) == 0x80; };
  const unsigned lead = b[i];
  if (lead < 0x80) return 1;
  size_t width = 0;
  if (lead >= 0xC2 && lead <= 0xDF)
    width = 2;
  else if (lead >= 0xE0 && lead <= 0xEF)
    width = 3;
  else if (lead >= 0xF0 && lead <= 0xF4)
    width = 4;
  if (width == 0) {
    *bad = 1;
    return 0;
  }
  const unsigned second = at(i + 1);
  bool second_ok = false;
  if (width == 2) {
    second_ok = is_cont(second);
  } else if (width == 3) {
    second_ok = (lead == 0xE0 && second >= 0xA0 && second <= 0xBF) ||
                (lead == 0xED && second >= 0x80 && second <= 0x9F) ||
                (lead != 0xE0 && lead != 0xED && is_cont(second));
  } else {
    second_ok = (lead == 0xF0 && second >= 0x90 && second <= 0xBF) ||
                (lead == 0xF4 && second >= 0x80 && second <= 0x8F) ||
                (lead != 0xF0 && lead != 0xF4 && is_cont(second));
  }
  if (!second_ok) {
    *bad = 1;
    return 0;
  }
  for (size_t k = 2; k < width; ++k) {
    if (!is_cont(at(i + k))) {
      *bad = k;
      return 0;
    }
  }
  return width;
}

}  // namespace

bool is_valid_utf8(std::string_view bytes) {
  const auto* b = reinterpret_cast<const unsigned char*>(bytes.data());
  for (size_t i = 0; i < bytes.size();) {
    if (b[i] < 0x80) {
      ++i;
      continue;
    }
    size_t bad = 0;
    const size_t len = valid_sequence_length(b, bytes.size(), i, &bad);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

std::string from_bytes_lossy(std::string_view bytes) {
  const auto* b = reinterpret_cast<const unsigned char*>(bytes.data());
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    if (b[i] < 0x80) {
      out.push_back(static_cast<char>(b[i++]));
      continue;
    }
    size_t bad = 0;
    const size_t len = valid_sequence_length(b, bytes.size(), i, &bad);
    if (len == 0) {
      append_utf8(out, kReplacementChar);
      i += bad;
    } else {
      out.append(bytes.substr(i, len));
      i += len;
    }
  }
  return out;
}

bool ends_with_replacement(std::string_view text) {
  return text.size() >= 3 && text.substr(text.size() - 3) == "\xEF\xBF\xBD";
}

bool is_whitespace(char32_t cp) {
  switch (cp) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x20:
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

namespace {

constexpr AssignedRange kNewerAssignments[] = {
    {0x00897, 0x00897, "Mn"}, {0x00CF3, 0x00CF3, "Mc"}, {0x00ECE, 0x00ECE, "Mn"},
    {0x01B4E, 0x01B4F, "Po"}, {0x01B7F, 0x01B7F, "Po"}, {0x01C89, 0x01C89, "Lu"},
    {0x01C8A, 0x01C8A, "Ll"}, {0x02427, 0x02429, "So"}, {0x02FFC, 0x02FFF, "So"},
    {0x031E4, 0x031E5, "So"}, {0x031EF, 0x031EF, "So"}, {0x0A7CB, 0x0A7CC, "Lu"},
    {0x0A7CD, 0x0A7CD, "Ll"}, {0x0A7DA, 0x0A7DA, "Lu"}, {0x0A7DB, 0x0A7DB, "Ll"},
    {0x0A7DC, 0x0A7DC, "Lu"}, {0x105C0, 0x105F3, "Lo"}, {0x10D40, 0x10D49, "Nd"},
    {0x10D4A, 0x10D4D, "Lo"}, {0x10D4E, 0x10D4E, "Lm"}, {0x10D4F, 0x10D4F, "Lo"},
    {0x10D50, 0x10D65, "Lu"}, {0x10D69, 0x10D6D, "Mn"}, {0x10D6E, 0x10D6E, "Pd"},
    {0x10D6F, 0x10D6F, "Lm"}, {0x10D70, 0x10D85, "Ll"}, {0x10D8E, 0x10D8F, "Sm"},
    {0x10EC2, 0x10EC4, "Lo"}, {0x10EFC, 0x10EFF, "Mn"}, {0x1123F, 0x11240, "Lo"},
    {0x11241, 0x11241, "Mn"}, {0x11380, 0x11389, "Lo"}, {0x1138B, 0x1138B, "Lo"},
    {0x1138E, 0x1138E, "Lo"}, {0x11390, 0x113B5, "Lo"}, {0x113B7, 0x113B7, "Lo"},
    {0x113B8, 0x113BA, "Mc"}, {0x113BB, 0x113C0, "Mn"}, {0x113C2, 0x113C2, "Mc"},
    {0x113C5, 0x113C5, "Mc"}, {0x113C7, 0x113CA, "Mc"}, {0x113CC, 0x113CD, "Mc"},
    {0x113CE, 0x113CE, "Mn"}, {0x113CF, 0x113CF, "Mc"}, {0x113D0, 0x113D0, "Mn"},
    {0x113D1, 0x113D1, "Lo"}, {0x113D2, 0x113D2, "Mn"}, {0x113D3, 0x113D3, "Lo"},
    {0x113D4, 0x113D5, "Po"}, {0x113D7, 0x113D8, "Po"}, {0x113E1, 0x113E2, "Mn"},
    {0x116D0, 0x116E3, "Nd"}, {0x11B00, 0x11B09, "Po"}, {0x11BC0, 0x11BE0, "Lo"},
    {0x11BE1, 0x11BE1, "Po"}, {0x11BF0, 0x11BF9, "Nd"}, {0x11F00, 0x11F01, "Mn"},
    {0x11F02, 0x11F02, "Lo"}, {0x11F03, 0x11F03, "Mc"}, {0x11F04, 0x11F10, "Lo"},
    {0x11F12, 0x11F33, "Lo"}, {0x11F34, 0x11F35, "Mc"}, {0x11F36, 0x11F3A, "Mn"},
    {0x11F3E, 0x11F3F, "Mc"}, {0x11F40, 0x11F40, "Mn"}, {0x11F41, 0x11F41, "Mc"},
    {0x11F42, 0x11F42, "Mn"}, {0x11F43, 0x11F4F, "Po"}, {0x11F50, 0x11F59, "Nd"},
    {0x11F5A, 0x11F5A, "Mn"}, {0x1342F, 0x1342F, "Lo"}, {0x13439, 0x1343F, "Cf"},
    {0x13440, 0x13440, "Mn"}, {0x13441, 0x13446, "Lo"}, {0x13447, 0x13455, "Mn"},
    {0x13460, 0x143FA, "Lo"}, {0x16100, 0x1611D, "Lo"}, {0x1611E, 0x16129, "Mn"},
    {0x1612A, 0x1612C, "Mc"}, {0x1612D, 0x1612F, "Mn"}, {0x16130, 0x16139, "Nd"},
    {0x16D40, 0x16D42, "Lm"}, {0x16D43, 0x16D6A, "Lo"}, {0x16D6B, 0x16D6C, "Lm"},
    {0x16D6D, 0x16D6F, "Po"}, {0x16D70, 0x16D79, "Nd"}, {0x18CFF, 0x18CFF, "Lo"},
    {0x1B132, 0x1B132, "Lo"}, {0x1B155, 0x1B155, "Lo"}, {0x1CC00, 0x1CCEF, "So"},
    {0x1CCF0, 0x1CCF9, "Nd"}, {0x1CD00, 0x1CEB3, "So"}, {0x1D2C0, 0x1D2D3, "No"},
    {0x1DF25, 0x1DF2A, "Ll"}, {0x1E030, 0x1E06D, "Lm"}, {0x1E08F, 0x1E08F, "Mn"},
    {0x1E4D0, 0x1E4EA, "Lo"}, {0x1E4EB, 0x1E4EB, "Lm"}, {0x1E4EC, 0x1E4EF, "Mn"},
    {0x1E4F0, 0x1E4F9, "Nd"}, {0x1E5D0, 0x1E5ED, "Lo"}, {0x1E5EE, 0x1E5EF, "Mn"},
    {0x1E5F0, 0x1E5F0, "Lo"}, {0x1E5F1, 0x1E5FA, "Nd"}, {0x1E5FF, 0x1E5FF, "Po"},
    {0x1F6DC, 0x1F6DC, "So"}, {0x1F774, 0x1F776, "So"}, {0x1F77B, 0x1F77F, "So"},
    {0x1F7D9, 0x1F7D9, "So"}, {0x1F8B2, 0x1F8BB, "So"}, {0x1F8C0, 0x1F8C1, "So"},
    {0x1FA75, 0x1FA77, "So"}, {0x1FA87, 0x1FA89, "So"}, {0x1FA8F, 0x1FA8F, "So"},
    {0x1FAAD, 0x1FAAF, "So"}, {0x1FABB, 0x1FABF, "So"}, {0x1FAC6, 0x1FAC6, "So"},
    {0x1FACE, 0x1FACF, "So"}, {0x1FADA, 0x1FADC, "So"}, {0x1FADF, 0x1FADF, "So"},
    {0x1FAE8, 0x1FAE9, "So"}, {0x1FAF7, 0x1FAF8, "So"}, {0x1FBCB, 0x1FBEF, "So"},
    {0x2B739, 0x2B739, "Lo"}, {0x2EBF0, 0x2EE5D, "Lo"}, {0x31350, 0x323AF, "Lo"},
};

// Marks that `tokenizers`' StripAccents keeps: its mark table predates them (same generator).
struct CodeRange {
  char32_t first;
  char32_t last;
};
constexpr CodeRange kMarksKeptByStripAccents[] = {
    {0x007FD, 0x007FD}, {0x00898, 0x0089F}, {0x008CA, 0x008D3}, {0x009FE, 0x009FE},
    {0x00AFA, 0x00AFF}, {0x00B55, 0x00B55}, {0x00C04, 0x00C04}, {0x00C3C, 0x00C3C},
    {0x00D00, 0x00D00}, {0x00D3B, 0x00D3C}, {0x00D81, 0x00D81}, {0x00EBA, 0x00EBA},
    {0x01715, 0x01715}, {0x0180F, 0x0180F}, {0x01ABF, 0x01ACE}, {0x01CF7, 0x01CF7},
    {0x01DF6, 0x01DFA}, {0x0A82C, 0x0A82C}, {0x0A8FF, 0x0A8FF}, {0x10D24, 0x10D27},
    {0x10EAB, 0x10EAC}, {0x10F46, 0x10F50}, {0x10F82, 0x10F85}, {0x11070, 0x11070},
    {0x11073, 0x11074}, {0x110C2, 0x110C2}, {0x11145, 0x11146}, {0x111C9, 0x111C9},
    {0x111CE, 0x111CF}, {0x1133B, 0x1133B}, {0x1145E, 0x1145E}, {0x1182C, 0x1183A},
    {0x11930, 0x11935}, {0x11937, 0x11938}, {0x1193B, 0x1193E}, {0x11940, 0x11940},
    {0x11942, 0x11943}, {0x119D1, 0x119D7}, {0x119DA, 0x119E0}, {0x119E4, 0x119E4},
    {0x11A01, 0x11A0A}, {0x11A33, 0x11A39}, {0x11A3B, 0x11A3E}, {0x11A47, 0x11A47},
    {0x11A51, 0x11A5B}, {0x11A8A, 0x11A99}, {0x11D31, 0x11D36}, {0x11D3A, 0x11D3A},
    {0x11D3C, 0x11D3D}, {0x11D3F, 0x11D45}, {0x11D47, 0x11D47}, {0x11D8A, 0x11D8E},
    {0x11D90, 0x11D91}, {0x11D93, 0x11D97}, {0x11EF3, 0x11EF6}, {0x16F4F, 0x16F4F},
    {0x16F7F, 0x16F87}, {0x16FE4, 0x16FE4}, {0x16FF0, 0x16FF1}, {0x1CF00, 0x1CF2D},
    {0x1CF30, 0x1CF46}, {0x1E130, 0x1E136}, {0x1E2AE, 0x1E2AE}, {0x1E2EC, 0x1E2EF},
};

// Punctuation that `tokenizers`' Punctuation pre-tokenizer does not know (same generator).
constexpr CodeRange kPunctuationUnknownToPunctuation[] = {
    {0x0061D, 0x0061D}, {0x009FD, 0x009FD}, {0x00A76, 0x00A76}, {0x00C77, 0x00C77},
    {0x00C84, 0x00C84}, {0x01B7D, 0x01B7E}, {0x02E43, 0x02E4F}, {0x02E52, 0x02E5D},
    {0x10EAD, 0x10EAD}, {0x10F55, 0x10F59}, {0x10F86, 0x10F89}, {0x1144B, 0x1144F},
    {0x1145A, 0x1145B}, {0x1145D, 0x1145D}, {0x11660, 0x1166C}, {0x116B9, 0x116B9},
    {0x1183B, 0x1183B}, {0x11944, 0x11946}, {0x119E2, 0x119E2}, {0x11A3F, 0x11A46},
    {0x11A9A, 0x11A9C}, {0x11A9E, 0x11AA2}, {0x11C41, 0x11C45}, {0x11C70, 0x11C71},
    {0x11EF7, 0x11EF8}, {0x11FFF, 0x11FFF}, {0x12FF1, 0x12FF2}, {0x16E97, 0x16E9A},
    {0x16FE2, 0x16FE2}, {0x1E95E, 0x1E95F},
};

// Code points `tokenizers`' NFC/NFD/NFKC/NFKD treat as unassigned (same generator).
constexpr CodeRange kUnknownToNormalizers[] = {
    {0x007FD, 0x007FD}, {0x00898, 0x0089F}, {0x008CA, 0x008D3}, {0x009FE, 0x009FE},
    {0x00C3C, 0x00C3C}, {0x00D3B, 0x00D3C}, {0x00EBA, 0x00EBA}, {0x01715, 0x01715},
    {0x01ABF, 0x01ACE}, {0x01DF6, 0x01DFA}, {0x032FF, 0x032FF}, {0x0A7F2, 0x0A7F4},
    {0x0A82C, 0x0A82C}, {0x0AB69, 0x0AB69}, {0x10781, 0x10785}, {0x10787, 0x107B0},
    {0x107B2, 0x107BA}, {0x10D24, 0x10D27}, {0x10EAB, 0x10EAC}, {0x10F46, 0x10F50},
    {0x10F82, 0x10F85}, {0x11070, 0x11070}, {0x1133B, 0x1133B}, {0x1145E, 0x1145E},
    {0x11839, 0x1183A}, {0x11938, 0x11938}, {0x1193D, 0x1193E}, {0x11943, 0x11943},
    {0x119E0, 0x119E0}, {0x11A34, 0x11A34}, {0x11A47, 0x11A47}, {0x11A99, 0x11A99},
    {0x11D42, 0x11D42}, {0x11D44, 0x11D45}, {0x11D97, 0x11D97}, {0x16FF0, 0x16FF1},
    {0x1E130, 0x1E136}, {0x1E2AE, 0x1E2AE}, {0x1E2EC, 0x1E2EF}, {0x1F16C, 0x1F16C},
    {0x1FBF0, 0x1FBF9},
};

template <typename Range>
const Range* find_range(std::span<const Range> ranges, char32_t cp) {
  auto it = std::upper_bound(ranges.begin(), ranges.end(), cp,
                             [](char32_t c, const Range& r) { return c < r.first; });
  if (it != ranges.begin() && cp <= (it - 1)->last) return &*(it - 1);
  return nullptr;
}

}  // namespace

std::span<const AssignedRange> newer_assignments() { return kNewerAssignments; }

std::string_view general_category(char32_t cp) {
  const std::string_view known = utf8proc_category_string(static_cast<utf8proc_int32_t>(cp));
  if (known != "Cn") return known;
  const AssignedRange* range = find_range(std::span<const AssignedRange>(kNewerAssignments), cp);
  return range != nullptr ? std::string_view(range->category) : known;
}

std::string newer_class_items(std::initializer_list<std::string_view> prefixes) {
  std::string items;
  char buffer[48];
  for (const AssignedRange& r : kNewerAssignments) {
    const std::string_view category = r.category;
    bool wanted = false;
    for (const std::string_view prefix : prefixes) wanted = wanted || category.starts_with(prefix);
    if (!wanted) continue;
    if (r.first == r.last) {
      std::snprintf(buffer, sizeof(buffer), "\\x{%X}", static_cast<unsigned>(r.first));
    } else {
      std::snprintf(buffer, sizeof(buffer), "\\x{%X}-\\x{%X}", static_cast<unsigned>(r.first),
                    static_cast<unsigned>(r.last));
    }
    items += buffer;
  }
  return items;
}

bool is_numeric(char32_t cp) { return general_category(cp).starts_with('N'); }

bool is_punctuation(char32_t cp) { return general_category(cp).starts_with('P'); }

bool is_mark(char32_t cp) { return general_category(cp).starts_with('M'); }

bool is_stripped_accent(char32_t cp) {
  if (!std::string_view(utf8proc_category_string(static_cast<utf8proc_int32_t>(cp)))
           .starts_with('M')) {
    return false;
  }
  return find_range(std::span<const AssignedRange>(kNewerAssignments), cp) == nullptr &&
         find_range(std::span<const CodeRange>(kMarksKeptByStripAccents), cp) == nullptr;
}

bool is_split_punctuation(char32_t cp) {
  if (!std::string_view(utf8proc_category_string(static_cast<utf8proc_int32_t>(cp)))
           .starts_with('P')) {
    return false;
  }
  return find_range(std::span<const AssignedRange>(kNewerAssignments), cp) == nullptr &&
         find_range(std::span<const CodeRange>(kPunctuationUnknownToPunctuation), cp) == nullptr;
}

bool is_control(char32_t cp) { return general_category(cp) == "Cc"; }

namespace {

std::string utf8proc_normalize(std::string_view text, int options) {
  if (text.empty()) return {};
  utf8proc_uint8_t* result = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                          static_cast<utf8proc_ssize_t>(text.size()), &result,
                                          static_cast<utf8proc_option_t>(options));
  std::unique_ptr<utf8proc_uint8_t, void (*)(void*)> owned(result, std::free);
  MOE_CHECK(n >= 0, "unicode normalisation failed: ", utf8proc_errmsg(n));
  return std::string(reinterpret_cast<const char*>(result), static_cast<size_t>(n));
}

// Characters `tokenizers` normalises as unassigned starters: they stay as they are and nothing
// composes or reorders across them.
bool is_normalization_barrier(char32_t cp) {
  if (cp < 0x7FD) return false;
  return find_range(std::span<const CodeRange>(kUnknownToNormalizers), cp) != nullptr ||
         find_range(std::span<const AssignedRange>(kNewerAssignments), cp) != nullptr;
}

}  // namespace

std::string normalize(std::string_view text, NormalForm form) {
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::kNFC:
      options |= UTF8PROC_COMPOSE;
      break;
    case NormalForm::kNFD:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case NormalForm::kNFKC:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case NormalForm::kNFKD:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
  }
  std::string out;
  out.reserve(text.size());
  size_t run_start = 0;
  for (size_t pos = 0; pos < text.size();) {
    const size_t start = pos;
    const char32_t cp = next_code_point(text, pos);
    if (!is_normalization_barrier(cp)) continue;
    out += utf8proc_normalize(text.substr(run_start, start - run_start), options);
    out.append(text.substr(start, pos - start));
    run_start = pos;
  }
  out += utf8proc_normalize(text.substr(run_start), options);
  return out;
}

std::string to_lower(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    const char32_t cp = next_code_point(text, pos);
    if (cp == 0x130) {  // the one unconditional multi-character lowercase mapping
      out += "i\xCC\x87";
      continue;
    }
    append_utf8(out, static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))));
  }
  return out;
}

namespace {

struct ByteTables {
  std::array<std::string, 256> to_chars;
  std::array<int16_t, 512> to_byte{};
  ByteTables() {
    to_byte.fill(-1);
    int next_extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const char32_t cp = printable ? char32_t(b) : char32_t(256 + next_extra++);
      to_chars[b] = to_utf8(cp);
      to_byte[cp] = static_cast<int16_t>(b);
    }
  }
};

const ByteTables& byte_tables() {
  static const ByteTables tables;
  return tables;
}

}  // namespace

const std::array<std::string, 256>& byte_to_chars() { return byte_tables().to_chars; }

int byte_of_char(char32_t cp) { return cp < 512 ? byte_tables().to_byte[cp] : -1; }

}  // namespace moeinfer::unicode
