// Blocking host calls, counted (docs/retriever.md#host-waits). A decode step overlaps
// selection and recall with the engine's kernels only if the host never waits for the
// device inside it, so every backend counts the calls it serves that can block the calling
// thread on the device: event waits and stream synchronisations, copies that are
// synchronous for the host (into or out of pageable host memory), and device allocations,
// frees and host registrations (cudaMalloc/cudaFree/cudaHostRegister may synchronise the
// whole device). A call is counted when it is made, whether or not it found the device
// busy, so the counts are deterministic.
//
// Counts are per thread: the Retriever reads its own thread's counts before and after its
// calls, so sequences driven from other threads never show up in its step.
#ifndef KVTIER_KERNELS_HOST_CALLS_H_
#define KVTIER_KERNELS_HOST_CALLS_H_

#include <cstdint>

namespace kvtier {

enum class HostCall : uint8_t {
  kWait,        // Event::Wait, Stream::Synchronize
  kSyncCopy,    // a copy into or out of pageable host memory
  kAllocation,  // device or pinned host allocation, host registration
  kFree,        // their release
};

struct HostCalls {
  int64_t waits = 0;
  int64_t sync_copies = 0;
  int64_t allocations = 0;
  int64_t frees = 0;

  int64_t total() const { return waits + sync_copies + allocations + frees; }
  HostCalls& operator+=(const HostCalls& o) {
    waits += o.waits;
    sync_copies += o.sync_copies;
    allocations += o.allocations;
    frees += o.frees;
    return *this;
  }
  friend HostCalls operator-(HostCalls a, const HostCalls& b) {
    a.waits -= b.waits;
    a.sync_copies -= b.sync_copies;
    a.allocations -= b.allocations;
    a.frees -= b.frees;
    return a;
  }
};

// The blocking calls this thread has made into any backend so far.
HostCalls ThreadHostCalls();
// Backends call this once per blocking call they serve, on the calling thread.
void CountHostCall(HostCall kind);

}  // namespace kvtier

#endif  // KVTIER_KERNELS_HOST_CALLS_H_
