// Every index formula of kvtier's memory layouts (docs/architecture.md#geometry-and-layouts), in
// one place. The CPU reference backend and the CUDA kernels both index through these structs; a
// test checks each formula by hand. Offsets are in elements unless a name says bytes.
//
// Host tier, HND: one host page per (sequence, layer, logical page):
//   [kv_head][K=0 | V=1][token][dim]
// so one (page, kv_head) K+V slab of 2·p·d elements is contiguous (16 KiB at p=32, d=128,
// fp16): the unit of recall.
//
// Summaries, per (sequence, layer): [page][kv_head][hi=0 | lo=1][dim].
// Key codes (SummaryMode::kKeyCodes), per (sequence, layer), bytes: [page][kv_head][token]
// [dim / 2], dimension 2m in the low nibble of byte m and 2m + 1 in the high one.
//
// GPU working set, NHD, per layer for a batch of B sequences with S slots each; K and V are
// separate buffers of the same shape:
//   [batch][slot][token][kv_head][dim]
// i.e. a standard NHD paged KV cache whose page table is the slot list. (batch, slot) is
// also written as one "global slot" b·S + slot.
//
// Slot table, per layer: [batch][kv_head][slot] → logical page held there for that head,
// or kEmptySlot. One slot may hold different logical pages for different heads.
//
// Pure value structs; thread-safe; no CUDA includes.
#ifndef KVTIER_LAYOUT_H_
#define KVTIER_LAYOUT_H_

#include <cstdint>

#include "kvtier/host_device.h"

namespace kvtier {

inline constexpr int32_t kEmptySlot = -1;
inline constexpr int32_t kKey = 0;
inline constexpr int32_t kValue = 1;
inline constexpr int32_t kHi = 0;
inline constexpr int32_t kLo = 1;

// One host page: [Hkv][2][p][d].
struct HostPageLayout {
  int32_t num_kv_heads;
  int32_t page_size;
  int32_t head_dim;

  KVTIER_HOST_DEVICE int64_t slab_elements() const {
    return int64_t{2} * page_size * head_dim;
  }
  KVTIER_HOST_DEVICE int64_t page_elements() const { return num_kv_heads * slab_elements(); }
  // Start of the K+V slab of `kv_head` within the page.
  KVTIER_HOST_DEVICE int64_t SlabOffset(int32_t kv_head) const {
    return kv_head * slab_elements();
  }
  // Element (kv_head, kind ∈ {kKey, kValue}, token, dim) within the page.
  KVTIER_HOST_DEVICE int64_t Offset(int32_t kv_head, int32_t kind, int32_t token,
                                    int32_t dim) const {
    return ((static_cast<int64_t>(kv_head) * 2 + kind) * page_size + token) * head_dim + dim;
  }
};

// Summaries of one (sequence, layer): [page][Hkv][2][d].
struct SummaryLayout {
  int32_t num_kv_heads;
  int32_t head_dim;

  KVTIER_HOST_DEVICE int64_t page_elements() const {
    return int64_t{2} * num_kv_heads * head_dim;
  }
  // Element (page, kv_head, which ∈ {kHi, kLo}, dim).
  KVTIER_HOST_DEVICE int64_t Offset(int64_t page, int32_t kv_head, int32_t which,
                                    int32_t dim) const {
    return ((page * num_kv_heads + kv_head) * 2 + which) * head_dim + dim;
  }
};

// Key codes of one (sequence, layer): [page][Hkv][p][d / 2] bytes, two 4-bit codes a byte.
// Code c of (token, dim) stands for lo + (c + 0.5)·(hi − lo)/16 with hi/lo the page's
// per-dimension max/min (SummaryMode::kKeyCodes).
inline constexpr int32_t kKeyCodeLevels = 16;
struct KeyCodeLayout {
  int32_t num_kv_heads;
  int32_t page_size;
  int32_t head_dim;  // even

  KVTIER_HOST_DEVICE int64_t row_bytes() const { return head_dim / 2; }
  KVTIER_HOST_DEVICE int64_t page_bytes() const {
    return static_cast<int64_t>(num_kv_heads) * page_size * row_bytes();
  }
  // Byte offset of (page, kv_head, token)'s row of codes.
  KVTIER_HOST_DEVICE int64_t RowOffset(int64_t page, int32_t kv_head, int32_t token) const {
    return ((page * num_kv_heads + kv_head) * page_size + token) * row_bytes();
  }
};

// NHD working set of one layer: K (and separately V) [B][S][p][Hkv][d].
struct WorkingSetLayout {
  int32_t num_slots;  // S, per sequence
  int32_t page_size;
  int32_t num_kv_heads;
  int32_t head_dim;

  KVTIER_HOST_DEVICE int64_t slot_elements() const {
    return static_cast<int64_t>(page_size) * num_kv_heads * head_dim;
  }
  KVTIER_HOST_DEVICE int64_t GlobalSlot(int32_t batch, int32_t slot) const {
    return static_cast<int64_t>(batch) * num_slots + slot;
  }
  // Element (global slot, token, kv_head, dim).
  KVTIER_HOST_DEVICE int64_t Offset(int64_t global_slot, int32_t token, int32_t kv_head,
                                    int32_t dim) const {
    return ((global_slot * page_size + token) * num_kv_heads + kv_head) * head_dim + dim;
  }
  // Element (batch, slot, token, kv_head, dim).
  KVTIER_HOST_DEVICE int64_t Offset(int32_t batch, int32_t slot, int32_t token,
                                    int32_t kv_head, int32_t dim) const {
    return Offset(GlobalSlot(batch, slot), token, kv_head, dim);
  }
  // Distance between consecutive tokens of one head in a slot (the NHD row stride).
  KVTIER_HOST_DEVICE int64_t token_stride() const {
    return static_cast<int64_t>(num_kv_heads) * head_dim;
  }
};

// Per-KV-head slot tables of one layer: [B][Hkv][S] int32 logical page or kEmptySlot.
struct SlotTableLayout {
  int32_t num_kv_heads;
  int32_t num_slots;

  KVTIER_HOST_DEVICE int64_t Offset(int32_t batch, int32_t kv_head, int32_t slot) const {
    return (static_cast<int64_t>(batch) * num_kv_heads + kv_head) * num_slots + slot;
  }
  KVTIER_HOST_DEVICE int64_t batch_elements() const {
    return static_cast<int64_t>(num_kv_heads) * num_slots;
  }
};

// Per-head query-like tensors of a batch: [B][H][d] (queries, attention outputs).
struct HeadsLayout {
  int32_t num_heads;
  int32_t head_dim;

  KVTIER_HOST_DEVICE int64_t Offset(int32_t batch, int32_t head, int32_t dim) const {
    return (static_cast<int64_t>(batch) * num_heads + head) * head_dim + dim;
  }
};

// Contiguous NHD KV of a batch for dense attention: [B][T][Hkv][d], T = max_tokens.
struct DenseKvLayout {
  int32_t max_tokens;
  int32_t num_kv_heads;
  int32_t head_dim;

  KVTIER_HOST_DEVICE int64_t Offset(int32_t batch, int32_t token, int32_t kv_head,
                                    int32_t dim) const {
    return ((static_cast<int64_t>(batch) * max_tokens + token) * num_kv_heads + kv_head) *
               head_dim + dim;
  }
};

// The KV head a query head reads under GQA: consecutive query heads share one KV head.
KVTIER_HOST_DEVICE inline int32_t KvHeadOfQueryHead(int32_t q_head, int32_t group_size) {
  return q_head / group_size;
}

}  // namespace kvtier

#endif  // KVTIER_LAYOUT_H_
