// The hot ops at decode size: one layer of Llama-3.1-8B (32 query heads, 8 KV heads of 128,
// pages of 32 tokens, fp16) as a decode step runs them, so that every backend is checked
// against the CPU reference at the sizes it is used at, and `kvtier-bench ops` times the
// same cases (each states the bytes it must move and, for attention and scoring, its
// floating-point operations). Names end in `_decode_<size>`.
//
// PerfOpCases are cases only `kvtier-bench ops` runs, at sizes a unit test cannot hold
// (inputs of up to 512 MiB): the same runs at 128K tokens, and the `_roofline_` set — pages of
// 16, a working set and a top-k of 1/8 of the context, every page a candidate — that holds
// the CPU kernels to the machine's read bandwidth (docs/benchmarks.md).
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "kvtier/layout.h"
#include "tests/kernels/op_cases.h"
#include "tests/kernels/op_cases_internal.h"

namespace kvtier::testing::op_cases_internal {
namespace {

constexpr KvShape kDecode{DType::kF16, 32, 8, 128, 32};
// The roofline set's: the same layer with pages of 16 tokens.
constexpr KvShape kRoofline{DType::kF16, 32, 8, 128, 16};
constexpr int64_t kElem = 2;  // fp16

int64_t Bytes(int64_t elements) { return elements * kElem; }
std::string Tokens(int64_t n) {
  return n % 1024 == 0 ? absl::StrFormat("%dk", n / 1024) : absl::StrCat(n);
}

TypedBuffer Normal(int64_t n, uint32_t seed) {
  TypedBuffer b(kDecode.dtype, n);
  b.FillNormal(seed);
  return b;
}

// Page scoring of one sequence at `context` tokens: every page's summary (with `codes`, every
// key's 4-bit codes in its page's bounds: SummaryMode::kKeyCodes, the default) against the
// query of every head, pooled per KV head.
// `*num_pages_at`, `*pooled_at` (when given): the indices of its page count and scores.
OpRun ScoreRun(const KvShape& shape, int32_t context, bool codes, uint32_t seed,
               int* num_pages_at = nullptr, int* pooled_at = nullptr) {
  const int32_t P = context / shape.page_size;
  const SummaryLayout sl{shape.num_kv_heads, shape.head_dim};
  const int64_t q_elems = int64_t{shape.num_q_heads} * shape.head_dim;
  OpRun r;
  const int iq = r.in.Add(Normal(q_elems, seed + 1));
  const int isum = r.in.Add(Normal(P * sl.page_elements(), seed + 2));
  const int inp = r.in.Add(std::vector<int32_t>{P});
  const int ipooled =
      r.in.Add(std::vector<float>(static_cast<size_t>(shape.num_kv_heads) * P, 7.0f));
  const KeyCodeLayout cl{shape.num_kv_heads, shape.page_size, shape.head_dim};
  int icodes = -1;
  if (codes) {
    std::vector<uint8_t> bytes(static_cast<size_t>(P * cl.page_bytes()));
    std::mt19937 rng(seed + 3);
    for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
    icodes = r.in.Add(bytes);
  }
  if (num_pages_at != nullptr) *num_pages_at = inp;
  if (pooled_at != nullptr) *pooled_at = ipooled;
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    ScorePagesArgs a;
    a.shape = shape;
    a.batch = 1;
    a.max_pages = P;
    a.q = p.get(iq);
    a.summaries = p.get(isum);
    a.num_pages = p.get<int32_t>(inp);
    a.softmax_scale = ScaleOf(shape.head_dim);
    a.pooled = p.get<float>(ipooled);
    if (icodes >= 0) a.codes = p.get<uint8_t>(icodes);
    return be.ScorePages(s, a);
  };
  r.check = [=](const OpBuffers&, const OpResult& want, const OpResult& got) {
    // Probabilities over P pages (about 1/P each): a relative tolerance.
    ExpectFloatBufNear(want, got, ipooled, 2e-4, 1e-7, "pooled");
  };
  r.bytes = Bytes(P * sl.page_elements() + q_elems) + int64_t{4} * shape.num_kv_heads * P;
  // Per query head, page and dimension: two products, a max and an add.
  r.flops = 4.0 * shape.num_q_heads * P * shape.head_dim;
  if (codes) {
    r.bytes += P * cl.page_bytes();
    // Per query head, key and dimension: the key decoded (a multiply-add) and its product
    // with the query (a multiply-add).
    r.flops = 4.0 * shape.num_q_heads * P * shape.page_size * shape.head_dim;
  }
  return r;
}

// TopK of one sequence over `max_pages` pooled scores (`ends`: 16 sink and 16 recent pages kept
// out of the candidates, as a decode step's selection; else every page a candidate).
TopKArgs DecodeTopK(const KvShape& shape, int32_t max_pages, int32_t k, bool ends,
                    const float* pooled, const int32_t* num_pages, int32_t* selected) {
  TopKArgs a;
  a.shape = shape;
  a.batch = 1;
  a.max_pages = max_pages;
  a.k = k;
  a.pooled = pooled;
  a.num_pages = num_pages;
  a.sink_pages = ends ? 16 : 0;
  a.recent_pages = ends ? 16 : 0;
  a.selected = selected;
  return a;
}

// Top-k of one sequence's pooled scores at `context` tokens (distinct random scores, so
// every backend selects the same pages).
// `ends`: as DecodeTopK.
OpRun TopKDecodeRun(const KvShape& shape, int32_t context, int32_t k, bool ends, uint32_t seed) {
  const int32_t P = context / shape.page_size, Hkv = shape.num_kv_heads;
  std::mt19937 rng(seed);
  std::vector<float> pooled(static_cast<size_t>(Hkv) * P);
  std::iota(pooled.begin(), pooled.end(), 0.0f);
  std::shuffle(pooled.begin(), pooled.end(), rng);
  OpRun r;
  const int ipooled = r.in.Add(pooled), inp = r.in.Add(std::vector<int32_t>{P});
  const int isel = r.in.Add(std::vector<int32_t>(static_cast<size_t>(Hkv) * k, -7));
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    return be.TopK(s, DecodeTopK(shape, P, k, ends, p.get<float>(ipooled), p.get<int32_t>(inp),
                                 p.get<int32_t>(isel)));
  };
  r.check = [=](const OpBuffers&, const OpResult& want, const OpResult& got) {
    ExpectSameBytes(want, got, isel, sizeof(int32_t), "selected");
  };
  r.bytes = int64_t{4} * Hkv * (P + k);
  return r;
}

// The drift check of one sequence: cosines of the current and previous query per head.
OpRun CosineDecodeRun(uint32_t seed) {
  const int64_t n = int64_t{kDecode.num_q_heads} * kDecode.head_dim;
  OpRun r;
  const int iq = r.in.Add(Normal(n, seed + 1)), iprev = r.in.Add(Normal(n, seed + 2));
  const int imean = r.in.Add(std::vector<float>(kDecode.num_kv_heads, 7.0f));
  const int idrift = r.in.Add(std::vector<uint8_t>(kDecode.num_kv_heads, 7));
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    QueryCosineArgs a;
    a.shape = kDecode;
    a.batch = 1;
    a.q = p.get(iq);
    a.q_prev = p.get(iprev);
    a.threshold = 0.0f;
    a.group_mean = p.get<float>(imean);
    a.drifted = p.get<uint8_t>(idrift);
    return be.QueryCosine(s, a);
  };
  r.check = [=](const OpBuffers&, const OpResult& want, const OpResult& got) {
    ExpectFloatBufNear(want, got, imean, 1e-5, 1e-6, "group_mean");
  };
  r.bytes = Bytes(2 * n);
  return r;
}

// An Offload of `n` items from the op's buffers (indices of r.in): center-mad summaries,
// every item's summary page below `summary_pages`.
struct OffloadBuffers {
  int k, v, items, pages, sums;
  int64_t src_slots, host_pages, summary_pages;
  int32_t n;
  OffloadArgs At(const KvShape& shape, const OpPtrs& p) const {
    OffloadArgs a;
    a.shape = shape;
    a.summary = SummaryMode::kCenterMad;
    a.k_src = p.get(k);
    a.v_src = p.get(v);
    a.num_src_slots = src_slots;
    a.host_pages = p.get(pages);
    a.num_host_pages = host_pages;
    a.summaries = p.get(sums);
    a.num_summary_pages = summary_pages;
    a.items = p.get<OffloadItem>(items);
    a.num_items = n;
    return a;
  }
};

// A zero-copy recall of `items` head-pages (each a distinct (slot, KV head)) from a pool of
// registered host pages into a working set of 64 slots.
OpRun RecallDecodeRun(int32_t items, uint32_t seed) {
  constexpr int32_t kSlots = 64, kHostPages = 128;
  const HostPageLayout hl{kDecode.num_kv_heads, kDecode.page_size, kDecode.head_dim};
  std::mt19937 rng(seed);
  std::vector<int32_t> targets(static_cast<size_t>(kSlots) * kDecode.num_kv_heads);
  std::iota(targets.begin(), targets.end(), 0);
  std::shuffle(targets.begin(), targets.end(), rng);
  std::vector<RecallItem> list;
  for (int32_t i = 0; i < items; ++i) {
    const int32_t t = targets[static_cast<size_t>(i)];
    list.push_back(
        {Uniform(rng, 0, kHostPages - 1), t % kDecode.num_kv_heads, t / kDecode.num_kv_heads});
  }
  OpRun r;
  const int ipages =
      r.in.Add(Normal(kHostPages * hl.page_elements(), seed + 1), Placement::kRegisteredHost);
  const int iitems = r.in.Add(list);
  const WorkingSetBuffers ws(r.in, kSlots, RandomCache(kDecode, kSlots, seed + 2),
                             RandomCache(kDecode, kSlots, seed + 3));
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    RecallArgs a;
    a.shape = kDecode;
    a.kv = ws.At(p);
    a.host_pages = p.get(ipages);
    a.num_host_pages = kHostPages;
    a.items = p.get<RecallItem>(iitems);
    a.num_items = items;
    return be.Recall(s, a);
  };
  r.check = [=](const OpBuffers&, const OpResult& want, const OpResult& got) {
    ws.ExpectSameCaches(want, got, kDecode.dtype);
  };
  // Each item reads its K and V slabs from host memory and writes them into the slot.
  r.bytes = int64_t{items} * 2 * Bytes(2 * hl.slab_elements());
  return r;
}

// The offload of `pages` full pages of the working set into registered host pages, with
// their summaries (center ± mean absolute deviation, the default).
OpRun OffloadDecodeRun(int32_t pages, uint32_t seed) {
  constexpr int32_t kSrcSlots = 64, kHostPages = 96;
  const HostPageLayout hl{kDecode.num_kv_heads, kDecode.page_size, kDecode.head_dim};
  const SummaryLayout sl{kDecode.num_kv_heads, kDecode.head_dim};
  std::vector<OffloadItem> items;
  for (int32_t i = 0; i < pages; ++i) items.push_back({i, 3 * i + 1, i});
  OpRun r;
  const int ik = r.in.Add(RandomCache(kDecode, kSrcSlots, seed + 1));
  const int iv = r.in.Add(RandomCache(kDecode, kSrcSlots, seed + 2));
  const int iitems = r.in.Add(items);
  const int ipages = r.in.Add(Filled(kDecode.dtype, kHostPages * hl.page_elements(), 0.0f),
                              Placement::kRegisteredHost);
  const int isums = r.in.Add(Filled(kDecode.dtype, pages * sl.page_elements(), 0.0f));
  const OffloadBuffers off{ik, iv, iitems, ipages, isums, kSrcSlots, kHostPages, pages, pages};
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) { return be.Offload(s, off.At(kDecode, p)); };
  r.check = [=](const OpBuffers&, const OpResult& want, const OpResult& got) {
    ExpectSameBytes(want, got, ipages, kElem, "host pages");
    ExpectSameBytes(want, got, isums, kElem, "summaries");
  };
  // Each page is read from the working set and written to the host; its summary written.
  r.bytes = int64_t{pages} * (2 * Bytes(hl.page_elements()) + Bytes(sl.page_elements()));
  return r;
}

// Sparse attention of one sequence over a full working set of `slots` slots, each KV head's
// table its own permutation of the pages.
OpRun SparseDecodeRun(const KvShape& shape, int32_t slots, uint32_t seed) {
  const SlotTableLayout tl{shape.num_kv_heads, slots};
  std::mt19937 rng(seed);
  std::vector<int32_t> table(static_cast<size_t>(shape.num_kv_heads) * slots);
  for (int32_t h = 0; h < shape.num_kv_heads; ++h) {
    std::vector<int32_t> pages = Iota(slots);
    std::shuffle(pages.begin(), pages.end(), rng);
    for (int32_t s = 0; s < slots; ++s) table[tl.Offset(0, h, s)] = pages[s];
  }
  const int64_t q_elems = int64_t{shape.num_q_heads} * shape.head_dim;
  OpRun r;
  const int iq = r.in.Add(Normal(q_elems, seed + 1)), itab = r.in.Add(table);
  const WorkingSetBuffers ws(r.in, slots, RandomCache(shape, slots, seed + 2),
                             RandomCache(shape, slots, seed + 3));
  const int ipp = r.in.Add(std::vector<int32_t>{-1}), ipl = r.in.Add(std::vector<int32_t>{0});
  const int iout = r.in.Add(Filled(shape.dtype, q_elems, 7.0f));
  const int ilse = r.in.Add(std::vector<float>(shape.num_q_heads, 7.0f));
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    SparseAttentionArgs a;
    a.shape = shape;
    a.kv = ws.At(p);
    a.kv.num_slots = slots;
    a.kv.slot_table = p.get<int32_t>(itab);
    a.kv.partial_page = p.get<int32_t>(ipp);
    a.kv.partial_len = p.get<int32_t>(ipl);
    a.batch = 1;
    a.q = p.get(iq);
    a.softmax_scale = ScaleOf(shape.head_dim);
    a.out = p.get(iout);
    a.lse = p.get<float>(ilse);
    return be.SparseAttention(s, a);
  };
  r.check = [=](const OpBuffers&, const OpResult& want, const OpResult& got) {
    ExpectAttentionOutNear(shape.dtype, want, got, iout, "out");
    ExpectFloatBufNear(want, got, ilse, 1e-4, 1e-4, "lse");
  };
  const int64_t tokens = int64_t{slots} * shape.page_size;
  r.bytes = 2 * Bytes(tokens * shape.num_kv_heads * shape.head_dim);
  // q·k and p·v for every query head and token: a multiply and an add each.
  r.flops = 4.0 * shape.num_q_heads * static_cast<double>(tokens) * shape.head_dim;
  return r;
}

// Dense attention of one sequence over `context` tokens of contiguous K and V.
OpRun DenseDecodeRun(const KvShape& shape, int32_t context, uint32_t seed) {
  const DenseKvLayout kl{context, shape.num_kv_heads, shape.head_dim};
  const int64_t q_elems = int64_t{shape.num_q_heads} * shape.head_dim;
  OpRun r;
  const int iq = r.in.Add(Normal(q_elems, seed + 1));
  const int ik = r.in.Add(Normal(kl.Offset(1, 0, 0, 0), seed + 2));
  const int iv = r.in.Add(Normal(kl.Offset(1, 0, 0, 0), seed + 3));
  const int ilen = r.in.Add(std::vector<int32_t>{context});
  const int iout = r.in.Add(Filled(shape.dtype, q_elems, 7.0f));
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    DenseAttentionArgs a;
    a.shape = shape;
    a.batch = 1;
    a.max_tokens = context;
    a.q = p.get(iq);
    a.k = p.get(ik);
    a.v = p.get(iv);
    a.seq_len = p.get<int32_t>(ilen);
    a.softmax_scale = ScaleOf(shape.head_dim);
    a.out = p.get(iout);
    return be.DenseAttention(s, a);
  };
  r.check = [=](const OpBuffers&, const OpResult& want, const OpResult& got) {
    ExpectAttentionOutNear(shape.dtype, want, got, iout, "out");
  };
  r.bytes = 2 * Bytes(kl.Offset(1, 0, 0, 0));
  r.flops = 4.0 * shape.num_q_heads * static_cast<double>(context) * shape.head_dim;
  return r;
}

}  // namespace

void AddDecodeCases(std::vector<OpCase>& cases) {
  for (const int32_t context : {8192, 32768, 131072}) {
    Add(cases, "ScorePages_decode_ctx" + Tokens(context),
        [context](uint32_t seed) { return ScoreRun(kDecode, context, false, seed); });
  }
  // Key codes read a quarter of the keys: 4 MiB at 8K, 16 MiB at 32K (128K: PerfOpCases).
  for (const int32_t context : {8192, 32768}) {
    Add(cases, "ScorePages_keycodes_decode_ctx" + Tokens(context),
        [context](uint32_t seed) { return ScoreRun(kDecode, context, true, seed); });
  }
  Add(cases, "TopK_decode_ctx32k_k32",
      [](uint32_t seed) { return TopKDecodeRun(kDecode, 32768, 32, true, seed); });
  Add(cases, "QueryCosine_decode", [](uint32_t seed) { return CosineDecodeRun(seed); });
  for (const int32_t items : {64, 256}) {
    Add(cases, absl::StrFormat("Recall_decode_%ditems", items),
        [items](uint32_t seed) { return RecallDecodeRun(items, seed); });
  }
  Add(cases, "Offload_decode_32pages", [](uint32_t seed) { return OffloadDecodeRun(32, seed); });
  // FreeKV's working set (2,048 tokens) and twice it.
  for (const int32_t slots : {64, 128}) {
    Add(cases, "SparseAttention_decode_ws" + Tokens(int64_t{slots} * kDecode.page_size),
        [slots](uint32_t seed) { return SparseDecodeRun(kDecode, slots, seed); });
  }
  for (const int32_t context : {8192, 32768}) {
    Add(cases, "DenseAttention_decode_ctx" + Tokens(context),
        [context](uint32_t seed) { return DenseDecodeRun(kDecode, context, seed); });
  }
}

namespace {

// ScorePages and then TopK over its scores (`ends`: as TopKDecodeRun): a step's selection.
OpRun SelectionRun(const KvShape& shape, int32_t context, int32_t k, bool ends, bool codes,
                   uint32_t seed) {
  int inp = 0, ipooled = 0;
  OpRun r = ScoreRun(shape, context, codes, seed, &inp, &ipooled);
  const OpRun topk = TopKDecodeRun(shape, context, k, ends, seed);
  // TopK reads ScorePages' page count and the scores it wrote; only its selection is new.
  const int isel = r.in.Add(std::vector<int32_t>(static_cast<size_t>(shape.num_kv_heads) * k, -7));
  const OpFn score_op = r.op;
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) -> absl::Status {
    if (absl::Status st = score_op(be, s, p); !st.ok()) return st;
    return be.TopK(s, DecodeTopK(shape, context / shape.page_size, k, ends,
                                 p.get<float>(ipooled), p.get<int32_t>(inp),
                                 p.get<int32_t>(isel)));
  };
  r.check = nullptr;
  // ScorePages' bytes; TopK reads the scores ScorePages wrote and writes its selection.
  r.bytes += topk.bytes;
  return r;
}

}  // namespace

void AddPerfCases(std::vector<OpCase>& cases) {
  // A decode step at 128K tokens beside the 8K and 32K of the op table: dense attention
  // over all of it (512 MiB of K and V) and the selection's TopK.
  Add(cases, "DenseAttention_decode_ctx128k",
      [](uint32_t seed) { return DenseDecodeRun(kDecode, 131072, seed); });
  Add(cases, "TopK_decode_ctx8k_k32",
      [](uint32_t seed) { return TopKDecodeRun(kDecode, 8192, 32, true, seed); });
  Add(cases, "TopK_decode_ctx128k_k32",
      [](uint32_t seed) { return TopKDecodeRun(kDecode, 131072, 32, true, seed); });
  // A step's selection with key codes (the default summary) at 32K and 128K: scoring every
  // page's keys (64 MiB of codes at 128K) and the top 32 pages per KV head.
  Add(cases, "ScorePages_keycodes_decode_ctx128k",
      [](uint32_t seed) { return ScoreRun(kDecode, 131072, true, seed); });
  for (const int32_t context : {32768, 131072}) {
    Add(cases, "Selection_keycodes_decode_ctx" + Tokens(context) + "_k32",
        [context](uint32_t seed) { return SelectionRun(kDecode, context, 32, true, true, seed); });
  }
  // The roofline set: a working set and a top-k of 1/8 of the context.
  for (const int32_t context : {32768, 131072}) {
    Add(cases, "DenseAttention_roofline_ctx" + Tokens(context),
        [context](uint32_t seed) { return DenseDecodeRun(kRoofline, context, seed); });
    const int32_t slots = context / 8 / kRoofline.page_size;
    Add(cases, "SparseAttention_roofline_ctx" + Tokens(context) + "_ws" + Tokens(context / 8),
        [slots](uint32_t seed) { return SparseDecodeRun(kRoofline, slots, seed); });
  }
  for (const int32_t context : {8192, 32768, 131072}) {
    const int32_t k = context / 8 / kRoofline.page_size;
    Add(cases, "ScorePages_roofline_ctx" + Tokens(context),
        [context](uint32_t seed) { return ScoreRun(kRoofline, context, false, seed); });
    Add(cases, "Selection_roofline_ctx" + Tokens(context), [context, k](uint32_t seed) {
      return SelectionRun(kRoofline, context, k, false, false, seed);
    });
    Add(cases, "TopK_roofline_ctx" + Tokens(context),
        [context, k](uint32_t seed) { return TopKDecodeRun(kRoofline, context, k, false, seed); });
  }
}

}  // namespace kvtier::testing::op_cases_internal
