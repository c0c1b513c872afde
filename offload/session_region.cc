#include "offload/session_region.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "absl/strings/str_format.h"
#include "core/status.h"
#include "offload/host_arena.h"
#include "offload/page_pool.h"
#include "offload/telemetry.h"

namespace kvtier {
namespace {

// Invariants: the header is read once, by Open(), and only the validated copy (layout_) is
// used after, so a peer that rewrites the header later cannot move our accesses out of
// bounds. Every shared word that changes after Format (epoch, directory entries) is
// accessed through std::atomic_ref.
constexpr uint64_t kHeaderBytes = 4096;
// The retrieval telemetry block (offload/telemetry.h) in the second half of the header page.
constexpr uint64_t kTelemetryOffset = 2048;
static_assert(kTelemetryOffset + kTelemetryBytes <= kHeaderBytes);

struct RegionHeader {
  uint64_t magic;
  uint32_t layout_version;
  uint32_t dtype;  // DType
  uint64_t total_bytes;
  int32_t num_layers;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t page_size;
  int32_t max_pages_per_layer;
  int64_t num_slots;
  uint64_t dir_offset;
  uint64_t slots_offset;
  uint64_t slot_stride;
  alignas(std::atomic_ref<uint64_t>::required_alignment) uint64_t epoch;  // atomic
};
static_assert(sizeof(RegionHeader) <= kTelemetryOffset);
static_assert(std::is_standard_layout_v<RegionHeader>);
static_assert(std::is_trivially_copyable_v<RegionHeader>);

// One (layer, page) of the directory. stamp == 0: not committed. The writer withdraws the
// stamp, stores slot and epoch (release), then the new stamp (release); a reader acquires
// the stamp, then slot and epoch, and re-reads the stamp (Commit, Lookup).
struct DirEntry {
  alignas(std::atomic_ref<uint64_t>::required_alignment) uint64_t stamp;
  int64_t slot;
  uint64_t epoch;
};
static_assert(std::is_standard_layout_v<DirEntry>);
static_assert(sizeof(DirEntry) == 24);
static_assert(std::atomic_ref<uint64_t>::is_always_lock_free);
static_assert(std::atomic_ref<int64_t>::is_always_lock_free);
// Lock-free atomics on shared memory work across processes only when address-free; the
// standard says lock-free ones should be (and on every platform we build for they are).

// REQUIRES: layer and page are within the validated layout.
DirEntry& EntryAt(char* base, const RegionLayout& l, int32_t layer, int64_t page) {
  auto* dir = reinterpret_cast<DirEntry*>(base + l.dir_offset);
  return dir[static_cast<int64_t>(layer) * l.max_pages_per_layer + page];
}

uint64_t RoundUp(uint64_t x, uint64_t m) { return (x + m - 1) / m * m; }

std::atomic_ref<uint64_t> Atomic(uint64_t& word) { return std::atomic_ref<uint64_t>(word); }
std::atomic_ref<int64_t> Atomic(int64_t& word) { return std::atomic_ref<int64_t>(word); }

absl::Status CheckBase(const void* base, size_t bytes) {
  if (base == nullptr || reinterpret_cast<uintptr_t>(base) % kRegionAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "session region base %p: must be non-null and %d-byte aligned", base, kRegionAlignment));
  }
  if (bytes < kHeaderBytes) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "session region of %d bytes: smaller than its %d-byte header", bytes, kHeaderBytes));
  }
  return absl::OkStatus();
}

// FAILED_PRECONDITION naming the first header field that differs from `want`.
absl::Status CheckHeader(const RegionHeader& h, const Geometry& g, const RegionLayout& want) {
  struct Field {
    const char* name;
    uint64_t got, want;
  };
  const Field fields[] = {
      {"num_layers", static_cast<uint64_t>(h.num_layers), static_cast<uint64_t>(g.num_layers)},
      {"num_q_heads", static_cast<uint64_t>(h.num_q_heads), static_cast<uint64_t>(g.num_q_heads)},
      {"num_kv_heads", static_cast<uint64_t>(h.num_kv_heads),
       static_cast<uint64_t>(g.num_kv_heads)},
      {"head_dim", static_cast<uint64_t>(h.head_dim), static_cast<uint64_t>(g.head_dim)},
      {"page_size", static_cast<uint64_t>(h.page_size), static_cast<uint64_t>(g.page_size)},
      {"dtype", h.dtype, static_cast<uint64_t>(g.dtype)},
      {"dir_offset", h.dir_offset, want.dir_offset},
      {"slots_offset", h.slots_offset, want.slots_offset},
      {"slot_stride", h.slot_stride, want.slot_stride},
      {"total_bytes", h.total_bytes, want.total_bytes},
  };
  for (const Field& f : fields) {
    if (f.got != f.want) {
      return absl::FailedPreconditionError(
          absl::StrFormat("session region header %s = %d: expected %d", f.name, f.got, f.want));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<RegionLayout> ComputeRegionLayout(const Geometry& g, int32_t max_pages_per_layer,
                                                 int64_t num_slots) {
  KVTIER_RETURN_IF_ERROR(g.Validate());
  if (max_pages_per_layer < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "session region max_pages_per_layer = %d: must be >= 1", max_pages_per_layer));
  }
  if (num_slots < 1 || num_slots > PagePool::kMaxSlots) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "session region num_slots = %d: must be in [1, %d]", num_slots, PagePool::kMaxSlots));
  }
  RegionLayout l;
  l.max_pages_per_layer = max_pages_per_layer;
  l.num_slots = num_slots;
  l.dir_offset = kHeaderBytes;
  // No overflow: layers <= 1024, pages < 2^31, 24-byte entries: < 2^60.
  const uint64_t dir_bytes =
      static_cast<uint64_t>(g.num_layers) * max_pages_per_layer * sizeof(DirEntry);
  l.slots_offset =
      RoundUp(l.dir_offset + dir_bytes, std::max<uint64_t>(kHeaderBytes, PagePool::kSlotAlignment));
  l.slot_stride = RoundUp(g.host_page_bytes(), PagePool::kSlotAlignment);
  const uint64_t max = HostArena::kMaxBytes;
  if (l.slots_offset > max ||
      static_cast<uint64_t>(num_slots) > (max - l.slots_offset) / l.slot_stride) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "session region of %d pages per layer and %d slots of %d bytes: exceeds %d bytes",
        max_pages_per_layer, num_slots, l.slot_stride, max));
  }
  l.total_bytes =
      RoundUp(l.slots_offset + static_cast<uint64_t>(num_slots) * l.slot_stride, kRegionAlignment);
  return l;
}

absl::StatusOr<SessionRegion> SessionRegion::Format(void* base, size_t bytes, const Geometry& g,
                                                    int32_t max_pages_per_layer,
                                                    int64_t num_slots) {
  KVTIER_ASSIGN_OR_RETURN(const RegionLayout l,
                          ComputeRegionLayout(g, max_pages_per_layer, num_slots));
  KVTIER_RETURN_IF_ERROR(CheckBase(base, bytes));
  if (bytes < l.total_bytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("session region of %d bytes: the layout needs %d", bytes, l.total_bytes));
  }
  char* p = static_cast<char*>(base);
  // Magic last: a region is recognisable only once everything else is in place.
  std::memset(p, 0, l.slots_offset);
  RegionHeader h{};
  h.layout_version = kRegionLayoutVersion;
  h.dtype = static_cast<uint32_t>(g.dtype);
  h.total_bytes = l.total_bytes;
  h.num_layers = g.num_layers;
  h.num_q_heads = g.num_q_heads;
  h.num_kv_heads = g.num_kv_heads;
  h.head_dim = g.head_dim;
  h.page_size = g.page_size;
  h.max_pages_per_layer = max_pages_per_layer;
  h.num_slots = num_slots;
  h.dir_offset = l.dir_offset;
  h.slots_offset = l.slots_offset;
  h.slot_stride = l.slot_stride;
  h.epoch = 1;
  std::memcpy(p, &h, sizeof(h));
  TelemetryBlock(p + kTelemetryOffset).Format();
  auto* header = reinterpret_cast<RegionHeader*>(p);
  Atomic(header->magic).store(kRegionMagic, std::memory_order_release);
  return SessionRegion(p, l, g);
}

absl::StatusOr<SessionRegion> SessionRegion::Open(void* base, size_t bytes,
                                                  const Geometry& expected) {
  KVTIER_RETURN_IF_ERROR(expected.Validate());
  KVTIER_RETURN_IF_ERROR(CheckBase(base, bytes));
  char* p = static_cast<char*>(base);
  const uint64_t magic =
      Atomic(reinterpret_cast<RegionHeader*>(p)->magic).load(std::memory_order_acquire);
  RegionHeader h;  // one snapshot; only what is validated from it is used after
  std::memcpy(&h, p, sizeof(h));
  if (magic != kRegionMagic) {
    return absl::FailedPreconditionError(
        absl::StrFormat("session region magic = %#x: expected %#x", magic, kRegionMagic));
  }
  if (h.layout_version != kRegionLayoutVersion) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "session region layout_version = %d: expected %d", h.layout_version, kRegionLayoutVersion));
  }
  absl::StatusOr<RegionLayout> l =
      ComputeRegionLayout(expected, h.max_pages_per_layer, h.num_slots);
  if (!l.ok()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("session region header max_pages_per_layer = %d, num_slots = %d: %s",
                        h.max_pages_per_layer, h.num_slots, l.status().message()));
  }
  KVTIER_RETURN_IF_ERROR(CheckHeader(h, expected, *l));
  if (l->total_bytes > bytes) {
    return absl::FailedPreconditionError(
        absl::StrFormat("session region header total_bytes = %d: exceeds the %d bytes mapped",
                        l->total_bytes, bytes));
  }
  return SessionRegion(p, *l, expected);
}

TelemetryBlock SessionRegion::telemetry() const { return TelemetryBlock(base_ + kTelemetryOffset); }

void* SessionRegion::slots() const { return base_ + layout_.slots_offset; }

const void* SessionRegion::SlotData(int64_t slot) const {
  return base_ + layout_.slots_offset + static_cast<uint64_t>(slot) * layout_.slot_stride;
}

absl::Status SessionRegion::Commit(int32_t layer, int64_t page, int64_t slot, uint64_t generation,
                                   uint64_t epoch) {
  if (generation == 0) {
    return absl::InvalidArgumentError("session region commit generation = 0: must be >= 1");
  }
  if (layer < 0 || layer >= geometry_.num_layers || page < 0 ||
      page >= layout_.max_pages_per_layer || slot < 0 || slot >= layout_.num_slots) {
    return absl::OutOfRangeError(absl::StrFormat(
        "session region commit (layer %d, page %d, slot %d): must be in [0, %d) x [0, %d) x [0, "
        "%d)",
        layer, page, slot, geometry_.num_layers, layout_.max_pages_per_layer, layout_.num_slots));
  }
  const uint64_t current = this->epoch();
  if (current > epoch) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "session region commit with epoch %d: the region moved on to epoch %d", epoch, current));
  }
  DirEntry& e = EntryAt(base_, layout_, layer, page);
  // Withdraw first: a reader that sees the new slot or epoch (acquire) then also sees a
  // stamp other than the one it read before them, and retries (Lookup).
  Atomic(e.stamp).store(0, std::memory_order_relaxed);
  Atomic(e.slot).store(slot, std::memory_order_release);
  Atomic(e.epoch).store(epoch, std::memory_order_release);
  Atomic(e.stamp).store(generation, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status SessionRegion::Uncommit(int32_t layer, int64_t page) {
  if (layer < 0 || layer >= geometry_.num_layers || page < 0 ||
      page > layout_.max_pages_per_layer) {
    return absl::OutOfRangeError(
        absl::StrFormat("session region uncommit (layer %d, page %d): must be in [0, %d) x [0, %d]",
                        layer, page, geometry_.num_layers, layout_.max_pages_per_layer));
  }
  // Front to back, so CommittedPrefix never grows while this runs.
  for (int64_t i = page; i < layout_.max_pages_per_layer; ++i) {
    Atomic(EntryAt(base_, layout_, layer, i).stamp).store(0, std::memory_order_release);
  }
  return absl::OkStatus();
}

absl::Status SessionRegion::Withdraw(int32_t layer, int64_t page) {
  if (layer < 0 || layer >= geometry_.num_layers || page < 0 ||
      page >= layout_.max_pages_per_layer) {
    return absl::OutOfRangeError(absl::StrFormat(
        "session region withdraw (layer %d, page %d): must be in [0, %d) x [0, %d)", layer, page,
        geometry_.num_layers, layout_.max_pages_per_layer));
  }
  Atomic(EntryAt(base_, layout_, layer, page).stamp).store(0, std::memory_order_release);
  return absl::OkStatus();
}

absl::StatusOr<CommittedPage> SessionRegion::Lookup(int32_t layer, int64_t page) const {
  if (layer < 0 || layer >= geometry_.num_layers || page < 0 ||
      page >= layout_.max_pages_per_layer) {
    return absl::OutOfRangeError(
        absl::StrFormat("session region lookup (layer %d, page %d): must be in [0, %d) x [0, %d)",
                        layer, page, geometry_.num_layers, layout_.max_pages_per_layer));
  }
  DirEntry& e = EntryAt(base_, layout_, layer, page);
  // A writer may re-commit the entry while we read it: re-read the stamp and retry, so slot
  // and epoch belong to the stamp we return (a seqlock read).
  constexpr int kAttempts = 16;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    CommittedPage c;
    c.generation = Atomic(e.stamp).load(std::memory_order_acquire);
    if (c.generation == 0) {
      return absl::NotFoundError(
          absl::StrFormat("session region (layer %d, page %d): not committed", layer, page));
    }
    // Acquire loads order the re-read after them (no fence: TSan does not model fences).
    c.slot = Atomic(e.slot).load(std::memory_order_acquire);
    c.epoch = Atomic(e.epoch).load(std::memory_order_acquire);
    if (Atomic(e.stamp).load(std::memory_order_relaxed) != c.generation) continue;
    if (c.slot < 0 || c.slot >= layout_.num_slots) {
      return absl::DataLossError(
          absl::StrFormat("session region (layer %d, page %d) names slot %d: outside [0, %d)",
                          layer, page, c.slot, layout_.num_slots));
    }
    return c;
  }
  return absl::AbortedError(absl::StrFormat(
      "session region (layer %d, page %d): changed under %d reads", layer, page, kAttempts));
}

int64_t SessionRegion::CommittedPrefix(int32_t layer) const {
  if (layer < 0 || layer >= geometry_.num_layers) return 0;
  int64_t n = 0;
  while (n < layout_.max_pages_per_layer &&
         Atomic(EntryAt(base_, layout_, layer, n).stamp).load(std::memory_order_acquire) != 0) {
    ++n;
  }
  return n;
}

int64_t SessionRegion::CommittedPages() const {
  int64_t n = 0;
  for (int32_t layer = 0; layer < geometry_.num_layers; ++layer) {
    for (int64_t page = 0; page < layout_.max_pages_per_layer; ++page) {
      if (Atomic(EntryAt(base_, layout_, layer, page).stamp).load(std::memory_order_acquire) != 0)
        ++n;
    }
  }
  return n;
}

uint64_t SessionRegion::epoch() const {
  return Atomic(reinterpret_cast<RegionHeader*>(base_)->epoch).load(std::memory_order_acquire);
}

absl::StatusOr<uint64_t> SessionRegion::BumpEpoch(uint64_t at_least) {
  auto epoch = Atomic(reinterpret_cast<RegionHeader*>(base_)->epoch);
  uint64_t current = epoch.load(std::memory_order_acquire);
  for (;;) {
    const uint64_t base = std::max(current, at_least);
    if (base == std::numeric_limits<uint64_t>::max()) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "the session region's epoch is %d, the largest value: it cannot advance to fence the "
          "previous holder (the region header was overwritten); open a new session",
          base));
    }
    if (epoch.compare_exchange_weak(current, base + 1, std::memory_order_acq_rel)) {
      return base + 1;
    }
  }
}

}  // namespace kvtier
