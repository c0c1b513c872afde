// LogLimiter: a burst per key, then a steady rate; suppressed lines are counted and reported
// with the next line let through; keys do not share a budget. Time is passed in, so nothing
// here waits.
#include "absl/time/time.h"
#include "daemon/logging.h"
#include "gtest/gtest.h"

namespace kvtier::daemon {
namespace {

TEST(LogLimiterTest, BurstThenRateWithTheSuppressedCount) {
  LogLimiter limiter(/*per_second=*/2, /*burst=*/3);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  uint64_t suppressed = 99;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(limiter.Allow("bad utf-8", t0, &suppressed)) << i;
    EXPECT_EQ(suppressed, 0u);
  }
  for (int i = 0; i < 1000; ++i) EXPECT_FALSE(limiter.Allow("bad utf-8", t0, &suppressed));
  // Another kind of line has its own budget.
  EXPECT_TRUE(limiter.Allow("grpc", t0, &suppressed));
  // Half a second later one more line (2 a second), reporting the 1000 it replaces.
  EXPECT_FALSE(limiter.Allow("bad utf-8", t0 + absl::Milliseconds(400), &suppressed));
  ASSERT_TRUE(limiter.Allow("bad utf-8", t0 + absl::Milliseconds(500), &suppressed));
  EXPECT_EQ(suppressed, 1001u);
  // A long quiet spell refills the burst, no more.
  const absl::Time later = t0 + absl::Hours(1);
  int allowed = 0;
  for (int i = 0; i < 10; ++i) allowed += limiter.Allow("bad utf-8", later, &suppressed);
  EXPECT_EQ(allowed, 3);
}

}  // namespace
}  // namespace kvtier::daemon
