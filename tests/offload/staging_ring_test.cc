// StagingRing (offload/staging_ring.h): blocks are 64-byte aligned and disjoint, space comes
// back in acquisition order whatever order blocks are released in, a block never straddles
// the ring's end, and a full ring says so instead of blocking.
#include "offload/staging_ring.h"

#include <cstdint>
#include <memory>

#include "gtest/gtest.h"
#include "kernels/registry.h"

namespace kvtier {
namespace {

TEST(StagingRingTest, ReusesSpaceInOrderAndNeverStraddlesTheEnd) {
  std::unique_ptr<Backend> be = CreateBackend(DeviceKind::kCpu).value();
  std::unique_ptr<StagingRing> ring = StagingRing::Create(*be, 1000).value();
  EXPECT_EQ(ring->capacity(), 1024u);  // rounded up to the block alignment
  const StagingRing::Block a = ring->TryAcquire(300);  // 320 bytes
  const StagingRing::Block b = ring->TryAcquire(300);
  const StagingRing::Block c = ring->TryAcquire(300);
  ASSERT_NE(a.data, nullptr);
  ASSERT_NE(b.data, nullptr);
  ASSERT_NE(c.data, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data) % StagingRing::kAlign, 0u);
  EXPECT_EQ(b.data - a.data, 320);
  EXPECT_EQ(c.data - b.data, 320);
  EXPECT_EQ(ring->in_use(), 960u);
  // 64 bytes left at the end: a 100-byte block does not fit, and nothing was taken.
  EXPECT_EQ(ring->TryAcquire(100).data, nullptr);
  EXPECT_EQ(ring->in_use(), 960u);
  // Releasing a later block frees nothing while an earlier one is held.
  ring->Release(b.ticket);
  EXPECT_EQ(ring->in_use(), 960u);
  EXPECT_EQ(ring->TryAcquire(100).data, nullptr);
  // Releasing the first frees both; the next block wraps to the start (skipping the tail).
  ring->Release(a.ticket);
  EXPECT_EQ(ring->in_use(), 320u);
  const StagingRing::Block d = ring->TryAcquire(100);
  ASSERT_NE(d.data, nullptr);
  EXPECT_EQ(d.data, a.data);
  ring->Release(c.ticket);
  ring->Release(c.ticket);  // repeated and unknown tickets are ignored
  ring->Release(12345);
  ring->Release(d.ticket);
  EXPECT_EQ(ring->in_use(), 0u);
  EXPECT_EQ(ring->blocks(), 0u);
  // Larger than the ring, or empty: never.
  EXPECT_EQ(ring->TryAcquire(2000).data, nullptr);
  EXPECT_EQ(ring->TryAcquire(0).data, nullptr);
  EXPECT_NE(ring->TryAcquire(1024).data, nullptr);
}

TEST(StagingRingTest, RefusesBadSizes) {
  std::unique_ptr<Backend> be = CreateBackend(DeviceKind::kCpu).value();
  EXPECT_TRUE(absl::IsInvalidArgument(StagingRing::Create(*be, 0).status()));
}

}  // namespace
}  // namespace kvtier
