#include "daemon/page_mover.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "core/status.h"

namespace kvtier::daemon {

PageMover::PageMover(ColdStore* store, PageMoverOptions options)
    : store_(store), options_(std::move(options)) {}

PageMover::~PageMover() { (void)RemoveAll(); }

absl::Time PageMover::DeadlineOf(absl::Time deadline) const {
  MutexLock lock(&call_mu_);
  return std::min({absl::Now() + options_.timeout, deadline, call_deadline_});
}

void PageMover::SetCallDeadline(absl::Time deadline) {
  MutexLock lock(&call_mu_);
  call_deadline_ = deadline;
}

absl::Status PageMover::Demote(std::span<const Out> pages, absl::Time deadline) {
  const std::string& keys = options_.keys;
  MutexLock lock(&mu_);
  std::vector<ColdPageRef> refs;
  std::map<Key, uint64_t> batch;  // → generation: a page named twice is written once
  uint64_t fresh = 0;             // keys not charged yet
  for (const Out& page : pages) {
    if (page.bytes.size() != options_.page_bytes || page.layer < 0 || page.page < 0 ||
        page.generation == 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "pages of %s: layer %d page %d generation %d with %d bytes; pages need a layer and a "
          "page >= 0, a generation >= 1 and %d bytes",
          keys, page.layer, page.page, page.generation, page.bytes.size(), options_.page_bytes));
    }
    const Key key{page.layer, page.page};
    if (auto [named, added] = batch.emplace(key, page.generation); !added) {
      if (named->second == page.generation) continue;
      return absl::InvalidArgumentError(absl::StrFormat(
          "pages of %s: layer %d page %d named twice, with generations %d and %d", keys,
          page.layer, page.page, named->second, page.generation));
    }
    auto held = held_.find(key);
    // Pages never change: a copy of this generation is already there.
    if (held != held_.end() && held->second == page.generation) continue;
    // Another generation of a held page, or a page a failed batch may have stored, is
    // written over its key and keeps its one charge.
    if (held == held_.end() && !unacknowledged_.contains(key)) ++fresh;
    refs.push_back(ColdPageRef{
        page.layer, page.page, page.generation,
        std::string_view(reinterpret_cast<const char*>(page.bytes.data()), page.bytes.size())});
  }
  if (refs.empty()) return absl::OkStatus();
  KVTIER_RETURN_IF_ERROR(
      store_->Reserve(keys, fresh * (options_.page_bytes + kColdHeaderBytes), overdraft_));
  // Charged from here on, and not to be read until acknowledged: a failure may leave any of
  // them stored (RemoveAll removes them).
  for (const ColdPageRef& r : refs) {
    held_.erase({r.layer, r.page});
    unacknowledged_.insert({r.layer, r.page});
  }
  KVTIER_RETURN_IF_ERROR(store_->PutPages(keys, refs, DeadlineOf(deadline), options_.live));
  for (const ColdPageRef& r : refs) {
    unacknowledged_.erase({r.layer, r.page});
    held_[{r.layer, r.page}] = r.generation;
  }
  return absl::OkStatus();
}

absl::Status PageMover::Promote(std::span<const In> pages, absl::Time deadline,
                                absl::FunctionRef<absl::Status()> may_write) {
  const std::string& keys = options_.keys;
  // Per layer: the indices of its pages, in the order asked, with the generations held.
  std::map<int32_t, std::vector<size_t>> by_layer;
  std::vector<uint64_t> generation(pages.size());
  {
    MutexLock lock(&mu_);
    for (size_t i = 0; i < pages.size(); ++i) {
      const In& p = pages[i];
      auto held = held_.find({p.layer, p.page});
      if (held == held_.end()) {
        return absl::NotFoundError(absl::StrFormat(
            "pages of %s: layer %d page %d was never demoted to the cold tier", keys, p.layer,
            p.page));
      }
      if (p.into.size() != options_.page_bytes) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "pages of %s: layer %d page %d into %d bytes; a page has %d", keys, p.layer, p.page,
            p.into.size(), options_.page_bytes));
      }
      generation[i] = held->second;
      by_layer[p.layer].push_back(i);
    }
  }
  // The reads run without the lock: a stalled node must not hold Generation(), which
  // ListSessions asks. Into buffers of our own: nothing is written before all are in.
  const absl::Time until = DeadlineOf(deadline);
  std::vector<std::string> got(pages.size());
  for (const auto& [layer, indices] : by_layer) {
    std::vector<int64_t> ps;
    std::vector<uint64_t> gens;
    for (size_t i : indices) {
      ps.push_back(pages[i].page);
      gens.push_back(generation[i]);
    }
    std::vector<absl::StatusOr<ColdPage>> read =
        store_->GetPages(keys, layer, ps, gens, until, options_.live);
    if (read.size() != indices.size()) {
      return absl::InternalError("cold tier: fewer pages read than asked");
    }
    for (size_t j = 0; j < indices.size(); ++j) {
      KVTIER_RETURN_IF_ERROR(read[j].status());
      if (read[j]->data.size() != options_.page_bytes) {
        return absl::DataLossError(absl::StrFormat(
            "pages of %s: layer %d page %d came back with %d bytes; %d expected", keys, layer,
            ps[j], read[j]->data.size(), options_.page_bytes));
      }
      got[indices[j]] = std::move(read[j]->data);
    }
  }
  KVTIER_RETURN_IF_ERROR(may_write());
  for (size_t i = 0; i < pages.size(); ++i) {
    std::memcpy(pages[i].into.data(), got[i].data(), options_.page_bytes);
  }
  return absl::OkStatus();
}

void PageMover::Adopt(std::span<const Held> pages) {
  MutexLock lock(&mu_);
  for (const Held& p : pages) {
    unacknowledged_.erase({p.layer, p.page});
    held_[{p.layer, p.page}] = p.generation;
  }
}

std::vector<PageMover::Held> PageMover::Release() {
  MutexLock lock(&mu_);
  std::vector<Held> out;
  out.reserve(held_.size());
  for (const auto& [key, generation] : held_) out.push_back({key.first, key.second, generation});
  held_.clear();
  return out;
}

void PageMover::SetOverdraft(uint64_t bytes) {
  MutexLock lock(&mu_);
  overdraft_ = bytes;
}

uint64_t PageMover::ChargedBytes() const {
  MutexLock lock(&mu_);
  return (held_.size() + unacknowledged_.size()) * (options_.page_bytes + kColdHeaderBytes);
}

std::optional<uint64_t> PageMover::Generation(int32_t layer, int64_t page) const {
  MutexLock lock(&mu_);
  auto it = held_.find({layer, page});
  if (it == held_.end()) return std::nullopt;
  return it->second;
}

std::vector<PageMover::Held> PageMover::HeldPages() const {
  MutexLock lock(&mu_);
  std::vector<Held> out;
  out.reserve(held_.size());
  for (const auto& [key, generation] : held_) out.push_back({key.first, key.second, generation});
  return out;
}

size_t PageMover::size() const {
  MutexLock lock(&mu_);
  return held_.size();
}

absl::Status PageMover::RemoveAll(absl::Time deadline) {
  MutexLock lock(&mu_);
  std::map<int32_t, std::vector<int64_t>> by_layer;
  for (const auto& [key, generation] : held_) by_layer[key.first].push_back(key.second);
  for (const Key& key : unacknowledged_) by_layer[key.first].push_back(key.second);
  held_.clear();
  unacknowledged_.clear();
  if (by_layer.empty()) return absl::OkStatus();
  const absl::Time until = std::min(deadline, absl::Now() + options_.timeout);
  absl::Status first;
  for (const auto& [layer, pages] : by_layer) {
    absl::Status st =
        store_->RemovePages(options_.keys, layer, pages, options_.page_bytes, until);
    if (first.ok()) first = st;
  }
  return first;
}

absl::Status PageMover::PutBatch(std::span<const StoredPage> pages,
                                 std::span<const std::span<const uint8_t>> bytes) {
  std::vector<Out> out;
  out.reserve(pages.size());
  for (size_t i = 0; i < pages.size(); ++i) {
    out.push_back({pages[i].layer, pages[i].page, pages[i].generation, bytes[i]});
  }
  return Demote(out, absl::InfiniteFuture());
}

absl::Status PageMover::GetBatch(std::span<const Read> reads) {
  std::vector<In> in;
  in.reserve(reads.size());
  for (const Read& r : reads) in.push_back({r.layer, r.page, r.out});
  return Promote(in, absl::InfiniteFuture());
}

}  // namespace kvtier::daemon
