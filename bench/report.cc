#include "bench/report.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/json.h"

#ifndef KVTIER_GIT_COMMIT
#define KVTIER_GIT_COMMIT "unknown"
#endif

namespace kvtier::bench {
namespace {

std::string Quote(std::string_view s) { return absl::StrCat("\"", JsonEscape(s), "\""); }

}  // namespace

std::string_view Commit() { return KVTIER_GIT_COMMIT; }

std::string HostCpu() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model = "unknown cpu";
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  }
  return absl::StrFormat("%s (%d threads)", model, std::thread::hardware_concurrency());
}

std::string UtcNow() {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::Now(), absl::UTCTimeZone());
}

JsonObject& JsonObject::Add(std::string_view key, std::string_view value) {
  fields_.emplace_back(std::string(key), Quote(value));
  return *this;
}
JsonObject& JsonObject::Add(std::string_view key, double value) {
  fields_.emplace_back(std::string(key),
                       std::isfinite(value) ? absl::StrFormat("%.6g", value) : "null");
  return *this;
}
JsonObject& JsonObject::Add(std::string_view key, int64_t value) {
  fields_.emplace_back(std::string(key), absl::StrCat(value));
  return *this;
}
JsonObject& JsonObject::Add(std::string_view key, bool value) {
  fields_.emplace_back(std::string(key), value ? "true" : "false");
  return *this;
}
JsonObject& JsonObject::AddObject(std::string_view key, const JsonObject& value) {
  fields_.emplace_back(std::string(key), value.ToString());
  return *this;
}

JsonObject& JsonObject::AddArray(std::string_view key, const std::vector<JsonObject>& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    absl::StrAppend(&out, i ? ", " : "", values[i].ToString());
  }
  fields_.emplace_back(std::string(key), out + "]");
  return *this;
}

std::string JsonObject::ToString() const {
  std::string out = "{";
  for (size_t i = 0; i < fields_.size(); ++i) {
    absl::StrAppend(&out, i ? ", " : "", Quote(fields_[i].first), ": ", fields_[i].second);
  }
  return out + "}";
}

double Median(std::vector<double> samples) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const size_t n = samples.size();
  return n % 2 ? samples[n / 2] : (samples[n / 2 - 1] + samples[n / 2]) / 2;
}

}  // namespace kvtier::bench
