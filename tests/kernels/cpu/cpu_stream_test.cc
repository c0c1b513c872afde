// Ordering and error semantics of the CPU backend's streams and events. A "gate" task that
// blocks on a promise holds a stream at a known point, so no test depends on timing.
#include "kernels/cpu/cpu_stream.h"

#include <cstring>
#include <future>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/host_calls.h"
#include "kernels/cpu/cpu_backend.h"

namespace kvtier {
namespace {

class CpuStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = NewCpuBackend(2);
    s1_ = std::move(backend_->CreateStream()).value();
    s2_ = std::move(backend_->CreateStream()).value();
    ev_ = std::move(backend_->CreateEvent()).value();
  }
  CpuStream& cpu(Stream& s) { return dynamic_cast<CpuStream&>(s); }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Stream> s1_, s2_;
  std::unique_ptr<Event> ev_;
};

TEST_F(CpuStreamTest, WorkOnOneStreamRunsInOrder) {
  std::vector<int> a(1024), b(1024, 0), c(1024, 0);
  for (int i = 0; i < 1024; ++i) a[static_cast<size_t>(i)] = i * 7;
  ASSERT_TRUE(backend_->Copy(*s1_, b.data(), a.data(), 4096).ok());
  ASSERT_TRUE(backend_->Copy(*s1_, c.data(), b.data(), 4096).ok());
  ASSERT_TRUE(backend_->Memset(*s1_, a.data(), 0, 4096).ok());
  ASSERT_TRUE(s1_->Synchronize().ok());
  for (int i = 0; i < 1024; ++i) EXPECT_EQ(c[static_cast<size_t>(i)], i * 7);
  EXPECT_EQ(a[5], 0);
}

TEST_F(CpuStreamTest, WaitOnAnEventHoldsBackTheOtherStream) {
  std::promise<void> gate;
  std::future<void> opened = gate.get_future();
  // Backend memory: a copy into pageable memory would block the host (as under CUDA).
  DeviceBuffer src_buf = backend_->Allocate(sizeof(int)).value();
  DeviceBuffer dst_buf = backend_->Allocate(sizeof(int)).value();
  int& src = *src_buf.as<int>();
  int& dst = *dst_buf.as<int>();
  src = 1;
  dst = 0;
  cpu(*s1_).Enqueue([&] {
    opened.wait();
    src = 42;  // written only after the gate opens
    return absl::OkStatus();
  });
  ASSERT_TRUE(s1_->Record(*ev_).ok());
  ASSERT_TRUE(s2_->Wait(*ev_).ok());
  ASSERT_TRUE(backend_->Copy(*s2_, &dst, &src, sizeof(int)).ok());
  EXPECT_FALSE(ev_->Query());
  EXPECT_EQ(ev_->Wait(absl::Milliseconds(5)).code(), absl::StatusCode::kDeadlineExceeded);
  gate.set_value();
  ASSERT_TRUE(s2_->Synchronize().ok());
  EXPECT_EQ(dst, 42);  // the copy ran after s1's task, never before
  EXPECT_TRUE(ev_->Query());
  EXPECT_TRUE(ev_->Wait().ok());
}

TEST_F(CpuStreamTest, UnrecordedEventIsComplete) {
  EXPECT_TRUE(ev_->Query());
  EXPECT_TRUE(ev_->Wait(absl::ZeroDuration()).ok());
  int x = 0, y = 5;
  ASSERT_TRUE(s2_->Wait(*ev_).ok());
  ASSERT_TRUE(backend_->Copy(*s2_, &x, &y, sizeof(int)).ok());
  ASSERT_TRUE(s2_->Synchronize().ok());
  EXPECT_EQ(x, 5);
}

TEST_F(CpuStreamTest, RerecordingMovesTheEventForward) {
  std::promise<void> gate;
  std::future<void> opened = gate.get_future();
  ASSERT_TRUE(s1_->Record(*ev_).ok());
  ASSERT_TRUE(s1_->Synchronize().ok());
  EXPECT_TRUE(ev_->Query());
  cpu(*s1_).Enqueue([&] {
    opened.wait();
    return absl::OkStatus();
  });
  ASSERT_TRUE(s1_->Record(*ev_).ok());
  EXPECT_FALSE(ev_->Query());
  gate.set_value();
  EXPECT_TRUE(ev_->Wait().ok());
}

TEST_F(CpuStreamTest, ErrorsAreStickyAndTravelThroughEvents) {
  DeviceBuffer mem = backend_->Allocate(3 * sizeof(int)).value();
  int& x = mem.as<int>()[0];
  int& y = mem.as<int>()[1];
  int& z = mem.as<int>()[2];
  x = 0, y = 9, z = 0;
  cpu(*s1_).Enqueue([] { return absl::OutOfRangeError("page 7 out of range"); });
  ASSERT_TRUE(backend_->Copy(*s1_, &x, &y, sizeof(int)).ok());  // skipped
  ASSERT_TRUE(s1_->Record(*ev_).ok());
  ASSERT_TRUE(s2_->Wait(*ev_).ok());
  ASSERT_TRUE(backend_->Copy(*s2_, &z, &y, sizeof(int)).ok());  // skipped too
  EXPECT_EQ(s1_->Synchronize().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(ev_->Wait().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(s2_->Synchronize().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(x, 0);
  EXPECT_EQ(z, 0);
}

TEST_F(CpuStreamTest, DestroyingAStreamRunsItsQueuedWork) {
  DeviceBuffer mem = backend_->Allocate(2 * sizeof(int)).value();
  int& x = mem.as<int>()[0];
  int& y = mem.as<int>()[1];
  x = 0, y = 3;
  {
    auto s = std::move(backend_->CreateStream()).value();
    ASSERT_TRUE(backend_->Copy(*s, &x, &y, sizeof(int)).ok());
  }
  EXPECT_EQ(x, 3);
}

// CUDA's blocking rules, modelled: a copy into pageable host memory returns once it (and the
// work before it) has run, and carries the stream's error; one out of pageable memory reads
// the source before returning; registered memory and backend memory never block. Each
// blocking copy is counted (kernels/host_calls.h).
TEST_F(CpuStreamTest, CopiesIntoOrOutOfPageableMemoryBlockAndAreCounted) {
  std::promise<void> gate;
  std::future<void> opened = gate.get_future();
  DeviceBuffer dev = backend_->Allocate(sizeof(int)).value();
  *dev.as<int>() = 7;
  cpu(*s1_).Enqueue([&] {
    opened.wait();
    *dev.as<int>() = 8;
    return absl::OkStatus();
  });
  int pageable = 0;
  std::thread opener([&] { gate.set_value(); });
  HostCalls before = ThreadHostCalls();
  ASSERT_TRUE(backend_->Copy(*s1_, &pageable, dev.data(), sizeof(int)).ok());
  EXPECT_EQ(pageable, 8);  // returned only after the gated task and the copy ran
  opener.join();
  EXPECT_EQ((ThreadHostCalls() - before).sync_copies, 1);

  int registered[4] = {0, 0, 0, 0};
  ASSERT_TRUE(backend_->RegisterHost(registered, sizeof(registered)).ok());
  before = ThreadHostCalls();
  ASSERT_TRUE(backend_->Copy(*s1_, registered, dev.data(), sizeof(int)).ok());
  int source = 5;
  ASSERT_TRUE(backend_->Copy(*s1_, dev.data(), &source, sizeof(int)).ok());
  source = 6;  // the pageable source was read before Copy returned
  ASSERT_TRUE(s1_->Synchronize().ok());
  EXPECT_EQ(registered[0], 8);
  EXPECT_EQ(*dev.as<int>(), 5);
  const HostCalls made = ThreadHostCalls() - before;
  EXPECT_EQ(made.sync_copies, 1);  // the pageable source only
  EXPECT_EQ(made.waits, 1);        // Synchronize
  ASSERT_TRUE(backend_->UnregisterHost(registered).ok());

  cpu(*s2_).Enqueue([] { return absl::DataLossError("bad page"); });
  EXPECT_EQ(backend_->Copy(*s2_, &pageable, dev.data(), sizeof(int)).code(),
            absl::StatusCode::kDataLoss);
  before = ThreadHostCalls();
  { DeviceBuffer b = backend_->Allocate(64).value(); }
  EXPECT_EQ((ThreadHostCalls() - before).allocations, 1);
  EXPECT_EQ((ThreadHostCalls() - before).frees, 1);
}

// Capture (Backend::BeginCapture): the work is recorded, not run; each Launch runs it again;
// what a capture cannot hold (events, synchronisation, pageable memory) fails it.
TEST_F(CpuStreamTest, CapturedWorkRunsOncePerLaunch) {
  ASSERT_TRUE(backend_->SupportsCapture());
  DeviceBuffer mem = backend_->Allocate(2 * sizeof(int)).value();
  int* x = mem.as<int>();
  x[0] = 0, x[1] = 1;
  int runs = 0;
  ASSERT_TRUE(backend_->BeginCapture(*s1_).ok());
  cpu(*s1_).Enqueue([&] {
    ++runs;
    return absl::OkStatus();
  });
  ASSERT_TRUE(backend_->Copy(*s1_, &x[0], &x[1], sizeof(int)).ok());
  absl::StatusOr<std::unique_ptr<Graph>> graph = backend_->EndCapture(*s1_);
  ASSERT_TRUE(graph.ok()) << graph.status();
  ASSERT_TRUE(s1_->Synchronize().ok());
  EXPECT_EQ(runs, 0);
  EXPECT_EQ(x[0], 0);
  ASSERT_TRUE((*graph)->Launch(*s1_).ok());
  ASSERT_TRUE((*graph)->Launch(*s2_).ok());
  ASSERT_TRUE(s1_->Synchronize().ok());
  ASSERT_TRUE(s2_->Synchronize().ok());
  EXPECT_EQ(runs, 2);
  EXPECT_EQ(x[0], 1);

  int pageable = 0;
  ASSERT_TRUE(backend_->BeginCapture(*s1_).ok());
  EXPECT_EQ(backend_->BeginCapture(*s1_).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(backend_->Copy(*s1_, &pageable, x, sizeof(int)).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(backend_->EndCapture(*s1_).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(backend_->BeginCapture(*s1_).ok());
  EXPECT_EQ(s1_->Record(*ev_).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(backend_->EndCapture(*s1_).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(backend_->EndCapture(*s1_).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(CpuStreamTest, AllocateIsAlignedAndRejectsZero) {
  auto buf = backend_->Allocate(1000);
  ASSERT_TRUE(buf.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buf->data()) % 256, 0u);
  EXPECT_EQ(buf->size(), 1000u);
  EXPECT_EQ(backend_->Allocate(0).status().code(), absl::StatusCode::kInvalidArgument);
  DeviceBuffer moved = std::move(*buf);
  EXPECT_EQ(buf->data(), nullptr);
  EXPECT_NE(moved.data(), nullptr);
}

}  // namespace
}  // namespace kvtier
