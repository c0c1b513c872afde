// Decode attention against the CPU reference: sparse over per-head slot tables (partial
// pages, causal limits, token probabilities, unaligned caches) and dense.
#include <algorithm>
#include <array>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "kvtier/layout.h"
#include "tests/kernels/op_cases.h"
#include "tests/kernels/op_cases_internal.h"

namespace kvtier::testing::op_cases_internal {
namespace {

struct SparseVariant {
  const char* name;
  bool lse, causal, prob;
};

// A working set of S = 6 slots over 10 logical pages: per (b, h) distinct pages in random
// slots, a quarter of the slots empty; the partial page (the last) held by head 0 of every
// sequence; KV head 1 of sequence 0 empty. Partial pages of some, no and zero tokens; causal
// limits past everything, mid-page and at an early page.
OpRun SparseAttentionRun(const HeadShape& c, int32_t page_size, const SparseVariant& var,
                         uint32_t seed) {
  const int32_t B = c.batch, Hq = QueryHeads(c), d = c.head_dim, p = page_size;
  constexpr int32_t kS = 6, kPages = 10, kPartialPage = kPages - 1;
  const SlotTableLayout tl{kHkv, kS};
  std::mt19937 rng(seed);
  TypedBuffer q(c.dtype, int64_t{B} * Hq * d);
  q.FillNormal(seed + 1);
  std::vector<int32_t> slot_table(static_cast<size_t>(B) * kHkv * kS);
  for (int32_t b = 0; b < B; ++b) {
    for (int32_t h = 0; h < kHkv; ++h) {
      std::vector<int32_t> pages = Iota(kPages);
      std::shuffle(pages.begin(), pages.end(), rng);
      for (int32_t s = 0; s < kS; ++s) {
        slot_table[tl.Offset(b, h, s)] = Chance(rng, 0.25) ? kEmptySlot : pages[s];
      }
      if (h == 0) {
        for (int32_t s = 0; s < kS; ++s) {
          if (slot_table[tl.Offset(b, h, s)] == kPartialPage) slot_table[tl.Offset(b, h, s)] = -1;
        }
        slot_table[tl.Offset(b, h, 2)] = kPartialPage;
      }
      if (b == 0 && h == 1) {
        for (int32_t s = 0; s < kS; ++s) slot_table[tl.Offset(b, h, s)] = kEmptySlot;
      }
    }
  }
  std::vector<int32_t> partial_page, partial_len;
  std::vector<int64_t> query_position;
  for (int32_t b = 0; b < B; ++b) {
    partial_page.push_back(b == 2 ? -1 : kPartialPage);
    partial_len.push_back(b == 1 ? 0 : Uniform(rng, 1, p - 1));
    query_position.push_back(b == 0 ? int64_t{kPages} * p : b == 1 ? 5 * p + 3 : 2 * p - 1);
  }
  const KvShape shape = ShapeOf(c, p);

  OpRun r;
  const int iq = r.in.Add(q), itab = r.in.Add(slot_table);
  WorkingSetBuffers ws(r.in, B * kS, RandomCache(shape, B * kS, seed + 2),
                       RandomCache(shape, B * kS, seed + 3), 0);
  const int ipp = r.in.Add(partial_page), ipl = r.in.Add(partial_len);
  const int iout = r.in.Add(Filled(c.dtype, q.size(), 7.0f));
  const int ilse = var.lse ? r.in.Add(std::vector<float>(static_cast<size_t>(B) * Hq, 7.0f)) : -1;
  const int iqpos = var.causal ? r.in.Add(query_position) : -1;
  const int iprob =
      var.prob ? r.in.Add(std::vector<float>(static_cast<size_t>(B) * Hq * kS * p, 7.0f)) : -1;
  r.op = [=](Backend& be, Stream& s, const OpPtrs& ptr) {
    SparseAttentionArgs a;
    a.shape = shape;
    a.kv = ws.At(ptr);
    a.kv.num_slots = kS;  // per sequence
    a.kv.slot_table = ptr.get<int32_t>(itab);
    a.kv.partial_page = ptr.get<int32_t>(ipp);
    a.kv.partial_len = ptr.get<int32_t>(ipl);
    a.batch = B;
    a.q = ptr.get(iq);
    a.softmax_scale = ScaleOf(d);
    a.out = ptr.get(iout);
    a.lse = ptr.get<float>(ilse);
    a.query_position = ptr.get<int64_t>(iqpos);
    a.token_prob = ptr.get<float>(iprob);
    return be.SparseAttention(s, a);
  };
  r.check = [=](const OpBuffers&, const OpResult& want, const OpResult& got) {
    ExpectAttentionOutNear(c.dtype, want, got, iout, "out");
    if (ilse >= 0) {
      ExpectFloatBufNear(want, got, ilse, 1e-4, 1e-4, "lse");
      // The empty head (sequence 0, KV head 1): lse = -inf.
      EXPECT_EQ(got.Get<float>(ilse)[static_cast<size_t>(c.group)], -kInf);
    }
    if (iprob >= 0) ExpectFloatBufNear(want, got, iprob, 0.0, 1e-5, "token_prob");
  };
  return r;
}

// Dense attention over T = 100 tokens of full, empty and partial sequences.
OpRun DenseAttentionRun(const HeadShape& c, bool with_lse, uint32_t seed) {
  const int32_t B = c.batch, Hq = QueryHeads(c), d = c.head_dim;
  constexpr int32_t kT = 100;
  const DenseKvLayout kl{kT, kHkv, d};
  TypedBuffer q(c.dtype, int64_t{B} * Hq * d), k(c.dtype, kl.Offset(B, 0, 0, 0));
  TypedBuffer v(c.dtype, k.size());
  q.FillNormal(seed + 1);
  k.FillNormal(seed + 2);
  v.FillNormal(seed + 3);
  OpRun r;
  const int iq = r.in.Add(q), ik = r.in.Add(k), iv = r.in.Add(v);
  const int ilen = r.in.Add(B == 1 ? std::vector<int32_t>{77} : std::vector<int32_t>{kT, 0, 37});
  const int iout = r.in.Add(Filled(c.dtype, q.size(), 7.0f));
  const int ilse = with_lse ? r.in.Add(std::vector<float>(static_cast<size_t>(B) * Hq, 7.0f)) : -1;
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    DenseAttentionArgs a;
    a.shape = ShapeOf(c);
    a.batch = B;
    a.max_tokens = kT;
    a.q = p.get(iq);
    a.k = p.get(ik);
    a.v = p.get(iv);
    a.seq_len = p.get<int32_t>(ilen);
    a.softmax_scale = ScaleOf(d);
    a.out = p.get(iout);
    a.lse = p.get<float>(ilse);
    return be.DenseAttention(s, a);
  };
  r.check = [=](const OpBuffers&, const OpResult& want, const OpResult& got) {
    ExpectAttentionOutNear(c.dtype, want, got, iout, "out");
    if (ilse >= 0) ExpectFloatBufNear(want, got, ilse, 1e-4, 1e-4, "lse");
  };
  return r;
}

}  // namespace

void AddAttentionCases(std::vector<OpCase>& cases) {
  for (const HeadShape& c : HeadShapes()) {
    const std::string shape = NameOf(c);
    // Both page sizes across the sweep: 32 for single sequences, 16 for batches.
    const int32_t p = c.batch == 1 ? 32 : 16;
    for (const SparseVariant& v : {SparseVariant{"plain", true, false, false},
                                   SparseVariant{"causal_no_lse", false, true, false},
                                   SparseVariant{"token_prob", true, false, true},
                                   SparseVariant{"causal_prob", true, true, true}}) {
      Add(cases, absl::StrFormat("SparseAttention_%s_p%d_%s", shape, p, v.name),
          [c, p, v](uint32_t seed) { return SparseAttentionRun(c, p, v, seed); });
    }
    for (const bool with_lse : {true, false}) {
      Add(cases, "DenseAttention_" + shape + (with_lse ? "_lse" : "_no_lse"),
          [c, with_lse](uint32_t seed) { return DenseAttentionRun(c, with_lse, seed); });
    }
  }
  // Caches off their 16-byte alignment are refused at enqueue on every backend
  // (kAttentionAlignment): backend_ops_test's MisalignedCachesAreRefused.
}

}  // namespace kvtier::testing::op_cases_internal
