#include "bench/trace.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "core/status.h"
#include "tests/testutil/random_fill.h"

namespace kvtier::bench {
namespace {

using ::testing::HasSubstr;
using ::testing::TestWithParam;
using ::testing::Values;

using Bytes = std::vector<uint8_t>;

Geometry Tiny(DType t = DType::kF16) {
  Geometry g;
  g.num_layers = 2;
  g.num_q_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = 16;
  g.page_size = 8;
  g.dtype = t;
  return g;
}

SyntheticTraceOptions TinyOptions(DType t = DType::kF16) {
  SyntheticTraceOptions o;
  o.geometry = Tiny(t);
  o.prefill_tokens = 100;  // a partial last page
  o.num_steps = 5;
  o.num_topics = 4;
  o.heavy_page_fraction = 0.2;
  return o;
}

std::unique_ptr<TraceSource> Make(const SyntheticTraceOptions& o) {
  auto src = MakeSyntheticTrace(o);
  EXPECT_TRUE(src.ok()) << src.status();
  return std::move(src).value();
}

struct StepRecord {
  Bytes q, k, v;
  bool operator==(const StepRecord&) const = default;
};
StepRecord GetStep(TraceSource& src, int32_t step, int32_t layer) {
  StepRecord r;
  EXPECT_TRUE(src.Step(step, layer, &r.q, &r.k, &r.v).ok());
  return r;
}
std::pair<Bytes, Bytes> GetPrefill(TraceSource& src, int32_t layer) {
  Bytes k, v;
  EXPECT_TRUE(src.Prefill(layer, &k, &v).ok());
  return {k, v};
}

std::string TempPath(const std::string& name) { return ::testing::TempDir() + "/" + name; }

Bytes ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), {});
}
void WriteAll(const std::string& path, const Bytes& data) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}
void PutU32(Bytes& b, size_t at, uint32_t x) {
  for (size_t i = 0; i < 4; ++i) b[at + i] = static_cast<uint8_t>(x >> (8 * i));
}

// --- synthetic source --------------------------------------------------------------------

TEST(SyntheticTraceTest, SizesFollowTheGeometry) {
  auto src = Make(TinyOptions());
  EXPECT_EQ(src->geometry(), Tiny());
  EXPECT_EQ(src->prefill_tokens(), 100);
  EXPECT_EQ(src->num_steps(), 5);
  auto [k, v] = GetPrefill(*src, 1);
  EXPECT_EQ(k.size(), 100u * 2 * 16 * 2);
  EXPECT_EQ(v.size(), k.size());
  const StepRecord r = GetStep(*src, 4, 1);
  EXPECT_EQ(r.q.size(), 4u * 16 * 2);
  EXPECT_EQ(r.k.size(), 2u * 16 * 2);
  EXPECT_EQ(r.v.size(), 2u * 16 * 2);
}

TEST(SyntheticTraceTest, SameSeedSameBytes) {
  auto a = Make(TinyOptions()), b = Make(TinyOptions());
  EXPECT_EQ(GetPrefill(*a, 1), GetPrefill(*b, 1));
  for (int32_t t = 0; t < 5; ++t) EXPECT_EQ(GetStep(*a, t, 0), GetStep(*b, t, 0)) << t;
  SyntheticTraceOptions o = TinyOptions();
  o.seed = 2;
  auto c = Make(o);
  EXPECT_NE(GetPrefill(*a, 1), GetPrefill(*c, 1));
  EXPECT_NE(GetStep(*a, 2, 0), GetStep(*c, 2, 0));
}

TEST(SyntheticTraceTest, LayersAndStepsDiffer) {
  auto src = Make(TinyOptions());
  EXPECT_NE(GetPrefill(*src, 0), GetPrefill(*src, 1));
  const StepRecord s0 = GetStep(*src, 0, 0), s1 = GetStep(*src, 1, 0), l1 = GetStep(*src, 0, 1);
  EXPECT_NE(s0.q, s1.q);
  EXPECT_NE(s0.k, s1.k);
  EXPECT_NE(s0.v, s1.v);
  EXPECT_NE(s0.q, l1.q);
  EXPECT_NE(s0.k, l1.k);
}

TEST(SyntheticTraceTest, AnyAccessOrderGivesTheSameBytes) {
  auto sequential = Make(TinyOptions()), random = Make(TinyOptions());
  std::vector<StepRecord> want;
  for (int32_t t = 0; t < 5; ++t) want.push_back(GetStep(*sequential, t, 1));
  for (int32_t t : {4, 1, 3, 0, 2}) {
    EXPECT_EQ(GetStep(*random, t, 1), want[static_cast<size_t>(t)]) << t;
  }
  EXPECT_EQ(GetPrefill(*random, 0), GetPrefill(*sequential, 0));
}

TEST(SyntheticTraceTest, OutOfRangeIndicesAreErrors) {
  auto src = Make(TinyOptions());
  Bytes q, k, v;
  EXPECT_EQ(src->Prefill(2, &k, &v).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(src->Prefill(-1, &k, &v).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(src->Step(5, 0, &q, &k, &v).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(src->Step(0, 2, &q, &k, &v).code(), absl::StatusCode::kOutOfRange);
}

struct BadOptions {
  const char* name;
  void (*mutate)(SyntheticTraceOptions&);
  const char* message;
};
class SyntheticTraceOptionsTest : public TestWithParam<BadOptions> {};

TEST_P(SyntheticTraceOptionsTest, AreRejectedWithTheirName) {
  SyntheticTraceOptions o = TinyOptions();
  GetParam().mutate(o);
  const auto src = MakeSyntheticTrace(o);
  EXPECT_EQ(src.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(src.status().message()), HasSubstr(GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(
    All, SyntheticTraceOptionsTest,
    Values(BadOptions{"geometry", [](SyntheticTraceOptions& o) { o.geometry.num_kv_heads = 3; },
                      "geometry.num_kv_heads = 3"},
           BadOptions{"no_prefill", [](SyntheticTraceOptions& o) { o.prefill_tokens = 0; },
                      "prefill_tokens = 0"},
           BadOptions{"too_many_topics", [](SyntheticTraceOptions& o) { o.num_topics = 15; },
                      "num_topics = 15: must be in [1, 14]"},
           BadOptions{"low_cosine", [](SyntheticTraceOptions& o) { o.step_cosine = 0.3; },
                      "step_cosine = 0.3: must be in [0.55, 1]"},
           BadOptions{"nan_logit", [](SyntheticTraceOptions& o) { o.heavy_logit = NAN; },
                      "heavy_logit = nan"},
           BadOptions{"jump", [](SyntheticTraceOptions& o) { o.jump_probability = 1.5; },
                      "jump_probability = 1.5"}),
    [](const ::testing::TestParamInfo<BadOptions>& tpi) { return tpi.param.name; });

// fp16 and bf16 traces are the fp32 trace rounded: generation is in float, storage last.
class SyntheticDTypeTest : public TestWithParam<DType> {};

TEST_P(SyntheticDTypeTest, IsTheFp32TraceRounded) {
  const DType t = GetParam();
  auto narrow = Make(TinyOptions(t)), wide = Make(TinyOptions(DType::kF32));
  auto round = [&](const Bytes& f32) {
    Bytes out(f32.size() / 4 * DTypeSize(t));
    for (size_t i = 0; i < f32.size() / 4; ++i) {
      testing::StoreElement(out.data(), t, static_cast<int64_t>(i),
                            testing::LoadElement(f32.data(), DType::kF32, static_cast<int64_t>(i)));
    }
    return out;
  };
  auto [wk, wv] = GetPrefill(*wide, 1);
  auto [nk, nv] = GetPrefill(*narrow, 1);
  EXPECT_EQ(nk, round(wk));
  EXPECT_EQ(nv, round(wv));
  const StepRecord ws = GetStep(*wide, 3, 0), ns = GetStep(*narrow, 3, 0);
  EXPECT_EQ(ns.q, round(ws.q));
  EXPECT_EQ(ns.k, round(ws.k));
  EXPECT_EQ(ns.v, round(ws.v));
  for (size_t i = 0; i < nk.size() / DTypeSize(t); ++i) {
    ASSERT_TRUE(std::isfinite(testing::LoadElement(nk.data(), t, static_cast<int64_t>(i))));
  }
}

INSTANTIATE_TEST_SUITE_P(All, SyntheticDTypeTest, Values(DType::kF16, DType::kBF16, DType::kF32),
                         [](const ::testing::TestParamInfo<DType>& tpi) {
                           return std::string(DTypeName(tpi.param));
                         });

// --- query process -----------------------------------------------------------------------

SyntheticTraceOptions QueryOptions() {
  SyntheticTraceOptions o;
  o.geometry = Llama31_8B();
  o.geometry.num_layers = 2;
  o.prefill_tokens = 64;  // queries do not depend on the prefill length
  o.num_steps = 150;
  return o;
}

class StepCosineTest : public TestWithParam<double> {};

TEST_P(StepCosineTest, MeanMatchesTheOptionWithoutJumps) {
  SyntheticTraceOptions o = QueryOptions();
  o.step_cosine = GetParam();
  o.jump_probability = 0;
  auto src = Make(o);
  double sum = 0;
  int n = 0;
  for (int32_t layer = 0; layer < 2; ++layer) {
    const auto cos = StepCosines(*src, layer);
    ASSERT_TRUE(cos.ok()) << cos.status();
    ASSERT_EQ(cos->size(), 149u);
    sum = std::accumulate(cos->begin(), cos->end(), sum);
    n += static_cast<int>(cos->size());
  }
  EXPECT_NEAR(sum / n, GetParam(), 0.05);
}

INSTANTIATE_TEST_SUITE_P(Settings, StepCosineTest, Values(0.8, 0.95));

TEST(SyntheticQueryTest, JumpsOccurAtTheConfiguredRateAndLowerTheCosine) {
  SyntheticTraceOptions o = QueryOptions();
  o.jump_probability = 0.1;
  auto src = Make(o);
  const Geometry& g = o.geometry;
  const int32_t d = g.head_dim, G = g.group_size();
  int jumps = 0, transitions = 0;
  double cos_jump = 0, cos_stay = 0;
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    std::vector<std::vector<int32_t>> topics;
    for (int32_t h = 0; h < g.num_kv_heads; ++h) {
      auto t = SyntheticDominantTopics(o, layer, h);
      ASSERT_TRUE(t.ok()) << t.status();
      topics.push_back(*std::move(t));
    }
    std::vector<float> prev, cur;
    for (int32_t step = 0; step < o.num_steps; ++step) {
      const StepRecord r = GetStep(*src, step, layer);
      cur.resize(static_cast<size_t>(g.num_q_heads) * d);
      for (size_t i = 0; i < cur.size(); ++i) {
        cur[i] = testing::LoadElement(r.q.data(), g.dtype, static_cast<int64_t>(i));
      }
      for (int32_t h = 0; step > 0 && h < g.num_kv_heads; ++h) {
        const bool jump = topics[static_cast<size_t>(h)][static_cast<size_t>(step)] !=
                          topics[static_cast<size_t>(h)][static_cast<size_t>(step - 1)];
        double c = 0;  // mean over the query group, as the correction check measures it
        for (int32_t qh = h * G; qh < (h + 1) * G; ++qh) {
          double ab = 0, aa = 0, bb = 0;
          for (int32_t i = 0; i < d; ++i) {
            const double a = cur[static_cast<size_t>(qh * d + i)],
                         b = prev[static_cast<size_t>(qh * d + i)];
            ab += a * b, aa += a * a, bb += b * b;
          }
          c += ab / std::sqrt(aa * bb) / G;
        }
        ++transitions;
        if (jump) {
          ++jumps;
          cos_jump += c;
        } else {
          cos_stay += c;
        }
      }
      prev.swap(cur);
    }
  }
  // 2 layers × 8 heads × 149 transitions at p = 0.1: 238 expected, σ ≈ 15.
  EXPECT_NEAR(static_cast<double>(jumps) / transitions, 0.1, 0.02);
  ASSERT_GT(jumps, 0);
  EXPECT_LT(cos_jump / jumps, cos_stay / (transitions - jumps) - 0.15);
}

TEST(SyntheticQueryTest, NoJumpsAtProbabilityZero) {
  SyntheticTraceOptions o = QueryOptions();
  o.jump_probability = 0;
  const auto topics = SyntheticDominantTopics(o, 1, 3);
  ASSERT_TRUE(topics.ok());
  for (int32_t t : *topics) EXPECT_EQ(t, topics->front());
  EXPECT_EQ(SyntheticDominantTopics(o, 2, 0).status().code(), absl::StatusCode::kOutOfRange);
}

// --- attention structure -----------------------------------------------------------------

SyntheticTraceOptions MassOptions() {
  SyntheticTraceOptions o;
  o.geometry.num_layers = 1;
  o.geometry.num_q_heads = 8;
  o.geometry.num_kv_heads = 2;
  o.geometry.head_dim = 128;
  o.geometry.page_size = 16;
  o.prefill_tokens = 8192;
  o.num_steps = 4;
  return o;
}

TEST(SyntheticAttentionTest, TopBudgetHoldsMostButNotAllTheMass) {
  auto src = Make(MassOptions());
  for (int32_t step : {0, 3}) {
    const auto mass = MeasureTopBudgetMass(*src, step, 0, 512);
    ASSERT_TRUE(mass.ok()) << mass.status();
    EXPECT_GT(mass->tokens, 0.85) << step;
    EXPECT_LT(mass->tokens, 0.995) << step;
    EXPECT_GT(mass->pages, 0.75) << step;
    EXPECT_LE(mass->pages, mass->tokens) << step;  // token top-k is the finer oracle
  }
}

TEST(SyntheticAttentionTest, WithoutStructureTheBudgetHoldsLittle) {
  SyntheticTraceOptions o = MassOptions();
  o.sink_logit = o.heavy_logit = o.recent_logit = o.topic_logit = 0;
  auto src = Make(o);
  const auto mass = MeasureTopBudgetMass(*src, 0, 0, 512);
  ASSERT_TRUE(mass.ok()) << mass.status();
  EXPECT_LT(mass->tokens, 0.35);  // 6 % of the tokens
  EXPECT_EQ(MeasureTopBudgetMass(*src, 0, 0, 8).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Exact attention mass per page of KV head `h`'s query group at `step` (mean over the
// group), layer 0.
std::vector<double> PageMass(TraceSource& src, int32_t step, int32_t h) {
  const Geometry& g = src.geometry();
  const int32_t d = g.head_dim, G = g.group_size();
  auto floats = [&](const Bytes& b) {
    std::vector<float> f(b.size() / DTypeSize(g.dtype));
    for (size_t i = 0; i < f.size(); ++i) {
      f[i] = testing::LoadElement(b.data(), g.dtype, static_cast<int64_t>(i));
    }
    return f;
  };
  std::vector<float> keys = floats(GetPrefill(src, 0).first), q;
  for (int32_t s = 0; s <= step; ++s) {
    const StepRecord r = GetStep(src, s, 0);
    const std::vector<float> k = floats(r.k);
    keys.insert(keys.end(), k.begin(), k.end());
    q = floats(r.q);
  }
  const auto tokens = static_cast<int64_t>(keys.size()) / (g.num_kv_heads * d);
  std::vector<double> mass(static_cast<size_t>((tokens + g.page_size - 1) / g.page_size));
  std::vector<double> w(static_cast<size_t>(tokens));
  for (int32_t qh = h * G; qh < (h + 1) * G; ++qh) {
    for (int64_t t = 0; t < tokens; ++t) {
      const float* k = keys.data() + (t * g.num_kv_heads + h) * d;
      double x = 0;
      for (int32_t i = 0; i < d; ++i) x += double{q[static_cast<size_t>(qh * d + i)]} * k[i];
      w[static_cast<size_t>(t)] = x / std::sqrt(static_cast<double>(d));
    }
    const double max = *std::max_element(w.begin(), w.end());
    double total = 0;
    for (double& x : w) total += (x = std::exp(x - max));
    for (int64_t t = 0; t < tokens; ++t) {
      mass[static_cast<size_t>(t / g.page_size)] += w[static_cast<size_t>(t)] / total / G;
    }
  }
  return mass;
}

// The `n` pages of most mass, page 0 (the sink) excluded.
std::vector<size_t> TopPages(const std::vector<double>& mass, size_t n) {
  std::vector<size_t> order(mass.size() - 1);
  std::iota(order.begin(), order.end(), 1);
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(n), order.end(),
                    [&](size_t a, size_t b) { return mass[a] > mass[b]; });
  order.resize(n);
  return order;
}

// Speculative selection: the share of step 1's mass (in the best n pages) that the best n
// pages of step 0 hold, summed over KV heads.
double SpeculativeRecall(TraceSource& src, size_t n) {
  double got = 0, best = 0;
  for (int32_t h = 0; h < src.geometry().num_kv_heads; ++h) {
    const std::vector<double> m0 = PageMass(src, 0, h), m1 = PageMass(src, 1, h);
    for (size_t p : TopPages(m0, n)) got += m1[p];
    for (size_t p : TopPages(m1, n)) best += m1[p];
  }
  return got / best;
}

TEST(SyntheticAttentionTest, HeavyPagesMoveWhenTheTopicJumps) {
  SyntheticTraceOptions o = MassOptions();
  o.jump_probability = 0;
  auto steady = Make(o);
  o.jump_probability = 1;  // a new dominant topic every step
  auto jumpy = Make(o);
  const double steady_recall = SpeculativeRecall(*steady, 24);
  const double jumpy_recall = SpeculativeRecall(*jumpy, 24);
  EXPECT_GT(steady_recall, 0.95);
  EXPECT_LT(jumpy_recall, 0.6);
}

// The statistics of the default trace (Llama-3.1-8B geometry, 32K tokens, budget 2048).
// Slow: run with --gtest_also_run_disabled_tests.
TEST(SyntheticAttentionTest, DISABLED_DefaultTraceStatistics) {
  SyntheticTraceOptions o;
  auto src = Make(o);
  for (int32_t layer : {0, 17}) {
    const auto cos = StepCosines(*src, layer);
    ASSERT_TRUE(cos.ok());
    std::printf("layer %d: mean step cosine %.4f (min %.4f)\n", layer,
                std::accumulate(cos->begin(), cos->end(), 0.0) / static_cast<double>(cos->size()),
                *std::min_element(cos->begin(), cos->end()));
    for (int32_t step : {0, 31, 63}) {
      const auto mass = MeasureTopBudgetMass(*src, step, layer, 2048);
      ASSERT_TRUE(mass.ok());
      std::printf("  step %d: top-2048-token mass %.4f, top-64-page mass %.4f\n", step,
                  mass->tokens, mass->pages);
    }
  }
}

// --- trace files -------------------------------------------------------------------------

class TraceFileRoundTripTest : public TestWithParam<DType> {};

TEST_P(TraceFileRoundTripTest, ReopenedFileEqualsTheSourceBitForBit) {
  const std::string path =
      TempPath(absl::StrCat("round_trip_", std::string(DTypeName(GetParam())), ".kvtrace"));
  auto src = Make(TinyOptions(GetParam()));
  ASSERT_TRUE(WriteTraceFile(*src, path).ok());
  auto file = OpenTraceFile(path);
  ASSERT_TRUE(file.ok()) << file.status();
  TraceSource& f = **file;
  EXPECT_EQ(f.geometry(), src->geometry());
  EXPECT_EQ(f.prefill_tokens(), 100);
  EXPECT_EQ(f.num_steps(), 5);
  for (int32_t layer = 0; layer < 2; ++layer) {
    EXPECT_EQ(GetPrefill(f, layer), GetPrefill(*src, layer)) << layer;
  }
  for (int32_t step = 4; step >= 0; --step) {  // pread: any order
    for (int32_t layer = 0; layer < 2; ++layer) {
      EXPECT_EQ(GetStep(f, step, layer), GetStep(*src, step, layer)) << step << " " << layer;
    }
  }
  Bytes q, k, v;
  EXPECT_EQ(f.Step(5, 0, &q, &k, &v).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(f.Prefill(2, &k, &v).code(), absl::StatusCode::kOutOfRange);
  // Header (64) + 2 layers × K, V [100][2][16] + 5 steps × 2 layers × (4 + 2 + 2) rows of 16.
  const size_t e = DTypeSize(GetParam());
  EXPECT_EQ(ReadAll(path).size(), 64 + 2 * 2 * 100 * 2 * 16 * e + 5 * 2 * 8 * 16 * e);
}

INSTANTIATE_TEST_SUITE_P(All, TraceFileRoundTripTest,
                         Values(DType::kF16, DType::kBF16, DType::kF32),
                         [](const ::testing::TestParamInfo<DType>& tpi) {
                           return std::string(DTypeName(tpi.param));
                         });

class TraceFileErrorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    good_ = TempPath("good.kvtrace");
    auto src = Make(TinyOptions());
    ASSERT_TRUE(WriteTraceFile(*src, good_).ok());
    bytes_ = ReadAll(good_);
  }
  // Opens `data` written to a file; returns the status.
  absl::Status OpenBytes(const Bytes& data) {
    const std::string path = TempPath("bad.kvtrace");
    WriteAll(path, data);
    return OpenTraceFile(path).status();
  }

  std::string good_;
  Bytes bytes_;
};

TEST_F(TraceFileErrorTest, MissingFileIsNotFound) {
  EXPECT_EQ(OpenTraceFile(TempPath("no-such.kvtrace")).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(TraceFileErrorTest, TruncatedFileIsDataLossNamingTheSizes) {
  Bytes cut(bytes_.begin(), bytes_.end() - 1);
  const absl::Status st = OpenBytes(cut);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(st.message()),
              HasSubstr(absl::StrCat(cut.size(), " bytes, expected ", bytes_.size())));
  EXPECT_THAT(std::string(st.message()), HasSubstr("truncated"));
  EXPECT_EQ(OpenBytes(Bytes(bytes_.begin(), bytes_.begin() + 20)).code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(OpenBytes(Bytes(bytes_.begin(), bytes_.begin() + 4)).code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(OpenBytes(Bytes()).code(), absl::StatusCode::kDataLoss);
}

TEST_F(TraceFileErrorTest, TrailingBytesAreDataLoss) {
  Bytes longer = bytes_;
  longer.push_back(0);
  EXPECT_EQ(OpenBytes(longer).code(), absl::StatusCode::kDataLoss);
}

TEST_F(TraceFileErrorTest, BadMagicIsInvalidArgument) {
  bytes_[0] = 'X';
  const absl::Status st = OpenBytes(bytes_);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("bad magic"));
}

TEST_F(TraceFileErrorTest, UnknownVersionIsUnimplemented) {
  PutU32(bytes_, 8, 2);
  const absl::Status st = OpenBytes(bytes_);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(st.message()), HasSubstr("version 2"));
}

TEST_F(TraceFileErrorTest, BadGeometryIsInvalidArgument) {
  PutU32(bytes_, 24, 3);  // num_kv_heads = 3 does not divide 4 query heads
  absl::Status st = OpenBytes(bytes_);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("geometry.num_kv_heads = 3"));
  PutU32(bytes_, 24, 2);
  PutU32(bytes_, 36, 7);  // dtype
  EXPECT_EQ(OpenBytes(bytes_).code(), absl::StatusCode::kInvalidArgument);
  PutU32(bytes_, 36, 0);
  PutU32(bytes_, 40, 0);  // prefill_tokens
  EXPECT_EQ(OpenBytes(bytes_).code(), absl::StatusCode::kInvalidArgument);
  PutU32(bytes_, 40, 0xffffffffu);
  EXPECT_EQ(OpenBytes(bytes_).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(TraceFileErrorTest, BadHeaderIsInvalidArgument) {
  Bytes reserved = bytes_;
  reserved[50] = 1;
  EXPECT_EQ(OpenBytes(reserved).code(), absl::StatusCode::kInvalidArgument);
  Bytes small = bytes_;
  PutU32(small, 12, 40);  // header_bytes below the fields
  EXPECT_EQ(OpenBytes(small).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(TraceFileErrorTest, ReaderHonoursALongerHeader) {
  Bytes longer(bytes_.begin(), bytes_.begin() + 64);
  longer.resize(128, 0);
  PutU32(longer, 12, 128);
  longer.insert(longer.end(), bytes_.begin() + 64, bytes_.end());
  const std::string path = TempPath("long_header.kvtrace");
  WriteAll(path, longer);
  auto file = OpenTraceFile(path);
  ASSERT_TRUE(file.ok()) << file.status();
  auto src = Make(TinyOptions());
  EXPECT_EQ(GetPrefill(**file, 1), GetPrefill(*src, 1));
  EXPECT_EQ(GetStep(**file, 4, 1), GetStep(*src, 4, 1));
}

// A source whose step returns the wrong size: the writer refuses and leaves no file.
class ShortSource final : public TraceSource {
 public:
  explicit ShortSource(std::unique_ptr<TraceSource> base) : base_(std::move(base)) {}
  const Geometry& geometry() const override { return base_->geometry(); }
  int32_t prefill_tokens() const override { return base_->prefill_tokens(); }
  int32_t num_steps() const override { return base_->num_steps(); }
  absl::Status Prefill(int32_t layer, Bytes* k, Bytes* v) override {
    return base_->Prefill(layer, k, v);
  }
  absl::Status Step(int32_t step, int32_t layer, Bytes* q, Bytes* k, Bytes* v) override {
    KVTIER_RETURN_IF_ERROR(base_->Step(step, layer, q, k, v));
    if (step == 3) v->pop_back();
    return absl::OkStatus();
  }

 private:
  std::unique_ptr<TraceSource> base_;
};

TEST(TraceFileWriteTest, WrongSizedSourceLeavesNoFile) {
  const std::string path = TempPath("short.kvtrace");
  std::remove(path.c_str());
  ShortSource src(Make(TinyOptions()));
  const absl::Status st = WriteTraceFile(src, path);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("a step's v"));
  EXPECT_EQ(OpenTraceFile(path).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvtier::bench
