// Shared helpers for the engine's C++/CUDA kernels: host/device qualifiers, the
// x86 ISA variants the CPU kernels are compiled for, and bit casts.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define ENGINE_HD __host__ __device__ __forceinline__
#else
#define ENGINE_HD inline __attribute__((always_inline))
#endif

namespace engine {

ENGINE_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

ENGINE_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// 16-bit float formats stored as raw bits, so the same kernels compile without
// c10 types (and in .cu files without torch headers).
ENGINE_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// IEEE binary16 -> binary32, exact and branch-free (selects vectorize).
ENGINE_HD float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  // normal: rebias 15 -> 127; inf/NaN: all-ones exponent keeps the payload
  const uint32_t normal = ((exp + (127u - 15u)) << 23) | (mant << 13);
  const uint32_t infnan = 0x7F800000u | (mant << 13);
  // subnormal (exp == 0): mant * 2^-24, exact in fp32
  const uint32_t sub = float_bits(static_cast<float>(mant) * 5.9604644775390625e-08f);
  const uint32_t mag = exp == 0 ? sub : (exp == 31 ? infnan : normal);
  return bits_float(sign | mag);
}

// fp32 -> bf16, round to nearest even; NaN -> quiet NaN with the input's sign.
ENGINE_HD uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(nan ? ((u >> 16) | 0x0040u) : rounded);
}

// fp32 -> IEEE fp16, round to nearest even, overflow -> inf, NaN -> quiet NaN.
ENGINE_HD uint16_t float_to_fp16(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // normal fp16 range [2^-14, 65520): rebias exponent, round the 13 dropped bits
  const uint32_t rebased = a - ((127u - 15u) << 23);
  const uint32_t normal = (rebased + 0xFFFu + ((rebased >> 13) & 1u)) >> 13;
  // subnormal: let the FPU round a + 2^-1 (ulp 2^-24) to nearest even
  const uint32_t sub = float_bits(bits_float(a) + 0.5f) - float_bits(0.5f);
  uint32_t mag = a < 0x38800000u ? sub : normal;     // 0x38800000 = 2^-14
  mag = a >= 0x477FF000u ? 0x7C00u : mag;            // >= 65520 rounds to inf
  mag = a > 0x7F800000u ? (0x7E00u | ((a >> 13) & 0x3FFu)) : mag;  // NaN stays NaN
  return static_cast<uint16_t>(sign | mag);
}

}  // namespace engine
