// ParseCommandLine and ConfigFromCommandLine. CLI11 reports errors by throwing; every exception is
// caught here and becomes a Status, so none leaves this file.
#include "daemon/cli.h"

#include <string>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"

#ifndef KVTIER_VERSION_STRING
#define KVTIER_VERSION_STRING "unknown"
#endif

namespace kvtier::daemon {
namespace {

// Flag values as CLI11 fills them; each CLI::Option says whether its flag was given at all.
struct RawFlags {
  std::string unix_socket, tcp_address, attach_socket, log_level, log_format, metrics_address;
  int32_t cpu_threads = 0;
};

template <class T>
void SetIfGiven(const CLI::Option* option, const T& value, std::optional<T>* out) {
  if (option->count() > 0) *out = value;
}

}  // namespace

absl::StatusOr<CommandLine> ParseCommandLine(int argc, const char* const* argv) {
  CLI::App app("kvtierd: the kvtier KV-cache daemon (per-tenant host arenas, gRPC control)",
               "kvtierd");
  app.set_version_flag("--version", "kvtierd " KVTIER_VERSION_STRING);
  CommandLine out;
  RawFlags raw;
  app.add_option("--config", out.config_file,
                 "TOML configuration read over the embedded default (every key: "
                 "deploy/kvtierd.example.toml)")
      ->type_name("FILE");
  const CLI::Option* unix_socket =
      app.add_option("--unix-socket", raw.unix_socket, "gRPC Unix socket (server.unix_socket)")
          ->type_name("PATH");
  const CLI::Option* tcp =
      app.add_option("--tcp", raw.tcp_address, "also serve gRPC on HOST:PORT (server.tcp_address)")
          ->type_name("HOST:PORT");
  const CLI::Option* attach_socket = app.add_option("--attach-socket", raw.attach_socket,
                                                    "shm attach socket (server.attach_socket)")
                                         ->type_name("PATH");
  app.add_flag("--no-shm", out.no_shm, "do not serve the attach socket (server.shm = false)");
  const CLI::Option* log_level =
      app.add_option("--log-level", raw.log_level,
                     "trace | debug | info | warn | error | off (log.level)")
          ->type_name("LEVEL");
  const CLI::Option* log_format =
      app.add_option("--log-format", raw.log_format, "text | json (log.format)")
          ->type_name("FORMAT");
  const CLI::Option* cpu_threads =
      app.add_option("--cpu-threads", raw.cpu_threads,
                     "CPU backend threads, 0: all cores (server.cpu_threads)")
          ->type_name("N");
  const CLI::Option* metrics_address =
      app.add_option("--metrics-address", raw.metrics_address,
                     "serve GET /metrics here: auto | off | unix:/PATH | HOST:PORT "
                     "(metrics.address)")
          ->type_name("ADDRESS");
  app.add_flag("--print-default-config", out.print_default_config,
               "print the embedded default configuration and exit");
  app.add_flag("--check-config", out.check_config,
               "validate the configuration and exit (0: good, 2: bad, with the reason)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    out.info_text = app.help();
    return out;
  } catch (const CLI::CallForVersion& e) {
    out.info_text = absl::StrCat(e.what(), "\n");
    return out;
  } catch (const CLI::ParseError& e) {
    return absl::InvalidArgumentError(absl::StrCat(e.what(), " (kvtierd --help lists the flags)"));
  }
  SetIfGiven(unix_socket, raw.unix_socket, &out.unix_socket);
  SetIfGiven(tcp, raw.tcp_address, &out.tcp_address);
  SetIfGiven(attach_socket, raw.attach_socket, &out.attach_socket);
  SetIfGiven(log_level, raw.log_level, &out.log_level);
  SetIfGiven(log_format, raw.log_format, &out.log_format);
  SetIfGiven(cpu_threads, raw.cpu_threads, &out.cpu_threads);
  SetIfGiven(metrics_address, raw.metrics_address, &out.metrics_address);
  return out;
}

absl::StatusOr<DaemonConfig> ConfigFromCommandLine(const CommandLine& command_line) {
  DaemonConfig config = DefaultConfig();
  if (!command_line.config_file.empty()) {
    KVTIER_ASSIGN_OR_RETURN(config, LoadConfigFile(command_line.config_file, config));
  }
  if (command_line.unix_socket) config.unix_socket = *command_line.unix_socket;
  if (command_line.tcp_address) config.tcp_address = *command_line.tcp_address;
  if (command_line.attach_socket) config.attach_socket = *command_line.attach_socket;
  if (command_line.no_shm) config.shm = false;
  if (command_line.log_level) config.log_level = *command_line.log_level;
  if (command_line.log_format) config.log_format = *command_line.log_format;
  if (command_line.cpu_threads) config.cpu_threads = *command_line.cpu_threads;
  if (command_line.metrics_address) config.metrics_address = *command_line.metrics_address;
  KVTIER_RETURN_IF_ERROR(config.Validate());
  return config;
}

}  // namespace kvtier::daemon
