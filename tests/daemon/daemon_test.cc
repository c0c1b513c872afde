// Daemon in-process: serves kvtier.v1 (Hello), the standard health service and reflection on its
// Unix socket (and TCP when asked), shuts down removing its sockets, refuses a socket path a live
// daemon holds, and replaces a stale one; its /metrics stays valid and bounded whatever method
// paths unauthenticated callers send, and keeps each peer to metrics.max_connections_per_peer.
#include "daemon/daemon.h"

#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/http.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvtier/v1/kvtier.grpc.pb.h"

namespace kvtier::daemon {
namespace {

using ::testing::HasSubstr;

// A safety net so a broken daemon fails the test instead of hanging it; never a timing assertion.
constexpr auto kCallDeadline = std::chrono::seconds(60);

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

class DaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = absl::StrCat(::testing::TempDir(), "kvtierd_XXXXXX");
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }

  DaemonConfig SmallConfig() const {
    DaemonConfig config;
    config.unix_socket = dir_ + "/kvtierd.sock";
    TenantConfig tenant;
    tenant.name = "t0";
    tenant.host_memory_bytes = 16u << 20;
    tenant.hugepages = "off";
    tenant.lock = false;
    config.tenants.push_back(tenant);
    config.shutdown_grace = absl::Seconds(5);
    return config;
  }

  static std::shared_ptr<grpc::Channel> Connect(const std::string& target) {
    return grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  }

  static grpc::Status Hello(const std::shared_ptr<grpc::Channel>& channel,
                            kvtier::v1::HelloReply* reply) {
    std::unique_ptr<kvtier::v1::KvTier::Stub> stub = kvtier::v1::KvTier::NewStub(channel);
    grpc::ClientContext context;
    context.AddMetadata("x-kvtier-tenant", "t0");
    context.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
    kvtier::v1::HelloRequest request;
    request.set_protocol_version(1);
    request.set_client_name("daemon_test");
    return stub->Hello(&context, request, reply);
  }

  std::string dir_;
};

std::string ToString(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

grpc::ByteBuffer ToBuffer(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// One unary call of `method` with serialized `request`; the serialized response.
grpc::Status RawUnary(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                      const std::string& request, std::string* response) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
  grpc::CompletionQueue cq;
  auto call = stub.PrepareUnaryCall(&context, method, ToBuffer(request), &cq);
  call->StartCall();
  grpc::ByteBuffer reply;
  grpc::Status status;
  call->Finish(&reply, &status, nullptr);
  void* tag = nullptr;
  bool ok = false;
  EXPECT_TRUE(cq.Next(&tag, &ok));
  if (status.ok()) *response = ToString(reply);
  return status;
}

// One request and its first response on bidirectional `method` (reflection).
grpc::Status RawBidiOnce(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                         const std::string& request, std::string* response) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(&context, method, &cq);
  void* tag = nullptr;
  bool ok = false;
  grpc::ByteBuffer reply;
  grpc::Status status;
  call->StartCall(nullptr);
  EXPECT_TRUE(cq.Next(&tag, &ok));
  call->Write(ToBuffer(request), nullptr);
  EXPECT_TRUE(cq.Next(&tag, &ok));
  call->WritesDone(nullptr);
  EXPECT_TRUE(cq.Next(&tag, &ok));
  call->Read(&reply, nullptr);
  EXPECT_TRUE(cq.Next(&tag, &ok));
  if (ok) *response = ToString(reply);
  call->Finish(&status, nullptr);
  EXPECT_TRUE(cq.Next(&tag, &ok));
  return status;
}

// grpc.health.v1.HealthCheckRequest{service} and HealthCheckResponse{status:
// SERVING}, as bytes (no health.proto is packaged).
std::string HealthRequest(const std::string& service) {
  if (service.empty()) return "";
  return absl::StrCat("\x0a", std::string(1, static_cast<char>(service.size())), service);
}
constexpr char kServing[] = "\x08\x01";

// ---- reading /metrics ---------------------------------------------------------------------------

// The daemon's /metrics text, as a scraper gets it.
std::string Scrape(const Daemon& daemon) {
  absl::StatusOr<HttpResponse> r =
      HttpGet(daemon.metrics_address(), "/metrics", absl::Seconds(60), size_t{256} << 20);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return "";
  EXPECT_EQ(r->status, 200);
  return r->body;
}

// Whether `text` is well-formed UTF-8 (no overlong forms, surrogates or code points past
// U+10FFFF), as the text format wants every label value.
bool IsUtf8(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    }
    if (c >= 0xc2 && c <= 0xdf) {
      n = 1, cp = c & 0x1f;
    } else if (c >= 0xe0 && c <= 0xef) {
      n = 2, cp = c & 0x0f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      n = 3, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n >= text.size()) return false;
    for (size_t k = 1; k <= n; ++k) {
      const auto b = static_cast<unsigned char>(text[i + k]);
      if ((b & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (b & 0x3f);
    }
    if ((n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) || cp > 0x10ffff ||
        (cp >= 0xd800 && cp <= 0xdfff)) {
      return false;
    }
    i += n + 1;
  }
  return true;
}

// The values of `label` in the samples named `sample` ("kvtier_rpcs_total"), unescaped.
std::multiset<std::string> LabelValues(const std::string& text, std::string_view sample,
                                       std::string_view label) {
  std::multiset<std::string> out;
  const std::string start = "\n" + std::string(sample) + "{";
  const std::string key = std::string(label) + "=\"";
  for (size_t at = text.find(start); at != std::string::npos; at = text.find(start, at + 1)) {
    const size_t line_end = text.find('\n', at + 1);
    const size_t k = text.find(key, at);
    if (k == std::string::npos || k > line_end) continue;
    std::string value;
    for (size_t i = k + key.size(); i < line_end && text[i] != '"'; ++i) {
      if (text[i] == '\\' && i + 1 < line_end) ++i;
      value += text[i];
    }
    out.insert(value);
  }
  return out;
}

// `promtool check metrics` accepts `text` (the parse a Prometheus scrape makes, and its lint).
// Without promtool this part is skipped, saying so, unless CI=true.
void ExpectPromtoolAccepts(const std::string& text, const std::string& dir) {
  if (std::system("command -v promtool >/dev/null 2>&1") != 0) {
    const char* ci = std::getenv("CI");
    if (ci != nullptr && std::string_view(ci) == "true") {
      ADD_FAILURE() << "promtool is not installed (Debian package prometheus; scripts/setup)";
    } else {
      std::printf("[ NOTE     ] promtool is not installed: the text is not checked with it\n");
    }
    return;
  }
  const std::string path = dir + "/metrics.txt";
  std::ofstream(path, std::ios::binary) << text;
  FILE* p = ::popen(("promtool check metrics < " + path + " 2>&1").c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string said;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), p)) > 0;) said.append(buf, n);
  const int status = ::pclose(p);
  EXPECT_EQ(status, 0) << "promtool check metrics: " << said.substr(0, 2000);
}

TEST_F(DaemonTest, ServesHelloHealthAndReflectionOnTheUnixSocket) {
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(SmallConfig());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  EXPECT_EQ((*daemon)->unix_socket(), dir_ + "/kvtierd.sock");
  EXPECT_EQ((*daemon)->attach_socket(), dir_ + "/kvtierd.sock.attach");
  EXPECT_TRUE(Exists((*daemon)->attach_socket()));
  auto channel = Connect("unix:" + (*daemon)->unix_socket());

  kvtier::v1::HelloReply hello;
  grpc::Status status = Hello(channel, &hello);
  ASSERT_TRUE(status.ok()) << status.error_code() << " " << status.error_message();
  EXPECT_EQ(hello.tenant(), "t0");
  EXPECT_TRUE(hello.shm_available());
  EXPECT_EQ(hello.attach_socket(), (*daemon)->attach_socket());

  for (const std::string service : {"", "kvtier.v1.KvTier"}) {
    std::string response;
    status = RawUnary(channel, "/grpc.health.v1.Health/Check", HealthRequest(service), &response);
    ASSERT_TRUE(status.ok()) << service << ": " << status.error_message();
    EXPECT_EQ(response, std::string(kServing)) << service;
  }

  // ServerReflectionRequest{list_services: ""} → the services, by name.
  std::string listed;
  status = RawBidiOnce(channel, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                       std::string("\x3a\x00", 2), &listed);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_THAT(listed, HasSubstr("kvtier.v1.KvTier"));
  EXPECT_THAT(listed, HasSubstr("grpc.health.v1.Health"));
}

TEST_F(DaemonTest, ShutdownRemovesTheSocketsAndWaitReturns) {
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(SmallConfig());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string unix_socket = (*daemon)->unix_socket();
  const std::string attach_socket = (*daemon)->attach_socket();
  ASSERT_TRUE(Exists(unix_socket));
  ASSERT_TRUE(Exists(attach_socket));
  std::thread waiter([&] { (*daemon)->Wait(); });
  (*daemon)->Shutdown();
  waiter.join();
  EXPECT_FALSE(Exists(unix_socket));
  EXPECT_FALSE(Exists(attach_socket));
  (*daemon)->Shutdown();  // again: returns at once
  // The path is free for the next daemon.
  absl::StatusOr<std::unique_ptr<Daemon>> next = Daemon::Start(SmallConfig());
  EXPECT_TRUE(next.ok()) << next.status();
}

TEST_F(DaemonTest, SecondDaemonOnALiveSocketIsFailedPrecondition) {
  absl::StatusOr<std::unique_ptr<Daemon>> first = Daemon::Start(SmallConfig());
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::unique_ptr<Daemon>> second = Daemon::Start(SmallConfig());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_THAT(second.status().message(), HasSubstr((*first)->unix_socket()));
  EXPECT_THAT(second.status().message(), HasSubstr("in use"));
  // The first one is untouched.
  kvtier::v1::HelloReply hello;
  EXPECT_TRUE(Hello(Connect("unix:" + (*first)->unix_socket()), &hello).ok());
}

TEST_F(DaemonTest, LiveAttachSocketIsFailedPreconditionToo) {
  DaemonConfig first_config = SmallConfig();
  absl::StatusOr<std::unique_ptr<Daemon>> first = Daemon::Start(first_config);
  ASSERT_TRUE(first.ok()) << first.status();
  DaemonConfig second_config = SmallConfig();
  second_config.unix_socket = dir_ + "/other.sock";
  second_config.attach_socket = (*first)->attach_socket();
  absl::StatusOr<std::unique_ptr<Daemon>> second = Daemon::Start(second_config);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_THAT(second.status().message(), HasSubstr("server.attach_socket"));
  EXPECT_FALSE(Exists(dir_ + "/other.sock"));
}

TEST_F(DaemonTest, StaleSocketFileIsReplaced) {
  const DaemonConfig config = SmallConfig();
  // A socket file nobody listens on, as a killed daemon leaves behind.
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  config.unix_socket.copy(addr.sun_path, sizeof(addr.sun_path) - 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
  ::close(fd);
  ASSERT_TRUE(Exists(config.unix_socket));

  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(config);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  kvtier::v1::HelloReply hello;
  grpc::Status status = Hello(Connect("unix:" + config.unix_socket), &hello);
  EXPECT_TRUE(status.ok()) << status.error_message();
}

TEST_F(DaemonTest, AFileThatIsNotASocketIsNotTouched) {
  const DaemonConfig config = SmallConfig();
  std::ofstream(config.unix_socket) << "not a socket";
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(config);
  EXPECT_EQ(daemon.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(daemon.status().message(), HasSubstr("not a socket"));
  EXPECT_TRUE(Exists(config.unix_socket));
}

TEST_F(DaemonTest, TcpOnAnyPortAndNoShm) {
  DaemonConfig config = SmallConfig();
  config.tcp_address = "127.0.0.1:0";
  config.shm = false;
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(config);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  ASSERT_GT((*daemon)->tcp_port(), 0);
  EXPECT_TRUE((*daemon)->attach_socket().empty());
  EXPECT_FALSE(Exists(config.unix_socket + ".attach"));
  kvtier::v1::HelloReply hello;
  grpc::Status status = Hello(Connect(absl::StrCat("127.0.0.1:", (*daemon)->tcp_port())), &hello);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_FALSE(hello.shm_available());
}

// ---- /metrics after calls to methods the daemon does not serve ---------------------------------

// A caller needs no credentials to send a call to any path; gRPC answers UNIMPLEMENTED. Paths
// of bytes that are not UTF-8, or with the characters the text format escapes, leave /metrics
// valid: one bad label value would fail every scrape until a restart.
TEST_F(DaemonTest, MetricsStayValidAfterCallsToPathsOfAnyBytes) {
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(SmallConfig());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto channel = Connect("unix:" + (*daemon)->unix_socket());
  kvtier::v1::HelloReply hello;
  ASSERT_TRUE(Hello(channel, &hello).ok());
  for (const std::string& path : {std::string("/bin\xff\xfe/x"), std::string("/\xc0\xaf/overlong"),
                                  std::string("/a\"quote\\back/slash\nnewline")}) {
    std::string response;
    const grpc::Status status = RawUnary(channel, path, "", &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << status.error_message();
  }
  const std::string text = Scrape(**daemon);
  ASSERT_FALSE(text.empty());
  EXPECT_TRUE(IsUtf8(text));
  ExpectPromtoolAccepts(text, dir_);
}

// Each method path the daemon does not serve used to become a `method` label value of its
// own: 19 series (the counter and the histogram) per path, forever. Calls to many distinct
// long paths leave the series as they were, but for one `method` value that counts them all.
TEST_F(DaemonTest, MethodsTheDaemonDoesNotServeShareOneLabelValue) {
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(SmallConfig());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto channel = Connect("unix:" + (*daemon)->unix_socket());
  kvtier::v1::HelloReply hello;
  ASSERT_TRUE(Hello(channel, &hello).ok());
  std::string answer;
  ASSERT_TRUE(RawUnary(channel, "/grpc.health.v1.Health/Check", "", &answer).ok());
  // Reflection: v1alpha is gRPC's synchronous service, v1 the daemon's callback one.
  for (const char* version : {"v1alpha", "v1"}) {
    const std::string method =
        absl::StrCat("/grpc.reflection.", version, ".ServerReflection/ServerReflectionInfo");
    ASSERT_TRUE(RawBidiOnce(channel, method, std::string("\x3a\x00", 2), &answer).ok()) << method;
  }
  const size_t bytes_before = Scrape(**daemon).size();
  constexpr int kCalls = 200;
  for (int i = 0; i < kCalls; ++i) {
    // 3 KB each, as in the report that took /metrics to 184 MB.
    const std::string path = absl::StrCat("/bogus.Service", i, "/", std::string(3000, 'm'));
    std::string response;
    const grpc::Status status = RawUnary(channel, path, "", &response);
    ASSERT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << status.error_message();
  }
  const std::string text = Scrape(**daemon);
  const std::multiset<std::string> methods = LabelValues(text, "kvtier_rpcs_total", "method");
  // The methods the daemon serves keep their names; every other path is "unknown".
  const std::set<std::string> expected = {
      "/kvtier.v1.KvTier/Hello", "/grpc.health.v1.Health/Check",
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
      "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", "unknown"};
  EXPECT_EQ(std::set<std::string>(methods.begin(), methods.end()), expected);
  EXPECT_EQ(LabelValues(text, "kvtier_rpc_duration_seconds_count", "method").size(),
            expected.size());
  EXPECT_NE(text.find(absl::StrCat("kvtier_rpcs_total{method=\"unknown\",code=\"UNIMPLEMENTED\"} ",
                                   kCalls, "\n")),
            std::string::npos);
  EXPECT_FALSE(absl::StrContains(text, "bogus"));
  // One method's series more than before: the counter and the histogram's 19 lines.
  EXPECT_LT(text.size(), bytes_before + 4096);
}

// metrics.max_connections_per_peer reaches the endpoint: with 1, a connection this process
// (one uid) holds leaves it no other until it closes.
TEST_F(DaemonTest, TheMetricsEndpointServesAPeerItsConfiguredConnections) {
  DaemonConfig config = SmallConfig();
  config.metrics_max_connections_per_peer = 1;
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(config);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string address = (*daemon)->metrics_address();
  ASSERT_TRUE(absl::StartsWith(address, "unix:")) << address;
  const int held = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(held, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  address.substr(5).copy(addr.sun_path, sizeof(addr.sun_path) - 1);
  ASSERT_EQ(::connect(held, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
  const absl::StatusOr<HttpResponse> refused = HttpGet(address, "/metrics", absl::Seconds(60));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  ::close(held);
  // The endpoint notices the close on its own threads.
  absl::StatusOr<HttpResponse> served;
  for (const absl::Time end = absl::Now() + absl::Seconds(20); absl::Now() < end;) {
    served = HttpGet(address, "/metrics", absl::Seconds(60));
    if (served.ok()) break;
  }
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_EQ(served->status, 200);
}

TEST_F(DaemonTest, BadConfigIsInvalidArgument) {
  DaemonConfig config = SmallConfig();
  config.tenants.clear();
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(config);
  EXPECT_EQ(daemon.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(Exists(config.unix_socket));
}

}  // namespace
}  // namespace kvtier::daemon
