// SequenceBatch (kvtier/sequence.h, docs/retriever.md#batches): B sequences of ragged
// lengths stepped as one batch give bit-identical outputs, working sets and statistics to the
// same B sequences run alone, in every mode, with policies, with members joining and leaving
// between steps and passed in any order; and the batch refuses what it cannot do. Built twice:
// on the cpu backend, and, labelled gpu, on cuda (sequence_batch_gpu_test; skips without a
// device).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/registry.h"
#include "kvtier/device.h"
#include "kvtier/sequence.h"
#include "tests/offload/retriever_harness.h"

namespace kvtier::retriever_test {
namespace {

constexpr int32_t kBatch = 4;

// One sequence's inputs, the same for its batched and its lone run.
struct Inputs {
  std::vector<std::pair<TypedBuffer, TypedBuffer>> prompt;
  std::vector<std::vector<std::pair<TypedBuffer, TypedBuffer>>> tokens;  // [step][layer]
  std::vector<TypedBuffer> queries;                                      // [step]
};

Inputs MakeInputs(const Geometry& g, int32_t prompt, int32_t steps, uint64_t seed) {
  HostModel model(g, seed);
  Inputs in;
  in.prompt = model.Grow(prompt);
  for (int32_t s = 0; s < steps; ++s) {
    in.tokens.push_back(model.Grow(1));
    in.queries.push_back(model.Query(seed * 1000 + s));
  }
  return in;
}

// Backend memory holding `src` (so that no copy blocks).
DeviceBuffer OnDevice(Device& d, Stream& s, const void* src, size_t bytes) {
  DeviceBuffer b = d.Allocate(bytes).value();
  EXPECT_TRUE(d.Copy(s, b.data(), src, bytes).ok());
  EXPECT_TRUE(s.Synchronize().ok());
  return b;
}

// What a sequence produced at each step: per layer the output bytes and the working set.
struct Trace {
  std::vector<std::vector<uint8_t>> out;         // [step · L + layer]
  std::vector<std::vector<int32_t>> slot_table;  // [step · L + layer]
  SequenceStats stats;
};

void Record(const Geometry& g, LocalSequence& seq, Device& device, const void* out, Trace* trace) {
  const size_t bytes = size_t{2} * g.num_q_heads * g.head_dim;  // fp16
  std::vector<uint8_t> host(bytes);
  EXPECT_TRUE(device.Copy(seq.compute_stream(), host.data(), out, bytes).ok());
  trace->out.push_back(std::move(host));
}

// Compares two traces; `what` names the sequence.
void ExpectSame(const Trace& a, const Trace& b, const std::string& what) {
  ASSERT_EQ(a.out.size(), b.out.size()) << what;
  for (size_t i = 0; i < a.out.size(); ++i) {
    EXPECT_EQ(a.out[i], b.out[i]) << what << ": output of layer-step " << i;
    EXPECT_EQ(a.slot_table[i], b.slot_table[i]) << what << ": slot table of layer-step " << i;
  }
  EXPECT_EQ(a.stats.steps, b.stats.steps) << what;
  EXPECT_EQ(a.stats.appended_tokens, b.stats.appended_tokens) << what;
  EXPECT_EQ(a.stats.offloaded_pages, b.stats.offloaded_pages) << what;
  EXPECT_EQ(a.stats.recalled_pages, b.stats.recalled_pages) << what;
  EXPECT_EQ(a.stats.correction_pages, b.stats.correction_pages) << what;
  EXPECT_EQ(a.stats.checked_heads, b.stats.checked_heads) << what;
  EXPECT_EQ(a.stats.corrected_heads, b.stats.corrected_heads) << what;
  EXPECT_EQ(a.stats.corrections, b.stats.corrections) << what;
  EXPECT_EQ(a.stats.resident_head_pages, b.stats.resident_head_pages) << what;
  EXPECT_EQ(a.stats.budget_changes, b.stats.budget_changes) << what;
}

// Runs one sequence alone from `first` to `last` step over its inputs.
Trace RunAlone(const Geometry& g, const SequenceOptions& o, const Inputs& in, int32_t steps) {
  std::unique_ptr<Device> device = MakeTestDevice();
  std::unique_ptr<LocalSequence> seq = NewLocalSequence(g, o, *device).value();
  Stream& s = seq->compute_stream();
  const int32_t prompt =
      static_cast<int32_t>(in.prompt[0].first.size() / (g.num_kv_heads * g.head_dim));
  for (int32_t l = 0; l < g.num_layers; ++l) {
    EXPECT_TRUE(seq->Append(l, in.prompt[l].first.data(), in.prompt[l].second.data(), prompt).ok());
  }
  DeviceBuffer out = device->Allocate(size_t{2} * g.num_q_heads * g.head_dim).value();
  Trace t;
  for (int32_t step = 0; step < steps; ++step) {
    DeviceBuffer q = OnDevice(*device, s, in.queries[step].data(), in.queries[step].bytes());
    for (int32_t l = 0; l < g.num_layers; ++l) {
      const auto& row = in.tokens[step][l];
      EXPECT_TRUE(seq->Append(l, row.first.data(), row.second.data(), 1).ok());
      EXPECT_TRUE(seq->BeginStep(l, q.data()).ok());
      EXPECT_TRUE(seq->Attend(l, q.data(), out.data(), nullptr).ok());
      EXPECT_TRUE(seq->EndStep(l, q.data()).ok());
      Record(g, *seq, *device, out.data(), &t);
      EXPECT_TRUE(seq->Wait().ok());
      t.slot_table.push_back(seq->LastStep(l).slot_table);
    }
  }
  EXPECT_TRUE(seq->Wait().ok());
  t.stats = seq->Stats();
  return t;
}

// The batch: member i runs inputs[i]; at step `swap_at` member 1 leaves and a new member
// (inputs[kBatch]) joins in its slot; from step `reverse_from` on the members are passed in
// reverse order (one run per member). Returns the traces of inputs[0..kBatch].
std::vector<Trace> RunBatched(const Geometry& g, const SequenceOptions& o,
                              const std::vector<Inputs>& inputs, int32_t steps, int32_t swap_at,
                              int32_t reverse_from) {
  std::unique_ptr<Device> device = MakeTestDevice();
  std::unique_ptr<SequenceBatch> batch = NewSequenceBatch(g, o, kBatch, *device).value();
  Stream& s = batch->compute_stream();
  std::vector<std::unique_ptr<LocalSequence>> seqs;
  std::vector<int32_t> input_of;  // member → inputs index
  std::vector<int32_t> first_step;
  std::vector<Trace> traces(inputs.size());
  const auto join = [&](int32_t i, int32_t step) {
    std::unique_ptr<LocalSequence> seq = batch->NewSequence().value();
    const Inputs& in = inputs[i];
    const int32_t prompt =
        static_cast<int32_t>(in.prompt[0].first.size() / (g.num_kv_heads * g.head_dim));
    for (int32_t l = 0; l < g.num_layers; ++l) {
      EXPECT_TRUE(
          seq->Append(l, in.prompt[l].first.data(), in.prompt[l].second.data(), prompt).ok());
    }
    return std::make_pair(std::move(seq), step);
  };
  std::vector<int32_t> member_step;  // steps the member has run
  for (int32_t i = 0; i < kBatch; ++i) {
    auto joined = join(i, 0);
    seqs.push_back(std::move(joined.first));
    input_of.push_back(i);
    member_step.push_back(0);
  }
  const size_t qb = size_t{2} * g.num_q_heads * g.head_dim;
  DeviceBuffer q = device->Allocate(qb * kBatch).value();
  DeviceBuffer out = device->Allocate(qb * kBatch).value();
  for (int32_t step = 0; step < steps; ++step) {
    if (step == swap_at) {
      EXPECT_TRUE(seqs[1]->Wait().ok());
      traces[input_of[1]].stats = seqs[1]->Stats();
      EXPECT_TRUE(seqs[1]->Close().ok());
      auto joined = join(kBatch, step);
      seqs[1] = std::move(joined.first);
      input_of[1] = kBatch;
      member_step[1] = 0;
    }
    std::vector<int32_t> order(kBatch);
    for (int32_t i = 0; i < kBatch; ++i) order[i] = step >= reverse_from ? kBatch - 1 - i : i;
    std::vector<LocalSequence*> members;
    std::vector<uint8_t> qs(qb * kBatch);
    for (int32_t j = 0; j < kBatch; ++j) {
      const int32_t m = order[j];
      members.push_back(seqs[m].get());
      const TypedBuffer& mq = inputs[input_of[m]].queries[member_step[m]];
      std::memcpy(qs.data() + j * qb, mq.data(), qb);
    }
    EXPECT_TRUE(device->Copy(s, q.data(), qs.data(), qs.size()).ok());
    EXPECT_TRUE(s.Synchronize().ok());
    for (int32_t l = 0; l < g.num_layers; ++l) {
      for (int32_t m = 0; m < kBatch; ++m) {
        const auto& row = inputs[input_of[m]].tokens[member_step[m]][l];
        EXPECT_TRUE(seqs[m]->Append(l, row.first.data(), row.second.data(), 1).ok());
      }
      absl::StatusOr<std::vector<WorkingSetView>> views = batch->BeginStep(l, members, q.data());
      EXPECT_TRUE(views.ok()) << views.status();
      if (!views.ok()) return traces;
      EXPECT_EQ(views->size(), members.size());
      EXPECT_TRUE(batch->Attend(l, members, q.data(), out.data(), nullptr).ok());
      EXPECT_TRUE(batch->EndStep(l, members, q.data()).ok());
      for (int32_t j = 0; j < kBatch; ++j) {
        const int32_t m = order[j];
        Record(g, *seqs[m], *device, out.as<uint8_t>() + j * qb, &traces[input_of[m]]);
      }
      EXPECT_TRUE(s.Synchronize().ok());
      for (int32_t m = 0; m < kBatch; ++m) {
        EXPECT_TRUE(seqs[m]->Wait().ok());
        traces[input_of[m]].slot_table.push_back(seqs[m]->LastStep(l).slot_table);
      }
    }
    for (int32_t m = 0; m < kBatch; ++m) ++member_step[m];
  }
  for (int32_t m = 0; m < kBatch; ++m) {
    EXPECT_TRUE(seqs[m]->Wait().ok());
    traces[input_of[m]].stats = seqs[m]->Stats();
  }
  return traces;
}

struct Case {
  std::string name;
  RetrievalMode mode;
  CorrectionTrigger trigger = CorrectionTrigger::kCosine;
  std::string residency;  // a residency policy, or empty
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class SequenceBatchTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override { KVTIER_SKIP_WITHOUT_TEST_DEVICE(); }
};

TEST_P(SequenceBatchTest, BatchedEqualsAloneBitForBit) {
  const Case& c = GetParam();
  const Geometry g = SmallGeometry(DType::kF16);
  SequenceOptions o = SmallOptions(c.mode);
  o.recall = RecallStrategy::kZeroCopy;
  o.correction_trigger = c.trigger;
  if (!c.residency.empty()) o.policy.residency = c.residency;
  constexpr int32_t kSteps = 14, kSwapAt = 6, kReverseFrom = 10;
  // Ragged prompts: the members sit at different page offsets and page counts.
  const int32_t prompts[kBatch + 1] = {37, 50, 64, 81, 45};
  std::vector<Inputs> inputs;
  for (int32_t i = 0; i <= kBatch; ++i) inputs.push_back(MakeInputs(g, prompts[i], kSteps, 7 + i));
  const std::vector<Trace> batched = RunBatched(g, o, inputs, kSteps, kSwapAt, kReverseFrom);
  for (int32_t i = 0; i <= kBatch; ++i) {
    // Member 1 ran kSwapAt steps before it left; its successor ran the rest.
    const int32_t steps = i == 1 ? kSwapAt : i == kBatch ? kSteps - kSwapAt : kSteps;
    ExpectSame(batched[i], RunAlone(g, o, inputs[i], steps),
               c.name + " sequence " + std::to_string(i));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Modes, SequenceBatchTest,
    ::testing::Values(
        Case{"speculative", RetrievalMode::kSpeculative, CorrectionTrigger::kCosine, ""},
        Case{"speculative_mass", RetrievalMode::kSpeculative, CorrectionTrigger::kMass, ""},
        Case{"speculative_h2o", RetrievalMode::kSpeculative, CorrectionTrigger::kCosine, "h2o"},
        Case{"sync", RetrievalMode::kSync, CorrectionTrigger::kCosine, ""},
        Case{"full", RetrievalMode::kFull, CorrectionTrigger::kCosine, ""},
        Case{"drop", RetrievalMode::kDrop, CorrectionTrigger::kCosine, ""}),
    [](const ::testing::TestParamInfo<Case>& p) { return p.param.name; });

TEST(SequenceBatchErrorsTest, RefusesWhatItCannotDo) {
  KVTIER_SKIP_WITHOUT_TEST_DEVICE();
  const Geometry g = SmallGeometry(DType::kF16);
  SequenceOptions o = SmallOptions(RetrievalMode::kSpeculative);
  std::unique_ptr<Device> device = MakeTestDevice();
  o.recall = RecallStrategy::kBatchedDma;
  EXPECT_TRUE(absl::IsInvalidArgument(NewSequenceBatch(g, o, 2, *device).status()));
  o.recall = RecallStrategy::kAuto;
  EXPECT_TRUE(absl::IsInvalidArgument(NewSequenceBatch(g, o, 0, *device).status()));
  SequenceOptions managed = SmallOptions(RetrievalMode::kDrop);
  managed.policy.residency = "h2o";
  // Refused when the batch is made (the step plan's rule), not when a member joins.
  EXPECT_TRUE(absl::IsInvalidArgument(NewSequenceBatch(g, managed, 2, *device).status()));

  std::unique_ptr<SequenceBatch> batch = NewSequenceBatch(g, o, 2, *device).value();
  std::unique_ptr<SequenceBatch> other = NewSequenceBatch(g, o, 2, *device).value();
  std::unique_ptr<LocalSequence> a = batch->NewSequence().value();
  std::unique_ptr<LocalSequence> b = batch->NewSequence().value();
  EXPECT_TRUE(absl::IsResourceExhausted(batch->NewSequence().status()));
  std::unique_ptr<LocalSequence> stranger = other->NewSequence().value();
  HostModel model(g, 1);
  auto rows = model.Grow(20);
  for (LocalSequence* s : {a.get(), b.get(), stranger.get()}) {
    ASSERT_TRUE(s->Append(0, rows[0].first.data(), rows[0].second.data(), 20).ok());
  }
  const TypedBuffer q = model.Query(1);
  std::vector<uint8_t> q2(2 * q.bytes());
  std::memcpy(q2.data(), q.data(), q.bytes());
  std::memcpy(q2.data() + q.bytes(), q.data(), q.bytes());
  std::vector<LocalSequence*> mixed = {a.get(), stranger.get()};
  EXPECT_TRUE(absl::IsInvalidArgument(batch->BeginStep(0, mixed, q2.data()).status()));
  std::vector<LocalSequence*> twice = {a.get(), a.get()};
  EXPECT_TRUE(absl::IsInvalidArgument(batch->BeginStep(0, twice, q2.data()).status()));
  std::vector<LocalSequence*> none;
  EXPECT_TRUE(absl::IsInvalidArgument(batch->BeginStep(0, none, q2.data()).status()));
  std::vector<LocalSequence*> both = {a.get(), b.get()};
  // Layer 1 has no tokens: refused before any member's work, so layer 0 still steps.
  EXPECT_TRUE(absl::IsFailedPrecondition(batch->BeginStep(1, both, q2.data()).status()));
  EXPECT_TRUE(absl::IsFailedPrecondition(batch->EndStep(0, both, q2.data())));
  ASSERT_TRUE(batch->BeginStep(0, both, q2.data()).ok());
  ASSERT_TRUE(batch->EndStep(0, both, q2.data()).ok());
  // A closed member has left (its own precondition, as for any closed sequence): its slot is
  // free for a new one.
  ASSERT_TRUE(b->Close().ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(batch->BeginStep(0, both, q2.data()).status()));
  EXPECT_TRUE(absl::IsFailedPrecondition(b->BeginStep(0, q.data()).status()));
  EXPECT_TRUE(batch->NewSequence().ok());
}

// Members keep the batch's storage: once the batch object is gone, each still names a batch
// and steps through it as before, bit for bit with a sequence made alone on the same inputs
// (tests/engine/eval_test.cc steps a decorator through the batch of the one it wraps).
TEST(SequenceBatchErrorsTest, AMemberOutlivesItsBatchObject) {
  KVTIER_SKIP_WITHOUT_TEST_DEVICE();
  const Geometry g = SmallGeometry(DType::kF16);
  const SequenceOptions o = SmallOptions(RetrievalMode::kSpeculative);
  std::unique_ptr<Device> device = MakeTestDevice();
  std::unique_ptr<SequenceBatch> batch = NewSequenceBatch(g, o, 2, *device).value();
  std::unique_ptr<LocalSequence> member = batch->NewSequence().value();
  std::unique_ptr<LocalSequence> alone = NewLocalSequence(g, o, *device).value();
  ASSERT_EQ(member->batch(), batch.get());
  HostModel model(g, 3);
  auto rows = model.Grow(70);
  for (LocalSequence* s : {member.get(), alone.get()}) {
    for (int32_t l = 0; l < g.num_layers; ++l) {
      ASSERT_TRUE(s->Append(l, rows[l].first.data(), rows[l].second.data(), 70).ok());
    }
  }
  Stream& cs = member->compute_stream();
  DeviceBuffer out_m = device->Allocate(size_t{2} * g.num_q_heads * g.head_dim).value();
  DeviceBuffer out_a = device->Allocate(out_m.size()).value();
  for (int32_t step = 0; step < 4; ++step) {
    if (step == 2) {
      batch.reset();
      ASSERT_NE(member->batch(), nullptr);
      EXPECT_EQ(member->batch()->max_batch(), 2);
    }
    const TypedBuffer qh = model.Query(50 + step);
    DeviceBuffer q = OnDevice(*device, cs, qh.data(), qh.bytes());
    for (int32_t l = 0; l < g.num_layers; ++l) {
      ASSERT_TRUE(member->Decode(l, q.data(), out_m.data(), nullptr).ok()) << step;
      ASSERT_TRUE(alone->Decode(l, q.data(), out_a.data(), nullptr).ok()) << step;
      Trace a, b;
      Record(g, *member, *device, out_m.data(), &a);
      Record(g, *alone, *device, out_a.data(), &b);
      ASSERT_TRUE(member->Wait().ok());
      ASSERT_TRUE(alone->Wait().ok());
      EXPECT_EQ(a.out, b.out) << "step " << step << " layer " << l;
    }
  }
  EXPECT_EQ(member->Stats().recalled_pages, alone->Stats().recalled_pages);
  EXPECT_GT(member->Stats().checked_heads, 0);
}

}  // namespace
}  // namespace kvtier::retriever_test
