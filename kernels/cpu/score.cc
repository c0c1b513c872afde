// Page scoring (Quest) and group pooling on the CPU. Two implementations: the scalar
// reference below (per (sequence, KV head), a strided walk over the summaries; kept as
// cpu::Isa::kScalar, the loops the vectorised kernel is tested against) and the vectorised
// one of score_simd.cc (AVX2, AVX-512), chosen at run time.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_format.h"
#include "kernels/cpu/convert.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/score_simd.h"
#include "kernels/cpu/simd.h"
#include "kernels/cpu/thread_pool.h"
#include "kvtier/layout.h"

namespace kvtier {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Σ_i max(q_i·hi_i, q_i·lo_i) with eight partial sums.
KVTIER_CPU_INLINE float BoundScore(const float* q, const float* hi, const float* lo, int32_t d) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int32_t i = 0;
  for (; i + 8 <= d; i += 8) {
    for (int j = 0; j < 8; ++j) {
      const float a = q[i + j] * hi[i + j];
      const float b = q[i + j] * lo[i + j];
      acc[j] += a > b ? a : b;
    }
  }
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < d; ++i) sum += std::max(q[i] * hi[i], q[i] * lo[i]);
  return sum;
}

// Adds mean-over-group softmax(scale · raw) into pooled[0, n).
KVTIER_CPU_INLINE void AddSoftmax(const float* raw, int32_t n, float scale, float weight, float* pooled) {
  float m = kNegInf;
  for (int32_t p = 0; p < n; ++p) m = std::max(m, scale * raw[p]);
  double sum = 0;
  for (int32_t p = 0; p < n; ++p) sum += std::exp(scale * raw[p] - m);
  const float inv = weight / static_cast<float>(sum);
  for (int32_t p = 0; p < n; ++p) pooled[p] += std::exp(scale * raw[p] - m) * inv;
}

// Pools raw[G][P] (the group's raw scores of pages [0, num_pages[b])) into pooled and
// writes them to scores when given.
KVTIER_CPU_INLINE void PoolGroup(const ScorePagesArgs& a, int32_t b, int32_t h, const float* raw) {
  const int32_t P = a.max_pages, G = a.shape.num_q_heads / a.shape.num_kv_heads;
  const int32_t n = a.num_pages[b];
  float* pooled = a.pooled + (int64_t{b} * a.shape.num_kv_heads + h) * P;
  for (int32_t p = 0; p < P; ++p) pooled[p] = p < n ? 0.0f : kNegInf;
  const float weight = 1.0f / static_cast<float>(G);
  for (int32_t g = 0; g < G; ++g) {
    const float* r = raw + int64_t{g} * P;
    AddSoftmax(r, n, a.softmax_scale, weight, pooled);
    if (a.scores != nullptr) {
      float* out = a.scores + (int64_t{b} * a.shape.num_q_heads + h * G + g) * P;
      for (int32_t p = 0; p < P; ++p) out[p] = p < n ? r[p] : kNegInf;
    }
  }
}

template <typename T>
KVTIER_CPU_INLINE void ScoreGroup(const ScorePagesArgs& a, int32_t b, int32_t h, std::vector<float>& scratch) {
  const int32_t d = a.shape.head_dim, P = a.max_pages,
                G = a.shape.num_q_heads / a.shape.num_kv_heads;
  const int32_t n = a.num_pages[b];
  const HeadsLayout ql{a.shape.num_q_heads, d};
  const SummaryLayout sl{a.shape.num_kv_heads, d};
  const T* q = static_cast<const T*>(a.q);
  const T* summaries = static_cast<const T*>(a.summaries) + int64_t{b} * P * sl.page_elements();
  // scratch: qf[G][d] | hi[d] | lo[d] | raw[G][P]
  scratch.resize(static_cast<size_t>(G) * d + 2 * d + static_cast<size_t>(G) * P);
  float* qf = scratch.data();
  float* hi = qf + G * d;
  float* lo = hi + d;
  float* raw = lo + d;
  for (int32_t g = 0; g < G; ++g) cpu::LoadRow(q + ql.Offset(b, h * G + g, 0), d, qf + g * d);
  for (int32_t p = 0; p < n; ++p) {
    cpu::LoadRow(summaries + sl.Offset(p, h, kHi, 0), d, hi);
    cpu::LoadRow(summaries + sl.Offset(p, h, kLo, 0), d, lo);
    for (int32_t g = 0; g < G; ++g) raw[int64_t{g} * P + p] = BoundScore(qf + g * d, hi, lo, d);
  }
  PoolGroup(a, b, h, raw);
}

// x, rounded on its own: the compiler may not fuse the product that made it into the sum it
// joins (an FMA rounds once, the vectorised kernel twice).
KVTIER_CPU_INLINE float Rounded(float x) {
#if defined(__x86_64__)
  asm("" : "+x"(x));
#endif
  return x;
}

// The token dots of one (page, KV head) against G query heads' weights w[G][d]:
// dots[g·ps + t] = Σ_i w[g·d + i]·(code(t, i) + 0.5), summed in dimension order, each product
// rounded before it is added. KeyCodeDotsSimd (score_simd.cc) gives the same bits.
void KeyCodeDotsScalar(const uint8_t* rows, int32_t G, int32_t d, int32_t ps, const float* w,
                       float* dots) {
  for (int32_t g = 0; g < G; ++g) {
    const float* wg = w + int64_t{g} * d;
    for (int32_t t = 0; t < ps; ++t) {
      const uint8_t* row = rows + int64_t{t} * (d / 2);
      float acc = 0.0f;
      for (int32_t i = 0; i < d; i += 2) {
        acc += Rounded(wg[i] * (static_cast<float>(row[i / 2] & 15) + 0.5f));
        acc += Rounded(wg[i + 1] * (static_cast<float>(row[i / 2] >> 4) + 0.5f));
      }
      dots[int64_t{g} * ps + t] = acc;
    }
  }
}

// Key codes (ScorePagesArgs::codes): each query head's raw score of a page is
// Σ_i q_i·lo_i + LSE_t(scale·x_t)/scale with x_t = Σ_i w_i·(code[t][i] + 0.5) and
// w_i = q_i·(hi_i − lo_i)/16 (summed in dimension order), so that the pooling's softmax over
// pages gives each page its decoded keys' share of the attention. The dots x_t, most of the
// work, are vectorised over a page's tokens for `isa` above scalar (same bits); the rest is
// this scalar loop on every ISA.
template <typename T>
void ScoreGroupCodes(const ScorePagesArgs& a, int32_t b, int32_t h, cpu::Isa isa,
                     std::vector<float>& scratch) {
  const int32_t d = a.shape.head_dim, P = a.max_pages, ps = a.shape.page_size,
                G = a.shape.num_q_heads / a.shape.num_kv_heads;
  const int32_t n = a.num_pages[b];
  const HeadsLayout ql{a.shape.num_q_heads, d};
  const SummaryLayout sl{a.shape.num_kv_heads, d};
  const KeyCodeLayout cl{a.shape.num_kv_heads, ps, d};
  const T* q = static_cast<const T*>(a.q);
  const T* summaries = static_cast<const T*>(a.summaries) + int64_t{b} * P * sl.page_elements();
  const uint8_t* codes = a.codes + int64_t{b} * P * cl.page_bytes();
  // scratch: qf[G][d] | hi[d] | lo[d] | w[G][d] | base[G] | raw[G][P] | dots[G][ps]
  const size_t gd = static_cast<size_t>(G) * d;
  scratch.resize(2 * gd + 2 * d + G + static_cast<size_t>(G) * P + static_cast<size_t>(G) * ps);
  float* qf = scratch.data();
  float* hi = qf + gd;
  float* lo = hi + d;
  float* w = lo + d;
  float* base = w + gd;
  float* raw = base + G;
  float* dots = raw + static_cast<size_t>(G) * P;
  const bool simd = isa != cpu::Isa::kScalar && d % 8 == 0;
  for (int32_t g = 0; g < G; ++g) cpu::LoadRow(q + ql.Offset(b, h * G + g, 0), d, qf + g * d);
  for (int32_t p = 0; p < n; ++p) {
    cpu::LoadRow(summaries + sl.Offset(p, h, kHi, 0), d, hi);
    cpu::LoadRow(summaries + sl.Offset(p, h, kLo, 0), d, lo);
    // hi becomes the step (hi − lo)/16; w = q·step. base[g] = Σ_i q_i·lo_i, each in dimension
    // order (the G sums side by side).
    for (int32_t i = 0; i < d; ++i) hi[i] = (hi[i] - lo[i]) / static_cast<float>(kKeyCodeLevels);
    for (int32_t g = 0; g < G; ++g) {
      const float* qg = qf + g * d;
      float* wg = w + int64_t{g} * d;
      for (int32_t i = 0; i < d; ++i) wg[i] = qg[i] * hi[i];
      base[g] = 0.0f;
    }
    for (int32_t i = 0; i < d; ++i) {
      for (int32_t g = 0; g < G; ++g) base[g] += Rounded(qf[g * d + i] * lo[i]);
    }
    const uint8_t* rows = codes + cl.RowOffset(p, h, 0);
    if (simd) {
      cpu::KeyCodeDotsSimd(rows, G, d, ps, w, dots, isa);
    } else {
      KeyCodeDotsScalar(rows, G, d, ps, w, dots);
    }
    for (int32_t g = 0; g < G; ++g) {
      float* x = dots + int64_t{g} * ps;
      float best = kNegInf;
      for (int32_t t = 0; t < ps; ++t) {
        x[t] = a.softmax_scale * x[t];
        best = std::max(best, x[t]);
      }
      double sum = 0;
      for (int32_t t = 0; t < ps; ++t) sum += std::exp(x[t] - best);
      raw[int64_t{g} * P + p] =
          base[g] + (best + static_cast<float>(std::log(sum))) / a.softmax_scale;
    }
  }
  PoolGroup(a, b, h, raw);
}

// Calls fn(b, h, scratch) for every (sequence, KV head) head_mask leaves on, over the pool.
template <typename Fn>
void ForEachHead(const ScorePagesArgs& a, ThreadPool* pool, Fn&& fn) {
  ParallelFor(pool, int64_t{a.batch} * a.shape.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t i = begin; i < end; ++i) {
      if (a.head_mask != nullptr && a.head_mask[i] == 0) continue;
      fn(static_cast<int32_t>(i / a.shape.num_kv_heads),
         static_cast<int32_t>(i % a.shape.num_kv_heads), scratch);
    }
  });
}

void ScoreCodes(const ScorePagesArgs& a, ThreadPool* pool, cpu::Isa isa) {
  cpu::DispatchDType(a.shape.dtype, [&]<typename T>() {
    ForEachHead(a, pool, [&](int32_t b, int32_t h, std::vector<float>& scratch) {
      ScoreGroupCodes<T>(a, b, h, isa, scratch);
    });
  });
}

// Multi-versioned entries (x86-64-v3 and baseline), one per dtype.
KVTIER_CPU_CLONES void ScoreGroupOf(const ScorePagesArgs& a, int32_t b, int32_t h,
                                    std::vector<float>& scratch, const Half*) {
  ScoreGroup<Half>(a, b, h, scratch);
}
KVTIER_CPU_CLONES void ScoreGroupOf(const ScorePagesArgs& a, int32_t b, int32_t h,
                                    std::vector<float>& scratch, const BFloat16*) {
  ScoreGroup<BFloat16>(a, b, h, scratch);
}
KVTIER_CPU_CLONES void ScoreGroupOf(const ScorePagesArgs& a, int32_t b, int32_t h,
                                    std::vector<float>& scratch, const float*) {
  ScoreGroup<float>(a, b, h, scratch);
}

// The scalar reference (num_pages already checked).
void ScorePagesScalar(const ScorePagesArgs& a, ThreadPool* pool) {
  cpu::DispatchDType(a.shape.dtype, [&]<typename T>() {
    ForEachHead(a, pool, [&](int32_t b, int32_t h, std::vector<float>& scratch) {
      ScoreGroupOf(a, b, h, scratch, static_cast<const T*>(nullptr));
    });
  });
}

}  // namespace

absl::Status CpuScorePages(const ScorePagesArgs& a, ThreadPool* pool) {
  return CpuScorePages(a, pool, cpu::ActiveIsa());
}

absl::Status CpuScorePages(const ScorePagesArgs& a, ThreadPool* pool, cpu::Isa isa) {
  for (int32_t b = 0; b < a.batch; ++b) {
    if (a.num_pages[b] < 0 || a.num_pages[b] > a.max_pages) {
      return absl::OutOfRangeError(absl::StrFormat(
          "ScorePages: num_pages[%d] = %d must be in [0, max_pages = %d]", b, a.num_pages[b],
          a.max_pages));
    }
  }
  isa = cpu::RunnableIsa(isa, a.shape.head_dim);
  if (a.codes != nullptr) {
    ScoreCodes(a, pool, isa);
    return absl::OkStatus();
  }
  if (isa == cpu::Isa::kScalar) {
    ScorePagesScalar(a, pool);
  } else {
    cpu::ScorePagesSimd(a, pool, isa);
  }
  return absl::OkStatus();
}

}  // namespace kvtier
