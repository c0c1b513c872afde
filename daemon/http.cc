// HttpServer and HttpGet on Boost.Beast. Invariants:
//  - Every socket is an asio::generic::stream_protocol socket, so one code path serves TCP and
//    Unix sockets alike.
//  - A Connection is owned by its pending handlers and runs on its own strand: its handlers
//    never run concurrently, so its members need no lock. It holds a place in peers_ from its
//    admission until its destruction, or until a newcomer replaces it there (then it is closed
//    on its strand).
//  - Stop() tears down only after the I/O threads are joined: acceptor first, then the
//    io_context, whose destruction destroys the pending handlers and with them the connections.
//  - Each request's read and its reply's write have one absolute deadline each (the stream's
//    expiry), so a client that drips bytes is cut off at io_timeout like a silent one; the
//    read's headers have a nearer one (header_timeout).
//  - Nothing a client sends can make a handler throw out of the I/O loop: parse errors become
//    4xx replies, the handler's exceptions a 500.
#include "daemon/http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/asio/basic_socket_acceptor.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/generic/stream_protocol.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core/basic_stream.hpp>
#include <boost/beast/core/error.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
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
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/mutex.h"
#include "core/status.h"
#include "daemon/peer_table.h"
#include "daemon/unix_socket.h"

namespace kvtier::daemon {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using Generic = asio::generic::stream_protocol;
using Stream = beast::basic_stream<Generic>;
using Acceptor = asio::basic_socket_acceptor<Generic>;
using Tcp = asio::ip::tcp;

constexpr int kListenBacklog = 64;
constexpr size_t kMaxRequestBodyBytes = 64 << 10;  // GET and HEAD carry none; tolerate a little
constexpr size_t kMaxResponseHeaderBytes = 64 << 10;
// How long a connection closed after an error keeps reading (and discarding) what the client
// still sends, so that its reply is not lost to a reset.
constexpr absl::Duration kMaxLinger = absl::Seconds(1);
// How long accept waits after a failure such as EMFILE before trying again.
constexpr std::chrono::milliseconds kAcceptRetry(100);
constexpr char kAcceptedForms[] =
    "expected unix:/path/to.sock or host:port (IPv4, [IPv6] or a name; port 0 = any)";

std::string ErrnoText(int err) { return std::strerror(err); }

absl::Status BadAddress(std::string_view address, std::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrFormat("HTTP address '%s': %s; %s", address, why, kAcceptedForms));
}

// The endpoints `address` names: the Unix path, or every address a TCP host resolves to.
absl::StatusOr<std::vector<Generic::endpoint>> Resolve(const HttpAddress& address) {
  if (address.kind == HttpAddress::Kind::kUnix) {
    return std::vector<Generic::endpoint>{
        Generic::endpoint(asio::local::stream_protocol::endpoint(address.path))};
  }
  boost::system::error_code ec;
  const asio::ip::address ip = asio::ip::make_address(address.host, ec);
  if (!ec)
    return std::vector<Generic::endpoint>{Generic::endpoint(Tcp::endpoint(ip, address.port))};
  asio::io_context io;
  Tcp::resolver resolver(io);
  const auto results = resolver.resolve(address.host, std::to_string(address.port),
                                        Tcp::resolver::numeric_service, ec);
  if (ec || results.empty()) {
    return absl::UnavailableError(absl::StrFormat("resolving %s: %s", address.ToString(),
                                                  ec ? ec.message() : "no addresses"));
  }
  std::vector<Generic::endpoint> out;
  for (const auto& entry : results) out.emplace_back(entry.endpoint());
  return out;
}

// "host:port" or "[v6]:port" of a bound TCP socket.
std::string BoundTcpAddress(int fd, int* port) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "";
  char text[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof(text));
    *port = ntohs(a->sin6_port);
    return absl::StrFormat("[%s]:%d", text, *port);
  }
  const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
  inet_ntop(AF_INET, &a->sin_addr, text, sizeof(text));
  *port = ntohs(a->sin_port);
  return absl::StrFormat("%s:%d", text, *port);
}

// Who is at the other end of `fd`, as the fairness rule counts peers: "uid:N" on a Unix
// socket (SO_PEERCRED), the IP address on TCP (an IPv4 address mapped into IPv6 as IPv4); "?"
// when the socket cannot say (the client is gone already).
std::string PeerOf(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char text[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_UNIX) {
    const std::optional<PeerCredentials> peer = PeerCredentialsOf(fd);
    return peer.has_value() ? absl::StrCat("uid:", peer->uid) : "?";
  }
  if (ss.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr, text, sizeof(text));
    return text;
  }
  if (ss.ss_family == AF_INET6) {
    const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr;
    if (IN6_IS_ADDR_V4MAPPED(&a)) {
      inet_ntop(AF_INET, &a.s6_addr[12], text, sizeof(text));
    } else {
      inet_ntop(AF_INET6, &a, text, sizeof(text));
    }
    return text;
  }
  return "?";
}

// Whether `ec` says the peer sent something that is not HTTP (rather than leaving early).
bool IsMalformed(const beast::error_code& ec) {
  return ec && ec.category() == http::make_error_code(http::error::end_of_stream).category() &&
         ec != http::error::end_of_stream && ec != http::error::partial_message;
}

class HttpServerImpl;
class Connection;
// The connections of each peer (PeerOf); the items can outlive their connections.
using Peers = PeerTable<std::string, std::weak_ptr<Connection>>;

// One client connection: requests read and answered in turn until the client or an error
// closes it. Owned by its pending handlers.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(HttpServerImpl& server, Generic::socket socket);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Serves the connection admitted with `ticket` (its place in the server's peers_).
  void Start(uint64_t ticket);
  // Closes the connection from any thread (on its strand, soon): it was replaced.
  void CloseSoon();

 private:
  void ReadRequest();
  void OnRead(beast::error_code ec);
  void Serve(const http::request<http::string_body>& request);
  // Sends an error reply for a request that could not be read, then closes.
  void Refuse(http::status status, std::string_view why);
  void Write(HttpResponse response, bool keep_alive, bool head);
  void OnWrite(beast::error_code ec);
  // Half-closes and discards what the client still sends, briefly, then closes.
  void Linger();
  void Close();

  HttpServerImpl& server_;
  std::optional<uint64_t> ticket_;  // set by Start
  Stream stream_;
  // The end of the current request's read: io_timeout after it began.
  std::chrono::steady_clock::time_point request_deadline_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  http::response<http::string_body> response_;
  std::optional<http::response_serializer<http::string_body>> serializer_;
  bool close_after_write_ = false;
  char discard_[512] = {};
};

class HttpServerImpl final : public HttpServer {
 public:
  HttpServerImpl(HttpServerOptions options, HttpHandler handler)
      : options_(std::move(options)),
        handler_(std::move(handler)),
        peers_({.max_total = options_.max_connections,
                .max_per_peer = options_.max_connections_per_peer}) {
    io_.emplace(kThreads);
    acceptor_.emplace(*io_);
    retry_.emplace(*io_);
  }
  ~HttpServerImpl() override { Stop(); }

  // Binds and listens. On failure the caller destroys the server, which unlinks whatever
  // was bound.
  absl::Status Listen(const HttpAddress& address) {
    absl::StatusOr<std::vector<Generic::endpoint>> resolved = Resolve(address);
    if (!resolved.ok()) return absl::FailedPreconditionError(resolved.status().message());
    const std::vector<Generic::endpoint>& endpoints = *resolved;
    if (address.kind == HttpAddress::Kind::kUnix) {
      KVTIER_RETURN_IF_ERROR(ClaimUnixSocketPath("HTTP socket", address.path).status());
    }
    const Generic::endpoint& endpoint = endpoints.front();
    boost::system::error_code ec;
    acceptor_->open(endpoint.protocol(), ec);
    if (!ec && address.kind == HttpAddress::Kind::kTcp) {
      acceptor_->set_option(asio::socket_base::reuse_address(true), ec);
    }
    if (ec) return absl::ResourceExhaustedError("HTTP socket(): " + ec.message());
    acceptor_->bind(endpoint, ec);
    if (ec) {
      return absl::FailedPreconditionError(
          absl::StrFormat("binding HTTP address %s: %s", address.ToString(), ec.message()));
    }
    if (address.kind == HttpAddress::Kind::kUnix) {
      KVTIER_RETURN_IF_ERROR(OwnSocketFile(address.path));
      bound_address_ = address.ToString();
    } else {
      bound_address_ = BoundTcpAddress(acceptor_->native_handle(), &port_);
    }
    acceptor_->listen(kListenBacklog, ec);
    if (ec) {
      return absl::FailedPreconditionError(
          absl::StrFormat("listening on HTTP address %s: %s", address.ToString(), ec.message()));
    }
    return absl::OkStatus();
  }

  void Run() {
    Accept();
    for (int i = 0; i < kThreads; ++i) threads_.emplace_back([this] { Loop(); });
  }

  void Stop() override {
    MutexLock lock(&stop_mu_);
    if (stopped_) return;
    stopped_ = true;
    io_->stop();
    for (std::thread& t : threads_) t.join();
    acceptor_.reset();
    retry_.reset();
    io_.reset();  // destroys the pending handlers, and with them every connection
    // Only our own socket file: another server may have replaced it since.
    struct stat st {};
    if (bound_file_.has_value() && lstat(socket_path_.c_str(), &st) == 0 &&
        std::make_pair(st.st_dev, st.st_ino) == *bound_file_) {
      unlink(socket_path_.c_str());
    }
  }

  std::string address() const override { return bound_address_; }
  int port() const override { return port_; }
  uint64_t refused_connections() const override { return refused_.load(); }

 private:
  friend class Connection;

  // Remembers the socket file's identity (Stop unlinks only that one) and sets its mode.
  absl::Status OwnSocketFile(const std::string& path) {
    socket_path_ = path;
    struct stat st {};
    if (lstat(path.c_str(), &st) == 0) bound_file_ = std::make_pair(st.st_dev, st.st_ino);
    if (chmod(path.c_str(), 0660) != 0) {
      return absl::FailedPreconditionError(
          absl::StrFormat("chmod 0660 of unix:%s: %s", path, ErrnoText(errno)));
    }
    return absl::OkStatus();
  }

  void Loop() {
    auto guard = asio::make_work_guard(*io_);
    for (;;) {
      try {
        io_->run();
        return;
      } catch (const std::exception& e) {  // e.g. bad_alloc in a handler: keep serving
        std::fprintf(stderr, "kvtier HTTP server %s: handler failed: %s\n", bound_address_.c_str(),
                     e.what());
      }
    }
  }

  void Accept() {
    acceptor_->async_accept(
        asio::make_strand(*io_), [this](boost::system::error_code ec, Generic::socket socket) {
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

  // Serves `socket` unless its peer holds its share already; at max_connections, makes room
  // by closing the oldest connection of the peer that holds the most.
  void Admit(Generic::socket socket) {
    const std::string peer = PeerOf(socket.native_handle());
    auto connection = std::make_shared<Connection>(*this, std::move(socket));
    Peers::Admission admission;
    {
      MutexLock lock(&peers_mu_);
      admission = peers_.Admit(peer, connection);
    }
    if (!admission.admitted) {
      ++refused_;  // the socket closes here: the client sees the end without a reply
      return;
    }
    if (admission.evicted.has_value()) {
      ++refused_;
      // Expired when that connection is being destroyed already.
      if (std::shared_ptr<Connection> evicted = admission.evicted->lock()) evicted->CloseSoon();
    }
    connection->Start(admission.ticket);
  }

  void Leave(uint64_t ticket) {
    MutexLock lock(&peers_mu_);
    peers_.Remove(ticket);  // false when it was replaced: its place is gone already
  }

  // What the handler answers, or a 500 when it throws or answers an impossible status.
  HttpResponse Handle(const HttpRequest& request) {
    HttpResponse response;
    try {
      response = handler_(request);
    } catch (const std::exception& e) {
      return HttpResponse{.status = 500, .body = absl::StrCat("internal error: ", e.what(), "\n")};
    } catch (...) {
      return HttpResponse{.status = 500, .body = "internal error\n"};
    }
    if (response.status < 100 || response.status > 999) {
      return HttpResponse{.status = 500,
                          .body = absl::StrFormat(
                              "internal error: the handler answered status %d\n", response.status)};
    }
    return response;
  }

  const HttpServerOptions options_;
  const HttpHandler handler_;
  // Before io_: the connections that io_'s destruction destroys leave it.
  Mutex peers_mu_;
  Peers peers_ ABSL_GUARDED_BY(peers_mu_);
  // Destroyed explicitly by Stop(), in this order: acceptor_ and retry_, then io_.
  std::optional<asio::io_context> io_;
  std::optional<Acceptor> acceptor_;
  std::optional<asio::steady_timer> retry_;
  std::vector<std::thread> threads_;
  std::string bound_address_;
  int port_ = 0;
  std::string socket_path_;
  std::optional<std::pair<dev_t, ino_t>> bound_file_;  // the socket file we created
  std::atomic<uint64_t> refused_{0};
  Mutex stop_mu_;
  bool stopped_ ABSL_GUARDED_BY(stop_mu_) = false;
};

Connection::Connection(HttpServerImpl& server, Generic::socket socket)
    : server_(server), stream_(std::move(socket)) {}

Connection::~Connection() {
  if (ticket_.has_value()) server_.Leave(*ticket_);
}

void Connection::Start(uint64_t ticket) {
  ticket_ = ticket;
  ReadRequest();
}

void Connection::CloseSoon() {
  asio::post(stream_.get_executor(), [self = shared_from_this()] { self->Close(); });
}

void Connection::ReadRequest() {
  const HttpServerOptions& o = server_.options_;
  parser_.emplace();
  parser_->header_limit(
      static_cast<uint32_t>(std::min<size_t>(o.max_request_header_bytes, UINT32_MAX)));
  parser_->body_limit(kMaxRequestBodyBytes);
  // One deadline for the whole request (and, on a kept-alive connection, the wait for it),
  // and a nearer one for its headers: a connection that sends nothing is closed at that.
  const auto now = std::chrono::steady_clock::now();
  request_deadline_ = now + absl::ToChronoNanoseconds(o.io_timeout);
  stream_.expires_at(
      std::min(request_deadline_, now + absl::ToChronoNanoseconds(o.header_timeout)));
  // The header first, then the body: Beast 1.74 checks a Content-Length against body_limit
  // only when the header is parsed on its own (an eager parse loses that error).
  http::async_read_header(
      stream_, buffer_, *parser_, [self = shared_from_this()](beast::error_code ec, size_t) {
        if (ec || self->parser_->is_done()) return self->OnRead(ec);
        self->stream_.expires_at(self->request_deadline_);
        http::async_read(self->stream_, self->buffer_, *self->parser_,
                         [self](beast::error_code body_ec, size_t) { self->OnRead(body_ec); });
      });
}

void Connection::OnRead(beast::error_code ec) {
  if (ec == http::error::header_limit) {
    return Refuse(http::status::request_header_fields_too_large,
                  absl::StrFormat("request headers exceed %d bytes",
                                  server_.options_.max_request_header_bytes));
  }
  if (ec == http::error::body_limit) {
    return Refuse(http::status::payload_too_large,
                  absl::StrFormat("request body exceeds %d bytes", kMaxRequestBodyBytes));
  }
  if (IsMalformed(ec)) return Refuse(http::status::bad_request, ec.message());
  if (ec) return Close();  // the client left, timed out, or the socket broke
  Serve(parser_->get());
}

void Connection::Serve(const http::request<http::string_body>& request) {
  const bool head = request.method() == http::verb::head;
  if (!head && request.method() != http::verb::get) {
    response_ = {};
    response_.set(http::field::allow, "GET, HEAD");
    HttpResponse refusal{.status = 405,
                         .body = absl::StrFormat("method %s is not allowed; use GET or HEAD\n",
                                                 std::string(request.method_string()))};
    return Write(std::move(refusal), request.keep_alive(), false);
  }
  response_ = {};
  HttpResponse response = server_.Handle(HttpRequest{.method = std::string(request.method_string()),
                                                     .target = std::string(request.target())});
  Write(std::move(response), request.keep_alive(), head);
}

void Connection::Refuse(http::status status, std::string_view why) {
  response_ = {};
  Write(HttpResponse{.status = static_cast<int>(status), .body = absl::StrFormat("%s\n", why)},
        false, false);
}

void Connection::Write(HttpResponse response, bool keep_alive, bool head) {
  response_.version(11);
  response_.result(static_cast<unsigned>(response.status));
  response_.set(http::field::content_type, response.content_type);
  response_.body() = std::move(response.body);
  response_.prepare_payload();  // Content-Length from the body, also for HEAD
  response_.keep_alive(keep_alive);
  close_after_write_ = !keep_alive;
  serializer_.emplace(response_);
  stream_.expires_after(absl::ToChronoNanoseconds(server_.options_.io_timeout));
  auto done = [self = shared_from_this()](beast::error_code ec, size_t) { self->OnWrite(ec); };
  if (head) {
    http::async_write_header(stream_, *serializer_, std::move(done));
  } else {
    http::async_write(stream_, *serializer_, std::move(done));
  }
}

void Connection::OnWrite(beast::error_code ec) {
  serializer_.reset();
  if (ec) return Close();
  if (close_after_write_) return Linger();
  ReadRequest();
}

void Connection::Linger() {
  beast::error_code ignored;
  stream_.socket().shutdown(Generic::socket::shutdown_send, ignored);
  stream_.expires_after(
      absl::ToChronoNanoseconds(std::min(kMaxLinger, server_.options_.io_timeout)));
  stream_.async_read_some(asio::buffer(discard_),
                          [self = shared_from_this()](beast::error_code ec, size_t) {
                            if (ec) return self->Close();
                            self->Linger();
                          });
}

void Connection::Close() {
  beast::error_code ignored;
  stream_.socket().shutdown(Generic::socket::shutdown_both, ignored);
  stream_.close();
}

// One HttpGet on its own io_context: resolve (done before), connect, write, read, each bounded
// by the same absolute deadline.
class GetCall {
 public:
  GetCall(asio::io_context& io, std::string address, std::string host, std::string target,
          absl::Time deadline, size_t max_body_bytes)
      : stream_(io), address_(std::move(address)), deadline_(deadline) {
    request_.version(11);
    request_.method(http::verb::get);
    request_.target(target);
    request_.set(http::field::host, host);
    request_.set(http::field::user_agent, "kvtier");
    request_.keep_alive(false);
    parser_.header_limit(kMaxResponseHeaderBytes);
    parser_.body_limit(max_body_bytes);
    max_body_bytes_ = max_body_bytes;
  }

  void Start(const std::vector<Generic::endpoint>& endpoints) {
    stream_.expires_at(
        std::chrono::steady_clock::now() +
        absl::ToChronoNanoseconds(std::max(deadline_ - absl::Now(), absl::ZeroDuration())));
    stream_.async_connect(endpoints, [this](beast::error_code ec, const Generic::endpoint&) {
      if (ec) return Fail(ec, "connecting");
      http::async_write(stream_, request_, [this](beast::error_code wec, size_t) {
        if (wec) return Fail(wec, "sending the request");
        ReadReply();
      });
    });
  }

  absl::StatusOr<HttpResponse> result() && { return std::move(result_); }

 private:
  // The header first, then the body (see Connection::ReadRequest).
  void ReadReply() {
    http::async_read_header(stream_, buffer_, parser_, [this](beast::error_code ec, size_t) {
      if (ec) return Fail(ec, "reading the reply");
      if (parser_.is_done()) return Finish();
      http::async_read(stream_, buffer_, parser_, [this](beast::error_code body_ec, size_t) {
        if (body_ec) return Fail(body_ec, "reading the reply");
        Finish();
      });
    });
  }

  void Finish() {
    const auto& message = parser_.get();
    result_ = HttpResponse{.status = static_cast<int>(message.result_int()),
                           .content_type = std::string(message[http::field::content_type]),
                           .body = message.body()};
  }

  void Fail(beast::error_code ec, std::string_view phase) {
    if (ec == beast::error::timeout) {
      result_ = absl::DeadlineExceededError(
          absl::StrFormat("GET http %s: deadline passed while %s", address_, phase));
    } else if (phase == "connecting") {
      result_ = absl::UnavailableError(
          absl::StrFormat("GET http %s: cannot connect: %s", address_, ec.message()));
    } else if (ec == http::error::body_limit) {
      result_ = absl::ResourceExhaustedError(absl::StrFormat(
          "GET http %s: the reply's body is longer than %d bytes", address_, max_body_bytes_));
    } else if (IsMalformed(ec)) {
      result_ = absl::UnknownError(
          absl::StrFormat("GET http %s: malformed HTTP reply: %s", address_, ec.message()));
    } else {
      result_ = absl::UnavailableError(absl::StrFormat("GET http %s: connection lost while %s: %s",
                                                       address_, phase, ec.message()));
    }
    beast::error_code ignored;
    stream_.socket().close(ignored);
  }

  Stream stream_;
  const std::string address_;
  const absl::Time deadline_;
  size_t max_body_bytes_ = 0;
  http::request<http::empty_body> request_;
  beast::flat_buffer buffer_;
  http::response_parser<http::string_body> parser_;
  absl::StatusOr<HttpResponse> result_ = absl::InternalError("GET did not finish");
};

bool IsUnreserved(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' ||
         c == '~';
}

}  // namespace

std::string HttpAddress::ToString() const {
  switch (kind) {
    case Kind::kUnix:
      return absl::StrCat("unix:", path);
    case Kind::kTcp:
      if (host.find(':') != std::string::npos) return absl::StrFormat("[%s]:%d", host, port);
      return absl::StrFormat("%s:%d", host, port);
  }
  return "";
}

absl::StatusOr<HttpAddress> ParseHttpAddress(std::string_view address) {
  HttpAddress out;
  if (address.starts_with("unix:")) {
    std::string_view path = address.substr(5);
    if (path.starts_with("///")) path.remove_prefix(2);  // gRPC's unix:///abs/path
    constexpr size_t kMaxPath = sizeof(sockaddr_un::sun_path) - 1;
    if (path.empty()) return BadAddress(address, "the Unix socket path is empty");
    if (path.find('\0') != std::string_view::npos) {
      return BadAddress(address, "the Unix socket path contains a NUL byte");
    }
    if (path.size() > kMaxPath) {
      return BadAddress(address, absl::StrFormat("the Unix socket path is %d bytes; at most %d fit",
                                                 path.size(), kMaxPath));
    }
    out.kind = HttpAddress::Kind::kUnix;
    out.path = std::string(path);
    return out;
  }
  const size_t colon = address.rfind(':');
  if (colon == std::string_view::npos) return BadAddress(address, "no port");
  std::string_view host = address.substr(0, colon);
  const std::string_view port = address.substr(colon + 1);
  if (host.starts_with("[")) {
    if (!host.ends_with("]") || host.size() < 3) {
      return BadAddress(address, "an IPv6 host must be written [address]");
    }
    host = host.substr(1, host.size() - 2);
    boost::system::error_code ec;
    asio::ip::make_address_v6(std::string(host), ec);
    if (ec) {
      return BadAddress(address, absl::StrFormat("'%s' is not an IPv6 address", host));
    }
  } else if (host.find(':') != std::string_view::npos) {
    return BadAddress(address, "an IPv6 host must be written [address]");
  }
  if (host.empty()) return BadAddress(address, "the host is empty (0.0.0.0 for every interface)");
  for (char c : host) {
    if (absl::ascii_isspace(static_cast<unsigned char>(c)) || c == '/' || c == '\0') {
      return BadAddress(address, "the host contains a space, '/' or a NUL byte");
    }
  }
  uint32_t port_number = 0;
  if (port.empty() || !std::all_of(port.begin(), port.end(), absl::ascii_isdigit) ||
      !absl::SimpleAtoi(absl::string_view(port.data(), port.size()), &port_number) ||
      port_number > 65535) {
    return BadAddress(address,
                      absl::StrFormat("the port '%s' is not a number in [0, 65535]", port));
  }
  out.kind = HttpAddress::Kind::kTcp;
  out.host = std::string(host);
  out.port = static_cast<uint16_t>(port_number);
  return out;
}

std::string UrlEncode(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (IsUnreserved(c)) {
      out.push_back(c);
    } else {
      absl::StrAppendFormat(&out, "%%%02X", static_cast<unsigned char>(c));
    }
  }
  return out;
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(HttpServerOptions options,
                                                              HttpHandler handler) {
  KVTIER_ASSIGN_OR_RETURN(const HttpAddress address, ParseHttpAddress(options.address));
  if (!handler) return absl::InvalidArgumentError("HTTP server needs a handler");
  if (options.io_timeout <= absl::ZeroDuration() ||
      options.header_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "HTTP io_timeout (%s) and header_timeout (%s) must be > 0",
        absl::FormatDuration(options.io_timeout), absl::FormatDuration(options.header_timeout)));
  }
  if (options.max_connections == 0 || options.max_request_header_bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("HTTP max_connections (%d) and max_request_header_bytes (%d) must be > 0",
                        options.max_connections, options.max_request_header_bytes));
  }
  if (options.max_connections_per_peer == 0 ||
      options.max_connections_per_peer > options.max_connections) {
    return absl::InvalidArgumentError(
        absl::StrFormat("HTTP max_connections_per_peer = %d must be in [1, max_connections = %d]",
                        options.max_connections_per_peer, options.max_connections));
  }
  auto server = std::make_unique<HttpServerImpl>(std::move(options), std::move(handler));
  KVTIER_RETURN_IF_ERROR(server->Listen(address));
  server->Run();
  return server;
}

absl::StatusOr<HttpResponse> HttpGet(std::string_view address, std::string_view target,
                                     absl::Duration timeout, size_t max_body_bytes) {
  const absl::Time deadline = absl::Now() + timeout;
  KVTIER_ASSIGN_OR_RETURN(const HttpAddress parsed, ParseHttpAddress(address));
  KVTIER_ASSIGN_OR_RETURN(const std::vector<Generic::endpoint> endpoints, Resolve(parsed));
  if (absl::Now() >= deadline) {
    return absl::DeadlineExceededError(
        absl::StrFormat("GET http %s: deadline passed while resolving", parsed.ToString()));
  }
  const std::string host =
      parsed.kind == HttpAddress::Kind::kUnix ? "localhost" : parsed.ToString();
  asio::io_context io(1);
  GetCall call(io, parsed.ToString(), host, std::string(target), deadline, max_body_bytes);
  call.Start(endpoints);
  io.run();  // every step is bounded by the stream's deadline
  return std::move(call).result();
}

}  // namespace kvtier::daemon
