#include "daemon/unix_socket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_format.h"

namespace kvtier::daemon {

absl::StatusOr<bool> ClaimUnixSocketPath(std::string_view what, const std::string& path,
                                         std::string_view in_use_hint) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return false;
    return absl::FailedPreconditionError(
        absl::StrFormat("%s %s: %s", what, path, std::strerror(errno)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s %s exists and is not a socket; remove it or choose another path", what, path));
  }
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("socket() to probe %s %s: %s", what, path, std::strerror(errno)));
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  path.copy(addr.sun_path, sizeof(addr.sun_path) - 1);
  // Non-blocking: a live listener with a full backlog answers EAGAIN instead of blocking.
  const int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  const int err = errno;
  ::close(fd);
  if (rc == 0 || err == EAGAIN || err == EINPROGRESS) {
    return absl::FailedPreconditionError(
        absl::StrFormat("%s %s is in use by a live process%s%s", what, path,
                        in_use_hint.empty() ? "" : "; ", in_use_hint));
  }
  if (err != ECONNREFUSED) {
    return absl::FailedPreconditionError(
        absl::StrFormat("%s %s exists and probing it failed (%s); not replacing it", what, path,
                        std::strerror(err)));
  }
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::FailedPreconditionError(absl::StrFormat("%s %s is stale but cannot be removed: %s",
                                                         what, path, std::strerror(errno)));
  }
  return true;
}

}  // namespace kvtier::daemon
