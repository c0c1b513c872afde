#include "kernels/ops.h"

#include <cmath>
#include <initializer_list>
#include <string>

#include "absl/strings/str_format.h"
#include "kvtier/geometry.h"
#include "core/status.h"

namespace kvtier {
namespace {

// Validation helpers: each returns INVALID_ARGUMENT naming `op.field` and the rule.
absl::Status CheckRange(const char* op, const char* field, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s = %d must be in [%d, %d]", op, field, v, lo, hi));
  }
  return absl::OkStatus();
}

absl::Status CheckPtr(const char* op, const char* field, const void* p) {
  if (p == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: %s must not be null", op, field));
  }
  return absl::OkStatus();
}

absl::Status CheckDType(const char* op, DType t) {
  switch (t) {
    case DType::kF16:
    case DType::kBF16:
    case DType::kF32:
      return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrFormat("%s: unknown shape.dtype %d", op, static_cast<int>(t)));
}

struct NamedPtr {
  const char* field;
  const void* p;
};
struct NamedRange {
  const char* field;
  int64_t v, lo, hi;  // the field's value and its inclusive range
};

// CheckPtr, CheckRange of each field in turn: the first failure.
absl::Status CheckPtrs(const char* op, std::initializer_list<NamedPtr> fields) {
  for (const NamedPtr& f : fields) KVTIER_RETURN_IF_ERROR(CheckPtr(op, f.field, f.p));
  return absl::OkStatus();
}
absl::Status CheckRanges(const char* op, std::initializer_list<NamedRange> fields) {
  for (const NamedRange& f : fields) {
    KVTIER_RETURN_IF_ERROR(CheckRange(op, f.field, f.v, f.lo, f.hi));
  }
  return absl::OkStatus();
}

constexpr int32_t kMaxBatch = 1 << 16;
constexpr int32_t kMaxPages = 1 << 24;  // 512M tokens at p = 32

// The KvShape fields an op reads besides num_kv_heads, which every op reads.
enum ShapeField : unsigned {
  kDType = 1u << 0,
  kQueryHeads = 1u << 1,  // num_q_heads; then num_kv_heads must divide it
  kHeadDim = 1u << 2,
  kPageSize = 1u << 3,
};
constexpr unsigned kHeadShape = kDType | kQueryHeads | kHeadDim;  // per-query-head ops
constexpr unsigned kPageShape = kDType | kHeadDim | kPageSize;    // slab and slot ops

// The one check of an op's KvShape: the fields in `needs`, and num_kv_heads.
absl::Status ValidateShape(const char* op, const KvShape& s, unsigned needs) {
  if ((needs & kDType) != 0) KVTIER_RETURN_IF_ERROR(CheckDType(op, s.dtype));
  if ((needs & kQueryHeads) != 0) {
    KVTIER_RETURN_IF_ERROR(
        CheckRange(op, "shape.num_q_heads", s.num_q_heads, 1, Geometry::kMaxQueryHeads));
    KVTIER_RETURN_IF_ERROR(CheckRange(op, "shape.num_kv_heads", s.num_kv_heads, 1, s.num_q_heads));
    if (s.num_q_heads % s.num_kv_heads != 0 ||
        s.num_q_heads / s.num_kv_heads > Geometry::kMaxGroupSize) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: shape.num_q_heads = %d must be a multiple of shape.num_kv_heads = "
                          "%d with at most %d per group",
                          op, s.num_q_heads, s.num_kv_heads, Geometry::kMaxGroupSize));
    }
  } else {
    KVTIER_RETURN_IF_ERROR(
        CheckRange(op, "shape.num_kv_heads", s.num_kv_heads, 1, Geometry::kMaxQueryHeads));
  }
  if ((needs & kHeadDim) != 0) {
    KVTIER_RETURN_IF_ERROR(CheckRange(op, "shape.head_dim", s.head_dim, 1, Geometry::kMaxHeadDim));
  }
  if ((needs & kPageSize) != 0) {
    KVTIER_RETURN_IF_ERROR(
        CheckRange(op, "shape.page_size", s.page_size, 1, Geometry::kMaxPageSize));
  }
  return absl::OkStatus();
}

// Key codes pack two dimensions a byte (KeyCodeLayout).
absl::Status CheckEvenHeadDim(const char* op, int32_t head_dim) {
  if (head_dim % 2 == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s: shape.head_dim = %d must be even with key codes (two 4-bit codes a byte)", op,
      head_dim));
}

// The PagedKv fields an op reads besides num_slots, which every op that takes one reads.
enum WorkingSetField : unsigned {
  kCaches = 1u << 0,  // k_cache, v_cache
  kSlotTable = 1u << 1,
  kPartialPage = 1u << 2,  // partial_page, partial_len
};

// The one check of an op's PagedKv: num_slots in [1, max_slots] and the fields in `needs`.
absl::Status ValidateWorkingSet(const char* op, const PagedKv& kv, int64_t max_slots,
                                unsigned needs) {
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "kv.num_slots", kv.num_slots, 1, max_slots));
  if ((needs & kCaches) != 0) {
    KVTIER_RETURN_IF_ERROR(CheckPtrs(op, {{"kv.k_cache", kv.k_cache}, {"kv.v_cache", kv.v_cache}}));
  }
  if ((needs & kSlotTable) != 0) {
    KVTIER_RETURN_IF_ERROR(CheckPtr(op, "kv.slot_table", kv.slot_table));
  }
  if ((needs & kPartialPage) != 0) {
    KVTIER_RETURN_IF_ERROR(
        CheckPtrs(op, {{"kv.partial_page", kv.partial_page}, {"kv.partial_len", kv.partial_len}}));
  }
  return absl::OkStatus();
}

}  // namespace

// Each op checks its shape, then (ops of items) the item count, for zero items nothing else,
// then its working set, then its own fields.

absl::Status ValidateArgs(const ScorePagesArgs& a) {
  constexpr const char* op = "ScorePages";
  KVTIER_RETURN_IF_ERROR(ValidateShape(op, a.shape, a.codes != nullptr ? kHeadShape | kPageSize : kHeadShape));
  KVTIER_RETURN_IF_ERROR(CheckRanges(
      op, {{"batch", a.batch, 1, kMaxBatch}, {"max_pages", a.max_pages, 1, kMaxPages}}));
  if (a.codes != nullptr) {
    KVTIER_RETURN_IF_ERROR(CheckEvenHeadDim(op, a.shape.head_dim));
    if (!(a.softmax_scale > 0.0f) || !std::isfinite(a.softmax_scale)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "ScorePages: softmax_scale = %g must be positive and finite with key codes (a "
          "page's score is its keys' log-sum-exp)",
          a.softmax_scale));
    }
  }
  return CheckPtrs(
      op,
      {{"q", a.q}, {"summaries", a.summaries}, {"num_pages", a.num_pages}, {"pooled", a.pooled}});
}

absl::Status ValidateArgs(const TopKArgs& a) {
  constexpr const char* op = "TopK";
  KVTIER_RETURN_IF_ERROR(ValidateShape(op, a.shape, 0));
  KVTIER_RETURN_IF_ERROR(CheckRanges(op, {{"batch", a.batch, 1, kMaxBatch},
                                          {"max_pages", a.max_pages, 1, kMaxPages},
                                          {"k", a.k, 1, a.max_pages},
                                          {"sink_pages", a.sink_pages, 0, kMaxPages},
                                          {"recent_pages", a.recent_pages, 0, kMaxPages}}));
  return CheckPtrs(op,
                   {{"pooled", a.pooled}, {"num_pages", a.num_pages}, {"selected", a.selected}});
}

absl::Status ValidateArgs(const QueryCosineArgs& a) {
  constexpr const char* op = "QueryCosine";
  KVTIER_RETURN_IF_ERROR(ValidateShape(op, a.shape, kHeadShape));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "batch", a.batch, 1, kMaxBatch));
  return CheckPtrs(op, {{"q", a.q}, {"q_prev", a.q_prev}, {"group_mean", a.group_mean}});
}

absl::Status ValidateArgs(const SelectionLossArgs& a) {
  constexpr const char* op = "SelectionLoss";
  KVTIER_RETURN_IF_ERROR(ValidateShape(op, a.shape, 0));
  KVTIER_RETURN_IF_ERROR(CheckRanges(op, {{"batch", a.batch, 1, kMaxBatch},
                                          {"max_pages", a.max_pages, 1, kMaxPages},
                                          {"k", a.k, 1, a.max_pages}}));
  if (!(a.threshold == a.threshold)) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: threshold is NaN", op));
  }
  return CheckPtrs(
      op, {{"pooled", a.pooled}, {"current", a.current}, {"fresh", a.fresh}, {"loss", a.loss}});
}

absl::Status ValidateArgs(const RecallArgs& a) {
  constexpr const char* op = "Recall";
  KVTIER_RETURN_IF_ERROR(ValidateShape(op, a.shape, kPageShape));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_items", a.num_items, 0, INT32_MAX));
  if (a.num_items == 0) return absl::OkStatus();
  KVTIER_RETURN_IF_ERROR(ValidateWorkingSet(op, a.kv, INT32_MAX, kCaches));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_host_pages", a.num_host_pages, 1, INT64_MAX));
  return CheckPtrs(op, {{"host_pages", a.host_pages}, {"items", a.items}});
}

absl::Status ValidateArgs(const GatherSlabsArgs& a) {
  constexpr const char* op = "GatherSlabs";
  KVTIER_RETURN_IF_ERROR(ValidateShape(op, a.shape, kPageShape));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_items", a.num_items, 0, INT32_MAX));
  if (a.num_items == 0) return absl::OkStatus();
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_host_pages", a.num_host_pages, 1, INT64_MAX));
  return CheckPtrs(op, {{"host_pages", a.host_pages}, {"items", a.items}, {"staging", a.staging}});
}

absl::Status ValidateArgs(const ScatterSlabsArgs& a) {
  constexpr const char* op = "ScatterSlabs";
  KVTIER_RETURN_IF_ERROR(ValidateShape(op, a.shape, kPageShape));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_items", a.num_items, 0, INT32_MAX));
  if (a.num_items == 0) return absl::OkStatus();
  KVTIER_RETURN_IF_ERROR(ValidateWorkingSet(op, a.kv, INT32_MAX, kCaches));
  return CheckPtrs(op, {{"staging", a.staging}, {"items", a.items}});
}

absl::Status ValidateArgs(const ReplaceArgs& a) {
  constexpr const char* op = "Replace";
  KVTIER_RETURN_IF_ERROR(ValidateShape(op, a.shape, 0));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "batch", a.batch, 1, kMaxBatch));
  KVTIER_RETURN_IF_ERROR(ValidateWorkingSet(op, a.kv, kMaxPages, kSlotTable));
  KVTIER_RETURN_IF_ERROR(CheckRanges(op, {{"k", a.k, 1, a.kv.num_slots},
                                          {"region_begin", a.region_begin, 0, a.kv.num_slots - a.k},
                                          {"max_pages", a.max_pages, 1, kMaxPages}}));
  return CheckPtrs(
      op, {{"selected", a.selected}, {"host_page_of", a.host_page_of}, {"items", a.items}});
}

absl::Status ValidateArgs(const OffloadArgs& a) {
  constexpr const char* op = "Offload";
  KVTIER_RETURN_IF_ERROR(ValidateShape(op, a.shape, kPageShape));
  if (a.summary != SummaryMode::kMinMax && a.summary != SummaryMode::kCenterMad &&
      a.summary != SummaryMode::kKeyCodes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Offload: summary = %d: must be minmax (0), center-mad (1) or key-codes (2)",
        static_cast<int>(a.summary)));
  }
  if (a.summary == SummaryMode::kKeyCodes) {
    KVTIER_RETURN_IF_ERROR(CheckEvenHeadDim(op, a.shape.head_dim));
  }
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_items", a.num_items, 0, INT32_MAX));
  if (a.num_items == 0) return absl::OkStatus();
  KVTIER_RETURN_IF_ERROR(
      CheckRanges(op, {{"num_src_slots", a.num_src_slots, 1, INT64_MAX},
                       {"num_host_pages", a.num_host_pages, 1, INT64_MAX},
                       {"num_summary_pages", a.num_summary_pages, 1, INT64_MAX}}));
  KVTIER_RETURN_IF_ERROR(CheckPtrs(op, {{"k_src", a.k_src},
                        {"v_src", a.v_src},
                        {"host_pages", a.host_pages},
                        {"summaries", a.summaries},
                        {"items", a.items}}));
  if (a.summary == SummaryMode::kKeyCodes) return CheckPtrs(op, {{"codes", a.codes}});
  return absl::OkStatus();
}

// query_position, token_prob and lse may be null.
absl::Status ValidateArgs(const SparseAttentionArgs& a) {
  constexpr const char* op = "SparseAttention";
  KVTIER_RETURN_IF_ERROR(ValidateShape(op, a.shape, kHeadShape | kPageSize));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "batch", a.batch, 1, kMaxBatch));
  KVTIER_RETURN_IF_ERROR(
      ValidateWorkingSet(op, a.kv, kMaxPages, kCaches | kSlotTable | kPartialPage));
  KVTIER_RETURN_IF_ERROR(CheckPtrs(op, {{"q", a.q}, {"out", a.out}}));
  // The alignment contract of every backend: K/V rows are read as 16-byte vectors (head_dim
  // is a multiple of 8 elements, so every row of an aligned cache is aligned). A misaligned
  // view is refused, never read slowly.
  for (const auto& [name, ptr] : {std::pair<const char*, const void*>{"kv.k_cache", a.kv.k_cache},
                                  {"kv.v_cache", a.kv.v_cache}}) {
    if (reinterpret_cast<uintptr_t>(ptr) % kAttentionAlignment != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %s (%p) must be %d-byte aligned (K/V rows are read as %d-byte vectors)", op, name,
          ptr, kAttentionAlignment, kAttentionAlignment));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateArgs(const DenseAttentionArgs& a) {
  constexpr const char* op = "DenseAttention";
  KVTIER_RETURN_IF_ERROR(ValidateShape(op, a.shape, kHeadShape));
  KVTIER_RETURN_IF_ERROR(CheckRanges(
      op, {{"batch", a.batch, 1, kMaxBatch}, {"max_tokens", a.max_tokens, 1, INT32_MAX}}));
  return CheckPtrs(op,
                   {{"q", a.q}, {"k", a.k}, {"v", a.v}, {"seq_len", a.seq_len}, {"out", a.out}});
}

// Items live in backend memory, so src_slot == dst_slot is found when the op runs.
absl::Status ValidateArgs(const MoveHeadSlotsArgs& a) {
  constexpr const char* op = "MoveHeadSlots";
  KVTIER_RETURN_IF_ERROR(ValidateShape(op, a.shape, kPageShape));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_items", a.num_items, 0, INT32_MAX));
  if (a.num_items == 0) return absl::OkStatus();
  KVTIER_RETURN_IF_ERROR(ValidateWorkingSet(op, a.kv, INT32_MAX, kCaches));
  return CheckPtr(op, "items", a.items);
}

}  // namespace kvtier
