// How far one float vector is from a reference, as the tests state their tolerances.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <stdexcept>

namespace moeinfer::testing {

// max |got - want| over max |want|: an error relative to the reference's scale, so that
// elements near zero do not dominate. The plain max difference when the reference is all zeros.
inline double max_rel_diff(std::span<const float> got, std::span<const float> want) {
  if (got.size() != want.size()) throw std::invalid_argument("max_rel_diff: sizes differ");
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    diff = std::max(diff, std::fabs(double{got[i]} - want[i]));
    scale = std::max(scale, std::fabs(double{want[i]}));
  }
  return scale > 0.0 ? diff / scale : diff;
}

}  // namespace moeinfer::testing
