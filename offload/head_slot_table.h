// HeadSlotTable: the host-side bookkeeping of a drop-mode working set whose pages policies
// evict per KV head (docs/architecture.md#policies; KV-Compress's per-head blocks). A slot holds
// one page of p tokens for every KV head, but each head's part of a slot may hold a different
// logical page (the slot table is per head), so heads keep different pages and different numbers of
// pages. A new page needs a slot that is free in every head (Append writes all heads of a
// token at once); Compact moves heads' pages down so that the free parts line up into whole
// free slots at the end, which Resize can then give back to the backend.
//
// Plans are values: Compact returns the moves for the backend (MoveHeadSlots) to execute.
// Plain C++, no device types. Thread-compatible.
#ifndef KVTIER_OFFLOAD_HEAD_SLOT_TABLE_H_
#define KVTIER_OFFLOAD_HEAD_SLOT_TABLE_H_

#include <cstdint>
#include <vector>

#include "kernels/ops.h"

namespace kvtier {

class HeadSlotTable {
 public:
  // REQUIRES: num_kv_heads ≥ 1, capacity ≥ 0.
  HeadSlotTable(int32_t num_kv_heads, int32_t capacity);

  int32_t num_kv_heads() const { return hkv_; }
  int32_t capacity() const { return cap_; }
  // [Hkv][capacity]: the logical page in each head's part of each slot, or −1.
  const std::vector<int32_t>& table() const { return table_; }
  int32_t at(int32_t h, int32_t slot) const { return table_[Index(h, slot)]; }

  // Puts `page` in the lowest slot free in every head; returns it, or −1 when there is none
  // (Compact, then Resize up).
  int32_t PlaceInFreeSlot(int32_t page);
  // Empties head h's part of the slot holding `page`; false when h does not hold it.
  bool Evict(int32_t h, int32_t page);
  // The slot of `page` in head h, or −1.
  int32_t SlotOf(int32_t h, int32_t page) const;
  // Head h's pages, ascending.
  std::vector<int32_t> Pages(int32_t h) const;
  int32_t CountOf(int32_t h) const;
  int64_t resident() const;  // head-pages held, all heads

  // Moves every head's pages into its lowest slots (keeping their order), except the slot
  // `fixed` (−1: none), which stays where it is in every head (the page being filled: its
  // next tokens go there for all heads). Returns the moves, in an order that is safe to run
  // one after another (every destination is free when its move runs). Afterwards slots
  // [used(), capacity) are free in every head.
  std::vector<HeadSlotMove> Compact(int32_t fixed);
  // One past the highest slot in use in any head (0 when empty).
  int32_t used() const;
  // Changes the capacity. REQUIRES: new_capacity ≥ used().
  void Resize(int32_t new_capacity);

 private:
  size_t Index(int32_t h, int32_t slot) const {
    return static_cast<size_t>(h) * static_cast<size_t>(cap_) + static_cast<size_t>(slot);
  }

  int32_t hkv_;
  int32_t cap_;
  std::vector<int32_t> table_;
};

}  // namespace kvtier

#endif  // KVTIER_OFFLOAD_HEAD_SLOT_TABLE_H_
