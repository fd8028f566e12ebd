// A scratch path no other test process can pick: ctest runs each test in its own process, many
// at once, so a name from the shuffle seed (time-based, equal for processes started in the same
// millisecond) is not enough; the process id and the running test's name are.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

namespace moeinfer::testing {

inline std::filesystem::path unique_temp_path(const std::string& stem) {
  const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = stem + "_" + std::to_string(::getpid());
  if (test != nullptr) name += std::string("_") + test->test_suite_name() + "_" + test->name();
  return std::filesystem::temp_directory_path() / name;
}

}  // namespace moeinfer::testing
