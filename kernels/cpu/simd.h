// Vector types for the CPU kernels, one struct per instruction set with the same static
// interface, so a kernel written once against `V` compiles for each:
//
//   V::kLanes                     fp32 lanes of V::F
//   Zero(), Set1(x)               constants
//   Load(const T*)                kLanes elements of float, Half or BFloat16 as fp32
//   Store(float*, F)
//   Add, Sub, Mul, Max, Min, Fma(a, b, c) = a·b + c
//   ReduceAdd(F), ReduceMax(F)    horizontal sum and max
//   Reduce4(a, b, c, d, out)      out[0..3] = the horizontal sums of a, b, c, d
//   Exp(F)                        e^x, relative error ≤ 2e-7 on [-87.3, 88.3]; 0 below
//
// Each struct is compiled for its own target (#pragma GCC target), so the header needs no
// special compiler flags; a kernel using one must be compiled under the same target: the
// kernel sources include their body once per instruction set inside such a region
// (attention_simd.cc shows how). Nothing here runs unless cpu::DetectedIsa() (isa.h) says
// the CPU has the instructions.
//
// GCC on x86-64 only (KVTIER_CPU_SIMD); elsewhere the reference kernels run.
#ifndef KVTIER_KERNELS_CPU_SIMD_H_
#define KVTIER_KERNELS_CPU_SIMD_H_

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVTIER_CPU_SIMD 1
#else
#define KVTIER_CPU_SIMD 0
#endif

#if KVTIER_CPU_SIMD
#include <immintrin.h>

#include <cstdint>

#include "kvtier/dtype.h"

#define KVTIER_SIMD_INLINE [[gnu::always_inline]] static inline
// Open and close a region compiled for one instruction set (pragmas take no macros, hence
// _Pragma). GCC 12's AVX-512 intrinsics start from _mm512_undefined_ps(), which trips
// -Wmaybe-uninitialized once inlined: the regions silence that warning.
#define KVTIER_SIMD_BEGIN_AVX2                                                     \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")")          \
      _Pragma("GCC diagnostic push")                                               \
          _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")
#define KVTIER_SIMD_BEGIN_AVX512                                                   \
  _Pragma("GCC push_options")                                                      \
      _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c\")") \
          _Pragma("GCC diagnostic push")                                           \
              _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")
#define KVTIER_SIMD_END _Pragma("GCC diagnostic pop") _Pragma("GCC pop_options")

namespace kvtier::cpu {

// Cephes-style expf constants (range reduction by ln 2 in two parts, degree-5 polynomial).
inline constexpr float kExpHi = 88.3762626647949f;
inline constexpr float kExpLo = -87.3365447504f;  // below: the result is flushed to 0
inline constexpr float kLog2e = 1.44269504088896341f;
inline constexpr float kLn2Hi = 0.693359375f;
inline constexpr float kLn2Lo = -2.12194440e-4f;
inline constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                   4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

KVTIER_SIMD_BEGIN_AVX2

struct Avx2 {
  static constexpr int kLanes = 8;
  using F = __m256;

  KVTIER_SIMD_INLINE F Zero() { return _mm256_setzero_ps(); }
  KVTIER_SIMD_INLINE F Set1(float x) { return _mm256_set1_ps(x); }
  KVTIER_SIMD_INLINE F Load(const float* p) { return _mm256_loadu_ps(p); }
  KVTIER_SIMD_INLINE F Load(const Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  KVTIER_SIMD_INLINE F Load(const BFloat16* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  KVTIER_SIMD_INLINE void Store(float* p, F v) { _mm256_storeu_ps(p, v); }
  KVTIER_SIMD_INLINE F Add(F a, F b) { return _mm256_add_ps(a, b); }
  KVTIER_SIMD_INLINE F Sub(F a, F b) { return _mm256_sub_ps(a, b); }
  KVTIER_SIMD_INLINE F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  KVTIER_SIMD_INLINE F Max(F a, F b) { return _mm256_max_ps(a, b); }
  KVTIER_SIMD_INLINE F Min(F a, F b) { return _mm256_min_ps(a, b); }
  KVTIER_SIMD_INLINE F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  // a·b rounded on its own: the compiler may not fuse it into a following Add.
  KVTIER_SIMD_INLINE F MulRounded(F a, F b) {
    F p = _mm256_mul_ps(a, b);
    asm("" : "+x"(p));
    return p;
  }

  // Integer lanes: offsets and gathers of 32-bit words.
  using I = __m256i;
  KVTIER_SIMD_INLINE I Strided(int32_t stride) {
    return _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(stride));
  }
  // The 32-bit words at base + offsets[l] bytes for lanes l < valid; 0 in the others (not read).
  KVTIER_SIMD_INLINE I GatherWords(const void* base, I offsets, int valid) {
    const I mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid),
                                      _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), static_cast<const int*>(base),
                                       offsets, mask, 1);
  }
  // Bits [kShift, kShift + 4) of every lane, as floats.
  template <int kShift>
  KVTIER_SIMD_INLINE F Nibble(I v) {
    return _mm256_cvtepi32_ps(
        _mm256_and_si256(_mm256_srli_epi32(v, kShift), _mm256_set1_epi32(15)));
  }

  KVTIER_SIMD_INLINE float ReduceAdd(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  KVTIER_SIMD_INLINE float ReduceMax(F v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  KVTIER_SIMD_INLINE void Reduce4(F a, F b, F c, F d, float* out) {
    const __m256 ab = _mm256_hadd_ps(a, b);
    const __m256 cd = _mm256_hadd_ps(c, d);
    const __m256 abcd = _mm256_hadd_ps(ab, cd);
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }

  KVTIER_SIMD_INLINE F Exp(F x) {
    const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLo), _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLo)), _mm256_set1_ps(kExpHi));
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Hi), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Lo), x);
    __m256 y = _mm256_set1_ps(kExpP[0]);
    for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpP[i]));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
  }
};

KVTIER_SIMD_END

KVTIER_SIMD_BEGIN_AVX512

struct Avx512 {
  static constexpr int kLanes = 16;
  using F = __m512;

  KVTIER_SIMD_INLINE F Zero() { return _mm512_setzero_ps(); }
  KVTIER_SIMD_INLINE F Set1(float x) { return _mm512_set1_ps(x); }
  KVTIER_SIMD_INLINE F Load(const float* p) { return _mm512_loadu_ps(p); }
  KVTIER_SIMD_INLINE F Load(const Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  KVTIER_SIMD_INLINE F Load(const BFloat16* p) {
    const __m512i w =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  KVTIER_SIMD_INLINE void Store(float* p, F v) { _mm512_storeu_ps(p, v); }
  KVTIER_SIMD_INLINE F Add(F a, F b) { return _mm512_add_ps(a, b); }
  KVTIER_SIMD_INLINE F Sub(F a, F b) { return _mm512_sub_ps(a, b); }
  KVTIER_SIMD_INLINE F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  KVTIER_SIMD_INLINE F Max(F a, F b) { return _mm512_max_ps(a, b); }
  KVTIER_SIMD_INLINE F Min(F a, F b) { return _mm512_min_ps(a, b); }
  KVTIER_SIMD_INLINE F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  KVTIER_SIMD_INLINE F MulRounded(F a, F b) {
    F p = _mm512_mul_ps(a, b);
    asm("" : "+v"(p));
    return p;
  }

  using I = __m512i;
  KVTIER_SIMD_INLINE I Strided(int32_t stride) {
    return _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(stride));
  }
  KVTIER_SIMD_INLINE I GatherWords(const void* base, I offsets, int valid) {
    const __mmask16 mask =
        valid >= kLanes ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << valid) - 1);
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, offsets, base, 1);
  }
  template <int kShift>
  KVTIER_SIMD_INLINE F Nibble(I v) {
    return _mm512_cvtepi32_ps(
        _mm512_and_si512(_mm512_srli_epi32(v, kShift), _mm512_set1_epi32(15)));
  }

  KVTIER_SIMD_INLINE __m256 Fold(F v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  }
  KVTIER_SIMD_INLINE float ReduceAdd(F v) { return Avx2::ReduceAdd(Fold(v)); }
  KVTIER_SIMD_INLINE float ReduceMax(F v) {
    return Avx2::ReduceMax(
        _mm256_max_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
  }
  KVTIER_SIMD_INLINE void Reduce4(F a, F b, F c, F d, float* out) {
    Avx2::Reduce4(Fold(a), Fold(b), Fold(c), Fold(d), out);
  }

  KVTIER_SIMD_INLINE F Exp(F x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLo), _CMP_GE_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLo)), _mm512_set1_ps(kExpHi));
    const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Hi), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Lo), x);
    __m512 y = _mm512_set1_ps(kExpP[0]);
    for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpP[i]));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(y, _mm512_castsi512_ps(e)));
  }
};

KVTIER_SIMD_END

// Prefetches the cache line holding p into all levels (a hint; never faults).
[[gnu::always_inline]] inline void Prefetch(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
}

}  // namespace kvtier::cpu

#endif  // KVTIER_CPU_SIMD
#endif  // KVTIER_KERNELS_CPU_SIMD_H_
