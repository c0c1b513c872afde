#include "daemon/caller.h"

#include <algorithm>
#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace kvtier::daemon {
namespace {

constexpr absl::string_view kTrailerPrefix = "kvtier.v1/trailer/";

}  // namespace

absl::Status Caller::CheckLive(std::string_view what) const {
  if (cancelled && cancelled()) {
    return absl::CancelledError(
        absl::StrFormat("%s was not done: the client cancelled the call", what));
  }
  const absl::Time now = absl::Now();
  if (now >= deadline) {
    return absl::DeadlineExceededError(absl::StrFormat(
        "%s was not done: the call's deadline (less the server's margin) passed %s ago", what,
        absl::FormatDuration(absl::Trunc(now - deadline, absl::Microseconds(1)))));
  }
  return absl::OkStatus();
}

void SetTrailer(absl::Status& status, std::string_view key, std::string_view value) {
  status.SetPayload(absl::StrCat(kTrailerPrefix, absl::string_view(key.data(), key.size())),
                    absl::Cord(absl::string_view(value.data(), value.size())));
}

std::optional<std::string> Trailer(const absl::Status& status, std::string_view key) {
  absl::optional<absl::Cord> payload =
      status.GetPayload(absl::StrCat(kTrailerPrefix, absl::string_view(key.data(), key.size())));
  if (!payload.has_value()) return std::nullopt;
  return std::string(*payload);
}

void ForEachTrailer(const absl::Status& status,
                    absl::FunctionRef<void(std::string_view key, std::string_view value)> fn) {
  status.ForEachPayload([&](absl::string_view url, const absl::Cord& payload) {
    if (!absl::StartsWith(url, kTrailerPrefix)) return;
    const absl::string_view key = url.substr(kTrailerPrefix.size());
    const std::string value(payload);
    fn(std::string_view(key.data(), key.size()), value);
  });
}

void SetRetryAfter(absl::Status& status, absl::Duration after) {
  const int64_t ms = std::max<int64_t>(1, absl::ToInt64Milliseconds(after));
  SetTrailer(status, kRetryAfterTrailer, absl::StrCat(ms));
}

}  // namespace kvtier::daemon
