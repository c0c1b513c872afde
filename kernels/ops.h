// Arguments of the backend's compute ops (docs/architecture.md#the-decode-step, docs/architecture.md#backends). Kernels are framework-free:
// raw pointers into backend memory, sizes, and the layouts of kvtier/layout.h. Ops never
// allocate; callers own every buffer. The structs carry no CUDA types, so the CPU reference
// and the CUDA kernels take the same arguments.
//
// Shape checks (positive sizes, GQA divisibility, non-null required pointers) happen when an
// op is enqueued: ValidateArgs below, called by Backend. Data-dependent checks (an index in
// a device array out of range) happen when the op runs, and fail the stream.
#ifndef KVTIER_KERNELS_OPS_H_
#define KVTIER_KERNELS_OPS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kvtier/dtype.h"
#include "kvtier/options.h"

namespace kvtier {

// Page scores (Quest): score[b][hq][page] = Σ_i max(q_i·hi_i, q_i·lo_i), then pooled per
// KV head. Pages at or beyond num_pages[b] score -inf in `pooled` (and `scores`).
struct ScorePagesArgs {
  DType dtype = DType::kF16;
  int32_t batch = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t max_pages = 0;          // P: per-sequence stride of summaries and scores
  const void* q = nullptr;        // [B][Hq][d]
  const void* summaries = nullptr;  // [B][P][Hkv][2][d] (SummaryLayout per sequence)
  const int32_t* num_pages = nullptr;  // [B], each in [0, P]
  float softmax_scale = 1.0f;     // multiplies scores inside the softmax pooling
  PoolMode pool = PoolMode::kSoftmaxMean;
  float* scores = nullptr;        // [B][Hq][P] raw scores out; optional (may be null)
  float* pooled = nullptr;        // [B][Hkv][P] out
  // [B][Hkv]: only KV heads with a nonzero entry (and their query groups) are scored; the
  // outputs of the others are left untouched. Null scores every head. This is how
  // correction re-selects just the drifted heads with no host round trip.
  const uint8_t* head_mask = nullptr;
};

// Top-k pages per (sequence, KV head) among candidates: pages in
// [sink_pages, num_pages[b] - recent_pages). Output best first; ties go to the lower page
// index, and NaN ranks below every number, so the result is deterministic. Fewer than k
// candidates pad with kEmptySlot (-1).
struct TopKArgs {
  int32_t batch = 0;
  int32_t num_kv_heads = 0;
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
// missing previous query always counts as drift.
struct QueryCosineArgs {
  DType dtype = DType::kF16;
  int32_t batch = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  const void* q = nullptr;       // [B][Hq][d]
  const void* q_prev = nullptr;  // [B][Hq][d]
  float threshold = 0.9f;        // τ
  float* cosine = nullptr;       // [B][Hq] out; optional
  float* group_mean = nullptr;   // [B][Hkv] out
  uint8_t* drifted = nullptr;    // [B][Hkv] out, 1 where group_mean < τ; optional
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
// Bit-exact. Host page i starts at host_pages + i·(Hkv·2·p·d) elements.
struct RecallArgs {
  DType dtype = DType::kF16;
  int32_t page_size = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  const void* host_pages = nullptr;  // HND pages (the host arena's page area)
  int64_t num_host_pages = 0;        // for range checks
  const RecallItem* items = nullptr;
  int32_t num_items = 0;
  void* k_cache = nullptr;           // [num_slots][p][Hkv][d]
  void* v_cache = nullptr;
  int32_t num_slots = 0;             // B·S, for range checks
};

// Recall split in two halves, for a streaming recall that overlaps the host→device copy
// of chunk n+1 with the transform of chunk n (double-buffered staging, ordered by
// events): GatherSlabs then ScatterSlabs over the same items equals Recall, bit for bit,
// and so does running both over consecutive chunks of the items. Staging holds one K+V
// slab per item, [num_items][2][p][d] elements: slab j is HostPageLayout{1, p, d} page j.
//
// GatherSlabs: staging slab j = the contiguous K+V slab of items[j].kv_head in host page
// items[j].host_page (HostPageLayout offset of (kv_head, 0, 0, 0)), bit-exact. A skip
// item leaves its slab untouched; dst_slot is not read.
struct GatherSlabsArgs {
  DType dtype = DType::kF16;
  int32_t page_size = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  const void* host_pages = nullptr;  // HND pages (the host arena's page area)
  int64_t num_host_pages = 0;        // for range checks
  const RecallItem* items = nullptr;
  int32_t num_items = 0;
  void* staging = nullptr;           // [num_items][2][p][d] out
};

// ScatterSlabs: staging slab j (HND [2][p][d]) → NHD global slot items[j].dst_slot, head
// items[j].kv_head of the working set, bit-exact. A skip item does nothing; host_page is
// read only to recognise skips.
struct ScatterSlabsArgs {
  DType dtype = DType::kF16;
  int32_t page_size = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  const void* staging = nullptr;     // [num_items][2][p][d], as GatherSlabs wrote it
  const RecallItem* items = nullptr;
  int32_t num_items = 0;
  void* k_cache = nullptr;           // [num_slots][p][Hkv][d]
  void* v_cache = nullptr;
  int32_t num_slots = 0;             // B·S, for range checks
};

// Page-cache replacement in the selected region [region_begin, region_begin + k) of each
// (sequence, KV head)'s slots (ArkVale, FreeKV), for heads whose mask is nonzero (all when
// head_mask is null). Pages of the new selection that are already resident keep their
// slots; every other page of the region is evicted (the new selection is the top-k, so
// what leaves is exactly the lower-scoring rest); missing pages take the freed slots in
// rank order, lowest slot first, and get one recall item each. Recall traffic is
// therefore the churn of the selection, not the budget. Writes the slot table in place
// and exactly k items per (sequence, KV head), padded with kSkipItem (all skip for
// unmasked heads), so the plan never has to come back to the host.
struct ReplaceArgs {
  int32_t batch = 0;
  int32_t num_kv_heads = 0;
  int32_t num_slots = 0;                 // S per sequence
  int32_t region_begin = 0;              // first slot of the selected region
  int32_t k = 0;                         // region size = TopK's k
  const int32_t* selected = nullptr;     // [B][Hkv][k] from TopK: best first, -1 padded
  int32_t* slot_table = nullptr;         // [B][Hkv][S] in/out (only the region changes)
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
// (page, KV head). Only full pages are offloaded.
struct OffloadArgs {
  DType dtype = DType::kF16;
  int32_t page_size = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  SummaryMode summary = SummaryMode::kMinMax;
  const void* k_src = nullptr;  // [num_src_slots][p][Hkv][d]
  const void* v_src = nullptr;
  int64_t num_src_slots = 0;
  void* host_pages = nullptr;   // HND pages
  int64_t num_host_pages = 0;
  void* summaries = nullptr;    // [num_summary_pages][Hkv][2][d]
  int64_t num_summary_pages = 0;
  const OffloadItem* items = nullptr;
  int32_t num_items = 0;
};

// Sparse paged decode attention over a working set with per-KV-head slot tables (GQA).
// Query head hq of sequence b attends over every token of every slot s whose table entry
// slot_table[b][hq / G][s] is a page (≥ 0); such a slot holds page_size tokens, except
// the one holding partial_page[b], which holds partial_len[b]. fp32 accumulation and
// online softmax; output in `dtype`. A head with no tokens outputs zeros and lse = -inf.
struct SparseAttentionArgs {
  DType dtype = DType::kF16;
  int32_t batch = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 0;
  int32_t num_slots = 0;                  // S per sequence
  const void* q = nullptr;                // [B][Hq][d]
  const void* k_cache = nullptr;          // [B][S][p][Hkv][d]
  const void* v_cache = nullptr;
  const int32_t* slot_table = nullptr;    // [B][Hkv][S]
  const int32_t* partial_page = nullptr;  // [B] logical page, or -1 for none
  const int32_t* partial_len = nullptr;   // [B] tokens in it, in [0, p]
  float softmax_scale = 1.0f;
  void* out = nullptr;                    // [B][Hq][d]
  float* lse = nullptr;                   // [B][Hq] natural log-sum-exp; optional
  // Causal limit: token t of logical page P has position P·page_size + t; tokens whose
  // position exceeds query_position[b] are not attended. Null: every token is attended.
  const int64_t* query_position = nullptr;  // [B]
  // Optional out: the softmax probability of every token, [B][Hq][S][p]; 0 for tokens not
  // attended (empty slots, beyond partial_len, masked). Policies read it (offload/policy).
  float* token_prob = nullptr;
  // Optional INT8 storage (Conf-KV): where slot_int8[b][h][s] is 1, head h's part of slot
  // s is read from k_int8/v_int8 (same NHD layout as the caches) times the per-channel
  // scale of that (slot, head): value = q · scale[b·S + s][h][dim] (QuantizeSlots writes
  // them). All four buffers and slot_int8 are given together or not at all.
  const uint8_t* slot_int8 = nullptr;  // [B][Hkv][S]
  const int8_t* k_int8 = nullptr;      // [B][S][p][Hkv][d]
  const int8_t* v_int8 = nullptr;
  const float* k_scale = nullptr;      // [B][S][Hkv][d]
  const float* v_scale = nullptr;
};

// One KV head's part of one working-set slot (global slot b·S + s).
struct HeadSlot {
  int32_t kv_head;
  int32_t slot;
};

// Symmetric INT8 quantisation of head-slots (Conf-KV): for each item, per channel c of K
// (and of V): scale[slot][h][c] = max over the page's p tokens of |x[t][h][c]| / 127 (fp32),
// q[t][h][c] = x / scale rounded to nearest (ties to even), clamped to [−127, 127]; a zero
// scale gives q = 0. So |x − q·scale| ≤ scale / 2 up to float rounding. The FP16/BF16/FP32
// caches are left as they are.
struct QuantizeSlotsArgs {
  DType dtype = DType::kF16;
  int32_t page_size = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  const HeadSlot* items = nullptr;
  int32_t num_items = 0;
  const void* k_cache = nullptr;  // [num_slots][p][Hkv][d]
  const void* v_cache = nullptr;
  int8_t* k_int8 = nullptr;       // [num_slots][p][Hkv][d] out
  int8_t* v_int8 = nullptr;
  float* k_scale = nullptr;       // [num_slots][Hkv][d] out
  float* v_scale = nullptr;
  int32_t num_slots = 0;          // for range checks
};

// Moves one KV head's part of a slot to another slot (compaction in drop mode): K and V of
// head `kv_head`, all p tokens, from src_slot to dst_slot, bit-exact; the INT8 copies and
// their scales too when those buffers are given. Items run in order; src and dst of one
// item may not be equal.
struct HeadSlotMove {
  int32_t kv_head;
  int32_t src_slot;
  int32_t dst_slot;
};
struct MoveHeadSlotsArgs {
  DType dtype = DType::kF16;
  int32_t page_size = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  const HeadSlotMove* items = nullptr;
  int32_t num_items = 0;
  void* k_cache = nullptr;  // [num_slots][p][Hkv][d]
  void* v_cache = nullptr;
  int8_t* k_int8 = nullptr;  // optional, with the scales
  int8_t* v_int8 = nullptr;
  float* k_scale = nullptr;
  float* v_scale = nullptr;
  int32_t num_slots = 0;
};

// Dense decode attention over contiguous NHD KV [B][T][Hkv][d] with seq_len[b] ≤ T tokens.
// The accuracy reference for sparse attention.
struct DenseAttentionArgs {
  DType dtype = DType::kF16;
  int32_t batch = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
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
absl::Status ValidateArgs(const RecallArgs& a);
absl::Status ValidateArgs(const GatherSlabsArgs& a);
absl::Status ValidateArgs(const ScatterSlabsArgs& a);
absl::Status ValidateArgs(const ReplaceArgs& a);
absl::Status ValidateArgs(const OffloadArgs& a);
absl::Status ValidateArgs(const SparseAttentionArgs& a);
absl::Status ValidateArgs(const DenseAttentionArgs& a);
absl::Status ValidateArgs(const QuantizeSlotsArgs& a);
absl::Status ValidateArgs(const MoveHeadSlotsArgs& a);

}  // namespace kvtier

#endif  // KVTIER_KERNELS_OPS_H_
