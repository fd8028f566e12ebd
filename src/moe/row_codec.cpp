#include "moe/row_codec.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/error.h"

namespace moeinfer::moe {

std::string_view dispatch_dtype_name(DispatchDtype dtype) {
  switch (dtype) {
    case DispatchDtype::kF32:
      return "f32";
    case DispatchDtype::kBF16:
      return "bf16";
    case DispatchDtype::kFp8:
      return "fp8";
  }
  return "?";  // unreachable: every enumerator returns above
}

DispatchDtype parse_dispatch_dtype(std::string_view text) {
  for (const DispatchDtype dtype :
       {DispatchDtype::kF32, DispatchDtype::kBF16, DispatchDtype::kFp8}) {
    if (text == dispatch_dtype_name(dtype)) return dtype;
  }
  MOE_FAIL("--dispatch-dtype '", text, "': expected f32, bf16 or fp8");
}

int64_t encoded_row_bytes(DispatchDtype dtype, int64_t H) {
  switch (dtype) {
    case DispatchDtype::kF32:
      return H * static_cast<int64_t>(sizeof(float));
    case DispatchDtype::kBF16:
      return H * static_cast<int64_t>(sizeof(uint16_t));
    case DispatchDtype::kFp8:
      return static_cast<int64_t>(sizeof(float)) + H;
  }
  return 0;  // unreachable
}

void encode_row(DispatchDtype dtype, const float* row, int64_t H, std::byte* out) {
  switch (dtype) {
    case DispatchDtype::kF32:
      std::memcpy(out, row, static_cast<size_t>(H) * sizeof(float));
      return;
    case DispatchDtype::kBF16:
      for (int64_t h = 0; h < H; ++h) {
        const uint16_t bits = f32_to_bf16(row[h]);
        std::memcpy(out + h * sizeof(bits), &bits, sizeof(bits));
      }
      return;
    case DispatchDtype::kFp8: {
      const float scale =
          encode_f8e4m3_scaled(row, H, reinterpret_cast<uint8_t*>(out + sizeof(float)));
      std::memcpy(out, &scale, sizeof(scale));
      return;
    }
  }
}

void decode_row(DispatchDtype dtype, const std::byte* in, int64_t H, float* row) {
  switch (dtype) {
    case DispatchDtype::kF32:
      std::memcpy(row, in, static_cast<size_t>(H) * sizeof(float));
      return;
    case DispatchDtype::kBF16:
      for (int64_t h = 0; h < H; ++h) {
        uint16_t bits;
        std::memcpy(&bits, in + h * sizeof(bits), sizeof(bits));
        row[h] = bf16_to_f32(bits);
      }
      return;
    case DispatchDtype::kFp8: {
      float scale;
      std::memcpy(&scale, in, sizeof(scale));
      const auto* values = reinterpret_cast<const uint8_t*>(in + sizeof(scale));
      const std::array<float, 256>& table = f8e4m3_values();
      for (int64_t h = 0; h < H; ++h) row[h] = table[values[h]] * scale;
      return;
    }
  }
}

}  // namespace moeinfer::moe
