// The command line's shared parsers (cli/device_arg.h): --routing-skew's accepted forms, the
// ones it refuses (the message names the flag and the accepted forms), and the label `bench
// --json` records for each.
#include "cli/device_arg.h"

#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <string>

#include "cli/usage_error.h"
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

// The refusal's message, or "" when `args.expert_parallel()` accepts (it returns before
// starting MPI in every case below).
std::string expert_parallel_refusal(const DeviceArgs& args) {
  try {
    args.expert_parallel();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(DispatchDtype, IsF32UnlessGivenAndRefusedWithoutExpertParallelism) {
  DeviceArgs args;
  EXPECT_EQ(args.dispatch_rows_dtype(), moe::DispatchDtype::kF32);
  EXPECT_EQ(expert_parallel_refusal(args), "");  // no flags: one process, nothing to refuse
  for (const char* dtype : {"f32", "bf16", "fp8"}) {
    args.dispatch_dtype = dtype;
    EXPECT_EQ(moe::dispatch_dtype_name(args.dispatch_rows_dtype()), dtype);
    const std::string message = expert_parallel_refusal(args);
    EXPECT_NE(message.find(std::string("--dispatch-dtype ") + dtype + " applies to --ep N"),
              std::string::npos)
        << message;
  }
}

TEST(DispatchDtype, RefusedOnCudaNamingTheFlag) {
  for (const int ep : {1, 2}) {
    DeviceArgs args{.device = "cuda", .ep = ep, .dispatch_dtype = "fp8"};
    const std::string message = expert_parallel_refusal(args);
    EXPECT_NE(message.find("--dispatch-dtype fp8 is not implemented on the CUDA backend"),
              std::string::npos)
        << "--ep " << ep << ": " << message;
  }
}

TEST(EpTransport, IsAutoUnlessGiven) {
  DeviceArgs args{.device = "cuda"};
  EXPECT_EQ(args.ep_rows_transport(), EpTransport::kAuto);
  args.ep_transport = "auto";
  EXPECT_EQ(args.ep_rows_transport(), EpTransport::kAuto);
  args.ep_transport = "nccl";
  EXPECT_EQ(args.ep_rows_transport(), EpTransport::kNccl);
  args.ep_transport = "staged";
  EXPECT_EQ(args.ep_rows_transport(), EpTransport::kStaged);
}

TEST(EpTransport, RefusedOnTheCpuAndWithoutExpertParallelismNamingTheFlag) {
  for (const char* transport : {"auto", "nccl", "staged"}) {
    const DeviceArgs cpu{.device = "cpu", .ep = 2, .ep_transport = transport};
    std::string message = expert_parallel_refusal(cpu);
    EXPECT_NE(
        message.find(std::string("--ep-transport ") + transport + " applies to --device cuda"),
        std::string::npos)
        << message;
    const DeviceArgs one{.device = "cuda", .ep = 1, .ep_transport = transport};
    message = expert_parallel_refusal(one);
    EXPECT_NE(message.find(std::string("--ep-transport ") + transport + " applies to --ep N"),
              std::string::npos)
        << message;
  }
}

TEST(MicroBatches, OnCudaNeedExpertParallelismAsOnTheCpu) {
  for (const char* device : {"cpu", "cuda"}) {
    const DeviceArgs args{.device = device, .ep = 1, .micro_batches = 2};
    const std::string message = expert_parallel_refusal(args);
    EXPECT_NE(message.find("--micro-batches 2 needs --ep N"), std::string::npos)
        << device << ": " << message;
  }
}

TEST(MicroBatches, OverlapOnCudaAppliesToTwoMicroBatchesOnly) {
  // On cuda --overlap says whether the two micro-batches alternate; with one it is refused by
  // name (before MPI starts).
  for (const char* overlap : {"on", "off"}) {
    const DeviceArgs one{.device = "cuda", .ep = 2, .overlap = overlap};
    const std::string message = expert_parallel_refusal(one);
    EXPECT_NE(
        message.find(std::string("--overlap ") + overlap + " on cuda applies to --micro-batches 2"),
        std::string::npos)
        << message;
  }
}

}  // namespace
}  // namespace moeinfer::cli

namespace moeinfer::cli {
namespace {

// --ep 0 was refused as "Value 0 not in range 0 to 1.79769e+308" (CLI::PositiveNumber's text).
TEST(EpFlag, RefusesZeroAndNegativeWithItsRange) {
  for (const char* value : {"0", "-2"}) {
    CLI::App app;
    DeviceArgs args;
    add_expert_parallel_option(&app, &args);
    try {
      app.parse(std::vector<std::string>{value, "--ep"});  // parse() takes the words reversed
      ADD_FAILURE() << "--ep " << value << " was accepted";
    } catch (const CLI::ParseError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("--ep"), std::string::npos) << message;
      EXPECT_NE(message.find("not in range 1 to"), std::string::npos) << message;
    }
  }
  CLI::App app;
  DeviceArgs args;
  add_expert_parallel_option(&app, &args);
  app.parse(std::vector<std::string>{"4", "--ep"});
  EXPECT_EQ(args.ep, 4);
}

// --weights-scope: experts unless given; linear needs --weights fp8|int4, refused otherwise on
// either device, the message naming both flags.
TEST(WeightsScope, LinearNeedsFp8OrInt4NamingBothFlags) {
  DeviceArgs args;
  EXPECT_EQ(args.weight_scope(), WeightScope::kExperts);
  args.weights_scope = "linear";
  for (const char* device : {"cpu", "cuda"}) {
    args.device = device;
    for (const char* weights : {"", "bf16"}) {
      args.weights = weights;
      if (args.device == "cuda" && args.weights == "bf16")
        continue;  // --weights bf16 refused first
      try {
        args.weight_scope();
        ADD_FAILURE() << device << " --weights '" << weights << "' --weights-scope linear accepted";
      } catch (const Error& e) {
        const std::string message = e.what();
        EXPECT_NE(message.find("--weights-scope linear"), std::string::npos) << message;
        EXPECT_NE(message.find("--weights fp8"), std::string::npos) << message;
      }
    }
    for (const char* weights : {"fp8", "int4"}) {
      args.weights = weights;
      EXPECT_EQ(args.weight_scope(), WeightScope::kLinear) << device << " " << weights;
    }
  }
}

}  // namespace
}  // namespace moeinfer::cli
