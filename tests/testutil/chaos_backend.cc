#include "tests/testutil/chaos_backend.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>

#include "absl/strings/str_format.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/cpu_stream.h"
#include "kernels/cpu/thread_pool.h"
#include "core/status.h"

namespace kvtier::testing {
namespace {

constexpr size_t kAlignment = 256;  // bytes, as the CPU backend and cudaMalloc guarantee

// Shared by a backend and its streams' queued tasks, so a task that outlives a misused
// backend still has somewhere to count.
struct Counters {
  std::atomic<int64_t> tasks_run{0};
  std::atomic<int64_t> delay_ns{0};
};

// A CpuStream whose tasks each sleep a random delay first. The delay is drawn when the
// task is enqueued (on the feeding thread, which owns rng_) and slept on the worker.
class ChaosStream final : public Stream {
 public:
  ChaosStream(const ChaosOptions& options, uint64_t index, std::shared_ptr<Counters> counters)
      : max_delay_ns_(absl::ToInt64Nanoseconds(options.max_delay)),
        drop_waits_(options.drop_waits),
        rng_(options.seed ^ ((index + 1) * 0x9E3779B97F4A7C15ull)),
        counters_(std::move(counters)) {}

  absl::Status Record(Event& event) override {
    // A foreign event is rejected by inner_ before anything is enqueued.
    if (dynamic_cast<CpuEvent*>(&event) != nullptr) Enqueue([] { return absl::OkStatus(); });
    return inner_.Record(event);
  }
  absl::Status Wait(Event& event) override {
    if (drop_waits_) return absl::OkStatus();
    return inner_.Wait(event);
  }
  absl::Status Synchronize() override { return inner_.Synchronize(); }

  // Enqueues `task` behind a random delay; like CpuStream::Enqueue otherwise.
  void Enqueue(std::function<absl::Status()> task) {
    const absl::Duration delay = absl::Nanoseconds(
        max_delay_ns_ > 0 ? std::uniform_int_distribution<int64_t>(0, max_delay_ns_)(rng_) : 0);
    inner_.Enqueue([counters = counters_, delay, task = std::move(task)] {
      if (delay > absl::ZeroDuration()) absl::SleepFor(delay);
      counters->tasks_run.fetch_add(1, std::memory_order_relaxed);
      counters->delay_ns.fetch_add(absl::ToInt64Nanoseconds(delay), std::memory_order_relaxed);
      return task();
    });
  }

 private:
  const int64_t max_delay_ns_;
  const bool drop_waits_;
  std::mt19937_64 rng_;  // used by the feeding thread only
  std::shared_ptr<Counters> counters_;
  CpuStream inner_;  // last: its destructor drains the queue while the rest is alive
};

class ChaosBackend final : public Backend {
 public:
  explicit ChaosBackend(const ChaosOptions& options)
      : options_(options), counters_(std::make_shared<Counters>()), pool_(options.threads) {}

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  std::string Describe() const override {
    return absl::StrFormat("chaos cpu: %d threads, delays up to %s%s", pool_.num_threads(),
                           absl::FormatDuration(options_.max_delay),
                           options_.drop_waits ? ", waits dropped" : "");
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

  // Priorities are ignored: every stream's ops share the pool, as ordering is what this
  // backend tests.
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream(StreamPriority) override {
    return std::unique_ptr<Stream>(std::make_unique<ChaosStream>(
        options_, next_stream_.fetch_add(1, std::memory_order_relaxed), counters_));
  }
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    return std::unique_ptr<Event>(std::make_unique<CpuEvent>());
  }

  absl::Status RegisterHost(void* data, size_t bytes) override {
    if (data == nullptr || bytes == 0 || bytes > kMaxRegisterBytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "RegisterHost: need a non-null range of 1..%d bytes (got %d)", kMaxRegisterBytes, bytes));
    }
    return absl::OkStatus();
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

  absl::Status Stall(Stream& s, absl::Duration duration) {
    return Submit(s, [duration] {
      absl::SleepFor(duration);
      return absl::OkStatus();
    });
  }

  ChaosStats Stats() const {
    return ChaosStats{counters_->tasks_run.load(std::memory_order_relaxed),
                      absl::Nanoseconds(counters_->delay_ns.load(std::memory_order_relaxed))};
  }

 protected:
  void Free(void* data) override { std::free(data); }

  absl::Status DoScorePages(Stream& s, const ScorePagesArgs& a) override {
    return Submit(s, [this, a] { return CpuScorePages(a, &pool_); });
  }
  absl::Status DoTopK(Stream& s, const TopKArgs& a) override {
    return Submit(s, [this, a] { return CpuTopK(a, &pool_); });
  }
  absl::Status DoQueryCosine(Stream& s, const QueryCosineArgs& a) override {
    return Submit(s, [this, a] { return CpuQueryCosine(a, &pool_); });
  }
  absl::Status DoSelectionLoss(Stream& s, const SelectionLossArgs& a) override {
    return Submit(s, [this, a] { return CpuSelectionLoss(a, &pool_); });
  }
  absl::Status DoRecall(Stream& s, const RecallArgs& a) override {
    return Submit(s, [this, a] { return CpuRecall(a, &pool_); });
  }
  absl::Status DoGatherSlabs(Stream& s, const GatherSlabsArgs& a) override {
    return Submit(s, [this, a] { return CpuGatherSlabs(a, &pool_); });
  }
  absl::Status DoScatterSlabs(Stream& s, const ScatterSlabsArgs& a) override {
    return Submit(s, [this, a] { return CpuScatterSlabs(a, &pool_); });
  }
  absl::Status DoReplace(Stream& s, const ReplaceArgs& a) override {
    return Submit(s, [this, a] { return CpuReplace(a, &pool_); });
  }
  absl::Status DoOffload(Stream& s, const OffloadArgs& a) override {
    return Submit(s, [this, a] { return CpuOffload(a, &pool_); });
  }
  absl::Status DoSparseAttention(Stream& s, const SparseAttentionArgs& a) override {
    return Submit(s, [this, a] { return CpuSparseAttention(a, &pool_); });
  }
  absl::Status DoDenseAttention(Stream& s, const DenseAttentionArgs& a) override {
    return Submit(s, [this, a] { return CpuDenseAttention(a, &pool_); });
  }
  absl::Status DoMoveHeadSlots(Stream& s, const MoveHeadSlotsArgs& a) override {
    return Submit(s, [this, a] { return CpuMoveHeadSlots(a, &pool_); });
  }

 private:
  // Enqueues `task` on `s` behind a random delay; `s` must be a chaos stream.
  static absl::Status Submit(Stream& s, std::function<absl::Status()> task) {
    auto* stream = dynamic_cast<ChaosStream*>(&s);
    if (stream == nullptr) {
      return absl::InvalidArgumentError("chaos backend: stream was not created by a chaos backend");
    }
    stream->Enqueue(std::move(task));
    return absl::OkStatus();
  }

  const ChaosOptions options_;
  const std::shared_ptr<Counters> counters_;
  std::atomic<uint64_t> next_stream_{0};
  ThreadPool pool_;
};

}  // namespace

std::unique_ptr<Backend> NewChaosBackend(const ChaosOptions& options) {
  return std::make_unique<ChaosBackend>(options);
}

ChaosStats GetChaosStats(Backend& backend) {
  auto* chaos = dynamic_cast<ChaosBackend*>(&backend);
  KVTIER_CHECK(chaos != nullptr);
  return chaos->Stats();
}

absl::Status EnqueueStall(Backend& backend, Stream& stream, absl::Duration duration) {
  auto* chaos = dynamic_cast<ChaosBackend*>(&backend);
  if (chaos == nullptr) {
    return absl::InvalidArgumentError("EnqueueStall: not a chaos backend");
  }
  return chaos->Stall(stream, duration);
}

}  // namespace kvtier::testing
