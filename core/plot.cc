#include "core/plot.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/plot_canvas.h"
#include "core/status.h"

namespace kvtier {
namespace {

using plot_internal::Canvas;
using plot_internal::kBorder;
using plot_internal::kGrid;
using plot_internal::kInk;
using plot_internal::kWhite;
using plot_internal::Rect;
using plot_internal::TextWidth;

// Short "%g"-like text: at most 4 significant digits, exponents without '+' and padding.
std::string FormatNumber(double v) {
  std::string s = absl::StrFormat("%.4g", v);
  const size_t e = s.find('e');
  if (e == std::string::npos) return s;
  std::string exp = s.substr(e + 1);
  const bool neg = exp[0] == '-';
  exp = exp.substr(exp[0] == '-' || exp[0] == '+' ? 1 : 0);
  while (exp.size() > 1 && exp[0] == '0') exp.erase(0, 1);
  return absl::StrCat(s.substr(0, e), "e", neg ? "-" : "", exp);
}

// One axis, in transformed units (log10 of the value on a log axis).
struct Axis {
  bool log = false;
  bool exp_labels = false;  // log axis: "1e5" labels rather than "100000"
  double lo = 0, hi = 1;
  std::vector<double> ticks, minor;

  bool Valid(double v) const { return std::isfinite(v) && (!log || v > 0); }
  double T(double v) const { return log ? std::log10(v) : v; }
  std::string Label(double t) const {
    if (!log) return FormatNumber(t);
    const long k = std::lround(t);
    return exp_labels ? absl::StrCat("1e", k) : FormatNumber(std::pow(10.0, k));
  }
};

// A linear axis spans the data plus 4% on each side, with ticks at the multiples of
// 1/2/5 × 10^k in it (about five); a log axis spans whole decades, with a tick at each
// decade (or every k-th, for at most nine ticks) and minor ticks at 2..9 × 10^k.
absl::StatusOr<Axis> MakeAxis(bool log, double mn, double mx) {
  Axis a;
  a.log = log;
  if (log) {
    if (mn == mx) {
      mn -= 1;
      mx += 1;
    }
    const double lo = std::floor(mn), hi = std::ceil(mx);
    const double k = std::max(1.0, std::ceil((hi - lo) / 8));
    a.lo = lo;
    a.hi = lo + k * std::ceil((hi - lo) / k);
    for (double t = a.lo; t <= a.hi + 0.5; t += k) a.ticks.push_back(t);
    a.exp_labels = a.lo < -3 || a.hi > 4;
    if (k == 1 && a.hi - a.lo <= 6) {
      for (double d = a.lo; d < a.hi; ++d) {
        for (int m = 2; m <= 9; ++m) a.minor.push_back(d + std::log10(m));
      }
    }
    return a;
  }
  if (mn == mx) {
    const double pad = mn == 0 ? 1 : std::abs(mn) * 0.1;
    mn -= pad;
    mx += pad;
  }
  const double range = mx - mn;
  if (!std::isfinite(range)) return absl::InvalidArgumentError("plot: value range too large");
  a.lo = mn - 0.04 * range;
  a.hi = mx + 0.04 * range;
  const double raw = range / 5, mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag, step = (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * mag;
  for (double i = std::ceil(a.lo / step - 1e-9); i * step <= a.hi && a.ticks.size() < 20; ++i) {
    a.ticks.push_back(std::abs(i * step) < step * 1e-9 ? 0.0 : i * step);
  }
  if (a.ticks.empty()) a.ticks.push_back((a.lo + a.hi) / 2);  // a range near rounding error
  return a;
}

}  // namespace

absl::StatusOr<std::string> RenderLinePlotPng(const PlotOptions& o,
                                              const std::vector<PlotSeries>& series) {
  KVTIER_RETURN_IF_ERROR(plot_internal::CheckImageSize("plot", o.width, o.height));
  double xmn = std::numeric_limits<double>::infinity(), xmx = -xmn, ymn = xmn, ymx = -xmn;
  Axis ax, ay;
  ax.log = o.log_x;
  ay.log = o.log_y;
  for (const PlotSeries& s : series) {
    if (s.x.size() != s.y.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "plot: series '%s' has %d x and %d y values", s.name, s.x.size(), s.y.size()));
    }
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!ax.Valid(s.x[i]) || !ay.Valid(s.y[i])) continue;
      xmn = std::min(xmn, ax.T(s.x[i]));
      xmx = std::max(xmx, ax.T(s.x[i]));
      ymn = std::min(ymn, ay.T(s.y[i]));
      ymx = std::max(ymx, ay.T(s.y[i]));
    }
  }
  if (!(xmn <= xmx)) return absl::InvalidArgumentError("plot: no drawable point in any series");
  KVTIER_ASSIGN_OR_RETURN(ax, MakeAxis(o.log_x, xmn, xmx));
  KVTIER_ASSIGN_OR_RETURN(ay, MakeAxis(o.log_y, ymn, ymx));

  // Layout, in units of the text scale s (font pixels of the tick labels).
  const int w = o.width, h = o.height, s = std::max(1, std::min(w, h) / 500), ch = 8 * s;
  int ylab_w = 0;
  for (double t : ay.ticks) ylab_w = std::max(ylab_w, TextWidth(ay.Label(t), s));
  const int max_name = std::max(4, (w * 3 / 10 - 40 * s) / (6 * s));
  std::vector<std::string> names;
  int name_w = 0;
  for (const PlotSeries& ser : series) {
    names.push_back(ser.name.size() > static_cast<size_t>(max_name)
                        ? ser.name.substr(0, max_name - 2) + ".."
                        : ser.name);
    name_w = std::max(name_w, TextWidth(names.back(), s));
  }
  const bool legend = name_w > 0;
  const int legend_w = 8 * s + 22 * s + 6 * s + name_w + 8 * s;
  const std::string last_x = ax.Label(ax.ticks.back());
  const int right = legend ? legend_w + 20 * s : std::max(16 * s, TextWidth(last_x, s) / 2 + 6 * s);
  const int top = 10 * s + (o.title.empty() ? 0 : 16 * s + 10 * s);
  const int left = 10 * s + (o.y_label.empty() ? 0 : ch + 10 * s) + ylab_w + 10 * s;
  const int bottom = 10 * s + ch + (o.x_label.empty() ? 0 : 10 * s + ch) + 10 * s;
  const Rect plot{left, top, std::max(left + 10, w - right), std::max(top + 10, h - bottom)};
  const double pw = plot.x1 - plot.x0, ph = plot.y1 - plot.y0;
  auto px = [&](double t) { return plot.x0 + (t - ax.lo) / (ax.hi - ax.lo) * pw; };
  auto py = [&](double t) { return plot.y1 - (t - ay.lo) / (ay.hi - ay.lo) * ph; };

  Canvas c(w, h);
  const int tick = 5 * s;
  // Grid, minor ticks, ticks and their labels.
  for (double t : ax.ticks) {
    const int x = static_cast<int>(std::lround(px(t)));
    c.Fill({x, plot.y0, x, plot.y1}, kGrid);
    c.Fill({x, plot.y1, x + s - 1, plot.y1 + tick}, kInk);
    const std::string l = ax.Label(t);
    c.Text(x - TextWidth(l, s) / 2, plot.y1 + tick + 4 * s, l, s, kInk);
  }
  for (double t : ay.ticks) {
    const int y = static_cast<int>(std::lround(py(t)));
    c.Fill({plot.x0, y, plot.x1, y}, kGrid);
    c.Fill({plot.x0 - tick, y, plot.x0, y + s - 1}, kInk);
    const std::string l = ay.Label(t);
    c.Text(plot.x0 - tick - 4 * s - TextWidth(l, s), y - ch / 2, l, s, kInk);
  }
  for (double t : ax.minor) {
    const int x = static_cast<int>(std::lround(px(t)));
    c.Fill({x, plot.y1, x, plot.y1 + tick / 2}, kInk);
  }
  for (double t : ay.minor) {
    const int y = static_cast<int>(std::lround(py(t)));
    c.Fill({plot.x0 - tick / 2, y, plot.x0, y}, kInk);
  }
  c.Frame(plot, s, kInk);

  // Title, centred on the image; axis labels, centred on the plot area.
  if (!o.title.empty()) {
    c.Text(std::max(4 * s, (w - TextWidth(o.title, 2 * s)) / 2), 10 * s, o.title, 2 * s, kInk);
  }
  if (!o.x_label.empty()) {
    const int x = plot.x0 + (plot.x1 - plot.x0 - TextWidth(o.x_label, s)) / 2;
    c.Text(std::max(0, x), plot.y1 + tick + 4 * s + ch + 10 * s, o.x_label, s, kInk);
  }
  if (!o.y_label.empty()) {
    const int y = plot.y1 - (plot.y1 - plot.y0 - TextWidth(o.y_label, s)) / 2;
    c.Text(10 * s, std::min(h - 1, y), o.y_label, s, kInk, /*vertical=*/true);
  }

  // The series: lines, then markers, clipped to the plot area (plus a marker's radius).
  const int thick = 2 * s, radius = 2 * s + 1;
  const double dash = 9.0 * s;
  c.SetClip({plot.x0 - radius, plot.y0 - radius, plot.x1 + radius, plot.y1 + radius});
  for (size_t k = 0; k < series.size(); ++k) {
    const PlotSeries& ser = series[k];
    const PlotColor col = kPlotPalette[k % kPlotPalette.size()];
    double phase = 0, lx = 0, ly = 0;
    bool have_last = false;
    for (size_t i = 0; i < ser.x.size(); ++i) {
      if (!ax.Valid(ser.x[i]) || !ay.Valid(ser.y[i])) {
        have_last = false;
        continue;
      }
      const double x = px(ax.T(ser.x[i])), y = py(ay.T(ser.y[i]));
      if (have_last) c.Line(lx, ly, x, y, thick, col, ser.dashed ? dash : 0, &phase);
      c.Disc(x, y, radius, col);
      lx = x, ly = y, have_last = true;
    }
  }
  c.ResetClip();

  // The legend, right of the plot area: a line and a marker in the series' colour, its name.
  if (legend) {
    const int row = ch + 7 * s;
    const Rect box{plot.x1 + 12 * s, plot.y0, plot.x1 + 12 * s + legend_w,
                   plot.y0 + 8 * s + static_cast<int>(series.size()) * row};
    c.Fill(box, kWhite);
    c.Frame(box, s, kBorder);
    for (size_t k = 0; k < series.size(); ++k) {
      const PlotColor col = kPlotPalette[k % kPlotPalette.size()];
      const int y = box.y0 + 4 * s + static_cast<int>(k) * row + row / 2;
      const int x0 = box.x0 + 8 * s, x1 = x0 + 22 * s;
      double phase = 0;
      c.Line(x0, y, x1, y, thick, col, series[k].dashed ? dash * 0.6 : 0, &phase);
      c.Disc((x0 + x1) / 2.0, y, radius, col);
      c.Text(x1 + 6 * s, y - ch / 2, names[k], s, kInk);
    }
  }
  return c.EncodePng();
}

absl::Status WriteLinePlot(const std::string& path, const PlotOptions& o,
                           const std::vector<PlotSeries>& series) {
  KVTIER_ASSIGN_OR_RETURN(const std::string png, RenderLinePlotPng(o, series));
  return plot_internal::WriteFileAtomically(path, png);
}

}  // namespace kvtier
