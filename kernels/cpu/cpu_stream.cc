#include "kernels/cpu/cpu_stream.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "kernels/host_calls.h"

namespace kvtier {

bool CpuEvent::Query() {
  MutexLock lock(&mu_);
  return completed_ >= armed_;
}

absl::Status CpuEvent::Wait(absl::Duration timeout) {
  CountHostCall(HostCall::kWait);
  MutexLock lock(&mu_);
  const uint64_t target = armed_;
  auto done = [this, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return completed_ >= target;
  };
  if (!completed_cv_.AwaitWithTimeout(&mu_, done, timeout)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "event not complete within ", absl::FormatDuration(timeout)));
  }
  return status_;
}

uint64_t CpuEvent::Armed() {
  MutexLock lock(&mu_);
  return armed_;
}

uint64_t CpuEvent::Arm() {
  MutexLock lock(&mu_);
  return ++armed_;
}

void CpuEvent::Complete(uint64_t seq, absl::Status status) {
  MutexLock lock(&mu_);
  if (seq > completed_) {
    completed_ = seq;
    status_ = std::move(status);
    completed_cv_.SignalAll();
  }
}

absl::Status CpuEvent::WaitFor(uint64_t seq) {
  MutexLock lock(&mu_);
  auto done = [this, seq]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return completed_ >= seq; };
  completed_cv_.Await(&mu_, done);
  return status_;
}

CpuStream::CpuStream(bool low_priority)
    : low_priority_(low_priority), worker_([this] { WorkerLoop(); }) {}

CpuStream::~CpuStream() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    work_cv_.SignalAll();
  }
  worker_.join();
}

void CpuStream::Push(Task task) {
  MutexLock lock(&mu_);
  queue_.push_back(std::move(task));
  work_cv_.SignalAll();
}

void CpuStream::Enqueue(std::function<absl::Status()> task) {
  if (capturing_) {
    captured_.push_back(std::move(task));
    return;
  }
  Push(Task{std::move(task), /*always_run=*/false});
}

absl::Status CpuStream::BeginCapture() {
  if (capturing_) return absl::FailedPreconditionError("BeginCapture: the stream is capturing");
  capturing_ = true;
  capture_status_ = absl::OkStatus();
  captured_.clear();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::function<absl::Status()>>> CpuStream::EndCapture() {
  if (!capturing_) return absl::FailedPreconditionError("EndCapture: the stream is not capturing");
  capturing_ = false;
  std::vector<std::function<absl::Status()>> tasks = std::move(captured_);
  captured_.clear();
  if (!capture_status_.ok()) return capture_status_;
  return tasks;
}

absl::Status CpuStream::Record(Event& event) {
  if (capturing_) {
    capture_status_ = absl::FailedPreconditionError(
        "Record on a capturing stream: a capture covers one stream's work only");
    return capture_status_;
  }
  auto* e = dynamic_cast<CpuEvent*>(&event);
  if (e == nullptr) return absl::InvalidArgumentError("Record: event is not a cpu event");
  const uint64_t seq = e->Arm();
  Push(Task{[this, e, seq] {
              absl::Status st;
              {
                MutexLock lock(&mu_);
                st = status_;
              }
              e->Complete(seq, st);
              return absl::OkStatus();
            },
            /*always_run=*/true});
  return absl::OkStatus();
}

absl::Status CpuStream::Wait(Event& event) {
  if (capturing_) {
    capture_status_ = absl::FailedPreconditionError(
        "Wait on a capturing stream: a capture covers one stream's work only");
    return capture_status_;
  }
  auto* e = dynamic_cast<CpuEvent*>(&event);
  if (e == nullptr) return absl::InvalidArgumentError("Wait: event is not a cpu event");
  // The target is the record in force now, as cudaStreamWaitEvent captures it.
  const uint64_t seq = e->Armed();
  Push(Task{[e, seq] { return e->WaitFor(seq); }, /*always_run=*/true});
  return absl::OkStatus();
}

absl::Status CpuStream::Synchronize() {
  if (capturing_) {
    capture_status_ = absl::FailedPreconditionError("Synchronize on a capturing stream");
    return capture_status_;
  }
  CountHostCall(HostCall::kWait);
  MutexLock lock(&mu_);
  idle_cv_.Await(&mu_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return Idle(); });
  return status_;
}

void CpuStream::WorkerLoop() {
  // Best effort: without the right to lower its priority the thread keeps the default.
  if (low_priority_) (void)setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 19);
  while (true) {
    Task task;
    bool failed;
    {
      MutexLock lock(&mu_);
      work_cv_.Await(&mu_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !queue_.empty();
      });
      if (queue_.empty()) return;  // stopping, and every task has run
      task = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      failed = !status_.ok();
    }
    absl::Status st;
    if (task.always_run || !failed) st = task.fn();
    MutexLock lock(&mu_);
    if (!st.ok() && status_.ok()) status_ = std::move(st);
    busy_ = false;
    idle_cv_.SignalAll();
  }
}

}  // namespace kvtier
