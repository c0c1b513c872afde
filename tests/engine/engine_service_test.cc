// kvtier-run's engine with its sequences in a real kvtierd: over shared memory (the
// sequence runs in this process over the tenant arena) and over gRPC (host tier, working
// set and attention in the daemon). Full mode reproduces the training script's greedy
// tokens through both; a speculative SHM session generates the same tokens as the same
// mode in-process, and the daemon holds the session's committed pages.
#include <memory>
#include <string>
#include <vector>

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
                           std::string* session_id = nullptr) {
    SequenceSpec spec;
    spec.placement = placement;
    spec.options.mode = mode;
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

}  // namespace
}  // namespace kvtier::engine
