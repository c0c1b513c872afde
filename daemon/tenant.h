// Tenant: one isolated slice of kvtierd's host tier (docs/architecture.md#processes): a
// shared-memory arena (a memfd, or the file TenantConfig::arena_path that survives a daemon
// restart; hugepages and NUMA binding per its TenantConfig) and a first-fit allocator that
// carves session regions out of it. The arena's size is the tenant's quota, and it
// covers both the session regions and the memory the daemon itself uses for the tenant's GRPC
// sessions (their Retrievers' working sets and summaries, staged Offload chunks), which is
// charged through the MemoryBudget interface. A region or a charge that does not fit is
// refused with RESOURCE_EXHAUSTED saying what it needed and what is free.
//
// Regions come back as move-only RegionLeases that return their range when destroyed.
//
// RegionAllocator is thread-compatible. Tenant is thread-safe; it must outlive every lease
// it handed out.
#ifndef KVTIER_DAEMON_TENANT_H_
#define KVTIER_DAEMON_TENANT_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/mutex.h"
#include "daemon/config.h"
#include "kernels/budgeted_backend.h"
#include "offload/host_arena.h"

namespace kvtier::daemon {

// First-fit allocation of byte ranges of [0, capacity) in units of `unit` bytes, with a
// free list that coalesces neighbours on Free. Pure bookkeeping: no memory is touched.
class RegionAllocator {
 public:
  // capacity is rounded down to a multiple of unit. REQUIRES: unit > 0.
  RegionAllocator(uint64_t capacity, uint64_t unit);

  // The offset of a free range of `bytes` rounded up to the unit (the lowest offset that
  // fits), or nullopt when none does (or bytes == 0).
  std::optional<uint64_t> Allocate(uint64_t bytes);
  // Returns [offset, offset + bytes rounded up to the unit). REQUIRES: exactly a range that
  // Allocate returned and that was not freed since.
  void Free(uint64_t offset, uint64_t bytes);
  // Takes exactly [offset, offset + bytes rounded up to the unit) out of the free list when
  // all of it is free (splitting the free range around it) and returns true; false, with
  // nothing changed, when any of it is in use or beyond the capacity, or when bytes == 0.
  // For re-adopting a range a previous process allocated. REQUIRES: offset is a multiple of
  // the unit (a misaligned offset is refused with false).
  bool Reserve(uint64_t offset, uint64_t bytes);

  uint64_t capacity() const { return capacity_; }
  uint64_t unit() const { return unit_; }
  uint64_t free_bytes() const { return free_bytes_; }
  uint64_t used_bytes() const { return capacity_ - free_bytes_; }
  uint64_t largest_free() const;
  size_t free_ranges() const { return free_.size(); }  // fragmentation, for tests
  uint64_t RoundUp(uint64_t bytes) const { return (bytes + unit_ - 1) / unit_ * unit_; }

 private:
  uint64_t capacity_;
  uint64_t unit_;
  uint64_t free_bytes_;
  std::map<uint64_t, uint64_t> free_;  // offset → length, disjoint, never adjacent
};

class Tenant;

// A region of a tenant's arena, owned. Move-only; returns the range when destroyed or
// Release()d. An empty lease (default, moved from, released) owns nothing.
class RegionLease {
 public:
  RegionLease() = default;
  RegionLease(RegionLease&& other) noexcept { *this = std::move(other); }
  RegionLease& operator=(RegionLease&& other) noexcept;
  RegionLease(const RegionLease&) = delete;
  RegionLease& operator=(const RegionLease&) = delete;
  ~RegionLease() { Release(); }

  bool valid() const { return tenant_ != nullptr; }
  uint64_t offset() const { return offset_; }  // bytes from the arena's first byte
  uint64_t bytes() const { return bytes_; }    // a multiple of kRegionAlignment
  void* data() const;                          // REQUIRES: valid()
  void Release();

 private:
  friend class Tenant;
  RegionLease(Tenant* tenant, uint64_t offset, uint64_t bytes)
      : tenant_(tenant), offset_(offset), bytes_(bytes) {}
  Tenant* tenant_ = nullptr;
  uint64_t offset_ = 0;
  uint64_t bytes_ = 0;
};

class Tenant final : public MemoryBudget {
 public:
  // Creates the tenant's arena: config.host_memory_bytes, in the file config.arena_path when
  // set (an existing file is mapped with its contents; see HostArena::Create), hugepages per
  // config.hugepages,
  // bound to config.numa_node (or, when -1 and gpu_pci_bus_id is set, the node hwloc finds
  // for that GPU; a failed lookup only logs a warning), locked when config.lock (best
  // effort). Logs the arena report. INVALID_ARGUMENT for a bad hugepages value or size;
  // HostArena::Create's errors otherwise.
  static absl::StatusOr<std::unique_ptr<Tenant>> Create(const TenantConfig& config);
  Tenant(const Tenant&) = delete;
  Tenant& operator=(const Tenant&) = delete;
  ~Tenant() override = default;

  const TenantConfig& config() const { return config_; }
  const std::string& name() const { return config_.name; }
  HostArena& arena() const { return *arena_; }
  uint64_t quota_bytes() const { return allocator_capacity_; }

  // A region of at least `bytes` (rounded up to kRegionAlignment), or RESOURCE_EXHAUSTED
  // "tenant 'a': session needs N bytes, M of Q bytes free" (adding the largest free range
  // when fragmentation is what refuses it).
  absl::StatusOr<RegionLease> AllocateRegion(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // A lease for exactly [offset, offset + bytes rounded up to kRegionAlignment): re-adopting
  // a session region that a previous daemon allocated in the same arena file
  // (config().arena_path) after a restart. FAILED_PRECONDITION naming the tenant and the
  // range when bytes == 0, when offset is not a multiple of kRegionAlignment, when the range
  // reaches beyond the quota, or when any of it is not free (another lease holds it);
  // RESOURCE_EXHAUSTED when it is free but charged daemon memory (Charge) leaves too little
  // of the quota for it.
  absl::StatusOr<RegionLease> AdoptRegion(uint64_t offset, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Regions plus charged daemon memory.
  uint64_t used_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  // Daemon memory charged now (included in used_bytes).
  uint64_t charged_bytes() const ABSL_LOCKS_EXCLUDED(mu_);

  // MemoryBudget: daemon memory of this tenant's GRPC sessions. RESOURCE_EXHAUSTED
  // "tenant 'a': daemon memory of a GRPC session needs N bytes, M of Q bytes free".
  absl::Status Charge(size_t bytes) override ABSL_LOCKS_EXCLUDED(mu_);
  void Release(size_t bytes) override ABSL_LOCKS_EXCLUDED(mu_);

  // Requests of this tenant's callers that ended in an error (GetStats' refused_requests).
  void CountRefused() { refused_.fetch_add(1, std::memory_order_relaxed); }
  uint64_t refused_requests() const { return refused_.load(std::memory_order_relaxed); }

 private:
  friend class RegionLease;
  Tenant(const TenantConfig& config, std::unique_ptr<HostArena> arena);
  void FreeRegion(uint64_t offset, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  const TenantConfig config_;
  const std::unique_ptr<HostArena> arena_;
  const uint64_t allocator_capacity_;
  std::atomic<uint64_t> refused_{0};
  mutable Mutex mu_;
  RegionAllocator allocator_ ABSL_GUARDED_BY(mu_);
  uint64_t charged_ ABSL_GUARDED_BY(mu_) = 0;  // bytes, ≤ allocator_.free_bytes() when taken
};

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_TENANT_H_
