// Top-k page selection on the CPU: deterministic (pinned pages first, then by score, ties to
// the lower page, NaN last), with per-head budgets (head_k) and excluded pages. Two
// implementations with bit-identical output: the reference (partial_sort with a comparator,
// O(n log k); cpu::Isa::kScalar) and a linear-time one for every other ISA (one integer key
// per candidate, a radix select of the k-th best key, a sort of the k selected).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "absl/strings/str_format.h"
#include "kernels/cpu/convert.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kvtier/layout.h"

namespace kvtier {
namespace {

// A page's rank class among candidates: lower ranks first. kPageExcluded wins over
// kPagePinned when a flag byte carries both bits; any other bits are kPageNormal.
inline int RankClass(const uint8_t* flags, int32_t page) {
  return flags != nullptr && (flags[page] & kPagePinned) != 0 ? 0 : 1;
}
inline bool Excluded(const uint8_t* flags, int32_t page) {
  return flags != nullptr && (flags[page] & kPageExcluded) != 0;
}

// A strict weak order: pinned pages first (when flags are given), then higher score first,
// NaN after every number, then lower page first.
struct Better {
  const float* score;
  const uint8_t* flags;  // this head's [P] page flags, or null
  bool operator()(int32_t x, int32_t y) const {
    if (flags != nullptr) {
      const int cx = RankClass(flags, x), cy = RankClass(flags, y);
      if (cx != cy) return cx < cy;
    }
    const float sx = score[x], sy = score[y];
    const bool nx = std::isnan(sx), ny = std::isnan(sy);
    if (nx != ny) return ny;
    if (!nx && sx != sy) return sx > sy;
    return x < y;
  }
};

void SelectHead(const TopKArgs& a, int32_t b, int32_t h, std::vector<int32_t>& cand) {
  const int64_t head = int64_t{b} * a.shape.num_kv_heads + h;
  const int32_t n = a.num_pages[b];
  const int32_t begin = std::min(a.sink_pages, n);
  const int32_t end = std::max(begin, n - a.recent_pages);
  const uint8_t* flags = a.page_flags != nullptr ? a.page_flags + head * a.max_pages : nullptr;
  cand.clear();
  for (int32_t p = begin; p < end; ++p) {
    if (!Excluded(flags, p)) cand.push_back(p);
  }
  const float* score = a.pooled + head * a.max_pages;
  const int32_t k_h = a.head_k != nullptr ? a.head_k[head] : a.k;  // range-checked by CpuTopK
  const auto take = static_cast<ptrdiff_t>(std::min<size_t>(static_cast<size_t>(k_h), cand.size()));
  std::partial_sort(cand.begin(), cand.begin() + take, cand.end(), Better{score, flags});
  int32_t* out = a.selected + head * a.k;
  for (int32_t i = 0; i < a.k; ++i) out[i] = i < take ? cand[static_cast<size_t>(i)] : kEmptySlot;
}

// The order of Better as one integer per candidate, larger = better, distinct for distinct
// pages: bit 63 pinned (when flags are given); bits 62..31 the score as an order-preserving
// uint32 (-0 as +0, so they tie as they compare equal; every NaN 0, below every number, so
// NaNs tie among themselves); bits 30..0 the page inverted (ties to the lower page).
// Branch-free, so the loops over candidates vectorise.
KVTIER_CPU_INLINE uint64_t CandidateKey(float score, bool pinned, int32_t page) {
  const uint32_t bits = std::bit_cast<uint32_t>(score == 0.0f ? 0.0f : score);
  // Negative: all bits flipped; otherwise the sign bit set.
  const uint32_t flip = static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31) | 0x80000000u;
  const uint32_t order = score != score ? 0u : bits ^ flip;
  return (uint64_t{pinned} << 63) | (uint64_t{order} << 31) |
         static_cast<uint64_t>(0x7fffffff - page);
}
inline int32_t PageOfKey(uint64_t key) {
  return 0x7fffffff - static_cast<int32_t>(key & 0x7fffffff);
}

// The keys of the candidate pages [begin, end) (excluded pages dropped) into keys; returns
// their count, and in *any and *all the OR and the AND of the keys (the bits where they
// differ tell the radix select where to start). One multi-versioned function (x86-64-v3
// and baseline): the loop without flags vectorises.
KVTIER_CPU_CLONES int32_t CandidateKeys(const float* score, const uint8_t* flags, int32_t begin,
                                        int32_t end, uint64_t* keys, uint64_t* any,
                                        uint64_t* all) {
  uint64_t or_bits = 0, and_bits = ~uint64_t{0};
  int32_t m = 0;
  if (flags == nullptr) {
    for (int32_t p = begin; p < end; ++p) {
      const uint64_t key = CandidateKey(score[p], false, p);
      keys[p - begin] = key;
      or_bits |= key;
      and_bits &= key;
    }
    m = end - begin;
  } else {
    for (int32_t p = begin; p < end; ++p) {
      const uint64_t key = CandidateKey(score[p], (flags[p] & kPagePinned) != 0, p);
      const bool keep = (flags[p] & kPageExcluded) == 0;
      keys[m] = key;
      m += keep ? 1 : 0;
      or_bits |= keep ? key : 0;
      and_bits &= keep ? key : ~uint64_t{0};
    }
  }
  *any = or_bits;
  *all = and_bits;
  return m;
}

// Radix select: each pass takes the kDigitBits bits just below the bits that all keys still
// in play share (so clustered scores still spread over the buckets), histograms them, takes
// every key above the bucket holding the k-th largest and keeps that bucket in play; below
// kSmallSet keys nth_element finishes. Each pass is linear in the keys in play, and at most
// 64 / kDigitBits + 1 passes run (keys are distinct).
constexpr int kDigitBits = 11;
constexpr int32_t kSmallSet = 64;

struct SelectScratch {
  std::vector<uint64_t> keys;  // every candidate's key
  std::vector<uint64_t> rest;  // the keys still in play
  std::vector<uint64_t> top;   // the keys taken
  std::vector<uint32_t> hist = std::vector<uint32_t>(size_t{1} << kDigitBits);
};

// The k largest (1 ≤ k < n) of keys[0, n) into out[0, k), in no particular order; any and
// all are the OR and AND of the keys; `rest` has room for n keys.
void TakeLargest(const uint64_t* keys, int32_t n, int32_t k, uint64_t any, uint64_t all,
                 uint64_t* out, uint64_t* rest, uint32_t* hist) {
  const uint64_t* cur = keys;
  int32_t taken = 0;
  while (n > kSmallSet && k < n) {
    // Keys are distinct, so n > 1 keys differ in some bit: top ≥ 1.
    const int top = 64 - std::countl_zero(any ^ all);
    const int width = std::min(kDigitBits, top);
    const int shift = top - width;
    const uint64_t mask = (uint64_t{1} << width) - 1;
    std::memset(hist, 0, sizeof(uint32_t) << width);
    for (int32_t i = 0; i < n; ++i) ++hist[(cur[i] >> shift) & mask];
    // The bucket of the k-th largest: walk down from the top.
    uint64_t bucket = mask;
    int32_t above = 0;
    while (above + static_cast<int32_t>(hist[bucket]) < k) {
      above += static_cast<int32_t>(hist[bucket--]);
    }
    // The keys at or above the bucket (few: fewer than k, plus the bucket) → rest, in one
    // branch-free pass (in place once cur is rest: the write index never passes the read
    // index); then of those, the ones above the bucket are taken and the bucket's stay.
    int32_t kept = 0;
    for (int32_t i = 0; i < n; ++i) {
      const uint64_t key = cur[i];
      rest[kept] = key;
      kept += ((key >> shift) & mask) >= bucket ? 1 : 0;
    }
    const int32_t candidates = kept;
    kept = 0;
    uint64_t or_bits = 0, and_bits = ~uint64_t{0};
    for (int32_t i = 0; i < candidates; ++i) {
      const uint64_t key = rest[i];
      if (((key >> shift) & mask) > bucket) {
        out[taken++] = key;
      } else {
        rest[kept++] = key;
        or_bits |= key;
        and_bits &= key;
      }
    }
    cur = rest;
    n = kept;
    k -= above;
    any = or_bits;
    all = and_bits;
  }
  if (k < n) {
    // Few keys left (cur may still be `keys`: copy before reordering).
    if (cur != rest) std::copy(cur, cur + n, rest);
    std::nth_element(rest, rest + (k - 1), rest + n, std::greater<uint64_t>());
    cur = rest;
  }
  std::copy(cur, cur + k, out + taken);
}

void SelectHeadLinear(const TopKArgs& a, int32_t b, int32_t h, SelectScratch& s) {
  const int64_t head = int64_t{b} * a.shape.num_kv_heads + h;
  const int32_t n = a.num_pages[b];
  const int32_t begin = std::min(a.sink_pages, n);
  const int32_t end = std::max(begin, n - a.recent_pages);
  const uint8_t* flags = a.page_flags != nullptr ? a.page_flags + head * a.max_pages : nullptr;
  s.keys.resize(static_cast<size_t>(end - begin));
  uint64_t any = 0, all = 0;
  const int32_t m = CandidateKeys(a.pooled + head * a.max_pages, flags, begin, end,
                                  s.keys.data(), &any, &all);
  const int32_t k_h = a.head_k != nullptr ? a.head_k[head] : a.k;  // range-checked by CpuTopK
  const int32_t take = std::min(k_h, m);
  uint64_t* top = s.keys.data();
  if (take > 0 && take < m) {
    s.rest.resize(static_cast<size_t>(m));
    s.top.resize(static_cast<size_t>(take));
    top = s.top.data();
    TakeLargest(s.keys.data(), m, take, any, all, top, s.rest.data(), s.hist.data());
  }
  std::sort(top, top + take, std::greater<uint64_t>());
  int32_t* out = a.selected + head * a.k;
  for (int32_t i = 0; i < a.k; ++i) out[i] = i < take ? PageOfKey(top[i]) : kEmptySlot;
}

// The range checks of CpuTopK, before any output.
absl::Status CheckTopK(const TopKArgs& a) {
  for (int32_t b = 0; b < a.batch; ++b) {
    if (a.num_pages[b] < 0 || a.num_pages[b] > a.max_pages) {
      return absl::OutOfRangeError(absl::StrFormat(
          "TopK: num_pages[%d] = %d must be in [0, max_pages = %d]", b, a.num_pages[b],
          a.max_pages));
    }
  }
  // head_k is checked only for the heads this call selects (head_mask), before any output.
  if (a.head_k != nullptr) {
    for (int64_t i = 0; i < int64_t{a.batch} * a.shape.num_kv_heads; ++i) {
      if (a.head_mask != nullptr && a.head_mask[i] == 0) continue;
      if (a.head_k[i] < 0 || a.head_k[i] > a.k) {
        return absl::OutOfRangeError(
            absl::StrFormat("TopK: head_k[%d] = %d must be in [0, k = %d]", i, a.head_k[i], a.k));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CpuTopK(const TopKArgs& a, ThreadPool* pool) {
  return CpuTopK(a, pool, cpu::ActiveIsa());
}

absl::Status CpuTopK(const TopKArgs& a, ThreadPool* pool, cpu::Isa isa) {
  if (absl::Status s = CheckTopK(a); !s.ok()) return s;
  isa = cpu::RunnableIsa(isa);  // the reference only on a CPU or build without any
  if (isa == cpu::Isa::kScalar) {
    ParallelFor(pool, int64_t{a.batch} * a.shape.num_kv_heads, 4, [&](int64_t begin, int64_t end) {
      std::vector<int32_t> cand;
      for (int64_t i = begin; i < end; ++i) {
        if (a.head_mask != nullptr && a.head_mask[i] == 0) continue;
        SelectHead(a, static_cast<int32_t>(i / a.shape.num_kv_heads),
                   static_cast<int32_t>(i % a.shape.num_kv_heads), cand);
      }
    });
    return absl::OkStatus();
  }
  ParallelFor(pool, int64_t{a.batch} * a.shape.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    thread_local SelectScratch scratch;  // reused across calls: no allocation per head
    for (int64_t i = begin; i < end; ++i) {
      if (a.head_mask != nullptr && a.head_mask[i] == 0) continue;
      SelectHeadLinear(a, static_cast<int32_t>(i / a.shape.num_kv_heads),
                       static_cast<int32_t>(i % a.shape.num_kv_heads), scratch);
    }
  });
  return absl::OkStatus();
}

}  // namespace kvtier
