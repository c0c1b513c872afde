// The backend interface: the one narrow door through which kvtier does device work
// (docs/architecture.md#backends). Two implementations: cpu (always built; host memory plays device
// memory, a stream is an ordered work queue on its own thread) and cuda (built when the
// toolkit is found; a stub returning UNIMPLEMENTED otherwise). Pick one with CreateBackend
// in kernels/registry.h; pass it in, never reach for a global.
//
// Semantics follow CUDA's so callers are written once:
//   - Every op is enqueued on a Stream and runs after the work enqueued before it there.
//     Enqueueing validates shapes and returns INVALID_ARGUMENT at once; an error while
//     running (a device index out of range, a CUDA fault) makes the stream's status sticky:
//     Synchronize() and events recorded afterwards report it, and a stream that waits on
//     such an event takes the error on. (The cpu backend also skips later work on a failed
//     stream; the cuda backend still runs it, so treat a failed stream's outputs as garbage.)
//   - Event::Record captures all work enqueued so far on that stream; Stream::Wait makes
//     later work on another stream wait for it. Re-recording an event moves it forward.
//   - Pointers in op arguments are backend memory (Allocate) or host memory registered
//     with RegisterHost; they must stay valid until the op has run.
//
// Thread-safety: a Backend may be used from many threads. A Stream is used by one thread
// at a time; an Event may be waited on from any thread.
#ifndef KVTIER_KERNELS_BACKEND_H_
#define KVTIER_KERNELS_BACKEND_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/ops.h"

namespace kvtier {

enum class BackendKind : uint8_t { kAuto = 0, kCpu = 1, kCuda = 2 };

// Scheduling priority of a stream, as CUDA's stream priorities: work on a low-priority
// stream yields to normal work, so background recall does not slow attention down. The cpu
// backend runs a low-priority stream's ops on its own worker thread at the lowest OS
// priority instead of on the shared thread pool; the cuda backend uses the device's lowest
// stream priority.
enum class StreamPriority : uint8_t { kNormal = 0, kLow = 1 };

class Backend;

// One contiguous copy of a batch (Backend::CopyBatch).
struct CopyRange {
  void* dst;
  const void* src;
  size_t bytes;
};

// Backend memory, move-only; frees itself. The Backend must outlive it.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Backend* backend, void* data, size_t bytes)
      : backend_(backend), data_(data), bytes_(bytes) {}
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Reset(); }

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t size() const { return bytes_; }  // bytes
  void Reset();

 private:
  Backend* backend_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

class Event {
 public:
  virtual ~Event() = default;
  // True when the work captured by the latest Record has run (or it was never recorded).
  virtual bool Query() = 0;
  // Blocks until the captured work has run. Returns the error of that work if any, or
  // DEADLINE_EXCEEDED once `timeout` has passed first.
  virtual absl::Status Wait(absl::Duration timeout = absl::InfiniteDuration()) = 0;
};

class Stream {
 public:
  virtual ~Stream() = default;
  // Captures the work enqueued so far on this stream in `event`.
  virtual absl::Status Record(Event& event) = 0;
  // Work enqueued on this stream after this call waits until `event` completes.
  virtual absl::Status Wait(Event& event) = 0;
  // Blocks until all enqueued work has run; returns the stream's sticky error, if any.
  virtual absl::Status Synchronize() = 0;
};

class Backend {
 public:
  Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;
  virtual ~Backend() = default;

  virtual BackendKind kind() const = 0;
  // One line for logs and benchmark reports: "cpu: 16 threads", "cuda: NVIDIA H100 ...".
  virtual std::string Describe() const = 0;

  // Backend memory of `bytes`, 256-byte aligned. RESOURCE_EXHAUSTED when out of memory.
  virtual absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) = 0;
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() {
    return CreateStream(StreamPriority::kNormal);
  }
  virtual absl::StatusOr<std::unique_ptr<Stream>> CreateStream(StreamPriority priority) = 0;
  virtual absl::StatusOr<std::unique_ptr<Event>> CreateEvent() = 0;

  // Pins/registers host memory for DMA and zero-copy access (at most kMaxRegisterBytes a
  // call: HostArena splits larger ranges). The cpu backend has nothing to do.
  static constexpr size_t kMaxRegisterBytes = size_t{64} << 30;
  virtual absl::Status RegisterHost(void* data, size_t bytes) = 0;
  virtual absl::Status UnregisterHost(void* data) = 0;

  // Copies between any backend memory and host memory, ordered on `stream`. Like every
  // op, it runs later: a host `src` or `dst` must stay valid until the stream has run it.
  virtual absl::Status Copy(Stream& stream, void* dst, const void* src, size_t bytes) = 0;
  virtual absl::Status Memset(Stream& stream, void* dst, int value, size_t bytes) = 0;
  // `n` independent copies (no range written by one is read or written by another), ordered
  // on `stream` as one op: they run after the work enqueued before and before the work
  // enqueued after, in any order among themselves. The range list is read during the call.
  // The cuda backend issues one cudaMemcpyBatchAsync where the runtime has it (one
  // cudaMemcpyAsync per range otherwise); this default issues one Copy per range.
  virtual absl::Status CopyBatch(Stream& stream, const CopyRange* ranges, size_t n);

  // The PCI bus id of the device ("0000:3b:00.0"), for NUMA-local host placement
  // (offload/numa_topology.h); empty when the backend has none (cpu).
  virtual std::string PciBusId() const { return {}; }

  // The compute ops (kernels/ops.h). Each validates shapes, then enqueues.
  absl::Status ScorePages(Stream& s, const ScorePagesArgs& a);
  absl::Status TopK(Stream& s, const TopKArgs& a);
  absl::Status QueryCosine(Stream& s, const QueryCosineArgs& a);
  absl::Status Recall(Stream& s, const RecallArgs& a);
  absl::Status GatherSlabs(Stream& s, const GatherSlabsArgs& a);
  absl::Status ScatterSlabs(Stream& s, const ScatterSlabsArgs& a);
  absl::Status Replace(Stream& s, const ReplaceArgs& a);
  absl::Status Offload(Stream& s, const OffloadArgs& a);
  absl::Status SparseAttention(Stream& s, const SparseAttentionArgs& a);
  absl::Status DenseAttention(Stream& s, const DenseAttentionArgs& a);
  absl::Status QuantizeSlots(Stream& s, const QuantizeSlotsArgs& a);
  absl::Status MoveHeadSlots(Stream& s, const MoveHeadSlotsArgs& a);

 protected:
  friend class DeviceBuffer;
  virtual void Free(void* data) = 0;

  virtual absl::Status DoScorePages(Stream& s, const ScorePagesArgs& a) = 0;
  virtual absl::Status DoTopK(Stream& s, const TopKArgs& a) = 0;
  virtual absl::Status DoQueryCosine(Stream& s, const QueryCosineArgs& a) = 0;
  virtual absl::Status DoRecall(Stream& s, const RecallArgs& a) = 0;
  virtual absl::Status DoGatherSlabs(Stream& s, const GatherSlabsArgs& a) = 0;
  virtual absl::Status DoScatterSlabs(Stream& s, const ScatterSlabsArgs& a) = 0;
  virtual absl::Status DoReplace(Stream& s, const ReplaceArgs& a) = 0;
  virtual absl::Status DoOffload(Stream& s, const OffloadArgs& a) = 0;
  virtual absl::Status DoSparseAttention(Stream& s, const SparseAttentionArgs& a) = 0;
  virtual absl::Status DoDenseAttention(Stream& s, const DenseAttentionArgs& a) = 0;
  virtual absl::Status DoQuantizeSlots(Stream& s, const QuantizeSlotsArgs& a) = 0;
  virtual absl::Status DoMoveHeadSlots(Stream& s, const MoveHeadSlotsArgs& a) = 0;
};

}  // namespace kvtier

#endif  // KVTIER_KERNELS_BACKEND_H_
