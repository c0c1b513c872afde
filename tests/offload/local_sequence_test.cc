// NewLocalSequence, the public in-process sequence (kvtier/sequence.h): the same results as
// a Retriever over a pool of the same shape, its own host tier only in the modes that have
// one, and devices kvtier did not create refused.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/registry.h"
#include "kvtier/device.h"
#include "kvtier/sequence.h"
#include "tests/offload/retriever_harness.h"

namespace kvtier::retriever_test {
namespace {

// Appends the harness's rows and decodes `steps` steps of every layer through the public
// contract; returns every output.
std::vector<std::vector<float>> Drive(Sequence& seq, HostModel& model, Harness& twin,
                                      int32_t steps) {
  const Geometry& g = seq.geometry();
  std::vector<std::vector<float>> outs;
  auto rows = model.Grow(40);
  for (int32_t l = 0; l < g.num_layers; ++l) {
    EXPECT_TRUE(seq.Append(l, rows[l].first.data(), rows[l].second.data(), 40).ok());
    EXPECT_TRUE(twin.retriever->Append(l, rows[l].first.data(), rows[l].second.data(), 40).ok());
  }
  for (int32_t step = 0; step < steps; ++step) {
    const TypedBuffer q = model.Query(100 + step);
    for (int32_t l = 0; l < g.num_layers; ++l) {
      TypedBuffer out(g.dtype, int64_t{g.num_q_heads} * g.head_dim);
      EXPECT_TRUE(seq.Decode(l, q.data(), out.data(), nullptr).ok());
      EXPECT_TRUE(seq.Wait().ok());
      outs.push_back(out.ToFloats());
    }
    const Harness::StepResult r = twin.Step(q);
    for (const std::vector<float>& o : r.out) outs.push_back(o);
  }
  return outs;
}

TEST(LocalSequenceTest, DecodesAsTheRetrieverOverAPoolDoes) {
  const Geometry g = SmallGeometry(DType::kF16);
  const SequenceOptions o = SmallOptions(RetrievalMode::kSpeculative);
  absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice(DeviceKind::kCpu);
  ASSERT_TRUE(device.ok()) << device.status();
  absl::StatusOr<std::unique_ptr<LocalSequence>> seq = NewLocalSequence(g, o, **device);
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_EQ((*seq)->local(), seq->get());
  HostModel model(g, 3);
  Harness twin(g, o);
  const std::vector<std::vector<float>> outs = Drive(**seq, model, twin, 4);
  // Per step: the sequence's layers, then the twin's.
  const size_t layers = static_cast<size_t>(g.num_layers);
  ASSERT_EQ(outs.size(), 4 * 2 * layers);
  for (size_t step = 0; step < 4; ++step) {
    for (size_t l = 0; l < layers; ++l) {
      EXPECT_EQ(outs[step * 2 * layers + l], outs[step * 2 * layers + layers + l])
          << "step " << step << " layer " << l;
    }
  }
  const SequenceStats st = (*seq)->Stats();
  EXPECT_EQ(st.offloaded_pages, int64_t{g.num_layers} * (40 / g.page_size));
  EXPECT_EQ((*seq)->LastStep(0).slot_table.size(),
            static_cast<size_t>(g.num_kv_heads) * o.budget_pages());
  ASSERT_TRUE((*seq)->Close().ok());
  EXPECT_TRUE(absl::IsFailedPrecondition((*seq)->Append(0, nullptr, nullptr, 1)));
}

// A sequence made alone is the one member of its own batch of one: stepping it through that
// batch gives bit for bit what its own calls give, with every recall strategy (a batch of one
// may use the DMA ones) and every mode.
TEST(LocalSequenceTest, ASequenceMadeAloneStepsThroughItsBatchOfOne) {
  const Geometry g = SmallGeometry(DType::kF16);
  absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice(DeviceKind::kCpu);
  ASSERT_TRUE(device.ok()) << device.status();
  for (RetrievalMode mode : {RetrievalMode::kSpeculative, RetrievalMode::kSync,
                             RetrievalMode::kFull, RetrievalMode::kDrop})
    for (RecallStrategy recall : {RecallStrategy::kBatchedDma, RecallStrategy::kZeroCopy}) {
      SCOPED_TRACE(std::string(RetrievalModeName(mode)) + " " +
                   std::string(RecallStrategyName(recall)));
      SequenceOptions o = SmallOptions(mode);
      o.recall = recall;
      std::unique_ptr<LocalSequence> alone = NewLocalSequence(g, o, **device).value();
      std::unique_ptr<LocalSequence> via = NewLocalSequence(g, o, **device).value();
      SequenceBatch* batch = via->batch();
      ASSERT_NE(batch, nullptr);
      EXPECT_EQ(batch->max_batch(), 1);
      EXPECT_NE(batch, alone->batch());
      HostModel model(g, 9);
      auto rows = model.Grow(90);
      for (int32_t l = 0; l < g.num_layers; ++l) {
        ASSERT_TRUE(alone->Append(l, rows[l].first.data(), rows[l].second.data(), 90).ok());
        ASSERT_TRUE(via->Append(l, rows[l].first.data(), rows[l].second.data(), 90).ok());
      }
      LocalSequence* const member[] = {via.get()};
      for (int32_t step = 0; step < 5; ++step) {
        const TypedBuffer q = model.Query(7 + step);
        for (int32_t l = 0; l < g.num_layers; ++l) {
          TypedBuffer a(g.dtype, int64_t{g.num_q_heads} * g.head_dim), b = a;
          ASSERT_TRUE(alone->Decode(l, q.data(), a.data(), nullptr).ok());
          ASSERT_TRUE(batch->BeginStep(l, member, q.data()).ok());
          ASSERT_TRUE(batch->Attend(l, member, q.data(), b.data(), nullptr).ok());
          ASSERT_TRUE(batch->EndStep(l, member, q.data()).ok());
          ASSERT_TRUE(alone->Wait().ok());
          ASSERT_TRUE(via->Wait().ok());
          EXPECT_EQ(a.ToFloats(), b.ToFloats()) << "step " << step << " layer " << l;
        }
      }
      EXPECT_EQ(alone->Stats().recalled_pages, via->Stats().recalled_pages);
      EXPECT_EQ(via->Stats().recall_strategy,
                mode == RetrievalMode::kSpeculative || mode == RetrievalMode::kSync
                    ? recall
                    : RecallStrategy::kZeroCopy);
    }
}

TEST(LocalSequenceTest, FullAndDropModesNeedNoHostTier) {
  const Geometry g = SmallGeometry();
  std::unique_ptr<Device> device = CreateDevice(DeviceKind::kCpu).value();
  for (RetrievalMode mode : {RetrievalMode::kFull, RetrievalMode::kDrop}) {
    SequenceOptions o = SmallOptions(mode);
    absl::StatusOr<std::unique_ptr<LocalSequence>> seq = NewLocalSequence(g, o, *device);
    ASSERT_TRUE(seq.ok()) << RetrievalModeName(mode) << ": " << seq.status();
    HostModel model(g, 5);
    auto rows = model.Grow(20);
    ASSERT_TRUE((*seq)->Append(0, rows[0].first.data(), rows[0].second.data(), 20).ok());
    const TypedBuffer q = model.Query(9);
    TypedBuffer out(g.dtype, int64_t{g.num_q_heads} * g.head_dim);
    ASSERT_TRUE((*seq)->Decode(0, q.data(), out.data(), nullptr).ok());
    ASSERT_TRUE((*seq)->Wait().ok());
    EXPECT_EQ((*seq)->Stats().offloaded_pages, 0) << RetrievalModeName(mode);
  }
}

// A Device an engine implemented itself: kvtier cannot run its ops on it.
class ForeignDevice final : public Device {
 public:
  DeviceKind kind() const override { return DeviceKind::kCpu; }
  std::string Describe() const override { return "foreign"; }
  absl::StatusOr<DeviceBuffer> Allocate(size_t) override {
    return absl::UnimplementedError("foreign");
  }
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream(StreamPriority) override {
    return absl::UnimplementedError("foreign");
  }
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    return absl::UnimplementedError("foreign");
  }
  absl::Status RegisterHost(void*, size_t) override { return absl::OkStatus(); }
  absl::Status UnregisterHost(void*) override { return absl::OkStatus(); }
  absl::Status Copy(Stream&, void*, const void*, size_t) override {
    return absl::UnimplementedError("foreign");
  }
  absl::Status Memset(Stream&, void*, int, size_t) override {
    return absl::UnimplementedError("foreign");
  }

 protected:
  void Free(void*) override {}
};

TEST(LocalSequenceTest, RefusesADeviceKvtierDidNotCreate) {
  ForeignDevice foreign;
  absl::StatusOr<std::unique_ptr<LocalSequence>> seq =
      NewLocalSequence(SmallGeometry(), SmallOptions(RetrievalMode::kSpeculative), foreign);
  ASSERT_TRUE(absl::IsInvalidArgument(seq.status())) << seq.status();
  EXPECT_THAT(std::string(seq.status().message()), ::testing::HasSubstr("not created by kvtier"));
}

TEST(LocalSequenceTest, InvalidOptionsNameTheField) {
  std::unique_ptr<Device> device = CreateDevice(DeviceKind::kCpu).value();
  SequenceOptions o = SmallOptions(RetrievalMode::kSpeculative);
  o.max_tokens = 0;
  absl::StatusOr<std::unique_ptr<LocalSequence>> seq =
      NewLocalSequence(SmallGeometry(), o, *device);
  ASSERT_TRUE(absl::IsInvalidArgument(seq.status())) << seq.status();
  EXPECT_THAT(std::string(seq.status().message()), ::testing::HasSubstr("max_tokens"));
}

}  // namespace
}  // namespace kvtier::retriever_test
