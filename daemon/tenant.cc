#include "daemon/tenant.h"

#include <algorithm>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "core/status.h"
#include "offload/numa_topology.h"
#include "offload/session_region.h"
#include "spdlog/spdlog.h"

namespace kvtier::daemon {

// ---- RegionAllocator ----------------------------------------------------------------------

RegionAllocator::RegionAllocator(uint64_t capacity, uint64_t unit)
    : capacity_(capacity / unit * unit), unit_(unit), free_bytes_(capacity_) {
  if (capacity_ > 0) free_.emplace(0, capacity_);
}

std::optional<uint64_t> RegionAllocator::Allocate(uint64_t bytes) {
  if (bytes == 0 || bytes > capacity_) return std::nullopt;
  const uint64_t need = RoundUp(bytes);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    const uint64_t offset = it->first;
    const uint64_t rest = it->second - need;
    free_.erase(it);
    if (rest > 0) free_.emplace(offset + need, rest);
    free_bytes_ -= need;
    return offset;
  }
  return std::nullopt;
}

void RegionAllocator::Free(uint64_t offset, uint64_t bytes) {
  uint64_t begin = offset;
  uint64_t length = RoundUp(bytes);
  free_bytes_ += length;
  // Merge with the free range that ends where this one begins, and the one that begins
  // where it ends: the list never holds two adjacent ranges.
  auto next = free_.lower_bound(begin);
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == begin) {
      begin = prev->first;
      length += prev->second;
      free_.erase(prev);
    }
  }
  if (next != free_.end() && begin + length == next->first) {
    length += next->second;
    free_.erase(next);
  }
  free_.emplace(begin, length);
}

bool RegionAllocator::Reserve(uint64_t offset, uint64_t bytes) {
  if (bytes == 0 || offset % unit_ != 0 || bytes > capacity_) return false;
  const uint64_t need = RoundUp(bytes);
  if (offset > capacity_ || need > capacity_ - offset) return false;
  // The free range that starts at or before offset is the only one that can hold it.
  auto it = free_.upper_bound(offset);
  if (it == free_.begin()) return false;
  --it;
  const uint64_t range_begin = it->first;
  const uint64_t range_end = it->first + it->second;
  const uint64_t end = offset + need;
  if (end > range_end) return false;  // also when the range ends before offset
  free_.erase(it);
  if (range_begin < offset) free_.emplace(range_begin, offset - range_begin);
  if (end < range_end) free_.emplace(end, range_end - end);
  free_bytes_ -= need;
  return true;
}

uint64_t RegionAllocator::largest_free() const {
  uint64_t best = 0;
  for (const auto& [offset, length] : free_) best = std::max(best, length);
  return best;
}

// ---- RegionLease --------------------------------------------------------------------------

RegionLease& RegionLease::operator=(RegionLease&& other) noexcept {
  if (this != &other) {
    Release();
    tenant_ = std::exchange(other.tenant_, nullptr);
    offset_ = std::exchange(other.offset_, 0);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void* RegionLease::data() const { return static_cast<char*>(tenant_->arena().data()) + offset_; }

void RegionLease::Release() {
  if (tenant_ == nullptr) return;
  std::exchange(tenant_, nullptr)->FreeRegion(offset_, bytes_);
  offset_ = bytes_ = 0;
}

// ---- Tenant -------------------------------------------------------------------------------

namespace {

absl::StatusOr<HugePages> ParseHugePages(const TenantConfig& c) {
  if (c.hugepages == "off") return HugePages::kOff;
  if (c.hugepages == "auto") return HugePages::kAuto;
  if (c.hugepages == "require") return HugePages::kRequire;
  return absl::InvalidArgumentError(
      absl::StrFormat("tenant '%s': hugepages = '%s': must be off, auto or require", c.name,
                      absl::CHexEscape(c.hugepages)));
}

// The node to bind to: the configured one, else the GPU's, else none (-1).
int ResolveNumaNode(const TenantConfig& c) {
  if (c.numa_node >= 0 || c.gpu_pci_bus_id.empty()) return c.numa_node;
  absl::StatusOr<int> node = NumaNodeOfPciDevice(c.gpu_pci_bus_id);
  if (!node.ok()) {
    spdlog::warn("tenant '{}': no NUMA node for gpu_pci_bus_id {} ({}); the arena is not bound",
                 c.name, c.gpu_pci_bus_id, node.status().ToString());
    return -1;
  }
  if (*node < 0) {
    spdlog::info("tenant '{}': GPU {} has no single nearest NUMA node; the arena is not bound",
                 c.name, c.gpu_pci_bus_id);
  }
  return *node;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tenant>> Tenant::Create(const TenantConfig& config) {
  if (config.host_memory_bytes < kRegionAlignment ||
      config.host_memory_bytes > HostArena::kMaxBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tenant '%s': host_memory_bytes = %d: must be in [%d, %d]", config.name,
                        config.host_memory_bytes, kRegionAlignment, HostArena::kMaxBytes));
  }
  ArenaOptions options;
  // Whole regions only: the arena is a multiple of kRegionAlignment.
  options.bytes =
      (config.host_memory_bytes + kRegionAlignment - 1) / kRegionAlignment * kRegionAlignment;
  options.name = "kvtier-" + config.name;
  KVTIER_ASSIGN_OR_RETURN(options.hugepages, ParseHugePages(config));
  options.numa_node = ResolveNumaNode(config);
  options.lock = config.lock;
  options.path = config.arena_path;
  absl::StatusOr<std::unique_ptr<HostArena>> arena = HostArena::Create(options);
  if (!arena.ok()) {
    return absl::Status(arena.status().code(),
                        absl::StrFormat("tenant '%s': %s", config.name, arena.status().message()));
  }
  for (absl::string_view line : absl::StrSplit((*arena)->report().ToString(), '\n')) {
    if (!line.empty()) spdlog::info("tenant '{}': {}", config.name, std::string(line));
  }
  return std::unique_ptr<Tenant>(new Tenant(config, *std::move(arena)));
}

Tenant::Tenant(const TenantConfig& config, std::unique_ptr<HostArena> arena)
    : config_(config),
      arena_(std::move(arena)),
      allocator_capacity_(arena_->size() / kRegionAlignment * kRegionAlignment),
      allocator_(arena_->size(), kRegionAlignment) {}

absl::StatusOr<RegionLease> Tenant::AllocateRegion(uint64_t bytes) {
  MutexLock lock(&mu_);
  const uint64_t need = allocator_.RoundUp(bytes);
  const uint64_t free = allocator_.free_bytes() - charged_;
  // Charged daemon memory takes quota but no address range: a region must fit both.
  std::optional<uint64_t> offset =
      need <= free ? allocator_.Allocate(bytes) : std::optional<uint64_t>();
  if (!offset.has_value()) {
    std::string msg = absl::StrFormat("tenant '%s': session needs %d bytes, %d of %d bytes free",
                                      name(), need, free, quota_bytes());
    if (charged_ > 0) {
      absl::StrAppendFormat(&msg, " (%d bytes are daemon memory of GRPC sessions)", charged_);
    }
    if (free >= need) {
      absl::StrAppendFormat(&msg, " (the largest free range is %d bytes)",
                            allocator_.largest_free());
    }
    return absl::ResourceExhaustedError(std::move(msg));
  }
  return RegionLease(this, *offset, allocator_.RoundUp(bytes));
}

absl::StatusOr<RegionLease> Tenant::AdoptRegion(uint64_t offset, uint64_t bytes) {
  MutexLock lock(&mu_);
  const uint64_t need = allocator_.RoundUp(bytes);
  const auto refuse = [&](absl::string_view why) {
    return absl::FailedPreconditionError(
        absl::StrFormat("tenant '%s': cannot adopt the region [%d, %d) (%d bytes): %s", name(),
                        offset, offset + need, bytes, why));
  };
  if (bytes == 0) return refuse("it is empty");
  if (offset % kRegionAlignment != 0) {
    return refuse(absl::StrFormat("the offset is not a multiple of %d bytes", kRegionAlignment));
  }
  if (offset > quota_bytes() || need > quota_bytes() - offset) {
    return refuse(absl::StrFormat("it reaches beyond the tenant's quota of %d bytes (the arena)",
                                  quota_bytes()));
  }
  const uint64_t free = allocator_.free_bytes() - charged_;
  if (!allocator_.Reserve(offset, bytes)) {
    return refuse("part of it is not free (another region holds it)");
  }
  if (need > free) {
    // Free as a range, but charged daemon memory holds that much of the quota.
    allocator_.Free(offset, bytes);
    return absl::ResourceExhaustedError(absl::StrFormat(
        "tenant '%s': cannot adopt the region [%d, %d) (%d bytes): %d of %d bytes of the quota "
        "free (%d bytes are daemon memory of GRPC sessions)",
        name(), offset, offset + need, bytes, free, quota_bytes(), charged_));
  }
  return RegionLease(this, offset, need);
}

uint64_t Tenant::used_bytes() const {
  MutexLock lock(&mu_);
  return allocator_.used_bytes() + charged_;
}

uint64_t Tenant::charged_bytes() const {
  MutexLock lock(&mu_);
  return charged_;
}

absl::Status Tenant::Charge(size_t bytes) {
  MutexLock lock(&mu_);
  const uint64_t free = allocator_.free_bytes() - charged_;
  if (bytes > free) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "tenant '%s': daemon memory of a GRPC session needs %d more bytes, %d of %d bytes of "
        "the tenant's quota (tenant.host_memory_bytes) free",
        name(), bytes, free, quota_bytes()));
  }
  charged_ += bytes;
  return absl::OkStatus();
}

void Tenant::Release(size_t bytes) {
  MutexLock lock(&mu_);
  KVTIER_CHECK(bytes <= charged_);
  charged_ -= bytes;
}

void Tenant::FreeRegion(uint64_t offset, uint64_t bytes) {
  MutexLock lock(&mu_);
  allocator_.Free(offset, bytes);
}

}  // namespace kvtier::daemon
