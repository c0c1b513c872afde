#include "bench/pcie_bench.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/plot.h"
#include "core/status.h"
#include "offload/host_arena.h"
#include "offload/numa_topology.h"
#include "offload/recall_strategy.h"

namespace kvtier::bench {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int32_t kMaxCopiesPerSample = 1024;
constexpr int64_t kNumaCopyBytes = 64 * kMiB;
constexpr int32_t kReferenceBudget = 2048;  // tokens: the headline recall point
constexpr double kGB = 1e9;

double Gbps(double bytes, double seconds) { return seconds > 0 ? bytes / seconds / kGB : 0; }

// The bandwidths of `bytes` moved in each of the times `s` summarises (seconds): the
// slowest time is the lowest bandwidth, so the percentiles swap.
Spread GbpsOf(double bytes, const Spread& s) {
  Spread g;
  g.median = Gbps(bytes, s.median);
  g.p10 = Gbps(bytes, s.p90);
  g.p90 = Gbps(bytes, s.p10);
  g.min = Gbps(bytes, s.max);
  g.max = Gbps(bytes, s.min);
  g.n = s.n;
  return g;
}

// Adds `key` (the median) and key_p10 / key_p90 to `j`.
void AddGbps(JsonObject& j, const std::string& key, const Spread& g) {
  j.Add(key, g.median).Add(key + "_p10", g.p10).Add(key + "_p90", g.p90);
}

std::string Bytes(int64_t b) {
  if (b >= kMiB && b % kMiB == 0) return absl::StrCat(b / kMiB, " MiB");
  if (b >= 1024 && b % 1024 == 0) return absl::StrCat(b / 1024, " KiB");
  return absl::StrCat(b, " B");
}

// "13.0" out of "..., driver 13.0, runtime 13.0" (the cuda backend's Describe()); "n/a".
std::string VersionAfter(const std::string& describe, std::string_view key) {
  size_t pos = describe.find(key);
  if (pos == std::string::npos) return "n/a";
  pos += key.size();
  const size_t end = describe.find_first_of(", ", pos);
  return describe.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
}

// Host memory for the copy sweep: page-aligned and registered with the backend (pinned), or
// plain malloc'd (pageable). Touched once so no page fault lands in a timed copy.
class HostBuffer {
 public:
  static absl::StatusOr<std::unique_ptr<HostBuffer>> Create(Backend& backend, size_t bytes,
                                                            bool pinned) {
    auto b = std::unique_ptr<HostBuffer>(new HostBuffer(backend));
    if (pinned) {
      const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
      b->data_ = std::aligned_alloc(page, (bytes + page - 1) / page * page);
    } else {
      b->data_ = std::malloc(bytes);
    }
    if (b->data_ == nullptr) {
      return absl::ResourceExhaustedError(absl::StrFormat("allocating %d host bytes", bytes));
    }
    std::memset(b->data_, 0x5a, bytes);
    if (pinned) {
      KVTIER_RETURN_IF_ERROR(backend.RegisterHost(b->data_, bytes));
      b->registered_ = true;
    }
    return b;
  }
  ~HostBuffer() {
    if (registered_) backend_.UnregisterHost(data_).IgnoreError();
    std::free(data_);
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  char* data() const { return static_cast<char*>(data_); }

 private:
  explicit HostBuffer(Backend& backend) : backend_(backend) {}
  Backend& backend_;
  void* data_ = nullptr;
  bool registered_ = false;
};

struct CopyRow {
  int64_t bytes = 0;
  int32_t copies_per_sample = 0;
  double pinned_h2d = 0, pinned_d2h = 0, pageable_h2d = 0, pageable_d2h = 0;  // GB/s, medians
  Spread pinned_h2d_spread, pinned_d2h_spread, pageable_h2d_spread, pageable_d2h_spread;
};

struct RecallRow {
  int32_t budget = 0;                          // tokens per KV head
  int32_t churn = 0;                           // percent
  int32_t items = 0;                           // slabs per plan
  int64_t bytes = 0;                           // recalled bytes per plan
  static constexpr size_t kStrategies = kRecallStrategies.size();
  std::array<double, kStrategies> seconds{};   // per kRecallStrategies entry (median)
  std::array<Spread, kStrategies> spread;      // per kRecallStrategies entry, seconds
  std::array<int64_t, kStrategies> ranges{};   // copy ranges the DMA strategy issued
  std::vector<std::vector<RecallItem>> plans;  // 1 warm-up + iters
};

class PcieBench {
 public:
  PcieBench(const PcieBenchOptions& o, std::ostream& log) : o_(o), log_(log) {}
  absl::StatusOr<JsonObject> Run();

 private:
  absl::Status Setup();
  absl::Status CopySweep();
  absl::Status MakePlans();
  absl::Status NhdVsHnd();
  absl::Status Recall();
  absl::Status Numa();
  absl::Status Plot() const;
  JsonObject Report() const;

  // Seconds of `iters` runs of (enqueue(i); synchronize drive), after one warm-up run
  // (i = 0; timed runs get i = 1..iters): their median and spread. `before(i)` runs untimed
  // before each.
  absl::StatusOr<Spread> Time(const std::function<absl::Status(int)>& enqueue,
                              const std::function<void(int)>& before = nullptr);
  absl::StatusOr<std::unique_ptr<HostArena>> MakeArena(size_t bytes, int node) const;
  // Recall of the reference plans with recaller `s` from `host_pages`; seconds.
  absl::StatusOr<Spread> TimeRecall(size_t s, const RecallRow& row, const void* host_pages,
                                    int64_t* ranges);
  std::vector<RecallItem> MakePlan(int32_t per_head, std::mt19937_64& rng) const;
  const RecallRow& Reference() const { return recall_[reference_]; }
  // `gbps` over the peak pinned H2D bandwidth: a GPU backend's PCIe peak. On the cpu backend
  // the "peak" is the best memcpy of the sweep, cache-resident at its smaller sizes, so no
  // fraction of it means anything: NaN (null in the JSON, "n/a" in the log).
  double Fraction(double gbps) const { return gpu() && peak_h2d_ > 0 ? gbps / peak_h2d_ : NAN; }
  std::string FractionText(double gbps) const {
    return gpu() ? absl::StrFormat("%4.2f", Fraction(gbps)) : std::string(" n/a");
  }
  bool gpu() const { return backend_->kind() != DeviceKind::kCpu; }
  size_t slab_bytes() const { return static_cast<size_t>(g_.slab_elements()) * g_.element_bytes(); }
  size_t fragment_bytes() const { return static_cast<size_t>(g_.head_dim) * g_.element_bytes(); }

  const PcieBenchOptions o_;
  std::ostream& log_;
  // Destroyed last: everything below frees through it.
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Stream> drive_, xform_;
  Geometry g_;
  int64_t host_pages_ = 0;
  int32_t num_slots_ = 0;            // working-set slots: the largest budget's pages per head
  std::unique_ptr<HostArena> area_;  // the host tier's HND pages, registered
  DeviceBuffer k_cache_, v_cache_;
  std::vector<std::unique_ptr<SlabRecaller>> recallers_;  // per kRecallStrategies entry

  std::vector<CopyRow> copies_;
  double peak_h2d_ = 0;
  int64_t peak_h2d_bytes_ = 0;
  std::vector<RecallRow> recall_;
  size_t reference_ = 0;
  size_t best_ = 0;  // kRecallStrategies index, fastest at the reference point
  JsonObject nhd_json_, numa_json_;
  struct {
    double hnd = 0, nhd = 0, nhd_batch = 0;
    int64_t bytes = 0;
  } nhd_;
  double seconds_ = 0;
};

absl::StatusOr<Spread> PcieBench::Time(const std::function<absl::Status(int)>& enqueue,
                                       const std::function<void(int)>& before) {
  std::vector<double> samples;
  for (int i = 0; i <= o_.iters; ++i) {
    if (before) before(i);
    const auto t0 = std::chrono::steady_clock::now();
    KVTIER_RETURN_IF_ERROR(enqueue(i));
    KVTIER_RETURN_IF_ERROR(drive_->Synchronize());
    const auto t1 = std::chrono::steady_clock::now();
    if (i > 0) samples.push_back(std::chrono::duration<double>(t1 - t0).count());
  }
  return SpreadOf(std::move(samples));
}

absl::StatusOr<std::unique_ptr<HostArena>> PcieBench::MakeArena(size_t bytes, int node) const {
  ArenaOptions ao;
  ao.bytes = bytes;
  ao.name = node >= 0 ? absl::StrCat("kvtier-pcie-node", node) : "kvtier-pcie";
  ao.hugepages = HugePages::kAuto;
  ao.numa_node = node;
  ao.lock = false;  // RegisterHost pins it
  KVTIER_ASSIGN_OR_RETURN(auto arena, HostArena::Create(ao));
  KVTIER_RETURN_IF_ERROR(arena->RegisterWith(*backend_));
  return arena;
}

absl::Status PcieBench::Setup() {
  auto bad = [](std::string m) { return absl::InvalidArgumentError(std::move(m)); };
  if (o_.iters < 1 || o_.iters > 10000) return bad("--iters must be in [1, 10000]");
  if (o_.min_bytes < 1 || o_.max_bytes < o_.min_bytes || o_.max_bytes > (int64_t{1} << 30)) {
    return bad(absl::StrFormat("--min-bytes %d / --max-bytes %d: need 1 <= min <= max <= 1 GiB",
                               o_.min_bytes, o_.max_bytes));
  }
  if (o_.sample_bytes < 1) return bad("--sample-bytes must be positive");
  if (o_.chunk_items < 1 || o_.chunk_items > 65536)
    return bad("--chunk-items must be in [1, 65536]");
  if (o_.budgets.empty() || o_.churn_percent.empty())
    return bad("--budgets and --churn must be non-empty");
  if (!o_.numa_nodes.empty() && o_.numa_nodes.size() != 2)
    return bad("--numa-nodes takes LOCAL,REMOTE");
  g_ = o_.geometry;
  g_.num_layers = 1;
  g_.num_q_heads = g_.num_kv_heads;
  KVTIER_RETURN_IF_ERROR(g_.Validate());
  int32_t max_pages = 0;
  for (int32_t b : o_.budgets) {
    if (b < g_.page_size || b % g_.page_size != 0 || b > (1 << 24)) {
      return bad(
          absl::StrFormat("--budgets: %d tokens must be a positive multiple of the page "
                          "size %d (at most 2^24)",
                          b, g_.page_size));
    }
    max_pages = std::max(max_pages, b / g_.page_size);
  }
  for (int32_t c : o_.churn_percent) {
    if (c < 1 || c > 100) return bad(absl::StrFormat("--churn: %d%% must be in [1, 100]", c));
  }

  KVTIER_ASSIGN_OR_RETURN(backend_,
                          CreateBackend(o_.backend, DeviceOptions{.cpu_threads = o_.threads,
                                                                  .cuda_device = o_.cuda_device}));
  KVTIER_ASSIGN_OR_RETURN(drive_, backend_->CreateStream());
  KVTIER_ASSIGN_OR_RETURN(xform_, backend_->CreateStream());
  host_pages_ = o_.host_pages > 0                       ? o_.host_pages
                : backend_->kind() == DeviceKind::kCuda ? 4096
                                                        : 1024;
  if (host_pages_ < max_pages) {
    return bad(
        absl::StrFormat("--host-pages %d: need at least %d (the largest budget's pages "
                        "per head, drawn distinct per head)",
                        host_pages_, max_pages));
  }
  num_slots_ = max_pages;
  const size_t area_bytes = static_cast<size_t>(host_pages_) * g_.host_page_bytes();
  if (area_bytes > HostArena::kMaxBytes) return bad("--host-pages: host area too large");
  KVTIER_ASSIGN_OR_RETURN(area_, MakeArena(area_bytes, -1));
  const size_t ws_bytes = static_cast<size_t>(num_slots_) * g_.page_size * g_.num_kv_heads *
                          g_.head_dim * g_.element_bytes();
  KVTIER_ASSIGN_OR_RETURN(k_cache_, backend_->Allocate(ws_bytes));
  KVTIER_ASSIGN_OR_RETURN(v_cache_, backend_->Allocate(ws_bytes));
  return absl::OkStatus();
}

absl::Status PcieBench::CopySweep() {
  std::vector<int64_t> sizes;
  for (int64_t s = o_.min_bytes; s <= o_.max_bytes; s *= 4) sizes.push_back(s);
  if (sizes.back() != o_.max_bytes) sizes.push_back(o_.max_bytes);
  const size_t max_bytes = static_cast<size_t>(o_.max_bytes);
  KVTIER_ASSIGN_OR_RETURN(auto pinned, HostBuffer::Create(*backend_, max_bytes, true));
  KVTIER_ASSIGN_OR_RETURN(auto pageable, HostBuffer::Create(*backend_, max_bytes, false));
  KVTIER_ASSIGN_OR_RETURN(DeviceBuffer dev, backend_->Allocate(max_bytes));
  KVTIER_RETURN_IF_ERROR(backend_->Memset(*drive_, dev.data(), 0x3c, max_bytes));
  KVTIER_RETURN_IF_ERROR(drive_->Synchronize());

  log_ << absl::StrFormat(
      "\n[1] host<->device copies (median of %d, p10/p90 in the JSON; GB/s, and / peak pinned "
      "H2D%s)\n",
      o_.iters, gpu() ? "" : ": n/a on the cpu backend");
  for (int64_t size : sizes) {
    CopyRow r;
    r.bytes = size;
    r.copies_per_sample =
        static_cast<int32_t>(std::clamp<int64_t>(o_.sample_bytes / size, 1, kMaxCopiesPerSample));
    // Consecutive copies of a sample walk through the buffer (wrapping), so a small size is
    // not one cache-hot line copied over and over.
    const int64_t slots = std::max<int64_t>(1, o_.max_bytes / size);
    auto run = [&](char* host, bool h2d, Spread* spread) -> absl::StatusOr<double> {
      KVTIER_ASSIGN_OR_RETURN(
          const Spread s, Time([&](int) -> absl::Status {
            for (int32_t c = 0; c < r.copies_per_sample; ++c) {
              const int64_t off = (c % slots) * size;
              char* d = dev.as<char>() + off;
              char* h = host + off;
              KVTIER_RETURN_IF_ERROR(
                  h2d ? backend_->Copy(*drive_, d, h, static_cast<size_t>(size))
                      : backend_->Copy(*drive_, h, d, static_cast<size_t>(size)));
            }
            return absl::OkStatus();
          }));
      *spread = GbpsOf(static_cast<double>(size) * r.copies_per_sample, s);
      return spread->median;
    };
    KVTIER_ASSIGN_OR_RETURN(r.pinned_h2d, run(pinned->data(), true, &r.pinned_h2d_spread));
    KVTIER_ASSIGN_OR_RETURN(r.pinned_d2h, run(pinned->data(), false, &r.pinned_d2h_spread));
    KVTIER_ASSIGN_OR_RETURN(r.pageable_h2d, run(pageable->data(), true, &r.pageable_h2d_spread));
    KVTIER_ASSIGN_OR_RETURN(r.pageable_d2h, run(pageable->data(), false, &r.pageable_d2h_spread));
    copies_.push_back(r);
  }
  // Peak: the best pinned H2D among the large sizes (>= 1 MiB, or the largest size run).
  const int64_t large = std::min<int64_t>(kMiB, sizes.back());
  for (const CopyRow& r : copies_) {
    if (r.bytes >= large && r.pinned_h2d > peak_h2d_) {
      peak_h2d_ = r.pinned_h2d;
      peak_h2d_bytes_ = r.bytes;
    }
  }
  log_ << absl::StrFormat("  %10s %6s | %-15s %-15s | %-15s %-15s | %s\n", "size", "copies",
                          "pinned H2D", "pinned D2H", "pageable H2D", "pageable D2H",
                          "pinned/pageable H2D");
  auto cell = [&](double v) { return absl::StrFormat("%7.2f (%s)", v, FractionText(v)); };
  for (const CopyRow& r : copies_) {
    log_ << absl::StrFormat("  %10s %6d | %-15s %-15s | %-15s %-15s | %.2fx\n", Bytes(r.bytes),
                            r.copies_per_sample, cell(r.pinned_h2d), cell(r.pinned_d2h),
                            cell(r.pageable_h2d), cell(r.pageable_d2h),
                            r.pageable_h2d > 0 ? r.pinned_h2d / r.pageable_h2d : 0.0);
  }
  if (gpu()) {
    log_ << absl::StrFormat("  peak pinned H2D: %.2f GB/s (at %s)\n", peak_h2d_,
                            Bytes(peak_h2d_bytes_));
  } else {
    log_ << absl::StrFormat(
        "  best memcpy of %s or more: %.2f GB/s (at %s); not a PCIe or DRAM peak (the smaller "
        "sizes stay in cache), so no fraction of it is reported on the cpu backend\n",
        Bytes(std::min<int64_t>(kMiB, sizes.back())), peak_h2d_, Bytes(peak_h2d_bytes_));
  }
  log_.flush();
  return absl::OkStatus();
}

// Random distinct (page, head) host slabs into distinct (slot, head) working-set places,
// `per_head` per KV head, in random order (as a top-k selection hands them over).
std::vector<RecallItem> PcieBench::MakePlan(int32_t per_head, std::mt19937_64& rng) const {
  std::vector<RecallItem> plan;
  plan.reserve(static_cast<size_t>(per_head) * g_.num_kv_heads);
  std::vector<int64_t> pages(static_cast<size_t>(host_pages_));
  std::vector<int32_t> slots(static_cast<size_t>(num_slots_));
  for (int32_t h = 0; h < g_.num_kv_heads; ++h) {
    std::iota(pages.begin(), pages.end(), int64_t{0});
    std::iota(slots.begin(), slots.end(), 0);
    for (int32_t i = 0; i < per_head; ++i) {  // partial Fisher–Yates on both
      const size_t ui = static_cast<size_t>(i);
      std::swap(pages[ui], pages[ui + rng() % (pages.size() - ui)]);
      std::swap(slots[ui], slots[ui + rng() % (slots.size() - ui)]);
      plan.push_back(RecallItem{pages[ui], h, slots[ui]});
    }
  }
  std::shuffle(plan.begin(), plan.end(), rng);
  return plan;
}

absl::StatusOr<Spread> PcieBench::TimeRecall(size_t s, const RecallRow& row, const void* host_pages,
                                             int64_t* ranges) {
  SlabRecaller& rec = *recallers_[s];
  RecallTarget t;
  t.host_pages = host_pages;
  t.num_host_pages = host_pages_;
  t.k_cache = k_cache_.data();
  t.v_cache = v_cache_.data();
  t.num_slots = num_slots_;
  return Time(
      [&](int) -> absl::Status {
        KVTIER_ASSIGN_OR_RETURN(const int64_t n, rec.Enqueue(*drive_, *xform_, row.items, t));
        if (ranges != nullptr) *ranges = n;
        return absl::OkStatus();
      },
      [&](int i) {
        const auto& plan = row.plans[static_cast<size_t>(i) % row.plans.size()];
        std::copy(plan.begin(), plan.end(), rec.plan());
      });
}

// The recall plans of every budget × churn (one per timed sample, and one for the warm-up),
// the reference point and one SlabRecaller per strategy.
absl::Status PcieBench::MakePlans() {
  std::mt19937_64 rng(o_.seed);
  int32_t max_items = 0;
  for (int32_t b : o_.budgets) {
    for (int32_t c : o_.churn_percent) {
      RecallRow r;
      r.budget = b;
      r.churn = c;
      const int32_t pages = b / g_.page_size;
      const int32_t per_head =
          std::clamp(static_cast<int32_t>(std::lround(pages * c / 100.0)), 1, pages);
      r.items = per_head * g_.num_kv_heads;
      r.bytes = static_cast<int64_t>(r.items) * static_cast<int64_t>(slab_bytes());
      for (int i = 0; i <= o_.iters; ++i) r.plans.push_back(MakePlan(per_head, rng));
      max_items = std::max(max_items, r.items);
      recall_.push_back(std::move(r));
    }
  }
  // The reference point: the budget nearest 2048 tokens at the highest churn.
  const int32_t max_churn = *std::max_element(o_.churn_percent.begin(), o_.churn_percent.end());
  int64_t best_distance = -1;
  for (size_t i = 0; i < recall_.size(); ++i) {
    if (recall_[i].churn != max_churn) continue;
    const int64_t d = std::abs(int64_t{recall_[i].budget} - kReferenceBudget);
    if (best_distance < 0 || d < best_distance) {
      best_distance = d;
      reference_ = i;
    }
  }
  for (RecallStrategy s : kRecallStrategies) {
    KVTIER_ASSIGN_OR_RETURN(auto rec,
                            SlabRecaller::Create(*backend_, g_, s, max_items, o_.chunk_items));
    recallers_.push_back(std::move(rec));
  }
  return absl::OkStatus();
}

absl::Status PcieBench::Recall() {
  for (RecallRow& r : recall_) {
    for (size_t s = 0; s < recallers_.size(); ++s) {
      KVTIER_ASSIGN_OR_RETURN(r.spread[s], TimeRecall(s, r, area_->data(), &r.ranges[s]));
      r.seconds[s] = r.spread[s].median;
    }
  }
  const RecallRow& ref = Reference();
  for (size_t s = 1; s < kRecallStrategies.size(); ++s) {
    if (ref.seconds[s] < ref.seconds[best_]) best_ = s;
  }

  log_ << absl::StrFormat(
      "\n[3] recall strategies: %s slabs from %d host pages (%s) into %d slots (median of %d, "
      "p10/p90 in the JSON; GB/s and / peak)\n",
      Bytes(static_cast<int64_t>(slab_bytes())), host_pages_,
      Bytes(static_cast<int64_t>(area_->size())), num_slots_, o_.iters);
  log_ << absl::StrFormat("  %6s %5s %6s %9s |", "budget", "churn", "items", "bytes");
  for (RecallStrategy s : kRecallStrategies)
    log_ << absl::StrFormat(" %-21s|", RecallStrategyName(s));
  log_ << " best/batched_dma\n";
  for (const RecallRow& r : recall_) {
    log_ << absl::StrFormat("  %6d %4d%% %6d %9s |", r.budget, r.churn, r.items, Bytes(r.bytes));
    double best = 0;
    for (size_t s = 0; s < kRecallStrategies.size(); ++s) {
      const double gbps = Gbps(static_cast<double>(r.bytes), r.seconds[s]);
      best = std::max(best, gbps);
      log_ << absl::StrFormat(" %7.2f (%s) %5dr |", gbps, FractionText(gbps), r.ranges[s]);
    }
    const double dma = Gbps(static_cast<double>(r.bytes), r.seconds[0]);  // batched_dma
    log_ << absl::StrFormat(" %.2fx\n", dma > 0 ? best / dma : 0.0);
  }
  const Spread best = GbpsOf(static_cast<double>(ref.bytes), ref.spread[best_]);
  log_ << absl::StrFormat(
      "  best at %d tokens, %d%% churn: %s, %.2f GB/s (p10-p90 %.2f-%.2f)%s (r = copy ranges "
      "issued)\n",
      ref.budget, ref.churn, RecallStrategyName(kRecallStrategies[best_]), best.median, best.p10,
      best.p90, gpu() ? absl::StrFormat(" = %.2f of peak", Fraction(best.median)) : std::string());
  log_.flush();
  return absl::OkStatus();
}

absl::Status PcieBench::NhdVsHnd() {
  const std::vector<RecallItem>& pairs = Reference().plans[0];
  const size_t n = pairs.size();
  const size_t slab = slab_bytes(), frag = fragment_bytes();
  const size_t page_bytes = g_.host_page_bytes();
  const int32_t p = g_.page_size, hkv = g_.num_kv_heads;
  KVTIER_ASSIGN_OR_RETURN(DeviceBuffer staging, backend_->Allocate(n * slab));
  const char* base = static_cast<const char*>(area_->data());
  char* dst = staging.as<char>();
  // (b)/(c): the same host area read as NHD pages: K [p][Hkv][d], then V [p][Hkv][d].
  std::vector<CopyRange> fragments;
  fragments.reserve(n * 2 * static_cast<size_t>(p));
  for (size_t i = 0; i < n; ++i) {
    const char* page = base + static_cast<size_t>(pairs[i].host_page) * page_bytes;
    for (int kv = 0; kv < 2; ++kv) {
      for (int32_t t = 0; t < p; ++t) {
        const size_t src =
            static_cast<size_t>(kv) * (page_bytes / 2) +
            (static_cast<size_t>(t) * hkv + static_cast<size_t>(pairs[i].kv_head)) * frag;
        fragments.push_back(
            CopyRange{dst + i * slab + (static_cast<size_t>(kv) * p + t) * frag, page + src, frag});
      }
    }
  }
  KVTIER_ASSIGN_OR_RETURN(
      const Spread hnd, Time([&](int) -> absl::Status {
        for (size_t i = 0; i < n; ++i) {
          const char* src = base + static_cast<size_t>(pairs[i].host_page) * page_bytes +
                            static_cast<size_t>(pairs[i].kv_head) * slab;
          KVTIER_RETURN_IF_ERROR(backend_->Copy(*drive_, dst + i * slab, src, slab));
        }
        return absl::OkStatus();
      }));
  KVTIER_ASSIGN_OR_RETURN(
      const Spread nhd, Time([&](int) -> absl::Status {
        for (const CopyRange& r : fragments) {
          KVTIER_RETURN_IF_ERROR(backend_->Copy(*drive_, r.dst, r.src, r.bytes));
        }
        return absl::OkStatus();
      }));
  KVTIER_ASSIGN_OR_RETURN(const Spread nhd_batch, Time([&](int) -> absl::Status {
                            return backend_->CopyBatch(*drive_, fragments.data(), fragments.size());
                          }));
  const double bytes = static_cast<double>(n * slab);
  const Spread hnd_gbps = GbpsOf(bytes, hnd), nhd_gbps = GbpsOf(bytes, nhd),
               nhd_batch_gbps = GbpsOf(bytes, nhd_batch);
  nhd_ = {hnd_gbps.median, nhd_gbps.median, nhd_batch_gbps.median, static_cast<int64_t>(n * slab)};
  nhd_json_.Add("pairs", static_cast<int64_t>(n))
      .Add("budget_tokens", Reference().budget)
      .Add("bytes", nhd_.bytes)
      .Add("hnd_slab_bytes", static_cast<int64_t>(slab))
      .Add("hnd_copies", static_cast<int64_t>(n))
      .Add("nhd_fragment_bytes", static_cast<int64_t>(frag))
      .Add("nhd_copies", static_cast<int64_t>(fragments.size()));
  AddGbps(nhd_json_, "hnd_gbps", hnd_gbps);
  AddGbps(nhd_json_, "nhd_gbps", nhd_gbps);
  AddGbps(nhd_json_, "nhd_batched_gbps", nhd_batch_gbps);
  nhd_json_.Add("hnd_fraction_of_peak", Fraction(nhd_.hnd))
      .Add("nhd_fraction_of_peak", Fraction(nhd_.nhd))
      .Add("nhd_batched_fraction_of_peak", Fraction(nhd_.nhd_batch))
      .Add("hnd_over_nhd", nhd_.nhd > 0 ? nhd_.hnd / nhd_.nhd : 0.0)
      .Add("hnd_over_nhd_batched", nhd_.nhd_batch > 0 ? nhd_.hnd / nhd_.nhd_batch : 0.0);
  log_ << absl::StrFormat(
      "\n[2] NHD vs HND: the same %d (page, head) pairs (%s, %d tokens per head), median of %d\n"
      "  %-34s %8s %10s %9s\n"
      "  %-34s %8d %7.2f GB/s %9s\n"
      "  %-34s %8d %7.2f GB/s %9s\n"
      "  %-34s %8d %7.2f GB/s %9s\n"
      "  HND slabs / NHD fragments: %.1fx (one copy each), %.1fx (batched)\n",
      n, Bytes(nhd_.bytes), Reference().budget, o_.iters, "layout (one copy per)", "copies",
      "bandwidth", "/ peak", absl::StrCat("HND ", Bytes(static_cast<int64_t>(slab)), " slab"), n,
      nhd_.hnd, FractionText(nhd_.hnd),
      absl::StrCat("NHD ", Bytes(static_cast<int64_t>(frag)), " token fragment"), fragments.size(),
      nhd_.nhd, FractionText(nhd_.nhd), "NHD fragments, one CopyBatch", fragments.size(),
      nhd_.nhd_batch, FractionText(nhd_.nhd_batch), nhd_.nhd > 0 ? nhd_.hnd / nhd_.nhd : 0.0,
      nhd_.nhd_batch > 0 ? nhd_.hnd / nhd_.nhd_batch : 0.0);
  log_.flush();
  return absl::OkStatus();
}

absl::Status PcieBench::Numa() {
  log_ << "\n[4] NUMA-local vs remote pinned memory\n";
  const int nodes = NumaNodeCount();
  const std::string bus = backend_->PciBusId();
  auto skip = [&](const std::string& why) {
    numa_json_.Add("skipped", why);
    log_ << "  skipped: " << why << "\n";
    return absl::OkStatus();
  };
  int local = -1;
  std::vector<int> remotes;
  std::string source;
  if (!o_.numa_nodes.empty()) {
    local = o_.numa_nodes[0];
    remotes = {o_.numa_nodes[1]};
    source = "--numa-nodes";
  } else {
    if (bus.empty()) {
      return skip(
          absl::StrFormat("the %s backend has no PCI bus id", DeviceKindName(backend_->kind())));
    }
    if (nodes < 2) return skip(absl::StrFormat("the host has %d NUMA node", nodes));
    const absl::StatusOr<int> node = NumaNodeOfPciDevice(bus);
    if (!node.ok()) return skip(absl::StrCat("device ", bus, ": ", node.status().ToString()));
    if (*node < 0) return skip(absl::StrCat("device ", bus, " has no NUMA locality"));
    local = *node;
    for (int n = 0; n < nodes; ++n) {
      if (n != local) remotes.push_back(n);
    }
    source = absl::StrCat("device ", bus);
  }
  const size_t area_bytes = std::max(static_cast<size_t>(host_pages_) * g_.host_page_bytes(),
                                     static_cast<size_t>(kNumaCopyBytes));
  KVTIER_ASSIGN_OR_RETURN(auto local_arena, MakeArena(area_bytes, local));
  if (local_arena->report().numa_policy != NumaPolicy::kBind) {
    return skip(absl::StrCat("cannot bind to the local node ", local, ": ",
                             local_arena->report().numa_note));
  }
  std::unique_ptr<HostArena> remote_arena;
  int remote = -1;
  std::string remote_notes;
  for (int n : remotes) {
    KVTIER_ASSIGN_OR_RETURN(auto a, MakeArena(area_bytes, n));
    if (a->report().numa_policy == NumaPolicy::kBind) {
      remote_arena = std::move(a);
      remote = n;
      break;
    }
    absl::StrAppend(&remote_notes, remote_notes.empty() ? "" : "; ", a->report().numa_note);
  }
  if (remote_arena == nullptr)
    return skip(absl::StrCat("no other node to bind to: ", remote_notes));

  KVTIER_ASSIGN_OR_RETURN(DeviceBuffer dev, backend_->Allocate(kNumaCopyBytes));
  auto h2d = [&](const HostArena& a) -> absl::StatusOr<Spread> {
    KVTIER_ASSIGN_OR_RETURN(const Spread s, Time([&](int) {
                              return backend_->Copy(*drive_, dev.data(), a.data(), kNumaCopyBytes);
                            }));
    return GbpsOf(static_cast<double>(kNumaCopyBytes), s);
  };
  auto recall = [&](const HostArena& a) -> absl::StatusOr<Spread> {
    KVTIER_ASSIGN_OR_RETURN(const Spread s, TimeRecall(best_, Reference(), a.data(), nullptr));
    return GbpsOf(static_cast<double>(Reference().bytes), s);
  };
  KVTIER_ASSIGN_OR_RETURN(const Spread local_h2d_gbps, h2d(*local_arena));
  KVTIER_ASSIGN_OR_RETURN(const Spread remote_h2d_gbps, h2d(*remote_arena));
  KVTIER_ASSIGN_OR_RETURN(const Spread local_recall_gbps, recall(*local_arena));
  KVTIER_ASSIGN_OR_RETURN(const Spread remote_recall_gbps, recall(*remote_arena));
  const double local_h2d = local_h2d_gbps.median, remote_h2d = remote_h2d_gbps.median;
  const double local_recall = local_recall_gbps.median, remote_recall = remote_recall_gbps.median;
  const std::string strategy(RecallStrategyName(kRecallStrategies[best_]));
  numa_json_.Add("nodes", nodes)
      .Add("local_from", source)
      .Add("local_node", local)
      .Add("remote_node", remote)
      .Add("h2d_bytes", kNumaCopyBytes);
  AddGbps(numa_json_, "local_h2d_gbps", local_h2d_gbps);
  AddGbps(numa_json_, "remote_h2d_gbps", remote_h2d_gbps);
  numa_json_.Add("remote_over_local_h2d", local_h2d > 0 ? remote_h2d / local_h2d : 0.0)
      .Add("recall_strategy", strategy)
      .Add("recall_bytes", Reference().bytes);
  AddGbps(numa_json_, "local_recall_gbps", local_recall_gbps);
  AddGbps(numa_json_, "remote_recall_gbps", remote_recall_gbps);
  numa_json_.Add("remote_over_local_recall", local_recall > 0 ? remote_recall / local_recall : 0.0)
      .Add("hugetlb", local_arena->report().hugetlb && remote_arena->report().hugetlb);
  log_ << absl::StrFormat(
      "  local node %d (%s) vs remote node %d, of %d; median of %d\n"
      "  %-28s %10s %10s %8s\n"
      "  %-28s %10.2f %10.2f %8.2f\n"
      "  %-28s %10.2f %10.2f %8.2f\n",
      local, source, remote, nodes, o_.iters, "GB/s", "local", "remote", "rem/loc",
      absl::StrCat("H2D ", Bytes(kNumaCopyBytes)), local_h2d, remote_h2d,
      local_h2d > 0 ? remote_h2d / local_h2d : 0.0,
      absl::StrCat("recall ", strategy, " ", Bytes(Reference().bytes)), local_recall, remote_recall,
      local_recall > 0 ? remote_recall / local_recall : 0.0);
  log_.flush();
  return absl::OkStatus();
}

absl::Status PcieBench::Plot() const {
  std::vector<PlotSeries> series;
  auto line = [&](std::string name, bool dashed, double CopyRow::*field) {
    PlotSeries s{std::move(name), {}, {}, dashed};
    for (const CopyRow& r : copies_) {
      s.x.push_back(static_cast<double>(r.bytes));
      s.y.push_back(r.*field);
    }
    series.push_back(std::move(s));
  };
  line("pinned H2D", false, &CopyRow::pinned_h2d);
  line("pinned D2H", false, &CopyRow::pinned_d2h);
  line("pageable H2D", true, &CopyRow::pageable_h2d);
  line("pageable D2H", true, &CopyRow::pageable_d2h);
  for (size_t s = 0; s < kRecallStrategies.size(); ++s) {
    // x: bytes per plan; plans of equal size (budget × churn) are averaged.
    std::map<int64_t, std::pair<double, int>> by_bytes;
    for (const RecallRow& r : recall_) {
      auto& [sum, count] = by_bytes[r.bytes];
      sum += Gbps(static_cast<double>(r.bytes), r.seconds[s]);
      ++count;
    }
    PlotSeries ps{absl::StrCat("recall ", std::string(RecallStrategyName(kRecallStrategies[s]))),
                  {},
                  {},
                  false};
    for (const auto& [bytes, v] : by_bytes) {
      ps.x.push_back(static_cast<double>(bytes));
      ps.y.push_back(v.first / v.second);
    }
    series.push_back(std::move(ps));
  }
  series.push_back(
      PlotSeries{"HND slab copies", {static_cast<double>(nhd_.bytes)}, {nhd_.hnd}, false});
  series.push_back(
      PlotSeries{"NHD token copies", {static_cast<double>(nhd_.bytes)}, {nhd_.nhd}, false});
  PlotOptions po;
  po.title = absl::StrFormat("kvtier pcie: bandwidth vs transfer size (%s)",
                             DeviceKindName(backend_->kind()));
  po.x_label = absl::StrFormat("bytes per copy; recall & HND/NHD: bytes per plan (%s slabs)",
                               Bytes(static_cast<int64_t>(slab_bytes())));
  po.y_label = "GB/s";
  po.log_x = true;
  po.log_y = true;
  return WriteLinePlot(o_.plot_path, po, series);
}

JsonObject PcieBench::Report() const {
  const std::string describe = backend_->Describe();
  const bool cuda = backend_->kind() == DeviceKind::kCuda;
  std::vector<JsonObject> copies;
  for (const CopyRow& r : copies_) {
    JsonObject j;
    j.Add("bytes", r.bytes).Add("copies_per_sample", r.copies_per_sample);
    AddGbps(j, "pinned_h2d_gbps", r.pinned_h2d_spread);
    AddGbps(j, "pinned_d2h_gbps", r.pinned_d2h_spread);
    AddGbps(j, "pageable_h2d_gbps", r.pageable_h2d_spread);
    AddGbps(j, "pageable_d2h_gbps", r.pageable_d2h_spread);
    j.Add("pinned_h2d_fraction_of_peak", Fraction(r.pinned_h2d))
        .Add("pinned_d2h_fraction_of_peak", Fraction(r.pinned_d2h))
        .Add("pageable_h2d_fraction_of_peak", Fraction(r.pageable_h2d))
        .Add("pageable_d2h_fraction_of_peak", Fraction(r.pageable_d2h));
    copies.push_back(std::move(j));
  }
  std::vector<JsonObject> recall;
  for (const RecallRow& r : recall_) {
    for (size_t s = 0; s < kRecallStrategies.size(); ++s) {
      const Spread gbps = GbpsOf(static_cast<double>(r.bytes), r.spread[s]);
      JsonObject j;
      j.Add("strategy", RecallStrategyName(kRecallStrategies[s]))
          .Add("budget_tokens", r.budget)
          .Add("churn_percent", r.churn)
          .Add("items", r.items)
          .Add("bytes", r.bytes)
          .Add("us", r.seconds[s] * 1e6);
      AddGbps(j, "gbps", gbps);
      j.Add("fraction_of_peak", Fraction(gbps.median)).Add("copy_ranges", r.ranges[s]);
      recall.push_back(std::move(j));
    }
  }
  const RecallRow& ref = Reference();
  JsonObject recall_gbps;
  for (size_t s = 0; s < kRecallStrategies.size(); ++s) {
    recall_gbps.Add(RecallStrategyName(kRecallStrategies[s]),
                    Gbps(static_cast<double>(ref.bytes), ref.seconds[s]));
  }
  JsonObject recall_best;  // per strategy: the best over every budget × churn
  for (size_t s = 0; s < kRecallStrategies.size(); ++s) {
    double best = 0;
    for (const RecallRow& r : recall_)
      best = std::max(best, Gbps(static_cast<double>(r.bytes), r.seconds[s]));
    recall_best.Add(RecallStrategyName(kRecallStrategies[s]), best);
  }
  const double best_gbps = Gbps(static_cast<double>(ref.bytes), ref.seconds[best_]);
  JsonObject reference;
  reference.Add("budget_tokens", ref.budget)
      .Add("churn_percent", ref.churn)
      .Add("items", ref.items)
      .Add("bytes", ref.bytes);
  JsonObject geometry;
  geometry.Add("kv_heads", g_.num_kv_heads)
      .Add("head_dim", g_.head_dim)
      .Add("page_size", g_.page_size)
      .Add("dtype", DTypeName(g_.dtype))
      .Add("slab_bytes", static_cast<int64_t>(slab_bytes()))
      .Add("fragment_bytes", static_cast<int64_t>(fragment_bytes()))
      .Add("host_page_bytes", static_cast<int64_t>(g_.host_page_bytes()));
  JsonObject sizes;
  sizes.Add("min_bytes", o_.min_bytes)
      .Add("max_bytes", o_.max_bytes)
      .Add("sample_bytes", o_.sample_bytes)
      .Add("iters", o_.iters)
      .Add("host_pages", host_pages_)
      .Add("host_area_bytes", static_cast<int64_t>(area_->size()))
      .Add("working_set_slots", num_slots_)
      .Add("chunk_items", o_.chunk_items)
      .Add("budgets", absl::StrJoin(o_.budgets, ","))
      .Add("churn_percent", absl::StrJoin(o_.churn_percent, ","));
  const ArenaReport& ar = area_->report();
  JsonObject host_area;
  host_area.Add("bytes", static_cast<int64_t>(ar.mapped_bytes))
      .Add("hugetlb", ar.hugetlb)
      .Add("transparent_hugepages", ar.transparent_hugepages);
  JsonObject j;
  j.Add("bench", "pcie")
      .Add("device", describe)
      .Add("driver", cuda ? VersionAfter(describe, "driver ") : "n/a")
      .Add("cuda", cuda ? VersionAfter(describe, "runtime ") : "n/a")
      .Add("pci_bus_id", backend_->PciBusId())
      .Add("host", HostCpu())
      .Add("numa_nodes", NumaNodeCount())
      .Add("commit", Commit())
      .Add("time", UtcNow())
      .AddObject("geometry", geometry)
      .AddObject("sizes", sizes)
      .AddObject("host_area", host_area)
      .Add("peak_h2d_gbps", peak_h2d_)
      .Add("peak_h2d_bytes", peak_h2d_bytes_)
      .AddObject("recall_gbps", recall_gbps)
      .AddObject("recall_reference", reference)
      .AddObject("recall_best_gbps", recall_best)
      .Add("best_strategy", RecallStrategyName(kRecallStrategies[best_]))
      .Add("best_recall_gbps", best_gbps)
      .Add("best_fraction_of_peak", Fraction(best_gbps))
      .Add("fractions_of_peak_apply", gpu())
      .AddArray("copies", copies)
      .AddArray("recall", recall)
      .AddObject("nhd_vs_hnd", nhd_json_)
      .AddObject("numa", numa_json_)
      .Add("seconds", seconds_);
  return j;
}

absl::StatusOr<JsonObject> PcieBench::Run() {
  const auto t0 = std::chrono::steady_clock::now();
  KVTIER_RETURN_IF_ERROR(Setup());
  log_ << absl::StrFormat(
      "kvtier-bench pcie  device=%s  commit=%s\n"
      "  host %s, %d NUMA node(s); geometry Hkv=%d d=%d p=%d %s: slab %s, token fragment %s\n",
      backend_->Describe(), Commit(), HostCpu(), NumaNodeCount(), g_.num_kv_heads, g_.head_dim,
      g_.page_size, DTypeName(g_.dtype), Bytes(static_cast<int64_t>(slab_bytes())),
      Bytes(static_cast<int64_t>(fragment_bytes())));
  KVTIER_RETURN_IF_ERROR(CopySweep());
  KVTIER_RETURN_IF_ERROR(MakePlans());
  KVTIER_RETURN_IF_ERROR(NhdVsHnd());
  KVTIER_RETURN_IF_ERROR(Recall());  // picks the best strategy Numa uses
  KVTIER_RETURN_IF_ERROR(Numa());
  if (!o_.plot_path.empty()) {
    KVTIER_RETURN_IF_ERROR(Plot());
    log_ << "\nplot: " << o_.plot_path << "\n";
  }
  seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return Report();
}

// "a,b,c" → ints; INVALID_ARGUMENT naming the flag.
absl::Status ParseList(const std::string& flag, const std::string& text,
                       std::vector<int32_t>* out) {
  std::string bad;
  if (ParseIntList(text, out, &bad)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat("%s: '%s' is not an integer", flag, bad));
}

struct PcieFlags {
  PcieBenchOptions o;
  std::string backend = "cpu", dtype = "fp16", budgets = "1024,2048,4096", churn = "10,25,50,100",
              numa_nodes, out;
  bool json = false;
};

int RunPcieCommand(PcieFlags& f) {
  absl::Status st = ParseList("--budgets", f.budgets, &f.o.budgets);
  if (st.ok()) st = ParseList("--churn", f.churn, &f.o.churn_percent);
  if (st.ok()) st = ParseList("--numa-nodes", f.numa_nodes, &f.o.numa_nodes);
  if (st.ok() && !ParseDeviceKind(f.backend, &f.o.backend)) {
    st = absl::InvalidArgumentError("--backend must be cpu, cuda or auto (got " + f.backend + ")");
  }
  if (st.ok() && !ParseDType(f.dtype, &f.o.geometry.dtype)) {
    st = absl::InvalidArgumentError("--dtype must be fp16, bf16 or fp32 (got " + f.dtype + ")");
  }
  if (!st.ok()) {
    std::cerr << "kvtier-bench pcie: " << st.message() << "\n";
    return 2;
  }
  auto report = RunPcieBench(f.o, f.json ? std::cerr : std::cout);
  if (!report.ok()) {
    std::cerr << "kvtier-bench pcie: " << report.status() << "\n";
    return 1;
  }
  const std::string text = report->ToString();
  if (f.json) std::cout << text << "\n";
  if (!f.out.empty()) {
    std::ofstream file(f.out);
    file << text << "\n";
    if (!file) {
      std::cerr << "kvtier-bench pcie: cannot write " << f.out << "\n";
      return 1;
    }
  }
  return 0;
}

}  // namespace

absl::StatusOr<JsonObject> RunPcieBench(const PcieBenchOptions& o, std::ostream& log) {
  PcieBench bench(o, log);
  return bench.Run();
}

CLI::App* AddPcieCommand(CLI::App& app, int* rc) {
  auto flags = std::make_shared<PcieFlags>();
  PcieFlags& f = *flags;
  auto* cmd = app.add_subcommand(
      "pcie",
      "host<->device bandwidth: pinned vs pageable copies, NHD vs HND recall, the "
      "recall strategies, NUMA-local vs remote");
  cmd->add_option("--backend", f.backend, "cpu, cuda or auto")->capture_default_str();
  cmd->add_option("--threads", f.o.threads, "cpu backend threads (0 = all)")->capture_default_str();
  cmd->add_option("--device", f.o.cuda_device, "cuda device ordinal")->capture_default_str();
  cmd->add_option("--min-bytes", f.o.min_bytes, "smallest copy size (sizes grow x4)")
      ->capture_default_str();
  cmd->add_option("--max-bytes", f.o.max_bytes, "largest copy size")->capture_default_str();
  cmd->add_option("--sample-bytes", f.o.sample_bytes,
                  "bytes per timed sample: small sizes enqueue several copies (at most 1024) "
                  "and synchronize once")
      ->capture_default_str();
  cmd->add_option("--iters", f.o.iters, "timed samples per measurement (median)")
      ->capture_default_str();
  cmd->add_option("--kv-heads", f.o.geometry.num_kv_heads, "KV heads")->capture_default_str();
  cmd->add_option("--head-dim", f.o.geometry.head_dim, "head dimension")->capture_default_str();
  cmd->add_option("--page-size", f.o.geometry.page_size, "tokens per page")->capture_default_str();
  cmd->add_option("--dtype", f.dtype, "fp16, bf16 or fp32")->capture_default_str();
  cmd->add_option("--budgets", f.budgets, "recall budgets, tokens per KV head (comma-separated)")
      ->capture_default_str();
  cmd->add_option("--churn", f.churn,
                  "percent of the selected head-pages recalled per step (comma-separated)")
      ->capture_default_str();
  cmd->add_option("--host-pages", f.o.host_pages,
                  "pages in the host area the plans draw from (0: 4096 on cuda, 1024 on cpu)")
      ->capture_default_str();
  cmd->add_option("--chunk-items", f.o.chunk_items, "slabs per staging chunk (DMA strategies)")
      ->capture_default_str();
  cmd->add_option("--numa-nodes", f.numa_nodes,
                  "LOCAL,REMOTE nodes to compare (default: the device's node and another)");
  cmd->add_option("--seed", f.o.seed, "plan random seed")->capture_default_str();
  cmd->add_option("--plot", f.o.plot_path, "write a PNG plot of bandwidth vs size here");
  cmd->add_flag("--json", f.json, "print the JSON report on stdout (human report to stderr)");
  cmd->add_option("--out", f.out, "also write the JSON report to this file");
  cmd->callback([flags, rc] { *rc = RunPcieCommand(*flags); });
  return cmd;
}

}  // namespace kvtier::bench
