// tools/kvtierctl/prometheus.h: the text format, one table of good inputs with what they parse
// to and one of malformed inputs with the line and the reason they are refused.
#include "tools/kvtierctl/prometheus.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::ctl {
namespace {

using ::testing::HasSubstr;
using Labels = std::vector<std::pair<std::string, std::string>>;

struct GoodCase {
  std::string name;  // the case, for the test's name
  std::string text;
  // The one sample expected (the text holds exactly one).
  std::string metric;
  Labels labels;
  double value;
  std::optional<int64_t> timestamp_ms;
};

class ParseGoodTest : public ::testing::TestWithParam<GoodCase> {};

TEST_P(ParseGoodTest, ParsesTheSample) {
  const GoodCase& c = GetParam();
  absl::StatusOr<PromText> t = ParsePrometheusText(c.text);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->samples.size(), 1u);
  const PromSample& s = t->samples[0];
  EXPECT_EQ(s.name, c.metric);
  EXPECT_EQ(s.labels, c.labels);
  if (std::isnan(c.value)) {
    EXPECT_TRUE(std::isnan(s.value));
  } else {
    EXPECT_EQ(s.value, c.value);
  }
  EXPECT_EQ(s.timestamp_ms, c.timestamp_ms);
}

constexpr double kInf = std::numeric_limits<double>::infinity();

INSTANTIATE_TEST_SUITE_P(
    Cases, ParseGoodTest,
    ::testing::Values(
        GoodCase{"Plain", "up 1\n", "up", {}, 1, std::nullopt},
        GoodCase{"NoFinalNewline", "up 1", "up", {}, 1, std::nullopt},
        GoodCase{"CrLf", "up 1\r\n", "up", {}, 1, std::nullopt},
        GoodCase{"ColonsInName", "a:b_c:d 2", "a:b_c:d", {}, 2, std::nullopt},
        GoodCase{"Labels", "m{a=\"x\",b=\"y\"} 3", "m", {{"a", "x"}, {"b", "y"}}, 3, std::nullopt},
        GoodCase{"TrailingComma", "m{a=\"x\",} 3", "m", {{"a", "x"}}, 3, std::nullopt},
        GoodCase{"EmptyBraces", "m{} 3", "m", {}, 3, std::nullopt},
        GoodCase{"BlanksInside",
                 "m{ a = \"x\" , b=\"\" }\t4",
                 "m",
                 {{"a", "x"}, {"b", ""}},
                 4,
                 std::nullopt},
        GoodCase{
            "EscapedQuote", R"(m{a="say \"hi\""} 1)", "m", {{"a", "say \"hi\""}}, 1, std::nullopt},
        GoodCase{"EscapedBackslash",
                 R"(m{path="C:\\dir"} 1)",
                 "m",
                 {{"path", "C:\\dir"}},
                 1,
                 std::nullopt},
        GoodCase{
            "EscapedNewline", R"(m{a="one\ntwo"} 1)", "m", {{"a", "one\ntwo"}}, 1, std::nullopt},
        GoodCase{"BraceAndCommaInValue", R"(m{a="}{,="} 1)", "m", {{"a", "}{,="}}, 1, std::nullopt},
        GoodCase{"Utf8Value", "m{a=\"h\xc3\xa9\"} 1", "m", {{"a", "h\xc3\xa9"}}, 1, std::nullopt},
        GoodCase{"PlusInf", "le{le=\"+Inf\"} +Inf", "le", {{"le", "+Inf"}}, kInf, std::nullopt},
        GoodCase{"MinusInf", "m -Inf", "m", {}, -kInf, std::nullopt},
        GoodCase{"BareInf", "m Inf", "m", {}, kInf, std::nullopt},
        GoodCase{"NaN", "m NaN", "m", {}, std::nan(""), std::nullopt},
        GoodCase{"Exponent", "m 1.5e-3", "m", {}, 1.5e-3, std::nullopt},
        GoodCase{"PlusSign", "m +7", "m", {}, 7, std::nullopt},
        GoodCase{"Negative", "m -0.25", "m", {}, -0.25, std::nullopt},
        GoodCase{"Timestamp", "m 1 1712345678901", "m", {}, 1, int64_t{1712345678901}},
        GoodCase{"NegativeTimestamp", "m 1 -5", "m", {}, 1, int64_t{-5}},
        GoodCase{"TrailingBlanks", "m 1 2  \t", "m", {}, 1, int64_t{2}},
        GoodCase{"LeadingBlanks", "  m 1", "m", {}, 1, std::nullopt},
        GoodCase{"CommentsAndBlankLines",
                 "# a comment\n\n   \n#\n# HELP m the help\n# TYPE m gauge\nm 1\n",
                 "m",
                 {},
                 1,
                 std::nullopt}),
    [](const ::testing::TestParamInfo<GoodCase>& p) { return p.param.name; });

struct BadCase {
  std::string name;
  std::string text;
  int line;            // the line the error names
  std::string reason;  // a part of the message
};

class ParseBadTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(ParseBadTest, RefusesWithTheLine) {
  const BadCase& c = GetParam();
  absl::StatusOr<PromText> t = ParsePrometheusText(c.text);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("line " + std::to_string(c.line) + ":"));
  EXPECT_THAT(t.status().message(), HasSubstr(c.reason));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ParseBadTest,
    ::testing::Values(BadCase{"NoValue", "ok 1\nm\n", 2, "missing value"},
                      BadCase{"NoValueAfterLabels", "m{a=\"b\"}", 1, "missing value"},
                      BadCase{"BadValue", "m one", 1, "not a number"},
                      BadCase{"ValueWithJunk", "m 1x", 1, "not a number"},
                      BadCase{"SpelledNanOnly", "m nan(1)", 1, "not a number"},
                      BadCase{"Overflow", "m 1e999", 1, "not a number"},
                      BadCase{"DoubleSign", "m +-1", 1, "not a number"},
                      BadCase{"BadTimestamp", "m 1 12.5", 1, "timestamp"},
                      BadCase{"TextAfterTimestamp", "m 1 2 3", 1, "after the timestamp"},
                      BadCase{"BadMetricName", "1m 1", 1, "metric name"},
                      BadCase{"NameThenJunk", "m-x 1", 1, "after the metric name"},
                      BadCase{"BadLabelName", "m{1a=\"x\"} 1", 1, "label name"},
                      BadCase{"ColonInLabelName", "m{a:b=\"x\"} 1", 1, "'='"},
                      BadCase{"UnquotedValue", "m{a=x} 1", 1, "open a label value"},
                      BadCase{"Unterminated", "m{a=\"x} 1", 1, "unterminated"},
                      BadCase{"UnclosedBrace", "m{a=\"x\" 1", 1, "',' or '}'"},
                      BadCase{"BadEscape", R"(m{a="\t"} 1)", 1, "invalid escape"},
                      BadCase{"RepeatedLabel", "m{a=\"1\",a=\"2\"} 1", 1, "repeated"},
                      BadCase{"UnknownType", "# TYPE m meter", 1, "not one of"},
                      BadCase{"TypeWithoutName", "# TYPE", 1, "metric name"},
                      BadCase{"TypeJunk", "# TYPE m gauge extra", 1, "after the TYPE"},
                      BadCase{"SecondType", "# TYPE m gauge\n# TYPE m counter", 2, "second TYPE"},
                      BadCase{"SecondHelp", "# HELP m a\nm 1\n# HELP m b", 3, "second HELP"},
                      BadCase{"BadHelpEscape", R"(# HELP m a \q b)", 1, "invalid escape"},
                      BadCase{"LaterLine", "a 1\nb 2\n\n# c\nd{x=\"\\\"} 4\n", 5, "unterminated"}),
    [](const ::testing::TestParamInfo<BadCase>& p) { return p.param.name; });

TEST(ParsePrometheusTextTest, KeepsHelpTypeAndOrder) {
  const std::string text =
      "# HELP kvtier_tenant_used_bytes Bytes in use.\\nSecond line, a \\\\ backslash.\n"
      "# TYPE kvtier_tenant_used_bytes gauge\n"
      "kvtier_tenant_used_bytes{tenant=\"a\"} 10\n"
      "kvtier_tenant_used_bytes{tenant=\"b\"} 20 1000\n"
      "# TYPE h histogram\n"
      "h_bucket{le=\"0.1\"} 1\n"
      "h_bucket{le=\"+Inf\"} 2\n"
      "h_sum 0.3\n"
      "h_count 2\n";
  absl::StatusOr<PromText> t = ParsePrometheusText(text);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->help.at("kvtier_tenant_used_bytes"), "Bytes in use.\nSecond line, a \\ backslash.");
  EXPECT_EQ(t->type.at("kvtier_tenant_used_bytes"), "gauge");
  EXPECT_EQ(t->type.at("h"), "histogram");
  ASSERT_EQ(t->samples.size(), 6u);
  EXPECT_EQ(t->samples[1].line, 4);
  const std::vector<const PromSample*> used = t->Find("kvtier_tenant_used_bytes");
  ASSERT_EQ(used.size(), 2u);
  EXPECT_EQ(*used[1]->Label("tenant"), "b");
  EXPECT_EQ(used[1]->Label("nope"), nullptr);
  EXPECT_EQ(used[1]->timestamp_ms, 1000);
  EXPECT_EQ(t->Find("h_bucket").size(), 2u);
  EXPECT_TRUE(t->Find("absent").empty());
}

TEST(ParsePrometheusTextTest, EmptyTextHasNoSamples) {
  absl::StatusOr<PromText> t = ParsePrometheusText("");
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE(t->samples.empty());
}

}  // namespace
}  // namespace kvtier::ctl
