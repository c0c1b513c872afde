// Row conversion and small vector helpers shared by the CPU ops. Loops are written so
// GCC's vectoriser handles them at -O3 (fixed-width partial sums, branch-free converts).
#ifndef KVTIER_KERNELS_CPU_CONVERT_H_
#define KVTIER_KERNELS_CPU_CONVERT_H_

#include <cstdint>

#include "kvtier/dtype.h"

namespace kvtier::cpu {

// out[i] = float(src[i]) for i < n.
template <typename T>
inline void LoadRow(const T* src, int32_t n, float* out) {
  for (int32_t i = 0; i < n; ++i) out[i] = ToFloat(src[i]);
}

// dst[i] = T(src[i]) (round to nearest even) for i < n.
template <typename T>
inline void StoreRow(const float* src, int32_t n, T* dst) {
  for (int32_t i = 0; i < n; ++i) dst[i] = FromFloat<T>(src[i]);
}

// Σ a[i]·b[i] with eight partial sums (vectorisable without -ffast-math).
inline float Dot(const float* a, const float* b, int32_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Calls fn.template operator()<T>() with T the storage type of `t`.
template <typename Fn>
inline auto DispatchDType(DType t, Fn&& fn) {
  switch (t) {
    case DType::kF16:
      return fn.template operator()<Half>();
    case DType::kBF16:
      return fn.template operator()<BFloat16>();
    case DType::kF32:
      return fn.template operator()<float>();
  }
  return fn.template operator()<float>();
}

}  // namespace kvtier::cpu

#endif  // KVTIER_KERNELS_CPU_CONVERT_H_
