#include "bench/tier_decode.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "bench/synthetic_kv.h"
#include "core/status.h"
#include "daemon/cold_store.h"
#include "daemon/page_mover.h"
#include "kernels/cpu/cpu_backend.h"
#include "offload/cold_pages.h"
#include "offload/host_tier.h"
#include "offload/page_pool.h"
#include "offload/retriever.h"

namespace kvtier::bench {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

constexpr char kTenant[] = "bench";

// The demoting sequence's cold pages: kvtierd's PageMover (daemon/page_mover.h) over a
// ColdStore of the bench's tenant, timed.
class TimedColdPages final : public ColdPages {
 public:
  explicit TimedColdPages(ColdPages& inner) : inner_(inner) {}
  absl::Status PutBatch(std::span<const StoredPage> pages,
                        std::span<const std::span<const uint8_t>> bytes) override {
    const auto start = Clock::now();
    absl::Status st = inner_.PutBatch(pages, bytes);
    seconds += SecondsSince(start);
    return st;
  }
  absl::Status GetBatch(std::span<const Read> reads) override {
    const auto start = Clock::now();
    absl::Status st = inner_.GetBatch(reads);
    seconds += SecondsSince(start);
    return st;
  }
  double seconds = 0;  // in PutBatch and GetBatch

 private:
  ColdPages& inner_;
};

class ColdHostTier final : public HostTier {
 public:
  ColdHostTier(PagePool& pool, ColdPages* cold) : pool_(pool), cold_(cold) {}
  PagePool& pool() override { return pool_; }
  absl::Status Commit(std::span<const StoredPage>) override { return absl::OkStatus(); }
  ColdPages* cold() override { return cold_; }

 private:
  PagePool& pool_;
  ColdPages* const cold_;
};

// Page-aligned host memory for a pool of `pages` slots.
struct HostPages {
  HostPages(size_t page_bytes, int64_t pages)
      : bytes(page_bytes * static_cast<size_t>(pages)),
        mem(static_cast<uint8_t*>(std::aligned_alloc(PagePool::kSlotAlignment, bytes))) {}
  ~HostPages() {
    pool.reset();
    std::free(mem);
  }
  size_t bytes;
  uint8_t* mem;
  std::unique_ptr<PagePool> pool;
};

Geometry DecodeGeometry(int32_t layers) {
  Geometry g;
  g.num_layers = layers;
  g.num_q_heads = 8;
  g.num_kv_heads = 2;
  g.head_dim = 64;
  g.page_size = 32;
  g.dtype = DType::kF16;
  return g;
}

}  // namespace

namespace {

// The sequences' options, or INVALID_ARGUMENT naming the flag.
absl::StatusOr<SequenceOptions> DecodeSequenceOptions(const TierDecodeOptions& o) {
  const Geometry g = DecodeGeometry(o.layers);
  const int32_t p = g.page_size;
  if (o.layers < 1 || o.layers > 64 || o.prefill < p || o.steps < 1 || o.budget_tokens < 4 * p ||
      !(o.drift >= 0 && o.drift <= 1)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--decode-layers in [1, 64], --decode-prefill >= %d, --decode-steps >= 1, "
        "--decode-budget >= %d and --decode-drift in [0, 1]",
        p, 4 * p));
  }
  SequenceOptions so;
  so.mode = RetrievalMode::kSpeculative;
  so.recall = RecallStrategy::kBatchedDma;
  so.max_tokens = o.prefill + o.steps;
  so.policy.residency = "h2o";
  if (absl::Status st = so.SetBudgetTokens(o.budget_tokens, p); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--decode-budget: ", st.message()));
  }
  const int64_t floor = DemoteFloorPages(g, so);
  if (int64_t{o.host_pages} * o.layers < floor) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--decode-host-pages = %d: with host_drop = demote the host tier needs at least %d "
        "pages over the %d layers (%d per layer)",
        o.host_pages, floor, o.layers, (floor + o.layers - 1) / o.layers));
  }
  return so;
}

}  // namespace

absl::Status CheckTierDecode(const TierDecodeOptions& o) {
  return DecodeSequenceOptions(o).status();
}

absl::StatusOr<TierDecodeResult> RunTierDecode(daemon::RedisCluster* cluster,
                                               daemon::ColdTier* cold, const std::string& prefix,
                                               const std::string& session,
                                               const TierDecodeOptions& o, std::ostream& log) {
  const Geometry g = DecodeGeometry(o.layers);
  const int32_t p = g.page_size;
  KVTIER_ASSIGN_OR_RETURN(const SequenceOptions so, DecodeSequenceOptions(o));
  const int32_t total_pages = (o.prefill + o.steps + p - 1) / p;
  SequenceOptions demote = so;
  demote.policy.host_drop = "demote";

  std::unique_ptr<Backend> backend = NewCpuBackend(2);
  const size_t page_bytes = g.host_page_bytes();
  HostPages all(page_bytes, int64_t{total_pages} * o.layers);
  HostPages small(page_bytes, int64_t{o.host_pages} * o.layers);
  KVTIER_ASSIGN_OR_RETURN(all.pool,
                          PagePool::Create(all.mem, page_bytes, int64_t{total_pages} * o.layers));
  KVTIER_ASSIGN_OR_RETURN(small.pool,
                          PagePool::Create(small.mem, page_bytes, int64_t{o.host_pages} * o.layers));
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Retriever> ref,
                          Retriever::Create(g, so, *backend, all.pool.get()));
  // A quota that never binds and no WAIT: what the section measures is the step's cost.
  daemon::ColdStore store(cluster, cold, prefix,
                          daemon::ColdStoreOptions{kTenant, uint64_t{1} << 50, 0,
                                                   absl::Seconds(2)});
  daemon::PageMover mover(&store, daemon::PageMoverOptions{daemon::PageMover::LiveKeys(session),
                                                           page_bytes, absl::Seconds(60), true});
  TimedColdPages cold_pages(mover);
  KVTIER_ASSIGN_OR_RETURN(
      std::unique_ptr<Retriever> dem,
      Retriever::Create(g, demote, *backend,
                        std::make_unique<ColdHostTier>(*small.pool, &cold_pages)));

  // The trace: planted K/V per layer, and per step a query drifting from the planted one.
  SyntheticKvOptions kvo;
  kvo.tokens = o.prefill + o.steps;
  std::vector<SyntheticKv> kv;
  for (int32_t l = 0; l < o.layers; ++l) {
    kvo.seed = 11 + static_cast<uint64_t>(l) * 7919;
    kv.push_back(MakeSyntheticKv(g, kvo));
  }
  const size_t token_bytes = static_cast<size_t>(g.num_kv_heads) * g.head_dim * g.element_bytes();
  const size_t q_elems = static_cast<size_t>(g.num_q_heads) * g.head_dim;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  const auto query = [&](int32_t l) {
    std::vector<uint8_t> q(q_elems * g.element_bytes());
    for (size_t i = 0; i < q_elems; ++i) {
      const float planted = LoadAsFloat(kv[l].q, g.dtype, static_cast<int64_t>(i));
      StoreElement(q, g.dtype, static_cast<int64_t>(i),
                   (1 - o.drift) * planted + o.drift * noise(rng) * 0.3f);
    }
    return q;
  };

  // Prefill, each timed whole.
  double prefill_s[2] = {0, 0};
  Retriever* seqs[2] = {ref.get(), dem.get()};
  for (int k = 0; k < 2; ++k) {
    const auto start = Clock::now();
    for (int32_t l = 0; l < o.layers; ++l) {
      KVTIER_RETURN_IF_ERROR(seqs[k]->Append(l, kv[l].k.data(), kv[l].v.data(), o.prefill));
    }
    KVTIER_RETURN_IF_ERROR(seqs[k]->Wait());
    prefill_s[k] = SecondsSince(start);
  }
  const double prefill_cold_s = cold_pages.seconds;

  std::vector<double> step_s[2];
  int64_t mismatches = 0;
  std::vector<uint8_t> out[2];
  for (auto& v : out) v.resize(q_elems * g.element_bytes() * static_cast<size_t>(o.layers));
  for (int32_t step = 0; step < o.steps; ++step) {
    std::vector<std::vector<uint8_t>> qs;
    for (int32_t l = 0; l < o.layers; ++l) qs.push_back(query(l));
    const size_t at = static_cast<size_t>(o.prefill + step) * token_bytes;
    for (int turn = 0; turn < 2; ++turn) {
      const int k = (step + turn) % 2;  // alternate which runs first
      Retriever& r = *seqs[k];
      const auto start = Clock::now();
      for (int32_t l = 0; l < o.layers; ++l) {
        KVTIER_RETURN_IF_ERROR(r.Append(l, kv[l].k.data() + at, kv[l].v.data() + at, 1));
        KVTIER_RETURN_IF_ERROR(r.BeginStep(l, qs[l].data()).status());
        KVTIER_RETURN_IF_ERROR(r.Attend(l, qs[l].data(),
                                        out[k].data() + l * q_elems * g.element_bytes(), nullptr));
        KVTIER_RETURN_IF_ERROR(r.EndStep(l, qs[l].data()));
      }
      KVTIER_RETURN_IF_ERROR(r.Wait());
      step_s[k].push_back(SecondsSince(start));
    }
    mismatches += out[0] != out[1];
  }
  const SequenceStats st = dem->Stats();
  const double cold_s = cold_pages.seconds;
  dem.reset();
  KVTIER_RETURN_IF_ERROR(mover.RemoveAll());

  const double p50[2] = {Quantile(step_s[0], 0.5) * 1e3, Quantile(step_s[1], 0.5) * 1e3};
  const double p99[2] = {Quantile(step_s[0], 0.99) * 1e3, Quantile(step_s[1], 0.99) * 1e3};
  double sum_s[2] = {0, 0};
  for (int k = 0; k < 2; ++k) {
    for (double s : step_s[k]) sum_s[k] += s;
  }
  log << absl::StreamFormat(
      "decode with host_drop = demote (%d layers, %d + %d tokens, %d of %d pages per layer in "
      "the host tier; speculative, batched_dma, h2o; cpu backend, 2 threads):\n"
      "  prefill        unbounded %8.1f ms   demote %8.1f ms (cold tier %.1f ms)\n"
      "  step p50       unbounded %8.3f ms   demote %8.3f ms   ratio %.2f\n"
      "  step p99       unbounded %8.3f ms   demote %8.3f ms\n"
      "  per step: %.2f pages promoted; over the run %d demoted, %d written, %d promoted; "
      "cold tier %.1f%% of the demoting sequence's step time\n"
      "  outputs bit-identical: %s (%d of %d steps differ)\n",
      o.layers, o.prefill, o.steps, o.host_pages, total_pages, prefill_s[0] * 1e3,
      prefill_s[1] * 1e3, prefill_cold_s * 1e3, p50[0], p50[1], p50[0] > 0 ? p50[1] / p50[0] : 0,
      p99[0], p99[1], static_cast<double>(st.host_promoted_pages) / o.steps,
      st.host_demoted_pages, st.cold_written_pages, st.host_promoted_pages,
      sum_s[1] > 0 ? 100 * (cold_s - prefill_cold_s) / sum_s[1] : 0,
      mismatches == 0 ? "yes" : "NO", mismatches, o.steps);

  JsonObject j;
  j.Add("layers", o.layers)
      .Add("prefill_tokens", o.prefill)
      .Add("steps", o.steps)
      .Add("host_pages_per_layer", o.host_pages)
      .Add("pages_per_layer", total_pages)
      .Add("page_bytes", static_cast<int64_t>(page_bytes))
      .Add("budget_tokens", o.budget_tokens)
      .Add("drift", static_cast<double>(o.drift))
      .Add("prefill_ms_unbounded", prefill_s[0] * 1e3)
      .Add("prefill_ms_demote", prefill_s[1] * 1e3)
      .Add("step_ms_p50_unbounded", p50[0])
      .Add("step_ms_p50_demote", p50[1])
      .Add("step_ms_p99_unbounded", p99[0])
      .Add("step_ms_p99_demote", p99[1])
      .Add("step_p50_demote_over_unbounded", p50[0] > 0 ? p50[1] / p50[0] : 0.0)
      .Add("demoted_pages", st.host_demoted_pages)
      .Add("written_pages", st.cold_written_pages)
      .Add("promoted_pages", st.host_promoted_pages)
      .Add("cold_seconds_steps", cold_s - prefill_cold_s)
      .Add("mismatched_steps", mismatches)
      .Add("statistic",
           "per step: wall time of one token's Append and step of every layer, then Wait; the "
           "two sequences alternate which runs first");
  return TierDecodeResult{std::move(j), mismatches};
}

}  // namespace kvtier::bench
