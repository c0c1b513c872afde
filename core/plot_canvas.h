// The raster under plot.h's charts (the line chart in plot.cc, the heatmap in
// plot_heatmap.cc): an 8-bit RGB canvas with a clip rectangle, filled rectangles, thick
// (optionally dashed) lines, discs and text in a 5×7 bitmap font; its PNG encoding (zlib
// only); and the atomic file write both writers use. Not part of the public API.
//
// Thread-safety: a Canvas is not thread-safe; the free functions keep no shared state.
#ifndef KVTIER_CORE_PLOT_CANVAS_H_
#define KVTIER_CORE_PLOT_CANVAS_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/plot.h"

namespace kvtier::plot_internal {

inline constexpr PlotColor kWhite{255, 255, 255};
inline constexpr PlotColor kInk{34, 34, 34};        // text, frame, ticks
inline constexpr PlotColor kGrid{228, 228, 228};    // grid lines
inline constexpr PlotColor kBorder{170, 170, 170};  // legend box, colour bar frame

struct Rect {
  int x0, y0, x1, y1;  // inclusive
};

// A w×h image, white when made. Every drawing call is clipped to the clip rectangle (the
// whole image unless set), so callers may draw partly or wholly outside it.
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
  // The rectangle's outline, `t` px thick, inside it.
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
            double* phase);

  // A filled disc of radius r around the pixel nearest (cx, cy).
  void Disc(double cx, double cy, int r, PlotColor c);

  // Text with its top-left corner at (x, y), each font pixel a scale×scale block; a glyph
  // is 5 font pixels wide plus 1 of spacing, 7 high plus a descender row. Printable ASCII;
  // any other byte shows as '?'. Vertical text reads bottom to top, starting at (x, y) = its
  // bottom-left corner.
  void Text(int x, int y, const std::string& s, int scale, PlotColor c, bool vertical = false);

  // The image as a PNG: signature, IHDR (8-bit RGB), one IDAT (filter 0 rows), IEND.
  // INTERNAL if zlib fails.
  absl::StatusOr<std::string> EncodePng() const;

 private:
  int w_, h_;
  std::vector<uint8_t> px_;  // row-major RGB
  Rect clip_;
};

// The width in pixels of `s` drawn by Canvas::Text at `scale` (0 for an empty string).
inline int TextWidth(const std::string& s, int scale) {
  return s.empty() ? 0 : (static_cast<int>(s.size()) * 6 - 1) * scale;
}

// OK when width and height are both in [200, 4096] (the sizes plot.h accepts), else
// INVALID_ARGUMENT; the message starts with `what`.
absl::Status CheckImageSize(const char* what, int32_t width, int32_t height);

// Writes `bytes` to `path` through a temporary file in the same directory (mode 0644),
// renamed over `path`, so readers never see a partial file. The file-system error
// (NOT_FOUND, PERMISSION_DENIED, ...) on failure; the temporary file is removed then.
absl::Status WriteFileAtomically(const std::string& path, const std::string& bytes);

}  // namespace kvtier::plot_internal

#endif  // KVTIER_CORE_PLOT_CANVAS_H_
