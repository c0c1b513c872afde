#include "bench/report.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
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

int64_t HostMemAvailable() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, "MemAvailable:")) continue;
    rest = absl::StripAsciiWhitespace(rest);
    absl::ConsumeSuffix(&rest, "kB");
    int64_t kib = 0;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(rest), &kib)) return kib * 1024;
  }
  return -1;
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

namespace {

// Quantile of samples already sorted. REQUIRES: not empty.
double SortedQuantile(const std::vector<double>& sorted, double q) {
  const size_t n = sorted.size();
  const double rank = q * static_cast<double>(n - 1);
  const size_t lo = static_cast<size_t>(rank);
  const size_t hi = std::min(lo + 1, n - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - static_cast<double>(lo));
}

}  // namespace

double Quantile(std::vector<double> samples, double q) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  return SortedQuantile(samples, q);
}

Spread SpreadOf(std::vector<double> samples) {
  Spread s;
  if (samples.empty()) return s;
  std::sort(samples.begin(), samples.end());
  const size_t n = samples.size();
  const auto quantile = [&](double q) { return SortedQuantile(samples, q); };
  s.median = quantile(0.5);
  s.p10 = quantile(0.1);
  s.p90 = quantile(0.9);
  s.min = samples.front();
  s.max = samples.back();
  s.n = static_cast<int64_t>(n);
  return s;
}

JsonObject SpreadJson(const Spread& s) {
  JsonObject j;
  j.Add("median", s.median)
      .Add("p10", s.p10)
      .Add("p90", s.p90)
      .Add("min", s.min)
      .Add("max", s.max)
      .Add("n", s.n);
  return j;
}

bool ParseIntList(const std::string& text, std::vector<int32_t>* out, std::string* bad) {
  out->clear();
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int32_t v = 0;
    if (!absl::SimpleAtoi(part, &v)) {
      if (bad != nullptr) *bad = std::string(part);
      return false;
    }
    out->push_back(v);
  }
  return true;
}

}  // namespace kvtier::bench
