// Token-id lists on the command line (cli/ids_arg.h): what is taken, and what is refused by name.
#include "cli/ids_arg.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"

namespace moeinfer::cli {
namespace {

TEST(ParseTokenIds, TakesACommaSeparatedList) {
  EXPECT_EQ(parse_token_ids("7", "--ids"), std::vector<int32_t>{7});
  EXPECT_EQ(parse_token_ids("1,0,2147483647", "--ids"), (std::vector<int32_t>{1, 0, 2147483647}));
}

TEST(ParseTokenIds, RefusesEmptyItemsSignsAndOverflowNamingTheFlag) {
  for (const char* bad : {"", ",", "1,", ",1", "1,,2", "-1", "+1", "1.5", "a", " 1", "2147483648",
                          "99999999999999999999"}) {
    try {
      parse_token_ids(bad, "--decode");
      ADD_FAILURE() << "'" << bad << "' was taken";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--decode"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace moeinfer::cli
