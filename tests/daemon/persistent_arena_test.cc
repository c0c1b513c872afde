// Persistent arenas (tenant.arena_path): a SessionManager started over the arena file and
// session table another one left behind takes up its sessions where they were — listed, with
// their pages, their epoch moved on, GRPC sessions stepping again, suspended ones still
// suspended — and forgets the closed ones; a table it cannot read stops the start, naming the
// file.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "tests/daemon/session_manager_testutil.h"

namespace kvtier::daemon {
namespace {

using session_manager_testing::ExpectedPage;
using session_manager_testing::GrpcParams;
using session_manager_testing::kMiB;
using session_manager_testing::Rows;
using session_manager_testing::SmallGeometry;
using session_manager_testing::TestConfig;

constexpr int64_t kTokens = 200;  // 25 full pages per layer

// A directory on tmpfs when the machine has /dev/shm, else in the test's temporary directory.
std::string TempDir() {
  const std::string base = std::filesystem::exists("/dev/shm") ? "/dev/shm" : ::testing::TempDir();
  std::string dir = base + "/kvtier-persist-XXXXXX";
  if (mkdtemp(dir.data()) == nullptr) return "";
  return dir;
}

class PersistentArenaTest : public session_manager_testing::SessionManagerTest {
 protected:
  void SetUp() override {
    spdlog::set_level(spdlog::level::warn);
    dir_ = TempDir();
    ASSERT_FALSE(dir_.empty());
    config_ = TestConfig();
    for (TenantConfig& t : config_.tenants) {
      if (t.name == "a") t.arena_path = dir_ + "/a.arena";
    }
    manager_ = Make(config_);
    ASSERT_NE(manager_, nullptr);
  }
  void TearDown() override {
    manager_.reset();
    std::filesystem::remove_all(dir_);
  }

  std::string OpenFilled(uint64_t seed, std::vector<Rows>* rows) {
    absl::StatusOr<SessionRecord> r = manager_->OpenSession(Caller{"a"}, GrpcParams("a"));
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return "";
    const Geometry g = SmallGeometry();
    for (int32_t l = 0; l < g.num_layers; ++l) rows->emplace_back(g, kTokens, seed + l);
    OffloadAll("a", r->id, *rows, 0, kTokens, 100);
    return r->id;
  }

  // Pages 0..kTokens/p - 1 of every layer are those of `rows`.
  void ExpectPages(const std::string& id, const std::vector<Rows>& rows) {
    const Geometry g = SmallGeometry();
    std::vector<int64_t> wanted(static_cast<size_t>(kTokens / g.page_size));
    for (size_t i = 0; i < wanted.size(); ++i) wanted[i] = static_cast<int64_t>(i);
    for (int32_t l = 0; l < g.num_layers; ++l) {
      std::vector<PageData> pages = FetchAll(Caller{"a"}, id, l, wanted);
      ASSERT_EQ(pages.size(), static_cast<size_t>(kTokens / g.page_size)) << "layer " << l;
      for (const PageData& p : pages) {
        ASSERT_EQ(p.data, ExpectedPage(g, rows[l], p.page)) << "layer " << l << " page " << p.page;
      }
    }
  }

  SessionRecord Listed(const std::string& id) {
    for (const SessionRecord& r : manager_->ListSessions(Caller{"a"})) {
      if (r.id == id) return r;
    }
    ADD_FAILURE() << "session " << id << " is not listed";
    return {};
  }

  std::string dir_;
  DaemonConfig config_;
};

TEST_F(PersistentArenaTest, ARestartedManagerTakesUpItsSessionsWhereTheyWere) {
  std::vector<Rows> rows_live, rows_suspended, rows_closed;
  const std::string live = OpenFilled(10, &rows_live);
  const std::string suspended = OpenFilled(20, &rows_suspended);
  const std::string closed = OpenFilled(30, &rows_closed);
  ASSERT_TRUE(manager_->SuspendSession(Caller{"a"}, suspended).ok());
  ASSERT_TRUE(manager_->CloseSession(Caller{"a"}, closed).ok());
  const SessionRecord before = Listed(live);
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/a.arena.sessions"));
  Exposition metrics;
  manager_->WriteMetrics(metrics);
  EXPECT_NE(metrics.text().find("kvtier_arena_persistent{tenant=\"a\"} 1\n"), std::string::npos);
  EXPECT_NE(metrics.text().find("kvtier_arena_persistent{tenant=\"b\"} 0\n"), std::string::npos);

  manager_.reset();  // the daemon goes; the arena file and its table stay
  manager_ = Make(config_);
  ASSERT_NE(manager_, nullptr);
  const std::vector<SessionRecord> listed = manager_->ListSessions(Caller{"a"});
  ASSERT_EQ(listed.size(), 2u);
  const SessionRecord after = Listed(live);
  EXPECT_FALSE(after.cold);
  EXPECT_EQ(after.region_offset, before.region_offset);
  EXPECT_GT(after.epoch, before.epoch);  // a holder that outlived the old daemon is fenced off
  EXPECT_EQ(after.committed_tokens, std::vector<uint64_t>(2, kTokens));
  EXPECT_TRUE(Listed(suspended).suspended);
  EXPECT_TRUE(manager_->ListSessions(Caller{"b"}).empty());

  ExpectPages(live, rows_live);
  // The GRPC session's Retriever was rebuilt from the region: it steps over every page.
  const Geometry g = SmallGeometry();
  const std::string q(static_cast<size_t>(g.num_q_heads) * g.head_dim * g.element_bytes(), '\1');
  absl::StatusOr<StepResult> step = manager_->Step(Caller{"a"}, live, 0, q, true);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->num_tokens, kTokens);
  // Appends go on where the pages end.
  Rows more(g, 16, 77);
  std::unique_ptr<OffloadStream> s = manager_->NewOffloadStream(Caller{"a"});
  for (int32_t l = 0; l < g.num_layers; ++l) {
    ASSERT_TRUE(s->Add(session_manager_testing::Chunk(live, l, more, 0, 16, false, g)).ok());
  }
  absl::StatusOr<OffloadResult> r = s->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->layer_tokens, std::vector<uint64_t>(2, kTokens + 16));

  // The suspended one refuses work until reattached, then it is whole too.
  EXPECT_EQ(manager_->Step(Caller{"a"}, suspended, 0, q, false).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(manager_->Reattach(Caller{"a"}, suspended).ok());
  ExpectPages(suspended, rows_suspended);
  // New sessions find room beside them (the adopted regions are taken).
  std::vector<Rows> rows_new;
  const std::string fresh = OpenFilled(40, &rows_new);
  ExpectPages(fresh, rows_new);
  ExpectPages(live, rows_live);  // its first pages, untouched by the appends and the new one
}

TEST_F(PersistentArenaTest, ATableItCannotReadStopsTheStartNamingTheFile) {
  std::vector<Rows> rows;
  ASSERT_FALSE(OpenFilled(1, &rows).empty());
  manager_.reset();
  {
    std::ofstream out(dir_ + "/a.arena.sessions", std::ios::binary | std::ios::trunc);
    out << "not a table";
  }
  absl::StatusOr<std::unique_ptr<SessionManager>> m = SessionManager::Create(config_);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(m.status().message()), ::testing::HasSubstr("a.arena.sessions"));
}

TEST_F(PersistentArenaTest, ANewArenaFileTakesUpNothing) {
  std::vector<Rows> rows;
  ASSERT_FALSE(OpenFilled(1, &rows).empty());
  manager_.reset();
  // The arena went (a reboot of a tmpfs), the table stayed: nothing is taken up, and the
  // table is rewritten empty.
  std::filesystem::remove(dir_ + "/a.arena");
  manager_ = Make(config_);
  ASSERT_NE(manager_, nullptr);
  EXPECT_TRUE(manager_->ListSessions(Caller{"a"}).empty());
  manager_.reset();
  manager_ = Make(config_);
  ASSERT_NE(manager_, nullptr);
  EXPECT_TRUE(manager_->ListSessions(Caller{"a"}).empty());
}

}  // namespace
}  // namespace kvtier::daemon
