// Output files named on the command line, checked when the command line is parsed: a run that
// takes minutes must not end by failing to write its results.
#pragma once

#include <CLI/CLI.hpp>

namespace moeinfer::cli {

// A path the command will write: not a folder, in a folder that exists and can be written.
CLI::Validator writable_file();

}  // namespace moeinfer::cli
