// kvtier-run eval's retrieval tasks (engine/eval_tasks.h) and the recorded prefill they
// share between variants (Decoder's PrefillRecord), on the project's model: a replayed
// prefill hands a sequence exactly what the prefill did, so every variant decodes as if it
// had run the prompt itself; needle prompts are what they claim (length, depth, key, the
// model's own tokens); the tasks have a cell per run and prompt, and full mode answers and
// scores as the dense decoder does.
#include "engine/eval_tasks.h"

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/eval.h"
#include "engine/eval_metrics.h"
#include "engine/generate.h"
#include "gtest/gtest.h"
#include "tests/engine/golden.h"

namespace kvtier::engine {
namespace {

class EvalTasksTest : public ::testing::Test {
 protected:
  void SetUp() override {
    EngineOptions o;
    o.model_path = testing::ModelDir() + "/kvtier-tiny.gguf";
    o.threads = 2;
    o.decoder.prefill_chunk = 128;  // prompts span several chunks
    absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Open(o);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = *std::move(e);
    text_ = engine_->tokenizer().Encode(testing::ReadAll(testing::ModelDir() + "/golden/eval.txt"),
                                        /*add_special=*/false);
  }

  std::unique_ptr<EngineSequence> Open(const EvalVariant& v, int32_t budget, int32_t max_tokens) {
    SequenceSpec spec;
    spec.options = v.options;
    spec.options.max_tokens = max_tokens;
    if (budget > 0) {
      EXPECT_TRUE(spec.options.SetBudgetTokens(budget, spec.page_size).ok());
    }
    absl::StatusOr<std::unique_ptr<EngineSequence>> s =
        EngineSequence::Open(*engine_, spec, nullptr);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }

  // Prefills `prompt` (through `record` when given), then decodes `steps` greedy tokens:
  // the logits of every step, and the sequence's statistics.
  std::vector<std::vector<float>> Decode(Sequence& seq, const std::vector<int32_t>& prompt,
                                         PrefillRecord* record, int steps, SequenceStats* stats) {
    Decoder& dec = engine_->decoder();
    std::vector<std::vector<float>> out(1);
    EXPECT_TRUE(dec.Prefill(seq, prompt, &out[0], {}, record).ok());
    for (int i = 0; i < steps; ++i) {
      std::vector<float> logits;
      const int32_t next = static_cast<int32_t>(
          std::max_element(out.back().begin(), out.back().end()) - out.back().begin());
      absl::Status st = dec.Step({&seq}, {next}, &logits);
      EXPECT_TRUE(st.ok()) << st;
      if (!st.ok()) break;
      out.push_back(std::move(logits));
    }
    EXPECT_TRUE(seq.Wait().ok());
    *stats = seq.Stats();
    return out;
  }

  static EvalVariant Variant(const std::string& name, RetrievalMode mode,
                             const std::string& residency = "", const std::string& budget = "") {
    EvalVariant v;
    v.name = name;
    v.options.mode = mode;
    if (!residency.empty()) v.options.policy.residency = residency;
    if (!budget.empty()) v.options.policy.budget = budget;
    return v;
  }

  std::unique_ptr<Engine> engine_;
  std::vector<int32_t> text_;
};

// For each kind of sequence — speculative (selection from summaries), H2O (reads the
// prompt's observed queries and attention) and EpiKV (reads the hidden-state changes) — a
// sequence prefilled from a record decodes exactly as the one that recorded it and as one
// prefilled without a record.
TEST_F(EvalTasksTest, AReplayedPrefillDecodesExactlyAsTheRecordedOne) {
  std::vector<int32_t> prompt(text_.begin(), text_.begin() + 700);
  prompt.insert(prompt.begin(), engine_->tokenizer().bos());
  for (const EvalVariant& v :
       {Variant("speculative", RetrievalMode::kSpeculative),
        Variant("h2o", RetrievalMode::kDrop, "h2o"),
        Variant("epikv", RetrievalMode::kDrop, "epiphany"),
        Variant("conf-kv", RetrievalMode::kDrop, "attention", "confidence")}) {
    SCOPED_TRACE(v.name);
    PrefillRecord record;
    SequenceStats s_rec, s_replay, s_plain;
    auto a = Open(v, 128, 1024), b = Open(v, 128, 1024), c = Open(v, 128, 1024);
    ASSERT_TRUE(a && b && c);
    const auto recorded = Decode(a->sequence(), prompt, &record, 24, &s_rec);
    ASSERT_FALSE(record.empty());
    EXPECT_EQ(record.ids(), prompt);
    const auto replayed = Decode(b->sequence(), prompt, &record, 24, &s_replay);
    const auto plain = Decode(c->sequence(), prompt, nullptr, 24, &s_plain);
    ASSERT_EQ(recorded.size(), 25u);
    EXPECT_EQ(replayed, recorded);
    EXPECT_EQ(plain, recorded);
    EXPECT_EQ(s_replay.evicted_head_pages, s_rec.evicted_head_pages);
    EXPECT_EQ(s_replay.corrected_heads, s_rec.corrected_heads);
    EXPECT_EQ(s_replay.recalled_bytes, s_rec.recalled_bytes);
    for (auto* s : {a.get(), b.get(), c.get()}) EXPECT_TRUE(s->Close().ok());
  }
}

TEST_F(EvalTasksTest, ARecordRefusesAnotherPrompt) {
  const EvalVariant full = Variant("full", RetrievalMode::kFull);
  PrefillRecord record;
  auto a = Open(full, 0, 1024), b = Open(full, 0, 1024);
  std::vector<float> logits;
  std::vector<int32_t> p1(text_.begin(), text_.begin() + 100),
      p2(text_.begin() + 1, text_.begin() + 101);
  ASSERT_TRUE(engine_->decoder().Prefill(a->sequence(), p1, &logits, {}, &record).ok());
  const absl::Status st = engine_->decoder().Prefill(b->sequence(), p2, &logits, {}, &record);
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_EQ(b->sequence().num_tokens(0), 0) << "nothing appended";
  EXPECT_EQ(record.ids(), p1);
}

TEST_F(EvalTasksTest, NeedlePromptsAreWhatTheyClaim) {
  const Tokenizer& tok = engine_->tokenizer();
  std::mt19937_64 rng(7);
  for (NeedleKind kind : {NeedleKind::kSingle, NeedleKind::kMultiKey}) {
    for (double depth : {0.0, 0.25, 0.5, 1.0}) {
      SCOPED_TRACE(std::string(NeedleKindName(kind)) + " at " + std::to_string(depth));
      absl::StatusOr<NeedlePrompt> p = BuildNeedlePrompt(tok, text_, 1000, depth, kind, rng);
      ASSERT_TRUE(p.ok()) << p.status();
      EXPECT_EQ(p->context.size() + p->question.size(), 1000u);
      EXPECT_EQ(p->context.front(), tok.bos());
      EXPECT_GE(p->key.size(), 5u);
      EXPECT_LE(p->key.size(), 7u);
      EXPECT_NE(p->key[0], '0');
      const std::string needle_text = tok.Decode(
          std::vector<int32_t>(p->context.begin() + p->needle_position, p->context.end()));
      const std::string expected = kind == NeedleKind::kSingle
                                       ? " The pass key is " + p->key + ". Remember it."
                                       : " The pass key of ";
      EXPECT_EQ(needle_text.substr(0, expected.size()), expected);
      if (kind == NeedleKind::kMultiKey) {
        EXPECT_NE(needle_text.find(" is " + p->key + "."), std::string::npos);
        // The question names the asked needle's name.
        const std::string name =
            needle_text.substr(expected.size(), needle_text.find(" is ") - expected.size());
        EXPECT_NE(tok.Decode(p->question).find("of " + name + "?"), std::string::npos);
      }
      // The needle lies at its depth of the filler: exactly for one needle, give or take the
      // other needles that may come before it for several.
      if (kind == NeedleKind::kSingle) {
        const int64_t needle = tok.Encode(" The pass key is " + p->key + ". Remember it. " +
                                              p->key + " is the pass key.",
                                          false)
                                   .size();
        const int64_t fill = static_cast<int64_t>(p->context.size()) - 1 - needle;
        EXPECT_EQ(p->needle_position - 1, static_cast<int64_t>(depth * fill));
      } else {
        EXPECT_NEAR(static_cast<double>(p->needle_position - 1) / p->context.size(), depth, 0.1);
      }
      EXPECT_EQ(tok.Decode(p->question).substr(0, 9), " What is ");
    }
  }
  EXPECT_TRUE(absl::IsInvalidArgument(
      BuildNeedlePrompt(tok, text_, 20, 0.5, NeedleKind::kSingle, rng).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      BuildNeedlePrompt(tok, std::vector<int32_t>(text_.begin(), text_.begin() + 500), 1000, 0.5,
                        NeedleKind::kSingle, rng)
          .status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      BuildNeedlePrompt(tok, text_, 1000, 1.5, NeedleKind::kSingle, rng).status()));
}

TEST_F(EvalTasksTest, AMultiValueNeedleStatesFourKeysOfOneNameAndAsksForAll) {
  const Tokenizer& tok = engine_->tokenizer();
  std::mt19937_64 rng(11);
  absl::StatusOr<NeedlePrompt> p =
      BuildNeedlePrompt(tok, text_, 1500, 0.3, NeedleKind::kMultiValue, rng);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->context.size() + p->question.size(), 1500u);
  ASSERT_EQ(p->keys.size(), 4u);
  EXPECT_EQ(p->keys[0], p->key);
  const std::string context = tok.Decode(p->context);
  const std::string question = tok.Decode(p->question);
  const std::string name =
      question.substr(std::string(" What are all the pass keys of ").size(),
                      question.find('?') - std::string(" What are all the pass keys of ").size());
  for (const std::string& k : p->keys) {
    EXPECT_EQ(std::count(p->keys.begin(), p->keys.end(), k), 1) << "distinct keys";
    EXPECT_NE(context.find(" One of the pass keys of " + name + " is " + k + "."),
              std::string::npos)
        << k;
  }
  const std::string all =
      " " + p->keys[2] + ", " + p->keys[0] + ", " + p->keys[3] + " and " + p->keys[1] + ".";
  EXPECT_TRUE(AnswerIsRight(*p, NeedleKind::kMultiValue, all));
  EXPECT_FALSE(
      AnswerIsRight(*p, NeedleKind::kMultiValue, " " + p->keys[0] + ", " + p->keys[1] + "."));
  EXPECT_FALSE(AnswerIsRight(*p, NeedleKind::kMultiValue,
                             " " + p->keys[0] + p->keys[1] + p->keys[2] + p->keys[3]));
  // Single and multi-key needles are right on their one key only.
  NeedlePrompt one;
  one.key = "48291";
  one.keys = {"48291"};
  EXPECT_TRUE(AnswerIsRight(one, NeedleKind::kSingle, " 48291."));
  EXPECT_FALSE(AnswerIsRight(one, NeedleKind::kSingle, " 482913."));
  EXPECT_FALSE(AnswerIsRight(one, NeedleKind::kMultiKey, " the 48291"));
}

TEST(AnswerKeyTest, TakesTheLeadingDigits) {
  EXPECT_EQ(AnswerKey(" 482913."), "482913");
  EXPECT_EQ(AnswerKey("482913"), "482913");
  EXPECT_EQ(AnswerKey("  4829 13"), "4829");
  EXPECT_EQ(AnswerKey(" the"), "");
  EXPECT_EQ(AnswerKey(""), "");
}

TEST(BudgetTokensTest, RoundsToTheNearestUnitOfFourPages) {
  // A needle prompt of 4,080 tokens (the context less room for the answer), pages of 32:
  // 1/32, 1/16, 1/8 and 1/4 are 128, 256, 512 and 1,024 tokens, not 128, 128, 384 and 896.
  EXPECT_EQ(BudgetTokens(4080, 32, 32), 128);
  EXPECT_EQ(BudgetTokens(4080, 16, 32), 256);
  EXPECT_EQ(BudgetTokens(4080, 8, 32), 512);
  EXPECT_EQ(BudgetTokens(4080, 4, 32), 1024);
  EXPECT_EQ(BudgetTokens(4096, 16, 32), 256);
  EXPECT_EQ(BudgetTokens(1000, 64, 32), 128);  // at least one unit
  EXPECT_EQ(BudgetTokens(4096, 0, 32), 0);     // full KV
}

TEST_F(EvalTasksTest, NiahHasACellPerRunAndPromptAndFullModeAnswersAsTheDenseDecoder) {
  NiahOptions o;
  o.contexts = {1024};
  o.depths = 3;
  o.trials = 2;
  o.kinds = {NeedleKind::kSingle};
  o.task.budget_divisors = {8};
  const std::vector<EvalVariant> variants = {Variant("window", RetrievalMode::kDrop),
                                             Variant("speculative", RetrievalMode::kSpeculative)};
  int64_t last_done = 0;
  absl::StatusOr<std::vector<NiahCell>> cells =
      RunNiah(*engine_, text_, o, variants, [&](const std::string&, int64_t done, int64_t total) {
        EXPECT_EQ(total, 6);
        last_done = done;
      });
  ASSERT_TRUE(cells.ok()) << cells.status();
  EXPECT_EQ(last_done, 6);
  ASSERT_EQ(cells->size(), 3u * 3u);  // (full, window@1/8, speculative@1/8) × 3 depths
  for (const NiahCell& c : *cells) {
    SCOPED_TRACE(c.variant + " at depth " + std::to_string(c.depth));
    EXPECT_TRUE(c.status.ok()) << c.status;
    EXPECT_EQ(c.trials, 2);
    EXPECT_EQ(c.context, 1024);
    EXPECT_EQ(c.budget_tokens, c.variant == "full" ? 0 : 128);
    EXPECT_FALSE(c.last_answer.empty());
    // Every wrong trial is listed once, in order, with the key it was asked for.
    EXPECT_EQ(static_cast<int32_t>(c.misses.size()), c.trials - c.correct);
    for (size_t i = 0; i < c.misses.size(); ++i) {
      EXPECT_FALSE(c.misses[i].key.empty());
      EXPECT_NE(AnswerKey(c.misses[i].answer), c.misses[i].key);
      if (i > 0) {
        EXPECT_GT(c.misses[i].trial, c.misses[i - 1].trial);
      }
    }
  }
  // The window at 1/8 of a 1,024-token prompt misses the needles outside it: the test sees
  // misses, not only hits.
  int32_t window_misses = 0;
  for (const NiahCell& c : *cells) window_misses += c.variant == "window" ? c.misses.size() : 0;
  EXPECT_GT(window_misses, 0);
  EXPECT_EQ((*cells)[0].variant, "full");
  EXPECT_EQ((*cells)[3].variant, "window");
  EXPECT_DOUBLE_EQ((*cells)[2].depth, 1.0);
  // Full mode's answer is the dense decoder's greedy continuation of the same prompt (the
  // last prompt of the last depth: the prompts are drawn in order from the seed), up to the
  // answer's length.
  std::mt19937_64 rng(o.task.seed);
  absl::StatusOr<NeedlePrompt> p;
  for (int i = 0; i < 6; ++i) {
    p = BuildNeedlePrompt(engine_->tokenizer(), text_, 1024, (*cells)[i / 2].depth,
                          NeedleKind::kSingle, rng);
    ASSERT_TRUE(p.ok()) << p.status();
  }
  std::vector<int32_t> prompt = p->context;
  prompt.insert(prompt.end(), p->question.begin(), p->question.end());
  GenerateOptions g;
  g.max_new_tokens = 12;
  absl::StatusOr<GenerateResult> dense = GenerateDense(*engine_, prompt, g);
  ASSERT_TRUE(dense.ok()) << dense.status();
  const std::string expected = engine_->tokenizer().Decode(dense->tokens);
  const std::string& got = (*cells)[2].last_answer;
  EXPECT_EQ(expected.substr(0, got.size()), got);
}

TEST_F(EvalTasksTest, CopyScoresTheRepeatAndFullModeScoresItAsTheDenseDecoder) {
  CopyOptions o;
  o.distances = {300, 900};
  o.passage = 64;
  o.context = 1024;
  o.trials = 1;
  o.task.budget_divisors = {8};
  absl::StatusOr<std::vector<CopyCell>> cells =
      RunCopy(*engine_, text_, o, {Variant("window", RetrievalMode::kDrop)});
  ASSERT_TRUE(cells.ok()) << cells.status();
  ASSERT_EQ(cells->size(), 4u);  // (full, window@1/8) × 2 distances
  for (const CopyCell& c : *cells) {
    EXPECT_TRUE(c.status.ok()) << c.status;
    EXPECT_EQ(c.trials, 1);
    EXPECT_GT(c.first_loss, 0);
    EXPECT_GT(c.repeat_loss, 0);
  }
  EXPECT_EQ((*cells)[2].budget_tokens, 128);  // 1/8 of the 1,024-token context
  // The first occurrence is scored once, the same for every run.
  EXPECT_EQ((*cells)[0].first_loss, (*cells)[2].first_loss);
  EXPECT_EQ((*cells)[1].first_loss, (*cells)[3].first_loss);
  // The window sees less than full KV: its loss on the repeat differs.
  EXPECT_NE((*cells)[2].repeat_loss, (*cells)[0].repeat_loss);
  // Full mode's loss on the repeat is the dense decoder's on the same prompt (the prompts are
  // drawn in order from the seed).
  std::mt19937_64 rng(o.task.seed);
  for (size_t d = 0; d < o.distances.size(); ++d) {
    absl::StatusOr<CopyPrompt> cp =
        BuildCopyPrompt(engine_->tokenizer(), text_, 1024, o.distances[d], o.passage, rng);
    ASSERT_TRUE(cp.ok()) << cp.status();
    EXPECT_EQ(cp->context.size() + cp->passage.size(), 1024u);
    absl::StatusOr<std::unique_ptr<DenseKv>> kv =
        DenseKv::Create(engine_->config(), engine_->device(), 1024);
    ASSERT_TRUE(kv.ok());
    std::vector<float> logits;
    ASSERT_TRUE(engine_->decoder().PrefillDense(**kv, cp->context, &logits).ok());
    double loss = 0;
    for (int32_t i = 0; i < o.passage; ++i) {
      if (i >= o.skip) loss -= LogProbAt(logits, cp->passage[i]);
      if (i + 1 < o.passage) {
        ASSERT_TRUE(engine_->decoder().StepDense(**kv, cp->passage[i], &logits).ok());
      }
    }
    EXPECT_NEAR((*cells)[d].repeat_loss, loss / (o.passage - o.skip), 0.02)
        << "at " << o.distances[d];
  }
  o.distances = {40};
  EXPECT_TRUE(absl::IsInvalidArgument(RunCopy(*engine_, text_, o, {}).status()));
  o.distances = {100000};
  EXPECT_TRUE(absl::IsInvalidArgument(RunCopy(*engine_, text_, o, {}).status()));
  o.distances = {960};  // 1 + 960 + 64 > 1024
  EXPECT_TRUE(absl::IsInvalidArgument(RunCopy(*engine_, text_, o, {}).status()));
  o.distances = {300};
  o.context = 100000;
  EXPECT_TRUE(absl::IsInvalidArgument(RunCopy(*engine_, text_, o, {}).status()));
  o.context = 1024;
  o.skip = 64;
  EXPECT_TRUE(absl::IsInvalidArgument(RunCopy(*engine_, text_, o, {}).status()));
}

}  // namespace
}  // namespace kvtier::engine
