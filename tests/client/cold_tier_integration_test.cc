// The cold tier end to end: the real kvtierd with a real Redis Cluster on loopback (3 masters
// with a replica each; skipped, saying why, without redis-server), engines through libkvtier.
// SHM sessions fill a tenant far beyond its arena (each suspended one is demoted when a new
// one needs the room) and every page reads back byte-exact after Reattach; and a kvtierd that
// shuts down and starts again finds its SHM and GRPC sessions, whose pages come back, and
// the engine goes on decoding. And, without a cold tier, a persistent arena: an SHM session
// survives kvtierd killed with SIGKILL.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kvtier/client.h"
#include "tests/client/daemon_process.h"
#include "tests/client/integration_options.h"
#include "tests/client/session_trace.h"
#include "tests/testutil/redis_cluster_process.h"
#include "tests/testutil/assert_ok.h"

namespace kvtier {
namespace {

using testing::DaemonProcess;
using testing::DaemonProcessOptions;
using testing::IntegrationSessionOptions;
using testing::IntegrationTrace;
using testing::SyntheticTrace;
using testing::TraceHostPage;

constexpr int32_t kPage = 32;
constexpr int32_t kPrefill = 600;                        // 18 full pages and 24 tokens
constexpr int32_t kFull = kPrefill / kPage * kPage;      // 576
// An SHM session of IntegrationSessionOptions (2048 tokens, 2 layers, 16 KiB pages) takes
// a region of a little over 2 MiB: this arena holds two, and beside them the daemon memory
// of one GRPC session of 600 tokens (its pages, working set, summaries and key codes).
constexpr uint64_t kArenaBytes = uint64_t{11} << 19;  // 5.5 MiB

std::unique_ptr<Client> Connect(const DaemonProcess& d) {
  ClientOptions o;
  o.tenant = "a";
  o.token = "ta";
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(d.target(), o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

// Every full page of both layers is the trace's.
void ExpectPages(Session& s, const SyntheticTrace& trace, int32_t full_tokens) {
  for (int32_t l = 0; l < 2; ++l) {
    absl::StatusOr<std::vector<FetchedPage>> pages = s.FetchPages(l, {});
    ASSERT_TRUE(pages.ok()) << pages.status();
    ASSERT_EQ(pages->size(), static_cast<size_t>(full_tokens / kPage)) << "layer " << l;
    for (const FetchedPage& p : *pages) {
      ASSERT_EQ(p.data, TraceHostPage(trace, l, p.page)) << "layer " << l << " page " << p.page;
    }
  }
}

class ColdTierIntegrationTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<testing::RedisClusterProcess>> c =
        testing::RedisClusterProcess::Start({});
    if (c.ok()) {
      cluster_ = c->release();
    } else {
      start_error_ = new absl::Status(c.status());
    }
    backend_ = NewCpuBackend(2).release();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
    delete start_error_;
    start_error_ = nullptr;
    delete backend_;
    backend_ = nullptr;
  }
  void SetUp() override {
    // No redis-server skips; a cluster that would not start fails.
    if (cluster_ == nullptr) {
      if (absl::IsNotFound(*start_error_)) GTEST_SKIP() << *start_error_;
      FAIL() << "the cluster did not start: " << *start_error_;
    }
  }

  static DaemonProcessOptions Options(const std::string& prefix) {
    DaemonProcessOptions o;
    o.kvtierd_path = KVTIERD_PATH;
    o.tenants = {{"a", "ta", kArenaBytes}};
    o.tenant_toml = "cold_quota_bytes = 268435456\n";
    o.cpu_threads = 2;
    o.extra_toml = absl::StrCat("[cold_tier]\nnodes = [\"",
                                absl::StrJoin(cluster_->seeds(), "\", \""),
                                "\"]\nkey_prefix = \"", prefix,
                                "\"\nmin_replicas = 1\noperation_timeout_ms = 20000\n");
    return o;
  }

  static absl::StatusOr<SessionInfo> Listed(Client& c, const std::string& id) {
    absl::StatusOr<std::vector<SessionInfo>> all = c.ListSessions();
    if (!all.ok()) return all.status();
    for (const SessionInfo& s : *all) {
      if (s.id == id) return s;
    }
    return absl::NotFoundError(id);
  }

  static testing::RedisClusterProcess* cluster_;
  static absl::Status* start_error_;
  static Backend* backend_;
};

testing::RedisClusterProcess* ColdTierIntegrationTest::cluster_ = nullptr;
absl::Status* ColdTierIntegrationTest::start_error_ = nullptr;
Backend* ColdTierIntegrationTest::backend_ = nullptr;

TEST_F(ColdTierIntegrationTest, ShmSessionsFillATenantFarBeyondItsArena) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(Options("fill"));
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<Client> c = Connect(**d);
  ASSERT_NE(c, nullptr);
  const SessionOptions options = IntegrationSessionOptions(Transport::kShm, backend_);
  // Six sessions of ~2 MiB each through a 5 MiB arena, each with its own trace.
  constexpr int kSessions = 6;
  std::vector<std::string> ids;
  std::vector<std::unique_ptr<SyntheticTrace>> traces;
  for (int i = 0; i < kSessions; ++i) {
    testing::TraceOptions t = IntegrationTrace();
    t.seed = 100 + i;
    traces.push_back(std::make_unique<SyntheticTrace>(t));
    absl::StatusOr<std::unique_ptr<Session>> s = c->OpenSession(options);
    ASSERT_TRUE(s.ok()) << "session " << i << ": " << s.status() << "\n" << (*d)->Log();
    ASSERT_OK(testing::AppendTokens(**s, *traces.back(), 0, kPrefill));
    ASSERT_OK((*s)->Suspend());
    ids.push_back((*s)->id());
  }
  int cold = 0;
  for (const std::string& id : ids) {
    absl::StatusOr<SessionInfo> info = Listed(*c, id);
    ASSERT_TRUE(info.ok()) << info.status();
    cold += info->cold;
  }
  EXPECT_GE(cold, kSessions - 2);
  // Each comes back whole, in any order (promoting one demotes another).
  for (int i = kSessions - 1; i >= 0; --i) {
    SCOPED_TRACE(i);
    absl::StatusOr<std::unique_ptr<Session>> s = c->Reattach(ids[i], options);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ((*s)->sequence().num_tokens(0), kFull);
    ExpectPages(**s, *traces[i], kFull);
    ASSERT_OK((*s)->Suspend());
  }
  ASSERT_TRUE((*d)->Stop(SIGTERM).ok());
}

// policy.host_drop = demote over SHM: the engine's Retriever keeps 29 of its ~50 pages per
// layer in the region and moves the rest through kvtierd (DemotePages, PromotePages) to the
// cluster. Decoding gives bit for bit what a session whose region holds everything gives,
// every page reads back (the demoted ones through the daemon), and after an engine restart
// Reattach rebuilds the sequence by appending its pages again: both go on decoding alike; and
// again after kvtierd restarted (SIGTERM moves the session to the cluster whole).
TEST_F(ColdTierIntegrationTest, AnShmSessionDemotesPagesAndDecodesBitIdentical) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(Options("live"));
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<Client> c = Connect(**d);
  ASSERT_NE(c, nullptr);
  testing::TraceOptions t = IntegrationTrace();
  t.prefill = 1600;
  t.steps = 80;
  const SyntheticTrace trace(t);
  SessionOptions ref_options = IntegrationSessionOptions(Transport::kShm, backend_);
  ref_options.sequence.recall = RecallStrategy::kBatchedDma;
  ref_options.sequence.policy.residency = "h2o";
  SessionOptions options = ref_options;
  options.sequence.policy.host_drop = "demote";
  // 29 pages per layer (the least it may be): 2 sink + 2 recent + 1, and 2 × 2 × 12 selected
  // spread over the 2 layers.
  options.host_tokens = 928;
  absl::StatusOr<std::unique_ptr<Session>> ref = c->OpenSession(ref_options);
  ASSERT_TRUE(ref.ok()) << ref.status();
  absl::StatusOr<std::unique_ptr<Session>> s = c->OpenSession(options);
  ASSERT_TRUE(s.ok()) << s.status() << "\n" << (*d)->Log();
  ASSERT_OK(testing::AppendTokens(**ref, trace, 0, t.prefill));
  ASSERT_OK(testing::AppendTokens(**s, trace, 0, t.prefill));
  const auto decode_both = [&](int32_t first, int32_t last) {
    auto want = testing::RunDecode(**ref, trace, first, last);
    ASSERT_TRUE(want.ok()) << want.status();
    auto got = testing::RunDecode(**s, trace, first, last);
    ASSERT_TRUE(got.ok()) << got.status() << "\n" << (*d)->Log();
    for (int32_t step = 0; step < last - first; ++step) {
      for (int32_t l = 0; l < 2; ++l) {
        ASSERT_EQ((*got)[step][l].output, (*want)[step][l].output)
            << "step " << first + step << " layer " << l;
        ASSERT_EQ((*got)[step][l].slot_table, (*want)[step][l].slot_table)
            << "step " << first + step << " layer " << l;
      }
    }
  };
  decode_both(0, 40);
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_OK((*s)->Flush());
  const SequenceStats st = (*s)->sequence().Stats();
  EXPECT_GT(st.host_demoted_pages, 0);
  EXPECT_GT(st.host_promoted_pages, 0) << "no step selected a demoted page";
  ExpectPages(**s, trace, (t.prefill + 40) / kPage * kPage);

  // The engine restarts: both sessions are taken over and decode on alike.
  const std::string ref_id = (*ref)->id(), id = (*s)->id();
  ref->reset();
  s->reset();
  ref = c->Reattach(ref_id, ref_options);
  ASSERT_TRUE(ref.ok()) << ref.status();
  s = c->Reattach(id, options);
  ASSERT_TRUE(s.ok()) << s.status() << "\n" << (*d)->Log();
  const int32_t full = (t.prefill + 40) / kPage * kPage;
  ASSERT_EQ((*s)->sequence().num_tokens(0), full);
  ASSERT_EQ((*ref)->sequence().num_tokens(0), full);
  ASSERT_OK(testing::AppendTokens(**ref, trace, full, t.prefill + 40));
  ASSERT_OK(testing::AppendTokens(**s, trace, full, t.prefill + 40));
  decode_both(40, 60);
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_GT((*s)->sequence().Stats().host_demoted_pages, 0);
  ExpectPages(**s, trace, (t.prefill + 60) / kPage * kPage);

  // kvtierd restarts: SIGTERM moves both sessions to the cluster whole (the demoting one's
  // pages read back from its demoted keys), and the engine takes both over from the new one.
  ASSERT_OK((*s)->Flush());
  ASSERT_OK((*ref)->Flush());
  ref->reset();
  s->reset();
  c.reset();
  absl::StatusOr<int> stopped = (*d)->Stop(SIGTERM);
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  EXPECT_NE((*d)->Log().find("demoted 2 sessions to the cold tier"), std::string::npos)
      << (*d)->Log();
  d = DaemonProcess::Start(Options("live"));
  ASSERT_TRUE(d.ok()) << d.status();
  c = Connect(**d);
  ASSERT_NE(c, nullptr);
  ref = c->Reattach(ref_id, ref_options);
  ASSERT_TRUE(ref.ok()) << ref.status() << "\n" << (*d)->Log();
  s = c->Reattach(id, options);
  ASSERT_TRUE(s.ok()) << s.status() << "\n" << (*d)->Log();
  const int32_t full2 = (t.prefill + 60) / kPage * kPage;
  ASSERT_EQ((*s)->sequence().num_tokens(1), full2);
  ASSERT_EQ((*ref)->sequence().num_tokens(1), full2);
  ASSERT_OK(testing::AppendTokens(**ref, trace, full2, t.prefill + 60));
  ASSERT_OK(testing::AppendTokens(**s, trace, full2, t.prefill + 60));
  decode_both(60, 80);
  ASSERT_FALSE(HasFatalFailure());
  ExpectPages(**s, trace, (t.prefill + 80) / kPage * kPage);
  ASSERT_OK((*s)->Close());
  ASSERT_OK((*ref)->Close());
  ASSERT_TRUE((*d)->Stop(SIGTERM).ok());
}

TEST_F(ColdTierIntegrationTest, SessionsSurviveARestartOfKvtierd) {
  const SyntheticTrace trace(IntegrationTrace());
  std::string shm_id, grpc_id;
  {
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(Options("restart"));
    ASSERT_TRUE(d.ok()) << d.status();
    std::unique_ptr<Client> c = Connect(**d);
    ASSERT_NE(c, nullptr);
    absl::StatusOr<std::unique_ptr<Session>> shm =
        c->OpenSession(IntegrationSessionOptions(Transport::kShm, backend_));
    ASSERT_TRUE(shm.ok()) << shm.status();
    ASSERT_OK(testing::AppendTokens(**shm, trace, 0, kPrefill));
    ASSERT_OK((*shm)->Suspend());  // the engine lets it go
    absl::StatusOr<std::unique_ptr<Session>> grpc =
        c->OpenSession(IntegrationSessionOptions(Transport::kGrpc));
    ASSERT_TRUE(grpc.ok()) << grpc.status();
    ASSERT_OK(testing::AppendTokens(**grpc, trace, 0, kPrefill));
    ASSERT_OK((*grpc)->Flush());
    shm_id = (*shm)->id();
    grpc_id = (*grpc)->id();
    // The GRPC session is still held when kvtierd goes: SIGTERM demotes both.
    absl::StatusOr<int> stopped = (*d)->Stop(SIGTERM);
    ASSERT_TRUE(stopped.ok()) << stopped.status();
    EXPECT_TRUE(WIFEXITED(*stopped) && WEXITSTATUS(*stopped) == 0) << (*d)->Log();
    EXPECT_NE((*d)->Log().find("demoted 2 sessions to the cold tier"), std::string::npos)
        << (*d)->Log();
  }
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(Options("restart"));
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<Client> c = Connect(**d);
  ASSERT_NE(c, nullptr);
  for (const std::string& id : {shm_id, grpc_id}) {
    absl::StatusOr<SessionInfo> info = Listed(*c, id);
    ASSERT_TRUE(info.ok()) << info.status() << "\n" << (*d)->Log();
    EXPECT_TRUE(info->cold);
    EXPECT_EQ(info->committed_tokens, (std::vector<int64_t>{kFull, kFull}));
  }
  // SHM: its pages come back into the new daemon's arena; the engine re-appends the partial
  // page and decodes on.
  absl::StatusOr<std::unique_ptr<Session>> shm =
      c->Reattach(shm_id, IntegrationSessionOptions(Transport::kShm, backend_));
  ASSERT_TRUE(shm.ok()) << shm.status() << "\n" << (*d)->Log();
  EXPECT_EQ((*shm)->sequence().num_tokens(1), kFull);
  ExpectPages(**shm, trace, kFull);
  ASSERT_OK(testing::AppendTokens(**shm, trace, kFull, kPrefill));
  absl::StatusOr<std::vector<std::vector<testing::StepRecord>>> steps =
      testing::RunDecode(**shm, trace, 0, 4);
  ASSERT_TRUE(steps.ok()) << steps.status();
  // GRPC: the daemon's Retriever is rebuilt from the pages.
  absl::StatusOr<std::unique_ptr<Session>> grpc =
      c->Reattach(grpc_id, IntegrationSessionOptions(Transport::kGrpc));
  ASSERT_TRUE(grpc.ok()) << grpc.status();
  EXPECT_EQ((*grpc)->sequence().num_tokens(0), kFull);
  ExpectPages(**grpc, trace, kFull);
  ASSERT_OK(testing::AppendTokens(**grpc, trace, kFull, kPrefill));
  std::vector<uint8_t> out(8 * 64 * 2);
  ASSERT_OK((*grpc)->sequence().Decode(0, trace.Query(0, 0), out.data(), nullptr));
  ASSERT_OK((*shm)->Close());
  ASSERT_OK((*grpc)->Close());
  ASSERT_TRUE((*d)->Stop(SIGTERM).ok());
}

// A persistent arena (tenant.arena_path), no cold tier: kvtierd killed with SIGKILL and
// started again over the same file takes up its SHM session, and the engine reattaches to
// its pages and decodes on.
TEST(PersistentArenaIntegrationTest, ShmSessionsSurviveAKilledKvtierd) {
  const std::string base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : ::testing::TempDir();
  std::string dir = base + "/kvtier-arena-XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  DaemonProcessOptions o;
  o.kvtierd_path = KVTIERD_PATH;
  o.tenants = {{"a", "ta", kArenaBytes}};
  o.tenant_toml = absl::StrCat("arena_path = \"", dir, "/a.arena\"\n");
  o.cpu_threads = 2;
  std::unique_ptr<Backend> backend = NewCpuBackend(2);
  const SessionOptions options = IntegrationSessionOptions(Transport::kShm, backend.get());
  const SyntheticTrace trace(IntegrationTrace());
  std::string id;
  {
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(o);
    ASSERT_TRUE(d.ok()) << d.status();
    std::unique_ptr<Client> c = Connect(**d);
    ASSERT_NE(c, nullptr);
    absl::StatusOr<std::unique_ptr<Session>> s = c->OpenSession(options);
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_OK(testing::AppendTokens(**s, trace, 0, kPrefill));
    ASSERT_OK((*s)->Flush());  // committed: in the arena file now
    id = (*s)->id();
    absl::StatusOr<int> killed = (*d)->Stop(SIGKILL);
    ASSERT_TRUE(killed.ok()) << killed.status();
    ASSERT_TRUE(WIFSIGNALED(*killed));
    (*s)->sequence().Close().IgnoreError();  // the engine notices its daemon is gone
  }
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(o);
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<Client> c = Connect(**d);
  ASSERT_NE(c, nullptr);
  absl::StatusOr<std::unique_ptr<Session>> s = c->Reattach(id, options);
  ASSERT_TRUE(s.ok()) << s.status() << "\n" << (*d)->Log();
  EXPECT_EQ((*s)->sequence().num_tokens(0), kFull);
  ExpectPages(**s, trace, kFull);
  ASSERT_OK(testing::AppendTokens(**s, trace, kFull, kPrefill));
  absl::StatusOr<std::vector<std::vector<testing::StepRecord>>> steps =
      testing::RunDecode(**s, trace, 0, 4);
  ASSERT_TRUE(steps.ok()) << steps.status();
  ASSERT_OK((*s)->Close());
  ASSERT_TRUE((*d)->Stop(SIGTERM).ok());
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvtier
