// The JSON-schema grammar of constrained decoding (runtime/json_schema_grammar.h), against a
// validator written here from the JSON Schema rules and not from the grammar:
// - random schemas (a generator below) and hand-written ones: random valid instances, written
//   compact and pretty-printed, are accepted byte by byte and complete; one-byte mutations that
//   the matcher accepts to completion parse and validate;
// - random token choices under the mask over a vocabulary of JSON-ish pieces and every single
//   byte: the trie walk's mask equals trying every token's bytes one by one, and every text that
//   ends (end-of-sequence allowed, or nothing can follow) parses and validates;
// - unsupported keywords and overlapping oneOf alternatives are refused, naming the keyword;
// - Tokenizer::token_bytes concatenates to the decoded text on the fixture tokenizers;
// - the per-step mask cost on a 150k-token vocabulary and the demo model's, printed (no timing
//   assertion).
#include "runtime/json_schema_grammar.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/tokenizer.h"

namespace moeinfer {
namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// The reference validator: JSON Schema's meaning of the keywords the grammar takes (an absent
// additionalProperties allows anything, as the standard says; the grammar is stricter).

int64_t code_points(const std::string& s) {
  int64_t n = 0;
  for (const char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

bool is_integer(const json& v) {
  if (v.is_number_integer() || v.is_number_unsigned()) return true;
  return v.is_number_float() && std::isfinite(v.get<double>()) &&
         v.get<double>() == std::floor(v.get<double>());
}

bool has_type(const json& v, const std::string& type) {
  if (type == "null") return v.is_null();
  if (type == "boolean") return v.is_boolean();
  if (type == "integer") return is_integer(v);
  if (type == "number") return v.is_number();
  if (type == "string") return v.is_string();
  if (type == "array") return v.is_array();
  if (type == "object") return v.is_object();
  return false;
}

// `pattern`: ECMA-262 as the C++ library implements it (std::regex's ECMAScript grammar), over
// the string's code points, matched anywhere in it. The random patterns below keep to what it
// and ECMA-262 agree on (no \\s, \\w outside ASCII, or '.'); the hand-written cases cover those.
std::wstring wide(const std::string& s) {
  std::wstring out;
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    const int n = b < 0x80 ? 0 : b < 0xE0 ? 1 : b < 0xF0 ? 2 : 3;
    uint32_t cp = n == 0 ? b : b & (0x3F >> n);
    for (int k = 1; k <= n; ++k) cp = cp << 6 | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(static_cast<wchar_t>(cp));
    i += n + 1;
  }
  return out;
}

bool matches_pattern(const std::string& pattern, const std::string& text) {
  const std::wregex re(wide(pattern), std::regex::ECMAScript);
  return std::regex_search(wide(text), re);
}

bool all_of_chars(const std::string& s, const char* set) {
  return !s.empty() && s.find_first_not_of(set) == std::string::npos;
}

constexpr const char* kDigits = "0123456789";
constexpr const char* kHex = "0123456789abcdefABCDEF";

bool two_digits(const std::string& s, size_t at, int max) {
  if (at + 2 > s.size() || !all_of_chars(s.substr(at, 2), kDigits)) return false;
  return std::stoi(s.substr(at, 2)) <= max;
}

// RFC 3339 full-date: a real day.
bool valid_date(const std::string& s) {
  if (s.size() != 10 || s[4] != '-' || s[7] != '-' || !all_of_chars(s.substr(0, 4), kDigits) ||
      !two_digits(s, 5, 12) || !two_digits(s, 8, 31)) {
    return false;
  }
  const int year = std::stoi(s.substr(0, 4)), month = std::stoi(s.substr(5, 2)),
            day = std::stoi(s.substr(8, 2));
  const bool leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
  const int days[] = {31, leap ? 29 : 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  return year >= 1 && month >= 1 && day >= 1 && day <= days[month - 1];
}

// RFC 3339 full-time without leap seconds.
bool valid_time(const std::string& s) {
  if (s.size() < 9 || s[2] != ':' || s[5] != ':' || !two_digits(s, 0, 23) ||
      !two_digits(s, 3, 59) || !two_digits(s, 6, 59)) {
    return false;
  }
  size_t at = 8;
  if (at < s.size() && s[at] == '.') {
    const size_t end = s.find_first_not_of(kDigits, at + 1);
    if (end == at + 1) return false;
    at = end == std::string::npos ? s.size() : end;
  }
  const std::string zone = s.substr(at);
  if (zone == "Z" || zone == "z") return true;
  return zone.size() == 6 && (zone[0] == '+' || zone[0] == '-') && zone[3] == ':' &&
         two_digits(zone, 1, 23) && two_digits(zone, 4, 59);
}

bool valid_hostname(const std::string& s) {
  if (s.empty() || s.size() > 253) return false;
  size_t start = 0;
  while (true) {
    const size_t dot = s.find('.', start);
    const std::string label =
        s.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-' ||
        !all_of_chars(label, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")) {
      return false;
    }
    if (dot == std::string::npos) return true;
    start = dot + 1;
  }
}

bool valid_format(const std::string& format, const std::string& s) {
  if (format == "date") return valid_date(s);
  if (format == "time") return valid_time(s);
  if (format == "date-time") {
    return s.size() > 11 && (s[10] == 'T' || s[10] == 't') && valid_date(s.substr(0, 10)) &&
           valid_time(s.substr(11));
  }
  if (format == "uuid") {
    if (s.size() != 36) return false;
    for (size_t i = 0; i < s.size(); ++i) {
      const bool dash = i == 8 || i == 13 || i == 18 || i == 23;
      if (dash ? s[i] != '-' : std::string(kHex).find(s[i]) == std::string::npos) return false;
    }
    return true;
  }
  if (format == "ipv4" || format == "ipv6") {
    unsigned char buf[16];
    return inet_pton(format == "ipv4" ? AF_INET : AF_INET6, s.c_str(), buf) == 1;
  }
  if (format == "hostname") return valid_hostname(s);
  if (format == "email") {
    const size_t at = s.rfind('@');
    if (at == std::string::npos || !valid_hostname(s.substr(at + 1))) return false;
    const std::string local = s.substr(0, at);
    if (local.empty() || local.front() == '.' || local.back() == '.' ||
        local.find("..") != std::string::npos) {
      return false;
    }
    return all_of_chars(local,
                        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                        "!#$%&'*+/=?^_`{|}~-.");
  }
  if (format == "uri") {
    const size_t colon = s.find(':');
    if (colon == std::string::npos || colon == 0 || !std::isalpha(static_cast<unsigned char>(s[0])))
      return false;
    for (size_t i = 1; i < colon; ++i) {
      if (!std::isalnum(static_cast<unsigned char>(s[i])) && s[i] != '+' && s[i] != '-' &&
          s[i] != '.') {
        return false;
      }
    }
    const std::string rest = s.substr(colon + 1);
    if (rest.empty()) return false;
    for (size_t i = 0; i < rest.size(); ++i) {
      if (rest[i] == '%') {
        if (i + 2 >= rest.size() || !all_of_chars(rest.substr(i + 1, 2), kHex)) return false;
        i += 2;
        continue;
      }
      if (!std::isalnum(static_cast<unsigned char>(rest[i])) &&
          std::string("-._~:/?#@!$&'()*+,;=").find(rest[i]) == std::string::npos) {
        return false;
      }
    }
    return true;
  }
  return true;  // an unknown format is an annotation
}

bool valid(const json& v, const json& s, const json& root);

const json& resolve(const std::string& ref, const json& root) {
  if (ref == "#") return root;
  const std::string defs = ref.starts_with("#/$defs/") ? "$defs" : "definitions";
  return root[defs][ref.substr(defs.size() + 3)];
}

bool valid(const json& v, const json& s, const json& root) {
  if (s.is_boolean()) return s.get<bool>();
  if (s.contains("$ref")) return valid(v, resolve(s["$ref"], root), root);
  if (s.contains("allOf")) {
    for (const json& sub : s["allOf"]) {
      if (!valid(v, sub, root)) return false;
    }
  }
  if (s.contains("anyOf")) {
    bool any = false;
    for (const json& sub : s["anyOf"]) any = any || valid(v, sub, root);
    if (!any) return false;
  }
  if (s.contains("oneOf")) {
    int matches = 0;
    for (const json& sub : s["oneOf"]) matches += valid(v, sub, root);
    if (matches != 1) return false;
  }
  if (s.contains("type")) {
    bool ok = false;
    if (s["type"].is_string()) {
      ok = has_type(v, s["type"]);
    } else {
      for (const json& t : s["type"]) ok = ok || has_type(v, t);
    }
    if (!ok) return false;
  }
  if (s.contains("const") && !(v == s["const"])) return false;
  if (s.contains("enum")) {
    bool found = false;
    for (const json& e : s["enum"]) found = found || (v == e && v.is_boolean() == e.is_boolean());
    if (!found) return false;
  }
  if (v.is_string()) {
    const int64_t n = code_points(v.get<std::string>());
    if (s.contains("minLength") && n < s["minLength"].get<int64_t>()) return false;
    if (s.contains("maxLength") && n > s["maxLength"].get<int64_t>()) return false;
    if (s.contains("pattern") && !matches_pattern(s["pattern"], v)) return false;
    if (s.contains("format") && !valid_format(s["format"], v)) return false;
  }
  if (v.is_number()) {
    const double x = v.get<double>();
    if (s.contains("minimum") && x < s["minimum"].get<double>()) return false;
    if (s.contains("maximum") && x > s["maximum"].get<double>()) return false;
    if (s.contains("exclusiveMinimum") && x <= s["exclusiveMinimum"].get<double>()) return false;
    if (s.contains("exclusiveMaximum") && x >= s["exclusiveMaximum"].get<double>()) return false;
  }
  if (v.is_array()) {
    const auto n = static_cast<int64_t>(v.size());
    if (s.contains("minItems") && n < s["minItems"].get<int64_t>()) return false;
    if (s.contains("maxItems") && n > s["maxItems"].get<int64_t>()) return false;
    if (s.contains("items")) {
      for (const json& item : v) {
        if (!valid(item, s["items"], root)) return false;
      }
    }
  }
  if (v.is_object()) {
    const json props = s.value("properties", json::object());
    if (s.contains("required")) {
      for (const json& name : s["required"]) {
        if (!v.contains(name.get<std::string>())) return false;
      }
    }
    for (const auto& [key, value] : v.items()) {
      if (props.contains(key)) {
        if (!valid(value, props[key], root)) return false;
      } else if (s.contains("additionalProperties")) {
        if (!valid(value, s["additionalProperties"], root)) return false;
      }
    }
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Random schemas and random instances of them.

// Patterns with strings that match them (the instance generator's, checked by the validator).
struct PatternCase {
  const char* pattern;
  std::vector<const char*> examples;
};
const std::vector<PatternCase>& pattern_cases() {
  static const std::vector<PatternCase> cases = {
      {"^[a-z]+[0-9]{2,3}$", {"abc12", "z999"}},
      {"^(cat|dog)s?$", {"cat", "dogs"}},
      {"[0-9]", {"a1b", "7"}},  // unanchored: a digit anywhere
      {"^\\d{3}-\\d{4}$", {"555-1234"}},
      {"^(?:[A-Z][a-z]*)( [A-Z][a-z]*)*$", {"Ann", "New York"}},
      {"^[^\"\\\\]{0,5}x$", {"x", "ab cx"}},
      {"^a|b$", {"ab", "xb", "a"}},
      {"^(\u00e9|\u4e2d)+\\.?$", {"\u00e9\u4e2d.", "\u4e2d"}},
      {"^[a-z_]+@[a-z]+\\.com$", {"a_b@cd.com"}},
      {"^$", {""}},
      {"^[\\u0041-\\u0043]{2}$", {"AB"}},
      {"^x{2,}y??$", {"xx", "xxxy"}},
      {"ab+c", {"zabbbcz"}},
      {"^\\$[1-9][0-9]*(\\.[0-9]{2})?$", {"$5", "$120.50"}},
  };
  return cases;
}

// Formats with strings of them.
const std::vector<std::pair<const char*, std::vector<const char*>>>& format_cases() {
  static const std::vector<std::pair<const char*, std::vector<const char*>>> cases = {
      {"date", {"2024-02-29", "1999-12-31", "0400-02-29", "2023-04-30"}},
      {"time", {"12:34:56Z", "23:59:59.5-01:00", "00:00:00.123456789+14:00"}},
      {"date-time", {"2024-01-01T00:00:00Z", "1970-06-30t23:59:59.123456+05:30"}},
      {"uuid", {"123e4567-e89b-12d3-a456-426614174000", "AAAAAAAA-BBBB-CCCC-DDDD-EEEEEEEEEEEE"}},
      {"ipv4", {"192.168.0.1", "0.0.0.0", "255.255.255.255"}},
      {"ipv6", {"::1", "2001:db8::ff00:42:8329", "::", "fe80::", "1:2:3:4:5:6:7:8"}},
      {"hostname", {"example.com", "a-b.c0", "localhost"}},
      {"email", {"john.doe+x@example.org", "a@b"}},
      {"uri", {"https://example.com/a?b=c#d", "urn:isbn:0451450523", "x:%20"}},
      {"color", {"red", "anything at all"}},  // unknown: an annotation
  };
  return cases;
}

class SchemaGen {
 public:
  explicit SchemaGen(uint64_t seed) : rng_(seed) {}

  json schema() {
    defs_ = json::object();
    json s = node(0);
    if (!defs_.empty()) s["$defs"] = defs_;
    return s;
  }

 private:
  int pick(int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng_); }
  bool coin(double p = 0.5) { return std::bernoulli_distribution(p)(rng_); }

  json scalar(int kind) {
    switch (kind) {
      case 0: {
        json s = {{"type", "string"}};
        if (coin(0.2)) {
          s["pattern"] = pattern_cases()[pick(pattern_cases().size())].pattern;
          return s;
        }
        if (coin(0.2)) {
          s["format"] = format_cases()[pick(format_cases().size())].first;
          return s;
        }
        if (coin(0.3)) s["maxLength"] = pick(12);
        if (coin(0.2)) s["minLength"] = std::min<int>(pick(4), s.value("maxLength", 99));
        return s;
      }
      case 1: {
        json s = {{"type", "integer"}};
        if (coin(0.4)) s["minimum"] = pick(200) - 100;
        if (coin(0.4)) s["maximum"] = s.value("minimum", -100) + pick(1000);
        if (coin(0.1)) s["exclusiveMaximum"] = s.value("maximum", 5000) + 1;
        return s;
      }
      case 2: {
        json s = {{"type", "number"}};
        if (coin(0.5)) {
          // Bounds on a grid of 1/4; instances on a grid of 1/8 (InstanceGen).
          const double lo = (pick(400) - 200) / 4.0, hi = lo + (1 + pick(400)) / 4.0;
          if (coin(0.7)) s[coin() ? "minimum" : "exclusiveMinimum"] = lo;
          if (coin(0.7)) s[coin() ? "maximum" : "exclusiveMaximum"] = hi;
        }
        if (coin(0.1)) {  // bounds off the binary grid
          s = {{"type", "number"}, {"minimum", coin() ? 0.1 : 0.001}};
          if (coin()) s["exclusiveMaximum"] = 2.3;
        }
        return s;
      }
      case 3:
        return {{"type", "boolean"}};
      case 4:
        return {{"type", "null"}};
      case 5: {
        const json pool = {"red", "green", "blue \"x\"", 3, -1.5, true, nullptr, "é中", 12, 1};
        json e = json::array();
        for (int i = 0, n = 1 + pick(4); i < n; ++i) e.push_back(pool[pick(pool.size())]);
        json s = {{"enum", e}};
        return s;
      }
      default: {
        const json pool = {"fixed", 7, json::array({1, 2}), json{{"k", "v"}}, false};
        return {{"const", pool[pick(pool.size())]}};
      }
    }
  }

  json node(int depth) {
    const int choice = depth >= 3 ? pick(7) : pick(13);
    if (choice < 7) return scalar(choice);
    switch (choice) {
      case 7:
      case 8: {  // object
        json s = {{"type", "object"}, {"properties", json::object()}};
        const char* names[] = {"name", "age", "tags", "a", "ab", "nested", "x y", "quote\"d", "ü"};
        json required = json::array();
        for (int i = 0, n = 1 + pick(5); i < n; ++i) {
          const std::string name = names[pick(9)];
          if (s["properties"].contains(name)) continue;
          s["properties"][name] = node(depth + 1);
          if (coin(0.6)) required.push_back(name);
        }
        if (!required.empty()) s["required"] = required;
        switch (pick(4)) {
          case 0:
            s["additionalProperties"] = false;
            break;
          case 1:
            s["additionalProperties"] = true;
            break;
          case 2:
            s["additionalProperties"] = scalar(pick(5));
            break;
          default:
            break;
        }
        return s;
      }
      case 9: {  // array
        json s = {{"type", "array"}, {"items", node(depth + 1)}};
        if (coin(0.4)) s["minItems"] = pick(3);
        if (coin(0.4)) s["maxItems"] = s.value("minItems", 0) + pick(4);
        return s;
      }
      case 10: {  // anyOf
        json alts = json::array();
        for (int i = 0, n = 2 + pick(2); i < n; ++i) alts.push_back(node(depth + 1));
        return {{"anyOf", alts}};
      }
      case 11: {  // oneOf of different types
        std::vector<int> kinds = {0, 1, 3, 4};
        std::shuffle(kinds.begin(), kinds.end(), rng_);
        json alts = json::array();
        for (int i = 0, n = 2 + pick(2); i < n; ++i) alts.push_back(scalar(kinds[i]));
        if (coin(0.5)) alts.push_back({{"type", "array"}, {"items", node(depth + 1)}});
        return {{"oneOf", alts}};
      }
      default: {  // a $ref to a definition
        const std::string name = "d" + std::to_string(defs_.size());
        defs_[name] = nullptr;  // the name is taken before its body draws more definitions
        defs_[name] = node(depth + 1);
        return {{"$ref", "#/$defs/" + name}};
      }
    }
  }

  std::mt19937_64 rng_;
  json defs_;
};

class InstanceGen {
 public:
  InstanceGen(const json& root, uint64_t seed) : root_(root), rng_(seed) {}

  json value(const json& s, int depth = 0) {
    if (s.is_boolean() || s.empty() || (s.size() == 1 && s.contains("$defs"))) {
      return any(depth);
    }
    if (s.contains("$ref")) return value(resolve(s["$ref"], root_), depth);
    if (s.contains("anyOf")) return value(s["anyOf"][pick(s["anyOf"].size())], depth);
    if (s.contains("oneOf")) return value(s["oneOf"][pick(s["oneOf"].size())], depth);
    if (s.contains("const")) return s["const"];
    if (s.contains("enum")) return s["enum"][pick(s["enum"].size())];
    const std::string type = s["type"].is_string()
                                 ? s["type"].get<std::string>()
                                 : s["type"][pick(s["type"].size())].get<std::string>();
    if (type == "null") return nullptr;
    if (type == "boolean") return coin();
    if (type == "integer") {
      int64_t lo = s.value("minimum", int64_t{-100000});
      int64_t hi = s.value("maximum", int64_t{100000});
      if (s.contains("exclusiveMaximum"))
        hi = std::min(hi, s["exclusiveMaximum"].get<int64_t>() - 1);
      return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
    }
    if (type == "number" && (s.contains("minimum") || s.contains("maximum") ||
                             s.contains("exclusiveMinimum") || s.contains("exclusiveMaximum"))) {
      double lo = -1000, hi = 1000;
      if (s.contains("minimum")) lo = std::max(lo, s["minimum"].get<double>());
      if (s.contains("exclusiveMinimum"))
        lo = std::max(lo, s["exclusiveMinimum"].get<double>() + 0.125);
      if (s.contains("maximum")) hi = std::min(hi, s["maximum"].get<double>());
      if (s.contains("exclusiveMaximum"))
        hi = std::min(hi, s["exclusiveMaximum"].get<double>() - 0.125);
      if (s.contains("minimum") && coin()) return s["minimum"];  // the bound itself
      if (s.contains("maximum") && coin()) return s["maximum"];
      const int64_t first = static_cast<int64_t>(std::ceil(lo * 8)),
                    last = static_cast<int64_t>(std::floor(hi * 8));
      return std::uniform_int_distribution<int64_t>(first, last)(rng_) / 8.0;
    }
    if (type == "string" && s.contains("pattern")) {
      for (const PatternCase& c : pattern_cases()) {
        if (c.pattern == s["pattern"]) return c.examples[pick(c.examples.size())];
      }
    }
    if (type == "string" && s.contains("format")) {
      for (const auto& [name, examples] : format_cases()) {
        if (name == s["format"]) return examples[pick(examples.size())];
      }
    }
    if (type == "number") {
      switch (pick(3)) {
        case 0:
          return pick(2000) - 1000;
        case 1:
          return (pick(20000) - 10000) / 8.0;
        default:
          return 1.5e10 * (coin() ? 1 : -1);
      }
    }
    if (type == "string") {
      const int64_t lo = s.value("minLength", 0);
      const int64_t hi = std::min<int64_t>(s.value("maxLength", 20), lo + 20);
      return text(std::uniform_int_distribution<int64_t>(lo, hi)(rng_));
    }
    if (type == "array") {
      const int64_t lo = s.value("minItems", 0);
      const int64_t hi = std::min<int64_t>(s.value("maxItems", 4), lo + 4);
      json a = json::array();
      for (int64_t i = 0, n = std::uniform_int_distribution<int64_t>(lo, hi)(rng_); i < n; ++i) {
        a.push_back(value(s.value("items", json::object()), depth + 1));
      }
      return a;
    }
    json o = json::object();
    const json props = s.value("properties", json::object());
    std::set<std::string> required;
    for (const json& r : s.value("required", json::array())) required.insert(r.get<std::string>());
    for (const auto& [key, sub] : props.items()) {
      if (required.count(key) || coin()) o[key] = value(sub, depth + 1);
    }
    const auto extra = s.find("additionalProperties");
    if (extra != s.end() && !(extra->is_boolean() && !extra->get<bool>())) {
      for (int i = 0, n = pick(3); i < n; ++i) {
        const std::string key = "extra" + std::to_string(pick(100));
        if (props.contains(key)) continue;
        o[key] = extra->is_boolean() ? any(depth + 1) : value(*extra, depth + 1);
      }
    }
    return o;
  }

 private:
  int pick(size_t n) {
    return std::uniform_int_distribution<int>(0, static_cast<int>(n) - 1)(rng_);
  }
  bool coin() { return std::bernoulli_distribution(0.5)(rng_); }

  std::string text(int64_t n) {
    static const char* const kPieces[] = {"a", "b",  "Z", " ",    "\"", "\\", "\n", "\t", "/",
                                          "é", "中", "😀", "\x01", "{",  "}",  ":",  ","};
    std::string s;
    for (int64_t i = 0; i < n; ++i) s += kPieces[pick(std::size(kPieces))];
    return s;
  }

  json any(int depth) {
    switch (depth > 2 ? pick(4) : pick(6)) {
      case 0:
        return text(pick(6));
      case 1:
        return pick(100);
      case 2:
        return coin();
      case 3:
        return nullptr;
      case 4: {
        json a = json::array();
        for (int i = 0, n = pick(3); i < n; ++i) a.push_back(any(depth + 1));
        return a;
      }
      default: {
        json o = json::object();
        for (int i = 0, n = pick(3); i < n; ++i) o["k" + std::to_string(i)] = any(depth + 1);
        return o;
      }
    }
  }

  const json& root_;
  std::mt19937_64 rng_;
};

// Feeds `text` to a fresh matcher; whether it took every byte and ends complete.
bool accepts(const std::shared_ptr<const JsonGrammar>& g, const std::string& text) {
  JsonMatcher m(g);
  return m.advance(text) && m.can_finish();
}

std::string describe(const json& schema, const std::string& text) {
  return "schema " + schema.dump() + "\ntext " + text;
}

// ---------------------------------------------------------------------------------------------

TEST(JsonSchemaGrammar, HandWrittenSchemasTakeTheirInstances) {
  const json person = json::parse(R"({
    "type": "object",
    "properties": {
      "name": {"type": "string", "maxLength": 20},
      "age": {"type": "integer", "minimum": 0, "maximum": 150},
      "email": {"type": ["string", "null"]},
      "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
      "address": {"$ref": "#/$defs/address"}
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": false,
    "$defs": {"address": {"type": "object", "properties": {"city": {"type": "string"},
              "zip": {"type": "string", "minLength": 5, "maxLength": 5}}, "required": ["city"]}}
  })");
  const auto g = JsonGrammar::from_schema(person);
  EXPECT_TRUE(accepts(g, R"({"name":"Ann","age":41,"tags":["a"]})"));
  EXPECT_TRUE(accepts(g, R"({ "tags": ["b", "c"], "age": 0, "name": "", "email": null })"));
  EXPECT_TRUE(accepts(
      g, R"({"name":"B","age":150,"tags":["a","a","a"],"address":{"city":"X","zip":"12345"}})"));
  EXPECT_FALSE(accepts(g, R"({"name":"Ann","age":41})"));                          // tags required
  EXPECT_FALSE(accepts(g, R"({"name":"Ann","age":151,"tags":["a"]})"));            // maximum
  EXPECT_FALSE(accepts(g, R"({"name":"Ann","age":-1,"tags":["a"]})"));             // minimum
  EXPECT_FALSE(accepts(g, R"({"name":"Ann","age":4.5,"tags":["a"]})"));            // integer
  EXPECT_FALSE(accepts(g, R"({"name":"Ann","age":1,"tags":[]})"));                 // minItems
  EXPECT_FALSE(accepts(g, R"({"name":"Ann","age":1,"tags":["a","b","c","a"]})"));  // maxItems
  EXPECT_FALSE(accepts(g, R"({"name":"Ann","age":1,"tags":["d"]})"));              // enum
  EXPECT_FALSE(accepts(g, R"({"name":"Ann","age":1,"tags":["a"],"x":1})"));        // additional
  EXPECT_FALSE(accepts(g, R"({"name":"Ann","name":"B","age":1,"tags":["a"]})"));   // repeated
  EXPECT_FALSE(accepts(g, R"({"name":"Ann","age":01,"tags":["a"]})"));             // leading zero
  EXPECT_FALSE(
      accepts(g, R"({"name":"B","age":1,"tags":["a"],"address":{"city":"X","zip":"123"}})"));
  EXPECT_FALSE(accepts(g, R"({"name":"B","age":1,"tags":["a"],"address":{}})"));
  EXPECT_FALSE(accepts(g, "{\"name\":\"a\x01\",\"age\":1,\"tags\":[\"a\"]}"));  // control
  EXPECT_FALSE(accepts(g, std::string(R"({"name":"abcdefghijklmnopqrstu","age":1,"tags":["a"]})")));

  // Strings: escapes, UTF-8 checked byte by byte, no surrogate escapes.
  const auto s = JsonGrammar::from_schema({{"type", "string"}, {"maxLength", 3}});
  EXPECT_TRUE(accepts(s, R"("\n\u00e9\"")"));
  EXPECT_TRUE(accepts(s, "\"中😀é\""));
  EXPECT_FALSE(accepts(s, "\"中😀éa\""));
  EXPECT_FALSE(accepts(s, R"("\ud83d")"));
  EXPECT_FALSE(accepts(s, "\"\xC0\xAF\""));      // overlong
  EXPECT_FALSE(accepts(s, "\"\xED\xA0\x80\""));  // a surrogate in UTF-8
  EXPECT_FALSE(accepts(s, R"("\x")"));

  // Numbers: the JSON grammar.
  const auto num = JsonGrammar::from_schema({{"type", "number"}});
  for (const char* ok : {"0", "-0", "1.5", "-12.25e+3", "3E7", "0.001"}) {
    EXPECT_TRUE(accepts(num, ok)) << ok;
  }
  for (const char* bad : {"01", "1.", ".5", "-", "1e", "+1", "1.5.2", "NaN"}) {
    EXPECT_FALSE(accepts(num, bad)) << bad;
  }

  // anyOf of objects that share a prefix of keys; oneOf told apart by a const discriminator.
  const auto any_of = JsonGrammar::from_schema(json::parse(R"({"anyOf": [
    {"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}},
     "required": ["kind", "x"]},
    {"type": "object", "properties": {"kind": {"const": "b"}, "y": {"type": "string"}},
     "required": ["kind"]}]})"));
  EXPECT_TRUE(accepts(any_of, R"({"kind":"a","x":3})"));
  EXPECT_TRUE(accepts(any_of, R"({"kind":"b"})"));
  EXPECT_FALSE(accepts(any_of, R"({"kind":"a"})"));
  EXPECT_FALSE(accepts(any_of, R"({"kind":"b","x":3})"));
  const auto one_of = JsonGrammar::from_schema(json::parse(R"({"oneOf": [
    {"type": "object", "properties": {"kind": {"const": "a"}}, "required": ["kind"],
     "additionalProperties": true},
    {"type": "object", "properties": {"kind": {"const": "b"}}, "required": ["kind"]}]})"));
  EXPECT_TRUE(accepts(one_of, R"({"kind":"a","z":[1,{}]})"));

  // A recursive schema: a tree through $ref.
  const auto tree = JsonGrammar::from_schema(json::parse(R"({"$ref": "#/$defs/node", "$defs":
    {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "children":
     {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v"]}}})"));
  EXPECT_TRUE(accepts(tree, R"({"v":1,"children":[{"v":2},{"v":3,"children":[{"v":4}]}]})"));
  EXPECT_FALSE(accepts(tree, R"({"v":1,"children":[{}]})"));

  // json_object: any object, nothing after it, whitespace runs bounded.
  const auto obj = JsonGrammar::any_object();
  EXPECT_TRUE(accepts(obj, R"( {"a": [1, {"b": null}], "c": "d", "e": -1.5e3, "f": true})"));
  EXPECT_FALSE(accepts(obj, "[1]"));
  EXPECT_FALSE(accepts(obj, "{} "));
  const std::string indent(json_grammar::kMaxIndent, ' ');
  EXPECT_TRUE(accepts(obj, "{ }"));
  EXPECT_FALSE(accepts(obj, "{  }"));
  EXPECT_TRUE(accepts(obj, "{\t\n" + indent + "}"));
  EXPECT_FALSE(accepts(obj, "{\n" + indent + " }"));
  EXPECT_FALSE(accepts(obj, "{\n\n}"));
  EXPECT_FALSE(accepts(obj, "{\r\n}"));
  JsonMatcher m(obj);
  ASSERT_TRUE(m.advance("{}"));
  EXPECT_TRUE(m.closed());
  JsonMatcher n(num);
  ASSERT_TRUE(n.advance("12"));
  EXPECT_TRUE(n.can_finish());
  EXPECT_FALSE(n.closed());  // more digits may follow
}

TEST(JsonSchemaGrammar, RefusesWhatItCannotFollow) {
  const std::vector<std::pair<const char*, const char*>> cases = {
      {R"j({"type": "string", "pattern": "(a)\\1"})j", "backreferences"},
      {R"j({"type": "string", "pattern": "(?<n>a)\\k<n>"})j", "backreferences"},
      {R"j({"type": "string", "pattern": "a(?=b)"})j", "lookahead"},
      {R"j({"type": "string", "pattern": "(?!b)a"})j", "lookahead"},
      {R"j({"type": "string", "pattern": "(?<=b)a"})j", "lookbehind"},
      {R"j({"type": "string", "pattern": "\\bword"})j", "word boundary"},
      {R"j({"type": "string", "pattern": "\\p{L}"})j", "Unicode property"},
      {R"j({"type": "string", "pattern": "a^b"})j", "'^'"},
      {R"j({"type": "string", "pattern": "(a$)"})j", "'$'"},
      {R"j({"type": "string", "pattern": "a{2000}"})j", "1000"},
      {R"j({"type": "string", "pattern": "(a{1000}){1000}"})j", "too large"},
      {R"j({"type": "string", "pattern": "[a-z"})j", "unclosed"},
      {R"j({"type": "string", "pattern": "(a"})j", "unclosed"},
      {R"j({"type": "string", "pattern": "a)"})j", "unmatched"},
      {R"j({"type": "string", "pattern": "*a"})j", "nothing to repeat"},
      {R"j({"type": "string", "pattern": "[z-a]"})j", "out of order"},
      {R"j({"type": "string", "pattern": "[^\\s\\S]"})j", "matches no string"},
      {R"j({"type": "string", "pattern": "^[]$"})j", "matches no string"},
      {R"j({"type": "string", "pattern": "^(a|b)*a(a|b){12}$"})j", "states"},
      {R"j({"type": "string", "pattern": 7})j", "pattern"},
      {R"j({"type": "string", "pattern": "^[0-9]{4}$", "maxLength": 3})j", "allowed length"},
      {R"j({"type": "string", "pattern": "^[a-z]+$", "format": "date"})j", "pattern and format"},
      {R"j({"type": "string", "format": "date", "minLength": 11})j", "allowed length"},
      {R"j({"type": "number", "minimum": 5, "maximum": 4})j", "no number between"},
      {R"j({"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 1})j", "no number"},
      {R"j({"type": "number", "minimum": 1e20})j", "minimum"},
      {R"j({"type": "number", "maximum": "3"})j", "maximum"},
      {R"j({"type": "integer", "multipleOf": 2})j", "multipleOf"},
      {R"j({"type": "object", "patternProperties": {}})j", "patternProperties"},
      {R"j({"type": "array", "prefixItems": []})j", "prefixItems"},
      {R"j({"type": "array", "uniqueItems": true})j", "uniqueItems"},
      {R"j({"allOf": [{"type": "string"}, {"maxLength": 2}]})j", "allOf"},
      {R"j({"not": {"type": "string"}})j", "not"},
      {R"j({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 2}]})j", "oneOf"},
      {R"j({"oneOf": [{"type": "integer"}, {"type": "number"}]})j", "oneOf"},
      {R"j({"$ref": "#/$defs/missing"})j", "missing"},
      {R"j({"$ref": "https://example.com/s.json"})j", "$ref"},
      {R"j({"type": "strange"})j", "strange"},
      {R"j({"enum": ["a"], "maxLength": 3})j", "maxLength"},
      {R"j({"type": "object", "required": ["a"]})j", "'a'"},
      {R"j({"type": "string", "minLength": 3, "maxLength": 2})j", "minLength"},
      {"false", "false"},
  };
  // Patterns that take too long to compile, alone or together in one schema.
  const json heavy = {{"type", "string"}, {"pattern", "^(.{1,100}){1,10}$"}};
  EXPECT_NO_THROW(JsonGrammar::from_schema(heavy));
  try {
    json props = json::object();
    for (int i = 0; i < 8; ++i) props["p" + std::to_string(i)] = heavy;
    JsonGrammar::from_schema({{"type", "object"}, {"properties", props}});
    ADD_FAILURE() << "eight heavy patterns compiled";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("with the schema's others"), std::string::npos)
        << e.what();
  }
  try {
    JsonGrammar::from_schema({{"type", "string"}, {"pattern", "(a?){1000}a{1000}"}});
    ADD_FAILURE() << "a pattern of a billion steps compiled";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("steps to compile"), std::string::npos) << e.what();
  }
  try {  // length tables come out of the same budget: 4001 states x 4001 lengths each
    json props = json::object();
    for (int i = 0; i < 8; ++i) {
      props["p" + std::to_string(i)] = {
          {"type", "string"}, {"pattern", "^([ab]{1000}){4}$"}, {"maxLength", 4095}};
    }
    JsonGrammar::from_schema({{"type", "object"}, {"properties", props}});
    ADD_FAILURE() << "eight large length tables built";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("too many steps"), std::string::npos) << e.what();
  }
  // Deeply nested groups are refused before the parser's recursion gets deep.
  EXPECT_THROW(JsonGrammar::from_schema(
                   {{"type", "string"},
                    {"pattern", std::string(100000, '(') + "a" + std::string(100000, ')')}}),
               Error);
  for (const auto& [schema, word] : cases) {
    try {
      JsonGrammar::from_schema(json::parse(schema));
      ADD_FAILURE() << "accepted " << schema;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << schema << ": " << e.what();
    }
  }
  // Annotations and uniqueItems false are fine.
  EXPECT_NO_THROW(JsonGrammar::from_schema(json::parse(
      R"({"title": "t", "description": "d", "type": "array", "uniqueItems": false,
          "items": {"type": "string", "default": "x", "examples": ["y"]}})")));
}

std::vector<std::string> test_vocabulary(uint64_t seed);

TEST(JsonSchemaGrammar, PatternsFollowEcmaScriptAsJsonSchemaMeansIt) {
  const auto str = [](const std::string& pattern) {
    return JsonGrammar::from_schema({{"type", "string"}, {"pattern", pattern}});
  };
  const auto quoted = [](const std::string& text) { return json(text).dump(); };
  // Each text is a JSON string's body, escapes and all; it is fed as written and as
  // nlohmann::json writes the decoded string (raw UTF-8, its own escapes).
  struct Case {
    const char* pattern;
    std::vector<std::string> yes, no;
  };
  const std::vector<Case> cases = {
      {"abc", {"abc", "xxabcyy"}, {"ab", "acb"}},  // anywhere, unless anchored
      {"^abc$", {"abc"}, {"xabc", "abcx"}},
      {"^a|b$", {"a", "ax", "xb"}, {"xa", "bx"}},
      {"^(a|b)$", {"a", "b"}, {"ab", "xb"}},
      {"^[^a-c]$", {"d", "\\n", "\\u00e9"}, {"a", "c", ""}},
      {"^.$", {"a", "\\u00e9", "\\t"}, {"\\n", "\\r", "\\u2028", ""}},
      {"^\\s+$", {" ", "\\t\\n", "\\u00a0\\ufeff", "\\u3000"}, {"a", ""}},
      {"^\\S$", {"a"}, {" ", "\\u00a0"}},
      {"^\\w\\W\\d\\D$", {"a-1x", "_ 9-"}, {"\\u00e9-1x", "a-\\u0661x"}},
      {"^a{2,3}$", {"aa", "aaa"}, {"a", "aaaa"}},
      {"^a{2}$", {"aa"}, {"aaa"}},
      {"^a{2,}$", {"aa", "aaaaaaa"}, {"a"}},
      {"^(ab)+?c*?$", {"ab", "ababcc"}, {"abb", "c"}},
      {"^x{1,2}{$", {"x{"}, {"x"}},  // a '{' that is no quantifier is a literal
      {"^\\x41\\u0042\\.\\t\\cJ$", {"AB.\\t\\n"}, {"AB,\\t\\n"}},
      {"^[\\d.-]+$", {"1.5", "-2"}, {"a"}},
      {"^(?<year>[0-9]{4})-[0-9]{2}$", {"2024-07"}, {"24-07"}},  // a named group
      {"^[^]$", {"a", "\\n"}, {""}},
      {"^\\ud83d\\ude00$", {"\xF0\x9F\x98\x80"}, {"a"}},  // a surrogate pair: one code point
      {"^[\\u4e00-\\u9fff]{2}$", {"\\u4e2d\\u6587", "\xE4\xB8\xAD\\u6587"}, {"\\u4e2d"}},
  };
  for (const Case& c : cases) {
    std::shared_ptr<const JsonGrammar> g;
    ASSERT_NO_THROW(g = str(c.pattern)) << c.pattern;
    for (const std::string& text : c.yes) {
      const std::string decoded = json::parse("\"" + text + "\"").get<std::string>();
      EXPECT_TRUE(accepts(g, "\"" + text + "\"")) << c.pattern << " should take " << text;
      EXPECT_TRUE(accepts(g, quoted(decoded))) << c.pattern << " should take " << text;
    }
    for (const std::string& text : c.no) {
      const std::string decoded = json::parse("\"" + text + "\"").get<std::string>();
      EXPECT_FALSE(accepts(g, "\"" + text + "\"")) << c.pattern << " should refuse " << text;
      EXPECT_FALSE(accepts(g, quoted(decoded))) << c.pattern << " should refuse " << text;
    }
  }
  // With a length bound: the automaton and the count together, never a dead end.
  const auto both = JsonGrammar::from_schema(
      {{"type", "string"}, {"pattern", "^(ab)+$"}, {"minLength", 3}, {"maxLength", 6}});
  EXPECT_TRUE(accepts(both, "\"abab\""));
  EXPECT_TRUE(accepts(both, "\"ababab\""));
  EXPECT_FALSE(accepts(both, "\"ab\""));
  EXPECT_FALSE(accepts(both, "\"abababab\""));
  JsonMatcher m(both);
  ASSERT_TRUE(m.advance("\"ababa"));
  EXPECT_FALSE(m.advance("\""));
  EXPECT_TRUE(m.advance("b\""));
}

TEST(JsonSchemaGrammar, FormatsTakeTheirStringsOnly) {
  const std::vector<std::pair<const char*, std::vector<const char*>>> refused = {
      {"date", {"2023-02-29", "1900-02-29", "0000-01-01", "2024-13-01", "2024-04-31", "24-01-01"}},
      {"time", {"24:00:00Z", "12:60:00Z", "12:00:60Z", "12:00:00", "12:00:00+1:00", "12:00:00.Z"}},
      {"date-time", {"2024-01-01 00:00:00Z", "2024-01-01T00:00Z"}},
      {"uuid", {"123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400g"}},
      {"ipv4", {"256.1.1.1", "01.2.3.4", "1.2.3", "1.2.3.4.5"}},
      {"ipv6", {"1:2:3:4:5:6:7:8:9", "1::2::3", ":1", "12345::", "g::"}},
      {"hostname", {"-a.com", "a-.com", "a..b", "", "a_b"}},
      {"email", {"@example.com", "a@", "a..b@c", "a b@c"}},
      {"uri", {"example.com", "1http://x", "http:", "http://a b", "x:%2"}},
  };
  for (const auto& [format, examples] : format_cases()) {
    const auto g = JsonGrammar::from_schema({{"type", "string"}, {"format", format}});
    for (const char* e : examples) {
      EXPECT_TRUE(valid_format(format, e)) << "test bug: " << format << " " << e;
      EXPECT_TRUE(accepts(g, json(e).dump())) << format << " should take " << e;
    }
  }
  for (const auto& [format, examples] : refused) {
    const auto g = JsonGrammar::from_schema({{"type", "string"}, {"format", format}});
    for (const char* e : examples) {
      EXPECT_FALSE(valid_format(format, e)) << "test bug: " << format << " " << e;
      EXPECT_FALSE(accepts(g, json(e).dump())) << format << " should refuse " << e;
    }
  }
  // A host name of 253 characters at most; format and pattern together; format on a
  // non-string type is an annotation (JSON Schema applies it to strings only).
  const auto host = JsonGrammar::from_schema({{"type", "string"}, {"format", "hostname"}});
  std::string long_name;  // five labels of 49 letters and their dots: 250 characters
  while (long_name.size() < 250) long_name += std::string(49, 'a') + ".";
  EXPECT_TRUE(accepts(host, "\"" + long_name + "abc\""));  // 253
  EXPECT_FALSE(accepts(host, "\"" + long_name + "abcd\""));
  const auto ymd =
      JsonGrammar::from_schema({{"type", "string"}, {"format", "date"}, {"pattern", "^2024-"}});
  EXPECT_TRUE(accepts(ymd, "\"2024-05-06\""));
  EXPECT_FALSE(accepts(ymd, "\"2023-05-06\""));
  EXPECT_TRUE(accepts(JsonGrammar::from_schema({{"type", "integer"}, {"format", "int32"}}), "12"));
}

TEST(JsonSchemaGrammar, NumberBoundsAreExact) {
  const auto range = JsonGrammar::from_schema(
      json::parse(R"({"type": "number", "minimum": -1.5, "exclusiveMaximum": 2.25})"));
  // 2.2499999999999996 is the double below 2.25; 2.2499999999999999 reads back as 2.25.
  for (const char* ok : {"-1.5", "-1.25", "0", "-0", "2.2499999999999996", "2.24", "1"}) {
    EXPECT_TRUE(accepts(range, ok)) << ok;
  }
  for (const char* bad :
       {"-1.50001", "2.25", "2.250", "2.2499999999999999", "3", "-2", "1e0", "0.1e1", "-"}) {
    EXPECT_FALSE(accepts(range, bad)) << bad;
  }
  // The bound as written: minimum 0.1 takes "0.1" (which reads back as the bound itself).
  const auto tenth = JsonGrammar::from_schema(json::parse(R"({"type": "number", "minimum": 0.1,
                                                               "maximum": 0.3})"));
  EXPECT_TRUE(accepts(tenth, "0.1"));
  EXPECT_TRUE(accepts(tenth, "0.3"));
  EXPECT_TRUE(accepts(tenth, "0.2999999999999999"));
  EXPECT_FALSE(accepts(tenth, "0.0999999999999999"));
  EXPECT_FALSE(accepts(tenth, "0.30000000000000001"));  // 17 fraction digits: too many anyway
  EXPECT_FALSE(accepts(tenth, "0.3000000000000001"));
  // exclusiveMinimum 0: the smallest number written is 1e-16.
  const auto positive =
      JsonGrammar::from_schema(json::parse(R"({"type": "number", "exclusiveMinimum": 0})"));
  EXPECT_TRUE(accepts(positive, "0.0000000000000001"));
  EXPECT_TRUE(accepts(positive, "123456789012345678.9"));
  EXPECT_FALSE(accepts(positive, "0"));
  EXPECT_FALSE(accepts(positive, "0.0"));
  EXPECT_FALSE(accepts(positive, "-0.5"));
  EXPECT_FALSE(accepts(positive, "1234567890123456789.5"));  // 20 digits
  // A prefix is taken only while some ending stays in the range: after "1" with maximum 1.5
  // the digits 6-9 are gone but "1.4" and "1" are not.
  const auto narrow = JsonGrammar::from_schema(
      json::parse(R"({"type": "number", "minimum": 1.25, "maximum": 1.5})"));
  JsonMatcher m(narrow);
  ASSERT_TRUE(m.advance("1."));
  EXPECT_FALSE(m.can_finish());
  JsonMatcher copy = m;
  EXPECT_FALSE(copy.advance("6"));
  EXPECT_FALSE(copy.advance("1"));
  EXPECT_TRUE(copy.advance("2"));
  EXPECT_FALSE(copy.can_finish());  // 1.2 < 1.25
  EXPECT_TRUE(copy.advance("5"));
  EXPECT_TRUE(copy.can_finish());
  EXPECT_FALSE(JsonMatcher(narrow).advance("2"));
  EXPECT_FALSE(JsonMatcher(narrow).advance("-"));
}

// Random token choices under the mask inside strings with a pattern or a format (and a length
// bound): never a dead end, and every finished string validates.
TEST(JsonSchemaGrammar, PatternStringsUnderTheMaskEndValid) {
  const std::vector<std::string> vocab = test_vocabulary(7);
  const TokenTrie trie(vocab);
  std::vector<json> schemas;
  for (const PatternCase& c : pattern_cases()) {
    schemas.push_back({{"type", "string"}, {"pattern", c.pattern}});
  }
  for (const auto& [format, examples] : format_cases()) {
    schemas.push_back({{"type", "string"}, {"format", format}});
  }
  schemas.push_back(
      {{"type", "string"}, {"pattern", "^[a-c]*x?$"}, {"minLength", 2}, {"maxLength", 5}});
  schemas.push_back({{"type", "string"}, {"format", "email"}, {"maxLength", 12}});
  schemas.push_back({{"type", "string"}, {"pattern", "[0-9]"}, {"maxLength", 3}});
  int finished = 0;
  for (size_t k = 0; k < schemas.size(); ++k) {
    const auto g = JsonGrammar::from_schema(schemas[k]);
    for (uint64_t seed = 0; seed < 40; ++seed) {
      std::mt19937_64 rng(seed * 131 + k);
      JsonMatcher m(g);
      std::vector<uint8_t> allowed(trie.vocab_size());
      std::string text;
      for (int step = 0; step < 400 && !m.closed(); ++step) {
        m.allowed_tokens(trie, allowed);
        if (seed < 3) {
          for (int64_t t = 1; t < trie.vocab_size(); ++t) {
            JsonMatcher copy = m;
            ASSERT_EQ(allowed[t] != 0, copy.advance(vocab[t]))
                << "token '" << vocab[t] << "' after " << describe(schemas[k], text);
          }
        }
        std::vector<int32_t> candidates;
        for (int64_t t = 1; t < trie.vocab_size(); ++t) {
          if (allowed[t]) candidates.push_back(static_cast<int32_t>(t));
        }
        ASSERT_FALSE(candidates.empty()) << "dead end: " << describe(schemas[k], text);
        int32_t token = candidates[rng() % candidates.size()];
        if (text.size() > 20 || std::bernoulli_distribution(0.1)(rng)) {
          // Towards the end: the closing quote when it can come, else a token after which it can.
          constexpr int32_t kQuote = '"';
          if (allowed[kQuote]) {
            token = kQuote;
          } else {
            std::shuffle(candidates.begin(), candidates.end(), rng);
            for (size_t i = 0; i < candidates.size() && i < 64; ++i) {
              JsonMatcher copy = m;
              if (copy.advance(vocab[candidates[i]]) && copy.advance("\"")) {
                token = candidates[i];
                break;
              }
            }
          }
        }
        ASSERT_TRUE(m.advance(vocab[token]));
        text += vocab[token];
      }
      ASSERT_TRUE(m.closed()) << "not closed in 400 steps: " << describe(schemas[k], text);
      ++finished;
      json parsed;
      ASSERT_NO_THROW(parsed = json::parse(text)) << describe(schemas[k], text);
      EXPECT_TRUE(valid(parsed, schemas[k], schemas[k])) << describe(schemas[k], text);
    }
  }
  std::printf("%d strings finished under the mask, all validated\n", finished);
}

TEST(JsonSchemaGrammar, RandomSchemasTakeRandomInstancesAndRefuseBrokenOnes) {
  int checked = 0, mutants_accepted = 0;
  for (uint64_t seed = 0; seed < 400; ++seed) {
    SchemaGen gen(seed);
    const json schema = gen.schema();
    std::shared_ptr<const JsonGrammar> g;
    try {
      g = JsonGrammar::from_schema(schema);
    } catch (const Error& e) {
      FAIL() << "seed " << seed << ": " << e.what() << "\n" << schema.dump();
    }
    InstanceGen instances(schema, seed * 7919 + 1);
    std::mt19937_64 rng(seed);
    for (int i = 0; i < 8; ++i) {
      const json v = instances.value(schema);
      ASSERT_TRUE(valid(v, schema, schema)) << "generator bug: " << describe(schema, v.dump());
      for (const std::string& text : {v.dump(), v.dump(1), v.dump(1, '\t')}) {
        EXPECT_TRUE(accepts(g, text)) << "seed " << seed << ": " << describe(schema, text);
        ++checked;
        // A one-byte change the matcher takes to completion must still be valid.
        std::string mutant = text;
        const size_t at = std::uniform_int_distribution<size_t>(0, text.size() - 1)(rng);
        const char pool[] = "{}[]\",:0123456789-.eE tfn\\a\x01";
        mutant[at] = pool[std::uniform_int_distribution<size_t>(0, sizeof(pool) - 2)(rng)];
        if (accepts(g, mutant)) {
          ++mutants_accepted;
          json parsed;
          ASSERT_NO_THROW(parsed = json::parse(mutant)) << describe(schema, mutant);
          EXPECT_TRUE(valid(parsed, schema, schema))
              << "seed " << seed << ": " << describe(schema, mutant);
        }
      }
    }
  }
  std::printf("instances accepted: %d, valid mutants accepted: %d\n", checked, mutants_accepted);
}

// A vocabulary of every single byte and JSON-ish pieces, token 0 being end-of-sequence.
std::vector<std::string> test_vocabulary(uint64_t seed) {
  std::vector<std::string> v = {""};
  for (int b = 1; b < 256; ++b) v.emplace_back(1, static_cast<char>(b));
  const std::vector<std::string> pieces = {
      "{\"",        "\"}",      "\":",       "\",",  "\", \"", "\": \"", "\": ",   ", \"",
      "true",       "false",    "null",      "tr",   "ue",     "12",     "-3",     ".5",
      "e+",         "00",       "  ",        "\n  ", "\n",     "[]",     "{}",     "[{",
      "}]",         "\"name\"", "\"name\":", "name", "age",    "tags",   "nested", "\"a\"",
      "ab",         "x y",      "quote",     "\\\"", "\\n",    "\\u00",  "\\u",    "é",
      "中文",       "\xE4\xB8", "\xAD",      "😀",    " the",   "red",    "green",  "blue",
      "fixed",      "\"red\"",  "\"fixed\"", "1,",   "],",     "},",     "\"]",    "7",
      "\"k\":\"v\""};
  v.insert(v.end(), pieces.begin(), pieces.end());
  std::mt19937_64 rng(seed);
  const std::string alphabet = "abcxyz \"{}[]:,0123456789.-\\";
  for (int i = 0; i < 300; ++i) {
    std::string t;
    for (int k = 0, n = 2 + static_cast<int>(rng() % 5); k < n; ++k)
      t += alphabet[rng() % alphabet.size()];
    v.push_back(t);
  }
  return v;
}

bool closes_something(const std::string& bytes) {
  return bytes.find_first_of("\"]}") != std::string::npos;
}

TEST(JsonSchemaGrammar, RandomTokensUnderTheMaskGiveValidJson) {
  const std::vector<std::string> vocab = test_vocabulary(1);
  const TokenTrie trie(vocab);
  const int64_t V = trie.vocab_size();
  int finished = 0, cut = 0;
  for (uint64_t seed = 0; seed < 300; ++seed) {
    SchemaGen gen(seed + 1000);
    const json schema = seed % 10 == 0 ? json::object() : gen.schema();
    const auto g = seed % 10 == 0 ? JsonGrammar::any_object() : JsonGrammar::from_schema(schema);
    JsonMatcher m(g);
    std::mt19937_64 rng(seed);
    std::vector<uint8_t> allowed(V);
    std::string text;
    bool done = false;
    for (int step = 0; step < 300 && !done; ++step) {
      m.allowed_tokens(trie, allowed);
      if (seed < 25) {  // the trie walk against every token tried alone
        for (int64_t t = 1; t < V; ++t) {
          JsonMatcher copy = m;
          ASSERT_EQ(allowed[t] != 0, copy.advance(vocab[t]))
              << "seed " << seed << " token '" << vocab[t] << "' after " << describe(schema, text);
        }
      }
      std::vector<int32_t> candidates, closers;
      for (int64_t t = 1; t < V; ++t) {
        if (!allowed[t]) continue;
        candidates.push_back(static_cast<int32_t>(t));
        if (closes_something(vocab[t])) closers.push_back(static_cast<int32_t>(t));
      }
      const bool late = text.size() > 80;
      if (m.can_finish() &&
          (candidates.empty() || std::bernoulli_distribution(late ? 0.9 : 0.3)(rng))) {
        done = true;
        break;
      }
      ASSERT_FALSE(candidates.empty()) << "dead end: " << describe(schema, text);
      const std::vector<int32_t>& from =
          late && !closers.empty() && std::bernoulli_distribution(0.8)(rng) ? closers : candidates;
      const int32_t token = from[rng() % from.size()];
      ASSERT_TRUE(m.advance(vocab[token]));
      text += vocab[token];
      done = m.closed();
    }
    if (!done) {
      ++cut;
      continue;
    }
    ++finished;
    json parsed;
    ASSERT_NO_THROW(parsed = json::parse(text))
        << "seed " << seed << ": " << describe(schema, text);
    if (seed % 10 == 0) {
      EXPECT_TRUE(parsed.is_object()) << text;
    } else {
      EXPECT_TRUE(valid(parsed, schema, schema))
          << "seed " << seed << ": " << describe(schema, text);
    }
  }
  std::printf("finished %d, cut at the step limit %d\n", finished, cut);
  EXPECT_GT(finished, 250);
}

TEST(JsonSchemaGrammar, TokenBytesConcatenateToTheDecodedText) {
  const std::filesystem::path dir = std::filesystem::path(MOE_FIXTURES_DIR) / "tokenizers";
  const std::vector<std::string> texts = {"{\"name\": \"Ann\", \"age\": 41}", "  x = [1, 2.5e3]",
                                          "héllo 中文 😀 \"q\"\n\ttab", "a"};
  for (const char* name : {"gpt2_bytelevel", "qwen2_bytelevel", "mixtral_metaspace",
                           "mixtral_legacy", "t5_metaspace"}) {
    const Tokenizer tok = Tokenizer::from_file(dir / name / "tokenizer.json");
    const std::vector<std::string> bytes = tok.token_bytes();
    ASSERT_EQ(static_cast<int64_t>(bytes.size()), tok.vocab_size());
    for (const std::string& text : texts) {
      const std::vector<int32_t> ids = tok.encode(text, false);
      std::string joined;
      for (int32_t id : ids) joined += bytes[id];
      const std::string decoded = tok.decode(ids, true);
      // At the start of a text a decoder may drop the first token's leading space.
      EXPECT_TRUE(joined == decoded || joined == " " + decoded)
          << name << ": '" << joined << "' vs '" << decoded << "'";
    }
  }
}

void print_mask_costs(const char* name, const TokenTrie& trie);

TEST(JsonSchemaGrammar, MaskCostOnALargeVocabulary) {
  // 150k tokens shaped like a BPE vocabulary: words with and without a leading space, digits,
  // punctuation runs, CJK, every single byte.
  std::mt19937_64 rng(5);
  std::vector<std::string> vocab = {""};
  for (int b = 1; b < 256; ++b) vocab.emplace_back(1, static_cast<char>(b));
  const std::string letters = "etaoinshrdlucmfwypvbgkjqxz";
  const std::vector<std::string> punct = {"\"", "\":", "\",",  "{\"", "\"}", ",", ".",
                                          ":",  "(",   ")",    "[",   "]",   "{", "}",
                                          "\n", "  ",  "\n\n", "'",   "-"};
  while (vocab.size() < 150000) {
    std::string t;
    switch (rng() % 6) {
      case 0:
        t = std::to_string(rng() % 1000);
        break;
      case 1:
        t = punct[rng() % punct.size()] + punct[rng() % punct.size()];
        break;
      case 2:
        t = "\xE4" + std::string(1, static_cast<char>(0xB8 + rng() % 8)) +
            std::string(1, static_cast<char>(0x80 + rng() % 64));
        break;
      default: {
        if (rng() % 2) t = " ";
        for (int k = 0, n = 1 + static_cast<int>(rng() % 9); k < n; ++k) {
          t += letters[std::min<size_t>(rng() % letters.size(), rng() % letters.size())];
        }
      }
    }
    vocab.push_back(t);
  }
  const Tokenizer demo = Tokenizer::from_file(std::filesystem::path(MOE_FIXTURES_DIR) / ".." /
                                              ".." / "models" / "demo" / "tokenizer.json");
  print_mask_costs("synthetic", TokenTrie(vocab));
  print_mask_costs("demo model's", TokenTrie::from_tokenizer(demo));
}

void print_mask_costs(const char* name, const TokenTrie& trie) {
  const json schema = json::parse(R"({"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}}},
    "required": ["name", "age", "tags"], "additionalProperties": false})");
  // Strings with a pattern or format walk the whole trie (every character moves the automaton).
  const json patterned = json::parse(R"({"type": "object", "properties": {
    "day": {"type": "string", "format": "date"},
    "mail": {"type": "string", "format": "email"},
    "note": {"type": "string", "pattern": "^[^0-9]*$"}},
    "required": ["day", "mail", "note"], "additionalProperties": false})");
  const auto g = JsonGrammar::from_schema(schema);
  const auto p = JsonGrammar::from_schema(patterned);
  std::vector<uint8_t> allowed(trie.vocab_size());
  std::printf("%s vocabulary of %lld tokens\n", name, static_cast<long long>(trie.vocab_size()));
  for (const auto& [grammar, prefix] : std::vector<std::pair<const JsonGrammar*, const char*>>{
           {g.get(), ""},
           {g.get(), "{"},
           {g.get(), "{\"na"},
           {g.get(), "{\"name\": \"hello wor"},
           {g.get(), "{\"name\": \"x\", \"age\": 4"},
           {g.get(), "{\"name\": \"x\", \"age\": 4, \"tags\": [\"ab"},
           {p.get(), "{\"day\": \"2024-0"},
           {p.get(), "{\"day\": \"2024-02-02\", \"mail\": \"john.d"},
           {p.get(), "{\"day\": \"2024-02-02\", \"mail\": \"a@b\", \"note\": \"hello wor"}}) {
    JsonMatcher m(
        std::shared_ptr<const JsonGrammar>(std::shared_ptr<const JsonGrammar>{}, grammar));
    ASSERT_TRUE(m.advance(prefix)) << prefix;
    // The first mask of a state apart (a pattern string's is cached for the steps after).
    const auto first = std::chrono::steady_clock::now();
    m.allowed_tokens(trie, allowed);
    const auto start = std::chrono::steady_clock::now();
    constexpr int kRepeats = 20;
    for (int i = 0; i < kRepeats; ++i) m.allowed_tokens(trie, allowed);
    const auto end = std::chrono::steady_clock::now();
    const double cold = std::chrono::duration<double, std::micro>(start - first).count();
    const double us = std::chrono::duration<double, std::micro>(end - start).count() / kRepeats;
    int64_t count = 0;
    for (uint8_t a : allowed) count += a;
    std::printf("  after %-45s %7.1f us per mask (first %7.1f), %6lld tokens allowed\n",
                ("'" + std::string(prefix) + "'").c_str(), us, cold, static_cast<long long>(count));
  }
}

}  // namespace
}  // namespace moeinfer
