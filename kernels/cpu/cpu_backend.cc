#include "kernels/cpu/cpu_backend.h"

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_format.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/cpu_stream.h"
#include "kernels/cpu/thread_pool.h"

namespace kvtier {
namespace {

constexpr size_t kAlignment = 256;  // bytes, as cudaMalloc guarantees

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int num_threads) : pool_(num_threads) {}

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  std::string Describe() const override {
    return absl::StrFormat("cpu: %d threads", pool_.num_threads());
  }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    if (bytes == 0) return absl::InvalidArgumentError("Allocate: bytes must be > 0");
    const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    void* p = std::aligned_alloc(kAlignment, rounded);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("Allocate: out of host memory allocating %d bytes", bytes));
    }
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
    return absl::OkStatus();  // host memory is already "device" memory here
  }
  absl::Status UnregisterHost(void*) override { return absl::OkStatus(); }

  absl::Status Copy(Stream& s, void* dst, const void* src, size_t bytes) override {
    return Submit(s, [dst, src, bytes] {
      if (bytes > 0) std::memcpy(dst, src, bytes);
      return absl::OkStatus();
    });
  }
  absl::Status Memset(Stream& s, void* dst, int value, size_t bytes) override {
    return Submit(s, [dst, value, bytes] {
      if (bytes > 0) std::memset(dst, value, bytes);
      return absl::OkStatus();
    });
  }

 protected:
  void Free(void* data) override { std::free(data); }

  // Ops of a low-priority stream run on its own (low-priority) worker alone.
  ThreadPool* PoolFor(Stream& s) {
    auto* cs = dynamic_cast<CpuStream*>(&s);
    return cs != nullptr && cs->low_priority() ? nullptr : &pool_;
  }

  absl::Status DoScorePages(Stream& s, const ScorePagesArgs& a) override {
    return Submit(s, [a, pool = PoolFor(s)] { return CpuScorePages(a, pool); });
  }
  absl::Status DoTopK(Stream& s, const TopKArgs& a) override {
    return Submit(s, [a, pool = PoolFor(s)] { return CpuTopK(a, pool); });
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
    return Submit(s, [a, pool = PoolFor(s)] { return CpuSparseAttention(a, pool); });
  }
  absl::Status DoDenseAttention(Stream& s, const DenseAttentionArgs& a) override {
    return Submit(s, [a, pool = PoolFor(s)] { return CpuDenseAttention(a, pool); });
  }
  absl::Status DoQuantizeSlots(Stream& s, const QuantizeSlotsArgs& a) override {
    return Submit(s, [a, pool = PoolFor(s)] { return CpuQuantizeSlots(a, pool); });
  }
  absl::Status DoMoveHeadSlots(Stream& s, const MoveHeadSlotsArgs& a) override {
    return Submit(s, [a, pool = PoolFor(s)] { return CpuMoveHeadSlots(a, pool); });
  }

 private:
  // Enqueues `task` on `s`, which must be a stream of this backend.
  static absl::Status Submit(Stream& s, std::function<absl::Status()> task) {
    auto* stream = dynamic_cast<CpuStream*>(&s);
    if (stream == nullptr) {
      return absl::InvalidArgumentError("cpu backend: stream was not created by a cpu backend");
    }
    stream->Enqueue(std::move(task));
    return absl::OkStatus();
  }

  ThreadPool pool_;
};

}  // namespace

std::unique_ptr<Backend> NewCpuBackend(int num_threads) {
  return std::make_unique<CpuBackend>(num_threads);
}

}  // namespace kvtier
