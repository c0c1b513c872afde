#include "kernels/cpu/cpu_backend.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_format.h"
#include "core/mutex.h"
#include "core/status.h"
#include "kernels/host_calls.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/cpu_stream.h"
#include "kernels/cpu/thread_pool.h"

namespace kvtier {
namespace {

constexpr size_t kAlignment = 256;  // bytes, as cudaMalloc guarantees
constexpr size_t kHugePage = size_t{2} << 20;  // x86-64 transparent huge page

// A captured task list (Backend::EndCapture): Launch enqueues every task again, in order.
class CpuGraph final : public Graph {
 public:
  explicit CpuGraph(std::vector<std::function<absl::Status()>> tasks) : tasks_(std::move(tasks)) {}
  absl::Status Launch(Stream& s) override {
    auto* stream = dynamic_cast<CpuStream*>(&s);
    if (stream == nullptr) {
      return absl::InvalidArgumentError("Graph::Launch: stream was not created by a cpu backend");
    }
    if (stream->capturing()) {
      return absl::FailedPreconditionError("Graph::Launch: the stream is capturing");
    }
    for (const auto& task : tasks_) stream->Enqueue(task);
    return absl::OkStatus();
  }

 private:
  const std::vector<std::function<absl::Status()>> tasks_;
};

class CpuBackend final : public Backend {
 public:
  CpuBackend(int num_threads, std::optional<cpu::Isa> isa)
      : isa_(isa), pool_(num_threads), low_pool_(pool_.num_threads(), /*low_priority=*/true) {}

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  std::string Describe() const override {
    if (isa_.has_value()) {
      return absl::StrFormat("cpu: %d threads, %s kernels", pool_.num_threads(),
                             cpu::IsaName(cpu::RunnableIsa(*isa_)));
    }
    return absl::StrFormat("cpu: %d threads", pool_.num_threads());
  }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    if (bytes == 0) return absl::InvalidArgumentError("Allocate: bytes must be > 0");
    // Buffers of a huge page or more are huge-page aligned and backed by transparent huge
    // pages where the kernel allows it (madvise mode): a working set or KV cache read once
    // per step after other layers' data has evicted it otherwise pays a TLB miss, and a
    // page-table walk from DRAM, every 4 KiB.
    const size_t align = bytes >= kHugePage ? kHugePage : kAlignment;
    const size_t rounded = (bytes + align - 1) / align * align;
    CountHostCall(HostCall::kAllocation);  // cudaMalloc may synchronise the device
    void* p = std::aligned_alloc(align, rounded);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("Allocate: out of host memory allocating %d bytes", bytes));
    }
    if (align == kHugePage) (void)madvise(p, rounded, MADV_HUGEPAGE);  // a hint: best effort
    Track(p, rounded, Memory::kDevice);
    return DeviceBuffer(this, p, bytes);
  }

  absl::StatusOr<std::unique_ptr<Stream>> CreateStream(StreamPriority priority) override {
    return std::unique_ptr<Stream>(
        std::make_unique<CpuStream>(priority == StreamPriority::kLow));
  }
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    return std::unique_ptr<Event>(std::make_unique<CpuEvent>());
  }

  absl::Status RegisterHost(void* data, size_t bytes) override {
    if (data == nullptr || bytes == 0 || bytes > kMaxRegisterBytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "RegisterHost: need a non-null range of 1..%d bytes (got %d)", kMaxRegisterBytes,
          bytes));
    }
    // Host memory is already "device" memory here; what registration changes is that
    // copies into and out of the range no longer block (as pinned memory under CUDA).
    CountHostCall(HostCall::kAllocation);
    Track(data, bytes, Memory::kPinned);
    return absl::OkStatus();
  }
  absl::Status UnregisterHost(void* data) override {
    CountHostCall(HostCall::kFree);
    Untrack(data);
    return absl::OkStatus();
  }

  // CUDA's blocking rules for copies, modelled: memory this backend allocated or registered
  // is device or pinned memory and copies are asynchronous; any other host memory is
  // pageable, and a copy into it returns only once it has run (after everything enqueued
  // before it on the stream), a copy out of it reads the source before returning. Both are
  // counted as synchronous copies (kernels/host_calls.h).
  absl::Status Copy(Stream& s, void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return Submit(s, [] { return absl::OkStatus(); });
    const bool pageable_dst = !Known(dst, bytes);
    const bool pageable_src = !Known(src, bytes);
    if (!pageable_dst && !pageable_src) {
      return Submit(s, [dst, src, bytes] {
        std::memcpy(dst, src, bytes);
        return absl::OkStatus();
      });
    }
    auto* stream = dynamic_cast<CpuStream*>(&s);
    if (stream == nullptr) {
      return absl::InvalidArgumentError("cpu backend: stream was not created by a cpu backend");
    }
    if (stream->capturing()) {
      absl::Status st = absl::FailedPreconditionError(
          "Copy: a captured copy may not touch pageable host memory (register it)");
      stream->FailCapture(st);
      return st;
    }
    CountHostCall(HostCall::kSyncCopy);
    if (pageable_src && !pageable_dst) {
      // Staged now, as the CUDA driver stages pageable sources.
      auto staged = std::shared_ptr<uint8_t[]>(new uint8_t[bytes]);
      std::memcpy(staged.get(), src, bytes);
      stream->Enqueue([dst, staged, bytes] {
        std::memcpy(dst, staged.get(), bytes);
        return absl::OkStatus();
      });
      return absl::OkStatus();
    }
    // Into pageable memory: returns once the copy (and the work before it) has run.
    auto done = std::make_shared<CpuEvent>();
    const uint64_t seq = done->Arm();
    stream->Enqueue([dst, src, bytes] {
      std::memcpy(dst, src, bytes);
      return absl::OkStatus();
    });
    KVTIER_RETURN_IF_ERROR(stream->Record(*done));
    return done->WaitFor(seq);
  }

  bool SupportsCapture() const override { return true; }
  absl::Status BeginCapture(Stream& s) override {
    auto* stream = dynamic_cast<CpuStream*>(&s);
    if (stream == nullptr) {
      return absl::InvalidArgumentError("BeginCapture: stream was not created by a cpu backend");
    }
    return stream->BeginCapture();
  }
  absl::StatusOr<std::unique_ptr<Graph>> EndCapture(Stream& s) override {
    auto* stream = dynamic_cast<CpuStream*>(&s);
    if (stream == nullptr) {
      return absl::InvalidArgumentError("EndCapture: stream was not created by a cpu backend");
    }
    KVTIER_ASSIGN_OR_RETURN(auto tasks, stream->EndCapture());
    return std::unique_ptr<Graph>(std::make_unique<CpuGraph>(std::move(tasks)));
  }
  absl::Status Memset(Stream& s, void* dst, int value, size_t bytes) override {
    return Submit(s, [dst, value, bytes] {
      if (bytes > 0) std::memset(dst, value, bytes);
      return absl::OkStatus();
    });
  }

 protected:
  void Free(void* data) override {
    CountHostCall(HostCall::kFree);
    Untrack(data);
    std::free(data);
  }

  // Ops of a low-priority stream run on its (low-priority) worker and the low-priority
  // pool, so background work of a whole batch is parallel and still yields to the rest.
  ThreadPool* PoolFor(Stream& s) {
    auto* cs = dynamic_cast<CpuStream*>(&s);
    return cs != nullptr && cs->low_priority() ? &low_pool_ : &pool_;
  }

  absl::Status DoScorePages(Stream& s, const ScorePagesArgs& a) override {
    return Submit(s, [a, pool = PoolFor(s), isa = Isa()] { return CpuScorePages(a, pool, isa); });
  }
  absl::Status DoTopK(Stream& s, const TopKArgs& a) override {
    return Submit(s, [a, pool = PoolFor(s), isa = Isa()] { return CpuTopK(a, pool, isa); });
  }
  absl::Status DoQueryCosine(Stream& s, const QueryCosineArgs& a) override {
    return Submit(s, [a, pool = PoolFor(s)] { return CpuQueryCosine(a, pool); });
  }
  absl::Status DoSelectionLoss(Stream& s, const SelectionLossArgs& a) override {
    return Submit(s, [a, pool = PoolFor(s)] { return CpuSelectionLoss(a, pool); });
  }
  absl::Status DoRecall(Stream& s, const RecallArgs& a) override {
    return Submit(s, [a, pool = PoolFor(s)] { return CpuRecall(a, pool); });
  }
  absl::Status DoGatherSlabs(Stream& s, const GatherSlabsArgs& a) override {
    return Submit(s, [a, pool = PoolFor(s)] { return CpuGatherSlabs(a, pool); });
  }
  absl::Status DoScatterSlabs(Stream& s, const ScatterSlabsArgs& a) override {
    return Submit(s, [a, pool = PoolFor(s)] { return CpuScatterSlabs(a, pool); });
  }
  absl::Status DoReplace(Stream& s, const ReplaceArgs& a) override {
    return Submit(s, [a, pool = PoolFor(s)] { return CpuReplace(a, pool); });
  }
  absl::Status DoOffload(Stream& s, const OffloadArgs& a) override {
    return Submit(s, [a, pool = PoolFor(s)] { return CpuOffload(a, pool); });
  }
  absl::Status DoSparseAttention(Stream& s, const SparseAttentionArgs& a) override {
    return Submit(s, [a, pool = PoolFor(s), isa = Isa()] {
      return CpuSparseAttention(a, pool, isa);
    });
  }
  absl::Status DoDenseAttention(Stream& s, const DenseAttentionArgs& a) override {
    return Submit(s, [a, pool = PoolFor(s), isa = Isa()] {
      return CpuDenseAttention(a, pool, isa);
    });
  }
  absl::Status DoMoveHeadSlots(Stream& s, const MoveHeadSlotsArgs& a) override {
    return Submit(s, [a, pool = PoolFor(s)] { return CpuMoveHeadSlots(a, pool); });
  }

 private:
  enum class Memory : uint8_t { kDevice, kPinned };
  struct Range {
    size_t bytes;
    Memory kind;
  };
  void Track(const void* p, size_t bytes, Memory kind) {
    MutexLock lock(&mu_);
    ranges_[reinterpret_cast<uintptr_t>(p)] = Range{bytes, kind};
  }
  void Untrack(const void* p) {
    MutexLock lock(&mu_);
    ranges_.erase(reinterpret_cast<uintptr_t>(p));
  }
  // [p, p + bytes) lies in memory this backend allocated or registered.
  bool Known(const void* p, size_t bytes) const {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    MutexLock lock(&mu_);
    auto it = ranges_.upper_bound(a);
    if (it == ranges_.begin()) return false;
    --it;
    return a - it->first < it->second.bytes && bytes <= it->second.bytes - (a - it->first);
  }

  // Enqueues `task` on `s`, which must be a stream of this backend.
  static absl::Status Submit(Stream& s, std::function<absl::Status()> task) {
    auto* stream = dynamic_cast<CpuStream*>(&s);
    if (stream == nullptr) {
      return absl::InvalidArgumentError("cpu backend: stream was not created by a cpu backend");
    }
    stream->Enqueue(std::move(task));
    return absl::OkStatus();
  }

  // The instruction set of the per-ISA ops: the one asked for, else the process's.
  cpu::Isa Isa() const { return isa_.has_value() ? *isa_ : cpu::ActiveIsa(); }

  const std::optional<cpu::Isa> isa_;
  ThreadPool pool_;
  ThreadPool low_pool_;  // nice 19 workers for the ops of low-priority streams
  mutable Mutex mu_;
  std::map<uintptr_t, Range> ranges_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<Backend> NewCpuBackend(int num_threads) {
  return std::make_unique<CpuBackend>(num_threads, std::nullopt);
}

std::unique_ptr<Backend> NewCpuBackend(int num_threads, cpu::Isa isa) {
  return std::make_unique<CpuBackend>(num_threads, isa);
}

}  // namespace kvtier
