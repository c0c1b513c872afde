// Selection on the GPU: page scoring with group pooling (Quest), top-k, query cosine with
// drift flags, and page-cache replacement. The CPU reference (kernels/cpu/score.cc, topk.cc,
// cosine.cc, replace.cc) defines the results: integer outputs match it exactly, float
// outputs up to fp32 rounding (sums are reduced in a different order).
//
// ScorePages: a warp scores one page of one KV head for its whole query group (the lanes
// split the d dimensions; the hi/lo rows are read once, the group's queries are staged as
// fp32 in shared memory). Pages are cut into tiles of TP ≥ max(32, 2·G) pages (the last
// tile takes the remainder), one block per (sequence, KV head, tile). The pooling (the mean
// over the group of a softmax over pages) needs, per query head, the max and the exp-sum over
// all pages of the sequence, so it is three kernels that use the head's own `pooled` row as
// scratch (the op allocates nothing): (1) each tile writes its per-query-head online-softmax
// statistics (m, Σ exp(x − m)) to pooled[t·2G, t·2G + 2G); (2) one block per KV head merges
// the tiles' statistics and writes the final (m, weight / sum) at the start of every tile,
// pooled[t·TP, t·TP + 2G); (3) each tile reads its copy, then overwrites its own pages with
// the pooled scores (raw scores re-read from `scores` when given, else recomputed). When the
// row holds fewer than two tiles, one block per KV head does all three steps with the
// statistics in shared memory.
//
// TopK: one block per (sequence, KV head), 512 threads, each warp owning a contiguous share
// of the candidates. Every candidate gets a 33-bit select key whose unsigned order is the
// CPU's order up to its page tie-break: pinned bit | score (order-preserving bits, -0 as +0,
// NaN below -inf), so equal keys are exactly the CPU's ties. An MSB-first radix select
// (a 1-bit pinned digit, then 8-bit digits) finds the k_h-th largest key T; each pass counts
// digits into per-warp histograms (lanes with equal digits combined by __match_any_sync, one
// uncontended shared atomic per distinct digit) that are summed once per pass. The selection
// is every key above T plus the first ties at T in page order: an ordered compaction (per-warp
// ballot counts, then each warp writes at its prefix offset, no shared counter) places it,
// and a bitonic network sorts it by (select key, page) (shared memory for up to kTopKSortKeys
// selections, else in place in the output row). The keys' low words and pinned bits are
// cached in shared memory when P is small.
//
// QueryCosine: one block per (sequence, KV head), a warp per query head.
//
// Replace: one block per (sequence, KV head) running the CPU's steps over the region: evict,
// rank the free slots in slot order and the misses in selection order (block-wide prefix
// counts), give the r-th miss the r-th free slot. Membership (is a slot's page selected, is
// it the page's first slot, is a selected page resident, is it the page's first entry) is
// one probe of two page → first-index hash tables in shared memory, built once per block,
// so a head costs O(k); regions over kReplaceSharedK slots fall back to scanning global
// memory.
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "kernels/cuda/compute_kernels.h"
#include "kernels/cuda/kernel_util.cuh"
#include "kvtier/layout.h"

namespace kvtier::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Geometry::kMaxGroupSize and kMaxHeadDim (kvtier/geometry.h is C++20, the .cu files C++17).
constexpr int32_t kMaxGroup = 64;     // query heads per KV head (lanes own g and g + 32)
constexpr int32_t kMaxHeadDim = 512;  // a lane holds at most 16 dimensions
static_assert(kMaxHeadDim <= 16 * kWarpSize, "DispatchPerLane covers every head_dim");

// Grid-stride loops cover launches with more work items than this.
constexpr int64_t kMaxGridBlocks = int64_t{1} << 20;

__device__ __forceinline__ int Lane() { return static_cast<int>(threadIdx.x) % kWarpSize; }
__device__ __forceinline__ int Warp() { return static_cast<int>(threadIdx.x) / kWarpSize; }
__device__ __forceinline__ int NumWarps() { return static_cast<int>(blockDim.x) / kWarpSize; }

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(kFullMask, v, offset);
  }
  return v;
}

// Exclusive prefix count of `flag` over the block's threads in thread order, and the block's
// total. Every thread of the block must call it; blockDim.x is a multiple of 32.
__device__ int32_t BlockRank(bool flag, int32_t* warp_counts, int32_t* total) {
  const unsigned ballot = __ballot_sync(kFullMask, flag);
  if (Lane() == 0) warp_counts[Warp()] = __popc(ballot);
  __syncthreads();
  int32_t before = 0;
  int32_t all = 0;
  for (int w = 0; w < NumWarps(); ++w) {
    if (w < Warp()) before += warp_counts[w];
    all += warp_counts[w];
  }
  __syncthreads();  // warp_counts may be reused
  *total = all;
  return before + __popc(ballot & ((1u << Lane()) - 1u));
}

// num_pages[b] is checked (reported by thread 0) for every head, as the CPU checks it for
// every sequence; then the head runs when head_mask allows it. Uniform across the block.
__device__ bool ActiveHead(const DeviceErrorSink& sink, KernelOp op, const int32_t* num_pages,
                           const uint8_t* head_mask, int32_t max_pages, int64_t bh, int32_t b,
                           int32_t* n) {
  *n = num_pages[b];
  if (!CheckField(sink, op, b, ItemField::kNumPages, *n, int64_t{max_pages} + 1)) return false;
  return head_mask == nullptr || head_mask[bh] != 0;
}

// ---------------------------------------------------------------------------------------
// ScorePages

constexpr int kTileThreads = 128;
constexpr int kTileWarps = kTileThreads / kWarpSize;
constexpr int kHeadThreads = 256;
constexpr int kHeadWarps = kHeadThreads / kWarpSize;
constexpr int kMergeThreads = 256;
constexpr int32_t kMinTilePages = 32;
constexpr size_t kMaxStagedQueryBytes = 32 * 1024;

struct ScoreParams {
  const void* q;          // [B][Hq][d]
  const void* summaries;  // [B][P][Hkv][2][d]
  const uint8_t* codes;   // [B][P] KeyCodeLayout pages, or null (bound scores)
  int32_t page_size;      // with codes
  const int32_t* num_pages;
  const uint8_t* head_mask;
  float* scores;  // optional
  float* pooled;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t max_pages;  // P
  int32_t group;      // G
  float scale;        // softmax_scale
  float weight;       // 1 / G
  bool stage_q;        // the group's queries are staged as fp32 in dynamic shared memory
  int32_t tile_pages;  // TP ≥ 2·G
  int32_t num_tiles;   // T; tile t is [t·TP, t·TP + TP), the last one [t·TP, P)
  int64_t num_items;   // B·Hkv·T
  DeviceErrorSink sink;
};

// Online softmax statistics of a set of values: m = their max (as std::max: a NaN never
// becomes it), s = Σ exp(x − m). (−inf, 0) is the empty set; s == 0 only for it.
__device__ __forceinline__ void MergeStat(float& m, float& s, float m2, float s2) {
  const float mn = m < m2 ? m2 : m;
  const float a = s == 0.0f ? 0.0f : s * expf(m - mn);
  const float c = s2 == 0.0f ? 0.0f : s2 * expf(m2 - mn);
  m = mn;
  s = a + c;
}

// Adds x: a −inf adds exp(−inf − m) = 0 to the CPU's sum, so it is skipped (an all −inf set
// keeps m = −inf and s = 0, and the pooled scores come out NaN as on the CPU).
__device__ __forceinline__ void PushStat(float& m, float& s, float x) {
  if (x != kNegInf) MergeStat(m, s, x, 1.0f);
}

// One page's share of the softmax pooling, rounded as the CPU's exp(scale·raw − m)·inv.
__device__ __forceinline__ float SoftmaxTerm(float scale, float raw, float m, float inv) {
  return __fmul_rn(expf(__fsub_rn(__fmul_rn(scale, raw), m)), inv);
}

template <typename T>
__device__ void StageQuery(const ScoreParams& p, int32_t b, int32_t h, float* qs) {
  if (!p.stage_q) return;
  const T* q = static_cast<const T*>(p.q) +
               HeadsLayout{p.num_q_heads, p.head_dim}.Offset(b, h * p.group, 0);
  const int32_t n = p.group * p.head_dim;
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) qs[i] = ToFloat(q[i]);
}

// Raw scores Σ_i max(q_i·hi_i, q_i·lo_i) of `page` for every query head g of KV head h's
// group, in g order: emit(g, score) on every lane. Called by a whole warp.
template <typename T, int kPerLane, typename Emit>
__device__ __forceinline__ void PageScores(const ScoreParams& p, int32_t b, int32_t h,
                                           int32_t page, const float* qs, Emit&& emit) {
  const int32_t d = p.head_dim;
  const int lane = Lane();
  const SummaryLayout sl{p.num_kv_heads, d};
  const T* hi_row = static_cast<const T*>(p.summaries) +
                    sl.Offset(int64_t{b} * p.max_pages + page, h, kHi, 0);
  const T* lo_row = hi_row + (sl.Offset(0, 0, kLo, 0) - sl.Offset(0, 0, kHi, 0));
  float hi[kPerLane];
  float lo[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int32_t i = lane + j * kWarpSize;
    hi[j] = i < d ? ToFloat(hi_row[i]) : 0.0f;
    lo[j] = i < d ? ToFloat(lo_row[i]) : 0.0f;
  }
  const T* qg = static_cast<const T*>(p.q) +
                HeadsLayout{p.num_q_heads, d}.Offset(b, h * p.group, 0);
  if (p.codes != nullptr) {
    // Key codes: lane l scores tokens l, l + 32, … of the page (the dimension weights
    // w_i = q_i·step_i broadcast from the lane that holds them); the warp merges the
    // tokens' log-sum-exp.
    const KeyCodeLayout cl{p.num_kv_heads, p.page_size, d};
    const uint8_t* rows = p.codes + cl.RowOffset(int64_t{b} * p.max_pages + page, h, 0);
    for (int32_t g = 0; g < p.group; ++g) {
      float base = 0.0f;
      float w[kPerLane];
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int32_t i = lane + j * kWarpSize;
        const float x = i < d ? (p.stage_q ? qs[g * d + i] : ToFloat(qg[int64_t{g} * d + i])) : 0.0f;
        base += x * lo[j];
        w[j] = x * __fdiv_rn(hi[j] - lo[j], static_cast<float>(kKeyCodeLevels));
      }
      base = WarpSum(base);
      // Online log-sum-exp statistics of scale·x_t over the lane's tokens, then the warp's.
      float m = kNegInf;
      float sum = 0.0f;
      for (int32_t t0 = 0; t0 < p.page_size; t0 += kWarpSize) {
        const int32_t t = t0 + lane;
        const uint8_t* row = rows + (t < p.page_size ? t : 0) * cl.row_bytes();
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
          for (int32_t l = 0; l < kWarpSize && j * kWarpSize + l < d; l += 2) {
            const float w0 = __shfl_sync(kFullMask, w[j], l);
            const float w1 = __shfl_sync(kFullMask, w[j], l + 1);
            const uint8_t c = row[(j * kWarpSize + l) / 2];
            acc += w0 * (static_cast<float>(c & 15) + 0.5f);
            acc += w1 * (static_cast<float>(c >> 4) + 0.5f);
          }
        }
        if (t < p.page_size) PushStat(m, sum, __fmul_rn(p.scale, acc));
      }
      for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        const float m2 = __shfl_xor_sync(kFullMask, m, offset);
        const float s2 = __shfl_xor_sync(kFullMask, sum, offset);
        MergeStat(m, sum, m2, s2);
      }
      emit(g, base + __fdiv_rn(m + logf(sum), p.scale));
    }
    return;
  }
  for (int32_t g = 0; g < p.group; ++g) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int32_t i = lane + j * kWarpSize;
      if (i < d) {
        const float x = p.stage_q ? qs[g * d + i] : ToFloat(qg[int64_t{g} * d + i]);
        const float a = x * hi[j];
        const float c = x * lo[j];
        acc += a > c ? a : c;
      }
    }
    emit(g, WarpSum(acc));
  }
}

// Scores pages [lo, hi) of KV head (b, h), whose sequence has n pages: raw scores to
// p.scores (−inf from n on), and the pages' per-query-head softmax statistics to
// stat_m/stat_s[g]. Returns with the block synchronised.
template <typename T, int kPerLane>
__device__ void ScoreTile(const ScoreParams& p, int32_t b, int32_t h, int32_t lo, int32_t hi,
                          int32_t n, const float* qs, float* warp_m, float* warp_s,
                          float* stat_m, float* stat_s) {
  const int lane = Lane();
  const int warp = Warp();
  const int32_t G = p.group;
  const int32_t P = p.max_pages;
  float* scores =
      p.scores != nullptr ? p.scores + (int64_t{b} * p.num_q_heads + h * G) * P : nullptr;
  // Lane l's statistics of query heads l and l + 32.
  float m0 = kNegInf;
  float s0 = 0.0f;
  float m1 = kNegInf;
  float s1 = 0.0f;
  const int32_t valid_end = min(hi, n);
  for (int32_t page = lo + warp; page < valid_end; page += NumWarps()) {
    PageScores<T, kPerLane>(p, b, h, page, qs, [&](int32_t g, float r) {
      const bool owner = lane == (g & (kWarpSize - 1));
      if (scores != nullptr && owner) scores[int64_t{g} * P + page] = r;
      if (owner) {
        const float x = __fmul_rn(p.scale, r);
        if (g < kWarpSize) {
          PushStat(m0, s0, x);
        } else {
          PushStat(m1, s1, x);
        }
      }
    });
  }
  const int32_t tail = max(lo, n);
  if (scores != nullptr && tail < hi) {
    const int32_t width = hi - tail;
    for (int64_t i = threadIdx.x; i < int64_t{G} * width; i += blockDim.x) {
      const int64_t g = i / width;
      scores[g * P + tail + (i - g * width)] = kNegInf;
    }
  }
  if (lane < G) {
    warp_m[warp * kMaxGroup + lane] = m0;
    warp_s[warp * kMaxGroup + lane] = s0;
  }
  if (lane + kWarpSize < G) {
    warp_m[warp * kMaxGroup + lane + kWarpSize] = m1;
    warp_s[warp * kMaxGroup + lane + kWarpSize] = s1;
  }
  __syncthreads();
  for (int32_t g = threadIdx.x; g < G; g += blockDim.x) {
    float m = kNegInf;
    float s = 0.0f;
    for (int w = 0; w < NumWarps(); ++w) {
      MergeStat(m, s, warp_m[w * kMaxGroup + g], warp_s[w * kMaxGroup + g]);
    }
    stat_m[g] = m;
    stat_s[g] = s;
  }
  __syncthreads();
}

// Softmax pooling of pages [lo, hi): pooled = Σ_g exp(scale·raw_g − m_g)·inv_g summed in g
// order as on the CPU (inv_g = weight / sum_g), −inf from n on. Raw scores are read back
// from p.scores when given, else recomputed.
template <typename T, int kPerLane>
__device__ void PoolTile(const ScoreParams& p, int32_t b, int32_t h, int32_t lo, int32_t hi,
                         int32_t n, const float* qs, const float* stat_m,
                         const float* stat_inv) {
  const int32_t G = p.group;
  const int32_t P = p.max_pages;
  float* pooled = p.pooled + (int64_t{b} * p.num_kv_heads + h) * P;
  const int32_t valid_end = min(hi, n);
  if (p.scores != nullptr) {
    const float* scores = p.scores + (int64_t{b} * p.num_q_heads + h * G) * P;
    for (int32_t page = lo + threadIdx.x; page < valid_end; page += blockDim.x) {
      float acc = 0.0f;
      for (int32_t g = 0; g < G; ++g) {
        const float r = scores[int64_t{g} * P + page];
        acc = __fadd_rn(acc, SoftmaxTerm(p.scale, r, stat_m[g], stat_inv[g]));
      }
      pooled[page] = acc;
    }
  } else {
    for (int32_t page = lo + Warp(); page < valid_end; page += NumWarps()) {
      float acc = 0.0f;
      PageScores<T, kPerLane>(p, b, h, page, qs, [&](int32_t g, float r) {
        acc = __fadd_rn(acc, SoftmaxTerm(p.scale, r, stat_m[g], stat_inv[g]));
      });
      if (Lane() == 0) pooled[page] = acc;
    }
  }
  for (int32_t page = max(lo, n) + threadIdx.x; page < hi; page += blockDim.x) {
    pooled[page] = kNegInf;
  }
}

// Whole rows in one block per (sequence, KV head): softmax pooling when P < 2·TP.
template <typename T, int kPerLane>
__global__ void __launch_bounds__(kHeadThreads) ScoreHeadKernel(const ScoreParams p) {
  extern __shared__ float head_qs[];
  __shared__ float warp_m[kHeadWarps * kMaxGroup];
  __shared__ float warp_s[kHeadWarps * kMaxGroup];
  __shared__ float stat_m[kMaxGroup];
  __shared__ float stat_s[kMaxGroup];
  const int64_t bh = blockIdx.x;
  const auto b = static_cast<int32_t>(bh / p.num_kv_heads);
  const auto h = static_cast<int32_t>(bh % p.num_kv_heads);
  int32_t n;
  if (!ActiveHead(p.sink, KernelOp::kScorePages, p.num_pages, p.head_mask, p.max_pages, bh, b,
                  &n)) {
    return;
  }
  StageQuery<T>(p, b, h, head_qs);
  __syncthreads();
  ScoreTile<T, kPerLane>(p, b, h, 0, p.max_pages, n, head_qs, warp_m, warp_s, stat_m, stat_s);
  for (int32_t g = threadIdx.x; g < p.group; g += blockDim.x) stat_s[g] = p.weight / stat_s[g];
  __syncthreads();
  PoolTile<T, kPerLane>(p, b, h, 0, p.max_pages, n, head_qs, stat_m, stat_s);
}

__device__ __forceinline__ void TileBounds(const ScoreParams& p, int32_t t, int32_t* lo,
                                           int32_t* hi) {
  *lo = t * p.tile_pages;
  *hi = t == p.num_tiles - 1 ? p.max_pages : *lo + p.tile_pages;
}

// Tiled step 1: one block per (head, tile).
template <typename T, int kPerLane>
__global__ void __launch_bounds__(kTileThreads) ScoreTilesKernel(const ScoreParams p) {
  extern __shared__ float tile_qs[];
  __shared__ float warp_m[kTileWarps * kMaxGroup];
  __shared__ float warp_s[kTileWarps * kMaxGroup];
  __shared__ float stat_m[kMaxGroup];
  __shared__ float stat_s[kMaxGroup];
  for (int64_t item = blockIdx.x; item < p.num_items; item += gridDim.x) {
    const int64_t bh = item / p.num_tiles;
    const auto t = static_cast<int32_t>(item % p.num_tiles);
    const auto b = static_cast<int32_t>(bh / p.num_kv_heads);
    const auto h = static_cast<int32_t>(bh % p.num_kv_heads);
    int32_t n;
    if (!ActiveHead(p.sink, KernelOp::kScorePages, p.num_pages, p.head_mask, p.max_pages, bh,
                    b, &n)) {
      continue;
    }
    int32_t lo;
    int32_t hi;
    TileBounds(p, t, &lo, &hi);
    StageQuery<T>(p, b, h, tile_qs);
    __syncthreads();
    ScoreTile<T, kPerLane>(p, b, h, lo, hi, n, tile_qs, warp_m, warp_s, stat_m, stat_s);
    // Compact statistics: T·2G ≤ T·TP ≤ P floats of the head's row.
    float* stats = p.pooled + bh * p.max_pages + int64_t{t} * 2 * p.group;
    for (int32_t g = threadIdx.x; g < p.group; g += blockDim.x) {
      stats[2 * g] = stat_m[g];
      stats[2 * g + 1] = stat_s[g];
    }
    __syncthreads();
  }
}

// Tiled step 2: merges the tiles' statistics of one head and copies the result (m, inv) to
// the start of every tile that has pages below n (each at least TP ≥ 2G pages long).
__global__ void __launch_bounds__(kMergeThreads) ScoreMergeKernel(const ScoreParams p) {
  __shared__ float stat_m[kMaxGroup];
  __shared__ float stat_inv[kMaxGroup];
  const int64_t bh = blockIdx.x;
  const auto b = static_cast<int32_t>(bh / p.num_kv_heads);
  int32_t n;
  if (!ActiveHead(p.sink, KernelOp::kScorePages, p.num_pages, p.head_mask, p.max_pages, bh, b,
                  &n)) {
    return;
  }
  const int32_t G = p.group;
  const int32_t filled = min(p.num_tiles, (n + p.tile_pages - 1) / p.tile_pages);
  float* row = p.pooled + bh * p.max_pages;
  for (int32_t g = Warp(); g < G; g += NumWarps()) {
    float m = kNegInf;
    float s = 0.0f;
    for (int32_t t = Lane(); t < filled; t += kWarpSize) {
      const float* stats = row + int64_t{t} * 2 * G;
      MergeStat(m, s, stats[2 * g], stats[2 * g + 1]);
    }
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      const float m2 = __shfl_xor_sync(kFullMask, m, offset);
      const float s2 = __shfl_xor_sync(kFullMask, s, offset);
      MergeStat(m, s, m2, s2);
    }
    if (Lane() == 0) {
      stat_m[g] = m;
      stat_inv[g] = p.weight / s;
    }
  }
  __syncthreads();  // every tile's statistics were read before any is overwritten
  for (int64_t i = threadIdx.x; i < int64_t{filled} * G; i += blockDim.x) {
    const int64_t t = i / G;
    const auto g = static_cast<int32_t>(i - t * G);
    float* stats = row + t * p.tile_pages;
    stats[2 * g] = stat_m[g];
    stats[2 * g + 1] = stat_inv[g];
  }
}

// Tiled step 3: each tile reads its copy of the statistics, then writes its pooled scores.
template <typename T, int kPerLane>
__global__ void __launch_bounds__(kTileThreads) ScorePoolKernel(const ScoreParams p) {
  extern __shared__ float pool_qs[];
  __shared__ float stat_m[kMaxGroup];
  __shared__ float stat_inv[kMaxGroup];
  for (int64_t item = blockIdx.x; item < p.num_items; item += gridDim.x) {
    const int64_t bh = item / p.num_tiles;
    const auto t = static_cast<int32_t>(item % p.num_tiles);
    const auto b = static_cast<int32_t>(bh / p.num_kv_heads);
    const auto h = static_cast<int32_t>(bh % p.num_kv_heads);
    int32_t n;
    if (!ActiveHead(p.sink, KernelOp::kScorePages, p.num_pages, p.head_mask, p.max_pages, bh,
                    b, &n)) {
      continue;
    }
    int32_t lo;
    int32_t hi;
    TileBounds(p, t, &lo, &hi);
    if (lo < n) {
      const float* stats = p.pooled + bh * p.max_pages + lo;
      for (int32_t g = threadIdx.x; g < p.group; g += blockDim.x) {
        stat_m[g] = stats[2 * g];
        stat_inv[g] = stats[2 * g + 1];
      }
      if (p.scores == nullptr) StageQuery<T>(p, b, h, pool_qs);
    }
    __syncthreads();  // the statistics are read before the tile is overwritten
    PoolTile<T, kPerLane>(p, b, h, lo, hi, n, pool_qs, stat_m, stat_inv);
    __syncthreads();
  }
}

// Calls fn(std::integral_constant<int, L>{}) with L the dimensions per lane for head_dim.
template <typename Fn>
cudaError_t DispatchPerLane(int32_t head_dim, Fn&& fn) {
  if (head_dim <= 4 * kWarpSize) return fn(std::integral_constant<int, 4>{});
  if (head_dim <= 8 * kWarpSize) return fn(std::integral_constant<int, 8>{});
  return fn(std::integral_constant<int, 16>{});
}

unsigned GridBlocks(int64_t items) {
  return static_cast<unsigned>(items < kMaxGridBlocks ? items : kMaxGridBlocks);
}

// ---------------------------------------------------------------------------------------
// TopK

constexpr int kTopKThreads = 512;
constexpr int kTopKWarps = kTopKThreads / kWarpSize;
constexpr int kTopKBatch = 4;              // 32-key steps a warp loads before it uses them
constexpr int32_t kTopKCachedKeys = 4096;  // keys cached in shared memory when P ≤ this
constexpr int32_t kTopKSortKeys = 1024;    // selections sorted in shared memory
constexpr int kPageBits = 24;              // kMaxPages (ops.cc) = 2^24
constexpr uint32_t kPageMask = (1u << kPageBits) - 1u;
constexpr int kRadixBits = 8;
constexpr int kRadixBins = 1 << kRadixBits;
constexpr int kClassShift = 32;  // the select key's pinned bit (and its highest digit)
constexpr int32_t kTakeAll = std::numeric_limits<int32_t>::max();

struct TopKParams {
  const float* pooled;
  const int32_t* num_pages;
  const uint8_t* head_mask;
  const int32_t* head_k;
  const uint8_t* page_flags;
  int32_t* selected;
  int32_t num_kv_heads;
  int32_t max_pages;
  int32_t k;
  int32_t sink_pages;
  int32_t recent_pages;
  bool cache_keys;
  DeviceErrorSink sink;
};

// The CPU's Better order without its page tie-break, as unsigned order, larger first: bit 32
// pinned, bits [0, 32) the score (sign-magnitude flipped to unsigned order, -0 as +0, NaN = 1
// below -inf's 0x7fffff). Two candidates tie on the CPU exactly when their keys are equal.
// Never 0: 0 marks a non-candidate.
__device__ __forceinline__ uint64_t SelectKey(float score, bool pinned) {
  uint32_t bits = 1u;
  if (!isnan(score)) {
    const uint32_t u = score == 0.0f ? 0u : __float_as_uint(score);
    bits = (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
  }
  return (static_cast<uint64_t>(pinned ? 1 : 0) << kClassShift) | bits;
}

// The whole CPU order as unsigned order: the select key, then 2^24 − 1 − page (lower pages
// first). Distinct for distinct pages.
__device__ __forceinline__ uint64_t RankKey(uint64_t select_key, int32_t page) {
  return (select_key << kPageBits) | static_cast<uint64_t>(kPageMask - static_cast<uint32_t>(page));
}

__device__ __forceinline__ int32_t PageOfKey(uint64_t key) {
  return static_cast<int32_t>(kPageMask - (static_cast<uint32_t>(key) & kPageMask));
}

// Select key of `page` of this head (flags: the head's [P] flags or null), 0 when excluded.
__device__ __forceinline__ uint64_t CandidateKey(const float* score, const uint8_t* flags,
                                                 int32_t page) {
  const uint8_t f = flags != nullptr ? flags[page] : kPageNormal;
  if ((f & kPageExcluded) != 0) return 0;
  return SelectKey(score[page], (f & kPagePinned) != 0);
}

// Select key of candidate i (page begin + i), read from global memory each time...
struct GlobalKeys {
  const float* score;
  const uint8_t* flags;
  int32_t begin;
  __device__ uint64_t operator()(int32_t i) const { return CandidateKey(score, flags, begin + i); }
};

// ...or from shared memory: the key's low 32 bits per candidate (0: not a candidate) and its
// pinned bit, one word per 32 candidates.
struct CachedKeys {
  const uint32_t* low;
  const uint32_t* pinned;
  __device__ uint64_t operator()(int32_t i) const {
    const uint32_t pin = (pinned[i / kWarpSize] >> (i % kWarpSize)) & 1u;
    return (static_cast<uint64_t>(pin) << kClassShift) | low[i];
  }
};

// Sort storage: keys in shared memory.
struct SharedKeys {
  uint64_t* keys;
  __device__ uint64_t Load(int32_t i) const { return keys[i]; }
  __device__ void Store(int32_t i, uint64_t key) const { keys[i] = key; }
};

// Sort storage: pages in the output row, keyed on the fly.
struct RowPages {
  int32_t* pages;
  const float* score;
  const uint8_t* flags;
  __device__ uint64_t Load(int32_t i) const {
    const int32_t page = pages[i];
    const bool pinned = flags != nullptr && (flags[page] & kPagePinned) != 0;
    return RankKey(SelectKey(score[page], pinned), page);
  }
  __device__ void Store(int32_t i, uint64_t key) const { pages[i] = PageOfKey(key); }
};

template <typename Keys>
__device__ __forceinline__ void CompareExchange(const Keys& keys, int32_t a, int32_t b,
                                                int32_t m) {
  if (b >= m) return;  // b is padding (a virtual minimum): already in order
  const uint64_t ka = keys.Load(a);
  const uint64_t kb = keys.Load(b);
  if (ka < kb) {
    keys.Store(a, kb);
    keys.Store(b, ka);
  }
}

// Sorts entries [0, m) descending with a bitonic network over the next power of two whose
// merges all run in one direction (each merge starts by comparing mirrored elements), so
// the virtual padding elements (minima) at [m, ...) never move and need no storage.
template <typename Keys>
__device__ void BitonicSortDescending(const Keys& keys, int32_t m) {
  if (m < 2) return;
  int32_t width = 1;
  while (width < m) width *= 2;
  const int32_t pairs = width / 2;
  for (int32_t size = 2; size <= width; size *= 2) {
    const int32_t half = size / 2;
    for (int32_t t = threadIdx.x; t < pairs; t += blockDim.x) {
      const int32_t base = (t / half) * size;
      const int32_t offset = t % half;
      CompareExchange(keys, base + offset, base + size - 1 - offset, m);
    }
    __syncthreads();
    for (int32_t stride = half / 2; stride > 0; stride /= 2) {
      for (int32_t t = threadIdx.x; t < pairs; t += blockDim.x) {
        const int32_t a = (t / stride) * 2 * stride + t % stride;
        CompareExchange(keys, a, a + stride, m);
      }
      __syncthreads();
    }
  }
}

// The warp's share [lo, hi) of the candidates [0, len): contiguous, in whole steps of 32, so
// candidate order is warp order, then step order, then lane order.
__device__ __forceinline__ void WarpChunk(int32_t len, int32_t* lo, int32_t* hi) {
  const int32_t per_warp =
      ((len + kTopKWarps - 1) / kTopKWarps + kWarpSize - 1) / kWarpSize * kWarpSize;
  *lo = min(len, Warp() * per_warp);
  *hi = min(len, *lo + per_warp);
}

// fn(i, key) for every candidate i of the warp's share, in candidate order, kTopKBatch steps
// of 32 keys loaded before any is used (independent loads in flight). Every lane calls fn in
// every step, with key 0 past hi, so fn may use warp intrinsics.
template <typename Keys, typename Fn>
__device__ __forceinline__ void ForWarpKeys(int32_t lo, int32_t hi, const Keys& key_at, Fn&& fn) {
  for (int32_t j = lo; j < hi; j += kWarpSize * kTopKBatch) {
    uint64_t keys[kTopKBatch];
#pragma unroll
    for (int s = 0; s < kTopKBatch; ++s) {
      const int32_t i = j + s * kWarpSize + Lane();
      keys[s] = i < hi ? key_at(i) : 0;
    }
#pragma unroll
    for (int s = 0; s < kTopKBatch; ++s) fn(j + s * kWarpSize + Lane(), keys[s]);
  }
}

struct RadixState {
  uint64_t prefix;     // digits chosen so far
  uint64_t threshold;  // when done: the selection is every candidate key ≥ threshold
  int32_t remaining;   // keys still to take from the keys matching prefix
  int32_t need;        // min(k_h, candidates)
  int32_t done;
};

struct TopKShared {
  int32_t warp_hist[kTopKWarps][kRadixBins];  // each warp's own histogram of a pass
  int32_t hist[kRadixBins];                   // their sum
  uint64_t sorted[kTopKSortKeys];
  int32_t warp_above[kTopKWarps];  // compaction: keys above the threshold per warp
  int32_t warp_equal[kTopKWarps];  // and keys equal to it
  RadixState st;
};

// One radix pass: the histogram of the digit at `shift` of the keys that match `prefix` on
// `mask`. Each warp counts its share into its own histogram (lanes with the same digit
// combine with __match_any_sync, so one shared atomic per distinct digit per step, on a row
// no other warp touches); then thread t sums bin t over the warps. Every thread calls it.
template <typename Keys>
__device__ void DigitHistogram(const Keys& key_at, int32_t lo, int32_t hi, uint64_t mask,
                               uint64_t prefix, int shift, TopKShared& sh) {
  int32_t* mine = sh.warp_hist[Warp()];
  for (int bin = Lane(); bin < kRadixBins; bin += kWarpSize) mine[bin] = 0;
  __syncwarp();
  ForWarpKeys(lo, hi, key_at, [&](int32_t, uint64_t key) {
    const bool in = key != 0 && (key & mask) == prefix;
    const int digit = in ? static_cast<int>(key >> shift) & (kRadixBins - 1) : -1;
    const unsigned peers = __match_any_sync(kFullMask, digit);
    if (in && Lane() == __ffs(peers) - 1) atomicAdd(&mine[digit], __popc(peers));
  });
  __syncthreads();
  for (int bin = threadIdx.x; bin < kRadixBins; bin += blockDim.x) {
    int32_t sum = 0;
    for (int w = 0; w < kTopKWarps; ++w) sum += sh.warp_hist[w][bin];
    sh.hist[bin] = sum;
  }
  __syncthreads();
}

// Warp 0: picks the digit (at `shift`) of the bucket holding the remaining-th largest key
// among those matching the prefix. Lane l owns bins [8l, 8l + 8). The first pass counts
// every candidate and fixes need = min(k_h, candidates).
__device__ void SelectDigit(const int32_t* hist, int shift, bool first, int32_t k_h,
                            RadixState* st) {
  const int lane = Lane();
  constexpr int kBinsPerLane = kRadixBins / kWarpSize;
  // The state is read by every lane before the one that picks the digit writes it.
  const uint64_t chosen = st->prefix;
  int32_t remaining = st->remaining;
  __syncwarp();
  int32_t local = 0;
#pragma unroll
  for (int j = 0; j < kBinsPerLane; ++j) local += hist[lane * kBinsPerLane + j];
  int32_t suffix = local;  // inclusive count of the bins from this lane's up
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const int32_t v = __shfl_down_sync(kFullMask, suffix, offset);
    if (lane + offset < kWarpSize) suffix += v;
  }
  const int32_t total = __shfl_sync(kFullMask, suffix, 0);
  if (first) {
    const int32_t need = min(k_h, total);
    if (need == 0 || need == total) {  // nothing, or every candidate
      if (lane == 0) {
        st->need = need;
        st->threshold = need == 0 ? ~uint64_t{0} : 1;
        st->done = 1;
      }
      return;
    }
    if (lane == 0) st->need = need;
    remaining = need;
  }
  int32_t above = suffix - local;  // keys in higher bins
  for (int j = kBinsPerLane - 1; j >= 0; --j) {
    const int32_t bin = lane * kBinsPerLane + j;
    const int32_t count = hist[bin];
    if (above < remaining && remaining <= above + count) {
      const uint64_t prefix = chosen | (static_cast<uint64_t>(bin) << shift);
      const int32_t rest = remaining - above;
      st->prefix = prefix;
      st->remaining = rest;
      if (count == rest) {  // the whole bucket is taken: the smallest key with this prefix
        st->threshold = prefix;
        st->done = 1;
      }
    }
    above += count;
  }
}

// Where a radix select cut: the selection is every key above `threshold` and the first
// `take_equal` keys equal to it in candidate order (the ties at the last place go to the
// lower pages), `need` keys in all.
struct Cut {
  uint64_t threshold;
  int32_t take_equal;
  int32_t need;
};

// Radix select of the k_h-th largest select key of the candidates, most significant digit
// first. Without flags no key is pinned, and the pinned digit is skipped. Every thread calls
// it (sh.st zeroed and the block synchronised before).
template <typename Keys>
__device__ Cut RadixSelect(const Keys& key_at, int32_t lo, int32_t hi, int32_t k_h, bool has_flags,
                           TopKShared& sh) {
  const int first_shift = has_flags ? kClassShift : kClassShift - kRadixBits;
  uint64_t mask = 0;  // the digits fixed so far
  for (int shift = first_shift; shift >= 0; shift -= kRadixBits) {
    const uint64_t prefix = sh.st.prefix;
    DigitHistogram(key_at, lo, hi, mask, prefix, shift, sh);
    if (Warp() == 0) SelectDigit(sh.hist, shift, shift == first_shift, k_h, &sh.st);
    __syncthreads();
    if (sh.st.done != 0) break;
    mask |= static_cast<uint64_t>(kRadixBins - 1) << shift;
  }
  // Ended on a whole bucket: every key ≥ threshold. Else after the last digit: the keys
  // above the exact key `prefix` and `remaining` of those equal to it.
  if (sh.st.done != 0) return Cut{sh.st.threshold, kTakeAll, sh.st.need};
  return Cut{sh.st.prefix, sh.st.remaining, sh.st.need};
}

// Ordered compaction of the selection into sh.sorted (as rank keys) when it fits, else into
// out (as pages), in any order: each warp counts its keys above and equal to the threshold,
// then writes its share at the offset the warps before it leave (no shared counter). Key 0
// (not a candidate) is neither above nor equal, as threshold ≥ 1. Returns with the block
// synchronised.
template <typename Keys>
__device__ void CompactSelection(const Keys& key_at, int32_t lo, int32_t hi, int32_t begin,
                                 const Cut& cut, int32_t* out, TopKShared& sh) {
  int32_t above = 0;
  int32_t equal = 0;
  ForWarpKeys(lo, hi, key_at, [&](int32_t, uint64_t key) {
    above += __popc(__ballot_sync(kFullMask, key > cut.threshold));
    equal += __popc(__ballot_sync(kFullMask, key != 0 && key == cut.threshold));
  });
  if (Lane() == 0) {
    sh.warp_above[Warp()] = above;
    sh.warp_equal[Warp()] = equal;
  }
  __syncthreads();
  int32_t pos = 0;           // selected keys before this warp's next step
  int32_t equal_before = 0;  // keys equal to the threshold before this warp's share
  for (int w = 0; w < Warp(); ++w) {
    const int32_t e = sh.warp_equal[w];
    pos += sh.warp_above[w] + max(0, min(e, cut.take_equal - equal_before));
    equal_before += e;
  }
  int32_t equal_left = max(0, cut.take_equal - equal_before);  // ties this warp may take
  const bool in_shared = cut.need <= kTopKSortKeys;
  const unsigned lower_lanes = (1u << Lane()) - 1u;
  ForWarpKeys(lo, hi, key_at, [&](int32_t i, uint64_t key) {
    const bool eq = key != 0 && key == cut.threshold;
    const unsigned eq_ballot = __ballot_sync(kFullMask, eq);
    const bool take = key > cut.threshold || (eq && __popc(eq_ballot & lower_lanes) < equal_left);
    const unsigned take_ballot = __ballot_sync(kFullMask, take);
    const int32_t at = pos + __popc(take_ballot & lower_lanes);
    if (take && at < cut.need) {  // always: exactly `need` keys are taken
      if (in_shared) {
        sh.sorted[at] = RankKey(key, begin + i);
      } else {
        out[at] = begin + i;
      }
    }
    pos += __popc(take_ballot);
    equal_left -= __popc(eq_ballot);
  });
  __syncthreads();
}

// Selects the k_h best of candidates [0, len) (page begin + i) into out[0, k), -1 after the
// selection: the cut, the compaction, then the sort by the whole order (select key, then
// page). Every thread calls it.
template <typename Keys>
__device__ __forceinline__ void SelectHead(const Keys& key_at, int32_t len, int32_t begin,
                                           int32_t k, int32_t k_h, bool has_flags,
                                           const float* score, const uint8_t* flags, int32_t* out,
                                           TopKShared& sh) {
  int32_t lo;
  int32_t hi;
  WarpChunk(len, &lo, &hi);
  const Cut cut = RadixSelect(key_at, lo, hi, k_h, has_flags, sh);
  CompactSelection(key_at, lo, hi, begin, cut, out, sh);
  const bool in_shared = cut.need <= kTopKSortKeys;
  if (in_shared) {
    BitonicSortDescending(SharedKeys{sh.sorted}, cut.need);
  } else {
    BitonicSortDescending(RowPages{out, score, flags}, cut.need);
  }
  for (int32_t i = threadIdx.x; i < k; i += blockDim.x) {
    if (i >= cut.need) {
      out[i] = kEmptySlot;
    } else if (in_shared) {
      out[i] = PageOfKey(sh.sorted[i]);
    }
  }
}

__global__ void __launch_bounds__(kTopKThreads) TopKKernel(const TopKParams p) {
  // When p.cache_keys: [P] low key words, then [⌈P/32⌉] pinned bits.
  extern __shared__ uint32_t topk_cache[];
  __shared__ TopKShared sh;
  const int64_t bh = blockIdx.x;
  const auto b = static_cast<int32_t>(bh / p.num_kv_heads);
  int32_t n;
  if (!ActiveHead(p.sink, KernelOp::kTopK, p.num_pages, p.head_mask, p.max_pages, bh, b, &n)) {
    return;
  }
  int32_t k_h = p.k;
  if (p.head_k != nullptr) {
    k_h = p.head_k[bh];
    if (!CheckField(p.sink, KernelOp::kTopK, bh, ItemField::kHeadK, k_h, int64_t{p.k} + 1)) {
      return;
    }
  }
  const int32_t begin = min(p.sink_pages, n);
  const int32_t end = max(begin, n - p.recent_pages);
  const int32_t len = end - begin;
  const float* score = p.pooled + bh * p.max_pages;
  const uint8_t* flags = p.page_flags != nullptr ? p.page_flags + bh * p.max_pages : nullptr;
  int32_t* out = p.selected + bh * p.k;
  const bool has_flags = flags != nullptr;
  const GlobalKeys global{score, flags, begin};
  if (threadIdx.x == 0) sh.st = RadixState{0, 0, 0, 0, 0};
  if (p.cache_keys) {  // len ≤ P ≤ kTopKCachedKeys
    uint32_t* low = topk_cache;
    uint32_t* pinned = topk_cache + p.max_pages;
    int32_t lo;
    int32_t hi;
    WarpChunk(len, &lo, &hi);
    ForWarpKeys(lo, hi, global, [&](int32_t i, uint64_t key) {
      if (i < hi) low[i] = static_cast<uint32_t>(key);
      const unsigned pin = __ballot_sync(kFullMask, ((key >> kClassShift) & 1u) != 0);
      const int32_t step = i - Lane();  // a multiple of 32
      if (Lane() == 0 && step < hi) pinned[step / kWarpSize] = pin;
    });
    __syncthreads();
    SelectHead(CachedKeys{low, pinned}, len, begin, p.k, k_h, has_flags, score, flags, out, sh);
  } else {
    __syncthreads();
    SelectHead(global, len, begin, p.k, k_h, has_flags, score, flags, out, sh);
  }
}

// ---------------------------------------------------------------------------------------
// QueryCosine

constexpr int kCosineThreads = 128;

template <typename T>
__global__ void __launch_bounds__(kCosineThreads) QueryCosineKernel(const QueryCosineArgs a) {
  __shared__ float cosines[kMaxGroup];
  const int64_t bh = blockIdx.x;
  const auto b = static_cast<int32_t>(bh / a.shape.num_kv_heads);
  const auto h = static_cast<int32_t>(bh % a.shape.num_kv_heads);
  const int32_t G = a.shape.num_q_heads / a.shape.num_kv_heads;
  const int32_t d = a.shape.head_dim;
  const HeadsLayout ql{a.shape.num_q_heads, d};
  for (int32_t g = Warp(); g < G; g += NumWarps()) {
    const int32_t hq = h * G + g;
    const T* x = static_cast<const T*>(a.q) + ql.Offset(b, hq, 0);
    const T* y = static_cast<const T*>(a.q_prev) + ql.Offset(b, hq, 0);
    float xx = 0.0f;
    float yy = 0.0f;
    float xy = 0.0f;
    for (int32_t i = Lane(); i < d; i += kWarpSize) {
      const float xf = ToFloat(x[i]);
      const float yf = ToFloat(y[i]);
      xx += xf * xf;
      yy += yf * yf;
      xy += xf * yf;
    }
    xx = WarpSum(xx);
    yy = WarpSum(yy);
    xy = WarpSum(xy);
    const float c = (xx > 0.0f && yy > 0.0f) ? xy / (sqrtf(xx) * sqrtf(yy)) : 0.0f;
    if (Lane() == 0) {
      cosines[g] = c;
      if (a.cosine != nullptr) a.cosine[int64_t{b} * a.shape.num_q_heads + hq] = c;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double sum = 0;  // in g order, as the CPU
    for (int32_t g = 0; g < G; ++g) sum += cosines[g];
    const auto mean = static_cast<float>(sum / G);
    a.group_mean[bh] = mean;
    if (a.drifted != nullptr) a.drifted[bh] = mean < a.threshold ? 1 : 0;
  }
}

// ---------------------------------------------------------------------------------------
// Replace

constexpr int kReplaceThreads = 256;
constexpr int32_t kReplaceSharedK = 1024;  // regions up to this size use shared page indexes
constexpr int32_t kNoPage = -1;            // an empty entry of a page index
constexpr int32_t kAbsent = std::numeric_limits<int32_t>::max();

// A page → smallest-index table in shared memory: open addressing with linear probing over
// 2^bits ≥ 2·(entries) slots, so a probe always ends at the page or an empty slot. Filled
// with atomics by every thread, then read only (after a barrier); the answer is the same in
// any insertion order.
struct PageIndex {
  int32_t* pages;  // [2^bits] a page, or kNoPage
  int32_t* first;  // [2^bits] the smallest index inserted with that page
  int bits;

  __device__ uint32_t Home(int32_t page) const {
    return (static_cast<uint32_t>(page) * 2654435769u) >> (32 - bits);  // Fibonacci hashing
  }
  __device__ uint32_t Next(uint32_t slot) const { return (slot + 1u) & ((1u << bits) - 1u); }
  __device__ void Clear() const {
    for (int32_t i = threadIdx.x; i < (1 << bits); i += blockDim.x) {
      pages[i] = kNoPage;
      first[i] = kAbsent;
    }
  }
  // REQUIRES: page ≥ 0.
  __device__ void Insert(int32_t page, int32_t index) const {
    for (uint32_t slot = Home(page);; slot = Next(slot)) {
      const int32_t held = atomicCAS(&pages[slot], kNoPage, page);
      if (held == kNoPage || held == page) {
        atomicMin(&first[slot], index);
        return;
      }
    }
  }
  // The smallest index inserted with `page`, or kAbsent. REQUIRES: page ≥ 0.
  __device__ int32_t Find(int32_t page) const {
    for (uint32_t slot = Home(page);; slot = Next(slot)) {
      const int32_t held = pages[slot];
      if (held == page) return first[slot];
      if (held == kNoPage) return kAbsent;
    }
  }
};

// log2 of the page index size for k entries: the power of two ≥ 2k.
int PageIndexBits(int32_t k) {
  int bits = 1;
  while ((int32_t{1} << bits) < 2 * k) ++bits;
  return bits;
}

// Dynamic shared memory of ReplaceKernel: two page indexes and the free-slot list.
size_t ReplaceSharedBytes(int32_t k) {
  return (size_t{4} << PageIndexBits(k)) * sizeof(int32_t) +
         static_cast<size_t>(k) * sizeof(int32_t);
}

// Heads whose mask is zero: k skip items and no misses. Returns whether the head is masked.
__device__ bool SkipMaskedHead(const ReplaceArgs& a, int64_t bh, int32_t h) {
  if (a.head_mask == nullptr || a.head_mask[bh] != 0) return false;
  RecallItem* items = a.items + bh * a.k;
  for (int32_t j = threadIdx.x; j < a.k; j += blockDim.x) items[j] = RecallItem{kSkipItem, h, 0};
  if (threadIdx.x == 0 && a.num_misses != nullptr) a.num_misses[bh] = 0;
  return true;
}

// Every selected page needs a host page; otherwise the head is reported and left untouched.
// Returns whether all have one (uniform across the block; synchronises it).
__device__ bool CheckHostPages(const ReplaceArgs& a, const DeviceErrorSink& sink, int64_t bh,
                               const int32_t* sel, const int64_t* host_page_of, int32_t* bad) {
  if (threadIdx.x == 0) *bad = 0;
  __syncthreads();
  for (int32_t i = threadIdx.x; i < a.k; i += blockDim.x) {
    const int32_t page = sel[i];
    if (page == kEmptySlot) continue;
    if (page < 0 || page >= a.max_pages || host_page_of[page] < 0) {
      ReportItemError(sink, KernelOp::kReplace, ItemField::kSelectedPage, bh * a.k + i, page,
                      a.max_pages);
      *bad = 1;
    }
  }
  __syncthreads();
  return *bad == 0;
}

// One block per (sequence, KV head), k ≤ kReplaceSharedK. The CPU's loops, with each
// membership test one probe of a shared page index instead of a scan:
//   slot s keeps its page  ⇔  page ≥ 0, page is selected, and s is the page's first slot
//     (the CPU evicts a page not in the selection and every later copy of a page);
//   selection entry i misses  ⇔  page ≥ 0, i is the page's first entry, and the page is in
//     no slot of the region (a resident page is kept; a repeat finds the first placed).
// Free slots are ranked in slot order, misses in selection order (block-wide prefix counts);
// the r-th miss takes the r-th free slot, as the CPU's free_slots[misses++].
__global__ void __launch_bounds__(kReplaceThreads)
    ReplaceKernel(const ReplaceArgs a, const DeviceErrorSink sink, const int bits) {
  extern __shared__ int32_t replace_shared[];
  __shared__ int32_t warp_counts[kReplaceThreads / kWarpSize];
  __shared__ int32_t bad;
  const int64_t bh = blockIdx.x;
  const auto b = static_cast<int32_t>(bh / a.shape.num_kv_heads);
  const auto h = static_cast<int32_t>(bh % a.shape.num_kv_heads);
  if (SkipMaskedHead(a, bh, h)) return;
  const int32_t k = a.k;
  RecallItem* items = a.items + bh * k;
  const int32_t* sel = a.selected + bh * k;
  const int64_t* host_page_of = a.host_page_of + int64_t{b} * a.max_pages;
  int32_t* region = a.kv.slot_table + SlotTableLayout{a.shape.num_kv_heads, a.kv.num_slots}.Offset(
                                          b, h, a.region_begin);
  const int32_t size = 1 << bits;
  const PageIndex selected{replace_shared, replace_shared + size, bits};
  const PageIndex resident{replace_shared + 2 * size, replace_shared + 3 * size, bits};
  int32_t* free_at = replace_shared + 4 * size;  // [k] the r-th free slot
  selected.Clear();
  resident.Clear();
  if (!CheckHostPages(a, sink, bh, sel, host_page_of, &bad)) return;  // synchronises

  for (int32_t i = threadIdx.x; i < k; i += blockDim.x) {
    const int32_t page = sel[i];
    if (page >= 0) selected.Insert(page, i);
    const int32_t held = region[i];
    if (held >= 0) resident.Insert(held, i);
  }
  __syncthreads();

  // 1. Evictions, and the free slots in slot order.
  int32_t freed = 0;
  for (int32_t base = 0; base < k; base += blockDim.x) {
    const int32_t s = base + static_cast<int32_t>(threadIdx.x);
    bool free_slot = false;
    if (s < k) {
      const int32_t page = region[s];
      free_slot = page < 0 || resident.Find(page) != s || selected.Find(page) == kAbsent;
      if (free_slot) region[s] = kEmptySlot;
    }
    int32_t total;
    const int32_t rank = freed + BlockRank(free_slot, warp_counts, &total);
    if (free_slot) free_at[rank] = s;
    freed += total;
  }

  // 2. Misses in selection order, each into the free slot of its rank.
  int32_t misses = 0;
  for (int32_t base = 0; base < k; base += blockDim.x) {
    const int32_t i = base + static_cast<int32_t>(threadIdx.x);
    bool miss = false;
    int32_t page = kEmptySlot;
    if (i < k) {
      page = sel[i];
      miss = page >= 0 && selected.Find(page) == i && resident.Find(page) == kAbsent;
    }
    int32_t total;
    const int32_t rank = misses + BlockRank(miss, warp_counts, &total);
    if (miss && rank < freed) {  // always: distinct selected pages ≤ k = kept + freed
      const int32_t s = free_at[rank];
      region[s] = page;
      items[rank] = RecallItem{host_page_of[page], h, b * a.kv.num_slots + a.region_begin + s};
    }
    misses += total;
  }
  misses = min(misses, freed);
  for (int32_t j = misses + static_cast<int32_t>(threadIdx.x); j < k; j += blockDim.x) {
    items[j] = RecallItem{kSkipItem, h, 0};
  }
  if (threadIdx.x == 0 && a.num_misses != nullptr) a.num_misses[bh] = misses;
}

// Regions larger than kReplaceSharedK: the same steps with membership by scanning the
// selection and the region in global memory (O(k²) per head).
__device__ __forceinline__ bool Contains(const int32_t* v, int32_t n, int32_t x) {
  for (int32_t i = 0; i < n; ++i) {
    if (v[i] == x) return true;
  }
  return false;
}

__global__ void __launch_bounds__(kReplaceThreads)
    ReplaceScanKernel(const ReplaceArgs a, const DeviceErrorSink sink) {
  __shared__ int32_t warp_counts[kReplaceThreads / kWarpSize];
  __shared__ int32_t bad;
  const int64_t bh = blockIdx.x;
  const auto b = static_cast<int32_t>(bh / a.shape.num_kv_heads);
  const auto h = static_cast<int32_t>(bh % a.shape.num_kv_heads);
  if (SkipMaskedHead(a, bh, h)) return;
  const int32_t k = a.k;
  RecallItem* items = a.items + bh * k;
  const int32_t* sel = a.selected + bh * k;
  const int64_t* host_page_of = a.host_page_of + int64_t{b} * a.max_pages;
  int32_t* region = a.kv.slot_table + SlotTableLayout{a.shape.num_kv_heads, a.kv.num_slots}.Offset(
                                          b, h, a.region_begin);
  if (!CheckHostPages(a, sink, bh, sel, host_page_of, &bad)) return;  // synchronises

  // 1. Evict every slot whose page is not selected, and every later copy of a page. Chunks
  // run in slot order, as the CPU's loop: earlier chunks' evictions are already written,
  // which changes no answer (the first copy of a selected page is always kept).
  for (int32_t base = 0; base < k; base += blockDim.x) {
    const int32_t s = base + static_cast<int32_t>(threadIdx.x);
    bool evict = false;
    if (s < k) {
      const int32_t page = region[s];
      evict = page < 0 || !Contains(sel, k, page) || Contains(region, s, page);
    }
    __syncthreads();
    if (evict) region[s] = kEmptySlot;
    __syncthreads();
  }

  // 2. Misses in selection order: selected pages not resident, first occurrence only (a
  // repeat finds the page the first one placed). Item r holds the page in dst_slot until 3.
  int32_t misses = 0;
  for (int32_t base = 0; base < k; base += blockDim.x) {
    const int32_t i = base + static_cast<int32_t>(threadIdx.x);
    bool miss = false;
    int32_t page = kEmptySlot;
    if (i < k) {
      page = sel[i];
      miss = page >= 0 && !Contains(region, k, page) && !Contains(sel, i, page);
    }
    int32_t total;
    const int32_t rank = misses + BlockRank(miss, warp_counts, &total);
    if (miss) items[rank] = RecallItem{host_page_of[page], h, page};
    misses += total;
  }
  __syncthreads();

  // 3. The r-th free slot (slot order) takes the r-th miss.
  if (misses > 0) {
    int32_t freed = 0;
    for (int32_t base = 0; base < k; base += blockDim.x) {
      const int32_t s = base + static_cast<int32_t>(threadIdx.x);
      const bool free_slot = s < k && region[s] == kEmptySlot;
      int32_t total;
      const int32_t rank = freed + BlockRank(free_slot, warp_counts, &total);
      if (free_slot && rank < misses) {
        RecallItem& it = items[rank];
        region[s] = it.dst_slot;
        it.dst_slot = b * a.kv.num_slots + a.region_begin + s;
      }
      freed += total;
    }
  }
  for (int32_t j = misses + static_cast<int32_t>(threadIdx.x); j < k; j += blockDim.x) {
    items[j] = RecallItem{kSkipItem, h, 0};
  }
  if (threadIdx.x == 0 && a.num_misses != nullptr) a.num_misses[bh] = misses;
}

}  // namespace

cudaError_t LaunchScorePages(const ScorePagesArgs& a, const DeviceErrorSink& sink,
                             cudaStream_t stream) {
  const int32_t G = a.shape.num_q_heads / a.shape.num_kv_heads;
  const int64_t heads = int64_t{a.batch} * a.shape.num_kv_heads;
  ScoreParams p{};
  p.q = a.q;
  p.summaries = a.summaries;
  p.codes = a.codes;
  p.page_size = a.shape.page_size;
  p.num_pages = a.num_pages;
  p.head_mask = a.head_mask;
  p.scores = a.scores;
  p.pooled = a.pooled;
  p.num_q_heads = a.shape.num_q_heads;
  p.num_kv_heads = a.shape.num_kv_heads;
  p.head_dim = a.shape.head_dim;
  p.max_pages = a.max_pages;
  p.group = G;
  p.scale = a.softmax_scale;
  p.weight = 1.0f / static_cast<float>(G);
  p.tile_pages = kMinTilePages > 2 * G ? kMinTilePages : 2 * G;
  p.sink = sink;
  const size_t q_bytes = static_cast<size_t>(G) * a.shape.head_dim * sizeof(float);
  p.stage_q = q_bytes <= kMaxStagedQueryBytes;
  const size_t smem = p.stage_q ? q_bytes : 0;
  const int32_t full_tiles = a.max_pages / p.tile_pages;
  return DispatchElement(a.shape.dtype, [&](auto element_tag) {
    using T = typename decltype(element_tag)::type;
    return DispatchPerLane(a.shape.head_dim, [&](auto lanes) {
      constexpr int kPerLane = decltype(lanes)::value;
      if (full_tiles < 2) {
        ScoreHeadKernel<T, kPerLane><<<static_cast<unsigned>(heads), kHeadThreads, smem,
                                       stream>>>(p);
        return cudaGetLastError();
      }
      p.num_tiles = full_tiles > 1 ? full_tiles : 1;
      p.num_items = heads * p.num_tiles;
      const unsigned blocks = GridBlocks(p.num_items);
      ScoreTilesKernel<T, kPerLane><<<blocks, kTileThreads, smem, stream>>>(p);
      if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
      ScoreMergeKernel<<<static_cast<unsigned>(heads), kMergeThreads, 0, stream>>>(p);
      if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
      ScorePoolKernel<T, kPerLane><<<blocks, kTileThreads, smem, stream>>>(p);
      return cudaGetLastError();
    });
  });
}

cudaError_t LaunchTopK(const TopKArgs& a, const DeviceErrorSink& sink, cudaStream_t stream) {
  TopKParams p{};
  p.pooled = a.pooled;
  p.num_pages = a.num_pages;
  p.head_mask = a.head_mask;
  p.head_k = a.head_k;
  p.page_flags = a.page_flags;
  p.selected = a.selected;
  p.num_kv_heads = a.shape.num_kv_heads;
  p.max_pages = a.max_pages;
  p.k = a.k;
  p.sink_pages = a.sink_pages;
  p.recent_pages = a.recent_pages;
  p.cache_keys = a.max_pages <= kTopKCachedKeys;
  p.sink = sink;
  const size_t words = static_cast<size_t>(a.max_pages) + (a.max_pages + kWarpSize - 1) / kWarpSize;
  const size_t smem = p.cache_keys ? words * sizeof(uint32_t) : 0;
  const auto heads = static_cast<unsigned>(int64_t{a.batch} * a.shape.num_kv_heads);
  TopKKernel<<<heads, kTopKThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchQueryCosine(const QueryCosineArgs& a, const DeviceErrorSink& /*sink*/,
                              cudaStream_t stream) {
  const auto heads = static_cast<unsigned>(int64_t{a.batch} * a.shape.num_kv_heads);
  return DispatchElement(a.shape.dtype, [&](auto element_tag) {
    using T = typename decltype(element_tag)::type;
    QueryCosineKernel<T><<<heads, kCosineThreads, 0, stream>>>(a);
    return cudaGetLastError();
  });
}

cudaError_t LaunchReplace(const ReplaceArgs& a, const DeviceErrorSink& sink,
                          cudaStream_t stream) {
  const auto heads = static_cast<unsigned>(int64_t{a.batch} * a.shape.num_kv_heads);
  if (a.k <= kReplaceSharedK) {
    ReplaceKernel<<<heads, kReplaceThreads, ReplaceSharedBytes(a.k), stream>>>(a, sink,
                                                                               PageIndexBits(a.k));
  } else {
    ReplaceScanKernel<<<heads, kReplaceThreads, 0, stream>>>(a, sink);
  }
  return cudaGetLastError();
}

}  // namespace kvtier::cuda
