// `moeinfer`: the command a user types. Each subcommand lives in its own cmd_*.cpp.
#include <cstdio>
#include <exception>

#include "cli/commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"moeinfer: Mixture-of-Experts inference engine"};
  app.require_subcommand(1);
  moeinfer::cli::add_tokenize_command(app);
  moeinfer::cli::add_logits_command(app);
  moeinfer::cli::add_generate_command(app);
  moeinfer::cli::add_info_command(app);
  moeinfer::cli::add_template_command(app);
  moeinfer::cli::add_expert_load_command(app);
  moeinfer::cli::add_serve_command(app);
  moeinfer::cli::add_bench_serve_command(app);
  moeinfer::cli::add_bench_command(app);
  moeinfer::cli::add_trace_command(app);
  moeinfer::cli::add_plan_command(app);
  moeinfer::cli::add_profile_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const moeinfer::Error& e) {
    std::fprintf(stderr, "moeinfer: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moeinfer: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
