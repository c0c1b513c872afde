// The CPU backend's Stream and Event. A CpuStream is an ordered work queue served by its
// own thread; a CpuEvent is a real completion signal with CUDA's record semantics (a
// record captures the work enqueued so far; re-recording moves the event forward).
//
// Errors: a failing task makes its stream's status sticky — later compute and copy tasks
// on that stream are skipped, Synchronize() returns the error, and events recorded after
// it complete carrying it. A stream that waits on an event carrying an error takes that
// error on, so a failed recall can never be read as good data downstream.
//
// Thread-safety: CpuEvent is thread-safe. A CpuStream may be fed from one thread at a
// time (as CUDA streams in practice); its worker runs concurrently with the feeder.
#ifndef KVTIER_KERNELS_CPU_CPU_STREAM_H_
#define KVTIER_KERNELS_CPU_CPU_STREAM_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "core/mutex.h"

namespace kvtier {

class CpuEvent final : public Event {
 public:
  bool Query() override;
  absl::Status Wait(absl::Duration timeout) override;

  // Arms the event for a new record; returns the sequence number the marker completes.
  uint64_t Arm();
  // The sequence number of the latest record (0 if never recorded).
  uint64_t Armed();
  // Marks record `seq` (and every earlier one) complete with `status`.
  void Complete(uint64_t seq, absl::Status status);
  // Blocks until record `seq` has completed; returns the status it completed with.
  absl::Status WaitFor(uint64_t seq);

 private:
  Mutex mu_;
  CondVar completed_cv_;  // signalled when completed_ advances
  uint64_t armed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

class CpuStream final : public Stream {
 public:
  // A low-priority stream's worker runs at the lowest OS priority (nice 19).
  explicit CpuStream(bool low_priority = false);
  // Runs the work already enqueued, then joins the worker.
  ~CpuStream() override;

  absl::Status Record(Event& event) override;
  absl::Status Wait(Event& event) override;
  absl::Status Synchronize() override;

  // Enqueues a task. Unless the stream has already failed, it runs after every task
  // enqueued before it; its error becomes the stream's sticky status. While the stream
  // captures, the task is recorded instead (Backend::BeginCapture).
  void Enqueue(std::function<absl::Status()> task);
  bool low_priority() const { return low_priority_; }

  // Capture (kernels/backend.h): tasks enqueued from BeginCapture to EndCapture are
  // recorded, not run; Record, Wait and Synchronize fail FAILED_PRECONDITION meanwhile.
  // FAILED_PRECONDITION when already (or not) capturing.
  absl::Status BeginCapture();
  absl::StatusOr<std::vector<std::function<absl::Status()>>> EndCapture();
  bool capturing() const { return capturing_; }
  // Fails the capture in progress: EndCapture returns `status`.
  void FailCapture(absl::Status status) {
    if (capture_status_.ok()) capture_status_ = std::move(status);
  }

 private:
  struct Task {
    std::function<absl::Status()> fn;
    bool always_run;  // markers and waits run even on a failed stream
  };
  void Push(Task task);
  void WorkerLoop();
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queue_.empty() && !busy_; }

  const bool low_priority_;
  // Capture state: touched only by the feeding thread.
  bool capturing_ = false;
  absl::Status capture_status_;
  std::vector<std::function<absl::Status()>> captured_;
  Mutex mu_;
  CondVar work_cv_;  // signalled when a task is queued or stopping_ is set
  CondVar idle_cv_;  // signalled when the worker finishes a task
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::thread worker_;
};

}  // namespace kvtier

#endif  // KVTIER_KERNELS_CPU_CPU_STREAM_H_
