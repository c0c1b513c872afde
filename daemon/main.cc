// kvtierd: parse the flags (daemon/cli.h), build and check the configuration, set up logs, start
// the Daemon, wait for SIGTERM or SIGINT, shut down gracefully.
//
// Exit codes: 0 after a clean shutdown (or --help, --version, --print-default-config, a good
// --check-config); 2 for bad flags or configuration; 1 when start-up fails (the message says
// what to fix, e.g. a socket path in use).
#include <signal.h>

#include <cstdio>
#include <string>

#include "absl/status/status.h"
#include "daemon/cli.h"
#include "daemon/config.h"
#include "daemon/daemon.h"
#include "daemon/logging.h"
#include "spdlog/spdlog.h"

namespace kvtier::daemon {
namespace {

int Fail(int code, std::string_view what, const absl::Status& status) {
  std::fprintf(stderr, "kvtierd: %.*s: %s\n", static_cast<int>(what.size()), what.data(),
               std::string(status.message()).c_str());
  return code;
}

// Blocks `signals` in this thread, so every thread started later inherits the mask and only
// sigwait() sees them.
sigset_t BlockShutdownSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}

int Run(int argc, char** argv) {
  absl::StatusOr<CommandLine> flags = ParseCommandLine(argc, argv);
  if (!flags.ok()) return Fail(kExitBadConfig, "bad flags", flags.status());
  if (!flags->info_text.empty()) {
    std::fputs(flags->info_text.c_str(), stdout);
    return kExitOk;
  }
  if (flags->print_default_config) {
    const std::string_view text = DefaultConfigToml();
    std::fwrite(text.data(), 1, text.size(), stdout);
    return kExitOk;
  }
  absl::StatusOr<DaemonConfig> config = ConfigFromCommandLine(*flags);
  if (!config.ok()) return Fail(kExitBadConfig, "bad configuration", config.status());
  if (flags->check_config) {
    std::printf("kvtierd: configuration OK (%zu tenants)\n", config->tenants.size());
    return kExitOk;
  }
  if (absl::Status logging = SetUpLogging(*config); !logging.ok()) {
    return Fail(kExitStartupFailed, "cannot set up logging", logging);
  }
  const sigset_t signals = BlockShutdownSignals();
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(*std::move(config));
  if (!daemon.ok()) {
    spdlog::error("start-up failed: {}", std::string(daemon.status().message()));
    return Fail(kExitStartupFailed, "start-up failed", daemon.status());
  }
  int signal_number = 0;
  while (sigwait(&signals, &signal_number) != 0) {
  }
  spdlog::info("received {}, shutting down", signal_number == SIGTERM ? "SIGTERM" : "SIGINT");
  (*daemon)->Shutdown();
  daemon->reset();
  spdlog::info("kvtierd exiting");
  spdlog::shutdown();
  return kExitOk;
}

}  // namespace
}  // namespace kvtier::daemon

int main(int argc, char** argv) { return kvtier::daemon::Run(argc, argv); }
