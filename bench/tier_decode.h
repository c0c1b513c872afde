// `kvtier-bench tier`'s decode section: what demoting pages costs a decode step. Two
// Retrievers on the CPU backend are fed the same synthetic trace (bench/synthetic_kv.h, with
// queries that drift from step to step, so the selection churns): the baseline over a host
// tier that holds every page, the other with policy.host_drop = demote over a host tier of
// `host_pages` per layer with the cold tier (ColdTier over the benchmark's Redis Cluster)
// behind it. Each decode step appends a token to every layer and runs every layer's step;
// the two sequences' steps alternate which runs first. Reported: the prefill's time, the
// step time's p50 / p99 for both and their ratio, pages demoted, written and promoted per
// step, and the cold tier's share of the time; every step's attention output is compared
// bit for bit (a difference is a mismatch).
//
// The cold tier here is kvtierd's own page mover (daemon/page_mover.h) over a ColdStore of the
// bench's tenant, with a quota that never binds and no WAIT (the run's cluster has no
// replicas to wait for).
#ifndef KVTIER_BENCH_TIER_DECODE_H_
#define KVTIER_BENCH_TIER_DECODE_H_

#include <cstdint>
#include <ostream>
#include <string>

#include "absl/status/statusor.h"
#include "bench/report.h"
#include "daemon/cold_tier.h"
#include "daemon/redis_cluster.h"

namespace kvtier::bench {

struct TierDecodeOptions {
  int32_t layers = 4;
  int32_t prefill = 4096;     // tokens per layer before the first step
  int32_t steps = 64;
  int32_t host_pages = 48;    // per layer, of the demoting sequence's host tier
  int32_t budget_tokens = 512;  // sink 1/4, selected 1/2, recent 1/4
  float drift = 0.5f;         // each step's query: (1 − drift) · the planted one + drift · noise
};

struct TierDecodeResult {
  JsonObject report;
  int64_t mismatches = 0;  // steps whose outputs differ
};

// INVALID_ARGUMENT for options out of range, naming the flag (e.g. a host tier below the
// demote floor): CheckTierDecode says so without running anything.
absl::Status CheckTierDecode(const TierDecodeOptions& o);
// Runs the section: CheckTierDecode's errors, the Retrievers' and the cold tier's.
absl::StatusOr<TierDecodeResult> RunTierDecode(daemon::RedisCluster* cluster,
                                               daemon::ColdTier* cold, const std::string& prefix,
                                               const std::string& session,
                                               const TierDecodeOptions& o, std::ostream& log);

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_TIER_DECODE_H_
