// Blocking host calls on the decode path (docs/retriever.md#host-waits). Built twice: on the
// cpu backend, which models CUDA's blocking rules (a copy into or out of pageable memory
// blocks), and, labelled gpu, on cuda (host_waits_gpu_test; skips without a device): a
// speculative decode makes none after its first step, sync mode makes exactly its one
// deliberate wait per layer-step when a DMA strategy needs its plan on the host, and none
// recalling zero-copy. The engine's side is played as an engine plays it: inputs in backend
// memory, one wait per decoded token for the outputs (outside the sequence's calls).
#include <cstdint>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/host_calls.h"
#include "kernels/registry.h"
#include "kvtier/device.h"
#include "kvtier/sequence.h"
#include "tests/offload/retriever_harness.h"

namespace kvtier::retriever_test {
namespace {

class HostWaitsTest : public ::testing::Test {
 protected:
  void SetUp() override { KVTIER_SKIP_WITHOUT_TEST_DEVICE(); }
};

// A buffer of backend memory holding `src`.
DeviceBuffer OnDevice(Device& d, Stream& s, const TypedBuffer& src) {
  DeviceBuffer b = d.Allocate(src.bytes()).value();
  EXPECT_TRUE(d.Copy(s, b.data(), src.data(), src.bytes()).ok());
  EXPECT_TRUE(s.Synchronize().ok());
  return b;
}

// Runs `steps` decode steps of every layer after a prefill; returns each step's blocking host
// calls, summed over its layers, as the sequence reports them (SequenceStats::host_waits).
std::vector<int64_t> Decode(const SequenceOptions& o, int32_t steps, SequenceStats* end) {
  const Geometry g = SmallGeometry(DType::kF16);
  std::unique_ptr<Device> device = MakeTestDevice();
  std::unique_ptr<LocalSequence> seq = NewLocalSequence(g, o, *device).value();
  Stream& s = seq->compute_stream();
  HostModel model(g, 11);
  auto prompt = model.Grow(60);
  for (int32_t l = 0; l < g.num_layers; ++l) {
    DeviceBuffer k = OnDevice(*device, s, prompt[l].first);
    DeviceBuffer v = OnDevice(*device, s, prompt[l].second);
    EXPECT_TRUE(seq->Append(l, k.data(), v.data(), 60).ok());
    EXPECT_TRUE(seq->Wait().ok());
  }
  DeviceBuffer out = device->Allocate(size_t{2} * g.num_q_heads * g.head_dim).value();
  std::vector<int64_t> per_step;
  for (int32_t step = 0; step < steps; ++step) {
    auto rows = model.Grow(1);
    std::vector<DeviceBuffer> ks, vs;
    for (int32_t l = 0; l < g.num_layers; ++l) {
      ks.push_back(OnDevice(*device, s, rows[l].first));
      vs.push_back(OnDevice(*device, s, rows[l].second));
    }
    DeviceBuffer q = OnDevice(*device, s, model.Query(1000 + step));
    const int64_t before = seq->Stats().host_waits;
    const HostCalls calls_before = ThreadHostCalls();
    for (int32_t l = 0; l < g.num_layers; ++l) {
      EXPECT_TRUE(seq->Append(l, ks[l].data(), vs[l].data(), 1).ok());
      EXPECT_TRUE(seq->BeginStep(l, q.data()).ok());
      EXPECT_TRUE(seq->Attend(l, q.data(), out.data(), nullptr).ok());
      EXPECT_TRUE(seq->EndStep(l, q.data()).ok());
    }
    const HostCalls made = ThreadHostCalls() - calls_before;
    per_step.push_back(seq->Stats().host_waits - before);
    // The sequence's count is every blocking call the thread made inside its calls.
    EXPECT_EQ(per_step.back(), made.total()) << "step " << step;
    // The engine reads its outputs: one wait per token, outside the sequence.
    EXPECT_TRUE(s.Synchronize().ok());
  }
  EXPECT_TRUE(seq->Wait().ok());
  for (int32_t l = 0; l < g.num_layers; ++l) {
    EXPECT_EQ(seq->LastStep(l).step, steps - 1);
    EXPECT_EQ(seq->LastStep(l).host_waits, per_step.back() / g.num_layers) << "layer " << l;
  }
  *end = seq->Stats();
  return per_step;
}

TEST_F(HostWaitsTest, SpeculativeDecodeMakesNoBlockingCallAfterWarmUp) {
  SequenceOptions o = SmallOptions(RetrievalMode::kSpeculative);
  o.recall = RecallStrategy::kZeroCopy;
  SequenceStats st;
  // 40 steps at page size 8: five pages fill, are offloaded and become candidates.
  const std::vector<int64_t> waits = Decode(o, 40, &st);
  for (size_t step = 1; step < waits.size(); ++step) {
    EXPECT_EQ(waits[step], 0) << "step " << step;
  }
  EXPECT_GT(st.recalled_pages, 0);  // the background selection did recall
  EXPECT_EQ(st.host_waits, waits[0]);
  EXPECT_EQ(st.host_waits,
            st.host_event_waits + st.host_sync_copies + st.host_allocations + st.host_frees);
}

TEST_F(HostWaitsTest, SpeculativeDecodeWithTheMassTriggerMakesNone) {
  SequenceOptions o = SmallOptions(RetrievalMode::kSpeculative);
  o.recall = RecallStrategy::kZeroCopy;
  o.correction_trigger = CorrectionTrigger::kMass;
  SequenceStats st;
  const std::vector<int64_t> waits = Decode(o, 24, &st);
  for (size_t step = 1; step < waits.size(); ++step) EXPECT_EQ(waits[step], 0) << step;
}

TEST_F(HostWaitsTest, SyncModeWaitsOncePerLayerStepForItsDmaPlanAndNeverZeroCopy) {
  const int32_t layers = SmallGeometry().num_layers;
  SequenceOptions o = SmallOptions(RetrievalMode::kSync);
  o.recall = RecallStrategy::kBatchedDma;
  SequenceStats st;
  std::vector<int64_t> waits = Decode(o, 12, &st);
  // The copy engines are driven from the host: the plan made on the device must reach it.
  for (size_t step = 1; step < waits.size(); ++step) EXPECT_EQ(waits[step], layers) << step;
  EXPECT_EQ(st.host_sync_copies + st.host_allocations + st.host_frees, 0);

  o.recall = RecallStrategy::kZeroCopy;
  waits = Decode(o, 12, &st);
  for (size_t step = 1; step < waits.size(); ++step) EXPECT_EQ(waits[step], 0) << step;
}

TEST_F(HostWaitsTest, PageableInputsAreCountedAsSynchronousCopies) {
  // The same decode with the query in ordinary host memory: every upload of it blocks.
  const Geometry g = SmallGeometry(DType::kF16);
  SequenceOptions o = SmallOptions(RetrievalMode::kSpeculative);
  o.recall = RecallStrategy::kZeroCopy;
  std::unique_ptr<Device> device = MakeTestDevice();
  std::unique_ptr<LocalSequence> seq = NewLocalSequence(g, o, *device).value();
  HostModel model(g, 5);
  auto prompt = model.Grow(30);
  ASSERT_TRUE(seq->Append(0, prompt[0].first.data(), prompt[0].second.data(), 30).ok());
  const TypedBuffer q = model.Query(1);
  for (int32_t step = 0; step < 3; ++step) {
    ASSERT_TRUE(seq->BeginStep(0, q.data()).ok());
    ASSERT_TRUE(seq->EndStep(0, q.data()).ok());
  }
  ASSERT_TRUE(seq->Wait().ok());
  const SequenceStats st = seq->Stats();
  // BeginStep copies q into q_cur, EndStep into q_prev: two synchronous copies per step; the
  // prompt's K and V were copied page by page (8, 8, 8, 6 tokens), counted in step 0.
  EXPECT_EQ(st.host_sync_copies, 3 * 2 + 4 * 2);
  EXPECT_EQ(seq->LastStep(0).host_waits, 2);
}

}  // namespace
}  // namespace kvtier::retriever_test
