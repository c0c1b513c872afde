// HeadSlotTable: placement in slots free in every head, per-head eviction, compaction plans
// that are safe to run in order and line free parts up into whole free slots, resizing.
#include "offload/head_slot_table.h"

#include <vector>

#include "gtest/gtest.h"

namespace kvtier {
namespace {

// Applies `moves` in order to a copy of the table before compaction, checking that every
// destination is free when its move runs; returns the result.
std::vector<int32_t> Replay(std::vector<int32_t> table, int32_t cap,
                            const std::vector<HeadSlotMove>& moves) {
  for (const HeadSlotMove& m : moves) {
    int32_t& dst = table[static_cast<size_t>(m.kv_head) * cap + m.dst_slot];
    int32_t& src = table[static_cast<size_t>(m.kv_head) * cap + m.src_slot];
    EXPECT_EQ(dst, -1) << "move into an occupied slot";
    EXPECT_NE(src, -1) << "move of an empty slot";
    dst = src;
    src = -1;
  }
  return table;
}

TEST(HeadSlotTableTest, PlacesNewPagesInSlotsFreeInEveryHead) {
  HeadSlotTable t(2, 3);
  EXPECT_EQ(t.PlaceInFreeSlot(0), 0);
  EXPECT_EQ(t.PlaceInFreeSlot(1), 1);
  EXPECT_TRUE(t.Evict(0, 0));  // head 0 frees slot 0, head 1 still holds page 0 there
  EXPECT_EQ(t.PlaceInFreeSlot(2), 2);
  EXPECT_EQ(t.PlaceInFreeSlot(3), -1);  // no slot free in both heads
  EXPECT_FALSE(t.Evict(0, 0));
  EXPECT_EQ(t.Pages(0), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(t.Pages(1), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(t.resident(), 5);
}

TEST(HeadSlotTableTest, CompactionLinesFreePartsUpIntoWholeSlots) {
  HeadSlotTable t(2, 6);
  for (int32_t p = 0; p < 6; ++p) ASSERT_EQ(t.PlaceInFreeSlot(p), p);
  // Head 0 keeps pages 0, 3, 5; head 1 keeps 1, 2, 4, 5.
  for (int32_t p : {1, 2, 4}) ASSERT_TRUE(t.Evict(0, p));
  for (int32_t p : {0, 3}) ASSERT_TRUE(t.Evict(1, p));
  const std::vector<int32_t> before = t.table();
  EXPECT_EQ(t.used(), 6);
  const std::vector<HeadSlotMove> moves = t.Compact(/*fixed=*/-1);
  EXPECT_EQ(Replay(before, 6, moves), t.table());
  EXPECT_EQ(t.used(), 4);
  EXPECT_EQ(t.Pages(0), (std::vector<int32_t>{0, 3, 5}));
  EXPECT_EQ(t.Pages(1), (std::vector<int32_t>{1, 2, 4, 5}));
  EXPECT_EQ(t.CountOf(0), 3);
  EXPECT_EQ(t.PlaceInFreeSlot(6), 4);
  t.Resize(5);
  EXPECT_EQ(t.capacity(), 5);
  EXPECT_EQ(t.Pages(1), (std::vector<int32_t>{1, 2, 4, 5, 6}));
  EXPECT_EQ(t.PlaceInFreeSlot(7), -1);
  t.Resize(8);
  EXPECT_EQ(t.PlaceInFreeSlot(7), 5);
}

TEST(HeadSlotTableTest, CompactionLeavesTheFixedSlotAlone) {
  HeadSlotTable t(1, 5);
  for (int32_t p = 0; p < 5; ++p) ASSERT_EQ(t.PlaceInFreeSlot(p), p);
  ASSERT_TRUE(t.Evict(0, 0));
  ASSERT_TRUE(t.Evict(0, 1));
  const std::vector<int32_t> before = t.table();
  const auto moves = t.Compact(/*fixed=*/0);
  EXPECT_EQ(Replay(before, 5, moves), t.table());
  // Slot 0 stays empty (fixed); pages 2..4 fill slots 1..3.
  EXPECT_EQ(t.at(0, 0), -1);
  EXPECT_EQ(t.used(), 4);
  EXPECT_EQ(t.CountOf(0), 3);
}

TEST(HeadSlotTableTest, RandomEvictionsCompactSafely) {
  uint64_t x = 12345;
  auto next = [&x] { return (x = x * 6364136223846793005ULL + 1442695040888963407ULL) >> 33; };
  for (int round = 0; round < 200; ++round) {
    const int32_t hkv = 1 + static_cast<int32_t>(next() % 4);
    const int32_t cap = 1 + static_cast<int32_t>(next() % 12);
    HeadSlotTable t(hkv, cap);
    for (int32_t p = 0; p < cap; ++p) ASSERT_EQ(t.PlaceInFreeSlot(p), p);
    std::vector<int32_t> counts(hkv, cap);
    for (int32_t h = 0; h < hkv; ++h) {
      for (int32_t p = 0; p < cap; ++p) {
        if (next() % 2 == 0) {
          ASSERT_TRUE(t.Evict(h, p));
          --counts[h];
        }
      }
    }
    const std::vector<int32_t> before = t.table();
    const auto moves = t.Compact(-1);
    ASSERT_EQ(Replay(before, cap, moves), t.table());
    int32_t most = 0;
    for (int32_t h = 0; h < hkv; ++h) {
      EXPECT_EQ(t.CountOf(h), counts[h]);
      most = std::max(most, counts[h]);
    }
    EXPECT_EQ(t.used(), most);
  }
}

}  // namespace
}  // namespace kvtier
