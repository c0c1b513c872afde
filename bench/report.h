// What every benchmark report carries (device, commit, host), and a tiny ordered JSON
// object writer so reports are one machine-readable line with keys in a stable order.
#ifndef KVTIER_BENCH_REPORT_H_
#define KVTIER_BENCH_REPORT_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvtier::bench {

// The commit the binary was built from (git describe at configure time).
std::string_view Commit();
// The host CPU model and logical core count, e.g. "Intel Xeon ... (16 threads)".
std::string HostCpu();
// UTC time now, ISO 8601.
std::string UtcNow();
// MemAvailable of /proc/meminfo in bytes; -1 when unknown (the big benchmarks check it
// before they allocate).
int64_t HostMemAvailable();

class JsonObject {
 public:
  JsonObject& Add(std::string_view key, std::string_view value);
  JsonObject& Add(std::string_view key, const char* value) { return Add(key, std::string_view(value)); }
  JsonObject& Add(std::string_view key, double value);
  JsonObject& Add(std::string_view key, int64_t value);
  JsonObject& Add(std::string_view key, int32_t value) { return Add(key, int64_t{value}); }
  JsonObject& Add(std::string_view key, bool value);
  JsonObject& AddObject(std::string_view key, const JsonObject& value);
  JsonObject& AddArray(std::string_view key, const std::vector<JsonObject>& values);
  std::string ToString() const;

 private:
  std::vector<std::pair<std::string, std::string>> fields_;  // key → encoded value
};

// "a,b,c" (empty parts skipped) into *out; false at the first part that is not an int32,
// named in *bad when given. The benchmarks' list flags (--budgets, --batch, --contexts, ...).
bool ParseIntList(const std::string& text, std::vector<int32_t>* out, std::string* bad = nullptr);

// Median of `samples` (copied, not modified).
double Median(std::vector<double> samples);
// The q-quantile of `samples` (copied), interpolated between the two nearest ranks (rank
// q·(n−1) of the sorted samples); 0 when there are none.
double Quantile(std::vector<double> samples, double q);

// Repeated measurements of one quantity summarised by their middle and spread, so a report
// shows what a typical run gives and how much runs vary instead of the best run.
struct Spread {
  double median = 0;
  double p10 = 0;  // 10th and 90th percentiles, linearly interpolated between samples
  double p90 = 0;
  double min = 0;
  double max = 0;
  int64_t n = 0;  // samples
};
// Of `samples` (copied, not modified); all zero when there are none.
Spread SpreadOf(std::vector<double> samples);
// {"median": …, "p10": …, "p90": …, "min": …, "max": …, "n": …}
JsonObject SpreadJson(const Spread& s);

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_REPORT_H_
