// The decoder's evaluation hooks and signals on the project's model, and `RunEval`
// (engine/eval.h) on a short held-out text: what the observer sees is what the sequence gets,
// the hidden-state change reaches the policies for every token (the same whether it was
// computed in a prompt chunk, across chunks or in a decode step), and the eval's metrics
// hold the relations they must (full mode is its own reference; speculative mode that
// corrects every head is sync mode), and a run that fails is its own result.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "engine/eval.h"
#include "engine/generate.h"
#include "gtest/gtest.h"
#include "tests/engine/golden.h"

namespace kvtier::engine {
namespace {

// A LocalSequence that forwards everything and records what the engine hands it: a
// decorator, so its batch steps the sequence it wraps.
class RecordingSequence final : public LocalSequence {
 public:
  explicit RecordingSequence(std::unique_ptr<LocalSequence> inner) : inner_(std::move(inner)) {}

  absl::Status Append(int32_t layer, const void* k, const void* v, int32_t n) override {
    if (layer == 0) {
      const float* kf = static_cast<const float*>(k);
      const size_t row = inner_->geometry().num_kv_heads * inner_->geometry().head_dim;
      keys0.insert(keys0.end(), kf, kf + n * row);
    }
    return inner_->Append(layer, k, v, n);
  }
  absl::Status Wait() override { return inner_->Wait(); }
  absl::Status Close() override { return inner_->Close(); }
  SequenceStats Stats() override { return inner_->Stats(); }
  StepStats LastStep(int32_t layer) override { return inner_->LastStep(layer); }
  const Geometry& geometry() const override { return inner_->geometry(); }
  const SequenceOptions& options() const override { return inner_->options(); }
  int32_t num_tokens(int32_t layer) const override { return inner_->num_tokens(layer); }
  // The step is the wrapped sequence's, through its batch.
  SequenceBatch* batch() override { return inner_->batch(); }
  LocalSequence* stepped() override { return inner_->stepped(); }
  absl::Status ReportSignals(const StepSignals& s) override {
    if (!s.hidden_delta.empty()) {
      EXPECT_EQ(s.first_position, static_cast<int64_t>(delta.size()) / s.num_layers)
          << "hidden-state changes arrive in order, every token once";
      EXPECT_EQ(s.hidden_delta.size(), static_cast<size_t>(s.num_tokens) * s.num_layers);
      delta.insert(delta.end(), s.hidden_delta.begin(), s.hidden_delta.end());
      layers = s.num_layers;
    }
    return inner_->ReportSignals(s);
  }
  absl::Status ObserveQueries(int32_t layer, const void* q, int32_t n, int64_t first) override {
    return inner_->ObserveQueries(layer, q, n, first);
  }
  void SetProfiling(bool on) override { inner_->SetProfiling(on); }
  Stream& compute_stream() override { return inner_->compute_stream(); }

  std::vector<float> keys0;  // layer 0's appended keys, F32
  std::vector<float> delta;  // [token][layer]
  int32_t layers = 0;

 private:
  std::unique_ptr<LocalSequence> inner_;
};

class EvalTest : public ::testing::Test {
 protected:
  static std::unique_ptr<Engine> Open(int32_t prefill_chunk) {
    EngineOptions o;
    o.model_path = testing::ModelDir() + "/kvtier-tiny.gguf";
    o.threads = 2;
    o.decoder.kv_dtype = DType::kF32;
    o.decoder.prefill_chunk = prefill_chunk;
    absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Open(o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? *std::move(e) : nullptr;
  }

  static std::unique_ptr<RecordingSequence> NewSequence(Engine& e) {
    SequenceOptions o;
    o.mode = RetrievalMode::kFull;
    o.max_tokens = 1024;
    o.compute_stream = &e.stream();
    absl::StatusOr<std::unique_ptr<LocalSequence>> s =
        NewLocalSequence(e.config().KvGeometry(DType::kF32, 16), o, e.device());
    EXPECT_TRUE(s.ok()) << s.status();
    return std::make_unique<RecordingSequence>(*std::move(s));
  }

  std::vector<int32_t> Text(Engine& e, size_t n) {
    std::vector<int32_t> ids =
        e.tokenizer().Encode(testing::ReadAll(testing::ModelDir() + "/golden/eval.txt"));
    ids.resize(n);
    return ids;
  }
};

TEST_F(EvalTest, ObserverSeesTheKeysTheSequenceGets) {
  std::unique_ptr<Engine> e = Open(16);
  ASSERT_NE(e, nullptr);
  const std::vector<int32_t> ids = Text(*e, 41);
  std::unique_ptr<RecordingSequence> seq = NewSequence(*e);
  std::vector<float> seen;
  std::vector<int32_t> positions;
  e->decoder().SetLayerObserver([&](const LayerRows& r) {
    if (r.layer == 0) {
      const int64_t row = int64_t{e->config().kv_heads} * e->config().head_dim;
      seen.insert(seen.end(), r.k, r.k + r.rows * row);
      positions.insert(positions.end(), r.positions, r.positions + r.rows);
    }
    return absl::OkStatus();
  });
  std::vector<float> logits;
  ASSERT_TRUE(e->decoder().Prefill(*seq, {ids.begin(), ids.begin() + 40}, &logits).ok());
  ASSERT_TRUE(e->decoder().Step({seq.get()}, {ids[40]}, &logits).ok());
  e->decoder().SetLayerObserver({});
  ASSERT_EQ(positions.size(), 41u);
  for (int32_t i = 0; i < 41; ++i) EXPECT_EQ(positions[i], i);
  EXPECT_EQ(seen, seq->keys0);  // the F32 KV dtype: bit for bit
  e->decoder().Forget(seq.get());
}

TEST_F(EvalTest, HiddenDeltaReachesThePoliciesForEveryTokenWhereverItWasComputed) {
  std::unique_ptr<Engine> chunked = Open(16), whole = Open(256);
  ASSERT_NE(chunked, nullptr);
  ASSERT_NE(whole, nullptr);
  const std::vector<int32_t> ids = Text(*whole, 41);
  std::vector<float> logits;
  // 40 prompt tokens in chunks of 16 (boundaries at 16 and 32), then one decode step.
  std::unique_ptr<RecordingSequence> a = NewSequence(*chunked);
  ASSERT_TRUE(chunked->decoder().Prefill(*a, {ids.begin(), ids.begin() + 40}, &logits).ok());
  ASSERT_TRUE(chunked->decoder().Step({a.get()}, {ids[40]}, &logits).ok());
  // All 41 tokens as one prompt chunk.
  std::unique_ptr<RecordingSequence> b = NewSequence(*whole);
  ASSERT_TRUE(whole->decoder().Prefill(*b, ids, &logits).ok());
  const int32_t n_layers = whole->config().layers;
  ASSERT_EQ(a->layers, n_layers);
  ASSERT_EQ(a->delta.size(), 41u * n_layers);
  ASSERT_EQ(b->delta.size(), 41u * n_layers);
  for (int32_t l = 0; l < n_layers; ++l) {
    EXPECT_EQ(a->delta[l], 0.0f) << "the first token has no previous hidden state";
    EXPECT_EQ(b->delta[l], 0.0f);
  }
  for (size_t i = n_layers; i < a->delta.size(); ++i) {
    ASSERT_TRUE(std::isfinite(a->delta[i]) && a->delta[i] > 0) << "token " << i / n_layers;
    // Chunk boundaries (16, 32) and the decode step (40) give what one chunk gives.
    EXPECT_NEAR(a->delta[i], b->delta[i], 1e-3 * b->delta[i] + 1e-4)
        << "token " << i / n_layers << " layer " << i % n_layers;
  }
  chunked->decoder().Forget(a.get());
  whole->decoder().Forget(b.get());
}

TEST_F(EvalTest, RunEvalHoldsTheRelationsItsMetricsMust) {
  std::unique_ptr<Engine> e = Open(256);
  ASSERT_NE(e, nullptr);
  const std::vector<int32_t> ids = Text(*e, 200);
  EvalOptions o;
  o.prefill_tokens = 160;
  o.steps = 24;
  o.page_size = 16;
  o.budgets = {64};
  o.recall_every = 3;
  auto variant = [](const std::string& name, RetrievalMode mode, float tau) {
    EvalVariant v;
    v.name = name;
    v.options.mode = mode;
    v.options.correction_threshold = tau;
    return v;
  };
  const std::vector<EvalVariant> variants = {
      variant("sync", RetrievalMode::kSync, 0.9f),
      variant("always", RetrievalMode::kSpeculative, 2.0f),  // corrects every head
      variant("never", RetrievalMode::kSpeculative, -2.0f),
      variant("window", RetrievalMode::kDrop, 0.9f)};
  absl::StatusOr<std::vector<EvalResult>> rs = RunEval(*e, ids, o, variants);
  ASSERT_TRUE(rs.ok()) << rs.status();
  ASSERT_EQ(rs->size(), 5u);
  const EvalResult& full = (*rs)[0];
  const EvalResult &sync = (*rs)[1], &always = (*rs)[2], &never = (*rs)[3], &window = (*rs)[4];
  EXPECT_EQ(full.variant, "full");
  EXPECT_EQ(full.steps, 24);
  EXPECT_EQ(full.recall_steps, 8);
  EXPECT_DOUBLE_EQ(full.top1_agreement, 1.0);
  EXPECT_NEAR(full.kl, 0.0, 1e-9);
  EXPECT_NEAR(full.recall_tokens, 1.0, 1e-9);
  EXPECT_NEAR(full.recall_pages, 1.0, 1e-9);
  EXPECT_GT(full.perplexity, 1.0);
  EXPECT_LT(full.perplexity, 4096.0);
  ASSERT_EQ(full.layer_recall_tokens.size(), static_cast<size_t>(e->config().layers));
  // Correcting every head before attention selects with q_t, as sync mode does.
  EXPECT_DOUBLE_EQ(always.correction_rate, 1.0);
  EXPECT_NEAR(always.perplexity, sync.perplexity, 1e-6 * sync.perplexity);
  EXPECT_NEAR(always.recall_pages, sync.recall_pages, 1e-9);
  EXPECT_EQ(never.corrected_heads, 0);
  EXPECT_GT(never.checked_heads, 0);
  for (const EvalResult& r : {sync, always, never, window}) {
    EXPECT_EQ(r.budget_tokens, 64);
    EXPECT_GE(r.kl, 0.0);
    EXPECT_GE(r.recall_tokens, 0.0);
    EXPECT_LE(r.recall_tokens, 1.0);
    EXPECT_GE(r.recall_pages, 0.0);
    EXPECT_LE(r.recall_pages, 1.0);
  }
  // 64 of 160+ tokens cannot hold all of the oracle's top-64 mass in every head.
  EXPECT_LT(window.recall_tokens, 1.0);
  EXPECT_LT(sync.recall_tokens, 1.0);
  EXPECT_EQ(window.recalled_bytes_per_token, 0.0);
  EXPECT_GT(sync.recalled_bytes_per_token, 0.0);
  EXPECT_GT(window.kl, 0.0);
  // Bad options name the flag.
  o.budgets = {100};
  absl::StatusOr<std::vector<EvalResult>> bad = RunEval(*e, ids, o, variants);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--budgets 100"), std::string::npos) << bad.status();
  o.budgets = {64};
  o.steps = 100;
  bad = RunEval(*e, ids, o, variants);
  EXPECT_NE(bad.status().message().find("needs 261"), std::string::npos) << bad.status();
}

// A variant whose run fails is a result with its status, where it would have been; the
// runs before and after it are scored as if it were not there. Drop mode has no host tier,
// so a policy that drops host pages is refused when the sequence opens: a real failure.
TEST_F(EvalTest, AFailedRunIsItsOwnResultAndTheOthersStillRun) {
  std::unique_ptr<Engine> e = Open(256);
  ASSERT_NE(e, nullptr);
  const std::vector<int32_t> ids = Text(*e, 200);
  EvalOptions o;
  o.prefill_tokens = 160;
  o.steps = 8;
  o.page_size = 16;
  o.budgets = {64};
  std::vector<EvalVariant> variants(3);
  variants[0].name = "window";
  variants[0].options.mode = RetrievalMode::kDrop;
  variants[1].name = "impossible";
  variants[1].options.mode = RetrievalMode::kDrop;
  variants[1].options.policy.residency = "h2o";
  variants[1].options.policy.host_drop = "evict";
  variants[2].name = "sync";
  variants[2].options.mode = RetrievalMode::kSync;
  std::vector<std::string> started;
  absl::StatusOr<std::vector<EvalResult>> rs =
      RunEval(*e, ids, o, variants, [&](const std::string& run, int64_t done, int64_t) {
        if (done == 0) started.push_back(run);
      });
  ASSERT_TRUE(rs.ok()) << rs.status();
  ASSERT_EQ(rs->size(), 4u);
  EXPECT_EQ(started, (std::vector<std::string>{"full", "window@64", "impossible@64", "sync@64"}));
  const EvalResult& failed = (*rs)[2];
  EXPECT_EQ(failed.variant, "impossible");
  EXPECT_EQ(failed.budget_tokens, 64);
  EXPECT_EQ(failed.mode, RetrievalMode::kDrop);
  EXPECT_TRUE(absl::IsInvalidArgument(failed.status)) << failed.status;
  EXPECT_NE(failed.status.message().find("no host tier"), std::string::npos) << failed.status;
  for (size_t i : {0, 1, 3}) {
    const EvalResult& r = (*rs)[i];
    EXPECT_TRUE(r.status.ok()) << r.variant << ": " << r.status;
    EXPECT_EQ(r.steps, 8) << r.variant;
    EXPECT_GT(r.perplexity, 1.0) << r.variant;
  }
  EXPECT_EQ((*rs)[1].variant, "window");
  EXPECT_EQ((*rs)[3].variant, "sync");
}

}  // namespace
}  // namespace kvtier::engine
