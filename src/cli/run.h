// The `moeinfer` command line as a function, for main() and for the Python module.
#pragma once

#include <string>
#include <vector>

namespace moeinfer::cli {

// Parses argv (argv[0]: the program's name) and runs the subcommand. Errors are printed to
// stderr as "moeinfer: error: ..."; returns the exit status: 0, 1 for a failed run, 2 for a
// usage error (a bad flag, a refused combination), or CLI11's status for its own parse errors.
int run(int argc, char** argv);

// The same for an embedding caller: `args` without the program's name. What the command throws
// reaches the caller (moeinfer::Error; cli::UsageError for a bad command line, CLI11's parse
// errors included, with a "did you mean" printed to stderr first); --help and --version print
// and return.
void run_or_throw(const std::vector<std::string>& args);

}  // namespace moeinfer::cli
