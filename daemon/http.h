// A small HTTP/1.1 server and client on Boost.Beast, for the daemon's GET-only endpoints
// (/metrics) and the tools that read them (kvtierctl).
//
// Addresses, shared by both sides: "unix:/path/to.sock" (also "unix:relative/path" and gRPC's
// "unix:///abs/path") or "host:port" where host is an IPv4 address, a bracketed IPv6 address
// ("[::1]:9464") or a name ("localhost:9464"); port 0 asks the server for any free port.
//
// The server runs one io_context on kThreads threads with asynchronous Beast I/O; each
// connection's handlers run on its own strand. Why not a thread per connection: the per-request
// deadline (io_timeout) has to cover the whole request, so a client that drips one byte a
// second is cut off at the deadline, which Beast's stream timers do and blocking reads with
// SO_RCVTIMEO cannot; and an idle keep-alive connection (Prometheus keeps them) costs a socket,
// not a thread. The handler runs on an I/O thread: it should be quick (render a page), since
// kThreads slow handlers at once delay every other connection.
//
// Fairness (daemon/peer_table.h, the attach socket's rule): a peer is an IP address on TCP and
// a uid (SO_PEERCRED) on a Unix socket. One peer may hold max_connections_per_peer connections
// (a further one is closed at accept), and at max_connections a new connection from a peer
// under its limit replaces the oldest connection of the peer that holds the most. A request's
// headers must arrive within header_timeout, so idle connections are closed early. One client
// holding connections, however many, cannot keep a scraper from another peer from an answer.
//
// Thread-safe: Start, Stop and the accessors may be called from any thread; the handler may be
// called concurrently from several connections.
#ifndef KVTIER_DAEMON_HTTP_H_
#define KVTIER_DAEMON_HTTP_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvtier::daemon {

// A parsed address. For kUnix only `path` is set; for kTcp `host` (without IPv6 brackets) and
// `port`.
struct HttpAddress {
  enum class Kind { kUnix, kTcp };
  Kind kind = Kind::kTcp;
  std::string path;
  std::string host;
  uint16_t port = 0;

  // "unix:/path", "host:port" or "[v6]:port".
  std::string ToString() const;
};

// INVALID_ARGUMENT naming `address` and the accepted forms when it does not parse (an empty
// host or path, a port that is not a number in [0, 65535], a Unix path longer than a socket
// address holds, an unbalanced bracket).
absl::StatusOr<HttpAddress> ParseHttpAddress(std::string_view address);

// `text` percent-encoded for a query-string value (RFC 3986 unreserved characters stay).
std::string UrlEncode(std::string_view text);

struct HttpRequest {
  std::string method;  // "GET" or "HEAD" (the only ones that reach a handler)
  std::string target;  // path and query, as sent: "/metrics?x=1"
};

struct HttpResponse {
  int status = 200;  // [100, 999]; anything else is answered as 500
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;  // for HEAD only its length is sent
};

// Called on a server thread for each GET or HEAD request. An exception it throws becomes a
// 500 reply; the server keeps serving.
using HttpHandler = std::function<HttpResponse(const HttpRequest&)>;

struct HttpServerOptions {
  std::string address;  // see ParseHttpAddress
  // Per request: reading it (from the accept, or the end of the previous reply on a
  // keep-alive connection) and writing the reply. > 0.
  absl::Duration io_timeout = absl::Seconds(5);
  // Of that, the request line and headers: an idle connection is closed once it passes.
  // > 0; when longer than io_timeout, io_timeout holds.
  absl::Duration header_timeout = absl::Seconds(2);
  // Connections served at once, > 0, and of one peer, in [1, max_connections] (see above).
  // Connections closed over either (counted in refused_connections()).
  uint32_t max_connections = 16;
  uint32_t max_connections_per_peer = 4;
  // The request line and headers, > 0; a larger request gets 431 and the connection is closed.
  size_t max_request_header_bytes = 8192;
};

class HttpServer {
 public:
  // I/O threads of one server.
  static constexpr int kThreads = 2;

  // Binds and starts serving. INVALID_ARGUMENT for an address that does not parse, an empty
  // handler or an option out of range; FAILED_PRECONDITION when binding fails (naming the
  // address and the reason). A Unix path gets mode 0660; a stale socket file left there (nobody
  // listens) is replaced, while a live socket or any other file is FAILED_PRECONDITION.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(HttpServerOptions options,
                                                           HttpHandler handler);
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;
  virtual ~HttpServer() = default;  // implementations Stop()

  // Closes the listener and every connection, waits for the threads and unlinks the Unix socket
  // file it created (only that file: one a later server put there stays). Idempotent.
  // REQUIRES: not called from the handler.
  virtual void Stop() = 0;
  // The address as bound: "unix:/path", or "127.0.0.1:PORT" / "[::1]:PORT" with the real port.
  virtual std::string address() const = 0;
  virtual int port() const = 0;  // 0 for a Unix socket
  // Connections closed unanswered by the fairness rule: at accept, over their peer's limit, or
  // replaced at max_connections.
  virtual uint64_t refused_connections() const = 0;

 protected:
  HttpServer() = default;
};

// One GET of `target` ("/metrics") from `address`, HTTP/1.1 with Connection: close; `timeout`
// covers connecting, writing and reading (a host name is resolved first, by the system's
// resolver, which the timeout does not interrupt). Any status comes back as a response.
// UNAVAILABLE naming the address when it cannot connect; DEADLINE_EXCEEDED when the timeout
// passes; RESOURCE_EXHAUSTED when the body is longer than max_body_bytes; INVALID_ARGUMENT for
// a bad address; UNKNOWN for a reply that is not HTTP.
absl::StatusOr<HttpResponse> HttpGet(std::string_view address, std::string_view target,
                                     absl::Duration timeout, size_t max_body_bytes = 64 << 20);

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_HTTP_H_
