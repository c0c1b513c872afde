#include "tests/testutil/redis_cluster_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "core/status.h"

extern char** environ;

namespace kvtier::testing {
namespace {

constexpr absl::Duration kPoll = absl::Milliseconds(20);

using ReplyPtr = std::unique_ptr<redisReply, void (*)(void*)>;

std::string FindBinary(const std::string& name) {
  std::vector<std::string> dirs;
  if (const char* path = std::getenv("PATH")) dirs = absl::StrSplit(path, ':');
  dirs.push_back("/usr/bin");
  dirs.push_back("/usr/sbin");
  for (const std::string& d : dirs) {
    const std::string candidate = d + "/" + name;
    if (!d.empty() && ::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

bool Bindable(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

// A loopback port the kernel hands out whose cluster bus port (+10000) is free too.
absl::StatusOr<int> FreePort(const std::set<int>& taken) {
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    int port = 0;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
      port = ntohs(a.sin_port);
    }
    ::close(fd);
    if (port > 0 && port <= 55535 && !taken.contains(port) && Bindable(port + 10000)) return port;
  }
  return absl::ResourceExhaustedError("no free loopback port pair (port, port + 10000)");
}

absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv, const std::string& log_path) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, log_path.c_str(),
                                   O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
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
  const int rc = ::posix_spawn(&pid, argv[0].c_str(), &fa, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) {
    return absl::InternalError(absl::StrCat("posix_spawn ", argv[0], ": ", std::strerror(rc)));
  }
  return pid;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<ReplyPtr> Query(int port, const std::vector<std::string>& argv) {
  redisContext* ctx = redisConnectWithTimeout("127.0.0.1", port, absl::ToTimeval(absl::Seconds(5)));
  if (ctx == nullptr || ctx->err != 0) {
    const std::string why = ctx == nullptr ? "out of memory" : ctx->errstr;
    if (ctx != nullptr) redisFree(ctx);
    return absl::UnavailableError(absl::StrCat("127.0.0.1:", port, ": ", why));
  }
  redisSetTimeout(ctx, absl::ToTimeval(absl::Seconds(5)));
  std::vector<const char*> ptrs;
  std::vector<size_t> lens;
  for (const std::string& a : argv) {
    ptrs.push_back(a.data());
    lens.push_back(a.size());
  }
  void* raw = redisCommandArgv(ctx, static_cast<int>(argv.size()), ptrs.data(), lens.data());
  const std::string why = ctx->errstr;
  redisFree(ctx);
  if (raw == nullptr) return absl::UnavailableError(absl::StrCat("127.0.0.1:", port, ": ", why));
  ReplyPtr reply(static_cast<redisReply*>(raw), freeReplyObject);
  if (reply->type == REDIS_REPLY_ERROR) {
    return absl::FailedPreconditionError(
        absl::StrCat("127.0.0.1:", port, " ", argv[0], ": ", reply->str));
  }
  return reply;
}

std::string Text(const redisReply* r) {
  switch (r->type) {
    case REDIS_REPLY_INTEGER:
      return absl::StrCat(r->integer);
    case REDIS_REPLY_ARRAY: {
      std::vector<std::string> parts;
      for (size_t i = 0; i < r->elements; ++i) parts.push_back(Text(r->element[i]));
      return absl::StrJoin(parts, "\n");
    }
    case REDIS_REPLY_NIL:
      return "";
    default:
      return std::string(r->str, r->len);
  }
}

// The value of "name:value" in an INFO-style text, or "".
std::string Field(absl::string_view text, absl::string_view name) {
  for (absl::string_view line : absl::StrSplit(text, absl::ByAnyChar("\r\n"))) {
    if (absl::StartsWith(line, name) && line.size() > name.size() && line[name.size()] == ':') {
      return std::string(line.substr(name.size() + 1));
    }
  }
  return "";
}

}  // namespace

absl::StatusOr<std::unique_ptr<RedisClusterProcess>> RedisClusterProcess::Start(
    const RedisClusterProcessOptions& options) {
  const absl::Time deadline = absl::Now() + options.start_timeout;
  const std::string server = FindBinary("redis-server");
  const std::string cli = FindBinary("redis-cli");
  if (server.empty() || cli.empty()) {
    return absl::NotFoundError(
        "redis-server or redis-cli not on PATH, /usr/bin or /usr/sbin (Debian package "
        "redis-server)");
  }
  std::unique_ptr<RedisClusterProcess> c(new RedisClusterProcess());
  c->cli_ = cli;
  c->replicas_per_master_ = options.replicas_per_master;
  std::string tmpl = (std::filesystem::temp_directory_path() / "kvtier-redis-cluster-XXXXXX");
  if (::mkdtemp(tmpl.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp: ", std::strerror(errno)));
  }
  c->dir_ = tmpl;
  c->node_timeout_ms_ = options.node_timeout_ms;
  const int n = options.masters * (1 + options.replicas_per_master);
  for (int i = 0; i < n; ++i) KVTIER_RETURN_IF_ERROR(c->SpawnNode(deadline));
  std::vector<std::string> create = {cli, "--cluster", "create"};
  for (int i = 0; i < n; ++i) create.push_back(c->address(i));
  create.push_back("--cluster-replicas");
  create.push_back(absl::StrCat(options.replicas_per_master));
  create.push_back("--cluster-yes");
  const std::string cli_log = c->dir_ + "/cluster-create.log";
  KVTIER_ASSIGN_OR_RETURN(const pid_t cli_pid, Spawn(create, cli_log));
  int st = 0;
  while (::waitpid(cli_pid, &st, WNOHANG) == 0) {
    if (absl::Now() > deadline) {
      ::kill(cli_pid, SIGKILL);
      ::waitpid(cli_pid, &st, 0);
      return absl::DeadlineExceededError(
          absl::StrCat("redis-cli --cluster create: ", ReadFile(cli_log)));
    }
    absl::SleepFor(kPoll);
  }
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    return absl::InternalError(absl::StrCat("redis-cli --cluster create: ", ReadFile(cli_log)));
  }
  KVTIER_RETURN_IF_ERROR(c->WaitClusterOk(deadline - absl::Now()));
  return c;
}

absl::Status RedisClusterProcess::SpawnNode(absl::Time deadline) {
  const std::string server = FindBinary("redis-server");
  const std::set<int> taken(ports_.begin(), ports_.end());
  KVTIER_ASSIGN_OR_RETURN(const int port, FreePort(taken));
  const std::string dir = absl::StrCat(dir_, "/", port);
  std::filesystem::create_directories(dir);
  KVTIER_ASSIGN_OR_RETURN(const pid_t pid, Spawn({server,
                                                  "--port",
                                                  absl::StrCat(port),
                                                  "--cluster-enabled",
                                                  "yes",
                                                  "--cluster-config-file",
                                                  absl::StrCat("nodes-", port, ".conf"),
                                                  "--cluster-node-timeout",
                                                  absl::StrCat(node_timeout_ms_),
                                                  "--save",
                                                  "",
                                                  "--appendonly",
                                                  "no",
                                                  "--bind",
                                                  "127.0.0.1",
                                                  "--protected-mode",
                                                  "no",
                                                  "--dir",
                                                  dir,
                                                  "--daemonize",
                                                  "no"},
                                                 dir + "/redis.log"));
  ports_.push_back(port);
  pids_.push_back(pid);
  const size_t i = pids_.size() - 1;
  while (!Query(port, {"PING"}).ok()) {
    int st = 0;
    if (::waitpid(pids_[i], &st, WNOHANG) > 0) {
      pids_[i] = -1;
      return absl::InternalError(absl::StrCat("redis-server on port ", port,
                                              " exited at start-up: ",
                                              ReadFile(dir + "/redis.log")));
    }
    if (absl::Now() > deadline) return absl::DeadlineExceededError("redis-server start-up");
    absl::SleepFor(kPoll);
  }
  return absl::OkStatus();
}

absl::StatusOr<int> RedisClusterProcess::AddReplica(int master, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  KVTIER_ASSIGN_OR_RETURN(const std::string master_id, NodeId(master));
  KVTIER_RETURN_IF_ERROR(SpawnNode(deadline));
  const int node = size() - 1;
  KVTIER_RETURN_IF_ERROR(
      Command(node, {"CLUSTER", "MEET", "127.0.0.1", absl::StrCat(port(master))}).status());
  // REPLICATE is refused until the new node has heard of the master (the gossip after MEET).
  for (;;) {
    const absl::StatusOr<std::string> r = Command(node, {"CLUSTER", "REPLICATE", master_id});
    if (r.ok()) break;
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("CLUSTER REPLICATE on ", address(node), ": ", r.status().message()));
    }
    absl::SleepFor(kPoll);
  }
  // Every live node lists it in CLUSTER SLOTS (what a client loads, from any node), and it is
  // in sync with its master.
  const std::string listed = absl::StrCat("\n", port(node), "\n");
  for (;;) {
    bool everywhere = true;
    for (int i = 0; i < size() && everywhere; ++i) {
      if (!alive(i)) continue;
      const absl::StatusOr<std::string> slots = Command(i, {"CLUSTER", "SLOTS"});
      everywhere = slots.ok() && absl::StrContains(absl::StrCat("\n", *slots, "\n"), listed);
    }
    const absl::StatusOr<std::string> info = Command(master, {"INFO", "replication"});
    if (everywhere && info.ok() &&
        absl::StrContains(*info, absl::StrCat("port=", port(node), ",state=online"))) {
      break;
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(address(node), " did not become a replica of ", address(master)));
    }
    absl::SleepFor(kPoll);
  }
  KVTIER_RETURN_IF_ERROR(WaitForReplicas(deadline - absl::Now()));
  return node;
}

RedisClusterProcess::~RedisClusterProcess() {
  for (pid_t pid : pids_) {
    if (pid <= 0) continue;
    ::kill(pid, SIGKILL);
    int st = 0;
    while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
    }
  }
  std::error_code ec;
  if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
}

std::string RedisClusterProcess::address(int node) const {
  return absl::StrCat("127.0.0.1:", port(node));
}

std::vector<std::string> RedisClusterProcess::seeds() const {
  std::vector<std::string> out;
  for (int i = 0; i < size(); ++i) out.push_back(address(i));
  return out;
}

absl::StatusOr<std::string> RedisClusterProcess::Command(int node,
                                                         const std::vector<std::string>& argv) {
  KVTIER_ASSIGN_OR_RETURN(ReplyPtr reply, Query(port(node), argv));
  return Text(reply.get());
}

absl::Status RedisClusterProcess::Kill(int node) {
  pid_t& pid = pids_[static_cast<size_t>(node)];
  if (pid <= 0) return absl::FailedPreconditionError("node already killed");
  ::kill(pid, SIGKILL);
  int st = 0;
  while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  pid = -1;
  return absl::OkStatus();
}

absl::Status RedisClusterProcess::Pause(int node) {
  if (!alive(node) || ::kill(pids_[static_cast<size_t>(node)], SIGSTOP) != 0) {
    return absl::FailedPreconditionError("cannot stop node");
  }
  return absl::OkStatus();
}

absl::Status RedisClusterProcess::Resume(int node) {
  if (!alive(node) || ::kill(pids_[static_cast<size_t>(node)], SIGCONT) != 0) {
    return absl::FailedPreconditionError("cannot continue node");
  }
  return absl::OkStatus();
}

int RedisClusterProcess::IndexOfPort(int p) const {
  const auto it = std::find(ports_.begin(), ports_.end(), p);
  return it == ports_.end() ? -1 : static_cast<int>(it - ports_.begin());
}

absl::StatusOr<int> RedisClusterProcess::MasterOf(uint16_t slot) {
  absl::Status last = absl::UnavailableError("no live node");
  for (int i = 0; i < size(); ++i) {
    if (!alive(i)) continue;
    auto reply = Query(port(i), {"CLUSTER", "SLOTS"});
    if (!reply.ok()) {
      last = reply.status();
      continue;
    }
    for (size_t e = 0; e < (*reply)->elements; ++e) {
      const redisReply* r = (*reply)->element[e];
      if (r->elements >= 3 && r->element[0]->integer <= slot && slot <= r->element[1]->integer) {
        return IndexOfPort(static_cast<int>(r->element[2]->element[1]->integer));
      }
    }
    return absl::NotFoundError(absl::StrCat("slot ", slot, " is not served"));
  }
  return last;
}

absl::Status RedisClusterProcess::WaitClusterOk(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::string why;
  for (;;) {
    why.clear();
    for (int i = 0; i < size() && why.empty(); ++i) {
      if (!alive(i)) continue;
      auto info = Command(i, {"CLUSTER", "INFO"});
      if (!info.ok() || Field(*info, "cluster_state") != "ok") {
        why = absl::StrCat(address(i), " not ok");
        continue;
      }
      auto slots = Query(port(i), {"CLUSTER", "SLOTS"});
      if (!slots.ok()) {
        why = std::string(slots.status().message());
        continue;
      }
      int64_t covered = 0;
      for (size_t e = 0; e < (*slots)->elements; ++e) {
        const redisReply* r = (*slots)->element[e];
        covered += r->element[1]->integer - r->element[0]->integer + 1;
        if (static_cast<int>(r->elements) - 3 < replicas_per_master_) {
          why = absl::StrCat(address(i), " sees a range without its replicas");
        }
      }
      if (covered != 16384) why = absl::StrCat(address(i), " sees ", covered, " slots");
    }
    if (why.empty()) return absl::OkStatus();
    if (absl::Now() > deadline) return absl::DeadlineExceededError(absl::StrCat("cluster: ", why));
    absl::SleepFor(kPoll);
  }
}

absl::Status RedisClusterProcess::WaitForPromotion(int dead, uint16_t slot,
                                                   absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    bool ok = true;
    for (int i = 0; i < size() && ok; ++i) {
      if (!alive(i)) continue;
      auto info = Command(i, {"CLUSTER", "INFO"});
      ok = info.ok() && Field(*info, "cluster_state") == "ok";
    }
    if (ok) {
      auto master = MasterOf(slot);
      if (master.ok() && *master != dead && *master >= 0 && alive(*master)) {
        return absl::OkStatus();
      }
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("no replica of node ", dead, " promoted for slot ", slot));
    }
    absl::SleepFor(kPoll);
  }
}

absl::Status RedisClusterProcess::WaitForReplicas(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    std::string why;
    for (int i = 0; i < size() && why.empty(); ++i) {
      if (!alive(i)) continue;
      auto info = Command(i, {"INFO", "replication"});
      if (!info.ok()) {
        why = std::string(info.status().message());
        continue;
      }
      if (Field(*info, "role") != "master") continue;
      const std::string offset = Field(*info, "master_repl_offset");
      int slaves = 0;
      (void)absl::SimpleAtoi(Field(*info, "connected_slaves"), &slaves);
      for (int s = 0; s < slaves; ++s) {
        const std::string line = Field(*info, absl::StrCat("slave", s));
        if (!absl::StrContains(line, "state=online") ||
            !absl::StrContains(line, absl::StrCat("offset=", offset, ","))) {
          why = absl::StrCat(address(i), " replica behind: ", line, " vs ", offset);
        }
      }
    }
    if (why.empty()) return absl::OkStatus();
    if (absl::Now() > deadline) return absl::DeadlineExceededError(why);
    absl::SleepFor(kPoll);
  }
}

absl::StatusOr<std::string> RedisClusterProcess::NodeId(int node) {
  return Command(node, {"CLUSTER", "MYID"});
}

absl::Status RedisClusterProcess::BeginMigration(uint16_t slot, int from, int to) {
  KVTIER_ASSIGN_OR_RETURN(const std::string from_id, NodeId(from));
  KVTIER_ASSIGN_OR_RETURN(const std::string to_id, NodeId(to));
  const std::string s = absl::StrCat(slot);
  KVTIER_RETURN_IF_ERROR(Command(to, {"CLUSTER", "SETSLOT", s, "IMPORTING", from_id}).status());
  return Command(from, {"CLUSTER", "SETSLOT", s, "MIGRATING", to_id}).status();
}

absl::Status RedisClusterProcess::FinishMigration(uint16_t slot, int from, int to) {
  KVTIER_ASSIGN_OR_RETURN(const std::string to_id, NodeId(to));
  const std::string s = absl::StrCat(slot);
  for (;;) {
    KVTIER_ASSIGN_OR_RETURN(ReplyPtr keys,
                            Query(port(from), {"CLUSTER", "GETKEYSINSLOT", s, "100"}));
    if (keys->elements == 0) break;
    std::vector<std::string> migrate = {"MIGRATE", "127.0.0.1", absl::StrCat(port(to)), "", "0",
                                        "5000",    "KEYS"};
    for (size_t i = 0; i < keys->elements; ++i) {
      migrate.emplace_back(keys->element[i]->str, keys->element[i]->len);
    }
    KVTIER_RETURN_IF_ERROR(Query(port(from), migrate).status());
  }
  KVTIER_RETURN_IF_ERROR(Command(to, {"CLUSTER", "SETSLOT", s, "NODE", to_id}).status());
  KVTIER_RETURN_IF_ERROR(Command(from, {"CLUSTER", "SETSLOT", s, "NODE", to_id}).status());
  for (int i = 0; i < size(); ++i) {
    if (i == from || i == to || !alive(i)) continue;
    auto info = Command(i, {"INFO", "replication"});
    if (info.ok() && Field(*info, "role") == "master") {
      KVTIER_RETURN_IF_ERROR(Command(i, {"CLUSTER", "SETSLOT", s, "NODE", to_id}).status());
    }
  }
  return absl::OkStatus();
}

}  // namespace kvtier::testing
