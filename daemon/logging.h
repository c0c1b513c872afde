// kvtierd's logs: the process-wide spdlog default logger, set up from the [log] table (level, text
// or JSON lines, stderr or a file). Components log with spdlog::info(...) and friends, as "event
// key=value key=value" so both formats stay greppable.
//
// SetUpLogging replaces the default logger; call it once, before threads start logging.
//
// Lines a client's request can cause (a malformed message, a session opened or closed) go
// through LogLimited: per kind of line, a burst and then a steady rate, with a count of what
// was suppressed on the next line let through, so no client can fill the disk. LogLimiter is
// thread-safe.
#ifndef KVTIER_DAEMON_LOGGING_H_
#define KVTIER_DAEMON_LOGGING_H_

#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/mutex.h"
#include "daemon/config.h"
#include "spdlog/spdlog.h"

namespace kvtier::daemon {

// Installs a logger named "kvtierd" as spdlog's default, at config.log_level, formatted as
// config.log_format, writing to config.log_file (appended) or stderr. Messages of the logger's
// level or above are flushed at once. FAILED_PRECONDITION when the file cannot be opened;
// INVALID_ARGUMENT for an unknown level or format (Validate() rejects them first).
absl::Status SetUpLogging(const DaemonConfig& config);

// A token bucket per key: `burst` lines at once, then `per_second` on average.
class LogLimiter {
 public:
  LogLimiter(double per_second, double burst) : per_second_(per_second), burst_(burst) {}
  LogLimiter(const LogLimiter&) = delete;
  LogLimiter& operator=(const LogLimiter&) = delete;

  // Whether a line of `key` may be logged at `now`; when it may, *suppressed is the number
  // of lines of `key` refused since the last one allowed.
  bool Allow(std::string_view key, absl::Time now, uint64_t* suppressed) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Bucket {
    double tokens = 0;
    absl::Time last;
    uint64_t suppressed = 0;
  };
  const double per_second_;
  const double burst_;
  Mutex mu_;
  std::map<std::string, Bucket, std::less<>> buckets_ ABSL_GUARDED_BY(mu_);
};

// The daemon's limiter for request-driven lines: a burst of 20 lines per kind, then 5 a
// second.
LogLimiter& RequestLogLimiter();

// Logs `fmt` at `level` when RequestLogLimiter() allows a line of `key`, adding how many
// were suppressed before it.
template <typename... Args>
void LogLimited(spdlog::level::level_enum level, std::string_view key,
                fmt::format_string<Args...> format, Args&&... args) {
  if (!spdlog::should_log(level)) return;
  uint64_t suppressed = 0;
  if (!RequestLogLimiter().Allow(key, absl::Now(), &suppressed)) return;
  std::string line = fmt::format(format, std::forward<Args>(args)...);
  if (suppressed > 0) line += fmt::format(" ({} similar lines suppressed)", suppressed);
  spdlog::log(level, "{}", line);
}

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_LOGGING_H_
