#include "kvtier/dtype.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "gtest/gtest.h"

namespace kvtier {
namespace {

// Independent reference: the value of an fp16 bit pattern by the IEEE 754 definition.
double HalfValue(uint16_t bits) {
  const int sign = bits >> 15, exp = (bits >> 10) & 0x1f, man = bits & 0x3ff;
  double v;
  if (exp == 0) {
    v = std::ldexp(man, -24);
  } else if (exp == 31) {
    v = man ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else {
    v = std::ldexp(1024 + man, exp - 25);
  }
  return sign ? -v : v;
}

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  DType t;
  for (DType d : {DType::kF16, DType::kBF16, DType::kF32}) {
    ASSERT_TRUE(ParseDType(DTypeName(d), &t));
    EXPECT_EQ(t, d);
  }
  EXPECT_FALSE(ParseDType("int8", &t));
}

TEST(DTypeTest, HalfToFloatIsExactForEveryBitPattern) {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const float f = HalfToFloat(Half{static_cast<uint16_t>(bits)});
    const double want = HalfValue(static_cast<uint16_t>(bits));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(f)) << bits;
    } else {
      EXPECT_EQ(static_cast<double>(f), want) << "bits " << bits;
      EXPECT_EQ(std::signbit(f), (bits & 0x8000) != 0) << bits;
    }
  }
}

TEST(DTypeTest, FloatToHalfRoundTripsEveryHalf) {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const float f = HalfToFloat(Half{static_cast<uint16_t>(bits)});
    const uint16_t back = FloatToHalf(f).bits;
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(Half{back}))) << bits;
    } else {
      EXPECT_EQ(back, bits) << "value " << f;
    }
  }
}

TEST(DTypeTest, FloatToHalfRoundsToNearestEvenAtEveryMidpoint) {
  // Between consecutive finite halves a < b (same sign), the midpoint rounds to the one
  // with an even mantissa, and points just off the midpoint round to the nearer one.
  for (uint32_t bits = 0; bits < 0x7bff; ++bits) {
    const double a = HalfValue(static_cast<uint16_t>(bits));
    const double b = HalfValue(static_cast<uint16_t>(bits + 1));
    const double mid = (a + b) / 2;  // exact in double, representable in float
    const auto even = static_cast<uint16_t>((bits & 1) ? bits + 1 : bits);
    EXPECT_EQ(FloatToHalf(static_cast<float>(mid)).bits, even) << "mid of " << bits;
    const float below = std::nextafter(static_cast<float>(mid), -1.0f);
    const float above = std::nextafter(static_cast<float>(mid), 1e9f);
    EXPECT_EQ(FloatToHalf(below).bits, bits) << bits;
    EXPECT_EQ(FloatToHalf(above).bits, bits + 1) << bits;
    EXPECT_EQ(FloatToHalf(static_cast<float>(-mid)).bits, even | 0x8000) << bits;
  }
}

TEST(DTypeTest, FloatToHalfOverflowAndSpecials) {
  EXPECT_EQ(FloatToHalf(65504.0f).bits, 0x7bff);
  EXPECT_EQ(FloatToHalf(65519.99f).bits, 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f).bits, 0x7c00);  // the midpoint to 2^16 rounds to inf
  EXPECT_EQ(FloatToHalf(1e10f).bits, 0x7c00);
  EXPECT_EQ(FloatToHalf(-1e10f).bits, 0xfc00);
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::infinity()).bits, 0x7c00);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(FloatToHalf(1e-30f).bits, 0x0000);
  EXPECT_EQ(FloatToHalf(-0.0f).bits, 0x8000);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)).bits, 0x0000);  // tie to even (zero)
  EXPECT_EQ(FloatToHalf(std::ldexp(1.5f, -25)).bits, 0x0001);
}

TEST(DTypeTest, BFloat16IsTheTopHalfAndRoundsToNearestEven) {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const float f = BFloat16ToFloat(BFloat16{static_cast<uint16_t>(bits)});
    uint32_t u;
    std::memcpy(&u, &f, 4);
    EXPECT_EQ(u, bits << 16);
    if (!std::isnan(f)) {
      EXPECT_EQ(FloatToBFloat16(f).bits, bits);
    }
  }
  auto from_bits = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  EXPECT_EQ(FloatToBFloat16(from_bits(0x3f808000u)).bits, 0x3f80);  // tie → even
  EXPECT_EQ(FloatToBFloat16(from_bits(0x3f818000u)).bits, 0x3f82);  // tie → even (up)
  EXPECT_EQ(FloatToBFloat16(from_bits(0x3f808001u)).bits, 0x3f81);  // above tie
  EXPECT_EQ(FloatToBFloat16(from_bits(0x7f7fffffu)).bits, 0x7f80);  // max float → inf
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(from_bits(0x7f800001u)))));
}

}  // namespace
}  // namespace kvtier
