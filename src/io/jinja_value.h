// Values of the Jinja-subset renderer behind ChatTemplate.
//
// Chat templates are written against Python's jinja2, so a value here behaves like the Python
// object jinja2 would hold: ints are Python ints (int64 here), `/` always gives a float, strings
// are indexed by code point, printing a list or dict gives Python's repr, and an undefined name
// behaves like jinja2's default `Undefined` (prints as '', iterates as empty, fails on arithmetic
// and on attribute access). Lists and dicts are immutable once built (transformers renders in an
// immutable sandbox), so they are shared by pointer; a namespace() is the one mutable object.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace moeinfer::jinja {

// Thrown by value operations that have no template line at hand; the evaluator adds the line and
// turns it into moeinfer::Error.
class JinjaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] void fail(const std::string& message);

class Value;
using ValueList = std::vector<Value>;
using ValueDict = std::vector<std::pair<Value, Value>>;  // insertion order, keys unique

// Positional and keyword arguments of a call, a filter or a test.
struct CallArgs {
  std::vector<Value> args;
  std::vector<std::pair<std::string, Value>> kwargs;
};

using NativeFunction = std::function<Value(CallArgs&)>;

struct Callable {
  std::string name;
  NativeFunction fn;
};

class Value {
 public:
  enum class Kind {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kTuple,
    kDict,
    kNamespace,
    kCallable
  };

  // What Python object a list-like value stands for, where jinja2 hands out something other than a
  // list: generators (select, map, unique, ... are lazy: always truthy, no len(), no indexing) and
  // dict views (d.items(): printed as dict_items([...]), not indexable).
  enum class Flavor : uint8_t { kPlain, kIterator, kDictItems, kDictKeys, kDictValues };

  Value() = default;  // undefined
  static Value undefined(std::string name = {}, std::string hint = {});
  static Value none();
  static Value boolean(bool b);
  static Value integer(int64_t i);
  static Value number(double f);
  static Value string(std::string s);
  static Value list(ValueList items);
  static Value tuple(ValueList items);
  static Value iterator(ValueList items);
  static Value dict_view(ValueList items, Flavor flavor);
  static Value dict(ValueDict items);
  static Value make_namespace(ValueDict items);
  static Value callable(std::string name, NativeFunction fn);
  static Value from_json(const nlohmann::ordered_json& j);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_float() const { return kind_ == Kind::kFloat; }
  bool is_number() const { return is_int() || is_float() || is_bool(); }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_list() const { return kind_ == Kind::kList || kind_ == Kind::kTuple; }
  // A real list or tuple (indexable, has len), not a generator or a dict view.
  bool is_sequence() const { return is_list() && flavor_ == Flavor::kPlain; }
  Flavor flavor() const { return flavor_; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_namespace() const { return kind_ == Kind::kNamespace; }
  bool is_callable() const { return kind_ == Kind::kCallable; }

  bool as_bool() const { return b_; }
  int64_t as_int() const { return is_bool() ? (b_ ? 1 : 0) : i_; }
  double as_double() const;  // int, float or bool
  const std::string& as_string() const { return *s_; }
  const ValueList& items() const { return *list_; }
  const ValueDict& entries() const { return *dict_; }
  ValueDict& namespace_entries() const { return *dict_; }
  const Callable& as_callable() const { return *fn_; }
  // For undefined values: the name that was looked up and, if any, what it was looked up on.
  std::string undefined_name() const { return s_ ? *s_ : std::string(); }
  std::string undefined_message() const;

  // Python semantics.
  bool truthy() const;
  std::string str() const;   // str(x); '' for undefined
  std::string repr() const;  // repr(x)
  const char* type_name() const;
  int64_t length() const;     // len(x); fails when the type has none
  ValueList iterate() const;  // list(x): chars of a string, keys of a dict; fails when not iterable

  // Dict lookup; nullptr when absent.
  const Value* find(const Value& key) const;
  const Value* find(std::string_view key) const;
  // The shared object behind a list, dict or namespace (nullptr for scalars): Python identity.
  const void* object_id() const;

 private:
  Kind kind_ = Kind::kUndefined;
  Flavor flavor_ = Flavor::kPlain;
  bool b_ = false;
  int64_t i_ = 0;
  double f_ = 0;
  std::shared_ptr<const std::string> s_;
  std::shared_ptr<const ValueList> list_;
  std::shared_ptr<ValueDict> dict_;
  std::shared_ptr<const Callable> fn_;
};

bool equals(const Value& a, const Value& b);               // Python ==
bool identical(const Value& a, const Value& b);            // Python `is` (the sameas test)
int compare(const Value& a, const Value& b);               // Python <, fails on unordered types
bool contains(const Value& container, const Value& item);  // Python `in`

// json.dumps as transformers' tojson calls it.
struct JsonOptions {
  bool ensure_ascii = false;
  std::optional<std::string> indent;  // None, or the string one level indents by
  std::optional<std::string> item_separator;
  std::optional<std::string> key_separator;
  bool sort_keys = false;
};
std::string to_json(const Value& v, const JsonOptions& options);

std::string py_float_repr(double x);
std::string py_str_repr(std::string_view s);

// UTF-8 helpers: strings are stored as UTF-8 and indexed by code point.
std::u32string utf8_decode(std::string_view s);
std::string utf8_encode(std::u32string_view s);
void utf8_append(std::string& out, char32_t c);
bool is_ascii(std::string_view s);
bool py_isspace(char32_t c);
char32_t py_upper(char32_t c);
char32_t py_lower(char32_t c);
char32_t py_title(char32_t c);
bool py_iscased(char32_t c);
bool py_isalnum(char32_t c);
bool py_isalpha(char32_t c);
bool py_isdigit(char32_t c);
bool py_islower(char32_t c);
bool py_isupper(char32_t c);

}  // namespace moeinfer::jinja
