// Test helper: a gtest suite over one real Redis Cluster (RedisClusterProcess) started once
// for the whole suite, since its nodes take seconds to start. Every test of the suite skips
// when redis-server is missing (NOT_FOUND) and fails when the cluster did not start.
//
//   class MyTest : public kvtier::testing::RedisClusterSuite<MyTest> {
//     void SetUp() override {
//       RedisClusterSuite::SetUp();
//       if (IsSkipped() || HasFatalFailure()) return;
//       ... process()->seeds() ...
//     }
//   };
#ifndef KVTIER_TESTS_TESTUTIL_REDIS_CLUSTER_SUITE_H_
#define KVTIER_TESTS_TESTUTIL_REDIS_CLUSTER_SUITE_H_

#include <memory>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/testutil/redis_cluster_process.h"

namespace kvtier::testing {

// `Suite` is the deriving fixture: each suite has its own cluster.
template <typename Suite>
class RedisClusterSuite : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto started = RedisClusterProcess::Start({});
    if (!started.ok()) {
      Reason() = started.status().ToString();
      return;
    }
    Process() = *std::move(started);
  }
  static void TearDownTestSuite() {
    Process().reset();
    Reason().clear();
  }
  void SetUp() override {
    if (Process() != nullptr) return;
    if (absl::StartsWith(Reason(), "NOT_FOUND")) GTEST_SKIP() << Reason();
    FAIL() << "cluster did not start: " << Reason();
  }
  // The suite's cluster; null only when SetUp skipped or failed the test.
  static RedisClusterProcess* process() { return Process().get(); }

 private:
  static std::unique_ptr<RedisClusterProcess>& Process() {
    static std::unique_ptr<RedisClusterProcess> process;
    return process;
  }
  static std::string& Reason() {
    static std::string reason;
    return reason;
  }
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_TESTUTIL_REDIS_CLUSTER_SUITE_H_
