// AttachToArena: one blocking exchange on a non-blocking socket, every wait bounded by
// poll() against one deadline. Invariant: every descriptor that arrives (the arena's, or
// stray ones a misbehaving daemon sends) is owned by a ScopedFd from the recvmsg that
// received it, so no error path leaks one.
#include "client/shm_attach.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "kvtier/client.h"
#include "kvtier/v1/kvtier.pb.h"
#include "offload/session_region.h"

namespace kvtier {
namespace {

constexpr size_t kLengthBytes = 4;
constexpr uint32_t kMaxReplyBytes = 64 << 10;  // a reply is a few hundred bytes
constexpr int kMaxFdsPerMessage = 4;           // room for stray descriptors, closed unused

class ScopedFd {
 public:
  explicit ScopedFd(int fd = -1) : fd_(fd) {}
  ScopedFd(ScopedFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  ScopedFd& operator=(ScopedFd&& other) noexcept {
    if (this != &other) {
      Reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  ~ScopedFd() { Reset(); }
  int get() const { return fd_; }
  void Reset() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

std::string ErrnoText(int err) { return std::strerror(err); }

// Waits until `fd` is ready for `events`; DEADLINE_EXCEEDED when `deadline` passes first.
absl::Status WaitFor(int fd, short events, absl::Time deadline, const char* what) {
  for (;;) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(
          absl::StrFormat("attach: the daemon did not answer (%s) within the timeout", what));
    }
    pollfd p{.fd = fd, .events = events, .revents = 0};
    const int ms =
        static_cast<int>(absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))));
    const int rc = poll(&p, 1, ms);
    if (rc > 0) return absl::OkStatus();  // ready, or an error/hangup the next call reports
    if (rc < 0 && errno != EINTR) return absl::InternalError("poll: " + ErrnoText(errno));
  }
}

absl::StatusOr<ScopedFd> Connect(const std::string& path, absl::Time deadline) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("attach socket path is %d bytes; a Unix socket path holds 1 to %d",
                        path.size(), sizeof(addr.sun_path) - 1));
  }
  ScopedFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (fd.get() < 0) return absl::ResourceExhaustedError("attach: socket(): " + ErrnoText(errno));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0) return fd;
  const int err = errno;
  if (err == EINPROGRESS) {
    KVTIER_RETURN_IF_ERROR(WaitFor(fd.get(), POLLOUT, deadline, "connect"));
    int so_error = 0;
    socklen_t len = sizeof(so_error);
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &so_error, &len);
    if (so_error == 0) return fd;
    return absl::UnavailableError(
        absl::StrFormat("attach: connecting to %s: %s", path, ErrnoText(so_error)));
  }
  // ENOENT / ECONNREFUSED: no daemon; EAGAIN: its backlog is full. All worth a retry later.
  return absl::UnavailableError(
      absl::StrFormat("attach: connecting to %s: %s", path, ErrnoText(err)));
}

absl::Status SendAll(int fd, const std::string& bytes, absl::Time deadline) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n >= 0) {
      sent += static_cast<size_t>(n);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      KVTIER_RETURN_IF_ERROR(WaitFor(fd, POLLOUT, deadline, "send"));
    } else if (errno != EINTR) {
      return absl::UnavailableError("attach: sending the request: " + ErrnoText(errno));
    }
  }
  return absl::OkStatus();
}

// Appends the descriptors of every SCM_RIGHTS message in `msg` to `fds`.
void TakeFds(msghdr& msg, std::vector<ScopedFd>& fds) {
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < n; ++i) {
      int one = -1;
      std::memcpy(&one, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds.emplace_back(one);
    }
  }
}

// Reads exactly `out.size()` bytes, collecting any descriptors that come with them.
absl::Status RecvAll(int fd, std::string& out, std::vector<ScopedFd>& fds, absl::Time deadline) {
  size_t got = 0;
  while (got < out.size()) {
    iovec iov{.iov_base = out.data() + got, .iov_len = out.size() - got};
    alignas(cmsghdr) char control[CMSG_SPACE(kMaxFdsPerMessage * sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
    if (n > 0) {
      TakeFds(msg, fds);
      if ((msg.msg_flags & MSG_CTRUNC) != 0) {
        return absl::InternalError("attach: the reply carried more descriptors than expected");
      }
      got += static_cast<size_t>(n);
    } else if (n == 0) {
      return absl::UnavailableError(absl::StrFormat(
          "attach: the daemon closed the connection after %d of %d reply bytes", got, out.size()));
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      KVTIER_RETURN_IF_ERROR(WaitFor(fd, POLLIN, deadline, "reply"));
    } else if (errno != EINTR) {
      return absl::UnavailableError("attach: reading the reply: " + ErrnoText(errno));
    }
  }
  return absl::OkStatus();
}

std::string EncodeRequest(std::string_view tenant, std::string_view token) {
  v1::AttachRequest request;
  request.set_protocol_version(kProtocolVersion);
  request.set_tenant(std::string(tenant));
  request.set_token(std::string(token));
  const std::string body = request.SerializeAsString();
  const auto n = static_cast<uint32_t>(body.size());
  std::string out(kLengthBytes, '\0');
  for (size_t i = 0; i < kLengthBytes; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + body;
}

absl::StatusCode CodeFromWire(int32_t code) {
  if (code < 1 || code > static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::StatusCode::kUnknown;
  }
  return static_cast<absl::StatusCode>(code);
}

}  // namespace

absl::StatusOr<AttachedArena> AttachToArena(const std::string& path, std::string_view tenant,
                                            std::string_view token, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  KVTIER_ASSIGN_OR_RETURN(ScopedFd sock, Connect(path, deadline));
  KVTIER_RETURN_IF_ERROR(SendAll(sock.get(), EncodeRequest(tenant, token), deadline));

  std::vector<ScopedFd> fds;
  std::string header(kLengthBytes, '\0');
  KVTIER_RETURN_IF_ERROR(RecvAll(sock.get(), header, fds, deadline));
  uint32_t n = 0;
  for (size_t i = 0; i < kLengthBytes; ++i) {
    n |= uint32_t{static_cast<unsigned char>(header[i])} << (8 * i);
  }
  if (n > kMaxReplyBytes) {
    return absl::InternalError(
        absl::StrFormat("attach: reply length %d bytes exceeds %d", n, kMaxReplyBytes));
  }
  std::string body(n, '\0');
  KVTIER_RETURN_IF_ERROR(RecvAll(sock.get(), body, fds, deadline));
  v1::AttachReply reply;
  if (!reply.ParseFromString(body)) {
    return absl::InternalError(absl::StrFormat("attach: reply of %d bytes does not parse", n));
  }
  if (reply.code() != 0) return absl::Status(CodeFromWire(reply.code()), reply.message());
  if (fds.size() != 1) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "attach: the daemon granted the attach with %d descriptors; expected 1", fds.size()));
  }
  if (reply.region_layout_version() != kRegionLayoutVersion) {
    return absl::FailedPreconditionError(
        absl::StrFormat("attach: the daemon's region_layout_version is %d; this client reads %d",
                        reply.region_layout_version(), kRegionLayoutVersion));
  }
  // Map dups the descriptor; ours closes with `fds`.
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<HostArena> arena,
                          HostArena::Map(fds[0].get(), reply.arena_bytes()));
  return AttachedArena{.arena = std::move(arena),
                       .region_layout_version = reply.region_layout_version(),
                       .name = reply.arena_name()};
}

}  // namespace kvtier
