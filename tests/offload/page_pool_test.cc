#include "offload/page_pool.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "offload/host_arena.h"

namespace kvtier {
namespace {

using ::testing::HasSubstr;

// 256-byte aligned scratch memory for pools that need no arena.
class Memory {
 public:
  explicit Memory(size_t bytes)
      : data_(static_cast<char*>(::operator new (bytes, std::align_val_t{256}))) {}
  ~Memory() { ::operator delete (data_, std::align_val_t{256}); }
  char* data() const { return data_; }

 private:
  char* data_;
};

std::unique_ptr<PagePool> MakePool(void* base, size_t slot_bytes, int64_t num_slots) {
  absl::StatusOr<std::unique_ptr<PagePool>> pool = PagePool::Create(base, slot_bytes, num_slots);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? *std::move(pool) : nullptr;
}

TEST(PagePoolTest, SlotsAreAlignedAndHandedOutInOrder) {
  Memory memory(4 * 512);
  std::unique_ptr<PagePool> pool = MakePool(memory.data(), 300, 4);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->slot_bytes(), 300u);
  EXPECT_EQ(pool->slot_stride(), 512u);
  std::vector<PageHandle> pages;
  for (int64_t i = 0; i < 4; ++i) {
    absl::StatusOr<PageHandle> page = pool->Allocate();
    ASSERT_TRUE(page.ok()) << page.status();
    EXPECT_EQ(page->slot(), i);
    EXPECT_EQ(page->data(), memory.data() + i * 512);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(page->data()) % PagePool::kSlotAlignment, 0u);
    pages.push_back(*std::move(page));
  }
}

TEST(PagePoolTest, ExhaustionIsResourceExhaustedWithTheCounts) {
  Memory memory(3 * 256);
  std::unique_ptr<PagePool> pool = MakePool(memory.data(), 256, 3);
  ASSERT_NE(pool, nullptr);
  std::vector<PageHandle> pages;
  for (int i = 0; i < 3; ++i) pages.push_back(*pool->Allocate());
  absl::StatusOr<PageHandle> extra = pool->Allocate();
  ASSERT_FALSE(extra.ok());
  EXPECT_EQ(extra.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(extra.status().message(),
              HasSubstr("page pool exhausted: all 3 slots of 256 bytes in use"));
  EXPECT_EQ(pool->stats().exhausted, 1u);
  pages.pop_back();  // freeing one makes room again
  EXPECT_TRUE(pool->Allocate().ok());
}

TEST(PagePoolTest, FreedSlotsAreReusedLastInFirstOut) {
  Memory memory(8 * 256);
  std::unique_ptr<PagePool> pool = MakePool(memory.data(), 256, 8);
  ASSERT_NE(pool, nullptr);
  std::vector<PageHandle> pages;
  for (int i = 0; i < 5; ++i) pages.push_back(*pool->Allocate());
  pages[1].Release();
  pages[3].Release();
  pages[2].Release();
  EXPECT_EQ(pool->Allocate()->slot(), 2);  // each temporary handle frees at once
  PageHandle a = *pool->Allocate();
  PageHandle b = *pool->Allocate();
  PageHandle c = *pool->Allocate();
  EXPECT_EQ(a.slot(), 2);
  EXPECT_EQ(b.slot(), 3);
  EXPECT_EQ(c.slot(), 1);
}

TEST(PagePoolTest, GenerationsIncreaseWithEveryAllocation) {
  Memory memory(2 * 256);
  std::unique_ptr<PagePool> pool = MakePool(memory.data(), 256, 2);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->CurrentGeneration(0), 0u);
  uint64_t last = 0;
  for (int i = 0; i < 5; ++i) {
    PageHandle page = *pool->Allocate();
    ASSERT_EQ(page.slot(), 0);
    EXPECT_GT(page.generation(), last);
    EXPECT_EQ(pool->CurrentGeneration(0), page.generation());
    EXPECT_TRUE(pool->IsLive(0, page.generation()));
    last = page.generation();
  }
  EXPECT_FALSE(pool->IsLive(0, last));  // freed
  PageHandle again = *pool->Allocate();
  EXPECT_FALSE(pool->IsLive(0, last));  // reused by a newer allocation
  EXPECT_TRUE(pool->IsLive(0, again.generation()));
  EXPECT_FALSE(pool->IsLive(-1, 1));
  EXPECT_FALSE(pool->IsLive(2, 1));
}

TEST(PagePoolTest, HandlesMoveAndFreeOnce) {
  Memory memory(2 * 256);
  std::unique_ptr<PagePool> pool = MakePool(memory.data(), 256, 2);
  ASSERT_NE(pool, nullptr);
  PageHandle a = *pool->Allocate();
  const int64_t slot = a.slot();
  const uint64_t generation = a.generation();
  PageHandle b = std::move(a);
  EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_TRUE(b.valid());
  EXPECT_EQ(b.slot(), slot);
  EXPECT_EQ(b.generation(), generation);
  EXPECT_EQ(pool->stats().in_use, 1);
  a.Release();  // empty: no-op
  EXPECT_EQ(pool->stats().in_use, 1);

  PageHandle c = *pool->Allocate();
  c = std::move(b);  // c's own slot is freed, b's is taken over
  EXPECT_EQ(pool->stats().in_use, 1);
  EXPECT_EQ(c.slot(), slot);
  c.Release();
  c.Release();
  EXPECT_EQ(pool->stats().in_use, 0);
}

TEST(PagePoolTest, HandlesFreeTheirSlotsWhenDestroyed) {
  Memory memory(4 * 256);
  std::unique_ptr<PagePool> pool = MakePool(memory.data(), 256, 4);
  ASSERT_NE(pool, nullptr);
  {
    std::vector<PageHandle> pages;
    for (int i = 0; i < 4; ++i) pages.push_back(*pool->Allocate());
    EXPECT_EQ(pool->stats().in_use, 4);
    EXPECT_EQ(pool->stats().capacity, 4);
  }
  EXPECT_EQ(pool->stats().in_use, 0);
  EXPECT_EQ(pool->stats().allocations, 4u);
}

TEST(PagePoolTest, RejectsBadShapes) {
  Memory memory(1024);
  EXPECT_EQ(PagePool::Create(nullptr, 256, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PagePool::Create(memory.data() + 64, 256, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PagePool::Create(memory.data(), 0, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PagePool::Create(memory.data(), 256, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PagePool::Create(memory.data(), 256, PagePool::kMaxSlots + 1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PagePoolTest, ArenaPoolUsesTheWholeArena) {
  ArenaOptions options;
  options.bytes = 1 << 20;
  options.hugepages = HugePages::kOff;
  absl::StatusOr<std::unique_ptr<HostArena>> arena = HostArena::Create(options);
  ASSERT_TRUE(arena.ok()) << arena.status();
  absl::StatusOr<std::unique_ptr<PagePool>> pool = PagePool::CreateInArena(**arena, 16 * 1024);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ((*pool)->base(), (*arena)->data());
  EXPECT_EQ((*pool)->num_slots(), 64);
  absl::StatusOr<std::unique_ptr<PagePool>> too_big =
      PagePool::CreateInArena(**arena, (*arena)->size() + 1);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PagePoolTest, ClaimTakesThatSlotWithThatGeneration) {
  Memory memory(4 * 256);
  std::unique_ptr<PagePool> pool = MakePool(memory.data(), 256, 4);
  ASSERT_NE(pool, nullptr);
  absl::StatusOr<PageHandle> claimed = pool->Claim(2, 7);
  ASSERT_TRUE(claimed.ok()) << claimed.status();
  EXPECT_EQ(claimed->slot(), 2);
  EXPECT_EQ(claimed->generation(), 7u);
  EXPECT_EQ(claimed->data(), memory.data() + 2 * 256);
  EXPECT_TRUE(pool->IsLive(2, 7));
  EXPECT_EQ(pool->CurrentGeneration(2), 7u);
  EXPECT_EQ(pool->stats().in_use, 1);
  EXPECT_EQ(pool->stats().allocations, 0u);
  // Allocate never hands out the claimed slot: the other three, then exhaustion.
  std::vector<PageHandle> pages;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<PageHandle> page = pool->Allocate();
    ASSERT_TRUE(page.ok()) << page.status();
    EXPECT_NE(page->slot(), 2);
    pages.push_back(*std::move(page));
  }
  EXPECT_EQ(pool->Allocate().status().code(), absl::StatusCode::kResourceExhausted);
  // Freed, the slot is allocated again with the next generation.
  claimed->Release();
  EXPECT_FALSE(pool->IsLive(2, 7));
  absl::StatusOr<PageHandle> again = pool->Allocate();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->slot(), 2);
  EXPECT_EQ(again->generation(), 8u);
}

TEST(PagePoolTest, ClaimErrors) {
  Memory memory(4 * 256);
  std::unique_ptr<PagePool> pool = MakePool(memory.data(), 256, 4);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->Claim(4, 1).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(pool->Claim(-1, 1).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(pool->Claim(0, 0).status().code(), absl::StatusCode::kInvalidArgument);
  PageHandle page = *pool->Allocate();  // slot 0, generation 1
  absl::StatusOr<PageHandle> busy = pool->Claim(0, 5);
  EXPECT_EQ(busy.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(busy.status().message(), HasSubstr("in use"));
  page.Release();
  // Generation 1 again is allowed; 0 < 1 is not (checked first: INVALID_ARGUMENT).
  PageHandle next = *pool->Allocate();  // slot 0, generation 2
  next.Release();
  absl::StatusOr<PageHandle> old = pool->Claim(0, 1);
  EXPECT_EQ(old.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(old.status().message(), HasSubstr("current generation 2"));
  absl::StatusOr<PageHandle> same = pool->Claim(0, 2);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(same->generation(), 2u);
  EXPECT_EQ(pool->stats().in_use, 1);
}

// Claims in any order, interleaved with allocations and frees, keep the free stack exact:
// every slot is handed out once, and all return to the pool.
TEST(PagePoolTest, ClaimsKeepTheFreeStackConsistent) {
  constexpr int64_t kSlots = 64;
  Memory memory(kSlots * 256);
  std::unique_ptr<PagePool> pool = MakePool(memory.data(), 256, kSlots);
  ASSERT_NE(pool, nullptr);
  std::vector<PageHandle> held;
  for (int64_t slot : {5, 63, 0, 17, 18, 40}) {
    absl::StatusOr<PageHandle> page = pool->Claim(slot, 3);
    ASSERT_TRUE(page.ok()) << page.status();
    held.push_back(*std::move(page));
  }
  for (int i = 0; i < 10; ++i) held.push_back(*pool->Allocate());
  held.erase(held.begin() + 1, held.begin() + 4);  // frees 63, 0, 17
  for (int64_t slot : {63, 1, 2}) {
    absl::StatusOr<PageHandle> page = pool->Claim(slot, 9);
    ASSERT_TRUE(page.ok()) << slot << ": " << page.status();
    held.push_back(*std::move(page));
  }
  while (true) {
    absl::StatusOr<PageHandle> page = pool->Allocate();
    if (!page.ok()) break;
    held.push_back(*std::move(page));
  }
  ASSERT_EQ(static_cast<int64_t>(held.size()), kSlots);
  std::vector<int> seen(kSlots, 0);
  for (const PageHandle& page : held) ++seen[page.slot()];
  for (int64_t slot = 0; slot < kSlots; ++slot) EXPECT_EQ(seen[slot], 1) << slot;
  held.clear();
  EXPECT_EQ(pool->stats().in_use, 0);
  // Every slot can be claimed again now.
  for (int64_t slot = 0; slot < kSlots; ++slot) {
    absl::StatusOr<PageHandle> page = pool->Claim(slot, 100);
    ASSERT_TRUE(page.ok()) << slot << ": " << page.status();
    held.push_back(*std::move(page));
  }
  EXPECT_EQ(pool->Allocate().status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(PagePoolTest, ConcurrentAllocateAndFreeKeepCountsRight) {
  constexpr int kSlots = 64;
  constexpr int kThreads = 8;
  constexpr int kRounds = 2000;
  Memory memory(kSlots * 256);
  std::unique_ptr<PagePool> pool = MakePool(memory.data(), 256, kSlots);
  ASSERT_NE(pool, nullptr);
  // owner[slot] is the thread holding it, or -1: two holders of one slot is a bug.
  std::vector<std::atomic<int>> owner(kSlots);
  for (auto& o : owner) o.store(-1);
  std::atomic<int> conflicts{0};
  std::atomic<int64_t> allocated{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<PageHandle> held;
      for (int round = 0; round < kRounds; ++round) {
        // Hold up to 8 pages (8 threads · 8 ≤ 64 slots, so allocation never fails).
        if (held.size() < 8 && (round % 3 != 2)) {
          absl::StatusOr<PageHandle> page = pool->Allocate();
          if (!page.ok()) {
            conflicts.fetch_add(1);
            continue;
          }
          int expected = -1;
          if (!owner[page->slot()].compare_exchange_strong(expected, t)) conflicts.fetch_add(1);
          allocated.fetch_add(1);
          held.push_back(*std::move(page));
        } else if (!held.empty()) {
          owner[held.back().slot()].store(-1);
          held.pop_back();
        }
      }
      for (PageHandle& page : held) owner[page.slot()].store(-1);
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(conflicts.load(), 0);
  const PagePoolStats stats = pool->stats();
  EXPECT_EQ(stats.in_use, 0);
  EXPECT_EQ(stats.allocations, static_cast<uint64_t>(allocated.load()));
  EXPECT_EQ(stats.exhausted, 0u);
}

}  // namespace
}  // namespace kvtier
