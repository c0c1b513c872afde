// kvtierd as a child process of a benchmark (`kvtier-bench ipc`, its /metrics section
// included): the binary this build made, found beside kvtier-bench, started on a private
// directory and configuration, stopped at the end.
//
// Not thread-safe; each object belongs to the thread that made it. Start the daemon before
// the benchmark starts threads of its own (gRPC's, a scraper's): it is forked, and the child
// only execs.
#ifndef KVTIER_BENCH_KVTIERD_CHILD_H_
#define KVTIER_BENCH_KVTIERD_CHILD_H_

#include <sys/types.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvtier::bench {

// The kvtierd binary: `flag` when given (NOT_FOUND naming it when it is not executable);
// else kvtierd next to this executable (installed side by side) or daemon/kvtierd of the
// build tree this executable's bench/ is in (NOT_FOUND naming both when neither is there).
absl::StatusOr<std::string> FindKvtierd(const std::string& flag);

// A private temporary directory, /tmp/<prefix>-XXXXXX, removed with everything in it when
// destroyed. Move-only.
class TempDir {
 public:
  // INTERNAL when mkdtemp fails.
  static absl::StatusOr<TempDir> Create(const std::string& prefix);
  TempDir(TempDir&& other) noexcept;
  TempDir& operator=(TempDir&&) = delete;
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  explicit TempDir(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

// kvtierd as a child process, on a configuration file and with its log (stdout and stderr)
// in `dir`: ready once the log says it serves, stopped with SIGTERM (SIGKILL after a safety
// timeout) by Stop() or the destructor. It gets SIGTERM too when this process dies first, so
// a crashed benchmark leaves no daemon behind.
class KvtierdProcess {
 public:
  // Writes `config` (TOML; its unix_socket must be `dir`/kvtierd.sock, its tcp_address set)
  // to `dir`/kvtierd.toml and starts `binary` on it. INTERNAL with the tail of the daemon's
  // log when it exits or stays silent at start-up, or serves without a TCP port.
  static absl::StatusOr<std::unique_ptr<KvtierdProcess>> Start(const std::string& binary,
                                                               const std::string& dir,
                                                               const std::string& config);
  ~KvtierdProcess() { (void)Stop(); }
  KvtierdProcess(const KvtierdProcess&) = delete;
  KvtierdProcess& operator=(const KvtierdProcess&) = delete;

  // Stops the daemon; INTERNAL when it did not exit 0 on SIGTERM (with its log's tail).
  // Idempotent.
  absl::Status Stop();
  const std::string& unix_socket() const { return unix_socket_; }
  int tcp_port() const { return tcp_port_; }
  pid_t pid() const { return pid_; }
  // The last ~2000 bytes of the daemon's log.
  std::string LogTail() const;

 private:
  KvtierdProcess(pid_t pid, const std::string& dir)
      : pid_(pid), log_path_(dir + "/kvtierd.log"), unix_socket_(dir + "/kvtierd.sock") {}
  std::string Log() const;
  // Waits for "kvtierd serving ... tcp port N" in the log (the daemon's last start-up line).
  absl::Status WaitServing();

  pid_t pid_;
  std::string log_path_;
  std::string unix_socket_;
  int tcp_port_ = 0;
};

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_KVTIERD_CHILD_H_
