// daemon/http.h over real sockets: addresses, GET and HEAD on TCP and Unix sockets, keep-alive,
// method and size refusals, misbehaving clients (stalled, too many, oversized), the Unix socket
// file's life cycle, and HttpGet's errors. Timing appears only as generous upper bounds.
#include "daemon/http.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::daemon {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kGetTimeout = absl::Seconds(20);  // never reached when things work

// A private directory for Unix sockets, removed at the end.
class TempDir {
 public:
  TempDir() {
    std::string templ = ::testing::TempDir() + "http-test-XXXXXX";
    EXPECT_NE(mkdtemp(templ.data()), nullptr) << std::strerror(errno);
    path_ = templ;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string Path(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

HttpHandler Echo() {
  return [](const HttpRequest& r) {
    if (r.target == "/missing") return HttpResponse{.status = 404, .body = "not here\n"};
    return HttpResponse{.body = absl::StrCat(r.method, " ", r.target, "\n")};
  };
}

std::unique_ptr<HttpServer> MustStart(HttpServerOptions options, HttpHandler handler = Echo()) {
  auto server = HttpServer::Start(std::move(options), std::move(handler));
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

// A blocking client socket speaking raw bytes; reads give up after a minute so a broken server
// fails the test instead of hanging it (no test relies on that time).
class RawClient {
 public:
  // `source`: the local IPv4 address a TCP client binds before it connects ("127.0.0.2": every
  // address of 127.0.0.0/8 is loopback), so that the server sees another peer; empty: any.
  explicit RawClient(const std::string& address, const std::string& source = "") {
    auto parsed = ParseHttpAddress(address);
    EXPECT_TRUE(parsed.ok()) << parsed.status();
    if (parsed->kind == HttpAddress::Kind::kUnix) {
      fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      std::memcpy(addr.sun_path, parsed->path.data(), parsed->path.size());
      connected_ = connect(fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
    } else {
      fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (!source.empty()) {
        sockaddr_in local{};
        local.sin_family = AF_INET;
        EXPECT_EQ(inet_pton(AF_INET, source.c_str(), &local.sin_addr), 1) << source;
        EXPECT_EQ(bind(fd_, reinterpret_cast<const sockaddr*>(&local), sizeof(local)), 0)
            << source << ": " << std::strerror(errno);
      }
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(parsed->port);
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      connected_ = connect(fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
    }
    EXPECT_TRUE(connected_) << std::strerror(errno);
    timeval tv{.tv_sec = 60, .tv_usec = 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  ~RawClient() { Close(); }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

  bool Send(const std::string& bytes) {
    return send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
           static_cast<ssize_t>(bytes.size());
  }

  struct Response {
    int status = 0;
    std::map<std::string, std::string> headers;  // names lower-cased
    std::string body;
  };

  // One response: headers, then Content-Length bytes of body (none for a HEAD). nullopt when the
  // connection ends first.
  std::optional<Response> Read(bool head = false) {
    size_t end;
    while ((end = buffered_.find("\r\n\r\n")) == std::string::npos) {
      if (!Fill()) return std::nullopt;
    }
    Response r;
    const std::string header = buffered_.substr(0, end);
    buffered_.erase(0, end + 4);
    size_t line_end = header.find("\r\n");
    const std::string status_line = header.substr(0, line_end);
    if (status_line.size() < 12 || !absl::SimpleAtoi(status_line.substr(9, 3), &r.status)) {
      ADD_FAILURE() << "bad status line: " << status_line;
      return std::nullopt;
    }
    while (line_end != std::string::npos) {
      const size_t next = header.find("\r\n", line_end + 2);
      const std::string line = header.substr(line_end + 2, next - line_end - 2);
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        r.headers[absl::AsciiStrToLower(line.substr(0, colon))] =
            std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
      }
      line_end = next;
    }
    size_t length = 0;
    if (!head && r.headers.count("content-length") &&
        absl::SimpleAtoi(r.headers["content-length"], &length)) {
      while (buffered_.size() < length) {
        if (!Fill()) return std::nullopt;
      }
      r.body = buffered_.substr(0, length);
      buffered_.erase(0, length);
    }
    return r;
  }

  // True when the server closes the connection without sending anything (more).
  bool ClosedByPeer() {
    if (!buffered_.empty()) return false;
    char c;
    const ssize_t n = recv(fd_, &c, 1, 0);
    return n == 0 || (n < 0 && errno == ECONNRESET);
  }

  // Waits up to `timeout` for the server to close the connection (anything it sends first is
  // discarded); false when it is still open then.
  bool ClosedWithin(absl::Duration timeout) {
    const absl::Time end = absl::Now() + timeout;
    for (;;) {
      pollfd p{.fd = fd_, .events = POLLIN, .revents = 0};
      const absl::Duration left = end - absl::Now();
      if (left <= absl::ZeroDuration()) return false;
      if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1) <= 0) continue;
      char buf[4096];
      const ssize_t n = recv(fd_, buf, sizeof(buf), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
    }
  }

  // True when the server has closed the connection by now (without waiting).
  bool ClosedNow() {
    pollfd p{.fd = fd_, .events = POLLIN, .revents = 0};
    if (poll(&p, 1, 0) <= 0) return false;
    char c;
    const ssize_t n = recv(fd_, &c, 1, MSG_DONTWAIT | MSG_PEEK);
    return n == 0 || (n < 0 && errno == ECONNRESET);
  }

  bool connected() const { return connected_; }

 private:
  bool Fill() {
    char buf[4096];
    const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
    if (n <= 0) return false;
    buffered_.append(buf, static_cast<size_t>(n));
    return true;
  }

  int fd_ = -1;
  bool connected_ = false;
  std::string buffered_;
};

std::string Get(const std::string& target, bool keep_alive = true) {
  return absl::StrCat("GET ", target, " HTTP/1.1\r\nHost: test\r\n",
                      keep_alive ? "" : "Connection: close\r\n", "\r\n");
}

// ---- addresses -------------------------------------------------------------------------------

struct AddressCase {
  std::string text;
  bool ok;
  std::string canonical;  // ToString() when ok
};

TEST(ParseHttpAddressTest, AcceptsTheDocumentedFormsAndNamesBadOnes) {
  const std::vector<AddressCase> cases = {
      {"unix:/run/kvtier/metrics.sock", true, "unix:/run/kvtier/metrics.sock"},
      {"unix:relative.sock", true, "unix:relative.sock"},
      {"unix:///abs/path.sock", true, "unix:/abs/path.sock"},
      {"127.0.0.1:9464", true, "127.0.0.1:9464"},
      {"0.0.0.0:0", true, "0.0.0.0:0"},
      {"localhost:65535", true, "localhost:65535"},
      {"[::1]:80", true, "[::1]:80"},
      {"[::]:9464", true, "[::]:9464"},
      {"", false, ""},
      {"unix:", false, ""},
      {"unix:" + std::string(200, 'p'), false, ""},
      {"localhost", false, ""},
      {":9464", false, ""},
      {"host:", false, ""},
      {"host:65536", false, ""},
      {"host:-1", false, ""},
      {"host:12ab", false, ""},
      {"::1:80", false, ""},
      {"[::1:80", false, ""},
      {"[nope]:80", false, ""},
      {"a b:80", false, ""},
  };
  for (const AddressCase& c : cases) {
    SCOPED_TRACE(c.text);
    absl::StatusOr<HttpAddress> a = ParseHttpAddress(c.text);
    if (c.ok) {
      ASSERT_TRUE(a.ok()) << a.status();
      EXPECT_EQ(a->ToString(), c.canonical);
    } else {
      ASSERT_FALSE(a.ok());
      EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(a.status().message(), HasSubstr("'" + c.text + "'"));
      EXPECT_THAT(a.status().message(), HasSubstr("host:port"));
    }
  }
}

TEST(ParseHttpAddressTest, SplitsHostPortAndPath) {
  auto tcp = ParseHttpAddress("[fe80::1]:9464");
  ASSERT_TRUE(tcp.ok());
  EXPECT_EQ(tcp->kind, HttpAddress::Kind::kTcp);
  EXPECT_EQ(tcp->host, "fe80::1");
  EXPECT_EQ(tcp->port, 9464);
  auto unix_socket = ParseHttpAddress("unix:/tmp/x.sock");
  ASSERT_TRUE(unix_socket.ok());
  EXPECT_EQ(unix_socket->kind, HttpAddress::Kind::kUnix);
  EXPECT_EQ(unix_socket->path, "/tmp/x.sock");
}

TEST(UrlEncodeTest, KeepsUnreservedAndEscapesTheRest) {
  EXPECT_EQ(UrlEncode("abc-XYZ_0.9~"), "abc-XYZ_0.9~");
  EXPECT_EQ(UrlEncode("a b&c=d/é"), "a%20b%26c%3Dd%2F%C3%A9");
  EXPECT_EQ(UrlEncode(""), "");
}

// ---- serving ---------------------------------------------------------------------------------

TEST(HttpServerTest, ServesGetOnAnyFreeTcpPort) {
  auto server = MustStart({.address = "127.0.0.1:0"});
  ASSERT_NE(server, nullptr);
  EXPECT_GT(server->port(), 0);
  EXPECT_EQ(server->address(), absl::StrCat("127.0.0.1:", server->port()));
  auto r = HttpGet(server->address(), "/metrics?x=1", kGetTimeout);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, "GET /metrics?x=1\n");
  EXPECT_EQ(r->content_type, "text/plain; charset=utf-8");
}

TEST(HttpServerTest, ResolvesAHostName) {
  auto server = MustStart({.address = "localhost:0"});
  ASSERT_NE(server, nullptr);
  auto r = HttpGet(absl::StrCat("localhost:", server->port()), "/named", kGetTimeout);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->body, "GET /named\n");
}

TEST(HttpServerTest, ServesGetOnAUnixSocketWithMode0660) {
  TempDir dir;
  const std::string path = dir.Path("metrics.sock");
  auto server = MustStart({.address = "unix:" + path});
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(server->address(), "unix:" + path);
  EXPECT_EQ(server->port(), 0);
  struct stat st {};
  ASSERT_EQ(lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  auto r = HttpGet(server->address(), "/metrics", kGetTimeout);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, "GET /metrics\n");
}

TEST(HttpServerTest, AnswersTheHandlersStatusAndContentType) {
  auto server = MustStart({.address = "127.0.0.1:0"}, [](const HttpRequest& r) {
    if (r.target == "/metrics") {
      return HttpResponse{.content_type = "text/plain; version=0.0.4", .body = "up 1\n"};
    }
    return HttpResponse{.status = 404, .body = "no such page\n"};
  });
  ASSERT_NE(server, nullptr);
  auto found = HttpGet(server->address(), "/metrics", kGetTimeout);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->content_type, "text/plain; version=0.0.4");
  auto missing = HttpGet(server->address(), "/nope", kGetTimeout);
  ASSERT_TRUE(missing.ok()) << missing.status();
  EXPECT_EQ(missing->status, 404);
  EXPECT_EQ(missing->body, "no such page\n");
}

TEST(HttpServerTest, RefusesOtherMethodsWith405AndAllow) {
  std::atomic<int> calls{0};
  auto server = MustStart({.address = "127.0.0.1:0"}, [&](const HttpRequest&) {
    ++calls;
    return HttpResponse{};
  });
  ASSERT_NE(server, nullptr);
  RawClient c(server->address());
  ASSERT_TRUE(c.Send("POST /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi"));
  auto r = c.Read();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, 405);
  EXPECT_EQ(r->headers["allow"], "GET, HEAD");
  EXPECT_THAT(r->body, HasSubstr("POST"));
  // The connection stays usable; the handler never saw the POST.
  ASSERT_TRUE(c.Send(Get("/ok")));
  auto next = c.Read();
  ASSERT_TRUE(next.has_value());
  EXPECT_EQ(next->status, 200);
  EXPECT_EQ(calls.load(), 1);
}

TEST(HttpServerTest, HeadSendsTheLengthButNoBody) {
  auto server = MustStart({.address = "127.0.0.1:0"});
  ASSERT_NE(server, nullptr);
  RawClient c(server->address());
  ASSERT_TRUE(c.Send("HEAD /page HTTP/1.1\r\nHost: t\r\n\r\n"));
  auto head = c.Read(/*head=*/true);
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(head->status, 200);
  EXPECT_EQ(head->headers["content-length"], std::to_string(std::string("HEAD /page\n").size()));
  // Nothing but the next reply follows: a GET on the same connection reads cleanly.
  ASSERT_TRUE(c.Send(Get("/after")));
  auto get = c.Read();
  ASSERT_TRUE(get.has_value());
  EXPECT_EQ(get->body, "GET /after\n");
}

TEST(HttpServerTest, KeepsAliveAcrossRequestsAndClosesWhenAsked) {
  auto server = MustStart({.address = "127.0.0.1:0"});
  ASSERT_NE(server, nullptr);
  RawClient c(server->address());
  ASSERT_TRUE(c.Send(Get("/one")));
  auto one = c.Read();
  ASSERT_TRUE(one.has_value());
  EXPECT_EQ(one->body, "GET /one\n");
  EXPECT_NE(absl::AsciiStrToLower(one->headers["connection"]), "close");
  ASSERT_TRUE(c.Send(Get("/two", /*keep_alive=*/false)));
  auto two = c.Read();
  ASSERT_TRUE(two.has_value());
  EXPECT_EQ(two->body, "GET /two\n");
  EXPECT_EQ(absl::AsciiStrToLower(two->headers["connection"]), "close");
  EXPECT_TRUE(c.ClosedByPeer());
}

TEST(HttpServerTest, AThrowingHandlerGets500AndTheServerKeepsServing) {
  auto server = MustStart({.address = "127.0.0.1:0"}, [](const HttpRequest& r) -> HttpResponse {
    if (r.target == "/throw") throw std::runtime_error("boom");
    if (r.target == "/bad-status") return HttpResponse{.status = 7, .body = ""};
    return HttpResponse{.body = "fine\n"};
  });
  ASSERT_NE(server, nullptr);
  auto thrown = HttpGet(server->address(), "/throw", kGetTimeout);
  ASSERT_TRUE(thrown.ok()) << thrown.status();
  EXPECT_EQ(thrown->status, 500);
  EXPECT_THAT(thrown->body, HasSubstr("boom"));
  auto bad = HttpGet(server->address(), "/bad-status", kGetTimeout);
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_EQ(bad->status, 500);
  auto fine = HttpGet(server->address(), "/", kGetTimeout);
  ASSERT_TRUE(fine.ok()) << fine.status();
  EXPECT_EQ(fine->body, "fine\n");
}

TEST(HttpServerTest, HandlersRunConcurrently) {
  // Each call waits until two are inside the handler at once; a server that ran one handler at
  // a time would time out the waits and answer 503.
  Mutex mu;
  CondVar cv;
  int inside = 0;
  auto server = MustStart({.address = "127.0.0.1:0"}, [&](const HttpRequest&) {
    MutexLock lock(&mu);
    ++inside;
    cv.SignalAll();
    const bool met = cv.AwaitWithTimeout(
        &mu, [&] { return inside >= 2; }, absl::Seconds(20));
    return HttpResponse{.status = met ? 200 : 503, .body = ""};
  });
  ASSERT_NE(server, nullptr);
  absl::StatusOr<HttpResponse> other;
  std::thread t([&] { other = HttpGet(server->address(), "/a", kGetTimeout + absl::Seconds(5)); });
  auto mine = HttpGet(server->address(), "/b", kGetTimeout + absl::Seconds(5));
  t.join();
  ASSERT_TRUE(mine.ok()) << mine.status();
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(mine->status, 200);
  EXPECT_EQ(other->status, 200);
}

// ---- misbehaving clients ---------------------------------------------------------------------

TEST(HttpServerTest, StalledClientsDoNotDelayOthers) {
  // More stalled clients than I/O threads, each holding half a request, and timeouts far
  // beyond the test: none of them may hold anything but its own connection.
  auto server = MustStart({.address = "127.0.0.1:0",
                           .io_timeout = absl::Minutes(5),
                           .header_timeout = absl::Minutes(5),
                           .max_connections_per_peer = 8});
  ASSERT_NE(server, nullptr);
  std::vector<std::unique_ptr<RawClient>> stalled;
  for (int i = 0; i < HttpServer::kThreads + 2; ++i) {
    stalled.push_back(std::make_unique<RawClient>(server->address()));
    ASSERT_TRUE(stalled.back()->Send("GET /slow HTTP/1.1\r\nHo"));
  }
  const absl::Time start = absl::Now();
  auto r = HttpGet(server->address(), "/fast", kGetTimeout);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->body, "GET /fast\n");
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(HttpServerTest, ADrippingClientIsCutOffAtTheIoTimeout) {
  auto server = MustStart({.address = "127.0.0.1:0", .io_timeout = absl::Milliseconds(300)});
  ASSERT_NE(server, nullptr);
  RawClient c(server->address());
  const absl::Time start = absl::Now();
  ASSERT_TRUE(c.Send("GET / HTTP/1.1\r\n"));
  // A header line every 50 ms (the poll is the drip rate): the request's one deadline stands.
  bool closed = false;
  while (!closed && absl::Now() - start < absl::Seconds(30)) {
    closed = !c.Send("X-Drip: 1\r\n") || c.ClosedWithin(absl::Milliseconds(50));
  }
  EXPECT_TRUE(closed);
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}

TEST(HttpServerTest, AnIdleKeptAliveConnectionIsClosedAtTheIoTimeout) {
  auto server = MustStart({.address = "127.0.0.1:0", .io_timeout = absl::Milliseconds(200)});
  ASSERT_NE(server, nullptr);
  RawClient c(server->address());
  ASSERT_TRUE(c.Send(Get("/")));
  ASSERT_TRUE(c.Read().has_value());
  EXPECT_TRUE(c.ClosedWithin(absl::Seconds(30)));
}

TEST(HttpServerTest, AnIdleConnectionIsClosedAtTheHeaderTimeout) {
  // However long a request may take, its headers must come within header_timeout: a
  // connection that sends nothing, or stops half-way, holds its place no longer than that.
  auto server = MustStart({.address = "127.0.0.1:0",
                           .io_timeout = absl::Minutes(5),
                           .header_timeout = absl::Milliseconds(200)});
  ASSERT_NE(server, nullptr);
  RawClient silent(server->address());
  RawClient halfway(server->address());
  ASSERT_TRUE(halfway.Send("GET / HTTP/1.1\r\nHo"));
  RawClient kept_alive(server->address());
  ASSERT_TRUE(kept_alive.Send(Get("/")));
  ASSERT_TRUE(kept_alive.Read().has_value());
  EXPECT_TRUE(silent.ClosedWithin(absl::Seconds(30)));
  EXPECT_TRUE(halfway.ClosedWithin(absl::Seconds(30)));
  EXPECT_TRUE(kept_alive.ClosedWithin(absl::Seconds(30)));
}

TEST(HttpServerTest, ConnectionsPastAPeersLimitAreClosedAndServiceGoesOn) {
  // Timeouts far beyond the test: the held connections stay until the test is done.
  auto server = MustStart({.address = "127.0.0.1:0",
                           .io_timeout = absl::Minutes(5),
                           .header_timeout = absl::Minutes(5),
                           .max_connections_per_peer = 2});
  ASSERT_NE(server, nullptr);
  // Two admitted connections (each answered once, so the server holds them), kept open.
  std::vector<std::unique_ptr<RawClient>> held;
  for (int i = 0; i < 2; ++i) {
    held.push_back(std::make_unique<RawClient>(server->address()));
    ASSERT_TRUE(held.back()->Send(Get("/held")));
    ASSERT_TRUE(held.back()->Read().has_value());
  }
  RawClient third(server->address());
  ASSERT_TRUE(third.connected());
  (void)third.Send(Get("/third"));
  EXPECT_TRUE(third.ClosedWithin(absl::Seconds(30)));
  EXPECT_EQ(server->refused_connections(), 1u);
  // The held ones still work.
  ASSERT_TRUE(held[0]->Send(Get("/again")));
  auto again = held[0]->Read();
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->body, "GET /again\n");
  // Once they leave, new clients are served (the server notices the close asynchronously).
  held.clear();
  const absl::Time end = absl::Now() + absl::Seconds(20);
  absl::StatusOr<HttpResponse> r;
  do {
    r = HttpGet(server->address(), "/later", kGetTimeout);
  } while (!r.ok() && absl::Now() < end);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->body, "GET /later\n");
}

// Several peers together hold every connection the server serves; a newcomer from another peer
// is still answered, in the place of the oldest connection of the peer that holds the most.
TEST(HttpServerTest, AtTheGlobalLimitTheHeaviestPeerMakesRoom) {
  auto server = MustStart({.address = "127.0.0.1:0",
                           .io_timeout = absl::Minutes(5),
                           .header_timeout = absl::Minutes(5),
                           .max_connections = 3,
                           .max_connections_per_peer = 2});
  ASSERT_NE(server, nullptr);
  // 127.0.0.1 holds two, 127.0.0.3 one (each answered once, so the server holds them).
  std::vector<std::unique_ptr<RawClient>> held;
  for (const char* source : {"127.0.0.1", "127.0.0.1", "127.0.0.3"}) {
    held.push_back(std::make_unique<RawClient>(server->address(), source));
    ASSERT_TRUE(held.back()->Send(Get("/held")));
    ASSERT_TRUE(held.back()->Read().has_value());
  }
  RawClient newcomer(server->address(), "127.0.0.2");
  ASSERT_TRUE(newcomer.Send(Get("/new")));
  const std::optional<RawClient::Response> r = newcomer.Read();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->body, "GET /new\n");
  EXPECT_EQ(server->refused_connections(), 1u);
  EXPECT_TRUE(held[0]->ClosedWithin(absl::Seconds(30)));  // 127.0.0.1's oldest
  for (size_t i : {1u, 2u}) {
    ASSERT_TRUE(held[i]->Send(Get("/again")));
    const std::optional<RawClient::Response> again = held[i]->Read();
    ASSERT_TRUE(again.has_value()) << i;
    EXPECT_EQ(again->body, "GET /again\n");
  }
}

// ---- fairness between peers -------------------------------------------------------------------

// More idle connections than a server serves at once (HttpServerOptions' default, the daemon's).
constexpr int kFloodConnections = 20;

// One peer (127.0.0.1) opens more idle connections than the server serves at once and holds
// them, sending nothing, as one misbehaving client can; a scrape from another peer (127.0.0.2)
// is answered while they are held, and every idle connection is closed at the header timeout.
TEST(HttpServerTest, IdleConnectionsOfOneAddressDoNotKeepAnotherAddressFromBeingServed) {
  auto server = MustStart({.address = "127.0.0.1:0"});
  ASSERT_NE(server, nullptr);
  std::vector<std::unique_ptr<RawClient>> idle;
  for (int i = 0; i < kFloodConnections; ++i) {
    idle.push_back(std::make_unique<RawClient>(server->address()));
    ASSERT_TRUE(idle.back()->connected());
  }
  const absl::Time start = absl::Now();
  RawClient scraper(server->address(), "127.0.0.2");
  ASSERT_TRUE(scraper.connected());
  ASSERT_TRUE(scraper.Send(Get("/metrics", false)));
  const std::optional<RawClient::Response> r = scraper.Read();
  ASSERT_TRUE(r.has_value()) << "the scrape from 127.0.0.2 was closed unanswered while "
                                "127.0.0.1 held idle connections";
  EXPECT_EQ(r->body, "GET /metrics\n");
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  // The flooding peer still held connections then (the server accepts in order).
  int open = 0;
  for (const auto& c : idle) open += c->ClosedNow() ? 0 : 1;
  EXPECT_GT(open, 0);
  for (const auto& c : idle) EXPECT_TRUE(c->ClosedWithin(absl::Seconds(30)));
}

// The same on a Unix socket, where a peer is a uid (SO_PEERCRED): this process (root) holds
// the idle connections, a child that became another uid scrapes. Needs root.
TEST(HttpServerTest, IdleConnectionsOfOneUidDoNotKeepAnotherUidFromBeingServed) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to connect as another uid";
  TempDir dir;
  // The child keeps group 0: the directory and the socket (mode 0660) let it in by group.
  ASSERT_EQ(chmod(dir.Path(".").c_str(), 0750), 0) << std::strerror(errno);
  const std::string path = dir.Path("m.sock");
  auto server = MustStart({.address = "unix:" + path});
  ASSERT_NE(server, nullptr);
  std::vector<std::unique_ptr<RawClient>> idle;
  for (int i = 0; i < kFloodConnections; ++i) {
    idle.push_back(std::make_unique<RawClient>(server->address()));
    ASSERT_TRUE(idle.back()->connected());
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  const char request[] = "GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n";
  const char expected[] = "HTTP/1.1 200";
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // only async-signal-safe calls from here on
    if (setgroups(0, nullptr) != 0 || setuid(65534) != 0) _exit(2);
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
      _exit(3);
    }
    if (write(fd, request, sizeof(request) - 1) != static_cast<ssize_t>(sizeof(request) - 1)) {
      _exit(4);
    }
    char reply[sizeof(expected) - 1];
    size_t got = 0;
    while (got < sizeof(reply)) {
      const ssize_t n = read(fd, reply + got, sizeof(reply) - got);
      if (n <= 0) _exit(5);  // closed unanswered
      got += static_cast<size_t>(n);
    }
    _exit(memcmp(reply, expected, sizeof(reply)) == 0 ? 0 : 6);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "the scrape as uid 65534 (2: setuid, 3: connect, 4: write failed; 5: closed unanswered; "
         "6: not 200) while uid 0 held idle connections";
  int open = 0;
  for (const auto& c : idle) open += c->ClosedNow() ? 0 : 1;
  EXPECT_GT(open, 0);
  for (const auto& c : idle) EXPECT_TRUE(c->ClosedWithin(absl::Seconds(30)));
}

TEST(HttpServerTest, OversizedHeadersGet431AndTheServerSurvives) {
  auto server = MustStart({.address = "127.0.0.1:0", .max_request_header_bytes = 1024});
  ASSERT_NE(server, nullptr);
  RawClient c(server->address());
  ASSERT_TRUE(c.Send(
      absl::StrCat("GET / HTTP/1.1\r\nHost: t\r\nX-Big: ", std::string(4096, 'b'), "\r\n\r\n")));
  auto r = c.Read();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, 431);
  EXPECT_TRUE(c.ClosedByPeer());
  auto after = HttpGet(server->address(), "/", kGetTimeout);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->status, 200);
}

TEST(HttpServerTest, GarbageGets400AndTheServerSurvives) {
  auto server = MustStart({.address = "127.0.0.1:0"});
  ASSERT_NE(server, nullptr);
  RawClient c(server->address());
  ASSERT_TRUE(c.Send("NOT HTTP AT ALL\r\n\r\n"));
  auto r = c.Read();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, 400);
  auto after = HttpGet(server->address(), "/", kGetTimeout);
  ASSERT_TRUE(after.ok()) << after.status();
}

TEST(HttpServerTest, ARequestBodyPastTheLimitGets413WithoutBeingRead) {
  auto server = MustStart({.address = "127.0.0.1:0"});
  ASSERT_NE(server, nullptr);
  RawClient c(server->address());
  // Announces 10 GB and sends none of it: the refusal comes from the header alone.
  ASSERT_TRUE(c.Send("GET / HTTP/1.1\r\nHost: t\r\nContent-Length: 10000000000\r\n\r\n"));
  auto r = c.Read();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, 413);
  EXPECT_TRUE(c.ClosedWithin(absl::Seconds(30)));
}

// ---- the Unix socket file --------------------------------------------------------------------

TEST(HttpServerTest, StopUnlinksTheSocketAndTheSamePathCanBeServedAgain) {
  TempDir dir;
  const std::string path = dir.Path("m.sock");
  auto first = MustStart({.address = "unix:" + path});
  ASSERT_NE(first, nullptr);
  first->Stop();
  first->Stop();  // idempotent
  struct stat st {};
  EXPECT_NE(lstat(path.c_str(), &st), 0);
  auto second = MustStart({.address = "unix:" + path});
  ASSERT_NE(second, nullptr);
  auto r = HttpGet(second->address(), "/", kGetTimeout);
  ASSERT_TRUE(r.ok()) << r.status();
  first.reset();  // must not unlink the second server's socket
  EXPECT_EQ(lstat(path.c_str(), &st), 0);
}

TEST(HttpServerTest, ReplacesAStaleSocketFile) {
  TempDir dir;
  const std::string path = dir.Path("stale.sock");
  {  // a socket file nobody listens on, as a crashed server leaves it
    const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.data(), path.size());
    ASSERT_EQ(bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
    close(fd);
  }
  auto server = MustStart({.address = "unix:" + path});
  ASSERT_NE(server, nullptr);
  auto r = HttpGet(server->address(), "/", kGetTimeout);
  ASSERT_TRUE(r.ok()) << r.status();
}

TEST(HttpServerTest, RefusesALiveSocketAndOtherFiles) {
  TempDir dir;
  const std::string path = dir.Path("live.sock");
  auto live = MustStart({.address = "unix:" + path});
  ASSERT_NE(live, nullptr);
  auto again = HttpServer::Start({.address = "unix:" + path}, Echo());
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.status().message(), HasSubstr(path));
  EXPECT_THAT(again.status().message(), HasSubstr("in use"));
  // The refused start left the live server's socket alone.
  ASSERT_TRUE(HttpGet(live->address(), "/", kGetTimeout).ok());

  const std::string file = dir.Path("plain-file");
  std::ofstream(file) << "not a socket";
  auto over_file = HttpServer::Start({.address = "unix:" + file}, Echo());
  ASSERT_FALSE(over_file.ok());
  EXPECT_EQ(over_file.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(over_file.status().message(), HasSubstr("not a socket"));
  EXPECT_TRUE(std::filesystem::exists(file));
}

TEST(HttpServerTest, RefusesBadAddressesAndOptions) {
  auto bad = HttpServer::Start({.address = "nonsense"}, Echo());
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("'nonsense'"));
  auto no_handler = HttpServer::Start({.address = "127.0.0.1:0"}, nullptr);
  EXPECT_EQ(no_handler.status().code(), absl::StatusCode::kInvalidArgument);
  auto no_timeout =
      HttpServer::Start({.address = "127.0.0.1:0", .io_timeout = absl::ZeroDuration()}, Echo());
  EXPECT_EQ(no_timeout.status().code(), absl::StatusCode::kInvalidArgument);
  auto no_connections = HttpServer::Start({.address = "127.0.0.1:0", .max_connections = 0}, Echo());
  EXPECT_EQ(no_connections.status().code(), absl::StatusCode::kInvalidArgument);
  auto no_header_timeout =
      HttpServer::Start({.address = "127.0.0.1:0", .header_timeout = absl::ZeroDuration()}, Echo());
  EXPECT_EQ(no_header_timeout.status().code(), absl::StatusCode::kInvalidArgument);
  for (uint32_t per_peer : {0u, 17u}) {
    auto bad_per_peer = HttpServer::Start(
        {.address = "127.0.0.1:0", .max_connections = 16, .max_connections_per_peer = per_peer},
        Echo());
    EXPECT_EQ(bad_per_peer.status().code(), absl::StatusCode::kInvalidArgument) << per_peer;
    EXPECT_THAT(bad_per_peer.status().message(), HasSubstr("max_connections_per_peer"));
  }
}

TEST(HttpServerTest, ABusyPortIsFailedPrecondition) {
  auto first = MustStart({.address = "127.0.0.1:0"});
  ASSERT_NE(first, nullptr);
  auto second = HttpServer::Start({.address = first->address()}, Echo());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.status().message(), HasSubstr(first->address()));
}

// ---- HttpGet ---------------------------------------------------------------------------------

// A TCP port nobody listens on (bound, read, released).
int ClosedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

TEST(HttpGetTest, AClosedPortOrMissingSocketIsUnavailable) {
  const std::string tcp = absl::StrCat("127.0.0.1:", ClosedPort());
  auto r = HttpGet(tcp, "/", kGetTimeout);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr(tcp));
  TempDir dir;
  const std::string unix_socket = "unix:" + dir.Path("absent.sock");
  auto u = HttpGet(unix_socket, "/", kGetTimeout);
  ASSERT_FALSE(u.ok());
  EXPECT_EQ(u.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(u.status().message(), HasSubstr(unix_socket));
}

TEST(HttpGetTest, ABadAddressIsInvalidArgument) {
  auto r = HttpGet("no-port", "/", kGetTimeout);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(HttpGetTest, AServerThatNeverAnswersIsDeadlineExceeded) {
  // A listener that never accepts: the connection completes in its backlog, the request is
  // written, and no reply ever comes.
  TempDir dir;
  const std::string path = dir.Path("mute.sock");
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  ASSERT_EQ(bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 4), 0);
  const absl::Time start = absl::Now();
  auto r = HttpGet("unix:" + path, "/", absl::Milliseconds(300));
  const absl::Duration took = absl::Now() - start;
  close(fd);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_GE(took, absl::Milliseconds(250));
  EXPECT_LT(took, absl::Seconds(15));
}

TEST(HttpGetTest, ABodyPastTheCapIsResourceExhausted) {
  auto server = MustStart({.address = "127.0.0.1:0"}, [](const HttpRequest&) {
    return HttpResponse{.body = std::string(10000, 'x')};
  });
  ASSERT_NE(server, nullptr);
  auto capped = HttpGet(server->address(), "/", kGetTimeout, 9999);
  ASSERT_FALSE(capped.ok());
  EXPECT_EQ(capped.status().code(), absl::StatusCode::kResourceExhausted);
  auto fits = HttpGet(server->address(), "/", kGetTimeout, 10000);
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(fits->body.size(), 10000u);
}

}  // namespace
}  // namespace kvtier::daemon
