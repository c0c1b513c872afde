// Row conversion and small vector helpers shared by the CPU ops. Loops are written so
// GCC's vectoriser handles them at -O3 (fixed-width partial sums, branch-free converts).
#ifndef KVTIER_KERNELS_CPU_CONVERT_H_
#define KVTIER_KERNELS_CPU_CONVERT_H_

#include <cstdint>

#include "kvtier/dtype.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define KVTIER_CPU_HAVE_F16C_PATH 1
#endif

// KVTIER_CPU_CLONES compiles a hot function twice, for x86-64-v3 (AVX2, FMA, F16C) and
// for the baseline, and picks one at load time (GCC function multi-versioning), so one
// portable binary still converts fp16 and multiplies with wide vectors where it can.
// Callees must be inlined into it to benefit: the helpers below are always_inline.
// Off under ThreadSanitizer: the dynamic loader runs the (instrumented) clone resolver
// before the TSan runtime is initialised, which crashes the program at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_THREAD__)
#define KVTIER_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KVTIER_CPU_CLONES
#endif
#define KVTIER_CPU_INLINE [[gnu::always_inline]] inline

namespace kvtier::cpu {

// out[i] = float(src[i]) for i < n.
template <typename T>
KVTIER_CPU_INLINE void LoadRow(const T* src, int32_t n, float* out) {
  for (int32_t i = 0; i < n; ++i) out[i] = ToFloat(src[i]);
}

#if KVTIER_CPU_HAVE_F16C_PATH
// fp16 → fp32 eight at a time with F16C (exact, as the scalar conversion). Only called
// after HasF16C() said yes; compiled for that target whatever the file's flags.
__attribute__((target("avx,f16c"))) inline void HalfRowToFloatF16C(const Half* src, int32_t n,
                                                                   float* out) {
  int32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) out[i] = HalfToFloat(src[i]);
}

inline bool HasF16C() {
  static const bool has = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return has;
}

// GCC does not vectorise the scalar fp16 conversion: use the F16C instruction when the
// CPU has it (checked per row: a predictable branch on a cached flag).
template <>
KVTIER_CPU_INLINE void LoadRow<Half>(const Half* src, int32_t n, float* out) {
  if (HasF16C()) {
    HalfRowToFloatF16C(src, n, out);
    return;
  }
  for (int32_t i = 0; i < n; ++i) out[i] = HalfToFloat(src[i]);
}
#endif

// dst[i] = T(src[i]) (round to nearest even) for i < n.
template <typename T>
KVTIER_CPU_INLINE void StoreRow(const float* src, int32_t n, T* dst) {
  for (int32_t i = 0; i < n; ++i) dst[i] = FromFloat<T>(src[i]);
}

// Σ a[i]·b[i] with eight partial sums (vectorisable without -ffast-math).
KVTIER_CPU_INLINE float Dot(const float* a, const float* b, int32_t n) {
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
