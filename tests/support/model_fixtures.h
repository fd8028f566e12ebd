// The model fixtures made by the reference implementation (tools/make_fixtures.py): each folder
// of tests/fixtures/models that holds a reference.json, for the tests that run every family.
#pragma once

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

namespace moeinfer::testing_support {

inline const std::filesystem::path kModelFixtures =
    std::filesystem::path(MOE_FIXTURES_DIR) / "models";

// The fixtures' folder names, sorted.
inline std::vector<std::string> model_fixture_names() {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(kModelFixtures)) {
    if (std::filesystem::exists(entry.path() / "reference.json")) {
      names.push_back(entry.path().filename().string());
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace moeinfer::testing_support
