// Data-dependent errors: every backend must accept the op and fail the stream with
// OUT_OF_RANGE naming the bad entry.
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

// ---- Data-dependent errors: OUT_OF_RANGE from the stream, on every backend ----

constexpr int32_t kErrB = 2, kErrHq = 4, kErrD = 64, kErrP = 16, kErrS = 4, kErrPages = 8;
const KvShape kErrShape{DType::kF16, kErrHq, kHkv, kErrD, kErrP};

// An OpRun that must fail the stream with OUT_OF_RANGE naming `message`.
OpRun OutOfRange(std::string message) {
  OpRun r;
  r.run_code = absl::StatusCode::kOutOfRange;
  r.run_message = std::move(message);
  return r;
}

OpRun ScorePagesNumPagesBeyondMaxPages(uint32_t seed) {
  TypedBuffer q(DType::kF16, kErrB * kErrHq * kErrD);
  TypedBuffer sums(DType::kF16, kErrB * kErrPages * kHkv * 2 * kErrD);
  q.FillNormal(seed + 1);
  sums.FillNormal(seed + 2);
  OpRun r = OutOfRange("ScorePages: num_pages[1] = 9");
  const int iq = r.in.Add(q), isum = r.in.Add(sums);
  const int inp = r.in.Add(std::vector<int32_t>{3, kErrPages + 1});
  const int ipooled = r.in.Add(std::vector<float>(kErrB * kHkv * kErrPages));
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    ScorePagesArgs a;
    a.shape = kErrShape;
    a.batch = kErrB;
    a.max_pages = kErrPages;
    a.q = p.get(iq);
    a.summaries = p.get(isum);
    a.num_pages = p.get<int32_t>(inp);
    a.pooled = p.get<float>(ipooled);
    return be.ScorePages(s, a);
  };
  return r;
}

OpRun TopKHeadKBeyondK(uint32_t) {
  constexpr int32_t kK = 4;
  OpRun r = OutOfRange("TopK: head_k[2] = 5");
  const int ipooled = r.in.Add(std::vector<float>(kErrB * kHkv * kErrPages, 1.0f));
  const int inp = r.in.Add(std::vector<int32_t>{kErrPages, kErrPages});
  const int ihk = r.in.Add(std::vector<int32_t>{1, 2, kK + 1, 0});
  const int isel = r.in.Add(std::vector<int32_t>(kErrB * kHkv * kK));
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    TopKArgs a;
    a.shape = kErrShape;
    a.batch = kErrB;
    a.max_pages = kErrPages;
    a.k = kK;
    a.pooled = p.get<float>(ipooled);
    a.num_pages = p.get<int32_t>(inp);
    a.selected = p.get<int32_t>(isel);
    a.head_k = p.get<int32_t>(ihk);
    return be.TopK(s, a);
  };
  return r;
}

OpRun ReplaceSelectedPageWithoutHostPage(uint32_t) {
  constexpr int32_t kK = 2;
  std::vector<int64_t> host_page_of(kErrB * kErrPages);
  std::iota(host_page_of.begin(), host_page_of.end(), 0);
  host_page_of[kErrPages + 5] = -1;            // sequence 1, page 5
  OpRun r = OutOfRange("Replace: selected[");  // the CPU names [b][h][i], CUDA the flat index
  const int isel = r.in.Add(std::vector<int32_t>{0, 1, 2, -1, 3, 4, 5, 6});
  const int itab = r.in.Add(std::vector<int32_t>(kErrB * kHkv * kErrS, kEmptySlot));
  const int ihp = r.in.Add(host_page_of);
  const int iitems = r.in.Add(std::vector<RecallItem>(kErrB * kHkv * kK));
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    ReplaceArgs a;
    a.shape = kErrShape;
    a.kv.num_slots = kErrS;
    a.kv.slot_table = p.get<int32_t>(itab);
    a.batch = kErrB;
    a.region_begin = 1;
    a.k = kK;
    a.selected = p.get<int32_t>(isel);
    a.host_page_of = p.get<int64_t>(ihp);
    a.max_pages = kErrPages;
    a.items = p.get<RecallItem>(iitems);
    return be.Replace(s, a);
  };
  return r;
}

// A page beyond max_pages (or below kEmptySlot) in one of SelectionLoss's two selections.
OpRun SelectionLossBadPage(bool in_current, uint32_t) {
  constexpr int32_t kK = 2;
  std::vector<int32_t> current{0, 1, 2, -1, 3, 4, 5, 6}, fresh{1, 0, 2, 3, -1, -1, 6, 5};
  std::vector<int32_t>& bad = in_current ? current : fresh;
  bad[5] = in_current ? kErrPages : -2;
  OpRun r = OutOfRange(in_current ? absl::StrFormat("SelectionLoss: current[5] = %d", kErrPages)
                                  : std::string("SelectionLoss: fresh[5] = -2"));
  const int ipooled = r.in.Add(std::vector<float>(kErrB * kHkv * kErrPages, 0.125f));
  const int icur = r.in.Add(current), ifr = r.in.Add(fresh);
  const int iloss = r.in.Add(std::vector<float>(kErrB * kHkv));
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    SelectionLossArgs a;
    a.shape = kErrShape;
    a.batch = kErrB;
    a.max_pages = kErrPages;
    a.k = kK;
    a.pooled = p.get<float>(ipooled);
    a.current = p.get<int32_t>(icur);
    a.fresh = p.get<int32_t>(ifr);
    a.loss = p.get<float>(iloss);
    return be.SelectionLoss(s, a);
  };
  return r;
}

// partial_len beyond the page size, or a slot table entry below -1.
OpRun SparseAttentionBadPartialLenOrSlotTable(bool bad_len, uint32_t seed) {
  constexpr int32_t kEntries = kErrB * kHkv * kErrS;
  std::vector<int32_t> table(kEntries);
  for (int32_t i = 0; i < kEntries; ++i) table[static_cast<size_t>(i)] = i % kErrS;
  if (!bad_len) table[5] = -2;
  TypedBuffer q(DType::kBF16, kErrB * kErrHq * kErrD);
  TypedBuffer k(DType::kBF16, kErrB * kErrS * kErrP * kHkv * kErrD);
  q.FillNormal(seed + 1);
  k.FillNormal(seed + 2);
  OpRun r = OutOfRange(bad_len ? "SparseAttention: partial_len[1] = 17"
                               : "SparseAttention: slot_table[5] = -2");
  const int iq = r.in.Add(q), ik = r.in.Add(k), iv = r.in.Add(k), itab = r.in.Add(table);
  const int ipp = r.in.Add(std::vector<int32_t>{1, 2});
  const int ipl = r.in.Add(std::vector<int32_t>{3, bad_len ? kErrP + 1 : kErrP});
  const int iout = r.in.Add(TypedBuffer(DType::kBF16, kErrB * kErrHq * kErrD));
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    SparseAttentionArgs a;
    a.shape = kErrShape;
    a.shape.dtype = DType::kBF16;
    a.kv = PagedKv{.k_cache = p.get(ik),
                   .v_cache = p.get(iv),
                   .num_slots = kErrS,
                   .slot_table = p.get<int32_t>(itab),
                   .partial_page = p.get<int32_t>(ipp),
                   .partial_len = p.get<int32_t>(ipl)};
    a.batch = kErrB;
    a.q = p.get(iq);
    a.out = p.get(iout);
    return be.SparseAttention(s, a);
  };
  return r;
}

OpRun DenseAttentionSeqLenBeyondMaxTokens(uint32_t seed) {
  constexpr int32_t kT = 40;
  TypedBuffer q(DType::kF32, kErrB * kErrHq * kErrD), k(DType::kF32, kErrB * kT * kHkv * kErrD);
  q.FillNormal(seed + 1);
  k.FillNormal(seed + 2);
  OpRun r = OutOfRange("DenseAttention: seq_len[0] = 41");
  const int iq = r.in.Add(q), ik = r.in.Add(k), iv = r.in.Add(k);
  const int ilen = r.in.Add(std::vector<int32_t>{kT + 1, 3});
  const int iout = r.in.Add(TypedBuffer(DType::kF32, kErrB * kErrHq * kErrD));
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    DenseAttentionArgs a;
    a.shape = kErrShape;
    a.shape.dtype = DType::kF32;
    a.batch = kErrB;
    a.max_tokens = kT;
    a.q = p.get(iq);
    a.k = p.get(ik);
    a.v = p.get(iv);
    a.seq_len = p.get<int32_t>(ilen);
    a.out = p.get(iout);
    return be.DenseAttention(s, a);
  };
  return r;
}

// The error shape's working set of kErrS slots, in `dtype`.
WorkingSetBuffers ErrorWorkingSet(OpBuffers& in, DType dtype, uint32_t seed) {
  KvShape shape = kErrShape;
  shape.dtype = dtype;
  return WorkingSetBuffers(in, kErrS, RandomCache(shape, kErrS, seed + 1),
                           RandomCache(shape, kErrS, seed + 2));
}

// A bad item anywhere fails the whole call before anything moves.
OpRun MoveHeadSlotsBadItem(HeadSlotMove bad, const char* message, uint32_t seed) {
  OpRun r = OutOfRange(message);
  const int iitems = r.in.Add(std::vector<HeadSlotMove>{{0, 0, 1}, {1, 2, 3}, bad, {0, 3, 2}});
  const WorkingSetBuffers ws = ErrorWorkingSet(r.in, DType::kF32, seed);
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    MoveHeadSlotsArgs a;
    a.shape = kErrShape;
    a.shape.dtype = DType::kF32;
    a.kv = ws.At(p);
    a.items = p.get<HeadSlotMove>(iitems);
    a.num_items = 4;
    return be.MoveHeadSlots(s, a);
  };
  r.check = [=](const OpBuffers& in, const OpResult& want, const OpResult& got) {
    for (const int i : ws.Indices()) {
      EXPECT_TRUE(got.bufs[static_cast<size_t>(i)] == in[static_cast<size_t>(i)])
          << "buffer " << i << " written";
      EXPECT_TRUE(want.bufs[static_cast<size_t>(i)] == in[static_cast<size_t>(i)])
          << "reference wrote buffer " << i;
    }
  };
  return r;
}

// Three host pages and a working set of the error shape.
struct CopyErrorBuffers {
  int ipages;
  WorkingSetBuffers ws;
  CopyErrorBuffers(OpBuffers& in, uint32_t seed)
      : ipages(in.Add(std::vector<Half>(static_cast<size_t>(3) * kHkv * 2 * kErrP * kErrD))),
        ws(in, kErrS, RandomCache(kErrShape, kErrS, seed),
           RandomCache(kErrShape, kErrS, seed + 1)) {}
};

OpRun RecallDstSlotOutOfRange(uint32_t seed) {
  OpRun r = OutOfRange("Recall: items[1].dst_slot = 4");
  const CopyErrorBuffers b(r.in, seed);
  const int iitems = r.in.Add(std::vector<RecallItem>{{0, 0, 0}, {1, 1, kErrS}, {2, 0, 1}});
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    RecallArgs a;
    a.shape = kErrShape;
    a.kv = b.ws.At(p);
    a.host_pages = p.get(b.ipages);
    a.num_host_pages = 3;
    a.items = p.get<RecallItem>(iitems);
    a.num_items = 3;
    return be.Recall(s, a);
  };
  return r;
}

OpRun OffloadSummaryPageOutOfRange(uint32_t seed) {
  OpRun r = OutOfRange("Offload: items[1].summary_page = 9");
  const CopyErrorBuffers b(r.in, seed);
  const int isums = r.in.Add(std::vector<Half>(4 * kHkv * 2 * kErrD));
  const int iitems = r.in.Add(std::vector<OffloadItem>{{0, 0, 0}, {1, 2, 9}});
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    OffloadArgs a;
    a.shape = kErrShape;
    a.k_src = p.get(b.ws.k);
    a.v_src = p.get(b.ws.v);
    a.num_src_slots = kErrS;
    a.host_pages = p.get(b.ipages);
    a.num_host_pages = 3;
    a.summaries = p.get(isums);
    a.num_summary_pages = 4;
    a.items = p.get<OffloadItem>(iitems);
    a.num_items = 2;
    return be.Offload(s, a);
  };
  return r;
}

// Item 1 names KV head 2 of 2; item 2 is a skip item with wild fields.
OpRun SlabsKvHeadOutOfRange(bool gather, uint32_t seed) {
  const std::vector<RecallItem> items = {{0, 0, 0}, {1, kHkv, 9}, {kSkipItem, 99, 99}};
  OpRun r = OutOfRange(gather ? "GatherSlabs: items[1].kv_head = 2"
                              : "ScatterSlabs: items[1].kv_head = 2");
  const CopyErrorBuffers b(r.in, seed);
  const int iitems = r.in.Add(items);
  const int istaging = r.in.Add(std::vector<Half>(items.size() * 2 * kErrP * kErrD));
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    if (gather) {
      GatherSlabsArgs a;
      a.shape = kErrShape;
      a.host_pages = p.get(b.ipages);
      a.num_host_pages = 3;
      a.items = p.get<RecallItem>(iitems);
      a.num_items = 3;
      a.staging = p.get(istaging);
      return be.GatherSlabs(s, a);
    }
    ScatterSlabsArgs a;
    a.shape = kErrShape;
    a.kv = b.ws.At(p);
    a.staging = p.get(istaging);
    a.items = p.get<RecallItem>(iitems);
    a.num_items = 3;
    return be.ScatterSlabs(s, a);
  };
  return r;
}

}  // namespace

void AddErrorCases(std::vector<OpCase>& cases) {
  Add(cases, "ScorePages_error_num_pages", ScorePagesNumPagesBeyondMaxPages);
  Add(cases, "TopK_error_head_k", TopKHeadKBeyondK);
  Add(cases, "Replace_error_no_host_page", ReplaceSelectedPageWithoutHostPage);
  for (const bool in_current : {true, false}) {
    Add(cases, in_current ? "SelectionLoss_error_current" : "SelectionLoss_error_fresh",
        [in_current](uint32_t seed) { return SelectionLossBadPage(in_current, seed); });
  }
  for (const bool bad_len : {true, false}) {
    Add(cases, bad_len ? "SparseAttention_error_partial_len" : "SparseAttention_error_slot_table",
        [bad_len](uint32_t seed) {
          return SparseAttentionBadPartialLenOrSlotTable(bad_len, seed);
        });
  }
  Add(cases, "DenseAttention_error_seq_len", DenseAttentionSeqLenBeyondMaxTokens);
  Add(cases, "MoveHeadSlots_error_kv_head", [](uint32_t seed) {
    return MoveHeadSlotsBadItem({kHkv, 0, 1}, "MoveHeadSlots: items[2].kv_head = 2", seed);
  });
  Add(cases, "MoveHeadSlots_error_src_slot", [](uint32_t seed) {
    return MoveHeadSlotsBadItem({0, kErrS, 1}, "MoveHeadSlots: items[2].src_slot = 4", seed);
  });
  Add(cases, "MoveHeadSlots_error_dst_slot", [](uint32_t seed) {
    return MoveHeadSlotsBadItem({1, 0, -1}, "MoveHeadSlots: items[2].dst_slot = -1", seed);
  });
  Add(cases, "Recall_error_dst_slot", RecallDstSlotOutOfRange);
  Add(cases, "Offload_error_summary_page", OffloadSummaryPageOutOfRange);
  for (const bool gather : {true, false}) {
    Add(cases, gather ? "GatherSlabs_error_kv_head" : "ScatterSlabs_error_kv_head",
        [gather](uint32_t seed) { return SlabsKvHeadOutOfRange(gather, seed); });
  }
}

}  // namespace kvtier::testing::op_cases_internal
