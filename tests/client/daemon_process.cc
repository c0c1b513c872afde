#include "tests/client/daemon_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "gtest/gtest.h"
#include "kvtier/v1/kvtier.grpc.pb.h"

extern char** environ;

namespace kvtier::testing {
namespace {

absl::Status Errno(std::string_view what) {
  return absl::InternalError(absl::StrFormat("%s: %s", what, std::strerror(errno)));
}

int TimeoutMs(absl::Duration d) {
  if (d <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(d) + 1, INT32_MAX));
}

// Waits until `fd` is readable or `timeout` passes; false on timeout.
absl::StatusOr<bool> PollReadable(int fd, absl::Duration timeout) {
  pollfd p{fd, POLLIN, 0};
  for (;;) {
    const int n = poll(&p, 1, TimeoutMs(timeout));
    if (n >= 0) return n > 0;
    if (errno != EINTR) return Errno("poll");
  }
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::string DaemonConfigToml(const DaemonProcessOptions& o) {
  std::string t = "[server]\n";
  absl::StrAppend(&t, "admin_token = \"", o.admin_token, "\"\n");
  absl::StrAppend(&t, "cpu_threads = ", o.cpu_threads, "\n");
  if (o.max_message_bytes != 0) {
    absl::StrAppend(&t, "max_message_bytes = ", o.max_message_bytes, "\n");
  }
  absl::StrAppend(&t, o.server_toml);
  absl::StrAppend(&t, "\n[log]\nlevel = \"info\"\n\n", o.extra_toml, "\n");
  for (const DaemonTenant& tenant : o.tenants) {
    absl::StrAppend(&t, "[[tenant]]\nname = \"", tenant.name, "\"\ntoken = \"", tenant.token,
                    "\"\nhost_memory_bytes = ", tenant.host_memory_bytes,
                    "\nhugepages = \"off\"\nlock = false\n", o.tenant_toml, "\n");
  }
  return t;
}

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Spawn(const std::vector<std::string>& argv,
                                                              const std::string& log_path) {
  if (argv.empty()) return absl::InvalidArgumentError("Spawn: argv is empty");
  int pipefd[2] = {-1, -1};
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (log_path.empty()) {
    if (pipe2(pipefd, O_CLOEXEC) != 0) return Errno("pipe2");
    posix_spawn_file_actions_adddup2(&fa, pipefd[1], STDOUT_FILENO);
  } else {
    posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, log_path.c_str(),
                                     O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
  }
  // The child starts with default dispositions and nothing blocked, whatever this thread has.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, argv[0].c_str(), &fa, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  if (pipefd[1] >= 0) close(pipefd[1]);
  if (rc != 0) {
    if (pipefd[0] >= 0) close(pipefd[0]);
    return absl::InternalError(absl::StrFormat("posix_spawn %s: %s", argv[0], std::strerror(rc)));
  }
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  return std::unique_ptr<Subprocess>(new Subprocess(pid, pidfd, pipefd[0]));
}

Subprocess::~Subprocess() {
  if (!reaped_) {
    kill(pid_, SIGKILL);
    int st = 0;
    while (waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
    }
  }
  if (pidfd_ >= 0) close(pidfd_);
  if (out_fd_ >= 0) close(out_fd_);
}

absl::StatusOr<std::string> Subprocess::ReadLine(absl::Duration timeout) {
  if (out_fd_ < 0) return absl::FailedPreconditionError("ReadLine: stdout goes to a log file");
  const absl::Time end = absl::Now() + timeout;
  for (;;) {
    if (const size_t nl = buffered_.find('\n'); nl != std::string::npos) {
      std::string line = buffered_.substr(0, nl);
      buffered_.erase(0, nl + 1);
      return line;
    }
    KVTIER_ASSIGN_OR_RETURN(const bool readable, PollReadable(out_fd_, end - absl::Now()));
    if (!readable) {
      return absl::DeadlineExceededError(
          absl::StrFormat("no line from pid %d within %s", pid_, absl::FormatDuration(timeout)));
    }
    char buf[4096];
    const ssize_t n = read(out_fd_, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno("read");
    if (n == 0) return absl::OutOfRangeError(absl::StrFormat("pid %d closed its stdout", pid_));
    buffered_.append(buf, static_cast<size_t>(n));
  }
}

absl::StatusOr<int> Subprocess::Wait(absl::Duration timeout) {
  if (reaped_) return wait_status_;
  if (pidfd_ >= 0) {
    KVTIER_ASSIGN_OR_RETURN(const bool exited, PollReadable(pidfd_, timeout));
    if (!exited) {
      return absl::DeadlineExceededError(
          absl::StrFormat("pid %d did not exit within %s", pid_, absl::FormatDuration(timeout)));
    }
  }
  int st = 0;
  pid_t r;
  while ((r = waitpid(pid_, &st, 0)) < 0 && errno == EINTR) {
  }
  if (r < 0) return Errno("waitpid");
  reaped_ = true;
  wait_status_ = st;
  return st;
}

absl::StatusOr<int> Subprocess::Stop(int signal, absl::Duration timeout) {
  if (!reaped_ && kill(pid_, signal) != 0 && errno != ESRCH) return Errno("kill");
  return Wait(timeout);
}

bool Subprocess::Running() {
  if (reaped_) return false;
  int st = 0;
  if (waitpid(pid_, &st, WNOHANG) == pid_) {
    reaped_ = true;
    wait_status_ = st;
    return false;
  }
  return true;
}

absl::StatusOr<std::unique_ptr<DaemonProcess>> DaemonProcess::Start(
    const DaemonProcessOptions& options) {
  std::unique_ptr<DaemonProcess> d(new DaemonProcess());
  std::string templ = ::testing::TempDir() + "kvtierd-XXXXXX";
  if (mkdtemp(templ.data()) == nullptr) return Errno("mkdtemp");
  d->dir_ = templ;
  d->socket_path_ = d->dir_ + "/kvtierd.sock";
  d->attach_path_ = d->dir_ + "/attach.sock";
  d->config_path_ = d->dir_ + "/kvtierd.toml";
  d->log_path_ = d->dir_ + "/kvtierd.log";
  {
    std::ofstream cfg(d->config_path_);
    cfg << DaemonConfigToml(options);
    if (!cfg.good()) return absl::InternalError("writing " + d->config_path_);
  }
  KVTIER_ASSIGN_OR_RETURN(
      d->process_,
      Subprocess::Spawn({options.kvtierd_path, "--config", d->config_path_, "--unix-socket",
                         d->socket_path_, "--attach-socket", d->attach_path_},
                        d->log_path_));
  KVTIER_RETURN_IF_ERROR(d->WaitReady(options));
  return d;
}

absl::Status DaemonProcess::WaitReady(const DaemonProcessOptions& options) {
  grpc::ChannelArguments args;
  // Reconnect quickly while the socket does not exist yet.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 20);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 20);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 200);
  auto channel =
      grpc::CreateCustomChannel("unix:" + socket_path_, grpc::InsecureChannelCredentials(), args);
  auto stub = v1::KvTier::NewStub(channel);
  const absl::Time end = absl::Now() + options.start_timeout;
  while (absl::Now() < end) {
    if (!process_->Running()) {
      return absl::UnavailableError(
          absl::StrCat("kvtierd exited during start-up; its log:\n", Log()));
    }
    grpc::ClientContext ctx;
    ctx.set_wait_for_ready(true);
    ctx.set_deadline(absl::ToChronoTime(std::min(end, absl::Now() + absl::Milliseconds(500))));
    if (!options.tenants.empty()) {
      ctx.AddMetadata("x-kvtier-tenant", options.tenants[0].name);
      if (!options.tenants[0].token.empty()) {
        ctx.AddMetadata("x-kvtier-token", options.tenants[0].token);
      }
    }
    v1::HelloRequest req;
    req.set_protocol_version(1);
    req.set_client_name("daemon_process");
    v1::HelloReply reply;
    const grpc::Status st = stub->Hello(&ctx, req, &reply);
    if (st.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED &&
        st.error_code() != grpc::StatusCode::UNAVAILABLE) {
      return absl::OkStatus();  // the daemon answered (even a refusal is an answer)
    }
  }
  return absl::DeadlineExceededError(absl::StrCat("kvtierd did not answer Hello within ",
                                                  absl::FormatDuration(options.start_timeout),
                                                  "; its log:\n", Log()));
}

DaemonProcess::~DaemonProcess() {
  process_.reset();  // SIGKILL when still running
  std::error_code ec;
  if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
}

absl::StatusOr<int> DaemonProcess::Stop(int signal, absl::Duration timeout) {
  return process_->Stop(signal, timeout);
}

std::string DaemonProcess::Log() const { return ReadFile(log_path_); }

}  // namespace kvtier::testing
