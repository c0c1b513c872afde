#include "kernels/ops.h"

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
  return absl::InvalidArgumentError(absl::StrFormat("%s: unknown dtype %d", op, static_cast<int>(t)));
}

absl::Status CheckHeads(const char* op, int32_t hq, int32_t hkv, int32_t d) {
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_q_heads", hq, 1, Geometry::kMaxQueryHeads));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_kv_heads", hkv, 1, hq));
  if (hq % hkv != 0 || hq / hkv > Geometry::kMaxGroupSize) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: num_q_heads = %d must be a multiple of num_kv_heads = %d with at most %d per group",
        op, hq, hkv, Geometry::kMaxGroupSize));
  }
  return CheckRange(op, "head_dim", d, 1, Geometry::kMaxHeadDim);
}

absl::Status CheckPage(const char* op, int32_t p, int32_t hkv, int32_t d) {
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "page_size", p, 1, Geometry::kMaxPageSize));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_kv_heads", hkv, 1, Geometry::kMaxQueryHeads));
  return CheckRange(op, "head_dim", d, 1, Geometry::kMaxHeadDim);
}

// INVALID_ARGUMENT unless the pointers of a group are all null or all non-null.
struct NamedPtr {
  const char* field;
  const void* p;
};
absl::Status CheckAllOrNone(const char* op, std::initializer_list<NamedPtr> group) {
  bool any = false, all = true;
  for (const NamedPtr& f : group) {
    any = any || f.p != nullptr;
    all = all && f.p != nullptr;
  }
  if (any == all) return absl::OkStatus();
  std::string names;
  const char* missing = "";
  for (const NamedPtr& f : group) {
    if (!names.empty()) names += ", ";
    names += f.field;
    if (f.p == nullptr && *missing == '\0') missing = f.field;
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s: %s must be given together or not at all (%s is null)", op, names, missing));
}

constexpr int32_t kMaxBatch = 1 << 16;
constexpr int32_t kMaxPages = 1 << 24;  // 512M tokens at p = 32

}  // namespace

absl::Status ValidateArgs(const ScorePagesArgs& a) {
  constexpr const char* op = "ScorePages";
  KVTIER_RETURN_IF_ERROR(CheckDType(op, a.dtype));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "batch", a.batch, 1, kMaxBatch));
  KVTIER_RETURN_IF_ERROR(CheckHeads(op, a.num_q_heads, a.num_kv_heads, a.head_dim));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "max_pages", a.max_pages, 1, kMaxPages));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "q", a.q));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "summaries", a.summaries));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "num_pages", a.num_pages));
  return CheckPtr(op, "pooled", a.pooled);
}

absl::Status ValidateArgs(const TopKArgs& a) {
  constexpr const char* op = "TopK";
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "batch", a.batch, 1, kMaxBatch));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_kv_heads", a.num_kv_heads, 1, Geometry::kMaxQueryHeads));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "max_pages", a.max_pages, 1, kMaxPages));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "k", a.k, 1, a.max_pages));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "sink_pages", a.sink_pages, 0, kMaxPages));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "recent_pages", a.recent_pages, 0, kMaxPages));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "pooled", a.pooled));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "num_pages", a.num_pages));
  return CheckPtr(op, "selected", a.selected);
}

absl::Status ValidateArgs(const QueryCosineArgs& a) {
  constexpr const char* op = "QueryCosine";
  KVTIER_RETURN_IF_ERROR(CheckDType(op, a.dtype));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "batch", a.batch, 1, kMaxBatch));
  KVTIER_RETURN_IF_ERROR(CheckHeads(op, a.num_q_heads, a.num_kv_heads, a.head_dim));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "q", a.q));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "q_prev", a.q_prev));
  return CheckPtr(op, "group_mean", a.group_mean);
}

absl::Status ValidateArgs(const RecallArgs& a) {
  constexpr const char* op = "Recall";
  KVTIER_RETURN_IF_ERROR(CheckDType(op, a.dtype));
  KVTIER_RETURN_IF_ERROR(CheckPage(op, a.page_size, a.num_kv_heads, a.head_dim));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_items", a.num_items, 0, INT32_MAX));
  if (a.num_items == 0) return absl::OkStatus();
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_host_pages", a.num_host_pages, 1, INT64_MAX));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_slots", a.num_slots, 1, INT32_MAX));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "host_pages", a.host_pages));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "items", a.items));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "k_cache", a.k_cache));
  return CheckPtr(op, "v_cache", a.v_cache);
}

absl::Status ValidateArgs(const GatherSlabsArgs& a) {
  constexpr const char* op = "GatherSlabs";
  KVTIER_RETURN_IF_ERROR(CheckDType(op, a.dtype));
  KVTIER_RETURN_IF_ERROR(CheckPage(op, a.page_size, a.num_kv_heads, a.head_dim));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_items", a.num_items, 0, INT32_MAX));
  if (a.num_items == 0) return absl::OkStatus();
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_host_pages", a.num_host_pages, 1, INT64_MAX));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "host_pages", a.host_pages));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "items", a.items));
  return CheckPtr(op, "staging", a.staging);
}

absl::Status ValidateArgs(const ScatterSlabsArgs& a) {
  constexpr const char* op = "ScatterSlabs";
  KVTIER_RETURN_IF_ERROR(CheckDType(op, a.dtype));
  KVTIER_RETURN_IF_ERROR(CheckPage(op, a.page_size, a.num_kv_heads, a.head_dim));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_items", a.num_items, 0, INT32_MAX));
  if (a.num_items == 0) return absl::OkStatus();
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_slots", a.num_slots, 1, INT32_MAX));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "staging", a.staging));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "items", a.items));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "k_cache", a.k_cache));
  return CheckPtr(op, "v_cache", a.v_cache);
}

absl::Status ValidateArgs(const ReplaceArgs& a) {
  constexpr const char* op = "Replace";
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "batch", a.batch, 1, kMaxBatch));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_kv_heads", a.num_kv_heads, 1, Geometry::kMaxQueryHeads));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_slots", a.num_slots, 1, kMaxPages));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "k", a.k, 1, a.num_slots));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "region_begin", a.region_begin, 0, a.num_slots - a.k));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "max_pages", a.max_pages, 1, kMaxPages));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "selected", a.selected));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "slot_table", a.slot_table));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "host_page_of", a.host_page_of));
  return CheckPtr(op, "items", a.items);
}

absl::Status ValidateArgs(const OffloadArgs& a) {
  constexpr const char* op = "Offload";
  KVTIER_RETURN_IF_ERROR(CheckDType(op, a.dtype));
  KVTIER_RETURN_IF_ERROR(CheckPage(op, a.page_size, a.num_kv_heads, a.head_dim));
  if (a.summary != SummaryMode::kMinMax && a.summary != SummaryMode::kCenterMad) {
    return absl::InvalidArgumentError("Offload: unknown summary mode");
  }
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_items", a.num_items, 0, INT32_MAX));
  if (a.num_items == 0) return absl::OkStatus();
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_src_slots", a.num_src_slots, 1, INT64_MAX));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_host_pages", a.num_host_pages, 1, INT64_MAX));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_summary_pages", a.num_summary_pages, 1, INT64_MAX));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "k_src", a.k_src));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "v_src", a.v_src));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "host_pages", a.host_pages));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "summaries", a.summaries));
  return CheckPtr(op, "items", a.items);
}

absl::Status ValidateArgs(const SparseAttentionArgs& a) {
  constexpr const char* op = "SparseAttention";
  KVTIER_RETURN_IF_ERROR(CheckDType(op, a.dtype));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "batch", a.batch, 1, kMaxBatch));
  KVTIER_RETURN_IF_ERROR(CheckHeads(op, a.num_q_heads, a.num_kv_heads, a.head_dim));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "page_size", a.page_size, 1, Geometry::kMaxPageSize));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_slots", a.num_slots, 1, kMaxPages));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "q", a.q));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "k_cache", a.k_cache));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "v_cache", a.v_cache));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "slot_table", a.slot_table));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "partial_page", a.partial_page));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "partial_len", a.partial_len));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "out", a.out));
  // query_position, token_prob: null-ok. The INT8 storage is all five buffers or none.
  return CheckAllOrNone(op, {{"slot_int8", a.slot_int8},
                             {"k_int8", a.k_int8},
                             {"v_int8", a.v_int8},
                             {"k_scale", a.k_scale},
                             {"v_scale", a.v_scale}});
}

absl::Status ValidateArgs(const DenseAttentionArgs& a) {
  constexpr const char* op = "DenseAttention";
  KVTIER_RETURN_IF_ERROR(CheckDType(op, a.dtype));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "batch", a.batch, 1, kMaxBatch));
  KVTIER_RETURN_IF_ERROR(CheckHeads(op, a.num_q_heads, a.num_kv_heads, a.head_dim));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "max_tokens", a.max_tokens, 1, INT32_MAX));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "q", a.q));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "k", a.k));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "v", a.v));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "seq_len", a.seq_len));
  return CheckPtr(op, "out", a.out);
}

absl::Status ValidateArgs(const QuantizeSlotsArgs& a) {
  constexpr const char* op = "QuantizeSlots";
  KVTIER_RETURN_IF_ERROR(CheckDType(op, a.dtype));
  KVTIER_RETURN_IF_ERROR(CheckPage(op, a.page_size, a.num_kv_heads, a.head_dim));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_items", a.num_items, 0, INT32_MAX));
  if (a.num_items == 0) return absl::OkStatus();
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_slots", a.num_slots, 1, INT32_MAX));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "items", a.items));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "k_cache", a.k_cache));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "v_cache", a.v_cache));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "k_int8", a.k_int8));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "v_int8", a.v_int8));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "k_scale", a.k_scale));
  return CheckPtr(op, "v_scale", a.v_scale);
}

// Items live in backend memory, so src_slot == dst_slot is found when the op runs.
absl::Status ValidateArgs(const MoveHeadSlotsArgs& a) {
  constexpr const char* op = "MoveHeadSlots";
  KVTIER_RETURN_IF_ERROR(CheckDType(op, a.dtype));
  KVTIER_RETURN_IF_ERROR(CheckPage(op, a.page_size, a.num_kv_heads, a.head_dim));
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_items", a.num_items, 0, INT32_MAX));
  KVTIER_RETURN_IF_ERROR(CheckAllOrNone(op, {{"k_int8", a.k_int8},
                                             {"v_int8", a.v_int8},
                                             {"k_scale", a.k_scale},
                                             {"v_scale", a.v_scale}}));
  if (a.num_items == 0) return absl::OkStatus();
  KVTIER_RETURN_IF_ERROR(CheckRange(op, "num_slots", a.num_slots, 1, INT32_MAX));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "items", a.items));
  KVTIER_RETURN_IF_ERROR(CheckPtr(op, "k_cache", a.k_cache));
  return CheckPtr(op, "v_cache", a.v_cache);
}

}  // namespace kvtier
