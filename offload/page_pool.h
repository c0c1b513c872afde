// PagePool: a fixed-size slot allocator over a range of memory (normally a HostArena), the
// storage of host pages (docs/architecture.md#processes,
// docs/architecture.md#geometry-and-layouts). Allocation and free are O(1) through a free stack;
// freed slots are reused LIFO (the most recently freed slot is still warm in cache and TLB). Every
// allocation increments the slot's generation, so a stale reference to a slot that was freed and
// reused can be detected (IsLive).
//
// Memory comes back as move-only PageHandles that free their slot when destroyed, so a
// slot cannot be freed twice. The pool owns no memory: the range must outlive the pool,
// and the pool must outlive every handle (the destructor checks that none is left).
//
// Thread-safe: Allocate, handle destruction, IsLive and stats may run on any thread. The
// bytes of a slot belong to whoever holds its handle.
#ifndef KVTIER_OFFLOAD_PAGE_POOL_H_
#define KVTIER_OFFLOAD_PAGE_POOL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "core/mutex.h"

namespace kvtier {

class HostArena;
class PagePool;

// One allocated slot. Move-only; frees the slot when destroyed or Release()d. An empty
// handle (default-constructed, moved from, released) owns nothing.
class PageHandle {
 public:
  PageHandle() = default;
  PageHandle(PageHandle&& other) noexcept { *this = std::move(other); }
  PageHandle& operator=(PageHandle&& other) noexcept;
  PageHandle(const PageHandle&) = delete;
  PageHandle& operator=(const PageHandle&) = delete;
  ~PageHandle() { Release(); }

  bool valid() const { return pool_ != nullptr; }
  // REQUIRES: valid() for the accessors below.
  int64_t slot() const { return slot_; }
  uint64_t generation() const { return generation_; }  // >= 1
  void* data() const;                                  // the slot's first byte
  const PagePool* pool() const { return pool_; }

  // Returns the slot to the pool now; the handle becomes empty. No-op when empty.
  void Release();

 private:
  friend class PagePool;
  PageHandle(PagePool* pool, int64_t slot, uint64_t generation)
      : pool_(pool), slot_(slot), generation_(generation) {}

  PagePool* pool_ = nullptr;
  int64_t slot_ = -1;
  uint64_t generation_ = 0;
};

struct PagePoolStats {
  int64_t in_use = 0;        // slots
  int64_t capacity = 0;      // slots
  uint64_t allocations = 0;  // successful Allocate calls since creation
  uint64_t exhausted = 0;    // Allocate calls refused because the pool was full
};

class PagePool {
 public:
  // Slots start at multiples of this many bytes from the (equally aligned) base.
  static constexpr size_t kSlotAlignment = 256;
  // Slot indices fit int32 (the kernels' page indices are int64, the free stack int32).
  static constexpr int64_t kMaxSlots = INT32_MAX;

  // A pool of `num_slots` slots over [base, base + num_slots · slot_stride()), where the
  // stride is slot_bytes rounded up to kSlotAlignment. INVALID_ARGUMENT when base is null
  // or not kSlotAlignment-aligned, slot_bytes is not in [1, 2^40], or num_slots is not in
  // [1, kMaxSlots].
  // REQUIRES: the range is valid memory that outlives the pool.
  static absl::StatusOr<std::unique_ptr<PagePool>> Create(void* base, size_t slot_bytes,
                                                          int64_t num_slots);
  // A pool over the whole of `arena`: as many slots as fit. INVALID_ARGUMENT when not even
  // one fits. REQUIRES: the arena outlives the pool.
  static absl::StatusOr<std::unique_ptr<PagePool>> CreateInArena(HostArena& arena,
                                                                 size_t slot_bytes);

  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;
  // REQUIRES: no handle is outstanding (checked: aborts otherwise).
  ~PagePool();

  // A free slot, or RESOURCE_EXHAUSTED "page pool exhausted: all N slots of B bytes in use".
  absl::StatusOr<PageHandle> Allocate() ABSL_LOCKS_EXCLUDED(mu_);

  // Claims the free slot `slot` as if Allocate had handed it out with `generation`: for a
  // restarted process that re-adopts pages already in shared memory. The slot's generation
  // becomes `generation`, so the next allocation after the handle is freed gets
  // generation + 1. Errors: OUT_OF_RANGE unless 0 <= slot < num_slots(); INVALID_ARGUMENT
  // for generation 0 or one below the slot's current generation; FAILED_PRECONDITION when
  // the slot is in use. O(1); not counted in stats().allocations.
  absl::StatusOr<PageHandle> Claim(int64_t slot, uint64_t generation) ABSL_LOCKS_EXCLUDED(mu_);

  // True when `slot` is allocated and its current generation is `generation`: a reference
  // taken from a handle is still about the same allocation. False for out-of-range slots.
  bool IsLive(int64_t slot, uint64_t generation) const ABSL_LOCKS_EXCLUDED(mu_);
  // The slot's generation: 0 before its first allocation. REQUIRES: 0 <= slot < num_slots().
  uint64_t CurrentGeneration(int64_t slot) const ABSL_LOCKS_EXCLUDED(mu_);

  PagePoolStats stats() const ABSL_LOCKS_EXCLUDED(mu_);

  void* base() const { return base_; }
  size_t slot_bytes() const { return slot_bytes_; }    // as asked
  size_t slot_stride() const { return slot_stride_; }  // bytes between consecutive slots
  int64_t num_slots() const { return num_slots_; }
  // REQUIRES: 0 <= slot < num_slots().
  void* SlotData(int64_t slot) const {
    return static_cast<char*>(base_) + static_cast<size_t>(slot) * slot_stride_;
  }

 private:
  friend class PageHandle;
  PagePool(void* base, size_t slot_bytes, size_t slot_stride, int64_t num_slots);
  void Free(int64_t slot, uint64_t generation) ABSL_LOCKS_EXCLUDED(mu_);

  void* const base_;
  const size_t slot_bytes_;
  const size_t slot_stride_;
  const int64_t num_slots_;

  mutable Mutex mu_;
  std::vector<int32_t> free_ ABSL_GUARDED_BY(mu_);         // stack; back() is next
  std::vector<int32_t> free_pos_ ABSL_GUARDED_BY(mu_);     // per slot: index in free_, or -1
  std::vector<uint64_t> generation_ ABSL_GUARDED_BY(mu_);  // per slot
  std::vector<uint8_t> in_use_ ABSL_GUARDED_BY(mu_);       // per slot, 0 or 1
  uint64_t allocations_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t exhausted_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvtier

#endif  // KVTIER_OFFLOAD_PAGE_POOL_H_
