// Python `str` behaviour for the Jinja-subset renderer: the string methods templates call
// (`content.strip()`, `name.split('.')`, ...), %-formatting, and the number parsing behind the
// `int` and `float` filters. Strings are UTF-8; indices and lengths count code points.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "io/jinja_value.h"

namespace moeinfer::jinja {

std::string py_str_lower(std::string_view s);
std::string py_str_upper(std::string_view s);
std::string py_str_capitalize(std::string_view s);
std::string py_str_title(std::string_view s);
std::string jinja_title(
    std::string_view s);  // jinja2's `title` filter, which differs from str.title
// chars: nullopt strips whitespace.
std::string py_str_strip(std::string_view s, const std::optional<std::string>& chars, bool left,
                         bool right);
std::string py_str_replace(std::string_view s, std::string_view old, std::string_view replacement,
                           int64_t count);
std::vector<std::string> py_str_splitlines(std::string_view s, bool keepends = false);
// mode: 'c' center, 'l' ljust, 'r' rjust.
std::string py_str_pad(std::string_view s, int64_t width, std::string_view fill, char mode);
// kind: 'l' islower, 'u' isupper.
bool py_str_is(std::string_view s, char kind);

std::optional<int64_t> parse_py_int(std::string_view s, int base);
std::optional<double> parse_py_float(std::string_view s);
double py_round(double x, int64_t digits);

// fmt % args, as Python's printf-style string formatting.
std::string percent_format(const std::string& fmt, const Value& args);

bool is_string_method(const std::string& name);
Value call_string_method(const std::string& s, const std::string& name, CallArgs& args);

}  // namespace moeinfer::jinja
