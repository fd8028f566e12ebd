// The renderer: walks the syntax tree with jinja2's scoping rules and Python's value semantics.
//
// Scopes: each loop iteration, macro call and `with` block gets a fresh frame whose parent is the
// enclosing one, so a `set` inside a loop is gone at the next iteration (hence namespace()), while
// `if` blocks share their parent's frame. Lookups go frame -> ... -> template -> context ->
// globals. Errors raised without a line (JinjaError) are given the line of the expression or
// statement being evaluated and become moeinfer::Error.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <functional>
#include <map>
#include <unordered_map>

#include "core/error.h"
#include "io/jinja_ast.h"
#include "io/jinja_strings.h"

namespace moeinfer::jinja {
namespace {

struct Frame {
  std::unordered_map<std::string, Value> vars;
  std::shared_ptr<Frame> parent;

  const Value* lookup(const std::string& name) const {
    for (const Frame* f = this; f; f = f->parent.get()) {
      auto it = f->vars.find(name);
      if (it != f->vars.end()) return &it->second;
    }
    return nullptr;
  }
};
using FramePtr = std::shared_ptr<Frame>;

FramePtr child_frame(const FramePtr& parent) {
  auto f = std::make_shared<Frame>();
  f->parent = parent;
  return f;
}

// A frame for a scope whose analysis found names that start out undefined (see jinja_ast.h).
FramePtr scope_frame(const FramePtr& parent, const std::vector<std::string>& undefined_names) {
  auto f = child_frame(parent);
  for (const auto& name : undefined_names) f->vars[name] = Value::undefined(name);
  return f;
}

enum class Flow { kNormal, kBreak, kContinue };

constexpr int64_t kMaxRange = 100000;  // jinja2's sandbox limit on range()
constexpr int kMaxCallDepth = 500;

// Binds call arguments to named parameters, as a Python signature would.
class Params {
 public:
  Params(const CallArgs& call, std::initializer_list<const char*> names, const std::string& what)
      : names_(names), values_(names.size()), present_(names.size(), false) {
    if (call.args.size() > names_.size()) {
      fail(what + " takes at most " + std::to_string(names_.size()) + " argument(s), got " +
           std::to_string(call.args.size()));
    }
    for (size_t i = 0; i < call.args.size(); ++i) {
      values_[i] = call.args[i];
      present_[i] = true;
    }
    for (const auto& [key, v] : call.kwargs) {
      auto it = std::find_if(names_.begin(), names_.end(), [&](const char* n) { return key == n; });
      if (it == names_.end()) fail(what + " got an unexpected keyword argument '" + key + "'");
      size_t i = static_cast<size_t>(it - names_.begin());
      if (present_[i]) fail(what + " got multiple values for argument '" + key + "'");
      values_[i] = v;
      present_[i] = true;
    }
  }
  bool has(size_t i) const { return present_[i]; }
  const Value& get(size_t i) const { return values_[i]; }
  Value get(size_t i, Value fallback) const { return present_[i] ? values_[i] : fallback; }
  bool flag(size_t i, bool fallback) const { return present_[i] ? values_[i].truthy() : fallback; }
  int64_t integer(size_t i, int64_t fallback) const {
    if (!present_[i]) return fallback;
    if (!values_[i].is_int() && !values_[i].is_bool()) {
      fail(std::string("'") + names_[i] + "' must be an integer, not " + values_[i].type_name());
    }
    return values_[i].as_int();
  }
  std::string str(size_t i, const std::string& fallback) const {
    return present_[i] ? values_[i].str() : fallback;
  }

 private:
  std::vector<const char*> names_;
  std::vector<Value> values_;
  std::vector<bool> present_;
};

const std::string& need_string(const Value& v, const char* what) {
  if (!v.is_string()) {
    if (v.is_undefined()) fail(v.undefined_message());
    fail(std::string(what) + " expects a string, got " + v.type_name());
  }
  return v.as_string();
}

int64_t need_int(const Value& v, const char* what) {
  if (!v.is_int() && !v.is_bool()) {
    if (v.is_undefined()) fail(v.undefined_message());
    fail(std::string(what) + " expects an integer, got " + v.type_name());
  }
  return v.as_int();
}

Value make_number_result(double v) { return Value::number(v); }

// Python's floor division and modulo.
int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
int64_t floor_mod(int64_t a, int64_t b) {
  int64_t m = a % b;
  if (m != 0 && ((m < 0) != (b < 0))) m += b;
  return m;
}
double float_mod(double a, double b) {
  double m = std::fmod(a, b);
  if (m == 0) return std::copysign(0.0, b);
  if ((m < 0) != (b < 0)) m += b;
  return m;
}

[[noreturn]] void fail_operands(const char* op, const Value& a, const Value& b) {
  if (a.is_undefined()) fail(a.undefined_message());
  if (b.is_undefined()) fail(b.undefined_message());
  fail(std::string("unsupported operand type(s) for ") + op + ": '" + a.type_name() + "' and '" +
       b.type_name() + "'");
}

Value repeat(const Value& seq, int64_t n) {
  if (seq.is_string()) {
    std::string out;
    for (int64_t i = 0; i < n; ++i) out += seq.as_string();
    return Value::string(std::move(out));
  }
  ValueList out;
  for (int64_t i = 0; i < n; ++i) out.insert(out.end(), seq.items().begin(), seq.items().end());
  return seq.kind() == Value::Kind::kTuple ? Value::tuple(std::move(out))
                                           : Value::list(std::move(out));
}

Value binary_op(const std::string& op, const Value& a, const Value& b) {
  bool nums = a.is_number() && b.is_number();
  bool ints = nums && !a.is_float() && !b.is_float();
  if (op == "~") return Value::string(a.str() + b.str());
  if (op == "+") {
    if (ints) return Value::integer(a.as_int() + b.as_int());
    if (nums) return Value::number(a.as_double() + b.as_double());
    if (a.is_string() && b.is_string()) return Value::string(a.as_string() + b.as_string());
    if (a.is_sequence() && b.is_sequence() && a.kind() == b.kind()) {
      ValueList out = a.items();
      out.insert(out.end(), b.items().begin(), b.items().end());
      return a.kind() == Value::Kind::kTuple ? Value::tuple(std::move(out))
                                             : Value::list(std::move(out));
    }
    fail_operands("+", a, b);
  }
  if (op == "-") {
    if (ints) return Value::integer(a.as_int() - b.as_int());
    if (nums) return Value::number(a.as_double() - b.as_double());
    fail_operands("-", a, b);
  }
  if (op == "*") {
    if (ints) return Value::integer(a.as_int() * b.as_int());
    if (nums) return Value::number(a.as_double() * b.as_double());
    if ((a.is_string() || a.is_sequence()) && (b.is_int() || b.is_bool()))
      return repeat(a, b.as_int());
    if ((b.is_string() || b.is_sequence()) && (a.is_int() || a.is_bool()))
      return repeat(b, a.as_int());
    fail_operands("*", a, b);
  }
  if (op == "/") {
    if (!nums) fail_operands("/", a, b);
    if (b.as_double() == 0) fail("division by zero");
    return Value::number(a.as_double() / b.as_double());
  }
  if (op == "//") {
    if (!nums) fail_operands("//", a, b);
    if (b.as_double() == 0) fail("integer division or modulo by zero");
    if (ints) return Value::integer(floor_div(a.as_int(), b.as_int()));
    return Value::number(std::floor(a.as_double() / b.as_double()));
  }
  if (op == "%") {
    if (a.is_string()) return Value::string(percent_format(a.as_string(), b));
    if (!nums) fail_operands("%", a, b);
    if (b.as_double() == 0) fail("integer division or modulo by zero");
    if (ints) return Value::integer(floor_mod(a.as_int(), b.as_int()));
    return Value::number(float_mod(a.as_double(), b.as_double()));
  }
  if (op == "**") {
    if (!nums) fail_operands("**", a, b);
    if (ints && b.as_int() >= 0) {
      int64_t result = 1, base = a.as_int();
      for (int64_t e = b.as_int(); e > 0; --e) result *= base;
      return Value::integer(result);
    }
    if (a.as_double() == 0 && b.as_double() < 0) fail("0.0 cannot be raised to a negative power");
    return Value::number(std::pow(a.as_double(), b.as_double()));
  }
  fail("unknown operator " + op);
}

// Python slicing of lists, tuples and strings.
Value slice_value(const Value& v, const Value& start_v, const Value& stop_v, const Value& step_v) {
  auto opt_int = [](const Value& x, const char* what) -> std::optional<int64_t> {
    if (x.is_undefined() || x.is_none()) return std::nullopt;
    return need_int(x, what);
  };
  int64_t step = opt_int(step_v, "slice step").value_or(1);
  if (step == 0) fail("slice step cannot be zero");
  std::u32string chars;
  bool is_str = v.is_string();
  int64_t n;
  if (is_str) {
    chars = utf8_decode(v.as_string());
    n = static_cast<int64_t>(chars.size());
  } else if (v.is_sequence()) {
    n = static_cast<int64_t>(v.items().size());
  } else {
    // Slices bypass jinja2's forgiving getitem: a TypeError surfaces.
    if (v.is_undefined()) fail(v.undefined_message());
    if (v.is_dict()) fail("unhashable type: 'slice'");
    fail(std::string("'") + (v.is_list() ? "generator" : v.type_name()) +
         "' object is not subscriptable");
  }
  auto clamp = [&](std::optional<int64_t> x, int64_t dflt) {
    if (!x) return dflt;
    int64_t i = *x;
    if (i < 0) i += n;
    if (step > 0) return std::clamp<int64_t>(i, 0, n);
    return std::clamp<int64_t>(i, -1, n - 1);
  };
  int64_t start = clamp(opt_int(start_v, "slice index"), step > 0 ? 0 : n - 1);
  int64_t stop = clamp(opt_int(stop_v, "slice index"), step > 0 ? n : -1);
  std::u32string out_chars;
  ValueList out_items;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
    if (is_str) {
      out_chars.push_back(chars[static_cast<size_t>(i)]);
    } else {
      out_items.push_back(v.items()[static_cast<size_t>(i)]);
    }
  }
  if (is_str) return Value::string(utf8_encode(out_chars));
  return v.kind() == Value::Kind::kTuple ? Value::tuple(std::move(out_items))
                                         : Value::list(std::move(out_items));
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

class Renderer;
using FilterFn = std::function<Value(Renderer&, const Value&, const CallArgs&)>;
using TestFn = std::function<bool(Renderer&, const Value&, const CallArgs&)>;
const std::map<std::string, FilterFn, std::less<>>& filter_table();
const std::map<std::string, TestFn, std::less<>>& test_table();

class Renderer {
 public:
  explicit Renderer(const Value& context) {
    globals_ = std::make_shared<Frame>();
    install_globals();
    auto ctx = child_frame(globals_);
    if (context.is_dict()) {
      for (const auto& [k, v] : context.entries()) ctx->vars[k.str()] = v;
    }
    root_ = child_frame(ctx);
  }

  std::string render(const Template& tmpl) {
    for (const auto& name : tmpl.undefined_names) root_->vars[name] = Value::undefined(name);
    std::string out;
    render_body(tmpl.body, root_, out);
    return out;
  }

  // ---- statements ----

  Flow render_body(const Body& body, const FramePtr& frame, std::string& out) {
    for (const auto& stmt : body) {
      Flow flow = render_stmt(*stmt, frame, out);
      if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

  Flow render_stmt(const Stmt& s, const FramePtr& frame, std::string& out) {
    try {
      return render_stmt_inner(s, frame, out);
    } catch (const JinjaError& e) {
      MOE_FAIL("chat template line ", s.line, ": ", e.what());
    }
  }

  Flow render_stmt_inner(const Stmt& s, const FramePtr& frame, std::string& out) {
    switch (s.type) {
      case Stmt::Type::kText:
        out += s.text;
        return Flow::kNormal;
      case Stmt::Type::kOutput:
        out += eval(*s.expr, frame).str();
        return Flow::kNormal;
      case Stmt::Type::kIf:
        for (const auto& [cond, body] : s.branches) {
          if (eval(*cond, frame).truthy()) return render_body(body, frame, out);
        }
        return render_body(s.else_body, frame, out);
      case Stmt::Type::kFor:
        return render_for(s, frame, out);
      case Stmt::Type::kSet:
        assign(*s.target, eval(*s.expr, frame), frame);
        return Flow::kNormal;
      case Stmt::Type::kSetBlock: {
        std::string captured;
        // A break or continue inside the block leaves the loop before the assignment.
        Flow flow = render_body(s.body, scope_frame(frame, s.undefined_names), captured);
        if (flow != Flow::kNormal) return flow;
        Value v = Value::string(std::move(captured));
        if (s.expr) v = eval_filter_chain(*s.expr, v, frame);
        assign(*s.target, v, frame);
        return Flow::kNormal;
      }
      case Stmt::Type::kMacro:
        frame->vars[s.name] = make_macro(s, frame, s.name);
        return Flow::kNormal;
      case Stmt::Type::kCallBlock: {
        Value caller = make_macro(s, frame, "caller");
        const Expr& call = *s.expr;
        Value callee = eval(*call.args[0], frame);
        CallArgs args = eval_args(call, frame);
        args.kwargs.emplace_back("caller", caller);
        out += call_value(callee, args).str();
        return Flow::kNormal;
      }
      case Stmt::Type::kFilterBlock: {
        std::string captured;
        Flow flow = render_body(s.body, scope_frame(frame, s.undefined_names), captured);
        if (flow != Flow::kNormal) return flow;
        out += eval_filter_chain(*s.expr, Value::string(std::move(captured)), frame).str();
        return Flow::kNormal;
      }
      case Stmt::Type::kWith: {
        auto inner = scope_frame(frame, s.undefined_names);
        for (const auto& [target, value] : s.assignments)
          assign(*target, eval(*value, frame), inner);
        return render_body(s.body, inner, out);
      }
      case Stmt::Type::kBreak:
        return Flow::kBreak;
      case Stmt::Type::kContinue:
        return Flow::kContinue;
      case Stmt::Type::kScope:
        return render_body(s.body, scope_frame(frame, s.undefined_names), out);
    }
    return Flow::kNormal;
  }

  Flow render_for(const Stmt& s, const FramePtr& frame, std::string& out) {
    if (s.recursive) fail("recursive loops are not supported");
    Value seq = eval(*s.expr, frame);
    if (seq.is_none()) fail("'NoneType' object is not iterable");
    ValueList items = seq.iterate();
    if (s.cond) {
      ValueList kept;
      for (const auto& item : items) {
        auto f = scope_frame(frame, s.undefined_names);
        assign(*s.target, item, f);
        if (eval(*s.cond, f).truthy()) kept.push_back(item);
      }
      items = std::move(kept);
    }
    // jinja2 runs the else block unless some iteration ran to the end of the body (a break or a
    // continue does not count).
    bool completed_any = false;
    int64_t n = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < n; ++i) {
      auto f = scope_frame(frame, s.undefined_names);
      assign(*s.target, items[static_cast<size_t>(i)], f);
      ValueDict loop;
      loop.emplace_back(Value::string("index"), Value::integer(i + 1));
      loop.emplace_back(Value::string("index0"), Value::integer(i));
      loop.emplace_back(Value::string("revindex"), Value::integer(n - i));
      loop.emplace_back(Value::string("revindex0"), Value::integer(n - i - 1));
      loop.emplace_back(Value::string("first"), Value::boolean(i == 0));
      loop.emplace_back(Value::string("last"), Value::boolean(i == n - 1));
      loop.emplace_back(Value::string("length"), Value::integer(n));
      loop.emplace_back(Value::string("depth"), Value::integer(1));
      loop.emplace_back(Value::string("depth0"), Value::integer(0));
      if (i > 0) loop.emplace_back(Value::string("previtem"), items[static_cast<size_t>(i - 1)]);
      if (i < n - 1)
        loop.emplace_back(Value::string("nextitem"), items[static_cast<size_t>(i + 1)]);
      loop.emplace_back(Value::string("cycle"), Value::callable("cycle", [i](CallArgs& a) {
                          if (a.args.empty()) fail("no items for cycling given");
                          return a.args[static_cast<size_t>(i) % a.args.size()];
                        }));
      f->vars["loop"] = Value::dict(std::move(loop));
      Flow flow = render_body(s.body, f, out);
      if (flow == Flow::kBreak) break;
      if (flow == Flow::kNormal) completed_any = true;
    }
    if (!completed_any) render_body(s.else_body, scope_frame(frame, s.else_undefined_names), out);
    return Flow::kNormal;
  }

  void assign(const Expr& target, const Value& v, const FramePtr& frame) {
    switch (target.type) {
      case Expr::Type::kName:
        frame->vars[target.name] = v;
        return;
      case Expr::Type::kTuple: {
        if (v.is_none() || v.is_number())
          fail(std::string("cannot unpack non-iterable ") + v.type_name() + " object");
        ValueList items = v.iterate();
        if (items.size() < target.args.size()) {
          fail("not enough values to unpack (expected " + std::to_string(target.args.size()) +
               ", got " + std::to_string(items.size()) + ")");
        }
        if (items.size() > target.args.size()) {
          fail("too many values to unpack (expected " + std::to_string(target.args.size()) + ")");
        }
        for (size_t i = 0; i < items.size(); ++i) assign(*target.args[i], items[i], frame);
        return;
      }
      case Expr::Type::kGetAttr: {
        const Value* ns = frame->lookup(target.args[0]->name);
        if (!ns || !ns->is_namespace()) fail("cannot assign attribute on non-namespace object");
        if (!target.name.empty() && target.name[0] == '_') {
          fail(
              "chat templates cannot store underscore-prefixed attributes on a namespace, but got "
              "'" +
              target.name + "'");
        }
        ValueDict& entries = ns->namespace_entries();
        for (auto& [k, old] : entries) {
          if (k.is_string() && k.as_string() == target.name) {
            old = v;
            return;
          }
        }
        entries.emplace_back(Value::string(target.name), v);
        return;
      }
      default:
        fail("cannot assign to this expression");
    }
  }

  // A macro keeps its defining frame alive through pinned_, not through its own closure: the frame
  // holds the macro, so a closure owning the frame would be a reference cycle.
  Value make_macro(const Stmt& s, const FramePtr& defining, const std::string& name) {
    size_t slot = pinned_.size();
    pinned_.push_back(defining);
    return Value::callable(name, [this, &s, slot, name](CallArgs& call) {
      if (++depth_ > kMaxCallDepth) fail("maximum recursion depth exceeded");
      auto f = scope_frame(pinned_[slot], s.undefined_names);
      size_t n = s.params.size();
      std::vector<bool> bound(n, false);
      ValueList varargs;
      for (size_t i = 0; i < call.args.size(); ++i) {
        if (i < n) {
          f->vars[s.params[i].name] = call.args[i];
          bound[i] = true;
        } else {
          varargs.push_back(call.args[i]);
        }
      }
      ValueDict kwargs;
      for (const auto& [key, v] : call.kwargs) {
        bool matched = false;
        for (size_t i = 0; i < n; ++i) {
          if (s.params[i].name == key) {
            if (bound[i])
              fail("macro '" + name + "' got multiple values for argument '" + key + "'");
            f->vars[key] = v;
            bound[i] = true;
            matched = true;
          }
        }
        if (!matched) {
          if (key == "caller") {
            f->vars["caller"] = v;
          } else {
            kwargs.emplace_back(Value::string(key), v);
          }
        }
      }
      for (size_t i = 0; i < n; ++i) {
        if (bound[i]) continue;
        if (s.params[i].default_value) {
          f->vars[s.params[i].name] = eval(*s.params[i].default_value, f);
        } else {
          f->vars[s.params[i].name] = Value::undefined(s.params[i].name);
        }
      }
      f->vars["varargs"] = Value::tuple(std::move(varargs));
      f->vars["kwargs"] = Value::dict(std::move(kwargs));
      std::string out;
      render_body(s.body, f, out);
      --depth_;
      return Value::string(std::move(out));
    });
  }

  // ---- expressions ----

  Value eval(const Expr& e, const FramePtr& frame) {
    try {
      return eval_inner(e, frame);
    } catch (const JinjaError& err) {
      MOE_FAIL("chat template line ", e.line, ": ", err.what());
    }
  }

  Value eval_inner(const Expr& e, const FramePtr& frame) {
    switch (e.type) {
      case Expr::Type::kConst:
        return e.value;
      case Expr::Type::kName: {
        const Value* v = frame->lookup(e.name);
        return v ? *v : Value::undefined(e.name);
      }
      case Expr::Type::kGetAttr:
        return getattr(eval(*e.args[0], frame), e.name);
      case Expr::Type::kGetItem:
        return getitem(eval(*e.args[0], frame), eval(*e.args[1], frame));
      case Expr::Type::kSlice: {
        Value obj = eval(*e.args[0], frame);
        auto part = [&](size_t i) { return e.args[i] ? eval(*e.args[i], frame) : Value::none(); };
        return slice_value(obj, part(1), part(2), part(3));
      }
      case Expr::Type::kCall: {
        Value callee = eval(*e.args[0], frame);
        CallArgs args = eval_args(e, frame);
        return call_value(callee, args);
      }
      case Expr::Type::kFilter:
        return eval_filter_chain(e, Value(), frame);
      case Expr::Type::kTest: {
        Value v = eval(*e.args[0], frame);
        CallArgs args = eval_args(e, frame);
        bool r = run_test(e.name, v, args);
        return Value::boolean(e.negated ? !r : r);
      }
      case Expr::Type::kUnary: {
        Value v = eval(*e.args[0], frame);
        if (e.name == "not") return Value::boolean(!v.truthy());
        if (!v.is_number()) {
          if (v.is_undefined()) fail(v.undefined_message());
          fail(std::string("bad operand type for unary ") + e.name + ": '" + v.type_name() + "'");
        }
        if (e.name == "+") return v.is_bool() ? Value::integer(v.as_int()) : v;
        if (v.is_float()) return Value::number(-v.as_double());
        return Value::integer(-v.as_int());
      }
      case Expr::Type::kBinary: {
        if (e.name == "and") {
          Value a = eval(*e.args[0], frame);
          return a.truthy() ? eval(*e.args[1], frame) : a;
        }
        if (e.name == "or") {
          Value a = eval(*e.args[0], frame);
          return a.truthy() ? a : eval(*e.args[1], frame);
        }
        Value a = eval(*e.args[0], frame);
        Value b = eval(*e.args[1], frame);
        return binary_op(e.name, a, b);
      }
      case Expr::Type::kCompare: {
        Value left = eval(*e.args[0], frame);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.args[i + 1], frame);
          if (!compare_op(e.ops[i], left, right)) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case Expr::Type::kCond:
        if (eval(*e.args[1], frame).truthy()) return eval(*e.args[0], frame);
        if (e.args[2]) return eval(*e.args[2], frame);
        return Value::undefined();
      case Expr::Type::kList:
      case Expr::Type::kTuple: {
        ValueList items;
        for (const auto& a : e.args) items.push_back(eval(*a, frame));
        return e.type == Expr::Type::kList ? Value::list(std::move(items))
                                           : Value::tuple(std::move(items));
      }
      case Expr::Type::kDict: {
        ValueDict items;
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          Value k = eval(*e.args[i], frame);
          Value v = eval(*e.args[i + 1], frame);
          if (!(k.is_string() || k.is_number() || k.is_none() || k.kind() == Value::Kind::kTuple)) {
            fail(std::string("unhashable type: '") + k.type_name() + "'");
          }
          bool replaced = false;
          for (auto& [ok, ov] : items) {
            if (equals(ok, k)) {
              ov = v;
              replaced = true;
            }
          }
          if (!replaced) items.emplace_back(std::move(k), std::move(v));
        }
        return Value::dict(std::move(items));
      }
    }
    fail("unknown expression");
  }

  static bool compare_op(const std::string& op, const Value& a, const Value& b) {
    if (op == "==") return equals(a, b);
    if (op == "!=") return !equals(a, b);
    if (op == "in") return contains(b, a);
    if (op == "notin") return !contains(b, a);
    int c = compare(a, b);
    if (op == "<") return c < 0;
    if (op == "<=") return c <= 0;
    if (op == ">") return c > 0;
    return c >= 0;
  }

  CallArgs eval_args(const Expr& e, const FramePtr& frame) {
    CallArgs args;
    for (size_t i = 1; i < e.args.size(); ++i) args.args.push_back(eval(*e.args[i], frame));
    if (e.star) {
      Value extra = eval(*e.star, frame);
      for (auto& v : extra.iterate()) args.args.push_back(v);
    }
    for (const auto& [k, v] : e.kwargs) args.kwargs.emplace_back(k, eval(*v, frame));
    if (e.star_star) {
      Value extra = eval(*e.star_star, frame);
      if (!extra.is_dict()) fail("argument after ** must be a mapping");
      for (const auto& [k, v] : extra.entries()) args.kwargs.emplace_back(k.str(), v);
    }
    return args;
  }

  // A filter expression; the innermost input is `input` when the chain starts in a filter block.
  Value eval_filter_chain(const Expr& e, const Value& input, const FramePtr& frame) {
    if (e.type != Expr::Type::kFilter) return eval(e, frame);
    try {
      Value v = e.args[0] ? eval_filter_chain(*e.args[0], input, frame) : input;
      CallArgs args = eval_args(e, frame);
      return run_filter(e.name, v, args);
    } catch (const JinjaError& err) {
      MOE_FAIL("chat template line ", e.line, ": ", err.what());
    }
  }

  Value call_value(const Value& callee, CallArgs& args) {
    if (!callee.is_callable()) {
      if (callee.is_undefined()) fail(callee.undefined_message());
      fail(std::string("'") + callee.type_name() + "' object is not callable");
    }
    return callee.as_callable().fn(args);
  }

  Value run_filter(const std::string& name, const Value& v, const CallArgs& args) {
    const auto& table = filter_table();
    auto it = table.find(name);
    if (it == table.end()) fail("no filter named '" + name + "'");
    return it->second(*this, v, args);
  }

  bool run_test(const std::string& name, const Value& v, const CallArgs& args) {
    const auto& table = test_table();
    auto it = table.find(name);
    if (it == table.end()) fail("no test named '" + name + "'");
    return it->second(*this, v, args);
  }

  // ---- attribute and item access (jinja2's sandboxed getattr / getitem) ----

  Value getattr(const Value& obj, const std::string& name) {
    switch (obj.kind()) {
      case Value::Kind::kUndefined:
        fail(obj.undefined_message());
      case Value::Kind::kDict: {
        if (auto m = dict_method(obj, name)) return *m;
        if (const Value* v = obj.find(name)) return *v;
        return Value::undefined(name, "dict object");
      }
      case Value::Kind::kNamespace: {
        if (const Value* v = obj.find(name)) return *v;
        return Value::undefined(name, "Namespace object");
      }
      case Value::Kind::kString:
        if (auto m = string_method(obj, name)) return *m;
        return Value::undefined(name, "str object");
      case Value::Kind::kList:
      case Value::Kind::kTuple:
        if (!obj.is_sequence()) return Value::undefined(name, "iterator");
        if (auto m = list_method(obj, name)) return *m;
        return Value::undefined(name, std::string(obj.type_name()) + " object");
      case Value::Kind::kNone:
        return Value::undefined(name, "None");
      default:
        return Value::undefined(name, std::string(obj.type_name()) + " object");
    }
  }

  Value getitem(const Value& obj, const Value& key) {
    switch (obj.kind()) {
      case Value::Kind::kUndefined:
        fail(obj.undefined_message());
      case Value::Kind::kDict:
        if (const Value* v = obj.find(key)) return *v;
        break;
      case Value::Kind::kList:
      case Value::Kind::kTuple:
        if (!obj.is_sequence()) break;
        if (key.is_int() || key.is_bool()) {
          int64_t n = static_cast<int64_t>(obj.items().size());
          int64_t i = key.as_int();
          if (i < 0) i += n;
          if (i >= 0 && i < n) return obj.items()[static_cast<size_t>(i)];
          return Value::undefined(key.str(), std::string(obj.type_name()) + " object");
        }
        break;
      case Value::Kind::kString:
        if (key.is_int() || key.is_bool()) {
          std::u32string chars = utf8_decode(obj.as_string());
          int64_t n = static_cast<int64_t>(chars.size());
          int64_t i = key.as_int();
          if (i < 0) i += n;
          if (i >= 0 && i < n)
            return Value::string(utf8_encode(chars.substr(static_cast<size_t>(i), 1)));
          return Value::undefined(key.str(), "str object");
        }
        break;
      default:
        break;
    }
    if (key.is_string()) return getattr(obj, key.as_string());
    return Value::undefined(key.str(), std::string(obj.type_name()) + " object");
  }

  // Follows a dotted path ("function.name", "0.text") the way jinja2's attribute filters do.
  Value get_path(const Value& obj, const Value& path) {
    if (path.is_int()) return getitem(obj, path);
    Value cur = obj;
    std::string p = path.str();
    size_t start = 0;
    while (true) {
      size_t dot = p.find('.', start);
      std::string part =
          p.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      bool digits = !part.empty() && std::all_of(part.begin(), part.end(),
                                                 [](char c) { return c >= '0' && c <= '9'; });
      cur = digits ? getitem(cur, Value::integer(std::stoll(part)))
                   : getitem(cur, Value::string(part));
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
    return cur;
  }

  std::optional<Value> dict_method(const Value& obj, const std::string& name) {
    if (name == "get") {
      return Value::callable("get", [obj](CallArgs& a) {
        Params p(a, {"key", "default"}, "get");
        const Value* v = obj.find(p.get(0));
        return v ? *v : p.get(1, Value::none());
      });
    }
    if (name == "items") {
      return Value::callable("items", [obj](CallArgs& a) {
        Params p(a, {}, "items");
        ValueList out;
        for (const auto& [k, v] : obj.entries()) out.push_back(Value::tuple({k, v}));
        return Value::dict_view(std::move(out), Value::Flavor::kDictItems);
      });
    }
    if (name == "keys") {
      return Value::callable("keys", [obj](CallArgs& a) {
        Params p(a, {}, "keys");
        return Value::dict_view(obj.iterate(), Value::Flavor::kDictKeys);
      });
    }
    if (name == "values") {
      return Value::callable("values", [obj](CallArgs& a) {
        Params p(a, {}, "values");
        ValueList out;
        for (const auto& [k, v] : obj.entries()) out.push_back(v);
        return Value::dict_view(std::move(out), Value::Flavor::kDictValues);
      });
    }
    if (name == "copy") {
      return Value::callable("copy", [obj](CallArgs&) { return Value::dict(obj.entries()); });
    }
    // The immutable sandbox hides mutating methods behind an undefined value that fails when
    // called (and prints as '').
    if (name == "clear" || name == "pop" || name == "popitem" || name == "setdefault" ||
        name == "update") {
      return Value::undefined(name, "dict object (unsafe attribute)");
    }
    return std::nullopt;
  }

  std::optional<Value> list_method(const Value& obj, const std::string& name) {
    if (name == "index") {
      return Value::callable("index", [obj](CallArgs& a) {
        Params p(a, {"value"}, "index");
        const auto& items = obj.items();
        for (size_t i = 0; i < items.size(); ++i) {
          if (equals(items[i], p.get(0))) return Value::integer(static_cast<int64_t>(i));
        }
        fail(p.get(0).repr() + " is not in list");
      });
    }
    if (name == "count") {
      return Value::callable("count", [obj](CallArgs& a) {
        Params p(a, {"value"}, "count");
        int64_t n = 0;
        for (const auto& v : obj.items()) n += equals(v, p.get(0));
        return Value::integer(n);
      });
    }
    if (name == "append" || name == "clear" || name == "extend" || name == "insert" ||
        name == "pop" || name == "remove" || name == "reverse" || name == "sort" ||
        name == "copy") {
      if (name == "copy")
        return Value::callable("copy", [obj](CallArgs&) { return Value::list(obj.items()); });
      return Value::undefined(name, std::string(obj.type_name()) + " object (unsafe attribute)");
    }
    return std::nullopt;
  }

  std::optional<Value> string_method(const Value& obj, const std::string& name) {
    if (!is_string_method(name)) return std::nullopt;
    return Value::callable(
        name, [obj, name](CallArgs& a) { return call_string_method(obj.as_string(), name, a); });
  }

  void install_globals() {
    auto& g = globals_->vars;
    g["raise_exception"] = Value::callable("raise_exception", [](CallArgs& a) -> Value {
      Params p(a, {"message"}, "raise_exception");
      fail(p.get(0).str());
    });
    g["range"] = Value::callable("range", [](CallArgs& a) {
      if (!a.kwargs.empty()) fail("range() takes no keyword arguments");
      if (a.args.empty() || a.args.size() > 3) fail("range expected 1 to 3 arguments");
      int64_t start = 0, stop, step = 1;
      if (a.args.size() == 1) {
        stop = need_int(a.args[0], "range()");
      } else {
        start = need_int(a.args[0], "range()");
        stop = need_int(a.args[1], "range()");
        if (a.args.size() == 3) step = need_int(a.args[2], "range()");
      }
      if (step == 0) fail("range() arg 3 must not be zero");
      ValueList out;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (static_cast<int64_t>(out.size()) >= kMaxRange) {
          fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
        }
        out.push_back(Value::integer(i));
      }
      return Value::list(std::move(out));
    });
    g["namespace"] = Value::callable("namespace", [](CallArgs& a) {
      ValueDict entries;
      auto put = [&](const Value& k, const Value& v) {
        std::string key = k.str();
        if (!key.empty() && key[0] == '_') {
          fail(
              "chat templates cannot store underscore-prefixed attributes on a namespace, but "
              "got '" +
              key + "'");
        }
        for (auto& [ek, ev] : entries) {
          if (ek.as_string() == key) {
            ev = v;
            return;
          }
        }
        entries.emplace_back(Value::string(key), v);
      };
      if (a.args.size() > 1) fail("namespace expected at most 1 positional argument");
      if (a.args.size() == 1) {
        if (!a.args[0].is_dict()) fail("namespace() argument must be a mapping");
        for (const auto& [k, v] : a.args[0].entries()) put(k, v);
      }
      for (const auto& [k, v] : a.kwargs) put(Value::string(k), v);
      return Value::make_namespace(std::move(entries));
    });
    g["dict"] = Value::callable("dict", [](CallArgs& a) {
      ValueDict entries;
      auto put = [&](const Value& k, const Value& v) {
        for (auto& [ek, ev] : entries) {
          if (equals(ek, k)) {
            ev = v;
            return;
          }
        }
        entries.emplace_back(k, v);
      };
      if (a.args.size() > 1) fail("dict expected at most 1 argument");
      if (a.args.size() == 1) {
        const Value& src = a.args[0];
        if (src.is_dict()) {
          for (const auto& [k, v] : src.entries()) put(k, v);
        } else {
          for (const auto& pair : src.iterate()) {
            ValueList kv = pair.iterate();
            if (kv.size() != 2) fail("dictionary update sequence element has wrong length");
            put(kv[0], kv[1]);
          }
        }
      }
      for (const auto& [k, v] : a.kwargs) put(Value::string(k), v);
      return Value::dict(std::move(entries));
    });
    g["strftime_now"] = Value::callable("strftime_now", [](CallArgs& a) {
      Params p(a, {"format"}, "strftime_now");
      std::string fmt = need_string(p.get(0), "strftime_now");
      std::time_t now = std::time(nullptr);
      std::tm local{};
      localtime_r(&now, &local);
      char buf[512];
      size_t n = std::strftime(buf, sizeof(buf), fmt.c_str(), &local);
      return Value::string(std::string(buf, n));
    });
  }

 private:
  FramePtr globals_;
  FramePtr root_;
  std::vector<FramePtr> pinned_;  // frames that defined macros, kept for the whole render
  int depth_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Filters

// The items of an iterable (a copy: callers may outlive the value they came from).
ValueList seq_of(const Value& v) {
  if (v.is_none()) fail("'NoneType' object is not iterable");
  if (v.is_number()) fail(std::string("'") + v.type_name() + "' object is not iterable");
  return v.iterate();
}

// Sort key for the case-insensitive filters: lower-cased strings.
Value fold_case(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value::string(py_str_lower(v.as_string()));
  return v;
}

JsonOptions json_options(const Params& p) {
  JsonOptions o;
  o.ensure_ascii = p.flag(0, false);
  if (p.has(1) && !p.get(1).is_none()) {
    const Value& ind = p.get(1);
    if (ind.is_string()) {
      o.indent = ind.as_string();
    } else {
      int64_t n = need_int(ind, "tojson indent");
      o.indent = std::string(static_cast<size_t>(std::max<int64_t>(n, 0)), ' ');
    }
  }
  if (p.has(2) && !p.get(2).is_none()) {
    ValueList seps = p.get(2).iterate();
    if (seps.size() != 2) fail("separators must be a (item_separator, key_separator) pair");
    o.item_separator = need_string(seps[0], "tojson separators");
    o.key_separator = need_string(seps[1], "tojson separators");
  }
  o.sort_keys = p.flag(3, false);
  return o;
}

std::vector<Value> select_items(Renderer& r, const Value& v, const CallArgs& a, bool by_attr,
                                bool keep) {
  ValueList items = seq_of(v);
  std::optional<Value> attr;
  size_t first_test_arg = 0;
  if (by_attr) {
    if (a.args.empty()) fail("selectattr/rejectattr need an attribute name");
    attr = a.args[0];
    first_test_arg = 1;
  }
  std::string test;
  CallArgs test_args;
  bool has_test = a.args.size() > first_test_arg;
  if (has_test) {
    test = need_string(a.args[first_test_arg], "select test name");
    test_args.args.assign(a.args.begin() + static_cast<long>(first_test_arg) + 1, a.args.end());
    test_args.kwargs = a.kwargs;
  }
  ValueList out;
  for (const auto& item : items) {
    Value subject = attr ? r.get_path(item, *attr) : item;
    bool ok = has_test ? r.run_test(test, subject, test_args) : subject.truthy();
    if (ok == keep) out.push_back(item);
  }
  return out;
}

const std::map<std::string, FilterFn, std::less<>>& filter_table() {
  static const std::map<std::string, FilterFn, std::less<>> table = [] {
    std::map<std::string, FilterFn, std::less<>> t;
    t["abs"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {}, "abs");
      if (v.is_float()) return Value::number(std::fabs(v.as_double()));
      int64_t i = need_int(v, "abs");
      return Value::integer(i < 0 ? -i : i);
    };
    t["attr"] = [](Renderer& r, const Value& v, const CallArgs& a) {
      Params p(a, {"name"}, "attr");
      return r.getattr(v, need_string(p.get(0), "attr"));
    };
    t["batch"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {"linecount", "fill_with"}, "batch");
      int64_t n = need_int(p.get(0), "batch");
      if (n <= 0) fail("batch size must be positive");
      ValueList out, cur;
      for (const auto& item : seq_of(v)) {
        cur.push_back(item);
        if (static_cast<int64_t>(cur.size()) == n) {
          out.push_back(Value::list(std::move(cur)));
          cur.clear();
        }
      }
      if (!cur.empty()) {
        if (p.has(1) && !p.get(1).is_none()) {
          while (static_cast<int64_t>(cur.size()) < n) cur.push_back(p.get(1));
        }
        out.push_back(Value::list(std::move(cur)));
      }
      return Value::iterator(std::move(out));
    };
    t["capitalize"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {}, "capitalize");
      return Value::string(py_str_capitalize(v.str()));
    };
    t["center"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {"width"}, "center");
      return Value::string(py_str_pad(v.str(), p.integer(0, 80), " ", 'c'));
    };
    t["length"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {}, "length");
      return Value::integer(v.length());
    };
    t["count"] = t["length"];
    t["default"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {"default_value", "boolean"}, "default");
      bool use_default = v.is_undefined() || (p.flag(1, false) && !v.truthy());
      return use_default ? p.get(0, Value::string("")) : v;
    };
    t["d"] = t["default"];
    t["dictsort"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {"case_sensitive", "by", "reverse"}, "dictsort");
      if (!v.is_dict()) fail("dictsort requires a dict");
      bool cs = p.flag(0, false);
      std::string by = p.str(1, "key");
      if (by != "key" && by != "value") fail("You can only sort by either 'key' or 'value'");
      size_t pos = by == "key" ? 0 : 1;
      bool rev = p.flag(2, false);
      ValueList items;
      for (const auto& [k, e] : v.entries()) items.push_back(Value::tuple({k, e}));
      std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
        Value kx = fold_case(x.items()[pos], cs), ky = fold_case(y.items()[pos], cs);
        return rev ? compare(ky, kx) < 0 : compare(kx, ky) < 0;
      });
      return Value::list(std::move(items));
    };
    t["escape"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {}, "escape");
      return Value::string(html_escape(v.str()));
    };
    t["e"] = t["escape"];
    t["forceescape"] = t["escape"];
    t["first"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {}, "first");
      ValueList items = seq_of(v);
      return items.empty() ? Value::undefined("first", "sequence") : items.front();
    };
    t["last"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {}, "last");
      if (v.flavor() == Value::Flavor::kIterator) fail("'generator' object is not reversible");
      ValueList items = seq_of(v);
      return items.empty() ? Value::undefined("last", "sequence") : items.back();
    };
    t["float"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {"default"}, "float");
      if (v.is_number()) return Value::number(v.as_double());
      if (v.is_string()) {
        if (auto f = parse_py_float(v.as_string())) return Value::number(*f);
      }
      return p.get(0, Value::number(0.0));
    };
    t["int"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {"default", "base"}, "int");
      if (v.is_int() || v.is_bool()) return Value::integer(v.as_int());
      if (v.is_float()) {
        double d = v.as_double();
        if (std::isfinite(d)) return Value::integer(static_cast<int64_t>(std::trunc(d)));
      }
      if (v.is_string()) {
        if (auto i = parse_py_int(v.as_string(), static_cast<int>(p.integer(1, 10)))) {
          return Value::integer(*i);
        }
        if (auto f = parse_py_float(v.as_string())) {
          if (std::isfinite(*f)) return Value::integer(static_cast<int64_t>(std::trunc(*f)));
        }
      }
      return p.get(0, Value::integer(0));
    };
    t["format"] = [](Renderer&, const Value& v, const CallArgs& a) {
      if (!a.args.empty() && !a.kwargs.empty()) {
        fail("can't handle positional and keyword arguments at the same time");
      }
      Value args;
      if (!a.kwargs.empty()) {
        ValueDict d;
        for (const auto& [k, x] : a.kwargs) d.emplace_back(Value::string(k), x);
        args = Value::dict(std::move(d));
      } else {
        args = Value::tuple(a.args);
      }
      return Value::string(percent_format(v.str(), args));
    };
    t["indent"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {"width", "first", "blank"}, "indent");
      std::string pad =
          p.has(0) && p.get(0).is_string()
              ? p.get(0).as_string()
              : std::string(static_cast<size_t>(std::max<int64_t>(p.integer(0, 4), 0)), ' ');
      std::string s = need_string(v, "indent") + "\n";
      std::vector<std::string> lines = py_str_splitlines(s);
      std::string out;
      if (p.flag(2, false)) {
        for (size_t i = 0; i < lines.size(); ++i) {
          if (i) out += "\n" + pad;
          out += lines[i];
        }
      } else {
        out = lines.empty() ? "" : lines[0];
        for (size_t i = 1; i < lines.size(); ++i) {
          out += "\n";
          if (!lines[i].empty()) out += pad;
          out += lines[i];
        }
      }
      if (p.flag(1, false)) out = pad + out;
      return Value::string(std::move(out));
    };
    t["items"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {}, "items");
      if (v.is_undefined()) return Value::iterator({});
      if (!v.is_dict())
        fail(std::string("can only get item pairs from a mapping, not ") + v.type_name());
      ValueList out;
      for (const auto& [k, e] : v.entries()) out.push_back(Value::tuple({k, e}));
      return Value::iterator(std::move(out));
    };
    t["join"] = [](Renderer& r, const Value& v, const CallArgs& a) {
      Params p(a, {"d", "attribute"}, "join");
      std::string sep = p.str(0, "");
      std::string out;
      bool first = true;
      for (const auto& item : seq_of(v)) {
        if (!first) out += sep;
        first = false;
        out += (p.has(1) && !p.get(1).is_none() ? r.get_path(item, p.get(1)) : item).str();
      }
      return Value::string(std::move(out));
    };
    t["list"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {}, "list");
      return Value::list(seq_of(v));
    };
    t["lower"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {}, "lower");
      return Value::string(py_str_lower(v.str()));
    };
    t["upper"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {}, "upper");
      return Value::string(py_str_upper(v.str()));
    };
    t["map"] = [](Renderer& r, const Value& v, const CallArgs& a) {
      ValueList out;
      const Value* attribute = nullptr;
      const Value* dflt = nullptr;
      for (const auto& [k, x] : a.kwargs) {
        if (k == "attribute") {
          attribute = &x;
        } else if (k == "default") {
          dflt = &x;
        } else if (!a.args.empty()) {
          continue;  // keyword argument of the mapped filter
        } else {
          fail("map got an unexpected keyword argument '" + k + "'");
        }
      }
      ValueList items = seq_of(v);
      if (attribute) {
        for (const auto& item : items) {
          Value x = r.get_path(item, *attribute);
          if (x.is_undefined() && dflt) x = *dflt;
          out.push_back(x);
        }
        return Value::iterator(std::move(out));
      }
      if (a.args.empty()) fail("map requires a filter name or attribute=");
      std::string name = need_string(a.args[0], "map filter name");
      CallArgs fargs;
      fargs.args.assign(a.args.begin() + 1, a.args.end());
      fargs.kwargs = a.kwargs;
      for (const auto& item : items) out.push_back(r.run_filter(name, item, fargs));
      return Value::iterator(std::move(out));
    };
    auto minmax = [](bool want_max) {
      return [want_max](Renderer& r, const Value& v, const CallArgs& a) {
        Params p(a, {"case_sensitive", "attribute"}, want_max ? "max" : "min");
        bool cs = p.flag(0, false);
        ValueList items = seq_of(v);
        if (items.empty()) return Value::undefined(want_max ? "max" : "min", "empty sequence");
        auto key = [&](const Value& x) {
          return fold_case(p.has(1) && !p.get(1).is_none() ? r.get_path(x, p.get(1)) : x, cs);
        };
        Value best = items[0];
        Value best_key = key(best);
        for (size_t i = 1; i < items.size(); ++i) {
          Value k = key(items[i]);
          int c = compare(k, best_key);
          if (want_max ? c > 0 : c < 0) {
            best = items[i];
            best_key = k;
          }
        }
        return best;
      };
    };
    t["max"] = minmax(true);
    t["min"] = minmax(false);
    t["reject"] = [](Renderer& r, const Value& v, const CallArgs& a) {
      return Value::iterator(select_items(r, v, a, false, false));
    };
    t["select"] = [](Renderer& r, const Value& v, const CallArgs& a) {
      return Value::iterator(select_items(r, v, a, false, true));
    };
    t["rejectattr"] = [](Renderer& r, const Value& v, const CallArgs& a) {
      return Value::iterator(select_items(r, v, a, true, false));
    };
    t["selectattr"] = [](Renderer& r, const Value& v, const CallArgs& a) {
      return Value::iterator(select_items(r, v, a, true, true));
    };
    t["replace"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {"old", "new", "count"}, "replace");
      int64_t count = p.has(2) && !p.get(2).is_none() ? need_int(p.get(2), "replace") : -1;
      return Value::string(py_str_replace(v.str(), p.get(0).str(), p.get(1).str(), count));
    };
    t["reverse"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {}, "reverse");
      if (v.is_string()) {
        std::u32string s = utf8_decode(v.as_string());
        std::reverse(s.begin(), s.end());
        return Value::string(utf8_encode(s));
      }
      ValueList items = seq_of(v);
      std::reverse(items.begin(), items.end());
      return Value::iterator(std::move(items));
    };
    t["round"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {"precision", "method"}, "round");
      int64_t precision = p.integer(0, 0);
      std::string method = p.str(1, "common");
      if (!v.is_number()) fail(std::string("type ") + v.type_name() + " doesn't define __round__");
      if (method == "common") {
        if (!v.is_float()) return Value::integer(v.as_int());
        return Value::number(py_round(v.as_double(), precision));
      }
      if (method != "ceil" && method != "floor") fail("method must be common, ceil or floor");
      double scale = std::pow(10.0, static_cast<double>(precision));
      double x = v.as_double() * scale;
      x = method == "ceil" ? std::ceil(x) : std::floor(x);
      return Value::number(x / scale);
    };
    t["safe"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {}, "safe");
      return Value::string(v.str());
    };
    t["sort"] = [](Renderer& r, const Value& v, const CallArgs& a) {
      Params p(a, {"reverse", "case_sensitive", "attribute"}, "sort");
      bool rev = p.flag(0, false), cs = p.flag(1, false);
      ValueList items = seq_of(v);
      auto key = [&](const Value& x) {
        return fold_case(p.has(2) && !p.get(2).is_none() ? r.get_path(x, p.get(2)) : x, cs);
      };
      std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
        return rev ? compare(key(y), key(x)) < 0 : compare(key(x), key(y)) < 0;
      });
      return Value::list(std::move(items));
    };
    t["string"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {}, "string");
      return Value::string(v.str());
    };
    t["sum"] = [](Renderer& r, const Value& v, const CallArgs& a) {
      Params p(a, {"attribute", "start"}, "sum");
      Value total = p.get(1, Value::integer(0));
      for (const auto& item : seq_of(v)) {
        total = binary_op("+", total,
                          p.has(0) && !p.get(0).is_none() ? r.get_path(item, p.get(0)) : item);
      }
      return total;
    };
    t["title"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {}, "title");
      return Value::string(jinja_title(v.str()));
    };
    t["tojson"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {"ensure_ascii", "indent", "separators", "sort_keys"}, "tojson");
      return Value::string(to_json(v, json_options(p)));
    };
    t["trim"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {"chars"}, "trim");
      std::optional<std::string> chars;
      if (p.has(0) && !p.get(0).is_none()) chars = p.get(0).str();
      return Value::string(py_str_strip(v.str(), chars, true, true));
    };
    t["truncate"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {"length", "killwords", "end", "leeway"}, "truncate");
      int64_t length = p.integer(0, 255), leeway = p.integer(3, 5);
      std::string end = p.str(2, "...");
      if (!v.is_string()) {
        if (static_cast<int64_t>(v.length()) <= length + leeway) return v;
        fail(std::string("truncate expects a string, got ") + v.type_name());
      }
      std::u32string s = utf8_decode(v.str());
      int64_t end_len = static_cast<int64_t>(utf8_decode(end).size());
      if (length < end_len) fail("expected length >= " + std::to_string(end_len));
      if (static_cast<int64_t>(s.size()) <= length + leeway) return Value::string(v.str());
      std::u32string head = s.substr(0, static_cast<size_t>(length - end_len));
      if (!p.flag(1, false)) {
        size_t sp = head.rfind(U' ');
        if (sp != std::u32string::npos) head = head.substr(0, sp);
      }
      return Value::string(utf8_encode(head) + end);
    };
    t["unique"] = [](Renderer& r, const Value& v, const CallArgs& a) {
      Params p(a, {"case_sensitive", "attribute"}, "unique");
      bool cs = p.flag(0, false);
      ValueList out, seen;
      for (const auto& item : seq_of(v)) {
        Value k =
            fold_case(p.has(1) && !p.get(1).is_none() ? r.get_path(item, p.get(1)) : item, cs);
        bool dup =
            std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return equals(s, k); });
        if (!dup) {
          seen.push_back(k);
          out.push_back(item);
        }
      }
      return Value::iterator(std::move(out));
    };
    t["wordcount"] = [](Renderer&, const Value& v, const CallArgs& a) {
      Params p(a, {}, "wordcount");
      int64_t n = 0;
      bool in_word = false;
      for (char32_t c : utf8_decode(v.str())) {
        bool w = c == '_' || py_isalnum(c);
        if (w && !in_word) ++n;
        in_word = w;
      }
      return Value::integer(n);
    };
    return t;
  }();
  return table;
}

// ---------------------------------------------------------------------------------------------
// Tests

const std::map<std::string, TestFn, std::less<>>& test_table() {
  static const std::map<std::string, TestFn, std::less<>> table = [] {
    std::map<std::string, TestFn, std::less<>> t;
    auto simple = [](auto pred) {
      return [pred](Renderer&, const Value& v, const CallArgs& a) {
        Params p(a, {}, "test");
        return pred(v);
      };
    };
    auto with_arg = [](auto pred) {
      return [pred](Renderer&, const Value& v, const CallArgs& a) {
        Params p(a, {"other"}, "test");
        return pred(v, p.get(0));
      };
    };
    t["defined"] = simple([](const Value& v) { return !v.is_undefined(); });
    t["undefined"] = simple([](const Value& v) { return v.is_undefined(); });
    t["none"] = simple([](const Value& v) { return v.is_none(); });
    t["boolean"] = simple([](const Value& v) { return v.is_bool(); });
    t["true"] = simple([](const Value& v) { return v.is_bool() && v.as_bool(); });
    t["false"] = simple([](const Value& v) { return v.is_bool() && !v.as_bool(); });
    t["integer"] = simple([](const Value& v) { return v.is_int(); });
    t["float"] = simple([](const Value& v) { return v.is_float(); });
    t["number"] = simple([](const Value& v) { return v.is_number(); });
    t["string"] = simple([](const Value& v) { return v.is_string(); });
    t["mapping"] = simple([](const Value& v) { return v.is_dict(); });
    t["iterable"] = simple([](const Value& v) {
      return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined();
    });
    t["sequence"] = simple([](const Value& v) {
      return v.is_string() || v.is_sequence() || v.is_dict() || v.is_undefined();
    });
    // Undefined has __call__ (it raises), so Python's callable() says True.
    t["callable"] = simple([](const Value& v) { return v.is_callable() || v.is_undefined(); });
    t["escaped"] = simple([](const Value&) { return false; });
    t["lower"] =
        simple([](const Value& v) { return v.is_string() && py_str_is(v.as_string(), 'l'); });
    t["upper"] =
        simple([](const Value& v) { return v.is_string() && py_str_is(v.as_string(), 'u'); });
    // value % 2 == 1, with Python's % (floats allowed, strings are %-formatting and fail).
    auto mod_is = [](const Value& v, const Value& d, int64_t want) {
      if (v.is_string()) fail("not all arguments converted during string formatting");
      return equals(binary_op("%", v, d), Value::integer(want));
    };
    t["odd"] = simple([mod_is](const Value& v) { return mod_is(v, Value::integer(2), 1); });
    t["even"] = simple([mod_is](const Value& v) { return mod_is(v, Value::integer(2), 0); });
    t["divisibleby"] =
        with_arg([mod_is](const Value& v, const Value& n) { return mod_is(v, n, 0); });
    t["eq"] = with_arg([](const Value& v, const Value& o) { return equals(v, o); });
    t["equalto"] = t["eq"];
    t["=="] = t["eq"];
    t["ne"] = with_arg([](const Value& v, const Value& o) { return !equals(v, o); });
    t["!="] = t["ne"];
    t["lt"] = with_arg([](const Value& v, const Value& o) { return compare(v, o) < 0; });
    t["lessthan"] = t["lt"];
    t["<"] = t["lt"];
    t["le"] = with_arg([](const Value& v, const Value& o) { return compare(v, o) <= 0; });
    t["<="] = t["le"];
    t["gt"] = with_arg([](const Value& v, const Value& o) { return compare(v, o) > 0; });
    t["greaterthan"] = t["gt"];
    t[">"] = t["gt"];
    t["ge"] = with_arg([](const Value& v, const Value& o) { return compare(v, o) >= 0; });
    t[">="] = t["ge"];
    t["in"] = with_arg([](const Value& v, const Value& seq) { return contains(seq, v); });
    t["sameas"] = with_arg([](const Value& v, const Value& o) { return identical(v, o); });
    t["filter"] = simple(
        [](const Value& v) { return v.is_string() && filter_table().count(v.as_string()) > 0; });
    t["test"] = simple(
        [](const Value& v) { return v.is_string() && test_table().count(v.as_string()) > 0; });
    return t;
  }();
  return table;
}

}  // namespace

bool is_known_filter(std::string_view name) { return filter_table().count(name) > 0; }
bool is_known_test(std::string_view name) { return test_table().count(name) > 0; }

std::string render_template(const Template& tmpl, const Value& context) {
  Renderer renderer(context);
  return renderer.render(tmpl);
}

}  // namespace moeinfer::jinja
