// AttachServer on Boost.Asio. Invariants:
//  - Every Asio object lives on the one io thread; handlers never run concurrently, so the
//    connection count needs no lock. Stop() runs the teardown only after that thread is
//    joined: acceptor and timer first, then the io_context, whose destruction destroys the
//    pending handlers and with them the connections they own.
//  - A connection owns a dup of the granted fd from the decision until its reply's first
//    byte is sent (the descriptor travels with it), so the authorizer's fd need only be
//    open during the call.
//  - Nothing the peer sends can make a handler throw or read out of bounds: the length is
//    checked before the body is read, and every error closes the connection.
//  - A connection holds a place in peers_ from Start until it closes or is replaced there. A
//    closed connection is never counted or replaced again, though its handlers may still hold
//    it for a moment.
#include "daemon/attach_server.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_format.h"
#include "core/mutex.h"
#include "core/status.h"
#include "daemon/unix_socket.h"
#include "kvtier/v1/kvtier.pb.h"
#include "offload/session_region.h"

namespace kvtier::daemon {
namespace {

namespace asio = boost::asio;
using Local = asio::local::stream_protocol;

constexpr size_t kLengthBytes = 4;  // the little-endian length prefix
constexpr int kListenBacklog = 64;
// How long accept waits after a failure such as EMFILE before trying again.
constexpr std::chrono::milliseconds kAcceptRetry(100);

std::string ErrnoText(int err) { return std::strerror(err); }

absl::Status CheckPath(const std::string& path) {
  constexpr size_t kMaxPath = sizeof(sockaddr_un::sun_path) - 1;
  if (path.empty()) return absl::InvalidArgumentError("attach socket path is empty");
  if (path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError("attach socket path contains a NUL byte");
  }
  if (path.size() > kMaxPath) {
    return absl::InvalidArgumentError(
        absl::StrFormat("attach socket path is %d bytes; a Unix socket path holds at most %d",
                        path.size(), kMaxPath));
  }
  return absl::OkStatus();
}

std::string EncodeReply(const v1::AttachReply& reply) {
  const std::string body = reply.SerializeAsString();
  const auto n = static_cast<uint32_t>(body.size());
  std::string out(kLengthBytes, '\0');
  for (size_t i = 0; i < kLengthBytes; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + body;
}

class AttachServerImpl;
class Connection;
using Peers = PeerTable<pid_t, Connection*>;  // the connections of each peer process

// One handshake: read the request, answer, close. Owned by its pending handlers.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(AttachServerImpl& server, Local::socket socket, const PeerCredentials& peer,
             bool peer_known);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // `ticket`: its place in the server's peers_.
  void Start(uint64_t ticket);
  // Closes the socket (pending reads end with operation_aborted) and leaves peers_.
  void Close();

 private:
  friend class AttachServerImpl;
  void ReadBody();
  void Decide();
  void Refuse(const absl::Status& status);
  void Send(const v1::AttachReply& reply, int owned_fd);
  void TrySend();

  AttachServerImpl& server_;
  Local::socket socket_;
  const PeerCredentials peer_;
  const bool peer_known_;           // SO_PEERCRED answered
  std::optional<uint64_t> ticket_;  // its place in server_.peers_, until it leaves
  bool answered_ = false;
  asio::steady_timer deadline_;
  unsigned char header_[kLengthBytes] = {};
  std::string body_;
  std::string out_;   // the encoded reply
  size_t sent_ = 0;   // bytes of out_ sent
  int send_fd_ = -1;  // owned; sent with the first byte, then closed
};

class AttachServerImpl final : public AttachServer {
 public:
  AttachServerImpl(std::string path, AttachAuthorizer authorize, AttachServerOptions options)
      : path_(std::move(path)),
        authorize_(std::move(authorize)),
        options_(options),
        peers_({.max_total = options.max_connections,
                .max_per_peer = options.max_connections_per_peer}) {
    io_.emplace();
    acceptor_.emplace(*io_);
    retry_.emplace(*io_);
  }
  ~AttachServerImpl() override { Stop(); }

  // Binds, sets the mode and listens. On failure the caller destroys the server, which
  // unlinks whatever was bound.
  absl::Status Listen() {
    boost::system::error_code ec;
    acceptor_->open(Local(), ec);
    if (ec) return absl::ResourceExhaustedError("attach socket: socket(): " + ec.message());
    acceptor_->bind(Local::endpoint(path_), ec);
    if (ec) {
      return absl::FailedPreconditionError(
          absl::StrFormat("binding attach socket %s: %s", path_, ec.message()));
    }
    struct stat st {};
    if (lstat(path_.c_str(), &st) == 0) bound_ = std::make_pair(st.st_dev, st.st_ino);
    if (chmod(path_.c_str(), 0660) != 0) {
      return absl::FailedPreconditionError(
          absl::StrFormat("chmod 0660 of attach socket %s: %s", path_, ErrnoText(errno)));
    }
    acceptor_->listen(kListenBacklog, ec);
    if (ec) {
      return absl::FailedPreconditionError(
          absl::StrFormat("listening on attach socket %s: %s", path_, ec.message()));
    }
    return absl::OkStatus();
  }

  void Run() {
    Accept();
    thread_ = std::thread([this] { Loop(); });
  }

  void Stop() override {
    MutexLock lock(&stop_mu_);
    if (stopped_) return;
    stopped_ = true;
    io_->stop();
    if (thread_.joinable()) thread_.join();
    acceptor_.reset();
    retry_.reset();
    io_.reset();
    // Only our own socket file: another daemon may have replaced it since.
    struct stat st {};
    if (bound_.has_value() && lstat(path_.c_str(), &st) == 0 &&
        std::make_pair(st.st_dev, st.st_ino) == *bound_) {
      unlink(path_.c_str());
    }
  }

  const std::string& path() const override { return path_; }
  uint64_t granted() const override { return granted_.load(); }
  uint64_t refused() const override { return refused_.load(); }
  uint64_t dropped() const override { return dropped_.load(); }
  std::vector<std::pair<std::string, uint64_t>> Outcomes() const override {
    std::vector<std::pair<std::string, uint64_t>> out;
    for (size_t c = 0; c < refused_by_code_.size(); ++c) {
      const uint64_t n = c == 0 ? granted_.load() : refused_by_code_[c].load();
      if (n == 0) continue;
      out.emplace_back(
          absl::AsciiStrToLower(absl::StatusCodeToString(static_cast<absl::StatusCode>(c))), n);
    }
    const std::pair<const char*, const std::atomic<uint64_t>*> drops[] = {
        {"dropped_peer_limit", &dropped_peer_limit_},
        {"dropped_global_limit", &dropped_global_limit_},
        {"dropped_timeout", &dropped_timeout_}};
    for (const auto& [name, n] : drops) {
      if (n->load() != 0) out.emplace_back(name, n->load());
    }
    return out;
  }

 private:
  friend class Connection;

  void Loop() {
    auto guard = asio::make_work_guard(*io_);
    for (;;) {
      try {
        io_->run();
        return;
      } catch (const std::exception& e) {  // e.g. bad_alloc in a handler: keep serving
        std::fprintf(stderr, "kvtier attach server %s: handler failed: %s\n", path_.c_str(),
                     e.what());
      }
    }
  }

  void Accept() {
    acceptor_->async_accept([this](boost::system::error_code ec, Local::socket socket) {
      if (ec == asio::error::operation_aborted) return;
      if (ec) {  // EMFILE and the like: back off instead of spinning
        retry_->expires_after(kAcceptRetry);
        retry_->async_wait([this](boost::system::error_code wait_ec) {
          if (!wait_ec) Accept();
        });
        return;
      }
      Admit(std::move(socket));
      Accept();
    });
  }

  // Serves `socket` unless its peer holds its share already; makes room at the global
  // limit by closing the oldest connection of the peer that holds the most.
  void Admit(Local::socket socket) {
    // Unknown credentials are refused once the request is read. A process in another pid
    // namespace (an engine container beside the daemon's) shows pid 0: such peers are told
    // apart by uid, under keys no pid takes.
    const std::optional<PeerCredentials> cred = PeerCredentialsOf(socket.native_handle());
    const PeerCredentials peer = cred.value_or(PeerCredentials{});
    const pid_t key = !cred.has_value() ? 0
                      : peer.pid != 0   ? peer.pid
                                        : -static_cast<pid_t>(peer.uid & 0x3fffffff) - 1;
    auto connection =
        std::make_shared<Connection>(*this, std::move(socket), peer, cred.has_value());
    Peers::Admission admission = peers_.Admit(key, connection.get());
    if (!admission.admitted) {
      ++dropped_;  // the socket closes here: the client sees the end without a reply
      ++dropped_peer_limit_;
      return;
    }
    if (admission.evicted.has_value()) {
      ++dropped_;
      ++dropped_global_limit_;
      (*admission.evicted)->Close();
    }
    connection->Start(admission.ticket);
  }

  void Leave(Connection* c) {
    if (!c->ticket_.has_value()) return;
    peers_.Remove(*c->ticket_);  // false when it was replaced: its place is gone already
    c->ticket_.reset();
  }

  const std::string path_;
  const AttachAuthorizer authorize_;
  const AttachServerOptions options_;
  // Destroyed explicitly by Stop(), in this order: acceptor_ and retry_, then io_.
  std::optional<asio::io_context> io_;
  std::optional<Local::acceptor> acceptor_;
  std::optional<asio::steady_timer> retry_;
  std::thread thread_;
  std::optional<std::pair<dev_t, ino_t>> bound_;  // the socket file we created
  // io thread only.
  Peers peers_;
  std::atomic<uint64_t> granted_{0};
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> dropped_{0};
  std::atomic<uint64_t> dropped_peer_limit_{0};
  std::atomic<uint64_t> dropped_global_limit_{0};
  std::atomic<uint64_t> dropped_timeout_{0};
  // Refusals by absl::StatusCode (index 0 unused: granted_ counts the OK ones).
  std::array<std::atomic<uint64_t>, 17> refused_by_code_{};
  Mutex stop_mu_;
  bool stopped_ ABSL_GUARDED_BY(stop_mu_) = false;
};

Connection::Connection(AttachServerImpl& server, Local::socket socket, const PeerCredentials& peer,
                       bool peer_known)
    : server_(server),
      socket_(std::move(socket)),
      peer_(peer),
      peer_known_(peer_known),
      deadline_(*server.io_) {}

Connection::~Connection() {
  if (send_fd_ >= 0) close(send_fd_);
  server_.Leave(this);
}

void Connection::Start(uint64_t ticket) {
  ticket_ = ticket;
  deadline_.expires_after(absl::ToChronoNanoseconds(server_.options_.handshake_timeout));
  deadline_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
    if (ec) return;
    if (!self->answered_) {  // too slow: drop it, no reply
      ++self->server_.dropped_;
      ++self->server_.dropped_timeout_;
    }
    self->Close();
  });
  asio::async_read(socket_, asio::buffer(header_),
                   [self = shared_from_this()](boost::system::error_code ec, size_t) {
                     if (ec) return self->Close();
                     self->ReadBody();
                   });
}

void Connection::ReadBody() {
  uint32_t n = 0;
  for (size_t i = 0; i < kLengthBytes; ++i) n |= uint32_t{header_[i]} << (8 * i);
  if (n > server_.options_.max_request_bytes) {
    return Refuse(absl::InvalidArgumentError(
        absl::StrFormat("AttachRequest length is %d bytes; max_request_bytes is %d", n,
                        server_.options_.max_request_bytes)));
  }
  body_.resize(n);
  if (n == 0) return Decide();
  asio::async_read(socket_, asio::buffer(body_.data(), body_.size()),
                   [self = shared_from_this()](boost::system::error_code ec, size_t) {
                     if (ec) return self->Close();  // truncated: the client went away
                     self->Decide();
                   });
}

void Connection::Decide() {
  v1::AttachRequest request;
  if (!request.ParseFromString(body_)) {
    return Refuse(absl::InvalidArgumentError(
        absl::StrFormat("AttachRequest of %d bytes does not parse", body_.size())));
  }
  const AttachServerOptions& o = server_.options_;
  if (request.protocol_version() == 0) {
    return Refuse(absl::InvalidArgumentError(
        absl::StrFormat("AttachRequest.protocol_version is 0 (unset); this daemon speaks "
                        "protocol versions %d to %d",
                        o.min_protocol_version, o.max_protocol_version)));
  }
  if (request.protocol_version() < o.min_protocol_version ||
      request.protocol_version() > o.max_protocol_version) {
    return Refuse(absl::FailedPreconditionError(absl::StrFormat(
        "AttachRequest.protocol_version = %d: this daemon speaks protocol versions %d to %d",
        request.protocol_version(), o.min_protocol_version, o.max_protocol_version)));
  }
  if (!peer_known_) {
    return Refuse(absl::InternalError("SO_PEERCRED of the attach peer failed: uid unknown"));
  }
  absl::StatusOr<AttachGrant> grant = server_.authorize_(peer_, request.tenant(), request.token());
  if (!grant.ok()) return Refuse(grant.status());
  const int fd = grant->fd < 0 ? -1 : fcntl(grant->fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) {
    return Refuse(grant->fd < 0 ? absl::InternalError("the authorizer granted no descriptor")
                                : absl::ResourceExhaustedError(absl::StrFormat(
                                      "duplicating arena fd %d: %s", grant->fd, ErrnoText(errno))));
  }
  v1::AttachReply reply;
  reply.set_code(0);
  reply.set_arena_bytes(grant->arena_bytes);
  reply.set_region_layout_version(kRegionLayoutVersion);
  reply.set_arena_name(grant->arena_name);
  ++server_.granted_;
  Send(reply, fd);
}

void Connection::Refuse(const absl::Status& status) {
  v1::AttachReply reply;
  reply.set_code(static_cast<int32_t>(status.code()));
  reply.set_message(std::string(status.message()));
  ++server_.refused_;
  const auto code = static_cast<size_t>(status.code());
  if (code > 0 && code < server_.refused_by_code_.size()) ++server_.refused_by_code_[code];
  Send(reply, -1);
}

void Connection::Send(const v1::AttachReply& reply, int owned_fd) {
  answered_ = true;
  out_ = EncodeReply(reply);
  sent_ = 0;
  send_fd_ = owned_fd;
  boost::system::error_code ec;
  socket_.non_blocking(true, ec);
  if (ec) return Close();
  TrySend();
}

// sendmsg by hand: Asio has no ancillary data. The descriptor rides on the first byte.
void Connection::TrySend() {
  while (sent_ < out_.size()) {
    iovec iov{.iov_base = out_.data() + sent_, .iov_len = out_.size() - sent_};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    if (send_fd_ >= 0) {
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
      cmsg->cmsg_level = SOL_SOCKET;
      cmsg->cmsg_type = SCM_RIGHTS;
      cmsg->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(cmsg), &send_fd_, sizeof(int));
    }
    const ssize_t n = sendmsg(socket_.native_handle(), &msg, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      socket_.async_wait(Local::socket::wait_write,
                         [self = shared_from_this()](boost::system::error_code ec) {
                           if (ec) return self->Close();
                           self->TrySend();
                         });
      return;
    }
    if (n < 0) return Close();  // the peer went away
    if (send_fd_ >= 0) {
      close(send_fd_);  // the peer holds its own reference now
      send_fd_ = -1;
    }
    sent_ += static_cast<size_t>(n);
  }
  Close();
}

void Connection::Close() {
  server_.Leave(this);
  boost::system::error_code ec;
  socket_.close(ec);   // pending reads complete with operation_aborted
  deadline_.cancel();  // releases the deadline handler's reference
}

}  // namespace

absl::StatusOr<std::unique_ptr<AttachServer>> AttachServer::Start(
    const std::string& path, AttachAuthorizer authorize, const AttachServerOptions& options) {
  KVTIER_RETURN_IF_ERROR(CheckPath(path));
  if (!authorize) return absl::InvalidArgumentError("attach server needs an authorizer");
  if (options.handshake_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("handshake_timeout is %s; it must be > 0",
                        absl::FormatDuration(options.handshake_timeout)));
  }
  if (options.max_request_bytes == 0 || options.max_connections == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("max_request_bytes (%d) and max_connections (%d) must be > 0",
                        options.max_request_bytes, options.max_connections));
  }
  if (options.max_connections_per_peer == 0 ||
      options.max_connections_per_peer > options.max_connections) {
    return absl::InvalidArgumentError(
        absl::StrFormat("max_connections_per_peer = %d must be in [1, max_connections = %d]",
                        options.max_connections_per_peer, options.max_connections));
  }
  if (options.min_protocol_version == 0 ||
      options.min_protocol_version > options.max_protocol_version) {
    return absl::InvalidArgumentError(
        absl::StrFormat("protocol versions [%d, %d]: need 1 <= min <= max",
                        options.min_protocol_version, options.max_protocol_version));
  }
  KVTIER_RETURN_IF_ERROR(ClaimUnixSocketPath("attach socket", path, "another kvtierd?").status());
  auto server = std::make_unique<AttachServerImpl>(path, std::move(authorize), options);
  KVTIER_RETURN_IF_ERROR(server->Listen());
  server->Run();
  return server;
}

}  // namespace kvtier::daemon
