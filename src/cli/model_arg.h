// The --model option shared by the subcommands, and the built-in default model used when it is
// not given.
#pragma once

#include <filesystem>
#include <string>

#include <CLI/CLI.hpp>

namespace moeinfer::cli {

// Adds --model DIR; when omitted the built-in default is used (see resolve_model_dir).
void add_model_option(CLI::App* cmd, std::string* model);
// The folder to load: the given one, or the default model shipped with the project.
std::filesystem::path resolve_model_dir(const std::string& model);

}  // namespace moeinfer::cli
