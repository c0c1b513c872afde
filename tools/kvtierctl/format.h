// Text helpers of kvtierctl's output: aligned tables, human-readable sizes and durations, JSON
// numbers. Pure functions; thread-safe.
#ifndef KVTIER_TOOLS_KVTIERCTL_FORMAT_H_
#define KVTIER_TOOLS_KVTIERCTL_FORMAT_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace kvtier::ctl {

struct Column {
  std::string title;
  bool right = false;  // right-aligned (numbers)
};

// The header and the rows, columns separated by two spaces and padded to their widest cell;
// one line each, no trailing blanks. REQUIRES: every row has header.size() cells.
std::string RenderTable(const std::vector<Column>& header,
                        const std::vector<std::vector<std::string>>& rows);

// Binary units with one decimal: "0 B", "512 B", "1.5 KiB", "1.0 GiB"; "-" for nullopt.
std::string HumanBytes(std::optional<double> bytes);

// "850ns", "45.2us", "1.30ms", "2.50s", "3m12s", "5h02m", "3d04h": three significant digits below
// a minute, two units above.
std::string HumanDuration(absl::Duration d);

// An integer count, or "-" for nullopt.
std::string Count(std::optional<double> n);

// A finite number as JSON ("null" for nullopt, NaN and infinities); integers without a fraction.
std::string JsonNumber(std::optional<double> v);

// `text` as a JSON string literal, quotes included.
std::string JsonString(const std::string& text);

}  // namespace kvtier::ctl

#endif  // KVTIER_TOOLS_KVTIERCTL_FORMAT_H_
