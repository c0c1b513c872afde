#include "core/plot.h"

#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::bench {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

uint32_t BigEndian32(const std::string& s, size_t at) {
  uint32_t v = 0;
  for (size_t i = 0; i < 4; ++i) v = v << 8 | static_cast<uint8_t>(s[at + i]);
  return v;
}

// A decoded PNG: header fields and the inflated scanlines (a filter byte, then 3·w bytes).
struct Image {
  int w = 0, h = 0, depth = 0, colour_type = 0;
  std::vector<uint8_t> raw;

  PlotColor At(int x, int y) const {
    const uint8_t* p = &raw[static_cast<size_t>(y) * (1 + 3 * w) + 1 + 3 * x];
    return {p[0], p[1], p[2]};
  }
  bool Dark(int x, int y) const {
    const PlotColor c = At(x, y);
    return c.r < 100 && c.g < 100 && c.b < 100;
  }
  int Count(PlotColor c) const {
    int n = 0;
    for (int y = 0; y < h; ++y) {
      for (int x = 0; x < w; ++x) n += At(x, y) == c;
    }
    return n;
  }
};

// Parses `png` (checking the signature, every chunk's CRC and the chunk order) into *img.
void Decode(const std::string& png, Image* img) {
  ASSERT_GE(png.size(), 8u);
  ASSERT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  std::vector<std::string> types;
  std::string idat;
  for (size_t at = 8; at < png.size();) {
    ASSERT_LE(at + 12, png.size());
    const uint32_t len = BigEndian32(png, at);
    ASSERT_LE(at + 12 + len, png.size());
    const std::string body = png.substr(at + 4, 4 + len);
    const uint32_t crc =
        static_cast<uint32_t>(crc32(0L, reinterpret_cast<const Bytef*>(body.data()), body.size()));
    EXPECT_EQ(BigEndian32(png, at + 8 + len), crc) << body.substr(0, 4);
    types.push_back(body.substr(0, 4));
    const std::string data = body.substr(4);
    if (types.back() == "IHDR") {
      ASSERT_EQ(len, 13u);
      img->w = static_cast<int>(BigEndian32(data, 0));
      img->h = static_cast<int>(BigEndian32(data, 4));
      img->depth = static_cast<uint8_t>(data[8]);
      img->colour_type = static_cast<uint8_t>(data[9]);
      EXPECT_EQ(data.substr(10), std::string(3, '\0'));  // deflate, filter 0, no interlace
    }
    if (types.back() == "IDAT") idat += data;
    at += 12 + len;
  }
  ASSERT_GE(types.size(), 3u);
  EXPECT_EQ(types.front(), "IHDR");
  EXPECT_EQ(types.back(), "IEND");
  ASSERT_GT(img->w, 0);
  ASSERT_GT(img->h, 0);
  const size_t want = static_cast<size_t>(img->h) * (1 + 3 * static_cast<size_t>(img->w));
  img->raw.assign(want + 1, 0);  // one spare byte: a longer stream would show as len > want
  uLongf len = img->raw.size();
  ASSERT_EQ(
      uncompress(img->raw.data(), &len, reinterpret_cast<const Bytef*>(idat.data()), idat.size()),
      Z_OK);
  ASSERT_EQ(len, want);
  img->raw.resize(want);
}

Image Render(const PlotOptions& o, const std::vector<PlotSeries>& series) {
  Image img;
  absl::StatusOr<std::string> png = RenderLinePlotPng(o, series);
  EXPECT_TRUE(png.ok()) << png.status();
  if (png.ok()) Decode(*png, &img);
  return img;
}

PlotSeries Line(const std::string& name, std::vector<double> x, std::vector<double> y) {
  PlotSeries s;
  s.name = name;
  s.x = std::move(x);
  s.y = std::move(y);
  return s;
}

PlotSeries Constant(double y, int n = 11) {
  PlotSeries s;
  s.name = "flat";
  for (int i = 0; i < n; ++i) {
    s.x.push_back(i);
    s.y.push_back(y);
  }
  return s;
}

TEST(PlotTest, PngHeaderParsesBack) {
  PlotOptions o;
  o.width = 640;
  o.height = 480;
  Image img;
  ASSERT_NO_FATAL_FAILURE(img = Render(o, {Constant(3)}));
  EXPECT_EQ(img.w, 640);
  EXPECT_EQ(img.h, 480);
  EXPECT_EQ(img.depth, 8);
  EXPECT_EQ(img.colour_type, 2);  // RGB
  for (int y = 0; y < img.h; ++y) {
    ASSERT_EQ(img.raw[static_cast<size_t>(y) * (1 + 3 * img.w)], 0) << "filter byte, row " << y;
  }
}

TEST(PlotTest, BackgroundIsWhite) {
  Image img = Render(PlotOptions{}, {Constant(3)});
  ASSERT_EQ(img.w, 960);
  ASSERT_EQ(img.h, 600);
  for (auto [x, y] : {std::pair{0, 0}, {img.w - 1, 0}, {0, img.h - 1}, {img.w - 1, img.h - 1}}) {
    EXPECT_EQ(img.At(x, y), (PlotColor{255, 255, 255})) << x << "," << y;
  }
}

// The columns of the left half of the image holding `c`, per row.
std::vector<int> RowCounts(const Image& img, PlotColor c) {
  std::vector<int> n(img.h, 0);
  for (int y = 0; y < img.h; ++y) {
    for (int x = 0; x < img.w / 2; ++x) n[y] += img.At(x, y) == c;
  }
  return n;
}

TEST(PlotTest, HorizontalSeriesDrawsOneRowInTheFirstColour) {
  Image img = Render(PlotOptions{}, {Constant(5)});
  ASSERT_EQ(img.w, 960);
  const std::vector<int> n = RowCounts(img, kPlotPalette[0]);
  const int row = static_cast<int>(std::max_element(n.begin(), n.end()) - n.begin());
  // The value is the middle of its axis, and the line spans most of the plot's left half.
  EXPECT_GT(row, img.h * 35 / 100);
  EXPECT_LT(row, img.h * 65 / 100);
  EXPECT_GT(n[row], img.w / 4);
  // Elsewhere only the markers (radius 3) show the colour.
  for (int y = 0; y < img.h; ++y) {
    if (std::abs(y - row) > 4) {
      EXPECT_EQ(n[y], 0) << "row " << y;
    }
  }
  // The line is continuous between its first and last point.
  int first = img.w, last = -1;
  for (int x = 0; x < img.w / 2; ++x) {
    if (img.At(x, row) == kPlotPalette[0]) first = std::min(first, x), last = x;
  }
  for (int x = first; x <= last; ++x) {
    EXPECT_TRUE(img.At(x, row) == kPlotPalette[0] || img.At(x, row + 1) == kPlotPalette[0] ||
                img.At(x, row - 1) == kPlotPalette[0])
        << "column " << x;
  }
}

TEST(PlotTest, NonFinitePointBreaksTheLine) {
  auto widest_gap = [](const Image& img) {
    const std::vector<int> n = RowCounts(img, kPlotPalette[0]);
    const int row = static_cast<int>(std::max_element(n.begin(), n.end()) - n.begin());
    int gap = 0, run = 0;
    bool started = false;
    for (int x = 0; x < img.w / 2; ++x) {
      bool hit = false;
      for (int y = row - 4; y <= row + 4; ++y) hit = hit || img.At(x, y) == kPlotPalette[0];
      if (hit) started = true, run = 0;
      if (!hit && started) gap = std::max(gap, ++run);
    }
    return gap - run;  // the trailing run after the last point is not a gap
  };
  PlotSeries broken = Constant(5);
  broken.y[2] = kNaN;
  broken.x[3] = std::numeric_limits<double>::infinity();
  EXPECT_EQ(widest_gap(Render(PlotOptions{}, {Constant(5)})), 0);
  EXPECT_GT(widest_gap(Render(PlotOptions{}, {broken})), 20);
}

TEST(PlotTest, TwoSeriesTwoColours) {
  PlotSeries dashed = Line("b", {0, 1, 2, 3}, {3, 1, 4, 1});
  dashed.dashed = true;
  Image img = Render(PlotOptions{}, {Line("a", {0, 1, 2, 3}, {1, 2, 3, 4}), dashed});
  EXPECT_GT(img.Count(kPlotPalette[0]), 200);
  EXPECT_GT(img.Count(kPlotPalette[1]), 200);
  EXPECT_EQ(img.Count(kPlotPalette[2]), 0);
}

TEST(PlotTest, PaletteColoursAreDistinct) {
  for (size_t i = 0; i < kPlotPalette.size(); ++i) {
    for (size_t j = 0; j < i; ++j) EXPECT_FALSE(kPlotPalette[i] == kPlotPalette[j]) << i << j;
  }
  EXPECT_GE(kPlotPalette.size(), 8u);
}

// Dark pixels in the middle columns above the plot frame (its top row: the first mostly
// dark row).
int DarkAboveFrame(const Image& img) {
  if (img.w < 200) return -1;  // did not decode
  int frame = 0;
  for (int y = 0; y < img.h && frame == 0; ++y) {
    int dark = 0;
    for (int x = 0; x < img.w; ++x) dark += img.Dark(x, y);
    if (dark > img.w / 2) frame = y;
  }
  int n = 0;
  for (int y = 0; y < frame; ++y) {
    for (int x = img.w / 2 - 80; x < img.w / 2 + 80; ++x) n += img.Dark(x, y);
  }
  return n;
}

TEST(PlotTest, TitleDrawsDarkPixelsInTheTitleBand) {
  PlotOptions o;
  EXPECT_EQ(DarkAboveFrame(Render(o, {Constant(1)})), 0);
  o.title = "Recall vs budget";
  EXPECT_GT(DarkAboveFrame(Render(o, {Constant(1)})), 100);
}

// Pixels of colour `c` (or dark ones) in the rectangle [x0, x1) × [y0, y1).
int CountIn(const Image& img, int x0, int y0, int x1, int y1, const PlotColor* c = nullptr) {
  int n = 0;
  for (int y = std::max(0, y0); y < std::min(img.h, y1); ++y) {
    for (int x = std::max(0, x0); x < std::min(img.w, x1); ++x) {
      n += c != nullptr ? img.At(x, y) == *c : img.Dark(x, y);
    }
  }
  return n;
}

TEST(PlotTest, AxisLabelsAndLegendDrawText) {
  PlotOptions o;
  const Image plain = Render(o, {Line("", {1, 2}, {1, 2})});
  o.x_label = "tokens";
  o.y_label = "latency (us)";
  const Image labelled = Render(o, {Line("a series name", {1, 2}, {1, 2})});
  ASSERT_EQ(plain.w, 960);
  ASSERT_EQ(labelled.w, 960);
  // The y label runs up the left of the frame, the x label below it: more dark pixels there
  // (the tick labels are the same in both images).
  auto frame_left = [](const Image& img) {
    for (int x = 0; x < img.w; ++x) {
      if (CountIn(img, x, 0, x + 1, img.h) > img.h / 2) return x;
    }
    return 0;
  };
  auto frame_bottom = [](const Image& img) {
    for (int y = img.h - 1; y >= 0; --y) {
      if (CountIn(img, 0, y, img.w, y + 1) > img.w / 2) return y;
    }
    return img.h - 1;
  };
  EXPECT_GT(CountIn(labelled, 0, 0, frame_left(labelled), labelled.h),
            CountIn(plain, 0, 0, frame_left(plain), plain.h) + 50);
  EXPECT_GT(CountIn(labelled, 0, frame_bottom(labelled) + 1, labelled.w, labelled.h),
            CountIn(plain, 0, frame_bottom(plain) + 1, plain.w, plain.h) + 50);
  // A legend (a grey box, the series' colour and its name) only when a series has a name.
  const PlotColor grey{170, 170, 170};
  EXPECT_EQ(CountIn(plain, 0, 0, plain.w, plain.h, &grey), 0);
  EXPECT_GT(CountIn(labelled, 0, 0, labelled.w, labelled.h, &grey), 100);
  EXPECT_GT(CountIn(labelled, labelled.w * 3 / 4, 0, labelled.w, labelled.h, &kPlotPalette[0]), 20);
  EXPECT_GT(CountIn(labelled, labelled.w * 3 / 4, 0, labelled.w, labelled.h), 30);
}

TEST(PlotTest, LogAxisSkipsNonPositiveValues) {
  PlotOptions o;
  o.log_y = true;
  const std::string with = *RenderLinePlotPng(o, {Line("s", {1, 2, 3, 4, 5}, {-1, 0, 1, 10, 100})});
  const std::string without = *RenderLinePlotPng(o, {Line("s", {3, 4, 5}, {1, 10, 100})});
  EXPECT_EQ(with, without);  // the skipped points change neither the ranges nor the lines
  o.log_y = false;
  EXPECT_NE(*RenderLinePlotPng(o, {Line("s", {1, 2, 3, 4, 5}, {-1, 0, 1, 10, 100})}), with);
  o.log_x = o.log_y = true;
  EXPECT_EQ(RenderLinePlotPng(o, {Line("s", {1, 2}, {0, -3})}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PlotTest, Deterministic) {
  PlotOptions o;
  o.title = "t";
  EXPECT_EQ(*RenderLinePlotPng(o, {Constant(2), Line("x", {1, 9}, {0, 7})}),
            *RenderLinePlotPng(o, {Constant(2), Line("x", {1, 9}, {0, 7})}));
}

TEST(PlotTest, InvalidArguments) {
  const auto code = [](const PlotOptions& o, const std::vector<PlotSeries>& s) {
    return RenderLinePlotPng(o, s).status().code();
  };
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(code(PlotOptions{}, {Line("m", {1, 2, 3}, {1, 2})}), kInvalid);
  EXPECT_EQ(code(PlotOptions{}, {Line("nan", {kNaN, 1}, {1, kNaN})}), kInvalid);
  EXPECT_EQ(code(PlotOptions{}, {Line("empty", {}, {})}), kInvalid);
  EXPECT_EQ(code(PlotOptions{}, {}), kInvalid);
  for (auto [w, h] : {std::pair{199, 600}, {4097, 600}, {960, 199}, {960, 4097}, {0, -1}}) {
    PlotOptions o;
    o.width = w;
    o.height = h;
    EXPECT_EQ(code(o, {Constant(1)}), kInvalid) << w << "x" << h;
  }
  for (auto [w, h] : {std::pair{200, 200}, {4096, 200}, {200, 4096}}) {
    PlotOptions o;
    o.width = w;
    o.height = h;
    o.title = "a rather long title for so small an image";
    Image img;
    ASSERT_NO_FATAL_FAILURE(
        img = Render(o, {Line("a very long series name that must be cut", {1, 2}, {3, 4})}));
    EXPECT_EQ(img.w, w);
    EXPECT_EQ(img.h, h);
  }
}

TEST(PlotTest, WriteLinePlotWritesTheRenderedImage) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / absl::StrCat("plot_test_", getpid());
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "plot.png").string();
  PlotOptions o;
  o.title = "write";
  const std::vector<PlotSeries> series = {Constant(4), Line("up", {0, 10}, {0, 8})};
  ASSERT_TRUE(WriteLinePlot(path, o, series).ok());
  ASSERT_TRUE(WriteLinePlot(path, o, series).ok());  // replaces an existing file
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const absl::StatusOr<std::string> png = RenderLinePlotPng(o, series);
  ASSERT_TRUE(png.ok());
  EXPECT_EQ(bytes, *png);
  // No temporary file is left behind.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir),
                          std::filesystem::directory_iterator()),
            1);
  // A missing directory is the file system's error; a bad plot is still INVALID_ARGUMENT.
  const absl::Status missing = WriteLinePlot((dir / "no-such-dir" / "p.png").string(), o, series);
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  EXPECT_EQ(WriteLinePlot(path, o, {Line("m", {1}, {})}).code(),
            absl::StatusCode::kInvalidArgument);
  std::filesystem::remove_all(dir);
}

// ---- Heatmaps ----

Image RenderHeat(const HeatmapOptions& o, const std::vector<std::vector<double>>& values,
                 std::vector<std::string> rows = {}, std::vector<std::string> cols = {}) {
  if (rows.empty()) rows.assign(values.size(), "");
  if (cols.empty() && !values.empty()) cols.assign(values[0].size(), "");
  Image img;
  absl::StatusOr<std::string> png = RenderHeatmapPng(o, rows, cols, values);
  EXPECT_TRUE(png.ok()) << png.status();
  if (png.ok()) Decode(*png, &img);
  return img;
}

// Neither white, black nor any grey: a cell of the colour scale (or the colour bar).
bool Coloured(PlotColor c) { return !(c.r == c.g && c.g == c.b); }

// Inclusive pixel spans of a heatmap's rows and columns, found by scanning (row 0 and
// column 0 must have no NaN cell): the first image row with the most scale-coloured pixels
// runs along the grid's top, where no cell label reaches; the coloured runs on it are the
// columns (then the colour bar), and the coloured runs down the grid's left edge the rows.
struct Grid {
  std::vector<std::pair<int, int>> cols, rows;
  int CenterX(size_t c) const { return (cols[c].first + cols[c].second) / 2; }
  int CenterY(size_t r) const { return (rows[r].first + rows[r].second) / 2; }
};

std::vector<std::pair<int, int>> ColouredRuns(const Image& img, bool along_x, int at) {
  std::vector<std::pair<int, int>> runs;
  const int n = along_x ? img.w : img.h;
  for (int i = 0; i < n; ++i) {
    if (!Coloured(along_x ? img.At(i, at) : img.At(at, i))) continue;
    if (!runs.empty() && runs.back().second == i - 1) {
      runs.back().second = i;
    } else {
      runs.push_back({i, i});
    }
  }
  return runs;
}

Grid FindGrid(const Image& img, size_t rows, size_t cols) {
  Grid g;
  int top = 0, most = 0;
  for (int y = 0; y < img.h; ++y) {
    const int n = static_cast<int>(ColouredRuns(img, true, y).size());
    int px = 0;
    for (int x = 0; x < img.w; ++x) px += Coloured(img.At(x, y));
    if (n > 0 && px > most) top = y, most = px;
  }
  g.cols = ColouredRuns(img, true, top);
  if (g.cols.empty()) return g;
  g.rows = ColouredRuns(img, false, g.cols[0].first);
  EXPECT_GE(g.cols.size(), cols + 1) << "the columns, then the colour bar";
  EXPECT_EQ(g.rows.size(), rows);
  g.cols.resize(std::min(g.cols.size(), cols));
  return g;
}

bool Greenish(PlotColor c) { return c.g > c.r + 60 && c.g > c.b + 30; }
bool Reddish(PlotColor c) { return c.r > c.g + 60 && c.r > c.b + 60; }
bool Yellowish(PlotColor c) { return c.r > 200 && c.g > 200 && c.b + 40 < std::min(c.r, c.g); }

TEST(HeatmapTest, PngDecodesToTheRequestedSize) {
  for (auto [w, h] : {std::pair{960, 600}, {200, 200}, {4096, 200}, {333, 1234}}) {
    HeatmapOptions o;
    o.width = w;
    o.height = h;
    o.title = "Needle in a haystack: accuracy";
    o.x_label = "needle depth";
    o.y_label = "context length";
    std::vector<std::vector<double>> v(12, std::vector<double>(20, 0.5));
    std::vector<std::string> rows(12, "a long row label, truncated"), cols(20, "depth 50%");
    Image img;
    ASSERT_NO_FATAL_FAILURE(img = RenderHeat(o, v, rows, cols));
    EXPECT_EQ(img.w, w);
    EXPECT_EQ(img.h, h);
    EXPECT_EQ(img.depth, 8);
    EXPECT_EQ(img.colour_type, 2);  // RGB
  }
}

TEST(HeatmapTest, HiIsGreenLoIsRedTheMiddleYellow) {
  HeatmapOptions o;
  o.lo = -5;
  o.hi = 15;
  o.annotate = false;
  const Image img = RenderHeat(o, {{15, 5, -5}, {-5, 15, 5}});
  const Grid g = FindGrid(img, 2, 3);
  ASSERT_EQ(g.rows.size(), 2u);
  ASSERT_EQ(g.cols.size(), 3u);
  for (auto [r, c] : {std::pair{0, 0}, {1, 1}}) {
    const PlotColor hi = img.At(g.CenterX(c), g.CenterY(r));
    EXPECT_TRUE(Greenish(hi)) << r << c << ": " << +hi.r << " " << +hi.g << " " << +hi.b;
  }
  for (auto [r, c] : {std::pair{0, 2}, {1, 0}}) {
    const PlotColor lo = img.At(g.CenterX(c), g.CenterY(r));
    EXPECT_TRUE(Reddish(lo)) << r << c << ": " << +lo.r << " " << +lo.g << " " << +lo.b;
  }
  for (auto [r, c] : {std::pair{0, 1}, {1, 2}}) {
    const PlotColor mid = img.At(g.CenterX(c), g.CenterY(r));
    EXPECT_TRUE(Yellowish(mid)) << r << c << ": " << +mid.r << " " << +mid.g << " " << +mid.b;
  }
  // Every cell is one colour, edge to edge.
  for (size_t r = 0; r < 2; ++r) {
    for (size_t c = 0; c < 3; ++c) {
      const PlotColor centre = img.At(g.CenterX(c), g.CenterY(r));
      EXPECT_EQ(CountIn(img, g.cols[c].first, g.rows[r].first, g.cols[c].second + 1,
                        g.rows[r].second + 1, &centre),
                (g.cols[c].second - g.cols[c].first + 1) * (g.rows[r].second - g.rows[r].first + 1))
          << r << c;
    }
  }
}

TEST(HeatmapTest, ValuesOutsideTheScaleTakeTheColourOfItsEnd) {
  HeatmapOptions o;
  o.annotate = false;
  const double inf = std::numeric_limits<double>::infinity();
  const Image img = RenderHeat(o, {{1, 1.5, 1e300, inf}, {0, -0.5, -1e300, -inf}});
  const Grid g = FindGrid(img, 2, 4);
  ASSERT_EQ(g.rows.size(), 2u);
  ASSERT_EQ(g.cols.size(), 4u);
  for (size_t r = 0; r < 2; ++r) {
    const PlotColor end = img.At(g.CenterX(0), g.CenterY(r));
    EXPECT_TRUE(r == 0 ? Greenish(end) : Reddish(end));
    for (size_t c = 1; c < 4; ++c) EXPECT_EQ(img.At(g.CenterX(c), g.CenterY(r)), end) << r << c;
  }
}

TEST(HeatmapTest, NanCellIsGreyAndUnlabelled) {
  HeatmapOptions o;  // annotated
  const Image img = RenderHeat(o, {{0.9, 0.9, 0.9}, {0.9, kNaN, 0.9}, {0.9, 0.9, 0.1}});
  const Grid g = FindGrid(img, 3, 3);
  ASSERT_EQ(g.rows.size(), 3u);
  ASSERT_EQ(g.cols.size(), 3u);
  const PlotColor grey = img.At(g.CenterX(1), g.CenterY(1));
  EXPECT_EQ(grey.r, grey.g);
  EXPECT_EQ(grey.g, grey.b);
  EXPECT_GT(grey.r, 100);
  EXPECT_LT(grey.r, 240);
  // No label: the whole cell (its spans scanned along row 0 and column 0) is that grey.
  const int x0 = g.cols[1].first, x1 = g.cols[1].second, y0 = g.rows[1].first,
            y1 = g.rows[1].second;
  EXPECT_EQ(CountIn(img, x0, y0, x1 + 1, y1 + 1, &grey), (x1 - x0 + 1) * (y1 - y0 + 1));
}

// Pixels inside cell (r, c) that differ from its top-left pixel (the cell's own colour).
int LabelPixels(const Image& img, const Grid& g, size_t r, size_t c, PlotColor* ink = nullptr) {
  const PlotColor bg = img.At(g.cols[c].first, g.rows[r].first);
  int n = 0;
  for (int y = g.rows[r].first; y <= g.rows[r].second; ++y) {
    for (int x = g.cols[c].first; x <= g.cols[c].second; ++x) {
      if (img.At(x, y) == bg) continue;
      ++n;
      if (ink != nullptr) *ink = img.At(x, y);
    }
  }
  return n;
}

TEST(HeatmapTest, CellLabelsContrastWithTheirCell) {
  HeatmapOptions o;
  const std::vector<std::vector<double>> v = {{1.0, 0.5}, {0.0, 0.75}};
  const Image img = RenderHeat(o, v);
  const Grid g = FindGrid(img, 2, 2);
  ASSERT_EQ(g.rows.size(), 2u);
  ASSERT_EQ(g.cols.size(), 2u);
  PlotColor ink;
  // Dark green and dark red cells: white text; the light yellow one: dark text.
  for (auto [r, c] : {std::pair{0, 0}, {1, 0}}) {
    EXPECT_GT(LabelPixels(img, g, r, c, &ink), 20) << r << c;
    EXPECT_EQ(ink, (PlotColor{255, 255, 255})) << r << c;
  }
  EXPECT_GT(LabelPixels(img, g, 0, 1, &ink), 20);
  EXPECT_TRUE(ink.r < 100 && ink.g < 100 && ink.b < 100);
  // Without annotation every cell is plain.
  o.annotate = false;
  const Image plain = RenderHeat(o, v);
  for (size_t r = 0; r < 2; ++r) {
    for (size_t c = 0; c < 2; ++c) EXPECT_EQ(LabelPixels(plain, g, r, c), 0) << r << c;
  }
}

TEST(HeatmapTest, DecimalsSetTheLabelsLength) {
  HeatmapOptions o;
  o.width = o.height = 400;  // labels at the small scale in both images
  auto label_pixels = [&](int32_t decimals) {
    o.decimals = decimals;
    const Image img = RenderHeat(o, {{0.25, 0.25}});
    const Grid g = FindGrid(img, 1, 2);
    return g.cols.size() == 2 ? LabelPixels(img, g, 0, 1) : -1;
  };
  const int none = label_pixels(0), four = label_pixels(4);
  EXPECT_GT(none, 5);          // "0"
  EXPECT_GT(four, none + 40);  // "0.2500"
}

TEST(HeatmapTest, LabelsOfCellsTooSmallForThemAreSkipped) {
  // A needle-in-a-haystack grid on the smallest image: no cell is big enough for "0.50".
  HeatmapOptions o;
  o.width = o.height = 200;
  const std::vector<std::vector<double>> v(12, std::vector<double>(20, 0.5));
  const std::vector<std::string> rows(12, "r"), cols(20, "c");
  const absl::StatusOr<std::string> annotated = RenderHeatmapPng(o, rows, cols, v);
  o.annotate = false;
  const absl::StatusOr<std::string> plain = RenderHeatmapPng(o, rows, cols, v);
  ASSERT_TRUE(annotated.ok() && plain.ok());
  EXPECT_EQ(*annotated, *plain);
  // At the default size every one of them is labelled.
  o = HeatmapOptions{};
  const Image img = RenderHeat(o, v, rows, cols);
  const Grid g = FindGrid(img, 12, 20);
  ASSERT_EQ(g.rows.size(), 12u);
  ASSERT_EQ(g.cols.size(), 20u);
  for (size_t r = 0; r < 12; ++r) {
    for (size_t c = 0; c < 20; ++c) EXPECT_GT(LabelPixels(img, g, r, c), 10) << r << c;
  }
}

TEST(HeatmapTest, RowAndColumnLabelsGoLeftOfAndBelowTheGrid) {
  HeatmapOptions o;
  o.annotate = false;
  const std::vector<std::vector<double>> v(4, std::vector<double>(10, 0.8));
  auto dark_left_below = [&](const std::vector<std::string>& rows,
                             const std::vector<std::string>& cols) {
    const Image img = RenderHeat(o, v, rows, cols);
    const Grid g = FindGrid(img, 4, 10);
    if (g.cols.size() != 10 || g.rows.size() != 4) return std::tuple{-1, -1, -1};
    // Below the grid, left of its right edge (the colour bar's "0.00" reaches lower).
    const int left = CountIn(img, 0, 0, g.cols[0].first, img.h);
    const int x1 = g.cols.back().second + 1, y0 = g.rows.back().second + 1;
    int first = img.h, last = -1;  // the dark rows below the grid
    for (int y = y0; y < img.h; ++y) {
      if (CountIn(img, 0, y, x1, y + 1) > 0) first = std::min(first, y), last = y;
    }
    return std::tuple{left, CountIn(img, 0, y0, x1, img.h), std::max(0, last - first + 1)};
  };
  const std::vector<std::string> none4(4, ""), none10(10, "");
  const std::vector<std::string> rows = {"1k", "4k", "16k", "64k"};
  const std::vector<std::string> cols = {"0", "10", "20", "30", "40", "50", "60", "70", "80", "90"};
  const auto [left0, below0, tall0] = dark_left_below(none4, none10);
  EXPECT_EQ(left0, 0);
  EXPECT_EQ(below0, 0);
  const auto [left1, below1, tall1] = dark_left_below(rows, cols);
  EXPECT_GT(left1, 40);
  EXPECT_GT(below1, 40);
  EXPECT_LE(tall1, 8);  // one line of text
  // Labels wider than a column turn vertical: the band below the grid grows taller.
  std::vector<std::string> long_cols;
  for (const std::string& c : cols) long_cols.push_back(absl::StrCat("depth ", c, " percent"));
  const auto [left2, below2, tall2] = dark_left_below(rows, long_cols);
  EXPECT_GT(tall2, 60);
}

TEST(HeatmapTest, ColourBarRunsFromLoToHiWithBothLabelled) {
  HeatmapOptions o;
  o.annotate = false;
  const Image img = RenderHeat(o, {{0.5, 0.5}});
  const Grid g = FindGrid(img, 1, 2);
  ASSERT_EQ(g.cols.size(), 2u);
  // The first coloured column right of the grid: green at its top, red at its bottom.
  int bar_x = -1;
  for (int x = g.cols.back().second + 1; x < img.w && bar_x < 0; ++x) {
    for (int y = 0; y < img.h && bar_x < 0; ++y) bar_x = Coloured(img.At(x, y)) ? x : -1;
  }
  ASSERT_GT(bar_x, 0);
  const std::vector<std::pair<int, int>> runs = ColouredRuns(img, false, bar_x + 2);
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_GT(runs[0].second - runs[0].first, img.h / 2);
  EXPECT_TRUE(Greenish(img.At(bar_x + 2, runs[0].first)));
  EXPECT_TRUE(Reddish(img.At(bar_x + 2, runs[0].second)));
  // Its labels ("1.00" at the top, "0.00" at the bottom) lie right of it.
  const int mid = (runs[0].first + runs[0].second) / 2;
  EXPECT_GT(CountIn(img, bar_x, 0, img.w, mid), 20);
  EXPECT_GT(CountIn(img, bar_x, mid, img.w, img.h), 20);
}

TEST(HeatmapTest, Deterministic) {
  HeatmapOptions o;
  o.title = "t";
  const std::vector<std::vector<double>> v = {{0.1, kNaN, 0.9}, {1, 0.5, 0}};
  const std::vector<std::string> rows = {"a", "b"}, cols = {"x", "y", "z"};
  const absl::StatusOr<std::string> a = RenderHeatmapPng(o, rows, cols, v);
  const absl::StatusOr<std::string> b = RenderHeatmapPng(o, rows, cols, v);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  o.lo = -1;  // and the inputs matter
  EXPECT_NE(*RenderHeatmapPng(o, rows, cols, v), *a);
}

TEST(HeatmapTest, InvalidArguments) {
  const std::vector<std::vector<double>> v = {{0.1, 0.2}, {0.3, 0.4}};
  const std::vector<std::string> two = {"a", "b"};
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  const auto code = [](const HeatmapOptions& o, const std::vector<std::string>& rows,
                       const std::vector<std::string>& cols,
                       const std::vector<std::vector<double>>& values) {
    return RenderHeatmapPng(o, rows, cols, values).status().code();
  };
  ASSERT_EQ(code(HeatmapOptions{}, two, two, v), absl::StatusCode::kOk);
  for (auto [w, h] : {std::pair{199, 600}, {4097, 600}, {960, 199}, {960, 4097}, {0, -1}}) {
    HeatmapOptions o;
    o.width = w;
    o.height = h;
    EXPECT_EQ(code(o, two, two, v), kInvalid) << w << "x" << h;
  }
  EXPECT_EQ(code(HeatmapOptions{}, {}, two, {}), kInvalid);                    // no rows
  EXPECT_EQ(code(HeatmapOptions{}, two, {}, {{}, {}}), kInvalid);              // no columns
  EXPECT_EQ(code(HeatmapOptions{}, two, two, {{0.1, 0.2}, {0.3}}), kInvalid);  // ragged
  EXPECT_EQ(code(HeatmapOptions{}, two, two, {{0.1, 0.2}, {}}), kInvalid);     // ragged
  EXPECT_EQ(code(HeatmapOptions{}, {"a"}, two, v), kInvalid);                  // row labels
  EXPECT_EQ(code(HeatmapOptions{}, {"a", "b", "c"}, two, v), kInvalid);        // row labels
  EXPECT_EQ(code(HeatmapOptions{}, two, {"a"}, v), kInvalid);                  // column labels
  EXPECT_EQ(code(HeatmapOptions{}, two, {"a", "b", "c"}, v), kInvalid);        // column labels
  const double inf = std::numeric_limits<double>::infinity();
  for (auto [lo, hi] :
       {std::pair{1.0, 1.0}, {1.0, 0.0}, {kNaN, 1.0}, {0.0, kNaN}, {-inf, 1.0}, {0.0, inf}}) {
    HeatmapOptions o;
    o.lo = lo;
    o.hi = hi;
    EXPECT_EQ(code(o, two, two, v), kInvalid) << lo << ".." << hi;
  }
  for (int32_t d : {-1, 11}) {
    HeatmapOptions o;
    o.decimals = d;
    EXPECT_EQ(code(o, two, two, v), kInvalid) << "decimals " << d;
  }
  // The extremes of the valid ranges are fine.
  HeatmapOptions o;
  o.lo = -1e308;
  o.hi = 1e308;
  o.decimals = 10;
  o.width = o.height = 200;
  EXPECT_EQ(code(o, two, two, v), absl::StatusCode::kOk);
}

TEST(HeatmapTest, WriteHeatmapWritesTheRenderedImage) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / absl::StrCat("heatmap_test_", getpid());
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "heatmap.png").string();
  HeatmapOptions o;
  o.title = "write";
  const std::vector<std::string> rows = {"4k", "8k"}, cols = {"0%", "50%", "100%"};
  const std::vector<std::vector<double>> v = {{1, 0.5, 0}, {kNaN, 0.25, 0.75}};
  ASSERT_TRUE(WriteHeatmap(path, o, rows, cols, v).ok());
  ASSERT_TRUE(WriteHeatmap(path, o, rows, cols, v).ok());  // replaces an existing file
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const absl::StatusOr<std::string> png = RenderHeatmapPng(o, rows, cols, v);
  ASSERT_TRUE(png.ok());
  EXPECT_EQ(bytes, *png);
  // No temporary file is left behind.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir),
                          std::filesystem::directory_iterator()),
            1);
  const absl::Status missing =
      WriteHeatmap((dir / "no-such-dir" / "h.png").string(), o, rows, cols, v);
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  EXPECT_EQ(WriteHeatmap(path, o, rows, {"0%"}, v).code(), absl::StatusCode::kInvalidArgument);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvtier::bench
