// The synthetic decode trace (bench/trace.h; the model in docs/trace-format.md).
//
// Invariants: every random quantity comes from its own counter-based stream, seeded by
// splitmix64 over (seed, stream, coordinates), so an element never depends on the order in
// which others were produced. The only iterated state is a layer's query process (AR(1)
// weights, AR(1) noise, dominant topics), advanced one step at a time from step 0 and cached.
#include <algorithm>
#include <cmath>
#include <optional>

#include "absl/strings/str_format.h"
#include "bench/trace.h"
#include "core/status.h"
#include "kvtier/dtype.h"

namespace kvtier::bench {
namespace {

// Shares of the squared norm of a query before it is normalised. The fixed part (sink,
// recency, dominant topic) changes only at a jump (recency drifts slowly); the fluctuating
// part (AR weights over all topics, isotropic AR noise) has step-to-step correlation rho, so
// the mean step cosine is about kFixedShare + kFluctShare·rho.
constexpr double kSinkShare = 0.15;
constexpr double kRecentShare = 0.10;
constexpr double kTopicShare = 0.30;
constexpr double kWeightShare = 0.10;
constexpr double kNoiseShare = 0.35;
constexpr double kFluctShare = kWeightShare + kNoiseShare;
constexpr double kMinStepCosine = 1.0 - kFluctShare;

// Independent random streams. Appending is fine; renumbering changes every trace.
enum class Stream : uint64_t {
  kBasis = 1,  // (layer, kv_head): sink direction and topics
  kKnot,       // (layer, kv_head, knot): recency knots
  kHeavy,      // (layer, kv_head, rank): heavy page placement
  kDominant,   // (layer, kv_head): dominant topic at step 0
  kJump,       // (layer, step, kv_head)
  kQuery,      // (layer, step, q_head): AR innovations
  kKeyNoise,   // (layer, position, kv_head)
  kKeyScale,   // (layer, position, kv_head): per-token boost factors
  kValue,      // (layer, position, kv_head)
  kPageTopic,  // (layer, kv_head, page): background topic of a prefill page
};

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;

uint64_t Mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t StreamSeed(uint64_t seed, Stream s, uint64_t a, uint64_t b = 0, uint64_t c = 0) {
  uint64_t h = Mix64(seed + kGolden * static_cast<uint64_t>(s));
  h = Mix64((h ^ a) + kGolden);
  h = Mix64((h ^ b) + kGolden);
  return Mix64((h ^ c) + kGolden);
}

// splitmix64 generator over one stream.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    state_ += kGolden;
    return Mix64(state_);
  }
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }  // [0, 1)
  float UniformF() { return static_cast<float>(Next() >> 40) * 0x1.0p-24f; }  // [0, 1)
  // About N(0, 1): the Irwin–Hall sum of four 16-bit uniforms, mean 0 and variance 1.
  // Integer sums and one rounding: the same bits on every platform, and cheap.
  float Normal() {
    const uint64_t x = Next();
    const int64_t s = static_cast<int64_t>((x & 0xffff) + ((x >> 16) & 0xffff) +
                                           ((x >> 32) & 0xffff) + (x >> 48));
    return static_cast<float>(s - 131070) * (1.7320508f / 65536.0f);
  }

 private:
  uint64_t state_;
};

double Dot(const float* a, const float* b, int32_t d) {
  double s = 0;
  for (int32_t i = 0; i < d; ++i) s += double{a[i]} * b[i];
  return s;
}

void Normalise(float* x, int32_t d, double norm) {
  const double n = std::sqrt(Dot(x, x, d));
  for (int32_t i = 0; i < d; ++i) x[i] = static_cast<float>(x[i] * (norm / n));
}

// *out = a random unit vector orthogonal to the `m` orthonormal rows of `basis`.
void RandomUnitOrthogonal(Rng& rng, const float* basis, int32_t m, int32_t d, float* out) {
  for (;;) {
    for (int32_t i = 0; i < d; ++i) out[i] = rng.Normal();
    for (int pass = 0; pass < 2; ++pass) {  // twice: Gram–Schmidt stays orthogonal in float
      for (int32_t j = 0; j < m; ++j) {
        const float* b = basis + static_cast<int64_t>(j) * d;
        const double c = Dot(out, b, d);
        for (int32_t i = 0; i < d; ++i) out[i] = static_cast<float>(out[i] - c * b[i]);
      }
    }
    if (Dot(out, out, d) > 1e-3 * d) break;  // a near-degenerate draw: draw again
  }
  Normalise(out, d, 1.0);
}

void StoreRow(const float* src, int32_t n, DType t, uint8_t* dst) {
  switch (t) {
    case DType::kF16:
      for (int32_t i = 0; i < n; ++i) reinterpret_cast<Half*>(dst)[i] = FloatToHalf(src[i]);
      return;
    case DType::kBF16:
      for (int32_t i = 0; i < n; ++i) {
        reinterpret_cast<BFloat16*>(dst)[i] = FloatToBFloat16(src[i]);
      }
      return;
    case DType::kF32:
      std::copy(src, src + n, reinterpret_cast<float*>(dst));
      return;
  }
}

absl::Status CheckRange(const char* name, double v, double lo, double hi) {
  if (v >= lo && v <= hi) return absl::OkStatus();  // false for NaN
  return absl::InvalidArgumentError(
      absl::StrFormat("synthetic trace: %s = %g: must be in [%g, %g]", name, v, lo, hi));
}

absl::Status Validate(const SyntheticTraceOptions& o) {
  KVTIER_RETURN_IF_ERROR(o.geometry.Validate());
  KVTIER_RETURN_IF_ERROR(CheckRange("prefill_tokens", o.prefill_tokens, 1, kMaxTracePrefillTokens));
  KVTIER_RETURN_IF_ERROR(CheckRange("num_steps", o.num_steps, 0, kMaxTraceSteps));
  KVTIER_RETURN_IF_ERROR(
      CheckRange("num_topics", o.num_topics, 1, std::min(64, o.geometry.head_dim - 2)));
  KVTIER_RETURN_IF_ERROR(CheckRange("heavy_page_fraction", o.heavy_page_fraction, 0, 0.5));
  KVTIER_RETURN_IF_ERROR(CheckRange("sink_logit", o.sink_logit, 0, 20));
  KVTIER_RETURN_IF_ERROR(CheckRange("heavy_logit", o.heavy_logit, 0, 20));
  KVTIER_RETURN_IF_ERROR(CheckRange("recent_logit", o.recent_logit, 0, 20));
  KVTIER_RETURN_IF_ERROR(CheckRange("topic_logit", o.topic_logit, 0, 20));
  KVTIER_RETURN_IF_ERROR(CheckRange("recent_tokens", o.recent_tokens, 1, 1 << 20));
  KVTIER_RETURN_IF_ERROR(CheckRange("key_noise", o.key_noise, 0, 10));
  KVTIER_RETURN_IF_ERROR(CheckRange("step_cosine", o.step_cosine, kMinStepCosine, 1));
  return CheckRange("jump_probability", o.jump_probability, 0, 1);
}

// The dominant-topic process of (layer, kv_head): its value at step 0, and one step on.
int32_t InitialTopic(const SyntheticTraceOptions& o, int32_t layer, int32_t h) {
  return static_cast<int32_t>(StreamSeed(o.seed, Stream::kDominant, static_cast<uint64_t>(layer),
                                         static_cast<uint64_t>(h)) %
                              static_cast<uint64_t>(o.num_topics));
}
int32_t NextTopic(const SyntheticTraceOptions& o, int32_t layer, int32_t step, int32_t h,
                  int32_t topic) {
  Rng rng(StreamSeed(o.seed, Stream::kJump, static_cast<uint64_t>(layer),
                     static_cast<uint64_t>(step), static_cast<uint64_t>(h)));
  if (o.num_topics < 2 || !(rng.Uniform() < o.jump_probability)) return topic;
  const auto others = static_cast<uint64_t>(o.num_topics - 1);
  return static_cast<int32_t>((static_cast<uint64_t>(topic) + 1 + rng.Next() % others) %
                              static_cast<uint64_t>(o.num_topics));
}

// What is fixed per layer, built on first use.
struct LayerModel {
  std::vector<float> basis;         // [Hkv][1 + K][d] unit rows: sink direction, topics
  std::vector<int8_t> heavy_topic;  // [Hkv][full prefill pages]: topic of a heavy page, or −1
};

// The query process of one layer at `step`.
struct QueryState {
  int32_t step = -1;
  std::vector<int32_t> dominant;  // [Hkv] topic index
  std::vector<float> weights;     // [Hq][K] AR(1) topic weights
  std::vector<float> noise;       // [Hq][d] AR(1) isotropic part
};

// The unit recency direction of one (layer, kv_head) at a token position: random unit knots
// every recent_tokens tokens (orthogonal to the head's sink and topics), linearly
// interpolated and normalised. Caches the two knots around the last position asked for.
class Recency {
 public:
  Recency(const SyntheticTraceOptions& o, int32_t layer, int32_t h, const float* basis)
      : o_(o),
        layer_(layer),
        h_(h),
        basis_(basis),
        d_(o.geometry.head_dim),
        a_(static_cast<size_t>(d_)),
        b_(a_.size()),
        out_(a_.size()) {}

  const float* At(int64_t pos) {
    const int64_t knot = pos / o_.recent_tokens;
    if (knot != knot_) {
      if (knot == knot_ + 1) {
        a_.swap(b_);
      } else {
        Knot(knot, a_.data());
      }
      Knot(knot + 1, b_.data());
      knot_ = knot;
    }
    const float phi =
        static_cast<float>(pos % o_.recent_tokens) / static_cast<float>(o_.recent_tokens);
    for (size_t i = 0; i < out_.size(); ++i) out_[i] = (1 - phi) * a_[i] + phi * b_[i];
    Normalise(out_.data(), d_, 1.0);
    return out_.data();
  }

 private:
  void Knot(int64_t knot, float* out) const {
    Rng rng(StreamSeed(o_.seed, Stream::kKnot, static_cast<uint64_t>(layer_),
                       static_cast<uint64_t>(h_), static_cast<uint64_t>(knot)));
    RandomUnitOrthogonal(rng, basis_, 1 + o_.num_topics, d_, out);
  }

  const SyntheticTraceOptions& o_;
  int32_t layer_, h_;
  const float* basis_;
  int32_t d_;
  int64_t knot_ = -2;
  std::vector<float> a_, b_, out_;
};

class SyntheticTrace final : public TraceSource {
 public:
  explicit SyntheticTrace(const SyntheticTraceOptions& o)
      : o_(o),
        g_(o.geometry),
        models_(static_cast<size_t>(g_.num_layers)),
        queries_(static_cast<size_t>(g_.num_layers)) {
    rho_ = 1.0 - (1.0 - o.step_cosine) / kFluctShare;
    sigma_w_ = std::sqrt(kWeightShare / o.num_topics);
    sigma_n_ = std::sqrt(kNoiseShare / g_.head_dim);
  }

  const Geometry& geometry() const override { return g_; }
  int32_t prefill_tokens() const override { return o_.prefill_tokens; }
  int32_t num_steps() const override { return o_.num_steps; }

  absl::Status Prefill(int32_t layer, std::vector<uint8_t>* k, std::vector<uint8_t>* v) override;
  absl::Status Step(int32_t step, int32_t layer, std::vector<uint8_t>* q, std::vector<uint8_t>* k,
                    std::vector<uint8_t>* v) override;

 private:
  const LayerModel& Model(int32_t layer);
  const QueryState& Queries(int32_t layer, int32_t step);
  void Advance(int32_t layer, QueryState& s) const;
  // Key of (layer, pos, kv head h): noise, recency, the sink for page 0, and alignment with
  // a heavy topic or (weaker) a background topic; −1 for none.
  void KeyRow(int32_t layer, int64_t pos, int32_t h, const float* recent, int32_t heavy_topic,
              int32_t background_topic, float* row) const;
  void ValueRow(int32_t layer, int64_t pos, int32_t h, float* row) const;
  // The background topic of a prefill page that is not heavy.
  int32_t PageTopic(int32_t layer, int32_t h, int32_t page) const {
    return static_cast<int32_t>(StreamSeed(o_.seed, Stream::kPageTopic,
                                           static_cast<uint64_t>(layer), static_cast<uint64_t>(h),
                                           static_cast<uint64_t>(page)) %
                                static_cast<uint64_t>(o_.num_topics));
  }
  const float* Basis(const LayerModel& m, int32_t h, int32_t row) const {
    return m.basis.data() + (static_cast<int64_t>(h) * (1 + o_.num_topics) + row) * g_.head_dim;
  }
  absl::Status CheckLayer(int32_t layer) const {
    if (layer >= 0 && layer < g_.num_layers) return absl::OkStatus();
    return absl::OutOfRangeError(
        absl::StrFormat("synthetic trace: layer %d outside [0, %d)", layer, g_.num_layers));
  }

  const SyntheticTraceOptions o_;
  const Geometry g_;
  double rho_, sigma_w_, sigma_n_;
  std::vector<std::optional<LayerModel>> models_;  // [L]
  std::vector<QueryState> queries_;                // [L]
};

const LayerModel& SyntheticTrace::Model(int32_t layer) {
  std::optional<LayerModel>& m = models_[static_cast<size_t>(layer)];
  if (m) return *m;
  m.emplace();
  const int32_t K = o_.num_topics, d = g_.head_dim, rows = 1 + K;
  m->basis.resize(static_cast<size_t>(g_.num_kv_heads) * rows * d);
  const int32_t pages = o_.prefill_tokens / g_.page_size;  // full prefill pages
  m->heavy_topic.assign(static_cast<size_t>(g_.num_kv_heads) * pages, -1);
  // Heavy pages: per_topic per topic among pages [1, pages), placed by hash with linear
  // probing; ranks go round the topics so a shortage of pages is shared evenly.
  const int32_t candidates = pages - 1;
  const int32_t per_topic =
      o_.heavy_page_fraction > 0
          ? std::max(1, static_cast<int32_t>(std::lround(o_.heavy_page_fraction * pages / K)))
          : 0;
  for (int32_t h = 0; h < g_.num_kv_heads; ++h) {
    Rng rng(StreamSeed(o_.seed, Stream::kBasis, static_cast<uint64_t>(layer),
                       static_cast<uint64_t>(h)));
    float* basis = m->basis.data() + static_cast<int64_t>(h) * rows * d;
    for (int32_t r = 0; r < rows; ++r) {
      RandomUnitOrthogonal(rng, basis, r, d, basis + static_cast<int64_t>(r) * d);
    }
    int8_t* topic_of = m->heavy_topic.data() + static_cast<int64_t>(h) * pages;
    int32_t placed = 0;
    for (int32_t rank = 0; rank < per_topic * K && placed < candidates; ++rank, ++placed) {
      auto at =
          static_cast<int32_t>(StreamSeed(o_.seed, Stream::kHeavy, static_cast<uint64_t>(layer),
                                          static_cast<uint64_t>(h), static_cast<uint64_t>(rank)) %
                               static_cast<uint64_t>(candidates));
      while (topic_of[1 + at] >= 0) at = (at + 1) % candidates;
      topic_of[1 + at] = static_cast<int8_t>(rank % K);
    }
  }
  return *m;
}

void SyntheticTrace::Advance(int32_t layer, QueryState& s) const {
  const int32_t K = o_.num_topics, d = g_.head_dim;
  ++s.step;
  if (s.step == 0) {
    s.dominant.resize(static_cast<size_t>(g_.num_kv_heads));
    for (int32_t h = 0; h < g_.num_kv_heads; ++h) {
      s.dominant[static_cast<size_t>(h)] = InitialTopic(o_, layer, h);
    }
    s.weights.assign(static_cast<size_t>(g_.num_q_heads) * K, 0.0f);
    s.noise.assign(static_cast<size_t>(g_.num_q_heads) * d, 0.0f);
  } else {
    for (int32_t h = 0; h < g_.num_kv_heads; ++h) {
      int32_t& topic = s.dominant[static_cast<size_t>(h)];
      topic = NextTopic(o_, layer, s.step, h, topic);
    }
  }
  // AR(1) with stationary variance σ²: x ← ρ·x + √(1−ρ²)·σ·ε; step 0 draws x = σ·ε.
  const double keep = s.step == 0 ? 0.0 : rho_;
  const double innovation = std::sqrt(1.0 - keep * keep);
  for (int32_t qh = 0; qh < g_.num_q_heads; ++qh) {
    Rng rng(StreamSeed(o_.seed, Stream::kQuery, static_cast<uint64_t>(layer),
                       static_cast<uint64_t>(s.step), static_cast<uint64_t>(qh)));
    float* w = s.weights.data() + static_cast<int64_t>(qh) * K;
    for (int32_t j = 0; j < K; ++j) {
      w[j] = static_cast<float>(keep * w[j] + innovation * sigma_w_ * rng.Normal());
    }
    float* n = s.noise.data() + static_cast<int64_t>(qh) * d;
    for (int32_t i = 0; i < d; ++i) {
      n[i] = static_cast<float>(keep * n[i] + innovation * sigma_n_ * rng.Normal());
    }
  }
}

const QueryState& SyntheticTrace::Queries(int32_t layer, int32_t step) {
  QueryState& s = queries_[static_cast<size_t>(layer)];
  if (s.step > step) s = QueryState{};  // random access backwards: replay from step 0
  while (s.step < step) Advance(layer, s);
  return s;
}

void SyntheticTrace::KeyRow(int32_t layer, int64_t pos, int32_t h, const float* recent,
                            int32_t heavy_topic, int32_t background_topic, float* row) const {
  const LayerModel& m = *models_[static_cast<size_t>(layer)];
  const int32_t d = g_.head_dim;
  Rng noise(StreamSeed(o_.seed, Stream::kKeyNoise, static_cast<uint64_t>(layer),
                       static_cast<uint64_t>(pos), static_cast<uint64_t>(h)));
  for (int32_t i = 0; i < d; ++i) row[i] = o_.key_noise * noise.Normal();
  // A key component c along a unit direction u of the query adds c·(share of u in the
  // query)^½ to the scaled logit, since queries are normalised to norm √d.
  auto add = [&](const float* u, double c) {
    for (int32_t i = 0; i < d; ++i) row[i] = static_cast<float>(row[i] + c * u[i]);
  };
  Rng scale(StreamSeed(o_.seed, Stream::kKeyScale, static_cast<uint64_t>(layer),
                       static_cast<uint64_t>(pos), static_cast<uint64_t>(h)));
  const double sink_u = 0.7 + 0.3 * scale.UniformF(), heavy_u = 0.5 + 0.5 * scale.UniformF();
  const double background_u = scale.UniformF();
  add(recent, o_.recent_logit / std::sqrt(kRecentShare));
  if (pos < g_.page_size) add(Basis(m, h, 0), sink_u * o_.sink_logit / std::sqrt(kSinkShare));
  if (heavy_topic >= 0) {
    add(Basis(m, h, 1 + heavy_topic), heavy_u * o_.heavy_logit / std::sqrt(kTopicShare));
  }
  if (background_topic >= 0) {
    add(Basis(m, h, 1 + background_topic), background_u * o_.topic_logit / std::sqrt(kTopicShare));
  }
}

void SyntheticTrace::ValueRow(int32_t layer, int64_t pos, int32_t h, float* row) const {
  Rng rng(StreamSeed(o_.seed, Stream::kValue, static_cast<uint64_t>(layer),
                     static_cast<uint64_t>(pos), static_cast<uint64_t>(h)));
  for (int32_t i = 0; i < g_.head_dim; ++i) row[i] = rng.Normal();
}

absl::Status SyntheticTrace::Prefill(int32_t layer, std::vector<uint8_t>* k,
                                     std::vector<uint8_t>* v) {
  KVTIER_RETURN_IF_ERROR(CheckLayer(layer));
  const LayerModel& m = Model(layer);
  const int32_t T = o_.prefill_tokens, Hkv = g_.num_kv_heads, d = g_.head_dim;
  const int32_t pages = T / g_.page_size;
  const size_t row_bytes = static_cast<size_t>(d) * g_.element_bytes();
  k->resize(static_cast<size_t>(T) * Hkv * row_bytes);
  v->resize(k->size());
  std::vector<Recency> recency;
  for (int32_t h = 0; h < Hkv; ++h) recency.emplace_back(o_, layer, h, Basis(m, h, 0));
  std::vector<float> row(static_cast<size_t>(d));
  for (int32_t pos = 0; pos < T; ++pos) {
    const int32_t page = pos / g_.page_size;
    for (int32_t h = 0; h < Hkv; ++h) {
      const int32_t heavy =
          page < pages ? m.heavy_topic[static_cast<size_t>(h) * pages + page] : -1;
      const size_t at = (static_cast<size_t>(pos) * Hkv + h) * row_bytes;
      KeyRow(layer, pos, h, recency[static_cast<size_t>(h)].At(pos), heavy,
             heavy >= 0 ? -1 : PageTopic(layer, h, page), row.data());
      StoreRow(row.data(), d, g_.dtype, k->data() + at);
      ValueRow(layer, pos, h, row.data());
      StoreRow(row.data(), d, g_.dtype, v->data() + at);
    }
  }
  return absl::OkStatus();
}

absl::Status SyntheticTrace::Step(int32_t step, int32_t layer, std::vector<uint8_t>* q,
                                  std::vector<uint8_t>* k, std::vector<uint8_t>* v) {
  KVTIER_RETURN_IF_ERROR(CheckLayer(layer));
  if (step < 0 || step >= o_.num_steps) {
    return absl::OutOfRangeError(
        absl::StrFormat("synthetic trace: step %d outside [0, %d)", step, o_.num_steps));
  }
  const LayerModel& m = Model(layer);
  const QueryState& s = Queries(layer, step);
  const int32_t K = o_.num_topics, d = g_.head_dim, G = g_.group_size();
  const int64_t pos = int64_t{o_.prefill_tokens} + step;
  const size_t row_bytes = static_cast<size_t>(d) * g_.element_bytes();
  q->resize(static_cast<size_t>(g_.num_q_heads) * row_bytes);
  k->resize(static_cast<size_t>(g_.num_kv_heads) * row_bytes);
  v->resize(k->size());
  std::vector<float> row(static_cast<size_t>(d));
  for (int32_t h = 0; h < g_.num_kv_heads; ++h) {
    Recency recency(o_, layer, h, Basis(m, h, 0));
    const float* recent = recency.At(pos);
    const int32_t topic = s.dominant[static_cast<size_t>(h)];
    KeyRow(layer, pos, h, recent, -1, topic, row.data());
    StoreRow(row.data(), d, g_.dtype, k->data() + static_cast<size_t>(h) * row_bytes);
    ValueRow(layer, pos, h, row.data());
    StoreRow(row.data(), d, g_.dtype, v->data() + static_cast<size_t>(h) * row_bytes);
    // Queries of the group: fixed part (sink, recency, dominant topic) + AR weights over
    // the topics + AR noise, normalised to norm √d.
    for (int32_t qh = h * G; qh < (h + 1) * G; ++qh) {
      const float* w = s.weights.data() + static_cast<int64_t>(qh) * K;
      const float* n = s.noise.data() + static_cast<int64_t>(qh) * d;
      for (int32_t i = 0; i < d; ++i) {
        double x = std::sqrt(kSinkShare) * Basis(m, h, 0)[i] + std::sqrt(kRecentShare) * recent[i] +
                   std::sqrt(kTopicShare) * Basis(m, h, 1 + topic)[i] + n[i];
        for (int32_t j = 0; j < K; ++j) x += double{w[j]} * Basis(m, h, 1 + j)[i];
        row[static_cast<size_t>(i)] = static_cast<float>(x);
      }
      Normalise(row.data(), d, std::sqrt(static_cast<double>(d)));
      StoreRow(row.data(), d, g_.dtype, q->data() + static_cast<size_t>(qh) * row_bytes);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TraceSource>> MakeSyntheticTrace(const SyntheticTraceOptions& o) {
  KVTIER_RETURN_IF_ERROR(Validate(o));
  return std::make_unique<SyntheticTrace>(o);
}

absl::StatusOr<std::vector<int32_t>> SyntheticDominantTopics(const SyntheticTraceOptions& o,
                                                             int32_t layer, int32_t kv_head) {
  KVTIER_RETURN_IF_ERROR(Validate(o));
  if (layer < 0 || layer >= o.geometry.num_layers || kv_head < 0 ||
      kv_head >= o.geometry.num_kv_heads) {
    return absl::OutOfRangeError(
        absl::StrFormat("synthetic trace: (layer %d, kv_head %d) outside [0, %d) × [0, %d)", layer,
                        kv_head, o.geometry.num_layers, o.geometry.num_kv_heads));
  }
  std::vector<int32_t> topics(static_cast<size_t>(o.num_steps));
  int32_t topic = InitialTopic(o, layer, kv_head);
  for (int32_t t = 0; t < o.num_steps; ++t) {
    if (t > 0) topic = NextTopic(o, layer, t, kv_head, topic);
    topics[static_cast<size_t>(t)] = topic;
  }
  return topics;
}

}  // namespace kvtier::bench
