// kvtier::Mutex, MutexLock and CondVar: hand-offs between threads and the timeout edges.
// Under -DKVTIER_SANITIZE=thread these also check that TSan sees the locking.
#include "core/mutex.h"

#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace kvtier {
namespace {

// A value published by one thread and awaited by another.
class Mailbox {
 public:
  void Put(int v) {
    MutexLock lock(&mu_);
    value_ = v;
    cv_.SignalAll();
  }
  int Take() {
    MutexLock lock(&mu_);
    cv_.Await(&mu_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return value_ != 0; });
    return value_;
  }
  // The value, or 0 when none arrived within `timeout`.
  int TakeWithTimeout(absl::Duration timeout) {
    MutexLock lock(&mu_);
    auto has_value = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return value_ != 0; };
    return cv_.AwaitWithTimeout(&mu_, has_value, timeout) ? value_ : 0;
  }

 private:
  Mutex mu_;
  CondVar cv_;
  int value_ ABSL_GUARDED_BY(mu_) = 0;
};

TEST(MutexTest, CountsFromManyThreadsAreNotLost) {
  Mutex mu;
  int64_t count = 0;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) {
        MutexLock lock(&mu);
        ++count;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  MutexLock lock(&mu);
  EXPECT_EQ(count, 40000);
}

TEST(CondVarTest, AwaitReturnsWhenAnotherThreadMakesThePredicateTrue) {
  Mailbox box;
  std::thread producer([&] { box.Put(7); });
  EXPECT_EQ(box.Take(), 7);
  producer.join();
}

TEST(CondVarTest, AwaitWithInfiniteTimeoutWaitsForThePredicate) {
  Mailbox box;
  std::thread producer([&] { box.Put(3); });
  EXPECT_EQ(box.TakeWithTimeout(absl::InfiniteDuration()), 3);
  producer.join();
}

TEST(CondVarTest, AwaitWithTimeoutGivesUpWhenThePredicateStaysFalse) {
  Mailbox box;
  EXPECT_EQ(box.TakeWithTimeout(absl::Milliseconds(1)), 0);
  EXPECT_EQ(box.TakeWithTimeout(absl::ZeroDuration()), 0);
  EXPECT_EQ(box.TakeWithTimeout(-absl::Seconds(1)), 0);
}

TEST(CondVarTest, AwaitWithTimeoutSucceedsAtOnceWhenThePredicateHolds) {
  Mailbox box;
  box.Put(5);
  EXPECT_EQ(box.TakeWithTimeout(absl::ZeroDuration()), 5);
}

TEST(CondVarTest, WaitWithTimeoutReportsAnExpiredTimeout) {
  Mutex mu;
  CondVar cv;
  MutexLock lock(&mu);
  EXPECT_TRUE(cv.WaitWithTimeout(&mu, absl::ZeroDuration()));
  EXPECT_TRUE(cv.WaitWithTimeout(&mu, -absl::Milliseconds(3)));
}

}  // namespace
}  // namespace kvtier
