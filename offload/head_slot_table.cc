// HeadSlotTable. Invariant: a page appears at most once per head.
#include "offload/head_slot_table.h"

#include <algorithm>

#include "core/status.h"
#include "kvtier/layout.h"

namespace kvtier {

HeadSlotTable::HeadSlotTable(int32_t num_kv_heads, int32_t capacity)
    : hkv_(num_kv_heads),
      cap_(capacity),
      table_(static_cast<size_t>(num_kv_heads) * capacity, kEmptySlot) {
  KVTIER_CHECK(num_kv_heads >= 1 && capacity >= 0);
}

int32_t HeadSlotTable::PlaceInFreeSlot(int32_t page) {
  for (int32_t s = 0; s < cap_; ++s) {
    bool free = true;
    for (int32_t h = 0; h < hkv_ && free; ++h) free = at(h, s) == kEmptySlot;
    if (!free) continue;
    for (int32_t h = 0; h < hkv_; ++h) table_[Index(h, s)] = page;
    return s;
  }
  return -1;
}

bool HeadSlotTable::Evict(int32_t h, int32_t page) {
  const int32_t s = SlotOf(h, page);
  if (s < 0) return false;
  table_[Index(h, s)] = kEmptySlot;
  return true;
}

int32_t HeadSlotTable::SlotOf(int32_t h, int32_t page) const {
  for (int32_t s = 0; s < cap_; ++s) {
    if (at(h, s) == page) return s;
  }
  return -1;
}

std::vector<int32_t> HeadSlotTable::Pages(int32_t h) const {
  std::vector<int32_t> out;
  for (int32_t s = 0; s < cap_; ++s) {
    if (at(h, s) != kEmptySlot) out.push_back(at(h, s));
  }
  std::sort(out.begin(), out.end());
  return out;
}

int32_t HeadSlotTable::CountOf(int32_t h) const {
  int32_t n = 0;
  for (int32_t s = 0; s < cap_; ++s) n += at(h, s) != kEmptySlot;
  return n;
}

int64_t HeadSlotTable::resident() const {
  return std::count_if(table_.begin(), table_.end(), [](int32_t e) { return e != kEmptySlot; });
}

std::vector<HeadSlotMove> HeadSlotTable::Compact(int32_t fixed) {
  std::vector<HeadSlotMove> moves;
  for (int32_t h = 0; h < hkv_; ++h) {
    // Two fingers: the lowest free slot and the highest used one; move while they cross.
    int32_t lo = 0;
    int32_t hi = cap_ - 1;
    while (true) {
      while (lo < cap_ && (lo == fixed || at(h, lo) != kEmptySlot)) ++lo;
      while (hi >= 0 && (hi == fixed || at(h, hi) == kEmptySlot)) --hi;
      if (lo >= hi) break;
      table_[Index(h, lo)] = at(h, hi);
      table_[Index(h, hi)] = kEmptySlot;
      moves.push_back(HeadSlotMove{h, hi, lo});
    }
  }
  return moves;
}

int32_t HeadSlotTable::used() const {
  for (int32_t s = cap_ - 1; s >= 0; --s) {
    for (int32_t h = 0; h < hkv_; ++h) {
      if (at(h, s) != kEmptySlot) return s + 1;
    }
  }
  return 0;
}

void HeadSlotTable::Resize(int32_t new_capacity) {
  KVTIER_CHECK(new_capacity >= used());
  std::vector<int32_t> table(static_cast<size_t>(hkv_) * new_capacity, kEmptySlot);
  const int32_t keep = std::min(cap_, new_capacity);
  for (int32_t h = 0; h < hkv_; ++h) {
    std::copy_n(table_.begin() + static_cast<ptrdiff_t>(Index(h, 0)), keep,
                table.begin() + static_cast<ptrdiff_t>(h) * new_capacity);
  }
  cap_ = new_capacity;
  table_ = std::move(table);
}

}  // namespace kvtier
