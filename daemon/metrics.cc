#include "daemon/metrics.h"

#include <algorithm>
#include <cmath>
#include <iterator>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvtier::daemon {

std::string FormatMetricValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::trunc(v) && std::fabs(v) < 9.007199254740992e15) {
    return absl::StrCat(static_cast<int64_t>(v));
  }
  // The shortest of %.15g, %.16g and %.17g that reads back as v (0.0025, not
  // 0.0025000000000000001).
  for (int digits = 15; digits < 17; ++digits) {
    std::string s = absl::StrFormat("%.*g", digits, v);
    double back = 0;
    if (absl::SimpleAtod(s, &back) && back == v) return s;
  }
  return absl::StrFormat("%.17g", v);
}

namespace {

constexpr std::string_view kReplacementCharacter = "\xef\xbf\xbd";  // U+FFFD in UTF-8

// The length of the well-formed UTF-8 sequence that `s` (not empty) starts with, 1 to 4; 0
// when it starts with none: a stray continuation byte, an overlong form, a surrogate, a code
// point past U+10FFFF, or a sequence cut short (the Unicode standard's table 3-7).
size_t Utf8SequenceLength(std::string_view s) {
  const auto b0 = static_cast<unsigned char>(s[0]);
  if (b0 < 0x80) return 1;
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xbf;  // the range of the second byte
  if (b0 >= 0xc2 && b0 <= 0xdf) {
    n = 2;
  } else if (b0 >= 0xe0 && b0 <= 0xef) {
    n = 3;
    if (b0 == 0xe0) lo = 0xa0;  // no overlong forms
    if (b0 == 0xed) hi = 0x9f;  // no surrogates
  } else if (b0 >= 0xf0 && b0 <= 0xf4) {
    n = 4;
    if (b0 == 0xf0) lo = 0x90;  // no overlong forms
    if (b0 == 0xf4) hi = 0x8f;  // nothing past U+10FFFF
  } else {
    return 0;
  }
  if (s.size() < n) return 0;
  const auto b1 = static_cast<unsigned char>(s[1]);
  if (b1 < lo || b1 > hi) return 0;
  for (size_t i = 2; i < n; ++i) {
    if ((static_cast<unsigned char>(s[i]) & 0xc0) != 0x80) return 0;
  }
  return n;
}

// `v` with `\` and newline escaped, and `"` too when `quote`, onto `out`; each byte that is
// not part of well-formed UTF-8 becomes U+FFFD, so the text stays valid whatever `v` holds.
void AppendEscaped(std::string_view v, bool quote, std::string& out) {
  for (size_t i = 0; i < v.size();) {
    const size_t n = Utf8SequenceLength(v.substr(i));
    if (n == 0) {
      out += kReplacementCharacter;
      ++i;
      continue;
    }
    const char c = v[i];
    if (n > 1) {
      out += v.substr(i, n);
    } else if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '"' && quote) {
      out += "\\\"";
    } else {
      out += c;
    }
    i += n;
  }
}

}  // namespace

std::string EscapeLabelValue(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  AppendEscaped(v, /*quote=*/true, out);
  return out;
}

void Exposition::Family(std::string_view name, std::string_view type, std::string_view help) {
  // HELP text escapes only \ and newline.
  ((text_ += "# HELP ") += name) += ' ';
  AppendEscaped(help, /*quote=*/false, text_);
  text_ += '\n';
  ((((text_ += "# TYPE ") += name) += ' ') += type) += '\n';
}

void Exposition::Line(std::string_view name, std::span<const Label> labels, std::string_view le,
                      double value) {
  text_ += name;
  if (!labels.empty() || !le.empty()) {
    text_ += '{';
    bool first = true;
    for (const Label& l : labels) {
      if (!first) text_ += ',';
      (text_ += l.name) += "=\"";
      AppendEscaped(l.value, /*quote=*/true, text_);
      text_ += '"';
      first = false;
    }
    if (!le.empty()) (((text_ += first ? "" : ",") += "le=\"") += le) += '"';
    text_ += '}';
  }
  absl::StrAppend(&text_, " ", FormatMetricValue(value), "\n");
}

void Exposition::Sample(std::string_view name, std::span<const Label> labels, double value) {
  Line(name, labels, "", value);
}

void Exposition::Histogram(std::string_view family, std::span<const Label> labels,
                           std::span<const double> bounds, std::span<const uint64_t> per_bucket,
                           double sum) {
  const std::string bucket = std::string(family) + "_bucket";
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds.size(); ++i) {
    cumulative += i < per_bucket.size() ? per_bucket[i] : 0;
    Line(bucket, labels, i < bounds.size() ? FormatMetricValue(bounds[i]) : "+Inf",
         static_cast<double>(cumulative));
  }
  Line(std::string(family) + "_sum", labels, "", sum);
  Line(std::string(family) + "_count", labels, "", static_cast<double>(cumulative));
}

void Counters::Add(std::vector<std::string> key, uint64_t n) {
  MutexLock lock(&mu_);
  counts_[std::move(key)] += n;
}

std::map<std::vector<std::string>, uint64_t> Counters::Snapshot() const {
  MutexLock lock(&mu_);
  return counts_;
}

void RpcMetrics::End(std::string_view method, std::string_view code, double seconds) {
  in_flight_.fetch_sub(1, std::memory_order_relaxed);
  if (!(seconds >= 0)) seconds = 0;
  const auto* it =
      std::lower_bound(std::begin(kRpcBucketsSeconds), std::end(kRpcBucketsSeconds), seconds);
  MutexLock lock(&mu_);
  auto m = methods_.find(method);
  if (m == methods_.end()) m = methods_.emplace(std::string(method), Method{}).first;
  auto c = m->second.codes.find(code);
  if (c == m->second.codes.end()) c = m->second.codes.emplace(std::string(code), 0).first;
  ++c->second;
  ++m->second.buckets[static_cast<size_t>(it - std::begin(kRpcBucketsSeconds))];
  m->second.sum += seconds;
}

void RpcMetrics::Write(Exposition& out) const {
  std::map<std::string, Method, std::less<>> methods;
  {
    MutexLock lock(&mu_);
    methods = methods_;
  }
  out.Family("kvtier_rpcs_total", "counter",
             "gRPC calls finished, by full method name and status code.");
  for (const auto& [name, m] : methods) {
    for (const auto& [code, n] : m.codes) {
      out.Sample("kvtier_rpcs_total", {{"method", name}, {"code", code}}, static_cast<double>(n));
    }
  }
  out.Family("kvtier_rpc_duration_seconds", "histogram",
             "Wall time of gRPC calls, from the call's start to its status, by method.");
  for (const auto& [name, m] : methods) {
    const Label labels[] = {{"method", name}};
    out.Histogram("kvtier_rpc_duration_seconds", labels, kRpcBucketsSeconds, m.buckets, m.sum);
  }
  out.Family("kvtier_rpcs_in_flight", "gauge", "gRPC calls in progress.");
  out.Sample("kvtier_rpcs_in_flight", {},
             static_cast<double>(std::max<int64_t>(0, in_flight_.load(std::memory_order_relaxed))));
}

}  // namespace kvtier::daemon
