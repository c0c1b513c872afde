// The counters of a sequence, each defined once, here (leveldb's GetProperty is the model).
// Everything that reports them is produced from this list: the fields of SequenceStats
// (kvtier/sequence.h), the words of the telemetry block a session publishes in shared
// memory, the families of kvtierd's /metrics (kvtier_retrieval_<name>_total for a counter,
// kvtier_retrieval_<name> for a gauge), the `counters` map of the protocol's SessionStats,
// and `kvtierctl stats`. Adding a counter is one line below (and the code that counts it).
//
// Every value is an int64 that only grows (kCounter) or a value now (kGauge). A head-page is
// one KV head's K+V of one page.
#ifndef KVTIER_COUNTERS_H_
#define KVTIER_COUNTERS_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

namespace kvtier {

enum class CounterKind : uint8_t { kCounter = 0, kGauge = 1 };

// X(name, kind, help): the name is the field, the wire key and the metric's stem.
#define KVTIER_SEQUENCE_COUNTERS(X)                                                           \
  X(steps, kCounter, "Layer-steps begun (BeginStep calls).")                                  \
  X(appended_tokens, kCounter, "Tokens appended, per layer, summed over layers.")             \
  X(offloaded_pages, kCounter, "(layer, page) pairs written to the host tier.")              \
  X(recalled_pages, kCounter,                                                                  \
    "Head-pages recalled from the host tier (background and correction).")                   \
  X(recalled_bytes, kCounter, "K+V bytes of the recalled head-pages.")                        \
  X(correction_pages, kCounter, "Head-pages recalled before attention, for corrected heads.") \
  X(checked_heads, kCounter, "(layer-step, KV head) pairs checked for query drift.")          \
  X(corrected_heads, kCounter,                                                                 \
    "Checked heads that were corrected (re-selected and recalled before attention).")        \
  X(profiled_steps, kCounter, "Layer-steps run while profiling (LocalSequence::SetProfiling).") \
  X(resident_head_pages, kGauge,                                                               \
    "Head-pages in the working sets, all layers: sinks, selected or kept, recent.")          \
  X(resident_bytes, kGauge, "K+V bytes of the working sets, all layers.")                    \
  X(evicted_head_pages, kCounter, "Head-pages evicted for good by drop-mode policies.")       \
  X(budget_changes, kCounter, "Layer-steps whose budget differed from the previous one.")     \
  X(host_dropped_pages, kCounter,                                                              \
    "Pages dropped for good because the host tier was full (host_drop = evict).")            \
  X(host_refusals, kCounter, "Writes refused because the host tier was full (host_drop = refuse).") \
  X(host_demoted_pages, kCounter,                                                              \
    "Pages moved to the cold tier because the host tier was full (host_drop = demote).")     \
  X(host_promoted_pages, kCounter, "Demoted pages a selection brought back into the host tier.") \
  X(cold_written_pages, kCounter, "Demotions that wrote the page to the cold tier (its first).") \
  X(host_waits, kCounter,                                                                      \
    "Blocking host calls (event waits, synchronous copies, allocations) of ended layer-steps.") \
  X(host_event_waits, kCounter, "Of those, event waits and stream synchronisations.")         \
  X(host_sync_copies, kCounter, "Of those, copies into or out of pageable host memory.")      \
  X(host_allocations, kCounter, "Of those, device allocations and host registrations.")       \
  X(host_frees, kCounter, "Of those, device frees.")                                          \
  X(graph_launches, kCounter,                                                                  \
    "Launches of captured graphs (correction, attention, background selection).")            \
  X(selection_bytes, kGauge,                                                                   \
    "Bytes of the page summaries and key codes on the backend, all layers (sized for "        \
    "max_tokens): what selection reads besides the working sets.")

struct SequenceStats;  // kvtier/sequence.h

// One counter of the list.
struct CounterInfo {
  std::string_view name;
  CounterKind kind;
  std::string_view help;
  int64_t SequenceStats::*field;
};

// Every counter, in the order of the list.
std::span<const CounterInfo> SequenceCounters();
inline constexpr int kNumSequenceCounters = 0
#define KVTIER_COUNT_ONE(name, kind, help) +1
    KVTIER_SEQUENCE_COUNTERS(KVTIER_COUNT_ONE)
#undef KVTIER_COUNT_ONE
    ;

// The value of counter `name` in `stats`, or nullopt for a name that is not a counter.
std::optional<int64_t> GetCounter(const SequenceStats& stats, std::string_view name);

}  // namespace kvtier

#endif  // KVTIER_COUNTERS_H_
