// Host memory for the benchmarks: the last-level cache's size, and a read of every byte of a
// buffer (vectorised where the CPU allows) on one thread or a pool's, whose time is the read
// bandwidth the op rows of `kvtier-bench ops` are held to and whose traffic evicts the caches
// before a cold rep.
#ifndef KVTIER_BENCH_HOST_MEMORY_H_
#define KVTIER_BENCH_HOST_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace kvtier {
class ThreadPool;
}  // namespace kvtier

namespace kvtier::bench {

// The last-level cache: its size in bytes and where it was read ("sysfs, L3" or
// "sysconf, L3"); 32 MiB and "assumed" when neither says.
struct CacheInfo {
  int64_t bytes = 0;
  std::string source;
};
CacheInfo LastLevelCache();

// Reads `bytes` at `p` and returns a checksum of it, so the reads cannot be optimised away.
uint64_t ReadSum(const void* p, size_t bytes);

// ReadSum over `bytes` at `p` on every thread of `pool`, eight parts per thread taken
// dynamically (so a late-waking worker leaves no thread with two shares).
uint64_t ParallelReadSum(ThreadPool& pool, const void* p, size_t bytes);

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_HOST_MEMORY_H_
