// The client side of the shared-memory attach handshake (daemon/attach_server.h): connects
// to the daemon's attach socket, sends tenant and token, receives the tenant arena's memfd
// over SCM_RIGHTS and maps it (HostArena::Map).
//
// Thread-safe (no shared state).
#ifndef KVTIER_CLIENT_SHM_ATTACH_H_
#define KVTIER_CLIENT_SHM_ATTACH_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "offload/host_arena.h"

namespace kvtier {

struct AttachedArena {
  std::unique_ptr<HostArena> arena;  // the tenant's arena, mapped MAP_SHARED
  uint32_t region_layout_version = 0;
  std::string name;
};

// UNAVAILABLE when nothing listens at `path`; the daemon's refusal code and message
// otherwise (PERMISSION_DENIED, NOT_FOUND, ...); DEADLINE_EXCEEDED after `timeout`;
// FAILED_PRECONDITION for a reply without a descriptor or with an unknown layout version.
absl::StatusOr<AttachedArena> AttachToArena(const std::string& path, std::string_view tenant,
                                            std::string_view token,
                                            absl::Duration timeout = absl::Seconds(5));

}  // namespace kvtier

#endif  // KVTIER_CLIENT_SHM_ATTACH_H_
