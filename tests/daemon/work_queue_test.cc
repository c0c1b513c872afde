// WorkQueue: jobs run exactly once on a worker; tenants are served round-robin; the queue is
// bounded (RESOURCE_EXHAUSTED with a retry hint); a tenant whose jobs block holds at most its
// share of the workers; Shutdown hands jobs that never started UNAVAILABLE. Workers are held with a
// gate, so every ordering below is deterministic.
#include "daemon/work_queue.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "core/mutex.h"
#include "daemon/caller.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::daemon {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Records the order jobs ran in, and holds the worker at a gate when asked to.
struct Recorder {
  Mutex mu;
  CondVar cv;
  std::vector<std::string> ran ABSL_GUARDED_BY(mu);
  std::vector<absl::Status> statuses ABSL_GUARDED_BY(mu);
  bool gate_open ABSL_GUARDED_BY(mu) = false;
  bool at_gate ABSL_GUARDED_BY(mu) = false;

  WorkQueue::Job Job(std::string name) {
    return [this, name](absl::Status st) {
      MutexLock lock(&mu);
      ran.push_back(name);
      statuses.push_back(st);
      cv.SignalAll();
    };
  }
  WorkQueue::Job Gate() {
    return [this](absl::Status) {
      MutexLock lock(&mu);
      at_gate = true;
      cv.SignalAll();
      cv.Await(&mu, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return gate_open; });
    };
  }
  void AwaitGate() {
    MutexLock lock(&mu);
    cv.Await(&mu, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return at_gate; });
  }
  void Open() {
    MutexLock lock(&mu);
    gate_open = true;
    cv.SignalAll();
  }
  void AwaitRan(size_t n) {
    MutexLock lock(&mu);
    cv.Await(&mu, [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return ran.size() >= n; });
  }
};

std::unique_ptr<WorkQueue> Queue(int threads, uint32_t max_queued) {
  absl::StatusOr<std::unique_ptr<WorkQueue>> q =
      WorkQueue::Create({.threads = threads, .max_queued = max_queued});
  EXPECT_TRUE(q.ok()) << q.status();
  return q.ok() ? *std::move(q) : nullptr;
}

TEST(WorkQueueTest, TenantsAreServedRoundRobin) {
  Recorder r;
  std::unique_ptr<WorkQueue> q = Queue(1, 16);
  ASSERT_TRUE(q->Submit("gate", r.Gate()).ok());
  r.AwaitGate();
  // Tenant a floods first; b and c arrive later, yet wait one job of a each at most.
  for (const char* name : {"a1", "a2", "a3", "a4"}) ASSERT_TRUE(q->Submit("a", r.Job(name)).ok());
  ASSERT_TRUE(q->Submit("b", r.Job("b1")).ok());
  ASSERT_TRUE(q->Submit("c", r.Job("c1")).ok());
  ASSERT_TRUE(q->Submit("b", r.Job("b2")).ok());
  EXPECT_EQ(q->queued(), 7u);
  r.Open();
  r.AwaitRan(7);
  MutexLock lock(&r.mu);
  EXPECT_THAT(r.ran, ElementsAre("a1", "b1", "c1", "a2", "b2", "a3", "a4"));
  for (const absl::Status& st : r.statuses) EXPECT_TRUE(st.ok()) << st;
}

TEST(WorkQueueTest, AFullQueueRefusesWithARetryHint) {
  Recorder r;
  std::unique_ptr<WorkQueue> q = Queue(1, 2);
  ASSERT_TRUE(q->Submit("gate", r.Gate()).ok());
  r.AwaitGate();
  ASSERT_TRUE(q->Submit("a", r.Job("a1")).ok());
  ASSERT_TRUE(q->Submit("b", r.Job("b1")).ok());
  absl::Status full = q->Submit("c", r.Job("c1"));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("server.max_queued_calls = 2"));
  std::optional<std::string> hint = Trailer(full, kRetryAfterTrailer);
  ASSERT_TRUE(hint.has_value());
  EXPECT_GE(std::stoi(*hint), 1);
  EXPECT_EQ(q->refused(), 1u);
  r.Open();
  r.AwaitRan(2);
  EXPECT_TRUE(q->Submit("c", r.Job("c1")).ok());  // room again
  r.AwaitRan(3);
}

TEST(WorkQueueTest, ShutdownHandsJobsThatNeverStartedUnavailable) {
  Recorder r;
  std::unique_ptr<WorkQueue> q = Queue(1, 8);
  ASSERT_TRUE(q->Submit("gate", r.Gate()).ok());
  r.AwaitGate();
  ASSERT_TRUE(q->Submit("a", r.Job("a1")).ok());
  ASSERT_TRUE(q->Submit("b", r.Job("b1")).ok());
  std::thread opener([&r] { r.Open(); });  // the gate job must finish for Shutdown to join
  q->Shutdown();
  opener.join();
  EXPECT_EQ(q->Submit("a", r.Job("late")).code(), absl::StatusCode::kUnavailable);
  MutexLock lock(&r.mu);
  ASSERT_EQ(r.ran.size(), 2u);  // each exactly once, neither on a worker
  for (const absl::Status& st : r.statuses) {
    EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  }
}

TEST(WorkQueueTest, ATenantWhoseJobsBlockLeavesAWorkerToOthers) {
  Recorder r;
  std::unique_ptr<WorkQueue> q = Queue(2, 16);
  EXPECT_EQ(q->max_running_per_tenant(), 1);  // all but one of 2
  // Tenant a's jobs block (a stalled cold-tier node): the first holds a worker, the second
  // waits for a's share rather than taking the other worker.
  ASSERT_TRUE(q->Submit("a", r.Gate()).ok());
  r.AwaitGate();
  ASSERT_TRUE(q->Submit("a", r.Gate()).ok());
  ASSERT_TRUE(q->Submit("b", r.Job("b1")).ok());
  {
    MutexLock lock(&r.mu);
    EXPECT_TRUE(r.cv.AwaitWithTimeout(
        &r.mu, [&r]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(r.mu) { return !r.ran.empty(); },
        absl::Seconds(10)))
        << "tenant b's job waited for tenant a's blocked ones";
  }
  EXPECT_EQ(q->queued(), 1u);  // a's second job, still waiting for a's worker
  r.Open();
  ASSERT_TRUE(q->Submit("a", r.Job("a3")).ok());
  r.AwaitRan(2);
  MutexLock lock(&r.mu);
  EXPECT_THAT(r.ran, ElementsAre("b1", "a3"));
}

TEST(WorkQueueTest, OptionsOutOfRangeAreRefused) {
  EXPECT_EQ(WorkQueue::Create({.threads = 0}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WorkQueue::Create({.threads = 1, .max_queued = 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WorkQueue::Create({.threads = 2, .max_running_per_tenant = 3}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WorkQueue::Create({.threads = 2, .max_running_per_tenant = -1}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier::daemon
