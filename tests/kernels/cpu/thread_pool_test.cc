#include "kernels/cpu/thread_pool.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvtier {
namespace {

TEST(ThreadPoolTest, CoversEveryIndexExactlyOnce) {
  ThreadPool pool(4);
  EXPECT_EQ(pool.num_threads(), 4);
  for (int64_t grain : {1, 3, 7, 1000}) {
    std::vector<std::atomic<int>> hits(1001);
    pool.ParallelFor(1001, grain, [&](int64_t b, int64_t e) {
      EXPECT_LE(e - b, grain);
      for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)]++;
    });
    for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  }
}

TEST(ThreadPoolTest, EmptyRangeRunsNothing) {
  ThreadPool pool(2);
  bool ran = false;
  pool.ParallelFor(0, 1, [&](int64_t, int64_t) { ran = true; });
  EXPECT_FALSE(ran);
}

TEST(ThreadPoolTest, ConcurrentCallersFromManyThreadsAllComplete) {
  ThreadPool pool(3);
  std::atomic<int64_t> total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 6; ++c) {
    callers.emplace_back([&] {
      for (int rep = 0; rep < 50; ++rep) {
        pool.ParallelFor(100, 7, [&](int64_t b, int64_t e) { total += e - b; });
      }
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(total.load(), 6 * 50 * 100);
}

TEST(ThreadPoolTest, NullPoolRunsInline) {
  int64_t sum = 0;
  ParallelFor(nullptr, 10, 3, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) sum += i;
  });
  EXPECT_EQ(sum, 45);
}

// Placement groups every CPU the process may use exactly once. With KVTIER_CPU_PIN=cpu,
// worker i is pinned to CPU i of that order (wrapping) and runs nowhere else; by default a
// worker is either free (one node) or kept to one whole node.
TEST(ThreadPoolTest, PlacementFollowsTheNumaNodesAndThePinMode) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  const std::vector<std::vector<int>> nodes = PlacementNodes();
  std::vector<int> flat;
  for (const auto& n : nodes) flat.insert(flat.end(), n.begin(), n.end());
  ASSERT_EQ(static_cast<int>(flat.size()), CPU_COUNT(&allowed));
  EXPECT_EQ(std::set<int>(flat.begin(), flat.end()).size(), flat.size());
  for (int c : flat) EXPECT_TRUE(CPU_ISSET(c, &allowed)) << c;

  const char* old = std::getenv("KVTIER_CPU_PIN");
  const std::string saved = old != nullptr ? old : "";
  {
    ASSERT_EQ(unsetenv("KVTIER_CPU_PIN"), 0);
    ThreadPool pool(3);
    ASSERT_EQ(pool.worker_cpus().size(), 2u);
    for (const std::vector<int>& w : pool.worker_cpus()) {
      if (nodes.size() <= 1) {
        EXPECT_TRUE(w.empty());
      } else {
        EXPECT_NE(std::find(nodes.begin(), nodes.end(), w), nodes.end());
      }
    }
  }
  {
    ASSERT_EQ(setenv("KVTIER_CPU_PIN", "cpu", 1), 0);
    ThreadPool pool(5);
    ASSERT_EQ(pool.worker_cpus().size(), 4u);
    std::set<int> pinned;
    for (size_t i = 0; i < 4; ++i) {
      ASSERT_EQ(pool.worker_cpus()[i], std::vector<int>{flat[(i + 1) % flat.size()]});
      pinned.insert(flat[(i + 1) % flat.size()]);
    }
    std::atomic<int> strays{0};
    const std::thread::id caller = std::this_thread::get_id();
    pool.ParallelFor(64, 1, [&](int64_t, int64_t) {
      if (std::this_thread::get_id() != caller && pinned.count(sched_getcpu()) == 0) ++strays;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    });
    EXPECT_EQ(strays.load(), 0);
  }
  {
    ASSERT_EQ(setenv("KVTIER_CPU_PIN", "0", 1), 0);
    ThreadPool pool(3);
    for (const std::vector<int>& w : pool.worker_cpus()) EXPECT_TRUE(w.empty());
  }
  if (old != nullptr) {
    setenv("KVTIER_CPU_PIN", saved.c_str(), 1);
  } else {
    unsetenv("KVTIER_CPU_PIN");
  }
}

}  // namespace
}  // namespace kvtier
