// `moeinfer`: the command a user types. Each subcommand lives in its own cmd_*.cpp; run.cpp
// parses the command line and turns errors into exit codes.
#include "cli/run.h"

int main(int argc, char** argv) { return moeinfer::cli::run(argc, argv); }
