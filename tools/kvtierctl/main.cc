// kvtierctl: the admin command of kvtierd. Parses the flags (CLI11, whose exceptions stay in
// this file) and runs one command of commands.h.
//
// Exit codes: 0 success; 1 a refusal, a failed RPC, or (health) a daemon that is not serving,
// (drain) not drained; 2 a usage error or a daemon that cannot be reached.
#include <cstdint>
#include <iostream>
#include <string>

#include "CLI/CLI.hpp"
#include "daemon/config.h"
#include "tools/kvtierctl/commands.h"

#ifndef KVTIER_VERSION_STRING
#define KVTIER_VERSION_STRING "unknown"
#endif

namespace kvtier::ctl {
namespace {

int Run(int argc, char** argv) {
  CLI::App app("kvtierctl: inspect and administer a running kvtierd", "kvtierctl");
  app.set_version_flag("--version", "kvtierctl " KVTIER_VERSION_STRING);
  app.fallthrough();  // global flags may also follow the command
  app.require_subcommand(1);
  CtlOptions o;
  app.add_option("--socket", o.socket,
                 "kvtierd's gRPC socket: PATH, unix:PATH or host:port (default: the daemon's "
                 "runtime default, " +
                     daemon::DefaultUnixSocketPath() + ")")
      ->envname("KVTIER_SOCKET")
      ->type_name("ADDRESS");
  app.add_option("--tenant", o.tenant, "tenant the calls name (x-kvtier-tenant)")
      ->type_name("NAME")
      ->capture_default_str();
  app.add_option("--token", o.token, "the tenant's token (x-kvtier-token)")
      ->envname("KVTIER_TOKEN")
      ->type_name("TOKEN");
  app.add_option("--metrics", o.metrics,
                 "HTTP address of /metrics (unix:PATH or host:port; default: the one the "
                 "daemon advertises in Hello)")
      ->type_name("ADDRESS");
  app.add_option("--timeout-ms", o.timeout_ms, "deadline of every call, in milliseconds")
      ->check(CLI::Range(int64_t{1}, int64_t{24} * 3600 * 1000))
      ->type_name("MS")
      ->capture_default_str();
  app.add_flag("--json", o.json, "JSON output (tenants, sessions, list, stats)");

  std::string service;
  CLI::App* health =
      app.add_subcommand("health",
                         "gRPC health check: prints SERVING, NOT_SERVING, ...; exit 0 only when "
                         "SERVING, 1 when not, 2 when unreachable");
  health->add_option("--service", service, "the service to check (default: the whole server)")
      ->type_name("NAME");
  CLI::App* metrics = app.add_subcommand("metrics", "print the daemon's /metrics verbatim");
  CLI::App* tenants = app.add_subcommand(
      "tenants", "per tenant (from /metrics): quota, use, sessions, refusals, arena pages");
  std::string tenant_filter;
  CLI::App* sessions = app.add_subcommand(
      "sessions", "per session (from /metrics): steps, corrections, recall, residency, timing");
  sessions->add_option("--tenant-filter", tenant_filter, "only this tenant's sessions")
      ->type_name("TENANT");
  std::string session_id;
  CLI::App* stats = app.add_subcommand("stats", "GetStats of one session of the tenant");
  stats->add_option("SESSION", session_id, "the session id")->required();
  CLI::App* list = app.add_subcommand("list", "ListSessions of the tenant");
  uint32_t drain_ms = 30000;
  std::string admin_token;
  CLI::App* drain = app.add_subcommand(
      "drain", "stop new sessions and wait for calls in flight; exit 0 when drained");
  drain
      ->add_option("--timeout-ms-drain", drain_ms,
                   "how long the daemon waits for calls in flight, in milliseconds")
      ->type_name("MS")
      ->capture_default_str();
  drain->add_option("--admin-token", admin_token, "the daemon's server.admin_token")
      ->envname("KVTIER_ADMIN_TOKEN")
      ->type_name("TOKEN");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForVersion& e) {
    std::cout << e.what() << "\n";
    return kExitOk;
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints help, the version, or the error
    return code == 0 ? kExitOk : kExitUsage;
  }
  if (o.socket.empty()) o.socket = daemon::DefaultUnixSocketPath();
  if (absl::StatusOr<DaemonAddress> a = ParseDaemonAddress(o.socket); !a.ok()) {
    std::cerr << "kvtierctl: " << a.status().message() << "\n";
    return kExitUsage;
  }
  if (drain->parsed() && admin_token.empty()) {
    std::cerr << "kvtierctl: drain needs --admin-token (or KVTIER_ADMIN_TOKEN)\n";
    return kExitUsage;
  }
  Ctl ctl(o, std::cout, std::cerr);
  if (health->parsed()) return ctl.Health(service);
  if (metrics->parsed()) return ctl.Metrics();
  if (tenants->parsed()) return ctl.Tenants();
  if (sessions->parsed()) return ctl.Sessions(tenant_filter);
  if (stats->parsed()) return ctl.Stats(session_id);
  if (list->parsed()) return ctl.List();
  return ctl.Drain(drain_ms, admin_token);
}

}  // namespace
}  // namespace kvtier::ctl

int main(int argc, char** argv) { return kvtier::ctl::Run(argc, argv); }
