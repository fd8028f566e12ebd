// Element types of checkpoint tensors and their conversions to float32.
#pragma once

#include <bit>
#include <cstddef>
#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace moeinfer {

// kU8: raw bytes (GPT-OSS's MXFP4 blocks and E8M0 scales), never a number format of its own.
enum class DType : uint8_t { kF32, kBF16, kF16, kF8E4M3, kI8, kI32, kI64, kBool, kU8 };

size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);
// Parses a safetensors dtype string ("F32", "BF16", ...); returns false when unknown.
bool parse_safetensors_dtype(std::string_view text, DType* dtype);

inline float bf16_to_f32(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }

// Round to nearest even, as torch does; NaN stays NaN.
inline uint16_t f32_to_bf16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float f16_to_f32(uint16_t bits);
uint16_t f32_to_f16(float value);
float f8e4m3_to_f32(uint8_t bits);
// The nearest e4m3 (OCP FP8, no infinities) to `value`, ties to even; magnitudes beyond 448, the
// largest finite e4m3, and infinities saturate to +-448; NaN gives the NaN code 0x7f.
uint8_t f32_to_f8e4m3(float value);
inline constexpr float kF8E4M3Max = 448.0f;
// Every e4m3 code's value (f8e4m3_to_f32 of each byte), so that decoding a row is a table load
// per value rather than a decode of its bits.
const std::array<float, 256>& f8e4m3_values();
// The scale that maps a group's largest magnitude onto e4m3's largest finite value (1 for an
// all-zero group, so that decoding never multiplies by 0/0): value = code * scale.
inline float f8e4m3_scale(float amax) { return amax > 0.0f ? amax / kF8E4M3Max : 1.0f; }
// n values as the e4m3 codes of x / scale, scale = f8e4m3_scale(max |x|), which it returns
// (x / scale, not x * (448 / amax): the largest lands on 448 within float rounding, and
// f32_to_f8e4m3 saturates what rounding puts above it).
float encode_f8e4m3_scaled(const float* x, int64_t n, uint8_t* codes);

// Converts n elements of `dtype` at src to float32 at dst.
void convert_to_f32(DType dtype, const void* src, float* dst, size_t n);

}  // namespace moeinfer
