#include "daemon/session_cold_pages.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "core/status.h"

namespace kvtier::daemon {

SessionColdPages::~SessionColdPages() { (void)RemoveAll(); }

absl::Status SessionColdPages::Put(const StoredPage& page, std::span<const uint8_t> bytes) {
  if (bytes.size() != page_bytes_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "session %s: a page of %d bytes; its pages have %d", session_, bytes.size(), page_bytes_));
  }
  MutexLock lock(&mu_);
  auto it = held_.find({page.layer, page.page});
  if (it != held_.end()) {
    // Pages never change: a copy of this generation is already there.
    if (it->second == page.generation) return absl::OkStatus();
    // Another generation of the page (written again after a reattach): its key is
    // overwritten, and charged once.
    store_->Unreserve(page_bytes_ + kColdHeaderBytes);
    held_.erase(it);
  }
  const ColdPageRef ref{page.layer, page.page, page.generation,
                        std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size())};
  KVTIER_RETURN_IF_ERROR(store_->PutPage(session_, ref, absl::Now() + timeout_));
  held_[{page.layer, page.page}] = page.generation;
  return absl::OkStatus();
}

absl::Status SessionColdPages::Get(int32_t layer, int64_t page, int64_t /*slot*/,
                                   std::span<uint8_t> out) {
  std::optional<uint64_t> generation = Generation(layer, page);
  if (!generation.has_value()) {
    return absl::NotFoundError(absl::StrFormat(
        "session %s: layer %d page %d was never demoted to the cold tier", session_, layer, page));
  }
  absl::StatusOr<ColdPage> got =
      store_->GetPage(session_, layer, page, *generation, absl::Now() + timeout_);
  if (!got.ok()) return got.status();
  if (got->data.size() != out.size()) {
    return absl::DataLossError(absl::StrFormat(
        "session %s: layer %d page %d came back with %d bytes; %d expected", session_, layer,
        page, got->data.size(), out.size()));
  }
  std::memcpy(out.data(), got->data.data(), out.size());
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
  if (held_.empty()) return absl::OkStatus();
  std::map<int32_t, std::vector<int64_t>> by_layer;
  for (const auto& [key, generation] : held_) by_layer[key.first].push_back(key.second);
  held_.clear();
  const absl::Time deadline = absl::Now() + timeout_;
  absl::Status first;
  for (const auto& [layer, pages] : by_layer) {
    absl::Status st = store_->RemovePages(session_, layer, pages, page_bytes_, deadline);
    if (first.ok()) first = st;
  }
  return first;
}

}  // namespace kvtier::daemon
