// The kvtierd command line: its flags parsed (CLI11) into a value, and the configuration they
// select — the embedded default, read over by the --config file, overridden by the flags.
//
// Flags:
//   --config FILE            TOML read over the embedded default (deploy/kvtierd.example.toml)
//   --unix-socket PATH       server.unix_socket
//   --tcp HOST:PORT          server.tcp_address
//   --attach-socket PATH     server.attach_socket
//   --no-shm                 server.shm = false
//   --log-level LEVEL        log.level
//   --log-format text|json   log.format
//   --cpu-threads N          server.cpu_threads
//   --print-default-config   print the embedded default configuration and exit 0
//   --check-config           validate the configuration and exit: 0 when good, 2 when not
//   --version, --help
//
// Thread-compatible values and pure functions (no I/O but reading the --config file).
#ifndef KVTIER_DAEMON_CLI_H_
#define KVTIER_DAEMON_CLI_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/config.h"

namespace kvtier::daemon {

// Exit codes of kvtierd.
inline constexpr int kExitOk = 0;
inline constexpr int kExitStartupFailed = 1;  // the configuration was good; start-up was not
inline constexpr int kExitBadConfig = 2;      // bad flags or configuration

struct CommandLine {
  std::string config_file;  // empty: the embedded default only
  std::optional<std::string> unix_socket;
  std::optional<std::string> tcp_address;
  std::optional<std::string> attach_socket;
  bool no_shm = false;
  std::optional<std::string> log_level;
  std::optional<std::string> log_format;
  std::optional<int32_t> cpu_threads;
  std::optional<std::string> metrics_address;
  bool print_default_config = false;
  bool check_config = false;
  // Set when --help or --version was given: print it to stdout and exit 0.
  std::string info_text;
};

// Parses argv (argv[0] is the program). INVALID_ARGUMENT with CLI11's message (the flag and what is
// wrong) for unknown flags, missing values and values of the wrong type.
absl::StatusOr<CommandLine> ParseCommandLine(int argc, const char* const* argv);

// DefaultConfig(), read over by command_line.config_file when set, then the flag overrides;
// validated. The errors of LoadConfigFile and DaemonConfig::Validate.
absl::StatusOr<DaemonConfig> ConfigFromCommandLine(const CommandLine& command_line);

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_CLI_H_
