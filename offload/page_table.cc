#include "offload/page_table.h"

#include <utility>

#include "absl/strings/str_format.h"

namespace kvtier {

absl::Status PageTable::Insert(int64_t logical, PageHandle page) {
  if (logical < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("logical page %d: must be >= 0", logical));
  }
  if (!page.valid() || page.pool() != pool_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("logical page %d: the page handle is %s", logical,
                        page.valid() ? "from another pool" : "empty"));
  }
  const auto [it, inserted] = pages_.try_emplace(logical, std::move(page));
  if (!inserted) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "logical page %d is already in the page table (slot %d)", logical, it->second.slot()));
  }
  return absl::OkStatus();
}

absl::StatusOr<PageEntry> PageTable::Lookup(int64_t logical) const {
  const auto it = pages_.find(logical);
  if (it == pages_.end()) {
    return absl::NotFoundError(absl::StrFormat(
        "logical page %d is not in the page table (%d pages)", logical, pages_.size()));
  }
  return PageEntry{it->second.slot(), it->second.generation()};
}

absl::Status PageTable::Erase(int64_t logical) {
  if (pages_.erase(logical) == 0) {
    return absl::NotFoundError(absl::StrFormat(
        "cannot erase logical page %d: not in the page table (%d pages)", logical, pages_.size()));
  }
  return absl::OkStatus();
}

}  // namespace kvtier
