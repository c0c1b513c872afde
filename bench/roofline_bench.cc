#include "bench/roofline_bench.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/status.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/ops.h"
#include "kvtier/dtype.h"
#include "kvtier/layout.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVTIER_ROOFLINE_AVX2 1
#else
#define KVTIER_ROOFLINE_AVX2 0
#endif

namespace kvtier::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Targets the report prints (not asserted).
constexpr int32_t kRowBandwidthPasses = 5;  // read-bandwidth passes after each row
constexpr double kDenseMinFraction = 0.6;   // cold dense attention, of the read bandwidth
constexpr double kSparseMinFraction = 0.5;  // cold sparse attention
constexpr double kDenseMinSpeedup = 3.0;    // cold dense, new kernels over old
constexpr int32_t kSpeedupContext = 32768;  // ... at this context
constexpr double kSelectionMaxPerDoubling = 2.2;  // cold selection time per doubling, new

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kAssumedLlc = 32 * kMiB;

// Where the checksums of the reads go, so that no read is optimised away.
volatile uint64_t g_read_sink = 0;

std::string Bytes(double bytes) {
  if (bytes >= double(1 << 30)) return absl::StrFormat("%.2f GiB", bytes / double(1 << 30));
  if (bytes >= double(1 << 20)) return absl::StrFormat("%.1f MiB", bytes / double(1 << 20));
  return absl::StrFormat("%.1f KiB", bytes / 1024.0);
}

// "32768K" / "1M" / "512" (a sysfs cache size) in bytes; 0 when it does not parse.
int64_t ParseCacheSize(absl::string_view s) {
  s = absl::StripAsciiWhitespace(s);
  int64_t unit = 1;
  if (absl::ConsumeSuffix(&s, "K")) {
    unit = 1024;
  } else if (absl::ConsumeSuffix(&s, "M")) {
    unit = kMiB;
  }
  int64_t v = 0;
  return absl::SimpleAtoi(s, &v) && v > 0 ? v * unit : 0;
}

#if KVTIER_ROOFLINE_AVX2
__attribute__((target("avx2"))) uint64_t ReadSumAvx2(const uint8_t* p, size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i_u*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i_u*>(p + i + 32)));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i_u*>(p + i + 64)));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i_u*>(p + i + 96)));
  }
  const __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), s);
  uint64_t sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  for (; i < n; ++i) sum += p[i];
  return sum;
}
#endif

// The portable loop: eight independent 64-bit sums (the compiler vectorises it).
uint64_t ReadSumPortable(const uint8_t* p, size_t n) {
  uint64_t acc[8] = {};
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    uint64_t w[8];
    std::memcpy(w, p + i, sizeof(w));
    for (int j = 0; j < 8; ++j) acc[j] += w[j];
  }
  uint64_t sum = 0;
  for (uint64_t a : acc) sum += a;
  for (; i < n; ++i) sum += p[i];
  return sum;
}

bool HaveAvx2() {
#if KVTIER_ROOFLINE_AVX2
  static const bool have = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return have;
#else
  return false;
#endif
}

// A host buffer aligned as the cpu backend aligns its allocations (64 bytes).
class HostBuffer {
 public:
  static absl::StatusOr<HostBuffer> Make(size_t bytes) {
    const size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "roofline bench: out of host memory allocating %s", Bytes(double(bytes))));
    }
    HostBuffer b;
    b.p_.reset(static_cast<uint8_t*>(p));
    b.size_ = bytes;
    return b;
  }
  uint8_t* data() const { return p_.get(); }
  size_t size() const { return size_; }
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(p_.get());
  }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> p_;
  size_t size_ = 0;
};

// About 1 Mi elements of dtype `t` uniform in [-1, 1] (a count that is not a power of two),
// made once per dtype.
const std::vector<uint8_t>& Pattern(DType t) {
  static std::vector<uint8_t> patterns[3];
  std::vector<uint8_t>& pattern = patterns[t == DType::kF16 ? 0 : t == DType::kBF16 ? 1 : 2];
  if (!pattern.empty()) return pattern;
  const size_t e = DTypeSize(t);
  const size_t n = (size_t{1} << 20) + 17;
  pattern.resize(n * e);
  std::mt19937_64 rng(0x9e3779b97f4a7c15ULL);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (size_t i = 0; i < n; ++i) {
    const float v = u(rng);
    if (t == DType::kF16) {
      const Half h = FloatToHalf(v);
      std::memcpy(&pattern[i * e], &h, e);
    } else if (t == DType::kBF16) {
      const BFloat16 h = FloatToBFloat16(v);
      std::memcpy(&pattern[i * e], &h, e);
    } else {
      std::memcpy(&pattern[i * e], &v, e);
    }
  }
  return pattern;
}

// Fills `bytes` of `dst` with elements of dtype `t` uniform in [-1, 1]: the pattern tiled by
// memcpy from an element offset that `seed` picks, so half a gigabyte fills in a fraction of
// a second and copies differ.
void FillRandom(void* dst, size_t bytes, DType t, uint64_t seed) {
  const std::vector<uint8_t>& pattern = Pattern(t);
  const size_t e = DTypeSize(t);
  size_t from = static_cast<size_t>(seed * 7919) % (pattern.size() / e) * e;
  auto* out = static_cast<uint8_t*>(dst);
  for (size_t off = 0; off < bytes;) {
    const size_t n = std::min(pattern.size() - from, bytes - off);
    std::memcpy(out + off, pattern.data() + from, n);
    off += n;
    from = 0;
  }
}

// How far the 10th and 90th percentiles reach from the median, the furthest of the two, as a
// fraction of it.
double RelSpread(const Spread& s) {
  return std::max(s.p90 - s.median, s.median - s.p10) / s.median;
}

// One op at one size: `call(isa, copy)` runs it once, synchronously, on copy `copy` of its
// inputs (copies of `copy_bytes` each, `read_bytes` of which it must read per call).
struct OpCase {
  std::string op;
  int32_t context = 0;
  int64_t read_bytes = 0;
  int64_t copy_bytes = 0;
  int32_t copies = 1;
  bool evict = false;  // cold: stream the eviction buffer before each timed call too
  std::function<absl::Status(cpu::Isa, int32_t)> call;
};

// A target of a row: `value` against a bound.
struct Target {
  std::string what;  // "fraction_of_read_bw", "speedup_over_old", ...
  double bound = 0;
  bool at_least = true;
  double value = NAN;
  bool met() const { return std::isfinite(value) && (at_least ? value >= bound : value <= bound); }
};

// One op at one size, cold or warm: old and new kernel times.
struct Row {
  std::string op;
  int32_t context = 0;
  bool cold = true;
  int64_t read_bytes = 0, copy_bytes = 0;
  int32_t copies = 1;
  bool evict = false;
  bool fits_llc = true;
  Spread old_ms, new_ms;
  Spread bw;  // GB/s: the read bandwidth measured right after the row's calls
  bool has_old = false;
  std::vector<Target> targets;
};

// Copies of `copy_bytes` that a cold rotation needs, and whether it needs eviction too.
struct ColdPlan {
  int32_t copies = 1;
  bool evict = false;
};

class RooflineBench {
 public:
  explicit RooflineBench(const RooflineBenchOptions& o) : o_(o), g_(o.geometry) {}
  absl::StatusOr<JsonObject> Run(std::ostream& log);

 private:
  absl::Status Check() const;
  ColdPlan Plan(int64_t copy_bytes) const;
  int64_t PeakBytes() const;
  // Median read bandwidth over o_.bw_reps passes of the buffer, GB/s, on the pool's threads
  // (`parallel`) or the calling thread.
  Spread ReadBandwidth(bool parallel, int32_t passes = 0);  // passes ≤ 0: --bw-reps
  absl::Status Evict();
  absl::Status Measure(const OpCase& c);
  // Attention's inputs: q, out, and `copies` K/V pairs of kv_bytes each, random.
  struct AttentionInputs {
    HostBuffer q, out;
    std::vector<HostBuffer> k, v;
  };
  absl::StatusOr<AttentionInputs> MakeInputs(size_t kv_bytes, int32_t copies) const;
  absl::Status MeasureDense(int32_t T);
  absl::Status MeasureSparse(int32_t T);
  absl::Status MeasureSelection(int32_t T);
  int32_t WorkingSetPages(int32_t T) const {
    const auto pages = static_cast<int32_t>(
        std::llround(o_.working_set_fraction * T / static_cast<double>(g_.page_size)));
    return std::clamp(pages, 1, T / g_.page_size);
  }
  size_t RowBytes() const { return size_t{1} * g_.num_kv_heads * g_.head_dim * g_.element_bytes(); }
  JsonObject Report(std::ostream& log) const;

  const RooflineBenchOptions o_;
  const Geometry g_;
  int threads_ = 1;
  cpu::Isa new_isa_ = cpu::Isa::kScalar;
  CacheInfo llc_;
  int64_t bw_bytes_ = 0;
  std::unique_ptr<ThreadPool> pool_;
  HostBuffer bw_buf_, evict_buf_;
  Spread bw_mt_, bw_1t_, bw_end_;
  std::vector<Row> rows_;
  std::vector<int32_t> contexts_, sel_contexts_;
  uint64_t sink_ = 0;  // checksums of the reads (g_read_sink at the end)
};

absl::Status RooflineBench::Check() const {
  KVTIER_RETURN_IF_ERROR(g_.Validate());
  if (contexts_.empty() && sel_contexts_.empty()) {
    return absl::InvalidArgumentError("--contexts and --selection-contexts are both empty");
  }
  for (const auto* list : {&contexts_, &sel_contexts_}) {
    for (int32_t T : *list) {
      if (T < g_.page_size || T % g_.page_size != 0 || T > (1 << 28)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "context %d must be a positive multiple of the page size %d (at most 2^28)", T,
            g_.page_size));
      }
    }
  }
  if (!(o_.working_set_fraction > 0 && o_.working_set_fraction <= 1)) {
    return absl::InvalidArgumentError("--working-set-fraction must be in (0, 1]");
  }
  if (o_.reps < 1 || o_.bw_reps < 1) {
    return absl::InvalidArgumentError("--reps and --bw-reps must be >= 1");
  }
  if (o_.threads < 0) return absl::InvalidArgumentError("--threads must be >= 0 (0 = all)");
  if (!(o_.cold_factor >= 1.0)) return absl::InvalidArgumentError("--cold-factor must be >= 1");
  if (o_.bw_bytes != 0 && o_.bw_bytes < kMiB) {
    return absl::InvalidArgumentError("--bw-mib must be >= 1 (0 = 8 x the last-level cache)");
  }
  if (o_.llc_bytes < 0) return absl::InvalidArgumentError("--llc-mib must be >= 0 (0 = detect)");
  if (o_.max_copies_bytes < 1) return absl::InvalidArgumentError("--max-copies-mib must be >= 1");
  if (!cpu::IsaSupported(new_isa_) || !cpu::IsaSupported(o_.old_isa)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--isa / --old-isa: this CPU and build support at most %s",
        cpu::IsaName(cpu::DetectedIsa())));
  }
  return absl::OkStatus();
}

ColdPlan RooflineBench::Plan(int64_t copy_bytes) const {
  const double reuse = o_.cold_factor * static_cast<double>(llc_.bytes);
  ColdPlan p;
  const auto need = static_cast<int64_t>(std::ceil(reuse / static_cast<double>(copy_bytes)));
  if (need <= 1) return p;  // one copy is already that large: cold by construction
  if (need * copy_bytes <= o_.max_copies_bytes) {
    p.copies = static_cast<int32_t>(need);
    return p;
  }
  p.copies = static_cast<int32_t>(std::max<int64_t>(1, o_.max_copies_bytes / copy_bytes));
  p.evict = true;
  return p;
}

// The most host memory one stage of the run holds: the bandwidth buffer plus the largest
// op's copies (ops run one after another and free their inputs).
int64_t RooflineBench::PeakBytes() const {
  int64_t op_max = 0;
  for (int32_t T : contexts_) {
    const int64_t dense = int64_t{2} * T * static_cast<int64_t>(RowBytes());
    const int64_t ws =
        int64_t{2} * WorkingSetPages(T) * g_.page_size * static_cast<int64_t>(RowBytes());
    op_max = std::max({op_max, dense * Plan(dense).copies, ws * Plan(ws).copies});
  }
  for (int32_t T : sel_contexts_) {
    const int64_t P = T / g_.page_size;
    const int64_t sum = P * static_cast<int64_t>(g_.summary_bytes());
    const int64_t pooled = P * g_.num_kv_heads * 4;
    op_max = std::max(op_max, sum * Plan(sum).copies + pooled * Plan(pooled).copies);
  }
  const int64_t evict = static_cast<int64_t>(o_.cold_factor * static_cast<double>(llc_.bytes));
  return bw_bytes_ + op_max + (evict > bw_bytes_ ? evict : 0);
}

Spread RooflineBench::ReadBandwidth(bool parallel, int32_t passes) {
  const uint8_t* p = bw_buf_.data();
  const size_t n = bw_buf_.size();
  std::vector<double> gbps;
  if (passes <= 0) passes = o_.bw_reps;
  for (int32_t r = 0; r <= passes; ++r) {  // pass 0 is a warm-up
    const Clock::time_point t0 = Clock::now();
    sink_ += parallel ? ParallelReadSum(*pool_, p, n) : ReadSum(p, n);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (r > 0) gbps.push_back(static_cast<double>(n) / s / 1e9);
  }
  return SpreadOf(std::move(gbps));
}

absl::Status RooflineBench::Evict() {
  const auto bytes = static_cast<size_t>(o_.cold_factor * static_cast<double>(llc_.bytes));
  if (bw_buf_.size() >= bytes) {
    sink_ += ParallelReadSum(*pool_, bw_buf_.data(), bytes);
    return absl::OkStatus();
  }
  if (evict_buf_.size() < bytes) {
    KVTIER_ASSIGN_OR_RETURN(evict_buf_, HostBuffer::Make(bytes));
    std::memset(evict_buf_.data(), 1, bytes);
  }
  sink_ += ParallelReadSum(*pool_, evict_buf_.data(), bytes);
  return absl::OkStatus();
}

// Times the op cold and (with o_.warm) warm: per rep the old kernel, then the new, after one
// untimed call of each. Cold calls walk the copies in turn; warm calls all use copy 0.
absl::Status RooflineBench::Measure(const OpCase& c) {
  std::vector<cpu::Isa> kernels;
  if (o_.old) kernels.push_back(o_.old_isa);
  kernels.push_back(new_isa_);
  for (const bool cold : {true, false}) {
    if (!cold && !o_.warm) continue;
    std::vector<std::vector<double>> ms(kernels.size());
    int32_t next = 0;
    auto one = [&](size_t k, bool timed) -> absl::Status {
      const int32_t copy = cold ? next++ % c.copies : 0;
      if (cold && c.evict) KVTIER_RETURN_IF_ERROR(Evict());
      const Clock::time_point t0 = Clock::now();
      KVTIER_RETURN_IF_ERROR(c.call(kernels[k], copy));
      const Clock::time_point t1 = Clock::now();
      if (timed) ms[k].push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      return absl::OkStatus();
    };
    for (size_t k = 0; k < kernels.size(); ++k) KVTIER_RETURN_IF_ERROR(one(k, false));
    for (int32_t r = 0; r < o_.reps; ++r) {
      for (size_t k = 0; k < kernels.size(); ++k) KVTIER_RETURN_IF_ERROR(one(k, true));
    }
    Row row;
    row.op = c.op;
    row.context = c.context;
    row.cold = cold;
    row.read_bytes = c.read_bytes;
    row.copy_bytes = c.copy_bytes;
    row.copies = cold ? c.copies : 1;
    row.evict = cold && c.evict;
    row.fits_llc = c.copy_bytes < llc_.bytes;
    row.has_old = o_.old;
    if (o_.old) row.old_ms = SpreadOf(ms.front());
    row.new_ms = SpreadOf(ms.back());
    // The denominator of this row: the machine's read bandwidth now, not only at the start
    // (it drifts on a shared host by tens of percent within a run).
    row.bw = ReadBandwidth(/*parallel=*/true, kRowBandwidthPasses);
    rows_.push_back(row);
  }
  return absl::OkStatus();
}

absl::StatusOr<RooflineBench::AttentionInputs> RooflineBench::MakeInputs(size_t kv_bytes,
                                                                         int32_t copies) const {
  const size_t q_bytes = size_t{1} * g_.num_q_heads * g_.head_dim * g_.element_bytes();
  AttentionInputs in;
  KVTIER_ASSIGN_OR_RETURN(in.q, HostBuffer::Make(q_bytes));
  KVTIER_ASSIGN_OR_RETURN(in.out, HostBuffer::Make(q_bytes));
  FillRandom(in.q.data(), q_bytes, g_.dtype, o_.seed);
  for (int32_t c = 0; c < copies; ++c) {
    KVTIER_ASSIGN_OR_RETURN(HostBuffer kb, HostBuffer::Make(kv_bytes));
    KVTIER_ASSIGN_OR_RETURN(HostBuffer vb, HostBuffer::Make(kv_bytes));
    FillRandom(kb.data(), kv_bytes, g_.dtype, o_.seed + 2 * c + 1);
    FillRandom(vb.data(), kv_bytes, g_.dtype, o_.seed + 2 * c + 2);
    in.k.push_back(std::move(kb));
    in.v.push_back(std::move(vb));
  }
  return in;
}

absl::Status RooflineBench::MeasureDense(int32_t T) {
  const size_t kv_bytes = size_t{1} * T * RowBytes();
  const ColdPlan plan = Plan(static_cast<int64_t>(2 * kv_bytes));
  KVTIER_ASSIGN_OR_RETURN(AttentionInputs in, MakeInputs(kv_bytes, plan.copies));
  HostBuffer &q = in.q, &out = in.out;
  std::vector<HostBuffer>&k = in.k, &v = in.v;
  const int32_t seq_len = T;
  DenseAttentionArgs a;
  a.shape = KvShapeOf(g_);
  a.batch = 1;
  a.max_tokens = T;
  a.q = q.data();
  a.seq_len = &seq_len;
  a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(g_.head_dim));
  a.out = out.data();
  a.k = k[0].data();
  a.v = v[0].data();
  KVTIER_RETURN_IF_ERROR(ValidateArgs(a));
  OpCase c;
  c.op = "dense";
  c.context = T;
  c.read_bytes = c.copy_bytes = static_cast<int64_t>(2 * kv_bytes);
  c.copies = plan.copies;
  c.evict = plan.evict;
  c.call = [&](cpu::Isa isa, int32_t copy) {
    DenseAttentionArgs x = a;
    x.k = k[static_cast<size_t>(copy)].data();
    x.v = v[static_cast<size_t>(copy)].data();
    return CpuDenseAttention(x, pool_.get(), isa);
  };
  return Measure(c);
}

absl::Status RooflineBench::MeasureSparse(int32_t T) {
  const int32_t S = WorkingSetPages(T), P = T / g_.page_size, Hkv = g_.num_kv_heads;
  const size_t cache_bytes = size_t{1} * S * g_.page_size * RowBytes();
  const ColdPlan plan = Plan(static_cast<int64_t>(2 * cache_bytes));
  KVTIER_ASSIGN_OR_RETURN(AttentionInputs in, MakeInputs(cache_bytes, plan.copies));
  HostBuffer &q = in.q, &out = in.out;
  std::vector<HostBuffer>&k = in.k, &v = in.v;
  // Every slot full; each KV head's table its own random choice of S of the P pages.
  std::vector<int32_t> table(static_cast<size_t>(Hkv) * S);
  std::mt19937_64 rng(o_.seed * 0x9e3779b97f4a7c15ULL + static_cast<uint64_t>(T));
  std::vector<int32_t> pages(static_cast<size_t>(P));
  const SlotTableLayout tl{Hkv, S};
  for (int32_t h = 0; h < Hkv; ++h) {
    std::iota(pages.begin(), pages.end(), 0);
    for (int32_t s = 0; s < S; ++s) {
      std::uniform_int_distribution<int32_t> pick(s, P - 1);
      std::swap(pages[static_cast<size_t>(s)], pages[static_cast<size_t>(pick(rng))]);
      table[static_cast<size_t>(tl.Offset(0, h, s))] = pages[static_cast<size_t>(s)];
    }
  }
  const int32_t partial_page = -1, partial_len = 0;
  SparseAttentionArgs a;
  a.shape = KvShapeOf(g_);
  a.batch = 1;
  a.kv.num_slots = S;
  a.kv.slot_table = table.data();
  a.kv.partial_page = &partial_page;
  a.kv.partial_len = &partial_len;
  a.q = q.data();
  a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(g_.head_dim));
  a.out = out.data();
  a.kv.k_cache = k[0].data();
  a.kv.v_cache = v[0].data();
  KVTIER_RETURN_IF_ERROR(ValidateArgs(a));
  OpCase c;
  c.op = "sparse";
  c.context = T;
  c.read_bytes = c.copy_bytes = static_cast<int64_t>(2 * cache_bytes);
  c.copies = plan.copies;
  c.evict = plan.evict;
  c.call = [&](cpu::Isa isa, int32_t copy) {
    SparseAttentionArgs x = a;
    x.kv.k_cache = k[static_cast<size_t>(copy)].data();
    x.kv.v_cache = v[static_cast<size_t>(copy)].data();
    return CpuSparseAttention(x, pool_.get(), isa);
  };
  return Measure(c);
}

// ScorePages alone, ScorePages + TopK ("selection"), and TopK alone, k = the working set's
// pages, every page a candidate.
absl::Status RooflineBench::MeasureSelection(int32_t T) {
  const int32_t P = T / g_.page_size, Hkv = g_.num_kv_heads, k = WorkingSetPages(T);
  const size_t sum_bytes = size_t{1} * P * g_.summary_bytes();
  const size_t pooled_bytes = size_t{4} * Hkv * P;
  const ColdPlan sum_plan = Plan(static_cast<int64_t>(sum_bytes));
  const ColdPlan topk_plan = Plan(static_cast<int64_t>(pooled_bytes));
  const size_t q_bytes = size_t{1} * g_.num_q_heads * g_.head_dim * g_.element_bytes();
  KVTIER_ASSIGN_OR_RETURN(HostBuffer q, HostBuffer::Make(q_bytes));
  FillRandom(q.data(), q_bytes, g_.dtype, o_.seed);
  // Per summary copy: the summaries, the pooled scores ScorePages writes, TopK's output.
  std::vector<HostBuffer> sums, pooled, selected;
  for (int32_t c = 0; c < sum_plan.copies; ++c) {
    KVTIER_ASSIGN_OR_RETURN(HostBuffer s, HostBuffer::Make(sum_bytes));
    FillRandom(s.data(), sum_bytes, g_.dtype, o_.seed + c + 1);
    sums.push_back(std::move(s));
    KVTIER_ASSIGN_OR_RETURN(HostBuffer pb, HostBuffer::Make(pooled_bytes));
    std::memset(pb.data(), 0, pooled_bytes);
    pooled.push_back(std::move(pb));
    KVTIER_ASSIGN_OR_RETURN(HostBuffer sb, HostBuffer::Make(size_t{4} * Hkv * k));
    selected.push_back(std::move(sb));
  }
  const int32_t num_pages = P;
  ScorePagesArgs sa;
  sa.shape = KvShapeOf(g_);
  sa.batch = 1;
  sa.max_pages = P;
  sa.q = q.data();
  sa.summaries = sums[0].data();
  sa.num_pages = &num_pages;
  sa.softmax_scale = 1.0f / std::sqrt(static_cast<float>(g_.head_dim));
  sa.pooled = pooled[0].as<float>();
  KVTIER_RETURN_IF_ERROR(ValidateArgs(sa));
  TopKArgs ta;
  ta.shape = KvShapeOf(g_);
  ta.batch = 1;
  ta.max_pages = P;
  ta.k = k;
  ta.pooled = pooled[0].as<float>();
  ta.num_pages = &num_pages;
  ta.selected = selected[0].as<int32_t>();
  KVTIER_RETURN_IF_ERROR(ValidateArgs(ta));
  auto score = [&](cpu::Isa isa, int32_t copy) {
    ScorePagesArgs x = sa;
    x.summaries = sums[static_cast<size_t>(copy)].data();
    x.pooled = pooled[static_cast<size_t>(copy)].as<float>();
    return CpuScorePages(x, pool_.get(), isa);
  };
  auto topk = [&](cpu::Isa isa, int32_t copy) {
    TopKArgs x = ta;
    x.pooled = pooled[static_cast<size_t>(copy)].as<float>();
    x.selected = selected[static_cast<size_t>(copy)].as<int32_t>();
    return CpuTopK(x, pool_.get(), isa);
  };
  // Real pooled scores for every copy (TopK's work depends on them).
  for (int32_t c = 0; c < sum_plan.copies; ++c) KVTIER_RETURN_IF_ERROR(score(new_isa_, c));

  OpCase c;
  c.context = T;
  c.read_bytes = c.copy_bytes = static_cast<int64_t>(sum_bytes);
  c.copies = sum_plan.copies;
  c.evict = sum_plan.evict;
  c.op = "score_pages";
  c.call = score;
  KVTIER_RETURN_IF_ERROR(Measure(c));
  c.op = "selection";
  c.call = [&](cpu::Isa isa, int32_t copy) {
    KVTIER_RETURN_IF_ERROR(score(isa, copy));
    return topk(isa, copy);
  };
  KVTIER_RETURN_IF_ERROR(Measure(c));

  // TopK alone over its own copies of the pooled scores (they are far smaller).
  std::vector<HostBuffer> tpooled, tselected;
  for (int32_t i = 0; i < topk_plan.copies; ++i) {
    KVTIER_ASSIGN_OR_RETURN(HostBuffer pb, HostBuffer::Make(pooled_bytes));
    std::memcpy(pb.data(), pooled[static_cast<size_t>(i) % pooled.size()].data(), pooled_bytes);
    tpooled.push_back(std::move(pb));
    KVTIER_ASSIGN_OR_RETURN(HostBuffer sb, HostBuffer::Make(size_t{4} * Hkv * k));
    tselected.push_back(std::move(sb));
  }
  OpCase t;
  t.op = "topk";
  t.context = T;
  t.read_bytes = t.copy_bytes = static_cast<int64_t>(pooled_bytes);
  t.copies = topk_plan.copies;
  t.evict = topk_plan.evict;
  t.call = [&](cpu::Isa isa, int32_t copy) {
    TopKArgs x = ta;
    x.pooled = tpooled[static_cast<size_t>(copy)].as<float>();
    x.selected = tselected[static_cast<size_t>(copy)].as<int32_t>();
    return CpuTopK(x, pool_.get(), isa);
  };
  return Measure(t);
}

absl::StatusOr<JsonObject> RooflineBench::Run(std::ostream& log) {
  threads_ = o_.threads > 0 ? o_.threads
                            : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  new_isa_ = o_.isa.value_or(cpu::ActiveIsa());
  contexts_ = o_.contexts;
  sel_contexts_ = o_.selection_contexts;
  std::sort(sel_contexts_.begin(), sel_contexts_.end());
  sel_contexts_.erase(std::unique(sel_contexts_.begin(), sel_contexts_.end()), sel_contexts_.end());
  KVTIER_RETURN_IF_ERROR(Check());
  llc_ = LastLevelCache();
  if (o_.llc_bytes > 0) llc_ = CacheInfo{o_.llc_bytes, "--llc-mib"};
  bw_bytes_ = o_.bw_bytes > 0 ? o_.bw_bytes
                              : std::clamp<int64_t>(8 * llc_.bytes, 256 * kMiB, 1024 * kMiB);
  const int64_t peak = PeakBytes();
  const int64_t avail = HostMemAvailable();
  if (avail > 0 && static_cast<double>(peak) > 0.9 * static_cast<double>(avail)) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "roofline bench: needs about %s of host memory at once, %s available; lower "
        "--contexts, --bw-mib or --cold-factor",
        Bytes(double(peak)), Bytes(double(avail))));
  }
  pool_ = std::make_unique<ThreadPool>(threads_);

  log << absl::StrFormat(
      "roofline bench: %d threads, last-level cache %s (%s), read-bandwidth buffer %s; at most "
      "%s held at once\n",
      threads_, Bytes(double(llc_.bytes)), llc_.source, Bytes(double(bw_bytes_)),
      Bytes(double(peak)));
  KVTIER_ASSIGN_OR_RETURN(bw_buf_, HostBuffer::Make(static_cast<size_t>(bw_bytes_)));
  FillRandom(bw_buf_.data(), bw_buf_.size(), DType::kF32, o_.seed);
  bw_mt_ = ReadBandwidth(/*parallel=*/true);
  bw_1t_ = ReadBandwidth(/*parallel=*/false);
  for (int32_t T : contexts_) {
    log << absl::StrFormat("roofline bench: dense and sparse attention at %d...\n", T);
    KVTIER_RETURN_IF_ERROR(MeasureDense(T));
    KVTIER_RETURN_IF_ERROR(MeasureSparse(T));
  }
  for (int32_t T : sel_contexts_) {
    log << absl::StrFormat("roofline bench: selection at %d...\n", T);
    KVTIER_RETURN_IF_ERROR(MeasureSelection(T));
  }
  bw_end_ = ReadBandwidth(/*parallel=*/true);
  g_read_sink = g_read_sink + sink_;
  return Report(log);
}

// (t_hi / t_lo)^(1 / log2(T_hi / T_lo)): the time factor per doubling of the context.
double PerDoubling(double t_lo, double t_hi, int32_t T_lo, int32_t T_hi) {
  return std::pow(t_hi / t_lo, 1.0 / std::log2(static_cast<double>(T_hi) / T_lo));
}

JsonObject RooflineBench::Report(std::ostream& log) const {
  const double bw = bw_mt_.median;  // GB/s: the denominator
  auto gbps = [](int64_t bytes, const Spread& ms) {
    return static_cast<double>(bytes) / (ms.median * 1e6);
  };
  const std::string device = absl::StrFormat("cpu: %d threads", threads_);
  const bool same = !o_.old || o_.old_isa == new_isa_;
  log << absl::StrFormat(
      "kvtier-bench roofline  device=%s  commit=%s\n"
      "  host %s; last-level cache %s (%s)\n"
      "  shape Hq=%d Hkv=%d d=%d p=%d %s, batch 1; sparse working set and top-k k = %.4g of the "
      "context\n"
      "  kernels: new = %s (detected %s)%s\n"
      "  read bandwidth (sum over %s, median of %d, p10-p90): %d threads %.1f GB/s (%.1f-%.1f), "
      "1 thread %.1f GB/s (%.1f-%.1f); again at the end: %.1f GB/s\n"
      "  cold: each call reads a copy of the op's inputs that was last read >= %.3g x LLC "
      "(%s) of data ago: copies rotate (1 copy: the input alone is that large, cold by "
      "construction, not replicated; '+evict': a %.3g x LLC buffer is also streamed before "
      "each call, outside the timer)\n"
      "  warm: the same buffers every call (after one untimed call)\n"
      "  median of %d calls per kernel; +-: the furthest of p10 and p90 from it (all in the "
      "JSON)\n\n",
      device, Commit(), HostCpu(), Bytes(double(llc_.bytes)), llc_.source, g_.num_q_heads,
      g_.num_kv_heads, g_.head_dim, g_.page_size, DTypeName(g_.dtype), o_.working_set_fraction,
      cpu::IsaName(new_isa_), cpu::IsaName(cpu::DetectedIsa()),
      !o_.old   ? std::string(", old kernels not timed (--no-old)")
      : same    ? absl::StrFormat(", old = %s: the same kernels", cpu::IsaName(o_.old_isa))
                : absl::StrFormat(", old = %s", cpu::IsaName(o_.old_isa)),
      Bytes(double(bw_bytes_)), o_.bw_reps, threads_, bw_mt_.median, bw_mt_.p10, bw_mt_.p90,
      bw_1t_.median, bw_1t_.p10, bw_1t_.p90, bw_end_.median, o_.cold_factor,
      Bytes(o_.cold_factor * double(llc_.bytes)), o_.cold_factor, o_.reps);
  log << "  of BW: new GB/s over the read bandwidth measured right after the row (BW, median of "
      << kRowBandwidthPasses << " passes)\n";
  log << absl::StrFormat("  %-11s %7s %10s %-5s %-8s %17s %17s %8s %8s %6s %6s %7s  %s\n", "op",
                         "context", "reads", "cache", "copies", "old ms", "new ms", "old GB/s",
                         "new GB/s", "BW", "of BW", "new/old", "targets (cold, new kernels)");

  // Cold times of the selection per context, for the doubling ratios.
  std::vector<std::pair<int32_t, Row>> sel_cold;
  std::vector<Row> rows = rows_;
  std::vector<JsonObject> ops;
  for (Row& r : rows) {
    const double new_gbps = gbps(r.read_bytes, r.new_ms);
    const double old_gbps = r.has_old ? gbps(r.read_bytes, r.old_ms) : NAN;
    const double row_bw = r.bw.n > 0 ? r.bw.median : bw;
    const double fraction = new_gbps / row_bw;
    const double speedup = r.has_old ? r.old_ms.median / r.new_ms.median : NAN;
    if (r.cold) {
      if (r.op == "dense") {
        r.targets.push_back({"fraction_of_read_bw", kDenseMinFraction, true, fraction});
        if (r.context == kSpeedupContext && r.has_old) {
          r.targets.push_back({"speedup_over_old", kDenseMinSpeedup, true, speedup});
        }
      } else if (r.op == "sparse") {
        r.targets.push_back({"fraction_of_read_bw", kSparseMinFraction, true, fraction});
      } else if (r.op == "selection") {
        sel_cold.emplace_back(r.context, r);
      }
    }
    std::string note;
    for (const Target& t : r.targets) {
      absl::StrAppend(&note, note.empty() ? "" : "; ",
                      absl::StrFormat("%s %s %.3g: %s",
                                      t.what == "speedup_over_old" ? "new/old" : "of BW",
                                      t.at_least ? ">=" : "<=", t.bound,
                                      t.met() ? "met" : "MISSED"));
    }
    if (!r.cold && !r.fits_llc) note = "(exceeds LLC: same as cold)";
    const std::string copies = !r.cold  ? std::string("same")
                               : r.evict ? absl::StrFormat("%d+evict", r.copies)
                                         : absl::StrCat(r.copies);
    auto ms = [](const Spread& s) {
      return absl::StrFormat("%9.3f +-%3.0f%%", s.median, 100 * RelSpread(s));
    };
    log << absl::StrFormat("  %-11s %7d %10s %-5s %-8s %17s %17s %8.2f %8.2f %6.1f %6.3f %7s%s\n",
                           r.op, r.context, Bytes(double(r.read_bytes)), r.cold ? "cold" : "warm",
                           copies, r.has_old ? ms(r.old_ms) : std::string("-"), ms(r.new_ms),
                           old_gbps, new_gbps, row_bw, fraction,
                           r.has_old ? absl::StrFormat("%.2fx", speedup) : std::string("-"),
                           note.empty() ? note : "  " + note);

    JsonObject j;
    j.Add("op", r.op)
        .Add("context", r.context)
        .Add("cache", r.cold ? "cold" : "warm")
        .Add("read_bytes", r.read_bytes)
        .Add("input_bytes", r.copy_bytes)
        .Add("fits_llc", r.fits_llc)
        .Add("method", !r.cold ? "same buffers"
                            : r.evict ? "rotate copies + evict"
                                      : "rotate copies")
        .Add("copies", r.copies);
    if (!r.cold && !r.fits_llc) j.Add("note", "exceeds LLC: same as cold");
    j.AddObject("new_ms", SpreadJson(r.new_ms))
        .Add("new_gbps", new_gbps)
        .Add("new_fraction_of_read_bw", fraction)
        .Add("read_bw_gbps", row_bw);
    if (r.bw.n > 0) j.AddObject("read_bw", SpreadJson(r.bw));
    if (r.has_old) {
      j.AddObject("old_ms", SpreadJson(r.old_ms))
          .Add("old_gbps", old_gbps)
          .Add("old_fraction_of_read_bw", old_gbps / row_bw)
          .Add("speedup", speedup);
    }
    std::vector<JsonObject> targets;
    for (const Target& t : r.targets) {
      JsonObject tj;
      tj.Add("what", t.what).Add(t.at_least ? "min" : "max", t.bound).Add("value", t.value)
          .Add("met", t.met());
      targets.push_back(tj);
    }
    j.AddArray("targets", targets);
    ops.push_back(j);
  }

  // Selection time per doubling of the context, cold, between consecutive sizes.
  std::vector<JsonObject> doublings;
  double worst_new = NAN;
  bool all_met = true;
  for (size_t i = 1; i < sel_cold.size(); ++i) {
    const auto& [T0, r0] = sel_cold[i - 1];
    const auto& [T1, r1] = sel_cold[i];
    const double n = PerDoubling(r0.new_ms.median, r1.new_ms.median, T0, T1);
    const double old = r0.has_old ? PerDoubling(r0.old_ms.median, r1.old_ms.median, T0, T1) : NAN;
    const bool met = n <= kSelectionMaxPerDoubling;
    all_met = all_met && met;
    worst_new = std::isfinite(worst_new) ? std::max(worst_new, n) : n;
    log << absl::StrFormat(
        "  selection %6d -> %6d (cold): new %.3f -> %.3f ms, %.2fx per doubling (target <= %.1f: "
        "%s)%s\n",
        T0, T1, r0.new_ms.median, r1.new_ms.median, n, kSelectionMaxPerDoubling,
        met ? "met" : "MISSED",
        r0.has_old ? absl::StrFormat("; old %.2fx per doubling", old) : std::string());
    JsonObject d;
    d.Add("from", T0).Add("to", T1).Add("new_per_doubling", n);
    if (r0.has_old) d.Add("old_per_doubling", old);
    d.Add("max", kSelectionMaxPerDoubling).Add("met", met);
    doublings.push_back(d);
  }

  std::vector<std::string> ctx, sel;
  for (int32_t T : contexts_) ctx.push_back(absl::StrCat(T));
  for (int32_t T : sel_contexts_) sel.push_back(absl::StrCat(T));
  JsonObject config;
  config.Add("threads", threads_)
      .Add("batch", int32_t{1})
      .Add("q_heads", g_.num_q_heads)
      .Add("kv_heads", g_.num_kv_heads)
      .Add("head_dim", g_.head_dim)
      .Add("page_size", g_.page_size)
      .Add("dtype", DTypeName(g_.dtype))
      .Add("contexts", absl::StrJoin(ctx, ","))
      .Add("selection_contexts", absl::StrJoin(sel, ","))
      .Add("working_set_fraction", o_.working_set_fraction)
      .Add("reps", o_.reps)
      .Add("bw_reps", o_.bw_reps)
      .Add("bw_bytes", bw_bytes_)
      .Add("llc_bytes", llc_.bytes)
      .Add("llc_source", llc_.source)
      .Add("cold_factor", o_.cold_factor)
      .Add("max_copies_bytes", o_.max_copies_bytes)
      .Add("isa_new", cpu::IsaName(new_isa_))
      .Add("isa_old", o_.old ? cpu::IsaName(o_.old_isa) : std::string_view("none"))
      .Add("isa_detected", cpu::IsaName(cpu::DetectedIsa()))
      .Add("seed", static_cast<int64_t>(o_.seed));
  JsonObject read_bw;
  read_bw.Add("threads", threads_)
      .Add("bytes", bw_bytes_)
      .Add("gbps", bw_mt_.median)
      .AddObject("gbps_spread", SpreadJson(bw_mt_))
      .Add("gbps_1thread", bw_1t_.median)
      .AddObject("gbps_1thread_spread", SpreadJson(bw_1t_))
      .Add("gbps_at_end", bw_end_.median);
  JsonObject targets;
  targets.Add("dense_fraction_min", kDenseMinFraction)
      .Add("sparse_fraction_min", kSparseMinFraction)
      .Add("dense_speedup_min", kDenseMinSpeedup)
      .Add("dense_speedup_context", kSpeedupContext)
      .Add("selection_per_doubling_max", kSelectionMaxPerDoubling);
  JsonObject scaling;
  scaling.AddArray("pairs", doublings).Add("new_worst", worst_new);
  if (!doublings.empty()) scaling.Add("met", all_met);

  JsonObject j;
  j.Add("bench", "roofline")
      .Add("device", device)
      .Add("host", HostCpu())
      .Add("commit", Commit())
      .Add("time", UtcNow())
      .Add("geometry", g_.ToString())
      .AddObject("config", config)
      .AddObject("read_bw", read_bw)
      .AddArray("ops", ops)
      .AddObject("selection_scaling", scaling)
      .AddObject("targets", targets);
  return j;
}

// The flags of the subcommand, alive as long as the CLI::App (the callback owns them).
struct RooflineFlags {
  RooflineBenchOptions o;
  std::string contexts = "32768,131072", selection_contexts = "8192,32768,131072",
              dtype = "fp16", isa, old_isa = "scalar", out;
  double bw_mib = 0, llc_mib = 0, max_copies_mib = 1024;
  bool json = false, no_old = false, no_warm = false;
};

bool ParseIsa(const std::string& s, cpu::Isa* out) {
  for (cpu::Isa i : {cpu::Isa::kScalar, cpu::Isa::kAvx2, cpu::Isa::kAvx512}) {
    if (s == cpu::IsaName(i)) {
      *out = i;
      return true;
    }
  }
  return false;
}

int RunRooflineCommand(RooflineFlags& f) {
  RooflineBenchOptions o = f.o;
  if (!ParseIntList(f.contexts, &o.contexts)) {
    std::cerr << "kvtier-bench roofline: --contexts must be comma-separated integers\n";
    return 2;
  }
  if (!ParseIntList(f.selection_contexts, &o.selection_contexts)) {
    std::cerr << "kvtier-bench roofline: --selection-contexts must be comma-separated integers\n";
    return 2;
  }
  if (!ParseDType(f.dtype, &o.geometry.dtype)) {
    std::cerr << "kvtier-bench roofline: --dtype must be fp16, bf16 or fp32\n";
    return 2;
  }
  if (!f.isa.empty()) {
    cpu::Isa isa = cpu::Isa::kScalar;
    if (!ParseIsa(f.isa, &isa)) {
      std::cerr << "kvtier-bench roofline: --isa must be scalar, avx2 or avx512\n";
      return 2;
    }
    o.isa = isa;
  }
  if (!ParseIsa(f.old_isa, &o.old_isa)) {
    std::cerr << "kvtier-bench roofline: --old-isa must be scalar, avx2 or avx512\n";
    return 2;
  }
  o.bw_bytes = static_cast<int64_t>(f.bw_mib * double(kMiB));
  o.llc_bytes = static_cast<int64_t>(f.llc_mib * double(kMiB));
  o.max_copies_bytes = static_cast<int64_t>(f.max_copies_mib * double(kMiB));
  o.old = !f.no_old;
  o.warm = !f.no_warm;
  auto report = RunRooflineBench(o, f.json ? std::cerr : std::cout);
  if (!report.ok()) {
    std::cerr << "kvtier-bench roofline: " << report.status() << "\n";
    return absl::IsInvalidArgument(report.status()) ? 2 : 1;
  }
  if (f.json) std::cout << report->ToString() << "\n";
  if (!f.out.empty()) std::ofstream(f.out) << report->ToString() << "\n";
  return 0;
}

}  // namespace

CacheInfo LastLevelCache() {
  // sysfs first: glibc's sysconf reports the whole package's L3 on some CPUs, not the
  // slice the calling core shares.
  int best_level = 0;
  int64_t best = 0;
  for (int i = 0; i < 16; ++i) {
    const std::string dir = absl::StrCat("/sys/devices/system/cpu/cpu0/cache/index", i, "/");
    std::ifstream level_in(dir + "level"), type_in(dir + "type"), size_in(dir + "size");
    if (!level_in) break;
    int level = 0;
    std::string type, size;
    level_in >> level;
    type_in >> type;
    size_in >> size;
    const int64_t bytes = ParseCacheSize(size);
    if (type != "Instruction" && bytes > 0 && level > best_level) {
      best_level = level;
      best = bytes;
    }
  }
  if (best > 0) return CacheInfo{best, absl::StrFormat("sysfs, L%d", best_level)};
#ifdef _SC_LEVEL3_CACHE_SIZE
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (l3 > 0) return CacheInfo{l3, "sysconf, L3"};
#endif
#ifdef _SC_LEVEL2_CACHE_SIZE
  const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  if (l2 > 0) return CacheInfo{l2, "sysconf, L2"};
#endif
  return CacheInfo{kAssumedLlc, "assumed"};
}

uint64_t ReadSum(const void* p, size_t bytes) {
  const auto* b = static_cast<const uint8_t*>(p);
#if KVTIER_ROOFLINE_AVX2
  if (HaveAvx2()) return ReadSumAvx2(b, bytes);
#endif
  return ReadSumPortable(b, bytes);
}

uint64_t ParallelReadSum(ThreadPool& pool, const void* p, size_t bytes) {
  const auto* base = static_cast<const uint8_t*>(p);
  const int64_t parts = int64_t{pool.num_threads()} * 8;
  const size_t part = (bytes / static_cast<size_t>(parts) + 4095) / 4096 * 4096;
  std::vector<uint64_t> sums(static_cast<size_t>(parts), 0);
  pool.ParallelFor(parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const size_t off = std::min(bytes, static_cast<size_t>(i) * part);
      sums[static_cast<size_t>(i)] = ReadSum(base + off, std::min(part, bytes - off));
    }
  });
  return std::accumulate(sums.begin(), sums.end(), uint64_t{0});
}

absl::StatusOr<JsonObject> RunRooflineBench(const RooflineBenchOptions& o, std::ostream& log) {
  RooflineBench bench(o);
  return bench.Run(log);
}

CLI::App* AddRooflineCommand(CLI::App& app, int* rc) {
  auto flags = std::make_shared<RooflineFlags>();
  RooflineFlags& f = *flags;
  auto* cmd = app.add_subcommand(
      "roofline",
      "CPU attention and selection ops against the same run's memory read bandwidth, "
      "cold and warm, old (scalar) vs new kernels");
  cmd->add_option("--contexts", f.contexts, "dense and sparse attention contexts (tokens)")
      ->capture_default_str();
  cmd->add_option("--selection-contexts", f.selection_contexts,
                  "ScorePages + TopK contexts (tokens); the ratio per doubling is between "
                  "consecutive ones")
      ->capture_default_str();
  cmd->add_option("--working-set-fraction", f.o.working_set_fraction,
                  "sparse working set and TopK's k as a fraction of the context")
      ->capture_default_str();
  cmd->add_option("--threads", f.o.threads, "threads of the ops and the read bandwidth (0 = all)")
      ->capture_default_str();
  cmd->add_option("--reps", f.o.reps, "timed calls per op, kernel and cold/warm (median reported)")
      ->capture_default_str();
  cmd->add_option("--bw-reps", f.o.bw_reps, "read-bandwidth passes (median reported)")
      ->capture_default_str();
  cmd->add_option("--bw-mib", f.bw_mib,
                  "read-bandwidth buffer in MiB (0 = 8 x the last-level cache, within "
                  "[256, 1024])")
      ->capture_default_str();
  cmd->add_option("--llc-mib", f.llc_mib, "last-level cache in MiB (0 = detect)")
      ->capture_default_str();
  cmd->add_option("--cold-factor", f.o.cold_factor,
                  "cold: data is re-read only after this many times the last-level cache")
      ->capture_default_str();
  cmd->add_option("--max-copies-mib", f.max_copies_mib,
                  "cold: most MiB of copies per op; beyond, a buffer is streamed before each "
                  "call instead")
      ->capture_default_str();
  cmd->add_option("--isa", f.isa,
                  "the new kernels: scalar, avx2 or avx512 (default: what production runs, "
                  "KVTIER_CPU_ISA capping it)");
  cmd->add_option("--old-isa", f.old_isa, "the old kernels to compare with")
      ->capture_default_str();
  cmd->add_flag("--no-old", f.no_old, "do not time the old kernels");
  cmd->add_flag("--no-warm", f.no_warm, "do not time the warm variants");
  cmd->add_option("--q-heads", f.o.geometry.num_q_heads)->capture_default_str();
  cmd->add_option("--kv-heads", f.o.geometry.num_kv_heads)->capture_default_str();
  cmd->add_option("--head-dim", f.o.geometry.head_dim)->capture_default_str();
  cmd->add_option("--page-size", f.o.geometry.page_size)->capture_default_str();
  cmd->add_option("--dtype", f.dtype, "fp16, bf16 or fp32")->capture_default_str();
  cmd->add_option("--seed", f.o.seed)->capture_default_str();
  cmd->add_flag("--json", f.json, "print one JSON object on stdout");
  cmd->add_option("--out", f.out, "also write the JSON report to this file");
  cmd->callback([flags, rc] { *rc = RunRooflineCommand(*flags); });
  return cmd;
}

}  // namespace kvtier::bench
