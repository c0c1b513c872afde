// WorkQueue: kvtierd's executor for the calls that do real work (OpenSession, Step, the
// commits of an Offload stream), so that gRPC's callback threads only parse, check and
// answer, and one slow call cannot hold the server. A fixed set of worker threads takes jobs
// from one FIFO per tenant, visiting the tenants round-robin: a tenant with many jobs waiting
// delays another tenant's next job by at most one job per worker. One tenant's jobs occupy at
// most `max_running_per_tenant` workers at once (by default all but one), so a tenant whose jobs
// block (a stalled cold-tier node, until their calls' deadlines) leaves the other workers to the
// other tenants; its further jobs wait their turn. The total of waiting jobs is bounded; past it
// Submit refuses with RESOURCE_EXHAUSTED and a retry hint (caller.h RetryAfter) estimated from the
// recent job durations.
//
// Thread-safe. Shutdown (or the destructor) refuses new jobs, hands every job that never
// started UNAVAILABLE, waits for the running ones and joins the workers.
#ifndef KVTIER_DAEMON_WORK_QUEUE_H_
#define KVTIER_DAEMON_WORK_QUEUE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/mutex.h"

namespace kvtier::daemon {

struct WorkQueueOptions {
  int threads = 2;            // workers, in [1, 1024]
  uint32_t max_queued = 256;  // jobs waiting (not running) over all tenants, > 0
  // Workers one tenant's jobs may occupy at once, in [0, threads]; 0: threads - 1 (at least 1).
  int max_running_per_tenant = 0;
};

class WorkQueue {
 public:
  // A job learns whether it may run: OK on a worker, UNAVAILABLE when the queue shut down
  // before it started. Either way it runs exactly once and must finish its call.
  using Job = absl::AnyInvocable<void(absl::Status) &&>;

  // INVALID_ARGUMENT for options out of range.
  static absl::StatusOr<std::unique_ptr<WorkQueue>> Create(const WorkQueueOptions& options);
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;
  ~WorkQueue();

  // Queues `job` behind `tenant`'s earlier jobs. RESOURCE_EXHAUSTED (with a retry hint)
  // when max_queued jobs wait already, UNAVAILABLE after Shutdown; `job` is then dropped
  // without running. Never runs the job on the calling thread.
  absl::Status Submit(std::string_view tenant, Job job) ABSL_LOCKS_EXCLUDED(mu_);

  // Idempotent; see the header comment. REQUIRES: not called from a job.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

  size_t queued() const ABSL_LOCKS_EXCLUDED(mu_);     // waiting jobs
  uint64_t refused() const ABSL_LOCKS_EXCLUDED(mu_);  // Submit calls refused as full
  int threads() const { return options_.threads; }
  int max_running_per_tenant() const { return per_tenant_; }

 private:
  explicit WorkQueue(const WorkQueueOptions& options);
  void Work() ABSL_LOCKS_EXCLUDED(mu_);
  // The tenant whose job runs next, round-robin over the tenants with a job waiting and fewer
  // than per_tenant_ running; waiting_.end() when there is none.
  std::map<std::string, std::deque<Job>, std::less<>>::iterator NextTenant()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the next job of NextTenant() (REQUIRES: there is one) and counts it running; its
  // tenant is returned in `tenant`.
  Job TakeNext(std::string* tenant) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Duration RetryHint() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const WorkQueueOptions options_;
  const int per_tenant_;              // options_.max_running_per_tenant resolved
  std::vector<std::thread> workers_;  // started by Create, joined by Shutdown

  mutable Mutex mu_;
  CondVar wake_;  // a job was queued, or shutdown began
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  size_t queued_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
  // Tenants with waiting jobs; `next_` is the tenant served after the last one served.
  std::map<std::string, std::deque<Job>, std::less<>> waiting_ ABSL_GUARDED_BY(mu_);
  std::string next_ ABSL_GUARDED_BY(mu_);
  // Tenants with jobs running → how many (absent at 0).
  std::map<std::string, int, std::less<>> running_ ABSL_GUARDED_BY(mu_);
  absl::Duration mean_job_ ABSL_GUARDED_BY(mu_) = absl::Milliseconds(1);  // moving average
};

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_WORK_QUEUE_H_
