// The CUDA backend (docs/architecture.md#backends): device memory, non-blocking streams and events, host
// registration for DMA and zero-copy kernels, copies (single and batched), the copy kernels
// (recall.cu, slabs.cu, offload.cu) and the arithmetic kernels (select.cu, attention.cu,
// policy_ops.cu).
//
// Every method first makes this backend's device current (restoring the caller's device
// afterwards), so one process may drive several GPUs through several backends.
#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "kernels/cuda/compute_kernels.h"
#include "kernels/cuda/copy_kernels.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_stream.h"
#include "core/mutex.h"
#include "core/status.h"

namespace kvtier {
namespace {

using cuda::CudaStatus;

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

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, std::string description)
      : device_(device), description_(std::move(description)), slots_(device) {}

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string Describe() const override { return description_; }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    if (bytes == 0) return absl::InvalidArgumentError("Allocate: bytes must be > 0");
    KVTIER_CUDA_SCOPED_DEVICE(device_);
    void* data = nullptr;
    KVTIER_RETURN_IF_ERROR(
        CudaStatus(cudaMalloc(&data, bytes),
                   absl::StrFormat("cudaMalloc(%d bytes) on cuda:%d", bytes, device_)));
    return DeviceBuffer(this, data, bytes);
  }

  absl::StatusOr<std::unique_ptr<Stream>> CreateStream(StreamPriority priority) override {
    KVTIER_CUDA_SCOPED_DEVICE(device_);
    KVTIER_ASSIGN_OR_RETURN(
        auto stream,
        cuda::CudaStream::Create(this, device_, slots_, priority == StreamPriority::kLow));
    return std::unique_ptr<Stream>(std::move(stream));
  }

  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    KVTIER_CUDA_SCOPED_DEVICE(device_);
    KVTIER_ASSIGN_OR_RETURN(auto event, cuda::CudaEvent::Create(this, device_));
    return std::unique_ptr<Event>(std::move(event));
  }

  absl::Status RegisterHost(void* data, size_t bytes) override;
  absl::Status UnregisterHost(void* data) override;

  absl::Status Copy(Stream& s, void* dst, const void* src, size_t bytes) override {
    KVTIER_ASSIGN_OR_RETURN(cuda::CudaStream * stream, cuda::AsCudaStream(s, this, "Copy"));
    if (bytes == 0) return absl::OkStatus();
    KVTIER_CUDA_SCOPED_DEVICE(device_);
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

  absl::Status Memset(Stream& s, void* dst, int value, size_t bytes) override {
    KVTIER_ASSIGN_OR_RETURN(cuda::CudaStream * stream, cuda::AsCudaStream(s, this, "Memset"));
    if (bytes == 0) return absl::OkStatus();
    KVTIER_CUDA_SCOPED_DEVICE(device_);
    return CudaStatus(cudaMemsetAsync(DeviceView(dst), value, bytes, stream->handle()),
                      absl::StrFormat("cudaMemsetAsync(%d bytes)", bytes));
  }

 protected:
  void Free(void* data) override {
    cuda::DeviceGuard guard(device_);
    (void)cudaFree(data);  // nothing to report to: DeviceBuffer frees in its destructor
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
  absl::Status DoQuantizeSlots(Stream& s, const QuantizeSlotsArgs& a) override;
  absl::Status DoMoveHeadSlots(Stream& s, const MoveHeadSlotsArgs& a) override;

 private:
  struct Registration {
    size_t bytes;
    uintptr_t device;  // device view of the range's first byte
  };

  // The device view of `p` when it lies in host memory registered here, else `p` itself
  // (device memory, or host memory whose pointer the device can use as is).
  const void* DeviceAddress(const void* p) const;
  template <typename T>
  T* DeviceView(T* p) const {
    return static_cast<T*>(const_cast<void*>(DeviceAddress(p)));
  }
  // `kv` with every pointer replaced by its device view.
  PagedKv DeviceView(const PagedKv& kv) const;

  const int device_;
  const std::string description_;
  cuda::ErrorSlotPool slots_;
  mutable Mutex mu_;
  // Host ranges registered through this backend, by first byte.
  std::map<uintptr_t, Registration> registered_ ABSL_GUARDED_BY(mu_);
};

absl::Status CudaBackend::RegisterHost(void* data, size_t bytes) {
  if (data == nullptr || bytes == 0 || bytes > kMaxRegisterBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "RegisterHost: need a non-null range of 1..%d bytes (got %d); split larger ranges",
        kMaxRegisterBytes, bytes));
  }
  KVTIER_CUDA_SCOPED_DEVICE(device_);
  KVTIER_RETURN_IF_ERROR(
      CudaStatus(cudaHostRegister(data, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped),
                 absl::StrFormat("cudaHostRegister(%p, %d bytes)", data, bytes)));
  void* device_view = nullptr;
  absl::Status status =
      CudaStatus(cudaHostGetDevicePointer(&device_view, data, 0), "cudaHostGetDevicePointer");
  if (!status.ok()) {
    (void)cudaHostUnregister(data);
    return status;
  }
  MutexLock lock(&mu_);
  registered_[reinterpret_cast<uintptr_t>(data)] =
      Registration{bytes, reinterpret_cast<uintptr_t>(device_view)};
  return absl::OkStatus();
}

absl::Status CudaBackend::UnregisterHost(void* data) {
  KVTIER_CUDA_SCOPED_DEVICE(device_);
  {
    MutexLock lock(&mu_);
    registered_.erase(reinterpret_cast<uintptr_t>(data));
  }
  return CudaStatus(cudaHostUnregister(data), absl::StrFormat("cudaHostUnregister(%p)", data));
}

const void* CudaBackend::DeviceAddress(const void* p) const {
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  MutexLock lock(&mu_);
  auto it = registered_.upper_bound(address);
  if (it == registered_.begin()) return p;
  --it;
  const uintptr_t offset = address - it->first;
  if (offset >= it->second.bytes) return p;
  return reinterpret_cast<const void*>(it->second.device + offset);
}

PagedKv CudaBackend::DeviceView(const PagedKv& kv) const {
  PagedKv d = kv;
  d.k_cache = DeviceView(kv.k_cache);
  d.v_cache = DeviceView(kv.v_cache);
  d.slot_table = DeviceView(kv.slot_table);
  d.partial_page = DeviceView(kv.partial_page);
  d.partial_len = DeviceView(kv.partial_len);
  d.slot_int8 = DeviceView(kv.slot_int8);
  d.k_int8 = DeviceView(kv.k_int8);
  d.v_int8 = DeviceView(kv.v_int8);
  d.k_scale = DeviceView(kv.k_scale);
  d.v_scale = DeviceView(kv.v_scale);
  return d;
}

absl::Status CudaBackend::CopyBatch(Stream& s, const CopyRange* ranges, size_t n) {
  KVTIER_ASSIGN_OR_RETURN(cuda::CudaStream * stream, cuda::AsCudaStream(s, this, "CopyBatch"));
  if (n == 0) return absl::OkStatus();
  if (ranges == nullptr) {
    return absl::InvalidArgumentError("CopyBatch: ranges must be non-null when n > 0");
  }
  KVTIER_CUDA_SCOPED_DEVICE(device_);
#if CUDART_VERSION >= 12080
  std::vector<void*> dsts(n);
  std::vector<const void*> srcs(n);
  std::vector<size_t> sizes(n);
  for (size_t i = 0; i < n; ++i) {
    dsts[i] = ranges[i].dst;
    srcs[i] = ranges[i].src;
    sizes[i] = ranges[i].bytes;
  }
  // One attribute for every copy: stream-ordered sources (they may have been written by
  // earlier work on the stream), copies overlapping compute where the hardware can.
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_index = 0;
#if CUDART_VERSION >= 13000
  return CudaStatus(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), n, &attr,
                                         &attr_index, 1, stream->handle()),
                    absl::StrFormat("cudaMemcpyBatchAsync(%d copies)", n));
#else
  size_t fail_index = 0;
  return CudaStatus(
      cudaMemcpyBatchAsync(const_cast<void**>(dsts.data()), const_cast<void**>(srcs.data()),
                           sizes.data(), n, &attr, &attr_index, 1, &fail_index, stream->handle()),
      absl::StrFormat("cudaMemcpyBatchAsync(%d copies)", n));
#endif
#else
  for (size_t i = 0; i < n; ++i) {
    KVTIER_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(ranges[i].dst, ranges[i].src, ranges[i].bytes, cudaMemcpyDefault,
                                   stream->handle()),
                   absl::StrFormat("cudaMemcpyAsync(%d bytes)", ranges[i].bytes)));
  }
  return absl::OkStatus();
#endif
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

absl::Status CudaBackend::DoSparseAttention(Stream& s, const SparseAttentionArgs& a) {
  KVTIER_CUDA_LAUNCH_OP(SparseAttention, LaunchSparseAttention, false, KVTIER_VIEW(kv),
                        KVTIER_VIEW(q), KVTIER_VIEW(out), KVTIER_VIEW(lse),
                        KVTIER_VIEW(query_position), KVTIER_VIEW(token_prob));
}

absl::Status CudaBackend::DoDenseAttention(Stream& s, const DenseAttentionArgs& a) {
  KVTIER_CUDA_LAUNCH_OP(DenseAttention, LaunchDenseAttention, false, KVTIER_VIEW(q), KVTIER_VIEW(k),
                        KVTIER_VIEW(v), KVTIER_VIEW(seq_len), KVTIER_VIEW(out), KVTIER_VIEW(lse));
}

absl::Status CudaBackend::DoQuantizeSlots(Stream& s, const QuantizeSlotsArgs& a) {
  if (a.num_items == 0) return absl::OkStatus();
  KVTIER_CUDA_LAUNCH_OP(QuantizeSlots, LaunchQuantizeSlots, false, KVTIER_VIEW(kv),
                        KVTIER_VIEW(items));
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
  return std::make_unique<CudaBackend>(device, *std::move(description));
}

int CudaDeviceCountImpl() {
  int count = 0;
  if (!CudaStatus(cudaGetDeviceCount(&count), "cudaGetDeviceCount").ok()) return 0;
  return count;
}

bool CudaBuilt() { return true; }

}  // namespace kvtier
