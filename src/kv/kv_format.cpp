#include "kv/kv_format.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>

#include "core/dtype.h"
#include "core/error.h"

namespace moeinfer {
namespace {

int64_t total_width(std::span<const int64_t> groups) {
  return std::accumulate(groups.begin(), groups.end(), int64_t{0});
}

}  // namespace

std::string_view kv_dtype_name(KvDType dtype) {
  switch (dtype) {
    case KvDType::kF32:
      return "f32";
    case KvDType::kBF16:
      return "bf16";
    case KvDType::kFP8:
      return "fp8";
  }
  return "?";
}

KvDType parse_kv_dtype(std::string_view text) {
  if (text == "f32") return KvDType::kF32;
  if (text == "bf16") return KvDType::kBF16;
  if (text == "fp8") return KvDType::kFP8;
  MOE_FAIL("kv dtype must be bf16, fp8 or f32, got '", std::string(text), "'");
}

int64_t kv_row_bytes(KvDType dtype, std::span<const int64_t> groups) {
  const int64_t width = total_width(groups);
  switch (dtype) {
    case KvDType::kF32:
      return width * 4;
    case KvDType::kBF16:
      return width * 2;
    case KvDType::kFP8:
      return static_cast<int64_t>(groups.size()) * 4 + width;
  }
  return 0;  // unreachable: every enumerator returns above
}

void encode_kv_row(KvDType dtype, std::span<const int64_t> groups, const float* row,
                   std::byte* dst) {
  const int64_t width = total_width(groups);
  switch (dtype) {
    case KvDType::kF32:
      std::memcpy(dst, row, static_cast<size_t>(width) * sizeof(float));
      return;
    case KvDType::kBF16:
      for (int64_t i = 0; i < width; ++i) {
        const uint16_t bits = f32_to_bf16(row[i]);
        std::memcpy(dst + 2 * i, &bits, 2);
      }
      return;
    case KvDType::kFP8: {
      auto* codes = reinterpret_cast<uint8_t*>(dst + groups.size() * sizeof(float));
      int64_t start = 0;
      for (size_t g = 0; g < groups.size(); ++g) {
        const float scale = encode_f8e4m3_scaled(row + start, groups[g], codes + start);
        std::memcpy(dst + g * sizeof(float), &scale, sizeof(float));
        start += groups[g];
      }
      return;
    }
  }
}

void decode_kv_row(KvDType dtype, std::span<const int64_t> groups, const std::byte* src,
                   int64_t offset, int64_t count, float* out) {
  switch (dtype) {
    case KvDType::kF32:
      std::memcpy(out, src + offset * 4, static_cast<size_t>(count) * sizeof(float));
      return;
    case KvDType::kBF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, src + 2 * (offset + i), 2);
        out[i] = bf16_to_f32(bits);
      }
      return;
    case KvDType::kFP8: {
      const std::byte* codes = src + groups.size() * sizeof(float);
      // A table load per value (attention reads each cached row once per query head and step).
      const std::array<float, 256>& values = f8e4m3_values();
      const int64_t end = offset + count;
      int64_t start = 0;
      for (size_t g = 0; g < groups.size() && start < end; ++g) {
        const int64_t lo = std::max(start, offset), hi = std::min(start + groups[g], end);
        if (lo < hi) {
          float scale;
          std::memcpy(&scale, src + g * sizeof(float), sizeof(float));
          for (int64_t i = lo; i < hi; ++i) {
            out[i - offset] = values[static_cast<uint8_t>(codes[i])] * scale;
          }
        }
        start += groups[g];
      }
      return;
    }
  }
}

}  // namespace moeinfer
