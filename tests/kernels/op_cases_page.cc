// The page-shaped ops against the CPU reference, bit for bit: Recall, GatherSlabs and
// ScatterSlabs, Offload (host pages in device or registered host memory) and MoveHeadSlots.
#include <algorithm>
#include <initializer_list>
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

// The page shapes (query heads are not read): dtype × page size × head dim × `kv_heads`,
// and one with rows no wide copy unit fits.
std::vector<KvShape> PageShapes(std::initializer_list<int32_t> kv_heads) {
  std::vector<KvShape> out;
  for (DType t : {DType::kF16, DType::kBF16, DType::kF32}) {
    for (int32_t p : {16, 32}) {
      for (int32_t d : {64, 128}) {
        for (int32_t h : kv_heads) out.push_back(KvShape{t, h, h, d, p});
      }
    }
    out.push_back(KvShape{t, 2, 2, 5, 3});
  }
  return out;
}

std::string NameOf(const KvShape& c) {
  return absl::StrFormat("%s_p%d_d%d_hkv%d", DTypeName(c.dtype), c.page_size, c.head_dim,
                         c.num_kv_heads);
}

const char* NameOf(Placement where) { return where == Placement::kDevice ? "device" : "zerocopy"; }

constexpr int32_t kCopyHostPages = 5;
constexpr int32_t kCopySlots = 6;  // B·S global slots

// Distinct (slot, head) targets, some left alone, host pages reused across items; with
// `skips`, every fourth a skip item with wild fields; with `odd`, a last skip item if the
// count would be even.
std::vector<RecallItem> CopyItems(const KvShape& c, bool skips, bool odd = false) {
  std::vector<RecallItem> items;
  for (int32_t s = 0; s < kCopySlots; ++s) {
    for (int32_t h = 0; h < c.num_kv_heads; ++h) {
      if (skips && (s + h) % 4 == 1) {
        items.push_back({kSkipItem, 1000, -7});
      } else if ((s + h) % 3 != 0) {
        items.push_back({(3 * s + 5 * h + 1) % kCopyHostPages, h, s});
      }
    }
  }
  if (items.empty()) items.push_back({4, 0, 0});
  if (odd && items.size() % 2 == 0) items.push_back({kSkipItem, 3, 1 << 30});
  return items;
}

// Host pages, then K and V caches whose rows no item writes must survive unchanged.
OpRun RecallRun(const KvShape& c, Placement pages_at, size_t misalign, uint32_t seed,
                bool odd = false) {
  const HostPageLayout hl{c.num_kv_heads, c.page_size, c.head_dim};
  TypedBuffer pages(c.dtype, kCopyHostPages * hl.page_elements());
  pages.FillNormal(seed + 1);
  const std::vector<RecallItem> items = CopyItems(c, /*skips=*/true, odd);
  OpRun r;
  const int ipages = r.in.Add(pages, pages_at, misalign), iitems = r.in.Add(items);
  const WorkingSetBuffers ws(r.in, kCopySlots, RandomCache(c, kCopySlots, seed + 2),
                             RandomCache(c, kCopySlots, seed + 3), misalign);
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    RecallArgs a;
    a.shape = c;
    a.kv = ws.At(p);
    a.host_pages = p.get(ipages);
    a.num_host_pages = kCopyHostPages;
    a.items = p.get<RecallItem>(iitems);
    a.num_items = static_cast<int32_t>(items.size());
    return be.Recall(s, a);
  };
  r.check = [=](const OpBuffers&, const OpResult& want, const OpResult& got) {
    ws.ExpectSameCaches(want, got, c.dtype);
  };
  return r;
}

// Staging starts random, so slabs of skip items must be left as they were.
OpRun GatherSlabsRun(const KvShape& c, Placement pages_at, uint32_t seed, bool odd = false) {
  const HostPageLayout hl{c.num_kv_heads, c.page_size, c.head_dim};
  TypedBuffer pages(c.dtype, kCopyHostPages * hl.page_elements());
  pages.FillNormal(seed + 1);
  const std::vector<RecallItem> items = CopyItems(c, /*skips=*/true, odd);
  const auto n = static_cast<int32_t>(items.size());
  TypedBuffer staging(c.dtype, n * hl.slab_elements());
  staging.FillNormal(seed + 2);
  OpRun r;
  const int ipages = r.in.Add(pages, pages_at), iitems = r.in.Add(items);
  const int istaging = r.in.Add(staging);
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    GatherSlabsArgs a;
    a.shape = c;
    a.host_pages = p.get(ipages);
    a.num_host_pages = kCopyHostPages;
    a.items = p.get<RecallItem>(iitems);
    a.num_items = n;
    a.staging = p.get(istaging);
    return be.GatherSlabs(s, a);
  };
  r.check = [=](const OpBuffers&, const OpResult& want, const OpResult& got) {
    ExpectSameBytes(want, got, istaging, DTypeSize(c.dtype), "staging");
  };
  return r;
}

OpRun ScatterSlabsRun(const KvShape& c, uint32_t seed, bool odd = false) {
  const std::vector<RecallItem> items = CopyItems(c, /*skips=*/true, odd);
  const auto n = static_cast<int32_t>(items.size());
  TypedBuffer staging(c.dtype, n * HostPageLayout{1, c.page_size, c.head_dim}.page_elements());
  staging.FillNormal(seed + 1);
  OpRun r;
  const int istaging = r.in.Add(staging), iitems = r.in.Add(items);
  const WorkingSetBuffers ws(r.in, kCopySlots, RandomCache(c, kCopySlots, seed + 2),
                             RandomCache(c, kCopySlots, seed + 3));
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    ScatterSlabsArgs a;
    a.shape = c;
    a.kv = ws.At(p);
    a.staging = p.get(istaging);
    a.items = p.get<RecallItem>(iitems);
    a.num_items = n;
    return be.ScatterSlabs(s, a);
  };
  r.check = [=](const OpBuffers&, const OpResult& want, const OpResult& got) {
    ws.ExpectSameCaches(want, got, c.dtype);
  };
  return r;
}

// Three full pages of a four-slot source into five host pages and six summary pages; pages
// and summaries no item writes must survive unchanged.
OpRun OffloadRun(const KvShape& c, Placement pages_at, SummaryMode mode, uint32_t seed) {
  const HostPageLayout hl{c.num_kv_heads, c.page_size, c.head_dim};
  const SummaryLayout sl{c.num_kv_heads, c.head_dim};
  constexpr int32_t kSrcSlots = 4, kHostPages = 5, kSummaryPages = 6;
  const TypedBuffer k = RandomCache(c, kSrcSlots, seed + 1),
                    v = RandomCache(c, kSrcSlots, seed + 2);
  TypedBuffer pages(c.dtype, kHostPages * hl.page_elements());
  TypedBuffer sums(c.dtype, kSummaryPages * sl.page_elements());
  pages.FillNormal(seed + 3);
  sums.FillNormal(seed + 4);
  const std::vector<OffloadItem> items = {{2, 4, 1}, {0, 1, 5}, {3, 0, 3}};
  OpRun r;
  const int ik = r.in.Add(k), iv = r.in.Add(v), iitems = r.in.Add(items);
  const int ipages = r.in.Add(pages, pages_at), isums = r.in.Add(sums, pages_at);
  // Key codes start as noise too: bytes no item writes must survive.
  const KeyCodeLayout cl{c.num_kv_heads, c.page_size, c.head_dim};
  std::vector<uint8_t> codes(static_cast<size_t>(kSummaryPages * cl.page_bytes()));
  std::mt19937 rng(seed + 5);
  for (uint8_t& b : codes) b = static_cast<uint8_t>(rng());
  const int icodes = mode == SummaryMode::kKeyCodes ? r.in.Add(codes) : -1;
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    OffloadArgs a;
    a.shape = c;
    a.summary = mode;
    a.k_src = p.get(ik);
    a.v_src = p.get(iv);
    a.num_src_slots = kSrcSlots;
    a.host_pages = p.get(ipages);
    a.num_host_pages = kHostPages;
    a.summaries = p.get(isums);
    a.num_summary_pages = kSummaryPages;
    if (icodes >= 0) a.codes = p.get<uint8_t>(icodes);
    a.items = p.get<OffloadItem>(iitems);
    a.num_items = static_cast<int32_t>(items.size());
    return be.Offload(s, a);
  };
  r.check = [=](const OpBuffers&, const OpResult& want, const OpResult& got) {
    ExpectSameBytes(want, got, ipages, DTypeSize(c.dtype), "host pages");
    ExpectSameBytes(want, got, isums, DTypeSize(c.dtype), "summaries");
    if (icodes >= 0) ExpectSameBytes(want, got, icodes, 1, "key codes");
  };
  return r;
}

// Chained moves (each reads what the one before wrote, then its source is overwritten),
// then random ones.
OpRun MoveHeadSlotsRun(const KvShape& c, uint32_t seed) {
  constexpr int32_t kSlots = 8;
  std::mt19937 rng(seed);
  const int32_t h_last = c.num_kv_heads - 1;
  std::vector<HeadSlotMove> items = {{0, 1, 3},      {0, 3, 5},      {0, 5, 1},
                                     {h_last, 5, 0}, {h_last, 0, 7}, {0, 2, 5}};
  for (int i = 0; i < 20; ++i) {
    const int32_t src = Uniform(rng, 0, kSlots - 1);
    int32_t dst = Uniform(rng, 0, kSlots - 2);
    if (dst >= src) ++dst;
    items.push_back({Uniform(rng, 0, c.num_kv_heads - 1), src, dst});
  }
  OpRun r;
  const int iitems = r.in.Add(items);
  WorkingSetBuffers ws(r.in, kSlots, RandomCache(c, kSlots, seed + 1),
                       RandomCache(c, kSlots, seed + 2));
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    MoveHeadSlotsArgs a;
    a.shape = c;
    a.kv = ws.At(p);
    a.items = p.get<HeadSlotMove>(iitems);
    a.num_items = static_cast<int32_t>(items.size());
    return be.MoveHeadSlots(s, a);
  };
  r.check = [=](const OpBuffers&, const OpResult& want, const OpResult& got) {
    ws.ExpectSameCaches(want, got, c.dtype);
  };
  return r;
}

}  // namespace

void AddPageCases(std::vector<OpCase>& cases) {
  for (const KvShape& c : PageShapes({1, 8})) {
    const std::string shape = NameOf(c);
    for (const Placement where : {Placement::kDevice, Placement::kRegisteredHost}) {
      const std::string suffix = std::string("_") + NameOf(where);
      Add(cases, "Recall_" + shape + suffix,
          [c, where](uint32_t seed) { return RecallRun(c, where, 0, seed); });
      Add(cases, "GatherSlabs_" + shape + suffix,
          [c, where](uint32_t seed) { return GatherSlabsRun(c, where, seed); });
      for (const SummaryMode mode :
           {SummaryMode::kMinMax, SummaryMode::kCenterMad, SummaryMode::kKeyCodes}) {
        if (mode == SummaryMode::kKeyCodes && c.head_dim % 2 != 0) continue;  // two codes a byte
        const char* name = mode == SummaryMode::kMinMax      ? "_minmax"
                           : mode == SummaryMode::kCenterMad ? "_centermad"
                                                             : "_keycodes";
        Add(cases, "Offload_" + shape + suffix + name,
            [c, where, mode](uint32_t seed) { return OffloadRun(c, where, mode, seed); });
      }
    }
    Add(cases, "ScatterSlabs_" + shape, [c](uint32_t seed) { return ScatterSlabsRun(c, seed); });
    // Host pages and caches one element off their alignment: the narrow copy units.
    Add(cases, "Recall_" + shape + "_misaligned",
        [c](uint32_t seed) { return RecallRun(c, Placement::kDevice, DTypeSize(c.dtype), seed); });
  }
  // The batched slab copies: the 16 KiB slab of p = 32, d = 128, fp16 (one round of four
  // 16-byte loads per thread) with an odd number of items, skips among them; and slabs that
  // fill no whole round (p = 33, d = 136), also in narrow units over several rounds.
  for (const KvShape& c : {KvShape{DType::kF16, 8, 8, 128, 32}, KvShape{DType::kF32, 2, 2, 136, 33},
                           KvShape{DType::kF16, 3, 3, 136, 33}}) {
    const std::string shape = NameOf(c) + "_odd";
    for (const Placement where : {Placement::kDevice, Placement::kRegisteredHost}) {
      const std::string suffix = std::string("_") + NameOf(where);
      Add(cases, "Recall_" + shape + suffix,
          [c, where](uint32_t seed) { return RecallRun(c, where, 0, seed, /*odd=*/true); });
      Add(cases, "GatherSlabs_" + shape + suffix,
          [c, where](uint32_t seed) { return GatherSlabsRun(c, where, seed, /*odd=*/true); });
    }
    Add(cases, "ScatterSlabs_" + shape,
        [c](uint32_t seed) { return ScatterSlabsRun(c, seed, /*odd=*/true); });
    Add(cases, "Recall_" + shape + "_misaligned", [c](uint32_t seed) {
      return RecallRun(c, Placement::kDevice, DTypeSize(c.dtype), seed, /*odd=*/true);
    });
  }
  for (const KvShape& c : PageShapes({1, 4})) {
    const std::string shape = NameOf(c);
    Add(cases, "MoveHeadSlots_" + shape, [c](uint32_t seed) { return MoveHeadSlotsRun(c, seed); });
  }
}

}  // namespace kvtier::testing::op_cases_internal
