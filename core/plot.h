// A small, dependency-light line-chart writer for the benchmarks and kvtier-run eval: renders series to an RGB
// raster with its own 5×7 bitmap font and encodes it as a PNG (zlib only), so a benchmark
// can leave a plot next to its JSON on machines without matplotlib or gnuplot.
//
// The chart: one colour per series (kPlotPalette, cycling), 2-px lines (dashed on request)
// with a marker at every point, a frame with ~5 "nice" ticks per axis (1/2/5 × 10^k, or
// decades on a log axis), light grid lines, tick labels, a title, axis labels and a legend
// box with the series names to the right of the plot area. Output is deterministic: the
// same inputs give the same bytes.
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

}  // namespace kvtier

#endif  // KVTIER_CORE_PLOT_H_
