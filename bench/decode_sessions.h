// The demo engine's link to kvtierd: makes `kvtier-bench decode --connect TARGET` open its
// host-tier modes (speculative, sync) as Sessions of a running daemon instead of private
// arenas, so the replay trace runs through the service exactly as an engine would drive it
// (SHM: the tenant arena mapped through the attach socket, the sequence in this process;
// GRPC: pages and steps over gRPC).
//
// Thread-compatible.
#ifndef KVTIER_BENCH_DECODE_SESSIONS_H_
#define KVTIER_BENCH_DECODE_SESSIONS_H_

#include <memory>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/decode_replay.h"
#include "kvtier/client.h"

namespace kvtier::bench {

class ReplaySessions {
 public:
  // Connects (Hello, capability check). The client's status passes through.
  static absl::StatusOr<std::unique_ptr<ReplaySessions>> Connect(const std::string& target,
                                                                 const ClientOptions& options,
                                                                 Transport transport,
                                                                 std::ostream& log);
  // Installs the session factory into `o` (ReplayBenchOptions::open_session).
  void Install(ReplayBenchOptions& o);
  // Closes every session opened (the replay and its sessions must be gone). Logs each.
  absl::Status CloseAll();
  const Capabilities& capabilities() const { return client_->capabilities(); }

 private:
  ReplaySessions(std::shared_ptr<Client> client, Transport transport, std::ostream& log)
      : client_(std::move(client)), transport_(transport), log_(log) {}
  std::shared_ptr<Client> client_;
  Transport transport_;
  std::ostream& log_;
  std::vector<std::string> ids_;
};

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_DECODE_SESSIONS_H_
