#include "offload/telemetry.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <type_traits>

#include "kvtier/sequence.h"

namespace kvtier {
namespace {

static_assert(std::is_trivially_copyable_v<TelemetryValues>);
static_assert(sizeof(TelemetryValues) % sizeof(uint64_t) == 0);
static_assert(std::atomic_ref<uint64_t>::is_always_lock_free);

// 2: a word for every counter of kvtier/counters.h; 3: int8_head_pages gone (INT8
// storage removed), so the words after resident_bytes moved.
constexpr uint64_t kTelemetryVersion = 3;
constexpr size_t kValueWords = sizeof(TelemetryValues) / sizeof(uint64_t);
// Words before the values: the magic and the version.
constexpr size_t kHead = 2;
// The word of pages_committed among the values: only AddCommitted writes it.
constexpr size_t kCommittedWord = offsetof(TelemetryValues, pages_committed) / sizeof(uint64_t);

std::atomic_ref<uint64_t> Word(uint64_t* words, size_t i) {
  return std::atomic_ref<uint64_t>(words[i]);
}

}  // namespace

void TelemetryValues::AddStepTime(double seconds) {
  if (!(seconds >= 0)) seconds = 0;  // NaN too
  const auto* it = std::lower_bound(kLayerStepBucketsSeconds.begin(),
                                    kLayerStepBucketsSeconds.end(), seconds);
  ++step_buckets[static_cast<size_t>(it - kLayerStepBucketsSeconds.begin())];
  step_nanos += static_cast<uint64_t>(std::llround(std::min(seconds, 1e9) * 1e9));
  ++step_count;
}

void TelemetryValues::SetCounters(const SequenceStats& stats) {
  const auto u = [](int64_t x) { return static_cast<uint64_t>(std::max<int64_t>(x, 0)); };
#define KVTIER_SET_WORD(name, kind, help) name = u(stats.name);
  KVTIER_SEQUENCE_COUNTERS(KVTIER_SET_WORD)
#undef KVTIER_SET_WORD
}

TelemetryValues TelemetryValues::ContinuedFrom(const TelemetryValues& base) const {
  TelemetryValues out = *this;
#define KVTIER_CONTINUE_WORD(name, kind, help) \
  if (CounterKind::kind == CounterKind::kCounter) out.name += base.name;
  KVTIER_SEQUENCE_COUNTERS(KVTIER_CONTINUE_WORD)
#undef KVTIER_CONTINUE_WORD
  for (int c = 0; c < kHeadClasses; ++c) {
    out.checked_heads_by_class[c] += base.checked_heads_by_class[c];
    out.corrected_heads_by_class[c] += base.corrected_heads_by_class[c];
  }
  out.mass_recall_micros += base.mass_recall_micros;
  out.mass_recall_count += base.mass_recall_count;
  for (size_t b = 0; b < kLayerStepBuckets; ++b) out.step_buckets[b] += base.step_buckets[b];
  out.step_nanos += base.step_nanos;
  out.step_count += base.step_count;
  return out;
}

void TelemetryBlock::Format() {
  for (size_t i = 0; i < kTelemetryWords; ++i) Word(words_, i).store(0, std::memory_order_relaxed);
  Word(words_, 1).store(kTelemetryVersion, std::memory_order_relaxed);
  Word(words_, 0).store(kTelemetryMagic, std::memory_order_release);
}

std::optional<TelemetryValues> TelemetryBlock::Read() const {
  if (Word(words_, 0).load(std::memory_order_acquire) != kTelemetryMagic ||
      Word(words_, 1).load(std::memory_order_relaxed) != kTelemetryVersion) {
    return std::nullopt;
  }
  uint64_t v[kValueWords];
  for (size_t i = 0; i < kValueWords; ++i) {
    v[i] = Word(words_, kHead + i).load(std::memory_order_relaxed);
  }
  TelemetryValues out;
  std::memcpy(&out, v, sizeof(out));
  return out;
}

void TelemetryBlock::Publish(const TelemetryValues& values) {
  uint64_t v[kValueWords];
  std::memcpy(v, &values, sizeof(v));
  for (size_t i = 0; i < kValueWords; ++i) {
    if (i == kCommittedWord) continue;
    Word(words_, kHead + i).store(v[i], std::memory_order_relaxed);
  }
}

void TelemetryBlock::AddCommitted(uint64_t pages) {
  std::atomic_ref<uint64_t> w = Word(words_, kHead + kCommittedWord);
  w.store(w.load(std::memory_order_relaxed) + pages, std::memory_order_relaxed);
}

}  // namespace kvtier
