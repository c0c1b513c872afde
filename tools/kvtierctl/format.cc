#include "tools/kvtierctl/format.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/json.h"

namespace kvtier::ctl {

std::string RenderTable(const std::vector<Column>& header,
                        const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width(header.size());
  for (size_t i = 0; i < header.size(); ++i) width[i] = header[i].title.size();
  for (const auto& row : rows) {
    for (size_t i = 0; i < header.size(); ++i) width[i] = std::max(width[i], row[i].size());
  }
  auto line = [&](const std::vector<std::string>& cells) {
    std::string out;
    for (size_t i = 0; i < header.size(); ++i) {
      const std::string pad(width[i] - cells[i].size(), ' ');
      if (i > 0) out += "  ";
      out += header[i].right ? pad + cells[i] : cells[i] + pad;
    }
    while (!out.empty() && out.back() == ' ') out.pop_back();
    return out + "\n";
  };
  std::vector<std::string> titles;
  for (const Column& c : header) titles.push_back(c.title);
  std::string out = line(titles);
  for (const auto& row : rows) out += line(row);
  return out;
}

std::string HumanBytes(std::optional<double> bytes) {
  if (!bytes.has_value() || !std::isfinite(*bytes)) return "-";
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = *bytes;
  size_t unit = 0;
  while (std::fabs(v) >= 1024 && unit + 1 < std::size(kUnits)) {
    v /= 1024;
    ++unit;
  }
  if (unit == 0) return absl::StrFormat("%.0f B", v);
  return absl::StrFormat("%.1f %s", v, kUnits[unit]);
}

std::string HumanDuration(absl::Duration d) {
  // (absl::StrCat, not "-" + std::string: GCC 12 at -O3 warns falsely about that operator+.)
  if (d < absl::ZeroDuration()) return absl::StrCat("-", HumanDuration(-d));
  const double ns = absl::ToDoubleNanoseconds(d);
  // Three significant digits below a minute.
  auto sig3 = [](double v, const char* unit) {
    if (v >= 100) return absl::StrFormat("%.0f%s", v, unit);
    if (v >= 10) return absl::StrFormat("%.1f%s", v, unit);
    return absl::StrFormat("%.2f%s", v, unit);
  };
  if (ns < 1e3) return absl::StrFormat("%.0fns", ns);
  if (ns < 1e6) return sig3(ns / 1e3, "us");
  if (ns < 1e9) return sig3(ns / 1e6, "ms");
  if (d < absl::Minutes(1)) return sig3(ns / 1e9, "s");
  const int64_t s = absl::ToInt64Seconds(d);
  if (d < absl::Hours(1)) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  if (d < absl::Hours(24)) return absl::StrFormat("%dh%02dm", s / 3600, (s / 60) % 60);
  return absl::StrFormat("%dd%02dh", s / 86400, (s / 3600) % 24);
}

std::string Count(std::optional<double> n) {
  if (!n.has_value() || !std::isfinite(*n)) return "-";
  return absl::StrFormat("%.0f", *n);
}

std::string JsonNumber(std::optional<double> v) {
  if (!v.has_value() || !std::isfinite(*v)) return "null";
  if (*v == std::trunc(*v) && std::fabs(*v) < 9.007199254740992e15) {
    return absl::StrFormat("%.0f", *v);
  }
  return absl::StrFormat("%.17g", *v);
}

std::string JsonString(const std::string& text) {
  return absl::StrCat("\"", JsonEscape(text), "\"");
}

}  // namespace kvtier::ctl
