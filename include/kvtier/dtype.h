// Element types of KV data: fp16, bf16 and fp32, with exact conversions.
//
// Half and BFloat16 are 16-bit storage types (no arithmetic): convert to float to compute.
// Widening (fp16/bf16 → fp32) is exact for every bit pattern, NaN payloads aside.
// Narrowing (fp32 → fp16/bf16) rounds to nearest, ties to even, overflows to ±inf, keeps
// NaN a NaN and produces subnormals where IEEE 754 does. Every function is host/device
// callable and thread-safe (pure). No CUDA includes: CPU and CUDA code share this header.
#ifndef KVTIER_DTYPE_H_
#define KVTIER_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "kvtier/host_device.h"

namespace kvtier {

enum class DType : uint8_t { kF16 = 0, kBF16 = 1, kF32 = 2 };

struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

// Bytes per element.
KVTIER_HOST_DEVICE constexpr size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kF16:
      return 2;
    case DType::kBF16:
      return 2;
    case DType::kF32:
      return 4;
  }
  return 0;
}

// "fp16", "bf16", "fp32".
std::string_view DTypeName(DType t);
// Parses "fp16"/"float16"/"half", "bf16"/"bfloat16", "fp32"/"float32"/"float".
// Returns false for anything else.
bool ParseDType(std::string_view name, DType* out);

KVTIER_HOST_DEVICE KVTIER_FORCE_INLINE uint32_t FloatBits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}
KVTIER_HOST_DEVICE KVTIER_FORCE_INLINE float BitsToFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// fp16 → fp32, exact. Branch-free so loops over rows vectorise: the exponent is rebiased
// by integer add, and subnormals are normalised by one exact float subtraction.
KVTIER_HOST_DEVICE KVTIER_FORCE_INLINE float HalfToFloat(Half h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t em = static_cast<uint32_t>(h.bits & 0x7fffu) << 13;  // exp+mantissa
  const uint32_t exp = em & 0x0f800000u;                               // half exponent
  const uint32_t normal = em + ((127u - 15u) << 23);
  const uint32_t infnan = normal + ((128u - 16u) << 23);
  // Subnormal (and zero): value = mantissa · 2^-24 = (2^-14 + mantissa·2^-24) − 2^-14.
  const float sub = BitsToFloat(em + (113u << 23)) - BitsToFloat(113u << 23);
  const uint32_t sub_bits = FloatBits(sub);
  const uint32_t out = exp == 0x0f800000u ? infnan : (exp == 0 ? sub_bits : normal);
  return BitsToFloat(out | sign);
}

// fp32 → fp16, round to nearest even.
KVTIER_HOST_DEVICE KVTIER_FORCE_INLINE Half FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) {  // inf or NaN: keep NaN quiet and non-zero
    return Half{static_cast<uint16_t>(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u))};
  }
  if (a >= 0x477ff000u) {  // ≥ 65520 rounds to inf
    return Half{static_cast<uint16_t>(sign | 0x7c00u)};
  }
  if (a < 0x38800000u) {  // below 2^-14: subnormal half (or zero)
    // Adding 0.5 (2^-1) aligns the value so the float's rounding does the half's RNE.
    const float shifted = BitsToFloat(a) + 0.5f;
    return Half{static_cast<uint16_t>(sign | (FloatBits(shifted) - 0x3f000000u))};
  }
  const uint32_t odd = (a >> 13) & 1u;
  const uint32_t r = a + ((15u - 127u) << 23) + 0xfffu + odd;
  return Half{static_cast<uint16_t>(sign | (r >> 13))};
}

// bf16 → fp32, exact (bf16 is the top half of an fp32).
KVTIER_HOST_DEVICE KVTIER_FORCE_INLINE float BFloat16ToFloat(BFloat16 b) {
  return BitsToFloat(static_cast<uint32_t>(b.bits) << 16);
}

// fp32 → bf16, round to nearest even; NaN stays NaN.
KVTIER_HOST_DEVICE KVTIER_FORCE_INLINE BFloat16 FloatToBFloat16(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return BFloat16{static_cast<uint16_t>((u >> 16) | 0x0040u)};
  }
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return BFloat16{static_cast<uint16_t>(rounded >> 16)};
}

// Generic conversions used by templated kernels: ToFloat(T) / FromFloat<T>(float).
KVTIER_HOST_DEVICE KVTIER_FORCE_INLINE float ToFloat(float x) { return x; }
KVTIER_HOST_DEVICE KVTIER_FORCE_INLINE float ToFloat(Half x) { return HalfToFloat(x); }
KVTIER_HOST_DEVICE KVTIER_FORCE_INLINE float ToFloat(BFloat16 x) { return BFloat16ToFloat(x); }

template <typename T>
KVTIER_HOST_DEVICE KVTIER_FORCE_INLINE T FromFloat(float x);
template <>
KVTIER_HOST_DEVICE KVTIER_FORCE_INLINE float FromFloat<float>(float x) {
  return x;
}
template <>
KVTIER_HOST_DEVICE KVTIER_FORCE_INLINE Half FromFloat<Half>(float x) {
  return FloatToHalf(x);
}
template <>
KVTIER_HOST_DEVICE KVTIER_FORCE_INLINE BFloat16 FromFloat<BFloat16>(float x) {
  return FloatToBFloat16(x);
}

}  // namespace kvtier

#endif  // KVTIER_DTYPE_H_
