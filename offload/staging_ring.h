// StagingRing: pinned host memory for the decode path's small host↔device copies
// (docs/retriever.md#host-waits). CUDA returns from a copy into or out of pageable host
// memory only once it is done (or may), so every upload of a count or a table entry and
// every download of a step's statistics goes through blocks of one ring, registered with the
// backend once, at creation. A block is acquired, filled or copied into, and released by its
// owner once the work that reads or writes it has run; space is reused in acquisition order.
// Ops may also read a block directly (zero-copy): it is registered host memory.
//
// Thread-compatible: one thread drives a ring at a time.
#ifndef KVTIER_OFFLOAD_STAGING_RING_H_
#define KVTIER_OFFLOAD_STAGING_RING_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace kvtier {

class StagingRing {
 public:
  static constexpr size_t kAlign = 64;  // every block starts on a 64-byte boundary

  // A ring of `bytes` (rounded up to kAlign) registered with `backend`. RESOURCE_EXHAUSTED
  // when host memory or registration fails. REQUIRES: backend outlives the ring.
  static absl::StatusOr<std::unique_ptr<StagingRing>> Create(Backend& backend, size_t bytes);
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  struct Block {
    uint8_t* data = nullptr;  // null: the ring has no room now
    uint64_t ticket = 0;
  };
  // `bytes` (> 0) of the ring, or a null block when the blocks not yet released leave no
  // contiguous room. Never blocks.
  Block TryAcquire(size_t bytes);
  // Gives a block back (in any order). Unknown or repeated tickets are ignored.
  void Release(uint64_t ticket);

  size_t capacity() const { return capacity_; }
  size_t in_use() const { return static_cast<size_t>(head_ - tail_); }
  size_t blocks() const { return blocks_.size(); }

 private:
  StagingRing(Backend& backend, uint8_t* base, size_t capacity)
      : backend_(backend), base_(base), capacity_(capacity) {}
  struct Entry {
    uint64_t ticket;
    uint64_t end;  // virtual offset one past the block
    bool released;
  };

  Backend& backend_;
  uint8_t* const base_;
  const size_t capacity_;
  uint64_t head_ = 0;  // virtual offset of the next block
  uint64_t tail_ = 0;  // virtual offset of the oldest unreleased byte
  uint64_t next_ticket_ = 1;
  std::deque<Entry> blocks_;  // in acquisition order
};

}  // namespace kvtier

#endif  // KVTIER_OFFLOAD_STAGING_RING_H_
