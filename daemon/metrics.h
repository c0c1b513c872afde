// Metrics: the pieces of kvtierd's /metrics (docs/metrics.md) — the Prometheus text
// exposition format (version 0.0.4) written family by family, and the counters the daemon
// keeps between scrapes (RPCs by method and code with their latency histograms, counts by
// label values). Everything that already has a home (tenants, sessions, their telemetry
// blocks) is read at scrape time instead of being counted twice.
//
// Exposition is thread-compatible; Counters and RpcMetrics are thread-safe.
#ifndef KVTIER_DAEMON_METRICS_H_
#define KVTIER_DAEMON_METRICS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <iterator>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "core/mutex.h"

namespace kvtier::daemon {

struct Label {
  std::string_view name;
  std::string_view value;
};

// One scrape's text. Every sample of a family must be written between its Family() and
// the next Family() (the format wants a family's lines together).
class Exposition {
 public:
  // `type`: "counter", "gauge", "histogram", "summary" or "untyped". REQUIRES: a valid metric
  // name ([a-zA-Z_:][a-zA-Z0-9_:]*), not written before.
  void Family(std::string_view name, std::string_view type, std::string_view help);
  // One sample of the current family: `name` is the family's, or it plus a suffix
  // (_bucket, _sum, _count). Label values are escaped (EscapeLabelValue); integers print
  // exactly.
  void Sample(std::string_view name, std::span<const Label> labels, double value);
  void Sample(std::string_view name, std::initializer_list<Label> labels, double value) {
    Sample(name, std::span<const Label>(labels.begin(), labels.size()), value);
  }
  // The samples of one histogram series: `bounds` the finite upper bounds (ascending),
  // `per_bucket` the count that fell in each bucket, the +Inf one last (bounds.size() + 1
  // entries, not cumulative: written cumulatively), `sum` in the family's unit.
  void Histogram(std::string_view family, std::span<const Label> labels,
                 std::span<const double> bounds, std::span<const uint64_t> per_bucket, double sum);

  const std::string& text() const { return text_; }
  std::string Take() { return std::move(text_); }

 private:
  void Line(std::string_view name, std::span<const Label> labels, std::string_view le,
            double value);
  std::string text_;
};

// A value as the format spells it: integers exactly, +Inf, -Inf, NaN, else shortest round
// trip.
std::string FormatMetricValue(double v);
// A label value as the text format wants it, whatever bytes `v` holds: \, " and newline
// escaped, and each byte that is not part of well-formed UTF-8 replaced by U+FFFD (a value
// that is not UTF-8 fails the parse of the whole scrape). HELP text gets the same, but for ".
std::string EscapeLabelValue(std::string_view v);

// Counts keyed by a tuple of label values (the family's label names are the writer's).
class Counters {
 public:
  void Add(std::vector<std::string> key, uint64_t n = 1) ABSL_LOCKS_EXCLUDED(mu_);
  std::map<std::vector<std::string>, uint64_t> Snapshot() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable Mutex mu_;
  std::map<std::vector<std::string>, uint64_t> counts_ ABSL_GUARDED_BY(mu_);
};

// Upper bounds of the RPC latency histogram, seconds.
inline constexpr double kRpcBucketsSeconds[] = {1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
                                                2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};

// The `method` label value of every call to a path the daemon does not serve.
inline constexpr char kUnknownMethod[] = "unknown";

// RPCs by method and code, with a latency histogram per method, and the calls in flight.
class RpcMetrics {
 public:
  void Begin() { in_flight_.fetch_add(1, std::memory_order_relaxed); }
  // One finished call: `method` as gRPC names it ("/kvtier.v1.KvTier/Step") or kUnknownMethod,
  // `code` the canonical code's name ("OK", "NOT_FOUND"), its wall time. Each method gets
  // series of its own, kept for good: REQUIRES `method` to be one of a fixed set, never a
  // path a caller chose (the interceptor in daemon.cc maps those to kUnknownMethod).
  void End(std::string_view method, std::string_view code, double seconds)
      ABSL_LOCKS_EXCLUDED(mu_);
  // kvtier_rpcs_total, kvtier_rpc_duration_seconds, kvtier_rpcs_in_flight.
  void Write(Exposition& out) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Method {
    std::map<std::string, uint64_t, std::less<>> codes;
    std::vector<uint64_t> buckets = std::vector<uint64_t>(std::size(kRpcBucketsSeconds) + 1);
    double sum = 0;
  };
  std::atomic<int64_t> in_flight_{0};
  mutable Mutex mu_;
  std::map<std::string, Method, std::less<>> methods_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_METRICS_H_
