// Output paths checked at parse time (cli/path_arg.h): a file in a writable folder is taken; a
// folder, or a file in a folder that does not exist, is refused with the reason.
#include "cli/path_arg.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

namespace moeinfer::cli {
namespace {

std::string check(std::string path) { return writable_file()(path); }

TEST(WritableFile, TakesAFileInAWritableFolder) {
  const std::filesystem::path dir = ::testing::TempDir();
  EXPECT_EQ(check((dir / "out.json").string()), "");
}

TEST(WritableFile, RefusesAFolderAndAMissingFolder) {
  const std::filesystem::path dir = ::testing::TempDir();
  EXPECT_NE(check(dir.string()).find("is a folder"), std::string::npos);
  EXPECT_NE(check((dir / "no-such-folder" / "out.json").string()).find("no folder"),
            std::string::npos);
}

}  // namespace
}  // namespace moeinfer::cli
