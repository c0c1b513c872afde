// The CPU backend's row conversions: the F16C fast path and the scalar path agree bit for
// bit on every fp16 pattern, and stores round as the scalar conversions do.
#include "kernels/cpu/convert.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"

namespace kvtier {
namespace {

std::vector<Half> AllHalves() {
  std::vector<Half> v(65536 + 5);  // + a tail that is not a multiple of 8
  for (size_t i = 0; i < v.size(); ++i) v[i].bits = static_cast<uint16_t>(i * 40503u);
  for (uint32_t i = 0; i < 65536; ++i) v[i].bits = static_cast<uint16_t>(i);
  return v;
}

void ExpectSameFloats(const std::vector<float>& got, const std::vector<Half>& src) {
  for (size_t i = 0; i < src.size(); ++i) {
    const float want = HalfToFloat(src[i]);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got[i])) << i;
    } else {
      uint32_t a, b;
      std::memcpy(&a, &got[i], 4);
      std::memcpy(&b, &want, 4);
      ASSERT_EQ(a, b) << "half bits " << src[i].bits;
    }
  }
}

TEST(ConvertTest, LoadRowHalfMatchesScalarOnEveryPattern) {
  const std::vector<Half> src = AllHalves();
  std::vector<float> out(src.size());
  cpu::LoadRow(src.data(), static_cast<int32_t>(src.size()), out.data());
  ExpectSameFloats(out, src);
}

#if KVTIER_CPU_HAVE_F16C_PATH
TEST(ConvertTest, F16CPathMatchesScalarOnEveryPattern) {
  if (!cpu::HasF16C()) GTEST_SKIP() << "this CPU has no F16C";
  const std::vector<Half> src = AllHalves();
  std::vector<float> out(src.size());
  cpu::HalfRowToFloatF16C(src.data(), static_cast<int32_t>(src.size()), out.data());
  ExpectSameFloats(out, src);
}
#endif

TEST(ConvertTest, StoreRowRoundsLikeTheScalarConversions) {
  const std::vector<float> src = {0.1f, -2.5f, 65519.0f, 65520.0f, 1e-8f, 3.14159f, -0.0f};
  std::vector<Half> h(src.size());
  std::vector<BFloat16> b(src.size());
  cpu::StoreRow(src.data(), static_cast<int32_t>(src.size()), h.data());
  cpu::StoreRow(src.data(), static_cast<int32_t>(src.size()), b.data());
  for (size_t i = 0; i < src.size(); ++i) {
    EXPECT_EQ(h[i].bits, FloatToHalf(src[i]).bits) << i;
    EXPECT_EQ(b[i].bits, FloatToBFloat16(src[i]).bits) << i;
  }
}

TEST(ConvertTest, DotHandlesTailsAndMatchesDouble) {
  for (int32_t n : {1, 7, 8, 9, 64, 131}) {
    std::vector<float> a(static_cast<size_t>(n)), c(static_cast<size_t>(n));
    double want = 0;
    for (int32_t i = 0; i < n; ++i) {
      a[static_cast<size_t>(i)] = 0.25f * static_cast<float>(i % 13) - 1.0f;
      c[static_cast<size_t>(i)] = 0.5f * static_cast<float>(i % 7) - 1.5f;
      want += double{a[static_cast<size_t>(i)]} * c[static_cast<size_t>(i)];
    }
    EXPECT_NEAR(cpu::Dot(a.data(), c.data(), n), want, 1e-4) << n;
  }
}

}  // namespace
}  // namespace kvtier
