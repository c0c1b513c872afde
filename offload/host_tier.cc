#include "offload/host_tier.h"

#include <string>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/status.h"
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
