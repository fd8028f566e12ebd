#include "core/dtype.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"

namespace moeinfer {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kF8E4M3: return 1;
    case DType::kI8: return 1;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kBool: return 1;
    case DType::kU8:
      return 1;
  }
  MOE_FAIL("unknown dtype ", static_cast<int>(dtype));
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kF8E4M3: return "F8_E4M3";
    case DType::kI8: return "I8";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
    case DType::kBool: return "BOOL";
    case DType::kU8:
      return "U8";
  }
  return "?";
}

bool parse_safetensors_dtype(std::string_view text, DType* dtype) {
  static constexpr struct {
    std::string_view name;
    DType dtype;
  } kNames[] = {{"F32", DType::kF32},        {"BF16", DType::kBF16}, {"F16", DType::kF16},
                {"F8_E4M3", DType::kF8E4M3}, {"I8", DType::kI8},     {"I32", DType::kI32},
                {"I64", DType::kI64},        {"BOOL", DType::kBool}, {"U8", DType::kU8}};
  for (const auto& entry : kNames) {
    if (entry.name == text) {
      *dtype = entry.dtype;
      return true;
    }
  }
  return false;
}

float f16_to_f32(uint16_t bits) {
  const uint32_t sign = uint32_t{bits & 0x8000u} << 16;
  const uint32_t exponent = (bits >> 10) & 0x1f;
  const uint32_t mantissa = bits & 0x3ff;
  if (exponent == 0) {
    // Zero or subnormal: value = mantissa * 2^-24.
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t f32_to_f16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const float magnitude = std::fabs(value);
  if (std::isnan(value)) return sign | 0x7e00;
  if (magnitude >= 65520.0f) return sign | 0x7c00;
  if (magnitude < 6.103515625e-05f) {
    // Subnormal: round magnitude / 2^-24 to nearest even.
    const float scaled = magnitude * 16777216.0f;
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  uint32_t rounded = (bits & 0x7fffffffu) + 0xfffu + ((bits >> 13) & 1u);
  return sign | static_cast<uint16_t>(((rounded >> 23) - 112) << 10 | ((rounded >> 13) & 0x3ff));
}

float f8e4m3_to_f32(uint8_t bits) {
  const bool negative = bits & 0x80;
  const int exponent = (bits >> 3) & 0xf;
  const int mantissa = bits & 0x7;
  float magnitude;
  if (exponent == 0xf && mantissa == 0x7) {
    magnitude = std::nanf("");
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);
  } else {
    magnitude = std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
  }
  return negative ? -magnitude : magnitude;
}

const std::array<float, 256>& f8e4m3_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> values{};
    for (int i = 0; i < 256; ++i) values[i] = f8e4m3_to_f32(static_cast<uint8_t>(i));
    return values;
  }();
  return table;
}

float encode_f8e4m3_scaled(const float* x, int64_t n, uint8_t* codes) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = f8e4m3_scale(amax);
  for (int64_t i = 0; i < n; ++i) codes[i] = f32_to_f8e4m3(x[i] / scale);
  return scale;
}

uint8_t f32_to_f8e4m3(float value) {
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  if (std::isnan(value)) return 0x7f;
  const float magnitude = std::fabs(value);
  if (magnitude >= kF8E4M3Max) return sign | 0x7e;
  if (magnitude < 0.015625f) {
    // Subnormal range (below 2^-6): multiples of 2^-9, so the code is the rounded multiple; a
    // round up to 8 lands on the smallest normal, whose code is 0x08 too.
    return sign | static_cast<uint8_t>(std::nearbyint(magnitude * 512.0f));
  }
  int exponent = 0;
  std::frexp(magnitude, &exponent);  // magnitude = m * 2^exponent, m in [0.5, 1)
  exponent -= 1;                     // magnitude = s * 2^exponent, s in [1, 2)
  int significand = static_cast<int>(std::nearbyint(std::ldexp(magnitude, 3 - exponent)));
  if (significand == 16) {  // rounded up to the next power of two
    significand = 8;
    exponent += 1;
  }
  // Below 448 every value rounds to at most 448 (exponent 8, significand 14): finite.
  return sign | static_cast<uint8_t>((exponent + 7) << 3 | (significand - 8));
}

void convert_to_f32(DType dtype, const void* src, float* dst, size_t n) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::kBF16: {
      const auto* in = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(in[i]);
      return;
    }
    case DType::kF16: {
      const auto* in = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(in[i]);
      return;
    }
    case DType::kF8E4M3: {
      const auto* in = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = f8e4m3_to_f32(in[i]);
      return;
    }
    default:
      MOE_FAIL("cannot convert ", dtype_name(dtype), " to F32");
  }
}

}  // namespace moeinfer
