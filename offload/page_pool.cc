#include "offload/page_pool.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/status.h"
#include "offload/host_arena.h"

namespace kvtier {

PageHandle& PageHandle::operator=(PageHandle&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = std::exchange(other.pool_, nullptr);
    slot_ = std::exchange(other.slot_, -1);
    generation_ = std::exchange(other.generation_, 0);
  }
  return *this;
}

void* PageHandle::data() const { return pool_->SlotData(slot_); }

void PageHandle::Release() {
  if (pool_ == nullptr) return;
  std::exchange(pool_, nullptr)->Free(slot_, generation_);
  slot_ = -1;
  generation_ = 0;
}

absl::StatusOr<std::unique_ptr<PagePool>> PagePool::Create(void* base, size_t slot_bytes,
                                                           int64_t num_slots) {
  if (base == nullptr || reinterpret_cast<uintptr_t>(base) % kSlotAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "page pool base %p: must be non-null and %d-byte aligned", base, kSlotAlignment));
  }
  if (slot_bytes == 0 || slot_bytes > (size_t{1} << 40)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("page pool slot_bytes %d: must be in [1, 2^40]", slot_bytes));
  }
  if (num_slots < 1 || num_slots > kMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrFormat("page pool num_slots %d: must be in [1, %d]", num_slots, kMaxSlots));
  }
  const size_t stride = (slot_bytes + kSlotAlignment - 1) / kSlotAlignment * kSlotAlignment;
  return std::unique_ptr<PagePool>(new PagePool(base, slot_bytes, stride, num_slots));
}

absl::StatusOr<std::unique_ptr<PagePool>> PagePool::CreateInArena(HostArena& arena,
                                                                  size_t slot_bytes) {
  const size_t stride = (slot_bytes + kSlotAlignment - 1) / kSlotAlignment * kSlotAlignment;
  const size_t fit = stride == 0 ? 0 : arena.size() / stride;
  if (slot_bytes == 0 || fit == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "arena of %d bytes holds no page pool slot of %d bytes", arena.size(), slot_bytes));
  }
  const int64_t num_slots = static_cast<int64_t>(std::min<size_t>(fit, kMaxSlots));
  return Create(arena.data(), slot_bytes, num_slots);
}

PagePool::PagePool(void* base, size_t slot_bytes, size_t slot_stride, int64_t num_slots)
    : base_(base), slot_bytes_(slot_bytes), slot_stride_(slot_stride), num_slots_(num_slots) {
  MutexLock lock(&mu_);
  const size_t n = static_cast<size_t>(num_slots);
  generation_.assign(n, 0);
  in_use_.assign(n, 0);
  // Slot 0 on top of the stack, so a fresh pool hands out 0, 1, 2, ...
  free_.reserve(n);
  free_pos_.assign(n, -1);
  for (int64_t slot = num_slots - 1; slot >= 0; --slot) {
    free_pos_[slot] = static_cast<int32_t>(free_.size());
    free_.push_back(static_cast<int32_t>(slot));
  }
}

PagePool::~PagePool() {
  MutexLock lock(&mu_);
  // Outstanding handles would free into a dead pool: a caller's ownership bug.
  KVTIER_CHECK(free_.size() == static_cast<size_t>(num_slots_));
}

absl::StatusOr<PageHandle> PagePool::Allocate() {
  MutexLock lock(&mu_);
  if (free_.empty()) {
    ++exhausted_;
    return absl::ResourceExhaustedError(absl::StrFormat(
        "page pool exhausted: all %d slots of %d bytes in use", num_slots_, slot_bytes_));
  }
  const int32_t slot = free_.back();
  free_.pop_back();
  free_pos_[slot] = -1;
  in_use_[slot] = 1;
  ++allocations_;
  return PageHandle(this, slot, ++generation_[slot]);
}

void PagePool::Free(int64_t slot, uint64_t generation) {
  MutexLock lock(&mu_);
  // Handles are move-only, so a slot is freed once, by the allocation that owns it.
  KVTIER_CHECK(in_use_[slot] == 1 && generation_[slot] == generation);
  in_use_[slot] = 0;
  free_pos_[slot] = static_cast<int32_t>(free_.size());
  free_.push_back(static_cast<int32_t>(slot));
}

absl::StatusOr<PageHandle> PagePool::Claim(int64_t slot, uint64_t generation) {
  if (slot < 0 || slot >= num_slots_) {
    return absl::OutOfRangeError(
        absl::StrFormat("page pool claim of slot %d: must be in [0, %d)", slot, num_slots_));
  }
  MutexLock lock(&mu_);
  if (generation == 0 || generation < generation_[slot]) {
    return absl::InvalidArgumentError(
        absl::StrFormat("page pool claim of slot %d with generation %d: must be >= 1 and >= "
                        "the slot's current generation %d",
                        slot, generation, generation_[slot]));
  }
  if (in_use_[slot] == 1) {
    return absl::FailedPreconditionError(
        absl::StrFormat("page pool claim of slot %d: the slot is in use", slot));
  }
  // Remove the slot from the free stack in O(1): the top entry takes its place.
  const int32_t pos = free_pos_[slot];
  KVTIER_CHECK(pos >= 0 && free_[pos] == slot);
  const int32_t top = free_.back();
  free_[pos] = top;
  free_pos_[top] = pos;
  free_.pop_back();
  free_pos_[slot] = -1;
  in_use_[slot] = 1;
  generation_[slot] = generation;
  return PageHandle(this, slot, generation);
}

bool PagePool::IsLive(int64_t slot, uint64_t generation) const {
  if (slot < 0 || slot >= num_slots_) return false;
  MutexLock lock(&mu_);
  return in_use_[slot] == 1 && generation_[slot] == generation;
}

uint64_t PagePool::CurrentGeneration(int64_t slot) const {
  KVTIER_CHECK(slot >= 0 && slot < num_slots_);
  MutexLock lock(&mu_);
  return generation_[slot];
}

PagePoolStats PagePool::stats() const {
  MutexLock lock(&mu_);
  return PagePoolStats{
      .in_use = num_slots_ - static_cast<int64_t>(free_.size()),
      .capacity = num_slots_,
      .allocations = allocations_,
      .exhausted = exhausted_,
  };
}

}  // namespace kvtier
