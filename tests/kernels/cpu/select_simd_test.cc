// Page selection with every instruction set above scalar that this CPU supports (AVX2,
// AVX-512) against the scalar reference (cpu::Isa::kScalar): ScorePages within float
// rounding, TopK exactly. Where the CPU has neither, the tests skip.
//
// ScorePages tolerance: with A = Σ_i |q_i|·max(|hi_i|, |lo_i|) (the magnitude of the sum of
// |terms| of a raw score), raw scores agree to 1e-5·A, and pooled scores (the group mean of
// a softmax over pages) to the error a raw-score error of 1e-5·A can cause through the
// softmax: Σ_g prob_g/G · (2·|scale|·1e-5·max_page A + 1e-5).
// -inf (pages beyond num_pages) must match exactly, and outputs of masked heads must be left
// untouched. hi and lo are drawn independently, so either order occurs: the kernels assume
// none.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/thread_pool.h"
#include "kvtier/layout.h"
#include "tests/kernels/cpu/cpu_op_test_util.h"
#include "tests/testutil/random_fill.h"

namespace kvtier {
namespace {

using testing::TypedBuffer;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kSentinel = 12345.0f;  // outputs a call must not touch keep it
constexpr int32_t kUntouched = 777;

// The ISAs above scalar this CPU runs.
std::vector<cpu::Isa> FastIsas() {
  std::vector<cpu::Isa> out;
  for (cpu::Isa isa : {cpu::Isa::kAvx2, cpu::Isa::kAvx512}) {
    if (cpu::IsaSupported(isa)) out.push_back(isa);
  }
  return out;
}

bool SameBits(float x, float y) {
  uint32_t a = 0, b = 0;
  std::memcpy(&a, &x, sizeof(a));
  std::memcpy(&b, &y, sizeof(b));
  return a == b;
}

// ---------------------------------------------------------------------------------------
// ScorePages

// One scoring problem: B sequences of up to P pages, num_pages per sequence.
struct ScoreCase {
  DType dtype;
  int32_t B, Hkv, G, d, P;
  std::vector<int32_t> num_pages;
  TypedBuffer q, sums;
  std::vector<double> mag;  // [B][Hq][P]: A of each raw score

  ScoreCase(DType t, int32_t hkv, int32_t g, int32_t dim, int32_t max_pages,
            std::vector<int32_t> n, uint64_t seed)
      : dtype(t),
        B(static_cast<int32_t>(n.size())),
        Hkv(hkv),
        G(g),
        d(dim),
        P(max_pages),
        num_pages(std::move(n)),
        q(t, int64_t{B} * hkv * g * dim),
        sums(t, int64_t{B} * max_pages * hkv * 2 * dim) {
    // hi and lo are independent: either order occurs (the kernels assume none).
    q.FillNormal(seed);
    sums.FillNormal(seed + 1);
    const HeadsLayout ql{Hq(), d};
    const SummaryLayout sl{Hkv, d};
    mag.assign(static_cast<size_t>(B * Hq() * P), 0.0);
    for (int32_t b = 0; b < B; ++b) {
      const int64_t base = int64_t{b} * P * sl.page_elements();
      for (int32_t hq = 0; hq < Hq(); ++hq) {
        for (int32_t p = 0; p < P; ++p) {
          double s = 0;
          for (int32_t i = 0; i < d; ++i) {
            const double hi = std::fabs(sums.Get(base + sl.Offset(p, hq / G, kHi, i)));
            const double lo = std::fabs(sums.Get(base + sl.Offset(p, hq / G, kLo, i)));
            s += std::fabs(q.Get(ql.Offset(b, hq, i))) * std::max(hi, lo);
          }
          mag[static_cast<size_t>((b * Hq() + hq) * P + p)] = s;
        }
      }
    }
  }
  int32_t Hq() const { return Hkv * G; }

  ScorePagesArgs Args(float* pooled, float* scores, const uint8_t* mask) const {
    ScorePagesArgs a = testing::ScoreArgs(
        {.dtype = dtype, .num_q_heads = Hq(), .num_kv_heads = Hkv, .head_dim = d}, B, P,
        q.data(), sums.data(), num_pages.data(), pooled);
    a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(d));
    a.scores = scores;
    a.head_mask = mask;
    return a;
  }
};

struct ScoreOut {
  std::vector<float> pooled, scores;
};

// Runs ScorePages with `isa` on sentinel-filled outputs.
ScoreOut RunScore(const ScoreCase& c, bool with_scores, const uint8_t* mask, ThreadPool* pool,
                  cpu::Isa isa) {
  ScoreOut o;
  o.pooled.assign(static_cast<size_t>(c.B * c.Hkv * c.P), kSentinel);
  o.scores.assign(with_scores ? static_cast<size_t>(c.B * c.Hq() * c.P) : 0, kSentinel);
  const ScorePagesArgs a =
      c.Args(o.pooled.data(), with_scores ? o.scores.data() : nullptr, mask);
  EXPECT_TRUE(CpuScorePages(a, pool, isa).ok());
  return o;
}

// The tolerance of pooled[b][h][p] for every page p (see the top of the file), from the
// reference's raw scores `raw` ([B][Hq][P]).
std::vector<double> PooledTolerance(const ScoreCase& c, const std::vector<float>& raw,
                                    int32_t b, int32_t h) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  const int32_t n = c.num_pages[static_cast<size_t>(b)];
  std::vector<double> tol(static_cast<size_t>(c.P), 0.0);
  for (int32_t g = 0; g < c.G; ++g) {
    const auto row = static_cast<size_t>((int64_t{b} * c.Hq() + h * c.G + g) * c.P);
    double max_mag = 0, mx = -1e300, z = 0;
    for (int32_t p = 0; p < n; ++p) {
      max_mag = std::max(max_mag, c.mag[row + static_cast<size_t>(p)]);
      mx = std::max(mx, scale * raw[row + static_cast<size_t>(p)]);
    }
    for (int32_t p = 0; p < n; ++p) z += std::exp(scale * raw[row + static_cast<size_t>(p)] - mx);
    for (int32_t p = 0; p < n; ++p) {
      const size_t i = row + static_cast<size_t>(p);
      tol[static_cast<size_t>(p)] +=
          std::exp(scale * raw[i] - mx) / z / c.G * (2 * scale * 1e-5 * max_mag + 1e-5);
    }
  }
  return tol;
}

// One output element of an active head against the reference's: -inf exactly, else within
// tol.
::testing::AssertionResult Agrees(float got, float want, double tol) {
  if (std::isinf(want)) {
    if (want < 0 && SameBits(got, want)) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "got " << got << ", want " << want;
  }
  if (std::isfinite(got) && std::fabs(double{got} - want) <= tol) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "got " << got << ", want " << want << " ± " << tol;
}

// Every (mask, scores, thread pool) variant of `c` with each fast ISA against
// the reference.
void CompareScores(const ScoreCase& c) {
  const std::vector<cpu::Isa> isas = FastIsas();
  if (isas.empty()) GTEST_SKIP() << "no vector ISA on this CPU";
  ThreadPool two(2);
  std::vector<uint8_t> mask(static_cast<size_t>(c.B * c.Hkv));
  for (size_t i = 0; i < mask.size(); ++i) mask[i] = i % 3 == 1 ? 0 : 1;
  // The reference's raw scores of every head, for the softmax tolerance.
  const ScoreOut raw = RunScore(c, true, nullptr, nullptr, cpu::Isa::kScalar);
  for (cpu::Isa isa : isas) {
    {
      for (int v = 0; v < 8; ++v) {
        const bool masked = (v & 1) != 0, with_scores = (v & 2) != 0;
        ThreadPool* pool = (v & 4) != 0 ? &two : nullptr;
        const uint8_t* m = masked ? mask.data() : nullptr;
        SCOPED_TRACE(::testing::Message()
 << cpu::IsaName(isa) << " masked=" << masked << " scores=" << with_scores
                     << " threads=" << (pool != nullptr ? 2 : 1));
        const ScoreOut want = RunScore(c, with_scores, m, pool, cpu::Isa::kScalar);
        const ScoreOut got = RunScore(c, with_scores, m, pool, isa);
        for (int32_t b = 0; b < c.B; ++b) {
          for (int32_t h = 0; h < c.Hkv; ++h) {
            const bool active = m == nullptr || m[b * c.Hkv + h] != 0;
            const std::vector<double> tol = PooledTolerance(c, raw.scores, b, h);
            for (int32_t p = 0; p < c.P; ++p) {
              const size_t i = static_cast<size_t>((b * c.Hkv + h) * c.P + p);
              if (active) {
                ASSERT_TRUE(Agrees(got.pooled[i], want.pooled[i], tol[static_cast<size_t>(p)]))
                    << "pooled b=" << b << " h=" << h << " p=" << p;
              } else {
                ASSERT_TRUE(SameBits(want.pooled[i], kSentinel) &&
                            SameBits(got.pooled[i], kSentinel))
                    << "masked head's pooled touched: b=" << b << " h=" << h << " p=" << p;
              }
            }
            if (!with_scores) continue;
            for (int32_t g = 0; g < c.G; ++g) {
              for (int32_t p = 0; p < c.P; ++p) {
                const size_t i = static_cast<size_t>((b * c.Hq() + h * c.G + g) * c.P + p);
                if (active) {
                  ASSERT_TRUE(Agrees(got.scores[i], want.scores[i], 1e-5 * c.mag[i]))
                      << "scores b=" << b << " h=" << h << " g=" << g << " p=" << p;
                } else {
                  ASSERT_TRUE(SameBits(want.scores[i], kSentinel) &&
                              SameBits(got.scores[i], kSentinel))
                      << "masked head's scores touched: b=" << b << " h=" << h;
                }
              }
            }
          }
        }
      }
    }
  }
}

// dtype, group size, head_dim
using ScoreParam = std::tuple<DType, int32_t, int32_t>;
class ScorePagesSimdTest : public ::testing::TestWithParam<ScoreParam> {};

TEST_P(ScorePagesSimdTest, MatchesTheReference) {
  const auto [dtype, G, d] = GetParam();
  // Sequences with P pages (all), 0, 1 and an odd count.
  CompareScores(ScoreCase(dtype, 2, G, d, 37, {37, 0, 1, 23}, 11));
}

INSTANTIATE_TEST_SUITE_P(Sweep, ScorePagesSimdTest,
                         ::testing::Combine(::testing::Values(DType::kF16, DType::kBF16,
                                                              DType::kF32),
                                            ::testing::Values(1, 2, 4, 8),
                                            ::testing::Values(8, 64, 72, 128, 256)),
                         [](const auto& tpi) {
                           return std::string(DTypeName(std::get<0>(tpi.param))) + "_g" +
                                  std::to_string(std::get<1>(tpi.param)) + "_d" +
                                  std::to_string(std::get<2>(tpi.param));
                         });

TEST(ScorePagesSimdTest, GroupSizesOutsideTheBlocksAndOneSequence) {
  // G = 3, 7 and 13 mix the 8/4/2/1 blocks; one sequence, one KV head.
  for (int32_t G : {3, 7, 13}) {
    SCOPED_TRACE(G);
    CompareScores(ScoreCase(DType::kF16, 1, G, 64, 19, {19}, 21));
  }
}

TEST(ScorePagesSimdTest, LongSequencesSplitIntoManyTasks) {
  // 4 KiB of fp32 summaries per page: the 1500 pages span many scoring tasks, and the
  // softmax sums over blocks.
  CompareScores(ScoreCase(DType::kF32, 2, 4, 256, 1500, {1500, 1111}, 31));
  CompareScores(ScoreCase(DType::kF16, 8, 4, 128, 700, {699, 700}, 41));
}

TEST(ScorePagesSimdTest, TwoArgumentOpRunsTheActiveIsa) {
  const ScoreCase c(DType::kF16, 2, 4, 64, 29, {29, 17}, 51);
  ThreadPool two(2);
  {
    std::vector<float> p1(static_cast<size_t>(c.B * c.Hkv * c.P)), p2(p1.size());
    std::vector<float> s1(static_cast<size_t>(c.B * c.Hq() * c.P)), s2(s1.size());
    ASSERT_TRUE(CpuScorePages(c.Args(p1.data(), s1.data(), nullptr), &two).ok());
    ASSERT_TRUE(
        CpuScorePages(c.Args(p2.data(), s2.data(), nullptr), &two, cpu::ActiveIsa()).ok());
    for (size_t i = 0; i < p1.size(); ++i) ASSERT_TRUE(SameBits(p1[i], p2[i])) << i;
    for (size_t i = 0; i < s1.size(); ++i) ASSERT_TRUE(SameBits(s1[i], s2[i])) << i;
  }
}

// Key codes: the vectorised dots over a page's tokens give the reference's bits — every raw
// score and pooled score identical — for page sizes below, at and across the lane counts (5,
// 8, 16, 40), group sizes inside and across the blocks of four (1, 3, 4, 5, 8) and ragged
// sequences, with and without a mask. Codes are random bytes; hi and lo independent normals.
TEST(ScorePagesSimdTest, KeyCodesGiveTheReferenceBitForBit) {
  const std::vector<cpu::Isa> isas = FastIsas();
  if (isas.empty()) GTEST_SKIP() << "no vector ISA on this CPU";
  ThreadPool two(2);
  for (const int32_t ps : {5, 8, 16, 40}) {
    for (const int32_t G : {1, 3, 4, 5, 8}) {
      for (const int32_t d : {8, 64, 72, 128}) {
        SCOPED_TRACE(::testing::Message() << "page " << ps << " G " << G << " d " << d);
        const ScoreCase c(DType::kF16, 2, G, d, 9, {9, 0, 4}, 71 + ps + G + d);
        const KeyCodeLayout cl{c.Hkv, ps, d};
        std::vector<uint8_t> codes(static_cast<size_t>(c.B * c.P * cl.page_bytes()));
        std::mt19937 rng(static_cast<uint32_t>(ps * 1000 + G * 10 + d));
        for (uint8_t& b : codes) b = static_cast<uint8_t>(rng());
        std::vector<uint8_t> mask(static_cast<size_t>(c.B * c.Hkv));
        for (size_t i = 0; i < mask.size(); ++i) mask[i] = i % 3 == 1 ? 0 : 1;
        const auto run = [&](cpu::Isa isa, const uint8_t* m, ThreadPool* pool) {
          ScoreOut o;
          o.pooled.assign(static_cast<size_t>(c.B * c.Hkv * c.P), kSentinel);
          o.scores.assign(static_cast<size_t>(c.B * c.Hq() * c.P), kSentinel);
          ScorePagesArgs a = c.Args(o.pooled.data(), o.scores.data(), m);
          a.shape.page_size = ps;
          a.codes = codes.data();
          EXPECT_TRUE(CpuScorePages(a, pool, isa).ok());
          return o;
        };
        for (const bool masked : {false, true}) {
          const uint8_t* m = masked ? mask.data() : nullptr;
          const ScoreOut want = run(cpu::Isa::kScalar, m, nullptr);
          for (cpu::Isa isa : isas) {
            const ScoreOut got = run(isa, m, &two);
            for (size_t i = 0; i < want.pooled.size(); ++i) {
              ASSERT_TRUE(SameBits(got.pooled[i], want.pooled[i]))
                  << cpu::IsaName(isa) << " pooled " << i << ": " << got.pooled[i] << " vs "
                  << want.pooled[i];
            }
            for (size_t i = 0; i < want.scores.size(); ++i) {
              ASSERT_TRUE(SameBits(got.scores[i], want.scores[i]))
                  << cpu::IsaName(isa) << " scores " << i << ": " << got.scores[i] << " vs "
                  << want.scores[i];
            }
          }
        }
      }
    }
  }
}

TEST(ScorePagesSimdTest, RejectsPageCountsLikeTheReference) {
  const ScoreCase c(DType::kF16, 1, 2, 16, 4, {4, 5}, 61);
  std::vector<float> pooled(static_cast<size_t>(c.B * c.Hkv * c.P), kSentinel);
  const ScorePagesArgs a = c.Args(pooled.data(), nullptr, nullptr);
  const absl::Status want = CpuScorePages(a, nullptr, cpu::Isa::kScalar);
  ASSERT_EQ(want.code(), absl::StatusCode::kOutOfRange);
  for (cpu::Isa isa : FastIsas()) {
    EXPECT_EQ(CpuScorePages(a, nullptr, isa), want) << cpu::IsaName(isa);
  }
  for (float x : pooled) ASSERT_TRUE(SameBits(x, kSentinel));
}

// ---------------------------------------------------------------------------------------
// TopK

// Pooled scores of one (sequence, KV head) in one of several styles that stress the order.
void FillScores(std::mt19937& rng, int style, float* s, int32_t n) {
  static const float kPalette[] = {0.0f,  -0.0f, 1.0f,    -1.0f,    2.5f,     kInf,
                                   kNegInf, std::numeric_limits<float>::quiet_NaN(),
                                   -std::numeric_limits<float>::quiet_NaN(),
                                   std::numeric_limits<float>::denorm_min(),
                                   -std::numeric_limits<float>::denorm_min(), 1e-30f,
                                   std::numeric_limits<float>::max(),
                                   std::numeric_limits<float>::lowest()};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> prob(0.0f, 1e-3f);
  const float same = normal(rng);
  for (int32_t p = 0; p < n; ++p) {
    switch (style) {
      case 0:  // a palette of special values and ties
        s[p] = kPalette[rng() % (sizeof(kPalette) / sizeof(kPalette[0]))];
        break;
      case 1:  // few distinct values: ties everywhere
        s[p] = static_cast<float>(rng() % 5);
        break;
      case 2:  // all equal
        s[p] = same;
        break;
      case 3:  // all NaN
        s[p] = std::numeric_limits<float>::quiet_NaN();
        break;
      case 4:  // softmax-like probabilities, some repeated
        s[p] = rng() % 8 == 0 ? 1e-4f : prob(rng);
        break;
      default:  // normal, with a sprinkle of specials
        s[p] = rng() % 16 == 0 ? kPalette[rng() % 9] : normal(rng);
        break;
    }
  }
}

struct TopKCase {
  int32_t B, Hkv, P, k;
  std::vector<int32_t> num_pages;
  std::vector<float> pooled;
  std::vector<uint8_t> flags, mask;
  std::vector<int32_t> head_k;
  int32_t sink = 0, recent = 0;

  TopKArgs Args(int32_t* selected, bool with_flags, bool with_mask, bool with_head_k) const {
    TopKArgs a = testing::SelectArgs(Hkv, B, P, k, pooled.data(), num_pages.data(), selected);
    a.sink_pages = sink;
    a.recent_pages = recent;
    a.page_flags = with_flags ? flags.data() : nullptr;
    a.head_mask = with_mask ? mask.data() : nullptr;
    a.head_k = with_head_k ? head_k.data() : nullptr;
    return a;
  }
};

TopKCase RandomTopK(uint32_t seed, int32_t B, int32_t Hkv, int32_t P, int32_t k) {
  std::mt19937 rng(seed);
  TopKCase c{B, Hkv, P, k, {}, {}, {}, {}, {}, 0, 0};
  for (int32_t b = 0; b < B; ++b) {
    const uint32_t r = rng() % 4;
    c.num_pages.push_back(r == 0 ? P : r == 1 ? 0 : static_cast<int32_t>(rng() % (P + 1)));
  }
  c.pooled.resize(static_cast<size_t>(B * Hkv * P));
  for (int32_t i = 0; i < B * Hkv; ++i) {
    FillScores(rng, static_cast<int>(rng() % 6), c.pooled.data() + int64_t{i} * P, P);
  }
  // Flags: mostly normal; pinned, excluded, both bits, and unknown bits (normal).
  static const uint8_t kFlags[] = {kPageNormal, kPageNormal, kPageNormal, kPageNormal,
                                   kPagePinned, kPageExcluded, kPagePinned | kPageExcluded,
                                   0x80, 0x04 | kPagePinned};
  for (size_t i = 0; i < c.pooled.size(); ++i) c.flags.push_back(kFlags[rng() % 9]);
  for (int32_t i = 0; i < B * Hkv; ++i) {
    c.mask.push_back(rng() % 3 == 0 ? 0 : 1);
    c.head_k.push_back(k == 0 ? 0 : static_cast<int32_t>(rng() % (k + 1)));
  }
  return c;
}

std::vector<int32_t> RunTopK(const TopKCase& c, bool flags, bool mask, bool head_k,
                             ThreadPool* pool, cpu::Isa isa) {
  std::vector<int32_t> out(static_cast<size_t>(std::max(1, c.B * c.Hkv * c.k)), kUntouched);
  EXPECT_TRUE(CpuTopK(c.Args(out.data(), flags, mask, head_k), pool, isa).ok());
  return out;
}

// Every (flags, mask, head_k, thread pool) variant of `c` with each fast ISA: exactly the
// reference's output.
void CompareTopK(const TopKCase& c) {
  const std::vector<cpu::Isa> isas = FastIsas();
  if (isas.empty()) GTEST_SKIP() << "no vector ISA on this CPU";
  ThreadPool two(2);
  for (cpu::Isa isa : isas) {
    for (int v = 0; v < 8; ++v) {
      const bool flags = (v & 1) != 0, mask = (v & 2) != 0, head_k = (v & 4) != 0;
      for (ThreadPool* pool : {static_cast<ThreadPool*>(nullptr), &two}) {
        SCOPED_TRACE(::testing::Message()
                     << cpu::IsaName(isa) << " flags=" << flags << " mask=" << mask
                     << " head_k=" << head_k << " threads=" << (pool != nullptr ? 2 : 1)
                     << " k=" << c.k << " sink=" << c.sink << " recent=" << c.recent);
        const std::vector<int32_t> want = RunTopK(c, flags, mask, head_k, pool, cpu::Isa::kScalar);
        const std::vector<int32_t> got = RunTopK(c, flags, mask, head_k, pool, isa);
        ASSERT_EQ(got, want);
      }
    }
  }
}

TEST(TopKSimdTest, SpecialValuesTiesFlagsAndBudgetsMatchTheReferenceExactly) {
  for (uint32_t seed = 1; seed <= 12; ++seed) {
    for (int32_t k : {1, 5, 40, 120}) {
      TopKCase c = RandomTopK(seed * 100 + static_cast<uint32_t>(k), 3, 3, 120, k);
      c.sink = static_cast<int32_t>(seed % 3);
      c.recent = static_cast<int32_t>(seed % 4);
      CompareTopK(c);
    }
  }
}

TEST(TopKSimdTest, LargeHeadsGoThroughEveryRadixPass) {
  // All-equal and all-NaN heads leave only the page bits to tell keys apart.
  for (uint32_t seed = 1; seed <= 3; ++seed) {
    for (int32_t k : {1, 64, 65, 128, 999}) {
      TopKCase c = RandomTopK(seed * 1000 + static_cast<uint32_t>(k), 2, 4, 4096, k);
      c.sink = 4;
      c.recent = 16;
      CompareTopK(c);
    }
  }
}

TEST(TopKSimdTest, MoreThanTheCandidatesAndNoCandidates) {
  // k beyond the candidates pads with kEmptySlot; sink + recent beyond num_pages leaves none.
  TopKCase c = RandomTopK(7, 2, 2, 30, 30);
  c.sink = 5;
  c.recent = 6;
  CompareTopK(c);
  c.sink = 20;
  c.recent = 20;
  CompareTopK(c);
}

TEST(TopKSimdTest, ZeroK) {
  // k = 0 (the backend refuses it; the op itself writes nothing) and head_k = 0 everywhere.
  TopKCase c = RandomTopK(9, 2, 2, 16, 0);
  CompareTopK(c);
  c = RandomTopK(10, 2, 2, 16, 4);
  std::fill(c.head_k.begin(), c.head_k.end(), 0);
  CompareTopK(c);
}

TEST(TopKSimdTest, TwoArgumentOpRunsTheActiveIsa) {
  const TopKCase c = RandomTopK(11, 2, 4, 500, 64);
  ThreadPool two(2);
  for (int v = 0; v < 8; ++v) {
    const bool flags = (v & 1) != 0, mask = (v & 2) != 0, head_k = (v & 4) != 0;
    std::vector<int32_t> out(static_cast<size_t>(c.B * c.Hkv * c.k), kUntouched);
    ASSERT_TRUE(CpuTopK(c.Args(out.data(), flags, mask, head_k), &two).ok());
    EXPECT_EQ(out, RunTopK(c, flags, mask, head_k, &two, cpu::ActiveIsa())) << v;
  }
}

TEST(TopKSimdTest, RejectsLikeTheReferenceBeforeAnyOutput) {
  TopKCase c = RandomTopK(12, 2, 2, 16, 4);
  c.num_pages = {16, 3};
  std::fill(c.mask.begin(), c.mask.end(), 1);
  std::vector<int32_t> want_out(static_cast<size_t>(c.B * c.Hkv * c.k), kUntouched);
  // A budget above k, then a page count above max_pages: same status, nothing written.
  c.head_k[3] = 5;
  for (int round = 0; round < 2; ++round) {
    if (round == 1) {
      c.head_k[3] = 1;
      c.num_pages[1] = 17;
    }
    std::vector<int32_t> out = want_out;
    const absl::Status want =
        CpuTopK(c.Args(out.data(), true, true, true), nullptr, cpu::Isa::kScalar);
    ASSERT_EQ(want.code(), absl::StatusCode::kOutOfRange);
    ASSERT_EQ(out, want_out);
    for (cpu::Isa isa : FastIsas()) {
      EXPECT_EQ(CpuTopK(c.Args(out.data(), true, true, true), nullptr, isa), want)
          << cpu::IsaName(isa);
      EXPECT_EQ(out, want_out);
    }
  }
}

}  // namespace
}  // namespace kvtier
