// A bad command line or input file. main() prints it as any error but exits 2, as usage errors
// do, so that a script can tell a refused request from a failed run.
#pragma once

#include <source_location>
#include <sstream>

#include "core/error.h"

namespace moeinfer::cli {

class UsageError : public Error {
 public:
  using Error::Error;
};

template <typename... Parts>
[[noreturn]] void refuse_usage(std::source_location where, const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  throw UsageError(out.str(), where);
}

}  // namespace moeinfer::cli

// USAGE_CHECK(cond, "message with ", value): throws moeinfer::cli::UsageError (exit 2).
#define USAGE_CHECK(cond, ...)                                                     \
  do {                                                                             \
    if (!(cond)) [[unlikely]]                                                      \
      ::moeinfer::cli::refuse_usage(std::source_location::current(), __VA_ARGS__); \
  } while (0)
