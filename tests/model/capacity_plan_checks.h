// What the capacity-plan tests (CPU: model/capacity_plan_alloc_test.cpp, GPU:
// cuda/cuda_capacity_plan_test.cpp) hold the plan to: within 5% of what was allocated.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <string>

namespace moeinfer::testing_util {

inline constexpr double kPlanTolerance = 0.05;
inline constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

inline void expect_within(double planned, double actual, const std::string& what) {
  EXPECT_LE(std::fabs(planned - actual), kPlanTolerance * actual)
      << what << ": planned " << planned << ", allocated " << actual;
}

// (planned - actual) / actual, for the printed tables.
inline double rel_diff(double planned, double actual) {
  return actual != 0 ? (planned - actual) / actual : 0.0;
}

}  // namespace moeinfer::testing_util
