// fp32 -> FP8 (float8_e4m3fn / float8_e5m2) with scaling and saturation, shared by the
// CPU and CUDA kernels so both produce the same bits.
//
// Contract (the documented reference, engine/ops/fp8.py):
//   out = clamp(x * scale, -MAX, MAX).to(fp8)   computed in fp32, round to nearest even
//   NaN stays NaN (0x7F with the sign of the NaN), +-inf saturates to +-MAX,
//   -0.0 stays -0.0, values below half the smallest subnormal flush to +-0.
// Branch-free so the CPU loops auto-vectorize: every path is computed and selected.
#pragma once

#include <cstdint>

#include "../common/engine_macros.h"

namespace engine {
namespace fp8 {

enum Format : int { kE4M3 = 0, kE5M2 = 1 };

template <int F>
struct FormatTraits;

template <>
struct FormatTraits<kE4M3> {
  static constexpr int kMantBits = 3;
  static constexpr int kBias = 7;
  static constexpr uint32_t kMaxBits = 0x43E00000u;  // 448.0f
  static constexpr float kMax = 448.0f;
};

template <>
struct FormatTraits<kE5M2> {
  static constexpr int kMantBits = 2;
  static constexpr int kBias = 15;
  static constexpr uint32_t kMaxBits = 0x47600000u;  // 57344.0f
  static constexpr float kMax = 57344.0f;
};

// |v| bits -> FP8 magnitude bits (sign added by the caller). `a` is already clamped
// to the format's max or is a NaN (a > 0x7F800000).
template <int F>
ENGINE_HD uint32_t fp8_magnitude(uint32_t a) {
  using T = FormatTraits<F>;
  constexpr int kShift = 23 - T::kMantBits;
  constexpr int kMinNormalExp = 1 - T::kBias;  // e4m3: 2^-6, e5m2: 2^-14
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + kMinNormalExp) << 23;
  // Subnormal outputs are multiples of 2^(kMinNormalExp - kMantBits). Adding a float
  // whose ulp is exactly that step makes the FPU round |v| to nearest even; the bit
  // difference is then the subnormal code (it reaches 2^kMantBits = the smallest
  // normal when rounding carries over, which is the right encoding).
  constexpr uint32_t kMagicBits = static_cast<uint32_t>(127 + kMinNormalExp - T::kMantBits + 23) << 23;
  const uint32_t sub = float_bits(bits_float(a) + bits_float(kMagicBits)) - kMagicBits;
  // Normal outputs: rebias the exponent, then round away the low kShift bits to
  // nearest even (a carry out of the mantissa correctly bumps the exponent).
  const uint32_t rebased = a - (static_cast<uint32_t>(127 - T::kBias) << 23);
  const uint32_t normal =
      (rebased + ((1u << (kShift - 1)) - 1u) + ((rebased >> kShift) & 1u)) >> kShift;
  uint32_t mag = a < kMinNormalBits ? sub : normal;
  return a > 0x7F800000u ? 0x7Fu : mag;  // NaN code in both formats
}

// One element: scale in fp32, saturate, round. Returns the FP8 byte.
template <int F>
ENGINE_HD uint8_t scale_to_fp8(float x, float scale) {
  const uint32_t u = float_bits(x * scale);
  const uint32_t sign = (u >> 24) & 0x80u;
  uint32_t a = u & 0x7FFFFFFFu;
  // saturate finite overflow and +-inf to MAX; NaN (a > 0x7F800000) passes through
  const uint32_t sat = a < FormatTraits<F>::kMaxBits ? a : FormatTraits<F>::kMaxBits;
  a = a > 0x7F800000u ? a : sat;
  return static_cast<uint8_t>(fp8_magnitude<F>(a) | sign);
}

}  // namespace fp8
}  // namespace engine
