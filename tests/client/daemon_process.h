// Test helpers: the real kvtierd as a subprocess (config written to a private temporary
// directory, sockets in it, stderr to a log file), and other subprocesses with a pipe on their
// stdout. Used by the service integration test, and reusable by benchmarks and the Python
// client's tests.
//
// Waiting is event-driven and bounded: readiness is a gRPC Hello that waits for the channel
// to connect; exits are observed through a pidfd. Nothing sleeps.
//
// Thread-compatible.
#ifndef KVTIER_TESTS_CLIENT_DAEMON_PROCESS_H_
#define KVTIER_TESTS_CLIENT_DAEMON_PROCESS_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvtier::testing {

struct DaemonTenant {
  std::string name;
  std::string token;
  uint64_t host_memory_bytes = uint64_t{64} << 20;
};

struct DaemonProcessOptions {
  std::string kvtierd_path;  // the binary (tests get it from a compile definition)
  std::vector<DaemonTenant> tenants;
  std::string admin_token;
  int cpu_threads = 0;             // [server] cpu_threads: the GRPC sessions' CPU backend
  uint64_t max_message_bytes = 0;  // 0: the daemon's default
  // TOML lines added to the [server] table (e.g. "work_threads = 1\n").
  std::string server_toml;
  // TOML lines added to every [[tenant]] table (e.g. "cold_quota_bytes = 1\n").
  std::string tenant_toml;
  // TOML appended verbatim (e.g. a [limits] table).
  std::string extra_toml;
  absl::Duration start_timeout = absl::Seconds(60);
};

// The TOML kvtierd reads for `options` (hugepages off, no locking: test machines).
std::string DaemonConfigToml(const DaemonProcessOptions& options);

// A running process started with posix_spawn; killed (SIGKILL) and reaped when destroyed.
class Subprocess {
 public:
  // Runs argv[0] with `argv`; stdout goes to a pipe (read with ReadLine) unless `log_path`
  // is set, in which case stdout and stderr are appended to that file.
  static absl::StatusOr<std::unique_ptr<Subprocess>> Spawn(const std::vector<std::string>& argv,
                                                           const std::string& log_path = "");
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  ~Subprocess();

  pid_t pid() const { return pid_; }
  // One line of the child's stdout (without the newline); DEADLINE_EXCEEDED after
  // `timeout`, OUT_OF_RANGE at end of file.
  absl::StatusOr<std::string> ReadLine(absl::Duration timeout);
  // Sends `signal` and waits for the exit: the wait status (WIFEXITED, ...).
  // DEADLINE_EXCEEDED when it has not exited within `timeout`.
  absl::StatusOr<int> Stop(int signal, absl::Duration timeout);
  // Waits for an exit without signalling.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  // True while the process has not exited (reaps it when it has).
  bool Running();

 private:
  Subprocess(pid_t pid, int pidfd, int out_fd) : pid_(pid), pidfd_(pidfd), out_fd_(out_fd) {}

  pid_t pid_;
  int pidfd_;   // -1 when pidfd_open is unavailable
  int out_fd_;  // -1 without a pipe
  bool reaped_ = false;
  int wait_status_ = 0;
  std::string buffered_;
};

class DaemonProcess {
 public:
  // Writes the config, starts kvtierd with --config, --unix-socket and --attach-socket in a
  // new temporary directory, and waits until Hello answers. The log is in the error when
  // the daemon exits or does not answer within start_timeout.
  static absl::StatusOr<std::unique_ptr<DaemonProcess>> Start(const DaemonProcessOptions& options);
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;
  // Kills the daemon if it still runs and removes the directory.
  ~DaemonProcess();

  const std::string& dir() const { return dir_; }
  const std::string& socket_path() const { return socket_path_; }
  const std::string& attach_path() const { return attach_path_; }
  std::string target() const { return "unix://" + socket_path_; }
  pid_t pid() const { return process_->pid(); }
  Subprocess& process() { return *process_; }
  // SIGTERM (by default) and wait: the wait status.
  absl::StatusOr<int> Stop(int signal, absl::Duration timeout = absl::Seconds(60));
  // The daemon's stdout and stderr so far.
  std::string Log() const;

 private:
  DaemonProcess() = default;
  absl::Status WaitReady(const DaemonProcessOptions& options);

  std::string dir_, socket_path_, attach_path_, config_path_, log_path_;
  std::unique_ptr<Subprocess> process_;
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_CLIENT_DAEMON_PROCESS_H_
