// The device an engine hands kvtier: memory, streams, events and copies (the public half of
// the backend split: the compute ops kvtier runs on a device are internal). kvtier does its
// device work only through a Device the caller passes in, never through a global one.
//
// Two kinds are built: cpu (always; host memory plays device memory, a stream is an ordered
// work queue on its own thread) and cuda (when the toolkit was found at build time; the
// engine's own CUDA context, so pointers kvtier returns are ordinary device pointers).
// Create one with CreateDevice. kvtier accepts only Devices it created: an engine does not
// implement this interface, it uses it.
//
// Semantics follow CUDA's so callers are written once:
//   - Every operation is enqueued on a Stream and runs after the work enqueued before it
//     there. Enqueueing validates its arguments and returns INVALID_ARGUMENT at once; an
//     error while running makes the stream's status sticky: Synchronize() and events
//     recorded afterwards report it, and a stream that waits on such an event takes it on.
//   - Event::Record captures all work enqueued so far on that stream; Stream::Wait makes
//     later work on another stream wait for it. Re-recording an event moves it forward.
//   - Pointers given to a Device are its memory (Allocate) or host memory registered with
//     RegisterHost; they must stay valid until the work that reads them has run.
//
// Thread-safety: a Device may be used from many threads. A Stream is used by one thread at
// a time; an Event may be waited on from any thread.
#ifndef KVTIER_DEVICE_H_
#define KVTIER_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvtier {

enum class DeviceKind : uint8_t { kAuto = 0, kCpu = 1, kCuda = 2 };
// "auto", "cpu", "cuda".
std::string_view DeviceKindName(DeviceKind kind);
bool ParseDeviceKind(std::string_view name, DeviceKind* out);

// Scheduling priority of a stream, as CUDA's stream priorities: work on a low-priority
// stream yields to normal work, so background recall does not slow attention down.
enum class StreamPriority : uint8_t { kNormal = 0, kLow = 1 };

class Device;

// One contiguous copy of a batch (Device::CopyBatch).
struct CopyRange {
  void* dst;
  const void* src;
  size_t bytes;
};

// Device memory, move-only; frees itself. The Device must outlive it. Made with a null
// device it is a view that frees nothing.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Device* device, void* data, size_t bytes)
      : device_(device), data_(data), bytes_(bytes) {}
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
  Device* device_ = nullptr;
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

class Device {
 public:
  Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  virtual ~Device() = default;

  virtual DeviceKind kind() const = 0;
  // One line for logs and benchmark reports: "cpu: 16 threads", "cuda: NVIDIA H100 ...".
  virtual std::string Describe() const = 0;

  // Device memory of `bytes`, 256-byte aligned. RESOURCE_EXHAUSTED when out of memory.
  virtual absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) = 0;
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() {
    return CreateStream(StreamPriority::kNormal);
  }
  virtual absl::StatusOr<std::unique_ptr<Stream>> CreateStream(StreamPriority priority) = 0;
  virtual absl::StatusOr<std::unique_ptr<Event>> CreateEvent() = 0;

  // Pins/registers host memory for DMA and zero-copy access (at most kMaxRegisterBytes a
  // call). The cpu device has nothing to do.
  static constexpr size_t kMaxRegisterBytes = size_t{64} << 30;
  virtual absl::Status RegisterHost(void* data, size_t bytes) = 0;
  virtual absl::Status UnregisterHost(void* data) = 0;

  // Copies between any device memory and host memory, ordered on `stream`. Like every
  // operation it runs later: a host `src` or `dst` must stay valid until the stream has run
  // it.
  virtual absl::Status Copy(Stream& stream, void* dst, const void* src, size_t bytes) = 0;
  virtual absl::Status Memset(Stream& stream, void* dst, int value, size_t bytes) = 0;
  // `n` independent copies (no range written by one is read or written by another), ordered
  // on `stream` as one operation: after the work enqueued before and before the work
  // enqueued after, in any order among themselves. The range list is read during the call.
  virtual absl::Status CopyBatch(Stream& stream, const CopyRange* ranges, size_t n);

  // The PCI bus id of the device ("0000:3b:00.0"), for NUMA-local host placement; empty
  // when it has none (cpu).
  virtual std::string PciBusId() const { return {}; }

 protected:
  friend class DeviceBuffer;
  virtual void Free(void* data) = 0;
};

struct DeviceOptions {
  int cpu_threads = 0;  // cpu device worker threads; 0 = hardware concurrency
  int cuda_device = 0;  // cuda device ordinal
};

// kCpu: always available. kCuda: UNIMPLEMENTED when built without CUDA, UNAVAILABLE when
// there is no usable device. kAuto: cuda if a device is usable, else cpu.
absl::StatusOr<std::unique_ptr<Device>> CreateDevice(DeviceKind kind,
                                                     const DeviceOptions& options = {});

// Number of usable CUDA devices: 0 when built without CUDA or when there is no driver or
// device (never an error).
int CudaDeviceCount();
// True when this build contains the CUDA device.
bool CudaBackendBuilt();

}  // namespace kvtier

#endif  // KVTIER_DEVICE_H_
