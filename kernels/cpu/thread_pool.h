// ThreadPool: a fixed set of worker threads for data-parallel loops in the CPU backend.
// ParallelFor splits [0, n) into chunks and runs them on the workers and the calling
// thread; the caller always takes part, so nested or concurrent ParallelFor calls from
// several threads (one per CPU stream) never deadlock, they only share the workers.
//
// NUMA-aware placement: on a machine with several NUMA nodes, workers fill the creating
// thread's node first (PlacementNodes), each free to move within its node, so a pool no
// larger than a node streams the memory its node serves. KVTIER_CPU_PIN=cpu pins each
// worker to one CPU instead (measured slower on a 2-core VM: the unpinned caller can land
// on a pinned worker's CPU while the other idles); KVTIER_CPU_PIN=0 leaves placement to
// the OS.
//
// Thread-safe. Non-copyable; the destructor joins the workers.
#ifndef KVTIER_KERNELS_CPU_THREAD_POOL_H_
#define KVTIER_KERNELS_CPU_THREAD_POOL_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "core/mutex.h"

namespace kvtier {

class ThreadPool {
 public:
  // `num_threads` is the total parallelism including the caller: num_threads − 1 workers
  // are started. ≤ 0 means std::thread::hardware_concurrency().
  // `low_priority`: the workers run at the lowest OS priority (nice 19), for background
  // work that must yield to the rest.
  explicit ThreadPool(int num_threads, bool low_priority = false);
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool();

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // The CPUs each worker may run on (worker i at [i]); an empty set: anywhere.
  const std::vector<std::vector<int>>& worker_cpus() const { return worker_cpus_; }

  // Calls fn(begin, end) over disjoint chunks covering [0, n), each at most `grain` long
  // (grain ≥ 1), and returns when all have run.
  void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void WorkerLoop();

  Mutex mu_;
  CondVar work_cv_;  // signalled when a task is queued or stopping_ is set
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
  std::vector<std::vector<int>> worker_cpus_;
};

// The CPUs this process may run on (sched_getaffinity), grouped by NUMA node (sysfs), the
// node of the calling thread first, each CPU once; allowed CPUs of no known node form the
// last group (all of them without NUMA information).
std::vector<std::vector<int>> PlacementNodes();

// ParallelFor on `pool`, or inline on the calling thread when `pool` is null.
void ParallelFor(ThreadPool* pool, int64_t n, int64_t grain,
                 const std::function<void(int64_t, int64_t)>& fn);

}  // namespace kvtier

#endif  // KVTIER_KERNELS_CPU_THREAD_POOL_H_
