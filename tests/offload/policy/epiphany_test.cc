// EpiKV epiphany scores: the causal rolling z-score, band scaling, band differences of
// hidden-state changes, page aggregation, frozen token scores, capped pinning and the two
// KV signals on hand-made keys.
#include "offload/policy/epiphany.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvtier/dtype.h"

namespace kvtier::policy {
namespace {

using ::testing::HasSubstr;
using Signal = EpiphanyOptions::Signal;
using Aggregate = EpiphanyOptions::Aggregate;

// ---- RollingZScore --------------------------------------------------------------------------

// z of the newest of k evenly spaced values (a linear ramp): ((k−1)/2) / sqrt((k²−1)/12).
double RampZ(int k) { return ((k - 1) / 2.0) / std::sqrt((k * k - 1) / 12.0); }

TEST(RollingZScoreTest, LinearRampIsConstantOnceTheWindowIsFull) {
  constexpr int kWindow = 8;  // full-window z = 3.5 / sqrt(63/12) = 1.5275
  RollingZScore z(kWindow);
  EXPECT_EQ(z.Push(3), 0.0);  // one value: 0
  for (int t = 1; t < 200; ++t) {
    const double got = z.Push(3 + 2.0 * t);
    const int k = std::min(t + 1, kWindow);
    EXPECT_NEAR(got, RampZ(k), 1e-9) << "t=" << t;
  }
  EXPECT_NEAR(RampZ(kWindow), 1.5275252, 1e-7);
  EXPECT_NEAR(RampZ(2), 1.0, 1e-12);
  EXPECT_EQ(z.size(), kWindow);
}

TEST(RollingZScoreTest, LargeOffsetsDoNotDrift) {
  RollingZScore z(64);
  double last = 0;
  for (int t = 0; t < 20000; ++t) last = z.Push(1e9 + 0.5 * t);
  EXPECT_NEAR(last, RampZ(64), 1e-6);  // (31.5)/sqrt(4095/12) = 1.7052
}

TEST(RollingZScoreTest, ASpikeAmongConstantsIsSqrtOfNMinusOne) {
  // One spike among n values: mean H/n, std H·sqrt(n−1)/n, so z = sqrt(n−1).
  RollingZScore z(16);
  for (int i = 0; i < 40; ++i) EXPECT_EQ(z.Push(5.0), 0.0);  // std 0 → 0
  EXPECT_NEAR(z.Push(105.0), std::sqrt(15.0), 1e-9);
  // The constant after it: z = −1/sqrt(n−1) while the spike is in the window.
  EXPECT_NEAR(z.Push(5.0), -1 / std::sqrt(15.0), 1e-9);
  for (int i = 0; i < 14; ++i) z.Push(5.0);
  EXPECT_EQ(z.Push(5.0), 0.0);  // the spike left the window
}

TEST(RollingZScoreTest, NonFiniteValuesCountAsTheMean) {
  RollingZScore z(4);
  z.Push(1);
  z.Push(3);
  EXPECT_EQ(z.Push(std::numeric_limits<double>::quiet_NaN()), 0.0);  // pushed as 2
  EXPECT_EQ(z.Push(std::numeric_limits<double>::infinity()), 0.0);   // pushed as 2
  // Window {1, 3, 2, 2}... then 5 replaces 1: {3, 2, 2, 5}, mean 3, std sqrt(1.5).
  EXPECT_NEAR(z.Push(5), 2 / std::sqrt(1.5), 1e-9);
}

// ---- Options and bands ----------------------------------------------------------------------

TEST(EpiphanyBandsTest, DefaultsFor32LayersAndScaledForOtherDepths) {
  const EpiphanyOptions o;
  const EpiphanyBands b32 = *ResolveEpiphanyBands(o, 32);
  EXPECT_EQ(b32.positive, (LayerBand{7, 13}));
  EXPECT_EQ(b32.negative, (LayerBand{18, 25}));
  // L = 16: [⌊7/2⌋, ⌈14/2⌉ − 1] = [3, 6]; [9, ⌈26/2⌉ − 1] = [9, 12].
  const EpiphanyBands b16 = *ResolveEpiphanyBands(o, 16);
  EXPECT_EQ(b16.positive, (LayerBand{3, 6}));
  EXPECT_EQ(b16.negative, (LayerBand{9, 12}));
  // L = 80: [⌊17.5⌋, 35 − 1] = [17, 34]; [45, 65 − 1] = [45, 64].
  const EpiphanyBands b80 = *ResolveEpiphanyBands(o, 80);
  EXPECT_EQ(b80.positive, (LayerBand{17, 34}));
  EXPECT_EQ(b80.negative, (LayerBand{45, 64}));
  // L = 1: both bands are the only layer.
  const EpiphanyBands b1 = *ResolveEpiphanyBands(o, 1);
  EXPECT_EQ(b1.positive, (LayerBand{0, 0}));
  EXPECT_EQ(b1.negative, (LayerBand{0, 0}));
  // Unscaled: as given, and they must fit the model.
  EpiphanyOptions raw;
  raw.scale_bands = false;
  EXPECT_EQ(ResolveEpiphanyBands(raw, 40)->negative, (LayerBand{18, 25}));
  const absl::StatusOr<EpiphanyBands> small = ResolveEpiphanyBands(raw, 16);
  EXPECT_EQ(small.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(small.status().message()), HasSubstr("negative_last must be < 16"));
}

TEST(EpiphanyOptionsTest, ValidateNamesTheField) {
  EXPECT_TRUE(EpiphanyOptions{}.Validate().ok());
  EpiphanyOptions o;
  o.window = 1;
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("window must be >= 2"));
  o = {};
  o.positive_last = 6;
  EXPECT_THAT(std::string(o.Validate().message()),
              HasSubstr("positive_last must be >= positive_first = 7"));
  o = {};
  o.negative_last = 32;
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("negative_last must be < 32"));
  o = {};
  o.negative_first = -1;
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("negative_first must be >= 0"));
  o = {};
  o.max_pinned_pages = -1;
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("max_pinned_pages"));
  o = {};
  o.pin_threshold = std::numeric_limits<float>::infinity();
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("pin_threshold must be finite"));
  EXPECT_EQ(EpiphanyScorer::Create(o, 32, 8, 32).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EpiphanyScorer::Create(EpiphanyOptions{}, 32, 8, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(EpiphanyScorer::Create(EpiphanyOptions{}, 32, 8, 32).ok());
}

// ---- Scores from hidden-state changes -------------------------------------------------------

// Four layers: positive band {1}, negative band {2, 3}, layer 0 in neither.
EpiphanyOptions SmallBands(int32_t window) {
  EpiphanyOptions o;
  o.scale_bands = false;
  o.positive_first = o.positive_last = 1;
  o.negative_first = 2;
  o.negative_last = 3;
  o.window = window;
  return o;
}

// Reports one token with x = 1 at every layer except the ones given.
void Token(EpiphanyScorer& s, int64_t position, float positive, float negative) {
  const std::vector<float> delta = {1.0f, positive, negative, negative};  // [1 token][4 layers]
  StepSignals signals;
  signals.first_position = position;
  signals.num_tokens = 1;
  signals.hidden_delta = delta;
  signals.num_layers = 4;
  s.OnSignals(signals);
}

TEST(EpiphanyScorerTest, PositiveBandSpikeScoresHighNegativeBandSpikeLow) {
  EpiphanyScorer s(SmallBands(8), 4, 2, 4);
  EXPECT_FALSE(s.needs_tokens());
  for (int t = 0; t < 8; ++t) Token(s, t, 1, 1);
  EXPECT_EQ(s.token_score(7), 0.0f);  // constant signals: z = 0
  // A spike in the positive band among 8 values: z_A = sqrt(7), z_B = 0.
  Token(s, 8, 11, 1);
  EXPECT_NEAR(*s.token_score(8), std::sqrt(7.0f), 1e-5f);
  for (int t = 9; t < 24; ++t) Token(s, t, 1, 1);
  // A spike in the negative band: z_B = sqrt(7), z_A = 0.
  Token(s, 24, 1, 11);
  EXPECT_NEAR(*s.token_score(24), -std::sqrt(7.0f), 1e-5f);
  // Both at once cancel.
  for (int t = 25; t < 40; ++t) Token(s, t, 1, 1);
  Token(s, 40, 11, 11);
  EXPECT_NEAR(*s.token_score(40), 0.0f, 1e-5f);
  EXPECT_EQ(s.scored_tokens(), 41);
  EXPECT_EQ(s.last_signal(1), 11.0);
  EXPECT_EQ(s.last_signal(0), 0.0);  // outside the bands
}

TEST(EpiphanyScorerTest, PageAggregatesMaxOrMean) {
  // Page 2 (tokens 8..11, p = 4): a spike at 8, then three tokens at z = −1/sqrt(7).
  for (Aggregate agg : {Aggregate::kMax, Aggregate::kMean}) {
    EpiphanyOptions o = SmallBands(8);
    o.aggregate = agg;
    EpiphanyScorer s(o, 4, 2, 4);
    for (int t = 0; t < 8; ++t) Token(s, t, 1, 1);
    Token(s, 8, 11, 1);
    for (int t = 9; t < 12; ++t) Token(s, t, 1, 1);
    EXPECT_NEAR(*s.token_score(9), -1 / std::sqrt(7.0f), 1e-5f);
    const float expected = agg == Aggregate::kMax
                               ? std::sqrt(7.0f)                               // 2.6458
                               : (std::sqrt(7.0f) - 3 / std::sqrt(7.0f)) / 4;  // 1/sqrt(7)
    EXPECT_NEAR(s.page_score(2), expected, 1e-5f);
    EXPECT_EQ(s.page_score(1), 0.0f);
    EXPECT_EQ(s.page_score(9), 0.0f);  // nothing scored there
    // Score is the page's, whatever the layer and head.
    EXPECT_EQ(s.Score(0, 0, 2), s.page_score(2));
    EXPECT_EQ(s.Score(31, 1, 2), s.page_score(2));
    // Pinned at ≥ 2.0: the max does, the mean (0.378) does not.
    EXPECT_EQ(s.Pinned(0, 0, 2), agg == Aggregate::kMax);
    EXPECT_EQ(s.Pinned(3, 1, 2), agg == Aggregate::kMax);
    EXPECT_FALSE(s.Pinned(0, 0, 1));
  }
}

TEST(EpiphanyScorerTest, ScoresAreFrozenOnceComputed) {
  EpiphanyScorer s(SmallBands(8), 4, 2, 4);
  for (int t = 0; t < 8; ++t) Token(s, t, 1, 1);
  Token(s, 8, 11, 1);
  for (int t = 9; t < 12; ++t) Token(s, t, 1, 1);
  const float token8 = *s.token_score(8);
  const float page2 = s.page_score(2);
  // Later tokens (a bigger spike among them) and re-sent earlier positions change nothing.
  for (int t = 12; t < 15; ++t) Token(s, t, 1, 1);
  Token(s, 15, 500, 1);
  Token(s, 8, 1000, 1000);  // a repeat of position 8: ignored
  EXPECT_EQ(*s.token_score(8), token8);
  EXPECT_EQ(s.page_score(2), page2);
  EXPECT_EQ(s.scored_tokens(), 16);
  // Only the last `window` token scores are kept.
  for (int t = 16; t < 30; ++t) Token(s, t, 1, 1);
  EXPECT_FALSE(s.token_score(8).has_value());
  EXPECT_TRUE(s.token_score(29).has_value());
  EXPECT_EQ(s.page_score(2), page2);  // the page keeps it
}

TEST(EpiphanyScorerTest, PinnedPagesAreCappedAndAboveThreshold) {
  // Window 64, p = 8, equal spikes at tokens 2, 16, 40 and 56 (pages 0, 2, 5, 7). With k
  // spikes among n values, a spike's z = sqrt((n − k)/k):
  //   token 2: n 3, k 1 → 1.414;  16: n 17, k 2 → 2.739;  40: n 41, k 3 → 3.559;
  //   56: n 57, k 4 → 3.640.
  for (int32_t cap : {2, 8}) {
    EpiphanyOptions o = SmallBands(64);
    o.max_pinned_pages = cap;
    EpiphanyScorer s(o, 4, 2, 8);
    for (int t = 0; t < 64; ++t) {
      const bool spike = t == 2 || t == 16 || t == 40 || t == 56;
      Token(s, t, spike ? 11 : 1, 1);
    }
    EXPECT_NEAR(s.page_score(0), std::sqrt(2.0f), 1e-5f);
    EXPECT_NEAR(s.page_score(2), std::sqrt(15.0f / 2), 1e-5f);
    EXPECT_NEAR(s.page_score(5), std::sqrt(38.0f / 3), 1e-5f);
    EXPECT_NEAR(s.page_score(7), std::sqrt(53.0f / 4), 1e-5f);
    std::vector<int64_t> pinned;
    for (int64_t page = 0; page < 8; ++page) {
      if (s.Pinned(0, 0, page)) pinned.push_back(page);
    }
    if (cap == 2) {
      EXPECT_EQ(pinned, (std::vector<int64_t>{5, 7}));  // the two highest
    } else {
      EXPECT_EQ(pinned, (std::vector<int64_t>{2, 5, 7}));  // page 0 is below 2.0
    }
  }
}

TEST(EpiphanyScorerTest, MalformedSignalsAreRejected) {
  EpiphanyScorer s(SmallBands(8), 4, 2, 4);
  const std::vector<float> delta(6, 1.0f);
  StepSignals signals;
  signals.hidden_delta = delta;
  signals.num_layers = 3;  // ≠ 4
  signals.num_tokens = 2;
  s.OnSignals(signals);
  signals.num_layers = 4;  // 2 · 4 ≠ 6 values
  s.OnSignals(signals);
  EXPECT_EQ(s.rejected(), 2);
  EXPECT_EQ(s.scored_tokens(), 0);
  s.OnSignals(StepSignals{});  // nothing to take: not an error
  EXPECT_EQ(s.rejected(), 2);
  // A prefill of 2 tokens at once.
  const std::vector<float> prefill(8, 1.0f);
  signals.hidden_delta = prefill;
  s.OnSignals(signals);
  EXPECT_EQ(s.scored_tokens(), 2);
}

// ---- Scores from keys and values ------------------------------------------------------------

// Two layers: positive band {0}, negative band {1}; Hkv = 2, d = 2.
EpiphanyOptions KvBands(Signal signal, int32_t window) {
  EpiphanyOptions o;
  o.scale_bands = false;
  o.positive_first = o.positive_last = 0;
  o.negative_first = o.negative_last = 1;
  o.signal = signal;
  o.window = window;
  return o;
}

// A block of tokens [n][Hkv = 2][d = 2] stored as `dtype`.
struct Block {
  std::vector<uint16_t> k16, v16;
  std::vector<float> k32, v32;
  TokenBlock view;

  Block(int32_t layer, int64_t first, DType dtype, const std::vector<float>& k,
        const std::vector<float>& v) {
    view.layer = layer;
    view.first_position = first;
    view.num_tokens = static_cast<int32_t>(k.size() / 4);
    view.num_kv_heads = 2;
    view.head_dim = 2;
    view.dtype = dtype;
    if (dtype == DType::kF32) {
      k32 = k;
      v32 = v;
      view.k = k32.data();
      view.v = v32.empty() ? nullptr : v32.data();
      return;
    }
    auto bits = [dtype](float x) {
      return dtype == DType::kF16 ? FloatToHalf(x).bits : FloatToBFloat16(x).bits;
    };
    for (float x : k) k16.push_back(bits(x));
    for (float x : v) v16.push_back(bits(x));
    view.k = k16.data();
    view.v = v16.empty() ? nullptr : v16.data();
  }
};

TEST(EpiphanyScorerTest, KeyVarianceOnHandMadeKeys) {
  // Layer 0 keys, head 0 | head 1, window 4. x = mean over heads of (1/d)·‖k − mean of the
  // previous (up to 4) keys‖²:
  //   t0 (0,0)|(1,1): 0 (no previous key)
  //   t1 (2,0)|(1,1): head 0 ‖(2,0)‖²/2 = 2, head 1 0            → 1
  //   t2 (1,1)|(1,3): means (1,0)|(1,1): 1/2 and 4/2              → 1.25
  //   t3 (0,0)|(1,1): means (1,1/3)|(1,5/3): (10/9)/2, (4/9)/2    → 7/18
  //   t4 (4,0)|(1,1): means (0.75,0.25)|(1,1.5): 5.3125, 0.125   → 2.71875
  //   t5 (0,0)|(1,1): t0 left the window; means (1.75,0.25)|(1,1.5): 1.5625, 0.125 → 0.84375
  const std::vector<float> keys = {0, 0, 1, 1, 2, 0, 1, 1, 1, 1, 1, 3,
                                   0, 0, 1, 1, 4, 0, 1, 1, 0, 0, 1, 1};
  const double expected[] = {0, 1, 1.25, 7.0 / 18, 2.71875, 0.84375};
  for (DType dtype : {DType::kF16, DType::kBF16, DType::kF32}) {
    EpiphanyScorer s(KvBands(Signal::kKeyVariance, 4), 2, 2, 2);
    EXPECT_TRUE(s.needs_tokens());
    for (int t = 0; t < 6; ++t) {
      const std::vector<float> k(keys.begin() + 4 * t, keys.begin() + 4 * t + 4);
      s.OnTokens(Block(0, t, dtype, k, {}).view);
      EXPECT_NEAR(s.last_signal(0), expected[t], 1e-6) << "t=" << t << " " << DTypeName(dtype);
    }
    EXPECT_EQ(s.rejected(), 0);
  }
}

TEST(EpiphanyScorerTest, LagKvOnHandMadeKeysAndValues) {
  // Per head ‖Δk‖/‖k_prev‖ + ‖Δv‖/‖v_prev‖, mean over the 2 heads:
  //   t1: head 0 k (1,0)→(2,0): 1, v unchanged: 0; head 1 k unchanged, v (0,1)→(0,3): 2 → 1.5
  //   t2: head 0 k (2,0)→(2,0): 0, v (1,0)→(0,1): sqrt 2; head 1 unchanged → sqrt(2)/2
  const std::vector<float> k = {1, 0, 0, 1, 2, 0, 0, 1, 2, 0, 0, 1};
  const std::vector<float> v = {1, 0, 0, 1, 1, 0, 0, 3, 0, 1, 0, 3};
  EpiphanyScorer s(KvBands(Signal::kLagKv, 4), 2, 2, 2);
  s.OnTokens(Block(0, 0, DType::kBF16, k, v).view);  // a prefill block of 3 tokens
  EXPECT_NEAR(s.last_signal(0), std::sqrt(2.0) / 2, 1e-6);
  // Token by token gives the same signals.
  EpiphanyScorer one(KvBands(Signal::kLagKv, 4), 2, 2, 2);
  const double expected[] = {0, 1.5, std::sqrt(2.0) / 2};
  for (int t = 0; t < 3; ++t) {
    const std::vector<float> kt(k.begin() + 4 * t, k.begin() + 4 * t + 4);
    const std::vector<float> vt(v.begin() + 4 * t, v.begin() + 4 * t + 4);
    one.OnTokens(Block(0, t, DType::kF32, kt, vt).view);
    EXPECT_NEAR(one.last_signal(0), expected[t], 1e-6) << "t=" << t;
  }
  // Values are required for kLagKv.
  one.OnTokens(Block(0, 3, DType::kF32, std::vector<float>(4, 1.0f), {}).view);
  EXPECT_EQ(one.rejected(), 1);
}

TEST(EpiphanyScorerTest, TokensWaitForEveryBandLayer) {
  EpiphanyScorer s(KvBands(Signal::kLagKv, 4), 2, 2, 2);
  const std::vector<float> ramp = {1, 0, 0, 1, 2, 0, 0, 2, 4, 0, 0, 4};
  // A prefill of 3 tokens on layer 0: nothing scored until layer 1 reports them.
  s.OnTokens(Block(0, 0, DType::kF32, ramp, ramp).view);
  EXPECT_EQ(s.scored_tokens(), 0);
  s.OnTokens(Block(1, 0, DType::kF32, ramp, ramp).view);
  EXPECT_EQ(s.scored_tokens(), 3);
  // Interleaved decode: layer 0 of token 3, then layer 1 of token 3.
  const std::vector<float> next = {8, 0, 0, 8};
  s.OnTokens(Block(0, 3, DType::kF32, next, next).view);
  EXPECT_EQ(s.scored_tokens(), 3);
  EXPECT_FALSE(s.token_score(3).has_value());
  s.OnTokens(Block(1, 3, DType::kF32, next, next).view);
  EXPECT_EQ(s.scored_tokens(), 4);
  EXPECT_TRUE(s.token_score(3).has_value());
  // Same signal in both bands: z_A = z_B, every score 0.
  for (int t = 0; t < 4; ++t) EXPECT_NEAR(*s.token_score(t), 0.0f, 1e-6f);
  // Repeats are skipped; a wrong head count is rejected.
  s.OnTokens(Block(0, 0, DType::kF32, ramp, ramp).view);
  EXPECT_EQ(s.scored_tokens(), 4);
  EXPECT_EQ(s.last_signal(0), s.last_signal(1));
  Block bad(0, 4, DType::kF32, next, next);
  bad.view.num_kv_heads = 1;
  s.OnTokens(bad.view);
  EXPECT_EQ(s.rejected(), 1);
  // Hidden deltas are not this signal's input.
  const std::vector<float> delta(2, 5.0f);
  StepSignals signals;
  signals.first_position = 4;
  signals.hidden_delta = delta;
  signals.num_layers = 2;
  s.OnSignals(signals);
  EXPECT_EQ(s.scored_tokens(), 4);
}

}  // namespace
}  // namespace kvtier::policy
