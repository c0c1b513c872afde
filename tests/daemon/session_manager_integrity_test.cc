// SessionManager under callers that run out of time, retry, flood or break their streams:
// deadlines and cancellation at every stage (nothing done when spent before, rolled back or
// kept for a retry when spent during), idempotent OpenSession, numbered Steps, start_token,
// per-tenant in-flight slots, the tenant quota covering the daemon's own memory of GRPC
// sessions, and the checks OpenSession makes up front.
#include <atomic>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "daemon/session_manager.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/daemon/session_manager_testutil.h"

namespace kvtier::daemon {
namespace {

using session_manager_testing::Chunk;
using session_manager_testing::ExpectError;
using session_manager_testing::GrpcParams;
using session_manager_testing::Rows;
using session_manager_testing::SessionManagerTest;
using session_manager_testing::ShmParams;
using session_manager_testing::SmallGeometry;
using session_manager_testing::TestConfig;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::SizeIs;
using testing::TypedBuffer;

using IntegrityTest = SessionManagerTest;

// A caller whose deadline passed a second ago.
Caller Expired(const std::string& tenant) {
  Caller c(tenant);
  c.deadline = absl::Now() - absl::Seconds(1);
  return c;
}

// A caller that cancels after `live_checks` checks said it was live.
Caller CancelsAfter(const std::string& tenant, int live_checks) {
  Caller c(tenant);
  auto checks = std::make_shared<std::atomic<int>>(0);
  c.cancelled = [checks, live_checks] { return checks->fetch_add(1) >= live_checks; };
  return c;
}

std::string Q(const Geometry& g, float x) {
  TypedBuffer q(g.dtype, int64_t{g.num_q_heads} * g.head_dim);
  q.FillNormal(static_cast<uint64_t>(x * 1000));
  return std::string(static_cast<const char*>(q.data()), q.bytes());
}

// ---- OpenSession -------------------------------------------------------------------------

TEST_F(IntegrityTest, OpenSessionWithASpentDeadlineDoesNothing) {
  ExpectError(manager_->OpenSession(Expired("a"), GrpcParams("a")).status(),
              absl::StatusCode::kDeadlineExceeded, {"OpenSession was not done"});
  EXPECT_TRUE(manager_->ListSessions(Caller("a")).empty());
  EXPECT_EQ(manager_->tenant("a").used_bytes(), 0u);
}

TEST_F(IntegrityTest, OpenSessionWhoseCallerLeavesDuringItIsRolledBack) {
  for (Transport t : {Transport::kGrpc, Transport::kShm}) {
    OpenSessionParams p = t == Transport::kGrpc ? GrpcParams("a") : ShmParams("a");
    // Live when the call starts, gone by the time the session is made.
    ExpectError(manager_->OpenSession(CancelsAfter("a", 1), p).status(),
                absl::StatusCode::kCancelled, {"the session it made was closed again"});
    EXPECT_TRUE(manager_->ListSessions(Caller("a")).empty());
    EXPECT_EQ(manager_->tenant("a").used_bytes(), 0u);  // region and daemon memory given back
    EXPECT_EQ(manager_->tenant("a").charged_bytes(), 0u);
  }
}

TEST_F(IntegrityTest, OpenSessionWithARequestIdIsIdempotent) {
  OpenSessionParams p = GrpcParams("a");
  p.request_id = "req-1";
  const SessionRecord first = Open(p);
  p.label = "the label may differ";
  const SessionRecord again = Open(p);
  EXPECT_EQ(again.id, first.id);
  EXPECT_THAT(manager_->ListSessions(Caller("a")), SizeIs(1));

  OpenSessionParams other = p;
  other.budget_tokens = 128;
  ExpectError(manager_->OpenSession(Caller("a"), other).status(),
              absl::StatusCode::kFailedPrecondition, {first.id, "other parameters"});
  // Ids are per tenant: b's req-1 is another session.
  OpenSessionParams b = GrpcParams("b");
  b.request_id = "req-1";
  EXPECT_NE(Open(b).id, first.id);
  // Once the session is closed, the id opens a new one.
  ASSERT_TRUE(manager_->CloseSession(Caller("a"), first.id).ok());
  EXPECT_NE(Open(p).id, first.id);

  OpenSessionParams bad = GrpcParams("a");
  bad.request_id = std::string("\x01\xff", 2);
  ExpectError(manager_->OpenSession(Caller("a"), bad).status(), absl::StatusCode::kInvalidArgument,
              {"request_id", "printable ASCII"});
  bad.request_id = std::string(65, 'x');
  ExpectError(manager_->OpenSession(Caller("a"), bad).status(), absl::StatusCode::kInvalidArgument,
              {"at most 64 bytes"});
}

TEST_F(IntegrityTest, OpenSessionChecksWhatTheDaemonServesUpFront) {
  OpenSessionParams page = GrpcParams("a");
  page.geometry.page_size = 7;
  ExpectError(manager_->OpenSession(Caller("a"), page).status(), absl::StatusCode::kInvalidArgument,
              {"page_size = 7", "8, 16, 32, 64, 128"});
  // Any finite τ: the mean cosine lies in [-1, 1], so τ > 1 always corrects, τ <= -1 never.
  for (float tau : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    OpenSessionParams p = GrpcParams("a");
    p.correction_threshold = tau;
    ExpectError(manager_->OpenSession(Caller("a"), p).status(), absl::StatusCode::kInvalidArgument,
                {"correction_threshold = ", "must be finite"});
  }
  for (float tau : {-2.0f, -1.0f, 0.0f, 1.0f, 1.5f, 5.0f}) {
    OpenSessionParams p = GrpcParams("a");
    p.correction_threshold = tau;
    const SessionRecord r = Open(p);
    ASSERT_TRUE(manager_->CloseSession(Caller("a"), r.id).ok());
  }
  // 8 tokens hold 1 page; the default budget (4 pages) selects 2 a step.
  OpenSessionParams tiny = GrpcParams("a");
  tiny.max_tokens = 8;
  tiny.budget_tokens = 0;
  ExpectError(manager_->OpenSession(Caller("a"), tiny).status(), absl::StatusCode::kInvalidArgument,
              {"selected_pages = 2: must be at most the 1 pages a layer holds", "max_tokens = 8",
               "the budget is 32 tokens"});
  tiny.mode = RetrievalMode::kFull;  // full mode selects nothing: fine
  EXPECT_TRUE(manager_->OpenSession(Caller("a"), tiny).ok());
}

// ---- Step --------------------------------------------------------------------------------

class StepTest : public IntegrityTest {
 protected:
  void SetUp() override {
    IntegrityTest::SetUp();
    r_ = Open(GrpcParams("a"));
    const Geometry g = SmallGeometry();
    OffloadAll("a", r_.id, {Rows(g, 64, 1), Rows(g, 64, 2)}, 0, 64, 64);
  }
  absl::StatusOr<StepResult> Step(uint64_t step, const std::string& q,
                                  const Caller& caller = Caller("a")) {
    return manager_->Step(caller, r_.id, 0, q, true, step);
  }
  uint64_t StepsRun() { return manager_->ListSessions(Caller("a"))[0].steps_run[0]; }
  SessionRecord r_;
};

TEST_F(StepTest, NumberedStepsRunOnceAndAreReplayedOnRetry) {
  const Geometry g = SmallGeometry();
  absl::StatusOr<StepResult> first = Step(1, Q(g, 1));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->step, 1u);
  EXPECT_FALSE(first->replayed);

  absl::StatusOr<StepResult> again = Step(1, Q(g, 1));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->replayed);
  EXPECT_EQ(again->step, 1u);
  EXPECT_EQ(again->output, first->output);
  EXPECT_EQ(again->slot_table, first->slot_table);
  EXPECT_EQ(again->lse, first->lse);
  EXPECT_EQ(StepsRun(), 1u);

  // The same number with another q, or a number out of order, is refused with the count.
  for (const auto& [n, q] : {std::pair<uint64_t, std::string>{1, Q(g, 2)}, {3, Q(g, 2)}}) {
    absl::Status st = Step(n, q).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_EQ(Trailer(st, kStepsRunTrailer), "1");
  }
  EXPECT_EQ(StepsRun(), 1u);
  ASSERT_TRUE(Step(2, Q(g, 2)).ok());
  ASSERT_TRUE(Step(0, Q(g, 3)).ok());  // unnumbered: runs, counts
  EXPECT_EQ(StepsRun(), 3u);
  EXPECT_EQ(Step(3, Q(g, 3)).status().code(), absl::StatusCode::kOk);  // replays step 3
  EXPECT_EQ(StepsRun(), 3u);
}

TEST_F(IntegrityTest, AStepTheRetrieverRefusesDoesNotCount) {
  const Geometry g = SmallGeometry();
  const SessionRecord r = Open(GrpcParams("a"));  // nothing appended: BeginStep refuses
  absl::Status st = manager_->Step(Caller("a"), r.id, 0, Q(g, 1), true, 1).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_EQ(manager_->ListSessions(Caller("a"))[0].steps_run[0], 0u);
  OffloadAll("a", r.id, {Rows(g, 16, 1), Rows(g, 16, 2)}, 0, 16, 16);
  absl::StatusOr<StepResult> again = manager_->Step(Caller("a"), r.id, 0, Q(g, 1), true, 1);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->replayed);
}

TEST_F(StepTest, AStepWithASpentDeadlineRunsNothing) {
  const Geometry g = SmallGeometry();
  ExpectError(Step(1, Q(g, 1), Expired("a")).status(), absl::StatusCode::kDeadlineExceeded,
              {"step 1 of layer 0 was not done"});
  EXPECT_EQ(StepsRun(), 0u);
  absl::StatusOr<StepResult> st = Step(1, Q(g, 1));
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_FALSE(st->replayed);  // nothing of the refused call was kept
}

// ---- Offload -----------------------------------------------------------------------------

TEST_F(IntegrityTest, OffloadStartTokenMustContinueTheLayer) {
  const Geometry g = SmallGeometry();
  const SessionRecord r = Open(GrpcParams("a"));
  Rows rows(g, 64, 3);
  std::unique_ptr<OffloadStream> s = manager_->NewOffloadStream(Caller("a"));
  OffloadChunk c = Chunk(r.id, 0, rows, 0, 16, false, g);
  c.start_token = 0;
  ASSERT_TRUE(s->Add(std::move(c)).ok());
  OffloadChunk next = Chunk(r.id, 0, rows, 16, 8, false, g);
  next.start_token = 16;  // the layer holds 0, the stream staged 16
  ASSERT_TRUE(s->Add(std::move(next)).ok());
  OffloadChunk twice = Chunk(r.id, 0, rows, 16, 8, true, g);
  twice.start_token = 16;
  ExpectError(s->Add(std::move(twice)), absl::StatusCode::kFailedPrecondition,
              {"message 3", "start_token = 16", "layer 0 ends at token 24"});
  EXPECT_THAT(manager_->ListSessions(Caller("a"))[0].committed_tokens, ElementsAre(0, 0));
}

TEST_F(IntegrityTest, StagedChunksAreChargedUntilAppliedOrDiscarded) {
  const Geometry g = SmallGeometry();
  const SessionRecord r = Open(GrpcParams("a"));
  const uint64_t base = manager_->tenant("a").charged_bytes();
  Rows rows(g, 64, 4);
  const uint64_t chunk_bytes =
      uint64_t{2} * 16 * static_cast<uint64_t>(g.num_kv_heads) * g.head_dim * g.element_bytes();
  uint64_t after_commit = 0;
  {
    std::unique_ptr<OffloadStream> s = manager_->NewOffloadStream(Caller("a"));
    ASSERT_TRUE(s->Add(Chunk(r.id, 0, rows, 0, 16, false, g)).ok());
    EXPECT_EQ(manager_->tenant("a").charged_bytes(), base + chunk_bytes);
    ASSERT_TRUE(s->Add(Chunk(r.id, 0, rows, 16, 16, true, g)).ok());
    EXPECT_EQ(manager_->tenant("a").charged_bytes(), base + 2 * chunk_bytes);
    ASSERT_TRUE(s->Commit().ok());
    // The staged bytes went back (the Retriever itself may have grown by a few bytes).
    after_commit = manager_->tenant("a").charged_bytes();
    EXPECT_LT(after_commit, base + chunk_bytes / 2);
    ASSERT_TRUE(s->Add(Chunk(r.id, 0, rows, 32, 16, false, g)).ok());
    EXPECT_EQ(manager_->tenant("a").charged_bytes(), after_commit + chunk_bytes);
  }  // broken: discarded
  EXPECT_EQ(manager_->tenant("a").charged_bytes(), after_commit);
  EXPECT_THAT(manager_->ListSessions(Caller("a"))[0].committed_tokens, ElementsAre(32, 0));
}

TEST_F(IntegrityTest, CommitsHappenOnlyWhileTheCallerIsLive) {
  const Geometry g = SmallGeometry();
  const SessionRecord r = Open(GrpcParams("a"));
  Rows rows(g, 64, 5);
  // Two live checks pass: the first commit; the second commit finds the caller gone.
  std::unique_ptr<OffloadStream> s = manager_->NewOffloadStream(CancelsAfter("a", 1));
  ASSERT_TRUE(s->Add(Chunk(r.id, 0, rows, 0, 8, true, g)).ok());
  ASSERT_TRUE(s->Commit().ok());
  ASSERT_TRUE(s->Add(Chunk(r.id, 0, rows, 8, 8, true, g)).ok());
  ExpectError(s->Commit(), absl::StatusCode::kCancelled,
              {"message 2", "the commit at message 2 was not done", "8 tokens, stand",
               "its 8 uncommitted tokens were discarded"});
  EXPECT_THAT(manager_->ListSessions(Caller("a"))[0].committed_tokens, ElementsAre(8, 0));
  // A stream that breaks before its next message names it.
  std::unique_ptr<OffloadStream> t = manager_->NewOffloadStream(Caller("a"));
  ASSERT_TRUE(t->Add(Chunk(r.id, 1, rows, 0, 8, false, g)).ok());
  ExpectError(t->Break(absl::InvalidArgumentError("does not parse"), true),
              absl::StatusCode::kInvalidArgument, {"Offload message 2: does not parse"});
  EXPECT_THAT(manager_->ListSessions(Caller("a"))[0].committed_tokens, ElementsAre(8, 0));
}

// ---- Fetch, slots, quota -----------------------------------------------------------------

TEST_F(IntegrityTest, FetchSendsEachPageOnce) {
  const Geometry g = SmallGeometry();
  const SessionRecord r = Open(GrpcParams("a"));
  OffloadAll("a", r.id, {Rows(g, 24, 6), Rows(g, 24, 7)}, 0, 24, 24);
  std::vector<PageData> pages = FetchAll(Caller("a"), r.id, 0, {1, 1, 1, 0, 1, 2, 0});
  ASSERT_THAT(pages, SizeIs(3));
  EXPECT_EQ(pages[0].page, 1);
  EXPECT_EQ(pages[1].page, 0);
  EXPECT_EQ(pages[2].page, 2);
}

TEST_F(IntegrityTest, EachTenantHasItsOwnInflightSlots) {
  DaemonConfig c = TestConfig();
  c.max_inflight_calls_per_tenant = 2;
  manager_ = Make(c);
  absl::StatusOr<CallSlot> one = manager_->Admit(Caller("a"));
  absl::StatusOr<CallSlot> two = manager_->Admit(Caller("a"));
  ASSERT_TRUE(one.ok() && two.ok());
  absl::StatusOr<CallSlot> three = manager_->Admit(Caller("a"));
  ExpectError(three.status(), absl::StatusCode::kResourceExhausted,
              {"tenant 'a' has 2 calls in flight", "max_inflight_calls_per_tenant = 2"});
  EXPECT_TRUE(Trailer(three.status(), kRetryAfterTrailer).has_value());
  EXPECT_TRUE(manager_->Admit(Caller("b")).ok());
  *one = CallSlot();  // a call ends
  EXPECT_TRUE(manager_->Admit(Caller("a")).ok());
}

TEST(TenantTest, TheQuotaCoversRegionsAndDaemonMemory) {
  absl::StatusOr<std::unique_ptr<Tenant>> made =
      Tenant::Create(session_manager_testing::MakeTenant("t", "", 1 << 20));
  ASSERT_TRUE(made.ok()) << made.status();
  Tenant& t = **made;
  ASSERT_TRUE(t.Charge(768 << 10).ok());
  EXPECT_EQ(t.used_bytes(), 768u << 10);
  // 256 KiB left: a 512 KiB region does not fit, though the arena's addresses are free.
  absl::StatusOr<RegionLease> lease = t.AllocateRegion(512 << 10);
  ExpectError(lease.status(), absl::StatusCode::kResourceExhausted,
              {"262144 of 1048576 bytes free", "daemon memory of GRPC sessions"});
  ExpectError(t.Charge(512 << 10), absl::StatusCode::kResourceExhausted,
              {"daemon memory of a GRPC session needs 524288 more bytes"});
  t.Release(768 << 10);
  EXPECT_TRUE(t.AllocateRegion(512 << 10).ok());
}

}  // namespace
}  // namespace kvtier::daemon
