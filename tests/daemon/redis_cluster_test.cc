// RedisCluster (daemon/redis_cluster.h) against a real Redis Cluster: 3 masters + 3 replicas,
// one cluster for the suite. The tests run in order; the destructive ones (pause, kill) last.
#include "daemon/redis_cluster.h"

#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testutil/redis_cluster_process.h"
#include "tests/testutil/redis_cluster_suite.h"

namespace kvtier::daemon {
namespace {

using ::kvtier::testing::RedisClusterProcess;
using ::testing::HasSubstr;

// How late a call may return after its deadline (scheduling noise on a loaded 2-core box).
constexpr absl::Duration kMargin = absl::Milliseconds(150);

absl::Time In(absl::Duration d) { return absl::Now() + d; }

TEST(RedisSlotTest, MatchesTheClusterSpecification) {
  EXPECT_EQ(RedisCluster::SlotOf("foo"), 12182);
  EXPECT_EQ(RedisCluster::SlotOf("123456789"), 0x31C3 & 16383);  // CRC16/XMODEM check value
  EXPECT_EQ(RedisCluster::SlotOf(""), 0);
  EXPECT_EQ(RedisCluster::SlotOf("{user1000}.following"), RedisCluster::SlotOf("user1000"));
  EXPECT_EQ(RedisCluster::SlotOf("{user1000}.following"),
            RedisCluster::SlotOf("{user1000}.followers"));
  EXPECT_NE(RedisCluster::SlotOf("foo{}{bar}"), RedisCluster::SlotOf("bar"));
  EXPECT_EQ(RedisCluster::SlotOf("foo{{bar}}zap"), RedisCluster::SlotOf("{bar"));
  EXPECT_EQ(RedisCluster::SlotOf("foo{bar}{zap}"), RedisCluster::SlotOf("bar"));
}

TEST(RedisConnectTest, BadSeedsAreUnavailableAndNamed) {
  RedisClusterOptions options;
  options.seeds = {"127.0.0.1:1", "127.0.0.1:2"};
  options.connect_timeout = absl::Milliseconds(200);
  auto cluster = RedisCluster::Connect(options);
  ASSERT_FALSE(cluster.ok());
  EXPECT_TRUE(absl::IsUnavailable(cluster.status())) << cluster.status();
  EXPECT_THAT(cluster.status().message(), HasSubstr("127.0.0.1:1 ("));
  EXPECT_THAT(cluster.status().message(), HasSubstr("127.0.0.1:2 ("));
  options.seeds = {"no-port"};
  EXPECT_TRUE(absl::IsInvalidArgument(RedisCluster::Connect(options).status()));
  options.seeds = {};
  EXPECT_TRUE(absl::IsInvalidArgument(RedisCluster::Connect(options).status()));
}

class RedisClusterTest : public ::kvtier::testing::RedisClusterSuite<RedisClusterTest> {
 protected:
  void SetUp() override {
    RedisClusterSuite::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    RedisClusterOptions options;
    options.seeds = {process()->address(0)};
    options.command_timeout = absl::Milliseconds(500);
    auto client = RedisCluster::Connect(options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  RedisClusterProcess& cluster() { return *process(); }

  std::unique_ptr<RedisCluster> client_;
};


TEST_F(RedisClusterTest, LoadsTheWholeCluster) {
  EXPECT_EQ(client_->node_count(), 6u);
  EXPECT_EQ(client_->slot_map_refreshes(), 1);
}

TEST_F(RedisClusterTest, SlotsAgreeWithClusterKeyslot) {
  for (const std::string key : {"foo", "", "foo{}{bar}", "foo{{bar}}zap", "{user1000}.following",
                                "a{b}c{d}", "{}", "}{x}", "page:123:layer:7"}) {
    auto slot = cluster().Command(0, {"CLUSTER", "KEYSLOT", key});
    ASSERT_TRUE(slot.ok()) << slot.status();
    EXPECT_EQ(*slot, absl::StrCat(RedisCluster::SlotOf(key))) << key;
  }
}

TEST_F(RedisClusterTest, BinaryValuesRoundTrip) {
  const std::string key("bin\0key", 7);
  const std::string small("a\0b\r\n\xff", 6);
  std::string big(1 << 20, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 131 + (i >> 9));
  for (const std::string& value : {small, big}) {
    auto set = client_->Run({"SET", key, value}, In(absl::Seconds(5)));
    ASSERT_TRUE(set.ok()) << set.status();
    EXPECT_EQ(set->type, RedisReply::Type::kStatus);
    EXPECT_EQ(set->str, "OK");
    auto get = client_->Run({"GET", key}, In(absl::Seconds(5)));
    ASSERT_TRUE(get.ok()) << get.status();
    EXPECT_EQ(get->type, RedisReply::Type::kString);
    EXPECT_EQ(get->str, value);
  }
  auto missing = client_->Run({"GET", "no-such-key"}, In(absl::Seconds(5)));
  ASSERT_TRUE(missing.ok()) << missing.status();
  EXPECT_EQ(missing->type, RedisReply::Type::kNil);
}

TEST_F(RedisClusterTest, PipelineSpansEveryMasterInOrder) {
  std::vector<std::vector<std::string>> commands;
  std::set<int> masters;
  for (int i = 0; i < 500; ++i) {
    const std::string key = absl::StrCat("pipe-", i);
    commands.push_back({"SET", key, absl::StrCat("value-", i)});
    commands.push_back({"GET", key});
    auto master = cluster().MasterOf(RedisCluster::SlotOf(key));
    ASSERT_TRUE(master.ok()) << master.status();
    masters.insert(*master);
  }
  EXPECT_EQ(masters.size(), 3u);
  const auto replies = client_->Pipeline(commands, In(absl::Seconds(10)));
  ASSERT_EQ(replies.size(), 1000u);
  for (int i = 0; i < 500; ++i) {
    ASSERT_TRUE(replies[2 * i].ok()) << replies[2 * i].status();
    ASSERT_TRUE(replies[2 * i + 1].ok()) << replies[2 * i + 1].status();
    EXPECT_EQ(replies[2 * i + 1]->str, absl::StrCat("value-", i));
  }
  EXPECT_EQ(client_->redirects(), 0);
}

TEST_F(RedisClusterTest, HashTaggedKeysLandOnOneNode) {
  std::vector<std::vector<std::string>> commands;
  for (int i = 0; i < 20; ++i)
    commands.push_back({"SET", absl::StrCat("{session-7}.page", i), "x"});
  for (const auto& r : client_->Pipeline(commands, In(absl::Seconds(5)))) {
    ASSERT_TRUE(r.ok()) << r.status();
  }
  auto master = cluster().MasterOf(RedisCluster::SlotOf("session-7"));
  ASSERT_TRUE(master.ok());
  auto count = cluster().Command(
      *master, {"CLUSTER", "COUNTKEYSINSLOT", absl::StrCat(RedisCluster::SlotOf("session-7"))});
  ASSERT_TRUE(count.ok()) << count.status();
  EXPECT_EQ(*count, "20");
}

TEST_F(RedisClusterTest, ErrorReplyFailsOnlyItsCommand) {
  const std::vector<std::vector<std::string>> commands = {
      {"SET", "err-s", "abc"}, {"INCR", "err-s"},  {"SET", "err-n", "1"},
      {"INCR", "err-n"},       {"NOSUCHCMD", "x"}, {"GET"}};
  const auto r = client_->Pipeline(commands, In(absl::Seconds(5)));
  ASSERT_EQ(r.size(), 6u);
  EXPECT_TRUE(r[0].ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(r[1].status())) << r[1].status();
  EXPECT_THAT(r[1].status().message(), HasSubstr("not an integer"));
  EXPECT_TRUE(r[2].ok());
  ASSERT_TRUE(r[3].ok()) << r[3].status();
  EXPECT_EQ(r[3]->integer, 2);
  EXPECT_TRUE(absl::IsInvalidArgument(r[4].status())) << r[4].status();
  EXPECT_TRUE(absl::IsInvalidArgument(r[5].status())) << r[5].status();
}

TEST_F(RedisClusterTest, FollowsAskDuringMigrationAndMovedAfter) {
  const std::string old_key = "{migr}old";
  const uint16_t slot = RedisCluster::SlotOf(old_key);
  ASSERT_TRUE(client_->Run({"SET", old_key, "before"}, In(absl::Seconds(5))).ok());
  auto from = cluster().MasterOf(slot);
  ASSERT_TRUE(from.ok()) << from.status();
  int to = -1;
  for (int i = 0; i < cluster().size() && to < 0; ++i) {
    auto role = cluster().Command(i, {"ROLE"});
    if (i != *from && role.ok() && absl::StartsWith(*role, "master")) to = i;
  }
  ASSERT_GE(to, 0);
  ASSERT_TRUE(cluster().BeginMigration(slot, *from, to).ok());
  // A key that is not on the source yet: the source answers ASK, the client follows once.
  auto set_new = client_->Run({"SET", "{migr}new", "during"}, In(absl::Seconds(5)));
  ASSERT_TRUE(set_new.ok()) << set_new.status();
  EXPECT_GE(client_->redirects(), 1);
  auto get_old = client_->Run({"GET", old_key}, In(absl::Seconds(5)));
  ASSERT_TRUE(get_old.ok()) << get_old.status();
  EXPECT_EQ(get_old->str, "before");
  const int64_t redirects_before = client_->redirects();
  const int64_t refreshes_before = client_->slot_map_refreshes();
  ASSERT_TRUE(cluster().FinishMigration(slot, *from, to).ok());
  // The client's map still names the source: MOVED, then the new owner.
  const auto r = client_->Pipeline(
      std::vector<std::vector<std::string>>{{"GET", old_key}, {"GET", "{migr}new"}},
      In(absl::Seconds(5)));
  ASSERT_TRUE(r[0].ok()) << r[0].status();
  ASSERT_TRUE(r[1].ok()) << r[1].status();
  EXPECT_EQ(r[0]->str, "before");
  EXPECT_EQ(r[1]->str, "during");
  EXPECT_GT(client_->redirects(), redirects_before);
  EXPECT_GT(client_->slot_map_refreshes(), refreshes_before);
  // Now routed straight to the new owner.
  const int64_t settled = client_->redirects();
  ASSERT_TRUE(client_->Run({"GET", old_key}, In(absl::Seconds(5))).ok());
  EXPECT_EQ(client_->redirects(), settled);
  auto owner = cluster().MasterOf(slot);
  ASSERT_TRUE(owner.ok());
  EXPECT_EQ(*owner, to);
}

TEST_F(RedisClusterTest, AuthenticatesAsAnAclUser) {
  for (int i = 0; i < cluster().size(); ++i) {
    ASSERT_TRUE(
        cluster().Command(i, {"ACL", "SETUSER", "cold", "on", ">s3cret", "~*", "+@all"}).ok());
  }
  RedisClusterOptions options;
  options.seeds = {cluster().address(1)};
  options.user = "cold";
  options.password = "s3cret";
  auto client = RedisCluster::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->Run({"SET", "acl-key", "a"}, In(absl::Seconds(5))).ok());
  auto whoami = (*client)->Run({"ACL", "WHOAMI"}, In(absl::Seconds(5)));
  ASSERT_TRUE(whoami.ok()) << whoami.status();
  EXPECT_EQ(whoami->str, "cold");
  options.password = "wrong";
  auto refused = RedisCluster::Connect(options);
  EXPECT_TRUE(absl::IsUnavailable(refused.status())) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("AUTH failed"));
}

TEST_F(RedisClusterTest, ReadsFromAReplica) {
  ASSERT_TRUE(client_->Run({"SET", "replicated", "copy"}, In(absl::Seconds(5))).ok());
  ASSERT_TRUE(cluster().WaitForReplicas(absl::Seconds(10)).ok());
  auto r = client_->RunOnReplica({"GET", "replicated"}, In(absl::Seconds(5)));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->str, "copy");
}

TEST_F(RedisClusterTest, PausedNodeMissesTheDeadlineThenRecovers) {
  const std::string key = "paused-key";
  ASSERT_TRUE(client_->Run({"SET", key, "v"}, In(absl::Seconds(5))).ok());
  auto master = cluster().MasterOf(RedisCluster::SlotOf(key));
  ASSERT_TRUE(master.ok());
  ASSERT_TRUE(cluster().Pause(*master).ok());
  // A key on another master: its node answers while the paused one holds up nobody else.
  std::string other;
  for (int i = 0; other.empty(); ++i) {
    const std::string k = absl::StrCat("other-", i);
    auto m = cluster().MasterOf(RedisCluster::SlotOf(k));
    ASSERT_TRUE(m.ok());
    if (*m != *master) other = k;
  }
  ASSERT_TRUE(client_->Run({"SET", other, "w"}, In(absl::Seconds(5))).ok());
  const absl::Time deadline = In(absl::Milliseconds(300));
  const auto r = client_->Pipeline(
      std::vector<std::vector<std::string>>{{"GET", key}, {"GET", other}}, deadline);
  const absl::Time returned = absl::Now();
  ASSERT_TRUE(cluster().Resume(*master).ok());
  EXPECT_TRUE(absl::IsDeadlineExceeded(r[0].status())) << r[0].status();
  ASSERT_TRUE(r[1].ok()) << r[1].status();
  EXPECT_EQ(r[1]->str, "w");
  EXPECT_LE(returned, deadline + kMargin);
  auto after = client_->Run({"GET", key}, In(absl::Seconds(5)));
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->str, "v");
}

TEST_F(RedisClusterTest, KilledMasterLosesNoAcknowledgedWrite) {
  std::vector<std::vector<std::string>> sets, gets;
  for (int i = 0; i < 300; ++i) {
    sets.push_back({"SET", absl::StrCat("fo-", i), absl::StrCat("v", i)});
    gets.push_back({"GET", absl::StrCat("fo-", i)});
  }
  for (const auto& r : client_->Pipeline(sets, In(absl::Seconds(10)))) ASSERT_TRUE(r.ok());
  ASSERT_TRUE(cluster().WaitForReplicas(absl::Seconds(10)).ok());
  const uint16_t slot = RedisCluster::SlotOf("fo-0");
  auto victim = cluster().MasterOf(slot);
  ASSERT_TRUE(victim.ok());
  ASSERT_TRUE(cluster().Kill(*victim).ok());
  // During the failover every call returns by its deadline: a value, or a retryable error.
  const absl::Time give_up = In(absl::Seconds(20));
  bool answered = false;
  int calls = 0;
  while (!answered && absl::Now() < give_up) {
    const absl::Time deadline = In(absl::Milliseconds(400));
    auto r = client_->Run({"GET", "fo-0"}, deadline);
    EXPECT_LE(absl::Now(), deadline + kMargin) << "call " << calls;
    ++calls;
    if (r.ok()) {
      EXPECT_EQ(r->str, "v0");
      answered = true;
    } else {
      EXPECT_TRUE(absl::IsUnavailable(r.status()) || absl::IsDeadlineExceeded(r.status()))
          << r.status();
    }
  }
  EXPECT_TRUE(answered) << "no answer after " << calls << " calls";
  ASSERT_TRUE(cluster().WaitForPromotion(*victim, slot, absl::Seconds(20)).ok());
  const auto replies = client_->Pipeline(gets, In(absl::Seconds(10)));
  for (int i = 0; i < 300; ++i) {
    ASSERT_TRUE(replies[i].ok()) << i << ": " << replies[i].status();
    EXPECT_EQ(replies[i]->str, absl::StrCat("v", i));
  }
  // The promoted master has no replica left.
  auto replica = client_->RunOnReplica({"GET", "fo-0"}, In(absl::Seconds(5)));
  EXPECT_TRUE(absl::IsNotFound(replica.status())) << replica.status();
}

}  // namespace
}  // namespace kvtier::daemon
