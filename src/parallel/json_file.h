// Reading the small JSON files of parallel/ (placements, topologies) with errors that name them.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moeinfer::parallel {

// The JSON document in `path`; `file` names it in errors ("placement file x.json: ...").
inline nlohmann::json read_json_file(const std::filesystem::path& path, const std::string& file) {
  std::ifstream in(path);
  MOE_CHECK(in.good(), file, ": cannot be read");
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    MOE_FAIL(file, ": not JSON (", e.what(), ")");
  }
}

}  // namespace moeinfer::parallel
