// SetUpLogging: one spdlog logger with one sink. JSON lines come from a pattern whose message field
// is a custom flag (%*) that escapes the payload, so every line is valid JSON whatever a message
// holds.
#include "daemon/logging.h"


#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/json.h"
#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/basic_file_sink.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace kvtier::daemon {
namespace {

constexpr char kTextPattern[] = "%Y-%m-%dT%H:%M:%S.%e%z %^%-5l%$ kvtierd[%P] %v";
constexpr char kJsonPattern[] =
    R"({"ts":"%Y-%m-%dT%H:%M:%S.%f%z","level":"%l","pid":%P,"tid":%t,"msg":"%*"})";

// %*: the message, escaped for a JSON string.
class JsonMessageFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm& /*time*/,
              spdlog::memory_buf_t& dest) override {
    const std::string escaped =
        JsonEscape(std::string_view(msg.payload.data(), msg.payload.size()));
    dest.append(escaped.data(), escaped.data() + escaped.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<JsonMessageFlag>();
  }
};

absl::StatusOr<spdlog::level::level_enum> ParseLevel(std::string_view level) {
  if (level == "trace") return spdlog::level::trace;
  if (level == "debug") return spdlog::level::debug;
  if (level == "info") return spdlog::level::info;
  if (level == "warn") return spdlog::level::warn;
  if (level == "error") return spdlog::level::err;
  if (level == "off") return spdlog::level::off;
  return absl::InvalidArgumentError(absl::StrFormat(
      "log.level = \"%s\" is not one of trace | debug | info | warn | error | off", level));
}

absl::StatusOr<spdlog::sink_ptr> MakeSink(const std::string& file) {
  if (file.empty()) return std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  try {
    return std::make_shared<spdlog::sinks::basic_file_sink_mt>(file, /*truncate=*/false);
  } catch (const spdlog::spdlog_ex& e) {
    return absl::FailedPreconditionError(
        absl::StrCat("log.file \"", file, "\" cannot be opened for appending: ", e.what()));
  }
}

}  // namespace

bool LogLimiter::Allow(std::string_view key, absl::Time now, uint64_t* suppressed) {
  MutexLock lock(&mu_);
  auto it = buckets_.find(key);
  if (it == buckets_.end()) {
    it = buckets_.emplace(std::string(key), Bucket{burst_, now, 0}).first;
  }
  Bucket& b = it->second;
  b.tokens = std::min(burst_, b.tokens + absl::ToDoubleSeconds(now - b.last) * per_second_);
  b.last = now;
  if (b.tokens < 1.0) {
    ++b.suppressed;
    return false;
  }
  b.tokens -= 1.0;
  *suppressed = std::exchange(b.suppressed, 0);
  return true;
}

LogLimiter& RequestLogLimiter() {
  static LogLimiter* limiter = new LogLimiter(/*per_second=*/5, /*burst=*/20);
  return *limiter;
}

absl::Status SetUpLogging(const DaemonConfig& config) {
  absl::StatusOr<spdlog::level::level_enum> level = ParseLevel(config.log_level);
  if (!level.ok()) return level.status();
  if (config.log_format != "text" && config.log_format != "json") {
    return absl::InvalidArgumentError(
        absl::StrCat("log.format = \"", config.log_format, "\" is not one of text | json"));
  }
  absl::StatusOr<spdlog::sink_ptr> sink = MakeSink(config.log_file);
  if (!sink.ok()) return sink.status();
  auto logger = std::make_shared<spdlog::logger>("kvtierd", *std::move(sink));
  if (config.log_format == "json") {
    auto formatter = std::make_unique<spdlog::pattern_formatter>();
    formatter->add_flag<JsonMessageFlag>('*').set_pattern(kJsonPattern);
    logger->set_formatter(std::move(formatter));
  } else {
    logger->set_pattern(kTextPattern);
  }
  logger->set_level(*level);
  logger->flush_on(*level);
  spdlog::set_default_logger(std::move(logger));
  return absl::OkStatus();
}

}  // namespace kvtier::daemon
