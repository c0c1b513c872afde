#include "bench/kvtierd_child.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/status.h"

namespace kvtier::bench {
namespace {

// Safety nets against a daemon that hangs, never measurements.
constexpr absl::Duration kDaemonStartTimeout = absl::Seconds(60);
constexpr absl::Duration kDaemonStopTimeout = absl::Seconds(30);

}  // namespace

absl::StatusOr<std::string> FindKvtierd(const std::string& flag) {
  if (!flag.empty()) {
    if (::access(flag.c_str(), X_OK) == 0) return flag;
    return absl::NotFoundError(absl::StrCat("--kvtierd ", flag, ": no executable kvtierd there"));
  }
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) {
    return absl::NotFoundError(
        absl::StrCat("cannot find kvtierd: this executable's path is unknown (", ec.message(),
                     "); pass --kvtierd PATH"));
  }
  std::vector<std::string> tried;
  for (const std::filesystem::path& candidate :
       {self.parent_path() / "kvtierd", self.parent_path().parent_path() / "daemon" / "kvtierd"}) {
    if (::access(candidate.c_str(), X_OK) == 0) return candidate.string();
    tried.push_back(candidate.string());
  }
  return absl::NotFoundError(absl::StrCat("no kvtierd binary at ", tried[0], " or ", tried[1],
                                          ": build the kvtierd target, or pass --kvtierd PATH"));
}

absl::StatusOr<TempDir> TempDir::Create(const std::string& prefix) {
  std::string tmpl = absl::StrCat("/tmp/", prefix, "-XXXXXX");
  if (::mkdtemp(tmpl.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp: ", std::strerror(errno)));
  }
  return TempDir(std::move(tmpl));
}

TempDir::TempDir(TempDir&& other) noexcept : path_(std::exchange(other.path_, std::string())) {}

TempDir::~TempDir() {
  std::error_code ec;
  if (!path_.empty()) std::filesystem::remove_all(path_, ec);
}

std::string KvtierdProcess::Log() const {
  std::ifstream in(log_path_);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string KvtierdProcess::LogTail() const {
  const std::string log = Log();
  return log.size() > 2000 ? "..." + log.substr(log.size() - 2000) : log;
}

absl::StatusOr<std::unique_ptr<KvtierdProcess>> KvtierdProcess::Start(const std::string& binary,
                                                                      const std::string& dir,
                                                                      const std::string& config) {
  const std::string config_path = dir + "/kvtierd.toml";
  {
    std::ofstream file(config_path);
    file << config;
    if (!file) return absl::InternalError(absl::StrCat("cannot write ", config_path));
  }
  std::vector<std::string> args = {binary, "--config", config_path};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string log_path = dir + "/kvtierd.log";
  const int log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (log_fd < 0) {
    return absl::InternalError(
        absl::StrCat("cannot create ", log_path, ": ", std::strerror(errno)));
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    // The child: only async-signal-safe calls until execv.
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(127);  // the parent died before prctl
    ::dup2(log_fd, STDOUT_FILENO);
    ::dup2(log_fd, STDERR_FILENO);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  const int fork_errno = errno;
  ::close(log_fd);
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(fork_errno)));
  std::unique_ptr<KvtierdProcess> daemon(new KvtierdProcess(pid, dir));
  KVTIER_RETURN_IF_ERROR(daemon->WaitServing());
  return daemon;
}

absl::Status KvtierdProcess::WaitServing() {
  constexpr std::string_view kServing = "kvtierd serving", kTcpPort = "tcp port ";
  const absl::Time deadline = absl::Now() + kDaemonStartTimeout;
  while (true) {
    const std::string log = Log();
    const size_t serving = log.find(kServing);
    if (serving != std::string::npos) {
      const size_t at = log.find(kTcpPort, serving);
      const size_t end =
          at == std::string::npos ? at : log.find_first_not_of("0123456789", at + kTcpPort.size());
      if (at == std::string::npos ||
          !absl::SimpleAtoi(log.substr(at + kTcpPort.size(), end - at - kTcpPort.size()),
                            &tcp_port_) ||
          tcp_port_ <= 0) {
        return absl::InternalError(
            absl::StrCat("kvtierd serves, but its log names no TCP port:\n", LogTail()));
      }
      return absl::OkStatus();
    }
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return absl::InternalError(absl::StrFormat(
          "kvtierd exited at start-up (%s %d):\n%s", WIFEXITED(status) ? "exit status" : "signal",
          WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status), LogTail()));
    }
    if (absl::Now() > deadline) {
      return absl::InternalError(absl::StrCat("kvtierd did not serve within ",
                                              absl::FormatDuration(kDaemonStartTimeout), ":\n",
                                              LogTail()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

absl::Status KvtierdProcess::Stop() {
  if (pid_ <= 0) return absl::OkStatus();
  const pid_t pid = std::exchange(pid_, -1);
  ::kill(pid, SIGTERM);
  int status = 0;
  const absl::Time deadline = absl::Now() + kDaemonStopTimeout;
  pid_t done = 0;
  while ((done = ::waitpid(pid, &status, WNOHANG)) == 0 && absl::Now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (done == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    return absl::InternalError(absl::StrCat("kvtierd did not exit within ",
                                            absl::FormatDuration(kDaemonStopTimeout),
                                            " of SIGTERM; killed:\n", LogTail()));
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(
        absl::StrFormat("kvtierd did not exit cleanly on SIGTERM (%s %d):\n%s",
                        WIFEXITED(status) ? "exit status" : "signal",
                        WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status), LogTail()));
  }
  return absl::OkStatus();
}

}  // namespace kvtier::bench
