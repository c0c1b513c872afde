// ParsePrometheusText: one pass over the lines with a cursor per line. Every error names the
// 1-based line number; nothing is returned from a text with a malformed line.
#include "tools/kvtierctl/prometheus.h"

#include <charconv>
#include <cmath>
#include <limits>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_format.h"
#include "core/status.h"

namespace kvtier::ctl {
namespace {

bool IsBlank(char c) { return c == ' ' || c == '\t'; }
bool IsNameStart(char c, bool colon) {
  return absl::ascii_isalpha(static_cast<unsigned char>(c)) || c == '_' || (colon && c == ':');
}
bool IsNameChar(char c, bool colon) {
  return IsNameStart(c, colon) || absl::ascii_isdigit(static_cast<unsigned char>(c));
}

// A position in one line, and the errors that name it.
class Cursor {
 public:
  Cursor(std::string_view line, int number) : line_(line), number_(number) {}

  bool done() const { return pos_ >= line_.size(); }
  char peek() const { return done() ? '\0' : line_[pos_]; }
  void Advance() { ++pos_; }
  // Skips blanks; whether there were any.
  bool SkipBlanks() {
    const size_t start = pos_;
    while (!done() && IsBlank(line_[pos_])) ++pos_;
    return pos_ > start;
  }
  // The characters up to the next blank or the end.
  std::string_view Token() {
    const size_t start = pos_;
    while (!done() && !IsBlank(line_[pos_])) ++pos_;
    return line_.substr(start, pos_ - start);
  }
  std::string_view Rest() {
    std::string_view rest = line_.substr(std::min(pos_, line_.size()));
    pos_ = line_.size();
    return rest;
  }
  // A metric name ([a-zA-Z_:][a-zA-Z0-9_:]*) or a label name (no colons).
  absl::StatusOr<std::string> Name(bool colon, std::string_view what) {
    const size_t start = pos_;
    if (!IsNameStart(peek(), colon)) return Error(absl::StrFormat("expected a %s", what));
    while (!done() && IsNameChar(line_[pos_], colon)) ++pos_;
    return std::string(line_.substr(start, pos_ - start));
  }
  absl::Status Error(std::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrFormat("line %d: %s (at column %d): %s", number_, what, pos_ + 1, line_));
  }

 private:
  std::string_view line_;
  int number_;
  size_t pos_ = 0;
};

// A label value after its opening quote, through the closing one.
absl::StatusOr<std::string> QuotedValue(Cursor& c) {
  std::string out;
  for (;;) {
    if (c.done()) return c.Error("unterminated label value");
    const char ch = c.peek();
    c.Advance();
    if (ch == '"') return out;
    if (ch != '\\') {
      out.push_back(ch);
      continue;
    }
    const char escaped = c.peek();
    if (escaped == '\\' || escaped == '"') {
      out.push_back(escaped);
    } else if (escaped == 'n') {
      out.push_back('\n');
    } else {
      return c.Error("invalid escape in a label value (only \\\\, \\\" and \\n)");
    }
    c.Advance();
  }
}

// `{name="value", ...}` after the opening brace, through the closing one.
absl::Status Labels(Cursor& c, PromSample& sample) {
  std::set<std::string> seen;
  for (;;) {
    c.SkipBlanks();
    if (c.peek() == '}') break;
    KVTIER_ASSIGN_OR_RETURN(std::string name, c.Name(false, "label name"));
    c.SkipBlanks();
    if (c.peek() != '=') return c.Error("expected '=' after a label name");
    c.Advance();
    c.SkipBlanks();
    if (c.peek() != '"') return c.Error("expected '\"' to open a label value");
    c.Advance();
    KVTIER_ASSIGN_OR_RETURN(std::string value, QuotedValue(c));
    if (!seen.insert(name).second) return c.Error(absl::StrFormat("label %s repeated", name));
    sample.labels.emplace_back(std::move(name), std::move(value));
    c.SkipBlanks();
    if (c.peek() == ',') {
      c.Advance();
      continue;
    }
    if (c.peek() != '}') return c.Error("expected ',' or '}' after a label value");
  }
  c.Advance();
  return absl::OkStatus();
}

// A value as Go's strconv.ParseFloat reads it (the forms exporters write).
std::optional<double> ParseValue(std::string_view token) {
  const std::string lower = absl::AsciiStrToLower(std::string(token));
  if (lower == "+inf" || lower == "inf" || lower == "+infinity" || lower == "infinity") {
    return std::numeric_limits<double>::infinity();
  }
  if (lower == "-inf" || lower == "-infinity") return -std::numeric_limits<double>::infinity();
  if (lower == "nan") return std::numeric_limits<double>::quiet_NaN();
  std::string_view digits = token;
  if (!digits.empty() && digits[0] == '+') {
    digits.remove_prefix(1);
    if (digits.empty() || digits[0] == '+' || digits[0] == '-') return std::nullopt;
  }
  double value = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (ec != std::errc() || end != digits.data() + digits.size() || std::isnan(value) ||
      std::isinf(value)) {
    return std::nullopt;  // nan and inf only as spelled above
  }
  return value;
}

absl::StatusOr<PromSample> SampleLine(Cursor& c, int number) {
  PromSample sample;
  sample.line = number;
  KVTIER_ASSIGN_OR_RETURN(sample.name, c.Name(true, "metric name"));
  const bool blank = c.SkipBlanks();
  if (c.done()) return c.Error("missing value");
  if (c.peek() == '{') {
    c.Advance();
    KVTIER_RETURN_IF_ERROR(Labels(c, sample));
    c.SkipBlanks();
  } else if (!blank) {
    return c.Error("expected '{' or a blank after the metric name");
  }
  if (c.done()) return c.Error("missing value");
  const std::string_view value = c.Token();
  const std::optional<double> parsed = ParseValue(value);
  if (!parsed.has_value()) return c.Error(absl::StrFormat("value '%s' is not a number", value));
  sample.value = *parsed;
  c.SkipBlanks();
  if (c.done()) return sample;
  const std::string_view ts = c.Token();
  int64_t timestamp = 0;
  const auto [end, ec] = std::from_chars(ts.data(), ts.data() + ts.size(), timestamp);
  if (ec != std::errc() || end != ts.data() + ts.size()) {
    return c.Error(absl::StrFormat("timestamp '%s' is not an integer (milliseconds)", ts));
  }
  sample.timestamp_ms = timestamp;
  c.SkipBlanks();
  if (!c.done()) return c.Error("unexpected text after the timestamp");
  return sample;
}

// A HELP docstring: \\ and \n are the only escapes.
absl::StatusOr<std::string> Docstring(Cursor& c) {
  std::string out;
  const std::string_view rest = c.Rest();
  for (size_t i = 0; i < rest.size(); ++i) {
    if (rest[i] != '\\') {
      out.push_back(rest[i]);
      continue;
    }
    if (i + 1 < rest.size() && rest[i + 1] == '\\') {
      out.push_back('\\');
    } else if (i + 1 < rest.size() && rest[i + 1] == 'n') {
      out.push_back('\n');
    } else {
      return c.Error("invalid escape in HELP text (only \\\\ and \\n)");
    }
    ++i;
  }
  return out;
}

// A comment line after its '#': HELP and TYPE are read, anything else is skipped.
absl::Status CommentLine(Cursor& c, PromText& out) {
  c.SkipBlanks();
  const std::string_view keyword = c.Token();
  if (keyword != "HELP" && keyword != "TYPE") return absl::OkStatus();
  if (!c.SkipBlanks()) return c.Error(absl::StrFormat("expected a metric name after %s", keyword));
  KVTIER_ASSIGN_OR_RETURN(std::string name, c.Name(true, "metric name"));
  const bool blank = c.SkipBlanks();
  if (!c.done() && !blank) return c.Error("expected a blank after the metric name");
  if (keyword == "HELP") {
    KVTIER_ASSIGN_OR_RETURN(std::string doc, Docstring(c));
    if (!out.help.emplace(name, std::move(doc)).second) {
      return c.Error(absl::StrFormat("second HELP line for %s", name));
    }
    return absl::OkStatus();
  }
  const std::string type(c.Token());
  static const std::set<std::string> kTypes = {"counter", "gauge", "histogram", "summary",
                                               "untyped"};
  if (kTypes.count(type) == 0) {
    return c.Error(absl::StrFormat(
        "TYPE '%s' is not one of counter, gauge, histogram, summary, untyped", type));
  }
  c.SkipBlanks();
  if (!c.done()) return c.Error("unexpected text after the TYPE");
  if (!out.type.emplace(name, type).second) {
    return c.Error(absl::StrFormat("second TYPE line for %s", name));
  }
  return absl::OkStatus();
}

}  // namespace

const std::string* PromSample::Label(std::string_view label) const {
  for (const auto& [k, v] : labels) {
    if (k == label) return &v;
  }
  return nullptr;
}

std::vector<const PromSample*> PromText::Find(std::string_view name) const {
  std::vector<const PromSample*> out;
  for (const PromSample& s : samples) {
    if (s.name == name) out.push_back(&s);
  }
  return out;
}

absl::StatusOr<PromText> ParsePrometheusText(std::string_view text) {
  PromText out;
  int number = 0;
  while (!text.empty()) {
    const size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text.remove_prefix(nl == std::string_view::npos ? text.size() : nl + 1);
    ++number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    Cursor c(line, number);
    c.SkipBlanks();
    if (c.done()) continue;
    if (c.peek() == '#') {
      c.Advance();
      KVTIER_RETURN_IF_ERROR(CommentLine(c, out));
      continue;
    }
    KVTIER_ASSIGN_OR_RETURN(PromSample sample, SampleLine(c, number));
    out.samples.push_back(std::move(sample));
  }
  return out;
}

}  // namespace kvtier::ctl
