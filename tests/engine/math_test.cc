// The engine's Math (engine/math.h) on every backend this build has: each op against a naive
// double-precision reference written here. The cpu parameter always runs; the cuda one skips
// itself without a usable device. Buffers live in the device's memory (Device::Allocate) and
// move through Device::Copy on the Math's stream, so one test body serves both backends.
//
// Tolerances: f32 arithmetic within 1e-4 relative to the magnitude of the terms summed (so
// cancellation does not make the bound meaningless); embedding and f32 conversions exact;
// conversions to fp16 / bf16 bit-exact against kvtier/dtype.h's helpers (the CPU's) and a
// few patterns known by hand, and widening exact for every one of the 65536 patterns.
#include "engine/math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kvtier/device.h"
#include "kvtier/dtype.h"

namespace kvtier::engine {
namespace {

class MathTest : public ::testing::TestWithParam<DeviceKind> {
 protected:
  void SetUp() override {
    if (GetParam() == DeviceKind::kCuda && CudaDeviceCount() == 0) {
      GTEST_SKIP() << (CudaBackendBuilt() ? "no usable CUDA device"
                                          : "built without the CUDA backend");
    }
    absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice(GetParam());
    ASSERT_TRUE(device.ok()) << device.status();
    device_ = *std::move(device);
    absl::StatusOr<std::unique_ptr<Stream>> stream = device_->CreateStream();
    ASSERT_TRUE(stream.ok()) << stream.status();
    stream_ = *std::move(stream);
    absl::StatusOr<std::unique_ptr<Math>> math = CreateMath(*device_, *stream_, /*threads=*/2);
    ASSERT_TRUE(math.ok()) << math.status();
    math_ = *std::move(math);
  }

  void TearDown() override {
    // The Math and the stream before the device they belong to.
    math_.reset();
    stream_.reset();
    device_.reset();
  }

  // Device memory holding `host`.
  template <typename T>
  DeviceBuffer Upload(const std::vector<T>& host) {
    DeviceBuffer buffer = Alloc<T>(host.size());
    if (!host.empty()) {
      EXPECT_TRUE(
          device_->Copy(*stream_, buffer.data(), host.data(), host.size() * sizeof(T)).ok());
      EXPECT_TRUE(stream_->Synchronize().ok());
    }
    return buffer;
  }

  // Device memory for `count` elements (at least one byte: Allocate refuses zero).
  template <typename T>
  DeviceBuffer Alloc(size_t count) {
    absl::StatusOr<DeviceBuffer> buffer = device_->Allocate(std::max<size_t>(count * sizeof(T), 1));
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    return buffer.ok() ? *std::move(buffer) : DeviceBuffer();
  }

  // The first `count` elements of `buffer`, once the Math's work so far has run.
  template <typename T>
  std::vector<T> Download(const DeviceBuffer& buffer, size_t count) {
    std::vector<T> host(count);
    EXPECT_TRUE(math_->Fence().ok());
    if (count == 0) return host;
    EXPECT_TRUE(device_->Copy(*stream_, host.data(), buffer.data(), count * sizeof(T)).ok());
    const absl::Status status = stream_->Synchronize();
    EXPECT_TRUE(status.ok()) << status;
    return host;
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Math> math_;
};

std::vector<float> RandomFloats(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

// |got − want| ≤ rel · scale + abs for every element; `scale` per element is the magnitude
// of the terms that made it (a sum of |products| for a dot product).
void ExpectClose(const std::vector<float>& got, const std::vector<double>& want,
                 const std::vector<double>& scale, double rel, double abs,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int reported = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double bound = rel * scale[i] + abs;
    if (!(std::fabs(got[i] - want[i]) <= bound)) {
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", want " << want[i]
                    << " (bound " << bound << ")";
      if (++reported == 10) return;
    }
  }
}

constexpr double kRel = 1e-4;  // f32 arithmetic

// ---- MatMul -------------------------------------------------------------------------------

TEST_P(MathTest, MatMulMatchesReference) {
  struct Case {
    int64_t m, n, k;
    bool bias;
  };
  for (const Case& c : {Case{1, 7, 5, false}, Case{1, 64, 128, true}, Case{3, 16, 33, true},
                        Case{17, 96, 130, false}, Case{32, 256, 64, true}}) {
    SCOPED_TRACE(absl::StrCat("m=", c.m, " n=", c.n, " k=", c.k, " bias=", c.bias));
    const std::vector<float> x = RandomFloats(c.m * c.k, 1);
    const std::vector<float> w = RandomFloats(c.n * c.k, 2);
    const std::vector<float> b = RandomFloats(c.n, 3);
    std::vector<double> want(c.m * c.n);
    std::vector<double> scale(c.m * c.n);
    for (int64_t i = 0; i < c.m; ++i) {
      for (int64_t j = 0; j < c.n; ++j) {
        double sum = c.bias ? b[j] : 0.0;
        double mag = c.bias ? std::fabs(b[j]) : 0.0;
        for (int64_t l = 0; l < c.k; ++l) {
          const double p = static_cast<double>(x[i * c.k + l]) * w[j * c.k + l];
          sum += p;
          mag += std::fabs(p);
        }
        want[i * c.n + j] = sum;
        scale[i * c.n + j] = mag;
      }
    }
    DeviceBuffer dx = Upload(x), dw = Upload(w), db = Upload(b);
    DeviceBuffer dy = Alloc<float>(c.m * c.n);
    ASSERT_TRUE(math_
                    ->MatMul(dx.as<float>(), dw.as<float>(), c.bias ? db.as<float>() : nullptr,
                             dy.as<float>(), c.m, c.n, c.k)
                    .ok());
    ExpectClose(Download<float>(dy, c.m * c.n), want, scale, kRel, 1e-6, "MatMul");
  }
}

// ---- RmsNorm ------------------------------------------------------------------------------

TEST_P(MathTest, RmsNormMatchesReferenceAndWorksInPlace) {
  const int64_t m = 5;
  const int64_t d = 300;  // not a multiple of a block
  const float eps = 1e-5f;
  std::vector<float> x = RandomFloats(m * d, 4, -3.0f, 3.0f);
  for (int64_t j = 0; j < d; ++j) x[4 * d + j] = 1e-4f * x[4 * d + j];  // eps matters here
  const std::vector<float> w = RandomFloats(d, 5, 0.5f, 1.5f);
  std::vector<double> want(m * d);
  std::vector<double> scale(m * d);
  for (int64_t i = 0; i < m; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += static_cast<double>(x[i * d + j]) * x[i * d + j];
    const double inv = 1.0 / std::sqrt(ss / d + eps);
    for (int64_t j = 0; j < d; ++j) {
      want[i * d + j] = x[i * d + j] * inv * w[j];
      scale[i * d + j] = std::fabs(want[i * d + j]);
    }
  }
  DeviceBuffer dx = Upload(x), dw = Upload(w);
  DeviceBuffer dy = Alloc<float>(m * d);
  ASSERT_TRUE(math_->RmsNorm(dx.as<float>(), dw.as<float>(), dy.as<float>(), m, d, eps).ok());
  ExpectClose(Download<float>(dy, m * d), want, scale, kRel, 1e-7, "RmsNorm");
  ASSERT_TRUE(math_->RmsNorm(dx.as<float>(), dw.as<float>(), dx.as<float>(), m, d, eps).ok());
  ExpectClose(Download<float>(dx, m * d), want, scale, kRel, 1e-7, "RmsNorm in place");
}

// ---- Rope ---------------------------------------------------------------------------------

TEST_P(MathTest, RopeMatchesReferenceForBothLayouts) {
  struct Case {
    int32_t heads, head_dim, rot_dim;
    bool neox;
  };
  const std::vector<int32_t> positions = {0, 1, 7, 1000, 32767, 3};
  const int64_t m = static_cast<int64_t>(positions.size());
  for (const Case& c : {Case{3, 16, 16, false}, Case{3, 16, 16, true}, Case{2, 64, 32, false},
                        Case{2, 64, 32, true}, Case{4, 128, 128, true}, Case{1, 10, 6, false}}) {
    SCOPED_TRACE(absl::StrCat("heads=", c.heads, " head_dim=", c.head_dim, " rot_dim=", c.rot_dim,
                              " neox=", c.neox));
    const int32_t half = c.rot_dim / 2;
    std::vector<float> inv_freq(half);
    for (int32_t p = 0; p < half; ++p) {
      inv_freq[p] = static_cast<float>(std::pow(10000.0, -2.0 * p / c.rot_dim));
    }
    const std::vector<float> x = RandomFloats(m * c.heads * c.head_dim, 6);
    std::vector<double> want(x.begin(), x.end());
    std::vector<double> scale(x.size());
    for (int64_t i = 0; i < m; ++i) {
      for (int32_t h = 0; h < c.heads; ++h) {
        const int64_t base = (i * c.heads + h) * c.head_dim;
        for (int32_t e = 0; e < c.head_dim; ++e) scale[base + e] = std::fabs(x[base + e]);
        for (int32_t p = 0; p < half; ++p) {
          const double angle = static_cast<double>(positions[i]) * inv_freq[p];
          const int64_t i0 = base + (c.neox ? p : 2 * p);
          const int64_t i1 = base + (c.neox ? p + half : 2 * p + 1);
          want[i0] = x[i0] * std::cos(angle) - x[i1] * std::sin(angle);
          want[i1] = x[i0] * std::sin(angle) + x[i1] * std::cos(angle);
          scale[i0] = scale[i1] = std::fabs(x[i0]) + std::fabs(x[i1]);
        }
      }
    }
    DeviceBuffer dx = Upload(x), dpos = Upload(positions), dfreq = Upload(inv_freq);
    RopeArgs a;
    a.x = dx.as<float>();
    a.positions = dpos.as<int32_t>();
    a.inv_freq = dfreq.as<float>();
    a.m = m;
    a.heads = c.heads;
    a.head_dim = c.head_dim;
    a.rot_dim = c.rot_dim;
    a.neox = c.neox;
    ASSERT_TRUE(math_->Rope(a).ok());
    // Dims past rot_dim pass through: their scale is |x| and the bound is then exactness
    // to within fp32 rounding, which they meet exactly.
    ExpectClose(Download<float>(dx, x.size()), want, scale, kRel, 1e-7, "Rope");
  }
}

// ---- SiluMul, Add, Embed ------------------------------------------------------------------

TEST_P(MathTest, SiluMulAndAddMatchReference) {
  const int64_t count = 1000;  // not a multiple of a block
  const std::vector<float> gate = RandomFloats(count, 7, -20.0f, 20.0f);
  const std::vector<float> up = RandomFloats(count, 8, -2.0f, 2.0f);
  std::vector<double> want(count);
  std::vector<double> scale(count);
  for (int64_t i = 0; i < count; ++i) {
    const double g = gate[i];
    want[i] = g / (1.0 + std::exp(-g)) * up[i];
    scale[i] = std::fabs(want[i]);
  }
  DeviceBuffer dgate = Upload(gate), dup = Upload(up);
  ASSERT_TRUE(math_->SiluMul(dgate.as<float>(), dup.as<float>(), count).ok());
  ExpectClose(Download<float>(dgate, count), want, scale, kRel, 1e-7, "SiluMul");

  DeviceBuffer dy = Upload(gate);
  ASSERT_TRUE(math_->Add(dy.as<float>(), dup.as<float>(), count).ok());
  for (int64_t i = 0; i < count; ++i) {
    want[i] = static_cast<double>(gate[i]) + up[i];
    scale[i] = std::fabs(want[i]);
  }
  // One rounding of an exact sum: within half an ulp.
  ExpectClose(Download<float>(dy, count), want, scale, 1e-7, 0, "Add");
}

TEST_P(MathTest, EmbedCopiesTableRows) {
  const int64_t vocab = 11;
  const int64_t d = 33;
  const std::vector<float> table = RandomFloats(vocab * d, 9);
  const std::vector<int32_t> ids = {3, 0, 10, 3, 7};
  const int64_t m = static_cast<int64_t>(ids.size());
  DeviceBuffer dtable = Upload(table), dids = Upload(ids);
  DeviceBuffer dy = Alloc<float>(m * d);
  ASSERT_TRUE(math_->Embed(dids.as<int32_t>(), dtable.as<float>(), dy.as<float>(), m, d).ok());
  const std::vector<float> got = Download<float>(dy, m * d);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < d; ++j) {
      ASSERT_EQ(got[i * d + j], table[ids[i] * d + j]) << "row " << i << " dim " << j;
    }
  }
}

TEST_P(MathTest, RowDistanceIsTheNormOfRowDifferencesAtAStride) {
  const int64_t m = 5, d = 300;  // d not a multiple of a block
  const std::vector<float> a = RandomFloats(m * d, 21, -3.0f, 3.0f);
  const std::vector<float> b = RandomFloats(m * d, 22, -3.0f, 3.0f);
  const int64_t stride = 3;
  std::vector<double> want(m * stride, -7.0), scale(m * stride, 1.0);
  for (int64_t i = 0; i < m; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += std::pow(double(a[i * d + j]) - b[i * d + j], 2);
    want[i * stride] = std::sqrt(ss);
    scale[i * stride] = want[i * stride];
  }
  const std::vector<float> fill(m * stride, -7.0f);  // the gaps must stay untouched
  DeviceBuffer da = Upload(a), db = Upload(b), dout = Upload(fill);
  ASSERT_TRUE(math_->RowDistance(da.as<float>(), db.as<float>(), dout.as<float>(), m, d, stride).ok());
  ExpectClose(Download<float>(dout, m * stride), want, scale, 1e-6, 0, "RowDistance");
  // A row against itself is 0; Copy makes b's first row a's.
  ASSERT_TRUE(math_->Copy(db.as<float>(), da.as<float>(), d).ok());
  ASSERT_TRUE(math_->RowDistance(da.as<float>(), db.as<float>(), dout.as<float>(), 1, d, 1).ok());
  EXPECT_EQ(Download<float>(dout, 1)[0], 0.0f);
}

// ---- CausalAttention ----------------------------------------------------------------------

struct AttentionCase {
  int64_t m, first_pos;
  int32_t q_heads, kv_heads, head_dim;
};

TEST_P(MathTest, CausalAttentionMatchesReference) {
  for (const AttentionCase& c :
       {AttentionCase{1, 0, 1, 1, 8}, AttentionCase{1, 37, 4, 2, 64}, AttentionCase{5, 0, 4, 4, 32},
        AttentionCase{7, 20, 8, 2, 128}, AttentionCase{3, 100, 6, 3, 256},
        AttentionCase{16, 300, 4, 1, 96}, AttentionCase{2, 5000, 2, 1, 64},
        AttentionCase{33, 0, 2, 2, 20}}) {
    SCOPED_TRACE(absl::StrCat("m=", c.m, " first_pos=", c.first_pos, " Hq=", c.q_heads,
                              " Hkv=", c.kv_heads, " d=", c.head_dim));
    const int64_t n = c.first_pos + c.m;
    const int32_t d = c.head_dim;
    const int64_t qs = int64_t{c.q_heads} * d;
    const int64_t kvs = int64_t{c.kv_heads} * d;
    // Queries scaled up so the softmax is far from uniform.
    const std::vector<float> q = RandomFloats(c.m * qs, 10, -3.0f, 3.0f);
    const std::vector<float> k = RandomFloats(n * kvs, 11);
    const std::vector<float> v = RandomFloats(n * kvs, 12);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    const int32_t group = c.q_heads / c.kv_heads;

    std::vector<double> want(c.m * qs);
    std::vector<double> scores(n);
    for (int64_t i = 0; i < c.m; ++i) {
      const int64_t visible = c.first_pos + i + 1;
      for (int32_t h = 0; h < c.q_heads; ++h) {
        const int32_t kvh = h / group;
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < visible; ++j) {
          double s = 0;
          for (int32_t e = 0; e < d; ++e) {
            s += static_cast<double>(q[i * qs + h * d + e]) * k[j * kvs + kvh * d + e];
          }
          scores[j] = s * scale;
          mx = std::max(mx, scores[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j < visible; ++j) sum += (scores[j] = std::exp(scores[j] - mx));
        for (int32_t e = 0; e < d; ++e) {
          double o = 0;
          for (int64_t j = 0; j < visible; ++j) o += scores[j] * v[j * kvs + kvh * d + e];
          want[i * qs + h * d + e] = o / sum;
        }
      }
    }
    DeviceBuffer dq = Upload(q), dk = Upload(k), dv = Upload(v);
    DeviceBuffer dout = Alloc<float>(c.m * qs);
    CausalAttentionArgs a;
    a.q = dq.as<float>();
    a.k = dk.as<float>();
    a.v = dv.as<float>();
    a.out = dout.as<float>();
    a.m = c.m;
    a.first_pos = c.first_pos;
    a.q_heads = c.q_heads;
    a.kv_heads = c.kv_heads;
    a.head_dim = d;
    a.scale = scale;
    ASSERT_TRUE(math_->CausalAttention(a).ok());
    // Outputs are convex combinations of values in [-1, 1]: an absolute bound.
    ExpectClose(Download<float>(dout, c.m * qs), want, std::vector<double>(want.size(), 1.0), kRel,
                0, "CausalAttention");
  }
}

// ---- Conversions --------------------------------------------------------------------------

uint16_t Bits16(const void* p) {
  uint16_t b;
  std::memcpy(&b, p, sizeof(b));
  return b;
}

// Values that exercise rounding: ties both ways, subnormals, overflow, specials.
std::vector<float> ConversionInputs() {
  std::vector<float> x = {0.0f,
                          -0.0f,
                          1.0f,
                          -2.5f,
                          1.0f + std::ldexp(1.0f, -11),      // fp16 tie → even (1.0)
                          1.0f + 3 * std::ldexp(1.0f, -11),  // fp16 tie → even (up)
                          1.0f + std::ldexp(1.0f, -8),       // bf16 tie → even (1.0)
                          1.0f + 3 * std::ldexp(1.0f, -8),   // bf16 tie → even (up)
                          std::ldexp(1.0f, -24),             // smallest fp16 subnormal
                          std::ldexp(1.0f, -25),             // tie with 0 → 0
                          std::ldexp(3.0f, -25),             // tie → 2^-23
                          1e-7f,
                          6.1e-5f,
                          65504.0f,
                          65519.0f,
                          65520.0f,  // rounds to fp16 inf
                          -1e6f,
                          std::ldexp(1.0f, -130),  // fp32 subnormal
                          3.0e38f,
                          std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(),
                          -std::numeric_limits<float>::quiet_NaN()};
  const std::vector<float> r = RandomFloats(2000, 13, -70000.0f, 70000.0f);
  x.insert(x.end(), r.begin(), r.end());
  std::mt19937 rng(14);
  for (int i = 0; i < 2000; ++i) {  // every exponent, random mantissas
    const uint32_t bits = static_cast<uint32_t>(rng());
    x.push_back(BitsToFloat(bits));
  }
  return x;
}

TEST_P(MathTest, ToDTypeMatchesCpuHelpersBitForBit) {
  const std::vector<float> x = ConversionInputs();
  const int64_t count = static_cast<int64_t>(x.size());
  DeviceBuffer dx = Upload(x);
  for (const DType dtype : {DType::kF16, DType::kBF16, DType::kF32}) {
    SCOPED_TRACE(DTypeName(dtype));
    DeviceBuffer dy = Alloc<uint8_t>(count * DTypeSize(dtype));
    ASSERT_TRUE(math_->ToDType(dx.as<float>(), dy.data(), dtype, count).ok());
    const std::vector<uint8_t> got = Download<uint8_t>(dy, count * DTypeSize(dtype));
    for (int64_t i = 0; i < count; ++i) {
      const uint8_t* p = got.data() + i * DTypeSize(dtype);
      switch (dtype) {
        case DType::kF16:
          ASSERT_EQ(Bits16(p), FloatToHalf(x[i]).bits) << "x = " << x[i] << " (#" << i << ")";
          break;
        case DType::kBF16:
          ASSERT_EQ(Bits16(p), FloatToBFloat16(x[i]).bits) << "x = " << x[i] << " (#" << i << ")";
          break;
        case DType::kF32: {
          uint32_t b;
          std::memcpy(&b, p, sizeof(b));
          ASSERT_EQ(b, FloatBits(x[i])) << "#" << i;
          break;
        }
      }
    }
    if (dtype == DType::kF32) continue;
    // Patterns known by hand (ConversionInputs' first entries), independent of the helpers.
    const std::vector<uint16_t> known =
        dtype == DType::kF16 ? std::vector<uint16_t>{0x0000, 0x8000, 0x3c00, 0xc100, 0x3c00, 0x3c02,
                                                     0x3c04, 0x3c0c, 0x0001, 0x0000, 0x0002}
                             : std::vector<uint16_t>{0x0000, 0x8000, 0x3f80, 0xc020, 0x3f80, 0x3f80,
                                                     0x3f80, 0x3f82, 0x3380, 0x3300, 0x33c0};
    for (size_t i = 0; i < known.size(); ++i) {
      EXPECT_EQ(Bits16(got.data() + 2 * i), known[i]) << "x = " << x[i] << " (#" << i << ")";
    }
    const uint16_t inf = dtype == DType::kF16 ? 0x7c00 : 0x7f80;
    EXPECT_EQ(Bits16(got.data() + 2 * 20), inf);           // +inf
    EXPECT_EQ(Bits16(got.data() + 2 * 21), inf | 0x8000);  // -inf
    if (dtype == DType::kF16) {
      EXPECT_EQ(Bits16(got.data() + 2 * 15), 0x7c00);  // 65520
    }
  }
}

TEST_P(MathTest, FromDTypeWidensEveryPatternExactlyAndRoundTrips) {
  std::vector<uint16_t> patterns(65536);
  for (uint32_t b = 0; b < 65536; ++b) patterns[b] = static_cast<uint16_t>(b);
  const int64_t count = static_cast<int64_t>(patterns.size());
  DeviceBuffer dpatterns = Upload(patterns);
  DeviceBuffer dwide = Alloc<float>(count);
  DeviceBuffer dnarrow = Alloc<uint16_t>(count);
  for (const DType dtype : {DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    ASSERT_TRUE(math_->FromDType(dpatterns.data(), dtype, dwide.as<float>(), count).ok());
    ASSERT_TRUE(math_->ToDType(dwide.as<float>(), dnarrow.data(), dtype, count).ok());
    const std::vector<float> wide = Download<float>(dwide, count);
    const std::vector<uint16_t> narrow = Download<uint16_t>(dnarrow, count);
    for (uint32_t b = 0; b < 65536; ++b) {
      const uint16_t bits = static_cast<uint16_t>(b);
      const float want =
          dtype == DType::kF16 ? HalfToFloat(Half{bits}) : BFloat16ToFloat(BFloat16{bits});
      ASSERT_EQ(FloatBits(wide[b]), FloatBits(want)) << "pattern " << b;
      // Every non-NaN pattern survives the round trip; a NaN stays the NaN the helpers make.
      const uint16_t back = std::isnan(want) ? (dtype == DType::kF16 ? FloatToHalf(want).bits
                                                                     : FloatToBFloat16(want).bits)
                                             : bits;
      ASSERT_EQ(narrow[b], back) << "pattern " << b;
    }
  }
  // fp32 both ways is a copy.
  const std::vector<float> x = ConversionInputs();
  DeviceBuffer dx = Upload(x);
  DeviceBuffer dy = Alloc<float>(x.size());
  ASSERT_TRUE(math_->FromDType(dx.data(), DType::kF32, dy.as<float>(), x.size()).ok());
  const std::vector<float> got = Download<float>(dy, x.size());
  ASSERT_EQ(std::memcmp(got.data(), x.data(), x.size() * sizeof(float)), 0);
}

TEST_P(MathTest, ReportsItsDevice) { EXPECT_EQ(&math_->device(), device_.get()); }

std::string ParamName(const ::testing::TestParamInfo<DeviceKind>& info) {
  return std::string(DeviceKindName(info.param));
}

INSTANTIATE_TEST_SUITE_P(Backends, MathTest, ::testing::Values(DeviceKind::kCpu, DeviceKind::kCuda),
                         ParamName);

}  // namespace
}  // namespace kvtier::engine
