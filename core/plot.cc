#include "core/plot.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"

namespace kvtier {
namespace {

// 5×8 glyphs of ASCII 32..126, one byte per column (left to right), bit 0 = top row; rows
// 0..6 are the body, row 7 the descenders of g, j, p, q and y.
constexpr uint8_t kFont[95][5] = {
    {0x00, 0x00, 0x00, 0x00, 0x00}, {0x00, 0x00, 0x5F, 0x00, 0x00}, {0x00, 0x07, 0x00, 0x07, 0x00},
    {0x14, 0x7F, 0x14, 0x7F, 0x14}, {0x24, 0x2A, 0x7F, 0x2A, 0x12}, {0x23, 0x13, 0x08, 0x64, 0x62},
    {0x36, 0x49, 0x55, 0x22, 0x50}, {0x00, 0x05, 0x03, 0x00, 0x00}, {0x00, 0x1C, 0x22, 0x41, 0x00},
    {0x00, 0x41, 0x22, 0x1C, 0x00}, {0x08, 0x2A, 0x1C, 0x2A, 0x08}, {0x08, 0x08, 0x3E, 0x08, 0x08},
    {0x00, 0x50, 0x30, 0x00, 0x00}, {0x08, 0x08, 0x08, 0x08, 0x08}, {0x00, 0x60, 0x60, 0x00, 0x00},
    {0x20, 0x10, 0x08, 0x04, 0x02}, {0x3E, 0x51, 0x49, 0x45, 0x3E}, {0x00, 0x42, 0x7F, 0x40, 0x00},
    {0x42, 0x61, 0x51, 0x49, 0x46}, {0x21, 0x41, 0x45, 0x4B, 0x31}, {0x18, 0x14, 0x12, 0x7F, 0x10},
    {0x27, 0x45, 0x45, 0x45, 0x39}, {0x3C, 0x4A, 0x49, 0x49, 0x30}, {0x01, 0x71, 0x09, 0x05, 0x03},
    {0x36, 0x49, 0x49, 0x49, 0x36}, {0x06, 0x49, 0x49, 0x29, 0x1E}, {0x00, 0x36, 0x36, 0x00, 0x00},
    {0x00, 0x56, 0x36, 0x00, 0x00}, {0x08, 0x14, 0x22, 0x41, 0x00}, {0x14, 0x14, 0x14, 0x14, 0x14},
    {0x00, 0x41, 0x22, 0x14, 0x08}, {0x02, 0x01, 0x51, 0x09, 0x06}, {0x32, 0x49, 0x79, 0x41, 0x3E},
    {0x7E, 0x11, 0x11, 0x11, 0x7E}, {0x7F, 0x49, 0x49, 0x49, 0x36}, {0x3E, 0x41, 0x41, 0x41, 0x22},
    {0x7F, 0x41, 0x41, 0x22, 0x1C}, {0x7F, 0x49, 0x49, 0x49, 0x41}, {0x7F, 0x09, 0x09, 0x09, 0x01},
    {0x3E, 0x41, 0x49, 0x49, 0x7A}, {0x7F, 0x08, 0x08, 0x08, 0x7F}, {0x00, 0x41, 0x7F, 0x41, 0x00},
    {0x20, 0x40, 0x41, 0x3F, 0x01}, {0x7F, 0x08, 0x14, 0x22, 0x41}, {0x7F, 0x40, 0x40, 0x40, 0x40},
    {0x7F, 0x02, 0x0C, 0x02, 0x7F}, {0x7F, 0x04, 0x08, 0x10, 0x7F}, {0x3E, 0x41, 0x41, 0x41, 0x3E},
    {0x7F, 0x09, 0x09, 0x09, 0x06}, {0x3E, 0x41, 0x51, 0x21, 0x5E}, {0x7F, 0x09, 0x19, 0x29, 0x46},
    {0x46, 0x49, 0x49, 0x49, 0x31}, {0x01, 0x01, 0x7F, 0x01, 0x01}, {0x3F, 0x40, 0x40, 0x40, 0x3F},
    {0x1F, 0x20, 0x40, 0x20, 0x1F}, {0x3F, 0x40, 0x38, 0x40, 0x3F}, {0x63, 0x14, 0x08, 0x14, 0x63},
    {0x07, 0x08, 0x70, 0x08, 0x07}, {0x61, 0x51, 0x49, 0x45, 0x43}, {0x00, 0x7F, 0x41, 0x41, 0x00},
    {0x02, 0x04, 0x08, 0x10, 0x20}, {0x00, 0x41, 0x41, 0x7F, 0x00}, {0x04, 0x02, 0x01, 0x02, 0x04},
    {0x40, 0x40, 0x40, 0x40, 0x40}, {0x00, 0x01, 0x02, 0x04, 0x00}, {0x20, 0x54, 0x54, 0x54, 0x78},
    {0x7F, 0x48, 0x44, 0x44, 0x38}, {0x38, 0x44, 0x44, 0x44, 0x20}, {0x38, 0x44, 0x44, 0x48, 0x7F},
    {0x38, 0x54, 0x54, 0x54, 0x18}, {0x08, 0x7E, 0x09, 0x01, 0x02}, {0x98, 0xA4, 0xA4, 0xA4, 0x7C},
    {0x7F, 0x08, 0x04, 0x04, 0x78}, {0x00, 0x44, 0x7D, 0x40, 0x00}, {0x80, 0x80, 0x84, 0x7D, 0x00},
    {0x7F, 0x10, 0x28, 0x44, 0x00}, {0x00, 0x41, 0x7F, 0x40, 0x00}, {0x7C, 0x04, 0x18, 0x04, 0x78},
    {0x7C, 0x08, 0x04, 0x04, 0x78}, {0x38, 0x44, 0x44, 0x44, 0x38}, {0xFC, 0x24, 0x24, 0x24, 0x18},
    {0x18, 0x24, 0x24, 0x24, 0xFC}, {0x7C, 0x08, 0x04, 0x04, 0x08}, {0x48, 0x54, 0x54, 0x54, 0x20},
    {0x04, 0x3F, 0x44, 0x40, 0x20}, {0x3C, 0x40, 0x40, 0x20, 0x7C}, {0x1C, 0x20, 0x40, 0x20, 0x1C},
    {0x3C, 0x40, 0x30, 0x40, 0x3C}, {0x44, 0x28, 0x10, 0x28, 0x44}, {0x9C, 0xA0, 0xA0, 0xA0, 0x7C},
    {0x44, 0x64, 0x54, 0x4C, 0x44}, {0x00, 0x08, 0x36, 0x41, 0x00}, {0x00, 0x00, 0x7F, 0x00, 0x00},
    {0x00, 0x41, 0x36, 0x08, 0x00}, {0x08, 0x04, 0x08, 0x10, 0x08},
};

constexpr PlotColor kWhite{255, 255, 255};
constexpr PlotColor kInk{34, 34, 34};        // text, frame, ticks
constexpr PlotColor kGrid{228, 228, 228};    // grid lines
constexpr PlotColor kBorder{170, 170, 170};  // legend box

struct Rect {
  int x0, y0, x1, y1;  // inclusive
};

class Canvas {
 public:
  Canvas(int w, int h) : w_(w), h_(h), px_(static_cast<size_t>(w) * h * 3, 255) { ResetClip(); }

  void SetClip(const Rect& r) {
    clip_ = {std::max(r.x0, 0), std::max(r.y0, 0), std::min(r.x1, w_ - 1), std::min(r.y1, h_ - 1)};
  }
  void ResetClip() { clip_ = {0, 0, w_ - 1, h_ - 1}; }

  void Put(int x, int y, PlotColor c) {
    if (x < clip_.x0 || x > clip_.x1 || y < clip_.y0 || y > clip_.y1) return;
    uint8_t* p = &px_[(static_cast<size_t>(y) * w_ + x) * 3];
    p[0] = c.r;
    p[1] = c.g;
    p[2] = c.b;
  }
  void Fill(const Rect& r, PlotColor c) {
    for (int y = std::max(r.y0, clip_.y0); y <= std::min(r.y1, clip_.y1); ++y) {
      for (int x = std::max(r.x0, clip_.x0); x <= std::min(r.x1, clip_.x1); ++x) Put(x, y, c);
    }
  }
  void Frame(const Rect& r, int t, PlotColor c) {
    Fill({r.x0, r.y0, r.x1, r.y0 + t - 1}, c);
    Fill({r.x0, r.y1 - t + 1, r.x1, r.y1}, c);
    Fill({r.x0, r.y0, r.x0 + t - 1, r.y1}, c);
    Fill({r.x1 - t + 1, r.y0, r.x1, r.y1}, c);
  }

  // A line `t` px thick from (x0, y0) to (x1, y1), stepped one pixel at a time along its
  // major axis. With dash > 0 it is drawn `dash` px on, dash/2 px off; *phase (the length
  // drawn so far) carries the pattern across the segments of one polyline.
  void Line(double x0, double y0, double x1, double y1, int t, PlotColor c, double dash,
            double* phase) {
    const double dx = x1 - x0, dy = y1 - y0, len = std::hypot(dx, dy);
    const int n = std::max(1, static_cast<int>(std::ceil(std::max(std::abs(dx), std::abs(dy)))));
    for (int i = 0; i <= n; ++i) {
      const double f = static_cast<double>(i) / n;
      if (dash > 0 && std::fmod(*phase + f * len, dash * 1.5) >= dash) continue;
      const int x = static_cast<int>(std::lround(x0 + f * dx)) - (t - 1) / 2;
      const int y = static_cast<int>(std::lround(y0 + f * dy)) - (t - 1) / 2;
      Fill({x, y, x + t - 1, y + t - 1}, c);
    }
    *phase += len;
  }

  void Disc(double cx, double cy, int r, PlotColor c) {
    const int x = static_cast<int>(std::lround(cx)), y = static_cast<int>(std::lround(cy));
    for (int j = -r; j <= r; ++j) {
      for (int i = -r; i <= r; ++i) {
        if (i * i + j * j <= r * r + r) Put(x + i, y + j, c);
      }
    }
  }

  // Text with its top-left corner at (x, y), each font pixel a scale×scale block. Vertical
  // text reads bottom to top, starting at (x, y) = its bottom-left corner.
  void Text(int x, int y, const std::string& s, int scale, PlotColor c, bool vertical = false) {
    for (size_t i = 0; i < s.size(); ++i) {
      const int ch = static_cast<unsigned char>(s[i]);
      const uint8_t* g = kFont[(ch >= 32 && ch <= 126 ? ch : '?') - 32];
      for (int col = 0; col < 5; ++col) {
        for (int row = 0; row < 8; ++row) {
          if ((g[col] >> row & 1) == 0) continue;
          const int along = (static_cast<int>(i) * 6 + col) * scale;
          const int bx = vertical ? x + row * scale : x + along;
          const int by = vertical ? y - along - scale + 1 : y + row * scale;
          Fill({bx, by, bx + scale - 1, by + scale - 1}, c);
        }
      }
    }
  }

  // The image as a PNG: signature, IHDR (8-bit RGB), one IDAT (filter 0 rows), IEND.
  absl::StatusOr<std::string> EncodePng() const {
    std::string raw;
    raw.reserve(static_cast<size_t>(h_) * (1 + 3 * w_));
    for (int y = 0; y < h_; ++y) {
      raw.push_back('\0');  // filter type None
      raw.append(reinterpret_cast<const char*>(&px_[static_cast<size_t>(y) * w_ * 3]),
                 static_cast<size_t>(w_) * 3);
    }
    uLongf zlen = compressBound(raw.size());
    std::string z(zlen, '\0');
    if (compress2(reinterpret_cast<Bytef*>(z.data()), &zlen,
                  reinterpret_cast<const Bytef*>(raw.data()), raw.size(), 6) != Z_OK) {
      return absl::InternalError("zlib compress2 failed");
    }
    z.resize(zlen);
    std::string png("\x89PNG\r\n\x1a\n", 8);
    std::string ihdr;
    PutU32(&ihdr, static_cast<uint32_t>(w_));
    PutU32(&ihdr, static_cast<uint32_t>(h_));
    ihdr.append({'\x08', '\x02', '\0', '\0', '\0'});  // depth 8, RGB, deflate, no interlace
    Chunk(&png, "IHDR", ihdr);
    Chunk(&png, "IDAT", z);
    Chunk(&png, "IEND", "");
    return png;
  }

 private:
  static void PutU32(std::string* s, uint32_t v) {
    for (int i = 3; i >= 0; --i) s->push_back(static_cast<char>(v >> (8 * i) & 0xFF));
  }
  static void Chunk(std::string* png, const char* type, const std::string& data) {
    PutU32(png, static_cast<uint32_t>(data.size()));
    const std::string body = std::string(type, 4) + data;
    png->append(body);
    PutU32(png, static_cast<uint32_t>(
                    crc32(0L, reinterpret_cast<const Bytef*>(body.data()), body.size())));
  }

  int w_, h_;
  std::vector<uint8_t> px_;
  Rect clip_;
};

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

int TextWidth(const std::string& s, int scale) {
  return s.empty() ? 0 : (static_cast<int>(s.size()) * 6 - 1) * scale;
}

}  // namespace

absl::StatusOr<std::string> RenderLinePlotPng(const PlotOptions& o,
                                              const std::vector<PlotSeries>& series) {
  if (o.width < 200 || o.width > 4096 || o.height < 200 || o.height > 4096) {
    return absl::InvalidArgumentError(
        absl::StrFormat("plot: size %dx%d outside [200, 4096]", o.width, o.height));
  }
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
  std::string tmp = absl::StrCat(path, ".tmp.XXXXXX");
  const int fd = mkstemp(tmp.data());
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot create ", tmp));
  absl::Status st;
  if (fchmod(fd, 0644) != 0) st = absl::ErrnoToStatus(errno, absl::StrCat("chmod ", tmp));
  for (size_t done = 0; st.ok() && done < png.size();) {
    const ssize_t n = write(fd, png.data() + done, png.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) st = absl::ErrnoToStatus(errno, absl::StrCat("cannot write ", tmp));
    if (n > 0) done += static_cast<size_t>(n);
  }
  if (close(fd) != 0 && st.ok()) st = absl::ErrnoToStatus(errno, absl::StrCat("close ", tmp));
  if (st.ok() && std::rename(tmp.c_str(), path.c_str()) != 0) {
    st = absl::ErrnoToStatus(errno, absl::StrCat("cannot rename to ", path));
  }
  if (!st.ok()) unlink(tmp.c_str());
  return st;
}

}  // namespace kvtier
