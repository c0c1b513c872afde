// kvtierd's logs: the process-wide spdlog default logger, set up from the [log] table (level, text
// or JSON lines, stderr or a file). Components log with spdlog::info(...) and friends, as "event
// key=value key=value" so both formats stay greppable.
//
// SetUpLogging replaces the default logger; call it once, before threads start logging.
#ifndef KVTIER_DAEMON_LOGGING_H_
#define KVTIER_DAEMON_LOGGING_H_

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "daemon/config.h"

namespace kvtier::daemon {

// Installs a logger named "kvtierd" as spdlog's default, at config.log_level, formatted as
// config.log_format, writing to config.log_file (appended) or stderr. Messages of the logger's
// level or above are flushed at once. FAILED_PRECONDITION when the file cannot be opened;
// INVALID_ARGUMENT for an unknown level or format (Validate() rejects them first).
absl::Status SetUpLogging(const DaemonConfig& config);

// `text` escaped for the inside of a JSON string (quotes, backslashes, control characters).
std::string JsonEscape(std::string_view text);

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_LOGGING_H_
