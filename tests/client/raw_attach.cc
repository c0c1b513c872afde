#include "tests/client/raw_attach.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

namespace kvtier::testing {

std::string FramedAttachRequest(const v1::AttachRequest& request) {
  const std::string body = request.SerializeAsString();
  std::string out(4, '\0');
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((body.size() >> (8 * i)) & 0xff);
  return out + body;
}

RawAttachResult RawAttachExchange(const std::string& path, const std::string& bytes,
                                  absl::Duration timeout) {
  RawAttachResult result;
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return result;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  path.copy(addr.sun_path, sizeof(addr.sun_path) - 1);
  const timeval tv = absl::ToTimeval(timeout);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return result;
  }
  result.connected = true;
  (void)!send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  shutdown(fd, SHUT_WR);
  std::string reply;
  for (;;) {
    char buf[4096];
    iovec iov{.iov_base = buf, .iov_len = sizeof(buf)};
    alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t got = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
    if (got <= 0) break;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < n; ++i) {
        int passed = -1;
        std::memcpy(&passed, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        close(passed);
        ++result.descriptors;
      }
    }
    reply.append(buf, static_cast<size_t>(got));
  }
  close(fd);
  v1::AttachReply parsed;
  if (reply.size() >= 4 && parsed.ParseFromString(reply.substr(4))) result.reply = parsed;
  return result;
}

}  // namespace kvtier::testing
