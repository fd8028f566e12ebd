// Errors carry the source location; only main() turns them into an exit code and only the HTTP
// layer into an OpenAI error object.
#pragma once

#include <source_location>
#include <sstream>
#include <stdexcept>
#include <string>

namespace moeinfer {

class Error : public std::runtime_error {
 public:
  Error(const std::string& message, std::source_location where)
      : std::runtime_error(message), where_(where) {}
  const std::source_location& where() const { return where_; }

 private:
  std::source_location where_;
};

namespace detail {
template <typename... Args>
[[noreturn]] void throw_error(std::source_location where, const Args&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  throw Error(out.str(), where);
}
}  // namespace detail

}  // namespace moeinfer

// MOE_CHECK(cond, "message with ", value): throws moeinfer::Error when cond is false.
#define MOE_CHECK(cond, ...)                                                               \
  do {                                                                                     \
    if (!(cond)) [[unlikely]]                                                              \
      ::moeinfer::detail::throw_error(std::source_location::current(), __VA_ARGS__);      \
  } while (0)

#define MOE_FAIL(...) ::moeinfer::detail::throw_error(std::source_location::current(), __VA_ARGS__)
