#include "daemon/peer_table.h"

#include <sys/socket.h>

namespace kvtier::daemon {

std::optional<PeerCredentials> PeerCredentialsOf(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return std::nullopt;
  return PeerCredentials{.pid = cred.pid, .uid = cred.uid, .gid = cred.gid};
}

}  // namespace kvtier::daemon
