// The whole `moeinfer` command line, parsed and run: main() is this, and so are the Python
// module's `python -m moeinfer ARGS` and moeinfer.serve().
#include "cli/run.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "cli/commands.h"
#include "cli/usage_error.h"
#include "core/error.h"
#include "core/version.h"

namespace moeinfer::cli {
namespace {

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// The closest of `names` to `word`, if it is close enough to be a slip of the keyboard.
std::string closest(std::string_view word, const std::vector<std::string>& names) {
  std::string best;
  size_t best_distance = std::max<size_t>(2, word.size() / 3) + 1;
  for (const std::string& name : names) {
    const size_t d = edit_distance(word, name);
    if (d < best_distance) {
      best = name;
      best_distance = d;
    }
  }
  return best;
}

// After a parse error: "did you mean" for a misspelt subcommand or --flag of the command line.
void suggest(const CLI::App& app, int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-') return;
  std::vector<std::string> commands;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
    commands.push_back(sub->get_name());
  const std::string command = argv[1];
  if (std::find(commands.begin(), commands.end(), command) == commands.end()) {
    if (const std::string near = closest(command, commands); !near.empty())
      std::fprintf(stderr, "moeinfer: did you mean '%s'?\n", near.c_str());
    return;
  }
  const CLI::App* sub = app.get_subcommand(command);
  std::vector<std::string> flags;
  for (const CLI::Option* option : sub->get_options())
    for (const std::string& name : option->get_lnames()) flags.push_back("--" + name);
  for (int i = 2; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (!arg.starts_with("--")) continue;
    const std::string flag(arg.substr(0, arg.find('=')));
    if (std::find(flags.begin(), flags.end(), flag) != flags.end()) continue;
    if (const std::string near = closest(flag, flags); !near.empty())
      std::fprintf(stderr, "moeinfer: %s: did you mean %s?\n", flag.c_str(), near.c_str());
  }
}

void add_commands(CLI::App& app) {
  app.set_version_flag("--version", std::string("moeinfer ") + kVersion);
  app.require_subcommand(1);
  add_tokenize_command(app);
  add_logits_command(app);
  add_eval_command(app);
  add_generate_command(app);
  add_info_command(app);
  add_template_command(app);
  add_expert_load_command(app);
  add_serve_command(app);
  add_bench_serve_command(app);
  add_bench_command(app);
  add_trace_command(app);
  add_plan_command(app);
  add_profile_command(app);
  add_placement_command(app);
}

}  // namespace

int run(int argc, char** argv) {
  CLI::App app{"moeinfer: Mixture-of-Experts inference engine"};
  add_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int status = app.exit(e);
    if (status != 0) suggest(app, argc, argv);
    return status;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "moeinfer: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moeinfer: error: %s\n", e.what());
    return 1;
  }
  return 0;
}

void run_or_throw(const std::vector<std::string>& args) {
  std::vector<std::string> words{"moeinfer"};
  words.insert(words.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& word : words) argv.push_back(word.data());
  const int argc = static_cast<int>(argv.size());
  CLI::App app{"moeinfer: Mixture-of-Experts inference engine"};
  add_commands(app);
  try {
    app.parse(argc, argv.data());
  } catch (const CLI::ParseError& e) {
    // --help and --version are parse "errors" of status 0: printed, not thrown.
    if (e.get_exit_code() == 0) {
      app.exit(e);
      return;
    }
    suggest(app, argc, argv.data());
    throw UsageError(e.what(), std::source_location::current());
  }
}

}  // namespace moeinfer::cli
