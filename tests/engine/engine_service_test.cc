// kvtier-run's engine with its sequences in a real kvtierd: over shared memory (the
// sequence runs in this process over the tenant arena) and over gRPC (host tier, working
// set and attention in the daemon). Full mode reproduces the training script's greedy
// tokens through both; a speculative SHM session generates the same tokens as the same
// mode in-process, and the daemon holds the session's committed pages; the drop-style
// policies, fed the engine's signals (over gRPC: ReportSignals), choose as they do in-process.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "engine/generate.h"
#include "gtest/gtest.h"
#include "tests/client/daemon_process.h"
#include "tests/engine/golden.h"

namespace kvtier::engine {
namespace {

class EngineServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string dir = testing::ModelDir();
    const testing::Golden golden = testing::LoadGolden();
    prompt_ = golden.prompt_ids;
    greedy_ = golden.greedy_ids;
    ASSERT_FALSE(prompt_.empty());
    EngineOptions o;
    o.model_path = dir + "/kvtier-tiny.gguf";
    o.threads = 2;
    o.decoder.kv_dtype = DType::kF32;
    absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Open(o);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = *std::move(e);
    testing::DaemonProcessOptions d;
    d.kvtierd_path = KVTIERD_PATH;
    d.tenants.push_back({"engine", "", uint64_t{64} << 20});
    absl::StatusOr<std::unique_ptr<testing::DaemonProcess>> daemon =
        testing::DaemonProcess::Start(d);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = *std::move(daemon);
    ClientOptions co;
    co.tenant = "engine";
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(daemon_->target(), co);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }

  // Generates `n` greedy tokens from the golden prompt over a sequence placed as asked.
  std::vector<int32_t> Run(Placement placement, RetrievalMode mode, int32_t n,
                           std::string* session_id = nullptr, const PolicyConfig& policy = {},
                           SequenceStats* stats = nullptr) {
    SequenceSpec spec;
    spec.placement = placement;
    spec.options.mode = mode;
    spec.options.policy = policy;
    if (mode != RetrievalMode::kFull) {
      EXPECT_TRUE(spec.options.SetBudgetTokens(128, spec.page_size).ok());
    }
    spec.options.max_tokens = 1024;
    absl::StatusOr<std::unique_ptr<EngineSequence>> s =
        EngineSequence::Open(*engine_, spec, client_.get());
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return {};
    GenerateOptions g;
    g.max_new_tokens = n;
    g.stop_at_eos = false;
    absl::StatusOr<std::vector<GenerateResult>> r =
        Generate(*engine_, {&(*s)->sequence()}, {prompt_}, g);
    EXPECT_TRUE(r.ok()) << r.status();
    if (session_id != nullptr) *session_id = (*s)->session_id();
    if (stats != nullptr) *stats = (*s)->sequence().Stats();
    EXPECT_TRUE((*s)->Close().ok());
    return r.ok() ? (*r)[0].tokens : std::vector<int32_t>{};
  }

  std::vector<int32_t> prompt_, greedy_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<testing::DaemonProcess> daemon_;
  std::unique_ptr<Client> client_;
};

TEST_F(EngineServiceTest, FullModeThroughTheDaemonReproducesTheReference) {
  const std::vector<int32_t> want(greedy_.begin(), greedy_.begin() + 24);
  EXPECT_EQ(Run(Placement::kShm, RetrievalMode::kFull, 24), want);
  EXPECT_EQ(Run(Placement::kGrpc, RetrievalMode::kFull, 24), want);
}

TEST_F(EngineServiceTest, SparseModesGiveTheSameTokensInProcessAndThroughTheDaemon) {
  for (RetrievalMode mode : {RetrievalMode::kSpeculative, RetrievalMode::kSync}) {
    SCOPED_TRACE(std::string(RetrievalModeName(mode)));
    const std::vector<int32_t> local = Run(Placement::kInProcess, mode, 24);
    ASSERT_EQ(local.size(), 24u);
    EXPECT_EQ(Run(Placement::kShm, mode, 24), local);
    EXPECT_EQ(Run(Placement::kGrpc, mode, 24), local);
  }
}

// Each policy reads what the engine hands it: the prompt's last queries (KV-Compress), every
// step's attention (H2O), the hidden-state changes (EpiKV) and the logits (Conf-KV). A GRPC
// session's policies run in the daemon and get them over ReportSignals: every placement
// makes the same choices, so the same tokens, and the policies do decide (evictions, budget
// changes, and EpiKV's tokens differ from the plain window's).
TEST_F(EngineServiceTest, PoliciesChooseAlikeInProcessAndThroughTheDaemon) {
  const std::vector<int32_t> window = Run(Placement::kInProcess, RetrievalMode::kDrop, 16);
  struct Case {
    RetrievalMode mode;
    const char* budget;
    const char* residency;
  };
  for (const Case& c : {Case{RetrievalMode::kDrop, "fixed", "h2o"},
                        Case{RetrievalMode::kDrop, "fixed", "epiphany"},
                        Case{RetrievalMode::kDrop, "kv_compress", "none"},
                        Case{RetrievalMode::kSpeculative, "confidence", "attention"}}) {
    SCOPED_TRACE(absl::StrFormat("%s %s %s", RetrievalModeName(c.mode), c.budget, c.residency));
    PolicyConfig p;
    p.budget = c.budget;
    p.residency = c.residency;
    SequenceStats local_stats, grpc_stats;
    const std::vector<int32_t> local =
        Run(Placement::kInProcess, c.mode, 16, nullptr, p, &local_stats);
    ASSERT_EQ(local.size(), 16u);
    EXPECT_EQ(Run(Placement::kShm, c.mode, 16, nullptr, p), local);
    EXPECT_EQ(Run(Placement::kGrpc, c.mode, 16, nullptr, p, &grpc_stats), local);
    EXPECT_EQ(grpc_stats.evicted_head_pages, local_stats.evicted_head_pages);
    EXPECT_EQ(grpc_stats.budget_changes, local_stats.budget_changes);
    if (c.mode == RetrievalMode::kDrop) {
      EXPECT_GT(local_stats.evicted_head_pages, 0);
    }
    if (std::string(c.residency) == "epiphany") {
      EXPECT_NE(local, window);
    }
  }
}

}  // namespace
}  // namespace kvtier::engine
