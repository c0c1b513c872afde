// Claiming the path of a listening Unix socket, for every socket kvtierd serves (gRPC, the
// shared-memory attach socket, the metrics endpoint): a path nobody uses is free, a socket
// file left by a process that died without unlinking it is removed, and anything else stays
// where it is and is an error.
//
// Thread-compatible (it acts on the file system; two claimants of one path race as they
// would with bind).
#ifndef KVTIER_DAEMON_UNIX_SOCKET_H_
#define KVTIER_DAEMON_UNIX_SOCKET_H_

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvtier::daemon {

// Makes `path` free to bind. Returns true when it removed a stale socket there (connecting
// to it was refused), false when nothing was there. FAILED_PRECONDITION, naming `what` ("the
// attach socket") and the path: a live process listens there (`in_use_hint` is appended:
// what to do about it), the file is not a socket, or it cannot be probed or removed;
// RESOURCE_EXHAUSTED when no socket can be made to probe it.
absl::StatusOr<bool> ClaimUnixSocketPath(std::string_view what, const std::string& path,
                                         std::string_view in_use_hint = "");

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_UNIX_SOCKET_H_
