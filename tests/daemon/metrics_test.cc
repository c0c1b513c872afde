// The exposition writer and counters behind kvtierd's /metrics (daemon/metrics.h): the text
// format's escaping and number spelling, histograms written cumulatively with +Inf, _sum and
// _count, and RpcMetrics' per-method, per-code counts and in-flight gauge.
#include "daemon/metrics.h"

#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvtier::daemon {
namespace {

TEST(MetricsTest, ValuesAreSpelledAsTheFormatWants) {
  EXPECT_EQ(FormatMetricValue(0), "0");
  EXPECT_EQ(FormatMetricValue(-1), "-1");
  EXPECT_EQ(FormatMetricValue(1073741824), "1073741824");
  EXPECT_EQ(FormatMetricValue(0.25), "0.25");
  EXPECT_EQ(FormatMetricValue(0.0025), "0.0025");  // the shortest that reads back
  EXPECT_EQ(FormatMetricValue(0.1), "0.1");
  EXPECT_EQ(FormatMetricValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatMetricValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(FormatMetricValue(std::nan("")), "NaN");
  EXPECT_EQ(std::stod(FormatMetricValue(0.1)), 0.1);  // round-trips
  EXPECT_EQ(std::stod(FormatMetricValue(1e300)), 1e300);
}

TEST(MetricsTest, LabelValuesAndHelpAreEscaped) {
  EXPECT_EQ(EscapeLabelValue(R"(a"b\c)" "\n"), R"(a\"b\\c\n)");
  Exposition out;
  out.Family("kvtier_x_total", "counter", "line one\nback\\slash");
  out.Sample("kvtier_x_total", {{"session", "s\"1"}, {"label", "two\nlines"}}, 3);
  out.Sample("kvtier_x_total", {}, 4);
  EXPECT_EQ(out.text(),
            "# HELP kvtier_x_total line one\\nback\\\\slash\n"
            "# TYPE kvtier_x_total counter\n"
            "kvtier_x_total{session=\"s\\\"1\",label=\"two\\nlines\"} 3\n"
            "kvtier_x_total 4\n");
}

// The text format wants UTF-8: one label value that is not fails the parse of the whole
// scrape. Each byte that is not part of a well-formed sequence becomes U+FFFD; well-formed
// sequences of every length stay.
TEST(MetricsTest, LabelValuesOfAnyBytesBecomeValidUtf8) {
  struct Case {
    std::string in;
    std::string out;
  };
  const std::string r = "\xef\xbf\xbd";  // U+FFFD
  const std::vector<Case> cases = {
      {"/bin\xff\xfe/x", "/bin" + r + r + "/x"},
      {"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"},
      {"\xc0\xaf", r + r},                  // overlong '/'
      {"\xe0\x80\xaf", r + r + r},          // overlong, three bytes
      {"\xed\xa0\x80", r + r + r},          // a surrogate
      {"\xf4\x90\x80\x80", r + r + r + r},  // past U+10FFFF
      {"\x80x", r + "x"},                   // a stray continuation byte
      {"\xe2\x82", r + r},                  // cut short at the end
      {"\xe2\x82\"", r + r + "\\\""},       // cut short by an escaped character
      {std::string("nul\0byte", 8), std::string("nul\0byte", 8)},
  };
  for (const Case& c : cases) EXPECT_EQ(EscapeLabelValue(c.in), c.out) << c.in;
  Exposition out;
  out.Family("kvtier_y_total", "counter", "help \xff");
  out.Sample("kvtier_y_total", {{"method", "/bin\xff\xfe/x"}}, 1);
  EXPECT_EQ(out.text(), "# HELP kvtier_y_total help " + r + "\n# TYPE kvtier_y_total counter\n" +
                            "kvtier_y_total{method=\"/bin" + r + r + "/x\"} 1\n");
}

TEST(MetricsTest, HistogramsAreCumulativeWithInfSumAndCount) {
  Exposition out;
  const double bounds[] = {0.001, 0.01};
  const uint64_t per_bucket[] = {2, 0, 5};  // 5 above the last bound
  const Label labels[] = {{"method", "m"}};
  out.Family("kvtier_t_seconds", "histogram", "h");
  out.Histogram("kvtier_t_seconds", labels, bounds, per_bucket, 12.5);
  EXPECT_EQ(out.text(),
            "# HELP kvtier_t_seconds h\n"
            "# TYPE kvtier_t_seconds histogram\n"
            "kvtier_t_seconds_bucket{method=\"m\",le=\"0.001\"} 2\n"
            "kvtier_t_seconds_bucket{method=\"m\",le=\"0.01\"} 2\n"
            "kvtier_t_seconds_bucket{method=\"m\",le=\"+Inf\"} 7\n"
            "kvtier_t_seconds_sum{method=\"m\"} 12.5\n"
            "kvtier_t_seconds_count{method=\"m\"} 7\n");
}

TEST(MetricsTest, RpcMetricsCountByMethodAndCodeFromManyThreads) {
  RpcMetrics m;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&m, t] {
      for (int i = 0; i < 250; ++i) {
        m.Begin();
        m.End(t % 2 == 0 ? "/a/Step" : "/a/Hello", i % 5 == 0 ? "NOT_FOUND" : "OK", 0.002);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  m.Begin();  // one still in flight
  Exposition out;
  m.Write(out);
  const std::string& t = out.text();
  EXPECT_NE(t.find("kvtier_rpcs_total{method=\"/a/Step\",code=\"OK\"} 400\n"), std::string::npos)
      << t;
  EXPECT_NE(t.find("kvtier_rpcs_total{method=\"/a/Step\",code=\"NOT_FOUND\"} 100\n"),
            std::string::npos);
  EXPECT_NE(t.find("kvtier_rpcs_total{method=\"/a/Hello\",code=\"OK\"} 400\n"), std::string::npos);
  // 2 ms is above the 1 ms bound and within 2.5 ms.
  EXPECT_NE(t.find("kvtier_rpc_duration_seconds_bucket{method=\"/a/Step\",le=\"0.001\"} 0\n"),
            std::string::npos);
  EXPECT_NE(t.find("kvtier_rpc_duration_seconds_bucket{method=\"/a/Step\",le=\"0.0025\"} 500\n"),
            std::string::npos);
  EXPECT_NE(t.find("kvtier_rpc_duration_seconds_count{method=\"/a/Hello\"} 500\n"),
            std::string::npos);
  EXPECT_NE(t.find("kvtier_rpcs_in_flight 1\n"), std::string::npos);
}

TEST(MetricsTest, CountersKeepOneCountPerKey) {
  Counters c;
  c.Add({"opened", "a", "shm"});
  c.Add({"opened", "a", "shm"}, 2);
  c.Add({"opened", "b", "grpc"});
  const auto snap = c.Snapshot();
  ASSERT_EQ(snap.size(), 2u);
  EXPECT_EQ(snap.at({"opened", "a", "shm"}), 3u);
  EXPECT_EQ(snap.at({"opened", "b", "grpc"}), 1u);
}

}  // namespace
}  // namespace kvtier::daemon
