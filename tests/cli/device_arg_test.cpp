// The command line's shared parsers (cli/device_arg.h): --routing-skew's accepted forms, the
// ones it refuses (the message names the flag and the accepted forms), and the label `bench
// --json` records for each.
#include "cli/device_arg.h"

#include <gtest/gtest.h>

#include <string>

#include "core/error.h"

namespace moeinfer::cli {
namespace {

using Kind = RoutingSkew::Kind;

TEST(ParseRoutingSkew, AcceptsNoneZipfAndUniform) {
  EXPECT_EQ(parse_routing_skew("").kind, Kind::kNone);
  EXPECT_EQ(parse_routing_skew("uniform").kind, Kind::kUniform);
  const RoutingSkew zipf = parse_routing_skew("zipf:1.0");
  EXPECT_EQ(zipf.kind, Kind::kZipf);
  EXPECT_DOUBLE_EQ(zipf.exponent, 1.0);
  EXPECT_DOUBLE_EQ(parse_routing_skew("zipf:0.25").exponent, 0.25);
  EXPECT_DOUBLE_EQ(parse_routing_skew("zipf:10").exponent, 10.0);
}

TEST(ParseRoutingSkew, RefusesEverythingElseNamingTheFlag) {
  // Not a known form: the message lists both.
  for (const std::string text :
       {"Uniform", "uniform:1", " uniform", "zipf", "lognormal:1", "1.0"}) {
    try {
      parse_routing_skew(text);
      ADD_FAILURE() << "'" << text << "' was accepted";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("--routing-skew '" + text + "'"), std::string::npos) << message;
      EXPECT_NE(message.find("zipf:A"), std::string::npos) << message;
      EXPECT_NE(message.find("uniform"), std::string::npos) << message;
    }
  }
  // zipf with a bad exponent: the message gives A's range.
  for (const std::string text :
       {"zipf:", "zipf:0", "zipf:-1", "zipf:10.5", "zipf:1x", "zipf:nan"}) {
    try {
      parse_routing_skew(text);
      ADD_FAILURE() << "'" << text << "' was accepted";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("--routing-skew '" + text + "'"), std::string::npos) << message;
      EXPECT_NE(message.find("(0, 10]"), std::string::npos) << message;
    }
  }
}

TEST(RoutingSkewLabel, NamesTheRoutingMeasured) {
  EXPECT_EQ(routing_skew_label(parse_routing_skew("")), "synthetic");
  EXPECT_EQ(routing_skew_label(parse_routing_skew("uniform")), "uniform");
  EXPECT_EQ(routing_skew_label(parse_routing_skew("zipf:1")), "zipf:1.0");
  EXPECT_EQ(routing_skew_label(parse_routing_skew("zipf:1.0")), "zipf:1.0");
  EXPECT_EQ(routing_skew_label(parse_routing_skew("zipf:1.25")), "zipf:1.25");
}

}  // namespace
}  // namespace moeinfer::cli
