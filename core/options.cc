// The names and small methods of the public vocabulary (include/kvtier: options.h,
// device.h, protocol.h), and the one resolver of SequenceOptions.
#include "kvtier/options.h"

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "kvtier/device.h"
#include "kvtier/protocol.h"

namespace kvtier {

std::string_view RetrievalModeName(RetrievalMode mode) {
  switch (mode) {
    case RetrievalMode::kSpeculative:
      return "speculative";
    case RetrievalMode::kSync:
      return "sync";
    case RetrievalMode::kFull:
      return "full";
    case RetrievalMode::kDrop:
      return "drop";
  }
  return "unknown";
}

std::string_view CorrectionTriggerName(CorrectionTrigger trigger) {
  switch (trigger) {
    case CorrectionTrigger::kCosine:
      return "cosine";
    case CorrectionTrigger::kMass:
      return "mass";
  }
  return "unknown";
}

bool ParseCorrectionTrigger(std::string_view name, CorrectionTrigger* out) {
  for (const CorrectionTrigger t : {CorrectionTrigger::kCosine, CorrectionTrigger::kMass}) {
    if (name == CorrectionTriggerName(t)) {
      *out = t;
      return true;
    }
  }
  return false;
}

std::string_view SummaryModeName(SummaryMode mode) {
  switch (mode) {
    case SummaryMode::kMinMax:
      return "minmax";
    case SummaryMode::kCenterMad:
      return "center-mad";
    case SummaryMode::kKeyCodes:
      return "key-codes";
  }
  return "unknown";
}

bool ParseSummaryMode(std::string_view name, SummaryMode* out) {
  for (const SummaryMode m : {SummaryMode::kMinMax, SummaryMode::kCenterMad, SummaryMode::kKeyCodes}) {
    if (name == SummaryModeName(m)) {
      *out = m;
      return true;
    }
  }
  return false;
}

absl::Status SequenceOptions::SetBudgetTokens(int32_t budget_tokens, int32_t page_size) {
  if (page_size <= 0 || budget_tokens <= 0 || budget_tokens % (4 * page_size) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "budget_tokens = %d: must be a positive multiple of 4 pages (%d tokens at page_size %d)",
        budget_tokens, 4 * page_size, page_size));
  }
  const int32_t pages = budget_tokens / page_size;
  sink_pages = DefaultSinkPages(pages);
  recent_pages = DefaultRecentPages(pages);
  selected_pages = pages - sink_pages - recent_pages;
  return absl::OkStatus();
}

namespace {

// A part below its least, in the one message the split and the resolver both give.
absl::Status SinkBelowZero(int64_t sink) {
  return absl::InvalidArgumentError(absl::StrFormat("sink_pages = %d: must be >= 0", sink));
}
absl::Status RecentBelowOne(int64_t recent) {
  return absl::InvalidArgumentError(
      absl::StrFormat("recent_pages = %d: must be >= 1 (it holds the page being filled)", recent));
}

}  // namespace

absl::Status SequenceOptions::SplitBudget(int64_t sink, int64_t recent) {
  // Parts below their least are refused as the resolver refuses them, however negative; within
  // the largest budget no sum below overflows, and nothing past it is valid.
  if (sink < 0) return SinkBelowZero(sink);
  if (recent < 1) return RecentBelowOne(recent);
  if (sink > kMaxBudgetPages || recent > kMaxBudgetPages) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sink_pages = %d, recent_pages = %d: each must be at most %d pages",
                        sink, recent, kMaxBudgetPages));
  }
  const int32_t pages = budget_pages();
  sink_pages = static_cast<int32_t>(sink);
  recent_pages = static_cast<int32_t>(recent);
  selected_pages = static_cast<int32_t>(pages - sink - recent);
  return absl::OkStatus();
}

namespace {

absl::Status Bad(std::string message) { return absl::InvalidArgumentError(std::move(message)); }

// The working set's shape: the mode, the capacity and the three regions.
absl::Status CheckShape(const SequenceOptions& o, int32_t page_size) {
  const int mode = static_cast<int>(o.mode);
  if (mode < static_cast<int>(RetrievalMode::kSpeculative) ||
      mode > static_cast<int>(RetrievalMode::kDrop)) {
    return Bad(absl::StrFormat("mode = %d: must be speculative (0), sync (1), full (2) or drop (3)",
                               mode));
  }
  if (o.max_tokens < 1 || o.max_tokens > kMaxSequenceTokens) {
    return Bad(
        absl::StrFormat("max_tokens = %d: must be in [1, %d]", o.max_tokens, kMaxSequenceTokens));
  }
  if (o.sink_pages < 0) return SinkBelowZero(o.sink_pages);
  if (o.selected_pages < 0) {
    return Bad(absl::StrFormat("selected_pages = %d: must be >= 0", o.selected_pages));
  }
  if (o.recent_pages < 1) return RecentBelowOne(o.recent_pages);
  if (o.mode == RetrievalMode::kFull) return absl::OkStatus();  // holds every page
  const int64_t budget = int64_t{o.sink_pages} + o.selected_pages + o.recent_pages;
  if (budget > kMaxBudgetPages) {
    return Bad(
        absl::StrFormat("budget = %d pages (sink %d + selected %d + recent %d): must be at most %d",
                        budget, o.sink_pages, o.selected_pages, o.recent_pages, kMaxBudgetPages));
  }
  // Selection picks k of the pages a layer holds: more could never be chosen.
  const int64_t max_pages = (int64_t{o.max_tokens} + page_size - 1) / page_size;
  const bool selects = o.mode == RetrievalMode::kSpeculative || o.mode == RetrievalMode::kSync;
  if (selects && o.selected_pages > max_pages) {
    return Bad(absl::StrFormat(
        "selected_pages = %d: must be at most the %d pages a layer holds (max_tokens = %d at "
        "page_size %d; the budget is %d tokens): lower the budget, raise max_tokens to at "
        "least %d, or use mode full",
        o.selected_pages, max_pages, o.max_tokens, page_size, budget * page_size,
        int64_t{o.selected_pages} * page_size));
  }
  return absl::OkStatus();
}

// How speculative mode corrects, and the numbers the steps run with.
absl::Status CheckCorrectionAndSteps(const SequenceOptions& o) {
  if (!std::isfinite(o.correction_threshold)) {
    return Bad(absl::StrFormat(
        "correction_threshold = %g: must be finite (it is compared with a mean cosine in "
        "[-1, 1]: > 1 always corrects, <= -1 never)",
        o.correction_threshold));
  }
  if (o.correction_trigger != CorrectionTrigger::kCosine &&
      o.correction_trigger != CorrectionTrigger::kMass) {
    return Bad(absl::StrFormat("correction_trigger = %d: must be cosine (0) or mass (1)",
                               static_cast<int>(o.correction_trigger)));
  }
  if (o.summary != SummaryMode::kMinMax && o.summary != SummaryMode::kCenterMad &&
      o.summary != SummaryMode::kKeyCodes) {
    return Bad(absl::StrFormat("summary = %d: must be minmax (0), center-mad (1) or key-codes (2)",
                               static_cast<int>(o.summary)));
  }
  if (!(o.correction_max_loss >= 0.0f && o.correction_max_loss <= 1.0f)) {
    return Bad(absl::StrFormat(
        "correction_max_loss = %g: must be in [0, 1] (the fraction of a head's estimated "
        "attention mass its stale selection may lose: 0 corrects on any loss, 1 never)",
        o.correction_max_loss));
  }
  if (!(std::isfinite(o.softmax_scale) && o.softmax_scale >= 0.0f)) {
    return Bad(absl::StrFormat("softmax_scale = %g: must be finite and >= 0 (0: 1/sqrt(head_dim))",
                               o.softmax_scale));
  }
  if (o.stream_chunk_items < 1 || o.stream_chunk_items > kMaxStreamChunkItems) {
    return Bad(absl::StrFormat("stream_chunk_items = %d: must be in [1, %d]", o.stream_chunk_items,
                               kMaxStreamChunkItems));
  }
  if (o.deadline <= absl::ZeroDuration()) {
    return Bad(
        absl::StrFormat("deadline = %s: must be positive", absl::FormatDuration(o.deadline)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SequenceOptions> ResolveSequenceOptions(const SequenceOptions& given,
                                                       int32_t page_size) {
  if (page_size < 1) {
    return Bad(absl::StrFormat("page_size = %d: must be >= 1", page_size));
  }
  if (absl::Status st = CheckShape(given, page_size); !st.ok()) return st;
  if (absl::Status st = CheckCorrectionAndSteps(given); !st.ok()) return st;
  return given;
}

std::string_view DeviceKindName(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kAuto:
      return "auto";
    case DeviceKind::kCpu:
      return "cpu";
    case DeviceKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

bool ParseDeviceKind(std::string_view name, DeviceKind* out) {
  if (name == "auto") {
    *out = DeviceKind::kAuto;
  } else if (name == "cpu") {
    *out = DeviceKind::kCpu;
  } else if (name == "cuda") {
    *out = DeviceKind::kCuda;
  } else {
    return false;
  }
  return true;
}

std::string_view TransportName(Transport t) {
  switch (t) {
    case Transport::kShm:
      return "shm";
    case Transport::kGrpc:
      return "grpc";
  }
  return "unknown";
}

}  // namespace kvtier
