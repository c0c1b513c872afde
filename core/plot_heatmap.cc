// The heatmap of plot.h. Layout, outside in: title band on top; y label, row labels, grid,
// colour bar and its labels left to right; column labels and x label below the grid. The
// grid's column (row) c spans pixels [xs[c], xs[c+1]) of its width (height), so cells differ
// by at most one pixel; a cell keeps a white gap of one text pixel on its right and bottom
// when it is big enough to spare one.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "core/plot.h"
#include "core/plot_canvas.h"
#include "core/status.h"

namespace kvtier {
namespace {

using plot_internal::Canvas;
using plot_internal::kBorder;
using plot_internal::kInk;
using plot_internal::kWhite;
using plot_internal::Rect;
using plot_internal::TextWidth;

// ColorBrewer RdYlGn, 11 classes: dark red through light yellow to dark green, interpolated
// linearly between neighbours.
constexpr std::array<PlotColor, 11> kScale = {
    PlotColor{165, 0, 38}, {215, 48, 39},   {244, 109, 67},  {253, 174, 97},
    {254, 224, 139},       {255, 255, 191}, {217, 239, 139}, {166, 217, 106},
    {102, 189, 99},        {26, 152, 80},   {0, 104, 55},
};
constexpr PlotColor kNanGrey{200, 200, 200};

// The scale's colour at t in [0, 1] (0: lo, 1: hi).
PlotColor ScaleAt(double t) {
  const double pos = std::clamp(t, 0.0, 1.0) * (kScale.size() - 1);
  const size_t i = std::min(kScale.size() - 2, static_cast<size_t>(pos));
  const double f = pos - static_cast<double>(i);
  auto mix = [f](uint8_t a, uint8_t b) {
    return static_cast<uint8_t>(std::lround(a + f * (static_cast<int>(b) - a)));
  };
  return {mix(kScale[i].r, kScale[i + 1].r), mix(kScale[i].g, kScale[i + 1].g),
          mix(kScale[i].b, kScale[i + 1].b)};
}

// Where v falls on [lo, hi], clamped to [0, 1] (infinities too). Halved operands keep
// hi - lo finite for any finite lo and hi.
double ScalePos(double v, double lo, double hi) {
  return std::clamp((v / 2 - lo / 2) / (hi / 2 - lo / 2), 0.0, 1.0);
}

// WCAG relative luminance of an sRGB colour.
double Luminance(PlotColor c) {
  auto lin = [](uint8_t v) {
    const double x = v / 255.0;
    return x <= 0.04045 ? x / 12.92 : std::pow((x + 0.055) / 1.055, 2.4);
  };
  return 0.2126 * lin(c.r) + 0.7152 * lin(c.g) + 0.0722 * lin(c.b);
}

// Text colour on a cell of colour `bg`: kInk or white, whichever has the higher contrast.
PlotColor TextOn(PlotColor bg) {
  const double l = Luminance(bg);
  return (l + 0.05) / (Luminance(kInk) + 0.05) >= 1.05 / (l + 0.05) ? kInk : kWhite;
}

// v with `decimals` digits after the point; a zero never shows a minus sign.
std::string FormatFixed(double v, int decimals) {
  std::string s = absl::StrFormat("%.*f", decimals, v);
  if (s[0] == '-' && s.find_first_not_of("0.", 1) == std::string::npos) s.erase(0, 1);
  return s;
}

std::string Truncate(const std::string& s, int max_chars) {
  return s.size() > static_cast<size_t>(max_chars) ? s.substr(0, max_chars - 2) + ".." : s;
}

absl::Status Validate(const HeatmapOptions& o, const std::vector<std::string>& row_labels,
                      const std::vector<std::string>& col_labels,
                      const std::vector<std::vector<double>>& values) {
  KVTIER_RETURN_IF_ERROR(plot_internal::CheckImageSize("heatmap", o.width, o.height));
  if (o.decimals < 0 || o.decimals > 10) {
    return absl::InvalidArgumentError(
        absl::StrFormat("heatmap: decimals %d outside [0, 10]", o.decimals));
  }
  if (!std::isfinite(o.lo) || !std::isfinite(o.hi) || o.lo >= o.hi) {
    return absl::InvalidArgumentError(
        absl::StrFormat("heatmap: scale [%g, %g] is not a finite lo < hi", o.lo, o.hi));
  }
  if (values.empty() || values[0].empty()) {
    return absl::InvalidArgumentError("heatmap: no rows or no columns");
  }
  for (size_t r = 1; r < values.size(); ++r) {
    if (values[r].size() != values[0].size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "heatmap: row %d has %d values, row 0 has %d", r, values[r].size(), values[0].size()));
    }
  }
  if (row_labels.size() != values.size() || col_labels.size() != values[0].size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("heatmap: %d row and %d column labels for a %dx%d grid", row_labels.size(),
                        col_labels.size(), values.size(), values[0].size()));
  }
  return absl::OkStatus();
}

// Where everything goes. s is the text scale (font pixels of labels), ch a text line's height.
struct Layout {
  int s = 1, ch = 8;
  Rect grid{}, bar{};
  std::vector<int> xs, ys;              // column and row boundaries, size cols+1 and rows+1
  int gap = 0;                          // white pixels right of and below each cell
  std::vector<std::string> rows, cols;  // the labels, truncated
  bool vertical_cols = false;           // column labels read bottom to top
  int row_step = 1, col_step = 1;       // label every k-th row / column
  int cell_scale = 1;                   // text scale of the cell labels
};

// Boundaries of n equal parts of [a, a + len): part i spans [out[i], out[i+1]).
std::vector<int> Split(int a, int len, size_t n) {
  std::vector<int> out(n + 1);
  for (size_t i = 0; i <= n; ++i) {
    out[i] = a + static_cast<int>(static_cast<int64_t>(len) * static_cast<int64_t>(i) /
                                  static_cast<int64_t>(n));
  }
  return out;
}

int MaxWidth(const std::vector<std::string>& v, int scale) {
  int w = 0;
  for (const std::string& t : v) w = std::max(w, TextWidth(t, scale));
  return w;
}

// The text scale of the cell labels: twice the labels' when the widest cell label fits every
// cell at that size with room to spare, else the labels'.
int CellLabelScale(const HeatmapOptions& o, const std::vector<std::vector<double>>& values, int s,
                   double cell_w, double cell_h) {
  int value_w = 0;
  for (const std::vector<double>& row : values) {
    for (double v : row) {
      if (!std::isnan(v)) value_w = std::max(value_w, TextWidth(FormatFixed(v, o.decimals), s));
    }
  }
  return 2 * value_w + 12 * s <= cell_w && 14 * s + 12 * s <= cell_h ? 2 * s : s;
}

Layout MakeLayout(const HeatmapOptions& o, const std::vector<std::string>& row_labels,
                  const std::vector<std::string>& col_labels,
                  const std::vector<std::vector<double>>& values) {
  Layout l;
  const int w = o.width, h = o.height, s = std::max(1, std::min(w, h) / 500);
  l.s = s;
  l.ch = 8 * s;
  // Row labels take at most a quarter of the width, column labels a fifth of the height.
  for (const std::string& r : row_labels) {
    l.rows.push_back(Truncate(r, std::max(4, w / 4 / (6 * s))));
  }
  for (const std::string& c : col_labels) {
    l.cols.push_back(Truncate(c, std::max(4, h / 5 / (6 * s))));
  }
  const int row_w = MaxWidth(l.rows, s), col_w = MaxWidth(l.cols, s);
  const int bar_label_w = std::max(TextWidth(FormatFixed(o.lo, o.decimals), s),
                                   TextWidth(FormatFixed(o.hi, o.decimals), s));
  const int left = 10 * s + (o.y_label.empty() ? 0 : l.ch + 10 * s) + row_w + (row_w ? 6 * s : 0);
  const int right = 16 * s + 16 * s + 8 * s + bar_label_w + 10 * s;
  const int top = 10 * s + (o.title.empty() ? 0 : 16 * s + 10 * s);
  const size_t nr = values.size(), nc = values[0].size();

  const int gw = std::max(10, w - left - right);
  l.xs = Split(left, gw, nc);
  const double cell_w = static_cast<double>(gw) / nc;
  l.vertical_cols = col_w > cell_w - 2 * s;
  if (l.vertical_cols) l.col_step = static_cast<int>(std::ceil(l.ch / cell_w));
  const int col_h = l.vertical_cols ? col_w : (col_w > 0 ? l.ch : 0);
  const int bottom = 6 * s + col_h + (o.x_label.empty() ? 0 : 10 * s + l.ch) + 10 * s;
  const int gh = std::max(10, h - top - bottom);
  l.ys = Split(top, gh, nr);
  const double cell_h = static_cast<double>(gh) / nr;
  l.row_step = static_cast<int>(std::ceil(l.ch / cell_h));
  l.grid = {left, top, left + gw - 1, top + gh - 1};
  l.gap = std::min(cell_w, cell_h) >= 6 * s ? s : 0;
  l.bar = {l.grid.x1 + 16 * s, top, l.grid.x1 + 32 * s - 1, l.grid.y1 - l.gap};

  l.cell_scale = CellLabelScale(o, values, s, cell_w, cell_h);
  return l;
}

// The cells, and their labels where they fit.
void DrawCells(Canvas& c, const Layout& l, const HeatmapOptions& o,
               const std::vector<std::vector<double>>& values) {
  for (size_t r = 0; r < values.size(); ++r) {
    for (size_t k = 0; k < values[r].size(); ++k) {
      const double v = values[r][k];
      const Rect cell{l.xs[k], l.ys[r], l.xs[k + 1] - 1 - l.gap, l.ys[r + 1] - 1 - l.gap};
      const PlotColor bg = std::isnan(v) ? kNanGrey : ScaleAt(ScalePos(v, o.lo, o.hi));
      c.Fill(cell, bg);
      if (!o.annotate || std::isnan(v)) continue;
      const std::string text = FormatFixed(v, o.decimals);
      const int ts = l.cell_scale, tw = TextWidth(text, ts), th = 7 * ts;
      const int cw = cell.x1 - cell.x0 + 1, chh = cell.y1 - cell.y0 + 1;
      if (tw + 2 * l.s > cw || th + 2 * l.s > chh) continue;  // too small for its label
      c.Text(cell.x0 + (cw - tw) / 2, cell.y0 + (chh - th) / 2, text, ts, TextOn(bg));
    }
  }
}

// Row labels right-aligned left of the grid; column labels centred below it, or vertical and
// ending just below it; the axis labels outside them; the title centred on the image.
void DrawLabels(Canvas& c, const Layout& l, const HeatmapOptions& o) {
  const int s = l.s, body = 7 * s;
  for (size_t r = 0; r < l.rows.size(); r += l.row_step) {
    const int cy = (l.ys[r] + l.ys[r + 1] - l.gap) / 2;
    c.Text(l.grid.x0 - 6 * s - TextWidth(l.rows[r], s), cy - body / 2, l.rows[r], s, kInk);
  }
  int col_h = 0;
  for (size_t k = 0; k < l.cols.size(); k += l.col_step) {
    const int cx = (l.xs[k] + l.xs[k + 1] - l.gap) / 2, tw = TextWidth(l.cols[k], s);
    if (l.vertical_cols) {
      c.Text(cx - body / 2, l.grid.y1 + 6 * s + tw - 1, l.cols[k], s, kInk, /*vertical=*/true);
    } else {
      c.Text(cx - tw / 2, l.grid.y1 + 6 * s, l.cols[k], s, kInk);
    }
    col_h = std::max(col_h, l.vertical_cols ? tw : l.ch);
  }
  if (!o.title.empty()) {
    c.Text(std::max(4 * s, (o.width - TextWidth(o.title, 2 * s)) / 2), 10 * s, o.title, 2 * s,
           kInk);
  }
  if (!o.x_label.empty()) {
    const int x = l.grid.x0 + (l.grid.x1 - l.grid.x0 - TextWidth(o.x_label, s)) / 2;
    c.Text(std::max(0, x), l.grid.y1 + 6 * s + col_h + 10 * s, o.x_label, s, kInk);
  }
  if (!o.y_label.empty()) {
    const int y = l.grid.y1 - (l.grid.y1 - l.grid.y0 - TextWidth(o.y_label, s)) / 2;
    c.Text(10 * s, std::min(o.height - 1, y), o.y_label, s, kInk, /*vertical=*/true);
  }
}

// The colour bar: the scale from lo (bottom) to hi (top), framed, with a tick and a label at
// each end.
void DrawColourBar(Canvas& c, const Layout& l, const HeatmapOptions& o) {
  const Rect& b = l.bar;
  const int s = l.s, span = std::max(1, b.y1 - b.y0);
  for (int y = b.y0; y <= b.y1; ++y) {
    c.Fill({b.x0, y, b.x1, y}, ScaleAt(static_cast<double>(b.y1 - y) / span));
  }
  c.Frame(b, s, kBorder);
  for (const auto& [y, v] : {std::pair{b.y0, o.hi}, std::pair{b.y1 - s + 1, o.lo}}) {
    c.Fill({b.x1 + 1, y, b.x1 + 4 * s, y + s - 1}, kInk);
    c.Text(b.x1 + 8 * s, y - 7 * s / 2, FormatFixed(v, o.decimals), s, kInk);
  }
}

}  // namespace

absl::StatusOr<std::string> RenderHeatmapPng(const HeatmapOptions& o,
                                             const std::vector<std::string>& row_labels,
                                             const std::vector<std::string>& col_labels,
                                             const std::vector<std::vector<double>>& values) {
  KVTIER_RETURN_IF_ERROR(Validate(o, row_labels, col_labels, values));
  const Layout l = MakeLayout(o, row_labels, col_labels, values);
  Canvas c(o.width, o.height);
  DrawCells(c, l, o, values);
  DrawLabels(c, l, o);
  DrawColourBar(c, l, o);
  return c.EncodePng();
}

absl::Status WriteHeatmap(const std::string& path, const HeatmapOptions& o,
                          const std::vector<std::string>& row_labels,
                          const std::vector<std::string>& col_labels,
                          const std::vector<std::vector<double>>& values) {
  KVTIER_ASSIGN_OR_RETURN(const std::string png,
                          RenderHeatmapPng(o, row_labels, col_labels, values));
  return plot_internal::WriteFileAtomically(path, png);
}

}  // namespace kvtier
