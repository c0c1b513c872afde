#include "offload/host_tier.h"

#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/status.h"
#include "kvtier/layout.h"
#include "offload/host_arena.h"
#include "offload/page_pool.h"

namespace kvtier {

namespace {

class OwnedHostTier final : public HostTier {
 public:
  OwnedHostTier(std::unique_ptr<HostArena> arena, std::unique_ptr<PagePool> pool)
      : arena_(std::move(arena)), pool_(std::move(pool)) {}
  PagePool& pool() override { return *pool_; }
  absl::Status Commit(std::span<const StoredPage>) override { return absl::OkStatus(); }

 private:
  std::unique_ptr<HostArena> arena_;  // outlives the pool
  std::unique_ptr<PagePool> pool_;
};

}  // namespace

void HostPageToRows(const Geometry& geometry, const void* page, void* k, void* v) {
  const int32_t p = geometry.page_size;
  const size_t elem = geometry.element_bytes();
  const size_t row = static_cast<size_t>(geometry.head_dim) * elem;
  const HostPageLayout hl{geometry.num_kv_heads, p, geometry.head_dim};
  const auto* src = static_cast<const uint8_t*>(page);
  for (int32_t h = 0; h < geometry.num_kv_heads; ++h) {
    for (int32_t t = 0; t < p; ++t) {
      const size_t dst = (static_cast<size_t>(t) * geometry.num_kv_heads + h) * row;
      std::memcpy(static_cast<uint8_t*>(k) + dst, src + hl.Offset(h, kKey, t, 0) * elem, row);
      std::memcpy(static_cast<uint8_t*>(v) + dst, src + hl.Offset(h, kValue, t, 0) * elem, row);
    }
  }
}

absl::StatusOr<std::unique_ptr<HostTier>> NewOwnedHostTier(const Geometry& geometry,
                                                           int32_t max_tokens, Backend& backend) {
  KVTIER_RETURN_IF_ERROR(geometry.Validate());
  if (max_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("max_tokens = %d must be >= 1", max_tokens));
  }
  const int64_t pages =
      int64_t{geometry.num_layers} * ((max_tokens + geometry.page_size - 1) / geometry.page_size);
  ArenaOptions ao;
  ao.bytes = static_cast<size_t>(pages) * geometry.host_page_bytes();
  ao.name = "kvtier-sequence";
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<HostArena> arena, HostArena::Create(ao));
  KVTIER_RETURN_IF_ERROR(arena->RegisterWith(backend));
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<PagePool> pool,
                          PagePool::CreateInArena(*arena, geometry.host_page_bytes()));
  return std::unique_ptr<HostTier>(new OwnedHostTier(std::move(arena), std::move(pool)));
}

}  // namespace kvtier
