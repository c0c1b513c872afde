// BudgetedBackend. Invariant: every entry of buffers_ is a live allocation of the inner
// backend whose size is charged to the budget; Free erases the entry (the inner buffer frees
// itself) and releases the charge.
#include "kernels/budgeted_backend.h"

#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "core/mutex.h"
#include "core/status.h"

namespace kvtier {
namespace {

class BudgetedBackend final : public Backend {
 public:
  BudgetedBackend(Backend& inner, MemoryBudget& budget) : inner_(inner), budget_(budget) {}

  DeviceKind kind() const override { return inner_.kind(); }
  std::string Describe() const override { return inner_.Describe() + " (budgeted)"; }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    KVTIER_RETURN_IF_ERROR(budget_.Charge(bytes));
    absl::StatusOr<DeviceBuffer> buffer = inner_.Allocate(bytes);
    if (!buffer.ok()) {
      budget_.Release(bytes);
      return buffer.status();
    }
    void* data = buffer->data();
    {
      MutexLock lock(&mu_);
      buffers_.emplace(data, *std::move(buffer));
    }
    return DeviceBuffer(this, data, bytes);
  }
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream(StreamPriority priority) override {
    return inner_.CreateStream(priority);
  }
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override { return inner_.CreateEvent(); }
  absl::Status RegisterHost(void* data, size_t bytes) override {
    return inner_.RegisterHost(data, bytes);
  }
  absl::Status UnregisterHost(void* data) override { return inner_.UnregisterHost(data); }
  absl::Status Copy(Stream& s, void* dst, const void* src, size_t bytes) override {
    return inner_.Copy(s, dst, src, bytes);
  }
  absl::Status Memset(Stream& s, void* dst, int value, size_t bytes) override {
    return inner_.Memset(s, dst, value, bytes);
  }
  absl::Status CopyBatch(Stream& s, const CopyRange* ranges, size_t n) override {
    return inner_.CopyBatch(s, ranges, n);
  }
  std::string PciBusId() const override { return inner_.PciBusId(); }
  bool SupportsCapture() const override { return inner_.SupportsCapture(); }
  absl::Status BeginCapture(Stream& s) override { return inner_.BeginCapture(s); }
  absl::StatusOr<std::unique_ptr<Graph>> EndCapture(Stream& s) override {
    return inner_.EndCapture(s);
  }
  size_t SparseAttentionWorkspaceBytes(const SparseAttentionArgs& a) const override {
    return inner_.SparseAttentionWorkspaceBytes(a);
  }

 protected:
  void Free(void* data) override {
    DeviceBuffer inner;
    {
      MutexLock lock(&mu_);
      auto it = buffers_.find(data);
      if (it == buffers_.end()) return;
      inner = std::move(it->second);
      buffers_.erase(it);
    }
    const size_t bytes = inner.size();
    inner.Reset();
    budget_.Release(bytes);
  }

  // The ops: the inner backend validates (again) and enqueues.
  absl::Status DoScorePages(Stream& s, const ScorePagesArgs& a) override {
    return inner_.ScorePages(s, a);
  }
  absl::Status DoTopK(Stream& s, const TopKArgs& a) override { return inner_.TopK(s, a); }
  absl::Status DoQueryCosine(Stream& s, const QueryCosineArgs& a) override {
    return inner_.QueryCosine(s, a);
  }
  absl::Status DoSelectionLoss(Stream& s, const SelectionLossArgs& a) override {
    return inner_.SelectionLoss(s, a);
  }
  absl::Status DoRecall(Stream& s, const RecallArgs& a) override { return inner_.Recall(s, a); }
  absl::Status DoGatherSlabs(Stream& s, const GatherSlabsArgs& a) override {
    return inner_.GatherSlabs(s, a);
  }
  absl::Status DoScatterSlabs(Stream& s, const ScatterSlabsArgs& a) override {
    return inner_.ScatterSlabs(s, a);
  }
  absl::Status DoReplace(Stream& s, const ReplaceArgs& a) override { return inner_.Replace(s, a); }
  absl::Status DoOffload(Stream& s, const OffloadArgs& a) override { return inner_.Offload(s, a); }
  absl::Status DoSparseAttention(Stream& s, const SparseAttentionArgs& a) override {
    return inner_.SparseAttention(s, a);
  }
  absl::Status DoDenseAttention(Stream& s, const DenseAttentionArgs& a) override {
    return inner_.DenseAttention(s, a);
  }
  absl::Status DoMoveHeadSlots(Stream& s, const MoveHeadSlotsArgs& a) override {
    return inner_.MoveHeadSlots(s, a);
  }

 private:
  Backend& inner_;
  MemoryBudget& budget_;
  Mutex mu_;
  absl::flat_hash_map<void*, DeviceBuffer> buffers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<Backend> NewBudgetedBackend(Backend& inner, MemoryBudget& budget) {
  return std::make_unique<BudgetedBackend>(inner, budget);
}

}  // namespace kvtier
