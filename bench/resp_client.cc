#include "bench/resp_client.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace kvtier::bench {

std::string EncodeCommand(const std::vector<std::string_view>& args) {
  std::string out = absl::StrCat("*", args.size(), "\r\n");
  for (std::string_view a : args) {
    absl::StrAppend(&out, "$", a.size(), "\r\n");
    out.append(a);
    out += "\r\n";
  }
  return out;
}

absl::StatusOr<std::unique_ptr<RespClient>> RespClient::ConnectUnix(const std::string& path) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("redis socket path has ", path.size(), " bytes; the limit is ",
                     sizeof(addr.sun_path) - 1));
  }
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::ResourceExhaustedError(absl::StrCat("socket: ", strerror(errno)));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("redis at ", path, ": ", strerror(err)));
  }
  return std::unique_ptr<RespClient>(new RespClient(fd));
}

RespClient::~RespClient() { ::close(fd_); }

absl::Status RespClient::WriteAll(std::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::UnavailableError(absl::StrCat("redis send: ", strerror(errno)));
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

absl::Status RespClient::Fill() {
  if (pos_ > 0 && pos_ == buf_.size()) {
    buf_.clear();
    pos_ = 0;
  }
  char tmp[1 << 16];
  ssize_t n;
  do {
    n = ::recv(fd_, tmp, sizeof(tmp), 0);
  } while (n < 0 && errno == EINTR);
  if (n <= 0) return absl::UnavailableError("redis closed the connection");
  buf_.append(tmp, static_cast<size_t>(n));
  return absl::OkStatus();
}

absl::StatusOr<std::string> RespClient::ReadLine() {
  for (;;) {
    const size_t eol = buf_.find("\r\n", pos_);
    if (eol != std::string::npos) {
      std::string line = buf_.substr(pos_, eol - pos_);
      pos_ = eol + 2;
      return line;
    }
    KVTIER_RETURN_IF_ERROR(Fill());
  }
}

absl::Status RespClient::ReadExact(size_t n, std::string* out) {
  while (buf_.size() - pos_ < n + 2) KVTIER_RETURN_IF_ERROR(Fill());
  out->assign(buf_, pos_, n);
  pos_ += n + 2;  // the bulk string's trailing CRLF
  if (pos_ == buf_.size()) {
    buf_.clear();
    pos_ = 0;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> RespClient::ReadReply(bool* is_nil) {
  *is_nil = false;
  KVTIER_ASSIGN_OR_RETURN(std::string line, ReadLine());
  if (line.empty()) return absl::InternalError("redis: empty reply line");
  const char kind = line[0];
  std::string rest = line.substr(1);
  switch (kind) {
    case '+':
    case ':':
      return rest;
    case '-':
      return absl::InternalError(absl::StrCat("redis error: ", rest));
    case '$': {
      int64_t len = 0;
      if (!absl::SimpleAtoi(rest, &len)) return absl::InternalError("redis: bad bulk length");
      if (len < 0) {
        *is_nil = true;
        return std::string();
      }
      std::string value;
      KVTIER_RETURN_IF_ERROR(ReadExact(static_cast<size_t>(len), &value));
      return value;
    }
    default:
      return absl::InternalError(absl::StrCat("redis: unexpected reply type '", line, "'"));
  }
}

absl::Status RespClient::SetMany(const std::vector<std::string>& keys,
                                 const std::vector<std::string_view>& values) {
  if (keys.size() != values.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(keys.size(), " keys but ", values.size(), " values"));
  }
  std::string out;
  for (size_t i = 0; i < keys.size(); ++i) {
    // Header, then the value straight from the caller's buffer: no copy of page bytes.
    out = absl::StrCat("*3\r\n$3\r\nSET\r\n$", keys[i].size(), "\r\n", keys[i], "\r\n$",
                       values[i].size(), "\r\n");
    KVTIER_RETURN_IF_ERROR(WriteAll(out));
    KVTIER_RETURN_IF_ERROR(WriteAll(values[i]));
    KVTIER_RETURN_IF_ERROR(WriteAll("\r\n"));
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    bool nil = false;
    KVTIER_ASSIGN_OR_RETURN(std::string reply, ReadReply(&nil));
    if (reply != "OK") return absl::InternalError(absl::StrCat("redis SET replied ", reply));
  }
  return absl::OkStatus();
}

absl::Status RespClient::GetMany(const std::vector<std::string>& keys,
                                 std::vector<std::string>* out) {
  std::string cmds;
  for (const std::string& k : keys) cmds += EncodeCommand({"GET", k});
  KVTIER_RETURN_IF_ERROR(WriteAll(cmds));
  out->resize(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    bool nil = false;
    KVTIER_ASSIGN_OR_RETURN((*out)[i], ReadReply(&nil));
    if (nil) return absl::NotFoundError(absl::StrCat("redis: no key ", keys[i]));
  }
  return absl::OkStatus();
}

absl::Status RespClient::Ping() {
  KVTIER_RETURN_IF_ERROR(WriteAll(EncodeCommand({"PING"})));
  bool nil = false;
  KVTIER_ASSIGN_OR_RETURN(std::string reply, ReadReply(&nil));
  if (reply != "PONG") return absl::InternalError(absl::StrCat("redis PING replied ", reply));
  return absl::OkStatus();
}

absl::Status RespClient::FlushAll() {
  KVTIER_RETURN_IF_ERROR(WriteAll(EncodeCommand({"FLUSHALL"})));
  bool nil = false;
  return ReadReply(&nil).status();
}

}  // namespace kvtier::bench
