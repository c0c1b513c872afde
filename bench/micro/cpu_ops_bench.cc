// Google Benchmark micro-benchmarks of the CPU backend's ops at decode-time sizes
// (Llama-3.1-8B layer: 32 query heads, 8 KV heads, d = 128, p = 32, fp16). Each reports
// bytes processed so runs compare against memory bandwidth; BM_Memcpy is the baseline.
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kvtier/layout.h"

namespace kvtier {
namespace {

constexpr int32_t kHq = 32, kHkv = 8, kD = 128, kP = 32;
constexpr KvShape kShape{DType::kF16, kHq, kHkv, kD, kP};

ThreadPool& Pool() {
  static ThreadPool* pool = new ThreadPool(0);
  return *pool;
}

std::vector<Half> RandomHalves(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  std::vector<Half> v(n);
  for (auto& x : v) x = FloatToHalf(dist(rng));
  return v;
}

void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<char> a(bytes, 1), b(bytes);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}
BENCHMARK(BM_Memcpy)->Arg(8 << 20)->Arg(64 << 20);

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

// Recall of `range(0)` head-pages (16 KiB slabs) scattered over a 4096-page host tier.
void BM_Recall(benchmark::State& state) {
  const auto n = static_cast<int32_t>(state.range(0));
  const int32_t host_pages = 4096, slots = 64;
  std::vector<Half> host(static_cast<size_t>(host_pages) * kHkv * 2 * kP * kD);
  std::vector<Half> k(static_cast<size_t>(slots) * kP * kHkv * kD), v(k.size());
  std::mt19937 rng(6);
  std::vector<RecallItem> items;
  for (int32_t i = 0; i < n; ++i) {
    items.push_back({static_cast<int64_t>(rng() % host_pages), i % kHkv, (i / kHkv) % slots});
  }
  RecallArgs a;
  a.shape = kShape;
  a.host_pages = host.data();
  a.num_host_pages = host_pages;
  a.items = items.data();
  a.num_items = n;
  a.kv.k_cache = k.data();
  a.kv.v_cache = v.data();
  a.kv.num_slots = slots;
  for (auto _ : state) benchmark::DoNotOptimize(CpuRecall(a, &Pool()));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * n * 2 * kP * kD * 2);
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
