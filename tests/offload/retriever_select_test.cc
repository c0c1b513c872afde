// Speculative mode's correction triggers on the CPU backend (offload/retriever_select.cc):
// the mass trigger against the cosine one on queries built to tell them apart, against sync
// mode, over a drifting run, and the options that configure it.
#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "offload/retriever.h"
#include "tests/offload/retriever_harness.h"

namespace kvtier {
namespace {

using namespace retriever_test;  // NOLINT: the harness is this test's vocabulary
using ::testing::HasSubstr;
using testing::TypedBuffer;

// Rows [first, first + n) of q ([Hq][d]) rotated towards the directions in `noise`: every
// row y of the result has cos(y, x) = c exactly (up to float rounding) with its row x of q.
void RotateRows(const Geometry& g, const TypedBuffer& q, const TypedBuffer& noise, int32_t first,
                int32_t n, float c, TypedBuffer* out) {
  const int32_t d = g.head_dim;
  for (int32_t r = first; r < first + n; ++r) {
    const int64_t o = int64_t{r} * d;
    double xx = 0, xn = 0;
    for (int32_t i = 0; i < d; ++i) {
      xx += double{q.Get(o + i)} * q.Get(o + i);
      xn += double{q.Get(o + i)} * noise.Get(o + i);
    }
    std::vector<double> u(static_cast<size_t>(d));  // noise without its component along x
    double uu = 0;
    for (int32_t i = 0; i < d; ++i) {
      u[static_cast<size_t>(i)] = noise.Get(o + i) - xn / xx * q.Get(o + i);
      uu += u[static_cast<size_t>(i)] * u[static_cast<size_t>(i)];
    }
    const double s = std::sqrt(1.0 - double{c} * c) * std::sqrt(xx / uu);
    for (int32_t i = 0; i < d; ++i) {
      out->Set(o + i, static_cast<float>(c * q.Get(o + i) + s * u[static_cast<size_t>(i)]));
    }
  }
}

// The host model's selection of every (layer, KV head) with q.
std::vector<std::vector<int32_t>> Selections(const Harness& h, const TypedBuffer& q) {
  std::vector<std::vector<int32_t>> out;
  for (int32_t l = 0; l < h.geometry.num_layers; ++l) {
    for (int32_t kh = 0; kh < h.geometry.num_kv_heads; ++kh) {
      out.push_back(h.seq.Select(l, q, kh, h.seq.tokens(), h.options));
    }
  }
  return out;
}

SequenceOptions Speculative(CorrectionTrigger trigger) {
  SequenceOptions o = SmallOptions(RetrievalMode::kSpeculative);
  o.correction_threshold = 0.9f;
  o.correction_trigger = trigger;
  return o;
}

TEST(CorrectionTriggerTest, MassKeepsHeadsWhoseTopPagesStayWhereCosineCorrects) {
  const Geometry g = SmallGeometry();
  Harness cosine(g, Speculative(CorrectionTrigger::kCosine));
  Harness mass(g, Speculative(CorrectionTrigger::kMass));
  cosine.Append(160);
  mass.Append(160);
  const TypedBuffer q0 = mass.seq.Query(3);
  // q1: each KV head's query group rotated to cosine 0.8 (below τ = 0.9) in a direction
  // that keeps the head's top pages in both layers.
  const std::vector<std::vector<int32_t>> before = Selections(mass, q0);
  TypedBuffer q1 = q0;
  const int32_t G = g.group_size();
  for (int32_t kh = 0; kh < g.num_kv_heads; ++kh) {
    bool found = false;
    for (uint64_t seed = 1; seed < 5000 && !found; ++seed) {
      RotateRows(g, q0, mass.seq.Query(1000 * (kh + 1) + seed), kh * G, G, 0.8f, &q1);
      found = true;
      for (int32_t l = 0; l < g.num_layers; ++l) {
        found = found && mass.seq.Select(l, q1, kh, mass.seq.tokens(), mass.options) ==
                             before[static_cast<size_t>(l * g.num_kv_heads + kh)];
      }
    }
    ASSERT_TRUE(found) << "no rotation of head " << kh << " keeps its top pages";
  }
  cosine.Step(q0);
  mass.Step(q0);
  const auto rc = cosine.Step(q1, /*end=*/false);
  const auto rm = mass.Step(q1, /*end=*/false);
  for (int32_t l = 0; l < g.num_layers; ++l) {
    const StepStats sc = cosine.retriever->LastStep(l), sm = mass.retriever->LastStep(l);
    EXPECT_EQ(sc.corrected_heads, g.num_kv_heads) << "layer " << l;
    EXPECT_EQ(sm.corrected_heads, 0) << "layer " << l;
    EXPECT_EQ(sm.correction_pages, 0) << "layer " << l;
    EXPECT_EQ(sm.drifted, std::vector<uint8_t>(2, 0));
    EXPECT_EQ(sm.lost_mass, std::vector<float>(2, 0.0f));
    EXPECT_TRUE(sc.lost_mass.empty());
    // The group means are kept with either trigger, and the same.
    ASSERT_EQ(sm.group_mean.size(), 2u);
    EXPECT_EQ(sm.group_mean, sc.group_mean);
    EXPECT_NEAR(sm.group_mean[0], 0.8f, 1e-5f);
    for (int32_t kh = 0; kh < g.num_kv_heads; ++kh) {
      EXPECT_EQ(SelectedRegion(rm.views[l], mass.options, kh),
                before[static_cast<size_t>(l * g.num_kv_heads + kh)]);
    }
    ExpectWorkingSetConsistent(g, mass.options, mass.seq, rm.views[l]);
  }
  // The cosine trigger's corrections changed no page, so nothing it recalled mattered.
  EXPECT_EQ(rc.out, rm.out);
}

TEST(CorrectionTriggerTest, MassCorrectsHeadsWhoseAttentionMovesAndThenEqualsSync) {
  const Geometry g = SmallGeometry();
  Harness sync(g, SmallOptions(RetrievalMode::kSync));
  Harness mass(g, Speculative(CorrectionTrigger::kMass));
  SequenceOptions never_options = Speculative(CorrectionTrigger::kMass);
  never_options.correction_max_loss = 1.0f;  // a loss is never above 1
  Harness never(g, never_options);
  for (Harness* h : {&sync, &mass, &never}) h->Append(160);
  const TypedBuffer q0 = mass.seq.Query(3);
  // q1: each KV head's query group replaced by one whose top pages share none with q0's, in
  // both layers.
  const std::vector<std::vector<int32_t>> before = Selections(mass, q0);
  TypedBuffer q1 = q0;
  const int32_t G = g.group_size();
  for (int32_t kh = 0; kh < g.num_kv_heads; ++kh) {
    bool found = false;
    for (uint64_t seed = 1; seed < 5000 && !found; ++seed) {
      const TypedBuffer other = mass.seq.Query(1000 * (kh + 1) + seed);
      for (int64_t i = int64_t{kh} * G * g.head_dim; i < int64_t{kh + 1} * G * g.head_dim; ++i) {
        q1.Set(i, other.Get(i));
      }
      found = true;
      for (int32_t l = 0; l < g.num_layers; ++l) {
        const std::vector<int32_t> after =
            mass.seq.Select(l, q1, kh, mass.seq.tokens(), mass.options);
        const std::vector<int32_t>& was = before[static_cast<size_t>(l * g.num_kv_heads + kh)];
        std::vector<int32_t> common;
        std::set_intersection(was.begin(), was.end(), after.begin(), after.end(),
                              std::back_inserter(common));
        found = found && common.empty();
      }
    }
    ASSERT_TRUE(found) << "no query moves head " << kh << " to other pages";
  }
  for (Harness* h : {&sync, &mass, &never}) h->Step(q0);
  const auto rs = sync.Step(q1, /*end=*/false);
  const auto rm = mass.Step(q1, /*end=*/false);
  const auto rn = never.Step(q1, /*end=*/false);
  for (int32_t l = 0; l < g.num_layers; ++l) {
    const StepStats sm = mass.retriever->LastStep(l);
    EXPECT_EQ(sm.corrected_heads, g.num_kv_heads) << "layer " << l;
    EXPECT_EQ(sm.correction_pages, g.num_kv_heads * mass.options.selected_pages);
    ASSERT_EQ(sm.lost_mass.size(), 2u);
    for (float loss : sm.lost_mass) {
      EXPECT_GT(loss, kDefaultCorrectionMaxLoss);
      EXPECT_LE(loss, 1.0f);
    }
    EXPECT_EQ(never.retriever->LastStep(l).corrected_heads, 0);
    for (int32_t kh = 0; kh < g.num_kv_heads; ++kh) {
      EXPECT_EQ(SelectedRegion(rm.views[l], mass.options, kh),
                mass.seq.Select(l, q1, kh, mass.seq.tokens(), mass.options));
    }
    ExpectWorkingSetConsistent(g, mass.options, mass.seq, rm.views[l]);
  }
  EXPECT_EQ(rm.out, rs.out);
  EXPECT_NE(rn.out, rs.out) << "uncorrected heads attend elsewhere: the check can fail";
}

// A drifting run with appends across page boundaries: the working sets stay consistent, the
// statistics count every check, and the mass trigger corrects some heads but not all.
TEST(CorrectionTriggerTest, MassTriggerRunStaysConsistent) {
  const Geometry g = SmallGeometry(DType::kF16);
  SequenceOptions o = Speculative(CorrectionTrigger::kMass);
  Harness h(g, o);
  h.Append(150);
  TypedBuffer q = h.seq.Query(0);
  constexpr int kSteps = 24;
  for (int step = 0; step < kSteps; ++step) {
    const TypedBuffer noise = h.seq.Query(500 + step);
    for (int64_t i = 0; i < q.size(); ++i) {
      q.Set(i, step % 6 == 5 ? noise.Get(i) : 0.9f * q.Get(i) + 0.4f * noise.Get(i));
    }
    h.Step(q, /*end=*/true, /*check=*/true);
    for (int32_t l = 0; l < g.num_layers && step > 0; ++l) {
      const StepStats st = h.retriever->LastStep(l);
      ASSERT_EQ(st.lost_mass.size(), 2u);
      for (int32_t kh = 0; kh < g.num_kv_heads; ++kh) {
        EXPECT_GE(st.lost_mass[kh], 0.0f);
        EXPECT_LE(st.lost_mass[kh], 1.0f);
        EXPECT_EQ(st.drifted[kh], st.lost_mass[kh] > o.correction_max_loss ? 1 : 0);
      }
    }
    h.Append(step % 4 == 3 ? 9 : 1);
  }
  ASSERT_TRUE(h.retriever->Wait().ok());
  const SequenceStats st = h.retriever->Stats();
  EXPECT_EQ(st.checked_heads, (kSteps - 1) * g.num_layers * g.num_kv_heads);
  EXPECT_GT(st.corrected_heads, 0);
  EXPECT_LT(st.corrected_heads, st.checked_heads);
}

// The τ rule (kvtier/options.h): any finite τ, compared with a mean cosine in [-1, 1] by a
// strict <. With an unchanged query (cosine 1) τ = 1.5 corrects every head and τ = 1 none;
// with a fresh random query τ = -2 corrects none.
TEST(CorrectionTriggerTest, TauAboveOneAlwaysCorrectsAndBelowMinusOneNever) {
  const Geometry g = SmallGeometry();
  const auto corrected = [&](float tau, uint64_t second_query) {
    SequenceOptions o = Speculative(CorrectionTrigger::kCosine);
    o.correction_threshold = tau;
    Harness h(g, o);
    h.Append(160);
    h.Step(h.seq.Query(3));
    h.Step(h.seq.Query(second_query), /*end=*/false);
    std::vector<int32_t> per_layer;
    for (int32_t l = 0; l < g.num_layers; ++l) {
      per_layer.push_back(h.retriever->LastStep(l).corrected_heads);
    }
    return per_layer;
  };
  const std::vector<int32_t> all(static_cast<size_t>(g.num_layers), g.num_kv_heads);
  const std::vector<int32_t> none(static_cast<size_t>(g.num_layers), 0);
  EXPECT_EQ(corrected(1.5f, /*same query*/ 3), all);
  EXPECT_EQ(corrected(1.0f, /*same query*/ 3), none);
  EXPECT_EQ(corrected(-2.0f, /*another query*/ 77), none);
  EXPECT_EQ(corrected(1.5f, /*another query*/ 77), all);
}

TEST(CorrectionTriggerTest, OptionsAreValidatedAndNamed) {
  const Geometry g = SmallGeometry();
  Harness h(g, Speculative(CorrectionTrigger::kMass));
  for (const float bad : {-0.01f, 1.5f, std::numeric_limits<float>::quiet_NaN()}) {
    SequenceOptions o = Speculative(CorrectionTrigger::kMass);
    o.correction_max_loss = bad;
    const auto r = Retriever::Create(g, o, *h.backend, h.tier->pool.get());
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("correction_max_loss"));
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("[0, 1]"));
  }
  SequenceOptions o = Speculative(CorrectionTrigger::kMass);
  o.correction_trigger = static_cast<CorrectionTrigger>(7);
  const auto r = Retriever::Create(g, o, *h.backend, h.tier->pool.get());
  EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("correction_trigger = 7"));

  for (const CorrectionTrigger t : {CorrectionTrigger::kCosine, CorrectionTrigger::kMass}) {
    CorrectionTrigger parsed = static_cast<CorrectionTrigger>(9);
    ASSERT_TRUE(ParseCorrectionTrigger(CorrectionTriggerName(t), &parsed));
    EXPECT_EQ(parsed, t);
  }
  EXPECT_EQ(CorrectionTriggerName(CorrectionTrigger::kMass), "mass");
  CorrectionTrigger out;
  EXPECT_FALSE(ParseCorrectionTrigger("entropy", &out));
  EXPECT_EQ(SequenceOptions{}.correction_trigger, CorrectionTrigger::kCosine);
  EXPECT_FLOAT_EQ(SequenceOptions{}.correction_max_loss, 0.1f);
}

TEST(SummaryModeTest, NamesParseAndAnUnknownModeIsRefused) {
  const Geometry g = SmallGeometry();
  Harness h(g, Speculative(CorrectionTrigger::kCosine));
  SequenceOptions o = Speculative(CorrectionTrigger::kCosine);
  o.summary = static_cast<SummaryMode>(3);
  const auto r = Retriever::Create(g, o, *h.backend, h.tier->pool.get());
  EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("summary = 3: must be minmax (0), center-mad (1) or key-codes (2)"));
  for (const SummaryMode m : {SummaryMode::kMinMax, SummaryMode::kCenterMad, SummaryMode::kKeyCodes}) {
    SummaryMode parsed = static_cast<SummaryMode>(9);
    ASSERT_TRUE(ParseSummaryMode(SummaryModeName(m), &parsed));
    EXPECT_EQ(parsed, m);
  }
  EXPECT_EQ(SummaryModeName(SummaryMode::kKeyCodes), "key-codes");
  SummaryMode out;
  EXPECT_FALSE(ParseSummaryMode("centre-mad", &out));
}

}  // namespace
}  // namespace kvtier
