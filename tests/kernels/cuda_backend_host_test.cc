// The host side of the CUDA backend's decode path: which calls block the host (counted per
// thread, kernels/host_calls.h), stream priorities, CopyBatch's range-by-range fallback,
// sparse attention's caller-provided workspace and alignment contract, and stream capture
// into CUDA graphs (replays equal direct launches; a replay's failure reaches the launching
// stream). Every test skips itself without a device.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_stream.h"
#include "kernels/host_calls.h"
#include "kernels/ops.h"
#include "kernels/registry.h"
#include "kvtier/layout.h"
#include "tests/kernels/cuda/cuda_test_util.h"
#include "tests/testutil/random_fill.h"

namespace kvtier {
namespace {

using testing::AlignedHostBuffer;
using testing::ScopedRegistration;
using testing::TypedBuffer;

// One decode step's buffers for a layer (B = 1, fp16, Hq = 8, Hkv = 2, d = 128, p = 32) over
// S = 64 full slots but the partial last: 2048 tokens, enough for a split plan on any GPU.
struct Step {
  static constexpr int32_t kHq = 8, kHkv = 2, kD = 128, kP = 32, kS = 64, kK = 8;
  static constexpr KvShape kShape{DType::kF16, kHq, kHkv, kD, kP};

  DeviceBuffer q, k, v, summaries, num_pages, slot_table, partial_page, partial_len;
  DeviceBuffer pooled, selected, out, lse, token_prob, workspace;

  ScorePagesArgs Score() const {
    ScorePagesArgs a;
    a.shape = kShape;
    a.batch = 1;
    a.max_pages = kS;
    a.q = q.data();
    a.summaries = summaries.data();
    a.num_pages = num_pages.as<int32_t>();
    a.pooled = pooled.as<float>();
    return a;
  }
  TopKArgs Select() const {
    TopKArgs a;
    a.shape = kShape;
    a.batch = 1;
    a.max_pages = kS;
    a.k = kK;
    a.pooled = pooled.as<float>();
    a.num_pages = num_pages.as<int32_t>();
    a.selected = selected.as<int32_t>();
    return a;
  }
  // With the workspace when `with_workspace`.
  SparseAttentionArgs Attend(bool with_workspace) const {
    SparseAttentionArgs a;
    a.shape = kShape;
    a.kv = PagedKv{.k_cache = k.data(),
                   .v_cache = v.data(),
                   .num_slots = kS,
                   .slot_table = slot_table.as<int32_t>(),
                   .partial_page = partial_page.as<int32_t>(),
                   .partial_len = partial_len.as<int32_t>()};
    a.batch = 1;
    a.q = q.data();
    a.softmax_scale = 0.088f;
    a.out = out.data();
    a.lse = lse.as<float>();
    a.token_prob = token_prob.as<float>();
    if (with_workspace) {
      a.workspace = workspace.data();
      a.workspace_bytes = workspace.size();
    }
    return a;
  }
};

class CudaBackendHostTest : public testing::CudaTestBase<> {
 protected:
  template <typename T>
  absl::StatusOr<DeviceBuffer> UploadVector(const std::vector<T>& v) {
    return Upload(v.data(), v.size() * sizeof(T));
  }
  absl::StatusOr<DeviceBuffer> UploadTyped(const TypedBuffer& b) {
    return Upload(b.data(), b.bytes());
  }
  absl::StatusOr<std::vector<unsigned char>> Read(const DeviceBuffer& b) {
    std::vector<unsigned char> host(b.size());
    absl::Status st = Download(host.data(), b.data(), b.size());
    if (!st.ok()) return st;
    return host;
  }

  // Inputs random, outputs filled with 0x7f bytes, the workspace sized for Attend.
  absl::StatusOr<Step> MakeStep() {
    Step s;
    TypedBuffer q(DType::kF16, Step::kHq * Step::kD);
    TypedBuffer k(DType::kF16, int64_t{Step::kS} * Step::kP * Step::kHkv * Step::kD);
    TypedBuffer v(DType::kF16, k.size());
    TypedBuffer sums(DType::kF16, int64_t{Step::kS} * Step::kHkv * 2 * Step::kD);
    q.FillNormal(1);
    k.FillNormal(2);
    v.FillNormal(3);
    sums.FillNormal(4);
    std::vector<int32_t> table(Step::kHkv * Step::kS);
    std::iota(table.begin(), table.end(), 0);
    for (int32_t& page : table) page = page % Step::kS % 7 == 3 ? kEmptySlot : page % Step::kS;
    KVTIER_ASSIGN_OR_RETURN(s.q, UploadTyped(q));
    KVTIER_ASSIGN_OR_RETURN(s.k, UploadTyped(k));
    KVTIER_ASSIGN_OR_RETURN(s.v, UploadTyped(v));
    KVTIER_ASSIGN_OR_RETURN(s.summaries, UploadTyped(sums));
    KVTIER_ASSIGN_OR_RETURN(s.num_pages, UploadVector(std::vector<int32_t>{Step::kS}));
    KVTIER_ASSIGN_OR_RETURN(s.slot_table, UploadVector(table));
    KVTIER_ASSIGN_OR_RETURN(s.partial_page, UploadVector(std::vector<int32_t>{Step::kS - 1}));
    KVTIER_ASSIGN_OR_RETURN(s.partial_len, UploadVector(std::vector<int32_t>{17}));
    for (auto [buffer, bytes] :
         {std::pair{&s.pooled, sizeof(float) * Step::kHkv * Step::kS},
          std::pair{&s.selected, sizeof(int32_t) * Step::kHkv * Step::kK},
          std::pair{&s.out, DTypeSize(DType::kF16) * Step::kHq * Step::kD},
          std::pair{&s.lse, sizeof(float) * Step::kHq},
          std::pair{&s.token_prob, sizeof(float) * Step::kHq * Step::kS * Step::kP}}) {
      KVTIER_ASSIGN_OR_RETURN(*buffer, backend_->Allocate(bytes));
    }
    KVTIER_RETURN_IF_ERROR(ClearOutputs(s));
    const size_t workspace = backend_->SparseAttentionWorkspaceBytes(s.Attend(false));
    if (workspace > 0) {
      KVTIER_ASSIGN_OR_RETURN(s.workspace, backend_->Allocate(workspace));
    }
    return s;
  }
  absl::Status ClearOutputs(Step& s) {
    for (DeviceBuffer* b : {&s.pooled, &s.selected, &s.out, &s.lse, &s.token_prob}) {
      KVTIER_RETURN_IF_ERROR(backend_->Memset(*stream_, b->data(), 0x7f, b->size()));
    }
    return stream_->Synchronize();
  }
  // Every output of the step, concatenated.
  absl::StatusOr<std::vector<unsigned char>> Outputs(const Step& s) {
    std::vector<unsigned char> all;
    for (const DeviceBuffer* b : {&s.pooled, &s.selected, &s.out, &s.lse, &s.token_prob}) {
      KVTIER_ASSIGN_OR_RETURN(std::vector<unsigned char> bytes, Read(*b));
      all.insert(all.end(), bytes.begin(), bytes.end());
    }
    return all;
  }
  absl::Status EnqueueStep(Stream& stream, const Step& s, bool with_workspace) {
    KVTIER_RETURN_IF_ERROR(backend_->ScorePages(stream, s.Score()));
    KVTIER_RETURN_IF_ERROR(backend_->TopK(stream, s.Select()));
    return backend_->SparseAttention(stream, s.Attend(with_workspace));
  }
};

// ---- Host-call counts ----

TEST_F(CudaBackendHostTest, CountsTheCallsThatBlockTheHost) {
  constexpr size_t kBytes = 1 << 16;
  HostCalls start = ThreadHostCalls();
  absl::StatusOr<DeviceBuffer> device = backend_->Allocate(kBytes);
  ASSERT_TRUE(device.ok()) << device.status();
  EXPECT_EQ((ThreadHostCalls() - start).allocations, 1);
  KVTIER_ASSERT_OK(backend_->Memset(*stream_, device->data(), 0x5a, kBytes));

  start = ThreadHostCalls();  // into pageable memory: one synchronous copy
  std::vector<unsigned char> pageable(kBytes);
  KVTIER_ASSERT_OK(backend_->Copy(*stream_, pageable.data(), device->data(), kBytes));
  KVTIER_ASSERT_OK(stream_->Synchronize());
  HostCalls delta = ThreadHostCalls() - start;
  EXPECT_EQ(delta.sync_copies, 1);
  EXPECT_EQ(delta.waits, 1);
  EXPECT_EQ(pageable[kBytes - 1], 0x5a);

  AlignedHostBuffer pinned(kBytes);
  start = ThreadHostCalls();  // into registered memory: asynchronous
  {
    ScopedRegistration registration(*backend_, pinned.data(), kBytes);
    KVTIER_ASSERT_OK(registration.status());
    auto event = backend_->CreateEvent();
    ASSERT_TRUE(event.ok()) << event.status();
    KVTIER_ASSERT_OK(backend_->Copy(*stream_, pinned.data(), device->data(), kBytes));
    auto* pinned_half = static_cast<char*>(pinned.data()) + kBytes / 2;
    auto* device_half = static_cast<char*>(device->data()) + kBytes / 2;
    const CopyRange ranges[] = {{pinned.data(), device->data(), kBytes / 2},
                                {device_half, pinned_half, kBytes / 2}};
    KVTIER_ASSERT_OK(backend_->CopyBatch(*stream_, ranges, 2));
    KVTIER_ASSERT_OK(stream_->Record(**event));
    KVTIER_ASSERT_OK((*event)->Wait());
  }
  delta = ThreadHostCalls() - start;
  EXPECT_EQ(delta.sync_copies, 0);
  EXPECT_EQ(delta.waits, 1);
  EXPECT_EQ(delta.allocations, 1);  // the registration
  EXPECT_EQ(delta.frees, 1);        // and its release
  EXPECT_EQ(static_cast<unsigned char*>(pinned.data())[kBytes - 1], 0x5a);

  start = ThreadHostCalls();  // a batch counts each range that touches pageable memory
  const CopyRange mixed[] = {{pageable.data(), device->data(), 64},
                             {static_cast<char*>(device->data()) + 64, device->data(), 64}};
  KVTIER_ASSERT_OK(backend_->CopyBatch(*stream_, mixed, 2));
  EXPECT_EQ((ThreadHostCalls() - start).sync_copies, 1);
  KVTIER_ASSERT_OK(stream_->Synchronize());

  start = ThreadHostCalls();
  device->Reset();
  EXPECT_EQ((ThreadHostCalls() - start).frees, 1);
}

// ---- Priorities ----

TEST_F(CudaBackendHostTest, NormalStreamsOutrankLowOnes) {
  int least = 0, greatest = 0;
  ASSERT_EQ(cudaDeviceGetStreamPriorityRange(&least, &greatest), cudaSuccess);
  auto low = backend_->CreateStream(StreamPriority::kLow);
  ASSERT_TRUE(low.ok()) << low.status();
  auto* normal_cuda = dynamic_cast<cuda::CudaStream*>(stream_.get());
  auto* low_cuda = dynamic_cast<cuda::CudaStream*>(low->get());
  ASSERT_TRUE(normal_cuda != nullptr && low_cuda != nullptr);
  int normal_priority = 0, low_priority = 0;
  ASSERT_EQ(cudaStreamGetPriority(normal_cuda->handle(), &normal_priority), cudaSuccess);
  ASSERT_EQ(cudaStreamGetPriority(low_cuda->handle(), &low_priority), cudaSuccess);
  EXPECT_EQ(normal_priority, greatest);
  EXPECT_EQ(low_priority, least);
  if (least == greatest) GTEST_SKIP() << "the device has one stream priority";
  EXPECT_LT(normal_priority, low_priority);  // numerically lower runs first
}

// ---- CopyBatch fallback ----

// Device → registered host, device → device and registered host → device ranges; returns
// the host buffer and the second device buffer afterwards.
absl::StatusOr<std::vector<unsigned char>> RunBatch(Backend& backend) {
  constexpr size_t kBytes = 1 << 16, kRange = 1000;
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, backend.CreateStream());
  KVTIER_ASSIGN_OR_RETURN(DeviceBuffer a, backend.Allocate(kBytes));
  KVTIER_ASSIGN_OR_RETURN(DeviceBuffer b, backend.Allocate(kBytes));
  AlignedHostBuffer host(2 * kBytes);
  auto* bytes = static_cast<unsigned char*>(host.data());
  for (size_t i = 0; i < 2 * kBytes; ++i) bytes[i] = static_cast<unsigned char>(i * 7 + 3);
  ScopedRegistration registration(backend, host.data(), host.bytes());
  KVTIER_RETURN_IF_ERROR(registration.status());
  KVTIER_RETURN_IF_ERROR(backend.Copy(*stream, a.data(), bytes + kBytes, kBytes));
  KVTIER_RETURN_IF_ERROR(backend.Memset(*stream, b.data(), 0, kBytes));
  std::vector<CopyRange> ranges;
  for (size_t off = 0; off + kRange <= kBytes / 2; off += 3 * kRange) {
    auto* da = static_cast<unsigned char*>(a.data());
    auto* db = static_cast<unsigned char*>(b.data());
    ranges.push_back({bytes + off, da + off + 17, kRange});                   // D2H
    ranges.push_back({db + off + kRange, da + off, kRange});                  // D2D
    ranges.push_back({db + kBytes / 2 + off, bytes + off + kBytes, kRange});  // H2D
  }
  ranges.push_back({bytes + kBytes - 1, bytes, 0});  // empty: skipped
  KVTIER_RETURN_IF_ERROR(backend.CopyBatch(*stream, ranges.data(), ranges.size()));
  std::vector<unsigned char> out(2 * kBytes);
  KVTIER_RETURN_IF_ERROR(backend.Copy(*stream, out.data() + kBytes, b.data(), kBytes));
  KVTIER_RETURN_IF_ERROR(stream->Synchronize());
  std::memcpy(out.data(), bytes, kBytes);
  return out;
}

TEST_F(CudaBackendHostTest, CopyBatchFallbackCopiesTheSameBytes) {
  ASSERT_EQ(setenv("KVTIER_CUDA_NO_BATCH_COPY", "1", 1), 0);
  absl::StatusOr<std::unique_ptr<Backend>> fallback = CreateBackend(DeviceKind::kCuda);
  ASSERT_EQ(unsetenv("KVTIER_CUDA_NO_BATCH_COPY"), 0);
  ASSERT_TRUE(fallback.ok()) << fallback.status();
  EXPECT_TRUE(absl::StrContains((*fallback)->Describe(),
                                "batched copies off (KVTIER_CUDA_NO_BATCH_COPY=1)"))
      << (*fallback)->Describe();
  absl::StatusOr<std::vector<unsigned char>> batched = RunBatch(*backend_);
  absl::StatusOr<std::vector<unsigned char>> each = RunBatch(**fallback);
  ASSERT_TRUE(batched.ok()) << batched.status();
  ASSERT_TRUE(each.ok()) << each.status();
  EXPECT_EQ(testing::FirstDifference(batched->data(), each->data(), batched->size(), 1), -1);
  EXPECT_EQ((*batched)[0], static_cast<unsigned char>(((1 << 16) + 17) * 7 + 3));
}

// ---- Sparse attention: workspace and alignment ----

TEST_F(CudaBackendHostTest, AttentionWithAWorkspaceEqualsAttentionWithout) {
  absl::StatusOr<Step> step = MakeStep();
  ASSERT_TRUE(step.ok()) << step.status();
  const size_t with_prob = backend_->SparseAttentionWorkspaceBytes(step->Attend(false));
  SparseAttentionArgs no_prob = step->Attend(false);
  no_prob.token_prob = nullptr;
  const size_t without_prob = backend_->SparseAttentionWorkspaceBytes(no_prob);
  EXPECT_GT(without_prob, 0u);                                         // a split plan: partials
  EXPECT_EQ(with_prob, without_prob + 2 * sizeof(float) * Step::kHq);  // and final (m, l)
  ASSERT_EQ(step->workspace.size(), with_prob);

  KVTIER_ASSERT_OK(backend_->SparseAttention(*stream_, step->Attend(false)));
  absl::StatusOr<std::vector<unsigned char>> registry = Outputs(*step);
  ASSERT_TRUE(registry.ok()) << registry.status();
  KVTIER_ASSERT_OK(ClearOutputs(*step));
  auto fresh = backend_->CreateStream();
  ASSERT_TRUE(fresh.ok());
  const HostCalls start = ThreadHostCalls();
  KVTIER_ASSERT_OK(backend_->SparseAttention(**fresh, step->Attend(true)));
  EXPECT_EQ((ThreadHostCalls() - start).allocations, 0);  // no scratch of its own
  KVTIER_ASSERT_OK((*fresh)->Synchronize());
  absl::StatusOr<std::vector<unsigned char>> workspace = Outputs(*step);
  ASSERT_TRUE(workspace.ok()) << workspace.status();
  EXPECT_EQ(testing::FirstDifference(registry->data(), workspace->data(), registry->size(), 1), -1);
}

TEST_F(CudaBackendHostTest, MisalignedViewsAreRefusedNamingTheField) {
  absl::StatusOr<Step> step = MakeStep();
  ASSERT_TRUE(step.ok()) << step.status();
  auto expect_refused = [&](const SparseAttentionArgs& a, const char* field) {
    const absl::Status st = backend_->SparseAttention(*stream_, a);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << field << ": " << st;
    EXPECT_TRUE(absl::StrContains(st.message(), field)) << st;
  };
  SparseAttentionArgs a = step->Attend(true);
  a.kv.k_cache = static_cast<char*>(step->k.data()) + 2;  // one fp16 element off
  expect_refused(a, "kv.k_cache (");
  a = step->Attend(true);
  a.kv.v_cache = static_cast<char*>(step->v.data()) + 8;
  expect_refused(a, "kv.v_cache (");
  a = step->Attend(true);
  a.q = static_cast<const char*>(step->q.data()) + 1;
  expect_refused(a, "q (");
  a = step->Attend(true);
  a.shape.head_dim = 12;  // not a multiple of 8 fp16 elements
  expect_refused(a, "shape.head_dim = 12");
  KVTIER_ASSERT_OK(stream_->Synchronize());  // nothing was launched
}

// ---- Capture ----

TEST_F(CudaBackendHostTest, ReplayedGraphsEqualDirectLaunches) {
  ASSERT_TRUE(backend_->SupportsCapture());
  absl::StatusOr<Step> step = MakeStep();
  ASSERT_TRUE(step.ok()) << step.status();
  KVTIER_ASSERT_OK(EnqueueStep(*stream_, *step, /*with_workspace=*/true));
  absl::StatusOr<std::vector<unsigned char>> direct = Outputs(*step);
  ASSERT_TRUE(direct.ok()) << direct.status();

  KVTIER_ASSERT_OK(ClearOutputs(*step));
  KVTIER_ASSERT_OK(backend_->BeginCapture(*stream_));
  const HostCalls start = ThreadHostCalls();
  KVTIER_ASSERT_OK(EnqueueStep(*stream_, *step, /*with_workspace=*/true));
  EXPECT_EQ((ThreadHostCalls() - start).total(), 0);
  absl::StatusOr<std::unique_ptr<Graph>> graph = backend_->EndCapture(*stream_);
  ASSERT_TRUE(graph.ok()) << graph.status();
  KVTIER_ASSERT_OK(stream_->Synchronize());
  absl::StatusOr<std::vector<unsigned char>> untouched = Outputs(*step);
  ASSERT_TRUE(untouched.ok());
  EXPECT_EQ((*untouched)[0], 0x7f);  // capturing ran nothing

  auto other = backend_->CreateStream();
  ASSERT_TRUE(other.ok());
  for (Stream* s : {stream_.get(), other->get()}) {
    KVTIER_ASSERT_OK(ClearOutputs(*step));
    KVTIER_ASSERT_OK((*graph)->Launch(*s));
    KVTIER_ASSERT_OK(s->Synchronize());
    absl::StatusOr<std::vector<unsigned char>> replay = Outputs(*step);
    ASSERT_TRUE(replay.ok()) << replay.status();
    EXPECT_EQ(testing::FirstDifference(direct->data(), replay->data(), direct->size(), 1), -1);
  }
}

TEST_F(CudaBackendHostTest, AReplayFailureReachesTheLaunchingStream) {
  absl::StatusOr<Step> step = MakeStep();
  ASSERT_TRUE(step.ok()) << step.status();
  KVTIER_ASSERT_OK(backend_->BeginCapture(*stream_));
  KVTIER_ASSERT_OK(backend_->SparseAttention(*stream_, step->Attend(true)));
  absl::StatusOr<std::unique_ptr<Graph>> graph = backend_->EndCapture(*stream_);
  ASSERT_TRUE(graph.ok()) << graph.status();
  const std::vector<int32_t> bad_len = {Step::kP + 1};
  KVTIER_ASSERT_OK(
      backend_->Copy(*stream_, step->partial_len.data(), bad_len.data(), sizeof(int32_t)));
  KVTIER_ASSERT_OK(stream_->Synchronize());

  auto other = backend_->CreateStream();
  auto event = backend_->CreateEvent();
  ASSERT_TRUE(other.ok() && event.ok());
  KVTIER_ASSERT_OK((*graph)->Launch(**other));
  KVTIER_ASSERT_OK((*other)->Record(**event));
  const absl::Status waited = (*event)->Wait();
  EXPECT_EQ(waited.code(), absl::StatusCode::kOutOfRange) << waited;
  EXPECT_TRUE(absl::StrContains(waited.message(), "partial_len[0] = 33")) << waited;
  EXPECT_EQ((*other)->Synchronize().code(), absl::StatusCode::kOutOfRange);
  const absl::Status own = stream_->Synchronize();
  EXPECT_TRUE(own.ok()) << own;  // the capture stream ran none of it
}

TEST_F(CudaBackendHostTest, CaptureRefusesWhatAGraphCannotHold) {
  auto event = backend_->CreateEvent();
  ASSERT_TRUE(event.ok());
  absl::StatusOr<DeviceBuffer> device = backend_->Allocate(256);
  ASSERT_TRUE(device.ok());
  std::vector<unsigned char> pageable(256);

  KVTIER_ASSERT_OK(backend_->BeginCapture(*stream_));
  EXPECT_EQ(backend_->BeginCapture(*stream_).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(stream_->Synchronize().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(stream_->Record(**event).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(stream_->Wait(**event).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(backend_->Copy(*stream_, pageable.data(), device->data(), 256).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(backend_->Memset(*stream_, device->data(), 1, 256).ok());  // device memory
  const absl::Status ended = backend_->EndCapture(*stream_).status();
  EXPECT_EQ(ended.code(), absl::StatusCode::kFailedPrecondition) << ended;
  EXPECT_TRUE(absl::StrContains(ended.message(), "Synchronize on a capturing stream")) << ended;

  // The stream works as before.
  KVTIER_ASSERT_OK(backend_->Copy(*stream_, pageable.data(), device->data(), 256));
  KVTIER_ASSERT_OK(stream_->Record(**event));
  KVTIER_ASSERT_OK(stream_->Synchronize());
  EXPECT_EQ(backend_->EndCapture(*stream_).status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace kvtier
