// WorkQueue. Invariants: queued_ is the number of jobs in waiting_; a tenant is in waiting_
// only while it has a job waiting, and in running_ only while it has a job running (never
// more than per_tenant_); a job leaves the queue exactly once, to a worker (with OK) or to
// Shutdown (with UNAVAILABLE).
#include "daemon/work_queue.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "daemon/caller.h"

namespace kvtier::daemon {
namespace {

constexpr int kMaxThreads = 1024;
// The retry hint stays within these bounds whatever the measured job times say.
constexpr absl::Duration kMinRetryHint = absl::Milliseconds(1);
constexpr absl::Duration kMaxRetryHint = absl::Seconds(5);

}  // namespace

absl::StatusOr<std::unique_ptr<WorkQueue>> WorkQueue::Create(const WorkQueueOptions& options) {
  if (options.threads < 1 || options.threads > kMaxThreads) {
    return absl::InvalidArgumentError(absl::StrFormat("work queue threads = %d: must be in [1, %d]",
                                                      options.threads, kMaxThreads));
  }
  if (options.max_queued < 1) {
    return absl::InvalidArgumentError("work queue max_queued must be > 0");
  }
  if (options.max_running_per_tenant < 0 || options.max_running_per_tenant > options.threads) {
    return absl::InvalidArgumentError(
        absl::StrFormat("work queue max_running_per_tenant = %d: must be in [0, threads = %d]",
                        options.max_running_per_tenant, options.threads));
  }
  std::unique_ptr<WorkQueue> q(new WorkQueue(options));
  for (int i = 0; i < options.threads; ++i) q->workers_.emplace_back([w = q.get()] { w->Work(); });
  return q;
}

WorkQueue::WorkQueue(const WorkQueueOptions& options)
    : options_(options),
      per_tenant_(options.max_running_per_tenant > 0 ? options.max_running_per_tenant
                                                     : std::max(1, options.threads - 1)) {}

WorkQueue::~WorkQueue() { Shutdown(); }

absl::Status WorkQueue::Submit(std::string_view tenant, Job job) {
  {
    MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("kvtierd is shutting down");
    if (queued_ >= options_.max_queued) {
      ++refused_;
      absl::Status full = absl::ResourceExhaustedError(absl::StrFormat(
          "kvtierd is busy: %d calls wait for a worker (server.max_queued_calls = %d); retry "
          "in %s",
          queued_, options_.max_queued, absl::FormatDuration(RetryHint())));
      SetRetryAfter(full, RetryHint());
      return full;
    }
    auto it = waiting_.find(tenant);
    if (it == waiting_.end()) it = waiting_.emplace(std::string(tenant), std::deque<Job>()).first;
    it->second.push_back(std::move(job));
    ++queued_;
  }
  wake_.Signal();
  return absl::OkStatus();
}

std::map<std::string, std::deque<WorkQueue::Job>, std::less<>>::iterator WorkQueue::NextTenant() {
  // The first tenant at or after next_ (wrapping around) below its share: round-robin in name
  // order over the tenants that may run another job.
  const auto may_run = [this](const std::string& tenant) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto r = running_.find(tenant);
    return r == running_.end() || r->second < per_tenant_;
  };
  const auto from = waiting_.lower_bound(next_);
  for (auto it = from; it != waiting_.end(); ++it) {
    if (may_run(it->first)) return it;
  }
  for (auto it = waiting_.begin(); it != from; ++it) {
    if (may_run(it->first)) return it;
  }
  return waiting_.end();
}

WorkQueue::Job WorkQueue::TakeNext(std::string* tenant) {
  auto it = NextTenant();
  Job job = std::move(it->second.front());
  it->second.pop_front();
  --queued_;
  ++running_[it->first];
  *tenant = it->first;
  // The tenant after this one goes next: its name with a NUL appended sorts right after it.
  next_ = it->first + '\0';
  if (it->second.empty()) waiting_.erase(it);
  return job;
}

absl::Duration WorkQueue::RetryHint() const {
  const size_t rounds = queued_ / static_cast<size_t>(options_.threads) + 1;
  return std::clamp(mean_job_ * static_cast<double>(rounds), kMinRetryHint, kMaxRetryHint);
}

void WorkQueue::Work() {
  for (;;) {
    Job job;
    std::string tenant;
    {
      MutexLock lock(&mu_);
      wake_.Await(&mu_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || (queued_ > 0 && NextTenant() != waiting_.end());
      });
      if (stopping_) return;  // Shutdown hands out what is left
      job = TakeNext(&tenant);
    }
    const absl::Time start = absl::Now();
    std::move(job)(absl::OkStatus());
    const absl::Duration took = absl::Now() - start;
    {
      MutexLock lock(&mu_);
      mean_job_ = mean_job_ * 0.9 + took * 0.1;
      auto r = running_.find(tenant);
      if (--r->second == 0) running_.erase(r);
    }
    // A job of this tenant that waited for its share may run now, on another worker too.
    wake_.Signal();
  }
}

void WorkQueue::Shutdown() {
  {
    MutexLock lock(&mu_);
    if (stopping_ && workers_.empty()) return;
    stopping_ = true;
  }
  wake_.SignalAll();
  for (std::thread& t : workers_) {
    if (t.joinable()) t.join();
  }
  workers_.clear();
  // Jobs that never started: each learns it will not run and finishes its call.
  std::map<std::string, std::deque<Job>, std::less<>> left;
  {
    MutexLock lock(&mu_);
    left.swap(waiting_);
    queued_ = 0;
  }
  for (auto& [tenant, jobs] : left) {
    for (Job& job : jobs) {
      std::move(job)(absl::UnavailableError("kvtierd shut down before the call started"));
    }
  }
}

size_t WorkQueue::queued() const {
  MutexLock lock(&mu_);
  return queued_;
}

uint64_t WorkQueue::refused() const {
  MutexLock lock(&mu_);
  return refused_;
}

}  // namespace kvtier::daemon
