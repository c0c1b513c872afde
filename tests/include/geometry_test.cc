#include "kvtier/geometry.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier {
namespace {

using ::testing::HasSubstr;

TEST(GeometryTest, Llama8BIsValidAndSizesFollow) {
  const Geometry g = Llama31_8B();
  ASSERT_TRUE(g.Validate().ok());
  EXPECT_EQ(g.group_size(), 4);
  EXPECT_EQ(g.slab_elements(), 2 * 32 * 128);
  EXPECT_EQ(g.host_page_bytes(), 8u * 2 * 32 * 128 * 2);  // 128 KiB
  EXPECT_EQ(g.summary_bytes(), 8u * 2 * 128 * 2);
  EXPECT_EQ(g.ToString(), "L=32 Hq=32 Hkv=8 d=128 p=32 fp16");
}

struct BadCase {
  const char* name;
  void (*mutate)(Geometry&);
  const char* message;
};

class GeometryErrorTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(GeometryErrorTest, NamesTheFieldAndTheLimit) {
  Geometry g = Llama31_8B();
  GetParam().mutate(g);
  const absl::Status st = g.Validate();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr(GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(
    All, GeometryErrorTest,
    ::testing::Values(
        BadCase{"zero_layers", [](Geometry& g) { g.num_layers = 0; },
                "geometry.num_layers = 0: must be in [1, 1024]"},
        BadCase{"too_many_layers", [](Geometry& g) { g.num_layers = 1025; },
                "num_layers = 1025"},
        BadCase{"zero_q_heads", [](Geometry& g) { g.num_q_heads = 0; },
                "geometry.num_q_heads = 0: must be in [1, 1024]"},
        BadCase{"more_kv_than_q", [](Geometry& g) { g.num_kv_heads = 64; },
                "geometry.num_kv_heads = 64: must be in [1, num_q_heads = 32]"},
        BadCase{"kv_not_dividing", [](Geometry& g) { g.num_kv_heads = 5; },
                "geometry.num_kv_heads = 5: must divide num_q_heads = 32"},
        BadCase{"group_too_big",
                [](Geometry& g) {
                  g.num_q_heads = 128;
                  g.num_kv_heads = 1;
                },
                "query group of 128 heads; the limit is 64"},
        BadCase{"head_dim_odd", [](Geometry& g) { g.head_dim = 100; },
                "geometry.head_dim = 100: must be a multiple of 8 in [8, 512]"},
        BadCase{"head_dim_big", [](Geometry& g) { g.head_dim = 1024; }, "head_dim = 1024"},
        BadCase{"page_not_pow2", [](Geometry& g) { g.page_size = 48; },
                "geometry.page_size = 48: must be a power of two in [1, 1024]"},
        BadCase{"page_zero", [](Geometry& g) { g.page_size = 0; }, "page_size = 0"},
        BadCase{"bad_dtype", [](Geometry& g) { g.dtype = static_cast<DType>(9); },
                "geometry.dtype = 9"}),
    [](const ::testing::TestParamInfo<BadCase>& tpi) { return tpi.param.name; });

}  // namespace
}  // namespace kvtier
