// Each subcommand of `moeinfer` registers itself on the top-level CLI11 app.
#pragma once

#include <CLI/CLI.hpp>

namespace moeinfer::cli {

void add_tokenize_command(CLI::App& app);
void add_logits_command(CLI::App& app);
void add_eval_command(CLI::App& app);
void add_generate_command(CLI::App& app);
void add_info_command(CLI::App& app);
void add_template_command(CLI::App& app);
void add_expert_load_command(CLI::App& app);
void add_serve_command(CLI::App& app);
void add_bench_serve_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_trace_command(CLI::App& app);
void add_plan_command(CLI::App& app);
void add_profile_command(CLI::App& app);
void add_placement_command(CLI::App& app);

}  // namespace moeinfer::cli
