// `kvtier-bench ops`: the op table's speed mode (ggml's test-backend-ops `perf`). The cases of
// tests/kernels/op_cases.h — the op table and its perf cases, too big for a unit test —
// whose names match --ops (by default the decode-size ones, `<Op>_decode_<size>`: one decode
// step of a Llama-3.1-8B layer) are each made once and timed on every backend asked for, over
// the same inputs:
//
//   cpu-scalar  the CPU backend with the scalar reference kernels (the same-run baseline of
//               every ratio: the ops with kernels per instruction set run the reference loops)
//   cpu         the CPU backend as production runs it (cpu::ActiveIsa(), capped by
//               KVTIER_CPU_ISA)
//   cuda        the CUDA backend, when a device is usable (skipped, and said so, otherwise)
//
// A rep is: (with --cold, a flush of the caches outside the timer: a read of --flush-mib on
// the host, on the cpu backends' threads, for the cpu backends; a device memset of as much
// for cuda) → enqueue the case's op(s) → synchronise the stream; the host wall time of the
// last two is the sample, so a GPU row includes one launch and one synchronisation. After
// --warmup untimed reps, --reps timed ones give the median and the 10th–90th percentiles.
// Each row reports GB/s from the bytes the case states it must move, GFLOP/s where it states
// its arithmetic, the fraction of the backend's own device-to-device copy bandwidth, for the
// cpu backends the fraction of the host's read bandwidth (a read of --flush-mib on their
// threads, measured at the start and the end of the run: the ceiling of an op that reads its
// bytes once), and the speed-up over the first backend.
//
// Figures over several rows follow the table (and are in the JSON's "derived"), each with
// its target where the project states one — printed met or missed, judged only cold:
//   - a decode step at 32K and 128K tokens: dense attention over the context against sparse
//     attention over a working set of 2,048 tokens (16 sink + 32 selected + 16 recent pages)
//     and against the whole sparse step (ScorePages + TopK + Recall of 256 head-pages + the
//     sparse attention); target: sparse attention ≥ 10 × faster than dense on the cpu backend;
//   - the roofline set (pages of 16, a working set and top-k of 1/8 of the context): dense
//     attention ≥ 0.6 and sparse ≥ 0.5 of the read bandwidth, dense at 32K ≥ 3 × the scalar
//     kernels, selection (ScorePages + TopK) time per doubling of the context ≤ 2.2.
#ifndef KVTIER_BENCH_OPS_BENCH_H_
#define KVTIER_BENCH_OPS_BENCH_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "bench/report.h"

namespace kvtier::bench {

struct OpsBenchOptions {
  std::string ops = "_decode_";  // ECMAScript regex searched in each case's name
  std::vector<std::string> backends = {"cpu-scalar", "cpu", "cuda"};
  int32_t reps = 20;
  int32_t warmup = 2;
  int32_t threads = 0;  // of the cpu backends; 0 = all
  bool cold = false;
  int32_t flush_mib = 256;  // the cold flush, and the copy-bandwidth buffer
};

// Runs the benchmark; the human report goes to `log`. INVALID_ARGUMENT for bad options
// (naming the flag), a regex that matches no case, or an unknown backend.
absl::StatusOr<JsonObject> RunOpsBench(const OpsBenchOptions& o, std::ostream& log);

// The `ops` subcommand; *rc is its exit status once it ran (2 for options refused).
CLI::App* AddOpsCommand(CLI::App& app, int* rc);

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_OPS_BENCH_H_
