// The cold tier (daemon/cold_tier.h). Its value format: a page round-trips with its
// generation, and every kind of damage — to the magic, the version, the length, the header
// or the payload — is DATA_LOSS, never a page with wrong bytes, and so is an intact value of
// another page; an intact value of another generation is a stale commit (FAILED_PRECONDITION);
// version 1 values (unbound) still read. And against a real Redis Cluster on loopback
// (3 masters, 1 replica each; skipped, saying why, without redis-server): pages of several
// sessions and layers read back byte-exact, a corrupted value is DATA_LOSS, a value corrupted
// on the master alone is recovered from the replica, another page's value under a page's key
// is refused, and nothing acknowledged is lost when a master is killed. On a cluster whose
// replica joined after the client loaded its slot map: a value corrupted on the master is
// read from that replica, and the map learns such replicas by age (slot_map_refresh).
#include "daemon/cold_tier.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "tests/daemon/cold_tier_suite.h"
#include "tests/testutil/redis_cluster_process.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::daemon {
namespace {

using ::testing::HasSubstr;

std::string Page(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + 7) & 0xff);
  return s;
}

TEST(ColdValueTest, TheChecksumIsCrc32cInHardwareAndInSoftware) {
  // The standard check value of CRC-32C.
  EXPECT_EQ(ColdChecksum("123456789", false), 0xE3069283u);
  EXPECT_EQ(ColdChecksum("123456789", true), 0xE3069283u);
  EXPECT_EQ(ColdChecksum("", true), 0u);
  // Every length and alignment agrees between the two.
  const std::string data = Page(300);
  for (size_t start = 0; start < 9; ++start) {
    for (size_t n = 0; n + start <= data.size(); n += 7) {
      const std::string_view v(data.data() + start, n);
      ASSERT_EQ(ColdChecksum(v, true), ColdChecksum(v, false)) << start << " " << n;
    }
  }
}

// The identity of page 5 of layer 1 of session "s" of tenant "acme".
const uint32_t kId = ColdIdentity("acme", "s", 1, 5);

TEST(ColdValueTest, RoundTripsBinaryPagesWithTheirGeneration) {
  for (size_t n : {size_t{1}, size_t{4096}, size_t{65536} + 3}) {
    const std::string data = Page(n);
    const std::string v = EncodeColdValue(kId, 42, data);
    ASSERT_EQ(v.size(), kColdHeaderBytes + n);
    absl::StatusOr<ColdPage> p = DecodeColdValue(v, kId, 42);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->generation, 42u);
    EXPECT_EQ(p->data, data);
    EXPECT_TRUE(DecodeColdValue(v, kId, 0).ok());  // 0: any generation
  }
}

TEST(ColdValueTest, AnotherGenerationIsAStaleCommitNotDataLoss) {
  const std::string v = EncodeColdValue(kId, 7, Page(100));
  absl::StatusOr<ColdPage> p = DecodeColdValue(v, kId, 8);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(p.status().message(), HasSubstr("generation 7, expected 8"));
}

TEST(ColdValueTest, EveryFlippedBitIsDataLoss) {
  const std::string v = EncodeColdValue(kId, 3, Page(256));
  // Each bit of the header and a spread of payload bits.
  for (size_t bit = 0; bit < v.size() * 8; bit += (bit < kColdHeaderBytes * 8 ? 1 : 61)) {
    std::string bad = v;
    bad[bit / 8] = static_cast<char>(bad[bit / 8] ^ (1 << (bit % 8)));
    absl::StatusOr<ColdPage> p = DecodeColdValue(bad, kId, 3);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kDataLoss) << "bit " << bit;
  }
}

TEST(ColdValueTest, TruncatedOrExtendedValuesAreDataLoss) {
  const std::string v = EncodeColdValue(kId, 3, Page(256));
  for (size_t n : {size_t{0}, size_t{10}, kColdHeaderBytes, v.size() - 1}) {
    EXPECT_EQ(DecodeColdValue(v.substr(0, n), kId, 3).status().code(),
              absl::StatusCode::kDataLoss)
        << n;
  }
  EXPECT_EQ(DecodeColdValue(v + "x", kId, 3).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(DecodeColdValue("not a page at all, but long enough for a header", kId, 0)
                  .status()
                  .message(),
              HasSubstr("magic"));
}

// Each field of (tenant, session, layer, page) changes the identity, and so do the fields'
// boundaries; an intact value under another identity is DATA_LOSS, whatever its generation.
TEST(ColdValueTest, AValueOfAnotherPageIsDataLoss) {
  const uint32_t others[] = {ColdIdentity("acme", "s", 1, 6), ColdIdentity("acme", "s", 2, 5),
                             ColdIdentity("acme", "t", 1, 5), ColdIdentity("acmf", "s", 1, 5),
                             ColdIdentity("acm", "es", 1, 5), ColdIdentity("acme", "s.live", 1, 5)};
  for (uint32_t other : others) {
    ASSERT_NE(other, kId);
    for (uint64_t generation : {uint64_t{3}, uint64_t{4}}) {
      absl::StatusOr<ColdPage> p =
          DecodeColdValue(EncodeColdValue(other, generation, Page(256)), kId, 3);
      EXPECT_EQ(p.status().code(), absl::StatusCode::kDataLoss) << other << " " << generation;
      EXPECT_THAT(p.status().message(), HasSubstr("another page"));
    }
  }
}

// A value of version 1 (written before values were bound to their page: bytes u64 where the
// identity and a 32-bit length are now) still reads, under any key, with its checks.
TEST(ColdValueTest, AVersion1ValueStillReads) {
  const std::string data = Page(300);
  std::string v(kColdHeaderBytes, '\0');
  const auto put = [&v](size_t at, uint64_t x, int bytes) {
    for (int i = 0; i < bytes; ++i) v[at + i] = static_cast<char>((x >> (8 * i)) & 0xff);
  };
  v.replace(0, 4, "KVTC");
  put(4, 1, 2);
  put(8, 9, 8);
  put(16, data.size(), 8);
  put(24, ColdChecksum(data), 4);
  put(28, ColdChecksum(std::string_view(v.data(), 28)), 4);
  v += data;
  absl::StatusOr<ColdPage> p = DecodeColdValue(v, kId, 9);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->data, data);
  std::string bad = v;
  bad[kColdHeaderBytes + 5] ^= 1;
  EXPECT_EQ(DecodeColdValue(bad, kId, 9).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(DecodeColdValue(v, kId, 8).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ColdTierTest, KeysPutTheTenantFirstAndHashTagSessionAndLayer) {
  EXPECT_EQ(ColdKey("kv", "acme", "s1", 3, 17), "kv:acme:{s1:3}:17");
  // One layer's pages share a slot.
  EXPECT_EQ(RedisCluster::SlotOf(ColdKey("kv", "acme", "s1", 3, 0)),
            RedisCluster::SlotOf(ColdKey("kv", "acme", "s1", 3, 9999)));
  EXPECT_EQ(ColdTier::Create(nullptr).status().code(), absl::StatusCode::kInvalidArgument);
}

using testing::RedisClusterProcess;
using testing::RedisClusterProcessOptions;

constexpr char kPrefix[] = "kvt";

class ColdTierClusterTest : public ::kvtier::testing::ColdTierSuite<ColdTierClusterTest, kPrefix> {
 protected:
  static absl::Time Deadline() { return absl::Now() + absl::Seconds(10); }

  // `n` pages of `bytes` each, distinct per (session, layer, page).
  static std::vector<std::string> Pages(const std::string& session, int layer, int n,
                                        size_t bytes) {
    std::vector<std::string> out;
    for (int p = 0; p < n; ++p) {
      std::string s(bytes, '\0');
      for (size_t i = 0; i < bytes; ++i) {
        s[i] = static_cast<char>((i * 31 + static_cast<size_t>(p) * 7 +
                                  static_cast<size_t>(layer) * 13 + session.size()) &
                                 0xff);
      }
      out.push_back(std::move(s));
    }
    return out;
  }
  absl::Status PutAll(const std::string& session, int layer, const std::vector<std::string>& data,
                      uint64_t generation) {
    std::vector<ColdPageRef> refs;
    for (size_t p = 0; p < data.size(); ++p) {
      refs.push_back({layer, static_cast<int64_t>(p), generation, data[p]});
    }
    return tier_->Put("acme", session, refs, Deadline());
  }
};

TEST_F(ColdTierClusterTest, PagesOfManySessionsAndLayersReadBackByteExact) {
  const std::vector<std::string> sessions = {"s-one", "s-two", "s-three"};
  for (const std::string& s : sessions) {
    for (int layer = 0; layer < 4; ++layer) {
      ASSERT_TRUE(PutAll(s, layer, Pages(s, layer, 32, 8192), 5).ok());
    }
  }
  std::vector<int64_t> all(32);
  for (int p = 0; p < 32; ++p) all[p] = p;
  for (const std::string& s : sessions) {
    for (int layer = 0; layer < 4; ++layer) {
      const std::vector<std::string> want = Pages(s, layer, 32, 8192);
      const std::vector<uint64_t> gens(32, 5);
      std::vector<absl::StatusOr<ColdPage>> got = tier_->Get("acme", s, layer, all, gens, Deadline());
      ASSERT_EQ(got.size(), 32u);
      for (int p = 0; p < 32; ++p) {
        ASSERT_TRUE(got[p].ok()) << s << " layer " << layer << " page " << p << ": "
                                 << got[p].status();
        EXPECT_EQ(got[p]->data, want[p]);
        EXPECT_EQ(got[p]->layer, layer);
        EXPECT_EQ(got[p]->page, p);
      }
    }
  }
  // A page never written, and one asked for at a newer generation than stored.
  const int64_t missing[] = {99};
  EXPECT_EQ(tier_->Get("acme", "s-one", 0, missing, {}, Deadline())[0].status().code(),
            absl::StatusCode::kNotFound);
  const int64_t zero[] = {0};
  const uint64_t newer[] = {6};
  EXPECT_EQ(tier_->Get("acme", "s-one", 0, zero, newer, Deadline())[0].status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Tenants are apart: the same session name under another tenant holds nothing.
  EXPECT_EQ(tier_->Get("other", "s-one", 0, zero, {}, Deadline())[0].status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(tier_->stats().pages_written, 3 * 4 * 32);
  // Deleted pages are gone.
  ASSERT_TRUE(tier_->Delete("acme", "s-three", 1, all, Deadline()).ok());
  EXPECT_EQ(tier_->Get("acme", "s-three", 1, zero, {}, Deadline())[0].status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(ColdTierClusterTest, ACorruptedValueIsDataLossNeverWrongBytes) {
  const std::vector<std::string> data = Pages("s-corrupt", 0, 2, 4096);
  ASSERT_TRUE(PutAll("s-corrupt", 0, data, 9).ok());
  // Flip one payload byte in place on the master (replicated to the replica too).
  const std::string key = tier_->Key("acme", "s-corrupt", 0, 1);
  const std::string offset = std::to_string(kColdHeaderBytes + 100);
  std::string flipped(1, static_cast<char>(data[1][100] ^ 0x01));
  absl::StatusOr<RedisReply> set = cluster_->Run({"SETRANGE", key, offset, flipped}, Deadline());
  ASSERT_TRUE(set.ok()) << set.status();
  ASSERT_TRUE(process()->WaitForReplicas(absl::Seconds(10)).ok());
  const int64_t pages[] = {0, 1};
  std::vector<absl::StatusOr<ColdPage>> got = tier_->Get("acme", "s-corrupt", 0, pages, {}, Deadline());
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  EXPECT_EQ(got[0]->data, data[0]);
  EXPECT_EQ(got[1].status().code(), absl::StatusCode::kDataLoss) << got[1].status();
  EXPECT_THAT(got[1].status().message(), HasSubstr("checksum"));
  EXPECT_EQ(tier_->stats().checksum_failures, 1);
  EXPECT_EQ(tier_->stats().replica_recoveries, 0);
}

TEST_F(ColdTierClusterTest, AValueCorruptedOnTheMasterAloneComesBackFromItsReplica) {
  const std::vector<std::string> data = Pages("s-replica", 2, 1, 4096);
  ASSERT_TRUE(PutAll("s-replica", 2, data, 3).ok());
  ASSERT_TRUE(process()->WaitForReplicas(absl::Seconds(10)).ok());
  const std::string key = tier_->Key("acme", "s-replica", 2, 0);
  // Corrupt the master's copy alone: a script whose effects are not replicated
  // (redis.set_repl(redis.REPL_NONE)) flips one payload bit on the master.
  const std::string flipped(1, static_cast<char>(data[0][7] ^ 0x40));
  // (On the slot's master directly: the cluster client routes by args[1], EVAL's script.)
  absl::StatusOr<int> master = process()->MasterOf(RedisCluster::SlotOf(key));
  ASSERT_TRUE(master.ok()) << master.status();
  absl::StatusOr<std::string> r = process()->Command(
      *master,
      {"EVAL",
       "redis.set_repl(redis.REPL_NONE); return redis.call('SETRANGE', KEYS[1], ARGV[1], ARGV[2])",
       "1", key, std::to_string(kColdHeaderBytes + 7), flipped});
  ASSERT_TRUE(r.ok()) << r.status();
  const int64_t pages[] = {0};
  std::vector<absl::StatusOr<ColdPage>> got = tier_->Get("acme", "s-replica", 2, pages, {}, Deadline());
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  EXPECT_EQ(got[0]->data, data[0]);
  EXPECT_EQ(tier_->stats().checksum_failures, 1);
  EXPECT_EQ(tier_->stats().replica_recoveries, 1);
}

// A cluster whose replicas joined after the client loaded its slot map (so the map names
// none): a value corrupted on its master alone still comes back intact from the new replica
// (the replica read that finds no replica reloads the map), and the map learns such replicas
// by age too (slot_map_refresh).
class ColdTierLateReplicaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    RedisClusterProcessOptions options;
    options.replicas_per_master = 0;
    auto started = RedisClusterProcess::Start(options);
    if (absl::IsNotFound(started.status())) GTEST_SKIP() << started.status();
    ASSERT_TRUE(started.ok()) << "cluster did not start: " << started.status();
    process_ = *std::move(started);
  }
  std::unique_ptr<RedisClusterProcess> process_;
};

TEST_F(ColdTierLateReplicaTest, AReplicaThatJoinedLaterServesAValueCorruptedOnTheMaster) {
  RedisClusterOptions options;
  options.seeds = process_->seeds();
  options.command_timeout = absl::Milliseconds(500);
  auto cluster = RedisCluster::Connect(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto tier = ColdTier::Create(cluster->get(), "kvt");
  ASSERT_TRUE(tier.ok()) << tier.status();
  const int nodes = static_cast<int>((*cluster)->node_count());
  EXPECT_EQ(nodes, 3);
  // A page written with the map loaded (no replicas in it).
  std::string data(4096, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>((i * 37 + 11) & 0xff);
  const ColdPageRef ref{0, 0, 5, data};
  ASSERT_TRUE((*tier)->Put("acme", "s-late", {&ref, 1}, absl::Now() + absl::Seconds(10)).ok());
  const std::string key = (*tier)->Key("acme", "s-late", 0, 0);
  absl::StatusOr<int> master = process_->MasterOf(RedisCluster::SlotOf(key));
  ASSERT_TRUE(master.ok()) << master.status();
  // A replica joins that master and copies the page.
  absl::StatusOr<int> replica = process_->AddReplica(*master, absl::Seconds(30));
  ASSERT_TRUE(replica.ok()) << replica.status();
  // The master's copy alone is damaged (a script whose effects are not replicated).
  const std::string flipped(1, static_cast<char>(data[7] ^ 0x40));
  ASSERT_TRUE(process_
                  ->Command(*master, {"EVAL",
                                      "redis.set_repl(redis.REPL_NONE); return "
                                      "redis.call('SETRANGE', KEYS[1], ARGV[1], ARGV[2])",
                                      "1", key, std::to_string(kColdHeaderBytes + 7), flipped})
                  .ok());
  const int64_t pages[] = {0};
  std::vector<absl::StatusOr<ColdPage>> got =
      (*tier)->Get("acme", "s-late", 0, pages, {}, absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  EXPECT_EQ(got[0]->data, data);
  EXPECT_EQ((*tier)->stats().replica_recoveries, 1);
  EXPECT_EQ((*cluster)->node_count(), 4u);
}

TEST_F(ColdTierLateReplicaTest, TheSlotMapLearnsReplicasThatJoinedLaterByAge) {
  RedisClusterOptions options;
  options.seeds = process_->seeds();
  options.command_timeout = absl::Milliseconds(500);
  options.slot_map_refresh = absl::Milliseconds(200);
  auto cluster = RedisCluster::Connect(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  EXPECT_EQ((*cluster)->node_count(), 3u);
  ASSERT_TRUE(process_->AddReplica(0, absl::Seconds(30)).ok());
  const int64_t refreshes = (*cluster)->slot_map_refreshes();
  absl::SleepFor(absl::Milliseconds(250));
  // The first command after the map is that old reloads it; no routing error needed.
  ASSERT_TRUE((*cluster)->Run({"SET", "late-replica", "x"}, absl::Now() + absl::Seconds(5)).ok());
  EXPECT_GT((*cluster)->slot_map_refreshes(), refreshes);
  EXPECT_EQ((*cluster)->node_count(), 4u);
}

// A value is bound to its key's (tenant, session, layer, page). Intact values of other pages
// of the same generation — page 6 of the layer, page 5 of another session, of another layer,
// of another tenant — copied over page 5's key (and replicated) are DATA_LOSS, never the other
// page's bytes; one copied over the master's value alone is read from the intact replica.
TEST_F(ColdTierClusterTest, AnIntactValueUnderAnotherPagesKeyIsRefused) {
  const std::vector<std::string> data = Pages("s-bind", 1, 8, 4096);
  ASSERT_TRUE(PutAll("s-bind", 1, data, 4).ok());
  ASSERT_TRUE(PutAll("s-bind-other", 1, Pages("s-bind-other", 1, 8, 4096), 4).ok());
  ASSERT_TRUE(PutAll("s-bind", 2, Pages("s-bind", 2, 8, 4096), 4).ok());
  const std::string foreign_page = Pages("s-bind", 3, 8, 4096)[5];
  const std::vector<ColdPageRef> foreign = {{1, 5, 4, foreign_page}};
  ASSERT_TRUE(tier_->Put("other-tenant", "s-bind", foreign, Deadline()).ok());
  const std::string key = tier_->Key("acme", "s-bind", 1, 5);
  const int64_t five[] = {5};
  const uint64_t generation[] = {4};
  for (const std::string& from :
       {tier_->Key("acme", "s-bind", 1, 6), tier_->Key("acme", "s-bind-other", 1, 5),
        tier_->Key("acme", "s-bind", 2, 5), tier_->Key("other-tenant", "s-bind", 1, 5)}) {
    SCOPED_TRACE(from);
    absl::StatusOr<RedisReply> value = cluster_->Run({"GET", from}, Deadline());
    ASSERT_TRUE(value.ok()) << value.status();
    ASSERT_TRUE(cluster_->Run({"SET", key, value->str}, Deadline()).ok());
    ASSERT_TRUE(process()->WaitForReplicas(absl::Seconds(10)).ok());
    std::vector<absl::StatusOr<ColdPage>> got =
        tier_->Get("acme", "s-bind", 1, five, generation, Deadline());
    ASSERT_EQ(got.size(), 1u);
    EXPECT_EQ(got[0].status().code(), absl::StatusCode::kDataLoss)
        << (got[0].ok() ? "served another page's value as page 5" : got[0].status().ToString());
    EXPECT_THAT(got[0].status().message(), HasSubstr("another page"));
  }
  // Page 5 written again; then page 6's value over the master's copy alone (not replicated).
  ASSERT_TRUE(PutAll("s-bind", 1, data, 4).ok());
  ASSERT_TRUE(process()->WaitForReplicas(absl::Seconds(10)).ok());
  absl::StatusOr<RedisReply> six =
      cluster_->Run({"GET", tier_->Key("acme", "s-bind", 1, 6)}, Deadline());
  ASSERT_TRUE(six.ok()) << six.status();
  absl::StatusOr<int> master = process()->MasterOf(RedisCluster::SlotOf(key));
  ASSERT_TRUE(master.ok()) << master.status();
  ASSERT_TRUE(process()
                  ->Command(*master, {"EVAL",
                                      "redis.set_repl(redis.REPL_NONE); "
                                      "return redis.call('SET', KEYS[1], ARGV[1])",
                                      "1", key, six->str})
                  .ok());
  const int64_t recoveries = tier_->stats().replica_recoveries;
  std::vector<absl::StatusOr<ColdPage>> got =
      tier_->Get("acme", "s-bind", 1, five, generation, Deadline());
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  EXPECT_TRUE(got[0]->data == data[5]) << "page 5 read back with other bytes";
  EXPECT_EQ(tier_->stats().replica_recoveries, recoveries + 1);
}

TEST_F(ColdTierClusterTest, KillingAMasterLosesNothingAcknowledged) {
  // Pages of several layers (so several slots and masters), acknowledged and replicated.
  std::vector<std::vector<std::string>> layers;
  for (int layer = 0; layer < 6; ++layer) {
    layers.push_back(Pages("s-failover", layer, 16, 2048));
    ASSERT_TRUE(PutAll("s-failover", layer, layers.back(), 2).ok());
  }
  ASSERT_TRUE(process()->WaitForReplicas(absl::Seconds(10)).ok());
  const uint16_t slot = RedisCluster::SlotOf(tier_->Key("acme", "s-failover", 0, 0));
  absl::StatusOr<int> master = process()->MasterOf(slot);
  ASSERT_TRUE(master.ok()) << master.status();
  ASSERT_TRUE(process()->Kill(*master).ok());
  ASSERT_TRUE(process()->WaitForPromotion(*master, slot, absl::Seconds(30)).ok());
  std::vector<int64_t> all(16);
  for (int p = 0; p < 16; ++p) all[p] = p;
  for (int layer = 0; layer < 6; ++layer) {
    std::vector<absl::StatusOr<ColdPage>> got =
        tier_->Get("acme", "s-failover", layer, all, {}, absl::Now() + absl::Seconds(20));
    for (int p = 0; p < 16; ++p) {
      ASSERT_TRUE(got[p].ok()) << "layer " << layer << " page " << p << ": " << got[p].status();
      EXPECT_EQ(got[p]->data, layers[layer][p]);
    }
  }
}

}  // namespace
}  // namespace kvtier::daemon
