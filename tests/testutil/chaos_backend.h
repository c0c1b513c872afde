// A test-only backend that proves code orders its device work by events alone. It is the
// CPU backend (same memory, same ops via kernels/cpu/cpu_ops.h, same validation and sticky
// errors) except that every task — op, copy, memset, event record — first sleeps a random
// time on its stream's worker, so work on different streams interleaves differently from
// run to run. Code that is correct only because the plain CPU backend happens to run a
// short task first fails here. With `drop_waits` it is deliberately broken: Stream::Wait
// does nothing, which a test of the ordering must catch.
//
// Thread-safety: as kernels/backend.h. Streams are fed from one thread at a time; each
// stream draws its delays from its own generator, so a run is reproducible up to the OS's
// thread scheduling.
#ifndef KVTIER_TESTS_TESTUTIL_CHAOS_BACKEND_H_
#define KVTIER_TESTS_TESTUTIL_CHAOS_BACKEND_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kernels/backend.h"

namespace kvtier::testing {

struct ChaosOptions {
  uint64_t seed = 1;  // stream n draws its delays from a generator seeded by (seed, n)
  // Every task sleeps a uniform random time in [0, max_delay] before it runs.
  absl::Duration max_delay = absl::Microseconds(300);
  bool drop_waits = false;  // Stream::Wait is silently ignored (a broken backend)
  int threads = 2;          // op parallelism; ≤ 0 means hardware_concurrency()
};

struct ChaosStats {
  int64_t tasks_run = 0;  // tasks that ran; those skipped on a failed stream are not counted
  // The sum of their random delays (EnqueueStall's durations not included).
  absl::Duration injected_delay = absl::ZeroDuration();
};

std::unique_ptr<Backend> NewChaosBackend(const ChaosOptions& options);

// Counts so far. REQUIRES: `backend` came from NewChaosBackend.
ChaosStats GetChaosStats(Backend& backend);

// Enqueues on `stream` a task that sleeps exactly `duration` (after its random delay): a
// slow kernel, to make a race certain rather than likely. INVALID_ARGUMENT when `backend`
// or `stream` is not a chaos backend's.
absl::Status EnqueueStall(Backend& backend, Stream& stream, absl::Duration duration);

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_TESTUTIL_CHAOS_BACKEND_H_
