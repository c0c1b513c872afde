// The parts of the public sequence contract (kvtier/sequence.h) every local sequence shares.
#include "kvtier/sequence.h"

#include <vector>

#include "core/status.h"

namespace kvtier {

std::span<const CounterInfo> SequenceCounters() {
  static constexpr CounterInfo kCounters[] = {
#define KVTIER_COUNTER_INFO(name, kind, help) \
  {#name, CounterKind::kind, help, &SequenceStats::name},
      KVTIER_SEQUENCE_COUNTERS(KVTIER_COUNTER_INFO)
#undef KVTIER_COUNTER_INFO
  };
  return kCounters;
}

std::optional<int64_t> GetCounter(const SequenceStats& stats, std::string_view name) {
  for (const CounterInfo& c : SequenceCounters()) {
    if (c.name == name) return stats.*c.field;
  }
  return std::nullopt;
}

// The step protocol is the batch's; alone, a sequence is a run of one member of it.
absl::StatusOr<WorkingSetView> LocalSequence::BeginStep(int32_t layer, const void* q) {
  LocalSequence* const member = stepped();
  KVTIER_ASSIGN_OR_RETURN(std::vector<WorkingSetView> views,
                          batch()->BeginStep(layer, {&member, 1}, q));
  return views.front();
}

absl::Status LocalSequence::Attend(int32_t layer, const void* q, void* out, float* lse) {
  LocalSequence* const member = stepped();
  return batch()->Attend(layer, {&member, 1}, q, out, lse);
}

absl::Status LocalSequence::EndStep(int32_t layer, const void* q) {
  LocalSequence* const member = stepped();
  return batch()->EndStep(layer, {&member, 1}, q);
}

absl::Status LocalSequence::Decode(int32_t layer, const void* q, void* out, float* lse) {
  KVTIER_RETURN_IF_ERROR(BeginStep(layer, q).status());
  if (out != nullptr) KVTIER_RETURN_IF_ERROR(Attend(layer, q, out, lse));
  return EndStep(layer, q);
}

}  // namespace kvtier
