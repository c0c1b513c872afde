// Ordering and error semantics of the CPU backend's streams and events. A "gate" task that
// blocks on a promise holds a stream at a known point, so no test depends on timing.
#include "kernels/cpu/cpu_stream.h"

#include <cstring>
#include <future>
#include <vector>

#include "gtest/gtest.h"
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
  int src = 1, dst = 0;
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
  int x = 0, y = 9, z = 0;
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
  int x = 0, y = 3;
  {
    auto s = std::move(backend_->CreateStream()).value();
    ASSERT_TRUE(backend_->Copy(*s, &x, &y, sizeof(int)).ok());
  }
  EXPECT_EQ(x, 3);
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
