// PageTable: the host-tier page table of one (sequence, layer): logical page index → the
// pool slot holding that page (HND, docs/architecture.md#geometry-and-layouts) and the slot's
// generation. The table owns the pages' PageHandles, so erasing an entry, clearing or destroying
// the table frees its slots. Entries are plain integers, no device types.
//
// A PageEntry copied out of the table (into a recall plan, say) can go stale when its page
// is erased and the slot reused; IsCurrent(entry) tells, by comparing generations.
//
// Thread-compatible: const methods may run concurrently; anything else needs the caller's
// lock (a session serialises its own tables). Movable, not copyable.
#ifndef KVTIER_OFFLOAD_PAGE_TABLE_H_
#define KVTIER_OFFLOAD_PAGE_TABLE_H_

#include <cstddef>
#include <cstdint>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "offload/page_pool.h"

namespace kvtier {

// Where a logical page lives in the host tier.
struct PageEntry {
  int64_t slot = -1;        // pool slot == host page index of the ops (kernels/ops.h)
  uint64_t generation = 0;  // the slot's generation when the page was stored

  friend bool operator==(const PageEntry&, const PageEntry&) = default;
};

class PageTable {
 public:
  // REQUIRES: `pool` outlives the table.
  explicit PageTable(const PagePool& pool) : pool_(&pool) {}
  PageTable(PageTable&&) = default;
  PageTable& operator=(PageTable&&) = default;
  PageTable(const PageTable&) = delete;
  PageTable& operator=(const PageTable&) = delete;

  // Stores `page` as logical page `logical`; the table owns it from then on. On error the
  // page is freed: INVALID_ARGUMENT for logical < 0 or a page that is empty or from another
  // pool; FAILED_PRECONDITION when `logical` is already present.
  absl::Status Insert(int64_t logical, PageHandle page);

  // The entry of `logical`, or NOT_FOUND.
  absl::StatusOr<PageEntry> Lookup(int64_t logical) const;
  bool Contains(int64_t logical) const { return pages_.contains(logical); }

  // Removes `logical` and frees its slot; NOT_FOUND when absent.
  absl::Status Erase(int64_t logical);
  // Removes every entry, freeing their slots.
  void Clear() { pages_.clear(); }
  size_t size() const { return pages_.size(); }
  // The pool whose slots the table holds.
  const PagePool& pool() const { return *pool_; }

  // True while `entry`'s slot still holds the allocation it was taken from (the pool's
  // current generation of the slot matches and the slot is allocated).
  bool IsCurrent(const PageEntry& entry) const {
    return pool_->IsLive(entry.slot, entry.generation);
  }

 private:
  const PagePool* pool_;
  absl::flat_hash_map<int64_t, PageHandle> pages_;
};

}  // namespace kvtier

#endif  // KVTIER_OFFLOAD_PAGE_TABLE_H_
