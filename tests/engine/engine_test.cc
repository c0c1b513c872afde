// The decoder against the training script's own forward pass (engine/model/train.py writes
// golden/: the prompt, its token ids, the greedy continuation and the logits at the last
// prompt position and every 4th generated step, from the F16-rounded weights it exports),
// in kvtier's full mode, in the dense loop, batched, and with a working set smaller than the
// cache. Parameterised over the devices in the build: CPU always; CUDA with a GPU (the
// `gpu`-labelled ctest entry).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "engine/generate.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine/golden.h"

namespace kvtier::engine {
namespace {

using testing::Golden;
using testing::LoadGolden;
using testing::ModelDir;

// max |a − b| over max(1, max |b|): the logits' error relative to their scale.
double RelMaxError(const float* a, const float* b, int32_t n) {
  double err = 0, scale = 1;
  for (int32_t i = 0; i < n; ++i) {
    err = std::max(err, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return err / scale;
}

class EngineTest : public ::testing::TestWithParam<DeviceKind> {
 protected:
  void SetUp() override {
    if (GetParam() == DeviceKind::kCuda && CudaDeviceCount() == 0) {
      GTEST_SKIP() << "no usable CUDA device";
    }
    golden_ = LoadGolden();
    ASSERT_FALSE(golden_.prompt_ids.empty()) << "no golden reference in " << ModelDir();
  }

  std::unique_ptr<Engine> Open(DType kv_dtype, int32_t max_batch = 4) {
    EngineOptions o;
    o.model_path = ModelDir() + "/kvtier-tiny.gguf";
    o.device = GetParam();
    o.threads = 2;
    o.decoder.kv_dtype = kv_dtype;
    o.decoder.max_batch = max_batch;
    o.decoder.prefill_chunk = 128;  // the golden prompt spans several chunks
    absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Open(o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? *std::move(e) : nullptr;
  }

  static SequenceSpec Spec(RetrievalMode mode, int32_t budget) {
    SequenceSpec spec;
    spec.options.mode = mode;
    if (budget > 0) {
      EXPECT_TRUE(spec.options.SetBudgetTokens(budget, spec.page_size).ok());
    }
    spec.options.max_tokens = 1024;
    spec.options.recall = RecallStrategy::kZeroCopy;  // as a batch recalls
    return spec;
  }
  std::unique_ptr<EngineSequence> OpenSequence(Engine& e, RetrievalMode mode, int32_t budget = 0,
                                               SequenceBatch* batch = nullptr) {
    absl::StatusOr<std::unique_ptr<EngineSequence>> s =
        EngineSequence::Open(e, Spec(mode, budget), nullptr, batch);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }

  // Greedy tokens equal to the reference, and logits within `tol` at every golden step.
  void ExpectMatchesGolden(const GenerateResult& r, double tol) {
    const size_t n = golden_.greedy_ids.size();
    ASSERT_GE(r.tokens.size(), n);
    EXPECT_EQ(std::vector<int32_t>(r.tokens.begin(), r.tokens.begin() + n), golden_.greedy_ids);
    for (size_t i = 0; i < golden_.logit_steps.size(); ++i) {
      const size_t step = golden_.logit_steps[i];
      ASSERT_LT(step, r.logits.size());
      const double err =
          RelMaxError(r.logits[step].data(), golden_.logits.data() + i * golden_.vocab, golden_.vocab);
      EXPECT_LE(err, tol) << "step " << step;
    }
  }

  GenerateOptions GoldenOptions() const {
    GenerateOptions g;
    g.max_new_tokens = static_cast<int32_t>(golden_.greedy_ids.size()) + 1;
    g.stop_at_eos = false;
    g.keep_logits = true;
    return g;
  }

  Golden golden_;
};

// The tolerance of the F32 paths: the script and the engine differ only in summation order
// (torch's matmuls, OpenBLAS's or cuBLAS's, the attention's softmax).
constexpr double kF32Tolerance = 1e-3;

TEST_P(EngineTest, TokenizerMatchesTheTrainingScript) {
  std::unique_ptr<Engine> e = Open(DType::kF32);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->tokenizer().Encode(golden_.prompt), golden_.prompt_ids);
  EXPECT_EQ(e->tokenizer().Decode(golden_.prompt_ids), golden_.prompt);
}

TEST_P(EngineTest, FullModeReproducesTheReference) {
  std::unique_ptr<Engine> e = Open(DType::kF32);
  ASSERT_NE(e, nullptr);
  std::unique_ptr<EngineSequence> s = OpenSequence(*e, RetrievalMode::kFull);
  ASSERT_NE(s, nullptr);
  absl::StatusOr<std::vector<GenerateResult>> r =
      Generate(*e, {&s->sequence()}, {golden_.prompt_ids}, GoldenOptions());
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectMatchesGolden((*r)[0], kF32Tolerance);
  // Every token of the sequence went through kvtier: prompt, then one per decode step.
  EXPECT_EQ(s->sequence().num_tokens(0),
            static_cast<int32_t>(golden_.prompt_ids.size() + golden_.greedy_ids.size()));
  EXPECT_TRUE(s->Close().ok());
}

TEST_P(EngineTest, DenseLoopReproducesTheReference) {
  std::unique_ptr<Engine> e = Open(DType::kF32);
  ASSERT_NE(e, nullptr);
  absl::StatusOr<GenerateResult> r = GenerateDense(*e, golden_.prompt_ids, GoldenOptions());
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectMatchesGolden(*r, kF32Tolerance);
}

TEST_P(EngineTest, Fp16KvStaysCloseToTheReference) {
  std::unique_ptr<Engine> e = Open(DType::kF16);
  ASSERT_NE(e, nullptr);
  std::unique_ptr<EngineSequence> s = OpenSequence(*e, RetrievalMode::kFull);
  ASSERT_NE(s, nullptr);
  // Teacher-forced on the reference's tokens is not what Generate does; the free-running
  // greedy text is compared token by token up to the first difference instead, and the
  // step-0 logits (prefill attention reads F32 K/V) exactly as the F32 path.
  absl::StatusOr<std::vector<GenerateResult>> r =
      Generate(*e, {&s->sequence()}, {golden_.prompt_ids}, GoldenOptions());
  ASSERT_TRUE(r.ok()) << r.status();
  const GenerateResult& g = (*r)[0];
  EXPECT_LE(RelMaxError(g.logits[0].data(), golden_.logits.data(), golden_.vocab), kF32Tolerance);
  size_t same = 0;
  while (same < golden_.greedy_ids.size() && g.tokens[same] == golden_.greedy_ids[same]) ++same;
  EXPECT_GE(same, 16u) << "fp16 KV diverged from the reference after " << same << " tokens";
  EXPECT_TRUE(s->Close().ok());
}

TEST_P(EngineTest, BatchedDecodeEqualsOneByOne) {
  std::unique_ptr<Engine> e = Open(DType::kF32, /*max_batch=*/3);
  ASSERT_NE(e, nullptr);
  // Three prompts of different lengths (so different positions in each step).
  std::vector<std::vector<int32_t>> prompts;
  for (size_t len : {golden_.prompt_ids.size(), golden_.prompt_ids.size() / 2, size_t{40}}) {
    prompts.emplace_back(golden_.prompt_ids.begin(), golden_.prompt_ids.begin() + len);
  }
  GenerateOptions g;
  g.max_new_tokens = 12;
  g.stop_at_eos = false;
  g.keep_logits = true;
  std::vector<std::unique_ptr<EngineSequence>> owned;
  std::vector<Sequence*> seqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    owned.push_back(OpenSequence(*e, RetrievalMode::kFull));
    ASSERT_NE(owned.back(), nullptr);
    seqs.push_back(&owned.back()->sequence());
  }
  absl::StatusOr<std::vector<GenerateResult>> batched = Generate(*e, seqs, prompts, g);
  ASSERT_TRUE(batched.ok()) << batched.status();
  EXPECT_EQ((*batched)[0].decode_steps, g.max_new_tokens - 1);  // one batched step per token
  for (size_t i = 0; i < prompts.size(); ++i) {
    std::unique_ptr<EngineSequence> s = OpenSequence(*e, RetrievalMode::kFull);
    ASSERT_NE(s, nullptr);
    absl::StatusOr<std::vector<GenerateResult>> one = Generate(*e, {&s->sequence()}, {prompts[i]}, g);
    ASSERT_TRUE(one.ok()) << one.status();
    EXPECT_EQ((*batched)[i].tokens, (*one)[0].tokens) << "prompt " << i;
    for (size_t t = 0; t < (*one)[0].logits.size(); ++t) {
      EXPECT_LE(RelMaxError((*batched)[i].logits[t].data(), (*one)[0].logits[t].data(),
                            e->config().vocab),
                kF32Tolerance)
          << "prompt " << i << " step " << t;
    }
  }
}

// The decoder steps the members of a SequenceBatch together (one launch of each op per layer
// for the batch): the same tokens, bit-identical logits and the same retrieval statistics as
// the same prompts decoded as separate sequences in one decoder batch (same arithmetic), in
// speculative mode with a working set smaller than the prompts.
TEST_P(EngineTest, SequenceBatchDecodesAsSeparateSequences) {
  std::unique_ptr<Engine> e = Open(DType::kF16, /*max_batch=*/3);
  ASSERT_NE(e, nullptr);
  constexpr int32_t kBudget = 128;
  std::vector<std::vector<int32_t>> prompts;
  for (size_t len : {golden_.prompt_ids.size(), golden_.prompt_ids.size() * 2 / 3, size_t{300}}) {
    prompts.emplace_back(golden_.prompt_ids.begin(), golden_.prompt_ids.begin() + len);
  }
  GenerateOptions g;
  g.max_new_tokens = 10;
  g.stop_at_eos = false;
  g.keep_logits = true;
  absl::StatusOr<std::unique_ptr<SequenceBatch>> batch =
      EngineBatch(*e, Spec(RetrievalMode::kSpeculative, kBudget), 3);
  ASSERT_TRUE(batch.ok()) << batch.status();
  std::vector<std::unique_ptr<EngineSequence>> members, separate;
  std::vector<Sequence*> in_batch, apart;
  for (size_t i = 0; i < prompts.size(); ++i) {
    members.push_back(OpenSequence(*e, RetrievalMode::kSpeculative, kBudget, batch->get()));
    separate.push_back(OpenSequence(*e, RetrievalMode::kSpeculative, kBudget));
    ASSERT_NE(members.back(), nullptr);
    ASSERT_NE(separate.back(), nullptr);
    ASSERT_EQ(members.back()->sequence().local()->batch(), batch->get());
    // A sequence made alone is the one member of its own batch of one.
    SequenceBatch* own = separate.back()->sequence().local()->batch();
    ASSERT_NE(own, nullptr);
    ASSERT_NE(own, batch->get());
    ASSERT_EQ(own->max_batch(), 1);
    in_batch.push_back(&members.back()->sequence());
    apart.push_back(&separate.back()->sequence());
  }
  absl::StatusOr<std::vector<GenerateResult>> batched = Generate(*e, in_batch, prompts, g);
  ASSERT_TRUE(batched.ok()) << batched.status();
  absl::StatusOr<std::vector<GenerateResult>> loose = Generate(*e, apart, prompts, g);
  ASSERT_TRUE(loose.ok()) << loose.status();
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ((*batched)[i].tokens, (*loose)[i].tokens) << "prompt " << i;
    EXPECT_EQ((*batched)[i].logits, (*loose)[i].logits) << "prompt " << i;
    const SequenceStats a = in_batch[i]->Stats(), b = apart[i]->Stats();
    EXPECT_GT(a.checked_heads, 0) << "prompt " << i;  // speculative steps did run
    EXPECT_EQ(a.recalled_pages, b.recalled_pages) << "prompt " << i;
    EXPECT_EQ(a.corrected_heads, b.corrected_heads) << "prompt " << i;
  }
}

TEST_P(EngineTest, SparseModesHoldTheBudgetAndGenerate) {
  std::unique_ptr<Engine> e = Open(DType::kF16);
  ASSERT_NE(e, nullptr);
  const int32_t budget = 128;  // 4 pages of 32: well below the golden prompt
  ASSERT_GT(golden_.prompt_ids.size(), 4u * budget / 2);
  for (RetrievalMode mode : {RetrievalMode::kSync, RetrievalMode::kSpeculative, RetrievalMode::kDrop}) {
    SCOPED_TRACE(std::string(RetrievalModeName(mode)));
    std::unique_ptr<EngineSequence> s = OpenSequence(*e, mode, budget);
    ASSERT_NE(s, nullptr);
    GenerateOptions g;
    g.max_new_tokens = 24;
    g.stop_at_eos = false;
    absl::StatusOr<std::vector<GenerateResult>> r =
        Generate(*e, {&s->sequence()}, {golden_.prompt_ids}, g);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ((*r)[0].tokens.size(), 24u);
    const SequenceStats st = s->sequence().Stats();
    const LlamaConfig& c = e->config();
    // The working set of every layer holds at most the budget's pages per KV head.
    const int64_t budget_bytes = int64_t{c.layers} * c.kv_heads * budget * c.head_dim * 2 * 2;
    EXPECT_GT(st.resident_bytes, 0);
    EXPECT_LE(st.resident_bytes, budget_bytes);
    EXPECT_EQ(st.steps, int64_t{c.layers} * 23);
    if (mode == RetrievalMode::kSpeculative) {
      EXPECT_GT(st.checked_heads, 0);
    }
    EXPECT_TRUE(s->Close().ok());
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, EngineTest, ::testing::Values(DeviceKind::kCpu, DeviceKind::kCuda),
                         [](const ::testing::TestParamInfo<DeviceKind>& i) {
                           return i.param == DeviceKind::kCpu ? std::string("Cpu") : std::string("Cuda");
                         });

}  // namespace
}  // namespace kvtier::engine
