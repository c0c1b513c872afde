#include "daemon/session_cold_pages.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "core/status.h"

namespace kvtier::daemon {

SessionColdPages::~SessionColdPages() { (void)RemoveAll(); }

absl::Time SessionColdPages::DeadlineOf(absl::Time deadline) const {
  MutexLock lock(&call_mu_);
  return std::min({absl::Now() + timeout_, deadline, call_deadline_});
}

void SessionColdPages::SetCallDeadline(absl::Time deadline) {
  MutexLock lock(&call_mu_);
  call_deadline_ = deadline;
}

absl::Status SessionColdPages::Put(const StoredPage& page, std::span<const uint8_t> bytes) {
  const std::span<const uint8_t> one[1] = {bytes};
  return PutBatch(std::span<const StoredPage>(&page, 1), one);
}

absl::Status SessionColdPages::PutBatchUntil(std::span<const StoredPage> pages,
                                             std::span<const std::span<const uint8_t>> bytes,
                                             absl::Time deadline) {
  MutexLock lock(&mu_);
  std::vector<ColdPageRef> refs;
  std::map<Key, uint64_t> batch;  // → generation: a page named twice is written once
  uint64_t fresh = 0;             // keys not charged yet
  for (size_t i = 0; i < pages.size(); ++i) {
    const StoredPage& page = pages[i];
    if (bytes[i].size() != page_bytes_) {
      return absl::InvalidArgumentError(
          absl::StrFormat("session %s: a page of %d bytes; its pages have %d", session_,
                          bytes[i].size(), page_bytes_));
    }
    const Key key{page.layer, page.page};
    if (auto [named, added] = batch.emplace(key, page.generation); !added) {
      if (named->second == page.generation) continue;
      return absl::InvalidArgumentError(absl::StrFormat(
          "session %s: layer %d page %d named twice, with generations %d and %d", session_,
          page.layer, page.page, named->second, page.generation));
    }
    auto held = held_.find(key);
    // Pages never change: a copy of this generation is already there.
    if (held != held_.end() && held->second == page.generation) continue;
    // Another generation of a held page (written again after a rebuild), or a page a failed
    // batch may have stored, is written over its key and keeps its one charge.
    if (held == held_.end() && !unacknowledged_.contains(key)) ++fresh;
    refs.push_back(ColdPageRef{
        page.layer, page.page, page.generation,
        std::string_view(reinterpret_cast<const char*>(bytes[i].data()), bytes[i].size())});
  }
  if (refs.empty()) return absl::OkStatus();
  KVTIER_RETURN_IF_ERROR(store_->Reserve(session_, fresh * (page_bytes_ + kColdHeaderBytes)));
  // Charged from here on, and not to be read until acknowledged: a failure may leave any of
  // them stored (RemoveAll removes them).
  for (const ColdPageRef& r : refs) {
    held_.erase({r.layer, r.page});
    unacknowledged_.insert({r.layer, r.page});
  }
  KVTIER_RETURN_IF_ERROR(store_->PutPages(session_, refs, DeadlineOf(deadline)));
  for (const ColdPageRef& r : refs) {
    unacknowledged_.erase({r.layer, r.page});
    held_[{r.layer, r.page}] = r.generation;
  }
  return absl::OkStatus();
}

absl::Status SessionColdPages::Get(int32_t layer, int64_t page, int64_t slot,
                                   std::span<uint8_t> out) {
  const Read one[1] = {{layer, page, slot, out}};
  return GetBatch(one);
}

absl::Status SessionColdPages::GetBatch(std::span<const Read> reads) {
  return ReadEach(reads, DeadlineOf(absl::InfiniteFuture()),
                  [&](size_t i, std::string&& data) {
                    std::memcpy(reads[i].out.data(), data.data(), reads[i].out.size());
                  });
}

absl::StatusOr<std::vector<std::string>> SessionColdPages::ReadPages(std::span<const Read> reads,
                                                                     absl::Time deadline) {
  std::vector<std::string> out(reads.size());
  KVTIER_RETURN_IF_ERROR(ReadEach(reads, DeadlineOf(deadline),
                                  [&](size_t i, std::string&& data) { out[i] = std::move(data); }));
  return out;
}

absl::Status SessionColdPages::ReadEach(std::span<const Read> reads, absl::Time deadline,
                                        absl::FunctionRef<void(size_t, std::string&&)> take) {
  // Per layer: the indices of its reads, in the order asked.
  std::map<int32_t, std::vector<size_t>> by_layer;
  for (size_t i = 0; i < reads.size(); ++i) by_layer[reads[i].layer].push_back(i);
  for (const auto& [layer, rs] : by_layer) {
    std::vector<int64_t> pages;
    std::vector<uint64_t> generations;
    for (size_t i : rs) {
      std::optional<uint64_t> generation = Generation(layer, reads[i].page);
      if (!generation.has_value()) {
        return absl::NotFoundError(
            absl::StrFormat("session %s: layer %d page %d was never demoted to the cold tier",
                            session_, layer, reads[i].page));
      }
      pages.push_back(reads[i].page);
      generations.push_back(*generation);
    }
    std::vector<absl::StatusOr<ColdPage>> got =
        store_->GetPages(session_, layer, pages, generations, deadline);
    for (size_t j = 0; j < rs.size(); ++j) {
      if (j >= got.size()) return absl::InternalError("cold tier: fewer pages read than asked");
      KVTIER_RETURN_IF_ERROR(got[j].status());
      const Read& r = reads[rs[j]];
      if (got[j]->data.size() != page_bytes_ || (!r.out.empty() && r.out.size() != page_bytes_)) {
        return absl::DataLossError(absl::StrFormat(
            "session %s: layer %d page %d came back with %d bytes; %d expected", session_, layer,
            r.page, got[j]->data.size(), page_bytes_));
      }
      take(rs[j], std::move(got[j]->data));
    }
  }
  return absl::OkStatus();
}

std::optional<uint64_t> SessionColdPages::Generation(int32_t layer, int64_t page) const {
  MutexLock lock(&mu_);
  auto it = held_.find({layer, page});
  if (it == held_.end()) return std::nullopt;
  return it->second;
}

size_t SessionColdPages::size() const {
  MutexLock lock(&mu_);
  return held_.size();
}

std::vector<std::pair<int32_t, int64_t>> SessionColdPages::Held() const {
  MutexLock lock(&mu_);
  std::vector<std::pair<int32_t, int64_t>> out;
  out.reserve(held_.size());
  for (const auto& [key, generation] : held_) out.push_back(key);
  return out;
}

absl::Status SessionColdPages::RemoveAll() {
  MutexLock lock(&mu_);
  std::map<int32_t, std::vector<int64_t>> by_layer;
  for (const auto& [key, generation] : held_) by_layer[key.first].push_back(key.second);
  for (const Key& key : unacknowledged_) by_layer[key.first].push_back(key.second);
  held_.clear();
  unacknowledged_.clear();
  if (by_layer.empty()) return absl::OkStatus();
  const absl::Time deadline = absl::Now() + timeout_;
  absl::Status first;
  for (const auto& [layer, pages] : by_layer) {
    absl::Status st = store_->RemovePages(session_, layer, pages, page_bytes_, deadline);
    if (first.ok()) first = st;
  }
  return first;
}

}  // namespace kvtier::daemon
