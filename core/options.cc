// The names and small methods of the public vocabulary (include/kvtier: options.h,
// device.h, protocol.h).
#include "kvtier/options.h"

#include <initializer_list>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
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

absl::Status SequenceOptions::SetBudgetTokens(int32_t budget_tokens, int32_t page_size) {
  if (page_size <= 0 || budget_tokens <= 0 || budget_tokens % (4 * page_size) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "budget = %d tokens: must be a positive multiple of 4 pages (%d tokens at p = %d)",
        budget_tokens, 4 * page_size, page_size));
  }
  const int32_t pages = budget_tokens / page_size;
  sink_pages = pages / 4;
  recent_pages = pages / 4;
  selected_pages = pages - sink_pages - recent_pages;
  return absl::OkStatus();
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
