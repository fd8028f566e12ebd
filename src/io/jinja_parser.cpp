// Lexer and recursive-descent parser of the Jinja subset.
//
// The lexer cuts the source into data and tag tokens the way jinja2's lexer does with
// trim_blocks=True and lstrip_blocks=True (the settings transformers renders chat templates with),
// so whitespace comes out byte-identical. The parser mirrors jinja2's parse_* functions one for
// one.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <set>

#include "core/error.h"
#include "io/jinja_ast.h"

namespace moeinfer::jinja {
namespace {

struct Token {
  enum class Type {
    kData,
    kVarBegin,
    kVarEnd,
    kBlockBegin,
    kBlockEnd,
    kName,
    kString,
    kInt,
    kFloat,
    kOp,
    kEof
  };
  Type type;
  std::string text;
  int64_t ival = 0;
  double fval = 0;
  int line = 1;
};

[[noreturn]] void syntax_error(int line, const std::string& message) {
  MOE_FAIL("chat template line ", line, ": syntax error: ", message);
}

bool is_ws(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f' ||
         (c >= 0x1c && c <= 0x1f);
}

class Lexer {
 public:
  explicit Lexer(std::string_view source) {
    // Newlines normalised to \n, and one trailing newline dropped (keep_trailing_newline=False).
    src_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_ += '\n';
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_ += source[i];
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  std::vector<Token> run() {
    bool line_starting = true;
    while (pos_ < src_.size()) {
      size_t t = find_tag(pos_);
      if (t == std::string::npos) {
        push_data(src_.substr(pos_), line_at(pos_));
        pos_ = src_.size();
        break;
      }
      char kind = src_[t + 1];
      char sign =
          (t + 2 < src_.size() && (src_[t + 2] == '-' || src_[t + 2] == '+')) ? src_[t + 2] : 0;
      std::string text = src_.substr(pos_, t - pos_);
      int text_line = line_at(pos_);
      if (sign == '-') {
        size_t end = text.size();
        while (end > 0 && is_ws(text[end - 1])) --end;
        text.resize(end);
      } else if (sign != '+' && kind != '{') {
        size_t l_pos = text.rfind('\n');
        l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
        if (l_pos > 0 || line_starting) {
          bool only_blank = std::all_of(text.begin() + static_cast<long>(l_pos), text.end(),
                                        [](char c) { return c == ' ' || c == '\t'; });
          if (only_blank) text.resize(l_pos);
        }
      }
      push_data(std::move(text), text_line);
      size_t p = t + 2 + (sign ? 1 : 0);
      if (kind == '#') {
        line_starting = lex_comment(t, p);
      } else if (kind == '%' && is_raw(p)) {
        line_starting = lex_raw(t, p);
      } else {
        line_starting = lex_tag(kind, t, p);
      }
    }
    tokens_.push_back(Token{Token::Type::kEof, "", 0, 0, line_at(src_.size())});
    return std::move(tokens_);
  }

 private:
  int line_at(size_t pos) {
    // Lines are counted incrementally: positions only move forward.
    while (line_pos_ < pos && line_pos_ < src_.size()) {
      if (src_[line_pos_] == '\n') ++line_;
      ++line_pos_;
    }
    return line_;
  }

  size_t find_tag(size_t from) const {
    for (size_t i = from; i + 1 < src_.size(); ++i) {
      if (src_[i] == '{' && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) {
        return i;
      }
    }
    return std::string::npos;
  }

  void push_data(std::string text, int line) {
    if (text.empty()) return;
    tokens_.push_back(Token{Token::Type::kData, std::move(text), 0, 0, line});
  }

  // Consumes a tag end at p: "-%}" plus all whitespace after it, "+%}", or "%}" plus one newline.
  // Returns whether the consumed text ends with a newline (jinja2's line_starting).
  bool consume_end(size_t& p, char kind, bool trim_newline) {
    char close = kind == '{' ? '}' : (kind == '%' ? '%' : '#');
    if (src_[p] == '-') {
      p += 3;
      size_t start = p;
      while (p < src_.size() && is_ws(src_[p])) ++p;
      return p > start && src_[p - 1] == '\n';
    }
    if (src_[p] == '+' && kind != '{') {
      p += 3;
      return false;
    }
    p += 2;
    (void)close;
    if (trim_newline && kind != '{' && p < src_.size() && src_[p] == '\n') {
      ++p;
      return true;
    }
    return false;
  }

  bool at_end(size_t p, char kind) const {
    char c1 = kind == '{' ? '}' : (kind == '%' ? '%' : '#');
    auto is_close = [&](size_t q) {
      return q + 1 < src_.size() && src_[q] == c1 && src_[q + 1] == '}';
    };
    if (is_close(p)) return true;
    if (p < src_.size() && src_[p] == '-' && is_close(p + 1)) return true;
    if (kind != '{' && p < src_.size() && src_[p] == '+' && is_close(p + 1)) return true;
    return false;
  }

  bool lex_comment(size_t t, size_t p) {
    int line = line_at(t);
    size_t q = src_.find("#}", p);
    if (q == std::string::npos) syntax_error(line, "missing end of comment tag");
    size_t end = q;
    if (q > p && (src_[q - 1] == '-' || src_[q - 1] == '+')) end = q - 1;
    pos_ = end;
    bool ls = consume_end(pos_, '#', true);
    return ls;
  }

  bool is_raw(size_t p) const {
    size_t q = p;
    while (q < src_.size() && is_ws(src_[q])) ++q;
    if (src_.compare(q, 3, "raw") != 0) return false;
    q += 3;
    while (q < src_.size() && is_ws(src_[q])) ++q;
    return at_end(q, '%');
  }

  bool lex_raw(size_t t, size_t p) {
    int line = line_at(t);
    while (is_ws(src_[p])) ++p;
    p += 3;
    while (is_ws(src_[p])) ++p;
    // The raw begin tag: "-%}" strips what follows, "%}" keeps the newline.
    if (src_[p] == '-') {
      p += 3;
      while (p < src_.size() && is_ws(src_[p])) ++p;
    } else {
      p += 2;
    }
    // Find {% endraw %}.
    size_t search = p;
    while (true) {
      size_t q = src_.find("{%", search);
      if (q == std::string::npos) syntax_error(line, "missing end of raw directive");
      size_t r = q + 2;
      char sign = (src_[r] == '-' || src_[r] == '+') ? src_[r] : 0;
      if (sign) ++r;
      while (r < src_.size() && is_ws(src_[r])) ++r;
      if (src_.compare(r, 6, "endraw") == 0) {
        r += 6;
        while (r < src_.size() && is_ws(src_[r])) ++r;
        if (at_end(r, '%')) {
          std::string text = src_.substr(p, q - p);
          if (sign == '-') {
            size_t e = text.size();
            while (e > 0 && is_ws(text[e - 1])) --e;
            text.resize(e);
          } else if (sign != '+') {
            size_t l_pos = text.rfind('\n');
            l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
            if (l_pos > 0 && std::all_of(text.begin() + static_cast<long>(l_pos), text.end(),
                                         [](char c) { return c == ' ' || c == '\t'; })) {
              text.resize(l_pos);
            }
          }
          push_data(std::move(text), line_at(p));
          pos_ = r;
          return consume_end(pos_, '%', true);
        }
      }
      search = q + 2;
    }
  }

  bool lex_tag(char kind, size_t t, size_t p) {
    int line = line_at(t);
    tokens_.push_back(
        Token{kind == '{' ? Token::Type::kVarBegin : Token::Type::kBlockBegin, "", 0, 0, line});
    std::vector<char> brackets;  // an end delimiter inside open brackets is not the tag's end
    while (true) {
      while (p < src_.size() && is_ws(src_[p])) ++p;
      if (p >= src_.size()) syntax_error(line_at(p), "unexpected end of template inside a tag");
      if (brackets.empty() && at_end(p, kind)) {
        int end_line = line_at(p);
        bool ls = consume_end(p, kind, true);
        tokens_.push_back(
            Token{kind == '{' ? Token::Type::kVarEnd : Token::Type::kBlockEnd, "", 0, 0, end_line});
        pos_ = p;
        return ls;
      }
      lex_token(p);
      const Token& tok = tokens_.back();
      if (tok.type == Token::Type::kOp) {
        char c = tok.text[0];
        if (c == '(' || c == '[' || c == '{') {
          brackets.push_back(c == '(' ? ')' : (c == '[' ? ']' : '}'));
        } else if (c == ')' || c == ']' || c == '}') {
          if (brackets.empty() || brackets.back() != c) {
            syntax_error(tok.line, std::string("unexpected '") + c + "'");
          }
          brackets.pop_back();
        }
      }
    }
  }

  static bool is_digit(char c) { return c >= '0' && c <= '9'; }
  static bool is_name_start(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  }

  // Digits with single underscores between them; returns the end, or start when none.
  size_t scan_digits(size_t p) const {
    size_t q = p;
    if (q >= src_.size() || !is_digit(src_[q])) return p;
    while (q < src_.size() && is_digit(src_[q])) {
      ++q;
      if (q + 1 < src_.size() && src_[q] == '_' && is_digit(src_[q + 1])) ++q;
    }
    return q;
  }

  void lex_token(size_t& p) {
    int line = line_at(p);
    char c = src_[p];
    if (is_digit(c)) {
      // 0x / 0o / 0b integers.
      if (c == '0' && p + 2 < src_.size() &&
          (src_[p + 1] == 'x' || src_[p + 1] == 'X' || src_[p + 1] == 'o' || src_[p + 1] == 'O' ||
           src_[p + 1] == 'b' || src_[p + 1] == 'B')) {
        char base_c = static_cast<char>(src_[p + 1] | 0x20);
        int base = base_c == 'x' ? 16 : (base_c == 'o' ? 8 : 2);
        size_t q = p + 2;
        std::string digits;
        while (q < src_.size() &&
               (std::isxdigit(static_cast<unsigned char>(src_[q])) || src_[q] == '_')) {
          if (src_[q] != '_') digits += src_[q];
          ++q;
        }
        if (!digits.empty()) {
          Token tok{Token::Type::kInt, src_.substr(p, q - p), 0, 0, line};
          tok.ival = std::strtoll(digits.c_str(), nullptr, base);
          tokens_.push_back(tok);
          p = q;
          return;
        }
      }
      size_t q = scan_digits(p);
      bool is_float = false;
      if (q + 1 < src_.size() && src_[q] == '.' && is_digit(src_[q + 1])) {
        q = scan_digits(q + 1);
        is_float = true;
      }
      if (q < src_.size() && (src_[q] == 'e' || src_[q] == 'E')) {
        size_t r = q + 1;
        if (r < src_.size() && (src_[r] == '+' || src_[r] == '-')) ++r;
        size_t s = scan_digits(r);
        if (s > r) {
          q = s;
          is_float = true;
        }
      }
      std::string text = src_.substr(p, q - p);
      std::string clean;
      for (char d : text) {
        if (d != '_') clean += d;
      }
      Token tok{is_float ? Token::Type::kFloat : Token::Type::kInt, text, 0, 0, line};
      if (is_float) {
        tok.fval = std::strtod(clean.c_str(), nullptr);
      } else {
        tok.ival = std::strtoll(clean.c_str(), nullptr, 10);
      }
      tokens_.push_back(tok);
      p = q;
      return;
    }
    if (is_name_start(c)) {
      size_t q = p;
      while (q < src_.size() && (is_name_start(src_[q]) || is_digit(src_[q]))) ++q;
      tokens_.push_back(Token{Token::Type::kName, src_.substr(p, q - p), 0, 0, line});
      p = q;
      return;
    }
    if (c == '\'' || c == '"') {
      size_t q = p + 1;
      while (q < src_.size() && src_[q] != c) {
        if (src_[q] == '\\') ++q;
        ++q;
      }
      if (q >= src_.size()) syntax_error(line, "unterminated string");
      tokens_.push_back(
          Token{Token::Type::kString, unescape(src_.substr(p + 1, q - p - 1)), 0, 0, line});
      p = q + 1;
      return;
    }
    static const char* kOps[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/",
                                 "*",  "%",  "~",  "[",  "]",  "(",  ")", "{", "}",
                                 ">",  "<",  "=",  ".",  ":",  "|",  ",", ";"};
    for (const char* op : kOps) {
      size_t n = std::char_traits<char>::length(op);
      if (src_.compare(p, n, op) == 0) {
        tokens_.push_back(Token{Token::Type::kOp, op, 0, 0, line});
        p += n;
        return;
      }
    }
    syntax_error(line, std::string("unexpected char '") + c + "'");
  }

  // Python's unicode-escape decoding of a string literal's body.
  static std::string unescape(const std::string& s) {
    std::string out;
    for (size_t i = 0; i < s.size(); ++i) {
      if (s[i] != '\\' || i + 1 >= s.size()) {
        out += s[i];
        continue;
      }
      char e = s[++i];
      auto hex = [&](size_t n) -> bool {
        if (i + n >= s.size() + 0 && i + n > s.size() - 1 + 1) return false;
        if (i + n >= s.size()) return false;
        char32_t v = 0;
        for (size_t k = 1; k <= n; ++k) {
          char h = s[i + k];
          if (!std::isxdigit(static_cast<unsigned char>(h))) return false;
          v = v * 16 + static_cast<char32_t>(std::isdigit(static_cast<unsigned char>(h))
                                                 ? h - '0'
                                                 : (h | 0x20) - 'a' + 10);
        }
        utf8_append(out, v);
        i += n;
        return true;
      };
      switch (e) {
        case '\n':
          break;
        case '\\':
          out += '\\';
          break;
        case '\'':
          out += '\'';
          break;
        case '"':
          out += '"';
          break;
        case 'a':
          out += '\a';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'v':
          out += '\v';
          break;
        case 'x':
          if (!hex(2)) out += "\\x";
          break;
        case 'u':
          if (!hex(4)) out += "\\u";
          break;
        case 'U':
          if (!hex(8)) out += "\\U";
          break;
        default:
          if (e >= '0' && e <= '7') {
            int v = e - '0';
            for (int k = 0; k < 2 && i + 1 < s.size() && s[i + 1] >= '0' && s[i + 1] <= '7'; ++k) {
              v = v * 8 + (s[++i] - '0');
            }
            utf8_append(out, static_cast<char32_t>(v));
          } else {
            out += '\\';
            out += e;
          }
      }
    }
    return out;
  }

  std::string src_;
  size_t pos_ = 0;
  size_t line_pos_ = 0;
  int line_ = 1;
  std::vector<Token> tokens_;
};

// ---------------------------------------------------------------------------------------------

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : toks_(std::move(tokens)) {}

  Body parse_all() { return subparse({}); }

 private:
  const Token& cur() const { return toks_[pos_]; }
  const Token& peek(size_t n = 1) const { return toks_[std::min(pos_ + n, toks_.size() - 1)]; }
  Token next() { return toks_[pos_ < toks_.size() - 1 ? pos_++ : pos_]; }
  bool is_op(const char* op) const { return cur().type == Token::Type::kOp && cur().text == op; }
  bool is_name(const char* name) const {
    return cur().type == Token::Type::kName && cur().text == name;
  }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    ++pos_;
    return true;
  }
  bool skip_name(const char* name) {
    if (!is_name(name)) return false;
    ++pos_;
    return true;
  }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case Token::Type::kEof:
        return "end of template";
      case Token::Type::kBlockEnd:
        return "end of statement block";
      case Token::Type::kVarEnd:
        return "end of print statement";
      case Token::Type::kData:
        return "template data";
      case Token::Type::kString:
        return "string";
      default:
        return "'" + t.text + "'";
    }
  }
  [[noreturn]] void unexpected() { syntax_error(cur().line, "unexpected " + describe(cur())); }
  void expect_op(const char* op) {
    if (!skip_op(op))
      syntax_error(cur().line, std::string("expected '") + op + "', got " + describe(cur()));
  }
  std::string expect_name() {
    if (cur().type != Token::Type::kName) {
      syntax_error(cur().line, "expected a name, got " + describe(cur()));
    }
    return next().text;
  }
  void expect_block_end() {
    if (cur().type != Token::Type::kBlockEnd) {
      syntax_error(cur().line, "expected end of statement block, got " + describe(cur()));
    }
    ++pos_;
  }
  void expect_end_tag(const char* name) {
    if (!skip_name(name)) syntax_error(cur().line, std::string("expected '") + name + "'");
    expect_block_end();
  }

  static ExprPtr make(Expr::Type type, int line) {
    auto e = std::make_unique<Expr>();
    e->type = type;
    e->line = line;
    return e;
  }
  static StmtPtr make_stmt(Stmt::Type type, int line) {
    auto s = std::make_unique<Stmt>();
    s->type = type;
    s->line = line;
    return s;
  }

  // Parses until a block tag whose first name is in `end`; leaves the parser on that name.
  Body subparse(const std::set<std::string>& end) {
    Body body;
    while (true) {
      const Token& t = cur();
      switch (t.type) {
        case Token::Type::kData: {
          auto s = make_stmt(Stmt::Type::kText, t.line);
          s->text = t.text;
          body.push_back(std::move(s));
          ++pos_;
          break;
        }
        case Token::Type::kVarBegin: {
          ++pos_;
          auto s = make_stmt(Stmt::Type::kOutput, t.line);
          s->expr = parse_tuple(false, true);
          if (cur().type != Token::Type::kVarEnd) {
            syntax_error(cur().line, "expected end of print statement, got " + describe(cur()));
          }
          ++pos_;
          body.push_back(std::move(s));
          break;
        }
        case Token::Type::kBlockBegin: {
          ++pos_;
          if (cur().type == Token::Type::kName && end.count(cur().text)) return body;
          body.push_back(parse_statement());
          break;
        }
        case Token::Type::kEof: {
          if (!end.empty()) {
            std::string names;
            for (const auto& n : end) names += (names.empty() ? "" : " or ") + n;
            syntax_error(t.line, "unexpected end of template, expected " + names);
          }
          return body;
        }
        default:
          unexpected();
      }
    }
  }

  StmtPtr parse_statement() {
    const Token& t = cur();
    if (t.type != Token::Type::kName) syntax_error(t.line, "tag name expected");
    const std::string& n = t.text;
    int line = t.line;
    if (n == "for") return parse_for();
    if (n == "if") return parse_if();
    if (n == "set") return parse_set();
    if (n == "macro") return parse_macro();
    if (n == "call") return parse_call_block();
    if (n == "filter") return parse_filter_block();
    if (n == "with") return parse_with();
    if (n == "break" || n == "continue") {
      if (loop_depth_ == 0) syntax_error(line, "'" + n + "' outside of a loop");
      ++pos_;
      expect_block_end();
      return make_stmt(n == "break" ? Stmt::Type::kBreak : Stmt::Type::kContinue, line);
    }
    if (n == "generation") {
      ++pos_;
      expect_block_end();
      auto s = make_stmt(Stmt::Type::kScope, line);
      s->body = subparse({"endgeneration"});
      expect_end_tag("endgeneration");
      return s;
    }
    syntax_error(line, "encountered unknown tag '" + n + "'");
  }

  StmtPtr parse_for() {
    auto s = make_stmt(Stmt::Type::kFor, cur().line);
    ++pos_;
    s->target = parse_assign_target(false);
    if (!skip_name("in")) syntax_error(cur().line, "expected 'in' in for loop");
    s->expr = parse_tuple(false, false);
    if (skip_name("if")) s->cond = parse_expression(true);
    if (skip_name("recursive")) s->recursive = true;
    expect_block_end();
    ++loop_depth_;
    s->body = subparse({"endfor", "else"});
    --loop_depth_;
    if (skip_name("else")) {
      expect_block_end();
      s->else_body = subparse({"endfor"});
    }
    expect_end_tag("endfor");
    return s;
  }

  StmtPtr parse_if() {
    auto s = make_stmt(Stmt::Type::kIf, cur().line);
    ++pos_;
    while (true) {
      ExprPtr cond = parse_tuple(false, false);
      expect_block_end();
      Body body = subparse({"elif", "else", "endif"});
      s->branches.emplace_back(std::move(cond), std::move(body));
      if (skip_name("elif")) continue;
      if (skip_name("else")) {
        expect_block_end();
        s->else_body = subparse({"endif"});
      }
      break;
    }
    expect_end_tag("endif");
    return s;
  }

  StmtPtr parse_set() {
    int line = cur().line;
    ++pos_;
    ExprPtr target = parse_assign_target(true);
    if (skip_op("=")) {
      auto s = make_stmt(Stmt::Type::kSet, line);
      s->target = std::move(target);
      s->expr = parse_tuple(false, true);
      expect_block_end();
      return s;
    }
    auto s = make_stmt(Stmt::Type::kSetBlock, line);
    s->target = std::move(target);
    if (is_op("|")) s->expr = parse_filter(nullptr, false);
    expect_block_end();
    s->body = subparse({"endset"});
    expect_end_tag("endset");
    return s;
  }

  StmtPtr parse_macro() {
    auto s = make_stmt(Stmt::Type::kMacro, cur().line);
    ++pos_;
    s->name = expect_name();
    parse_signature(*s);
    expect_block_end();
    s->body = subparse({"endmacro"});
    expect_end_tag("endmacro");
    return s;
  }

  void parse_signature(Stmt& s) {
    expect_op("(");
    while (!is_op(")")) {
      if (!s.params.empty()) expect_op(",");
      if (is_op(")")) break;
      MacroParam p;
      p.name = expect_name();
      if (skip_op("=")) {
        p.default_value = parse_expression(true);
      } else if (!s.params.empty() && s.params.back().default_value) {
        syntax_error(cur().line, "non-default argument follows default argument");
      }
      s.params.push_back(std::move(p));
    }
    expect_op(")");
  }

  StmtPtr parse_call_block() {
    auto s = make_stmt(Stmt::Type::kCallBlock, cur().line);
    ++pos_;
    if (is_op("(")) parse_signature(*s);
    s->expr = parse_expression(true);
    if (s->expr->type != Expr::Type::kCall) syntax_error(s->line, "expected call");
    expect_block_end();
    s->body = subparse({"endcall"});
    expect_end_tag("endcall");
    return s;
  }

  StmtPtr parse_filter_block() {
    auto s = make_stmt(Stmt::Type::kFilterBlock, cur().line);
    ++pos_;
    s->expr = parse_filter(nullptr, true);
    expect_block_end();
    s->body = subparse({"endfilter"});
    expect_end_tag("endfilter");
    return s;
  }

  StmtPtr parse_with() {
    auto s = make_stmt(Stmt::Type::kWith, cur().line);
    ++pos_;
    while (cur().type != Token::Type::kBlockEnd) {
      if (!s->assignments.empty()) expect_op(",");
      ExprPtr target = parse_assign_target(false);
      expect_op("=");
      s->assignments.emplace_back(std::move(target), parse_expression(true));
    }
    expect_block_end();
    s->body = subparse({"endwith"});
    expect_end_tag("endwith");
    return s;
  }

  // name | name.attr (namespace, set only) | tuple of names.
  ExprPtr parse_assign_target(bool with_namespace) {
    int line = cur().line;
    if (with_namespace && peek().type == Token::Type::kOp && peek().text == "." &&
        cur().type == Token::Type::kName) {
      auto e = make(Expr::Type::kGetAttr, line);
      auto ns = make(Expr::Type::kName, line);
      ns->name = next().text;
      ++pos_;
      e->name = expect_name();
      e->args.push_back(std::move(ns));
      return e;
    }
    auto parse_one = [&]() -> ExprPtr {
      if (is_op("(")) {
        ++pos_;
        ExprPtr inner = parse_assign_target(false);
        expect_op(")");
        return inner;
      }
      auto n = make(Expr::Type::kName, cur().line);
      n->name = expect_name();
      if (n->name == "true" || n->name == "false" || n->name == "none" || n->name == "True" ||
          n->name == "False" || n->name == "None") {
        syntax_error(line, "can't assign to " + n->name);
      }
      return n;
    };
    ExprPtr first = parse_one();
    if (!is_op(",")) return first;
    auto tuple = make(Expr::Type::kTuple, line);
    tuple->args.push_back(std::move(first));
    while (skip_op(",")) {
      if (cur().type != Token::Type::kName && !is_op("(")) break;
      tuple->args.push_back(parse_one());
    }
    return tuple;
  }

  // ---- expressions ----

  // An expression, or a tuple of expressions separated by commas.
  ExprPtr parse_tuple(bool simplified, bool with_condexpr, bool explicit_parens = false) {
    int line = cur().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_op(",");
      if (tuple_ends()) break;
      if (simplified) {
        items.push_back(parse_primary());
      } else {
        items.push_back(parse_expression(with_condexpr));
      }
      if (is_op(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens) unexpected();
    }
    auto t = make(Expr::Type::kTuple, line);
    t->args = std::move(items);
    return t;
  }

  bool tuple_ends() const {
    const Token& t = cur();
    if (t.type == Token::Type::kVarEnd || t.type == Token::Type::kBlockEnd ||
        t.type == Token::Type::kEof) {
      return true;
    }
    if (t.type == Token::Type::kOp && (t.text == ")" || t.text == "]" || t.text == "}")) {
      return true;
    }
    return t.type == Token::Type::kName &&
           (t.text == "in" || t.text == "if" || t.text == "recursive");
  }

  ExprPtr parse_expression(bool with_condexpr) {
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    int line = cur().line;
    ExprPtr expr1 = parse_or();
    while (skip_name("if")) {
      ExprPtr cond = parse_or();
      ExprPtr expr3;
      if (skip_name("else")) expr3 = parse_condexpr();
      auto c = make(Expr::Type::kCond, line);
      c->args.push_back(std::move(expr1));
      c->args.push_back(std::move(cond));
      c->args.push_back(std::move(expr3));
      expr1 = std::move(c);
    }
    return expr1;
  }

  ExprPtr binary(const std::string& op, ExprPtr l, ExprPtr r, int line) {
    auto b = make(Expr::Type::kBinary, line);
    b->name = op;
    b->args.push_back(std::move(l));
    b->args.push_back(std::move(r));
    return b;
  }

  ExprPtr parse_or() {
    int line = cur().line;
    ExprPtr left = parse_and();
    while (skip_name("or")) left = binary("or", std::move(left), parse_and(), line);
    return left;
  }

  ExprPtr parse_and() {
    int line = cur().line;
    ExprPtr left = parse_not();
    while (skip_name("and")) left = binary("and", std::move(left), parse_not(), line);
    return left;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      int line = next().line;
      auto n = make(Expr::Type::kUnary, line);
      n->name = "not";
      n->args.push_back(parse_not());
      return n;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    int line = cur().line;
    ExprPtr expr = parse_math1();
    ExprPtr cmp;
    while (true) {
      std::string op;
      const Token& t = cur();
      if (t.type == Token::Type::kOp && (t.text == "==" || t.text == "!=" || t.text == "<" ||
                                         t.text == ">" || t.text == "<=" || t.text == ">=")) {
        op = t.text;
        ++pos_;
      } else if (is_name("in")) {
        op = "in";
        ++pos_;
      } else if (is_name("not") && peek().type == Token::Type::kName && peek().text == "in") {
        op = "notin";
        pos_ += 2;
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(Expr::Type::kCompare, line);
        cmp->args.push_back(std::move(expr));
      }
      cmp->ops.push_back(op);
      cmp->args.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(expr);
  }

  ExprPtr parse_math1() {
    int line = cur().line;
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      std::string op = next().text;
      left = binary(op, std::move(left), parse_concat(), line);
    }
    return left;
  }

  ExprPtr parse_concat() {
    int line = cur().line;
    ExprPtr left = parse_math2();
    while (skip_op("~")) left = binary("~", std::move(left), parse_math2(), line);
    return left;
  }

  ExprPtr parse_math2() {
    int line = cur().line;
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      std::string op = next().text;
      left = binary(op, std::move(left), parse_pow(), line);
    }
    return left;
  }

  ExprPtr parse_pow() {
    int line = cur().line;
    ExprPtr left = parse_unary(true);
    while (skip_op("**")) left = binary("**", std::move(left), parse_unary(true), line);
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    int line = cur().line;
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      auto u = make(Expr::Type::kUnary, line);
      u->name = next().text;
      u->args.push_back(parse_unary(false));
      node = std::move(u);
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    int line = t.line;
    switch (t.type) {
      case Token::Type::kName: {
        auto e = make(Expr::Type::kConst, line);
        const std::string& n = t.text;
        if (n == "true" || n == "True") {
          e->value = Value::boolean(true);
        } else if (n == "false" || n == "False") {
          e->value = Value::boolean(false);
        } else if (n == "none" || n == "None") {
          e->value = Value::none();
        } else {
          e->type = Expr::Type::kName;
          e->name = n;
        }
        ++pos_;
        return e;
      }
      case Token::Type::kString: {
        std::string s = next().text;
        while (cur().type == Token::Type::kString) s += next().text;
        auto e = make(Expr::Type::kConst, line);
        e->value = Value::string(std::move(s));
        return e;
      }
      case Token::Type::kInt: {
        auto e = make(Expr::Type::kConst, line);
        e->value = Value::integer(next().ival);
        return e;
      }
      case Token::Type::kFloat: {
        auto e = make(Expr::Type::kConst, line);
        e->value = Value::number(next().fval);
        return e;
      }
      case Token::Type::kOp:
        if (t.text == "(") {
          ++pos_;
          ExprPtr e = parse_tuple(false, true, true);
          expect_op(")");
          return e;
        }
        if (t.text == "[") {
          ++pos_;
          auto e = make(Expr::Type::kList, line);
          while (!is_op("]")) {
            if (!e->args.empty()) expect_op(",");
            if (is_op("]")) break;
            e->args.push_back(parse_expression(true));
          }
          expect_op("]");
          return e;
        }
        if (t.text == "{") {
          ++pos_;
          auto e = make(Expr::Type::kDict, line);
          while (!is_op("}")) {
            if (!e->args.empty()) expect_op(",");
            if (is_op("}")) break;
            e->args.push_back(parse_expression(true));
            expect_op(":");
            e->args.push_back(parse_expression(true));
          }
          expect_op("}");
          return e;
        }
        unexpected();
      default:
        unexpected();
    }
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (is_op(".") || is_op("[")) {
        node = parse_subscript(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is_op("|")) {
        node = parse_filter(std::move(node), false);
      } else if (is_name("is")) {
        node = parse_test(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr node) {
    Token t = next();
    if (t.text == ".") {
      const Token& a = cur();
      if (a.type == Token::Type::kName) {
        auto e = make(Expr::Type::kGetAttr, t.line);
        e->name = next().text;
        e->args.push_back(std::move(node));
        return e;
      }
      if (a.type == Token::Type::kInt) {
        auto e = make(Expr::Type::kGetItem, t.line);
        e->args.push_back(std::move(node));
        auto idx = make(Expr::Type::kConst, t.line);
        idx->value = Value::integer(next().ival);
        e->args.push_back(std::move(idx));
        return e;
      }
      syntax_error(a.line, "expected name or number after '.'");
    }
    // '[': one subscript, a slice, or a tuple of them.
    std::vector<ExprPtr> subs;
    while (!is_op("]")) {
      if (!subs.empty()) {
        expect_op(",");
        if (is_op("]")) break;
      }
      subs.push_back(parse_subscribed());
    }
    expect_op("]");
    if (subs.empty()) syntax_error(t.line, "expected subscript expression");
    ExprPtr index;
    if (subs.size() == 1) {
      index = std::move(subs[0]);
    } else {
      index = make(Expr::Type::kTuple, t.line);
      index->args = std::move(subs);
    }
    if (index->type == Expr::Type::kSlice) {
      index->args[0] = std::move(node);
      return index;
    }
    auto e = make(Expr::Type::kGetItem, t.line);
    e->args.push_back(std::move(node));
    e->args.push_back(std::move(index));
    return e;
  }

  // One subscript; a slice comes back as kSlice with args[0] left for the caller to fill.
  ExprPtr parse_subscribed() {
    int line = cur().line;
    ExprPtr start;
    if (!is_op(":")) {
      start = parse_expression(true);
      if (!is_op(":")) return start;
    }
    ++pos_;  // ':'
    auto slice = make(Expr::Type::kSlice, line);
    slice->args.resize(4);
    slice->args[1] = std::move(start);
    if (!is_op("]") && !is_op(",") && !is_op(":")) slice->args[2] = parse_expression(true);
    if (skip_op(":")) {
      if (!is_op("]") && !is_op(",")) slice->args[3] = parse_expression(true);
    }
    return slice;
  }

  void parse_call_args(Expr& e) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) {
        expect_op(",");
        if (is_op(")")) break;
      }
      first = false;
      if (skip_op("*")) {
        e.star = parse_expression(true);
      } else if (skip_op("**")) {
        e.star_star = parse_expression(true);
      } else if (cur().type == Token::Type::kName && peek().type == Token::Type::kOp &&
                 peek().text == "=") {
        std::string key = next().text;
        ++pos_;
        e.kwargs.emplace_back(key, parse_expression(true));
      } else {
        if (!e.kwargs.empty()) syntax_error(cur().line, "positional argument after keyword");
        e.args.push_back(parse_expression(true));
      }
    }
    expect_op(")");
  }

  ExprPtr parse_call(ExprPtr node) {
    auto e = make(Expr::Type::kCall, cur().line);
    e->args.push_back(std::move(node));
    parse_call_args(*e);
    return e;
  }

  // `| name(args)` repeated; node is null in filter blocks and block sets.
  ExprPtr parse_filter(ExprPtr node, bool start_inline) {
    while (is_op("|") || start_inline) {
      if (!start_inline) ++pos_;
      start_inline = false;
      int line = cur().line;
      std::string name = expect_name();
      while (is_op(".")) {
        ++pos_;
        name += "." + expect_name();
      }
      auto e = make(Expr::Type::kFilter, line);
      e->name = name;
      e->unknown = !is_known_filter(name);
      e->args.push_back(std::move(node));
      if (is_op("(")) {
        parse_call_args(*e);
      }
      node = std::move(e);
    }
    return node;
  }

  ExprPtr parse_test(ExprPtr node) {
    int line = next().line;  // 'is'
    auto e = make(Expr::Type::kTest, line);
    if (skip_name("not")) e->negated = true;
    std::string name = expect_name();
    while (is_op(".")) {
      ++pos_;
      name += "." + expect_name();
    }
    e->name = name;
    e->unknown = !is_known_test(name);
    e->args.push_back(std::move(node));
    const Token& t = cur();
    if (is_op("(")) {
      parse_call_args(*e);
    } else if ((t.type == Token::Type::kName || t.type == Token::Type::kString ||
                t.type == Token::Type::kInt || t.type == Token::Type::kFloat || is_op("[") ||
                is_op("{")) &&
               !(t.type == Token::Type::kName &&
                 (t.text == "else" || t.text == "or" || t.text == "and"))) {
      if (is_name("is")) syntax_error(t.line, "you cannot chain multiple tests with is");
      ExprPtr arg = parse_primary();
      e->args.push_back(parse_postfix(std::move(arg)));
    }
    return e;
  }

  std::vector<Token> toks_;
  size_t pos_ = 0;
  int loop_depth_ = 0;
};

// jinja2 rejects unknown filters and tests when it compiles the template, except inside an `if`
// statement or an `x if c else y` expression, where the error waits until the filter runs.
void check_names(const Expr* e, bool soft);
void check_names(const Body& body, bool soft);

void check_names(const Expr* e, bool soft) {
  if (!e) return;
  if (e->unknown && !soft) {
    syntax_error(e->line, std::string("no ") +
                              (e->type == Expr::Type::kFilter ? "filter" : "test") + " named '" +
                              e->name + "'");
  }
  bool inner_soft = soft || e->type == Expr::Type::kCond;
  for (const auto& a : e->args) check_names(a.get(), inner_soft);
  for (const auto& [k, a] : e->kwargs) check_names(a.get(), inner_soft);
  check_names(e->star.get(), inner_soft);
  check_names(e->star_star.get(), inner_soft);
}

void check_names(const Body& body, bool soft) {
  for (const auto& s : body) {
    bool is_if = s->type == Stmt::Type::kIf;
    // Loops, macros and call blocks open a fresh (not soft) frame in jinja2's compiler.
    bool fresh = s->type == Stmt::Type::kFor || s->type == Stmt::Type::kMacro ||
                 s->type == Stmt::Type::kCallBlock;
    check_names(s->expr.get(), soft || is_if);
    check_names(s->target.get(), soft);
    check_names(s->cond.get(), fresh ? false : soft);
    for (const auto& [cond, branch] : s->branches) {
      check_names(cond.get(), true);
      check_names(branch, true);
    }
    for (const auto& p : s->params) check_names(p.default_value.get(), soft);
    for (const auto& [t, v] : s->assignments) check_names(v.get(), soft);
    check_names(s->body, fresh ? false : soft);
    check_names(s->else_body, fresh ? false : (soft || is_if));
  }
}

// Scope analysis after jinja2's idtracking: in each scope (template, loop body, macro, block), a
// name is a parameter, an alias of an enclosing scope's variable, resolved from the context, or
// undefined until assigned. Only the last kind needs the renderer's attention.
class ScopeAnalysis {
 public:
  enum class Kind { kParam, kAlias, kResolve, kUndefined };

  // A nested body, analysed once its enclosing scope is complete (jinja2 analyses a frame fully
  // before it looks inside the frames it opens).
  struct Pending {
    const Body* body;
    std::vector<std::string>* out;
    std::vector<std::string> params;
    const Expr* target;
    std::vector<const Expr*> first_loads;
  };

  struct Scope {
    const Scope* parent = nullptr;
    std::map<std::string, Kind> refs;
    std::set<std::string> stores;
    std::shared_ptr<std::vector<Pending>> pending = std::make_shared<std::vector<Pending>>();

    bool has_ref(const std::string& name) const {
      for (const Scope* s = this; s; s = s->parent) {
        if (s->refs.count(name)) return true;
      }
      return false;
    }
    std::vector<std::string> undefined() const {
      std::vector<std::string> out;
      for (const auto& [name, kind] : refs) {
        if (kind == Kind::kUndefined) out.push_back(name);
      }
      return out;
    }
  };

  static void load(Scope& scope, const std::string& name) {
    if (!scope.has_ref(name)) scope.refs[name] = Kind::kResolve;
  }
  static void store(Scope& scope, const std::string& name) {
    scope.stores.insert(name);
    if (scope.refs.count(name)) return;
    bool outer = scope.parent && scope.parent->has_ref(name);
    scope.refs[name] = outer ? Kind::kAlias : Kind::kUndefined;
  }

  static void loads(Scope& scope, const Expr* e) {
    if (!e) return;
    if (e->type == Expr::Type::kName) load(scope, e->name);
    for (const auto& a : e->args) loads(scope, a.get());
    for (const auto& [k, a] : e->kwargs) loads(scope, a.get());
    loads(scope, e->star.get());
    loads(scope, e->star_star.get());
  }

  static void stores(Scope& scope, const Expr* target) {
    if (target->type == Expr::Type::kName) {
      store(scope, target->name);
    } else if (target->type == Expr::Type::kTuple) {
      for (const auto& t : target->args) stores(scope, t.get());
    } else if (target->type == Expr::Type::kGetAttr) {
      load(scope, target->args[0]->name);  // {% set ns.attr = ... %} reads ns
    }
  }

  static void params(Scope& scope, const Expr* target) {
    if (target->type == Expr::Type::kName) {
      scope.refs[target->name] = Kind::kParam;
    } else if (target->type == Expr::Type::kTuple) {
      for (const auto& t : target->args) params(scope, t.get());
    }
  }

  // A nested body; its undefined names land in `out` once the enclosing scope is complete.
  static void child(Scope& parent, const Body& body, std::vector<std::string>& out,
                    const std::vector<std::string>& param_names = {}, const Expr* target = nullptr,
                    const std::vector<const Expr*>& first_loads = {}) {
    parent.pending->push_back(Pending{&body, &out, param_names, target, first_loads});
  }

  // Analyses a scope's own level, then the scopes it opens.
  static void run(Scope& scope, const Body& body) {
    visit(scope, body);
    std::vector<Pending> pending = std::move(*scope.pending);
    scope.pending->clear();
    for (const auto& p : pending) {
      Scope inner;
      inner.parent = &scope;
      for (const auto& name : p.params) inner.refs[name] = Kind::kParam;
      if (p.target) params(inner, p.target);
      for (const Expr* e : p.first_loads) loads(inner, e);
      run(inner, *p.body);
      *p.out = inner.undefined();
    }
  }

  // Branches of an `if` are visited on copies of the scope and merged the way jinja2 merges them:
  // a name assigned in only some branches comes from outside (alias or context).
  static void merge_branches(Scope& scope, const std::vector<Scope>& branches) {
    std::map<std::string, size_t> counts;
    for (const auto& b : branches) {
      for (const auto& name : b.stores) {
        if (!scope.stores.count(name)) ++counts[name];
      }
    }
    for (const auto& b : branches) {
      for (const auto& [name, kind] : b.refs) scope.refs[name] = kind;
      scope.stores.insert(b.stores.begin(), b.stores.end());
    }
    for (const auto& [name, count] : counts) {
      if (count == branches.size()) continue;
      bool outer = scope.parent && scope.parent->has_ref(name);
      scope.refs[name] = outer ? Kind::kAlias : Kind::kResolve;
    }
  }

  static void visit_if(Scope& scope, const Stmt& s, size_t branch) {
    loads(scope, s.branches[branch].first.get());
    std::vector<Scope> copies(3, scope);
    visit(copies[0], s.branches[branch].second);
    if (branch + 1 < s.branches.size()) visit_elif(copies[1], s, branch + 1);
    if (branch == 0) visit(copies[2], s.else_body);
    merge_branches(scope, copies);
  }

  // jinja2 keeps `elif`s as If nodes without an else inside the first If's elif branch.
  static void visit_elif(Scope& scope, const Stmt& s, size_t branch) {
    for (size_t i = branch; i < s.branches.size(); ++i) {
      loads(scope, s.branches[i].first.get());
      std::vector<Scope> copies(3, scope);
      visit(copies[0], s.branches[i].second);
      merge_branches(scope, copies);
    }
  }

  static void visit(Scope& scope, const Body& body) {
    for (const auto& sp : body) {
      Stmt& s = *sp;
      switch (s.type) {
        case Stmt::Type::kText:
        case Stmt::Type::kBreak:
        case Stmt::Type::kContinue:
          break;
        case Stmt::Type::kOutput:
          loads(scope, s.expr.get());
          break;
        case Stmt::Type::kIf:
          visit_if(scope, s, 0);
          break;
        case Stmt::Type::kFor:
          loads(scope, s.expr.get());
          child(scope, s.body, s.undefined_names, {"loop"}, s.target.get(), {s.cond.get()});
          child(scope, s.else_body, s.else_undefined_names);
          break;
        case Stmt::Type::kSet:
          loads(scope, s.expr.get());
          stores(scope, s.target.get());
          break;
        case Stmt::Type::kSetBlock:
          child(scope, s.body, s.undefined_names);
          loads(scope, s.expr.get());
          stores(scope, s.target.get());
          break;
        case Stmt::Type::kMacro:
        case Stmt::Type::kCallBlock: {
          if (s.type == Stmt::Type::kMacro) {
            store(scope, s.name);
          } else {
            loads(scope, s.expr.get());
          }
          // Defaults are evaluated inside the macro's own scope, after its parameters.
          std::vector<std::string> names = {"varargs", "kwargs", "caller"};
          std::vector<const Expr*> defaults;
          for (const auto& p : s.params) {
            names.push_back(p.name);
            defaults.push_back(p.default_value.get());
          }
          child(scope, s.body, s.undefined_names, names, nullptr, defaults);
          break;
        }
        case Stmt::Type::kFilterBlock:
          loads(scope, s.expr.get());
          child(scope, s.body, s.undefined_names);
          break;
        case Stmt::Type::kWith: {
          std::vector<std::string> names;
          for (const auto& [target, value] : s.assignments) {
            loads(scope, value.get());
            if (target->type == Expr::Type::kName) names.push_back(target->name);
          }
          child(scope, s.body, s.undefined_names, names);
          break;
        }
        case Stmt::Type::kScope:
          child(scope, s.body, s.undefined_names);
          break;
      }
    }
  }
};

}  // namespace

std::shared_ptr<const Template> parse_template(std::string_view source) {
  Lexer lexer(source);
  Parser parser(lexer.run());
  auto tmpl = std::make_shared<Template>();
  tmpl->body = parser.parse_all();
  check_names(tmpl->body, false);
  ScopeAnalysis::Scope root;
  ScopeAnalysis::run(root, tmpl->body);
  tmpl->undefined_names = root.undefined();
  return tmpl;
}

}  // namespace moeinfer::jinja
