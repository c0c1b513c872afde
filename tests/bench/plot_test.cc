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

}  // namespace
}  // namespace kvtier::bench
