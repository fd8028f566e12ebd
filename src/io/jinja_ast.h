// Syntax tree of the Jinja-subset renderer, the parser that builds it and the renderer that walks
// it.
//
// The parser follows jinja2's grammar and operator precedence (including its quirks: `**` is left
// associative, `is` tests bind tighter than `not` and comparisons, `x if c` without `else` is
// undefined when c is false). The lexer applies the whitespace rules of the environment
// transformers builds: trim_blocks, lstrip_blocks, `-`/`+` markers, one trailing newline dropped.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "io/jinja_value.h"

namespace moeinfer::jinja {

struct Expr;
struct Stmt;
using ExprPtr = std::unique_ptr<Expr>;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Expr {
  enum class Type {
    kConst,    // value
    kName,     // name
    kGetAttr,  // args[0].name
    kGetItem,  // args[0][args[1]]
    kSlice,    // args[0][args[1]:args[2]:args[3]], absent parts are null
    kCall,     // args[0](args[1..], kwargs, *star, **star_star)
    kFilter,   // args[0] | name(args[1..], kwargs); args[0] null inside filter blocks
    kTest,     // args[0] is [not] name(args[1..], kwargs)
    kUnary,    // name in {"-", "+", "not"} of args[0]
    kBinary,   // args[0] name args[1], name in {+ - * / // % ** ~ and or}
    kCompare,  // args[0] ops[0] args[1] ops[1] args[2] ...
    kCond,     // args[0] if args[1] else args[2] (null: undefined)
    kList,
    kTuple,
    kDict,  // args: key0, value0, key1, value1, ...
  };
  Type type;
  int line = 0;
  Value value;
  std::string name;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  ExprPtr star;
  ExprPtr star_star;
  std::vector<std::string> ops;
  bool negated = false;
  bool unknown = false;  // filter/test not known at parse time: fails when evaluated
};

struct MacroParam {
  std::string name;
  ExprPtr default_value;  // null: required
};

struct Stmt {
  enum class Type {
    kText,         // text
    kOutput,       // {{ expr }}
    kIf,           // branches (cond, body); else_body
    kFor,          // for target in expr [if cond]: body else else_body
    kSet,          // set target = expr
    kSetBlock,     // set target [| filter]: body
    kMacro,        // macro name(params): body
    kCallBlock,    // call(params) expr: body
    kFilterBlock,  // filter expr(filter chain with null input): body
    kWith,         // with assignments: body
    kBreak,
    kContinue,
    kScope,  // body rendered as is ({% generation %})
  };
  Type type;
  int line = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr target;
  ExprPtr cond;
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body body;
  Body else_body;
  std::string name;
  std::vector<MacroParam> params;
  std::vector<std::pair<ExprPtr, ExprPtr>> assignments;  // {% with %}
  bool recursive = false;
  // Names that start out undefined in the scope this statement opens (a loop iteration, a macro
  // call, a block): see Template::undefined_names.
  std::vector<std::string> undefined_names;
  std::vector<std::string> else_undefined_names;  // for the else block of a loop
};

struct Template {
  Body body;
  // jinja2 decides per scope, at compile time, where each name comes from. A name whose first use
  // in a scope is an assignment (and that no enclosing scope uses) is a fresh local that is
  // undefined until assigned, even if the context has a value for it; nested scopes see that local.
  // These are such names for the template's top level.
  std::vector<std::string> undefined_names;
};

// Names the renderer implements; the parser rejects others outside `if` blocks, as jinja2 does.
bool is_known_filter(std::string_view name);
bool is_known_test(std::string_view name);

// Throws moeinfer::Error naming the template line.
std::shared_ptr<const Template> parse_template(std::string_view source);
// context: a dict of the template's variables.
std::string render_template(const Template& tmpl, const Value& context);

}  // namespace moeinfer::jinja
