#include "io/unicode.h"

#include <utf8proc.h>

#include <cstdlib>
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
utf8proc_category_t category(char32_t cp) {
  return static_cast<utf8proc_category_t>(utf8proc_category(static_cast<utf8proc_int32_t>(cp)));
}
}  // namespace

bool is_numeric(char32_t cp) {
  const auto c = category(cp);
  return c == UTF8PROC_CATEGORY_ND || c == UTF8PROC_CATEGORY_NL || c == UTF8PROC_CATEGORY_NO;
}

bool is_punctuation(char32_t cp) {
  const auto c = category(cp);
  return c >= UTF8PROC_CATEGORY_PC && c <= UTF8PROC_CATEGORY_PO;
}

bool is_mark(char32_t cp) {
  const auto c = category(cp);
  return c == UTF8PROC_CATEGORY_MN || c == UTF8PROC_CATEGORY_MC || c == UTF8PROC_CATEGORY_ME;
}

bool is_control(char32_t cp) { return category(cp) == UTF8PROC_CATEGORY_CC; }

std::string normalize(std::string_view text, NormalForm form) {
  if (text.empty()) return {};
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
  utf8proc_uint8_t* result = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                          static_cast<utf8proc_ssize_t>(text.size()), &result,
                                          static_cast<utf8proc_option_t>(options));
  std::unique_ptr<utf8proc_uint8_t, void (*)(void*)> owned(result, std::free);
  MOE_CHECK(n >= 0, "unicode normalisation failed: ", utf8proc_errmsg(n));
  return std::string(reinterpret_cast<const char*>(result), static_cast<size_t>(n));
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
