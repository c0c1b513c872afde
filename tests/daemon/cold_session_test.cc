// Sessions in the cold tier (docs/service.md#the-cold-tier), through the SessionManager,
// against a real Redis Cluster on loopback (3 masters with a replica each; the tests skip,
// saying why, without redis-server): a tenant filled far beyond its arena demotes its
// suspended sessions and every page reads back byte-exact; a full arena with nothing suspended
// still refuses, and so does a full cold quota; a daemon that shut down and started again
// finds its sessions and Reattach brings them back (GRPC sessions step again), and with a
// master paused at shutdown it still finds every session with no key there; a corrupted
// value is DATA_LOSS, never wrong bytes; a killed master loses nothing a demotion
// acknowledged (WAIT for a replica); a tenant's Redis ACL user reaches only its own keys.
// Live sessions with policy.host_drop = demote: pages move one by one and steps match a session
// that holds everything bit for bit; a corrupted demoted page is DATA_LOSS for the step that
// needs it; such a session survives a restart. SHM sessions' DemotePages / PromotePages: a
// promotion whose call ended (deadline, cancel) while its master was paused never writes its
// slot; a page named many times is written and charged once; a demotion WAIT refused leaves
// no keys and no charge after close. A master stalled under one tenant's demotions fails its
// calls at their deadlines and never holds the work queue's workers from another tenant; a
// Fetch of demoted pages from a stalled master ends at its deadline too.
#include <atomic>
#include <future>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "daemon/cold_store.h"
#include "daemon/cold_tier.h"
#include "daemon/redis_cluster.h"
#include "daemon/work_queue.h"
#include "kvtier/v1/cold_record.pb.h"
#include "offload/session_region.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "tests/daemon/session_manager_testutil.h"
#include "tests/testutil/redis_cluster_process.h"

namespace kvtier::daemon {
namespace {

using session_manager_testing::ExpectedPage;
using session_manager_testing::ExpectError;
using session_manager_testing::GrpcParams;
using session_manager_testing::kMiB;
using session_manager_testing::MakeTenant;
using session_manager_testing::Rows;
using session_manager_testing::ShmParams;
using session_manager_testing::SmallGeometry;
using session_manager_testing::TestConfig;
using ::testing::HasSubstr;

constexpr int64_t kTokens = 1000;  // 125 full pages per layer, no partial one

// A cluster, or why not: NOT_FOUND (no redis-server) skips a test, anything else fails it.
absl::StatusOr<std::unique_ptr<testing::RedisClusterProcess>> StartCluster() {
  return testing::RedisClusterProcess::Start(testing::RedisClusterProcessOptions());
}

class ColdSessionTest : public session_manager_testing::SessionManagerTest {
 protected:
  static void SetUpTestSuite() {
    // Failure detection well past the 0.8 s a test pauses a master for: no failover.
    testing::RedisClusterProcessOptions options;
    options.node_timeout_ms = 5000;
    absl::StatusOr<std::unique_ptr<testing::RedisClusterProcess>> c =
        testing::RedisClusterProcess::Start(options);
    if (c.ok()) {
      cluster_ = c->release();
    } else {
      start_error_ = new absl::Status(c.status());
    }
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
    delete start_error_;
    start_error_ = nullptr;
  }

  void SetUp() override {
    spdlog::set_level(spdlog::level::warn);
    if (cluster_ == nullptr) {
      if (absl::IsNotFound(*start_error_)) GTEST_SKIP() << *start_error_;
      FAIL() << "the cluster did not start: " << *start_error_;
    }
    prefix_ = absl::StrCat("t", ::testing::UnitTest::GetInstance()->random_seed(), "x",
                           counter_++);
  }

  // Tenant "small" (1.5 MiB: two GRPC sessions of 1024 tokens at a time) with a cold tier of
  // `cold_quota` bytes.
  DaemonConfig ColdConfig(uint64_t cold_quota = 64 * kMiB) const {
    DaemonConfig c = TestConfig();
    c.cold_tier.nodes = cluster_->seeds();
    c.cold_tier.key_prefix = prefix_;
    c.cold_tier.operation_timeout = absl::Seconds(20);
    c.cold_tier.min_replicas = 1;
    for (TenantConfig& t : c.tenants) {
      t.cold_quota_bytes = cold_quota;
      if (t.name == "small") t.host_memory_bytes = 3 * kMiB / 2;
    }
    return c;
  }

  static OpenSessionParams Big(OpenSessionParams p) {
    p.tenant = "small";
    p.max_tokens = 1024;
    return p;
  }

  // Opens a session of `p` with max_tokens 1024, offloads kTokens of fresh rows (GRPC) and returns their rows.
  std::string OpenFilled(OpenSessionParams p, uint64_t seed, std::vector<Rows>* rows) {
    p.max_tokens = 1024;
    absl::StatusOr<SessionRecord> r = manager_->OpenSession(Caller{p.tenant}, p);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return "";
    const Geometry g = SmallGeometry();
    rows->clear();
    for (int32_t l = 0; l < g.num_layers; ++l) rows->emplace_back(g, kTokens, seed + 10 * l);
    // Committed a chunk at a time: staged chunks count against the tenant's small arena.
    std::unique_ptr<OffloadStream> s = manager_->NewOffloadStream(Caller{p.tenant});
    for (int32_t l = 0; l < g.num_layers; ++l) {
      for (int64_t t = 0; t < kTokens; t += 200) {
        EXPECT_TRUE(s->Add(session_manager_testing::Chunk(r->id, l, (*rows)[l], t, 200, true, g))
                        .ok());
        const absl::Status c = s->Commit();
        EXPECT_TRUE(c.ok()) << c;
      }
    }
    absl::StatusOr<OffloadResult> done = s->Finish();
    EXPECT_TRUE(done.ok()) << done.status();
    return r->id;
  }

  void Suspend(const std::string& tenant, const std::string& id) {
    absl::StatusOr<SessionRecord> r = manager_->SuspendSession(Caller{tenant}, id);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->suspended);
  }

  // Every full page of every layer is the HND page of `rows`.
  void ExpectPages(const std::string& tenant, const std::string& id, const std::vector<Rows>& rows) {
    const Geometry g = SmallGeometry();
    for (int32_t l = 0; l < g.num_layers; ++l) {
      std::vector<PageData> pages = FetchAll(Caller{tenant}, id, l);
      ASSERT_EQ(pages.size(), static_cast<size_t>(kTokens / g.page_size)) << id << " layer " << l;
      for (const PageData& p : pages) {
        ASSERT_EQ(p.data, ExpectedPage(g, rows[l], p.page)) << id << " layer " << l << " page "
                                                            << p.page;
      }
    }
  }

  SessionRecord Listed(const std::string& tenant, const std::string& id) {
    for (const SessionRecord& r : manager_->ListSessions(Caller{tenant})) {
      if (r.id == id) return r;
    }
    ADD_FAILURE() << "session " << id << " is not listed";
    return {};
  }

  // An SHM session of tenant "a" that demotes pages (16 host pages per layer of 128), and in
  // *region its region as the engine maps it (left empty when the open failed).
  SessionRecord OpenShmDemoting(std::optional<SessionRegion>* region) {
    OpenSessionParams p = ShmParams("a");
    p.max_tokens = 1024;
    p.host_drop = "demote";
    p.host_tokens = 128;
    SessionRecord r = Open(p);
    EXPECT_FALSE(r.id.empty());
    if (!r.id.empty()) *region = EngineRegion("a", r);
    return r;
  }

  // The engine's side of an SHM session: its region in the engine's mapping of the arena.
  std::optional<SessionRegion> EngineRegion(const std::string& tenant, const SessionRecord& r) {
    void* base = static_cast<char*>(manager_->tenant(tenant).arena().data()) + r.region_offset;
    absl::StatusOr<SessionRegion> region = SessionRegion::Open(base, r.region_bytes, SmallGeometry());
    EXPECT_TRUE(region.ok()) << region.status();
    if (!region.ok()) return std::nullopt;
    return *region;
  }

  // The engine writes `bytes` into `slot` and commits it as (layer, page) of `generation`.
  static void EngineCommit(SessionRegion& region, int32_t layer, int64_t page, int64_t slot,
                           uint64_t generation, const std::string& bytes) {
    std::memcpy(const_cast<void*>(region.SlotData(slot)), bytes.data(), bytes.size());
    const absl::Status st = region.Commit(layer, page, slot, generation, region.epoch());
    ASSERT_TRUE(st.ok()) << st;
  }
  static std::string SlotBytes(const SessionRegion& region, int64_t slot) {
    return std::string(static_cast<const char*>(region.SlotData(slot)),
                       SmallGeometry().host_page_bytes());
  }

  // The value of one series of the manager's metrics; -1 when it is not there.
  double Metric(const std::string& series) {
    Exposition out;
    manager_->WriteMetrics(out);
    const std::string text = out.text();
    const size_t at = text.find(series + " ");
    return at == std::string::npos ? -1.0 : std::stod(text.substr(at + series.size() + 1));
  }
  double ColdUsed(const std::string& tenant) {
    return Metric(absl::StrCat("kvtier_cold_used_bytes{tenant=\"", tenant, "\"}"));
  }

  // Keys of session `id`'s demoted pages ("<session>.live") on the cluster's masters.
  int LiveKeys(const std::string& tenant, const std::string& id) {
    return Keys(absl::StrCat(prefix_, ":", tenant, ":{", id, ".live:*"));
  }
  // Keys of session `id`'s pages as a cold session's, and its record.
  int RecordPageKeys(const std::string& tenant, const std::string& id) {
    return Keys(absl::StrCat(prefix_, ":", tenant, ":{", id, ":*"));
  }
  int RecordKeys(const std::string& tenant, const std::string& id) {
    return Keys(absl::StrCat(prefix_, ":", tenant, ":{", id, "}:meta"));
  }
  // Keys matching `pattern` (SCAN MATCH) on the cluster's masters.
  int Keys(const std::string& pattern) {
    int n = 0;
    for (int node = 0; node < cluster_->size(); ++node) {
      absl::StatusOr<std::string> role = cluster_->Command(node, {"ROLE"});
      EXPECT_TRUE(role.ok()) << role.status();
      if (!role.ok() || !absl::StartsWith(*role, "master")) continue;
      std::string cursor = "0";
      do {
        absl::StatusOr<std::string> page =
            cluster_->Command(node, {"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"});
        EXPECT_TRUE(page.ok()) << page.status();
        if (!page.ok()) return -1;
        // The cursor, then one key a line.
        std::vector<std::string> lines = absl::StrSplit(*page, '\n', absl::SkipEmpty());
        if (lines.empty()) return -1;
        cursor = lines[0];
        n += static_cast<int>(lines.size()) - 1;
      } while (cursor != "0");
    }
    return n;
  }

  static testing::RedisClusterProcess* cluster_;
  static absl::Status* start_error_;
  static int counter_;
  std::string prefix_;
};

testing::RedisClusterProcess* ColdSessionTest::cluster_ = nullptr;
absl::Status* ColdSessionTest::start_error_ = nullptr;
int ColdSessionTest::counter_ = 0;

TEST_F(ColdSessionTest, FillsATenantBeyondItsArenaAndReadsEveryPageBack) {
  manager_ = Make(ColdConfig());
  ASSERT_NE(manager_, nullptr);
  // Five sessions of ~0.7 MiB each (region and daemon memory) through a 1.5 MiB arena:
  // opens demote the older ones.
  constexpr int kSessions = 5;
  std::vector<std::string> ids;
  std::vector<std::vector<Rows>> rows(kSessions);
  for (int i = 0; i < kSessions; ++i) {
    ids.push_back(OpenFilled(Big(GrpcParams("small")), 100 + i, &rows[i]));
    ASSERT_FALSE(ids.back().empty());
    Suspend("small", ids.back());
  }
  // The oldest are cold now, least recently suspended first; the newest is not.
  EXPECT_TRUE(Listed("small", ids[0]).cold);
  EXPECT_TRUE(Listed("small", ids[1]).cold);
  EXPECT_TRUE(Listed("small", ids[2]).cold);
  EXPECT_FALSE(Listed("small", ids.back()).cold);
  // Every session's every page comes back (each Fetch promotes one, demoting another).
  for (int i = 0; i < kSessions; ++i) {
    SCOPED_TRACE(i);
    ExpectPages("small", ids[i], rows[i]);
    EXPECT_FALSE(Listed("small", ids[i]).cold);
  }
  // The cold tier holds what was demoted: the counters moved both ways.
  absl::StatusOr<StatsReport> st = manager_->GetStats(Caller{"small"}, ids[0]);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->session->committed_pages, 2u * kTokens / SmallGeometry().page_size);
  EXPECT_TRUE(Listed("small", ids[0]).cold);  // the later Fetches demoted it again
  // GetStats counts sessions as admission does: those holding host memory, and the cold
  // ones apart.
  uint32_t cold = 0;
  for (const std::string& id : ids) cold += Listed("small", id).cold;
  EXPECT_GT(cold, 0u);
  EXPECT_EQ(st->tenant.cold_sessions, cold);
  EXPECT_EQ(st->tenant.sessions, kSessions - cold);
  EXPECT_LE(manager_->tenant("small").used_bytes(), 3 * kMiB / 2);
  // The metrics count both ways: each session was demoted at least once and promoted once.
  Exposition out;
  manager_->WriteMetrics(out);
  const std::string text = out.text();
  const double pages = static_cast<double>(2 * kTokens / SmallGeometry().page_size);
  const auto value = [&](const std::string& series) {
    const size_t at = text.find(series + " ");
    return at == std::string::npos ? -1.0 : std::stod(text.substr(at + series.size() + 1));
  };
  EXPECT_GE(value(R"(kvtier_cold_pages_total{tenant="small",direction="demoted"})"), 5 * pages);
  EXPECT_GE(value(R"(kvtier_cold_pages_total{tenant="small",direction="promoted"})"), 5 * pages);
  EXPECT_GE(value(R"(kvtier_cold_sessions_moved_total{tenant="small",direction="promoted"})"), 5);
  EXPECT_EQ(value(R"(kvtier_cold_data_loss_total{tenant="small"})"), 0);
  EXPECT_EQ(value(R"(kvtier_cold_quota_bytes{tenant="small"})"), 64.0 * kMiB);
  EXPECT_NE(text.find("kvtier_sessions_demoted_total{tenant=\"small\",transport=\"grpc\"}"),
            std::string::npos);
}

// policy.host_drop = demote: a live GRPC session whose host tier holds 16 of its pages per
// layer demotes the lowest-scoring ones to the cluster as it grows, and a step that selects
// one brings it back through the host tier. A session over a host tier that holds everything
// is the reference: every step's output is bit-identical; Fetch reads demoted pages from the
// cluster byte-exact; closing removes the keys and returns the quota.
TEST_F(ColdSessionTest, ALiveSessionDemotesPagesAndStepsBringThemBackBitIdentical) {
  manager_ = Make(ColdConfig());
  ASSERT_NE(manager_, nullptr);
  const Geometry g = SmallGeometry();
  for (RetrievalMode mode : {RetrievalMode::kSpeculative, RetrievalMode::kSync}) {
    SCOPED_TRACE(RetrievalModeName(mode));
    OpenSessionParams ref = GrpcParams("a");
    ref.mode = mode;
    ref.max_tokens = 1024;
    ref.residency_policy = "h2o";
    OpenSessionParams cold = ref;
    cold.host_drop = "demote";
    cold.host_tokens = 128;  // 16 pages per layer
    OpenSessionParams tiny = cold;
    tiny.host_tokens = 64;
    // The budget of 8 pages splits 1 + 5 + 2: sink, recent and the page being filled (4 pages)
    // and 2 × 2 KV heads × 5 selected pages over 2 layers (10): 14 pages of 8 tokens.
    ExpectError(manager_->OpenSession(Caller{"a"}, tiny).status(),
                absl::StatusCode::kInvalidArgument,
                {"retrieval.host_tokens = 64", "at least 112 tokens"});
    const SessionRecord a = Open(ref);
    const SessionRecord b = Open(cold);
    ASSERT_FALSE(b.id.empty());
    EXPECT_LT(b.region_bytes, a.region_bytes);  // the host tier is what was asked
    std::vector<Rows> rows;
    for (int32_t l = 0; l < g.num_layers; ++l) rows.emplace_back(g, 512, 40 + l);
    // 200 tokens at once (25 pages a layer: the appends demote), then a page at a time.
    int64_t tokens = 0;
    const auto grow = [&](int64_t n) {
      for (const std::string& id : {a.id, b.id}) {
        const OffloadResult r = OffloadAll("a", id, rows, tokens, n, n);
        ASSERT_EQ(r.layer_tokens, std::vector<uint64_t>(2, tokens + n)) << id;
      }
      tokens += n;
    };
    grow(200);
    for (int step = 0; tokens + g.page_size <= 512; ++step) {
      Rows q(g, 1, 1000 + step);
      std::string qbytes(static_cast<size_t>(g.num_q_heads) * g.head_dim * g.element_bytes(), 0);
      std::memcpy(qbytes.data(), q.k.data(), std::min(qbytes.size(), q.k.bytes()));
      for (int32_t l = 0; l < g.num_layers; ++l) {
        absl::StatusOr<StepResult> want = manager_->Step(Caller{"a"}, a.id, l, qbytes, true);
        absl::StatusOr<StepResult> got = manager_->Step(Caller{"a"}, b.id, l, qbytes, true);
        ASSERT_TRUE(want.ok()) << want.status();
        ASSERT_TRUE(got.ok()) << "step " << step << " layer " << l << ": " << got.status();
        ASSERT_EQ(got->output, want->output) << "step " << step << " layer " << l;
        ASSERT_EQ(got->slot_table, want->slot_table) << "step " << step << " layer " << l;
      }
      grow(g.page_size);
      if (HasFatalFailure()) return;
    }
    absl::StatusOr<StatsReport> st = manager_->GetStats(Caller{"a"}, b.id);
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_GT(st->session->sequence.host_demoted_pages, 0);
    EXPECT_GT(st->session->sequence.host_promoted_pages, 0) << "no step selected a demoted page";
    EXPECT_EQ(st->session->committed_pages, 2u * tokens / g.page_size);
    // Every page reads back byte-exact, the demoted ones from the cluster.
    for (int32_t l = 0; l < g.num_layers; ++l) {
      std::vector<PageData> pages = FetchAll(Caller{"a"}, b.id, l);
      ASSERT_EQ(pages.size(), static_cast<size_t>(tokens / g.page_size));
      for (const PageData& p : pages) {
        ASSERT_EQ(p.data, ExpectedPage(g, rows[l], p.page)) << "layer " << l << " page " << p.page;
      }
    }
    Exposition out;
    manager_->WriteMetrics(out);
    const std::string text = out.text();
    const auto value = [&](const std::string& series) {
      const size_t at = text.find(series + " ");
      return at == std::string::npos ? -1.0 : std::stod(text.substr(at + series.size() + 1));
    };
    EXPECT_GT(value(R"(kvtier_cold_live_pages_total{tenant="a",direction="demoted"})"), 0);
    EXPECT_GT(value(R"(kvtier_cold_live_pages_total{tenant="a",direction="promoted"})"), 0);
    EXPECT_GT(value(R"(kvtier_cold_used_bytes{tenant="a"})"), 0);
    // The demoted pages' keys ("<session>.live") are there, and go with the session.
    RedisClusterOptions o;
    o.seeds = cluster_->seeds();
    absl::StatusOr<std::unique_ptr<RedisCluster>> rc = RedisCluster::Connect(o);
    ASSERT_TRUE(rc.ok()) << rc.status();
    std::unique_ptr<ColdTier> tier = ColdTier::Create(rc->get(), prefix_).value();
    std::vector<int64_t> all(static_cast<size_t>(tokens / g.page_size));
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
    const std::vector<uint64_t> any(all.size(), 0);
    const auto stored = [&] {
      int n = 0;
      for (int32_t l = 0; l < g.num_layers; ++l) {
        for (const auto& got :
             tier->Get("a", b.id + ".live", l, all, any, absl::Now() + absl::Seconds(5))) {
          EXPECT_TRUE(got.ok() || absl::IsNotFound(got.status())) << got.status();
          n += got.ok();
        }
      }
      return n;
    };
    EXPECT_GT(stored(), 0);
    ASSERT_TRUE(manager_->CloseSession(Caller{"a"}, a.id).ok());
    ASSERT_TRUE(manager_->CloseSession(Caller{"a"}, b.id).ok());
    Exposition after;
    manager_->WriteMetrics(after);
    EXPECT_NE(after.text().find(R"(kvtier_cold_used_bytes{tenant="a"} 0)"), std::string::npos);
    EXPECT_EQ(stored(), 0);
  }
}

TEST_F(ColdSessionTest, SuspendedSessionsAreDemotedAfterTheirTimeWithoutPressure) {
  DaemonConfig config = ColdConfig();
  config.cold_tier.demote_suspended_after = absl::Milliseconds(50);
  manager_ = Make(config);
  ASSERT_NE(manager_, nullptr);
  std::vector<Rows> rows, rows_live;
  const std::string id = OpenFilled(GrpcParams("a"), 11, &rows);
  const std::string live = OpenFilled(GrpcParams("a"), 12, &rows_live);
  Suspend("a", id);
  // The demoter takes it within a few of its periods (the arena has plenty of room).
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (!Listed("a", id).cold && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_TRUE(Listed("a", id).cold);
  EXPECT_FALSE(Listed("a", live).cold);  // never a session that is not suspended
  // Reattached (no longer suspended, so the demoter leaves it), it is whole.
  ASSERT_TRUE(manager_->Reattach(Caller{"a"}, id).ok());
  ExpectPages("a", id, rows);
}

// Four threads over one small arena: each owns a session and loops suspend → open another
// (demoting someone) → close it → reattach → fetch, while the others do the same. Sessions
// move between the tiers under each other's feet; every call ends OK or with a retryable
// UNAVAILABLE / RESOURCE_EXHAUSTED, and every session reads back whole at the end.
TEST_F(ColdSessionTest, ConcurrentSuspendsReattachesAndOpensLoseNothing) {
  DaemonConfig config = ColdConfig();
  config.max_sessions_per_tenant = 16;
  manager_ = Make(config);
  ASSERT_NE(manager_, nullptr);
  constexpr int kThreads = 4;
  std::vector<std::string> ids(kThreads);
  std::vector<std::vector<Rows>> rows(kThreads);
  for (int i = 0; i < kThreads; ++i) {
    ids[i] = OpenFilled(Big(GrpcParams("small")), 300 + i, &rows[i]);
    ASSERT_FALSE(ids[i].empty());
    Suspend("small", ids[i]);
  }
  std::atomic<int> unexpected{0};
  const auto allowed = [](const absl::Status& st) {
    return st.ok() || absl::IsUnavailable(st) || absl::IsResourceExhausted(st);
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      const Caller caller{"small"};
      for (int round = 0; round < 3; ++round) {
        const absl::Status r = manager_->Reattach(caller, ids[i]).status();
        absl::Status f = r;
        if (r.ok()) {
          absl::StatusOr<std::unique_ptr<FetchCursor>> c = manager_->StartFetch(caller, ids[i], 1, {});
          f = c.status();
          while (f.ok() && !(*c)->done()) f = (*c)->Next(uint64_t{1} << 20).status();
        }
        const absl::Status s = manager_->SuspendSession(caller, ids[i]).status();
        OpenSessionParams p = Big(GrpcParams("small"));
        absl::StatusOr<SessionRecord> extra = manager_->OpenSession(caller, p);
        absl::Status c = extra.status();
        if (extra.ok()) c = manager_->CloseSession(caller, extra->id).status();
        for (const absl::Status* st : std::initializer_list<const absl::Status*>{&r, &f, &s, &c}) {
          if (!allowed(*st)) {
            ++unexpected;
            ADD_FAILURE() << "thread " << i << " round " << round << ": " << *st;
          }
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(unexpected.load(), 0);
  for (int i = 0; i < kThreads; ++i) {
    SCOPED_TRACE(i);
    ASSERT_TRUE(manager_->SuspendSession(Caller{"small"}, ids[i]).ok());  // may be cold already
    ExpectPages("small", ids[i], rows[i]);
  }
  EXPECT_LE(manager_->tenant("small").used_bytes(), 3 * kMiB / 2);
}

TEST_F(ColdSessionTest, AFullArenaWithNothingSuspendedStillRefuses) {
  manager_ = Make(ColdConfig());
  ASSERT_NE(manager_, nullptr);
  std::vector<Rows> rows;
  ASSERT_FALSE(OpenFilled(Big(GrpcParams("small")), 1, &rows).empty());
  ASSERT_FALSE(OpenFilled(Big(GrpcParams("small")), 2, &rows).empty());
  absl::StatusOr<SessionRecord> r =
      manager_->OpenSession(Caller{"small"}, Big(GrpcParams("small")));
  ExpectError(r.status(), absl::StatusCode::kResourceExhausted,
              {"tenant 'small'", "no suspended session"});
}

TEST_F(ColdSessionTest, TheColdQuotaLimitsDemotion) {
  manager_ = Make(ColdConfig(/*cold_quota=*/64 << 10));  // less than one session's pages
  ASSERT_NE(manager_, nullptr);
  std::vector<Rows> rows;
  const std::string id = OpenFilled(Big(GrpcParams("small")), 1, &rows);
  Suspend("small", id);
  std::vector<Rows> rows2;
  ASSERT_FALSE(OpenFilled(Big(GrpcParams("small")), 2, &rows2).empty());
  absl::StatusOr<SessionRecord> r =
      manager_->OpenSession(Caller{"small"}, Big(GrpcParams("small")));
  ExpectError(r.status(), absl::StatusCode::kResourceExhausted, {"cold_quota_bytes"});
  // Nothing moved: the suspended session is still whole in the host tier.
  EXPECT_FALSE(Listed("small", id).cold);
  ExpectPages("small", id, rows);
}

TEST_F(ColdSessionTest, ARestartedDaemonFindsItsSessionsAndReattachBringsThemBack) {
  DaemonConfig config = ColdConfig();
  manager_ = Make(config);
  ASSERT_NE(manager_, nullptr);
  std::vector<Rows> rows_a, rows_b;
  const std::string a = OpenFilled(GrpcParams("a"), 7, &rows_a);   // live at shutdown
  const std::string b = OpenFilled(GrpcParams("b"), 17, &rows_b);  // suspended
  Suspend("b", b);
  const uint64_t epoch_a = Listed("a", a).epoch;
  // Shutdown: everything is demoted, then the manager (and its arenas) goes.
  EXPECT_EQ(manager_->PersistAllSessions(absl::Now() + absl::Seconds(20)), 2u);
  EXPECT_EQ(manager_->CloseAllSessions(), 0u);
  manager_.reset();

  manager_ = Make(config);
  ASSERT_NE(manager_, nullptr);
  const SessionRecord la = Listed("a", a);
  EXPECT_TRUE(la.cold);
  EXPECT_FALSE(la.suspended);
  EXPECT_EQ(la.committed_tokens, std::vector<uint64_t>(2, kTokens));
  EXPECT_TRUE(Listed("b", b).suspended);
  EXPECT_TRUE(manager_->ListSessions(Caller{"small"}).empty());  // tenants stay apart

  absl::StatusOr<SessionRecord> r = manager_->Reattach(Caller{"a"}, a);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->cold);
  EXPECT_GT(r->epoch, epoch_a);  // the old holder stays fenced off
  EXPECT_EQ(r->committed_tokens, std::vector<uint64_t>(2, kTokens));
  ExpectPages("a", a, rows_a);
  // The GRPC session steps again over its restored pages.
  const Geometry g = SmallGeometry();
  Rows q(g, 1, 99);
  std::string qbytes(static_cast<size_t>(g.num_q_heads) * g.head_dim * g.element_bytes(), '\0');
  std::memcpy(qbytes.data(), q.k.data(), std::min(qbytes.size(), q.k.bytes()));
  absl::StatusOr<StepResult> step = manager_->Step(Caller{"a"}, a, 0, qbytes, true);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->num_tokens, kTokens);

  // The suspended one: Step is refused until Reattach; then it is whole.
  EXPECT_EQ(manager_->Step(Caller{"b"}, b, 0, qbytes, false).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(manager_->Reattach(Caller{"b"}, b).ok());
  ExpectPages("b", b, rows_b);
  // Closing a promoted session leaves nothing in the cold tier for a third daemon.
  ASSERT_TRUE(manager_->CloseSession(Caller{"a"}, a).ok());
  ASSERT_TRUE(manager_->CloseSession(Caller{"b"}, b).ok());
  manager_.reset();
  manager_ = Make(config);
  ASSERT_NE(manager_, nullptr);
  EXPECT_TRUE(manager_->ListSessions(Caller{"a"}).empty());
  EXPECT_TRUE(manager_->ListSessions(Caller{"b"}).empty());
}

// The cold tier's format is the one earlier daemons wrote and read
// (docs/service.md#the-cold-tier): after a shutdown, the session's record is a version 1
// ColdSessionRecord at "<prefix>:<tenant>:{<session>}:meta", listed in the tenant's index,
// and each layer's committed prefix is under "<prefix>:<tenant>:{<session>:<layer>}:<page>"
// with the generations the record names, read here with ColdTier alone; a new daemon
// promotes it byte-exact, and its promotion removes every one of those keys.
TEST_F(ColdSessionTest, AColdSessionIsStoredInThePreviousFormatAndPromotedFromIt) {
  DaemonConfig config = ColdConfig();
  manager_ = Make(config);
  ASSERT_NE(manager_, nullptr);
  std::vector<Rows> rows;
  const std::string id = OpenFilled(GrpcParams("a"), 23, &rows);
  EXPECT_EQ(manager_->PersistAllSessions(absl::Now() + absl::Seconds(20)), 1u);
  EXPECT_EQ(manager_->CloseAllSessions(), 0u);
  manager_.reset();

  const Geometry g = SmallGeometry();
  RedisClusterOptions o;
  o.seeds = cluster_->seeds();
  absl::StatusOr<std::unique_ptr<RedisCluster>> rc = RedisCluster::Connect(o);
  ASSERT_TRUE(rc.ok()) << rc.status();
  std::unique_ptr<ColdTier> tier = ColdTier::Create(rc->get(), prefix_).value();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  const std::string meta = absl::StrCat(prefix_, ":a:{", id, "}:meta");
  absl::StatusOr<RedisReply> value = (*rc)->Run({"GET", meta}, deadline);
  ASSERT_TRUE(value.ok()) << value.status();
  v1::ColdSessionRecord record;
  ASSERT_TRUE(record.ParseFromString(value->str));
  EXPECT_EQ(record.version(), 1u);
  EXPECT_EQ(record.session_id(), id);
  EXPECT_EQ(record.page_bytes(), g.host_page_bytes());
  absl::StatusOr<RedisReply> listed =
      (*rc)->Run({"SISMEMBER", absl::StrCat(prefix_, ":a:sessions"), id}, deadline);
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->integer, 1);
  ASSERT_EQ(record.layers_size(), g.num_layers);
  std::vector<int64_t> all(static_cast<size_t>(kTokens / g.page_size));
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
  for (int32_t l = 0; l < g.num_layers; ++l) {
    const v1::ColdLayer& cl = record.layers(l);
    ASSERT_EQ(static_cast<size_t>(cl.generations_size()), all.size()) << "layer " << l;
    const std::vector<uint64_t> gens(cl.generations().begin(), cl.generations().end());
    std::vector<absl::StatusOr<ColdPage>> got = tier->Get("a", id, l, all, gens, deadline);
    ASSERT_EQ(got.size(), all.size());
    for (size_t p = 0; p < got.size(); ++p) {
      ASSERT_TRUE(got[p].ok()) << "layer " << l << " page " << p << ": " << got[p].status();
      EXPECT_EQ(got[p]->data, ExpectedPage(g, rows[l], static_cast<int64_t>(p)))
          << "layer " << l << " page " << p;
    }
  }

  manager_ = Make(config);
  ASSERT_NE(manager_, nullptr);
  ASSERT_TRUE(manager_->Reattach(Caller{"a"}, id).ok());
  ExpectPages("a", id, rows);
  for (int32_t l = 0; l < g.num_layers; ++l) {
    for (const auto& got : tier->Get("a", id, l, all, {}, deadline)) {
      EXPECT_TRUE(absl::IsNotFound(got.status())) << got.status();
    }
  }
  absl::StatusOr<RedisReply> gone = (*rc)->Run({"EXISTS", meta}, deadline);
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_EQ(gone->integer, 0);
}

// Shutdown with one master paused (SIGSTOP): sessions are persisted independently, so every
// session with no key on that master comes back after the restart, whichever order the
// manager meets them in, and the log names every session that was not persisted, with its
// tenant.
TEST_F(ColdSessionTest, APausedMasterAtShutdownLosesOnlyTheSessionsWithKeysOnIt) {
  DaemonConfig config = ColdConfig();
  config.max_sessions_per_tenant = 12;
  config.cold_tier.command_timeout = absl::Milliseconds(300);
  manager_ = Make(config);
  ASSERT_NE(manager_, nullptr);
  const Geometry g = SmallGeometry();
  std::vector<std::string> ids;
  for (int i = 0; i < 12; ++i) {
    absl::StatusOr<SessionRecord> r = manager_->OpenSession(Caller{"a"}, GrpcParams("a"));
    ASSERT_TRUE(r.ok()) << r.status();
    std::unique_ptr<OffloadStream> s = manager_->NewOffloadStream(Caller{"a"});
    for (int32_t l = 0; l < g.num_layers; ++l) {
      Rows rows(g, 64, 500 + 10 * i + l);
      ASSERT_TRUE(s->Add(session_manager_testing::Chunk(r->id, l, rows, 0, 64, true, g)).ok());
    }
    ASSERT_TRUE(s->Commit().ok());
    ASSERT_TRUE(s->Finish().ok());
    ids.push_back(r->id);
  }
  // The masters a session's keys live on: its layers' pages, its record; and the tenant's
  // index, which every session's demotion writes.
  std::vector<int> masters;
  for (int node = 0; node < cluster_->size(); ++node) {
    absl::StatusOr<std::string> role = cluster_->Command(node, {"ROLE"});
    ASSERT_TRUE(role.ok()) << role.status();
    if (absl::StartsWith(*role, "master")) masters.push_back(node);
  }
  const auto master_of = [&](const std::string& key) {
    absl::StatusOr<int> m = cluster_->MasterOf(RedisCluster::SlotOf(key));
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? *m : -1;
  };
  const int index_master = master_of(absl::StrCat(prefix_, ":a:sessions"));
  const auto touches = [&](const std::string& id, int node) {
    if (master_of(absl::StrCat(prefix_, ":a:{", id, "}:meta")) == node) return true;
    for (int32_t l = 0; l < g.num_layers; ++l) {
      if (master_of(ColdKey(prefix_, "a", id, l, 0)) == node) return true;
    }
    return false;
  };
  // The paused master: not the index's, and holding keys of some sessions but not all.
  int paused = -1;
  std::vector<std::string> kept, lost;
  for (int node : masters) {
    if (node == index_master) continue;
    std::vector<std::string> k, x;
    for (const std::string& id : ids) (touches(id, node) ? x : k).push_back(id);
    if (k.size() > kept.size() && !x.empty()) {
      paused = node;
      kept = k;
      lost = x;
    }
  }
  ASSERT_NE(paused, -1) << "no master holds keys of only some of the sessions";
  ASSERT_FALSE(kept.empty());

  std::ostringstream log;
  std::shared_ptr<spdlog::logger> previous = spdlog::default_logger();
  auto capture = std::make_shared<spdlog::logger>(
      "capture", std::make_shared<spdlog::sinks::ostream_sink_mt>(log));
  capture->set_level(spdlog::level::warn);
  spdlog::set_default_logger(capture);
  ASSERT_TRUE(cluster_->Pause(paused).ok());
  const absl::Time began = absl::Now();
  const size_t persisted = manager_->PersistAllSessions(absl::Now() + absl::Seconds(3));
  const absl::Duration took = absl::Now() - began;
  ASSERT_TRUE(cluster_->Resume(paused).ok());
  spdlog::set_default_logger(previous);
  EXPECT_LT(took, absl::Seconds(5));
  EXPECT_EQ(manager_->CloseAllSessions(), ids.size() - persisted);
  manager_.reset();
  ASSERT_TRUE(cluster_->WaitForReplicas(absl::Seconds(10)).ok());

  // Every session with no key on the paused master came back, whole.
  EXPECT_GE(persisted, kept.size()) << log.str();
  manager_ = Make(config);
  ASSERT_NE(manager_, nullptr);
  std::vector<std::string> listed;
  for (const SessionRecord& r : manager_->ListSessions(Caller{"a"})) listed.push_back(r.id);
  for (const std::string& id : kept) {
    EXPECT_THAT(listed, ::testing::Contains(id)) << "session " << id << " was lost\n"
                                                 << log.str();
    absl::StatusOr<SessionRecord> r = manager_->Reattach(Caller{"a"}, id);
    ASSERT_TRUE(r.ok()) << id << ": " << r.status();
    EXPECT_EQ(r->committed_tokens, std::vector<uint64_t>(2, 64)) << id;
  }
  // Every session that was not persisted is named, with its tenant.
  const std::string text = log.str();
  int named = 0;
  for (const std::string& id : lost) {
    if (absl::StrContains(text, absl::StrCat("session ", id, " of tenant 'a'"))) ++named;
  }
  EXPECT_EQ(named, static_cast<int>(ids.size() - persisted)) << text;
  for (const std::string& id : ids) manager_->CloseSession(Caller{"a"}, id).IgnoreError();
}

TEST_F(ColdSessionTest, ACorruptedValueIsDataLossNeverWrongBytes) {
  manager_ = Make(ColdConfig());
  ASSERT_NE(manager_, nullptr);
  std::vector<Rows> rows;
  const std::string id = OpenFilled(GrpcParams("a"), 3, &rows);
  Suspend("a", id);
  ASSERT_EQ(manager_->PersistAllSessions(absl::Now() + absl::Seconds(20)), 1u);
  ASSERT_TRUE(Listed("a", id).cold);
  // One byte of layer 1 page 5's payload, on the master (the write replicates, so no intact
  // copy is left anywhere).
  const std::string key = ColdKey(prefix_, "a", id, 1, 5);
  absl::StatusOr<int> master = cluster_->MasterOf(RedisCluster::SlotOf(key));
  ASSERT_TRUE(master.ok()) << master.status();
  ASSERT_TRUE(cluster_->Command(*master, {"SETRANGE", key, "100", "\x5a"}).ok());
  ASSERT_TRUE(cluster_->WaitForReplicas(absl::Seconds(10)).ok());

  absl::StatusOr<SessionRecord> r = manager_->Reattach(Caller{"a"}, id);
  ExpectError(r.status(), absl::StatusCode::kDataLoss, {"layer 1 page 5"});
  EXPECT_EQ(manager_->StartFetch(Caller{"a"}, id, 0, {}).status().code(),
            absl::StatusCode::kDataLoss);
  // The session stays cold, its record intact, for an operator to look at or close.
  EXPECT_TRUE(Listed("a", id).cold);
  EXPECT_TRUE(manager_->CloseSession(Caller{"a"}, id).ok());
}

// A live session's demoted page with no intact copy: the step that selects it is DATA_LOSS,
// never attention over wrong bytes, and so is a Fetch of it; the session can still be
// closed, and its keys go.
TEST_F(ColdSessionTest, ACorruptedDemotedPageIsDataLossForTheStepThatNeedsIt) {
  manager_ = Make(ColdConfig());
  ASSERT_NE(manager_, nullptr);
  const Geometry g = SmallGeometry();
  OpenSessionParams p = GrpcParams("a");
  p.mode = RetrievalMode::kSync;
  p.max_tokens = 1024;
  p.host_drop = "demote";
  p.host_tokens = 128;
  const SessionRecord s = Open(p);
  ASSERT_FALSE(s.id.empty());
  std::vector<Rows> rows;
  for (int32_t l = 0; l < g.num_layers; ++l) rows.emplace_back(g, 400, 70 + l);
  OffloadAll("a", s.id, rows, 0, 400, 200);  // 50 pages a layer through 16 host pages each
  // Every page that has a key (the demoted ones) loses a byte of its payload, everywhere.
  int corrupted = 0;
  for (int32_t l = 0; l < g.num_layers; ++l) {
    for (int64_t page = 0; page < 50; ++page) {
      const std::string key = ColdKey(prefix_, "a", s.id + ".live", l, page);
      absl::StatusOr<int> master = cluster_->MasterOf(RedisCluster::SlotOf(key));
      ASSERT_TRUE(master.ok()) << master.status();
      absl::StatusOr<std::string> exists = cluster_->Command(*master, {"EXISTS", key});
      ASSERT_TRUE(exists.ok()) << exists.status();
      if (*exists != "1") continue;
      ASSERT_TRUE(cluster_->Command(*master, {"SETRANGE", key, "100", "\x5a"}).ok());
      ++corrupted;
    }
  }
  ASSERT_GT(corrupted, 40);
  ASSERT_TRUE(cluster_->WaitForReplicas(absl::Seconds(10)).ok());
  {
    absl::StatusOr<std::unique_ptr<FetchCursor>> cursor =
        manager_->StartFetch(Caller{"a"}, s.id, 0, {});
    ASSERT_TRUE(cursor.ok()) << cursor.status();
    absl::Status fetched;
    while (fetched.ok() && !(*cursor)->done()) fetched = (*cursor)->Next(uint64_t{1} << 20).status();
    ExpectError(fetched, absl::StatusCode::kDataLoss, {"checksum"});
  }
  // Steps until one selects a demoted page (sync mode selects with every step's query).
  absl::Status failed;
  for (int step = 0; step < 20 && failed.ok(); ++step) {
    Rows q(g, 1, 2000 + step);
    std::string qbytes(static_cast<size_t>(g.num_q_heads) * g.head_dim * g.element_bytes(), 0);
    std::memcpy(qbytes.data(), q.k.data(), std::min(qbytes.size(), q.k.bytes()));
    for (int32_t l = 0; l < g.num_layers && failed.ok(); ++l) {
      failed = manager_->Step(Caller{"a"}, s.id, l, qbytes, true).status();
    }
  }
  ExpectError(failed, absl::StatusCode::kDataLoss, {"from the cold tier", "checksum"});
  ASSERT_TRUE(manager_->CloseSession(Caller{"a"}, s.id).ok());
  Exposition out;
  manager_->WriteMetrics(out);
  EXPECT_NE(out.text().find(R"(kvtier_cold_used_bytes{tenant="a"} 0)"), std::string::npos);
  EXPECT_EQ(out.text().find(R"(kvtier_cold_data_loss_total{tenant="a"} 0)"), std::string::npos);
}

// A GRPC session that demotes pages survives a restart through the cold tier: shutdown
// writes every page (from its region or read back from its demoted keys) under its record,
// and Reattach rebuilds its Retriever by appending them again over a host tier of the same
// size, which demotes as it fills. It then steps exactly like a session that never demoted.
TEST_F(ColdSessionTest, ASessionThatDemotesPagesSurvivesARestart) {
  DaemonConfig config = ColdConfig();
  manager_ = Make(config);
  ASSERT_NE(manager_, nullptr);
  const Geometry g = SmallGeometry();
  OpenSessionParams ref = GrpcParams("a");
  ref.max_tokens = 1024;
  ref.residency_policy = "h2o";
  OpenSessionParams cold = ref;
  cold.host_drop = "demote";
  cold.host_tokens = 128;
  const std::string a = Open(ref).id;
  const std::string b = Open(cold).id;
  ASSERT_FALSE(b.empty());
  std::vector<Rows> rows;
  for (int32_t l = 0; l < g.num_layers; ++l) rows.emplace_back(g, 320, 90 + l);
  for (const std::string& id : {a, b}) OffloadAll("a", id, rows, 0, 320, 160);
  const auto q_of = [&](int step) {
    Rows q(g, 1, 3000 + step);
    std::string qbytes(static_cast<size_t>(g.num_q_heads) * g.head_dim * g.element_bytes(), 0);
    std::memcpy(qbytes.data(), q.k.data(), std::min(qbytes.size(), q.k.bytes()));
    return qbytes;
  };
  const auto step_both = [&](int first, int last) {
    for (int step = first; step < last; ++step) {
      for (int32_t l = 0; l < g.num_layers; ++l) {
        absl::StatusOr<StepResult> want = manager_->Step(Caller{"a"}, a, l, q_of(step), true);
        absl::StatusOr<StepResult> got = manager_->Step(Caller{"a"}, b, l, q_of(step), true);
        ASSERT_TRUE(want.ok()) << want.status();
        ASSERT_TRUE(got.ok()) << "step " << step << " layer " << l << ": " << got.status();
        ASSERT_EQ(got->output, want->output) << "step " << step << " layer " << l;
      }
    }
  };
  step_both(0, 5);
  ASSERT_FALSE(HasFatalFailure());
  absl::StatusOr<StatsReport> before = manager_->GetStats(Caller{"a"}, b);
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_GT(before->session->sequence.host_demoted_pages, 0);

  EXPECT_EQ(manager_->PersistAllSessions(absl::Now() + absl::Seconds(20)), 2u);
  EXPECT_EQ(manager_->CloseAllSessions(), 0u);
  manager_.reset();
  manager_ = Make(config);
  ASSERT_NE(manager_, nullptr);
  EXPECT_TRUE(Listed("a", b).cold);
  EXPECT_EQ(Listed("a", b).committed_tokens, std::vector<uint64_t>(2, 320));
  for (const std::string& id : {a, b}) {
    absl::StatusOr<SessionRecord> r = manager_->Reattach(Caller{"a"}, id);
    ASSERT_TRUE(r.ok()) << id << ": " << r.status();
    EXPECT_EQ(r->committed_tokens, std::vector<uint64_t>(2, 320)) << id;
  }
  // Every page is whole, and the rebuilt session demoted again as it filled.
  for (int32_t l = 0; l < g.num_layers; ++l) {
    std::vector<PageData> pages = FetchAll(Caller{"a"}, b, l);
    ASSERT_EQ(pages.size(), 40u);
    for (const PageData& p : pages) {
      ASSERT_EQ(p.data, ExpectedPage(g, rows[l], p.page)) << "layer " << l << " page " << p.page;
    }
  }
  absl::StatusOr<StatsReport> after = manager_->GetStats(Caller{"a"}, b);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_GT(after->session->sequence.host_demoted_pages, 0);
  step_both(5, 12);
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(manager_->CloseSession(Caller{"a"}, a).ok());
  ASSERT_TRUE(manager_->CloseSession(Caller{"a"}, b).ok());
  Exposition out;
  manager_->WriteMetrics(out);
  EXPECT_NE(out.text().find(R"(kvtier_cold_used_bytes{tenant="a"} 0)"), std::string::npos);
}

// A session that demotes pages moves whole by copying its pages between its live keys and its
// record's; both copies exist until the move ends. A quota that holds the session once (its
// record and a margin of 8 pages, well short of the ~48 pages it demoted itself) is enough both
// ways, and the charges stay exact.
TEST_F(ColdSessionTest, ASessionThatDemotesPagesMovesWholeWithinAQuotaThatHoldsItOnce) {
  const Geometry g = SmallGeometry();
  const uint64_t value_bytes = g.host_page_bytes() + kColdHeaderBytes;
  constexpr int64_t kSessionTokens = 320;  // 40 pages per layer
  const uint64_t record_pages = static_cast<uint64_t>(kSessionTokens / g.page_size) * g.num_layers;
  const uint64_t quota = ColdStore::ValueBytes(record_pages, g.host_page_bytes()) + 8 * value_bytes;
  DaemonConfig config = ColdConfig(quota);
  manager_ = Make(config);
  ASSERT_NE(manager_, nullptr);
  OpenSessionParams p = GrpcParams("a");
  p.max_tokens = 1024;
  p.host_drop = "demote";
  p.host_tokens = 128;
  const std::string id = Open(p).id;
  ASSERT_FALSE(id.empty());
  std::vector<Rows> rows;
  for (int32_t l = 0; l < g.num_layers; ++l) rows.emplace_back(g, kSessionTokens, 70 + l);
  OffloadAll("a", id, rows, 0, kSessionTokens, 160);
  const int live_before = LiveKeys("a", id);
  ASSERT_GT(live_before, 8 + 1);  // the two copies do not fit together
  EXPECT_EQ(ColdUsed("a"), static_cast<double>(live_before * value_bytes));

  // Demoted whole (shutdown): the record's copy is written while the live one still stands.
  EXPECT_EQ(manager_->PersistAllSessions(absl::Now() + absl::Seconds(20)), 1u);
  EXPECT_EQ(manager_->CloseAllSessions(), 0u);
  manager_.reset();
  EXPECT_EQ(LiveKeys("a", id), 0);
  manager_ = Make(config);
  ASSERT_NE(manager_, nullptr);
  ASSERT_TRUE(Listed("a", id).cold);
  EXPECT_EQ(ColdUsed("a"), static_cast<double>(ColdStore::ValueBytes(record_pages,
                                                                      g.host_page_bytes())));

  // Promoted: the rebuilt session demotes anew under its live keys before the record goes.
  absl::StatusOr<SessionRecord> r = manager_->Reattach(Caller{"a"}, id);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->committed_tokens, std::vector<uint64_t>(2, kSessionTokens));
  const int live_after = LiveKeys("a", id);
  EXPECT_GT(live_after, 8 + 1);
  EXPECT_EQ(ColdUsed("a"), static_cast<double>(live_after * value_bytes));
  for (int32_t l = 0; l < g.num_layers; ++l) {
    std::vector<PageData> pages = FetchAll(Caller{"a"}, id, l);
    ASSERT_EQ(pages.size(), 40u);
    for (const PageData& page : pages) {
      ASSERT_EQ(page.data, ExpectedPage(g, rows[l], page.page)) << "layer " << l << " page "
                                                                 << page.page;
    }
  }
  ASSERT_TRUE(manager_->CloseSession(Caller{"a"}, id).ok());
  EXPECT_EQ(ColdUsed("a"), 0.0);
  EXPECT_EQ(LiveKeys("a", id), 0);
}

// The same for an SHM session that demotes pages: its engine demoted 12 of layer 0's 28 pages
// (DemotePages) and holds the other 16 in its region. Demoted whole at shutdown (record: 28
// pages, while the 12 live keys stand) and promoted by its Reattach (every page under its live
// keys again, while the record stands), each within a quota of the record and 4 pages.
TEST_F(ColdSessionTest, AnShmSessionThatDemotesPagesMovesWholeWithinAQuotaThatHoldsItOnce) {
  const Geometry g = SmallGeometry();
  const uint64_t value_bytes = g.host_page_bytes() + kColdHeaderBytes;
  constexpr int64_t kPages = 28, kDemoted = 12, kSlots = 16;
  DaemonConfig config =
      ColdConfig(ColdStore::ValueBytes(kPages, g.host_page_bytes()) + 4 * value_bytes);
  manager_ = Make(config);
  ASSERT_NE(manager_, nullptr);
  std::optional<SessionRegion> region;
  const SessionRecord s = OpenShmDemoting(&region);
  ASSERT_TRUE(region.has_value());
  const auto bytes = [&](int64_t page) {
    return std::string(g.host_page_bytes(), static_cast<char>('A' + page));
  };
  std::vector<TenantSession::PageMove> demote;
  for (int64_t page = 0; page < kSlots; ++page) {
    EngineCommit(*region, 0, page, page, 1, bytes(page));
    ASSERT_FALSE(HasFatalFailure());
    if (page < kDemoted) demote.push_back({0, page, page, 1});
  }
  ASSERT_TRUE(manager_->MovePages(Caller{"a"}, s.id, true, s.epoch, demote).ok());
  for (int64_t page = 0; page < kDemoted; ++page) ASSERT_TRUE(region->Withdraw(0, page).ok());
  for (int64_t page = kSlots; page < kPages; ++page) {  // into the demoted pages' slots
    EngineCommit(*region, 0, page, page - kSlots, 1, bytes(page));
    ASSERT_FALSE(HasFatalFailure());
  }
  EXPECT_EQ(LiveKeys("a", s.id), kDemoted);

  EXPECT_EQ(manager_->PersistAllSessions(absl::Now() + absl::Seconds(20)), 1u);
  EXPECT_EQ(manager_->CloseAllSessions(), 0u);
  manager_.reset();
  EXPECT_EQ(LiveKeys("a", s.id), 0);
  EXPECT_EQ(RecordPageKeys("a", s.id), kPages);
  manager_ = Make(config);
  ASSERT_NE(manager_, nullptr);
  ASSERT_TRUE(Listed("a", s.id).cold);

  absl::StatusOr<SessionRecord> r = manager_->Reattach(Caller{"a"}, s.id);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(LiveKeys("a", s.id), kPages);
  EXPECT_EQ(RecordPageKeys("a", s.id), 0);
  EXPECT_EQ(ColdUsed("a"), static_cast<double>(kPages * value_bytes));
  std::optional<SessionRegion> back = EngineRegion("a", *r);
  ASSERT_TRUE(back.has_value());
  for (int64_t page : {int64_t{0}, kDemoted - 1, kDemoted, kPages - 1}) {
    ASSERT_TRUE(manager_->MovePages(Caller{"a"}, s.id, false, r->epoch, {{0, page, 0, 1}}).ok())
        << "page " << page;
    EXPECT_TRUE(SlotBytes(*back, 0) == bytes(page)) << "page " << page;
  }
  ASSERT_TRUE(manager_->CloseSession(Caller{"a"}, s.id).ok());
  EXPECT_EQ(ColdUsed("a"), 0.0);
  EXPECT_EQ(LiveKeys("a", s.id), 0);
}

// An engine that reuses a demoted page's slot without withdrawing the page leaves two entries
// naming one slot; a whole-session demotion would store the slot's new bytes under the old page.
// It is refused instead (DATA_LOSS, naming both), and nothing of it stays in the cold tier.
TEST_F(ColdSessionTest, ASlotTwoPagesNameIsNeverDemoted) {
  manager_ = Make(ColdConfig());
  ASSERT_NE(manager_, nullptr);
  const Geometry g = SmallGeometry();
  const double value_bytes = static_cast<double>(g.host_page_bytes() + kColdHeaderBytes);
  std::optional<SessionRegion> region;
  const SessionRecord s = OpenShmDemoting(&region);
  ASSERT_TRUE(region.has_value());
  for (int64_t page = 0; page < 4; ++page) {
    EngineCommit(*region, 0, page, page, 1, std::string(g.host_page_bytes(), 'a' + page));
    ASSERT_FALSE(HasFatalFailure());
  }
  ASSERT_TRUE(manager_->MovePages(Caller{"a"}, s.id, true, s.epoch, {{0, 0, 0, 1}}).ok());
  // Page 4 into page 0's slot, page 0 not withdrawn.
  EngineCommit(*region, 0, 4, 0, 1, std::string(g.host_page_bytes(), 'e'));
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_EQ(manager_->PersistAllSessions(absl::Now() + absl::Seconds(20)), 0u);
  EXPECT_FALSE(Listed("a", s.id).cold);
  EXPECT_EQ(RecordKeys("a", s.id), 0);
  EXPECT_EQ(RecordPageKeys("a", s.id), 0);
  EXPECT_EQ(ColdUsed("a"), value_bytes);  // page 0's live key alone
  // Withdrawn, it demotes.
  ASSERT_TRUE(region->Withdraw(0, 0).ok());
  EXPECT_EQ(manager_->PersistAllSessions(absl::Now() + absl::Seconds(20)), 1u);
  EXPECT_TRUE(Listed("a", s.id).cold);
  ASSERT_TRUE(manager_->CloseSession(Caller{"a"}, s.id).ok());
  EXPECT_EQ(ColdUsed("a"), 0.0);
}

// A demotion whose record was written but neither acknowledged nor removable (the WAIT after it
// and the removal of its index entry and record refused: a node that took the writes and then
// stopped answering) leaves a record a restart may take the session up from. Its pages stay
// under it, so that restart loses nothing; the close removes record and pages, and the next
// demotion replaces them. Charges stay exact throughout.
TEST_F(ColdSessionTest, ARecordADemotionCouldNotTakeBackKeepsItsPages) {
  DaemonConfig config = ColdConfig();
  const Geometry g = SmallGeometry();
  constexpr int64_t kSessionTokens = 320;  // 40 pages per layer
  const uint64_t record_pages = static_cast<uint64_t>(kSessionTokens / g.page_size) * g.num_layers;
  const double record_bytes =
      static_cast<double>(ColdStore::ValueBytes(record_pages, g.host_page_bytes()));
  // From the first record written on: its WAIT, and any removal of an index entry or record,
  // are refused.
  std::atomic<bool> record_written{false};
  const auto fault = [&](const std::vector<std::string>& argv) -> std::optional<absl::Status> {
    const std::string& cmd = argv[0];
    if (cmd == "SET" && argv.size() > 1 && absl::EndsWith(argv[1], "}:meta")) {
      record_written = true;
      return std::nullopt;
    }
    if (record_written && (cmd == "WAIT" || cmd == "SREM" ||
                           (cmd == "DEL" && argv.size() > 1 && absl::EndsWith(argv[1], "}:meta")))) {
      return absl::UnavailableError("injected: no answer");
    }
    return std::nullopt;
  };
  const auto open_filled = [&](uint64_t seed, std::vector<Rows>* rows) {
    OpenSessionParams p = GrpcParams("a");
    p.max_tokens = 1024;
    const std::string id = Open(p).id;
    rows->clear();
    for (int32_t l = 0; l < g.num_layers; ++l) rows->emplace_back(g, kSessionTokens, seed + l);
    OffloadAll("a", id, *rows, 0, kSessionTokens, 160);
    return id;
  };
  const auto fail_demotion = [&](const std::string& id) {
    record_written = false;
    manager_->ColdClusterForTesting("a")->SetFaultForTesting(fault);
    EXPECT_EQ(manager_->PersistAllSessions(absl::Now() + absl::Seconds(20)), 0u);
    manager_->ColdClusterForTesting("a")->SetFaultForTesting(nullptr);
    EXPECT_FALSE(Listed("a", id).cold);
    EXPECT_EQ(RecordKeys("a", id), 1);
    EXPECT_EQ(RecordPageKeys("a", id), static_cast<int>(record_pages));
    EXPECT_EQ(ColdUsed("a"), record_bytes);
  };
  const auto expect_pages = [&](const std::string& id, const std::vector<Rows>& rows) {
    for (int32_t l = 0; l < g.num_layers; ++l) {
      std::vector<PageData> pages = FetchAll(Caller{"a"}, id, l);
      ASSERT_EQ(pages.size(), static_cast<size_t>(kSessionTokens / g.page_size));
      for (const PageData& p : pages) {
        ASSERT_EQ(p.data, ExpectedPage(g, rows[l], p.page)) << "layer " << l << " page " << p.page;
      }
    }
  };
  manager_ = Make(config);
  ASSERT_NE(manager_, nullptr);
  ASSERT_NE(manager_->ColdClusterForTesting("a"), nullptr);

  // Closed: the record and its pages go.
  std::vector<Rows> rows;
  const std::string a = open_filled(10, &rows);
  fail_demotion(a);
  ASSERT_TRUE(manager_->CloseSession(Caller{"a"}, a).ok());
  EXPECT_EQ(RecordKeys("a", a), 0);
  EXPECT_EQ(RecordPageKeys("a", a), 0);
  EXPECT_EQ(ColdUsed("a"), 0.0);

  // Demoted again: the new record replaces it, charged once.
  const std::string b = open_filled(20, &rows);
  fail_demotion(b);
  EXPECT_EQ(manager_->PersistAllSessions(absl::Now() + absl::Seconds(20)), 1u);
  EXPECT_TRUE(Listed("a", b).cold);
  EXPECT_EQ(ColdUsed("a"), record_bytes);
  ASSERT_TRUE(manager_->Reattach(Caller{"a"}, b).ok());
  expect_pages(b, rows);
  ASSERT_TRUE(manager_->CloseSession(Caller{"a"}, b).ok());
  EXPECT_EQ(ColdUsed("a"), 0.0);

  // The daemon stops without demoting it: the next one takes the session up from that
  // record, every page intact.
  const std::string c = open_filled(30, &rows);
  fail_demotion(c);
  manager_.reset();
  EXPECT_EQ(RecordPageKeys("a", c), static_cast<int>(record_pages)) << "after reset";
  manager_ = Make(config);
  EXPECT_EQ(RecordPageKeys("a", c), static_cast<int>(record_pages)) << "after make";
  ASSERT_NE(manager_, nullptr);
  ASSERT_TRUE(Listed("a", c).cold);
  EXPECT_EQ(ColdUsed("a"), record_bytes);
  absl::StatusOr<SessionRecord> r = manager_->Reattach(Caller{"a"}, c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->committed_tokens, std::vector<uint64_t>(2, kSessionTokens));
  expect_pages(c, rows);
  ASSERT_TRUE(manager_->CloseSession(Caller{"a"}, c).ok());
  EXPECT_EQ(ColdUsed("a"), 0.0);
  EXPECT_EQ(RecordPageKeys("a", c), 0);
}

TEST_F(ColdSessionTest, ATenantsAclUserReachesOnlyItsOwnKeys) {
  // ACLs are per node in Redis Cluster: the user is set on every node.
  const std::string user = absl::StrCat(prefix_, "-a");
  for (int n = 0; n < cluster_->size(); ++n) {
    ASSERT_TRUE(cluster_
                    ->Command(n, {"ACL", "SETUSER", user, "on", ">pw-a", "resetkeys",
                                  absl::StrCat("~", prefix_, ":a:*"), "-@all", "+get", "+set",
                                  "+del", "+wait", "+sadd", "+srem", "+smembers", "+cluster",
                                  "+readonly", "+asking", "+ping"})
                    .ok());
  }
  DaemonConfig config = ColdConfig();
  for (TenantConfig& t : config.tenants) {
    if (t.name == "a") {
      t.redis_user = user;
      t.redis_password = "pw-a";
    }
  }
  manager_ = Make(config);
  ASSERT_NE(manager_, nullptr);
  std::vector<Rows> rows;
  const std::string id = OpenFilled(GrpcParams("a"), 5, &rows);
  Suspend("a", id);
  ASSERT_EQ(manager_->PersistAllSessions(absl::Now() + absl::Seconds(20)), 1u);
  ASSERT_TRUE(manager_->Reattach(Caller{"a"}, id).ok());
  ExpectPages("a", id, rows);
  // The same user cannot touch tenant b's keys.
  RedisClusterOptions o;
  o.seeds = cluster_->seeds();
  o.user = user;
  o.password = "pw-a";
  absl::StatusOr<std::unique_ptr<RedisCluster>> as_a = RedisCluster::Connect(o);
  ASSERT_TRUE(as_a.ok()) << as_a.status();
  absl::StatusOr<RedisReply> other = (*as_a)->Run(
      {"GET", ColdKey(prefix_, "b", "x", 0, 0)}, absl::Now() + absl::Seconds(5));
  ASSERT_FALSE(other.ok());
  EXPECT_THAT(std::string(other.status().message()), HasSubstr("NOPERM"));
}

// PromotePages whose deadline passes while the cold tier stalls (the page's master paused
// past it) answers DEADLINE_EXCEEDED and never writes the slot it named, then or later: the
// engine owns that slot again once the call has ended.
// The issue's case: one master SIGSTOPped under tenant a's sessions, four Offload commits of a
// (deadline 1 s) that must demote pages to it, on a work queue of 2 workers. a's calls end
// DEADLINE_EXCEEDED at about their deadline, not at cold_tier.operation_timeout_ms, and tenant
// b's Step, whose session never touches the cold tier, does not wait for them. The bounds are
// seconds against the 10 s the stall would cost.
TEST_F(ColdSessionTest, AStalledNodeHoldsNoOtherTenantsStepAndEndsAtTheCallsDeadline) {
  DaemonConfig config = ColdConfig();
  config.cold_tier.operation_timeout = absl::Seconds(10);
  manager_ = Make(config);
  ASSERT_NE(manager_, nullptr);
  const Geometry g = SmallGeometry();
  OpenSessionParams pb = GrpcParams("b");
  pb.mode = RetrievalMode::kSync;
  pb.max_tokens = 1024;
  const SessionRecord b = Open(pb);
  ASSERT_FALSE(b.id.empty());
  std::vector<Rows> brows;
  for (int32_t l = 0; l < g.num_layers; ++l) brows.emplace_back(g, 64, 7 + l);
  OffloadAll("b", b.id, brows, 0, 64, 64);
  // Four sessions of a that demote (16 host pages per layer), each with a layer whose pages go
  // to the master the first one's layer 0 goes to.
  int master = -1;
  std::vector<SessionRecord> as;
  for (int tries = 0; as.size() < 4 && tries < 40; ++tries) {
    OpenSessionParams pa = pb;
    pa.tenant = "a";
    pa.host_drop = "demote";
    pa.host_tokens = 128;
    const SessionRecord s = Open(pa);
    ASSERT_FALSE(s.id.empty());
    bool on = false;
    for (int32_t l = 0; l < g.num_layers; ++l) {
      absl::StatusOr<int> m =
          cluster_->MasterOf(RedisCluster::SlotOf(ColdKey(prefix_, "a", s.id + ".live", l, 0)));
      ASSERT_TRUE(m.ok()) << m.status();
      if (master < 0) master = *m;
      on = on || *m == master;
    }
    if (on) {
      as.push_back(s);
    } else {
      ASSERT_TRUE(manager_->CloseSession(Caller{"a"}, s.id).ok());
    }
  }
  ASSERT_EQ(as.size(), 4u);
  // 15 pages a layer fill their host tiers: the next commit demotes.
  std::vector<Rows> arows;
  for (int32_t l = 0; l < g.num_layers; ++l) arows.emplace_back(g, 512, 70 + l);
  for (const SessionRecord& s : as) OffloadAll("a", s.id, arows, 0, 120, 120);
  ASSERT_FALSE(HasFailure());

  absl::StatusOr<std::unique_ptr<WorkQueue>> queue = WorkQueue::Create({.threads = 2});
  ASSERT_TRUE(queue.ok()) << queue.status();
  ASSERT_TRUE(cluster_->Pause(master).ok());
  struct Resume {
    testing::RedisClusterProcess* cluster;
    int node;
    bool done = false;
    void operator()() {
      if (done) return;
      done = true;
      EXPECT_TRUE(cluster->Resume(node).ok());
    }
    ~Resume() { (*this)(); }
  } resume{cluster_, master};

  struct Done {
    absl::Status status;
    absl::Duration took;
  };
  const absl::Time start = absl::Now();
  Caller ca{"a"};
  ca.deadline = start + absl::Seconds(1);
  std::vector<std::future<Done>> a_done;
  for (const SessionRecord& s : as) {
    std::promise<Done> done;
    a_done.push_back(done.get_future());
    ASSERT_TRUE((*queue)
                    ->Submit("a",
                             [this, &arows, g, ca, start, id = s.id,
                              done = std::move(done)](absl::Status st) mutable {
                               if (st.ok()) {
                                 std::unique_ptr<OffloadStream> stream =
                                     manager_->NewOffloadStream(ca);
                                 for (int32_t l = 0; l < g.num_layers && st.ok(); ++l) {
                                   st = stream->Add(
                                       Chunk(id, l, arows[l], 120, 200, l + 1 == g.num_layers, g));
                                 }
                                 if (st.ok()) st = stream->Commit();
                               }
                               done.set_value({st, absl::Now() - start});
                             })
                    .ok());
  }
  absl::SleepFor(absl::Milliseconds(200));  // a's first commits are in the cold tier
  std::string q(static_cast<size_t>(g.num_q_heads) * g.head_dim * g.element_bytes(), '\0');
  std::promise<Done> b_promise;
  std::future<Done> b_done = b_promise.get_future();
  const absl::Time b_start = absl::Now();
  Caller cb{"b"};
  cb.deadline = b_start + absl::Seconds(30);
  ASSERT_TRUE((*queue)
                  ->Submit("b",
                           [this, cb, b_start, q, id = b.id,
                            done = std::move(b_promise)](absl::Status st) mutable {
                             if (st.ok()) st = manager_->Step(cb, id, 0, q, true).status();
                             done.set_value({st, absl::Now() - b_start});
                           })
                  .ok());
  ASSERT_EQ(b_done.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  const Done bd = b_done.get();
  EXPECT_TRUE(bd.status.ok()) << bd.status;
  EXPECT_LT(bd.took, absl::Seconds(1)) << "tenant b's Step waited for tenant a's stalled node";
  for (std::future<Done>& f : a_done) {
    ASSERT_EQ(f.wait_for(std::chrono::seconds(120)), std::future_status::ready);
    const Done ad = f.get();
    EXPECT_EQ(ad.status.code(), absl::StatusCode::kDeadlineExceeded) << ad.status;
    EXPECT_LT(ad.took, absl::Seconds(4)) << "a's call outlived its 1 s deadline: " << ad.status;
  }
  (*queue)->Shutdown();
  // The node answers again: a's sessions take the rest of the commits, from the tokens each
  // layer holds (a layer's appends before the cut-off demotion stay, as committed_tokens says).
  resume();
  for (const SessionRecord& s : as) {
    const std::vector<uint64_t> held = Listed("a", s.id).committed_tokens;
    ASSERT_EQ(held.size(), 2u);
    std::unique_ptr<OffloadStream> stream = manager_->NewOffloadStream(Caller{"a"});
    for (int32_t l = 0; l < g.num_layers; ++l) {
      const int64_t from = static_cast<int64_t>(held[l]);
      ASSERT_LE(from, 320);
      if (from < 320) {
        EXPECT_TRUE(stream->Add(Chunk(s.id, l, arows[l], from, 320 - from, false, g)).ok());
      }
    }
    absl::StatusOr<OffloadResult> r = stream->Finish();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->layer_tokens, std::vector<uint64_t>(2, 320)) << s.id;
  }
  EXPECT_TRUE(manager_->Step(Caller{"a"}, as[0].id, 0, q, true).ok());
  for (const SessionRecord& s : as) EXPECT_TRUE(manager_->CloseSession(Caller{"a"}, s.id).ok());
  EXPECT_TRUE(manager_->CloseSession(Caller{"b"}, b.id).ok());
}

// Fetch reads a live session's demoted pages by the Fetch's deadline, not by
// cold_tier.operation_timeout_ms, when their master is stalled.
TEST_F(ColdSessionTest, FetchOfDemotedPagesEndsAtItsDeadlineWhenTheirMasterStalls) {
  DaemonConfig config = ColdConfig();
  config.cold_tier.operation_timeout = absl::Seconds(10);
  manager_ = Make(config);
  ASSERT_NE(manager_, nullptr);
  const Geometry g = SmallGeometry();
  OpenSessionParams p = GrpcParams("a");
  p.mode = RetrievalMode::kSync;
  p.max_tokens = 1024;
  p.host_drop = "demote";
  p.host_tokens = 128;  // 16 pages per layer of the 25 below
  const SessionRecord s = Open(p);
  ASSERT_FALSE(s.id.empty());
  std::vector<Rows> rows;
  for (int32_t l = 0; l < g.num_layers; ++l) rows.emplace_back(g, 200, 90 + l);
  OffloadAll("a", s.id, rows, 0, 200, 200);
  // Layer 0's pages share a slot.
  absl::StatusOr<int> master =
      cluster_->MasterOf(RedisCluster::SlotOf(ColdKey(prefix_, "a", s.id + ".live", 0, 0)));
  ASSERT_TRUE(master.ok()) << master.status();
  ASSERT_TRUE(cluster_->Pause(*master).ok());
  bool resumed = false;
  const auto resume = [&] {
    if (resumed) return;
    resumed = true;
    EXPECT_TRUE(cluster_->Resume(*master).ok());
  };
  Caller caller{"a"};
  caller.deadline = absl::Now() + absl::Milliseconds(500);
  const absl::Time start = absl::Now();
  absl::Status st;
  absl::StatusOr<std::unique_ptr<FetchCursor>> cursor = manager_->StartFetch(caller, s.id, 0, {});
  if (!cursor.ok()) st = cursor.status();
  while (cursor.ok() && !(*cursor)->done() && st.ok()) {
    st = (*cursor)->Next(uint64_t{1} << 20).status();
  }
  const absl::Duration took = absl::Now() - start;
  resume();
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_LT(took, absl::Seconds(4)) << "the Fetch outlived its 0.5 s deadline: " << st;
  // The node answers again: every page reads back.
  const std::vector<PageData> pages = FetchAll(Caller{"a"}, s.id, 0);
  EXPECT_EQ(pages.size(), 25u);
  for (const PageData& page : pages) {
    EXPECT_EQ(page.data, ExpectedPage(g, rows[0], page.page)) << "page " << page.page;
  }
  EXPECT_TRUE(manager_->CloseSession(Caller{"a"}, s.id).ok());
}

TEST_F(ColdSessionTest, PromotePagesNeverWritesItsSlotAfterItsDeadline) {
  manager_ = Make(ColdConfig());
  ASSERT_NE(manager_, nullptr);
  const Geometry g = SmallGeometry();
  std::optional<SessionRegion> region;
  const SessionRecord s = OpenShmDemoting(&region);
  ASSERT_TRUE(region.has_value());
  const std::string page(g.host_page_bytes(), 'p');
  EngineCommit(*region, 0, 0, 0, 1, page);
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(manager_->MovePages(Caller{"a"}, s.id, true, s.epoch, {{0, 0, 0, 1}}).ok());
  // What the engine keeps in slot 5, which the promotion below names.
  const std::string mine(g.host_page_bytes(), 'E');
  std::memcpy(const_cast<void*>(region->SlotData(5)), mine.data(), mine.size());

  const std::string key = ColdKey(prefix_, "a", s.id + ".live", 0, 0);
  absl::StatusOr<int> master = cluster_->MasterOf(RedisCluster::SlotOf(key));
  ASSERT_TRUE(master.ok()) << master.status();
  ASSERT_TRUE(cluster_->Pause(*master).ok());
  std::thread resume([&] {
    absl::SleepFor(absl::Milliseconds(800));
    EXPECT_TRUE(cluster_->Resume(*master).ok());
  });
  Caller caller{"a"};
  caller.deadline = absl::Now() + absl::Milliseconds(300);
  const absl::Time start = absl::Now();
  const absl::Status promoted = manager_->MovePages(caller, s.id, false, s.epoch, {{0, 0, 5, 1}});
  const absl::Duration took = absl::Now() - start;
  resume.join();
  EXPECT_EQ(promoted.code(), absl::StatusCode::kDeadlineExceeded) << promoted;
  EXPECT_LT(took, absl::Milliseconds(700)) << "the read outlived the call's deadline";
  // The node answers again: a promotion into another slot works, and slot 5 holds what the
  // engine put there.
  const absl::Status again = manager_->MovePages(Caller{"a"}, s.id, false, s.epoch, {{0, 0, 6, 1}});
  ASSERT_TRUE(again.ok()) << again;
  EXPECT_TRUE(SlotBytes(*region, 6) == page);
  EXPECT_TRUE(SlotBytes(*region, 5) == mine) << "PromotePages wrote the slot after its deadline";
  EXPECT_TRUE(manager_->CloseSession(Caller{"a"}, s.id).ok());
}

// The same when the caller goes away while the page is read (a cancel the cluster client
// cannot see): the read completes, but the slot is not written and the call is CANCELLED.
TEST_F(ColdSessionTest, PromotePagesCancelledDuringItsReadLeavesItsSlot) {
  manager_ = Make(ColdConfig());
  ASSERT_NE(manager_, nullptr);
  const Geometry g = SmallGeometry();
  std::optional<SessionRegion> region;
  const SessionRecord s = OpenShmDemoting(&region);
  ASSERT_TRUE(region.has_value());
  EngineCommit(*region, 1, 0, 0, 1, std::string(g.host_page_bytes(), 'p'));
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(manager_->MovePages(Caller{"a"}, s.id, true, s.epoch, {{1, 0, 0, 1}}).ok());
  const std::string mine(g.host_page_bytes(), 'E');
  std::memcpy(const_cast<void*>(region->SlotData(7)), mine.data(), mine.size());

  const std::string key = ColdKey(prefix_, "a", s.id + ".live", 1, 0);
  absl::StatusOr<int> master = cluster_->MasterOf(RedisCluster::SlotOf(key));
  ASSERT_TRUE(master.ok()) << master.status();
  ASSERT_TRUE(cluster_->Pause(*master).ok());
  std::atomic<bool> gone{false};
  std::thread client([&] {
    absl::SleepFor(absl::Milliseconds(100));
    gone = true;  // the caller cancels while the read waits for the node
    absl::SleepFor(absl::Milliseconds(100));
    EXPECT_TRUE(cluster_->Resume(*master).ok());
  });
  Caller caller{"a"};
  caller.cancelled = [&gone] { return gone.load(); };
  const absl::Status promoted = manager_->MovePages(caller, s.id, false, s.epoch, {{1, 0, 7, 1}});
  client.join();
  EXPECT_EQ(promoted.code(), absl::StatusCode::kCancelled) << promoted;
  EXPECT_TRUE(SlotBytes(*region, 7) == mine) << "PromotePages wrote the slot after a cancel";
  EXPECT_TRUE(manager_->CloseSession(Caller{"a"}, s.id).ok());
}

// DemotePages naming a page many times writes it once and charges it once; demoting it again
// (the same generation, or a newer one from another slot) keeps one key and one charge; the
// session's close returns the whole charge and removes its keys.
TEST_F(ColdSessionTest, DemotePagesChargesEachPageOnceAndCloseReturnsIt) {
  manager_ = Make(ColdConfig());
  ASSERT_NE(manager_, nullptr);
  const Geometry g = SmallGeometry();
  const double value_bytes = static_cast<double>(g.host_page_bytes() + kColdHeaderBytes);
  std::optional<SessionRegion> region;
  const SessionRecord s = OpenShmDemoting(&region);
  ASSERT_TRUE(region.has_value());
  for (int64_t page = 0; page < 3; ++page) {
    EngineCommit(*region, 0, page, page, 1, std::string(g.host_page_bytes(), 'a' + page));
    ASSERT_FALSE(HasFatalFailure());
    const std::vector<TenantSession::PageMove> moves(SessionManager::kMaxPagesPerMove,
                                                     {0, page, page, 1});
    const absl::Status st = manager_->MovePages(Caller{"a"}, s.id, true, s.epoch, moves);
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_EQ(ColdUsed("a"), static_cast<double>(page + 1) * value_bytes) << "page " << page;
  }
  EXPECT_EQ(LiveKeys("a", s.id), 3);
  // Page 0 again, as it is: nothing new is written or charged.
  ASSERT_TRUE(manager_->MovePages(Caller{"a"}, s.id, true, s.epoch, {{0, 0, 0, 1}}).ok());
  EXPECT_EQ(ColdUsed("a"), 3 * value_bytes);
  // Page 0 committed again, newer, from slot 3: its key is written over, charged once.
  EngineCommit(*region, 0, 0, 3, 2, std::string(g.host_page_bytes(), 'z'));
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(manager_->MovePages(Caller{"a"}, s.id, true, s.epoch, {{0, 0, 3, 2}}).ok());
  EXPECT_EQ(ColdUsed("a"), 3 * value_bytes);
  EXPECT_EQ(LiveKeys("a", s.id), 3);
  ASSERT_TRUE(manager_->CloseSession(Caller{"a"}, s.id).ok());
  EXPECT_EQ(ColdUsed("a"), 0);
  EXPECT_EQ(LiveKeys("a", s.id), 0);
}

// A live session's demotion that WAIT cannot acknowledge (min_replicas 2, one replica per
// master) fails the Offload that needed room with UNAVAILABLE, after its pages reached the
// masters; they stay the session's: its close removes every "<session>.live" key and the
// tenant's cold tier is charged nothing afterwards.
TEST_F(ColdSessionTest, DemotionsWaitRefusedLeaveNoKeysOrChargeAfterClose) {
  DaemonConfig config = ColdConfig();
  config.cold_tier.min_replicas = 2;
  config.cold_tier.command_timeout = absl::Milliseconds(200);  // WAIT gives up in 150 ms
  manager_ = Make(config);
  ASSERT_NE(manager_, nullptr);
  const Geometry g = SmallGeometry();
  OpenSessionParams p = GrpcParams("a");
  p.mode = RetrievalMode::kSync;
  p.max_tokens = 1024;
  p.host_drop = "demote";
  p.host_tokens = 128;
  const SessionRecord s = Open(p);
  ASSERT_FALSE(s.id.empty());
  std::vector<Rows> rows;
  for (int32_t l = 0; l < g.num_layers; ++l) rows.emplace_back(g, 400, 50 + l);
  // 50 pages a layer through 16 host pages each: the appends must demote.
  std::unique_ptr<OffloadStream> stream = manager_->NewOffloadStream(Caller{"a"});
  absl::Status st;
  for (int32_t l = 0; l < g.num_layers && st.ok(); ++l) {
    for (int64_t t = 0; t < 400 && st.ok(); t += 200) {
      st = stream->Add(session_manager_testing::Chunk(s.id, l, rows[l], t, 200, false, g));
    }
  }
  if (st.ok()) st = stream->Finish().status();
  ExpectError(st, absl::StatusCode::kUnavailable, {"WAIT 2"});
  const int written = LiveKeys("a", s.id);
  EXPECT_GT(written, 0) << "the failed demotion wrote nothing to the masters";
  // What it wrote is charged until it is removed.
  EXPECT_EQ(ColdUsed("a"), written * static_cast<double>(g.host_page_bytes() + kColdHeaderBytes));
  ASSERT_TRUE(manager_->CloseSession(Caller{"a"}, s.id).ok());
  EXPECT_EQ(LiveKeys("a", s.id), 0);
  EXPECT_EQ(ColdUsed("a"), 0);
}

// Its own cluster: it kills a master.
TEST(ColdSessionFailoverTest, AKilledMasterLosesNothingADemotionAcknowledged) {
  spdlog::set_level(spdlog::level::warn);
  absl::StatusOr<std::unique_ptr<testing::RedisClusterProcess>> started = StartCluster();
  if (absl::IsNotFound(started.status())) GTEST_SKIP() << started.status();
  ASSERT_TRUE(started.ok()) << "the cluster did not start: " << started.status();
  std::unique_ptr<testing::RedisClusterProcess> cluster = *std::move(started);
  DaemonConfig config = TestConfig();
  config.cold_tier.nodes = cluster->seeds();
  config.cold_tier.key_prefix = "failover";
  config.cold_tier.min_replicas = 1;
  config.cold_tier.command_timeout = absl::Milliseconds(500);
  config.cold_tier.operation_timeout = absl::Seconds(30);
  for (TenantConfig& t : config.tenants) t.cold_quota_bytes = 64 * kMiB;
  absl::StatusOr<std::unique_ptr<SessionManager>> m = SessionManager::Create(config);
  ASSERT_TRUE(m.ok()) << m.status();
  const Geometry g = SmallGeometry();
  // Four sessions, demoted (acknowledged: written and WAITed for a replica).
  std::vector<std::string> ids;
  std::vector<std::vector<Rows>> rows(4);
  for (int i = 0; i < 4; ++i) {
    OpenSessionParams p = GrpcParams("a");
    absl::StatusOr<SessionRecord> r = (*m)->OpenSession(Caller{"a"}, p);
    ASSERT_TRUE(r.ok()) << r.status();
    for (int32_t l = 0; l < g.num_layers; ++l) rows[i].emplace_back(g, 256, 1000 + 10 * i + l);
    std::unique_ptr<OffloadStream> s = (*m)->NewOffloadStream(Caller{"a"});
    for (int32_t l = 0; l < g.num_layers; ++l) {
      ASSERT_TRUE(
          s->Add(session_manager_testing::Chunk(r->id, l, rows[i][l], 0, 256, false, g)).ok());
    }
    ASSERT_TRUE(s->Finish().ok());
    ASSERT_TRUE((*m)->SuspendSession(Caller{"a"}, r->id).ok());
    ids.push_back(r->id);
  }
  // Demote sessions 0 and 1 (acknowledged: written and WAITed for a replica)...
  const auto demote = [&](size_t i) {
    return (*m)->DemoteSession(ids[i], absl::Now() + absl::Seconds(30));
  };
  ASSERT_TRUE(demote(0).ok());
  ASSERT_TRUE(demote(1).ok());
  // ... kill the master holding session 0's layer 0 ...
  const uint16_t slot = RedisCluster::SlotOf(ColdKey("failover", "a", ids[0], 0, 0));
  absl::StatusOr<int> master = cluster->MasterOf(slot);
  ASSERT_TRUE(master.ok()) << master.status();
  ASSERT_TRUE(cluster->Kill(*master).ok());
  // ... and demote sessions 2 and 3 while the cluster fails over: each either succeeds
  // (retrying through the failover within its deadline) or stays whole in the host tier.
  const absl::Status d2 = demote(2), d3 = demote(3);
  std::cerr << "demotions during the failover: " << d2 << ", " << d3 << "\n";
  ASSERT_TRUE(cluster->WaitForPromotion(*master, slot, absl::Seconds(30)).ok());
  // Every page of every session comes back byte-exact.
  for (size_t i = 0; i < ids.size(); ++i) {
    absl::StatusOr<SessionRecord> r = (*m)->Reattach(Caller{"a"}, ids[i]);
    ASSERT_TRUE(r.ok()) << i << ": " << r.status();
    for (int32_t l = 0; l < g.num_layers; ++l) {
      absl::StatusOr<std::unique_ptr<FetchCursor>> c = (*m)->StartFetch(Caller{"a"}, ids[i], l, {});
      ASSERT_TRUE(c.ok()) << c.status();
      int64_t n = 0;
      while (!(*c)->done()) {
        absl::StatusOr<std::vector<PageData>> batch = (*c)->Next(uint64_t{1} << 20);
        ASSERT_TRUE(batch.ok()) << batch.status();
        for (const PageData& p : *batch) {
          ASSERT_EQ(p.data, ExpectedPage(g, rows[i][l], p.page)) << i << " " << l << " " << p.page;
          ++n;
        }
      }
      EXPECT_EQ(n, 256 / g.page_size);
    }
  }
}

}  // namespace
}  // namespace kvtier::daemon
