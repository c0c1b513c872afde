// The CUDA backend (docs/architecture.md#backends): device memory, non-blocking streams and
// events, host registration for DMA and zero-copy kernels, copies (single and batched), the
// copy kernels (recall.cu, slabs.cu, offload.cu), the arithmetic kernels (select.cu,
// attention.cu, policy_ops.cu) and stream capture into CUDA graphs (cuda_stream.h).
//
// Every method first makes this backend's device current (restoring the caller's device
// afterwards), so one process may drive several GPUs through several backends. Blocking
// host calls are counted (kernels/host_calls.h): event waits and stream synchronisations
// (cuda_stream.cc), cudaMalloc/cudaFree and host (un)registration, the attention scratch's
// own cudaMalloc (attention.cu), and copies into or out of pageable host memory. Memory is
// classified by the ranges this backend allocated or registered (a map lookup), else by
// cudaPointerGetAttributes.
#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "core/mutex.h"
#include "core/status.h"
#include "kernels/cuda/compute_kernels.h"
#include "kernels/cuda/copy_kernels.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_stream.h"
#include "kernels/host_calls.h"
#include "kvtier/cuda.h"

namespace kvtier {
namespace {

using cuda::CudaStatus;

constexpr int kBatchCopyVersion = 12080;  // cudaMemcpyBatchAsync: runtime and driver 12.8

// "cuda: NVIDIA H100 80GB HBM3 (sm_90), 79 GiB, driver 13.0, runtime 13.0".
absl::StatusOr<std::string> DescribeDevice(int device) {
  cudaDeviceProp prop;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  int driver = 0;
  int runtime = 0;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaDriverGetVersion(&driver));
  KVTIER_CUDA_RETURN_IF_ERROR(cudaRuntimeGetVersion(&runtime));
  const size_t gib = (prop.totalGlobalMem + (size_t{1} << 29)) >> 30;  // rounded
  return absl::StrFormat("cuda: %s (sm_%d%d), %d GiB, driver %d.%d, runtime %d.%d", prop.name,
                         prop.major, prop.minor, gib, driver / 1000, driver % 1000 / 10,
                         runtime / 1000, runtime % 1000 / 10);
}

// Why CopyBatch must copy range by range from the start, or "" when cudaMemcpyBatchAsync may
// be tried: it needs runtime and driver 12.8; KVTIER_CUDA_NO_BATCH_COPY=1 forces the
// fallback (tests, and a way out should a driver mishandle batches).
std::string BatchCopyOff() {
  const char* forced = std::getenv("KVTIER_CUDA_NO_BATCH_COPY");
  if (forced != nullptr && absl::string_view(forced) == "1") {
    return "KVTIER_CUDA_NO_BATCH_COPY=1";
  }
#if CUDART_VERSION < 12080
  return "built with a CUDA runtime before 12.8";
#else
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) {
    (void)cudaGetLastError();
    return "driver version unknown";
  }
  if (driver < kBatchCopyVersion) {
    return absl::StrFormat("driver %d.%d before 12.8", driver / 1000, driver % 1000 / 10);
  }
  return "";
#endif
}

class CudaBackend final : public Backend {
 public:
  // `batch_copy_off`: why CopyBatch must not use cudaMemcpyBatchAsync ("" when it may).
  CudaBackend(int device, std::string description, std::string batch_copy_off)
      : device_(device),
        description_(std::move(description)),
        slots_(device),
        batch_copy_(batch_copy_off.empty()),
        batch_copy_off_(std::move(batch_copy_off)) {}

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  // The device line, and ", batched copies off (why)" when CopyBatch copies range by range.
  std::string Describe() const override {
    MutexLock lock(&mu_);
    if (batch_copy_off_.empty()) return description_;
    return absl::StrCat(description_, ", batched copies off (", batch_copy_off_, ")");
  }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    if (bytes == 0) return absl::InvalidArgumentError("Allocate: bytes must be > 0");
    KVTIER_CUDA_SCOPED_DEVICE(device_);
    void* data = nullptr;
    CountHostCall(HostCall::kAllocation);  // cudaMalloc may synchronise the device
    KVTIER_RETURN_IF_ERROR(
        CudaStatus(cudaMalloc(&data, bytes),
                   absl::StrFormat("cudaMalloc(%d bytes) on cuda:%d", bytes, device_)));
    const uintptr_t address = reinterpret_cast<uintptr_t>(data);
    Track(Range{address, bytes, address});
    return DeviceBuffer(this, data, bytes);
  }

  absl::StatusOr<std::unique_ptr<Stream>> CreateStream(StreamPriority priority) override {
    KVTIER_CUDA_SCOPED_DEVICE(device_);
    KVTIER_ASSIGN_OR_RETURN(
        auto stream,
        cuda::CudaStream::Create(this, device_, slots_, priority == StreamPriority::kLow));
    return std::unique_ptr<Stream>(std::move(stream));
  }

  // kvtier/cuda.h: AdoptCudaStream checked `native` (not a default stream) first.
  absl::StatusOr<std::unique_ptr<Stream>> AdoptStream(cudaStream_t native);
  int ordinal() const { return device_; }

  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    KVTIER_CUDA_SCOPED_DEVICE(device_);
    KVTIER_ASSIGN_OR_RETURN(auto event, cuda::CudaEvent::Create(this, device_));
    return std::unique_ptr<Event>(std::move(event));
  }

  absl::Status RegisterHost(void* data, size_t bytes) override;
  absl::Status UnregisterHost(void* data) override;

  // Copies into or out of pageable host memory (memory neither allocated nor registered
  // here, and not pinned by anyone else) are synchronous for the host: each such call
  // counts one HostCall::kSyncCopy, and while `s` captures it is refused.
  absl::Status Copy(Stream& s, void* dst, const void* src, size_t bytes) override {
    KVTIER_ASSIGN_OR_RETURN(cuda::CudaStream * stream, cuda::AsCudaStream(s, this, "Copy"));
    if (bytes == 0) return absl::OkStatus();
    KVTIER_CUDA_SCOPED_DEVICE(device_);
    if (TouchesPageable(dst, src, bytes)) {
      if (stream->capturing()) return RefuseWhileCapturing(*stream, "Copy");
      CountHostCall(HostCall::kSyncCopy);
    }
    // cudaMemcpyDefault: unified addressing tells host, registered and device memory apart.
    return CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream->handle()),
                      absl::StrFormat("cudaMemcpyAsync(%d bytes)", bytes));
  }

  absl::Status CopyBatch(Stream& s, const CopyRange* ranges, size_t n) override;

  std::string PciBusId() const override {
    char id[32] = {};
    if (cudaDeviceGetPCIBusId(id, sizeof(id), device_) != cudaSuccess) return {};
    return id;
  }

  // A kernel on the device (or zero-copy) view: never a synchronous copy. While `s`
  // captures, pageable host memory is refused.
  absl::Status Memset(Stream& s, void* dst, int value, size_t bytes) override {
    KVTIER_ASSIGN_OR_RETURN(cuda::CudaStream * stream, cuda::AsCudaStream(s, this, "Memset"));
    if (bytes == 0) return absl::OkStatus();
    KVTIER_CUDA_SCOPED_DEVICE(device_);
    if (stream->capturing() && Pageable(dst, bytes)) {
      return RefuseWhileCapturing(*stream, "Memset");
    }
    return CudaStatus(cudaMemsetAsync(DeviceView(dst), value, bytes, stream->handle()),
                      absl::StrFormat("cudaMemsetAsync(%d bytes)", bytes));
  }

  // CUDA graphs (cuda_stream.h: the error slot of a graph, and the limits).
  bool SupportsCapture() const override { return true; }
  absl::Status BeginCapture(Stream& s) override {
    KVTIER_ASSIGN_OR_RETURN(cuda::CudaStream * stream, cuda::AsCudaStream(s, this, "BeginCapture"));
    return stream->BeginCapture(slots_);
  }
  absl::StatusOr<std::unique_ptr<Graph>> EndCapture(Stream& s) override {
    KVTIER_ASSIGN_OR_RETURN(cuda::CudaStream * stream, cuda::AsCudaStream(s, this, "EndCapture"));
    return stream->EndCapture();
  }

  size_t SparseAttentionWorkspaceBytes(const SparseAttentionArgs& a) const override {
    return cuda::SparseAttentionScratchBytes(a, device_);
  }

 protected:
  void Free(void* data) override {
    cuda::DeviceGuard guard(device_);
    Untrack(data);
    CountHostCall(HostCall::kFree);  // cudaFree may synchronise the device
    // Nothing to report a failure to: DeviceBuffer frees in its destructor.
    (void)cudaFree(data);
  }

  absl::Status DoRecall(Stream& s, const RecallArgs& a) override;
  absl::Status DoGatherSlabs(Stream& s, const GatherSlabsArgs& a) override;
  absl::Status DoScatterSlabs(Stream& s, const ScatterSlabsArgs& a) override;
  absl::Status DoOffload(Stream& s, const OffloadArgs& a) override;

  absl::Status DoScorePages(Stream& s, const ScorePagesArgs& a) override;
  absl::Status DoTopK(Stream& s, const TopKArgs& a) override;
  absl::Status DoReplace(Stream& s, const ReplaceArgs& a) override;
  absl::Status DoQueryCosine(Stream& s, const QueryCosineArgs& a) override;
  absl::Status DoSelectionLoss(Stream& s, const SelectionLossArgs& a) override;
  absl::Status DoSparseAttention(Stream& s, const SparseAttentionArgs& a) override;
  absl::Status DoDenseAttention(Stream& s, const DenseAttentionArgs& a) override;
  absl::Status DoMoveHeadSlots(Stream& s, const MoveHeadSlotsArgs& a) override;

 private:
  // Memory this backend allocated (device view = itself) or registered (device view of the
  // host range), by first byte.
  struct Range {
    uintptr_t base;  // first byte
    size_t bytes;
    uintptr_t device;  // device view of the first byte
  };

  void Track(Range range) {
    MutexLock lock(&mu_);
    ranges_[range.base] = range;
  }
  void Untrack(const void* p) {
    MutexLock lock(&mu_);
    ranges_.erase(reinterpret_cast<uintptr_t>(p));
  }
  // The tracked range holding [p, p + bytes), or null.
  const Range* Find(const void* p, size_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // [p, p + bytes) is pageable host memory: not tracked here, and cudaPointerGetAttributes
  // knows it as unregistered host memory (or does not know it). Nothing is cached: memory
  // freed and reused may change kind.
  bool Pageable(const void* p, size_t bytes) const;
  bool TouchesPageable(const void* dst, const void* src, size_t bytes) const {
    return Pageable(dst, bytes) || Pageable(src, bytes);
  }
  // FAILED_PRECONDITION for `op` touching pageable memory while `stream` captures; fails
  // the capture.
  static absl::Status RefuseWhileCapturing(cuda::CudaStream& stream, absl::string_view op);

  // The device view of `p` when it lies in host memory registered here, else `p` itself
  // (device memory, or host memory whose pointer the device can use as is).
  const void* DeviceAddress(const void* p) const;
  template <typename T>
  T* DeviceView(T* p) const {
    return static_cast<T*>(const_cast<void*>(DeviceAddress(p)));
  }
  // `kv` with every pointer replaced by its device view.
  PagedKv DeviceView(const PagedKv& kv) const;

  // CopyBatch's two ways: one cudaMemcpyBatchAsync (raw error: the caller decides whether it
  // means "unsupported") and one cudaMemcpyAsync per range.
  static cudaError_t BatchCopy(cudaStream_t stream, const CopyRange* ranges, size_t n);
  static absl::Status CopyEach(cudaStream_t stream, const CopyRange* ranges, size_t n);
  void DisableBatchCopy(std::string why) {
    batch_copy_.store(false, std::memory_order_relaxed);
    MutexLock lock(&mu_);
    if (batch_copy_off_.empty()) batch_copy_off_ = std::move(why);
  }

  const int device_;
  const std::string description_;
  cuda::ErrorSlotPool slots_;
  // False once cudaMemcpyBatchAsync is known not to work here; never true again.
  std::atomic<bool> batch_copy_;
  mutable Mutex mu_;
  std::string batch_copy_off_ ABSL_GUARDED_BY(mu_);
  std::map<uintptr_t, Range> ranges_ ABSL_GUARDED_BY(mu_);
};

absl::Status CudaBackend::RegisterHost(void* data, size_t bytes) {
  if (data == nullptr || bytes == 0 || bytes > kMaxRegisterBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "RegisterHost: need a non-null range of 1..%d bytes (got %d); split larger ranges",
        kMaxRegisterBytes, bytes));
  }
  KVTIER_CUDA_SCOPED_DEVICE(device_);
  CountHostCall(HostCall::kAllocation);  // cudaHostRegister may synchronise the device
  KVTIER_RETURN_IF_ERROR(
      CudaStatus(cudaHostRegister(data, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped),
                 absl::StrFormat("cudaHostRegister(%p, %d bytes)", data, bytes)));
  void* device_view = nullptr;
  absl::Status status =
      CudaStatus(cudaHostGetDevicePointer(&device_view, data, 0), "cudaHostGetDevicePointer");
  if (!status.ok()) {
    CountHostCall(HostCall::kFree);
    (void)cudaHostUnregister(data);
    return status;
  }
  Track(Range{reinterpret_cast<uintptr_t>(data), bytes, reinterpret_cast<uintptr_t>(device_view)});
  return absl::OkStatus();
}

absl::Status CudaBackend::UnregisterHost(void* data) {
  KVTIER_CUDA_SCOPED_DEVICE(device_);
  Untrack(data);
  CountHostCall(HostCall::kFree);
  return CudaStatus(cudaHostUnregister(data), absl::StrFormat("cudaHostUnregister(%p)", data));
}

const CudaBackend::Range* CudaBackend::Find(const void* p, size_t bytes) const {
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  auto it = ranges_.upper_bound(address);
  if (it == ranges_.begin()) return nullptr;
  --it;
  const uintptr_t offset = address - it->first;
  if (offset >= it->second.bytes || bytes > it->second.bytes - offset) return nullptr;
  return &it->second;
}

bool CudaBackend::Pageable(const void* p, size_t bytes) const {
  {
    MutexLock lock(&mu_);
    if (Find(p, bytes) != nullptr) return false;
  }
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky; a pointer CUDA does not know is host memory
    return true;
  }
  // Pinned memory (cudaHostAlloc, or registered by someone else) has a device view.
  return attr.type == cudaMemoryTypeUnregistered ||
         (attr.type == cudaMemoryTypeHost && attr.devicePointer == nullptr);
}

absl::Status CudaBackend::RefuseWhileCapturing(cuda::CudaStream& stream, absl::string_view op) {
  absl::Status status = absl::FailedPreconditionError(absl::StrFormat(
      "%s on a capturing stream touches pageable host memory (register it: a graph replays "
      "copies asynchronously)",
      op));
  stream.FailCapture(status);
  return status;
}

const void* CudaBackend::DeviceAddress(const void* p) const {
  MutexLock lock(&mu_);
  const Range* range = Find(p, 1);
  if (range == nullptr) return p;
  return reinterpret_cast<const void*>(range->device +
                                       (reinterpret_cast<uintptr_t>(p) - range->base));
}

PagedKv CudaBackend::DeviceView(const PagedKv& kv) const {
  PagedKv d = kv;
  d.k_cache = DeviceView(kv.k_cache);
  d.v_cache = DeviceView(kv.v_cache);
  d.slot_table = DeviceView(kv.slot_table);
  d.partial_page = DeviceView(kv.partial_page);
  d.partial_len = DeviceView(kv.partial_len);
  return d;
}

// One cudaMemcpyBatchAsync where the runtime and the driver have it (and it has not been
// found wanting), else one cudaMemcpyAsync per range. The range-by-range way is taken for a
// batch touching pageable memory (each such range then counts as a synchronous copy; the
// batch API's handling of it is not relied on) and while capturing (plain copies are
// capturable on every driver). Fallback at run time: cudaErrorNotSupported or
// cudaErrorCallRequiresNewerDriver turn the batch API off for good; cudaErrorInvalidValue
// does when the same ranges then copy one by one (so it was the batch API that refused
// them, not the ranges). Copying a range twice is harmless: the ranges are independent and
// run in stream order. Zero-byte ranges are skipped.
absl::Status CudaBackend::CopyBatch(Stream& s, const CopyRange* ranges, size_t n) {
  KVTIER_ASSIGN_OR_RETURN(cuda::CudaStream * stream, cuda::AsCudaStream(s, this, "CopyBatch"));
  if (n == 0) return absl::OkStatus();
  if (ranges == nullptr) {
    return absl::InvalidArgumentError("CopyBatch: ranges must be non-null when n > 0");
  }
  KVTIER_CUDA_SCOPED_DEVICE(device_);
  size_t pageable = 0;
  for (size_t i = 0; i < n; ++i) {
    if (ranges[i].bytes > 0 && TouchesPageable(ranges[i].dst, ranges[i].src, ranges[i].bytes)) {
      ++pageable;
    }
  }
  if (pageable > 0 && stream->capturing()) return RefuseWhileCapturing(*stream, "CopyBatch");
  for (size_t i = 0; i < pageable; ++i) CountHostCall(HostCall::kSyncCopy);
  if (pageable > 0 || stream->capturing() || !batch_copy_.load(std::memory_order_relaxed)) {
    return CopyEach(stream->handle(), ranges, n);
  }
  const cudaError_t err = BatchCopy(stream->handle(), ranges, n);
  if (err == cudaSuccess) return absl::OkStatus();
  if (err != cudaErrorNotSupported && err != cudaErrorCallRequiresNewerDriver &&
      err != cudaErrorInvalidValue) {
    return CudaStatus(err, absl::StrFormat("cudaMemcpyBatchAsync(%d copies)", n));
  }
  (void)cudaGetLastError();  // none of the three is sticky: clear it for later checks
  absl::Status each = CopyEach(stream->handle(), ranges, n);
  if (each.ok() || err != cudaErrorInvalidValue) {
    DisableBatchCopy(absl::StrCat("cudaMemcpyBatchAsync: ", cudaGetErrorName(err)));
  }
  return each;
}

cudaError_t CudaBackend::BatchCopy(cudaStream_t stream, const CopyRange* ranges, size_t n) {
#if CUDART_VERSION >= 12080
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  dsts.reserve(n);
  srcs.reserve(n);
  sizes.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (ranges[i].bytes == 0) continue;
    dsts.push_back(ranges[i].dst);
    srcs.push_back(ranges[i].src);
    sizes.push_back(ranges[i].bytes);
  }
  if (sizes.empty()) return cudaSuccess;
  // One attribute for every copy: stream-ordered sources (they may have been written by
  // earlier work on the stream), copies overlapping compute where the hardware can.
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_index = 0;
#if CUDART_VERSION >= 13000
  return cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), sizes.size(), &attr,
                              &attr_index, 1, stream);
#else
  size_t fail_index = 0;
  return cudaMemcpyBatchAsync(const_cast<void**>(dsts.data()), const_cast<void**>(srcs.data()),
                              sizes.data(), sizes.size(), &attr, &attr_index, 1, &fail_index,
                              stream);
#endif
#else
  (void)stream;
  (void)ranges;
  (void)n;
  return cudaErrorNotSupported;  // never called: batch_copy_ starts false (NewCudaBackend)
#endif
}

absl::Status CudaBackend::CopyEach(cudaStream_t stream, const CopyRange* ranges, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (ranges[i].bytes == 0) continue;
    KVTIER_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(ranges[i].dst, ranges[i].src, ranges[i].bytes, cudaMemcpyDefault, stream),
        absl::StrFormat("cudaMemcpyAsync(%d bytes)", ranges[i].bytes)));
  }
  return absl::OkStatus();
}

// The sparse op's alignment contract (attention.cu, compute_kernels.h), checked on the
// device views the kernel reads: INVALID_ARGUMENT naming the first field that breaks it.
absl::Status CheckSparseAttentionAlignment(const SparseAttentionArgs& a) {
  constexpr const char* op = "SparseAttention";
  const int32_t vec = cuda::AttentionVectorElements(a.shape.dtype);
  if (vec == 0 || a.shape.head_dim % vec != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: shape.head_dim = %d must be a multiple of %d on the cuda backend (K/V rows are "
        "read as %d-byte vectors)",
        op, a.shape.head_dim, vec, cuda::kAttentionVectorBytes));
  }
  const size_t element = DTypeSize(a.shape.dtype);
  struct Field {
    const char* name;
    const void* ptr;
    size_t alignment;  // bytes
  };
  // kv.k_cache and kv.v_cache: ValidateArgs checks them for every backend (kAttentionAlignment).
  const Field fields[] = {
      {"q", a.q, element},
      {"out", a.out, element},
      {"lse", a.lse, sizeof(float)},
      {"token_prob", a.token_prob, sizeof(float)},
      {"kv.slot_table", a.kv.slot_table, sizeof(int32_t)},
      {"kv.partial_page", a.kv.partial_page, sizeof(int32_t)},
      {"kv.partial_len", a.kv.partial_len, sizeof(int32_t)},
      {"query_position", a.query_position, sizeof(int64_t)},
      {"workspace", a.workspace, sizeof(float)},
  };
  for (const Field& f : fields) {
    if (f.ptr != nullptr && reinterpret_cast<uintptr_t>(f.ptr) % f.alignment != 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: %s (%p) must be %d-byte aligned on the cuda backend", op, f.name,
                          f.ptr, f.alignment));
    }
  }
  return absl::OkStatus();
}

// The ops: once the stream is known to be this backend's, nothing is launched when `empty`
// holds (an op of no items); otherwise every pointer argument is translated to its device
// view and the kernel is launched on the stream with the stream's error sink.
#define KVTIER_CUDA_LAUNCH_OP(Name, Launcher, empty, ...)                                \
  KVTIER_ASSIGN_OR_RETURN(cuda::CudaStream* stream, cuda::AsCudaStream(s, this, #Name)); \
  if (empty) return absl::OkStatus();                                                    \
  KVTIER_CUDA_SCOPED_DEVICE(device_);                                                    \
  auto d = a;                                                                            \
  __VA_ARGS__;                                                                           \
  return CudaStatus(cuda::Launcher(d, stream->NextOp(), stream->handle()), #Name " kernel launch")

#define KVTIER_VIEW(field) d.field = DeviceView(a.field)

absl::Status CudaBackend::DoRecall(Stream& s, const RecallArgs& a) {
  KVTIER_CUDA_LAUNCH_OP(Recall, LaunchRecall, a.num_items == 0, KVTIER_VIEW(host_pages),
                        KVTIER_VIEW(items), KVTIER_VIEW(kv));
}

absl::Status CudaBackend::DoGatherSlabs(Stream& s, const GatherSlabsArgs& a) {
  KVTIER_CUDA_LAUNCH_OP(GatherSlabs, LaunchGatherSlabs, a.num_items == 0, KVTIER_VIEW(host_pages),
                        KVTIER_VIEW(items), KVTIER_VIEW(staging));
}

absl::Status CudaBackend::DoScatterSlabs(Stream& s, const ScatterSlabsArgs& a) {
  KVTIER_CUDA_LAUNCH_OP(ScatterSlabs, LaunchScatterSlabs, a.num_items == 0, KVTIER_VIEW(staging),
                        KVTIER_VIEW(items), KVTIER_VIEW(kv));
}

absl::Status CudaBackend::DoOffload(Stream& s, const OffloadArgs& a) {
  KVTIER_CUDA_LAUNCH_OP(Offload, LaunchOffload, a.num_items == 0, KVTIER_VIEW(k_src),
                        KVTIER_VIEW(v_src), KVTIER_VIEW(host_pages), KVTIER_VIEW(summaries),
                        KVTIER_VIEW(items));
}

absl::Status CudaBackend::DoScorePages(Stream& s, const ScorePagesArgs& a) {
  KVTIER_CUDA_LAUNCH_OP(ScorePages, LaunchScorePages, false, KVTIER_VIEW(q), KVTIER_VIEW(summaries),
                        KVTIER_VIEW(num_pages), KVTIER_VIEW(scores), KVTIER_VIEW(pooled),
                        KVTIER_VIEW(head_mask));
}

absl::Status CudaBackend::DoTopK(Stream& s, const TopKArgs& a) {
  KVTIER_CUDA_LAUNCH_OP(TopK, LaunchTopK, false, KVTIER_VIEW(pooled), KVTIER_VIEW(num_pages),
                        KVTIER_VIEW(selected), KVTIER_VIEW(head_mask), KVTIER_VIEW(head_k),
                        KVTIER_VIEW(page_flags));
}

absl::Status CudaBackend::DoQueryCosine(Stream& s, const QueryCosineArgs& a) {
  KVTIER_CUDA_LAUNCH_OP(QueryCosine, LaunchQueryCosine, false, KVTIER_VIEW(q), KVTIER_VIEW(q_prev),
                        KVTIER_VIEW(cosine), KVTIER_VIEW(group_mean), KVTIER_VIEW(drifted));
}

absl::Status CudaBackend::DoSelectionLoss(Stream& s, const SelectionLossArgs& a) {
  KVTIER_CUDA_LAUNCH_OP(SelectionLoss, LaunchSelectionLoss, false, KVTIER_VIEW(pooled),
                        KVTIER_VIEW(current), KVTIER_VIEW(fresh), KVTIER_VIEW(loss),
                        KVTIER_VIEW(drifted));
}

absl::Status CudaBackend::DoReplace(Stream& s, const ReplaceArgs& a) {
  KVTIER_CUDA_LAUNCH_OP(Replace, LaunchReplace, false, KVTIER_VIEW(kv), KVTIER_VIEW(selected),
                        KVTIER_VIEW(host_page_of), KVTIER_VIEW(head_mask), KVTIER_VIEW(items),
                        KVTIER_VIEW(num_misses));
}

// Refuses views that break the kernel's alignment contract before launching; takes its
// split scratch from a.workspace when that is large enough (attention.cu).
absl::Status CudaBackend::DoSparseAttention(Stream& s, const SparseAttentionArgs& a) {
  KVTIER_ASSIGN_OR_RETURN(cuda::CudaStream * stream,
                          cuda::AsCudaStream(s, this, "SparseAttention"));
  KVTIER_CUDA_SCOPED_DEVICE(device_);
  auto d = a;
  KVTIER_VIEW(kv), KVTIER_VIEW(q), KVTIER_VIEW(out), KVTIER_VIEW(lse), KVTIER_VIEW(query_position),
      KVTIER_VIEW(token_prob), KVTIER_VIEW(workspace);
  KVTIER_RETURN_IF_ERROR(CheckSparseAttentionAlignment(d));
  return CudaStatus(cuda::LaunchSparseAttention(d, stream->NextOp(), stream->handle()),
                    "SparseAttention kernel launch");
}

absl::Status CudaBackend::DoDenseAttention(Stream& s, const DenseAttentionArgs& a) {
  KVTIER_CUDA_LAUNCH_OP(DenseAttention, LaunchDenseAttention, false, KVTIER_VIEW(q), KVTIER_VIEW(k),
                        KVTIER_VIEW(v), KVTIER_VIEW(seq_len), KVTIER_VIEW(out), KVTIER_VIEW(lse));
}

absl::Status CudaBackend::DoMoveHeadSlots(Stream& s, const MoveHeadSlotsArgs& a) {
  if (a.num_items == 0) return absl::OkStatus();
  KVTIER_CUDA_LAUNCH_OP(MoveHeadSlots, LaunchMoveHeadSlots, false, KVTIER_VIEW(kv),
                        KVTIER_VIEW(items));
}

#undef KVTIER_VIEW
#undef KVTIER_CUDA_LAUNCH_OP

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(const DeviceOptions& options) {
  int count = 0;
  absl::Status status = CudaStatus(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (!status.ok()) {
    return absl::UnavailableError(absl::StrCat("cuda backend unavailable: ", status.message()));
  }
  const int device = options.cuda_device;
  if (device < 0 || device >= count) {
    return absl::UnavailableError(absl::StrFormat(
        "cuda backend: device %d requested, but %d device(s) are visible", device, count));
  }
  cuda::DeviceGuard guard(device);
  status = guard.status();
  // cudaFree(nullptr) creates the device's primary context: fail here, not on first use.
  if (status.ok()) status = CudaStatus(cudaFree(nullptr), "context creation");
  absl::StatusOr<std::string> description =
      status.ok() ? DescribeDevice(device) : absl::StatusOr<std::string>(status);
  if (!description.ok()) {
    return absl::UnavailableError(absl::StrFormat("cuda backend: device %d is not usable: %s",
                                                  device, description.status().message()));
  }
  return std::make_unique<CudaBackend>(device, *std::move(description), BatchCopyOff());
}

absl::StatusOr<std::unique_ptr<Stream>> CudaBackend::AdoptStream(cudaStream_t native) {
  KVTIER_CUDA_SCOPED_DEVICE(device_);
#if CUDART_VERSION >= 12080
  int native_device = -1;
  KVTIER_RETURN_IF_ERROR(CudaStatus(cudaStreamGetDevice(native, &native_device),
                                    "AdoptCudaStream: cudaStreamGetDevice"));
  if (native_device != device_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("AdoptCudaStream: the stream belongs to cuda:%d, the device is cuda:%d",
                        native_device, device_));
  }
#else
  // Before CUDA 12.8 the runtime cannot say which device a stream belongs to; at least
  // check that the handle is a stream (the device is the caller's REQUIRES).
  unsigned int flags = 0;
  KVTIER_RETURN_IF_ERROR(
      CudaStatus(cudaStreamGetFlags(native, &flags), "AdoptCudaStream: cudaStreamGetFlags"));
#endif
  KVTIER_ASSIGN_OR_RETURN(auto stream, cuda::CudaStream::Adopt(this, device_, slots_, native));
  return std::unique_ptr<Stream>(std::move(stream));
}

// The CUDA backend behind `device`, or INVALID_ARGUMENT naming `op`.
absl::StatusOr<CudaBackend*> AsCudaBackend(Device& device, absl::string_view op) {
  auto* backend = dynamic_cast<CudaBackend*>(&device);
  if (backend == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: needs a kvtier cuda device (CreateDevice(DeviceKind::kCuda)), got a %s device", op,
        DeviceKindName(device.kind())));
  }
  return backend;
}

int CudaDeviceCountImpl() {
  int count = 0;
  if (!CudaStatus(cudaGetDeviceCount(&count), "cudaGetDeviceCount").ok()) return 0;
  return count;
}

bool CudaBuilt() { return true; }

// ---- kvtier/cuda.h ----

absl::StatusOr<cudaStream_t> NativeCudaStream(Stream& stream) {
  auto* cuda_stream = dynamic_cast<cuda::CudaStream*>(&stream);
  if (cuda_stream == nullptr) {
    return absl::InvalidArgumentError(
        "NativeCudaStream: not a stream of a kvtier cuda device (a cpu stream has no native "
        "CUDA stream)");
  }
  return cuda_stream->handle();
}

absl::StatusOr<std::unique_ptr<Stream>> AdoptCudaStream(Device& device, cudaStream_t native) {
  KVTIER_ASSIGN_OR_RETURN(CudaBackend * backend, AsCudaBackend(device, "AdoptCudaStream"));
  if (native == nullptr || native == cudaStreamLegacy || native == cudaStreamPerThread) {
    return absl::InvalidArgumentError(
        "AdoptCudaStream: a default stream (0, cudaStreamLegacy, cudaStreamPerThread) cannot be "
        "adopted: it synchronises implicitly and cannot be captured; create a stream");
  }
  return backend->AdoptStream(native);
}

absl::StatusOr<int> CudaDeviceOrdinal(Device& device) {
  KVTIER_ASSIGN_OR_RETURN(CudaBackend * backend, AsCudaBackend(device, "CudaDeviceOrdinal"));
  return backend->ordinal();
}

}  // namespace kvtier
