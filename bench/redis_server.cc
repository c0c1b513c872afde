#include "bench/redis_server.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/resp_client.h"

extern char** environ;

namespace kvtier::bench {
namespace {

std::string FindBinary(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  std::vector<std::string> dirs;
  if (const char* path = std::getenv("PATH")) {
    std::string p(path);
    size_t start = 0;
    while (start <= p.size()) {
      const size_t end = p.find(':', start);
      dirs.push_back(p.substr(start, end == std::string::npos ? std::string::npos : end - start));
      if (end == std::string::npos) break;
      start = end + 1;
    }
  }
  dirs.push_back("/usr/bin");
  dirs.push_back("/usr/sbin");
  for (const std::string& d : dirs) {
    const std::string candidate = d + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

std::string VersionOf(const std::string& binary) {
  const std::string cmd = binary + " --version 2>/dev/null";
  FILE* f = ::popen(cmd.c_str(), "r");
  if (f == nullptr) return "";
  std::array<char, 256> line{};
  std::string out = std::fgets(line.data(), line.size(), f) ? line.data() : "";
  ::pclose(f);
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<RedisServer>> RedisServer::Start(const std::string& binary,
                                                                 absl::Duration timeout) {
  const std::string path = FindBinary(binary);
  if (path.empty()) {
    return absl::NotFoundError(absl::StrCat("no ", binary,
                                            " on PATH, /usr/bin or /usr/sbin (Debian package "
                                            "redis-server)"));
  }
  char tmpl[] = "/tmp/kvtier-redis-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp: ", strerror(errno)));
  }
  const std::string dir = tmpl;
  const std::string socket = dir + "/redis.sock";
  std::vector<std::string> args = {path,           "--port",       "0",  "--unixsocket", socket,
                                   "--save",       "",             "--appendonly", "no",
                                   "--dir",        dir,            "--daemonize",  "no",
                                   "--loglevel",   "warning",      "--logfile",    dir + "/redis.log"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int rc = ::posix_spawn(&pid, path.c_str(), nullptr, nullptr, argv.data(), environ);
  if (rc != 0) {
    std::filesystem::remove_all(dir);
    return absl::InternalError(absl::StrCat("spawn ", path, ": ", strerror(rc)));
  }
  std::unique_ptr<RedisServer> server(new RedisServer(pid, dir, socket));
  server->version_ = VersionOf(path);
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    auto client = RespClient::ConnectUnix(socket);
    if (client.ok() && (*client)->Ping().ok()) return server;
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      server->pid_ = -1;
      return absl::InternalError(
          absl::StrCat(path, " exited at start-up (status ", status, "); see ", dir, "/redis.log"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::DeadlineExceededError(
      absl::StrCat(path, " did not answer PING within ", absl::FormatDuration(timeout)));
}

RedisServer::~RedisServer() {
  if (pid_ > 0) {
    ::kill(pid_, SIGTERM);
    int status = 0;
    for (int i = 0; i < 200 && ::waitpid(pid_, &status, WNOHANG) == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (::waitpid(pid_, &status, WNOHANG) == 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

}  // namespace kvtier::bench
