// daemon/peer_table.h: the per-peer limit, eviction at the global limit (the oldest connection
// of the peer that holds the most), and tickets that outlive an eviction.
#include "daemon/peer_table.h"

#include <string>

#include "gtest/gtest.h"

namespace kvtier::daemon {
namespace {

using Table = PeerTable<std::string, int>;

TEST(PeerTableTest, APeerAtItsLimitIsRefusedAndOthersAreNot) {
  Table t({.max_total = 8, .max_per_peer = 2});
  EXPECT_TRUE(t.Admit("a", 1).admitted);
  const Table::Admission second = t.Admit("a", 2);
  EXPECT_TRUE(second.admitted);
  EXPECT_FALSE(t.Admit("a", 3).admitted);
  EXPECT_TRUE(t.Admit("b", 4).admitted);
  EXPECT_EQ(t.size(), 3u);
  // A connection that leaves frees its peer's place.
  EXPECT_TRUE(t.Remove(second.ticket));
  EXPECT_FALSE(t.Remove(second.ticket));
  EXPECT_TRUE(t.Admit("a", 5).admitted);
}

TEST(PeerTableTest, AtTheGlobalLimitTheOldestOfTheHeaviestPeerMakesRoom) {
  Table t({.max_total = 4, .max_per_peer = 3});
  const Table::Admission a1 = t.Admit("a", 1);
  t.Admit("b", 2);
  t.Admit("a", 3);
  t.Admit("a", 4);
  const Table::Admission c = t.Admit("c", 5);
  ASSERT_TRUE(c.admitted);
  ASSERT_TRUE(c.evicted.has_value());
  EXPECT_EQ(*c.evicted, 1);  // a's oldest: a holds the most
  EXPECT_EQ(t.size(), 4u);
  EXPECT_FALSE(t.Remove(a1.ticket));  // gone with the eviction
  // a and c now hold 2 and 1, b 1: a's next oldest goes, then ties go to the first peer.
  EXPECT_EQ(t.Admit("d", 6).evicted, 3);
  EXPECT_EQ(t.Admit("e", 7).evicted, 4);  // a, b, c, d hold 1 each: a is first
  EXPECT_EQ(t.Admit("f", 8).evicted, 2);
  EXPECT_EQ(t.size(), 4u);
}

TEST(PeerTableTest, ANewcomerMayEvictItsOwnPeersOldest) {
  Table t({.max_total = 2, .max_per_peer = 2});
  t.Admit("a", 1);
  t.Admit("b", 2);
  const Table::Admission again = t.Admit("a", 3);  // a holds 1 < 2, and is the first heaviest
  ASSERT_TRUE(again.admitted);
  EXPECT_EQ(again.evicted, 1);
  EXPECT_TRUE(t.Remove(again.ticket));
  EXPECT_EQ(t.size(), 1u);
}

TEST(PeerTableTest, BelowTheGlobalLimitNothingIsEvicted) {
  Table t({.max_total = 3, .max_per_peer = 3});
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(t.Admit("a", i).evicted.has_value());
}

}  // namespace
}  // namespace kvtier::daemon
