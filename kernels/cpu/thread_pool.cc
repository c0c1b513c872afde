#include "kernels/cpu/thread_pool.h"

#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

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

// A sysfs cpulist ("0-3,8,10-11") as CPU numbers; empty when unreadable.
std::vector<int> ReadCpuList(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!std::getline(in, text)) return {};
  std::vector<int> cpus;
  std::stringstream ss(text);
  std::string part;
  while (std::getline(ss, part, ',')) {
    if (part.empty()) continue;
    const size_t dash = part.find('-');
    const int lo = std::atoi(part.substr(0, dash).c_str());
    const int hi = dash == std::string::npos ? lo : std::atoi(part.substr(dash + 1).c_str());
    for (int c = lo; c <= hi && c - lo < 4096; ++c) cpus.push_back(c);
  }
  return cpus;
}

// KVTIER_CPU_PIN: "0" or "off" places nothing, "cpu" pins each worker to one CPU, anything
// else (the default) keeps workers on NUMA nodes.
enum class Placement { kOff, kNode, kCpu };
Placement PlacementMode() {
  const char* env = std::getenv("KVTIER_CPU_PIN");
  if (env == nullptr) return Placement::kNode;
  const std::string v(env);
  if (v == "0" || v == "off") return Placement::kOff;
  if (v == "cpu") return Placement::kCpu;
  return Placement::kNode;
}

void SetAffinity(const std::vector<int>& cpus) {
  if (cpus.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  (void)sched_setaffinity(0, sizeof(set), &set);  // best effort, as the priority
}

}  // namespace

std::vector<std::vector<int>> PlacementNodes() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return {};
  std::vector<int> allowed;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) allowed.push_back(c);
  }
  std::vector<std::pair<int, std::vector<int>>> numbered;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/sys/devices/system/node", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() <= 4 || name.compare(0, 4, "node") != 0 ||
        name.find_first_not_of("0123456789", 4) != std::string::npos) {
      continue;
    }
    std::vector<int> cpus = ReadCpuList(entry.path().string() + "/cpulist");
    if (!cpus.empty()) numbered.emplace_back(std::atoi(name.c_str() + 4), std::move(cpus));
  }
  std::sort(numbered.begin(), numbered.end());
  // Keep the allowed CPUs of each node, each CPU once; the caller's node first; CPUs of no
  // known node form a last group.
  std::vector<std::vector<int>> nodes;
  std::vector<bool> taken(CPU_SETSIZE, false);
  for (auto& [number, cpus] : numbered) {
    std::vector<int> mine;
    for (int c : cpus) {
      if (c >= 0 && c < CPU_SETSIZE && CPU_ISSET(c, &set) && !taken[static_cast<size_t>(c)]) {
        taken[static_cast<size_t>(c)] = true;
        mine.push_back(c);
      }
    }
    if (!mine.empty()) nodes.push_back(std::move(mine));
  }
  std::vector<int> rest;
  for (int c : allowed) {
    if (!taken[static_cast<size_t>(c)]) rest.push_back(c);
  }
  if (!rest.empty()) nodes.push_back(std::move(rest));
  const int here = sched_getcpu();
  std::stable_partition(nodes.begin(), nodes.end(), [here](const std::vector<int>& cpus) {
    return std::find(cpus.begin(), cpus.end(), here) != cpus.end();
  });
  return nodes;
}

ThreadPool::ThreadPool(int num_threads, bool low_priority) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::thread::hardware_concurrency());
  num_threads = std::max(num_threads, 1);
  // Where each worker may run (empty: anywhere). Node placement: the pool fills the
  // caller's node first (its CPUs count the caller's thread), then the next, each worker
  // free within its node; on one node nothing is restricted. CPU placement: worker i on
  // CPU i of the nodes' order, the caller keeping its own.
  const Placement mode = num_threads > 1 ? PlacementMode() : Placement::kOff;
  const std::vector<std::vector<int>> nodes =
      mode == Placement::kOff ? std::vector<std::vector<int>>{} : PlacementNodes();
  std::vector<int> flat;
  for (const auto& n : nodes) flat.insert(flat.end(), n.begin(), n.end());
  workers_.reserve(static_cast<size_t>(num_threads - 1));
  for (int i = 1; i < num_threads; ++i) {
    std::vector<int> cpus;
    if (mode == Placement::kCpu && !flat.empty()) {
      cpus = {flat[static_cast<size_t>(i) % flat.size()]};
    } else if (mode == Placement::kNode && nodes.size() > 1) {
      int slot = i % static_cast<int>(flat.size());
      for (const auto& n : nodes) {
        if (slot < static_cast<int>(n.size())) {
          cpus = n;
          break;
        }
        slot -= static_cast<int>(n.size());
      }
    }
    worker_cpus_.push_back(cpus);
    workers_.emplace_back([this, low_priority, cpus] {
      // Best effort: without the right to lower its priority the thread keeps the default.
      if (low_priority) (void)setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 19);
      SetAffinity(cpus);
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
