// The CUDA arithmetic ops (ScorePages, TopK, QueryCosine, Replace, SparseAttention,
// DenseAttention, QuantizeSlots, MoveHeadSlots) against the CPU reference backend: random
// inputs from fixed seeds go, as identical copies, through the op on both backends (Backend
// interface only), and the outputs are compared — integer outputs exactly, float outputs
// within tolerances that allow for a different summation order. Each op class also has a
// data-dependent error that must fail the stream with OUT_OF_RANGE on both backends.
// Skips itself without a device.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/ops.h"
#include "kernels/registry.h"
#include "kvtier/dtype.h"
#include "kvtier/layout.h"
#include "core/status.h"
#include "tests/kernels/cuda/cuda_test_util.h"
#include "tests/testutil/random_fill.h"

namespace kvtier {
namespace {

using testing::FirstDifference;
using testing::TypedBuffer;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---- Running one op on both backends ----

// Host images of an op's buffers (inputs and outputs alike), by index.
class OpBuffers {
 public:
  template <typename T>
  int Add(const std::vector<T>& v) {
    return AddBytes(v.data(), v.size() * sizeof(T));
  }
  int Add(const TypedBuffer& b) { return AddBytes(b.data(), b.bytes()); }
  size_t size() const { return bufs_.size(); }
  const std::vector<unsigned char>& operator[](size_t i) const { return bufs_[i]; }

 private:
  int AddBytes(const void* data, size_t bytes) {
    const auto* p = static_cast<const unsigned char*>(data);
    bufs_.emplace_back(p, p + bytes);
    return static_cast<int>(bufs_.size()) - 1;
  }
  std::vector<std::vector<unsigned char>> bufs_;
};

// Backend addresses of the OpBuffers on one backend; index -1 (an optional buffer left
// out) is null.
class OpPtrs {
 public:
  explicit OpPtrs(std::vector<void*> ptrs) : ptrs_(std::move(ptrs)) {}
  template <typename T = void>
  T* get(int i) const {
    return i < 0 ? nullptr : static_cast<T*>(ptrs_[static_cast<size_t>(i)]);
  }

 private:
  std::vector<void*> ptrs_;
};

// What one backend made of the op: the status the op call returned, the stream's status
// after it ran, and every buffer as it was afterwards.
struct OpResult {
  absl::Status enqueue;
  absl::Status run;
  std::vector<std::vector<unsigned char>> bufs;

  template <typename T>
  std::vector<T> Get(int i) const {
    const std::vector<unsigned char>& b = bufs[static_cast<size_t>(i)];
    std::vector<T> out(b.size() / sizeof(T));
    if (!out.empty()) std::memcpy(out.data(), b.data(), out.size() * sizeof(T));
    return out;
  }
};

using OpFn = std::function<absl::Status(Backend&, Stream&, const OpPtrs&)>;

// Uploads a copy of every buffer to `backend`, runs `fn` on a fresh stream, synchronises
// it and downloads every buffer back (on another stream: a failed stream skips later work
// on the cpu backend).
absl::StatusOr<OpResult> RunOn(Backend& backend, const OpBuffers& in, const OpFn& fn) {
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Stream> io, backend.CreateStream());
  std::vector<DeviceBuffer> device;
  std::vector<void*> ptrs;
  for (size_t i = 0; i < in.size(); ++i) {
    const size_t bytes = in[i].size();
    KVTIER_ASSIGN_OR_RETURN(DeviceBuffer d, backend.Allocate(std::max<size_t>(bytes, 16)));
    if (bytes > 0) KVTIER_RETURN_IF_ERROR(backend.Copy(*io, d.data(), in[i].data(), bytes));
    ptrs.push_back(d.data());
    device.push_back(std::move(d));
  }
  KVTIER_RETURN_IF_ERROR(io->Synchronize());
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Stream> op_stream, backend.CreateStream());
  OpResult result;
  result.enqueue = fn(backend, *op_stream, OpPtrs(ptrs));
  result.run = op_stream->Synchronize();
  result.bufs.resize(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    result.bufs[i].resize(in[i].size());
    if (!in[i].empty()) {
      KVTIER_RETURN_IF_ERROR(
          backend.Copy(*io, result.bufs[i].data(), device[i].data(), in[i].size()));
    }
  }
  KVTIER_RETURN_IF_ERROR(io->Synchronize());
  return result;
}

// The CUDA backend (from CudaTestBase, which skips without a device) plus the CPU
// reference backend.
template <typename Base>
class DualBackendTest : public testing::CudaTestBase<Base> {
 protected:
  void SetUp() override {
    testing::CudaTestBase<Base>::SetUp();
    if (this->IsSkipped() || this->HasFatalFailure()) return;
    absl::StatusOr<std::unique_ptr<Backend>> cpu = CreateBackend(DeviceKind::kCpu);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    cpu_ = *std::move(cpu);
  }

  // Runs `fn` on the CPU and on the CUDA backend over identical copies of `in`.
  void RunBoth(const OpBuffers& in, const OpFn& fn, OpResult* cpu, OpResult* gpu) {
    absl::StatusOr<OpResult> c = RunOn(*cpu_, in, fn);
    ASSERT_TRUE(c.ok()) << "cpu: " << c.status();
    absl::StatusOr<OpResult> g = RunOn(*this->backend_, in, fn);
    ASSERT_TRUE(g.ok()) << "cuda: " << g.status();
    *cpu = *std::move(c);
    *gpu = *std::move(g);
  }

  // RunBoth, then both backends must have accepted and run the op.
  void RunBothOk(const OpBuffers& in, const OpFn& fn, OpResult* cpu, OpResult* gpu) {
    ASSERT_NO_FATAL_FAILURE(RunBoth(in, fn, cpu, gpu));
    ASSERT_TRUE(cpu->enqueue.ok()) << "cpu: " << cpu->enqueue;
    ASSERT_TRUE(cpu->run.ok()) << "cpu: " << cpu->run;
    ASSERT_TRUE(gpu->enqueue.ok()) << "cuda: " << gpu->enqueue;
    ASSERT_TRUE(gpu->run.ok()) << "cuda: " << gpu->run;
  }

  // RunBoth, then both backends must accept the op and fail the stream with OUT_OF_RANGE
  // (the CUDA message naming `cuda_message`).
  void RunBothOutOfRange(const OpBuffers& in, const OpFn& fn, const std::string& cuda_message,
                         OpResult* cpu, OpResult* gpu) {
    ASSERT_NO_FATAL_FAILURE(RunBoth(in, fn, cpu, gpu));
    ASSERT_TRUE(cpu->enqueue.ok()) << "cpu: " << cpu->enqueue;
    ASSERT_TRUE(gpu->enqueue.ok()) << "cuda: " << gpu->enqueue;
    EXPECT_EQ(cpu->run.code(), absl::StatusCode::kOutOfRange) << "cpu: " << cpu->run;
    EXPECT_EQ(gpu->run.code(), absl::StatusCode::kOutOfRange) << "cuda: " << gpu->run;
    EXPECT_TRUE(absl::StrContains(gpu->run.message(), cuda_message)) << gpu->run;
  }

  std::unique_ptr<Backend> cpu_;
};

// ---- Comparisons ----

// Buffer `i` bit for bit, in elements of `elem` bytes.
void ExpectSameBytes(const OpResult& cpu, const OpResult& gpu, int i, size_t elem,
                     const std::string& what) {
  const auto& want = cpu.bufs[static_cast<size_t>(i)];
  const auto& got = gpu.bufs[static_cast<size_t>(i)];
  ASSERT_EQ(want.size(), got.size()) << what;
  EXPECT_EQ(FirstDifference(got.data(), want.data(), want.size(), elem), -1) << what;
}

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

// fp32 buffers: |got − want| ≤ atol + rtol·|want|, non-finite values equal.
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

void ExpectFloatBufNear(const OpResult& cpu, const OpResult& gpu, int i, double rtol, double atol,
                        const std::string& what) {
  ExpectFloatsNear(cpu.Get<float>(i), gpu.Get<float>(i), rtol, atol, what);
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

// Attention outputs in `t`: both backends accumulate in fp32 (in different orders) and
// round once, so fp32 must agree within atol + rtol·|want| (2e-5 each), and fp16/bf16
// within 2 units in the last place of the dtype plus that fp32 slack.
void ExpectAttentionOutNear(DType t, const OpResult& cpu, const OpResult& gpu, int i,
                            const std::string& what) {
  const auto& wb = cpu.bufs[static_cast<size_t>(i)];
  const auto& gb = gpu.bufs[static_cast<size_t>(i)];
  ASSERT_EQ(wb.size(), gb.size()) << what;
  const int64_t n = static_cast<int64_t>(wb.size() / DTypeSize(t));
  constexpr double kTol = 2e-5;
  MismatchLog log(what);
  for (int64_t j = 0; j < n; ++j) {
    const float want = testing::LoadElement(wb.data(), t, j);
    const float got = testing::LoadElement(gb.data(), t, j);
    bool done = false;
    const bool agree = NonFiniteAgree(want, got, &done);
    if (done) {
      if (!agree) log.Add(j, want, got);
      continue;
    }
    const double diff = std::fabs(double{got} - want);
    const double tol =
        t == DType::kF32 ? kTol + kTol * std::fabs(double{want}) : 2 * UlpOf(t, want) + kTol;
    if (diff > tol) log.Add(j, want, got);
  }
}

// ---- Random inputs ----

std::vector<int32_t> Iota(int32_t n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

int32_t Uniform(std::mt19937& rng, int32_t lo, int32_t hi) {  // [lo, hi]
  return std::uniform_int_distribution<int32_t>(lo, hi)(rng);
}

bool Chance(std::mt19937& rng, double p) { return std::bernoulli_distribution(p)(rng); }

std::vector<int8_t> RandomInt8(std::mt19937& rng, int64_t n) {
  std::vector<int8_t> v(static_cast<size_t>(n));
  for (int8_t& x : v) x = static_cast<int8_t>(Uniform(rng, -127, 127));
  return v;
}

std::vector<float> RandomFloats(std::mt19937& rng, int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

// ---- Shapes ----

// The head-shape sweep of the query-side ops: Hkv = 2 KV heads, G query heads per KV head.
// The shape fields every per-head op (scoring, cosine, attention) takes.
template <typename Args>
Args HeadOpArgs(DType dtype, int32_t batch, int32_t q_heads, int32_t kv_heads, int32_t d) {
  Args a;
  a.dtype = dtype;
  a.batch = batch;
  a.num_q_heads = q_heads;
  a.num_kv_heads = kv_heads;
  a.head_dim = d;
  return a;
}

struct HeadShape {
  DType dtype;
  int32_t group;
  int32_t head_dim;
  int32_t batch;
};
constexpr int32_t kHkv = 2;

std::string HeadShapeName(const ::testing::TestParamInfo<HeadShape>& info) {
  const HeadShape& s = info.param;
  return absl::StrFormat("%s_g%d_d%d_b%d", DTypeName(s.dtype), s.group, s.head_dim, s.batch);
}

std::vector<HeadShape> AllHeadShapes() {
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

uint32_t SeedOf(const HeadShape& s, uint32_t salt) {
  return salt * 7919u + static_cast<uint32_t>(s.dtype) * 1009u +
         static_cast<uint32_t>(s.group) * 101u + static_cast<uint32_t>(s.head_dim) * 11u +
         static_cast<uint32_t>(s.batch);
}

class CudaHeadOpsTest : public DualBackendTest<::testing::TestWithParam<HeadShape>> {};

// ---- ScorePages ----

TEST_P(CudaHeadOpsTest, ScorePagesMatchesCpu) {
  const HeadShape c = GetParam();
  const int32_t B = c.batch, Hq = kHkv * c.group, d = c.head_dim;
  constexpr int32_t P = 24;
  const SummaryLayout sl{kHkv, d};
  TypedBuffer q(c.dtype, int64_t{B} * Hq * d);
  TypedBuffer summaries(c.dtype, int64_t{B} * P * sl.page_elements());
  q.FillNormal(SeedOf(c, 1));
  summaries.FillNormal(SeedOf(c, 2));
  // Full, empty and partly filled sequences.
  const std::vector<int32_t> num_pages =
      B == 1 ? std::vector<int32_t>{19} : std::vector<int32_t>{P, 0, 7};
  std::vector<uint8_t> head_mask(static_cast<size_t>(B) * kHkv);
  for (size_t i = 0; i < head_mask.size(); ++i) head_mask[i] = i % 3 == 1 ? 0 : 1;
  // Outputs start as a sentinel, so entries an op must not write are compared too.
  const std::vector<float> scores(static_cast<size_t>(B) * Hq * P, 7.0f);
  const std::vector<float> pooled(static_cast<size_t>(B) * kHkv * P, 7.0f);

  struct Variant {
    PoolMode pool;
    bool mask;
    bool with_scores;
  };
  for (const Variant v :
       {Variant{PoolMode::kSoftmaxMean, false, true}, Variant{PoolMode::kSoftmaxMean, true, false},
        Variant{PoolMode::kRawMean, true, true}, Variant{PoolMode::kRawMean, false, false}}) {
    SCOPED_TRACE(absl::StrFormat("pool %s, head_mask %d, scores %d",
                                 v.pool == PoolMode::kSoftmaxMean ? "softmax" : "raw", v.mask,
                                 v.with_scores));
    OpBuffers in;
    const int iq = in.Add(q), isum = in.Add(summaries), inp = in.Add(num_pages);
    const int imask = v.mask ? in.Add(head_mask) : -1;
    const int iscores = v.with_scores ? in.Add(scores) : -1;
    const int ipooled = in.Add(pooled);
    OpResult cpu, gpu;
    ASSERT_NO_FATAL_FAILURE(RunBothOk(
        in,
        [&](Backend& be, Stream& s, const OpPtrs& p) {
          auto a = HeadOpArgs<ScorePagesArgs>(c.dtype, B, Hq, kHkv, d);
          a.max_pages = P;
          a.q = p.get(iq);
          a.summaries = p.get(isum);
          a.num_pages = p.get<int32_t>(inp);
          a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(d));
          a.pool = v.pool;
          a.scores = p.get<float>(iscores);
          a.pooled = p.get<float>(ipooled);
          a.head_mask = p.get<uint8_t>(imask);
          return be.ScorePages(s, a);
        },
        &cpu, &gpu));
    ExpectFloatBufNear(cpu, gpu, ipooled, 1e-4, 1e-5, "pooled");
    if (iscores >= 0) ExpectFloatBufNear(cpu, gpu, iscores, 1e-4, 1e-5, "scores");
  }
}

// ---- QueryCosine ----

TEST_P(CudaHeadOpsTest, QueryCosineMatchesCpu) {
  const HeadShape c = GetParam();
  const int32_t B = c.batch, Hq = kHkv * c.group, d = c.head_dim;
  const HeadsLayout ql{Hq, d};
  std::mt19937 rng(SeedOf(c, 3));
  TypedBuffer q(c.dtype, int64_t{B} * Hq * d);
  TypedBuffer noise(c.dtype, q.size());
  q.FillNormal(SeedOf(c, 4));
  noise.FillNormal(SeedOf(c, 5));
  // q_prev = q + noise·σ with σ per head, from near-identical (no drift) to unrelated.
  TypedBuffer q_prev(c.dtype, q.size());
  for (int32_t b = 0; b < B; ++b) {
    for (int32_t hq = 0; hq < Hq; ++hq) {
      const float sigma = std::array<float, 4>{0.05f, 0.3f, 0.6f, 3.0f}[Uniform(rng, 0, 3)];
      for (int32_t i = 0; i < d; ++i) {
        const int64_t o = ql.Offset(b, hq, i);
        q_prev.Set(o, q.Get(o) + sigma * noise.Get(o));
      }
    }
  }
  // A missing previous query (zero vector) for every head of the last KV head of the last
  // sequence, and a zero current query for query head 0 of sequence 0.
  for (int32_t hq = (kHkv - 1) * c.group; hq < Hq; ++hq) {
    for (int32_t i = 0; i < d; ++i) q_prev.Set(ql.Offset(B - 1, hq, i), 0.0f);
  }
  for (int32_t i = 0; i < d; ++i) q.Set(ql.Offset(0, 0, i), 0.0f);
  const std::vector<float> cosine(static_cast<size_t>(B) * Hq, 7.0f);
  const std::vector<float> group_mean(static_cast<size_t>(B) * kHkv, 7.0f);
  const std::vector<uint8_t> drifted(static_cast<size_t>(B) * kHkv, 7);
  constexpr float kThreshold = 0.9f;

  for (const bool optional : {true, false}) {
    SCOPED_TRACE(absl::StrFormat("cosine and drifted given: %d", optional));
    OpBuffers in;
    const int iq = in.Add(q), iqp = in.Add(q_prev);
    const int icos = optional ? in.Add(cosine) : -1;
    const int imean = in.Add(group_mean);
    const int idrift = optional ? in.Add(drifted) : -1;
    OpResult cpu, gpu;
    ASSERT_NO_FATAL_FAILURE(RunBothOk(
        in,
        [&](Backend& be, Stream& s, const OpPtrs& p) {
          auto a = HeadOpArgs<QueryCosineArgs>(c.dtype, B, Hq, kHkv, d);
          a.q = p.get(iq);
          a.q_prev = p.get(iqp);
          a.threshold = kThreshold;
          a.cosine = p.get<float>(icos);
          a.group_mean = p.get<float>(imean);
          a.drifted = p.get<uint8_t>(idrift);
          return be.QueryCosine(s, a);
        },
        &cpu, &gpu));
    const std::vector<float> want_mean = cpu.Get<float>(imean);
    ExpectFloatsNear(want_mean, gpu.Get<float>(imean), 0.0, 1e-5, "group_mean");
    // The zero vectors: cosine 0, so those groups drift.
    EXPECT_EQ(gpu.Get<float>(imean)[static_cast<size_t>(B * kHkv - 1)], 0.0f);
    if (!optional) continue;
    ExpectFloatBufNear(cpu, gpu, icos, 0.0, 1e-5, "cosine");
    const std::vector<uint8_t> want = cpu.Get<uint8_t>(idrift), got = gpu.Get<uint8_t>(idrift);
    for (size_t i = 0; i < want.size(); ++i) {
      // A mean within float noise of τ may fall either way.
      if (std::fabs(want_mean[i] - kThreshold) < 1e-5f) continue;
      EXPECT_EQ(got[i], want[i]) << "drifted[" << i << "], group mean " << want_mean[i];
    }
    EXPECT_EQ(got.back(), 1);
  }
}

// ---- SparseAttention ----

TEST_P(CudaHeadOpsTest, SparseAttentionMatchesCpu) {
  const HeadShape c = GetParam();
  const int32_t B = c.batch, Hq = kHkv * c.group, d = c.head_dim;
  constexpr int32_t kP = 16, kS = 6, kPages = 10;  // page size, slots, logical pages
  constexpr int32_t kPartialPage = kPages - 1;
  const WorkingSetLayout wl{kS, kP, kHkv, d};
  const SlotTableLayout tl{kHkv, kS};
  std::mt19937 rng(SeedOf(c, 6));
  TypedBuffer q(c.dtype, int64_t{B} * Hq * d);
  TypedBuffer k(c.dtype, B * wl.num_slots * wl.slot_elements());
  TypedBuffer v(c.dtype, k.size());
  q.FillNormal(SeedOf(c, 7));
  k.FillNormal(SeedOf(c, 8));
  v.FillNormal(SeedOf(c, 9));
  // Per (b, h): distinct pages in random slots, a quarter of the slots empty; the partial
  // page (the last one) held by head 0 of every sequence; KV head 1 of sequence 0 empty.
  std::vector<int32_t> slot_table(static_cast<size_t>(B) * kHkv * kS);
  for (int32_t b = 0; b < B; ++b) {
    for (int32_t h = 0; h < kHkv; ++h) {
      std::vector<int32_t> pages = Iota(kPages);
      std::shuffle(pages.begin(), pages.end(), rng);
      for (int32_t s = 0; s < kS; ++s) {
        slot_table[tl.Offset(b, h, s)] = Chance(rng, 0.25) ? kEmptySlot : pages[s];
      }
      if (h == 0) {
        for (int32_t s = 0; s < kS; ++s) {
          if (slot_table[tl.Offset(b, h, s)] == kPartialPage) slot_table[tl.Offset(b, h, s)] = -1;
        }
        slot_table[tl.Offset(b, h, 2)] = kPartialPage;
      }
      if (b == 0 && h == 1) {
        for (int32_t s = 0; s < kS; ++s) slot_table[tl.Offset(b, h, s)] = kEmptySlot;
      }
    }
  }
  // Partial pages: a partial length, an empty partial page, none.
  std::vector<int32_t> partial_page, partial_len;
  for (int32_t b = 0; b < B; ++b) {
    partial_page.push_back(b == 2 ? -1 : kPartialPage);
    partial_len.push_back(b == 1 ? 0 : Uniform(rng, 1, kP - 1));
  }
  // Causal limits: everything, mid-page, an early page only.
  std::vector<int64_t> query_position;
  for (int32_t b = 0; b < B; ++b) {
    query_position.push_back(b == 0 ? int64_t{kPages} * kP : b == 1 ? 5 * kP + 3 : 2 * kP - 1);
  }
  // INT8 copies of 40% of the head-slots, with per-channel scales around 1/64.
  std::vector<uint8_t> slot_int8(slot_table.size());
  for (uint8_t& f : slot_int8) f = Chance(rng, 0.4) ? 1 : 0;
  const std::vector<int8_t> k_int8 = RandomInt8(rng, k.size());
  const std::vector<int8_t> v_int8 = RandomInt8(rng, k.size());
  const int64_t scales = int64_t{B} * kS * kHkv * d;
  const std::vector<float> k_scale = RandomFloats(rng, scales, 0.005f, 0.02f);
  const std::vector<float> v_scale = RandomFloats(rng, scales, 0.005f, 0.02f);
  TypedBuffer out(c.dtype, q.size());
  for (int64_t i = 0; i < out.size(); ++i) out.Set(i, 7.0f);
  const std::vector<float> lse(static_cast<size_t>(B) * Hq, 7.0f);
  const std::vector<float> token_prob(static_cast<size_t>(B) * Hq * kS * kP, 7.0f);

  struct Variant {
    const char* name;
    bool lse, causal, prob, int8;
  };
  for (const Variant var :
       {Variant{"plain", true, false, false, false},
        Variant{"no lse, causal", false, true, false, false},
        Variant{"token_prob", true, false, true, false}, Variant{"int8", true, false, false, true},
        Variant{"causal, token_prob, int8", true, true, true, true}}) {
    SCOPED_TRACE(var.name);
    OpBuffers in;
    const int iq = in.Add(q), ik = in.Add(k), iv = in.Add(v), itab = in.Add(slot_table);
    const int ipp = in.Add(partial_page), ipl = in.Add(partial_len), iout = in.Add(out);
    const int ilse = var.lse ? in.Add(lse) : -1;
    const int iqpos = var.causal ? in.Add(query_position) : -1;
    const int iprob = var.prob ? in.Add(token_prob) : -1;
    const int iflags = var.int8 ? in.Add(slot_int8) : -1;
    const int ik8 = var.int8 ? in.Add(k_int8) : -1, iv8 = var.int8 ? in.Add(v_int8) : -1;
    const int iks = var.int8 ? in.Add(k_scale) : -1, ivs = var.int8 ? in.Add(v_scale) : -1;
    OpResult cpu, gpu;
    ASSERT_NO_FATAL_FAILURE(RunBothOk(
        in,
        [&](Backend& be, Stream& s, const OpPtrs& p) {
          auto a = HeadOpArgs<SparseAttentionArgs>(c.dtype, B, Hq, kHkv, d);
          a.page_size = kP;
          a.num_slots = kS;
          a.q = p.get(iq);
          a.k_cache = p.get(ik);
          a.v_cache = p.get(iv);
          a.slot_table = p.get<int32_t>(itab);
          a.partial_page = p.get<int32_t>(ipp);
          a.partial_len = p.get<int32_t>(ipl);
          a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(d));
          a.out = p.get(iout);
          a.lse = p.get<float>(ilse);
          a.query_position = p.get<int64_t>(iqpos);
          a.token_prob = p.get<float>(iprob);
          a.slot_int8 = p.get<uint8_t>(iflags);
          a.k_int8 = p.get<int8_t>(ik8);
          a.v_int8 = p.get<int8_t>(iv8);
          a.k_scale = p.get<float>(iks);
          a.v_scale = p.get<float>(ivs);
          return be.SparseAttention(s, a);
        },
        &cpu, &gpu));
    ExpectAttentionOutNear(c.dtype, cpu, gpu, iout, "out");
    if (ilse >= 0) {
      ExpectFloatBufNear(cpu, gpu, ilse, 1e-4, 1e-4, "lse");
      // The empty head (sequence 0, KV head 1): lse = -inf.
      EXPECT_EQ(gpu.Get<float>(ilse)[static_cast<size_t>(c.group)], -kInf);
    }
    if (iprob >= 0) ExpectFloatBufNear(cpu, gpu, iprob, 0.0, 1e-5, "token_prob");
  }
}

// ---- DenseAttention ----

TEST_P(CudaHeadOpsTest, DenseAttentionMatchesCpu) {
  const HeadShape c = GetParam();
  const int32_t B = c.batch, Hq = kHkv * c.group, d = c.head_dim;
  constexpr int32_t kT = 100;
  const DenseKvLayout kl{kT, kHkv, d};
  TypedBuffer q(c.dtype, int64_t{B} * Hq * d);
  TypedBuffer k(c.dtype, kl.Offset(B, 0, 0, 0));
  TypedBuffer v(c.dtype, k.size());
  q.FillNormal(SeedOf(c, 10));
  k.FillNormal(SeedOf(c, 11));
  v.FillNormal(SeedOf(c, 12));
  // Full, empty and partial sequences.
  const std::vector<int32_t> seq_len =
      B == 1 ? std::vector<int32_t>{77} : std::vector<int32_t>{kT, 0, 37};
  TypedBuffer out(c.dtype, q.size());
  for (int64_t i = 0; i < out.size(); ++i) out.Set(i, 7.0f);
  const std::vector<float> lse(static_cast<size_t>(B) * Hq, 7.0f);

  for (const bool with_lse : {true, false}) {
    SCOPED_TRACE(absl::StrFormat("lse %d", with_lse));
    OpBuffers in;
    const int iq = in.Add(q), ik = in.Add(k), iv = in.Add(v), ilen = in.Add(seq_len);
    const int iout = in.Add(out), ilse = with_lse ? in.Add(lse) : -1;
    OpResult cpu, gpu;
    ASSERT_NO_FATAL_FAILURE(RunBothOk(
        in,
        [&](Backend& be, Stream& s, const OpPtrs& p) {
          auto a = HeadOpArgs<DenseAttentionArgs>(c.dtype, B, Hq, kHkv, d);
          a.max_tokens = kT;
          a.q = p.get(iq);
          a.k = p.get(ik);
          a.v = p.get(iv);
          a.seq_len = p.get<int32_t>(ilen);
          a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(d));
          a.out = p.get(iout);
          a.lse = p.get<float>(ilse);
          return be.DenseAttention(s, a);
        },
        &cpu, &gpu));
    ExpectAttentionOutNear(c.dtype, cpu, gpu, iout, "out");
    if (ilse >= 0) ExpectFloatBufNear(cpu, gpu, ilse, 1e-4, 1e-4, "lse");
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, CudaHeadOpsTest, ::testing::ValuesIn(AllHeadShapes()),
                         HeadShapeName);

// ---- TopK ----

struct TopKCase {
  int32_t batch;
  int32_t kv_heads;
  int32_t max_pages;
  int32_t k;
};

std::string TopKCaseName(const ::testing::TestParamInfo<TopKCase>& info) {
  const TopKCase& c = info.param;
  return absl::StrFormat("b%d_hkv%d_p%d_k%d", c.batch, c.kv_heads, c.max_pages, c.k);
}

class CudaTopKTest : public DualBackendTest<::testing::TestWithParam<TopKCase>> {};

TEST_P(CudaTopKTest, MatchesCpu) {
  const TopKCase c = GetParam();
  const int32_t B = c.batch, H = c.kv_heads, P = c.max_pages;
  std::mt19937 rng(static_cast<uint32_t>(B * 131 + H * 17 + P * 3 + c.k));
  // Scores with many ties (a few distinct values), NaN and ±inf.
  std::vector<float> pooled(static_cast<size_t>(B) * H * P);
  for (float& x : pooled) {
    const int32_t r = Uniform(rng, 0, 99);
    x = r < 5   ? kNaN
        : r < 7 ? -kInf
        : r < 8 ? kInf
                : static_cast<float>(Uniform(rng, -3, 4)) * 0.5f;
  }
  // A full sequence, a random one, one with fewer candidates than k.
  std::vector<int32_t> num_pages;
  for (int32_t b = 0; b < B; ++b) {
    num_pages.push_back(b == 0 ? P : b == 1 ? Uniform(rng, 0, P) : std::min(P, c.k / 2 + 3));
  }
  std::vector<uint8_t> head_mask(static_cast<size_t>(B) * H);
  for (size_t i = 0; i < head_mask.size(); ++i) head_mask[i] = i % 3 == 2 ? 0 : 1;
  std::vector<int32_t> head_k(static_cast<size_t>(B) * H);
  for (int32_t& x : head_k) x = Uniform(rng, 0, c.k);
  head_k[0] = c.k;
  // Pinned, excluded, both bits (excluded wins) and unknown bits (normal).
  std::vector<uint8_t> page_flags(pooled.size());
  for (uint8_t& f : page_flags) {
    const int32_t r = Uniform(rng, 0, 99);
    f = r < 10   ? kPagePinned
        : r < 20 ? kPageExcluded
        : r < 23 ? (kPagePinned | kPageExcluded)
        : r < 26 ? 4
                 : kPageNormal;
  }
  const std::vector<int32_t> selected(static_cast<size_t>(B) * H * c.k, -7);

  struct Variant {
    const char* name;
    bool mask, budgets, flags;
    int32_t sink, recent;
  };
  for (const Variant v :
       {Variant{"plain", false, false, false, 0, 0},
        Variant{"sink, recent", false, false, false, 2, 3},
        Variant{"head_mask", true, false, false, 1, 0}, Variant{"head_k", false, true, false, 0, 1},
        Variant{"page_flags", false, false, true, 0, 0}, Variant{"all", true, true, true, 2, 2}}) {
    SCOPED_TRACE(v.name);
    OpBuffers in;
    const int ipooled = in.Add(pooled), inp = in.Add(num_pages), isel = in.Add(selected);
    const int imask = v.mask ? in.Add(head_mask) : -1;
    const int ihk = v.budgets ? in.Add(head_k) : -1;
    const int iflags = v.flags ? in.Add(page_flags) : -1;
    OpResult cpu, gpu;
    ASSERT_NO_FATAL_FAILURE(RunBothOk(
        in,
        [&](Backend& be, Stream& s, const OpPtrs& p) {
          TopKArgs a;
          a.batch = B;
          a.num_kv_heads = H;
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
        },
        &cpu, &gpu));
    ExpectSameBytes(cpu, gpu, isel, sizeof(int32_t), "selected");
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, CudaTopKTest,
                         ::testing::Values(TopKCase{1, 1, 16, 4}, TopKCase{3, 2, 64, 8},
                                           TopKCase{2, 4, 300, 32}, TopKCase{3, 8, 1000, 64},
                                           TopKCase{1, 2, 40, 40}, TopKCase{2, 4, 4096, 128}),
                         TopKCaseName);

// ---- Replace ----

struct ReplaceCase {
  int32_t batch;
  int32_t kv_heads;
  int32_t num_slots;
  int32_t region_begin;
  int32_t k;
  int32_t max_pages;
};

std::string ReplaceCaseName(const ::testing::TestParamInfo<ReplaceCase>& info) {
  const ReplaceCase& c = info.param;
  return absl::StrFormat("b%d_hkv%d_s%d_r%d_k%d_p%d", c.batch, c.kv_heads, c.num_slots,
                         c.region_begin, c.k, c.max_pages);
}

class CudaReplaceTest : public DualBackendTest<::testing::TestWithParam<ReplaceCase>> {};

// Items compared as the op defines them: the same host page, and for a real (non-skip)
// item the same head and destination slot.
void ExpectSameItems(const OpResult& cpu, const OpResult& gpu, int i) {
  const std::vector<RecallItem> want = cpu.Get<RecallItem>(i), got = gpu.Get<RecallItem>(i);
  ASSERT_EQ(want.size(), got.size());
  int64_t bad = 0;
  for (size_t j = 0; j < want.size(); ++j) {
    const bool same = want[j].host_page == got[j].host_page &&
                      (want[j].host_page == kSkipItem ||
                       (want[j].kv_head == got[j].kv_head && want[j].dst_slot == got[j].dst_slot));
    if (!same && bad++ < 5) {
      ADD_FAILURE() << "items[" << j << "]: want {" << want[j].host_page << ", " << want[j].kv_head
                    << ", " << want[j].dst_slot << "} got {" << got[j].host_page << ", "
                    << got[j].kv_head << ", " << got[j].dst_slot << "}";
    }
  }
  EXPECT_EQ(bad, 0) << "items mismatches";
}

TEST_P(CudaReplaceTest, MatchesCpu) {
  const ReplaceCase c = GetParam();
  const int32_t B = c.batch, H = c.kv_heads, S = c.num_slots, K = c.k, P = c.max_pages;
  const SlotTableLayout tl{H, S};
  std::mt19937 rng(static_cast<uint32_t>(B * 7 + H * 11 + S * 13 + c.region_begin * 17 + K * 19));
  std::vector<int32_t> slot_table(static_cast<size_t>(B) * H * S);
  std::vector<int32_t> selected(static_cast<size_t>(B) * H * K);
  std::vector<int64_t> host_page_of(static_cast<size_t>(B) * P, -1);
  for (int32_t b = 0; b < B; ++b) {
    std::vector<bool> wanted(static_cast<size_t>(P), false);
    for (int32_t h = 0; h < H; ++h) {
      // Region: distinct pages, a fifth of the slots empty. Outside it: anything, untouched.
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
      // Selection: m distinct pages, about half of them resident (hits), best first; the
      // rest of the k entries -1.
      const int32_t m = h == 0 && b == 0 ? K : Uniform(rng, 0, K);
      std::vector<int32_t> sel;
      std::shuffle(resident.begin(), resident.end(), rng);
      for (int32_t r : resident) {
        if (static_cast<int32_t>(sel.size()) < m && Chance(rng, 0.5)) sel.push_back(r);
      }
      for (size_t j = static_cast<size_t>(K);
           j < pages.size() && static_cast<int32_t>(sel.size()) < m; ++j) {
        sel.push_back(pages[j]);  // not in the region: a miss
      }
      std::shuffle(sel.begin(), sel.end(), rng);
      for (int32_t i = 0; i < K; ++i) {
        const int32_t page =
            i < static_cast<int32_t>(sel.size()) ? sel[static_cast<size_t>(i)] : kEmptySlot;
        selected[static_cast<size_t>((int64_t{b} * H + h) * K + i)] = page;
        if (page >= 0) wanted[static_cast<size_t>(page)] = true;
      }
    }
    // Every selected page has a host page; some others have none.
    for (int32_t page = 0; page < P; ++page) {
      if (wanted[static_cast<size_t>(page)] || Chance(rng, 0.5)) {
        host_page_of[static_cast<size_t>(int64_t{b} * P + page)] = Uniform(rng, 0, 100000);
      }
    }
  }
  std::vector<uint8_t> head_mask(static_cast<size_t>(B) * H);
  for (size_t i = 0; i < head_mask.size(); ++i) head_mask[i] = i % 3 == 1 ? 0 : 1;
  const std::vector<RecallItem> items(static_cast<size_t>(B) * H * K, RecallItem{-9, -9, -9});
  const std::vector<int32_t> num_misses(static_cast<size_t>(B) * H, -5);

  struct Variant {
    const char* name;
    bool mask, misses;
  };
  for (const Variant v : {Variant{"plain", false, true}, Variant{"head_mask", true, true},
                          Variant{"head_mask, no num_misses", true, false}}) {
    SCOPED_TRACE(v.name);
    OpBuffers in;
    const int isel = in.Add(selected), itab = in.Add(slot_table), ihp = in.Add(host_page_of);
    const int iitems = in.Add(items);
    const int imask = v.mask ? in.Add(head_mask) : -1;
    const int imiss = v.misses ? in.Add(num_misses) : -1;
    OpResult cpu, gpu;
    ASSERT_NO_FATAL_FAILURE(RunBothOk(
        in,
        [&](Backend& be, Stream& s, const OpPtrs& p) {
          ReplaceArgs a;
          a.batch = B;
          a.num_kv_heads = H;
          a.num_slots = S;
          a.region_begin = c.region_begin;
          a.k = K;
          a.selected = p.get<int32_t>(isel);
          a.slot_table = p.get<int32_t>(itab);
          a.host_page_of = p.get<int64_t>(ihp);
          a.max_pages = P;
          a.head_mask = p.get<uint8_t>(imask);
          a.items = p.get<RecallItem>(iitems);
          a.num_misses = p.get<int32_t>(imiss);
          return be.Replace(s, a);
        },
        &cpu, &gpu));
    ExpectSameBytes(cpu, gpu, itab, sizeof(int32_t), "slot_table");
    ExpectSameItems(cpu, gpu, iitems);
    if (imiss >= 0) ExpectSameBytes(cpu, gpu, imiss, sizeof(int32_t), "num_misses");
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, CudaReplaceTest,
                         ::testing::Values(ReplaceCase{1, 1, 8, 0, 8, 32},
                                           ReplaceCase{3, 2, 20, 4, 12, 64},
                                           ReplaceCase{2, 8, 64, 16, 32, 500},
                                           ReplaceCase{3, 4, 40, 0, 40, 100}),
                         ReplaceCaseName);

// ---- QuantizeSlots, MoveHeadSlots ----

struct SlotCase {
  DType dtype;
  int32_t page_size;
  int32_t head_dim;
  int32_t kv_heads;
};

// The shape fields every slot op takes, from the case.
template <typename Args>
Args SlotShape(const SlotCase& c) {
  Args a;
  a.dtype = c.dtype;
  a.page_size = c.page_size;
  a.num_kv_heads = c.kv_heads;
  a.head_dim = c.head_dim;
  return a;
}

std::string SlotCaseName(const ::testing::TestParamInfo<SlotCase>& info) {
  const SlotCase& c = info.param;
  return absl::StrFormat("%s_p%d_d%d_hkv%d", DTypeName(c.dtype), c.page_size, c.head_dim,
                         c.kv_heads);
}

std::vector<SlotCase> AllSlotCases() {
  std::vector<SlotCase> out;
  for (DType t : {DType::kF16, DType::kBF16, DType::kF32}) {
    for (int32_t p : {16, 32}) {
      for (int32_t d : {64, 128}) {
        for (int32_t h : {1, 4}) out.push_back({t, p, d, h});
      }
    }
  }
  return out;
}

uint32_t SeedOf(const SlotCase& c, uint32_t salt) {
  return salt * 7919u + static_cast<uint32_t>(c.dtype) * 1009u +
         static_cast<uint32_t>(c.page_size) * 101u + static_cast<uint32_t>(c.head_dim) * 11u +
         static_cast<uint32_t>(c.kv_heads);
}

class CudaSlotOpsTest : public DualBackendTest<::testing::TestWithParam<SlotCase>> {};

TEST_P(CudaSlotOpsTest, QuantizeSlotsMatchesCpuBitForBit) {
  const SlotCase c = GetParam();
  constexpr int32_t kSlots = 6;
  const WorkingSetLayout wl{kSlots, c.page_size, c.kv_heads, c.head_dim};
  std::mt19937 rng(SeedOf(c, 1));
  TypedBuffer k(c.dtype, kSlots * wl.slot_elements());
  TypedBuffer v(c.dtype, k.size());
  k.FillNormal(SeedOf(c, 2));
  v.FillNormal(SeedOf(c, 3), 4.0f);
  // Two thirds of the (slot, head) pairs, in random order.
  std::vector<HeadSlot> items;
  for (int32_t s = 0; s < kSlots; ++s) {
    for (int32_t h = 0; h < c.kv_heads; ++h) {
      if ((s + h) % 3 != 2) items.push_back({h, s});
    }
  }
  std::shuffle(items.begin(), items.end(), rng);
  // Special channels of the first item's K: all zero (zero scale); max 127 so the scale is
  // exactly 1 and the other tokens are ties (x.5, to even); a NaN (ignored by the max,
  // quantised to 0); an inf (scale inf, everything 0).
  const HeadSlot first = items[0];
  for (int32_t t = 0; t < c.page_size; ++t) {
    const auto at = [&](int32_t ch) {
      return wl.Offset(int64_t{first.slot}, t, first.kv_head, ch);
    };
    k.Set(at(0), 0.0f);
    k.Set(at(1), t == 0 ? 127.0f : static_cast<float>(t - c.page_size / 2) + 0.5f);
    if (t == 1) k.Set(at(2), kNaN);
    if (t == 2) k.Set(at(3), kInf);
  }
  // Outputs start random, so what no item writes is compared too.
  const std::vector<int8_t> k_int8 = RandomInt8(rng, k.size());
  const std::vector<int8_t> v_int8 = RandomInt8(rng, k.size());
  const int64_t scales = int64_t{kSlots} * c.kv_heads * c.head_dim;
  const std::vector<float> k_scale = RandomFloats(rng, scales, 0.0f, 1.0f);
  const std::vector<float> v_scale = RandomFloats(rng, scales, 0.0f, 1.0f);

  OpBuffers in;
  const int iitems = in.Add(items), ik = in.Add(k), iv = in.Add(v);
  const int ik8 = in.Add(k_int8), iv8 = in.Add(v_int8), iks = in.Add(k_scale),
            ivs = in.Add(v_scale);
  OpResult cpu, gpu;
  ASSERT_NO_FATAL_FAILURE(RunBothOk(
      in,
      [&](Backend& be, Stream& s, const OpPtrs& p) {
        auto a = SlotShape<QuantizeSlotsArgs>(c);
        a.items = p.get<HeadSlot>(iitems);
        a.num_items = static_cast<int32_t>(items.size());
        a.k_cache = p.get(ik);
        a.v_cache = p.get(iv);
        a.k_int8 = p.get<int8_t>(ik8);
        a.v_int8 = p.get<int8_t>(iv8);
        a.k_scale = p.get<float>(iks);
        a.v_scale = p.get<float>(ivs);
        a.num_slots = kSlots;
        return be.QuantizeSlots(s, a);
      },
      &cpu, &gpu));
  ExpectSameBytes(cpu, gpu, ik8, 1, "k_int8");
  ExpectSameBytes(cpu, gpu, iv8, 1, "v_int8");
  ExpectSameBytes(cpu, gpu, iks, sizeof(float), "k_scale");
  ExpectSameBytes(cpu, gpu, ivs, sizeof(float), "v_scale");
  // The tie channel rounded to even: 0.5 → 0, 1.5 → 2, -0.5 → 0.
  const std::vector<int8_t> got = gpu.Get<int8_t>(ik8);
  const int32_t half = c.page_size / 2;
  EXPECT_EQ(got[static_cast<size_t>(wl.Offset(int64_t{first.slot}, half, first.kv_head, 1))], 0);
  EXPECT_EQ(got[static_cast<size_t>(wl.Offset(int64_t{first.slot}, half + 1, first.kv_head, 1))],
            2);
  EXPECT_EQ(got[static_cast<size_t>(wl.Offset(int64_t{first.slot}, half - 1, first.kv_head, 1))],
            0);
}

TEST_P(CudaSlotOpsTest, MoveHeadSlotsMatchesCpuBitForBit) {
  const SlotCase c = GetParam();
  constexpr int32_t kSlots = 8;
  const WorkingSetLayout wl{kSlots, c.page_size, c.kv_heads, c.head_dim};
  std::mt19937 rng(SeedOf(c, 4));
  TypedBuffer k(c.dtype, kSlots * wl.slot_elements());
  TypedBuffer v(c.dtype, k.size());
  k.FillNormal(SeedOf(c, 5));
  v.FillNormal(SeedOf(c, 6));
  const std::vector<int8_t> k_int8 = RandomInt8(rng, k.size());
  const std::vector<int8_t> v_int8 = RandomInt8(rng, k.size());
  const int64_t scales = int64_t{kSlots} * c.kv_heads * c.head_dim;
  const std::vector<float> k_scale = RandomFloats(rng, scales, 0.0f, 1.0f);
  const std::vector<float> v_scale = RandomFloats(rng, scales, 0.0f, 1.0f);
  // Chained moves (each reads what the one before wrote, then its source is overwritten),
  // then random ones.
  const int32_t h_last = c.kv_heads - 1;
  std::vector<HeadSlotMove> items = {{0, 1, 3},      {0, 3, 5},      {0, 5, 1},
                                     {h_last, 5, 0}, {h_last, 0, 7}, {0, 2, 5}};
  for (int i = 0; i < 20; ++i) {
    const int32_t src = Uniform(rng, 0, kSlots - 1);
    int32_t dst = Uniform(rng, 0, kSlots - 2);
    if (dst >= src) ++dst;
    items.push_back({Uniform(rng, 0, c.kv_heads - 1), src, dst});
  }

  for (const bool with_int8 : {false, true}) {
    SCOPED_TRACE(absl::StrFormat("int8 %d", with_int8));
    OpBuffers in;
    const int iitems = in.Add(items), ik = in.Add(k), iv = in.Add(v);
    const int ik8 = with_int8 ? in.Add(k_int8) : -1, iv8 = with_int8 ? in.Add(v_int8) : -1;
    const int iks = with_int8 ? in.Add(k_scale) : -1, ivs = with_int8 ? in.Add(v_scale) : -1;
    OpResult cpu, gpu;
    ASSERT_NO_FATAL_FAILURE(RunBothOk(
        in,
        [&](Backend& be, Stream& s, const OpPtrs& p) {
          auto a = SlotShape<MoveHeadSlotsArgs>(c);
          a.items = p.get<HeadSlotMove>(iitems);
          a.num_items = static_cast<int32_t>(items.size());
          a.k_cache = p.get(ik);
          a.v_cache = p.get(iv);
          a.k_int8 = p.get<int8_t>(ik8);
          a.v_int8 = p.get<int8_t>(iv8);
          a.k_scale = p.get<float>(iks);
          a.v_scale = p.get<float>(ivs);
          a.num_slots = kSlots;
          return be.MoveHeadSlots(s, a);
        },
        &cpu, &gpu));
    const size_t elem = DTypeSize(c.dtype);
    ExpectSameBytes(cpu, gpu, ik, elem, "k_cache");
    ExpectSameBytes(cpu, gpu, iv, elem, "v_cache");
    if (!with_int8) continue;
    ExpectSameBytes(cpu, gpu, ik8, 1, "k_int8");
    ExpectSameBytes(cpu, gpu, iv8, 1, "v_int8");
    ExpectSameBytes(cpu, gpu, iks, sizeof(float), "k_scale");
    ExpectSameBytes(cpu, gpu, ivs, sizeof(float), "v_scale");
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, CudaSlotOpsTest, ::testing::ValuesIn(AllSlotCases()), SlotCaseName);

// ---- Data-dependent errors: OUT_OF_RANGE from the stream, on both backends ----

class CudaComputeErrorTest : public DualBackendTest<::testing::Test> {
 protected:
  static constexpr int32_t kB = 2, kHq = 4, kD = 64, kP = 16, kS = 4, kPages = 8;
};

TEST_F(CudaComputeErrorTest, ScorePagesNumPagesBeyondMaxPages) {
  TypedBuffer q(DType::kF16, kB * kHq * kD), sums(DType::kF16, kB * kPages * kHkv * 2 * kD);
  q.FillNormal(1);
  sums.FillNormal(2);
  OpBuffers in;
  const int iq = in.Add(q), isum = in.Add(sums);
  const int inp = in.Add(std::vector<int32_t>{3, kPages + 1});
  const int ipooled = in.Add(std::vector<float>(kB * kHkv * kPages));
  OpResult cpu, gpu;
  ASSERT_NO_FATAL_FAILURE(RunBothOutOfRange(
      in,
      [&](Backend& be, Stream& s, const OpPtrs& p) {
        ScorePagesArgs a;
        a.dtype = DType::kF16;
        a.batch = kB;
        a.num_q_heads = kHq;
        a.num_kv_heads = kHkv;
        a.head_dim = kD;
        a.max_pages = kPages;
        a.q = p.get(iq);
        a.summaries = p.get(isum);
        a.num_pages = p.get<int32_t>(inp);
        a.pooled = p.get<float>(ipooled);
        return be.ScorePages(s, a);
      },
      "ScorePages:", &cpu, &gpu));
}

TEST_F(CudaComputeErrorTest, TopKHeadKBeyondK) {
  constexpr int32_t kK = 4;
  OpBuffers in;
  const int ipooled = in.Add(std::vector<float>(kB * kHkv * kPages, 1.0f));
  const int inp = in.Add(std::vector<int32_t>{kPages, kPages});
  const int ihk = in.Add(std::vector<int32_t>{1, 2, kK + 1, 0});
  const int isel = in.Add(std::vector<int32_t>(kB * kHkv * kK));
  OpResult cpu, gpu;
  ASSERT_NO_FATAL_FAILURE(RunBothOutOfRange(
      in,
      [&](Backend& be, Stream& s, const OpPtrs& p) {
        TopKArgs a;
        a.batch = kB;
        a.num_kv_heads = kHkv;
        a.max_pages = kPages;
        a.k = kK;
        a.pooled = p.get<float>(ipooled);
        a.num_pages = p.get<int32_t>(inp);
        a.selected = p.get<int32_t>(isel);
        a.head_k = p.get<int32_t>(ihk);
        return be.TopK(s, a);
      },
      "TopK: head_k[2] = 5", &cpu, &gpu));
}

TEST_F(CudaComputeErrorTest, ReplaceSelectedPageWithoutHostPage) {
  constexpr int32_t kK = 2;
  std::vector<int64_t> host_page_of(kB * kPages);
  std::iota(host_page_of.begin(), host_page_of.end(), 0);
  host_page_of[kPages + 5] = -1;  // sequence 1, page 5
  OpBuffers in;
  const int isel = in.Add(std::vector<int32_t>{0, 1, 2, -1, 3, 4, 5, 6});
  const int itab = in.Add(std::vector<int32_t>(kB * kHkv * kS, kEmptySlot));
  const int ihp = in.Add(host_page_of);
  const int iitems = in.Add(std::vector<RecallItem>(kB * kHkv * kK));
  OpResult cpu, gpu;
  ASSERT_NO_FATAL_FAILURE(RunBothOutOfRange(
      in,
      [&](Backend& be, Stream& s, const OpPtrs& p) {
        ReplaceArgs a;
        a.batch = kB;
        a.num_kv_heads = kHkv;
        a.num_slots = kS;
        a.region_begin = 1;
        a.k = kK;
        a.selected = p.get<int32_t>(isel);
        a.slot_table = p.get<int32_t>(itab);
        a.host_page_of = p.get<int64_t>(ihp);
        a.max_pages = kPages;
        a.items = p.get<RecallItem>(iitems);
        return be.Replace(s, a);
      },
      "Replace:", &cpu, &gpu));
}

// Both data checks of SparseAttention: partial_len beyond the page size, and a slot table
// entry below -1.
TEST_F(CudaComputeErrorTest, SparseAttentionBadPartialLenOrSlotTable) {
  constexpr int32_t kEntries = kB * kHkv * kS;
  std::vector<int32_t> table(kEntries);
  for (int32_t i = 0; i < kEntries; ++i) table[static_cast<size_t>(i)] = i % kS;
  TypedBuffer q(DType::kBF16, kB * kHq * kD), k(DType::kBF16, kB * kS * kP * kHkv * kD);
  q.FillNormal(3);
  k.FillNormal(4);
  for (const bool bad_len : {true, false}) {
    SCOPED_TRACE(bad_len ? "partial_len" : "slot_table");
    std::vector<int32_t> tab = table;
    if (!bad_len) tab[5] = -2;
    OpBuffers in;
    const int iq = in.Add(q), ik = in.Add(k), iv = in.Add(k), itab = in.Add(tab);
    const int ipp = in.Add(std::vector<int32_t>{1, 2});
    const int ipl = in.Add(std::vector<int32_t>{3, bad_len ? kP + 1 : kP});
    const int iout = in.Add(TypedBuffer(DType::kBF16, kB * kHq * kD));
    OpResult cpu, gpu;
    ASSERT_NO_FATAL_FAILURE(RunBothOutOfRange(
        in,
        [&](Backend& be, Stream& s, const OpPtrs& p) {
          SparseAttentionArgs a;
          a.dtype = DType::kBF16;
          a.batch = kB;
          a.num_q_heads = kHq;
          a.num_kv_heads = kHkv;
          a.head_dim = kD;
          a.page_size = kP;
          a.num_slots = kS;
          a.q = p.get(iq);
          a.k_cache = p.get(ik);
          a.v_cache = p.get(iv);
          a.slot_table = p.get<int32_t>(itab);
          a.partial_page = p.get<int32_t>(ipp);
          a.partial_len = p.get<int32_t>(ipl);
          a.out = p.get(iout);
          return be.SparseAttention(s, a);
        },
        bad_len ? "SparseAttention: partial_len[1] = 17" : "SparseAttention: slot_table[5] = -2",
        &cpu, &gpu));
  }
}

TEST_F(CudaComputeErrorTest, DenseAttentionSeqLenBeyondMaxTokens) {
  constexpr int32_t kT = 40;
  TypedBuffer q(DType::kF32, kB * kHq * kD), k(DType::kF32, kB * kT * kHkv * kD);
  q.FillNormal(5);
  k.FillNormal(6);
  OpBuffers in;
  const int iq = in.Add(q), ik = in.Add(k), iv = in.Add(k);
  const int ilen = in.Add(std::vector<int32_t>{kT + 1, 3});
  const int iout = in.Add(TypedBuffer(DType::kF32, kB * kHq * kD));
  OpResult cpu, gpu;
  ASSERT_NO_FATAL_FAILURE(RunBothOutOfRange(
      in,
      [&](Backend& be, Stream& s, const OpPtrs& p) {
        DenseAttentionArgs a;
        a.dtype = DType::kF32;
        a.batch = kB;
        a.num_q_heads = kHq;
        a.num_kv_heads = kHkv;
        a.head_dim = kD;
        a.max_tokens = kT;
        a.q = p.get(iq);
        a.k = p.get(ik);
        a.v = p.get(iv);
        a.seq_len = p.get<int32_t>(ilen);
        a.out = p.get(iout);
        return be.DenseAttention(s, a);
      },
      "DenseAttention: seq_len[0] = 41", &cpu, &gpu));
}

TEST_F(CudaComputeErrorTest, QuantizeSlotsKvHeadOrSlotOutOfRange) {
  TypedBuffer k(DType::kF16, kS * kP * kHkv * kD);
  k.FillNormal(7);
  struct Bad {
    HeadSlot item;
    const char* message;
  };
  for (const Bad bad : {Bad{{kHkv, 1}, "QuantizeSlots: items[1].kv_head = 2"},
                        Bad{{0, kS}, "QuantizeSlots: items[1].slot = 4"}}) {
    SCOPED_TRACE(bad.message);
    OpBuffers in;
    const int iitems = in.Add(std::vector<HeadSlot>{{0, 0}, bad.item, {1, 2}});
    const int ik = in.Add(k), iv = in.Add(k);
    const int ik8 = in.Add(std::vector<int8_t>(static_cast<size_t>(k.size())));
    const int iv8 = in.Add(std::vector<int8_t>(static_cast<size_t>(k.size())));
    const int iks = in.Add(std::vector<float>(kS * kHkv * kD));
    const int ivs = in.Add(std::vector<float>(kS * kHkv * kD));
    OpResult cpu, gpu;
    ASSERT_NO_FATAL_FAILURE(RunBothOutOfRange(
        in,
        [&](Backend& be, Stream& s, const OpPtrs& p) {
          QuantizeSlotsArgs a;
          a.dtype = DType::kF16;
          a.page_size = kP;
          a.num_kv_heads = kHkv;
          a.head_dim = kD;
          a.items = p.get<HeadSlot>(iitems);
          a.num_items = 3;
          a.k_cache = p.get(ik);
          a.v_cache = p.get(iv);
          a.k_int8 = p.get<int8_t>(ik8);
          a.v_int8 = p.get<int8_t>(iv8);
          a.k_scale = p.get<float>(iks);
          a.v_scale = p.get<float>(ivs);
          a.num_slots = kS;
          return be.QuantizeSlots(s, a);
        },
        bad.message, &cpu, &gpu));
  }
}

// A bad item anywhere fails the whole call before anything moves, on both backends.
TEST_F(CudaComputeErrorTest, MoveHeadSlotsBadItemMovesNothing) {
  TypedBuffer k(DType::kF32, kS * kP * kHkv * kD), v(DType::kF32, k.size());
  k.FillNormal(8);
  v.FillNormal(9);
  std::mt19937 rng(10);
  struct Bad {
    HeadSlotMove item;
    const char* message;
  };
  for (const Bad bad : {Bad{{kHkv, 0, 1}, "MoveHeadSlots: items[2].kv_head = 2"},
                        Bad{{0, kS, 1}, "MoveHeadSlots: items[2].src_slot = 4"},
                        Bad{{1, 0, -1}, "MoveHeadSlots: items[2].dst_slot = -1"}}) {
    SCOPED_TRACE(bad.message);
    OpBuffers in;
    const int iitems = in.Add(std::vector<HeadSlotMove>{{0, 0, 1}, {1, 2, 3}, bad.item, {0, 3, 2}});
    const int ik = in.Add(k), iv = in.Add(v);
    const int ik8 = in.Add(RandomInt8(rng, k.size())), iv8 = in.Add(RandomInt8(rng, k.size()));
    const int iks = in.Add(RandomFloats(rng, kS * kHkv * kD, 0.0f, 1.0f));
    const int ivs = in.Add(RandomFloats(rng, kS * kHkv * kD, 0.0f, 1.0f));
    OpResult cpu, gpu;
    ASSERT_NO_FATAL_FAILURE(RunBothOutOfRange(
        in,
        [&](Backend& be, Stream& s, const OpPtrs& p) {
          MoveHeadSlotsArgs a;
          a.dtype = DType::kF32;
          a.page_size = kP;
          a.num_kv_heads = kHkv;
          a.head_dim = kD;
          a.items = p.get<HeadSlotMove>(iitems);
          a.num_items = 4;
          a.k_cache = p.get(ik);
          a.v_cache = p.get(iv);
          a.k_int8 = p.get<int8_t>(ik8);
          a.v_int8 = p.get<int8_t>(iv8);
          a.k_scale = p.get<float>(iks);
          a.v_scale = p.get<float>(ivs);
          a.num_slots = kS;
          return be.MoveHeadSlots(s, a);
        },
        bad.message, &cpu, &gpu));
    for (const int i : {ik, iv, ik8, iv8, iks, ivs}) {
      EXPECT_TRUE(gpu.bufs[static_cast<size_t>(i)] == in[static_cast<size_t>(i)])
          << "cuda wrote buffer " << i;
      EXPECT_TRUE(cpu.bufs[static_cast<size_t>(i)] == in[static_cast<size_t>(i)])
          << "cpu wrote buffer " << i;
    }
  }
}

}  // namespace
}  // namespace kvtier
