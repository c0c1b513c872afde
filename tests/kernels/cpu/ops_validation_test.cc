// Shape errors are refused when an op is enqueued; data errors fail the stream when it runs.
#include <cmath>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/registry.h"

namespace kvtier {
namespace {

using ::testing::HasSubstr;

class OpsValidationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = std::move(CreateBackend(DeviceKind::kCpu)).value();
    stream_ = std::move(backend_->CreateStream()).value();
  }
  void ExpectInvalid(const absl::Status& st, const std::string& text) {
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr(text));
  }
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Stream> stream_;
  std::vector<float> buf_ = std::vector<float>(4096);
  std::vector<int8_t> bytes_ = std::vector<int8_t>(4096);
  std::vector<int32_t> ints_ = std::vector<int32_t>(64, 1);
};

TEST_F(OpsValidationTest, ScorePagesNamesTheBadField) {
  ScorePagesArgs a;
  a.shape = {.dtype = DType::kF32, .num_q_heads = 6, .num_kv_heads = 4, .head_dim = 8};
  a.batch = 1;
  a.max_pages = 4;
  a.q = a.summaries = buf_.data();
  a.num_pages = ints_.data();
  a.pooled = buf_.data();
  ExpectInvalid(backend_->ScorePages(*stream_, a),
                "ScorePages: shape.num_q_heads = 6 must be a multiple of shape.num_kv_heads = 4");
  a.shape.num_kv_heads = 3;
  a.batch = 0;
  ExpectInvalid(backend_->ScorePages(*stream_, a), "ScorePages: batch = 0 must be in [1, 65536]");
  a.batch = 1;
  a.pooled = nullptr;
  ExpectInvalid(backend_->ScorePages(*stream_, a), "ScorePages: pooled must not be null");
}

TEST_F(OpsValidationTest, KeyCodesNeedAnEvenHeadDimTheirBufferAndAPositiveScale) {
  ScorePagesArgs a;
  a.shape = {.dtype = DType::kF32, .num_q_heads = 2, .num_kv_heads = 1, .head_dim = 9, .page_size = 4};
  a.batch = 1;
  a.max_pages = 4;
  a.q = a.summaries = buf_.data();
  a.num_pages = ints_.data();
  a.pooled = buf_.data();
  a.codes = reinterpret_cast<const uint8_t*>(bytes_.data());
  ExpectInvalid(backend_->ScorePages(*stream_, a),
                "ScorePages: shape.head_dim = 9 must be even with key codes");
  a.shape.head_dim = 8;
  a.softmax_scale = 0.0f;
  ExpectInvalid(backend_->ScorePages(*stream_, a),
                "ScorePages: softmax_scale = 0 must be positive and finite with key codes");
  a.shape.page_size = 0;
  a.softmax_scale = 1.0f;
  ExpectInvalid(backend_->ScorePages(*stream_, a), "ScorePages: shape.page_size = 0");

  OffloadItem item{0, 0, 0};
  OffloadArgs o;
  o.shape = {.dtype = DType::kF32, .num_q_heads = 2, .num_kv_heads = 1, .head_dim = 8, .page_size = 4};
  o.summary = SummaryMode::kKeyCodes;
  o.k_src = o.v_src = o.host_pages = o.summaries = buf_.data();
  o.num_src_slots = o.num_host_pages = o.num_summary_pages = 1;
  o.items = &item;
  o.num_items = 1;
  ExpectInvalid(backend_->Offload(*stream_, o), "Offload: codes must not be null");
  o.summary = static_cast<SummaryMode>(7);
  ExpectInvalid(backend_->Offload(*stream_, o),
                "Offload: summary = 7: must be minmax (0), center-mad (1) or key-codes (2)");
}

TEST_F(OpsValidationTest, TopKRejectsKLargerThanPages) {
  TopKArgs a;
  a.shape.num_kv_heads = 1;
  a.batch = 1;
  a.max_pages = 4;
  a.k = 5;
  a.pooled = buf_.data();
  a.num_pages = ints_.data();
  a.selected = ints_.data();
  ExpectInvalid(backend_->TopK(*stream_, a), "TopK: k = 5 must be in [1, 4]");
}

TEST_F(OpsValidationTest, SelectionLossNamesTheBadField) {
  SelectionLossArgs a;
  a.shape.num_kv_heads = 2;
  a.batch = 1;
  a.max_pages = 4;
  a.k = 5;
  a.pooled = buf_.data();
  a.current = a.fresh = ints_.data();
  a.loss = buf_.data();
  ExpectInvalid(backend_->SelectionLoss(*stream_, a), "SelectionLoss: k = 5 must be in [1, 4]");
  a.k = 2;
  a.shape.num_kv_heads = 0;
  ExpectInvalid(backend_->SelectionLoss(*stream_, a), "SelectionLoss: shape.num_kv_heads = 0");
  a.shape.num_kv_heads = 2;
  a.fresh = nullptr;
  ExpectInvalid(backend_->SelectionLoss(*stream_, a), "SelectionLoss: fresh must not be null");
  a.fresh = ints_.data();
  a.loss = nullptr;
  ExpectInvalid(backend_->SelectionLoss(*stream_, a), "SelectionLoss: loss must not be null");
  a.loss = buf_.data();
  a.threshold = std::nanf("");
  ExpectInvalid(backend_->SelectionLoss(*stream_, a), "SelectionLoss: threshold is NaN");
  a.threshold = 0.05f;
  EXPECT_TRUE(backend_->SelectionLoss(*stream_, a).ok());  // drifted is optional
  EXPECT_TRUE(stream_->Synchronize().ok());
}

TEST_F(OpsValidationTest, ReplaceRegionMustFitTheSlots) {
  ReplaceArgs a;
  a.shape.num_kv_heads = 2;
  a.kv.num_slots = 10;
  a.kv.slot_table = ints_.data();
  a.batch = 1;
  a.k = 4;
  a.region_begin = 7;
  a.max_pages = 8;
  ExpectInvalid(backend_->Replace(*stream_, a), "Replace: region_begin = 7 must be in [0, 6]");
  a.region_begin = 0;
  a.k = 11;
  ExpectInvalid(backend_->Replace(*stream_, a), "Replace: k = 11 must be in [1, 10]");
  a.kv.num_slots = 0;
  ExpectInvalid(backend_->Replace(*stream_, a), "Replace: kv.num_slots = 0 must be in [1, ");
}

TEST_F(OpsValidationTest, AttentionAndRecallShapes) {
  const KvShape shape{.num_q_heads = 4, .num_kv_heads = 2, .head_dim = 8, .page_size = 2048};
  SparseAttentionArgs s;
  s.shape = shape;
  s.batch = 1;
  ExpectInvalid(backend_->SparseAttention(*stream_, s),
                "SparseAttention: shape.page_size = 2048 must be in [1, 1024]");
  s.shape.page_size = 16;
  ExpectInvalid(backend_->SparseAttention(*stream_, s),
                "SparseAttention: kv.num_slots = 0 must be in [1, ");
  DenseAttentionArgs d;
  d.shape = shape;  // no page size to read
  d.batch = 1;
  d.max_tokens = 0;
  ExpectInvalid(backend_->DenseAttention(*stream_, d), "DenseAttention: max_tokens = 0");
  RecallArgs r;
  r.shape = {.num_kv_heads = 2, .head_dim = 8, .page_size = 16};
  r.num_items = 1;
  r.num_host_pages = 1;
  r.kv.num_slots = 1;
  ExpectInvalid(backend_->Recall(*stream_, r), "Recall: kv.k_cache must not be null");
  r.kv.k_cache = r.kv.v_cache = buf_.data();
  ExpectInvalid(backend_->Recall(*stream_, r), "Recall: host_pages must not be null");
}

TEST_F(OpsValidationTest, SparseAttentionOptionalFieldsNeedNothingMore) {
  SparseAttentionArgs a;
  a.shape = {
      .dtype = DType::kF32, .num_q_heads = 2, .num_kv_heads = 1, .head_dim = 8, .page_size = 4};
  a.kv = {.k_cache = buf_.data(),
          .v_cache = buf_.data(),
          .num_slots = 2,
          .slot_table = ints_.data(),
          .partial_page = ints_.data(),
          .partial_len = ints_.data()};
  a.batch = 1;
  a.q = buf_.data();
  a.out = buf_.data() + 2048;
  a.token_prob = buf_.data() + 1024;  // optional outputs and limits need nothing more
  const int64_t qpos = 3;
  a.query_position = &qpos;
  EXPECT_TRUE(backend_->SparseAttention(*stream_, a).ok());
  EXPECT_TRUE(stream_->Synchronize().ok());
}

TEST_F(OpsValidationTest, MoveHeadSlotsShapes) {
  const KvShape shape{.dtype = DType::kF32, .num_kv_heads = 2, .head_dim = 8, .page_size = 4};
  MoveHeadSlotsArgs m{.shape = shape};
  EXPECT_TRUE(backend_->MoveHeadSlots(*stream_, m).ok()) << "no items: nothing to check";
  m.kv = {.k_cache = buf_.data(), .num_slots = 2};
  m.items = reinterpret_cast<const HeadSlotMove*>(ints_.data());
  m.num_items = 1;
  ExpectInvalid(backend_->MoveHeadSlots(*stream_, m), "MoveHeadSlots: kv.v_cache must not be null");
  m.kv.v_cache = buf_.data();
  m.shape.page_size = 0;
  ExpectInvalid(backend_->MoveHeadSlots(*stream_, m), "MoveHeadSlots: shape.page_size = 0");
  m.shape.page_size = 4;
  m.num_items = -1;
  ExpectInvalid(backend_->MoveHeadSlots(*stream_, m), "MoveHeadSlots: num_items = -1");
}

TEST_F(OpsValidationTest, OutOfRangeItemsFailTheStreamAndWriteNothing) {
  const int32_t p = 2, H = 1, d = 8;
  std::vector<float> host(2 * H * 2 * p * d, 1.0f), k(p * H * d, 0.0f), v(p * H * d, 0.0f);
  std::vector<RecallItem> items = {{0, 0, 0}, {5, 0, 0}};  // host page 5 of 2
  RecallArgs r;
  r.shape = {.dtype = DType::kF32, .num_kv_heads = H, .head_dim = d, .page_size = p};
  r.kv = {.k_cache = k.data(), .v_cache = v.data(), .num_slots = 1};
  r.host_pages = host.data();
  r.num_host_pages = 2;
  r.items = items.data();
  r.num_items = 2;
  ASSERT_TRUE(backend_->Recall(*stream_, r).ok());
  const absl::Status st = stream_->Synchronize();
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(st.message()), HasSubstr("items[1].host_page = 5 must be in [0, 2)"));
  EXPECT_EQ(k[0], 0.0f);  // the valid item was not applied either: all or nothing
}

TEST_F(OpsValidationTest, StreamsOfAnotherKindAreRefused) {
  class ForeignStream : public Stream {
   public:
    absl::Status Record(Event&) override { return absl::OkStatus(); }
    absl::Status Wait(Event&) override { return absl::OkStatus(); }
    absl::Status Synchronize() override { return absl::OkStatus(); }
  } foreign;
  int x = 0, y = 1;
  EXPECT_EQ(backend_->Copy(foreign, &x, &y, 4).code(), absl::StatusCode::kInvalidArgument);
}

TEST(RegistryTest, CpuAlwaysAvailableAndAutoFallsBack) {
  auto cpu = CreateBackend(DeviceKind::kCpu, DeviceOptions{.cpu_threads = 3});
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ((*cpu)->kind(), DeviceKind::kCpu);
  EXPECT_EQ((*cpu)->Describe(), "cpu: 3 threads");
  auto any = CreateBackend(DeviceKind::kAuto);
  ASSERT_TRUE(any.ok());
  EXPECT_EQ((*any)->kind(), CudaDeviceCount() > 0 ? DeviceKind::kCuda : DeviceKind::kCpu);
  auto cuda = CreateBackend(DeviceKind::kCuda);
  if (!CudaBackendBuilt()) {
    EXPECT_EQ(cuda.status().code(), absl::StatusCode::kUnimplemented);
  } else if (CudaDeviceCount() == 0) {
    EXPECT_EQ(cuda.status().code(), absl::StatusCode::kUnavailable);
  }
  DeviceKind k;
  EXPECT_TRUE(ParseDeviceKind("cuda", &k));
  EXPECT_EQ(k, DeviceKind::kCuda);
  EXPECT_FALSE(ParseDeviceKind("tpu", &k));
}

}  // namespace
}  // namespace kvtier
