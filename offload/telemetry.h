// Retrieval telemetry: the counters a session's Retriever publishes for kvtierd's /metrics
// (docs/metrics.md#retrieval), with no RPC and no lock on the decode path.
//
// The block lives in the session region's header page (offload/session_region.h), so it is
// shared by whoever drives the session's Retriever (the engine's libkvtier for SHM sessions,
// the daemon itself for GRPC sessions) and the daemon, which reads it when it is scraped.
// The writer stores every word with a relaxed atomic store at the end of each layer-step
// (and at Flush, Wait, Close): a few dozen plain stores to a cache line it owns, nothing the
// step waits for. A reader loads each word atomically: it never sees a torn word, but a
// scrape that races a step may see some words one step ahead of others. Every word is a
// count or a gauge, so that is harmless.
//
// The block is written by a process the daemon does not trust: a reader takes the words as
// numbers about that session only, checks the magic and version, and never uses them to
// index or size anything.
//
// Thread-safe (every access is atomic); one writer per block.
#ifndef KVTIER_OFFLOAD_TELEMETRY_H_
#define KVTIER_OFFLOAD_TELEMETRY_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>

#include "kvtier/counters.h"

namespace kvtier {

// Layers are put in three classes by depth: the first, middle and last third of the model.
// Query drift, and so correction, differs by depth (EpiKV's observation about middle
// layers), and three classes keep the label's cardinality fixed whatever the model.
inline constexpr int kHeadClasses = 3;
inline constexpr std::array<const char*, kHeadClasses> kHeadClassNames = {"early", "middle",
                                                                         "late"};
// The class of `layer` in a model of `num_layers`. REQUIRES: 0 <= layer < num_layers.
inline int HeadClassOf(int32_t layer, int32_t num_layers) {
  return static_cast<int>(static_cast<int64_t>(layer) * kHeadClasses / num_layers);
}

// Upper bounds of the layer-step time histogram, seconds (the +Inf bucket follows).
inline constexpr std::array<double, 14> kLayerStepBucketsSeconds = {
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 1.0};
inline constexpr size_t kLayerStepBuckets = kLayerStepBucketsSeconds.size() + 1;

// The published values. Plain data; the block stores it word by word.
struct TelemetryValues {
  // A word for every counter of kvtier/counters.h, named as there.
#define KVTIER_TELEMETRY_WORD(name, kind, help) uint64_t name = 0;
  KVTIER_SEQUENCE_COUNTERS(KVTIER_TELEMETRY_WORD)
#undef KVTIER_TELEMETRY_WORD
  // (layer, page) pairs made visible in the region: written by AddCommitted alone (the host
  // tier's commits); Publish leaves the word as it is.
  uint64_t pages_committed = 0;
  // checked_heads and corrected_heads by the depth class of the layer.
  std::array<uint64_t, kHeadClasses> checked_heads_by_class{};
  std::array<uint64_t, kHeadClasses> corrected_heads_by_class{};
  uint64_t recall_strategy = 0;    // RecallStrategy + 1; 0: not yet known
  // Estimated mass recall (mass trigger only: 1 − the estimated relative loss of each checked
  // head's selection, 1 for a corrected head), in millionths, and how many heads it sums.
  uint64_t mass_recall_micros = 0;
  uint64_t mass_recall_count = 0;
  // Layer-step time, BeginStep to the end of EndStep: per-bucket (not cumulative) counts,
  // the sum in nanoseconds and the count.
  std::array<uint64_t, kLayerStepBuckets> step_buckets{};
  uint64_t step_nanos = 0;
  uint64_t step_count = 0;

  // Adds a layer-step of `seconds` to the histogram.
  void AddStepTime(double seconds);
  // The counters' words from `stats` (gauges too).
  void SetCounters(const SequenceStats& stats);
  // `base` + this, word by word (a reattached writer continues the counts it found; gauges,
  // the strategy and pages_committed are this one's).
  TelemetryValues ContinuedFrom(const TelemetryValues& base) const;
};

inline constexpr uint64_t kTelemetryMagic = 0x314d4c54'5654564bull;  // "KVTVTLM1"
inline constexpr size_t kTelemetryWords = 2 + sizeof(TelemetryValues) / sizeof(uint64_t);
inline constexpr size_t kTelemetryBytes = kTelemetryWords * sizeof(uint64_t);

// A view of a telemetry block: kTelemetryBytes of 8-byte aligned shared memory.
class TelemetryBlock {
 public:
  // REQUIRES: `words` is 8-byte aligned and holds kTelemetryBytes.
  explicit TelemetryBlock(void* words) : words_(static_cast<uint64_t*>(words)) {}

  // Writes the magic and zeros (the region's owner, when it formats the region).
  void Format();
  // The values, or nullopt when the magic is not there (never formatted, or overwritten).
  std::optional<TelemetryValues> Read() const;
  // Writer: publishes `v` (relaxed stores, word by word), all but pages_committed.
  void Publish(const TelemetryValues& v);
  // Writer: adds to pages_committed alone (the host tier's commits, between steps).
  void AddCommitted(uint64_t pages);

 private:
  uint64_t* words_;
};

}  // namespace kvtier

#endif  // KVTIER_OFFLOAD_TELEMETRY_H_
