#include "kernels/cuda/cuda_stream.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/host_calls.h"

namespace kvtier::cuda {
namespace {

// Polling backoff of Event::Wait with a finite timeout.
constexpr absl::Duration kFirstPause = absl::Microseconds(2);
constexpr absl::Duration kMaxPause = absl::Microseconds(500);

absl::string_view OpName(KernelOp op) {
  switch (op) {
    case KernelOp::kRecall:
      return "Recall";
    case KernelOp::kOffload:
      return "Offload";
    case KernelOp::kGatherSlabs:
      return "GatherSlabs";
    case KernelOp::kScatterSlabs:
      return "ScatterSlabs";
    case KernelOp::kScorePages:
      return "ScorePages";
    case KernelOp::kTopK:
      return "TopK";
    case KernelOp::kQueryCosine:
      return "QueryCosine";
    case KernelOp::kReplace:
      return "Replace";
    case KernelOp::kSparseAttention:
      return "SparseAttention";
    case KernelOp::kDenseAttention:
      return "DenseAttention";
    case KernelOp::kMoveHeadSlots:
      return "MoveHeadSlots";
    case KernelOp::kSelectionLoss:
      return "SelectionLoss";
  }
  return "kernel";
}

absl::string_view FieldName(ItemField field) {
  switch (field) {
    case ItemField::kHostPage:
      return "host_page";
    case ItemField::kKvHead:
      return "kv_head";
    case ItemField::kDstSlot:
      return "dst_slot";
    case ItemField::kSrcSlot:
      return "src_slot";
    case ItemField::kSummaryPage:
      return "summary_page";
    case ItemField::kNumPages:
      return "num_pages";
    case ItemField::kHeadK:
      return "head_k";
    case ItemField::kSelectedPage:
      return "selected";
    case ItemField::kPartialLen:
      return "partial_len";
    case ItemField::kSlotTable:
      return "slot_table";
    case ItemField::kSeqLen:
      return "seq_len";
    case ItemField::kSlot:
      return "slot";
    case ItemField::kCurrentPage:
      return "current";
    case ItemField::kFreshPage:
      return "fresh";
  }
  return "index";
}

}  // namespace

// ---- ErrorSlot ----

bool ErrorSlot::failed() const {
  return std::atomic_ref<uint64_t>(host_record_->op_seq).load(std::memory_order_acquire) != 0;
}

absl::Status ErrorSlot::FailureUpTo(uint64_t seq) const {
  const uint64_t failed_seq =
      std::atomic_ref<uint64_t>(host_record_->op_seq).load(std::memory_order_acquire);
  if (failed_seq == 0 || failed_seq > seq) return absl::OkStatus();
  // op_seq is written last (after a system fence), so the fields below are complete.
  const DeviceErrorRecord& r = *host_record_;
  const auto field = static_cast<ItemField>(r.field);
  if (field >= ItemField::kNumPages && field != ItemField::kSlot) {  // an array entry
    return absl::OutOfRangeError(absl::StrFormat(
        "%s: %s[%d] = %d must be in [0, %d) (found by the CUDA kernel)",
        OpName(static_cast<KernelOp>(r.op)), FieldName(field), r.item, r.value, r.limit));
  }
  return absl::OutOfRangeError(
      absl::StrFormat("%s: items[%d].%s = %d must be in [0, %d) (found by the CUDA kernel)",
                      OpName(static_cast<KernelOp>(r.op)), r.item,
                      FieldName(static_cast<ItemField>(r.field)), r.value, r.limit));
}

// ---- ErrorSlotPool ----

ErrorSlotPool::~ErrorSlotPool() {
  DeviceGuard guard(device_);
  MutexLock lock(&mu_);
  for (ErrorSlot* slot : free_) {
    if (slot->claim_ != nullptr) (void)cudaFree(slot->claim_);
    if (slot->host_record_ != nullptr) (void)cudaFreeHost(slot->host_record_);
    delete slot;
  }
}

absl::StatusOr<std::shared_ptr<ErrorSlot>> ErrorSlotPool::Acquire(cudaStream_t stream) {
  KVTIER_ASSIGN_OR_RETURN(std::shared_ptr<ErrorSlot> slot, Take());
  KVTIER_CUDA_RETURN_IF_ERROR(slot->ResetClaim(stream));
  return slot;
}

absl::StatusOr<std::shared_ptr<ErrorSlot>> ErrorSlotPool::Take() {
  ErrorSlot* raw = nullptr;
  {
    MutexLock lock(&mu_);
    if (!free_.empty()) {
      raw = free_.back();
      free_.pop_back();
    }
  }
  if (raw == nullptr) raw = new ErrorSlot();
  // From here on the slot goes back to the pool whatever happens.
  std::shared_ptr<ErrorSlot> slot(raw, [this](ErrorSlot* s) { Release(s); });
  if (raw->host_record_ == nullptr) KVTIER_RETURN_IF_ERROR(Allocate(*raw));
  std::memset(raw->host_record_, 0, sizeof(DeviceErrorRecord));
  raw->retired_.store(false, std::memory_order_relaxed);
  return slot;
}

absl::Status ErrorSlotPool::Allocate(ErrorSlot& slot) {
  void* host = nullptr;
  KVTIER_CUDA_RETURN_IF_ERROR(
      cudaHostAlloc(&host, sizeof(DeviceErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable));
  void* device_view = nullptr;
  void* claim = nullptr;
  absl::Status status =
      CudaStatus(cudaHostGetDevicePointer(&device_view, host, 0), "cudaHostGetDevicePointer");
  if (status.ok()) status = CudaStatus(cudaMalloc(&claim, sizeof(int32_t)), "cudaMalloc");
  if (!status.ok()) {
    (void)cudaFreeHost(host);
    return status;
  }
  slot.host_record_ = static_cast<DeviceErrorRecord*>(host);
  slot.device_record_ = static_cast<DeviceErrorRecord*>(device_view);
  slot.claim_ = static_cast<int32_t*>(claim);
  return absl::OkStatus();
}

void ErrorSlotPool::Release(ErrorSlot* slot) {
  MutexLock lock(&mu_);
  free_.push_back(slot);
}

// ---- ErrorDeps ----

void ErrorDeps::Add(const std::shared_ptr<ErrorSlot>& slot, uint64_t seq) {
  if (seq == 0 || slot->retired_clean()) return;
  for (Mark& mark : marks_) {
    if (mark.slot == slot) {
      mark.seq = std::max(mark.seq, seq);
      return;
    }
  }
  marks_.push_back(Mark{slot, seq});
}

void ErrorDeps::Merge(const ErrorDeps& other) {
  marks_.erase(std::remove_if(marks_.begin(), marks_.end(),
                              [](const Mark& m) { return m.slot->retired_clean(); }),
               marks_.end());
  for (const Mark& mark : other.marks_) Add(mark.slot, mark.seq);
}

absl::Status ErrorDeps::Check() const {
  for (const Mark& mark : marks_) {
    absl::Status status = mark.slot->FailureUpTo(mark.seq);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

// ---- CudaEvent ----

absl::StatusOr<std::unique_ptr<CudaEvent>> CudaEvent::Create(const Backend* owner, int device) {
  cudaEvent_t event = nullptr;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return std::unique_ptr<CudaEvent>(new CudaEvent(owner, device, event));
}

CudaEvent::~CudaEvent() {
  DeviceGuard guard(device_);
  (void)cudaEventDestroy(event_);
}

bool CudaEvent::Query() {
  DeviceGuard guard(device_);
  if (!guard.status().ok()) return true;  // Wait() reports the failure
  absl::StatusOr<bool> ready = CudaReady(cudaEventQuery(event_), "cudaEventQuery");
  return !ready.ok() || *ready;  // a failed event has finished: Wait() reports why
}

absl::Status CudaEvent::Wait(absl::Duration timeout) {
  CountHostCall(HostCall::kWait);  // counted whether or not the event was complete
  const ErrorDeps deps = captured();
  KVTIER_CUDA_SCOPED_DEVICE(device_);
  if (timeout == absl::InfiniteDuration()) {
    KVTIER_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(event_));
  } else {
    KVTIER_RETURN_IF_ERROR(Poll(timeout));
  }
  return deps.Check();
}

absl::Status CudaEvent::Poll(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration pause = kFirstPause;
  while (true) {
    KVTIER_ASSIGN_OR_RETURN(const bool ready, CudaReady(cudaEventQuery(event_), "cudaEventQuery"));
    if (ready) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrFormat("cuda event not complete within %s", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(std::min(pause, deadline - now));
    pause = std::min(pause * 2, kMaxPause);
  }
}

absl::Status CudaEvent::RecordOn(cudaStream_t stream, ErrorDeps deps) {
  MutexLock lock(&mu_);
  KVTIER_CUDA_RETURN_IF_ERROR(cudaEventRecord(event_, stream));
  captured_ = std::move(deps);
  return absl::OkStatus();
}

ErrorDeps CudaEvent::captured() const {
  MutexLock lock(&mu_);
  return captured_;
}

// ---- CudaStream ----

absl::StatusOr<std::unique_ptr<CudaStream>> CudaStream::Create(const Backend* owner, int device,
                                                               ErrorSlotPool& slots,
                                                               bool low_priority) {
  // Numerically greatest <= least (lower numbers run first); 0 is the default priority and
  // also the least on current GPUs, so normal streams take `greatest` to be above both the
  // low ones and any stream created at the default (see the header).
  int least = 0, greatest = 0;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t stream = nullptr;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking,
                                                           low_priority ? least : greatest));
  absl::StatusOr<std::shared_ptr<ErrorSlot>> errors = slots.Acquire(stream);
  if (!errors.ok()) {
    (void)cudaStreamDestroy(stream);
    return errors.status();
  }
  return std::unique_ptr<CudaStream>(
      new CudaStream(owner, device, stream, *std::move(errors), /*owned=*/true));
}

absl::StatusOr<std::unique_ptr<CudaStream>> CudaStream::Adopt(const Backend* owner, int device,
                                                              ErrorSlotPool& slots,
                                                              cudaStream_t native) {
  // The claim word is reset in `native`'s order, before any kvtier kernel enqueued there.
  KVTIER_ASSIGN_OR_RETURN(std::shared_ptr<ErrorSlot> errors, slots.Acquire(native));
  return std::unique_ptr<CudaStream>(
      new CudaStream(owner, device, native, std::move(errors), /*owned=*/false));
}

CudaStream::~CudaStream() {
  DeviceGuard guard(device_);
  if (capturing_) {  // abandoned: end the capture, drop what it made
    cudaGraph_t graph = nullptr;
    if (cudaStreamEndCapture(stream_, &graph) == cudaSuccess && graph != nullptr) {
      (void)cudaGraphDestroy(graph);
    }
    (void)cudaGetLastError();
    errors_ = std::move(saved_errors_);
    capturing_ = false;
  }
  // Kernels still queued write into errors_; drain them before it can be freed.
  if (cudaStreamSynchronize(stream_) == cudaSuccess) errors_->Retire();
  if (owned_) (void)cudaStreamDestroy(stream_);
}

absl::Status CudaStream::RefuseWhileCapturing(absl::string_view op) {
  absl::Status status = absl::FailedPreconditionError(
      absl::StrFormat("%s on a capturing stream: a capture covers one stream's work only", op));
  FailCapture(status);
  return status;
}

absl::Status CudaStream::Record(Event& event) {
  KVTIER_ASSIGN_OR_RETURN(CudaEvent * e, AsCudaEvent(event, owner_, "Record"));
  if (capturing_) return RefuseWhileCapturing("Record");
  KVTIER_CUDA_SCOPED_DEVICE(device_);
  ErrorDeps deps = upstream_;
  deps.Add(errors_, op_seq_);
  return e->RecordOn(stream_, std::move(deps));
}

absl::Status CudaStream::Wait(Event& event) {
  KVTIER_ASSIGN_OR_RETURN(CudaEvent * e, AsCudaEvent(event, owner_, "Wait"));
  if (capturing_) return RefuseWhileCapturing("Wait");
  KVTIER_CUDA_SCOPED_DEVICE(device_);
  KVTIER_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, e->handle(), 0));
  upstream_.Merge(e->captured());
  return absl::OkStatus();
}

absl::Status CudaStream::Synchronize() {
  if (capturing_) return RefuseWhileCapturing("Synchronize");
  CountHostCall(HostCall::kWait);  // counted whether or not the stream was idle
  KVTIER_CUDA_SCOPED_DEVICE(device_);
  absl::Status status = CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  if (!sticky_.ok()) return sticky_;
  if (status.ok()) status = errors_->FailureUpTo(op_seq_);
  if (status.ok()) status = upstream_.Check();
  sticky_ = status;
  return status;
}

absl::Status CudaStream::BeginCapture(ErrorSlotPool& slots) {
  if (capturing_) return absl::FailedPreconditionError("BeginCapture: the stream is capturing");
  KVTIER_CUDA_SCOPED_DEVICE(device_);
  // Taken before the capture starts: a new slot allocates, which a capture refuses.
  KVTIER_ASSIGN_OR_RETURN(std::shared_ptr<ErrorSlot> slot, slots.Take());
  KVTIER_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  // The graph's first node clears its claim word, so every replay starts claimable in the
  // launching stream's order, whichever stream that is.
  if (const cudaError_t err = slot->ResetClaim(stream_); err != cudaSuccess) {
    cudaGraph_t graph = nullptr;
    if (cudaStreamEndCapture(stream_, &graph) == cudaSuccess && graph != nullptr) {
      (void)cudaGraphDestroy(graph);
    }
    return CudaStatus(err, "BeginCapture: cudaMemsetAsync of the graph's claim word");
  }
  saved_errors_ = std::exchange(errors_, std::move(slot));
  saved_op_seq_ = std::exchange(op_seq_, 0);
  capture_status_ = absl::OkStatus();
  capturing_ = true;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Graph>> CudaStream::EndCapture() {
  if (!capturing_) return absl::FailedPreconditionError("EndCapture: the stream is not capturing");
  KVTIER_CUDA_SCOPED_DEVICE(device_);
  // The stream gets its own slot and sequence back whatever happens below.
  capturing_ = false;
  std::shared_ptr<ErrorSlot> slot = std::exchange(errors_, std::move(saved_errors_));
  const uint64_t ops = std::exchange(op_seq_, saved_op_seq_);
  absl::Status status = std::exchange(capture_status_, absl::OkStatus());
  cudaGraph_t graph = nullptr;
  const absl::Status ended =
      CudaStatus(cudaStreamEndCapture(stream_, &graph), "cudaStreamEndCapture");
  if (status.ok()) status = ended;
  cudaGraphExec_t exec = nullptr;
  if (status.ok()) {
    status = CudaStatus(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  }
  if (graph != nullptr) (void)cudaGraphDestroy(graph);  // the executable graph is independent
  if (!status.ok()) return status;  // `slot` goes back to the pool: nothing ran with it
  return std::unique_ptr<Graph>(new CudaGraph(owner_, device_, exec, std::move(slot), ops));
}

// ---- CudaGraph ----

CudaGraph::~CudaGraph() {
  DeviceGuard guard(device_);
  (void)cudaGraphExecDestroy(exec_);
  errors_->Retire();  // its launches have run (Graph's contract)
}

absl::Status CudaGraph::Launch(Stream& s) {
  KVTIER_ASSIGN_OR_RETURN(CudaStream * stream, AsCudaStream(s, owner_, "Graph::Launch"));
  if (stream->capturing()) {
    return absl::FailedPreconditionError("Graph::Launch: the stream is capturing");
  }
  KVTIER_CUDA_SCOPED_DEVICE(device_);
  KVTIER_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec_, stream->handle()));
  stream->DependOn(errors_, ops_);
  return absl::OkStatus();
}

absl::StatusOr<CudaStream*> AsCudaStream(Stream& stream, const Backend* owner,
                                         absl::string_view op) {
  auto* s = dynamic_cast<CudaStream*>(&stream);
  if (s == nullptr || s->owner() != owner) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cuda backend: %s: the stream was not created by this backend", op));
  }
  return s;
}

absl::StatusOr<CudaEvent*> AsCudaEvent(Event& event, const Backend* owner, absl::string_view op) {
  auto* e = dynamic_cast<CudaEvent*>(&event);
  if (e == nullptr || e->owner() != owner) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cuda backend: %s: the event was not created by this backend", op));
  }
  return e;
}

}  // namespace kvtier::cuda
