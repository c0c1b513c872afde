// GgufFile: a valid file round-trips (every metadata type, every tensor type dequantized to
// values computed here independently), Open() on a real file equals FromBytes, and every
// refusal is INVALID_ARGUMENT naming its field, including every prefix of a valid file.
#include "engine/gguf.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine/gguf_builder.h"

namespace kvtier::engine {
namespace {

using ::kvtier::testing::GgufBuilder;
using ::kvtier::testing::GgufLayout;
using ::kvtier::testing::Q8_0Block;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;

namespace t = ::kvtier::testing;

// The refusal's message, or a marker when the bytes were accepted or refused with another code
// (so EXPECT_THAT on the message also checks the code).
std::string RefusalOf(const std::string& bytes) {
  absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::FromBytes(bytes);
  if (f.ok()) return "<accepted>";
  if (f.status().code() != absl::StatusCode::kInvalidArgument) {
    return "<wrong code> " + f.status().ToString();
  }
  return std::string(f.status().message());
}

std::unique_ptr<GgufFile> MustParse(const std::string& bytes) {
  absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::FromBytes(bytes);
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? std::move(f).value() : nullptr;
}

std::vector<float> Dequantized(const GgufTensor& t) {
  std::vector<float> out(static_cast<size_t>(t.elements));
  GgufFile::Dequantize(t, out.data());
  return out;
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// F32 data with values whose bits must survive unchanged.
const std::vector<float> kF32Values = {1.0f,
                                       -0.0f,
                                       std::numeric_limits<float>::infinity(),
                                       std::numeric_limits<float>::denorm_min(),
                                       std::numeric_limits<float>::max(),
                                       -3.25f,
                                       1e-20f,
                                       123456.789f};

// fp16 bit patterns and their values, worked out by hand from the IEEE 754 binary16 layout.
const std::vector<uint16_t> kF16Bits = {0x3c00, 0xc000, 0x7bff, 0x0001, 0x0400,
                                        0x3555, 0x7c00, 0xfc00, 0x8000};
const std::vector<float> kF16Values = {1.0f,
                                       -2.0f,
                                       65504.0f,
                                       std::ldexp(1.0f, -24),  // smallest subnormal
                                       std::ldexp(1.0f, -14),  // smallest normal
                                       0.333251953125f,        // 1.0101010101b × 2^-2
                                       std::numeric_limits<float>::infinity(),
                                       -std::numeric_limits<float>::infinity(),
                                       -0.0f};

// bf16 is the top half of an fp32.
const std::vector<uint16_t> kBF16Bits = {0x3f80, 0xc040, 0x4049, 0x0001, 0xff80};
const std::vector<float> kBF16Values = {1.0f, -3.0f, 3.140625f, std::ldexp(1.0f, -133),
                                        -std::numeric_limits<float>::infinity()};

// Three Q8_0 blocks: d = 0.5, d = 2^-24 (an fp16 subnormal), d = -1.
std::vector<Q8_0Block> Q8Blocks() {
  std::vector<Q8_0Block> blocks(3);
  blocks[0].d = 0x3800;
  blocks[1].d = 0x0001;
  blocks[2].d = 0xbc00;
  for (int j = 0; j < 32; ++j) {
    blocks[0].q[j] = static_cast<int8_t>(j - 16);
    blocks[1].q[j] = static_cast<int8_t>(4 * j - 64);
    blocks[2].q[j] = static_cast<int8_t>(j % 2 == 0 ? 127 - j : -128 + j);
  }
  return blocks;
}
std::vector<float> Q8Expected() {
  std::vector<float> out;
  const std::vector<Q8_0Block> blocks = Q8Blocks();
  const double scales[3] = {0.5, std::ldexp(1.0, -24), -1.0};
  for (int b = 0; b < 3; ++b) {
    for (int j = 0; j < 32; ++j) out.push_back(static_cast<float>(scales[b] * blocks[b].q[j]));
  }
  return out;
}

// A file with metadata of every type and a tensor of every supported type.
GgufBuilder FullBuilder() {
  GgufBuilder b;
  b.AddU8("u8", 255)
      .AddI8("i8", -128)
      .AddU16("u16", 65535)
      .AddI16("i16", -32768)
      .AddU32("u32", 4294967295u)
      .AddI32("i32", std::numeric_limits<int32_t>::min())
      .AddF32("f32", 0.15625f)
      .AddBool("true", true)
      .AddBool("false", false)
      .AddString("string", std::string("a\0b\xff", 4))
      .AddString("empty", "")
      .AddU64("u64.max", std::numeric_limits<uint64_t>::max())
      .AddU64("u64", 1234567890123ull)
      .AddI64("i64", std::numeric_limits<int64_t>::min())
      .AddF64("f64", 3.141592653589793)
      .AddStringArray("strings", {"hello", "", std::string("x\0y", 3)})
      .AddU8Array("u8s", {0, 255})
      .AddI8Array("i8s", {-128, 127})
      .AddU16Array("u16s", {65535})
      .AddI16Array("i16s", {-32768, 1})
      .AddU32Array("u32s", {7, 4294967295u})
      .AddI32Array("i32s", {-1, 2, -3})
      .AddU64Array("u64s", {uint64_t{1} << 62})
      .AddI64Array("i64s", {std::numeric_limits<int64_t>::min(), 5})
      .AddF32Array("f32s", {0.5f, -1.25f})
      .AddF64Array("f64s", {1e300, -2.5})
      .AddBoolArray("bools", {true, false, true})
      .AddI32Array("empty.array", {});
  b.AddTensorF32("f32.weight", {4, 2, 1, 1}, kF32Values);
  b.AddTensorF16Bits("f16.weight", {3, 3}, kF16Bits);
  b.AddTensorBF16Bits("bf16.weight", {5}, kBF16Bits);
  b.AddTensorQ8_0Blocks("q8.weight", {32, 3}, Q8Blocks());
  return b;
}

void ExpectFullFile(const GgufFile& f) {
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(*f.GetInt("u8"), 255);
  EXPECT_EQ(*f.GetInt("i8"), -128);
  EXPECT_EQ(*f.GetInt("u16"), 65535);
  EXPECT_EQ(*f.GetInt("i16"), -32768);
  EXPECT_EQ(*f.GetInt("u32"), 4294967295ll);
  EXPECT_EQ(*f.GetUint32("u32"), 4294967295u);
  EXPECT_EQ(*f.GetInt("i32"), std::numeric_limits<int32_t>::min());
  EXPECT_EQ(*f.GetFloat("f32"), 0.15625);
  EXPECT_EQ(*f.GetBool("true"), true);
  EXPECT_EQ(*f.GetBool("false"), false);
  EXPECT_EQ(*f.GetString("string"), std::string("a\0b\xff", 4));
  EXPECT_EQ(*f.GetString("empty"), "");
  EXPECT_EQ(*f.GetFloat("u64.max"), 18446744073709551615.0);
  EXPECT_EQ(*f.GetInt("u64"), 1234567890123ll);
  EXPECT_EQ(*f.GetInt("i64"), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(*f.GetFloat("i64"), -9223372036854775808.0);
  EXPECT_EQ(*f.GetFloat("f64"), 3.141592653589793);
  EXPECT_THAT(*f.GetStringArray("strings"), ElementsAre("hello", "", std::string("x\0y", 3)));
  EXPECT_THAT(*f.GetIntArray("u8s"), ElementsAre(0, 255));
  EXPECT_THAT(*f.GetIntArray("i8s"), ElementsAre(-128, 127));
  EXPECT_THAT(*f.GetIntArray("u16s"), ElementsAre(65535));
  EXPECT_THAT(*f.GetIntArray("i16s"), ElementsAre(-32768, 1));
  EXPECT_THAT(*f.GetIntArray("u32s"), ElementsAre(7, 4294967295ll));
  EXPECT_THAT(*f.GetIntArray("i32s"), ElementsAre(-1, 2, -3));
  EXPECT_THAT(*f.GetIntArray("u64s"), ElementsAre(int64_t{1} << 62));
  EXPECT_THAT(*f.GetIntArray("i64s"), ElementsAre(std::numeric_limits<int64_t>::min(), 5));
  EXPECT_THAT(*f.GetFloatArray("f32s"), ElementsAre(0.5, -1.25));
  EXPECT_THAT(*f.GetFloatArray("f64s"), ElementsAre(1e300, -2.5));
  EXPECT_TRUE(f.GetIntArray("empty.array")->empty());
  GgufValueType element = GgufValueType::kU8;
  uint64_t count = 0;
  EXPECT_EQ(*f.TypeOf("bools", &element, &count), GgufValueType::kArray);
  EXPECT_EQ(element, GgufValueType::kBool);
  EXPECT_EQ(count, 3u);
  EXPECT_EQ(*f.TypeOf("f64"), GgufValueType::kF64);
  EXPECT_THAT(f.Keys(), ElementsAre("u8", "i8", "u16", "i16", "u32", "i32", "f32", "true", "false",
                                    "string", "empty", "u64.max", "u64", "i64", "f64", "strings",
                                    "u8s", "i8s", "u16s", "i16s", "u32s", "i32s", "u64s", "i64s",
                                    "f32s", "f64s", "bools", "empty.array"));

  ASSERT_EQ(f.tensors().size(), 4u);
  const GgufTensor* f32 = f.FindTensor("f32.weight");
  ASSERT_NE(f32, nullptr);
  EXPECT_EQ(f32, &f.tensors()[0]);
  EXPECT_EQ(f32->type, GgmlType::kF32);
  EXPECT_THAT(f32->dims, ElementsAre(4, 2, 1, 1));
  EXPECT_EQ(f32->elements, 8);
  EXPECT_EQ(f32->bytes, 32u);
  const std::vector<float> f32_out = Dequantized(*f32);
  for (size_t i = 0; i < kF32Values.size(); ++i) {
    EXPECT_EQ(Bits(f32_out[i]), Bits(kF32Values[i])) << i;
  }

  const GgufTensor* f16 = f.FindTensor("f16.weight");
  ASSERT_NE(f16, nullptr);
  EXPECT_EQ(f16->type, GgmlType::kF16);
  EXPECT_THAT(f16->dims, ElementsAre(3, 3));
  EXPECT_EQ(f16->elements, 9);
  EXPECT_EQ(f16->bytes, 18u);
  const std::vector<float> f16_out = Dequantized(*f16);
  for (size_t i = 0; i < kF16Values.size(); ++i) {
    EXPECT_EQ(Bits(f16_out[i]), Bits(kF16Values[i])) << i;
  }

  const GgufTensor* bf16 = f.FindTensor("bf16.weight");
  ASSERT_NE(bf16, nullptr);
  EXPECT_EQ(bf16->type, GgmlType::kBF16);
  EXPECT_EQ(bf16->bytes, 10u);
  const std::vector<float> bf16_out = Dequantized(*bf16);
  for (size_t i = 0; i < kBF16Values.size(); ++i) {
    EXPECT_EQ(Bits(bf16_out[i]), Bits(kBF16Values[i])) << i;
  }

  const GgufTensor* q8 = f.FindTensor("q8.weight");
  ASSERT_NE(q8, nullptr);
  EXPECT_EQ(q8->type, GgmlType::kQ8_0);
  EXPECT_THAT(q8->dims, ElementsAre(32, 3));
  EXPECT_EQ(q8->elements, 96);
  EXPECT_EQ(q8->bytes, 3u * 34u);
  const std::vector<float> q8_out = Dequantized(*q8);
  const std::vector<float> q8_expected = Q8Expected();
  for (size_t i = 0; i < q8_expected.size(); ++i) {
    EXPECT_EQ(Bits(q8_out[i]), Bits(q8_expected[i])) << i;
  }

  EXPECT_EQ(f.FindTensor("absent"), nullptr);
  // Every tensor's data starts at an aligned offset of the data section, inside the file.
  for (const GgufTensor& t : f.tensors()) {
    const size_t at = static_cast<size_t>(t.data - f.file_data());
    EXPECT_GE(at, f.data_offset());
    EXPECT_EQ((at - f.data_offset()) % f.alignment(), 0u);
    EXPECT_LE(at + t.bytes, f.file_size());
  }
}

TEST(GgufTest, TypeNames) {
  EXPECT_EQ(GgmlTypeName(0), "F32");
  EXPECT_EQ(GgmlTypeName(1), "F16");
  EXPECT_EQ(GgmlTypeName(2), "Q4_0");
  EXPECT_EQ(GgmlTypeName(8), "Q8_0");
  EXPECT_EQ(GgmlTypeName(12), "Q4_K");
  EXPECT_EQ(GgmlTypeName(15), "Q8_K");
  EXPECT_EQ(GgmlTypeName(24), "I8");
  EXPECT_EQ(GgmlTypeName(28), "F64");
  EXPECT_EQ(GgmlTypeName(30), "BF16");
  EXPECT_EQ(GgmlTypeName(1000), "unknown");
  EXPECT_EQ(GgufValueTypeName(8), "string");
  EXPECT_EQ(GgufValueTypeName(13), "unknown");
}

TEST(GgufTest, RoundTripsEveryMetadataAndTensorType) {
  std::unique_ptr<GgufFile> f = MustParse(FullBuilder().Build());
  ASSERT_NE(f, nullptr);
  ExpectFullFile(*f);
}

TEST(GgufTest, AcceptsVersion2AndNoTensorsAndNoMetadata) {
  GgufBuilder b;
  b.set_version(2).AddU32("k", 1);
  std::unique_ptr<GgufFile> f = MustParse(b.Build());
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->version(), 2u);
  EXPECT_TRUE(f->tensors().empty());
  EXPECT_LE(f->data_offset(), f->file_size());

  std::unique_ptr<GgufFile> empty = MustParse(GgufBuilder().Build());
  ASSERT_NE(empty, nullptr);
  EXPECT_TRUE(empty->Keys().empty());
  EXPECT_FALSE(empty->Has("general.alignment"));
}

TEST(GgufTest, BuilderQuantizesQ8_0AsGgml) {
  std::vector<float> values(64);
  for (int i = 0; i < 64; ++i) values[i] = std::sin(0.3f * i) * (i < 32 ? 1.0f : 100.0f);
  GgufBuilder b;
  b.AddTensorQ8_0("q", {64}, values);
  std::unique_ptr<GgufFile> f = MustParse(b.Build());
  ASSERT_NE(f, nullptr);
  const std::vector<float> out = Dequantized(f->tensors()[0]);
  for (int i = 0; i < 64; ++i) {
    const float amax = i < 32 ? 1.0f : 100.0f;
    EXPECT_NEAR(out[i], values[i], amax / 127.0f) << i;  // half a step, plus the fp16 scale
  }
}

TEST(GgufTest, HonoursAlignment) {
  for (uint32_t alignment : {1u, 2u, 8u, 64u, 4096u, 65536u}) {
    SCOPED_TRACE(alignment);
    GgufBuilder b;
    b.set_alignment(alignment);
    b.AddTensorF16Bits("a", {3}, {0x3c00, 0x4000, 0x4200});
    b.AddTensorF32("b", {2}, {1.0f, 2.0f});
    GgufLayout layout;
    const std::string bytes = b.Build(&layout);
    std::unique_ptr<GgufFile> f = MustParse(bytes);
    ASSERT_NE(f, nullptr);
    EXPECT_EQ(f->alignment(), alignment);
    EXPECT_EQ(*f->GetUint32("general.alignment"), alignment);
    EXPECT_EQ(f->data_offset(), layout.data_offset);
    EXPECT_EQ(f->tensors()[1].data - f->file_data(), static_cast<ptrdiff_t>(layout.tensor_data[1]));
    EXPECT_THAT(Dequantized(f->tensors()[0]), ElementsAre(1.0f, 2.0f, 3.0f));
    EXPECT_THAT(Dequantized(f->tensors()[1]), ElementsAre(1.0f, 2.0f));
  }
}

// A temporary file that removes itself.
class TempFile {
 public:
  explicit TempFile(const std::string& bytes) {
    char name[] = "/tmp/gguf_test_XXXXXX";
    const int fd = mkstemp(name);
    EXPECT_GE(fd, 0);
    path_ = name;
    if (fd >= 0) {
      EXPECT_EQ(write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
      close(fd);
    }
  }
  ~TempFile() { unlink(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(GgufTest, OpenMapsTheSameFileFromBytesParses) {
  const std::string bytes = FullBuilder().Build();
  TempFile file(bytes);
  absl::StatusOr<std::unique_ptr<GgufFile>> mapped = GgufFile::Open(file.path());
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  std::unique_ptr<GgufFile> parsed = MustParse(bytes);
  ASSERT_NE(parsed, nullptr);
  ExpectFullFile(**mapped);
  EXPECT_EQ((*mapped)->file_size(), parsed->file_size());
  EXPECT_EQ(std::memcmp((*mapped)->file_data(), parsed->file_data(), bytes.size()), 0);
  EXPECT_EQ((*mapped)->Keys(), parsed->Keys());
  EXPECT_EQ((*mapped)->data_offset(), parsed->data_offset());
  ASSERT_EQ((*mapped)->tensors().size(), parsed->tensors().size());
  for (size_t i = 0; i < parsed->tensors().size(); ++i) {
    const GgufTensor& a = (*mapped)->tensors()[i];
    const GgufTensor& b = parsed->tensors()[i];
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.type, b.type);
    EXPECT_EQ(a.dims, b.dims);
    EXPECT_EQ(a.bytes, b.bytes);
    EXPECT_EQ(a.data - (*mapped)->file_data(), b.data - parsed->file_data());
    EXPECT_EQ(std::memcmp(a.data, b.data, a.bytes), 0);
  }
}

TEST(GgufTest, OpenErrors) {
  absl::StatusOr<std::unique_ptr<GgufFile>> missing = GgufFile::Open("/nonexistent/model.gguf");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()),
              AllOf(HasSubstr("/nonexistent/model.gguf"), HasSubstr("No such file")));

  absl::StatusOr<std::unique_ptr<GgufFile>> dir = GgufFile::Open("/tmp");
  EXPECT_EQ(dir.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(dir.status().message()), HasSubstr("not a regular file"));

  TempFile empty("");
  absl::StatusOr<std::unique_ptr<GgufFile>> e = GgufFile::Open(empty.path());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(e.status().message()),
              AllOf(StartsWith(empty.path() + ": "), HasSubstr("truncated"), HasSubstr("magic")));

  GgufBuilder bad;
  bad.set_version(1);
  TempFile v1(bad.Build());
  absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::Open(v1.path());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(f.status().message()),
              AllOf(StartsWith(v1.path()), HasSubstr("version 1")));

  if (geteuid() != 0) {  // root reads anything
    TempFile locked(FullBuilder().Build());
    ASSERT_EQ(chmod(locked.path().c_str(), 0), 0);
    absl::StatusOr<std::unique_ptr<GgufFile>> denied = GgufFile::Open(locked.path());
    EXPECT_EQ(denied.status().code(), absl::StatusCode::kPermissionDenied);
    EXPECT_THAT(std::string(denied.status().message()), HasSubstr(locked.path()));
  }
}

// Every strict prefix of a valid file is refused cleanly and says "truncated"; the whole file
// is accepted. Without trailing padding, every byte of the file matters.
TEST(GgufTest, RefusesEveryPrefix) {
  GgufBuilder b = FullBuilder();
  b.set_pad_end(false);
  const std::string bytes = b.Build();
  ASSERT_NE(MustParse(bytes), nullptr);
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_THAT(RefusalOf(bytes.substr(0, n)), AllOf(StartsWith("GGUF"), HasSubstr("truncated")))
        << "prefix of " << n << " bytes";
  }
}

TEST(GgufTest, RefusesBadMagic) {
  GgufBuilder b;
  b.set_magic("GGML");
  EXPECT_THAT(RefusalOf(b.Build()), AllOf(HasSubstr("magic"), HasSubstr("GGML")));
  EXPECT_THAT(RefusalOf("GG"), AllOf(HasSubstr("truncated"), HasSubstr("magic")));
  EXPECT_THAT(RefusalOf(""), AllOf(HasSubstr("truncated"), HasSubstr("magic")));
}

TEST(GgufTest, RefusesOtherVersions) {
  GgufBuilder b;
  EXPECT_THAT(RefusalOf(b.set_version(1).Build()),
              AllOf(HasSubstr("version 1 is not supported"), HasSubstr("2 and 3")));
  EXPECT_THAT(RefusalOf(b.set_version(4).Build()),
              AllOf(HasSubstr("version 4 is not supported"), HasSubstr("2 and 3")));
  EXPECT_THAT(RefusalOf(b.set_version(0).Build()), HasSubstr("version 0 is not supported"));
  EXPECT_THAT(
      RefusalOf(b.set_version(0x03000000).Build()),
      AllOf(HasSubstr("version 50331648"), HasSubstr("byteswapped"), HasSubstr("big-endian")));
  EXPECT_THAT(RefusalOf(b.set_version(0x02000000).Build()),
              AllOf(HasSubstr("version 2 byteswapped"), HasSubstr("big-endian")));
}

TEST(GgufTest, RefusesHugeCounts) {
  GgufBuilder b;
  b.AddU32("k", 1);
  b.set_tensor_count(uint64_t{1} << 21);
  EXPECT_THAT(RefusalOf(b.Build()),
              AllOf(HasSubstr("tensor_count = 2097152"), HasSubstr("limit of 1048576")));
  b.set_tensor_count(~uint64_t{0});
  EXPECT_THAT(RefusalOf(b.Build()), HasSubstr("tensor_count = 18446744073709551615"));
  b.set_tensor_count(1000);  // within the limit, not within the file
  EXPECT_THAT(RefusalOf(b.Build()),
              AllOf(HasSubstr("tensor_count = 1000"), HasSubstr("truncated")));

  GgufBuilder k;
  k.AddU32("k", 1);
  k.set_kv_count(uint64_t{1} << 40);
  EXPECT_THAT(RefusalOf(k.Build()),
              AllOf(HasSubstr("metadata_kv_count = 1099511627776"), HasSubstr("limit")));
  k.set_kv_count(1000);
  EXPECT_THAT(RefusalOf(k.Build()),
              AllOf(HasSubstr("metadata_kv_count = 1000"), HasSubstr("truncated")));
}

TEST(GgufTest, RefusesHugeStrings) {
  GgufBuilder value;
  value.AddRaw("s", t::kGgufString, GgufBuilder::Pod(uint64_t{1} << 60) + "abc");
  EXPECT_THAT(RefusalOf(value.Build()),
              AllOf(HasSubstr("metadata key 's'"), HasSubstr("string value length"),
                    HasSubstr("1152921504606846976"), HasSubstr("limit of 1048576")));

  GgufBuilder past_end;
  past_end.AddRaw("s", t::kGgufString, GgufBuilder::Pod(uint64_t{1000}) + "abc");
  EXPECT_THAT(RefusalOf(past_end.Build()),
              AllOf(HasSubstr("truncated"), HasSubstr("string value length 1000")));

  GgufBuilder key;
  key.AddU8(std::string(70000, 'k'), 1);
  EXPECT_THAT(RefusalOf(key.Build()),
              AllOf(HasSubstr("key length 70000"), HasSubstr("limit of 65535")));

  GgufBuilder name;
  name.AddTensorF32(std::string(65536, 'n'), {1}, {1.0f});
  EXPECT_THAT(RefusalOf(name.Build()),
              AllOf(HasSubstr("tensor #0"), HasSubstr("name length 65536")));

  GgufBuilder element;
  element.AddRawArray("a", t::kGgufString, 2,
                      GgufBuilder::Str("ok") + GgufBuilder::Pod(~uint64_t{0}));
  EXPECT_THAT(RefusalOf(element.Build()),
              AllOf(HasSubstr("'a'"), HasSubstr("element 1 length 18446744073709551615")));
}

TEST(GgufTest, RefusesHugeArrayCounts) {
  GgufBuilder b;
  b.AddRawArray("a", t::kGgufU32, uint64_t{1} << 62, "");
  EXPECT_THAT(RefusalOf(b.Build()),
              AllOf(HasSubstr("metadata key 'a'"), HasSubstr("array count 4611686018427387904"),
                    HasSubstr("u32")));
  GgufBuilder s;
  s.AddRawArray("s", t::kGgufString, 1000, GgufBuilder::Str("x"));
  EXPECT_THAT(RefusalOf(s.Build()),
              AllOf(HasSubstr("array count 1000 of string"), HasSubstr("truncated")));
}

TEST(GgufTest, RefusesBadValues) {
  GgufBuilder bad_bool;
  bad_bool.AddRaw("b", t::kGgufBool, "\x02");
  EXPECT_THAT(RefusalOf(bad_bool.Build()),
              AllOf(HasSubstr("metadata key 'b'"), HasSubstr("bool value = 2")));

  GgufBuilder bad_bools;
  bad_bools.AddRawArray("bs", t::kGgufBool, 3, std::string("\x00\x01\x05", 3));
  EXPECT_THAT(RefusalOf(bad_bools.Build()), HasSubstr("bool array element 2 = 5"));

  for (uint32_t type : {13u, 0xffffffffu}) {
    GgufBuilder unknown;
    unknown.AddRaw("u", type, "12345678");
    EXPECT_THAT(RefusalOf(unknown.Build()),
                AllOf(HasSubstr("metadata key 'u'"),
                      HasSubstr(absl::StrCat("value type ", type, " is unknown"))));
  }

  GgufBuilder nested;
  nested.AddRawArray("n", t::kGgufArray, 1,
                     GgufBuilder::Pod(uint32_t{t::kGgufU8}) + GgufBuilder::Pod(uint64_t{1}) + "x");
  EXPECT_THAT(RefusalOf(nested.Build()),
              AllOf(HasSubstr("'n'"), HasSubstr("arrays of arrays are not supported")));

  GgufBuilder element_type;
  element_type.AddRawArray("e", 99, 0, "");
  EXPECT_THAT(RefusalOf(element_type.Build()), HasSubstr("array element type 99 is unknown"));
}

TEST(GgufTest, RefusesDuplicates) {
  GgufBuilder key;
  key.AddU32("k", 1).AddString("other", "x").AddU8("k", 2);
  EXPECT_THAT(RefusalOf(key.Build()), AllOf(HasSubstr("metadata key 'k' (kv #2)"),
                                            HasSubstr("duplicate key"), HasSubstr("kv #0")));

  GgufBuilder tensor;
  tensor.AddTensorF32("w", {1}, {1.0f});
  tensor.AddTensorF32("w", {1}, {2.0f});
  EXPECT_THAT(RefusalOf(tensor.Build()),
              AllOf(HasSubstr("tensor 'w' (#1)"), HasSubstr("duplicate tensor name")));
}

TEST(GgufTest, RefusesBadAlignment) {
  for (uint32_t alignment : {0u, 24u, 3u, 1u << 17, 0x80000000u}) {
    GgufBuilder b;  // laid out with 32; the reader refuses the key before any layout
    b.AddU32("general.alignment", alignment);
    b.AddTensorF32("w", {1}, {1.0f});
    EXPECT_THAT(RefusalOf(b.Build()),
                AllOf(HasSubstr(absl::StrCat("general.alignment = ", alignment)),
                      HasSubstr("power of two in [1, 65536]")));
  }
  GgufBuilder wrong_type;
  wrong_type.AddU64("general.alignment", 32);
  EXPECT_THAT(RefusalOf(wrong_type.Build()),
              AllOf(HasSubstr("general.alignment has type u64"), HasSubstr("u32")));
}

TEST(GgufTest, RefusesBadDims) {
  for (uint32_t n_dims : {0u, 5u, 0xffffffffu}) {
    GgufBuilder b;
    b.tensor(b.AddTensorF32("w", {1}, {1.0f})).n_dims = n_dims;
    EXPECT_THAT(RefusalOf(b.Build()),
                AllOf(HasSubstr("tensor 'w' (#0)"),
                      HasSubstr(absl::StrCat("n_dims = ", n_dims, ": must be in [1, 4]"))));
  }
  GgufBuilder zero;
  zero.AddTensorF32("w", {2, 0}, {});
  EXPECT_THAT(RefusalOf(zero.Build()), AllOf(HasSubstr("tensor 'w'"), HasSubstr("ne[1] = 0")));
}

TEST(GgufTest, RefusesElementCountOverflow) {
  struct Case {
    std::vector<uint64_t> dims;
    std::string field;
  };
  const Case cases[] = {
      {{uint64_t{1} << 32, uint64_t{1} << 32}, "ne[1] = 4294967296"},
      {{~uint64_t{0}}, "ne[0] = 18446744073709551615"},
      {{uint64_t{1} << 63, 1}, "ne[0] = 9223372036854775808"},
      {{uint64_t{1} << 24, uint64_t{1} << 24, 2}, "ne[2] = 2"},
      {{3, 3, uint64_t{1} << 21, uint64_t{1} << 24}, "ne[3] = 16777216"},
      {{(uint64_t{1} << 48) + 1}, "ne[0] = 281474976710657"},
  };
  for (const Case& c : cases) {
    GgufBuilder b;
    b.AddTensorF32("w", c.dims, {1.0f});
    EXPECT_THAT(RefusalOf(b.Build()),
                AllOf(HasSubstr("tensor 'w'"), HasSubstr(c.field), HasSubstr("2^48")));
  }
  // Exactly 2^48 elements is within the limit: refused only because the data is not there.
  GgufBuilder at_limit;
  at_limit.AddTensorF32("w", {uint64_t{1} << 24, uint64_t{1} << 24}, {1.0f});
  EXPECT_THAT(RefusalOf(at_limit.Build()),
              AllOf(HasSubstr("tensor 'w'"), HasSubstr("past the end of the file")));
}

TEST(GgufTest, RefusesUnsupportedTensorTypes) {
  GgufBuilder b;
  b.AddTensorRaw("blk.0.attn_q.weight", {256}, 12, std::string(144, '\0'));
  EXPECT_THAT(RefusalOf(b.Build()),
              HasSubstr("tensor 'blk.0.attn_q.weight' (#0): type 12 (Q4_K) is not supported "
                        "(F32, F16, BF16, Q8_0)"));
  GgufBuilder unknown;
  unknown.AddTensorRaw("w", {1}, 77, "abcd");
  EXPECT_THAT(RefusalOf(unknown.Build()), HasSubstr("type 77 (unknown) is not supported"));
}

TEST(GgufTest, RefusesQ8_0WithRaggedRows) {
  GgufBuilder b;
  b.AddTensorQ8_0Blocks("q", {16, 2}, {Q8_0Block{}});
  EXPECT_THAT(RefusalOf(b.Build()), AllOf(HasSubstr("tensor 'q'"), HasSubstr("Q8_0"),
                                          HasSubstr("multiple of 32"), HasSubstr("ne[0] = 16")));
}

TEST(GgufTest, RefusesBadOffsets) {
  GgufBuilder misaligned;
  misaligned.AddTensorF32("a", {1}, {1.0f});
  misaligned.tensor(misaligned.AddTensorF32("b", {1}, {1.0f})).offset = 8;
  EXPECT_THAT(RefusalOf(misaligned.Build()),
              AllOf(HasSubstr("tensor 'b' (#1)"),
                    HasSubstr("offset 8 is not a multiple of the alignment 32")));

  GgufBuilder far;
  far.tensor(far.AddTensorF32("w", {4}, {1, 2, 3, 4})).offset = uint64_t{1} << 40;
  EXPECT_THAT(RefusalOf(far.Build()),
              AllOf(HasSubstr("tensor 'w'"), HasSubstr("offset 1099511627776"),
                    HasSubstr("past the end of the file")));

  GgufBuilder wrap;  // offset + bytes wraps around 2^64
  wrap.tensor(wrap.AddTensorF32("w", {4}, {1, 2, 3, 4})).offset = ~uint64_t{0} - 31;
  EXPECT_THAT(RefusalOf(wrap.Build()), HasSubstr("past the end of the file"));

  GgufBuilder cut;
  cut.AddTensorF32("a", {8}, std::vector<float>(8, 1.0f));
  cut.AddTensorF32("b", {8}, std::vector<float>(8, 1.0f));
  std::string bytes = cut.set_pad_end(false).Build();
  bytes.resize(bytes.size() - 1);
  EXPECT_THAT(RefusalOf(bytes), AllOf(HasSubstr("tensor 'b' (#1)"), HasSubstr("truncated"),
                                      HasSubstr("past the end of the file")));

  GgufBuilder no_data;  // the data section's padding is cut off
  no_data.AddTensorF32("a", {1}, {1.0f});
  GgufLayout layout;
  bytes = no_data.Build(&layout);
  bytes.resize(layout.header_end + 1);
  EXPECT_THAT(RefusalOf(bytes), AllOf(HasSubstr("truncated"), HasSubstr("data section")));
}

TEST(GgufTest, RefusesOverlappingTensors) {
  GgufBuilder same;
  same.AddTensorF32("a", {8}, std::vector<float>(8, 1.0f));
  same.tensor(same.AddTensorF32("b", {8}, std::vector<float>(8, 2.0f))).offset = 0;
  EXPECT_THAT(RefusalOf(same.Build()),
              AllOf(HasSubstr("tensor 'b' (#1)"), HasSubstr("overlaps the data of tensor 'a'")));

  GgufBuilder partial;  // a is 64 bytes at 0; b claims 48
  partial.set_alignment(16);
  partial.AddTensorF32("a", {16}, std::vector<float>(16, 1.0f));
  partial.tensor(partial.AddTensorF32("b", {4}, {1, 2, 3, 4})).offset = 48;
  EXPECT_THAT(RefusalOf(partial.Build()),
              AllOf(HasSubstr("tensor 'b'"), HasSubstr("[48, 64)"), HasSubstr("'a' [0, 64)")));

  GgufBuilder reversed;  // listed out of order: still found
  reversed.set_alignment(16);
  reversed.tensor(reversed.AddTensorF32("x", {4}, {1, 2, 3, 4})).offset = 64;
  reversed.tensor(reversed.AddTensorF32("y", {20}, std::vector<float>(20, 1.0f))).offset = 0;
  EXPECT_THAT(RefusalOf(reversed.Build()),
              AllOf(HasSubstr("tensor 'x'"), HasSubstr("overlaps the data of tensor 'y'")));

  GgufBuilder adjacent;  // touching is fine
  adjacent.set_alignment(16);
  adjacent.AddTensorF32("a", {4}, {1, 2, 3, 4});
  adjacent.AddTensorF32("b", {4}, {5, 6, 7, 8});
  EXPECT_NE(MustParse(adjacent.Build()), nullptr);
}

TEST(GgufTest, GettersCheckTypes) {
  std::unique_ptr<GgufFile> f = MustParse(FullBuilder().Build());
  ASSERT_NE(f, nullptr);
  const auto expect_invalid = [](const absl::Status& s, const std::string& key,
                                 const std::string& stored, const std::string& wanted) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()),
                AllOf(HasSubstr(absl::StrCat("'", key, "'")),
                      HasSubstr(absl::StrCat("has type ", stored)), HasSubstr(wanted)));
  };
  expect_invalid(f->GetInt("string").status(), "string", "string", "an integer");
  expect_invalid(f->GetInt("true").status(), "true", "bool", "an integer");
  expect_invalid(f->GetInt("f32").status(), "f32", "f32", "an integer");
  expect_invalid(f->GetUint32("strings").status(), "strings", "array of string", "an integer");
  expect_invalid(f->GetFloat("string").status(), "string", "string", "a number");
  expect_invalid(f->GetBool("u8").status(), "u8", "u8", "bool");
  expect_invalid(f->GetString("u32").status(), "u32", "u32", "string");
  expect_invalid(f->GetStringArray("string").status(), "string", "string", "array of string");
  expect_invalid(f->GetStringArray("u32s").status(), "u32s", "array of u32", "array of string");
  expect_invalid(f->GetIntArray("f32s").status(), "f32s", "array of f32", "array of integers");
  expect_invalid(f->GetIntArray("bools").status(), "bools", "array of bool", "array of integers");
  expect_invalid(f->GetFloatArray("i32s").status(), "i32s", "array of i32", "f32 or f64");
  expect_invalid(f->GetIntOr("string", 5).status(), "string", "string", "an integer");
  expect_invalid(f->GetFloatOr("strings", 5).status(), "strings", "array of string", "a number");

  // Values out of the requested range.
  const absl::Status big = f->GetInt("u64.max").status();
  EXPECT_EQ(big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(big.message()),
              AllOf(HasSubstr("'u64.max'"), HasSubstr("18446744073709551615"), HasSubstr("int64")));
  const absl::Status negative = f->GetUint32("i8").status();
  EXPECT_EQ(negative.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(negative.message()),
              AllOf(HasSubstr("'i8' = -128"), HasSubstr("uint32")));
  const absl::Status wide = f->GetUint32("u64").status();
  EXPECT_EQ(wide.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wide.message()), AllOf(HasSubstr("1234567890123"), HasSubstr("uint32")));
  EXPECT_EQ(*f->GetUint32("u16"), 65535u);

  GgufBuilder b;
  b.AddU64Array("big", {1, ~uint64_t{0}});
  std::unique_ptr<GgufFile> g = MustParse(b.Build());
  ASSERT_NE(g, nullptr);
  EXPECT_THAT(std::string(g->GetIntArray("big").status().message()),
              AllOf(HasSubstr("'big'"), HasSubstr("element 1"), HasSubstr("int64")));

  // Absent keys.
  for (const absl::Status& s :
       {f->GetInt("nope").status(), f->GetUint32("nope").status(), f->GetFloat("nope").status(),
        f->GetBool("nope").status(), f->GetString("nope").status(),
        f->GetStringArray("nope").status(), f->GetIntArray("nope").status(),
        f->GetFloatArray("nope").status(), f->TypeOf("nope").status()}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("'nope'"));
  }
  EXPECT_FALSE(f->Has("nope"));
  EXPECT_TRUE(f->Has("u8"));
  EXPECT_EQ(*f->GetIntOr("nope", -7), -7);
  EXPECT_EQ(*f->GetIntOr("i16", -7), -32768);
  EXPECT_EQ(*f->GetFloatOr("nope", 2.5), 2.5);
  EXPECT_EQ(*f->GetFloatOr("f32", 2.5), 0.15625);
  EXPECT_EQ(*f->GetFloatOr("u8", 2.5), 255.0);
}

}  // namespace
}  // namespace kvtier::engine
