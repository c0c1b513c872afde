// Google Benchmark micro-benchmarks of the CPU backend's ops at decode-time sizes
// (Llama-3.1-8B layer: 32 query heads, 8 KV heads, d = 128, p = 32, fp16). Each reports
// bytes processed so runs compare against memory bandwidth; BM_Memcpy is the baseline: on
// the ops' thread pool, wall time, at sizes beyond the last-level cache (a size that fits
// it is labelled warm: it measures the cache, not DRAM).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "benchmark/benchmark.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kvtier/layout.h"

namespace kvtier {
namespace {

constexpr int32_t kHq = 32, kHkv = 8, kD = 128, kP = 32;
constexpr KvShape kShape{DType::kF16, kHq, kHkv, kD, kP};
// The last-level cache when Google Benchmark cannot read its size.
constexpr size_t kAssumedLastLevelCacheBytes = size_t{32} << 20;

ThreadPool& Pool() {
  static ThreadPool* pool = new ThreadPool(0);
  return *pool;
}

// The largest cache Google Benchmark found (the last level), in bytes.
size_t LastLevelCacheBytes() {
  size_t bytes = 0;
  for (const auto& c : benchmark::CPUInfo::Get().caches) {
    bytes = std::max(bytes, static_cast<size_t>(std::max(c.size, 0)));
  }
  return bytes > 0 ? bytes : kAssumedLastLevelCacheBytes;
}

// "warm" when `bytes` (what an iteration touches) fits the last-level cache, so repeated
// iterations run from cache; "DRAM" otherwise.
std::string CacheLabel(size_t bytes) {
  const size_t llc = LastLevelCacheBytes();
  return absl::StrFormat("%s (%d MiB touched, last-level cache %d MiB)",
                         bytes <= llc ? "warm: cache-resident" : "DRAM", bytes >> 20, llc >> 20);
}

std::vector<Half> RandomHalves(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  std::vector<Half> v(n);
  for (auto& x : v) x = FloatToHalf(dist(rng));
  return v;
}

// memcpy of range(0) bytes split evenly over the pool's threads (the parallelism the ops
// get), in wall time; bytes processed = bytes copied. Both buffers are written before the
// first iteration, so no page fault is timed.
void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<char> a(bytes, 1), b(bytes, 0);
  ThreadPool& pool = Pool();
  const int64_t parts = pool.num_threads();
  const size_t part = (bytes / static_cast<size_t>(parts) + 4095) / 4096 * 4096;
  for (auto _ : state) {
    pool.ParallelFor(parts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const size_t at = std::min(bytes, static_cast<size_t>(i) * part);
        std::memcpy(b.data() + at, a.data() + at, std::min(part, bytes - at));
      }
    });
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.counters["threads"] = static_cast<double>(parts);
  state.SetLabel(CacheLabel(2 * bytes));
}
// 8 MiB: source and destination fit a 32 MiB last-level cache (labelled warm); 64 and
// 256 MiB do not.
BENCHMARK(BM_Memcpy)->Arg(8 << 20)->Arg(64 << 20)->Arg(256 << 20)->UseRealTime();

void BM_ScorePages(benchmark::State& state) {
  const auto pages = static_cast<int32_t>(state.range(0));
  auto q = RandomHalves(kHq * kD, 1);
  auto sums = RandomHalves(static_cast<size_t>(pages) * kHkv * 2 * kD, 2);
  std::vector<float> pooled(static_cast<size_t>(kHkv) * pages);
  ScorePagesArgs a;
  a.batch = 1;
  a.shape = kShape;
  a.max_pages = pages;
  a.q = q.data();
  a.summaries = sums.data();
  a.num_pages = &pages;
  a.softmax_scale = 1.0f / std::sqrt(float{kD});
  a.pooled = pooled.data();
  for (auto _ : state) benchmark::DoNotOptimize(CpuScorePages(a, &Pool()));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * sums.size() * 2));
}
BENCHMARK(BM_ScorePages)->Arg(1024)->Arg(4096)->UseRealTime();

void BM_TopK(benchmark::State& state) {
  const auto pages = static_cast<int32_t>(state.range(0));
  std::mt19937 rng(3);
  std::vector<float> pooled(static_cast<size_t>(kHkv) * pages);
  for (auto& x : pooled) x = static_cast<float>(rng()) / 4e9f;
  std::vector<int32_t> sel(kHkv * 32);
  TopKArgs a;
  a.batch = 1;
  a.shape = kShape;
  a.max_pages = pages;
  a.k = 32;
  a.pooled = pooled.data();
  a.num_pages = &pages;
  a.sink_pages = 16;
  a.recent_pages = 15;
  a.selected = sel.data();
  for (auto _ : state) benchmark::DoNotOptimize(CpuTopK(a, &Pool()));
}
BENCHMARK(BM_TopK)->Arg(1024)->Arg(4096)->UseRealTime();

void BM_QueryCosine(benchmark::State& state) {
  const auto batch = static_cast<int32_t>(state.range(0));
  auto q = RandomHalves(static_cast<size_t>(batch) * kHq * kD, 4);
  auto qp = RandomHalves(q.size(), 5);
  std::vector<float> mean(static_cast<size_t>(batch) * kHkv);
  QueryCosineArgs a;
  a.batch = batch;
  a.shape = kShape;
  a.q = q.data();
  a.q_prev = qp.data();
  a.group_mean = mean.data();
  for (auto _ : state) benchmark::DoNotOptimize(CpuQueryCosine(a, &Pool()));
}
BENCHMARK(BM_QueryCosine)->Arg(1)->Arg(8)->UseRealTime();

// Recall of `range(0)` head-pages (16 KiB slabs) per iteration from a 4096-page host tier
// (512 MiB) into a 1024-slot working set (2 × 64 MiB), both beyond the last-level cache.
// Every (page, KV head) slab of the host tier is in one shuffled list; each iteration
// recalls the next range(0) of it into the next range(0) slots, so no slab is read again
// until all of them have been: DRAM to DRAM, not the same slabs from cache.
void BM_Recall(benchmark::State& state) {
  const auto n = static_cast<int32_t>(state.range(0));
  const int32_t host_pages = 4096, slots = 1024;
  std::vector<Half> host(static_cast<size_t>(host_pages) * kHkv * 2 * kP * kD);
  std::vector<Half> k(static_cast<size_t>(slots) * kP * kHkv * kD), v(k.size());
  std::vector<RecallItem> all;  // item i goes to slot i % slots: distinct within a plan
  for (int64_t page = 0; page < host_pages; ++page) {
    for (int32_t h = 0; h < kHkv; ++h) all.push_back({page, h, 0});
  }
  std::shuffle(all.begin(), all.end(), std::mt19937(6));
  for (size_t i = 0; i < all.size(); ++i) all[i].dst_slot = static_cast<int32_t>(i % slots);
  RecallArgs a;
  a.shape = kShape;
  a.host_pages = host.data();
  a.num_host_pages = host_pages;
  a.num_items = n;
  a.kv.k_cache = k.data();
  a.kv.v_cache = v.data();
  a.kv.num_slots = slots;
  size_t next = 0;  // the plan's first item in `all`
  for (auto _ : state) {
    if (next + static_cast<size_t>(n) > all.size()) next = 0;
    a.items = all.data() + next;
    next += static_cast<size_t>(n);
    benchmark::DoNotOptimize(CpuRecall(a, &Pool()));
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * n * 2 * kP * kD * 2);
  state.SetLabel(CacheLabel((host.size() + 2 * k.size()) * sizeof(Half)));
}
BENCHMARK(BM_Recall)->Arg(64)->Arg(256)->UseRealTime();

void BM_Offload(benchmark::State& state) {
  const auto n = static_cast<int32_t>(state.range(0));
  auto k = RandomHalves(static_cast<size_t>(n) * kP * kHkv * kD, 7);
  auto v = RandomHalves(k.size(), 8);
  std::vector<Half> host(k.size() * 2), sums(static_cast<size_t>(n) * kHkv * 2 * kD);
  std::vector<OffloadItem> items;
  for (int32_t i = 0; i < n; ++i) items.push_back({i, i, i});
  OffloadArgs a;
  a.shape = kShape;
  a.k_src = k.data();
  a.v_src = v.data();
  a.num_src_slots = n;
  a.host_pages = host.data();
  a.num_host_pages = n;
  a.summaries = sums.data();
  a.num_summary_pages = n;
  a.items = items.data();
  a.num_items = n;
  for (auto _ : state) benchmark::DoNotOptimize(CpuOffload(a, &Pool()));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * k.size() * 2 * 2));
}
BENCHMARK(BM_Offload)->Arg(1)->Arg(32)->UseRealTime();

// Sparse attention over a working set of range(0) slots, every slot live for every head.
void BM_SparseAttention(benchmark::State& state) {
  const auto slots = static_cast<int32_t>(state.range(0));
  auto q = RandomHalves(kHq * kD, 9);
  auto k = RandomHalves(static_cast<size_t>(slots) * kP * kHkv * kD, 10);
  auto v = RandomHalves(k.size(), 11);
  std::vector<int32_t> table(static_cast<size_t>(kHkv) * slots);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(i % static_cast<size_t>(slots));
  const int32_t no_partial = -1, zero = 0;
  std::vector<Half> out(kHq * kD);
  SparseAttentionArgs a;
  a.batch = 1;
  a.shape = kShape;
  a.kv.num_slots = slots;
  a.q = q.data();
  a.kv.k_cache = k.data();
  a.kv.v_cache = v.data();
  a.kv.slot_table = table.data();
  a.kv.partial_page = &no_partial;
  a.kv.partial_len = &zero;
  a.softmax_scale = 1.0f / std::sqrt(float{kD});
  a.out = out.data();
  for (auto _ : state) benchmark::DoNotOptimize(CpuSparseAttention(a, &Pool()));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * k.size() * 2 * 2));
}
BENCHMARK(BM_SparseAttention)->Arg(64)->Arg(128)->UseRealTime();

void BM_DenseAttention(benchmark::State& state) {
  const auto tokens = static_cast<int32_t>(state.range(0));
  auto q = RandomHalves(kHq * kD, 12);
  auto k = RandomHalves(static_cast<size_t>(tokens) * kHkv * kD, 13);
  auto v = RandomHalves(k.size(), 14);
  std::vector<Half> out(kHq * kD);
  DenseAttentionArgs a;
  a.batch = 1;
  a.shape = kShape;
  a.max_tokens = tokens;
  a.q = q.data();
  a.k = k.data();
  a.v = v.data();
  a.seq_len = &tokens;
  a.softmax_scale = 1.0f / std::sqrt(float{kD});
  a.out = out.data();
  for (auto _ : state) benchmark::DoNotOptimize(CpuDenseAttention(a, &Pool()));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * k.size() * 2 * 2));
}
BENCHMARK(BM_DenseAttention)->Arg(2048)->Arg(32768)->UseRealTime();

}  // namespace
}  // namespace kvtier

BENCHMARK_MAIN();
