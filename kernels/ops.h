// Arguments of the backend's compute ops (docs/architecture.md#the-decode-step,
// docs/architecture.md#backends). Kernels are framework-free: raw pointers into backend memory,
// sizes, and the layouts of kvtier/layout.h. Ops never allocate; callers own every buffer. The
// structs carry no CUDA types, so the CPU reference and the CUDA kernels take the same arguments.
//
// Every op's arguments embed one description of the head and page shape (KvShape) and,
// where the op touches the working set, one description of it (PagedKv), as FlashInfer's
// paged_kv_t does; each op reads the fields of them it needs and adds its own.
//
// Shape checks (positive sizes, GQA divisibility, non-null required pointers) happen when an
// op is enqueued: ValidateArgs below, called by Backend. Data-dependent checks (an index in
// a device array out of range) happen when the op runs, and fail the stream.
#ifndef KVTIER_KERNELS_OPS_H_
#define KVTIER_KERNELS_OPS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kvtier/dtype.h"
#include "kvtier/geometry.h"
#include "kvtier/options.h"

namespace kvtier {

// The head and page shape an op works on. Every op reads num_kv_heads; which of the others
// it reads is said at its struct (an op without query heads or pages leaves them unread).
// ValidateArgs checks exactly the fields the op reads, with Geometry's limits.
struct KvShape {
  DType dtype = DType::kF16;
  int32_t num_q_heads = 0;   // Hq, a multiple of num_kv_heads
  int32_t num_kv_heads = 0;  // Hkv
  int32_t head_dim = 0;      // d, elements
  int32_t page_size = 0;     // p, tokens per page (and per working-set slot)
};

// The shape of a model's KV cache: every KvShape field from the geometry.
inline KvShape KvShapeOf(const Geometry& g) {
  return KvShape{g.dtype, g.num_q_heads, g.num_kv_heads, g.head_dim, g.page_size};
}

// A working set in backend memory: NHD K and V caches of num_slots slots of p tokens, with
// the per-KV-head slot tables and the partial page attention reads. Ops that batch sequences (SparseAttention, Replace) take num_slots = S per sequence,
// global slot b·S + s; the others address global slots and take the whole cache as one
// sequence, num_slots = B·S. Each op says which fields it reads and which it writes; the
// pointers are mutable because some op writes each of them.
struct PagedKv {
  void* k_cache = nullptr;  // [num_slots][p][Hkv][d]
  void* v_cache = nullptr;
  int32_t num_slots = 0;
  int32_t* slot_table = nullptr;          // [B][Hkv][S] → logical page, or kEmptySlot
  const int32_t* partial_page = nullptr;  // [B] logical page being filled, or -1 for none
  const int32_t* partial_len = nullptr;   // [B] tokens in it, in [0, p]
};

// Page scores (Quest): score[b][hq][page] = Σ_i max(q_i·hi_i, q_i·lo_i), then pooled per
// KV head: pooled[b][h][page] = the mean over the query group of softmax over the pages
// [0, num_pages[b]) of softmax_scale · score. Pages at or beyond num_pages[b] score -inf in
// `pooled` (and `scores`).
// With key codes (SummaryMode::kKeyCodes; `codes` non-null) a page scores by its decoded
// keys k̂_t = lo + (code[t] + 0.5)·(hi − lo)/16 instead (hi/lo: its bounds): score =
// log Σ_t exp(softmax_scale·q·k̂_t) / softmax_scale over its page_size keys, so that the
// softmax over pages gives each page its decoded keys' share of the attention (a page with
// one key the query matches ranks high; its mean does not hide it). softmax_scale > 0.
// Reads shape.dtype, num_q_heads, num_kv_heads, head_dim, and page_size with codes.
struct ScorePagesArgs {
  KvShape shape{};
  int32_t batch = 0;
  int32_t max_pages = 0;          // P: per-sequence stride of summaries and scores
  const void* q = nullptr;        // [B][Hq][d]
  const void* summaries = nullptr;  // [B][P][Hkv][2][d] (SummaryLayout per sequence)
  const int32_t* num_pages = nullptr;  // [B], each in [0, P]
  float softmax_scale = 1.0f;     // multiplies scores inside the softmax pooling
  float* scores = nullptr;        // [B][Hq][P] raw scores out; optional (may be null)
  float* pooled = nullptr;        // [B][Hkv][P] out
  // [B][Hkv]: only KV heads with a nonzero entry (and their query groups) are scored; the
  // outputs of the others are left untouched. Null scores every head. This is how
  // correction re-selects just the drifted heads with no host round trip.
  const uint8_t* head_mask = nullptr;
  // [B][P] pages of KeyCodeLayout bytes (per-sequence stride P pages), as Offload wrote them
  // with SummaryMode::kKeyCodes; null: the bound score above. REQUIRES head_dim even.
  const uint8_t* codes = nullptr;
};

// Top-k pages per (sequence, KV head) among candidates: pages in
// [sink_pages, num_pages[b] - recent_pages). Output best first; ties go to the lower page
// index, and NaN ranks below every number, so the result is deterministic. Fewer than k
// candidates pad with kEmptySlot (-1). Reads shape.num_kv_heads.
struct TopKArgs {
  KvShape shape{};
  int32_t batch = 0;
  int32_t max_pages = 0;               // P
  int32_t k = 0;
  const float* pooled = nullptr;       // [B][Hkv][P]
  const int32_t* num_pages = nullptr;  // [B]
  int32_t sink_pages = 0;
  int32_t recent_pages = 0;
  int32_t* selected = nullptr;         // [B][Hkv][k] out
  const uint8_t* head_mask = nullptr;  // [B][Hkv]; as ScorePagesArgs::head_mask
  // [B][Hkv]: per-head budget k_h in [0, k] (policies, offload/policy/policy.h); entries
  // [k_h, k) of the output are kEmptySlot. Null: k for every head. A value outside [0, k]
  // fails the stream with OUT_OF_RANGE.
  const int32_t* head_k = nullptr;
  // [B][Hkv][P]: kPagePinned candidates rank ahead of every other candidate (by score among
  // themselves); kPageExcluded pages are never candidates (dropped from the host tier).
  // Null: every page is kPageNormal.
  const uint8_t* page_flags = nullptr;
};

inline constexpr uint8_t kPageNormal = 0;
inline constexpr uint8_t kPagePinned = 1;
inline constexpr uint8_t kPageExcluded = 2;

// Cosine of q_t and q_{t-1} per query head, its mean over each KV head's query group, and
// drift flags (group mean < threshold). A zero vector has cosine 0 with anything, so a
// missing previous query always counts as drift. Reads shape.dtype, num_q_heads,
// num_kv_heads, head_dim.
struct QueryCosineArgs {
  KvShape shape{};
  int32_t batch = 0;
  const void* q = nullptr;       // [B][Hq][d]
  const void* q_prev = nullptr;  // [B][Hq][d]
  float threshold = 0.9f;        // τ
  float* cosine = nullptr;       // [B][Hq] out; optional
  float* group_mean = nullptr;   // [B][Hkv] out
  uint8_t* drifted = nullptr;    // [B][Hkv] out, 1 where group_mean < τ; optional
};

// How much of a KV head's estimated attention mass its current (stale) selection loses
// against a fresh one (the mass correction trigger, CorrectionTrigger::kMass): per (sequence,
// KV head), with w(page) the page's weight,
//   loss = (Σ_{fresh} w − Σ_{current} w) / Σ_{fresh} w, clamped to [0, 1] (0 unless
//   Σ_{fresh} w > 0, and 0 for a NaN ratio), drifted = loss > threshold.
// The sums run over the pages of the two selections, kEmptySlot entries ignored; the numerator
// is computed as Σ over pages only in `fresh` minus Σ over pages only in `current`, so two
// selections of the same pages (in any order) lose exactly 0. Weights: the pooled scores,
// probabilities over pages (ScorePages' pooling), w = pooled; a NaN weight counts as 0. An
// entry outside [0, max_pages) other than kEmptySlot fails the stream with OUT_OF_RANGE.
// Reads shape.num_kv_heads.
struct SelectionLossArgs {
  KvShape shape{};
  int32_t batch = 0;
  int32_t max_pages = 0;                   // P
  int32_t k = 0;                           // entries per (sequence, KV head) of both selections
  const float* pooled = nullptr;           // [B][Hkv][P], as ScorePages wrote them
  const int32_t* current = nullptr;        // [B][Hkv][k] the selection attention would read
  const int32_t* fresh = nullptr;          // [B][Hkv][k] TopK's selection with q_t
  float threshold = 0.05f;                 // correction_max_loss
  float* loss = nullptr;                   // [B][Hkv] out
  uint8_t* drifted = nullptr;              // [B][Hkv] out, 1 where loss > threshold; optional
};

// One head-page to recall: the K+V slab of `kv_head` in host page `host_page`, written to
// NHD global slot `dst_slot` (b·S + slot) for that head. An item whose host_page is
// kSkipItem does nothing: fixed-size plans made on the device pad with it.
inline constexpr int64_t kSkipItem = -1;
struct RecallItem {
  int64_t host_page;
  int32_t kv_head;
  int32_t dst_slot;
};

// Recall transform: gathers head-page slabs from HND host pages into the NHD working set.
// Bit-exact. Host page i starts at host_pages + i·(Hkv·2·p·d) elements. Reads
// shape.dtype, num_kv_heads, head_dim, page_size; writes kv.k_cache and kv.v_cache (B·S
// global slots in kv.num_slots, for range checks).
struct RecallArgs {
  KvShape shape{};
  PagedKv kv{};
  const void* host_pages = nullptr;  // HND pages (the host arena's page area)
  int64_t num_host_pages = 0;        // for range checks
  const RecallItem* items = nullptr;
  int32_t num_items = 0;
};

// Recall split in two halves, for a streaming recall that overlaps the host→device copy
// of chunk n+1 with the transform of chunk n (double-buffered staging, ordered by
// events): GatherSlabs then ScatterSlabs over the same items equals Recall, bit for bit,
// and so does running both over consecutive chunks of the items. Staging holds one K+V
// slab per item, [num_items][2][p][d] elements: slab j is HostPageLayout{1, p, d} page j.
//
// GatherSlabs: staging slab j = the contiguous K+V slab of items[j].kv_head in host page
// items[j].host_page (HostPageLayout offset of (kv_head, 0, 0, 0)), bit-exact. A skip
// item leaves its slab untouched; dst_slot is not read. Reads shape.dtype, num_kv_heads,
// head_dim, page_size.
struct GatherSlabsArgs {
  KvShape shape{};
  const void* host_pages = nullptr;  // HND pages (the host arena's page area)
  int64_t num_host_pages = 0;        // for range checks
  const RecallItem* items = nullptr;
  int32_t num_items = 0;
  void* staging = nullptr;           // [num_items][2][p][d] out
};

// ScatterSlabs: staging slab j (HND [2][p][d]) → NHD global slot items[j].dst_slot, head
// items[j].kv_head of the working set, bit-exact. A skip item does nothing; host_page is
// read only to recognise skips. Reads the shape as GatherSlabs; writes kv.k_cache and
// kv.v_cache as Recall.
struct ScatterSlabsArgs {
  KvShape shape{};
  PagedKv kv{};
  const void* staging = nullptr;     // [num_items][2][p][d], as GatherSlabs wrote it
  const RecallItem* items = nullptr;
  int32_t num_items = 0;
};

// Page-cache replacement in the selected region [region_begin, region_begin + k) of each
// (sequence, KV head)'s slots (ArkVale, FreeKV), for heads whose mask is nonzero (all when
// head_mask is null). Pages of the new selection that are already resident keep their
// slots; every other page of the region is evicted (the new selection is the top-k, so
// what leaves is exactly the lower-scoring rest); missing pages take the freed slots in
// rank order, lowest slot first, and get one recall item each. Recall traffic is
// therefore the churn of the selection, not the budget. Writes the slot table in place
// and exactly k items per (sequence, KV head), padded with kSkipItem (all skip for
// unmasked heads), so the plan never has to come back to the host. Reads
// shape.num_kv_heads and kv.num_slots (S per sequence); reads and writes kv.slot_table (only
// the region changes).
struct ReplaceArgs {
  KvShape shape{};
  PagedKv kv{};
  int32_t batch = 0;
  int32_t region_begin = 0;              // first slot of the selected region
  int32_t k = 0;                         // region size = TopK's k
  const int32_t* selected = nullptr;     // [B][Hkv][k] from TopK: best first, -1 padded
  const int64_t* host_page_of = nullptr; // [B][max_pages]: logical page → host page, or -1
  int32_t max_pages = 0;
  const uint8_t* head_mask = nullptr;    // [B][Hkv]; null = every head
  RecallItem* items = nullptr;           // [B][Hkv][k] out
  int32_t* num_misses = nullptr;         // [B][Hkv] out: pages to recall; optional
};

// One full page to offload: NHD global slot `src_slot` of the source K/V buffers → host
// page `host_page` (HND) and summary page `summary_page`.
struct OffloadItem {
  int64_t src_slot;
  int64_t host_page;
  int64_t summary_page;
};

// Offload: NHD → HND transpose into host pages (bit-exact) plus key summaries per
// (page, KV head). Only full pages are offloaded. Reads shape.dtype, num_kv_heads, head_dim,
// page_size.
struct OffloadArgs {
  KvShape shape{};
  SummaryMode summary = SummaryMode::kMinMax;
  const void* k_src = nullptr;  // [num_src_slots][p][Hkv][d]
  const void* v_src = nullptr;
  int64_t num_src_slots = 0;
  void* host_pages = nullptr;   // HND pages
  int64_t num_host_pages = 0;
  void* summaries = nullptr;    // [num_summary_pages][Hkv][2][d]
  int64_t num_summary_pages = 0;
  // kKeyCodes: the keys' 4-bit codes, [num_summary_pages] pages of KeyCodeLayout bytes
  // (summary_page indexes them too), each code floor((k − lo)/step) clamped to [0, 15] with
  // hi/lo as stored (rounded to the dtype) and step = (hi − lo)/16; a dimension whose keys
  // are all equal codes 0. Required with kKeyCodes (head_dim even), ignored otherwise.
  uint8_t* codes = nullptr;
  const OffloadItem* items = nullptr;
  int32_t num_items = 0;
};

// Sparse paged decode attention over a working set with per-KV-head slot tables (GQA).
// Query head hq of sequence b attends over every token of every slot s whose table entry
// kv.slot_table[b][hq / G][s] is a page (≥ 0); such a slot holds page_size tokens, except
// the one holding kv.partial_page[b], which holds kv.partial_len[b]. fp32 accumulation and
// online softmax; output in shape.dtype. A head with no tokens outputs zeros and lse = -inf.
// Reads every shape field, and of the working set ([B][S][p][Hkv][d], kv.num_slots = S per
// sequence) the caches, the slot tables and the partial page.
// K and V caches of SparseAttention must be aligned to this many bytes (ValidateArgs refuses
// others with INVALID_ARGUMENT on every backend).
inline constexpr size_t kAttentionAlignment = 16;
struct SparseAttentionArgs {
  KvShape shape{};
  PagedKv kv{};
  int32_t batch = 0;
  const void* q = nullptr;                // [B][Hq][d]
  float softmax_scale = 1.0f;
  void* out = nullptr;                    // [B][Hq][d]
  float* lse = nullptr;                   // [B][Hq] natural log-sum-exp; optional
  // Causal limit: token t of logical page P has position P·page_size + t; tokens whose
  // position exceeds query_position[b] are not attended. Null: every token is attended.
  const int64_t* query_position = nullptr;  // [B]
  // Optional out: the softmax probability of every token, [B][Hq][S][p]; 0 for tokens not
  // attended (empty slots, beyond partial_len, masked). Policies read it (offload/policy).
  float* token_prob = nullptr;
  // Backend memory the op may use as scratch (split-KV partials, softmax statistics), at
  // least Backend::SparseAttentionWorkspaceBytes(*this) bytes, touched by no other work in
  // flight. Null (or too small): a backend that needs scratch uses its own per-stream buffer,
  // allocated on first use and on growth — a blocking allocation (kernels/host_calls.h), so
  // the decode path always passes one.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Moves one KV head's part of a slot to another slot (compaction in drop mode): K and V of
// head `kv_head`, all p tokens, from src_slot to dst_slot, bit-exact. Items run in order;
// src and dst of one item may not be equal. Reads shape.dtype, num_kv_heads, head_dim and
// page_size; reads and writes kv.k_cache and kv.v_cache (kv.num_slots global slots).
struct HeadSlotMove {
  int32_t kv_head;
  int32_t src_slot;
  int32_t dst_slot;
};
struct MoveHeadSlotsArgs {
  KvShape shape{};
  PagedKv kv{};
  const HeadSlotMove* items = nullptr;
  int32_t num_items = 0;
};

// Dense decode attention over contiguous NHD KV [B][T][Hkv][d] with seq_len[b] ≤ T tokens.
// The accuracy reference for sparse attention. Reads shape.dtype, num_q_heads, num_kv_heads,
// head_dim.
struct DenseAttentionArgs {
  KvShape shape{};
  int32_t batch = 0;
  int32_t max_tokens = 0;            // T
  const void* q = nullptr;           // [B][Hq][d]
  const void* k = nullptr;           // [B][T][Hkv][d]
  const void* v = nullptr;
  const int32_t* seq_len = nullptr;  // [B]
  float softmax_scale = 1.0f;
  void* out = nullptr;               // [B][Hq][d]
  float* lse = nullptr;              // [B][Hq]; optional
};

// Shape validation shared by every backend: OK, or INVALID_ARGUMENT naming the field.
absl::Status ValidateArgs(const ScorePagesArgs& a);
absl::Status ValidateArgs(const TopKArgs& a);
absl::Status ValidateArgs(const QueryCosineArgs& a);
absl::Status ValidateArgs(const SelectionLossArgs& a);
absl::Status ValidateArgs(const RecallArgs& a);
absl::Status ValidateArgs(const GatherSlabsArgs& a);
absl::Status ValidateArgs(const ScatterSlabsArgs& a);
absl::Status ValidateArgs(const ReplaceArgs& a);
absl::Status ValidateArgs(const OffloadArgs& a);
absl::Status ValidateArgs(const SparseAttentionArgs& a);
absl::Status ValidateArgs(const DenseAttentionArgs& a);
absl::Status ValidateArgs(const MoveHeadSlotsArgs& a);

}  // namespace kvtier

#endif  // KVTIER_KERNELS_OPS_H_
