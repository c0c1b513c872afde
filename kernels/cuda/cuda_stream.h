// The CUDA backend's Stream and Event, the per-stream error slot that the kernels report
// into (device_error.h), and the Graph that stream capture makes.
//
// Errors: a CUDA fault, or an item out of range found by a kernel, makes the stream's
// status sticky: Synchronize() returns it, Wait() on an event recorded after the failing
// op returns it, and a stream that waits on such an event takes the error on — so a failed
// recall is never read as good data downstream, as on the cpu backend. Unlike the cpu
// backend, work enqueued after a failure still runs on the device (skipping it would need
// a host round trip); only what is reported about it fails. Events recorded before the
// failing op stay good: each record captures a sequence number per stream it depends on.
//
// These methods accept only streams and events created by the same CudaBackend (checked
// with dynamic_cast and an owner pointer; anything else is INVALID_ARGUMENT). The backend
// must outlive them.
//
// Capture (Backend::BeginCapture): while a stream captures, its kernels report into an
// error slot of the graph's own, numbered by the graph's own op sequence, and the stream's
// own slot and sequence are set aside. A replayed graph's failure is reported like a failure
// of work the launching stream waited on: Launch adds the graph's slot (up to its last op)
// to that stream's dependencies, so its next Record and Synchronize see it. Limits:
//   - A graph's failure is sticky for the graph: its record is never cleared, so once a
//     replay failed, every stream that launched the graph reports it at its next check,
//     even for replays of its own that ran clean (an over-report, never a miss). The claim
//     word is reset by the graph's first node, in the launching stream's order, so a later
//     failing replay may rewrite the description while the host is not reading it.
//   - One stream per capture: Record, Wait and Synchronize on a capturing stream fail
//     FAILED_PRECONDITION, and so does a copy or memset touching pageable host memory
//     (cuda_backend.cc); the first such refusal is what EndCapture returns. CopyBatch
//     captures one memcpy node per range. BeginCapture and EndCapture run on one thread.
//   - A graph cannot be launched into a capturing stream.
//   - The attention scratch a graph uses: attention.cu.
//
// Thread-safety: CudaEvent and CudaGraph are thread-safe. A CudaStream is fed from one
// thread at a time (capture included: cudaStreamCaptureModeThreadLocal).
#ifndef KVTIER_KERNELS_CUDA_CUDA_STREAM_H_
#define KVTIER_KERNELS_CUDA_CUDA_STREAM_H_

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/mutex.h"
#include "kernels/backend.h"
#include "kernels/cuda/device_error.h"

namespace kvtier::cuda {

// One stream's first failure: a DeviceErrorRecord in mapped pinned host memory and the
// claim word in device memory. Shared by the stream and by every record that depends on
// it; handed out and taken back by an ErrorSlotPool.
class ErrorSlot {
 public:
  ErrorSlot(const ErrorSlot&) = delete;
  ErrorSlot& operator=(const ErrorSlot&) = delete;

  DeviceErrorSink Sink(uint64_t op_seq) const { return {claim_, device_record_, op_seq}; }
  // Clears the claim word in `stream`'s order (a captured memset while `stream` captures).
  cudaError_t ResetClaim(cudaStream_t stream) const {
    return cudaMemsetAsync(claim_, 0, sizeof(int32_t), stream);
  }
  // OUT_OF_RANGE describing the recorded failure if it was an op with sequence number ≤
  // `seq`, else OK. REQUIRES: the stream's work up to op `seq` has completed.
  absl::Status FailureUpTo(uint64_t seq) const;
  bool failed() const;
  // Called once the owning stream has drained for good: a retired slot that has not failed
  // never will, so dependency lists may drop it.
  void Retire() { retired_.store(true, std::memory_order_release); }
  bool retired_clean() const { return retired_.load(std::memory_order_acquire) && !failed(); }

 private:
  friend class ErrorSlotPool;
  ErrorSlot() = default;

  DeviceErrorRecord* host_record_ = nullptr;    // cudaHostAlloc'ed, mapped
  DeviceErrorRecord* device_record_ = nullptr;  // its device view
  int32_t* claim_ = nullptr;                    // cudaMalloc'ed
  std::atomic<bool> retired_{false};
};

// Allocates ErrorSlots on one device and recycles them, so that dropping the last
// reference to a slot (which may happen on the decode path, in an event's dependency
// list) never calls cudaFree, which can synchronise the device. Frees every slot when
// destroyed. REQUIRES: outlives every slot it handed out. Thread-safe.
class ErrorSlotPool {
 public:
  explicit ErrorSlotPool(int device) : device_(device) {}
  ~ErrorSlotPool();
  ErrorSlotPool(const ErrorSlotPool&) = delete;
  ErrorSlotPool& operator=(const ErrorSlotPool&) = delete;

  // A cleared slot whose claim word is reset in `stream`'s order, before any kernel of
  // that stream can use it. REQUIRES: the pool's device is current.
  absl::StatusOr<std::shared_ptr<ErrorSlot>> Acquire(cudaStream_t stream);
  // A slot with a cleared host record whose claim word the caller must reset (ResetClaim)
  // before any kernel uses it. May allocate (never during a capture: call it before).
  // REQUIRES: the pool's device is current.
  absl::StatusOr<std::shared_ptr<ErrorSlot>> Take();

 private:
  absl::Status Allocate(ErrorSlot& slot);
  void Release(ErrorSlot* slot);

  const int device_;
  Mutex mu_;
  std::vector<ErrorSlot*> free_ ABSL_GUARDED_BY(mu_);
};

// The failures a piece of work depends on: for each stream it (transitively) waited on,
// the highest op sequence number of that stream it saw. Small: one entry per live stream.
class ErrorDeps {
 public:
  void Add(const std::shared_ptr<ErrorSlot>& slot, uint64_t seq);
  void Merge(const ErrorDeps& other);
  // The first failure among the dependencies, or OK. REQUIRES: the work has completed.
  absl::Status Check() const;

 private:
  struct Mark {
    std::shared_ptr<ErrorSlot> slot;
    uint64_t seq;
  };
  absl::InlinedVector<Mark, 4> marks_;
};

class CudaEvent final : public Event {
 public:
  // A cudaEventDisableTiming event on `device` (which must be current).
  static absl::StatusOr<std::unique_ptr<CudaEvent>> Create(const Backend* owner, int device);
  ~CudaEvent() override;

  bool Query() override;
  // Infinite timeout: cudaEventSynchronize. Otherwise polls cudaEventQuery with a short
  // exponential backoff and returns DEADLINE_EXCEEDED once `timeout` has passed. Every call
  // counts one HostCall::kWait (kernels/host_calls.h).
  absl::Status Wait(absl::Duration timeout) override;

  const Backend* owner() const { return owner_; }
  cudaEvent_t handle() const { return event_; }
  // cudaEventRecord on `stream`; later waits report the failures in `deps`.
  absl::Status RecordOn(cudaStream_t stream, ErrorDeps deps);
  ErrorDeps captured() const;

 private:
  CudaEvent(const Backend* owner, int device, cudaEvent_t event)
      : owner_(owner), device_(device), event_(event) {}
  absl::Status Poll(absl::Duration timeout);

  const Backend* const owner_;
  const int device_;
  const cudaEvent_t event_;
  mutable Mutex mu_;
  ErrorDeps captured_ ABSL_GUARDED_BY(mu_);
};

class CudaStream final : public Stream {
 public:
  // A non-blocking stream on `device` (which must be current), reporting into a slot of
  // `slots`. Normal streams take the device's greatest (highest) priority, low ones its
  // least. A stream an engine creates itself outside kvtier (cudaStreamCreate, PyTorch's
  // streams) runs at the default priority, which is the least: for background recall on a
  // low kvtier stream to yield to the engine's compute, the engine creates its compute
  // stream through Device::CreateStream (kvtier's normal priority).
  static absl::StatusOr<std::unique_ptr<CudaStream>> Create(const Backend* owner, int device,
                                                            ErrorSlotPool& slots,
                                                            bool low_priority = false);
  // A stream over the engine's `native` stream (kvtier/cuda.h AdoptCudaStream), reporting
  // into a slot of `slots`; it keeps `native`'s flags and priority and does not own it.
  // REQUIRES: `device` is current, `native` is a created stream of `device` and outlives
  // the returned one.
  static absl::StatusOr<std::unique_ptr<CudaStream>> Adopt(const Backend* owner, int device,
                                                           ErrorSlotPool& slots,
                                                           cudaStream_t native);
  // Abandons a capture in progress, waits for the enqueued work, then destroys the stream
  // (unless adopted: the engine's stream is left alive).
  ~CudaStream() override;

  // FAILED_PRECONDITION while capturing (and the capture then fails). Synchronize counts one
  // HostCall::kWait per call it serves.
  absl::Status Record(Event& event) override;
  absl::Status Wait(Event& event) override;
  absl::Status Synchronize() override;

  const Backend* owner() const { return owner_; }
  cudaStream_t handle() const { return stream_; }
  // The error sink of the next kernel enqueued here; advances the op sequence (the
  // graph's, while capturing).
  DeviceErrorSink NextOp() { return errors_->Sink(++op_seq_); }

  // Capture (kernels/backend.h, the header above). BeginCapture takes a slot of `slots` for
  // the graph and starts a thread-local cudaStreamBeginCapture; EndCapture instantiates
  // what was captured. FAILED_PRECONDITION when already (or not) capturing; EndCapture
  // returns the first failure recorded by FailCapture or by a refused call meanwhile.
  // REQUIRES: both on the same thread (CUDA's rule for thread-local capture).
  absl::Status BeginCapture(ErrorSlotPool& slots);
  absl::StatusOr<std::unique_ptr<Graph>> EndCapture();
  bool capturing() const { return capturing_; }
  // Fails the capture in progress: EndCapture returns `status` (the first one).
  void FailCapture(const absl::Status& status) { capture_status_.Update(status); }
  // Work enqueued from now on depends on op `seq` of `slot` (a graph launched here).
  void DependOn(const std::shared_ptr<ErrorSlot>& slot, uint64_t seq) { upstream_.Add(slot, seq); }

 private:
  CudaStream(const Backend* owner, int device, cudaStream_t stream,
             std::shared_ptr<ErrorSlot> errors, bool owned)
      : owner_(owner),
        device_(device),
        stream_(stream),
        owned_(owned),
        errors_(std::move(errors)) {}
  // FAILED_PRECONDITION naming `op`, recorded as the capture's failure.
  absl::Status RefuseWhileCapturing(absl::string_view op);

  const Backend* const owner_;
  const int device_;
  const cudaStream_t stream_;
  const bool owned_;                   // false: adopted, the engine destroys stream_
  std::shared_ptr<ErrorSlot> errors_;  // the graph's slot while capturing
  uint64_t op_seq_ = 0;                // kernels enqueued so far (into errors_)
  ErrorDeps upstream_;                 // failures of work this stream waited on
  absl::Status sticky_;
  // Capture state: the stream's own slot and sequence, set aside meanwhile.
  bool capturing_ = false;
  absl::Status capture_status_;
  std::shared_ptr<ErrorSlot> saved_errors_;
  uint64_t saved_op_seq_ = 0;
};

// An instantiated CUDA graph (Backend::EndCapture) with the error slot its kernels report
// into. Launch: cudaGraphLaunch on a stream of the same backend (CUDA orders launches of one
// graph behind each other, so replays never share its scratch concurrently), then that
// stream depends on the graph's ops (the header above). The destructor destroys the
// executable graph. REQUIRES (Graph): destroyed only after its launches have run.
class CudaGraph final : public Graph {
 public:
  CudaGraph(const Backend* owner, int device, cudaGraphExec_t exec,
            std::shared_ptr<ErrorSlot> errors, uint64_t ops)
      : owner_(owner), device_(device), exec_(exec), errors_(std::move(errors)), ops_(ops) {}
  ~CudaGraph() override;
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  absl::Status Launch(Stream& s) override;

 private:
  const Backend* const owner_;
  const int device_;
  const cudaGraphExec_t exec_;
  const std::shared_ptr<ErrorSlot> errors_;
  const uint64_t ops_;  // kernels captured: their sequence numbers are 1..ops_
};

// `stream` / `event` as this backend's own type, or INVALID_ARGUMENT naming `op` when it
// was created by another backend.
absl::StatusOr<CudaStream*> AsCudaStream(Stream& stream, const Backend* owner,
                                         absl::string_view op);
absl::StatusOr<CudaEvent*> AsCudaEvent(Event& event, const Backend* owner, absl::string_view op);

}  // namespace kvtier::cuda

#endif  // KVTIER_KERNELS_CUDA_CUDA_STREAM_H_
