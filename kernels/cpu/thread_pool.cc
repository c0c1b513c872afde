#include "kernels/cpu/thread_pool.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <memory>

namespace kvtier {
namespace {

// Shared by the caller and the helpers of one ParallelFor. Helpers hold it by shared_ptr,
// so a helper that starts after the loop has finished finds no chunk and touches nothing
// else; `fn` is only called for claimed chunks, all of which finish before the caller
// returns, so the reference stays valid whenever it is used.
struct Job {
  int64_t n;
  int64_t grain;
  int64_t chunks;
  const std::function<void(int64_t, int64_t)>* fn;
  std::atomic<int64_t> next{0};
  Mutex mu;
  CondVar finished_cv;  // signalled when `finished` grows
  int64_t finished ABSL_GUARDED_BY(mu) = 0;

  // Claims and runs chunks until none are left.
  void Drain() {
    int64_t done = 0;
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      const int64_t begin = c * grain;
      (*fn)(begin, std::min(n, begin + grain));
      ++done;
    }
    if (done > 0) {
      MutexLock lock(&mu);
      finished += done;
      finished_cv.Signal();  // only the caller waits
    }
  }

  // Blocks until every chunk has run.
  void AwaitFinished() {
    MutexLock lock(&mu);
    finished_cv.Await(&mu,
                      [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return finished == chunks; });
  }
};

}  // namespace

ThreadPool::ThreadPool(int num_threads, bool low_priority) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::thread::hardware_concurrency());
  num_threads = std::max(num_threads, 1);
  workers_.reserve(static_cast<size_t>(num_threads - 1));
  for (int i = 1; i < num_threads; ++i) {
    workers_.emplace_back([this, low_priority] {
      // Best effort: without the right to lower its priority the thread keeps the default.
      if (low_priority) (void)setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 19);
      WorkerLoop();
    });
  }
}

ThreadPool::~ThreadPool() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    work_cv_.SignalAll();
  }
  for (auto& t : workers_) t.join();
}

void ThreadPool::WorkerLoop() {
  while (true) {
    std::function<void()> task;
    {
      MutexLock lock(&mu_);
      work_cv_.Await(&mu_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !queue_.empty();
      });
      if (queue_.empty()) return;  // stopping and nothing left
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

void ThreadPool::ParallelFor(int64_t n, int64_t grain,
                             const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t chunks = (n + grain - 1) / grain;
  if (chunks == 1 || workers_.empty()) {
    for (int64_t b = 0; b < n; b += grain) fn(b, std::min(n, b + grain));
    return;
  }
  auto job = std::make_shared<Job>();
  job->n = n;
  job->grain = grain;
  job->chunks = chunks;
  job->fn = &fn;
  const int64_t helpers = std::min<int64_t>(chunks - 1, static_cast<int64_t>(workers_.size()));
  {
    MutexLock lock(&mu_);
    for (int64_t i = 0; i < helpers; ++i) queue_.emplace_back([job] { job->Drain(); });
    work_cv_.SignalAll();
  }
  job->Drain();
  job->AwaitFinished();
}

void ParallelFor(ThreadPool* pool, int64_t n, int64_t grain,
                 const std::function<void(int64_t, int64_t)>& fn) {
  if (pool != nullptr) {
    pool->ParallelFor(n, grain, fn);
    return;
  }
  grain = std::max<int64_t>(grain, 1);
  for (int64_t b = 0; b < n; b += grain) fn(b, std::min(n, b + grain));
}

}  // namespace kvtier
