// Captured layer-steps (SequenceOptions::capture_graphs, docs/retriever.md#graphs): the same
// speculative decode with graphs on and off gives bit-identical outputs, working sets and
// statistics, alone and in a batch, while the captured graphs are what actually ran. Built
// twice: on the cpu backend (which records task lists), and, labelled gpu, on cuda (CUDA
// graphs; skips without a device).
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/registry.h"
#include "kvtier/device.h"
#include "kvtier/sequence.h"
#include "tests/offload/retriever_harness.h"

namespace kvtier::retriever_test {
namespace {

struct Decoded {
  std::vector<std::vector<uint8_t>> out;         // [member][step · L + layer] bytes
  std::vector<std::vector<int32_t>> slot_table;  // [member · steps · L]
  std::vector<SequenceStats> stats;
};

// `members` sequences (ragged prompts) decoded `steps` steps, in one batch when batched.
Decoded Decode(const SequenceOptions& options, int32_t members, int32_t steps, bool batched) {
  const Geometry g = SmallGeometry(DType::kF16);
  std::unique_ptr<Device> device = MakeTestDevice();
  // One compute stream for every sequence, as an engine's: inputs and outputs are ordered
  // with each sequence's work.
  std::unique_ptr<Stream> compute = device->CreateStream().value();
  SequenceOptions o = options;
  o.compute_stream = compute.get();
  std::unique_ptr<SequenceBatch> batch;
  std::vector<std::unique_ptr<LocalSequence>> seqs;
  if (batched) batch = NewSequenceBatch(g, o, members, *device).value();
  for (int32_t m = 0; m < members; ++m) {
    seqs.push_back(batched ? batch->NewSequence().value()
                           : NewLocalSequence(g, o, *device).value());
  }
  std::vector<HostModel> models;
  for (int32_t m = 0; m < members; ++m) models.emplace_back(g, 21 + m);
  for (int32_t m = 0; m < members; ++m) {
    const int32_t prompt = 35 + 9 * m;
    auto rows = models[m].Grow(prompt);
    for (int32_t l = 0; l < g.num_layers; ++l) {
      EXPECT_TRUE(seqs[m]->Append(l, rows[l].first.data(), rows[l].second.data(), prompt).ok());
    }
    EXPECT_TRUE(seqs[m]->Wait().ok());
  }
  const size_t qb = size_t{2} * g.num_q_heads * g.head_dim;
  const size_t rb = size_t{2} * g.num_kv_heads * g.head_dim;
  DeviceBuffer q = device->Allocate(qb * members).value();
  DeviceBuffer out = device->Allocate(qb * members).value();
  DeviceBuffer kv = device->Allocate(2 * rb * members * g.num_layers).value();
  Stream& s = *compute;
  Decoded run;
  run.out.resize(members);
  std::vector<LocalSequence*> ptrs;
  for (auto& p : seqs) ptrs.push_back(p.get());
  for (int32_t step = 0; step < steps; ++step) {
    std::vector<uint8_t> qs(qb * members), rows(2 * rb * members * g.num_layers);
    for (int32_t m = 0; m < members; ++m) {
      const TypedBuffer mq = models[m].Query(500 + step);
      std::memcpy(qs.data() + m * qb, mq.data(), qb);
      auto r = models[m].Grow(1);
      for (int32_t l = 0; l < g.num_layers; ++l) {
        uint8_t* at = rows.data() + (static_cast<size_t>(l) * members + m) * 2 * rb;
        std::memcpy(at, r[l].first.data(), rb);
        std::memcpy(at + rb, r[l].second.data(), rb);
      }
    }
    EXPECT_TRUE(device->Copy(s, q.data(), qs.data(), qs.size()).ok());
    EXPECT_TRUE(device->Copy(s, kv.data(), rows.data(), rows.size()).ok());
    EXPECT_TRUE(s.Synchronize().ok());
    for (int32_t l = 0; l < g.num_layers; ++l) {
      for (int32_t m = 0; m < members; ++m) {
        const uint8_t* at = kv.as<uint8_t>() + (static_cast<size_t>(l) * members + m) * 2 * rb;
        EXPECT_TRUE(seqs[m]->Append(l, at, at + rb, 1).ok());
      }
      if (batched) {
        EXPECT_TRUE(batch->BeginStep(l, ptrs, q.data()).ok());
        EXPECT_TRUE(batch->Attend(l, ptrs, q.data(), out.data(), nullptr).ok());
        EXPECT_TRUE(batch->EndStep(l, ptrs, q.data()).ok());
      } else {
        for (int32_t m = 0; m < members; ++m) {
          const uint8_t* qm = q.as<uint8_t>() + m * qb;
          EXPECT_TRUE(seqs[m]->BeginStep(l, qm).ok());
          EXPECT_TRUE(seqs[m]->Attend(l, qm, out.as<uint8_t>() + m * qb, nullptr).ok());
          EXPECT_TRUE(seqs[m]->EndStep(l, qm).ok());
        }
      }
      std::vector<uint8_t> host(qb * members);
      EXPECT_TRUE(device->Copy(s, host.data(), out.data(), host.size()).ok());
      for (int32_t m = 0; m < members; ++m) {
        run.out[m].insert(run.out[m].end(), host.begin() + m * qb, host.begin() + (m + 1) * qb);
        EXPECT_TRUE(seqs[m]->Wait().ok());
        run.slot_table.push_back(seqs[m]->LastStep(l).slot_table);
      }
    }
  }
  for (auto& seq : seqs) {
    EXPECT_TRUE(seq->Wait().ok());
    run.stats.push_back(seq->Stats());
  }
  seqs.clear();
  batch.reset();
  return run;
}

void ExpectSame(const Decoded& a, const Decoded& b, const std::string& what) {
  ASSERT_EQ(a.out.size(), b.out.size());
  for (size_t m = 0; m < a.out.size(); ++m) {
    EXPECT_EQ(a.out[m], b.out[m]) << what << ": outputs of member " << m;
    EXPECT_EQ(a.stats[m].recalled_pages, b.stats[m].recalled_pages) << what << " member " << m;
    EXPECT_EQ(a.stats[m].correction_pages, b.stats[m].correction_pages) << what << " " << m;
    EXPECT_EQ(a.stats[m].corrected_heads, b.stats[m].corrected_heads) << what << " " << m;
    EXPECT_EQ(a.stats[m].corrections, b.stats[m].corrections) << what << " " << m;
  }
  EXPECT_EQ(a.slot_table, b.slot_table) << what;
}

class GraphCaptureTest : public ::testing::TestWithParam<CorrectionTrigger> {
 protected:
  void SetUp() override { KVTIER_SKIP_WITHOUT_TEST_DEVICE(); }
};

TEST_P(GraphCaptureTest, CapturedStepsEqualDirectLaunches) {
  SequenceOptions o = SmallOptions(RetrievalMode::kSpeculative);
  o.recall = RecallStrategy::kZeroCopy;
  o.correction_trigger = GetParam();
  constexpr int32_t kSteps = 20;  // page size 8: pages fill and join the candidates
  for (bool batched : {false, true}) {
    const std::string what = batched ? "batched" : "alone";
    const Decoded direct = Decode(o, 3, kSteps, batched);
    ExpectSame(direct, Decode(o, 3, kSteps, batched), what + " (direct twice)");
    SequenceOptions og = o;
    og.capture_graphs = true;
    const Decoded graphs = Decode(og, 3, kSteps, batched);
    ExpectSame(direct, graphs, what);
    const int32_t layers = SmallGeometry().num_layers;
    for (size_t m = 0; m < graphs.stats.size(); ++m) {
      EXPECT_EQ(direct.stats[m].graph_launches, 0) << what;
      // In a batch the run's graphs count for the member that starts the run.
      if (batched && m > 0) continue;
      // Every step's background selection, every step's correction but the first (which
      // selects every head), and every step's attention once its q and out came back (from
      // the second step on) ran as a graph.
      EXPECT_EQ(graphs.stats[m].graph_launches, int64_t{layers} * (3 * kSteps - 2)) << what;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Triggers, GraphCaptureTest,
                         ::testing::Values(CorrectionTrigger::kCosine, CorrectionTrigger::kMass),
                         [](const ::testing::TestParamInfo<CorrectionTrigger>& p) {
                           return std::string(CorrectionTriggerName(p.param));
                         });

TEST(GraphCaptureOffTest, OtherModesAndStrategiesLaunchDirectly) {
  KVTIER_SKIP_WITHOUT_TEST_DEVICE();
  SequenceOptions o = SmallOptions(RetrievalMode::kSpeculative);
  o.recall = RecallStrategy::kBatchedDma;  // its plan goes to the host: nothing to capture
  o.capture_graphs = true;
  EXPECT_EQ(Decode(o, 1, 6, false).stats[0].graph_launches, 0);
  o = SmallOptions(RetrievalMode::kSync);
  o.recall = RecallStrategy::kZeroCopy;
  o.capture_graphs = true;
  EXPECT_EQ(Decode(o, 1, 6, false).stats[0].graph_launches, 0);
}

}  // namespace
}  // namespace kvtier::retriever_test
