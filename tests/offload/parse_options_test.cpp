// --expert-budget and --expert-cache as the command line spells them.
#include "offload/parse_options.h"

#include <gtest/gtest.h>

#include "core/error.h"

namespace moeinfer::offload {
namespace {

OffloadOptions budget(const char* text) {
  OffloadOptions o;
  parse_expert_budget(text, &o);
  return o;
}

TEST(ParseExpertBudget, Percentages) {
  EXPECT_DOUBLE_EQ(budget("50%").budget_fraction, 0.5);
  EXPECT_EQ(budget("50%").budget_bytes, -1);
  EXPECT_DOUBLE_EQ(budget("12.5%").budget_fraction, 0.125);
  EXPECT_DOUBLE_EQ(budget("0%").budget_fraction, 0.0);
  EXPECT_DOUBLE_EQ(budget("100%").budget_fraction, 1.0);
  EXPECT_TRUE(budget("0%").enabled());
}

TEST(ParseExpertBudget, Bytes) {
  EXPECT_EQ(budget("1000000").budget_bytes, 1000000);
  EXPECT_DOUBLE_EQ(budget("1000000").budget_fraction, -1.0);
  EXPECT_EQ(budget("0").budget_bytes, 0);
  EXPECT_EQ(budget("800MB").budget_bytes, 800000000);
  EXPECT_EQ(budget("24GiB").budget_bytes, int64_t{24} << 30);
  EXPECT_EQ(budget("24gib").budget_bytes, int64_t{24} << 30);
  EXPECT_EQ(budget("1.5GB").budget_bytes, 1500000000);
  EXPECT_EQ(budget("512KiB").budget_bytes, 512 * 1024);
  EXPECT_EQ(budget("7B").budget_bytes, 7);
  EXPECT_EQ(budget("2TiB").budget_bytes, int64_t{2} << 40);
}

void expect_error(const char* text, const char* fragment) {
  OffloadOptions o;
  try {
    parse_expert_budget(text, &o);
    ADD_FAILURE() << "'" << text << "' was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
        << "'" << text << "': " << e.what();
  }
}

TEST(ParseExpertBudget, BadInputNamesTheProblem) {
  expect_error("", "empty");
  expect_error("-5%", "negative");
  expect_error("-100", "negative");
  expect_error("150%", "0 to 100");
  expect_error("100.5%", "0 to 100");
  expect_error("24XB", "unknown unit 'XB'");
  expect_error("12 GiB", "unknown unit");
  expect_error("GiB", "expected a number");
  expect_error("%", "expected a number");
  expect_error("1e9", "unknown unit 'e9'");
  expect_error("50%%", "unknown unit");
}

TEST(ParseExpertCache, Policies) {
  OffloadOptions o;
  parse_expert_cache("lfu", &o);
  EXPECT_EQ(o.policy, CachePolicy::kLfu);
  EXPECT_TRUE(o.hot_set_file.empty());
  parse_expert_cache("lru", &o);
  EXPECT_EQ(o.policy, CachePolicy::kLru);
  parse_expert_cache("static:/tmp/trace.bin", &o);
  EXPECT_EQ(o.policy, CachePolicy::kStatic);
  EXPECT_EQ(o.hot_set_file, "/tmp/trace.bin");
  parse_expert_cache("lru:warm.bin", &o);  // LRU warmed up from a trace
  EXPECT_EQ(o.policy, CachePolicy::kLru);
  EXPECT_EQ(o.hot_set_file, "warm.bin");
  EXPECT_THROW(parse_expert_cache("static", &o), Error);
  EXPECT_THROW(parse_expert_cache("static:", &o), Error);
  EXPECT_THROW(parse_expert_cache("fifo", &o), Error);
  EXPECT_THROW(parse_expert_cache("", &o), Error);
}

TEST(ParseOffloadFlags, BudgetAndCacheTogether) {
  EXPECT_FALSE(parse_offload_flags("", "").enabled());
  EXPECT_THROW(parse_offload_flags("", "lfu"), Error);  // a policy without a budget
  EXPECT_THROW(parse_offload_flags("", "lru"), Error);
  const OffloadOptions o = parse_offload_flags("25%", "lfu");
  EXPECT_TRUE(o.enabled());
  EXPECT_EQ(o.policy, CachePolicy::kLfu);
  EXPECT_DOUBLE_EQ(o.budget_fraction, 0.25);
}

TEST(ParseOffloadFlags, ColdExperts) {
  EXPECT_EQ(parse_offload_flags("25%", "").cold, ColdExperts::kGpu);  // the default
  EXPECT_EQ(parse_offload_flags("25%", "", "cpu").cold, ColdExperts::kCpu);
  EXPECT_EQ(parse_offload_flags("25%", "lfu", "AUTO").cold, ColdExperts::kAuto);
  EXPECT_EQ(parse_offload_flags("25%", "", "gpu").cold, ColdExperts::kGpu);
  try {
    parse_offload_flags("25%", "", "disk");
    ADD_FAILURE() << "--cold-experts disk was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'disk'"), std::string::npos) << e.what();
  }
  // Without a budget no expert is cold: the flag alone means nothing.
  EXPECT_THROW(parse_offload_flags("", "", "cpu"), Error);
}

TEST(ParseOffloadFlags, ExpertPrefetch) {
  EXPECT_EQ(parse_offload_flags("25%", "").prefetch, PrefetchMode::kAuto);  // the default
  EXPECT_EQ(parse_offload_flags("25%", "", "", "off").prefetch, PrefetchMode::kOff);
  EXPECT_EQ(parse_offload_flags("25%", "", "auto", "ON").prefetch, PrefetchMode::kOn);
  EXPECT_EQ(parse_offload_flags("25%", "", "", "auto").prefetch, PrefetchMode::kAuto);
  try {
    parse_offload_flags("25%", "", "", "sometimes");
    ADD_FAILURE() << "--expert-prefetch sometimes was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'sometimes'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_offload_flags("", "", "", "off"), Error);  // nothing to prefetch
}

TEST(ParseOffloadFlags, FormatRoundTrips) {
  EXPECT_EQ(format_expert_budget(int64_t{3} << 20), "3MiB");
  EXPECT_EQ(format_expert_budget(1000), "1000");
  OffloadOptions o;
  parse_expert_budget(format_expert_budget(int64_t{12345} << 20), &o);
  EXPECT_EQ(o.budget_bytes, int64_t{12345} << 20);
}

TEST(CheckOffloadModel, DenseModelIsRefused) {
  const OffloadOptions on = parse_offload_flags("50%", "");
  EXPECT_NO_THROW(check_offload_model(on, 8, "qwen3_moe"));
  EXPECT_NO_THROW(check_offload_model(OffloadOptions{}, 0, "llama"));
  try {
    check_offload_model(on, 0, "llama");
    ADD_FAILURE() << "a budget for a dense model was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("llama"), std::string::npos) << e.what();
  }
}

TEST(OffloadOptions, SlotsOfABudget) {
  OffloadOptions o = parse_offload_flags("50%", "");
  EXPECT_EQ(o.num_slots(100, 64), 32);
  o = parse_offload_flags("250", "");
  EXPECT_EQ(o.num_slots(100, 64), 2);
  o = parse_offload_flags("1GiB", "");
  EXPECT_EQ(o.num_slots(100, 64), 64);  // never more than there are experts
}

}  // namespace
}  // namespace moeinfer::offload
