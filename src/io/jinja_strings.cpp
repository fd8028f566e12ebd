// Python `str` methods and formatting for template values.
#include "io/jinja_strings.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "io/unicode.h"

namespace moeinfer::jinja {
namespace {

std::u32string u32(std::string_view s) { return utf8_decode(s); }
std::string u8(const std::u32string& s) { return utf8_encode(s); }

bool is_line_break(char32_t c) {
  return c == '\n' || c == '\r' || c == 0x0b || c == 0x0c || c == 0x1c || c == 0x1d || c == 0x1e ||
         c == 0x85 || c == 0x2028 || c == 0x2029;
}

std::vector<std::string> split_ws(const std::u32string& s, int64_t maxsplit) {
  std::vector<std::string> out;
  size_t i = 0, n = s.size();
  while (maxsplit != 0) {
    while (i < n && py_isspace(s[i])) ++i;
    if (i >= n) break;
    size_t j = i;
    while (j < n && !py_isspace(s[j])) ++j;
    out.push_back(u8(s.substr(i, j - i)));
    i = j;
    if (maxsplit > 0) --maxsplit;
  }
  while (i < n && py_isspace(s[i])) ++i;
  if (i < n) out.push_back(u8(s.substr(i)));
  return out;
}

std::vector<std::string> rsplit_ws(const std::u32string& s, int64_t maxsplit) {
  std::vector<std::string> out;
  size_t n = s.size();
  size_t i = n;  // exclusive end
  while (maxsplit != 0) {
    while (i > 0 && py_isspace(s[i - 1])) --i;
    if (i == 0) break;
    size_t j = i;
    while (j > 0 && !py_isspace(s[j - 1])) --j;
    out.push_back(u8(s.substr(j, i - j)));
    i = j;
    if (maxsplit > 0) --maxsplit;
  }
  while (i > 0 && py_isspace(s[i - 1])) --i;
  if (i > 0) out.push_back(u8(s.substr(0, i)));
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<std::string> split_sep(const std::string& s, const std::string& sep, int64_t maxsplit) {
  if (sep.empty()) fail("empty separator");
  std::vector<std::string> out;
  size_t start = 0;
  while (maxsplit != 0) {
    size_t pos = s.find(sep, start);
    if (pos == std::string::npos) break;
    out.push_back(s.substr(start, pos - start));
    start = pos + sep.size();
    if (maxsplit > 0) --maxsplit;
  }
  out.push_back(s.substr(start));
  return out;
}

std::vector<std::string> rsplit_sep(const std::string& s, const std::string& sep,
                                    int64_t maxsplit) {
  if (sep.empty()) fail("empty separator");
  std::vector<std::string> out;
  size_t end = s.size();
  while (maxsplit != 0 && end >= sep.size()) {
    size_t pos = s.rfind(sep, end - sep.size());
    if (pos == std::string::npos) break;
    out.push_back(s.substr(pos + sep.size(), end - pos - sep.size()));
    end = pos;
    if (maxsplit > 0) --maxsplit;
  }
  out.push_back(s.substr(0, end));
  std::reverse(out.begin(), out.end());
  return out;
}

Value string_list(std::vector<std::string> parts) {
  ValueList out;
  out.reserve(parts.size());
  for (auto& p : parts) out.push_back(Value::string(std::move(p)));
  return Value::list(std::move(out));
}

// Code point index of a byte offset.
int64_t cp_index(const std::string& s, size_t byte_pos) {
  return unicode::count_code_points(std::string_view(s).substr(0, byte_pos));
}

// Byte offset of a code point index (clamped like Python slice bounds).
size_t byte_offset(const std::string& s, int64_t cp) {
  int64_t total = static_cast<int64_t>(u32(s).size());
  if (cp < 0) cp += total;
  cp = std::clamp<int64_t>(cp, 0, total);
  size_t i = 0;
  for (int64_t k = 0; k < cp && i < s.size(); ++k) {
    ++i;
    while (i < s.size() && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) ++i;
  }
  return i;
}

const std::string& str_arg(const Value& v, const char* method) {
  if (!v.is_string()) {
    if (v.is_undefined()) fail(v.undefined_message());
    fail(std::string(method) + "() argument must be str, not " + v.type_name());
  }
  return v.as_string();
}

std::optional<std::string> opt_chars(const CallArgs& a, const char* method) {
  if (a.args.size() > 1 || !a.kwargs.empty())
    fail(std::string(method) + "() takes at most 1 argument");
  if (a.args.empty() || a.args[0].is_none()) return std::nullopt;
  return str_arg(a.args[0], method);
}

int64_t int_arg(const Value& v, const char* method) {
  if (!v.is_int() && !v.is_bool()) {
    fail(std::string(method) + "() expects an integer, got " + v.type_name());
  }
  return v.as_int();
}

std::string py_str_format(const std::string& fmt, const CallArgs& a) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < fmt.size(); ++i) {
    char c = fmt[i];
    if (c == '{') {
      if (i + 1 < fmt.size() && fmt[i + 1] == '{') {
        out += '{';
        ++i;
        continue;
      }
      size_t close = fmt.find('}', i);
      if (close == std::string::npos) fail("Single '{' encountered in format string");
      std::string field = fmt.substr(i + 1, close - i - 1);
      std::string spec;
      size_t colon = field.find(':');
      if (colon != std::string::npos) {
        spec = field.substr(colon + 1);
        field = field.substr(0, colon);
      }
      bool repr = false;
      size_t bang = field.find('!');
      if (bang != std::string::npos) {
        repr = field.substr(bang + 1) == "r";
        field = field.substr(0, bang);
      }
      Value v;
      if (field.empty()) {
        if (auto_index >= a.args.size()) fail("Replacement index out of range for positional args");
        v = a.args[auto_index++];
      } else if (std::all_of(field.begin(), field.end(),
                             [](char d) { return d >= '0' && d <= '9'; })) {
        size_t idx = std::stoul(field);
        if (idx >= a.args.size()) fail("Replacement index out of range for positional args");
        v = a.args[idx];
      } else {
        bool found = false;
        for (const auto& [k, x] : a.kwargs) {
          if (k == field) {
            v = x;
            found = true;
          }
        }
        if (!found) fail("KeyError: '" + field + "'");
      }
      if (!spec.empty()) fail("format specs in str.format are not supported");
      out += repr ? v.repr() : v.str();
      i = close;
    } else if (c == '}') {
      if (i + 1 < fmt.size() && fmt[i + 1] == '}') ++i;
      out += '}';
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

std::string py_str_lower(std::string_view s) {
  std::u32string c = u32(s);
  for (auto& ch : c) ch = py_lower(ch);
  return u8(c);
}

std::string py_str_upper(std::string_view s) {
  std::u32string c = u32(s);
  for (auto& ch : c) ch = py_upper(ch);
  return u8(c);
}

std::string py_str_capitalize(std::string_view s) {
  std::u32string c = u32(s);
  for (size_t i = 0; i < c.size(); ++i) c[i] = i == 0 ? py_title(c[i]) : py_lower(c[i]);
  return u8(c);
}

std::string py_str_title(std::string_view s) {
  std::u32string c = u32(s);
  bool prev_cased = false;
  for (auto& ch : c) {
    bool cased = py_iscased(ch);
    ch = prev_cased ? py_lower(ch) : py_title(ch);
    prev_cased = cased;
  }
  return u8(c);
}

std::string jinja_title(std::string_view s) {
  // Words start after runs of '-', whitespace, '(', '{', '[' or '<'.
  std::u32string c = u32(s);
  auto is_delim = [](char32_t ch) {
    return ch == '-' || ch == '(' || ch == '{' || ch == '[' || ch == '<' || py_isspace(ch);
  };
  bool word_start = true;
  for (auto& ch : c) {
    if (is_delim(ch)) {
      word_start = true;
      continue;
    }
    ch = word_start ? py_upper(ch) : py_lower(ch);
    word_start = false;
  }
  return u8(c);
}

std::string py_str_strip(std::string_view s, const std::optional<std::string>& chars, bool left,
                         bool right) {
  std::u32string c = u32(s);
  std::u32string set = chars ? u32(*chars) : std::u32string();
  auto strip_it = [&](char32_t ch) {
    return chars ? set.find(ch) != std::u32string::npos : py_isspace(ch);
  };
  size_t b = 0, e = c.size();
  if (left) {
    while (b < e && strip_it(c[b])) ++b;
  }
  if (right) {
    while (e > b && strip_it(c[e - 1])) --e;
  }
  return u8(c.substr(b, e - b));
}

std::string py_str_replace(std::string_view s, std::string_view old, std::string_view replacement,
                           int64_t count) {
  std::string out;
  if (old.empty()) {
    std::u32string c = u32(s);
    int64_t done = 0;
    for (size_t i = 0; i <= c.size(); ++i) {
      if (count < 0 || done < count) {
        out += replacement;
        ++done;
      }
      if (i < c.size()) utf8_append(out, c[i]);
    }
    return out;
  }
  size_t start = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t pos = s.find(old, start);
    if (pos == std::string_view::npos) break;
    out.append(s.substr(start, pos - start));
    out.append(replacement);
    start = pos + old.size();
    ++done;
  }
  out.append(s.substr(start));
  return out;
}

std::vector<std::string> py_str_splitlines(std::string_view s, bool keepends) {
  std::u32string c = u32(s);
  std::vector<std::string> out;
  size_t i = 0, start = 0;
  while (i < c.size()) {
    if (is_line_break(c[i])) {
      size_t eol = i + 1;
      if (c[i] == '\r' && i + 1 < c.size() && c[i + 1] == '\n') eol = i + 2;
      out.push_back(u8(c.substr(start, (keepends ? eol : i) - start)));
      start = i = eol;
    } else {
      ++i;
    }
  }
  if (start < c.size()) out.push_back(u8(c.substr(start)));
  return out;
}

std::string py_str_pad(std::string_view s, int64_t width, std::string_view fill, char mode) {
  std::u32string f = u32(fill);
  if (f.size() != 1) fail("The fill character must be exactly one character long");
  int64_t len = static_cast<int64_t>(u32(s).size());
  int64_t marg = width - len;
  if (marg <= 0) return std::string(s);
  int64_t left = 0;
  if (mode == 'c') {
    left = marg / 2 + (marg & width & 1);
  } else if (mode == 'r') {
    left = marg;
  }
  int64_t right = marg - left;
  std::string out;
  for (int64_t i = 0; i < left; ++i) utf8_append(out, f[0]);
  out += s;
  for (int64_t i = 0; i < right; ++i) utf8_append(out, f[0]);
  return out;
}

bool py_str_is(std::string_view s, char kind) {
  bool any_cased = false;
  for (char32_t c : u32(s)) {
    if (kind == 'l') {
      if (py_isupper(c)) return false;
      any_cased |= py_islower(c);
    } else {
      if (py_islower(c)) return false;
      any_cased |= py_isupper(c);
    }
  }
  return any_cased;
}

std::optional<int64_t> parse_py_int(std::string_view text, int base) {
  std::string s = py_str_strip(text, std::nullopt, true, true);
  size_t i = 0;
  bool neg = false;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) neg = s[i++] == '-';
  if (i + 1 < s.size() && s[i] == '0') {
    char p = static_cast<char>(s[i + 1] | 0x20);
    if ((p == 'x' && base == 16) || (p == 'o' && base == 8) || (p == 'b' && base == 2)) {
      i += 2;
      if (i < s.size() && s[i] == '_') ++i;
    }
  }
  if (i >= s.size()) return std::nullopt;
  int64_t v = 0;
  bool prev_digit = false;
  for (; i < s.size(); ++i) {
    char c = s[i];
    if (c == '_') {
      if (!prev_digit || i + 1 >= s.size()) return std::nullopt;
      prev_digit = false;
      continue;
    }
    int d;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') {
      d = (c | 0x20) - 'a' + 10;
    } else {
      return std::nullopt;
    }
    if (d >= base) return std::nullopt;
    v = v * base + d;
    prev_digit = true;
  }
  return neg ? -v : v;
}

std::optional<double> parse_py_float(std::string_view text) {
  std::string s = py_str_strip(text, std::nullopt, true, true);
  if (s.empty()) return std::nullopt;
  std::string lower = py_str_lower(s);
  std::string body = lower;
  double sign = 1;
  if (!body.empty() && (body[0] == '+' || body[0] == '-')) {
    sign = body[0] == '-' ? -1 : 1;
    body = body.substr(1);
  }
  if (body == "inf" || body == "infinity") return sign * HUGE_VAL;
  if (body == "nan") return std::nan("");
  std::string clean;
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    if (c == '_') {
      bool ok = i > 0 && i + 1 < s.size() && std::isdigit(static_cast<unsigned char>(s[i - 1])) &&
                std::isdigit(static_cast<unsigned char>(s[i + 1]));
      if (!ok) return std::nullopt;
      continue;
    }
    if (!(std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == 'e' || c == 'E' ||
          c == '+' || c == '-')) {
      return std::nullopt;
    }
    clean += c;
  }
  char* end = nullptr;
  double v = std::strtod(clean.c_str(), &end);
  if (end != clean.c_str() + clean.size()) return std::nullopt;
  return v;
}

double py_round(double x, int64_t digits) {
  if (!std::isfinite(x)) return x;
  if (digits > 300) return x;
  if (digits >= 0) {
    char buf[512];
    std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(digits), x);
    return std::strtod(buf, nullptr);
  }
  double m = std::pow(10.0, static_cast<double>(-digits));
  return std::nearbyint(x / m) * m;
}

std::string percent_format(const std::string& fmt, const Value& args) {
  ValueList positional;
  const Value* mapping = nullptr;
  if (args.kind() == Value::Kind::kTuple) {
    positional = args.items();
  } else if (args.is_dict()) {
    mapping = &args;
  } else {
    positional.push_back(args);
  }
  size_t next_arg = 0;
  std::string out;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out += fmt[i];
      continue;
    }
    if (++i >= fmt.size()) fail("incomplete format");
    Value v;
    bool have_value = false;
    if (fmt[i] == '(') {
      size_t close = fmt.find(')', i);
      if (close == std::string::npos || !mapping) fail("format requires a mapping");
      std::string key = fmt.substr(i + 1, close - i - 1);
      const Value* found = mapping->find(key);
      if (!found) fail("KeyError: '" + key + "'");
      v = *found;
      have_value = true;
      i = close + 1;
    }
    std::string flags;
    while (i < fmt.size() && std::string("-+ #0").find(fmt[i]) != std::string::npos)
      flags += fmt[i++];
    std::string width;
    while (i < fmt.size() && std::isdigit(static_cast<unsigned char>(fmt[i]))) width += fmt[i++];
    std::string precision;
    if (i < fmt.size() && fmt[i] == '.') {
      precision = ".";
      ++i;
      while (i < fmt.size() && std::isdigit(static_cast<unsigned char>(fmt[i])))
        precision += fmt[i++];
    }
    if (i >= fmt.size()) fail("incomplete format");
    char type = fmt[i];
    if (type == '%') {
      out += '%';
      continue;
    }
    if (!have_value) {
      if (next_arg >= positional.size()) fail("not enough arguments for format string");
      v = positional[next_arg++];
    }
    std::string piece;
    char buf[512];
    std::string spec = "%" + flags + width + precision;
    switch (type) {
      case 's':
      case 'r':
      case 'a': {
        piece = type == 's' ? v.str() : v.repr();
        if (precision.size() > 1) {
          std::u32string c = utf8_decode(piece);
          piece = utf8_encode(c.substr(0, std::stoul(precision.substr(1))));
        }
        int64_t w = width.empty() ? 0 : std::stoll(width);
        piece = py_str_pad(piece, w, " ", flags.find('-') != std::string::npos ? 'l' : 'r');
        break;
      }
      case 'd':
      case 'i':
      case 'u': {
        if (!v.is_number())
          fail(std::string("%d format: a real number is required, not ") + v.type_name());
        long long n = v.is_float() ? static_cast<long long>(std::trunc(v.as_double())) : v.as_int();
        std::snprintf(buf, sizeof(buf), (spec + "lld").c_str(), n);
        piece = buf;
        break;
      }
      case 'x':
      case 'X':
      case 'o': {
        if (!v.is_int() && !v.is_bool()) fail("%x format: an integer is required");
        long long n = v.as_int();
        std::string sign = n < 0 ? "-" : "";
        std::snprintf(buf, sizeof(buf), (spec + "ll" + type).c_str(), n < 0 ? -n : n);
        piece = sign + buf;
        break;
      }
      case 'f':
      case 'F':
      case 'e':
      case 'E':
      case 'g':
      case 'G': {
        if (!v.is_number()) fail(std::string("must be real number, not ") + v.type_name());
        std::snprintf(buf, sizeof(buf), (spec + type).c_str(), v.as_double());
        piece = buf;
        break;
      }
      case 'c':
        piece = v.is_int() ? utf8_encode(std::u32string(1, static_cast<char32_t>(v.as_int())))
                           : v.str();
        break;
      default:
        fail(std::string("unsupported format character '") + type + "'");
    }
    out += piece;
  }
  if (!mapping && next_arg < positional.size()) {
    fail("not all arguments converted during string formatting");
  }
  return out;
}

bool is_string_method(const std::string& name) {
  static const char* kNames[] = {
      "strip",        "lstrip",       "rstrip",  "split",   "rsplit",    "splitlines",
      "startswith",   "endswith",     "upper",   "lower",   "title",     "capitalize",
      "swapcase",     "casefold",     "replace", "find",    "rfind",     "index",
      "rindex",       "count",        "join",    "isdigit", "isdecimal", "isnumeric",
      "isalpha",      "isalnum",      "isspace", "islower", "isupper",   "istitle",
      "center",       "ljust",        "rjust",   "zfill",   "partition", "rpartition",
      "removeprefix", "removesuffix", "format"};
  return std::any_of(std::begin(kNames), std::end(kNames),
                     [&](const char* n) { return name == n; });
}

Value call_string_method(const std::string& s, const std::string& name, CallArgs& a) {
  auto no_args = [&]() {
    if (!a.args.empty() || !a.kwargs.empty()) fail(name + "() takes no arguments");
  };
  auto arg = [&](size_t i, const char* kw) -> const Value* {
    if (i < a.args.size()) return &a.args[i];
    for (const auto& [k, v] : a.kwargs) {
      if (k == kw) return &v;
    }
    return nullptr;
  };
  if (name == "strip") return Value::string(py_str_strip(s, opt_chars(a, "strip"), true, true));
  if (name == "lstrip") return Value::string(py_str_strip(s, opt_chars(a, "lstrip"), true, false));
  if (name == "rstrip") return Value::string(py_str_strip(s, opt_chars(a, "rstrip"), false, true));
  if (name == "split" || name == "rsplit") {
    const Value* sep = arg(0, "sep");
    const Value* maxv = arg(1, "maxsplit");
    int64_t maxsplit = maxv ? int_arg(*maxv, name.c_str()) : -1;
    bool right = name == "rsplit";
    if (!sep || sep->is_none()) {
      return string_list(right ? rsplit_ws(u32(s), maxsplit) : split_ws(u32(s), maxsplit));
    }
    const std::string& sp = str_arg(*sep, name.c_str());
    return string_list(right ? rsplit_sep(s, sp, maxsplit) : split_sep(s, sp, maxsplit));
  }
  if (name == "splitlines") {
    const Value* keep = arg(0, "keepends");
    return string_list(py_str_splitlines(s, keep && keep->truthy()));
  }
  if (name == "startswith" || name == "endswith") {
    if (a.args.empty()) fail(name + "() takes at least 1 argument");
    std::string sub = s;
    if (a.args.size() > 1) {
      size_t b = byte_offset(s, int_arg(a.args[1], name.c_str()));
      size_t e = a.args.size() > 2 ? byte_offset(s, int_arg(a.args[2], name.c_str())) : s.size();
      sub = e > b ? s.substr(b, e - b) : "";
    }
    ValueList options = a.args[0].is_list() ? a.args[0].items() : ValueList{a.args[0]};
    for (const auto& o : options) {
      const std::string& p = str_arg(o, name.c_str());
      bool hit = name == "startswith" ? sub.compare(0, p.size(), p) == 0 && sub.size() >= p.size()
                                      : sub.size() >= p.size() &&
                                            sub.compare(sub.size() - p.size(), p.size(), p) == 0;
      if (hit) return Value::boolean(true);
    }
    return Value::boolean(false);
  }
  if (name == "upper") {
    no_args();
    return Value::string(py_str_upper(s));
  }
  if (name == "lower" || name == "casefold") {
    no_args();
    return Value::string(py_str_lower(s));
  }
  if (name == "title") {
    no_args();
    return Value::string(py_str_title(s));
  }
  if (name == "capitalize") {
    no_args();
    return Value::string(py_str_capitalize(s));
  }
  if (name == "swapcase") {
    no_args();
    std::u32string c = u32(s);
    for (auto& ch : c) ch = py_isupper(ch) ? py_lower(ch) : (py_islower(ch) ? py_upper(ch) : ch);
    return Value::string(u8(c));
  }
  if (name == "replace") {
    if (a.args.size() < 2) fail("replace() takes at least 2 arguments");
    int64_t count = a.args.size() > 2 ? int_arg(a.args[2], "replace") : -1;
    if (const Value* c = arg(99, "count")) count = int_arg(*c, "replace");
    return Value::string(
        py_str_replace(s, str_arg(a.args[0], "replace"), str_arg(a.args[1], "replace"), count));
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
    if (a.args.empty()) fail(name + "() takes at least 1 argument");
    const std::string& sub = str_arg(a.args[0], name.c_str());
    size_t b = a.args.size() > 1 && !a.args[1].is_none()
                   ? byte_offset(s, int_arg(a.args[1], name.c_str()))
                   : 0;
    size_t e = a.args.size() > 2 && !a.args[2].is_none()
                   ? byte_offset(s, int_arg(a.args[2], name.c_str()))
                   : s.size();
    if (e < b) e = b;
    std::string window = s.substr(b, e - b);
    if (name == "count") {
      if (sub.empty()) return Value::integer(static_cast<int64_t>(u32(window).size()) + 1);
      int64_t n = 0;
      for (size_t p = window.find(sub); p != std::string::npos;
           p = window.find(sub, p + sub.size()))
        ++n;
      return Value::integer(n);
    }
    bool reverse = name[0] == 'r';
    size_t pos = reverse ? window.rfind(sub) : window.find(sub);
    if (pos == std::string::npos) {
      if (name == "index" || name == "rindex") fail("substring not found");
      return Value::integer(-1);
    }
    return Value::integer(cp_index(s, b + pos));
  }
  if (name == "join") {
    if (a.args.size() != 1) fail("join() takes exactly one argument");
    std::string out;
    bool first = true;
    for (const auto& item : a.args[0].iterate()) {
      if (!first) out += s;
      first = false;
      out += str_arg(item, "join");
    }
    return Value::string(std::move(out));
  }
  if (name.rfind("is", 0) == 0) {
    no_args();
    std::u32string c = u32(s);
    if (name == "islower") return Value::boolean(py_str_is(s, 'l'));
    if (name == "isupper") return Value::boolean(py_str_is(s, 'u'));
    if (c.empty()) return Value::boolean(false);
    if (name == "istitle") {
      return Value::boolean(py_str_title(s) == s && std::any_of(c.begin(), c.end(), py_iscased));
    }
    auto all = [&](auto pred) { return Value::boolean(std::all_of(c.begin(), c.end(), pred)); };
    if (name == "isdigit" || name == "isdecimal") return all(py_isdigit);
    if (name == "isnumeric") return all(py_isalnum);
    if (name == "isalpha") return all(py_isalpha);
    if (name == "isalnum") return all(py_isalnum);
    if (name == "isspace") return all(py_isspace);
  }
  if (name == "center" || name == "ljust" || name == "rjust") {
    if (a.args.empty()) fail(name + "() takes at least 1 argument");
    std::string fill = a.args.size() > 1 ? str_arg(a.args[1], name.c_str()) : " ";
    return Value::string(py_str_pad(s, int_arg(a.args[0], name.c_str()), fill,
                                    name == "center" ? 'c' : (name == "ljust" ? 'l' : 'r')));
  }
  if (name == "zfill") {
    if (a.args.size() != 1) fail("zfill() takes exactly one argument");
    int64_t width = int_arg(a.args[0], "zfill");
    std::u32string c = u32(s);
    int64_t pad = width - static_cast<int64_t>(c.size());
    if (pad <= 0) return Value::string(s);
    size_t at = (!c.empty() && (c[0] == '+' || c[0] == '-')) ? 1 : 0;
    c.insert(at, static_cast<size_t>(pad), U'0');
    return Value::string(u8(c));
  }
  if (name == "partition" || name == "rpartition") {
    if (a.args.size() != 1) fail(name + "() takes exactly one argument");
    const std::string& sep = str_arg(a.args[0], name.c_str());
    if (sep.empty()) fail("empty separator");
    size_t pos = name == "partition" ? s.find(sep) : s.rfind(sep);
    if (pos == std::string::npos) {
      return name == "partition"
                 ? Value::tuple({Value::string(s), Value::string(""), Value::string("")})
                 : Value::tuple({Value::string(""), Value::string(""), Value::string(s)});
    }
    return Value::tuple({Value::string(s.substr(0, pos)), Value::string(sep),
                         Value::string(s.substr(pos + sep.size()))});
  }
  if (name == "removeprefix" || name == "removesuffix") {
    if (a.args.size() != 1) fail(name + "() takes exactly one argument");
    const std::string& x = str_arg(a.args[0], name.c_str());
    if (name == "removeprefix") {
      return Value::string(
          s.compare(0, x.size(), x) == 0 && s.size() >= x.size() ? s.substr(x.size()) : s);
    }
    bool ends = s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
    return Value::string(ends && !x.empty() ? s.substr(0, s.size() - x.size()) : s);
  }
  if (name == "format") return Value::string(py_str_format(s, a));
  fail("str has no method '" + name + "'");
}

}  // namespace moeinfer::jinja
