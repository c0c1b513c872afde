// Each formula of kvtier/layout.h checked against offsets worked out by hand for small,
// distinct sizes (so a swapped dimension gives a different number).
#include "kvtier/layout.h"

#include "gtest/gtest.h"

namespace kvtier {
namespace {

TEST(LayoutTest, HostPageIsHeadKindTokenDim) {
  const HostPageLayout l{/*num_kv_heads=*/3, /*page_size=*/4, /*head_dim=*/5};
  EXPECT_EQ(l.slab_elements(), 40);  // 2·4·5
  EXPECT_EQ(l.page_elements(), 120);
  EXPECT_EQ(l.SlabOffset(2), 80);
  EXPECT_EQ(l.Offset(0, kKey, 0, 0), 0);
  EXPECT_EQ(l.Offset(0, kKey, 0, 4), 4);
  EXPECT_EQ(l.Offset(0, kKey, 1, 0), 5);
  EXPECT_EQ(l.Offset(0, kValue, 0, 0), 20);       // after 4 tokens of K
  EXPECT_EQ(l.Offset(1, kKey, 0, 0), 40);         // next head's slab
  EXPECT_EQ(l.Offset(2, kValue, 3, 4), 80 + 20 + 15 + 4);
  // A slab (K then V of one head) is contiguous and exactly slab_elements long.
  EXPECT_EQ(l.Offset(1, kValue, 3, 4) + 1, l.SlabOffset(2));
}

TEST(LayoutTest, SummaryIsPageHeadHiLoDim) {
  const SummaryLayout l{/*num_kv_heads=*/3, /*head_dim=*/5};
  EXPECT_EQ(l.page_elements(), 30);
  EXPECT_EQ(l.Offset(0, 0, kHi, 0), 0);
  EXPECT_EQ(l.Offset(0, 0, kLo, 0), 5);
  EXPECT_EQ(l.Offset(0, 1, kHi, 0), 10);
  EXPECT_EQ(l.Offset(2, 1, kLo, 3), 60 + 10 + 5 + 3);
}

TEST(LayoutTest, WorkingSetIsBatchSlotTokenHeadDim) {
  const WorkingSetLayout l{/*num_slots=*/6, /*page_size=*/4, /*num_kv_heads=*/3, /*head_dim=*/5};
  EXPECT_EQ(l.slot_elements(), 60);  // 4·3·5
  EXPECT_EQ(l.token_stride(), 15);
  EXPECT_EQ(l.GlobalSlot(2, 1), 13);
  EXPECT_EQ(l.Offset(int64_t{0}, 0, 0, 1), 1);
  EXPECT_EQ(l.Offset(int64_t{0}, 0, 1, 0), 5);    // heads are adjacent within a token
  EXPECT_EQ(l.Offset(int64_t{0}, 1, 0, 0), 15);   // next token
  EXPECT_EQ(l.Offset(int64_t{1}, 0, 0, 0), 60);   // next slot
  EXPECT_EQ(l.Offset(1, 2, 3, 2, 4), (6 + 2) * 60 + 3 * 15 + 2 * 5 + 4);
}

TEST(LayoutTest, SlotTableIsBatchHeadSlot) {
  const SlotTableLayout l{/*num_kv_heads=*/3, /*num_slots=*/6};
  EXPECT_EQ(l.batch_elements(), 18);
  EXPECT_EQ(l.Offset(0, 0, 5), 5);
  EXPECT_EQ(l.Offset(0, 1, 0), 6);
  EXPECT_EQ(l.Offset(2, 2, 1), 36 + 12 + 1);
}

TEST(LayoutTest, HeadsAndDenseKv) {
  const HeadsLayout h{/*num_heads=*/4, /*head_dim=*/5};
  EXPECT_EQ(h.Offset(1, 2, 3), 20 + 10 + 3);
  const DenseKvLayout d{/*max_tokens=*/7, /*num_kv_heads=*/3, /*head_dim=*/5};
  EXPECT_EQ(d.Offset(0, 1, 0, 0), 15);
  EXPECT_EQ(d.Offset(1, 2, 1, 4), 105 + 30 + 5 + 4);
}

TEST(LayoutTest, QueryHeadsMapToConsecutiveGroups) {
  EXPECT_EQ(KvHeadOfQueryHead(0, 4), 0);
  EXPECT_EQ(KvHeadOfQueryHead(3, 4), 0);
  EXPECT_EQ(KvHeadOfQueryHead(4, 4), 1);
  EXPECT_EQ(KvHeadOfQueryHead(31, 4), 7);
  EXPECT_EQ(KvHeadOfQueryHead(5, 1), 5);
}

}  // namespace
}  // namespace kvtier
