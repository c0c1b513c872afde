// What the CPU op tests (tests/kernels/cpu) share: the arguments of scoring and selection,
// and the sparse attention case (a random working set, the
// arguments over it, and a naive double-precision reference).
#ifndef KVTIER_TESTS_KERNELS_CPU_CPU_OP_TEST_UTIL_H_
#define KVTIER_TESTS_KERNELS_CPU_CPU_OP_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kvtier/layout.h"
#include "tests/testutil/random_fill.h"

namespace kvtier::testing {

// ScorePages over `batch` sequences of queries q [B][Hq][d] against the summaries of up to
// max_pages pages ([B][P][Hkv][2][d], num_pages [B]) into pooled [B][Hkv][P]; the other
// fields at their defaults.
inline ScorePagesArgs ScoreArgs(const KvShape& shape, int32_t batch, int32_t max_pages,
                                const void* q, const void* summaries, const int32_t* num_pages,
                                float* pooled) {
  return ScorePagesArgs{.shape = shape,
                        .batch = batch,
                        .max_pages = max_pages,
                        .q = q,
                        .summaries = summaries,
                        .num_pages = num_pages,
                        .pooled = pooled};
}

// TopK of the best k of up to max_pages pages per (sequence, KV head) into selected
// [B][Hkv][k]: no sink or recent pages, head mask, budgets or page flags.
inline TopKArgs SelectArgs(int32_t num_kv_heads, int32_t batch, int32_t max_pages, int32_t k,
                           const float* pooled, const int32_t* num_pages, int32_t* selected) {
  return TopKArgs{.shape = {.num_kv_heads = num_kv_heads},
                  .batch = batch,
                  .max_pages = max_pages,
                  .k = k,
                  .pooled = pooled,
                  .num_pages = num_pages,
                  .selected = selected};
}

// The output tolerance of attention against a naive double-precision loop: the kernels
// accumulate in fp32 and round the output to the dtype (half an ulp: 2^-11 fp16, 2^-8 bf16,
// relative to the output's magnitude).
inline double OutputTolerance(DType t) {
  switch (t) {
    case DType::kF16:
      return 2e-3;
    case DType::kBF16:
      return 1e-2;
    case DType::kF32:
      return 2e-5;
  }
  return 0;
}

// A working set with full random content for sparse attention, whose tables say which
// (slot, head) pages are live; optionally a causal limit. The naive reference reads what attention must read.
struct AttentionCase {
  DType dtype;
  int32_t B, Hkv, G, d, p, S;
  std::vector<int32_t> table, partial_page, partial_len;
  std::vector<int64_t> qpos;  // empty: no causal limit
  TypedBuffer q, k, v;
  float scale;

  AttentionCase(DType t, int32_t batch, int32_t kv_heads, int32_t group, int32_t dim, int32_t page,
                int32_t slots)
      : dtype(t),
        B(batch),
        Hkv(kv_heads),
        G(group),
        d(dim),
        p(page),
        S(slots),
        q(t, int64_t{batch} * kv_heads * group * dim),
        k(t, int64_t{batch} * slots * page * kv_heads * dim),
        v(t, int64_t{batch} * slots * page * kv_heads * dim),
        scale(1.0f / std::sqrt(static_cast<float>(dim))) {
    q.FillNormal(31, 2.0f);
    k.FillNormal(32);
    v.FillNormal(33);
    table.assign(static_cast<size_t>(B * Hkv * S), kEmptySlot);
    partial_page.assign(static_cast<size_t>(B), -1);
    partial_len.assign(static_cast<size_t>(B), 0);
  }
  int32_t Hq() const { return Hkv * G; }
  WorkingSetLayout wl() const { return WorkingSetLayout{S, p, Hkv, d}; }
  SlotTableLayout tl() const { return SlotTableLayout{Hkv, S}; }

  // Random pages in ~2/3 of the (b, h, s) entries; page P partial in sequence 0.
  void RandomTable(uint32_t seed, int32_t max_page) {
    std::mt19937 rng(seed);
    for (int32_t& e : table) {
      e = rng() % 3 == 0 ? kEmptySlot
                         : static_cast<int32_t>(rng() % static_cast<uint32_t>(max_page));
    }
    partial_page[0] = table[0] >= 0 ? table[0] : 1;
    partial_len[0] = p / 2 + 1;
  }

  KvShape Shape() const { return KvShape{dtype, Hq(), Hkv, d, p}; }

  SparseAttentionArgs Args(void* out, float* lse, float* prob) {
    SparseAttentionArgs a;
    a.shape = Shape();
    a.kv = {.k_cache = k.data(),
            .v_cache = v.data(),
            .num_slots = S,
            .slot_table = table.data(),
            .partial_page = partial_page.data(),
            .partial_len = partial_len.data()};
    a.batch = B;
    a.q = q.data();
    a.softmax_scale = scale;
    a.out = out;
    a.lse = lse;
    a.token_prob = prob;
    a.query_position = qpos.empty() ? nullptr : qpos.data();
    return a;
  }

  // K (kind 0) or V (kind 1) element as attention must read it.
  double Element(int32_t kind, int32_t b, int32_t s, int32_t t, int32_t h, int32_t i) const {
    const int64_t off = wl().Offset(b, s, t, h, i);
    return kind == 0 ? k.Get(off) : v.Get(off);
  }

  // Naive attention in double: out [B][Hq][d], lse [B][Hq], prob [B][Hq][S][p].
  void Reference(std::vector<double>& out, std::vector<double>& lse,
                 std::vector<double>& prob) const {
    out.assign(static_cast<size_t>(B * Hq() * d), 0.0);
    lse.assign(static_cast<size_t>(B * Hq()), -std::numeric_limits<double>::infinity());
    prob.assign(static_cast<size_t>(B * Hq() * S * p), 0.0);
    for (int32_t b = 0; b < B; ++b) {
      for (int32_t hq = 0; hq < Hq(); ++hq) {
        const int32_t h = hq / G;
        struct Tok {
          int32_t s, t;
          double score;
        };
        std::vector<Tok> toks;
        for (int32_t s = 0; s < S; ++s) {
          const int32_t page = table[static_cast<size_t>(tl().Offset(b, h, s))];
          if (page < 0) continue;
          const int32_t n = page == partial_page[static_cast<size_t>(b)]
                                ? partial_len[static_cast<size_t>(b)]
                                : p;
          for (int32_t t = 0; t < n; ++t) {
            if (!qpos.empty() && int64_t{page} * p + t > qpos[static_cast<size_t>(b)]) continue;
            double dot = 0;
            for (int32_t i = 0; i < d; ++i) {
              dot += double{q.Get((int64_t{b} * Hq() + hq) * d + i)} * Element(0, b, s, t, h, i);
            }
            toks.push_back({s, t, dot * scale});
          }
        }
        if (toks.empty()) continue;
        double m = -std::numeric_limits<double>::infinity(), z = 0;
        for (const Tok& tok : toks) m = std::max(m, tok.score);
        for (const Tok& tok : toks) z += std::exp(tok.score - m);
        const int64_t row = int64_t{b} * Hq() + hq;
        for (const Tok& tok : toks) {
          const double w = std::exp(tok.score - m) / z;
          prob[static_cast<size_t>((row * S + tok.s) * p + tok.t)] = w;
          for (int32_t i = 0; i < d; ++i) {
            out[static_cast<size_t>(row * d + i)] += w * Element(1, b, tok.s, tok.t, h, i);
          }
        }
        lse[static_cast<size_t>(row)] = m + std::log(z);
      }
    }
  }

  // Runs CpuSparseAttention (with and without a pool) and compares everything with the
  // naive loop: out within the dtype's rounding (at least `rel`), lse and token_prob
  // within `rel` relative.
  void RunAndCompare(double rel, bool with_prob) {
    std::vector<double> want, want_lse, want_prob;
    Reference(want, want_lse, want_prob);
    const double out_tol = std::max(rel, OutputTolerance(dtype));
    std::unique_ptr<ThreadPool> pool = std::make_unique<ThreadPool>(4);
    for (ThreadPool* pl : {static_cast<ThreadPool*>(nullptr), pool.get()}) {
      TypedBuffer out(dtype, int64_t{B} * Hq() * d);
      std::vector<float> lse(static_cast<size_t>(B * Hq()));
      std::vector<float> prob(with_prob ? want_prob.size() : 0, -1.0f);
      ASSERT_TRUE(
          CpuSparseAttention(Args(out.data(), lse.data(), with_prob ? prob.data() : nullptr), pl)
              .ok());
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_NEAR(out.Get(static_cast<int64_t>(i)), want[i], out_tol * (1 + std::fabs(want[i])))
            << "out " << i;
      }
      for (size_t i = 0; i < want_lse.size(); ++i) {
        if (std::isinf(want_lse[i])) {
          EXPECT_TRUE(std::isinf(lse[i]) && lse[i] < 0) << i;
        } else {
          EXPECT_NEAR(lse[i], want_lse[i], rel * (1 + std::fabs(want_lse[i]))) << "lse " << i;
        }
      }
      if (!with_prob) continue;
      for (size_t i = 0; i < want_prob.size(); ++i) {
        ASSERT_NEAR(prob[i], want_prob[i], 1e-6 + rel * want_prob[i]) << "prob " << i;
        if (want_prob[i] == 0) {
          ASSERT_EQ(prob[i], 0.0f) << "unattended token " << i;
        }
      }
    }
  }
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_KERNELS_CPU_CPU_OP_TEST_UTIL_H_
