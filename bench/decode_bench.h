// `kvtier-bench decode`: the decode-step benchmark, leveldb's db_bench shape. --workloads
// names what runs, in the order given, over one option set:
//
//   replay    the trace-driven evaluator of the retrieval modes: accuracy against full KV,
//             recall traffic, critical path and wall time per step (bench/decode_replay.h;
//             --connect runs it through kvtierd sessions, bench/decode_sessions.h)
//   step      per-layer decode step times at long context, per batch size: dense, resident,
//             speculative and sync (bench/decode_step.h)
//   policies  the drop-policy sweep: memory vs attention error against full KV per policy and
//             budget (bench/decode_policies.h)
//
// A flag given applies to every listed workload that reads it; a flag not given leaves each
// workload its own default (the sizes differ: policies replays 8K tokens, the others 32K).
// A flag that no listed workload reads is refused, as are flags a trace file makes
// meaningless. Each workload measures its baselines in its own run and reports its ratios in
// its section of one JSON object:
//   {"bench": "decode", "workloads": "replay,step", "commit": ..., "time": ...,
//    "replay": {...}, "step": {...}}
// Exit status: 0; 2 for options refused (also a backend this build or machine lacks); 1 for
// any other failure. The first workload that fails ends the run.
#ifndef KVTIER_BENCH_DECODE_BENCH_H_
#define KVTIER_BENCH_DECODE_BENCH_H_

#include "CLI/CLI.hpp"

namespace kvtier::bench {

// Registers the `decode` subcommand on `app`. When it is the one given on the command line,
// its callback runs the workloads during parsing and stores the exit status in *rc.
CLI::App* AddDecodeCommand(CLI::App& app, int* rc);

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_DECODE_BENCH_H_
