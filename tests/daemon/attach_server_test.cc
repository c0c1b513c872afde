// The shm attach handshake end to end: daemon/attach_server.h against client/shm_attach.h,
// plus raw clients that misbehave and a scripted daemon that answers badly.
#include "daemon/attach_server.h"

#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "client/shm_attach.h"
#include "core/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvtier/v1/kvtier.pb.h"
#include "offload/host_arena.h"
#include "offload/session_region.h"

namespace kvtier::daemon {
namespace {

using ::testing::HasSubstr;

constexpr size_t kArenaBytes = size_t{1} << 20;

std::unique_ptr<HostArena> MakeArena() {
  auto arena = HostArena::Create(
      {.bytes = kArenaBytes, .name = "attach-test", .hugepages = HugePages::kOff, .lock = false});
  EXPECT_TRUE(arena.ok()) << arena.status();
  return arena.ok() ? std::move(*arena) : nullptr;
}

AttachAuthorizer GrantAll(const HostArena* arena) {
  return [arena](const PeerCredentials&, std::string_view,
                 std::string_view) -> absl::StatusOr<AttachGrant> {
    return AttachGrant{.fd = arena->fd(), .arena_bytes = arena->size(), .arena_name = "t0"};
  };
}

sockaddr_un Address(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), std::min(path.size(), sizeof(addr.sun_path) - 1));
  return addr;
}

std::string LengthPrefixed(uint32_t n, const std::string& body) {
  std::string out;
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  return out + body;
}

std::string EncodedRequest(const std::string& tenant, const std::string& token) {
  v1::AttachRequest request;
  request.set_protocol_version(1);
  request.set_tenant(tenant);
  request.set_token(token);
  const std::string body = request.SerializeAsString();
  return LengthPrefixed(static_cast<uint32_t>(body.size()), body);
}

// What a raw client saw: the reply (absent when the server closed without one) and how many
// descriptors came with it.
struct RawResult {
  std::optional<v1::AttachReply> reply;
  int num_fds = 0;
};

// A blocking client socket; reads give up after a minute so that a broken server fails the
// test instead of hanging it (no test relies on that time).
int RawConnect(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const sockaddr_un addr = Address(path);
  EXPECT_EQ(connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0)
      << std::strerror(errno);
  timeval tv{.tv_sec = 60, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

// Reads `n` bytes; false when the connection ended (or broke) first.
bool RecvExactly(int fd, char* out, size_t n, int& num_fds) {
  size_t got = 0;
  while (got < n) {
    iovec iov{.iov_base = out + got, .iov_len = n - got};
    alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t r = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
    if (r <= 0) return false;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      const size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < k; ++i) {
        int one = -1;
        std::memcpy(&one, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        close(one);
        ++num_fds;
      }
    }
    got += static_cast<size_t>(r);
  }
  return true;
}

RawResult ReadReply(int fd) {
  RawResult result;
  char header[4];
  if (!RecvExactly(fd, header, 4, result.num_fds)) return result;
  uint32_t n = 0;
  for (int i = 0; i < 4; ++i) n |= uint32_t{static_cast<unsigned char>(header[i])} << (8 * i);
  std::string body(n, '\0');
  if (!RecvExactly(fd, body.data(), n, result.num_fds)) return result;
  v1::AttachReply reply;
  if (reply.ParseFromString(body)) result.reply = reply;
  return result;
}

// Sends `bytes` (then half-closes when `shut_write`) and reads whatever comes back.
RawResult RawExchange(const std::string& path, const std::string& bytes, bool shut_write) {
  const int fd = RawConnect(path);
  EXPECT_EQ(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
  if (shut_write) shutdown(fd, SHUT_WR);
  RawResult result = ReadReply(fd);
  close(fd);
  return result;
}

// True when the server closes `fd` without sending a byte.
bool ClosedWithoutReply(int fd) {
  char byte;
  return recv(fd, &byte, 1, 0) == 0;
}

class AttachServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = ::testing::TempDir() + "kvtier-attach-XXXXXX";
    ASSERT_NE(mkdtemp(templ.data()), nullptr) << std::strerror(errno);
    dir_ = templ;
    path_ = dir_ + "/attach.sock";
    arena_ = MakeArena();
    ASSERT_NE(arena_, nullptr);
  }
  void TearDown() override {
    unlink(path_.c_str());
    rmdir(dir_.c_str());
  }

  std::unique_ptr<AttachServer> StartServer(AttachAuthorizer authorize,
                                            const AttachServerOptions& options = {}) {
    auto server = AttachServer::Start(path_, std::move(authorize), options);
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? std::move(*server) : nullptr;
  }

  // The server still answers a well-behaved client.
  void ExpectServes() {
    auto attached = AttachToArena(path_, "t0", "");
    EXPECT_TRUE(attached.ok()) << attached.status();
  }

  std::string dir_;
  std::string path_;
  std::unique_ptr<HostArena> arena_;
};

TEST_F(AttachServerTest, GrantPassesAnFdThatMapsTheSameMemory) {
  auto server = StartServer(GrantAll(arena_.get()));
  ASSERT_NE(server, nullptr);
  auto attached = AttachToArena(path_, "t0", "");
  ASSERT_TRUE(attached.ok()) << attached.status();
  HostArena& client = *attached->arena;
  EXPECT_EQ(client.size(), arena_->size());
  EXPECT_EQ(attached->region_layout_version, kRegionLayoutVersion);
  EXPECT_EQ(attached->name, "t0");
  EXPECT_EQ(server->granted(), 1u);
  EXPECT_EQ(server->refused(), 0u);

  auto* daemon_bytes = static_cast<unsigned char*>(arena_->data());
  auto* client_bytes = static_cast<unsigned char*>(client.data());
  ASSERT_NE(daemon_bytes, client_bytes);  // two mappings of one file
  for (size_t i = 0; i < kArenaBytes; i += 4093) daemon_bytes[i] = static_cast<unsigned char>(i);
  for (size_t i = 0; i < kArenaBytes; i += 4093) {
    ASSERT_EQ(client_bytes[i], static_cast<unsigned char>(i)) << "offset " << i;
  }
  client_bytes[kArenaBytes - 1] = 0xA5;
  client_bytes[12345] = 0x5A;
  EXPECT_EQ(daemon_bytes[kArenaBytes - 1], 0xA5);
  EXPECT_EQ(daemon_bytes[12345], 0x5A);
}

TEST_F(AttachServerTest, AuthorizerSeesThisProcessAndTheRequest) {
  struct Seen {
    Mutex mu;
    std::optional<PeerCredentials> peer ABSL_GUARDED_BY(mu);
    std::string tenant ABSL_GUARDED_BY(mu);
    std::string token ABSL_GUARDED_BY(mu);
  } seen;
  const HostArena* arena = arena_.get();
  auto server = StartServer([&seen, arena](const PeerCredentials& peer, std::string_view tenant,
                                           std::string_view token) -> absl::StatusOr<AttachGrant> {
    MutexLock lock(&seen.mu);
    seen.peer = peer;
    seen.tenant = tenant;
    seen.token = token;
    return AttachGrant{.fd = arena->fd(), .arena_bytes = arena->size(), .arena_name = "a"};
  });
  ASSERT_NE(server, nullptr);
  ASSERT_TRUE(AttachToArena(path_, "tenant-a", "s3cret").ok());
  MutexLock lock(&seen.mu);
  ASSERT_TRUE(seen.peer.has_value());
  EXPECT_EQ(seen.peer->pid, getpid());
  EXPECT_EQ(seen.peer->uid, getuid());
  EXPECT_EQ(seen.peer->gid, getgid());
  EXPECT_EQ(seen.tenant, "tenant-a");
  EXPECT_EQ(seen.token, "s3cret");
}

class AttachRefusalTest : public AttachServerTest,
                          public ::testing::WithParamInterface<absl::Status> {};

TEST_P(AttachRefusalTest, RefusalCodeAndMessagePassThroughWithoutFd) {
  const absl::Status refusal = GetParam();
  auto server =
      StartServer([refusal](const PeerCredentials&, std::string_view,
                            std::string_view) -> absl::StatusOr<AttachGrant> { return refusal; });
  ASSERT_NE(server, nullptr);
  auto attached = AttachToArena(path_, "t0", "wrong");
  EXPECT_EQ(attached.status(), refusal);

  RawResult raw = RawExchange(path_, EncodedRequest("t0", "wrong"), false);
  ASSERT_TRUE(raw.reply.has_value());
  EXPECT_EQ(raw.reply->code(), static_cast<int>(refusal.code()));
  EXPECT_EQ(raw.reply->message(), refusal.message());
  EXPECT_EQ(raw.num_fds, 0);
  EXPECT_EQ(server->refused(), 2u);
  EXPECT_EQ(server->granted(), 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Codes, AttachRefusalTest,
    ::testing::Values(absl::PermissionDeniedError("uid 1234 may not attach to tenant t0"),
                      absl::NotFoundError("no tenant named t0"),
                      absl::UnavailableError("kvtierd is draining")));

TEST_F(AttachServerTest, OversizedLengthGetsInvalidArgumentAndServingGoesOn) {
  auto server = StartServer(GrantAll(arena_.get()), {.max_request_bytes = 256});
  ASSERT_NE(server, nullptr);
  for (uint32_t length : {257u, 0xffffffffu}) {
    RawResult raw = RawExchange(path_, LengthPrefixed(length, std::string(16, 'x')), false);
    ASSERT_TRUE(raw.reply.has_value()) << length;
    EXPECT_EQ(raw.reply->code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(raw.reply->message(), HasSubstr("max_request_bytes is 256"));
    EXPECT_EQ(raw.num_fds, 0);
  }
  ExpectServes();
}

TEST_F(AttachServerTest, GarbageGetsInvalidArgumentAndServingGoesOn) {
  auto server = StartServer(GrantAll(arena_.get()));
  ASSERT_NE(server, nullptr);
  RawResult raw = RawExchange(path_, LengthPrefixed(8, std::string(8, '\xff')), false);
  ASSERT_TRUE(raw.reply.has_value());
  EXPECT_EQ(raw.reply->code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(raw.reply->message(), HasSubstr("does not parse"));
  EXPECT_EQ(raw.num_fds, 0);
  ExpectServes();
}

TEST_F(AttachServerTest, UnsetProtocolVersionGetsInvalidArgument) {
  auto server = StartServer(GrantAll(arena_.get()));
  ASSERT_NE(server, nullptr);
  RawResult raw = RawExchange(path_, LengthPrefixed(0, ""), false);
  ASSERT_TRUE(raw.reply.has_value());
  EXPECT_EQ(raw.reply->code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(raw.reply->message(), HasSubstr("protocol_version"));
  EXPECT_EQ(raw.num_fds, 0);
  EXPECT_EQ(server->refused(), 1u);
}

TEST_F(AttachServerTest, TruncatedRequestsCloseTheConnectionAndServingGoesOn) {
  auto server = StartServer(GrantAll(arena_.get()));
  ASSERT_NE(server, nullptr);
  // The body ends early; the length prefix ends early; nothing at all.
  for (const std::string& bytes :
       {LengthPrefixed(100, std::string(10, 'x')), std::string("\x10\x00", 2), std::string()}) {
    RawResult raw = RawExchange(path_, bytes, true);
    EXPECT_FALSE(raw.reply.has_value()) << bytes.size() << " bytes";
  }
  // A client that connects and goes away at once.
  close(RawConnect(path_));
  ExpectServes();
  EXPECT_EQ(server->granted(), 1u);
}

TEST_F(AttachServerTest, ClientThatLeavesBeforeTheReplyDoesNotStopServing) {
  auto server = StartServer(GrantAll(arena_.get()));
  ASSERT_NE(server, nullptr);
  for (int i = 0; i < 8; ++i) {  // the reply meets a closed peer: EPIPE, never SIGPIPE
    const int fd = RawConnect(path_);
    const std::string request = EncodedRequest("t0", "");
    ASSERT_EQ(send(fd, request.data(), request.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(request.size()));
    close(fd);
  }
  ExpectServes();
}

TEST_F(AttachServerTest, SilentClientIsDroppedAfterTheHandshakeTimeout) {
  auto server = StartServer(GrantAll(arena_.get()), {.handshake_timeout = absl::Milliseconds(20)});
  ASSERT_NE(server, nullptr);
  const int silent = RawConnect(path_);
  EXPECT_TRUE(ClosedWithoutReply(silent));
  close(silent);
  // A client that stops half-way through its request is dropped the same way.
  const int slow = RawConnect(path_);
  ASSERT_EQ(send(slow, "\x08\x00", 2, MSG_NOSIGNAL), 2);
  EXPECT_TRUE(ClosedWithoutReply(slow));
  close(slow);
  ExpectServes();
}

TEST_F(AttachServerTest, ConnectionsBeyondThePeerLimitAreClosed) {
  auto server =
      StartServer(GrantAll(arena_.get()), {.max_connections = 8, .max_connections_per_peer = 1});
  ASSERT_NE(server, nullptr);
  const int holder = RawConnect(path_);  // accepted first, holds this process's only handshake
  const int extra = RawConnect(path_);
  EXPECT_TRUE(ClosedWithoutReply(extra));
  close(extra);
  EXPECT_GE(server->dropped(), 1u);
  close(holder);
}

// Another process holds every handshake the server allows; an attach from this process
// still gets its answer, by replacing the flooder's oldest connection.
TEST_F(AttachServerTest, AtTheGlobalLimitTheHeaviestPeerMakesRoom) {
  auto server =
      StartServer(GrantAll(arena_.get()), {.max_connections = 2, .max_connections_per_peer = 2});
  ASSERT_NE(server, nullptr);
  int ready[2], release[2];
  ASSERT_EQ(pipe2(ready, O_CLOEXEC), 0);
  ASSERT_EQ(pipe2(release, O_CLOEXEC), 0);
  const sockaddr_un addr = Address(path_);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // the flooder: only async-signal-safe calls from here on
    for (int i = 0; i < 2; ++i) {
      const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0 || connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
        _exit(1);
      }
    }
    char byte = 1;
    if (write(ready[1], &byte, 1) != 1) _exit(1);
    (void)!read(release[0], &byte, 1);  // hold the silent connections until told
    _exit(0);
  }
  char byte = 0;
  ASSERT_EQ(read(ready[0], &byte, 1), 1);
  ExpectServes();
  EXPECT_GE(server->dropped(), 1u);  // one of the flooder's connections made room
  ASSERT_EQ(write(release[1], &byte, 1), 1);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  for (int fd : {ready[0], ready[1], release[0], release[1]}) close(fd);
}

TEST_F(AttachServerTest, ProtocolVersionOutsideTheRangeIsFailedPrecondition) {
  auto server =
      StartServer(GrantAll(arena_.get()), {.min_protocol_version = 1, .max_protocol_version = 1});
  ASSERT_NE(server, nullptr);
  v1::AttachRequest request;
  request.set_protocol_version(999);
  request.set_tenant("t0");
  const std::string body = request.SerializeAsString();
  RawResult raw =
      RawExchange(path_, LengthPrefixed(static_cast<uint32_t>(body.size()), body), false);
  ASSERT_TRUE(raw.reply.has_value());
  EXPECT_EQ(raw.reply->code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(raw.reply->message(), HasSubstr("protocol_version = 999"));
  EXPECT_EQ(raw.num_fds, 0);
  EXPECT_EQ(server->granted(), 0u);
}

TEST_F(AttachServerTest, StaleSocketFileIsReplaced) {
  const int dead = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const sockaddr_un addr = Address(path_);
  ASSERT_EQ(bind(dead, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
  close(dead);  // the file stays, and nothing listens: what a crashed daemon leaves
  struct stat st {};
  ASSERT_EQ(lstat(path_.c_str(), &st), 0);
  ASSERT_TRUE(S_ISSOCK(st.st_mode));

  auto server = StartServer(GrantAll(arena_.get()));
  ASSERT_NE(server, nullptr);
  ExpectServes();
}

TEST_F(AttachServerTest, LiveSocketIsRefusedAndKeepsServing) {
  auto first = StartServer(GrantAll(arena_.get()));
  ASSERT_NE(first, nullptr);
  auto second = AttachServer::Start(path_, GrantAll(arena_.get()));
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.status().message(), HasSubstr("live"));
  ExpectServes();
  EXPECT_EQ(first->granted(), 1u);
}

TEST_F(AttachServerTest, OtherFileAtThePathIsRefusedAndKept) {
  const int file = open(path_.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
  ASSERT_GE(file, 0);
  close(file);
  auto server = AttachServer::Start(path_, GrantAll(arena_.get()));
  EXPECT_EQ(server.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(server.status().message(), HasSubstr("not a socket"));
  struct stat st {};
  ASSERT_EQ(lstat(path_.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
}

TEST_F(AttachServerTest, PathTooLongIsRefusedWithTheLimit) {
  const std::string long_path = dir_ + "/" + std::string(sizeof(sockaddr_un::sun_path), 's');
  auto server = AttachServer::Start(long_path, GrantAll(arena_.get()));
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(server.status().message(),
              HasSubstr(std::to_string(sizeof(sockaddr_un::sun_path) - 1)));
  auto attached = AttachToArena(long_path, "t0", "");
  EXPECT_EQ(attached.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(AttachServerTest, SocketHasMode0660AndStopUnlinksIt) {
  auto server = StartServer(GrantAll(arena_.get()));
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(server->path(), path_);
  struct stat st {};
  ASSERT_EQ(lstat(path_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  server->Stop();
  EXPECT_NE(lstat(path_.c_str(), &st), 0);
  EXPECT_EQ(errno, ENOENT);
  EXPECT_EQ(AttachToArena(path_, "t0", "").status().code(), absl::StatusCode::kUnavailable);
  server->Stop();  // idempotent
}

// ---- The client against a scripted daemon ---------------------------------------------------

class ScriptedDaemon {
 public:
  explicit ScriptedDaemon(const std::string& path) {
    fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const sockaddr_un addr = Address(path);
    EXPECT_EQ(bind(fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(listen(fd_, 4), 0);
  }
  ~ScriptedDaemon() {
    if (thread_.joinable()) thread_.join();
    close(fd_);
  }

  // Answers one connection with `reply`, attaching `fd` when it is >= 0.
  void AnswerOnce(v1::AttachReply reply, int fd) {
    thread_ = std::thread([this, reply = std::move(reply), fd] {
      const int conn = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      ASSERT_GE(conn, 0);
      int ignored = 0;
      char header[4];
      ASSERT_TRUE(RecvExactly(conn, header, 4, ignored));
      std::string out =
          LengthPrefixed(static_cast<uint32_t>(reply.ByteSizeLong()), reply.SerializeAsString());
      iovec iov{.iov_base = out.data(), .iov_len = out.size()};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
      if (fd >= 0) {
        msg.msg_control = control;
        msg.msg_controllen = sizeof(control);
        cmsghdr* c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
      }
      EXPECT_EQ(sendmsg(conn, &msg, MSG_NOSIGNAL), static_cast<ssize_t>(out.size()));
      close(conn);
    });
  }

 private:
  int fd_ = -1;
  std::thread thread_;
};

v1::AttachReply OkReply(uint64_t bytes, uint32_t layout_version) {
  v1::AttachReply reply;
  reply.set_code(0);
  reply.set_arena_bytes(bytes);
  reply.set_region_layout_version(layout_version);
  return reply;
}

TEST_F(AttachServerTest, ClientRefusesAGrantWithoutDescriptor) {
  ScriptedDaemon daemon(path_);
  daemon.AnswerOnce(OkReply(kArenaBytes, kRegionLayoutVersion), -1);
  auto attached = AttachToArena(path_, "t0", "");
  EXPECT_EQ(attached.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(attached.status().message(), HasSubstr("descriptor"));
}

TEST_F(AttachServerTest, ClientRefusesAnUnknownRegionLayoutVersion) {
  ScriptedDaemon daemon(path_);
  daemon.AnswerOnce(OkReply(kArenaBytes, kRegionLayoutVersion + 1), arena_->fd());
  auto attached = AttachToArena(path_, "t0", "");
  EXPECT_EQ(attached.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(attached.status().message(), HasSubstr("region_layout_version"));
}

TEST_F(AttachServerTest, ClientRefusesAGrantLargerThanTheFile) {
  ScriptedDaemon daemon(path_);
  daemon.AnswerOnce(OkReply(2 * kArenaBytes, kRegionLayoutVersion), arena_->fd());
  auto attached = AttachToArena(path_, "t0", "");
  EXPECT_EQ(attached.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(AttachServerTest, ClientGivesUpAtItsDeadline) {
  ScriptedDaemon daemon(path_);  // listens, never accepts: the connection waits in the backlog
  auto attached = AttachToArena(path_, "t0", "", absl::Milliseconds(20));
  EXPECT_EQ(attached.status().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST_F(AttachServerTest, ClientWithNothingListeningIsUnavailable) {
  auto attached = AttachToArena(path_, "t0", "");
  EXPECT_EQ(attached.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(attached.status().message(), HasSubstr(path_));
}

}  // namespace
}  // namespace kvtier::daemon
