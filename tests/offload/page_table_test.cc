#include "offload/page_table.h"

#include <memory>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier {
namespace {

using ::testing::HasSubstr;

class PageTableTest : public ::testing::Test {
 protected:
  static constexpr int64_t kSlots = 8;

  void SetUp() override {
    memory_.resize(kSlots * 256 / sizeof(uint64_t) + 32);
    // Align the base to 256 bytes inside the vector.
    auto address = reinterpret_cast<uintptr_t>(memory_.data());
    void* base = reinterpret_cast<void*>((address + 255) / 256 * 256);
    pool_ = *PagePool::Create(base, 256, kSlots);
    other_pool_ = *PagePool::Create(base, 256, kSlots);
  }

  PageHandle Page() { return *pool_->Allocate(); }

  std::vector<uint64_t> memory_;
  std::unique_ptr<PagePool> pool_;
  std::unique_ptr<PagePool> other_pool_;
};

TEST_F(PageTableTest, InsertThenLookupGivesSlotAndGeneration) {
  PageTable table(*pool_);
  PageHandle page = Page();
  const PageEntry expected{page.slot(), page.generation()};
  ASSERT_TRUE(table.Insert(7, std::move(page)).ok());
  EXPECT_EQ(table.size(), 1u);
  EXPECT_TRUE(table.Contains(7));
  absl::StatusOr<PageEntry> entry = table.Lookup(7);
  ASSERT_TRUE(entry.ok()) << entry.status();
  EXPECT_EQ(*entry, expected);
  EXPECT_TRUE(table.IsCurrent(*entry));
  EXPECT_EQ(pool_->stats().in_use, 1);  // the table owns the page
}

TEST_F(PageTableTest, MissingPageIsNotFound) {
  PageTable table(*pool_);
  absl::StatusOr<PageEntry> entry = table.Lookup(3);
  EXPECT_EQ(entry.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(entry.status().message(), HasSubstr("logical page 3"));
  EXPECT_EQ(table.Erase(3).code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(table.Contains(3));
}

TEST_F(PageTableTest, InsertingAPresentPageFailsAndFreesTheNewOne) {
  PageTable table(*pool_);
  ASSERT_TRUE(table.Insert(0, Page()).ok());
  const PageEntry first = *table.Lookup(0);
  const absl::Status s = table.Insert(0, Page());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("already"));
  EXPECT_EQ(*table.Lookup(0), first);  // unchanged
  EXPECT_EQ(pool_->stats().in_use, 1);
}

TEST_F(PageTableTest, RejectsNegativeIndicesEmptyAndForeignPages) {
  PageTable table(*pool_);
  EXPECT_EQ(table.Insert(-1, Page()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table.Insert(0, PageHandle()).code(), absl::StatusCode::kInvalidArgument);
  const absl::Status foreign = table.Insert(0, *other_pool_->Allocate());
  EXPECT_EQ(foreign.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(foreign.message(), HasSubstr("another pool"));
  EXPECT_EQ(table.size(), 0u);
  EXPECT_EQ(pool_->stats().in_use, 0);
  EXPECT_EQ(other_pool_->stats().in_use, 0);
}

TEST_F(PageTableTest, EraseFreesTheSlotAndStalesTheEntry) {
  PageTable table(*pool_);
  ASSERT_TRUE(table.Insert(5, Page()).ok());
  const PageEntry entry = *table.Lookup(5);
  ASSERT_TRUE(table.Erase(5).ok());
  EXPECT_EQ(pool_->stats().in_use, 0);
  EXPECT_FALSE(table.IsCurrent(entry));  // freed
  ASSERT_TRUE(table.Insert(6, Page()).ok());
  const PageEntry reused = *table.Lookup(6);
  EXPECT_EQ(reused.slot, entry.slot);  // LIFO reuse of the same slot...
  EXPECT_NE(reused.generation, entry.generation);
  EXPECT_FALSE(table.IsCurrent(entry));  // ...so the old entry stays stale
  EXPECT_TRUE(table.IsCurrent(reused));
}

TEST_F(PageTableTest, ClearAndDestructionFreeEverySlot) {
  {
    PageTable table(*pool_);
    for (int64_t logical = 0; logical < 4; ++logical) {
      ASSERT_TRUE(table.Insert(logical * 10, Page()).ok());
    }
    EXPECT_EQ(table.size(), 4u);
    table.Clear();
    EXPECT_EQ(table.size(), 0u);
    EXPECT_EQ(pool_->stats().in_use, 0);
    for (int64_t logical = 0; logical < kSlots; ++logical) {
      ASSERT_TRUE(table.Insert(logical, Page()).ok());
    }
    EXPECT_EQ(pool_->stats().in_use, kSlots);
    PageTable moved = std::move(table);
    EXPECT_EQ(moved.size(), static_cast<size_t>(kSlots));
    EXPECT_EQ(pool_->stats().in_use, kSlots);
  }
  EXPECT_EQ(pool_->stats().in_use, 0);
}

TEST_F(PageTableTest, EntriesOfDistinctPagesHaveDistinctSlots) {
  PageTable table(*pool_);
  for (int64_t logical = 0; logical < kSlots; ++logical) {
    ASSERT_TRUE(table.Insert(logical, Page()).ok());
  }
  std::vector<bool> used(kSlots, false);
  for (int64_t logical = 0; logical < kSlots; ++logical) {
    const PageEntry entry = *table.Lookup(logical);
    ASSERT_GE(entry.slot, 0);
    ASSERT_LT(entry.slot, kSlots);
    EXPECT_FALSE(used[entry.slot]);
    used[entry.slot] = true;
  }
}

}  // namespace
}  // namespace kvtier
