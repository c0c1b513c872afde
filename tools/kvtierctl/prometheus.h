// A parser for the Prometheus text exposition format (version 0.0.4), enough for kvtierctl to
// read kvtierd's /metrics: `# HELP` and `# TYPE` lines, other comments, samples with labels
// (values escaped with \\, \" and \n), values as Go's ParseFloat writes them (+Inf, -Inf, NaN,
// exponents) and optional integer timestamps (ms).
//
// Strict where the format is: a malformed line is INVALID_ARGUMENT naming its line number and
// what was wrong, so a broken exporter is noticed rather than half-read.
//
// Thread-compatible: values only.
#ifndef KVTIER_TOOLS_KVTIERCTL_PROMETHEUS_H_
#define KVTIER_TOOLS_KVTIERCTL_PROMETHEUS_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace kvtier::ctl {

struct PromSample {
  std::string name;  // with any _sum / _count / _bucket suffix, as written
  std::vector<std::pair<std::string, std::string>> labels;  // in the order written, unescaped
  double value = 0;
  std::optional<int64_t> timestamp_ms;
  int line = 0;  // 1-based

  // The value of label `name`, or nullptr when the sample has none.
  const std::string* Label(std::string_view label) const;
};

struct PromText {
  std::vector<PromSample> samples;          // in the order written
  std::map<std::string, std::string> help;  // metric family -> docstring, unescaped
  std::map<std::string, std::string> type;  // family -> counter|gauge|histogram|summary|untyped

  // Every sample named `name`, in order.
  std::vector<const PromSample*> Find(std::string_view name) const;
};

// Parses `text`. INVALID_ARGUMENT "line N: ..." for the first malformed line: a bad metric or
// label name, an unterminated or badly escaped label value, a repeated label, a value or a
// timestamp that is not a number, trailing garbage, an unknown TYPE, or a second HELP or TYPE
// line for one family.
absl::StatusOr<PromText> ParsePrometheusText(std::string_view text);

}  // namespace kvtier::ctl

#endif  // KVTIER_TOOLS_KVTIERCTL_PROMETHEUS_H_
