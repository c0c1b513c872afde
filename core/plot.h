// A small, dependency-light chart writer for the benchmarks and kvtier-run eval: renders line
// charts and heatmaps to an RGB raster with its own 5×7 bitmap font and encodes it as a PNG
// (zlib only), so a benchmark can leave a plot next to its JSON on machines without
// matplotlib or gnuplot.
//
// The line chart: one colour per series (kPlotPalette, cycling), 2-px lines (dashed on
// request) with a marker at every point, a frame with ~5 "nice" ticks per axis (1/2/5 × 10^k,
// or decades on a log axis), light grid lines, tick labels, a title, axis labels and a legend
// box with the series names to the right of the plot area.
//
// The heatmap: a grid of coloured cells (e.g. accuracy by context length × needle depth),
// each optionally labelled with its value, row and column labels, and a colour bar.
//
// Output is deterministic: the same inputs give the same bytes. Both writers write through a
// temporary file renamed over the destination.
//
// Thread-safety: the functions keep no shared state; concurrent calls are safe (two calls
// writing the same path race, but each rename is atomic: the file is one complete image).
#ifndef KVTIER_CORE_PLOT_H_
#define KVTIER_CORE_PLOT_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvtier {

struct PlotColor {
  uint8_t r = 0, g = 0, b = 0;
  friend bool operator==(const PlotColor&, const PlotColor&) = default;
};

// Series i is drawn in kPlotPalette[i % size]: ten distinguishable colours (Tableau 10).
inline constexpr std::array<PlotColor, 10> kPlotPalette = {
    PlotColor{31, 119, 180}, {255, 127, 14},  {44, 160, 44},   {214, 39, 40},  {148, 103, 189},
    {140, 86, 75},           {227, 119, 194}, {127, 127, 127}, {188, 189, 34}, {23, 190, 207},
};

// One line. Points are drawn in order, joined by segments. A point with a NaN or infinite
// coordinate (or a non-positive one on a log axis) is skipped and breaks the line there; it
// does not count towards the axis ranges either. Names are printable ASCII (anything else
// shows as '?'); long names are truncated in the legend.
struct PlotSeries {
  std::string name;
  std::vector<double> x, y;  // same length
  bool dashed = false;
};

struct PlotOptions {
  std::string title, x_label, y_label;  // empty: not drawn
  bool log_x = false, log_y = false;    // log10 axes
  int32_t width = 960, height = 600;    // pixels, each in [200, 4096]
};

// Renders the chart as an 8-bit RGB PNG and writes it to `path` (through a temporary file
// in the same directory, renamed over `path`, so readers never see a partial image).
// INVALID_ARGUMENT for a size outside [200, 4096], a series whose x and y lengths differ,
// or no drawable point in any series; the file-system error (NOT_FOUND, PERMISSION_DENIED,
// ...) when the file cannot be written.
absl::Status WriteLinePlot(const std::string& path, const PlotOptions& o,
                           const std::vector<PlotSeries>& series);

// The same image in memory: the PNG file's bytes. Same errors as WriteLinePlot (but never a
// file-system one).
absl::StatusOr<std::string> RenderLinePlotPng(const PlotOptions& o,
                                              const std::vector<PlotSeries>& series);

// How WriteHeatmap draws; the grid itself comes in its arguments.
struct HeatmapOptions {
  std::string title, x_label, y_label;  // empty: not drawn
  double lo = 0, hi = 1;                // the colour scale's range; values are clamped to it
  bool annotate = true;                 // print each cell's value (see below) in the cell
  int32_t decimals = 2;                 // digits after the point in cell labels and the scale
  int32_t width = 960, height = 600;    // pixels, each in [200, 4096]
};

// Renders a grid of cells as an 8-bit RGB PNG and writes it to `path` (through a temporary
// file, as WriteLinePlot). values[r][c] is drawn at row r (top to bottom) and column c (left
// to right), coloured on a perceptually ordered scale (ColorBrewer RdYlGn) from lo (red)
// through yellow to hi (green); a value outside [lo, hi], an infinity included, takes the
// colour of the end it passes. A NaN cell is grey and unlabelled.
//
// With o.annotate, a cell shows its value with o.decimals digits after the point ("0.85"), in
// dark or white text, whichever contrasts more with the cell; a cell too small for its
// label has none. Row labels go left of the grid, column labels below it (turned vertical
// when the widest does not fit a column; only every k-th is drawn when the cells are too
// small for one each); labels are printable ASCII (anything else shows as '?') and long
// ones are truncated. A colour bar right of the grid shows the scale, lo and hi labelled.
//
// INVALID_ARGUMENT for a size outside [200, 4096], decimals outside [0, 10], no rows or no
// columns, rows of different lengths, row_labels.size() != values.size() or
// col_labels.size() != the row length, lo >= hi or a non-finite lo or hi; the file-system
// error when the file cannot be written, as WriteLinePlot.
absl::Status WriteHeatmap(const std::string& path, const HeatmapOptions& o,
                          const std::vector<std::string>& row_labels,
                          const std::vector<std::string>& col_labels,
                          const std::vector<std::vector<double>>& values);

// The same image in memory: the PNG file's bytes. Same errors as WriteHeatmap (but never a
// file-system one).
absl::StatusOr<std::string> RenderHeatmapPng(const HeatmapOptions& o,
                                             const std::vector<std::string>& row_labels,
                                             const std::vector<std::string>& col_labels,
                                             const std::vector<std::vector<double>>& values);

}  // namespace kvtier

#endif  // KVTIER_CORE_PLOT_H_
