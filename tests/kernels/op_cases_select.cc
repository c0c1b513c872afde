// The selection ops against the CPU reference: page scores and their pooling, top-k (alone
// and on the scores each backend computed), query cosines and drift flags, the mass trigger's
// selection loss (also against losses worked out by hand), and page-cache replacement.
#include <algorithm>
#include <array>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "kvtier/layout.h"
#include "tests/kernels/op_cases.h"
#include "tests/kernels/op_cases_internal.h"

namespace kvtier::testing::op_cases_internal {
namespace {

// ---- Comparisons of selections ----

// Items compared as the op defines them: the same host page, and for a real (non-skip)
// item the same head and destination slot.
void ExpectSameItems(const OpResult& want, const OpResult& got, int i) {
  const std::vector<RecallItem> w = want.Get<RecallItem>(i), g = got.Get<RecallItem>(i);
  ASSERT_EQ(w.size(), g.size());
  int64_t bad = 0;
  for (size_t j = 0; j < w.size(); ++j) {
    const bool same = w[j].host_page == g[j].host_page &&
                      (w[j].host_page == kSkipItem ||
                       (w[j].kv_head == g[j].kv_head && w[j].dst_slot == g[j].dst_slot));
    if (!same && bad++ < 5) {
      ADD_FAILURE() << "items[" << j << "]: want {" << w[j].host_page << ", " << w[j].kv_head
                    << ", " << w[j].dst_slot << "} got {" << g[j].host_page << ", " << g[j].kv_head
                    << ", " << g[j].dst_slot << "}";
    }
  }
  EXPECT_EQ(bad, 0) << "items mismatches";
}

// Top-k selections [heads][k] made from scores each backend computed itself: equal, except
// that where the two picks at a rank differ both must be pages whose reference scores
// `pooled` ([heads][P]) tie within 1e-5 + 1e-4·|score|.
void ExpectSameSelection(const OpResult& want, const OpResult& got, int isel, int ipooled,
                         int32_t k, int32_t P) {
  const std::vector<int32_t> w = want.Get<int32_t>(isel), g = got.Get<int32_t>(isel);
  const std::vector<float> score = want.Get<float>(ipooled);
  ASSERT_EQ(w.size(), g.size());
  for (size_t j = 0; j < w.size(); ++j) {
    if (w[j] == g[j]) continue;
    const auto head = static_cast<int64_t>(j) / k;
    ASSERT_TRUE(w[j] >= 0 && g[j] >= 0 && g[j] < P)
        << "selected[" << j << "]: want " << w[j] << " got " << g[j];
    const float sw = score[static_cast<size_t>(head * P + w[j])];
    const float sg = score[static_cast<size_t>(head * P + g[j])];
    EXPECT_LE(std::fabs(double{sw} - sg), 1e-5 + 1e-4 * std::fabs(double{sw}))
        << "selected[" << j << "]: want page " << w[j] << " (score " << sw << ") got page " << g[j]
        << " (score " << sg << ")";
  }
}

// ---- ScorePages, QueryCosine ----

// Scores over P = 24 pages of full, empty and partly filled sequences; pooled (and raw
// scores when asked for) start as a sentinel, which masked-off heads must keep.
struct ScoreVariant {
  const char* name;
  bool mask;
  bool with_scores;
  bool codes = false;  // key codes (pages of kCodePageSize tokens)
};
constexpr int32_t kCodePageSize = 40;  // more tokens than a warp's lanes
constexpr int32_t kScorePages = 24;

// The inputs of a ScorePages call; `Op` returns its arguments over the placed buffers.
struct ScoreInputs {
  HeadShape c;
  int iq, isum, inp, imask, iscores, ipooled, icodes = -1;

  ScoreInputs(const HeadShape& shape, uint32_t seed, OpBuffers& in, bool mask, bool scores,
              bool codes = false)
      : c(shape) {
    const int32_t B = c.batch, Hq = QueryHeads(c), d = c.head_dim, P = kScorePages;
    TypedBuffer q(c.dtype, int64_t{B} * Hq * d);
    TypedBuffer summaries(c.dtype, int64_t{B} * P * SummaryLayout{kHkv, d}.page_elements());
    q.FillNormal(seed + 1);
    summaries.FillNormal(seed + 2);
    std::vector<uint8_t> head_mask(static_cast<size_t>(B) * kHkv);
    for (size_t i = 0; i < head_mask.size(); ++i) head_mask[i] = i % 3 == 1 ? 0 : 1;
    iq = in.Add(q);
    isum = in.Add(summaries);
    inp = in.Add(B == 1 ? std::vector<int32_t>{19} : std::vector<int32_t>{P, 0, 7});
    imask = mask ? in.Add(head_mask) : -1;
    iscores = scores ? in.Add(std::vector<float>(static_cast<size_t>(B) * Hq * P, 7.0f)) : -1;
    ipooled = in.Add(std::vector<float>(static_cast<size_t>(B) * kHkv * P, 7.0f));
    if (codes) {
      const KeyCodeLayout cl{kHkv, kCodePageSize, d};
      std::vector<uint8_t> bytes(static_cast<size_t>(int64_t{B} * P * cl.page_bytes()));
      std::mt19937 rng(seed + 3);
      for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
      icodes = in.Add(bytes);
    }
  }

  ScorePagesArgs Args(const OpPtrs& p) const {
    ScorePagesArgs a;
    a.shape = ShapeOf(c, icodes >= 0 ? kCodePageSize : 0);
    a.batch = c.batch;
    a.max_pages = kScorePages;
    a.q = p.get(iq);
    if (icodes >= 0) a.codes = p.get<uint8_t>(icodes);
    a.summaries = p.get(isum);
    a.num_pages = p.get<int32_t>(inp);
    a.softmax_scale = ScaleOf(c.head_dim);
    a.scores = p.get<float>(iscores);
    a.pooled = p.get<float>(ipooled);
    a.head_mask = p.get<uint8_t>(imask);
    return a;
  }
};

OpRun ScorePagesRun(const HeadShape& c, const ScoreVariant& v, uint32_t seed) {
  OpRun r;
  const ScoreInputs s(c, seed, r.in, v.mask, v.with_scores, v.codes);
  r.op = [s](Backend& be, Stream& st, const OpPtrs& p) { return be.ScorePages(st, s.Args(p)); };
  r.check = [s](const OpBuffers&, const OpResult& want, const OpResult& got) {
    ExpectFloatBufNear(want, got, s.ipooled, 1e-4, 1e-5, "pooled");
    if (s.iscores >= 0) ExpectFloatBufNear(want, got, s.iscores, 1e-4, 1e-5, "scores");
  };
  return r;
}

// ScorePages then TopK on one stream, as the Retriever selects: each backend selects from
// the scores it computed, so near-ties may go either way (ExpectSameSelection).
OpRun ScoreTopKRun(const HeadShape& c, uint32_t seed) {
  constexpr int32_t kK = 6;
  OpRun r;
  const ScoreInputs s(c, seed, r.in, /*mask=*/false, /*scores=*/false);
  const int isel = r.in.Add(std::vector<int32_t>(static_cast<size_t>(c.batch) * kHkv * kK, -7));
  r.op = [s, isel](Backend& be, Stream& st, const OpPtrs& p) {
    KVTIER_RETURN_IF_ERROR(be.ScorePages(st, s.Args(p)));
    TopKArgs a;
    a.shape = ShapeOf(s.c);
    a.batch = s.c.batch;
    a.max_pages = kScorePages;
    a.k = kK;
    a.pooled = p.get<float>(s.ipooled);
    a.num_pages = p.get<int32_t>(s.inp);
    a.sink_pages = 1;
    a.recent_pages = 2;
    a.selected = p.get<int32_t>(isel);
    return be.TopK(st, a);
  };
  r.check = [s, isel](const OpBuffers&, const OpResult& want, const OpResult& got) {
    ExpectFloatBufNear(want, got, s.ipooled, 1e-4, 1e-5, "pooled");
    ExpectSameSelection(want, got, isel, s.ipooled, kK, kScorePages);
  };
  return r;
}

// q_prev = q + noise·σ with σ per head from near-identical (no drift) to unrelated; a
// missing previous query (zero vector) for the last KV head of the last sequence and a zero
// current query for query head 0 of sequence 0.
OpRun QueryCosineRun(const HeadShape& c, bool optional, uint32_t seed) {
  const int32_t B = c.batch, Hq = QueryHeads(c), d = c.head_dim;
  const HeadsLayout ql{Hq, d};
  std::mt19937 rng(seed);
  TypedBuffer q(c.dtype, int64_t{B} * Hq * d), noise(c.dtype, q.size()), q_prev(c.dtype, q.size());
  q.FillNormal(seed + 1);
  noise.FillNormal(seed + 2);
  for (int32_t b = 0; b < B; ++b) {
    for (int32_t hq = 0; hq < Hq; ++hq) {
      const float sigma = std::array<float, 4>{0.05f, 0.3f, 0.6f, 3.0f}[Uniform(rng, 0, 3)];
      for (int32_t i = 0; i < d; ++i) {
        const int64_t o = ql.Offset(b, hq, i);
        q_prev.Set(o, q.Get(o) + sigma * noise.Get(o));
      }
    }
  }
  for (int32_t hq = (kHkv - 1) * c.group; hq < Hq; ++hq) {
    for (int32_t i = 0; i < d; ++i) q_prev.Set(ql.Offset(B - 1, hq, i), 0.0f);
  }
  for (int32_t i = 0; i < d; ++i) q.Set(ql.Offset(0, 0, i), 0.0f);
  constexpr float kThreshold = 0.9f;
  OpRun r;
  const int iq = r.in.Add(q), iqp = r.in.Add(q_prev);
  const int icos = optional ? r.in.Add(std::vector<float>(static_cast<size_t>(B) * Hq, 7.0f)) : -1;
  const int imean = r.in.Add(std::vector<float>(static_cast<size_t>(B) * kHkv, 7.0f));
  const int idrift =
      optional ? r.in.Add(std::vector<uint8_t>(static_cast<size_t>(B) * kHkv, 7)) : -1;
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    QueryCosineArgs a;
    a.shape = ShapeOf(c);
    a.batch = B;
    a.q = p.get(iq);
    a.q_prev = p.get(iqp);
    a.threshold = kThreshold;
    a.cosine = p.get<float>(icos);
    a.group_mean = p.get<float>(imean);
    a.drifted = p.get<uint8_t>(idrift);
    return be.QueryCosine(s, a);
  };
  r.check = [=](const OpBuffers&, const OpResult& want, const OpResult& got) {
    const std::vector<float> want_mean = want.Get<float>(imean);
    ExpectFloatsNear(want_mean, got.Get<float>(imean), 0.0, 1e-5, "group_mean");
    // The zero vectors: cosine 0, so those groups drift.
    EXPECT_EQ(got.Get<float>(imean)[static_cast<size_t>(B * kHkv - 1)], 0.0f);
    if (!optional) return;
    ExpectFloatBufNear(want, got, icos, 0.0, 1e-5, "cosine");
    const std::vector<uint8_t> w = want.Get<uint8_t>(idrift), g = got.Get<uint8_t>(idrift);
    for (size_t i = 0; i < w.size(); ++i) {
      // A mean within float noise of τ may fall either way.
      if (std::fabs(want_mean[i] - kThreshold) < 1e-5f) continue;
      EXPECT_EQ(g[i], w[i]) << "drifted[" << i << "], group mean " << want_mean[i];
    }
    EXPECT_EQ(g.back(), 1);
  };
  return r;
}

// ---- TopK ----

struct TopKShape {
  int32_t batch, kv_heads, max_pages, k;
};
struct TopKVariant {
  const char* name;
  bool mask, budgets, flags;
  int32_t sink, recent;
};

// Scores with many ties (a few distinct values), NaN and ±inf; a full sequence, a random
// one and one with fewer candidates than k; per-head budgets; pinned, excluded, both bits
// (excluded wins) and unknown bits (normal). With `wide_scores`, half the scores are
// continuous (every bit of the key matters, ±0 tie) and the rest ties as above.
OpRun TopKRun(const TopKShape& c, const TopKVariant& v, uint32_t seed, bool wide_scores = false) {
  const int32_t B = c.batch, H = c.kv_heads, P = c.max_pages;
  std::mt19937 rng(seed);
  std::vector<float> pooled(static_cast<size_t>(B) * H * P);
  for (float& x : pooled) {
    const int32_t r = Uniform(rng, 0, 99);
    x = r < 5   ? kNaN
        : r < 7 ? -kInf
        : r < 8 ? kInf
                : static_cast<float>(Uniform(rng, -3, 4)) * 0.5f;
    if (wide_scores && r >= 8 && r < 58) {
      x = r < 10   ? (r == 8 ? 0.0f : -0.0f)
          : r < 20 ? std::ldexp(std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng), -100)
                   : std::uniform_real_distribution<float>(-4.0f, 4.0f)(rng);
    }
  }
  std::vector<int32_t> num_pages;
  for (int32_t b = 0; b < B; ++b) {
    num_pages.push_back(b == 0 ? P : b == 1 ? Uniform(rng, 0, P) : std::min(P, c.k / 2 + 3));
  }
  std::vector<uint8_t> head_mask(static_cast<size_t>(B) * H);
  for (size_t i = 0; i < head_mask.size(); ++i) head_mask[i] = i % 3 == 2 ? 0 : 1;
  std::vector<int32_t> head_k(static_cast<size_t>(B) * H);
  for (int32_t& x : head_k) x = Uniform(rng, 0, c.k);
  head_k[0] = c.k;
  std::vector<uint8_t> page_flags(pooled.size());
  for (uint8_t& f : page_flags) {
    const int32_t r = Uniform(rng, 0, 99);
    f = r < 10   ? kPagePinned
        : r < 20 ? kPageExcluded
        : r < 23 ? (kPagePinned | kPageExcluded)
        : r < 26 ? 4
                 : kPageNormal;
  }
  OpRun r;
  const int ipooled = r.in.Add(pooled), inp = r.in.Add(num_pages);
  const int isel = r.in.Add(std::vector<int32_t>(static_cast<size_t>(B) * H * c.k, -7));
  const int imask = v.mask ? r.in.Add(head_mask) : -1;
  const int ihk = v.budgets ? r.in.Add(head_k) : -1;
  const int iflags = v.flags ? r.in.Add(page_flags) : -1;
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    TopKArgs a;
    a.shape.num_kv_heads = H;
    a.batch = B;
    a.max_pages = P;
    a.k = c.k;
    a.pooled = p.get<float>(ipooled);
    a.num_pages = p.get<int32_t>(inp);
    a.sink_pages = v.sink;
    a.recent_pages = v.recent;
    a.selected = p.get<int32_t>(isel);
    a.head_mask = p.get<uint8_t>(imask);
    a.head_k = p.get<int32_t>(ihk);
    a.page_flags = p.get<uint8_t>(iflags);
    return be.TopK(s, a);
  };
  r.check = [isel](const OpBuffers&, const OpResult& want, const OpResult& got) {
    ExpectSameBytes(want, got, isel, sizeof(int32_t), "selected");
  };
  return r;
}

void AddTopKCases(std::vector<OpCase>& cases) {
  for (const TopKShape& c :
       {TopKShape{1, 1, 16, 4}, TopKShape{3, 2, 64, 8}, TopKShape{2, 4, 300, 32},
        TopKShape{3, 8, 1000, 64}, TopKShape{1, 2, 40, 40}, TopKShape{2, 4, 4096, 128}}) {
    for (const TopKVariant& v : {TopKVariant{"plain", false, false, false, 0, 0},
                                 TopKVariant{"sink_recent", false, false, false, 2, 3},
                                 TopKVariant{"head_mask", true, false, false, 1, 0},
                                 TopKVariant{"head_k", false, true, false, 0, 1},
                                 TopKVariant{"page_flags", false, false, true, 0, 0},
                                 TopKVariant{"all", true, true, true, 2, 2}}) {
      Add(cases,
          absl::StrFormat("TopK_b%d_hkv%d_p%d_k%d_%s", c.batch, c.kv_heads, c.max_pages, c.k,
                          v.name),
          [c, v](uint32_t seed) { return TopKRun(c, v, seed); });
    }
  }
  // The GPU's large paths: k = 1024 over about 4096 pages (keys cached in shared memory, the
  // cutoff inside a run of ties and across the pinned boundary), beyond the cache (4500 and
  // 32768 pages), and a selection larger than the shared sort (k = 1500, sorted in place).
  for (const TopKShape& c : {TopKShape{2, 4, 4096, 1024}, TopKShape{2, 2, 4500, 1024},
                             TopKShape{1, 2, 32768, 1024}, TopKShape{1, 2, 3000, 1500}}) {
    for (const TopKVariant& v : {TopKVariant{"plain", false, false, false, 0, 0},
                                 TopKVariant{"all", true, true, true, 2, 2}}) {
      for (const bool wide : {false, true}) {
        Add(cases,
            absl::StrFormat("TopK_b%d_hkv%d_p%d_k%d_%s%s", c.batch, c.kv_heads, c.max_pages, c.k,
                            v.name, wide ? "_wide" : ""),
            [c, v, wide](uint32_t seed) { return TopKRun(c, v, seed, wide); });
      }
    }
    Add(cases,
        absl::StrFormat("TopK_b%d_hkv%d_p%d_k%d_page_flags_wide", c.batch, c.kv_heads, c.max_pages,
                        c.k),
        [c](uint32_t seed) {
          return TopKRun(c, TopKVariant{"page_flags", false, false, true, 0, 0}, seed, true);
        });
  }
}

// ---- SelectionLoss ----

constexpr float kMaxLoss = 0.05f;  // the default correction_max_loss

// Hand-made heads (k = 2, P = 4), each with its expected loss at threshold 0.05.
struct LossHead {
  std::array<float, 4> p;
  std::array<int32_t, 2> current, fresh;
  float loss;
};
const std::vector<LossHead>& KnownLossHeads() {
  static const std::vector<LossHead> heads = {
      {{0.5f, 0.3f, 0.1f, 0.1f}, {2, 3}, {0, 1}, 0.75f},         // (0.8 − 0.2) / 0.8
      {{0.5f, 0.3f, 0.1f, 0.1f}, {1, 0}, {0, 1}, 0.0f},          // the same pages, reordered
      {{0.4f, 0.3f, 0.2f, 0.1f}, {0, -1}, {0, 1}, 0.3f / 0.7f},  // an empty slot
      {{0.5f, 0.3f, 0.1f, 0.1f}, {0, 1}, {0, -1}, 0.0f},         // more than fresh: clamped to 0
      {{0.25f, 0.25f, 0.25f, 0.25f}, {-1, -1}, {-1, -1}, 0.0f},  // nothing selected
      {{0.5f, 0.3f, 0.28f, 0.1f}, {0, 2}, {0, 1}, 0.025f},       // (0.8 − 0.78) / 0.8: kept
  };
  return heads;
}

OpRun SelectionLossKnownRun() {
  constexpr int32_t kK = 2, kP = 4;
  const std::vector<LossHead>& heads = KnownLossHeads();
  const auto n = static_cast<int32_t>(heads.size());  // batch n / kHkv
  std::vector<float> pooled;
  std::vector<int32_t> current, fresh;
  for (const LossHead& h : heads) {
    pooled.insert(pooled.end(), h.p.begin(), h.p.end());
    current.insert(current.end(), h.current.begin(), h.current.end());
    fresh.insert(fresh.end(), h.fresh.begin(), h.fresh.end());
  }
  OpRun r;
  const int ipooled = r.in.Add(pooled), icur = r.in.Add(current), ifr = r.in.Add(fresh);
  const int iloss = r.in.Add(std::vector<float>(static_cast<size_t>(n), 7.0f));
  const int idrift = r.in.Add(std::vector<uint8_t>(static_cast<size_t>(n), 7));
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    SelectionLossArgs a;
    a.shape.num_kv_heads = kHkv;
    a.batch = n / kHkv;
    a.max_pages = kP;
    a.k = kK;
    a.pooled = p.get<float>(ipooled);
    a.current = p.get<int32_t>(icur);
    a.fresh = p.get<int32_t>(ifr);
    a.threshold = kMaxLoss;
    a.loss = p.get<float>(iloss);
    a.drifted = p.get<uint8_t>(idrift);
    return be.SelectionLoss(s, a);
  };
  r.check = [=](const OpBuffers&, const OpResult& want, const OpResult& got) {
    for (const OpResult* res : {&want, &got}) {
      const std::vector<float> loss = res->Get<float>(iloss);
      const std::vector<uint8_t> drifted = res->Get<uint8_t>(idrift);
      for (size_t i = 0; i < heads.size(); ++i) {
        EXPECT_NEAR(loss[i], heads[i].loss, 2e-6)
            << (res == &want ? "cpu" : "backend") << " head " << i;
        EXPECT_EQ(drifted[i], heads[i].loss > kMaxLoss ? 1 : 0) << "head " << i;
      }
      EXPECT_EQ(loss[1], 0.0f) << "the same pages must lose exactly nothing";
    }
  };
  return r;
}

struct LossShape {
  int32_t batch, kv_heads, max_pages, k;
};

// Random pooled rows (probabilities, a few of them NaN) and pairs of selections of distinct
// pages that share about half their pages, padded with kEmptySlot.
OpRun SelectionLossRun(const LossShape& c, bool flags, uint32_t seed) {
  const int32_t B = c.batch, H = c.kv_heads, P = c.max_pages, K = c.k;
  std::mt19937 rng(seed);
  std::vector<float> pooled(static_cast<size_t>(B) * H * P);
  std::vector<int32_t> current(static_cast<size_t>(B) * H * K), fresh(current.size());
  for (int64_t head = 0; head < int64_t{B} * H; ++head) {
    float* row = pooled.data() + head * P;
    double sum = 0;
    for (int32_t p = 0; p < P; ++p) {
      const float x = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
      row[p] = x * x * x;
      sum += row[p];
    }
    for (int32_t p = 0; p < P; ++p) {
      row[p] = Chance(rng, 0.03) ? kNaN : static_cast<float>(row[p] / sum);
    }
    std::vector<int32_t> pages = Iota(P);
    std::shuffle(pages.begin(), pages.end(), rng);
    const int32_t nf = head == 0 ? K : Uniform(rng, 0, K);
    const int32_t nc = head == 0 ? K : Uniform(rng, 0, K);
    for (int32_t i = 0; i < K; ++i) {
      fresh[static_cast<size_t>(head * K + i)] =
          i < nf ? pages[static_cast<size_t>(i)] : kEmptySlot;
      // Current: fresh's page at the same rank half the time, else one fresh does not hold.
      int32_t& cur = current[static_cast<size_t>(head * K + i)];
      if (i >= nc) {
        cur = kEmptySlot;
      } else if (i < nf && Chance(rng, 0.5)) {
        cur = pages[static_cast<size_t>(i)];
      } else {
        cur = pages[static_cast<size_t>(std::min(K + i, P - 1))];
      }
    }
    std::shuffle(current.begin() + head * K, current.begin() + (head + 1) * K, rng);
  }
  OpRun r;
  const int ipooled = r.in.Add(pooled), icur = r.in.Add(current), ifr = r.in.Add(fresh);
  const int iloss = r.in.Add(std::vector<float>(static_cast<size_t>(B) * H, 7.0f));
  const int idrift = flags ? r.in.Add(std::vector<uint8_t>(static_cast<size_t>(B) * H, 7)) : -1;
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    SelectionLossArgs a;
    a.shape.num_kv_heads = H;
    a.batch = B;
    a.max_pages = P;
    a.k = K;
    a.pooled = p.get<float>(ipooled);
    a.current = p.get<int32_t>(icur);
    a.fresh = p.get<int32_t>(ifr);
    a.threshold = 0.2f;
    a.loss = p.get<float>(iloss);
    a.drifted = p.get<uint8_t>(idrift);
    return be.SelectionLoss(s, a);
  };
  r.check = [=](const OpBuffers&, const OpResult& want, const OpResult& got) {
    const std::vector<float> w = want.Get<float>(iloss);
    ExpectFloatsNear(w, got.Get<float>(iloss), 1e-5, 1e-5, "loss");
    if (idrift < 0) return;
    const std::vector<uint8_t> wd = want.Get<uint8_t>(idrift), gd = got.Get<uint8_t>(idrift);
    for (size_t i = 0; i < wd.size(); ++i) {
      if (std::fabs(w[i] - 0.2f) < 1e-5f) continue;  // within float noise of the threshold
      EXPECT_EQ(gd[i], wd[i]) << "drifted[" << i << "], loss " << w[i];
    }
  };
  return r;
}

void AddSelectionLossCases(std::vector<OpCase>& cases) {
  Add(cases, "SelectionLoss_known", [](uint32_t) { return SelectionLossKnownRun(); });
  for (const LossShape& c :
       {LossShape{1, 1, 16, 4}, LossShape{3, 2, 64, 8}, LossShape{2, 4, 300, 32},
        LossShape{2, 8, 1000, 200}, LossShape{1, 2, 40, 40}}) {
    for (const bool flags : {true, false}) {
      Add(cases,
          absl::StrFormat("SelectionLoss_b%d_hkv%d_p%d_k%d%s", c.batch, c.kv_heads, c.max_pages,
                          c.k, flags ? "" : "_loss_only"),
          [c, flags](uint32_t seed) { return SelectionLossRun(c, flags, seed); });
    }
  }
}

// ---- Replace ----

struct ReplaceShape {
  int32_t batch, kv_heads, num_slots, region_begin, k, max_pages;
};

// Regions of distinct pages with a fifth of the slots empty (anything outside them, which
// must stay untouched); selections of up to k distinct pages, about half of them resident
// (hits), best first; every selected page with a host page and some others without one.
// With `corrupt`, tables no TopK makes: repeated pages in the region (later copies are
// evicted) and in the selection (a repeat is a hit), and negative entries other than -1.
OpRun ReplaceRun(const ReplaceShape& c, bool mask, bool misses, uint32_t seed,
                 bool corrupt = false) {
  const int32_t B = c.batch, H = c.kv_heads, S = c.num_slots, K = c.k, P = c.max_pages;
  const SlotTableLayout tl{H, S};
  std::mt19937 rng(seed);
  std::vector<int32_t> slot_table(static_cast<size_t>(B) * H * S);
  std::vector<int32_t> selected(static_cast<size_t>(B) * H * K);
  std::vector<int64_t> host_page_of(static_cast<size_t>(B) * P, -1);
  for (int32_t b = 0; b < B; ++b) {
    std::vector<bool> wanted(static_cast<size_t>(P), false);
    for (int32_t h = 0; h < H; ++h) {
      std::vector<int32_t> pages = Iota(P);
      std::shuffle(pages.begin(), pages.end(), rng);
      std::vector<int32_t> resident;
      for (int32_t s = 0; s < S; ++s) {
        int32_t& e = slot_table[tl.Offset(b, h, s)];
        if (s < c.region_begin || s >= c.region_begin + K) {
          e = Uniform(rng, -1, 3 * P);
        } else if (Chance(rng, 0.2)) {
          e = kEmptySlot;
        } else {
          e = pages[static_cast<size_t>(s - c.region_begin)];
          resident.push_back(e);
        }
      }
      const int32_t m = h == 0 && b == 0 ? K : Uniform(rng, 0, K);
      std::vector<int32_t> sel;
      std::shuffle(resident.begin(), resident.end(), rng);
      for (int32_t page : resident) {
        if (static_cast<int32_t>(sel.size()) < m && Chance(rng, 0.5)) sel.push_back(page);
      }
      for (size_t j = static_cast<size_t>(K);
           j < pages.size() && static_cast<int32_t>(sel.size()) < m; ++j) {
        sel.push_back(pages[j]);  // not in the region: a miss
      }
      std::shuffle(sel.begin(), sel.end(), rng);
      if (corrupt && !sel.empty()) {
        for (int32_t s = c.region_begin; s < c.region_begin + K; ++s) {
          int32_t& e = slot_table[tl.Offset(b, h, s)];
          const int32_t r = Uniform(rng, 0, 9);
          if (r == 0) e = -5;
          if (r == 1) e = slot_table[tl.Offset(b, h, Uniform(rng, c.region_begin, s))];
        }
        for (size_t j = 1; j < sel.size(); ++j) {
          const int32_t earlier = Uniform(rng, 0, static_cast<int32_t>(j) - 1);
          if (Chance(rng, 0.1)) sel[j] = sel[static_cast<size_t>(earlier)];
        }
      }
      for (int32_t i = 0; i < K; ++i) {
        const int32_t page =
            i < static_cast<int32_t>(sel.size()) ? sel[static_cast<size_t>(i)] : kEmptySlot;
        selected[static_cast<size_t>((int64_t{b} * H + h) * K + i)] = page;
        if (page >= 0) wanted[static_cast<size_t>(page)] = true;
      }
    }
    for (int32_t page = 0; page < P; ++page) {
      if (wanted[static_cast<size_t>(page)] || Chance(rng, 0.5)) {
        host_page_of[static_cast<size_t>(int64_t{b} * P + page)] = Uniform(rng, 0, 100000);
      }
    }
  }
  std::vector<uint8_t> head_mask(static_cast<size_t>(B) * H);
  for (size_t i = 0; i < head_mask.size(); ++i) head_mask[i] = i % 3 == 1 ? 0 : 1;
  OpRun r;
  const int isel = r.in.Add(selected), itab = r.in.Add(slot_table);
  const int ihp = r.in.Add(host_page_of);
  const int iitems =
      r.in.Add(std::vector<RecallItem>(static_cast<size_t>(B) * H * K, RecallItem{-9, -9, -9}));
  const int imask = mask ? r.in.Add(head_mask) : -1;
  const int imiss = misses ? r.in.Add(std::vector<int32_t>(static_cast<size_t>(B) * H, -5)) : -1;
  r.op = [=](Backend& be, Stream& s, const OpPtrs& p) {
    ReplaceArgs a;
    a.shape.num_kv_heads = H;
    a.kv.num_slots = S;
    a.kv.slot_table = p.get<int32_t>(itab);
    a.batch = B;
    a.region_begin = c.region_begin;
    a.k = K;
    a.selected = p.get<int32_t>(isel);
    a.host_page_of = p.get<int64_t>(ihp);
    a.max_pages = P;
    a.head_mask = p.get<uint8_t>(imask);
    a.items = p.get<RecallItem>(iitems);
    a.num_misses = p.get<int32_t>(imiss);
    return be.Replace(s, a);
  };
  r.check = [=](const OpBuffers&, const OpResult& want, const OpResult& got) {
    ExpectSameBytes(want, got, itab, sizeof(int32_t), "slot_table");
    ExpectSameItems(want, got, iitems);
    if (imiss >= 0) ExpectSameBytes(want, got, imiss, sizeof(int32_t), "num_misses");
  };
  return r;
}

void AddReplaceCases(std::vector<OpCase>& cases) {
  for (const ReplaceShape& c :
       {ReplaceShape{1, 1, 8, 0, 8, 32}, ReplaceShape{3, 2, 20, 4, 12, 64},
        ReplaceShape{2, 8, 64, 16, 32, 500}, ReplaceShape{3, 4, 40, 0, 40, 100}}) {
    struct Variant {
      const char* name;
      bool mask, misses;
    };
    for (const Variant v : {Variant{"plain", false, true}, Variant{"head_mask", true, true},
                            Variant{"head_mask_no_misses", true, false}}) {
      Add(cases,
          absl::StrFormat("Replace_b%d_hkv%d_s%d_r%d_k%d_p%d_%s", c.batch, c.kv_heads, c.num_slots,
                          c.region_begin, c.k, c.max_pages, v.name),
          [c, v](uint32_t seed) { return ReplaceRun(c, v.mask, v.misses, seed); });
    }
  }
  // The GPU's shared page indexes at their largest (k = 1024, regions partly resident) and
  // corrupt tables, and a region beyond them (k = 1100, the scanning fallback).
  for (const ReplaceShape& c :
       {ReplaceShape{2, 4, 1100, 40, 1024, 4096}, ReplaceShape{1, 2, 1100, 0, 1100, 3000},
        ReplaceShape{3, 2, 40, 4, 33, 100}}) {
    for (const bool corrupt : {false, true}) {
      Add(cases,
          absl::StrFormat("Replace_b%d_hkv%d_s%d_r%d_k%d_p%d_%s", c.batch, c.kv_heads, c.num_slots,
                          c.region_begin, c.k, c.max_pages, corrupt ? "corrupt" : "masked"),
          [c, corrupt](uint32_t seed) { return ReplaceRun(c, true, true, seed, corrupt); });
    }
  }
}

}  // namespace

void AddSelectionCases(std::vector<OpCase>& cases) {
  for (const HeadShape& c : HeadShapes()) {
    const std::string shape = NameOf(c);
    for (const ScoreVariant& v :
         {ScoreVariant{"scores", false, true}, ScoreVariant{"mask", true, false},
          ScoreVariant{"mask_scores", true, true}, ScoreVariant{"plain", false, false},
          ScoreVariant{"keycodes", false, true, true},
          ScoreVariant{"keycodes_mask", true, false, true}}) {
      Add(cases, "ScorePages_" + shape + "_" + v.name,
          [c, v](uint32_t seed) { return ScorePagesRun(c, v, seed); });
    }
    Add(cases, "ScoreTopK_" + shape, [c](uint32_t seed) { return ScoreTopKRun(c, seed); });
    for (const bool optional : {true, false}) {
      Add(cases, "QueryCosine_" + shape + (optional ? "_all_outputs" : "_mean_only"),
          [c, optional](uint32_t seed) { return QueryCosineRun(c, optional, seed); });
    }
  }
  AddTopKCases(cases);
  AddSelectionLossCases(cases);
  AddReplaceCases(cases);
}

}  // namespace kvtier::testing::op_cases_internal
