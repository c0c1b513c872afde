#include "offload/staging_ring.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/str_format.h"
#include "core/status.h"

namespace kvtier {

absl::StatusOr<std::unique_ptr<StagingRing>> StagingRing::Create(Backend& backend, size_t bytes) {
  if (bytes == 0 || bytes > Device::kMaxRegisterBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("staging ring: %d bytes must be in [1, %d]", bytes, Device::kMaxRegisterBytes));
  }
  const size_t capacity = (bytes + kAlign - 1) / kAlign * kAlign;
  auto* base = static_cast<uint8_t*>(std::aligned_alloc(4096, (capacity + 4095) / 4096 * 4096));
  if (base == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("staging ring: out of host memory allocating %d bytes", capacity));
  }
  if (absl::Status st = backend.RegisterHost(base, capacity); !st.ok()) {
    std::free(base);
    return absl::ResourceExhaustedError(
        absl::StrFormat("staging ring: registering %d bytes of host memory: %s", capacity,
                        st.message()));
  }
  return std::unique_ptr<StagingRing>(new StagingRing(backend, base, capacity));
}

StagingRing::~StagingRing() {
  (void)backend_.UnregisterHost(base_);
  std::free(base_);
}

StagingRing::Block StagingRing::TryAcquire(size_t bytes) {
  const uint64_t size = (bytes + kAlign - 1) / kAlign * kAlign;
  if (bytes == 0 || size > capacity_) return {};
  if (blocks_.empty() && head_ % capacity_ != 0) {
    // Nothing is held: start again at the ring's beginning, so a block of any size fits.
    head_ = tail_ = head_ + (capacity_ - head_ % capacity_);
  }
  uint64_t begin = head_;
  const uint64_t offset = begin % capacity_;
  if (offset + size > capacity_) begin += capacity_ - offset;  // skip the ring's tail end
  if (begin + size - tail_ > capacity_) return {};
  if (begin != head_) {
    // The skipped bytes form a released block, so that tail_ passes them in order. It takes
    // the last ticket given, which keeps blocks_ sorted by ticket for Release's search.
    blocks_.push_back(Entry{next_ticket_ - 1, begin, true});
  }
  const uint64_t ticket = next_ticket_++;
  blocks_.push_back(Entry{ticket, begin + size, false});
  head_ = begin + size;
  return Block{base_ + begin % capacity_, ticket};
}

void StagingRing::Release(uint64_t ticket) {
  if (ticket == 0) return;
  // Tickets grow with every acquisition and blocks_ is in acquisition order (a skipped end
  // carries the ticket before it): a binary search, not a scan (a prefill's offload holds
  // many blocks at once, and releases each). The first entry of a ticket is its block.
  const auto it = std::lower_bound(blocks_.begin(), blocks_.end(), ticket,
                                   [](const Entry& e, uint64_t t) { return e.ticket < t; });
  if (it != blocks_.end() && it->ticket == ticket) it->released = true;
  while (!blocks_.empty() && blocks_.front().released) {
    tail_ = blocks_.front().end;
    blocks_.pop_front();
  }
  if (blocks_.empty()) tail_ = head_;
}

}  // namespace kvtier
