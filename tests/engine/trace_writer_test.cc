// The engine's trace writer (engine/trace_writer.h) against the benchmark's reader
// (bench/trace.h): what one writes in docs/trace-format.md's format, the other reads back
// exactly, whatever order the records came in; bad headers and records are refused.
#include "engine/trace_writer.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench/trace.h"
#include "gtest/gtest.h"

namespace kvtier::engine {
namespace {

std::string TempPath() {
  char path[] = "/tmp/kvtier-trace-writer-test-XXXXXX";
  const int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  close(fd);
  return path;
}

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-4, 4);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// The values of raw trace bytes of `dtype` as floats.
std::vector<float> AsFloats(const std::vector<uint8_t>& bytes, DType dtype) {
  std::vector<float> out(bytes.size() / DTypeSize(dtype));
  for (size_t i = 0; i < out.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(&out[i], bytes.data() + 4 * i, 4);
    } else if (dtype == DType::kF16) {
      Half h;
      std::memcpy(&h, bytes.data() + 2 * i, 2);
      out[i] = HalfToFloat(h);
    } else {
      BFloat16 b;
      std::memcpy(&b, bytes.data() + 2 * i, 2);
      out[i] = BFloat16ToFloat(b);
    }
  }
  return out;
}

std::vector<float> Rounded(const std::vector<float>& x, DType dtype) {
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    out[i] = dtype == DType::kF16    ? HalfToFloat(FloatToHalf(x[i]))
             : dtype == DType::kBF16 ? BFloat16ToFloat(FloatToBFloat16(x[i]))
                                     : x[i];
  }
  return out;
}

class TraceWriterTest : public ::testing::TestWithParam<DType> {};

TEST_P(TraceWriterTest, TheBenchmarksReaderReadsBackEveryRecord) {
  TraceHeader h;
  h.layers = 2;
  h.q_heads = 4;
  h.kv_heads = 2;
  h.head_dim = 8;
  h.page_size = 4;
  h.dtype = GetParam();
  h.prefill_tokens = 7;
  h.steps = 3;
  const std::string path = TempPath();
  absl::StatusOr<std::unique_ptr<TraceWriter>> w = TraceWriter::Create(path, h);
  ASSERT_TRUE(w.ok()) << w.status();
  const size_t row = 2 * 8, qrow = 4 * 8;
  std::vector<std::vector<float>> k(2), v(2), q(6), sk(6), sv(6);
  // Steps first and backwards, prefill in two pieces: offsets, not order, place records.
  for (int s = 2; s >= 0; --s) {
    for (int l = 0; l < 2; ++l) {
      const int i = s * 2 + l;
      q[i] = Random(qrow, 100 + i);
      sk[i] = Random(row, 200 + i);
      sv[i] = Random(row, 300 + i);
      ASSERT_TRUE((*w)->WriteStep(s, l, q[i].data(), sk[i].data(), sv[i].data()).ok());
    }
  }
  for (int l = 0; l < 2; ++l) {
    k[l] = Random(7 * row, 10 + l);
    v[l] = Random(7 * row, 20 + l);
    ASSERT_TRUE((*w)->WritePrefill(l, 0, 3, k[l].data(), v[l].data()).ok());
    ASSERT_TRUE((*w)->WritePrefill(l, 3, 4, k[l].data() + 3 * row, v[l].data() + 3 * row).ok());
  }
  EXPECT_EQ((*w)->WriteStep(3, 0, q[0].data(), sk[0].data(), sv[0].data()).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*w)->WritePrefill(0, 5, 3, k[0].data(), v[0].data()).code(),
            absl::StatusCode::kOutOfRange);
  ASSERT_TRUE((*w)->Close().ok());

  absl::StatusOr<std::unique_ptr<bench::TraceSource>> r = bench::OpenTraceFile(path);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->geometry().num_layers, 2);
  EXPECT_EQ((*r)->geometry().num_q_heads, 4);
  EXPECT_EQ((*r)->geometry().page_size, 4);
  EXPECT_EQ((*r)->geometry().dtype, GetParam());
  EXPECT_EQ((*r)->prefill_tokens(), 7);
  EXPECT_EQ((*r)->num_steps(), 3);
  std::vector<uint8_t> a, b, c;
  for (int l = 0; l < 2; ++l) {
    ASSERT_TRUE((*r)->Prefill(l, &a, &b).ok());
    EXPECT_EQ(AsFloats(a, GetParam()), Rounded(k[l], GetParam())) << "layer " << l;
    EXPECT_EQ(AsFloats(b, GetParam()), Rounded(v[l], GetParam())) << "layer " << l;
  }
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE((*r)->Step(i / 2, i % 2, &a, &b, &c).ok());
    EXPECT_EQ(AsFloats(a, GetParam()), Rounded(q[i], GetParam())) << "record " << i;
    EXPECT_EQ(AsFloats(b, GetParam()), Rounded(sk[i], GetParam())) << "record " << i;
    EXPECT_EQ(AsFloats(c, GetParam()), Rounded(sv[i], GetParam())) << "record " << i;
  }
  std::remove(path.c_str());
}

INSTANTIATE_TEST_SUITE_P(DTypes, TraceWriterTest,
                         ::testing::Values(DType::kF16, DType::kBF16, DType::kF32),
                         [](const auto& p) { return std::string(DTypeName(p.param)); });

TEST(TraceWriter, RefusesHeadersTheFormatDoesNotAllowAndIncompleteFiles) {
  TraceHeader h;
  h.layers = 1;
  h.q_heads = 2;
  h.kv_heads = 2;
  h.head_dim = 8;
  h.page_size = 4;
  h.prefill_tokens = 2;
  h.steps = 1;
  const std::string path = TempPath();
  for (auto [field, breaker] : std::vector<std::pair<std::string, void (*)(TraceHeader&)>>{
           {"head_dim", [](TraceHeader& x) { x.head_dim = 12; }},
           {"page_size", [](TraceHeader& x) { x.page_size = 6; }},
           {"num_kv_heads", [](TraceHeader& x) { x.kv_heads = 3; }},
           {"prefill_tokens", [](TraceHeader& x) { x.prefill_tokens = 0; }}}) {
    TraceHeader bad = h;
    breaker(bad);
    absl::StatusOr<std::unique_ptr<TraceWriter>> w = TraceWriter::Create(path, bad);
    EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(w.status().message().find(field), std::string::npos) << w.status();
  }
  // A record never written leaves the file short: Close says so.
  absl::StatusOr<std::unique_ptr<TraceWriter>> w = TraceWriter::Create(path, h);
  ASSERT_TRUE(w.ok());
  const std::vector<float> x(16, 1.0f);
  ASSERT_TRUE((*w)->WritePrefill(0, 0, 2, x.data(), x.data()).ok());
  EXPECT_EQ((*w)->Close().code(), absl::StatusCode::kDataLoss);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace kvtier::engine
