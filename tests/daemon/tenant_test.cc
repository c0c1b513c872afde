// Tenant and RegionAllocator: carving, reserving and adopting session regions of a tenant's
// arena, and an arena kept in a file (TenantConfig::arena_path) across Tenant lifetimes.
#include "daemon/tenant.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "offload/session_region.h"
#include "tests/testutil/arena_dir.h"

namespace kvtier::daemon {
namespace {

using ::kvtier::testing::ArenaFileDir;

using ::testing::HasSubstr;

constexpr uint64_t kUnit = 64;
constexpr uint64_t kAlign = kRegionAlignment;
constexpr uint64_t kMiB = uint64_t{1} << 20;

// ---- RegionAllocator::Reserve --------------------------------------------------------------

TEST(RegionAllocatorReserveTest, MiddleOfAFreeRangeSplitsIt) {
  RegionAllocator a(10 * kUnit, kUnit);
  ASSERT_TRUE(a.Reserve(3 * kUnit, 2 * kUnit - 1));  // rounded up to 2 units: [3, 5)
  EXPECT_EQ(a.free_bytes(), 8 * kUnit);
  EXPECT_EQ(a.free_ranges(), 2u);  // [0, 3) and [5, 10)
  EXPECT_EQ(a.largest_free(), 5 * kUnit);
  // First fit now sees the split: 4 units only fit after the reserved range.
  EXPECT_EQ(a.Allocate(4 * kUnit), std::optional<uint64_t>(5 * kUnit));
  EXPECT_EQ(a.Allocate(3 * kUnit), std::optional<uint64_t>(0));
  EXPECT_EQ(a.Allocate(kUnit), std::optional<uint64_t>(9 * kUnit));
  EXPECT_EQ(a.free_bytes(), 0u);
  // Freeing the reserved range works like freeing an allocated one.
  a.Free(3 * kUnit, 2 * kUnit);
  EXPECT_EQ(a.free_bytes(), 2 * kUnit);
  EXPECT_EQ(a.Allocate(2 * kUnit), std::optional<uint64_t>(3 * kUnit));
}

TEST(RegionAllocatorReserveTest, FreeAfterReserveCoalescesBackToOneRange) {
  RegionAllocator a(10 * kUnit, kUnit);
  ASSERT_TRUE(a.Reserve(4 * kUnit, kUnit));
  EXPECT_EQ(a.free_ranges(), 2u);
  a.Free(4 * kUnit, kUnit);
  EXPECT_EQ(a.free_ranges(), 1u);
  EXPECT_EQ(a.free_bytes(), 10 * kUnit);
  ASSERT_TRUE(a.Reserve(0, 10 * kUnit));  // the whole capacity
  EXPECT_EQ(a.free_bytes(), 0u);
  EXPECT_EQ(a.free_ranges(), 0u);
}

TEST(RegionAllocatorReserveTest, OverlappingAnAllocationIsRefusedAndChangesNothing) {
  RegionAllocator a(10 * kUnit, kUnit);
  ASSERT_EQ(a.Allocate(2 * kUnit), std::optional<uint64_t>(0));          // [0, 2)
  ASSERT_EQ(a.Allocate(2 * kUnit), std::optional<uint64_t>(2 * kUnit));  // [2, 4)
  // Free: [0, 2) and [4, 10).
  a.Free(0, 2 * kUnit);
  const uint64_t free_before = a.free_bytes();
  const size_t ranges_before = a.free_ranges();
  for (const auto& [offset, bytes] : std::initializer_list<std::pair<uint64_t, uint64_t>>{
           {2 * kUnit, kUnit},      // inside the allocation
           {kUnit, 2 * kUnit},      // the free range's tail and the allocation's head
           {3 * kUnit, 2 * kUnit},  // the allocation's tail and the next free range
           {0, 10 * kUnit},         // everything
           {0, 3 * kUnit}}) {       // more than the first free range holds
    EXPECT_FALSE(a.Reserve(offset, bytes)) << offset << " + " << bytes;
    EXPECT_EQ(a.free_bytes(), free_before);
    EXPECT_EQ(a.free_ranges(), ranges_before);
  }
  // Right next to the allocation, on either side, is fine.
  EXPECT_TRUE(a.Reserve(kUnit, kUnit));
  EXPECT_TRUE(a.Reserve(4 * kUnit, kUnit));
  EXPECT_EQ(a.free_bytes(), free_before - 2 * kUnit);
}

TEST(RegionAllocatorReserveTest, AtTheEndAndBeyondIt) {
  RegionAllocator a(10 * kUnit, kUnit);
  EXPECT_FALSE(a.Reserve(9 * kUnit, 2 * kUnit));                   // reaches past the capacity
  EXPECT_FALSE(a.Reserve(10 * kUnit, kUnit));                      // starts at the capacity
  EXPECT_FALSE(a.Reserve(UINT64_MAX / kUnit * kUnit, 2 * kUnit));  // no wrap-around
  ASSERT_TRUE(a.Reserve(9 * kUnit, kUnit));                        // the last unit
  EXPECT_EQ(a.free_ranges(), 1u);
  EXPECT_EQ(a.largest_free(), 9 * kUnit);
  EXPECT_FALSE(a.Reserve(9 * kUnit, kUnit));  // taken already
  EXPECT_FALSE(a.Reserve(8 * kUnit, 2 * kUnit));
  EXPECT_EQ(a.Allocate(9 * kUnit), std::optional<uint64_t>(0));
  EXPECT_EQ(a.free_bytes(), 0u);
}

TEST(RegionAllocatorReserveTest, EmptyAndMisalignedAreRefused) {
  RegionAllocator a(10 * kUnit, kUnit);
  EXPECT_FALSE(a.Reserve(0, 0));
  EXPECT_FALSE(a.Reserve(kUnit / 2, kUnit));
  EXPECT_FALSE(a.Reserve(0, 11 * kUnit));
  EXPECT_EQ(a.free_bytes(), 10 * kUnit);
  EXPECT_EQ(a.free_ranges(), 1u);
}

// ---- Tenant::AdoptRegion -------------------------------------------------------------------

TenantConfig SmallTenant(const std::string& name = "a") {
  TenantConfig config;
  config.name = name;
  config.host_memory_bytes = kMiB;  // 16 regions of 64 KiB
  config.hugepages = "off";
  config.lock = false;
  return config;
}

std::unique_ptr<Tenant> MakeTenant(const TenantConfig& config) {
  absl::StatusOr<std::unique_ptr<Tenant>> tenant = Tenant::Create(config);
  EXPECT_TRUE(tenant.ok()) << tenant.status();
  return tenant.ok() ? *std::move(tenant) : nullptr;
}

TEST(TenantAdoptRegionTest, LeasesExactlyTheRangeAndAllocationAvoidsIt) {
  std::unique_ptr<Tenant> tenant = MakeTenant(SmallTenant());
  ASSERT_NE(tenant, nullptr);
  ASSERT_EQ(tenant->quota_bytes(), kMiB);
  absl::StatusOr<RegionLease> adopted = tenant->AdoptRegion(2 * kAlign, 3 * kAlign - 100);
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  EXPECT_TRUE(adopted->valid());
  EXPECT_EQ(adopted->offset(), 2 * kAlign);
  EXPECT_EQ(adopted->bytes(), 3 * kAlign);
  EXPECT_EQ(adopted->data(), static_cast<char*>(tenant->arena().data()) + 2 * kAlign);
  EXPECT_EQ(tenant->used_bytes(), 3 * kAlign);

  // First fit: the two regions before it, then the ones after it.
  absl::StatusOr<RegionLease> first = tenant->AllocateRegion(2 * kAlign);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->offset(), 0u);
  absl::StatusOr<RegionLease> next = tenant->AllocateRegion(kAlign);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->offset(), 5 * kAlign);

  // Released, the range can be adopted (or allocated) again.
  adopted->Release();
  EXPECT_EQ(tenant->used_bytes(), 3 * kAlign);
  absl::StatusOr<RegionLease> again = tenant->AdoptRegion(2 * kAlign, 3 * kAlign);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(tenant->used_bytes(), 6 * kAlign);
}

TEST(TenantAdoptRegionTest, RefusesTakenMisalignedAndOutOfQuotaRanges) {
  std::unique_ptr<Tenant> tenant = MakeTenant(SmallTenant());
  ASSERT_NE(tenant, nullptr);
  absl::StatusOr<RegionLease> held = tenant->AdoptRegion(4 * kAlign, 2 * kAlign);
  ASSERT_TRUE(held.ok()) << held.status();
  const uint64_t used = tenant->used_bytes();

  struct Case {
    uint64_t offset;
    uint64_t bytes;
    std::string message;
  };
  const Case cases[] = {
      {5 * kAlign, kAlign, "not free"},
      {3 * kAlign, 2 * kAlign, "not free"},
      {4 * kAlign, 2 * kAlign, "not free"},
      {kAlign + 4096, kAlign, "not a multiple of 65536"},
      {15 * kAlign, 2 * kAlign, "beyond the tenant's quota of 1048576 bytes"},
      {16 * kAlign, kAlign, "beyond the tenant's quota"},
      {UINT64_MAX / kAlign * kAlign, 2 * kAlign, "beyond the tenant's quota"},
      {0, 0, "empty"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<RegionLease> lease = tenant->AdoptRegion(c.offset, c.bytes);
    ASSERT_FALSE(lease.ok()) << c.offset << " + " << c.bytes;
    EXPECT_EQ(lease.status().code(), absl::StatusCode::kFailedPrecondition) << lease.status();
    EXPECT_THAT(lease.status().message(), HasSubstr("tenant 'a'"));
    EXPECT_THAT(lease.status().message(), HasSubstr(c.message));
    EXPECT_EQ(tenant->used_bytes(), used);
  }
  absl::StatusOr<RegionLease> overlap = tenant->AdoptRegion(3 * kAlign, 2 * kAlign);
  EXPECT_THAT(overlap.status().message(),
              HasSubstr(absl::StrCat("[", 3 * kAlign, ", ", 5 * kAlign, ")")));
}

TEST(TenantAdoptRegionTest, ChargedDaemonMemoryCountsAgainstTheQuota) {
  std::unique_ptr<Tenant> tenant = MakeTenant(SmallTenant());
  ASSERT_NE(tenant, nullptr);
  ASSERT_TRUE(tenant->Charge(kMiB - kAlign).ok());
  absl::StatusOr<RegionLease> too_big = tenant->AdoptRegion(0, 2 * kAlign);
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted) << too_big.status();
  EXPECT_THAT(too_big.status().message(), HasSubstr("daemon memory"));
  EXPECT_EQ(tenant->used_bytes(), kMiB - kAlign);  // nothing taken
  absl::StatusOr<RegionLease> fits = tenant->AdoptRegion(15 * kAlign, kAlign);
  ASSERT_TRUE(fits.ok()) << fits.status();
  tenant->Release(kMiB - kAlign);
}

// ---- TenantConfig::arena_path ----------------------------------------------------------------

TEST(TenantArenaFileTest, ARecreatedTenantMapsTheSameBytesAndAdoptsTheRegion) {
  TenantConfig config = SmallTenant("persistent");
  config.arena_path = absl::StrCat(ArenaFileDir(), "/kvtier-tenant-test-", getpid(), ".arena");
  unlink(config.arena_path.c_str());
  constexpr char kText[] = "a session that outlives its daemon";
  {
    std::unique_ptr<Tenant> tenant = MakeTenant(config);
    ASSERT_NE(tenant, nullptr);
    EXPECT_EQ(tenant->arena().report().path, config.arena_path);
    EXPECT_FALSE(tenant->arena().report().existed);
    absl::StatusOr<RegionLease> first = tenant->AllocateRegion(kAlign);  // [0, kAlign)
    ASSERT_TRUE(first.ok()) << first.status();
    absl::StatusOr<RegionLease> region = tenant->AllocateRegion(2 * kAlign);
    ASSERT_TRUE(region.ok()) << region.status();
    ASSERT_EQ(region->offset(), kAlign);
    std::memcpy(region->data(), kText, sizeof(kText));
  }
  {
    std::unique_ptr<Tenant> tenant = MakeTenant(config);
    ASSERT_NE(tenant, nullptr);
    EXPECT_TRUE(tenant->arena().report().existed);
    absl::StatusOr<RegionLease> region = tenant->AdoptRegion(kAlign, 2 * kAlign);
    ASSERT_TRUE(region.ok()) << region.status();
    EXPECT_STREQ(static_cast<const char*>(region->data()), kText);
  }
  // Another size for the same file is refused and names the file.
  TenantConfig bigger = config;
  bigger.host_memory_bytes = 2 * kMiB;
  absl::StatusOr<std::unique_ptr<Tenant>> refused = Tenant::Create(bigger);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("tenant 'persistent'"));
  EXPECT_THAT(refused.status().message(), HasSubstr(config.arena_path));
  unlink(config.arena_path.c_str());
}

}  // namespace
}  // namespace kvtier::daemon
