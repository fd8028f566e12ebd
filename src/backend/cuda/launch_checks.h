// Argument checks shared by the launchers of the CUDA MoE-stage kernels. Each names the
// offending value, so a refused launch says which pointer or size was wrong.
#pragma once

#include <cstdint>
#include <limits>

#include "core/error.h"

namespace moeinfer::cuda::detail {

inline void check_pointer(const void* pointer, const char* name) {
  MOE_CHECK(pointer != nullptr, name, " is null");
}

// 16-byte alignment, needed by the kernels that move rows as uint4 vectors.
inline void check_aligned16(const void* pointer, const char* name) {
  MOE_CHECK(reinterpret_cast<uintptr_t>(pointer) % 16 == 0, name, " (", pointer,
            ") is not 16-byte aligned");
}

inline void check_int32_range(int64_t value, const char* name) {
  MOE_CHECK(value >= 0 && value <= std::numeric_limits<int32_t>::max(), name, " = ", value,
            " is outside [0, 2^31)");
}

inline void check_hidden_size(int64_t hidden_size) {
  MOE_CHECK(hidden_size > 0 && hidden_size % 8 == 0, "hidden_size = ", hidden_size,
            " must be a positive multiple of 8 (rows move as 16-byte vectors)");
}

}  // namespace moeinfer::cuda::detail
