// `kvtier-bench roofline`: the CPU backend's hot ops against the machine's memory bandwidth,
// all measured in one run. Decode attention reads every byte of its KV once and does little
// arithmetic per byte, so its ceiling is the read bandwidth of DRAM; the report says how
// close each op comes to it.
//
//   read bandwidth  a vectorised read (sum) over a DRAM-sized buffer (default 8 × the last-
//                   level cache, at least 256 MiB and at most 1 GiB), on --threads threads and
//                   on 1; the median of --bw-reps passes. The denominator of every fraction.
//   dense           CpuDenseAttention over contiguous NHD K/V of each --contexts size.
//   sparse          CpuSparseAttention over a working set of --working-set-fraction of the
//                   context (default 1/8), every slot full, each KV head's slot table its own
//                   random choice of pages, no partial page.
//   selection       CpuScorePages + CpuTopK (k = the working set's pages) at each
//                   --selection-contexts size, and the time ratio per doubling of the
//                   context; TopK alone, too.
//
// Each op runs with the old kernels (cpu::Isa::kScalar, the reference loops) and the new ones
// (cpu::ActiveIsa(), or --isa), interleaved rep by rep on the same inputs and thread pool.
// Effective GB/s = the bytes the op must read (K+V for attention, the summaries for
// ScorePages and selection, the pooled scores for TopK) / its median time.
//
// Cold and warm are measured and named separately:
//   cold  the op's inputs are not in cache: it rotates over copies of them whose total is at
//         least --cold-factor × the last-level cache, so every byte is read again only after
//         that much other data (an input of that size or more is one copy: cold by
//         construction, and never replicated). Where the copies would exceed --max-copies-mib,
//         as many as fit rotate and a --cold-factor × LLC buffer is streamed through the
//         cache before each timed call, outside the timer.
//   warm  the same buffers every call: only meaningful where the inputs are smaller than the
//         last-level cache; rows whose inputs are not are marked "exceeds LLC: same as cold".
//
// Targets (printed with met/missed, never asserted): cold dense ≥ 0.6 and cold sparse ≥ 0.5
// of the read bandwidth, dense new ≥ 3 × old at 32K (cold), selection time per doubling of the
// context ≤ 2.2 (cold, new kernels).
#ifndef KVTIER_BENCH_ROOFLINE_BENCH_H_
#define KVTIER_BENCH_ROOFLINE_BENCH_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "bench/report.h"
#include "kernels/cpu/isa.h"
#include "kvtier/geometry.h"

namespace kvtier {
class ThreadPool;
}  // namespace kvtier

namespace kvtier::bench {

struct RooflineBenchOptions {
  // Hq 32, Hkv 8, d 128, fp16 (Llama 3.1 8B), pages of 16 tokens; one sequence.
  Geometry geometry = [] {
    Geometry g = Llama31_8B();
    g.page_size = 16;
    return g;
  }();
  std::vector<int32_t> contexts = {32768, 131072};                  // dense and sparse
  std::vector<int32_t> selection_contexts = {8192, 32768, 131072};  // ScorePages + TopK
  double working_set_fraction = 0.125;  // sparse working set and TopK's k, of the context
  int threads = 0;                      // 0 = std::thread::hardware_concurrency()
  int32_t reps = 11;                    // timed calls per op, kernel and cold/warm
  int32_t bw_reps = 11;                 // read-bandwidth passes
  int64_t bw_bytes = 0;                 // read-bandwidth buffer; 0 = 8 × LLC in [256 MiB, 1 GiB]
  int64_t llc_bytes = 0;                // last-level cache; 0 = detect (LastLevelCache)
  double cold_factor = 2.0;             // cold: reuse distance ≥ this × LLC
  int64_t max_copies_bytes = int64_t{1} << 30;  // cold copies of one op at most; then evict
  std::optional<cpu::Isa> isa;          // the new kernels' ISA; unset = cpu::ActiveIsa()
  cpu::Isa old_isa = cpu::Isa::kScalar;  // the old kernels
  bool old = true;                      // time the old kernels too
  bool warm = true;                     // time the warm variants too
  uint64_t seed = 1;
};

// The last-level cache: its size in bytes and where it was read ("sysfs index3" or
// "sysconf"); 32 MiB and "assumed" when neither says.
struct CacheInfo {
  int64_t bytes = 0;
  std::string source;
};
CacheInfo LastLevelCache();

// Reads `bytes` at `p` (vectorised where the CPU allows) and returns a checksum of it, so the
// reads cannot be optimised away: the loop of the read-bandwidth measurement and of cache
// eviction.
uint64_t ReadSum(const void* p, size_t bytes);

// ReadSum over `bytes` at `p` on every thread of `pool`, eight parts per thread taken
// dynamically (so a late-waking worker leaves no thread with two shares).
uint64_t ParallelReadSum(ThreadPool& pool, const void* p, size_t bytes);

// Runs the benchmark, writing a human-readable report to `log`; returns the JSON report.
// INVALID_ARGUMENT for inconsistent options; RESOURCE_EXHAUSTED when the run would need more
// host memory than is available.
absl::StatusOr<JsonObject> RunRooflineBench(const RooflineBenchOptions& o, std::ostream& log);

// Registers the `roofline` subcommand on `app`. When it is the one given on the command
// line, its callback runs the benchmark during parsing and stores the exit status in *rc.
CLI::App* AddRooflineCommand(CLI::App& app, int* rc);

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_ROOFLINE_BENCH_H_
