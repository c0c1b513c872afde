// SessionManager: sessions of tenants on real arenas and the CPU backend — open/close and
// every validation error (code and message), quotas, tenant isolation, attach
// authorization, offload → commit → fetch round trips, broken streams, steps against a
// Retriever run directly, reattach and drain.
#include "daemon/session_manager.h"

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_replace.h"
#include "daemon/session_params.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/registry.h"
#include "offload/page_pool.h"
#include "offload/session_region.h"
#include "spdlog/spdlog.h"
#include "tests/daemon/session_manager_testutil.h"
#include "tests/testutil/random_fill.h"

namespace kvtier::daemon {
namespace {

using session_manager_testing::Bytes;
using session_manager_testing::Chunk;
using session_manager_testing::ExpectedPage;
using session_manager_testing::ExpectError;
using session_manager_testing::GrpcParams;
using session_manager_testing::kMiB;
using session_manager_testing::MakeTenant;
using session_manager_testing::Rows;
using session_manager_testing::SessionManagerTest;
using session_manager_testing::ShmParams;
using session_manager_testing::SmallGeometry;
using session_manager_testing::TestConfig;
using ::testing::HasSubstr;
using ::testing::SizeIs;
using testing::TypedBuffer;

// ---- open / close -------------------------------------------------------------------------

TEST_F(SessionManagerTest, OpenResolvesDefaultsAndCloseFreesTheRegion) {
  OpenSessionParams p = GrpcParams("a");
  p.max_tokens = 0;
  p.budget_tokens = 0;
  const SessionRecord r = Open(p);
  EXPECT_THAT(r.id, SizeIs(32));
  EXPECT_EQ(r.id.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_EQ(r.spec.tenant, "a");
  EXPECT_EQ(r.spec.label, "test");
  EXPECT_EQ(r.spec.sequence.max_tokens, 256);   // default_max_tokens
  EXPECT_EQ(r.spec.budget_tokens, 256);         // 2048 capped at the capacity
  EXPECT_FLOAT_EQ(r.spec.sequence.correction_threshold, kDefaultCorrectionThreshold);
  EXPECT_EQ(r.spec.sequence.correction_trigger, CorrectionTrigger::kCosine);
  EXPECT_FLOAT_EQ(r.spec.sequence.correction_max_loss, 0.1f);
  EXPECT_EQ(r.epoch, 1u);
  EXPECT_EQ(r.committed_tokens, std::vector<uint64_t>(2, 0));
  EXPECT_EQ(r.region_offset % kRegionAlignment, 0u);
  EXPECT_GT(r.region_bytes, 0u);
  // A GRPC session's Retriever lives in the daemon: its memory is charged to the tenant too.
  EXPECT_GT(manager_->tenant("a").charged_bytes(), 0u);
  EXPECT_EQ(manager_->tenant("a").used_bytes(),
            r.region_bytes + manager_->tenant("a").charged_bytes());

  absl::StatusOr<CloseResult> c = manager_->CloseSession(Caller{"a"}, r.id);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->freed_bytes, r.region_bytes);
  EXPECT_EQ(manager_->tenant("a").used_bytes(), 0u);
  EXPECT_EQ(manager_->tenant("a").charged_bytes(), 0u);
  ExpectError(manager_->CloseSession(Caller{"a"}, r.id).status(), absl::StatusCode::kNotFound,
              {"no such session"});
  EXPECT_TRUE(manager_->ListSessions(Caller{"a"}).empty());
}

TEST_F(SessionManagerTest, ListSessionsShowsTheCallersTenantInCreationOrder) {
  const SessionRecord a1 = Open(GrpcParams("a"));
  const SessionRecord b1 = Open(ShmParams("b"));
  const SessionRecord a2 = Open(ShmParams("a"));
  std::vector<SessionRecord> list = manager_->ListSessions(Caller{"a"});
  ASSERT_THAT(list, SizeIs(2));
  EXPECT_EQ(list[0].id, a1.id);
  EXPECT_EQ(list[1].id, a2.id);
  EXPECT_EQ(list[1].spec.transport, Transport::kShm);
  list = manager_->ListSessions(Caller{"b"});
  ASSERT_THAT(list, SizeIs(1));
  EXPECT_EQ(list[0].id, b1.id);
}

struct BadOpen {
  std::string name;
  void (*mutate)(OpenSessionParams*);
  absl::StatusCode code;
  std::vector<std::string> needles;
};

class OpenValidationTest : public SessionManagerTest,
                           public ::testing::WithParamInterface<BadOpen> {};

TEST_P(OpenValidationTest, RefusesWithTheFieldAndTheLimit) {
  OpenSessionParams p = GrpcParams("a");
  GetParam().mutate(&p);
  absl::StatusOr<SessionRecord> r = manager_->OpenSession(Caller{"a"}, p);
  ExpectError(r.status(), GetParam().code, GetParam().needles);
  EXPECT_EQ(manager_->tenant("a").used_bytes(), 0u);
  EXPECT_EQ(manager_->tenant("a").refused_requests(), 1u);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, OpenValidationTest,
    ::testing::Values(BadOpen{"OtherTenant",
                              [](OpenSessionParams* p) { p->tenant = "b"; },
                              absl::StatusCode::kPermissionDenied,
                              {"tenant = 'b'", "caller's tenant 'a'"}},
                      BadOpen{"HeadDim",
                              [](OpenSessionParams* p) { p->geometry.head_dim = 100; },
                              absl::StatusCode::kInvalidArgument,
                              {"geometry.head_dim = 100", "512"}},
                      BadOpen{"PageSize",
                              [](OpenSessionParams* p) { p->geometry.page_size = 4; },
                              absl::StatusCode::kInvalidArgument,
                              {"geometry.page_size = 4", "8, 16, 32, 64, 128"}},
                      BadOpen{"Layers",
                              [](OpenSessionParams* p) { p->geometry.num_layers = 9; },
                              absl::StatusCode::kInvalidArgument,
                              {"num_layers = 9", "max_layers = 8"}},
                      BadOpen{"MaxTokens",
                              [](OpenSessionParams* p) { p->max_tokens = 2000; },
                              absl::StatusCode::kInvalidArgument,
                              {"max_tokens = 2000", "max_tokens_per_session = 1024"}},
                      BadOpen{"BudgetSplit",
                              [](OpenSessionParams* p) { p->budget_tokens = 48; },
                              absl::StatusCode::kInvalidArgument,
                              {"budget_tokens = 48", "multiple of 4"}},
                      BadOpen{"BudgetOverCapacity",
                              [](OpenSessionParams* p) { p->budget_tokens = 512; },
                              absl::StatusCode::kInvalidArgument,
                              {"budget_tokens = 512", "at most 256"}},
                      BadOpen{"Tau",
                              [](OpenSessionParams* p) {
                                p->correction_threshold = std::numeric_limits<float>::quiet_NaN();
                              },
                              absl::StatusCode::kInvalidArgument,
                              {"correction_threshold"}},
                      BadOpen{"Trigger",
                              [](OpenSessionParams* p) { p->correction_trigger = "entropy"; },
                              absl::StatusCode::kInvalidArgument,
                              {"retrieval.correction_trigger = 'entropy'", "cosine, mass"}},
                      BadOpen{"Summary",
                              [](OpenSessionParams* p) { p->summary = "pca"; },
                              absl::StatusCode::kInvalidArgument,
                              {"retrieval.summary = 'pca'", "key-codes, center-mad, minmax"}},
                      BadOpen{"MaxLoss",
                              [](OpenSessionParams* p) { p->correction_max_loss = 1.5f; },
                              absl::StatusCode::kInvalidArgument,
                              {"correction_max_loss = 1.5", "[0, 1]"}},
                      BadOpen{"MaxLossNaN",
                              [](OpenSessionParams* p) {
                                p->correction_max_loss = std::numeric_limits<float>::quiet_NaN();
                              },
                              absl::StatusCode::kInvalidArgument,
                              {"correction_max_loss = nan", "[0, 1]"}},
                      BadOpen{"Policy",
                              [](OpenSessionParams* p) { p->budget_policy = "greedy"; },
                              absl::StatusCode::kInvalidArgument,
                              {"policy.budget = 'greedy'", "fixed", "confidence"}},
                      BadOpen{"PolicyRange",
                              [](OpenSessionParams* p) {
                                p->budget_policy = "confidence";
                                p->policy_params["confidence.enter_tight"] = "2";
                              },
                              absl::StatusCode::kInvalidArgument,
                              {"confidence.enter_tight", "[0, 1]"}},
                      BadOpen{"HostDropEvict",
                              [](OpenSessionParams* p) { p->host_drop = "evict"; },
                              absl::StatusCode::kInvalidArgument,
                              {"host_drop = 'evict'", "refuse"}},
                      BadOpen{"HostDropDemoteInDropMode",
                              [](OpenSessionParams* p) {
                                p->mode = RetrievalMode::kDrop;
                                p->host_drop = "demote";
                              },
                              absl::StatusCode::kInvalidArgument,
                              {"host_drop = 'demote'", "no host tier"}},
                      BadOpen{"HostDropDemoteWithoutColdTier",
                              [](OpenSessionParams* p) { p->host_drop = "demote"; },
                              absl::StatusCode::kFailedPrecondition,
                              {"host_drop = 'demote'", "no cold tier"}},
                      BadOpen{"HostTokensBelowMaxWithoutDemote",
                              [](OpenSessionParams* p) { p->host_tokens = 128; },
                              absl::StatusCode::kInvalidArgument,
                              {"retrieval.host_tokens = 128", "host_drop = 'demote'"}},
                      BadOpen{"HostTokensAboveMax",
                              [](OpenSessionParams* p) { p->host_tokens = 4096; },
                              absl::StatusCode::kInvalidArgument,
                              {"retrieval.host_tokens = 4096", "max_tokens = 256"}},
                      BadOpen{"PolicyParams",
                              [](OpenSessionParams* p) { p->policy_params["alpha"] = "1"; },
                              absl::StatusCode::kInvalidArgument,
                              {"policy.params", "alpha"}},
                      BadOpen{"Label",
                              [](OpenSessionParams* p) { p->label = std::string(300, 'x'); },
                              absl::StatusCode::kInvalidArgument,
                              {"label: 300 bytes", "256"}}),
    [](const ::testing::TestParamInfo<BadOpen>& case_info) { return case_info.param.name; });

TEST_F(SessionManagerTest, ShmIsRefusedWhenTheDaemonServesNoAttachSocket) {
  DaemonConfig c = TestConfig();
  c.shm = false;
  manager_ = Make(c);
  ExpectError(manager_->OpenSession(Caller{"a"}, ShmParams("a")).status(),
              absl::StatusCode::kFailedPrecondition, {"transport = SHM", "shm = false"});
  absl::StatusOr<SessionRecord> grpc = manager_->OpenSession(Caller{"a"}, GrpcParams("a"));
  EXPECT_TRUE(grpc.ok()) << grpc.status();
}

// ---- quotas -------------------------------------------------------------------------------

TEST_F(SessionManagerTest, SessionCountLimitRefusesAndCloseReleases) {
  std::vector<SessionRecord> open;
  for (int i = 0; i < 4; ++i) open.push_back(Open(ShmParams("a")));
  ExpectError(manager_->OpenSession(Caller{"a"}, ShmParams("a")).status(),
              absl::StatusCode::kResourceExhausted,
              {"tenant 'a' has 4 sessions", "max_sessions_per_tenant = 4"});
  // Another tenant's count is its own.
  EXPECT_TRUE(manager_->OpenSession(Caller{"b"}, ShmParams("b")).ok());
  ASSERT_TRUE(manager_->CloseSession(Caller{"a"}, open[0].id).ok());
  EXPECT_TRUE(manager_->OpenSession(Caller{"a"}, ShmParams("a")).ok());
}

TEST_F(SessionManagerTest, MemoryQuotaRefusesWithTheSizesAndCloseReleases) {
  OpenSessionParams p = ShmParams("small");
  p.max_tokens = 1024;  // 256 slots of 2 KiB: more than half of the 1 MiB arena
  const SessionRecord first = Open(p);
  const uint64_t quota = manager_->tenant("small").quota_bytes();
  EXPECT_EQ(quota, 1 * kMiB);
  absl::StatusOr<SessionRecord> second = manager_->OpenSession(Caller{"small"}, p);
  ExpectError(second.status(), absl::StatusCode::kResourceExhausted,
              {"tenant 'small': session needs " + std::to_string(first.region_bytes) + " bytes",
               std::to_string(quota - first.region_bytes) + " of " + std::to_string(quota) +
                   " bytes free"});
  ASSERT_TRUE(manager_->CloseSession(Caller{"small"}, first.id).ok());
  const SessionRecord again = Open(p);
  EXPECT_EQ(again.region_offset, first.region_offset);
}

TEST(RegionAllocatorTest, FirstFitCoalescesOnFree) {
  RegionAllocator a(10 * 64, 64);
  EXPECT_EQ(a.Allocate(100), 0u);    // 2 units
  EXPECT_EQ(a.Allocate(64), 128u);   // 1 unit
  EXPECT_EQ(a.Allocate(192), 192u);  // 3 units
  EXPECT_EQ(a.free_bytes(), 4u * 64);
  a.Free(0, 100);
  a.Free(192, 192);
  EXPECT_EQ(a.free_ranges(), 2u);  // [0, 128) and [192, 640)
  EXPECT_EQ(a.Allocate(128), 0u);  // the first range that fits
  a.Free(0, 128);
  a.Free(128, 64);  // joins both neighbours
  EXPECT_EQ(a.free_ranges(), 1u);
  EXPECT_EQ(a.free_bytes(), 640u);
  EXPECT_EQ(a.largest_free(), 640u);
  EXPECT_FALSE(a.Allocate(641).has_value());
  EXPECT_FALSE(a.Allocate(0).has_value());
  EXPECT_EQ(a.Allocate(640), 0u);
  EXPECT_EQ(a.free_bytes(), 0u);
}

// ---- authentication and isolation ---------------------------------------------------------

TEST_F(SessionManagerTest, AuthenticateChecksTenantAndToken) {
  EXPECT_EQ(manager_->Authenticate("a", "tok-a")->tenant, "a");
  EXPECT_EQ(manager_->Authenticate("b", "anything")->tenant, "b");  // b has no token
  ExpectError(manager_->Authenticate("a", "wrong").status(), absl::StatusCode::kPermissionDenied,
              {"tenant 'a'", "x-kvtier-token"});
  ExpectError(manager_->Authenticate("a", "").status(), absl::StatusCode::kPermissionDenied,
              {"x-kvtier-token"});
  ExpectError(manager_->Authenticate("nobody", "").status(), absl::StatusCode::kPermissionDenied,
              {"x-kvtier-tenant = 'nobody'"});
  ExpectError(manager_->Authenticate("", "").status(), absl::StatusCode::kUnauthenticated,
              {"x-kvtier-tenant"});
}

// Another tenant's session id is answered exactly like an unknown one (same code, same
// message but for the id): the answers cannot tell which ids exist.
TEST_F(SessionManagerTest, AnotherTenantCannotTouchASession) {
  const SessionRecord r = Open(GrpcParams("a"));
  const Caller b{"b"};
  const absl::StatusCode denied = absl::StatusCode::kNotFound;
  const std::string unknown(r.id.size(), '0');
  const absl::Status theirs = manager_->CloseSession(b, r.id).status();
  const absl::Status nobodys = manager_->CloseSession(b, unknown).status();
  EXPECT_EQ(theirs.code(), nobodys.code());
  EXPECT_EQ(absl::StrReplaceAll(theirs.message(), {{r.id, unknown}}), nobodys.message());
  ExpectError(manager_->CloseSession(b, r.id).status(), denied, {r.id, "'b'"});
  ExpectError(manager_->StartFetch(b, r.id, 0, {}).status(), denied, {r.id});
  ExpectError(manager_->Step(b, r.id, 0, std::string(256, '\0'), true).status(), denied, {r.id});
  ExpectError(manager_->GetStats(b, r.id).status(), denied, {r.id});
  ExpectError(manager_->Reattach(b, r.id).status(), denied, {r.id});
  std::unique_ptr<OffloadStream> s = manager_->NewOffloadStream(b);
  Rows rows(SmallGeometry(), 8, 1);
  ExpectError(s->Add(Chunk(r.id, 0, rows, 0, 8, true, SmallGeometry())), denied, {r.id});
  EXPECT_TRUE(manager_->ListSessions(b).empty());
  // Still A's, untouched.
  ASSERT_THAT(manager_->ListSessions(Caller{"a"}), SizeIs(1));
  EXPECT_EQ(manager_->ListSessions(Caller{"a"})[0].epoch, 1u);
  EXPECT_EQ(manager_->tenant("b").refused_requests(), 8u);
}

TEST_F(SessionManagerTest, UnknownSessionIsNotFound) {
  ExpectError(manager_->CloseSession(Caller{"a"}, "0123").status(), absl::StatusCode::kNotFound,
              {"session_id = '0123'"});
  ExpectError(manager_->Reattach(Caller{"a"}, "").status(), absl::StatusCode::kNotFound,
              {"no such session"});
}

TEST_F(SessionManagerTest, AttachNeedsAnAllowedUidAndTheToken) {
  DaemonConfig c = TestConfig();
  c.tenants[1].uids = {12345, 23456};
  manager_ = Make(c);
  PeerCredentials me;
  me.pid = getpid();
  me.uid = geteuid();
  absl::StatusOr<AttachGrant> g = manager_->AuthorizeAttach(me, "a", "tok-a");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->fd, manager_->tenant("a").arena().fd());
  EXPECT_EQ(g->arena_bytes, manager_->tenant("a").arena().size());
  EXPECT_EQ(g->arena_name, "kvtier-a");

  ExpectError(manager_->AuthorizeAttach(me, "a", "nope").status(),
              absl::StatusCode::kPermissionDenied, {"tenant 'a'", "token"});
  PeerCredentials other = me;
  other.uid = me.uid + 1;
  ExpectError(manager_->AuthorizeAttach(other, "a", "tok-a").status(),
              absl::StatusCode::kPermissionDenied,
              {"uid " + std::to_string(other.uid), "daemon's uid " + std::to_string(me.uid)});
  // Tenant b lists its uids: the daemon's own is not among them.
  ExpectError(manager_->AuthorizeAttach(me, "b", "").status(), absl::StatusCode::kPermissionDenied,
              {"uid " + std::to_string(me.uid), "12345, 23456"});
  PeerCredentials listed = me;
  listed.uid = 23456;
  EXPECT_TRUE(manager_->AuthorizeAttach(listed, "b", "").ok());
  ExpectError(manager_->AuthorizeAttach(me, "zzz", "").status(), absl::StatusCode::kNotFound,
              {"tenant 'zzz'"});
  manager_->StartDrain();
  ExpectError(manager_->AuthorizeAttach(me, "a", "tok-a").status(), absl::StatusCode::kUnavailable,
              {"draining"});
}

// ---- offload, commit, fetch ---------------------------------------------------------------

TEST_F(SessionManagerTest, OffloadCommitsPagesThatFetchReadsBackAsHnd) {
  const Geometry g = SmallGeometry();
  const SessionRecord r = Open(GrpcParams("a"));
  std::vector<Rows> rows = {Rows(g, 40, 10), Rows(g, 40, 20)};
  const OffloadResult o = OffloadAll("a", r.id, rows, 0, 40, 16);
  EXPECT_EQ(o.committed_tokens, 80u);
  EXPECT_EQ(o.layer_tokens, (std::vector<uint64_t>{40, 40}));
  EXPECT_EQ(manager_->ListSessions(Caller{"a"})[0].committed_tokens,
            (std::vector<uint64_t>{40, 40}));

  for (int32_t l = 0; l < 2; ++l) {
    // 40 tokens = 5 full pages; the partial sixth stays in the working set.
    std::vector<PageData> pages = FetchAll(Caller{"a"}, r.id, l);
    ASSERT_THAT(pages, SizeIs(5));
    for (int64_t i = 0; i < 5; ++i) {
      EXPECT_EQ(pages[i].layer, l);
      EXPECT_EQ(pages[i].page, i);
      EXPECT_GE(pages[i].generation, 1u);
      EXPECT_EQ(pages[i].data, ExpectedPage(g, rows[l], i)) << "layer " << l << " page " << i;
    }
  }
  // Named pages come in the order asked.
  std::vector<PageData> named = FetchAll(Caller{"a"}, r.id, 1, {3, 1});
  ASSERT_THAT(named, SizeIs(2));
  EXPECT_EQ(named[0].page, 3);
  EXPECT_EQ(named[1].data, ExpectedPage(g, rows[1], 1));

  absl::StatusOr<StatsReport> stats = manager_->GetStats(Caller{"a"}, r.id);
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_TRUE(stats->session.has_value());
  EXPECT_EQ(stats->session->committed_pages, 10u);
  EXPECT_EQ(stats->session->sequence.appended_tokens, 80);
  EXPECT_EQ(stats->tenant.sessions, 1u);
  EXPECT_EQ(stats->tenant.used_bytes, r.region_bytes + manager_->tenant("a").charged_bytes());

  // More tokens later extend the same pages.
  std::vector<Rows> more = {Rows(g, 48, 10), Rows(g, 48, 20)};  // same seeds: same prefix
  const OffloadResult o2 = OffloadAll("a", r.id, more, 40, 8, 8);
  EXPECT_EQ(o2.layer_tokens, (std::vector<uint64_t>{48, 48}));
  std::vector<PageData> six = FetchAll(Caller{"a"}, r.id, 0);
  ASSERT_THAT(six, SizeIs(6));
  EXPECT_EQ(six[5].data, ExpectedPage(g, more[0], 5));
}

TEST_F(SessionManagerTest, FetchSplitsIntoMessagesAndChecksPages) {
  const Geometry g = SmallGeometry();
  const SessionRecord r = Open(GrpcParams("a"));
  std::vector<Rows> rows = {Rows(g, 40, 1), Rows(g, 40, 2)};
  OffloadAll("a", r.id, rows, 0, 40, 40);
  const uint64_t per_page = g.host_page_bytes() + SessionManager::kPageOverheadBytes;

  absl::StatusOr<std::unique_ptr<FetchCursor>> c = manager_->StartFetch(Caller{"a"}, r.id, 0, {});
  ASSERT_TRUE(c.ok()) << c.status();
  std::vector<size_t> sizes;
  while (!(*c)->done()) {
    absl::StatusOr<std::vector<PageData>> batch = (*c)->Next(2 * per_page + 10);
    ASSERT_TRUE(batch.ok()) << batch.status();
    sizes.push_back(batch->size());
  }
  EXPECT_EQ(sizes, (std::vector<size_t>{2, 2, 1}));

  c = manager_->StartFetch(Caller{"a"}, r.id, 0, {});
  ASSERT_TRUE(c.ok());
  ExpectError((*c)->Next(per_page - 1).status(), absl::StatusCode::kResourceExhausted,
              {"max_message_bytes = " + std::to_string(per_page - 1)});

  ExpectError(manager_->StartFetch(Caller{"a"}, r.id, 0, {1, 5}).status(),
              absl::StatusCode::kNotFound, {"layer 0 page 5 is not committed"});
  ExpectError(manager_->StartFetch(Caller{"a"}, r.id, 0, {32}).status(),
              absl::StatusCode::kOutOfRange, {"page 32", "32 pages per layer", "max_tokens = 256"});
  ExpectError(manager_->StartFetch(Caller{"a"}, r.id, 2, {}).status(),
              absl::StatusCode::kInvalidArgument, {"layer = 2", "num_layers = 2"});
}

TEST_F(SessionManagerTest, BrokenStreamLeavesNothingOfItsUncommittedChunks) {
  const Geometry g = SmallGeometry();
  const SessionRecord r = Open(GrpcParams("a"));
  Rows rows(g, 64, 3);
  {
    std::unique_ptr<OffloadStream> s = manager_->NewOffloadStream(Caller{"a"});
    ASSERT_TRUE(s->Add(Chunk(r.id, 0, rows, 0, 32, false, g)).ok());
    ASSERT_TRUE(s->Add(Chunk(r.id, 1, rows, 0, 32, false, g)).ok());
  }  // destroyed without Finish: the stream broke
  EXPECT_EQ(manager_->ListSessions(Caller{"a"})[0].committed_tokens, (std::vector<uint64_t>{0, 0}));
  EXPECT_TRUE(FetchAll(Caller{"a"}, r.id, 0).empty());
  {
    std::unique_ptr<OffloadStream> s = manager_->NewOffloadStream(Caller{"a"});
    ASSERT_TRUE(s->Add(Chunk(r.id, 0, rows, 0, 16, false, g)).ok());
    ASSERT_TRUE(s->Add(Chunk(r.id, 0, rows, 16, 8, true, g)).ok());
    ASSERT_TRUE(s->commit_due());
    ASSERT_TRUE(s->Commit().ok());  // applies 24 tokens
    ASSERT_TRUE(s->Add(Chunk(r.id, 0, rows, 24, 16, false, g)).ok());
  }
  EXPECT_EQ(manager_->ListSessions(Caller{"a"})[0].committed_tokens,
            (std::vector<uint64_t>{24, 0}));
  std::vector<PageData> pages = FetchAll(Caller{"a"}, r.id, 0);
  ASSERT_THAT(pages, SizeIs(3));
  EXPECT_EQ(pages[2].data, ExpectedPage(g, rows, 2));
}

TEST_F(SessionManagerTest, OffloadValidatesEachMessage) {
  const Geometry g = SmallGeometry();
  const SessionRecord r = Open(GrpcParams("a"));
  const SessionRecord shm = Open(ShmParams("a"));
  Rows rows(g, 260, 4);  // 257 tokens are read for the capacity check
  const auto add = [&](OffloadChunk c) {
    return manager_->NewOffloadStream(Caller{"a"})->Add(std::move(c));
  };
  ExpectError(add(Chunk(r.id, 2, rows, 0, 8, false, g)), absl::StatusCode::kInvalidArgument,
              {"layer = 2", "num_layers = 2"});
  OffloadChunk none = Chunk(r.id, 0, rows, 0, 8, false, g);
  none.num_tokens = 0;
  ExpectError(add(none), absl::StatusCode::kInvalidArgument,
              {"num_tokens = 0", "max_tokens_per_offload = 256"});
  OffloadChunk many = Chunk(r.id, 0, rows, 0, 8, false, g);
  many.num_tokens = 257;
  ExpectError(add(many), absl::StatusCode::kInvalidArgument, {"num_tokens = 257"});
  OffloadChunk short_k = Chunk(r.id, 0, rows, 0, 8, false, g);
  short_k.k.resize(100);
  ExpectError(add(short_k), absl::StatusCode::kInvalidArgument, {"k: 100 bytes", "needs 1024"});
  OffloadChunk long_v = Chunk(r.id, 0, rows, 0, 8, false, g);
  long_v.v += "x";
  ExpectError(add(long_v), absl::StatusCode::kInvalidArgument, {"v: 1025 bytes", "needs 1024"});
  ExpectError(add(Chunk(shm.id, 0, rows, 0, 8, false, g)), absl::StatusCode::kFailedPrecondition,
              {"uses SHM"});

  std::unique_ptr<OffloadStream> s = manager_->NewOffloadStream(Caller{"a"});
  ASSERT_TRUE(s->Add(Chunk(r.id, 0, rows, 0, 200, false, g)).ok());
  ExpectError(s->Add(Chunk(shm.id, 0, rows, 0, 8, false, g)), absl::StatusCode::kInvalidArgument,
              {"session_id = '" + shm.id + "'", "every message"});
  // The error sticks: the stream is done.
  ExpectError(s->Add(Chunk(r.id, 0, rows, 0, 8, false, g)), absl::StatusCode::kInvalidArgument,
              {"every message"});
  EXPECT_FALSE(s->Finish().ok());

  s = manager_->NewOffloadStream(Caller{"a"});
  ASSERT_TRUE(s->Add(Chunk(r.id, 0, rows, 0, 200, false, g)).ok());
  ExpectError(s->Add(Chunk(r.id, 0, rows, 200, 57, false, g)), absl::StatusCode::kOutOfRange,
              {"layer 0 would hold 257 tokens", "max_tokens is 256"});
  EXPECT_EQ(manager_->ListSessions(Caller{"a"})[0].committed_tokens, (std::vector<uint64_t>{0, 0}));
}

TEST_F(SessionManagerTest, ClosingASessionFailsItsOpenStream) {
  const Geometry g = SmallGeometry();
  const SessionRecord r = Open(GrpcParams("a"));
  Rows rows(g, 16, 5);
  std::unique_ptr<OffloadStream> s = manager_->NewOffloadStream(Caller{"a"});
  ASSERT_TRUE(s->Add(Chunk(r.id, 0, rows, 0, 16, false, g)).ok());
  ASSERT_TRUE(manager_->CloseSession(Caller{"a"}, r.id).ok());
  ExpectError(s->Finish().status(), absl::StatusCode::kNotFound, {"was closed"});
  s.reset();
  EXPECT_EQ(manager_->tenant("a").used_bytes(), 0u);  // the last reference returned it
}

// ---- SHM sessions: the engine writes, the daemon reads with range checks --------------------

TEST_F(SessionManagerTest, ShmSessionReportsWhatTheEngineCommitted) {
  const Geometry g = SmallGeometry();
  const SessionRecord r = Open(ShmParams("a"));
  // The engine's side: the region in its mapping of the arena.
  void* base = static_cast<char*>(manager_->tenant("a").arena().data()) + r.region_offset;
  absl::StatusOr<SessionRegion> region = SessionRegion::Open(base, r.region_bytes, g);
  ASSERT_TRUE(region.ok()) << region.status();
  const std::string page(g.host_page_bytes(), 'p');
  for (int64_t page_index : {0, 1, 3}) {
    std::memcpy(const_cast<void*>(region->SlotData(10 + page_index)), page.data(), page.size());
    ASSERT_TRUE(region->Commit(0, page_index, 10 + page_index, 7, region->epoch()).ok());
  }
  EXPECT_EQ(manager_->ListSessions(Caller{"a"})[0].committed_tokens,
            (std::vector<uint64_t>{16, 0}));  // the committed prefix: pages 0 and 1
  std::vector<PageData> pages = FetchAll(Caller{"a"}, r.id, 0);
  ASSERT_THAT(pages, SizeIs(3));
  EXPECT_EQ(pages[2].page, 3);
  EXPECT_EQ(pages[2].generation, 7u);
  EXPECT_EQ(pages[2].data, page);

  absl::StatusOr<SessionRecord> re = manager_->Reattach(Caller{"a"}, r.id);
  ASSERT_TRUE(re.ok()) << re.status();
  EXPECT_EQ(re->epoch, 2u);
  EXPECT_EQ(re->committed_tokens, (std::vector<uint64_t>{16, 0}));
  // The previous holder is fenced off.
  EXPECT_EQ(region->Commit(0, 2, 12, 8, 1).code(), absl::StatusCode::kFailedPrecondition);
  ExpectError(manager_->Step(Caller{"a"}, r.id, 0, std::string(256, '\0'), true).status(),
              absl::StatusCode::kFailedPrecondition, {"uses SHM", "steps run in the engine"});
}

TEST_F(SessionManagerTest, OpenTakesTheCorrectionTriggerAndARetryMustRepeatIt) {
  OpenSessionParams p = GrpcParams("a");
  p.correction_trigger = "mass";
  p.correction_max_loss = 0.2f;
  p.request_id = "trigger-1";
  const SessionRecord r = Open(p);
  EXPECT_EQ(r.spec.sequence.correction_trigger, CorrectionTrigger::kMass);
  EXPECT_FLOAT_EQ(r.spec.sequence.correction_max_loss, 0.2f);
  EXPECT_EQ(r.spec.sequence.summary, SummaryMode::kKeyCodes);  // none given: the default
  EXPECT_EQ(Open(p).id, r.id);  // the same request again: the same session
  for (const auto& change : std::vector<std::function<void(OpenSessionParams*)>>{
           [](OpenSessionParams* q) { q->correction_trigger = "cosine"; },
           [](OpenSessionParams* q) { q->correction_max_loss.reset(); },
           [](OpenSessionParams* q) { q->summary = "center-mad"; },
           [](OpenSessionParams* q) { q->recent_pages = 1; }}) {
    OpenSessionParams other = p;
    change(&other);
    ExpectError(manager_->OpenSession(Caller{"a"}, other).status(),
                absl::StatusCode::kFailedPrecondition, {"with other parameters"});
  }
}

TEST_F(SessionManagerTest, OpenTakesASplitPartByPartAndPersistsIt) {
  OpenSessionParams p = GrpcParams("a");
  const SessionRecord plain = Open(p);
  SequenceOptions rule;
  ASSERT_TRUE(rule.SetBudgetTokens(plain.spec.budget_tokens, p.geometry.page_size).ok());
  EXPECT_EQ(plain.spec.sequence.sink_pages, rule.sink_pages);  // none given: the library's
  EXPECT_EQ(plain.spec.sequence.recent_pages, rule.recent_pages);

  p.sink_pages = 0;  // the recent pages left to the rule; the rest selected
  const SessionRecord r = Open(p);
  EXPECT_EQ(r.spec.sequence.sink_pages, 0);
  EXPECT_EQ(r.spec.sequence.recent_pages, rule.recent_pages);
  EXPECT_EQ(r.spec.sequence.selected_pages, rule.budget_pages() - rule.recent_pages);
  // The request kept for reopening (the cold tier's record) carries the split it resolved.
  const v1::OpenSessionRequest kept = ResolvedRequest(p, r.spec);
  ASSERT_TRUE(kept.retrieval().has_sink_pages());
  EXPECT_EQ(kept.retrieval().sink_pages(), 0u);
  EXPECT_EQ(kept.retrieval().recent_pages(), static_cast<uint32_t>(rule.recent_pages));

  p.recent_pages = 0;
  ExpectError(manager_->OpenSession(Caller{"a"}, p).status(), absl::StatusCode::kInvalidArgument,
              {"recent_pages = 0: must be >= 1"});
  p.recent_pages = static_cast<uint32_t>(rule.budget_pages() + 1);
  ExpectError(manager_->OpenSession(Caller{"a"}, p).status(), absl::StatusCode::kInvalidArgument,
              {"selected_pages = -1: must be >= 0"});
}

// ---- Step -----------------------------------------------------------------------------------

TEST_F(SessionManagerTest, StepMatchesARetrieverRunDirectly) {
  const Geometry g = SmallGeometry();
  OpenSessionParams p = GrpcParams("a");
  p.correction_threshold = 0.5f;
  const SessionRecord r = Open(p);

  // The reference: the same options on its own CPU backend and page pool.
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(DeviceKind::kCpu, {2});
  ASSERT_TRUE(backend.ok());
  const int64_t slots = int64_t{g.num_layers} * r.spec.max_pages();
  void* mem = std::aligned_alloc(PagePool::kSlotAlignment, slots * g.host_page_bytes());
  std::unique_ptr<PagePool> pool = PagePool::Create(mem, g.host_page_bytes(), slots).value();
  std::unique_ptr<Retriever> ref =
      Retriever::Create(g, r.spec.sequence, **backend, pool.get()).value();

  std::vector<Rows> rows = {Rows(g, 200, 31), Rows(g, 200, 32)};
  OffloadAll("a", r.id, rows, 0, 150, 50);
  for (int32_t l = 0; l < 2; ++l) {
    for (int64_t t = 0; t < 150; t += 50) {
      OffloadChunk c = Chunk(r.id, l, rows[l], t, 50, false, g);
      ASSERT_TRUE(ref->Append(l, c.k.data(), c.v.data(), 50).ok());
      ASSERT_TRUE(ref->Wait().ok());
    }
  }
  std::mt19937_64 rng(7);
  int corrected = 0;
  for (int32_t step = 0; step < 12; ++step) {
    const int32_t l = step % 2;
    TypedBuffer q(g.dtype, int64_t{g.num_q_heads} * g.head_dim);
    q.FillNormal(rng());
    const std::string qs = Bytes(q);
    absl::StatusOr<StepResult> got = manager_->Step(Caller{"a"}, r.id, l, qs, true);
    ASSERT_TRUE(got.ok()) << got.status();

    absl::StatusOr<WorkingSetView> view = ref->BeginStep(l, q.data());
    ASSERT_TRUE(view.ok()) << view.status();
    TypedBuffer out(g.dtype, int64_t{g.num_q_heads} * g.head_dim);
    std::vector<float> lse(g.num_q_heads);
    ASSERT_TRUE(ref->Attend(l, q.data(), out.data(), lse.data()).ok());
    std::vector<int32_t> table(static_cast<size_t>(g.num_kv_heads) * view->num_slots);
    ASSERT_TRUE(ref->compute_stream().Synchronize().ok());
    std::memcpy(table.data(), view->slot_table, table.size() * sizeof(int32_t));
    ASSERT_TRUE(ref->EndStep(l, q.data()).ok());
    ASSERT_TRUE(ref->Wait().ok());  // every statistic of the step collected

    EXPECT_EQ(got->layer, l);
    EXPECT_EQ(got->num_tokens, view->num_tokens);
    EXPECT_EQ(got->num_slots, view->num_slots);
    EXPECT_EQ(got->slot_table, table) << "step " << step;
    EXPECT_EQ(got->output, Bytes(out)) << "step " << step;
    EXPECT_EQ(got->lse, lse) << "step " << step;
    EXPECT_EQ(got->corrected_heads, ref->LastStep(l).corrected_heads);
    corrected += got->corrected_heads;

    // A decode token for this layer after each step, as an engine would.
    if (step % 2 == 1) {
      const int64_t t = 150 + step / 2;
      std::unique_ptr<OffloadStream> s = manager_->NewOffloadStream(Caller{"a"});
      for (int32_t layer = 0; layer < 2; ++layer) {
        OffloadChunk c = Chunk(r.id, layer, rows[layer], t, 1, layer == 1, g);
        ASSERT_TRUE(ref->Append(layer, c.k.data(), c.v.data(), 1).ok());
        // The reference reads c's bytes on its stream; the commit below frees them.
        ASSERT_TRUE(ref->Wait().ok());
        ASSERT_TRUE(s->Add(std::move(c)).ok());
      }
      ASSERT_TRUE(s->Finish().ok());
    }
  }
  EXPECT_GT(corrected, 0);  // random queries drift: the correction path ran

  absl::StatusOr<StatsReport> stats = manager_->GetStats(Caller{"a"}, r.id);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->session->sequence.steps, 12);
  ASSERT_TRUE(ref->Close().ok());
  ref.reset();
  pool.reset();
  std::free(mem);
}

TEST_F(SessionManagerTest, StepChecksItsRequest) {
  const Geometry g = SmallGeometry();
  const SessionRecord r = Open(GrpcParams("a"));
  const std::string q(static_cast<size_t>(g.num_q_heads) * g.head_dim * 4, '\0');
  ExpectError(manager_->Step(Caller{"a"}, r.id, 0, q, true).status(),
              absl::StatusCode::kFailedPrecondition, {"no tokens"});
  ExpectError(manager_->Step(Caller{"a"}, r.id, 0, q.substr(1), true).status(),
              absl::StatusCode::kInvalidArgument, {"q: 255 bytes", "expected 256"});
  ExpectError(manager_->Step(Caller{"a"}, r.id, 5, q, true).status(),
              absl::StatusCode::kInvalidArgument, {"layer = 5", "num_layers = 2"});
}

TEST_F(SessionManagerTest, ConcurrentCallsOnOneSessionSerialize) {
  const Geometry g = SmallGeometry();
  const SessionRecord r = Open(GrpcParams("a"));
  std::vector<Rows> rows = {Rows(g, 64, 41), Rows(g, 64, 42)};
  OffloadAll("a", r.id, rows, 0, 64, 64);
  std::vector<std::thread> threads;
  for (int32_t l = 0; l < 2; ++l) {
    threads.emplace_back([&, l] {
      TypedBuffer q(g.dtype, int64_t{g.num_q_heads} * g.head_dim);
      for (int i = 0; i < 20; ++i) {
        q.FillNormal(100 * l + i);
        EXPECT_TRUE(manager_->Step(Caller{"a"}, r.id, l, Bytes(q), i % 2 == 0).ok());
        EXPECT_THAT(FetchAll(Caller{"a"}, r.id, l), SizeIs(8));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(manager_->GetStats(Caller{"a"}, r.id)->session->sequence.steps, 40);
}

// ---- drain and shutdown ---------------------------------------------------------------------

TEST_F(SessionManagerTest, DrainNeedsTheAdminTokenAndRefusesNewSessions) {
  const SessionRecord r = Open(GrpcParams("a"));
  ExpectError(manager_->Drain("tok-a", absl::ZeroDuration()).status(),
              absl::StatusCode::kPermissionDenied, {"admin token"});
  EXPECT_FALSE(manager_->draining());

  std::unique_ptr<OffloadStream> stream = manager_->NewOffloadStream(Caller{"a"});
  absl::StatusOr<DrainResult> d = manager_->Drain("admin-secret", absl::ZeroDuration());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->drained);  // the stream is in flight
  EXPECT_EQ(d->inflight_calls, 1u);
  EXPECT_EQ(d->open_sessions, 1u);
  EXPECT_TRUE(manager_->draining());
  ExpectError(manager_->OpenSession(Caller{"a"}, GrpcParams("a")).status(),
              absl::StatusCode::kUnavailable, {"draining"});
  // Sessions already open keep working.
  EXPECT_TRUE(manager_->StartFetch(Caller{"a"}, r.id, 0, {}).ok());

  // A Drain that waits returns once the stream ends.
  absl::StatusOr<DrainResult> waited;
  std::thread drainer([&] { waited = manager_->Drain("admin-secret", absl::InfiniteDuration()); });
  stream.reset();
  drainer.join();
  ASSERT_TRUE(waited.ok());
  EXPECT_TRUE(waited->drained);
  EXPECT_EQ(waited->inflight_calls, 0u);

  EXPECT_EQ(manager_->CloseAllSessions(), 1u);
  EXPECT_EQ(manager_->tenant("a").used_bytes(), 0u);
  EXPECT_TRUE(manager_->ListSessions(Caller{"a"}).empty());
}

TEST_F(SessionManagerTest, DrainIsRefusedWithoutAnAdminToken) {
  DaemonConfig c = TestConfig();
  c.admin_token.clear();
  manager_ = Make(c);
  ExpectError(manager_->Drain("", absl::ZeroDuration()).status(),
              absl::StatusCode::kPermissionDenied, {"admin_token"});
  EXPECT_FALSE(manager_->draining());
}

TEST_F(SessionManagerTest, GetStatsReportsTheTenant) {
  const SessionRecord r = Open(ShmParams("a"));
  (void)manager_->CloseSession(Caller{"a"}, "missing");
  absl::StatusOr<StatsReport> s = manager_->GetStats(Caller{"a"}, "");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->session.has_value());
  EXPECT_EQ(s->tenant.tenant, "a");
  EXPECT_EQ(s->tenant.quota_bytes, 8 * kMiB);
  EXPECT_EQ(s->tenant.used_bytes, r.region_bytes);
  EXPECT_EQ(s->tenant.sessions, 1u);
  EXPECT_EQ(s->tenant.refused_requests, 1u);
}

}  // namespace
}  // namespace kvtier::daemon
