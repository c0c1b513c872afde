// Test helpers: gRPC calls with raw message bytes (no generated stub, no client-side
// serialization), so tests and fuzzers can send what a hostile or broken client would, and
// hand-encoded messages of services whose .proto is not in the tree (grpc.health.v1).
//
// Thread-compatible.
#ifndef KVTIER_TESTS_CLIENT_RAW_GRPC_H_
#define KVTIER_TESTS_CLIENT_RAW_GRPC_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/status.h"

namespace kvtier::testing {

struct RawCallResult {
  grpc::Status status;
  std::vector<std::string> replies;                  // every message the server sent
  std::multimap<std::string, std::string> trailers;  // the server's trailing metadata
  size_t written = 0;                                // request messages the transport took
};

// One call of `method` ("/kvtier.v1.KvTier/Offload"): sends `requests` as its messages (one
// for a unary or server-streaming method), half-closes, reads every reply and finishes. The
// context carries the caller's metadata and deadline.
RawCallResult RawCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                      const std::vector<std::string>& requests, grpc::ClientContext& ctx);

// A channel to `target` without client-side message size limits.
std::shared_ptr<grpc::Channel> UnlimitedChannel(const std::string& target);

// grpc.health.v1.Health/Check of `service` ("" for the whole server): the serving status
// number (1 SERVING, 2 NOT_SERVING, 3 SERVICE_UNKNOWN), or -1 when the call failed.
int HealthCheck(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                absl::Duration timeout = absl::Seconds(10));

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_CLIENT_RAW_GRPC_H_
