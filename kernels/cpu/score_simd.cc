// Vectorised page scoring (Quest) and group pooling on the CPU, for AVX2 and AVX-512
// (score_simd.inc holds the kernels, compiled once per instruction set). Written for the
// memory system, since the summaries are the big read ([P][Hkv][2][d] per sequence: 32 MiB
// at 128K tokens, page 16, 8 KV heads, d 128, fp16):
//   1. one task per (sequence, range of pages) over every KV head, so each thread streams a
//      contiguous part of the summaries; each (page, KV head) row is converted to fp32 once
//      and scored against all query heads of its group (two pages at a time, so each query
//      load serves two rows), and rows a few pages ahead are prefetched. Raw scores go to
//      `scores` when requested, else to scratch.
//   2. one task per (sequence, KV head): pooling over the group (vectorised exp), -inf
//      beyond num_pages.
// With key codes score.cc runs the reference's per-page loop and calls KeyCodeDotsSimd for
// the part that is most of the work: every token's decoded key against the queries.
#include "kernels/cpu/score_simd.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/simd.h"
#include "kernels/cpu/thread_pool.h"

#if KVTIER_CPU_SIMD
namespace kvtier::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// How far ahead (in pages) the scoring pass prefetches summary rows.
constexpr int32_t kPrefetchPages = 4;
// Summary bytes per scoring task: long enough runs for the hardware prefetcher and few task
// claims, small enough that a pool of a few threads still balances.
constexpr int64_t kTaskBytes = int64_t{256} << 10;

}  // namespace
}  // namespace kvtier::cpu

KVTIER_SIMD_BEGIN_AVX2
namespace kvtier::cpu::score_avx2 {
using V = Avx2;
KVTIER_SIMD_INLINE __m256 SelectBySign(__m256 s, __m256 a, __m256 b) {
  return _mm256_blendv_ps(a, b, s);
}
#include "kernels/cpu/score_simd.inc"
}  // namespace kvtier::cpu::score_avx2
KVTIER_SIMD_END

KVTIER_SIMD_BEGIN_AVX512
namespace kvtier::cpu::score_avx512 {
using V = Avx512;
KVTIER_SIMD_INLINE __m512 SelectBySign(__m512 s, __m512 a, __m512 b) {
  return _mm512_mask_blend_ps(_mm512_movepi32_mask(_mm512_castps_si512(s)), a, b);
}
#include "kernels/cpu/score_simd.inc"
}  // namespace kvtier::cpu::score_avx512
KVTIER_SIMD_END

namespace kvtier::cpu {
namespace {

// The kernels of one instruction set for one dtype.
template <typename T>
struct Kernels {
  void (*interleave_queries)(const T* q, int64_t groups, int32_t G, int32_t d, float* qs);
  void (*score_range)(const ScorePagesArgs& a, const float* qs, int32_t b, int32_t p0,
                      int32_t p1, float* raw);
  void (*pool_head)(const ScorePagesArgs& a, const float* raw, bool raw_is_scores, int32_t b,
                    int32_t h, float* tmp);
};

// A buffer of at least n floats owned by the calling thread, reused across calls (growing
// only). Two names, so one thread can hold both at once.
float* CallScratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}
float* TaskScratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

template <typename T>
void Run(const ScorePagesArgs& a, ThreadPool* pool, const Kernels<T>& k) {
  const int32_t B = a.batch, Hq = a.shape.num_q_heads, Hkv = a.shape.num_kv_heads,
                d = a.shape.head_dim, P = a.max_pages;
  // Scratch: the queries in fp32, [B][Hq][d] floats (InterleaveQueries' layout), then
  // (without a scores output) the raw scores [B][Hq][P].
  const size_t q_elems = static_cast<size_t>(B) * Hq * d;
  const size_t raw_elems = a.scores != nullptr ? 0 : static_cast<size_t>(B) * Hq * P;
  float* qs = CallScratch(q_elems + raw_elems);
  float* raw = a.scores != nullptr ? a.scores : qs + q_elems;
  k.interleave_queries(static_cast<const T*>(a.q), int64_t{B} * Hkv, Hq / Hkv, d, qs);

  // Phase 1: tasks of `per_task` pages; first[b] is the first task of sequence b.
  const int64_t page_bytes = int64_t{2} * Hkv * d * static_cast<int64_t>(sizeof(T));
  const auto per_task = static_cast<int32_t>(std::max<int64_t>(1, kTaskBytes / page_bytes));
  std::vector<int64_t> first(static_cast<size_t>(B) + 1, 0);
  for (int32_t b = 0; b < B; ++b) {
    first[static_cast<size_t>(b) + 1] =
        first[static_cast<size_t>(b)] + (a.num_pages[b] + per_task - 1) / per_task;
  }
  ParallelFor(pool, first.back(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const auto b = static_cast<int32_t>(std::upper_bound(first.begin(), first.end(), t) -
                                          first.begin() - 1);
      const auto p0 = static_cast<int32_t>((t - first[static_cast<size_t>(b)]) * per_task);
      k.score_range(a, qs, b, p0, std::min(a.num_pages[b], p0 + per_task), raw);
    }
  });

  // Phase 2: pooling per (sequence, KV head).
  ParallelFor(pool, int64_t{B} * Hkv, 1, [&](int64_t begin, int64_t end) {
    float* tmp = TaskScratch(static_cast<size_t>(P));
    for (int64_t i = begin; i < end; ++i) {
      if (a.head_mask != nullptr && a.head_mask[i] == 0) continue;
      k.pool_head(a, raw, a.scores != nullptr, static_cast<int32_t>(i / Hkv),
                  static_cast<int32_t>(i % Hkv), tmp);
    }
  });
}

template <typename T>
Kernels<T> KernelsOf(Isa isa) {
  if (isa == Isa::kAvx512) {
    return {&score_avx512::InterleaveQueries<T>, &score_avx512::ScoreRange<T>,
            &score_avx512::PoolHead};
  }
  return {&score_avx2::InterleaveQueries<T>, &score_avx2::ScoreRange<T>, &score_avx2::PoolHead};
}

}  // namespace

void ScorePagesSimd(const ScorePagesArgs& a, ThreadPool* pool, Isa isa) {
  DispatchDType(a.shape.dtype, [&]<typename T>() { Run<T>(a, pool, KernelsOf<T>(isa)); });
}

void KeyCodeDotsSimd(const uint8_t* rows, int32_t G, int32_t d, int32_t ps, const float* w,
                     float* dots, Isa isa) {
  if (isa == Isa::kAvx512) {
    score_avx512::KeyCodeDots(rows, G, d, ps, w, dots);
  } else {
    score_avx2::KeyCodeDots(rows, G, d, ps, w, dots);
  }
}

}  // namespace kvtier::cpu

#else  // !KVTIER_CPU_SIMD: never called (score.cc runs the reference)

void kvtier::cpu::ScorePagesSimd(const ScorePagesArgs&, ThreadPool*, Isa) {}
void kvtier::cpu::KeyCodeDotsSimd(const uint8_t*, int32_t, int32_t, int32_t, const float*, float*,
                                  Isa) {}

#endif  // KVTIER_CPU_SIMD
