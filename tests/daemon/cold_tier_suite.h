// Test helper: a RedisClusterSuite (tests/testutil/redis_cluster_suite.h) whose every test
// starts connected to the suite's cluster (cluster_, 500 ms command timeout) with a cold tier
// over it (tier_) under the key prefix `kPrefix`.
//
//   class MyTest : public kvtier::testing::ColdTierSuite<MyTest, kMyPrefix> { ... };
#ifndef KVTIER_TESTS_DAEMON_COLD_TIER_SUITE_H_
#define KVTIER_TESTS_DAEMON_COLD_TIER_SUITE_H_

#include <memory>
#include <utility>

#include "absl/time/time.h"
#include "daemon/cold_tier.h"
#include "daemon/redis_cluster.h"
#include "gtest/gtest.h"
#include "tests/testutil/redis_cluster_suite.h"

namespace kvtier::testing {

template <typename Suite, const char* kPrefix>
class ColdTierSuite : public ::kvtier::testing::RedisClusterSuite<Suite> {
 protected:
  using Base = ::kvtier::testing::RedisClusterSuite<Suite>;
  void SetUp() override {
    Base::SetUp();
    if (this->IsSkipped() || this->HasFatalFailure()) return;
    daemon::RedisClusterOptions options;
    options.seeds = Base::process()->seeds();
    options.command_timeout = absl::Milliseconds(500);
    auto cluster = daemon::RedisCluster::Connect(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
    auto tier = daemon::ColdTier::Create(cluster_.get(), kPrefix);
    ASSERT_TRUE(tier.ok()) << tier.status();
    tier_ = *std::move(tier);
  }

  std::unique_ptr<daemon::RedisCluster> cluster_;
  std::unique_ptr<daemon::ColdTier> tier_;
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_DAEMON_COLD_TIER_SUITE_H_
