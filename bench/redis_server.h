// A private redis-server for the peer baseline of `kvtier-bench ipc`: started as a child
// process on a Unix socket in a temporary directory, with persistence off (no RDB, no AOF),
// and stopped (SIGTERM, then SIGKILL) when the object is destroyed.
//
// Thread-compatible.
#ifndef KVTIER_BENCH_REDIS_SERVER_H_
#define KVTIER_BENCH_REDIS_SERVER_H_

#include <sys/types.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvtier::bench {

class RedisServer {
 public:
  // Starts `binary` (looked up on PATH, then /usr/bin and /usr/sbin) and waits until it
  // answers PING. NOT_FOUND when there is no redis-server (Debian: apt-get install
  // redis-server); DEADLINE_EXCEEDED when it does not answer within `timeout`.
  static absl::StatusOr<std::unique_ptr<RedisServer>> Start(
      const std::string& binary = "redis-server", absl::Duration timeout = absl::Seconds(10));
  ~RedisServer();
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;

  const std::string& socket_path() const { return socket_; }
  const std::string& version() const { return version_; }

 private:
  RedisServer(pid_t pid, std::string dir, std::string socket)
      : pid_(pid), dir_(std::move(dir)), socket_(std::move(socket)) {}
  pid_t pid_;
  std::string dir_;
  std::string socket_;
  std::string version_;
};

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_REDIS_SERVER_H_
