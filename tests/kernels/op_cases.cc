#include "tests/kernels/op_cases.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "kvtier/layout.h"
#include "tests/kernels/op_cases_internal.h"

namespace kvtier::testing {

// ---- Running one op on a backend ----

int OpBuffers::AddBytes(const void* data, size_t bytes, Placement where, size_t offset) {
  const auto* p = static_cast<const unsigned char*>(data);
  bufs_.push_back(Buffer{std::vector<unsigned char>(p, p + bytes), where, offset});
  return static_cast<int>(bufs_.size()) - 1;
}

absl::StatusOr<std::unique_ptr<PlacedBuffers>> PlacedBuffers::Place(Backend& backend,
                                                                     const OpBuffers& in) {
  std::unique_ptr<PlacedBuffers> placed(new PlacedBuffers(backend));
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Stream> io, backend.CreateStream());
  std::vector<void*> ptrs;
  for (size_t i = 0; i < in.size(); ++i) {
    const size_t bytes = in[i].size(), total = std::max<size_t>(bytes + in.offset(i), 16);
    unsigned char* base = nullptr;
    if (in.placement(i) == Placement::kDevice) {
      KVTIER_ASSIGN_OR_RETURN(DeviceBuffer d, backend.Allocate(total));
      base = d.as<unsigned char>();
      placed->device_.push_back(std::move(d));
    } else {
      placed->host_.push_back(std::make_unique<AlignedHostBuffer>(total));
      base = static_cast<unsigned char*>(placed->host_.back()->data());
      placed->registrations_.push_back(std::make_unique<ScopedRegistration>(backend, base, total));
      KVTIER_RETURN_IF_ERROR(placed->registrations_.back()->status());
    }
    ptrs.push_back(base + in.offset(i));
    if (bytes > 0) KVTIER_RETURN_IF_ERROR(backend.Copy(*io, ptrs.back(), in[i].data(), bytes));
  }
  KVTIER_RETURN_IF_ERROR(io->Synchronize());
  placed->ptrs_ = OpPtrs(std::move(ptrs));
  return placed;
}

absl::Status PlacedBuffers::ReadBack(const OpBuffers& in, Stream& io,
                                     std::vector<std::vector<unsigned char>>* out) const {
  out->resize(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    (*out)[i].resize(in[i].size());
    if (!in[i].empty()) {
      KVTIER_RETURN_IF_ERROR(backend_.Copy(io, (*out)[i].data(),
                                           ptrs_.get(static_cast<int>(i)), in[i].size()));
    }
  }
  return io.Synchronize();
}

absl::StatusOr<OpResult> RunOn(Backend& backend, const OpBuffers& in, const OpFn& fn) {
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<PlacedBuffers> placed, PlacedBuffers::Place(backend, in));
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Stream> io, backend.CreateStream());
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Stream> op_stream, backend.CreateStream());
  OpResult result;
  result.enqueue = fn(backend, *op_stream, placed->ptrs());
  result.run = op_stream->Synchronize();
  KVTIER_RETURN_IF_ERROR(placed->ReadBack(in, *io, &result.bufs));
  return result;
}

// ---- Comparisons ----

int64_t FirstDifference(const void* a, const void* b, size_t bytes, size_t elem_bytes) {
  const auto* x = static_cast<const unsigned char*>(a);
  const auto* y = static_cast<const unsigned char*>(b);
  for (size_t i = 0; i < bytes; i += elem_bytes) {
    if (std::memcmp(x + i, y + i, elem_bytes) != 0) return static_cast<int64_t>(i / elem_bytes);
  }
  return -1;
}

void ExpectSameBytes(const OpResult& want, const OpResult& got, int i, size_t elem,
                     const std::string& what) {
  const auto& w = want.bufs[static_cast<size_t>(i)];
  const auto& g = got.bufs[static_cast<size_t>(i)];
  ASSERT_EQ(w.size(), g.size()) << what;
  EXPECT_EQ(FirstDifference(g.data(), w.data(), w.size(), elem), -1) << what;
}

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Shows the first few mismatches of a comparison and counts them.
class MismatchLog {
 public:
  explicit MismatchLog(std::string what) : what_(std::move(what)) {}
  void Add(int64_t i, double want, double got) {
    if (count_++ < 5) msg_ += absl::StrFormat("\n  [%d] want %.9g got %.9g", i, want, got);
  }
  ~MismatchLog() { EXPECT_EQ(count_, 0) << what_ << ": " << count_ << " mismatches" << msg_; }

 private:
  std::string what_;
  std::string msg_;
  int64_t count_ = 0;
};

// True when got and want agree in non-finite values (NaN with NaN, ±inf with itself); sets
// *done when either is not finite.
bool NonFiniteAgree(double want, double got, bool* done) {
  *done = !std::isfinite(want) || !std::isfinite(got);
  if (!*done) return true;
  if (std::isnan(want) || std::isnan(got)) return std::isnan(want) && std::isnan(got);
  return want == got;
}

// The spacing of `t` values at |x| (one unit in the last place), for x finite.
double UlpOf(DType t, float x) {
  const float a = std::fabs(x);
  switch (t) {
    case DType::kF16: {
      const Half h = FloatToHalf(a);
      if (h.bits >= 0x7bffu) return 32.0;  // max finite: spacing 2^5
      return double{HalfToFloat(Half{static_cast<uint16_t>(h.bits + 1)})} - HalfToFloat(h);
    }
    case DType::kBF16: {
      const BFloat16 b = FloatToBFloat16(a);
      if (b.bits >= 0x7f7fu) return std::ldexp(1.0, 120);
      return double{BFloat16ToFloat(BFloat16{static_cast<uint16_t>(b.bits + 1)})} -
             BFloat16ToFloat(b);
    }
    case DType::kF32:
      return double{std::nextafter(a, kInf)} - a;
  }
  return 0.0;
}

}  // namespace

void ExpectFloatsNear(const std::vector<float>& want, const std::vector<float>& got, double rtol,
                      double atol, const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  MismatchLog log(what);
  for (size_t i = 0; i < want.size(); ++i) {
    bool done = false;
    const bool agree = NonFiniteAgree(want[i], got[i], &done);
    if (done ? !agree
             : std::fabs(double{got[i]} - want[i]) > atol + rtol * std::fabs(double{want[i]})) {
      log.Add(static_cast<int64_t>(i), want[i], got[i]);
    }
  }
}

void ExpectFloatBufNear(const OpResult& want, const OpResult& got, int i, double rtol, double atol,
                        const std::string& what) {
  ExpectFloatsNear(want.Get<float>(i), got.Get<float>(i), rtol, atol, what);
}

void ExpectAttentionOutNear(DType t, const OpResult& want, const OpResult& got, int i,
                            const std::string& what) {
  const auto& wb = want.bufs[static_cast<size_t>(i)];
  const auto& gb = got.bufs[static_cast<size_t>(i)];
  ASSERT_EQ(wb.size(), gb.size()) << what;
  const auto n = static_cast<int64_t>(wb.size() / DTypeSize(t));
  constexpr double kTol = 2e-5;
  MismatchLog log(what);
  for (int64_t j = 0; j < n; ++j) {
    const float w = LoadElement(wb.data(), t, j);
    const float g = LoadElement(gb.data(), t, j);
    bool done = false;
    const bool agree = NonFiniteAgree(w, g, &done);
    if (done) {
      if (!agree) log.Add(j, w, g);
      continue;
    }
    const double tol =
        t == DType::kF32 ? kTol + kTol * std::fabs(double{w}) : 2 * UlpOf(t, w) + kTol;
    if (std::fabs(double{g} - w) > tol) log.Add(j, w, g);
  }
}

// ---- Random inputs ----

int32_t Uniform(std::mt19937& rng, int32_t lo, int32_t hi) {
  return std::uniform_int_distribution<int32_t>(lo, hi)(rng);
}

bool Chance(std::mt19937& rng, double p) { return std::bernoulli_distribution(p)(rng); }

std::vector<float> RandomFloats(std::mt19937& rng, int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

namespace op_cases_internal {

std::vector<int32_t> Iota(int32_t n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

float ScaleOf(int32_t head_dim) { return 1.0f / std::sqrt(static_cast<float>(head_dim)); }

TypedBuffer Filled(DType t, int64_t n, float value) {
  TypedBuffer b(t, n);
  for (int64_t i = 0; i < n; ++i) b.Set(i, value);
  return b;
}

TypedBuffer RandomCache(const KvShape& s, int32_t slots, uint32_t seed, float stddev) {
  TypedBuffer b(s.dtype, int64_t{slots} * s.page_size * s.num_kv_heads * s.head_dim);
  b.FillNormal(seed, stddev);
  return b;
}

void Add(std::vector<OpCase>& cases, std::string name, Maker make) {
  uint32_t seed = 2166136261u;  // FNV-1a
  for (const char c : name) seed = (seed ^ static_cast<unsigned char>(c)) * 16777619u;
  cases.push_back(OpCase{std::move(name), [seed, make = std::move(make)] { return make(seed); }});
}

WorkingSetBuffers::WorkingSetBuffers(OpBuffers& in, int32_t num_slots, const TypedBuffer& k_cache,
                                     const TypedBuffer& v_cache, size_t offset)
    : slots(num_slots),
      elements(k_cache.size()),
      k(in.Add(k_cache, Placement::kDevice, offset)),
      v(in.Add(v_cache, Placement::kDevice, offset)) {}

PagedKv WorkingSetBuffers::At(const OpPtrs& p) const {
  return PagedKv{.k_cache = p.get(k), .v_cache = p.get(v), .num_slots = slots};
}

void WorkingSetBuffers::ExpectSameCaches(const OpResult& want, const OpResult& got, DType t) const {
  ExpectSameBytes(want, got, k, DTypeSize(t), "k_cache");
  ExpectSameBytes(want, got, v, DTypeSize(t), "v_cache");
}

std::vector<int> WorkingSetBuffers::Indices() const {
  std::vector<int> out;
  for (const int i : {k, v}) {
    if (i >= 0) out.push_back(i);
  }
  return out;
}

std::vector<HeadShape> HeadShapes() {
  std::vector<HeadShape> out;
  for (DType t : {DType::kF16, DType::kBF16, DType::kF32}) {
    for (int32_t g : {1, 2, 4, 8}) {
      for (int32_t d : {64, 128}) {
        for (int32_t b : {1, 3}) out.push_back({t, g, d, b});
      }
    }
  }
  return out;
}

std::string NameOf(const HeadShape& s) {
  return absl::StrFormat("%s_g%d_d%d_b%d", DTypeName(s.dtype), s.group, s.head_dim, s.batch);
}

KvShape ShapeOf(const HeadShape& s, int32_t page_size) {
  return KvShape{s.dtype, QueryHeads(s), kHkv, s.head_dim, page_size};
}

}  // namespace op_cases_internal

const std::vector<OpCase>& OpCases() {
  static const std::vector<OpCase>* const cases = [] {
    auto* all = new std::vector<OpCase>;
    op_cases_internal::AddSelectionCases(*all);
    op_cases_internal::AddAttentionCases(*all);
    op_cases_internal::AddPageCases(*all);
    op_cases_internal::AddErrorCases(*all);
    op_cases_internal::AddDecodeCases(*all);
    return all;
  }();
  return *cases;
}

const std::vector<OpCase>& PerfOpCases() {
  static const std::vector<OpCase>* const cases = [] {
    auto* all = new std::vector<OpCase>;
    op_cases_internal::AddPerfCases(*all);
    return all;
  }();
  return *cases;
}

}  // namespace kvtier::testing
