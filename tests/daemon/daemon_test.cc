// Daemon in-process: serves kvtier.v1 (Hello), the standard health service and reflection on its
// Unix socket (and TCP when asked), shuts down removing its sockets, refuses a socket path a live
// daemon holds, and replaces a stale one.
#include "daemon/daemon.h"

#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
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

TEST_F(DaemonTest, BadConfigIsInvalidArgument) {
  DaemonConfig config = SmallConfig();
  config.tenants.clear();
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(config);
  EXPECT_EQ(daemon.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(Exists(config.unix_socket));
}

}  // namespace
}  // namespace kvtier::daemon
